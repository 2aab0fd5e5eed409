"""Figures of the robustness analyses (`vitscope.analyses.robustness`): shape bias, frequency-band noise,
corruptions. One figure per kind, a panel per model where panels are per model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from vitscope.analyses.robustness import decision_rows
from vitscope.metrics.robustness import accuracy_interval
from vitscope.report.figures._common import (
    Figures,
    current,
    grid_layout,
    legend_outside,
    model_color,
    model_label,
    models_of,
    not_computed,
    plt,
)


def _at_chance(df: pd.DataFrame) -> list[str]:
    """Models whose decision (head, else last-layer probe) is at chance: rows with a ``reason``."""
    if "reason" not in df.columns:
        return []
    d = _last(df)
    return list(dict.fromkeys(d[d["reason"].notna()]["model"]))


def _chance_note(models: list[str]) -> str:
    return (f" Not reported, the readout's clean accuracy within noise of chance: {', '.join(models)}."
            if models else "")


def _last(df: pd.DataFrame) -> pd.DataFrame:
    """Per model, the rows of its decision: the head where there is one, else the last layer's probe."""
    return decision_rows(df, head_only=True, column="where")


WITHIN_NOISE_GID = "within-noise"


def _yerr(g: pd.DataFrame) -> np.ndarray | None:
    """(2, n) distances from each row's value to its 95 % interval's ends (``value_lo``, ``value_hi``), for
    ``errorbar``; None when the table carries none."""
    if not {"value_lo", "value_hi"} <= set(g.columns) or g["value_lo"].isna().all():
        return None
    v = g["value"].to_numpy(dtype=float)
    return np.nan_to_num(np.clip(np.stack([v - g["value_lo"].to_numpy(dtype=float),
                                           g["value_hi"].to_numpy(dtype=float) - v]), 0, None))


def _n_of(g: pd.DataFrame) -> str:
    """"n = N": the images the rows' accuracies are on (a range where they differ)."""
    n = pd.to_numeric(g["n_images"], errors="coerce").dropna().astype(int) if "n_images" in g.columns else []
    if not len(n):
        return "n unknown"
    return f"n = {n.min()}" if n.min() == n.max() else f"n = {n.min()}-{n.max()}"


def _n_note(d: pd.DataFrame) -> str:
    """A sentence naming the test images behind each model's probe values, and what one image is worth."""
    if "n_images" not in d.columns or d.empty:
        return ""
    ns = pd.to_numeric(d["n_images"], errors="coerce")
    per = {m: int(v) for m, v in ns.groupby(d["model"], sort=False).max().dropna().items()}
    if not per:
        return ""
    each = (f"n = {next(iter(per.values()))} test images each" if len(set(per.values())) == 1
            else "n test images " + ", ".join(f"{m} {v}" for m, v in per.items()))
    return f"Probes tested on {each} (one image moves an accuracy by {1 / max(min(per.values()), 1):.3f})."


def _interval_of(rows: pd.DataFrame) -> tuple[float, float] | None:
    """(low, high) of a row's 95 % interval, when the table carries one."""
    if not {"value_lo", "value_hi"} <= set(rows.columns) or not len(rows):
        return None
    lo, hi = float(rows["value_lo"].iloc[0]), float(rows["value_hi"].iloc[0])
    return (lo, hi) if np.isfinite(lo) and np.isfinite(hi) else None


