"""Delete-a-group jackknife of the similarity measures (`vitscope.metrics.similarity`): the replicates, each
matrix's neighbour lists searched once long and filtered per group, and the interval."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from vitscope.metrics.intervals import t_quantile
from vitscope.metrics.similarity.comparison import compare_grid
from vitscope.metrics.similarity.prepared import (
    DEFAULT_MEASURES,
    SUBSPACE_K,
    Prepared,
    _check_k,
    _check_measures,
    _cosines,
    _matrix,
    _neighbour_lists,
    _top_k,
    prepare,
)


def jackknife_replicates(xs: Sequence[Any], ys: Sequence[Any], pairs: Iterable[tuple[int, int]], groups: int,
                         measures: Iterable[str] = DEFAULT_MEASURES, k: int = 10, rsa_images: int | None = None,
                         alphas: Sequence[float] = (0.0, 0.5, 1.0), ridge: float = 1e-3, reverse: Iterable[str] = (),
                         subspace_k: int = SUBSPACE_K, subspace_space: str = "auto"
                         ) -> dict[tuple[int, int], dict[str, list[float]]]:
    """The measures of each ``(i, j)`` of ``pairs`` (``xs[i]`` against ``ys[j]``, matrices of the same n examples)
    computed again without each of ``groups`` groups of examples: example r is in group ``r % groups`` (deal the
    rows in a random order beforehand for random groups). The RDM keeps the first ``rsa_images`` examples that are
    left; the subspace similarity compares ``subspace_k`` directions in ``subspace_space``. A matrix is prepared
    once per group for all the pairs it is in. Returns {pair: {metric: [the value without group g for g in
    0..groups-1]}}, for `jackknife_interval`."""
    pairs = list(dict.fromkeys((int(i), int(j)) for i, j in pairs))
    measures, reverse = _check_measures(measures), list(reverse)
    n = len(xs[pairs[0][0]]) if pairs else 0
    out: dict[tuple[int, int], dict[str, list[float]]] = {pair: {} for pair in pairs}
    rows_a, rows_b = sorted({i for i, _ in pairs}), sorted({j for _, j in pairs})
    m_rsa = n if rsa_images is None else min(int(rsa_images), n)
    mats = {("x", i): _matrix(xs[i], f"x{i}") for i in rows_a} | {("y", j): _matrix(ys[j], f"y{j}") for j in rows_b}
    neighbours = [m for m in measures if m in ("mutual_knn", "cknna")]
    rest = [m for m in measures if m not in neighbours]
    # each matrix's neighbour lists once, long enough that a group's deletion leaves k in nearly every row
    lists = {key: _long_lists(a, k, groups) for key, a in mats.items()} if neighbours else {}
    for g in range(groups):
        keep = np.flatnonzero(np.arange(n) % groups != g)
        kw = dict(k=k, rsa_images=int((keep < m_rsa).sum()), subspace_k=subspace_k)

        def prep(key: tuple[str, int], keep: np.ndarray = keep, kw: dict = kw) -> Prepared:
            p = prepare(mats[key][keep], rest, name=f"{key[0]}{key[1]}", **kw) if rest else Prepared(n=len(keep))
            if neighbours:
                _check_k(k, len(keep))
                p.knn, p.knn_sim = _lists_without(*lists[key], keep, k)
            return p

        # a replicate's products of n rows at float32 (`Prepared.single`): replicates differ from each other by
        # about the stderr / sqrt(groups) (1e-3 and more), the products' rounding by about 1e-6
        pa = [prep(("x", i)).single() for i in rows_a]
        pb = [prep(("y", j)).single() for j in rows_b]
        got = compare_grid(pa, pb, [(rows_a.index(i), rows_b.index(j)) for i, j in pairs], measures, alphas=alphas,
                           ridge=ridge, reverse=reverse, subspace_space=subspace_space)
        for i, j in pairs:
            for metric, v in got[rows_a.index(i), rows_b.index(j)].items():
                out[i, j].setdefault(metric, []).append(v)
    return out


def _long_lists(a: np.ndarray, k: int, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_neighbour_lists` about twice as long as k plus what a group's deletion takes from a list."""
    return _neighbour_lists(a, min(a.shape[0] - 1, 2 * int(np.ceil(k * groups / max(groups - 1, 1))) + 8))


def _lists_without(z: np.ndarray, idx: np.ndarray, sim: np.ndarray, keep: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest neighbours among the rows ``keep`` (sorted) of each of them, numbered among them: the
    first k kept entries of its long list (`_long_lists`). Deleting rows keeps the order of the others and their
    column order, which breaks ties, so these are the lists `prepare` finds on ``z[keep]``; a row left with fewer
    than k kept entries is searched again."""
    new = np.full(z.shape[0], -1)
    new[keep] = np.arange(len(keep))
    cand = new[idx[keep]]
    ok = cand >= 0
    take = ok & (np.cumsum(ok, axis=1) <= k)
    short = take.sum(1) < k
    knn = np.empty((len(keep), k), dtype=idx.dtype)
    knn_sim = np.empty((len(keep), k))
    full = ~short
    knn[full] = cand[full][take[full]].reshape(-1, k)
    knn_sim[full] = sim[keep][full][take[full]].reshape(-1, k)
    for r in np.flatnonzero(short):  # rare: most of its list was deleted
        row = _cosines(z[keep[r]], z[keep])
        row[r] = -np.inf
        knn[r] = _top_k(row[None, :], k)[0]
        knn_sim[r] = row[knn[r]]
    return knn, knn_sim


def jackknife_interval(value: float, replicates: Sequence[float], bounds: tuple[float, float] = (-np.inf, np.inf),
                       level: float = 0.95) -> tuple[float, float, float]:
    """``(stderr, low, high)`` of a delete-a-group jackknife: ``replicates`` are the statistic computed without
    each of G groups; ``stderr² = (G - 1) / G · Σ (v_g - mean v)²`` (Efron & Stein: it overstates the variance
    rather than understates it) and ``value ± t(G - 1) · stderr``, clipped to ``bounds``. NaN without two
    finite replicates."""
    v = np.asarray(replicates, dtype=np.float64)
    g = len(v)
    if g < 2 or not np.isfinite(v).all() or not np.isfinite(value):
        return (float("nan"),) * 3
    se = float(np.sqrt((g - 1) / g * ((v - v.mean()) ** 2).sum()))
    half = t_quantile(g - 1, level) * se
    return se, float(max(value - half, bounds[0])), float(min(value + half, bounds[1]))
