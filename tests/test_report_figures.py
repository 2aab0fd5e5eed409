"""Figures show the numbers of the tables they are drawn from, and their count does not grow with models."""

import numpy as np
import pandas as pd

from vitscope.report.figures import FIGURES


def _cka_table(models, views, depth, rng):
    rows = []
    for i, a in enumerate(models):
        for b in models[i:]:
            for v in views:
                for la in range(depth):
                    for lb in range(depth):
                        rows.append({"model": a, "model_b": b, "token_view": v, "metric": "cka_minibatch",
                                     "tap": f"block{la}.out", "tap_b": f"block{lb}.out", "layer": la,
                                     "layer_b": lb, "value": rng.uniform()})
    return pd.DataFrame(rows)


def test_cka_figure_is_one_mosaic_per_view_whose_blocks_hold_the_table_mirrored():
    rng = np.random.default_rng(0)
    models, views, depth = ["m0", "m1", "m2", "m3"], ["cls", "gap"], 5
    df = _cka_table(models, views, depth, rng)
    figs = FIGURES["cka"](df)
    assert len(figs) == len(views)
    for (caption, fig), view in zip(figs, views, strict=True):
        assert view in caption
        panels = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
        assert len(panels) == 1
        got = np.asarray(panels[0].images[0].get_array().filled(np.nan), dtype=float)
        assert got.shape == (len(models) * (depth + 1) - 1,) * 2
        for i, a in enumerate(models):
            for j, b in enumerate(models):
                g = df[(df.model == min(a, b)) & (df.model_b == max(a, b)) & (df.token_view == view)]
                want = np.zeros((depth, depth))
                want[g.layer.to_numpy(), g.layer_b.to_numpy()] = g.value.to_numpy()
                if a > b:  # the table holds each pair once: the other order is its transpose
                    want = want.T
                block = got[i * (depth + 1):i * (depth + 1) + depth, j * (depth + 1):j * (depth + 1) + depth]
                np.testing.assert_allclose(block, want)
        # the gaps between models are empty (drawn white), not zeros that would read as "dissimilar"
        assert np.isnan(got[depth, :]).all() and np.isnan(got[:, depth]).all()
        labels = [t.get_text() for t in panels[0].get_yticklabels()]
        assert labels == models


def test_residual_cka_figure_is_one_per_view_with_a_row_per_model():
    rng = np.random.default_rng(1)
    rows = [{"model": m, "token_view": v, "metric": f"skip_vs_{br}", "layer": i, "layer_b": j,
             "value": rng.uniform()}
            for m in ("a", "b", "c") for v in ("gap",) for br in ("attn_out", "mlp_out")
            for i in range(4) for j in range(4)]
    df = pd.DataFrame(rows)
    figs = FIGURES["residual_cka"](df)
    assert len(figs) == 1
    panels = [ax for ax in figs[0][1].axes if ax.images and ax.get_label() != "<colorbar>"]
    assert len(panels) == 6
    for k, ax in enumerate(panels):
        model, branch = "abc"[k // 2], ("attn_out", "mlp_out")[k % 2]
        g = df[(df.model == model) & (df.metric == f"skip_vs_{branch}")]
        want = g.pivot_table(index="layer", columns="layer_b", values="value").to_numpy()
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), want)


# ------------------------------------------------------------------------------------------------------------
# every figure of a real (tiny) run: legends, colour scales, no empty panel; export, plot, summary
# ------------------------------------------------------------------------------------------------------------

import re  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402
from study_fixtures import TWO_TINY_MODELS  # noqa: E402

import vitscope as vs  # noqa: E402
from vitscope.cli import main  # noqa: E402
from vitscope.report.figures._common import NOT_COMPUTED_GID  # noqa: E402
from vitscope.report.run import load_run  # noqa: E402
from vitscope.study import load_config, run_study  # noqa: E402

