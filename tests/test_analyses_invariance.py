"""The `stir` pair analysis, fed by hand (update / merge / state_dict / finalize), on two tiny models."""

import copy
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import vitscope as vs
from vitscope.analyses.invariance import Stir, dynamics
from vitscope.data.base import Batch
from vitscope.errors import InputError, VitscopeError

SMALL = dict(img_size=16, patch_size=4, embed_dim=48, depth=3, num_heads=3, num_classes=4)
KW = dict(iterations=4, layers=[0, 2], corruptions=["gaussian_noise:3", "contrast:5"])


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (conftest)


def model(seed: int, **kw) -> vs.ViTModel:
    torch.manual_seed(seed)
    return vs.load_model("vit_small_patch16_224", pretrained=False, seed=seed, **{**SMALL, **kw})


def pair():
    pt = model(0)
    ft = copy.deepcopy(pt)
    ft.name = "ft"
    with torch.no_grad():  # a "fine-tuned" copy: the deeper blocks moved
        for p in ft.model.blocks[1:].parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return pt, ft


def batches(n_batches: int = 3, b: int = 6):
    g = torch.Generator().manual_seed(1)
    for k in range(n_batches):
        yield Batch(images=torch.randn(b, 3, 16, 16, generator=g).clamp(-2, 2),
                    index=torch.arange(k * b, (k + 1) * b), labels=torch.randint(0, 4, (b,), generator=g))


def run(pt, ft, bs, store=None, **kw):
    a = Stir(pt.info(), ft.info(), **{**KW, **kw})
    if store is not None:
        a.store = store
    for batch in bs:
        a.update(pt, ft, batch)
    return a


def test_pair_table_formulas_and_settings():
    pt, ft = pair()
    a = run(pt, ft, batches())
    df = a.finalize()
    assert not df.isna()[["value"]].any().any()
    assert set(df.model) == {pt.name} and set(df.model_b) == {"ft"}
    assert (df.iterations == 4).all() and (df.images == 18).all()
    v = {(r.metric, r.layer, r.layer_b): r.value for r in df.itertuples() if r.metric != "accuracy"}
    for i in (0, 2):
        assert math.isclose(v[("forgetting", i, i)], 1 - v[("stir_b|a", i, i)])
        assert math.isclose(v[("learning", i, i)], 1 - v[("stir_a|b", i, i)])
        assert math.isclose(v[("cka_divergence", i, i)], 1 - v[("cka", i, i)])
    assert math.isclose(v[("invariance_flow", 2, 0)], v[("stir_b|a", 2, 0)] - v[("stir_b|a", 2, 2)])
    fid = {r.layer: r.value for r in df[df.metric == "fidelity_a"].itertuples()}
    for i in (0, 2):  # eq. 2 with its first term measured
        assert math.isclose(v[("forgetting_vs_self", i, i)], fid[i] - v[("stir_b|a", i, i)])
    # block 0 is untouched by the "fine-tuning": no cka divergence there, some at block 2
    assert v[("cka_divergence", 0, 0)] < 1e-6 < v[("cka_divergence", 2, 2)]
    acc = df[df.metric == "accuracy"]
    assert list(acc.corruption) == ["clean", "gaussian_noise:3", "contrast:5"]


def test_same_model_diagonal_is_one():
    pt, _ = pair()
    same = copy.deepcopy(pt)
    with torch.no_grad():  # a new head (a fine-tuning run's epoch 0): the encoder, all the taps read, is the same
        same.model.head.weight.normal_()
    df = run(pt, same, batches(2), iterations=2).finalize()
    s = df[df.metric.isin(["stir_b|a", "stir_a|b"])]
    assert np.allclose(s[s.layer == s.layer_b].value, 1.0)
    assert np.allclose(df[df.metric == "forgetting"].value, 0.0)
    assert np.allclose(df[df.metric == "forgetting_vs_self"].value, 0.0)
    assert (df[df.metric == "fidelity_a"].value < 0.999).all()  # the measured self-STIR, for the record


def test_resume_and_merge_give_the_same_numbers(tmp_path):
    pt, ft = pair()
    bs = list(batches(4))
    full = run(pt, ft, bs).finalize()
    # interrupted after two batches: state saved, a new accumulator loads it and sees the rest
    first = run(pt, ft, bs[:2])
    resumed = Stir(pt.info(), ft.info(), **KW)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    for b in bs[2:]:
        resumed.update(pt, ft, b)
    out = resumed.finalize()
    assert np.array_equal(out.value.to_numpy(), full.value.to_numpy())
    # shards merged
    other = run(pt, ft, bs[2:])
    first.merge(other)
    assert np.allclose(first.finalize().value.to_numpy(), full.value.to_numpy(), rtol=1e-12, atol=1e-12)


