"""Pure functions of a mechanistic lens: attention rollout, a logit lens readout, high-norm token outliers.

* :func:`fuse_heads` / :func:`rollout_step` / :func:`attention_rollout`: attention rollout (Abnar and Zuidema
  2020) with the options of the public vit-explain code (head fusion mean / max / min, a discard ratio of the
  weakest fused weights, the residual added as ``0.5 A + 0.5 I``), each row renormalised to sum 1 (vit-explain
  divides by ``a.sum(dim=-1)`` without ``keepdim``, which broadcasts the row sums over columns; here rows).
* :func:`gradient_rollout`: the gradient-weighted relevance of Chefer et al. 2021, ``R <- R + mean_h(∇A ⊙ A)^+ R``.
* :func:`kl_to_final`: KL(final || block) of two sets of logits, per image.
* :func:`robust_outliers`: tokens whose norm lies above ``median + k * 1.4826 * MAD`` of their own image's
  patch-token norms (the normal-consistent MAD), per image.
* :func:`bimodal_threshold`: a norm threshold read off a pooled distribution of log norms that has two modes
  (a two-Gaussian mixture, Ashman's D), or none when it has one.
* :func:`topk_kendall_tau` / :func:`top1_f1` / :func:`top1_f1_replicates`: how alike two models' own heads
  rank the classes of an image and pick its top-1 class (Shekhar et al. 2022 §2.4, Fig. 4), symmetric in the
  two models.

Tensors in, tensors out; no I/O (``vitscope.metrics`` conventions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["HEAD_FUSIONS", "MAD_SCALE", "MAX_UPPER_SHARE", "MIN_SEPARATION", "attention_rollout", "bimodal_threshold",
           "fuse_heads", "gradient_rollout", "kl_to_final", "product_rows", "robust_outliers", "rollout_step",
           "top1_f1", "top1_f1_replicates", "topk_kendall_tau"]

HEAD_FUSIONS = ("mean", "max", "min")
MAD_SCALE = 1.4826
"""The MAD times this estimates the standard deviation of a normal distribution."""
MIN_SEPARATION = 2.0
"""Ashman's D above which two Gaussian components count as two modes (Ashman, Bird and Zepf 1994)."""
MAX_UPPER_SHARE = 0.2
"""The largest share of the tokens an upper mode may hold to count as artifacts: they are a small minority (about
2 % of the tokens in Darcet et al. 2024); a larger upper mode splits ordinary tokens (object vs background)."""


def fuse_heads(attn: Tensor, head_fusion: Literal["mean", "max", "min"] = "mean") -> Tensor:
    """``(B, H, T, T) -> (B, T, T)``: the heads' attention fused by their mean, maximum or minimum."""
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be (B, H, T, T), got shape {tuple(attn.shape)}")
    if head_fusion == "mean":
        return attn.mean(1)
    if head_fusion == "max":
        return attn.amax(1)
    if head_fusion == "min":
        return attn.amin(1)
    raise ValueError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, got {head_fusion!r}")


def rollout_step(fused: Tensor, discard_ratio: float = 0.0) -> Tensor:
    """One layer's rollout factor from its fused attention ``(B, T, T)``.

    The ``floor(discard_ratio * T * T)`` smallest entries of each image's fused matrix are set to 0 (ties: the
    lower flat index goes first, a stable sort), except entry (0, 0), the first token's attention to itself,
    which vit-explain never discards; then ``0.5 * fused + 0.5 * I`` with each row divided by its sum."""
    if not 0.0 <= float(discard_ratio) < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    B, T, _ = fused.shape
    a = (fused * 0.5).contiguous()  # a copy: the input is left as it is
    n = int(discard_ratio * T * T)
    if n:
        order = torch.sort(fused.reshape(B, T * T), dim=-1, stable=True).indices[:, :n]
        first = a[:, 0, 0].clone()  # entry (0, 0) is never discarded
        a.view(B, T * T).scatter_(-1, order, 0.0)
        a[:, 0, 0] = first
    a.diagonal(dim1=-2, dim2=-1).add_(0.5)
    return a.div_(a.sum(-1, keepdim=True))


