"""Study overhead: 2 small models x every registered analysis on 512 synthetic images, or (``--size zoo``) the
embedded default study itself, exactly as `vitscope run` runs it (its models, datasets, views and analyses).

Prints, from one run: the wall time of the study (first run, nothing cached), the sum of bare forward
passes over the same images (fused attention, batches drawn the same way, the images loaded and generated
before the clock starts: that is study work; measured before and after the study, their mean), their ratio
(goal: at most 1.5x), the overhead
(study - bare) / bare, and the time of a fully cached rerun relative to the first run (goal < 5%).

    python benchmarks/study.py [--images 512] [--batch 32] [--size s|ti|zoo]

For the zoo the goal is study / bare forwards <= 2.5x.

``--imagefolder ROOT`` measures instead what the helper process (study/helper.py) gives a study that reads files:
the default study with its ``cifar10`` dataset read from ROOT, an ImageFolder (``--images`` of its images, 1000
unless given), run by `vitscope run` in a new process, nothing cached: without the helper (``VITSCOPE_WORKERS=1``),
with it, and with it and ``num_workers=0`` (no reading worker in the study's process either). Prints each run's
wall seconds (the command's, imports and report included), its model stage (the manifest's ``seconds``), its CPU
seconds (every process of the run), the models the helper computed, the tables that differ from those of the run
without the helper (and by how much: one process uses two threads, a process beside a helper one, which moves the
last bits of a few tables), the ratios, and the load averages around each run (a shared machine shows there). A
missing ROOT is said and skipped.

    python benchmarks/study.py --imagefolder ../shared/data/cifar10/test --images 1000
"""

from __future__ import annotations  # noqa: I001 - vitscope is imported before torch, on purpose

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vitscope as vs  # first, as the `vitscope` command does: torch's OpenMP threads then wait passively

import torch
from vitscope.analyses import ANALYSES
from vitscope.data import SyntheticShapes
from vitscope.data.catalog import build_dataset
from vitscope.study import load_config, run_study
from vitscope.study import helper
from vitscope.study.plan import make_plan
from vitscope.study.run import _select_ids

# The smallest models of the sources' comparisons are ViT-S/16 (DINO, MoCo v3); "ti" is smaller still,
# where the analyses' per-token work weighs most against a forward pass.
PAIRS = {
    "s": [("vit_small_patch16_224", "vit-s16", {}),
          ("beit_base_patch16_224", "beit-s16", {"embed_dim": 384, "num_heads": 6, "init_values": 0.1})],
    "ti": [("vit_tiny_patch16_224", "vit-ti16", {}),
           ("beit_base_patch16_224", "beit-ti16", {"embed_dim": 192, "num_heads": 3, "init_values": 0.1})],
}


def bare_forward_seconds(models: list[tuple[str, str, dict]], work: list, pretrained: bool) -> float:
    """Seconds of bare forwards (fused attention, no hooks) of every model over ``work``: ((dataset, ids),
    batch size) per pass; each dataset's batches are loaded and preprocessed before the clock starts."""
    total = 0.0
    for name, _label, kw in models:
        vm = vs.load_model(name, pretrained=pretrained, **kw)
        loaded: dict[int, list[torch.Tensor]] = {}
        for (ds, ids), bs in work:
            if id(ds) not in loaded:
                loaded[id(ds)] = [b.images for b in ds.batches(bs, vm.preprocessing, indices=ids)]
        t0 = time.perf_counter()
        with torch.inference_mode():
            for (ds, _ids), _bs in work:
                for images in loaded[id(ds)]:
                    vm.model(images)
        total += time.perf_counter() - t0
    return total


def print_where_time_went(manifest: dict, n_models: int) -> None:
    """The first run's manifest timings: per model load, pass (and its parts), finalize; then the cross-model
    stage and the report."""
    print("  where the first run's time went (manifest timings):")
    fin: dict[str, float] = {}
    for label, m in manifest["models"].items():
        t = m.get("timings", {})
        print(f"    {label}: load {t.get('load', 0):.1f} s, pass {t.get('pass', 0):.1f} s, "
              f"finalize {sum(t.get('finalize', {}).values()):.1f} s")
        print("      pass: " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                     sorted(t.get("pass_parts", {}).items(), key=lambda kv: -kv[1])))
        for k, v in t.get("finalize", {}).items():
            fin[k] = fin.get(k, 0.0) + v
    print(f"    finalize by analysis ({n_models} models): " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                          sorted(fin.items(), key=lambda kv: -kv[1])))
    t = manifest.get("timings", {})
    print(f"    cross-model stage and tables {t.get('cross_and_tables', 0):.1f} s, report {t.get('report', 0):.1f} s")


