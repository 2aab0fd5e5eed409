"""Saliency: the smallest token set holding a share of the attention, its IoU with a foreground mask, and
the IoU that uniform attention reaches (the reference level)."""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from vitscope.metrics.attention.spatial import _check_attn, _check_grid, cls_attention_maps, spatial_attention

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


#: how a pixel-level foreground mask becomes token-level (`foreground_tokens`)
MASK_RULES = ("coverage", "authors")


def foreground_tokens(masks: Tensor, grid_size: tuple[int, int], rule: str = "coverage") -> Tensor:
    """(B, Hpx, Wpx) foreground masks (0 .. 1) -> (B, h, w) float 0/1 token masks, by ``rule``:

    * ``"coverage"``: a token is foreground when the mask covers at least half of its area (area average >= 0.5,
      `_masks_to_grid`); a mask already at the grid is read as-is.
    * ``"authors"``: Walmer et al.'s rule (``vit_analysis`` ``run_seg_analysis.py: prep_token_masks``): the 0/255
      mask resized to the grid by PIL's ``Image.resize`` (bicubic, antialiased when shrinking; rounded to 8 bits)
      and a token foreground when its value is > 0, i.e. any trace of the object in the token's bicubic
      footprint. Here torch's antialiased bicubic (``F.interpolate(mode='bicubic', align_corners=False,
      antialias=True)``, PIL's filter) on the 0-255 scale, a token kept when its value rounds to 1 or more
      (>= 0.5), as PIL's 8-bit output does. Its masks are larger than the coverage rule's (about a token's
      border wider), which lowers the IoU of compact attention maps.
    """
    if rule not in MASK_RULES:
        raise ValueError(f"mask rule must be one of {MASK_RULES}, got {rule!r}")
    h, w = grid_size
    if rule == "coverage" or tuple(masks.shape[-2:]) == (h, w):
        return _masks_to_grid(masks, (h, w), masks.shape[0]).reshape(-1, h, w).to(torch.float32)
    m = masks.to(torch.float32).clamp(0.0, 1.0) * 255.0  # 0/1 masks as PIL's 0/255 image
    up = F.interpolate(m[:, None], size=(h, w), mode="bicubic", align_corners=False, antialias=True)[:, 0]
    return (up >= 0.5).to(torch.float32)


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

    The attention weights over the spatial tokens are the CLS row (``query="cls"``: row 0, spatial keys,
    renormalised; needs ``num_prefix_tokens >= 1`` and a model whose token 0 is a CLS token, which the caller
    checks: in a model with registers and no CLS token it is a register) or the mean of all renormalised
    spatial query rows (``query="mean"``). The predicted set is :func:`top_mass_mask` of those weights at
    ``mass``. The ground truth ``masks`` is either ``(B, h, w)`` at token resolution (bool; a float mask is
    thresholded at 0.5) or ``(B, Hpx, Wpx)`` at pixel resolution (bool or float in [0, 1]), which is
    area-averaged to ``(h, w)`` (``adaptive_avg_pool2d``; exact block means when the sizes divide) and a token
    is foreground iff its covered fraction is ``>= 0.5``. IoU is computed at token resolution; NaN when both
    sets are empty.

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
