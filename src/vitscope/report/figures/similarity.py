"""Figures of the similarity analyses (`vitscope.analyses.similarity`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from vitscope.references import cite
from vitscope.report.figures._common import (
    Figures,
    band_handle,
    colorbar,
    grid_layout,
    grid_shape,
    has_interval,
    layer_lines,
    legend_outside,
    model_color,
    model_label,
    models_of,
    panels,
    plt,
    style_handle,
)


def _heatmap(ax: plt.Axes, mat: pd.DataFrame, xlabel: str, ylabel: str) -> plt.cm.ScalarMappable:
    im = ax.imshow(mat.values, origin="lower", vmin=0, vmax=1, cmap="magma")
    ax.set_xticks(range(mat.shape[1]), [_short(t) for t in mat.columns], rotation=90, fontsize=6)
    ax.set_yticks(range(mat.shape[0]), [_short(t) for t in mat.index], fontsize=6)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    return im


def cka(df: pd.DataFrame) -> Figures:
    """Tap x tap CKA, one figure per token view: one mosaic whose block (A, B) is model A (rows: its taps)
    against model B (columns), each model against itself on the diagonal, the pairs the table holds once
    mirrored across it [Walmer et al. 2023 Fig. 6, 19]; then CKA divergence per layer between models
    [Merlin et al. 2023 eq. 4], a panel per model with a line per other model. One figure per view, not per
    pair: the figure count stays constant in the number of models. The mosaic is one image (white lines
    between models), drawn with a single imshow: a grid of n x n panels took seconds to lay out and render."""
    out: Figures = []
    grid = df[df.metric == "cka_minibatch"]
    for view, gv in grid.groupby("token_view", sort=False):
        fig = _cka_mosaic(gv)
        out.append((f"CKA between the taps of every pair of models ({view} token view): block (row A, column B) "
                    "has A's taps on its rows and B's on its columns, layer 0 at the bottom left. Bright = similar "
                    "representations; a model against itself has 1 on its diagonal.", fig))
    div = df[df.metric == "cka_divergence"]
    for view, gv in div.groupby("token_view", sort=False):
        out.append(_divergence(gv, str(view)))
    return out


def _cka_offsets(taps: dict[str, list[str]]) -> dict[str, int]:
    """Where each model's block starts in the CKA mosaic (one empty row / column between models)."""
    offsets, at = {}, 0
    for model, t in taps.items():
        offsets[model] = at
        at += len(t) + 1
    return offsets


