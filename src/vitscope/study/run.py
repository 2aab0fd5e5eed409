"""Run a study: every model once over each (dataset, view) pass its analyses need, every analysis fed from
those passes; then the pair stages (two related models at once), the cross-model stage, tables and report.

The plan (`study/plan.py`) is made before any model loads. For each model the runner looks up every analysis
in the cache (`study/cache.py`): finished ones are read back without loading the model; unfinished ones
resume from their last saved chunk; new ones start at the first. A dataset's images are cut into fixed
chunks of ``batch_size`` image ids (one forward batch each), so batches, resumes and shards group images
identically whatever happened before (an unreadable image leaves its chunk one image shorter, in every
run). Under torchrun the chunks are split into contiguous shards whose boundaries are multiples of every
batch size in play, and of whole units (videos) where the dataset has them; shards' states are merged
with the same `merge` that resume uses. A run directory holds:
  results/<analysis>.parquet   tidy tables (model, analysis, metric, layer, head, token_view, value, ...)
  manifest.json                config, versions, model digests, load reports, timings, skipped images
  config.yaml, report.html

This module is the run loop; the rest lives beside it: `keys` (the cache keys and the sources: datasets, their
selected ids and chunks), `pool` (the models, each loaded once), `passes` (a model's streamed passes), `stages`
(the pair stages and the cross-model stage) and `tables` (the results tables in the run directory).
"""

from __future__ import annotations

import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from vitscope.errors import StudyInterrupted, WorkerDied
from vitscope.files import write_atomic
from vitscope.models.adapter import ModelInfo
from vitscope.study import helper as helpers
from vitscope.study import rundir
from vitscope.study.cache import Cache, default_cache_dir, digest, model_folders
from vitscope.study.config import StudyConfig, preflight, to_yaml
from vitscope.study.cost import announce
from vitscope.study.distributed import Dist

# the stages' modules, under the names they had here (`study/helper.py`, tests and benchmarks import them from here)
from vitscope.study.keys import Source, balanced_ids, check_batch_sizes, index_labels  # noqa: F401 - re-exported
from vitscope.study.keys import analysis_key as _analysis_key
from vitscope.study.keys import dataset_summary as _dataset_summary
from vitscope.study.keys import model_key as _model_key
from vitscope.study.keys import select_ids as _select_ids  # noqa: F401 - re-exported
from vitscope.study.keys import shard_ids as _shard  # noqa: F401 - re-exported
from vitscope.study.keys import source as _source
from vitscope.study.passes import KEPT, Job
from vitscope.study.passes import pass_batches as _pass_batches  # noqa: F401 - re-exported
from vitscope.study.passes import run_model as _run_model
from vitscope.study.plan import AnalysisPlan, Plan, label_of, make_plan
from vitscope.study.pool import ModelPool as _ModelPool
from vitscope.study.stages import cross_stage
from vitscope.study.stages import run_pair as _run_pair
from vitscope.study.tables import config_key as _config_key
from vitscope.study.tables import report_is_of as _report_is_of
from vitscope.study.tables import tables_match as _tables_match
from vitscope.study.tables import write_tables as _write_tables
from vitscope.threads import one_thread


def run_study(cfg: StudyConfig, on_batch: Callable[[str, int], None] | None = None, overwrite: bool = False,
              models: tuple[int, int] | None = None) -> Path:
    """Run (or resume, or read back) the study; returns the run directory. ``on_batch(model, i)`` is called
    after each batch (tests use it to interrupt a run). A directory holding another config's results is
    refused unless ``overwrite``. Ctrl-C raises `StudyInterrupted`, saying what the cache holds.

    ``models=(k, n)``: only slice k of n of the models (`config.slice_models`, round-robin) into the cache, for
    jobs on several machines sharing one cache; such a run writes nothing into the run directory and takes
    no lock on it, and leaves the pair stages, the cross-model stage, the tables and the report to a run
    without ``models``, which reads every sliced model back from the cache (docs/CLUSTER.md)."""
    progress: dict[str, Any] = {}
    try:
        if models is not None:
            return _run_slice(cfg, models, on_batch, progress)
        return _locked_run(cfg, on_batch, overwrite, progress)
    except KeyboardInterrupt as e:
        if isinstance(e, StudyInterrupted):
            raise
        raise StudyInterrupted(f"interrupted: {_what_is_saved(cfg, progress)}") from None
    except (WorkerDied, RuntimeError) as e:  # a reading worker died: the pass saved its partial states as it
        # died (`passes.run_model`); said as after Ctrl-C (its SIGCHLD error can surface outside the reading loop)
        from vitscope.data.pipeline import worker_death

        died = e if isinstance(e, WorkerDied) else worker_death(e, "during a pass")
        if died is None:
            raise
        raise WorkerDied(f"{died}; {_what_is_saved(cfg, progress)}") from None


