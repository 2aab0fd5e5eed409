"""Linear Grams of minibatches and the unbiased HSIC_1 estimator between them (formula in the package
docstring, `vitscope.metrics.cka`)."""

import threading

import torch

from vitscope.metrics.cka.common import (
    MIN_HSIC1_EXAMPLES,
    ArrayLike,
    _as_float_tensor,
    _check_square,
    _flatten_features,
    _to_float64,
)

# ----------------------------------------------------------------------------------------------------------
# Grams and HSIC_1
# ----------------------------------------------------------------------------------------------------------


#: Features per chunk of the CPU Gram kernel times rows: the chunk buffer holds 2**18 values (1 MB in float32).
_CHUNK_VALUES = 2**18
#: The chunked CPU kernel (shifted or converted features) is used from this many features per example.
CHUNKED_GRAM_MIN_FEATURES = 16384


_BUFFERS = threading.local()


def _chunk_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU buffer of at least ``numel`` values, kept per thread and dtype and reused (grown only).

    Allocating the 1 MB chunk buffer on every call would interleave it with the small Grams that the cache
    keeps: the allocator then places a kept Gram in each freed buffer's hole and has to grow the heap for
    the next buffer, ~1 MB lost per Gram (measured: 4.5 GB over 8192 images x 24 streams)."""
    cache = _BUFFERS.__dict__.setdefault("by_dtype", {})
    buf = cache.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = cache[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def gram_matrix(x: torch.Tensor, shift: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(x - shift)(x - shift)ᵀ`` of ``(n, F)`` features, in ``dtype`` (default: ``x``'s), without validation.

    The kernel behind :func:`gram_linear` and the CKA Gram cache. Features that need no shift and no
    conversion go straight to one matrix product, the least work there is. Otherwise, on CPU with many
    features (``F >= CHUNKED_GRAM_MIN_FEATURES``), they are copied chunk by chunk, transposed, into a
    reused buffer that stays in cache, the shift and the conversion fused into that copy, and the chunk
    products are accumulated with ``addmm``: for a small ``n`` (32) MKL multiplies the example-minor
    ``(F_chunk, n)`` buffer ~4x faster than the row-major ``(n, F)`` features, which pays for the copy.
    Measured on 32 x 151k float32 features (1 thread, loaded machine): with a shift 1.2-1.4x faster than
    subtracting then multiplying, and no large temporary; without one, on par with ``x @ x.T`` on average
    but slower when other processes share the core's cache, hence not used. Accumulation over chunks is
    in ``dtype``, as BLAS does over its own blocks of ``F``.

    Args:
        x: ``(n, F)`` floating-point features (any strides).
        shift: optional ``(F,)`` vector subtracted from every row.
        dtype: dtype of the product and the result.
    """
    dtype = x.dtype if dtype is None else dtype
    n, F = x.shape
    if x.device.type != "cpu" or F < CHUNKED_GRAM_MIN_FEATURES or (shift is None and x.dtype == dtype):
        if x.dtype != dtype:
            x = x.to(dtype)
        if shift is not None:
            x = x - (shift if shift.dtype == dtype else shift.to(dtype))
        return x @ x.T
    c = min(F, max(1024, _CHUNK_VALUES // max(n, 1)))
    buf = _chunk_buffer(c * n, dtype).view(c, n)
    g = torch.zeros(n, n, dtype=dtype)
    for s in range(0, F, c):
        e = min(s + c, F)
        b = buf[: e - s]
        if shift is None:
            b.copy_(x[:, s:e].T)
        else:
            torch.sub(x[:, s:e].T, shift[s:e, None], out=b)
        g.addmm_(b.T, b)
    return g


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
        dtype (float32 or float64; half precision is promoted to float32, integers to float64), by
        :func:`gram_matrix`.
    """
    feats = _flatten_features(_as_float_tensor(x, "x"), "x")
    ref = None
    if reference_mean is not None:
        ref = _as_float_tensor(reference_mean, "reference_mean")
        ref = ref.to(device=feats.device, dtype=feats.dtype).reshape(-1)
        if ref.numel() != feats.shape[1]:
            raise ValueError(
                f"reference_mean has {ref.numel()} entries but the features have {feats.shape[1]} "
                "(after flattening the token axis)"
            )
    return _to_float64(gram_matrix(feats, ref))


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
