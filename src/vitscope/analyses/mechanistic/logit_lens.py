"""The logit lens (`LogitLens`): part of the mechanistic lens (`vitscope.analyses.mechanistic`; math in
`vitscope.metrics.mechanistic`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.mechanistic._common import _Means, _Mechanistic
from vitscope.analyses.splits import TestEvery
from vitscope.bounds import Count, Iterations, Positive
from vitscope.errors import VitscopeError
from vitscope.host import on_device, on_host
from vitscope.metrics import mechanistic as M
from vitscope.metrics.semantics import binomial_interval

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
