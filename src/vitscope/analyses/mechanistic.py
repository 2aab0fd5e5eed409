"""A mechanistic lens: attention rollout, the logit lens and high-norm artifact tokens (math in
`vitscope.metrics.mechanistic`).

=========================  ===================================================================================
analysis                   metrics (extra columns)
=========================  ===================================================================================
``attention_rollout``      ``rollout_map`` per (layer, grid cell) (``row``, ``col``); ``iou_rollout``,
                           ``iou_cls_attention``, ``iou_gain`` per layer (``stderr``, ``value_lo``,
                           ``value_hi``, ``n``); all with ``n_images``, ``n_masked``
``logit_lens``             ``top1_accuracy`` per layer (``value_lo``, ``value_hi``, ``n``, ``readout``);
                           ``kl_to_final``, ``agreement_with_final`` per layer (intervals, ``readout``)
``high_norm_tokens``       ``norm_quantile`` per (layer, quantile) (``quantile``, ``token_view``);
                           ``outliers_per_image``, ``images_with_outliers``, ``patch_variance``,
                           ``foreground_share``, ``cls_attention_absorbed`` per layer (``tokens``:
                           outliers / all, intervals); ``outlier_position`` per (layer, cell)
=========================  ===================================================================================

Every state is sums and counts of a size fixed by the model, so parts merge by addition (shards, resume).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, cast

import pandas as pd
import torch

from vitscope.analyses.attention import Z95, _saliency_iou_of, stderr_from_sums
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.bounds import Range
from vitscope.errors import VitscopeError
from vitscope.metrics import attention as A
from vitscope.metrics import mechanistic as M
from vitscope.metrics.semantics import binomial_interval


class _Means:
    """Streamed means over images of a ``shape``-d statistic: float64 sums, sums of squares and counts."""

    def __init__(self, *shape: int):
        self.sum = torch.zeros(*shape, dtype=torch.float64)
        self.sumsq = torch.zeros(*shape, dtype=torch.float64)
        self.count = torch.zeros(*shape, dtype=torch.float64)

    def add(self, values: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Values ``(B, *shape)``; ``ok`` (same shape, bool) selects those that count (NaN never does)."""
        v = values.double().cpu()
        ok = ~torch.isnan(v) if ok is None else ok.cpu() & ~torch.isnan(v)
        v = torch.where(ok, v, 0.0)
        self.sum += v.sum(0)
        self.sumsq += v.square().sum(0)
        self.count += ok.sum(0)

    def merge(self, other: _Means) -> None:
        self.sum += other.sum
        self.sumsq += other.sumsq
        self.count += other.count

    def state(self) -> dict[str, torch.Tensor]:
        return {"sum": self.sum.clone(), "sumsq": self.sumsq.clone(), "count": self.count.clone()}

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> _Means:
        m = cls(0)
        m.sum, m.sumsq, m.count = (state[k].clone() for k in ("sum", "sumsq", "count"))
        return m

    def row(self, *idx: int) -> dict[str, float]:
        """``value`` (mean; NaN without values), ``stderr`` and the 95 % interval of one entry, with ``n``."""
        s, q, n = float(self.sum[idx]), float(self.sumsq[idx]), int(self.count[idx])
        v = s / n if n else float("nan")
        se = float(stderr_from_sums(torch.tensor(s), torch.tensor(q), n))
        return {"value": v, "stderr": se, "value_lo": v - Z95 * se, "value_hi": v + Z95 * se, "n": n}


