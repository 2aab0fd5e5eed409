"""Figures of the attention analyses (`vitscope.analyses.attention`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.patches import Patch

from vitscope.references import cite
from vitscope.report.figures._common import (
    UNIFORM_COLOR,
    UNIFORM_GID,
    Z95,
    Figures,
    band_handle,
    colorbar,
    current,
    has_interval,
    legend_outside,
    model_color,
    model_label,
    models_of,
    panels,
    plt,
    style_handle,
    uniform_line,
)

HEAD_TYPE_COLORS = {"strict_local": "#1b9e77", "soft_local": "#a6d854", "axial": "#7570b3",
                    "offset_local": "#e7298a", "global": "#d95f02", "mixed": "#bdbdbd"}
"""One colour per head type (`vitscope.analyses.attention.HEAD_TYPES`), shared by every figure."""

_ARROWS = {"right": "\u2192", "up-right": "\u2197", "up": "\u2191", "up-left": "\u2196", "left": "\u2190",
           "down-left": "\u2199", "down": "\u2193", "down-right": "\u2198", "horizontal": "\u2194",
           "vertical": "\u2195"}


def _heads_and_mean(ax: plt.Axes, d: pd.DataFrame) -> list[str]:
    """Each head's value (dots, jittered within its block) and the per-layer mean over heads (line) with its
    95 % band (the heads' mean stderr: an upper bound), one colour per model."""
    models = models_of(d)
    for model in models:
        g = d[d.model == model]
        color = model_color(model, models)
        jitter = (g["head"] / max(g["head"].max(), 1) - 0.5) * 0.3
        ax.scatter(g["layer"] + jitter, g["value"], s=9, alpha=0.5, color=color, lw=0)
        mean = g.groupby("layer")["value"].mean()
        ax.plot(mean.index, mean.values, "-o", ms=3, color=color, label=model_label(model))
        if "stderr" in g.columns and g["stderr"].notna().any():
            se = g.groupby("layer")["stderr"].mean()
            ax.fill_between(mean.index.astype(float), mean - Z95 * se, mean + Z95 * se, color=color, alpha=0.15,
                            lw=0)
    ax.set_xlabel("block")
    ax.grid(alpha=0.3)
    return models


def attention_distance(df: pd.DataFrame) -> Figures:
    """Distance per head (dots) and the per-layer mean (line, 95 % band), one colour per model [Walmer et al.
    2023 Fig. 4]."""
    d = df[df.metric == "distance_px"]
    if d.empty:
        return []
    fig, axes = panels(1, 1, panel=(5.0, 3.4))
    _heads_and_mean(axes[0, 0], d)
    axes[0, 0].set_ylabel("mean attention distance (px)")
    uniform = df[df.metric == "distance_px_uniform"]
    uniform_line(axes[0, 0], uniform, _models(d))
    extra = [style_handle("o", "dot: one head", alpha=0.6), *([band_handle()] if has_interval(d) else []),
             *([style_handle("--", "black dashed: uniform attention", color=UNIFORM_COLOR, lw=1.4)]
               if len(uniform) else [])]
    legend_outside(fig, extra=extra)
    ref = ("; black dashed: uniform attention on the same grid (no preference for near or far keys)" if len(uniform)
           else "; no uniform-attention reference in this table (rerun attention_distance)")
    return [(f"Attention distance per head and layer [{cite('walmer2023', 'Fig. 4')}; {cite('park2023')}]{ref}",
             fig)]


def _models(df: pd.DataFrame) -> list[str]:
    return models_of(df)


def attention_nmi(df: pd.DataFrame) -> Figures:
    """NMI(q, k) per head (dots) and its mean over heads per layer (line, 95 % band), one colour per model;
    low values mean attention collapse, every query attending alike [Park et al. 2023]."""
    d = df[df.metric == "nmi"]
    if d.empty:
        return []
    fig, axes = panels(1, 1, panel=(5.0, 3.4))
    ax = axes[0, 0]
    _heads_and_mean(ax, d)
    ax.set_ylabel("NMI(query, key)")
    ax.set_ylim(bottom=-0.02)
    # uniform attention: every query's distribution over keys is the same, so the mutual information is 0
    uniform_line(ax, pd.DataFrame({"model": _models(d)[:1], "value": [0.0]}), _models(d)[:1])
    extra = [style_handle("o", "dot: one head", alpha=0.6), *([band_handle()] if has_interval(d) else []),
             style_handle("--", "black dashed: uniform attention", color=UNIFORM_COLOR, lw=1.4)]
    legend_outside(fig, extra=extra)
    return [("Attention collapse: NMI between queries and keys per layer (mean over heads); black dashed: uniform "
             f"attention, 0 (every query attends alike) [{cite('park2023')}]", fig)]


def saliency_iou(df: pd.DataFrame) -> Figures:
    """IoU of the top-60%-mass attention tokens with the foreground per layer: best head (solid) and heads
    merged (dashed), one colour per model, one panel per query, 95 % bands [Walmer et al. 2023 Fig. 7]."""
    d = df[df.metric.isin(["iou_best_head", "iou_merged"])]
    uniform = df[df.metric == "iou_uniform"]
    queries = [q for q in ("cls", "mean") if q in set(d["query"])]
    if not queries:
        return []
    fig, axes = panels(1, len(queries), panel=(3.6, 3.0), sharey=True)
    models = _models(d)
    for ax, q in zip(axes[0], queries, strict=True):
        for model in models:
            g = d[(d.model == model) & (d["query"] == q)]
            color = model_color(model, models)
            for metric, style in (("iou_best_head", "-o"), ("iou_merged", "--")):
                s = g[g.metric == metric].sort_values("layer")
                if len(s):
                    ax.plot(s["layer"], s["value"], style, ms=3, color=color,
                            label=model_label(model) if metric == "iou_best_head" else "_")
                    if "value_lo" in s.columns and s["value_lo"].notna().any():
                        ax.fill_between(s["layer"].astype(float), s["value_lo"].astype(float),
                                        s["value_hi"].astype(float), color=color, alpha=0.12, lw=0)
        uniform_line(ax, uniform[uniform["query"] == q], models)
        ax.set_title(f"query: {'CLS' if q == 'cls' else 'mean of spatial queries'}", fontsize=9)
        ax.set_xlabel("block")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("IoU with foreground")
    axes[0, 0].set_ylim(0, 1)
    extra = [style_handle("-o", "solid: best head"), style_handle("--", "dashed: heads merged"),
             *([band_handle()] if has_interval(d) else []),
             *([style_handle("--", "black dashed: uniform attention", color=UNIFORM_COLOR, lw=1.4)]
               if len(uniform) else [])]
    legend_outside(fig, extra=extra)
    level = pd.to_numeric(uniform["value"], errors="coerce").dropna()
    ref = (f"; black dashed: the IoU uniform attention gets on the same masks ({level.min():.3g}"
           + (f"-{level.max():.3g}" if level.max() - level.min() > 5e-4 else "") + "), the level of a map with no "
           "spatial preference: a curve near it finds no foreground" if len(level) else
           "; the uniform-attention reference needs the table's iou_uniform rows (rerun saliency_iou)")
    return [(f"Attention-saliency IoU per layer (best head, heads merged){ref} "
             f"[{cite('walmer2023', 'Fig. 7')}]", fig)]


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


def uniform_norm(ratios: object, floor: float = 2.0, q: float = 99.5) -> LogNorm:
    """One colour scale for attention in units of uniform attention's (1 = uniform): logarithmic and symmetric
    about 1, so uniform attention is the middle of the colour map in every map drawn with it; its top the ``q``-th
    percentile of the cells of ``ratios`` (one array or several) above uniform, at least ``floor`` (so that a
    near-uniform map stays one colour instead of being stretched until it looks structured, what scaling each map
    to its own maximum did), its bottom 1 / top. Values beyond are clipped (`in_norm`): far below uniform (a
    corner of an aligned map, a few keys no query looks at) all read "much less than uniform"."""
    parts = ratios if isinstance(ratios, (list, tuple)) else [ratios]
    r = np.concatenate([np.asarray(a, dtype=float).ravel() for a in parts]) if parts else np.zeros(0)
    r = r[np.isfinite(r) & (r > 1)]
    half = float(np.percentile(np.log10(r), q)) if r.size else 0.0
    top = 10 ** max(half, float(np.log10(floor)))
    return LogNorm(vmin=1 / top, vmax=top, clip=True)


def in_norm(ratios: np.ndarray, norm: LogNorm) -> np.ndarray:
    """``ratios`` clipped into the norm's range (zeros to its low end; NaN stays NaN: a gap)."""
    return np.where(np.isfinite(ratios), np.clip(ratios, norm.vmin, norm.vmax), np.nan)


def uniform_colorbar(fig: plt.Figure, mappable: object, ax: plt.Axes, what: str, short: bool = False,
                     **kw: object) -> object:
    """The colour bar of maps drawn with `uniform_norm`: ticks at its ends and at 1, the uniform level marked.
    ``short``: a one-line label, for a bar beside a row or two of maps (the caption says the rest)."""
    label = f"{what} ÷ uniform" if short else f"{what} ÷ uniform attention's\n(log; 1 = uniform)"
    cb = colorbar(fig, mappable, ax, label, extend="both", **kw)
    lo, hi = mappable.norm.vmin, mappable.norm.vmax  # type: ignore[attr-defined]
    cb.set_ticks([lo, 1.0, hi], labels=[f"{lo:.2g}", "1 uniform", f"{hi:.3g}"])
    cb.minorticks_off()
    cb.ax.axhline(1.0, color="white", lw=1.2, gid=UNIFORM_GID)
    return cb


def cls_uniform(arr: np.ndarray) -> np.ndarray:
    """Uniform attention's value in each cell of a CLS map of ``arr``'s grid (``(..., R, C)``): 1 / (R C)."""
    R, C = arr.shape[-2:]
    return np.full((R, C), 1.0 / (R * C))


def aaam_uniform(arr: np.ndarray) -> np.ndarray:
    """Uniform attention's AAAM on ``arr``'s canvas (``(..., 2h - 1, 2w - 1)``): ``(h - |dy|)(w - |dx|) / (h w)²``
    (`vitscope.metrics.attention.uniform_mass_3x3`'s pyramid), so that a map ÷ it reads 1 for uniform attention."""
    R, C = arr.shape[-2:]
    h, w = (R + 1) // 2, (C + 1) // 2
    dy, dx = np.abs(np.arange(R) - (h - 1)), np.abs(np.arange(C) - (w - 1))
    return np.outer(h - dy, w - dx) / float(h * w) ** 2


def _map_grid(arr: np.ndarray, layers: list[int], heads: list[int], cmap: str,
              labels: dict[tuple[int, int], str] | None = None, norm: LogNorm | None = None,
              what: str = "attention") -> plt.Figure:
    """Small multiples: one row per layer, one column per head, tiled into one image with a 1-cell gap, drawn with
    a single imshow (fast to render): ``arr`` in units of uniform attention's, every map on one colour scale
    (``norm``, `uniform_norm`; default: this figure's), so uniform attention is the same colour everywhere."""
    L, H, R, C = arr.shape
    norm = norm if norm is not None else uniform_norm(arr)
    scaled = in_norm(arr, norm)
    mosaic = np.full((L * (R + 1) - 1, H * (C + 1) - 1), np.nan)
    for i in range(L):
        for j in range(H):
            mosaic[i * (R + 1):i * (R + 1) + R, j * (C + 1):j * (C + 1) + C] = scaled[i, j]
    cell = min(0.75, 8.0 / max(H, 1), 9.0 / max(L, 1))
    fig, ax = plt.subplots(figsize=(H * cell + 1.4, L * cell + 0.5), layout="constrained")
    cm = plt.get_cmap(cmap).with_extremes(bad="white")
    im = ax.imshow(mosaic, cmap=cm, norm=norm, interpolation="nearest")
    ax.set_xticks([j * (C + 1) + (C - 1) / 2 for j in range(H)], [f"h{h}" for h in heads], fontsize=6)
    ax.set_yticks([i * (R + 1) + (R - 1) / 2 for i in range(L)], [f"b{b}" for b in layers], fontsize=6)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    for (i, j), text in (labels or {}).items():
        ax.text(j * (C + 1), i * (R + 1), text, fontsize=4.5, va="top", ha="left", color="white",
                bbox={"facecolor": "black", "alpha": 0.4, "pad": 0.3, "linewidth": 0})
    uniform_colorbar(fig, im, ax, what, shrink=min(1.0, 3.0 / max(L * cell, 1e-6)))
    return fig


def cls_attention_maps(df: pd.DataFrame) -> Figures:
    """Average CLS attention map of every layer (rows) and head (columns), one figure per model, every map of every
    model on one colour scale in units of uniform attention's (`uniform_norm`) [Walmer et al. 2023 Fig. 11-13];
    then, for each image the analysis kept, the image with the CLS map over it per layer (mean over heads, and the
    best saliency head when `saliency_iou` ran)."""
    d = df[(df.metric == "cls_attention") & df["image"].isna()] if "image" in df.columns else df.iloc[0:0]
    out: Figures = []
    grids = {m: _grid_array(d[d.model == m], "row", "col") for m in _models(d)}
    ratios = {m: g[0] / cls_uniform(g[0]) for m, g in grids.items()}
    norm = uniform_norm(list(ratios.values())) if ratios else None
    for model, (_, layers, heads, _) in grids.items():
        out.append((f"Average CLS attention maps, {model} (rows: blocks, columns: heads), in units of uniform "
                    "attention's (1 = uniform, the colour bar's middle; one scale for every model's maps) "
                    f"[{cite('walmer2023', 'Fig. 11-13')}]",
                    _map_grid(ratios[model], layers, heads, "viridis", norm=norm, what="CLS attention")))
    out += overlays(df)
    return out


def _decode_png(data: bytes) -> np.ndarray:
    """PNG bytes -> (H, W, 3) uint8."""
    import io

    from PIL import Image

    return np.array(Image.open(io.BytesIO(data)).convert("RGB"))


def _best_saliency_heads() -> dict[tuple[str, int], int]:
    """(model, layer) -> the head whose CLS attention best matches the foreground (`saliency_iou`, CLS query),
    from the report's other tables; empty when that analysis did not run."""
    sal = current().tables.get("saliency_iou")
    if sal is None or sal.empty or "query" not in sal.columns:
        return {}
    best = sal[(sal.metric == "iou_best_head") & (sal["query"] == "cls") & sal["head"].notna()]
    return {(str(r.model), int(r.layer)): int(r.head) for r in best.itertuples()}


def _fit(pix: np.ndarray, side: int) -> np.ndarray:
    """An (H, W, 3) uint8 image resized (bilinear) to ``side`` x ``side``, as floats in [0, 1]."""
    from PIL import Image

    if pix.shape[0] != side or pix.shape[1] != side:
        pix = np.asarray(Image.fromarray(pix).resize((side, side), Image.BILINEAR))
    return pix.astype(np.float64) / 255.0


def _upsample(grid: np.ndarray, side: int) -> np.ndarray:
    """A token grid (R, C) bilinearly upsampled to ``side`` x ``side`` pixels (cell centres aligned, edges held)."""
    from scipy.ndimage import zoom

    g = np.nan_to_num(np.asarray(grid, dtype=np.float64), nan=0.0)
    return zoom(g, (side / g.shape[0], side / g.shape[1]), order=1, mode="nearest", grid_mode=True)


def overlays(df: pd.DataFrame, max_images: int = 4) -> Figures:
    """Per-image attention overlays [Walmer et al. 2023 Fig. 11-13]: for each of the first ``max_images``
    images the analysis kept, a row per model with the image as that model saw it, then its CLS attention
    over the image at every block (mean over heads); under it, when `saliency_iou` ran, the CLS map of the
    block's best saliency head (its id in the corner). Every map of a figure on one colour scale in units of
    uniform attention's (`uniform_norm`: 1 = uniform, the colour map's middle), so a near-uniform map is one flat
    colour.

    The cells are composed into one RGB mosaic drawn with a single imshow (a figure of 16 x 9 axes took
    seconds to lay out and render; the mosaic takes a fraction of one), with the colour scale beside it."""
    if "png" not in df.columns or "image" not in df.columns:
        return []
    images = df[(df.metric == "input_image") & df["png"].notna()]
    maps = df[(df.metric == "cls_attention") & df["image"].notna()]
    if images.empty or maps.empty:
        return []
    best = _best_saliency_heads()
    layers = sorted(int(x) for x in maps["layer"].unique())
    cmap = plt.get_cmap("inferno")
    alpha, gap = 0.6, 0.08  # the map's opacity over the image; white gap between cells, in cells
    out: Figures = []
    for image_id in sorted(int(x) for x in images["image"].unique())[:max_images]:
        models = models_of(images[images.image == image_id])
        rows = [(m, kind) for m in models for kind in ("mean", "best")
                if kind == "mean" or any((m, layer) in best for layer in layers)]
        pixels = {m: _decode_png(images[(images.model == m) & (images.image == image_id)]["png"].iloc[0])
                  for m in models}
        side = int(min(max(p.shape[0] for p in pixels.values()), 112))
        step = side + max(1, round(gap * side))
        mosaic = np.ones((len(rows) * step - (step - side), (len(layers) + 1) * step - (step - side), 3))
        g_all = maps[maps.image == image_id]
        notes: list[tuple[int, int, str, str]] = []  # (row, column, text, colour)
        cells: dict[tuple[int, int], np.ndarray | None] = {}  # (row, column) -> the map ÷ uniform attention's
        for r, (model, kind) in enumerate(rows):
            g = g_all[g_all.model == model]
            arr, g_layers, g_heads, _ = _grid_array(g, "row", "col") if len(g) else (None, [], [], None)
            for c, layer in enumerate(layers, start=1):
                grid = None
                if layer in g_layers:
                    per_head = arr[g_layers.index(layer)]  # (heads, R, C)
                    if kind == "mean":  # the mean over the heads that have the cell
                        grid = np.nansum(per_head, 0) / np.maximum(np.isfinite(per_head).sum(0), 1)
                    elif (head := best.get((model, layer))) is not None:
                        notes.append((r, c, f"h{head}", "white"))
                        grid = per_head[g_heads.index(head)] if head in g_heads else None
                cells[(r, c)] = None if grid is None else grid / cls_uniform(grid)
        norm = uniform_norm([v for v in cells.values() if v is not None])
        for r, (model, _) in enumerate(rows):
            pix = _fit(pixels[model], side)
            pale = 0.55 * pix + 0.45 * pix.mean(-1, keepdims=True)  # colours under the map
            y = r * step
            mosaic[y:y + side, 0:side] = pix
            for c, _ in enumerate(layers, start=1):
                x, grid = c * step, cells.get((r, c))
                if grid is not None:
                    heat = cmap(norm(in_norm(_upsample(grid, side), norm)))[..., :3]
                    mosaic[y:y + side, x:x + side] = (1 - alpha) * pale + alpha * heat
                else:
                    mosaic[y:y + side, x:x + side] = 0.92
                    notes.append((r, c, "no map", "0.3"))
        cell = 0.9
        fig, ax = plt.subplots(figsize=(cell * (len(layers) + 1) + 2.4, cell * len(rows) + 0.7), layout="constrained")
        # aspect 'auto' (the figure's size keeps the cells near square): constrained layout reserves the row labels'
        # margin around the axes' box, and a mosaic that kept its aspect inside the box would slide past it
        ax.imshow(mosaic, interpolation="nearest", aspect="auto")
        for r, c, text, colour in notes:
            ax.text(c * step + 0.04 * side, r * step + 0.04 * side, text, fontsize=5, va="top", ha="left",
                    color=colour)
        ax.set_xticks([c * step + (side - 1) / 2 for c in range(len(layers) + 1)],
                      [f"image {image_id}", *(f"block {layer}" for layer in layers)], fontsize=7)
        ax.xaxis.set_ticks_position("top")
        kinds = {"mean": "CLS, mean of heads", "best": "best saliency head"}
        labels = [f"{model_label(m, lines=True)}\n{kinds[k]}" for m, k in rows]
        ax.set_yticks([r * step + (side - 1) / 2 for r in range(len(rows))], labels, fontsize=6)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        mappable = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
        uniform_colorbar(fig, mappable, ax, "CLS attention", shrink=0.6)
        source = "; best saliency head: the block's head with the best IoU with the foreground (saliency_iou)" \
            if best else "; the best saliency head needs the saliency_iou analysis"
        out.append((f"Image {image_id} as each model saw it, with its CLS attention over it at every block (mean of "
                    f"heads{source}), every map on one scale in units of uniform attention's (1 = uniform, the colour "
                    f"bar's middle) [{cite('walmer2023', 'Fig. 11-13')}]", fig))
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
    grids = {m: _grid_array(aaam[aaam.model == m], "dy", "dx") for m in _models(aaam)}
    ratios = {m: g[0] / aaam_uniform(g[0]) for m, g in grids.items()}
    norm = uniform_norm(list(ratios.values())) if ratios else None
    for model, (_, layers, heads, _) in grids.items():
        t = types[types.model == model]
        labels = {(layers.index(int(r["layer"])), heads.index(int(r["head"]))): _type_label(r)
                  for _, r in t.iterrows() if int(r["layer"]) in layers and int(r["head"]) in heads}
        out.append((f"Aligned aggregated attention maps, {model} (rows: blocks, columns: heads; the query at the "
                    "centre of each map, its head type in the corner), each cell ÷ uniform attention's AAAM there "
                    "(a centred pyramid), so uniform attention reads 1 everywhere (the colour bar's middle; one "
                    "scale for every model's maps): local heads stand out by a bright centre "
                    f"[{cite('walmer2023', 'Fig. 5')}]",
                    _map_grid(ratios[model], layers, heads, "magma", labels, norm=norm, what="AAAM")))
    if types.empty:
        return out
    names = list(HEAD_TYPE_COLORS)
    cmap = ListedColormap([HEAD_TYPE_COLORS[n] for n in names])
    models = _models(types)
    fig, axes = panels(1, len(models), panel=(min(3.0, 12 / len(models)), 3.4))
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
        ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(names) - 0.5, aspect="auto", interpolation="nearest",
                  gid="categorical")
        ax.set_xticks(range(len(heads)), [str(h) for h in heads], fontsize=6)
        ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=6)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("block", fontsize=8)
        n_local = int(t["type"].isin(["strict_local", "soft_local", "axial", "offset_local"]).sum())
        ax.set_title(f"{model_label(model, lines=True)}\n{n_local} of {len(t)} heads local", fontsize=8)
    legend_outside(fig, handles=[Patch(color=HEAD_TYPE_COLORS[n], label=n.replace("_", " ")) for n in names],
                   title="head type")
    out.append(("Head types from the AAAM (strict local, soft local, axial, offset local, global, mixed; rules in "
                "vitscope.metrics.attention.head_types, scaled to each grid by comparing with uniform attention) "
                f"[{cite('walmer2023', '§4.2')}]", fig))
    return out



