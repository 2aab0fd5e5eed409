"""The input pipeline (`vitscope.data.pipeline`): reading, decoding, resizing, cropping, normalising and a view
in worker processes, measured on generated high-resolution JPEGs (half 500x375, half 854x480, an imagefolder
in a temporary folder).

Prints, from one run:
1. the pipeline alone, exactly as a study pass runs it (`study.run._pass_batches`: chunks of ``--batch`` ids,
   ViT-S/16's preprocessing at 224 px, the view ``band_noise:band=3``), in images/s for 0, 1 and 2 workers,
   the ratio 2 workers / 0 workers (goal >= 1.7x on a quiet 2-core machine) and the milliseconds per image of
   one worker;
2. a study of ViT-S/16 at 224 px (pretrained=False) with attention_distance + cka + semantics on the same
   JPEGs (default `num_workers`), against the bare forwards of the same images (`benchmarks/study.py`'s
   `bare_forward_seconds`: fused attention, the images loaded before the clock starts): the study's pass
   and the whole study (finalize and report included) / bare forwards (goal for the pass: <= 1.15x), and the
   pass with ``num_workers=0`` for comparison.

    python benchmarks/pipeline.py [--images 240] [--study-images 192] [--batch 32] [--skip-study]
"""

from __future__ import annotations  # noqa: I001 - vitscope is imported before numpy and torch, on purpose

import argparse
import functools
import json
import resource
import os
import sys
import tempfile
import time
from pathlib import Path

import vitscope as vs  # first, as the `vitscope` command does: torch's OpenMP threads then wait passively

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import bare_forward_seconds, print_where_time_went  # noqa: E402

from vitscope.data.catalog import build_dataset  # noqa: E402
from vitscope.data.pipeline import Chunks  # noqa: E402
from vitscope.study import load_config, run_study  # noqa: E402
from vitscope.study.config import DatasetConfig  # noqa: E402
from vitscope.study.run import Source, _pass_batches  # noqa: E402

SIZES = ((500, 375), (854, 480))  # (width, height)
VIEW = "band_noise:band=3"
MODEL = ("vit_small_patch16_224", "vit-s16", {})


