"""Centered kernel alignment (CKA) between two sets of features of the same examples.

Three estimators are provided:

* ``"minibatch"`` -- minibatch linear CKA with the unbiased HSIC_1 estimator (Song et al. 2012; Nguyen,
  Raghu & Kornblith 2021, "Do wide and deep networks learn the same things?"). For minibatches
  ``b = 1..B`` with linear Grams ``K_b = X_b X_bᵀ`` and ``L_b = Y_b Y_bᵀ``::

      CKA = mean_b HSIC_1(K_b, L_b) / sqrt(mean_b HSIC_1(K_b, K_b) * mean_b HSIC_1(L_b, L_b))

  and, with ``K̃``, ``L̃`` the Grams with their diagonal set to zero (no centring)::

      HSIC_1(K, L) = [tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1) / ((n-1)(n-2)) - 2/(n-2) 1ᵀK̃L̃1] / (n(n-3))

  which needs ``n >= 4`` examples per minibatch. Batches are averaged with equal weight per batch by
  default (see :func:`minibatch_cka`).
* ``"full"`` (alias ``"linear"``) -- biased full-batch linear CKA (Kornblith et al. 2019).
* ``"rbf"`` -- biased full-batch RBF-kernel CKA with a median-distance bandwidth (Kornblith et al. 2019).

Features may be ``(N, D)`` or ``(N, T, D)``; a token axis is flattened into ``T * D`` features.
All functions are pure (no I/O); every accumulation is done in float64.
"""

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "ESTIMATORS",
    "MIN_HSIC1_EXAMPLES",
    "cka",
    "cka_from_gram_list",
    "cka_from_grams",
    "cosine_similarity_matrix",
    "gram_linear",
    "hsic1",
    "hsic1_cross",
    "linear_cka",
    "minibatch_cka",
    "rbf_cka",
]

ArrayLike = torch.Tensor | np.ndarray

#: Names accepted by :func:`cka` for ``estimator``.
ESTIMATORS: tuple[str, ...] = ("minibatch", "full", "linear", "rbf")  # "full" and "linear": the same estimator

#: The unbiased HSIC_1 estimator divides by n(n-3)(n-2)(n-1): it needs at least this many examples.
MIN_HSIC1_EXAMPLES = 4


# ----------------------------------------------------------------------------------------------------------
# Input handling
# ----------------------------------------------------------------------------------------------------------


def _as_float_tensor(x: ArrayLike, name: str) -> torch.Tensor:
    """Return ``x`` as a float32 or float64 tensor (no copy when it already is one).

    Half-precision inputs are promoted to float32 (matrix products in fp16/bf16 are too lossy and not
    available on every device); integer and boolean inputs become float64.
    """
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.is_complex():
        raise ValueError(f"{name} must be real-valued, got dtype {t.dtype}")
    if t.dtype in (torch.float32, torch.float64):
        return t
    if t.is_floating_point():
        return t.to(torch.float32)
    return t.to(torch.float64)


def _to_float64(t: torch.Tensor) -> torch.Tensor:
    """Cast to float64, moving to CPU first on devices without float64 support (MPS)."""
    if t.device.type == "mps":
        t = t.cpu()
    return t.to(torch.float64)


def _flatten_features(x: torch.Tensor, name: str) -> torch.Tensor:
    """``(N, D)`` stays as is, ``(N, T, D)`` becomes ``(N, T * D)``; other ranks are rejected."""
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        return x.reshape(x.shape[0], -1)
    raise ValueError(f"{name} must have shape (N, D) or (N, T, D), got shape {tuple(x.shape)}")


def _check_finite(x: torch.Tensor, name: str) -> None:
    """Raise a ValueError that counts the NaN and inf entries of ``x``, if there are any."""
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    raise ValueError(
        f"{name} contains non-finite values: {n_nan} NaN and {n_inf} inf out of {x.numel()} entries; "
        "CKA needs finite features"
    )