def _what_is_saved(cfg: StudyConfig, progress: dict[str, Any]) -> str:
    """What the cache keeps when a run dies (Ctrl-C, a stop signal, a reading worker killed), as the rest of one
    sentence: how many of the study's models have every analysis in the cache, which hold partial states, and
    that the same command resumes (a pass saves its partial states when it dies)."""
    resume = "rerun the same command to resume from there"
    if "sources" not in progress:
        return "no model had run yet, so nothing was computed"
    plan, sources, cache = progress["plan"], progress["sources"], progress["cache"]
    done, partial = [], []
    try:
        for mc in plan.models:
            mkey = _model_key(mc, sources)[1]
            if not (cache.root / mkey).is_dir():  # nothing of it yet (and `cache.path` would create the folder)
                continue
            paths = [(cache.path(mkey, ap.name, k), cache.path(mkey, ap.name, k, (0, 1)))
                     for ap in plan.single_of(label_of(mc)) for k in [_analysis_key(mkey, ap, sources, cfg)]]
            if all(final.is_file() for final, _ in paths):
                done.append(label_of(mc))
            elif any(final.is_file() or part.is_file() for final, part in paths):
                images = sum(KEPT.get(mkey, {}).values())
                partial.append(label_of(mc) + (f" ({images:,} images of its passes kept)" if images else ""))
    except Exception:  # noqa: BLE001 - the message must not fail: say the general case
        return f"what was finished is in the cache ({cache.root}): {resume}"
    said = f"{len(done)} of {len(plan.models)} models' results are in the cache ({cache.root})"
    if partial:
        said += f", with partial states of {', '.join(partial)}"
    if len(done) == len(plan.models):
        said += f" (the {'report was' if progress.get('tables') else 'tables and report were'} not written)"
    return f"{said}; {resume}"


def _locked_run(cfg: StudyConfig, on_batch: Callable[[str, int], None] | None, overwrite: bool,
                progress: dict[str, Any]) -> Path:
    preflight(cfg)  # one-sentence errors about the config, device, files and directories before any model loads
    dist = Dist.from_env()
    cfg.device = dist.device(cfg.device)  # torchrun on several GPUs: a bare `cuda` is each rank's own
    out = Path(cfg.output_dir)
    lock = rundir.hold(out) if dist.is_main else None  # one writer per run directory, for the whole run
    try:
        return _run_study(cfg, dist, out, on_batch, overwrite, progress)
    finally:
        if lock is not None:
            lock.release()


def _run_slice(cfg: StudyConfig, models: tuple[int, int], on_batch: Callable[[str, int], None] | None,
               progress: dict[str, Any]) -> Path:
    """Slice ``models`` of the study's models into the cache, each model exactly as a full run computes it
    (`_run_model`, also under torchrun); nothing is written into the run directory."""
    from vitscope.study.config import slice_models

    preflight(cfg)
    k, n = models
    mine = {label_of(m) for m in slice_models(cfg.models, k, n)}
    dist = Dist.from_env()
    cfg.device = dist.device(cfg.device)
    out = Path(cfg.output_dir)
    plan = make_plan(cfg)
    cache = Cache(Path(cfg.cache_dir or default_cache_dir(out)))
    sources = {name: _source(name, dc, cfg, plan, dist) for name, dc in plan.datasets.items()}
    progress.update(plan=plan, sources=sources, cache=cache)
    announce(cfg, plan, sources, cache, dist, mine)
    single = [ap for ap in plan.analyses if not ap.pair]
    pool = _ModelPool(cfg, plan, sources)
    for mc in plan.models:
        if label_of(mc) in mine:
            _run_model(cfg, mc, label_of(mc), single, sources, cache, dist, pool, on_batch)
            pool.clear()
    _say(cfg, dist, f"slice {k}/{n}: {len(mine)} of {len(plan.models)} models in the cache ({cache.root}); "
                    "a run without --models writes the tables and the report")
    return out


