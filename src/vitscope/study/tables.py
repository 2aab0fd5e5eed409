"""The run directory's tables: the key of what decides a run's results (`config_key`), this study's tables
written into ``results/`` as a whole (`write_tables`), and whether the tables and report there are already
this study's (`tables_match`, `report_is_of`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd

from vitscope.study import rundir
from vitscope.study.cache import digest
from vitscope.study.config import StudyConfig


def config_key(cfg: StudyConfig) -> str:
    """What decides a run's results: the config without where it is written and how it reports progress."""
    d = asdict(cfg)
    for k in ("output_dir", "cache_dir", "progress", "save_every", "device"):
        d.pop(k, None)
    return digest(d)


def write_tables(out: Path, frames: dict[str, list[pd.DataFrame]], epochs: dict[str, int],
                 previous: dict[str, Any]) -> list[str]:
    """Exactly this study's tables: written into a fresh folder that replaces ``results/`` as a whole (files there
    that vitscope did not write are kept: `rundir.swap_tables`), with ``rundir.EMPTY_TABLE`` where a model's table
    had no rows (`empty_reasons`). Returns the files written."""
    tables = {}
    empty = empty_reasons(frames)
    if len(empty):
        tables[rundir.EMPTY_TABLE] = empty
    for name, parts in frames.items():
        parts = [p for p in parts if p is not None and len(p)]
        if parts:
            df = pd.concat(parts, ignore_index=True)
            if epochs:
                df["epoch"] = df["model"].map(epochs).astype("Int64")
                if "model_b" in df.columns:
                    df["epoch_b"] = df["model_b"].map(epochs).astype("Int64")
            tables[f"{name}.parquet"] = df

    def write(folder: Path) -> None:
        for file, df in tables.items():
            (folder / file).parent.mkdir(parents=True, exist_ok=True)  # summary/
            df.to_parquet(folder / file, index=False)

    return rundir.swap_tables(out, write, list(tables), previous)


def empty_reasons(frames: dict[str, list[pd.DataFrame]]) -> pd.DataFrame:
    """One row (analysis, model, reason) per table without rows that says why (`analyses.base.explain_empty`:
    ``attrs`` set by the study), in the study's order: what the report says under each analysis."""
    from vitscope.analyses.base import EMPTY_MODEL, EMPTY_REASON

    rows = [{"analysis": name, "model": str(p.attrs.get(EMPTY_MODEL, "")), "reason": str(p.attrs[EMPTY_REASON])}
            for name, parts in frames.items() for p in parts
            if p is not None and not len(p) and p.attrs.get(EMPTY_REASON)]
    return pd.DataFrame(rows, columns=["analysis", "model", "reason"])


def report_is_of(out: Path) -> bool:
    """report.html was drawn from exactly the tables in results/ (it records their digests)."""
    from vitscope.report.html import report_digest, results_digest

    return report_digest(out) == results_digest(out)


def tables_match(out: Path, frames: dict[str, list[pd.DataFrame]]) -> bool:
    """The results folder holds exactly the tables this study writes (no leftovers of another config)."""
    have = {p.stem for p in (out / "results").glob("*.parquet")}
    want = {n for n, parts in frames.items() if any(p is not None and len(p) for p in parts)}
    return have == want or not want - have and have <= want