ALL_YAML = TWO_TINY_MODELS + """\
dataset: {name: synthetic-shapes, n_images: 12}
analyses:
  attention_distance: {}
  attention_nmi: {}
  aligned_attention_maps: {}
  cls_attention_maps: {keep_images: 1}
  saliency_iou: {}
  cka: {batch_size: 6}
  residual_cka: {batch_size: 6}
  diversity: {batch_size: 6}
  svd_volume: {}
  fourier: {}
  semantics: {ks: [3], test_every: 3}
  tsne: {n_images: 2, max_iter: 250}
batch_size: 6
progress: false
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("figures")
    (d / "study.yaml").write_text(ALL_YAML)
    return run_study(load_config(d / "study.yaml", [f"output_dir={d / 'run'}"]))


def _all_figures(run_dir):
    """(analysis, caption, figure) of every figure of the run, one at a time (the caller closes each)."""
    run = load_run(run_dir)
    seen = set()
    for name in run.tables:
        for caption, fig in run.figures(name):
            seen.add(name)
            yield name, caption, fig
    assert seen == set(run.tables)  # every analysis of the run has figures


def _data_axes(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.get_visible() and ax.axison]


def _legend_problems(fig, draw=True):
    """Legends that leave the figure or cover a panel (in display pixels after a draw)."""
    if draw:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems = []
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for leg in legends:
        box = leg.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > fig.bbox.x1 + 1 or box.y1 > fig.bbox.y1 + 1:
            problems.append(f"legend {box} leaves the figure {fig.bbox}")
        for ax in _data_axes(fig):
            if box.overlaps(ax.get_window_extent(renderer)):
                problems.append(f"legend {box} covers a panel {ax.get_window_extent(renderer)}")
    return problems


def _drawn_texts(fig):
    """(what, corners) of every text a drawn figure shows, in display pixels: titles, axis labels, the tick labels
    each axis draws (those in its view), colour-bar labels, notes, and each legend as one box. A turned text's
    corners are those of its own rectangle (its unturned extent turned about the centre of its window extent),
    not of the larger level box around it."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()

    def corners(t):
        box = t.get_window_extent(renderer)
        angle = t.get_rotation() % 180 if isinstance(t, Text) else 0
        if angle in (0, 90):
            return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])
        t.set_rotation(0)
        level = t.get_window_extent(renderer)
        t.set_rotation(angle)
        a = np.deg2rad(angle)
        turn = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
        half = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]]) * [level.width / 2, level.height / 2]
        return half @ turn.T + [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2]

    out, inside = [], set()
    for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]:
        inside.update(id(t) for t in leg.findobj(Text))
        out.append(("a legend", corners(leg)))
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            ticks = axis.get_major_ticks() + axis.get_minor_ticks()
            inside.update(id(t) for tick in ticks for t in (tick.label1, tick.label2))
            if ax.get_visible() and ax.axison and axis.get_visible():
                out += [(f"tick label {t.get_text()!r}", corners(t)) for tick in axis._update_ticks()  # noqa: SLF001
                        for t in (tick.label1, tick.label2) if t.get_visible() and t.get_text().strip()]
    out += [(repr(t.get_text()), corners(t)) for t in fig.findobj(Text) if id(t) not in inside and t.get_visible()
            and t.get_text().strip() and (t.axes is None or t.axes.get_visible())]
    return out


def _text_overlaps(fig, draw=True):
    """Pairs of texts of a figure that overlap by more than a pixel (after a draw): two convex rectangles overlap
    unless a side of one separates them."""
    if draw:
        fig.canvas.draw()
    texts = _drawn_texts(fig)

    def apart(p, q):
        for poly in (p, q):
            for k in range(4):
                edge = poly[(k + 1) % 4] - poly[k]
                if not edge.any():
                    continue
                normal = np.array([-edge[1], edge[0]]) / np.hypot(*edge)
                a, b = p @ normal, q @ normal
                if min(a.max(), b.max()) - max(a.min(), b.min()) <= 1:
                    return True
        return False

    return [f"{texts[i][0]} overlaps {texts[j][0]}" for i in range(len(texts)) for j in range(i + 1, len(texts))
            if not apart(texts[i][1], texts[j][1])]


def _empty_panels(fig):
    """Visible axes (colour bars aside) that draw nothing (no line, collection, image or patch) and do not say why."""
    return [f"an empty panel {ax.get_title()!r}" for ax in fig.axes if ax.get_visible()
            and ax.get_label() != "<colorbar>" and not hasattr(ax, "_colorbar")
            and not (ax.lines or ax.collections or ax.images or ax.patches)
            and not any(t.get_gid() == NOT_COMPUTED_GID for t in ax.texts)]


def _print_problems(fig):
    """What a figure laid out for print must not have (after one draw): texts overlapping or past the figure's
    edge, a legend off the figure or over a panel, a visible panel with nothing in it."""
    fig.canvas.draw()
    return (_text_overlaps(fig, draw=False) + _text_outside(fig, draw=False) + _legend_problems(fig, draw=False)
            + _empty_panels(fig))


