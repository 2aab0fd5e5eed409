"""Speed of the invariance lens (`vitscope.invariance`).

1. Inversion throughput (image-iterations per second) against the model's bare forward + backward at the same
   batch size (input gradient only, parameters frozen, as the inversion; also with parameter gradients, as a
   training step), at the deepest tap (the whole network runs), for a zoo model and for ViT-S/16.
2. STIR for a zoo pretrained / fine-tuned pair with the study's `stir` analysis (both directions, all 8 blocks,
   50 iterations, one repeat) on N images, and how it scales with layers and images.

    PYTHONPATH=src python benchmarks/invariance.py [--threads 1] [--images 32] [--ft PATH] [--skip-vits]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import vitscope as vs
from vitscope.invariance import invert


def bare(vm: vs.ViTModel, x: torch.Tensor, iters: int, param_grads: bool) -> float:
    """Seconds per forward + backward (to the input) of the full encoder."""
    for p in vm.model.parameters():
        p.requires_grad_(param_grads)
    ts = []
    for _ in range(iters + 1):
        xx = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        out = vm.model.forward_features(xx)
        g = torch.autograd.grad(out.square().sum(), [xx] + (list(vm.model.parameters()) if param_grads else []),
                                allow_unused=True)
        ts.append(time.perf_counter() - t0)
        del g
    for p in vm.model.parameters():
        p.requires_grad_(True)
    return sorted(ts[1:])[len(ts[1:]) // 2]


def throughput(name: str, vm: vs.ViTModel, batch: int, iters: int) -> None:
    x = torch.randn(batch, 3, *vm.img_size).clamp(-2, 2)
    tap = f"block{vm.depth - 1}.out"
    t_in = bare(vm, x, 3, param_grads=False)
    t_tr = bare(vm, x, 3, param_grads=True)
    invert(vm, x[:2], tap, iterations=1)  # warm-up
    t0 = time.perf_counter()
    invert(vm, x, tap, iterations=1)
    t1 = time.perf_counter()
    invert(vm, x, tap, iterations=1 + iters)
    t_inv = time.perf_counter() - t1
    ips = batch * (1 + iters) / t_inv  # all of it: the target's forward and the last iterate's check included
    marginal = batch * iters / (t_inv - (t1 - t0))  # per added iteration
    print(f"{name:>12}  batch {batch:3d}  bare fwd+bwd (input grad) {batch / t_in:7.1f} img/s   (+param grads "
          f"{batch / t_tr:7.1f})   inversion {ips:7.1f} image-iterations/s overall ({1 + iters} its, {t_inv:.1f} s), "
          f"{marginal:7.1f} per added iteration = {ips / (batch / t_in):.2f}x / {marginal / (batch / t_in):.2f}x "
          f"of bare (input grad), {ips / (batch / t_tr):.2f}x / {marginal / (batch / t_tr):.2f}x of bare "
          "(+param grads)")


def stir_time(pt: vs.ViTModel, ft: vs.ViTModel, n: int, layers: list[int], iterations: int) -> float:
    from vitscope.analyses.invariance import Stir
    from vitscope.data.base import Batch
    from vitscope.data.catalog import FORMATS
    from vitscope.study.config import DatasetConfig

    ds = FORMATS["cifar10-test-1k"].build(DatasetConfig(name="cifar10-test-1k"))
    a = Stir(pt.info(), ft.info(), layers=layers, iterations=iterations, corruptions=None)
    t0 = time.perf_counter()
    done = 0
    for b in ds.batches(32, pt.preprocessing):
        if done >= n:
            break
        b = Batch(images=b.images[: n - done], index=b.index[: n - done], labels=None)
        a.update(pt, ft, b)
        done += len(b)
    a.finalize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--pt", default="zoo-random", help="the pretrained model (default: zoo-random)")
    ap.add_argument("--ft", default="zoo-random-ft-cls", help="its fine-tuned model (default: zoo-random-ft-cls)")
    ap.add_argument("--skip-vits", action="store_true")
    ap.add_argument("--skip-stir", action="store_true")
    ap.add_argument("--skip-zoo", action="store_true")
    ap.add_argument("--vits-iterations", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {args.threads}; load average {os.getloadavg()}")
    zoo = vs.load_model(args.pt)
    if not args.skip_zoo:
        throughput(args.pt, zoo, 32, 10)
    if not args.skip_vits:
        vits = vs.load_model("vit_small_patch16_224", pretrained=False)
        throughput("ViT-S/16", vits, 8, args.vits_iterations)
    if args.skip_stir:
        return
    ft = vs.load_model(args.ft)
    n, it = args.images, args.iterations
    t8 = stir_time(zoo, ft, n, list(range(8)), it)
    print(f"STIR {args.pt} -> {ft.name}: {n} images, 8 layers, {it} iterations, 1 repeat: {t8:.1f} s "
          f"({t8 / n:.2f} s per image; 500 images ~ {t8 / n * 500 / 60:.0f} min)")
    t2 = stir_time(zoo, ft, n, [1, 7], it)
    print(f"  layers [1, 7]: {t2:.1f} s;  layers [1]:", end=" ")
    t1 = stir_time(zoo, ft, n, [1], it)
    print(f"{t1:.1f} s  (cost per inverted layer j grows with j + 1 blocks: early exit)")
    th = stir_time(zoo, ft, n // 2, list(range(8)), it)
    print(f"  {n // 2} images, 8 layers: {th:.1f} s (linear in images: {t8 / th:.2f}x for 2x images)")
    print(f"load average now {os.getloadavg()}")


if __name__ == "__main__":
    main()
