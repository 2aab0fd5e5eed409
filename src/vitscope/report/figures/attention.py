"""Figures of the attention analyses (`vitscope.analyses.attention`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from vitscope.report.figures._common import Figures, plt

HEAD_TYPE_COLORS = {"strict_local": "#1b9e77", "soft_local": "#a6d854", "axial": "#7570b3",
                    "offset_local": "#e7298a", "global": "#d95f02", "mixed": "#bdbdbd"}
"""One colour per head type (`vitscope.analyses.attention.HEAD_TYPES`), shared by every figure."""

_ARROWS = {"right": "\u2192", "up-right": "\u2197", "up": "\u2191", "up-left": "\u2196", "left": "\u2190",
           "down-left": "\u2199", "down": "\u2193", "down-right": "\u2198", "horizontal": "\u2194",
           "vertical": "\u2195"}


def attention_distance(df: pd.DataFrame) -> Figures:
    """Distance per head (dots) and the per-layer mean (line), one colour per model [Walmer et al. 2023 Fig. 4]."""
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


def _models(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["model"]))


def attention_nmi(df: pd.DataFrame) -> Figures:
    """NMI(q, k) per head (dots) and its mean over heads per layer (line), one colour per model; low values
    mean attention collapse, every query attending alike [Park et al. 2023]."""
    d = df[df.metric == "nmi"]
    if d.empty:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, model in enumerate(_models(d)):
        g = d[d.model == model]
        jitter = (g["head"] / max(g["head"].max(), 1) - 0.5) * 0.3
        ax.scatter(g["layer"] + jitter, g["value"], s=9, alpha=0.5, color=f"C{k}")
        mean = g.groupby("layer")["value"].mean()
        ax.plot(mean.index, mean.values, "-o", ms=3, color=f"C{k}", label=model)
    ax.set_xlabel("block")
    ax.set_ylabel("NMI(query, key)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return [("Attention collapse: NMI between queries and keys per layer (mean over heads)", fig)]


def saliency_iou(df: pd.DataFrame) -> Figures:
    """IoU of the top-60%-mass attention tokens with the foreground per layer: best head (solid) and heads
    merged (dashed), one colour per model, one panel per query [Walmer et al. 2023 Fig. 7]."""
    d = df[df.metric.isin(["iou_best_head", "iou_merged"])]
    queries = [q for q in ("cls", "mean") if q in set(d["query"])]
    if not queries:
        return []
    fig, axes = plt.subplots(1, len(queries), figsize=(4.2 * len(queries), 3.6), squeeze=False, sharey=True)
    for ax, q in zip(axes[0], queries, strict=True):
        for k, model in enumerate(_models(d)):
            g = d[(d.model == model) & (d["query"] == q)]
            for metric, style in (("iou_best_head", "-o"), ("iou_merged", "--")):
                s = g[g.metric == metric].sort_values("layer")
                if len(s):
                    label = f"{model} ({'best head' if metric == 'iou_best_head' else 'heads merged'})"
                    ax.plot(s["layer"], s["value"], style, ms=3, color=f"C{k}", label=label)
        ax.set_title(f"query: {'CLS' if q == 'cls' else 'mean of spatial queries'}", fontsize=9)
        ax.set_xlabel("block")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("IoU with foreground")
    axes[0, 0].set_ylim(0, 1)
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    return [("Attention-saliency IoU per layer (best head, heads merged)", fig)]


def _grid_array(d: pd.DataFrame, a: str, b: str) -> tuple[np.ndarray, list[int], list[int], tuple[int, int]]:
    """(layers, heads, R, C) array from rows with layer, head, and cell coordinates in columns a, b."""
    layers = sorted(int(x) for x in d["layer"].unique())
    heads = sorted(int(x) for x in d["head"].unique())
    ra, rb = d[a].astype(int), d[b].astype(int)
    R, C = int(ra.max() - ra.min() + 1), int(rb.max() - rb.min() + 1)
    arr = np.full((len(layers), len(heads), R, C), np.nan)
    li = d["layer"].astype(int).map({v: i for i, v in enumerate(layers)}).to_numpy()
    hi = d["head"].astype(int).map({v: i for i, v in enumerate(heads)}).to_numpy()
    arr[li, hi, (ra - ra.min()).to_numpy(), (rb - rb.min()).to_numpy()] = d["value"].to_numpy(dtype=float)
    return arr, layers, heads, (R, C)


def _map_grid(arr: np.ndarray, layers: list[int], heads: list[int], cmap: str,
              labels: dict[tuple[int, int], str] | None = None) -> plt.Figure:
    """Small multiples: one row per layer, one column per head, each map on its own colour scale (divided by
    its own maximum), tiled into one image with a 1-cell gap, drawn with a single imshow (fast to render)."""
    L, H, R, C = arr.shape
    mx = np.nanmax(np.where(np.isfinite(arr), arr, np.nan), axis=(2, 3), keepdims=True)
    norm = arr / np.where(np.isfinite(mx) & (mx > 0), mx, 1.0)
    mosaic = np.full((L * (R + 1) - 1, H * (C + 1) - 1), np.nan)
    for i in range(L):
        for j in range(H):
            mosaic[i * (R + 1):i * (R + 1) + R, j * (C + 1):j * (C + 1) + C] = norm[i, j]
    cell = min(0.75, 8.0 / max(H, 1), 9.0 / max(L, 1))
    fig, ax = plt.subplots(figsize=(H * cell + 0.6, L * cell + 0.5))
    cm = plt.get_cmap(cmap).with_extremes(bad="white")
    ax.imshow(mosaic, cmap=cm, vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([j * (C + 1) + (C - 1) / 2 for j in range(H)], [f"h{h}" for h in heads], fontsize=6)
    ax.set_yticks([i * (R + 1) + (R - 1) / 2 for i in range(L)], [f"b{b}" for b in layers], fontsize=6)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    for (i, j), text in (labels or {}).items():
        ax.text(j * (C + 1), i * (R + 1), text, fontsize=4.5, va="top", ha="left", color="white",
                bbox={"facecolor": "black", "alpha": 0.4, "pad": 0.3, "linewidth": 0})
    fig.tight_layout(pad=0.3)
    return fig


def cls_attention_maps(df: pd.DataFrame) -> Figures:
    """Average CLS attention map of every layer (rows) and head (columns), one figure per model, each map on
    its own colour scale [Walmer et al. 2023 Fig. 11-13]."""
    d = df[(df.metric == "cls_attention") & df["image"].isna()] if "image" in df.columns else df.iloc[0:0]
    out: Figures = []
    for model in _models(d):
        arr, layers, heads, _ = _grid_array(d[d.model == model], "row", "col")
        out.append((f"Average CLS attention maps, {model} (rows: blocks, columns: heads)",
                    _map_grid(arr, layers, heads, "viridis")))
    return out


def _type_label(row: pd.Series) -> str:
    short = {"strict_local": "SL", "soft_local": "so", "axial": "ax", "offset_local": "of", "global": "G",
             "mixed": "mx"}.get(row["type"], "?")
    direction = row.get("direction")
    return short + (_ARROWS.get(direction, "") if isinstance(direction, str) else "")


def aligned_attention_maps(df: pd.DataFrame) -> Figures:
    """Per model: the AAAM of every layer and head (query at the centre of each map, type in the corner)
    [Walmer et al. 2023 Fig. 5], then one map of the automatic head types (layers x heads, one colour per type;
    arrows give the direction of offset and axial heads), all models side by side."""
    out: Figures = []
    aaam = df[df.metric == "aaam"]
    types = df[df.metric == "head_type"]
    for model in _models(aaam):
        arr, layers, heads, _ = _grid_array(aaam[aaam.model == model], "dy", "dx")
        t = types[types.model == model]
        labels = {(layers.index(int(r["layer"])), heads.index(int(r["head"]))): _type_label(r)
                  for _, r in t.iterrows() if int(r["layer"]) in layers and int(r["head"]) in heads}
        out.append((f"Aligned aggregated attention maps, {model} (rows: blocks, columns: heads)",
                    _map_grid(arr, layers, heads, "magma", labels)))
    if types.empty:
        return out
    names = list(HEAD_TYPE_COLORS)
    cmap = ListedColormap([HEAD_TYPE_COLORS[n] for n in names])
    models = _models(types)
    fig, axes = plt.subplots(1, len(models), figsize=(min(3.0 * len(models), 12) + 1.6, 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        t = types[types.model == model]
        layers = sorted(int(x) for x in t["layer"].unique())
        heads = sorted(int(x) for x in t["head"].unique())
        codes = np.full((len(layers), len(heads)), np.nan)
        for _, r in t.iterrows():
            i, j = layers.index(int(r["layer"])), heads.index(int(r["head"]))
            codes[i, j] = names.index(r["type"]) if r["type"] in names else np.nan
            arrow = _ARROWS.get(r["direction"], "") if isinstance(r["direction"], str) else ""
            if arrow:
                ax.text(j, i, arrow, ha="center", va="center", fontsize=7, color="white")
        ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(names) - 0.5, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(heads)), [str(h) for h in heads], fontsize=6)
        ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=6)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("block", fontsize=8)
        ax.set_title(model, fontsize=9)
    fig.legend(handles=[Patch(color=HEAD_TYPE_COLORS[n], label=n.replace("_", " ")) for n in names],
               loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.5 / fig.get_figwidth(), 1))
    out.append(("Head types from the AAAM (strict local, soft local, axial, offset local, global, mixed)", fig))
    return out


FIGURES = {
    "attention_distance": attention_distance,
    "attention_nmi": attention_nmi,
    "saliency_iou": saliency_iou,
    "cls_attention_maps": cls_attention_maps,
    "aligned_attention_maps": aligned_attention_maps,
}
