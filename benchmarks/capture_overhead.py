"""Capture overhead: ViT-S/16 at 224 px, batch 32, CPU.

Prints, from one run, the time ratio of
  (a) capturing every block{i}.out       vs a bare forward with unfused (eager) attention, goal <= 1.05x
  (b) capturing every tap incl. attention vs a bare forward with unfused attention,         goal <= 1.25x
and the price of the attention path: every capture runs timm's eager attention (one path whatever the taps,
so no number depends on what else a pass captures; see capture/engine.py), which a feature-only pass pays
against timm's default fused SDPA ("unfused vs fused bare forward").
Runs are interleaved; the median and the minimum of --reps repetitions are both reported (on a shared
2-core machine single runs vary by +-10%, so the minimum is the steadier estimate of the cost).

    python benchmarks/capture_overhead.py [--reps 5] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vitscope as vs
from vitscope.capture import engine


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
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

    # vitscope tunes glibc's allocator at the first Capture (see engine.tune_allocator). Measure once
    # without it, so the ratios below can be compared with what an untuned process pays.
    engine._ALLOCATOR_TUNED = False
    untuned = {"bare_unfused": [], "cap_all": []}
    set_fused(False)
    bare()
    for _ in range(max(3, args.reps // 3)):
        set_fused(False)
        untuned["bare_unfused"].append(_time(bare))
        set_fused(True)
        untuned["cap_all"].append(_time(lambda: capture(cap_all)))
    engine._ALLOCATOR_TUNED = None
    print("tuned allocator:", engine.tune_allocator())

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
    med = {k: statistics.median(v) for k, v in t.items()}
    best = {k: min(v) for k, v in t.items()}
    for k in t:
        print(f"  {k:<13} median {med[k]:7.3f} s   min {best[k]:7.3f} s")
    for label, m in (("median", med), ("min", best)):
        ra = m["cap_out"] / m["bare_unfused"]
        rb = m["cap_all"] / m["bare_unfused"]
        print(f"[{label}] (a) every block{{i}}.out vs bare unfused forward:      {ra:.3f}x  (goal <= 1.05)")
        print(f"[{label}] (b) every tap incl. attention vs bare unfused forward: {rb:.3f}x  (goal <= 1.25)")
    print(f"unfused vs fused bare forward (median): {med['bare_unfused'] / med['bare_fused']:.3f}x, (min): "
          f"{best['bare_unfused'] / best['bare_fused']:.3f}x  (the price of one attention path)")
    ub, uc = (statistics.median(untuned[k]) for k in ("bare_unfused", "cap_all"))
    print(f"without allocator tuning (median): bare unfused {ub:.3f} s, every tap {uc:.3f} s -> (b) {uc / ub:.3f}x; "
          f"tuning speeds the bare unfused forward up {ub / med['bare_unfused']:.2f}x")


if __name__ == "__main__":
    main()