def test_no_legend_leaves_its_figure_or_covers_a_panel(run_dir):
    for name, caption, fig in _all_figures(run_dir):
        assert _legend_problems(fig) == [], (name, caption)
        plt.close(fig)


def test_every_heat_map_has_a_colour_scale_and_no_panel_is_left_empty(run_dir):
    for name, caption, fig in _all_figures(run_dir):
        scales = [ax._colorbar.mappable for ax in fig.axes if ax.get_label() == "<colorbar>"]  # noqa: SLF001
        for ax in _data_axes(fig):
            for im in ax.images:
                if np.asarray(im.get_array()).ndim == 3:  # an RGB photograph under an overlay
                    continue
                if im.get_gid() == "categorical":  # head types: one colour per type, named in a legend
                    assert fig.legends, (name, caption)
                    continue
                assert any(s.get_cmap().name == im.get_cmap().name and s.norm.vmin == im.norm.vmin
                           and s.norm.vmax == im.norm.vmax for s in scales), (name, caption)
            drawn = ax.lines or ax.collections or ax.images or ax.patches
            told = any(t.get_gid() == NOT_COMPUTED_GID for t in ax.texts)
            assert drawn or told, f"{name}: an empty panel in '{caption}'"
        plt.close(fig)


def test_a_view_that_was_not_computed_says_why_in_place(run_dir):
    (caption, fig), = load_run(run_dir).figures("semantics")
    texts = {ax.get_title(): [t.get_text().replace("\n", " ") for t in ax.texts if t.get_gid() == NOT_COMPUTED_GID]
             for ax in fig.axes}
    # probes run on the CLS and mean-of-spatial views by default: the 'gap' panel says so and how to enable it
    why = " ".join(texts["linear probe top-1 (gap)"])
    assert "not computed for the 'gap' view" in why and "analyses.semantics.probe" in why
    assert texts["linear probe top-1 (cls)"] == []
    plt.close(fig)


def test_export_writes_every_figure_at_a_column_width_with_embedded_fonts(run_dir, tmp_path):
    n = 0
    for *_, fig in _all_figures(run_dir):
        n += 1
        plt.close(fig)
    assert main(["report", str(run_dir), "--export", str(tmp_path / "pdf"), "--format", "pdf"]) == 0
    pdfs = sorted((tmp_path / "pdf").glob("*.pdf"))
    assert len(pdfs) == n
    index = (tmp_path / "pdf" / "figures.tsv").read_text().splitlines()
    assert len(index) == n + 1 and index[0].startswith("file\twidth_in")
    for line in index[1:]:
        file, width, height, layout, caption = line.split("\t")
        data = (tmp_path / "pdf" / file).read_bytes()
        assert b"/FontFile2" in data  # TrueType fonts embedded (pdf.fonttype 42), not Type 3
        box = [float(x) for x in re.search(rb"/MediaBox \[([^\]]+)\]", data).group(1).split()]
        assert box[2] - box[0] == pytest.approx(float(width) * 72, abs=1)
        assert float(width) in (3.5, 7.16)  # one journal column or two, never the figure's own size
        assert caption
    vs.report.export(run_dir, tmp_path / "svg", "svg", analyses=["attention_distance"])
    svg = (tmp_path / "svg" / "attention_distance-01.svg").read_text()
    assert "<path" in svg and "<image" not in svg  # a line figure is all vector
    vs.report.export(run_dir, tmp_path / "png", "png", columns=1, analyses=["attention_distance"])
    im = Image.open(tmp_path / "png" / "attention_distance-01.png")
    assert im.info["dpi"][0] == pytest.approx(300, abs=1) and im.size[0] == pytest.approx(3.5 * 300, abs=2)


def _checked_export(monkeypatch, run_dir, out, **kw):
    """``vs.report.export(run_dir, out, "png", **kw)``, each figure checked as laid out for its file (before it is
    saved): [(caption, layout, width, problems)], problems being text that overlaps other text or leaves the
    figure, a legend that leaves it or covers a panel, and a visible panel with nothing in it."""
    import importlib

    module = importlib.import_module("vitscope.report.export")  # vitscope.report.export is also the function
    relayout, seen = module._relayout, []

    def checked(fig, columns):
        layout = relayout(fig, columns)
        problems = _print_problems(fig)
        seen.append((fig.get_label(), layout, round(float(fig.get_figwidth()), 2), problems))
        return layout

    monkeypatch.setattr(module, "_relayout", checked)
    vs.report.export(run_dir, out, "png", **kw)
    return seen


