"""Capture overhead: ViT-S/16 and DINOv3's Eva S/16 (RoPE, 4 storage tokens) at 224 px, batch 32, CPU.

Prints, from one run, per model the time ratio of
  (a) capturing every block{i}.out       vs a bare forward with unfused (eager) attention, goal <= 1.05x
  (b) capturing every tap incl. attention vs a bare forward with unfused attention,         goal <= 1.25x
  (c) capturing every tap incl. attention vs the model's bare forward as timm runs it (fused SDPA), the Eva's
      goal <= 1.3x (its attention tap needs the eager path, with RoPE applied as the model applies it)
and the price of the attention path: every capture runs timm's eager attention (one path whatever the taps,
so no number depends on what else a pass captures; see capture/engine.py), which a feature-only pass pays
against timm's default fused SDPA ("unfused vs fused bare forward").
Runs are interleaved; the median and the minimum of --reps repetitions are both reported (on a shared
2-core machine single runs vary by +-10%, so the minimum is the steadier estimate of the cost).

    python benchmarks/capture_overhead.py [--reps 5] [--batch 32] [--models vit_small_patch16_224 ...]
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


def measure(name: str, args: argparse.Namespace, untuned_too: bool) -> dict[str, float]:
    """Interleaved timings of one model; prints its lines and returns its median and minimum ratios."""
    vm = vs.load_model(name, pretrained=False, img_size=224)
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

    untuned: dict[str, list[float]] = {"bare_unfused": [], "cap_all": []}
    if untuned_too:
        # vitscope tunes glibc's allocator at the first Capture (see engine.tune_allocator). Measure once
        # without it, so the ratios below can be compared with what an untuned process pays.
        engine._ALLOCATOR_TUNED = False
        set_fused(False)
        bare()
        for _ in range(max(3, args.reps // 3)):
            set_fused(False)
            untuned["bare_unfused"].append(_time(bare))
            set_fused(True)
            untuned["cap_all"].append(_time(lambda: capture(cap_all)))
        engine._ALLOCATOR_TUNED = None
        print("tuned allocator:", engine.tune_allocator())

    print(f"{name} ({vm.family}, {len(vm.taps)} taps), batch {args.batch}, {torch.get_num_threads()} threads, "
          f"{args.reps} reps")
    bare()  # warm-up
    capture(cap_all)
    t: dict[str, list[float]] = {"bare_fused": [], "cap_out": [], "bare_unfused": [], "cap_all": []}
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
    row: dict[str, float] = {}
    for label, m in (("median", med), ("min", best)):
        row[f"a_{label}"] = m["cap_out"] / m["bare_unfused"]
        row[f"b_{label}"] = m["cap_all"] / m["bare_unfused"]
        row[f"c_{label}"] = m["cap_all"] / m["bare_fused"]
    print(f"  unfused vs fused bare forward (median): {med['bare_unfused'] / med['bare_fused']:.3f}x, (min): "
          f"{best['bare_unfused'] / best['bare_fused']:.3f}x  (the price of one attention path)")
    if untuned_too:
        ub, uc = (statistics.median(untuned[k]) for k in ("bare_unfused", "cap_all"))
        print(f"  without allocator tuning (median): bare unfused {ub:.3f} s, every tap {uc:.3f} s -> (b) "
              f"{uc / ub:.3f}x; tuning speeds the bare unfused forward up {ub / med['bare_unfused']:.2f}x")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "vit_small_patch16_dinov3"],
                    help="timm names, built at 224 px with random weights (default: ViT-S/16 and DINOv3's Eva S/16)")
    args = ap.parse_args()

    rows = {name: measure(name, args, untuned_too=i == 0) for i, name in enumerate(args.models)}
    print("\nratios, one row per model (goals: (a) <= 1.05, (b) <= 1.25 for ViT-S/16, (c) <= 1.3 for the Eva):")
    print(f"  {'model':<28} {'(a) block outputs':>18} {'(b) every tap / unfused':>24} {'(c) every tap / fused':>22}")
    for name, r in rows.items():
        print(f"  {name:<28} {r['a_median']:>8.3f} (min {r['a_min']:.3f}) {r['b_median']:>12.3f} (min {r['b_min']:.3f})"
              f" {r['c_median']:>10.3f} (min {r['c_min']:.3f})")


if __name__ == "__main__":
    main()
