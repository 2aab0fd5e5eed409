"""Probe tuning benchmark: what the tuned linear probe costs against the fixed one it replaced, on the default
study's own data (the zoo models' CLS and GAP features at every block, 500 shipped CIFAR-10 photographs, the
stratified 400 / 100 split). CPU seconds of one thread (as the semantics stage runs them), in one run:

* former:  scikit-learn's LogisticRegression, weight decay 1e-4, a fixed budget of 100 L-BFGS iterations;
* tuned, scikit-learn: the same cross-validation as vitscope's (2 folds, decays 1 .. 1e-4 with early stop) and
  refit, with scikit-learn's solver: what the tuned probe cost before vitscope minimised it itself;
* tuned, vitscope: `vitscope.metrics.semantics.fit_probe(tune=True)` (SciPy's L-BFGS-B in the training rows'
  principal axes, preconditioned by the Hessian's diagonal at each fit's start).

``--stage``: also the whole semantics stage, the `finalize` of the default study's semantics analysis for each
model (k-NN, probes and k-means on CLS and GAP, chance rows included), with the tuned probe and with the former
probe put in its place.

Goal (the semantics stage may grow by at most 20 %): tuned, vitscope / former <= 1.2. Measured on a shared
2-core machine with the default study's 8 models (--models zoo-sup zoo-dino zoo-mocov3 zoo-mae zoo-simmim
zoo-hybrid zoo-random zoo-random-ft-cls --stage; ratios within one run, range over runs): the probes 0.60-0.69x
the former (2.4 s), the stage 0.68-0.73x (3.3-3.5 s). The tuned probe before preconditioning (plain L-BFGS):
probes 1.14-1.25x, stage 1.09-1.11x.

    python benchmarks/probe_tuning.py [--models zoo-sup zoo-dino zoo-mae zoo-random] [--stage]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

import vitscope as vs
from vitscope.data.formats.shipped import Cifar10Test1k
from vitscope.metrics import semantics as S
from vitscope.study.run import balanced_ids
from vitscope.threads import few_threads


def features(names: list[str], n_images: int) -> tuple[list[np.ndarray], np.ndarray]:
    ds = Cifar10Test1k()
    ids = balanced_ids(ds.index_labels(), n_images)
    sets, labels = [], None
    for name in names:
        vm = vs.load_model(name)
        batches = list(ds.batches(100, vm.preprocessing, indices=ids))
        taps = [f"block{i}.out" for i in range(vm.depth)]
        out = vs.extract(vm, [b.images for b in batches], taps)
        labels = torch.cat([b.labels for b in batches]).numpy()
        for t in taps:
            sets += [out[t][:, 0].double().numpy(), out[t][:, 1:].mean(1).double().numpy()]
    return sets, labels


def sklearn_tuned(x: np.ndarray, y: np.ndarray) -> float:
    """The tuned probe's protocol with scikit-learn's solver; -> the chosen decay."""
    fold = S.class_folds(y, 2)
    models = [LogisticRegression(C=1.0, max_iter=1000, tol=1e-3, warm_start=True) for _ in range(2)]
    acc, best = {}, None
    for lam in sorted(S.PROBE_GRID, reverse=True):
        hits = 0
        for f, m in enumerate(models):
            tr = fold != f
            m.set_params(C=1 / (2 * lam * tr.sum()))
            hits += int((m.fit(x[tr], y[tr]).predict(x[~tr]) == y[~tr]).sum())
        acc[lam] = hits
        if best is None or acc[lam] > acc[best]:
            best = lam
        elif acc[lam] < acc[best]:
            break
    LogisticRegression(C=1 / (2 * best * len(y)), max_iter=1000).fit(x, y)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["zoo-sup", "zoo-dino", "zoo-mae", "zoo-random"])
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--stage", action="store_true", help="also time the semantics stage's finalize")
    args = ap.parse_args()
    sets, y = features(args.models, args.images)
    test = S.class_folds(y, 5) == 0
    std = []
    for x in sets:
        mu, sd = x[~test].mean(0), np.maximum(x[~test].std(0, ddof=1), 1e-6)
        std.append(((x[~test] - mu) / sd, (x[test] - mu) / sd))
    times = {}
    with few_threads(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        t = time.process_time()
        former = [LogisticRegression(C=1 / (2 * 1e-4 * len(a)), max_iter=100).fit(a, y[~test]).score(b, y[test])
                  for a, b in std]
        times["former (scikit-learn, 1e-4, 100 it.)"] = time.process_time() - t
        t = time.process_time()
        for a, _ in std:
            sklearn_tuned(a, y[~test])
        times["tuned, scikit-learn solver"] = time.process_time() - t
        t = time.process_time()
        tuned = [S.fit_probe(torch.from_numpy(x[~test]), torch.from_numpy(y[~test]), torch.from_numpy(x[test]),
                             torch.from_numpy(y[test]), tune=True, max_iter=1000) for x in sets]
        times["tuned, vitscope"] = time.process_time() - t
    print(f"{len(sets)} feature sets ({', '.join(args.models)}: every block, CLS and GAP), "
          f"{int((~test).sum())} train / {int(test.sum())} test images, one thread, CPU seconds")
    base = times["former (scikit-learn, 1e-4, 100 it.)"]
    for k, v in times.items():
        print(f"  {k:40s} {v:6.2f} s  {v / base:4.2f}x")
    print(f"goal: tuned, vitscope / former <= 1.2: {times['tuned, vitscope'] / base:.2f}x")
    print(f"mean test top-1: former {np.mean(former):.3f}, tuned {np.mean([f.accuracy for f in tuned]):.3f}; "
          f"decays chosen: {Counter(f.weight_decay for f in tuned)}")
    if args.stage:
        stage(args.models, args.images)


def former_fit(train: torch.Tensor, train_labels: torch.Tensor, test: torch.Tensor, test_labels: torch.Tensor, *,
               num_classes: int | None = None, **_: object) -> S.ProbeFit:
    """The probe before tuning (scikit-learn, decay 1e-4, 100 iterations), as a `fit_probe` in its place."""
    c = int(num_classes if num_classes is not None else int(max(train_labels.max(), test_labels.max())) + 1)
    x, xt = train.double().numpy(), test.double().numpy()
    mu, sd = x.mean(0), np.maximum(x.std(0, ddof=1), 1e-6)
    x, xt = (x - mu) / sd, (xt - mu) / sd
    m = LogisticRegression(C=1 / (2 * 1e-4 * len(x)), max_iter=100).fit(x, train_labels.numpy())
    scores = torch.full((len(xt), c), -1e9, dtype=torch.float64)
    scores[:, torch.from_numpy(m.classes_)] = torch.from_numpy(m.predict_log_proba(xt))
    return S.ProbeFit(float((scores.argmax(1) == test_labels).double().mean()), scores, 1e-4, 100, False)


def stage(names: list[str], n_images: int) -> None:
    """The default study's semantics analysis of each model fed once, its finalize timed with either probe."""
    from vitscope.analyses import get_analysis
    from vitscope.capture import stream

    ds = Cifar10Test1k()
    ids = balanced_ids(ds.index_labels(), n_images)
    analyses = []
    for name in names:
        vm = vs.load_model(name)
        a = get_analysis("semantics")(vm, ks=[10, 20], views=["cls", "gap"], probe=["cls", "gap"],
                                      kmeans=["cls", "gap"])
        stream(vm, list(ds.batches(100, vm.preprocessing, indices=ids)), [a], progress=False)
        analyses.append(a)
    tuned_fit = S.fit_probe

    def finalize_all(fit: object) -> float:
        S.fit_probe = fit
        try:
            t = time.process_time()
            for a in analyses:
                a.finalize()
            return time.process_time() - t
        finally:
            S.fit_probe = tuned_fit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [(finalize_all(former_fit), finalize_all(tuned_fit)) for _ in range(2)]
    print(f"semantics stage (finalize of {len(names)} models, CPU seconds, twice, interleaved):")
    for i, (f, t) in enumerate(runs):
        print(f"  run {i + 1}: former probe {f:6.2f} s, tuned probe {t:6.2f} s: {t / f:4.2f}x")


if __name__ == "__main__":
    main()
