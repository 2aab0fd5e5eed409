"""Shared plotting helpers: every figure module returns a list of (caption, matplotlib Figure).

A new figure module needs little more than these; used as below, its figures pass the report's checks
(tests/test_report_figures.py: no legend over data or cut off, a colour scale on every heat map, a sentence
instead of an empty panel):

    fig, axes = panels(nrows, ncols, panel=(3.4, 2.6))   constrained layout; axes is always 2-D
    layer_lines(ax, df, "metric")                         one line per model against the block: 95 % band from
                                                          the table's value_lo / value_hi (or stderr), the
                                                          model's ``<metric>_chance`` rows dashed
    legend_outside(fig, extra=[style_handle("--", "chance: ...")])
                                                          one legend right of all panels (the figure widens to
                                                          hold it, in columns when long); explain dashed lines
    colorbar(fig, image, axes, "label")                   the colour scale of a heat map (one per shared scale)
    not_computed(ax, "probe not computed ...: enable with ...")
                                                          an empty panel that says why, in place
    model_color(m), model_label(m)                        one colour per model in every figure (`PALETTE`);
                                                          untrained baselines alone grey, labelled "(untrained)",
                                                          a fine-tuned model labelled with its family

Which models are untrained, the study's model order and the other analyses' tables come from `context`,
which the report and `vitscope.report.plot` set from the run's manifest; figure functions read them with
`current()`. A figure built from fixed margins (`grid_layout`, for many small panels) has no layout engine:
give it a colour bar in a margin it reserved, and no legend.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import matplotlib

if "ipykernel" not in sys.modules and not os.environ.get("MPLBACKEND"):
    matplotlib.use("Agg")  # headless drawing for the report; a notebook keeps its own backend (`vitscope.plot`)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402
from matplotlib.layout_engine import ConstrainedLayoutEngine  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from vitscope.metrics.intervals import Z95  # noqa: E402  (bands are value ± Z95 · stderr without value_lo / value_hi)
from vitscope.report.summary import best_layer_low, is_finding  # noqa: E402  (the one rule for a best layer)

Figures = list[tuple[str, plt.Figure]]


UNTRAINED_COLOR = "0.45"
PALETTE = ("#0077BB", "#EE7733", "#117733", "#CC3311", "#AA4499", "#88CCEE", "#DDCC77", "#332288", "#44AA99",
           "#882255", "#999933", "#CC6677")
"""Twelve colours that stay apart for colour-blind readers (Paul Tol's vibrant and muted schemes, no grey): the
trained models in the study's order; beyond twelve they repeat."""
NOT_COMPUTED_GID = "not-computed"


@dataclass
class Context:
    """What a figure may know beyond its own table: the study's models in order (stable colours), the
    untrained ones (drawn grey, labelled), and the other analyses' tables (figures that combine two)."""

    models: list[str] = field(default_factory=list)
    untrained: set[str] = field(default_factory=set)
    tables: Mapping[str, pd.DataFrame] = field(default_factory=dict)
    families: Mapping[str, str] = field(default_factory=dict)  # model -> what it is (`models.registry.describe_family`)
    readouts: Mapping[str, str] = field(default_factory=dict)  # model -> what its head reads (`ViTModel.readout`)


_CONTEXT = Context()


def current() -> Context:
    """The context figures are drawn in (empty outside `context`)."""
    return _CONTEXT


@contextmanager
def context(models: Sequence[str] = (), untrained: Iterable[str] = (),
            tables: Mapping[str, pd.DataFrame] | None = None, families: Mapping[str, str] | None = None,
            readouts: Mapping[str, str] | None = None) -> Iterator[Context]:
    """Draw figures knowing the study's model order, its untrained models, the other tables and what each model
    is (its family, and what its head reads)."""
    global _CONTEXT
    previous = _CONTEXT
    _CONTEXT = Context(list(models), set(untrained), dict(tables or {}), dict(families or {}), dict(readouts or {}))
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = previous


def models_of(df: pd.DataFrame, column: str = "model") -> list[str]:
    """The models of a table in the study's order (order of appearance for models the context lacks)."""
    seen = list(dict.fromkeys(df[column].dropna())) if column in df.columns else []
    order = {m: i for i, m in enumerate(_CONTEXT.models)}
    return sorted(seen, key=lambda m: (order.get(m, len(order)), seen.index(m)))


def model_color(model: str, models: Sequence[str] | None = None) -> object:
    """One colour per model, the same in every figure of a report: trained models (fine-tuned ones included)
    take `PALETTE` in the study's order; untrained ones alone are grey."""
    if model in _CONTEXT.untrained:
        return UNTRAINED_COLOR
    order = [m for m in (_CONTEXT.models or list(models or [])) if m not in _CONTEXT.untrained]
    if model not in order:
        order = [*order, *[m for m in (models or []) if m not in order and m not in _CONTEXT.untrained]]
    k = order.index(model) if model in order else 0
    return PALETTE[k % len(PALETTE)]


def model_label(model: str, lines: bool = False) -> str:
    """The model's name, with "(untrained)" for a baseline and its family for a fine-tuned model (its start's
    family and what it was tuned for, e.g. "untrained → classification"), and, in a study whose models read out
    differently (a CLS token beside an attention pool or a patch mean), its readout in brackets ("[attention
    pool]"); ``lines``: the family on a line of its own (a panel's title)."""
    family = "untrained" if model in _CONTEXT.untrained else _CONTEXT.families.get(model, "")
    readouts = {r for m, r in _CONTEXT.readouts.items() if not _CONTEXT.models or m in _CONTEXT.models}
    readout = f" [{_CONTEXT.readouts[model]}]" if len(readouts) > 1 and model in _CONTEXT.readouts else ""
    if family != "untrained" and "→" not in family:
        return f"{model}{readout}"
    return f"{model}{readout}{chr(10) if lines else ' '}({family})"


def wrap_labels(fig: plt.Figure) -> None:
    """Titles and axis labels wrap at the figure's edge instead of running past it (matplotlib's ``wrap``;
    `vitscope.report.run.Run.figures` applies it to every figure, so a figure laid out again at a column's width
    keeps them whole)."""
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":  # beside the figure's edge while laid out: it would wrap to nothing
            continue
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            text.set_wrap(True)


def panels(nrows: int = 1, ncols: int = 1, panel: tuple[float, float] = (3.6, 2.8), **kw: object
           ) -> tuple[plt.Figure, np.ndarray]:
    """A figure of ``nrows x ncols`` panels of about ``panel`` inches each, constrained layout (legends
    outside, colour bars and labels get their room), axes always a 2-D array."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel[0] * ncols, panel[1] * nrows), squeeze=False,
                             layout="constrained", **kw)  # type: ignore[arg-type]
    return fig, axes


def _interval(g: pd.DataFrame) -> tuple[pd.Series, pd.Series] | None:
    """Per-layer 95 % interval of the layer means of ``g``: the means of value_lo and value_hi; else mean ±
    Z95 x the mean stderr. Averaging stderrs over the heads of a layer bounds the stderr of their mean from
    above (the heads are measured on the same images, their errors are not independent)."""
    if {"value_lo", "value_hi"} <= set(g.columns) and g["value_lo"].notna().any():
        lo = g.groupby("layer")["value_lo"].mean().sort_index()
        hi = g.groupby("layer")["value_hi"].mean().sort_index()
        return lo, hi
    if "stderr" in g.columns and g["stderr"].notna().any():
        m = g.groupby("layer")["value"].mean().sort_index()
        se = g.groupby("layer")["stderr"].mean().sort_index()
        return m - Z95 * se, m + Z95 * se
    return None


def layer_lines(ax: plt.Axes, df: pd.DataFrame, metric: str, style: str = "-o", label_suffix: str = "",
                title: str | None = None, mark_best: bool = False, band: bool = True) -> list[str]:
    """One line per model of ``metric`` against the block index (mean over any other rows of a layer),
    same colour per model across panels and figures, with its 95 % band over images (`_interval`) when the
    table has one; optionally (``mark_best``) a star on the best layer where it is a finding
    (`best_layer_finding`: above chance and the untrained model beyond its interval simultaneous over the
    layers), and where no model's is, `NO_BEST_NOTE` in the panel. The model's random-chance rows
    (``<metric>_chance``) are drawn dashed in its colour: a horizontal line when they have no layer, else a line
    over the layers. Returns the models drawn."""
    d = df[df.metric == metric]
    models = models_of(d)
    starred = 0
    for model in models:
        g = d[d.model == model]
        color = model_color(model, models)
        per_layer = g.groupby("layer")["value"].mean().sort_index()
        ax.plot(per_layer.index, per_layer.values, style, ms=3, color=color, label=model_label(model) + label_suffix)
        iv = _interval(g) if band else None
        if iv is not None:
            ax.fill_between(iv[0].index.astype(float), iv[0].values.astype(float), iv[1].values.astype(float),
                            color=color, alpha=0.15, lw=0)
        if mark_best and per_layer.notna().any() and best_layer_finding(df, metric, model):
            ax.plot([per_layer.idxmax()], [per_layer.max()], "*", ms=10, color=color, gid=BEST_GID)
            starred += 1
        chance = df[(df.metric == f"{metric}_chance") & (df.model == model)]
        if chance["layer"].notna().any():
            c = chance.groupby("layer")["value"].mean().sort_index()
            ax.plot(c.index, c.values, "--", lw=1, color=color, alpha=0.6)
        elif len(chance):
            ax.axhline(float(chance["value"].mean()), ls="--", lw=1, color=color, alpha=0.6)
    if mark_best and models and not starred:  # say so in place: no layer is ranked
        ax.text(0.02, 0.97, NO_BEST_NOTE, transform=ax.transAxes, ha="left", va="top", fontsize=6, color="0.35",
                gid=NO_BEST_GID)
    if title:
        ax.set_title(title, fontsize=9)
    ax.set_xlabel("block")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    decoder_blocks(ax, d)
    return models


def decoder_starts(df: pd.DataFrame) -> dict[str, int]:
    """Model -> its first MAE decoder block, for the models whose rows say which blocks are a decoder's
    (``block_label`` 'decoder j', `vitscope.models.adapter.block_label`; ``decoder: true``)."""
    if "block_label" not in df.columns or "layer" not in df.columns:
        return {}
    dec = df[df["block_label"].astype(str).str.startswith("decoder") & df["layer"].notna()]
    return {m: int(g["layer"].min()) for m, g in dec.groupby("model")}


def decoder_blocks(ax: plt.Axes, d: pd.DataFrame) -> None:
    """Name the blocks of an MAE decoder on a per-block x axis: a dotted line in the model's colour where its
    decoder starts and, where every model names each block alike, ticks 'block i' / 'decoder j' (the table's
    ``block_label``). Nothing for tables without decoder blocks."""
    starts = decoder_starts(d)
    if not starts:
        return
    for model, start in starts.items():
        ax.axvline(start - 0.5, ls=":", lw=1, color=model_color(model))
    rows = d.dropna(subset=["layer", "block_label"])
    names = rows.groupby("layer")["block_label"].agg(lambda s: sorted(set(s)))
    if all(len(v) == 1 for v in names):
        ax.set_xticks([float(x) for x in names.index], [v[0] for v in names], rotation=90, fontsize=6)
    ax.set_xlabel("block (dotted: the MAE decoder starts)")


BEST_GID, NO_BEST_GID = "best-layer", "no-best-layer"
NO_BEST_NOTE = "no best layer: none above chance\nand the untrained model beyond its interval"


def chance_level(df: pd.DataFrame, metric: str, model: str, layer: object) -> float:
    """The chance level ``model``'s ``metric`` at ``layer`` has to beat: the highest of its rows' ``chance`` column
    (e.g. the majority-class rate) and its ``<metric>_chance`` rows (at ``layer`` where they have layers: the same
    score on random features); NaN without either."""
    levels = []
    rows = df[(df.metric == metric) & (df.model == model) & (df["layer"] == layer)]
    if "chance" in rows.columns:
        levels += list(pd.to_numeric(rows["chance"], errors="coerce").dropna())
    c = df[(df.metric == f"{metric}_chance") & (df.model == model)]
    if c["layer"].notna().any():
        c = c[c["layer"] == layer]
    if len(c):
        levels.append(float(pd.to_numeric(c["value"], errors="coerce").mean()))
    levels = [v for v in levels if np.isfinite(v)]
    return max(levels) if levels else float("nan")


def best_layer_finding(df: pd.DataFrame, metric: str, model: str) -> bool:
    """Whether ``model``'s best layer of ``metric`` may be marked (`vitscope.report.summary.is_finding`, the rule
    the summary applies): the low end of its interval simultaneous over the model's layers
    (`vitscope.report.summary.best_layer_low`) above the chance level there (`chance_level`) and above the best
    score of the untrained models in the table (the context's). Never for an untrained model (the reference
    itself), nor for a model with several rows per layer (no interval of their mean to choose by)."""
    if model in _CONTEXT.untrained:
        return False
    d = df[(df.metric == metric) & df["layer"].notna()]
    g = d[d.model == model]
    values = pd.to_numeric(g["value"], errors="coerce")
    if values.isna().all() or g["layer"].duplicated().any():
        return False
    best = g.loc[values.idxmax()]
    base = d[d.model.isin(_CONTEXT.untrained)]["value"]
    baseline = float(pd.to_numeric(base, errors="coerce").max()) if len(base) else float("nan")
    return is_finding(best_layer_low(g), chance_level(df, metric, model, best["layer"]), baseline)


def has_interval(df: pd.DataFrame) -> bool:
    """Whether a table carries an uncertainty (value_lo / value_hi or stderr) anywhere."""
    return any(c in df.columns and df[c].notna().any() for c in ("value_lo", "stderr"))


def style_handle(style: str, label: str, color: object = "0.35", **kw: object) -> Line2D:
    """A legend entry explaining a line style and/or marker, in matplotlib's format-string form (``"--"``,
    ``"-o"``, ``"*"``), e.g. ``style_handle("--", "dashed: Gaussian features")``."""
    line = next((ls for ls in ("--", "-.", ":", "-") if style.startswith(ls)), "")
    marker = style[len(line):] or None
    return Line2D([], [], linestyle=line or "", marker=marker, color=color, label=label, **kw)


def band_handle(label: str = "band: 95 % interval over images") -> Artist:
    from matplotlib.patches import Patch

    return Patch(color="0.5", alpha=0.25, lw=0, label=label)


def legend_outside(fig: plt.Figure, handles: Sequence[Artist] | None = None, extra: Sequence[Artist] = (),
                   fontsize: float = 7, title: str | None = None) -> object:
    """One legend for the whole figure, to the right of every panel, never over data nor cut off.

    ``handles``: the entries (default: every labelled artist of every panel, each label once); ``extra`` are
    appended (e.g. `style_handle` explaining dashed lines). The figure widens by the legend's width so that
    the panels keep their size, and the legend takes as many columns as it needs to fit the figure's height.
    Needs a figure with constrained layout (`panels`)."""
    if handles is None:
        seen: dict[str, Artist] = {}
        for ax in fig.axes:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                if lab and not lab.startswith("_"):
                    seen.setdefault(lab, h)
        # models in the study's order (a panel per model may meet them in another order), the rest after
        rank = {model_label(m): i for i, m in enumerate(_CONTEXT.models)}
        handles = [seen[lab] for lab in sorted(seen, key=lambda lab: (rank.get(lab, len(rank)), list(seen).index(lab)))]
    handles = [*handles, *extra]
    if not handles:
        return None
    if not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):  # "outside" needs it (tight ignores it)
        fig.set_layout_engine("constrained")
    renderer = fig.canvas.get_renderer()
    w, h = fig.get_size_inches()
    ncols = 1
    while True:
        leg = fig.legend(handles=handles, loc="outside right upper", fontsize=fontsize, frameon=False, ncols=ncols,
                         title=title, title_fontsize=fontsize)
        box = leg.get_window_extent(renderer)
        if box.height <= 0.96 * h * fig.dpi or ncols >= 6:
            break
        leg.remove()
        ncols += 1
    if box.height > 0.96 * h * fig.dpi:  # still taller than the figure: make the figure as tall
        fig.set_size_inches(w, box.height / fig.dpi / 0.96)
    fig.set_size_inches(w + box.width / fig.dpi + 0.15, fig.get_size_inches()[1])
    return leg


def colorbar(fig: plt.Figure, mappable: object, axes: object, label: str, **kw: object) -> object:
    """The colour scale of a heat map (or of every heat map sharing ``mappable``'s scale) beside ``axes``."""
    cb = fig.colorbar(mappable, ax=axes, **({"fraction": 0.046, "pad": 0.03} | kw))  # type: ignore[arg-type]
    cb.set_label(label, fontsize=7)
    cb.ax.tick_params(labelsize=6)
    return cb


def not_computed(ax: plt.Axes, why: str, width: int = 34) -> None:
    """An empty panel that says, in place, why there is nothing to show (and how to get it)."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("")
    for s in ax.spines.values():
        s.set_color("0.8")
    ax.text(0.5, 0.5, textwrap.fill(why, width), ha="center", va="center", fontsize=7, color="0.35",
            transform=ax.transAxes, gid=NOT_COMPUTED_GID, wrap=True)


def message_figure(caption: str, why: str, size: tuple[float, float] = (4.0, 1.4)) -> tuple[str, plt.Figure]:
    """A whole figure that only says why it is empty (a figure's data missing altogether)."""
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    not_computed(ax, why, width=int(size[0] * 14))
    return caption, fig


def layer_figure(df: pd.DataFrame, metric: str, ylabel: str, figsize: tuple[float, float] = (4.6, 3.2),
                 extra: Sequence[Artist] = ()) -> plt.Figure:
    """One panel of `layer_lines` for ``metric``, with a y label and the models' legend outside."""
    fig, axes = panels(1, 1, panel=figsize)
    ax = axes[0, 0]
    layer_lines(ax, df, metric)
    ax.set_ylabel(ylabel)
    legend_outside(fig, extra=[*([band_handle()] if has_interval(df[df.metric == metric]) else []), *extra])
    return fig


def grid_layout(fig: plt.Figure, left: float = 0.55, right: float = 0.12, top: float = 0.32, bottom: float = 0.45,
                wspace: float = 0.32, hspace: float = 0.62) -> None:
    """Fixed margins (inches) for a grid of small panels: ``tight_layout`` measures every tick label and
    cost half the time of a many-panel figure; panels of layer curves have labels of known size."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h,
                        wspace=wspace, hspace=hspace)


def grid_shape(n: int, max_cols: int = 4) -> tuple[int, int]:
    """(rows, columns) for ``n`` panels, at most ``max_cols`` wide."""
    cols = min(n, max_cols)
    return math.ceil(n / max(cols, 1)), max(cols, 1)


UNIFORM_COLOR, UNIFORM_GID = "0.1", "uniform-attention"


def uniform_line(ax: plt.Axes, rows: pd.DataFrame, models: list[str]) -> None:
    """The uniform-attention reference (``iou_uniform`` rows) as a black dashed line, labelled in place: one line
    when every model's is the same (same masks, same grid), else one per model (grids differ)."""
    values = {m: float(v) for m, v in rows.groupby("model")["value"].mean().items() if np.isfinite(v)}
    if not values:
        return
    levels: list[float] = []
    for v in sorted(values.values()):  # the same level to the third decimal: one line
        if not levels or v - levels[-1] > 5e-4:
            levels.append(v)
    for v in levels:
        ax.axhline(v, ls=(0, (4, 2)), lw=1.4, color=UNIFORM_COLOR, zorder=1.5, gid=UNIFORM_GID)
    ax.text(0.98, levels[-1], f"uniform attention {levels[0]:.2g}" + (f"-{levels[-1]:.2g}" if len(levels) > 1 else ""),
            transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=6, color=UNIFORM_COLOR)
