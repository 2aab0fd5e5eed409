"""Aligned aggregated attention maps (AAAM), their shape statistics, and the references of uniform attention
on the same grid (its centre-3x3 mass, its entropy)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from vitscope.metrics.attention.spatial import EPS, _check_grid, spatial_attention

_ANISO_EPS = 1e-6
"""Added to both variances in the anisotropy ratio (token units²): keeps a point mass at ratio 1."""


# ----------------------------------------------------------------------------------------------------
# aligned aggregated attention maps
# ----------------------------------------------------------------------------------------------------


def _canvas_index(h: int, w: int, device: torch.device | None = None) -> Tensor:
    """(S*S,) flat canvas index of key k for query q, row-major over (q, k), query at the canvas centre."""
    r = torch.arange(h, device=device).repeat_interleave(w, output_size=h * w)  # output_size: no host wait
    c = torch.arange(w, device=device).repeat(h)
    dy = r[None, :] - r[:, None] + (h - 1)  # (q, k) -> canvas row
    dx = c[None, :] - c[:, None] + (w - 1)  # (q, k) -> canvas col
    return (dy * (2 * w - 1) + dx).reshape(-1)


def aligned_maps(
    attn: Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    reduce: Literal["mean", "sum"] = "mean",
) -> Tensor | tuple[Tensor, int]:
    """Aligned Aggregated Attention Maps (AAAM; Walmer et al., CVPR 2023, "Teaching Matters", §4.2).

    Each spatial query's ``h x w`` map (prefix keys dropped, renormalised) is added into a
    ``(2h - 1) x (2w - 1)`` canvas shifted so that the query's own position lands on the canvas centre
    ``(h - 1, w - 1)``; canvas cell ``(h - 1 + dy, w - 1 + dx)`` therefore collects the attention paid to
    the key ``dy`` rows below and ``dx`` columns right of the query. Summing covers every query of every
    image; the mean divides by the number of maps added, ``n_maps = B * h * w`` (queries x images; a query
    whose spatial row is all-zero still counts). With softmax rows each mean canvas sums to 1 per head.

    Args:
        attn: ``(B, H, T, T)`` attention probabilities.
        grid_size: patch grid ``(h, w)``.
        num_prefix_tokens: prefix tokens ahead of the patch tokens.
        reduce: ``"mean"`` returns the averaged canvas; ``"sum"`` returns ``(sum_canvas, n_maps)`` for
            streaming: add the canvases and the counts over batches, divide once at the end.

    Returns:
        ``"mean"``: ``(H, 2h - 1, 2w - 1)`` in the dtype of ``attn``.
        ``"sum"``: ``(sum_canvas, n_maps)`` with ``sum_canvas`` ``(H, 2h - 1, 2w - 1)`` float64 and
        ``n_maps`` a Python int.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    h, w = _check_grid(attn, grid_size, num_prefix_tokens)
    B = attn.shape[0]
    A = spatial_attention(attn, num_prefix_tokens)
    canvas = canvas_of_spatial(A.sum(dim=0, dtype=torch.float64), grid_size)  # summed over images
    n_maps = B * h * w
    if reduce == "sum":
        return canvas, n_maps
    return (canvas / n_maps).to(attn.dtype)


def canvas_of_spatial(spatial: Tensor, grid_size: tuple[int, int]) -> Tensor:
    """The :func:`aligned_maps` canvas sum ``(H, 2h - 1, 2w - 1)`` float64 of spatial attention as given
    (``(H, S, S)``, e.g. a sum over images; rows not renormalised here): each query's row added into the canvas
    with the query at its centre."""
    h, w = grid_size
    H, S = spatial.shape[0], h * w
    index = _canvas_index(h, w, device=spatial.device).expand(H, -1)
    canvas = torch.zeros(H, (2 * h - 1) * (2 * w - 1), dtype=torch.float64, device=spatial.device)
    canvas.scatter_add_(1, index, spatial.reshape(H, S * S).double())
    return canvas.reshape(H, 2 * h - 1, 2 * w - 1)


