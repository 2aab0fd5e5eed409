"""Calibration of every interval the report shows, and of its "within noise" flags (issue 40, item 4).

For each interval kind, data are simulated whose truth is known analytically, then run through the project's own
interval code (the functions the tables call), and the share of the nominal 95 % intervals that contain the truth
is counted over many draws. For each flag, the truth is "no difference" (a score at chance, two models alike) and
the share of draws where the report nevertheless claims a difference is counted: its false-finding rate.

Goal: coverage within 93-97 % for every kind; false-finding rate <= 5 % for every flag. With 1,000 draws the Monte
Carlo error of a coverage near 95 % is 0.7 points (of a rate near 5 %, 0.7 points too).

Interval kinds (the function each simulation calls; docs/CALIBRATION.md says why each method):

  cka             minibatch CKA: `metrics.cka.cka_from_gram_streams`, `cka_stderr_from_gram_streams` (batch means),
                  `analyses.similarity._with_interval` (value ± t(B - 1) stderr). Features x ~ N(0, I_d), y = W x + s e:
                  the population linear CKA is ||W||_F² / (√d ||W Wᵀ + s² I||_F) (the unbiased HSIC_1 estimates
                  ||Cov(x, y)||_F² at any batch size). Compared: ± t(B - 1) stderr, B minibatches.
  accuracy        k-NN / probe / readout / logit-lens accuracies: `metrics.semantics.binomial_interval` (Wilson) of
                  Binomial(n, p) correct decisions; the exact coverage (a sum over the binomial) beside it.
                  Compared: Wald, p ± 1.96 sqrt(p (1 - p) / n).
  shape_bias      `metrics.robustness.shape_bias_tally` / `shape_bias_of_tally`, `analyses.robustness.
                  shape_bias_interval` (Wilson over the shape + texture decisions) of multinomial decisions.
  jf              propagation's J&F: `analyses.dense._interval` clustered by video (t, videos - 1) of per-object
                  scores: video means ~ Beta around the truth, objects ~ Beta around their video's mean.
                  Compared: the former ± 1.96 stderr over objects.
  pck             correspondence's PCK: per-pair moment sums, `metrics.intervals.ratio_interval` (clustered by
                  pair, t); pair difficulty ~ Beta around the truth, correct keypoints ~ Binomial.
                  Compared: the former binomial ± 1.96 sqrt(p (1 - p) / keypoints).
  retrieval       mAP: `analyses.dense._interval` over queries (t); per-query AP ~ Beta around the truth.
  stir            STIR's repeats: `analyses.invariance._repeat_interval` (t, repeats - 1) of per-repeat values,
                  normal or skewed (shifted Gamma). Compared: ± 1.96 spread / √repeats.
  image_mean      means over images (attention, geometry, mechanistic): `analyses.attention.stderr_from_sums`,
                  value ± 1.96 stderr, of log-normal per-image values.
  similarity      every measure of the similarity analysis: `metrics.similarity.jackknife_replicates` (delete a
                  group of 20) and `jackknife_interval` (value ± t(19) stderr) on two 16-wide views of a shared
                  4-dimensional latent, 120 examples (the ratio of 2,000 images to ViT-S's 384 channels); truth:
                  the measure's mean at that n over 1,000 independent draws (these measures are biased in n).

Flags (the summary's own functions on simulated tables):

  semantics_chance     `report.summary.semantics`: "within noise of chance" when the best layer's Wilson interval,
                       at the Bonferroni level over the layers it was chosen from, reaches the majority-class rate;
                       truth: every layer at chance. Compared: the best layer's own 95 % interval (before).
  semantics_untrained  the same sentence's "within noise of the untrained model" (best layer of each).
  dense_chance         `report.summary._best_layer` ("no layer above chance": the best row's `value_lo`,
                       Bonferroni over the layers, t, reaches chance); truth: every layer at chance. Compared: 1.96
                       standard errors of the best layer (before).
  readout_chance       `analyses.robustness.chance_reason` (a readout's clean accuracy within noise of chance).
  attention_untrained  `report.summary.attention_distance`: "within noise of the untrained model" (late layers).

    python benchmarks/calibration.py              # every kind and flag, 1,000 draws each (a few minutes, 2 cores)
    python benchmarks/calibration.py --quick      # the headline setting of each, 200 draws (seconds)
    python benchmarks/calibration.py --draws 5000 --only cka accuracy --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.stats import binom, norm

from vitscope.analyses import dense as AD
from vitscope.analyses import invariance as AI
from vitscope.analyses import robustness as AR
from vitscope.analyses.attention import stderr_from_sums
from vitscope.analyses.similarity import _with_interval
from vitscope.metrics import cka as C
from vitscope.metrics import intervals as I
from vitscope.metrics import robustness as R
from vitscope.metrics import semantics as S
from vitscope.metrics.intervals import Z95
from vitscope.report import summary as SU
from vitscope.threads import few_threads

NOMINAL = 0.95
GOAL_COVERAGE = (0.93, 0.97)
GOAL_FALSE_FINDING = 0.05


# ------------------------------------------------------------------------------------------------------ helpers


def _covered(lo: Iterable[float], hi: Iterable[float], truth: float | np.ndarray) -> np.ndarray:
    """Per draw: the interval holds the truth (a NaN interval does not)."""
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return (lo <= truth) & (truth <= hi)


def _result(kind: str, setting: str, method: str, hits: np.ndarray, compare: dict[str, np.ndarray] | None = None,
            **extra: Any) -> dict[str, Any]:
    """The dict every `coverage_*` returns: coverage of the tables' method over the draws, and of the methods it is
    compared with on the same draws (``compare``: label -> hits)."""
    hits = np.asarray(hits, dtype=bool)
    return {"kind": kind, "setting": setting, "method": method, "nominal": NOMINAL, "draws": int(hits.size),
            "coverage": float(hits.mean()), "mc_error": float(math.sqrt(NOMINAL * (1 - NOMINAL) / hits.size)),
            "compare": {k: float(np.asarray(v, dtype=bool).mean()) for k, v in (compare or {}).items()}, **extra}


def _flag_result(flag: str, setting: str, method: str, false: np.ndarray, compare: dict[str, np.ndarray] | None = None,
                 **extra: Any) -> dict[str, Any]:
    """The dict every `false_finding_*` returns: the share of draws (truth: no difference) that claim one."""
    false = np.asarray(false, dtype=bool)
    return {"kind": flag, "setting": setting, "method": method, "nominal": 1 - NOMINAL, "draws": int(false.size),
            "false_finding": float(false.mean()),
            "compare": {k: float(np.asarray(v, dtype=bool).mean()) for k, v in (compare or {}).items()}, **extra}


def _beta(rng: np.random.Generator, mean: np.ndarray | float, concentration: float, size: Any = None) -> np.ndarray:
    """Beta draws with the given mean and concentration a + b."""
    m = np.clip(np.asarray(mean, dtype=np.float64), 1e-6, 1 - 1e-6)
    return rng.beta(m * concentration, (1 - m) * concentration, size=size)


# ------------------------------------------------------------------------------------------------- CKA (minibatch)


def cka_truth(weights: np.ndarray, noise: float) -> float:
    """Population linear CKA of x ~ N(0, I_d) and y = W x + noise · e (e ~ N(0, I)): HSIC(x, y) = ||Cov(x, y)||_F² =
    ||W||_F², HSIC(x, x) = ||I_d||_F² = d, HSIC(y, y) = ||W Wᵀ + noise² I||_F²."""
    d = weights.shape[1]
    syy = weights @ weights.T + noise ** 2 * np.eye(weights.shape[0])
    return float(np.sum(weights ** 2) / (math.sqrt(d) * np.linalg.norm(syy)))


def coverage_cka(draws: int, seed: int, batches: int = 16, batch_size: int = 32, dim: int = 16,
                 noise: float = 1.0, chunk: int = 100) -> dict[str, Any]:
    """Minibatch CKA's interval (value ± t(B - 1) stderr, the cka table's) over ``batches`` minibatches of
    ``batch_size`` images, ``dim`` features per side. Draws go through the table's functions in chunks: the draws of
    a chunk are the "taps" of one call (the diagonal of the tap x tap grid is each draw's CKA). One thread: small
    products (on 2 shared cores, 3x faster than two threads)."""
    with few_threads():
        return _coverage_cka(draws, seed, batches, batch_size, dim, noise, chunk)


def _coverage_cka(draws: int, seed: int, batches: int, batch_size: int, dim: int, noise: float, chunk: int
                  ) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((dim, dim)) / math.sqrt(dim)
    truth = cka_truth(w, noise)
    values, ses = [], []
    for start in range(0, draws, chunk):
        k = min(chunk, draws - start)
        x = rng.standard_normal((k, batches, batch_size, dim))
        y = x @ w.T + noise * rng.standard_normal((k, batches, batch_size, dim))
        gx = torch.from_numpy(np.einsum("gbid,gbjd->gbij", x, x))
        gy = torch.from_numpy(np.einsum("gbid,gbjd->gbij", y, y))
        streams_a, streams_b = [list(g) for g in gx], [list(g) for g in gy]
        values.append(C.cka_from_gram_streams(streams_a, streams_b).diagonal().numpy())
        ses.append(C.cka_stderr_from_gram_streams(streams_a, streams_b).diagonal().numpy())
    v, se = np.concatenate(values), np.concatenate(ses)
    shipped = [_with_interval(float(a), float(b), batches) for a, b in zip(v, se, strict=True)]
    hits = _covered([r["value_lo"] for r in shipped], [r["value_hi"] for r in shipped], truth)
    return _result("cka", f"{batches} batches x {batch_size}, d={dim}, CKA {truth:.2f}",
                   f"value ± t({batches - 1}) stderr (batch means)", hits,
                   {"value ± 1.96 stderr (before)": _covered(v - Z95 * se, v + Z95 * se, truth)},
                   truth=truth, mean_value=float(v.mean()), sd_value=float(v.std()), mean_stderr=float(se.mean()))


# ------------------------------------------------------------------------------------------------- proportions


def wald_interval(p: float, n: int) -> tuple[float, float]:
    """The naive interval p ± 1.96 sqrt(p (1 - p) / n) (what a harness must catch under-covering at small n p)."""
    half = Z95 * math.sqrt(p * (1 - p) / n)
    return p - half, p + half


def exact_coverage(n: int, p: float, interval: Callable[[float, int], tuple[float, ...]] = S.binomial_interval
                   ) -> float:
    """The coverage of ``interval`` at (n, p) computed exactly: the binomial probability of the counts whose interval
    holds p."""
    ks = np.arange(n + 1)
    holds = np.array([(lambda iv: iv[0] <= p <= iv[1])(interval(k / n, n)) for k in ks])
    return float(binom.pmf(ks, n, p)[holds].sum())


def coverage_accuracy(draws: int, seed: int, n: int = 100, p: Iterable[float] = (0.1, 0.3, 0.5, 0.7, 0.9)
                      ) -> dict[str, Any]:
    """Accuracies' Wilson interval (`binomial_interval`, as semantics, the robustness readouts and the mechanistic
    lenses call it) on ``n`` test images; draw i's true accuracy is ``p[i % len(p)]``."""
    rng = np.random.default_rng(seed)
    ps = np.resize(np.asarray(list(p), dtype=np.float64), draws)
    k = rng.binomial(n, ps)
    wilson = [S.binomial_interval(float(c) / n, n) for c in k]
    wald = [wald_interval(float(c) / n, n) for c in k]
    hits = _covered([w[0] for w in wilson], [w[1] for w in wilson], ps)
    exact = {float(q): exact_coverage(n, float(q)) for q in dict.fromkeys(ps.tolist())}
    return _result("accuracy", f"n={n}, p in {{{', '.join(f'{q:g}' for q in exact)}}}", "Wilson", hits,
                   {"Wald p ± 1.96 se": _covered([w[0] for w in wald], [w[1] for w in wald], ps)},
                   exact=exact, exact_min=min(exact.values()))


