"""Merlin et al. (seed 002) to the letter: the App. E.1 hypothesis search, Bonferroni, the correlation up to each
epoch (Fig. 14), learning vs forgetting across layers (App. C.1), cka divergence over ``cka_layers``, the
robustness target from the corruptions analysis, CIFAR-100-C in the RobustBench layout and 100-way heads. Every
statistic is checked against a direct computation written here (scipy.stats.pearsonr, plain loops)."""

import copy
import math
import statistics

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import torch

import vitscope as vs
from vitscope.analyses.invariance import Stir
from vitscope.data.base import Batch
from vitscope.errors import ConfigError, InputError, VitscopeError
from vitscope.metrics import invariance as M

SMALL = dict(img_size=16, patch_size=4, embed_dim=48, depth=3, num_heads=3, num_classes=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (conftest)


# -- the hypothesis search, on a synthetic table ---------------------------------------------------------------
def _reference_sets(L):
    """App. E.1's layer sets written out by hand: the first n and the last n layers, n = 1 .. L-1."""
    sets = []
    for n in range(1, L):
        sets.append(("first", n, list(range(0, n))))
        sets.append(("last", n, list(range(L - n, L))))
    return sets


def _agg(values, how):
    vals = [float(v) for v in values]
    if how == "mean":
        return sum(vals) / len(vals)
    if how == "std":
        return statistics.pstdev(vals)
    return min(vals) if how == "min" else max(vals)


def _quantity(lrn, fgt, q):
    return {"learning": lrn, "forgetting": fgt, "learning+forgetting": lrn + fgt,
            "learning-forgetting": lrn - fgt, "cka_divergence": None}[q]


def test_the_hypothesis_count_is_the_papers_for_12_layers():
    rng = np.random.default_rng(0)
    E, L = 9, 12
    rows = M.hypothesis_search(rng.random((E, L)), rng.random((E, L)), rng.random((E, L)), rng.random(E))
    fam = pd.Series([r["family"] for r in rows]).value_counts()
    assert fam["learning_forgetting"] == 352 and fam["cka_divergence"] == 88 and len(rows) == 352 + 88
    assert {r["hypotheses"] for r in rows if r["family"] == "learning_forgetting"} == {352}
    assert {r["hypotheses"] for r in rows if r["family"] == "cka_divergence"} == {88}
    assert len(_reference_sets(L)) * 4 * 4 == 352
    # no hypothesis twice
    assert len({(r["quantity"], r["aggregate"], r["layer_set"]) for r in rows}) == len(rows)
    paper = [r for r in rows if r["paper"]]
    assert {(r["quantity"], r["aggregate"], r["layers"]) for r in paper} == {("forgetting", "std", "2-12"),
                                                                            ("cka_divergence", "std", "1-8")}
    with pytest.raises(ValueError):
        M.hypothesis_layer_sets(1)


def test_every_hypothesis_against_scipy_and_a_loop():
    rng = np.random.default_rng(1)
    E, L = 8, 5
    lrn, fgt, div = rng.random((E, L)), rng.random((E, L)), rng.random((E, L))
    target = rng.random(E)
    got = {(r["quantity"], r["aggregate"], r["layer_set"]): r
           for r in M.hypothesis_search(lrn, fgt, div, target, blocks=[0, 2, 4, 6, 8])}
    n_lf, n_cka = len(_reference_sets(L)) * 16, len(_reference_sets(L)) * 4
    assert len(got) == n_lf + n_cka
    checked = 0
    for kind, n, pos in _reference_sets(L):
        for q in ("learning", "forgetting", "learning+forgetting", "learning-forgetting", "cka_divergence"):
            per = div if q == "cka_divergence" else _quantity(lrn, fgt, q)
            for how in ("mean", "std", "min", "max"):
                series = [_agg([per[e][i] for i in pos], how) for e in range(E)]
                r = got[(q, how, f"{kind} {n}")]
                m = n_cka if q == "cka_divergence" else n_lf
                if len(pos) == 1 and how == "std":  # a constant series: no correlation
                    assert math.isnan(r["r"]) and math.isnan(r["p_bonferroni"])
                    continue
                ref = scipy.stats.pearsonr(series, target)
                assert math.isclose(r["r"], ref[0], rel_tol=1e-9, abs_tol=1e-12)
                assert math.isclose(r["p"], ref[1], rel_tol=1e-6)
                assert r["p_bonferroni"] == pytest.approx(min(1.0, ref[1] * m), rel=1e-6)
                checked += 1
    assert checked == n_lf + n_cka - 2 * L // 1 * 0 - 5 * 2  # the single-layer stds (first 1, last 1) of 5 quantities
    # the layer names are the 1-based blocks
    assert got[("forgetting", "std", "last 4")]["layers"] == "3-9"
    assert got[("forgetting", "std", "first 1")]["layers"] == "1"


def test_bonferroni_caps_at_one_and_keeps_nan():
    assert M.bonferroni(0.001, 352) == pytest.approx(0.352)
    assert M.bonferroni(0.01, 352) == 1.0
    assert math.isnan(M.bonferroni(math.nan, 88))


def test_correlation_up_to_each_epoch():
    rng = np.random.default_rng(2)
    x, y = rng.random(7), rng.random(7)
    got = M.pearson_up_to(x, y)
    assert len(got) == 7 and all(math.isnan(r) for r, _ in got[:2])
    for n in range(3, 8):
        ref = scipy.stats.pearsonr(x[:n], y[:n])
        assert math.isclose(got[n - 1][0], ref[0], rel_tol=1e-9)
        assert math.isclose(got[n - 1][1], ref[1], rel_tol=1e-6, abs_tol=1e-12)


# -- on the stir analysis itself: tiny models fed by hand -------------------------------------------------------
def model(seed, **kw):
    torch.manual_seed(seed)
    return vs.load_model("vit_small_patch16_224", pretrained=False, seed=seed, **{**SMALL, **kw})


def batches(n_batches=2, b=6, classes=4):
    g = torch.Generator().manual_seed(1)
    for k in range(n_batches):
        yield Batch(images=torch.randn(b, 3, 16, 16, generator=g).clamp(-2, 2),
                    index=torch.arange(k * b, (k + 1) * b), labels=torch.randint(0, classes, (b,), generator=g))


def finished_run(n_epochs=4, **kw):
    pt = model(0)
    ft = copy.deepcopy(pt)
    out = []
    for ep in range(n_epochs):
        m = copy.deepcopy(ft)
        m.name = "ft"
        torch.manual_seed(ep)
        with torch.no_grad():
            for p in [*m.model.blocks[1:].parameters(), *m.model.head.parameters()]:
                p.add_(torch.randn_like(p) * 0.3 * (ep + 1))
        a = Stir(pt.info(), m.info(), iterations=1, corruptions=["gaussian_noise:3"], **kw)
        for batch in batches():
            a.update(pt, m, batch)
        a.epoch, a.model_b = ep, f"ft@e{ep}"
        out.append(a)
    return pt, out


@pytest.fixture(scope="module")
def run4():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return finished_run(cka_layers=[0, 1])
    finally:
        torch.set_num_threads(n)


def _layers(df, metric):
    return df[df.metric == metric].sort_values("layer")["value"].to_numpy(float)


def test_learning_forgetting_across_layers_and_cka_layers(run4):
    _, runs = run4
    df = runs[0].finalize()
    lrn, fgt, div = _layers(df, "learning"), _layers(df, "forgetting"), _layers(df, "cka_divergence")
    r = df[df.metric == "learning_forgetting_r"]
    ref = scipy.stats.pearsonr(lrn, fgt)
    assert math.isclose(r.value.item(), ref[0], rel_tol=1e-9) and math.isclose(r.p.item(), ref[1], rel_tol=1e-6)
    c = df[df.metric == "cka_divergence_layers"]
    assert c.value.item() == pytest.approx((div[0] + div[1]) / 2) and c.layers.item() == "1-2"


def test_the_dynamics_carry_the_hypotheses_and_the_up_to_epoch_series(run4):
    pt, runs = run4
    df = Stir.cross(runs)
    frames = [a.finalize() for a in runs]
    lrn = np.stack([_layers(f, "learning") for f in frames])
    fgt = np.stack([_layers(f, "forgetting") for f in frames])
    div = np.stack([_layers(f, "cka_divergence") for f in frames])
    acc = df[df.metric == "dynamics:corrupted_accuracy"].sort_values("epoch").value.to_numpy(float)
    h = df[df.metric == "hypothesis"]
    # every hypothesis of a non-constant series has its row (the std of one layer is constant: no r, no row)
    want = sum(1 for q in ("learning", "forgetting", "learning+forgetting", "learning-forgetting", "cka_divergence")
               for _, n, pos in _reference_sets(3) for how in ("mean", "std", "min", "max")
               if len({_agg([(div if q == "cka_divergence" else _quantity(lrn, fgt, q))[e][i] for i in pos], how)
                       for e in range(4)}) > 1)
    assert len(h) == want and h["value"].notna().all() and set(h.target) == {"corrupted_accuracy"}
    assert set(h.hypotheses) == {64, 16}
    row = h[(h.quantity == "learning+forgetting") & (h["aggregate"] == "max") & (h.layer_set == "last 2")]
    series = [max(lrn[e][1] + fgt[e][1], lrn[e][2] + fgt[e][2]) for e in range(4)]
    ref = scipy.stats.pearsonr(series, acc)
    assert math.isclose(row.value.item(), ref[0], rel_tol=1e-9)
    assert row.p_bonferroni.item() == pytest.approx(min(1.0, ref[1] * 64), rel=1e-6)
    paper = h[h.paper == True]  # noqa: E712
    assert set(zip(paper.quantity, paper.layers, strict=True)) == {("forgetting", "2-3"), ("cka_divergence", "1-2")}
    up = df[df.metric == "pearson_up_to_epoch"].sort_values("epoch")
    std = [statistics.pstdev(fgt[e][1:]) for e in range(4)]
    assert list(up.epoch) == [2, 3]
    for _, r in up.iterrows():
        n = int(r.epoch) + 1
        assert math.isclose(r.value, scipy.stats.pearsonr(std[:n], acc[:n])[0], rel_tol=1e-9)
    cka = df[df.metric == "dynamics:cka_divergence_mean_cka_layers"].sort_values("epoch").value.to_numpy(float)
    assert np.allclose(cka, [f[f.metric == "cka_divergence_layers"].value.item() for f in frames])


def test_the_robustness_target_comes_from_the_corruptions_table(run4):
    _, runs = run4
    rng = np.random.default_rng(3)
    tables, want = [], []
    for a in runs:
        rows = [{"model": a.model_b, "analysis": "corruptions", "metric": "accuracy", "readout": "head",
                 "corruption": c, "severity": s, "value": float(rng.random())}
                for c in ("gaussian_noise", "fog") for s in range(1, 6)]
        rows.append({"model": a.model_b, "analysis": "corruptions", "metric": "accuracy", "readout": "head",
                     "corruption": "clean", "severity": 0, "value": 0.99})
        t = pd.DataFrame(rows)
        want.append(t[t.severity > 0].value.mean())
        tables.append((type("C", (), {"datasets": {"data": "cifar100c"}})(), t))
    mine = [copy.copy(a) for a in runs]
    for a in mine:
        a.robustness_data = "cifar100c"
    df = Stir.cross(mine, inputs={"corruptions": tables})
    got = df[df.metric == "dynamics:robustness_accuracy"].sort_values("epoch").value.to_numpy(float)
    assert np.allclose(got, want)
    h = df[df.metric == "hypothesis"]
    assert set(h.target) == {"robustness_accuracy"}
    frames = [a.finalize() for a in runs]
    series = [float(np.mean(_layers(f, "forgetting")[1:])) for f in frames]
    row = h[(h.quantity == "forgetting") & (h["aggregate"] == "mean") & (h.layer_set == "last 2")]
    assert math.isclose(row.value.item(), scipy.stats.pearsonr(series, want)[0], rel_tol=1e-9)
    # a dataset no corruptions analysis ran on: said, and no target
    for a in mine:
        a.robustness_data = "elsewhere"
    with pytest.warns(Warning, match="robustness_data 'elsewhere'"):
        df = Stir.cross(mine, inputs={"corruptions": tables})
    assert df[df.metric == "dynamics:robustness_accuracy"].value.isna().all()


def test_stir_parameters_are_checked_in_one_sentence():
    pt = model(0)
    with pytest.raises(ConfigError, match="head_classes 'cifar1000' is not a label space"):
        Stir(pt.info(), pt.info(), head_classes="cifar1000")
    with pytest.raises(VitscopeError, match="cka_layers"):
        Stir(pt.info(), pt.info(), cka_layers=[7])
    assert Stir(pt.info(), pt.info()).cka_layers == [0, 1, 2]  # the first 8 of a 3-block model: all


# -- CIFAR-100-C and 100-way heads -------------------------------------------------------------------------------
def _robustbench(root, n_per=20, max_label=99, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    labels = rng.integers(0, max_label + 1, 5 * n_per).astype(np.int64)
    labels[0] = max_label
    for c in ("gaussian_noise", "fog"):
        np.save(root / f"{c}.npy", rng.integers(0, 256, (5 * n_per, 8, 8, 3), dtype=np.uint8))
    np.save(root / "labels.npy", labels)
    return labels


def test_cifar100c_in_the_robustbench_layout(tmp_path):
    from vitscope.data.formats.robustness import CIFAR100_CLASSES, CorruptedFolder

    assert len(CIFAR100_CLASSES) == 100 and list(CIFAR100_CLASSES) == sorted(CIFAR100_CLASSES)
    labels = _robustbench(tmp_path / "c100")
    ds = CorruptedFolder(tmp_path / "c100")
    assert ds.classes == list(CIFAR100_CLASSES) and len(ds) == 2 * 5 * 20
    arr = np.load(tmp_path / "c100" / "fog.npy")
    for i in (0, 37, 199):
        s = ds.load(i)
        c, sev = s.extra["corruption"], s.extra["severity"]
        row = (["fog", "gaussian_noise"].index(c) * 100 + (sev - 1) * 20 + (i % 20)) % 100
        assert s.label == int(labels[row]) and sev == 1 + (i % 100) // 20
        if c == "fog":
            assert np.array_equal(np.asarray(s.image), arr[row])
    # 1,000 per level in the paper: here 4 of the 20, the same rows at every severity and corruption
    few = CorruptedFolder(tmp_path / "c100", images_per_level=4, seed=1)
    assert len(few) == 2 * 5 * 4
    rows = [e[3] for e in few.entries]
    offsets = {r % 20 for r in rows}
    assert len(offsets) == 4 and all(r % 20 in offsets for r in rows)
    # stated explicitly, or refused when labels.npy does not fit
    assert CorruptedFolder(tmp_path / "c100", classes="cifar100").classes == list(CIFAR100_CLASSES)
    with pytest.raises(InputError, match="class ids 0..9"):
        CorruptedFolder(tmp_path / "c100", classes="cifar10")
    with pytest.raises(InputError, match="classes 'imagenet'"):
        CorruptedFolder(tmp_path / "c100", classes="imagenet")
    _robustbench(tmp_path / "c10", max_label=9)
    assert len(CorruptedFolder(tmp_path / "c10").classes) == 10


def test_a_100_way_head_is_accepted_and_a_wrong_one_refused():
    from vitscope.analyses.robustness import BandNoise, Corruptions
    from vitscope.data.formats.robustness import CIFAR100_CLASSES

    vm = model(0, num_classes=100)
    for cls, kw in ((Corruptions, {"corruptions": ["gaussian_noise"]}), (BandNoise, {})):
        a = cls(vm, head_classes="cifar100", readout="head", **kw)
        a.datasets = {"data": "cifar100c"}
        a.configure({"data": list(CIFAR100_CLASSES)})
        assert a.use_head and a.head_space == "cifar100"
        with pytest.raises(ConfigError,
                           match=r"^[^.]*cifar1000[^.]*; choose imagenet-1k, cifar10, cifar100, dataset, none$"):
            cls(vm, head_classes="cifar1000", **kw)
        with pytest.raises(ConfigError, match="needs a head of 10 logits"):
            cls(vm, head_classes="cifar10", **kw)
    stir = Stir(vm.info(), vm.info(), head_classes="cifar100", iterations=0, layers=[2], corruptions=None)
    stir.update(vm, vm, next(batches(1, b=4, classes=100)))
    assert stir.has_head


def test_the_report_shows_the_hypothesis_table_and_the_up_to_epoch_series(run4):
    import matplotlib.pyplot as plt

    from vitscope.report.figures.invariance import FIGURES

    _, runs = run4
    df = pd.concat([*(a.finalize().assign(model_b=a.model_b) for a in runs), Stir.cross(runs)], ignore_index=True)
    figs = FIGURES["stir"](df)
    caps = [c for c, _ in figs]
    assert any("hypothesis search (App. E.1)" in c and "64 hypotheses" in c for c in caps)
    assert any("Fig. 14" in c for c in caps)
    for _, f in figs:
        plt.close(f)
