"""Representation similarity beyond CKA: functions of two feature matrices of the same n examples, (n, d) and
(n, d'), computed in float64. No I/O.

Linear family, all from one SVD per matrix (columns centred, the matrix scaled to unit Frobenius norm:
``X = U diag(s) Vᵀ``) and the cross product ``M = U_xᵀ U_y``:

* ``procrustes``   orthogonal Procrustes distance ``min_Q |X - Y Q|_F = sqrt(2 - 2 |XᵀY|_*)`` in [0, sqrt 2]
                   (Williams et al. 2021; the narrower matrix zero-padded).
* ``angular_shape`` the angular shape metric with partial whitening ``alpha`` (Williams et al. 2021; netrep's
                   ``LinearMetric``): each matrix whitened by ``alpha I + (1 - alpha) (XᵀX)^(-1/2)`` (eigenvalues
                   clipped at 1e-7), then ``arccos(|X_wᵀ Y_w|_* / (|X_w|_F |Y_w|_F))`` in [0, pi/2]. alpha = 0: CCA
                   (invariant to invertible linear maps); alpha = 1: Procrustes. Unlike netrep, inputs are scaled
                   to unit norm first, so intermediate alphas are invariant to isotropic scaling too.
* ``cca``          canonical correlations = singular values of M (numerical rank kept); ``mean_cca`` their mean.
* ``svcca``        Raghu et al. 2017: each matrix reduced to its leading singular directions holding ``keep``
                   (0.99) of its variance, then mean CCA (the truncation reads the variance spectrum: invariant
                   to rotations and scaling, not to every invertible linear map).
* ``pwcca``        Morcos et al. 2018: canonical correlations weighted by how much of X each canonical variate
                   h_i accounts for, ``sum_j |<h_i, x_j>|`` over X's neurons x_j (asymmetric: weights from X; it
                   depends on X's neuron basis, so it is invariant to scaling and to permuting or flipping neurons,
                   not to rotations).
* ``ridge_r2``     how well X predicts Y by ridge regression (penalty ``ridge`` relative to X's total variance,
                   which is 1 after scaling), scored by leave-one-out R² over all of Y's columns: the closed form
                   residuals ``(I - H) Y / (1 - h_ii)`` of the hat matrix ``H = X (XᵀX + λ I)⁻¹ Xᵀ`` on the
                   centred matrices (the centring uses every example).

Image x image family:

* ``rsa``          representational similarity analysis (Kriegeskorte et al. 2008): correlation-distance RDMs
                   ``1 - pearson(x_i, x_j)`` over the pairs i < j, compared by Spearman's rho and Kendall's tau_a.
* ``mutual_knn``   Huh et al. 2024: rows L2-normalised, each example's k nearest neighbours by cosine (itself
                   excluded) in X and in Y; the mean over examples of |N_X(i) ∩ N_Y(i)| / k. 1 for identical
                   neighbourhoods, about k / (n - 1) for independent ones.
* ``cknna``        Huh et al. 2024: unbiased HSIC of the cosine kernels K, L restricted to mutual neighbours
                   (``mask = knn_K ∩ knn_L``), normalised by the same quantity of K with itself and L with itself.

`prepare` computes the per-matrix part once (SVD, neighbours, RDM) and `compare` the pair part, so a grid of
layers costs one SVD per layer; `Prepared.permuted` reorders the examples of a prepared matrix without
recomputing it (permutation nulls). The pairwise functions below are `compare(prepare(x), prepare(y))`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import scipy.sparse as sp
import scipy.stats

from vitscope.errors import VitscopeError
from vitscope.metrics.intervals import t_quantile

__all__ = [
    "LINEAR_MEASURES",
    "MEASURES",
    "Prepared",
    "angular_shape_metric",
    "cca_correlations",
    "RANGES",
    "cknna",
    "compare",
    "compare_grid",
    "jackknife_interval",
    "jackknife_replicates",
    "kendall_tau_a",
    "mean_cca",
    "mutual_knn",
    "prepare",
    "procrustes_distance",
    "range_of",
    "pwcca",
    "rsa",
    "ridge_r2",
    "svcca",
]

#: measures computed from the SVD of each matrix
LINEAR_MEASURES = ("procrustes", "angular_shape", "mean_cca", "svcca", "pwcca", "ridge_r2")
#: every measure `compare` knows; ``rsa`` gives ``rsa_spearman`` and ``rsa_kendall``, ``ridge_r2`` X -> Y
MEASURES = (*LINEAR_MEASURES, "rsa", "mutual_knn", "cknna")

EIGVAL_TOL = 1e-7  # netrep's clip of the covariance eigenvalues in the partial whitening
RANK_TOL = 1e-6  # singular values below this times the largest are numerical zeros (the SVD comes from the
# eigendecomposition of the smaller Gram matrix, whose precision on s is about 1e-8 of the largest)


class FeatureError(VitscopeError, ValueError):
    """Features a similarity measure cannot take."""


def _matrix(x: Any, name: str) -> np.ndarray:
    a = x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)
    if a.ndim == 3:
        a = a.reshape(a.shape[0], -1)
    if a.ndim != 2:
        raise FeatureError(f"{name} must have shape (n, d) or (n, T, d), got shape {a.shape}")
    if not np.isfinite(a).all():
        raise FeatureError(f"{name} holds {int((~np.isfinite(a)).sum())} non-finite values; similarity needs "
                           "finite features")
    if a.shape[0] < 4:
        raise FeatureError(f"{name} holds {a.shape[0]} examples; similarity measures need at least 4")
    return a


@dataclass
class Prepared:
    """The per-matrix part of every measure, for one (n, d) matrix."""

    n: int
    u: np.ndarray | None = None  # (n, r) left singular vectors of the centred, unit-norm matrix
    s: np.ndarray | None = None  # (r,) its singular values
    vt: np.ndarray | None = None  # (r, d) right singular vectors
    keep_svcca: int = 0  # leading directions SVCCA keeps
    knn: np.ndarray | None = None  # (n, k) neighbours by cosine, itself excluded
    knn_sim: np.ndarray | None = None  # (n, k) the cosines to them
    rdm: np.ndarray | None = None  # (m,) upper triangle of the correlation-distance RDM
    rdm_n: int = 0  # examples of the RDM (the first rdm_n)
    rdm_ranks: np.ndarray | None = None
    extra: dict = field(default_factory=dict)  # cached values the order of the examples does not change

    def single(self) -> Prepared:
        """The same matrix with its basis in float32: `compare_grid`'s products of n rows (the cross products and
        ridge's residuals) and PWCCA's weights then run at float32, about twice as fast, and every
        decomposition still at float64.
        For permutation nulls, where a shuffled score needs a few digits (errors of about 1e-6 here)."""
        return replace(self, u=None if self.u is None else self.u.astype(np.float32),
                       vt=None if self.vt is None else self.vt.astype(np.float32))

    def permuted(self, perm: np.ndarray) -> Prepared:
        """The same matrix with its examples reordered (row i of the new one is row perm[i]), without a new SVD
        or neighbour search. The RDM part is reordered within its first ``rdm_n`` examples: ``perm`` must map
        them onto themselves for it (else the RDM is dropped)."""
        perm = np.asarray(perm)
        out = replace(self)
        if self.u is not None:
            out.u = self.u[perm]
        if self.knn is not None:
            inv = np.empty_like(perm)
            inv[perm] = np.arange(len(perm))
            out.knn, out.knn_sim = inv[self.knn[perm]], self.knn_sim[perm]
        if self.rdm is not None:
            p = perm[:self.rdm_n]
            if np.array_equal(np.sort(p), np.arange(self.rdm_n)):
                at = _triangle_positions(self.rdm_n)[np.ix_(p, p)][np.triu_indices(self.rdm_n, 1)]
                out.rdm, out.rdm_ranks = self.rdm[at], self.rdm_ranks[at]  # a rank moves with its entry
            else:
                out.rdm = out.rdm_ranks = None
        return out


@functools.lru_cache(maxsize=4)
def _triangle_positions(m: int) -> np.ndarray:
    """(m, m): the position of entry (i, j) (or (j, i)) in the upper triangle ``np.triu_indices(m, 1)``."""
    iu = np.triu_indices(m, 1)
    pos = np.zeros((m, m), dtype=np.intp)
    pos[iu] = np.arange(len(iu[0]))
    pos += pos.T
    pos.setflags(write=False)  # shared by every caller
    return pos


def prepare(x: Any, measures: Iterable[str] = MEASURES, k: int = 10, keep: float = 0.99,
            rsa_images: int | None = None, name: str = "x") -> Prepared:
    """The per-matrix part of ``measures`` for ``x`` (n, d): the SVD for the linear family, the ``k`` nearest
    neighbours for mutual k-NN and CKNNA, the RDM of the first ``rsa_images`` examples (all if None) for RSA."""
    measures = _check_measures(measures)
    a = _matrix(x, name)
    n = a.shape[0]
    p = Prepared(n=n)
    if any(m in LINEAR_MEASURES for m in measures):
        c = a - a.mean(0)
        norm = np.linalg.norm(c)
        if norm == 0:
            raise FeatureError(f"{name} is constant over the examples; linear similarity measures need variation")
        u, s, vt = _thin_svd(c / norm)
        r = int((s > RANK_TOL * s[0]).sum())
        p.u, p.s, p.vt = u[:, :r], s[:r], vt[:r]
        var = np.cumsum(p.s ** 2) / np.sum(p.s ** 2)
        p.keep_svcca = int(min(np.searchsorted(var, keep - 1e-12) + 1, r))
    if "mutual_knn" in measures or "cknna" in measures:
        _check_k(k, n)
        _, p.knn, p.knn_sim = _neighbour_lists(a, k)
    if "rsa" in measures:
        m = n if rsa_images is None else min(int(rsa_images), n)
        if m < 4:
            raise FeatureError(f"RSA needs at least 4 examples, got {m}")
        p.rdm_n, p.rdm = m, correlation_rdm(a[:m])
        p.rdm_ranks = scipy.stats.rankdata(p.rdm)
    return p


def _check_k(k: int, n: int) -> None:
    if not 1 <= k <= n - 1:
        raise FeatureError(f"k = {k} neighbours needs between 1 and n - 1 = {n - 1}")


CANDIDATES = 8  # neighbours searched beyond a list's length at float32, before float64 orders them
F32_ERROR = 2.0 ** -23  # twice float32's unit roundoff: the margin of `_neighbour_lists`' error bounds


def _neighbour_lists(a: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(z, idx, sim)``: the rows of ``a`` at unit norm, each row's ``length`` nearest neighbours by cosine
    (itself excluded, `_top_k`'s order) and the cosines to them.

    The same lists as a float64 search, at about half its cost: float32 scores give each row ``length +
    CANDIDATES`` candidates, their float64 cosines (`_cosines`) order them. The scores are the cosines less a
    per-row constant, from the rows less their mean m (features share a large mean, which float32 would
    otherwise resolve poorly): ``z_i·z_j = (z_i - m)·(z_j - m) + m·z_j + (m·z_i - m·m)``. Every row left out
    scores at most the last candidate's score plus float32's error bound on the score ((d + 2) 2^-23 |z_i - m|
    max_j |z_j - m|, and 2^-21 for the sum); a row whose length-th cosine does not clear that (near-ties,
    duplicated images) is searched again at float64."""
    z = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-300)
    n, d = z.shape
    width = min(n - 1, length + CANDIDATES)
    m = z.mean(0)
    zc = z - m
    mz = z @ m
    zc32 = zc.astype(np.float32)
    score = zc32 @ zc32.T
    score += mz.astype(np.float32)[None, :]
    np.fill_diagonal(score, -np.inf)
    cand = _top_k(score, width)
    last = np.take_along_axis(score, cand[:, -1:], axis=1)[:, 0].astype(np.float64)
    del score
    cos = np.empty(cand.shape)
    for s in range(0, n, ROWS_AT_ONCE):
        cos[s:s + ROWS_AT_ONCE] = _cosines(z[s:s + ROWS_AT_ONCE], z[cand[s:s + ROWS_AT_ONCE]])
    order = np.lexsort((cand, -cos), axis=-1)
    idx = np.take_along_axis(cand, order, axis=1)[:, :length]
    sim = np.take_along_axis(cos, order, axis=1)[:, :length]
    if width < n - 1:
        spread = np.linalg.norm(zc, axis=1)
        bound = (d + 2) * F32_ERROR * spread * spread.max() + 4 * F32_ERROR
        for r in np.flatnonzero(sim[:, -1] <= last + (mz - m @ m) + bound):
            row = _cosines(z[r], z)
            row[r] = -np.inf
            idx[r] = _top_k(row[None, :], length)[0]
            sim[r] = row[idx[r]]
    return z, idx, sim