def _load() -> str:
    return "load " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _differences(tables: dict, alone: dict) -> str:
    """The tables of ``tables`` that are not exactly those of ``alone``, each with its largest relative difference."""
    import numpy as np

    out = []
    for name, t in tables.items():
        other = alone.get(name)
        if other is not None and t.equals(other):
            continue
        if other is None or t.shape != other.shape or list(t.columns) != list(other.columns):
            out.append(f"{name} (other rows or columns)")
            continue
        rel = 0.0
        for c in t.columns:
            if not t[c].equals(other[c]):
                if not np.issubdtype(t[c].dtype, np.number):
                    rel = float("inf")
                    break
                a, b = t[c].to_numpy(float), other[c].to_numpy(float)
                rel = max(rel, float(np.nanmax(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))))
        out.append(f"{name} (largest relative difference {rel:.1g})")
    return "equal" if not out else "differ: " + ", ".join(out)


def helper_speedup(root: Path, images: int) -> None:
    """The default study with its ``cifar10`` dataset read from the ImageFolder ``root`` (``images`` of it), by
    `vitscope run` in a new process, cold, without the helper process, with it, and with it and ``num_workers=0``:
    wall, model stage and CPU seconds, ratios, load (module docstring)."""
    import resource

    import pandas as pd
    import yaml

    from vitscope.study.config import default_config_path
    from vitscope.threads import workers

    if not root.is_dir():
        print(f"helper speed-up: skipped, {root} does not exist (an ImageFolder: root/<class>/<images>)")
        return
    if workers() < 2:
        print("helper speed-up: skipped, this machine runs no helper (one usable core, or VITSCOPE_WORKERS=1)")
        return
    study = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))
    study["datasets"]["cifar10"] = {"name": "imagefolder", "root": str(root.resolve()), "n_images": images}
    arms = {"alone": ("1", []), "helper": ("2", []), "helper, num_workers=0": ("2", ["num_workers=0"])}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "study.yaml"
        cfg.write_text(yaml.safe_dump(study, sort_keys=False))
        for arm, (n_workers, over) in arms.items():
            out = Path(tmp) / arm.replace(", ", "-").replace("=", "")
            before, r0 = _load(), resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "vitscope", "run", str(cfg), f"output_dir={out}",
                                   f"cache_dir={out}-cache", "progress=false", *over],
                                  env={**os.environ, "VITSCOPE_WORKERS": n_workers}, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run, its helper and its reading workers
            cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
            if done.returncode != 0:
                raise SystemExit(f"{arm}: vitscope run failed\n{done.stdout}{done.stderr}")
            manifest = json.loads((out / "manifest.json").read_text())
            helped = [m for m, meta in manifest["models"].items() if meta.get("helper_process")]
            tables = {f.name: pd.read_parquet(f) for f in sorted((out / "results").glob("*.parquet"))}
            runs[arm] = (wall, manifest["seconds"], cpu, helped, tables, before, _load())
    print(f"the default study ({len(study['models'])} models), its cifar10 dataset read from {root} "
          f"({images} images), by `vitscope run`, nothing cached, one run each, in this order:")
    for arm, (wall, stage, cpu, helped, tables, before, after) in runs.items():
        print(f"  {arm:21s} {wall:6.1f} s wall, model stage {stage:6.1f} s, CPU {cpu:6.1f} s; {before} before, "
              f"{after} after")
        if arm != "alone":
            print(f"    the helper computed {len(helped)} models ({', '.join(helped) or 'none'}); tables against "
                  f"'alone': {_differences(tables, runs['alone'][4])}")
    for a, b in (("alone", "helper"), ("alone", "helper, num_workers=0"), ("helper, num_workers=0", "helper")):
        print(f"  {a} / {b}: {runs[a][0] / runs[b][0]:.2f}x wall, {runs[a][1] / runs[b][1]:.2f}x model stage")
    print(f"  this machine: {os.cpu_count()} cores, shared with other work (see the load averages)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=None, help="512 (1000 with --imagefolder)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", choices=[*sorted(PAIRS), "zoo"], default="s",
                    help="the model pair (ViT + BEiT, S or Ti), or zoo: the default study as shipped")
    ap.add_argument("--imagefolder", type=Path, default=None,
                    help="measure the helper process's speed-up on the default study reading this ImageFolder")
    args = ap.parse_args()
    if args.imagefolder is not None:
        helper_speedup(args.imagefolder, args.images or 1000)
        return
    args.images = args.images or 512
    default = load_config()
    if args.size == "zoo":
        MODELS = [(m.name, m.label or m.name, {}) for m in default.models]
        analyses = default.analyses
    else:
        MODELS = PAIRS[args.size]
        analyses = {a: {} for a in ANALYSES}
    vs.capture.engine.tune_allocator()  # the study tunes it too: same conditions for both sides

    def bare_forwards() -> float:
        """Every model's forward over every image of every (dataset, view) pass the study plans (views: the
        clean images again; a view's perturbation is study work), fused attention; the images are loaded and
        preprocessed before the clock starts (loading and generating them is study work too)."""
        if args.size == "zoo":
            plan = make_plan(default)
            passes = list(dict.fromkeys(p for ap in plan.analyses if not ap.pair for p in ap.passes))
            data = {}
            for name, dc in plan.datasets.items():
                ds = build_dataset(dc)
                data[name] = (ds, _select_ids(ds, dc.n_images))  # the images the study picks
            work = [(data[d], default.batch_size) for d, _view in passes]
        else:
            ds = SyntheticShapes(n=args.images)
            work = [((ds, list(range(len(ds)))), args.batch)]
        return bare_forward_seconds(MODELS, work, pretrained=args.size == "zoo")

    def study_config(tmp: str):  # noqa: ANN202
        overrides = [f"output_dir={tmp}/run", f"cache_dir={tmp}/cache", "progress=false"]
        if args.size == "zoo":
            return load_config(None, overrides)
        cfg = Path(tmp) / "study.yaml"
        models = "\n".join(f"  - {{name: {n}, label: {lab}, pretrained: false, kwargs: {kw or {}}}}"
                           for n, lab, kw in MODELS)
        cfg.write_text(f"models:\n{models}\ndataset: {{name: synthetic-shapes, n_images: {args.images}}}\n"
                       f"analyses:\n" + "\n".join(f"  {a}: {json.dumps(p or {})}" for a, p in analyses.items())
                       + f"\nbatch_size: {args.batch}\n")
        return load_config(cfg, overrides)

    bare_before = bare_forwards()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = study_config(tmp)
        # `vitscope run` starts its helper process before its own imports, so the helper imports while the
        # study's process does; here the study's imports are done before the clock starts, and so are the
        # helper's (where the study uses one)
        helper.prespawn(None if args.size == "zoo" else Path(tmp) / "study.yaml")
        if helper._WAITING is not None:
            helper._WAITING.wait_ready()
        t0, c0 = time.perf_counter(), time.process_time()
        run_dir = run_study(cfg)
        first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
        manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
        t0 = time.perf_counter()
        run_study(study_config(tmp))
        cached = time.perf_counter() - t0
    bare_after = bare_forwards()  # before and after: a drift in the machine's load shows as a gap between them
    bare = (bare_before + bare_after) / 2

    what = "the default study's datasets and views" if args.size == "zoo" else \
        f"{args.images} images, batch {args.batch}"
    print(f"{len(MODELS)} models x {len(analyses)} analyses ({', '.join(analyses)}), {what}, "
          f"{torch.get_num_threads()} threads")
    print(f"  bare forward passes (sum): {bare:7.2f} s "
          f"(mean of {bare_before:.2f} s before and {bare_after:.2f} s after)")
    print(f"  study, first run:          {first:7.2f} s = {first / bare:.2f}x the bare forwards "
          f"({first / max(bare_before, bare_after):.2f}x-{first / min(bare_before, bare_after):.2f}x); "
          f"everything that is not the forward: {(first - bare) / bare:.2f}x the bare forwards")
    print(f"  study, first run CPU time: {first_cpu:7.2f} s ({first_cpu / first:.2f} cores busy on average)")
    print(f"  study time / bare forwards: {first / bare:.2f}x" + (" (goal for the zoo: <= 2.5x)" if args.size == "zoo"
                                                                  else ""))
    print(f"  study, cached rerun:       {cached:7.2f} s = {100 * cached / first:.1f}% of the first run (goal < 5%)")
    print_where_time_went(manifest, len(MODELS))


if __name__ == "__main__":
    main()
