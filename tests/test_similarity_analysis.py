"""The `similarity` analysis: its grids against the measures on extracted features, the seeded subset (the same
for any chunking, shard split or resume), cross-model pairs, permutation nulls and bootstrap intervals."""

import types
import warnings

import numpy as np
import pytest
import torch

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.analyses.similarity import subset_keys
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.errors import VitscopeError
from vitscope.metrics import similarity as M

N = 24


def _batches(vm, n=N, fwd=6, start=0):
    bs = list(SyntheticShapes(n=n + start, seed=2).batches(fwd, vm.preprocessing))
    out = []
    for b in bs:
        keep = b.index >= start
        if keep.any():
            b.images, b.index = b.images[keep], b.index[keep]
            b.labels = b.labels[keep] if b.labels is not None else None
            out.append(b)
    return out


def _run(vm, batches, **params):
    a = get_analysis("similarity")(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def _gap(vm, batches, tap):
    x = torch.cat([b.images for b in batches])
    return vs.extract(vm, x, tap, view="gap")[tap].half()  # the analysis keeps float16


def _value(df, tap, tap_b, metric):
    return df[(df.tap == tap) & (df.tap_b == tap_b) & (df.metric == metric)].value.item()


def test_within_model_grid_equals_the_measures_on_extracted_features():
    vm = tiny("vit")
    batches = _batches(vm)
    a = _run(vm, batches, k=4, rsa_images=N, n_subset=100, grid="full", alphas=[0.0, 0.5, 1.0])
    df = a.finalize()
    f0, f2 = _gap(vm, batches, "block0.out"), _gap(vm, batches, "block2.out")
    assert _value(df, "block0.out", "block2.out", "procrustes") == pytest.approx(M.procrustes_distance(f0, f2))
    assert _value(df, "block2.out", "block0.out", "procrustes") == pytest.approx(M.procrustes_distance(f0, f2))
    assert _value(df, "block0.out", "block2.out", "ridge_r2") == pytest.approx(M.ridge_r2(f0, f2))
    assert _value(df, "block2.out", "block0.out", "ridge_r2") == pytest.approx(M.ridge_r2(f2, f0))
    assert _value(df, "block2.out", "block0.out", "pwcca") == pytest.approx(M.pwcca(f2, f0))
    assert _value(df, "block0.out", "block2.out", "angular_shape_alpha=0.5") == \
        pytest.approx(M.angular_shape_metric(f0, f2, 0.5))
    assert _value(df, "block0.out", "block2.out", "mutual_knn") == pytest.approx(M.mutual_knn(f0, f2, k=4))
    assert _value(df, "block0.out", "block2.out", "cknna") == pytest.approx(M.cknna(f0, f2, k=4))
    assert _value(df, "block2.out", "block0.out", "cknna") == pytest.approx(M.cknna(f2, f0, k=4))  # not a copy
    # RSA over the images in key order: the same images, so the same RDM comparison up to their order
    assert _value(df, "block0.out", "block2.out", "rsa_kendall") == pytest.approx(M.rsa(f0, f2)["rsa_kendall"])
    diag = df[(df.tap == df.tap_b) & (df.metric == "mean_cca")].value
    assert diag.to_numpy() == pytest.approx(1.0)
    n_metrics = df.metric.nunique()
    assert len(df) == 9 * n_metrics and set(df.n_images) == {N} and set(df.images_seen) == {N}


def test_the_subset_is_the_smallest_keys_whatever_the_chunking_shards_or_resumption():
    vm = tiny("vit")
    params = dict(taps="block-1.out", n_subset=7, measures=["mean_cca"])
    whole = _run(vm, _batches(vm, fwd=6), **params)
    other_chunks = _run(vm, _batches(vm, fwd=4), **params)
    first, second = _run(vm, _batches(vm, n=13, fwd=5), **params), _run(vm, _batches(vm, n=N - 13, start=13), **params)
    second.merge(first)  # shards gathered in any order
    resumed = get_analysis("similarity")(vm, **params)
    resumed.load_state_dict(second.state_dict())
    ids = torch.arange(N)
    expected = ids[np.lexsort((ids.numpy(), subset_keys(ids, 0).numpy()))][:7]  # by key, then id
    for a in (other_chunks, second, resumed):
        assert torch.equal(a.ids, whole.ids)
        assert torch.equal(a.feats["block2.out"], whole.feats["block2.out"])
    assert torch.equal(whole.ids, expected)
    assert whole.n_images == second.n_images == N
    other_seed = _run(vm, _batches(vm), **{**params, "seed": 1})
    assert not torch.equal(other_seed.ids, whole.ids)


def test_subset_keys_spread_uniformly():
    keys = subset_keys(torch.arange(20000), 3).double()
    kept = torch.argsort(keys)[:2000]  # the subset of 2,000: every tenth of the ids equally often
    counts = torch.bincount(kept // 2000, minlength=10)
    assert counts.min() > 150 and counts.max() < 250
    assert len(torch.unique(keys)) == 20000


def _fed(vm, feats: dict, ids, **params):
    """An analysis fed features by hand, (n, D) per tap, in batches of 16."""
    a = get_analysis("similarity")(vm, taps=list(feats), **params)
    for s in range(0, len(ids), 16):
        batch = types.SimpleNamespace(index=ids[s:s + 16], extra={})
        a.update({t: torch.as_tensor(x[s:s + 16]) for t, x in feats.items()}, batch)
    return a


def test_cross_model_rows_nulls_and_intervals():
    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    rng = np.random.default_rng(0)
    n, d = 200, 12
    x = rng.standard_normal((n, d)).astype(np.float32)
    related = (x @ np.linalg.qr(rng.standard_normal((d, d)))[0] + 0.3 * rng.standard_normal((n, d))).astype(np.float32)
    independent = rng.standard_normal((n, d)).astype(np.float32)
    ids = torch.arange(n)
    params = dict(k=10, rsa_images=60, n_permutations=99, n_groups=8, null_pairs="matched", grid="cross")
    a = _fed(vm_a, {"block0.out": x, "block1.out": x}, ids, **params)
    b = _fed(vm_b, {"block0.out": related, "block1.out": independent}, ids, **params)
    cross = type(a).cross([a, b])
    assert set(cross.model) == {"A"} and set(cross.model_b) == {"B"}
    xa, xb = torch.from_numpy(x).half(), torch.from_numpy(related).half()
    row = cross[(cross.tap == "block0.out") & (cross.tap_b == "block0.out")].set_index("metric")
    assert row.loc["svcca", "value"] == pytest.approx(M.svcca(xa, xb))
    assert row.loc["ridge_r2_reverse", "value"] == pytest.approx(M.ridge_r2(xb, xa))
    # the related pair beats every shuffle: p reaches 1 / (1 + 99); ridge R² has no null (its chance level is 0)
    ridge = row.index.str.startswith("ridge_r2")
    assert np.allclose(row.p_value[~ridge], 1 / 100) and (row.n_permutations[~ridge] == 99).all()
    assert row.loc[ridge, ["null_mean", "p_value", "n_permutations"]].isna().all().all()
    # every measure, the neighbour and RDM ones too, has a jackknife interval around its value
    assert row.value_lo.notna().all() and (row.n_groups == 8).all()
    assert (row.value_lo <= row.value).all() and (row.value <= row.value_hi).all()
    assert (row.stderr > 0).all()
    # matched pairs only: block0 with block0, block1 with block1
    assert cross.null_mean.notna().groupby([cross.tap, cross.tap_b]).any().to_dict() == {
        ("block0.out", "block0.out"): True, ("block0.out", "block1.out"): False,
        ("block1.out", "block0.out"): False, ("block1.out", "block1.out"): True}
    # independent features: the null sits where theory puts it, and the observed score inside it
    ind = cross[(cross.tap == "block1.out") & (cross.tap_b == "block1.out")].set_index("metric")
    assert ind.loc["mutual_knn", "null_mean"] == pytest.approx(10 / (n - 1), rel=0.25)
    assert abs(ind.loc["rsa_spearman", "null_mean"]) < 0.02
    assert abs(ind.loc["rsa_kendall", "null_mean"]) < 0.02
    nulls = ind[ind.null_mean.notna()]
    assert len(nulls) == len(ind) - 2  # all but ridge R² both ways
    assert (nulls.null_q05 <= nulls.null_mean).all() and (nulls.null_mean <= nulls.null_q95).all()


def test_jackknife_interval_equals_a_by_hand_jackknife():
    """The table's stderr and interval against the measures recomputed without each group, by hand: the
    group of the r-th kept image is r mod G, the kept images ordered by their subset key."""
    from scipy.stats import t

    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    rng = np.random.default_rng(3)
    n, d, g_count = 90, 6, 5
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (x[:, ::-1] + 0.7 * rng.standard_normal((n, d))).astype(np.float32)
    params = dict(k=4, rsa_images=30, n_permutations=0, n_groups=g_count,
                  measures=["mean_cca", "ridge_r2", "rsa", "mutual_knn", "procrustes"])
    a = _fed(vm_a, {"block0.out": x}, torch.arange(n), **params)
    b = _fed(vm_b, {"block0.out": y}, torch.arange(n), **params)
    row = type(a).cross([a, b]).set_index("metric")
    assert list(row.index) == list(row.index.unique())  # one pair, one row per metric
    xs, ys = a.feats["block0.out"].double().numpy(), b.feats["block0.out"].double().numpy()
    reps: dict[str, list[float]] = {}
    for g in range(g_count):
        keep = [r for r in range(n) if r % g_count != g]
        m_rsa = sum(1 for r in keep if r < 30)
        xk, yk = xs[keep], ys[keep]
        reps.setdefault("mean_cca", []).append(M.mean_cca(xk, yk))
        reps.setdefault("ridge_r2", []).append(M.ridge_r2(xk, yk))
        reps.setdefault("ridge_r2_reverse", []).append(M.ridge_r2(yk, xk))
        reps.setdefault("procrustes", []).append(M.procrustes_distance(xk, yk))
        reps.setdefault("mutual_knn", []).append(M.mutual_knn(xk, yk, k=4))
        reps.setdefault("rsa_spearman", []).append(M.rsa(xk[:m_rsa], yk[:m_rsa])["rsa_spearman"])
    for metric, v in reps.items():
        v = np.array(v)
        se = np.sqrt((g_count - 1) / g_count * ((v - v.mean()) ** 2).sum())
        assert row.loc[metric, "stderr"] == pytest.approx(se, rel=1e-6), metric
        half = t.ppf(0.975, g_count - 1) * se
        lo, hi = M.range_of(metric)
        assert row.loc[metric, "value_lo"] == pytest.approx(max(row.loc[metric, "value"] - half, lo), rel=1e-6)
        assert row.loc[metric, "value_hi"] == pytest.approx(min(row.loc[metric, "value"] + half, hi), rel=1e-6)


def test_default_tests_only_the_last_pair_and_old_parameters_say_what_replaced_them():
    from vitscope.analyses.base import validate_params

    cls = get_analysis("similarity")
    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    rng = np.random.default_rng(4)
    f = {f"block{i}.out": rng.standard_normal((60, 6)).astype(np.float32) for i in range(3)}
    a = _fed(vm_a, f, torch.arange(60), k=3, rsa_images=20, measures=["mean_cca"], n_groups=4)
    b = _fed(vm_b, f, torch.arange(60), k=3, rsa_images=20, measures=["mean_cca"], n_groups=4)
    cross = cls.cross([a, b])
    tested = cross[cross.p_value.notna()]
    assert list(zip(tested.tap, tested.tap_b, strict=True)) == [("block2.out", "block2.out")]
    assert tested.n_permutations.item() == 99 and tested.value_lo.notna().all()
    with pytest.raises(VitscopeError, match="no longer takes 'n_bootstrap'.*jackknife"):
        validate_params(cls, {"n_bootstrap": 20})
    with pytest.raises(VitscopeError, match="0 or at least 99"):
        validate_params(cls, {"n_permutations": 20})
    validate_params(cls, {"n_permutations": 0, "n_groups": 0})


def test_the_default_grid_is_matched_depths_across_models_drawn_as_profiles_with_their_intervals():
    import matplotlib.pyplot as plt
    import pandas as pd
    from matplotlib.container import ErrorbarContainer

    from vitscope.report.figures import FIGURES

    cls = get_analysis("similarity")
    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    rng = np.random.default_rng(7)
    fa = {f"block{i}.out": rng.standard_normal((60, 6)).astype(np.float32) for i in range(3)}
    fb = {f"block{i}.out": rng.standard_normal((60, 6)).astype(np.float32) for i in range(2)}  # a shallower B
    a = _fed(vm_a, fa, torch.arange(60), k=3, rsa_images=20, measures=["mean_cca", "ridge_r2"], n_groups=4)
    b = _fed(vm_b, fb, torch.arange(60), k=3, rsa_images=20, measures=["mean_cca", "ridge_r2"], n_groups=4)
    assert a.finalize().empty  # nothing within a model unless grid: full
    cross = cls.cross([a, b])
    # each of A's layers with B's at the same relative depth: 0 -> 0, 1 -> round(0.5) = 0, 2 -> 1
    assert set(zip(cross.tap, cross.tap_b, strict=True)) == {("block0.out", "block0.out"),
                                                             ("block1.out", "block0.out"),
                                                             ("block2.out", "block1.out")}
    assert set(cross.metric) == {"mean_cca", "ridge_r2", "ridge_r2_reverse"}
    (caption, fig), = FIGURES["similarity"](cross)
    assert "grid: full" in caption
    ax = next(ax for ax in fig.axes if ax.get_title().startswith("mean cca"))
    assert len(ax.lines) >= 1 and list(ax.lines[0].get_xdata()) == [0, 1, 2]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert bars  # the last pair's jackknife interval
    plt.close(fig)
    # one model alone with grid 'matched': no rows, said by the study (a warning "no rows for A: <empty_reason>")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cls.cross([a]) is None
    reason = a.empty_reason()
    assert "with grid 'matched' it has no rows within one model" in reason and "grid: full" in reason
    assert pd.isna(cross.p_value).sum() == len(cross) - 1  # nulls at the last pair only, not ridge R²


def test_cross_model_refuses_different_images():
    vm = tiny("vit")
    a = _run(vm, _batches(vm, n=12), taps="block-1.out", measures=["mean_cca"])
    b = _run(vm, _batches(vm, n=12, start=6), taps="block-1.out", measures=["mean_cca"])
    with pytest.warns(UserWarning, match="saw different images"):
        assert type(a).cross([a, b]) is None


def test_bad_parameters_are_one_sentence():
    vm = tiny("vit")
    cls = get_analysis("similarity")
    with pytest.raises(VitscopeError, match="not one vector per image"):
        cls(vm, view="spatial")
    with pytest.raises(VitscopeError, match="unknown similarity measure 'cca'"):
        cls(vm, measures=["cca"])
    with pytest.raises(VitscopeError, match="null_pairs"):
        cls(vm, null_pairs="some")
    with pytest.raises(VitscopeError, match="kept 3 images"):
        _run(vm, _batches(vm, n=3), taps="block-1.out").finalize()


def test_figures_show_the_table_reverse_scores_in_the_other_block_and_a_map_per_model():
    import matplotlib.pyplot as plt
    import pandas as pd
    from test_report_figures import _legend_problems

    from vitscope.report.figures import FIGURES

    vms = [tiny("vit"), tiny("vit", seed=5)]
    vms[0].name, vms[1].name = "A", "B"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((60, 8)).astype(np.float32)
    feats = [{f"block{i}.out": x * (i + 1) + rng.standard_normal((60, 8)).astype(np.float32) for i in range(3)}
             for _ in vms]
    an = [_fed(vm, f, torch.arange(60), k=5, n_permutations=0, n_groups=0, grid="full",
               measures=["ridge_r2", "angular_shape", "mutual_knn"], alphas=[0.0, 0.5, 1.0])
          for vm, f in zip(vms, feats, strict=True)]
    df = pd.concat([a.finalize() for a in an] + [type(an[0]).cross(an)], ignore_index=True)
    figs = FIGURES["similarity"](df)
    assert len(figs) == 2
    grid = figs[0][1]
    data = [ax for ax in grid.axes if ax.images and ax.get_label() != "<colorbar>"]
    titles = [ax.get_title() for ax in data]
    assert titles[:2] == ["shape metric (radians), alpha 0", "shape metric (radians), alpha 0.5"]
    ridge = next(ax for ax in data if ax.get_title().startswith("ridge"))
    got = np.asarray(ridge.images[0].get_array().filled(np.nan), dtype=float)
    cross = df[(df.model == "A") & (df.model_b == "B")]
    fwd = cross[(cross.metric == "ridge_r2") & (cross.tap == "block1.out") & (cross.tap_b == "block2.out")]
    rev = cross[(cross.metric == "ridge_r2_reverse") & (cross.tap == "block1.out") & (cross.tap_b == "block2.out")]
    assert got[1, 4 + 2] == pytest.approx(fwd.value.item())  # A's block1 (row 1) predicts B's block2 (column 6)
    assert got[4 + 2, 1] == pytest.approx(rev.value.item())  # B's block2 predicts A's block1
    assert fwd.value.item() != pytest.approx(rev.value.item())
    scales = [ax._colorbar.mappable for ax in grid.axes if ax.get_label() == "<colorbar>"]  # noqa: SLF001
    assert len(scales) == len(data)
    mds = figs[1][1]
    lines = [ln for ln in mds.axes[0].lines if ln.get_linestyle() == "-"]
    assert len(lines) == 2 and all(len(ln.get_xdata()) == 3 for ln in lines)  # one trajectory of 3 taps per model
    for _, fig in figs:
        assert _legend_problems(fig) == []
        plt.close(fig)


def test_a_study_writes_the_table_and_a_killed_run_resumes_to_the_same_table(tmp_path):
    import pandas as pd

    from vitscope.study import load_config, run_study

    kw = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
    (tmp_path / "study.yaml").write_text(f"""
models:
  - {{name: vit_small_patch16_224, label: a, pretrained: false, kwargs: {kw}}}
  - {{name: vit_small_patch16_224, label: b, pretrained: false, seed: 3, kwargs: {kw}}}
dataset: {{name: synthetic-shapes, n_images: 30}}
analyses:
  similarity: {{n_subset: 13, k: 3, rsa_images: 10, n_permutations: 99, n_groups: 3, grid: full}}
batch_size: 4
progress: false
""")
    cfg = tmp_path / "study.yaml"
    ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c-ref'}"]))

    class Killed(Exception):
        pass

    def kill(model, b):
        if b == 3:
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", "save_every=1", f"cache_dir={tmp_path / 'c-run'}"]
    with pytest.raises(Killed):
        run_study(load_config(cfg, over), on_batch=kill)
    out = run_study(load_config(cfg, over))
    a, b = (pd.read_parquet(d / "results" / "similarity.parquet") for d in (ref, out))
    pd.testing.assert_frame_equal(a, b)
    assert set(zip(a.model, a.model_b, strict=True)) == {("a", "a"), ("b", "b"), ("a", "b")}
    assert set(a.n_images) == {13, 10} and set(a.images_seen) == {30}
    assert a[a.model_b != a.model].null_mean.notna().any()
    assert "by the angular shape metric" in (out / "report.html").read_text()  # the MDS map is in the report


@pytest.mark.skipif(__import__("shutil").which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.slow  # its merge is checked in process (shards in any order); torchrun itself by tests/test_distributed.py
def test_torchrun_equals_one_process(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    kw = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
    cfg = tmp_path / "study.yaml"
    cfg.write_text(f"""
models:
  - {{name: vit_small_patch16_224, label: a, pretrained: false, kwargs: {kw}}}
  - {{name: vit_small_patch16_224, label: b, pretrained: false, seed: 3, kwargs: {kw}}}
dataset: {{name: synthetic-shapes, n_images: 40}}
analyses:
  similarity: {{n_subset: 17, k: 3, rsa_images: 9, n_permutations: 99, n_groups: 2}}
batch_size: 4
progress: false
""")
    script = str(Path(__file__).parent / "run_with_fixtures.py")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--quiet", "run", str(cfg),
                    f"output_dir={tmp_path / 'sharded'}"], check=True, timeout=300, env=env)
    subprocess.run([sys.executable, script, "--quiet", "run", str(cfg), f"output_dir={tmp_path / 'single'}"],
                   check=True, timeout=300, env=env)
    a, b = (pd.read_parquet(tmp_path / d / "results" / "similarity.parquet") for d in ("sharded", "single"))
    assert len(a) == len(b) > 0 and set(a.images_seen) == {40}
    pd.testing.assert_frame_equal(a, b)


def test_three_models_give_each_pair_what_the_pair_alone_gives():
    import pandas as pd

    rng = np.random.default_rng(7)
    an = []
    for name in ("A", "B", "C"):
        vm = tiny("vit")
        vm.name = name
        an.append(_fed(vm, {"block0.out": rng.standard_normal((40, 6)).astype(np.float32)}, torch.arange(40),
                       k=3, n_groups=4))
    cls = type(an[0])
    every = cls.cross(an)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        alone = cls.cross([an[a], an[b]])
        got = every[(every.model == an[a].model_name) & (every.model_b == an[b].model_name)]
        pd.testing.assert_frame_equal(got.reset_index(drop=True), alone.reset_index(drop=True))


def test_nulls_and_intervals_equal_the_pair_by_pair_loop_they_replaced():
    """The same seeded shuffles as the loop of commit b73785d, one `compare` per shuffle."""
    from similarity_before import compare_before

    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    rng = np.random.default_rng(3)
    n, d, m_rsa = 70, 9, 25
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (x @ rng.standard_normal((d, d)) + rng.standard_normal((n, d))).astype(np.float32)
    params = dict(k=5, rsa_images=m_rsa, n_permutations=99, n_groups=0, seed=4)
    a, b = _fed(vm_a, {"block0.out": x}, torch.arange(n), **params), _fed(vm_b, {"block0.out": y}, torch.arange(n),
                                                                          **params)
    row = type(a).cross([a, b]).set_index("metric")
    fa, fb = a.feats["block0.out"], b.feats["block0.out"]
    pa, pb = (M.prepare(f, k=5, rsa_images=m_rsa) for f in (fa, fb))
    rev = ["ridge_r2", "pwcca", "cknna"]
    null: dict = {}
    for p in range(99):
        g = np.random.default_rng([4, 1, 0, 0, p])
        shuffled = pb.permuted(np.concatenate([g.permutation(m_rsa), m_rsa + g.permutation(n - m_rsa)]))
        got = {m: v for m, v in compare_before(pa, shuffled).items()
               if not m.startswith("ridge") and m != "angular_shape_alpha=0.5"}  # not in the default alphas
        got.update({f"{m}_reverse": v for m, v in compare_before(shuffled, pa, rev[1:]).items()})
        for metric, v in got.items():
            null.setdefault(metric, []).append(v)
    assert set(null) == set(row.index[row.null_mean.notna()]) == set(row.index) - {"ridge_r2", "ridge_r2_reverse"}
    for metric, v in null.items():
        v = np.asarray(v)
        assert row.loc[metric, "null_mean"] == pytest.approx(v.mean(), rel=1e-9, abs=1e-7), metric
        assert row.loc[metric, "null_q95"] == pytest.approx(np.quantile(v, 0.95), rel=1e-9, abs=1e-7), metric
        assert row.loc[metric, "n_permutations"] == 99


def _splitmix64_reference(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """The uint64 NumPy recipe `subset_keys` follows in int64 tensor arithmetic (the slow reference)."""
    mix = 0x9E3779B97F4A7C15
    with np.errstate(over="ignore"):
        z = ids.numpy().astype(np.uint64) + np.uint64((int(seed) * mix + mix) % 2 ** 64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(1)).astype(np.int64))


@pytest.mark.parametrize("seed", [0, 3, -7, 2 ** 40 + 1])
def test_subset_keys_are_the_uint64_splitmix_bits_without_a_host_copy(seed):
    from host_syncs import HostSyncs

    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.arange(3000), torch.randint(-2 ** 62, 2 ** 62, (3000,), generator=g),
                     torch.tensor([2 ** 63 - 1, -2 ** 63])])
    with HostSyncs() as s:
        keys = subset_keys(ids, seed)
    assert s.count == 0, dict(s.where)
    assert keys.dtype == torch.long and bool((keys >= 0).all())
    assert torch.equal(keys, _splitmix64_reference(ids, seed))


def test_every_measure_is_symmetric_or_listed_as_asymmetric_and_then_given_both_ways():
    """On random features, each measure with x and y swapped: the ones that change are exactly `ASYMMETRIC`
    (both the metrics' and the findings' list), and `compare_grid`'s ``*_reverse`` is the function with the
    arguments swapped."""
    import vitscope.measures as measures

    g = np.random.default_rng(0)
    x = g.normal(size=(40, 12))
    y = x @ g.normal(size=(12, 9)) + 0.7 * g.normal(size=(40, 9))
    px, py = M.prepare(x, k=5), M.prepare(y, k=5)
    xy, yx = M.compare(px, py), M.compare(py, px)
    changed = {measures.base(m) for m in xy if not np.isclose(xy[m], yx[m], rtol=1e-9, atol=1e-12)}
    assert changed == set(M.ASYMMETRIC) == set(measures.ASYMMETRIC)
    got = M.compare_grid([px], [py], [(0, 0)], reverse=M.ASYMMETRIC)[0, 0]
    for m in M.ASYMMETRIC:
        assert got[m] == pytest.approx(xy[m]) and got[f"{m}_reverse"] == pytest.approx(yx[m])