def _spread(values: list[int], n: int) -> list[int]:
    """At most ``n`` of ``values`` (sorted), evenly spaced, the first and the last among them."""
    if len(values) <= n:
        return values
    return list(dict.fromkeys(values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)))


def query_attention_maps(df: pd.DataFrame, max_images: int = 4, max_blocks: int = 8) -> Figures:
    """Attention of chosen query tokens over a few images [Park et al. 2023, slides p. 4; Wang, Fig. 9]: one
    figure per kept image (the first ``max_images``), whatever the number of models, as one mosaic: a row per
    (model, query), models one under the other, with the image as that model saw it and then, at each block (at
    most ``max_blocks``, evenly spaced), the query's attention (mean of heads) over the image; a dot marks the
    query patch (the CLS query has none). Every map of a figure on one colour scale in units of uniform attention's
    (`uniform_norm`: 1 = uniform), so a collapsed model shows the same map in each of its query rows and a local
    one a spot at each dot."""
    if "png" not in df.columns or "query" not in df.columns or "image" not in df.columns:
        return []
    images = df[(df.metric == "input_image") & df["png"].notna()]
    maps = df[(df.metric == "query_attention_mean") & df["image"].notna()]
    if images.empty or maps.empty:
        return []
    layers = _spread(sorted(int(x) for x in maps["layer"].unique()), max_blocks)
    queries = list(dict.fromkeys(str(q) for q in maps["query"]))
    cmap = plt.get_cmap("inferno")
    alpha, gap = 0.6, 0.08  # the map's opacity over the image; white gap between cells, in cells
    out: Figures = []
    for image_id in sorted(int(x) for x in images["image"].unique())[:max_images]:
        models = models_of(images[images.image == image_id])
        rows = [(m, q) for m in models for q in queries]
        pixels = {m: _decode_png(images[(images.model == m) & (images.image == image_id)]["png"].iloc[0])
                  for m in models}
        side = int(min(max(p.shape[0] for p in pixels.values()), 112))
        step = side + max(1, round(gap * side))
        g_all = maps[maps.image == image_id]
        cells: dict[tuple[int, int], np.ndarray] = {}  # (row, column) -> the map ÷ uniform attention's
        dots: list[tuple[float, float]] = []  # (x, y) in the mosaic's pixels
        for r, (model, query) in enumerate(rows):
            g = g_all[(g_all.model == model) & (g_all["query"] == query)]
            if g.empty:
                continue
            arr, g_layers, _, (R, C) = _grid_array(g.assign(head=0), "row", "col")  # the mean: one "head"
            qr, qc = g["query_row"].iloc[0], g["query_col"].iloc[0]
            for c, layer in enumerate(layers):
                if layer in g_layers:
                    grid = arr[g_layers.index(layer), 0]
                    cells[(r, c + 1)] = grid / cls_uniform(grid)
            if not (pd.isna(qr) or pd.isna(qc)):
                y, x = (int(qr) + 0.5) * side / R, (int(qc) + 0.5) * side / C
                dots += [(c * step + x, r * step + y) for c in range(len(layers) + 1)]
        norm = uniform_norm(list(cells.values()))
        mosaic = np.ones((len(rows) * step - (step - side), (len(layers) + 1) * step - (step - side), 3))
        notes: list[tuple[int, int, str]] = []
        for r, (model, query) in enumerate(rows):
            pix = _fit(pixels[model], side)
            pale = 0.55 * pix + 0.45 * pix.mean(-1, keepdims=True)  # colours under the map
            y = r * step
            mosaic[y:y + side, 0:side] = pix
            if query == "cls":
                notes.append((r, 0, "CLS"))
            for c in range(1, len(layers) + 1):
                x, grid = c * step, cells.get((r, c))
                if grid is None:
                    mosaic[y:y + side, x:x + side] = 0.92
                    notes.append((r, c, "no map"))
                else:
                    heat = cmap(norm(in_norm(_upsample(grid, side), norm)))[..., :3]
                    mosaic[y:y + side, x:x + side] = (1 - alpha) * pale + alpha * heat
        cell = 0.9
        fig, ax = plt.subplots(figsize=(cell * (len(layers) + 1) + 2.4, cell * len(rows) + 0.7), layout="constrained")
        ax.imshow(mosaic, interpolation="nearest", aspect="auto")  # 'auto': see `overlays`
        if dots:
            xs, ys = zip(*dots, strict=True)
            ax.scatter(xs, ys, s=14, c="#33ddff", edgecolors="black", linewidths=0.6, zorder=3)
        for r, c, text in notes:
            ax.text(c * step + 0.04 * side, r * step + 0.04 * side, text, fontsize=5, va="top", ha="left",
                    color="white" if text == "CLS" else "0.3")
        ax.set_xticks([c * step + (side - 1) / 2 for c in range(len(layers) + 1)],
                      [f"image {image_id}", *(f"block {layer}" for layer in layers)], fontsize=7)
        ax.xaxis.set_ticks_position("top")
        ax.set_yticks([r * step + (side - 1) / 2 for r in range(len(rows))],
                      [f"{model_label(m, lines=True)}" + (f"\nquery {q}" if q else "") for m, q in rows], fontsize=6)
        ax.set_xlim(-0.5, mosaic.shape[1] - 0.5)
        ax.set_ylim(mosaic.shape[0] - 0.5, -0.5)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        uniform_colorbar(fig, plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax, "attention", shrink=0.6)
        out.append((f"Image {image_id}: where chosen query tokens look (dot: the query patch; rows: model and query; "
                    "mean of heads per block), every map on one scale in units of uniform attention's (1 = uniform, "
                    "the colour bar's middle); maps alike for every query mean attention collapse, a spot at the dot "
                    f"local attention [{cite('park2023', 'slides p. 4')}; {cite('wang_clmm', 'Fig. 9')}]", fig))
    return out


