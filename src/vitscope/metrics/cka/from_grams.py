"""Minibatch CKA matrices between taps from their Grams (stacked, listed per minibatch, or kept per tap as a
Gram cache does) and the standard error of the per-tap streams' CKA by batch means."""

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from vitscope.metrics.cka.common import MIN_HSIC1_EXAMPLES, ArrayLike, _check_square, _to_float64
from vitscope.metrics.cka.hsic import _check_hsic1_size, _combine_hsic1_terms, hsic1, hsic1_cross

# ----------------------------------------------------------------------------------------------------------
# CKA from Grams
# ----------------------------------------------------------------------------------------------------------


def _batch_weights(weights: ArrayLike | Sequence[float] | None, num_batches: int) -> torch.Tensor:
    """Validated non-negative float64 weights of shape ``(num_batches,)``; ``None`` means all ones."""
    if weights is None:
        return torch.ones(num_batches, dtype=torch.float64)
    if isinstance(weights, torch.Tensor):
        w = _to_float64(weights)
    else:
        w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    if w.shape != (num_batches,):
        raise ValueError(f"weights must have shape ({num_batches},), one per minibatch, got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and non-negative")
    return w


def _cka_ratio(cross: torch.Tensor, self_a: torch.Tensor, self_b: torch.Tensor) -> torch.Tensor:
    """``cross[a, c] / sqrt(self_a[a] * self_b[c])``; NaN where the denominator is not positive."""
    denom = self_a[:, None] * self_b[None, :]
    positive = denom > 0
    safe = torch.where(positive, denom, torch.ones_like(denom))
    nan = torch.full_like(cross, math.nan)
    return torch.where(positive, cross / torch.sqrt(safe), nan)


_Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _hsic1_parts(g: torch.Tensor, w: torch.Tensor, fresh: bool = False) -> tuple[_Parts, _Parts, bool]:
    """Left and right parts of the three HSIC_1 terms of ``(A, B, n, n)`` float64 Grams, every minibatch
    laid side by side: left ``(w_b vec(K̃), w_b 1ᵀK̃1, w_b K̃ᵀ1)``, right ``(vec(K̃ᵀ), 1ᵀK̃1, K̃1)``, shapes
    ``(A, B*n*n)``, ``(A, B)``, ``(A, B*n)``. ``left(K) @ right(L).T`` sums each term over minibatches for
    every pair of taps: ``Σ_b w_b tr(K̃L̃)``, ``Σ_b w_b (1ᵀK̃1)(1ᵀL̃1)``, ``Σ_b w_b 1ᵀK̃L̃1``. Also returns
    whether every Gram is exactly symmetric. ``fresh``: ``g`` is a temporary whose diagonal may be zeroed
    in place."""
    A, B, n = g.shape[0], g.shape[1], g.shape[-1]
    kt = g if fresh else g.clone()
    kt.diagonal(dim1=-2, dim2=-1).zero_()
    rows, cols = kt.sum(dim=-1), kt.sum(dim=-2)  # K̃1, K̃ᵀ1: (A, B, n)
    total = rows.sum(dim=-1)
    symmetric = torch.equal(kt, kt.transpose(-1, -2))
    right = ((kt if symmetric else kt.transpose(-1, -2)).reshape(A, B * n * n), total, rows.reshape(A, B * n))
    if bool((w != 1).any()):
        kt, total, cols = kt * w[:, None, None], total * w, cols * w[:, None]
    return (kt.reshape(A, B * n * n), total, cols.reshape(A, B * n)), right, symmetric


