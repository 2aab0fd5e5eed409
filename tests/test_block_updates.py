"""block_updates (how blocks move tokens) against slow references written here: loops over images and tokens on
the raw taps of `vitscope.capture.engine.extract` (numpy, float64, no code shared with
vitscope.metrics.block_updates), the token picture against a PCA by numpy's SVD, Student t intervals by scipy,
and the accumulator protocol (shards, resume)."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.capture.engine import extract
from vitscope.data import SyntheticShapes

pytestmark = pytest.mark.usefixtures("one_thread")

STATS = ["attn_update", "mlp_update", "attn_share", "mlp_share", "displacement", "unison_cosine", "unison_share"]


def _batches(vm, n=7, bs=3, seed=1):
    return list(SyntheticShapes(n=n, seed=seed).batches(bs, vm.preprocessing))


def _run(vm, batches, **params):
    a = get_analysis("block_updates")(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def _fed(vm, batches, **params):
    a = get_analysis("block_updates")(vm, **params)
    for b in batches:
        with vs.Capture(vm, a.required_taps()) as cap:
            a.update(cap(b.images), b)
    return a


def _taps(vm, batches, layers):
    every = sorted({*layers, *(i - 1 for i in layers if i > 0)})  # the blocks and the ones feeding them
    names = ["embed"] + [f"block{i}.{t}" for i in every for t in ("attn_out", "resid_mid", "mlp_out", "out")]
    got = extract(vm, [b.images for b in batches], names, batch_size=len(batches[0].images))
    return {k: v.double().numpy() for k, v in got.items()}


def _unit(v):
    n = np.sqrt((v * v).sum())
    return v / n


def _ref_image(x_in, a, mid, m, out, p, has_cls):
    """{(view, stat): value} of one image, a loop over its tokens (and over pairs of patch tokens)."""
    per_token = []
    for t in range(len(x_in)):
        na, nm = np.linalg.norm(a[t]), np.linalg.norm(m[t])
        per_token.append([na / np.linalg.norm(x_in[t]), nm / np.linalg.norm(mid[t]), na / (na + nm), nm / (na + nm),
                          np.linalg.norm(out[t] - x_in[t]) / np.linalg.norm(x_in[t])])
    per_token = np.array(per_token)
    res = {("spatial", s): float(np.mean(per_token[p:, k])) for k, s in enumerate(STATS[:5])}
    if has_cls:
        res.update({("cls", s): float(per_token[0, k]) for k, s in enumerate(STATS[:5])})
    d = [out[t] - x_in[t] for t in range(p, len(x_in))]
    cos = [float(_unit(d[i]) @ _unit(d[j])) for i in range(len(d)) for j in range(len(d)) if i != j]
    res[("spatial", "unison_cosine")] = float(np.mean(cos))
    mean_d = np.mean(d, axis=0)
    res[("spatial", "unison_share")] = float(mean_d @ mean_d / np.mean([x @ x for x in d]))
    return res


def _ref_table(vm, batches, layers):
    """Per (layer, view, stat): the per-image values of the slow reference."""
    taps = _taps(vm, batches, layers)
    p = vm.num_prefix_tokens
    per: dict[tuple[int, str, str], list[float]] = {}
    for i in layers:
        x_in = taps["embed"] if i == 0 else taps[f"block{i - 1}.out"]
        a, mid, m, out = (taps[f"block{i}.{t}"] for t in ("attn_out", "resid_mid", "mlp_out", "out"))
        for b in range(len(x_in)):
            for (view, s), v in _ref_image(x_in[b], a[b], mid[b], m[b], out[b], p, vm.has_cls_token).items():
                per.setdefault((i, view, s), []).append(v)
    return per


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_statistics_and_t_intervals_match_a_loop_over_images_and_tokens(kind):
    vm = tiny(kind)
    batches = _batches(vm)
    layers = [0, 2] if kind == "vit" else [1, 2]
    df = _run(vm, batches, layers=layers, keep_images=0).finalize()
    ref = _ref_table(vm, batches, layers)
    stat = df[df.metric != "token_position"]
    assert (df.metric == "token_position").sum() == 0  # keep_images 0: no picture
    assert len(stat) == len(ref)  # every (layer, view, stat) the reference has, and no other
    for (i, view, s), vals in ref.items():
        row = stat[(stat.layer == i) & (stat.token_view == view) & (stat.metric == s)]
        assert len(row) == 1, (i, view, s)
        r = row.iloc[0]
        v = np.array(vals)
        n = len(v)
        mean, se = v.mean(), v.std(ddof=1) / np.sqrt(n)
        half = stats.t.ppf(0.975, n - 1) * se
        assert r.n == n == 7
        assert r.value == pytest.approx(mean, rel=1e-5, abs=1e-6), (i, view, s)
        assert r.stderr == pytest.approx(se, rel=1e-4, abs=1e-7), (i, view, s)
        assert r.value_lo == pytest.approx(mean - half, rel=1e-4, abs=1e-6)
        assert r.value_hi == pytest.approx(mean + half, rel=1e-4, abs=1e-6)
        assert r.value_lo <= r.value <= r.value_hi
        assert r.value_hi - r.value_lo > 2 * 1.96 * r.stderr  # Student's t with 6 df is wider than the normal
    # the shares are complements, per image, so their means are too
    for view in stat.token_view.unique():
        a = stat[(stat.metric == "attn_share") & (stat.token_view == view)].value.to_numpy()
        m = stat[(stat.metric == "mlp_share") & (stat.token_view == view)].value.to_numpy()
        assert a + m == pytest.approx(np.ones_like(a), abs=1e-9)
    assert set(stat[stat.token_view == "cls"].metric) == set(STATS[:5])  # no unison for a single token


def test_unison_of_a_pure_translation_is_one_and_of_independent_moves_near_zero():
    from vitscope.metrics.block_updates import unison

    g = torch.Generator().manual_seed(0)
    c = torch.randn(1, 1, 32, generator=g, dtype=torch.float64)
    same = unison(c.expand(2, 50, 32).clone())
    assert same.numpy() == pytest.approx(np.ones((2, 2)), abs=1e-6)
    indep = unison(torch.randn(1, 400, 4096, generator=g)).numpy()[0]
    assert abs(indep[0]) < 0.01  # mean cosine of unrelated directions
    assert indep[1] == pytest.approx(1 / 400, rel=0.2)  # balanced independent moves: 1 / T
    # a token that does not move counts in no pair
    d = torch.randn(3, 6, 8, generator=g)
    d[:, 2] = 0
    got = unison(d).numpy()
    for b in range(3):
        moving = [d[b, t].double().numpy() for t in range(6) if t != 2]
        cos = [_unit(x) @ _unit(y) for i, x in enumerate(moving) for j, y in enumerate(moving) if i != j]
        assert got[b, 0] == pytest.approx(np.mean(cos), abs=1e-5)


def _ref_projection(before, after, p):
    """PCA by numpy's SVD of the centred patch tokens of ``before``; both arrays on its first two axes."""
    x = before[p:]
    mu = x.mean(0)
    _, s, vt = np.linalg.svd(x - mu, full_matrices=False)
    return (before - mu) @ vt[:2].T, (after - mu) @ vt[:2].T, float((s[:2] ** 2).sum() / (s ** 2).sum())


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_token_picture_is_the_input_pca_applied_to_the_output_for_the_smallest_ids(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=7, bs=3)
    # fed in reverse order: the kept images are still those of smallest id
    a = _run(vm, batches[::-1], layers=[0], picture_layers=[0, 2], keep_images=2)
    df = a.finalize()
    pic = df[df.metric == "token_position"]
    assert sorted(pic["image"].unique()) == [0, 1]
    assert sorted(pic.layer.unique()) == [0, 2]
    p = vm.num_prefix_tokens
    taps = _taps(vm, batches, [0, 1, 2])
    for image in (0, 1):
        for layer in (0, 2):
            x_in = (taps["embed"] if layer == 0 else taps[f"block{layer - 1}.out"])[image]
            x_out = taps[f"block{layer}.out"][image]
            before, after, share = _ref_projection(x_in, x_out, p)
            rows = pic[(pic["image"] == image) & (pic.layer == layer)]
            views = [("spatial", np.arange(p, len(x_in)))] + ([("cls", np.array([0]))] if vm.has_cls_token else [])
            assert len(rows) == sum(len(idx) for _, idx in views)
            got_b, got_a, want_b, want_a, values = [], [], [], [], []
            for view, idx in views:
                r = rows[rows.token_view == view].sort_values("token")
                assert list(r.token) == list(range(len(idx)))
                got_b.append(r[["x_before", "y_before"]].to_numpy(float))
                got_a.append(r[["x_after", "y_after"]].to_numpy(float))
                values.append(r.value.to_numpy(float))
                want_b.append(before[idx])
                want_a.append(after[idx])
            gb, ga, wb, wa = (np.concatenate(v) for v in (got_b, got_a, want_b, want_a))
            sign = np.sign((gb * wb).sum(0))  # an axis's sign is a convention: align each with the reference
            assert np.all(sign != 0)
            assert gb == pytest.approx(wb * sign, rel=1e-4, abs=1e-4)
            assert ga == pytest.approx(wa * sign, rel=1e-4, abs=1e-4)
            assert rows.pca_variance.iloc[0] == pytest.approx(share, rel=1e-5)
            assert np.concatenate(values) == pytest.approx(np.hypot(*(wa - wb).T), rel=1e-4, abs=1e-5)


