"""Which layer knows what (math in `vitscope.metrics.semantics`): per layer and view, a bounded on-disk
store of pooled features (one float16 vector per image, object or part), then k-NN, a linear probe and
k-means, each against its random-chance baseline (Gaussian features of the same shape, Walmer et al. 2023
B.3) and with a binomial interval; across models, the agreement of the probes' predictions (Shekhar et al.
2022 §2.4)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis, views_with_cls
from vitscope.analyses.pooled import PooledTable
from vitscope.analyses.splits import ProbeFolds, TestEvery, check_test_every, split_warnings, stratified_test
from vitscope.bounds import Count, Fraction, Iterations, Positive, Range, Restarts
from vitscope.capture.views import region_weights, token_view
from vitscope.errors import ConfigError, ResultWarning, VitscopeError
from vitscope.host import to_host
from vitscope.metrics import semantics as S
from vitscope.threads import few_threads, single_threaded

REGION_VIEWS = ("object", "part")  # rows per foreground object / per part: mask-weighted means of patch tokens


@register_analysis
class Semantics(Analysis):
    """k-NN (DINO voting, k in {10, 20, 100, 200}; top-1, and top-5 when there are more than 5 classes), a
    linear probe (L-BFGS or SGD, standardised features by default) and k-means purity/NMI/ARI (k = number of
    classes) per layer and view [Shekhar et al. 2022 §2.3; Walmer et al. 2023 §5.2, §6.1], with chance rows
    (``*_chance``) computed on Gaussian features of the same shape.

    Accuracies and purity carry a 95 % Wilson (binomial) interval over the images scored (``value_lo``,
    ``value_hi``) and its standard error (``stderr``); accuracies also the majority-class rate of the test
    images (``chance``: answering the k most frequent training classes), the level they must beat.

    k-NN runs on every view; probes and k-means on the views the sources use them on (``probe``: CLS and the
    mean of the spatial tokens; ``kmeans``: those and the object and part views), as lists of views, or
    True / False for all / none of ``views``. They are most of the analysis's cost.

    Images labelled -1 (no class: a COCO image without annotations) give no image-level or object rows.
    Views: image level 'cls', 'gap', 'gap_spatial' (label = the image's class); 'object' (the mean of the
    patch tokens weighted by the foreground mask, label = the image's class) and 'part' (one row per part
    of an image, label = the part id), from the batches' masks and part maps where the dataset has them.
    Where a dataset gives instances (``batch.objects`` with ``batch.extra['instance_labels']``; COCO for the
    object view, PartImageNet for the part view, as ``extra['instances_of']`` says), the view has one row per
    annotated instance instead, labelled with its category (COCO) or part (PartImageNet): Walmer et al. 2023
    §5.3 (Fig. 8) pool each annotation's mask, not each image's or each part category's. Regions covering less
    than ``min_region_tokens`` tokens' worth of the grid are left out (the authors drop only empty ones).

    ``kmeans_k``: the number of k-means clusters. 'classes' (default: the number of distinct labels of the
    view's rows, the usual choice and what earlier versions did, so results stay comparable), an integer for
    every view (Walmer et al. use 80 on COCO objects and on PartImageNet parts), or a mapping {view: k} (views
    left out use 'classes'). A k not below the view's row count skips its k-means with a warning. k-means rows
    record the k used in ``k``.

    The test split is the dataset's own (``batch.is_test``), else stratified (`vitscope.analyses.splits`): within
    each class, in id order, every ``test_every``-th image (from the first on) is a test image and a class of
    one image stays in training, so every class with two images or more is in both parts; decided per image
    from the image-level rows, so all views (and the part rows of an image) share it. A class without a
    training image or with fewer than two test images is a `ResultWarning` naming it; a view where no class
    has both gets no k-NN or probe rows (one warning; k-means still runs), so the study goes on. Every row
    records ``n_train`` and ``n_test`` of its view.

    The probe (``probe_tune``, default on) picks its L2 weight decay from ``probe_grid`` by ``probe_folds``-fold
    cross-validation on the training split alone (folds stratified by class rank, deterministic; one
    warm-started path per fold from the strongest decay to the weakest, stopped at the first decay whose
    held-out accuracy is below the best so far, as the weak end costs the most iterations), refits on the whole
    training split and runs to convergence (at most ``probe_max_iter`` L-BFGS iterations, preconditioned in the
    training features' principal axes; stopping short of convergence warns); ``probe_top1`` rows record the
    ``probe_weight_decay`` chosen and the ``probe_iterations`` of the final fit. ``probe_tune: false`` is the
    fixed decay ``probe_weight_decay`` for a fixed budget of ``probe_max_iter`` iterations, without a warning.

    ``standardize`` (default true): the probe fits on features normalised by the training rows' mean and std,
    MAE's affine-free BatchNorm before the linear layer, which Walmer et al. 2023 (Table 6, rows 'CLS+BN',
    'Spat.+BN') found better for every model and view, and which makes one weight-decay grid and learning rate
    fit every layer's scale; false fits the raw features, their rows 'CLS' and 'Spat.' ("no BN"). Only the
    probe is affected: the k-NN normalises every row to unit length (DINO's cosine) and k-means clusters the
    raw features whatever this says.

    ``probe_solver``: 'lbfgs' (default: the exact optimum of the regularised problem above, cheap at the
    ``max_images`` stored rows) or 'sgd', a linear softmax layer trained as the sources train theirs
    (`vitscope.metrics.semantics.fit_probe_sgd`): ``sgd_epochs`` passes over every training row of the store
    in shuffled minibatches of ``sgd_batch`` rows read one at a time from the file onto the model's device
    (memory bounded by a minibatch, so ``max_images`` can be the whole dataset: the papers' full-data probe;
    set ``kmeans: false`` then, k-means of every row is the cost), momentum ``sgd_momentum``, learning rate
    ``sgd_lr`` decayed by ``sgd_schedule`` ('cosine' per step as DINO and MAE, or 'step': x0.1 at 60 % and
    80 % of the epochs), L2 ``sgd_weight_decay`` on the weights (0 as DINO and MAE), initial weights and
    shuffles drawn from ``seed``. The default lr 0.1 suits standardised features; raw ones may need less
    (Walmer et al. reduced it for BEiT's CLS). Its ``probe_top1`` rows record ``probe_weight_decay`` =
    ``sgd_weight_decay`` and ``probe_iterations`` = the minibatch steps; every probe row records its
    ``solver``; a diverging loss warns.
    At most ``max_images`` images are kept, in a float16 store on disk (`vitscope.analyses.pooled`).

    Against the sources: the k-NN is DINO's (cosine of L2-normalised features, weights exp(sim / T), T =
    ``temperature`` = 0.07, 20-NN reported; the rows carry ``k`` and ``temperature``). The probe deviates: DINO,
    DINOv2 and MAE train a linear layer with SGD on the full training set, without or with light augmentation,
    and choose the learning rate (DINOv2 also the weight decay) on held-out data; here by default it is
    multinomial logistic regression (L-BFGS) on the frozen float16 features, standardised as MAE's affine-free
    BatchNorm does, with the weight decay chosen by cross-validation on the training split (``probe_solver:
    sgd`` is the sources' SGD, with a fixed learning rate, not one chosen on held-out data). Both are scored on a
    stratified 1/``test_every`` of the selected images unless the dataset has its own split, not on an official
    validation set."""

    name = "semantics"
    needs = frozenset({"labels"})
    # 2: probes and k-means on the sources' views by default (1: on every view); 3: intervals, chance, no top-5
    # with 5 classes or fewer; 4: stratified split decided in finalize (own split flagged), tuned probe, n_train
    # 5: a k-NN top-5 counts only classes that got votes; 6: instance rows for the region views, kmeans_k
    state_version = 6
    description = "k-NN, linear probe and k-means per layer and view (image, object, part), with chance baselines"

    def __init__(self, vm: Any, layers: Any = None,
                 views: str | Sequence[str] = ("cls", "gap", "gap_spatial", "object", "part"),
                 max_images: Count = 5000, test_every: TestEvery = 5, ks: Sequence[Count] = (10, 20, 100, 200),
                 temperature: Positive = 0.07,
                 kmeans: bool | str | Sequence[str] = ("cls", "gap_spatial", "object", "part"),
                 probe: bool | str | Sequence[str] = ("cls", "gap_spatial"),
                 seed: int = 0, min_region_tokens: Fraction = 0.5, kmeans_n_init: Restarts = 1,
                 kmeans_k: Literal["classes"] | Count | Mapping[str, Count] = "classes", probe_tune: bool = True,
                 probe_grid: Sequence[Positive] = S.PROBE_GRID, probe_folds: ProbeFolds = 2,
                 probe_max_iter: Iterations = 1000, probe_weight_decay: Positive = 1e-4, standardize: bool = True,
                 probe_solver: Literal["lbfgs", "sgd"] = "lbfgs", sgd_epochs: Iterations = 10, sgd_batch: Count = 256,
                 sgd_lr: Positive = 0.1, sgd_momentum: Fraction = 0.9,
                 sgd_weight_decay: Annotated[float, Range(0)] = 0.0,
                 sgd_schedule: Literal["cosine", "step"] = "cosine"):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        self.views = views_with_cls(self, views)
        self.max_images, self.ks = int(max_images), tuple(int(k) for k in ks)
        self.temperature = float(temperature)
        if not self.temperature > 0:
            raise ConfigError(f"semantics: temperature must be positive; got {temperature}")
        self.test_every = check_test_every(test_every, self.name)
        self.probe_kw = S.probe_options(self.name, probe_tune, probe_grid, probe_folds, probe_max_iter,
                                        probe_weight_decay, standardize)
        if probe_solver not in ("lbfgs", "sgd"):
            raise ConfigError(f"semantics: probe_solver {probe_solver!r} does not exist; choose lbfgs or sgd")
        self.probe_solver = probe_solver
        self.sgd_kw = {**S.sgd_options(self.name, sgd_epochs, sgd_batch, sgd_lr, sgd_momentum, sgd_weight_decay,
                                       sgd_schedule), "standardize": self.probe_kw["standardize"]}
        self.kmeans_views, self.probe_views = _view_subset(kmeans, self.views), _view_subset(probe, self.views)
        self.seed = int(seed)
        self.min_region_tokens, self.kmeans_n_init = float(min_region_tokens), int(kmeans_n_init)
        self.kmeans_k = _check_kmeans_k(kmeans_k)
        self.tables = {v: PooledTable(len(self.layers)) for v in self.views}
        self.unlabelled = 0
        self.own_split = False  # the dataset has its own split (batch.is_test), stored in the tables' is_test
        self.class_names: list[str] | None = None

    def state_bytes(self, n_images: int) -> int:
        """The pooled features: one float16 vector per image (at least; objects and parts add rows), layer and
        view."""
        return 2 * min(n_images, self.max_images) * len(self.layers) * len(self.views) * self.embed_dim

    def superlinear(self, n_images: int) -> list[str]:
        n = min(n_images, self.max_images)
        test = n // self.test_every
        grid = f"{len(self.layers)} layers x {len(self.views)} views"
        out = [f"k-NN {test} x {n - test} similarities per layer and view ({grid})"]
        if self.kmeans_views:
            out.append(f"k-means of {n} rows per layer and view ({len(self.layers)} x {len(self.kmeans_views)})")
        return out

    def required_taps(self) -> list[str]:
        return [f"block{i}.out" for i in self.layers]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        """Pool every view of every layer on the features' device, then move all of it (and whatever of the
        batch's ids, labels and split flags is not on the host yet) in one transfer (`vitscope.host.to_host`)."""
        take = min(self.max_images - self.n_images, len(batch))
        if take <= 0:
            return
        ids = batch.index[:take].long()
        if batch.is_test is not None:
            self.own_split, is_test = True, batch.is_test[:take].bool()
        else:  # decided in finalize, when every row is known
            is_test = torch.zeros(take, dtype=torch.bool)
        if self.class_names is None and batch.extra.get("class_names") is not None:
            self.class_names = [str(c) for c in batch.extra["class_names"]]
        labels = batch.labels[:take].long() if batch.labels is not None else None
        if labels is None:
            self.unlabelled += take
        x = [feats[f"block{i}.out"][:take] for i in self.layers]
        pooled: dict[str, list[torch.Tensor]] = {}  # view -> per layer (rows, D) float16, on the device
        regions: dict[str, torch.Tensor] = {}  # region view -> (B, K) region ids on the host, 0 = padding
        instances: dict[str, torch.Tensor | None] = {}  # region view -> (B, n + 1) label of each instance id
        for v in self.views:
            if v in REGION_VIEWS:
                instances[v] = _instance_labels(batch, v, take)
                maps = (batch.objects if instances[v] is not None else batch.masks if v == "object"
                        else batch.parts)
                if maps is None or (v == "object" and labels is None and instances[v] is None):
                    continue
                weights, regions[v] = region_weights(maps[:take], self.grid_of(batch), self.min_region_tokens)
                pooled[v] = _region_rows(x, weights, self.num_prefix_tokens)
            elif labels is not None:
                pooled[v] = [token_view(f, v, self.num_prefix_tokens, self.has_cls_token).to(torch.float16)
                             for f in x]
        if pooled:
            *flat, ids, labels, is_test = to_host(*(f for v in pooled for f in pooled[v]), ids, labels, is_test)
            L = len(self.layers)
            for n, v in enumerate(pooled):
                rows = flat[n * L:(n + 1) * L]
                if v in regions:
                    valid = regions[v].reshape(-1) > 0  # (B K,): the regions kept, images in order
                    image = torch.arange(take)[:, None].expand_as(regions[v]).reshape(-1)[valid]
                    region = regions[v].reshape(-1)[valid]
                    inst = instances.get(v)
                    region_labels = (inst[image, region] if inst is not None
                                     else labels[image] if v == "object" else region)
                    self.tables[v].append_host([r[valid] for r in rows], ids[image], region_labels, is_test[image])
                else:
                    self.tables[v].append_host(rows, ids, labels, is_test)
        self.n_images += take

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Semantics) and other.layers == self.layers and other.views == self.views
        for v in self.views:
            self.tables[v].extend(other.tables[v])
        self.n_images += other.n_images
        self.unlabelled += other.unlabelled
        self.own_split = self.own_split or other.own_split
        self.class_names = self.class_names or other.class_names

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "views": self.views,
                "tables": {v: t.state_dict() for v, t in self.tables.items()},
                "n_images": self.n_images, "unlabelled": self.unlabelled, "own_split": self.own_split,
                "class_names": list(self.class_names) if self.class_names is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.views = list(state["layers"]), list(state["views"])
        self.tables = {v: PooledTable.from_state(t) for v, t in state["tables"].items()}
        self.n_images, self.unlabelled = int(state["n_images"]), int(state["unlabelled"])
        self.own_split = bool(state.get("own_split", False))
        names = state.get("class_names")
        self.class_names = [str(c) for c in names] if names is not None else None

    def _splits(self) -> dict[str, torch.Tensor]:
        """{view: (rows,) bool test flags}: the dataset's own split, else `stratified_test` of the images (their
        image-level (id, label) pairs, shared by every view; a part table without image-level rows is split by
        its own rows)."""
        if self.own_split:
            return {v: t.column("is_test") for v, t in self.tables.items()}
        image = [t for v, t in self.tables.items() if v != "part" and len(t)]
        test_ids = None
        if image:
            ids = torch.cat([t.column("ids") for t in image])
            labels = torch.cat([t.column("labels") for t in image])
            ids, first = _unique_first(ids)
            labels = labels[first]
            test_ids = ids[stratified_test(ids, labels, self.test_every)]
        out = {}
        for v, t in self.tables.items():
            ids = t.column("ids")
            out[v] = (torch.isin(ids, test_ids) if test_ids is not None
                      else stratified_test(ids, t.column("labels"), self.test_every))
        return out

    def _scores(self, x: torch.Tensor, y: torch.Tensor, test: torch.Tensor, probe: S.ProbeFit | None,
                kmeans_k: int | None, scorable: bool) -> dict[str, dict[str, float]]:
        """{metric: {"value", and where it applies "value_lo", "value_hi", "stderr", "chance", the probe's
        settings}}; k-means with ``kmeans_k`` clusters (None: no k-means)."""
        out: dict[str, dict[str, float]] = {}
        c = int(y.max()) + 1
        n_classes = len(torch.unique(y))
        n_test = int(test.sum())

        def scored(acc: float, n: int, chance: float | None = None) -> dict[str, float]:
            lo, hi, se = S.binomial_interval(acc, n)
            row = {"value": acc, "value_lo": lo, "value_hi": hi, "stderr": se}
            return row if chance is None else {**row, "chance": chance}

        if scorable:
            top1_chance = S.majority_rate(y[~test], y[test], 1)
            top5_chance = S.majority_rate(y[~test], y[test], 5)
            for k, (t1, t5) in S.knn_classify(_take(x, ~test), y[~test], _take(x, test), y[test], ks=self.ks,
                                               num_classes=c, temperature=self.temperature,
                                               device=x.device).items():
                knn = {"k": k, "temperature": self.temperature}
                out[f"knn{k}_top1"] = {**scored(t1, n_test, top1_chance), **knn}
                if n_classes > 5:  # top-5 of 5 classes or fewer is 1 by construction
                    out[f"knn{k}_top5"] = {**scored(t5, n_test, top5_chance), **knn}
            if probe is not None:
                out["probe_top1"] = {**scored(probe.accuracy, n_test, top1_chance),
                                     "probe_weight_decay": probe.weight_decay, "probe_iterations": probe.iterations,
                                     "solver": probe.solver}
        k = kmeans_k
        if k is not None and len(x) > k > 1:
            scores = S.kmeans_scores(x.float(), y.numpy(), k=k, seed=self.seed, n_init=self.kmeans_n_init)
            for m, v in scores.items():
                out[f"kmeans_{m}"] = {**(scored(v, len(x)) if m == "purity" else {"value": v}), "k": k}
        return out

    def _probes(self, feats: list[torch.Tensor], y: torch.Tensor, test: torch.Tensor, view: str, where: str,
                stores: list[torch.Tensor] | None = None) -> list[S.ProbeFit | None]:
        """The probe of each (n, D) feature set (all layers in one call); the SGD probe streams minibatches from
        ``stores`` (the host stores behind ``feats``: on a GPU, ``feats`` are copies there)."""
        if view not in self.probe_views:
            return [None] * len(feats)
        if self.probe_solver == "sgd":
            return [self._sgd_probe(x, y, test, where) for x in (stores if stores is not None else feats)]
        return S.probe_fits([_take(f, ~test) for f in feats], y[~test], [_take(f, test) for f in feats], y[test],
                            num_classes=int(y.max()) + 1, where=where, device=feats[0].device, **self.probe_kw)

    def finalize(self) -> pd.DataFrame:
        self.tables = {v: t.labelled() for v, t in self.tables.items()}  # rows labelled -1 have no class
        largest = max((len(t) * t.layer(0).shape[-1] for t in self.tables.values() if len(t)), default=0)
        with few_threads(largest):  # probes and k-means of a few hundred rows: one thread, none spinning
            return self._finalize()

    def _finalize(self) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        sizes: dict[str, tuple[int, int]] = {}
        gen = torch.Generator().manual_seed(self.seed)
        splits = self._splits()
        warned: list[tuple[torch.Tensor, torch.Tensor]] = []
        for v in self.views:
            t = self.tables[v]
            if len(t) < 2:
                continue
            y, test = t.column("labels"), splits[v]
            sizes[v] = (int((~test).sum()), int(test.sum()))
            one_class = self._warn_if_meaningless(v, y)
            where = f"semantics: model {self.model_name!r}, view {v!r}"
            seen = any(torch.equal(y, a) and torch.equal(test, b) for a, b in warned)  # said for a view before
            if not seen:
                warned.append((y, test))
                same = [w for w in self.views if w != v and len(self.tables[w]) == len(t)
                        and torch.equal(self.tables[w].column("labels"), y) and torch.equal(splits[w], test)]
                if same:
                    where = f"semantics: model {self.model_name!r}, views {', '.join(repr(w) for w in [v, *same])}"
            with warnings.catch_warnings():
                if seen:
                    warnings.simplefilter("ignore", ResultWarning)
                scorable = not one_class and split_warnings(
                    where, y, test, self.class_names if v != "part" else None)
            noise = torch.randn(t.layer(0).shape, generator=gen)  # same shape as one layer's features
            # float16 views of the store + noise (on a GPU: copied there in float32, a chunk of rows at a time)
            feats = [store_on_device(f, self.device) for f in [*(t.layer(j) for j in range(len(self.layers))), noise]]
            stores = [*(t.layer(j) for j in range(len(self.layers))), noise]
            probes = self._probes(feats, y, test, v, where, stores) if scorable else [None] * len(feats)
            kmeans_k = self._kmeans_clusters(v, y) if v in self.kmeans_views else None
            for layer, x, probe in zip([*self.layers, None], feats, probes, strict=True):
                suffix = "" if layer is not None else "_chance"
                for metric, val in self._scores(x.float(), y, test, probe, kmeans_k, scorable).items():
                    rows.append({"metric": metric + suffix, "layer": layer, "token_view": v, **val})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        df["n_train"] = df["token_view"].map({v: s[0] for v, s in sizes.items()})
        df["n_test"] = df["token_view"].map({v: s[1] for v, s in sizes.items()})
        for c in ("k", "temperature", "probe_weight_decay", "probe_iterations"):
            if c not in df.columns:
                df[c] = float("nan")
        if "solver" not in df.columns:  # the probe's solver, on probe rows
            df["solver"] = None
        return df

    def _kmeans_clusters(self, view: str, y: torch.Tensor) -> int | None:
        """The k of the view's k-means (`kmeans_k`); None, with a ResultWarning, when the view has too few rows
        for a k asked for (k-means needs more rows than clusters)."""
        k = self.kmeans_k.get(view, "classes") if isinstance(self.kmeans_k, Mapping) else self.kmeans_k
        if k == "classes":
            return len(torch.unique(y))
        if not len(y) > k:
            warnings.warn(f"semantics: model {self.model_name!r}, view {view!r}: kmeans_k = {k} needs more than "
                          f"{k} rows, the view has {len(y)}; no k-means rows", ResultWarning, stacklevel=3)
            return None
        return int(k)

    def _warn_if_meaningless(self, view: str, y: torch.Tensor) -> bool:
        """One ResultWarning for a view whose rows all have one label (True then): no score can mean anything."""
        if len(torch.unique(y)) < 2:
            warnings.warn(f"semantics: model {self.model_name!r}, view {view!r}: every row has the same label, so "
                          "k-NN, the probe and k-means score 1.0 whatever the features (1.0 is chance here); use a "
                          "dataset with at least two classes", ResultWarning, stacklevel=3)
            return True
        return False

    def _sgd_probe(self, store: torch.Tensor, y: torch.Tensor, test: torch.Tensor, where: str, warn: bool = True
                   ) -> S.ProbeFit:
        """`vitscope.metrics.semantics.fit_probe_sgd` on every training row of one host store (read a minibatch
        at a time onto `Analysis.device`), seeded by the analysis's ``seed``."""
        return S.fit_probe_sgd(store, y, test, seed=self.seed, num_classes=int(y.max()) + 1, where=where, warn=warn,
                               device=self.device, **self.sgd_kw)

    def probe_logits(self, view: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(test scores of the probe: log-probabilities, test labels, test ids) at one layer and image-level view."""
        t = self.tables[view]
        y, ids, test = t.column("labels"), t.column("ids"), self._splits()[view]
        if self.probe_solver == "sgd":
            fit = self._sgd_probe(t.layer(self.layers.index(layer)), y, test, f"semantics: model {self.model_name!r}",
                                  warn=False)
            return fit.scores, y[test], ids[test]
        x = store_on_device(t.layer(self.layers.index(layer)), self.device).float()
        fit = S.fit_probe(_take(x, ~test), y[~test], _take(x, test), y[test], num_classes=int(y.max()) + 1,
                          warn=False, device=x.device, **self.probe_kw)
        return fit.scores, y[test], ids[test]

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


def _region_rows(x: list[torch.Tensor], weights: torch.Tensor, prefix: int) -> list[torch.Tensor]:
    """Per layer the mask-weighted means of the patch tokens of every region slot, (B K, D) float16 on the
    features' device (`vitscope.capture.views.region_pool` before it drops the padding slots, which the host
    drops after the transfer: their number is not known on the device)."""
    out = []
    for f in x:
        spatial = token_view(f, "spatial", prefix)
        if weights.shape[0] != spatial.shape[0] or weights.shape[-1] != spatial.shape[1]:
            raise VitscopeError(f"region weights of shape {tuple(weights.shape)} do not fit patch tokens of shape "
                                f"{tuple(spatial.shape)}")
        w = weights.to(device=spatial.device, dtype=spatial.dtype)
        out.append(torch.bmm(w, spatial).reshape(-1, spatial.shape[-1]).to(torch.float16))
    return out


def store_on_device(x: torch.Tensor, device: torch.device, chunk: int = 4096) -> torch.Tensor:
    """Rows of a host store for the finalize steps: on the CPU ``x`` itself (nothing copied); on another device a
    float32 copy there (a float16 store widened exactly), moved ``chunk`` rows at a time so no full-size float32
    copy is made on the host."""
    if device.type == "cpu":
        return x
    out = torch.empty(x.shape, dtype=torch.float32, device=device)
    for s in range(0, len(x), chunk):
        out[s:s + chunk] = x[s:s + chunk].to(device)
    return out


def _take(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` where the host bool ``mask`` is True, wherever ``x`` lives."""
    return x[mask.to(x.device)]


def _check_kmeans_k(k: Any) -> str | int | dict[str, int]:
    """``kmeans_k`` checked: 'classes', an integer >= 2, or {view: such an integer} (one ConfigError otherwise)."""
    def one(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ConfigError(f"semantics: {what} must be 'classes' or an integer of at least 2; got {value!r}")
        return int(value)

    if isinstance(k, str) and k == "classes":
        return k
    if isinstance(k, Mapping):
        return {str(v): one(n, f"kmeans_k[{v!r}]") for v, n in k.items()}
    return one(k, "kmeans_k")


def _instance_labels(batch: Any, view: str, take: int) -> torch.Tensor | None:
    """(take, n + 1) int64 on the host: the label of instance id i of image b at [b, i] (0 for id 0 and ids an
    image lacks), where the batch's ``objects`` are the instances of region ``view``
    (``extra['instances_of']``, labels in ``extra['instance_labels']``); else None."""
    labels = batch.extra.get("instance_labels")
    if batch.objects is None or labels is None or batch.extra.get("instances_of") != view:
        return None
    labels = [torch.as_tensor(t).long().cpu() for t in labels[:take]]
    out = torch.zeros(take, 1 + max((len(t) for t in labels), default=0), dtype=torch.long)
    for b, t in enumerate(labels):
        out[b, 1:1 + len(t)] = t
    return out


def _view_subset(which: Any, views: list[str]) -> list[str]:
    """The views a per-view step runs on: True = all of ``views``, False/None = none, else those listed."""
    if which is True or which is False or which is None:
        return list(views) if which else []
    which = [which] if isinstance(which, str) else list(which)
    return [v for v in views if v in which]


def _unique_first(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct ids, sorted; the position of each one's first row)."""
    uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    first = torch.full((len(uniq),), len(ids), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(ids)), reduce="amin")
    return uniq, first
