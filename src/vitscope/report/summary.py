"""The report's summary: the key findings of a run in sentences, with their numbers and uncertainty, and a flag
on each result that is within noise of chance or of the untrained model.

Each analysis with a summary has a function here (keyed by analysis name in ``SUMMARIES``, as figures are
in ``FIGURES``) taking its table and the study's `Study` facts and returning `Point`s. "Within noise" means
the difference is at most 1.96 times its standard error: ``sqrt(se_a² + se_b²)`` for two estimates, the
estimate's own ``se`` against a fixed chance level. Standard errors come from the tables' ``stderr`` column;
for a mean over the heads of a layer (or layers) the heads' mean stderr, an upper bound (their errors come
from the same images).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from vitscope.metrics.intervals import Z95


def model_families(manifest: dict[str, Any]) -> dict[str, str]:
    """``{model: family}`` as a reader should see it (`vitscope.models.registry.describe_family`): "untrained" for
    a random initialisation, "untrained → classification" for one fine-tuned from it."""
    from vitscope.models.registry import describe_family

    return {m: describe_family(meta.get("objective_family"), meta.get("supervision"), meta.get("finetuned_from"))
            for m, meta in manifest.get("models", {}).items()}


def model_readouts(manifest: dict[str, Any]) -> dict[str, str]:
    """``{model: what its head reads}`` ('CLS token', 'mean of patch tokens', 'attention pool'; `ViTModel.readout`)
    for the models whose manifest records it."""
    return {m: str(meta["readout"]) for m, meta in manifest.get("models", {}).items() if meta.get("readout")}


def untrained_models(manifest: dict[str, Any]) -> list[str]:
    """The models the manifest records as untrained (random initialisation, not fine-tuned): the baselines."""
    return [m for m, family in model_families(manifest).items() if family == "untrained"]


@dataclass
class Study:
    """What a summary needs to know besides one table: the models in order and which are untrained."""

    models: list[str] = field(default_factory=list)
    untrained: list[str] = field(default_factory=list)


@dataclass
class Point:
    """One sentence of the summary; ``flags`` name what it is within noise of ("chance", "the untrained model");
    ``not_above_chance``: the models whose result it states is not above chance (the report lists them)."""

    analysis: str
    text: str
    flags: list[str] = field(default_factory=list)
    not_above_chance: list[str] = field(default_factory=list)


def within_noise(a: float, se_a: float, b: float, se_b: float = 0.0) -> bool:
    """|a - b| <= 1.96 sqrt(se_a² + se_b²); False when an error is unknown (NaN)."""
    se = math.sqrt(se_a ** 2 + se_b ** 2)
    return bool(np.isfinite(se) and abs(a - b) <= Z95 * se)


def above_chance(score: float, stderr: float, chance: float) -> bool:
    """Whether a score is above its chance level beyond noise (not `within_noise` of it); without a stderr, whether
    it is above at all; without a chance level, True."""
    if not np.isfinite(chance):
        return True
    if not np.isfinite(stderr):
        return bool(score > chance)
    return bool(score > chance and not within_noise(score, stderr, chance))


def _fmt(v: float, se: float, unit: str = "", digits: int = 3) -> str:
    """``v ± half-width`` of its 95 % interval, both to the half-width's second significant digit."""
    half = Z95 * se
    if not np.isfinite(half) or half <= 0:
        return f"{v:.{digits}g}{unit}"
    decimals = max(0, 1 - math.floor(math.log10(half)))
    return f"{v:.{decimals}f} ± {half:.{decimals}f}{unit}"


def _models(df: pd.DataFrame, study: Study) -> list[str]:
    seen = list(dict.fromkeys(df["model"].dropna()))
    order = {m: i for i, m in enumerate(study.models)}
    return sorted(seen, key=lambda m: order.get(m, len(order)))


