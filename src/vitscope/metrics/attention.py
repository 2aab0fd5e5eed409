"""Pure metrics on ViT attention tensors.

Conventions shared by every function in this module:

* ``attn`` is a floating-point tensor of shape ``(B, H, T, T)`` holding softmax probabilities: row ``q``
  (a query) is a distribution over the keys ``k`` and sums to 1.
* The token sequence is ``num_prefix_tokens`` prefix tokens (CLS first, then registers if any; 0 when the
  model has no CLS token) followed by ``h * w`` spatial patch tokens in row-major order, so spatial token
  ``s`` sits at row ``s // w`` and column ``s % w`` of the patch grid ``grid_size = (h, w)``.
* "Spatial attention" means a spatial query's row restricted to the spatial keys (prefix keys dropped) and
  renormalised to sum to 1. A row whose spatial mass is zero stays zero (the renormalisation divides by
  ``max(row_sum, EPS)``).
* Element-wise work happens in the input dtype (float32 or float64); sums that feed a metric are
  accumulated in float64. Metric tensors are returned in the input dtype unless stated otherwise.

Nothing here loops over queries or images; everything is vectorised with broadcasting, ``scatter_add`` and
index arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "EPS",
    "HeadTypeThresholds",
    "aam_statistics",
    "aligned_maps",
    "attention_distance",
    "attention_nmi",
    "cls_attention_maps",
    "distance_in_pixels",
    "head_types",
    "saliency_iou",
    "saliency_iou_merged",
    "spatial_attention",
    "top_mass_mask",
    "uniform_saliency_iou",
]

EPS: float = 1e-12
"""Guard for divisions by a (possibly zero) row sum or normaliser."""

_ANISO_EPS = 1e-6
"""Added to both variances in the anisotropy ratio (token units²): keeps a point mass at ratio 1."""


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
        num_prefix_tokens: number of leading prefix tokens (CLS + registers), ``0 <= p < T``.

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
        num_prefix_tokens: prefix tokens; the CLS token is token 0 so this must be ``>= 1``.

    Returns:
        ``(B, H, h, w)`` in the dtype of ``attn``: row 0 restricted to the spatial keys (CLS and register keys
        dropped), renormalised to sum to 1 over the grid.

    Raises:
        ValueError: if ``num_prefix_tokens == 0`` (the model has no CLS token) or the shapes disagree.
    """
    h, w = _check_grid(attn, grid_size, num_prefix_tokens)
    if num_prefix_tokens == 0:
        raise ValueError("cls_attention_maps needs a CLS token, but num_prefix_tokens=0 (no prefix tokens)")
    row = _renormalise(attn[:, :, 0, num_prefix_tokens:])
    return row.reshape(*row.shape[:2], h, w)


# ----------------------------------------------------------------------------------------------------
# attention distance
# ----------------------------------------------------------------------------------------------------