def attention_rollout(attns: Sequence[Tensor], head_fusion: Literal["mean", "max", "min"] = "mean",
                      discard_ratio: float = 0.0, query: int | Tensor = 0) -> Tensor:
    """The rollout up to each block, row ``query`` (token 0 by default, the CLS token of a model that has one;
    the caller checks ``has_cls_token``, as token 0 of a model with registers and no CLS token is a register), or
    a query given as weights over the tokens ``(B, T)`` (the row ``w^T R_l``: a model without a CLS token read
    through its pooling): ``(B, L, T)``.

    ``attns`` are the attention probabilities ``(B, H, T, T)`` of blocks 0 .. L-1 in order. The rollout up to
    block l is ``R_l = F_l F_{l-1} ... F_0`` (`rollout_step` factors); row ``query`` of it is computed from
    the left, ``e_q^T F_l`` times the earlier factors, so no ``T x T`` product of matrices is formed:
    O(L^2 T^2) per image instead of O(L T^3), in L batched products (every block's row advanced at once)."""
    if not attns:
        raise ValueError("attention_rollout needs the attention of at least one block")
    factors = [rollout_step(fuse_heads(a, head_fusion), discard_ratio) for a in attns]
    return product_rows(factors, query)


def product_rows(factors: Sequence[Tensor], query: int | Tensor = 0) -> Tensor:
    """``(B, L, T)``: row ``query`` of ``F_l F_{l-1} ... F_0`` for every l, from ``(B, T, T)`` factors F_0 ..
    F_{L-1}, or with ``query`` weights ``(B, T)`` the row ``w^T F_l ... F_0``. Row l is advanced from the left
    (``e_q^T F_l``, then times F_{l-1}, ...), every block's row at once: L batched vector-matrix products, never a
    T x T matrix product."""
    B, T = factors[0].shape[:2]
    rows = factors[0].new_zeros(B, len(factors), T)
    if isinstance(query, Tensor) and query.shape != (B, T):
        raise ValueError(f"query weights must be (B, T) = {(B, T)}, got {tuple(query.shape)}")
    for m in range(len(factors) - 1, -1, -1):
        if m + 1 < len(factors):
            rows[:, m + 1:] = torch.bmm(rows[:, m + 1:], factors[m])
        if isinstance(query, Tensor):
            rows[:, m] = torch.bmm(query[:, None, :].to(factors[m].dtype), factors[m])[:, 0]
        else:
            rows[:, m] = factors[m][:, query]
    return rows


def gradient_rollout(attns: Sequence[Tensor], grads: Sequence[Tensor], query: int | Tensor = 0) -> Tensor:
    """Chefer et al. 2021 (generic attention-model explainability) relevance up to each block, row ``query``:
    ``(B, L, T)``. Per block ``Ā = mean_h (∇A ⊙ A)^+`` (the attention weighted by the gradient of the explained
    score, negative parts dropped, heads averaged) and ``R_l = (I + Ā_l) R_{l-1}`` from ``R = I``: the rows are
    not renormalised (relevance, not a distribution)."""
    if len(attns) != len(grads) or not attns:
        raise ValueError("gradient_rollout needs one gradient per attention tensor, and at least one block")
    factors = []
    for a, g in zip(attns, grads, strict=True):
        f = (a * g).clamp_min_(0).mean(1)
        f.diagonal(dim1=-2, dim2=-1).add_(1.0)
        factors.append(f)
    return product_rows(factors, query)


def kl_to_final(logits: Tensor, final_logits: Tensor) -> Tensor:
    """``(N,)`` float64 KL(softmax(final) || softmax(logits)) per row, in nats."""
    lp = torch.log_softmax(logits.double(), -1)
    lq = torch.log_softmax(final_logits.double(), -1)
    return (lq.exp() * (lq - lp)).sum(-1)


def robust_outliers(norms: Tensor, k: float = 6.0) -> Tensor:
    """``(..., N) -> (..., N)`` bool: entries above ``median + k * MAD_SCALE * MAD`` of their own last axis
    (the lower median of an even count, as ``torch.median``). A row whose MAD is 0 flags entries above its
    median, so a single token raised over identical ones is found."""
    med = norms.median(-1, keepdim=True).values
    mad = (norms - med).abs().median(-1, keepdim=True).values
    return norms > med + k * MAD_SCALE * mad