def attention_explorer(df: pd.DataFrame) -> Figures:
    """The explorer's static stand-in (for readers with scripts off and for ``--export``): the first kept image's
    centre and top-left patches as the queries, their attention (mean of heads) at every block, drawn as
    `query_attention_maps` draws its queries, from the explorer's 8-bit rows
    (`vitscope.analyses.attention.explorer.dequantise_rows`)."""
    from vitscope.analyses.attention.explorer import dequantise_rows

    need = {"codes", "scales", "image", "png", "grid_rows", "grid_cols", "prefix_tokens"}
    if not need <= set(df.columns):
        return []
    images = df[(df.metric == "input_image") & df["png"].notna()]
    attn = df[(df.metric == "attention") & df["codes"].notna()]
    if images.empty or attn.empty:
        return []
    first = int(images["image"].min())
    rows = []
    for r in attn[attn.image == first].itertuples(index=False):
        H, T, R, C, P = int(r.heads), int(r.tokens), int(r.grid_rows), int(r.grid_cols), int(r.prefix_tokens)
        a = dequantise_rows(np.frombuffer(r.codes, np.uint8).reshape(H, T, T),
                            np.frombuffer(r.scales, "<f4").reshape(H, T))
        for name, (qr, qc) in (("centre", (R // 2, C // 2)), ("corner", (0, 0))):
            grid = a[:, P + qr * C + qc, P:].mean(0).reshape(R, C)
            rows += [{"model": r.model, "metric": "query_attention_mean", "image": first, "layer": int(r.layer),
                      "query": name, "query_row": qr, "query_col": qc, "row": i, "col": j,
                      "value": float(grid[i, j])} for i in range(R) for j in range(C)]
    shown = pd.concat([images[images.image == first].assign(query=None), pd.DataFrame(rows)], ignore_index=True)
    return [(f"Attention explorer, drawn once (the page's explorer shows any patch, head and block): "
             f"{caption[0].lower()}{caption[1:]}", fig) for caption, fig in query_attention_maps(shown, max_images=1)]


FIGURES = {
    "attention_distance": attention_distance,
    "attention_nmi": attention_nmi,
    "saliency_iou": saliency_iou,
    "cls_attention_maps": cls_attention_maps,
    "aligned_attention_maps": aligned_attention_maps,
    "query_attention_maps": query_attention_maps,
    "attention_explorer": attention_explorer,
}
