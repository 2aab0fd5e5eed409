"""Which similarity findings survive a change of measure: each finding that rests on a between-model similarity
("two contrastive models are more alike than contrastive and MIM") re-checked under every measure a run's tables
hold (minibatch CKA from ``results/cka.parquet``; Procrustes, the shape metric, the CCA family, RSA, mutual k-NN,
CKNNA and ridge R² from ``results/similarity.parquet``), per token view, with the verdict holds / fails /
inconclusive per measure. ``vitscope findings RUN_DIR`` prints it; ``vitscope zoo findings`` adds it to the zoo's.

How a measure is judged. Each pair of models is compared at the last block of each (block outputs when the table
has them): the pair's value and its standard error, the table's ``stderr`` (CKA: batch means; the similarity
analysis: a jackknife over groups of images, computed for the pairs its ``null_pairs`` names, the last blocks by
default), else from its 95 % interval (``(value_hi - value_lo) / 3.92``). An asymmetric measure (ridge R², PWCCA,
CKNNA) is the mean of its two directions (their errors taken as fully correlated: the mean of the two). The
finding compares the mean over the pairs it expects more alike (CL~CL) with the mean over the others (CL~MIM);
the difference gets the 95 % interval of a normal with the pairs' errors taken as independent (as
`vitscope.zoo.findings` draws them). "More alike" reads each measure's declared direction (`vitscope.measures`):
larger for a similarity, smaller for a distance. The finding **holds** under a measure when the interval lies on
the "more alike" side of zero, **fails** when it lies on the other side, and is **inconclusive** when it contains
zero. A measure without errors at the last blocks (a run with ``n_groups: 0`` or ``null_pairs: none``) is
**inconclusive** whatever its point values say, which the table shows beside it (``interval`` = "none"). Only
the images' sampling is counted, not the choice of models.

Models are grouped by objective family: the manifest's ``objective_family`` (a registry entry's family; "none"
for untrained models and for names the registry does not know), or ``families`` given by the caller
(``--family LABEL=FAMILY``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from vitscope.errors import VitscopeError, first_line, unknown_name
from vitscope.measures import ASYMMETRIC, DIRECTION, DISTANCE, alike_sign, base, direction
from vitscope.references import cite
from vitscope.study.rundir import FINDINGS_TABLE

CL, MIM = "contrastive", "reconstructive"
FAMILIES = ("explicit", "language", "contrastive", "reconstructive", "hybrid", "autoregressive", "latent",
            "none")  # models.registry.Family
Z95 = 1.959964  # metrics.intervals.Z95; not imported: vitscope.metrics loads torch, `vitscope findings` must not
SHORT = {CL: "CL", MIM: "MIM", "explicit": "SUP", "language": "LANG", "hybrid": "HYB", "autoregressive": "AR",
         "latent": "JEPA", "none": "none"}
HOLDS, FAILS, INCONCLUSIVE = "holds", "fails", "inconclusive"
#: where the similarity tables are, and which of their metrics are measures of a pair of models
TABLES = {"cka": ("cka_minibatch",), "similarity": None}  # None: every metric `vitscope.measures` declares
SUMMARY = Path("results") / FINDINGS_TABLE  # a derived table the run directory counts as vitscope's own
HOW_TO_GET_SIMILARITY = ("add `similarity: {}` under `analyses:` in the study's config and run it again (the "
                         "cached models are not run again for the other analyses)")


@dataclass(frozen=True)
class SimilarityFinding:
    """``alike`` pairs of families are expected more alike than ``than`` pairs, at the models' last blocks."""

    claim: str
    source: str
    alike: tuple[str, str]
    than: tuple[str, str]

    @property
    def expected(self) -> str:
        return f"{'~'.join(SHORT[f] for f in self.alike)} more alike than {'~'.join(SHORT[f] for f in self.than)}"


SIMILARITY_FINDINGS = [
    SimilarityFinding("two contrastive models are more alike than contrastive and MIM",
                      f"[{cite('walmer2023', 'Fig. 19')}]", (CL, CL), (CL, MIM)),
]


# -- reading a run directory -----------------------------------------------------------------------------------

