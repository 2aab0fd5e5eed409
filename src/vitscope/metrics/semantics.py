"""Which layer knows what: k-NN, linear probes, clustering scores, prediction agreement (pure functions).

Protocols follow the sources: DINO's weighted k-NN (Caron et al. 2021; Walmer et al. 2023 §6.1, Shekhar et al.
2022 §2.3), k-means purity / NMI / ARI (Walmer et al. 2023 §5.2), Kendall's tau of class rankings and top-1 F1
(Shekhar et al. 2022 §2.4). Accuracies carry a binomial interval (`binomial_interval`) and a majority-class
chance level (`majority_rate`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy.optimize import minimize
from scipy.special import log_softmax
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score, f1_score, normalized_mutual_info_score
from sklearn.metrics.cluster import contingency_matrix

from vitscope.errors import ConfigError, ResultWarning
from vitscope.metrics.intervals import Z95
from vitscope.threads import few_threads

Tensor = torch.Tensor


def knn_classify(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor,
                 ks: tuple[int, ...] = (10, 20, 100, 200), temperature: float = 0.07, num_classes: int | None = None,
                 chunk: int = 1024, device: torch.device | str | None = None) -> dict[int, tuple[float, float]]:
    """DINO's weighted k-NN: cosine similarity of L2-normalised features, the k nearest training images
    vote for their class with weight exp(sim / T). Returns {k: (top-1, top-5)} accuracies in [0, 1];
    k larger than the training set is clipped to it. ``device``: where the similarities are computed (default:
    the training features'); the test rows go there ``chunk`` at a time, and the hits are counted there and
    read once at the end.

    A hit in the top n: the true class got votes and fewer than n classes score above it (equal scores: the
    lower class index first). A class no neighbour voted for is never among the predictions: with fewer voting
    classes than 5, a top-5 filled up from zero-score ties would depend on the kernel's tie order (DINO's
    ``sort`` does this; the same study scored on a GPU and a CPU differed by up to 5 % at k = 10)."""
    device = train.device if device is None else torch.device(device)
    train = torch.nn.functional.normalize(train.to(device).float(), dim=1)
    train_labels = train_labels.to(device)
    c = int(num_classes if num_classes is not None else int(max(train_labels.max(), test_labels.max())) + 1)
    kmax = min(max(ks), len(train))
    hits = torch.zeros(len(ks), 2, dtype=torch.long, device=device)
    classes = torch.arange(c, device=device)
    for s in range(0, len(test), chunk):
        part = torch.nn.functional.normalize(test[s:s + chunk].to(device).float(), dim=1)
        sim, idx = (part @ train.T).topk(kmax, dim=1)
        votes_lbl = train_labels[idx]
        w = (sim / temperature).exp()
        y = test_labels[s:s + chunk, None].to(device)
        for i, k in enumerate(ks):
            kk = min(k, kmax)
            scores = torch.zeros(len(y), c, device=device).scatter_add_(1, votes_lbl[:, :kk], w[:, :kk])
            mine = scores.gather(1, y)  # (b, 1): the true class's score
            rank = ((scores > mine) | ((scores == mine) & (classes < y))).sum(1)
            voted = mine[:, 0] > 0
            hits[i, 0] += (voted & (rank < 1)).sum()
            hits[i, 1] += (voted & (rank < 5)).sum()
    n = max(len(test), 1)
    return {k: (h[0] / n, h[1] / n) for k, h in zip(ks, hits.tolist(), strict=True)}


def binomial_interval(p: float, n: int, z: float = Z95) -> tuple[float, float, float]:
    """Wilson score interval of a proportion ``p`` observed on ``n`` trials: (low, high, standard error
    ``sqrt(p (1 - p) / n)``), 95 % by default. Unlike p ± z·se it stays inside [0, 1] and is not empty at
    p = 0 or 1 (where its bound is exactly 0 or 1: computed, it rounds to 1 - 1e-16, which would leave out the
    observed 1). ``n = 0`` gives NaNs."""
    if n <= 0 or not np.isfinite(p):
        return float("nan"), float("nan"), float("nan")
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if p <= 0 else float(max(0.0, centre - half))
    hi = 1.0 if p >= 1 else float(min(1.0, centre + half))
    return lo, hi, float(np.sqrt(p * (1 - p) / n))


def majority_rate(train_labels: Tensor, test_labels: Tensor, k: int = 1) -> float:
    """Top-``k`` accuracy of always answering the ``k`` most frequent training classes: the chance level an
    accuracy has to beat (1/C for balanced classes)."""
    if len(test_labels) == 0 or len(train_labels) == 0:
        return float("nan")
    classes, counts = torch.unique(train_labels, return_counts=True)
    top = classes[torch.argsort(counts, descending=True, stable=True)[:k]]
    return float(torch.isin(test_labels, top).double().mean())


PROBE_GRID = (1.0, 1e-1, 1e-2, 1e-3, 1e-4)  # L2 weight decays the tuned probe chooses from, strongest first


@dataclass
class ProbeFit:
    """One fitted probe: test top-1 ``accuracy``, (m, C) test log-probabilities ``scores``, the L2
    ``weight_decay`` used (chosen by cross-validation when tuned), the L-BFGS ``iterations`` of the final
    fit and whether it ``converged`` within its cap; ``cv_accuracy``: the held-out accuracy of each decay
    tried ({} when not tuned). ``solver``: 'lbfgs' (`fit_probe`) or 'sgd' (`fit_probe_sgd`: then
    ``iterations`` counts its minibatch steps, ``converged`` is False when its loss diverged, and ``losses``
    holds the mean training loss of each epoch)."""

    accuracy: float
    scores: Tensor
    weight_decay: float
    iterations: int
    converged: bool
    cv_accuracy: dict[float, float] = field(default_factory=dict)
    solver: str = "lbfgs"
    losses: list[float] = field(default_factory=list)


def probe_options(who: str, tune: bool = True, grid: Sequence[float] = PROBE_GRID, folds: int = 2,
                  max_iter: int = 1000, weight_decay: float = 1e-4, standardize: bool = True) -> dict[str, Any]:
    """An analysis's probe parameters checked (one sentence each) -> keyword arguments of `fit_probe`."""
    if not isinstance(standardize, bool | np.bool_):
        raise ConfigError(f"{who}: standardize must be true or false; got {standardize!r}")
    grid = tuple(sorted((float(g) for g in grid), reverse=True))
    if not grid or any(not np.isfinite(g) or g <= 0 for g in grid):
        raise ConfigError(f"{who}: probe_grid must list positive weight decays; got {list(grid)}")
    if int(folds) < 2:
        raise ConfigError(f"{who}: probe_folds must be at least 2; got {folds}")
    if int(max_iter) < 1:
        raise ConfigError(f"{who}: probe_max_iter must be at least 1; got {max_iter}")
    if not float(weight_decay) > 0:
        raise ConfigError(f"{who}: probe_weight_decay must be positive; got {weight_decay}")
    return {"tune": bool(tune), "grid": grid, "folds": int(folds), "max_iter": int(max_iter),
            "weight_decay": float(weight_decay), "standardize": bool(standardize)}


