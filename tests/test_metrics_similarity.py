"""Similarity measures beyond CKA, each against an independent implementation from the papers' formulas (and
rsatoolbox where it is installed), and their invariances."""

import itertools

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from vitscope.errors import VitscopeError
from vitscope.metrics import similarity as S


def _data(n=40, d=6, e=5, seed=0, noise=0.5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) + rng.standard_normal(d)
    y = x[:, :e] @ rng.standard_normal((e, e)) + noise * rng.standard_normal((n, e))
    return x, y


def _unit(a):
    c = a - a.mean(0)
    return c / np.linalg.norm(c)


def _pad(a, d):
    return np.hstack([a, np.zeros((a.shape[0], d - a.shape[1]))])


def _ref_cca(x, y):
    """Canonical correlations: singular values of the whitened cross-covariance C_xx^-1/2 C_xy C_yy^-1/2."""
    xc, yc = x - x.mean(0), y - y.mean(0)

    def inv_sqrt(c):
        w, v = np.linalg.eigh(c)
        return v @ np.diag(w ** -0.5) @ v.T

    m = inv_sqrt(xc.T @ xc) @ xc.T @ yc @ inv_sqrt(yc.T @ yc)
    return np.linalg.svd(m, compute_uv=False)


def test_procrustes_equals_scipy_orthogonal_procrustes():
    x, y = _data()
    xu, yu = _unit(x), _pad(_unit(y), x.shape[1])
    r, _ = scipy.linalg.orthogonal_procrustes(yu, xu)
    assert S.procrustes_distance(x, y) == pytest.approx(np.linalg.norm(xu - yu @ r), rel=1e-9)


def _netrep_angular(x, y, alpha):
    """netrep's LinearMetric (zero padding, partial whitening preserving variance, Procrustes rotation, angle)
    written out, on unit-norm centred inputs."""
    d = max(x.shape[1], y.shape[1])
    xs, ys = _pad(_unit(x), d), _pad(_unit(y), d)

    def whiten(a):
        if alpha == 1:
            return a
        lam, v = np.linalg.eigh(a.T @ a)
        lam = np.maximum(lam, 1e-7)
        w = alpha + (1 - alpha) * lam ** -0.5
        return a @ (v * w) @ v.T

    xw, yw = whiten(xs), whiten(ys)
    u, _, vt = np.linalg.svd(xw.T @ yw)
    a, b = xw @ u, yw @ vt.T
    return np.arccos(np.clip((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)), -1, 1))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_angular_shape_metric_equals_netrep_formula(alpha):
    x, y = _data(d=5, e=5)
    assert S.angular_shape_metric(x, y, alpha) == pytest.approx(_netrep_angular(x, y, alpha), abs=1e-9)


def test_angular_shape_alpha_ends_are_cca_and_procrustes():
    x, y = _data(d=5, e=5)
    rho = _ref_cca(x, y)
    assert S.angular_shape_metric(x, y, 0.0) == pytest.approx(np.arccos(rho.sum() / 5), abs=1e-9)
    p = S.procrustes_distance(x, y)
    assert S.angular_shape_metric(x, y, 1.0) == pytest.approx(np.arccos(1 - p ** 2 / 2), abs=1e-9)


def test_cca_family_against_whitened_cross_covariance():
    x, y = _data()
    rho = _ref_cca(x, y)
    assert S.cca_correlations(x, y) == pytest.approx(np.sort(rho)[::-1], abs=1e-9)
    assert S.mean_cca(x, y) == pytest.approx(rho.mean(), abs=1e-9)


def test_svcca_keeps_directions_holding_the_variance_then_cca():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 8)) * np.array([10, 8, 6, 4, 0.01, 0.01, 0.01, 0.01])
    y = x[:, :6] @ rng.standard_normal((6, 6)) + rng.standard_normal((50, 6))
    ref = []
    for a in (x, y):
        u, s, _ = np.linalg.svd(a - a.mean(0), full_matrices=False)
        kept = np.searchsorted(np.cumsum(s ** 2) / np.sum(s ** 2), 0.99) + 1
        ref.append(u[:, :kept] * s[:kept])
    assert ref[0].shape[1] == 4  # the four large directions carry more than 99 % of x's variance
    assert S.svcca(x, y) == pytest.approx(_ref_cca(*ref).mean(), abs=1e-9)


