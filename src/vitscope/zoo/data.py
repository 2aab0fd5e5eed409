"""The zoo's one data pipeline: CIFAR-10 (ImageFolder of JPEGs) or generated shapes, and the views.

Images are decoded once into a uint8 tensor in memory (CIFAR-10 train: 150 MB, about 20 s), and every
augmentation runs batched on tensors in the training process, so nothing needs worker processes on a
2-core machine (``num_workers`` = 0: the augmentations cost a few percent of a training step, measured
by ``benchmarks/zoo_throughput.py``). Step ``s`` of a run with seed ``seed`` always gets the same images
and the same views: the image order of each pass over the data comes from a generator seeded with
(seed, pass), the augmentation of step ``s`` from a generator seeded with (seed, s); the objectives draw
their masks from the same per-step generator. So a resumed run needs nothing but the step number to
continue bit-identically, and no global RNG is touched.

Augmentations (parameters in `ViewSpec` / `Photometric`):
  * every view: random resized crop + horizontal flip (crop area fraction ``scale``, aspect 3/4..4/3);
  * contrastive views (MoCo v3, hybrid, DINO): colour jitter (brightness 0.4, contrast 0.4, saturation
    0.2, hue 0.1, p = 0.8), grayscale (p = 0.2), Gaussian blur and solarisation with the asymmetric
    probabilities of BYOL / MoCo v3 / DINO (view 1: blur 1.0; view 2: blur 0.1, solarise 0.2; local
    crops: blur 0.5). Blur is a 3-tap kernel with sigma 0.1..1.0 px, scaled down from ImageNet's
    23-px kernel for 32-px images. Hue is a rotation in YIQ space (a close, batched stand-in for an HSV
    hue shift); the jitter order is fixed (brightness, contrast, saturation, hue).
  * DINO multi-crop: 2 global crops at the training size (scale 0.4..1) + ``n_local`` local crops at
    half the side (16 px for 32-px training, scale 0.05..0.4), as in Caron et al. 2021.

Accounting: a view weighs its pixel count relative to a full-size view, so a 16-px local crop of a
32-px model is 0.25 view (`ViewSpec.views_per_image`). Views fed to a teacher / momentum encoder are
the same views, not counted twice.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Where CIFAR-10 is looked for when --data is not given (the first that exists), else generated shapes.
CIFAR_CANDIDATES = ("../shared/data/cifar10", "/work/shared/data/cifar10")
SYNTHETIC = "synthetic"


# -- image sets ---------------------------------------------------------------------------------------

@dataclass
class ImageSet:
    """Images in memory: ``images`` (N, 3, H, W) uint8, ``labels`` (N,) int64."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str
    root: str | None = None

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def balanced_subset(self, n: int) -> torch.Tensor:
        """Indices of about ``n`` images, the first n/C of each class in file order (seed independent)."""
        per = max(1, n // max(1, len(self.classes)))
        out = [torch.nonzero(self.labels == c).flatten()[:per] for c in range(len(self.classes))]
        return torch.cat(out).sort().values


def load_imagefolder(root: str | Path, name: str = "cifar10") -> ImageSet:
    """An ImageFolder split (``root/<class>/*.jpg``) decoded into memory, in torchvision's sorted order."""
    from PIL import Image
    from torchvision.datasets import ImageFolder

    from vitscope.data.preprocess import to_rgb

    folder = ImageFolder(str(root), loader=lambda p: p)
    arrays = []
    for path, _ in folder.samples:
        with Image.open(path) as im:
            arrays.append(np.asarray(to_rgb(im)))
    sizes = {a.shape for a in arrays}
    if len(sizes) != 1:
        raise ValueError(f"{root}: images of different sizes {sorted(sizes)[:3]}; the zoo expects one size")
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor([c for _, c in folder.samples], dtype=torch.int64)
    return ImageSet(images, labels, list(folder.classes), name, str(root))


def synthetic_set(n: int, seed: int, size: int) -> ImageSet:
    """``n`` generated shape images (`vitscope.data.synthetic.draw`), class = shape: offline fallback."""
    from vitscope.data import SyntheticShapes
    from vitscope.data.synthetic import draw

    classes = list(SyntheticShapes(n, seed, size).classes)  # the `Dataset` protocol's class names
    drawn = [draw(i, size, seed) for i in range(n)]
    images = torch.from_numpy(np.stack([(d[0] * 255).round().astype(np.uint8) for d in drawn]))
    labels = torch.tensor([d[2] for d in drawn], dtype=torch.int64)
    return ImageSet(images.permute(0, 3, 1, 2).contiguous(), labels, classes, "synthetic-shapes")


def find_cifar(data: str | Path | None) -> Path | None:
    """The CIFAR-10 root to use: ``data`` if given (must exist), else the first existing candidate."""
    if data is not None and str(data) != SYNTHETIC:
        p = Path(data).expanduser()
        if not (p / "train").is_dir() or not (p / "test").is_dir():
            raise FileNotFoundError(f"{p} is not an ImageFolder root with train/ and test/ splits")
        return p
    if data is None:
        env = os.environ.get("VITSCOPE_CIFAR10")
        for c in ([env] if env else []) + list(CIFAR_CANDIDATES):
            p = Path(c)
            if (p / "train").is_dir() and (p / "test").is_dir():
                return p.resolve()
    return None


@dataclass
class DataSource:
    train: ImageSet
    test: ImageSet
    description: dict[str, Any] = field(default_factory=dict)


def load_data(data: str | Path | None, size: int = 32, synthetic_n: tuple[int, int] = (5000, 1000),
              seed: int = 0) -> DataSource:
    """CIFAR-10 train/test from ``data`` (or found), else generated shapes of ``size`` px (with a warning).

    ``data='synthetic'`` forces the generated set: ``synthetic_n`` (train, test) images, test drawn with
    another seed so no test image is a train image.
    """
    root = find_cifar(data)
    if root is None:
        if data is None:
            log.warning("no CIFAR-10 found (looked in %s); training on generated shapes", ", ".join(CIFAR_CANDIDATES))
        train = synthetic_set(synthetic_n[0], seed, size)
        test = synthetic_set(synthetic_n[1], seed + 10_000, size)
        desc = {"name": "synthetic-shapes", "path": None, "n_train": len(train), "n_test": len(test),
                "size": size, "seed": seed}
        return DataSource(train, test, desc)
    train = load_imagefolder(root / "train")
    test = load_imagefolder(root / "test")
    if train.classes != test.classes:
        raise ValueError(f"{root}: train and test have different classes")
    desc = {"name": "cifar10", "path": str(root), "n_train": len(train), "n_test": len(test),
            "size": int(train.images.shape[-1])}
    return DataSource(train, test, desc)


# -- views --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Photometric:
    """Colour augmentations of one view (probabilities per image)."""

    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1
    gray_p: float = 0.2
    blur_p: float = 0.0
    blur_sigma: tuple[float, float] = (0.1, 1.0)
    solarize_p: float = 0.0


# BYOL / MoCo v3 / DINO asymmetric pairs, and DINO's local crops.
VIEW1 = Photometric(blur_p=1.0)
VIEW2 = Photometric(blur_p=0.1, solarize_p=0.2)
LOCAL = Photometric(blur_p=0.5)


@dataclass(frozen=True)
class ViewSpec:
    """What an objective needs from each image: global views (training size), local views (smaller)."""

    n_global: int = 1
    n_local: int = 0
    global_scale: tuple[float, float] = (0.2, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.4)
    local_ratio: float = 0.5  # local side / global side
    colour: bool = False  # photometric augmentations (VIEW1, VIEW2 on the globals, LOCAL on the locals)

    def views_per_image(self) -> float:
        """Image-views per image: each view weighted by its pixels relative to a global view."""
        return self.n_global + self.n_local * self.local_ratio**2

    def local_size(self, size: int, patch: int) -> int:
        s = int(round(size * self.local_ratio / patch)) * patch
        return max(patch, s)


@dataclass
class ViewBatch:
    """The views of one training step. ``generator`` is the step's own generator (for masks)."""

    global_views: list[torch.Tensor]
    local_views: list[torch.Tensor]
    labels: torch.Tensor
    index: torch.Tensor
    generator: torch.Generator
    image_views: float

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _uniform(n: int, lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=g) * (hi - lo) + lo


def random_resized_crop(x: torch.Tensor, out: int, scale: Sequence[float], g: torch.Generator,
                        ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True) -> torch.Tensor:
    """Batched RandomResizedCrop + horizontal flip by bilinear resampling; x (B, C, H, W) float.

    Area fraction ~ U(scale), log aspect ~ U(log ratio); a box larger than the image is clipped to it
    (torchvision retries, then falls back to the centre; clipping keeps the draw count fixed).
    """
    b = x.shape[0]
    area = _uniform(b, scale[0], scale[1], g)
    r = torch.exp(_uniform(b, math.log(ratio[0]), math.log(ratio[1]), g))
    w = torch.sqrt(area * r).clamp(max=1.0)
    h = torch.sqrt(area / r).clamp(max=1.0)
    cx = w / 2 + torch.rand(b, generator=g) * (1 - w)
    cy = h / 2 + torch.rand(b, generator=g) * (1 - h)
    sign = torch.where(torch.rand(b, generator=g) < 0.5, -1.0, 1.0) if flip else torch.ones(b)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0] = w * sign
    theta[:, 0, 2] = 2 * cx - 1
    theta[:, 1, 1] = h
    theta[:, 1, 2] = 2 * cy - 1
    grid = F.affine_grid(theta, [b, x.shape[1], out, out], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


_GRAY = torch.tensor([0.299, 0.587, 0.114])
_RGB2YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ2RGB = torch.linalg.inv(_RGB2YIQ)


def _gray(x: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bchw,c->bhw", x, _GRAY).unsqueeze(1)


def _per(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def photometric(x: torch.Tensor, p: Photometric, g: torch.Generator) -> torch.Tensor:
    """Batched colour jitter, grayscale, blur, solarisation on images in [0, 1]; every draw is made for
    every image (so the generator advances the same whatever is applied)."""
    b = x.shape[0]
    apply = torch.rand(b, generator=g) < p.jitter_p
    fb = _uniform(b, 1 - p.brightness, 1 + p.brightness, g)
    fc = _uniform(b, 1 - p.contrast, 1 + p.contrast, g)
    fs = _uniform(b, 1 - p.saturation, 1 + p.saturation, g)
    fh = _uniform(b, -p.hue, p.hue, g)
    gray_on = torch.rand(b, generator=g) < p.gray_p
    blur_on = torch.rand(b, generator=g) < p.blur_p
    sigma = _uniform(b, p.blur_sigma[0], p.blur_sigma[1], g)
    sol_on = torch.rand(b, generator=g) < p.solarize_p

    j = (x * _per(fb)).clamp(0, 1)
    m = _gray(j).mean(dim=(1, 2, 3), keepdim=True)
    j = ((j - m) * _per(fc) + m).clamp(0, 1)
    gr = _gray(j)
    j = ((j - gr) * _per(fs) + gr).clamp(0, 1)
    ang = fh * 2 * math.pi
    cos, sin = torch.cos(ang), torch.sin(ang)
    rot = torch.zeros(b, 3, 3)
    rot[:, 0, 0] = 1
    rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = cos, -sin, sin, cos
    mat = _YIQ2RGB @ rot @ _RGB2YIQ  # (b, 3, 3)
    j = torch.einsum("bij,bjhw->bihw", mat, j).clamp(0, 1)
    x = torch.where(_per(apply), j, x)
    x = torch.where(_per(gray_on), _gray(x).expand_as(x), x)
    if p.blur_p > 0:
        taps = torch.arange(-1, 2, dtype=x.dtype)
        k = torch.exp(-(taps[None] ** 2) / (2 * sigma[:, None] ** 2))
        k = (k / k.sum(1, keepdim=True)).repeat_interleave(x.shape[1], 0)  # (b*C, 3)
        y = x.reshape(1, -1, *x.shape[-2:])
        y = F.conv2d(F.pad(y, (1, 1, 0, 0), mode="reflect"), k.view(-1, 1, 1, 3), groups=k.shape[0])
        y = F.conv2d(F.pad(y, (0, 0, 1, 1), mode="reflect"), k.view(-1, 1, 3, 1), groups=k.shape[0])
        x = torch.where(_per(blur_on), y.view_as(x), x)
    if p.solarize_p > 0:
        x = torch.where(_per(sol_on), torch.where(x >= 0.5, 1 - x, x), x)
    return x


class Augment:
    """uint8 images -> the normalised views of a `ViewSpec`, at ``size`` px (local crops smaller)."""

    def __init__(self, spec: ViewSpec, size: int, mean: Sequence[float], std: Sequence[float], patch: int = 4):
        self.spec, self.size = spec, size
        self.local_size = spec.local_size(size, patch)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def __call__(self, images: torch.Tensor, g: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x = images.float() / 255
        s = self.spec
        globals_, locals_ = [], []
        for i in range(s.n_global):
            v = random_resized_crop(x, self.size, s.global_scale, g)
            if s.colour:
                v = photometric(v, VIEW1 if i % 2 == 0 else VIEW2, g)
            globals_.append(self.normalise(v))
        for _ in range(s.n_local):
            v = random_resized_crop(x, self.local_size, s.local_scale, g)
            if s.colour:
                v = photometric(v, LOCAL, g)
            locals_.append(self.normalise(v))
        return globals_, locals_

    def plain(self, images: torch.Tensor) -> torch.Tensor:
        """Evaluation: no augmentation, resized to ``size`` if needed, normalised."""
        x = images.float() / 255
        if x.shape[-1] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True)
        return self.normalise(x)


class ViewStream:
    """The deterministic stream of training batches: ``batch(step)`` depends on (seed, step) only.

    Passes over the data follow each other; each pass is a fresh permutation (seeded by (seed, pass))
    cut into ``len(data) // batch_size`` full batches (the remainder of each pass is skipped).
    """

    def __init__(self, data: ImageSet, spec: ViewSpec, batch_size: int, seed: int, augment: Augment):
        if batch_size > len(data):
            raise ValueError(f"batch size {batch_size} is larger than the data ({len(data)} images)")
        self.data, self.spec, self.batch_size, self.seed, self.augment = data, spec, batch_size, seed, augment
        self.steps_per_pass = len(data) // batch_size
        self._perm: tuple[int, torch.Tensor] | None = None

    def permutation(self, p: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != p:
            g = torch.Generator().manual_seed(_seed(self.seed, 1, p))
            self._perm = (p, torch.randperm(len(self.data), generator=g))
        return self._perm[1]

    def batch(self, step: int) -> ViewBatch:
        p, i = divmod(step, self.steps_per_pass)
        idx = self.permutation(p)[i * self.batch_size:(i + 1) * self.batch_size]
        g = torch.Generator().manual_seed(_seed(self.seed, 2, step))
        globals_, locals_ = self.augment(self.data.images[idx], g)
        return ViewBatch(globals_, locals_, self.data.labels[idx], idx, g,
                         len(idx) * self.spec.views_per_image())
