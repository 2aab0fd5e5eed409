"""Representation similarity beyond CKA (`similarity`): Procrustes, shape metric, CCA family, RSA, mutual
k-NN, CKNNA, ridge R² and (opt-in) subspace similarity on a seeded subset of images kept in float16
(`vitscope.analyses.similarity.subset`), within and across models, with permutation nulls and jackknife
intervals (math in `vitscope.metrics.similarity`).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.similarity.subset import subset_keys
from vitscope.bounds import Count, Fraction, Positive, Range
from vitscope.capture.taps import expand_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.errors import ConfigError, ResultWarning, VitscopeError, unknown_name
from vitscope.host import to_host
from vitscope.metrics import similarity as M
from vitscope.threads import few_threads

#: permutations of a null: 0 for none, else enough for a p-value of 0.01
Permutations = Annotated[int, Range(99, or_zero=True, why="a p-value needs 99 permutations to reach 0.01")]
#: groups of images of the jackknife: 0 for no intervals
Groups = Annotated[int, Range(2, 1000, or_zero=True, why="a jackknife needs 2 groups; beyond 1000 it takes hours")]
#: which layer pairs across models get nulls and intervals
NULL_PAIRS = ("last", "matched", "all", "none")
#: which layer pairs the measures are computed for: across models, each layer with the other model's at the same
#: relative depth ('matched'), or every pair ('cross'); 'full' adds every pair within each model
GRIDS = ("matched", "cross", "full")

#: token views whose features are one vector per image (the measures need (n, d) with d a layer's width)
POOLED_VIEWS = ("cls", "gap", "gap_spatial")


@register_analysis
class Similarity(Analysis):
    """Representation similarity beyond CKA (math in `vitscope.metrics.similarity`) between the layers of every
    pair of models (`cross`): orthogonal Procrustes distance and the angular shape
    metric at partial whitenings ``alphas`` (0 = CCA, 1 = Procrustes; Williams et al. 2021; 0 and 1 by default,
    which come from the CCA and Procrustes decompositions; each other alpha, 0.5 say, adds a decomposition per
    pair and permutation), mean CCA, SVCCA
    (Raghu et al. 2017), PWCCA (Morcos et al. 2018; weights from ``layer``), RSA of correlation-distance RDMs
    by Spearman and Kendall's tau_a (Kriegeskorte et al. 2008), mutual k-NN and CKNNA (Huh et al. 2024) and
    leave-one-out ridge R² (``layer`` predicts ``layer_b``; across models also the reverse, ``*_reverse``), and,
    when ``measures`` names it (opt-in: not in the default list), ``subspace_similarity`` (Ramasesh et al. 2021,
    "Anatomy of catastrophic forgetting", the second baseline of Merlin et al. 2023): the overlap of the two
    layers' top-``subspace_k`` principal subspaces, ``|U_aᵀ U_b|_F² / k`` in [0, 1] (1: the same subspace, 0:
    orthogonal). ``subspace_space`` says where the principal directions live: 'features' is Ramasesh et al.'s
    measure to the letter, the top-k eigenvectors of each layer's centred feature covariance over the subset (the
    right singular vectors), which Merlin et al. use for one network before and after fine-tuning; it needs the
    two layers to share their feature coordinates, so it is defined only for layers of the same width and is
    meaningful only for a network and its fine-tune (between different networks of equal width it compares
    unrelated coordinates: a value, but not a comparison of representations). 'images' takes the left singular
    vectors, the principal components' scores over the images (about k / (n_images - 1) by chance): defined
    across widths (ViT-S against ViT-B) and invariant to rotations and isotropic scaling of either layer's
    features. 'auto' (the default) is 'features' where the two layers have the same width, which gives the
    fine-tuning baseline to the letter, and 'images' otherwise, the only variant defined across widths. Each
    subspace row's ``subspace_space`` column says which ran. The feature-space directions do not depend on the
    order of the images, so shuffling B's images leaves the value unchanged: its rows get no permutation null
    (no ``null_*`` or ``p_value``), only the jackknife interval over groups of images, which does move them; the
    images variant gets both. ``subspace_k`` (10) must be below ``n_subset``; a layer of lower rank compares its
    rank's directions.
    PWCCA, ridge R² and CKNNA change with the order of the pair (`ASYMMETRIC`): within a model every ordered
    pair of layers has its own row, the others are copied to (j, i). ``measures`` picks them; distances
    (procrustes, angular_shape) are small for similar representations.

    ``grid`` says which layer pairs: 'matched' (the default), each layer of A with B's layer at the same
    relative depth, a profile through depth; 'cross', every layer of A with every layer of B; 'full', those and
    every pair of layers within each model (layer x layer, what `cka` gives cheaply for CKA). A pair costs a
    cross product and a few r x r decompositions (see Cost), so 'cross' costs 13x 'matched' for 13 taps and 'full'
    about twice 'cross'; the map of every tap by the shape metric needs 'full'.

    One pooled ``view`` ('cls', 'gap' or 'gap_spatial') of each tap. The measures need whole feature
    matrices, so the analysis keeps a seeded random subset of ``n_subset`` images in float16: the images whose
    keys (a hash of image id and ``seed``, `subset_keys`) are smallest, which makes the subset the same for
    every model, shard and resumed run. RSA uses the first ``rsa_images`` of them (its RDM and Kendall's tau
    grow with the square of the images). Rows record ``n_images`` (the images a value was computed on) and
    ``images_seen``.

    A pair of models where one is declared ``finetuned_from`` the other (each epoch of a ``checkpoints:`` list
    is its own model) has the column ``pretrained`` on its rows (the pretrained model's label; absent or empty on
    other pairs): with ``grid: matched`` and equal depths, its rows of layer i against layer i are the per-layer,
    per-epoch view of Merlin et al. and Ramasesh et al. (the report draws the subspace similarity so, a line per
    fine-tuned model; ``null_pairs: matched`` gives every layer its interval).

    Across models, for the pairs ``null_pairs`` names ('last': the two models' last taps, the pair the findings
    read, the default; 'matched': each layer of A with B's layer at the same relative depth; 'all'; 'none'),
    every score gets:

    * a permutation null: B's images shuffled ``n_permutations`` times (0, or at least 99 so that a p-value can
      reach 0.01): ``null_mean``, ``null_q05``, ``null_q95``, ``n_permutations`` and ``p_value`` = (1 + the
      shuffles scoring at least as well) / (1 + n_permutations), in the direction the measure improves. Not
      for ridge R² (`WITHOUT_NULL`): it is out of sample, so its chance level is 0 (unrelated features
      score at most 0 in expectation), and its interval against 0 is the test;
    * a 95 % interval from a delete-a-group jackknife over images: the kept images are dealt into ``n_groups``
      groups G (0 for none; by their rank in the seeded subset, so the groups are random and the same for both
      models), the measure is computed again without each group, and ``stderr`` = sqrt((G - 1) / G · sum_g
      (v_g - mean v)²); ``value_lo``, ``value_hi`` = value ± t(G - 1) · stderr, clipped to the measure's range
      (`metrics.similarity.RANGES`); ``n_groups``. Why not a bootstrap: a resample with replacement holds about
      63 % distinct images, and the CCA family, the shape metric and ridge's leave-one-out depend on the number
      of distinct images (mean CCA of independent random features is 0.44 at 380 images and 0.34 at 600), so
      the bootstrap's intervals missed their own estimate; a duplicated image is also its own nearest neighbour
      and a zero distance, which ruled it out for the neighbour and RDM measures. A jackknife replicate holds
      distinct images only, so every measure gets an interval. What it covers: the value the measure takes, on
      average, on this many images drawn from the same distribution. These measures are biased with respect to
      their infinite-sample value (CCA of unrelated features is far from 0 when n is a few times the width), so
      compare models at the same ``n_images``, as the analysis does. Coverage: `benchmarks/calibration.py`
      (docs/CALIBRATION.md).

    Cost: each tap is prepared once (an SVD; its k-NN lists, from float32 candidates ordered at float64; its RDM); a
    grid's cross products come from one matrix product per tap (`metrics.similarity.compare_grid`); each pair then
    takes one eigendecomposition of an r x r matrix with vectors (r = the layer's rank, 384 for ViT-S: CCA, and
    PWCCA both ways) and two values-only ones (Procrustes, SVCCA; one more per alpha other than 0 and 1), and ridge
    two products of n rows (both ways); the subspace similarity reads a k x k block of the cross product (images) or
    multiplies two k x width blocks of the right singular vectors (features): next to nothing, nulls and jackknife
    included. A tested pair adds ``n_permutations`` such comparisons without ridge (on
    float32 bases, `Prepared.single`) and ``n_groups`` of its two taps prepared again without a group (their
    neighbour lists filtered from long lists searched once). Memory: the subset (``n_subset`` x width x 2 bytes per
    tap); every tap's float64 basis (n x r: 6 MB at n = 2000), one n x n neighbour score at a time (16 MB) and
    products of n x 2048 (33 MB). `benchmarks/similarity.py` measures it against CKA's time on the same features
    (two ViT-S/16, 13 taps, 2,048 images, one thread; 2026-11-28, quiet: load 0.5-0.9 on 2 cores): the default (13
    matched pairs, 99 permutations and a 10-group jackknife of the last pair) 12.7-13.3 s against CKA's 1.42-1.43 s,
    9.0-9.3x (9.1-9.8x over four runs; 23.9 s, 11.9x, with 20 groups, alpha 0.5 and ridge's null; 83 s with the full
    grids): the pairs with every tap prepared 3.8-4.1 s, the permutations 5.7-5.9 s, the jackknife 1.8-2.0 s. The
    floor, mean CCA alone over the same pairs, permutations and jackknife (a cross product and one decomposition per
    pair and replicate), is 4.2-4.3 s (2.9-3.0x); each linear measure alone costs 2.9-6.2 s (PWCCA the most), the
    neighbour and RDM measures 0.8-2.2 s. ``grid: full`` (both models' 13 x 13 grids and the cross grid) took 52.5 s
    (``--grid full``, the same conditions)."""

    state_version = 5  # 2: CKNNA is asymmetric: its (j, i) rows within a model and *_reverse across models;
    # 3: jackknife intervals (stderr) instead of the bootstrap's, 99 permutations, the last pair by default;
    # 4: ``grid``, 'matched' by default (the full grids on request); 5: alphas 0 and 1 by default, 10 jackknife
    # groups, no permutation null for ridge R² (its chance level is 0)
    replaced = {"n_bootstrap": "its bootstrap intervals missed their own estimates (a resample's duplicated "
                               "images change the CCA family, the shape metric, ridge and the neighbours); "
                               "a jackknife over n_groups groups of images gives the intervals now"}

    name = "similarity"
    in_default_study = False  # its measures and nulls cost many times CKA (benchmarks/similarity.py)
    description = ("Procrustes, shape metric, CCA / SVCCA / PWCCA, RSA, mutual k-NN, CKNNA, ridge R² and (opt-in) "
                   "subspace similarity between layers, within and across models, with permutation nulls and "
                   "jackknife intervals")

    def __init__(self, vm: Any, taps: str | Sequence[str] = "block*.out", view: str = "gap",
                 measures: Sequence[str] = tuple(M.DEFAULT_MEASURES), n_subset: Annotated[int, Range(5)] = 2000,
                 seed: int = 0, alphas: Sequence[Fraction] = (0.0, 1.0), k: Count = 10,
                 rsa_images: Annotated[int, Range(5)] = 200, ridge: Positive = 1e-3,
                 n_permutations: Permutations = 99, n_groups: Groups = 10, null_pairs: str = "last",
                 grid: str = "matched", subspace_k: Count = M.SUBSPACE_K,
                 subspace_space: Literal["auto", "features", "images"] = "auto"):
        super().__init__(vm)
        self.taps = expand_taps(list(taps) if not isinstance(taps, str) else taps, self.depth)
        if view not in POOLED_VIEWS:
            raise ConfigError(f"similarity: view {view!r} is not one vector per image; choose one of "
                              f"{', '.join(POOLED_VIEWS)}")
        if view == "cls" and not self.has_cls_token:
            raise ConfigError("similarity: this model has no CLS token; use the view 'gap' or 'gap_spatial'")
        self.view = view
        measures = [measures] if isinstance(measures, str) else list(measures)
        for m in measures:
            if m not in M.MEASURES:
                raise unknown_name("similarity measure", m, M.MEASURES)
        self.measures = [m for m in M.MEASURES if m in measures]
        if null_pairs not in NULL_PAIRS:
            raise unknown_name("similarity null_pairs", null_pairs, NULL_PAIRS)
        if grid not in GRIDS:
            raise unknown_name("similarity grid", grid, GRIDS)
        self.grid = grid
        if ("mutual_knn" in self.measures or "cknna" in self.measures) and int(k) >= int(n_subset):
            raise ConfigError(f"similarity: k = {k} neighbours needs n_subset above it, got {n_subset}")
        if "subspace_similarity" in self.measures and int(subspace_k) >= int(n_subset):
            raise ConfigError(f"similarity: subspace_k = {subspace_k} principal directions needs n_subset above it, "
                              f"got {n_subset}")
        if subspace_space not in M.SUBSPACE_SPACES:
            raise unknown_name("similarity subspace_space", subspace_space, M.SUBSPACE_SPACES)
        self.subspace_k, self.subspace_space = int(subspace_k), subspace_space
        self.n_subset, self.seed, self.k = int(n_subset), int(seed), int(k)
        self.alphas, self.rsa_images, self.ridge = [float(a) for a in alphas], int(rsa_images), float(ridge)
        self.n_permutations, self.n_groups, self.null_pairs = int(n_permutations), int(n_groups), null_pairs
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys = torch.empty(0, dtype=torch.long)
        self.feats: dict[str, torch.Tensor] = {}  # tap -> (rows, D) float16, rows ordered by key

    def required_taps(self) -> list[str]:
        return list(self.taps)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        rows = {t: token_view(feats[t], self.view, self.num_prefix_tokens, self.has_cls_token)
                if feats[t].ndim == 3 else feats[t] for t in self.taps}
        ids = batch.index.long()
        *host, ids = to_host(*(rows[t].detach().to(torch.float16) for t in self.taps), ids)
        self._keep(ids, subset_keys(ids, self.seed), dict(zip(self.taps, host, strict=True)))
        self.n_images += len(ids)

    def _keep(self, ids: torch.Tensor, keys: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
        """Add rows and keep the ``n_subset`` with the smallest (key, id), in that order."""
        if not len(ids):
            return
        ids, keys = torch.cat([self.ids, ids]), torch.cat([self.keys, keys])
        feats = {t: torch.cat([self.feats[t], x]) if t in self.feats else x for t, x in rows.items()}
        order = torch.argsort(ids, stable=True)
        order = order[torch.argsort(keys[order], stable=True)][:self.n_subset]
        self.ids, self.keys = ids[order], keys[order]
        self.feats = {t: x[order].contiguous() for t, x in feats.items()}

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Similarity) and other.taps == self.taps and other.view == self.view
        self._keep(other.ids, other.keys, other.feats)
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"taps": list(self.taps), "view": self.view, "n_images": self.n_images, "ids": self.ids,
                "keys": self.keys, "feats": dict(self.feats)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.taps, self.view, self.n_images = list(state["taps"]), str(state["view"]), int(state["n_images"])
        self.ids, self.keys, self.feats = state["ids"], state["keys"], dict(state["feats"])

    # -- finalize ---------------------------------------------------------------------------------------------

    def _check_kept(self) -> None:
        if len(self.ids) < 5:
            raise VitscopeError(f"similarity: {self.model_name} kept {len(self.ids)} images; the measures need at "
                                "least 5 (give the dataset more images)")

    def _prepared(self, rows: Any = None) -> list[M.Prepared]:
        self._check_kept()
        return [M.prepare(self.feats[t] if rows is None else self.feats[t][rows], self.measures, k=self.k,
                          rsa_images=self.rsa_images, name=f"{self.model_name} {t}", subspace_k=self.subspace_k)
                for t in self.taps]

    def _compare(self, pa: M.Prepared, pb: M.Prepared, measures: Sequence[str] | None = None) -> dict[str, float]:
        return M.compare(pa, pb, measures or self.measures, alphas=self.alphas, ridge=self.ridge,
                         subspace_space=self.subspace_space)

    def _n_of(self, metric: str) -> int:
        return min(self.rsa_images, len(self.ids)) if metric.startswith("rsa") else len(self.ids)

    def _row(self, other: Similarity, i: int, j: int, metric: str, value: float) -> dict[str, Any]:
        ta, tb = self.taps[i], other.taps[j]
        row = {"metric": metric, "layer": parse_tap(ta)[0], "layer_b": parse_tap(tb)[0], "tap": ta, "tap_b": tb,
               "token_view": self.view, "model_b": other.model_name, "value": value,
               "n_images": self._n_of(metric), "images_seen": self.n_images}
        if metric == "subspace_similarity":
            row["subspace_space"] = self._space(other, i, j)
        return row

    def _width(self, i: int) -> int:
        """The width of tap i's features (one vector per image)."""
        return int(np.prod(self.feats[self.taps[i]].shape[1:]))

    def _space(self, other: Similarity, i: int, j: int) -> str:
        """Where the subspace similarity of this model's tap i and ``other``'s tap j takes its principal directions
        ('features' or 'images', `metrics.similarity.subspace_space_of`); 'features' asked for layers of different
        widths is an error that names them."""
        wa, wb = self._width(i), other._width(j)
        if self.subspace_space == "features" and wa != wb:
            raise ConfigError(f"similarity: subspace_space 'features' needs layers of the same width, but "
                              f"{self.model_name} {self.taps[i]} has {wa} and {other.model_name} {other.taps[j]} "
                              f"{wb} (use 'auto' or 'images')")
        if self.subspace_space == "auto":
            return "features" if wa == wb else "images"
        return self.subspace_space

    def finalize(self) -> pd.DataFrame:
        if self.grid != "full":  # the measures across models only (`cross`): no rows within the model
            self._check_kept()
            return self.tidy([])
        with few_threads():
            prep = self._prepared()
            asym = [m for m in M.ASYMMETRIC if m in self.measures]
            n = len(prep)
            got = M.compare_grid(prep, prep, [(i, j) for i in range(n) for j in range(i, n)], self.measures,
                                 alphas=self.alphas, ridge=self.ridge, reverse=asym,
                                 subspace_space=self.subspace_space)
            rows = []
            for i, j in itertools.product(range(n), repeat=2):
                if i <= j:
                    for metric, v in got[i, j].items():
                        if metric.endswith("_reverse"):
                            continue
                        rows.append(self._row(self, i, j, metric, v))
                        if i != j and metric not in asym:
                            rows.append(self._row(self, j, i, metric, v))
                else:  # the asymmetric measures of (i, j): the reverse ones of (j, i)
                    rows += [self._row(self, i, j, m, got[j, i][f"{m}_reverse"]) for m in asym]
        return self.tidy(rows)

    def empty_reason(self) -> str:
        """Why this model has no rows: grids 'matched' and 'cross' measure across models only (no second model
        it shares images and a token view with), else the generic reason."""
        if self.grid != "full" and self.n_images:
            return (f"it compares models, and with grid '{self.grid}' it has no rows within one model: no other model "
                    "of the study saw the same images under the same token view (set grid: full for the pairs of "
                    "layers within the model)")
        return super().empty_reason()

    @classmethod
    def cross(cls, analyses: list[Analysis]) -> pd.DataFrame | None:
        frames = []  # one model alone with grid matched or cross: no rows, said by the study (`empty_reason`)
        prepared: dict[int, list[M.Prepared]] = {}  # each model's taps prepared once for all its pairs

        def prep(k: int) -> list[M.Prepared]:
            if k not in prepared:
                with few_threads():
                    prepared[k] = analyses[k]._prepared()
            return prepared[k]

        for i, a in enumerate(analyses):
            for j in range(i + 1, len(analyses)):
                b = analyses[j]
                assert isinstance(a, Similarity) and isinstance(b, Similarity)
                if not torch.equal(a.ids, b.ids) or a.view != b.view:
                    warnings.warn(f"similarity: {a.model_name} and {b.model_name} saw different images "
                                  f"(or token views); the pair is left out", stacklevel=2)
                    continue
                frames.append(a._cross_rows(b, prep(i), prep(j)))
            prepared.pop(i, None)  # model i has no later pairs
        return pd.concat(frames, ignore_index=True) if frames else None

    def _grid_pairs(self, other: Similarity) -> list[tuple[int, int]]:
        """The layer pairs across the two models that ``grid`` computes."""
        na, nb = len(self.taps), len(other.taps)
        if self.grid == "matched":
            return _matched(na, nb)
        return list(itertools.product(range(na), range(nb)))

    def _tested_pairs(self, other: Similarity) -> list[tuple[int, int]]:
        """The layer pairs ``null_pairs`` names ('all': every pair the grid computes), which get nulls and
        intervals."""
        na, nb = len(self.taps), len(other.taps)
        if self.null_pairs == "none" or not (self.n_permutations or self.n_groups):
            return []
        if self.null_pairs == "all":
            return self._grid_pairs(other)
        if self.null_pairs == "last":
            return [(na - 1, nb - 1)]
        return _matched(na, nb)

    def _cross_rows(self, other: Similarity, pa: list[M.Prepared], pb: list[M.Prepared]) -> pd.DataFrame:
        with few_threads():
            rev = [m for m in M.ASYMMETRIC if m in self.measures]
            if "subspace_similarity" in self.measures:
                for i, j in self._grid_pairs(other):
                    self._space(other, i, j)  # 'features' across widths: an error naming the layers, first
            grid = M.compare_grid(pa, pb, self._grid_pairs(other), self.measures, alphas=self.alphas,
                                  ridge=self.ridge, reverse=rev, subspace_space=self.subspace_space)
            rows: dict[tuple[int, int, str], dict[str, Any]] = {}
            for (i, j), got in grid.items():
                for metric, v in got.items():
                    rows[i, j, metric] = self._row(other, i, j, metric, v)
            tested = self._tested_pairs(other)
            jack = self._jackknife(other, tested, rev)
            for i, j in tested:
                null = self._null(pa[i], pb[j], rev, i, j, self._order_free(other, i, j))
                for metric, row in ((m, r) for (a, b, m), r in rows.items() if (a, b) == (i, j)):
                    v = np.asarray(null.get(metric, []), dtype=float)
                    if len(v):
                        as_good = v <= row["value"] if _is_distance(metric) else v >= row["value"]
                        row.update(null_mean=float(v.mean()), null_q05=float(np.quantile(v, 0.05)),
                                   null_q95=float(np.quantile(v, 0.95)), n_permutations=len(v),
                                   p_value=float((1 + as_good.sum()) / (1 + len(v))))
                    reps = jack.get((i, j), {}).get(metric)
                    if reps is not None:
                        se, lo, hi = M.jackknife_interval(row["value"], reps, M.range_of(metric))
                        row.update(stderr=se, value_lo=lo, value_hi=hi, n_groups=len(reps))
            pretrained = self._pretrained_of(other)
            if pretrained is not None:
                for row in rows.values():
                    row["pretrained"] = pretrained
        return self.tidy(list(rows.values()))

    def _pretrained_of(self, other: Similarity) -> str | None:
        """The pretrained model's label when one of the pair is declared ``finetuned_from`` the other, else None."""
        if other.finetuned_from is not None and other.finetuned_from == self.model_name:
            return self.model_name
        if self.finetuned_from is not None and self.finetuned_from == other.model_name:
            return other.model_name
        return None

    def _rng(self, *stream: int) -> Any:
        return np.random.default_rng([self.seed, *stream])

    def _order_free(self, other: Similarity, i: int, j: int) -> list[str]:
        """The measures of the pair (i, j) that the order of B's images does not change, so that shuffling it is no
        null: the subspace similarity in feature space (the covariance's eigenvectors are sums over the images)."""
        if "subspace_similarity" in self.measures and self._space(other, i, j) == "features":
            return ["subspace_similarity"]
        return []

    def _null(self, pa: M.Prepared, pb: M.Prepared, rev: list[str], i: int, j: int,
              skip: Sequence[str] = ()) -> dict[str, list[float]]:
        """Scores with B's images shuffled: the RDM's images among themselves, the rest among themselves. All
        the shuffles of one pair in one `compare_grid` (their cross products in one matrix product). Neither the
        measures of `WITHOUT_NULL` nor those in ``skip`` (`_order_free`) get one."""
        n, m_rsa = len(self.ids), min(self.rsa_images, len(self.ids))
        shuffled = []
        pa, pb = pa.single(), pb.single()  # a shuffle's score needs a few digits: float32 products, 2x faster
        for p in range(self.n_permutations):
            g = self._rng(1, i, j, p)
            shuffled.append(pb.permuted(np.concatenate([g.permutation(m_rsa), m_rsa + g.permutation(n - m_rsa)])))
        measures = [m for m in self.measures if m not in WITHOUT_NULL and m not in skip]
        if not measures:
            return {}
        grid = M.compare_grid([pa], shuffled, [(0, p) for p in range(len(shuffled))], measures,
                              alphas=self.alphas, ridge=self.ridge, reverse=[m for m in rev if m in measures],
                              subspace_space=self.subspace_space)
        out: dict[str, list[float]] = {}
        for p in range(len(shuffled)):
            for metric, v in grid[0, p].items():
                out.setdefault(metric, []).append(v)
        return out

    def _jackknife(self, other: Similarity, pairs: list[tuple[int, int]], rev: list[str]
                   ) -> dict[tuple[int, int], dict[str, list[float]]]:
        """Per pair, every measure computed again without each of ``n_groups`` groups of images
        (`metrics.similarity.jackknife_replicates`): {pair: {metric: [value without group g, ...]}}."""
        n, g_count = len(self.ids), self.n_groups
        if not pairs or not g_count:
            return {}
        if g_count > n // 2:
            warnings.warn(f"similarity: {n} kept images are too few for {g_count} jackknife groups of at "
                          "least 2; the pairs get no interval", ResultWarning, stacklevel=2)
            return {}
        return M.jackknife_replicates([self.feats[t] for t in self.taps], [other.feats[t] for t in other.taps],
                                      pairs, g_count, self.measures, k=self.k, rsa_images=self.rsa_images,
                                      alphas=self.alphas, ridge=self.ridge, reverse=rev, subspace_k=self.subspace_k,
                                      subspace_space=self.subspace_space)


#: measures without a permutation null: leave-one-out ridge R² is out of sample, so unrelated features score
#: at most 0 in expectation (each held-out image is predicted by a noisy mean: about -r / (n - r) for r
#: directions) and 0 is its chance level; its jackknife interval against 0 is the test. Its shuffles
#: cost two products of n rows each, a fifth of a permutation's time.
WITHOUT_NULL = ("ridge_r2",)


def _matched(na: int, nb: int) -> list[tuple[int, int]]:
    """Each of A's ``na`` layers with B's layer at the same relative depth (the first with the first, the last
    with the last)."""
    return sorted({(i, round(i * (nb - 1) / max(na - 1, 1))) for i in range(na)})


def _is_distance(metric: str) -> bool:
    return metric.startswith(("procrustes", "angular_shape"))
