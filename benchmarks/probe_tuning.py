"""Probe tuning benchmark: what the tuned linear probe costs against the fixed one it replaced, on the default
study's own data (the zoo models' CLS and GAP features at every block, 500 shipped CIFAR-10 photographs, the
stratified 400 / 100 split). CPU seconds of one thread (as the semantics stage runs them), in one run:

* former:  scikit-learn's LogisticRegression, weight decay 1e-4, a fixed budget of 100 L-BFGS iterations;
* tuned, scikit-learn: the same cross-validation as vitscope's (2 folds, decays 1 .. 1e-4 with early stop) and
  refit, with scikit-learn's solver: what the tuned probe cost before vitscope minimised it itself;
* tuned, vitscope: `vitscope.metrics.semantics.fit_probe(tune=True)`.

Goal (the semantics stage may grow by at most 20 %): tuned, vitscope / former <= 1.2.

    python benchmarks/probe_tuning.py [--models zoo-sup zoo-dino zoo-mae zoo-random]
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


if __name__ == "__main__":
    main()