def _equal_tables(got, ref):
    assert list(got.columns) == list(ref.columns) and len(got) == len(ref)
    for col in ("value", "stderr", "value_lo", "value_hi", "x_before", "y_after"):
        assert got[col].to_numpy(dtype=float) == pytest.approx(ref[col].to_numpy(dtype=float), rel=1e-9, abs=1e-12,
                                                                nan_ok=True), col


def test_merge_of_two_shards_and_resume_equal_one_pass():
    vm = tiny("reg")
    batches = _batches(vm, n=7, bs=3)
    params = {"layers": [0, 2], "picture_layers": [1], "keep_images": 2}
    whole = _fed(vm, batches, **params)
    first, second = _fed(vm, batches[1:], **params), _fed(vm, batches[:1], **params)
    first.merge(second)  # the later shard first: its kept images are displaced by the earlier shard's smaller ids
    part = _fed(vm, batches[:1], **params)
    resumed = get_analysis("block_updates")(vm, **params)
    resumed.load_state_dict(part.state_dict())
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    assert sorted(ref[ref.metric == "token_position"]["image"].unique()) == [0, 1]
    for other in (first, resumed):
        _equal_tables(other.finalize(), ref)
    with pytest.raises(vs.VitscopeError, match="different settings"):
        whole.merge(get_analysis("block_updates")(vm, **{**params, "keep_images": 1}))


