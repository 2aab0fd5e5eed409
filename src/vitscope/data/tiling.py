"""Dense features of a whole image from a fixed-input ViT, by tiling (the downstream protocol of
ANALYSES.md): resize the short side to 2x the model input and the long side to a multiple of the patch
size, cut non-overlapping tiles of the input size, cover the leftover strip at the right / bottom with an
extra tile aligned to the image edge, and drop that tile's tokens that overlap tokens already covered.
Every token of the resulting (H_tok, W_tok, D) grid comes from exactly one tile.

Pure parts (no model): `tiling_size`, `plan_tiles`, `cut_tiles`, `assemble`. With a model:
`vitscope.capture.dense_features` (the engine runs the tiles), which returns the grid with its pixel geometry
back to the original image (`DenseFeatures`). For a study pass: `TiledDataset`, a dataset whose batches are
the tiles of its items (the dense analyses assemble them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vitscope.errors import InputError

if TYPE_CHECKING:
    from vitscope.data.transforms import Geometry


@dataclass(frozen=True)
class Tile:
    """A tile at pixel (y, x) of the resized image; its token rows [rows[0], rows[1]) and columns
    [cols[0], cols[1]) are kept and go to token (dst_y, dst_x) onwards in the grid."""

    y: int
    x: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_y: int
    dst_x: int


@dataclass(frozen=True)
class TilePlan:
    """Tiles covering a (height, width) image whose sides are multiples of ``patch``."""

    height: int
    width: int
    tile: int
    patch: int
    tiles: tuple[Tile, ...]

    @property
    def grid(self) -> tuple[int, int]:
        """(H_tok, W_tok) of the assembled token grid."""
        return self.height // self.patch, self.width // self.patch


def tiling_size(height: int, width: int, tile: int, patch: int, scale: int = 2) -> tuple[int, int]:
    """(height, width) to resize an image to: short side ``scale * tile``, long side in proportion,
    rounded to a multiple of ``patch`` (and never below the short side)."""
    if tile % patch:
        raise InputError(f"tile {tile} is not a multiple of the patch size {patch}")
    short = scale * tile
    if height <= width:
        long = max(short, int(round(width * short / height / patch)) * patch)
        return short, long
    long = max(short, int(round(height * short / width / patch)) * patch)
    return long, short


def _axis(length: int, tile: int, patch: int) -> list[tuple[int, tuple[int, int], int]]:
    """(start pixel, kept token range within the tile, first grid token) along one side."""
    t = tile // patch
    out = [(k * tile, (0, t), k * t) for k in range(length // tile)]
    rest = length - (length // tile) * tile
    if rest:
        out.append((length - tile, (t - rest // patch, t), (length - rest) // patch))
    return out


def plan_tiles(height: int, width: int, tile: int, patch: int) -> TilePlan:
    """Non-overlapping ``tile`` x ``tile`` tiles from the top-left, plus edge-aligned tiles for the
    leftovers whose already-covered tokens are dropped. Sides must be multiples of ``patch``, >= ``tile``."""
    if tile % patch:
        raise InputError(f"tile {tile} is not a multiple of the patch size {patch}")
    if height % patch or width % patch:
        raise InputError(f"image sides must be multiples of the patch size {patch}; got {height}x{width} "
                         "(resize with tiling_size first)")
    if height < tile or width < tile:
        raise InputError(f"image {height}x{width} is smaller than one {tile}x{tile} tile")
    tiles = tuple(Tile(y, x, rows, cols, dy, dx)
                  for y, rows, dy in _axis(height, tile, patch) for x, cols, dx in _axis(width, tile, patch))
    return TilePlan(height, width, tile, patch, tiles)


def cut_tiles(image: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """(C, H, W) -> (N, C, tile, tile) in plan order."""
    if tuple(image.shape[-2:]) != (plan.height, plan.width):
        raise InputError(f"image is {tuple(image.shape[-2:])}, the plan is for {(plan.height, plan.width)}")
    s = plan.tile
    return torch.stack([image[:, t.y:t.y + s, t.x:t.x + s] for t in plan.tiles])


def assemble(plan: TilePlan, features: torch.Tensor) -> torch.Tensor:
    """(N, t, t, D) token features of the tiles, in plan order -> (H_tok, W_tok, D)."""
    t = plan.tile // plan.patch
    if features.ndim != 4 or tuple(features.shape[:3]) != (len(plan.tiles), t, t):
        raise InputError(f"expected tile features of shape ({len(plan.tiles)}, {t}, {t}, D); "
                         f"got {tuple(features.shape)}")
    gh, gw = plan.grid
    out = features.new_zeros((gh, gw, features.shape[-1]))
    for f, tl in zip(features, plan.tiles, strict=True):
        (r0, r1), (c0, c1) = tl.rows, tl.cols
        out[tl.dst_y:tl.dst_y + r1 - r0, tl.dst_x:tl.dst_x + c1 - c0] = f[r0:r1, c0:c1]
    return out


@dataclass
class DenseFeatures:
    """A dense token grid: ``features`` (H_tok, W_tok, D); token (i, j) covers pixels
    [i p, (i+1) p) x [j p, (j+1) p) of the resized image (p = ``patch``); ``geometry`` maps the original
    image's pixels to the resized one's."""

    features: torch.Tensor
    patch: int
    plan: TilePlan
    geometry: Geometry

    def token_centres(self) -> np.ndarray:
        """(H_tok, W_tok, 2) ``x, y`` centre of each token in the original image's pixels."""
        gh, gw = self.plan.grid
        ys, xs = np.meshgrid((np.arange(gh) + 0.5) * self.patch, (np.arange(gw) + 0.5) * self.patch, indexing="ij")
        return self.geometry.invert(np.stack([xs, ys], axis=-1))

    def token_at(self, xy: np.ndarray) -> np.ndarray:
        """(N, 2) points in the original image -> (N, 2) token (row, col), clipped to the grid."""
        p = self.geometry.apply(np.asarray(xy, dtype=np.float64).reshape(-1, 2))
        gh, gw = self.plan.grid
        return np.stack([np.clip(np.floor(p[:, 1] / self.patch), 0, gh - 1),
                         np.clip(np.floor(p[:, 0] / self.patch), 0, gw - 1)], axis=1).astype(np.int64)


