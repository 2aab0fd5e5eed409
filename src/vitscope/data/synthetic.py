"""A generated image set that needs no download: one shape per image, class = shape.

Deterministic for (seed, image index), drawn at any resolution, with its foreground mask. Colours,
position, scale and rotation are random, the background is textured noise, so the class is carried by
shape alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from vitscope.data.base import Batch
from vitscope.data.preprocess import normalize_tensor
from vitscope.models.registry import Preprocessing

SHAPES = ("disk", "square", "triangle", "cross", "ring", "bar", "diamond", "star")


def _shape_mask(kind: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """u, v: coordinates in the shape's own frame, the shape spanning about [-1, 1]."""
    r = np.hypot(u, v)
    if kind == "disk":
        return r <= 1
    if kind == "square":
        return (np.abs(u) <= 0.8) & (np.abs(v) <= 0.8)
    if kind == "triangle":
        return (v <= 0.7) & (v >= -0.9 + 1.6 * np.abs(u) * 1.1)
    if kind == "cross":
        return ((np.abs(u) <= 0.28) & (np.abs(v) <= 1)) | ((np.abs(v) <= 0.28) & (np.abs(u) <= 1))
    if kind == "ring":
        return (r <= 1) & (r >= 0.55)
    if kind == "bar":
        return (np.abs(u) <= 1) & (np.abs(v) <= 0.3)
    if kind == "diamond":
        return np.abs(u) + np.abs(v) <= 1
    if kind == "star":
        theta = np.arctan2(v, u)
        return r <= 0.55 + 0.45 * np.cos(5 * theta) ** 2
    raise ValueError(kind)


def draw(index: int, size: int, seed: int = 0, classes: tuple[str, ...] = SHAPES
         ) -> tuple[np.ndarray, np.ndarray, int]:
    """Image (size, size, 3) float32 in [0, 1], foreground mask (size, size) bool, class id."""
    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(len(classes)))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    bg = rng.uniform(0.1, 0.9, 3).astype(np.float32)
    noise = rng.normal(0, 0.08, (size, size, 1)).astype(np.float32)
    img = np.clip(bg + noise + 0.1 * np.sin(2 * np.pi * rng.uniform(2, 6) * xx)[..., None], 0, 1)
    scale = rng.uniform(0.2, 0.35)
    cy, cx = rng.uniform(scale, 1 - scale, 2)
    angle = rng.uniform(0, 2 * np.pi)
    du, dv = (xx - cx) / scale, (yy - cy) / scale
    u = np.cos(angle) * du + np.sin(angle) * dv
    v = -np.sin(angle) * du + np.cos(angle) * dv
    mask = _shape_mask(classes[label], u, v)
    fg = rng.uniform(0, 1, 3).astype(np.float32)
    if np.abs(fg - bg).sum() < 0.6:
        fg = 1 - bg
    img[mask] = np.clip(fg + rng.normal(0, 0.05, (int(mask.sum()), 3)), 0, 1)
    return img.astype(np.float32), mask, label


@dataclass
class SyntheticShapes:
    """``n`` generated images; ``size`` None = each model's own input size."""

    n: int = 256
    seed: int = 0
    size: int | None = None
    name: str = "synthetic-shapes"

    @property
    def classes(self) -> list[str]:
        return list(SHAPES)

    def __len__(self) -> int:
        return self.n

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]:
        """Batches from image ``start`` on (or of ``indices``), drawn at the model's input size."""
        ids = list(range(self.n)) if indices is None else list(indices)
        size = self.size or preprocessing.input_size
        for i in range(start, len(ids), batch_size):
            chunk = ids[i:i + batch_size]
            drawn = [draw(j, size, self.seed) for j in chunk]
            x = torch.from_numpy(np.stack([d[0] for d in drawn])).permute(0, 3, 1, 2)
            yield Batch(
                images=normalize_tensor(x, preprocessing),
                index=torch.tensor(chunk),
                labels=torch.tensor([d[2] for d in drawn]),
                masks=torch.from_numpy(np.stack([d[1] for d in drawn])),
            )