def coverage_shape_bias(draws: int, seed: int, images: int = 128, shape: float = 0.3, texture: float = 0.5,
                        classes: int = 16) -> dict[str, Any]:
    """The shape bias's Wilson interval (`shape_bias_interval`) from a decision tally of ``images`` cue-conflict
    images (shape class != texture class), each decided by shape, texture or neither with the given
    probabilities; truth shape / (shape + texture)."""
    rng = np.random.default_rng(seed)
    truth = shape / (shape + texture)
    lo, hi = np.empty(draws), np.empty(draws)
    for i in range(draws):
        s = rng.integers(0, classes, images)
        t = (s + rng.integers(1, classes, images)) % classes  # a texture class other than the shape's
        other = (s + 1 + (t == (s + 1) % classes)) % classes  # a class that is neither
        u = rng.random(images)
        d = np.where(u < shape, s, np.where(u < shape + texture, t, other))
        counts = R.shape_bias_of_tally(R.shape_bias_tally(torch.from_numpy(d), torch.from_numpy(s),
                                                          torch.from_numpy(t)))
        iv = AR.shape_bias_interval(counts)
        lo[i], hi[i] = iv["value_lo"], iv["value_hi"]
    return _result("shape_bias", f"{images} images, P(shape, texture) = {shape:g}, {texture:g}; bias {truth:.2f}",
                   "Wilson over shape + texture decisions", _covered(lo, hi, truth))


