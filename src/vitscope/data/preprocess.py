"""Per-model preprocessing: the registry entry's resize, centre crop and normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vitscope.errors import InputError
from vitscope.models.registry import Preprocessing


def transform(pre: Preprocessing):  # noqa: ANN201 - torchvision transform
    """torchvision transform for PIL images: resize short side, centre crop, to tensor, normalise."""
    from torchvision import transforms as T

    interp = {"bicubic": T.InterpolationMode.BICUBIC, "bilinear": T.InterpolationMode.BILINEAR,
              "nearest": T.InterpolationMode.NEAREST}.get(pre.interpolation, T.InterpolationMode.BICUBIC)
    return T.Compose([
        T.Resize(pre.resize_size, interpolation=interp),
        T.CenterCrop(pre.input_size),
        T.ToTensor(),
        T.Normalize(pre.mean, pre.std),
    ])


_HIGH_BIT_DEPTH = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def to_rgb(im: Any) -> Any:
    """An 8-bit RGB PIL image of any PIL image. PIL's own ``convert('RGB')`` clips high-bit-depth greyscale
    (16-bit PNG or TIFF: modes ``I;16*`` and ``I``; float: ``F``) at 255, so most of such an image turns white;
    here it is scaled instead: 16-bit values by 255/65535, floats in [0, 1] by 255, anything else by the
    image's own range (with a warning, since that range is a guess). 16-bit RGB files are already reduced to
    8 bits per channel by PIL when decoded."""
    if im.mode not in _HIGH_BIT_DEPTH:
        return im.convert("RGB")
    import warnings

    import numpy as np
    from PIL import Image

    a = np.asarray(im).astype(np.float64)
    lo, hi = (float(np.nanmin(a)), float(np.nanmax(a))) if a.size else (0.0, 0.0)
    if im.mode.startswith("I;16") or (im.mode == "I" and (im.format == "PNG" or (lo >= 0 and 255 < hi <= 65535))):
        a = a * (255 / 65535)
    elif im.mode == "F" and lo >= 0 and hi <= 1:
        a = a * 255
    elif not (lo >= 0 and hi <= 255):
        warnings.warn(f"an image of mode {im.mode} with values in [{lo:g}, {hi:g}] was scaled to 8 bits by its own "
                      "range", UserWarning, stacklevel=2)
        a = (a - lo) * (255 / max(hi - lo, 1e-12))
    grey = np.clip(np.rint(np.nan_to_num(a)), 0, 255).astype(np.uint8)
    return Image.fromarray(np.repeat(grey[..., None], 3, axis=2), "RGB")


def load_images(items: Sequence[Any], pre: Preprocessing) -> torch.Tensor:
    """PIL images or image file paths -> a normalised (B, 3, S, S) batch. Unreadable files say which."""
    from PIL import Image, UnidentifiedImageError

    tf = transform(pre)
    out = []
    for item in items:
        if isinstance(item, str | Path):
            try:
                with Image.open(item) as im:
                    img = to_rgb(im)
            except (OSError, UnidentifiedImageError) as e:
                raise InputError(f"could not read image {str(item)!r}: {e}") from e
        elif hasattr(item, "convert"):
            img = to_rgb(item)
        else:
            raise InputError(f"expected PIL images or paths, got {type(item).__name__}")
        out.append(tf(img))
    return torch.stack(out)
