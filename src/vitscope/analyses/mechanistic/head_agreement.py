"""Head agreement (`HeadAgreement`): how alike two models' own classifier heads rank an image's classes and pick
its top-1 class, Shekhar et al. 2022 §2.4, Fig. 4 (a pair analysis; math in `vitscope.metrics.mechanistic`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, cast

import numpy as np
import pandas as pd
import torch

from vitscope.analyses.base import Forwards, PairAnalysis, register_analysis
from vitscope.bounds import Count, Range
from vitscope.errors import ResultWarning, VitscopeError
from vitscope.metrics import mechanistic as M

#: a top-k of Kendall's tau: two classes at least (one class has no pair to order)
TopK = Annotated[int, Range(2, why="Kendall's tau orders pairs of classes")]


def head_classes(vm: Any) -> int:
    """The number of classes of ``vm``'s classifier head (0: headless, its ``logits`` tap is the pooled feature)."""
    return int(getattr(getattr(vm, "model", None), "num_classes", 0) or 0)


@register_analysis
class HeadAgreement(PairAnalysis):
    """Agreement of two models' own classifier heads on the same images [Shekhar et al. 2022 §2.4, Fig. 4], from
    each model's ``logits`` tap (one clean forward per model and batch):

    * ``kendall_tau`` per ``k`` in ``ks``: per image, Kendall's tau-b between the two models' logits on the top-k
      classes, averaged over the images. The paper ranks one model's top-k classes under both; which model's
      top-k is taken changes the value, so here it is the mean of the two (A's top-k and B's top-k:
      `vitscope.metrics.mechanistic.topk_kendall_tau`), the same for (A, B) and (B, A). ``k`` is capped at the
      number of classes (column ``k_used``). The 95 % interval is the t interval of the mean over the images
      (`vitscope.metrics.intervals.mean_interval`; ``stderr``, ``value_lo``, ``value_hi``, ``n``).
    * ``top1_f1``: the macro F1 of one model's top-1 predictions against the other's (symmetric:
      `vitscope.metrics.mechanistic.top1_f1`), with a delete-a-group jackknife interval over ``f1_groups``
      contiguous groups of the images in id order (t with groups - 1 degrees of freedom), since it is not a mean
      over images.
    * ``top1_agreement``: the share of images whose top-1 class the two heads share (the micro F1), with its
      t interval over the images.

    Both models need a classification head over the same classes (as many logits; the same known label space,
    `vitscope.analyses.robustness.head_label_space`). Otherwise the table is empty and says why (a
    `ResultWarning` too): a headless model's ``logits`` are its pooled features, not class scores. The paper
    ranks the outputs of linear probes trained on ImageNet; here the models' own heads (fine-tuned or
    supervised checkpoints, or a zoo model's head). The pairs are the study's: ``pairs: [[A, B], ...]`` or
    every ``finetuned_from``. The state keeps each image's taus and top-1 classes (a few numbers per image), so
    parts merge by concatenation, sorted by image id at the end: shards and resumes give the same table."""

    name = "head_agreement"
    description = "Kendall's tau of the top-5/10/100 classes and top-1 F1 between two models' own heads (Shekhar)"
    in_default_study = False  # a study names its pairs
    state_version = 1

    def __init__(self, info_a: Any, info_b: Any, *, ks: Sequence[TopK] = (5, 10, 100), f1_groups: Count = 20,
                 **params: Any):
        params.pop("pairs", None)  # which pairs: the planner's business
        if params:
            raise VitscopeError(f"{self.name}: unknown parameter(s) {', '.join(sorted(params))}; it takes ks, "
                                "f1_groups")
        super().__init__(info_a, info_b)
        if isinstance(ks, int | str) or not len(ks):
            raise VitscopeError(f"{self.name}: ks must be a non-empty list of top-k sizes (2 or more); got {ks!r}")
        for k in ks:
            TopK.__metadata__[0].check(k, f"{self.name}: ks")
        Count.__metadata__[0].check(f1_groups, f"{self.name}: f1_groups")
        self.ks = sorted({int(k) for k in ks})
        self.f1_groups = int(f1_groups)
        self.classes: int | None = None  # the heads' classes, once both are seen to have the same
        self.no_rows_because = None
        self.ids: list[torch.Tensor] = []
        self.taus: list[torch.Tensor] = []  # (B, len(ks)) per batch
        self.preds: list[torch.Tensor] = []  # (B, 2): A's and B's top-1 class

    # -- the heads ---------------------------------------------------------------------------------------------
    def _check_heads(self, vm_a: Any, vm_b: Any) -> bool:
        """Whether both models have a head over the same classes; else the reason, kept and warned once."""
        if self.classes is not None or self.no_rows_because:
            return self.classes is not None
        from vitscope.analyses.robustness import head_label_space

        ca, cb = head_classes(vm_a), head_classes(vm_b)
        sa, sb = head_label_space(vm_a), head_label_space(vm_b)
        if not ca or not cb:
            who = " and ".join(repr(m) for m, c in ((self.model_a, ca), (self.model_b, cb)) if not c)
            reason = (f"{who} {'has' if ' and ' not in who else 'have'} no classification head, so there are no "
                      "class rankings to compare (load both with a head over the same classes)")
        elif ca != cb or (sa is not None and sb is not None and sa != sb):
            reason = (f"the heads of {self.model_a!r} ({ca} classes{f', {sa}' if sa else ''}) and {self.model_b!r} "
                      f"({cb} classes{f', {sb}' if sb else ''}) do not score the same classes")
        else:
            self.classes = ca
            return True
        self.no_rows_because = reason
        warnings.warn(f"{self.name}: {reason}; the table of this pair is empty", ResultWarning, stacklevel=3)
        return False

    # -- cost --------------------------------------------------------------------------------------------------
    def own_forwards(self, vm_a: Any, vm_b: Any, data: Any) -> list[Forwards]:
        """One clean forward of every batch on each model (its ``logits``)."""
        n, batches = sum(data.batches), len(data.batches)
        return [Forwards(batches, n, model="a"), Forwards(batches, n, model="b")]

    # -- accumulation ------------------------------------------------------------------------------------------
    def update(self, vm_a: Any, vm_b: Any, batch: Any) -> None:
        from vitscope.capture.engine import Capture
        from vitscope.host import to_host

        if not self._check_heads(vm_a, vm_b):
            self.n_images += len(batch)
            return
        logits = []
        for vm in (vm_a, vm_b):
            with Capture(vm, ["logits"]) as cap:
                logits.append(cap(batch.images)["logits"])
        la, lb = cast(tuple[torch.Tensor, torch.Tensor], to_host(*logits))  # one copy per model and batch
        self.taus.append(torch.stack([M.topk_kendall_tau(la, lb, k) for k in self.ks], 1))
        self.preds.append(torch.stack([la.argmax(-1), lb.argmax(-1)], 1).long())
        self.ids.append(batch.index.detach().cpu().long().reshape(-1))
        self.n_images += len(batch)

    def merge(self, other: Any) -> None:
        o = cast(HeadAgreement, other)
        if o.ks != self.ks:
            raise VitscopeError(f"{self.name}: cannot merge parts with other ks ({o.ks} vs {self.ks})")
        self.ids += o.ids
        self.taus += o.taus
        self.preds += o.preds
        self.n_images += o.n_images
        self.classes = self.classes if self.classes is not None else o.classes
        self.no_rows_because = self.no_rows_because or o.no_rows_because

    def state_dict(self) -> dict[str, Any]:
        ids, taus, preds = self._sorted()
        return {"ks": list(self.ks), "f1_groups": self.f1_groups, "classes": self.classes,
                "reason": self.no_rows_because, "n_images": self.n_images, "ids": ids, "taus": taus,
                "preds": preds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ks, self.f1_groups = [int(k) for k in state["ks"]], int(state["f1_groups"])
        self.classes, self.no_rows_because = state["classes"], state["reason"]
        self.n_images = int(state["n_images"])
        self.ids, self.taus, self.preds = [state["ids"].clone()], [state["taus"].clone()], [state["preds"].clone()]

    def _sorted(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every image's id, taus and top-1 classes, in id order (the same whatever the shards or resumes)."""
        ids = torch.cat(self.ids) if self.ids else torch.zeros(0, dtype=torch.long)
        taus = torch.cat(self.taus) if self.taus else torch.zeros(0, len(self.ks), dtype=torch.float64)
        preds = torch.cat(self.preds) if self.preds else torch.zeros(0, 2, dtype=torch.long)
        order = torch.argsort(ids, stable=True)
        return ids[order], taus[order], preds[order]

    # -- the table ---------------------------------------------------------------------------------------------
    def empty_reason(self) -> str:
        return self.no_rows_because or super().empty_reason()

    def finalize(self) -> pd.DataFrame:
        from vitscope.metrics.intervals import mean_interval
        from vitscope.metrics.similarity.jackknife import jackknife_interval

        _, taus, preds = self._sorted()
        rows: list[dict[str, Any]] = []
        n = len(taus)
        if n and self.classes is not None:
            for j, k in enumerate(self.ks):
                rows.append({"metric": "kendall_tau", "k": k, "k_used": min(k, self.classes),
                             **_mean_row(taus[:, j].numpy(), mean_interval)})
            f1 = M.top1_f1(preds[:, 0], preds[:, 1])
            se, lo, hi = jackknife_interval(f1, M.top1_f1_replicates(preds[:, 0], preds[:, 1], self.f1_groups),
                                            bounds=(0.0, 1.0))
            rows.append({"metric": "top1_f1", "value": f1, "stderr": se, "value_lo": lo, "value_hi": hi, "n": n,
                         "f1_groups": min(self.f1_groups, n)})
            same = (preds[:, 0] == preds[:, 1]).double().numpy()
            rows.append({"metric": "top1_agreement", **_mean_row(same, mean_interval)})
        df = self.tidy(rows)
        if len(df):
            df["classes"], df["n_images"] = self.classes, self.n_images
        return df


def _mean_row(values: np.ndarray, mean_interval: Any) -> dict[str, Any]:
    """``value`` (the mean of the finite values), ``stderr``, the t interval and ``n`` (the finite values)."""
    ci = mean_interval(values)
    return {"value": float(ci["mean"]), "stderr": float(ci["stderr"]), "value_lo": float(ci["value_lo"]),
            "value_hi": float(ci["value_hi"]), "n": int(np.isfinite(values).sum())}
