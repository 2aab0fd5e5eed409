"""Which layer knows what (math in `vitscope.metrics.semantics`): per layer and view, a bounded on-disk
store of pooled features (one float16 vector per image, object or part), then k-NN, a linear probe and
k-means, each against its random-chance baseline (Gaussian features of the same shape, Walmer et al. 2023
B.3) and with a binomial interval; across models, the agreement of the probes' predictions (Shekhar et al.
2022 §2.4)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.pooled import PooledTable
from vitscope.capture.views import region_pool, region_weights, token_view
from vitscope.errors import ResultWarning
from vitscope.metrics import semantics as S
from vitscope.threads import few_threads, single_threaded

REGION_VIEWS = ("object", "part")  # rows per foreground object / per part: mask-weighted means of patch tokens


@register_analysis
class Semantics(Analysis):
    """k-NN (DINO voting, k in {10, 20, 100, 200}; top-1, and top-5 when there are more than 5 classes), a
    linear probe (L-BFGS, standardised features) and k-means purity/NMI/ARI (k = number of classes) per layer
    and view [Shekhar et al. 2022 §2.3; Walmer et al. 2023 §5.2, §6.1], with chance rows (``*_chance``)
    computed on Gaussian features of the same shape.

    Accuracies and purity carry a 95 % Wilson (binomial) interval over the images scored (``value_lo``,
    ``value_hi``) and its standard error (``stderr``); accuracies also the majority-class rate of the test
    images (``chance``: answering the k most frequent training classes), the level they must beat.

    k-NN runs on every view; probes and k-means on the views the sources use them on (``probe``: CLS and the
    mean of the spatial tokens; ``kmeans``: those and the object and part views), as lists of views, or
    True / False for all / none of ``views``. They are most of the analysis's cost.

    Views: image level 'cls', 'gap', 'gap_spatial' (label = the image's class); 'object' (the mean of the
    patch tokens weighted by the foreground mask, label = the image's class) and 'part' (one row per part
    of an image, label = the part id), from the batches' masks and part maps where the dataset has them.
    The test split is the dataset's own (``batch.is_test``), else the images whose id is a multiple of
    ``test_every``. At most ``max_images`` images are kept, in a float16 store on disk
    (`vitscope.analyses.pooled`)."""

    name = "semantics"
    needs = frozenset({"labels"})
    # 2: probes and k-means on the sources' views by default (1: on every view); 3: intervals, chance, no top-5
    # with 5 classes or fewer
    state_version = 3
    description = "k-NN, linear probe and k-means per layer and view (image, object, part), with chance baselines"

    def __init__(self, vm: Any, layers: Any = None,
                 views: str | Sequence[str] = ("cls", "gap", "gap_spatial", "object", "part"),
                 max_images: int = 5000, test_every: int = 5, ks: Sequence[int] = (10, 20, 100, 200),
                 kmeans: bool | str | Sequence[str] = ("cls", "gap_spatial", "object", "part"),
                 probe: bool | str | Sequence[str] = ("cls", "gap_spatial"),
                 seed: int = 0, min_region_tokens: float = 0.5, kmeans_n_init: int = 1):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        views = [views] if isinstance(views, str) else list(views)
        self.views = [v for v in views if v != "cls" or self.has_cls_token]
        self.max_images, self.test_every, self.ks = int(max_images), int(test_every), tuple(int(k) for k in ks)
        self.kmeans_views, self.probe_views = _view_subset(kmeans, self.views), _view_subset(probe, self.views)
        self.seed = int(seed)
        self.min_region_tokens, self.kmeans_n_init = float(min_region_tokens), int(kmeans_n_init)
        self.tables = {v: PooledTable(len(self.layers)) for v in self.views}
        self.unlabelled = 0

    def required_taps(self) -> list[str]:
        return [f"block{i}.out" for i in self.layers]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        take = min(self.max_images - self.n_images, len(batch))
        if take <= 0:
            return
        ids = batch.index[:take].cpu().long()
        is_test = batch.is_test[:take].cpu() if batch.is_test is not None else ids % self.test_every == 0
        labels = batch.labels[:take].cpu().long() if batch.labels is not None else None
        if labels is None:
            self.unlabelled += take
        x = [feats[f"block{i}.out"][:take] for i in self.layers]
        for v in self.views:
            if v in REGION_VIEWS:
                maps = batch.masks if v == "object" else batch.parts
                if maps is None or (v == "object" and labels is None):
                    continue
                weights, region_ids = region_weights(maps[:take], self.grid_of(batch), self.min_region_tokens)
                pooled = [region_pool(token_view(f, "spatial", self.num_prefix_tokens), weights, region_ids)
                          for f in x]
                rows, regions = pooled[0][1], pooled[0][2]
                self.tables[v].append([p[0] for p in pooled], ids[rows],
                                      labels[rows] if v == "object" else regions, is_test[rows])
            elif labels is not None:
                self.tables[v].append([token_view(f, v, self.num_prefix_tokens, self.has_cls_token) for f in x],
                                      ids, labels, is_test)
        self.n_images += take

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Semantics) and other.layers == self.layers and other.views == self.views
        for v in self.views:
            self.tables[v].extend(other.tables[v])
        self.n_images += other.n_images
        self.unlabelled += other.unlabelled

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "views": self.views,
                "tables": {v: t.state_dict() for v, t in self.tables.items()},
                "n_images": self.n_images, "unlabelled": self.unlabelled}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.views = list(state["layers"]), list(state["views"])
        self.tables = {v: PooledTable.from_state(t) for v, t in state["tables"].items()}
        self.n_images, self.unlabelled = int(state["n_images"]), int(state["unlabelled"])

    def _scores(self, x: torch.Tensor, y: torch.Tensor, test: torch.Tensor, probe: float | None, kmeans: bool
                ) -> dict[str, dict[str, float]]:
        """{metric: {"value", and where it applies "value_lo", "value_hi", "stderr", "chance"}}."""
        out: dict[str, dict[str, float]] = {}
        c = int(y.max()) + 1
        n_classes = len(torch.unique(y))
        n_test = int(test.sum())

        def scored(acc: float, n: int, chance: float | None = None) -> dict[str, float]:
            lo, hi, se = S.binomial_interval(acc, n)
            row = {"value": acc, "value_lo": lo, "value_hi": hi, "stderr": se}
            return row if chance is None else {**row, "chance": chance}

        if test.any() and (~test).any():
            top1_chance = S.majority_rate(y[~test], y[test], 1)
            top5_chance = S.majority_rate(y[~test], y[test], 5)
            for k, (t1, t5) in S.knn_classify(x[~test], y[~test], x[test], y[test], ks=self.ks, num_classes=c).items():
                out[f"knn{k}_top1"] = scored(t1, n_test, top1_chance)
                if n_classes > 5:  # top-5 of 5 classes or fewer is 1 by construction
                    out[f"knn{k}_top5"] = scored(t5, n_test, top5_chance)
            if probe is not None:
                out["probe_top1"] = scored(probe, n_test, top1_chance)
        k = n_classes
        if kmeans and len(x) > k > 1:
            scores = S.kmeans_scores(x.float().numpy(), y.numpy(), k=k, seed=self.seed, n_init=self.kmeans_n_init)
            for m, v in scores.items():
                out[f"kmeans_{m}"] = scored(v, len(x)) if m == "purity" else {"value": v}
        return out

    def _probes(self, feats: list[torch.Tensor], y: torch.Tensor, test: torch.Tensor, view: str
                ) -> list[float | None]:
        """Probe top-1 of each (n, D) feature set (all layers in one call)."""
        if view not in self.probe_views or not test.any() or not (~test).any():
            return [None] * len(feats)
        return S.linear_probes([f[~test] for f in feats], y[~test], [f[test] for f in feats], y[test],
                               num_classes=int(y.max()) + 1)[0]

    def finalize(self) -> pd.DataFrame:
        largest = max((len(t) * t.layer(0).shape[-1] for t in self.tables.values() if len(t)), default=0)
        with few_threads(largest):  # probes and k-means of a few hundred rows: one thread, none spinning
            return self._finalize()

    def _finalize(self) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        n_test = {}
        gen = torch.Generator().manual_seed(self.seed)
        for v in self.views:
            t = self.tables[v]
            if len(t) < 2:
                continue
            y, test = t.column("labels"), t.column("is_test")
            n_test[v] = int(test.sum())
            one_class = self._warn_if_meaningless(v, y, test)
            noise = torch.randn(t.layer(0).shape, generator=gen)  # same shape as one layer's features
            feats = [t.layer(j) for j in range(len(self.layers))] + [noise]  # float16 views of the store + noise
            with warnings.catch_warnings():
                if one_class:  # said once above, for every score
                    warnings.filterwarnings("ignore", category=ResultWarning, message="linear probe")
                probes = self._probes(feats, y, test, v)
            for layer, x, probe in zip([*self.layers, None], feats, probes, strict=True):
                suffix = "" if layer is not None else "_chance"
                for metric, val in self._scores(x.float(), y, test, probe, v in self.kmeans_views).items():
                    rows.append({"metric": metric + suffix, "layer": layer, "token_view": v, **val})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        df["n_test"] = df["token_view"].map(n_test)
        return df

    def _warn_if_meaningless(self, view: str, y: torch.Tensor, test: torch.Tensor) -> bool:
        """One ResultWarning per view whose scores cannot mean much; True when it has a single class."""
        n_classes, n_test = len(torch.unique(y)), int(test.sum())
        where = f"semantics: model {self.model_name!r}, view {view!r}"
        if n_classes < 2:
            warnings.warn(f"{where}: every row has the same label, so k-NN, the probe and k-means score 1.0 "
                          "whatever the features (1.0 is chance here); use a dataset with at least two classes",
                          ResultWarning, stacklevel=3)
            return True
        if n_test < n_classes:
            warnings.warn(f"{where}: {n_test} test rows for {n_classes} classes, so some classes are never tested "
                          f"and accuracies move in steps of {1 / max(n_test, 1):.2g}; use more images (or a smaller "
                          "test_every)", ResultWarning, stacklevel=3)
        return False

    def probe_logits(self, view: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(test scores of the probe: log-probabilities, test labels, test ids) at one layer and image-level view."""
        t = self.tables[view]
        y, ids, test = t.column("labels"), t.column("ids"), t.column("is_test")
        x = t.layer(self.layers.index(layer)).float()
        _, logits = S.linear_probe(x[~test], y[~test], x[test], y[test], num_classes=int(y.max()) + 1)
        return logits, y[test], ids[test]

    @classmethod
    @single_threaded
    def cross(cls, analyses: list[Analysis]) -> pd.DataFrame | None:
        """Agreement of the last-layer probes of every pair of models on the same test images (each model's
        probe is fitted once, not once per pair)."""
        frames = []
        fitted: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def logits(m: Semantics, view: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if (id(m), view) not in fitted:
                fitted[(id(m), view)] = m.probe_logits(view, m.layers[-1])
            return fitted[(id(m), view)]

        for i, a in enumerate(analyses):
            for b in analyses[i + 1:]:
                assert isinstance(a, Semantics) and isinstance(b, Semantics)
                views = [v for v in a.probe_views if v in b.probe_views and v != "part" and len(a.tables[v]) > 1
                         and len(b.tables[v]) > 1]
                if not views:
                    continue
                la, ya, ia = logits(a, views[0])
                lb, _, ib = logits(b, views[0])
                if not torch.equal(ia, ib):
                    continue
                agree = S.prediction_agreement(la, lb, ya)
                rows = [{"metric": k, "layer": a.layers[-1], "layer_b": b.layers[-1], "token_view": views[0],
                         "model_b": b.model_name, "value": v} for k, v in agree.items()]
                frames.append(a.tidy(rows))
        return pd.concat(frames, ignore_index=True) if frames else None


def _view_subset(which: Any, views: list[str]) -> list[str]:
    """The views a per-view step runs on: True = all of ``views``, False/None = none, else those listed."""
    if which is True or which is False or which is None:
        return list(views) if which else []
    which = [which] if isinstance(which, str) else list(which)
    return [v for v in views if v in which]
