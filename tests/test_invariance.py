"""Representation inversion, STIR and the invariance metrics of Merlin et al. (vitscope.invariance)."""

import copy
import math

import numpy as np
import pytest
import scipy.stats
import torch

import vitscope as vs
from vitscope.errors import ConfigError, InputError, UnknownTapError
from vitscope.invariance import (
    StirSums,
    check_pair,
    flow_matrix,
    flow_summary,
    forgetting,
    invert,
    learning,
    pearson,
    stir,
)
from vitscope.metrics import invariance as M

# 16-px images, patch 4: 4 x 4 tokens; embed_dim 48 = 3 * 4 * 4, so a generic patch embedding is injective
SMALL = dict(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=3)


def small(seed: int, **kw) -> vs.ViTModel:
    torch.manual_seed(seed)
    return vs.load_model("vit_small_patch16_224", pretrained=False, seed=seed, **{**SMALL, **kw})


def pixels(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def normalise(vm: vs.ViTModel, u: torch.Tensor) -> torch.Tensor:
    pre = vm.preprocessing
    return (u - torch.tensor(pre.mean).view(1, 3, 1, 1)) / torch.tensor(pre.std).view(1, 3, 1, 1)


def drop_channel(vm: vs.ViTModel, c: int = 2) -> vs.ViTModel:
    with torch.no_grad():
        vm.model.patch_embed.proj.weight[:, c] = 0
    return vm


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (conftest)


# -- inversion ------------------------------------------------------------------------------------------------


def test_inversion_reaches_its_error_keeps_best_and_clamps():
    vm = vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                       depth=3, num_heads=3)
    x = normalise(vm, pixels(4, 32))
    taps = ["block0.out", "block2.out", "block1.attn"]
    inv = invert(vm, x, taps, history=True)  # the defaults: 50 iterations, step 0.5, noise start
    assert inv.images.shape == (3, 4, 3, 32, 32)
    assert inv.history.shape == (51, 3, 4)
    # stated: relative error < 0.15 at every block output for 32-px images within the default 50 iterations
    assert float(inv.rel_error[:2].max()) < 0.15
    assert bool((inv.history[0, :2] > 0.8).all())  # it started far away
    # best iterate: the minimum over every iterate, never worse than the last one
    assert torch.allclose(inv.rel_error, inv.history.min(dim=0).values)
    assert bool((inv.rel_error <= inv.history[-1]).all())
    last = invert(vm, x, taps, keep_best=False, history=True)
    assert torch.equal(last.rel_error, last.history[-1])
    # the kept images give the reported error (recomputed independently)
    feats = vs.extract(vm, inv.images[1], "block2.out")["block2.out"].flatten(1)
    ref = vs.extract(vm, x, "block2.out")["block2.out"].flatten(1)
    err = (feats - ref).norm(dim=1) / ref.norm(dim=1)
    assert torch.allclose(err, inv.rel_error[1], atol=1e-4)
    # clamped: valid pixels, and the normalised images are exactly those pixels normalised
    assert float(inv.pixels.min()) >= 0 and float(inv.pixels.max()) <= 1
    assert torch.allclose(inv.images, normalise(vm, inv.pixels.flatten(0, 1)).view_as(inv.images), atol=1e-6)


def test_batched_layers_equal_separate_runs_and_chunks():
    vm = small(0, depth=3)
    x = normalise(vm, pixels(5))
    taps = ["block2.out", "embed", "block0.attn"]
    both = invert(vm, x, taps, iterations=6)
    for k, t in enumerate(taps):
        one = invert(vm, x, t, iterations=6)
        assert torch.allclose(one.images[0], both.images[k], atol=1e-5), t
    chunked = invert(vm, x, taps, iterations=6, max_rows=3)
    assert torch.allclose(chunked.images, both.images, atol=1e-5)
    # an image's inversion depends on its id, not on its batch
    part = invert(vm, x[2:4], taps, iterations=6, ids=torch.tensor([2, 3]))
    assert torch.allclose(part.images, both.images[:, 2:4], atol=1e-5)


def test_parameters_get_no_gradient_and_stay_trainable():
    vm = small(1)
    params = list(vm.model.parameters())
    invert(vm, normalise(vm, pixels(4)), "block1.out", iterations=2)
    assert all(p.grad is None for p in params)
    assert all(p.requires_grad for p in params)


# -- STIR --------------------------------------------------------------------------------------------------------


