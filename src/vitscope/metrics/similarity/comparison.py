"""The pair part of the similarity measures (`vitscope.metrics.similarity`, whose docstring holds the math):
`compare` and `compare_grid` on prepared matrices, the per-measure computations, and the pairwise functions
on two feature matrices (`compare(prepare(x), prepare(y))`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
import scipy.stats

from vitscope.metrics.similarity.prepared import (
    DEFAULT_MEASURES,
    EIGVAL_TOL,
    LINEAR_MEASURES,
    SUBSPACE_SPACES,
    FeatureError,
    Prepared,
    _check_measures,
    _svals,
    prepare,
    subspace_space_of,
)


def compare(px: Prepared, py: Prepared, measures: Iterable[str] = DEFAULT_MEASURES,
            alphas: Sequence[float] = (0.0, 0.5, 1.0), ridge: float = 1e-3,
            subspace_space: str = "auto") -> dict[str, float]:
    """{name: value} of ``measures`` between two prepared matrices of the same examples. Names: ``procrustes``,
    ``angular_shape_alpha=<a>`` per alpha, ``mean_cca``, ``svcca``, ``pwcca``, ``ridge_r2`` (X predicts Y),
    ``rsa_spearman``, ``rsa_kendall``, ``mutual_knn``, ``cknna``, ``subspace_similarity`` (opt-in: named; its
    directions in ``subspace_space``, `subspace_space_of`)."""
    return compare_grid([px], [py], [(0, 0)], measures, alphas, ridge, subspace_space=subspace_space)[0, 0]


#: the range of each measure's values (the base name: ``angular_shape`` for every alpha); intervals are clipped to it
RANGES = {"procrustes": (0.0, float(np.sqrt(2.0))), "angular_shape": (0.0, float(np.pi / 2)), "mean_cca": (0.0, 1.0),
          "svcca": (0.0, 1.0), "pwcca": (0.0, 1.0), "ridge_r2": (-np.inf, 1.0), "rsa_spearman": (-1.0, 1.0),
          "rsa_kendall": (-1.0, 1.0), "mutual_knn": (0.0, 1.0), "cknna": (-np.inf, np.inf),
          "subspace_similarity": (0.0, 1.0)}


def range_of(metric: str) -> tuple[float, float]:
    """The range of a table's ``metric`` (``angular_shape_alpha=0.5``, ``ridge_r2_reverse``, ...)."""
    return RANGES[metric.split("_alpha=")[0].removesuffix("_reverse")]


#: measures whose value changes when x and y swap: `compare_grid` gives them as ``<name>_reverse`` too (CKNNA:
#: its masked kernels are not symmetric matrices, so the unbiased HSIC's 1ᵀK̃L̃1 term changes with the order)
ASYMMETRIC = ("pwcca", "ridge_r2", "cknna")
GRID_COLUMNS = 2048  # columns of the stacked targets in one product (n x 2048 float64: 32 MB at n = 2000)


def compare_grid(pa: Sequence[Prepared], pb: Sequence[Prepared], pairs: Iterable[tuple[int, int]],
                 measures: Iterable[str] = DEFAULT_MEASURES, alphas: Sequence[float] = (0.0, 0.5, 1.0),
                 ridge: float = 1e-3, reverse: Iterable[str] = (), subspace_space: str = "auto"
                 ) -> dict[tuple[int, int], dict[str, float]]:
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
    if subspace_space not in SUBSPACE_SPACES:
        raise FeatureError(f"subspace_space must be one of {', '.join(SUBSPACE_SPACES)}, got {subspace_space!r}")
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
            out[i, j].update(_linear(pa[i], pb[j], m, measures, [float(a) for a in alphas], reverse,
                                     subspace_space))
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
    for m in ("procrustes", "angular_shape", "mean_cca", "pwcca", "svcca", "ridge_r2", "subspace_similarity", "rsa",
              "mutual_knn", "cknna"):
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
            reverse: list[str], subspace_space: str = "auto") -> dict[str, float]:
    """The linear measures but ridge from the cross product ``cross = U_xᵀ U_y`` (and the right singular vectors
    for the feature-space subspace similarity)."""
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
    if "subspace_similarity" in measures:
        out["subspace_similarity"] = _subspace(px, py, cross, subspace_space)
    return out


def _subspace(px: Prepared, py: Prepared, cross: np.ndarray, space: str = "auto") -> float:
    """Subspace similarity (Ramasesh et al. 2021) of the two matrices' leading principal directions,
    ``|A_kᵀ B_k|_F² / k`` of the ``keep_subspace`` leading ones of each (descending singular values), in ``space``
    (`subspace_space_of`): 'images', the left singular vectors (a block of ``cross = U_xᵀ U_y``); 'features',
    Ramasesh et al.'s, the right singular vectors (the top eigenvectors of the centred feature covariance, ``V_xᵀ
    V_y`` of the same width). The mean squared cosine of the principal angles: 1 for the same subspace, 0 for
    orthogonal ones. Where a matrix has fewer than k directions (its rank), the larger of the two counts divides, so
    that only equal subspaces of equal dimension score 1."""
    ka, kb = px.keep_subspace, py.keep_subspace
    if not ka or not kb:
        raise FeatureError("compare: the subspace similarity needs both matrices prepared with it")
    if subspace_space_of(space, px, py) == "features":
        block = px.vt[:ka].astype(np.float64) @ py.vt[:kb].astype(np.float64).T
    else:
        block = cross[:ka, :kb]
    return float(np.clip(np.einsum("ij,ij->", block, block) / max(ka, kb), 0.0, 1.0))


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
    prep = {k: kw.pop(k) for k in ("k", "keep", "rsa_images", "subspace_k") if k in kw}
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


def subspace_similarity(x: Any, y: Any, k: int = 10, space: str = "auto") -> float:
    """Ramasesh et al. 2021's subspace similarity of the top-``k`` principal subspaces of x and y (columns
    centred), in [0, 1], 1 for the same subspace. ``space`` 'features': Ramasesh et al.'s, the top-k eigenvectors
    of the feature covariances (x and y of the same width, their columns the same coordinates: one network before
    and after training); 'images': the principal components' scores over the examples, so that x and y may differ
    in width (about k / (n - 1) for unrelated features); 'auto': features at equal widths, images otherwise
    (`_subspace`)."""
    return _pair(x, y, ["subspace_similarity"], subspace_k=k, subspace_space=space)["subspace_similarity"]