# ------------------------------------------------------------------------------------------------- dense tasks


def _objects(rng: np.random.Generator, videos: int, objects: tuple[int, int], mean: float, video_conc: float,
             object_conc: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-object scores and video labels: 1 video mean per video around ``mean``, objects around it."""
    counts = rng.integers(objects[0], objects[1] + 1, videos)
    label = np.repeat(np.arange(videos), counts)
    return _beta(rng, _beta(rng, mean, video_conc, videos)[label], object_conc), label


def coverage_jf(draws: int, seed: int, videos: int = 2, objects: tuple[int, int] = (1, 2), mean: float = 0.6,
                video_concentration: float = 8.0, object_concentration: float = 20.0) -> dict[str, Any]:
    """Propagation's J&F interval (`analyses.dense._interval`, clustered by video, t) over ``videos`` videos of
    ``objects`` objects each (the default study: 2 videos of 1-2 objects; DAVIS 2017 val: 30 videos, 61 objects)."""
    rng = np.random.default_rng(seed)
    hits, former = np.zeros(draws, bool), np.zeros(draws, bool)
    for i in range(draws):
        x, label = _objects(rng, videos, objects, mean, video_concentration, object_concentration)
        iv = AD._interval(torch.from_numpy(x), torch.from_numpy(label))
        hits[i] = _covered(iv["value_lo"], iv["value_hi"], mean)
        se = x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else math.nan  # the former stderr over objects
        former[i] = _covered(x.mean() - Z95 * se, x.mean() + Z95 * se, mean)
    return _result("jf", f"{videos} videos x {objects[0]}-{objects[1]} objects", "clustered by video, t", hits,
                   {"former ± 1.96 stderr over objects": former})


def _pairs(rng: np.random.Generator, pairs: int, keypoints: tuple[int, int], mean: float, concentration: float
           ) -> tuple[np.ndarray, np.ndarray]:
    """Per-pair correct keypoints and keypoints: pair difficulty ~ Beta(mean, concentration)."""
    k = rng.integers(keypoints[0], keypoints[1] + 1, pairs)
    return rng.binomial(k, _beta(rng, mean, concentration, pairs)), k


def _pck_interval(c: np.ndarray, k: np.ndarray) -> tuple[float, float, float, float]:
    """The correspondence table's interval from the per-pair sums it keeps (correct, keypoints, correct², correct x
    keypoints, keypoints², pairs)."""
    c, k = c.astype(np.float64), k.astype(np.float64)
    return I.ratio_interval(c.sum(), k.sum(), c @ c, c @ k, k @ k, len(k))


def coverage_pck(draws: int, seed: int, pairs: int = 32, keypoints: tuple[int, int] = (3, 12), mean: float = 0.5,
                 concentration: float = 4.0) -> dict[str, Any]:
    """Correspondence's PCK interval (pair-clustered `ratio_interval`, t) over ``pairs`` pairs with ``keypoints``
    keypoints each; ``concentration`` of the pairs' difficulty (intra-pair correlation 1 / (1 + concentration))."""
    rng = np.random.default_rng(seed)
    hits, former = np.zeros(draws, bool), np.zeros(draws, bool)
    for i in range(draws):
        c, k = _pairs(rng, pairs, keypoints, mean, concentration)
        _, _, lo, hi = _pck_interval(c, k)
        hits[i] = _covered(lo, hi, mean)
        p, n = c.sum() / k.sum(), k.sum()
        half = Z95 * math.sqrt(p * (1 - p) / n)  # the former binomial stderr over keypoints
        former[i] = _covered(p - half, p + half, mean)
    return _result("pck", f"{pairs} pairs x {keypoints[0]}-{keypoints[1]} keypoints, ICC "
                   f"{1 / (1 + concentration):.2f}", "clustered by pair, t", hits,
                   {"former binomial ± 1.96 se over keypoints": former})


