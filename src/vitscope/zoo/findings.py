"""Do the sources' qualitative findings hold for a set of models? Checked on a finished study's results.

Models are grouped by their objective family, as the study's manifest records it (registry entry:
'contrastive' = DINO, MoCo-v3; 'reconstructive' = MAE, SimMIM, BEiT). Each finding compares the two
groups' means of one measure; "late layers" are the last third of the blocks. ``vitscope zoo findings
RUN_DIR`` prints the table (markdown); docs/ZOO.md holds it for the shipped zoo.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

CL, MIM = "contrastive", "reconstructive"


@dataclass(frozen=True)
class Finding:
    claim: str
    source: str
    measure: str
    analysis: str
    value: Callable[[pd.DataFrame, str, int], float]  # (results, model, depth) -> the model's number
    expect: str  # 'CL > MIM' or 'CL < MIM'


def _late(df: pd.DataFrame, metric: str, depth: int, **eq: str) -> pd.Series:
    d = df[(df.metric == metric) & (df.layer >= depth - max(1, depth // 3))]
    for k, v in eq.items():
        d = d[d[k] == v]
    return d["value"]


def _late_mean(metric: str, **eq: str) -> Callable[[pd.DataFrame, str, int], float]:
    return lambda df, model, depth: float(_late(df[df.model == model], metric, depth, **eq).mean())


def _knn(df: pd.DataFrame, model: str, depth: int, what: str) -> float:
    d = df[(df.model == model) & (df.metric == "knn20_top1") & (df.token_view == "cls")]
    per_layer = d.groupby("layer")["value"].mean()
    if per_layer.empty:
        return float("nan")
    return float(per_layer.iloc[-1]) if what == "last" else float(per_layer.idxmax())


FINDINGS = [
    Finding("contrastive models attend more globally in late layers", "[001; 003]",
            "mean attention distance (px), late layers", "attention_distance", _late_mean("distance_px"),
            "CL > MIM"),
    Finding("contrastive late-layer attention collapses (queries attend alike)", "[001]",
            "attention NMI(query, key), late layers", "attention_nmi", _late_mean("nmi"), "CL < MIM"),
    Finding("contrastive models have the better last-layer k-NN", "[003]",
            "20-NN top-1 (CLS), last block", "semantics", lambda df, m, d: _knn(df, m, d, "last"), "CL > MIM"),
    Finding("MIM models peak earlier in k-NN", "[003]", "block of the best 20-NN top-1 (CLS)",
            "semantics", lambda df, m, d: _knn(df, m, d, "peak"), "CL > MIM"),
    Finding("MIM features carry more high-frequency amplitude", "[001]",
            "Δ log amplitude at the highest frequency, late layers", "fourier",
            _late_mean("high_freq_delta_log_amp"), "CL < MIM"),
]


def _pair_cka(cka: pd.DataFrame, a: str, b: str, depth_a: int, depth_b: int) -> float:
    """Last block of a vs last block of b, CLS view (either direction of the pair)."""
    d = cka[(cka.metric == "cka_minibatch") & (cka.token_view == "cls")]
    d = d[((d.model == a) & (d.model_b == b) & (d.layer == depth_a - 1) & (d.layer_b == depth_b - 1))
          | ((d.model == b) & (d.model_b == a) & (d.layer == depth_b - 1) & (d.layer_b == depth_a - 1))]
    return float(d["value"].mean()) if len(d) else float("nan")


def check(run_dir: str | Path) -> pd.DataFrame:
    """One row per finding: each group's mean, the per-model values, and whether the finding holds."""
    run_dir = Path(run_dir)
    models = json.loads((run_dir / "manifest.json").read_text())["models"]
    groups = {g: [m for m, meta in models.items() if meta.get("objective_family") == g] for g in (CL, MIM)}
    depth = {m: int(meta["depth"]) for m, meta in models.items() if "depth" in meta}
    rows = []

    def add(claim, source, measure, per_model, cl, mim, expect):  # noqa: ANN001, ANN202
        holds = None if np.isnan(cl) or np.isnan(mim) else bool(cl > mim if expect == "CL > MIM" else cl < mim)
        rows.append({"finding": claim, "source": source, "measure": measure, "expected": expect,
                     "contrastive": cl, "mim": mim, "holds": holds,
                     "per_model": ", ".join(f"{m} {v:.3g}" for m, v in per_model.items())})

    for f in FINDINGS:
        path = run_dir / "results" / f"{f.analysis}.parquet"
        if not path.is_file():
            continue
        df = pd.read_parquet(path)
        vals = {m: f.value(df, m, depth[m]) for g in (CL, MIM) for m in groups[g]}
        mean = {g: float(np.nanmean([vals[m] for m in groups[g]])) if groups[g] else float("nan") for g in (CL, MIM)}
        add(f.claim, f.source, f.measure, vals, mean[CL], mean[MIM], f.expect)
    path = run_dir / "results" / "cka.parquet"
    if path.is_file() and len(groups[CL]) >= 2:
        cka = pd.read_parquet(path)
        cl = [(a, b) for i, a in enumerate(groups[CL]) for b in groups[CL][i + 1:]]
        mixed = [(a, b) for a in groups[CL] for b in groups[MIM]]
        vals = {f"{a}~{b}": _pair_cka(cka, a, b, depth[a], depth[b]) for a, b in cl + mixed}
        add("two contrastive models are more alike than contrastive and MIM", "[003 Fig. 19]",
            "CKA of the last blocks (CLS): CL~CL vs CL~MIM pairs", vals,
            float(np.nanmean([vals[f"{a}~{b}"] for a, b in cl])),
            float(np.nanmean([vals[f"{a}~{b}"] for a, b in mixed])) if mixed else float("nan"), "CL > MIM")
    return pd.DataFrame(rows)


def to_markdown(table: pd.DataFrame) -> str:
    lines = ["| finding | measure | contrastive | MIM | holds? |", "|---|---|---|---|---|"]
    for r in table.itertuples():
        verdict = "n/a" if r.holds is None else ("yes" if r.holds else "**no**")
        lines.append(f"| {r.finding} {r.source} | {r.measure} ({r.expected}) | {r.contrastive:.3g} | {r.mim:.3g} "
                     f"| {verdict} |")
    return "\n".join(lines)