def shape_bias(df: pd.DataFrame) -> Figures:
    """Left: the models' shape bias on one axis (Geirhos et al. 2019, Fig. 4 / model-vs-human's plot): head
    (filled) and last-layer probe (open), with their 95 % intervals; right: the probes' shape bias per block with
    its band, for every model whose probe is above chance somewhere, the untrained models in grey (their level is
    the reference) and the 0.5 line (no preference). Models whose probe is at chance at every block are named,
    not drawn."""
    d = df[df.metric == "shape_bias"]
    if d.empty:
        return []
    models = models_of(d)
    probe = d[d.readout == "probe"] if "readout" in d.columns else d.iloc[:0]
    never = [m for m in models if len(probe[probe.model == m]) and probe[probe.model == m]["value"].isna().all()
             and not d[(d.model == m) & (d.readout == "head")]["value"].notna().any()]
    some = [m for m in models if m not in never and probe[probe.model == m]["value"].isna().any()]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.32 * max(len(models), 4)),
                                  gridspec_kw={"width_ratios": [1, 1.3]})
    for k, m in enumerate(models):
        g = d[d.model == m]
        color = model_color(m, models)
        head = g[g.readout == "head"] if "readout" in g.columns else g.iloc[:0]
        per = probe[probe.model == m]
        if len(head) and np.isfinite(float(head["value"].iloc[0])):
            ax.plot([float(head["value"].iloc[0])], [k], "o", color=color, ms=7)
            iv = _interval_of(head)
            if iv:
                ax.plot(iv, [k, k], "-", color=color, lw=1.5)
        if len(per):
            last = per.loc[[pd.to_numeric(per["layer"]).idxmax()]]
            if np.isfinite(float(last["value"].iloc[0])):
                ax.plot([float(last["value"].iloc[0])], [k + 0.15], "o", mfc="none", color=color, ms=7)
                iv = _interval_of(last)
                if iv:
                    ax.plot(iv, [k + 0.15, k + 0.15], ":", color=color, lw=1.2)
            elif not len(head):
                ax.text(0.02, k, "last-block probe at chance: no shape bias", fontsize=6.5, va="center",
                        color="0.35")
        if len(per) and m not in never:
            per = per.assign(layer=pd.to_numeric(per["layer"])).sort_values("layer")
            untrained = m in current().untrained
            ax2.plot(per["layer"], per["value"], "--o" if untrained else "-o", ms=3, color=color,
                     label=model_label(m), zorder=3 if untrained else 2)
            if {"value_lo", "value_hi"} <= set(per.columns) and per["value_lo"].notna().any():
                ax2.fill_between(per["layer"].astype(float), per["value_lo"].astype(float),
                                 per["value_hi"].astype(float), color=color, alpha=0.08, lw=0)
    ax.set_yticks(range(len(models)), [model_label(m) for m in models], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.axvline(0.5, color="0.6", lw=0.8, ls=":")
    ax.set_xlabel("fraction of shape decisions (0 = texture, 1 = shape)")
    ax.set_title("decision (filled: head, open: last-block probe)", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    ax2.set_ylim(0, 1)
    ax2.axhline(0.5, color="0.6", lw=0.8, ls=":", label="0.5: no preference")
    ax2.set_xlabel("block")
    ax2.set_ylabel("shape bias (probe)")
    ax2.set_title("probe per block", fontsize=9)
    ax2.grid(alpha=0.3)
    if len(probe) and probe["value"].isna().all():
        not_computed(ax2, "every probe's clean accuracy is within noise of chance: no shape bias from a probe")
    elif never:
        ax2.text(0.02, 0.03, "at chance at every block (not drawn): " + ", ".join(model_label(m) for m in never),
                 transform=ax2.transAxes, fontsize=6.5, color="0.35", va="bottom", wrap=True)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.set_layout_engine("constrained")
    untrained = [m for m in models if m in current().untrained and m not in never]
    note = ((f" Grey, dashed: the untrained {', '.join(untrained)}, the level training is judged against."
             if untrained else "")
            + (f" Probes at chance at every block (their clean accuracy within noise of chance, no shape bias): "
               f"{', '.join(never)}." if never else "")
            + (f" Gaps: blocks where the probe's clean accuracy is within noise of chance ({', '.join(some)})."
               if some else ""))
    out = [("Shape vs texture bias on cue-conflict images: among decisions for the shape or the texture class, "
            "the fraction for the shape, with its 95 % interval over those decisions (left: lines; right: bands) "
            "(Geirhos et al., ICLR 2019; Park et al., ICLR 2023); dotted line: 0.5, no preference." + note, fig)]
    return out + _shape_bias_categories(df)


def _category_decisions(df: pd.DataFrame) -> pd.DataFrame:
    """The ``shape_bias_category`` rows of each model's decision: its head's where it has them, else its
    last-block probe's."""
    d = df[df.metric == "shape_bias_category"]
    keep = []
    for m in models_of(d):
        g = d[d.model == m]
        head = g[g.readout == "head"]
        if len(head):
            keep.append(head)
            continue
        probe = g[g.readout == "probe"]
        if len(probe):
            layer = pd.to_numeric(probe["layer"])
            keep.append(probe[layer == layer.max()])
    return pd.concat(keep) if keep else d.iloc[:0]


def _shape_bias_categories(df: pd.DataFrame) -> Figures:
    """Per shape category, each model's shape bias as a point (head, else last-block probe) and the model's mean
    over the categories as a vertical line, categories as rows (Geirhos et al. 2019 Fig. 4; Park et al. 2023)."""
    d = _category_decisions(df)
    if d.empty:
        return []
    models = models_of(d)
    cats = list(dict.fromkeys(d["category"].astype(str)))
    fig, ax = plt.subplots(figsize=(6.2, 0.9 + 0.28 * max(len(cats), 4)), layout="constrained")
    for k, m in enumerate(models):
        g = d[d.model == m]
        color = model_color(m, models)
        ys = [cats.index(str(c)) + (k - (len(models) - 1) / 2) * 0.8 / max(len(models), 1) for c in g["category"]]
        vals = g["value"].astype(float).to_numpy()
        ax.plot(vals, ys, "o", color=color, ms=4, alpha=0.9, label=model_label(m))
        if np.isfinite(vals).any():
            ax.axvline(float(np.nanmean(vals)), color=color, lw=1.2)
    ax.set_yticks(range(len(cats)), cats, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(-0.02, 1.02)
    ax.axvline(0.5, color="0.6", lw=0.8, ls=":")
    ax.set_xlabel("fraction of shape decisions (0 = texture, 1 = shape)")
    ax.grid(alpha=0.3, axis="x")
    legend_outside(fig)
    readouts = ", ".join(sorted(set(d["readout"].astype(str))))
    return [("Shape bias per category (the shape class of the cue-conflict image): a point per category and model "
             f"({readouts}: a model's head where it has one, else its last-block probe), the model's mean over the "
             "categories as a vertical line (Geirhos et al., ICLR 2019, Fig. 4; Park et al., ICLR 2023); dotted: "
             "0.5, no preference. Categories with no shape or texture decision are not drawn.", fig)]


def band_noise(df: pd.DataFrame) -> Figures:
    """Heat map of the accuracy drop (band x layer) per model, and the drop per band at each model's last
    layer (or head), all models on one axis."""
    d = df[(df.metric == "drop")]
    if d.empty:
        return []
    out: Figures = []
    probe = d[d.readout == "probe"]
    models = list(dict.fromkeys(probe["model"]))
    if models:
        cols = min(4, len(models))
        rows = math.ceil(len(models) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols + 0.8, 2.6 * rows), squeeze=False)
        vmax = max(float(np.nan_to_num(np.nanmax(np.abs(probe["value"].to_numpy(dtype=float))))), 1e-3) \
            if probe["value"].notna().any() else 1e-3
        im = None
        for k, m in enumerate(models):
            ax = axes[k // cols][k % cols]
            g = probe[probe.model == m].assign(layer=lambda x: pd.to_numeric(x["layer"]))
            grid = g.pivot_table(index="band", columns="layer", values="value").sort_index()
            ax.set_title(model_label(m, lines=True), fontsize=9)
            if grid.isna().all().all():
                not_computed(ax, "the probe is at chance at every block: no drop", width=22)
                continue
            im = ax.imshow(grid.to_numpy(dtype=float), origin="lower", aspect="auto", cmap="RdBu_r", vmin=-vmax,
                           vmax=vmax, extent=(grid.columns.min() - 0.5, grid.columns.max() + 0.5,
                                              grid.index.min() - 0.5, grid.index.max() + 0.5))
            noise = g[(g["value_lo"] <= 0) & (g["value_hi"] >= 0)] if "value_lo" in g.columns else g.iloc[:0]
            if len(noise):  # a drop whose 95 % interval holds 0: no drop beyond noise
                ax.plot(noise["layer"].astype(float), noise["band"].astype(float), "o", ms=2.5, mfc="0.2", mec="none",
                        ls="none", gid=WITHIN_NOISE_GID)
            ax.set_xlabel("block")
            ax.set_ylabel("band (low -> high freq.)")
        for k in range(len(models), rows * cols):
            axes[k // cols][k % cols].axis("off")
        grid_layout(fig, right=1.1, top=0.5)
        if im is not None:
            w = fig.get_size_inches()[0]
            cax = fig.add_axes((1 - 0.9 / w, 0.15, 0.12 / w, 0.7))
            fig.colorbar(im, cax=cax, label="accuracy drop")
        out.append(("Accuracy drop under frequency-band noise (probe per block; red = accuracy lost), band 0 = lowest "
                    "frequencies (Park et al., ICLR 2023); dot: a drop within noise of none (its 95 % interval, "
                    "paired over the same test images, holds 0); blank: the probe's clean accuracy is within noise of "
                    f"chance there, so no drop is reported. {_n_note(probe)}", fig))
    last = _last(d)
    if len(last):
        fig, ax = plt.subplots(figsize=(6.2, 3.2), layout="constrained")
        models = list(dict.fromkeys(last["model"]))
        for k, (m, g) in enumerate(last.groupby("model", sort=False)):
            g = g.sort_values("band")
            if g["value"].isna().all():
                continue
            x = g["band_low"].to_numpy(dtype=float) + 0.05 + 0.006 * (k - (len(models) - 1) / 2)  # bars apart
            ax.errorbar(x, g["value"].to_numpy(dtype=float), yerr=_yerr(g), fmt="-o", ms=3, lw=1, elinewidth=0.8,
                        capsize=1.5, color=model_color(m, models),
                        label=f"{model_label(m)} ({g['where'].iloc[0]}, {_n_of(g)})")
        ax.axhline(0, color="0.6", lw=0.8)
        ax.set_xlabel("noise frequency (x pi rad / pixel, band centre)")
        ax.set_ylabel("accuracy drop (95 % interval)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        out.append(("Accuracy drop per noise band at each model's decision (head, else last-layer probe): "
                    "low-frequency vs high-frequency fragility. Bars: 95 % interval of the drop, paired over the same "
                    "test images and valid however an image's clean and noisy decisions go together (Newcombe's "
                    "paired score interval at the least correlation the accuracies allow); n = the images each "
                    "accuracy is on (legend)." + _chance_note(_at_chance(d)), fig))
    return out


def corruptions(df: pd.DataFrame) -> Figures:
    """Accuracy vs severity (mean over the corruptions of each family) at each model's decision, and the mean
    corruption accuracy per layer (probes)."""
    d = df[df.metric == "accuracy"]
    if d.empty:
        return []
    last = _last(d)
    fams = [f for f in ("noise", "blur", "weather", "digital", "held-out") if (last["family"] == f).any()]
    panels = ["all", *fams]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(2.9 * (len(panels) + 1) + 1.2, 2.9), squeeze=False,
                             layout="constrained")
    models = list(dict.fromkeys(df["model"]))
    at_chance = _at_chance(df[df.metric == "relative_drop"])
    for p, fam in enumerate(panels):
        ax = axes[0][p]
        for m, g in last.groupby("model", sort=False):
            clean = g[g.severity == 0]["value"].mean()
            sel = g[(g.severity > 0) & ((g.family == fam) if fam != "all" else True)]
            per = sel.groupby("severity")["value"].mean()
            xs, ys = [0, *per.index.astype(int)], [clean, *per.values]
            ns = pd.to_numeric(g["n_images"], errors="coerce").dropna() if "n_images" in g.columns else []
            n = int(ns.max()) if len(ns) else 0
            # a mean over the family's corruptions of the same n images: its Wilson interval on n is conservative
            ivs = [accuracy_interval(float(y), n) for y in ys]
            yerr = np.nan_to_num(np.array([[y - iv["value_lo"] for y, iv in zip(ys, ivs, strict=True)],
                                           [iv["value_hi"] - y for y, iv in zip(ys, ivs, strict=True)]])).clip(0)
            chance = m in at_chance
            ax.errorbar(np.asarray(xs, dtype=float) + 0.04 * (list(models).index(m) - (len(models) - 1) / 2), ys,
                        yerr=yerr, fmt=":o" if chance else "-o", ms=3, lw=1, elinewidth=0.8,
                        capsize=1.5, color=model_color(m, models), alpha=0.5 if chance else 1,
                        label=f"{model_label(m)} ({g['where'].iloc[0]}, {f'n = {n}' if n else 'n unknown'}"
                              f"{', at chance' if chance else ''})")
        ax.set_title(f"{fam} corruptions" if fam != "all" else "all corruptions", fontsize=9)
        ax.set_xlabel("severity")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (95 % interval)")
    ax = axes[0][-1]
    mca = df[(df.metric == "mca") & (df.readout == "probe")]
    for m, g in mca.groupby("model", sort=False):
        g = g.assign(layer=pd.to_numeric(g["layer"])).sort_values("layer")
        ax.plot(g["layer"], g["value"], "-o", ms=3, color=model_color(m, models), label=model_label(m))
        if "value_lo" in g.columns and g["value_lo"].notna().any():
            ax.fill_between(g["layer"].astype(float), g["value_lo"].astype(float), g["value_hi"].astype(float),
                            color=model_color(m, models), alpha=0.12, lw=0)
    ax.set_title("mean corruption accuracy per block (probe)", fontsize=9)
    ax.set_xlabel("block")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    legend_outside(fig, handles=axes[0][0].get_legend_handles_labels()[0])
    return [("Accuracy under common corruptions vs severity (0 = clean; Hendrycks & Dietterich, ICLR 2019), mean "
             "over the corruptions of each family, at each model's decision (head, else last-layer probe); right: the "
             "mean corruption accuracy per block. Bars and bands: 95 % Wilson intervals over the n test images each "
             "accuracy is on (legend; a mean over several corruptions of the same images on that n, conservative). "
             f"{_n_note(mca)} Dotted: a readout whose clean accuracy is within noise of chance, whose accuracy says "
             "nothing about robustness." + _chance_note(at_chance), fig)]


FIGURES = {"shape_bias": shape_bias, "band_noise": band_noise, "corruptions": corruptions}