def coverage_retrieval(draws: int, seed: int, queries: int = 8, mean: float = 0.5, concentration: float = 3.0
                       ) -> dict[str, Any]:
    """Retrieval's mAP interval (`analyses.dense._interval` over queries, t); per-query AP ~ Beta (8 queries: the
    default study; 70: revisited Oxford)."""
    rng = np.random.default_rng(seed)
    aps = _beta(rng, mean, concentration, (draws, queries))
    ivs = [AD._interval(torch.from_numpy(a)) for a in aps]
    m = aps.mean(1)
    se = aps.std(1, ddof=1) / math.sqrt(queries)
    return _result("retrieval", f"{queries} queries", "stderr over queries, t",
                   _covered([v["value_lo"] for v in ivs], [v["value_hi"] for v in ivs], mean),
                   {"former ± 1.96 stderr": _covered(m - Z95 * se, m + Z95 * se, mean)})


# ------------------------------------------------------------------------------------------------- robustness drops


def coverage_drop(draws: int, seed: int, images: int = 64, clean: float = 0.7, perturbed: float = 0.5,
                  pairing: str = "independent") -> dict[str, Any]:
    """band_noise's and corruptions' accuracy-drop interval (`metrics.robustness.drop_interval`: Newcombe's paired
    interval at the least correlation the two accuracies allow) on ``images`` images seen clean and perturbed.
    Each image's two decisions are drawn jointly with P(both right) at the ``pairing``: 'least' (the Fréchet
    bound the interval assumes: coverage near nominal), 'independent', or 'most' (min of the accuracies: a
    perturbation that only takes right answers away, the usual case: conservative). Truth clean - perturbed."""
    rng = np.random.default_rng(seed)
    low, high = max(0.0, clean + perturbed - 1.0), min(clean, perturbed)
    both = {"least": low, "independent": clean * perturbed, "most": high}[pairing]
    probs = [both, clean - both, perturbed - both, 1.0 - clean - perturbed + both]
    n = rng.multinomial(images, probs, size=draws)
    c, q = (n[:, 0] + n[:, 1]) / images, (n[:, 0] + n[:, 2]) / images
    iv = [R.drop_interval(float(a), float(b), images) for a, b in zip(c, q, strict=True)]
    se = np.sqrt(c * (1 - c) / images + q * (1 - q) / images)  # as if the two were independent samples
    d = c - q
    return _result("drop", f"{images} images, accuracy {clean:g} -> {perturbed:g}, {pairing} pairing",
                   "Newcombe paired, least correlation",
                   _covered([v["value_lo"] for v in iv], [v["value_hi"] for v in iv], clean - perturbed),
                   {"d ± 1.96 unpaired se": _covered(d - Z95 * se, d + Z95 * se, clean - perturbed)})


def coverage_mean_of_views(draws: int, seed: int, images: int = 64,
                           accuracies: tuple[float, ...] = (0.6, 0.5, 0.4, 0.3, 0.2),
                           together: bool = True) -> dict[str, Any]:
    """The mean corruption accuracy's interval (`metrics.robustness.accuracy_interval` of the mean over views of
    the same ``images`` images: Wilson at the mean): view v right on an image when its difficulty u < the view's
    accuracy (``together``: one u per image for every view, the most a mean can vary) or with its own u per view.
    Truth the mean of ``accuracies``."""
    rng = np.random.default_rng(seed)
    acc = np.asarray(accuracies, dtype=np.float64)
    u = rng.random((draws, images, 1 if together else len(acc)))
    mean = (u < acc).mean((1, 2))
    iv = [R.accuracy_interval(float(m), images) for m in mean]
    return _result("mean_of_views", f"{images} images, {len(acc)} views, {'one' if together else 'own'} difficulty "
                   "per image", "Wilson at the mean accuracy",
                   _covered([v["value_lo"] for v in iv], [v["value_hi"] for v in iv], float(acc.mean())))


