"""CIFAR-10 / CIFAR-100 from the python-format files, laid out as torchvision's classes expect them.

The files (``cifar-10-batches-py/`` or ``cifar-100-python/`` under ``root``) must be present: nothing
is downloaded. ``verify=True`` checks their md5 sums against torchvision's list; ``verify=False`` (default)
only checks that they are there, so re-packed or subset copies load too. The pickles are read with
`vitscope.data.formats.common.load_data_pickle` (arrays and builtin containers only, so a file cannot
run code), not with torchvision's unrestricted ``pickle.load``. The JPEG copy in ImageFolder layout is read by
`vitscope.data.formats.imagefolder.ImageFolder`.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from vitscope.data.base import Sample
from vitscope.data.formats.common import FileDataset, load_data_pickle
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


def _read(folder: Path, cls: type, train: bool, verify: bool) -> tuple[np.ndarray, list[int], list[str]]:
    """What torchvision's CIFAR10.__init__ reads (same files, same order, same md5 check), unpickled as data."""
    from torchvision.datasets.utils import check_integrity

    files = (cls.train_list if train else cls.test_list) + [[cls.meta["filename"], cls.meta["md5"]]]
    if verify and not all(check_integrity(str(folder / f), md5) for f, md5 in files):
        raise RuntimeError("Dataset not found or corrupted (md5 sums differ from the release's)")
    data, targets = [], []
    for f, _ in files[:-1]:
        entry = load_data_pickle(folder / f, encoding="latin1")
        data.append(np.asarray(entry["data"], dtype=np.uint8))
        targets.extend(int(t) for t in (entry["labels"] if "labels" in entry else entry["fine_labels"]))
    images = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
    classes = [str(c) for c in load_data_pickle(folder / files[-1][0], encoding="latin1")[cls.meta["key"]]]
    return images, targets, classes


class Cifar(FileDataset):
    """CIFAR-``which`` (10 or 100), the ``train`` or test split, images (32, 32, 3) uint8 in memory."""

    reads_files = False  # the images are in memory

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
            data, targets, classes = _read(folder, cls, train, verify)
        except (RuntimeError, pickle.UnpicklingError, KeyError, TypeError, ValueError, EOFError, OSError) as e:
            raise InputError(f"CIFAR-{which} files in {str(folder)!r} did not load: {type(e).__name__}: {e}") from e
        self.name = name or f"cifar{which}-{'train' if train else 'test'}"
        self.classes = classes
        self.data: np.ndarray = data
        self.targets = targets
        if len(self.data) == 0:
            raise InputError(f"the CIFAR-{which} files in {str(folder)!r} hold no images")

    def __len__(self) -> int:
        return len(self.data)

    def index_labels(self) -> list[int]:
        """The class of every item, from the index (no image is read)."""
        return [int(v) for v in self.targets]

    def load(self, i: int) -> Sample:
        return Sample(image=self.data[i], label=self.targets[i], index=i)
