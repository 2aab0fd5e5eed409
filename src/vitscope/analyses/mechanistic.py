"""A mechanistic lens: attention rollout (plain and gradient-weighted), the logit lens, high-norm artifact tokens
and head ablation (math in `vitscope.metrics.mechanistic`).

=========================  ===================================================================================
analysis                   metrics (extra columns)
=========================  ===================================================================================
``attention_rollout``      ``rollout_map`` per (layer, grid cell) (``row``, ``col``); ``iou_rollout``,
                           ``iou_cls_attention``, ``iou_gain`` per layer (``stderr``, ``value_lo``,
                           ``value_hi``, ``n``); all with ``n_images``, ``n_masked``
``gradient_rollout``       as ``attention_rollout`` (``head_fusion`` = ``gradient``)
``logit_lens``             ``top1_accuracy`` per layer (``value_lo``, ``value_hi``, ``n``, ``readout``);
                           ``kl_to_final``, ``agreement_with_final`` per layer (intervals, ``readout``)
``high_norm_tokens``       ``norm_quantile`` per (layer, quantile) (``quantile``, ``token_view``), all with ``rule``;
                           ``outliers_per_image``, ``images_with_outliers``, ``patch_variance``,
                           ``foreground_share``, ``cls_attention_absorbed`` per layer (``tokens``:
                           outliers / all, intervals); ``outlier_position`` per (layer, cell); ``knn_accuracy``
                           per layer (``tokens``: outliers / random_patch); ``norm_threshold`` per layer
                           (rule bimodal: ``separation``, ``upper_share``)
``head_ablation``          ``kl_from_clean``, ``prediction_flips``, ``accuracy_drop`` (or ``output_change``) per
                           (layer, head) or per layer (``heads`` = all) (``stderr``, ``value_lo``, ``value_hi``,
                           ``n``, ``mode``: zero / mean, ``heads``)
=========================  ===================================================================================

Every state is sums and counts of a size fixed by the model (and, for the probe and the k-NN, at most
``max_images`` pooled rows), so parts merge by addition (shards, resume); head_ablation's mean and the bimodal
norm thresholds come from a statistics pass over the same images in every part (`Analysis.prepare`), and parts
merge only when theirs agree. Rollout and the high-norm tokens
are in the embedded default study (``in_default_study``: cheap beside its pass); the other three cost extra
passes or a probe, and a study names them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, cast

import pandas as pd
import torch

from vitscope.analyses.attention import Z95, _saliency_iou_of, stderr_from_sums
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.splits import TestEvery
from vitscope.bounds import Count, Iterations, Positive, Range
from vitscope.capture.engine import taps_paused
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, on_device, on_host, to_host
from vitscope.metrics import attention as A
from vitscope.metrics import mechanistic as M
from vitscope.metrics.semantics import binomial_interval


class _Means:
    """Streamed means over images of a ``shape``-d statistic: float64 sums, sums of squares and counts, kept on
    the device of the values they are given (moved there at the first `add` after a load or a merge)."""

    def __init__(self, *shape: int):
        self.sum = torch.zeros(shape, dtype=torch.float64)
        self.sumsq = torch.zeros(shape, dtype=torch.float64)
        self.count = torch.zeros(shape, dtype=torch.float64)

    def to(self, device: torch.device) -> None:
        """Move the sums to ``device`` (where the next values are)."""
        self.sum, self.sumsq, self.count = (on_device(t, device) for t in (self.sum, self.sumsq, self.count))

    def add(self, values: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Values ``(B, *shape)``; ``ok`` (same shape, bool) selects those that count (NaN never does)."""
        v = values.double()
        self.to(v.device)
        ok = ~torch.isnan(v) if ok is None else on_device(ok, v.device) & ~torch.isnan(v)
        v = torch.where(ok, v, 0.0)
        self.sum += v.sum(0)
        self.sumsq += v.square().sum(0)
        self.count += ok.sum(0)

    def merge(self, other: _Means) -> None:
        """Add ``other``'s sums (moved to this one's device)."""
        dev = self.sum.device
        self.sum += on_device(other.sum, dev)
        self.sumsq += on_device(other.sumsq, dev)
        self.count += on_device(other.count, dev)

    def state(self) -> dict[str, torch.Tensor]:
        return {"sum": host_copy(self.sum), "sumsq": host_copy(self.sumsq), "count": host_copy(self.count)}

    @classmethod
    def of_values(cls, values: torch.Tensor) -> _Means:
        """The means of ``(n,)`` values (a scalar statistic)."""
        m = cls()
        m.add(values)
        return m

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
    """Shared plumbing: settings that must agree to merge, and the tensors of the state. The sums (``_MEANS``,
    ``_TENSORS``, and ``_ON_DEVICE``: state a batch reads, not summed) live on the features' device between
    batches (`_to_device` at each update); ``state_dict`` hands out CPU copies."""

    in_default_study = False

    _MEANS: tuple[str, ...] = ()
    _TENSORS: tuple[str, ...] = ()
    _ON_DEVICE: tuple[str, ...] = ()

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers)}

    def _check_mergeable(self, other: Analysis) -> None:
        if type(other) is not type(self):
            raise VitscopeError(f"{self.name}: cannot merge a {type(other).__name__} into a {type(self).__name__}")
        mine, theirs = self._settings(), cast(_Mechanistic, other)._settings()
        if mine != theirs:
            raise VitscopeError(f"{self.name}: cannot merge parts computed with different settings: {mine} vs {theirs}")

    def _to_device(self, device: torch.device) -> None:
        """Move the state's sums to ``device`` (the incoming features'): a no-op after the first batch."""
        for k in self._MEANS:
            getattr(self, k).to(device)
        for k in (*self._TENSORS, *self._ON_DEVICE):
            setattr(self, k, on_device(getattr(self, k), device))

    def _add_tensors(self, other: _Mechanistic, names: Sequence[str]) -> None:
        """Add ``other``'s tensors ``names`` to this one's (moved to this one's device)."""
        for k in names:
            mine = getattr(self, k)
            mine.add_(on_device(getattr(other, k), mine.device))

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        self._check_grid_merge(other)
        for k in self._MEANS:
            getattr(self, k).merge(getattr(other, k))
        self._add_tensors(cast(_Mechanistic, other), self._TENSORS)
        self.n_images += other.n_images
        self.n_masked += other.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {"settings": self._settings(), "grid": list(self.grid_size), "n_images": self.n_images,
                "n_masked": self.n_masked, **{k: getattr(self, k).state() for k in self._MEANS},
                **{k: host_copy(getattr(self, k)) for k in self._TENSORS}}

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
      ``stderr`` over the images scored (``n``) and the 95 % interval ``value_lo``, ``value_hi``;
    * ``iou_uniform``: no layer: the mean IoU uniform attention gets on the same masks, the reference level
      (`vitscope.metrics.attention.uniform_saliency_iou`, as ``saliency_iou``'s).

    A model without a CLS token has no CLS row to roll out: nothing is captured and the table is empty (with
    a warning)."""

    name = "attention_rollout"
    in_default_study = True  # cheap beside the pass (benchmarks/mechanistic.py)
    description = "attention rollout CLS maps per block and their foreground IoU beside the CLS attention's"
    state_version = 2  # 2: the uniform-attention reference (iou_uniform)
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
        rows = self._rows(feats, batch)  # (B, L, T)
        self._to_device(rows.device)
        maps = rows[..., p:]
        maps = maps / maps.sum(-1, keepdim=True).clamp_min(A.EPS)
        self.map_sum += maps.sum(0, dtype=torch.float64).reshape(len(self.layers), *g)
        self.n_images += len(batch)
        if batch.masks is None:
            return
        cls = torch.stack([feats[f"block{i}.attn"][:, :, 0, p:].mean(1) for i in self.layers], 1)
        masks = on_device(batch.masks, maps.device)
        iou = _saliency_iou_of(torch.cat([maps, cls.to(maps.dtype)], 1), masks, g, self.mass).double()
        L = len(self.layers)
        self.iou_rollout.add(iou[:, :L])
        self.iou_cls.add(iou[:, L:])
        self.iou_gain.add(iou[:, :L] - iou[:, L:])
        self.iou_uniform.add(A.uniform_saliency_iou(masks, g, self.mass)[:, None])
        self.n_masked += len(batch)

    def _rows(self, feats: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
        """``(B, layers, T)``: the CLS row of the rollout up to each requested block."""
        attns = [feats[f"block{i}.attn"] for i in range(max(self.layers) + 1)]
        return M.attention_rollout(attns, self.head_fusion, self.discard_ratio)[:, self.layers]

    def _columns(self) -> dict[str, Any]:
        return {"head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio}

    def mean_maps(self) -> torch.Tensor:
        """``(layers, h, w)`` float64 mean rollout map over the images seen (on the CPU)."""
        return self.map_sum.cpu() / max(self.n_images, 1)

    def finalize(self) -> pd.DataFrame:
        if not self.has_cls_token:
            warnings.warn(f"{self.name}: model {self.model_name!r} has no CLS token, so there is no CLS row to roll "
                          "out; the table is empty", UserWarning, stacklevel=2)
            return self.tidy([])
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows: list[dict[str, Any]] = []
        if self.n_images:
            m = self.mean_maps()
            h, w = self.grid_size
            rows += [{"metric": "rollout_map", "layer": i, "row": r, "col": c, "value": float(m[j, r, c])}
                     for j, i in enumerate(self.layers) for r in range(h) for c in range(w)]
        for metric, means in (("iou_rollout", self.iou_rollout), ("iou_cls_attention", self.iou_cls),
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
    with ``head_fusion`` = ``gradient``. A model without a classifier head or a CLS token has nothing to explain:
    the table is empty, with a warning."""

    name = "gradient_rollout"
    in_default_study = False  # its own forward and backward pass per batch
    description = "gradient-weighted rollout (Chefer et al.) of the predicted class per block, with foreground IoU"

    def __init__(self, vm: Any, layers: Any = None, mass: Annotated[float, Range(0, 1, open_lo=True)] = 0.6):
        super().__init__(vm, layers=layers, mass=mass)
        self.head_fusion = "gradient"
        self._vm = vm if getattr(vm, "model", None) is not None else None
        self.has_head = self._vm is None or int(getattr(vm.model, "num_classes", 0) or 0) > 0

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "mass": self.mass, "has_head": self.has_head}

    def _columns(self) -> dict[str, Any]:
        return {"head_fusion": "gradient"}

    def required_taps(self) -> list[str]:
        if not (self.has_cls_token and self.has_head):
            return []
        return [f"block{i}.attn" for i in self.layers] + ["logits"]  # logits: the pass runs to the end

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if not self.has_head:
            self.n_images += len(batch)
            return
        super().update(feats, batch)

    def finalize(self) -> pd.DataFrame:
        if self.has_cls_token and not self.has_head:
            warnings.warn(f"{self.name}: model {self.model_name!r} has no classifier head, so there is no predicted "
                          "class to explain; the table is empty", UserWarning, stacklevel=2)
            return self.tidy([])
        return super().finalize()

    def _rows(self, feats: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
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
        rows = M.gradient_rollout([a.detach() for a in attns], grads)
        return rows[:, self.layers]


LENS_READOUTS = ("auto", "head", "probe")


@register_analysis
class LogitLens(_Mechanistic):
    """The logit lens (nostalgebraist 2020) on a ViT: each block's residual stream read out as the model reads
    its last one, through the final norm and the model's own head (its pooling: the CLS token, or the mean of
    the patch tokens for ``global_pool='avg'``), per block:

    * ``kl_to_final``: mean over images of KL(final prediction || the block's), in nats (``stderr``, 95 %
      interval); 0 at the last block;
    * ``agreement_with_final``: share of images whose top-1 class at the block is the final top-1 (Wilson 95 %
      interval); 1 at the last block;
    * ``top1_accuracy``: against the labels (Wilson 95 % interval), when the head's label space covers the
      dataset's classes (``head_classes``, as the robustness lenses decide it) -- else not reported.

    A model without a classifier head (``readout: probe``, or ``auto`` on a headless model) gets one: a linear
    probe (`vitscope.metrics.semantics.fit_probe`, standardised features) fitted once on the last block's pooled
    features (the model's pooling after the final norm) of the training images (the dataset's own split, else
    every ``test_every``-th image of each class held out), then applied unchanged to every block's test images.
    The table says which in its ``readout`` column (``head`` or ``probe fitted on block L``). The probe keeps
    at most ``max_images`` images (those of smallest dataset index: the same in any shard order)."""

    name = "logit_lens"
    state_version = 1
    description = "each block's CLS (pooled) token through the final norm and the head: accuracy, KL to final"
    _MEANS = ("kl",)
    _TENSORS = ("agree", "correct", "scored")

    def __init__(self, vm: Any, layers: Any = None, readout: Literal["auto", "head", "probe"] = "auto",
                 head_classes: str | None = None,
                 max_images: Count = 2000, test_every: TestEvery = 5, probe_max_iter: Iterations = 100,
                 probe_weight_decay: Positive = 1e-4):
        from vitscope.analyses.robustness import check_head_classes, head_label_space
        from vitscope.analyses.splits import check_test_every

        super().__init__(vm)
        if readout not in LENS_READOUTS:
            raise VitscopeError(f"{self.name}: readout {readout!r} does not exist; choose {', '.join(LENS_READOUTS)}")
        check_head_classes(self.name, head_classes)
        self.layers = self.layers_param(layers)
        self._model = getattr(vm, "model", None)  # a loaded model; a ModelInfo (cached state) has none
        has_head = int(getattr(self._model, "num_classes", 0) or 0) > 0
        if readout == "head" and self._model is not None and not has_head:
            raise VitscopeError(f"{self.name}: readout 'head' needs a classifier head; {self.model_name} has none "
                                "(readout: probe fits one on the last block)")
        self.readout = "probe" if readout == "probe" or (readout == "auto" and not has_head) else "head"
        self.head_space = (None if head_classes == "none" else head_classes) or head_label_space(vm)
        self.max_images, self.test_every = int(max_images), check_test_every(test_every, self.name)
        self.probe_max_iter, self.probe_weight_decay = int(probe_max_iter), float(probe_weight_decay)
        self.classes: list[str] | None = None
        L = len(self.layers)
        self.kl = _Means(L)
        self.agree, self.correct, self.scored = (torch.zeros(L, dtype=torch.float64) for _ in range(3))
        self.n_masked = 0  # unused here (the shared state layout): images with a label
        # probe readout: pooled features of the kept images, (images, layers, D), with their ids and labels
        self.ids = torch.zeros(0, dtype=torch.long)
        self.labels = torch.zeros(0, dtype=torch.long)
        self.is_test = torch.zeros(0, dtype=torch.bool)
        self.pooled = torch.zeros(0, L, 0)
        self.own_split = False

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "readout": self.readout, "head_space": self.head_space,
                "max_images": self.max_images, "test_every": self.test_every, "probe_max_iter": self.probe_max_iter,
                "probe_weight_decay": self.probe_weight_decay, "classes": self.classes}

    def configure(self, dataset_classes: Mapping[str, Sequence[str] | None] | None = None) -> None:
        got = (dataset_classes or {}).get("data")
        self.classes = list(got) if got is not None else None

    def required_taps(self) -> list[str]:
        return [f"block{i}.out" for i in self.layers] + (["logits"] if self.readout == "head" else [])

    def _read(self, x: torch.Tensor, pre_logits: bool) -> torch.Tensor:
        """The model's own readout of a residual stream: final norm, pooling, head (hooks bypassed)."""
        m = self._model
        if m is None:
            raise VitscopeError(f"{self.name}: reading block outputs needs the loaded model, not a cached state")
        with torch.inference_mode():
            return m.forward_head(m.norm.forward(x), pre_logits=pre_logits)

    def _covered_classes(self) -> list[str] | None:
        """The dataset's classes when the head's label space covers them (labels can be scored), else None."""
        from vitscope.analyses.robustness import head_covers, known_classes

        classes = self.classes if self.classes is not None else known_classes(self.datasets.get("data"))
        return list(classes) if classes is not None and head_covers(self.head_space, classes) else None

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        B = len(batch)
        if self.readout == "probe":
            self._keep_pooled(feats, batch)
            self.n_images += B
            return
        from vitscope.analyses.robustness import head_scores

        final = feats["logits"].double()
        self._to_device(final.device)
        top_final = final.argmax(-1)
        classes = self._covered_classes() if batch.labels is not None else None
        labels = on_device(batch.labels, final.device) if classes is not None else None
        kls, agree, correct = [], [], []
        for i in self.layers:
            lg = self._read(feats[f"block{i}.out"], pre_logits=False).double()
            kls.append(M.kl_to_final(lg, final))
            agree.append((lg.argmax(-1) == top_final).double().sum())
            if classes is not None:
                scores = head_scores(cast(str, self.head_space), classes, lg)
                correct.append((scores.argmax(-1) == labels).double().sum())
        self.kl.add(torch.stack(kls, 1))
        self.agree += torch.stack(agree)
        if classes is not None:
            self.correct += torch.stack(correct)
            self.scored += B
            self.n_masked += B
        self.n_images += B

    def _keep_pooled(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if batch.labels is None:
            return
        x = torch.stack([self._read(feats[f"block{i}.out"], pre_logits=True) for i in self.layers], 1)
        x = x.detach().float().cpu()  # the batch's one copy: the kept rows live on the host
        if not len(self.ids):
            self.pooled = torch.zeros(0, *x.shape[1:])
        test = on_host(batch.is_test).bool() if batch.is_test is not None else torch.zeros(len(batch), dtype=torch.bool)
        self.own_split = self.own_split or batch.is_test is not None
        self._keep(on_host(batch.index).long(), on_host(batch.labels).long(), test, x)
        self.n_masked += len(batch)

    def _keep(self, ids: torch.Tensor, labels: torch.Tensor, test: torch.Tensor, x: torch.Tensor) -> None:
        """Keep the ``max_images`` smallest ids among those kept and the new ones, in id order."""
        ids, order = torch.sort(torch.cat([self.ids, ids]), stable=True)
        sel = order[: self.max_images]
        self.pooled = torch.cat([self.pooled, x])[sel]
        self.labels = torch.cat([self.labels, labels])[sel]
        self.is_test = torch.cat([self.is_test, test])[sel]
        self.ids = ids[: self.max_images]

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        o = cast(LogitLens, other)
        self.kl.merge(o.kl)
        self._add_tensors(o, self._TENSORS)
        if len(o.ids):
            if not len(self.ids):
                self.pooled = torch.zeros(0, *o.pooled.shape[1:])
            self._keep(o.ids, o.labels, o.is_test, o.pooled)
        self.own_split = self.own_split or o.own_split
        self.n_images += o.n_images
        self.n_masked += o.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ids": self.ids.clone(), "labels": self.labels.clone(),
                "is_test": self.is_test.clone(), "pooled": self.pooled.clone(), "own_split": self.own_split}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.ids, self.labels = state["ids"].clone(), state["labels"].clone()
        self.is_test, self.pooled = state["is_test"].clone(), state["pooled"].clone()
        self.own_split = bool(state["own_split"])

    def finalize(self) -> pd.DataFrame:
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows = self._probe_rows() if self.readout == "probe" else self._head_rows()
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df

    def _share(self, metric: str, layer: int, hits: float, n: int, readout: str) -> dict[str, Any]:
        p = hits / n if n else float("nan")
        lo, hi, se = binomial_interval(p, n)
        return {"metric": metric, "layer": layer, "value": p, "stderr": se, "value_lo": lo, "value_hi": hi, "n": n,
                "readout": readout}

    def _head_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for j, i in enumerate(self.layers):
            rows.append({"metric": "kl_to_final", "layer": i, **self.kl.row(j), "readout": "head"})
            rows.append(self._share("agreement_with_final", i, float(self.agree[j]), self.n_images, "head"))
            if self.scored[j] > 0:
                rows.append(self._share("top1_accuracy", i, float(self.correct[j]), int(self.scored[j]), "head"))
        return rows

    def _probe_rows(self) -> list[dict[str, Any]]:
        from vitscope.analyses.splits import split_warnings, stratified_test
        from vitscope.metrics.semantics import fit_probe

        if not len(self.ids):
            warnings.warn(f"{self.name}: no labelled image reached the probe of {self.model_name!r}; the table is "
                          "empty", UserWarning, stacklevel=3)
            return []
        y = self.labels
        test = self.is_test if self.own_split else stratified_test(self.ids, y, self.test_every)
        if not split_warnings(self.name, y, test):
            return []
        x = self.pooled  # (n, L, D)
        L = len(self.layers)
        readout = f"probe fitted on block {self.layers[-1]}"
        xt = x[test].transpose(0, 1).reshape(-1, x.shape[-1])  # every block's test rows, block-major
        yt = y[test].repeat(L)
        fit = fit_probe(x[~test, -1], y[~test], xt, yt, weight_decay=self.probe_weight_decay,
                        max_iter=self.probe_max_iter, warn=False, where=self.name)
        m = int(test.sum())
        scores = fit.scores.reshape(L, m, -1)
        final = scores[-1]
        rows: list[dict[str, Any]] = []
        for j, i in enumerate(self.layers):
            rows.append({"metric": "kl_to_final", "layer": i, "readout": readout,
                         **_Means.of_values(M.kl_to_final(scores[j], final)).row()})
            agree = float((scores[j].argmax(-1) == final.argmax(-1)).double().sum())
            rows.append(self._share("agreement_with_final", i, agree, m, readout))
            correct = float((scores[j].argmax(-1) == y[test]).double().sum())
            rows.append(self._share("top1_accuracy", i, correct, m, readout))
        return rows


