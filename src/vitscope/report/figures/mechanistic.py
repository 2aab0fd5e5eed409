"""Figures of the mechanistic lens (`vitscope.analyses.mechanistic`): rollout, logit lens, high-norm tokens,
head ablation, block updates, head agreement."""

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


#: block_updates' curve panels per token view: (metric, panel title)
_UPDATE_PANELS = (("attn_update", "attention update ‖attn_out‖ / ‖x_in‖"),
                  ("mlp_update", "MLP update ‖mlp_out‖ / ‖resid_mid‖"),
                  ("displacement", "displacement ‖out − x_in‖ / ‖x_in‖"),
                  ("unison_cosine", "unison: mean cos between tokens' moves"))


def _update_curves(df: pd.DataFrame, view: str) -> plt.Figure:
    """One panel per statistic of `_UPDATE_PANELS` the view has, models as lines with their 95 % bands."""
    d = df[df.token_view == view]
    shown = [(m, t) for m, t in _UPDATE_PANELS if (d.metric == m).any()]
    fig, axes = panels(1, len(shown), panel=(3.1, 2.7))
    for ax, (metric, title) in zip(axes[0], shown, strict=True):
        layer_lines(ax, d, metric, title=title)
        if metric == "unison_cosine":
            ax.axhline(0, color="0.3", lw=0.8)
    legend_outside(fig, extra=[band_handle()])
    return fig


def _token_picture(d: pd.DataFrame) -> plt.Figure:
    """One panel per (model, kept image) row and picture block column: every token as an arrow from before the
    block (hollow dot) to after it (filled dot), in the plane of the block input's two principal axes (the CLS
    token in black)."""
    from vitscope.report.figures._common import model_label

    models = models_of(d)
    rows = [(m, i) for m in models for i in sorted(d[d.model == m]["image"].dropna().unique())]
    layers = sorted(int(x) for x in d["layer"].unique())
    fig, axes = panels(len(rows), len(layers), panel=(1.9, 1.8))
    for r, (model, image) in enumerate(rows):
        for c, layer in enumerate(layers):
            ax = axes[r, c]
            g = d[(d.model == model) & (d["image"] == image) & (d["layer"] == layer)]
            ax.set_xticks([])
            ax.set_yticks([])
            for view, color in (("spatial", model_color(model, models)), ("cls", "black")):
                t = g[g.token_view == view]
                if t.empty:
                    continue
                x0, y0 = t["x_before"].to_numpy(float), t["y_before"].to_numpy(float)
                x1, y1 = t["x_after"].to_numpy(float), t["y_after"].to_numpy(float)
                ax.scatter(x0, y0, s=7, facecolors="none", edgecolors=color, linewidths=0.5)  # before: hollow
                ax.scatter(x1, y1, s=5, color=color, linewidths=0)  # after: filled
                ax.quiver(x0, y0, x1 - x0, y1 - y0, angles="xy", scale_units="xy", scale=1, color=color,
                          width=0.006, alpha=0.8)
            ax.set_aspect("equal", adjustable="datalim")  # both axes in the same units: distances read true
            share = g["pca_variance"].dropna()
            note = f" ({float(share.iloc[0]):.0%} var.)" if len(share) else ""
            ax.set_title(f"b{layer}{note}", fontsize=7)
            if c == 0:
                ax.set_ylabel(f"{model_label(model)}\nimage {int(image)}", fontsize=6)
    return fig