def _canvas_geometry(aaam: Tensor) -> tuple[Tensor, int, int]:
    if not isinstance(aaam, Tensor) or aaam.ndim not in (2, 3):
        shape = tuple(aaam.shape) if isinstance(aaam, Tensor) else type(aaam).__name__
        raise ValueError(f"aaam must be a tensor (H, 2h-1, 2w-1) or (2h-1, 2w-1), got {shape}")
    if aaam.ndim == 2:
        aaam = aaam.unsqueeze(0)
    R, C = aaam.shape[-2:]
    if R % 2 == 0 or C % 2 == 0:
        raise ValueError(f"aaam canvas sides must be odd (2h-1, 2w-1), got {R}x{C}")
    return aaam, (R + 1) // 2, (C + 1) // 2


def _triangle_entropy(n: int) -> float:
    """Entropy (nats) of the difference of two independent uniform draws on {0, ..., n-1}."""
    d = torch.arange(-(n - 1), n, dtype=torch.float64)
    p = (n - d.abs()) / (n * n)
    return float(-(p * p.log()).sum())


def uniform_mass_3x3(grid_size: tuple[int, int]) -> float:
    """Mass that uniform attention's AAAM puts in the centre 3x3 on an ``(h, w)`` grid: the AAAM of uniform
    attention is ``(h - |dy|)(w - |dx|) / (h w)^2``, so the mass is ``(sum_{|dy|<=1} (h - |dy|)) (sum_{|dx|<=1}
    (w - |dx|)) / (h w)^2``, ``(3h - 2)(3w - 2) / (h w)^2`` for sides of at least 2."""
    h, w = (int(v) for v in grid_size)
    rows = sum(h - abs(d) for d in (-1, 0, 1) if abs(d) < h)
    cols = sum(w - abs(d) for d in (-1, 0, 1) if abs(d) < w)
    return rows * cols / float(h * w) ** 2