def _prepare_pair(x: ArrayLike, y: ArrayLike, min_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a pair of feature arrays and return them as flattened ``(N, D)`` float tensors."""
    fx = _flatten_features(_as_float_tensor(x, "x"), "x")
    fy = _flatten_features(_as_float_tensor(y, "y"), "y")
    if fx.shape[0] != fy.shape[0]:
        raise ValueError(
            f"x and y must hold the same examples: got N={fx.shape[0]} for x and N={fy.shape[0]} for y"
        )
    if fx.shape[0] < min_n:
        raise ValueError(f"CKA needs at least {min_n} examples, got N={fx.shape[0]}")
    _check_finite(fx, "x")
    _check_finite(fy, "y")
    return fx, fy.to(fx.device)


def _check_square(g: torch.Tensor, name: str, ndim: int | None = None) -> None:
    """Check that ``g`` is a (batch of) square matrices, optionally of an exact rank."""
    if ndim is not None and g.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(g.shape)}")
    if g.ndim < 2 or g.shape[-1] != g.shape[-2]:
        raise ValueError(f"{name} must end in a square (n, n) matrix, got shape {tuple(g.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Grams and HSIC_1
# ----------------------------------------------------------------------------------------------------------


def gram_linear(x: ArrayLike, reference_mean: ArrayLike | None = None) -> torch.Tensor:
    """Linear Gram matrix ``K = X Xᵀ`` of one minibatch.

    Args:
        x: features of shape ``(n, D)`` or ``(n, T, D)`` (flattened to ``(n, T * D)``).
        reference_mean: optional vector with ``T * D`` entries (any shape with that many elements)
            subtracted from every example before the product. HSIC_1 is unchanged when the same constant
            vector is added to every example, but a float32 Gram of features with a large common mean
            loses the answer to cancellation; subtracting e.g. the mean of the first minibatch keeps the
            product well conditioned, so float32 is then sufficient.

    Returns:
        The ``(n, n)`` Gram matrix as float64. The subtraction and the product are computed in the input
        dtype (float32 or float64; half precision is promoted to float32, integers to float64).
    """
    feats = _flatten_features(_as_float_tensor(x, "x"), "x")
    if reference_mean is not None:
        ref = _as_float_tensor(reference_mean, "reference_mean")
        ref = ref.to(device=feats.device, dtype=feats.dtype).reshape(-1)
        if ref.numel() != feats.shape[1]:
            raise ValueError(
                f"reference_mean has {ref.numel()} entries but the features have {feats.shape[1]} "
                "(after flattening the token axis)"
            )
        feats = feats - ref
    return _to_float64(feats @ feats.T)


def _zero_diagonal(g: torch.Tensor) -> torch.Tensor:
    """Copy of ``g`` (..., n, n) with its diagonal set to zero."""
    n = g.shape[-1]
    mask = torch.eye(n, dtype=torch.bool, device=g.device)
    return g.masked_fill(mask, 0.0)


def _combine_hsic1_terms(
    trace: torch.Tensor, sum_product: torch.Tensor, one_k_l_one: torch.Tensor, n: int
) -> torch.Tensor:
    """``[tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1)/((n-1)(n-2)) - 2/(n-2) 1ᵀK̃L̃1] / (n(n-3))``."""
    return (trace + sum_product / ((n - 1) * (n - 2)) - (2.0 / (n - 2)) * one_k_l_one) / (n * (n - 3))


def _check_hsic1_size(n: int) -> None:
    if n < MIN_HSIC1_EXAMPLES:
        raise ValueError(f"the unbiased HSIC_1 estimator needs n >= {MIN_HSIC1_EXAMPLES} examples, got n={n}")


def hsic1(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Unbiased HSIC_1 estimator (Song et al. 2012) of Gram matrices, batched over leading dimensions.

    Args:
        K: Gram matrices of shape ``(..., n, n)``.
        L: Gram matrices of shape ``(..., n, n)``; leading dimensions broadcast against ``K``.

    Returns:
        ``(...)`` float64 tensor of HSIC_1 values. The diagonals are zeroed (no centring) and the formula
        in the module docstring is applied. The trace and ``1ᵀK̃L̃1`` are computed exactly, so the result
        is also correct for non-symmetric matrices.
    """
    K = _to_float64(torch.as_tensor(K))
    L = _to_float64(torch.as_tensor(L)).to(K.device)
    _check_square(K, "K")
    _check_square(L, "L")
    if K.shape[-1] != L.shape[-1]:
        raise ValueError(f"K and L must have the same n, got shapes {tuple(K.shape)} and {tuple(L.shape)}")
    n = K.shape[-1]
    _check_hsic1_size(n)
    Kt = _zero_diagonal(K)
    Lt = _zero_diagonal(L)
    trace = (Kt * Lt.transpose(-1, -2)).sum(dim=(-2, -1))
    sum_product = Kt.sum(dim=(-2, -1)) * Lt.sum(dim=(-2, -1))
    # 1ᵀK̃L̃1 = (K̃ᵀ1) · (L̃1): column sums of K̃ against row sums of L̃.
    one_k_l_one = (Kt.sum(dim=-2) * Lt.sum(dim=-1)).sum(dim=-1)
    return _combine_hsic1_terms(trace, sum_product, one_k_l_one, n)


