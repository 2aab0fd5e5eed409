"""Figures of the similarity analyses (`vitscope.analyses.similarity`)."""

from __future__ import annotations

import inspect

import numpy as np
import pandas as pd

from vitscope.measures import is_distance
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


def _mosaic_matrix(gv: pd.DataFrame) -> tuple[np.ndarray, list[str], dict[str, list[str]], dict[str, int]]:
    """The tap x tap values of every pair of models as one matrix (one empty row / column between models): block
    (A, B) holds A's taps on its rows and B's on its columns; a pair the table holds in one order only is
    mirrored into the other."""
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
    return mosaic, models, taps, off


def _mosaic_ticks(ax: plt.Axes, models: list[str], taps: dict[str, list[str]], off: dict[str, int], n: int,
                  model_labels: bool = True) -> None:
    pos = [off[m] + i for m in models for i in range(len(taps[m]))]
    short = [_short(t) for m in models for t in taps[m]]
    fs = 6 if n <= 40 else 4.5
    ax.set_xticks(pos, short, minor=True)
    ax.set_yticks(pos, short, minor=True)
    ax.tick_params(which="minor", length=1.5, labelsize=fs)
    ax.tick_params(axis="x", which="minor", labelrotation=90)
    centres = [off[m] + (len(taps[m]) - 1) / 2 for m in models]
    if model_labels:
        ax.set_xticks(centres, [model_label(m, lines=True) for m in models], rotation=30, ha="right")
        ax.set_yticks(centres, [model_label(m, lines=True) for m in models])
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    pad = 6 + 0.75 * fs * max(len(s) for s in short)  # points: beyond the taps' labels
    ax.tick_params(which="major", length=0, pad=pad, labelsize=7)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _cka_mosaic(gv: pd.DataFrame) -> plt.Figure:
    mosaic, models, taps, off = _mosaic_matrix(gv)
    n = len(mosaic)
    side = min(11.0, max(3.2, 0.13 * n + 1.5))
    fig, ax = plt.subplots(figsize=(side + 1.4, side + 0.6), layout="constrained")
    im = ax.imshow(mosaic, origin="lower", vmin=0, vmax=1, cmap=plt.get_cmap("magma").with_extremes(bad="white"),
                   interpolation="nearest")
    _mosaic_ticks(ax, models, taps, off, n)
    ax.set_xlabel("model B (its taps)", fontsize=8)
    ax.set_ylabel("model A (its taps)", fontsize=8)
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
                ax.set_title(model, fontsize=8)  # not in the y label: two lines of it ran into the next row's
                ax.set_ylabel("skip path into block i", fontsize=8)
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


#: how each measure of the `similarity` table is drawn: (colour range, label); distances get a reversed map so
#: that bright means similar in every panel
_SCALES = {"procrustes": ((0.0, float(np.sqrt(2))), "Procrustes distance"),
           "angular_shape": ((0.0, float(np.pi / 2)), "shape metric (radians)"),
           "ridge_r2": ((0.0, 1.0), "ridge R² (row predicts column)"),
           "pwcca": ((0.0, 1.0), "PWCCA (weights from the row)"),
           "subspace_similarity": ((0.0, 1.0), "subspace similarity (top-k principal subspaces)")}


def _scale(metric: str) -> tuple[tuple[float, float], str, bool]:
    """(vmin, vmax), label, reversed (a distance) of one measure."""
    base = metric.split("_alpha=")[0]
    (lo, hi), label = _SCALES.get(base, ((0.0, 1.0), metric.replace("_", " ")))
    if "_alpha=" in metric:
        label = f"{label}, alpha {metric.split('=')[1]}"
    return (lo, hi), label, is_distance(metric)


def similarity(df: pd.DataFrame) -> Figures:
    """Two figures of the `similarity` table. (1) One mosaic per measure (small multiples), each as the CKA
    mosaic: block (A, B) = A's taps (rows) against B's (columns); for the asymmetric measures (ridge R², PWCCA)
    the block (B, A) is the ``*_reverse`` score, so a row always predicts / weights its column; distances drawn
    on a reversed scale (bright = similar everywhere). (2) A metric MDS map of every (model, tap) from the
    angular shape metric [Williams et al. 2021] (alpha 0.5 where computed, else the first), each model a
    coloured trajectory through depth. (3) Where the subspace similarity ran across a pretrained -> fine-tuned
    pair (rows with ``pretrained``), its value per layer, a line per fine-tuned model or epoch (`subspace_per_layer`)
    [Ramasesh et al. 2021]."""
    return [*_similarity(df), *subspace_per_layer(df)]


