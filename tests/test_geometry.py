"""SVD volume and Fourier analysis: pure functions against numpy references, analyses end to end."""

import numpy as np
import pytest
import torch

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.metrics import geometry as G


def test_covariance_spectrum_matches_numpy():
    x = torch.randn(3, 20, 7, dtype=torch.float64) @ torch.randn(7, 7, dtype=torch.float64)
    got = G.covariance_spectrum(x)
    for b in range(3):
        ref = np.sort(np.linalg.eigvalsh(np.cov(x[b].numpy().T)))[::-1]
        assert got[b].numpy() == pytest.approx(ref, rel=1e-8, abs=1e-10)


def test_streamed_moments_give_the_full_covariance_spectrum():
    x = torch.randn(50, 6, dtype=torch.float64) * torch.arange(1, 7) + 5.0
    sx, sxx = torch.zeros(6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64)
    for chunk in x.split(13):
        sx += chunk.sum(0)
        sxx += chunk.T @ chunk
    ref = np.sort(np.linalg.eigvalsh(np.cov(x.numpy().T)))[::-1]
    assert G.spectrum_from_moments(sx, sxx, 50).numpy() == pytest.approx(ref, rel=1e-9)


def test_isotropic_tokens_occupy_more_volume_than_rank_one_tokens():
    g = torch.Generator().manual_seed(0)
    iso = torch.randn(4, 64, 16, generator=g)
    rank1 = torch.randn(4, 64, 1, generator=g) * torch.randn(1, 1, 16, generator=g)
    li, l1 = G.token_log_spectrum(iso), G.token_log_spectrum(rank1)
    # all directions used: Marchenko-Pastur spread for 64 samples in 16 dims is log(2.25 / 0.25) = 2.2
    assert (li.max(-1).values - li.min(-1).values).max() < 3.0
    assert ((l1[:, 0] - l1[:, 1]) > 10).all()  # one direction only
    assert li[:, :8].mean() > l1[:, :8].mean() + 5


def _numpy_log_amp(tokens, h, w):
    B, S, D = tokens.shape
    out = np.zeros((B, h, w))
    for b in range(B):
        for c in range(D):
            m = tokens[b, :, c].reshape(h, w)
            out[b] += np.log(np.maximum(np.abs(np.fft.fft2(m)), 1e-12))
        out[b] = np.fft.fftshift(out[b] / D)
    return out


