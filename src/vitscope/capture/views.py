"""Token views: how a (B, T, D) tap becomes one vector (or a set of vectors) per image.

  cls          the CLS token                       (B, D)
  spatial      patch tokens only, prefix dropped   (B, S, D)
  gap          mean over all tokens                (B, D)
  gap_spatial  mean over patch tokens              (B, D)
  all          every token, unchanged              (B, T, D)
"""

from __future__ import annotations

import torch

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