# ------------------------------------------------------------------------------------------------- STIR, means


def coverage_stir(draws: int, seed: int, repeats: int = 3, mean: float = 0.8, sd: float = 0.02,
                  gamma_shape: float | None = None) -> dict[str, Any]:
    """STIR's repeat interval (`analyses.invariance._repeat_interval`: mean ± t(R - 1) spread / √R) of ``repeats``
    per-repeat values: normal (a repeat's STIR sums HSIC terms over every image: near normal), or, with
    ``gamma_shape`` k, a shifted Gamma(k) of the same mean and sd (skewness 2 / √k)."""
    rng = np.random.default_rng(seed)
    if gamma_shape:
        k = float(gamma_shape)
        vals = mean + sd * (rng.gamma(k, 1.0, (repeats, draws)) - k) / math.sqrt(k)
    else:
        vals = mean + sd * rng.standard_normal((repeats, draws))
    iv = AI._repeat_interval(vals)
    m, se = vals.mean(0), vals.std(0, ddof=1) / math.sqrt(repeats)
    shape = f"skewness {2 / math.sqrt(gamma_shape):.1f}" if gamma_shape else "normal"
    return _result("stir", f"{repeats} repeats, {shape}", "mean ± t(R - 1) stderr",
                   _covered(iv["value_lo"], iv["value_hi"], mean),
                   {"mean ± 1.96 spread / √R": _covered(m - Z95 * se, m + Z95 * se, mean)})


def coverage_image_mean(draws: int, seed: int, images: int = 256, sigma: float = 0.5) -> dict[str, Any]:
    """Means over images (attention, geometry, mechanistic): `stderr_from_sums` and value ± 1.96 stderr, of
    log-normal per-image values (truth exp(sigma² / 2))."""
    rng = np.random.default_rng(seed)
    x = np.exp(sigma * rng.standard_normal((draws, images)))
    sums, sq = torch.from_numpy(x.sum(1)), torch.from_numpy((x * x).sum(1))
    se = stderr_from_sums(sums, sq, images).numpy()
    m = x.mean(1)
    return _result("image_mean", f"{images} images, log-normal sigma {sigma:g}", "value ± 1.96 stderr over images",
                   _covered(m - Z95 * se, m + Z95 * se, math.exp(sigma ** 2 / 2)))


# ------------------------------------------------------------------------------------------------- flags


def _layer_accuracies(rng: np.random.Generator, draws: int, layers: int, n: int, p: float, rho: float) -> np.ndarray:
    """(draws, layers) accuracies on ``n`` images, each layer right with probability ``p``; ``rho``: correlation of
    the layers' latent scores on the same image (0: independent layers, the worst case for a best-of-layers)."""
    u = rng.standard_normal((draws, 1, n))
    e = rng.standard_normal((draws, layers, n))
    latent = math.sqrt(rho) * u + math.sqrt(1 - rho) * e
    return (latent < norm.ppf(p)).mean(2)


def _semantics_rows(model: str, acc: np.ndarray, n: int, chance: float) -> list[dict[str, Any]]:
    """Rows of a semantics table (knn20_top1 on the cls view) as `Semantics._scores` writes them."""
    rows = []
    for layer, a in enumerate(acc):
        lo, hi, se = S.binomial_interval(float(a), n)
        rows.append({"model": model, "metric": "knn20_top1", "token_view": "cls", "layer": layer, "value": float(a),
                     "value_lo": lo, "value_hi": hi, "stderr": se, "chance": chance, "n_test": n})
    return rows


def false_finding_semantics_chance(draws: int, seed: int, layers: int = 8, n: int = 100, classes: int = 10,
                                   rho: float = 0.0, chunk: int = 250) -> dict[str, Any]:
    """`report.summary.semantics` on tables whose every layer is at chance (1 / classes): the share of models it
    does not list as within noise of chance (the summary: the best layer's Wilson interval at the Bonferroni level
    1 - 0.05 / layers). Compared: the best layer's own 95 % Wilson interval (before)."""
    rng = np.random.default_rng(seed)
    chance = 1.0 / classes
    acc = _layer_accuracies(rng, draws, layers, n, chance, rho)
    false = np.zeros(draws, bool)
    for start in range(0, draws, chunk):
        models = [f"m{i}" for i in range(start, min(start + chunk, draws))]
        df = pd.DataFrame([r for i, m in enumerate(models) for r in _semantics_rows(m, acc[start + i], n, chance)])
        (point,) = SU.semantics(df, SU.Study(models=models))
        flagged = set(point.not_above_chance)
        false[start:start + len(models)] = [m not in flagged for m in models]
    z = norm.ppf(1 - 0.025 / layers)
    single = [S.binomial_interval(float(a.max()), n)[0] > chance for a in acc]
    return _flag_result("semantics_chance", f"{layers} layers{'' if layers == 1 else f', rho {rho:g}'}, n={n}, "
                        f"{classes} classes", f"best layer's Bonferroni Wilson (z {z:.2f}) above chance", false,
                        {"the best layer's own 95 % Wilson (before)": np.asarray(single)})


