"""Figures of the attention analyses (`vitscope.analyses.attention`)."""

from __future__ import annotations

import pandas as pd

from vitscope.report.figures._common import Figures, plt


def attention_distance(df: pd.DataFrame) -> Figures:
    """Distance per head (dots) and the per-layer mean (line), one colour per model [seed 003 Fig. 4]."""
    d = df[df.metric == "distance_px"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, (model, g) in enumerate(d.groupby("model", sort=False)):
        color = f"C{k}"
        jitter = (g["head"] / max(g["head"].max(), 1) - 0.5) * 0.3
        ax.scatter(g["layer"] + jitter, g["value"], s=9, alpha=0.5, color=color)
        mean = g.groupby("layer")["value"].mean()
        ax.plot(mean.index, mean.values, "-o", ms=3, color=color, label=model)
    ax.set_xlabel("block")
    ax.set_ylabel("mean attention distance (px)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return [("Attention distance per head and layer", fig)]


FIGURES = {"attention_distance": attention_distance}
