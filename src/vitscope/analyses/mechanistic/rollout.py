"""Attention rollout, plain (`AttentionRollout`) and gradient-weighted (`GradientRollout`): part of the
mechanistic lens (`vitscope.analyses.mechanistic`; math in `vitscope.metrics.mechanistic`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import pandas as pd
import torch

from vitscope.analyses.attention import _saliency_iou_of
from vitscope.analyses.base import DataSizes, Forwards, register_analysis
from vitscope.analyses.mechanistic._common import _Means, _Mechanistic
from vitscope.bounds import Range
from vitscope.capture.engine import taps_paused
from vitscope.errors import VitscopeError
from vitscope.host import on_device
from vitscope.metrics import attention as A
from vitscope.metrics import mechanistic as M

CLS_QUERY, POOL_QUERY, MEAN_QUERY = "cls", "attention pool", "mean of patch tokens"


def rollout_query(vm: Any) -> str:
    """The row a rollout reads: the CLS token's, else the attention pool's weights, else the patch tokens' mean."""
    if vm.has_cls_token:
        return CLS_QUERY
    return POOL_QUERY if getattr(vm, "has_attention_pool", False) else MEAN_QUERY


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
      ``stderr`` over the images scored (``n``) and the 95 % interval ``value_lo``, ``value_hi``;
    * ``iou_uniform``: no layer: the mean IoU uniform attention gets on the same masks, the reference level
      (`vitscope.metrics.attention.uniform_saliency_iou`, as ``saliency_iou``'s).

    A model without a CLS token is rolled out from what its head reads instead (column ``query``): the attention
    pool's weights over the tokens (SigLIP's MAP head, PE; the ``pool_attn`` tap, its heads and queries averaged)
    where it pools with attention, else the mean over the patch tokens (a model that reads their mean: I-JEPA,
    timm's AIMv2, a ViT with registers and global_pool='avg'). The map of block l is then the row ``w^T R_l`` for
    those weights w, and the reference beside it, ``iou_query_attention`` (in place of ``iou_cls_attention``), is
    that query's own attention at block l, ``w^T A_l`` (heads averaged), as the CLS row of ``A_l`` is for a model
    with a CLS token (w = e_0)."""

    name = "attention_rollout"
    in_default_study = True  # cheap beside the pass (benchmarks/mechanistic.py)
    description = "attention rollout CLS maps per block and their foreground IoU beside the CLS attention's"
    state_version = 3  # 2: the uniform-attention reference (iou_uniform); 3: the query of a model without CLS
    _MEANS = ("iou_rollout", "iou_cls", "iou_gain", "iou_uniform")
    _TENSORS = ("map_sum",)

    def __init__(self, vm: Any, layers: Any = None, head_fusion: Literal["mean", "max", "min"] = "mean",
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
        self.iou_uniform = _Means(1)
        self.n_masked = 0
        self.query = rollout_query(vm)

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio,
                "mass": self.mass, "query": self.query}

    def required_taps(self) -> list[str]:
        return ([f"block{i}.attn" for i in range(max(self.layers) + 1)]
                + (["pool_attn"] if self.query == POOL_QUERY else []))

    def _weights(self, feats: Mapping[str, torch.Tensor], like: torch.Tensor) -> int | torch.Tensor:
        """The query: token 0 (the CLS token), or weights over the tokens ``(B, T)`` (see the class doc)."""
        if self.query == CLS_QUERY:
            return 0
        if self.query == POOL_QUERY:
            return feats["pool_attn"].mean((1, 2)).to(like.dtype)
        w = torch.zeros(like.shape[0], like.shape[-1], dtype=like.dtype, device=like.device)
        w[:, self.num_prefix_tokens:] = 1.0 / (like.shape[-1] - self.num_prefix_tokens)
        return w

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.map_sum = torch.zeros(len(self.layers), *grid, dtype=torch.float64)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        g, p = self.pass_grid(batch), self.num_prefix_tokens
        first = feats[f"block{self.layers[0]}.attn"]
        w = self._weights(feats, first[:, 0, 0])
        rows = self._rows(feats, batch, w)  # (B, L, T)
        self._to_device(rows.device)
        maps = rows[..., p:]
        maps = maps / maps.sum(-1, keepdim=True).clamp_min(A.EPS)
        self.map_sum += maps.sum(0, dtype=torch.float64).reshape(len(self.layers), *g)
        self.n_images += len(batch)
        if batch.masks is None:
            return
        if isinstance(w, int):
            own = [feats[f"block{i}.attn"][:, :, w].mean(1) for i in self.layers]
        else:
            own = [torch.bmm(w[:, None, :], feats[f"block{i}.attn"].mean(1).to(w.dtype))[:, 0] for i in self.layers]
        cls = torch.stack(own, 1)[..., p:]
        cls = cls / cls.sum(-1, keepdim=True).clamp_min(A.EPS)
        masks = on_device(batch.masks, maps.device)
        iou = _saliency_iou_of(torch.cat([maps, cls.to(maps.dtype)], 1), masks, g, self.mass).double()
        L = len(self.layers)
        self.iou_rollout.add(iou[:, :L])
        self.iou_cls.add(iou[:, L:])
        self.iou_gain.add(iou[:, :L] - iou[:, L:])
        self.iou_uniform.add(A.uniform_saliency_iou(masks, g, self.mass)[:, None])
        self.n_masked += len(batch)

    def _rows(self, feats: Mapping[str, torch.Tensor], batch: Any, w: int | torch.Tensor) -> torch.Tensor:
        """``(B, layers, T)``: the query ``w``'s row (`_weights`) of the rollout up to each requested block."""
        attns = [feats[f"block{i}.attn"] for i in range(max(self.layers) + 1)]
        return M.attention_rollout(attns, self.head_fusion, self.discard_ratio, query=w)[:, self.layers]

    def _columns(self) -> dict[str, Any]:
        return {"head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio, "query": self.query}

    def mean_maps(self) -> torch.Tensor:
        """``(layers, h, w)`` float64 mean rollout map over the images seen (on the CPU)."""
        return self.map_sum.cpu() / max(self.n_images, 1)

    def finalize(self) -> pd.DataFrame:
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows: list[dict[str, Any]] = []
        if self.n_images:
            m = self.mean_maps()
            h, w = self.grid_size
            rows += [{"metric": "rollout_map", "layer": i, "row": r, "col": c, "value": float(m[j, r, c])}
                     for j, i in enumerate(self.layers) for r in range(h) for c in range(w)]
        own = "iou_cls_attention" if self.query == CLS_QUERY else "iou_query_attention"
        for metric, means in (("iou_rollout", self.iou_rollout), (own, self.iou_cls),
                              ("iou_gain", self.iou_gain)):
            rows += [{"metric": metric, "layer": i, **means.row(j)} for j, i in enumerate(self.layers)]
        if self.n_masked:
            rows.append({"metric": "iou_uniform", "layer": None, **self.iou_uniform.row(0)})
        df = self.tidy(rows)
        df["n_images"], df["n_masked"] = self.n_images, self.n_masked
        for k, v in self._columns().items():
            df[k] = v
        return df


@register_analysis
class GradientRollout(AttentionRollout):
    """Gradient-weighted attention rollout (Chefer et al. 2021, generic attention-model explainability): the
    relevance of each token for the model's predicted class, ``R <- R + mean_h((dy/dA) * A)^+ R`` from ``R = I``
    over blocks 0 .. l (`vitscope.metrics.mechanistic.gradient_rollout`), its CLS row over the patch tokens
    renormalised as the block's map. The gradients come from a second forward and backward of each batch with
    the model's attention kept (the pass itself runs without gradients): about three forwards' time more. The
    table is `attention_rollout`'s (``rollout_map``, ``iou_rollout`` beside ``iou_cls_attention``, ``iou_gain``),
    with ``head_fusion`` = ``gradient``; a model without a CLS token is read from its pooling, as
    `attention_rollout` says. A model without a classifier head has nothing to explain: the table is empty, and
    the study says why."""

    name = "gradient_rollout"
    in_default_study = False  # its own forward and backward pass per batch
    description = "gradient-weighted rollout (Chefer et al.) of the predicted class per block, with foreground IoU"

    def __init__(self, vm: Any, layers: Any = None, mass: Annotated[float, Range(0, 1, open_lo=True)] = 0.6):
        super().__init__(vm, layers=layers, mass=mass)
        self.head_fusion = "gradient"
        self._vm = vm if getattr(vm, "model", None) is not None else None
        self.has_head = self._vm is None or int(getattr(vm.model, "num_classes", 0) or 0) > 0

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "mass": self.mass, "has_head": self.has_head, "query": self.query}

    def _columns(self) -> dict[str, Any]:
        return {"head_fusion": "gradient", "query": self.query}

    def required_taps(self) -> list[str]:
        if not self.has_head:
            return []
        return ([f"block{i}.attn" for i in self.layers] + (["pool_attn"] if self.query == POOL_QUERY else [])
                + ["logits"])  # logits: the pass runs to the end

    def own_forwards(self, vm: Any, data: DataSizes) -> list[Forwards]:
        """One forward (to the logits) and backward (to the attention maps) per batch of its clean pass, for a
        model with a classifier head."""
        if not self.has_head:
            return []
        return [Forwards(len(data.batches), sum(data.batches), gradients=True)]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if not self.has_head:
            self.n_images += len(batch)
            return
        super().update(feats, batch)

    def finalize(self) -> pd.DataFrame:
        if not self.has_head:  # said by the study with its reason (`empty_reason`)
            return self.tidy([])
        return super().finalize()

    def empty_reason(self) -> str:
        """A model without a classifier head (``has_head``, kept in the state) has no predicted class to explain."""
        if not self.has_head:
            return "the model has no classifier head, so there is no predicted class to explain"
        return super().empty_reason()

    def _rows(self, feats: Mapping[str, torch.Tensor], batch: Any, w: int | torch.Tensor) -> torch.Tensor:
        vm = self._vm
        if vm is None:
            raise VitscopeError(f"{self.name}: gradients need the loaded model, not a cached state")
        model, last = vm.model, max(self.layers)
        blocks = list(model.blocks)
        kept: dict[int, torch.Tensor] = {}

        def keep(i: int) -> Any:
            return lambda module, args, out: kept.__setitem__(i, out)

        handles = [blocks[i].attn.attn_drop.register_forward_hook(keep(i)) for i in range(last + 1)]
        fused = [(b.attn, b.attn.fused_attn) for b in blocks if hasattr(b.attn, "fused_attn")]
        try:
            for module, _ in fused:
                module.fused_attn = False  # the eager path, whose attention the hooks see
            x = batch.images.detach().to(next(model.parameters()).device).clone().requires_grad_(True)
            with torch.inference_mode(False), torch.enable_grad(), vm.input_size(*x.shape[-2:]), taps_paused():
                logits = model(x)
                score = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
                attns = [kept[i] for i in range(last + 1)]
                grads = torch.autograd.grad(score, attns)
        finally:
            for h in handles:
                h.remove()
            for module, flag in fused:
                module.fused_attn = flag
        rows = M.gradient_rollout([a.detach() for a in attns], grads, query=w)
        return rows[:, self.layers]
