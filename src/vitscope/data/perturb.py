"""Perturbed views of a dataset's images: frequency-band noise and common corruptions.

Both are registered views (`vitscope.data.views`): functions of a batch ``x01`` (B, 3, H, W) in [0, 1], already
resized for the model, the images' ids and the study seed, that return the perturbed batch. Their randomness
comes only from `image_generator(seed, view_key, image_id)`, one generator per image, so every model sees
the same perturbed images and a resumed or sharded pass draws the same noise.

**Frequency-band noise** (Park et al., "What do self-supervised ViTs learn?", ICLR 2023, after Park & Kim,
"How do vision transformers work?", ICLR 2022): white Gaussian noise, per channel, filtered in the Fourier
domain to the annulus ``band * width <= |omega| < (band + 1) * width`` of radial frequency
``|omega| = 2 pi sqrt(fx^2 + fy^2)`` (radians per pixel, fx, fy the DFT frequencies in cycles per pixel;
width 0.1 pi, so bands 0..9 sweep 0..pi), then scaled to a fixed root-mean-square ``rms`` per pixel (the
same noise energy in every band). The annulus is symmetric under omega -> -omega, so the filtered noise is
exactly real and all of its energy lies in the band. This is ``definition='circular_rms'``, the default.

``definition='square_sign'`` is the definition of Park et al.'s public code as measured against it (issue 29):
per channel, sign noise ``eps * sign(z)``, z standard normal per pixel (+-eps, not normalised afterwards), its
DFT kept on a *square* annulus of the shifted spectrum, ``band * width <= max(|omega_y|, |omega_x|) < (band + 1)
* width`` (omega = 2 pi f per axis), and transformed back (real part). Its root-mean-square is not fixed: it is
``eps * sqrt(share of the DFT coefficients in the band)``, so it grows with the band (the outer squares hold
more coefficients; `square_band_rms`: at eps 0.1 and 32 px 0.0094 in band 0, 0.020-0.046 in bands 1-9 (3.7x
in band 9, 4.9x in band 8), at 224 px 0.0103 rising to 0.0431, 4.2x), and the corners of a square reach radial
frequencies up to sqrt(2) x its edge. A drop in accuracy then mixes the band's frequency
with its larger noise energy, which is why the default keeps the energy fixed.

**Common corruptions** (Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations", ICLR 2019): the 15 ImageNet-C corruptions in four families and the four
held-out ones, severities 1-5 (0 = the clean image). Backend: the maintained package
``imagecorruptions-imaug`` (the fork of ``imagecorruptions``, which no longer imports; ``pip install
vitscope[robust]``), run per image on uint8 arrays with the global numpy RNG seeded from the image's
generator and restored afterwards. The corruptions whose definition is a few array operations (``NATIVE``:
the noises, Gaussian blur, brightness, contrast, JPEG, pixelate; one or more of every family but weather's
snow / frost / fog) are also implemented here with torch ops, batched, with the package's constants, and
tested against it: the default, because they cost a fraction of the package's per-image numpy (and need no
extra dependency); ``backend='package'`` uses the package for every corruption.
The package's parameters are ImageNet-C's (for 224 px images);
CIFAR-10-C used milder ones at 32 px, so absolute numbers at 32 px are not comparable with CIFAR-10-C's.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from vitscope.data.views import image_generator, register_view
from vitscope.errors import VitscopeError, check_choice, close_matches

Tensor = torch.Tensor

# ---------------------------------------------------------------- frequency-band noise
BAND_WIDTH = 0.1 * math.pi
N_BANDS = 10
#: how a band's noise is made: vitscope's default first, then Park et al.'s public code's (module docstring)
BAND_DEFINITIONS = ("circular_rms", "square_sign")


def check_band_definition(definition: object, who: str = "band_noise") -> str:
    """One sentence for a band definition that does not exist; returns it."""
    return check_choice(definition, BAND_DEFINITIONS, who, "band definition", "circular_rms (the same noise energy "
                        "in every band, the default) or square_sign (Park et al.'s public code)")


def band_key(band: int, n_bands: int = N_BANDS, width: float = BAND_WIDTH, rms: float = 0.1,
             definition: str = "circular_rms", eps: float = 0.1) -> str:
    """The view key of one band (what the per-image generators are keyed by); the default definition's key
    names no definition, so its noise is the same as before the option existed."""
    if definition == "circular_rms":
        return f"band_noise:band={int(band)},n_bands={int(n_bands)},rms={float(rms)},width={float(width)}"
    return (f"band_noise:band={int(band)},definition={definition},eps={float(eps)},n_bands={int(n_bands)},"
            f"width={float(width)}")


@lru_cache(maxsize=64)
def band_mask(h: int, w: int, band: int, width: float = BAND_WIDTH) -> Tensor:
    """(h, w) bool: the DFT coefficients whose radial frequency lies in ``[band * width, (band + 1) * width)``."""
    fy = torch.fft.fftfreq(h, dtype=torch.float64)[:, None]
    fx = torch.fft.fftfreq(w, dtype=torch.float64)[None, :]
    omega = 2 * math.pi * torch.sqrt(fy * fy + fx * fx)
    return (omega >= band * width) & (omega < (band + 1) * width)


def band_noise_like(shape: tuple[int, ...], generators: list[torch.Generator], band: int,
                    width: float = BAND_WIDTH, rms: float = 0.1, device: torch.device | str | None = None) -> Tensor:
    """(B, C, H, W) noise confined to one frequency band, root-mean-square ``rms`` per image; image b's
    noise is drawn from ``generators[b]``.

    White Gaussian noise filtered to the band, drawn directly in the Fourier domain: the DFT of white noise
    is independent complex Gaussians on a half plane (the other half is their conjugate), so only the
    band's coefficients of the real-FFT half plane are drawn (a few percent of H x W numbers for the low
    bands) and inverted with one ``irfft2``. The columns the real FFT stores without their conjugate
    partner (frequency 0 and, for even W, W/2) get sqrt(2) x the scale, so each coefficient has exactly
    the variance it has in filtered white noise. The draws come from the (CPU) generators, everything after
    them runs on ``device``: the same noise there up to float rounding.

    The inverse is ``irfft2`` done as its two 1-d passes (what pocketfft, torch's CPU FFT, does inside
    ``irfft2``: the same numbers, bit for bit), the first one (along the height) only on the columns that
    hold band coefficients: the others stay zero. For band 3 of 10 at 224 px that is 45 of 113 columns, and
    the noise of a batch of 32 took 9 ms instead of 20 ms on one core."""
    b, c, h, w = shape
    half = band_mask(h, w, int(band), float(width))[:, : w // 2 + 1]
    rows, cols = half.nonzero(as_tuple=True)
    if not len(rows):
        raise VitscopeError(f"frequency band {band} (width {width / math.pi:.2g} pi) holds no DFT frequency of a "
                            f"{h}x{w} image; use fewer or wider bands at this size")
    scale = torch.ones(len(cols))
    scale[(cols == 0) | ((cols == w // 2) & (w % 2 == 0))] = math.sqrt(2.0)
    used, pos = torch.unique(cols, return_inverse=True)  # the columns with band coefficients
    sub = torch.zeros(b, c, len(used), h, dtype=torch.complex64, device=device)  # (column, row): rows contiguous
    if b:
        z = torch.stack([torch.randn(c, len(rows), 2, generator=g) for g in generators]).to(device)
        z = z * scale.to(device)[:, None]
        sub[:, :, pos.to(device), rows.to(device)] = torch.view_as_complex(z.contiguous())
    spec = torch.zeros(b, c, h, w // 2 + 1, dtype=torch.complex64, device=device)
    spec[..., used.to(device)] = torch.fft.ifft(sub, dim=-1).transpose(-1, -2)
    noise = torch.fft.irfft(spec, n=w, dim=-1)
    norm = noise.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt().clamp_min(1e-12)
    return noise.mul_(rms / norm)


@lru_cache(maxsize=64)
def square_band_mask(h: int, w: int, band: int, width: float = BAND_WIDTH) -> Tensor:
    """(h, w) bool, unshifted DFT layout: the coefficients whose larger per-axis frequency
    ``max(|omega_y|, |omega_x|)`` lies in ``[band * width, (band + 1) * width)`` (a square annulus)."""
    wy = 2 * math.pi * torch.fft.fftfreq(h, dtype=torch.float64).abs()[:, None]
    wx = 2 * math.pi * torch.fft.fftfreq(w, dtype=torch.float64).abs()[None, :]
    cheb = torch.maximum(wy.expand(h, w), wx.expand(h, w))
    return (cheb >= band * width) & (cheb < (band + 1) * width)


def square_sign_noise_like(shape: tuple[int, ...], generators: list[torch.Generator], band: int,
                           width: float = BAND_WIDTH, eps: float = 0.1,
                           device: torch.device | str | None = None) -> Tensor:
    """(B, C, H, W) noise of Park et al.'s public code: ``eps * sign(z)`` (z ~ N(0, 1) per pixel and channel,
    image b's from ``generators[b]``) filtered to the square annulus `square_band_mask`, not renormalised; the
    signs are drawn on the CPU and travel as one byte each, the filter runs on ``device``."""
    b, c, h, w = shape
    mask = square_band_mask(h, w, int(band), float(width))
    if not bool(mask.any()):
        raise VitscopeError(f"frequency band {band} (width {width / math.pi:.2g} pi) holds no DFT frequency of a "
                            f"{h}x{w} image; use fewer or wider bands at this size")
    if not b:
        return torch.zeros(shape, device=device)
    positive = torch.stack([torch.randn(c, h, w, generator=g) for g in generators]) >= 0
    delta = torch.where(positive.to(device), float(eps), -float(eps))
    return torch.fft.ifft2(torch.fft.fft2(delta) * mask.to(device)).real.float()


def square_band_rms(h: int, w: int, band: int, width: float = BAND_WIDTH, eps: float = 0.1) -> float:
    """The expected root-mean-square of `square_sign_noise_like` (white +-eps noise keeps the share of its energy
    that the band's coefficients hold): ``eps * sqrt(n_band / (h w))``."""
    return float(eps) * math.sqrt(int(square_band_mask(h, w, int(band), float(width)).sum()) / (h * w))


@register_view("band_noise")
def band_noise(x01: Tensor, index: Tensor, seed: int, *, band: int, n_bands: int = N_BANDS,
               width: float = BAND_WIDTH, rms: float = 0.1, definition: str = "circular_rms",
               eps: float = 0.1) -> Tensor:
    """``x01`` plus noise in frequency band ``band`` (0 = lowest) of ``n_bands`` of width ``width`` (radians per
    pixel); ``definition='circular_rms'`` (default): Gaussian noise on a circular annulus with ``rms``
    root-mean-square intensity (images in [0, 1]); ``'square_sign'``: Park et al.'s public code, +-``eps``
    sign noise on a square annulus, not renormalised. The engine clamps to [0, 1]."""
    if not 0 <= int(band) < int(n_bands):
        raise VitscopeError(f"band_noise: band {band} does not exist; bands are 0..{int(n_bands) - 1}")
    check_band_definition(definition)
    key = band_key(band, n_bands, width, rms, definition, eps)
    gens = [image_generator(seed, key, int(i)) for i in index.tolist()]
    if definition == "square_sign":
        noise = square_sign_noise_like(tuple(x01.shape), gens, int(band), float(width), float(eps), x01.device)
    else:
        noise = band_noise_like(tuple(x01.shape), gens, int(band), float(width), float(rms), x01.device)
    return x01 + noise.to(x01.dtype)


# ---------------------------------------------------------------- common corruptions
FAMILIES: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
    "held-out": ("speckle_noise", "gaussian_blur", "spatter", "saturate"),  # ImageNet-C's held-out four
}
CORRUPTIONS: tuple[str, ...] = tuple(c for f in FAMILIES.values() for c in f)
COMMON: tuple[str, ...] = tuple(c for f, cs in FAMILIES.items() if f != "held-out" for c in cs)
FAMILY_OF = {c: f for f, cs in FAMILIES.items() for c in cs}
SEVERITIES = (1, 2, 3, 4, 5)
PACKAGE = "imagecorruptions-imaug"