def block_updates(df: pd.DataFrame) -> Figures:
    """Per block, the attention and MLP updates relative to the residual stream, the displacement and how much
    the patch tokens move in unison, per token view with 95 % bands; then the token picture: arrows from before
    to after each chosen block, one panel per (model, image) and block [Park et al. 2023; Wang, Fig. 13]."""
    out: Figures = []
    src = f"[{cite('park2023')}; {cite('wang_clmm', 'Fig. 13')}]"
    for view in ("spatial", "cls"):
        if (df[df.metric.isin([m for m, _ in _UPDATE_PANELS])].token_view == view).any():
            what = "patch tokens, a mean per image" if view == "spatial" else "the CLS token"
            out.append((f"How much each block changes the residual stream ({what}): each branch's update relative "
                        "to the stream it is added to, the block's displacement and (patch tokens) the mean cosine "
                        f"between different tokens' moves (1: every token moved alike) {src}",
                        _update_curves(df, view)))
    pic = df[df.metric == "token_position"]
    if not pic.empty:
        out.append(("Tokens before and after a block: each arrow one token of one image, in the plane of the block "
                    "input's two principal axes (fitted on its patch tokens, applied to the output too; share of "
                    "the input's variance in the title), hollow before, filled after; black: the CLS token. "
                    f"Arrows alike: tokens moved in unison {src}", _token_picture(pic)))
    return out


def head_agreement(df: pd.DataFrame) -> Figures:
    """Bars per model pair: Kendall's tau of the two heads' top-k class rankings per k, top-1 F1 and top-1
    agreement, each with its 95 % interval as an error bar [Shekhar et al. 2022, Fig. 4]."""
    from vitscope.report.figures._common import model_label

    d = df[df.metric.isin(["kendall_tau", "top1_f1", "top1_agreement"])]
    if d.empty:
        return []
    pairs = list(dict.fromkeys(zip(d["model"], d["model_b"], strict=True)))
    ks = sorted(int(k) for k in d.loc[d.metric == "kendall_tau", "k"].dropna().unique())
    groups = [("kendall_tau", k, f"\u03c4 top-{k}") for k in ks] + [("top1_f1", None, "top-1 F1"),
                                                                     ("top1_agreement", None, "top-1 agreement")]
    fig, axes = panels(1, 1, panel=(max(3.6, 0.9 * len(groups) * max(len(pairs), 1) ** 0.5 + 1.5), 2.8))
    ax = axes[0, 0]
    width = 0.8 / len(pairs)
    for p, (a, b) in enumerate(pairs):
        xs, ys, lo, hi = [], [], [], []
        for x, (metric, k, _) in enumerate(groups):
            r = d[(d.metric == metric) & (d.model == a) & (d.model_b == b)]
            if k is not None:
                r = r[r["k"].astype(float) == k]
            if r.empty:
                continue
            v = float(r["value"].iloc[0])
            xs.append(x - 0.4 + width * (p + 0.5))
            ys.append(v)
            lo.append(v - float(r["value_lo"].iloc[0]) if pd.notna(r["value_lo"].iloc[0]) else 0.0)
            hi.append(float(r["value_hi"].iloc[0]) - v if pd.notna(r["value_hi"].iloc[0]) else 0.0)
        ax.bar(xs, ys, width=width * 0.95, color=f"C{p % 10}", yerr=[lo, hi], capsize=2, ecolor="0.25",
               label=f"{model_label(a)} \u2194 {model_label(b)}")
    ax.set_xticks(range(len(groups)), [g[2] for g in groups], fontsize=7)
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_ylim(min(0.0, float(np.nanmin(d["value"].astype(float))) - 0.05), 1.05)
    ax.set_ylabel("agreement of the two heads", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    legend_outside(fig)
    return [("Agreement of two models' own classifier heads on the same images: Kendall's tau of their top-k class "
             "rankings (each model's top-k, averaged), the macro F1 of one's top-1 against the other's and the share "
             "of images with the same top-1; error bars: 95 % intervals over the images "
             f"[{cite('shekhar2022', 'Fig. 4')}]", fig)]


FIGURES = {"attention_rollout": attention_rollout, "gradient_rollout": gradient_rollout, "logit_lens": logit_lens,
           "high_norm_tokens": high_norm_tokens, "head_ablation": head_ablation, "block_updates": block_updates,
           "head_agreement": head_agreement}
