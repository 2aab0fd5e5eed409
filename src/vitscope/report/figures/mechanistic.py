"""Figures of the mechanistic lens (`vitscope.analyses.mechanistic`): rollout, logit lens, high-norm tokens."""

from __future__ import annotations

import numpy as np
import pandas as pd

from vitscope.references import cite
from vitscope.report.figures._common import (
    Figures,
    band_handle,
    layer_lines,
    legend_outside,
    model_color,
    models_of,
    panels,
    plt,
    style_handle,
    uniform_line,
)


def _maps_mosaic(d: pd.DataFrame, title_models: list[str]) -> plt.Figure:
    """One row per model, one column per block: each block's mean map (``row``, ``col`` cells) in units of
    uniform attention's (the map times its R C cells; 1 = uniform), tiled into one image and drawn with a single
    imshow on one logarithmic scale for the figure (`uniform_norm`), so a near-uniform map reads flat."""
    from vitscope.report.figures._common import model_label
    from vitscope.report.figures.attention import in_norm, uniform_colorbar, uniform_norm

    layers = sorted(int(x) for x in d["layer"].unique())
    R, C = int(d["row"].max()) + 1, int(d["col"].max()) + 1
    mosaic = np.full((len(title_models) * (R + 1) - 1, len(layers) * (C + 1) - 1), np.nan)
    for i, model in enumerate(title_models):
        g = d[d.model == model]
        for j, layer in enumerate(layers):
            cell = g[g["layer"] == layer]
            if cell.empty:
                continue
            m = np.full((R, C), np.nan)
            m[cell["row"].astype(int), cell["col"].astype(int)] = cell["value"].astype(float)
            mosaic[i * (R + 1):i * (R + 1) + R, j * (C + 1):j * (C + 1) + C] = m / np.nansum(m) * (R * C)
    norm = uniform_norm(mosaic)
    cell = min(0.75, 9.0 / max(len(layers), 1))
    fig, ax = plt.subplots(figsize=(len(layers) * cell + 2.2, len(title_models) * cell + 0.6), layout="constrained")
    im = ax.imshow(in_norm(mosaic, norm), cmap=plt.get_cmap("viridis").with_extremes(bad="white"), norm=norm,
                   interpolation="nearest")
    ax.set_xticks([j * (C + 1) + (C - 1) / 2 for j in range(len(layers))], [f"b{b}" for b in layers], fontsize=6)
    ax.set_yticks([i * (R + 1) + (R - 1) / 2 for i in range(len(title_models))],
                  [model_label(m) for m in title_models], fontsize=6)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    uniform_colorbar(fig, im, ax, "map", short=True, shrink=0.8)
    return fig


def _queries(df: pd.DataFrame) -> str:
    """A title's clause naming the models rolled out from another query than the CLS token (models without one)."""
    if "query" not in df.columns:
        return ""
    other = df[df["query"].notna() & (df["query"] != "cls")].drop_duplicates("model")
    if other.empty:
        return ""
    return ("; without a CLS token, the row of the model's readout (CLS attention: that query's): "
            + ", ".join(f"{m} ({q})" for m, q in zip(other.model, other["query"], strict=True)))