def _similarity(df: pd.DataFrame) -> Figures:
    """The mosaics and the map of `similarity` (the profiles of matched layers when the table has no more)."""
    if _matched_only(df[~df.metric.str.endswith("_reverse")]):
        return [_profiles(df)]
    df = df[~df.metric.str.endswith("_reverse")].pipe(lambda d: pd.concat([d, _reversed(df)], ignore_index=True))
    metrics = list(dict.fromkeys(df.metric))
    rows, cols = grid_shape(len(metrics), 4)
    n_side = len(_mosaic_matrix(df[df.metric == metrics[0]])[0])
    side = min(5.0, max(2.6, 0.09 * n_side + 1.6))
    fig, axes = panels(rows, cols, panel=(side + 0.9, side + 0.5))
    for ax, metric in zip(axes.flat, metrics, strict=False):
        mosaic, models, taps, off = _mosaic_matrix(df[df.metric == metric])
        (lo, hi), label, dist = _scale(metric)
        cmap = plt.get_cmap("magma_r" if dist else "magma").with_extremes(bad="white")
        im = ax.imshow(mosaic, origin="lower", vmin=lo, vmax=hi, cmap=cmap, interpolation="nearest")
        _mosaic_ticks(ax, models, taps, off, len(mosaic), model_labels=len(models) > 1)
        ax.set_title(label, fontsize=8)
        colorbar(fig, im, ax, label, shrink=0.8)
    for ax in axes.flat[len(metrics):]:
        ax.set_axis_off()
    view = ", ".join(map(str, dict.fromkeys(df.token_view)))
    out: Figures = [(f"Similarity between the taps of every pair of models by each measure ({view} token view): "
                     "block (row A, column B) has A's taps on its rows and B's on its columns, layer 0 at the "
                     "bottom left; bright = similar in every panel (distances on a reversed scale) "
                     f"[{cite('williams2021')}; {cite('raghu2017')}; {cite('morcos2018')}; "
                     f"{cite('kriegeskorte2008')}; {cite('huh2024')}]", fig)]
    mds = _mds_map(df)
    if mds is not None:
        out.append(mds)
    else:
        out[0] = (out[0][0] + ". No map of every tap by the shape metric: it needs the distances within each "
                  "model as well (grid: full, and alpha among the measures)", out[0][1])
    return out