def _late_mean(df: pd.DataFrame, metric: str, model: str) -> tuple[float, float, list[int]]:
    """Mean of ``metric`` over the last third of the model's blocks (and heads) and its (upper-bound) stderr."""
    d = df[(df.model == model) & (df.metric == metric)]
    if d.empty:
        return float("nan"), float("nan"), []
    depth = int(d["layer"].max()) + 1
    late = d[d["layer"] >= depth - max(1, depth // 3)]
    se = float(late["stderr"].mean()) if "stderr" in late.columns else float("nan")
    return float(late["value"].mean()), se, sorted(int(x) for x in late["layer"].unique())


def _vs_untrained(values: Mapping[str, tuple[float, float]], study: Study) -> tuple[list[str], str | None]:
    """Trained models within noise of the (first) untrained model, and that model's name."""
    base = next((m for m in study.untrained if m in values), None)
    if base is None:
        return [], None
    b, se_b = values[base]
    return [m for m, (v, se) in values.items() if m != base and within_noise(v, se, b, se_b)], base


def _extremes_sentence(what: str, values: Mapping[str, tuple[float, float]], study: Study, unit: str = "") -> Point:
    """Every model's value in the study's order, then the highest and lowest trained model and those within noise
    of the untrained one."""
    each = "; ".join(f"{m}{' (untrained)' if m in study.untrained else ''} {_fmt(*v, unit)}" for m, v in values.items())
    text = f"{what}: {each}"
    trained = {m: v for m, v in values.items() if m not in study.untrained}
    if len(trained) > 1:
        hi = max(trained, key=lambda m: trained[m][0])
        lo = min(trained, key=lambda m: trained[m][0])
        text += f". Highest {hi}, lowest {lo}"
    close, base = _vs_untrained(values, study)
    flags = []
    if close:
        text += f". Within noise of the untrained model: {', '.join(close)}"
        flags.append("the untrained model")
    return Point("", text + ".", flags)


def attention_distance(df: pd.DataFrame, study: Study) -> list[Point]:
    values, layers = {}, []
    for m in _models(df, study):
        v, se, layers = _late_mean(df, "distance_px", m)
        values[m] = (v, se)
    if not values:
        return []
    span = f"blocks {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"block {layers[0]}" if layers else "late blocks"
    return [_extremes_sentence(f"Mean attention distance in the late layers ({span}, mean over heads, ± 95 %)",
                               values, study, " px")]


def attention_nmi(df: pd.DataFrame, study: Study) -> list[Point]:
    values = {}
    for m in _models(df, study):
        v, se, _ = _late_mean(df, "nmi", m)
        values[m] = (v, se)
    if not values:
        return []
    p = _extremes_sentence("Attention NMI(query, key) in the late layers (low = collapse, ± 95 %)", values, study)
    return [p]


def aligned_attention_maps(df: pd.DataFrame, study: Study) -> list[Point]:
    t = df[df.metric == "head_type"]
    if t.empty:
        return []
    local_kinds = ["strict_local", "soft_local", "axial", "offset_local"]
    parts = []
    for m in _models(t, study):
        g = t[t.model == m]
        loc = g[g["type"].isin(local_kinds)]
        blocks = sorted(int(x) for x in loc["layer"].unique())
        where = f" (blocks {', '.join(map(str, blocks))})" if blocks else ""
        parts.append(f"{m} {len(loc)} of {len(g)}{where}")
    return [Point("", "Local attention heads (strict, soft, axial or offset local, from the aligned maps): "
                  + "; ".join(parts) + ".")]


def saliency_iou(df: pd.DataFrame, study: Study) -> list[Point]:
    d = df[(df.metric == "iou_best_head") & (df["query"] == "cls")] if "query" in df.columns else df.iloc[0:0]
    if d.empty:
        return []
    values = {}
    for m in _models(d, study):
        g = d[d.model == m].dropna(subset=["value"])
        if len(g):
            r = g.loc[g["value"].idxmax()]
            values[m] = (float(r["value"]), float(r.get("stderr", float("nan"))))
    if not values:
        return []
    return [_extremes_sentence("Best CLS-attention IoU with the foreground (best head of the best block, ± 95 %)",
                               values, study)]


def semantics(df: pd.DataFrame, study: Study) -> list[Point]:
    metric = "knn20_top1" if (df.metric == "knn20_top1").any() else next(
        (m for m in sorted(df.metric.unique()) if m.startswith("knn") and m.endswith("_top1")), None)
    if metric is None:
        return []
    views = [v for v in ("cls", "gap_spatial", "gap") if ((df.metric == metric) & (df.token_view == v)).any()]
    if not views:
        return []
    view = views[0]
    d = df[(df.metric == metric) & (df.token_view == view) & df["layer"].notna()]
    points, best = [], {}
    for m in _models(d, study):
        g = d[d.model == m]
        r = g.loc[g["value"].idxmax()]
        best[m] = (float(r["value"]), float(r.get("stderr", float("nan"))), int(r["layer"]),
                   float(r.get("chance", float("nan"))), float(r.get("value_lo", float("nan"))),
                   float(r.get("value_hi", float("nan"))))
    if not best:
        return []
    chance = float(np.nanmean([b[3] for b in best.values()])) if any(np.isfinite(b[3]) for b in best.values()) \
        else float("nan")
    k = metric[3:].split("_")[0]
    parts = [f"{m} {v:.3g} [{lo:.3g}, {hi:.3g}] at block {layer}" for m, (v, _, layer, _, lo, hi) in best.items()]
    text = f"Best {k}-NN top-1 ({view} token, 95 % binomial interval): " + "; ".join(parts)
    flags = []
    # the low end of each model's best layer, simultaneous over the layers it was chosen from (Bonferroni), else
    # models at chance at every layer were called above chance 23-27 % of the time (benchmarks/calibration.py)
    low = {m: best_layer_low(d[d.model == m]) for m in best}
    if np.isfinite(chance):
        text += f". Chance (majority class) is {chance:.3g}"
        at_chance = [m for m, b in best.items() if np.isfinite(b[3]) and not is_finding(low[m], b[3])]
        if at_chance:
            text += f"; within noise of chance: {', '.join(at_chance)}"
            flags.append("chance")
    else:
        at_chance = []
    # the rule of the stars and the best-layer table (`is_finding`): the best layer's lower bound, simultaneous
    # over the layers, above the untrained model's best
    base = next((m for m in study.untrained if m in best), None)
    if base is not None:
        close = [m for m in best if m != base and m not in at_chance
                 and not is_finding(low[m], float("nan"), best[base][0])]
        if close:
            text += (f"; not above the untrained {base} ({best[base][0]:.3g}) beyond the interval (simultaneous "
                     f"over the layers): {', '.join(close)}")
            flags.append("the untrained model")
    points.append(Point("", text + ".", flags, at_chance))
    return points


def best_layer_low(rows: pd.DataFrame) -> float:
    """The low end of the 95 % interval of the best of ``rows`` (one per layer, or per candidate the best was chosen
    from; the best: the highest ``value``), simultaneous over the ``len(rows)`` candidates (Bonferroni: level
    1 - 0.05 / candidates), so it holds whichever layer came out best: the Wilson interval of an accuracy on
    ``n_test`` images; else ``value - t · stderr`` over ``interval_units`` (`vitscope.analyses.dense.best_interval`);
    else ``value - z · stderr`` (the normal quantile at that level); else the row's own ``value_lo`` (not
    simultaneous). NaN without any of them: nothing shows the best to be more than noise."""
    from scipy.stats import norm

    from vitscope.metrics.semantics import binomial_interval

    r = rows[pd.to_numeric(rows["value"], errors="coerce").notna()] if "value" in rows else rows.iloc[0:0]
    if r.empty:
        return float("nan")
    best = r.loc[pd.to_numeric(r["value"]).idxmax()]
    value, candidates = float(best["value"]), len(r)
    z = float(norm.ppf(1 - 0.025 / max(candidates, 1)))
    n_test = int(r["n_test"].dropna().iloc[0]) if "n_test" in r and r["n_test"].notna().any() else 0
    if n_test > 0:
        return binomial_interval(value, n_test, z=z)[0]
    se = _number(best.get("stderr"))
    if np.isfinite(se):
        units = _number(best.get("interval_units"))
        if np.isfinite(units):
            from vitscope.analyses.dense import best_interval

            return best_interval({"value": value, "stderr": se, "interval_units": units}, candidates)[0]
        return value - z * se
    return _number(best.get("value_lo"))


def is_finding(low: float, chance: float, baseline: float = float("nan")) -> bool:
    """The one rule for emphasising a best layer (a star on a curve, a coloured cell): the low end of its interval
    (`best_layer_low`, or a best-layer row's simultaneous ``value_lo``) above ``chance`` where the chance level is
    known, and above ``baseline``, the untrained model's best score (the same task, metric and view), where the
    study has one. False without an interval: an estimate with no error is no finding."""
    if not np.isfinite(low):
        return False
    return not (np.isfinite(chance) and low <= chance) and not (np.isfinite(baseline) and low <= baseline)


def best_above_chance(row: Mapping[str, Any]) -> bool:
    """Whether a dense task's best-layer row is above its chance level beyond noise: the low end of its interval
    (``value_lo``: simultaneous over the layers it was chosen from, `analyses.dense.best_interval`) above chance;
    a table without it falls back to 1.96 standard errors (`best_row_low`, `is_finding`)."""
    return is_finding(best_row_low(row), _number(row.get("chance")))


def best_row_low(row: Mapping[str, Any]) -> float:
    """The low end of a best-layer row's interval: its ``value_lo`` (simultaneous over the layers it was chosen
    from, `analyses.dense.best_interval`), else value - 1.96 stderr; NaN without either."""
    lo = _number(row.get("value_lo"))
    return lo if np.isfinite(lo) else _number(row.get("value")) - Z95 * _number(row.get("stderr"))


def best_row_is_finding(row: Mapping[str, Any], baseline: float = float("nan")) -> bool:
    """`is_finding` for a best-layer row: above its chance level and the untrained model's best score ``baseline``
    beyond its interval (`best_row_low`)."""
    return is_finding(best_row_low(row), _number(row.get("chance")), baseline)


def _number(v: Any) -> float:
    """A table cell as a float, NaN for None / NA / anything not a number."""
    try:
        return float(v) if v is not None and pd.notna(v) else float("nan")
    except (TypeError, ValueError):
        return float("nan")


DENSE_TASKS = {"propagation": ("JF", "video propagation J&F"), "correspondence": ("pck@0.1", "keypoint PCK@0.1"),
               "retrieval": ("mAP_medium", "retrieval mAP (Medium)")}


def _best_layer(task: str) -> Callable[[pd.DataFrame, Study], list[Point]]:
    metric, label = DENSE_TASKS[task]

    def point(df: pd.DataFrame, study: Study) -> list[Point]:
        best = df[df.metric == f"best_{metric}"]
        if best.empty:
            return []
        parts, below, chance = [], [], float("nan")
        for m in _models(best, study):
            r = best[best.model == m].iloc[0]
            se = float(r["stderr"]) if "stderr" in r and pd.notna(r["stderr"]) else float("nan")
            chance = float(r["chance"]) if "chance" in r and pd.notna(r["chance"]) else chance
            if best_above_chance(r):
                lo, hi = r.get("value_lo", float("nan")), r.get("value_hi", float("nan"))
                shown = f"{float(r['value']):.3g} [{float(lo):.3g}, {float(hi):.3g}]" if pd.notna(lo) and pd.notna(hi) \
                    else _fmt(float(r["value"]), se)
                parts.append(f"{m} {shown} at block {int(r['layer'])}")
            else:
                below.append(m)
        text = f"Best layer for {label} (95 % interval, simultaneous over the layers): " + (
            "; ".join(parts) if parts else "none above chance")
        if np.isfinite(chance):
            text += f". Chance is {chance:.3g}"
        if below:
            text += f"; no layer above chance: {', '.join(below)}"
        flags = ["chance"] if below else []
        # above chance, but not above the untrained model's best beyond the interval (`is_finding`)
        base = next((m for m in study.untrained if (best.model == m).any()), None)
        if base is not None:
            b = float(best[best.model == base]["value"].iloc[0])
            close = [m for m in _models(best, study) if m != base and m not in below
                     and not best_row_is_finding(best[best.model == m].iloc[0], b)]
            if close:
                text += f"; not above the untrained {base} ({b:.3g}) beyond the interval: {', '.join(close)}"
                flags.append("the untrained model")
        return [Point("", text + ".", flags, below)]

    return point


def _readout(metric: str, what: str) -> Callable[[pd.DataFrame, Study], list[Point]]:
    """A robustness figure at each model's decision (head, else last-layer probe); models whose readout is at chance
    (``reason``) are listed, not given a number."""

    def point(df: pd.DataFrame, study: Study) -> list[Point]:
        from vitscope.analyses.robustness import decision_rows

        d = df[df.metric == metric]
        if "band" in d.columns and d["band"].notna().any():
            d = d[d["band"] == d["band"].max()]
        if "corruption" in d.columns and metric == "mca":
            d = d[d["corruption"].isna()]
        if d.empty:
            return []
        d = decision_rows(d, head_only=True, column="where")
        parts, below = [], []
        for m in _models(d, study):
            g = d[d.model == m]
            reasons = g["reason"].dropna() if "reason" in g.columns else []
            if len(reasons) or g["value"].isna().all():
                below.append(m)
            else:
                parts.append(f"{m} {float(g['value'].mean()):.3g} ({g['where'].iloc[0]})")
        text = f"{what}: " + ("; ".join(parts) if parts else "no readout above chance")
        if below:
            text += f"; not reported, the readout's clean accuracy is within noise of chance: {', '.join(below)}"
        return [Point("", text + ".", ["chance"] if below else [], below)]

    return point


def cka(df: pd.DataFrame, study: Study) -> list[Point]:
    d = df[(df.metric == "cka_minibatch") & (df.model != df.model_b)] if "model_b" in df.columns else df.iloc[0:0]
    if d.empty:
        return []
    view = "cls" if (d.token_view == "cls").any() else str(d.token_view.iloc[0])
    d = d[d.token_view == view]
    last = {}
    for (a, b), g in d.groupby(["model", "model_b"], sort=False):
        depth_a, depth_b = int(g["layer"].max()), int(g["layer_b"].max())
        r = g[(g.layer == depth_a) & (g.layer_b == depth_b)]
        if len(r):
            last[(a, b)] = (float(r["value"].iloc[0]), float(r["stderr"].iloc[0]) if "stderr" in r else float("nan"))
    trained = {p: v for p, v in last.items() if not (set(p) & set(study.untrained))}
    if not trained:
        return []
    hi = max(trained, key=lambda p: trained[p][0])
    lo = min(trained, key=lambda p: trained[p][0])
    if hi == lo:
        return [Point("", f"Last-block CKA between {hi[0]} and {hi[1]} ({view} token, ± 95 %): {_fmt(*trained[hi])}.")]
    return [Point("", f"Last-block CKA between models ({view} token, ± 95 %): most alike {hi[0]} and {hi[1]} "
                      f"{_fmt(*trained[hi])}, least alike {lo[0]} and {lo[1]} {_fmt(*trained[lo])}.")]


SUMMARIES: dict[str, Callable[[pd.DataFrame, Study], list[Point]]] = {
    "attention_distance": attention_distance,
    "attention_nmi": attention_nmi,
    "aligned_attention_maps": aligned_attention_maps,
    "saliency_iou": saliency_iou,
    "semantics": semantics,
    "cka": cka,
    "shape_bias": _readout("shape_bias", "Shape bias (fraction of shape decisions) at each model's decision"),
    "band_noise": _readout("drop", "Accuracy drop under the highest-frequency noise band at each model's decision"),
    "corruptions": _readout("mca_relative_drop", "Relative accuracy drop under the corruptions (mean) at each "
                                                 "model's decision"),
    **{task: _best_layer(task) for task in DENSE_TASKS},
}


def summarize(tables: Mapping[str, pd.DataFrame], study: Study) -> list[Point]:
    """The summary's points, analysis by analysis in the order of ``tables``."""
    out = []
    for name, df in tables.items():
        fn = SUMMARIES.get(name)
        if fn is None or df.empty:
            continue
        for p in fn(df, study):
            p.analysis = name
            out.append(p)
    return out
