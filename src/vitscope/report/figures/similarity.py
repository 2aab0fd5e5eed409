"""Figures of the similarity analyses (`vitscope.analyses.similarity`)."""

from __future__ import annotations

import pandas as pd

from vitscope.report.figures._common import Figures, grid_layout, layer_figure, layer_lines, plt


def _heatmap(ax: plt.Axes, mat: pd.DataFrame, xlabel: str, ylabel: str) -> plt.cm.ScalarMappable:
    im = ax.imshow(mat.values, origin="lower", vmin=0, vmax=1, cmap="magma")
    ax.set_xticks(range(mat.shape[1]), [_short(t) for t in mat.columns], rotation=90, fontsize=6)
    ax.set_yticks(range(mat.shape[0]), [_short(t) for t in mat.index], fontsize=6)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    return im


def cka(df: pd.DataFrame) -> Figures:
    """Tap x tap CKA heatmaps, one figure per token view: a grid whose cell (A, B) is model A (rows: its
    taps) against model B (columns), each model against itself on the diagonal [Walmer et al. 2023 Fig. 6, 19]; then
    CKA divergence per layer between models [Merlin et al. 2023 eq. 4]. One figure per view, not per pair: the
    figure count stays constant in the number of models."""
    out: Figures = []
    grid = df[df.metric == "cka_minibatch"]
    for view, gv in grid.groupby("token_view", sort=False):
        models = list(dict.fromkeys([*gv["model"], *gv["model_b"]]))
        n = len(models)
        size = 2.3 if n > 1 else 3.4
        fig, axes = plt.subplots(n, n, figsize=(size * n + 1.1, size * n + 0.3), squeeze=False)
        grid_layout(fig, left=0.6, right=1.0, top=0.3, bottom=0.55, wspace=0.45, hspace=0.45)
        im = None
        for (ma, mb), g in gv.groupby(["model", "model_b"], sort=False):
            ax = axes[models.index(ma), models.index(mb)]
            taps_a, taps_b = list(dict.fromkeys(g["tap"])), list(dict.fromkeys(g["tap_b"]))
            mat = g.pivot_table(index="tap", columns="tap_b", values="value").reindex(index=taps_a, columns=taps_b)
            im = _heatmap(ax, mat, mb, ma)
        for ax in axes.flat:
            if not ax.images:
                ax.set_axis_off()
        if im is not None:
            fig.colorbar(im, ax=axes, fraction=0.03 if n > 1 else 0.046)
        out.append((f"CKA between the taps of every pair of models ({view} token view): cell (row A, column B) "
                    "has A's taps on its rows and B's on its columns. Bright = similar representations; a model "
                    "against itself has 1 on its diagonal.", fig))
    div = df[df.metric == "cka_divergence"]
    if len(div):
        pairs = div.assign(model=div["model"] + " vs " + div["model_b"] + " (" + div["token_view"] + ")")
        fig = layer_figure(pairs, "cka_divergence", "1 - CKA (same layer)", figsize=(5.5, 3.4))
        out.append(("CKA divergence per layer between models (e.g. pretrained vs fine-tuned): "
                    "higher = the layer changed more", fig))
    return out


def residual_cka(df: pd.DataFrame) -> Figures:
    """Skip path (rows: input of block i) vs branch output (columns: block j) [Walmer et al. 2023 Fig. 23]: one figure
    per token view, a row of two panels (attention and MLP branch) per model."""
    out: Figures = []
    for view, gv in df.groupby("token_view", sort=False):
        models = list(dict.fromkeys(gv["model"]))
        fig, axes = plt.subplots(len(models), 2, figsize=(6.4, 2.7 * len(models) + 0.4), squeeze=False)
        grid_layout(fig, left=0.75, right=1.0, top=0.35, bottom=0.5, wspace=0.35, hspace=0.55)
        im = None
        for row, model in zip(axes, models, strict=True):
            g = gv[gv.model == model]
            for ax, branch in zip(row, ("attn_out", "mlp_out"), strict=True):
                mat = g[g.metric == f"skip_vs_{branch}"].pivot_table(index="layer", columns="layer_b", values="value")
                im = ax.imshow(mat.values, origin="lower", vmin=0, vmax=1, cmap="magma")
                ax.set_xlabel(f"block j ({branch})", fontsize=8)
                ax.set_ylabel(f"{model}\nskip path into block i", fontsize=8)
                ax.tick_params(labelsize=6)
        if im is not None:
            fig.colorbar(im, ax=axes, fraction=0.046)
        out.append((f"Residual-connection CKA ({view} token view), one row per model: the skip path into block i "
                    "against the attention (left) and MLP (right) branch of block j; a dark diagonal means each "
                    "branch adds something the skip path did not carry", fig))
    return out


def diversity(df: pd.DataFrame) -> Figures:
    """Similarity between heads, between spatial tokens, and before/after attention, per layer [Park et al. 2023]."""
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
