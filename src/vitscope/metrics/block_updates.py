"""How a transformer block moves its tokens (pure functions on tensors; the analysis is
`vitscope.analyses.mechanistic.block_updates`).

A pre-norm block adds two updates to the residual stream: ``resid_mid = x_in + attn_out`` and
``out = resid_mid + mlp_out``. Per token, `token_update_stats` measures each update against the stream it is
added to, each branch's share of the two updates and the block's whole displacement; per image, `unison`
measures how much the tokens move together (Park et al. 2023: a contrastive model's attention adds nearly the same
vector to every token, ``z -> z + c``; a masked-modelling model moves each token its own way). `project_pair`
draws one image's tokens before and after a block in the plane of the block input's two principal axes.
"""

from __future__ import annotations

import numpy as np
import torch

#: the per-token statistics of `token_update_stats`, in its last axis's order
TOKEN_STATS = ("attn_update", "mlp_update", "attn_share", "mlp_share", "displacement")
#: the per-image statistics of `unison`, in its last axis's order
UNISON_STATS = ("unison_cosine", "unison_share")


def _norm(x: torch.Tensor) -> torch.Tensor:
    """Euclidean norm over the last axis, computed in float32 (bfloat16 / float16 taps included), as float64."""
    return torch.linalg.vector_norm(x.float(), dim=-1).double()


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else NaN (a ratio to nothing is not a number, not infinity)."""
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.full_like(num, float("nan")))


def token_update_stats(x_in: torch.Tensor, attn_out: torch.Tensor, resid_mid: torch.Tensor, mlp_out: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """``(..., T, D)`` block input, attention update, stream between the branches, MLP update and block output ->
    ``(..., T, 5)`` float64 per token, in `TOKEN_STATS` order:

    * ``attn_update`` = ||attn_out|| / ||x_in||, ``mlp_update`` = ||mlp_out|| / ||resid_mid||: each update's size
      relative to the stream it is added to;
    * ``attn_share`` = ||attn_out|| / (||attn_out|| + ||mlp_out||) and ``mlp_share`` = 1 - attn_share: which branch
      makes the block's change (as norms: the updates need not be orthogonal, so no squared split is exact);
    * ``displacement`` = ||out - x_in|| / ||x_in||: how far the block moves the token, relative to where it was.

    A ratio whose denominator is 0 is NaN."""
    n_in, n_a, n_mid, n_m = _norm(x_in), _norm(attn_out), _norm(resid_mid), _norm(mlp_out)
    share = _ratio(n_a, n_a + n_m)
    disp = _norm(out.float() - x_in.float())
    return torch.stack([_ratio(n_a, n_in), _ratio(n_m, n_mid), share, 1 - share, _ratio(disp, n_in)], -1)


def unison(d: torch.Tensor) -> torch.Tensor:
    """``(B, T, D)`` displacements of an image's tokens -> ``(B, 2)`` float64, in `UNISON_STATS` order:

    * ``unison_cosine``: mean cosine between the displacements of two different tokens, over the ``n (n - 1)``
      ordered pairs of tokens that move, from ``Σ_{i≠j} u_i·u_j = ||Σ u_i||² - n`` (``u`` unit vectors): 1 when every
      token moves in the same direction, about 0 for unrelated directions;
    * ``unison_share``: the share of the displacements' second moment the mean displacement explains,
      ``||mean d||² / mean ||d||²``: 1 for a pure translation ``z -> z + c``, ``1 / T`` for balanced independent moves.

    NaN for an image with fewer than two moving tokens (cosine) or no movement (share)."""
    d = d.float()
    norms = torch.linalg.vector_norm(d, dim=-1)  # (B, T)
    moving = norms > 0
    u = d / norms.clamp_min(torch.finfo(d.dtype).tiny)[..., None] * moving[..., None]
    n = moving.double().sum(1)
    s2 = torch.linalg.vector_norm(u.sum(1), dim=-1).double().square()
    pairs = n * (n - 1)
    cosine = torch.where(pairs > 0, (s2 - n) / pairs.clamp_min(1), torch.full_like(s2, float("nan")))
    second = norms.double().square().mean(1)
    mean_sq = torch.linalg.vector_norm(d.mean(1), dim=-1).double().square()
    share = torch.where(second > 0, mean_sq / second.clamp_min(torch.finfo(second.dtype).tiny),
                        torch.full_like(second, float("nan")))
    return torch.stack([cosine, share], -1)


def project_pair(before: np.ndarray, after: np.ndarray, fit_rows: np.ndarray | None = None,
                 n_components: int = 2) -> tuple[np.ndarray, np.ndarray, float]:
    """A principal-component projection fitted on ``before`` (``(T, D)``; only the rows ``fit_rows`` selects, a
    boolean mask, when given) and applied unchanged to both ``before`` and ``after``, so a token's arrow from its
    position before the block to its position after is drawn in one frame. Returns the ``(T, k)`` coordinates
    before and after and the share of the fitted rows' variance the ``k`` axes explain (scikit-learn's PCA,
    full SVD: deterministic; its sign convention, `sklearn.utils.extmath.svd_flip`)."""
    from sklearn.decomposition import PCA

    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    rows = b if fit_rows is None else b[np.asarray(fit_rows, dtype=bool)]
    k = min(n_components, rows.shape[0], rows.shape[1])
    pca = PCA(n_components=k, svd_solver="full").fit(rows)
    share = float(pca.explained_variance_ratio_.sum()) if rows.shape[0] > 1 else float("nan")
    pad = ((0, 0), (0, n_components - k))  # fewer rows or features than axes: the missing axes are 0
    return np.pad(pca.transform(b), pad), np.pad(pca.transform(a), pad), share
