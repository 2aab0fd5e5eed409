"""The sample and batch types every dataset yields, whatever ground truth it has."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Batch:
    """A batch on its way through the capture engine.

    images: (B, 3, H, W) preprocessed for the model; index: (B,) the images' ids in the dataset (so
    shards and resumed runs can be merged and checked); labels: (B,) class ids or None; masks: (B, H, W)
    foreground masks at pixel resolution or None; extra: anything else a dataset provides.
    """

    images: torch.Tensor
    index: torch.Tensor
    labels: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.images.shape[0])


class Dataset(Protocol):
    """What the study needs of a dataset: a size, class names, and batches at a given preprocessing."""

    name: str
    classes: list[str]

    def __len__(self) -> int: ...

    def batches(self, batch_size: int, preprocessing: Any, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]: ...