@pytest.mark.slow  # a minute: every figure of the run laid out, checked and written at 300 dpi
def test_every_exported_figure_is_a_column_wide_its_texts_apart_and_no_panel_empty(run_dir, tmp_path, monkeypatch):
    seen = _checked_export(monkeypatch, run_dir, tmp_path / "png")
    assert len(seen) > len(load_run(run_dir).tables)
    for caption, layout, width, problems in seen:
        assert width in (3.5, 7.16) and "crowded" not in layout and problems == [], (caption, layout, problems)
    index = (tmp_path / "png" / "figures.tsv").read_text().splitlines()[1:]
    assert len(index) == len(seen)
    for line in index:
        file, width, _height, layout, _caption = line.split("\t")
        assert float(width) in (3.5, 7.16) and layout.startswith(("1 column", "2 columns")), line
        with Image.open(tmp_path / "png" / file) as im:
            assert im.size[0] == pytest.approx(float(width) * 300, abs=2), line


def _many_model_tables(n_models, depth=4, seed=0):
    """Small tables of the figure families a new user's export went wrong on (issue 41), for ``n_models`` models
    with names as long as the zoo's: the band-noise heat maps (a colour bar placed by hand), the head types (a
    legend beside a row of panels), residual CKA (long y labels, a panel pair per model), high-norm tokens and
    shape bias (long legends)."""
    rng = np.random.default_rng(seed)
    models = [f"zoo-model-{k}-{'ft-cls' if k % 2 else 'base'}" for k in range(n_models)]
    layers, bands = range(depth), range(5)
    band_noise = pd.DataFrame(
        [{"model": m, "metric": "drop", "readout": "probe", "layer": layer, "band": b, "band_low": b / 5,
          "value": rng.uniform(-0.2, 0.2)} for m in models for layer in layers for b in bands]
        + [{"model": m, "metric": "drop", "readout": "head", "layer": np.nan, "band": b, "band_low": b / 5,
            "value": rng.uniform(-0.2, 0.2)} for m in models for b in bands])
    types = ["strict_local", "soft_local", "axial", "offset_local", "global", "mixed"]
    head_types = pd.DataFrame([{"model": m, "metric": "head_type", "layer": layer, "head": h,
                                "type": types[int(rng.integers(len(types)))], "direction": None}
                               for m in models for layer in layers for h in range(3)])
    residual = pd.DataFrame([{"model": m, "token_view": "cls", "metric": f"skip_vs_{br}", "layer": i, "layer_b": j,
                              "value": rng.uniform()} for m in models for br in ("attn_out", "mlp_out")
                             for i in layers for j in layers])
    norms = [{"model": m, "metric": "norm_quantile", "token_view": "spatial", "layer": layer, "quantile": q,
              "value": 5 + 10 * q + rng.uniform(), "k": 6.0} for m in models for layer in layers
             for q in (0.01, 0.5, 0.99, 1.0)]
    lines = [{"model": m, "metric": metric, "tokens": tokens, "layer": layer, "value": v, "value_lo": v - 0.05,
              "value_hi": v + 0.05, "k": 6.0}
             for m in models for layer in layers
             for metric, tokens in (("outliers_per_image", None), ("cls_attention_absorbed", "outliers"),
                                    ("cls_attention_absorbed", "uniform"))
             for v in [rng.uniform(0.1, 0.5)]]
    shape = pd.DataFrame(
        [{"model": m, "metric": "shape_bias", "readout": "probe", "layer": layer, "value": v, "value_lo": v - 0.1,
          "value_hi": v + 0.1} for m in models for layer in layers for v in [rng.uniform(0.2, 0.8)]]
        + [{"model": m, "metric": "shape_bias", "readout": "head", "layer": np.nan, "value": 0.4,
            "value_lo": 0.3, "value_hi": 0.5} for m in models[::2]])
    return {"band_noise": band_noise, "aligned_attention_maps": head_types, "residual_cka": residual,
            "high_norm_tokens": pd.DataFrame(norms + lines), "shape_bias": shape}


