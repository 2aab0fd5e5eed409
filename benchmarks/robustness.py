"""The robustness set (shape_bias, band_noise, corruptions) on N images: where the time goes.

For each model: every pass the three analyses need (shape_bias: the clean training images and the cue-conflict
images; band_noise and corruptions: the clean images and each perturbed view), fed by
`vitscope.analyses._drive.run_passes` as the study engine feeds them. Prints seconds of perturbation, forward
(capture), analysis updates and finalize (probes per layer and view), and the ratio of the whole to the
forward passes (goal <= 1.2x); then the perturbation throughput on its own (images/s) per view kind.
Image generation (the synthetic scenes) is the data loader's and is not counted.

    python benchmarks/robustness.py [--n 512] [--models zoo-dino vit_small_patch16_224] [--threads 1]
        [--corruptions gaussian_noise shot_noise impulse_noise contrast jpeg_compression pixelate]
        [--severities 1 3 5] [--bands 0 1 ... 9] [--only shape_bias band_noise corruptions]

ViT-S/16 is built with random weights (timing does not depend on them; no download).
"""

from __future__ import annotations

import argparse
import time

import torch

import vitscope as vs
from vitscope.analyses._drive import run_passes
from vitscope.analyses.robustness import BandNoise, Corruptions, ShapeBias
from vitscope.data import perturb as P
from vitscope.data.synthetic import SyntheticShapes


class _Cached:
    """A dataset whose batches are drawn once (image generation is the loader's cost, not the analysis's)."""

    def __init__(self, ds, bs, pre):
        self.name, self.classes = ds.name, ds.classes
        self.n = len(ds)
        self.cached = list(ds.batches(bs, pre))

    def __len__(self):
        return self.n

    def batches(self, bs, pre, start=0, indices=None):
        for b in self.cached:
            yield type(b)(**{**b.__dict__, "extra": dict(b.extra)})


def perturb_throughput(size: int, n: int, corruptions: list[str], bs: int = 64) -> dict[str, float]:
    x = torch.rand(bs, 3, size, size)
    out = {}
    for b in (0, 5, 9):
        t = time.perf_counter()
        for s in range(0, n, bs):
            P.band_noise(x, torch.arange(s, s + bs), 0, band=b)
        out[f"band_noise band {b}"] = n / (time.perf_counter() - t)
    for c in corruptions:
        t = time.perf_counter()
        for s in range(0, n, bs):
            P.corrupt_batch(x, torch.arange(s, s + bs), 0, c, 3)
        out[f"{c} (sev 3)"] = n / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=["zoo-dino", "vit_small_patch16_224"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--corruptions", nargs="+", default=["gaussian_noise", "shot_noise", "impulse_noise", "contrast",
                                                         "jpeg_compression", "pixelate"])
    ap.add_argument("--severities", nargs="+", type=int, default=[1, 3, 5])
    ap.add_argument("--bands", type=int, nargs="+", default=list(range(10)), help="which of the 10 bands")
    ap.add_argument("--only", nargs="+", default=["shape_bias", "band_noise", "corruptions"])
    ap.add_argument("--throughput-only", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, {args.n} images, batch {args.batch}")
    for name in args.models:
        vm = vs.load_model(name, pretrained=not name.startswith("vit_"))
        size = vm.img_size[0]
        print(f"\n== {name} ({size} px)")
        thr = perturb_throughput(size, min(args.n, 256), args.corruptions, args.batch)
        print("perturbation alone (images/s): " + ", ".join(f"{k} {v:.0f}" for k, v in thr.items()))
        if args.throughput_only:
            continue
        pre = vm.preprocessing
        t0 = time.perf_counter()
        shapes = _Cached(SyntheticShapes(n=args.n, seed=1), args.batch, pre)
        cue = _Cached(SyntheticShapes(n=args.n, seed=2, variant="cue-conflict"), args.batch, pre)
        print(f"(image generation, not counted: {time.perf_counter() - t0:.1f} s)")
        jobs = [("shape_bias", ShapeBias(vm), {"data": cue, "train": shapes}),
                ("band_noise", BandNoise(vm, bands=args.bands), {"data": shapes}),
                ("corruptions", Corruptions(vm, corruptions=args.corruptions, severities=args.severities),
                 {"data": shapes})]
        total = {"perturb": 0.0, "forward": 0.0, "update": 0.0, "finalize": 0.0}
        for label, an, data in [j for j in jobs if j[0] in args.only]:
            t = run_passes(an, vm, data, batch_size=args.batch)
            t1 = time.perf_counter()
            df = an.finalize()
            t["finalize"] = time.perf_counter() - t1
            n_pass = len(type(an).views(getattr(an, "params", {}))) + len(data) - 1
            for k in total:
                total[k] += t[k]
            whole = sum(t.values())
            print(f"{label:12s} {n_pass:3d} passes: perturb {t['perturb']:6.1f} s  forward {t['forward']:6.1f} s  "
                  f"update {t['update']:5.1f} s  finalize {t['finalize']:5.1f} s  -> {whole / t['forward']:.2f}x "
                  f"forward ({len(df)} rows)")
        ratio = sum(total.values()) / total["forward"]
        print(f"{'all':12s}            perturb {total['perturb']:6.1f} s  forward {total['forward']:6.1f} s  "
              f"update {total['update']:5.1f} s  finalize {total['finalize']:5.1f} s  -> {ratio:.2f}x forward")


if __name__ == "__main__":
    main()
