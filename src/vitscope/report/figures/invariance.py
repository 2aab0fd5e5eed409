"""Figures of the invariance lens (`vitscope.analyses.invariance`, Merlin et al., "What happens during finetuning
of ViTs: an invariance based investigation"): learning / forgetting / cka divergence per layer and the
Invariance Flow matrix, one panel per pretrained -> fine-tuned pair (for a checkpoint list: its last epoch),
and the dynamics over a run's epochs with their Pearson correlation to accuracy on corrupted data."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from vitscope.report.figures._common import Figures, colorbar, grid_layout, legend_outside, plt


def _pairs(df: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(A, B, rows) per pair; of a checkpoint list (B@epoch) only the last epoch."""
    d = df[df["model_b"].notna()]
    out, last = [], {}
    for (a, b), g in d.groupby(["model", "model_b"], sort=False):
        run, _, ep = str(b).partition("@")
        e = float(ep) if ep.replace(".", "", 1).isdigit() else -1.0
        key = (a, run)
        if key not in last or e > last[key][0]:
            last[key] = (e, b, g)
    for (a, _), (_, b, g) in last.items():
        out.append((a, b, g))
    return out


def _settings(g: pd.DataFrame) -> str:
    r = g.iloc[0]
    def get(c: str) -> object:
        v = r[c] if c in g.columns and pd.notna(r[c]) else "?"
        return f"{v:g}" if isinstance(v, float) else v
    return (f"{get('images')} images, {get('iterations')} inversion iterations (step {get('step_size')}), "
            f"{get('repeats')} repeat(s), {get('token_view')} token view"
            + (f", {get('cka_estimator')} CKA" if "cka_estimator" in g.columns else ""))


def _panels(n: int, w: float = 3.3, h: float = 2.8, **kw: object) -> tuple[plt.Figure, np.ndarray]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols + 0.4, h * rows + 0.3), squeeze=False, **kw)
    return fig, axes


def _fidelity(pairs: list[tuple[str, str, pd.DataFrame]]) -> str:
    """The inversions' fidelity per model of each pair (CKA of a layer on the images and on their inversions, the
    range over the blocks): how much of 1 - STIR the inversions alone account for."""
    parts = []
    for a, b, g in pairs:
        for side, m in (("a", a), ("b", b)):
            f = g[g.metric == f"fidelity_{side}"]["value"].astype(float)
            if f.notna().any():
                parts.append(f"{m} {f.min():.2f}-{f.max():.2f}")
    return ("Inversion fidelity (CKA of a block on the images and on their inversions, over the blocks): "
            + "; ".join(dict.fromkeys(parts)) + ".") if parts else ""


RAW = (("learning", "learning"), ("forgetting", "forgetting"), ("cka_divergence", "cka divergence"))
VS_SELF = (("learning_vs_self", "learning (vs self)"), ("forgetting_vs_self", "forgetting (vs self)"),
           ("cka_divergence", "cka divergence"))


