"""The shared ground of `vitscope.metrics.attention`: the validation of ``attn``, ``grid_size`` and
``num_prefix_tokens``, the renormalisation guard :data:`EPS`, token positions on the unit square, and the spatial
attention (and the CLS map) that every other metric starts from. Conventions: the package's docstring."""

from __future__ import annotations

import torch
from torch import Tensor

EPS: float = 1e-12
"""Guard for divisions by a (possibly zero) row sum or normaliser."""



# ----------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------


def _check_attn(attn: Tensor) -> None:
    if not isinstance(attn, Tensor):
        raise TypeError(f"attn must be a torch.Tensor, got {type(attn).__name__}")
    if attn.ndim != 4:
        raise ValueError(f"attn must be 4-D (B, H, T, T), got shape {tuple(attn.shape)}")
    if attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be square in its last two dims (B, H, T, T), got {tuple(attn.shape)}")
    if not attn.is_floating_point():
        raise ValueError(f"attn must be a floating-point tensor, got dtype {attn.dtype}")


def _check_prefix(attn: Tensor, num_prefix_tokens: int) -> int:
    """Validate ``num_prefix_tokens`` against ``attn`` and return the number of spatial tokens S."""
    if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int):
        raise TypeError(f"num_prefix_tokens must be an int, got {num_prefix_tokens!r}")
    T = attn.shape[-1]
    if num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
    if num_prefix_tokens >= T:
        raise ValueError(
            f"num_prefix_tokens={num_prefix_tokens} leaves no spatial token in a sequence of T={T} tokens"
        )
    return T - num_prefix_tokens


def _check_grid(attn: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> tuple[int, int]:
    """Validate ``attn``, ``grid_size`` and ``num_prefix_tokens`` together; return ``(h, w)``."""
    _check_attn(attn)
    try:
        h, w = (int(v) for v in grid_size)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"grid_size must be a pair (h, w) of positive ints, got {grid_size!r}") from exc
    if h < 1 or w < 1:
        raise ValueError(f"grid_size must be a pair (h, w) of positive ints, got {grid_size!r}")
    S = _check_prefix(attn, num_prefix_tokens)
    if S != h * w:
        raise ValueError(
            f"attn has T={attn.shape[-1]} tokens but num_prefix_tokens={num_prefix_tokens} + h*w="
            f"{h}*{w}={h * w} gives {num_prefix_tokens + h * w}: check grid_size and num_prefix_tokens"
        )
    return h, w


def _renormalise(x: Tensor) -> Tensor:
    """Divide the last dim by its sum (accumulated in float64, floored at EPS); keeps the dtype."""
    s = x.sum(dim=-1, keepdim=True, dtype=torch.float64).clamp_min(EPS)
    return x / s.to(x.dtype)


def _grid_positions(h: int, w: int, device: torch.device | None = None) -> Tensor:
    """(h*w, 2) float64 (row, col) positions on the unit square: index / (max(h, w) - 1)."""
    scale = max(max(h, w) - 1, 1)
    rows = torch.arange(h, dtype=torch.float64, device=device).repeat_interleave(w, output_size=h * w)
    cols = torch.arange(w, dtype=torch.float64, device=device).repeat(h)
    return torch.stack([rows, cols], dim=-1) / scale


# ----------------------------------------------------------------------------------------------------
# spatial attention
# ----------------------------------------------------------------------------------------------------


def spatial_attention(attn: Tensor, num_prefix_tokens: int) -> Tensor:
    """Spatial queries over spatial keys, each row renormalised to sum to 1.

    Args:
        attn: ``(B, H, T, T)`` attention probabilities.
        num_prefix_tokens: number of leading prefix tokens (the CLS token if any, and the registers if any),
            ``0 <= p < T``.

    Returns:
        ``(B, H, S, S)`` with ``S = T - p`` in the dtype of ``attn``. Prefix queries and prefix keys are
        dropped; each remaining row is divided by its spatial mass (floored at :data:`EPS`, so a row with no
        spatial mass stays all-zero instead of becoming NaN).
    """
    _check_attn(attn)
    _check_prefix(attn, num_prefix_tokens)
    p = num_prefix_tokens
    return _renormalise(attn[..., p:, p:])


def cls_attention_maps(attn: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> Tensor:
    """The CLS query's attention over the spatial keys, as a map on the patch grid.

    Args:
        attn: ``(B, H, T, T)`` attention probabilities, ``T = num_prefix_tokens + h * w``.
        grid_size: patch grid ``(h, w)``.
        num_prefix_tokens: prefix tokens, ``>= 1``. Row 0 is read as the CLS query: the model must have a
            CLS token (``ViTModel.has_cls_token``), which the caller checks; in a model with registers and no
            CLS token, token 0 is a register and its row is not a CLS map.

    Returns:
        ``(B, H, h, w)`` in the dtype of ``attn``: row 0 restricted to the spatial keys (CLS and register keys
        dropped), renormalised to sum to 1 over the grid.

    Raises:
        ValueError: if ``num_prefix_tokens == 0`` (no prefix token, so no CLS token) or the shapes disagree.
    """
    h, w = _check_grid(attn, grid_size, num_prefix_tokens)
    if num_prefix_tokens == 0:
        raise ValueError("cls_attention_maps needs a CLS token, but num_prefix_tokens=0 (no prefix tokens)")
    row = _renormalise(attn[:, :, 0, num_prefix_tokens:])
    return row.reshape(*row.shape[:2], h, w)