def test_a_model_without_cls_token_reports_the_patch_tokens_only():
    vm = vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48, depth=3,
                       num_heads=3, class_token=False, reg_tokens=2, global_pool="avg")
    batches = _batches(vm, n=4, bs=2)
    df = _run(vm, batches, layers=[1]).finalize()
    assert set(df.token_view) == {"spatial"}
    ref = _ref_table(vm, batches, [1])
    for (i, view, s), vals in ref.items():
        r = df[(df.layer == i) & (df.token_view == view) & (df.metric == s)].iloc[0]
        assert r.value == pytest.approx(np.mean(vals), rel=1e-5, abs=1e-6)
    pic = df[df.metric == "token_position"]
    assert len(pic) == len(pic.layer.unique()) * 16  # the 4x4 patch tokens, registers left out


def test_parameters_are_refused_in_one_sentence():
    from vitscope.analyses.base import validate_params

    cls = get_analysis("block_updates")
    with pytest.raises(vs.ConfigError, match="keep_images"):
        validate_params(cls, {"keep_images": -1})
    validate_params(cls, {"keep_images": 0, "layers": [0, -1], "picture_layers": [1]})
    with pytest.raises(vs.VitscopeError, match="out of range"):
        cls(tiny("vit"), picture_layers=[5])
    from vitscope.analyses.mechanistic.block_updates import default_picture_layers

    assert default_picture_layers(12) == [0, 4, 7, 11] and default_picture_layers(2) == [0, 1]