def aam_statistics(aaam: Tensor) -> dict[str, Tensor]:
    """Shape statistics of aligned aggregated attention maps, one value per head.

    The canvas is first normalised to total mass 1 per head (an all-zero head gives zeros). Offsets are in
    token units relative to the canvas centre, ``dy`` positive downwards (image rows) and ``dx`` positive to
    the right.

    Args:
        aaam: ``(H, 2h - 1, 2w - 1)`` (or a single ``(2h - 1, 2w - 1)`` canvas, treated as ``H = 1``), e.g.
            from :func:`aligned_maps`.

    Returns:
        A dict of float64 tensors of shape ``(H,)``:

        * ``com_dy``, ``com_dx``: centre of mass.
        * ``offset``: its length ``sqrt(com_dy² + com_dx²)``.
        * ``angle``: its direction in degrees in ``(-180, 180]``, counter-clockwise from "right" with "up"
          at +90 (``atan2(-com_dy, com_dx)``); 0 when the offset is 0.
        * ``var_y``, ``var_x``: central second moments along rows and columns.
        * ``spread``: ``sqrt(var_y + var_x)``, the root of the second central moment.
        * ``spread_norm``: ``spread`` divided by the spread of the AAAM of uniform attention on the same grid,
          ``sqrt(((h² - 1) + (w² - 1)) / 6)``; 1 for uniform attention, 0 for a point mass.
        * ``anisotropy``: ``(var_y + 1e-6) / (var_x + 1e-6)``; > 1 elongated vertically, < 1 horizontally,
          1 for isotropic maps and for a point mass.
        * ``mass_center``: mass on the centre cell (attention to self).
        * ``mass_3x3``: mass within the centre 3x3 (self and the 8 immediate neighbours).
        * ``locality``: ``mass_3x3`` over the mass that uniform attention on the same grid puts in the centre
          3x3 (:func:`uniform_mass_3x3`): 1 for uniform attention, above 1 when the immediate neighbourhood
          gets more than its share. Unlike ``mass_3x3`` it means the same on every grid (that share is 12 %
          on 8x8, 4 % on 14x14, 3 % on 16x16).
        * ``mass_row``, ``mass_col``: mass on the centre row (``dy = 0``) and the centre column (``dx = 0``).
        * ``peak_dy``, ``peak_dx``: location of the maximum (integer valued). Ties within a relative 1e-9
          are broken towards the centre (smallest Euclidean distance), then by row-major order.
        * ``peak_mass_3x3``: mass within the 3x3 around the peak (clipped at the canvas border).
        * ``entropy``: Shannon entropy of the normalised canvas in nats (``0 log 0 = 0``).
        * ``entropy_norm``: ``entropy`` divided by the entropy of the uniform-attention AAAM on the same grid
          (1 for uniform attention; it can slightly exceed 1 for maps more spread than that reference).
    """
    aaam, h, w = _canvas_geometry(aaam)
    H = aaam.shape[0]
    device = aaam.device
    m = aaam.to(torch.float64)
    total = m.sum(dim=(-2, -1), keepdim=True)
    P = m / total.clamp_min(EPS)
    dy = torch.arange(-(h - 1), h, dtype=torch.float64, device=device)[:, None]  # (R, 1)
    dx = torch.arange(-(w - 1), w, dtype=torch.float64, device=device)[None, :]  # (1, C)

    mass_y = P.sum(dim=-1)  # (H, R)
    mass_x = P.sum(dim=-2)  # (H, C)
    com_dy = (mass_y * dy[:, 0]).sum(-1)
    com_dx = (mass_x * dx[0]).sum(-1)
    var_y = (mass_y * (dy[:, 0] - com_dy[:, None]) ** 2).sum(-1)
    var_x = (mass_x * (dx[0] - com_dx[:, None]) ** 2).sum(-1)
    offset = torch.sqrt(com_dy**2 + com_dx**2)
    angle = torch.rad2deg(torch.atan2(-com_dy, com_dx))
    angle = torch.where(angle <= -180.0, angle + 360.0, angle)
    spread = torch.sqrt(var_y + var_x)
    uniform_spread = math.sqrt(((h * h - 1) + (w * w - 1)) / 6.0)
    spread_norm = spread / uniform_spread if uniform_spread > 0 else torch.zeros_like(spread)
    anisotropy = (var_y + _ANISO_EPS) / (var_x + _ANISO_EPS)

    cy, cx = h - 1, w - 1
    mass_center = P[:, cy, cx]
    mass_3x3 = P[:, max(cy - 1, 0) : cy + 2, max(cx - 1, 0) : cx + 2].sum(dim=(-2, -1))
    mass_row = P[:, cy, :].sum(-1)
    mass_col = P[:, :, cx].sum(-1)
    locality = mass_3x3 / uniform_mass_3x3((h, w))

    # peak: maximum, ties (relative 1e-9) broken towards the centre, then row-major first
    flat = P.reshape(H, -1)
    peak_val = flat.amax(dim=-1, keepdim=True)
    is_max = flat >= peak_val * (1 - 1e-9)
    dist_c = (dy**2 + dx**2).reshape(1, -1).expand(H, -1)
    idx = torch.where(is_max, dist_c, torch.full_like(dist_c, math.inf)).argmin(dim=-1)
    peak_r = idx // (2 * w - 1)
    peak_c = idx % (2 * w - 1)
    peak_dy = (peak_r - cy).to(torch.float64)
    peak_dx = (peak_c - cx).to(torch.float64)
    rows = torch.arange(2 * h - 1, device=device)
    cols = torch.arange(2 * w - 1, device=device)
    near_peak = ((rows[None, :, None] - peak_r[:, None, None]).abs() <= 1) & (
        (cols[None, None, :] - peak_c[:, None, None]).abs() <= 1
    )
    peak_mass_3x3 = (P * near_peak).sum(dim=(-2, -1))

    entropy = -torch.xlogy(P, P).sum(dim=(-2, -1))
    ref_entropy = _triangle_entropy(h) + _triangle_entropy(w)
    entropy_norm = entropy / ref_entropy if ref_entropy > 0 else torch.zeros_like(entropy)

    return {
        "com_dy": com_dy,
        "com_dx": com_dx,
        "offset": offset,
        "angle": angle,
        "var_y": var_y,
        "var_x": var_x,
        "spread": spread,
        "spread_norm": spread_norm,
        "anisotropy": anisotropy,
        "mass_center": mass_center,
        "mass_3x3": mass_3x3,
        "locality": locality,
        "mass_row": mass_row,
        "mass_col": mass_col,
        "peak_dy": peak_dy,
        "peak_dx": peak_dx,
        "peak_mass_3x3": peak_mass_3x3,
        "entropy": entropy,
        "entropy_norm": entropy_norm,
    }