def test_pwcca_weights_canonical_variates_by_neurons_of_x():
    x, y = _data()
    xc, yc = x - x.mean(0), y - y.mean(0)
    qx, qy = np.linalg.qr(xc)[0], np.linalg.qr(yc)[0]
    a, rho, _ = np.linalg.svd(qx.T @ qy, full_matrices=False)
    h = qx @ a  # canonical variates of x, unit norm
    alpha = np.array([np.abs([h[:, i] @ xc[:, j] for j in range(xc.shape[1])]).sum() for i in range(len(rho))])
    assert S.pwcca(x, y) == pytest.approx((alpha / alpha.sum() * rho).sum(), abs=1e-9)


def test_ridge_r2_equals_an_explicit_leave_one_out_loop():
    x, y = _data(n=30)
    lam = 0.01
    xc, yc = _unit(x), y - y.mean(0)
    sse = 0.0
    for i in range(len(x)):
        keep = np.arange(len(x)) != i
        w = np.linalg.solve(xc[keep].T @ xc[keep] + lam * np.eye(x.shape[1]), xc[keep].T @ yc[keep])
        sse += ((yc[i] - xc[i] @ w) ** 2).sum()
    assert S.ridge_r2(x, y, ridge=lam) == pytest.approx(1 - sse / (yc ** 2).sum(), rel=1e-9)
    assert S.ridge_r2(x, y) > S.ridge_r2(x, np.random.default_rng(9).standard_normal(y.shape))


def _tau_a_loop(a, b):
    s = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in itertools.combinations(range(len(a)), 2))
    return s / (len(a) * (len(a) - 1) / 2)


def test_rsa_spearman_and_kendall_tau_a():
    x, y = _data(n=14)
    rdm = [1 - np.corrcoef(a)[np.triu_indices(14, 1)] for a in (x, y)]
    got = S.rsa(x, y)
    assert got["rsa_spearman"] == pytest.approx(scipy.stats.spearmanr(*rdm).statistic, abs=1e-9)
    assert got["rsa_kendall"] == pytest.approx(_tau_a_loop(*rdm), abs=1e-9)
    ties_a, ties_b = np.array([1, 1, 2, 3, 3, 3, 0, 5.0]), np.array([2, 1, 1, 3, 4, 4, 0, 0.0])
    assert S.kendall_tau_a(ties_a, ties_b) == pytest.approx(_tau_a_loop(ties_a, ties_b), abs=1e-12)


def test_rsa_equals_rsatoolbox():
    rsatoolbox = pytest.importorskip("rsatoolbox")
    x, y = _data(n=12)
    rdms = [rsatoolbox.rdm.calc_rdm(rsatoolbox.data.Dataset(a), method="correlation") for a in (x, y)]
    got = S.rsa(x, y)
    ref_s = rsatoolbox.rdm.compare(rdms[0], rdms[1], method="spearman").item()
    ref_t = rsatoolbox.rdm.compare(rdms[0], rdms[1], method="tau-a").item()
    assert got["rsa_spearman"] == pytest.approx(ref_s, abs=1e-9)
    assert got["rsa_kendall"] == pytest.approx(ref_t, abs=1e-9)


def _knn_brute(a, k):
    z = a / np.linalg.norm(a, axis=1, keepdims=True)
    out = []
    for i in range(len(a)):
        sims = [(z[i] @ z[j], j) for j in range(len(a)) if j != i]
        out.append({j for _, j in sorted(sims, reverse=True)[:k]})
    return out


def test_mutual_knn_by_brute_force_and_its_ends():
    x, y = _data(n=30)
    nx, ny = _knn_brute(x, 5), _knn_brute(y, 5)
    ref = np.mean([len(a & b) / 5 for a, b in zip(nx, ny, strict=True)])
    assert S.mutual_knn(x, y, k=5) == pytest.approx(ref, abs=1e-12)
    assert S.mutual_knn(x, x, k=5) == 1.0
    rng = np.random.default_rng(1)
    n, k = 400, 10
    vals = [S.mutual_knn(rng.standard_normal((n, 20)), rng.standard_normal((n, 20)), k=k) for _ in range(5)]
    # independent neighbourhoods: |N_x ∩ N_y| is hypergeometric with mean k^2 / (n - 1)
    assert np.mean(vals) == pytest.approx(k / (n - 1), rel=0.15)