@pytest.mark.parametrize("n_models, names", [
    (6, ("band_noise", "aligned_attention_maps")),  # a few seconds: the colour bar and the legend beside panels
    pytest.param(8, None, marks=pytest.mark.slow),  # every family a new user's export got wrong, as many models
])
def test_figures_of_many_models_export_a_column_wide_their_texts_apart_and_no_panel_empty(n_models, names):
    """Issue 41: exported, the band-noise colour bar covered two panels, the head types' legend a panel title,
    residual CKA's y labels the neighbouring panels; high-norm tokens, shape bias and three more came out 10-16 in
    wide (and 6 models left band noise two empty panels). Each now takes one journal column or two, its panels
    wrapped into rows where one row does not fit."""
    import matplotlib as mpl

    from vitscope.report.export import RC, _relayout
    from vitscope.report.figures._common import context

    tables = _many_model_tables(n_models)
    drawn = 0
    with mpl.rc_context(RC), context(models=list(dict.fromkeys(tables["band_noise"]["model"]))):
        for name, table in tables.items():
            if names is not None and name not in names:
                continue
            for caption, fig in FIGURES[name](table):
                layout = _relayout(fig, None)
                assert round(float(fig.get_figwidth()), 2) in (3.5, 7.16), (name, caption, fig.get_figwidth())
                assert "crowded" not in layout and _print_problems(fig) == [], (name, layout, _print_problems(fig))
                if caption.startswith(("Accuracy drop under", "Head types", "Residual")):  # a row too long for 7.16 in
                    assert "rows of" in layout, (name, layout)
                plt.close(fig)
                drawn += 1
    assert drawn >= (3 if names else 6)


def test_plot_draws_any_figure_from_a_run_or_a_table(run_dir):
    import matplotlib.figure

    from vitscope.report.plot import figures

    fig = vs.plot(run_dir, "attention_distance")  # one Figure, its panels its axes (README: fig.get_label())
    assert isinstance(fig, matplotlib.figure.Figure) and fig.get_label().startswith("Attention distance")
    df = pd.read_parquet(run_dir / "results" / "attention_distance.parquet")
    only = vs.plot(df, models=["tiny-vit"], untrained=["tiny-vit"])
    labels = [t.get_text() for leg in only.legends for t in leg.get_texts()]
    assert "tiny-vit (untrained)" in labels and not any("tiny-beit" in x for x in labels)
    cka = figures(run_dir / "results" / "cka.parquet", token_view="gap")
    assert len(cka) == 2 and "gap token view" in cka[0].get_label()  # the grid and the divergence, one view
    assert all(isinstance(f, matplotlib.figure.Figure) for f in cka)
    second = vs.plot(run_dir / "results" / "cka.parquet", token_view="gap", figure=1)  # one of several
    assert isinstance(second, matplotlib.figure.Figure) and second.get_label() == cka[1].get_label()
    by_caption = vs.plot(run_dir, "cka", token_view="gap", figure=cka[1].get_label()[:40])
    assert by_caption.get_label() == cka[1].get_label()
    with pytest.raises(vs.VitscopeError, match=r"draws 2 figures; pass figure=.*0: .*1: "):
        vs.plot(run_dir, "cka", token_view="gap")  # which one is not guessed
    with pytest.raises(vs.VitscopeError, match="name the analysis"):
        vs.plot(run_dir)
    plt.close("all")


def test_report_states_findings_with_numbers_and_cites_sources_by_name(run_dir):
    html = (run_dir / "report.html").read_text()
    assert "id='summary'" in html and "id='references'" in html
    assert "Matthew Walmer, Saksham Suri" in html and not re.search(r"seeds? 00\d", html, re.I)
    summary = html[html.index("id='summary'"):html.index("id='models'")]
    assert re.search(r"attention distance .* \d+(\.\d+)? ± \d", summary)
    # both tiny models are untrained: nothing is compared with an untrained baseline of itself
    assert "Best 3-NN top-1 (cls token, 95 % binomial interval)" in summary


