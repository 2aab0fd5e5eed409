"""Dense downstream tasks: what the tasks cost beside the forward passes they need (ViT-S/16, 224 px, all 12
blocks plus the final norm, CPU, random init; the weights do not change the cost).

``--size 480`` runs propagation at DAVIS's protocol instead: generated 480 x 854 frames (the central rows of
854-pixel scenes) seen whole (short side 480, sides rounded to the patch: 480 x 848, a 30 x 53 grid), labels
propagated on that grid and scored at 480 x 854 (`vitscope.data.transforms.Framing`), as `vitscope.data.formats.Davis`
batches them; the forward of one such frame is then timed against one 224 x 224 frame.

Measured on the 2-core machine, quiet (random-init ViT-S/16, 12 blocks + final norm, 2 threads, 2026-11-25):
  --tasks propagation --size 480 --frames 12 --reps 2 --batch 4: forward 9.11 s, analysis 6.99 s, total /
      forward 1.77x (goal <= 2x); --frames 24 (contexts of 8 frames most of the time, as in long videos):
      forward 17.06 s, analysis 17.61 s, 2.00x (median 2.02x); one 480 x 848 forward 0.66 s against 0.053 s at
      224 x 224 (12.5x; 1590 tokens against 196)
  --tasks propagation --frames 50 --reps 3 (224 px): 2.09x (median 2.15x): on a 14 x 14 grid the radius-12
      neighbourhood is the whole frame, so the affinity is DINO's full product (about 0.65 of a forward's MACs)
  --tasks correspondence retrieval --reps 3: 1.04x and 1.06x

  propagation     one generated video of --frames (50) frames       goal: total <= 2x the forward passes
  correspondence  --pairs (32) generated pairs (2 images each)      goal: total <= 1.3x
  retrieval       a generated split (--queries 16, 4 views, 32 distractors)   goal: total <= 1.3x

Total = forward + the analysis's updates + its finalize (retrieval ranks in finalize). The images are made
before timing. Each task is timed --reps times (interleaved with nothing else); the minimum and the median are
printed (a shared 2-core machine varies by +-10% and more). Also printed: the propagation state held while
streaming (one video in progress: first frame + the last 7, all layers), the same whether 1 or 3 videos pass.

    python benchmarks/dense.py [--reps 3] [--frames 50] [--pairs 32] [--queries 16] [--tasks propagation ...]
                               [--threads 1]

On a heavily shared machine, use --threads 1: with 2 threads each of the propagation's many small elementwise
ops (masks of 224 x 224 per layer and object) waits for a descheduled second thread; measured at a load average
of 25 on 2 cores, one binary dilation of 26 masks took 18 ms on 1 thread and 750 ms on 2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vitscope as vs
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data.synthetic_tasks import SyntheticPairs, SyntheticRetrieval, SyntheticVideos


def _state_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_state_bytes(v) for v in obj)
    return 0


def run(vm, name: str, batches: list, peak: list | None = None) -> dict[str, float]:
    a = get_analysis(name)(vm)
    timings: dict[str, float] = {}
    if peak is not None:
        update = a.update

        def watched(feats, batch):
            update(feats, batch)
            peak.append(_state_bytes(a.cur))
        a.update = watched
    stream(vm, batches, [a], progress=False, timings=timings)
    t0 = time.perf_counter()
    a.finalize()
    return {"forward": timings["forward"], "analysis": timings[name] + time.perf_counter() - t0}


def whole_frames(n_frames: int, size: int, batch: int, pre) -> list:
    """One generated video as DAVIS batches it: 854 x 854 scenes cut to their central 480 rows (a 480 x 854
    frame and annotation), seen whole at short side ``size``, the annotation kept at 480 x 854 for scoring."""
    from vitscope.data.transforms import Framing, collate

    vids = SyntheticVideos(n_videos=1, n_frames=n_frames, seed=0, size=854)
    framing = Framing("full", size)
    samples = []
    for i in range(n_frames):
        s = vids.sample(i)
        top = (854 - 480) // 2
        s.image, s.objects = s.image[top:top + 480], s.objects[top:top + 480]
        s.mask = s.parts = None
        s.keypoints = s.bbox = None
        samples.append(framing.apply(s, pre))
    out = []
    for k in range(0, n_frames, batch):
        chunk = samples[k:k + batch]
        b = collate(chunk, pre)
        b.extra["source_objects"] = [torch.as_tensor(c.extra["source_objects"]).long() for c in chunk]
        b.extra["framing"] = framing.describe(pre)
        out.append(b)
    return out


def forward_cost(vm, frame: torch.Tensor, pre, reps: int) -> None:
    """Seconds of one forward (every block and the final norm captured) of one whole frame against one
    224 x 224 frame, interleaved, minimum and median over ``reps`` pairs."""
    from vitscope.capture import Capture

    taps = [f"block{i}.out" for i in range(vm.depth)] + ["final_norm"]
    square = torch.zeros(1, 3, pre.input_size, pre.input_size)
    big, small = [], []
    with Capture(vm, taps) as cap:
        cap(square)
        for _ in range(max(reps, 3)):
            t0 = time.perf_counter()
            cap(frame)
            t1 = time.perf_counter()
            cap(square)
            big.append(t1 - t0)
            small.append(time.perf_counter() - t1)
    print(f"forward of one frame: {tuple(frame.shape[-2:])} {min(big):.3f} s (median {statistics.median(big):.3f}), "
          f"{pre.input_size} x {pre.input_size} {min(small):.3f} s (median {statistics.median(small):.3f}): "
          f"{min(big) / min(small):.1f}x (tokens {frame.shape[-2] * frame.shape[-1] // vm.patch_size ** 2} vs "
          f"{pre.input_size ** 2 // vm.patch_size ** 2})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--tasks", nargs="+", default=["propagation", "correspondence", "retrieval"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--size", type=int, default=None, help="propagation on whole 480 x 854-style frames, short "
                    "side SIZE (DAVIS's protocol: 480)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vm = vs.load_model(args.model, pretrained=False)
    pre = vm.preprocessing
    videos = (whole_frames(args.frames, args.size, args.batch, pre) if args.size else
              list(SyntheticVideos(n_videos=1, n_frames=args.frames, seed=0).batches(args.batch, pre)))
    data = {
        "propagation": videos,
        "correspondence": list(SyntheticPairs(n_pairs=args.pairs, seed=0, flat=True).batches(args.batch, pre)),
        "retrieval": list(SyntheticRetrieval(n_queries=args.queries, views=4, n_distractors=2 * args.queries,
                                             seed=0).batches(args.batch, pre)),
    }
    goals = {"propagation": 2.0, "correspondence": 1.3, "retrieval": 1.3}
    print(f"{args.model}, {vm.depth} blocks + final norm, grid {vm.grid_size}, torch threads "
          f"{torch.get_num_threads()}" + (f"; propagation on whole frames {tuple(videos[0].images.shape[-2:])}, "
                                          f"scored at {tuple(videos[0].extra['source_objects'][0].shape)}"
                                          if args.size else ""))
    if args.size:
        forward_cost(vm, videos[0].images[:1], pre, args.reps)
    for name, batches in data.items():
        if name not in args.tasks:
            continue
        n = sum(len(b) for b in batches)
        ratios, fwd, ana = [], [], []
        for _ in range(args.reps):
            t = run(vm, name, batches)
            fwd.append(t["forward"])
            ana.append(t["analysis"])
            ratios.append((t["forward"] + t["analysis"]) / t["forward"])
        print(f"{name:15s} {n:4d} images  forward {min(fwd):6.2f} s  analysis {min(ana):6.2f} s  "
              f"total / forward: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x  "
              f"(goal <= {goals[name]}x)")
    if "propagation" not in args.tasks or args.size:
        return
    one, three = [], []
    run(vm, "propagation", data["propagation"][:1], one)
    vids = list(SyntheticVideos(n_videos=3, n_frames=12, seed=1).batches(args.batch, pre))
    run(vm, "propagation", vids, three)
    print(f"propagation state in progress: peak {max(one) / 2**20:.1f} MB with 1 video, "
          f"{max(three) / 2**20:.1f} MB with 3 videos (per-video state: bounded by 1 + 7 frames x 12 layers)")


if __name__ == "__main__":
    main()