def _hsic_unbiased_loop(kt, lt):
    n = len(kt)
    return ((kt * lt.T).sum() + kt.sum() * lt.sum() / ((n - 1) * (n - 2)) - 2 / (n - 2) * (kt @ lt).sum()) \
        / (n * (n - 3))


def test_cknna_against_dense_masks():
    x, y = _data(n=30)
    k = 6
    kx = [(x, _knn_brute(x, k)), (y, _knn_brute(y, k))]

    def masked(a, mask_sets):
        z = a / np.linalg.norm(a, axis=1, keepdims=True)
        m = np.zeros((len(a), len(a)))
        for i, js in enumerate(mask_sets):
            m[i, list(js)] = 1
        return m * (z @ z.T)

    inter = [a & b for a, b in zip(kx[0][1], kx[1][1], strict=True)]
    kl = _hsic_unbiased_loop(masked(x, inter), masked(y, inter))
    kk = _hsic_unbiased_loop(masked(x, kx[0][1]), masked(x, kx[0][1]))
    ll = _hsic_unbiased_loop(masked(y, kx[1][1]), masked(y, kx[1][1]))
    assert S.cknna(x, y, k=k) == pytest.approx(kl / np.sqrt(kk * ll), rel=1e-9)
    assert S.cknna(x, x, k=k) == pytest.approx(1.0)


def _all(x, y, k=5):
    out = S.compare(S.prepare(x, k=k), S.prepare(y, k=k), alphas=(0.0, 0.5, 1.0))
    out["ridge_r2_reverse"] = S.ridge_r2(y, x)
    return out


def test_invariances():
    rng = np.random.default_rng(4)
    x, y = _data(n=60, d=6, e=6, seed=4)
    base = _all(x, y)
    q = np.linalg.qr(rng.standard_normal((6, 6)))[0]
    rotated = _all(x @ q * 3.7, y)
    for name, v in base.items():
        if name in ("pwcca", "rsa_spearman", "rsa_kendall"):  # x's neuron basis matters: weights from its
            continue  # neurons; correlation distance centres each image over its neurons
        assert rotated[name] == pytest.approx(v, abs=1e-8), name
    flips = np.diag(rng.choice([-1.0, 1.0], 6))[rng.permutation(6)]
    permuted = _all(x[:, rng.permutation(6)] * 0.2, y)
    for name in ("pwcca", "rsa_spearman", "rsa_kendall"):
        assert permuted[name] == pytest.approx(base[name], abs=1e-9)
        assert abs(rotated[name] - base[name]) > 1e-4, name
    assert _all(x @ flips * 0.2, y)["pwcca"] == pytest.approx(base["pwcca"], abs=1e-9)
    a = rng.standard_normal((6, 6)) + 3 * np.eye(6)  # invertible, far from orthogonal
    linear = _all(x @ a, y)
    for name in ("mean_cca", "angular_shape_alpha=0"):  # SVCCA's truncation reads the variance: not invariant
        assert linear[name] == pytest.approx(base[name], abs=1e-8), name
    for name in ("procrustes", "angular_shape_alpha=1"):
        assert abs(linear[name] - base[name]) > 1e-3, name


def test_identical_features_score_perfectly():
    x, _ = _data(n=50)
    got = _all(x, x)
    assert got["procrustes"] == pytest.approx(0.0, abs=1e-6)
    for a in (0.0, 0.5, 1.0):
        assert got[f"angular_shape_alpha={a:g}"] == pytest.approx(0.0, abs=1e-6)
    for name in ("mean_cca", "svcca", "pwcca", "rsa_spearman", "rsa_kendall", "mutual_knn", "cknna"):
        assert got[name] == pytest.approx(1.0, abs=1e-9), name


def test_permuted_prepared_equals_prepared_permuted():
    x, y = _data(n=30)
    perm = np.random.default_rng(2).permutation(30)
    py = S.prepare(y, k=4)
    a = S.compare(S.prepare(x, k=4), py.permuted(perm))
    b = S.compare(S.prepare(x, k=4), S.prepare(y[perm], k=4))
    assert a.keys() == b.keys()
    moved, fresh = py.permuted(perm), S.prepare(y[perm], k=4)
    np.testing.assert_allclose(moved.rdm, fresh.rdm, atol=1e-12)
    np.testing.assert_array_equal(moved.rdm_ranks, scipy.stats.rankdata(moved.rdm))  # the ranks moved with them
    for name in a:
        assert a[name] == pytest.approx(b[name], abs=1e-9), name


