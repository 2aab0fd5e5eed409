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

Against the untrained network. A difference between the groups says which objective moved the measure only
beside the untrained network of the same architecture (the manifest's untrained models: family "none", not
fine-tuned; zoo-random in the zoo). Each finding names its subject, the group it makes a claim about ("contrastive
models attend more globally"), and holds only when, besides the group difference, the subject's departure from
the untrained network (subject - untrained, same draws) lies beyond its interval in the claimed direction. When
the groups differ but the subject sits within noise of the untrained network (the other group moved), the
verdict is **inconclusive** and ``reason`` says which group moved and where; without an untrained model in the
study it is inconclusive too ("no untrained model to compare with"). Both groups' departures are in the table
(``cl_vs_untrained``, ``mim_vs_untrained`` with their intervals). For the similarity finding the untrained
comparison is CL~CL against CL~untrained pairs, and the MIM~MIM agreement is shown beside (``within_mim``). For
the k-NN peak block (a location, meaningless on the untrained network's flat chance curve) the departure is the
subject's best k-NN against the untrained network's best.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

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
    subject: str = CL  # the group the claim is about: its departure from the untrained network must agree
    # the number whose departure from the untrained network is judged, when not ``value`` (and its direction:
    # +1 the subject above the untrained, -1 below; None: the claim's direction for the subject)
    departure: Callable[[pd.DataFrame, str, int, np.random.Generator], tuple[float, np.ndarray | None]] | None = None
    departure_sign: int | None = None
    #: how the reasons name the groups and the untrained baseline
    names: ClassVar[dict[str, str]] = {CL: "contrastive", MIM: "MIM"}
    base_name: ClassVar[str] = "the untrained network"

    def sign(self) -> int:
        """+1 when the claim puts the subject above the untrained network, -1 below."""
        return _claimed_sign(self.expect, self.subject) if self.departure_sign is None else self.departure_sign


def _claimed_sign(expect: str, subject: str) -> int:
    """+1 when ``expect`` ('CL > MIM' or 'CL < MIM') puts ``subject`` (CL or MIM) above the other group."""
    s = 1 if expect == "CL > MIM" else -1
    return s if subject == CL else -s


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


def _knn_best(df: pd.DataFrame, model: str, depth: int, rng: np.random.Generator) -> tuple[float, np.ndarray | None]:
    """The best block's 20-NN top-1; draws: the maximum of independently drawn layer values."""
    d = _knn_curve(df, model)
    if d.empty:
        return float("nan"), None
    vals, se = d["value"].to_numpy(dtype=float), _se(d)
    if se is None:
        return float(vals.max()), None
    return float(vals.max()), (vals[None, :] + rng.standard_normal((DRAWS, len(vals))) * se[None, :]).max(axis=1)


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
            "semantics", _knn_peak, "CL > MIM", semantic=True, subject=MIM, departure=_knn_best, departure_sign=1),
    Finding("MIM features carry more high-frequency amplitude", f"[{cite(PARK)}]",
            "Δ log amplitude at the highest frequency, late layers", "fourier",
            _late_mean("high_freq_delta_log_amp"), "CL < MIM", subject=MIM),
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


def _interval(draws: np.ndarray | None) -> tuple[float, float]:
    if draws is None or not np.isfinite(draws).all():
        return float("nan"), float("nan")
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def _group(per_model: dict[str, tuple[float, np.ndarray | None]], keys: list[str]) -> tuple[float, np.ndarray | None]:
    """The mean over ``keys`` of the values and of the draws (None when a draw is missing or a key is absent)."""
    if not keys:
        return float("nan"), None
    draws = [per_model[k][1] for k in keys]
    mean = _nanmean([per_model[k][0] for k in keys])
    return mean, None if any(d is None for d in draws) else np.mean(draws, axis=0)


def _moved(name: str, value: float, draws: np.ndarray | None, base: str = "the untrained network") -> str:
    """'MIM below the untrained network (-7.3 [-7.4, -7.2])' or '... within noise of ... (...)'."""
    lo, hi = _interval(draws)
    if np.isnan(lo):
        return f"{name} {value:+.3g} from {base} (no uncertainty)"
    where = "above" if lo > 0 else "below" if hi < 0 else "within noise of"
    return f"{name} {where} {base} ({value:+.3g} [{lo:+.3g}, {hi:+.3g}])"


def untrained_models(models: dict[str, dict]) -> list[str]:
    """The study's untrained networks (manifest family "none", not fine-tuned): the baseline of every finding."""
    return [m for m, meta in models.items()
            if meta.get("objective_family") in (None, "none") and not meta.get("finetuned_from")
            and str(meta.get("supervision", "random init")).startswith("random init")]


def check(run_dir: str | Path) -> pd.DataFrame:
    """One row per finding: each group's mean, the per-model values, the difference with its 95 % interval, each
    group's departure from the untrained network with its interval, the verdict and its reason (module docstring:
    how it is decided). ``holds`` is True / False only for a clear verdict, None when inconclusive or without
    uncertainty."""
    run_dir = Path(run_dir)
    models = json.loads((run_dir / "manifest.json").read_text())["models"]
    groups = {g: [m for m, meta in models.items() if meta.get("objective_family") == g] for g in (CL, MIM)}
    base = untrained_models(models)
    depth = {m: int(meta["depth"]) for m, meta in models.items() if "depth" in meta}
    rng = np.random.default_rng(SEED)
    rows = []

    def add(f: Finding | SimilarityLike, measure: str, per_model: dict[str, tuple[float, np.ndarray | None]],
            cl: list[str], mim: list[str], untrained: list[str], dep: dict[str, tuple[float, np.ndarray | None]],
            extra: dict | None = None) -> None:
        (m_cl, d_cl), (m_mim, d_mim) = _group(per_model, cl), _group(per_model, mim)
        if np.isnan(m_cl) and np.isnan(m_mim):  # the measure is not in the tables (e.g. no 20-NN)
            return
        diff = None if d_cl is None or d_mim is None else d_cl - d_mim
        word, lo, hi = verdict(diff, f.expect) if not (np.isnan(m_cl) or np.isnan(m_mim)) else \
            (UNKNOWN, float("nan"), float("nan"))
        # each group against the untrained network, on the departure's numbers
        moved, reason = {}, ""
        u_mean, u_draws = _group(dep, untrained)
        shown_base = _group(per_model, untrained)[0] if all(k in per_model for k in untrained) else u_mean
        for g, keys in ((CL, cl), (MIM, mim)):
            g_mean, g_draws = _group(dep, keys)
            moved[g] = (g_mean - u_mean, None if g_draws is None or u_draws is None else g_draws - u_draws)
        if word == HOLDS:
            sub_value, sub_draws = moved[f.subject]
            sub_lo, sub_hi = _interval(sub_draws)
            other = MIM if f.subject == CL else CL
            name, said = f.names, f.base_name
            if not untrained:
                word, reason = INCONCLUSIVE, "no untrained model in the study to compare with (add zoo-random)"
            elif np.isnan(sub_lo):
                word, reason = UNKNOWN, "the untrained comparison has no uncertainty"
            elif not (f.sign() * sub_lo > 0 and f.sign() * sub_hi > 0):
                word = INCONCLUSIVE
                reason = (f"the groups differ, but {_moved(name[f.subject], *moved[f.subject], said)}; "
                          f"{_moved(name[other], *moved[other], said)}")
            else:
                reason = (f"{_moved(name[f.subject], *moved[f.subject], said)}; "
                          f"{_moved(name[other], *moved[other], said)}")
                if abs(moved[other][0]) > abs(sub_value):
                    reason += f"; most of the difference is the departure of {name[other]}"
        elif word == CONTRADICTED:
            reason = "the groups differ the other way"
        elif word == INCONCLUSIVE:
            reason = "the groups' difference is within noise"
        row = {"finding": f.claim, "source": f.source, "measure": measure, "expected": f.expect,
               "contrastive": m_cl, "mim": m_mim, "difference": m_cl - m_mim,
               "difference_lo": lo, "difference_hi": hi, "verdict": word,
               "holds": True if word == HOLDS else False if word == CONTRADICTED else None,
               "semantic": getattr(f, "semantic", False), "subject": f.subject, "untrained": shown_base,
               "untrained_models": ", ".join(untrained), "reason": reason,
               "per_model": ", ".join(f"{m} {v:.3g}" for m, (v, _) in per_model.items())}
        for g, col in ((CL, "cl_vs_untrained"), (MIM, "mim_vs_untrained")):
            row[col] = moved[g][0]
            row[f"{col}_lo"], row[f"{col}_hi"] = _interval(moved[g][1])
        row.update(extra or {})
        rows.append(row)

    for f in FINDINGS:
        path = run_dir / "results" / f"{f.analysis}.parquet"
        if not path.is_file():
            continue
        df = pd.read_parquet(path)
        everyone = [m for m in (*groups[CL], *groups[MIM], *base) if m in depth]
        vals = {m: f.value(df, m, depth[m], rng) for m in everyone}
        dep = vals if f.departure is None else {m: f.departure(df, m, depth[m], rng) for m in everyone}
        shown = {m: v for m, v in vals.items() if m not in base}
        add(f, f.measure, {**shown, **{m: vals[m] for m in base}}, groups[CL], groups[MIM], base, dep)
    path = run_dir / "results" / "cka.parquet"
    if path.is_file() and len(groups[CL]) >= 2:
        cka = pd.read_parquet(path)
        cl = [(a, b) for i, a in enumerate(groups[CL]) for b in groups[CL][i + 1:]]
        mixed = [(a, b) for a in groups[CL] for b in groups[MIM]]
        within_mim = [(a, b) for i, a in enumerate(groups[MIM]) for b in groups[MIM][i + 1:]]
        to_base = [(a, b) for a in groups[CL] for b in base]
        vals = {f"{a}~{b}": _pair_cka(cka, a, b, depth[a], depth[b], rng) for a, b in cl + mixed + within_mim + to_base}
        key = [f"{a}~{b}" for a, b in cl], [f"{a}~{b}" for a, b in mixed]
        f0 = SIMILARITY_FINDINGS[0]  # re-checked under every measure of a similarity table: vitscope.findings
        # the untrained comparison: CL~CL (the subject) against the CL~untrained pairs
        like = SimilarityLike(f0.claim, f0.source, "CL > MIM", CL)
        m_within, _ = _group(vals, [f"{a}~{b}" for a, b in within_mim])
        base_pairs = [f"{a}~{b}" for a, b in to_base]
        add(like, "CKA of the last blocks (CLS): CL~CL vs CL~MIM pairs",
            {k: vals[k] for k in (*key[0], *key[1], *[f"{a}~{b}" for a, b in within_mim])}, key[0], key[1],
            base_pairs, vals, {"within_mim": m_within, "untrained_models": ", ".join(base)})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class SimilarityLike:
    """The similarity finding in `check`'s terms: its groups are pairs of models, and its departure compares the
    CL~CL and CL~MIM pairs with the CL~untrained ones."""

    claim: str
    source: str
    expect: str
    subject: str
    semantic: bool = False
    names: ClassVar[dict[str, str]] = {CL: "CL~CL", MIM: "CL~MIM"}
    base_name: ClassVar[str] = "the CL~untrained pairs"

    def sign(self) -> int:
        return _claimed_sign(self.expect, self.subject)


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
    lines = ["| finding | measure | contrastive | MIM | untrained | CL - MIM (95 % interval) | holds? | why |",
             "|---|---|---|---|---|---|---|---|"]
    word = {HOLDS: "yes", CONTRADICTED: "**no**", INCONCLUSIVE: "inconclusive", UNKNOWN: "n/a (no uncertainty)"}
    for r in table.itertuples():
        interval = "" if np.isnan(r.difference_lo) else f" ({r.difference_lo:+.3g} to {r.difference_hi:+.3g})"
        mark = " †" if getattr(r, "semantic", False) else ""
        within = getattr(r, "within_mim", float("nan"))
        mim = f"{r.mim:.3g}" + ("" if pd.isna(within) else f" (MIM~MIM {within:.3g})")
        base = "-" if pd.isna(getattr(r, "untrained", float("nan"))) else f"{r.untrained:.3g}"
        lines.append(f"| {r.finding}{mark} {r.source} | {r.measure} ({r.expected}) | {r.contrastive:.3g} | {mim} "
                     f"| {base} | {r.difference:+.3g}{interval} | {word[r.verdict]} | {getattr(r, 'reason', '')} |")
    lines.append("")
    lines.append("holds = the 95 % interval of the difference over images (parametric bootstrap from the tables' "
                 "standard errors; `vitscope.zoo.findings`) lies on the expected side of 0, and the group the "
                 "finding is about has moved from the untrained network in the claimed direction beyond its "
                 "interval; inconclusive = either is within noise. †: rests on MIM semantics (k-NN, probes, "
                 "retrieval).")
    return "\n".join(lines)