def as_sample(image: Any) -> Any:
    """``image`` (a `Sample`, PIL image, (H, W, 3) array or (3, H, W) tensor in [0, 1]) as a `Sample`."""
    from vitscope.data.base import Sample

    if isinstance(image, Sample):
        return image
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise InputError(f"expected a (3, H, W) image tensor in [0, 1]; got {tuple(image.shape)}")
        return Sample(image=image.permute(1, 2, 0).float().numpy())
    if hasattr(image, "convert"):
        from vitscope.data.preprocess import to_rgb

        return Sample(image=np.asarray(to_rgb(image)))
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise InputError(f"expected an (H, W, 3) image; got shape {arr.shape}")
    return Sample(image=arr)


# ------------------------------------------------------------------------------------------------ tiled datasets


class TiledDataset:
    """A dataset's items as dense tiles, for a study pass (every tile goes through the model's forward).

    Each item is drawn at its own resolution (generated sets at ``scale`` x the model input), resized by
    `tiling_size` (short side ``scale`` x the input, long side a multiple of ``patch``; its annotations follow:
    label maps nearest, keypoints and boxes scaled), normalised and cut by `plan_tiles`. A batch holds the tiles
    of ``batch_size`` items (so batch b covers items [b * batch_size, (b + 1) * batch_size), as for an untiled
    dataset); ``batch.index`` repeats each item's id for its tiles, and ``batch.extra['tiling']`` holds
    ``patch``, ``tile`` and per item its ``plan``, ``first`` row in the batch and its annotations at the
    resized resolution (``objects``, ``mask``, ``parts``, ``keypoints``, ``bbox``, ``label``, ``frame``,
    ``sequence`` and the base's per-sample extras such as ``pair`` / ``role``; ``ref_size``: max(bbox h, w)
    scaled like the image). The dense analyses assemble each item's token grid with `assemble`.

    ``patch``: the patch size the tiles are cut for, or None (``patch: model``, the default of a study): cut for
    each model's own patch size, as Walmer et al.'s dense extraction does per model; the study hands every model
    `for_patch` of it (`vitscope.study.keys.for_model`), and reading a per-model dataset before that is an
    error. An integer must be the model's patch size (the dataset does not know the model; an analysis whose
    model has another patch size says so). The base must offer ``raw_samples(indices, size)``.

    The fixed id chunks do not depend on the patch: ``len`` and `unit_bounds` count items (images, frames,
    pairs), never tiles, so every patch size cuts the same chunks, shards and resume points."""

    def __init__(self, base: Any, scale: int = 2, patch: int | None = 16):
        if not hasattr(base, "raw_samples"):
            raise InputError(f"dataset {getattr(base, 'name', base)!r} cannot be tiled (it has no raw_samples)")
        self.base, self.scale = base, int(scale)
        self.patch = None if patch is None else int(patch)
        self.name = base.name
        self.classes = base.classes

    @property
    def per_model(self) -> bool:
        """Whether the tiles are cut for each model's own patch size (``patch: model``)."""
        return self.patch is None

    def for_patch(self, patch: int) -> TiledDataset:
        """This dataset cut for ``patch`` (a model's patch size): itself where it already is, else a copy over the
        same base (the same items, ids and annotations; only the resize to a multiple of the patch and the
        tiles' plan differ)."""
        if self.patch == int(patch):
            return self
        return TiledDataset(self.base, scale=self.scale, patch=int(patch))

    def __len__(self) -> int:
        return len(self.base)

    def unit_bounds(self) -> list[int]:
        return self.base.unit_bounds() if hasattr(self.base, "unit_bounds") else list(range(len(self)))

    def count_tiles(self, indices: list[int], tile: int | None = None, patch: int | None = None) -> int:
        """Tiles (forward images) of the items ``indices`` for a model of input ``tile`` and patch size ``patch``
        (this dataset's own where it has one), without drawing an image: from each item's (height, width) where the
        base tells it (``raw_size(index)``), else the items counted as squares, as the generated sets draw them
        (``scale`` x ``scale`` tiles each, whatever the patch; a real dataset's aspect ratios are not read for an
        estimate)."""
        size_of = getattr(self.base, "raw_size", None)
        if size_of is None or tile is None:
            return self.scale * self.scale * len(indices)
        patch = self.patch if self.patch is not None else int(patch or tile)
        total = 0
        for i in indices:
            h, w = tiling_size(*size_of(int(i)), tile, patch, self.scale)
            total += len(_axis(h, tile, patch)) * len(_axis(w, tile, patch))
        return total

    def __getattr__(self, key: str) -> Any:  # gnd, n_queries, sequences, ... of the base
        if key == "base":
            raise AttributeError(key)
        return getattr(self.base, key)

    def batches(self, batch_size: int, preprocessing: Any, start: int = 0,
                indices: list[int] | None = None) -> Any:
        from vitscope.data.base import Batch
        from vitscope.data.transforms import as_float, normalize, resize

        if self.patch is None:
            raise InputError(f"dataset {self.name!r} is tiled per model (patch: model): read it through "
                             "for_patch(the model's patch size)")
        tile = preprocessing.input_size
        ids = list(range(len(self))) if indices is None else list(indices)
        chunk: list[tuple[Any, TilePlan, torch.Tensor]] = []

        def emit() -> Batch:
            images = torch.cat([t for _, _, t in chunk])
            index = torch.cat([torch.full((len(t),), int(s.index), dtype=torch.long) for s, _, t in chunk])
            items, first = [], 0
            for s, plan, t in chunk:
                items.append({"index": int(s.index), "plan": plan, "first": first, "objects": _t(s.objects),
                              "mask": _t(s.mask), "parts": _t(s.parts),
                              "keypoints": _t(s.keypoints), "bbox": _t(s.bbox), "label": s.label,
                              "frame": s.frame, "sequence": s.sequence, **s.extra})
                first += len(t)
            return Batch(images=images, index=index, extra={"tiling": {"patch": self.patch, "tile": tile,
                                                                       "items": items}})

        for s in self.base.raw_samples(ids[start:], self.scale * tile):
            h, w = tiling_size(*s.size, tile, self.patch, self.scale)
            r = resize(s, h, w, preprocessing.interpolation)
            if s.bbox is not None:
                b = np.asarray(s.bbox, np.float64)
                r.extra = {**r.extra, "ref_size": float(max(b[2] - b[0], b[3] - b[1]) * abs(r.geometry.sx))}
            x = normalize(torch.from_numpy(np.ascontiguousarray(as_float(r.image))).permute(2, 0, 1)[None],
                          preprocessing)[0]
            plan = plan_tiles(h, w, tile, self.patch)
            chunk.append((r, plan, cut_tiles(x, plan)))
            if len(chunk) == batch_size:
                yield emit()
                chunk = []
        if chunk:
            yield emit()


def _t(a: Any) -> torch.Tensor | None:
    return None if a is None else torch.as_tensor(np.asarray(a))
