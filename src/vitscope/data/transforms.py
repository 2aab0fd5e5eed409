"""Geometric transforms on `Sample`s that keep every annotation aligned with the pixels.

Each operation maps the image and, identically, its masks (nearest neighbour, pixel-centre aligned:
the same rule as PIL's NEAREST), keypoints (coordinates transformed; points that leave the image are
marked not visible) and box, and composes the mapping into ``sample.geometry`` (a `Geometry`), so a
point in the file's pixels can always be found in the model's input and back.

`for_model` is a model's eval preprocessing: resize the short side to ``pre.resize_size``, centre crop
``pre.input_size``, optional horizontal flip. `collate` turns transformed samples into a normalised `Batch`.
Coordinates follow `vitscope.data.base`: continuous, pixel (i, j) covers [j, j+1) x [i, i+1).

The resize (`resize`) of an 8-bit image stays 8-bit: torch's ``uint8`` antialiased interpolation (bicubic or
bilinear, Keys' a = -0.5 kernel widened by the scale when shrinking, rounded to uint8), which is PIL's
``Image.resize`` algorithm: the pixels agree with PIL's BICUBIC / BILINEAR up to one grey level in rounding
(>= 99% identical on photographs), i.e. with timm's and torchvision's eval transform (``Resize`` on a PIL
image), the protocol the models were evaluated with. Why not the float path: it is 5-7x slower than the
uint8 one (about 2 ms against 0.3 ms for an 854x480 JPEG to a 224-px short side on one core; PIL itself
takes 2-3 ms), it converts the whole file-size image to float32 first (4x the bytes), and its unrounded
output differs from PIL's by 0.3 grey levels on average. Crop and flip keep uint8 too; only the model's
input (the 224x224 crop) is converted to float and normalised, in `collate`. Images that are already float
(in memory, generated; high-bit-depth files are scaled to 8 bits by `vitscope.data.preprocess.to_rgb` when
read) keep the float path: torch's antialiased interpolation in float32, clamped to [0, 1].
`PIXELS_VERSION` names this choice; it is part of a study's cache keys, so results computed from other
pixels are not reused.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from vitscope.data.base import Batch, Sample
from vitscope.models.registry import Preprocessing

_MODES = {"bicubic": "bicubic", "bilinear": "bilinear", "nearest": "nearest-exact", "area": "area"}

#: the pixels' numerics (see the module's docstring): 3 = as 2, with the views (band noise, corruptions)
#: computed on one thread wherever the chunk is read (`vitscope.data.pipeline`: the last bits of some view
#: kernels depend on the thread count); 2 = 8-bit images resized in uint8 (PIL's algorithm); 1 (before) = every
#: image converted to float32 and resized there. Part of a study's cache keys.
PIXELS_VERSION = 3


@dataclass(frozen=True)
class Geometry:
    """Axis-aligned map from source pixels to output pixels: ``x' = sx * x + tx``, ``y' = sy * y + ty``.

    sx < 0 is a horizontal flip. height, width: the output's size; src_height, src_width: the source's.
    """

    sx: float
    tx: float
    sy: float
    ty: float
    height: int
    width: int
    src_height: int
    src_width: int

    @classmethod
    def identity(cls, height: int, width: int) -> Geometry:
        return cls(1.0, 0.0, 1.0, 0.0, height, width, height, width)

    def then(self, sx: float, tx: float, sy: float, ty: float, height: int, width: int) -> Geometry:
        """This map followed by another one onto an image of (height, width)."""
        return Geometry(sx * self.sx, sx * self.tx + tx, sy * self.sy, sy * self.ty + ty, height, width,
                        self.src_height, self.src_width)

    def apply(self, xy: np.ndarray) -> np.ndarray:
        """(N, 2) source points -> output points."""
        xy = np.asarray(xy, dtype=np.float64)
        return np.stack([xy[..., 0] * self.sx + self.tx, xy[..., 1] * self.sy + self.ty], axis=-1)

    def invert(self, xy: np.ndarray) -> np.ndarray:
        """(N, 2) output points -> source points."""
        xy = np.asarray(xy, dtype=np.float64)
        return np.stack([(xy[..., 0] - self.tx) / self.sx, (xy[..., 1] - self.ty) / self.sy], axis=-1)


def as_float(image: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 or float -> float32 in [0, 1]."""
    if image.dtype == np.uint8:
        return image.astype(np.float32) / 255.0
    return image.astype(np.float32, copy=False)


def _geometry(s: Sample) -> Geometry:
    if s.geometry is not None:
        return s.geometry
    h, w = s.size
    return Geometry.identity(h, w)


