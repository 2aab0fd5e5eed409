"""Streaming analyses fed by the one-pass engine agree with slow direct computations."""

import math

import pytest
import torch

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import Batch, SyntheticShapes


def _batches(vm, n=20, bs=6, start=0):
    return list(SyntheticShapes(n=n, seed=1).batches(bs, vm.preprocessing, start=start))


def _slow_distance(attn, grid, prefix):
    """Loop reference: per image, head and spatial query, sum_k a_qk * |pos_q - pos_k| (unit square)."""
    B, H, T, _ = attn.shape
    h, w = grid
    scale = max(h, w) - 1
    out = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        for hd in range(H):
            tot = 0.0
            for q in range(h * w):
                row = attn[b, hd, prefix + q, prefix:].double()
                row = row / row.sum()
                qy, qx = divmod(q, w)
                for k in range(h * w):
                    ky, kx = divmod(k, w)
                    tot += float(row[k]) * math.hypot(qy - ky, qx - kx) / scale
            out[b, hd] = tot / (h * w)
    return out


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_attention_distance_from_the_pipeline_equals_a_slow_reimplementation(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=7, bs=4)
    a = get_analysis("attention_distance")(vm)
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    attn = vs.extract(vm, torch.cat([b.images for b in batches]), [f"block{i}.attn" for i in range(3)])
    for i in range(3):
        ref = _slow_distance(attn[f"block{i}.attn"], vm.grid_size, vm.num_prefix_tokens).mean(0)
        got = df[(df.metric == "distance") & (df.layer == i)].sort_values("head")["value"].to_numpy()
        assert got == pytest.approx(ref.numpy(), abs=1e-6)
        px = df[(df.metric == "distance_px") & (df.layer == i)].sort_values("head")["value"].to_numpy()
        assert px == pytest.approx(ref.numpy() * vm.patch_size * (vm.grid_size[0] - 1), abs=1e-5)


def _run(name, vm, batches, **params):
    a = get_analysis(name)(vm, **params)
    for b in batches:
        with vs.Capture(vm, a.required_taps()) as cap:
            a.update(cap(b.images), b)
    return a


@pytest.mark.parametrize("name,params", [("attention_distance", {}), ("cka", {"batch_size": 8})])
def test_merge_and_resume_give_the_same_result_as_one_pass(name, params):
    vm = tiny("vit")
    batches = _batches(vm, n=24, bs=8)
    whole = _run(name, vm, batches, **params).finalize()
    first = _run(name, vm, batches[:2], **params)
    second = _run(name, vm, batches[2:], **params)
    first.merge(second)
    # resume: state saved after one batch, restored into a fresh accumulator, then continued
    part = _run(name, vm, batches[:1], **params)
    resumed = get_analysis(name)(vm, **params)
    resumed.load_state_dict(part.state_dict())
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    # a merged part subtracts its own reference mean before its float32 Grams: float32 rounding only
    for other in (first.finalize(), resumed.finalize()):
        assert other["value"].to_numpy() == pytest.approx(whole["value"].to_numpy(), rel=1e-6, abs=1e-9)


def test_cka_analysis_matches_cka_on_extracted_features():
    vm = tiny("vit")
    batches = _batches(vm, n=20, bs=6)  # 20 images, CKA batch 8: groups of 8, 8 and a last one of 4
    a = _run("cka", vm, batches, batch_size=8, views=["cls", "gap_spatial"])
    df = a.finalize()
    x = torch.cat([b.images for b in batches])
    for view in ["cls", "gap_spatial"]:
        feats = vs.extract(vm, x, ["block0.out", "block2.out"], view=view)
        ref = vs.cka(feats["block0.out"], feats["block2.out"], estimator="minibatch", batch_size=8)
        got = df[(df.tap == "block0.out") & (df.tap_b == "block2.out") & (df.token_view == view)]["value"]
        assert float(got.iloc[0]) == pytest.approx(ref, rel=1e-6)
        diag = df[(df.tap == df.tap_b) & (df.token_view == view)]["value"]
        assert diag.to_numpy() == pytest.approx(1.0)
    assert set(df.columns) >= {"model", "analysis", "metric", "layer", "head", "token_view", "value",
                               "model_b", "layer_b", "tap", "tap_b", "n_images", "batch_size"}


def test_cross_model_cka_from_separate_runs():
    va, vb = tiny("vit"), tiny("beit")
    va.name, vb.name = "A", "B"
    a = _run("cka", va, _batches(va), batch_size=5, views=["gap"])
    b = _run("cka", vb, _batches(vb), batch_size=5, views=["gap"])
    cross = type(a).cross([a, b])
    x = torch.cat([bt.images for bt in _batches(va)])
    fa = vs.extract(va, x, ["block1.out"], view="gap")["block1.out"]
    fb = vs.extract(vb, x, ["block2.out"], view="gap")["block2.out"]
    got = cross[(cross.tap == "block1.out") & (cross.tap_b == "block2.out")]
    assert (got.model.iloc[0], got.model_b.iloc[0]) == ("A", "B")
    assert float(got.value.iloc[0]) == pytest.approx(vs.cka(fa, fb, batch_size=5), rel=1e-6)


def test_cross_model_cka_refuses_different_images():
    va, vb = tiny("vit"), tiny("vit", seed=1)
    a = _run("cka", va, _batches(va, n=10, bs=5), batch_size=5)
    b = _run("cka", vb, _batches(vb, n=10, bs=5, start=5), batch_size=5)
    with pytest.warns(UserWarning, match="different images"):
        assert type(a).cross([a, b]) is None


def test_stream_hands_each_analysis_only_its_taps():
    vm = tiny("vit")

    class Greedy(get_analysis("attention_distance")):
        def update(self, feats, batch):
            feats["block0.out"]  # not declared

    with pytest.raises(KeyError, match="required_taps"):
        stream(vm, _batches(vm, n=4, bs=4), [Greedy(vm)], progress=False)


def test_batch_type_len():
    b = Batch(images=torch.zeros(3, 3, 8, 8), index=torch.arange(3))
    assert len(b) == 3


def test_cross_model_cka_pairs_batches_by_image_ids_not_arrival_order():
    va, vb = tiny("vit"), tiny("beit")
    va.name, vb.name = "A", "B"
    batches = _batches(va, n=20, bs=5)
    a = _run("cka", va, batches, batch_size=5, views=["gap"])
    b = _run("cka", vb, batches[::-1], batch_size=5, views=["gap"])  # same CKA batches, reversed order
    b_in_order = _run("cka", vb, batches, batch_size=5, views=["gap"])
    got, ref = type(a).cross([a, b]), type(a).cross([a, b_in_order])
    # the reversed run shifts its float32 Grams by another first-batch mean: float32 rounding only
    assert got.value.to_numpy() == pytest.approx(ref.value.to_numpy(), rel=1e-6, abs=1e-7)