def attention_distance(attn: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> Tensor:
    """Mean attention distance per image and head, on the unit square.

    For each spatial query ``q`` the expected distance ``sum_k A_qk * ||pos_q - pos_k||`` is taken over the
    spatial keys with the renormalised spatial attention ``A`` (see :func:`spatial_attention`), then averaged
    uniformly over the ``h * w`` spatial queries. Positions are ``(row, col) / (max(h, w) - 1)``, so the
    longer side of the grid spans [0, 1] whatever the patch size, and models with different patch sizes
    compare. Use :func:`distance_in_pixels` to convert to pixels. A 1x1 grid has distance 0.

    Args:
        attn: ``(B, H, T, T)`` attention probabilities.
        grid_size: patch grid ``(h, w)``.
        num_prefix_tokens: prefix tokens ahead of the patch tokens.

    Returns:
        ``(B, H)`` in the dtype of ``attn`` (products in the input dtype, sums in float64).
    """
    _check_grid(attn, grid_size, num_prefix_tokens)
    return distance_of_spatial(spatial_attention(attn, num_prefix_tokens), grid_size).to(attn.dtype)


def distance_of_spatial(spatial: Tensor, grid_size: tuple[int, int], distances: Tensor | None = None) -> Tensor:
    """:func:`attention_distance` of spatial attention as given (``(..., S, S)``, rows not renormalised here),
    float64: the expected key distance of each query (products in the input dtype, sums in float64), averaged
    over the queries. ``distances``: the ``(S, S)`` position distances in the input dtype, when the caller
    keeps them."""
    if distances is None:
        pos = _grid_positions(*grid_size, device=spatial.device)
        distances = torch.cdist(pos, pos).to(spatial.dtype)
    return (spatial * distances).sum(dim=-1, dtype=torch.float64).mean(dim=-1)


def distance_in_pixels(
    distance_unit: Tensor | float, grid_size: tuple[int, int], patch_size: int
) -> Tensor | float:
    """Convert a unit-square attention distance (:func:`attention_distance`) to pixels.

    ``distance_px = distance_unit * patch_size * (max(h, w) - 1)``: one unit-square step of
    ``1 / (max(h, w) - 1)`` is one patch, i.e. ``patch_size`` pixels (patch centre to patch centre).
    Works on tensors and plain floats alike.
    """
    h, w = (int(v) for v in grid_size)
    if h < 1 or w < 1:
        raise ValueError(f"grid_size must be a pair (h, w) of positive ints, got {grid_size!r}")
    if patch_size <= 0:
        raise ValueError(f"patch_size must be positive, got {patch_size}")
    return distance_unit * patch_size * (max(h, w) - 1)


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


# ----------------------------------------------------------------------------------------------------
# head types
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadTypeThresholds:
    """Thresholds of :func:`head_types`; statistics as in :func:`aam_statistics`, offsets in tokens.

    Attributes:
        strict_mass_3x3: ``strict_local`` needs at least this fraction of the AAAM mass in the centre 3x3
            (self + 8 neighbours). 0.8 means the head looks almost only at the query and its immediate
            neighbours; uniform attention on a 14x14 grid puts only ~4 % there, so the rule is far from the
            global regime, and a head that leaks 20 % further out is already "soft".
        axial_anisotropy: ``axial`` needs ``max(a, 1/a) >=`` this, ``a = var_y / var_x``. 4 means a standard
            deviation at least twice as large along one axis as across it: clearly elongated, while
            Gaussian-like local heads (a ~ 1) stay well below.
        axial_band_mass: ``axial`` needs at least this fraction of mass on the centre row (horizontal) or
            centre column (vertical). 0.5: most of the mass lies exactly on the query's own row/column,
            which separates axial heads from merely stretched blobs.
        axial_min_std: ``axial`` needs a standard deviation along its axis of at least this many tokens. 1.0
            keeps a head that attends to a single neighbour (anisotropy is then huge, because the variance
            across is 0) out of ``axial``: elongation has to extend over several tokens. Row attention on a
            3x3 grid already has std 1.15.
        offset_min: ``offset_local`` needs a centre-of-mass offset of at least this many tokens. 0.5 means
            the mass centre is closer to a neighbour than to the query itself on the token grid.
        offset_peak_mass: ``offset_local`` needs at least this fraction of mass within the 3x3 around the
            (off-centre) peak, i.e. the displaced attention is itself local. 0.5: most of it sits there.
        global_entropy: ``global`` needs ``entropy_norm >=`` this (1 = uniform attention). 0.8 admits
            near-uniform heads and heads attending to a fixed region of the image (~0.84 on 14x14) but not
            local heads (a Gaussian of 1.5 tokens on 14x14 gives ~0.6).
        global_spread: ``global`` needs ``spread_norm >=`` this (1 = uniform attention). 0.5: mass reaches
            at least half as far as under uniform attention.
        global_max_locality: ``global`` needs ``locality`` (centre-3x3 mass over uniform attention's on the
            same grid, :func:`aam_statistics`) below this. 2: a head whose immediate neighbourhood gets at
            least twice its uniform share attends locally, however long its tail. This is the rule that scales
            with the grid: entropy and spread are normalised by uniform attention too, but a mixture of a
            local peak and a broad background keeps both near 1, and a local head of fixed size in tokens
            gets more "global" by them the smaller the grid (on 8x8, heads with 30-40 % of their mass in the
            centre 3x3, three times uniform's 12 %, have ``entropy_norm`` 0.82-0.88 and ``spread_norm``
            0.7-0.8).
        global_min_distance: only used when ``distance`` is passed to :func:`head_types`: ``global`` then
            also needs a mean attention distance (unit square, :func:`attention_distance`) of at least this.
            0.25 is about half the value of uniform attention on a square grid (0.56 on 14x14, 0.52 in the
            continuum limit).
        soft_peak_radius: ``soft_local`` needs the peak within this Chebyshev distance (tokens) of the
            centre. 1: peak on the query or on one of its 8 neighbours.
    """

    strict_mass_3x3: float = 0.8
    axial_anisotropy: float = 4.0
    axial_band_mass: float = 0.5
    axial_min_std: float = 1.0
    offset_min: float = 0.5
    offset_peak_mass: float = 0.5
    global_entropy: float = 0.8
    global_spread: float = 0.5
    global_max_locality: float = 2.0
    global_min_distance: float = 0.25
    soft_peak_radius: int = 1


_DIRECTIONS = ("right", "up-right", "up", "up-left", "left", "down-left", "down", "down-right")


def _direction_name(angle_deg: float) -> str:
    """One of 8 compass names for an angle counter-clockwise from "right" ("up" = +90); 45° sectors."""
    return _DIRECTIONS[int(round(angle_deg / 45.0)) % 8]


def head_types(
    aaam: Tensor,
    distance: Tensor | None = None,
    thresholds: HeadTypeThresholds | Mapping[str, float] | None = None,
) -> list[dict[str, object]]:
    """Classify each head by the shape of its aligned aggregated attention map.

    The rules are tried in this fixed order and the first that matches decides (statistics from
    :func:`aam_statistics`, thresholds ``t`` from :class:`HeadTypeThresholds`):

    1. ``"strict_local"``: peak at the centre and ``mass_3x3 >= t.strict_mass_3x3``. Statistic ``mass_3x3``.
    2. ``"axial"``: ``max(a, 1/a) >= t.axial_anisotropy`` (``a = anisotropy``) and, along the long axis,
       band mass ``>= t.axial_band_mass`` and standard deviation ``>= t.axial_min_std``. Direction
       ``"horizontal"`` (along the centre row, ``a < 1``) or ``"vertical"``. Statistic ``anisotropy``.
       Tried before ``offset_local`` so an elongated head with a one-sided bias is still axial.
    3. ``"offset_local"``: peak not at the centre, centre-of-mass ``offset >= t.offset_min`` and
       ``peak_mass_3x3 >= t.offset_peak_mass``. Direction: the centre-of-mass angle snapped to one of
       ``right, up-right, up, up-left, left, down-left, down, down-right`` (45° sectors). Statistic
       ``offset``.
    4. ``"global"``: ``entropy_norm >= t.global_entropy``, ``spread_norm >= t.global_spread`` and
       ``locality < t.global_max_locality`` (and, when ``distance`` is given, ``distance >=
       t.global_min_distance``). Statistic ``entropy_norm``.
    5. ``"soft_local"``: peak within Chebyshev distance ``t.soft_peak_radius`` of the centre (mass too spread
       for ``strict_local``, not spread enough for ``global``). Statistic ``mass_3x3``.
    6. ``"mixed"``: none of the above (e.g. several distant modes). Statistic ``entropy_norm``.

    Args:
        aaam: ``(H, 2h - 1, 2w - 1)`` aligned aggregated attention maps (:func:`aligned_maps`).
        distance: optional mean attention distance per head on the unit square, ``(H,)`` or ``(B, H)``
            (averaged over ``B``), from :func:`attention_distance`; reported and used by the ``global`` rule.
        thresholds: a :class:`HeadTypeThresholds`, a mapping of field overrides, or None for the defaults.

    Returns:
        One dict per head: ``{"head": int, "type": str, "direction": str | None, "offset": float (centre of
        mass offset length in tokens), "statistic": str, "value": float}``, plus ``"distance": float`` when
        ``distance`` is given.
    """
    if thresholds is None:
        t = HeadTypeThresholds()
    elif isinstance(thresholds, HeadTypeThresholds):
        t = thresholds
    elif isinstance(thresholds, Mapping):
        known = {f.name for f in fields(HeadTypeThresholds)}
        unknown = set(thresholds) - known
        if unknown:
            raise ValueError(f"unknown head-type thresholds {sorted(unknown)}; known: {sorted(known)}")
        t = HeadTypeThresholds(**thresholds)
    else:
        raise TypeError(f"thresholds must be HeadTypeThresholds, a mapping or None, got {type(thresholds)}")

    canvas, _, _ = _canvas_geometry(aaam)
    H = canvas.shape[0]
    stats = {k: v.tolist() for k, v in aam_statistics(canvas).items()}
    dist: list[float] | None = None
    if distance is not None:
        d = torch.as_tensor(distance, dtype=torch.float64)
        if d.ndim == 2:
            d = d.mean(dim=0)
        if d.ndim != 1 or d.shape[0] != H:
            raise ValueError(f"distance must have shape (H,) or (B, H) with H={H}, got {tuple(d.shape)}")
        dist = d.tolist()

    out: list[dict[str, object]] = []
    for i in range(H):
        s = {k: v[i] for k, v in stats.items()}
        peak_at_centre = s["peak_dy"] == 0 and s["peak_dx"] == 0
        peak_cheb = max(abs(s["peak_dy"]), abs(s["peak_dx"]))
        ratio = max(s["anisotropy"], 1.0 / s["anisotropy"])
        horizontal = s["anisotropy"] < 1.0
        band = s["mass_row"] if horizontal else s["mass_col"]
        axis_std = math.sqrt(s["var_x"] if horizontal else s["var_y"])
        direction: str | None = None
        if peak_at_centre and s["mass_3x3"] >= t.strict_mass_3x3:
            kind, stat = "strict_local", "mass_3x3"
        elif ratio >= t.axial_anisotropy and band >= t.axial_band_mass and axis_std >= t.axial_min_std:
            kind, stat = "axial", "anisotropy"
            direction = "horizontal" if horizontal else "vertical"
        elif not peak_at_centre and s["offset"] >= t.offset_min and s["peak_mass_3x3"] >= t.offset_peak_mass:
            kind, stat = "offset_local", "offset"
            direction = _direction_name(s["angle"])
        elif (
            s["entropy_norm"] >= t.global_entropy
            and s["spread_norm"] >= t.global_spread
            and s["locality"] < t.global_max_locality
            and (dist is None or dist[i] >= t.global_min_distance)
        ):
            kind, stat = "global", "entropy_norm"
        elif peak_cheb <= t.soft_peak_radius:
            kind, stat = "soft_local", "mass_3x3"
        else:
            kind, stat = "mixed", "entropy_norm"
        entry: dict[str, object] = {
            "head": i,
            "type": kind,
            "direction": direction,
            "offset": float(s["offset"]),
            "statistic": stat,
            "value": float(s[stat]),
        }
        if dist is not None:
            entry["distance"] = float(dist[i])
        out.append(entry)
    return out


# ----------------------------------------------------------------------------------------------------
# attention collapse
# ----------------------------------------------------------------------------------------------------


def attention_nmi(attn: Tensor, num_prefix_tokens: int) -> Tensor:
    """Normalised mutual information between spatial queries and keys (Park et al., ICLR 2023).

    With ``p(q) = 1 / S`` uniform over the spatial queries, ``p(k | q) = A_qk`` the renormalised spatial
    attention and ``p(k) = sum_q p(q) A_qk``::

        MI  = sum_q sum_k p(q) A_qk log(A_qk / p(k))         (0 log 0 = 0)
        NMI = MI / sqrt(H(q) H(k)),  H(q) = log S,  H(k) = -sum_k p(k) log p(k)

    NMI is 0 when every query attends alike (attention collapse) and 1 when the queries attend to distinct
    keys one-to-one. When ``H(q) H(k) = 0`` (a single spatial token, or all mass on a single key) the MI is
    0 too and NMI is defined as 0.

    Returns:
        ``(B, H)`` in the dtype of ``attn`` (logs in the input dtype, sums in float64).
    """
    A = spatial_attention(attn, num_prefix_tokens)
    S = A.shape[-1]
    pk = A.sum(dim=-2, dtype=torch.float64) / S  # (B, H, S)
    pk_t = pk.to(A.dtype).unsqueeze(-2)
    ratio = A / pk_t.clamp_min(torch.finfo(A.dtype).tiny)
    terms = torch.where(A > 0, A * torch.log(torch.where(A > 0, ratio, torch.ones_like(ratio))), 0.0)
    mi = terms.sum(dim=(-2, -1), dtype=torch.float64) / S
    h_k = -torch.xlogy(pk, pk).sum(dim=-1)
    h_q = math.log(S)
    denom = torch.sqrt(h_k * h_q)
    nmi = torch.where(denom > EPS, mi / denom.clamp_min(EPS), torch.zeros_like(mi))
    return nmi.to(attn.dtype)


# ----------------------------------------------------------------------------------------------------
# saliency
# ----------------------------------------------------------------------------------------------------


def top_mass_mask(weights: Tensor, mass: float = 0.6) -> Tensor:
    """Smallest set of tokens holding a fraction ``mass`` of the total weight.

    Along the last dim, weights (non-negative) are sorted in descending order with a *stable* sort, so equal
    weights keep their original order (the lower index comes first). The cumulative sum (float64) is taken
    in that order, and token ``i`` is kept iff the cumulative weight strictly *before* it is
    ``< mass * total`` (``total`` = the full cumulative sum). The kept set is therefore the shortest prefix
    of the sorted order whose sum reaches at least ``mass * total``: reaching it exactly is enough (the next
    token is not added, up to floating-point rounding), ties at the cut are resolved in favour of the lower
    index, and zero-weight tokens are never needed. An all-zero row gives an empty set.

    Args:
        weights: ``(..., S)`` non-negative weights, normally summing to 1.
        mass: fraction in ``(0, 1]``.

    Returns:
        Bool tensor of the shape of ``weights``.
    """
    if not isinstance(weights, Tensor) or weights.ndim < 1:
        raise ValueError("weights must be a tensor with at least one dimension (..., S)")
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    sorted_w, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    csum = sorted_w.to(torch.float64).cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(csum[..., :1]), csum[..., :-1]], dim=-1)
    keep_sorted = before < mass * csum[..., -1:]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _masks_to_grid(masks: Tensor, grid_size: tuple[int, int], batch: int) -> Tensor:
    """(B, h, w) masks as-is, or (B, Hpx, Wpx) area-averaged to the grid; foreground iff mean >= 0.5."""
    if not isinstance(masks, Tensor) or masks.ndim != 3:
        shape = tuple(masks.shape) if isinstance(masks, Tensor) else type(masks).__name__
        raise ValueError(f"masks must be a tensor (B, h, w) or (B, Hpx, Wpx), got {shape}")
    if masks.shape[0] != batch:
        raise ValueError(f"masks has batch size {masks.shape[0]} but attn has {batch}")
    h, w = grid_size
    m = masks.to(torch.float64)
    if tuple(masks.shape[-2:]) != (h, w):
        if masks.shape[-2] < h or masks.shape[-1] < w:
            raise ValueError(
                f"masks of spatial size {tuple(masks.shape[-2:])} are smaller than the grid {(h, w)}"
            )
        m = F.adaptive_avg_pool2d(m.unsqueeze(1), (h, w)).squeeze(1)
    return (m >= 0.5).reshape(batch, h * w)


