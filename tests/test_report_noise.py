"""No emphasis on noise (issue 41, item 2): a reader must never mistake noise for a finding.

a. a best layer is starred (a heat-table cell coloured) only where it clears chance and the untrained model beyond
   its interval, simultaneous over the layers; b. the robustness comparisons carry intervals and their n;
c. the saliency IoU figure draws the uniform-attention reference; d. attention maps share one colour scale in units
of uniform attention's; e. the dense tasks say when nothing is above chance instead of ranking layers."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer

from vitscope.report.figures import FIGURES
from vitscope.report.figures._common import BEST_GID, NO_BEST_GID, context


def _stars(fig):
    return [line for ax in fig.axes for line in ax.lines if line.get_gid() == BEST_GID]


def _notes(fig, gid):
    return [t for ax in fig.axes for t in ax.texts if t.get_gid() == gid]


def _close(figs):
    for _, fig in figs:
        plt.close(fig)


# ------------------------------------------------------------------------------------------------ a. stars


def _propagation(values: dict[str, list[float]], stderr: float = 0.01, units: int = 20, chance: float = 0.1):
    """A propagation table: per model, J, F and J&F per layer (``values``) with their stderr over ``units`` videos,
    the constant-feature chance rows and the best-layer row with its interval simultaneous over the layers."""
    from vitscope.analyses.dense import best_interval

    rows = []
    for m, vs in values.items():
        for metric in ("J", "F", "JF"):
            for layer, v in enumerate(vs):
                rows.append({"model": m, "metric": metric, "layer": layer, "value": v, "stderr": stderr,
                             "value_lo": v - 2.1 * stderr, "value_hi": v + 2.1 * stderr, "interval_units": units})
            rows.append({"model": m, "metric": f"{metric}_chance", "layer": None, "value": chance})
        b = int(np.argmax(vs))
        best = {"value": vs[b], "stderr": stderr, "interval_units": units}
        lo, hi = best_interval(best, len(vs))
        rows.append({"model": m, "metric": "best_JF", "layer": b, "value": vs[b], "stderr": stderr, "value_lo": lo,
                     "value_hi": hi, "interval_units": units, "chance": chance, "token_view": None,
                     "last_layer_value": vs[-1]})
    return pd.DataFrame(rows)


def test_no_star_where_every_model_is_at_chance():
    rng = np.random.default_rng(0)
    df = _propagation({m: list(0.1 + rng.normal(0, 0.01, 8)) for m in ("a", "b", "random")}, stderr=0.01)
    with context(["a", "b", "random"], ["random"]):
        figs = FIGURES["propagation"](df)
    (caption, fig), = figs
    assert not _stars(fig)  # the highest point of a curve at chance is no best layer
    assert len(_notes(fig, NO_BEST_GID)) == 3  # every panel says so in place
    assert caption.startswith("Nothing here is above chance")
    _close(figs)


def test_star_only_above_chance_and_the_untrained_model_beyond_the_interval():
    base = [0.30] * 8
    df = _propagation({"good": [0.3, 0.4, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3],  # far above both
                       "like_random": [0.3, 0.31, 0.32, 0.3, 0.3, 0.3, 0.3, 0.3],  # above chance, not the untrained
                       "random": base}, stderr=0.01)
    with context(["good", "like_random", "random"], ["random"]):
        figs = FIGURES["propagation"](df)
        (caption, fig), = figs
        stars = _stars(fig)
        colours = {line.get_color() for line in stars}
        from vitscope.report.figures._common import model_color

        assert len(stars) == 3 and colours == {model_color("good")}  # one per panel, only the good model
        assert not caption.startswith("Nothing")
    # without the untrained model in the study, the model above chance is starred too
    with context(["good", "like_random"], []):
        figs2 = FIGURES["propagation"](df[df.model != "random"])
        assert len(_stars(figs2[0][1])) == 6
    _close(figs + figs2)


def test_semantics_star_needs_the_best_of_the_layers_to_clear_chance_simultaneously():
    """Best of 8 layers at chance on 100 images: 0.17 clears chance's own Wilson interval (0.109 > 0.1) but not
    the one simultaneous over the layers it was chosen from; 0.4 does."""
    rows = []
    for m, best in (("lucky", 0.17), ("good", 0.4)):
        for layer in range(8):
            v = best if layer == 5 else 0.1
            rows.append({"model": m, "metric": "knn20_top1", "token_view": "cls", "layer": layer, "value": v,
                         "chance": 0.1, "n_test": 100, "value_lo": 0.109 if v == 0.17 else v - 0.08,
                         "value_hi": v + 0.08})
    with context(["lucky", "good"], []):
        figs = FIGURES["semantics"](pd.DataFrame(rows))
        from vitscope.report.figures._common import model_color

        assert [s.get_color() for s in _stars(figs[0][1])] == [model_color("good")]
    _close(figs)


def test_best_layer_heat_table_colours_only_findings():
    """Propagation at 0.33 for every model, the untrained one included (chance 0): no cell is coloured; a trained
    model above chance and the untrained model is."""
    from vitscope.report.figures.dense import NOT_ABOVE_UNTRAINED, best_layer_summary, summary_figure

    def row(model, value, lo, task_metric="best_JF", chance=0.0):
        return {"model": model, "metric": task_metric, "layer": 2, "token_view": None, "value": value,
                "stderr": 0.05, "value_lo": lo, "value_hi": value + (value - lo), "chance": chance,
                "last_layer_value": value}

    models = {m: {"supervision": s, "objective_family": f, "depth": 8, "heads": 3, "grid": [8, 8], "patch": 16}
              for m, s, f in (("sup", "supervised", "supervised"), ("dino", "self-distillation", "dino"),
                              ("zoo-random", "random init", "none"))}
    prop = pd.DataFrame([row("sup", 0.34, 0.2), row("dino", 0.33, 0.19), row("zoo-random", 0.327, 0.26)])
    retr = pd.DataFrame([row(m, v, lo, "best_mAP_medium", 0.12)
                         for m, v, lo in (("sup", 0.6, 0.45), ("dino", 0.15, 0.05), ("zoo-random", 0.13, 0.06))])
    s = best_layer_summary({"propagation": prop, "retrieval": retr}, models)
    p = s[s.task == "propagation"].set_index("model")
    assert p.above_chance.all() and not p.finding.any()  # above chance 0, but not above the untrained 0.327
    assert p.loc["sup", "best"] == NOT_ABOVE_UNTRAINED and bool(p.loc["zoo-random", "untrained"])
    r = s[s.task == "retrieval"].set_index("model")
    assert r.finding.tolist() == [True, False, False]
    with context(list(models), ["zoo-random"]):
        (caption, fig), = summary_figure(s)
    gain = np.ma.getdata(fig.axes[0].images[0].get_array())
    assert np.isfinite(gain).sum() == 1  # only retrieval's sup is coloured: the rest grey and hatched
    hatched = [a for a in fig.axes[0].patches if a.get_gid() == "no-finding"]
    assert len(hatched) == 5
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum("≈ untrained" in t for t in texts) == 2 and sum(t.endswith("untrained") for t in texts) == 4
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ b. intervals


def test_drop_interval_is_the_difference_of_wilson_ends_at_correlation_minus_one_and_covers():
    from vitscope.metrics.robustness import drop_interval
    from vitscope.metrics.semantics import binomial_interval

    # p1 + p2 <= 1: the least correlation is -1 only when both are 0.5; there the ends are the Wilson ends' difference
    iv = drop_interval(0.5, 0.5, 68)
    lo, hi, _ = binomial_interval(0.5, 68)
    assert iv["value_lo"] == pytest.approx(lo - hi) and iv["value_hi"] == pytest.approx(hi - lo)
    # coverage whatever the pairing, the least favourable (anti-correlated decisions) included
    rng = np.random.default_rng(1)
    n, p1, p2, hits = 68, 0.6, 0.45, 0
    for _ in range(1500):
        u = rng.random(n)
        x, y = u < p1, u > 1 - p2  # as anti-correlated as these accuracies allow
        got = drop_interval(x.mean(), y.mean(), n)
        hits += got["value_lo"] <= p1 - p2 <= got["value_hi"]
    assert hits / 1500 >= 0.93


def _robustness_tables(n=68):
    rng = np.random.default_rng(0)
    bn, co = [], []
    from vitscope.metrics.robustness import accuracy_interval, drop_interval

    for m in ("a", "b"):
        for layer in (None, 3):
            readout = "head" if layer is None else "probe"
            clean = rng.uniform(0.5, 0.8)
            bn.append({"model": m, "metric": "accuracy", "layer": layer, "readout": readout, "band": -1,
                       "band_low": np.nan, "value": clean, "n_images": n, **accuracy_interval(clean, n)})
            for band in range(3):
                acc = clean - rng.uniform(0, 0.2)
                bn.append({"model": m, "metric": "accuracy", "layer": layer, "readout": readout, "band": band,
                           "band_low": band / 10, "value": acc, "n_images": n, **accuracy_interval(acc, n)})
                bn.append({"model": m, "metric": "drop", "layer": layer, "readout": readout, "band": band,
                           "band_low": band / 10, "value": clean - acc, "n_images": n,
                           **drop_interval(clean, acc, n)})
            co.append({"model": m, "metric": "accuracy", "layer": layer, "readout": readout, "corruption": "clean",
                       "severity": 0, "family": "clean", "value": clean, "n_images": n})
            accs = []
            for c, f in (("contrast", "digital"), ("gaussian_noise", "noise")):
                acc = clean - rng.uniform(0, 0.3)
                accs.append(acc)
                co.append({"model": m, "metric": "accuracy", "layer": layer, "readout": readout, "corruption": c,
                           "severity": 3, "family": f, "value": acc, "n_images": n, **accuracy_interval(acc, n)})
            co.append({"model": m, "metric": "mca", "layer": layer, "readout": readout, "corruption": None,
                       "severity": None, "family": None, "value": np.mean(accs), "n_images": n,
                       **accuracy_interval(np.mean(accs), n)})
    return pd.DataFrame(bn), pd.DataFrame(co)


def test_robustness_comparisons_have_error_bars_and_state_their_n():
    from vitscope.metrics.semantics import binomial_interval

    bn, co = _robustness_tables(n=68)
    with context(["a", "b"], []):
        heat, line = FIGURES["band_noise"](bn)
        (cap_c, fig_c), = FIGURES["corruptions"](co)
    bars = [c for c in line[1].axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2  # one per model, at its decision
    # the bars are the drop's rows' intervals
    _, caps, (segments,) = bars[0]
    ends = np.array([seg[:, 1] for seg in segments.get_segments()])
    rows = bn[(bn.model == "a") & (bn.metric == "drop") & (bn.readout == "head")].sort_values("band")
    np.testing.assert_allclose(ends, rows[["value_lo", "value_hi"]].to_numpy(), atol=1e-12)
    labels = line[1].axes[0].get_legend_handles_labels()[1]
    assert all("n = 68" in lab for lab in labels)
    assert "n = 68 test images" in heat[0] and "0.015" in heat[0]  # one image moves an accuracy by 1/68
    severity_bars = [c for c in fig_c.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(severity_bars) == 2
    # the mean over the family's corruptions of the same 68 images: its Wilson interval on 68
    g = co[(co.model == "a") & (co.readout == "head") & (co.metric == "accuracy") & (co.severity == 3)]
    mean = g["value"].mean()
    lo, hi, _ = binomial_interval(mean, 68)
    _, _, (segments,) = severity_bars[0]
    seg = segments.get_segments()[1]  # severity 3
    assert seg[:, 1] == pytest.approx([lo, hi])
    assert "n = 68" in " ".join(fig_c.axes[0].get_legend_handles_labels()[1]) or "n = 68" in cap_c
    for fig in (heat[1], line[1], fig_c):
        plt.close(fig)


def _feed(an, view, vectors, labels, bs=32):
    """Per-image vectors as the CLS token of a one-block model, under ``view`` (as the engine's passes give them)."""
    import torch

    from vitscope.data.base import Batch

    for s in range(0, len(vectors), bs):
        v = vectors[s:s + bs].float()
        b = Batch(images=torch.zeros(len(v), 3, 1, 1), index=torch.arange(s, s + len(v)), labels=labels[s:s + bs])
        b.dataset, b.view = "data", view
        an.update({"block0.out": torch.stack([v, torch.zeros_like(v)], dim=1)}, b)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_band_noise_and_corruptions_tables_carry_intervals():
    """Every accuracy and drop of band_noise, every accuracy and mca of corruptions, from the analyses themselves:
    clean features that name the class, perturbed ones that lose it for a quarter of the images."""
    import torch

    from vitscope.analyses.robustness import BandNoise, Corruptions
    from vitscope.metrics.robustness import drop_interval
    from vitscope.metrics.semantics import binomial_interval
    from vitscope.models.adapter import ModelInfo

    info = ModelInfo("m", 1, 1, 8, (1, 1), 32, 1, True)
    n, c = 160, 4
    labels = torch.arange(n) % c
    clean = torch.nn.functional.one_hot(labels, c).double() * 3 + 0.1 * torch.randn(n, c, dtype=torch.float64,
                                                                                     generator=torch.Generator()
                                                                                     .manual_seed(0))
    lost = torch.arange(n) % 4 == 1  # a quarter of the images look like the next class
    noisy = torch.where(lost[:, None], clean.roll(1, dims=1), clean)
    tables = []
    for cls, params in ((BandNoise, {"bands": [0]}), (Corruptions, {"corruptions": ["contrast"], "severities": [3],
                                                                    "table": "cifar"})):
        an = cls(info, classes=[str(k) for k in range(c)], test_every=2, probe_tune=False, probe_max_iter=200,
                 **params)
        for view in cls.views({**params}):
            _feed(an, view, clean if view == "clean" else noisy, labels)
        tables.append(an.finalize())
    t, co = tables
    acc = t[t.metric == "accuracy"]
    assert len(acc) == 2 and acc.n_images.eq(n // 2).all()
    for r in acc.itertuples():
        lo, hi, se = binomial_interval(r.value, r.n_images)
        assert (r.value_lo, r.value_hi, r.stderr) == pytest.approx((lo, hi, se))
    drop, = t[t.metric == "drop"].itertuples()
    base, after = acc[acc.band == -1].value.item(), acc[acc.band == 0].value.item()
    assert base > 0.9 and drop.value == pytest.approx(base - after) and drop.value > 0.15
    want = drop_interval(base, after, n // 2)
    assert (drop.value_lo, drop.value_hi, drop.stderr) == pytest.approx((want["value_lo"], want["value_hi"],
                                                                        want["stderr"]))
    assert drop.value_lo > 0  # a quarter of the images lost: beyond noise on 80
    rows = co[co.metric.isin(["accuracy", "mca"])]
    assert len(rows) == 3 and rows.n_images.eq(n // 2).all()
    for r in rows.itertuples():
        lo, hi, _ = binomial_interval(r.value, r.n_images)
        assert (r.value_lo, r.value_hi) == pytest.approx((lo, hi))


# ------------------------------------------------------------------------------------------------ c. uniform IoU


def test_saliency_figure_draws_the_uniform_attention_reference_computed_from_the_masks():
    """The dashed reference is the mean over the images of the IoU of k = ceil(0.6 S) tokens drawn at random (any k
    equally likely: uniform attention ties everywhere) with the image's foreground tokens: summed here from the
    hypergeometric law with scipy, not vitscope's code."""
    import torch
    from scipy.stats import hypergeom

    from conftest import tiny
    from vitscope.analyses import get_analysis
    from vitscope.capture import stream
    from vitscope.data import SyntheticShapes
    from vitscope.report.figures._common import UNIFORM_GID

    vm = tiny("vit")
    batches = list(SyntheticShapes(n=9, seed=2).batches(3, vm.preprocessing))
    a = get_analysis("saliency_iou")(vm)
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    h, w = vm.grid_size
    S, k = h * w, math.ceil(0.6 * h * w)
    expected = []
    for b in batches:
        B, Hp, Wp = b.masks.shape
        fg = (b.masks.double().reshape(B, h, Hp // h, w, Wp // w).mean(dim=(2, 4)) >= 0.5).reshape(B, -1).sum(1)
        for F in fg.tolist():
            x = np.arange(0, min(F, k) + 1)
            expected.append(float((hypergeom(S, F, k).pmf(x) * x / (k + F - x)).sum()))
    ref = float(np.mean(expected))
    assert 0 < ref < 1 and torch.is_tensor(b.masks)
    u = df[df.metric == "iou_uniform"]
    assert len(u) == len(set(df["query"])) and u.value.to_numpy() == pytest.approx(ref)
    (caption, fig), = FIGURES["saliency_iou"](df)
    lines = [line for ax in fig.axes for line in ax.lines if line.get_gid() == UNIFORM_GID]
    assert len(lines) == 2 and all(line.get_ydata()[0] == pytest.approx(ref) for line in lines)  # a panel per query
    assert all(line.get_linestyle() == "--" for line in lines)
    assert any("uniform attention" in t.get_text() for ax in fig.axes for t in ax.texts)
    assert f"{ref:.3g}" in caption and "uniform attention" in caption
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ d. one scale


def _cls_table(maps: dict[str, np.ndarray], image=None):
    rows = []
    for m, arr in maps.items():  # arr (layers, heads, R, C), each map summing to 1
        L, H, R, C = arr.shape
        for li in range(L):
            for hd in range(H):
                for r in range(R):
                    for c in range(C):
                        rows.append({"model": m, "metric": "cls_attention", "layer": li, "head": hd, "row": r,
                                     "col": c, "value": arr[li, hd, r, c], "image": image})
    return pd.DataFrame(rows)


def test_attention_maps_share_one_scale_in_units_of_uniform_attention():
    R = C = 4
    uniform = np.full((2, 3, R, C), 1 / (R * C))
    peaked = np.full((2, 3, R, C), 0.2 / (R * C - 1))
    peaked[..., 1, 2] = 0.8
    near = uniform * (1 + 0.02 * np.random.default_rng(0).standard_normal(uniform.shape))
    near /= near.sum(axis=(2, 3), keepdims=True)  # an untrained model: near-uniform maps
    df = _cls_table({"trained": peaked, "untrained": near})
    with context(["trained", "untrained"], ["untrained"]):
        figs = FIGURES["cls_attention_maps"](df)
    assert len(figs) == 2
    norms = [fig.axes[0].images[0].norm for _, fig in figs]
    assert len({(n.vmin, n.vmax) for n in norms}) == 1  # one scale for both models' figures
    assert norms[0].vmin * norms[0].vmax == pytest.approx(1.0)  # centred on uniform
    # in units of uniform attention's: the peak reads 0.8 x 16 (clipped to the scale), the untrained model's maps
    # within 10 % of 1, where scaling each map to its own maximum had stretched them over the whole colour map
    trained = np.ma.filled(figs[0][1].axes[0].images[0].get_array(), np.nan)
    untrained = np.ma.filled(figs[1][1].axes[0].images[0].get_array(), np.nan)
    assert np.nanmax(trained) == pytest.approx(min(0.8 * 16, norms[0].vmax))
    assert np.nanmax(np.abs(np.log(untrained[np.isfinite(untrained)]))) < 0.1
    spread = norms[0](np.nanmax(untrained)) - norms[0](np.nanmin(untrained))
    assert spread < 0.1  # a tenth of the colour map at most: it reads as one flat colour
    _close(figs)


def test_aligned_maps_of_uniform_attention_read_one_everywhere():
    import torch

    from vitscope.metrics.attention import aligned_maps

    h = w = 4
    attn = torch.full((2, 3, 1 + h * w, 1 + h * w), 1.0 / (1 + h * w), dtype=torch.float64)
    aaam = aligned_maps(attn, (h, w), 1).numpy()  # (heads, 2h-1, 2w-1)
    rows = [{"model": "u", "metric": "aaam", "layer": 0, "head": hd, "dy": dy - (h - 1), "dx": dx - (w - 1),
             "value": aaam[hd, dy, dx]} for hd in range(3) for dy in range(2 * h - 1) for dx in range(2 * w - 1)]
    with context(["u"], ["u"]):
        figs = FIGURES["aligned_attention_maps"](pd.DataFrame(rows))
    image = figs[0][1].axes[0].images[0]
    vals = np.ma.filled(image.get_array(), np.nan)
    np.testing.assert_allclose(vals[np.isfinite(vals)], 1.0)  # the pyramid divided by itself
    _close(figs)


# ------------------------------------------------------------------------------------------------ e. nothing above


def test_dense_figures_and_section_say_nothing_is_above_chance(tmp_path):
    import json

    from vitscope.report.figures.dense import best_layer_summary, summary_figure
    from vitscope.report.html import write_report

    rng = np.random.default_rng(3)
    df = _propagation({m: list(0.1 + rng.normal(0, 0.01, 8)) for m in ("a", "zoo-random")}, stderr=0.03)
    models = {"a": {"supervision": "supervised", "objective_family": "supervised"},
              "zoo-random": {"supervision": "random init", "objective_family": "none"}}
    s = best_layer_summary({"propagation": df}, models)
    assert not s.above_chance.any()
    with context(list(models), ["zoo-random"]):
        (caption, fig), = summary_figure(s)
        (cap_p, fig_p), = FIGURES["propagation"](df)
    assert caption.startswith("Nothing here is above chance") and cap_p.startswith("Nothing here is above chance")
    assert not _stars(fig_p)
    plt.close(fig)
    plt.close(fig_p)
    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    df.to_parquet(run / "results" / "propagation.parquet", index=False)
    (run / "manifest.json").write_text(json.dumps({"models": models}))
    html = write_report(run).read_text()
    assert "Nothing here is above chance:</strong>" in html


def test_attention_distance_and_nmi_figures_draw_the_uniform_attention_reference():
    """Uniform attention's distance is the mean distance between two grid positions (every pair, itself
    included), computed here by a loop in pixels; its NMI is 0. Both drawn dashed."""
    from conftest import tiny
    from vitscope.analyses import get_analysis
    from vitscope.capture import stream
    from vitscope.data import SyntheticShapes
    from vitscope.report.figures import FIGURES
    from vitscope.report.figures._common import UNIFORM_GID

    vm = tiny("vit")
    batches = list(SyntheticShapes(n=4, seed=1).batches(2, vm.preprocessing))
    a, b = get_analysis("attention_distance")(vm), get_analysis("attention_nmi")(vm)
    stream(vm, batches, [a, b], progress=False)
    dist, nmi = a.finalize(), b.finalize()
    h, w = vm.grid_size
    cells = [(r * vm.patch_size, c * vm.patch_size) for r in range(h) for c in range(w)]
    ref = float(np.mean([math.dist(p, q) for p in cells for q in cells]))
    u = dist[dist.metric == "distance_px_uniform"]
    assert len(u) == 1 and u.value.item() == pytest.approx(ref)
    for table, name, level in ((dist, "attention_distance", ref), (nmi, "attention_nmi", 0.0)):
        caption, fig = FIGURES[name](table)[0]
        lines = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == UNIFORM_GID]
        assert len(lines) == 1 and lines[0].get_ydata()[0] == pytest.approx(level)
        assert "uniform" in caption
        plt.close(fig)


def test_rollout_maps_share_one_scale_in_units_of_uniform_attention_and_export_uncrowded():
    """A uniform rollout map reads 1 in every cell and a peaked one does not; both models on one norm; laid out
    for a journal page, the mosaic of 2 and of 8 models keeps its texts apart and inside (its colour bar's label
    is one line beside one or two rows of maps)."""
    import matplotlib as mpl
    from test_report_figures import _print_problems

    from vitscope.report.export import RC, _relayout
    from vitscope.report.figures import FIGURES

    def table(models: list[str], R: int, peaks: list[float], layers: int = 2) -> pd.DataFrame:
        rows = []
        for model, peak in zip(models, peaks, strict=True):
            for layer in range(layers):
                for r in range(R):
                    for c in range(R):
                        v = peak if (r, c) == (1, 1) else (1 - peak) / (R * R - 1)
                        rows.append({"model": model, "metric": "rollout_map", "layer": layer, "row": r, "col": c,
                                     "value": v})
        return pd.DataFrame(rows)

    R = 3
    caption, fig = FIGURES["attention_rollout"](table(["flat", "peaked"], R, [1 / (R * R), 0.5]))[-1]
    im = next(a for a in fig.axes if a.images).images[0]
    arr = np.asarray(im.get_array().filled(np.nan), dtype=float)
    assert arr[:R, :R] == pytest.approx(np.ones((R, R)))  # the flat model's first block
    assert arr[R + 1:2 * R + 1, :R][1, 1] == pytest.approx(min(0.5 * R * R, im.norm.vmax))
    assert im.norm.vmin == pytest.approx(1 / im.norm.vmax) and "uniform" in caption
    plt.close(fig)
    for models in (["a", "b"], [f"m{i}" for i in range(8)]):
        with mpl.rc_context(RC):
            _, fig = FIGURES["attention_rollout"](table(models, 4, [0.2] * len(models), layers=12))[-1]
            layout = _relayout(fig, None)
            assert "crowded" not in layout and _print_problems(fig) == [], (len(models), layout)
            plt.close(fig)