def test_pretrained_inversions_are_cached_and_reused(tmp_path):
    pt, ft = pair()
    bs = list(batches(2))
    store = lambda key: tmp_path / key  # noqa: E731
    first = run(pt, ft, bs, store=store)
    assert first.cache_hits == 0 and len(list(tmp_path.rglob("*.safetensors"))) == 2
    ft2 = copy.deepcopy(ft)
    ft2.name = "ft@e2"
    again = run(pt, ft2, bs, store=store)
    assert again.cache_hits == 2  # A's inversions served the second fine-tuned model
    f1, f2 = first.finalize(), again.finalize()
    assert np.array_equal(f1.value.to_numpy(), f2.value.to_numpy())


def test_dynamics_correlation_over_epochs():
    import scipy.stats

    pt, ft = pair()
    finished = []
    for ep in range(4):
        m = copy.deepcopy(ft)
        torch.manual_seed(ep)
        with torch.no_grad():  # epochs differ in their deep block and their head (so in accuracy)
            for p in [*m.model.blocks[2].parameters(), *m.model.head.parameters()]:
                p.add_(torch.randn_like(p) * 0.3 * ep)
        a = run(pt, m, batches(2), iterations=1, layers=None)
        a.epoch = ep
        a.model_b = f"ft@e{ep}"
        finished.append(a)
    df = Stir.cross(finished)
    acc = df[df.metric == "dynamics:corrupted_accuracy"].sort_values("epoch")
    assert list(acc.epoch) == [0, 1, 2, 3]
    fstd = df[df.metric == "dynamics:forgetting_std_from_layer2"].sort_values("epoch")
    ref = scipy.stats.pearsonr(fstd.value, acc.value)
    r = df[(df.metric == "pearson_r") & (df.series == "forgetting_std_from_layer2")].value.item()
    p = df[(df.metric == "pearson_p") & (df.series == "forgetting_std_from_layer2")].value.item()
    assert math.isclose(r, ref[0], rel_tol=1e-9) and math.isclose(p, ref[1], rel_tol=1e-6)
    # the baseline any series that grows with training meets: clean accuracy's own correlation
    clean = df[df.metric == "dynamics:clean_accuracy"].sort_values("epoch")
    r = df[(df.metric == "pearson_r") & (df.series == "clean_accuracy")].value.item()
    assert math.isclose(r, scipy.stats.pearsonr(clean.value, acc.value)[0], rel_tol=1e-9)
    assert dynamics(finished, pt.name, "ft") is not None


def test_bad_input():
    pt, ft = pair()
    other = model(3, img_size=32)
    a = Stir(pt.info(), other.info(), **KW)
    with pytest.raises(InputError, match="same input"):
        a.update(pt, other, next(batches(1)))
    with pytest.raises(VitscopeError, match="out of range"):
        Stir(pt.info(), ft.info(), layers=[5])
    with pytest.raises(VitscopeError, match="did you mean attn_out"):
        Stir(pt.info(), ft.info(), tap="attn_ot")
    with pytest.raises(VitscopeError, match="unknown corruption"):
        Stir(pt.info(), ft.info(), corruptions=["fgo"])
    broken = copy.deepcopy(ft)
    with torch.no_grad():
        broken.model.blocks[0].norm1.weight[0] = math.nan
    from vitscope.capture.engine import NonFiniteError

    with pytest.raises(NonFiniteError, match="non-finite"):  # one sentence naming the model: no NaN in tables
        run(pt, broken, batches(1), corruptions=None).finalize()


def test_every_derived_metric_carries_its_spread_over_the_repeats():
    """learning / forgetting / flow are computed per repeat; their spread is the sample std over the repeats
    (checked against `statistics.stdev` of the per-repeat STIR grids), not 0."""
    import statistics

    pt, ft = pair()
    a = run(pt, ft, batches(2), repeats=3, corruptions=None)
    df = a.finalize()
    per_r = a.sums["ba"].values().numpy()  # (R, J inverted at A, I measured at B) over layers [0, 2]
    per_r_aa = a.sums["aa"].values().numpy()
    row = {(r.metric, r.layer, r.layer_b): r for r in df.itertuples()}
    for k, i in enumerate((0, 2)):
        want = statistics.stdev(1 - per_r[r, k, k] for r in range(3))
        assert want > 0 and math.isclose(row[("forgetting", i, i)].spread, want, rel_tol=1e-9)
        want = statistics.stdev(per_r_aa[r, k, k] - per_r[r, k, k] for r in range(3))
        assert math.isclose(row[("forgetting_vs_self", i, i)].spread, want, rel_tol=1e-9)
        assert row[("cka_divergence", i, i)].spread == 0  # no inversion in it
    want = statistics.stdev(per_r[r, 1, 0] - per_r[r, 1, 1] for r in range(3))
    assert want > 0 and math.isclose(row[("invariance_flow", 2, 0)].spread, want, rel_tol=1e-9)
    assert not df.spread.isna().any()
    # the repeat interval: mean ± t(2) spread / sqrt(3) (t = 4.303), none on the derived flow summaries
    for key in [("forgetting", 0, 0), ("invariance_flow", 2, 0), ("stir_b|a", 0, 2)]:
        r = row[key]
        assert math.isclose(r.stderr, r.spread / math.sqrt(3), rel_tol=1e-9)
        assert math.isclose(r.value_hi - r.value, 4.302653 * r.stderr, rel_tol=1e-6)
        assert math.isclose(r.value - r.value_lo, r.value_hi - r.value, rel_tol=1e-9)
    assert df[df.metric.str.startswith("flow_")]["value_lo"].isna().all()


