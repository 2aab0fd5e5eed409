"""Token views: how a (B, T, D) tap becomes one vector (or a set of vectors) per image.

  cls          the CLS token                       (B, D)
  spatial      patch tokens only, prefix dropped   (B, S, D)
  gap          mean over all tokens                (B, D)
  gap_spatial  mean over patch tokens              (B, D)
  all          every token, unchanged              (B, T, D)

and `region_pool`: the mask-weighted mean of patch tokens over each object / part region of an image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitscope.errors import VitscopeError

VIEWS = ("cls", "spatial", "gap", "gap_spatial", "all")


def token_view(x: torch.Tensor, view: str, num_prefix_tokens: int, has_cls: bool = True) -> torch.Tensor:
    if x.ndim != 3:
        raise VitscopeError(f"token views apply to (B, T, D) taps; got shape {tuple(x.shape)}")
    if view == "cls":
        if not has_cls or num_prefix_tokens == 0:
            raise VitscopeError("this model has no CLS token; use the 'gap' or 'gap_spatial' view")
        return x[:, 0]
    if view == "spatial":
        return x[:, num_prefix_tokens:]
    if view == "gap":
        return x.mean(dim=1)
    if view == "gap_spatial":
        return x[:, num_prefix_tokens:].mean(dim=1)
    if view == "all":
        return x
    raise VitscopeError(f"unknown token view {view!r}; choose one of {', '.join(VIEWS)}")


def region_weights(maps: torch.Tensor, grid: tuple[int, int],
                   min_tokens: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """How much each region of each image covers each patch token.

    maps: (B, H, W) integer region ids at pixel resolution or at the grid (0 = background), or bool masks
    (one region, id 1). A region's weight on a token is the fraction of the token's pixels it covers (area
    average, exact block means when the sizes divide), normalised to sum to 1 over the tokens. Regions
    covering less than ``min_tokens`` tokens' worth of area are left out.
    Returns (weights (B, K, h * w) float32, region ids (B, K) with 0 marking padding), K = the most regions
    kept in one image. Pool any layer's patch tokens with `region_pool`.
    """
    h, w = grid
    if maps.ndim != 3:
        raise VitscopeError(f"region maps must be (B, H, W); got shape {tuple(maps.shape)}")
    if maps.shape[-2] < h or maps.shape[-1] < w:
        raise VitscopeError(f"region maps of size {tuple(maps.shape[-2:])} are smaller than the grid {grid}")
    maps = maps.long()
    per_image = []
    for m in maps:
        ids = torch.unique(m)
        ids = ids[ids > 0]
        onehot = (m[None] == ids[:, None, None]).to(torch.float32)  # (k, H, W)
        wts = F.adaptive_avg_pool2d(onehot[:, None], (h, w)).reshape(len(ids), h * w)
        mass = wts.sum(1)
        keep = mass >= min_tokens
        per_image.append((wts[keep] / mass[keep, None], ids[keep]))
    k = max((len(i) for _, i in per_image), default=0)
    weights = torch.zeros(len(maps), k, h * w)
    region_ids = torch.zeros(len(maps), k, dtype=torch.long)
    for b, (wts, ids) in enumerate(per_image):
        weights[b, :len(ids)], region_ids[b, :len(ids)] = wts, ids
    return weights, region_ids


def region_pool(spatial: torch.Tensor, weights: torch.Tensor,
                region_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask-weighted means of patch tokens: ``spatial`` (B, S, D) (``token_view(x, 'spatial', ...)``) and the
    output of `region_weights` -> (vectors (R, D), image row in the batch (R,), region id (R,)), one row per
    region kept, images in order."""
    if weights.shape[0] != spatial.shape[0] or weights.shape[-1] != spatial.shape[1]:
        raise VitscopeError(f"region weights of shape {tuple(weights.shape)} do not fit patch tokens of shape "
                            f"{tuple(spatial.shape)}")
    valid = region_ids > 0
    pooled = torch.bmm(weights.to(spatial.dtype), spatial)  # (B, K, D)
    rows = torch.arange(len(spatial))[:, None].expand_as(region_ids)
    return pooled[valid], rows[valid], region_ids[valid]