def check_corruption(name: str, severity: int) -> None:
    """One sentence for a corruption or severity that does not exist."""
    if name not in CORRUPTIONS:
        hint = close_matches(name, CORRUPTIONS)
        raise VitscopeError(f"unknown corruption {name!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
                            + f" Corruptions: {', '.join(CORRUPTIONS)}.")
    if int(severity) != severity or not 0 <= int(severity) <= 5:
        raise VitscopeError(f"corruption severity {severity!r} does not exist; severities are 1..5 (0 = clean)")


def package_available() -> bool:
    try:
        import imagecorruptions  # noqa: F401
    except Exception:  # noqa: BLE001 - the original package fails on import (pkg_resources), not only missing
        return False
    return True


def _seed_of(g: torch.Generator) -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g))


def _gaussian_kernel(sigma: float, truncate: float = 4.0) -> Tensor:
    r = int(truncate * sigma + 0.5)  # scipy.ndimage's radius, as skimage.filters.gaussian uses
    t = torch.arange(-r, r + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return (k / k.sum()).to(torch.float32)


def _blur(x: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur with scipy's 'nearest' border (skimage.filters.gaussian's default)."""
    k = _gaussian_kernel(sigma).to(x.device)
    r = len(k) // 2
    b, c, h, w = x.shape
    y = x.reshape(1, b * c, h, w)  # one depthwise (grouped) convolution: ~8x faster than a batch of 1-channel ones
    y = F.conv2d(F.pad(y, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1).expand(b * c, 1, 1, -1), groups=b * c)
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1).expand(b * c, 1, -1, 1), groups=b * c)
    return y.reshape(b, c, h, w)


def _per_image_pil(x: Tensor, fn: Callable) -> Tensor:
    from PIL import Image

    out = []
    for img in x.cpu():
        u8 = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        res = np.asarray(fn(Image.fromarray(u8)), dtype=np.float32) / 255.0
        out.append(torch.from_numpy(res).permute(2, 0, 1))
    return torch.stack(out).to(x.device, x.dtype)


def _jpeg(img, quality: int):
    from PIL import Image

    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return Image.open(buf).convert("RGB")


def _pixelate(img, c: float):
    from PIL import Image

    w, h = img.size
    return img.resize((int(w * c), int(h * c)), Image.BOX).resize((w, h), Image.NEAREST)


# The constants of the corruptions with a native version, per severity 1..5, for each table: "imagenet" =
# ImageNet-C (the imagecorruptions package, made for 224-px images), "cifar" = CIFAR-10-C (Hendrycks &
# Dietterich's make_cifar_c.py, github.com/hendrycks/robustness, ImageNet-C/create_c/: made for 32-px images).
TABLES: dict[str, dict[str, tuple[float, ...]]] = {
    "imagenet": {"gaussian_noise": (.08, .12, .18, .26, .38), "speckle_noise": (.15, .2, .35, .45, .6),
                 "shot_noise": (60, 25, 12, 5, 3), "impulse_noise": (.03, .06, .09, .17, .27),
                 "gaussian_blur": (1, 2, 3, 4, 6), "contrast": (.4, .3, .2, .1, .05),
                 "brightness": (.1, .2, .3, .4, .5), "jpeg_compression": (25, 18, 15, 10, 7),
                 "pixelate": (.6, .5, .4, .3, .25)},
    "cifar": {"gaussian_noise": (.04, .06, .08, .09, .10), "speckle_noise": (.06, .1, .12, .16, .2),
              "shot_noise": (500, 250, 100, 75, 50), "impulse_noise": (.01, .02, .03, .05, .07),
              "gaussian_blur": (.4, .6, .7, .8, 1), "contrast": (.75, .5, .4, .3, .15),
              "brightness": (.05, .1, .15, .2, .3), "jpeg_compression": (80, 65, 58, 50, 40),
              "pixelate": (.95, .9, .85, .75, .65)},
}


def _draws(gens: list[torch.Generator], draw: Callable[[torch.Generator], Tensor], device: torch.device) -> Tensor:
    """One draw per image from its (CPU) generator, stacked and moved to ``device`` (the same numbers anywhere)."""
    return torch.stack([draw(g) for g in gens]).to(device)


def _native(name: str, x: Tensor, gens: list[torch.Generator], s: int, table: str = "imagenet") -> Tensor:
    """The corruptions defined by a few array operations, with the constants of ``table``."""
    c = TABLES[table][name][s - 1]
    if name == "gaussian_noise":
        return x + c * _draws(gens, lambda g: torch.randn(x.shape[1:], generator=g), x.device)
    if name == "speckle_noise":
        return x + x * c * _draws(gens, lambda g: torch.randn(x.shape[1:], generator=g), x.device)
    if name == "shot_noise":  # the Poisson draws need the images on the generators' side (the CPU)
        rate = x.cpu() * c
        counts = torch.stack([torch.poisson(xi, generator=g) for xi, g in zip(rate, gens, strict=True)])
        return counts.to(x.device) / c
    if name == "impulse_noise":  # skimage's 's&p': each value flipped with prob. c, to 1 or 0 with prob. 1/2
        u = _draws(gens, lambda g: torch.rand((2, *x.shape[1:]), generator=g), x.device)
        return torch.where(u[:, 0] < c, (u[:, 1] < 0.5).to(x.dtype), x)
    if name == "gaussian_blur":
        return _blur(x, c)
    if name == "contrast":
        mean = x.mean(dim=(2, 3), keepdim=True)
        return (x - mean) * c + mean
    if name == "brightness":  # HSV value + c: with hue and saturation fixed, RGB scales by V' / V (grey at V = 0)
        v = x.amax(dim=1, keepdim=True)
        v2 = (v + c).clamp(max=1.0)
        return torch.where(v > 0, x * (v2 / v.clamp_min(1e-12)), v2.expand_as(x))
    if name == "jpeg_compression":
        return _per_image_pil(x, lambda im: _jpeg(im, int(c)))
    if name == "pixelate":
        return _per_image_pil(x, lambda im: _pixelate(im, c))
    raise KeyError(name)


NATIVE = tuple(TABLES["imagenet"])


def needs_package(name: str, backend: str = "auto") -> bool:
    return backend == "package" or name not in NATIVE


def check_backend(names: list[str], backend: str = "auto", table: str = "imagenet") -> None:
    """Config-time check: the corruptions asked for can run here, with the constants of ``table``."""
    if backend not in ("auto", "package", "native"):
        raise VitscopeError(f"corruption backend {backend!r} does not exist; choose auto, native or package")
    if table not in TABLES:
        raise VitscopeError(f"corruption table {table!r} does not exist; choose {' or '.join(TABLES)}")
    if table != "imagenet":  # the package knows ImageNet-C's constants only
        if backend == "package" or any(n not in NATIVE for n in names):
            raise VitscopeError(f"the {table} table holds the native corruptions only ({', '.join(NATIVE)}); "
                                f"{', '.join(n for n in names if n not in NATIVE) or 'backend package'} "
                                "need the ImageNet-C table")
        return
    if backend == "native" and any(n not in NATIVE for n in names):
        raise VitscopeError(f"corruptions {', '.join(n for n in names if n not in NATIVE)} have no native "
                            f"implementation (native: {', '.join(NATIVE)}); use backend 'auto' or 'package'")
    missing = [n for n in names if needs_package(n, backend)]
    if missing and not package_available():
        raise VitscopeError(f"the corruptions {', '.join(missing)} need the package {PACKAGE} "
                            "(pip install 'vitscope[robust]'), which is not importable here")


def _package(name: str, x: Tensor, gens: list[torch.Generator], s: int) -> Tensor:
    from imagecorruptions import corrupt

    out = []
    state = np.random.get_state()
    try:
        for img, g in zip(x.cpu(), gens, strict=True):
            seed = _seed_of(g)
            np.random.seed(seed)
            u8 = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
            kw = {"seed": seed} if name in ("glass_blur", "impulse_noise") else {}
            res = corrupt(u8, severity=s, corruption_name=name, **kw)
            out.append(torch.from_numpy(np.ascontiguousarray(res, dtype=np.float32) / 255.0).permute(2, 0, 1))
    finally:
        np.random.set_state(state)
    return torch.stack(out).to(x.device, x.dtype)


def corruption_key(name: str, severity: int) -> str:
    return f"corruption:name={name},severity={int(severity)}"


def corrupt_batch(x01: Tensor, index: Tensor, seed: int, name: str, severity: int,
                  backend: str = "auto", table: str = "imagenet") -> Tensor:
    """Corruption ``name`` at ``severity`` (0 = identity) of a batch in [0, 1], clamped to [0, 1]; ``table``:
    the constants, "imagenet" (ImageNet-C, for 224-px images) or "cifar" (CIFAR-10-C, for 32-px images)."""
    check_corruption(name, severity)
    s = int(severity)
    if s == 0 or not len(x01):
        return x01
    if table != "imagenet":
        check_backend([name], backend, table)
    gens = [image_generator(seed, corruption_key(name, s), int(i)) for i in index.tolist()]
    x = x01.detach().to(torch.float32)  # on the batch's device: only the draws and PIL's codecs use the CPU
    out = _package(name, x, gens, s) if needs_package(name, backend) else _native(name, x, gens, s, table)
    return out.clamp_(0, 1).to(x01.dtype)


@register_view("corruption")
def corruption(x01: Tensor, index: Tensor, seed: int, *, name: str, severity: int, backend: str = "auto",
               table: str = "imagenet") -> Tensor:
    """ImageNet-C / CIFAR-10-C corruption ``name`` at ``severity`` 1..5 (Hendrycks & Dietterich, ICLR 2019)."""
    return corrupt_batch(x01, index, seed, name, severity, backend, table)