def read_manifest(run_dir: str | Path) -> dict:
    """The run's manifest.json, or one sentence (VitscopeError) on what is wrong with the directory."""
    path = Path(run_dir)
    if not path.is_dir():
        raise VitscopeError(f"{str(path)!r} is not a directory: pass a run directory (the output_dir of a "
                            "`vitscope run`)")
    mf = path / "manifest.json"
    if not mf.is_file():
        raise VitscopeError(f"{str(path)!r} has no manifest.json: pass the output_dir of a finished `vitscope run`")
    try:
        manifest = json.loads(mf.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise VitscopeError(f"{str(mf)!r} is not a vitscope manifest ({first_line(e)}); rerun the study into a "
                            "fresh output_dir") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("models"), dict):
        raise VitscopeError(f"{str(mf)!r} is not a vitscope manifest (no mapping of models); rerun the study")
    return manifest


def read_table(run_dir: str | Path, name: str) -> pd.DataFrame | None:
    """``results/NAME.parquet`` of the run, None when absent, one sentence when it is not a table."""
    p = Path(run_dir) / "results" / f"{name}.parquet"
    if not p.is_file():
        return None
    try:
        return pd.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - whatever pyarrow says of a file that is not a table
        raise VitscopeError(f"{str(p)!r} is not a table vitscope wrote ({first_line(e)}); rerun the study to "
                            "rewrite it") from None


def parse_families(items: list[str], models: Mapping[str, object]) -> dict[str, str]:
    """``LABEL=FAMILY`` items (``--family``) as a mapping, one sentence for a bad item, label or family."""
    out = {}
    for item in items:
        label, sep, fam = item.partition("=")
        if not sep or not label or not fam:
            raise VitscopeError(f"--family takes LABEL=FAMILY (e.g. my-dino=contrastive), got {item!r}")
        if label not in models:
            raise unknown_name("model label", label, models)
        if fam not in FAMILIES:
            raise unknown_name("family", fam, FAMILIES)
        out[label] = fam
    return out