def class_folds(labels: np.ndarray, folds: int) -> np.ndarray:
    """Fold of each row: within each class, rows in their order here get folds 0, 1, ..., folds - 1, 0, ...
    (stratified and deterministic)."""
    y = np.asarray(labels)
    n = len(y)
    order = np.lexsort((np.arange(n), y))
    ys = y[order]
    starts = np.r_[0, np.flatnonzero(ys[1:] != ys[:-1]) + 1] if n else np.zeros(0, dtype=int)
    sizes = np.diff(np.r_[starts, n])
    out = np.empty(n, dtype=np.int64)
    out[order] = (np.arange(n) - np.repeat(starts, sizes)) % folds
    return out


def stratified_test(ids: Tensor, labels: Tensor, test_every: int) -> Tensor:
    """(n,) bool, True = test row: within each label, rows ordered by id (ties: their order here), ranks
    0, ``test_every``, 2 ``test_every``, ... are test rows; a label with one row keeps it for training."""
    ids_np, y = ids.long().numpy(), labels.long().numpy()
    n = len(y)
    test = np.zeros(n, dtype=bool)
    if n == 0:
        return torch.from_numpy(test)
    order = np.lexsort((np.arange(n), ids_np, y))  # by label, then id, then position
    ys = y[order]
    starts = np.r_[0, np.flatnonzero(ys[1:] != ys[:-1]) + 1]
    sizes = np.diff(np.r_[starts, n])
    rank = np.arange(n) - np.repeat(starts, sizes)
    test[order] = (rank % int(test_every) == 0) & (np.repeat(sizes, sizes) > 1)
    return torch.from_numpy(test)


def _softmax_loss_grad(p: np.ndarray, x: np.ndarray | Tensor, onehot: np.ndarray | Tensor, weight_decay: float
                       ) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of a multinomial logistic regression + weight_decay |W|^2 (bias not penalised), and its
    gradient; ``p`` holds W (D x C, row-major) then the C biases. ``x`` a tensor (on an accelerator): computed
    there (`_softmax_loss_grad_on`)."""
    if isinstance(x, Tensor):
        return _softmax_loss_grad_on(p, x, _like(onehot, x), weight_decay)
    n, d = x.shape
    c = onehot.shape[1]
    w, b = p[:d * c].reshape(d, c), p[d * c:]
    z = x @ w + b
    z -= z.max(1, keepdims=True)
    e = np.exp(z)
    s = e.sum(1, keepdims=True)
    loss = -float((onehot * (z - np.log(s))).sum()) / n + weight_decay * float((w * w).sum())
    g = (e / s - onehot) / n
    return loss, np.concatenate([(x.T @ g + 2 * weight_decay * w).ravel(), g.sum(0)])


def _softmax_loss_grad_on(p: np.ndarray, x: Tensor, onehot: Tensor, weight_decay: float) -> tuple[float, np.ndarray]:
    """`_softmax_loss_grad` with the rows ``x`` and ``onehot`` float64 tensors on their device: the parameters go
    there, the loss and gradient come back in one copy."""
    n, d = x.shape
    c = onehot.shape[1]
    pt = torch.from_numpy(np.ascontiguousarray(p)).to(x.device)
    w, b = pt[:d * c].reshape(d, c), pt[d * c:]
    z = x @ w + b
    z = z - z.max(1, keepdim=True).values
    e = z.exp()
    s = e.sum(1, keepdim=True)
    loss = -(onehot * (z - s.log())).sum() / n + weight_decay * (w * w).sum()
    g = (e / s - onehot) / n
    out = torch.cat([loss.reshape(1), (x.T @ g + 2 * weight_decay * w).reshape(-1), g.sum(0)]).cpu().numpy()
    return float(out[0]), out[1:]


def _like(a: np.ndarray | Tensor, x: Tensor) -> Tensor:
    """``a`` as a float64 tensor on ``x``'s device."""
    return torch.as_tensor(a, dtype=torch.float64).to(x.device)


