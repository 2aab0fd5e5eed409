"""Every figure vitscope draws, one function per analysis, keyed by analysis name.

Each takes the analysis's tidy table and returns a list of (title, matplotlib Figure).
"""

from __future__ import annotations

from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

Figures = list[tuple[str, plt.Figure]]


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


def cka(df: pd.DataFrame) -> Figures:
    """Layer x layer CKA heatmaps: each model against itself, then each pair of models."""
    out: Figures = []
    for (ma, mb, view), g in df.groupby(["model", "model_b", "token_view"], sort=False):
        taps_a = list(dict.fromkeys(g["tap"]))
        taps_b = list(dict.fromkeys(g["tap_b"]))
        mat = g.pivot_table(index="tap", columns="tap_b", values="value").reindex(index=taps_a, columns=taps_b)
        fig, ax = plt.subplots(figsize=(4.2, 3.6))
        im = ax.imshow(mat.values, origin="lower", vmin=0, vmax=1, cmap="magma")
        ax.set_xticks(range(len(taps_b)), [_short(t) for t in taps_b], rotation=90, fontsize=6)
        ax.set_yticks(range(len(taps_a)), [_short(t) for t in taps_a], fontsize=6)
        ax.set_xlabel(mb)
        ax.set_ylabel(ma)
        fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        out.append((f"CKA {ma} vs {mb} ({view})", fig))
    return out


def _short(tap: str) -> str:
    return tap.replace("block", "b").replace(".out", "")


FIGURES: dict[str, Callable[[pd.DataFrame], Figures]] = {
    "attention_distance": attention_distance,
    "cka": cka,
}


