"""CKA of two feature matrices of the same examples, as a float: minibatch (unbiased HSIC_1), biased linear and
RBF estimators, `cka` choosing among them; and the mean cosine similarity between items."""

import math
import warnings

import torch

from vitscope.metrics.cka.common import (
    ESTIMATORS,
    FEW_CKA_EXAMPLES,
    MIN_HSIC1_EXAMPLES,
    ArrayLike,
    _as_float_tensor,
    _check_finite,
    _prepare_pair,
    _to_float64,
)
from vitscope.metrics.cka.from_grams import cka_from_gram_list
from vitscope.metrics.cka.hsic import _zero_diagonal, gram_linear

# ----------------------------------------------------------------------------------------------------------
# Float API on features
# ----------------------------------------------------------------------------------------------------------


def _minibatch_cka(fx: torch.Tensor, fy: torch.Tensor, batch_size: int) -> float:
    """Minibatch CKA of validated, flattened features (see :func:`minibatch_cka`)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < MIN_HSIC1_EXAMPLES:
        raise ValueError(f"batch_size must be an integer >= {MIN_HSIC1_EXAMPLES}, got {batch_size!r}")
    n_total = fx.shape[0]
    if n_total < FEW_CKA_EXAMPLES:
        from vitscope.errors import ResultWarning

        warnings.warn(
            f"CKA from {n_total} examples is mostly noise: the unbiased HSIC_1 estimator's variance is large below "
            f"{FEW_CKA_EXAMPLES} examples (between unrelated representations its standard deviation is about 0.7 "
            f"at 4 examples, 0.1 at 16, 0.04 at 32) and the value is not bounded to [0, 1]; use at least "
            f"{FEW_CKA_EXAMPLES} examples",
            ResultWarning,
            stacklevel=3,
        )
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
        x: ``(N, D)`` or ``(N, T, D)`` features, numpy array or torch tensor, or what :func:`vitscope.extract`
            returns for one tap (``{tap: tensor}``).
        y: features of the same examples in the same order (its ``D``/``T`` may differ from ``x``'s).
        estimator: ``"minibatch"`` (:func:`minibatch_cka`), ``"full"`` or its alias ``"linear"``
            (:func:`linear_cka`, biased full-batch) or ``"rbf"`` (:func:`rbf_cka`).
        batch_size: minibatch size, used only by the ``"minibatch"`` estimator.

    Returns:
        CKA as a Python float.

    Raises:
        ValueError: unknown estimator, mismatched ``N``, ``N < 4`` (for every estimator), bad shapes or
            non-finite values (the message counts the NaN and inf entries).

    Warns:
        ResultWarning: the minibatch estimator on fewer than `FEW_CKA_EXAMPLES` (32) examples, where the
            unbiased estimator's variance makes the value mostly noise (it can fall below 0).
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