def _rows(x: np.ndarray | Tensor, mask: np.ndarray) -> np.ndarray | Tensor:
    """The rows of ``x`` (an array, or a tensor on any device) where the bool array ``mask`` is True."""
    if isinstance(x, Tensor):
        return x[torch.from_numpy(np.flatnonzero(mask)).to(x.device)]
    return x[mask]


def _times(x: np.ndarray | Tensor, a: np.ndarray) -> np.ndarray | Tensor:
    """``x @ a``, on ``x``'s device when it is a tensor."""
    return x @ _like(a, x) if isinstance(x, Tensor) else x @ a


def _lbfgs(x: np.ndarray, onehot: np.ndarray, weight_decay: float, max_iter: int, tol: float = 1e-4,
           start: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The probe's objective minimised by SciPy's L-BFGS-B with scikit-learn's settings for its `lbfgs` solver
    (gtol = ``tol``, 50 line-search steps): the same optimum as ``LogisticRegression(C=1 / (2 weight_decay n))``
    (tests/test_splits.py checks it against scikit-learn), at half its cost on a study's probes (a few hundred
    rows, 100-800 features: scikit-learn's per-iteration dispatch costs as much as the arithmetic; measured with
    benchmarks/probes.py). -> (parameters, iterations)."""
    d, c = x.shape[1], onehot.shape[1]
    if isinstance(x, Tensor):
        onehot = _like(onehot, x)
    p0 = np.zeros(d * c + c) if start is None else start
    r = minimize(_softmax_loss_grad, p0, args=(x, onehot, weight_decay), jac=True, method="L-BFGS-B",
                 options={"maxiter": max_iter, "gtol": tol, "maxls": 50, "ftol": 64 * np.finfo(float).eps})
    return r.x, int(r.nit)


def _logits(p: np.ndarray, x: np.ndarray | Tensor, c: int) -> np.ndarray:
    """(n, C) logits of rows ``x`` (a tensor: computed on its device, returned on the host)."""
    d = x.shape[1]
    if isinstance(x, Tensor):
        return (x @ _like(p[:d * c].reshape(d, c), x) + _like(p[d * c:], x)).cpu().numpy()
    return x @ p[:d * c].reshape(d, c) + p[d * c:]


def principal_axes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(D, r) orthonormal axes of the (n, D) rows ``x`` (r = min(n, D): the right singular vectors, from the
    D x D Gram matrix when n >= D) and the mean square of x along each, (r,). In these coordinates (x @ axes)
    the probe's objective is the same problem (the penalty |W|^2 is rotation invariant; with D > n, weights
    outside the rows' span change no logit and are 0 at the optimum), its weights uncorrelated to first order,
    so a per-axis scale preconditions it."""
    n, d = x.shape
    if isinstance(x, Tensor):  # on its device; the axes and their variances come back as arrays
        if n >= d:
            s, axes = torch.linalg.eigh(x.T @ x)
            return axes.cpu().numpy(), np.maximum(s.cpu().numpy(), 0.0) / n
        _, sv, vt = torch.linalg.svd(x, full_matrices=False)
        return vt.T.cpu().numpy(), sv.cpu().numpy() ** 2 / n
    if n >= d:
        s, axes = np.linalg.eigh(x.T @ x)
        return axes, np.maximum(s, 0.0) / n
    _, sv, vt = np.linalg.svd(x, full_matrices=False)
    return vt.T, sv ** 2 / n


