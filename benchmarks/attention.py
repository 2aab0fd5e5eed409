"""Attention analyses overhead: ViT-S/16 at 224 px, batch 32, CPU.

Prints, from one run, the time of a `stream` pass feeding ALL attention analyses (every block) against a
bare forward with unfused attention (the attention probabilities have to be materialised for any of
them), goal <= 1.3x. Also a capture-only pass (every block{i}.attn, no analysis) to separate the cost
of the hooks from the cost of the analyses, and the time of each analysis's `update` when run alone.

Runs are interleaved; the median and the minimum of --reps repetitions are both reported (on a shared
2-core machine single runs vary by +-10%, so the minimum is the steadier estimate of the cost). The
allocator is tuned (`engine.tune_allocator`, as every vitscope pass does) before timing either side.

    python benchmarks/attention.py [--reps 7] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import vitscope as vs
from vitscope.analyses import ANALYSES
from vitscope.capture import engine, stream
from vitscope.data import Batch, SyntheticShapes

NAMES = ("attention_distance", "attention_nmi", "cls_attention_maps", "aligned_attention_maps", "saliency_iou")


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", default="vit_small_patch16_224")
    args = ap.parse_args()

    print("tuned allocator:", engine.tune_allocator())
    vm = vs.load_model(args.model, pretrained=False)
    model = vm.model
    batch: Batch = next(SyntheticShapes(n=args.batch, seed=0).batches(args.batch, vm.preprocessing))
    x = batch.images
    attn_taps = [f"block{i}.attn" for i in range(vm.depth)]
    missing = [n for n in NAMES if n not in ANALYSES]
    assert not missing, f"analyses not registered: {missing}"

    def bare_unfused() -> None:
        for b in model.blocks:
            b.attn.fused_attn = False
        with torch.inference_mode():
            model(x)
        for b in model.blocks:
            b.attn.fused_attn = True

    def capture_only() -> None:
        with vs.Capture(vm, attn_taps) as cap:
            cap(x)

    def analysed() -> None:
        analyses = [ANALYSES[n](vm) for n in NAMES]
        stream(vm, [batch], analyses, progress=False)

    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads, {args.reps} reps, "
          f"analyses: {', '.join(NAMES)}")
    bare_unfused()  # warm-up
    analysed()
    t: dict[str, list[float]] = {"bare_unfused": [], "capture_attn": [], "all_analyses": []}
    for _ in range(args.reps):
        t["bare_unfused"].append(_time(bare_unfused))
        t["capture_attn"].append(_time(capture_only))
        t["all_analyses"].append(_time(analysed))
    med = {k: statistics.median(v) for k, v in t.items()}
    best = {k: min(v) for k, v in t.items()}
    for k in t:
        print(f"  {k:<13} median {med[k]:7.3f} s   min {best[k]:7.3f} s")
    for label, m in (("median", med), ("min", best)):
        print(f"[{label}] all attention analyses vs bare unfused forward: "
              f"{m['all_analyses'] / m['bare_unfused']:.3f}x  (goal <= 1.3)   "
              f"capture only: {m['capture_attn'] / m['bare_unfused']:.3f}x")

    # each analysis's update alone on freshly captured attention (cloned, so nothing computed for another
    # analysis is reused): what it costs when run by itself. Together they cost less than the sum, because
    # the analyses of one pass share row sums, image sums and query means of the same captured tensor.
    with vs.Capture(vm, attn_taps) as cap:
        feats = cap(x)
    solo: dict[str, list[float]] = {n: [] for n in NAMES}
    analyses = {n: ANALYSES[n](vm) for n in NAMES}
    for _ in range(max(3, args.reps // 2)):
        for n in NAMES:
            fresh = {k: v.clone() for k, v in feats.items()}
            solo[n].append(_time(lambda n=n, fresh=fresh: analyses[n].update(fresh, batch)))
            del fresh
    for n in NAMES:
        print(f"  update {n:<24} alone: median {statistics.median(solo[n]):6.3f} s   min {min(solo[n]):6.3f} s")


if __name__ == "__main__":
    main()