def test_figures_draw_from_a_two_model_run(tmp_path):
    import matplotlib.pyplot as plt

    from vitscope.references import ANALYSIS_REFERENCES
    from vitscope.report.figures import FIGURES

    assert ANALYSIS_REFERENCES["block_updates"] == ["park2023", "wang_clmm"]
    parts = []
    for kind, label in (("vit", "A"), ("reg", "B")):
        vm = tiny(kind)
        vm.name = label
        parts.append(_run(vm, _batches(vm, n=6, bs=3), keep_images=2).finalize())
    path = tmp_path / "block_updates.parquet"
    pd.concat(parts, ignore_index=True).to_parquet(path, index=False)  # as the study stores it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pandas/matplotlib warnings from the figure code
        figs = FIGURES["block_updates"](pd.read_parquet(path))
    assert len(figs) == 3  # spatial curves, CLS curves, the token picture
    curves, _, (caption, mosaic) = figs
    assert len([ax for ax in curves[1].axes if ax.lines]) == 4
    drawn = [ax for ax in mosaic.axes if ax.collections]
    assert len(drawn) == 2 * 2 * 3  # (2 models x 2 images) x 3 blocks, one quiver per token view
    assert "principal axes" in caption
    for _, fig in figs:
        plt.close(fig)
    assert FIGURES["block_updates"](parts[0].iloc[0:0]) == []


def test_update_reads_the_host_at_most_once_per_batch(monkeypatch):
    """The sums stay on the features' device; the kept images' ids are the one read (the token copy, in the
    batches that hold a kept image, is the device's one transfer: on the CPU it is a clone)."""
    from host_syncs import HostSyncs

    import vitscope.host

    monkeypatch.setattr(vitscope.host, "CPU_READS", False)
    vm = tiny("reg")
    a = get_analysis("block_updates")(vm, keep_images=2)
    counts = []
    for b in _batches(vm, n=9, bs=3):
        with vs.Capture(vm, a.required_taps()) as cap:
            feats = cap(b.images)
        with HostSyncs() as s:
            a.update(feats, b)
        counts.append(s.count)
    assert max(counts) <= 1, counts
    assert a.kept_ids == [0, 1]
    none = get_analysis("block_updates")(vm, keep_images=0)
    with HostSyncs() as s:
        none.update(feats, b)
    assert s.count == 0


@pytest.mark.slow  # a whole study of two tiny models (about 15 s)
def test_a_study_of_a_vit_and_a_beit_writes_the_table(tmp_path):
    from study_fixtures import TWO_TINY_MODELS, run_study_text

    text = TWO_TINY_MODELS + """dataset: {name: synthetic-shapes, n_images: 8}
analyses:
  block_updates: {keep_images: 1}
batch_size: 4
progress: false
"""
    tables, _ = run_study_text(tmp_path, text)
    df = tables["block_updates"]
    assert set(df.model) == {"tiny-vit", "tiny-beit"}
    for _, g in df.groupby("model"):
        assert set(g.metric) == {*STATS, "token_position"}
        assert (g[g.metric != "token_position"].n == 8).all()
        assert set(g[g.metric == "token_position"]["image"]) == {0}
