"""Shape vs texture bias on cue-conflict images (`vitscope.analyses.robustness`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.robustness._common import (
    _clean_columns,
    _reason_of,
    _Robustness,
    _with_reason,
    chance_reason,
    decision_rows,
    shape_bias_interval,
)
from vitscope.errors import ConfigError
from vitscope.host import on_device, on_host
from vitscope.metrics import robustness as R
from vitscope.metrics import semantics as S


# ---------------------------------------------------------------- shape vs texture bias
@register_analysis
class ShapeBias(_Robustness):
    """Shape vs texture bias on cue-conflict images (Geirhos et al., ICLR 2019; per model in Park et al., "What do
    self-supervised ViTs learn?", ICLR 2023, last layer only): among the decisions that are either the shape
    class or the texture class, the fraction that follow the shape, with the counts (``n_shape``,
    ``n_texture``, ``n_other``; images whose shape and texture class agree are left out). Per layer from
    linear probes fitted on the clean ``train`` input (images of the same classes: the generated silhouettes'
    shape-only and texture-only images, or scenes with random textures, a shape-only probe), and from
    the model's head where it covers the classes. Rows per (readout, layer): ``shape_bias``, ``n_shape``,
    ``n_texture``, ``n_other``, ``n_images`` (images whose cues differ), ``n_excluded``, ``shape_match`` /
    ``texture_match``, and ``clean_accuracy`` of the probe on held-out clean training images.
    ``match_denominator``: what ``shape_match`` / ``texture_match`` divide by, ``all`` (default: every
    cue-conflict image, the left-out ones included, as model-vs-human's ``fraction-correct-shape`` /
    ``-texture``) or ``kept`` (the images whose cues differ); a column of the table. The shape bias does not
    depend on it. It carries a 95 % Wilson interval (``value_lo``, ``value_hi``) and ``stderr`` over the
    ``n_shape + n_texture`` decisions it is the fraction of (`shape_bias_interval`; the decisions of a fixed
    readout are independent trials; benchmarks/calibration.py, docs/CALIBRATION.md). ``standardize`` (default
    true, as `vitscope.analyses.semantics.Semantics`'s): the probes fit on standardised features (MAE's
    affine-free BatchNorm); false fits the raw ones (Walmer et al. 2023 Table 6's 'no BN' rows).

    Per category (Geirhos et al. 2019 Fig. 4 and Park et al. 2023 plot a point per shape class and each model's
    mean as a line): rows ``shape_bias_category`` per (readout, layer, ``category``), the category being the
    shape class of the cue-conflict images, with the same counts and Wilson interval over that class's
    decisions (``n`` = its ``n_shape + n_texture``); a probe at chance at a block gives NaN there too, as its
    overall row. The overall ``shape_bias`` rows are unchanged (they pool every decision, not the categories'
    mean)."""

    name = "shape_bias"
    description = "shape vs texture bias on cue-conflict images, per layer (probes) and for the head"
    needs = frozenset({"cue_conflict"})
    inputs = {"train": frozenset({"labels"})}
    state_version = 7  # 7: the head's decisions tallied per shape class too ('cue_category');
    # 6: the shape bias's Wilson interval; 5: the head's decisions as a tally (`R.shape_bias_tally`);
    # 4: no shape bias from a probe at chance (reason); 3: stratified split, tuned probe;
    # 2: match_denominator (every image by default)

    def __init__(self, vm: Any, match_denominator: str = "all", standardize: bool = True, **kw: Any):
        super().__init__(vm, **kw)
        self.match_denominator = R.check_match_denominator(match_denominator)
        self.probe_kw["standardize"] = S.probe_options(self.name, standardize=standardize)["standardize"]
        self.cue_texture: list[torch.Tensor] = []  # texture class of each row of tables['cue'], in order

    @classmethod
    def views(cls, params: dict) -> list[str]:
        """Only the clean images; called by the planner at configuration, so an unknown ``match_denominator`` is
        one sentence before any model loads."""
        R.check_match_denominator(params.get("match_denominator", "all"))
        return ["clean"]

    def merge(self, other: Analysis) -> None:
        super().merge(other)
        assert isinstance(other, ShapeBias)
        self.cue_texture.extend(other.cue_texture)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "cue_texture": torch.cat(self.cue_texture) if self.cue_texture
                else torch.empty(0, dtype=torch.long)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.cue_texture = [state["cue_texture"]] if len(state["cue_texture"]) else []

    def _check_train_classes(self, names: Sequence[str] | None) -> None:
        """At the first clean training batch (when `configure` was not told the classes): the probe's classes
        must be the cue-conflict images' classes."""
        if names is None:
            return
        self.dataset_classes["train"] = list(names)
        ok, why = self.probe_possible()
        if not ok and self.use_probe:
            if not self.use_head:
                raise ConfigError(f"shape_bias: {self.model_name} has no classifier head covering the cue-conflict "
                                  f"classes and there are no clean images for a linear probe ({why})")
            self.use_probe = False  # the head decides; no probe rows

    def probe_possible(self) -> tuple[bool, str]:
        train = self.datasets.get("train")
        if "train" in self.datasets and train is None:
            return False, "no dataset provides clean labelled training images"
        if train is not None and train == self.datasets.get("data"):
            raise ConfigError(f"shape_bias: its train input is the cue-conflict set {train!r} itself; name a dataset "
                              "of clean images of the same classes with train_dataset: (e.g. synthetic-silhouettes)")
        mine, theirs = self.classes_of("data"), self.classes_of("train")
        if mine is not None and theirs is not None and list(mine) != list(theirs):
            return False, (f"the training images ({train}) have other classes than the cue-conflict images "
                           f"({len(theirs)} vs {len(mine)} classes)")
        return True, ""

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self._ensure_configured(batch)
        slot = self._slot(batch)
        texture = batch.extra.get("texture_labels") if slot == "data" else None
        if slot == "data" and texture is None and "train" not in self.datasets:
            slot = "train"  # by hand (no planner): batches without texture labels are the clean training images
        key = "cue" if slot == "data" else "train"
        if key == "train" and not self.seen.get("train") and "train" not in self.dataset_classes:
            self._check_train_classes(batch.extra.get("class_names"))
        take = min(self.max_images - self.seen.get(key, 0), len(batch))
        if take <= 0:
            return
        labels = on_host(batch.labels)[:take].long()
        if key == "cue":
            tex = on_host(torch.as_tensor(texture))[:take].long()
            if self.use_head:  # before the probe's copy to the host: a tally on the device
                d, c = self._head_decisions(feats, take)
                shape, tex_d = on_device(labels, d.device), on_device(tex, d.device)
                self._add_tally("cue", R.shape_bias_tally(d, shape, tex_d))
                self._add_tally("cue_category", R.shape_bias_category_tally(d, shape, tex_d, c))
            if self.use_probe:
                self._add_pooled("cue", feats, batch, take, labels, torch.ones(take, dtype=torch.bool))
                self.cue_texture.append(tex)
            self.n_images += take
        elif self.use_probe:
            self._add_pooled("train", feats, batch, take, labels, self._is_test(batch, take))
        self.seen[key] = self.seen.get(key, 0) + take

    @staticmethod
    def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
        """Per model and readout (head; last-layer probe): shape bias, its counts, the probe's clean accuracy;
        and the block where the probes' shape bias peaks."""
        rows = []
        for (model, decision), g in decision_rows(df).groupby(["model", "decision"], sort=False):
            v = g.set_index("metric")["value"]
            row = {"model": model, "readout": decision, "shape bias": v.get("shape_bias"),
                   "shape / texture / other": f"{int(v.get('n_shape', 0))} / {int(v.get('n_texture', 0))} / "
                                              f"{int(v.get('n_other', 0))}",
                   "clean accuracy (probe)": v.get("clean_accuracy", float("nan"))}
            per = df[(df.model == model) & (df.metric == "shape_bias") & (df.readout == "probe")]
            if len(per) and decision != "head" and per["value"].notna().any():
                row["peak block"] = int(per.loc[per["value"].astype(float).idxmax(), "layer"])
            row["reason"] = _reason_of(g)
            rows.append(row)
        return pd.DataFrame(rows)

    def _category_rows(self, tally: torch.Tensor, base: dict[str, Any], reason: str | None = None
                       ) -> list[dict[str, Any]]:
        """``shape_bias_category`` rows from a per-class tally (`R.shape_bias_category_tally`): one per shape
        class with images, named by the dataset's class name; NaN with ``reason`` where the readout is at chance."""
        names = self.classes_of("data") or []
        rows = []
        for k, row in enumerate(tally.cpu()):
            if not int(row[0]):
                continue
            c = R.shape_bias_of_tally(row, self.match_denominator)
            counts = {"n": int(c["n_shape"] + c["n_texture"]), "n_shape": c["n_shape"],
                      "n_texture": c["n_texture"], "n_other": c["n_other"]}
            value = ({"value": math.nan, "reason": reason} if reason
                     else {"value": float(c["shape_bias"]), **shape_bias_interval(c)})
            rows.append({"metric": "shape_bias_category", **base, "category": names[k] if k < len(names) else str(k),
                         **counts, **value})
        return rows

    def finalize(self) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        if "cue" in self.heads:
            c = R.shape_bias_of_tally(self.heads["cue"], self.match_denominator)
            rows += [{"metric": k, "readout": "head", "value": float(v),
                      **(shape_bias_interval(c) if k == "shape_bias" else {})} for k, v in c.items()]
            if "cue_category" in self.heads:
                rows += self._category_rows(self.heads["cue_category"], {"readout": "head"})
        cue, train = self.tables.get("cue"), self.tables.get("train")
        if self.use_probe and cue is not None and train is not None and len(train) > 1 and len(cue):
            shape = cue.column("labels")
            texture = torch.cat(self.cue_texture) if self.cue_texture else torch.empty(0, dtype=torch.long)
            ytr, test = train.column("labels"), self._split(train)
            if not self._check_split(ytr, test):  # no held-out clean accuracy: fit on every training image
                test = torch.zeros_like(test)
            fit = ~test
            c = self._num_classes(ytr, shape, texture)
            sizes = {"n_train": int(fit.sum()), "n_test": int(test.sum())}
            for j, layer in enumerate(self.layers):
                xtr = train.layer(j)
                (d_cue, d_test), cols = self._probe(xtr[fit], ytr[fit], [cue.layer(j), xtr[test]], c)
                counts = R.shape_bias_counts(d_cue, shape, texture, self.match_denominator)
                acc, n_test = R.accuracy(d_test, ytr[test]), int(test.sum())
                chance = S.majority_rate(ytr[fit], ytr[test])
                reason = chance_reason(acc, n_test, chance)
                rows += [{"metric": k, "layer": layer, "readout": "probe", **sizes, **cols,
                          **({"value": math.nan, "reason": reason} if reason and k == "shape_bias"
                             else {"value": float(v), **(shape_bias_interval(counts) if k == "shape_bias" else {})})}
                         for k, v in counts.items()]
                rows += self._category_rows(R.shape_bias_category_tally(d_cue, shape, texture, c),
                                            {"layer": layer, "readout": "probe", **sizes, **cols}, reason)
                rows.append({"metric": "clean_accuracy", "layer": layer, "readout": "probe", "value": acc,
                             **sizes, **cols, **_clean_columns(acc, n_test, chance)})
        df = _with_reason(self.tidy(rows))
        df["token_view"] = df["readout"].map({"probe": self.token_view, "head": None})
        df["dataset"] = self.datasets.get("data")
        df["match_denominator"] = self.match_denominator
        return df
