"""Attention-saliency IoU per layer and head against the foreground masks
(`vitscope.analyses.attention`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, cast

import pandas as pd
import torch

from vitscope.analyses.attention._common import (
    _LayerAttention,
    _saliency_iou_of,
    _Spatial,
    stderr_from_sums,
)
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.bounds import Range
from vitscope.errors import ConfigError, VitscopeError
from vitscope.host import host_copy
from vitscope.metrics import attention as A
from vitscope.metrics.intervals import Z95


@register_analysis
class SaliencyIoU(_LayerAttention):
    """Attention-saliency IoU per layer and head [Walmer et al. 2023 §4.4, Fig. 7]: the smallest
    set of spatial tokens holding ``mass`` (60 %) of a query's attention, against the ground-truth
    foreground (``batch.masks``, pixel resolution, area-downsampled to the patch grid), IoU at token
    resolution. Queries: ``"cls"`` (the CLS row over spatial keys) and ``"mean"`` (the mean of all spatial
    query rows). Also the heads merged (attention averaged over heads first).

    Per image the IoU is NaN when both sets are empty; such images are left out of that head's mean.
    Batches without masks (``masks is None``) are skipped and counted. A model without CLS token drops the
    ``"cls"`` query (with a warning at ``finalize``).

    Table (extra columns ``query``, ``n_images`` = images with a mask, ``n_skipped`` = images without):

    * ``iou``: mean IoU per (layer, head);
    * ``iou_best_head``: per layer, the head with the highest mean IoU (``head`` = its id, value = its IoU);
    * ``iou_merged``: per layer, mean IoU of the head-averaged attention (``head`` missing);
    * ``iou_uniform``: per query, no layer nor head: the mean IoU uniform attention gets on the same masks
      (`vitscope.metrics.attention.uniform_saliency_iou`: any ``ceil(mass · S)`` tokens with equal chance), the
      level of a map with no spatial preference;

    each with ``stderr`` over the images scored and the 95 % interval ``value_lo``, ``value_hi``.

    ``mask_rule`` (column ``mask_rule``): how the pixel mask becomes token-level. ``"coverage"`` (default, kept so
    that earlier results stay comparable): a token is foreground when the mask covers at least half of it.
    ``"authors"``: Walmer et al.'s rule (``vit_analysis``: the mask resized to the grid by PIL's bicubic
    ``Image.resize``, a token foreground when its value is > 0; `vitscope.metrics.attention.foreground_tokens`),
    which keeps every token the object touches, so masks are larger and IoUs differ from the coverage rule's.
    """

    name = "saliency_iou"
    # (mask_rule is a parameter: in the cache key, no state change)
    state_version = 3  # 3: the uniform-attention reference (iou_uniform); 2: sums of squares (stderr over images)
    needs = frozenset({"masks"})
    description = "IoU of the top-60%-mass attention tokens with the foreground, per layer and head"

    def __init__(self, vm: Any, layers: Any = None, queries: str | Sequence[str] = ("cls", "mean"),
                 mass: Annotated[float, Range(0, 1, open_lo=True)] = 0.6,
                 mask_rule: Literal["coverage", "authors"] = "coverage"):
        super().__init__(vm, layers)
        if mask_rule not in A.MASK_RULES:
            raise ConfigError(f"{self.name}: mask_rule must be one of {', '.join(A.MASK_RULES)}, got {mask_rule!r}")
        self.mask_rule = str(mask_rule)
        queries = [queries] if isinstance(queries, str) else list(queries)
        bad = [q for q in queries if q not in ("cls", "mean")]
        if bad or not queries:
            raise VitscopeError(f"{self.name}: queries must be among 'cls' and 'mean', got {queries!r}")
        if not 0.0 < float(mass) <= 1.0:
            raise VitscopeError(f"{self.name}: mass must be in (0, 1], got {mass}")
        self.requested_queries = list(dict.fromkeys(queries))
        self.queries = [q for q in self.requested_queries if q != "cls" or self.has_cls_token]
        self.mass = float(mass)
        Q, L, H = len(self.queries), len(self.layers), self.num_heads
        self.iou_sum = torch.zeros(Q, L, H, dtype=torch.float64)
        self.iou_count = torch.zeros(Q, L, H, dtype=torch.float64)
        self.iou_sumsq = torch.zeros(Q, L, H, dtype=torch.float64)
        self.merged_sum = torch.zeros(Q, L, dtype=torch.float64)
        self.merged_sumsq = torch.zeros(Q, L, dtype=torch.float64)
        self.merged_count = torch.zeros(Q, L, dtype=torch.float64)
        self.uniform_sums = torch.zeros(3, dtype=torch.float64)  # uniform attention's IoU: sum, sum of squares, images
        self.n_skipped = 0

    def required_taps(self) -> list[str]:
        return super().required_taps() if self.queries else []

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "queries": list(self.queries), "mass": self.mass, "mask_rule": self.mask_rule}

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if batch.masks is None:
            self.n_skipped += len(batch)
            return
        if not self.queries:
            self.n_images += len(batch)
            return
        g, p, B, H = self.grid_of(batch), self.num_prefix_tokens, len(batch), self.num_heads
        # the attention weights of every (layer, query) and of the heads merged, gathered so that the IoU
        # (top-mass sets, mask downsampling) runs once per batch on a small (B, N, S) tensor
        weights = []
        for i in self.layers:
            attn = feats[f"block{i}.attn"]
            sp = _Spatial(attn, p) if "mean" in self.queries else None
            for q in self.queries:
                if q == "cls":
                    per_head = A.cls_attention_maps(attn, g, p).flatten(-2)
                    # heads merged = attention averaged over heads first: its CLS row is the mean CLS row
                    merged = attn[:, :, 0, p:].mean(1, keepdim=True)
                else:
                    sp = cast(_Spatial, sp)
                    per_head = sp.query_mean()
                    # the head-averaged attention's spatial rows have mass s.mean(heads): renormalise by that
                    inv = 1.0 / sp.s.sum(1, keepdim=True).clamp_min(H * A.EPS)
                    merged = sp.query_mean(inv.expand_as(sp.s)).sum(1, keepdim=True)
                weights += [per_head, merged]
        W = torch.cat(weights, dim=1)  # (B, layers * queries * (H + 1), S)
        masks = A.foreground_tokens(batch.masks.to(W.device), g, self.mask_rule)  # (B, h, w) at the grid
        iou = _saliency_iou_of(W, masks, g, self.mass).double()
        uniform = A.uniform_saliency_iou(masks, g, self.mass)
        iou = iou.reshape(B, len(self.layers), len(self.queries), H + 1)
        ok = ~torch.isnan(iou)
        vals = torch.where(ok, iou, 0.0)
        sums, counts = vals.sum(0).transpose(0, 1), ok.sum(0).transpose(0, 1)  # (Q, L, H+1)
        sumsq = vals.square().sum(0).transpose(0, 1)
        for k in self._TENSORS:  # the sums live on the features' device
            setattr(self, k, getattr(self, k).to(iou.device))
        self.iou_sum += sums[..., :H]
        self.iou_sumsq += sumsq[..., :H]
        self.iou_count += counts[..., :H]
        self.merged_sum += sums[..., H]
        self.merged_sumsq += sumsq[..., H]
        self.merged_count += counts[..., H]
        self.uniform_sums += torch.stack([uniform.sum(), uniform.square().sum(), uniform.new_full((), float(B))])
        self.n_images += B

    _TENSORS = ("iou_sum", "iou_sumsq", "iou_count", "merged_sum", "merged_sumsq", "merged_count", "uniform_sums")

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, SaliencyIoU)
        for k in self._TENSORS:
            mine = getattr(self, k)
            mine.add_(getattr(other, k).to(mine.device))
        self.n_images += other.n_images
        self.n_skipped += other.n_skipped

    def state_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "queries": list(self.queries), "mass": self.mass,
                "mask_rule": self.mask_rule,
                "requested_queries": list(self.requested_queries), "n_images": self.n_images,
                "n_skipped": self.n_skipped, **{k: host_copy(getattr(self, k)) for k in self._TENSORS}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.queries = list(state["layers"]), list(state["queries"])
        self.requested_queries, self.mass = list(state["requested_queries"]), float(state["mass"])
        self.mask_rule = str(state.get("mask_rule", "coverage"))
        self.n_images, self.n_skipped = int(state["n_images"]), int(state["n_skipped"])
        for k in self._TENSORS:
            setattr(self, k, state[k].clone())

    def finalize(self) -> pd.DataFrame:
        dropped = [q for q in self.requested_queries if q not in self.queries]
        if dropped:
            warnings.warn(f"{self.name}: model {self.model_name!r} has no CLS token; query 'cls' is skipped",
                          UserWarning, stacklevel=2)
        if self.n_skipped:
            warnings.warn(f"{self.name}: {self.n_skipped} image(s) had no foreground mask and were skipped "
                          f"({self.n_images} used)", UserWarning, stacklevel=2)
        nan = float("nan")
        st = self.state_dict()  # the sums on the CPU
        per_head = torch.where(st["iou_count"] > 0, st["iou_sum"] / st["iou_count"].clamp_min(1), nan)
        merged = torch.where(st["merged_count"] > 0, st["merged_sum"] / st["merged_count"].clamp_min(1), nan)
        se_head = stderr_from_sums(st["iou_sum"], st["iou_sumsq"], st["iou_count"])
        se_merged = stderr_from_sums(st["merged_sum"], st["merged_sumsq"], st["merged_count"])

        def stat(value: torch.Tensor, se: torch.Tensor) -> dict[str, float]:
            v, e = float(value), float(se)
            return {"value": v, "stderr": e, "value_lo": v - Z95 * e, "value_hi": v + Z95 * e}

        rows: list[dict[str, Any]] = []
        for qi, q in enumerate(self.queries):
            for j, i in enumerate(self.layers):
                v = per_head[qi, j]
                rows += [{"metric": "iou", "layer": i, "head": h, "query": q, **stat(v[h], se_head[qi, j, h])}
                         for h in range(self.num_heads)]
                if torch.isnan(v).all():
                    rows.append({"metric": "iou_best_head", "layer": i, "head": None, "query": q, "value": nan})
                else:
                    best = int(torch.nan_to_num(v, nan=-1.0).argmax())
                    rows.append({"metric": "iou_best_head", "layer": i, "head": best, "query": q,
                                 **stat(v[best], se_head[qi, j, best])})
                rows.append({"metric": "iou_merged", "layer": i, "head": None, "query": q,
                             **stat(merged[qi, j], se_merged[qi, j])})
            u_sum, u_sumsq, u_n = st["uniform_sums"]
            rows.append({"metric": "iou_uniform", "layer": None, "head": None, "query": q,
                         **stat(u_sum / u_n if u_n > 0 else torch.tensor(nan), stderr_from_sums(u_sum, u_sumsq, u_n))})
        df = self.tidy(rows) if rows else self._frame({"query": []})
        df["n_images"] = self.n_images
        df["n_skipped"] = self.n_skipped
        df["mask_rule"] = self.mask_rule
        return df
