"""Attention analyses, streamed over the ``block{i}.attn`` taps (math in `vitscope.metrics.attention`).

Sources (full references in `vitscope.references`): Walmer et al. 2023 ("Teaching Matters", CVPR) and Park et
al. 2023 ("What do self-supervised ViTs learn?", ICLR).

Every analysis here keeps state whose size depends on the model only (sums over images, a count, and at
most ``keep_images`` per-image maps), so memory does not grow with the dataset, and merging two parts
adds their sums: a merge of two shards equals one pass over all their images (up to float64 rounding).
The sums (and the few kept maps) live on the features' device and ``update`` never waits for it: no value
reaches the host and no Python branch depends on one (tests/test_host_syncs.py counts); ``state_dict``
copies the state to the CPU, and a loaded or merged state moves to the device at its next batch.

Speed (all layers of ViT-S/16 at batch 32 must cost well under a third of the forward pass; see
benchmarks/attention.py): nothing of the size of the attention is formed beyond one temporary. The
renormalised spatial attention stays implicit (a view and per-row inverse masses, `_Spatial`); metrics
that are linear in it (AAAM, distance) are evaluated on its sum over the batch's images, with the
arithmetic of the `vitscope.metrics.attention` functions; NMI is rearranged to a single ``R log R`` pass;
the IoU of every layer, query and merged head runs as one call per batch; and the analyses of one pass
share row sums, image sums and query means of the same captured tensor (`_SHARED`).
tests/test_analyses_attention.py checks each analysis against slow loops, and the hot path against the
metric functions.

=========================  ===================================================================================
analysis                   metrics (extra columns)
=========================  ===================================================================================
``attention_distance``     ``distance``, ``distance_px`` per (layer, head) (``stderr``, ``value_lo``, ``value_hi``,
                           ``n_images``)
``attention_nmi``          ``nmi`` per (layer, head) (``stderr``, ``value_lo``, ``value_hi``, ``n_images``)
``cls_attention_maps``     ``cls_attention`` per (layer, head, grid cell) (``row``, ``col``, ``image``,
                           ``n_images``); ``image`` is missing for the average, the dataset index otherwise
``aligned_attention_maps`` ``aaam`` per (layer, head, canvas cell) (``dy``, ``dx``); ``aam_statistic`` per
                           (layer, head) (``statistic``); ``head_type`` per (layer, head) (``type``,
                           ``direction``, ``offset``, ``statistic``, ``statistic_value``, ``distance``);
                           ``head_type_count`` per type (``type``) -- all with ``n_images``
``saliency_iou``           ``iou`` per (layer, head), ``iou_best_head`` and ``iou_merged`` per layer
                           (``query``, ``stderr``, ``value_lo``, ``value_hi``, ``n_images``, ``n_skipped``)
=========================  ===================================================================================

Means over images carry their spread: ``stderr`` is the standard error of the mean over images (sample
standard deviation over sqrt(n), from a streamed sum of squares) and ``value_lo`` / ``value_hi`` the 95 %
interval ``value ± 1.96 stderr``.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, cast

import pandas as pd
import torch
import torch.nn.functional as F

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.kept import keep_smallest, smallest_distinct, valid_rows
from vitscope.bounds import NonNegative, Range
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, moved, on_device
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


@register_analysis
class AttentionDistance(_PerHeadMean):
    """Average attention distance per layer and head [Walmer et al. 2023 §4.3; Park et al. 2023]:
    for each spatial query, sum_k A_qk * ||pos_q - pos_k|| over spatial keys (prefix keys dropped,
    rows renormalised), positions on the unit square; mean over queries and images. Reported in
    unit-square units (``distance``) and in pixels (``distance_px``), each with its standard error over
    images (``stderr``) and 95 % interval (``value_lo``, ``value_hi``). The reference: ``distance_uniform`` and
    ``distance_px_uniform`` (no layer nor head), the distance of uniform attention on the same grid (every query
    attending to every spatial key alike: the mean distance between two grid positions), the level of attention
    with no preference for near or far."""

    name = "attention_distance"
    description = "mean attention distance per layer and head"
    state_version = 3  # 3: the uniform-attention reference rows; 2: sums of squares (stderr over images)

    def batch_values(self, sps: list[_Spatial]) -> torch.Tensor:
        return torch.stack([sp.image_distance(self.grid_size) for sp in sps])

    def finalize(self) -> pd.DataFrame:
        mean, se = self.mean(), self.stderr()
        px = A.distance_in_pixels(1.0, self.grid_size, self.patch_size)
        rows = self._stat_rows("distance", mean, se) + self._stat_rows("distance_px", mean * px, se * px)
        S = self.grid_size[0] * self.grid_size[1]
        uniform = float(A.distance_of_spatial(torch.full((S, S), 1.0 / S, dtype=torch.float64), self.grid_size))
        rows += [{"metric": "distance_uniform", "layer": None, "head": None, "value": uniform},
                 {"metric": "distance_px_uniform", "layer": None, "head": None, "value": uniform * px}]
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df


@register_analysis
class AttentionNMI(_PerHeadMean):
    """Attention collapse as the normalised mutual information NMI(q, k) between spatial queries and
    keys, per layer and head [Park et al. 2023, "attention collapse"]: p(q) uniform over the
    spatial queries, p(k|q) the renormalised spatial attention; NMI = MI / sqrt(H(q) H(k)), computed per
    image and averaged over images. Near 0: every query attends alike (collapse); 1: one-to-one.

    Table: metric ``nmi`` per (layer, head), extra columns ``stderr`` (over images), ``value_lo``,
    ``value_hi`` (95 % interval) and ``n_images``."""

    name = "attention_nmi"
    description = "NMI between spatial queries and keys per layer and head (attention collapse)"

    def batch_values(self, sps: list[_Spatial]) -> torch.Tensor:
        return _nmi(sps)

    def finalize(self) -> pd.DataFrame:
        mean = self.mean() if self.n_images else torch.full_like(self.sums, float("nan"))
        df = self.tidy(self._stat_rows("nmi", mean, self.stderr()))
        df["n_images"] = self.n_images
        return df


def _png_bytes(pixels: torch.Tensor) -> bytes:
    """``(3, H, W)`` uint8 -> PNG file bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _cell_columns(values: torch.Tensor, layers: Sequence[int], names: tuple[str, str],
                  offsets: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """Columns layer, head, <names[0]>, <names[1]>, value of a ``(L, H, R, C)`` grid, row-major."""
    L, H, R, C = values.shape
    lay = torch.tensor(list(layers), dtype=torch.long)
    idx = torch.arange(L * H * R * C)
    return {
        "layer": lay[idx // (H * R * C)].numpy(),
        "head": ((idx // (R * C)) % H).numpy(),
        names[0]: ((idx // C) % R - offsets[0]).numpy(),
        names[1]: (idx % C - offsets[1]).numpy(),
        "value": values.reshape(-1).double().cpu().numpy(),
    }


@register_analysis
class CLSAttentionMaps(_LayerAttention):
    """Average CLS attention map per layer and head [Walmer et al. 2023 §4.1, Fig. 11-13]:
    the CLS query's row over the spatial keys (CLS and register keys dropped, renormalised), on the patch
    grid, averaged over all images (a float64 sum and a count). The maps of single images are kept too,
    for the ``keep_images`` images with the smallest dataset index (bounded memory, independent of the
    order in which batches or shards arrive), with those images as the model saw them (after its resize
    and crop, un-normalised, 8 bits), so the report can draw each map over its image.

    Table: metric ``cls_attention``, one row per (layer, head, grid cell), extra columns ``row``, ``col``
    (patch grid coordinates), ``image`` (missing for the average over images, the dataset index for a
    single image's map) and ``n_images`` (images in the average); metric ``input_image``, one row per kept
    image (``image`` = its index, value missing) whose ``png`` column holds the image as PNG bytes. A model
    without CLS token has no such map: the analysis captures nothing and returns an empty table, with a
    warning."""

    name = "cls_attention_maps"
    state_version = 2  # 2: the kept images' pixels
    description = "average (and a few single-image) CLS attention maps per layer and head"

    def __init__(self, vm: Any, layers: Any = None, keep_images: NonNegative = 4):
        super().__init__(vm, layers)
        if int(keep_images) < 0:
            raise VitscopeError(f"{self.name}: keep_images must be >= 0, got {keep_images}")
        self.keep_images = int(keep_images)
        h, w = self.grid_size
        L, H = len(self.layers), self.num_heads
        self.sums = torch.zeros(L, H, h, w, dtype=torch.float64)
        self.kept_index = torch.zeros(0, dtype=torch.long)
        self.kept_maps = torch.zeros(0, L, H, h, w, dtype=torch.float32)
        self.kept_pixels = torch.zeros(0, 3, 1, 1, dtype=torch.uint8)
        pre = getattr(vm, "preprocessing", None)  # a loaded model has it; a ModelInfo (cached state) does not
        self.pixel_mean = tuple(float(x) for x in pre.mean) if pre is not None else None
        self.pixel_std = tuple(float(x) for x in pre.std) if pre is not None else None

    def required_taps(self) -> list[str]:
        return super().required_taps() if self.has_cls_token else []

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "keep_images": self.keep_images}

    def on_grid(self, grid: tuple[int, int]) -> None:
        L, H = len(self.layers), self.num_heads
        self.sums = torch.zeros(L, H, *grid, dtype=torch.float64)
        self.kept_maps = torch.zeros(0, L, H, *grid, dtype=torch.float32)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if self.has_cls_token:
            self.pass_grid(batch)
        self.n_images += len(batch)
        if not self.has_cls_token:
            return
        maps = torch.stack([A.cls_attention_maps(feats[f"block{i}.attn"], self.grid_size, self.num_prefix_tokens)
                            for i in self.layers], dim=1)  # (B, L, H, h, w)
        self.sums = on_device(self.sums, maps.device)
        self.sums += maps.sum(0, dtype=torch.float64)
        if self.keep_images:
            index = batch.index.to(maps.device, torch.long)
            # only the batch's images that can be kept are converted (its keep_images smallest indices)
            take, index = smallest_distinct(index, self.keep_images)
            self._keep(index, maps[take].detach().float(), self._pixels(batch.images[take.to(batch.images.device)]))

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` model inputs -> uint8 images as the model saw them (on their device): normalisation
        undone with the model's mean and std (each image scaled to its own range when they are not known)."""
        x = images.detach().float()
        if self.pixel_mean is not None and self.pixel_std is not None:
            std = torch.tensor(self.pixel_std, device=x.device).view(1, 3, 1, 1)
            x = x * std + torch.tensor(self.pixel_mean, device=x.device).view(1, 3, 1, 1)
        else:
            lo = x.amin(dim=(1, 2, 3), keepdim=True)
            x = (x - lo) / (x.amax(dim=(1, 2, 3), keepdim=True) - lo).clamp_min(1e-12)
        return (x.clamp(0, 1) * 255).round().to(torch.uint8)

    def _keep(self, index: torch.Tensor, maps: torch.Tensor, pixels: torch.Tensor) -> None:
        """Keep the ``keep_images`` smallest distinct dataset indices among those kept and the new ones, on the
        new ones' device (`vitscope.analyses.kept`: ``kept_index`` may end in `NO_ID` rows, dropped on save)."""
        if len(index) == 0:
            return
        if len(self.kept_index) == 0:  # the first images decide the size of the kept pixels
            self.kept_pixels = torch.zeros(0, *pixels.shape[1:], dtype=torch.uint8)
        self.kept_index, (self.kept_maps, self.kept_pixels) = keep_smallest(
            self.keep_images, self.kept_index, [self.kept_maps, self.kept_pixels], index, [maps, pixels])

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, CLSAttentionMaps)
        self._check_grid_merge(other)
        self.sums += other.sums.to(self.sums.device)
        self.n_images += other.n_images
        if self.keep_images:
            dev = self.sums.device
            self._keep(other.kept_index.to(dev), other.kept_maps.to(dev), other.kept_pixels.to(dev))

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept indices, maps and pixels on the CPU, without the rows that hold no image."""
        index, (maps, pixels) = valid_rows(self.kept_index, [self.kept_maps, self.kept_pixels])
        return index, maps, pixels

    def state_dict(self) -> dict[str, Any]:
        index, maps, pixels = self._kept()
        return {"layers": list(self.layers), "keep_images": self.keep_images, "n_images": self.n_images,
                "sums": host_copy(self.sums), "kept_index": index, "kept_maps": maps, "kept_pixels": pixels}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.keep_images = list(state["layers"]), int(state["keep_images"])
        self.n_images = int(state["n_images"])
        self.sums, self.kept_index = state["sums"].clone(), state["kept_index"].clone()
        self.kept_maps, self.kept_pixels = state["kept_maps"].clone(), state["kept_pixels"].clone()
        self.grid_size = (int(self.sums.shape[-2]), int(self.sums.shape[-1]))

    def average(self) -> torch.Tensor:
        """``(layers, heads, h, w)`` float64 average CLS map (zeros before any image), on the CPU."""
        return self.sums.cpu() / max(self.n_images, 1)

    def finalize(self) -> pd.DataFrame:
        if not self.has_cls_token:
            warnings.warn(f"{self.name}: model {self.model_name!r} has no CLS token, so there is no CLS attention "
                          f"map; the table is empty", UserWarning, stacklevel=2)
            return self._frame({"row": [], "col": [], "image": pd.array([], dtype="Int64"), "n_images": []})
        kept_index, kept_maps, kept_pixels = self._kept()
        parts = [(None, self.average())] if self.n_images else []
        parts += [(int(i), m) for i, m in zip(kept_index.tolist(), kept_maps, strict=True)]
        frames = [pd.DataFrame({**_cell_columns(maps, self.layers, ("row", "col")),
                                "image": pd.array([image] * maps.numel(), dtype="Int64")})
                  for image, maps in parts]
        if not frames:
            return self._frame({"row": [], "col": [], "image": pd.array([], dtype="Int64"), "n_images": []})
        df = pd.concat(frames, ignore_index=True)
        df["metric"] = "cls_attention"
        if len(kept_index):
            df = pd.concat([df, pd.DataFrame({
                "metric": "input_image", "image": pd.array(kept_index.tolist(), dtype="Int64"),
                "value": float("nan"), "png": [_png_bytes(p) for p in kept_pixels]})], ignore_index=True)
        df["n_images"] = self.n_images
        return self.tidy(cast(Any, df))


@register_analysis
class AlignedAttentionMaps(_LayerAttention):
    """Aligned Aggregated Attention Maps (AAAM) and automatic head types per layer and head [Walmer et al.
    2023 (Walmer et al. 2023) §4.2, Fig. 5-6; the attention distance of §4.3 / Park et al. 2023 feeds the
    ``global`` rule].

    Each spatial query's map over the spatial keys (prefix keys dropped, renormalised) is added into a
    ``(2h-1) x (2w-1)`` canvas with the query at the centre; the state keeps the float64 canvas sums per
    (layer, head) and the number of maps added (``images x h*w``: every query of every image), and the
    AAAM is their ratio, so each head's AAAM sums to 1. The mean attention distance per (layer, head) is
    accumulated in the same pass. At ``finalize`` each head's AAAM is summarised
    (:func:`~vitscope.metrics.attention.aam_statistics`) and classified
    (:func:`~vitscope.metrics.attention.head_types`, thresholds overridable with ``thresholds``) as
    strict_local, soft_local, axial, offset_local, global or mixed. The paper classified by eye.

    Table (all rows carry ``n_images``):

    * ``aaam``: one row per (layer, head, canvas cell); ``dy``, ``dx`` = key position relative to the query
      (rows down, columns right), value = mean attention.
    * ``aam_statistic``: one row per (layer, head, statistic); ``statistic`` names it (``offset``,
      ``spread_norm``, ``entropy_norm``, ``anisotropy``, ``mass_3x3``, ... see ``aam_statistics``).
    * ``head_type``: one row per (layer, head), value 1; ``type``, ``direction`` (axial: horizontal or
      vertical; offset_local: one of 8 compass directions; else missing), ``offset`` (centre-of-mass offset,
      tokens), ``statistic`` / ``statistic_value`` (the statistic that decided), ``distance`` (mean attention
      distance, unit square).
    * ``head_type_count``: one row per type (all six, zeros included) with layer and head missing;
      value = number of the model's analysed heads of that ``type``.
    """

    name = "aligned_attention_maps"
    state_version = 2  # 2: head types with the grid-scaled locality rule (the cached tables held the old ones)
    description = "aligned aggregated attention maps (AAAM) and head types per layer and head"

    def __init__(self, vm: Any, layers: Any = None, thresholds: Mapping[str, float] | None = None):
        super().__init__(vm, layers)
        self.thresholds = dict(thresholds) if thresholds else {}
        A.head_types(torch.zeros(1, 1, 1), thresholds=self.thresholds)  # unknown threshold names fail here
        h, w = self.grid_size
        L, H = len(self.layers), self.num_heads
        self.canvas = torch.zeros(L, H, 2 * h - 1, 2 * w - 1, dtype=torch.float64)
        self.distance = torch.zeros(L, H, dtype=torch.float64)
        self.n_maps = 0

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "thresholds": dict(self.thresholds)}

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.canvas = torch.zeros(len(self.layers), self.num_heads, 2 * grid[0] - 1, 2 * grid[1] - 1,
                                  dtype=torch.float64)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        sps = [_Spatial(feats[f"block{i}.attn"], self.num_prefix_tokens) for i in self.layers]
        canvas, dist = _canvas_and_distance(sps, self.grid_size)
        self.canvas, self.distance = moved((self.canvas, self.distance), dist.device)
        self.canvas += cast(torch.Tensor, canvas)
        self.distance += dist
        self.n_maps += len(batch) * self.grid_size[0] * self.grid_size[1]
        self.n_images += len(batch)

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, AlignedAttentionMaps)
        self._check_grid_merge(other)
        self.canvas += other.canvas.to(self.canvas.device)
        self.distance += other.distance.to(self.distance.device)
        self.n_maps += other.n_maps
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "thresholds": dict(self.thresholds), "canvas": host_copy(self.canvas),
                "distance": host_copy(self.distance), "n_maps": self.n_maps, "n_images": self.n_images}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.thresholds = list(state["layers"]), dict(state["thresholds"])
        self.canvas, self.distance = state["canvas"].clone(), state["distance"].clone()
        self.grid_size = ((int(self.canvas.shape[-2]) + 1) // 2, (int(self.canvas.shape[-1]) + 1) // 2)
        self.n_maps, self.n_images = int(state["n_maps"]), int(state["n_images"])

    def aaam(self) -> torch.Tensor:
        """``(layers, heads, 2h-1, 2w-1)`` float64: canvas sums over the number of maps added (on the CPU)."""
        return self.canvas.cpu() / max(self.n_maps, 1)

    def finalize(self) -> pd.DataFrame:
        if self.n_images == 0:
            return self._frame({"dy": [], "dx": [], "n_images": []})
        h, w = self.grid_size
        aaam = self.aaam()
        dist = self.distance.cpu() / self.n_images
        frames = [pd.DataFrame({"metric": "aaam", **_cell_columns(aaam, self.layers, ("dy", "dx"), (h - 1, w - 1))})]
        rows: list[dict[str, Any]] = []
        counts = dict.fromkeys(HEAD_TYPES, 0)
        for j, i in enumerate(self.layers):
            for stat, v in A.aam_statistics(aaam[j]).items():
                rows += [{"metric": "aam_statistic", "layer": i, "head": hd, "statistic": stat, "value": float(x)}
                         for hd, x in enumerate(v.tolist())]
            for t in A.head_types(aaam[j], distance=dist[j], thresholds=self.thresholds):
                counts[str(t["type"])] = counts.get(str(t["type"]), 0) + 1
                rows.append({"metric": "head_type", "layer": i, "head": t["head"], "value": 1.0,
                             "type": t["type"], "direction": t["direction"], "offset": t["offset"],
                             "statistic": t["statistic"], "statistic_value": t["value"], "distance": t["distance"]})
        rows += [{"metric": "head_type_count", "type": k, "value": float(c)} for k, c in counts.items()]
        frames.append(pd.DataFrame(rows))
        df = pd.concat(frames, ignore_index=True)
        df["n_images"] = self.n_images
        return self.tidy(cast(Any, df))


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
    """

    name = "saliency_iou"
    state_version = 3  # 3: the uniform-attention reference (iou_uniform); 2: sums of squares (stderr over images)
    needs = frozenset({"masks"})
    description = "IoU of the top-60%-mass attention tokens with the foreground, per layer and head"

    def __init__(self, vm: Any, layers: Any = None, queries: str | Sequence[str] = ("cls", "mean"),
                 mass: Annotated[float, Range(0, 1, open_lo=True)] = 0.6):
        super().__init__(vm, layers)
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
        return {**super()._settings(), "queries": list(self.queries), "mass": self.mass}

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
        masks = batch.masks.to(W.device)
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
                "requested_queries": list(self.requested_queries), "n_images": self.n_images,
                "n_skipped": self.n_skipped, **{k: host_copy(getattr(self, k)) for k in self._TENSORS}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.queries = list(state["layers"]), list(state["queries"])
        self.requested_queries, self.mass = list(state["requested_queries"]), float(state["mass"])
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
        return df
