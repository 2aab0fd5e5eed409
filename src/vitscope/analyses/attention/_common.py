"""Shared helpers of the attention analyses (`vitscope.analyses.attention`): the hot path (per-layer
reductions that never materialise another ``(B, H, S, S)`` tensor, shared by the analyses of one pass), the
per-layer plumbing and the standard error of a streamed mean.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import pandas as pd
import torch
import torch.nn.functional as F

from vitscope.analyses.base import Analysis
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, moved
from vitscope.metrics import attention as A
from vitscope.metrics.intervals import Z95

HEAD_TYPES = ("strict_local", "soft_local", "axial", "offset_local", "global", "mixed")
"""Every type :func:`vitscope.metrics.attention.head_types` can return, in the order figures list them."""


# ----------------------------------------------------------------------------------------------------
# hot path: per-layer reductions that never materialise another (B, H, S, S) tensor
# ----------------------------------------------------------------------------------------------------


_SHARED: dict[int, tuple[weakref.ref[torch.Tensor], int, dict[tuple[int, str], torch.Tensor]]] = {}
"""Small reductions of captured attention tensors, by tensor identity, shared by the analyses of one pass.

Every analysis reads the same ``block{i}.attn`` tensor of a batch, and several need the same row sums,
image sum or query mean of it: the first computes them, the others reuse them. Only results that are new
tensors (never views of the attention) are kept, so the entry does not keep the attention alive; it is
dropped when the tensor is freed (weakref callback). A tensor modified in place is recomputed (version
counter; captured inference tensors have none and are read-only by the analysis protocol)."""


def _shared_results(attn: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    key = id(attn)
    try:
        version = attn._version
    except RuntimeError:  # inference tensors do not track a version counter
        version = -1
    entry = _SHARED.get(key)
    if entry is None or entry[0]() is not attn or entry[1] != version:

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            if key in _SHARED and _SHARED[key][0] is ref:
                del _SHARED[key]

        entry = (weakref.ref(attn, forget), version, {})
        _SHARED[key] = entry
    return entry[2]


class _Spatial:
    """One layer's attention as the streaming analyses read it, without copies.

    ``R = attn[..., p:, p:]`` is a view of the spatial block and ``inv`` the inverse of each spatial row's
    mass (floored at ``A.EPS`` as in :func:`~vitscope.metrics.attention.spatial_attention`), so the spatial
    attention ``A.spatial_attention(attn, p)`` is ``R * inv[..., None]``; it is never formed. Element-wise
    work is in the input dtype; the callers accumulate the small results in float64. Reductions are
    computed once per captured tensor and shared between analyses (:data:`_SHARED`).
    """

    def __init__(self, attn: torch.Tensor, num_prefix_tokens: int):
        self.attn = attn
        self.p = num_prefix_tokens
        self.R = attn[..., num_prefix_tokens:, num_prefix_tokens:]
        self._memo = _shared_results(attn)

    def _get(self, name: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = (self.p, name)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @property
    def s(self) -> torch.Tensor:
        """``(B, H, S)`` spatial mass of each query row."""
        return self._get("s", lambda: self.R.sum(-1))

    @property
    def inv(self) -> torch.Tensor:
        """``(B, H, S)`` ``1 / max(s, EPS)``."""
        return self._get("inv", lambda: 1.0 / self.s.clamp_min(A.EPS))

    @property
    def full_rows(self) -> torch.Tensor:
        """0-d bool tensor: every spatial row is renormalised to sum 1 (no row with mass below EPS), the
        condition under which metrics that are linear in the spatial attention may be evaluated on its sum over
        images renormalised (a tensor, not a Python bool: the pass does not wait for it)."""
        return self._get("full_rows", lambda: (self.s >= A.EPS).all())

    def image_sum(self, max_elements: int = 1 << 21) -> torch.Tensor:
        """``(H, S, S)`` sum over images of the spatial attention, a few images at a time so that the scaled
        temporary (at most ``max_elements``) stays in cache: measured faster than a per-head batched matmul
        or an einsum, which copy the strided attention."""

        def compute() -> torch.Tensor:
            R, inv = self.R, self.inv.to(self.R.dtype)
            chunk = max(1, max_elements // max(R[0].numel(), 1))
            acc = (R[:chunk] * inv[:chunk].unsqueeze(-1)).sum(0)
            for b in range(chunk, R.shape[0], chunk):
                acc += (R[b:b + chunk] * inv[b:b + chunk].unsqueeze(-1)).sum(0)
            return acc

        return self._get("image_sum", compute)

    def query_mean(self, inv: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, H, S)``: mean over the spatial queries of the rows ``R_q * inv_q`` (``inv`` defaults to the
        per-row renormalisation, giving the mean of the spatial attention rows), as one batched matmul."""
        B, H, S, _ = self.R.shape

        def compute(inv: torch.Tensor) -> torch.Tensor:
            w = inv.reshape(B * H, 1, S).to(self.R.dtype)
            return torch.bmm(w, self.R.reshape(B * H, S, S)).reshape(B, H, S) / S

        if inv is None:
            return self._get("query_mean", lambda: compute(self.inv))
        return compute(inv)

    def image_distance(self, grid: tuple[int, int], max_elements: int = 1 << 21) -> torch.Tensor:
        """``(B, H)`` float64 mean attention distance of each image (as
        :func:`~vitscope.metrics.attention.attention_distance`): ``sum_k R_qk D_qk`` row by row, a few images at
        a time so the product stays in cache, then scaled by ``inv`` and averaged over the queries."""

        def compute() -> torch.Tensor:
            R = self.R
            D = _distance_matrix(grid, R.dtype, R.device)
            rows = torch.empty(R.shape[:-1], dtype=torch.float64, device=R.device)
            chunk = max(1, max_elements // max(R[0].numel(), 1))
            for b in range(0, R.shape[0], chunk):
                torch.sum(R[b:b + chunk] * D, dim=-1, dtype=torch.float64, out=rows[b:b + chunk])
            return (rows * self.inv.double()).mean(-1)

        return self._get(f"image_distance{tuple(grid)}", compute)

    def row_xlogx(self, max_elements: int = 1 << 24) -> torch.Tensor:
        """``(B, H, S)``: ``sum_k R_qk log R_qk``, in as few chunks of images as keep the one temporary under
        ``max_elements`` (few large ops: on a shared machine every op's thread barrier costs, see
        benchmarks/attention.py). ``0 log 0 = 0``: ``log 0 = -inf`` times 0 is NaN, which ``nansum`` skips (one
        pass fewer than clamping first); a NaN in the attention still reaches the result through ``s``."""
        out = torch.empty(self.R.shape[:-1], dtype=self.R.dtype, device=self.R.device)
        chunk = max(1, max_elements // max(self.R[0].numel(), 1))
        for b in range(0, self.R.shape[0], chunk):
            r = self.R[b:b + chunk]
            torch.nansum(r.log().mul_(r), dim=-1, out=out[b:b + chunk])
        return out


_DISTANCES: dict[tuple[tuple[int, int], torch.dtype, torch.device], torch.Tensor] = {}


def _distance_matrix(grid: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(S, S)`` distances between patch positions on the unit square (as in `vitscope.metrics.attention`),
    cached per grid, dtype and device."""
    key = (tuple(grid), dtype, device)
    if key not in _DISTANCES:
        h, w = grid
        scale = max(max(h, w) - 1, 1)
        pos = torch.stack(torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                                         indexing="ij"), -1).reshape(-1, 2) / scale
        _DISTANCES[key] = torch.cdist(pos, pos).to(device=device, dtype=dtype)
    return _DISTANCES[key]


def _canvas_and_distance(sps: Sequence[_Spatial], grid: tuple[int, int], with_canvas: bool = True
                         ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """For each layer's attention, the sum over the batch of the AAAM canvas (``(L, H, 2h-1, 2w-1)``, None
    unless ``with_canvas``) and of the mean attention distance (``(L, H)``), float64 on the attention's device.

    Both metrics are linear in the spatial attention, so they are evaluated on its sum over the ``B`` images
    (`_Spatial.image_sum`, one read of the attention), all layers at once (their ``L x H`` sums as heads).
    When every row of a layer was renormalised to sum 1 (`_Spatial.full_rows`), that sum's rows sum to ``B``
    and it is renormalised and scaled by ``B`` as :func:`~vitscope.metrics.attention.aligned_maps` and
    :func:`~vitscope.metrics.attention.attention_distance` do (their cores, `distance_of_spatial` and
    `canvas_of_spatial`, do the rest); a layer with a row without spatial mass (which counts as zeros) is
    summed as it is. The choice is a
    ``torch.where`` on the device, so the pass never waits for it."""
    L, (B, H) = len(sps), sps[0].attn.shape[:2]
    h, w = grid
    M = torch.stack([sp.image_sum() for sp in sps]).flatten(0, 1)  # (L * H, S, S)
    full = torch.stack([sp.full_rows for sp in sps]).unsqueeze(1).expand(L, H).reshape(L * H)
    X = torch.where(full[:, None, None], A._renormalise(M), M)
    scale = torch.where(full, float(B), 1.0).double()  # (L * H,)
    per_query = A.distance_of_spatial(X, grid, _distance_matrix(grid, M.dtype, M.device))  # (L * H,)
    # a renormalised layer's distance is rounded to the attention's dtype, as attention_distance returns it
    dist = torch.where(full, per_query.to(M.dtype).double() * scale, per_query).reshape(L, H)
    if not with_canvas:
        return None, dist
    canvas = A.canvas_of_spatial(X, grid) * scale[:, None, None]
    return canvas.reshape(L, H, 2 * h - 1, 2 * w - 1), dist


def _nmi(sps: Sequence[_Spatial]) -> torch.Tensor:
    """``(L, B, H)`` float64: :func:`~vitscope.metrics.attention.attention_nmi` of each layer (Park et al. 2023).

    Rearranged so that the only pass over the full attention is one ``R log R``: with ``A = R * inv`` and
    ``p(k) = mean_q A_qk``, ``MI = mean_q sum_k A_qk log A_qk + H(k)`` (because ``sum_q p(q) A_qk = p(k)``),
    and ``sum_k A_qk log A_qk = inv_q sum_k R_qk log R_qk + (inv_q s_q) log inv_q`` (0 for an empty row).
    The small float64 part runs once on all layers stacked."""
    S = sps[0].s.shape[-1]
    pk = torch.stack([sp.query_mean() for sp in sps]).double()
    xlogx = torch.stack([sp.row_xlogx() for sp in sps]).double()
    inv = torch.stack([sp.inv for sp in sps]).double()
    w = inv * torch.stack([sp.s for sp in sps]).double()
    h_k = -torch.xlogy(pk, pk).sum(-1)
    mi = (inv * xlogx + torch.log(inv) * w).mean(-1) + h_k
    denom = torch.sqrt(h_k * math.log(S))
    return torch.where(denom > A.EPS, mi / denom.clamp_min(A.EPS), torch.zeros_like(mi))


def _saliency_iou_of(weights: torch.Tensor, grid_masks: torch.Tensor, grid: tuple[int, int], mass: float
                     ) -> torch.Tensor:
    """:func:`~vitscope.metrics.attention.saliency_iou` of given attention weights over the spatial tokens,
    ``(B, H', S) -> (B, H')``: its CLS query is row 0 of the attention it is given, so it gets a broadcast
    view (no copy) in which every row is ``[0, weights]`` (one prefix token with no mass)."""
    B, Hh, S = weights.shape
    rows = F.pad(weights, (1, 0)).unsqueeze(2).expand(B, Hh, S + 1, S + 1)
    return A.saliency_iou(rows, grid_masks, grid, 1, mass=mass, query="cls")


class _LayerAttention(Analysis):
    """Shared plumbing: the requested blocks, their ``block{i}.attn`` taps, and merge compatibility."""

    def __init__(self, vm: Any, layers: Any = None):
        super().__init__(vm)
        self.layers = self.layers_param(layers)

    def required_taps(self) -> list[str]:
        return [f"block{i}.attn" for i in self.layers]

    def _settings(self) -> dict[str, Any]:
        """Everything two parts must share to be merged (the layers, plus parameters of subclasses)."""
        return {"layers": list(self.layers)}

    def _check_mergeable(self, other: Analysis) -> None:
        if type(other) is not type(self):
            raise VitscopeError(f"{self.name}: cannot merge a {type(other).__name__} into a {type(self).__name__}")
        mine, theirs = self._settings(), cast(_LayerAttention, other)._settings()
        if mine != theirs:
            raise VitscopeError(f"{self.name}: cannot merge parts computed with different settings: {mine} vs {theirs}")

    def _frame(self, columns: Mapping[str, Any]) -> pd.DataFrame:
        """``tidy`` on column arrays (large grids: building a frame from columns, not from row dicts)."""
        return self.tidy(cast(Any, dict(columns)))


class _PerHeadMean(_LayerAttention):
    """A per-image, per-head statistic of each layer's attention, averaged over images: subclasses define
    :meth:`batch_values` (the statistic of each of a batch's images); the state is a float64 ``(layers, heads)``
    sum, a sum of squares (for the spread over images) and a count."""

    state_version = 2  # 2: sums of squares (stderr over images)

    def __init__(self, vm: Any, layers: Any = None):
        super().__init__(vm, layers)
        self.sums = torch.zeros(len(self.layers), self.num_heads, dtype=torch.float64)
        self.sumsq = torch.zeros_like(self.sums)

    def batch_values(self, sps: list[_Spatial]) -> torch.Tensor:
        """``(layers, B, H)`` float64: the statistic of each layer's attention for each of the batch's images."""
        raise NotImplementedError

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        sps = [_Spatial(feats[f"block{i}.attn"], self.num_prefix_tokens) for i in self.layers]
        v = self.batch_values(sps).double()
        self.sums, self.sumsq = moved((self.sums, self.sumsq), v.device)
        self.sums += v.sum(1)
        self.sumsq += v.square().sum(1)
        self.n_images += len(batch)

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, _PerHeadMean)
        self._check_grid_merge(other)
        self.sums += other.sums.to(self.sums.device)
        self.sumsq += other.sumsq.to(self.sumsq.device)
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "sums": host_copy(self.sums), "sumsq": host_copy(self.sumsq),
                "n_images": self.n_images, "grid": list(self.grid_size)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.sums, self.n_images = list(state["layers"]), state["sums"].clone(), state["n_images"]
        self.sumsq = state["sumsq"].clone()
        self.grid_size = tuple(int(v) for v in state.get("grid", self.grid_size))

    def mean(self) -> torch.Tensor:
        """``(layers, heads)`` float64 mean over the images seen (0 before any image), on the CPU."""
        return self.sums.cpu() / max(self.n_images, 1)

    def stderr(self) -> torch.Tensor:
        """``(layers, heads)`` float64 standard error of the mean over images (sample standard deviation, ddof
        1, over sqrt(n)); NaN below two images. On the CPU."""
        return stderr_from_sums(self.sums.cpu(), self.sumsq.cpu(), self.n_images)

    def _stat_rows(self, metric: str, mean: torch.Tensor, se: torch.Tensor) -> list[dict[str, Any]]:
        """Rows of a per-(layer, head) statistic with its stderr and 95 % interval (mean ± 1.96 stderr)."""
        return [{"metric": metric, "layer": i, "head": h, "value": float(mean[j, h]), "stderr": float(se[j, h]),
                 "value_lo": float(mean[j, h] - Z95 * se[j, h]), "value_hi": float(mean[j, h] + Z95 * se[j, h])}
                for j, i in enumerate(self.layers) for h in range(self.num_heads)]




def stderr_from_sums(sums: torch.Tensor, sumsq: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """Standard error of a mean from the sum and the sum of squares of ``n`` values (elementwise):
    ``sqrt(var / n)`` with the sample variance ``(sumsq - sums² / n) / (n - 1)`` (clamped at 0 against
    rounding). NaN where ``n < 2``."""
    n_t = torch.as_tensor(n, dtype=torch.float64)
    var = (sumsq - sums.square() / n_t.clamp_min(1)) / (n_t - 1).clamp_min(1)
    se = torch.sqrt(var.clamp_min(0) / n_t.clamp_min(1))
    return torch.where(n_t >= 2, se, torch.full_like(se, float("nan")))
