"""Tests for vitscope.metrics.cka against independent, slow loop references written in this file."""

import math
import statistics

import numpy as np
import pytest
import torch

from vitscope.metrics import cka as C

ESTIMATORS = ("minibatch", "linear", "rbf")


# ----------------------------------------------------------------------------------------------------------
# Independent references: explicit Python loops / textbook matrix formulas, numpy float64
# ----------------------------------------------------------------------------------------------------------


def ref_hsic1(K: np.ndarray, L: np.ndarray) -> float:
    """HSIC_1 written literally with Python loops over i, j (k)."""
    K = np.asarray(K, dtype=np.float64).tolist()
    L = np.asarray(L, dtype=np.float64).tolist()
    n = len(K)
    Kt = [[0.0 if i == j else K[i][j] for j in range(n)] for i in range(n)]
    Lt = [[0.0 if i == j else L[i][j] for j in range(n)] for i in range(n)]
    trace = 0.0
    for i in range(n):
        for j in range(n):
            trace += Kt[i][j] * Lt[j][i]
    sum_k = 0.0
    sum_l = 0.0
    for i in range(n):
        for j in range(n):
            sum_k += Kt[i][j]
            sum_l += Lt[i][j]
    one_kl_one = 0.0
    for i in range(n):
        for j in range(n):
            for k in range(n):
                one_kl_one += Kt[i][j] * Lt[j][k]
    return (trace + sum_k * sum_l / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * one_kl_one) / (n * (n - 3))