def model_families(models: Mapping[str, Mapping], families: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each model's objective family: ``families`` first, else the manifest's ``objective_family``, else none."""
    fam = {m: str(meta.get("objective_family") or "none") if isinstance(meta, Mapping) else "none"
           for m, meta in models.items()}
    fam.update(families or {})
    return fam


# -- the check -------------------------------------------------------------------------------------------------

def pair_measures(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """The rows of ``tables`` (name -> table) that compare two models by a declared measure, with columns
    ``table``, ``measure`` (an asymmetric measure's ``*_reverse`` rows under the forward name) and ``se``."""
    frames = []
    for name, df in tables.items():
        if df is None or df.empty or not {"model", "model_b", "metric", "value"} <= set(df.columns):
            continue
        keep = TABLES.get(name)
        d = df[(df.model != df.model_b) & df.model_b.notna()]
        d = d[d.metric.isin(keep) if keep else d.metric.map(_pair_metric)]
        if d.empty:
            continue
        d = d.copy()
        d["table"] = name
        d["measure"] = [m.removesuffix("_reverse") if base(m) in ASYMMETRIC else m for m in d.metric.astype(str)]
        se = d["stderr"].astype(float) if "stderr" in d.columns else pd.Series(np.nan, index=d.index)
        if {"value_lo", "value_hi"} <= set(d.columns):
            width = (d["value_hi"].astype(float) - d["value_lo"].astype(float)) / (2 * Z95)
            se = se.where(se.notna(), width)
        d["se"] = se
        if "token_view" not in d.columns:
            d["token_view"] = ""
        d["token_view"] = d["token_view"].fillna("")
        frames.append(d)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _pair_metric(metric: object) -> bool:
    """A declared measure; of a symmetric one's ``*_reverse`` rows (the same number again), none."""
    m = str(metric)
    return direction(m) is not None and (not m.endswith("_reverse") or base(m) in ASYMMETRIC)


def _last_layers(rows: pd.DataFrame, models: Mapping[str, Mapping]) -> dict[str, int]:
    """The last block of each model: the manifest's depth - 1, else the deepest layer the tables hold."""
    out: dict[str, int] = {}
    for col, lcol in (("model", "layer"), ("model_b", "layer_b")):
        if lcol in rows.columns:
            for m, layer in rows.groupby(col)[lcol].max().items():
                if pd.notna(layer):
                    out[str(m)] = max(out.get(str(m), -1), int(layer))
    for m, meta in models.items():
        if isinstance(meta, Mapping) and meta.get("depth"):
            out[m] = int(meta["depth"]) - 1
    return out


def _pair(d: pd.DataFrame, a: str, b: str, last: Mapping[str, int]) -> tuple[float, float]:
    """(value, standard error) of the pair (a, b) at their last blocks, either order of the table's rows; the
    two directions of an asymmetric measure averaged. nan when the table lacks the pair (se: when no interval)."""
    if a not in last or b not in last:
        return float("nan"), float("nan")
    la, lb = last[a], last[b]
    hit = (((d.model == a) & (d.model_b == b) & (d.layer == la) & (d.layer_b == lb))
           | ((d.model == b) & (d.model_b == a) & (d.layer == lb) & (d.layer_b == la)))
    d = d[hit]
    if "tap" in d.columns and "tap_b" in d.columns:  # block outputs when the table has other taps there too
        out = d[d.tap.astype(str).str.endswith(".out") & d.tap_b.astype(str).str.endswith(".out")]
        d = out if len(out) else d
    if d.empty:
        return float("nan"), float("nan")
    se = d["se"].to_numpy(dtype=float)
    return float(d["value"].astype(float).mean()), float(se.mean()) if np.isfinite(se).all() else float("nan")


def _pairs(fam: Mapping[str, str], f1: str, f2: str) -> list[tuple[str, str]]:
    g1 = [m for m, f in fam.items() if f == f1]
    if f1 == f2:
        return [(a, b) for i, a in enumerate(g1) for b in g1[i + 1:]]
    return [(a, b) for a in g1 for b in (m for m, f in fam.items() if f == f2)]


def judge(alike: list[tuple[float, float]], than: list[tuple[float, float]], measure: str
          ) -> tuple[str, float, float, float]:
    """(verdict, difference, low, high): the difference of the mean values (alike pairs - other pairs) and its
    95 % interval (nan without one), judged in the measure's direction (module docstring)."""
    va, vt = [v for v, _ in alike], [v for v, _ in than]
    diff = float(np.mean(va) - np.mean(vt))
    se_a, se_t = [s for _, s in alike], [s for _, s in than]
    if not np.isfinite(se_a + se_t).all():
        return INCONCLUSIVE, diff, float("nan"), float("nan")
    se = math.sqrt(sum(s * s for s in se_a) / len(se_a) ** 2 + sum(s * s for s in se_t) / len(se_t) ** 2)
    lo, hi = diff - Z95 * se, diff + Z95 * se
    sign = alike_sign(measure)
    if sign * lo > 0 and sign * hi > 0:
        return HOLDS, diff, lo, hi
    if sign * lo < 0 and sign * hi < 0:
        return FAILS, diff, lo, hi
    return INCONCLUSIVE, diff, lo, hi


def check_measures(run_dir: str | Path, families: Mapping[str, str] | None = None,
                   tables: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """One row per (finding, measure, token view) the run's tables allow: the mean over the pairs expected more
    alike and over the others, their difference with its 95 % interval, and the verdict (holds / fails /
    inconclusive; module docstring). ``tables``: the run's tables by name, when already read."""
    manifest = read_manifest(run_dir)
    models = manifest["models"]
    fam = model_families(models, families)
    if tables is None:
        tables = {name: t for name in TABLES if (t := read_table(run_dir, name)) is not None}
    rows_all = pair_measures(tables)
    rows = []
    if rows_all.empty:
        return pd.DataFrame(rows)
    last = _last_layers(rows_all, models)
    for f in SIMILARITY_FINDINGS:
        alike, than = _pairs(fam, *f.alike), _pairs(fam, *f.than)
        if not alike or not than:
            continue
        for (table, measure, view), d in rows_all.groupby(["table", "measure", "token_view"], sort=False):
            va = {f"{a}~{b}": _pair(d, a, b, last) for a, b in alike}
            vt = {f"{a}~{b}": _pair(d, a, b, last) for a, b in than}
            va = {k: v for k, v in va.items() if np.isfinite(v[0])}
            vt = {k: v for k, v in vt.items() if np.isfinite(v[0])}
            if not va or not vt:  # the table lacks the pairs (e.g. a pair left out for other images)
                continue
            word, diff, lo, hi = judge(list(va.values()), list(vt.values()), measure)
            interval = "none" if np.isnan(lo) else "stderr" if table == "cka" else "jackknife"
            rows.append({"finding": f.claim, "source": f.source, "expected": f.expected, "table": table,
                         "measure": measure, "token_view": view, "direction": DIRECTION[base(measure)],
                         "alike": float(np.mean([v for v, _ in va.values()])),
                         "than": float(np.mean([v for v, _ in vt.values()])),
                         "difference": diff, "difference_lo": lo, "difference_hi": hi, "interval": interval,
                         "verdict": word, "n_alike": len(va), "n_than": len(vt),
                         "per_pair": ", ".join(f"{k} {v:.3g}" for k, (v, _) in {**va, **vt}.items())})
    return pd.DataFrame(rows)


def no_check_reason(run_dir: str | Path, families: Mapping[str, str] | None = None) -> str:
    """Why `check_measures` found nothing to check, in one sentence."""
    manifest = read_manifest(run_dir)
    fam = model_families(manifest["models"], families)
    names = [n for n in TABLES if (Path(run_dir) / "results" / f"{n}.parquet").is_file()]
    if not names:
        return (f"{str(run_dir)!r} holds neither results/cka.parquet nor results/similarity.parquet: "
                f"{HOW_TO_GET_SIMILARITY}")
    counts = ", ".join(f"{f} {sum(v == f for v in fam.values())}" for f in (CL, MIM))
    return (f"{str(run_dir)!r}: no similarity finding could be checked: they need two contrastive models and a "
            f"reconstructive one compared across models in {' / '.join(names)} (this run: {counts}; models "
            "without a registry family count as none: give theirs with --family LABEL=contrastive)")


def to_markdown(table: pd.DataFrame) -> str:
    """The per-measure table as markdown, one block per finding."""
    word = {HOLDS: "holds", FAILS: "**fails**", INCONCLUSIVE: "inconclusive"}
    lines = []
    for (claim, source, expected), t in table.groupby(["finding", "source", "expected"], sort=False):
        a, o = expected.split(" more alike than ")
        lines += [f"{claim} {source}, at the last blocks, under each measure:", "",
                  f"| measure | view | more alike | {a} | {o} | {a} - {o} (95 % interval) | verdict |",
                  "|---|---|---|---|---|---|---|"]
        for r in t.itertuples():
            interval = " (no interval)" if np.isnan(r.difference_lo) else \
                f" ({r.difference_lo:+.3g} to {r.difference_hi:+.3g})"
            sense = "smaller" if r.direction == DISTANCE else "larger"
            name = f"{r.measure} (both directions)" if base(r.measure) in ASYMMETRIC else r.measure
            lines.append(f"| {name} | {r.token_view or '-'} | {sense} | {r.alike:.3g} | {r.than:.3g} "
                         f"| {r.difference:+.3g}{interval} | {word[r.verdict]} |")
        lines.append("")
    lines.append("holds = the 95 % interval of the difference (from the pairs' standard errors: CKA's batch means, "
                 "the similarity analysis' jackknife over groups of images) lies on the side the measure calls "
                 "more alike (distances: smaller); fails = on the other side; inconclusive = it contains 0, or "
                 "the pairs have no standard error (similarity with n_groups 0). `vitscope.findings` says how.")
    return "\n".join(lines)


def write(run_dir: str | Path, table: pd.DataFrame) -> Path:
    """The table as ``results/summary/findings.parquet`` of the run (a summary, not an analysis' table)."""
    from vitscope.files import write_atomic

    out = Path(run_dir) / SUMMARY
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: table.to_parquet(f, index=False))
    return out
