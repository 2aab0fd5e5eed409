"""Splits that cannot go wrong: class-balanced selection, the stratified test split, its warnings; and the
tuned probe (issue 29, parts 2 and 3)."""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from vitscope.analyses import get_analysis
from vitscope.analyses.splits import split_warnings, stratified_test
from vitscope.errors import ConfigError, ResultWarning
from vitscope.metrics import semantics as S
from vitscope.study.run import balanced_ids


def _split_reference(ids, labels, every):
    test = [False] * len(ids)
    for c in set(labels.tolist()):
        rows = sorted((int(ids[i]), i) for i in range(len(ids)) if int(labels[i]) == c)
        for r, (_, i) in enumerate(rows):
            test[i] = len(rows) > 1 and r % every == 0
    return torch.tensor(test, dtype=torch.bool)


@pytest.mark.parametrize("seed", range(4))
def test_stratified_split_equals_a_loop_and_puts_every_class_of_two_in_both_parts(seed):
    g = np.random.default_rng(seed)
    n = int(g.integers(1, 80))
    ids = torch.from_numpy(g.permutation(1000)[:n])
    labels = torch.from_numpy(g.integers(0, 7, n))
    every = int(g.integers(2, 6))
    test = stratified_test(ids, labels, every)
    assert torch.equal(test, _split_reference(ids, labels, every))
    for c in torch.unique(labels):
        k = int((labels == c).sum())
        n_test = int(test[labels == c].sum())
        assert n_test == (0 if k == 1 else -(-k // every))  # ceil(k / every): in proportion
        assert k - n_test >= 1  # every class has a training row
    # a function of the rows, not of their order
    perm = torch.from_numpy(g.permutation(n))
    assert torch.equal(stratified_test(ids[perm], labels[perm], every), test[perm])


def _balanced_reference(labels, n):
    """Quotas by water filling, one image at a time: the next image goes to the class with the fewest taken
    among those with images left (ties: more images left, then the lower class)."""
    classes = sorted(set(labels))
    size = {c: labels.count(c) for c in classes}
    quota = dict.fromkeys(classes, 0)
    for _ in range(min(n, len(labels))):
        c = min((c for c in classes if quota[c] < size[c]), key=lambda c: (quota[c], -(size[c] - quota[c]), c))
        quota[c] += 1
    return quota


@pytest.mark.parametrize("seed", range(4))
def test_balanced_selection_takes_equal_shares_spread_within_each_class(seed):
    g = np.random.default_rng(seed)
    labels = g.integers(0, 6, int(g.integers(10, 200))).tolist()
    labels += [6] * 2  # a small class
    n = int(g.integers(1, len(labels) + 5))
    ids = balanced_ids(labels, n)
    assert ids == sorted(set(ids)) and len(ids) == min(n, len(labels)) and ids == balanced_ids(labels, n)
    got = {c: sum(1 for i in ids if labels[i] == c) for c in set(labels)}
    want = _balanced_reference(labels, n)
    assert got == want
    for c in set(labels):
        members = [i for i, y in enumerate(labels) if y == c]
        mine = [i for i in ids if labels[i] == c]
        if 1 < len(mine) < len(members):  # an even spread: first and last member of the class, no big gap
            assert mine[0] == members[0] and mine[-1] == members[-1]
    open_ = [v for c, v in got.items() if v < labels.count(c)]
    assert not open_ or max(open_) - min(open_) <= 1


def test_shipped_cifar_selection_is_balanced_and_chunks_do_not_depend_on_it():
    from vitscope.data.formats.shipped import Cifar10Test1k
    from vitscope.study.run import _select_ids

    ds = Cifar10Test1k()
    labels = ds.index_labels()
    assert labels == [i // 100 for i in range(1000)]  # the documented layout, read without decoding images
    for n in (100, 128, 200, 300, 500):
        ids = _select_ids(ds, n)
        counts = np.bincount([labels[i] for i in ids], minlength=10)
        assert len(ids) == n and counts.max() - counts.min() <= 1


def _warned(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, ResultWarning)]


def test_split_warnings_name_the_classes_and_refuse_to_score_when_nothing_can_be():
    y = torch.tensor([0, 0, 0, 1, 1, 2])
    test = torch.tensor([True, False, True, True, False, True])  # class 2: no training image; 1: one test image
    ok, said = _warned(lambda: split_warnings("here", y, test, ["cat", "dog", "ship"]))
    assert ok and len(said) == 2
    assert "'ship'" in said[0] and "no training image" in said[0] and "'cat'" not in said[0]
    assert "'dog'" in said[1] and "'ship'" in said[1] and "fewer than 2 test" in said[1] and "'cat'" not in said[1]
    ok, said = _warned(lambda: split_warnings("here", y, torch.zeros(6, dtype=torch.bool)))
    assert not ok and len(said) == 1 and "no class has both" in said[0]
    ok, said = _warned(lambda: split_warnings("here", torch.tensor([0, 0, 0, 1, 1, 1]),
                                              torch.tensor([True, True, False, True, True, False])))
    assert ok and said == []
    with pytest.raises(ConfigError, match="test_every"):
        get_analysis("semantics")(_tiny(), test_every=1)


def _tiny():
    from conftest import tiny

    return tiny("vit")


def test_semantics_split_is_stratified_recorded_and_the_same_for_every_view():
    from vitscope.capture import stream
    from vitscope.data import SyntheticShapes

    vm = _tiny()
    batches = list(SyntheticShapes(n=40, seed=3).batches(8, vm.preprocessing))
    a = get_analysis("semantics")(vm, layers=[1], views=["cls", "gap"], ks=(3,), kmeans=False, probe=["cls"])
    stream(vm, batches, [a], progress=False)
    df, _ = _warned(a.finalize)
    ids = torch.cat([b.index for b in batches])
    y = torch.cat([b.labels for b in batches])
    test = _split_reference(ids, y, 5)
    for v in ("cls", "gap"):
        rows = df[df.token_view == v]
        assert (rows.n_test == int(test.sum())).all() and (rows.n_train == int((~test).sum())).all()
    probe = df[df.metric == "probe_top1"]
    assert len(probe) == 1 and probe.probe_weight_decay.item() in S.PROBE_GRID and probe.probe_iterations.item() > 0
    knn = df[df.metric == "knn3_top1"]  # the protocol's settings in the rows (issue 29, part 5)
    assert len(knn) == 2 and (knn.k == 3).all() and (knn.temperature == 0.07).all()


def _readme_study_yaml():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "cifar10-test-1k" in b)
    return block


@pytest.mark.slow
@pytest.mark.parametrize("n", [100, 200, 300])
def test_the_readme_two_dataset_study_has_every_class_in_both_splits_and_the_supervised_model_beats_chance(
        n, tmp_path):
    """Issue 29: at n_images 100 the README's study gave 20-NN = 0 (a class without training images)."""
    from vitscope.capture import stream
    from vitscope.data.catalog import build_dataset
    from vitscope.models import load_model
    from vitscope.study import load_config
    from vitscope.study.config import study_datasets
    from vitscope.study.run import _select_ids

    (tmp_path / "s.yaml").write_text(_readme_study_yaml())
    cfg = load_config(tmp_path / "s.yaml", [f"datasets.photos.n_images={n}"])
    dc = study_datasets(cfg)["photos"]
    ds = build_dataset(dc)
    ids = _select_ids(ds, dc.n_images)
    vm = load_model("zoo-sup")
    a = get_analysis("semantics")(vm, **dict(cfg.analyses["semantics"]))
    stream(vm, ds.batches(50, vm.preprocessing, indices=ids), [a], progress=False)
    df, said = _warned(a.finalize)
    assert said == []  # no class without training images, none with fewer than 2 test images
    y = torch.tensor([ds.index_labels()[i] for i in ids])
    test = _split_reference(torch.tensor(ids), y, 5)
    assert set(y[test].tolist()) == set(y[~test].tolist()) == set(range(10))
    knn = df[(df.metric == "knn20_top1") & (df.layer == vm.depth - 1) & (df.token_view == "cls")]
    assert (knn.n_test == int(test.sum())).all()
    # well above chance (0.1 for 10 balanced classes): the whole 95 % interval above twice chance
    assert knn.value.item() > 0.35 and knn.value_lo.item() > 0.2, knn
    probe = df[(df.metric == "probe_top1") & (df.layer == vm.depth - 1) & (df.token_view == "cls")]
    assert probe.value_lo.item() > 0.2, probe


def _two_problems(seed=0):
    """A problem that needs strong regularisation (few images, every feature a weak cue, 15 % of the labels
    flipped: a weakly regularised probe fits the flips) and one that needs little (the classes differ only by a
    small offset on top of a large component all features share: the classifier must weigh feature differences
    with large weights)."""
    g = np.random.default_rng(seed)
    n, d = 40, 10
    y = g.integers(0, 2, n)
    x = g.normal(size=(n, d)) + 0.4 * (2 * y - 1)[:, None]
    y = np.where(g.random(n) < 0.15, 1 - y, y)
    strong = (torch.from_numpy(x).float(), torch.from_numpy(y))
    n = 400
    y = g.integers(0, 3, n)
    z = g.normal(size=(n, 1))
    x = np.concatenate([z + 0.15 * np.eye(3)[y] + 0.02 * g.normal(size=(n, 3)), g.normal(size=(n, 2))], 1)
    weak = (torch.from_numpy(x).float(), torch.from_numpy(y))
    return strong, weak


def _sklearn_probe(lam, n, y):
    """scikit-learn's LogisticRegression with vitscope's probe objective, mean cross-entropy + lam |W|^2 with
    one weight vector per class: for two classes scikit-learn fits a single vector w = w1 - w2, whose penalty
    at the optimum (w1 = -w2) is half, so C doubles."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=(2 if len(np.unique(y)) == 2 else 1) / (2 * lam * n), max_iter=5000, tol=1e-10)


def _cv_reference(x, y, lam, folds):
    """Held-out accuracy of one weight decay, fitted from scratch per fold with scikit-learn's own
    LogisticRegression (no warm start), folds: per class, rows in order, round robin."""

    x = (x - x.mean(0)) / np.maximum(x.std(0, ddof=1), 1e-6)
    fold = np.zeros(len(y), dtype=int)
    for c in np.unique(y):
        rows = np.flatnonzero(y == c)
        fold[rows] = np.arange(len(rows)) % folds
    hits = 0
    for f in range(folds):
        tr, va = fold != f, fold == f
        m = _sklearn_probe(lam, tr.sum(), y[tr]).fit(x[tr], y[tr])
        hits += (m.predict(x[va]) == y[va]).sum()
    return hits / len(y)


def test_the_tuned_probe_picks_strong_decay_for_few_noisy_images_and_weak_for_many_clean_ones():
    (xs, ys), (xw, yw) = _two_problems()
    strong = S.fit_probe(xs, ys, xs[:5], ys[:5], tune=True)
    weak = S.fit_probe(xw, yw, xw[:5], yw[:5], tune=True)
    assert strong.weight_decay > weak.weight_decay
    assert strong.weight_decay >= 1e-1 and weak.weight_decay <= 1e-2
    assert strong.converged and weak.converged and 0 < strong.iterations < 1000
    # the choice is the one an independent cross-validation makes (scikit-learn from scratch per fold and decay,
    # tight tolerance; from the strongest decay down, stopped at the first decay below the best so far; ties: the
    # stronger decay)
    for fit, (x, y) in ((strong, (xs, ys)), (weak, (xw, yw))):
        ref = {lam: _cv_reference(x.double().numpy(), y.numpy(), lam, 2) for lam in S.PROBE_GRID}
        best = S.PROBE_GRID[0]
        for lam in S.PROBE_GRID[1:]:
            if ref[lam] < ref[best]:
                break
            best = lam if ref[lam] > ref[best] else best
        assert fit.weight_decay == best
        assert fit.cv_accuracy[fit.weight_decay] == pytest.approx(ref[fit.weight_decay], abs=1.5 / len(y))
    for lam, acc in weak.cv_accuracy.items():  # well conditioned: each decay tried scores as from scratch (2 %)
        assert acc == pytest.approx(_cv_reference(xw.double().numpy(), yw.numpy(), lam, 2), abs=0.02)


def test_the_tuned_probe_refits_on_all_training_rows_at_the_chosen_decay():
    (x, y), _ = _two_problems(1)
    fit = S.fit_probe(x[:30], y[:30], x[30:], y[30:], tune=True)
    xs = x.double().numpy()
    mu, sd = xs[:30].mean(0), np.maximum(xs[:30].std(0, ddof=1), 1e-6)
    m = _sklearn_probe(fit.weight_decay, 30, y[:30].numpy()).fit((xs[:30] - mu) / sd, y[:30].numpy())
    want = m.predict_log_proba((xs[30:] - mu) / sd)
    assert np.abs(fit.scores.numpy() - want).max() < 1e-3


@pytest.mark.parametrize("n, d, ratio", [(60, 12, 0.85), (24, 40, 1.1)])
def test_the_preconditioned_probe_reaches_the_plain_optimum_under_the_plain_criterion(n, d, ratio):
    """The tuned probe's solver (principal axes, per-axis scale) solves the same problem as the plain L-BFGS,
    with more rows than features and with fewer (weights restricted to the rows' span); 'converged' is the
    plain criterion, the gradient in the original coordinates at most the tolerance; along the warm-started
    path of decays the cross-validation walks it takes fewer iterations with more rows than features (166
    against 223 in one environment, 204 in another: the plain solver's count moves with the BLAS build's rounding)
    and about as many with fewer (117 against 119)."""
    g = np.random.default_rng(n)
    y = np.arange(n) % 3
    x = g.normal(size=(n, d)) @ g.normal(size=(d, d)) + np.eye(3, d)[y]  # correlated features
    x = (x - x.mean(0)) / x.std(0, ddof=1)
    onehot = np.eye(3)[y]
    rot, var = S.principal_axes(x)
    assert rot.shape == (d, min(n, d)) and np.allclose(rot.T @ rot, np.eye(min(n, d)))
    p = plain = None
    iters = plain_iters = 0
    for lam in S.PROBE_GRID:
        p, it, converged = S._lbfgs_axes(x @ rot, onehot, lam, 5000, var, rot, 1e-6, p)
        plain, plain_it = S._lbfgs(x, onehot, lam, 5000, 1e-6, plain)
        iters, plain_iters = iters + it, plain_iters + plain_it
        w = S._rotate(p, rot, 3)
        assert converged and np.abs(S._softmax_loss_grad(w, x, onehot, lam)[1]).max() <= 1e-6
        tight, _ = S._lbfgs(x, onehot, lam, 50000, 1e-11)
        best = S._softmax_loss_grad(tight, x, onehot, lam)[0]
        for q in (w, plain):  # both as close to the optimum's objective
            assert S._softmax_loss_grad(q, x, onehot, lam)[0] - best < 1e-7
    assert iters < ratio * plain_iters, (iters, plain_iters)


def test_a_probe_that_hits_its_cap_warns():
    (x, y), _ = _two_problems(2)
    fit, said = _warned(lambda: S.fit_probe(x, y, x[:4], y[:4], tune=True, grid=(1e-4,), max_iter=3, where="here"))
    assert not fit.converged and fit.iterations == 3
    assert len(said) == 1 and said[0].startswith("here:") and "cap of 3 iterations" in said[0]
    _, said = _warned(lambda: S.fit_probe(x, y, x[:4], y[:4], max_iter=3))  # the fixed budget (zoo cards): silent
    assert said == []