def _lbfgs_axes(x: np.ndarray, onehot: np.ndarray, weight_decay: float, max_iter: int, variances: np.ndarray,
                axes: np.ndarray, tol: float = 1e-4, start: np.ndarray | None = None
                ) -> tuple[np.ndarray, int, bool]:
    """`_lbfgs` of rows ``x`` given in `principal_axes` coordinates (with their ``variances``; ``axes`` to
    measure the gradient in the original coordinates), preconditioned by the diagonal of the objective's
    Hessian at its start (in these coordinates the weights' cross terms are small): each parameter is
    optimised multiplied by the square root of its diagonal entry (from zero: equal class probabilities, the
    weights along axis j: variance_j (C - 1) / C^2 + 2 weight_decay). The same optimum as `_lbfgs`, with its
    criterion: it stops when the largest entry of the objective's gradient in the original coordinates is at
    most ``tol`` (converged), or after ``max_iter`` iterations (or when L-BFGS makes no progress). On the zoo's
    features a tuned probe takes about half the time it took with `_lbfgs` (benchmarks/probe_tuning.py).
    -> (parameters in the axes' coordinates, iterations, converged)."""
    r, c = x.shape[1], onehot.shape[1]
    if isinstance(x, Tensor):
        onehot = _like(onehot, x)
    if start is None:  # equal class probabilities
        h = (c - 1) / c ** 2
        hw, hb = np.repeat(h * variances, c), np.full(c, h)
    else:
        z = _logits(start, x, c)
        pr = np.exp(z - z.max(1, keepdims=True))
        pr /= pr.sum(1, keepdims=True)
        pq = pr * (1 - pr)
        xx = ((x * x).T @ _like(pq, x)).cpu().numpy() if isinstance(x, Tensor) else (x * x).T @ pq
        hw, hb = xx.ravel() / len(x), pq.mean(0)
    scale = np.concatenate([1 / np.sqrt(hw + 2 * weight_decay), 1 / np.sqrt(np.maximum(hb, 1e-4))])
    p = np.zeros(r * c + c) if start is None else start
    loss, g = _softmax_loss_grad(p, x, onehot, weight_decay)
    last = {"v": p / scale, "loss": loss, "g": g}  # the last evaluation (L-BFGS-B's iterate after a line search)

    def scaled(v: np.ndarray) -> tuple[float, np.ndarray]:
        if not np.array_equal(v, last["v"]):
            last["v"] = v.copy()
            last["loss"], last["g"] = _softmax_loss_grad(v * scale, x, onehot, weight_decay)
        return last["loss"], last["g"] * scale

    def small(g: np.ndarray) -> bool:  # the plain criterion, in the original coordinates
        return bool(np.abs(g[r * c:]).max() <= tol and np.abs(axes @ g[:r * c].reshape(r, c)).max() <= tol)

    def stop(intermediate_result: Any) -> None:
        if np.array_equal(intermediate_result.x, last["v"]) and small(last["g"]):
            raise StopIteration

    if small(g):
        return p, 0, True
    res = minimize(scaled, last["v"], jac=True, method="L-BFGS-B", callback=stop,
                   options={"maxiter": max_iter, "gtol": 0.0, "maxls": 50, "ftol": 64 * np.finfo(float).eps})
    scaled(res.x)
    return res.x * scale, int(res.nit), small(last["g"])


def choose_weight_decay(x: np.ndarray, y: np.ndarray, grid: Sequence[float], folds: int = 2, max_iter: int = 1000,
                        tol: float = 1e-3, patience: int = 1, axes: tuple[np.ndarray, np.ndarray] | None = None
                        ) -> tuple[float, dict[float, float], np.ndarray | None]:
    """The weight decay of ``grid`` with the best ``folds``-fold held-out accuracy on (x, y) (ties: the
    stronger), the accuracy of each decay tried, and the folds' mean parameters at the chosen decay (a start for
    the final fit; None when nothing was fitted). ``y``: class positions 0..C-1. One warm-started path per fold
    from the strongest decay to the weakest, stopped after ``patience`` decays below the best so far (weaker
    decays cost the most iterations); each fit preconditioned (`_lbfgs_axes`) in the `principal_axes` of all
    of x (or ``axes``: x's, already applied, and x's variances along them; the parameters are then in those
    coordinates). Folds:
    `class_folds`; a class with fewer rows than folds is simply absent from some."""
    grid = sorted(grid, reverse=True)
    fold = class_folds(y, folds)
    parts = [(fold != f, fold == f) for f in range(folds)]
    parts = [(tr, va) for tr, va in parts if va.any() and len(np.unique(y[tr])) > 1]
    if not parts:
        return grid[0], {}, None
    if axes is None:
        rot, var = principal_axes(x)
        best, acc, start = choose_weight_decay(_times(x, rot), y, grid, folds, max_iter, tol, patience,
                                               (rot, var))
        return best, acc, None if start is None else _rotate(start, rot, int(y.max()) + 1)
    c = int(y.max()) + 1
    onehot = np.eye(c)[y]
    params: list[np.ndarray | None] = [None] * len(parts)
    acc: dict[float, float] = {}
    at: dict[float, np.ndarray] = {}
    best, since = grid[0], 0
    for lam in grid:
        hits = 0
        for i, (tr, va) in enumerate(parts):
            params[i], _, _ = _lbfgs_axes(_rows(x, tr), onehot[tr], lam, max_iter, axes[1], axes[0], tol, params[i])
            hits += int((_logits(params[i], _rows(x, va), c).argmax(1) == y[va]).sum())
        acc[lam] = hits / sum(int(va.sum()) for _, va in parts)
        at[lam] = np.mean(params, 0)
        if acc[lam] > acc[best]:
            best, since = lam, 0
        elif acc[lam] < acc[best]:  # ties go on (and keep the stronger decay)
            since += 1
            if since >= patience:
                break
    return best, acc, at[best]


