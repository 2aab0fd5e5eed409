"""Run a study: every model once over the dataset, every analysis fed from that one pass.

For each model the planner looks up every requested analysis in the cache (`study/cache.py`): finished
ones are read back without loading the model; unfinished ones resume from their last saved batch; new ones
start at the first. One pass then runs from the earliest batch anyone needs, feeding each analysis only
the batches it has not seen. Under torchrun the images are split into contiguous shards (aligned to every
CKA batch size, so shards group images exactly as one process would), and the shards' states are merged
with the same `merge` that resume uses. A run directory holds:
  results/<analysis>.parquet   tidy tables (model, analysis, metric, layer, head, token_view, value, ...)
  manifest.json                config, versions, model digests, load reports, timings, skipped images
  config.yaml, report.html
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from vitscope.analyses import Analysis, get_analysis
from vitscope.capture import stream
from vitscope.data import make_dataset
from vitscope.files import write_atomic
from vitscope.models import load_model
from vitscope.models.adapter import ModelInfo
from vitscope.models.load import resolve_spec
from vitscope.study.cache import Cache, default_cache_dir, digest, model_key
from vitscope.study.config import ModelConfig, StudyConfig, preflight, to_yaml
from vitscope.study.distributed import Dist

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One analysis of one model: where its cache entries live and how far it got."""

    name: str
    params: dict[str, Any]
    key: str
    final: Path
    part: Path
    analysis: Analysis | None = None
    done: int = 0  # batches of this shard already fed
    finished: bool = False
    frame: pd.DataFrame | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def run_study(cfg: StudyConfig, on_batch: Callable[[str, int], None] | None = None) -> Path:
    """Run (or resume, or read back) the study; returns the run directory. ``on_batch(model, i)`` is called
    after each batch (tests use it to interrupt a run)."""
    preflight(cfg)  # one-sentence errors about the config, device, files and directories before any model loads
    dist = Dist.from_env()
    out = Path(cfg.output_dir)
    cache = Cache(cfg.cache_dir or default_cache_dir(out))
    dataset = make_dataset(cfg.dataset)
    if len(dataset) == 0:
        raise ValueError(f"dataset {dataset.name!r} has no images")
    frames: dict[str, list[pd.DataFrame]] = defaultdict(list)
    by_analysis: dict[str, list[Analysis]] = defaultdict(list)
    manifest: dict[str, Any] = {
        "config": asdict(cfg), "versions": _versions(), "world_size": dist.world,
        "dataset": {"name": dataset.name, "n_images": len(dataset)}, "models": {},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    t_study = time.perf_counter()
    for mc in cfg.models:
        label = mc.label or mc.name
        t0 = time.perf_counter()
        info, jobs, mmeta = _run_model(cfg, mc, label, dataset, cache, dist, on_batch)
        for job in jobs:
            frames[job.name].append(job.frame)
            by_analysis[job.name].append(job.analysis)
        manifest["models"][label] = {**mmeta, "seconds": round(time.perf_counter() - t0, 2),
                                     "analyses_from_cache": [j.name for j in jobs if j.meta.get("from_cache")]}
    manifest["seconds"] = round(time.perf_counter() - t_study, 2)
    manifest["skipped_images"] = [list(map(str, s)) for s in getattr(dataset, "skipped", [])]
    if not dist.is_main:
        dist.barrier()
        return out
    (out / "results").mkdir(parents=True, exist_ok=True)
    all_cached = all(m["analyses_from_cache"] == list(cfg.analyses) for m in manifest["models"].values())
    results_key = digest(asdict(cfg), sorted(m["model_key"] for m in manifest["models"].values()))
    previous = out / "manifest.json"
    unchanged = all_cached and previous.is_file() and (out / "report.html").is_file() and \
        json.loads(previous.read_text()).get("results_key") == results_key
    timings: dict[str, Any] = {}
    if not unchanged:
        t0 = time.perf_counter()
        for name, group in by_analysis.items():  # the cross-model stage, from the per-model states
            cross = type(group[0]).cross(group)
            if cross is not None and len(cross):
                frames[name].append(cross)
        for name, parts in frames.items():
            parts = [p for p in parts if p is not None and len(p)]
            if parts:
                table = pd.concat(parts, ignore_index=True)
                write_atomic(out / "results" / f"{name}.parquet", lambda f, t=table: t.to_parquet(f, index=False))
        timings["cross_and_tables"] = round(time.perf_counter() - t0, 2)
    manifest["results_key"] = results_key
    manifest["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_atomic(out / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=2, default=str).encode()))
    write_atomic(out / "config.yaml", lambda f: f.write(to_yaml(cfg).encode()))
    if not unchanged:  # a fully cached rerun of the same study leaves results and report as they are
        from vitscope.report import write_report

        t0 = time.perf_counter()
        write_report(out)
        timings["report"] = round(time.perf_counter() - t0, 2)
        manifest["timings"] = timings
        write_atomic(out / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=2, default=str).encode()))
    dist.barrier()
    return out


