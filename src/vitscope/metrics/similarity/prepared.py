"""The per-matrix part of the similarity measures (`vitscope.metrics.similarity`): `Prepared` and `prepare` (the SVD,
the k nearest neighbours, the RDM), the float32-candidate neighbour search and the decompositions they use."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import scipy.stats

from vitscope.errors import VitscopeError

#: measures computed from the SVD of each matrix
LINEAR_MEASURES = ("procrustes", "angular_shape", "mean_cca", "svcca", "pwcca", "ridge_r2", "subspace_similarity")
#: every measure `compare` knows; ``rsa`` gives ``rsa_spearman`` and ``rsa_kendall``, ``ridge_r2`` X -> Y
MEASURES = (*LINEAR_MEASURES, "rsa", "mutual_knn", "cknna")
#: measures computed only when asked for by name (the similarity analysis' ``measures``, `compare`'s): the
#: subspace similarity came after the others; opt-in, the tables and cache entries of the default stay as they were
OPT_IN = ("subspace_similarity",)
#: the measures computed when none are named
DEFAULT_MEASURES = tuple(m for m in MEASURES if m not in OPT_IN)
#: leading principal directions the subspace similarity compares by default (Ramasesh et al. 2021's k is a choice
#: of the analyst; 10 is also the neighbours' default k here)
SUBSPACE_K = 10
#: where the subspace similarity takes its principal directions: 'features' (Ramasesh et al. 2021: the top-k
#: eigenvectors of the feature covariance, the right singular vectors; layers of the same width only), 'images' (the
#: left singular vectors, the principal components' scores over the examples: any widths), 'auto' (features where
#: the two widths are equal, images otherwise; `subspace_space_of`)
SUBSPACE_SPACES = ("auto", "features", "images")

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
    vt: np.ndarray | None = None  # (r, d) right singular vectors (feature-space principal directions)
    keep_svcca: int = 0  # leading directions SVCCA keeps
    keep_subspace: int = 0  # leading directions the subspace similarity compares: min(subspace_k, rank)
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


def prepare(x: Any, measures: Iterable[str] = DEFAULT_MEASURES, k: int = 10, keep: float = 0.99,
            rsa_images: int | None = None, name: str = "x", subspace_k: int = SUBSPACE_K) -> Prepared:
    """The per-matrix part of ``measures`` for ``x`` (n, d): the SVD for the linear family (its ``subspace_k``
    leading directions for the subspace similarity, fewer where the numerical rank is lower), the ``k`` nearest
    neighbours for mutual k-NN and CKNNA, the RDM of the first ``rsa_images`` examples (all if None) for RSA."""
    measures = _check_measures(measures)
    if int(subspace_k) < 1:
        raise FeatureError(f"the subspace similarity needs subspace_k >= 1 principal directions, got {subspace_k}")
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
        p.keep_subspace = min(int(subspace_k), r)
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


def subspace_space_of(space: str, px: Prepared, py: Prepared) -> str:
    """The space ('features' or 'images') the subspace similarity of ``px`` and ``py`` uses for ``space``: 'auto'
    is 'features' where the two matrices have the same width (their feature coordinates can be the same ones, as
    for one network before and after fine-tuning), 'images' otherwise (the only variant defined across widths)."""
    if space not in SUBSPACE_SPACES:
        raise FeatureError(f"subspace_space must be one of {', '.join(SUBSPACE_SPACES)}, got {space!r}")
    if px.vt is None or py.vt is None:
        raise FeatureError("compare: the subspace similarity needs both matrices prepared with it")
    same = px.vt.shape[1] == py.vt.shape[1]
    if space == "features" and not same:
        raise FeatureError(f"the feature-space subspace similarity needs matrices of the same width, got "
                           f"{px.vt.shape[1]} and {py.vt.shape[1]} (use subspace_space 'images' or 'auto')")
    if space == "auto":
        return "features" if same else "images"
    return space


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