NORM_BINS = torch.logspace(-3, 6, 901, dtype=torch.float64)
"""Edges of the norm histogram: 900 bins of 0.01 decade (2.3 % wide) from 1e-3 to 1e6, bin ``floor(100 (log10
norm + 3))``; norms outside land in the first or last bin (the exact minimum and maximum are kept beside)."""
QUANTILES = (0.01, 0.25, 0.5, 0.75, 0.99)
NORM_RULES = ("mad", "bimodal")


def _quantiles(hist: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """Quantiles of the values a histogram on `NORM_BINS` counted: the geometric centre of the bin that holds
    the q-th value (2.3 % resolution); NaN when it counted nothing."""
    n = float(hist.sum())
    if n == 0:
        return [float("nan")] * len(qs)
    cum = hist.double().cumsum(0)
    centres = (NORM_BINS[:-1] * NORM_BINS[1:]).sqrt()
    return [float(centres[int(torch.searchsorted(cum, q * n).clamp_max(len(centres) - 1))]) for q in qs]


def _random_token(ids: torch.Tensor, layer: int, n_tokens: int) -> torch.Tensor:
    """A patch token per image, fixed by (image id, block) alone: the same in every shard and resumed run."""
    return (ids.long() * 2654435761 + (layer + 1) * 40503) % n_tokens


@register_analysis
class HighNormTokens(_Mechanistic):
    """High-norm artifact tokens (Darcet et al. 2024) per block, from the residual stream after the block
    (``block{i}.out``) and the next block's attention (which reads it).

    Rule (``rule``), which patch tokens are outliers at a block:

    * ``mad`` (default): those whose norm exceeds ``median + k * 1.4826 * MAD`` of their own image's patch-token
      norms at that block (`vitscope.metrics.mechanistic.robust_outliers`; the MAD scaled to a normal standard
      deviation, ``k`` = 6 by default);
    * ``bimodal``: the register paper's reading of the norm histogram (artifacts are a second mode, about 2 %
      of the tokens, of much larger norm), made a rule: those above one threshold per block, read off the
      pooled log10 norms of every patch token of the first ``threshold_images`` images of the selection by a
      two-Gaussian mixture (`vitscope.metrics.mechanistic.bimodal_threshold`): where the upper component's
      weighted density overtakes the lower one's, if the two are separated (Ashman's D > 2) and the upper one
      holds at most a fifth of the tokens (artifacts are a minority; a larger upper mode is ordinary tokens,
      e.g. object vs flat background), else no threshold and no outliers at that block. The norms come from a
      statistics pass before the pass (`Analysis.prepare`: a forward of those images up to the last block
      read, once per run, the same images on every rank, saved in the state so a resumed run reuses it).

    ``mad`` is the default: it needs no statistics pass (the analysis stays cheap beside the pass it shares in
    the default study), decides each image alone, and finds a raised token in any image; but it also flags the
    far tail of a single-mode distribution, so it reports some outliers in models without artifacts, where
    ``bimodal`` reports none (measured: the zoo's ``zoo-sup`` on 256 generated shapes, ``mad`` 0.04 to 0.5 per
    image at every block, in 4 to 16 % of the images; ``bimodal`` found no outlier mode at any block). Table:

    * ``norm_quantile``: per (layer, ``quantile``), the distribution of patch-token norms over every token of
      every image (a 0.01-decade histogram; ``quantile`` 0 and 1 are the exact minimum and maximum); with
      registers (more than one prefix token), the register tokens' norms too (``token_view`` = ``register``);
    * ``outliers_per_image``: mean count per image (``stderr``, interval); ``images_with_outliers``: share of
      images with at least one (Wilson interval);
    * ``outlier_position``: per (layer, ``row``, ``col``), how many images have an outlier at that patch;
    * ``patch_variance``: mean pixel variance (of the model's normalised input) of the patch under the token,
      ``tokens`` = ``outliers`` or ``all`` (artifacts sit in redundant, low-variance background patches);
      ``foreground_share``: share of tokens on the foreground mask (masks: same rule as ``saliency_iou``),
      outliers vs all (means over tokens; the stderr treats tokens as independent);
    * ``cls_attention_absorbed``: per image with outliers, the head-averaged CLS attention mass the next block
      puts on them (``tokens`` = ``outliers``), beside the mass uniform attention would give that many tokens
      (``uniform``); with registers, the mass on the registers (``registers``); not at the last block;
    * ``knn_accuracy``: with labels and ``knn``, weighted 20-NN accuracy (DINO's rule) of the mean outlier token
      of each image that has one, against one random patch token of the same images (``tokens`` =
      ``outliers`` / ``random_patch``; Wilson intervals; at most ``max_images`` images kept, float16; test split
      as the semantics analysis's);
    * ``norm_threshold`` (``rule`` = ``bimodal``): per layer, the threshold (a norm; NaN where the distribution
      has one mode), with its ``separation`` (Ashman's D) and ``upper_share`` (the upper component's weight).

    Every row carries ``rule`` (the rule in words).
    """

    name = "high_norm_tokens"
    state_version = 2  # the rule and the bimodal thresholds in the state
    in_default_study = True  # cheap beside the pass (benchmarks/mechanistic.py)
    description = "high-norm artifact tokens per block: norm quantiles, outliers, where they sit, attention, k-NN"
    _MEANS = ("count", "var_out", "var_all", "fg_out", "fg_all", "absorbed", "uniform", "registers")
    _TENSORS = ("hist", "reg_hist", "lo_hi", "positions", "with_outliers")
    _ON_DEVICE = ("thresholds",)

    def __init__(self, vm: Any, layers: Any = None, k: Positive = 6.0, knn: bool = True, knn_k: Count = 20,
                 max_images: Count = 1000, test_every: TestEvery = 5, rule: Literal["mad", "bimodal"] = "mad",
                 threshold_images: Count = 200):
        from vitscope.analyses.splits import check_test_every
        from vitscope.errors import check_choice

        super().__init__(vm)
        if not float(k) > 0:
            raise VitscopeError(f"{self.name}: k must be positive, got {k}")
        self.rule = check_choice(rule, NORM_RULES, self.name, "rule", "mad or bimodal")
        Count.__metadata__[0].check(threshold_images, f"{self.name}: threshold_images")
        self.threshold_images = int(threshold_images)
        self.layers = self.layers_param(layers)
        self.k, self.knn, self.knn_k = float(k), bool(knn), int(knn_k)
        self.max_images, self.test_every = int(max_images), check_test_every(test_every, self.name)
        L = len(self.layers)
        for name in self._MEANS:
            setattr(self, name, _Means(L))
        self.hist = torch.zeros(L, len(NORM_BINS) - 1, dtype=torch.float64)
        self.reg_hist = torch.zeros_like(self.hist)
        self.lo_hi = torch.zeros(L, 4, dtype=torch.float64)  # min, -max of patches; min, -max of registers
        self.lo_hi[:] = float("inf")
        self.positions = torch.zeros(L, *self.grid_size, dtype=torch.float64)
        self.with_outliers = torch.zeros(L, dtype=torch.float64)
        self.n_masked = 0
        self.ids = torch.zeros(0, dtype=torch.long)
        self.labels = torch.zeros(0, dtype=torch.long)
        self.has_out = torch.zeros(0, L, dtype=torch.bool)
        self.out_feats = torch.zeros(0, L, 0, dtype=torch.float16)
        self.rand_feats = torch.zeros(0, L, 0, dtype=torch.float16)
        # rule bimodal: per layer log10 threshold (inf: one mode), Ashman's D, upper weight; images they came from
        self.thresholds = torch.zeros(3, 0, dtype=torch.float64)
        self.threshold_n = 0

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "k": self.k, "knn": self.knn, "knn_k": self.knn_k,
                "max_images": self.max_images, "test_every": self.test_every, "rule": self.rule,
                "threshold_images": self.threshold_images}

    def prepare(self, vm: Any, first_images: Any) -> None:
        """Rule ``bimodal``: the statistics pass, unless the state already holds its thresholds (a resume)."""
        if self.rule != "bimodal" or self.threshold_n:
            return
        from vitscope.capture.engine import Capture

        taps, p = [f"block{i}.out" for i in self.layers], self.num_prefix_tokens
        logs: list[list[torch.Tensor]] = [[] for _ in taps]
        n = 0
        with Capture(vm, taps) as cap:
            for b in first_images(self.threshold_images):
                feats = cap(b.images)
                for j, t in enumerate(taps):
                    logs[j].append(torch.log10(torch.linalg.vector_norm(feats[t][:, p:].float(), dim=-1)).cpu())
                n += len(b.images)
        if not n:
            raise VitscopeError(f"{self.name}: rule 'bimodal' found no image to read the norm distribution from")
        fits = [M.bimodal_threshold(torch.cat([v.flatten() for v in lv])) for lv in logs]
        self.thresholds = torch.tensor(fits, dtype=torch.float64).T.contiguous()  # (3, L)
        self.threshold_n = n

    def _rule_text(self) -> str:
        if self.rule == "bimodal":
            return (f"norm above the block's bimodal threshold (2-Gaussian mixture on log10 norms of "
                    f"{self.threshold_n} images, Ashman's D > {M.MIN_SEPARATION:g}, upper mode <= "
                    f"{M.MAX_UPPER_SHARE:g} of the tokens)")
        return f"norm > median + {self.k:g}*1.4826*MAD of the image's patch tokens"

    def required_taps(self) -> list[str]:
        nxt = [f"block{i + 1}.attn" for i in self.layers if i + 1 < self.depth] if self.has_cls_token else []
        return [f"block{i}.out" for i in self.layers] + nxt

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.positions = torch.zeros(len(self.layers), *grid, dtype=torch.float64)

    @staticmethod
    def _hist(norms: torch.Tensor) -> torch.Tensor:
        """``(L, ...)`` norms -> ``(L, bins)`` float64 counts on `NORM_BINS`, on the norms' device: one
        ``index_add_`` for every block (its output has a fixed size, unlike ``bincount``'s, so the host never
        waits for it; counts of ones in float64 are exact)."""
        nb, dev = len(NORM_BINS) - 1, norms.device
        idx = ((torch.log10(norms.flatten(1)) + 3) * 100).floor_().nan_to_num_(0).clamp_(0, nb - 1).long()
        idx = (idx + nb * torch.arange(len(norms), device=dev)[:, None]).reshape(-1)
        counts = torch.zeros(len(norms) * nb, dtype=torch.float64, device=dev)
        return counts.index_add_(0, idx, torch.ones(len(idx), dtype=torch.float64, device=dev)).reshape(len(norms), nb)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        g, p = self.pass_grid(batch), self.num_prefix_tokens
        B, S, L, ps = len(batch), g[0] * g[1], len(self.layers), self.patch_size
        # (L, B, S) patch norms (float32 norms of float32 tokens, then float64) and outlier flags, every block
        xs = [feats[f"block{i}.out"] for i in self.layers]
        norms = torch.stack([torch.linalg.vector_norm(t[:, p:], dim=-1) for t in xs]).double()
        dev = norms.device
        self._to_device(dev)
        if self.rule == "bimodal":
            if not self.threshold_n:
                raise VitscopeError(f"{self.name}: rule 'bimodal' needs its thresholds from the statistics pass: "
                                    "call prepare(vm, first_images) before the first batch (a study does)")
            out = torch.log10(norms) > self.thresholds[0][:, None, None]
        else:
            out = M.robust_outliers(norms, self.k)
        self.hist += self._hist(norms)
        lo_hi = [norms.amin((1, 2)), -norms.amax((1, 2))]
        if p > 1:
            rn = torch.stack([torch.linalg.vector_norm(t[:, 1:p], dim=-1) for t in xs]).double()
            self.reg_hist += self._hist(rn)
            lo_hi += [rn.amin((1, 2)), -rn.amax((1, 2))]
        else:
            lo_hi += [torch.full_like(lo_hi[0], float("inf"))] * 2
        self.lo_hi = torch.minimum(self.lo_hi, torch.stack(lo_hi, 1))
        outf = out.double()  # (L, B, S) 0 / 1
        n_out = outf.sum(-1)  # (L, B)
        self.count.add(n_out.T)
        self.with_outliers += (n_out > 0).sum(1).double()
        self.positions += outf.sum(1).reshape(L, *g)  # images with an outlier at each patch
        # pixel variance of each patch of the model's input, (B, S), in grid order
        img = on_device(batch.images, dev).float()[..., :g[0] * ps, :g[1] * ps].reshape(B, -1, g[0], ps, g[1], ps)
        var = img.var(dim=(1, 3, 5), unbiased=False).reshape(B, S).double()
        ok_out = out.permute(1, 2, 0).reshape(B * S, L)
        self.var_out.add(var.reshape(-1, 1).expand(-1, L), ok_out)
        self.var_all.add(var.reshape(-1, 1).expand(-1, L))
        if batch.masks is not None:
            fg = on_device(A._masks_to_grid(batch.masks, g, B), dev).double().reshape(-1, 1).expand(-1, L)
            self.fg_out.add(fg, ok_out)
            self.fg_all.add(fg)
            self.n_masked += B
        if self.has_cls_token:
            self._add_cls_attention(feats, outf, n_out)
        if self.knn and batch.labels is not None:
            self._keep_tokens(xs, out, n_out, batch, S)
        self.n_images += B

    def _add_cls_attention(self, feats: Mapping[str, torch.Tensor], outf: torch.Tensor, n_out: torch.Tensor) -> None:
        """Per image and block, the CLS attention mass the next block puts on the outliers, what uniform attention
        would give that many tokens (NaN for an image without outliers) and the mass on the registers; NaN at a
        block without a next one. ``outf``: (L, B, S) 0 / 1 outlier flags, ``n_out``: (L, B) their counts."""
        p, (L, B) = self.num_prefix_tokens, n_out.shape
        cls = {j: feats[f"block{i + 1}.attn"][:, :, 0].mean(1).double()  # (B, T), head-averaged CLS row
               for j, i in enumerate(self.layers) if i + 1 < self.depth}
        if not cls:
            return
        nan = torch.full((B,), float("nan"), dtype=torch.float64, device=n_out.device)

        def per_block(value: Any) -> torch.Tensor:
            return torch.stack([value(j) if j in cls else nan for j in range(L)], 1)  # (B, L)

        some = n_out > 0
        self.absorbed.add(per_block(lambda j: torch.where(some[j], (cls[j][:, p:] * outf[j]).sum(-1), nan)))
        self.uniform.add(per_block(lambda j: torch.where(some[j], n_out[j] / cls[j].shape[-1], nan)))
        self.registers.add(per_block(lambda j: cls[j][:, 1:p].sum(-1) if p > 1 else nan))

    def _keep_tokens(self, xs: list[torch.Tensor], out: torch.Tensor, n_out: torch.Tensor, batch: Any, S: int
                     ) -> None:
        """For the k-NN: per image and block the mean outlier token and a random patch token, with whether it
        has outliers, brought to the host in the batch's one copy (`to_host`) and kept (`_keep`)."""
        p, B = self.num_prefix_tokens, len(batch)
        ids = on_host(batch.index).long()
        dev_ids = on_device(ids, out.device)
        mean_out, rand = [], []
        for j, i in enumerate(self.layers):
            tok = xs[j][:, p:]
            w = out[j].to(tok.dtype)
            mean_out.append(torch.bmm(w[:, None], tok)[:, 0] / w.sum(-1, keepdim=True).clamp_min(1))
            rand.append(tok[torch.arange(B, device=tok.device), _random_token(dev_ids, i, S)])
        has, mean_out_h, rand_h = to_host((n_out > 0).T, torch.stack(mean_out, 1).half(), torch.stack(rand, 1).half())
        self._keep(ids, on_host(batch.labels).long(), has, mean_out_h, rand_h)

    def _keep(self, ids: torch.Tensor, labels: torch.Tensor, has: torch.Tensor, out: torch.Tensor,
              rand: torch.Tensor) -> None:
        """Keep the ``max_images`` smallest ids among those kept and the new ones, in id order."""
        if not len(self.ids):
            self.out_feats = torch.zeros(0, *out.shape[1:], dtype=torch.float16)
            self.rand_feats = torch.zeros(0, *rand.shape[1:], dtype=torch.float16)
        ids, order = torch.sort(torch.cat([self.ids, ids]), stable=True)
        sel = order[: self.max_images]
        self.labels = torch.cat([self.labels, labels])[sel]
        self.has_out = torch.cat([self.has_out, has])[sel]
        self.out_feats = torch.cat([self.out_feats, out])[sel]
        self.rand_feats = torch.cat([self.rand_feats, rand])[sel]
        self.ids = ids[: self.max_images]

    _KEPT = ("ids", "labels", "has_out", "out_feats", "rand_feats")

    def merge(self, other: Analysis) -> None:
        o = cast(HighNormTokens, other)
        self._check_mergeable(o)
        self._check_grid_merge(o)
        if self.threshold_n and o.threshold_n and not (
                self.threshold_n == o.threshold_n and torch.allclose(on_host(self.thresholds), on_host(o.thresholds),
                                                                     rtol=1e-4)):
            raise VitscopeError(f"{self.name}: cannot merge parts that used different bimodal thresholds (other "
                                "images in their statistics passes)")
        if o.threshold_n and not self.threshold_n:
            self.thresholds, self.threshold_n = o.thresholds.clone(), o.threshold_n
        for k in self._MEANS:
            getattr(self, k).merge(getattr(o, k))
        self._add_tensors(o, ("hist", "reg_hist", "positions", "with_outliers"))
        self.lo_hi = torch.minimum(self.lo_hi, on_device(o.lo_hi, self.lo_hi.device))
        if len(o.ids):
            self._keep(o.ids, o.labels, o.has_out, o.out_feats, o.rand_feats)
        self.n_images += o.n_images
        self.n_masked += o.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **{k: getattr(self, k).clone() for k in self._KEPT},
                "thresholds": host_copy(self.thresholds), "threshold_n": self.threshold_n}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        for k in self._KEPT:
            setattr(self, k, state[k].clone())
        self.thresholds, self.threshold_n = state["thresholds"].clone(), int(state["threshold_n"])

    def finalize(self) -> pd.DataFrame:
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows: list[dict[str, Any]] = []
        views = [("spatial", self.hist, 0)] + ([("register", self.reg_hist, 2)] if self.num_prefix_tokens > 1 else [])
        h, w = self.grid_size
        for j, i in enumerate(self.layers):
            for view, hist, col in views:
                if not hist[j].sum():
                    continue
                lo, hi = float(self.lo_hi[j, col]), -float(self.lo_hi[j, col + 1])
                qs = [min(max(v, lo), hi) for v in _quantiles(hist[j], QUANTILES)]  # a bin's centre: inside
                rows += [{"metric": "norm_quantile", "layer": i, "token_view": view, "quantile": q, "value": v}
                         for q, v in zip((0.0, *QUANTILES, 1.0), (lo, *qs, hi), strict=True)]
            rows.append({"metric": "outliers_per_image", "layer": i, **self.count.row(j)})
            rows.append(self._share(i, float(self.with_outliers[j]), self.n_images))
            rows += [{"metric": "outlier_position", "layer": i, "row": r, "col": c,
                      "value": float(self.positions[j, r, c])} for r in range(h) for c in range(w)]
            for metric, tokens, means in (("patch_variance", "outliers", self.var_out),
                                          ("patch_variance", "all", self.var_all),
                                          ("foreground_share", "outliers", self.fg_out),
                                          ("foreground_share", "all", self.fg_all),
                                          ("cls_attention_absorbed", "outliers", self.absorbed),
                                          ("cls_attention_absorbed", "uniform", self.uniform),
                                          ("cls_attention_absorbed", "registers", self.registers)):
                if means.count[j] > 0:
                    rows.append({"metric": metric, "layer": i, "tokens": tokens, **means.row(j)})
        if self.rule == "bimodal" and self.threshold_n:
            for j, i in enumerate(self.layers):
                thr, sep, upper = (float(v) for v in self.thresholds[:, j])
                rows.append({"metric": "norm_threshold", "layer": i, "value": 10 ** thr if thr < float("inf")
                             else float("nan"), "separation": sep, "upper_share": upper, "n": self.threshold_n})
        rows += self._knn_rows()
        df = self.tidy(rows)
        df["n_images"], df["n_masked"], df["k"] = self.n_images, self.n_masked, self.k
        df["rule"] = self._rule_text()
        return df

    def _share(self, layer: int, hits: float, n: int) -> dict[str, Any]:
        p = hits / n if n else float("nan")
        lo, hi, se = binomial_interval(p, n)
        return {"metric": "images_with_outliers", "layer": layer, "value": p, "stderr": se, "value_lo": lo,
                "value_hi": hi, "n": n}

    def _knn_rows(self) -> list[dict[str, Any]]:
        from vitscope.analyses.splits import stratified_test
        from vitscope.metrics.semantics import knn_classify

        rows: list[dict[str, Any]] = []
        if not self.knn or not len(self.ids):
            return rows
        for j, i in enumerate(self.layers):
            sel = self.has_out[:, j]
            ids, y = self.ids[sel], self.labels[sel]
            test = stratified_test(ids, y, self.test_every)
            if not test.any() or test.all() or len(torch.unique(y[~test])) < 2:
                continue
            for tokens, feats in (("outliers", self.out_feats), ("random_patch", self.rand_feats)):
                x = feats[sel, j].float()
                acc = knn_classify(x[~test], y[~test], x[test], y[test], ks=(self.knn_k,))[self.knn_k][0]
                n = int(test.sum())
                lo, hi, se = binomial_interval(acc, n)
                rows.append({"metric": "knn_accuracy", "layer": i, "tokens": tokens, "value": acc, "stderr": se,
                             "value_lo": lo, "value_hi": hi, "n": n})
        return rows