def _run_model(cfg: StudyConfig, mc: ModelConfig, label: str, dataset: Any, cache: Cache, dist: Dist,
               on_batch: Callable[[str, int], None] | None) -> tuple[ModelInfo, list[Job], dict[str, Any]]:
    spec = resolve_spec(mc.name)
    mkey = model_key(spec, mc.weights, mc.pretrained, mc.checkpoint_format, mc.seed, dict(mc.kwargs))
    dkey = digest(asdict(cfg.dataset))
    shard = (dist.rank, dist.world)
    jobs = []
    for name, params in cfg.analyses.items():
        params = dict(params or {})
        akey = digest(mkey, dkey, name, get_analysis(name).state_version, params, cfg.dtype)
        jobs.append(Job(name, params, akey, cache.path(mkey, name, akey), cache.path(mkey, name, akey, shard)))
    info: ModelInfo | None = None
    trained = bool(mc.weights) or (mc.pretrained and spec.weights.kind != "none")
    mmeta: dict[str, Any] = {"source": mc.name, "model_key": mkey,
                             "supervision": spec.supervision if trained else "random init",
                             "objective_family": spec.family if trained else "none"}
    for job in jobs:  # finished entries: no model needed
        entry = cache.load(job.final)
        if entry is not None and entry.get("finished"):
            info = ModelInfo(**{**entry["info"], "name": label})
            job.analysis = get_analysis(job.name)(info, **job.params)
            job.analysis.load_state_dict(entry["state"])
            job.analysis.model_name = label
            job.finished, job.meta = True, {"from_cache": True}
            job.frame = _relabel(entry.get("frame"), entry.get("label"), label)
            mmeta.update(entry.get("model_meta", {}))
    todo = [j for j in jobs if not j.finished]
    timings: dict[str, Any] = {}
    if todo:
        t0 = time.perf_counter()
        vm = load_model(mc.name, weights=mc.weights, pretrained=mc.pretrained,
                        checkpoint_format=mc.checkpoint_format, seed=mc.seed, device=cfg.device, **mc.kwargs)
        vm.name = label
        info = vm.info()
        mmeta.update({"weights_digest": vm.weights_digest, "family": vm.family, "depth": vm.depth,
                      "heads": vm.num_heads, "grid": list(vm.grid_size), "patch": vm.patch_size,
                      "prefix_tokens": vm.num_prefix_tokens,
                      "load_report": vm.load_report.summary() if vm.load_report else "random initialisation"})
        for job in todo:
            job.analysis = get_analysis(job.name)(vm, **job.params)
            part = cache.load(job.part)
            if part is not None and part.get("batch_size") == cfg.batch_size:
                job.analysis.load_state_dict(part["state"])
                job.done = int(part["done"])
        timings["load"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        updates: dict[str, float] = {}
        _pass(cfg, vm, dataset, todo, cache, mkey, dist, on_batch, updates)
        timings["pass"] = round(time.perf_counter() - t0, 2)
        timings["pass_parts"] = {k: round(v, 4) for k, v in updates.items()}  # forward, and each update
        merged = dist.gather_states(todo)
        if dist.is_main:
            for job, parts in zip(todo, merged, strict=True):
                for state in parts[1:]:
                    other = get_analysis(job.name)(vm, **job.params)
                    other.load_state_dict(state)
                    job.analysis.merge(other)
                t0 = time.perf_counter()
                job.frame = job.analysis.finalize()  # once: a cached rerun reads the table back
                timings.setdefault("finalize", {})[job.name] = round(time.perf_counter() - t0, 2)
                with cache.lock(mkey):
                    cache.save(job.final, {"finished": True, "state": job.analysis.state_dict(),
                                           "info": asdict(info), "model_meta": mmeta, "params": job.params,
                                           "frame": job.frame, "label": label})
        dist.barrier()
        for job in todo:
            job.part.unlink(missing_ok=True)
            job.meta = {"from_cache": False}
        del vm
    for job in jobs:
        if job.frame is None and dist.is_main:
            job.frame = job.analysis.finalize()
    if timings:
        mmeta = {**mmeta, "timings": timings}
    return info, jobs, mmeta


def _relabel(frame: pd.DataFrame | None, old: str | None, new: str) -> pd.DataFrame | None:
    """A cached table under the label the model has in this study (labels are not part of the key)."""
    if frame is None or old is None:
        return None
    frame = frame.copy()
    for col in ("model", "model_b"):
        if col in frame.columns:
            frame.loc[frame[col] == old, col] = new
    return frame


def _shard_indices(n: int, cfg: StudyConfig, dist: Dist) -> list[int]:
    """Contiguous shards whose boundaries are multiples of every batch size in play (forward and CKA), so
    that sharded runs group images into exactly the same CKA batches as a single process."""
    if n > cfg.dataset.n_images:  # a real dataset larger than asked for: an even spread over it
        ids = [int(i) for i in torch.linspace(0, n - 1, cfg.dataset.n_images).round().long().tolist()]
    else:
        ids = list(range(n))
    n = len(ids)
    align = cfg.batch_size
    for params in cfg.analyses.values():
        bs = (params or {}).get("batch_size")
        if isinstance(bs, int) and bs > 0:
            align = math.lcm(align, bs)
    per = math.ceil(math.ceil(n / align) / dist.world) * align
    return ids[min(dist.rank * per, n):min((dist.rank + 1) * per, n)]


def _pass(cfg: StudyConfig, vm: Any, dataset: Any, jobs: list[Job], cache: Cache, mkey: str, dist: Dist,
          on_batch: Callable[[str, int], None] | None, timings: dict[str, float] | None = None) -> None:
    """`stream` from the earliest batch any job still needs, feeding each job only what it has not seen;
    partial states saved every ``save_every`` batches (or 2 minutes) and when the pass dies."""
    indices = _shard_indices(len(dataset), cfg, dist)
    start = min(j.done for j in jobs)
    if start >= math.ceil(len(indices) / cfg.batch_size):
        return
    seen = [j.done for j in jobs]
    last_save = time.monotonic()

    def save() -> None:
        for job, k in zip(jobs, seen, strict=True):
            job.done = k
        _save_parts(jobs, cache, mkey, cfg.batch_size)

    def after(b: int) -> None:
        nonlocal last_save
        if (b + 1) % cfg.save_every == 0 or time.monotonic() - last_save > 120:
            save()
            last_save = time.monotonic()
        if on_batch is not None:
            on_batch(vm.name, b)

    batches = dataset.batches(cfg.batch_size, vm.preprocessing, start=start * cfg.batch_size, indices=indices)
    try:
        stream(vm, batches, [j.analysis for j in jobs], dtype=cfg.dtype, progress=cfg.progress,
               total=len(indices) - min(start * cfg.batch_size, len(indices)), on_batch=after, first=start,
               seen=seen, desc=vm.name + (f" [{dist.rank}/{dist.world}]" if dist.world > 1 else ""),
               timings=timings)
    except BaseException:
        save()  # keep what is done: a rerun resumes from here
        raise
    for job, k in zip(jobs, seen, strict=True):
        job.done = k


def _save_parts(jobs: list[Job], cache: Cache, mkey: str, batch_size: int) -> None:
    with cache.lock(mkey):
        for job in jobs:
            if job.done > 0:
                cache.save(job.part, {"state": job.analysis.state_dict(), "done": job.done,
                                      "batch_size": batch_size})


def _versions() -> dict[str, str]:
    import timm

    from vitscope import __version__

    return {"vitscope": __version__, "torch": torch.__version__, "timm": timm.__version__,
            "python": platform.python_version()}
