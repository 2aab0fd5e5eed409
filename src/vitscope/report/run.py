"""A run directory as the report, the figure export and `plot` read it: its tables in the analyses' order, its
manifest, and the figure context (model order, untrained models, the other tables)."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from vitscope.errors import VitscopeError, first_line
from vitscope.report.figures import FIGURES
from vitscope.report.figures._common import context, wrap_labels
from vitscope.report.summary import model_families, model_readouts, untrained_models  # also imported from here
from vitscope.study.rundir import EMPTY_TABLE

BEST_LAYERS = "best_layers"
"""The report's figure of the dense tasks' best layers (a summary over their tables, not an analysis)."""


@dataclass
class Run:
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # sha256 of the bytes each table was read from
    #: analysis -> [(model, reason)] where its table had no rows for that model (results/summary/empty.parquet)
    empty: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    @property
    def models(self) -> list[str]:
        return list(self.manifest.get("models", {}))

    @property
    def untrained(self) -> list[str]:
        return untrained_models(self.manifest)

    @property
    def families(self) -> dict[str, str]:
        return model_families(self.manifest)

    @contextmanager
    def figure_context(self) -> Iterator[None]:
        with context(self.models, self.untrained, self.tables, self.families, model_readouts(self.manifest)):
            yield

    def best_layers(self) -> pd.DataFrame:
        """The dense tasks' best layer per (task, model), with k-NN's from the semantics table beside them
        (`vitscope.report.figures.dense.best_layer_summary`)."""
        from vitscope.report.figures.dense import TASKS, best_layer_summary

        tables = {n: t for n, t in self.tables.items() if n in TASKS or n == "semantics"}  # k-NN beside them
        dense = any(n in TASKS for n in tables)
        return best_layer_summary(tables, self.manifest.get("models", {})) if dense else pd.DataFrame()

    def sections(self) -> list[str]:
        """The analyses the report has a section for, in the order they are registered: those with a table and
        those that said why they have no rows for some model (with no table at all, their section says only why)."""
        from vitscope.analyses import ANALYSES

        order = {name: i for i, name in enumerate(ANALYSES)}
        names = [*self.tables, *(n for n in self.empty if n not in self.tables)]
        return sorted(names, key=lambda n: (order.get(n, len(order)), n))

    def figure_names(self) -> list[str]:
        """What the report draws figures for, in its order: every analysis, then the dense tasks' best layers
        (`BEST_LAYERS`) where there are any; the export writes exactly these."""
        return [*self.tables, *([BEST_LAYERS] if not self.best_layers().empty else [])]

    def figures(self, name: str) -> Iterator[tuple[str, plt.Figure]]:
        """(caption, figure) of one analysis (or of `BEST_LAYERS`), drawn in the run's context; each figure's label
        is its caption."""
        if name == BEST_LAYERS:
            from vitscope.report.figures.dense import summary_figure

            with self.figure_context():
                drawn = summary_figure(self.best_layers())
            for caption, fig in drawn:
                fig.set_label(caption)
                wrap_labels(fig)
                yield caption, fig
            return
        fn = FIGURES.get(name)
        if fn is None or name not in self.tables:
            return
        with self.figure_context():
            drawn = fn(self.tables[name])
        for caption, fig in drawn:
            fig.set_label(caption)
            wrap_labels(fig)
            yield caption, fig


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory's manifest and every ``results/*.parquet`` (in the order analyses are registered)."""
    from vitscope.analyses import ANALYSES

    path = Path(run_dir)
    mf = path / "manifest.json"
    try:
        manifest = json.loads(mf.read_text()) if mf.is_file() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise VitscopeError(f"{str(mf)!r} is not a vitscope manifest ({first_line(e)}); rerun the study into a "
                            "fresh output_dir") from None
    if not isinstance(manifest, dict):
        raise VitscopeError(f"{str(mf)!r} is not a vitscope manifest (not a mapping); rerun the study")
    order = {name: i for i, name in enumerate(ANALYSES)}
    files = sorted((path / "results").glob("*.parquet"), key=lambda p: (order.get(p.stem, len(order)), p.stem))
    run = Run(path, manifest)
    for p in files:
        raw = p.read_bytes()  # one read: the table and its digest come from the same bytes
        try:
            run.tables[p.stem] = pd.read_parquet(io.BytesIO(raw))
        except Exception as e:  # noqa: BLE001 - whatever pyarrow says of a file that is not a table
            raise VitscopeError(f"{str(p)!r} is not a table vitscope wrote ({first_line(e)}); rerun the study "
                                "to rewrite it") from None
        run.digests[p.stem] = hashlib.sha256(raw).hexdigest()
    run.empty = _empty_reasons(path / "results" / EMPTY_TABLE)
    return run


def _empty_reasons(p: Path) -> dict[str, list[tuple[str, str]]]:
    """results/summary/empty.parquet by analysis: ``{analysis: [(model, reason)]}`` ({} without the file)."""
    if not p.is_file():
        return {}
    try:
        df = pd.read_parquet(p, columns=["analysis", "model", "reason"])
    except Exception as e:  # noqa: BLE001 - whatever pyarrow says of a file that is not this table
        raise VitscopeError(f"{str(p)!r} is not a table vitscope wrote ({first_line(e)}); rerun the study "
                            "to rewrite it") from None
    out: dict[str, list[tuple[str, str]]] = {}
    for analysis, model, reason in df.itertuples(index=False):
        out.setdefault(str(analysis), []).append((str(model), str(reason)))
    return out