def hsic1_cross(grams_a: torch.Tensor, grams_b: torch.Tensor) -> torch.Tensor:
    """HSIC_1 between every tap of ``grams_a`` and every tap of ``grams_b``, for every minibatch.

    Args:
        grams_a: ``(A, B, n, n)`` Grams of ``A`` taps over ``B`` minibatches.
        grams_b: ``(C, B, n, n)`` Grams of ``C`` taps over the same ``B`` minibatches (same examples in
            the same order).

    Returns:
        ``(A, C, B)`` float64 tensor ``out[a, c, b] = HSIC_1(grams_a[a, b], grams_b[c, b])``, computed with
        batched contractions (no Python loop over pairs): ``tr(K̃L̃) = Σ_ij K̃_ij L̃_ji`` and
        ``1ᵀK̃L̃1 = (K̃ᵀ1)·(L̃1)``.
    """
    ga = _to_float64(torch.as_tensor(grams_a))
    gb = _to_float64(torch.as_tensor(grams_b)).to(ga.device)
    _check_square(ga, "grams_a", ndim=4)
    _check_square(gb, "grams_b", ndim=4)
    if ga.shape[1:] != gb.shape[1:]:
        raise ValueError(
            "grams_a (A, B, n, n) and grams_b (C, B, n, n) must share B and n, "
            f"got shapes {tuple(ga.shape)} and {tuple(gb.shape)}"
        )
    n = ga.shape[-1]
    _check_hsic1_size(n)
    Kt = _zero_diagonal(ga)
    Lt = _zero_diagonal(gb)
    trace = torch.einsum("abij,cbji->acb", Kt, Lt)
    sum_product = Kt.sum(dim=(-2, -1))[:, None, :] * Lt.sum(dim=(-2, -1))[None, :, :]
    one_k_l_one = torch.einsum("abj,cbj->acb", Kt.sum(dim=-2), Lt.sum(dim=-1))
    return _combine_hsic1_terms(trace, sum_product, one_k_l_one, n)


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