ROWS_AT_ONCE = 256  # rows whose candidates are gathered at once (256 x width x d float64)


def _cosines(rows: np.ndarray, others: np.ndarray) -> np.ndarray:
    """``rows · others`` along the last axis ((d,) with (m, d), or (b, d) with (b, m, d)), one summation order for
    every caller, so equal pairs of vectors give equal bits whichever search computed them."""
    if rows.ndim == 1:
        return np.einsum("d,jd->j", rows, others)
    return np.einsum("id,ijd->ij", rows, others)


def _top_k(sim: np.ndarray, k: int) -> np.ndarray:
    """Per row, the columns of the ``k`` largest values, largest first and equal values by column: the first
    ``k`` of a stable argsort of ``-sim``, from each row's k-th largest value (a values-only partition, about 4x
    faster than an index partition) and the entries at or above it (rows where the k-th value is tied take the
    sort)."""
    cols = sim.shape[1]
    kth = np.partition(sim, cols - k, axis=1)[:, cols - k:cols - k + 1]
    above = sim >= kth
    tied = above.sum(1) > k
    above[tied] = False
    idx = np.zeros((sim.shape[0], k), dtype=np.intp)
    idx[~tied] = (np.flatnonzero(above) % cols).reshape(-1, k)  # row-major: each untied row's k columns in order
    vals = np.take_along_axis(sim, idx, axis=1)
    idx = np.take_along_axis(idx, np.lexsort((idx, -vals), axis=-1), axis=1)
    if tied.any():
        idx[tied] = np.argsort(-sim[tied], axis=1, kind="stable")[:, :k]
    return idx