def _nearest(a: np.ndarray | None, height: int, width: int) -> np.ndarray | None:
    """Nearest-neighbour resize of a label map: output pixel centre (i + .5) reads source floor((i + .5) h / H)."""
    if a is None:
        return None
    h, w = a.shape[:2]
    rows = np.minimum(((np.arange(height) + 0.5) * h / height).astype(np.int64), h - 1)
    cols = np.minimum(((np.arange(width) + 0.5) * w / width).astype(np.int64), w - 1)
    return a[rows][:, cols]


def _points(s: Sample, sx: float, tx: float, sy: float, ty: float, height: int, width: int
            ) -> tuple[np.ndarray | None, np.ndarray | None]:
    kp = s.keypoints
    if kp is not None:
        kp = np.array(kp, dtype=np.float32, copy=True).reshape(-1, 3)
        kp[:, 0] = kp[:, 0] * sx + tx
        kp[:, 1] = kp[:, 1] * sy + ty
        inside = (kp[:, 0] >= 0) & (kp[:, 0] < width) & (kp[:, 1] >= 0) & (kp[:, 1] < height)
        kp[:, 2] = np.where(inside, kp[:, 2], 0.0)
    box = s.bbox
    if box is not None:
        b = np.asarray(box, dtype=np.float64)
        xs = np.sort([b[0] * sx + tx, b[2] * sx + tx])
        ys = np.sort([b[1] * sy + ty, b[3] * sy + ty])
        box = np.array([np.clip(xs[0], 0, width), np.clip(ys[0], 0, height),
                        np.clip(xs[1], 0, width), np.clip(ys[1], 0, height)], dtype=np.float32)
    return kp, box


def resize_image(image: np.ndarray, height: int, width: int, interpolation: str = "bicubic") -> np.ndarray:
    """(H, W, C) image -> (height, width, C), antialiased when shrinking (bicubic, bilinear). uint8 stays uint8
    (torch's uint8 path: PIL's ``Image.resize`` algorithm, rounded; the module's docstring says why); other
    dtypes become float32 in [0, 1] (float32 interpolation, clamped)."""
    mode = _MODES.get(interpolation, "bicubic")
    kw = {"align_corners": False, "antialias": True} if mode in ("bicubic", "bilinear") else {}
    if image.dtype == np.uint8 and mode != "area":  # torch has no uint8 area mode
        with warnings.catch_warnings():  # a decoded PIL image's array is read-only; interpolate only reads it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            x = torch.from_numpy(np.ascontiguousarray(image))
        # (1, C, H, W) viewed channels-last: torch's fast uint8 kernel. Its result is (1, C, H, W) contiguous; the
        # (H, W, C) copy is torch's (0.17 ms at 224x398, numpy's strided uint8 copy took 0.35 ms)
        out = F.interpolate(x.permute(2, 0, 1)[None], size=(height, width), mode=mode, **kw)
        return out[0].permute(1, 2, 0).contiguous().numpy()
    x = torch.from_numpy(np.ascontiguousarray(as_float(image))).permute(2, 0, 1)[None]
    return F.interpolate(x, size=(height, width), mode=mode, **kw).clamp_(0, 1)[0].permute(1, 2, 0).numpy()


def resize(s: Sample, height: int, width: int, interpolation: str = "bicubic") -> Sample:
    """Resize to (height, width): image by `resize_image` (antialiased when shrinking; 8-bit images stay 8-bit,
    PIL's algorithm), label maps nearest."""
    h, w = s.size
    if (h, w) == (height, width):
        return replace(s, geometry=_geometry(s))
    img = resize_image(s.image, height, width, interpolation)
    sx, sy = width / w, height / h
    kp, box = _points(s, sx, 0.0, sy, 0.0, height, width)
    return replace(s, image=img, mask=_nearest(s.mask, height, width), parts=_nearest(s.parts, height, width),
                   objects=_nearest(s.objects, height, width), keypoints=kp, bbox=box,
                   geometry=_geometry(s).then(sx, 0.0, sy, 0.0, height, width))