ABLATION_MODES = ("zero", "mean")
ABLATION_SETS = ("each", "all")


@register_analysis
class HeadAblation(_Mechanistic):
    """Ablation of attention heads, read at the model's output. An ablated head's output (its slice of
    ``block{i}.heads``, before the output projection) is replaced (``mode``):

    * ``zero``: by 0;
    * ``mean``: by its mean over images at the same token position, ``mean_images`` images (the first of the
      dataset's selection, in dataset order; all of them when it has fewer). Per position, because a ViT's
      tokens are not exchangeable (position embeddings, the CLS token, registers): a mean over positions would
      also erase what a head writes where; over images, because that is what mean-ablation asks (the head's
      typical output kept, its dependence on the image removed), and zero is no typical output (the next
      LayerNorm and MLP never saw it). The mean comes from a statistics pass before the ablation pass
      (`Analysis.prepare`), since the ablation of the first image already needs it (a mean accumulated in the
      ablation pass itself would differ per shard and per batch order): a forward of those images up to the
      last ablated block, once per run (on every rank the same images, so shards agree; saved in the state, so
      a resumed run reuses it). Every image then needs the same token grid as those images.

    ``heads`` picks the ablation sets: ``each`` head of a block alone (a row per (layer, head)), or ``all``
    heads of the block at once (a row per layer, ``head`` empty; with ``mean``: the block's attention branch
    replaced by its mean output). The rest of the network runs from the pass's own residual stream entering
    that block (``embed`` / ``block{i-1}.out``): only the blocks from i on are recomputed, every set of a block
    in one batch of ``sets x images``; nothing is written to the weights. Table per (layer, head), with the
    columns ``mode`` and ``heads``:

    * with a classifier head: ``kl_from_clean`` (mean over images of KL(clean prediction || ablated), nats,
      ``stderr``, interval) and ``prediction_flips`` (share of images whose top-1 class changes, Wilson
      interval); ``accuracy_drop`` (clean minus ablated top-1 accuracy, the mean of the per-image differences
      with their ``stderr`` and interval) when the head's label space covers the dataset's classes (as the
      logit lens decides it);
    * without one: ``output_change`` (mean over images of 1 - cosine similarity of the model's pooled output,
      clean vs ablated).

    Cost: one forward per ablation set from the ablated block on: per block i, ``sets x (depth - i)`` block
    passes for every image (``each``: about ``heads x depth / 2`` forwards over all blocks, ``all``: about
    ``depth / 2``); ``mean`` adds the statistics pass over ``mean_images`` images. Name the blocks to ablate
    with ``layers``. BEiT with a shared relative position bias is refused (its blocks cannot be rerun alone).
    To re-measure another analysis (k-NN, propagation, shape bias) with heads ablated, make the model an ablated
    variant instead: ``ablate:`` on its study entry (docs/CONFIG.md), one forward per image per variant."""

    name = "head_ablation"
    state_version = 2  # the mean and the ablation sets in the state
    description = "attention heads zeroed or mean-ablated (each, or all of a block): KL to the clean prediction, flips"
    _MEANS = ("kl", "change", "drop")
    _TENSORS = ("flips",)
    _ON_DEVICE = ("head_mean",)

    def __init__(self, vm: Any, layers: Any = None, head_classes: str | None = None,
                 mode: Literal["zero", "mean"] = "zero", heads: Literal["each", "all"] = "each",
                 mean_images: Count = 500):
        from vitscope.analyses.robustness import check_head_classes, head_label_space
        from vitscope.errors import check_choice

        super().__init__(vm)
        check_head_classes(self.name, head_classes)
        self.mode = check_choice(mode, ABLATION_MODES, self.name, "mode", "zero or mean")
        self.heads = check_choice(heads, ABLATION_SETS, self.name, "heads", "each or all")
        Count.__metadata__[0].check(mean_images, f"{self.name}: mean_images")
        self.mean_images = int(mean_images)
        self.layers = self.layers_param(layers)
        self._model = getattr(vm, "model", None)
        if self._model is not None and getattr(self._model, "rel_pos_bias", None) is not None:
            raise VitscopeError(f"{self.name}: {self.model_name} shares one relative position bias across blocks, "
                                "so a block cannot be rerun alone from the cached residual stream")
        self.has_head = self._model is None or int(getattr(self._model, "num_classes", 0) or 0) > 0
        self.head_space = (None if head_classes == "none" else head_classes) or head_label_space(vm)
        self.classes: list[str] | None = None
        L, G = len(self.layers), self.n_sets
        self.kl, self.change, self.drop = _Means(L, G), _Means(L, G), _Means(L, G)
        self.flips = torch.zeros(L, G, dtype=torch.float64)
        self.n_masked = 0  # the shared state layout: images whose labels were scored
        # mode mean: (layers, tokens, D) float64 mean of block{i}.heads over the images of the statistics pass
        self.head_mean = torch.zeros(0, dtype=torch.float64)
        self.mean_n = 0

    @property
    def n_sets(self) -> int:
        """Ablation sets per block: one per head, or one (all heads)."""
        return self.num_heads if self.heads == "each" else 1

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "has_head": self.has_head, "head_space": self.head_space,
                "classes": self.classes, "mode": self.mode, "heads": self.heads, "mean_images": self.mean_images}

    configure = LogitLens.configure
    _covered_classes = LogitLens._covered_classes

    def required_taps(self) -> list[str]:
        return [("embed" if i == 0 else f"block{i - 1}.out") for i in self.layers] + ["logits"]

    def prepare(self, vm: Any, first_images: Any) -> None:
        """Mode ``mean``: the statistics pass, unless the state already holds its result (a resumed run)."""
        if self.mode != "mean" or self.mean_n:
            return
        from vitscope.models.ablation import head_means

        self.head_mean, self.mean_n = head_means(vm, self.layers, first_images, self.mean_images, self.name)

    def _ablated(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """``(G, B, ...)`` model outputs with ablation set g of block ``layer`` (head g, or every head) in group g."""
        from vitscope.models.ablation import replace_heads

        m, H, G = self._model, self.num_heads, self.n_sets
        if m is None:
            raise VitscopeError(f"{self.name}: ablation needs the loaded model, not a cached state")
        B = x.shape[0]
        mean = None
        if self.mode == "mean":
            if not self.mean_n:
                raise VitscopeError(f"{self.name}: mode 'mean' needs the heads' mean from its statistics pass: call "
                                    "prepare(vm, first_images) before the first batch (a study does)")
            mean = self.head_mean[self.layers.index(layer)]  # (T, D)
            if mean.shape[0] != x.shape[1]:
                raise VitscopeError(f"{self.name}: mode 'mean' averaged the heads over {mean.shape[0]} tokens, but "
                                    f"this batch has {x.shape[1]} (images of another size): give the dataset one "
                                    "image size")

        def ablate(module: Any, args: tuple) -> tuple:
            h = args[0].clone()
            view = h.view(G, B, *h.shape[1:])
            for g in range(G):
                replace_heads(view[g], H, None if G == 1 else [g], mean)
            return (h, *args[1:])

        handle = m.blocks[layer].attn.proj.register_forward_pre_hook(ablate)
        try:
            with torch.inference_mode(), taps_paused():
                y = x.repeat(G, *([1] * (x.ndim - 1)))
                for blk in list(m.blocks)[layer:]:
                    y = blk(y)
                out = m.forward_head(m.norm(y))
        finally:
            handle.remove()
        return out.reshape(G, B, -1)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        from vitscope.analyses.robustness import head_scores

        B = len(batch)
        clean = feats["logits"].double()
        self._to_device(clean.device)
        classes = self._covered_classes() if (self.has_head and batch.labels is not None) else None
        labels = on_device(batch.labels, clean.device) if classes is not None else None

        def hits(logits: torch.Tensor) -> torch.Tensor:
            scores = head_scores(cast(str, self.head_space), cast(list, classes), logits)
            return (scores.argmax(-1) == labels).double()

        kls, changes, flips, correct = [], [], [], []
        for i in self.layers:
            x = feats["embed"] if i == 0 else feats[f"block{i - 1}.out"]
            abl = self._ablated(x, i).double()  # (G, B, C): G ablation sets
            if self.has_head:
                kls.append(torch.stack([M.kl_to_final(a, clean) for a in abl], 1))  # (B, G)
                flips.append((abl.argmax(-1) != clean.argmax(-1)).double().sum(1))
                if classes is not None:
                    correct.append(hits(clean).unsqueeze(1) - torch.stack([hits(a) for a in abl], 1))  # (B, G)
            else:
                cos = torch.nn.functional.cosine_similarity(abl, clean.unsqueeze(0), dim=-1)  # (G, B)
                changes.append((1 - cos).T)
        if self.has_head:
            self.kl.add(torch.stack(kls, 1))
            self.flips += torch.stack(flips)
            if classes is not None:
                self.drop.add(torch.stack(correct, 1))
                self.n_masked += B
        else:
            self.change.add(torch.stack(changes, 1))
        self.n_images += B

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        o = cast(HeadAblation, other)
        if self.mean_n and o.mean_n and (self.mean_n != o.mean_n or self.head_mean.shape != o.head_mean.shape
                                         or not torch.allclose(self.head_mean.cpu(), o.head_mean.cpu(), rtol=1e-4,
                                                               atol=1e-6)):
            raise VitscopeError(f"{self.name}: cannot merge parts ablated with different means of the heads (other "
                                "images in their statistics passes)")
        if o.mean_n and not self.mean_n:
            self.head_mean, self.mean_n = o.head_mean.clone(), o.mean_n
        for k in self._MEANS:
            getattr(self, k).merge(getattr(o, k))
        self._add_tensors(o, self._TENSORS)
        self.n_images += o.n_images
        self.n_masked += o.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "head_mean": host_copy(self.head_mean), "mean_n": self.mean_n}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.head_mean, self.mean_n = state["head_mean"].clone(), int(state["mean_n"])

    def finalize(self) -> pd.DataFrame:
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows: list[dict[str, Any]] = []
        n = self.n_images
        for j, i in enumerate(self.layers):
            for g in range(self.n_sets):
                h = g if self.heads == "each" else None
                if not self.has_head:
                    rows.append({"metric": "output_change", "layer": i, "head": h, **self.change.row(j, g)})
                    continue
                rows.append({"metric": "kl_from_clean", "layer": i, "head": h, **self.kl.row(j, g)})
                p = float(self.flips[j, g]) / n if n else float("nan")
                lo, hi, se = binomial_interval(p, n)
                rows.append({"metric": "prediction_flips", "layer": i, "head": h, "value": p, "stderr": se,
                             "value_lo": lo, "value_hi": hi, "n": n})
                if self.drop.count[j, g] > 0:  # per image: clean correct minus ablated correct (-1, 0 or 1)
                    rows.append({"metric": "accuracy_drop", "layer": i, "head": h, **self.drop.row(j, g)})
        df = self.tidy(rows)
        df["n_images"], df["mode"], df["heads"] = self.n_images, self.mode, self.heads
        if self.mode == "mean":
            df["mean_images"] = self.mean_n
        return df
