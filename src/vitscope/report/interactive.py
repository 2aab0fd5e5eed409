"""The report's interactive layer: the data its charts and attention explorer read, as JSON in the page.

`charts` turns the per-layer tables into curves (one series per model with its 95 % interval, the chance level,
the untrained models marked) and the CKA tables into grids per model pair; `explorer` decodes nothing: it hands
the `attention_explorer` table's quantised rows to the page as base64, which the page decodes per image and block
when it is shown (`assets/interactive.js`). The charts are drawn by uPlot (vendored in `vendor/`, MIT), the maps
and grids on plain canvases. Everything is in the one HTML file: no request leaves the page.

The static figures these charts stand for stay in the page inside ``<noscript>`` (`replaces`), and for
``--export``."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import pandas as pd

EXPLORER = "attention_explorer"
"""The analysis whose kept attention rows the explorer shows."""


@dataclass(frozen=True)
class Curves:
    """One interactive per-layer chart of an analysis: the rows of ``metrics`` (names, or a regular expression
    when ``pattern``) with a numeric layer, one panel per value of the ``facets`` columns (a picker chooses),
    one series per model. Rows left over per (panel, model, layer) (heads, say) are averaged, the band then
    their range. ``replaces``: pieces of the captions of the static figures this chart shows the data of."""

    analysis: str
    title: str
    metrics: tuple[str, ...] = ()
    pattern: str = ""
    facets: tuple[str, ...] = ("metric", "token_view")
    replaces: tuple[str, ...] = ()
    reference: str = "chance"  # what the table's *_chance rows are for this analysis


CURVES: tuple[Curves, ...] = (
    Curves("attention_distance", "Mean attention distance per block (fraction of the image's diagonal)",
           ("distance",), replaces=("Attention distance per head and layer",)),
    Curves("attention_nmi", "Attention collapse: NMI between queries and keys per block", pattern=".*",
           replaces=("Attention collapse: NMI",)),
    Curves("saliency_iou", "Attention-saliency IoU per block", pattern=".*", facets=("metric", "query"),
           replaces=("Attention-saliency IoU",)),
    Curves("semantics", "Which block knows the class: k-NN, probe and k-means per block",
           pattern=r"^(knn\d+_top\d+|probe_top1|kmeans_(purity|nmi|ari))$", replaces=("Which layer knows the class",)),
    Curves("propagation", "Video mask propagation (J, F, J&F) per block", ("JF", "J", "F"),
           replaces=("Video mask propagation per layer",)),
    Curves("correspondence", "Keypoint correspondence per block", pattern=r"^(?!video_|pair_).*(?<!_chance)$",
           facets=("metric", "token_view", "category"), replaces=("Keypoint correspondence per layer",)),
    Curves("retrieval", "Instance retrieval per block", pattern=r"^(?!query_).*(?<!_chance)$",
           replaces=("Instance retrieval per layer",)),
    Curves("band_noise", "Probe accuracy under frequency-band noise per block", ("accuracy", "drop"),
           facets=("metric", "band", "readout")),
    Curves("corruptions", "Probe accuracy under corruptions per block", ("accuracy", "relative_drop"),
           facets=("metric", "corruption", "severity", "readout")),
    Curves("diversity", "Representation diversity inside self-attention per block", pattern=".*"),
    Curves("svd_volume", "Volume of the tokens per block", ("token_log_volume", "image_log_volume"),
           reference="isotropic Gaussian features (the most their variance fills)"),
    Curves("fourier", "High-frequency amplitude per block", ("high_freq_delta_log_amp",),
           reference="white-noise tokens"),
    Curves("block_updates", "Attention and MLP updates per block, and how far tokens move in unison",
           ("attn_share", "mlp_share", "attn_update", "mlp_update", "displacement", "unison_cosine", "unison_share")),
    Curves("high_norm_tokens", "High-norm tokens per block",
           ("outliers_per_image", "images_with_outliers", "cls_attention_absorbed", "knn_accuracy", "patch_variance"),
           facets=("metric", "token_view", "tokens")),
)
CKA_REPLACES = ("CKA between the taps of every pair of models",)


def _num(x: Any) -> float | None:
    """A JSON number, or None for a missing or non-finite one."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return float(f"{v:.6g}") if math.isfinite(v) else None  # 6 significant digits: the page shows 4