def _rotate(p: np.ndarray, axes: np.ndarray, c: int) -> np.ndarray:
    """Parameters of `principal_axes` coordinates -> the original ones."""
    r = axes.shape[1]
    return np.concatenate([(axes @ p[:r * c].reshape(r, c)).ravel(), p[r * c:]])


#: device types where `fit_probe` keeps the features (and the products with them) on the device; elsewhere (the
#: CPU) it works in NumPy. Tests add "cpu" to run the device path on the CPU.
ACCELERATED = ("cuda",)


def fit_probe(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor, *, standardize: bool = True,
              weight_decay: float = 1e-4, max_iter: int = 100, num_classes: int | None = None, warn: bool = True,
              tune: bool = False, grid: Sequence[float] = PROBE_GRID, folds: int = 2, where: str = "linear probe",
              device: torch.device | str | None = None) -> ProbeFit:
    """Multinomial logistic regression (L-BFGS, `_lbfgs`), loss = mean cross-entropy + ``weight_decay`` x
    |W|^2 (bias not penalised). ``standardize``: features normalised with the training mean and std first (what
    a BatchNorm without affine parameters does at convergence). ``tune``: the weight decay is chosen from
    ``grid`` by `choose_weight_decay` on the training rows alone, then the probe is refitted on all of them
    (both in the rows' `principal_axes`, preconditioned: `_lbfgs_axes`), to a gradient of at most 1e-4.
    At most ``max_iter`` iterations; a tuned fit that does not converge warns (`ResultWarning`, prefixed by
    ``where``). Classes absent from the training labels get a score below every other; a training set of
    fewer than two classes warns: the probe then predicts its one class everywhere.

    ``device`` (a GPU, see `ACCELERATED`): the features are standardised, rotated and multiplied there, in
    float64 (L-BFGS itself, on the parameters, stays on the host); the same problem, so the same optimum up to
    the rounding of the products. Otherwise (default, the CPU) in NumPy, as always."""
    on = torch.device(device) if device is not None else None
    with few_threads(train.numel() + test.numel()):  # a few hundred rows: a second thread only spins
        c = int(num_classes) if num_classes is not None else int(max(train_labels.max(), test_labels.max())) + 1
        if on is not None and on.type in ACCELERATED:
            x, xt = train.to(on).double(), test.to(on).double()
            if standardize:
                mu, sd = x.mean(0), x.std(0, correction=1).clamp_min(1e-6)
                x, xt = (x - mu) / sd, (xt - mu) / sd
        else:
            x, xt = train.double().numpy(), test.double().numpy()
            if standardize:
                mu, sd = x.mean(0), np.maximum(x.std(0, ddof=1), 1e-6)
                x, xt = (x - mu) / sd, (xt - mu) / sd
        y = train_labels.numpy()
        scores = torch.full((len(xt), c), float("nan"), dtype=torch.float64)
        classes = np.unique(y)
        if len(classes) < 2 and warn:
            warn_single_class_probe(len(classes))
        lam, cv, iters, converged = float(weight_decay), {}, 0, True
        if len(classes) == 1:  # nothing to fit: every test image gets the one class seen
            scores[:, int(classes[0])] = 0.0
        elif len(classes) > 1:
            pos = np.searchsorted(classes, y)  # the training classes as positions 0..C'-1
            if tune:  # in the training rows' principal axes (the same problem, preconditioned)
                rot, var = principal_axes(x)
                x, xt = _times(x, rot), _times(xt, rot)
                lam, cv, start = choose_weight_decay(x, pos, grid, folds, max_iter, axes=(rot, var))
                params, iters, converged = _lbfgs_axes(x, np.eye(len(classes))[pos], lam, max_iter, var, rot,
                                                       start=start)
            else:
                params, iters = _lbfgs(x, np.eye(len(classes))[pos], lam, max_iter)
                converged = iters < max_iter
            if tune and not converged and warn:
                why = (f"at its cap of {max_iter} iterations before converging; raise probe_max_iter"
                       if iters >= max_iter else
                       f"after {iters} iterations with its gradient above the tolerance (1e-4)")
                warnings.warn(f"{where}: the probe (weight decay {lam:g}) stopped {why}", ResultWarning,
                              stacklevel=2)
            if len(xt):
                scores[:, torch.from_numpy(classes)] = torch.from_numpy(
                    log_softmax(_logits(params, xt, len(classes)), 1))
        if len(xt) and np.isfinite(scores.numpy()).any():
            scores = torch.nan_to_num(scores, nan=float(np.nanmin(scores.numpy())) - 1.0)
        acc = float((scores.argmax(1) == test_labels).double().mean()) if len(xt) else float("nan")
        return ProbeFit(acc, scores, lam, iters, converged, cv)


