"""Figures of the similarity analyses (`vitscope.analyses.similarity`)."""

from __future__ import annotations

import pandas as pd

from vitscope.report.figures._common import Figures, plt


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


FIGURES = {"cka": cka}
