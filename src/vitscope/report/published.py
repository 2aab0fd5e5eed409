"""The paper's numbers beside this run's: a recipe's ``published:`` entries (`vitscope.study.config.check_published`)
looked up in the run's tables, for the report's "Published numbers" section. The paper's number is a reference,
not a test: protocols differ (the recipes' comments say how), so the table shows both and their interval, and says
where this run has no row to compare with."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

#: the keys of an entry that are not selector columns of the analysis's table
_ENTRY_KEYS = ("analysis", "model", "metric", "layer", "value", "source", "scale")
#: columns whose rows break a value down further (per head, category, video, pair partner): a published number is
#: the aggregate row, where these are empty, unless the entry selects them
_DETAIL_COLUMNS = ("head", "category", "video", "model_b", "layer_b", "k")

COLUMNS = ["source", "analysis", "model", "metric", "layer", "paper", "this run", "±", "note"]


def published_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's ``published:`` entries, from the config its manifest records (none: an empty list)."""
    return list((manifest.get("config") or {}).get("published") or [])


def _rows(table: pd.DataFrame, entry: dict[str, Any]) -> pd.DataFrame:
    """The rows of ``table`` the entry names: its model and metric, each selector column equal to the entry's
    value, and the detail columns the entry does not select empty."""
    rows = table[(table["model"].astype(str) == str(entry["model"])) & (table["metric"] == entry["metric"])]
    for key, want in entry.items():
        if key in _ENTRY_KEYS:
            continue
        if key not in rows.columns:
            return rows.iloc[0:0]
        rows = rows[rows[key].astype(str) == str(want)]
    for col in _DETAIL_COLUMNS:
        if col in rows.columns and col not in entry:
            rows = rows[rows[col].isna()]
    return rows[pd.to_numeric(rows["value"], errors="coerce").notna()]


def _half_width(row: pd.Series) -> float:
    """Half the 95 % interval of a row: (value_hi - value_lo) / 2, else 1.96 stderr, else NaN."""
    lo, hi = row.get("value_lo"), row.get("value_hi")
    if lo is not None and hi is not None and not (pd.isna(lo) or pd.isna(hi)):
        return (float(hi) - float(lo)) / 2
    se = row.get("stderr")
    return 1.96 * float(se) if se is not None and not pd.isna(se) else math.nan


def measured(tables: dict[str, pd.DataFrame], entry: dict[str, Any]) -> tuple[float, float, Any, str]:
    """(value, ± half 95 % interval, layer, note) of this run for one published entry, in the paper's units
    (times ``scale``): at the entry's layer, the best layer's (the largest value; 'best'), or the row without a
    layer (null). NaN and a note saying why where the run has no such row."""
    scale = float(entry.get("scale", 1.0))
    table = tables.get(entry["analysis"])
    if table is None or table.empty:
        return math.nan, math.nan, entry["layer"], f"this run has no {entry['analysis']} table"
    rows = _rows(table, entry)
    layer = entry["layer"]
    if "layer" in rows.columns:
        layers = pd.to_numeric(rows["layer"], errors="coerce")
        rows = rows[layers.isna()] if layer is None else rows[layers.notna()] if layer == "best" else \
            rows[layers == layer]
    if rows.empty:
        return math.nan, math.nan, layer, "no row in this run for this model, metric and layer"
    if len(rows) > 1 and layer != "best":
        return math.nan, math.nan, layer, f"{len(rows)} rows match: the entry needs a selector column"
    row = rows.loc[pd.to_numeric(rows["value"]).astype(float).idxmax()]
    at = layer if layer != "best" else int(row["layer"])
    return float(row["value"]) * scale, _half_width(row) * scale, at, ""


def published_table(tables: dict[str, pd.DataFrame], manifest: dict[str, Any]) -> pd.DataFrame:
    """One row per published entry: its source, what it measures, the paper's value and this run's ± its half
    95 % interval (`COLUMNS`); empty when the run's config has none."""
    out = []
    for e in published_entries(manifest):
        value, half, layer, note = measured(tables, e)
        shown = "best" if e["layer"] == "best" and pd.isna(value) else layer
        if e["layer"] == "best" and not pd.isna(value):
            shown = f"best ({layer})"
        out.append({"source": e["source"], "analysis": e["analysis"], "model": e["model"], "metric": e["metric"],
                    "layer": "" if shown is None else shown, "paper": float(e["value"]), "this run": value,
                    "±": half, "note": note})
    return pd.DataFrame(out, columns=COLUMNS)