def _jpeg(job: tuple[Path, int, int, tuple[int, int]]) -> None:
    """One photograph-like JPEG (smooth colour fields with fine texture, quality 90), drawn from (seed, its index)."""
    from PIL import Image

    path, seed, i, (w, h) = job
    rng = np.random.default_rng([seed, i])
    coarse = Image.fromarray(rng.integers(0, 255, (h // 32 + 1, w // 32 + 1, 3), dtype=np.uint8)).resize(
        (w, h), Image.BICUBIC)
    img = np.asarray(coarse, dtype=np.int16) + rng.integers(-20, 21, (h, w, 3), dtype=np.int16)
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def write_jpegs(root: Path, n: int, seed: int = 0, sizes: tuple[tuple[int, int], ...] = SIZES) -> float:
    """``n`` JPEGs in two classes (an ImageFolder), image i of size ``sizes[i % len(sizes)]`` drawn from
    (``seed``, i), so any number of processes writes the same files: every core writes them (benchmarks/device.py
    writes 10,000). Returns the seconds it took."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    jobs = []
    for i in range(n):
        folder = root / ("a" if i % 4 < 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((folder / f"{i:05d}.jpg", seed, i, sizes[i % len(sizes)]))
    procs = max(1, min(os.cpu_count() or 1, 32))
    if procs == 1 or n < 64:
        for job in jobs:
            _jpeg(job)
    else:
        with mp.get_context("fork").Pool(procs) as pool:
            pool.map(_jpeg, jobs, chunksize=max(1, n // (4 * procs)))
    return time.perf_counter() - t0


def _cpu_seconds() -> float:
    """CPU time of this process and of its ended children (the workers, once the pass has shut them down)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def pipeline_rate(root: Path, n: int, batch: int, workers: int, pre) -> tuple[float, float]:  # noqa: ANN001
    """Images per second through the study's pass iterator (read, decode, resize, crop, normalise, the view),
    and the CPU milliseconds per image it took (this process and the workers together)."""
    ds = build_dataset(DatasetConfig(name="imagefolder", root=str(root), n_images=n))
    ids = list(range(len(ds)))
    src = Source("jpegs", ds, [ids[i:i + batch] for i in range(0, len(ids), batch)], "")
    t0, c0 = time.perf_counter(), _cpu_seconds()
    seen = sum(len(b) for b in _pass_batches(src, VIEW, pre, 0, 0, None, workers, torch.device("cpu"))
               if b is not None)
    assert seen == len(ids)
    return seen / (time.perf_counter() - t0), 1000 * (_cpu_seconds() - c0) / seen


def _read_chunks(chunks: Chunks, ks: range) -> None:
    torch.set_num_threads(1)
    for k in ks:
        chunks[k]


def machine_ceiling(root: Path, n: int, batch: int, pre) -> tuple[float, float]:  # noqa: ANN001
    """The same reading (and view) with no pipeline at all: all chunks in this process on one thread, then split
    between two forked processes (no queue, no copy back): seconds per image of each. Their ratio is what two
    workers could gain over one reader on this machine at best (memory bandwidth and shared caches included)."""
    import multiprocessing as mp

    from vitscope.data.views import apply_view

    ds = build_dataset(DatasetConfig(name="imagefolder", root=str(root), n_images=n))
    view = functools.partial(apply_view, spec=VIEW, mean=pre.mean, std=pre.std, seed=0, inplace=True)
    chunks = Chunks(ds, [list(range(i, min(i + batch, n))) for i in range(0, n, batch)], pre, view)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    _read_chunks(chunks, range(len(chunks)))
    one = time.perf_counter() - t0
    torch.set_num_threads(threads)
    procs = [mp.get_context("fork").Process(target=_read_chunks, args=(chunks, range(i, len(chunks), 2)))
             for i in range(2)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return one / n, (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=240, help="JPEGs for the pipeline alone")
    ap.add_argument("--study-images", type=int, default=192, help="of them, how many the study reads")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-study", action="store_true")
    args = ap.parse_args()
    pre = vs.load_model(MODEL[0], pretrained=False).preprocessing
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jpegs"
        write_jpegs(root, args.images)
        pipeline_rate(root, 2 * args.batch, args.batch, 0, pre)  # warm: imports, page cache
        rates = {w: pipeline_rate(root, args.images, args.batch, w, pre) for w in (0, 1, 2)}
        print(f"input pipeline alone: {args.images} JPEGs ({' and '.join(f'{w}x{h}' for w, h in SIZES)}), "
              f"224 px, view {VIEW}, batch {args.batch}, {torch.get_num_threads()} torch threads here")
        for w, (r, cpu) in rates.items():
            print(f"  num_workers={w}: {r:7.1f} images/s ({1000 / r:.2f} ms per image; CPU {cpu:.2f} ms per image, "
                  "this process and its workers)")
        print(f"  2 workers / 0 workers: {rates[2][0] / rates[0][0]:.2f}x (goal on a quiet 2-core machine: >= 1.7x; "
              f"the CPU time per image: {rates[2][1] / rates[0][1]:.2f}x)")
        print(f"  one worker: {1000 / rates[1][0]:.2f} ms per image (in this process: {1000 / rates[0][0]:.2f} ms)")
        one, two = machine_ceiling(root, args.images, args.batch, pre)
        print(f"  the same reading with no pipeline (forked processes, nothing sent back): one process on one thread "
              f"{1000 * one:.2f} ms per image, two processes {1000 * two:.2f} ms per image: {one / two:.2f}x; the best "
              f"2 workers could do against num_workers=0 here: {1000 / rates[0][0] / (1000 * two):.2f}x")
        if args.skip_study:
            return
        n = min(args.study_images, args.images)
        study = Path(tmp) / "study.yaml"
        study.write_text(f"models:\n  - {{name: {MODEL[0]}, label: {MODEL[1]}, pretrained: false}}\n"
                         f"dataset: {{name: imagefolder, root: {root}, n_images: {n}}}\n"
                         "analyses:\n  attention_distance: {}\n  cka: {}\n  semantics: {}\n"
                         f"batch_size: {args.batch}\nprogress: false\n")
        ds = build_dataset(DatasetConfig(name="imagefolder", root=str(root), n_images=n))
        from vitscope.study.run import _select_ids

        work = [((ds, _select_ids(ds, n)), args.batch)]
        bare_before = bare_forward_seconds([MODEL], work, pretrained=False)
        runs = {}
        for label, over in (("default", []), ("num_workers=0", ["num_workers=0"])):
            out = Path(tmp) / label
            t0 = time.perf_counter()
            run_dir = run_study(load_config(study, [f"output_dir={out}", f"cache_dir={out}-cache", *over]))
            wall = time.perf_counter() - t0
            manifest = json.loads((run_dir / "manifest.json").read_text())
            runs[label] = (wall, manifest)
        bare_after = bare_forward_seconds([MODEL], work, pretrained=False)
        bare = (bare_before + bare_after) / 2
        print(f"study: {MODEL[1]} at 224 px (pretrained=False), {n} of the JPEGs, attention_distance + cka + "
              f"semantics, batch {args.batch}")
        print(f"  bare forwards: {bare:.2f} s (mean of {bare_before:.2f} s before and {bare_after:.2f} s after)")
        for label, (wall, manifest) in runs.items():
            t = next(iter(manifest["models"].values()))["timings"]
            print(f"  {label:14s} pass {t['pass']:.2f} s = {t['pass'] / bare:.2f}x the bare forwards (goal <= 1.15x); "
                  f"whole study {wall:.2f} s = {wall / bare:.2f}x")
        print_where_time_went(runs["default"][1], 1)


if __name__ == "__main__":
    main()
