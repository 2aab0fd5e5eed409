"""The held-out split of every analysis that fits on one part of its images and scores on the rest (semantics'
k-NN and probes, the robustness probes).

A dataset's own split (``batch.is_test``) wins. Otherwise the split is stratified and decided in ``finalize``,
when every row is known: within each class, rows in the order of their image ids, every ``test_every``-th
row (the 1st, the ``test_every + 1``-th, ...) is a test row, and a class of a single row stays in training.
So every class with at least two rows is in both parts, in proportion, and the split is a function of the
rows' (id, label) pairs alone: the same in a resumed, a sharded and an uninterrupted run, whatever the order
in which batches arrived. `split_warnings` names the classes a split leaves without a training row or with
fewer than two test rows (`ResultWarning`), and says when no class can be scored at all.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Annotated

import torch

from vitscope.bounds import Range
from vitscope.errors import ConfigError, ResultWarning
from vitscope.metrics.semantics import stratified_test  # also imported from here (its home: metrics, for data too)

#: every test_every-th image of each class is a test image: 1 would leave no training image
TestEvery = Annotated[int, Range(2, why="every test_every-th image of each class is held out for testing")]
#: the probe's cross-validation folds
ProbeFolds = Annotated[int, Range(2, why="the probe's weight decay is chosen by cross-validation")]

Tensor = torch.Tensor


def check_test_every(test_every: int, who: str) -> int:
    """``test_every`` as an int; one sentence when it leaves no training rows (or is not a count)."""
    try:
        n = int(test_every)
    except (TypeError, ValueError):
        raise ConfigError(f"{who}: test_every must be an integer of at least 2; got {test_every!r}") from None
    if n < 2:
        raise ConfigError(f"{who}: test_every must be at least 2 (every test_every-th image of each class is held "
                          f"out for testing); got {test_every}")
    return n


def test_rows(ids: Tensor, labels: Tensor, own: Tensor | None, test_every: int) -> Tensor:
    """The test rows: the dataset's own split ``own`` where it has one, else `stratified_test`."""
    return own.bool() if own is not None else stratified_test(ids, labels, test_every)


def _names(classes: Sequence[int], names: Sequence[str] | None, most: int = 6) -> str:
    def one(c: int) -> str:
        return repr(names[c]) if names is not None and 0 <= c < len(names) else f"class {c}"
    shown = ", ".join(one(int(c)) for c in classes[:most])
    return shown + (f" and {len(classes) - most} more" if len(classes) > most else "")


def split_warnings(where: str, labels: Tensor, test: Tensor, names: Sequence[str] | None = None,
                   warn: bool = True) -> bool:
    """Warn (`ResultWarning`, prefixed by ``where``) about the classes of ``labels`` with no training row and
    those with fewer than two test rows; False (after one warning) when no class has both a training and a
    test row, so no classification score can mean anything."""
    y = labels.long()
    classes = torch.unique(y)
    n_train = torch.stack([((y == c) & ~test).sum() for c in classes]) if len(classes) else torch.zeros(0)
    n_test = torch.stack([((y == c) & test).sum() for c in classes]) if len(classes) else torch.zeros(0)
    if not bool(((n_train > 0) & (n_test > 0)).any()):
        if warn:
            warnings.warn(f"{where}: no class has both a training and a test image ({int((~test).sum())} training, "
                          f"{int(test.sum())} test), so nothing is classified; use more images or a dataset with "
                          "at least two per class", ResultWarning, stacklevel=3)
        return False
    if not warn:
        return True
    no_train = classes[n_train == 0].tolist()
    if no_train:
        warnings.warn(f"{where}: {_names(no_train, names)} ha{'s' if len(no_train) == 1 else 've'} no training "
                      "image, so no test image of "
                      f"{'it' if len(no_train) == 1 else 'them'} can be classified right; use more images",
                      ResultWarning, stacklevel=3)
    few = classes[n_test < 2].tolist()
    if few:
        warnings.warn(f"{where}: {_names(few, names)} ha{'s' if len(few) == 1 else 've'} fewer than 2 test images, "
                      f"so {'its' if len(few) == 1 else 'their'} share of the accuracy rests on one image or none; use "
                      "more images (or a smaller test_every)", ResultWarning, stacklevel=3)
    return True