def test_self_stir_is_one_at_the_same_layer_for_any_inversion_quality():
    vm = small(2)
    x = normalise(vm, pixels(8))
    for iterations in (0, 3):
        df = stir(vm, copy.deepcopy(vm), x, ["block0.out", "block1.out"], ["block0.out", "block1.out"],
                  iterations=iterations, batch_size=8)
        same = df[df.tap_inverted == df.tap_measured]
        assert np.allclose(same.stir, 1.0)
        assert (same.measured < 0.99).all()  # the inversions are poor: 1 is the definition, not luck
        assert (df[df.tap_inverted != df.tap_measured].stir < 0.99).all()


def test_shared_invariance_by_construction_and_direction():
    # A and C discard the blue channel (patch embedding column zeroed); B reads it
    a = drop_channel(small(3))
    c = drop_channel(small(4))
    b = small(3)
    with torch.no_grad():
        b.model.load_state_dict(a.model.state_dict())
        b.model.patch_embed.proj.weight[:, 2] = torch.randn_like(b.model.patch_embed.proj.weight[:, 2]) * 0.1
    u = pixels(16, seed=5)
    x = normalise(a, u)
    inv = invert(a, x, "embed", iterations=80)
    # the inversion changes blue freely (it stays at its start) and matches red and green
    px = inv.pixels[0]
    assert float((px[:, 2] - u[:, 2]).abs().mean()) > 0.25
    assert float((px[:, :2] - u[:, :2]).abs().mean()) < 0.05
    kw = dict(iterations=80, batch_size=16)
    s_c = stir(c, a, x, "embed", "embed", **kw).stir.item()
    s_b = stir(b, a, x, "embed", "embed", **kw).stir.item()
    s_ab = stir(a, b, x, "embed", "embed", **kw).stir.item()
    assert s_c > 0.95  # shares the invariance
    assert s_b < 0.8   # reads the channel A ignores
    assert s_ab > s_b + 0.15  # directional: STIR(A|B) != STIR(B|A)


def test_stir_accumulates_over_all_batches_exactly():
    # the HSIC sums over two batches equal the minibatch CKA of vitscope.metrics.cka on the same features
    from vitscope.metrics.cka import minibatch_cka

    g = torch.Generator().manual_seed(0)
    f, h = torch.randn(16, 30, generator=g), torch.randn(16, 20, generator=g)
    h[:, :5] += f[:, :5] * 3
    s = M.hsic_terms(f[:8], h[:8]) + M.hsic_terms(f[8:], h[8:])
    assert math.isclose(float(M.stir_from_sums(s)), minibatch_cka(f, h, batch_size=8), rel_tol=1e-6)


# -- formulas -----------------------------------------------------------------------------------------------------


def test_learning_forgetting_flow_from_hand_set_stir():
    s_ft_pt = np.array([[0.9, 0.5, 0.2], [0.7, 0.6, 0.3], [0.8, 0.65, 0.4]])  # [i pt, j ft] = STIR(ft[j]|pt[i])
    s_pt_ft = np.array([0.95, 0.7, 0.5])  # STIR(pt[i]|ft[i])
    assert np.allclose(forgetting(np.diag(s_ft_pt)), [0.1, 0.4, 0.6])
    assert np.allclose(learning(s_pt_ft), [0.05, 0.3, 0.5])
    assert np.allclose(M.cka_divergence([0.9, 0.25]), [0.1, 0.75])
    f = flow_matrix(s_ft_pt)
    assert np.allclose(f, [[0, -0.4, -0.7], [0.1, 0, -0.3], [0.4, 0.25, 0]])
    summary = flow_summary(f)
    # compression: mean over i of max(0, max_{j<i} F) = (0 + 0.1 + 0.4) / 3; no expansion
    assert math.isclose(summary["compression"], 0.5 / 3)
    assert summary["expansion"] == 0
    assert summary["compressed_layers"] == 2 and summary["expanded_layers"] == 0
    assert math.isclose(summary["mean_shift"], (0 - 1 - 2) / 3)


def test_pearson_matches_scipy():
    x = [0.31, 0.42, 0.40, 0.55, 0.61, 0.58, 0.70]
    y = [0.12, 0.18, 0.15, 0.22, 0.30, 0.26, 0.33]
    r, p = pearson(x, y)
    ref = scipy.stats.pearsonr(x, y)
    assert math.isclose(r, ref[0], rel_tol=1e-12)
    assert math.isclose(p, ref[1], rel_tol=1e-9)
    r2, p2 = pearson(x, y[::-1])
    ref2 = scipy.stats.pearsonr(x, y[::-1])
    assert math.isclose(r2, ref2[0], rel_tol=1e-12) and math.isclose(p2, ref2[1], rel_tol=1e-9)
    assert all(math.isnan(v) for v in pearson([1, 2], [3, 4]))
    assert all(math.isnan(v) for v in pearson([1, 1, 1], [3, 4, 5]))


