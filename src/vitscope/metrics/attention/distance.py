"""How far and how distinctly heads attend: the mean attention distance (on the unit square, or in pixels)
and the normalised mutual information between queries and keys (attention collapse)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitscope.metrics.attention.spatial import EPS, _check_grid, _grid_positions, spatial_attention

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
