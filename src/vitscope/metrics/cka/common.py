"""Input handling shared by the CKA estimators: features as float tensors, their checks, and the constants the
estimators share (see the package docstring, `vitscope.metrics.cka`)."""

from collections.abc import Mapping

import numpy as np
import torch

ArrayLike = torch.Tensor | np.ndarray | Mapping[str, torch.Tensor]  # a mapping: `extract`'s dict for one tap

#: Names accepted by :func:`cka` for ``estimator``.
ESTIMATORS: tuple[str, ...] = ("minibatch", "full", "linear", "rbf")  # "full" and "linear": the same estimator

#: The unbiased HSIC_1 estimator divides by n(n-3)(n-2)(n-1): it needs at least this many examples.
MIN_HSIC1_EXAMPLES = 4

#: Below this many examples `cka` warns: the unbiased estimator's variance swamps the value. Between unrelated
#: representations (200 pairs of 384-d Gaussian features, one minibatch) its standard deviation is 0.69 at 4
#: examples, 0.24 at 8, 0.10 at 16 and 0.04 at 32, and single values reach -1 and 1 at 4.
FEW_CKA_EXAMPLES = 32


# ----------------------------------------------------------------------------------------------------------
# Input handling
# ----------------------------------------------------------------------------------------------------------


def _as_float_tensor(x: ArrayLike, name: str) -> torch.Tensor:
    """Return ``x`` as a float32 or float64 tensor (no copy when it already is one).

    Half-precision inputs are promoted to float32 (matrix products in fp16/bf16 are too lossy and not
    available on every device); integer and boolean inputs become float64.
    """
    if isinstance(x, Mapping):  # what `vitscope.extract` returns: {tap: (N, ...) tensor}
        if len(x) != 1:
            taps = ", ".join(repr(k) for k in list(x)[:4]) + (", ..." if len(x) > 4 else "")
            raise ValueError(f"{name} is a dict of {len(x)} taps ({taps}); pass one tap's features, e.g. "
                             f"{name}[{next(iter(x), 'block3.out')!r}], or extract a single tap")
        x = next(iter(x.values()))
    if not isinstance(x, torch.Tensor):
        arr = np.asarray(x)
        if arr.dtype == object:
            raise ValueError(f"{name} must be numeric features of shape (N, D) or (N, T, D) (an array, a tensor, "
                             f"or vitscope.extract's dict for one tap), got a {type(x).__name__} of mixed objects")
        x = torch.as_tensor(arr)
    t = x
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