def attention_rollout(df: pd.DataFrame) -> Figures:
    """Foreground IoU of the rollout map (solid) and of the same block's CLS attention, heads averaged
    (dashed), per block with 95 % bands; then the mean rollout map of every block, one row per model
    [Abnar and Zuidema 2020; IoU rule of Walmer et al. 2023 §4.4]."""
    out: Figures = []
    # a model without a CLS token is rolled out from its readout's query (column 'query'): its reference is that
    # query's attention (iou_query_attention), drawn as the CLS attention is
    df = df.assign(metric=df.metric.replace({"iou_query_attention": "iou_cls_attention"}))
    queries = _queries(df)
    iou = df[df.metric.isin(["iou_rollout", "iou_cls_attention"])]
    if not iou.empty and iou["value"].notna().any():
        fig, axes = panels(1, 2, panel=(3.6, 3.0))
        layer_lines(axes[0, 0], iou, "iou_rollout", "-o", title="IoU with the foreground")
        layer_lines(axes[0, 0], iou, "iou_cls_attention", "--", label_suffix=" (CLS attention)")
        axes[0, 0].set_ylim(0, 1)
        uniform = df[df.metric == "iou_uniform"]
        uniform_line(axes[0, 0], uniform, models_of(iou))
        layer_lines(axes[0, 1], df, "iou_gain", "-o", title="rollout minus CLS attention (per image)")
        axes[0, 1].axhline(0, color="0.3", lw=0.8)
        legend_outside(fig, extra=[style_handle("-o", "solid: rollout"), style_handle("--", "dashed: CLS attention"),
                                   band_handle()])
        ref = ("; black dashed: uniform attention on the same masks, the level of a map with no spatial preference"
               if not uniform.empty else "; no uniform-attention reference in this table (rerun attention_rollout)")
        out.append(("Does rollout find the object better than the CLS attention of the same block? Foreground IoU "
                    f"per block [{cite('abnar2020')}; IoU as {cite('walmer2023', '§4.4')}]{ref}{queries}", fig))
    maps = df[df.metric == "rollout_map"]
    if not maps.empty:
        out.append((f"Mean attention rollout map (CLS row{queries and ', or the readout query'}) up to each block, "
                    "one row per model, in units of uniform "
                    "attention's on one logarithmic scale (1 = uniform: a map with no spatial preference is one flat "
                    f"colour) [{cite('abnar2020')}]",
                    _maps_mosaic(maps, models_of(maps))))
    return out


def logit_lens(df: pd.DataFrame) -> Figures:
    """KL of each block's prediction to the final one, its agreement with the final top-1, and its accuracy
    when the labels can be scored, per block with 95 % bands; the readout (head or probe) in the title."""
    metrics = [(m, t) for m, t in (("kl_to_final", "KL(final ‖ block), nats"),
                                   ("agreement_with_final", "top-1 = final top-1"),
                                   ("top1_accuracy", "top-1 accuracy")) if (df.metric == m).any()]
    if not metrics:
        return []
    fig, axes = panels(1, len(metrics), panel=(3.3, 2.8))
    for ax, (metric, title) in zip(axes[0], metrics, strict=True):
        layer_lines(ax, df, metric, title=title)
        if metric == "kl_to_final":
            ax.set_yscale("symlog", linthresh=0.1)  # a probe read on early blocks can sit tens of nats away
    legend_outside(fig, extra=[band_handle("band: 95 % interval")])
    readouts = ", ".join(sorted({str(r) for r in df.get("readout", pd.Series(dtype=str)).dropna()}))
    return [(f"Logit lens: each block read out by the final norm and the {readouts or 'head'} "
             f"[{cite('nostalgebraist2020')}]", fig)]


