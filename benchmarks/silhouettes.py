"""The silhouette cue-conflict stimuli (`vitscope.data.silhouettes`): are they balanced, and can the zoo read them?

For two reference observers (raw pixels; `random_feature_map`, a fixed random convolution) and every model, per
block (the pooled token the shape_bias analysis reads: CLS, else the mean patch token):

- ``shape``: held-out accuracy of a linear probe fitted on the shape-only set (labels: the shapes),
- ``texture``: the same on the texture-only set (labels: the textures),
- ``clean``: the probe fitted on both sets together (what shape_bias fits), on its held-out images of both,
- ``bias``: that probe's shape bias on the cue-conflict set, with its 95 % Wilson interval and the counts
  shape / texture / other,

with the default study's probe settings (`silhouettes.probe_accuracy`: weight decay 1e-4, 100 L-BFGS iterations,
every 5th image of each class held out). Chance is 1/8. Balanced stimuli: the reference feature map reads shape
and texture at comparable rates; a model's shape bias is then its own.

    python benchmarks/silhouettes.py [--n 512] [--n-conflict 256] [--models zoo-sup zoo-dino ...] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

import vitscope as vs
from vitscope.capture.engine import extract
from vitscope.data import silhouettes as SL
from vitscope.metrics import robustness as R
from vitscope.metrics.semantics import binomial_interval, fit_probe

DEFAULT_MODELS = ["zoo-sup", "zoo-dino", "zoo-mocov3", "zoo-mae", "zoo-simmim", "zoo-hybrid", "zoo-random",
                  "zoo-random-ft-cls"]


def bias(train: np.ndarray, y: np.ndarray, conflict: np.ndarray, shape: np.ndarray, texture: np.ndarray
         ) -> dict[str, float]:
    """The shape_bias probe (fitted on every clean image) on the cue-conflict features: counts and shape bias."""
    fit = fit_probe(torch.as_tensor(train), torch.as_tensor(y).long(), torch.as_tensor(conflict),
                    torch.zeros(len(conflict), dtype=torch.long), weight_decay=1e-4, max_iter=100, num_classes=SL.K,
                    warn=False)
    return R.shape_bias_counts(fit.scores.argmax(1), torch.as_tensor(shape), torch.as_tensor(texture))


def rows(name: str, layers: list[np.ndarray], conflict: list[np.ndarray], y: np.ndarray, kind: np.ndarray,
         shape: np.ndarray, texture: np.ndarray) -> None:
    for j, (f, fc) in enumerate(zip(layers, conflict, strict=True)):
        s, _ = SL.probe_accuracy(f[kind == 0], y[kind == 0])
        t, _ = SL.probe_accuracy(f[kind == 1], y[kind == 1])
        c, _ = SL.probe_accuracy(f, y)
        b = bias(f, y, fc, shape, texture)
        lo, hi, _ = binomial_interval(b["shape_bias"], int(b["n_shape"] + b["n_texture"]))
        print(f"{name:<18} {j:>5}  {s:5.2f}  {t:7.2f}  {c:5.2f}  {b['shape_bias']:4.2f} [{lo:.2f}, {hi:.2f}]  "
              f"{int(b['n_shape'])} / {int(b['n_texture'])} / {int(b['n_other'])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=512, help="clean images (half shape-only, half texture-only)")
    ap.add_argument("--n-conflict", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="the clean sets' seed (the cue-conflict set: seed + 1)")
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="vitscope")
    clean = SL.Silhouettes(n=args.n, seed=args.seed, cue="both")
    cue = SL.Silhouettes(n=args.n_conflict, seed=args.seed + 1, cue="conflict")
    st = [clean.stimulus(i) for i in range(args.n)]
    y, kind = np.array([s.label for s in st]), np.array([s.kind for s in st])
    sc = [cue.stimulus(i) for i in range(args.n_conflict)]
    shape, texture = np.array([s.shape for s in sc]), np.array([s.texture for s in sc])
    x = np.stack([SL.render(s, 32)[0] for s in st])
    xc = np.stack([SL.render(s, 32)[0] for s in sc])
    print(f"{args.n} clean images ({(kind == 0).sum()} shape-only, {(kind == 1).sum()} texture-only), "
          f"{args.n_conflict} cue-conflict; chance {1 / SL.K:.3f}")
    print(f"{'observer':<18} {'block':>5}  shape  texture  clean  shape bias [95 %]  shape / texture / other")
    rows("pixels", [x.reshape(len(x), -1)], [xc.reshape(len(xc), -1)], y, kind, shape, texture)
    rows("random-feature-map", [SL.random_feature_map(x)], [SL.random_feature_map(xc)], y, kind, shape, texture)
    for m in args.models:
        t0 = time.perf_counter()
        vm = vs.load_model(m)
        taps = [f"block{i}.out" for i in range(vm.depth)]
        view = "cls" if vm.has_cls_token else "gap_spatial"
        f = extract(vm, [b.images for b in clean.batches(64, vm.preprocessing)], taps, view=view, batch_size=64)
        fc = extract(vm, [b.images for b in cue.batches(64, vm.preprocessing)], taps, view=view, batch_size=64)
        rows(m, [f[t].numpy() for t in taps], [fc[t].numpy() for t in taps], y, kind, shape, texture)
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