def _finetuned_rows(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The rows of ``metric`` of pretrained -> fine-tuned pairs at the same layer, oriented so that ``model`` is
    the pretrained model and ``model_b`` (with ``epoch_b`` where the table has epochs) the fine-tuned one."""
    if "pretrained" not in df.columns:
        return df.iloc[:0]
    d = df[(df.metric == metric) & df.pretrained.notna() & (df.layer == df.layer_b)]
    flip = d.model != d.pretrained
    swap = {"model": "model_b", "model_b": "model", "tap": "tap_b", "tap_b": "tap", "epoch": "epoch_b",
            "epoch_b": "epoch"}
    back = d[flip].rename(columns={k: v for k, v in swap.items() if k in d.columns})
    return pd.concat([d[~flip], back], ignore_index=True)


def subspace_per_layer(df: pd.DataFrame) -> Figures:
    """Subspace similarity of each layer of the pretrained model with the same layer of each model fine-tuned
    from it [Ramasesh et al. 2021; Merlin et al. 2023's baseline]: a panel per pretrained model (and token view),
    a line per fine-tuned model, coloured by epoch along a colour map for a checkpoint list, with its 95 %
    jackknife interval where the table has one (``null_pairs: matched`` gives every layer one). Nothing when the
    measure did not run across such a pair."""
    d = _finetuned_rows(df, "subspace_similarity")
    if d.empty:
        return []
    groups = list(d.groupby(["model", "token_view"], sort=False))
    rows, cols = grid_shape(len(groups), 3)
    fig, axes = panels(rows, cols, panel=(3.4, 2.6), sharey=True)
    handles, seen = [], set()
    for ax, ((pre, view), g) in zip(axes.flat, groups, strict=False):
        for ft, color, name in _finetuned_lines(g):
            h = g[g.model_b == ft].sort_values("layer")
            ax.plot(h.layer.astype(float), h.value.astype(float), "-o", ms=2.5, lw=1.2, color=color)
            if {"value_lo", "value_hi"} <= set(h.columns) and h.value_lo.notna().any():
                e = h[h.value_lo.notna()]
                ax.fill_between(e.layer.astype(float), e.value_lo.astype(float), e.value_hi.astype(float),
                                color=color, alpha=0.15, lw=0)
            if name not in seen:
                seen.add(name)
                handles.append(style_handle("-o", name, color=color))
        ax.set_title(f"{model_label(pre)} vs fine-tuned ({view})", fontsize=7)
        ax.set_xlabel("block (the same in both models)", fontsize=7)
        ax.set_ylim(0, 1.02)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(groups):]:
        ax.set_axis_off()
    for ax in axes[:, 0]:
        ax.set_ylabel("subspace similarity", fontsize=7)
    legend_outside(fig, handles=handles, extra=[band_handle()] if has_interval(d) else [])
    return [("Subspace similarity of each layer before and after fine-tuning: the overlap of the top-k principal "
             "subspaces of the pretrained model's layer and the same layer of each fine-tuned model (or epoch of a "
             f"checkpoint list), |V_pᵀ V_f|²_F / k (1 = the same subspace); {_space_note(d)}; low = the layer's "
             f"dominant directions changed [{cite('ramasesh2021')}; {cite('merlin2023')}]", fig)]


def _space_note(d: pd.DataFrame) -> str:
    """Where the drawn rows took their principal directions (the table's ``subspace_space``; images before it)."""
    spaces = set(d.subspace_space.dropna()) if "subspace_space" in d.columns else {"images"}
    notes = {"features": "directions in feature space (the top-k eigenvectors of each layer's feature covariance, "
                         "as Ramasesh et al.)",
             "images": "directions in the space of the images (the principal components' scores over the subset; "
                       "about k / n images by chance)"}
    return "; ".join(notes[s] for s in sorted(spaces) if s in notes) or notes["images"]


def _finetuned_lines(g: pd.DataFrame) -> list[tuple[str, object, str]]:
    """(fine-tuned model, colour, legend label) in epoch order: a colour map over the epochs of a checkpoint
    list, the report's model colours otherwise."""
    models = list(dict.fromkeys(g.model_b))
    epochs = {}
    if "epoch_b" in g.columns:
        epochs = {m: e for m, e in zip(g.model_b, g.epoch_b, strict=True) if pd.notna(e)}
    if len(epochs) == len(models) and len(models) > 1:
        models.sort(key=lambda m: epochs[m])
        cmap = plt.get_cmap("viridis")
        return [(m, cmap(k / (len(models) - 1)), f"{m} (epoch {int(epochs[m])})") for k, m in enumerate(models)]
    return [(m, model_color(m), model_label(m)) for m in models]


def _matched_only(df: pd.DataFrame) -> bool:
    """Whether the table holds matched layers only (`grid: matched`): across models, one layer of B per layer
    of A and measure."""
    if df.empty or (df.model == df.model_b).any():
        return False
    return bool((df.groupby(["model", "model_b", "tap", "metric"], sort=False).size() == 1).all())


def _profiles(df: pd.DataFrame) -> tuple[str, plt.Figure]:
    """One panel per measure: its value at matched depths against A's block, a line per pair of models, with
    the 95 % interval where the table has one (the pairs ``null_pairs`` names)."""
    metrics = list(dict.fromkeys(df.metric))
    pairs = list(dict.fromkeys(zip(df.model, df.model_b, strict=True)))
    names = [f"{model_label(a)} vs {model_label(b)}" for a, b in pairs]
    rows, cols = grid_shape(len(metrics), 4)
    fig, axes = panels(rows, cols, panel=(2.6, 2.1))
    for ax, metric in zip(axes.flat, metrics, strict=False):
        for (a, b), name in zip(pairs, names, strict=True):
            g = df[(df.metric == metric) & (df.model == a) & (df.model_b == b)].sort_values("layer")
            color = model_color(name, names)
            ax.plot(g.layer, g.value, "-o", ms=2.5, lw=1.2, color=color, label=name)
            if {"value_lo", "value_hi"} <= set(g.columns):
                e = g[g.value_lo.notna()]
                ax.errorbar(e.layer, e.value, yerr=[e.value - e.value_lo, e.value_hi - e.value], fmt="none",
                            ecolor=color, capsize=2, lw=1)
        base = metric.removesuffix("_reverse")
        label = _scale(base)[1].replace("row predicts column", "A predicts B").replace("from the row", "from A")
        if metric != base:
            label = _scale(base)[1].replace("row predicts column", "B predicts A").replace("from the row", "from B")
        ax.set_title(label + (" (lower = similar)" if _scale(base)[2] else ""), fontsize=7)
        ax.set_xlabel("block of A (B's at the same relative depth)", fontsize=6)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(metrics):]:
        ax.set_axis_off()
    handles = [style_handle("-o", n, color=model_color(n, names)) for n in names]
    legend_outside(fig, handles=handles, extra=[style_handle("|", "bars: 95 % jackknife interval", markersize=8)])
    view = ", ".join(map(str, dict.fromkeys(df.token_view)))
    return (f"Similarity of matched layers between models by each measure ({view} token view): each layer of A "
            "against B's layer at the same relative depth, a line per pair of models; bars: 95 % intervals (a "
            "jackknife over groups of images) at the pairs with nulls (null_pairs). Every pair of layers, and a "
            "map of every tap by the shape metric: grid: full "
            f"[{cite('williams2021')}; {cite('raghu2017')}; {cite('morcos2018')}; {cite('kriegeskorte2008')}; "
            f"{cite('huh2024')}]", fig)


def _reversed(df: pd.DataFrame) -> pd.DataFrame:
    """``*_reverse`` rows as the forward measure of (B, A): model and tap columns swapped."""
    rev = df[df.metric.str.endswith("_reverse")]
    swap = {"model": "model_b", "model_b": "model", "tap": "tap_b", "tap_b": "tap", "layer": "layer_b",
            "layer_b": "layer"}
    return rev.rename(columns=swap).assign(metric=rev.metric.str.removesuffix("_reverse"))


def _mds_map(df: pd.DataFrame) -> tuple[str, plt.Figure] | None:
    """MDS of the shape-metric distances between every (model, tap) the table connects."""
    shape = sorted(m for m in set(df.metric) if m.startswith("angular_shape_alpha="))
    if not shape:
        return None
    metric = min(shape, key=lambda m: abs(float(m.split("=")[1]) - 0.5))
    g = df[df.metric == metric]
    nodes = list(dict.fromkeys([*zip(g.model, g.tap, strict=True), *zip(g.model_b, g.tap_b, strict=True)]))
    where = {n: i for i, n in enumerate(nodes)}
    d = np.full((len(nodes),) * 2, np.nan)
    ia = [where[n] for n in zip(g.model, g.tap, strict=True)]
    ib = [where[n] for n in zip(g.model_b, g.tap_b, strict=True)]
    d[ia, ib] = g.value.to_numpy(dtype=float)
    d = np.where(np.isnan(d), d.T, d)
    np.fill_diagonal(d, 0.0)
    keep = ~np.isnan(d).any(1)  # models the table does not pair with every other are left out
    if keep.sum() < 3:
        return None
    from sklearn.manifold import MDS

    from vitscope.threads import few_threads

    d = (d[keep][:, keep] + d[keep][:, keep].T) / 2
    # scikit-learn 1.8 renamed ``dissimilarity`` to ``metric`` and added the classical-MDS start
    new_api = "metric_mds" in inspect.signature(MDS).parameters
    kw = {"metric": "precomputed", "init": "classical_mds", "n_init": 1} if new_api else \
        {"dissimilarity": "precomputed", "n_init": 4}
    with few_threads():
        xy = MDS(n_components=2, random_state=0, normalized_stress="auto", **kw).fit_transform(d)
    nodes = [n for n, k in zip(nodes, keep, strict=True) if k]
    fig, axes = panels(1, 1, panel=(4.2, 3.6))
    ax = axes[0, 0]
    models = list(dict.fromkeys(m for m, _ in nodes))
    for m in models:
        idx = [i for i, (mm, _) in enumerate(nodes) if mm == m]
        c = model_color(m, models)
        ax.plot(xy[idx, 0], xy[idx, 1], "-o", color=c, markersize=3, linewidth=1.2, label=model_label(m))
        ax.plot(xy[idx[0], 0], xy[idx[0], 1], "s", color=c, markersize=6)
        ax.plot(xy[idx[-1], 0], xy[idx[-1], 1], "^", color=c, markersize=7)
    ax.set_xlabel("MDS 1", fontsize=8)
    ax.set_ylabel("MDS 2", fontsize=8)
    ax.set_aspect("equal", adjustable="datalim")
    ax.tick_params(labelsize=6)
    legend_outside(fig, extra=[style_handle("s", "square: first tap"), style_handle("^", "triangle: last tap")])
    alpha = metric.split("=")[1]
    return (f"A map of every model's taps by the angular shape metric (alpha {alpha}; metric MDS of the "
            "distances, so nearby points are similar representations): each model a line through depth from "
            f"its first tap (square) to its last (triangle) [{cite('williams2021')}]", fig)


def _short(tap: str) -> str:
    return tap.replace("block", "b").replace(".out", "")


FIGURES = {"cka": cka, "residual_cka": residual_cka, "diversity": diversity, "similarity": similarity}