def test_log_amplitude_map_matches_numpy():
    # seeded: an unseeded draw (the global generator, whose state depends on the tests before) can put an
    # amplitude near 0, where float32's error is large in the log
    t = torch.randn(2, 30, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # the FFT runs in float32: agreement to float32 precision (over 300 seeds the largest log error was 2e-5)
    assert G.log_amplitude_map(t, (5, 6)).numpy() == pytest.approx(_numpy_log_amp(t.numpy(), 5, 6), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_single_diagonal_frequency_lands_at_that_frequency(k):
    h = 12
    r, c = np.meshgrid(np.arange(h), np.arange(h), indexing="ij")
    phases = np.random.default_rng(k).uniform(0, 2 * np.pi, 4)
    maps = np.stack([2 + np.cos(2 * np.pi * k * (r + c) / h + p) for p in phases], -1)  # (h, h, 4)
    tokens = torch.from_numpy(maps.reshape(1, h * h, 4))
    freq, delta = G.diagonal_profile(G.log_amplitude_map(tokens, (h, h))[0])
    assert int(delta[1:].argmax()) + 1 == k
    assert float(freq[k]) == pytest.approx(2 * k / h)


def _batches(vm, n=18, bs=6):
    return list(SyntheticShapes(n=n, seed=3).batches(bs, vm.preprocessing))


@pytest.mark.parametrize("token_every", [1, 3])
def test_svd_volume_and_fourier_from_the_pipeline_equal_direct_computation(token_every):
    vm = tiny("reg")
    batches = _batches(vm)
    svd = get_analysis("svd_volume")(vm, taps=["block1.out"], k=4, token_every=token_every)
    four = get_analysis("fourier")(vm, taps=["block2.out"])
    stream(vm, batches, [svd, four], progress=False)
    x = torch.cat([b.images for b in batches])
    f = vs.extract(vm, x, ["block1.out", "block2.out"])
    sp1 = f["block1.out"][:, 5:].double().numpy()  # 5 prefix tokens
    df = svd.finalize()
    img = np.sort(np.linalg.eigvalsh(np.cov(sp1.mean(1).T)))[::-1]
    got = df[df.metric == "image_log_eigenvalue"].sort_values("index").value.to_numpy()
    assert got[:10] == pytest.approx(np.log(np.maximum(img[:10], 1e-12)), rel=1e-6)
    ids = torch.cat([b.index for b in batches]).numpy()
    tok = np.mean([np.log(np.maximum(np.sort(np.linalg.eigvalsh(np.cov(s.T)))[::-1][:16], 1e-12))
                   for s in sp1[ids % token_every == 0]], 0)
    got_tok = df[df.metric == "token_log_eigenvalue"].sort_values("index").value.to_numpy()
    assert got_tok[:8] == pytest.approx(tok[:8], rel=1e-5)
    vol = df[df.metric == "token_log_volume"]
    assert vol.value.item() == pytest.approx(tok[:4].mean(), rel=1e-5)
    # its stderr over images: numpy's standard error of the per-image volumes
    per_image = [np.log(np.maximum(np.sort(np.linalg.eigvalsh(np.cov(s.T)))[::-1][:4], 1e-12)).mean()
                 for s in sp1[ids % token_every == 0]]
    assert vol.stderr.item() == pytest.approx(np.std(per_image, ddof=1) / np.sqrt(len(per_image)), rel=1e-4)
    # the chance row is scaled by the tokens' mean channel variance
    mean_var = np.mean([s.var(0, ddof=1).mean() for s in sp1[ids % token_every == 0]])
    assert float(svd.tvar["block1.out"] / svd.ntok["block1.out"]) == pytest.approx(mean_var, rel=1e-6)
    sp2 = f["block2.out"][:, 5:].double().numpy()
    amp = _numpy_log_amp(sp2, 4, 4).mean(0)
    ref = np.array([amp[2 + j, 2 + j] for j in range(2)])
    fd = four.finalize()
    curve = fd[fd.metric == "delta_log_amp"].sort_values("freq").value.to_numpy()
    assert curve == pytest.approx(ref - ref[0], abs=1e-6)
    high = fd[fd.metric == "high_freq_delta_log_amp"]
    assert high.value.item() == pytest.approx(ref[-1] - ref[0], abs=1e-6)
    amps = _numpy_log_amp(sp2, 4, 4)
    per_image = amps[:, 3, 3] - amps[:, 2, 2]
    assert high.stderr.item() == pytest.approx(np.std(per_image, ddof=1) / np.sqrt(len(per_image)), rel=1e-4)
    assert high.value_lo.item() < high.value.item() < high.value_hi.item()


@pytest.mark.parametrize("name", ["svd_volume", "fourier"])
def test_merge_equals_one_pass(name):
    vm = tiny("vit")
    batches = _batches(vm)
    whole = get_analysis(name)(vm)
    stream(vm, batches, [whole], progress=False)
    a, b = get_analysis(name)(vm), get_analysis(name)(vm)
    stream(vm, batches[:1], [a], progress=False)
    stream(vm, batches[1:], [b], progress=False)
    a.merge(b)
    c = get_analysis(name)(vm)
    c.load_state_dict(a.state_dict())
    assert c.finalize().value.to_numpy() == pytest.approx(whole.finalize().value.to_numpy(), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", ["svd_volume", "fourier"])
def test_merge_with_a_part_that_saw_no_image_keeps_the_sums(name):
    """A part without images (its per-tap sums empty) merged into a fed one, or a fed one into it, changes
    nothing: the taps only one part has seen keep their sums (the merge used to drop or fail on them)."""
    vm = tiny("vit")
    batches = _batches(vm, n=6)
    fed = get_analysis(name)(vm)
    stream(vm, batches, [fed], progress=False)
    want = fed.finalize().value.to_numpy()
    into_empty, empty = get_analysis(name)(vm), get_analysis(name)(vm)
    into_empty.merge(fed)
    fed.merge(empty)
    for part in (into_empty, fed):
        assert part.finalize().value.to_numpy() == pytest.approx(want, rel=1e-12, nan_ok=True)


def test_tsne_separates_images_whose_tokens_are_distinct_and_keeps_the_smallest_ids():
    from vitscope.data import Batch

    vm = tiny("vit")  # 4x4 grid: 16 tokens per image, 48-d
    g = torch.Generator().manual_seed(0)
    centres = 10 * torch.randn(6, 48, generator=g)
    tokens = centres[:, None] + 0.1 * torch.randn(6, 16, 48, generator=g)  # image i: a tight blob at centre i
    feats = torch.cat([torch.zeros(6, 1, 48), tokens], 1)  # prefix (CLS) token first
    a = get_analysis("tsne")(vm, layers=[0], n_images=4, perplexity=5)
    b = get_analysis("tsne")(vm, layers=[0], n_images=4, perplexity=5)
    order = [5, 2, 0, 4, 1, 3]
    for part, idx in ((a, order[:3]), (b, order[3:])):
        part.update({"block0.out": feats[idx]}, Batch(images=torch.zeros(3), index=torch.tensor(idx),
                                                       labels=torch.tensor(idx)))
    a.merge(b)
    df = a.finalize()
    assert sorted(df.image.unique()) == [0, 1, 2, 3] and len(df) == 4 * 16
    xy = torch.tensor(df[["x", "y"]].to_numpy())
    d = torch.cdist(xy, xy)
    d.fill_diagonal_(float("inf"))
    same = (torch.tensor(df.image.to_numpy())[d.argmin(1)] == torch.tensor(df.image.to_numpy())).float().mean()
    assert same > 0.95
    again = get_analysis("tsne")(vm, layers=[0], n_images=4, perplexity=5)
    again.load_state_dict(a.state_dict())
    assert again.finalize()[["x", "y"]].to_numpy() == pytest.approx(df[["x", "y"]].to_numpy())


def _feed(analysis, tokens, tap="block0.out", bs=16):
    """Feed (N, 1 + S, D) features straight to an analysis, as the capture engine would."""
    from vitscope.data.base import Batch

    for s in range(0, len(tokens), bs):
        idx = torch.arange(s, min(s + bs, len(tokens)))
        analysis.update({tap: tokens[idx]}, Batch(images=tokens[idx], index=idx))


def test_chance_rows_match_gaussian_features_and_sit_above_low_rank_ones():
    vm = tiny("vit")  # 4x4 grid, 48-d, one prefix token
    g = torch.Generator().manual_seed(3)
    gauss = 2.5 * torch.randn(96, 17, 48, generator=g)  # isotropic, variance 6.25
    low = torch.randn(96, 17, 2, generator=g) @ torch.randn(2, 48, generator=g)  # rank 2 per image and overall
    for feats, same in ((gauss, True), (low, False)):
        svd = get_analysis("svd_volume")(vm, taps=["block0.out"], k=8, seed=1)
        four = get_analysis("fourier")(vm, taps=["block0.out"])
        _feed(svd, feats)
        _feed(four, feats)
        df, fd = svd.finalize(), four.finalize()
        for level in ("token", "image"):
            vol, chance = (df[df.metric == f"{level}_log_volume{c}"].value.item() for c in ("", "_chance"))
            if same:  # another draw of the same distribution: close (sampling error of a mean of 8 log eigenvalues)
                assert vol == pytest.approx(chance, abs=0.25), level
            else:
                assert vol < chance - 3, level
        hf, hf_chance = (fd[fd.metric == f"high_freq_delta_log_amp{c}"].value.item() for c in ("", "_chance"))
        if same:
            assert hf == pytest.approx(hf_chance, abs=0.15)
    ramp = torch.linspace(1, 2, 16)[None, :, None]  # every channel a smooth ramp over the tokens
    smooth = torch.randn(96, 1, 48, generator=g) * ramp
    four = get_analysis("fourier")(vm, taps=["block0.out"])
    _feed(four, torch.cat([torch.zeros(96, 1, 48), smooth], 1))
    fd = four.finalize()
    assert fd[fd.metric == "high_freq_delta_log_amp"].value.item() < \
        fd[fd.metric == "high_freq_delta_log_amp_chance"].value.item() - 1


@pytest.mark.parametrize("grid", [(4, 4), (5, 6), (7, 7), (8, 8), (14, 14)])
def test_diagonal_log_amplitude_is_the_diagonal_of_the_fft_map(grid):
    h, w = grid
    g = torch.Generator().manual_seed(h * w)
    t = torch.randn(3, h * w, 7, generator=g, dtype=torch.float64) + torch.rand(7, generator=g, dtype=torch.float64)
    full = _numpy_log_amp(t.numpy(), h, w)
    steps = min(h - h // 2, w - w // 2)
    ref = np.stack([full[:, h // 2 + j, w // 2 + j] for j in range(steps)], 1)
    got = G.diagonal_log_amplitude(t, grid)
    assert got.shape == (3, steps) and got.dtype == torch.float64
    assert got.numpy() == pytest.approx(ref, abs=2e-5)
