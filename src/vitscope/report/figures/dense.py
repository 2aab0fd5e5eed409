"""Figures of the dense downstream tasks (`vitscope.analyses.dense`): a per-layer curve figure per task, and
the best-layer summary across tasks and models (after Walmer et al., "Teaching Matters: Investigating the
Role of Supervision in Vision Transformers", CVPR 2023, Table 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from vitscope.report.figures._common import Figures, colorbar, current, grid_layout, layer_lines, legend_outside, plt
from vitscope.report.summary import (
    DENSE_TASKS,
    best_above_chance,
    best_row_is_finding,
    best_row_low,
    is_finding,
    untrained_models,
)

TASKS = DENSE_TASKS  # analysis -> (headline metric, label)

#: k-NN classification beside the dense tasks in the best-layer summary (Walmer et al. 2023, Table 1 puts it there):
#: its ``task`` name, label and the k read from the semantics table (DINO's 20-NN; the smallest k there otherwise)
KNN_TASK, KNN_LABEL, KNN_K = "knn", "k-NN top-1 (semantics)", 20
#: the image-level views of the semantics table a k-NN best layer is chosen from (object / part rows are regions)
KNN_VIEWS = ("cls", "gap", "gap_spatial")


STAR = ("star = best layer, only where its 95 % interval (simultaneous over the layers) clears chance and the "
        "untrained model's best")


def nothing_above(df: pd.DataFrame, task: str) -> str:
    """The sentence a task's figures open with when no trained model's best layer of its headline metric (its
    ``best_*`` rows) is a finding (`vitscope.report.summary.best_row_is_finding`): none above chance beyond its
    interval, or none above the untrained model's best too; "" when one is (then layers are ranked)."""
    metric, label = TASKS[task]
    best = df[df.metric == f"best_{metric}"] if "metric" in df.columns else df.iloc[0:0]
    untrained = best[best.model.isin(current().untrained)]
    trained = best[~best.model.isin(current().untrained)]
    if trained.empty:
        return ""
    baseline = float(untrained["value"].max()) if len(untrained) else float("nan")
    if not any(best_above_chance(r) for _, r in trained.iterrows()):
        return (f"Nothing here is above chance: no trained model's best layer of {label} clears the chance level "
                "beyond its 95 % interval (simultaneous over the layers), so no layer is ranked. ")
    if not any(best_row_is_finding(r, baseline) for _, r in trained.iterrows()):
        return (f"Nothing here is above the untrained model: no trained model's best layer of {label} clears the "
                f"untrained model's best ({baseline:.3g}) beyond its 95 % interval, so no layer is ranked. ")
    return ""


def _panels(df: pd.DataFrame, panels: list[tuple[str, str]], rows: list[tuple[str, pd.DataFrame]],
            caption: str) -> Figures:
    panels = [(m, t) for m, t in panels if (df.metric == m).any()]
    if not panels or not rows:
        return []
    fig, axes = plt.subplots(len(rows), len(panels), figsize=(3.6 * len(panels), 2.8 * len(rows)), squeeze=False)
    for r, (label, d) in enumerate(rows):
        for c, (metric, title) in enumerate(panels):
            layer_lines(axes[r][c], d, metric, title=f"{title}{label}", mark_best=True)
    grid_layout(fig)
    legend_outside(fig)  # beside the panels, never over a curve
    return [(caption, fig)]


def variant_note(df: pd.DataFrame) -> str:
    """The note a task's captions end with when one of the source's variants ran (the table's ``variant`` column:
    pixel matching, the Gaussian "random" baseline, ...), with the random features' score per model where the table
    has it; "" for a default table."""
    if "variant" not in df.columns or not df["variant"].notna().any():
        return ""
    note = " Variant: " + "; ".join(dict.fromkeys(df["variant"].dropna().astype(str))) + "."
    if "random_features" in df.columns:
        best = df[df.metric.astype(str).str.startswith("best_") & df.random_features.notna()]
        if len(best):
            note += " Random (Gaussian) features score " + ", ".join(
                f"{r.model} {r.random_features:.3g}" for r in best.itertuples()) + "."
    return note


def _overall(df: pd.DataFrame, column: str) -> pd.DataFrame:
    return df[df[column].isna()] if column in df.columns else df


def propagation(df: pd.DataFrame) -> Figures:
    """J, F and J&F per layer and model, over every video (star = best layer, dashed = constant features)."""
    d = _overall(df, "video")
    return _panels(d, [("J", "J (region IoU)"), ("F", "F (boundary)"), ("JF", "J&F")], [("", d)],
                   nothing_above(d, "propagation") + "Video mask propagation per layer (DINO's protocol, no "
                   f"training): J, F and J&F over every video ({STAR}; dashed = the same propagation with constant "
                   "features, the chance level)" + variant_note(df))