def false_finding_semantics_untrained(draws: int, seed: int, layers: int = 8, n: int = 100, p: float = 0.4,
                                      rho: float = 0.0) -> dict[str, Any]:
    """`report.summary.semantics` with a trained and an untrained model of the same accuracy at every layer: the
    share of draws where the trained one is not called within noise of the untrained one."""
    rng = np.random.default_rng(seed)
    a = _layer_accuracies(rng, draws, layers, n, p, rho)
    b = _layer_accuracies(rng, draws, layers, n, p, rho)
    false = np.zeros(draws, bool)
    for i in range(draws):
        df = pd.DataFrame(_semantics_rows("trained", a[i], n, 0.1) + _semantics_rows("untrained", b[i], n, 0.1))
        (point,) = SU.semantics(df, SU.Study(models=["trained", "untrained"], untrained=["untrained"]))
        false[i] = "the untrained model" not in point.flags
    return _flag_result("semantics_untrained", f"{layers} layers, n={n}, p={p:g}", "|a - b| > 1.96 sqrt(se_a² + "
                        "se_b²) (best layers)", false)


def _dense_best(task: str, layers: int, scores: list[dict[str, Any]], chance: float, model: str) -> dict[str, Any]:
    """The ``best_<metric>`` row `_Dense._best_rows` makes of per-layer rows."""
    metric = AD.Propagation.headline if task == "propagation" else AD.Correspondence.headline
    me = SimpleNamespace(layers=list(range(layers)), name=task)
    rows = [{"metric": metric, "layer": layer, "token_view": "spatial", **r} for layer, r in enumerate(scores)]
    rows.append({"metric": f"{metric}_chance", "layer": None, "token_view": "spatial", "value": chance})
    (best,) = AD._Dense._best_rows(me, rows, metric)  # type: ignore[arg-type]
    return {"model": model, **best}


def false_finding_dense_chance(draws: int, seed: int, task: str = "propagation", layers: int = 8, units: int = 2,
                               chance: float = 0.3, chunk: int = 250) -> dict[str, Any]:
    """`report.summary._best_layer` on tables whose every layer is at chance: the share of models it does not list
    as "no layer above chance" (the summary: the best row's interval, Bonferroni over the layers, t, above chance).
    ``units``: videos (propagation, 1-2 objects each) or pairs (correspondence, 3-12 keypoints each). Compared:
    the best layer's value more than 1.96 standard errors above chance (before)."""
    rng = np.random.default_rng(seed)
    best = []
    for i in range(draws):
        scores = []
        for _ in range(layers):
            if task == "propagation":
                x, label = _objects(rng, units, (1, 2), chance, 8.0, 20.0)
                scores.append({"value": float(x.mean()), **AD._interval(torch.from_numpy(x), torch.from_numpy(label))})
            else:
                c, k = _pairs(rng, units, (3, 12), chance, 4.0)
                v, se, lo, hi = _pck_interval(c, k)
                scores.append({"value": v, "stderr": se, "value_lo": lo, "value_hi": hi, "interval_units": units})
        best.append(_dense_best(task, layers, scores, chance, f"m{i}"))
    point = SU._best_layer(task)
    false = np.zeros(draws, bool)
    for start in range(0, draws, chunk):
        part = pd.DataFrame(best[start:start + chunk])
        models = list(part["model"])
        (p,) = point(part, SU.Study(models=models))
        below = set(p.not_above_chance)
        false[start:start + len(models)] = [m not in below for m in models]
    before = np.array([b["value"] - Z95 * b["stderr"] > chance for b in best])
    what = "videos (1-2 objects)" if task == "propagation" else "pairs (3-12 keypoints)"
    return _flag_result("dense_chance", f"{task}: {layers} layers, {units} {what}",
                        "best row's value_lo (Bonferroni t) above chance (summary)", false,
                        {"best layer > chance + 1.96 stderr (before)": before})


def false_finding_readout_chance(draws: int, seed: int, n: int = 64, classes: int = 10) -> dict[str, Any]:
    """`analyses.robustness.chance_reason` of a readout whose clean accuracy is at chance: the share of draws it
    finds above chance (no reason given, so its bias / robustness figure is reported)."""
    rng = np.random.default_rng(seed)
    chance = 1.0 / classes
    k = rng.binomial(n, chance, draws)
    false = np.array([AR.chance_reason(float(c) / n, n, chance) is None for c in k])
    return _flag_result("readout_chance", f"n={n}, {classes} classes", "Wilson lower bound above chance", false)


