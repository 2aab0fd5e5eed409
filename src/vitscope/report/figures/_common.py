"""Shared plotting helpers: every figure module returns a list of (title, matplotlib Figure)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

Figures = list[tuple[str, plt.Figure]]


def layer_lines(ax: plt.Axes, df: pd.DataFrame, metric: str, style: str = "-o", label_suffix: str = "",
                title: str | None = None, mark_best: bool = False) -> None:
    """One line per model of ``metric`` against the block index (mean over any other rows of a layer),
    same colour per model across panels; optionally a star on the best layer. The model's random-chance
    rows (``<metric>_chance``) are drawn dashed in its colour: a horizontal line when they have no layer,
    else a line over the layers."""
    d = df[df.metric == metric]
    for k, (model, g) in enumerate(d.groupby("model", sort=False)):
        per_layer = g.groupby("layer")["value"].mean().sort_index()
        ax.plot(per_layer.index, per_layer.values, style, ms=3, color=f"C{k}", label=f"{model}{label_suffix}")
        if mark_best and len(per_layer):
            ax.plot([per_layer.idxmax()], [per_layer.max()], "*", ms=10, color=f"C{k}")
        chance = df[(df.metric == f"{metric}_chance") & (df.model == model)]
        if chance["layer"].notna().any():
            c = chance.groupby("layer")["value"].mean().sort_index()
            ax.plot(c.index, c.values, "--", lw=1, color=f"C{k}", alpha=0.6)
        elif len(chance):
            ax.axhline(float(chance["value"].mean()), ls="--", lw=1, color=f"C{k}", alpha=0.6)
    if title:
        ax.set_title(title, fontsize=9)
    ax.set_xlabel("block")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def layer_figure(df: pd.DataFrame, metric: str, ylabel: str, figsize: tuple[float, float] = (5.5, 3.2)) -> plt.Figure:
    """One panel of `layer_lines` for ``metric``, with a y label and the models' legend."""
    fig, ax = plt.subplots(figsize=figsize)
    layer_lines(ax, df, metric)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def grid_layout(fig: plt.Figure, left: float = 0.55, right: float = 0.12, top: float = 0.32, bottom: float = 0.45,
                wspace: float = 0.32, hspace: float = 0.62) -> None:
    """Fixed margins (inches) for a grid of small panels: ``tight_layout`` measures every tick label and
    cost half the time of a many-panel figure; panels of layer curves have labels of known size."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h,
                        wspace=wspace, hspace=hspace)