def test_the_dynamics_use_the_robustness_lens_corruptions_with_cifar10c_constants():
    from vitscope.analyses.invariance import _parse_corruptions

    assert _parse_corruptions("default") == [(k, s) for k in ("gaussian_noise", "gaussian_blur", "contrast")
                                             for s in (3, 5)]
    assert _parse_corruptions(["contrast:1,5"]) == [("contrast", 1), ("contrast", 5)]
    with pytest.raises(VitscopeError, match="unknown corruption .contrats'; did you mean contrast"):
        _parse_corruptions(["contrats"])
    with pytest.raises(VitscopeError, match="native corruptions only"):  # no CIFAR-10-C constants here
        _parse_corruptions(["fog:3"])


def test_in_a_study_with_a_checkpoint_list(tmp_path):
    """stir as a pair stage of the engine: pt -> each checkpoint of a fine-tuning run, pt's inversions made once,
    a rerun served from the cache, the dynamics (epochs, Pearson) in the cross-model table."""
    from vitscope.models.load import save_checkpoint
    from vitscope.study import load_config, run_study

    run_dir = tmp_path / "ft" / "checkpoints"
    run_dir.mkdir(parents=True)
    tiny = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10)
    pt = vs.load_model("vit_small_patch16_224", pretrained=False, seed=0, **tiny)
    for e in range(3):
        vm = copy.deepcopy(pt)
        torch.manual_seed(e)
        with torch.no_grad():
            for p in vm.model.blocks[1].parameters():
                p.add_(torch.randn_like(p) * 0.2 * e)
        save_checkpoint(vm.model, run_dir / f"encoder_epoch{e:03d}.safetensors", vm.spec)
    kw = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, num_classes: 10}"
    (tmp_path / "s.yaml").write_text(f"""
models:
  - {{name: vit_small_patch16_224, label: pt, pretrained: false, kwargs: {kw}}}
  - {{label: ft, checkpoints: {tmp_path / 'ft'}, finetuned_from: pt}}
dataset: {{name: cifar10-test-1k, n_images: 16}}
analyses:
  stir: {{iterations: 2, corruptions: ["contrast:5"]}}
batch_size: 8
progress: false
""")
    cfg = load_config(tmp_path / "s.yaml", [f"output_dir={tmp_path / 'run'}"])
    out = run_study(cfg)
    df = pd.read_parquet(next(Path(out).rglob("stir*.parquet")))
    assert set(df.model_b.dropna()) >= {"ft@0", "ft@1", "ft@2"}
    pairs = df[df.metric == "forgetting"]
    assert len(pairs) == 3 * 2 and not pairs.value.isna().any()
    assert set(df[df.metric == "pearson_r"].series) or df[df.metric.str.startswith("dynamics:")].epoch.nunique() == 3
    inv = [f for f in tmp_path.rglob("*.safetensors") if "store" in f.parts]
    assert len(inv) == 2  # pt's inversions, in the study cache: two batches, made once for the three checkpoints
    again = pd.read_parquet(next(Path(run_study(cfg)).rglob("stir*.parquet")))  # a rerun: from the cache
    assert np.array_equal(again.value.to_numpy(), df.value.to_numpy())
    # a pair stage recomputed (here: a new version of the analysis) rewrites the tables, though every
    # single-model analysis (none here) and the config are unchanged
    from vitscope.analyses.invariance import Stir as _Stir

    table = next(Path(out).rglob("stir*.parquet"))
    before = table.stat().st_mtime_ns
    try:
        _Stir.state_version += 100
        run_study(cfg)
    finally:
        _Stir.state_version -= 100
    assert table.stat().st_mtime_ns != before
    # back to the old version: every state comes from the cache, but the tables on disk are the other version's
    before = table.stat().st_mtime_ns
    run_study(cfg)
    assert table.stat().st_mtime_ns != before
    assert np.array_equal(pd.read_parquet(table).value.to_numpy(), df.value.to_numpy())