def ref_gram(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    return x @ x.T


def ref_minibatch_cka(x: np.ndarray, y: np.ndarray, batch_size: int, weights: str = "equal") -> float:
    """Minibatch CKA from per-batch loop HSIC_1 values (last batch kept if it has >= 4 examples)."""
    n = len(x)
    num, sxx, syy, wsum = 0.0, 0.0, 0.0, 0.0
    for s in range(0, n, batch_size):
        e = min(s + batch_size, n)
        if e - s < 4:
            continue
        K, L = ref_gram(x[s:e]), ref_gram(y[s:e])
        w = 1.0 if weights == "equal" else float(e - s)
        num += w * ref_hsic1(K, L)
        sxx += w * ref_hsic1(K, K)
        syy += w * ref_hsic1(L, L)
        wsum += w
    return (num / wsum) / math.sqrt((sxx / wsum) * (syy / wsum))


def ref_biased_cka(K: np.ndarray, L: np.ndarray) -> float:
    """tr(KHLH) / sqrt(tr(KHKH) tr(LHLH)) with the centring matrix H = I - 11ᵀ/n."""
    n = len(K)
    H = np.eye(n) - np.ones((n, n)) / n
    return np.trace(K @ H @ L @ H) / math.sqrt(np.trace(K @ H @ K @ H) * np.trace(L @ H @ L @ H))


def ref_rbf_gram(x: np.ndarray, sigma_frac: float) -> np.ndarray:
    """RBF Gram with sigma = sigma_frac * median distance over pairs i < j, by loops."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    n = len(x)
    d = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            d[i, j] = math.sqrt(sum((a - b) ** 2 for a, b in zip(x[i], x[j], strict=True)))
    sigma = sigma_frac * statistics.median(d[i, j] for i in range(n) for j in range(i + 1, n))
    return np.exp(-(d**2) / (2 * sigma**2))


def random_orthogonal(rng: np.random.Generator, d: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def correlated_pair(rng: np.random.Generator, n: int, dx: int, dy: int, noise: float):
    x = rng.standard_normal((n, dx))
    y = x @ rng.standard_normal((dx, dy)) / math.sqrt(dx) + noise * rng.standard_normal((n, dy))
    return x, y


# ----------------------------------------------------------------------------------------------------------
# hsic1 / hsic1_cross / cka_from_grams
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 7, 10, 12])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hsic1_matches_loop_reference(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    # linear Grams of features with a non-zero mean
    K = ref_gram(rng.standard_normal((n, 5)) + 2.0)
    L = ref_gram(rng.standard_normal((n, 9)))
    got = C.hsic1(torch.from_numpy(K), torch.from_numpy(L))
    assert got.dtype == torch.float64 and got.shape == ()
    assert float(got) == pytest.approx(ref_hsic1(K, L), rel=1e-10, abs=1e-12)
    # general (non-symmetric) matrices: the trace and 1ᵀK̃L̃1 must be computed exactly
    A, B = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    assert float(C.hsic1(torch.from_numpy(A), torch.from_numpy(B))) == pytest.approx(
        ref_hsic1(A, B), rel=1e-10, abs=1e-12
    )


def test_hsic1_batched_over_leading_dims_and_float32_input() -> None:
    rng = np.random.default_rng(3)
    n = 9
    K = np.stack([[ref_gram(rng.standard_normal((n, 4))) for _ in range(3)] for _ in range(2)])
    L = np.stack([[ref_gram(rng.standard_normal((n, 6))) for _ in range(3)] for _ in range(2)])
    got = C.hsic1(torch.from_numpy(K).float(), torch.from_numpy(L).float())
    assert got.shape == (2, 3) and got.dtype == torch.float64
    for i in range(2):
        for j in range(3):
            # float32 storage of the Grams: relative precision ~1e-7
            assert float(got[i, j]) == pytest.approx(
                ref_hsic1(K[i, j].astype(np.float32), L[i, j].astype(np.float32)), rel=1e-9, abs=1e-9
            )


def test_hsic1_rejects_too_few_examples_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="n >= 4"):
        C.hsic1(torch.eye(3), torch.eye(3))
    with pytest.raises(ValueError, match="square"):
        C.hsic1(torch.ones(5, 4), torch.ones(5, 4))
    with pytest.raises(ValueError, match="same n"):
        C.hsic1(torch.eye(5), torch.eye(6))


def _random_gram_stack(rng: np.random.Generator, taps: int, batches: int, n: int) -> np.ndarray:
    return np.stack(
        [[ref_gram(rng.standard_normal((n, 3 + t)) + t) for _ in range(batches)] for t in range(taps)]
    )


def test_hsic1_cross_matches_loops_over_pairs() -> None:
    rng = np.random.default_rng(4)
    ga = _random_gram_stack(rng, 3, 4, 9)
    gb = _random_gram_stack(rng, 2, 4, 9)
    got = C.hsic1_cross(torch.from_numpy(ga), torch.from_numpy(gb))
    assert got.shape == (3, 2, 4) and got.dtype == torch.float64
    for a in range(3):
        for c in range(2):
            for b in range(4):
                assert float(got[a, c, b]) == pytest.approx(ref_hsic1(ga[a, b], gb[c, b]), rel=1e-10)


def test_hsic1_cross_is_exact_for_non_symmetric_matrices() -> None:
    # transposes and row- vs column-sums only matter here; must agree with the literal formula and hsic1
    rng = np.random.default_rng(41)
    ga, gb = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((2, 3, 6, 6))
    got = C.hsic1_cross(torch.from_numpy(ga), torch.from_numpy(gb))
    for a in range(2):
        for c in range(2):
            for b in range(3):
                assert float(got[a, c, b]) == pytest.approx(ref_hsic1(ga[a, b], gb[c, b]), rel=1e-10)
    np.testing.assert_allclose(
        got.diagonal(dim1=0, dim2=1).T.numpy(),
        C.hsic1(torch.from_numpy(ga), torch.from_numpy(gb)).numpy(),
        rtol=1e-12,
    )


def test_hsic1_cross_rejects_mismatched_batches() -> None:
    with pytest.raises(ValueError, match="share B and n"):
        C.hsic1_cross(torch.zeros(2, 3, 5, 5), torch.zeros(2, 4, 5, 5))


def _ref_cka_from_grams(ga: np.ndarray, gb: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.zeros((len(ga), len(gb)))
    for a in range(len(ga)):
        for c in range(len(gb)):
            num = sum(w[b] * ref_hsic1(ga[a, b], gb[c, b]) for b in range(len(w))) / w.sum()
            saa = sum(w[b] * ref_hsic1(ga[a, b], ga[a, b]) for b in range(len(w))) / w.sum()
            scc = sum(w[b] * ref_hsic1(gb[c, b], gb[c, b]) for b in range(len(w))) / w.sum()
            out[a, c] = num / math.sqrt(saa * scc)
    return out


def test_cka_from_grams_matches_loops_over_pairs() -> None:
    rng = np.random.default_rng(5)
    ga = _random_gram_stack(rng, 3, 4, 8)
    gb = _random_gram_stack(rng, 2, 4, 8)
    got = C.cka_from_grams(torch.from_numpy(ga), torch.from_numpy(gb))
    assert got.shape == (3, 2)
    np.testing.assert_allclose(got.numpy(), _ref_cka_from_grams(ga, gb, np.ones(4)), rtol=1e-10)

    w = np.array([1.0, 3.0, 0.5, 2.0])
    got_w = C.cka_from_grams(torch.from_numpy(ga), torch.from_numpy(gb), weights=w)
    np.testing.assert_allclose(got_w.numpy(), _ref_cka_from_grams(ga, gb, w), rtol=1e-10)
    assert not np.allclose(got_w.numpy(), got.numpy(), rtol=1e-6)  # weights actually matter


def test_cka_from_grams_without_b_compares_a_with_itself() -> None:
    rng = np.random.default_rng(6)
    ga = torch.from_numpy(_random_gram_stack(rng, 4, 3, 10))
    self_cka = C.cka_from_grams(ga)
    np.testing.assert_allclose(self_cka.numpy(), C.cka_from_grams(ga, ga).numpy(), rtol=1e-12)
    np.testing.assert_allclose(self_cka.numpy(), self_cka.numpy().T, rtol=1e-12)
    np.testing.assert_allclose(np.diag(self_cka.numpy()), np.ones(4), rtol=1e-12)
    with pytest.raises(ValueError, match="weights"):
        C.cka_from_grams(ga, weights=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="weights"):
        C.cka_from_grams(ga, weights=[1.0, 1.0])


def test_cka_from_grams_is_nan_for_constant_features() -> None:
    g = torch.from_numpy(_random_gram_stack(np.random.default_rng(7), 1, 2, 6))
    const = torch.full_like(g, 3.0)  # Gram of a constant feature vector: HSIC_1 = 0
    assert math.isnan(float(C.cka_from_grams(g, const)[0, 0]))


# ----------------------------------------------------------------------------------------------------------
# Batch order, splitting, grouping of unequal batch sizes
# ----------------------------------------------------------------------------------------------------------


def _gram_list(x: np.ndarray, sizes: list[int]) -> list[torch.Tensor]:
    out, s = [], 0
    for size in sizes:
        out.append(torch.from_numpy(ref_gram(x[s : s + size]))[None])
        s += size
    return out


def test_batch_order_and_split_into_halves_do_not_matter() -> None:
    rng = np.random.default_rng(8)
    x, y = correlated_pair(rng, 96, 10, 7, 1.0)
    sizes = [12, 12, 12, 12, 12, 12, 12, 12]
    la, lb = _gram_list(x, sizes), _gram_list(y, sizes)
    whole = float(C.cka_from_gram_list(la, lb)[0, 0])
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    permuted = float(C.cka_from_gram_list([la[i] for i in perm], [lb[i] for i in perm])[0, 0])
    assert permuted == pytest.approx(whole, rel=1e-12)

    # stacked path: per-batch HSICs of the two halves, concatenated, give the same batch average
    ga, gb = torch.stack(la, dim=1), torch.stack(lb, dim=1)
    full = C.hsic1_cross(ga, gb)
    halves = torch.cat([C.hsic1_cross(ga[:, :4], gb[:, :4]), C.hsic1_cross(ga[:, 4:], gb[:, 4:])], dim=-1)
    np.testing.assert_allclose(halves.numpy(), full.numpy(), rtol=1e-12)
    num = halves.mean(-1)
    saa = torch.cat([C.hsic1(ga[:, :4], ga[:, :4]), C.hsic1(ga[:, 4:], ga[:, 4:])], dim=-1).mean(-1)
    sbb = torch.cat([C.hsic1(gb[:, :4], gb[:, :4]), C.hsic1(gb[:, 4:], gb[:, 4:])], dim=-1).mean(-1)
    combined = float(num[0, 0] / torch.sqrt(saa[0] * sbb[0]))
    assert combined == pytest.approx(whole, rel=1e-12)
    assert float(C.cka_from_grams(ga, gb)[0, 0]) == pytest.approx(whole, rel=1e-12)
    assert whole == pytest.approx(ref_minibatch_cka(x, y, 12), rel=1e-10)


def test_gram_list_with_unequal_sizes_matches_reference() -> None:
    rng = np.random.default_rng(9)
    x, y = correlated_pair(rng, 40, 6, 5, 0.7)
    sizes = [7, 10, 7, 5, 10, 1]  # groups n=7, 10, 5 interleaved; the last batch (n=1) is skipped
    la, lb = _gram_list(x, sizes), _gram_list(y, sizes)
    with pytest.warns(UserWarning, match=r"1 of 40 examples"):
        got = C.cka_from_gram_list(la, lb, weights=[1, 2, 3, 4, 5, 6])
    starts = np.cumsum([0] + sizes)
    w = np.array([1, 2, 3, 4, 5], dtype=float)
    Ks = [ref_gram(x[starts[b] : starts[b + 1]]) for b in range(5)]
    Ls = [ref_gram(y[starts[b] : starts[b + 1]]) for b in range(5)]
    num = sum(w[b] * ref_hsic1(Ks[b], Ls[b]) for b in range(5))
    sxx = sum(w[b] * ref_hsic1(Ks[b], Ks[b]) for b in range(5))
    syy = sum(w[b] * ref_hsic1(Ls[b], Ls[b]) for b in range(5))
    assert float(got[0, 0]) == pytest.approx(num / math.sqrt(sxx * syy), rel=1e-10)


def test_gram_list_validation() -> None:
    g5, g6 = torch.eye(5)[None], torch.eye(6)[None]
    with pytest.raises(ValueError, match="empty"):
        C.cka_from_gram_list([])
    with pytest.raises(ValueError, match="minibatches"):
        C.cka_from_gram_list([g5, g5], [g5])
    with pytest.raises(ValueError, match="n=5"):
        C.cka_from_gram_list([g5], [g6])
    with pytest.raises(ValueError, match="taps"):
        C.cka_from_gram_list([g5, torch.eye(5).repeat(2, 1, 1)])
    with pytest.warns(UserWarning, match="3 of 3 examples"), pytest.raises(ValueError, match="no minibatch"):
        C.cka_from_gram_list([torch.eye(3)[None]])


def _ref_cka_loops(Ks: list[list[np.ndarray]], Ls: list[list[np.ndarray]], w: list[float]) -> np.ndarray:
    """CKA matrix from per-tap lists of per-minibatch matrices, by the loop HSIC_1 (NaN for a non-positive
    denominator)."""
    out = np.empty((len(Ks), len(Ls)))
    for a, ks in enumerate(Ks):
        for c, ls in enumerate(Ls):
            num = sum(wb * ref_hsic1(k, l) for wb, k, l in zip(w, ks, ls, strict=True))
            den = sum(wb * ref_hsic1(k, k) for wb, k in zip(w, ks, strict=True)) * sum(
                wb * ref_hsic1(l, l) for wb, l in zip(w, ls, strict=True))
            out[a, c] = num / math.sqrt(den) if den > 0 else math.nan
    return out


def test_cka_from_grams_is_exact_for_non_symmetric_matrices() -> None:
    rng = np.random.default_rng(22)
    sym = _random_gram_stack(rng, 3, 4, 7)
    skew = rng.standard_normal(sym.shape)
    ga = sym + 0.3 * (skew - np.swapaxes(skew, -1, -2))  # K != Kᵀ: tr(K̃L̃) and 1ᵀK̃L̃1 depend on the order
    gb = _random_gram_stack(rng, 2, 4, 7) + 0.2 * rng.standard_normal((2, 4, 7, 7))
    w = [1.0, 2.0, 0.5, 3.0]
    got = C.cka_from_grams(torch.from_numpy(ga), torch.from_numpy(gb), weights=w).numpy()
    expected = _ref_cka_loops([list(k) for k in ga], [list(k) for k in gb], w)
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    self_got = C.cka_from_grams(torch.from_numpy(ga)).numpy()
    np.testing.assert_allclose(self_got, _ref_cka_loops([list(k) for k in ga], [list(k) for k in ga], [1.0] * 4),
                               rtol=1e-9)
    assert not np.allclose(self_got, self_got.T, rtol=1e-6)  # not symmetrised: HSIC_1(K, L) != HSIC_1(L, K) here


def test_gram_streams_match_loop_reference_and_gram_list() -> None:
    rng = np.random.default_rng(23)
    x, y = correlated_pair(rng, 51, 9, 6, 0.8)  # minibatches of 16, 16, 16 and 3 (left out, with a warning)
    taps_a = [x, np.tanh(x @ rng.standard_normal((9, 5)))]
    taps_b = [y, y[:, :3] + 0.5 * rng.standard_normal((51, 3)), x[:, :4] ** 2]
    bounds = [(0, 16), (16, 32), (32, 48), (48, 51)]
    streams_a = [[torch.from_numpy(ref_gram(t[s:e])).float() for s, e in bounds] for t in taps_a]
    streams_b = [[torch.from_numpy(ref_gram(t[s:e])).float() for s, e in bounds] for t in taps_b]
    exact_a = [[g.double().numpy() for g in st[:3]] for st in streams_a]  # the float32 Grams' exact values
    exact_b = [[g.double().numpy() for g in st[:3]] for st in streams_b]
    with pytest.warns(UserWarning, match=r"3 of 51 examples"):
        got = C.cka_from_gram_streams(streams_a, streams_b)
    assert got.shape == (2, 3) and got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), _ref_cka_loops(exact_a, exact_b, [1.0] * 3), rtol=1e-10)
    per_batch_a = [torch.stack(g) for g in zip(*streams_a, strict=True)]
    per_batch_b = [torch.stack(g) for g in zip(*streams_b, strict=True)]
    with pytest.warns(UserWarning):
        np.testing.assert_allclose(got.numpy(), C.cka_from_gram_list(per_batch_a, per_batch_b).numpy(), rtol=1e-12)
    # weights, one per minibatch (the skipped one's is ignored), and a tap set against itself
    w = [1.0, 3.0, 2.0, 5.0]
    with pytest.warns(UserWarning):
        got_w = C.cka_from_gram_streams(streams_a, streams_b, weights=w).numpy()
    np.testing.assert_allclose(got_w, _ref_cka_loops(exact_a, exact_b, w[:3]), rtol=1e-10)
    with pytest.warns(UserWarning):
        self_cka = C.cka_from_gram_streams(streams_b).numpy()
    np.testing.assert_allclose(self_cka, _ref_cka_loops(exact_b, exact_b, [1.0] * 3), rtol=1e-10)
    np.testing.assert_array_equal(self_cka, self_cka.T)


def test_gram_streams_validation() -> None:
    g4, g5 = torch.eye(4), torch.eye(5)
    with pytest.raises(ValueError, match="empty"):
        C.cka_from_gram_streams([])
    with pytest.raises(ValueError, match="minibatches"):
        C.cka_from_gram_streams([[g4, g4]], [[g4]])
    with pytest.raises(ValueError, match="shapes"):
        C.cka_from_gram_streams([[g4, g5], [g4, g4]])
    with pytest.raises(ValueError, match="square"):
        C.cka_from_gram_streams([[torch.zeros(4, 5)]])


@pytest.mark.parametrize("shift", [False, True])
def test_gram_matrix_kernels_match_float64_product(shift: bool) -> None:
    rng = np.random.default_rng(24)
    n, t = 40, 3
    d = C.CHUNKED_GRAM_MIN_FEATURES // t + 7  # several chunks, the last one partial
    x32 = torch.from_numpy(rng.standard_normal((2 * n, t, d)) + 10.0).float()[::2]  # rows not contiguous
    feats = x32.reshape(n, -1)
    assert not feats.is_contiguous() and feats.shape[1] >= C.CHUNKED_GRAM_MIN_FEATURES
    ref = x32[:8].double().mean(0).reshape(-1).float() if shift else None
    centred = feats.double().numpy() - (ref.double().numpy() if shift else 0.0)  # exact values of the inputs
    expected = centred @ centred.T
    got = C.gram_matrix(feats, ref)
    assert got.dtype == torch.float32 and got.shape == (n, n)
    scale = np.abs(expected).max()
    assert np.abs(got.double().numpy() - expected).max() / scale < 2e-6
    # half-precision input is converted chunk by chunk; float64 stays float64
    half = feats.bfloat16()
    hc = half.double().numpy() - (ref.double().numpy() if shift else 0.0)
    got_h = C.gram_matrix(half, ref, torch.float32)
    assert got_h.dtype == torch.float32
    assert np.abs(got_h.double().numpy() - hc @ hc.T).max() / np.abs(hc @ hc.T).max() < 2e-6
    got_64 = C.gram_matrix(feats.double(), None if ref is None else ref.double())
    assert got_64.dtype == torch.float64
    np.testing.assert_allclose(got_64.numpy(), expected, rtol=1e-12, atol=1e-12 * scale)
    # the chunk buffer is reused, not allocated per call: per-call 1 MB buffers interleaved with the small
    # Grams a cache keeps fragment the heap (~1 MB lost per kept Gram)
    before = C._chunk_buffer(1, torch.float32).data_ptr()
    kept = [C.gram_matrix(feats, ref) for _ in range(3)]
    assert C._chunk_buffer(1, torch.float32).data_ptr() == before
    assert all(torch.equal(k, got) for k in kept)


# ----------------------------------------------------------------------------------------------------------
# minibatch_cka: partial batches, full batch, precision trick
# ----------------------------------------------------------------------------------------------------------


def test_partial_last_batch_is_used_with_equal_weight() -> None:
    rng = np.random.default_rng(10)
    x, y = correlated_pair(rng, 70, 6, 8, 1.5)  # batches of 32, 32, 6
    got = C.minibatch_cka(x, y, batch_size=32)
    bounds = [(0, 32), (32, 64), (64, 70)]
    hxy = [ref_hsic1(ref_gram(x[s:e]), ref_gram(y[s:e])) for s, e in bounds]
    hxx = [ref_hsic1(ref_gram(x[s:e]), ref_gram(x[s:e])) for s, e in bounds]
    hyy = [ref_hsic1(ref_gram(y[s:e]), ref_gram(y[s:e])) for s, e in bounds]
    manual = (sum(hxy) / 3) / math.sqrt((sum(hxx) / 3) * (sum(hyy) / 3))
    assert got == pytest.approx(manual, rel=1e-10)
    # the documented choice is visible: weighting batches by their size would give another number
    by_size = ref_minibatch_cka(x, y, 32, weights="size")
    assert abs(by_size - got) > 1e-6
    # and the 2-batch estimate (partial batch dropped) is different too, so the third batch was used
    assert abs(ref_minibatch_cka(x[:64], y[:64], 32) - got) > 1e-6


def test_last_batch_with_fewer_than_four_examples_warns_and_is_dropped() -> None:
    rng = np.random.default_rng(11)
    x, y = correlated_pair(rng, 67, 6, 8, 1.0)
    with pytest.warns(UserWarning, match=r"3 of 67 examples"):
        got = C.minibatch_cka(x, y, batch_size=32)
    assert got == pytest.approx(ref_minibatch_cka(x[:64], y[:64], 32), rel=1e-10)


def test_minibatch_with_one_batch_equals_full_batch_unbiased_cka() -> None:
    rng = np.random.default_rng(12)
    x, y = correlated_pair(rng, 40, 5, 7, 1.0)
    K, L = ref_gram(x), ref_gram(y)
    full = ref_hsic1(K, L) / math.sqrt(ref_hsic1(K, K) * ref_hsic1(L, L))
    assert C.minibatch_cka(x, y, batch_size=40) == pytest.approx(full, rel=1e-10)
    assert C.minibatch_cka(x, y, batch_size=1000) == pytest.approx(full, rel=1e-10)
    # smaller batches give a different (noisier) estimate of the same quantity
    assert C.minibatch_cka(x, y, batch_size=8) != pytest.approx(full, rel=1e-6)


def test_hsic1_invariant_to_constant_shift_in_float64() -> None:
    rng = np.random.default_rng(13)
    x, y = correlated_pair(rng, 12, 6, 4, 0.5)
    shift_x, shift_y = 50.0 + rng.standard_normal(6), -30.0 + rng.standard_normal(4)
    plain = C.hsic1(C.gram_linear(torch.from_numpy(x)), C.gram_linear(torch.from_numpy(y)))
    kx = C.gram_linear(torch.from_numpy(x + shift_x))
    ky = C.gram_linear(torch.from_numpy(y + shift_y))
    shifted = C.hsic1(kx, ky)
    assert float(shifted) == pytest.approx(float(plain), rel=1e-8)
    assert float(plain) == pytest.approx(ref_hsic1(ref_gram(x), ref_gram(y)), rel=1e-10)


def test_reference_mean_trick_rescues_float32_with_large_mean() -> None:
    rng = np.random.default_rng(14)
    x, y = correlated_pair(rng, 64, 48, 40, 1.0)
    shift_x = 1e3 + 10.0 * rng.standard_normal(48)
    shift_y = -1e3 + 10.0 * rng.standard_normal(40)
    xs32 = torch.from_numpy(x + shift_x).float()
    ys32 = torch.from_numpy(y + shift_y).float()
    # exact float64 copies of the float32 data with the shift removed (so storage rounding is shared)
    x64 = xs32.double().numpy() - shift_x
    y64 = ys32.double().numpy() - shift_y
    reference = ref_minibatch_cka(x64, y64, 32)

    with_trick = C.minibatch_cka(xs32, ys32, batch_size=32)
    trick_err = abs(with_trick - reference)
    assert trick_err < 1e-6  # observed ~1e-8: fp32 Grams of unit-scale features

    # the same estimator with naive float32 Grams (no mean subtracted) loses the answer
    la = [C.gram_linear(xs32[s : s + 32])[None] for s in (0, 32)]
    lb = [C.gram_linear(ys32[s : s + 32])[None] for s in (0, 32)]
    naive = float(C.cka_from_gram_list(la, lb)[0, 0])
    naive_err = abs(naive - reference) if math.isfinite(naive) else math.inf
    assert naive_err > 1e-2
    assert naive_err > 100 * trick_err


def test_gram_linear_reference_mean_and_dtype() -> None:
    rng = np.random.default_rng(15)
    x = rng.standard_normal((6, 3, 4))
    m = rng.standard_normal(12)
    g = C.gram_linear(torch.from_numpy(x).float(), reference_mean=torch.from_numpy(m))
    assert g.dtype == torch.float64 and g.shape == (6, 6)
    flat = x.reshape(6, 12) - m
    np.testing.assert_allclose(g.numpy(), flat @ flat.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reference_mean"):
        C.gram_linear(torch.from_numpy(x), reference_mean=torch.zeros(4))


# ----------------------------------------------------------------------------------------------------------
# Float API: properties shared by the estimators
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_self_similarity_is_one(estimator: str) -> None:
    x = np.random.default_rng(16).standard_normal((48, 12))
    assert C.cka(x, x, estimator=estimator, batch_size=16) == pytest.approx(1.0, abs=1e-12)
    assert isinstance(C.cka(x, x, estimator=estimator), float)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_symmetry(estimator: str) -> None:
    x, y = correlated_pair(np.random.default_rng(17), 48, 9, 5, 1.0)
    assert C.cka(x, y, estimator) == pytest.approx(C.cka(y, x, estimator), rel=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_invariance_to_orthogonal_transform_and_isotropic_scaling(estimator: str) -> None:
    rng = np.random.default_rng(18)
    x, y = correlated_pair(rng, 64, 10, 6, 1.0)
    base = C.cka(x, y, estimator)
    q = random_orthogonal(rng, 10)
    assert C.cka(x @ q, y, estimator) == pytest.approx(base, rel=1e-10)
    assert C.cka(3.7 * x, 0.02 * y, estimator) == pytest.approx(base, rel=1e-10)
    # a generic (non-orthogonal, anisotropic) linear map does change CKA
    a = np.diag(np.linspace(0.1, 10.0, 10))
    assert C.cka(x @ a, y, estimator) != pytest.approx(base, rel=1e-3)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_correlated_inputs_decrease_with_noise(estimator: str) -> None:
    rng = np.random.default_rng(19)
    x = rng.standard_normal((256, 16))
    r = rng.standard_normal((16, 12)) / 4.0
    e = rng.standard_normal((256, 12))
    values = [C.cka(x, x @ r + s * e, estimator) for s in (0.25, 0.5, 1.0, 2.0, 4.0)]
    assert all(0.0 < v < 1.0 for v in values), values
    assert all(a > b for a, b in zip(values, values[1:], strict=False)), values
    # unrelated features are much less similar than the least noisy pair
    assert C.cka(x, rng.standard_normal((256, 12)), estimator) < 0.5 * values[0]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_token_axis_is_flattened(estimator: str) -> None:
    rng = np.random.default_rng(20)
    x3 = rng.standard_normal((40, 3, 4))
    y = rng.standard_normal((40, 5)) + x3[:, 0, :1]
    flat = C.cka(x3.reshape(40, 12), y, estimator, 16)
    assert C.cka(x3, y, estimator, 16) == pytest.approx(flat, rel=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_numpy_and_torch_float32_inputs_agree(estimator: str) -> None:
    x, y = correlated_pair(np.random.default_rng(21), 48, 8, 6, 1.0)
    ref = C.cka(x, y, estimator)
    assert C.cka(torch.from_numpy(x), torch.from_numpy(y), estimator) == pytest.approx(ref, rel=1e-12)
    got32 = C.cka(torch.from_numpy(x).float(), y.astype(np.float32), estimator)
    assert got32 == pytest.approx(ref, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------
# linear_cka and rbf_cka against the centring-matrix references
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "dx", "dy"), [(30, 4, 6), (10, 40, 25)])
def test_linear_cka_matches_centring_matrix_reference(n: int, dx: int, dy: int) -> None:
    # (30, 4, 6) takes the D×D path, (10, 40, 25) the N×N Gram path
    rng = np.random.default_rng(22)
    x = rng.standard_normal((n, dx)) + 5.0
    y = x[:, :1] * rng.standard_normal((1, dy)) + rng.standard_normal((n, dy))
    assert C.linear_cka(x, y) == pytest.approx(ref_biased_cka(ref_gram(x), ref_gram(y)), rel=1e-10)


@pytest.mark.parametrize("sigma_frac", [0.8, 0.3])
@pytest.mark.parametrize("n", [11, 12])  # odd and even number of pairs for the median
def test_rbf_cka_matches_loop_reference(n: int, sigma_frac: float) -> None:
    rng = np.random.default_rng(23)
    x, y = correlated_pair(rng, n, 5, 3, 0.8)
    expected = ref_biased_cka(ref_rbf_gram(x, sigma_frac), ref_rbf_gram(y, sigma_frac))
    assert C.rbf_cka(x, y, sigma_frac=sigma_frac) == pytest.approx(expected, rel=1e-10)


def test_constant_features_give_nan_not_an_error() -> None:
    x = np.random.default_rng(24).standard_normal((20, 4))
    const = np.ones((20, 3))
    for estimator in ESTIMATORS:
        assert math.isnan(C.cka(x, const, estimator, 8))


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def test_input_validation_errors() -> None:
    x = np.random.default_rng(25).standard_normal((10, 3))
    with pytest.raises(ValueError, match="N=10 for x and N=9 for y"):
        C.cka(x, x[:9])
    with pytest.raises(ValueError, match="at least 4 examples, got N=3"):
        C.cka(x[:3], x[:3], estimator="linear")
    bad = x.copy()
    bad[0, 0] = np.nan
    bad[1, :2] = np.nan
    bad[2, 2] = np.inf
    with pytest.raises(ValueError, match="3 NaN and 1 inf"):
        C.cka(x, bad)
    with pytest.raises(ValueError, match="'minibatch', 'full', 'linear', 'rbf'"):
        C.cka(x, x, estimator="kernel")
    with pytest.raises(ValueError, match=r"\(N, D\) or \(N, T, D\)"):
        C.cka(x[:, 0], x[:, 0])
    with pytest.raises(ValueError, match="batch_size"):
        C.minibatch_cka(x, x, batch_size=3)
    with pytest.raises(ValueError, match="sigma_frac"):
        C.rbf_cka(x, x, sigma_frac=0.0)


# ----------------------------------------------------------------------------------------------------------
# cosine_similarity_matrix
# ----------------------------------------------------------------------------------------------------------


def test_cosine_similarity_matrix_matches_loops() -> None:
    rng = np.random.default_rng(26)
    f = rng.standard_normal((4, 7, 5))
    f[1] = 2.5 * f[0]  # same direction as item 0 on every example
    f[2] = -f[0]
    got = C.cosine_similarity_matrix(torch.from_numpy(f).float())
    assert got.shape == (4, 4) and got.dtype == torch.float64
    expected = np.zeros((4, 4))
    for i in range(4):
        for j in range(4):
            expected[i, j] = np.mean(
                [f[i, n] @ f[j, n] / (np.linalg.norm(f[i, n]) * np.linalg.norm(f[j, n])) for n in range(7)]
            )
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)
    assert float(got[0, 1]) == pytest.approx(1.0, abs=1e-6)
    assert float(got[0, 2]) == pytest.approx(-1.0, abs=1e-6)
    with pytest.raises(ValueError, match=r"\(M, N, D\)"):
        C.cosine_similarity_matrix(torch.zeros(3, 4))


def test_full_is_the_biased_full_batch_estimator():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    y = x @ torch.randn(6, 5, generator=g, dtype=torch.float64) + torch.randn(40, 5, generator=g, dtype=torch.float64)
    n = 40
    H = torch.eye(n, dtype=torch.float64) - torch.ones(n, n, dtype=torch.float64) / n
    K, L = x @ x.T, y @ y.T
    ref = float(torch.trace(K @ H @ L @ H) / torch.sqrt(torch.trace(K @ H @ K @ H) * torch.trace(L @ H @ L @ H)))
    assert C.cka(x, y, estimator="full") == pytest.approx(ref, rel=1e-10)
    assert C.cka(x, y, estimator="full") == C.cka(x, y, estimator="linear")


def test_cka_on_few_examples_warns_why_and_the_reason_holds() -> None:
    """`vs.cka` below FEW_CKA_EXAMPLES examples warns (the unbiased estimator's variance), at it does not; and
    what the warning says is so: between unrelated representations the estimate spreads far more at 4 examples
    than at FEW_CKA_EXAMPLES, and it leaves [0, 1]."""
    import warnings

    from vitscope.errors import ResultWarning

    rng = np.random.default_rng(0)
    few = C.FEW_CKA_EXAMPLES
    x, y = correlated_pair(rng, few - 1, 16, 8, 0.5)
    with pytest.warns(ResultWarning, match=rf"CKA from {few - 1} examples .*variance.* at least {few} examples"):
        C.cka(x, y)
    x, y = correlated_pair(rng, few, 16, 8, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.cka(x, y)
        C.cka(x, y, estimator="full")  # the biased full-batch estimator is not the one meant
    spread = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResultWarning)
        for n in (4, few):
            values = [C.cka(rng.standard_normal((n, 64)), rng.standard_normal((n, 64)), batch_size=n)
                      for _ in range(100)]
            spread[n] = (statistics.stdev(values), min(values))
    assert spread[4][0] > 5 * spread[few][0] and spread[4][1] < 0
