"""The sample and batch types every dataset yields, whatever ground truth it has.

Coordinates: keypoints and boxes are continuous pixel coordinates ``(x, y)`` in the image they belong to,
pixel ``(row i, column j)`` covering ``[j, j + 1) x [i, i + 1)``; so the pixel holding a point is
``(floor(y), floor(x))`` and a resize by a factor s maps x to ``s * x``. Loaders of formats that give
integer pixel indices (SPair-71k) add 0.5.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class Batch:
    """A batch on its way through the capture engine.

    images: (B, 3, H, W) preprocessed for the model; index: (B,) the images' ids in the dataset (so
    shards and resumed runs can be merged and checked); labels: (B,) class ids or None; masks: (B, H, W)
    bool foreground masks at pixel resolution or None; extra: anything else a dataset provides.
    Optional dense / geometric ground truth, all aligned with ``images``:
    parts: (B, H, W) int64 part ids (0 = background, id k is the dataset's ``part_names[k - 1]``);
    objects: (B, H, W) int64 object / instance ids (0 = background), for multi-object data;
    keypoints: (B, K, 3) float32 ``x, y, visible`` in pixels (rows padded with zeros = not visible);
    boxes: (B, 4) float32 ``x0, y0, x1, y1`` in pixels; frames: (B,) frame index in a sequence;
    sequences: the sequence (video) name of each image; is_test: (B,) bool, the dataset's own train / test
    split (None when it has none: analyses that need a split then hold out a fixed share of the ids).
    In a study, dataset: the configured name of the dataset the batch comes from, and view: the view it is
    seen under ('clean' for the identity; see `vitscope.data.views`).
    """

    images: torch.Tensor
    index: torch.Tensor
    labels: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    parts: torch.Tensor | None = None
    objects: torch.Tensor | None = None
    keypoints: torch.Tensor | None = None
    boxes: torch.Tensor | None = None
    frames: torch.Tensor | None = None
    sequences: list[str] | None = None
    is_test: torch.Tensor | None = None
    dataset: str = ""
    view: str = "clean"

    def __len__(self) -> int:
        return int(self.images.shape[0])


@dataclass
class RaggedBatch:
    """One id chunk whose images differ in size (whole frames of a variable-size dataset): consecutive runs
    of one size, each a `Batch` (``parts``), in the chunk's order. The capture engine runs one forward per
    part and feeds every analysis the parts in order, so a chunk keeps its composition (resume, shards and
    tables as for any batch) and no image is padded or resized to fit another. Padding was rejected (attention
    sees the pad tokens, so the features change), and so was one image per chunk (it changes the chunks and the
    CKA groups)."""

    parts: list[Batch]
    dataset: str = ""
    view: str = "clean"

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def index(self) -> torch.Tensor:
        return torch.cat([p.index for p in self.parts])

    def __setattr__(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)
        if key in ("dataset", "view") and "parts" in self.__dict__:
            for p in self.parts:
                setattr(p, key, value)


def batch_parts(batch: Batch | RaggedBatch) -> list[Batch]:
    """The batches of one size a chunk's batch consists of (itself for a plain `Batch`)."""
    return list(batch.parts) if isinstance(batch, RaggedBatch) else [batch]


def ragged(batches: list[Batch]) -> Batch | RaggedBatch:
    """Batches of one chunk -> one `Batch` when they are a single one, else a `RaggedBatch`."""
    return batches[0] if len(batches) == 1 else RaggedBatch(list(batches))


@dataclass
class Sample:
    """One image with whatever ground truth its dataset has, at the image's own resolution.

    image: (H, W, 3) uint8, or float32 in [0, 1]; label: class id; mask: (H, W) bool foreground;
    parts: (H, W) integer part ids (0 = background); objects: (H, W) integer object ids (0 = background);
    keypoints: (K, 3) float32 ``x, y, visible``; bbox: (4,) float32 ``x0, y0, x1, y1``; frame: index in
    its sequence; sequence: the sequence's name; is_test: whether it belongs to the dataset's test split
    (None: the dataset has no split); index: the sample's id in its dataset; geometry: how
    the image was mapped from the file's pixels (set by `vitscope.data.transforms`); extra: the rest.
    """

    image: np.ndarray
    label: int | None = None
    mask: np.ndarray | None = None
    parts: np.ndarray | None = None
    objects: np.ndarray | None = None
    keypoints: np.ndarray | None = None
    bbox: np.ndarray | None = None
    frame: int | None = None
    sequence: str | None = None
    is_test: bool | None = None
    index: int = -1
    geometry: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> tuple[int, int]:
        """(height, width)."""
        return int(self.image.shape[0]), int(self.image.shape[1])


class Dataset(Protocol):
    """What the study needs of a dataset: a size, class names, and batches at a given preprocessing."""

    name: str
    classes: list[str]

    def __len__(self) -> int: ...

    def batches(self, batch_size: int, preprocessing: Any, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]: ...


class RetrievalSplit:
    """Index layout shared by retrieval datasets: the first ``n_queries`` items are the queries, the rest the
    database. Subclasses provide ``n_queries`` and ``__len__``."""

    n_queries: int

    @property
    def queries(self) -> list[int]:
        return list(range(self.n_queries))

    @property
    def database(self) -> list[int]:
        return list(range(self.n_queries, len(self)))
