"""Real-format loaders (the implementations live in `vitscope.data.formats`, one module per format).

    from vitscope.data.loaders import ImageFolder
    ds = ImageFolder("train", "imagenet50_classes.txt", per_class=100)     # the ImageNet-50 subset
    for batch in ds.batches(32, vm.preprocessing): ...
    ds.skipped                                                             # [(path, reason), ...]
"""

from vitscope.data.formats import (
    IMAGE_EXTENSIONS,
    Cifar,
    CocoInstances,
    Davis,
    FileDataset,
    ImageFolder,
    PartImageNet,
    RevisitedRetrieval,
    SkippedImagesWarning,
    SPair71k,
    Unreadable,
    read_class_list,
)

__all__ = ["IMAGE_EXTENSIONS", "Cifar", "CocoInstances", "Davis", "FileDataset", "ImageFolder", "PartImageNet",
           "RevisitedRetrieval", "SPair71k", "SkippedImagesWarning", "Unreadable", "read_class_list"]