def linear_probe(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor, *,
                 standardize: bool = True, weight_decay: float = 1e-4, max_iter: int = 100,
                 num_classes: int | None = None, warn: bool = True, **tuning: Any) -> tuple[float, Tensor]:
    """`fit_probe` -> (top-1 accuracy on the test set, (m, C) test log-probabilities). Without ``tune=True``
    (in ``tuning``, with ``grid``, ``folds``, ``where``) the fixed ``weight_decay`` and a fixed budget of
    ``max_iter`` iterations (deterministic; the protocol of the zoo's cards)."""
    fit = fit_probe(train, train_labels, test, test_labels, standardize=standardize, weight_decay=weight_decay,
                    max_iter=max_iter, num_classes=num_classes, warn=warn, **tuning)
    return fit.accuracy, fit.scores


def probe_fits(train: Sequence[Tensor], train_labels: Tensor, test: Sequence[Tensor], test_labels: Tensor,
               **kw: Any) -> list[ProbeFit]:
    """`fit_probe` of L feature sets of the same images (e.g. the layers of a model); the single-class
    warning once for all."""
    if "num_classes" not in kw or kw["num_classes"] is None:
        kw["num_classes"] = int(max(train_labels.max(), test_labels.max())) + 1
    n_classes = len(torch.unique(train_labels))
    if n_classes < 2 and kw.pop("warn", True):
        warn_single_class_probe(n_classes)  # once for all the feature sets
    kw["warn"] = kw.get("tune", False)  # the cap warning stays per fit
    if n_classes < 2:
        kw["warn"] = False
    return [fit_probe(a, train_labels, b, test_labels, **kw) for a, b in zip(train, test, strict=True)]


def linear_probes(train: Sequence[Tensor], train_labels: Tensor, test: Sequence[Tensor], test_labels: Tensor,
                  **kw: Any) -> tuple[list[float], Tensor]:
    """`linear_probe` of L feature sets of the same images (sequences of (n, D) / (m, D) tensors, e.g. the
    layers of a model) -> (L top-1 accuracies, (L, m, C) test scores)."""
    out = probe_fits(train, train_labels, test, test_labels, **kw)
    return [o.accuracy for o in out], torch.stack([o.scores for o in out])


SGD_SCHEDULES = ("cosine", "step")
STEP_MILESTONES = (0.6, 0.8)  # 'step': x0.1 from 60 % and again from 80 % of the epochs (MoCo's 60 and 80 of 100)


def sgd_options(who: str, epochs: int = 10, batch: int = 256, lr: float = 0.1, momentum: float = 0.9,
                weight_decay: float = 0.0, schedule: str = "cosine") -> dict[str, Any]:
    """An analysis's SGD-probe parameters checked (one sentence each) -> keyword arguments of `fit_probe_sgd`."""
    if int(epochs) < 1:
        raise ConfigError(f"{who}: sgd_epochs must be at least 1; got {epochs}")
    if int(batch) < 1:
        raise ConfigError(f"{who}: sgd_batch must be at least 1; got {batch}")
    if not (np.isfinite(lr) and float(lr) > 0):
        raise ConfigError(f"{who}: sgd_lr must be a positive number; got {lr}")
    if not 0 <= float(momentum) < 1:
        raise ConfigError(f"{who}: sgd_momentum must be at least 0 and below 1; got {momentum}")
    if not (np.isfinite(weight_decay) and float(weight_decay) >= 0):
        raise ConfigError(f"{who}: sgd_weight_decay must be 0 or positive; got {weight_decay}")
    if schedule not in SGD_SCHEDULES:
        raise ConfigError(f"{who}: sgd_schedule {schedule!r} does not exist; choose {' or '.join(SGD_SCHEDULES)}")
    return {"epochs": int(epochs), "batch": int(batch), "lr": float(lr), "momentum": float(momentum),
            "weight_decay": float(weight_decay), "schedule": str(schedule)}


def read_rows(x: Tensor, idx: Tensor, device: torch.device) -> Tensor:
    """Rows ``idx`` of an (n, D) store as float32 on ``device``: on a memory-mapped store (`PooledTable.layer`)
    only those rows are read from the file, so a minibatch costs its own rows of memory, never the store's.
    Every read of `fit_probe_sgd` goes through here (tests count the rows)."""
    return x[idx.to(x.device)].to(device=device, dtype=torch.float32)


def sgd_lr(lr: float, step: int, total: int, epoch: int, epochs: int, schedule: str) -> float:
    """The learning rate of minibatch ``step`` (0-based, of ``total``) in ``epoch`` (0-based, of ``epochs``):
    'cosine' decays per step from ``lr`` towards 0, lr (1 + cos(pi step / total)) / 2 (DINO, MAE, without
    warm-up); 'step' multiplies it by 0.1 at each of `STEP_MILESTONES` (fractions of the epochs)."""
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + float(np.cos(np.pi * step / max(total, 1))))
    return lr * 0.1 ** sum(epoch >= f * epochs for f in STEP_MILESTONES)