def _thin_svd(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``a = U diag(s) Vᵀ``, s descending, from the eigendecomposition of the smaller of ``aᵀa`` and ``a aᵀ``
    (4x faster than LAPACK's SVD of a tall matrix); directions with s below RANK_TOL of the largest are dropped
    (their vectors would be imprecise)."""
    tall = a.shape[0] >= a.shape[1]
    lam, vec = np.linalg.eigh(a.T @ a if tall else a @ a.T)
    lam, vec = lam[::-1], vec[:, ::-1]
    s = np.sqrt(np.clip(lam, 0.0, None))
    r = max(int((s > RANK_TOL * s[0]).sum()), 1)
    s, vec = s[:r], vec[:, :r]
    if tall:
        return (a @ vec) / s[None, :], s, vec.T
    return vec, s, (vec.T @ a) / s[:, None]


def _svals(a: np.ndarray) -> np.ndarray:
    """Singular values of ``a``, descending (min of its sides), from the eigenvalues of its smaller Gram."""
    g = a.T @ a if a.shape[0] >= a.shape[1] else a @ a.T
    return np.sqrt(np.clip(np.linalg.eigvalsh(g)[::-1], 0.0, None))


def _check_measures(measures: Iterable[str]) -> list[str]:
    measures = [measures] if isinstance(measures, str) else list(measures)
    for m in measures:
        if m not in MEASURES:
            raise FeatureError(f"unknown similarity measure {m!r}; the measures are {', '.join(MEASURES)}")
    return measures


def correlation_rdm(a: np.ndarray) -> np.ndarray:
    """Upper triangle (i < j, row-major) of ``1 - pearson(a_i, a_j)`` between the rows of ``a``."""
    z = a - a.mean(1, keepdims=True)
    z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-300)
    return (1.0 - z @ z.T)[np.triu_indices(len(a), 1)]


def compare(px: Prepared, py: Prepared, measures: Iterable[str] = MEASURES, alphas: Sequence[float] = (0.0, 0.5, 1.0),
            ridge: float = 1e-3) -> dict[str, float]:
    """{name: value} of ``measures`` between two prepared matrices of the same examples. Names: ``procrustes``,
    ``angular_shape_alpha=<a>`` per alpha, ``mean_cca``, ``svcca``, ``pwcca``, ``ridge_r2`` (X predicts Y),
    ``rsa_spearman``, ``rsa_kendall``, ``mutual_knn``, ``cknna``."""
    return compare_grid([px], [py], [(0, 0)], measures, alphas, ridge)[0, 0]


#: the range of each measure's values (the base name: ``angular_shape`` for every alpha); intervals are clipped to it
RANGES = {"procrustes": (0.0, float(np.sqrt(2.0))), "angular_shape": (0.0, float(np.pi / 2)), "mean_cca": (0.0, 1.0),
          "svcca": (0.0, 1.0), "pwcca": (0.0, 1.0), "ridge_r2": (-np.inf, 1.0), "rsa_spearman": (-1.0, 1.0),
          "rsa_kendall": (-1.0, 1.0), "mutual_knn": (0.0, 1.0), "cknna": (-np.inf, np.inf)}


def range_of(metric: str) -> tuple[float, float]:
    """The range of a table's ``metric`` (``angular_shape_alpha=0.5``, ``ridge_r2_reverse``, ...)."""
    return RANGES[metric.split("_alpha=")[0].removesuffix("_reverse")]


#: measures whose value changes when x and y swap: `compare_grid` gives them as ``<name>_reverse`` too (CKNNA:
#: its masked kernels are not symmetric matrices, so the unbiased HSIC's 1ᵀK̃L̃1 term changes with the order)
ASYMMETRIC = ("pwcca", "ridge_r2", "cknna")
GRID_COLUMNS = 2048  # columns of the stacked targets in one product (n x 2048 float64: 32 MB at n = 2000)


def compare_grid(pa: Sequence[Prepared], pb: Sequence[Prepared], pairs: Iterable[tuple[int, int]],
                 measures: Iterable[str] = MEASURES, alphas: Sequence[float] = (0.0, 0.5, 1.0), ridge: float = 1e-3,
                 reverse: Iterable[str] = ()) -> dict[tuple[int, int], dict[str, float]]:
    """``compare(pa[i], pb[j], measures)`` for each ``(i, j)`` of ``pairs``, and for the asymmetric measures in
    ``reverse`` (pwcca, ridge_r2, cknna) also ``<name>_reverse`` = ``compare(pb[j], pa[i], [name])``: the same numbers
    as those calls (up to float rounding), in less time. The cross products ``U_iᵀ U_j`` of each ``pa[i]``
    with all the ``pb[j]`` it meets come from one matrix product; one eigendecomposition of each of
    ``M Mᵀ`` and ``Mᵀ M`` gives the canonical correlations and PWCCA's directions both ways; ridge's residuals
    of one predictor against all its targets come from one product."""
    measures = _check_measures(measures)
    asked = _check_measures(reverse)
    if any(m not in ASYMMETRIC for m in asked):
        raise FeatureError(f"compare_grid: reverse takes the asymmetric measures {', '.join(ASYMMETRIC)}")
    reverse = [m for m in ASYMMETRIC if m in asked and m in measures]
    pairs = list(dict.fromkeys((int(i), int(j)) for i, j in pairs))
    linear = any(m in LINEAR_MEASURES for m in measures)
    for i, j in pairs:
        px, py = pa[i], pb[j]
        if px.n != py.n:
            raise FeatureError(f"x and y must hold the same examples: got n = {px.n} and n = {py.n}")
        if linear and (px.u is None or py.u is None):
            raise FeatureError("compare: a matrix was prepared without the linear measures")
    out: dict[tuple[int, int], dict[str, float]] = {pair: {} for pair in pairs}
    if linear:
        cross = _cross_products(pa, pb, pairs)
        for (i, j), m in cross.items():
            out[i, j].update(_linear(pa[i], pb[j], m, measures, [float(a) for a in alphas], reverse))
        if "ridge_r2" in measures:
            for (i, j), v in _ridge_grid(pa, pb, cross, float(ridge)).items():
                out[i, j]["ridge_r2"] = v
            if "ridge_r2" in reverse:
                back = {(j, i): m.T for (i, j), m in cross.items()}
                for (j, i), v in _ridge_grid(pb, pa, back, float(ridge)).items():
                    out[i, j]["ridge_r2_reverse"] = v
    for i, j in pairs:
        out[i, j].update(_nonlinear(pa[i], pb[j], measures, "cknna" in reverse))
        out[i, j] = _ordered(out[i, j], measures, [float(a) for a in alphas], reverse)
    return out


def _ordered(got: dict[str, float], measures: list[str], alphas: list[float], reverse: list[str]) -> dict[str, float]:
    """The names in a fixed order (the tables' row order), then the reverse ones."""
    names = []
    for m in ("procrustes", "angular_shape", "mean_cca", "pwcca", "svcca", "ridge_r2", "rsa", "mutual_knn", "cknna"):
        if m not in measures:
            continue
        if m == "angular_shape":
            names += [f"angular_shape_alpha={a:g}" for a in alphas]
        elif m == "rsa":
            names += ["rsa_spearman", "rsa_kendall"]
        else:
            names.append(m)
    names += [f"{m}_reverse" for m in reverse]
    return {k: got[k] for k in dict.fromkeys(names) if k in got}


def _cross_products(pa: Sequence[Prepared], pb: Sequence[Prepared],
                    pairs: list[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
    """``U_iᵀ U_j`` for each pair: per i, its partners' bases side by side in one product."""
    by_i: dict[int, list[int]] = {}
    for i, j in pairs:
        by_i.setdefault(i, []).append(j)
    out = {}
    for i, js in by_i.items():
        for chunk in _chunks(js, [pb[j].u.shape[1] for j in js]):
            wide = pa[i].u.T @ np.concatenate([pb[j].u for j in chunk], axis=1)
            for j, block in zip(chunk, _split(wide, [pb[j].u.shape[1] for j in chunk]), strict=True):
                out[i, j] = block.astype(np.float64, copy=False)  # a float32 product (`Prepared.single`) too
    return {pair: out[pair] for pair in pairs}


def _chunks(items: list[int], widths: list[int]) -> list[list[int]]:
    """``items`` in runs whose widths add up to at most GRID_COLUMNS (one item alone may exceed it)."""
    runs, run, width = [], [], 0
    for item, w in zip(items, widths, strict=True):
        if run and width + w > GRID_COLUMNS:
            runs.append(run)
            run, width = [], 0
        run.append(item)
        width += w
    return [*runs, run] if run else runs


def _split(wide: np.ndarray, widths: list[int]) -> list[np.ndarray]:
    return np.split(wide, np.cumsum(widths)[:-1], axis=1)


def _linear(px: Prepared, py: Prepared, cross: np.ndarray, measures: list[str], alphas: list[float],
            reverse: list[str]) -> dict[str, float]:
    """The linear measures but ridge from the cross product ``cross = U_xᵀ U_y``."""
    out: dict[str, float] = {}
    tall = cross.shape[0] >= cross.shape[1]  # _svals takes the smaller Gram: Mᵀ M when tall
    eig: dict[bool, tuple[np.ndarray, np.ndarray]] = {}  # False: eigh(M Mᵀ) (x's side), True: eigh(Mᵀ M)
    if "pwcca" in measures:
        eig[False] = np.linalg.eigh(cross @ cross.T)
    if "pwcca" in reverse:
        eig[True] = _other_side(cross, *eig[False]) if "pwcca" in measures else None
        if eig[True] is None:
            eig[True] = np.linalg.eigh(cross.T @ cross)
    rho = None  # canonical correlations, computed once for the measures that share them
    if "mean_cca" in measures or "pwcca" in measures or ("angular_shape" in measures and 0.0 in alphas):
        lam = eig[tall][0] if tall in eig else np.linalg.eigvalsh(cross.T @ cross if tall else cross @ cross.T)
        rho = np.clip(np.sqrt(np.clip(lam[::-1], 0.0, None)), 0.0, 1.0)
    nuc1 = None
    if "procrustes" in measures or ("angular_shape" in measures and 1.0 in alphas):
        nuc1 = _svals(px.s[:, None] * cross * py.s[None, :]).sum()  # |XᵀY|_*, both at unit norm
        if "procrustes" in measures:
            out["procrustes"] = float(np.sqrt(max(0.0, 2.0 - 2.0 * min(nuc1, 1.0))))
    if "angular_shape" in measures:
        for a in alphas:
            known = nuc1 if a == 1.0 else rho.sum() if a == 0.0 else None
            out[f"angular_shape_alpha={a:g}"] = _angular(px, py, cross, a, known)
    if "mean_cca" in measures:
        out["mean_cca"] = float(rho.mean())
    if "pwcca" in measures:
        out["pwcca"] = _pwcca(px, *eig[False], min(cross.shape))
    if "pwcca" in reverse:
        out["pwcca_reverse"] = _pwcca(py, *eig[True], min(cross.shape))
    if "svcca" in measures:
        rho_k = _svals(cross[:px.keep_svcca, :py.keep_svcca])
        out["svcca"] = float(np.clip(rho_k, 0.0, 1.0).mean())
    return out


SIDE_TOL = 1e-12  # smallest canonical correlation² whose y-side direction is derived from its x-side one


def _other_side(cross: np.ndarray, lam: np.ndarray, vec: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``eigh(Mᵀ M)``'s leading part from ``eigh(M Mᵀ) = (lam, vec)`` (ascending): each y-side canonical direction
    is ``b_i = Mᵀ a_i / rho_i``, one r³ product instead of a second eigendecomposition. Returned ascending as eigh
    gives it, the ``min(M.shape)`` leading directions only (all PWCCA reads). An error e in ``a_i`` becomes about
    e rho_j / rho_i in ``b_i``: None when a rho_i² is below SIDE_TOL (the caller decomposes ``Mᵀ M`` instead)."""
    c = min(cross.shape)
    lam_c, vec_c = lam[lam.shape[0] - c:], vec[:, vec.shape[1] - c:]
    if c == 0 or lam_c[0] < SIDE_TOL:
        return None
    b = cross.T @ vec_c
    return lam_c, b / np.linalg.norm(b, axis=0, keepdims=True)  # |Mᵀ a_i| = rho_i, renormalised against rounding


def _pwcca(px: Prepared, lam: np.ndarray, vec: np.ndarray, c: int) -> float:
    """PWCCA with weights from x, given the eigendecomposition of ``M Mᵀ`` (ascending) for ``M = U_xᵀ U_y``:
    x's canonical directions are its eigenvectors of the ``c`` largest eigenvalues."""
    ua, rho_w = vec[:, ::-1][:, :c], np.sqrt(np.clip(lam[::-1][:c], 0.0, 1.0))
    # <h_i, x_j> for the canonical variates h = U_x a_i and the neurons x_j (columns of U_x S V_xᵀ)
    dt = px.vt.dtype  # float32 for `Prepared.single` bases
    w = np.abs((ua.T * px.s[None, :]).astype(dt, copy=False) @ px.vt).sum(1, dtype=np.float64)
    return float((w * rho_w).sum() / w.sum())


def _ridge_grid(pa: Sequence[Prepared], pb: Sequence[Prepared], cross: Mapping[tuple[int, int], np.ndarray],
                ridge: float) -> dict[tuple[int, int], float]:
    """Leave-one-out ridge R² (module docstring) of pa[i] predicting pb[j] for each pair of ``cross`` (its
    ``U_iᵀ U_j``): per i, the fitted values of all its targets in one product."""
    by_i: dict[int, list[int]] = {}
    for i, j in cross:
        by_i.setdefault(i, []).append(j)
    out = {}
    for i, js in by_i.items():
        px = pa[i]
        f = px.s ** 2 / (px.s ** 2 + ridge)  # shrinkage of each direction of X (total variance 1)
        scale = 1.0 / np.maximum(1.0 - (px.u ** 2) @ f, 1e-12)  # 1 / (1 - the hat matrix's diagonal)
        dt = px.u.dtype  # float32 for `Prepared.single` bases: the products of n rows at that precision
        for chunk in _chunks(js, [pb[j].u.shape[1] for j in js]):
            coef = np.concatenate([f[:, None] * cross[i, j] * pb[j].s[None, :] for j in chunk], axis=1).astype(dt)
            resid = np.concatenate([pb[j].u * pb[j].s[None, :].astype(dt) for j in chunk], axis=1).astype(dt)
            resid -= px.u @ coef  # (I - H) Y in Y's basis, every target side by side
            resid *= scale[:, None].astype(dt)
            sse = np.einsum("ij,ij->j", resid, resid, dtype=np.float64)
            for j, part in zip(chunk, _split(sse[None, :], [pb[j].u.shape[1] for j in chunk]), strict=True):
                out[i, j] = float(1.0 - part.sum() / (pb[j].s ** 2).sum())
    return out


def _nonlinear(px: Prepared, py: Prepared, measures: list[str], cknna_reverse: bool = False) -> dict[str, float]:
    out: dict[str, float] = {}
    if "rsa" in measures:
        if px.rdm is None or py.rdm is None or px.rdm_n != py.rdm_n:
            raise FeatureError("compare: RSA needs both matrices prepared with RDMs of the same examples")
        out["rsa_spearman"] = _pearson(px.rdm_ranks, py.rdm_ranks)
        out["rsa_kendall"] = kendall_tau_a(px.rdm, py.rdm)
    if "mutual_knn" in measures or "cknna" in measures:
        if px.knn is None or py.knn is None or px.knn.shape != py.knn.shape:
            raise FeatureError("compare: mutual k-NN needs both matrices prepared with the same k")
        same = px.knn[:, :, None] == py.knn[:, None, :]  # (n, k, k)
        if "mutual_knn" in measures:
            out["mutual_knn"] = float(same.sum() / px.knn.size)
        if "cknna" in measures:
            out["cknna"] = _cknna(px, py, same)
            if cknna_reverse:  # the neighbour matches seen from y: the same mask, the kernels' roles swapped
                out["cknna_reverse"] = _cknna(py, px, same.transpose(0, 2, 1))
    return out


def _angular(px: Prepared, py: Prepared, cross: np.ndarray, alpha: float, known: float | None = None) -> float:
    """``known``: the nuclear norm of the whitened cross product where another measure computed it (alpha 1:
    Procrustes'; alpha 0: the sum of the canonical correlations, when no eigenvalue is clipped)."""
    if not 0.0 <= alpha <= 1.0:
        raise FeatureError(f"the shape metric's alpha must be between 0 (CCA) and 1 (Procrustes), got {alpha}")

    def weights(s: np.ndarray) -> np.ndarray:  # singular values of X_w = X Z (netrep's whiten, unit-norm X)
        if alpha > 1 - EIGVAL_TOL:
            return s
        return s * (alpha + (1 - alpha) / np.sqrt(np.maximum(s ** 2, EIGVAL_TOL)))

    wx, wy = weights(px.s), weights(py.s)
    if known is not None and (alpha == 1.0 or (px.s ** 2 >= EIGVAL_TOL).all() and (py.s ** 2 >= EIGVAL_TOL).all()):
        nuc = known
    else:
        nuc = _svals(wx[:, None] * cross * wy[None, :]).sum()
    return float(np.arccos(np.clip(nuc / (np.linalg.norm(wx) * np.linalg.norm(wy)), -1.0, 1.0)))


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a @ a) * (b @ b))
    return float(a @ b / den) if den > 0 else float("nan")


def kendall_tau_a(a: np.ndarray, b: np.ndarray) -> float:
    """Kendall's tau_a = (concordant - discordant) / (m (m - 1) / 2), ties counting as neither, in O(m log m):
    scipy's tau_b times its tie correction ``sqrt((m0 - t_a)(m0 - t_b))`` gives concordant - discordant."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    m = len(a)
    m0 = m * (m - 1) / 2
    ties = [float((c * (c - 1) // 2).sum()) for c in (np.unique(v, return_counts=True)[1] for v in (a, b))]
    den = np.sqrt((m0 - ties[0]) * (m0 - ties[1]))
    if den == 0:
        return float("nan")
    tau_b = scipy.stats.kendalltau(a, b, variant="b").statistic
    return float(tau_b * den / m0)


def _cknna(px: Prepared, py: Prepared, same: np.ndarray) -> float:
    n, k = px.knn.shape

    def hsic(kv: np.ndarray, lv: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
        """Unbiased HSIC (Song et al. 2012) of two masked kernels with the same support, as Huh et al.:
        sum(K̃ ∘ L̃ᵀ) + sum K̃ sum L̃ / ((n-1)(n-2)) - 2 / (n-2) 1ᵀK̃L̃1, over n (n-3)."""
        km = sp.csr_matrix((kv, (rows, cols)), shape=(n, n))
        lm = sp.csr_matrix((lv, (rows, cols)), shape=(n, n))
        t1 = km.multiply(lm.T).sum()
        t2 = km.sum() * lm.sum() / ((n - 1) * (n - 2))
        t3 = 2.0 / (n - 2) * float(np.asarray(km.sum(0)).ravel() @ np.asarray(lm.sum(1)).ravel())
        return (t1 + t2 - t3) / (n * (n - 3))

    rows = np.repeat(np.arange(n), k)
    i_x, j_x = np.nonzero(same.any(2))  # positions in x's list that are also in y's
    j_y = same.argmax(2)[i_x, j_x]
    kl = hsic(px.knn_sim[i_x, j_x], py.knn_sim[i_x, j_y], i_x, px.knn[i_x, j_x])

    def self_hsic(p: Prepared) -> float:  # the same for every partner and every reordering of the examples
        if "hsic_self" not in p.extra:
            p.extra["hsic_self"] = hsic(p.knn_sim.ravel(), p.knn_sim.ravel(), rows, p.knn.ravel())
        return p.extra["hsic_self"]

    kk, ll = self_hsic(px), self_hsic(py)
    return float(kl / np.sqrt(kk * ll)) if kk * ll > 0 else float("nan")


def _pair(x: Any, y: Any, measures: Iterable[str], **kw: Any) -> dict[str, float]:
    prep = {k: kw.pop(k) for k in ("k", "keep", "rsa_images") if k in kw}
    return compare(prepare(x, measures, name="x", **prep), prepare(y, measures, name="y", **prep), measures, **kw)


def procrustes_distance(x: Any, y: Any) -> float:
    """Orthogonal Procrustes distance between the centred, unit-norm x and y, in [0, sqrt 2]."""
    return _pair(x, y, ["procrustes"])["procrustes"]


def angular_shape_metric(x: Any, y: Any, alpha: float = 1.0) -> float:
    """Williams et al. 2021's angular shape metric with partial whitening alpha (0: CCA, 1: Procrustes)."""
    return _pair(x, y, ["angular_shape"], alphas=[alpha])[f"angular_shape_alpha={float(alpha):g}"]


def cca_correlations(x: Any, y: Any) -> np.ndarray:
    """The canonical correlations, largest first (min of the two numerical ranks)."""
    px, py = prepare(x, ["mean_cca"]), prepare(y, ["mean_cca"], name="y")
    if px.n != py.n:
        raise FeatureError(f"x and y must hold the same examples: got n = {px.n} and n = {py.n}")
    return np.clip(_svals(px.u.T @ py.u), 0.0, 1.0)


def mean_cca(x: Any, y: Any) -> float:
    return _pair(x, y, ["mean_cca"])["mean_cca"]


def svcca(x: Any, y: Any, keep: float = 0.99) -> float:
    return _pair(x, y, ["svcca"], keep=keep)["svcca"]


def pwcca(x: Any, y: Any) -> float:
    return _pair(x, y, ["pwcca"])["pwcca"]


def ridge_r2(x: Any, y: Any, ridge: float = 1e-3) -> float:
    """Leave-one-out R² of y predicted from x by ridge regression (penalty relative to x's total variance)."""
    return _pair(x, y, ["ridge_r2"], ridge=ridge)["ridge_r2"]


def rsa(x: Any, y: Any) -> dict[str, float]:
    """{'rsa_spearman', 'rsa_kendall'} between the correlation-distance RDMs of x and y."""
    return _pair(x, y, ["rsa"])


def mutual_knn(x: Any, y: Any, k: int = 10) -> float:
    return _pair(x, y, ["mutual_knn"], k=k)["mutual_knn"]


def cknna(x: Any, y: Any, k: int = 10) -> float:
    return _pair(x, y, ["cknna"], k=k)["cknna"]


def jackknife_replicates(xs: Sequence[Any], ys: Sequence[Any], pairs: Iterable[tuple[int, int]], groups: int,
                         measures: Iterable[str] = MEASURES, k: int = 10, rsa_images: int | None = None,
                         alphas: Sequence[float] = (0.0, 0.5, 1.0), ridge: float = 1e-3, reverse: Iterable[str] = ()
                         ) -> dict[tuple[int, int], dict[str, list[float]]]:
    """The measures of each ``(i, j)`` of ``pairs`` (``xs[i]`` against ``ys[j]``, matrices of the same n examples)
    computed again without each of ``groups`` groups of examples: example r is in group ``r % groups`` (deal the
    rows in a random order beforehand for random groups). The RDM keeps the first ``rsa_images`` examples that are
    left. A matrix is prepared once per group for all the pairs it is in. Returns {pair: {metric: [the value
    without group g for g in 0..groups-1]}}, for `jackknife_interval`."""
    pairs = list(dict.fromkeys((int(i), int(j)) for i, j in pairs))
    measures, reverse = _check_measures(measures), list(reverse)
    n = len(xs[pairs[0][0]]) if pairs else 0
    out: dict[tuple[int, int], dict[str, list[float]]] = {pair: {} for pair in pairs}
    rows_a, rows_b = sorted({i for i, _ in pairs}), sorted({j for _, j in pairs})
    m_rsa = n if rsa_images is None else min(int(rsa_images), n)
    mats = {("x", i): _matrix(xs[i], f"x{i}") for i in rows_a} | {("y", j): _matrix(ys[j], f"y{j}") for j in rows_b}
    neighbours = [m for m in measures if m in ("mutual_knn", "cknna")]
    rest = [m for m in measures if m not in neighbours]
    # each matrix's neighbour lists once, long enough that a group's deletion leaves k in nearly every row
    lists = {key: _long_lists(a, k, groups) for key, a in mats.items()} if neighbours else {}
    for g in range(groups):
        keep = np.flatnonzero(np.arange(n) % groups != g)
        kw = dict(k=k, rsa_images=int((keep < m_rsa).sum()))

        def prep(key: tuple[str, int], keep: np.ndarray = keep, kw: dict = kw) -> Prepared:
            p = prepare(mats[key][keep], rest, name=f"{key[0]}{key[1]}", **kw) if rest else Prepared(n=len(keep))
            if neighbours:
                _check_k(k, len(keep))
                p.knn, p.knn_sim = _lists_without(*lists[key], keep, k)
            return p

        # a replicate's products of n rows at float32 (`Prepared.single`): replicates differ from each other by
        # about the stderr / sqrt(groups) (1e-3 and more), the products' rounding by about 1e-6
        pa = [prep(("x", i)).single() for i in rows_a]
        pb = [prep(("y", j)).single() for j in rows_b]
        got = compare_grid(pa, pb, [(rows_a.index(i), rows_b.index(j)) for i, j in pairs], measures, alphas=alphas,
                           ridge=ridge, reverse=reverse)
        for i, j in pairs:
            for metric, v in got[rows_a.index(i), rows_b.index(j)].items():
                out[i, j].setdefault(metric, []).append(v)
    return out


def _long_lists(a: np.ndarray, k: int, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_neighbour_lists` about twice as long as k plus what a group's deletion takes from a list."""
    return _neighbour_lists(a, min(a.shape[0] - 1, 2 * int(np.ceil(k * groups / max(groups - 1, 1))) + 8))


def _lists_without(z: np.ndarray, idx: np.ndarray, sim: np.ndarray, keep: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest neighbours among the rows ``keep`` (sorted) of each of them, numbered among them: the
    first k kept entries of its long list (`_long_lists`). Deleting rows keeps the order of the others and their
    column order, which breaks ties, so these are the lists `prepare` finds on ``z[keep]``; a row left with fewer
    than k kept entries is searched again."""
    new = np.full(z.shape[0], -1)
    new[keep] = np.arange(len(keep))
    cand = new[idx[keep]]
    ok = cand >= 0
    take = ok & (np.cumsum(ok, axis=1) <= k)
    short = take.sum(1) < k
    knn = np.empty((len(keep), k), dtype=idx.dtype)
    knn_sim = np.empty((len(keep), k))
    full = ~short
    knn[full] = cand[full][take[full]].reshape(-1, k)
    knn_sim[full] = sim[keep][full][take[full]].reshape(-1, k)
    for r in np.flatnonzero(short):  # rare: most of its list was deleted
        row = _cosines(z[keep[r]], z[keep])
        row[r] = -np.inf
        knn[r] = _top_k(row[None, :], k)[0]
        knn_sim[r] = row[knn[r]]
    return knn, knn_sim


def jackknife_interval(value: float, replicates: Sequence[float], bounds: tuple[float, float] = (-np.inf, np.inf),
                       level: float = 0.95) -> tuple[float, float, float]:
    """``(stderr, low, high)`` of a delete-a-group jackknife: ``replicates`` are the statistic computed without
    each of G groups; ``stderr² = (G - 1) / G · Σ (v_g - mean v)²`` (Efron & Stein: it overstates the variance
    rather than understates it) and ``value ± t(G - 1) · stderr``, clipped to ``bounds``. NaN without two
    finite replicates."""
    v = np.asarray(replicates, dtype=np.float64)
    g = len(v)
    if g < 2 or not np.isfinite(v).all() or not np.isfinite(value):
        return (float("nan"),) * 3
    se = float(np.sqrt((g - 1) / g * ((v - v.mean()) ** 2).sum()))
    half = t_quantile(g - 1, level) * se
    return se, float(max(value - half, bounds[0])), float(min(value + half, bounds[1]))
