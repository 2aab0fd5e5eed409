"""Throughput of one zoo training step per objective, and the budget it allows.

For each objective: the zoo architecture (or --arch overrides), batches from the real data pipeline
(random uint8 images standing in for CIFAR-10: the augmentations cost the same), the real training step
(`vitscope.zoo.train.train_step`: forward, backward, clipping, AdamW, schedule, EMA teacher). After
--warmup steps, --steps steps are timed, round-robin over the objectives (a burst of load elsewhere
slows all alike); the median step time is reported (and the minimum), the augmentation share
separately. Prints, per objective, images/s (source images) and image-views/s (the budget's unit),
then the common budget: the slowest objective's image-views/s x --minutes.

    python benchmarks/zoo_throughput.py [--steps 12] [--warmup 3] [--minutes 45] [--batch 128]
    python benchmarks/zoo_throughput.py --arch embed_dim=192 depth=6 num_heads=3    # another size

Speed-ups of the step (issue 18), against fp32 in one interleaved run: ``--variants`` runs every listed
variant of every objective from the same initialisation on the same batches, round-robin step by step,
and prints each variant's median CPU time per step, its ratio to fp32, and how far its losses are from
fp32's over the timed steps (the first step starts from identical weights, later ones drift apart):

    python benchmarks/zoo_throughput.py --threads 1 --steps 6 --warmup 2 --objectives supervised dino simmim \
        --variants fp32 bf16 foreach fused bf16-fused channels-last

variants: fp32 (the reference: torch's default AdamW), bf16 (forward under bfloat16 autocast), foreach /
fused (AdamW implementations), channels-last (the patch-embedding convolution's memory format), compile
(torch.compile of the encoder's blocks; compilation time excluded), and combinations joined by '-'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from vitscope.zoo import ZOO_ARCH, ZooArch, build_objective
from vitscope.zoo.data import Augment, ImageSet, ViewStream
from vitscope.zoo.train import TrainConfig, make_optimizer, train_step


def _arch(overrides: list[str]) -> ZooArch:
    kw = asdict(ZOO_ARCH)
    for o in overrides:
        k, _, v = o.partition("=")
        kw[k] = type(kw[k])(v)
    return ZooArch(**kw)


def _finetune_init(arch: ZooArch, tmp: Path) -> str:
    from vitscope.models import save_checkpoint
    from vitscope.models.registry import ModelSpec, WeightSource
    from vitscope.zoo.arch import TIMM_ARCH, build_encoder, zoo_preprocessing

    spec = ModelSpec("zoo-bench", TIMM_ARCH, "none", "none", WeightSource("none"), zoo_preprocessing(arch.img_size),
                     arch.kwargs(0))
    return str(save_checkpoint(build_encoder(arch, 0), tmp / "init.safetensors", spec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--minutes", type=float, default=45.0)
    ap.add_argument("--objectives", nargs="*",
                    default=["supervised", "dino", "mocov3", "mae", "simmim", "hybrid", "finetune"])
    ap.add_argument("--arch", nargs="*", default=[], help="ZooArch overrides, key=value")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, 2 here)")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="step time the budget is computed from (min = least disturbed by other load)")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="compare step variants against fp32 instead (fp32 bf16 foreach fused channels-last compile, "
                         "or combinations such as bf16-fused)")
    ap.add_argument("--split", action="store_true",
                    help="where bf16 autocast gains and loses: CPU time of the encoder's inference forward, training "
                         "forward and backward (supervised loss), fp32 against bf16, interleaved")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    arch = _arch(args.arch)
    if args.split:
        split_bf16(args, arch)
        return
    if args.variants is not None:
        compare_variants(args, arch)
        return
    print(f"arch: {arch}  batch {args.batch}  torch threads {torch.get_num_threads()}  "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    g = torch.Generator().manual_seed(0)
    n = max(1024, 2 * args.batch)
    data = ImageSet(torch.randint(0, 256, (n, 3, arch.img_size, arch.img_size), dtype=torch.uint8, generator=g),
                    torch.randint(0, 10, (n,), generator=g), [str(i) for i in range(10)], "random")
    rates: dict[str, float] = {}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.objectives:
            kw = {"init": _finetune_init(arch, Path(tmp))} if name == "finetune" else {}
            obj = build_objective(name, arch, 10, 0, **kw)
            pre = obj.preprocessing
            stream = ViewStream(data, obj.views, args.batch, 0, Augment(obj.views, obj.img_size, pre.mean, pre.std,
                                                                        obj.patch_size))
            opt, sched = make_optimizer(obj, TrainConfig(name, tmp), 1000)
            obj.train()
            runs[name] = {"obj": obj, "stream": stream, "opt": opt, "sched": sched, "aug": [], "step": [], "cpu": []}
        # round-robin: one step of each objective per round, so a burst of load elsewhere hits all alike
        for s in range(args.warmup + args.steps):
            for r in runs.values():
                c0, t0 = time.process_time(), time.perf_counter()
                batch = r["stream"].batch(s)
                t1 = time.perf_counter()
                train_step(r["obj"], r["opt"], r["sched"], batch, s, 1000, 3.0)
                t2, c2 = time.perf_counter(), time.process_time()
                if s >= args.warmup:
                    r["aug"].append(t1 - t0)
                    r["step"].append(t2 - t1)
                    r["cpu"].append(c2 - c0)
    for name, r in runs.items():
        tot = [a + b for a, b in zip(r["aug"], r["step"], strict=True)]
        med, best = statistics.median(tot), min(tot)
        vpi = r["obj"].views.views_per_image()
        img_s = args.batch / (med if args.stat == "median" else best)
        rates[name] = img_s * vpi
        print(f"{name:<11} views/image {vpi:4.2f}  step median {med:5.2f} s, min {best:5.2f} s, "
              f"cpu {statistics.median(r['cpu']):5.2f} s (augment {100 * sum(r['aug']) / sum(tot):4.1f}%)  "
              f"images/s {img_s:6.1f}  "
              f"image-views/s {img_s * vpi:6.1f}  -> {img_s * vpi * args.minutes * 60 / 1e3:5.0f}k views "
              f"in {args.minutes:g} min")
    slow = min(rates, key=rates.get)
    budget = rates[slow] * args.minutes * 60
    print(f"slowest: {slow} at {rates[slow]:.1f} image-views/s ({args.stat} step) -> common budget {rates[slow]:.1f} x "
          f"{args.minutes * 60:.0f} s = {budget / 1e3:.0f}k image-views "
          f"(= {budget / 50_000:.1f} passes of CIFAR-10 train at 1 view per image); "
          f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

def split_bf16(args: argparse.Namespace, arch: ZooArch) -> None:
    """Median CPU time of the encoder's forward (no grad), forward (grad) and backward, fp32 vs bf16 autocast."""
    from vitscope.zoo.arch import build_encoder

    torch.manual_seed(0)
    m = build_encoder(arch, 10).train()
    x = torch.randn(args.batch, 3, arch.img_size, arch.img_size)
    y = torch.randint(0, 10, (args.batch,))
    times: dict[str, dict[str, list[float]]] = {p: {"inference": [], "forward": [], "backward": []}
                                                for p in ("fp32", "bf16")}
    for s in range(args.warmup + args.steps):
        for p in ("fp32", "bf16"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p == "bf16"):
                c0 = time.process_time()
                with torch.no_grad():
                    m(x)
                c1 = time.process_time()
                out = m(x)
            loss = torch.nn.functional.cross_entropy(out.float(), y)
            c2 = time.process_time()
            loss.backward()
            c3 = time.process_time()
            m.zero_grad(set_to_none=True)
            if s >= args.warmup:
                for k, v in (("inference", c1 - c0), ("forward", c2 - c1), ("backward", c3 - c2)):
                    times[p][k].append(v)
    print(f"arch: {arch}  batch {args.batch}  torch threads {torch.get_num_threads()}  "
          f"(median CPU s over {args.steps})")
    for k in ("inference", "forward", "backward"):
        a, b = statistics.median(times["fp32"][k]), statistics.median(times["bf16"][k])
        print(f"{k:<10} fp32 {a:6.3f} s  bf16 {b:6.3f} s  speed-up {a / b:5.2f}x")