class _Mechanistic(Analysis):
    """Shared plumbing: settings that must agree to merge, and the tensors of the state."""

    _MEANS: tuple[str, ...] = ()
    _TENSORS: tuple[str, ...] = ()

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers)}

    def _check_mergeable(self, other: Analysis) -> None:
        if type(other) is not type(self):
            raise VitscopeError(f"{self.name}: cannot merge a {type(other).__name__} into a {type(self).__name__}")
        mine, theirs = self._settings(), cast(_Mechanistic, other)._settings()
        if mine != theirs:
            raise VitscopeError(f"{self.name}: cannot merge parts computed with different settings: {mine} vs {theirs}")

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        self._check_grid_merge(other)
        for k in self._MEANS:
            getattr(self, k).merge(getattr(other, k))
        for k in self._TENSORS:
            getattr(self, k).add_(getattr(other, k))
        self.n_images += other.n_images
        self.n_masked += other.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {"settings": self._settings(), "grid": list(self.grid_size), "n_images": self.n_images,
                "n_masked": self.n_masked, **{k: getattr(self, k).state() for k in self._MEANS},
                **{k: getattr(self, k).clone() for k in self._TENSORS}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k, v in state["settings"].items():
            setattr(self, k, v)
        self.grid_size = tuple(int(v) for v in state["grid"])
        self.n_images, self.n_masked = int(state["n_images"]), int(state["n_masked"])
        for k in self._MEANS:
            setattr(self, k, _Means.of(state[k]))
        for k in self._TENSORS:
            setattr(self, k, state[k].clone())


@register_analysis
class AttentionRollout(_Mechanistic):
    """Attention rollout (Abnar and Zuidema 2020) with the options of the public vit-explain code: per block
    the heads' attention fused (``head_fusion``: mean, max or min), the ``discard_ratio`` smallest fused
    weights of each image set to 0 (the first token's weight on itself kept), the residual added as
    ``0.5 A + 0.5 I`` and every row renormalised; the rollout up to block l is the product of those factors
    of blocks 0 .. l. Its CLS row over the patch tokens (prefix keys dropped, renormalised) is that block's
    rollout map.

    Beside ``saliency_iou`` and with its rule (the smallest set of tokens holding ``mass`` of the map, the mask
    area-averaged to the grid, IoU at token resolution), each map is scored against the foreground mask, and
    so is the head-averaged CLS attention of the same block (``saliency_iou``'s ``iou_merged``, CLS query):
    the table answers whether the rollout finds the object better than that block's CLS attention.

    Table (all rows carry ``n_images``, and ``n_masked`` = images with a mask):

    * ``rollout_map``: per (layer, grid cell) (``row``, ``col``), the mean over images of the rollout map;
    * ``iou_rollout`` / ``iou_cls_attention``: per layer, mean IoU of the rollout map / of the CLS attention
      with the foreground; ``iou_gain``: the mean per-image difference (rollout minus CLS attention); each with
      ``stderr`` over the images scored (``n``) and the 95 % interval ``value_lo``, ``value_hi``.

    A model without a CLS token has no CLS row to roll out: nothing is captured and the table is empty (with
    a warning)."""

    name = "attention_rollout"
    description = "attention rollout CLS maps per block and their foreground IoU beside the CLS attention's"
    _MEANS = ("iou_rollout", "iou_cls", "iou_gain")
    _TENSORS = ("map_sum",)

    def __init__(self, vm: Any, layers: Any = None, head_fusion: str = "mean",
                 discard_ratio: Annotated[float, Range(0, 0.99)] = 0.0,
                 mass: Annotated[float, Range(0, 1, open_lo=True)] = 0.6):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        if head_fusion not in M.HEAD_FUSIONS:
            raise VitscopeError(f"{self.name}: head_fusion must be one of {', '.join(M.HEAD_FUSIONS)}, "
                                f"got {head_fusion!r}")
        if not 0.0 <= float(discard_ratio) < 1.0:
            raise VitscopeError(f"{self.name}: discard_ratio must be in [0, 1), got {discard_ratio}")
        if not 0.0 < float(mass) <= 1.0:
            raise VitscopeError(f"{self.name}: mass must be in (0, 1], got {mass}")
        self.head_fusion, self.discard_ratio, self.mass = head_fusion, float(discard_ratio), float(mass)
        L = len(self.layers)
        self.map_sum = torch.zeros(L, *self.grid_size, dtype=torch.float64)
        self.iou_rollout, self.iou_cls, self.iou_gain = _Means(L), _Means(L), _Means(L)
        self.n_masked = 0

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio,
                "mass": self.mass}

    def required_taps(self) -> list[str]:
        return [f"block{i}.attn" for i in range(max(self.layers) + 1)] if self.has_cls_token else []

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.map_sum = torch.zeros(len(self.layers), *grid, dtype=torch.float64)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if not self.has_cls_token:
            self.n_images += len(batch)
            return
        g, p = self.pass_grid(batch), self.num_prefix_tokens
        attns = [feats[f"block{i}.attn"] for i in range(max(self.layers) + 1)]
        rows = M.attention_rollout(attns, self.head_fusion, self.discard_ratio)[:, self.layers]  # (B, L, T)
        maps = rows[..., p:]
        maps = maps / maps.sum(-1, keepdim=True).clamp_min(A.EPS)
        self.map_sum += maps.sum(0, dtype=torch.float64).reshape(len(self.layers), *g).cpu()
        self.n_images += len(batch)
        if batch.masks is None:
            return
        cls = torch.stack([feats[f"block{i}.attn"][:, :, 0, p:].mean(1) for i in self.layers], 1)
        iou = _saliency_iou_of(torch.cat([maps, cls.to(maps.dtype)], 1), batch.masks.to(maps.device), g, self.mass)
        iou = iou.double().cpu()
        L = len(self.layers)
        self.iou_rollout.add(iou[:, :L])
        self.iou_cls.add(iou[:, L:])
        self.iou_gain.add(iou[:, :L] - iou[:, L:])
        self.n_masked += len(batch)

    def mean_maps(self) -> torch.Tensor:
        """``(layers, h, w)`` float64 mean rollout map over the images seen."""
        return self.map_sum / max(self.n_images, 1)

    def finalize(self) -> pd.DataFrame:
        if not self.has_cls_token:
            warnings.warn(f"{self.name}: model {self.model_name!r} has no CLS token, so there is no CLS row to roll "
                          "out; the table is empty", UserWarning, stacklevel=2)
            return self.tidy([])
        rows: list[dict[str, Any]] = []
        if self.n_images:
            m = self.mean_maps()
            h, w = self.grid_size
            rows += [{"metric": "rollout_map", "layer": i, "row": r, "col": c, "value": float(m[j, r, c])}
                     for j, i in enumerate(self.layers) for r in range(h) for c in range(w)]
        for metric, means in (("iou_rollout", self.iou_rollout), ("iou_cls_attention", self.iou_cls),
                              ("iou_gain", self.iou_gain)):
            rows += [{"metric": metric, "layer": i, **means.row(j)} for j, i in enumerate(self.layers)]
        df = self.tidy(rows)
        df["n_images"], df["n_masked"] = self.n_images, self.n_masked
        df["head_fusion"], df["discard_ratio"] = self.head_fusion, self.discard_ratio
        return df
