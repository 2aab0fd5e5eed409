"""The pairwise `compare` of `vitscope.metrics.similarity` as it was before `compare_grid` (commit b73785d):
one pair at a time, its own eigendecompositions and ridge product. The fast grid is tested against it."""

from collections.abc import Iterable, Sequence

import numpy as np

from vitscope.metrics.similarity import (
    LINEAR_MEASURES,
    MEASURES,
    FeatureError,
    Prepared,
    _angular,
    _check_measures,
    _cknna,
    _pearson,
    _svals,
    kendall_tau_a,
)


def compare_before(px: Prepared, py: Prepared, measures: Iterable[str] = MEASURES,
                   alphas: Sequence[float] = (0.0, 0.5, 1.0), ridge: float = 1e-3) -> dict[str, float]:
    """{name: value} of ``measures`` between two prepared matrices of the same examples. Names: ``procrustes``,
    ``angular_shape_alpha=<a>`` per alpha, ``mean_cca``, ``svcca``, ``pwcca``, ``ridge_r2`` (X predicts Y),
    ``rsa_spearman``, ``rsa_kendall``, ``mutual_knn``, ``cknna``."""
    measures = _check_measures(measures)
    if px.n != py.n:
        raise FeatureError(f"x and y must hold the same examples: got n = {px.n} and n = {py.n}")
    out: dict[str, float] = {}
    if any(m in LINEAR_MEASURES for m in measures):
        if px.u is None or py.u is None:
            raise FeatureError("compare: a matrix was prepared without the linear measures")
        cross = px.u.T @ py.u  # (rx, ry)
        rho = None  # canonical correlations, computed once for the measures that share them
        if "mean_cca" in measures or "pwcca" in measures or ("angular_shape" in measures and 0.0 in alphas):
            rho = np.clip(_svals(cross), 0.0, 1.0)
        if "procrustes" in measures or ("angular_shape" in measures and 1.0 in alphas):
            nuc1 = _svals(px.s[:, None] * cross * py.s[None, :]).sum()  # |XᵀY|_*, both at unit norm
            if "procrustes" in measures:
                out["procrustes"] = float(np.sqrt(max(0.0, 2.0 - 2.0 * min(nuc1, 1.0))))
        if "angular_shape" in measures:
            for a in alphas:
                known = nuc1 if float(a) == 1.0 else rho.sum() if float(a) == 0.0 else None
                out[f"angular_shape_alpha={float(a):g}"] = _angular(px, py, cross, float(a), known)
        if "mean_cca" in measures:
            out["mean_cca"] = float(rho.mean())
        if "pwcca" in measures:
            # canonical directions of x: eigenvectors of cross crossᵀ, the largest min(rx, ry) eigenvalues
            lam, ua = np.linalg.eigh(cross @ cross.T)
            c = min(cross.shape)
            ua, rho_w = ua[:, ::-1][:, :c], np.sqrt(np.clip(lam[::-1][:c], 0.0, 1.0))
            # <h_i, x_j> for the canonical variates h = U_x a_i and the neurons x_j (columns of U_x S V_xᵀ)
            w = np.abs((ua.T * px.s[None, :]) @ px.vt).sum(1)
            out["pwcca"] = float((w * rho_w).sum() / w.sum())
        if "svcca" in measures:
            rho_k = _svals(cross[:px.keep_svcca, :py.keep_svcca])
            out["svcca"] = float(np.clip(rho_k, 0.0, 1.0).mean())
        if "ridge_r2" in measures:
            out["ridge_r2"] = _ridge_loo_r2(px, py, cross, float(ridge))
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
    return out


def _ridge_loo_r2(px: Prepared, py: Prepared, cross: np.ndarray, ridge: float) -> float:
    f = px.s ** 2 / (px.s ** 2 + ridge)  # shrinkage of each direction of X (total variance 1)
    h = (px.u ** 2) @ f  # the hat matrix's diagonal
    resid = py.u * py.s[None, :] - px.u @ (f[:, None] * cross * py.s[None, :])  # (I - H) Y in Y's basis
    loo = resid / np.maximum(1.0 - h, 1e-12)[:, None]
    return float(1.0 - (loo ** 2).sum() / (py.s ** 2).sum())