def test_summary_flags_results_within_noise_of_chance_or_of_the_untrained_model():
    from vitscope.report.summary import Study, summarize

    study = Study(["good", "weak", "dead", "random"], ["random"])
    sem = pd.DataFrame([
        {"model": m, "metric": "knn20_top1", "token_view": "cls", "layer": 0, "value": v, "stderr": 0.02,
         "value_lo": v - 0.04, "value_hi": v + 0.04, "chance": 0.1}
        for m, v in (("good", 0.6), ("weak", 0.32), ("dead", 0.11), ("random", 0.3))])
    dist = pd.DataFrame([{"model": m, "metric": "distance_px", "layer": layer, "head": 0, "value": v, "stderr": se}
                         for m, v, se in (("good", 20.0, 0.1), ("weak", 16.6, 0.1), ("random", 16.5, 0.05))
                         for layer in range(3)])
    points = {p.analysis: p for p in summarize({"attention_distance": dist, "semantics": sem}, study)}
    s = points["semantics"]
    assert "good 0.6 [0.56, 0.64] at block 0" in s.text and "Chance (majority class) is 0.1" in s.text
    # the stars' rule (`is_finding`): weak's best lies above chance but not above the untrained model's best
    # beyond its interval (0.32 - 1.96 x 0.02 <= 0.3)
    assert "within noise of chance: dead" in s.text
    assert "not above the untrained random (0.3) beyond the interval (simultaneous over the layers): weak" in s.text
    assert s.flags == ["chance", "the untrained model"] and s.not_above_chance == ["dead"]
    d = points["attention_distance"]
    # 16.6 vs 16.5 px with standard errors 0.1 and 0.05: |0.1| <= 1.96 sqrt(0.1² + 0.05²) = 0.22 -> within noise
    assert "good 20.00 ± 0.20 px; weak 16.60 ± 0.20 px; random (untrained) 16.500 ± 0.098 px" in d.text  # every model
    assert "Highest good, lowest weak" in d.text and "Within noise of the untrained model: weak." in d.text
    assert d.flags == ["the untrained model"]
    # the best of 8 layers, each at chance on 100 test images: a best of 0.17 clears chance's 95 % interval on its
    # own (its Wilson low end 0.109 > 0.1) but not the interval simultaneous over the 8 layers it was chosen from
    lucky = pd.DataFrame([{"model": "good", "metric": "knn20_top1", "token_view": "cls", "layer": layer,
                           "value": 0.17 if layer == 5 else 0.1, "chance": 0.1, "n_test": 100,
                           "value_lo": 0.109 if layer == 5 else 0.05, "value_hi": 0.25} for layer in range(8)])
    s = next(p for p in summarize({"semantics": lucky}, Study(["good"], [])) if p.analysis == "semantics")
    assert s.not_above_chance == ["good"] and "within noise of chance: good" in s.text


def test_overlay_mosaic_cells_are_the_image_under_the_mean_cls_map(run_dir):
    """Each cell of the per-image overlay is the kept image, paled, under its CLS map (mean of heads, in units of
    uniform attention's on the figure's one log scale centred on 1, bilinear to the image's pixels; torch's
    interpolate here, not the figure's code path)."""
    import io

    import torch

    run = load_run(run_dir)
    df = run.tables["cls_attention_maps"]
    images = df[df.metric == "input_image"]
    image_id = int(sorted(images["image"].dropna().astype(int))[0])
    figs = [(c, f) for c, f in run.figures("cls_attention_maps") if c.startswith(f"Image {image_id} ")]
    assert len(figs) == 1
    ax = _data_axes(figs[0][1])[0]
    mosaic = np.asarray(ax.images[0].get_array(), dtype=float)
    model = images.model.iloc[0]
    pix = np.asarray(Image.open(io.BytesIO(images[(images.model == model) & (images.image == image_id)]
                                           ["png"].iloc[0])).convert("RGB"), dtype=float) / 255
    side = pix.shape[0]
    np.testing.assert_allclose(mosaic[:side, :side], pix)  # first row, first column: the image itself
    maps = df[(df.metric == "cls_attention") & (df.image == image_id) & (df.model == model)]
    layer = sorted(maps.layer.unique())[0]
    grid = maps[maps.layer == layer].groupby(["row", "col"])["value"].mean().unstack().to_numpy()
    grid = grid * grid.size  # ÷ uniform attention's 1 / (rows x columns)
    up = torch.nn.functional.interpolate(torch.tensor(grid)[None, None], size=(side, side), mode="bilinear",
                                         align_corners=False)[0, 0].numpy()
    cbar, = [a for a in figs[0][1].axes if a.get_label() == "<colorbar>"]
    lo, hi = cbar._colorbar.mappable.norm.vmin, cbar._colorbar.mappable.norm.vmax
    assert lo * hi == pytest.approx(1.0) and hi >= 2  # symmetric about uniform, at least x/÷ 2
    heat = plt.get_cmap("inferno")(np.log(np.clip(up, lo, hi) / lo) / np.log(hi / lo))[..., :3]
    pale = 0.55 * pix + 0.45 * pix.mean(-1, keepdims=True)
    n_layers = len(maps.layer.unique())
    gap = (mosaic.shape[1] - (n_layers + 1) * side) // n_layers  # cells and the white gaps between them
    step = side + gap
    assert gap >= 1 and (mosaic[:side, side:step] == 1).all()
    np.testing.assert_allclose(mosaic[:side, step:step + side], 0.4 * pale + 0.6 * heat, atol=1e-9)
    plt.close(figs[0][1])