VARIANT_PARTS = ("fp32", "bf16", "foreach", "fused", "channels-last", "compile")


def _parse_variant(v: str) -> dict:
    parts = {p.replace("channelslast", "channels-last") for p in v.replace("channels-last", "channelslast").split("-")}
    unknown = parts - set(VARIANT_PARTS)
    if unknown:
        raise SystemExit(f"unknown variant part(s) {sorted(unknown)} in {v!r}; parts: {', '.join(VARIANT_PARTS)}")
    return {"precision": "bf16" if "bf16" in parts else "fp32",
            "adamw": "fused" if "fused" in parts else "foreach" if "foreach" in parts else "default",
            "channels_last": "channels-last" in parts, "compile": "compile" in parts}


def compare_variants(args: argparse.Namespace, arch: ZooArch) -> None:
    """Every variant of every objective, same init and batches, interleaved step by step."""
    variants = list(dict.fromkeys(["fp32", *args.variants]))
    print(f"arch: {arch}  batch {args.batch}  torch threads {torch.get_num_threads()}  torch {torch.__version__}  "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    g = torch.Generator().manual_seed(0)
    n = max(1024, 2 * args.batch)
    data = ImageSet(torch.randint(0, 256, (n, 3, arch.img_size, arch.img_size), dtype=torch.uint8, generator=g),
                    torch.randint(0, 10, (n,), generator=g), [str(i) for i in range(10)], "random")
    runs: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.objectives:
            for v in variants:
                kw = {"init": _finetune_init(arch, Path(tmp))} if name == "finetune" else {}
                obj = build_objective(name, arch, 10, 0, **kw)  # seeded: every variant starts from the same weights
                pv = _parse_variant(v)
                if pv["channels_last"]:
                    obj.to(memory_format=torch.channels_last)
                if pv["compile"]:
                    for blk_owner in [m for m in obj.modules() if hasattr(m, "blocks")]:
                        for i, blk in enumerate(blk_owner.blocks):
                            blk_owner.blocks[i] = torch.compile(blk, dynamic=False)
                pre = obj.preprocessing
                stream = ViewStream(data, obj.views, args.batch, 0,
                                    Augment(obj.views, obj.img_size, pre.mean, pre.std, obj.patch_size))
                cfg = TrainConfig(name, tmp, precision=pv["precision"], adamw=pv["adamw"])
                opt, sched = make_optimizer(obj, cfg, 1000)
                obj.train()
                runs[(name, v)] = {"obj": obj, "stream": stream, "opt": opt, "sched": sched, "pv": pv,
                                   "cpu": [], "wall": [], "loss": []}
        for s in range(args.warmup + args.steps):
            for r in runs.values():
                batch = r["stream"].batch(s)
                if r["pv"]["channels_last"]:
                    batch.global_views = [x.contiguous(memory_format=torch.channels_last) for x in batch.global_views]
                c0, t0 = time.process_time(), time.perf_counter()
                loss, _ = train_step(r["obj"], r["opt"], r["sched"], batch, s, 1000, 3.0, r["pv"]["precision"])
                t1, c1 = time.perf_counter(), time.process_time()
                r["loss"].append(float(loss))
                if s >= args.warmup:
                    r["cpu"].append(c1 - c0)
                    r["wall"].append(t1 - t0)
    print(f"{'objective':<11} {'variant':<16} {'cpu/step':>9} {'wall/step':>9} {'speed-up':>8}  "
          f"{'step-1 loss rel. diff':>21}  {'max rel. loss diff':>18}")
    for name in args.objectives:
        ref = runs[(name, "fp32")]
        ref_cpu = statistics.median(ref["cpu"])
        for v in variants:
            r = runs[(name, v)]
            cpu = statistics.median(r["cpu"])
            d0 = abs(r["loss"][0] - ref["loss"][0]) / abs(ref["loss"][0])
            dmax = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], ref["loss"], strict=True))
            print(f"{name:<11} {v:<16} {cpu:8.3f}s {statistics.median(r['wall']):8.3f}s {ref_cpu / cpu:7.2f}x  "
                  f"{d0:21.2e}  {dmax:18.2e}")
    print(f"median over {args.steps} timed steps after {args.warmup} warm-up steps; speed-up = fp32 cpu / variant "
          f"cpu; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
