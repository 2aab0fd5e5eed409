"""Figures of the semantics analysis (`vitscope.analyses.semantics`)."""

from __future__ import annotations

import re

import pandas as pd

from vitscope.references import cite
from vitscope.report.figures._common import (
    Figures,
    band_handle,
    layer_lines,
    legend_outside,
    not_computed,
    panels,
    style_handle,
)

# (metric, title, the analysis parameter that chooses its views, or None when it runs on every view)
PANELS = [("knn_top1", "k-NN top-1", None), ("probe_top1", "linear probe top-1", "probe"),
          ("kmeans_purity", "k-means purity", "kmeans")]


def _knn_metric(df: pd.DataFrame) -> str | None:
    """The k-NN top-1 metric to draw: 20-NN as the sources, else the smallest k in the table."""
    ks = sorted({int(m.group(1)) for m in (re.fullmatch(r"knn(\d+)_top1", x) for x in df.metric.unique()) if m})
    if not ks:
        return None
    return "knn20_top1" if 20 in ks else f"knn{ks[0]}_top1"


def semantics(df: pd.DataFrame) -> Figures:
    """Per-layer curves per model and token view with their 95 % binomial bands, best layer starred where it is a
    finding (`vitscope.report.figures._common.best_layer_finding`), the
    Gaussian-feature chance rows dashed and the majority-class rate dotted [Walmer et al. 2023 Fig. 7, 9;
    Shekhar et al. 2022 Fig. 3]. A view a panel's score was not computed for says so in place, with the
    parameter that enables it."""
    df = df[df.model_b.isna()] if "model_b" in df.columns else df  # probe agreement rows are pairwise
    knn = _knn_metric(df)
    panels_ = [(knn if m == "knn_top1" else m, (f"{knn.split('_')[0][3:]}-NN top-1" if m == "knn_top1" and knn
                                                 else title), param)
               for m, title, param in PANELS]
    panels_ = [(m, t, p) for m, t, p in panels_ if m is not None and (df.metric == m).any()]
    if not panels_:
        return []
    views = list(dict.fromkeys(df["token_view"].dropna()))
    fig, axes = panels(len(views), len(panels_), panel=(3.3, 2.5))
    has_chance = "chance" in df.columns and df["chance"].notna().any()
    for r, view in enumerate(views):
        dv = df[df.token_view == view]
        for c, (metric, title, param) in enumerate(panels_):
            ax = axes[r][c]
            ax.set_title(f"{title} ({view})", fontsize=9)
            if not (dv.metric == metric).any():
                done = sorted(set(df[df.metric == metric].token_view.dropna()))
                not_computed(ax, f"{title} not computed for the '{view}' view: add it to "
                                 f"analyses.semantics.{param} (computed for: {', '.join(done)})"
                             if param else f"{title}: no {view} rows in this run")
                continue
            layer_lines(ax, dv, metric, mark_best=True)
            if has_chance:
                chance = dv[dv.metric == metric]["chance"].dropna()
                if len(chance):
                    ax.axhline(float(chance.mean()), ls=":", lw=1.2, color="0.2")
    extra = [style_handle("*", "best layer, above chance and\nthe untrained model", ms=8),
             style_handle("--", "dashed: same score on Gaussian features")]
    if has_chance:
        extra.append(style_handle(":", "dotted: majority-class rate", color="0.2"))
    extra.append(band_handle("band: 95 % binomial interval"))
    legend_outside(fig, extra=extra)
    note = ""
    scored = df[df.metric.str.endswith("top1") & ~df.metric.str.endswith("_chance") & df["layer"].notna()]
    if has_chance and "value_hi" in scored.columns and scored["chance"].notna().any():
        above = scored[scored["value_lo"] > scored["chance"]]
        if above.empty:
            note = ("Every accuracy here is within noise of the majority-class rate: these features do not "
                    "separate these classes. ")
        else:
            note = (f"{len(above)} of {len(scored)} accuracies clear the majority-class rate beyond their 95 % "
                    "interval. ")
    return [(note + "Which layer knows the class: k-NN, linear probe and k-means purity per layer and token view "
             "(star = best layer, only where its 95 % interval, simultaneous over the layers, clears both chance and "
             "the untrained model's best; bands: 95 % binomial intervals over the test images) "
             f"[{cite('walmer2023', 'Fig. 7, 9')}; {cite('shekhar2022', 'Fig. 3')}]", fig)]


FIGURES = {"semantics": semantics}