def test_report_drawn_in_two_processes_is_the_same_report(run_dir, monkeypatch):
    from vitscope.report.html import write_report

    monkeypatch.setenv("VITSCOPE_WORKERS", "1")
    one = write_report(run_dir).read_bytes()
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    two = write_report(run_dir).read_bytes()
    assert one == two and one.count(b"data:image/png;base64,") > 10


# ------------------------------------------------------------------ the default study, small: every figure whole
@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The embedded default study (every analysis) on its pretrained -> fine-tuned pair (zoo-random and
    zoo-random-ft-cls, whose CIFAR-10 head gives the robustness lenses their head readout) and a few images: every
    figure family of the report, drawn from the zoo's real weights."""
    import yaml

    from vitscope.study.config import default_config_path

    cfg = yaml.safe_load(default_config_path().read_text())
    cfg["models"] = [m for m in cfg["models"] if m["name"] in ("zoo-random", "zoo-random-ft-cls")]
    small = {"cifar10": 60, "shapes": 120, "cue-conflict": 24, "cifar10-128": 40, "pairs": 16, "stir_small": 8}
    for name, n in small.items():
        cfg["datasets"][name]["n_images"] = n
    cfg["analyses"]["stir"].update(iterations=2, layers=[1, 7])
    cfg["analyses"]["semantics"].update(probe_tune=False, probe_max_iter=50)
    d = tmp_path_factory.mktemp("default-small")
    cfg.update(output_dir=str(d / "run"), progress=False)
    (d / "study.yaml").write_text(yaml.safe_dump(cfg))
    return run_study(load_config(d / "study.yaml"))


def _text_outside(fig, draw=True):
    """Text that runs past the figure's edges, in display pixels after a draw: titles, labels, legends, notes,
    and of every axis the tick labels it draws (`Axis.get_tightbbox`: those inside its view) with its label."""
    from matplotlib.text import Text

    if draw:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes, tick_labels = [], set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            tick_labels.update(id(t) for t in axis.get_ticklabels(which="both"))
            box = axis.get_tightbbox(renderer) if ax.get_visible() and ax.axison and axis.get_visible() else None
            if box is not None:
                boxes.append((f"an axis of {ax.get_title()!r}", box))
    boxes += [(repr(t.get_text()), t.get_window_extent(renderer)) for t in fig.findobj(Text)
              if id(t) not in tick_labels and t.get_visible() and t.get_text().strip()]
    edge = fig.bbox
    return [f"{what} at {box.bounds} leaves the figure {edge.bounds}" for what, box in boxes
            if box.x0 < edge.x0 - 1 or box.y0 < edge.y0 - 1 or box.x1 > edge.x1 + 1 or box.y1 > edge.y1 + 1]


def test_every_figure_of_the_default_study_keeps_its_text_inside_and_draws_without_a_warning(default_run):
    import warnings

    import matplotlib as mpl

    from vitscope.report.export import RC, _relayout

    run = load_run(default_run)
    assert {"shape_bias", "band_noise", "corruptions", "retrieval", "stir", "best_layers"} <= set(run.figure_names())
    n = 0
    for name in run.figure_names():
        for exported in (False, True):  # as the report draws it, and laid out again at a column's width
            with warnings.catch_warnings(record=True) as caught, mpl.rc_context(RC if exported else {}):
                warnings.simplefilter("always")
                for caption, fig in run.figures(name):
                    if exported:  # a journal column or two wide, its texts apart, no empty panel (issue 41)
                        layout = _relayout(fig, None)
                        assert round(float(fig.get_figwidth()), 2) in (3.5, 7.16), (name, caption)
                        assert "crowded" not in layout and _print_problems(fig) == [], (name, layout, caption)
                    assert _text_outside(fig) == [], (name, exported, caption)  # after a draw: warnings are out
                    if name == "stir" and caption.startswith(("Learning", "Invariance")):  # the y scale named
                        assert fig.axes[0].get_ylabel().strip(), caption
                    plt.close(fig)
                    n += 1
            assert [str(w.message) for w in caught] == [], (name, exported)
    assert n > 2 * len(run.tables)