def _weighted_hsic_sums(
    ga: torch.Tensor, gb: torch.Tensor | None, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted sums over minibatches of cross (A, C), self-a (A,) and self-b (C,) HSIC_1 values.

    ``gb=None`` means ``gb = ga``; the self terms are computed once per tap from the diagonal pairs only.
    """
    w = w.to(ga.device)
    other = ga if gb is None else gb
    cross = (hsic1_cross(ga, other) * w).sum(dim=-1)
    self_a = (hsic1(ga, ga) * w).sum(dim=-1)
    self_b = self_a if gb is None else (hsic1(gb, gb) * w).sum(dim=-1)
    return cross, self_a, self_b


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

    if skipped_batches:
        warnings.warn(
            f"CKA: skipped {skipped_batches} minibatch(es) with fewer than {MIN_HSIC1_EXAMPLES} examples; "
            f"{skipped_examples} of {total_examples} examples were left out of the estimate "
            "(the unbiased HSIC_1 estimator needs n >= 4)",
            UserWarning,
            stacklevel=2,
        )
    if not groups:
        raise ValueError(f"no minibatch has at least {MIN_HSIC1_EXAMPLES} examples; cannot estimate CKA")

    cross = self_a = self_b = None
    total_weight = 0.0
    for idx in groups.values():
        w = w_all[idx]
        total_weight += float(w.sum())
        stacked_a = torch.stack([grams_a[i] for i in idx], dim=1)
        stacked_b = None if grams_b is None else torch.stack([grams_b[i] for i in idx], dim=1)
        c, sa, sb = _weighted_hsic_sums(stacked_a, stacked_b, w)
        cross = c if cross is None else cross + c
        self_a = sa if self_a is None else self_a + sa
        self_b = sb if self_b is None else self_b + sb
    if total_weight <= 0:
        raise ValueError("the usable minibatches all have zero weight")
    assert cross is not None and self_a is not None and self_b is not None
    return _cka_ratio(cross / total_weight, self_a / total_weight, self_b / total_weight)


# ----------------------------------------------------------------------------------------------------------
# Float API on features
# ----------------------------------------------------------------------------------------------------------


def _minibatch_cka(fx: torch.Tensor, fy: torch.Tensor, batch_size: int) -> float:
    """Minibatch CKA of validated, flattened features (see :func:`minibatch_cka`)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < MIN_HSIC1_EXAMPLES:
        raise ValueError(f"batch_size must be an integer >= {MIN_HSIC1_EXAMPLES}, got {batch_size!r}")
    n_total = fx.shape[0]
    bounds = [(s, min(s + batch_size, n_total)) for s in range(0, n_total, batch_size)]
    last = bounds[-1][1] - bounds[-1][0]
    if last < MIN_HSIC1_EXAMPLES:
        warnings.warn(
            f"minibatch CKA: the last minibatch has only {last} example(s) (N={n_total}, "
            f"batch_size={batch_size}); HSIC_1 needs at least {MIN_HSIC1_EXAMPLES}, so {last} of "
            f"{n_total} examples were left out of the estimate",
            UserWarning,
            stacklevel=3,
        )
        bounds = bounds[:-1]
    # Precision trick: subtract the first minibatch's mean (computed in float64) from every example.
    first_start, first_end = bounds[0]
    mean_x = fx[first_start:first_end].to(torch.float64).mean(dim=0).to(fx.dtype)
    mean_y = fy[first_start:first_end].to(torch.float64).mean(dim=0).to(fy.dtype)
    grams_x = [gram_linear(fx[s:e], mean_x).unsqueeze(0) for s, e in bounds]
    grams_y = [gram_linear(fy[s:e], mean_y).unsqueeze(0) for s, e in bounds]
    return float(cka_from_gram_list(grams_x, grams_y)[0, 0])


def minibatch_cka(x: ArrayLike, y: ArrayLike, batch_size: int = 32) -> float:
    """Minibatch linear CKA with the unbiased HSIC_1 estimator (Nguyen et al. 2021).

    The ``N`` examples are split into consecutive minibatches of ``batch_size``. The last, partial
    minibatch is kept if it has at least 4 examples; otherwise it is dropped with a warning saying how
    many examples were left out. The mean of the first minibatch is subtracted from all features (HSIC_1
    is invariant to a common shift; this keeps float32 Grams accurate when features have a large mean).

    Minibatches are averaged with **equal weight per minibatch**, as in Nguyen et al.; weighting by
    minibatch size would differ only through the last partial minibatch.

    Args:
        x: ``(N, D)`` or ``(N, T, D)`` features (tensor or numpy array, float32/float64).
        y: features of the same ``N`` examples, in the same order.
        batch_size: examples per minibatch (>= 4).

    Returns:
        The CKA estimate as a Python float (NaN if either representation has no positive self-HSIC).
    """
    fx, fy = _prepare_pair(x, y, min_n=MIN_HSIC1_EXAMPLES)
    return _minibatch_cka(fx, fy, batch_size)


def _linear_cka(fx: torch.Tensor, fy: torch.Tensor) -> float:
    """Biased linear CKA of validated, flattened features (see :func:`linear_cka`)."""
    fx = _to_float64(fx)
    fy = _to_float64(fy).to(fx.device)
    fx = fx - fx.mean(dim=0)
    fy = fy - fy.mean(dim=0)
    n, dx = fx.shape
    dy = fy.shape[1]
    gram_cost = n * n * (dx + dy)
    feature_cost = n * (dx * dy + dx * dx + dy * dy)
    if gram_cost <= feature_cost:
        K = fx @ fx.T
        L = fy @ fy.T
        hsic_xy = (K * L).sum()
        hsic_xx = (K * K).sum()
        hsic_yy = (L * L).sum()
    else:
        hsic_xy = (fy.T @ fx).square().sum()
        hsic_xx = (fx.T @ fx).square().sum()
        hsic_yy = (fy.T @ fy).square().sum()
    denom = float(torch.sqrt(hsic_xx) * torch.sqrt(hsic_yy))
    return float(hsic_xy) / denom if denom > 0 else math.nan


def linear_cka(x: ArrayLike, y: ArrayLike) -> float:
    """Biased full-batch linear CKA (Kornblith et al. 2019).

    Features are centred and ``‖YᵀX‖_F² / (‖XᵀX‖_F ‖YᵀY‖_F)`` is computed in float64, through the
    ``N×N`` Grams or the ``D×D`` feature products, whichever is cheaper.

    Args:
        x: ``(N, D)`` or ``(N, T, D)`` features (N >= 2).
        y: features of the same ``N`` examples.

    Returns:
        CKA as a Python float (NaN if either representation is constant).
    """
    fx, fy = _prepare_pair(x, y, min_n=2)
    return _linear_cka(fx, fy)


def _median(v: torch.Tensor) -> torch.Tensor:
    """Median of a 1-D tensor, averaging the two middle values for an even count (like numpy)."""
    s = torch.sort(v).values
    m = s.numel() // 2
    return s[m] if s.numel() % 2 else 0.5 * (s[m - 1] + s[m])


def _gram_rbf(f: torch.Tensor, sigma_frac: float) -> torch.Tensor | None:
    """RBF Gram with ``sigma = sigma_frac * median pairwise distance``; None if that median is zero."""
    f = f - f.mean(dim=0)  # distances are shift invariant; centring avoids cancellation below
    dots = f @ f.T
    sq_norms = torch.diagonal(dots)
    sq_dist = (sq_norms[:, None] + sq_norms[None, :] - 2.0 * dots).clamp_min(0.0)
    sq_dist = _zero_diagonal(sq_dist)
    n = f.shape[0]
    rows, cols = torch.triu_indices(n, n, offset=1, device=f.device)
    median_dist = float(_median(torch.sqrt(sq_dist[rows, cols])))
    if median_dist <= 0:
        return None
    sigma = sigma_frac * median_dist
    return torch.exp(-sq_dist / (2.0 * sigma * sigma))


def _centre_gram(g: torch.Tensor) -> torch.Tensor:
    """``H g H`` with ``H = I - 11ᵀ/n``."""
    return g - g.mean(dim=0, keepdim=True) - g.mean(dim=1, keepdim=True) + g.mean()


def _rbf_cka(fx: torch.Tensor, fy: torch.Tensor, sigma_frac: float) -> float:
    """RBF CKA of validated, flattened features (see :func:`rbf_cka`)."""
    if not (math.isfinite(sigma_frac) and sigma_frac > 0):
        raise ValueError(f"sigma_frac must be a positive finite number, got {sigma_frac!r}")
    K = _gram_rbf(_to_float64(fx), sigma_frac)
    L = _gram_rbf(_to_float64(fy).to(fx.device), sigma_frac)
    if K is None or L is None:
        return math.nan
    Kc = _centre_gram(K)
    Lc = _centre_gram(L)
    denom = float(torch.sqrt((Kc * Kc).sum()) * torch.sqrt((Lc * Lc).sum()))
    return float((Kc * Lc).sum()) / denom if denom > 0 else math.nan


def rbf_cka(x: ArrayLike, y: ArrayLike, sigma_frac: float = 0.8) -> float:
    """Biased full-batch CKA with RBF kernels (Kornblith et al. 2019).

    Each representation gets its own bandwidth ``sigma = sigma_frac * median`` of the Euclidean distances
    between distinct examples (pairs ``i < j``; the median of an even count averages the two middle
    values). Note that Kornblith et al.'s reference code instead takes the median of the full matrix of
    *squared* distances, zero diagonal included, so values differ slightly from theirs for the same
    ``sigma_frac``. The kernel is ``exp(-‖x_i - x_j‖² / (2 sigma²))``; the Grams are centred and the
    biased HSIC ``tr(K H L H)`` is used.

    Args:
        x: ``(N, D)`` or ``(N, T, D)`` features (N >= 2).
        y: features of the same ``N`` examples.
        sigma_frac: bandwidth as a fraction of the median distance.

    Returns:
        CKA as a Python float; NaN when a median distance is zero (e.g. constant features).
    """
    fx, fy = _prepare_pair(x, y, min_n=2)
    return _rbf_cka(fx, fy, sigma_frac)


def cka(x: ArrayLike, y: ArrayLike, estimator: str = "minibatch", batch_size: int = 32) -> float:
    """CKA between two representations of the same ``N`` examples.

    Args:
        x: ``(N, D)`` or ``(N, T, D)`` features, numpy array or torch tensor.
        y: features of the same examples in the same order (its ``D``/``T`` may differ from ``x``'s).
        estimator: ``"minibatch"`` (:func:`minibatch_cka`), ``"full"`` or its alias ``"linear"``
            (:func:`linear_cka`, biased full-batch) or ``"rbf"`` (:func:`rbf_cka`).
        batch_size: minibatch size, used only by the ``"minibatch"`` estimator.

    Returns:
        CKA as a Python float.

    Raises:
        ValueError: unknown estimator, mismatched ``N``, ``N < 4`` (for every estimator), bad shapes or
            non-finite values (the message counts the NaN and inf entries).
    """
    if estimator not in ESTIMATORS:
        valid = ", ".join(repr(e) for e in ESTIMATORS)
        raise ValueError(f"unknown CKA estimator {estimator!r}; valid estimators are: {valid}")
    fx, fy = _prepare_pair(x, y, min_n=MIN_HSIC1_EXAMPLES)
    if estimator == "minibatch":
        return _minibatch_cka(fx, fy, batch_size)
    if estimator in ("full", "linear"):
        return _linear_cka(fx, fy)
    return _rbf_cka(fx, fy, 0.8)


def cosine_similarity_matrix(feats: ArrayLike) -> torch.Tensor:
    """Mean cosine similarity between ``M`` items measured on the same ``N`` examples.

    Args:
        feats: ``(M, N, D)`` features: ``M`` items (heads, layers, tokens, ...), ``N`` examples, ``D``
            dimensions.

    Returns:
        ``(M, M)`` float64 tensor with entry ``[i, j] = mean_n cos(feats[i, n], feats[j, n])``. A zero
        vector has cosine 0 with everything (including itself).
    """
    f = _to_float64(_as_float_tensor(feats, "feats"))
    if f.ndim != 3:
        raise ValueError(f"feats must have shape (M, N, D), got shape {tuple(f.shape)}")
    if f.shape[1] == 0:
        raise ValueError("feats has no examples (N = 0)")
    _check_finite(f, "feats")
    unit = torch.nn.functional.normalize(f, dim=-1)
    return torch.einsum("ind,jnd->ij", unit, unit) / f.shape[1]
