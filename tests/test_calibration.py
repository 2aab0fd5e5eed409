"""benchmarks/calibration.py: every interval kind of the report covers its simulated truth about 95 % of the time
(accepted within 90-99 % on these small simulations), every flag's false-finding rate stays near or under 5 %, and
the harness catches intervals that under-cover (Wald at a small n p, value ± 1.96 stderr over few clustered units).
The fast tests run in CI (200 draws, well under 5 s together); the slow ones (``-m slow``) take 400 draws of every
kind and flag, and the benchmark's own ``--quick`` run. docs/CALIBRATION.md has the full table."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vitscope.analyses import get_analysis
from vitscope.metrics import intervals as I

ROOT = Path(__file__).resolve().parents[1]


def _calibration_module():
    spec = importlib.util.spec_from_file_location("calibration", ROOT / "benchmarks" / "calibration.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["calibration"] = mod
    spec.loader.exec_module(mod)
    return mod


cb = _calibration_module()
ACCEPT = (0.90, 0.99)


def _accepted(r: dict, value: float | None = None) -> bool:
    v = r["coverage"] if value is None else value
    return ACCEPT[0] <= v <= ACCEPT[1]


# ------------------------------------------------------------------------------------------------- fast (CI)

FAST = [
    (cb.coverage_accuracy, {}),
    (cb.coverage_shape_bias, {}),
    (cb.coverage_jf, {}),
    (cb.coverage_pck, {}),
    (cb.coverage_retrieval, {}),
    (cb.coverage_stir, {}),
    (cb.coverage_image_mean, {}),
    (cb.coverage_drop, {"pairing": "least"}),
]


@pytest.mark.parametrize("fn,setting", FAST, ids=[f.__name__ for f, _ in FAST])
def test_each_interval_kind_covers_its_truth_on_a_small_simulation(fn, setting):
    r = fn(200, 11, **setting)
    assert r["draws"] == 200
    assert _accepted(r), r


def test_robustness_drops_and_mean_accuracies_are_never_too_narrow_and_exact_at_the_worst_pairing():
    """The drop interval assumes the least correlation the two accuracies allow, since the tallies do not keep
    the pairing: there it covers near 95 %, with any other pairing more (never less); the unpaired interval
    under-covers at that pairing, so the harness sees the difference. The mean corruption accuracy's Wilson
    interval at the mean is conservative for views of the same images."""
    least = cb.coverage_drop(300, 12, pairing="least")
    assert _accepted(least), least
    assert least["compare"]["d ± 1.96 unpaired se"] < ACCEPT[0]
    for pairing in ("independent", "most"):
        assert cb.coverage_drop(300, 13, pairing=pairing)["coverage"] >= least["coverage"]
    for together in (True, False):
        assert cb.coverage_mean_of_views(300, 14, together=together)["coverage"] >= ACCEPT[0]


def test_the_harness_catches_intervals_that_under_cover():
    """The same simulations score the naive intervals the tables no longer use as failing: Wald at p = 0.02 on 20
    images (a 0-of-20 count gives the empty interval [0, 0]), value ± 1.96 stderr over the objects of 2 videos,
    the binomial error over the keypoints of 32 pairs of unequal difficulty, 1.96 instead of t over 3 repeats."""
    wald = cb.coverage_accuracy(200, 3, n=20, p=(0.02,))["compare"]["Wald p ± 1.96 se"]
    assert wald < ACCEPT[0] and math.isclose(wald, 1 - 0.98 ** 20, abs_tol=0.1)
    assert cb.exact_coverage(20, 0.02, lambda p, n: cb.wald_interval(p, n)) < 0.5
    assert cb.coverage_jf(200, 3)["compare"]["former ± 1.96 stderr over objects"] < ACCEPT[0]
    assert cb.coverage_pck(200, 3)["compare"]["former binomial ± 1.96 se over keypoints"] < ACCEPT[0]
    assert cb.coverage_stir(200, 3)["compare"]["mean ± 1.96 spread / √R"] < ACCEPT[0]


def test_wilson_coverage_by_simulation_agrees_with_the_exact_binomial_sum():
    r = cb.coverage_accuracy(200, 5, n=64, p=(0.3,))
    assert abs(r["coverage"] - r["exact"][0.3]) < 4 * r["mc_error"]
    assert 0.93 <= r["exact_min"] <= 0.97


def test_cka_covers_the_analytic_truth_it_converges_to():
    """Minibatch CKA's interval (16 minibatches of 32, the default study's 500 images) covers the analytic
    population CKA; the truth is what the estimator converges to: the mean of the 200 estimates is within 4 Monte
    Carlo errors of it (plus the ratio's O(1 / images) bias). The table's t(15) interval covers about 95 % here;
    the former value ± 1.96 stderr about 92.5 % (docs/CALIBRATION.md)."""
    r = cb.coverage_cka(200, 11)
    assert _accepted(r), r
    assert r["compare"]["value ± 1.96 stderr (before)"] <= r["coverage"]  # t is wider
    assert abs(r["mean_value"] - r["truth"]) < 4 * r["sd_value"] / math.sqrt(200) + 0.002


def test_wilson_holds_an_observed_proportion_of_one_and_of_zero():
    """At p = 0 and 1 the Wilson bounds are exactly 0 and 1 (computed, the upper one rounded to 1 - 1e-16: a
    perfect readout's interval left out its own value and a true proportion of 1 was never covered)."""
    from vitscope.metrics.semantics import binomial_interval

    for n in (7, 20, 120, 1000):
        assert binomial_interval(1.0, n)[1] == 1.0 and binomial_interval(0.0, n)[0] == 0.0
    assert cb.exact_coverage(120, 1.0) == pytest.approx(1.0)


def test_a_readout_at_chance_is_rarely_reported_above_it():
    r = cb.false_finding_readout_chance(200, 4)
    assert r["false_finding"] <= cb.false_finding_limit(200)


def test_the_interval_helpers():
    assert I.t_quantile(1) == pytest.approx(12.7062, rel=1e-4) and math.isnan(I.t_quantile(0))
    assert np.allclose(I.t_quantile(np.array([2, 30])), [4.302653, 2.042272])
    x = np.array([0.2, 0.4, 0.9, 0.5])
    m, se, lo, hi = I.cluster_interval(x)  # one unit per value: the t interval of a mean
    assert m == pytest.approx(x.mean()) and se == pytest.approx(x.std(ddof=1) / 2)
    assert hi - m == pytest.approx(I.t_quantile(3) * se)
    # clustered: the sums per cluster and their counts
    m, se, _, _ = I.cluster_interval(np.array([0.2, 0.4, 0.9, np.nan]), np.array([0, 0, 1, 1]))
    y, n = np.array([0.6, 0.9]), np.array([2.0, 1.0])
    assert m == pytest.approx(0.5) and se == pytest.approx(math.sqrt(2 * ((y - 0.5 * n) ** 2).sum()) / 3)
    assert all(math.isnan(v) for v in I.cluster_interval(np.array([0.3, 0.5]), np.array([1, 1]))[1:])
    out = I.mean_interval(np.array([[1.0, np.nan], [2.0, 5.0], [3.0, np.nan]]))
    assert out["mean"].tolist()[0] == 2.0 and out["spread"][1] == 0 and math.isnan(out["value_lo"][1])


# ------------------------------------------------------------------------------------------------- the tables' paths


def _info(grid: int, patch: int, depth: int = 1, dim: int = 8):
    from vitscope.models.adapter import ModelInfo

    return ModelInfo("calib", depth, 1, dim, (grid, grid), patch, 1, True)


def test_the_correspondence_interval_is_the_pair_clustered_one_of_its_per_pair_counts(monkeypatch):
    """The table's PCK stderr and interval equal `ratio_interval` of the per-pair counts (recorded from
    `pck_counts` as the analysis scores them): the sums the state keeps are the pair-level moments."""
    from vitscope.analyses import dense as AD
    from vitscope.data.synthetic_tasks import SyntheticPairs
    from vitscope.models.registry import Preprocessing

    seen = []
    real = AD.D.pck_counts

    def recording(*args, **kw):
        correct, chance = real(*args, **kw)
        seen.append((correct.clone(), args[7].sum(1).clone()))  # (B, L, A) correct, (B,) keypoints counted
        return correct, chance

    monkeypatch.setattr(AD.D, "pck_counts", recording)
    pairs = SyntheticPairs(n_pairs=9, seed=4, size=32, flat=True)
    g = torch.Generator().manual_seed(3)
    an = get_analysis("correspondence")(_info(4, 8, depth=2), final_norm=False)
    for b in pairs.batches(5, Preprocessing(input_size=32)):
        an.update({f"block{i}.out": torch.randn(len(b), 17, 6, generator=g) for i in range(2)}, b)
    df = an.finalize()
    correct = torch.cat([c for c, _ in seen]).double().numpy()
    k = torch.cat([n for _, n in seen]).double().numpy()
    scored = k > 0
    assert scored.sum() >= 5
    for li, layer in enumerate((0, 1)):
        c = correct[scored, li, 0]  # alpha 0.1
        want = cb._pck_interval(c, k[scored])
        row = df[(df.metric == "pck@0.1") & (df.layer == layer) & df.category.isna()].iloc[0]
        assert row["value"] == pytest.approx(want[0])
        assert (row["stderr"], row["value_lo"], row["value_hi"]) == pytest.approx(want[1:])
        assert row["interval_units"] == scored.sum()


def test_the_propagation_interval_is_clustered_by_video_and_the_best_row_is_simultaneous():
    from vitscope.data.synthetic_tasks import SyntheticVideos
    from vitscope.models.registry import Preprocessing

    vids = SyntheticVideos(n_videos=4, n_frames=4, seed=2, size=32)
    g = torch.Generator().manual_seed(5)
    an = get_analysis("propagation")(_info(4, 8, depth=2), final_norm=False)
    for b in vids.batches(4, Preprocessing(input_size=32)):
        an.update({f"block{i}.out": torch.randn(len(b), 17, 6, generator=g) for i in range(2)}, b)
    df = an.finalize()
    video = np.concatenate([np.full(v["J"].shape[1], i) for i, v in enumerate(an.videos)])
    jf = np.concatenate([((v["J"] + v["F"]) / 2).numpy() for v in an.videos], 1)  # (L + 1, objects)
    rows = df[(df.metric == "JF") & df.video.isna()].sort_values("layer")
    for k, (_, row) in enumerate(rows.iterrows()):
        want = I.cluster_interval(jf[k], video)
        assert (row["stderr"], row["value_lo"], row["value_hi"]) == pytest.approx(want[1:])
        assert row["interval_units"] == 4
    best = df[df.metric == "best_JF"].iloc[0]
    half = I.t_quantile(3, 1 - 0.05 / 2) * best["stderr"]  # Bonferroni over the 2 layers it was chosen from
    assert (best["value_lo"], best["value_hi"]) == pytest.approx((best["value"] - half, best["value"] + half))


# ------------------------------------------------------------------------------------------------- slow

SLOW = [(fn, s) for fn, settings in cb.SUITE if fn.__name__.startswith("coverage_") for s in settings]
#: settings where the tables' own interval is known to miss (docs/CALIBRATION.md): a strongly skewed STIR repeat
#: distribution (3 draws: 92.2 % at 1,000 draws)
KNOWN_MISS = {("coverage_stir", "gamma_shape=2.0")}
#: settings where the tables' interval is conservative by design (docs/CALIBRATION.md): a drop's interval at any
#: pairing but the least correlation it assumes, a mean over views of the same images
CONSERVATIVE_SETTINGS = {("coverage_drop", ""), ("coverage_drop", "pairing=most"),
                         ("coverage_mean_of_views", ""), ("coverage_mean_of_views", "together=False")}


def _key(fn, setting) -> tuple[str, str]:
    return fn.__name__, ",".join(f"{k}={v}" for k, v in setting.items())


#: similarity measures whose jackknife interval is conservative (Efron & Stein: the jackknife overstates the
#: variance of a statistic with strong second-order terms, which the CCA family, the shape metric at alpha < 1
#: and the neighbour measures have at n a few times the width): covered 98-100 %, above the goal's 97 %
CONSERVATIVE = {"angular_shape_alpha=0", "angular_shape_alpha=0.5", "mean_cca", "svcca", "pwcca", "pwcca_reverse",
                "mutual_knn", "cknna", "cknna_reverse", "subspace_similarity"}


def test_the_similarity_jackknife_covers_the_measures_value_at_its_n():
    """Every measure's jackknife interval on a small simulation (n = 48 of 8-wide views, 8 groups, 200 draws): at
    least 90 % coverage of the measure's mean at that n (computed from 400 independent draws), the conservative
    ones too; and the test can fail: an interval a quarter as wide covers far less."""
    rs = cb.coverage_similarity(200, 5, n=48, dim=8, groups=8, k=4, rsa_images=24, truth_draws=400,
                                measures=["mean_cca", "procrustes", "ridge_r2", "rsa", "mutual_knn"])
    got = {r["setting"].split(",")[0]: r for r in rs}
    assert set(got) == {"mean_cca", "procrustes", "ridge_r2", "ridge_r2_reverse", "rsa_spearman", "rsa_kendall",
                        "mutual_knn"}
    for name, r in got.items():
        assert r["coverage"] >= 0.90, (name, r["coverage"])
        if name not in CONSERVATIVE:
            assert r["coverage"] <= 0.99, (name, r["coverage"])
    narrow = got["procrustes"]["compare"]["a quarter as wide"]
    assert narrow < 0.6, narrow


@pytest.mark.slow
@pytest.mark.parametrize("fn,setting", SLOW, ids=["-".join(_key(f, s)).rstrip("-") for f, s in SLOW])
def test_every_setting_of_every_kind_covers_its_truth(fn, setting):
    if fn is cb.coverage_similarity:
        for r in fn(400, 21, **setting):
            name = r["setting"].split(",")[0]
            assert r["coverage"] >= 0.90 if name in CONSERVATIVE else _accepted(r), r
        return
    r = fn(400, 21, **setting)
    if _key(fn, setting) in CONSERVATIVE_SETTINGS:
        assert r["coverage"] >= ACCEPT[0], r
        return
    if not _accepted(r) and _key(fn, setting) in KNOWN_MISS:
        pytest.xfail(f"known under-coverage ({r['coverage']:.1%}): docs/CALIBRATION.md")
    assert _accepted(r), r
    for method, v in r["compare"].items():
        if "proposed" in method:
            assert _accepted(r, v), (method, v)


FLAGS = [(fn, s) for fn, settings in cb.SUITE if fn.__name__.startswith("false_finding_") for s in settings]


@pytest.mark.slow
@pytest.mark.parametrize("fn,setting", FLAGS, ids=["-".join(_key(f, s)).rstrip("-") for f, s in FLAGS])
def test_every_flag_keeps_its_false_finding_rate(fn, setting):
    """Under 'no difference' the flags claim one at most 5 % of the time (plus the Monte Carlo margin). The
    summary's best-of-layers chance flags use the best row's interval simultaneous over the layers; their former
    rules (the best layer's own interval, 1.96 standard errors) claimed 'above chance' for 15-45 % of models at
    chance over 8 layers, which the comparison shows."""
    r = fn(400, 31, **setting)
    limit = cb.false_finding_limit(400)
    assert r["false_finding"] <= limit, r
    if r["kind"] in ("semantics_chance", "dense_chance") and setting.get("layers", 8) > 1:
        # the harness catches the former best-of-layers flags' false findings
        assert max(r["compare"].values()) > limit, r


@pytest.mark.slow
def test_the_quick_benchmark_prints_one_row_per_kind_and_flag():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "calibration.py"), "--quick"], capture_output=True,
                       text=True, timeout=300, check=True)
    table = p.stdout
    for fn, _ in cb.SUITE:
        name = fn.__name__.removeprefix("coverage_").removeprefix("false_finding_")
        assert f"\n{name} " in table, name
    assert "Goal: coverage 93%-97%" in table