def correspondence(df: pd.DataFrame) -> Figures:
    """PCK at each threshold per layer and model, over every keypoint."""
    d = _overall(df, "category")
    alphas = sorted({m.split("@")[1] for m in d.metric if m.startswith("pck@") and m.count("_") == 0},
                    key=lambda a: -float(a))
    return _panels(d, [(f"pck@{a}", f"PCK@{a}") for a in alphas], [("", d)],
                   nothing_above(d, "correspondence") + "Keypoint correspondence per layer (nearest patch token, no "
                   "training): PCK at alpha x max(bbox h, w) of the target object, over every keypoint "
                   f"({STAR}; dashed = a uniformly random target token)" + variant_note(df))


def retrieval(df: pd.DataFrame) -> Figures:
    """mAP (Medium, Hard, Easy) per layer, model and token view."""
    views = list(dict.fromkeys(df["token_view"].dropna()))
    rows = [(f" ({v})", df[df.token_view == v]) for v in views]
    return _panels(df, [("mAP_medium", "mAP Medium"), ("mAP_hard", "mAP Hard"), ("mAP_easy", "mAP Easy")], rows,
                   nothing_above(df, "retrieval") + "Instance retrieval per layer (cosine of CLS / mean patch "
                   f"token, no training): revisited mAP ({STAR}; dashed = random rankings)" + variant_note(df))


FIGURES = {"propagation": propagation, "correspondence": correspondence, "retrieval": retrieval}


# ------------------------------------------------------------------------------------------------ summary


def _protocol(row: Any) -> str | None:
    """The protocol a task's table names (framing, model input, where and which frames were scored, the source's
    variants that ran), one line."""
    parts = [(None, "framing"), ("input", "input_size"), ("scored at", "scored_at"), ("frames", "frames_scored"),
             ("variant:", "variant")]
    text = [f"{k} {row.get(c)}" if k else str(row.get(c)) for k, c in parts
            if isinstance(row.get(c), str) and row.get(c)]
    return "; ".join(text) or None


NOT_ABOVE_CHANCE = "no layer above chance"
NOT_ABOVE_UNTRAINED = "not above the untrained model"


