"""Head ablation (`HeadAblation`): part of the mechanistic lens (`vitscope.analyses.mechanistic`; math in
`vitscope.metrics.mechanistic`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, DataSizes, Forwards, register_analysis
from vitscope.analyses.mechanistic._common import _Means, _Mechanistic
from vitscope.analyses.mechanistic.logit_lens import LogitLens
from vitscope.bounds import Count
from vitscope.capture.engine import taps_paused
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, on_device
from vitscope.metrics import mechanistic as M
from vitscope.metrics.semantics import binomial_interval

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
    with ``layers``. BEiT with a shared relative position bias (SimMIM) reruns its blocks with it.
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

    def own_forwards(self, vm: Any, data: DataSizes) -> list[Forwards]:
        """Per batch of B images and per ablated block i, one rerun of the blocks from i on for its ablation sets
        (sets x B images, ``depth - i`` blocks each); mode ``mean`` adds the statistics pass over the first
        ``mean_images`` images, up to the last ablated block."""
        n, batches = sum(data.batches), len(data.batches)
        G, layers = self.n_sets, self.layers
        out = [Forwards(batches * len(layers), G * n * len(layers),
                        blocks=G * n * sum(self.depth - i for i in layers))]
        if self.mode == "mean":
            first = data.first(self.mean_images)
            out.append(Forwards(len(first), sum(first), blocks=sum(first) * (max(layers, default=-1) + 1)))
        return out

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
                # BEiT / SimMIM with one relative position bias shared by all blocks: each block is given it, as
                # timm's forward_features does (the model's single input size, so the table is the model's own)
                shared = getattr(m, "rel_pos_bias", None)
                kw = {"shared_rel_pos_bias": shared()} if shared is not None else {}
                for blk in list(m.blocks)[layer:]:
                    y = blk(y, **kw)
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