def test_torch_input_and_bad_inputs_are_one_sentence():
    x, y = _data(n=20)
    assert S.mean_cca(torch.from_numpy(x).float(), y) == pytest.approx(S.mean_cca(x.astype(np.float32), y))
    with pytest.raises(VitscopeError, match="same examples"):
        S.mean_cca(x, y[:10])
    with pytest.raises(VitscopeError, match="non-finite"):
        S.mean_cca(np.full((5, 3), np.nan), y[:5])
    with pytest.raises(VitscopeError, match="unknown similarity measure 'cca2'"):
        S.prepare(x, ["cca2"])
    with pytest.raises(VitscopeError, match="alpha"):
        S.angular_shape_metric(x, y, 2.0)
    with pytest.raises(VitscopeError, match="k = 30"):
        S.mutual_knn(x, y, k=30)


@pytest.mark.parametrize("n, d", [(30, 45), (90, 12)])  # fewer examples than channels, and more
def test_compare_grid_equals_the_pairwise_compare_it_replaced(n, d):
    from similarity_before import compare_before

    rng = np.random.default_rng(n)
    base = rng.standard_normal((n, d)) * np.linspace(2.0, 0.1, d)
    layers_a = [base + s * rng.standard_normal((n, d)) for s in (0.1, 1.0, 3.0)]
    layers_b = [base[:, :d - 3] @ rng.standard_normal((d - 3, d - 3)) + rng.standard_normal((n, d - 3)),
                rng.standard_normal((n, d + 2)), layers_a[0]]  # related, independent, identical
    pa, pb = [S.prepare(x, k=5, rsa_images=20) for x in layers_a], [S.prepare(y, k=5, rsa_images=20) for y in layers_b]
    pairs = [(0, 0), (0, 2), (1, 1), (2, 0), (2, 2), (1, 0)]
    alphas = (0.0, 0.3, 1.0)
    got = S.compare_grid(pa, pb, pairs, alphas=alphas, ridge=1e-2, reverse=["ridge_r2", "pwcca"])
    assert list(got) == pairs
    for i, j in pairs:
        want = compare_before(pa[i], pb[j], alphas=alphas, ridge=1e-2)
        back = compare_before(pb[j], pa[i], ["ridge_r2", "pwcca"], ridge=1e-2)
        want.update({f"{m}_reverse": v for m, v in back.items()})
        assert set(got[i, j]) == set(want)
        for name, v in want.items():
            # the distances near 0 are arccos / sqrt of 1 - 1e-16 rounding: about 1.5e-8 either way
            tol = 1e-7 if name.startswith(("procrustes", "angular")) else 1e-11
            assert got[i, j][name] == pytest.approx(v, rel=1e-9, abs=tol), (i, j, name)
    # a grid wider than one product's columns: the chunks give the same numbers
    wide = S.compare_grid(pa, pb * 40, [(0, j) for j in range(120)], ["ridge_r2", "mean_cca"], reverse=["ridge_r2"])
    for j in range(120):
        want = compare_before(pa[0], pb[j % 3], ["ridge_r2", "mean_cca"])
        assert wide[0, j]["ridge_r2"] == pytest.approx(want["ridge_r2"], rel=1e-9)
        assert wide[0, j]["mean_cca"] == pytest.approx(want["mean_cca"], rel=1e-9)
        assert wide[0, j]["ridge_r2_reverse"] == pytest.approx(S.ridge_r2(layers_b[j % 3], layers_a[0]), rel=1e-9)
    with pytest.raises(VitscopeError, match="asymmetric"):
        S.compare_grid(pa, pb, [(0, 0)], reverse=["mean_cca"])


def test_top_k_equals_the_first_k_of_a_stable_sort_with_ties():
    rng = np.random.default_rng(7)
    for trial in range(60):
        n = int(rng.integers(5, 50))
        k = int(rng.integers(1, n))
        sim = rng.integers(0, 3, (n, n)).astype(float) if trial % 2 else rng.standard_normal((n, n))
        np.fill_diagonal(sim, -np.inf)
        assert np.array_equal(S._top_k(sim, k), np.argsort(-sim, axis=1, kind="stable")[:, :k]), trial


