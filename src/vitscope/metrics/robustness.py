"""Robustness (pure functions): class decisions from a head or a probe, shape vs texture bias, accuracy under
perturbation and its summaries.

Shape bias (Geirhos et al., "ImageNet-trained CNNs are biased towards texture; increasing shape bias improves
accuracy and robustness", ICLR 2019): on cue-conflict images (shape of class A, texture of class B != A),
the fraction of shape decisions among the decisions that are either the shape or the texture class.
Frequency-band noise (Park et al., "What do self-supervised ViTs learn?", ICLR 2023) and common corruptions
(Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common Corruptions and Perturbations",
ICLR 2019): accuracy per perturbation, its drop from clean, the mean corruption accuracy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from vitscope.errors import check_choice
from vitscope.metrics.intervals import Z95
from vitscope.metrics.semantics import ProbeFit, binomial_interval, fit_probe

Tensor = torch.Tensor

# ---------------------------------------------------------------- the 16-class ImageNet mapping
#: The 16 entry-level categories of Geirhos et al. (ICLR 2019), sorted (the order of the stimuli's folders),
#: and the ImageNet-1k class indices of each, as published in bethgelab/model-vs-human,
#: ``modelvshuman/helper/human_categories.py`` (``HumanCategories.<category>_indices``), the code of
#: Geirhos et al., "Partial success in closing the gap between human and machine vision" (NeurIPS 2021).
IMAGENET_16_INDICES: dict[str, tuple[int, ...]] = {
    "airplane": (404,),
    "bear": (294, 295, 296, 297),
    "bicycle": (444, 671),
    "bird": (8, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 22, 23, 24, 80, 81, 82, 83, 87, 88, 89, 90, 91, 92, 93,
             94, 95, 96, 98, 99, 100, 127, 128, 129, 130, 131, 132, 133, 135, 136, 137, 138, 139, 140, 141, 142,
             143, 144, 145),
    "boat": (472, 554, 625, 814, 914),
    "bottle": (440, 720, 737, 898, 899, 901, 907),
    "car": (436, 511, 817),
    "cat": (281, 282, 283, 284, 285, 286),
    "chair": (423, 559, 765, 857),
    "clock": (409, 530, 892),
    "dog": (152, 153, 154, 155, 156, 157, 158, 159, 160, 161, 162, 163, 164, 165, 166, 167, 168, 169, 170, 171,
            172, 173, 174, 175, 176, 177, 178, 179, 180, 181, 182, 183, 184, 185, 186, 187, 188, 189, 190, 191,
            193, 194, 195, 196, 197, 198, 199, 200, 201, 202, 203, 205, 206, 207, 208, 209, 210, 211, 212, 213,
            214, 215, 216, 217, 218, 219, 220, 221, 222, 223, 224, 225, 226, 228, 229, 230, 231, 232, 233, 234,
            235, 236, 237, 238, 239, 240, 241, 243, 244, 245, 246, 247, 248, 249, 250, 252, 253, 254, 255, 256,
            257, 259, 261, 262, 263, 265, 266, 267, 268),
    "elephant": (385, 386),
    "keyboard": (508, 878),
    "knife": (499,),
    "oven": (766,),
    "truck": (555, 569, 656, 675, 717, 734, 864, 867),
}
CATEGORIES_16: tuple[str, ...] = tuple(IMAGENET_16_INDICES)

#: torchvision's / the CIFAR-10 files' class order: what a CIFAR-10 head's outputs mean.
CIFAR10_CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                                    "truck")


def imagenet_to_16(logits: Tensor, categories: Sequence[str] = CATEGORIES_16) -> Tensor:
    """(N, 1000) ImageNet logits -> (N, len(categories)) scores: the mean softmax probability of each
    category's ImageNet classes (model-vs-human's ``ImageNetProbabilitiesTo16ClassesMapping``, mean
    aggregation)."""
    if logits.shape[-1] != 1000:
        raise ValueError(f"expected ImageNet-1k logits (N, 1000); got {tuple(logits.shape)}")
    p = logits.double().softmax(-1)
    return torch.stack([p.index_select(1, _category_index(c, p.device)).mean(1) for c in categories], dim=1)


@functools.cache
def _category_index(category: str, device: torch.device) -> Tensor:
    """The ImageNet class indices of ``category`` as a long tensor on ``device``, made once per device: a Python
    list as an index is copied to the logits' device at every call, which waits for the device's queue."""
    return torch.tensor(IMAGENET_16_INDICES[category], dtype=torch.long, device=device)


# ---------------------------------------------------------------- decisions
def probe_decisions(train: Tensor, train_labels: Tensor, tests: Sequence[Tensor], num_classes: int,
                    **kw: object) -> list[Tensor]:
    """Fit one linear probe (`vitscope.metrics.semantics.linear_probe`: multinomial logistic regression on
    standardised features) on ``train`` and return its class decisions on each of ``tests``."""
    return probe_fit_decisions(train, train_labels, tests, num_classes, **kw)[0]


def probe_fit_decisions(train: Tensor, train_labels: Tensor, tests: Sequence[Tensor], num_classes: int,
                        **kw: object) -> tuple[list[Tensor], ProbeFit | None]:
    """`probe_decisions` and the fit (`vitscope.metrics.semantics.fit_probe`: its weight decay, iterations);
    None when there is nothing to decide."""
    sizes = [len(t) for t in tests]
    if not sum(sizes):
        return [torch.empty(0, dtype=torch.long) for _ in tests], None
    allt = torch.cat([t.float() for t in tests])
    fit = fit_probe(train.float(), train_labels.long(), allt, torch.zeros(len(allt), dtype=torch.long),
                    num_classes=num_classes, **kw)
    return list(fit.scores.argmax(1).split(sizes)), fit


# ---------------------------------------------------------------- shape bias
#: the denominators of shape_match / texture_match: model-vs-human's (every cue-conflict image) first, the default
MATCH_DENOMINATORS = ("all", "kept")


def check_match_denominator(denominator: object, who: str = "shape_bias") -> str:
    """One sentence for a denominator that does not exist; returns it."""
    return check_choice(denominator, MATCH_DENOMINATORS, who, "match_denominator", "all (every cue-conflict image, "
                        "as model-vs-human) or kept (the images whose shape and texture differ)")


def shape_bias_counts(decisions: Tensor, shape_labels: Tensor, texture_labels: Tensor,
                      match_denominator: str = "all") -> dict[str, float]:
    """Counts of shape / texture / other decisions on cue-conflict images and the shape bias
    ``shape / (shape + texture)`` (NaN when no decision is either). Images whose shape and texture class
    are the same are left out of the counts (``n_excluded``), as Geirhos et al. do. ``shape_match`` /
    ``texture_match``: the shape / texture decisions as a fraction of every image (``match_denominator='all'``,
    as model-vs-human's ``ShapeBias.analysis``: ``len(df2[...]) / len(df)``, df2 the images left in) or of the
    images left in (``'kept'``); the shape bias is the same either way."""
    check_match_denominator(match_denominator)
    return shape_bias_of_tally(shape_bias_tally(decisions, shape_labels, texture_labels), match_denominator)


def shape_bias_tally(decisions: Tensor, shape_labels: Tensor, texture_labels: Tensor) -> Tensor:
    """``(4,)`` int64 on the decisions' device: images, images whose shape and texture classes differ (kept),
    and among those the shape and the texture decisions. Tallies of batches add up (`shape_bias_of_tally`), so
    the decisions need not leave the device."""
    d, s, t = decisions.long(), shape_labels.long(), texture_labels.long()
    keep = s != t
    return torch.stack([torch.full((), len(d), dtype=torch.long, device=d.device), keep.sum(),
                        ((d == s) & keep).sum(), ((d == t) & keep).sum()])


def shape_bias_category_tally(decisions: Tensor, shape_labels: Tensor, texture_labels: Tensor,
                              num_classes: int) -> Tensor:
    """``(num_classes, 4)`` int64 on the decisions' device: `shape_bias_tally` of the images of each shape class
    (row c: the images whose shape is class c), for Park et al.'s and Geirhos et al.'s per-category shape bias.
    An image whose shape label is outside ``0 .. num_classes - 1`` is counted in no row (no device-side index
    error on a GPU). Tallies of batches add up; each row is read by `shape_bias_of_tally`."""
    d, s, t = decisions.long(), shape_labels.long(), texture_labels.long()
    keep = s != t
    per = torch.stack([torch.ones_like(s), keep.long(), ((d == s) & keep).long(), ((d == t) & keep).long()], 1)
    inside = ((s >= 0) & (s < num_classes)).long().unsqueeze(1)
    out = torch.zeros(num_classes, 4, dtype=torch.long, device=d.device)
    return out.index_add_(0, s.clamp(0, max(num_classes - 1, 0)), per * inside)


def shape_bias_of_tally(tally: Tensor, match_denominator: str = "all") -> dict[str, float]:
    """`shape_bias_counts` from a (summed) `shape_bias_tally`."""
    n_all, n, n_shape, n_texture = (int(v) for v in tally.tolist())
    cue = n_shape + n_texture
    den = n_all if match_denominator == "all" else n
    return {"shape_bias": n_shape / cue if cue else float("nan"), "n_shape": n_shape, "n_texture": n_texture,
            "n_other": n - cue, "n_images": n, "n_excluded": n_all - n,
            "shape_match": n_shape / den if den else float("nan"),
            "texture_match": n_texture / den if den else float("nan")}


# ---------------------------------------------------------------- accuracy under perturbation
def accuracy(decisions: Tensor, labels: Tensor) -> float:
    return float((decisions.long() == labels.long()).double().mean()) if len(labels) else float("nan")


def accuracy_tally(decisions: Tensor, labels: Tensor, num_classes: int, keep: Tensor | None = None) -> Tensor:
    """``(2 + num_classes,)`` int64 on the decisions' device: images, correct decisions, images per class (labels
    in ``0 .. num_classes - 1``; an image labelled outside them counts, never as correct nor in a class), of the
    images ``keep`` selects (a bool mask; None: all). Tallies of batches add up (`accuracy_of_tally`), so the
    decisions need not leave the device (and no label can index outside the tally: on a GPU that would be a
    device-side assert, not an error)."""
    d, y = decisions.long(), labels.long()
    w = torch.ones_like(y) if keep is None else keep.long()
    inside = (y >= 0) & (y < num_classes)
    out = torch.zeros(2 + num_classes, dtype=torch.long, device=d.device)
    out[0] = w.sum()
    out[1] = ((d == y) & inside).long().mul(w).sum()
    out[2:].index_add_(0, y.clamp(0, max(num_classes - 1, 0)), w * inside.long())
    return out


def accuracy_of_tally(tally: Tensor) -> tuple[float, int, float]:
    """``(accuracy, images, chance)`` of a (summed) `accuracy_tally`: `accuracy` of its decisions and the
    majority-class rate of its labels (`vitscope.metrics.semantics.majority_rate` of the labels against
    themselves); NaN without images."""
    t = tally.cpu()
    n = int(t[0])
    if not n:
        return float("nan"), 0, float("nan")
    return int(t[1]) / n, n, int(t[2:].max()) / n


def drop(clean: float, perturbed: float) -> float:
    """Accuracy lost to the perturbation (clean - perturbed), in accuracy points."""
    return clean - perturbed


def relative_drop(clean: float, perturbed: float) -> float:
    """(clean - perturbed) / clean: the share of the clean accuracy lost (NaN for a clean accuracy of 0)."""
    return (clean - perturbed) / clean if clean > 0 else float("nan")


def accuracy_interval(accuracy: float, n: int) -> dict[str, float]:
    """``value_lo``, ``value_hi``, ``stderr`` of an accuracy on ``n`` images: the 95 % Wilson interval
    (`vitscope.metrics.semantics.binomial_interval`; NaN without images). Also valid for a mean of accuracies of
    several views of the same ``n`` images (a mean corruption accuracy): the variance of a mean is at most the mean
    of the views' standard errors squared, and that, with ``p(1 - p)`` concave, at most ``p̄(1 - p̄) / n``, the
    variance the interval assumes, so the interval is conservative, never too narrow."""
    lo, hi, se = binomial_interval(accuracy, int(n))
    return {"value_lo": lo, "value_hi": hi, "stderr": se}


def drop_interval(clean: float, perturbed: float, n: int, z: float = Z95) -> dict[str, float]:
    """``value_lo``, ``value_hi``, ``stderr`` of an accuracy drop ``clean - perturbed``, both accuracies on the
    same ``n`` images, whichever way the two decisions of an image go together: Newcombe's hybrid score interval
    for a paired difference (Newcombe, Stat. Med. 1998, 17:2635: the two Wilson intervals joined through the
    correlation φ of the pairs' decisions), at the least correlation the two accuracies allow (Fréchet:
    ``P(both right) >= max(0, clean + perturbed - 1)``), so it is never narrower than the interval the pairs' own
    correlation would give (which the tallies do not keep); at correlation -1 it is the difference of the two
    Wilson intervals' ends. ``stderr``: the paired difference's standard error at that correlation. NaN without
    images."""
    p1, p2 = float(clean), float(perturbed)
    if n <= 0 or not (np.isfinite(p1) and np.isfinite(p2)):
        return {"value_lo": float("nan"), "value_hi": float("nan"), "stderr": float("nan")}
    l1, u1, _ = binomial_interval(p1, int(n), z=z)
    l2, u2, _ = binomial_interval(p2, int(n), z=z)
    cov = max(0.0, p1 + p2 - 1.0) - p1 * p2  # the least covariance of two 0/1 variables with these means
    v1, v2 = p1 * (1 - p1), p2 * (1 - p2)
    phi = cov / np.sqrt(v1 * v2) if v1 > 0 and v2 > 0 else 0.0
    d = p1 - p2
    low = d - np.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    high = d + np.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    se = float(np.sqrt(max(v1 + v2 - 2 * cov, 0.0) / n))
    return {"value_lo": float(max(low, -1.0)), "value_hi": float(min(high, 1.0)), "stderr": se}


def corruption_summary(acc: dict[tuple[str, int], float], clean: float) -> dict[str, float]:
    """From accuracies per (corruption, severity): the mean corruption accuracy (mean over every corruption
    and severity measured, each corruption weighted by its severities, as ImageNet-C's mean over 1-5) and
    its relative drop from ``clean``."""
    names = sorted({c for c, _ in acc})
    per = [float(np.mean([v for (c, _), v in acc.items() if c == n])) for n in names]
    mca = float(np.mean(per)) if per else float("nan")
    return {"mca": mca, "mca_relative_drop": relative_drop(clean, mca)}