def _run_study(cfg: StudyConfig, dist: Dist, out: Path, on_batch: Callable[[str, int], None] | None,
               overwrite: bool, progress: dict[str, Any]) -> Path:
    plan = make_plan(cfg)
    config_key = _config_key(cfg)
    cache_root = Path(cfg.cache_dir or default_cache_dir(out))
    # the cache's folders are vitscope's own, also where the cache is the run directory itself
    keep = (cache_root, *(model_folders(cache_root) if cache_root.resolve() == out.resolve() else ()))
    claimed = rundir.claim(out, config_key, overwrite, keep=keep) if dist.is_main else {}
    cache = Cache(cache_root)
    sources = {name: _source(name, dc, cfg, plan, dist) for name, dc in plan.datasets.items()}
    check_batch_sizes(cfg, plan, sources, dist.world)
    progress.update(plan=plan, sources=sources, cache=cache)  # what Ctrl-C reports on
    announce(cfg, plan, sources, cache, dist)  # the cost, and a batch too large for the device refused
    manifest: dict[str, Any] = {
        "config": asdict(cfg), "config_key": config_key, "versions": _versions(), "world_size": dist.world,
        "dataset": _dataset_summary(next(iter(sources.values()))),
        "datasets": {n: _dataset_summary(s) for n, s in sources.items()},
        "models": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    t_study = time.perf_counter()
    frames: dict[str, list[pd.DataFrame]] = defaultdict(list)
    by_analysis: dict[str, list[Any]] = defaultdict(list)
    pool = _ModelPool(cfg, plan, sources)
    infos: dict[str, ModelInfo] = {}
    mkeys: dict[str, str] = {}
    single = [ap for ap in plan.analyses if not ap.pair]
    helper = _start_helper(cfg, plan, single, sources, cache, dist, on_batch)
    # two processes of one thread each (study/helper.py), in every pool: a probe's BLAS threads would spin
    restore_threads = one_thread() if helper is not None else None

    def release_helper() -> None:  # the helper's work is done or abandoned: all threads back to this process
        nonlocal helper
        if helper is not None:
            helper.close()
            helper = None
            if restore_threads is not None:
                restore_threads()

    done: dict[str, tuple[list[Job], dict[str, Any]]] = {}  # label -> (its jobs, its manifest entry)
    paired: dict[tuple[str, str, str], Job] = {}  # (analysis, a, b) -> the pair stage's job

    def step(mc: Any, helped: dict[str, Any] | None) -> None:
        """One model: computed here, or read back from the cache where the helper computed it (``helped``: its
        timings); then the pair stages whose two models have both passed."""
        label = label_of(mc)
        t0 = time.perf_counter()
        info, jobs, mmeta = _run_model(cfg, mc, label, single, sources, cache, dist, pool, on_batch)
        infos[label], mkeys[label] = info, mmeta["model_key"]
        seconds = round(time.perf_counter() - t0, 2)
        if helped is not None:  # computed in this run by the helper, read back here
            for job in jobs:
                job.meta["from_cache"] = False
            mmeta = {**mmeta, "timings": helped["timings"], "helper_process": True}
            seconds = helped["seconds"]
        done[label] = jobs, {**mmeta, "seconds": seconds,
                             "analyses_from_cache": [j.name for j in jobs if j.meta.get("from_cache")]}
        for ap in plan.analyses:  # pair stages of this model: as soon as both of its models have passed
            for a, b in ap.pairs:  # (a pair may name its models in either order of the study's)
                if label in (a, b) and a in infos and b in infos:
                    paired[(ap.name, a, b)] = _run_pair(cfg, ap, a, b, infos, mkeys, sources, cache, dist, pool,
                                                        on_batch)
        pool.done_with(label)

    try:
        # this process's own models first (those of pair stages, and those already cached), then it claims from
        # the list it shares with the helper until all are claimed, then reads back what the helper computed:
        # whoever is free takes the next model (tables and manifest are assembled in study order below)
        shared = helper.labels if helper is not None else []
        for mc in plan.models:
            if label_of(mc) not in shared:
                step(mc, None)
        if helper is not None:
            mine: set[str] = set()
            while (label := helper.claim()) is not None:
                mine.add(label)
                step(pool.by_label[label], None)
                for lab in helper.finished():  # read back while the helper still computes, not all at the end
                    if lab not in done:
                        step(pool.by_label[lab], helper.wait_for(lab))
            for label in helper.claimed_by_helper(mine):
                if label not in done:  # None from wait_for: the helper failed, the model is computed here
                    step(pool.by_label[label], helper.wait_for(label))
    finally:
        release_helper()
    order = [label_of(m) for m in plan.models]
    for label in order:  # in study order, whichever process computed what: each model, then the pair stages
        jobs, manifest["models"][label] = done[label]  # that follow its pass (the later of their two models)
        for job in jobs:
            frames[job.name].append(job.frame)
            by_analysis[job.name].append(job.analysis)
        for (name, a, b), job in paired.items():
            if max(order.index(a), order.index(b)) == order.index(label):
                frames[name].append(job.frame)
                by_analysis[name].append(job.analysis)
    for (name, a, b), job in paired.items():
        manifest["models"][b].setdefault("pairs", {})[f"{name}:{a}"] = {"from_cache": job.meta.get("from_cache",
                                                                                                   False)}
    pool.clear()
    manifest["seconds"] = round(time.perf_counter() - t_study, 2)
    manifest["skipped_images"] = {n: sorted([p, r] for p, r in s.skipped.items()) for n, s in sources.items()
                                  if s.skipped}
    if not dist.is_main:
        dist.barrier()
        return out
    n_jobs = sum(len(m["analyses_from_cache"]) for m in manifest["models"].values())
    total = sum(len(plan.single_of(label_of(m))) for m in plan.models)  # each analysis on its `models`
    manifest["analyses_read_from_cache"] = [n_jobs, total]
    # what the tables were computed from: the config, the models and every analysis's version (a new version
    # of an analysis makes the tables written by the old one stale, even when its states come from the cache)
    results_key = digest(config_key, sorted(mkeys.values()),
                         sorted((ap.name, ap.cls.state_version) for ap in plan.analyses))
    previous = claimed
    pairs_cached = all(p["from_cache"] for m in manifest["models"].values() for p in m.get("pairs", {}).values())
    unchanged = n_jobs == total and pairs_cached and previous.get("results_key") == results_key \
        and previous.get("report_done") and (out / "report.html").is_file() and _tables_match(out, frames) \
        and _report_is_of(out)
    if total:
        _say(cfg, dist, f"{n_jobs} of {total} analyses (models x analyses) read from the cache")
    timings: dict[str, Any] = {}
    if unchanged:
        _say(cfg, dist, f"results and report unchanged: {out} already holds this study's tables and report")
    else:
        _say(cfg, dist, f"cross-model stage and tables: {len(by_analysis)} analyses")
        t0 = time.perf_counter()
        epochs = {label_of(m): m.epoch for m in plan.models if m.epoch is not None}
        cross_stage(by_analysis, frames)
        manifest["results_files"] = _write_tables(out, frames, epochs, previous)
        progress["tables"] = True
        timings["cross_and_tables"] = round(time.perf_counter() - t0, 2)
    manifest.setdefault("results_files", previous.get("results_files", []))
    manifest["results_key"] = results_key
    manifest["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    manifest["report_done"] = bool(unchanged)
    rundir.write_json(out / rundir.MANIFEST, manifest)
    write_atomic(out / "config.yaml", lambda f: f.write(to_yaml(cfg).encode()))
    if not unchanged:  # a fully cached rerun of the same study leaves results and report as they are
        from vitscope.report import write_report

        _say(cfg, dist, f"report: {len(frames)} tables")
        t0 = time.perf_counter()
        write_report(out)
        timings["report"] = round(time.perf_counter() - t0, 2)
        manifest["timings"] = timings
        manifest["report_done"] = True
        rundir.write_json(out / rundir.MANIFEST, manifest)
    dist.barrier()
    return out


def _start_helper(cfg: StudyConfig, plan: Plan, single: list[AnalysisPlan], sources: dict[str, Source], cache: Cache,
                  dist: Dist, on_batch: Callable[[str, int], None] | None) -> helpers.Helper | None:
    """A helper process sharing the list of models with work left with this process, where it pays
    (`vitscope.study.helper`); one started early by `vitscope run` is used, or dismissed when none pays."""
    if dist.world > 1 or on_batch is not None or not single:
        helpers.dismiss()
        return None
    pending = []
    for mc in plan.models:
        _spec, mkey = _model_key(mc, sources)
        if any(not cache.path(mkey, ap.name, _analysis_key(mkey, ap, sources, cfg)).is_file()
               for ap in plan.single_of(label_of(mc))):
            pending.append(label_of(mc))
    labels = helpers.delegated(plan, sources, pending)
    if not labels:
        helpers.dismiss()  # one started early by `vitscope run`, not needed
        return None
    _say(cfg, dist, f"a helper process shares {len(labels)} of the {len(pending)} models with this one: "
                    f"{', '.join(labels)}")
    return helpers.start(cfg, labels)


def _versions() -> dict[str, str]:
    import timm

    from vitscope import __version__

    return {"vitscope": __version__, "torch": torch.__version__, "timm": timm.__version__,
            "python": platform.python_version()}


def _say(cfg: StudyConfig, dist: Dist, msg: str) -> None:
    """One progress line on stderr (beside the per-model bars; off with -q / progress=false)."""
    if cfg.progress and dist.is_main:
        print(msg, file=sys.stderr, flush=True)