def best_layer_summary(tables: Mapping[str, pd.DataFrame], models: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """One row per (task, model): the best layer, its score and ``stderr``, the last layer's score, the chance
    level, whether the best score is above chance beyond noise (``above_chance``; ``best``: "block N", or "no
    layer above chance") and the protocol the task ran under (``protocol``: whole frame or centre crop, input
    size, ...), from the ``best_*`` rows of each task's table; ``models`` (the manifest's) adds each model's
    supervision and, for every trained model, the best score of a random-init model of the same architecture
    (depth, heads, grid, patch) in the same study. ``untrained``: whether the model is an untrained baseline (the
    manifest's family, as `vitscope.report.summary.untrained_models`, or the figure context's); ``untrained_score``:
    the score a trained model is judged against (the same-architecture random-init model's, else the best of the
    task's untrained models); ``finding``: above chance and above that score beyond the interval
    (`vitscope.report.summary.best_row_is_finding`), what the heat table colours; ``best`` says
    `NOT_ABOVE_UNTRAINED` for a trained model above chance but not above it."""
    models = dict(models or {})
    rows = []
    for task, (metric, label) in TASKS.items():
        df = tables.get(task)
        if df is None or df.empty:
            continue
        best = df[df.metric == f"best_{metric}"]
        for _, r in best.iterrows():
            score, chance = float(r["value"]), float(r.get("chance", np.nan))
            stderr = float(r["stderr"]) if "stderr" in r and pd.notna(r["stderr"]) else np.nan
            above = best_above_chance(r)
            rows.append({"task": task, "label": label, "model": r["model"], "best_layer": int(r["layer"]),
                         "best": f"block {int(r['layer'])}" if above else NOT_ABOVE_CHANCE,
                         "token_view": r["token_view"], "score": score, "stderr": stderr,
                         "score_lo": best_row_low(r), "score_hi": float(r.get("value_hi", np.nan)),
                         "last_layer_score": float(r.get("last_layer_value", np.nan)),
                         "chance": chance, "above_chance": above, "protocol": _protocol(r),
                         **({"random_features_score": float(r["random_features"])}
                            if pd.notna(r.get("random_features", np.nan)) else {})})
    if tables.get("semantics") is not None and rows:  # k-NN beside the dense tasks, as the paper's Table 1
        rows += knn_best_rows(tables["semantics"])
    out = pd.DataFrame(rows)
    if out.empty:
        return out

    def arch(m: str) -> tuple:
        d = models.get(m, {})
        return (d.get("depth"), d.get("heads"), tuple(d.get("grid") or ()), d.get("patch"))

    out["supervision"] = [models.get(m, {}).get("supervision") for m in out.model]
    random_score = []
    for _, r in out.iterrows():
        peers = [m for m, d in models.items() if d.get("supervision") == "random init" and m != r.model
                 and arch(m) == arch(r.model) and arch(m) != (None, None, (), None)]
        s = out[(out.task == r.task) & out.model.isin(peers)].score
        random_score.append(float(s.max()) if len(s) and r.supervision != "random init" else np.nan)
    out["random_init_score"] = random_score
    untrained = set(untrained_models({"models": models})) | current().untrained
    out["untrained"] = out.model.isin(untrained)
    base = []
    for _, r in out.iterrows():
        peers = out[(out.task == r.task) & out.untrained & (out.model != r.model)].score
        base.append(np.nan if r.untrained else r.random_init_score if np.isfinite(r.random_init_score)
                    else float(peers.max()) if len(peers) else np.nan)
    out["untrained_score"] = base
    out["finding"] = [bool(r.above_chance and not r.untrained and is_finding(r.score_lo, np.nan, r.untrained_score))
                      for _, r in out.iterrows()]
    out.loc[out.above_chance & ~out.untrained & ~out.finding, "best"] = NOT_ABOVE_UNTRAINED
    return out


def knn_best_rows(df: pd.DataFrame, k: int = KNN_K) -> list[dict[str, Any]]:
    """Per model, the best layer of k-NN top-1 accuracy in a semantics table (its ``knn<k>_top1`` rows over the
    image-level views `KNN_VIEWS`; k = ``k``, else the smallest k there), as rows of `best_layer_summary`: the score,
    its ``stderr`` (binomial, over the test images), an interval simultaneous over the (layer, view) candidates
    (value ± z · stderr at level 1 - 0.05 / candidates, Bonferroni, as the dense tasks' `best_interval`), the last
    layer's score, ``chance`` = the majority-class rate of the test images, and ``random_features_score`` = the
    k-NN of Gaussian features of the same shape (the table's ``knn<k>_top1_chance`` row, Walmer et al.'s random
    baseline)."""
    from statistics import NormalDist

    if df is None or df.empty or "metric" not in df.columns:
        return []
    ks = sorted({int(m[3:-5]) for m in df.metric.dropna().unique() if m.startswith("knn") and m.endswith("_top1")
                 and m[3:-5].isdigit()})
    if not ks:
        return []
    k = k if k in ks else ks[0]
    metric = f"knn{k}_top1"
    views = df.token_view.isin(KNN_VIEWS) if "token_view" in df.columns else pd.Series(True, index=df.index)
    out = []
    for model, d in df[views].groupby("model", sort=False):
        cand = d[(d.metric == metric) & d.layer.notna() & d.value.notna()]
        if cand.empty:
            continue
        best = cand.sort_values(["value", "layer"], ascending=[False, True]).iloc[0]
        se = float(best.get("stderr", np.nan))
        z = NormalDist().inv_cdf(1 - 0.05 / (2 * len(cand)))
        lo, hi = float(best.value) - z * se, float(best.value) + z * se
        chance = float(best.get("chance", np.nan))
        row = {"value": float(best.value), "value_lo": lo, "stderr": se, "chance": chance}
        last = cand[(cand.layer == cand.layer.max()) & (cand.token_view == best.token_view)].value
        rand = d[(d.metric == f"{metric}_chance") & (d.token_view == best.token_view)].value
        above = best_above_chance(row)
        out.append({"task": KNN_TASK, "label": KNN_LABEL, "model": model, "best_layer": int(best.layer),
                    "best": f"block {int(best.layer)}" if above else NOT_ABOVE_CHANCE,
                    "token_view": best.token_view, "score": float(best.value), "stderr": se, "score_lo": lo,
                    "score_hi": hi, "last_layer_score": float(last.iloc[0]) if len(last) else np.nan,
                    "chance": chance, "above_chance": above, "protocol": f"semantics k-NN, k = {k}",
                    "random_features_score": float(rand.iloc[0]) if len(rand) else np.nan})
    return out


def _summary_labels() -> dict[str, str]:
    """Task -> label of every row kind of the best-layer summary, in its order (dense tasks, then k-NN)."""
    return {**{t: label for t, (_, label) in TASKS.items()}, KNN_TASK: KNN_LABEL}


def summary_figure(summary: pd.DataFrame) -> Figures:
    """Task x model heat table: each cell the best layer's score and the block it is at ("at chance" where the best
    score is within noise of chance, "≈ untrained" where it is not above the untrained model's beyond its interval,
    "untrained" for the reference itself); colour only where the cell is a finding (``finding`` of
    `best_layer_summary`): the score's distance from chance as a share of the way from chance to 1, diverging
    around chance (below chance shows as such); every other cell grey and hatched."""
    if summary.empty:
        return []
    from matplotlib.colors import CenteredNorm
    from matplotlib.patches import Rectangle

    labels = _summary_labels()
    tasks = [t for t in labels if t in set(summary.task)]
    models = list(dict.fromkeys(summary.model))
    gain = np.full((len(tasks), len(models)), np.nan)
    text = [["" for _ in models] for _ in tasks]
    muted: list[tuple[int, int]] = []  # cells that are no finding: grey, hatched
    for _, r in summary.iterrows():
        i, j = tasks.index(r.task), models.index(r.model)
        c = r.chance if np.isfinite(r.chance) else 0.0
        where = r.best if "best" in r and isinstance(r.best, str) else f"block {r.best_layer}"
        finding = bool(r.finding) if "finding" in r and pd.notna(r.finding) else where != NOT_ABOVE_CHANCE
        if finding:
            gain[i, j] = (r.score - c) / max(1 - c, 1e-9)
        else:
            muted.append((i, j))
            where = ("untrained" if "untrained" in r and bool(r.untrained) else
                     "at chance" if where == NOT_ABOVE_CHANCE else "≈ untrained" if where == NOT_ABOVE_UNTRAINED
                     else where)
        text[i][j] = f"{r.score:.2f}\n" + ("at chance" if where == NOT_ABOVE_CHANCE else where)
    fig, ax = plt.subplots(figsize=(1.4 + 1.05 * len(models), 1.4 + 0.75 * len(tasks)), layout="constrained")
    top = float(np.nanmax(np.abs(gain))) if np.isfinite(gain).any() else 0.0
    norm = CenteredNorm(0.0, halfrange=top if top > 1e-6 else 1.0)  # nothing coloured: the whole way to 1
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.93")
    im = ax.imshow(gain, cmap=cmap, norm=norm, aspect="auto")
    for i, j in muted:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="0.78", lw=0,
                               gid="no-finding"))
    for i in range(len(tasks)):
        for j in range(len(models)):
            if text[i][j]:
                dark = np.isfinite(gain[i, j]) and abs(norm(gain[i, j]) - 0.5) > 0.3
                ax.text(j, i, text[i][j], ha="center", va="center", fontsize=6.5,
                        color="white" if dark else "0.25" if (i, j) in muted else "black")
    ax.set_xticks(range(len(models)), models, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(tasks)), [labels[t] for t in tasks], fontsize=8)
    colorbar(fig, im, ax, "(score - chance) / (1 - chance)\n(0 = chance, < 0 below)")
    trained = summary[~summary.untrained] if "untrained" in summary.columns else summary
    lead = ""
    if len(trained) and not trained["above_chance"].any():
        lead = ("Nothing here is above chance: no trained model's best layer clears its task's chance level beyond its "
                "95 % interval (simultaneous over the layers), so no layer is ranked. ")
    elif "finding" in trained.columns and len(trained) and not trained["finding"].any():
        lead = ("Nothing here is above the untrained model: no trained model's best layer clears the untrained "
                "model's best beyond its 95 % interval, so no layer is ranked. ")
    return [(lead + "Best layer per task and model, no training (after Walmer et al., CVPR 2023, Table 1): the best "
             "block's score and where it is; coloured only where it clears both the task's chance level and the "
             "untrained model's best score beyond its 95 % interval (simultaneous over the layers), else grey and "
             "hatched: \"at chance\" (within noise of chance, or below it), \"≈ untrained\" (not above the untrained "
             "model), \"untrained\" (the reference itself); colour = the score's distance from chance (blue: below "
             "chance)", fig)]


__all__ = ["FIGURES", "KNN_TASK", "NOT_ABOVE_CHANCE", "NOT_ABOVE_UNTRAINED", "TASKS", "best_above_chance",
           "best_layer_summary", "knn_best_rows", "nothing_above", "summary_figure", "variant_note"]
