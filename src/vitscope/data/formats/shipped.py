"""Datasets that ship inside the package (no download, no files of the user's): `cifar10-test-1k`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from vitscope.data.base import Sample
from vitscope.data.formats.common import FileDataset

CIFAR10_TEST_1K = "data/shipped/cifar10_test_1k.npz"


def shipped_path(rel: str) -> Path:
    return Path(str(resources.files("vitscope") / rel))


class Cifar10Test1k(FileDataset):
    """1,000 CIFAR-10 test photographs, 100 per class (provenance and the files used:
    ``vitscope/data/shipped/README.md``). Item ``i`` is class ``i // 100``:
    sorted by class, so a study's ``n_images`` below 1,000 takes an even spread that keeps every class."""

    reads_files = False  # the images are in memory

    def __init__(self, name: str = "cifar10-test-1k"):
        super().__init__()
        with np.load(shipped_path(CIFAR10_TEST_1K), allow_pickle=False) as z:
            self.data = z["images"]
            self.targets = z["labels"].astype(np.int64)
            self.classes = [str(c) for c in z["classes"]]
            self.files = [str(f) for f in z["files"]]
        self.name = name

    def __len__(self) -> int:
        return len(self.data)

    def index_labels(self) -> list[int]:
        """The class of every item, from the index (no image is read)."""
        return [int(v) for v in self.targets]

    def load(self, i: int) -> Sample:
        return Sample(image=self.data[i], label=int(self.targets[i]), index=i, extra={"path": self.files[i]})