def _interval(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Each row's 95 % interval: its ``value_lo``/``value_hi`` where the table has them, else value ± 1.96
    stderr, else missing."""
    value = pd.to_numeric(rows["value"], errors="coerce")
    lo = pd.to_numeric(rows["value_lo"], errors="coerce") if "value_lo" in rows else pd.Series(np.nan, rows.index)
    hi = pd.to_numeric(rows["value_hi"], errors="coerce") if "value_hi" in rows else pd.Series(np.nan, rows.index)
    if "stderr" in rows:
        se = pd.to_numeric(rows["stderr"], errors="coerce")
        lo, hi = lo.fillna(value - 1.96 * se), hi.fillna(value + 1.96 * se)
    return lo, hi


def _facet_label(key: tuple[Any, ...], facets: Iterable[str]) -> str:
    parts = []
    for col, v in zip(facets, key, strict=True):
        if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        parts.append(str(v) if col == "metric" else f"{col} {v}")
    return " · ".join(parts) or "all"


def _chance(table: pd.DataFrame, panel: pd.DataFrame, metric: str, facets: tuple[str, ...],
            key: tuple[Any, ...]) -> float | None:
    """The panel's chance level: the rows' ``chance`` column where it has one value, else the table's
    ``<metric>_chance`` rows that share the panel's other facets (their mean over models)."""
    if "chance" in panel.columns:
        c = pd.to_numeric(panel["chance"], errors="coerce").dropna()
        if len(c) and np.allclose(c, c.iloc[0]):
            return _num(c.iloc[0])
    rows = table[table["metric"] == f"{metric}_chance"]
    for col, v in zip(facets, key, strict=True):
        if col != "metric" and col in rows.columns and not (isinstance(v, float) and math.isnan(v)) and v is not None:
            rows = rows[rows[col] == v]
    vals = pd.to_numeric(rows["value"], errors="coerce").dropna()
    return _num(vals.mean()) if len(vals) else None


def curves(table: pd.DataFrame, spec: Curves, models: list[str]) -> list[dict[str, Any]]:
    """The panels of one `Curves` chart: ``[{label, x, series: {model: {y, lo, hi, n}}, chance, note}]``."""
    d = table
    if "model_b" in d.columns:
        d = d[d["model_b"].isna() | (d["model_b"] == d["model"])]
    if "layer" not in d.columns:
        return []
    d = d.assign(layer=pd.to_numeric(d["layer"], errors="coerce"), value=pd.to_numeric(d["value"], errors="coerce"))
    d = d[d["layer"].notna() & d["value"].notna()]
    if spec.metrics:
        d = d[d["metric"].isin(spec.metrics)]
    if spec.pattern:
        d = d[d["metric"].astype(str).str.match(spec.pattern) & ~d["metric"].astype(str).str.endswith("_chance")]
    if d.empty:
        return []
    facets = tuple(f for f in spec.facets if f in d.columns)
    lo, hi = _interval(d)
    d = d.assign(_lo=lo, _hi=hi)
    keys = d[list(facets)].astype(object).where(d[list(facets)].notna(), None)
    d = d.assign(_key=[tuple(r) for r in keys.itertuples(index=False)])
    order = list(dict.fromkeys(d["_key"]))
    if spec.metrics:  # the spec's metric order first
        rank = {m: i for i, m in enumerate(spec.metrics)}
        order.sort(key=lambda k: rank.get(k[0], len(rank)))
    kid, uniq = pd.factorize(d["_key"])
    d = d.assign(_kid=kid)
    # one aggregation for every panel, model and layer (per-group pandas calls cost seconds on a study's tables)
    agg = d.groupby(["_kid", "model", "layer"], sort=True).agg(
        v=("value", "mean"), n=("value", "size"), vmin=("value", "min"), vmax=("value", "max"),
        lo=("_lo", "first"), hi=("_hi", "first")).reset_index()
    several = agg["n"] > 1
    agg.loc[several, "lo"], agg.loc[several, "hi"] = agg.loc[several, "vmin"], agg.loc[several, "vmax"]
    index = {key: i for i, key in enumerate(uniq)}
    by_key = dict(tuple(agg.groupby("_kid", sort=False)))
    rows_by_key = dict(tuple(d.groupby("_kid", sort=False)))
    panels = []
    for key in order:
        k = index[key]
        sub = by_key[k]
        xs = sorted(sub["layer"].unique())
        at = {(r.model, r.layer): r for r in sub.itertuples(index=False)}
        present = set(sub["model"])
        series: dict[str, dict[str, list[float | None]]] = {}
        for model in [m for m in models if m in present] + sorted(present - set(models)):
            got = [at.get((model, x)) for x in xs]
            series[str(model)] = {"y": [_num(r.v) if r else None for r in got],
                                  "lo": [_num(r.lo) if r else None for r in got],
                                  "hi": [_num(r.hi) if r else None for r in got],
                                  "n": [int(r.n) if r else 0 for r in got]}
        averaged = int(sub["n"].max())
        note = (f"each point is the mean of up to {averaged} rows of the table (e.g. heads); its band is their range, "
                "not an interval" if averaged > 1 else "bands: 95 % intervals")
        panels.append({"label": _facet_label(key, facets), "x": [_num(x) for x in xs], "series": series,
                       "chance": _chance(table, rows_by_key[k], str(key[0]), facets, key), "note": note,
                       "reference": spec.reference})
    return panels


def grids(table: pd.DataFrame, metrics: Iterable[str] | None = ("cka_minibatch",)) -> list[dict[str, Any]]:
    """Block-by-block matrices per (measure, token view) and model pair, for the rows of ``metrics`` (None: every
    metric with a ``layer_b``); one order of a pair serves both (the page transposes):
    ``[{view, range, pairs: [{a, b, layers_a, layers_b, value, lo, hi}]}]``, ``value[i][j]`` = the measure between
    a's block layers_a[i] and b's block layers_b[j]; ``range`` the colour scale's ends ([0, 1] for CKA, else the
    measure's smallest and largest value in the table)."""
    if not {"metric", "model_b", "layer", "layer_b"} <= set(table.columns):
        return []
    d = table if metrics is None else table[table["metric"].isin(list(metrics))]
    d = d.assign(layer=pd.to_numeric(d["layer"], errors="coerce"), layer_b=pd.to_numeric(d["layer_b"], errors="coerce"),
                 value=pd.to_numeric(d["value"], errors="coerce"))
    d = d[d["model_b"].notna() & d["layer"].notna() & d["layer_b"].notna()]
    if d.empty:
        return []
    lo, hi = _interval(d)
    d = d.assign(_lo=lo, _hi=hi, _view=d["token_view"].fillna("") if "token_view" in d.columns else "")
    cells = d.groupby(["metric", "_view", "model", "model_b", "layer", "layer_b"], sort=False).agg(
        value=("value", "mean"), lo=("_lo", "mean"), hi=("_hi", "mean")).reset_index()
    out = []
    for (metric, view), v in cells.groupby(["metric", "_view"], sort=False):  # one pass over the cells
        pairs = []
        for (a, b), g in v.groupby(["model", "model_b"], sort=False):
            la, lb = sorted(g["layer"].unique()), sorted(g["layer_b"].unique())
            ia, ib = {x: i for i, x in enumerate(la)}, {x: j for j, x in enumerate(lb)}
            mats = {k: [[None] * len(lb) for _ in la] for k in ("value", "lo", "hi")}
            for r in g.itertuples(index=False):
                for k in mats:
                    mats[k][ia[r.layer]][ib[r.layer_b]] = _num(getattr(r, k))
            pairs.append({"a": str(a), "b": str(b), "layers_a": [_num(x) for x in la],
                          "layers_b": [_num(x) for x in lb], **mats})
        label = " · ".join(str(x) for x in ((metric if metrics is None else None), view or None) if x) or "all"
        span = [0.0, 1.0] if str(metric).startswith("cka") else [_num(v["value"].min()), _num(v["value"].max())]
        out.append({"view": label, "range": span, "pairs": pairs})
    return out


def cka_diagonal(cka: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """CKA between the same block of two models, as curves, read off the CKA `grids`: one panel per (reference
    model, token view), a series per other model (blocks both have), with the rows' intervals."""
    panels = []
    for grid in cka:
        pairs = {(p["a"], p["b"]): p for p in grid["pairs"]}
        present = [m for m in models if any(m in k for k in pairs)]
        for ref in present:
            series, xs = {}, set()
            for other in present:
                p, flip = (pairs.get((ref, other)), False) if (ref, other) in pairs else (pairs.get((other, ref)), True)
                if other == ref or p is None:
                    continue
                la, lb = (p["layers_b"], p["layers_a"]) if flip else (p["layers_a"], p["layers_b"])
                common = [x for x in la if x in lb]
                vals = {}
                for x in common:
                    i, j = la.index(x), lb.index(x)
                    vals[x] = [p[k][j][i] if flip else p[k][i][j] for k in ("value", "lo", "hi")]
                series[other] = vals
                xs |= set(common)
            if not series:
                continue
            xs_sorted = sorted(xs)
            panels.append({"label": f"vs {ref}" + (f" · {grid['view']}" if grid["view"] else ""), "x": xs_sorted,
                           "series": {m: {"y": [v.get(x, [None] * 3)[0] for x in xs_sorted],
                                          "lo": [v.get(x, [None] * 3)[1] for x in xs_sorted],
                                          "hi": [v.get(x, [None] * 3)[2] for x in xs_sorted],
                                          "n": [1 if x in v else 0 for x in xs_sorted]} for m, v in series.items()},
                           "chance": None, "note": "bands: 95 % intervals"})
    return panels


def charts(tables: dict[str, pd.DataFrame], models: list[str]) -> dict[str, list[dict[str, Any]]]:
    """``{analysis: [chart]}``, each chart ``{id, title, panels}`` (plus ``grids`` for CKA), for the analyses the
    run has tables of."""
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in CURVES:
        if spec.analysis in tables:
            panels = curves(tables[spec.analysis], spec, models)
            if panels:
                out.setdefault(spec.analysis, []).append({"title": spec.title, "panels": panels})
    if "cka" in tables:
        cka = grids(tables["cka"])
        diag = cka_diagonal(cka, models)
        if diag:
            out.setdefault("cka", []).append({"title": "CKA between the same block of two models", "panels": diag})
        if cka:
            out.setdefault("cka", []).append({"title": "CKA between every pair of blocks of two models", "grids": cka})
    if "similarity" in tables:
        measures = grids(tables["similarity"], None)
        if measures:
            out.setdefault("similarity", []).append(
                {"title": "Each measure between every pair of blocks of two models", "grids": measures})
    n = 0
    for charts_ in out.values():
        for c in charts_:
            c["id"] = f"vs-chart-{n}"
            n += 1
    return out


def replaced(name: str, caption: str) -> bool:
    """Whether the static figure of this caption stands for an interactive chart of the page (then it goes inside
    ``<noscript>``, for readers with scripts off)."""
    pieces = [p for s in CURVES if s.analysis == name for p in s.replaces]
    if name == "cka":
        pieces += list(CKA_REPLACES)
    return any(p in caption for p in pieces)


def _b64(x: Any) -> str:
    return base64.b64encode(bytes(x)).decode() if x is not None else ""


def explorer(tables: dict[str, pd.DataFrame], models: list[str]) -> dict[str, Any] | None:
    """The explorer's data per model: its grid, prefix tokens and kept images (PNG, base64), each block's
    quantised attention (uint8 codes and float32 row maxima, base64; ``a = code / 255 * max``), its rollout and
    the pool's attention where the model has one; head types from ``aligned_attention_maps`` where the run has
    that table. None without the explorer's table."""
    t = tables.get(EXPLORER)
    if t is None or t.empty:
        return None
    types = _head_types(tables.get("aligned_attention_maps"))
    order = [m for m in models if m in set(t["model"])] + sorted(set(t["model"]) - set(models))
    shown = _within_budget(t, order)
    out: dict[str, Any] = {"models": {}, "left_out": {}}
    for model in order:
        g = t[t["model"] == model]
        first = g.iloc[0]
        entry: dict[str, Any] = {
            "grid": [int(first["grid_rows"]), int(first["grid_cols"])], "prefix": int(first["prefix_tokens"]),
            "cls": bool(first["cls_token"]), "images": {}, "types": types.get(str(model), {})}
        kept = sorted(int(i) for i in g["image"].dropna().unique())
        if len(shown[model]) < len(kept):
            out["left_out"][str(model)] = len(kept) - len(shown[model])
        if not shown[model]:
            continue
        for image, gi in g[g["image"].isin(shown[model])].groupby("image", sort=True):
            img: dict[str, Any] = {"attention": {}, "rollout": {}}
            for r in gi.itertuples(index=False):
                if r.metric == "input_image":
                    img["png"] = _b64(r.png)
                elif r.metric in ("attention", "rollout"):
                    img[r.metric][str(int(r.layer))] = [_b64(r.codes), _b64(r.scales)]
                    img["tokens"] = int(r.tokens)
                    if r.metric == "attention":
                        img["heads"] = int(r.heads)
                elif r.metric == "pool_attention":
                    img["pool"] = [_b64(r.codes), _b64(r.scales), int(r.heads), int(r.queries)]
            entry["images"][str(int(image))] = img
        entry["layers"] = sorted({int(k) for im in entry["images"].values() for k in im["attention"]})
        out["models"][str(model)] = entry
    return out


PAGE_BUDGET = 8_000_000
"""Bytes of quantised maps the page carries at most (about 10.7 MB as base64): images are taken in order, the
first kept image of every model, then the second, ...; the rest stay in the table (the page says how many)."""


def _within_budget(t: pd.DataFrame, models: list[str]) -> dict[str, list[int]]:
    """``{model: [image]}`` of the kept images whose maps fit `PAGE_BUDGET`, image-major."""
    sizes = {}
    for (model, image), g in t[t["codes"].notna()].groupby(["model", "image"]):
        sizes[(model, int(image))] = int(sum(len(c) for c in g["codes"]) + sum(len(c) for c in g["scales"]))
    images = {m: sorted(i for mm, i in sizes if mm == m) for m in models}
    shown: dict[str, list[int]] = {m: [] for m in models}
    total = 0
    for rank in range(max((len(v) for v in images.values()), default=0)):
        for m in models:
            if rank < len(images[m]) and len(shown[m]) == rank:  # a model's images stay in order
                size = sizes[(m, images[m][rank])]
                if total + size <= PAGE_BUDGET:
                    shown[m].append(images[m][rank])
                    total += size
    return shown


def _head_types(table: pd.DataFrame | None) -> dict[str, dict[str, str]]:
    """``{model: {"block,head": type}}`` from aligned_attention_maps' ``head_type`` rows."""
    if table is None or "type" not in table.columns:
        return {}
    rows = table[table["metric"] == "head_type"]
    out: dict[str, dict[str, str]] = {}
    for r in rows.itertuples(index=False):
        if pd.notna(r.layer) and pd.notna(r.head) and isinstance(r.type, str):
            out.setdefault(str(r.model), {})[f"{int(r.layer)},{int(r.head)}"] = r.type
    return out


def to_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</``), NaN as null."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def asset(name: str) -> str:
    """A file of the report's own scripts and styles (``assets/``) or of the vendored uPlot (``vendor/``)."""
    return resources.files("vitscope.report").joinpath(name).read_text(encoding="utf-8")


def model_meta(models: list[str], untrained: list[str], families: dict[str, str],
               colors: dict[str, str]) -> list[dict[str, Any]]:
    """The page's model list: name, family, whether untrained, colour (the figures' own)."""
    return [{"name": m, "family": families.get(m, "") or "", "untrained": m in untrained,
             "color": colors.get(m, "#888888")} for m in models]

