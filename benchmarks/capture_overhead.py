"""Capture overhead: ViT-S/16 at 224 px, batch 32, CPU.

Prints, from one run, the time ratio of
  (a) capturing every block{i}.out       vs a bare forward (timm's default fused attention), goal <= 1.05x
  (b) capturing every tap incl. attention vs a bare forward with unfused attention,      goal <= 1.25x
Runs are interleaved and the median of --reps repetitions is used, so load on the machine affects
both sides alike.

    python benchmarks/capture_overhead.py [--reps 5] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vitscope as vs


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", default="vit_small_patch16_224")
    args = ap.parse_args()

    vm = vs.load_model(args.model, pretrained=False)
    x = torch.randn(args.batch, 3, *vm.img_size, generator=torch.Generator().manual_seed(0))
    model = vm.model
    out_taps = [f"block{i}.out" for i in range(vm.depth)]

    def set_fused(flag: bool) -> None:
        for b in model.blocks:
            b.attn.fused_attn = flag

    def bare() -> None:
        with torch.inference_mode():
            model(x)

    cap_out = vs.Capture(vm, out_taps)
    cap_all = vs.Capture(vm, vm.taps)

    def capture(cap: vs.Capture) -> None:
        with cap:
            cap(x)

    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads, {args.reps} reps (median)")
    bare()  # warm-up
    capture(cap_all)
    t = {"bare_fused": [], "cap_out": [], "bare_unfused": [], "cap_all": []}
    for _ in range(args.reps):
        set_fused(True)
        t["bare_fused"].append(_time(bare))
        t["cap_out"].append(_time(lambda: capture(cap_out)))
        set_fused(False)
        t["bare_unfused"].append(_time(bare))
        set_fused(True)
        t["cap_all"].append(_time(lambda: capture(cap_all)))
    m = {k: statistics.median(v) for k, v in t.items()}
    for k, v in m.items():
        print(f"  {k:<13} {v:7.3f} s")
    ra = m["cap_out"] / m["bare_fused"]
    rb = m["cap_all"] / m["bare_unfused"]
    print(f"(a) every block{{i}}.out vs bare forward:            {ra:.3f}x  (goal <= 1.05)")
    print(f"(b) every tap incl. attention vs bare unfused forward: {rb:.3f}x  (goal <= 1.25)")
    print(f"    (unfused vs fused bare forward: {m['bare_unfused'] / m['bare_fused']:.3f}x)")


if __name__ == "__main__":
    main()