def short_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) after resizing the short side to ``size`` (long side truncated, as torchvision)."""
    if height <= width:
        return size, max(1, int(size * width / height))
    return max(1, int(size * height / width)), size


def resize_short(s: Sample, size: int, interpolation: str = "bicubic") -> Sample:
    """Resize so that the short side is ``size``, keeping the aspect ratio."""
    return resize(s, *short_side_size(*s.size, size), interpolation=interpolation)


def _crop_map(a: np.ndarray | None, top: int, left: int, height: int, width: int) -> np.ndarray | None:
    if a is None:
        return None
    h, w = a.shape[:2]
    out = np.zeros((height, width, *a.shape[2:]), dtype=a.dtype)
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + height, h), min(left + width, w)
    if y1 > y0 and x1 > x0:
        out[y0 - top:y1 - top, x0 - left:x1 - left] = a[y0:y1, x0:x1]
    return out


def crop(s: Sample, top: int, left: int, height: int, width: int) -> Sample:
    """The window [top, top + height) x [left, left + width); parts outside the image are zero."""
    kp, box = _points(s, 1.0, -float(left), 1.0, -float(top), height, width)
    return replace(s, image=_crop_map(s.image, top, left, height, width),
                   mask=_crop_map(s.mask, top, left, height, width),
                   parts=_crop_map(s.parts, top, left, height, width),
                   objects=_crop_map(s.objects, top, left, height, width), keypoints=kp, bbox=box,
                   geometry=_geometry(s).then(1.0, -float(left), 1.0, -float(top), height, width))


def center_crop(s: Sample, size: int | tuple[int, int]) -> Sample:
    """Centre crop to ``size`` (int = square), offsets rounded as torchvision's CenterCrop."""
    th, tw = (size, size) if isinstance(size, int) else size
    h, w = s.size
    return crop(s, int(round((h - th) / 2.0)), int(round((w - tw) / 2.0)), th, tw)


def hflip(s: Sample) -> Sample:
    """Mirror left-right. Keypoint ids are kept (a dataset with left/right names must swap them itself)."""
    h, w = s.size

    def flip(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[:, ::-1])

    kp, box = _points(s, -1.0, float(w), 1.0, 0.0, h, w)
    return replace(s, image=flip(s.image), mask=flip(s.mask), parts=flip(s.parts), objects=flip(s.objects),
                   keypoints=kp, bbox=box, geometry=_geometry(s).then(-1.0, float(w), 1.0, 0.0, h, w))


def for_model(s: Sample, pre: Preprocessing, flip: bool = False) -> Sample:
    """A model's eval view of a sample: short side to ``pre.resize_size``, centre crop, optional flip."""
    out = center_crop(resize_short(s, pre.resize_size, pre.interpolation), pre.input_size)
    return hflip(out) if flip else out


CROPS = ("full", "center")


@dataclass(frozen=True)
class Framing:
    """How a dataset's images reach the model. ``crop='center'``: the model's eval preprocessing (short side
    resized, centre crop: `for_model`). ``crop='full'``: the whole image at its aspect ratio (`whole_frame`):
    the ``side`` ('short' or 'long') resized to ``size`` pixels (None: the model's input size), each side then
    rounded down to a multiple of the model's patch size; the model runs on the non-square input (position
    embeddings interpolated to the token grid), and annotations at the file's resolution travel beside the
    resized ones (``extra['source_objects']``, the geometry) so tasks can be scored there."""

    crop: str = "center"
    size: int | None = None
    side: str = "short"

    def __post_init__(self) -> None:
        from vitscope.errors import InputError

        if self.crop not in CROPS:
            raise InputError(f"crop must be one of {', '.join(CROPS)}; got {self.crop!r}")
        if self.side not in ("short", "long"):
            raise InputError(f"side must be 'short' or 'long'; got {self.side!r}")
        if self.size is not None and int(self.size) < 1:
            raise InputError(f"size must be a positive number of pixels; got {self.size}")

    def describe(self, pre: Preprocessing | None = None) -> str:
        """What the table and report say, e.g. 'full frame, short side 480' or 'centre crop 224'."""
        if self.crop == "center":
            return f"centre crop {pre.input_size}" if pre is not None else "centre crop"
        size = self.size if self.size is not None else (pre.input_size if pre is not None else "input size")
        return f"full frame, {self.side} side {size}"

    def apply(self, s: Sample, pre: Preprocessing, flip: bool = False) -> Sample:
        if self.crop == "center":
            return for_model(s, pre, flip)
        if not getattr(pre, "any_size", True):
            from vitscope.errors import InputError

            raise InputError("this model takes one input size only (BEiT: relative position bias tables built for "
                             "one token grid), so it cannot see whole frames; set the dataset option crop: center")
        out = whole_frame(s, self.size or pre.input_size, int(getattr(pre, "patch_size", 16)), self.side,
                          pre.interpolation)
        return hflip(out) if flip else out