def _cka_mosaic(gv: pd.DataFrame) -> plt.Figure:
    models = list(dict.fromkeys([*gv["model"], *gv["model_b"]]))
    taps: dict[str, list[str]] = {m: [] for m in models}
    for col_m, col_t in (("model", "tap"), ("model_b", "tap_b")):
        for m, t in zip(gv[col_m], gv[col_t], strict=True):
            if t not in taps[m]:
                taps[m].append(t)
    off = _cka_offsets(taps)
    n = off[models[-1]] + len(taps[models[-1]])
    mosaic = np.full((n, n), np.nan)
    for (ma, mb), g in gv.groupby(["model", "model_b"], sort=False):
        ia = g["tap"].map({t: i for i, t in enumerate(taps[ma])}).to_numpy() + off[ma]
        ib = g["tap_b"].map({t: i for i, t in enumerate(taps[mb])}).to_numpy() + off[mb]
        values = g["value"].to_numpy(dtype=float)
        mirror = np.isnan(mosaic[ib, ia]) & (ma != mb)  # the other order, unless the table has it too
        mosaic[ia, ib] = values
        mosaic[ib[mirror], ia[mirror]] = values[mirror]
    side = min(11.0, max(3.2, 0.13 * n + 1.5))
    fig, ax = plt.subplots(figsize=(side + 1.4, side + 0.6), layout="constrained")
    im = ax.imshow(mosaic, origin="lower", vmin=0, vmax=1, cmap=plt.get_cmap("magma").with_extremes(bad="white"),
                   interpolation="nearest")
    pos = [off[m] + i for m in models for i in range(len(taps[m]))]
    short = [_short(t) for m in models for t in taps[m]]
    fs = 6 if n <= 40 else 4.5
    ax.set_xticks(pos, short, minor=True)
    ax.set_yticks(pos, short, minor=True)
    ax.tick_params(which="minor", length=1.5, labelsize=fs)
    ax.tick_params(axis="x", which="minor", labelrotation=90)
    centres = [off[m] + (len(taps[m]) - 1) / 2 for m in models]
    ax.set_xticks(centres, [model_label(m, lines=True) for m in models], rotation=30, ha="right")
    ax.set_yticks(centres, [model_label(m, lines=True) for m in models])
    pad = 6 + 0.75 * fs * max(len(s) for s in short)  # points: beyond the taps' labels
    ax.tick_params(which="major", length=0, pad=pad, labelsize=7)
    ax.set_xlabel("model B (its taps)", fontsize=8)
    ax.set_ylabel("model A (its taps)", fontsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    colorbar(fig, im, ax, "CKA", shrink=0.7)
    return fig


def _divergence(div: pd.DataFrame, view: str) -> tuple[str, plt.Figure]:
    """1 - CKA of the same layer in two models: one panel per model, a line (with its band) per other model,
    so no panel holds more lines than there are models."""
    both = pd.concat([div, div.rename(columns={"model": "model_b", "model_b": "model"})], ignore_index=True)
    models = models_of(both)
    rows, cols = grid_shape(len(models), 4)
    fig, axes = panels(rows, cols, panel=(3.0, 2.3), sharey=True)
    for ax, model in zip(axes.flat, models, strict=False):
        g = both[both.model == model]
        others = g.assign(model=g["model_b"])  # a line per other model, in its own colour
        layer_lines(ax, others, "cka_divergence", title=f"{model_label(model, lines=True)} vs ...")
    for ax in axes.flat[len(models):]:
        ax.set_axis_off()
    for ax in axes[:, 0]:
        ax.set_ylabel("1 - CKA (same layer)")
    legend_outside(fig, extra=[band_handle()] if has_interval(div) else [])
    return (f"CKA divergence per layer between models ({view} token view): one panel per model, a line per "
            "other model; higher = the layer differs more (e.g. pretrained vs fine-tuned) "
            f"[{cite('merlin2023', 'eq. 4')}]", fig)


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
            colorbar(fig, im, axes, "CKA")
        out.append((f"Residual-connection CKA ({view} token view), one row per model: the skip path into block i "
                    "against the attention (left) and MLP (right) branch of block j; a dark diagonal means each "
                    "branch adds something the skip path did not carry", fig))
    return out


def diversity(df: pd.DataFrame) -> Figures:
    """Similarity between heads, between spatial tokens, and before/after attention, per layer, with 95 %
    bands [Park et al. 2023; Wang 2023]."""
    fig, axes = panels(1, 3, panel=(3.2, 2.7), sharey=True)
    for ax, what in zip(axes[0], ("heads", "tokens", "depth"), strict=True):
        for measure, style in (("cka", "-o"), ("cosine", "--s")):
            layer_lines(ax, df, f"{measure}_{what}", style, title=what)
    axes[0, 0].set_ylabel("similarity")
    handles = [style_handle("-", model_label(m), color=model_color(m, models_of(df))) for m in models_of(df)]
    extra = [style_handle("-o", "solid: minibatch CKA"), style_handle("--s", "dashed: cosine")]
    if has_interval(df):
        extra.append(band_handle())
    legend_outside(fig, handles=handles, extra=extra)
    return [("Representation diversity inside self-attention: high similarity = low diversity (solid: minibatch "
             f"CKA, dashed: cosine) [{cite('park2023')}; {cite('wang_clmm')}]", fig)]


def _short(tap: str) -> str:
    return tap.replace("block", "b").replace(".out", "")


FIGURES = {"cka": cka, "residual_cka": residual_cka, "diversity": diversity}
