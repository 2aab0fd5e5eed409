"""Do the sources' qualitative findings hold for a set of models? Checked on a finished study's results.

Models are grouped by their objective family, as the study's manifest records it (registry entry:
'contrastive' = DINO, MoCo-v3; 'reconstructive' = MAE, SimMIM, BEiT). Each finding compares the two
groups' means of one measure; "late layers" are the last third of the blocks. ``vitscope zoo findings
RUN_DIR`` prints the table (markdown); docs/ZOO.md holds it for the shipped zoo.

How "holds" is decided: a finding holds only when the difference of the group means is larger than its
uncertainty over the images. Every number in the tables carries a standard error over images (``stderr``:
means over images from streamed sums of squares, accuracies binomial, CKA by batch means). Each model's
measure is recomputed on ``DRAWS`` draws of its table values from normal distributions with those standard
errors (a parametric bootstrap, fixed seed): one shared draw per model for a mean over layers and heads (their
errors come from the same images; taking them fully correlated bounds the error of their mean from above),
independent draws per layer for the block where a curve peaks. The difference of the group means gets a
95 % interval from the 2.5 and 97.5 percentiles of its draws: the finding **holds** when the interval lies
on the expected side of zero, is **contradicted** when it lies on the other side, and is **inconclusive**
when it contains zero. A table without standard errors (written by an older vitscope) gives "no uncertainty"
and no verdict. Only the images' sampling is counted: with one or two models per group, whether the groups
differ in general is another question, which the per-model values let the reader judge.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from vitscope.findings import SIMILARITY_FINDINGS
from vitscope.references import cite

CL, MIM = "contrastive", "reconstructive"
DRAWS = 4000
SEED = 0

# analyses whose numbers rest on a model's semantics (k-NN, probes, retrieval): the zoo's MIM caveat applies
SEMANTIC_ANALYSES = ("semantics", "retrieval")

HOLDS, CONTRADICTED, INCONCLUSIVE, UNKNOWN = "holds", "contradicted", "inconclusive", "no uncertainty"


@dataclass(frozen=True)
class Finding:
    claim: str
    source: str
    measure: str
    analysis: str
    # (results, model, depth, rng) -> (the model's number, DRAWS draws of it; None when the table has no stderr)
    value: Callable[[pd.DataFrame, str, int, np.random.Generator], tuple[float, np.ndarray | None]]
    expect: str  # 'CL > MIM' or 'CL < MIM'
    semantic: bool = False  # rests on MIM semantics (k-NN, probes, retrieval): see `budget_caveat`


def _se(d: pd.DataFrame) -> np.ndarray | None:
    if "stderr" not in d.columns or d["stderr"].isna().all():
        return None
    return d["stderr"].to_numpy(dtype=float)


def _late_mean(metric: str, **eq: str) -> Callable[..., tuple[float, np.ndarray | None]]:
    """Mean of ``metric`` over the late layers (and heads); draws with one shared normal deviate per model,
    scaled by the mean standard error (the bound for fully correlated errors)."""

    def value(df: pd.DataFrame, model: str, depth: int, rng: np.random.Generator) -> tuple[float, np.ndarray | None]:
        d = df[(df.model == model) & (df.metric == metric) & (df.layer >= depth - max(1, depth // 3))]
        for k, v in eq.items():
            d = d[d[k] == v]
        mean = float(d["value"].mean()) if len(d) else float("nan")
        se = _se(d)
        if se is None or not len(d):
            return mean, None
        return mean, mean + rng.standard_normal(DRAWS) * float(np.nanmean(se))

    return value


def _knn_curve(df: pd.DataFrame, model: str) -> pd.DataFrame:
    d = df[(df.model == model) & (df.metric == "knn20_top1") & (df.token_view == "cls")]
    return d.sort_values("layer")


def _knn_last(df: pd.DataFrame, model: str, depth: int, rng: np.random.Generator) -> tuple[float, np.ndarray | None]:
    d = _knn_curve(df, model)
    if d.empty:
        return float("nan"), None
    last = d.iloc[-1]
    se = _se(d.iloc[-1:])
    v = float(last["value"])
    return v, None if se is None else v + rng.standard_normal(DRAWS) * se[0]


def _knn_peak(df: pd.DataFrame, model: str, depth: int, rng: np.random.Generator) -> tuple[float, np.ndarray | None]:
    """The block of the best 20-NN top-1; draws: the argmax of independently drawn layer values."""
    d = _knn_curve(df, model)
    if d.empty:
        return float("nan"), None
    layers, vals = d["layer"].to_numpy(dtype=float), d["value"].to_numpy(dtype=float)
    peak = float(layers[int(np.argmax(vals))])
    se = _se(d)
    if se is None:
        return peak, None
    draws = vals[None, :] + rng.standard_normal((DRAWS, len(vals))) * se[None, :]
    return peak, layers[np.argmax(draws, axis=1)]


WALMER, PARK = "walmer2023", "park2023"

FINDINGS = [
    Finding("contrastive models attend more globally in late layers", f"[{cite(PARK)}; {cite(WALMER)}]",
            "mean attention distance (px), late layers", "attention_distance", _late_mean("distance_px"),
            "CL > MIM"),
    Finding("contrastive late-layer attention collapses (queries attend alike)", f"[{cite(PARK)}]",
            "attention NMI(query, key), late layers", "attention_nmi", _late_mean("nmi"), "CL < MIM"),
    Finding("contrastive models have the better last-layer k-NN", f"[{cite(WALMER)}]",
            "20-NN top-1 (CLS), last block", "semantics", _knn_last, "CL > MIM",
            semantic=True),
    Finding("MIM models peak earlier in k-NN", f"[{cite(WALMER)}]", "block of the best 20-NN top-1 (CLS)",
            "semantics", _knn_peak, "CL > MIM", semantic=True),
    Finding("MIM features carry more high-frequency amplitude", f"[{cite(PARK)}]",
            "Δ log amplitude at the highest frequency, late layers", "fourier",
            _late_mean("high_freq_delta_log_amp"), "CL < MIM"),
]


def _pair_cka(cka: pd.DataFrame, a: str, b: str, depth_a: int, depth_b: int, rng: np.random.Generator
              ) -> tuple[float, np.ndarray | None]:
    """Last block of a vs last block of b, CLS view (either direction of the pair)."""
    d = cka[(cka.metric == "cka_minibatch") & (cka.token_view == "cls")]
    d = d[((d.model == a) & (d.model_b == b) & (d.layer == depth_a - 1) & (d.layer_b == depth_b - 1))
          | ((d.model == b) & (d.model_b == a) & (d.layer == depth_b - 1) & (d.layer_b == depth_a - 1))]
    if d.empty:
        return float("nan"), None
    v, se = float(d["value"].mean()), _se(d)
    return v, None if se is None else v + rng.standard_normal(DRAWS) * float(np.nanmean(se))


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def verdict(diff_draws: np.ndarray | None, expect: str) -> tuple[str, float, float]:
    """(verdict, low, high) of the 95 % interval of the CL - MIM difference from its draws."""
    if diff_draws is None or not np.isfinite(diff_draws).all():
        return UNKNOWN, float("nan"), float("nan")
    lo, hi = (float(x) for x in np.percentile(diff_draws, [2.5, 97.5]))
    sign = 1 if expect == "CL > MIM" else -1
    if sign * lo > 0 and sign * hi > 0:
        return HOLDS, lo, hi
    if sign * lo < 0 and sign * hi < 0:
        return CONTRADICTED, lo, hi
    return INCONCLUSIVE, lo, hi


def check(run_dir: str | Path) -> pd.DataFrame:
    """One row per finding: each group's mean, the per-model values, the difference with its 95 % interval
    and the verdict (module docstring: how it is decided). ``holds`` is True / False only for a clear
    verdict, None when inconclusive or without uncertainty."""
    run_dir = Path(run_dir)
    models = json.loads((run_dir / "manifest.json").read_text())["models"]
    groups = {g: [m for m, meta in models.items() if meta.get("objective_family") == g] for g in (CL, MIM)}
    depth = {m: int(meta["depth"]) for m, meta in models.items() if "depth" in meta}
    rng = np.random.default_rng(SEED)
    rows = []

    def add(claim: str, source: str, measure: str, per_model: dict[str, tuple[float, np.ndarray | None]],
            cl: list[str], mim: list[str], expect: str, semantic: bool = False) -> None:
        mean = {g: _nanmean([per_model[k][0] for k in keys]) for g, keys in ((CL, cl), (MIM, mim))}
        if np.isnan(mean[CL]) and np.isnan(mean[MIM]):  # the measure is not in the tables (e.g. no 20-NN)
            return
        draws = [per_model[k][1] for k in cl + mim]
        diff = None
        if cl and mim and all(d is not None for d in draws):
            diff = (np.mean([per_model[k][1] for k in cl], axis=0)  # type: ignore[misc]
                    - np.mean([per_model[k][1] for k in mim], axis=0))  # type: ignore[misc]
        word, lo, hi = verdict(diff, expect) if not (np.isnan(mean[CL]) or np.isnan(mean[MIM])) else \
            (UNKNOWN, float("nan"), float("nan"))
        rows.append({"finding": claim, "source": source, "measure": measure, "expected": expect,
                     "contrastive": mean[CL], "mim": mean[MIM], "difference": mean[CL] - mean[MIM],
                     "difference_lo": lo, "difference_hi": hi, "verdict": word,
                     "holds": True if word == HOLDS else False if word == CONTRADICTED else None,
                     "semantic": semantic,
                     "per_model": ", ".join(f"{m} {v:.3g}" for m, (v, _) in per_model.items())})

    for f in FINDINGS:
        path = run_dir / "results" / f"{f.analysis}.parquet"
        if not path.is_file():
            continue
        df = pd.read_parquet(path)
        vals = {m: f.value(df, m, depth[m], rng) for g in (CL, MIM) for m in groups[g]}
        add(f.claim, f.source, f.measure, vals, groups[CL], groups[MIM], f.expect, f.semantic)
    path = run_dir / "results" / "cka.parquet"
    if path.is_file() and len(groups[CL]) >= 2:
        cka = pd.read_parquet(path)
        cl = [(a, b) for i, a in enumerate(groups[CL]) for b in groups[CL][i + 1:]]
        mixed = [(a, b) for a in groups[CL] for b in groups[MIM]]
        vals = {f"{a}~{b}": _pair_cka(cka, a, b, depth[a], depth[b], rng) for a, b in cl + mixed}
        f = SIMILARITY_FINDINGS[0]  # re-checked under every measure of a similarity table: vitscope.findings
        add(f.claim, f.source, "CKA of the last blocks (CLS): CL~CL vs CL~MIM pairs", vals, [f"{a}~{b}" for a, b in cl],
            [f"{a}~{b}" for a, b in mixed], "CL > MIM")
    return pd.DataFrame(rows)


def budget_caveat(models: dict[str, dict]) -> str | None:
    """One sentence on the training budget of the study's shipped masked-modelling zoo models (``models``: the
    manifest's models), from their cards: how far their features are above the untrained network's, and which
    findings that affects; None when the study has no such model."""
    from vitscope.zoo.evaluate import FAMILY, CardError, margins, random_card, shipped_card

    parts, views = [], set()
    for label, meta in models.items():
        card = shipped_card(str(meta.get("source", label)))
        if card is None or FAMILY.get(card.get("objective", "")) != "masked":
            continue
        try:
            k = margins(card, random_card())["knn20"]
        except CardError:
            continue
        parts.append(f"{label} {k['margin']:+.3f} [{k['interval'][0]:+.3f}, {k['interval'][1]:+.3f}]")
        views.add(int(card.get("image_views", 0)))
    if not parts:
        return None
    budget = f"{max(views):,} image-views" if views else "the zoo's budget"
    return (f"Budget caveat: at {budget} the masked-modelling zoo models' best-block 20-NN is only "
            f"{', '.join(parts)} over the untrained zoo-random (95 % intervals), so the findings that rest on MIM "
            "semantics (k-NN, probes, retrieval; marked †) may reflect the small training budget rather than the "
            "objective; the attention findings are not affected (docs/ZOO.md).")


def to_markdown(table: pd.DataFrame) -> str:
    lines = ["| finding | measure | contrastive | MIM | CL - MIM (95 % interval) | holds? |",
             "|---|---|---|---|---|---|"]
    word = {HOLDS: "yes", CONTRADICTED: "**no**", INCONCLUSIVE: "inconclusive", UNKNOWN: "n/a (no uncertainty)"}
    for r in table.itertuples():
        interval = "" if np.isnan(r.difference_lo) else f" ({r.difference_lo:+.3g} to {r.difference_hi:+.3g})"
        mark = " †" if getattr(r, "semantic", False) else ""
        lines.append(f"| {r.finding}{mark} {r.source} | {r.measure} ({r.expected}) | {r.contrastive:.3g} | {r.mim:.3g} "
                     f"| {r.difference:+.3g}{interval} | {word[r.verdict]} |")
    lines.append("")
    lines.append("holds = the 95 % interval of the difference over images (parametric bootstrap from the tables' "
                 "standard errors; `vitscope.zoo.findings`) lies on the expected side of 0; inconclusive = it "
                 "contains 0. †: rests on MIM semantics (k-NN, probes, retrieval).")
    return "\n".join(lines)
