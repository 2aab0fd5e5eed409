"""Synthetic data speed: images/s of the generator (`SyntheticShapes.batches`: scene sampling, drawing,
ground truth, normalisation) at 32 and 224 px, against a ViT-S/16 forward at 224 px, batch 32, CPU.

Prints, from one run, each rate and the ratio generator / forward (above 1: the data keeps up with the
model it feeds; one process, no workers). Wall-clock time, so a busy machine slows both sides. The
allocator is tuned first, as in a study (`vitscope.capture.engine.tune_allocator`).

    python benchmarks/synthetic_speed.py [--n32 2048] [--n224 256] [--batches 3]
"""

from __future__ import annotations

import argparse
import time

import torch

import vitscope as vs
from vitscope.capture.engine import tune_allocator
from vitscope.data import SyntheticShapes
from vitscope.models.registry import Preprocessing


def generator_rate(size: int, n: int, batch: int = 32) -> float:
    """Images per second through ``SyntheticShapes(...).batches`` at ``size`` px."""
    ds = SyntheticShapes(n=n, seed=0)
    pre = Preprocessing(input_size=size)
    next(SyntheticShapes(n=batch, seed=1).batches(batch, pre))  # warm-up (imports, caches)
    t0 = time.perf_counter()
    count = sum(len(b) for b in ds.batches(batch, pre))
    return count / (time.perf_counter() - t0)


def forward_rate(batches: int, batch: int = 32) -> float:
    """Images per second of a bare ViT-S/16 forward at 224 px (random weights, inference mode)."""
    vm = vs.load_model("vit_small_patch16_224", pretrained=False)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        vm.model(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(batches):
            vm.model(x)
    return batches * batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n32", type=int, default=2048, help="images generated at 32 px")
    ap.add_argument("--n224", type=int, default=256, help="images generated at 224 px")
    ap.add_argument("--batches", type=int, default=3, help="ViT-S/16 forward batches of 32")
    args = ap.parse_args()

    tune_allocator()
    gen32 = generator_rate(32, args.n32)
    gen224 = generator_rate(224, args.n224)
    fwd = forward_rate(args.batches)
    print(f"threads: {torch.get_num_threads()}")
    print(f"synthetic generator  32 px: {gen32:8.1f} images/s")
    print(f"synthetic generator 224 px: {gen224:8.1f} images/s")
    print(f"ViT-S/16 forward    224 px: {fwd:8.1f} images/s (batch 32)")
    print(f"ratio generator/forward: 32 px {gen32 / fwd:.1f}x, 224 px {gen224 / fwd:.1f}x")


if __name__ == "__main__":
    main()