def test_export_writes_exactly_the_report_figures(default_run, tmp_path):
    html = (default_run / "report.html").read_text()
    files = vs.report.export(default_run, tmp_path, "png")
    assert len(files) == html.count("<figure>")
    names = {re.sub(r"-\d+\.png$", "", f.name) for f in files}
    assert names == set(load_run(default_run).figure_names()) and "best_layers" in names


def test_a_fine_tuned_model_is_named_for_its_start_and_its_task_and_has_its_own_colour(default_run):
    from vitscope.models.registry import describe_family
    from vitscope.report.figures._common import UNTRAINED_COLOR, context, model_color, model_label

    run = load_run(default_run)
    assert run.families["zoo-random-ft-cls"] == "untrained → classification"
    assert run.untrained == ["zoo-random"]
    assert describe_family("contrastive", "mocov3+ft-reconstruction") == "contrastive → reconstruction"
    assert describe_family("explicit", "supervised") == "explicit"
    html = (default_run / "report.html").read_text()
    assert "<td>zoo-random-ft-cls</td><td>untrained → classification</td>" in html
    with run.figure_context():
        assert model_label("zoo-random-ft-cls") == "zoo-random-ft-cls (untrained → classification)"
        assert model_color("zoo-random-ft-cls") != UNTRAINED_COLOR == model_color("zoo-random")
    (caption, fig), = run.figures("attention_distance")
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert "zoo-random-ft-cls (untrained → classification)" in labels and "zoo-random (untrained)" in labels
    plt.close(fig)
    summary = html[html.index("id='summary'"):html.index("id='models'")]
    for m in run.models:  # the summary covers every model
        assert m in summary
    # twelve models: twelve colours, none of them the untrained grey
    models = [f"m{i}" for i in range(12)]
    with context(models, ["m11"]):
        colours = [model_color(m) for m in models]
    assert len(set(colours)) == 12 and colours.count(UNTRAINED_COLOR) == 1 and colours[11] == UNTRAINED_COLOR


def test_best_layer_within_noise_of_chance_is_no_layer_above_chance():
    from vitscope.report.figures.dense import NOT_ABOVE_CHANCE, best_layer_summary, summary_figure
    from vitscope.report.summary import Study, summarize

    def table(model, value, stderr):
        return {"model": model, "metric": "best_mAP_medium", "layer": 3, "token_view": "cls", "value": value,
                "stderr": stderr, "chance": 0.12, "last_layer_value": value}

    # clearly above chance; within noise of it; below it (beyond noise): the last two name no layer
    df = pd.DataFrame([table("good", 0.5, 0.02), table("noisy", 0.15, 0.03), table("below", 0.08, 0.01)])
    s = best_layer_summary({"retrieval": df}).set_index("model")
    assert s.loc["good", "best"] == "block 3" and bool(s.loc["good", "above_chance"])
    assert s.loc["noisy", "best"] == s.loc["below", "best"] == NOT_ABOVE_CHANCE
    assert not s["above_chance"].loc[["noisy", "below"]].any()
    (caption, fig), = summary_figure(s.reset_index())
    image = fig.axes[0].images[0]
    assert image.norm.vmin < 0 < image.norm.vmax  # the scale reaches below chance, diverging around it
    cells = [t.get_text() for t in fig.axes[0].texts]
    assert sum("at chance" in t for t in cells) == 2 and "block 3" in cells[0]
    plt.close(fig)
    point, = summarize({"retrieval": df}, Study(["good", "noisy", "below"], []))
    assert point.not_above_chance == ["noisy", "below"] and "good 0.500 ± 0.039 at block 3" in point.text


def test_the_reports_redraw_call_of_every_section_draws_one_of_its_figures(run_dir):
    """The call each section of the report shows works as written: `vs.plot` gives one Figure, so a section of
    several figures says figure=i and the range it has; a section of one shows the call without it."""
    import re

    import matplotlib.figure

    from vitscope.report.plot import figures

    html = (run_dir / "report.html").read_text()
    calls = re.findall(r"<code>vitscope\.plot\(run_dir, '(\w+)'(, figure=i)?\)</code>(?: \(i from 0 to (\d+))?", html)
    assert {name for name, _, _ in calls} == set(load_run(run_dir).tables)
    for name, several, last in calls:
        n = len(figures(run_dir, name))
        plt.close("all")
        if several:
            assert n > 1 and int(last) == n - 1, name
            fig = vs.plot(run_dir, name, figure=int(last))
        else:
            assert n == 1, name
            fig = vs.plot(run_dir, name)
        assert isinstance(fig, matplotlib.figure.Figure)
        plt.close("all")
