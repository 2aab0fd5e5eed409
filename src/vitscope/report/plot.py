"""Draw any analysis's figures from a results table, e.g. in a notebook to restyle them:

    import vitscope as vs
    fig = vs.plot("vitscope-runs/default", "attention_distance")       # a run directory: one Figure
    fig = vs.plot(df, models=["zoo-dino", "zoo-mae"])                   # a table (pandas) of one analysis
    fig.get_label()                                                     # the caption the report gives it
    fig.axes[0].set_ylim(0, 20); fig.savefig("distance.pdf")
    fig = vs.plot(run, "cka", token_view="gap", figure=1)               # an analysis that draws several
    figs = figures(run, "cka")                                          # all of them: [Figure, ...]

The figures are the report's, drawn by `vitscope.report.figures` with the run's context (model colours, the
untrained baselines, other tables a figure combines with) when a run directory is given. A figure with several
panels is one Figure (its panels are ``fig.axes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from vitscope.errors import VitscopeError
from vitscope.report.figures import FIGURES
from vitscope.report.figures._common import context
from vitscope.report.run import load_run
from vitscope.report.summary import model_readouts


def _select(df: pd.DataFrame, models: Iterable[str] | None, where: dict[str, Any]) -> pd.DataFrame:
    if models is not None:
        keep = set(models)
        ok = df["model"].isin(keep)
        if "model_b" in df.columns:
            ok &= df["model_b"].isna() | df["model_b"].isin(keep)
        df = df[ok]
    for col, want in where.items():
        if col not in df.columns:
            raise VitscopeError(f"the table has no column {col!r}; columns: {', '.join(df.columns)}")
        df = df[df[col].isin(want)] if isinstance(want, list | tuple | set) else df[df[col] == want]
    return df


def plot(source: str | Path | pd.DataFrame, analysis: str | None = None, *, figure: int | str | None = None,
         models: Iterable[str] | None = None, untrained: Iterable[str] | None = None, **where: Any) -> plt.Figure:
    """One figure of one analysis, drawn from its results table, as the report draws it (``vs.plot``).

    Args:
        source, analysis, models, untrained, where: as for `figures`.
        figure: which one, where the analysis draws several (e.g. a CKA grid and its divergence per token
            view): its position, or a piece of its caption; not needed where it draws one.

    Returns:
        The matplotlib Figure, labelled with its caption (``fig.get_label()``); nothing is shown or saved.
    """
    drawn = figures(source, analysis, models=models, untrained=untrained, **where)
    if not drawn:
        raise VitscopeError("nothing to draw: the selected rows hold no figure of this analysis")
    captions = [f.get_label() for f in drawn]
    if figure is None and len(drawn) == 1:
        return drawn[0]
    if isinstance(figure, int) and -len(drawn) <= figure < len(drawn):
        chosen = drawn[figure]
    elif isinstance(figure, str) and sum(figure in c for c in captions) == 1:
        chosen = next(f for f, c in zip(drawn, captions, strict=True) if figure in c)
    else:
        for f in drawn:
            plt.close(f)
        choices = "; ".join(f"{i}: {c}" for i, c in enumerate(captions))
        asked = "it draws" if figure is None else f"figure={figure!r} is not one of the"
        raise VitscopeError(f"{asked} {len(drawn)} figures; pass figure= (a position or a piece of the caption), "
                            f"or a filter such as token_view=, or use vitscope.report.plot.figures for all: {choices}")
    for f in drawn:
        if f is not chosen:
            plt.close(f)
    return chosen


def figures(source: str | Path | pd.DataFrame, analysis: str | None = None, *,
            models: Iterable[str] | None = None, untrained: Iterable[str] | None = None,
            **where: Any) -> list[plt.Figure]:
    """Every figure of one analysis, drawn from its results table.

    Args:
        source: a run directory, a ``results/<analysis>.parquet`` file, or the table itself.
        analysis: the analysis (``vitscope.report.figures.FIGURES`` keys); optional when ``source`` is a table
            of one analysis or its parquet file.
        models: draw only these models (pairs only among them).
        untrained: models to draw as untrained baselines (grey); a run directory's manifest says so itself.
        **where: column filters, ``column=value`` or ``column=[values]``, e.g. ``token_view="cls"``.

    Returns:
        The matplotlib figures, each labelled with its caption (``fig.get_label()``); nothing is shown or
        saved (``fig.savefig(...)``, or ``vitscope report RUN_DIR --export DIR`` for all of them).
    """
    run = None
    if isinstance(source, pd.DataFrame):
        df = source
    else:
        path = Path(source)
        if path.is_dir():
            run = load_run(path)
            if analysis is None:
                raise VitscopeError(f"name the analysis to plot; {path} has: {', '.join(run.tables)}")
            if analysis not in run.tables:
                raise VitscopeError(f"{path} has no results for {analysis!r}; it has: {', '.join(run.tables)}")
            df = run.tables[analysis]
        elif path.suffix == ".parquet" and path.is_file():
            df = pd.read_parquet(path)
            analysis = analysis or path.stem
        else:
            raise VitscopeError(f"{source}: not a run directory, a results parquet file or a table")
    if analysis is None:
        names = list(dict.fromkeys(df["analysis"].dropna())) if "analysis" in df.columns else []
        if len(names) != 1:
            raise VitscopeError(f"name the analysis to plot (the table holds {names or 'no analysis column'})")
        analysis = names[0]
    if analysis not in FIGURES:
        raise VitscopeError(f"no figures for {analysis!r}; figures exist for: {', '.join(sorted(FIGURES))}")
    df = _select(df, models, where)
    order = run.models if run is not None else list(dict.fromkeys(df["model"].dropna()))
    base = set(run.untrained if run is not None else []) | set(untrained or [])
    tables = {k: _select(v, models, {}) for k, v in run.tables.items()} if run is not None else {}
    readouts = model_readouts(run.manifest) if run is not None else None
    with context(order, base, tables, run.families if run is not None else None, readouts):
        drawn = FIGURES[analysis](df)
    for caption, fig in drawn:
        fig.set_label(caption)
    return [fig for _, fig in drawn]
