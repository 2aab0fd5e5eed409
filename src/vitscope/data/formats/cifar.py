"""CIFAR-10 / CIFAR-100 from the python-format files, read by torchvision's own classes.

The files (``cifar-10-batches-py/`` or ``cifar-100-python/`` under ``root``) must be present: nothing
is downloaded. torchvision checks their md5 sums; ``verify=False`` (default) only checks that they are
there, so re-packed or subset copies load too. The JPEG copy in ImageFolder layout is read by
`vitscope.data.formats.imagefolder.ImageFolder`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitscope.data.base import Sample
from vitscope.data.formats.common import FileDataset
from vitscope.errors import InputError


def _torchvision_class(which: int, verify: bool) -> type:
    from torchvision.datasets import CIFAR10, CIFAR100

    base = CIFAR10 if which == 10 else CIFAR100
    if verify:
        return base
    return type(f"Unverified{base.__name__}", (base,), {
        "train_list": [[f, None] for f, _ in base.train_list],
        "test_list": [[f, None] for f, _ in base.test_list],
        "meta": {**base.meta, "md5": None},
    })


class Cifar(FileDataset):
    """CIFAR-``which`` (10 or 100), the ``train`` or test split, images (32, 32, 3) uint8 in memory."""

    def __init__(self, root: str | Path, train: bool = False, which: int = 10, verify: bool = False,
                 name: str | None = None):
        super().__init__()
        if which not in (10, 100):
            raise InputError(f"CIFAR comes as 10 or 100 classes; got which={which}")
        root = Path(root)
        cls = _torchvision_class(which, verify)
        folder = root / cls.base_folder
        if not folder.is_dir() and root.name == cls.base_folder:  # given the batches folder itself
            root, folder = root.parent, root
        needed = [f for f, _ in (cls.train_list if train else cls.test_list)] + [cls.meta["filename"]]
        absent = [f for f in needed if not (folder / f).is_file()]
        if absent:
            raise InputError(f"expected the CIFAR-{which} python files {', '.join(needed)} in {str(folder)!r}; "
                             f"missing: {', '.join(absent)} (torchvision.datasets.CIFAR{which}(root, "
                             "download=True) fetches them)")
        try:
            ds = cls(str(root), train=train, download=False)
        except RuntimeError as e:
            raise InputError(f"CIFAR-{which} files in {str(folder)!r} did not load: {e}") from e
        self.name = name or f"cifar{which}-{'train' if train else 'test'}"
        self.classes = list(ds.classes)
        self.data: np.ndarray = ds.data
        self.targets = [int(t) for t in ds.targets]
        if len(self.data) == 0:
            raise InputError(f"the CIFAR-{which} files in {str(folder)!r} hold no images")

    def __len__(self) -> int:
        return len(self.data)

    def load(self, i: int) -> Sample:
        return Sample(image=self.data[i], label=self.targets[i], index=i)