def whole_frame_size(height: int, width: int, size: int, patch: int, side: str = "short") -> tuple[int, int]:
    """(height, width) of a whole frame for the model: ``side`` ('short' or 'long') scaled to ``size`` with
    the aspect ratio kept, then each side rounded down to a multiple of ``patch`` (at least one patch)."""
    scale = size / (min(height, width) if side == "short" else max(height, width))

    def fit(n: int) -> int:
        return max(patch, int(n * scale + 1e-6) // patch * patch)

    return fit(height), fit(width)


def whole_frame(s: Sample, size: int, patch: int, side: str = "short", interpolation: str = "bicubic") -> Sample:
    """The whole image resized by `whole_frame_size` (annotations follow: label maps nearest, points scaled),
    with the file's annotations kept in ``extra``: ``source_objects`` (the label map at the file's resolution,
    for scoring there), ``source_keypoints`` and ``source_bbox``."""
    keep = {k: v for k, v in (("source_objects", s.objects), ("source_keypoints", s.keypoints),
                              ("source_bbox", s.bbox)) if v is not None}
    out = resize(s, *whole_frame_size(*s.size, size, patch, side), interpolation=interpolation)
    out.extra = {**s.extra, **keep}
    return out


def normalize(images: torch.Tensor, pre: Preprocessing, inplace: bool = False) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> normalised with the model's mean and std (no resizing); ``inplace``: in
    ``images``' own buffer (the same numbers, no second batch-sized one)."""
    mean = torch.tensor(pre.mean, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(pre.std, dtype=images.dtype).view(1, 3, 1, 1)
    return images.sub_(mean).div_(std) if inplace else (images - mean) / std


def _stack_maps(maps: Sequence[np.ndarray | None], dtype: torch.dtype) -> torch.Tensor | None:
    if not maps or any(m is None for m in maps):
        return None
    return torch.from_numpy(np.stack(maps)).to(dtype)


def _batch_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty float32 batch; in a DataLoader worker, in shared memory already (as torch's default_collate
    does), so handing the batch to the study's process does not copy it into shared memory again."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape)
    storage = torch.empty(0)._typed_storage()._new_shared(int(np.prod(shape)), device="cpu")
    return torch.empty(0).new(storage).view(shape)


def collate(samples: Sequence[Sample], pre: Preprocessing) -> Batch:
    """Samples of one size -> a `Batch` with images normalised for ``pre``; a field is set only when every
    sample has it (keypoints: padded to the largest K with invisible rows)."""
    # the crops are stacked as they are (uint8 from a file) and only the stack is converted to float
    images = [s.image for s in samples]
    stacked = np.stack(images if images and all(im.dtype == np.uint8 for im in images)
                       else [as_float(im) for im in images])
    x = _batch_buffer((stacked.shape[0], stacked.shape[3], stacked.shape[1], stacked.shape[2]))
    x.copy_(torch.from_numpy(stacked).permute(0, 3, 1, 2))  # uint8 -> float32 exactly
    if stacked.dtype == np.uint8:
        x.div_(255.0)
    normalize(x, pre, inplace=True)  # in the worker's shared-memory buffer
    labels = None
    if samples and all(s.label is not None for s in samples):
        labels = torch.tensor([int(s.label) for s in samples], dtype=torch.long)
    keypoints = None
    if samples and all(s.keypoints is not None for s in samples):
        k = max(len(s.keypoints) for s in samples)
        kp = np.zeros((len(samples), k, 3), dtype=np.float32)
        for i, s in enumerate(samples):
            kp[i, :len(s.keypoints)] = s.keypoints
        keypoints = torch.from_numpy(kp)
    boxes = None
    if samples and all(s.bbox is not None for s in samples):
        boxes = torch.from_numpy(np.stack([np.asarray(s.bbox, dtype=np.float32) for s in samples]))
    frames = None
    if samples and all(s.frame is not None for s in samples):
        frames = torch.tensor([int(s.frame) for s in samples], dtype=torch.long)
    sequences = [s.sequence for s in samples] if samples and all(s.sequence is not None for s in samples) else None
    is_test = None
    if samples and all(s.is_test is not None for s in samples):
        is_test = torch.tensor([bool(s.is_test) for s in samples], dtype=torch.bool)
    return Batch(
        images=x,
        index=torch.tensor([s.index for s in samples], dtype=torch.long),
        labels=labels,
        masks=_stack_maps([s.mask for s in samples], torch.bool),
        parts=_stack_maps([s.parts for s in samples], torch.long),
        objects=_stack_maps([s.objects for s in samples], torch.long),
        keypoints=keypoints,
        boxes=boxes,
        frames=frames,
        sequences=sequences,
        is_test=is_test,
    )