def false_finding_attention_untrained(draws: int, seed: int, layers: int = 8, heads: int = 3, rho: float = 1.0,
                                      stderr: float = 0.5) -> dict[str, Any]:
    """`report.summary.attention_distance` with a trained and an untrained model alike at every late layer and head
    (per-head estimates with standard error ``stderr``, correlated ``rho`` across heads and layers: 1 is the worst
    case for the mean-stderr bound): the share of draws not called within noise of the untrained model."""
    rng = np.random.default_rng(seed)
    false = np.zeros(draws, bool)
    for i in range(draws):
        rows = []
        for model in ("trained", "untrained"):
            z = math.sqrt(rho) * rng.standard_normal() + math.sqrt(1 - rho) * rng.standard_normal((layers, heads))
            z = np.broadcast_to(z, (layers, heads))
            rows += [{"model": model, "metric": "distance_px", "layer": layer, "head": h,
                      "value": 10.0 + stderr * float(z[layer, h]), "stderr": stderr}
                     for layer in range(layers) for h in range(heads)]
        (point,) = SU.attention_distance(pd.DataFrame(rows), SU.Study(models=["trained", "untrained"],
                                                                      untrained=["untrained"]))
        false[i] = "the untrained model" not in point.flags
    return _flag_result("attention_untrained", f"{layers} layers x {heads} heads, rho {rho:g}",
                        "|a - b| > 1.96 sqrt(se_a² + se_b²) (late mean, mean stderr)", false)


# ------------------------------------------------------------------------------------------------- the table

#: (function, settings): the headline setting first (the one --quick runs); the default study's sizes where it has
#: the kind (500 CIFAR-10 images in CKA batches of 32, 100 semantics test images, 64 robustness test images, 128
#: cue-conflict images, 2 videos, 32 pairs, 8 queries), then the sources' sizes and harder cases
# ------------------------------------------------------------------------------------------------- similarity