def _weighted_hsic_sums(
    ga: torch.Tensor, gb: torch.Tensor | None, w: torch.Tensor, fresh: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted sums over minibatches of cross (A, C), self-a (A,) and self-b (C,) HSIC_1 values.

    ``gb=None`` (or ``gb is ga``) means ``gb = ga``. HSIC_1 is bilinear in (K, L), so each of its three
    terms, summed over minibatches, is one matrix product for all pairs of taps at once
    (:func:`_hsic1_parts`; exact for non-symmetric matrices too), then the terms are combined. Symmetric
    Grams compared with themselves give an exactly symmetric matrix (rounding of (a, c) and (c, a) is
    averaged). ``fresh``: ``ga`` and ``gb`` are temporaries that may be modified.
    """
    n = ga.shape[-1]
    _check_hsic1_size(n)
    w = w.to(device=ga.device, dtype=torch.float64)
    left_a, right_a, symmetric = _hsic1_parts(ga, w, fresh)

    def pairs(left: _Parts, right: _Parts) -> torch.Tensor:
        return _combine_hsic1_terms(*(p @ q.T for p, q in zip(left, right, strict=True)), n)

    def selves(left: _Parts, right: _Parts) -> torch.Tensor:
        return _combine_hsic1_terms(*(torch.einsum("ak,ak->a", p, q) for p, q in zip(left, right, strict=True)), n)

    if gb is None or gb is ga:
        cross = pairs(left_a, right_a)
        if symmetric:
            cross = (cross + cross.T) / 2
        self_a = cross.diagonal().clone()
        return cross, self_a, self_a
    left_b, right_b, _ = _hsic1_parts(gb, w, fresh)
    return pairs(left_a, right_b), selves(left_a, right_a), selves(left_b, right_b)


def cka_from_grams(
    grams_a: torch.Tensor,
    grams_b: torch.Tensor | None = None,
    weights: ArrayLike | Sequence[float] | None = None,
) -> torch.Tensor:
    """Minibatch CKA matrix between taps, from Grams of equal-size minibatches.

    Args:
        grams_a: ``(A, B, n, n)`` Grams of ``A`` taps over ``B`` minibatches of ``n`` examples.
        grams_b: ``(C, B, n, n)`` Grams over the same minibatches, or ``None`` to compare ``grams_a``
            with itself.
        weights: optional ``(B,)`` non-negative minibatch weights (e.g. batch sizes); ``None`` averages
            the minibatches with equal weight. The same weights are used in the numerator and in both
            self terms.

    Returns:
        ``(A, C)`` float64 CKA matrix ``mean_b HSIC_1(K_ab, L_cb) / sqrt(mean_b HSIC_1(K_ab, K_ab) *
        mean_b HSIC_1(L_cb, L_cb))``. Entries whose self terms are not positive (e.g. constant features)
        are NaN.
    """
    ga = _to_float64(torch.as_tensor(grams_a))
    _check_square(ga, "grams_a", ndim=4)
    gb = None if grams_b is None else _to_float64(torch.as_tensor(grams_b)).to(ga.device)
    if gb is not None:
        _check_square(gb, "grams_b", ndim=4)
        if ga.shape[1:] != gb.shape[1:]:
            raise ValueError(
                "grams_a (A, B, n, n) and grams_b (C, B, n, n) must share B and n, "
                f"got shapes {tuple(ga.shape)} and {tuple(gb.shape)}"
            )
    w = _batch_weights(weights, ga.shape[1])
    if float(w.sum()) <= 0:
        raise ValueError("weights must not all be zero")
    return _cka_ratio(*_weighted_hsic_sums(ga, gb, w))


def cka_from_gram_list(
    list_a: Sequence[torch.Tensor],
    list_b: Sequence[torch.Tensor] | None = None,
    weights: ArrayLike | Sequence[float] | None = None,
) -> torch.Tensor:
    """Minibatch CKA matrix from per-minibatch Grams whose sizes may differ.

    Minibatches with the same number of examples are stacked and go through the vectorised path of
    :func:`cka_from_grams`; the per-group weighted sums are then combined, so the result equals the
    average over all minibatches regardless of their order or grouping.

    Args:
        list_a: list over minibatches of ``(A, n_b, n_b)`` Grams (``A`` taps, same for every minibatch).
        list_b: list over the same minibatches of ``(C, n_b, n_b)`` Grams, or ``None`` for ``list_a``
            against itself.
        weights: optional per-minibatch non-negative weights; ``None`` weighs every minibatch equally.

    Returns:
        ``(A, C)`` float64 CKA matrix (NaN where a self term is not positive).

    Minibatches with fewer than 4 examples cannot enter HSIC_1: they are skipped with a warning that says
    how many examples were left out. A ValueError is raised if no minibatch is usable.
    """
    if len(list_a) == 0:
        raise ValueError("list_a is empty: need at least one minibatch of Grams")
    if list_b is not None and len(list_b) != len(list_a):
        raise ValueError(f"list_a has {len(list_a)} minibatches but list_b has {len(list_b)}")
    w_all = _batch_weights(weights, len(list_a))

    grams_a: list[torch.Tensor] = []
    grams_b: list[torch.Tensor] | None = None if list_b is None else []
    groups: dict[int, list[int]] = {}
    num_a: int | None = None
    num_c: int | None = None
    total_examples = skipped_examples = skipped_batches = 0
    for i, raw_a in enumerate(list_a):
        ga = _to_float64(torch.as_tensor(raw_a))
        _check_square(ga, f"list_a[{i}]", ndim=3)
        num_a = ga.shape[0] if num_a is None else num_a
        if ga.shape[0] != num_a:
            raise ValueError(f"list_a[{i}] has {ga.shape[0]} taps, expected {num_a} as in list_a[0]")
        n = ga.shape[-1]
        grams_a.append(ga)
        if grams_b is not None and list_b is not None:
            gb = _to_float64(torch.as_tensor(list_b[i])).to(ga.device)
            _check_square(gb, f"list_b[{i}]", ndim=3)
            num_c = gb.shape[0] if num_c is None else num_c
            if gb.shape[0] != num_c:
                raise ValueError(f"list_b[{i}] has {gb.shape[0]} taps, expected {num_c} as in list_b[0]")
            if gb.shape[-1] != n:
                raise ValueError(f"minibatch {i}: list_a has n={n} examples but list_b has n={gb.shape[-1]}")
            grams_b.append(gb)
        total_examples += n
        if n < MIN_HSIC1_EXAMPLES:
            skipped_batches += 1
            skipped_examples += n
            continue
        groups.setdefault(n, []).append(i)

    return _cka_over_groups(
        groups,
        w_all,
        lambda idx: torch.stack([grams_a[i] for i in idx], dim=1),
        None if grams_b is None else lambda idx: torch.stack([grams_b[i] for i in idx], dim=1),
        (skipped_batches, skipped_examples, total_examples),
    )


def _cka_over_groups(
    groups: dict[int, list[int]],
    w_all: torch.Tensor,
    stack_a: Callable[[list[int]], torch.Tensor],
    stack_b: Callable[[list[int]], torch.Tensor] | None,
    skipped: tuple[int, int, int],
) -> torch.Tensor:
    """CKA from minibatches grouped by size: ``stack_a(idx)`` gives the fresh ``(A, len(idx), n, n)`` float64
    Grams of the minibatches ``idx``; per-group weighted HSIC sums are added, then divided by the total
    weight. ``skipped``: (minibatches, examples, all examples) left out for having fewer than 4 examples."""
    skipped_batches, skipped_examples, total_examples = skipped
    if skipped_batches:
        warnings.warn(
            f"CKA: skipped {skipped_batches} minibatch(es) with fewer than {MIN_HSIC1_EXAMPLES} examples; "
            f"{skipped_examples} of {total_examples} examples were left out of the estimate "
            "(the unbiased HSIC_1 estimator needs n >= 4)",
            UserWarning,
            stacklevel=3,
        )
    if not groups:
        raise ValueError(f"no minibatch has at least {MIN_HSIC1_EXAMPLES} examples; cannot estimate CKA")
    cross = self_a = self_b = None
    total_weight = 0.0
    for idx in groups.values():
        w = w_all[idx]
        total_weight += float(w.sum())
        ga = stack_a(idx)
        gb = None if stack_b is None else stack_b(idx).to(ga.device)
        c, sa, sb = _weighted_hsic_sums(ga, gb, w, fresh=True)
        cross = c if cross is None else cross + c
        self_a = sa if self_a is None else self_a + sa
        self_b = sb if self_b is None else self_b + sb
    if total_weight <= 0:
        raise ValueError("the usable minibatches all have zero weight")
    assert cross is not None and self_a is not None and self_b is not None
    return _cka_ratio(cross / total_weight, self_a / total_weight, self_b / total_weight)


def cka_from_gram_streams(
    streams_a: Sequence[Sequence[torch.Tensor]],
    streams_b: Sequence[Sequence[torch.Tensor]] | None = None,
    weights: ArrayLike | Sequence[float] | None = None,
) -> torch.Tensor:
    """Minibatch CKA matrix from Grams kept per tap: ``streams_a[a][b]`` is tap ``a``'s ``(n_b, n_b)`` Gram
    of minibatch ``b``.

    The same estimate as :func:`cka_from_gram_list` (same weights, same handling of minibatches with fewer
    than 4 examples) on the layout a Gram cache keeps: one list per tap. Each tap's minibatches of one size
    are stacked once, instead of every minibatch's taps.

    Args:
        streams_a: per tap, the list over minibatches of its Grams (any float dtype).
        streams_b: the same for the taps of the other side, over the same minibatches in the same order,
            or ``None`` for ``streams_a`` against itself.
        weights: optional per-minibatch non-negative weights; ``None`` weighs every minibatch equally.

    Returns:
        ``(A, C)`` float64 CKA matrix (NaN where a self term is not positive).
    """
    if len(streams_a) == 0 or len(streams_a[0]) == 0:
        raise ValueError("streams_a is empty: need at least one tap with one minibatch of Grams")
    num = len(streams_a[0])
    shapes = [tuple(g.shape) for g in streams_a[0]]
    if any(len(s) != 2 or s[0] != s[1] for s in shapes):
        raise ValueError("every Gram must be a square (n, n) matrix")
    for name, streams in (("streams_a", streams_a), ("streams_b", streams_b or [])):
        for t, stream in enumerate(streams):
            if len(stream) != num:
                raise ValueError(f"{name}[{t}] has {len(stream)} minibatches, expected {num}")
            if [tuple(g.shape) for g in stream] != shapes:
                raise ValueError(f"{name}[{t}]: Gram shapes differ from those of streams_a[0], minibatch by minibatch")
    w_all = _batch_weights(weights, num)
    groups: dict[int, list[int]] = {}
    skipped_batches = skipped_examples = 0
    for i, (n, _) in enumerate(shapes):
        if n < MIN_HSIC1_EXAMPLES:
            skipped_batches += 1
            skipped_examples += n
        else:
            groups.setdefault(n, []).append(i)

    def stack(streams: Sequence[Sequence[torch.Tensor]], idx: list[int]) -> torch.Tensor:
        """(taps, len(idx), n, n) float64: one stack, one conversion."""
        flat = [g for s in streams for g in (s if len(idx) == num else [s[i] for i in idx])]
        n = flat[0].shape[-1]
        return _to_float64(torch.stack(flat)).view(len(streams), len(idx), n, n)

    return _cka_over_groups(
        groups,
        w_all,
        lambda idx: stack(streams_a, idx),
        None if streams_b is None else lambda idx: stack(streams_b, idx),
        (skipped_batches, skipped_examples, sum(n for n, _ in shapes)),
    )


def cka_stderr_from_gram_streams(
    streams_a: Sequence[Sequence[torch.Tensor]],
    streams_b: Sequence[Sequence[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Standard error of the minibatch CKA matrix of :func:`cka_from_gram_streams`, by batch means: the CKA of
    each minibatch alone (its HSIC_1 terms, :func:`hsic1_cross`), their sample standard deviation over the
    minibatches (ddof 1) divided by the square root of their number. One minibatch's CKA is noisier than the
    pooled ratio, so this errs on the large side. Minibatches with fewer than 4 examples are left out, as in
    the estimate; NaN with fewer than two minibatches.

    Returns:
        ``(A, C)`` float64.
    """
    same = streams_b is None
    streams_b = streams_a if streams_b is None else streams_b
    sizes = [int(g.shape[-1]) for g in streams_a[0]]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        if n >= MIN_HSIC1_EXAMPLES:
            groups.setdefault(n, []).append(i)
    A, C = len(streams_a), len(streams_b)
    total = torch.zeros(A, C, dtype=torch.float64)
    total_sq = torch.zeros(A, C, dtype=torch.float64)
    count = 0
    chunks = [idx[k:k + 64] for idx in groups.values() for k in range(0, len(idx), 64)]  # bounded temporaries
    for idx in chunks:
        ga = _to_float64(torch.stack([torch.stack([s[i] for i in idx]) for s in streams_a]))  # (A, B, n, n)
        gb = ga if same else _to_float64(torch.stack([torch.stack([s[i] for i in idx]) for s in streams_b]))
        cross = hsic1_cross(ga, gb)  # (A, C, B)
        self_a = hsic1(ga, ga)  # (A, B)
        self_b = self_a if same else hsic1(gb, gb)
        denom = self_a[:, None, :] * self_b[None, :, :]
        per_batch = torch.where(denom > 0, cross / denom.clamp_min(1e-300).sqrt(), torch.nan)
        total += per_batch.sum(-1)
        total_sq += per_batch.square().sum(-1)
        count += len(idx)
    if count < 2:
        return torch.full((A, C), math.nan, dtype=torch.float64)
    var = (total_sq - total.square() / count) / (count - 1)
    return torch.sqrt(var.clamp_min(0) / count)