# -- bad input ----------------------------------------------------------------------------------------------------


def test_bad_pairs_taps_and_divergence():
    a = small(5)
    other_size = small(5, img_size=32)
    with pytest.raises(InputError, match="same input.*16x16.*32x32"):
        check_pair(a, other_size)
    other_norm = small(6)
    from dataclasses import replace

    other_norm.spec = replace(other_norm.spec, preprocessing=replace(other_norm.spec.preprocessing,
                                                                     mean=(0.1, 0.2, 0.3), std=(0.3, 0.3, 0.3)))
    with pytest.raises(InputError, match="normalises with"):
        check_pair(a, other_norm)
    x = normalise(a, pixels(8))
    with pytest.raises(UnknownTapError, match="block7.out"):
        stir(a, small(7), x, "block0.out", "block7.out", iterations=1)
    broken = small(8)
    with torch.no_grad():
        broken.model.blocks[0].mlp.fc1.weight[0, 0] = math.nan
    from vitscope.capture.engine import NonFiniteError

    with pytest.raises(NonFiniteError, match="non-finite"):  # one sentence naming the model: no NaN in tables
        invert(broken, x, "block1.out", iterations=2)
        stir(a, broken, x, "block1.out", "block1.out", iterations=2, batch_size=8)


# -- the public STIR code's estimator ------------------------------------------------------------------------------


def _biased_linear_cka_reference(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al.'s biased linear CKA written out with the centring matrix H (float64 numpy)."""
    n = len(x)
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = h @ (x @ x.T) @ h, h @ (y @ y.T) @ h
    return float((k * l_).sum() / math.sqrt((k * k).sum() * (l_ * l_).sum()))


def test_last_batch_biased_is_the_biased_cka_of_the_batch_with_the_highest_ids_in_any_order():
    g = torch.Generator().manual_seed(3)
    batches = []
    for key in (7, 15, 23):  # three batches of 8; arrival order and shards must not matter
        f = torch.randn(8, 12, generator=g) + 2.0
        h = torch.randn(8, 9, generator=g)
        h[:, :4] += f[:, :4] * (key / 8)
        batches.append((key, f, h))
    want = _biased_linear_cka_reference(batches[-1][1].double().numpy(), batches[-1][2].double().numpy())
    keep, err = torch.ones(8, dtype=torch.bool), torch.zeros(8)

    def fed(order):
        s = StirSums(1, 1, 1)
        for k in order:
            key, f, h = batches[k]
            s.add(0, 0, [f], [h], keep, err, key=key)
        return s

    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        s = fed(order)
        assert math.isclose(float(s.values("last_batch_biased")[0, 0, 0]), want, rel_tol=1e-6)
        # the default is untouched: the unbiased minibatch CKA summed over all three batches
        assert math.isclose(float(s.values()[0, 0, 0]), float(fed([0, 1, 2]).values()[0, 0, 0]), rel_tol=1e-12)
    for a_part, b_part in (([0, 2], [1]), ([1], [0, 2]), ([0], [1, 2])):  # shards merged either way round
        a, b = fed(a_part), fed(b_part)
        a.merge(b)
        assert math.isclose(float(a.values("last_batch_biased")[0, 0, 0]), want, rel_tol=1e-6)
        assert int(a.batches.sum()) == 3
    s = StirSums(1, 1, 1)
    s.load_state_dict(fed([2, 1]).state_dict())
    assert math.isclose(float(s.values("last_batch_biased")[0, 0, 0]), want, rel_tol=1e-6)
    # one batch only: the two estimators differ (biased vs unbiased), both from the same Grams
    one = fed([2])
    assert not math.isclose(float(one.values()[0, 0, 0]), want, rel_tol=1e-3)
    with pytest.raises(ConfigError, match="cka_estimator 'last_batch' does not exist; choose minibatch_unbiased"):
        one.values("last_batch")


def test_stir_function_offers_the_public_estimator():
    m1, m2 = small(0), small(1)
    x = normalise(m1, pixels(12))
    kw = dict(iterations=2, batch_size=4)
    last = stir(m2, m1, x, "block1.out", "block0.out", cka_estimator="last_batch_biased", **kw)
    default = stir(m2, m1, x, "block1.out", "block0.out", **kw)
    assert list(last.cka_estimator) == ["last_batch_biased"] and list(default.cka_estimator) == ["minibatch_unbiased"]
    assert not math.isclose(last.stir.item(), default.stir.item(), rel_tol=1e-3)
    with pytest.raises(ConfigError, match="cka_estimator 'biased' does not exist"):
        stir(m2, m1, x, "block1.out", "block0.out", cka_estimator="biased", **kw)
