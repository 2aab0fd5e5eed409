"""Figures of the similarity analyses (`vitscope.analyses.similarity`)."""

from __future__ import annotations

import pandas as pd

from vitscope.report.figures._common import Figures, layer_figure, layer_lines, plt


def _heatmap(ax: plt.Axes, mat: pd.DataFrame, xlabel: str, ylabel: str) -> plt.cm.ScalarMappable:
    im = ax.imshow(mat.values, origin="lower", vmin=0, vmax=1, cmap="magma")
    ax.set_xticks(range(mat.shape[1]), [_short(t) for t in mat.columns], rotation=90, fontsize=6)
    ax.set_yticks(range(mat.shape[0]), [_short(t) for t in mat.index], fontsize=6)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    return im


def cka(df: pd.DataFrame) -> Figures:
    """Tap x tap CKA heatmaps: each model against itself, then each pair of models [seed 003 Fig. 6, 19],
    and CKA divergence per layer between models [seed 002 eq. 4]."""
    out: Figures = []
    grid = df[df.metric == "cka_minibatch"]
    for (ma, mb, view), g in grid.groupby(["model", "model_b", "token_view"], sort=False):
        taps_a = list(dict.fromkeys(g["tap"]))
        taps_b = list(dict.fromkeys(g["tap_b"]))
        mat = g.pivot_table(index="tap", columns="tap_b", values="value").reindex(index=taps_a, columns=taps_b)
        fig, ax = plt.subplots(figsize=(4.2, 3.6))
        im = _heatmap(ax, mat, mb, ma)
        fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        out.append((f"CKA {ma} vs {mb} ({view} token view). Bright = similar representations; "
                    "the diagonal of a model against itself is 1.", fig))
    div = df[df.metric == "cka_divergence"]
    if len(div):
        pairs = div.assign(model=div["model"] + " vs " + div["model_b"] + " (" + div["token_view"] + ")")
        fig = layer_figure(pairs, "cka_divergence", "1 - CKA (same layer)", figsize=(5.5, 3.4))
        out.append(("CKA divergence per layer between models (e.g. pretrained vs fine-tuned): "
                    "higher = the layer changed more", fig))
    return out


def residual_cka(df: pd.DataFrame) -> Figures:
    """Skip path (rows: input of block i) vs branch output (columns: block j) [seed 003 Fig. 23]."""
    out: Figures = []
    for (model, view), g in df.groupby(["model", "token_view"], sort=False):
        fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.4))
        for ax, branch in zip(axes, ("attn_out", "mlp_out"), strict=True):
            h = g[g.metric == f"skip_vs_{branch}"]
            mat = h.pivot_table(index="layer", columns="layer_b", values="value")
            im = ax.imshow(mat.values, origin="lower", vmin=0, vmax=1, cmap="magma")
            ax.set_xlabel(f"block j ({branch})", fontsize=8)
            ax.set_ylabel("skip path into block i", fontsize=8)
            ax.set_title(branch, fontsize=8)
        fig.colorbar(im, ax=axes, fraction=0.046)
        out.append((f"Residual-connection CKA, {model} ({view}): a dark diagonal means each branch adds "
                    "something the skip path did not carry", fig))
    return out


def diversity(df: pd.DataFrame) -> Figures:
    """Similarity between heads, between spatial tokens, and before/after attention, per layer [seed 001]."""
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2), sharey=True)
    for ax, what in zip(axes, ("heads", "tokens", "depth"), strict=True):
        for measure, style in (("cka", "-o"), ("cosine", "--s")):
            layer_lines(ax, df, f"{measure}_{what}", style, label_suffix=f" ({measure})", title=what)
    axes[0].set_ylabel("similarity")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return [("Representation diversity inside self-attention: high similarity = low diversity "
             "(solid: minibatch CKA, dashed: cosine)", fig)]


def _short(tap: str) -> str:
    return tap.replace("block", "b").replace(".out", "")


FIGURES = {"cka": cka, "residual_cka": residual_cka, "diversity": diversity}