def stir(df: pd.DataFrame, raw: bool = False) -> Figures:
    """Learning / forgetting per block, floor-corrected (``*_vs_self``: the inversions' own STIR as the first term)
    by default; the raw 1 - STIR with ``raw=True``, or where the table has no ``*_vs_self`` rows (e.g.
    ``vitscope.plot(run, "stir", metric=["learning", "forgetting", "cka_divergence"])``); then the Invariance Flow
    matrices and the dynamics over epochs."""
    out: Figures = []
    pairs = _pairs(df)
    if not pairs:
        return out
    # learning / forgetting / cka divergence per layer
    raw = raw or not df.metric.isin(["learning_vs_self", "forgetting_vs_self"]).any()
    metrics = RAW if raw else VS_SELF
    fig, axes = _panels(len(pairs))
    shown = pd.concat([g[g.metric.isin([m for m, _ in metrics])] for _, _, g in pairs])
    values = shown["value"].astype(float) if len(shown) else pd.Series([0.0, 1.0])
    top, bottom = max(float(np.nanmax(values)), 0.05), min(float(np.nanmin(values)), 0.0)
    pad = 0.05 * (top - bottom)
    for ax, (a, b, g) in zip(axes.flat, pairs, strict=False):
        for k, (metric, label) in enumerate(metrics):
            d = g[g.metric == metric].sort_values("layer")
            ax.plot(d["layer"].astype(int), d["value"].astype(float), "-o", ms=3, color=f"C{k}", label=label)
        ax.axhline(0, color="0.6", lw=0.8)
        ax.set_title(f"{a} ->\n{b}", fontsize=8)
        ax.set_xlabel("block", fontsize=8)
        if ax is axes.flat[0]:  # one scale for every pair: the first panel names it
            ax.set_ylabel("1 - STIR, 1 - CKA" if raw else "STIR gain / loss, 1 - CKA", fontsize=8)
        ax.set_ylim(bottom - pad, top + pad)  # one scale for every pair: panels compare
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(pairs):]:
        ax.set_axis_off()
    grid_layout(fig, left=0.5, right=0.15, top=0.35, bottom=0.5, wspace=0.3, hspace=0.55)
    legend_outside(fig)  # beside the panels, never over a curve
    what = ("Learning (1 - STIR(pt[i] | ft[i])), forgetting (1 - STIR(ft[i] | pt[i]))" if raw else
            "Learning (STIR(ft[i] | ft[i]) - STIR(pt[i] | ft[i])) and forgetting (STIR(pt[i] | pt[i]) - STIR(ft[i] | "
            "pt[i])), floor-corrected: the first term measured on the same inversions, so imperfect inversions cancel "
            "(raw 1 - STIR: vitscope.plot(run, 'stir', metric=['learning', 'forgetting', 'cka_divergence'])),")
    out.append((f"{what} and cka divergence (1 - CKA(ft[i], pt[i])) per block, one panel per pretrained -> "
                f"fine-tuned pair (Merlin et al. eqs. 2-4); {_settings(pairs[0][2])}. {_fidelity(pairs)}", fig))
    # Invariance Flow matrices
    flows = [(a, b, g[g.metric == "invariance_flow"]) for a, b, g in pairs]
    flows = [f for f in flows if len(f[2])]
    if flows:
        fig, axes = _panels(len(flows), 3.2, 3.0, layout="constrained")
        vmax = max(float(np.nanmax(np.abs(f[2]["value"].astype(float)))) for f in flows) or 1.0
        im = None
        notes = []
        for ax, (a, b, f) in zip(axes.flat, flows, strict=False):
            mat = f.pivot_table(index="layer", columns="layer_b", values="value")
            im = ax.imshow(mat.values, origin="lower", cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            ax.set_xticks(range(mat.shape[1]), [int(c) for c in mat.columns], fontsize=6)
            ax.set_yticks(range(mat.shape[0]), [int(c) for c in mat.index], fontsize=6)
            ax.set_xlabel(f"fine-tuned block j ({b})", fontsize=7)
            ax.set_ylabel(f"pretrained block i ({a})", fontsize=7)
            s = pairs[[p[1] for p in pairs].index(b)][2]
            comp = s[s.metric == "flow_compression"]["value"]
            exp_ = s[s.metric == "flow_expansion"]["value"]
            if len(comp) and len(exp_):
                notes.append(f"{a} -> {b}: compression {float(comp.iloc[0]):.3f}, expansion {float(exp_.iloc[0]):.3f}")
        for ax in list(axes.flat)[len(flows):]:
            ax.set_axis_off()
        colorbar(fig, im, axes, "flow (STIR difference)")
        out.append(("Invariance Flow matrix STIR(ft[j] | pt[i]) - STIR(ft[i] | pt[i]) (Merlin et al. eq. 5), block i "
                    "of the pretrained model up the y axis, block j of the fine-tuned one along the x axis: red above "
                    "the diagonal (upper left, j < i) = invariances of pretrained block i found in a shallower "
                    "fine-tuned block (compression), red below it (lower right, j > i) = expansion. "
                    + "; ".join(notes) + ".", fig))
    # dynamics over epochs
    dyn = df[df.metric.astype(str).str.startswith("dynamics:")]
    if len(dyn) and "epoch" in dyn.columns:
        runs = list(dyn.groupby(["model", "model_b"], sort=False))
        fig, axes = _panels(len(runs), 3.6, 2.9)
        caps = []
        for ax, ((a, b), g) in zip(axes.flat, runs, strict=False):
            for k, name in enumerate(("forgetting_mean", "learning_mean", "forgetting_std_from_layer2",
                                      "cka_divergence_mean")):
                d = g[g.metric == f"dynamics:{name}"].sort_values("epoch")
                ax.plot(d["epoch"].astype(float), d["value"].astype(float), "-o", ms=3, color=f"C{k}", label=name)
            acc = g[g.metric == "dynamics:corrupted_accuracy"].sort_values("epoch")
            if acc["value"].notna().any():
                ax2 = ax.twinx()
                ax2.plot(acc["epoch"].astype(float), acc["value"].astype(float), "--s", ms=3, color="k",
                         label="corrupted accuracy")
                ax2.set_ylabel("accuracy (corrupted)", fontsize=7)
            ax.set_title(f"{a} -> {b}", fontsize=8)
            ax.set_xlabel("epoch", fontsize=8)
            ax.grid(alpha=0.3)
            pr = df[(df.metric == "pearson_r") & (df.model == a) & (df.model_b == b)]
            pp = df[(df.metric == "pearson_p") & (df.model == a) & (df.model_b == b)]
            for series in ("forgetting_std_from_layer2", "forgetting_mean", "learning_mean", "cka_divergence_std",
                           "clean_accuracy"):
                r = pr[pr.series == series]["value"]
                p = pp[pp.series == series]["value"]
                if len(r):
                    base = " (the baseline: clean accuracy itself)" if series == "clean_accuracy" else ""
                    caps.append(f"{b}: r({series}, corrupted accuracy) = {float(r.iloc[0]):.2f} "
                                f"(p = {float(p.iloc[0]):.2g}){base}")
        for ax in list(axes.flat)[len(runs):]:
            ax.set_axis_off()
        grid_layout(fig, left=0.5, right=0.7, top=0.35, bottom=0.5, wspace=0.55, hspace=0.55)
        legend_outside(fig)  # beside the panels, never over a curve
        out.append(("Fine-tuning dynamics: the metrics per epoch (lines) and the mean accuracy over the corruptions "
                    "(dashed, right axis), Merlin et al. Sec. 4.4; Pearson over the epochs: "
                    + ("; ".join(caps) if caps else "not computed (fewer than 3 epochs, or a constant series)")
                    + ".", fig))
    out += _hypothesis_table(df) + _up_to_epoch(df)
    return out


#: hypotheses shown per fine-tuning run (by |r|), beside the paper's
TOP_HYPOTHESES = 10


def _hypothesis_table(df: pd.DataFrame) -> list[tuple[str, plt.Figure]]:
    """Merlin et al. App. E.1 per fine-tuning run: the hypotheses of largest |r| with the target and the paper's
    (marked), with p and the Bonferroni-corrected p, as a table."""
    h = df[df.metric == "hypothesis"]
    if not len(h):
        return []
    out = []
    for (a, b), g in h.groupby(["model", "model_b"], sort=False):
        g = g.assign(absr=g["value"].astype(float).abs())
        top = g[g["absr"].notna()].sort_values("absr", ascending=False).head(TOP_HYPOTHESES)
        paper = g[g["paper"].astype(bool)]
        rows = pd.concat([top, paper[~paper.index.isin(top.index)]])
        cells = [[("* " if bool(r["paper"]) else "") + f"{r['aggregate']}({r['quantity']})", str(r["layers"]),
                  f"{float(r['value']):.3f}", f"{float(r['p']):.2g}", f"{float(r['p_bonferroni']):.2g}",
                  str(int(r["hypotheses"]))] for _, r in rows.iterrows()]
        fig, ax = plt.subplots(figsize=(7.2, 0.3 * len(cells) + 0.6))
        ax.set_axis_off()
        t = ax.table(cellText=cells, colLabels=["hypothesis", "layers", "r", "p", "Bonferroni p", "of"],
                     loc="center", cellLoc="left")
        t.auto_set_font_size(False)
        t.set_fontsize(7)
        t.auto_set_column_width(list(range(6)))
        n = int(g.get("epochs", pd.Series([math.nan])).iloc[0]) if "epochs" in g.columns else 0
        target = str(g["target"].iloc[0]) if "target" in g.columns else "corrupted_accuracy"
        out.append((f"{a} -> {b}: Merlin et al.'s hypothesis search (App. E.1), Pearson r over {n} epochs of each "
                    f"aggregate (mean, std, min, max over the first / last n layers, 1-based) of learning, "
                    f"forgetting, their sum and difference ({_count(g, 'learning_forgetting')} "
                    f"hypotheses) and of cka divergence ({_count(g, 'cka_divergence')}) with "
                    f"{target.replace('_', ' ')}: the {TOP_HYPOTHESES} of largest |r| and, marked *, the ones the "
                    "paper reports (std of forgetting over layers 2..L; std of cka divergence over layers 1-8). "
                    "Bonferroni p = p x the family's count, capped at 1: only below 0.05 does a hypothesis survive "
                    "the search.", fig))
    return out


def _count(g: pd.DataFrame, family: str) -> int:
    """Hypotheses of a family tested (column ``hypotheses``: constant series have no row but count)."""
    v = g[g.family == family]["hypotheses"]
    return int(v.iloc[0]) if len(v) else 0


def _up_to_epoch(df: pd.DataFrame) -> list[tuple[str, plt.Figure]]:
    """Merlin et al. Fig. 14: r of the std of forgetting over layers 2..L with the target, over the epochs up to
    each epoch, one line per fine-tuning run."""
    u = df[df.metric == "pearson_up_to_epoch"]
    if not len(u):
        return []
    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    for k, ((a, b), g) in enumerate(u.groupby(["model", "model_b"], sort=False)):
        g = g.sort_values("epoch")
        ax.plot(g["epoch"].astype(float), g["value"].astype(float), "-o", ms=3, color=f"C{k}", label=f"{a} -> {b}")
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("up to epoch", fontsize=8)
    ax.set_ylabel("Pearson r", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    target = str(u["target"].iloc[0]).replace("_", " ") if "target" in u.columns else "corrupted accuracy"
    return [(f"Correlation of the std of forgetting over layers 2..L with {target}, computed over the epochs up to "
             "the one on the x axis (Merlin et al. Fig. 14; from 3 epochs): a strong r on the early epochs alone "
             "means the correlation is not only the end of training's plateau.", fig)]


FIGURES = {"stir": stir}