def bimodal_threshold(values: Tensor, min_separation: float = MIN_SEPARATION, max_share: float = MAX_UPPER_SHARE,
                      max_values: int = 200_000, seed: int = 0) -> tuple[float, float, float]:
    """``(threshold, separation, upper_share)`` of 1-D ``values`` (log norms): a two-component Gaussian mixture
    (scikit-learn, fixed ``seed``) is fitted; its separation is Ashman's D,
    ``sqrt(2) |mu_2 - mu_1| / sqrt(s_1^2 + s_2^2)``, and ``upper_share`` the mixture weight of the upper
    component. When D exceeds ``min_separation`` and the upper component holds at most ``max_share`` of the
    values, the distribution has an outlier mode and the threshold is the point between the means where the
    upper component's weighted density overtakes the lower one's (on a grid of 10,001 points: 1e-4 of the gap);
    else it is ``inf`` (no value lies above it). At most ``max_values`` values are used (an even stride)."""
    import numpy as np
    from sklearn.mixture import GaussianMixture

    x = values.detach().double().flatten().cpu().numpy()
    x = x[np.isfinite(x)]
    if len(x) < 4 or np.ptp(x) == 0:
        return float("inf"), 0.0, 0.0
    if len(x) > max_values:
        x = x[:: -(-len(x) // max_values)]
    gm = GaussianMixture(2, covariance_type="full", random_state=seed, n_init=1).fit(x[:, None])
    mu, sd, w = gm.means_[:, 0], np.sqrt(gm.covariances_[:, 0, 0]), gm.weights_
    lo, hi = np.argsort(mu)
    sep = float(np.sqrt(2) * (mu[hi] - mu[lo]) / np.sqrt(sd[lo] ** 2 + sd[hi] ** 2))
    if not (sep > min_separation and w[hi] <= max_share):
        return float("inf"), sep, float(w[hi])
    grid = np.linspace(mu[lo], mu[hi], 10_001)

    def log_density(k: int) -> np.ndarray:
        return np.log(w[k]) - np.log(sd[k]) - 0.5 * ((grid - mu[k]) / sd[k]) ** 2

    above = np.nonzero(log_density(hi) >= log_density(lo))[0]
    return float(grid[above[0]] if len(above) else grid[-1]), sep, float(w[hi])


# ---------------------------------------------------------------- two models' heads (Shekhar et al. 2022, Fig. 4)


def topk_kendall_tau(logits_a: Tensor, logits_b: Tensor, k: int) -> Tensor:
    """``(N,)`` float64: per image, Kendall's tau between two models' rankings of their top-k classes (Shekhar et
    al. 2022 §2.4, Fig. 4: "Kendall's Tau rank correlation coefficient of the top-k class predictions"). The
    paper ranks one model's top-k classes under both models, which depends on whose top-k is taken; here both
    are taken and averaged, ``(tau_b(A, B on A's top-k) + tau_b(A, B on B's top-k)) / 2``, so the value is the
    same for (A, B) and (B, A). Each term is `scipy.stats.kendalltau`'s tau-b of the two models' logits on those
    classes (the order of the logits is the ranking); ``k`` is capped at the number of classes."""
    from vitscope.metrics.semantics import kendall_tau_b_rows

    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logits of shapes {tuple(logits_a.shape)} and {tuple(logits_b.shape)}: the two heads need "
                         "the same classes")
    kk = min(int(k), logits_a.shape[-1])
    a, b = logits_a.double(), logits_b.double()
    taus = []
    for ref in (a, b):
        top = ref.topk(kk, dim=-1).indices
        taus.append(kendall_tau_b_rows(a.gather(-1, top).cpu(), b.gather(-1, top).cpu()))
    return (taus[0] + taus[1]) / 2


def top1_f1(pred_a: Tensor, pred_b: Tensor) -> float:
    """The F1 score of one model's top-1 predictions against the other's (Shekhar et al. 2022 §2.4: 0.93 for DINO
    and MoCo v3): macro-averaged over the classes either model predicts (scikit-learn's ``f1_score(average=
    "macro")``), per class ``2 |A = c and B = c| / (|A = c| + |B = c|)``, which swapping A and B leaves unchanged.
    NaN without images."""
    from sklearn.metrics import f1_score

    if not len(pred_a):
        return float("nan")
    return float(f1_score(pred_a.long().cpu().numpy(), pred_b.long().cpu().numpy(), average="macro"))


def top1_f1_replicates(pred_a: Tensor, pred_b: Tensor, groups: int) -> list[float]:
    """`top1_f1` without each of ``groups`` contiguous blocks of the images in turn (delete-a-group jackknife
    replicates, for `vitscope.metrics.similarity.jackknife.jackknife_interval`): the macro F1 is not a mean over
    images, so a t interval of per-image values does not apply to it."""
    n = len(pred_a)
    g = min(int(groups), n)
    bounds = torch.linspace(0, n, g + 1).round().long().tolist()
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        keep = torch.ones(n, dtype=torch.bool)
        keep[lo:hi] = False
        out.append(top1_f1(pred_a[keep], pred_b[keep]))
    return out