def test_the_public_stir_estimator_is_an_option_named_in_the_table():
    """cka_estimator: last_batch_biased reports the biased linear CKA of the last batch (the public STIR code's
    CKA): its `cka` rows equal a numpy reference on that batch's features; resumed and merged runs pick the same
    batch; the default is unchanged and every row names its estimator."""
    from vitscope.invariance import measure

    pt, ft = pair()
    bs = list(batches(3))
    a = run(pt, ft, bs, cka_estimator="last_batch_biased", corruptions=None)
    df = a.finalize()
    assert set(df.cka_estimator) == {"last_batch_biased"}
    fa = measure(pt, bs[-1].images, ["block0.out", "block2.out"], "all")
    fb = measure(ft, bs[-1].images, ["block0.out", "block2.out"], "all")
    n = len(bs[-1].images)
    h = np.eye(n) - np.ones((n, n)) / n
    for i, li in enumerate((0, 2)):
        for j, lj in enumerate((0, 2)):
            k, l_ = (h @ (f.double().numpy() @ f.double().numpy().T) @ h for f in (fa[i], fb[j]))
            want = (k * l_).sum() / math.sqrt((k * k).sum() * (l_ * l_).sum())
            got = df[(df.metric == "cka") & (df.layer == li) & (df.layer_b == lj)].value.item()
            assert math.isclose(got, want, rel_tol=1e-6)
    # shards merged in either order, and a resumed run, pick the same last batch
    for first_part, second_part in ((bs[:2], bs[2:]), (bs[2:], bs[:2])):
        x = run(pt, ft, first_part, cka_estimator="last_batch_biased", corruptions=None)
        y = run(pt, ft, second_part, cka_estimator="last_batch_biased", corruptions=None)
        x.merge(y)
        assert np.allclose(x.finalize().value.to_numpy(), df.value.to_numpy(), rtol=1e-12, atol=1e-12)
    resumed = Stir(pt.info(), ft.info(), **{**KW, "cka_estimator": "last_batch_biased", "corruptions": None})
    resumed.load_state_dict(copy.deepcopy(run(pt, ft, bs[:2], cka_estimator="last_batch_biased",
                                              corruptions=None).state_dict()))
    resumed.update(pt, ft, bs[2])
    assert np.array_equal(resumed.finalize().value.to_numpy(), df.value.to_numpy())
    default = run(pt, ft, bs, corruptions=None).finalize()
    assert set(default.cka_estimator) == {"minibatch_unbiased"}
    got = default.set_index(["metric", "layer", "layer_b"]).value
    last = df.set_index(["metric", "layer", "layer_b"]).value
    assert not math.isclose(got[("cka", 2, 2)], last[("cka", 2, 2)], rel_tol=1e-3)


def test_an_unknown_cka_estimator_is_one_sentence_at_config_time():
    from vitscope.errors import ConfigError

    with pytest.raises(ConfigError, match="cka_estimator 'biased' does not exist; choose minibatch_unbiased or "
                                          "last_batch_biased"):
        Stir.views({"cka_estimator": "biased"})  # the planner calls it before any model loads
    assert Stir.views({"cka_estimator": "last_batch_biased"}) == ["clean"]
    pt, ft = pair()
    with pytest.raises(ConfigError, match="does not exist"):
        Stir(pt.info(), ft.info(), cka_estimator="unbiased")


def test_a_pair_analysis_outside_a_study_removes_its_temporary_store_with_itself(tmp_path, monkeypatch):
    """Outside a study (no cache) `store` is a temporary folder; it went with nothing and stayed in /tmp. Only
    that folder goes: a user's file beside it in the temporary directory, and a study's cache store, stay."""
    import gc
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "users-notes.txt").write_text("mine")
    pt, ft = pair()
    a = Stir(pt.info(), ft.info(), **KW)
    d = a.store("products")
    (d / "x.pt").write_bytes(b"data")
    root = d.parent
    assert root.parent == tmp_path and a.store("other").parent == root and root.is_dir()  # one folder
    del a
    gc.collect()
    assert not root.exists() and (tmp_path / "users-notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob("vitscope-store-*"))
    cached = tmp_path / "cache-store"  # in a study the planner sets the store: a cache folder, never removed
    b = Stir(pt.info(), ft.info(), **KW)
    b._store = lambda key: (cached / key).mkdir(parents=True, exist_ok=True) or cached / key
    (b.store("products") / "x.pt").write_bytes(b"data")
    del b
    gc.collect()
    assert (cached / "products" / "x.pt").read_bytes() == b"data"
