"""Pass overhead of the mechanistic lens beside the analyses whose taps it shares.

Attention rollout reads every ``block{i}.attn`` (as the attention analyses do) and the high-norm tokens read
every ``block{i}.out`` (as svd_volume, fourier, semantics, cka do) plus the next block's attention, so on top
of a pass that already feeds those analyses they add their updates only, no capture. Prints, from one run, a
`stream` pass of one batch feeding the shared-tap analyses (``BASE``) against the same pass with
attention_rollout + high_norm_tokens added (goal <= 1.10x), and with logit_lens too; then each new analysis's
update alone on the captured tensors, and what each of the five costs one model on the default study's
256 shapes (gradient_rollout runs its own forward and backward, head_ablation reruns blocks: heavier, opt-in).

Runs are interleaved; the median and the minimum of --reps repetitions are both reported (on a shared
machine the minimum is the steadier estimate of the cost).

    OMP_NUM_THREADS=1 python benchmarks/mechanistic.py [--model zoo-sup] [--batch 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import vitscope as vs
from vitscope.analyses import ANALYSES
from vitscope.capture import engine, stream
from vitscope.data import SyntheticShapes

BASE = ("attention_distance", "attention_nmi", "cls_attention_maps", "aligned_attention_maps", "saliency_iou",
        "svd_volume", "fourier")
NEW = ("attention_rollout", "high_norm_tokens")


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", default="zoo-sup")
    ap.add_argument("--images", type=int, default=256, help="images of the per-model estimate (the default "
                    "study's synthetic-shapes set has 256)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print("tuned allocator:", engine.tune_allocator())
    vm = vs.load_model(args.model)
    batch = next(SyntheticShapes(n=args.batch, seed=0).batches(args.batch, vm.preprocessing))

    def run(names: tuple[str, ...]) -> Callable[[], None]:
        def go() -> None:
            stream(vm, [batch], [ANALYSES[n](vm) for n in names], progress=False)
        return go

    variants = {"base": run(BASE), "base+rollout+norms": run(BASE + NEW),
                "base+rollout+norms+lens": run(BASE + NEW + ("logit_lens",))}
    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads, {args.reps} reps")
    print(f"  base: {', '.join(BASE)}")
    for fn in variants.values():  # warm-up
        fn()
    t: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.reps):
        for k, fn in variants.items():
            t[k].append(_time(fn))
    for k, v in t.items():
        print(f"  {k:<26} median {statistics.median(v):7.3f} s   min {min(v):7.3f} s")
    for label, red in (("median", statistics.median), ("min", min)):
        base = red(t["base"])
        print(f"[{label}] rollout + high-norm tokens over base: {red(t['base+rollout+norms']) / base:.3f}x "
              f"(goal <= 1.10)   with logit lens too: {red(t['base+rollout+norms+lens']) / base:.3f}x")

    ALL = NEW + ("logit_lens", "gradient_rollout", "head_ablation")
    taps = sorted({tp for n in ALL for tp in ANALYSES[n](vm).required_taps()})
    with vs.Capture(vm, taps) as cap:
        feats = cap(batch.images)
    for n in ALL:
        a = ANALYSES[n](vm)
        times = [_time(lambda a=a: a.update(feats, batch)) for _ in range(max(3, args.reps // 2))]
        print(f"  update {n:<18} alone: median {statistics.median(times):6.3f} s   min {min(times):6.3f} s")

    # what one model of a study would pay: the updates of every batch of --images images and the finalize
    batches = list(SyntheticShapes(n=args.images, seed=0).batches(args.batch, vm.preprocessing))
    feats_of = []
    for b in batches:
        with vs.Capture(vm, taps) as cap:
            feats_of.append(cap(b.images))
    for n in ALL:
        a = ANALYSES[n](vm)
        up = sum(_time(lambda a=a, f=f, b=b: a.update(f, b)) for f, b in zip(feats_of, batches, strict=True))
        fin = _time(a.finalize)
        print(f"  {n:<18} on {args.images} images: updates {up:6.3f} s, finalize {fin:6.3f} s")


if __name__ == "__main__":
    main()
