"""Probes benchmark: k-NN for 12 layers x 3 token views on 10k pooled 768-d features (8k train / 2k test,
k in {10, 20, 100, 200}), then the 12 linear probes of one view; wall time and peak RSS printed.
Goal: the 36 k-NN settings in under 30 s on CPU. The features live where the semantics analysis keeps
them, in the float16 on-disk store (`vitscope.analyses.pooled`), written 1000 images at a time; the
process's anonymous memory (RssAnon) vs mapped file pages (RssFile) is printed at the end.

    python benchmarks/probes.py [--images 10000] [--dim 768] [--classes 50]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from vitscope.analyses.pooled import PooledTable
from vitscope.metrics import semantics as S


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--classes", type=int, default=50)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, args.classes, (args.images,), generator=g)
    centres = torch.randn(args.classes, args.dim, generator=g)
    test = torch.arange(args.images) % 5 == 0
    tables = [PooledTable(12) for _view in range(3)]  # separability grows with depth
    for s in range(0, args.images, 1000):
        ys = y[s:s + 1000]
        for t in tables:
            t.append([(layer / 11) * centres[ys] + torch.randn(len(ys), args.dim, generator=g) for layer in range(12)],
                     torch.arange(s, s + len(ys)), ys, test[s:s + len(ys)])
    feats = [t.layer(j) for j in range(12) for t in tables]  # float16 views of the files, layer-major
    t0 = time.perf_counter()
    acc = []
    for x in feats:
        x = x.float()
        acc.append(S.knn_classify(x[~test], y[~test], x[test], y[test], ks=(10, 20, 100, 200))[20][0])
    t_knn = time.perf_counter() - t0
    t0 = time.perf_counter()
    probe = [S.linear_probe(x.float()[~test], y[~test], x.float()[test], y[test])[0] for x in feats[::3]]
    t_probe = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.images} images ({int((~test).sum())} train / {int(test.sum())} test), {args.dim}-d, "
          f"{args.classes} classes, {torch.get_num_threads()} threads")
    print(f"k-NN, 36 settings (12 layers x 3 views, k in 10/20/100/200): {t_knn:6.2f} s (goal < 30 s); "
          f"20-NN top-1 first/last layer {acc[0]:.3f}/{acc[-1]:.3f}")
    print(f"linear probes, 12 layers (L-BFGS, 100 iterations):         {t_probe:6.2f} s; "
          f"top-1 first/last layer {probe[0]:.3f}/{probe[-1]:.3f}")
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    print(f"peak RSS {peak:.0f} MB (features stored: {sum(f.numel() * 2 for f in feats) / 2**20:.0f} MB float16 on "
          f"disk); now RssAnon {status.get('RssAnon', '?').strip()}, RssFile {status.get('RssFile', '?').strip()}")


if __name__ == "__main__":
    main()