@functools.cache
def _uniform_top_mass(S: int, mass: float) -> int:
    """How many tokens :func:`top_mass_mask` keeps of a uniform row of ``S``: its rule in Python floats (no tensor
    to read back), ``ceil(mass · S)`` up to the rounding of the running sum."""
    w, before, total, k = 1.0 / S, 0.0, 0.0, 0
    for _ in range(S):
        total += w
    for _ in range(S):
        if before < mass * total:
            k += 1
        before += w
    return k


def uniform_saliency_iou(masks: Tensor, grid_size: tuple[int, int], mass: float = 0.6) -> Tensor:
    """The :func:`saliency_iou` of uniform attention, per image: the reference level of a map with no spatial
    preference. Every token of a uniform map ties, so its top-mass set is ``k`` tokens (``k`` = the size of
    :func:`top_mass_mask` of a uniform row at ``mass``, ``ceil(mass · S)``), any ``k`` of the ``S`` with equal
    chance (the index order that breaks exact ties is an artefact; a nearly uniform map breaks them at random).
    With ``F`` foreground tokens (``masks`` as :func:`saliency_iou` reads them) the overlap ``X`` is then
    hypergeometric (``S``, ``F``, ``k``) and the IoU ``X / (k + F - X)``; this returns its expectation, summed
    exactly over ``X``. ``(B,)`` float64 on the masks' device (no copy to the host)."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    h, w = grid_size
    S = h * w
    gt = _masks_to_grid(masks, (h, w), masks.shape[0])
    fg = gt.sum(-1, dtype=torch.float64).unsqueeze(-1)  # (B, 1)
    k = float(_uniform_top_mass(S, float(mass)))
    x = torch.arange(S + 1, dtype=torch.float64, device=gt.device)  # (S + 1,) the possible overlaps

    def log_choose(n: Tensor, r: Tensor) -> Tensor:
        return torch.lgamma(n + 1) - torch.lgamma(r + 1) - torch.lgamma(n - r + 1)

    ok = (x <= fg) & (x <= k) & (k - x <= S - fg)
    xs, rest = torch.minimum(x, fg), torch.clamp(torch.minimum(k - x, S - fg), min=0.0)
    log_p = log_choose(fg, xs) + log_choose(S - fg, rest) - log_choose(fg.new_full((), float(S)), fg.new_full((), k))
    p = torch.where(ok, log_p.exp(), torch.zeros_like(log_p))
    return (p * x / (k + fg - x).clamp_min(1.0)).sum(-1)


def _saliency_weights(attn: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int, query: str) -> Tensor:
    if query == "cls":
        return cls_attention_maps(attn, grid_size, num_prefix_tokens).flatten(-2)
    if query == "mean":
        _check_grid(attn, grid_size, num_prefix_tokens)
        return spatial_attention(attn, num_prefix_tokens).mean(dim=-2)
    raise ValueError(f"query must be 'cls' or 'mean', got {query!r}")


def saliency_iou(
    attn: Tensor,
    masks: Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    mass: float = 0.6,
    query: Literal["cls", "mean"] = "cls",
) -> Tensor:
    """IoU between the top-mass attention set and a ground-truth foreground, per image and head.

    The attention weights over the spatial tokens are the CLS row (``query="cls"``; spatial keys,
    renormalised; needs ``num_prefix_tokens >= 1``) or the mean of all renormalised spatial query rows
    (``query="mean"``). The predicted set is :func:`top_mass_mask` of those weights at ``mass``. The ground
    truth ``masks`` is either ``(B, h, w)`` at token resolution (bool; a float mask is thresholded at 0.5)
    or ``(B, Hpx, Wpx)`` at pixel resolution (bool or float in [0, 1]), which is area-averaged to ``(h, w)``
    (``adaptive_avg_pool2d``; exact block means when the sizes divide) and a token is foreground iff its
    covered fraction is ``>= 0.5``. IoU is computed at token resolution; NaN when both sets are empty.

    Returns:
        ``(B, H)`` in the dtype of ``attn``.
    """
    h, w = _check_grid(attn, grid_size, num_prefix_tokens)
    weights = _saliency_weights(attn, (h, w), num_prefix_tokens, query)  # (B, H, S)
    pred = top_mass_mask(weights, mass)
    gt = _masks_to_grid(masks, (h, w), attn.shape[0]).to(attn.device).unsqueeze(1)  # (B, 1, S)
    inter = (pred & gt).sum(dim=-1, dtype=torch.float64)
    union = (pred | gt).sum(dim=-1, dtype=torch.float64)
    iou = torch.where(union > 0, inter / union.clamp_min(1.0), torch.full_like(inter, math.nan))
    return iou.to(attn.dtype)


def saliency_iou_merged(
    attn: Tensor,
    masks: Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    mass: float = 0.6,
    query: Literal["cls", "mean"] = "cls",
) -> Tensor:
    """:func:`saliency_iou` on the attention averaged over heads first; returns ``(B,)``."""
    _check_attn(attn)
    merged = attn.mean(dim=1, keepdim=True)
    return saliency_iou(merged, masks, grid_size, num_prefix_tokens, mass=mass, query=query)[:, 0]