def test_neighbour_lists_from_float32_candidates_equal_a_float64_stable_sort(monkeypatch):
    """The float32 candidate search against a plain float64 search (every cosine by the same summation, a
    stable sort): random rows, duplicated rows (exact ties), pairs of rows 1e-9 apart and a cluster of rows
    1e-9 apart (more near-ties than candidates: float32 cannot order them, the rows are searched again at
    float64), across widths where the candidates cover every row or not."""
    rng = np.random.default_rng(11)
    searched_again = []
    cosines = S._cosines
    monkeypatch.setattr("vitscope.metrics.similarity.prepared._cosines",  # where `_neighbour_lists` reads it
                        lambda r, o: (searched_again.append(r.ndim == 1), cosines(r, o))[1])
    for t in range(40):
        n, d = int(rng.integers(12, 300)), int(rng.integers(2, 80))
        length = int(rng.integers(1, min(40, n - 1)))
        a = rng.standard_normal((n, d))
        dup = rng.choice(n, size=n // 4, replace=False)
        if t % 4 == 1:
            a[dup] = a[dup[::-1]]  # exact ties
        elif t % 4 == 2:
            a[dup] = a[dup[::-1]] + 1e-9 * rng.standard_normal((len(dup), d))  # below float32's resolution
        elif t % 4 == 3:
            a[dup] = a[dup[0]] + 1e-9 * rng.standard_normal((len(dup), d))
        z, idx, sim = S._neighbour_lists(a, length)
        full = np.stack([cosines(z[r], z) for r in range(n)])
        np.fill_diagonal(full, -np.inf)
        want = np.argsort(-full, axis=1, kind="stable")[:, :length]
        np.testing.assert_array_equal(idx, want, err_msg=str(t))
        np.testing.assert_array_equal(sim, np.take_along_axis(full, want, axis=1), err_msg=str(t))
    assert any(searched_again)  # the float64 fallback was exercised


def test_a_jackknife_replicate_s_neighbour_lists_are_those_of_a_fresh_search_ties_included():
    """`_lists_without` (the long lists filtered) against `prepare` on the kept rows, on tied and untied data,
    with groups large enough that some rows lose most of their list and are searched again."""
    rng = np.random.default_rng(2)
    for t in range(24):
        n, d = int(rng.integers(20, 200)), int(rng.integers(2, 12))
        k, groups = int(rng.integers(1, min(12, n // 3))), int(rng.integers(2, 8))
        a = rng.integers(-2, 3, size=(n, d)).astype(float) if t % 2 else rng.standard_normal((n, d))
        a[np.linalg.norm(a, axis=1) == 0, 0] = 1.0
        lists = S._long_lists(a, k, groups)
        for g in range(groups):
            keep = np.flatnonzero(np.arange(n) % groups != g)
            knn, knn_sim = S._lists_without(*lists, keep, k)
            fresh = S.prepare(a[keep], ["mutual_knn"], k=k)
            np.testing.assert_array_equal(knn, fresh.knn)
            np.testing.assert_allclose(knn_sim, fresh.knn_sim, rtol=1e-12)


def test_float32_bases_for_nulls_give_every_measure_within_1e_5_of_float64():
    """`Prepared.single` (the permutation nulls' bases): the same scores as the float64 bases to a few digits."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 40)) * (np.arange(40) + 1.0) ** -0.5
    y = x @ rng.standard_normal((40, 50)) + rng.standard_normal((300, 50))
    px, py = S.prepare(x, rsa_images=60), S.prepare(y, rsa_images=60)
    for p in range(3):
        perm = np.concatenate([rng.permutation(60), 60 + rng.permutation(240)]) if p else np.arange(300)
        exact = S.compare_grid([px], [py.permuted(perm)], [(0, 0)], reverse=S.ASYMMETRIC)[0, 0]
        fast = S.compare_grid([px.single()], [py.single().permuted(perm)], [(0, 0)], reverse=S.ASYMMETRIC)[0, 0]
        assert fast.keys() == exact.keys()
        for m in exact:
            assert fast[m] == pytest.approx(exact[m], abs=1e-5), m
