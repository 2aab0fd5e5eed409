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


def load_images(items: Sequence[Any], pre: Preprocessing) -> torch.Tensor:
    """PIL images or image file paths -> a normalised (B, 3, S, S) batch. Unreadable files say which."""
    from PIL import Image, UnidentifiedImageError

    tf = transform(pre)
    out = []
    for item in items:
        if isinstance(item, str | Path):
            try:
                with Image.open(item) as im:
                    img = im.convert("RGB")
            except (OSError, UnidentifiedImageError) as e:
                raise InputError(f"could not read image {str(item)!r}: {e}") from e
        elif hasattr(item, "convert"):
            img = item.convert("RGB")
        else:
            raise InputError(f"expected PIL images or paths, got {type(item).__name__}")
        out.append(tf(img))
    return torch.stack(out)