def high_norm_tokens(df: pd.DataFrame) -> Figures:
    """Patch-token norm per block (median line, 1-99 % band, maximum dotted) per model; outliers per image;
    the CLS attention they absorb beside what uniform attention would give them [Darcet et al. 2024]."""
    q = df[(df.metric == "norm_quantile") & (df.token_view == "spatial")]
    if q.empty:
        return []
    fig, axes = panels(1, 3, panel=(3.3, 2.8))
    ax = axes[0, 0]
    models = models_of(q)
    for model in models:
        g = q[q.model == model]
        color = model_color(model, models)

        def at(level: float, g: pd.DataFrame = g) -> pd.Series:
            return g[g["quantile"] == level].groupby("layer")["value"].mean().sort_index()

        med, lo, hi, mx = at(0.5), at(0.01), at(0.99), at(1.0)
        ax.plot(med.index, med.values, "-o", ms=3, color=color)
        ax.fill_between(lo.index.astype(float), lo.values, hi.values, color=color, alpha=0.15, lw=0)
        ax.plot(mx.index, mx.values, ":", color=color)
    ax.set_yscale("log")
    ax.set_title("patch-token norm", fontsize=9)
    ax.set_xlabel("block")
    ax.grid(alpha=0.3)
    layer_lines(axes[0, 1], df, "outliers_per_image", title="outliers per image")
    absorbed = df[(df.metric == "cls_attention_absorbed")]
    layer_lines(axes[0, 2], absorbed[absorbed.tokens == "outliers"], "cls_attention_absorbed",
                title="CLS attention on the outliers")
    layer_lines(axes[0, 2], absorbed[absorbed.tokens == "uniform"], "cls_attention_absorbed", "--", band=False,
                label_suffix=" (uniform)")
    legend_outside(fig, extra=[style_handle("-o", "norm: median, band 1-99 %"), style_handle(":", "dotted: maximum"),
                               style_handle("--", "dashed: uniform attention's share"), band_handle()])
    k = df["k"].dropna()
    said = df["rule"].dropna() if "rule" in df.columns else pd.Series([], dtype=object)
    if len(said) and said.str.startswith("norm above").any():
        rule = "norm above the block's bimodal threshold"
    else:
        rule = f"norm > median + {float(k.iloc[0]):g}·1.4826·MAD of the image" if len(k) else "the stated rule"
    return [(f"High-norm tokens per block (outlier: {rule}) [{cite('darcet2024')}]", fig)]


def gradient_rollout(df: pd.DataFrame) -> Figures:
    """`attention_rollout`'s figures for the gradient-weighted relevance [Chefer et al. 2021]."""
    return [(title.replace("rollout", "gradient rollout", 1).replace(cite("abnar2020"), cite("chefer2021")), fig)
            for title, fig in attention_rollout(df)]


def head_ablation(df: pd.DataFrame) -> Figures:
    """Effect of ablating each head (or all heads of a block: column ``all``) on the model's output, block x
    head, one panel per model: KL to the clean prediction (with a head), else 1 - cosine of the pooled output
    [Michel et al. 2019]."""
    from vitscope.report.figures._common import colorbar, model_label

    out: Figures = []
    df = df.assign(head=df["head"].astype(float).fillna(-1))  # heads: all -> one column, -1
    modes = sorted(set(df["mode"].dropna())) if "mode" in df.columns else []
    how = {"zero": "zeroed", "mean": "mean-ablated"}
    done = " or ".join(how.get(m, m) for m in modes) or "zeroed"
    for metric, label in (("kl_from_clean", "KL(clean ‖ ablated), nats"), ("output_change", "1 - cos(clean, ablated)")):
        d = df[df.metric == metric]
        models = models_of(d)
        if not models:
            continue
        fig, axes = panels(1, len(models), panel=(2.6, 2.4))
        vmax = float(d["value"].max()) if d["value"].notna().any() else 1.0
        for ax, model in zip(axes[0], models, strict=True):
            g = d[d.model == model]
            arr = g.pivot_table(index="layer", columns="head", values="value", aggfunc="mean")
            im = ax.imshow(arr.to_numpy(dtype=float), aspect="auto", cmap="magma", vmin=0, vmax=vmax or 1.0,
                           interpolation="nearest")
            ax.set_yticks(range(len(arr.index)), [f"b{int(b)}" for b in arr.index], fontsize=6)
            ax.set_xticks(range(len(arr.columns)), [f"h{int(h)}" if h >= 0 else "all" for h in arr.columns],
                          fontsize=6)
            ax.set_title(model_label(model), fontsize=9)
        colorbar(fig, im, axes[0, -1], label)
        out.append((f"Attention heads {done} (each in turn; 'all': every head of the block): change of the "
                    f"model's output ({label}), block x head [{cite('michel2019')}]", fig))
    return out


FIGURES = {"attention_rollout": attention_rollout, "gradient_rollout": gradient_rollout, "logit_lens": logit_lens,
           "high_norm_tokens": high_norm_tokens, "head_ablation": head_ablation}
