"""Confidence intervals of means over a few independent units (pure functions).

The tables' intervals of proportions are Wilson's (`vitscope.metrics.semantics.binomial_interval`); the ones here
are for means whose units are few or come in clusters, where value ± 1.96 stderr covers less than 95 %
(benchmarks/calibration.py measures each; docs/CALIBRATION.md):

* `t_quantile`: Student's t instead of the normal quantile, for a standard error estimated from ``G`` units
  (``G - 1`` degrees of freedom): 12.7 for 2 units, 2.36 for 8, 2.05 for 30 (1.96 at infinity).
* `cluster_interval` / `ratio_interval`: a mean over items that come in clusters (objects in videos, keypoints in
  image pairs) whose items are not independent: the ratio ``θ = Σ_g y_g / Σ_g n_g`` of the clusters' totals
  ``y_g`` and sizes ``n_g``, with the cluster-robust (linearised) standard error

      se² = G / (G - 1) · Σ_g (y_g - θ n_g)² / (Σ_g n_g)²

  and ``θ ± t_quantile(G - 1) · se``. With one item per cluster it is the plain ``s / √G`` and the t interval
  of a mean; with independent items it agrees with the item-level error, and with items that share their
  cluster's difficulty it grows by the design effect that an item-level error misses.
* `mean_interval`: the t interval of a mean over a few independent draws along an axis (STIR's repeats).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["cluster_interval", "mean_interval", "ratio_interval", "t_quantile"]

#: the two-sided 95 % quantile of the normal: intervals of means over many units are value ± Z95 · stderr
Z95 = 1.959964


def t_quantile(df: float | np.ndarray, level: float = 0.95) -> float | np.ndarray:
    """The two-sided ``level`` quantile of Student's t with ``df`` degrees of freedom (NaN for ``df < 1``), elementwise
    for an array."""
    from scipy.stats import t

    d = np.asarray(df, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        q = np.where(d >= 1, t.ppf(0.5 + level / 2, np.where(d >= 1, d, 1.0)), np.nan)
    return float(q) if q.ndim == 0 else q


def mean_interval(values: np.ndarray, level: float = 0.95) -> dict[str, np.ndarray]:
    """Over axis 0 of ``values`` (independent draws, e.g. repeats), NaN-aware: ``mean``, ``spread`` (the sample
    standard deviation; 0 for one draw), ``stderr`` = spread / √n and the t interval ``value_lo``, ``value_hi`` =
    mean ± t_quantile(n - 1) · stderr, n the finite draws (stderr and interval NaN for fewer than two)."""
    arr = np.asarray(values, dtype=np.float64)
    fin = np.isfinite(arr)
    n = fin.sum(0)
    with np.errstate(all="ignore"):
        mean = np.where(n > 0, np.where(fin, arr, 0.0).sum(0) / np.maximum(n, 1), np.nan)
        dev = np.where(fin, arr - mean, 0.0)
        sd = np.where(n > 1, np.sqrt((dev * dev).sum(0) / np.maximum(n - 1, 1)), np.where(n > 0, 0.0, np.nan))
        se = np.where(n > 1, sd / np.sqrt(np.maximum(n, 1)), np.nan)
        half = t_quantile(n - 1, level) * se
    return {"mean": mean, "spread": sd, "stderr": se, "value_lo": mean - half, "value_hi": mean + half}


def ratio_interval(sum_y: float, sum_n: float, sum_yy: float, sum_yn: float, sum_nn: float, clusters: int,
                   level: float = 0.95) -> tuple[float, float, float, float]:
    """``(θ, stderr, low, high)`` of the ratio ``θ = Σ y_g / Σ n_g`` over ``clusters`` clusters, from the moments
    ``Σ y_g``, ``Σ n_g``, ``Σ y_g²``, ``Σ y_g n_g``, ``Σ n_g²`` (so a stream keeps five sums, not every cluster):
    the cluster-robust standard error of the module docstring and the t interval with ``clusters - 1`` degrees of
    freedom. The standard error and the interval are NaN with fewer than two clusters; all four without items."""
    if not sum_n > 0:
        return (float("nan"),) * 4
    theta = sum_y / sum_n
    g = int(clusters)
    if g < 2:
        return theta, float("nan"), float("nan"), float("nan")
    resid = max(sum_yy - 2 * theta * sum_yn + theta * theta * sum_nn, 0.0)  # Σ (y_g - θ n_g)², clamped: rounding
    se = math.sqrt(g / (g - 1) * resid) / sum_n
    half = t_quantile(g - 1, level) * se
    return theta, se, theta - half, theta + half


def cluster_interval(values: np.ndarray, clusters: np.ndarray | None = None, level: float = 0.95
                     ) -> tuple[float, float, float, float]:
    """``(mean, stderr, low, high)`` of the mean of the finite ``values`` (one per item), the items grouped by
    ``clusters`` (a label per item; None: every item its own cluster): `ratio_interval` of the clusters' sums
    and counts. Non-finite values are left out, as items that were not scored."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    c = np.arange(len(v)) if clusters is None else np.asarray(clusters).reshape(-1)
    keep = np.isfinite(v)
    v, c = v[keep], c[keep]
    if not len(v):
        return (float("nan"),) * 4
    _, idx = np.unique(c, return_inverse=True)
    y = np.bincount(idx, weights=v)
    n = np.bincount(idx).astype(np.float64)
    return ratio_interval(float(y.sum()), float(n.sum()), float(y @ y), float(y @ n), float(n @ n), len(y), level)
