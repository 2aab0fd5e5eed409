"""The invariance metrics of Merlin et al., "What happens during finetuning of ViTs: an invariance based
investigation" (2023), on STIR values (Nanda et al., "Measuring Representational Robustness of Neural
Networks Through Shared Invariances", ICML 2022). Pure functions on arrays, no models, no I/O.

With pt the pretrained and ft the fine-tuned model, layers i, j:

  STIR(m2[i] | m1[j])  = mean over k repeats of CKA(m2[i](X), m2[i](X')), X' inverted from noise so that
                         m1[j](X') ~ m1[j](X)                                  (Nanda et al. eq. 1)
  forgetting(ft[i]|pt[i]) = 1 - STIR(ft[i] | pt[i])                            (Merlin et al. eq. 2)
  learning(ft[i]|pt[i])   = 1 - STIR(pt[i] | ft[i])                            (eq. 3)
  cka divergence          = 1 - CKA(ft[i], pt[i])                              (eq. 4)
  Invariance Flow(ft[j], pt[i]) = STIR(ft[j] | pt[i]) - STIR(ft[i] | pt[i])    (eq. 5)

The "1" in eqs. 2-4 is STIR (or CKA) of a layer with itself, 1 by definition (Merlin et al. Sec. 3.2). A
positive flow at j < i means the invariances of pretrained layer i are found in a shallower fine-tuned layer
(compression); at j > i in a deeper one (expansion).

STIR's CKA is, by default, the minibatch CKA with the unbiased HSIC_1 estimator (`vitscope.metrics.cka`),
accumulated over every batch: `StirSums` keeps the three per-batch HSIC_1 sums, so merging shards or resuming is
an addition (``cka_estimator='minibatch_unbiased'``). The public STIR code (github.com/nvedant07/STIR, its default
``sim_metric='linear_CKA'``: ``WrapperCKA(linear_CKA)`` of ``stir/CKA_pytorch.py``) computes the biased linear CKA
of each batch and keeps the value of the last one (``WrapperCKA.__call__`` overwrites it); that estimator is
``cka_estimator='last_batch_biased'``: the three Frobenius products of the doubly centred Grams of the batch
with the highest image ids (`hsic_terms_both` returns both sets of terms from the same Grams).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from vitscope.errors import check_choice
from vitscope.metrics import cka as C

#: STIR's CKA: vitscope's default first, then the public STIR code's (see the module docstring)
CKA_ESTIMATORS = ("minibatch_unbiased", "last_batch_biased")


def check_cka_estimator(name: object, who: str = "stir") -> str:
    """One sentence for an estimator that does not exist; returns the name."""
    return check_choice(name, CKA_ESTIMATORS, who, "cka_estimator",
                        f"{' or '.join(CKA_ESTIMATORS)} (the public STIR code's)")

__all__ = [
    "cka_divergence",
    "flow_matrix",
    "flow_summary",
    "forgetting",
    "CKA_ESTIMATORS",
    "check_cka_estimator",
    "hsic_terms",
    "hsic_terms_both",
    "learning",
    "pearson",
    "stir_from_sums",
    "AGGREGATES",
    "COMBINATIONS",
    "aggregate",
    "bonferroni",
    "combine",
    "hypothesis_layer_sets",
    "hypothesis_search",
    "pearson_up_to",
]


def _arr(x: Sequence[float] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def forgetting(stir_ft_given_pt: Sequence[float] | np.ndarray) -> np.ndarray:
    """forgetting(ft[i]|pt[i]) = 1 - STIR(ft[i]|pt[i]), elementwise over layers."""
    return 1.0 - _arr(stir_ft_given_pt)


def learning(stir_pt_given_ft: Sequence[float] | np.ndarray) -> np.ndarray:
    """learning(ft[i]|pt[i]) = 1 - STIR(pt[i]|ft[i]), elementwise over layers."""
    return 1.0 - _arr(stir_pt_given_ft)


def cka_divergence(cka_ft_pt: Sequence[float] | np.ndarray) -> np.ndarray:
    """cka divergence(ft[i], pt[i]) = 1 - CKA(ft[i], pt[i]), elementwise over layers."""
    return 1.0 - _arr(cka_ft_pt)


def flow_matrix(stir_ft_given_pt: np.ndarray) -> np.ndarray:
    """Invariance Flow matrix from the STIR grid ``S[i, j] = STIR(ft[j] | pt[i])`` (rows: pretrained layer i,
    columns: fine-tuned layer j, the same layers in the same order on both axes):
    ``F[i, j] = S[i, j] - S[i, i]``. Its diagonal is 0."""
    s = _arr(stir_ft_given_pt)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"the STIR grid must be square (same layers of both models), got shape {s.shape}")
    return s - np.diag(s)[:, None]


def flow_summary(flow: np.ndarray) -> dict[str, float]:
    """Compression / expansion read off an Invariance Flow matrix ``F[i, j]`` (pt layer i, ft layer j).

    compression: mean over pretrained layers i of the largest positive flow to a shallower fine-tuned layer
    (max(0, max_{j<i} F[i, j])); expansion: the same towards deeper layers (j > i); compressed_layers /
    expanded_layers: how many pretrained layers have their best-matching fine-tuned layer (argmax_j F[i, j],
    when its flow is positive) shallower / deeper than themselves; mean_shift: mean over i of (best j - i) in
    layer positions (negative: invariances move to shallower layers)."""
    f = _arr(flow)
    n = f.shape[0]
    comp, exp_, shifts = [], [], []
    n_comp = n_exp = 0
    for i in range(n):
        row = f[i]
        comp.append(max(0.0, float(np.max(row[:i]))) if i > 0 else 0.0)
        exp_.append(max(0.0, float(np.max(row[i + 1:]))) if i < n - 1 else 0.0)
        best = int(np.argmax(row))
        if row[best] <= 0:
            best = i
        shifts.append(best - i)
        n_comp += best < i
        n_exp += best > i
    return {"compression": float(np.mean(comp)), "expansion": float(np.mean(exp_)),
            "compressed_layers": float(n_comp), "expanded_layers": float(n_exp),
            "mean_shift": float(np.mean(shifts))}


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Pearson's r and its two-sided p-value (t test with n - 2 degrees of freedom, as scipy.stats.pearsonr).
    NaN, NaN when fewer than 3 finite pairs remain or either series is constant."""
    a, b = _arr(x), _arr(y)
    if a.shape != b.shape:
        raise ValueError(f"the two series differ in length: {a.shape} vs {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    n = len(a)
    if n < 3:
        return math.nan, math.nan
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    if den == 0:
        return math.nan, math.nan
    r = max(-1.0, min(1.0, float(a @ b) / den))
    if abs(r) == 1.0:
        return r, 0.0
    from scipy.special import stdtr

    t = r * math.sqrt((n - 2) / (1.0 - r * r))
    p = 2.0 * float(stdtr(n - 2, -abs(t)))
    return r, p


# -- Merlin et al. App. E.1: the hypothesis search over aggregate metrics ------------------------------------------
#: how the layers of a set are aggregated into one number per epoch (std: population, ddof 0)
AGGREGATES = ("mean", "std", "min", "max")
#: learning and forgetting, alone and combined per layer (their sum and their difference)
COMBINATIONS = ("learning", "forgetting", "learning+forgetting", "learning-forgetting")


def hypothesis_layer_sets(n_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The layer sets of Merlin et al. App. E.1, as (kind, 0-based positions): for n = 1 .. L-1 the first n layers
    and the last n layers (n = 1: one layer alone, the first or the last). 2(L-1) sets: 22 for a 12-block ViT,
    so 22 x 4 combinations x 4 aggregates = 352 hypotheses and 22 x 4 = 88 for cka divergence, the paper's counts;
    the sets it reports, layers 2-12 (last 11) and layers 1-8 (first 8), are among them. All L layers (n = L) is
    not a set: the paper's counts leave no room for it."""
    L = int(n_layers)
    if L < 2:
        raise ValueError(f"the hypothesis search needs at least 2 layers, got {L}")
    out: list[tuple[str, tuple[int, ...]]] = []
    for n in range(1, L):
        out.append((f"first {n}", tuple(range(n))))
        out.append((f"last {n}", tuple(range(L - n, L))))
    return out


def combine(learning_: np.ndarray, forgetting_: np.ndarray, how: str) -> np.ndarray:
    """Per (epoch, layer): learning, forgetting, their sum or learning - forgetting (`COMBINATIONS`)."""
    lrn, fgt = _arr(learning_), _arr(forgetting_)
    if how == "learning":
        return lrn
    if how == "forgetting":
        return fgt
    if how == "learning+forgetting":
        return lrn + fgt
    if how == "learning-forgetting":
        return lrn - fgt
    raise ValueError(f"unknown combination {how!r}; choose {', '.join(COMBINATIONS)}")


def aggregate(values: np.ndarray, positions: Sequence[int], how: str) -> np.ndarray:
    """(E, L) per-epoch, per-layer values -> (E,): the ``how`` (`AGGREGATES`) over the layers at ``positions``."""
    v = _arr(values)[:, list(positions)]
    fn = {"mean": np.mean, "std": np.std, "min": np.min, "max": np.max}.get(how)
    if fn is None:
        raise ValueError(f"unknown aggregate {how!r}; choose {', '.join(AGGREGATES)}")
    return fn(v, axis=1)


def bonferroni(p: float, m: int) -> float:
    """Bonferroni-corrected p-value: p x m (the number of hypotheses tested), capped at 1; NaN stays NaN."""
    return min(1.0, float(p) * int(m)) if math.isfinite(float(p)) else math.nan


def _layer_label(positions: Sequence[int], names: Sequence[int] | None) -> str:
    """1-based layer numbers of a set, as the paper writes them ('2-12', '5'); ``names``: the 0-based blocks."""
    blocks = [int(names[i]) + 1 if names is not None else int(i) + 1 for i in positions]
    return f"{blocks[0]}" if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"


def hypothesis_search(learning_: np.ndarray, forgetting_: np.ndarray, cka_divergence_: np.ndarray | None,
                      target: Sequence[float] | np.ndarray, blocks: Sequence[int] | None = None) -> list[dict]:
    """Merlin et al. App. E.1: Pearson r and p of every aggregate hypothesis with ``target`` (one value per
    epoch, e.g. the mean accuracy on corrupted test sets), over (E epochs, L layers) arrays. Two families, each
    Bonferroni-corrected by its own size: learning/forgetting (`hypothesis_layer_sets` x `COMBINATIONS` x
    `AGGREGATES`, 352 for L = 12) and cka divergence (sets x aggregates, 88). ``blocks``: the 0-based block of
    each layer (names the sets: 'layers 2-12'). ``paper``: the hypotheses the paper reports, the std of forgetting
    over layers 2..L (the last L-1) and the std of cka divergence over layers 1-8 (the first min(8, L-1))."""
    fgt = _arr(forgetting_)
    L = fgt.shape[1]
    sets = hypothesis_layer_sets(L)
    first_paper = f"first {min(8, L - 1)}"
    families = [("learning_forgetting", c, combine(learning_, forgetting_, c)) for c in COMBINATIONS]
    if cka_divergence_ is not None:
        families.append(("cka_divergence", "cka_divergence", _arr(cka_divergence_)))
    sizes = {"learning_forgetting": len(sets) * len(COMBINATIONS) * len(AGGREGATES),
             "cka_divergence": len(sets) * len(AGGREGATES)}
    rows = []
    for family, quantity, vals in families:
        for kind, pos in sets:
            for how in AGGREGATES:
                r, p = pearson(aggregate(vals, pos, how), target)
                paper = how == "std" and ((quantity == "forgetting" and kind == f"last {L - 1}")
                                          or (quantity == "cka_divergence" and kind == first_paper))
                rows.append({"family": family, "quantity": quantity, "aggregate": how, "layer_set": kind,
                             "layers": _layer_label(pos, blocks), "r": r, "p": p,
                             "p_bonferroni": bonferroni(p, sizes[family]), "hypotheses": sizes[family],
                             "paper": paper})
    return rows


def pearson_up_to(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> list[tuple[float, float]]:
    """Merlin et al. Fig. 14: (r, p) of the first n values of ``x`` and ``y``, for every n = 1 .. len(x) (NaN
    until 3 finite pairs)."""
    a, b = _arr(x), _arr(y)
    return [pearson(a[:n], b[:n]) for n in range(1, len(a) + 1)]


def _centred_grams(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grams = []
    for f in (x, y):
        f = f.reshape(f.shape[0], -1)
        grams.append(C.gram_matrix(f.float(), f.double().mean(0).float(), torch.float32).double())
    return grams[0], grams[1]


def hsic_terms(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """HSIC_1(K, L), HSIC_1(K, K), HSIC_1(L, L) of one minibatch, K and L the linear Grams of ``x`` (n, F) and
    ``y`` (n, G), as a float64 (3,) tensor. Each is shifted by its own batch mean before the Gram (HSIC_1 is
    unchanged by a constant shift; the float32 product keeps its precision)."""
    return hsic_terms_both(x, y)[0]


def hsic_terms_both(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unbiased terms of `hsic_terms` and the biased ones of the same batch, from the same Grams: (3,)
    float64 each. Biased: <HKH, HLH>_F, <HKH, HKH>_F, <HLH, HLH>_F with H = I - 11^T/n (Kornblith et al.'s
    linear CKA is the first over the square root of the product of the other two; the common factor
    1/(n-1)^2 of HSIC_0 cancels in the ratio, so the terms are not divided by it)."""
    k, l_ = _centred_grams(x, y)
    unbiased = torch.stack([C.hsic1(k, l_), C.hsic1(k, k), C.hsic1(l_, l_)])
    kc, lc = _centre(k), _centre(l_)
    biased = torch.stack([(kc * lc).sum(), (kc * kc).sum(), (lc * lc).sum()])
    return unbiased, biased


def _centre(g: torch.Tensor) -> torch.Tensor:
    """H g H (float64): exact double centring of a Gram whose features were only approximately centred."""
    return g - g.mean(dim=0, keepdim=True) - g.mean(dim=1, keepdim=True) + g.mean()


def stir_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """CKA from summed HSIC_1 terms ``(..., 3)`` (cross, self x, self y): sum cross / sqrt(sum self x *
    sum self y); NaN where a self term is not positive (constant features)."""
    s = sums.double()
    den = s[..., 1] * s[..., 2]
    out = torch.full(den.shape, math.nan, dtype=torch.float64)
    ok = den > 0
    out[ok] = s[..., 0][ok] / torch.sqrt(den[ok])
    return out
