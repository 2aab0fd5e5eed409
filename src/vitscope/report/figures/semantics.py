"""Figures of the semantics analysis (`vitscope.analyses.semantics`)."""

from __future__ import annotations

import pandas as pd

from vitscope.report.figures._common import Figures, grid_layout, layer_lines, plt

PANELS = [("knn20_top1", "20-NN top-1"), ("probe_top1", "linear probe top-1"), ("kmeans_purity", "k-means purity")]


def semantics(df: pd.DataFrame) -> Figures:
    """Per-layer curves per model and token view, best layer marked, chance as a dashed line
    [Walmer et al. 2023 Fig. 7, 9; Shekhar et al. 2022 Fig. 3]."""
    panels = [(m, t) for m, t in PANELS if (df.metric == m).any()]
    if not panels:
        return []
    views = list(dict.fromkeys(df["token_view"].dropna()))
    fig, axes = plt.subplots(len(views), len(panels), figsize=(3.6 * len(panels), 2.8 * len(views)), squeeze=False)
    for r, view in enumerate(views):
        for c, (metric, title) in enumerate(panels):
            ax = axes[r][c]
            layer_lines(ax, df[df.token_view == view], metric, title=f"{title} ({view})", mark_best=True)
    axes[0][0].legend(fontsize=7)
    grid_layout(fig)
    return [("Which layer knows the class: k-NN, linear probe and k-means purity per layer (star = best layer, "
             "dashed = the same metric on Gaussian features of the same shape)", fig)]


FIGURES = {"semantics": semantics}