def streamed_moments(x: Tensor, rows: Tensor, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(mean, standard deviation with ddof 1, floored at 1e-6 as `fit_probe`'s) of the features ``x[rows]``,
    read ``batch`` rows at a time (`read_rows`); float64 sums shifted by the first row (no cancellation when
    the mean dwarfs the spread)."""
    n = len(rows)
    shift = read_rows(x, rows[:1], device).double()[0]
    s1 = torch.zeros_like(shift)
    s2 = torch.zeros_like(shift)
    for s in range(0, n, batch):
        xb = read_rows(x, rows[s:s + batch], device).double() - shift
        s1 += xb.sum(0)
        s2 += (xb * xb).sum(0)
    mean = s1 / n
    var = (s2 - n * mean * mean) / max(n - 1, 1)
    return (mean + shift).float(), var.clamp_min(0).sqrt().clamp_min(1e-6).float()


def fit_probe_sgd(x: Tensor, labels: Tensor, is_test: Tensor, *, standardize: bool = True, epochs: int = 10,
                  batch: int = 256, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                  schedule: str = "cosine", seed: int = 0, num_classes: int | None = None,
                  where: str = "linear probe", warn: bool = True, device: torch.device | str | None = None
                  ) -> ProbeFit:
    """A linear softmax classifier trained by minibatch SGD on every training row of the store ``x`` ((n, D),
    typically a memory-mapped float16 `PooledTable.layer`), as DINO, MAE and Walmer et al. (2023, Table 6)
    train their linear probes: mean cross-entropy, momentum ``momentum`` (PyTorch's: v = m v + g, p -= lr v),
    L2 ``weight_decay`` on the weights (g += wd W; the bias is not decayed), learning-rate ``schedule``
    (`sgd_lr`), ``epochs`` passes over the training rows (``~is_test``) in minibatches of ``batch`` (the last
    one smaller). ``standardize``: features normalised by the training rows' mean and std first
    (`streamed_moments`: MAE's affine-free BatchNorm at convergence), else raw (Walmer et al.'s 'no BN' rows).

    Memory stays bounded: every read is one minibatch of rows (`read_rows`) moved to ``device`` (where the
    products run; default the CPU), and the test rows are scored ``batch`` at a time. Deterministic for a
    ``seed``: a `torch.Generator` seeded with it draws the initial weights first (N(0, 0.01^2), (D, C') for the
    C' training classes; the bias starts at 0), then one `torch.randperm` of the training rows per epoch.
    Returns a `ProbeFit` like `fit_probe`'s (test log-probabilities; classes absent from training score below
    every other) with ``solver='sgd'``, the steps taken as ``iterations`` and each epoch's mean training loss;
    a loss that becomes non-finite stops the fit with a `ResultWarning` (prefixed by ``where``)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    is_test = is_test.bool().cpu()
    y = labels.long().cpu()
    train_rows, test_rows = torch.nonzero(~is_test).flatten(), torch.nonzero(is_test).flatten()
    c = int(num_classes) if num_classes is not None else int(y.max()) + 1
    classes = torch.unique(y[train_rows])
    scores = torch.full((len(test_rows), c), float("nan"), dtype=torch.float64)
    if len(classes) < 2 and warn:
        warn_single_class_probe(len(classes))
    steps, losses, finite = 0, [], True
    if len(classes) == 1:
        scores[:, int(classes[0])] = 0.0
    elif len(classes) > 1:
        pos = torch.searchsorted(classes, y)  # training classes as positions 0..C'-1 (test rows: unused)
        if standardize:
            mu, sd = streamed_moments(x, train_rows, batch, dev)
        else:
            mu, sd = torch.zeros(x.shape[1], device=dev), torch.ones(x.shape[1], device=dev)
        g = torch.Generator().manual_seed(int(seed))
        w = (torch.randn(x.shape[1], len(classes), generator=g) * 0.01).to(dev)
        b = torch.zeros(len(classes), device=dev)
        vw, vb = torch.zeros_like(w), torch.zeros_like(b)
        n = len(train_rows)
        per_epoch = -(-n // batch)
        for epoch in range(epochs):
            order = train_rows[torch.randperm(n, generator=g)]
            total = torch.zeros((), dtype=torch.float64, device=dev)
            for s in range(0, n, batch):
                rows = order[s:s + batch]
                xb = (read_rows(x, rows, dev) - mu) / sd
                z = torch.log_softmax(xb @ w + b, 1)
                yb = pos[rows].to(dev)
                total -= z.gather(1, yb[:, None]).double().sum()
                grad = z.exp()
                grad[torch.arange(len(rows), device=dev), yb] -= 1.0
                grad /= len(rows)
                vw.mul_(momentum).add_(xb.T @ grad + weight_decay * w)
                vb.mul_(momentum).add_(grad.sum(0))
                step_lr = sgd_lr(lr, steps, per_epoch * epochs, epoch, epochs, schedule)
                w.sub_(step_lr * vw)
                b.sub_(step_lr * vb)
                steps += 1
            losses.append(float(total) / n)  # one read of the device per epoch
            if not np.isfinite(losses[-1]):
                finite = False
                if warn:
                    warnings.warn(f"{where}: the SGD probe's training loss became non-finite in epoch {epoch + 1}; "
                                  f"lower sgd_lr (now {lr:g}) or standardize the features", ResultWarning,
                                  stacklevel=2)
                break
        for s in range(0, len(test_rows), batch):
            xb = (read_rows(x, test_rows[s:s + batch], dev) - mu) / sd
            scores[s:s + batch, classes] = torch.log_softmax((xb @ w + b).double(), 1).cpu()
    if len(test_rows) and torch.isfinite(scores).any():
        scores = torch.nan_to_num(scores, nan=float(scores[torch.isfinite(scores)].min()) - 1.0)
    acc = float((scores.argmax(1) == y[test_rows]).double().mean()) if len(test_rows) else float("nan")
    return ProbeFit(acc, scores, float(weight_decay), steps, finite, {}, "sgd", losses)


def warn_single_class_probe(n_classes: int) -> None:
    warnings.warn(f"linear probe: its training set holds {n_classes} class{'es' if n_classes != 1 else ''}, so it "
                  "predicts one class for every test image and its accuracy is that class's share of the test set, "
                  "not a measure of the features", ResultWarning, stacklevel=3)


def purity(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Fraction of samples whose cluster's majority class is their own class."""
    m = contingency_matrix(labels_true, labels_pred)
    return float(m.max(axis=0).sum() / m.sum())


def kmeans_scores(feats: np.ndarray | Tensor, labels: np.ndarray, k: int, seed: int = 0, n_init: int = 1
                  ) -> dict[str, float]:
    """k-means (scikit-learn, k-means++ seeding, fixed seed; ``n_init`` restarts, 1 = scikit-learn's default for
    k-means++) on the features in float32; purity, NMI and ARI against labels. On the host whatever the model's
    device: a k-means of another library (or on a GPU, with other random draws) gives other clusters on the same
    seed, so a study's k-means scores would depend on where it ran; at the rows the analyses keep (``max_images``)
    this is seconds per layer."""
    x = feats.float().cpu().numpy() if isinstance(feats, Tensor) else np.asarray(feats, dtype=np.float32)
    pred = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit_predict(x)
    return {"purity": purity(labels, pred), "nmi": float(normalized_mutual_info_score(labels, pred)),
            "ari": float(adjusted_rand_score(labels, pred))}


def kendall_tau_b_rows(a: Tensor, b: Tensor, chunk: int = 256) -> Tensor:
    """Kendall's tau-b of every row of ``a`` (n, k) with the same row of ``b`` (what `scipy.stats.kendalltau`
    gives one row at a time; NaN where a row is constant), from the k x k sign matrices of a few rows at a time:
    tau_b = sum_{i<j} sgn(a_i - a_j) sgn(b_i - b_j) / sqrt((n0 - ties_a) (n0 - ties_b)), n0 = k (k - 1) / 2."""
    a, b = a.double(), b.double()
    out = torch.empty(len(a), dtype=torch.float64)
    for s in range(0, len(a), chunk):
        sa = torch.sign(a[s:s + chunk, :, None] - a[s:s + chunk, None, :])
        sb = torch.sign(b[s:s + chunk, :, None] - b[s:s + chunk, None, :])
        con = (sa * sb).sum((1, 2)) / 2  # each unordered pair counted twice
        untied_a = (sa != 0).sum((1, 2)).double() / 2  # n0 - ties_a
        untied_b = (sb != 0).sum((1, 2)).double() / 2
        den = torch.sqrt(untied_a * untied_b)
        out[s:s + chunk] = torch.where(den > 0, con / den.clamp_min(1e-300), torch.tensor(float("nan"),
                                                                                          dtype=torch.float64))
    return out  # k < 2: no pair, every row NaN (den 0), as scipy


def prediction_agreement(logits_a: Tensor, logits_b: Tensor, labels: Tensor,
                         ks: tuple[int, ...] = (5, 10, 100)) -> dict[str, float]:
    """Shekhar et al. 2022 §2.4: for each image, Kendall's tau between the two models' scores on model A's top-k
    classes, averaged over all, correctly (both right) and incorrectly (both wrong) classified images;
    and the macro F1 of model B's top-1 predictions against model A's."""
    pa, pb = logits_a.argmax(1), logits_b.argmax(1)
    groups = {"all": torch.ones_like(labels, dtype=torch.bool), "correct": (pa == labels) & (pb == labels),
              "incorrect": (pa != labels) & (pb != labels)}
    out: dict[str, float] = {}
    for k in ks:
        kk = min(k, logits_a.shape[1])
        top = logits_a.topk(kk, dim=1).indices
        taus_t = kendall_tau_b_rows(logits_a.gather(1, top), logits_b.gather(1, top))
        for g, mask in groups.items():
            sel = taus_t[mask]
            out[f"kendall_tau_top{k}_{g}"] = float(np.nanmean(sel.numpy())) if len(sel) else float("nan")
    out["top1_f1"] = float(f1_score(pa.numpy(), pb.numpy(), average="macro"))
    return out