def _latent_pair(rng: np.random.Generator, n: int, a: np.ndarray, b: np.ndarray, noise: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Two views of one latent z ~ N(0, I_q): x = z A + noise e, y = tanh(z B) + noise e' (a nonlinear relation, so
    no measure is at a boundary of its range)."""
    z = rng.standard_normal((n, a.shape[0]))
    return (z @ a + noise * rng.standard_normal((n, a.shape[1])),
            np.tanh(z @ b) + noise * rng.standard_normal((n, b.shape[1])))


def coverage_similarity(draws: int, seed: int, n: int = 120, dim: int = 16, groups: int = 10, k: int = 5,
                        rsa_images: int = 40, truth_draws: int | None = None,
                        measures: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The similarity analysis' jackknife intervals (`metrics.similarity.jackknife_replicates` over ``groups``
    groups, `jackknife_interval`: value ± t(G - 1) stderr) of every measure, on ``n`` examples of two ``dim``-wide
    views of a 4-dimensional latent (`_latent_pair`; n / dim about the ratio of 2,000 images to ViT-S's 384
    channels). Truth: the measure's expectation at this n, the mean over ``truth_draws`` independent draws (these
    measures are biased in n, so the interval claims the value at the table's ``n_images``, not at infinity).
    One result per measure."""
    from vitscope.metrics import similarity as M

    measures = list(measures or M.MEASURES)
    rev = [m for m in M.ASYMMETRIC if m in measures]
    setup = np.random.default_rng([seed, 0])
    a, b = setup.standard_normal((4, dim)), setup.standard_normal((4, dim))

    def values(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        px, py = (M.prepare(v, measures, k=k, rsa_images=rsa_images) for v in (x, y))
        return M.compare_grid([px], [py], [(0, 0)], measures, reverse=rev)[0, 0]

    truth: dict[str, list[float]] = {}
    for t in range(truth_draws or 1000):
        for m, v in values(*_latent_pair(np.random.default_rng([seed, 1, t]), n, a, b, 1.0)).items():
            truth.setdefault(m, []).append(v)
    mean = {m: float(np.mean(v)) for m, v in truth.items()}
    hits: dict[str, list[bool]] = {}
    narrow: dict[str, list[bool]] = {}
    for d in range(draws):
        x, y = _latent_pair(np.random.default_rng([seed, 2, d]), n, a, b, 1.0)
        reps = M.jackknife_replicates([x], [y], [(0, 0)], groups, measures, k=k, rsa_images=rsa_images,
                                      reverse=rev)[0, 0]
        for m, v in values(x, y).items():
            se, lo, hi = M.jackknife_interval(v, reps[m], M.range_of(m))
            hits.setdefault(m, []).append(bool(lo <= mean[m] <= hi))
            q = (hi - lo) / 8  # a quarter of the interval's half-width: the harness must see it under-cover
            narrow.setdefault(m, []).append(bool(v - q <= mean[m] <= v + q))
    return [_result("similarity", f"{m}, n {n}, width {dim}, {groups} groups", "delete-a-group jackknife, t",
                    np.array(h), {"a quarter as wide": np.array(narrow[m])}, truth=mean[m])
            for m, h in hits.items()]


SUITE: list[tuple[Callable[..., dict[str, Any]], list[dict[str, Any]]]] = [
    (coverage_cka, [dict(batches=16, noise=1.0), dict(batches=16, noise=0.3), dict(batches=16, noise=3.0),
                    dict(batches=4, noise=1.0), dict(batches=64, batch_size=64, dim=32, noise=1.0)]),
    (coverage_accuracy, [dict(n=100), dict(n=64), dict(n=20), dict(n=1000, p=(0.01, 0.05, 0.5, 0.95))]),
    (coverage_shape_bias, [dict(), dict(shape=0.05, texture=0.6), dict(images=1280, shape=0.2, texture=0.6)]),
    (coverage_jf, [dict(), dict(videos=8), dict(videos=30, objects=(1, 4))]),
    (coverage_pck, [dict(), dict(pairs=500), dict(concentration=1000.0), dict(pairs=8, concentration=2.0)]),
    (coverage_retrieval, [dict(), dict(queries=70)]),
    (coverage_stir, [dict(), dict(repeats=2), dict(gamma_shape=8.0), dict(repeats=5, gamma_shape=8.0),
                     dict(gamma_shape=2.0)]),
    (coverage_image_mean, [dict(), dict(images=32)]),
    (coverage_drop, [dict(), dict(pairing="least"), dict(pairing="most"), dict(images=500, clean=0.9, perturbed=0.85,
                                                                             pairing="least")]),
    (coverage_mean_of_views, [dict(), dict(together=False)]),
    (coverage_similarity, [dict()]),
    (false_finding_semantics_chance, [dict(layers=1), dict(layers=8), dict(layers=8, rho=0.5)]),
    (false_finding_semantics_untrained, [dict()]),
    (false_finding_dense_chance, [dict(), dict(units=30), dict(task="correspondence", units=32)]),
    (false_finding_readout_chance, [dict(), dict(n=500)]),
    (false_finding_attention_untrained, [dict(), dict(rho=0.3)]),
]


def false_finding_limit(draws: int) -> float:
    """The highest measured false-finding rate that meets the goal: 5 % plus the one-sided Monte Carlo margin
    1.645 sqrt(0.05 · 0.95 / draws) (a flag exactly at 5 % measures above 5 % half the time; 6.1 % at 1,000 draws)."""
    return GOAL_FALSE_FINDING + 1.645 * math.sqrt(GOAL_FALSE_FINDING * (1 - GOAL_FALSE_FINDING) / draws)


def meets_goal(r: dict[str, Any], value: float | None = None) -> bool:
    """Coverage within 93-97 %; a false-finding rate within `false_finding_limit`."""
    if "false_finding" in r:
        return (r["false_finding"] if value is None else value) <= false_finding_limit(r["draws"])
    v = r["coverage"] if value is None else value
    return GOAL_COVERAGE[0] <= v <= GOAL_COVERAGE[1]


def run(draws: int, seed: int, quick: bool = False, only: Iterable[str] | None = None,
        log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every kind and flag of `SUITE` (``quick``: the headline setting of each), each setting with its own seed."""
    only = set(only or [])
    out = []
    for k, (fn, settings) in enumerate(SUITE):
        name = fn.__name__.removeprefix("coverage_").removeprefix("false_finding_")
        if only and name not in only:
            continue
        for j, setting in enumerate(settings[:1] if quick else settings):
            t0 = time.perf_counter()
            with warnings.catch_warnings(), few_threads():
                warnings.simplefilter("ignore")
                got = fn(draws, seed + 1000 * k + j, **setting)
            for r in got if isinstance(got, list) else [got]:  # similarity: one result per measure
                r["seconds"] = time.perf_counter() - t0
                out.append(r)
                if log:
                    log(f"{name}: {r['setting']} ({r['seconds']:.1f} s)")
    return out


def table(results: list[dict[str, Any]]) -> str:
    """One row per result and per compared method: kind, setting, method, nominal, coverage, false-finding rate,
    draws, goal (coverage 93-97 %, false-finding <= 5 %)."""
    head = ("kind", "setting", "method", "nominal", "coverage", "false-finding", "draws", "goal")
    rows = [head]
    for r in results:
        flag = "false_finding" in r
        for method, v in [(r["method"], r["false_finding" if flag else "coverage"]), *r["compare"].items()]:
            compared = method != r["method"]
            cells = (r["kind"], r["setting"], ("  vs " if compared else "") + method, f"{r['nominal']:.0%}",
                     "" if flag else f"{v:.1%}", f"{v:.1%}" if flag else "", str(r["draws"]),
                     ("ok" if meets_goal(r, v) else "MISS") if not compared else
                     ("(ok)" if meets_goal(r, v) else "(miss)"))
            rows.append(cells)
        if "exact_min" in r:
            rows.append(("", "", "  exact (binomial sum), lowest p", "", f"{r['exact_min']:.1%}", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=None, help="draws per setting (default 1000; 200 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the headline setting of each kind, 200 draws")
    ap.add_argument("--only", nargs="*", default=None, help="kinds / flags by name (e.g. cka accuracy dense_chance)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a kind or flag misses its goal")
    args = ap.parse_args(argv)
    draws = args.draws or (200 if args.quick else 1000)
    t0 = time.perf_counter()
    results = run(draws, args.seed, args.quick, args.only, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(table(results))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{datetime.date.today()}, {time.perf_counter() - t0:.0f} s, load average {load:.2f} on "
          f"{os.cpu_count()} cores; seed {args.seed}. Goal: coverage {GOAL_COVERAGE[0]:.0%}-{GOAL_COVERAGE[1]:.0%}, "
          f"false-finding <= {GOAL_FALSE_FINDING:.0%} (+ Monte Carlo margin: <= {false_finding_limit(draws):.1%} at "
          f"{draws} draws); '(ok)' / '(miss)': a compared method against the same goal.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 1 if args.strict and not all(meets_goal(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
