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
"""

from __future__ import annotations

import functools
import logging
import math
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import PairAnalysis
from vitscope.capture import stream
from vitscope.data.base import batch_parts
from vitscope.data.catalog import build_dataset
from vitscope.data.views import CLEAN, apply_view
from vitscope.errors import ConfigError, InputError, StudyInterrupted
from vitscope.files import write_atomic
from vitscope.models import load_model
from vitscope.models.adapter import ModelInfo
from vitscope.models.load import file_given, resolve_spec
from vitscope.study import helper as helpers
from vitscope.study import rundir
from vitscope.study.cache import Cache, default_cache_dir, digest, model_key
from vitscope.study.config import StudyConfig, preflight, to_yaml
from vitscope.study.cost import announce
from vitscope.study.distributed import Dist
from vitscope.study.plan import AnalysisPlan, Plan, label_of, make_plan
from vitscope.threads import one_thread

log = logging.getLogger(__name__)

PassKey = tuple[str, str]  # (dataset name, view key)
#: partial states are saved at least this often during a pass (seconds) ...
SAVE_SECONDS = 10.0
#: ... unless saving takes long: then every SAVE_OVERHEAD times the last save's duration
SAVE_OVERHEAD = 5.0
#: per model key, per pass: the images whose batches this process saved (the Ctrl-C message reads it)
KEPT: dict[str, dict[str, int]] = {}


@dataclass
class Job:
    """One analysis of one model (or of one model pair): where its cache entries live and how far it got."""

    plan: AnalysisPlan
    key: str
    final: Path
    part: Path
    analysis: Any = None
    done: dict[str, int] = field(default_factory=dict)  # pass -> chunks of this shard already fed
    finished: bool = False
    frame: pd.DataFrame | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.plan.name


@dataclass
class Source:
    """A built dataset, its chunks for this shard and the images it could not read."""

    name: str
    dataset: Any
    chunks: list[list[int]]
    signature: str
    skipped: dict[str, str] = field(default_factory=dict)
    selection: str = ""  # digest of every rank's selected ids (in the analyses' cache keys)
    read_here: set[str] = field(default_factory=set)  # the skipped images this rank's own passes met
    offset: int = 0      # position of this shard's first id in the selection (torchrun; 0 in one process)
    n_selected: int = 0  # ids selected on every rank together
    selected: list[int] = field(default_factory=list)  # every rank's selected ids, in order (`_first_images`)
    config: str = ""     # digest of the dataset's config (in an ablated variant's model key)


def _pk(p: PassKey) -> str:
    return f"{p[0]}|{p[1]}"


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
        raise StudyInterrupted(_what_is_saved(cfg, progress)) from None


def _what_is_saved(cfg: StudyConfig, progress: dict[str, Any]) -> str:
    """One sentence after Ctrl-C: how many of the study's models have every analysis in the cache, which hold
    partial states, and that the same command resumes (a pass saves its partial states when it dies)."""
    resume = "rerun the same command to resume from there"
    if "sources" not in progress:
        return "interrupted before any model ran: nothing was computed yet"
    plan, sources, cache = progress["plan"], progress["sources"], progress["cache"]
    single = [ap for ap in plan.analyses if not ap.pair]
    done, partial = [], []
    try:
        for mc in plan.models:
            mkey = _model_key(mc, sources)[1]
            if not (cache.root / mkey).is_dir():  # nothing of it yet (and `cache.path` would create the folder)
                continue
            paths = [(cache.path(mkey, ap.name, k), cache.path(mkey, ap.name, k, (0, 1)))
                     for ap in single for k in [_analysis_key(mkey, ap, sources, cfg)]]
            if all(final.is_file() for final, _ in paths):
                done.append(label_of(mc))
            elif any(final.is_file() or part.is_file() for final, part in paths):
                images = sum(KEPT.get(mkey, {}).values())
                partial.append(label_of(mc) + (f" ({images:,} images of its passes kept)" if images else ""))
    except Exception:  # noqa: BLE001 - the message must not fail: say the general case
        return f"interrupted; what was finished is in the cache ({cache.root}): {resume}"
    said = f"{len(done)} of {len(plan.models)} models' results are in the cache ({cache.root})"
    if partial:
        said += f", with partial states of {', '.join(partial)}"
    if len(done) == len(plan.models):
        said += f" (the {'report was' if progress.get('tables') else 'tables and report were'} not written)"
    return f"interrupted: {said}; {resume}"


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
    claimed = rundir.claim(out, config_key, overwrite, keep=(cache_root,)) if dist.is_main else {}
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
    total = len(plan.models) * len(single)
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
        for name, group in by_analysis.items():  # the cross-model stage, from the per-model states
            cross = type(group[0]).cross(group)
            if cross is not None and len(cross):
                frames[name].append(cross)
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


# ---------------------------------------------------------------- output directory


def _config_key(cfg: StudyConfig) -> str:
    """What decides a run's results: the config without where it is written and how it reports progress."""
    d = asdict(cfg)
    for k in ("output_dir", "cache_dir", "progress", "save_every", "device"):
        d.pop(k, None)
    return digest(d)


def _write_tables(out: Path, frames: dict[str, list[pd.DataFrame]], epochs: dict[str, int],
                  previous: dict[str, Any]) -> list[str]:
    """Exactly this study's tables: written into a fresh folder that replaces ``results/`` as a whole (files there
    that vitscope did not write are kept: `rundir.swap_tables`). Returns the files written."""
    tables = {}
    for name, parts in frames.items():
        parts = [p for p in parts if p is not None and len(p)]
        if parts:
            df = pd.concat(parts, ignore_index=True)
            if epochs:
                df["epoch"] = df["model"].map(epochs).astype("Int64")
                if "model_b" in df.columns:
                    df["epoch_b"] = df["model_b"].map(epochs).astype("Int64")
            tables[f"{name}.parquet"] = df

    def write(folder: Path) -> None:
        for file, df in tables.items():
            df.to_parquet(folder / file, index=False)

    return rundir.swap_tables(out, write, list(tables), previous)


def _report_is_of(out: Path) -> bool:
    """report.html was drawn from exactly the tables in results/ (it records their digests)."""
    from vitscope.report.html import report_digest, results_digest

    return report_digest(out) == results_digest(out)


def _tables_match(out: Path, frames: dict[str, list[pd.DataFrame]]) -> bool:
    """The results folder holds exactly the tables this study writes (no leftovers of another config)."""
    have = {p.stem for p in (out / "results").glob("*.parquet")}
    want = {n for n, parts in frames.items() if any(p is not None and len(p) for p in parts)}
    return have == want or not want - have and have <= want


# ---------------------------------------------------------------- data


def _dataset_summary(src: Source) -> dict[str, Any]:
    return {"name": src.name, "format": getattr(src.dataset, "name", src.name),
            "n_images": src.n_selected, "available": len(src.dataset)}


def _source(name: str, dc: Any, cfg: StudyConfig, plan: Plan, dist: Dist) -> Source:
    ds = build_dataset(dc)
    if len(ds) == 0:
        raise InputError(f"dataset {name!r} ({dc.name}) has no images")
    ids = _select_ids(ds, dc.n_images)
    shard, offset = _shard(ids, ds, plan.align(name, cfg.batch_size), dist)
    chunks = [shard[i:i + cfg.batch_size] for i in range(0, len(shard), cfg.batch_size)]
    return Source(name, ds, chunks, digest(cfg.batch_size, shard), selection=digest(ids), offset=offset,
                  n_selected=len(ids), selected=list(ids), config=digest(asdict(dc)))


def check_batch_sizes(cfg: StudyConfig, plan: Plan, sources: dict[str, Source], world: int = 1) -> None:
    """Refuse, in one ConfigError sentence and before any model loads, a study with an analysis that needs at
    least ``min_batch`` images in every batch (stir's unbiased CKA: 4) whose selection leaves a batch with fewer,
    in one process or in any of ``world`` shards (every rank judges all shards, so all refuse alike); otherwise
    the pair stage would fail at that batch, after every model's pass."""
    for ap in plan.analyses:
        need = int(getattr(ap.cls, "min_batch", 0) or 0)
        name = ap.slots.get("data")
        if need <= 1 or name not in sources:
            continue
        src = sources[name]
        shards = [src.selected] if world <= 1 else \
            [_shard(src.selected, src.dataset, plan.align(name, cfg.batch_size), Dist(r, world))[0]
             for r in range(world)]
        sizes = [len(s[i:i + cfg.batch_size]) for s in shards for i in range(0, len(s), cfg.batch_size)]
        if sizes and min(sizes) < need:
            where = "" if world <= 1 else f" over {world} processes"
            raise ConfigError(
                f"analysis {ap.name!r} needs at least {need} images in every batch, but the {src.n_selected} images "
                f"of dataset {name!r} in batches of {cfg.batch_size}{where} leave a batch of {min(sizes)}: choose "
                f"batch_size (at least {need}) and n_images so that no batch holds fewer")


def _first_images(src: Source, pre: Any, batch_size: int) -> Callable[[int], Iterator[Any]]:
    """``n -> `` the clean batches of the first ``n`` selected images of ``src`` (every rank's selection, not
    this shard's: the same images on every rank), for `Analysis.prepare`."""
    def batches(n: int) -> Iterator[Any]:
        for b in src.dataset.batches(batch_size, pre, indices=list(src.selected[:n])):
            b.dataset, b.view = src.name, CLEAN
            yield b
    return batches


def _units(ds: Any, n: int) -> list[int] | None:
    bounds = getattr(ds, "unit_bounds", None)
    if bounds is None:
        return None
    starts = sorted({int(b) for b in bounds()} | {0})
    return [s for s in starts if s < n]


def _select_ids(ds: Any, n_images: int) -> list[int]:
    """All ids, or ``n_images`` of them: whole units (videos, pairs) from the first on; where the dataset knows
    its labels without reading an image (``index_labels()``), a class-balanced selection (`balanced_ids`);
    else an even spread. A pure function of the dataset and ``n_images``: every rank and rerun selects the
    same ids."""
    n = len(ds)
    if n <= n_images:
        return list(range(n))
    units = _units(ds, n)
    if units is not None:
        ends = [*units[1:], n]
        ids: list[int] = []
        for s, e in zip(units, ends, strict=True):
            if ids and len(ids) + (e - s) > n_images:
                break
            ids.extend(range(s, e))
        return ids
    labels = index_labels(ds)
    if labels is not None:
        return balanced_ids(labels, n_images)
    return _spread(n, n_images)


def _spread(n: int, k: int) -> list[int]:
    """``k`` of ``range(n)``, evenly spread, first and last included."""
    return [int(i) for i in torch.linspace(0, n - 1, k).round().long().tolist()] if k > 0 else []


def index_labels(ds: Any) -> list[int] | None:
    """The class of every id, where the dataset knows them from its index (``index_labels()``), else None."""
    fn = getattr(ds, "index_labels", None)
    labels = fn() if callable(fn) else None
    return None if labels is None or len(labels) != len(ds) else [int(v) for v in labels]


def balanced_ids(labels: Sequence[int], n_images: int) -> list[int]:
    """``n_images`` ids, as many of each class as it allows: every class gets the same share, a class with
    fewer images all of them and the rest goes to the others (the remainder one each to the largest classes,
    the lower class id first); within a class an even spread of its ids. Sorted."""
    by_class: dict[int, list[int]] = {}
    for i, c in enumerate(labels):
        by_class.setdefault(int(c), []).append(i)
    quota = {c: 0 for c in by_class}
    left, open_ = min(int(n_images), len(labels)), sorted(by_class)
    while left > 0 and open_:
        share = left // len(open_)
        if share == 0:  # fewer images left than classes: one each to the classes with the most ids left
            for c in sorted(open_, key=lambda c: (-(len(by_class[c]) - quota[c]), c))[:left]:
                quota[c] += 1
            break
        for c in list(open_):
            take = min(share, len(by_class[c]) - quota[c])
            quota[c] += take
            left -= take
            if quota[c] == len(by_class[c]):
                open_.remove(c)
    return sorted(i for c, members in by_class.items() for i in (members[j] for j in _spread(len(members), quota[c])))


def _shard(ids: list[int], ds: Any, align: int, dist: Dist) -> tuple[list[int], int]:
    """This rank's contiguous block of ``ids`` and the position of its first: boundaries at multiples of
    ``align`` positions, moved forward to the next unit start where the dataset has units, so no video or pair
    is split across ranks."""
    if dist.world == 1:
        return ids, 0
    n = len(ids)
    per = math.ceil(math.ceil(n / align) / dist.world) * align
    cuts = [min(r * per, n) for r in range(dist.world + 1)]
    units = _units(ds, len(ds))
    if units is not None:
        starts = {i for i in units}
        for r in range(1, dist.world):
            c = cuts[r]
            while 0 < c < n and ids[c] not in starts:
                c += 1
            cuts[r] = max(c, cuts[r - 1])
    return ids[cuts[dist.rank]:cuts[dist.rank + 1]], cuts[dist.rank]


def _set_positions(batch: Any, ids: list[int], first: int) -> None:
    """``extra['position']`` of every image of a chunk's batch: its place in the study's selection (the chunk
    starts at ``first``), the same in one process and in any shard, also when images of the chunk could not
    be read (CKA groups follow it: `analyses.similarity.GramGroups`). Left out where the batch's index is not
    the chunk's ids (tiles)."""
    where = {int(i): first + j for j, i in enumerate(ids)}
    for part in batch_parts(batch):
        index = [int(i) for i in part.index]
        if all(i in where for i in index):
            part.extra["position"] = torch.tensor([where[i] for i in index], dtype=torch.long)


def _pass_batches(src: Source, view: str, pre: Any, seed: int, start: int, timings: dict[str, float] | None,
                  num_workers: int | None = 0, device: torch.device | None = None) -> Iterator[Any]:
    """Chunks from ``start`` on as batches (one per chunk; a chunk none of whose images could be read
    yields an empty marker so chunk numbers stay aligned), read by ``num_workers`` processes (None: `auto_workers`;
    `vitscope.data.pipeline`), their images moved to ``device`` (pinned and non-blocking for a GPU), under
    ``view`` on that device: on a GPU here after the copy, on the CPU where the chunk is read (the workers)."""
    from vitscope.data.pipeline import auto_workers, chunk_batches

    workers = auto_workers(src.dataset) if num_workers is None else num_workers
    gpu = device is not None and device.type == "cuda"
    on_host = device is None or device.type == "cpu"
    size = len(src.chunks[0]) if src.chunks else 0
    viewed = None if view == CLEAN else functools.partial(apply_view, spec=view, mean=pre.mean, std=pre.std, seed=seed)
    chunks = chunk_batches(src.dataset, src.chunks, pre, start, workers, pin_memory=gpu,  # in the batch's buffer
                           transform=functools.partial(viewed, inplace=True) if on_host and viewed else None)
    try:
        for item in chunks:
            k, batch = item.k, item.batch
            for path, reason in getattr(src.dataset, "skipped", []):
                src.skipped.setdefault(str(path), str(reason))
                src.read_here.add(str(path))
            if batch is None:
                yield None
                continue
            batch.dataset, batch.view = src.name, view
            _set_positions(batch, src.chunks[k], src.offset + k * size)
            t0 = time.perf_counter()
            for part in batch_parts(batch):
                if not on_host:
                    part.images = part.images.to(device, non_blocking=gpu)
                    if viewed is not None:
                        part.images = viewed(part.images, part.index)
            if timings is not None and viewed is not None:  # on the host: the time the reader spent on it
                spent = item.transform_seconds if on_host else time.perf_counter() - t0
                timings[f"view {view}"] = timings.get(f"view {view}", 0.0) + spent
            yield batch
    finally:
        chunks.close()  # the workers end with the pass, also when it fails or is interrupted


def _device(vm: Any) -> torch.device:
    return next(vm.model.parameters()).device


# ---------------------------------------------------------------- models


class _ModelPool:
    """Models loaded once per study, released when no later stage needs them (at most the model in its pass
    and the other model of a pair stage that follows it)."""

    def __init__(self, cfg: StudyConfig, plan: Plan, sources: dict[str, Source] | None = None):
        self.cfg = cfg
        self.sources = sources or {}
        self.by_label = {label_of(m): m for m in plan.models}
        order = [label_of(m) for m in plan.models]
        self.last_use = {lab: i for i, lab in enumerate(order)}
        for ap in plan.analyses:  # a pair stage runs after the later of its two models' passes
            for a, b in ap.pairs:
                later = max(order.index(a), order.index(b))
                for x in (a, b):
                    self.last_use[x] = max(self.last_use[x], later)
        self.order = order
        self.loaded: dict[str, Any] = {}

    def get(self, label: str) -> Any:
        if label not in self.loaded:
            mc = self.by_label[label]
            vm = load_model(mc.name, weights=mc.weights, pretrained=mc.pretrained,
                            checkpoint_format=mc.checkpoint_format, seed=mc.seed, device=self.cfg.device,
                            **mc.kwargs)
            vm.name = label
            if mc.ablate is not None:  # an ablated variant: its write-hooks, after the statistics pass
                vm.ablation = self._ablation(mc, vm)
            self.loaded[label] = vm
        return self.loaded[label]

    def _ablation(self, mc: Any, vm: Any) -> Any:
        from vitscope.models.ablation import parse_spec, resolve

        spec = parse_spec(mc.ablate, f"model {label_of(mc)!r}: ablate")
        first = None
        if spec.needs_statistics:
            src = self.sources[_statistics_dataset(spec, self.sources)]
            first = _first_images(src, vm.preprocessing, self.cfg.batch_size)
        ablation = resolve(vm, spec, first, f"model {label_of(mc)!r}")
        if not ablation.heads:
            import warnings

            from vitscope.errors import ResultWarning

            warnings.warn(f"model {label_of(mc)!r}: the ablation {spec.describe()} resolves to no head of this "
                          "model, so the variant is the clean model", ResultWarning, stacklevel=2)
        return ablation.install(vm)

    def _release(self, label: str) -> None:
        vm = self.loaded.pop(label)
        ablation = getattr(vm, "ablation", None)
        if ablation is not None:  # the hooks off: the model object as loaded
            ablation.remove()

    def done_with(self, label: str) -> None:
        now = self.order.index(label)
        for lab in list(self.loaded):
            if self.last_use[lab] <= now:
                self._release(lab)

    def clear(self) -> None:
        for lab in list(self.loaded):
            self._release(lab)


def _statistics_dataset(spec: Any, sources: dict[str, Source]) -> str:
    """The dataset an ablation's statistics pass reads: ``spec.dataset``, else the study's first used one."""
    from vitscope.errors import ConfigError

    name = spec.dataset or next(iter(sources), None)
    if name not in sources:
        raise ConfigError(f"ablate.dataset {name!r}: no analysis of the study uses that dataset, so it is not read; "
                          f"name one of {', '.join(sources)}")
    return name


def _model_key(mc: Any, sources: dict[str, Source] | None = None) -> tuple[Any, str]:
    """The model's cache key; an ablated variant's adds its spec and, where it has a statistics pass (mode mean,
    a head type), the images of that pass (dataset config, selection, count), which decide the resolved heads
    and their means (recorded in the manifest)."""
    spec = resolve_spec(mc.name)
    key = model_key(spec, file_given(mc.name, mc.weights) or mc.weights, mc.pretrained, mc.checkpoint_format,
                    mc.seed, dict(mc.kwargs))
    if mc.ablate is not None:
        from vitscope.models.ablation import parse_spec

        ab = parse_spec(mc.ablate, f"model {label_of(mc)!r}: ablate")
        stats = None
        if ab.needs_statistics:
            src = (sources or {})[_statistics_dataset(ab, sources or {})]
            stats = [src.name, src.config, src.selection, min(ab.images, src.n_selected)]
        key = digest(key, "ablate", ab.as_dict(), stats)
    return spec, key


def _analysis_key(mkey: str, ap: AnalysisPlan, sources: dict[str, Source], cfg: StudyConfig) -> str:
    """The cache key of one analysis of one model: what decides its state."""
    return digest(mkey, _dataset_keys(ap, sources, cfg), ap.name, ap.cls.state_version, ap.params, ap.views,
                  cfg.dtype, cfg.seed)


def _dataset_keys(ap: AnalysisPlan, sources: dict[str, Source], cfg: StudyConfig) -> dict[str, Any]:
    """What decides each slot's pixels: the dataset's spec, the ids selected and how images are resized
    (`vitscope.data.transforms.PIXELS_VERSION`: results computed from other pixels are not reused)."""
    from vitscope.data.transforms import PIXELS_VERSION
    from vitscope.study.config import study_datasets

    dcs = study_datasets(cfg)
    return {slot: {**asdict(dcs[name]), "selected": sources[name].selection if name in sources else None,
                   "pixels": PIXELS_VERSION}
            for slot, name in ap.slots.items()}


def _relate(analysis: Any, ap: AnalysisPlan, mc: Any, device: str) -> None:
    analysis.datasets = dict(ap.slots)
    if not isinstance(analysis, PairAnalysis):
        analysis.finetuned_from = mc.finetuned_from
        analysis.device = torch.device(device)
    analysis.epoch = mc.epoch


def _run_model(cfg: StudyConfig, mc: Any, label: str, plans: list[AnalysisPlan], sources: dict[str, Source],
               cache: Cache, dist: Dist, pool: _ModelPool,
               on_batch: Callable[[str, int], None] | None) -> tuple[ModelInfo, list[Job], dict[str, Any]]:
    from vitscope.models.registry import get_spec  # noqa: F401 - registry loaded before resolve_spec

    spec, mkey = _model_key(mc, sources)
    shard = (dist.rank, dist.world)
    jobs = []
    for ap in plans:
        akey = _analysis_key(mkey, ap, sources, cfg)
        jobs.append(Job(ap, akey, cache.path(mkey, ap.name, akey), cache.path(mkey, ap.name, akey, shard)))
    info: ModelInfo | None = None
    trained = bool(mc.weights) or (mc.pretrained and spec.weights.kind != "none")
    mmeta: dict[str, Any] = {"source": mc.name, "model_key": mkey,
                             "supervision": spec.supervision if trained else "random init",
                             "objective_family": spec.family if trained else "none"}
    if mc.finetuned_from:
        mmeta["finetuned_from"] = mc.finetuned_from
    if mc.epoch is not None:
        mmeta["epoch"] = mc.epoch
    for job in jobs:  # finished entries: no model needed
        entry = cache.load(job.final)
        if entry is not None and entry.get("finished"):
            try:
                info_c = ModelInfo(**{**entry["info"], "name": label})
                analysis = job.plan.cls(info_c, **job.plan.params)
                analysis.load_state_dict(entry["state"])
                frame = _relabel(entry.get("frame"), entry.get("label"), label)
                meta = dict(entry.get("model_meta", {}))
            except Exception as e:  # noqa: BLE001 - data of the wrong fields or types: recomputed, not trusted
                _unusable(job.final, e)
                continue
            info, job.analysis, job.frame = info_c, analysis, frame
            job.analysis.model_name = label
            _relate(job.analysis, job.plan, mc, cfg.device)
            job.finished, job.meta = True, {"from_cache": True}
            mmeta.update(meta)
            _restore_skipped(entry, sources, job.plan)
    todo = [j for j in jobs if not j.finished]
    timings: dict[str, Any] = {}
    if todo:
        t0 = time.perf_counter()
        vm = pool.get(label)
        info = vm.info()
        mmeta.update({"weights_digest": vm.weights_digest, "family": vm.family, "depth": vm.depth,
                      "heads": vm.num_heads, "grid": list(vm.grid_size), "patch": vm.patch_size,
                      "prefix_tokens": vm.num_prefix_tokens,
                      "load_report": vm.load_report.summary() if vm.load_report else "random initialisation"})
        if getattr(vm, "ablation", None) is not None:  # the resolved heads, with the spec and statistics images
            mmeta["ablation"] = vm.ablation.meta
        for job in todo:
            job.analysis = job.plan.cls(vm, **job.plan.params)
            _relate(job.analysis, job.plan, mc, cfg.device)
            job.analysis.configure({slot: getattr(sources[d].dataset, "classes", None)
                                    for slot, d in job.plan.slots.items()})
            part = cache.load(job.part)
            if part is not None and part.get("chunks") == _chunk_signature(job, sources):
                try:
                    job.analysis.load_state_dict(part["state"])
                    job.done = {str(k): int(v) for k, v in part["done"].items()}
                except Exception as e:  # noqa: BLE001 - started again from the first chunk
                    _unusable(job.part, e)
                    job.analysis, job.done = job.plan.cls(vm, **job.plan.params), {}
                    _relate(job.analysis, job.plan, mc, cfg.device)
                    job.analysis.configure({slot: getattr(sources[d].dataset, "classes", None)
                                            for slot, d in job.plan.slots.items()})
                    continue
                _restore_skipped(part, sources, job.plan)
        for job in todo:
            if not isinstance(job.analysis, PairAnalysis):
                main = sources[job.plan.slots["data"]]
                job.analysis.prepare(vm, _first_images(main, vm.preprocessing, cfg.batch_size))
        timings["load"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        updates: dict[str, float] = {}
        passes: list[PassKey] = []
        for job in todo:
            passes += [p for p in job.plan.passes if p not in passes]
        try:
            for p in passes:
                _pass(cfg, vm, p, sources, [j for j in todo if p in j.plan.passes], cache, mkey, dist, on_batch,
                      updates)
        except BaseException:
            # the pass that died recorded its progress; the passes finished before it are kept too (their jobs
            # wait for the model's last pass): one save of every started job
            _save_parts(todo, cache, mkey, sources)
            raise
        timings["pass"] = round(time.perf_counter() - t0, 2)
        timings["pass_parts"] = {k: round(v, 4) for k, v in updates.items()}  # data wait, forward, each update
        _gather_skipped(sources, dist)
        merged = dist.gather_states(todo)
        if dist.is_main:
            for job, parts in zip(todo, merged, strict=True):
                for state in parts[1:]:
                    other = job.plan.cls(vm, **job.plan.params)
                    other.load_state_dict(state)
                    job.analysis.merge(other)
                t0 = time.perf_counter()
                job.frame = job.analysis.finalize()  # once: a cached rerun reads the table back
                timings.setdefault("finalize", {})[job.name] = round(time.perf_counter() - t0, 2)
                with cache.lock(mkey):
                    cache.note(mkey, model=label, source=str(mc.name))
                    cache.save(job.final, {"finished": True, "state": job.analysis.state_dict(),
                                           "info": asdict(info), "model_meta": mmeta, "params": job.plan.params,
                                           "frame": job.frame, "label": label,
                                           "skipped": _skipped_for(job.plan, sources)})
        dist.barrier()
        for job in todo:
            job.part.unlink(missing_ok=True)
            job.meta = {"from_cache": False}
    for job in jobs:
        if job.frame is None and dist.is_main:
            job.frame = job.analysis.finalize()
    if timings:
        mmeta = {**mmeta, "timings": timings}
    assert info is not None or not jobs
    return info, jobs, mmeta  # type: ignore[return-value]


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
        if any(not cache.path(mkey, ap.name, _analysis_key(mkey, ap, sources, cfg)).is_file() for ap in single):
            pending.append(label_of(mc))
    labels = helpers.delegated(plan, sources, pending)
    if not labels:
        helpers.dismiss()  # one started early by `vitscope run`, not needed
        return None
    _say(cfg, dist, f"a helper process shares {len(labels)} of the {len(pending)} models with this one: "
                    f"{', '.join(labels)}")
    return helpers.start(cfg, labels)


def _unusable(path: Path, e: Exception) -> None:
    """A cache entry that reads as data but whose fields or types do not fit its analysis (another layout, a
    hand-edited file): said once, and recomputed instead of stopping every rerun with a traceback."""
    from vitscope.errors import first_line

    log.warning("ignoring cache entry %s (%s: %s); it is recomputed", path, type(e).__name__, first_line(e))


def _gather_skipped(sources: dict[str, Source], dist: Dist) -> None:
    """Every rank's unreadable images into every rank's sources (torchrun: each rank reads only its shard), so
    the cache entries and the manifest list them all, as one process would."""
    if dist.world == 1:
        return
    for theirs in dist.gather({n: dict(s.skipped) for n, s in sources.items()}):
        for n, items in theirs.items():
            for path, reason in items.items():
                sources[n].skipped.setdefault(path, reason)


def _skipped_for(ap: AnalysisPlan, sources: dict[str, Source]) -> dict[str, dict[str, str]]:
    return {d: dict(sources[d].skipped) for d in set(ap.slots.values()) if sources[d].skipped}


def _restore_skipped(entry: dict[str, Any], sources: dict[str, Source], ap: AnalysisPlan) -> None:
    for d, items in (entry.get("skipped") or {}).items():
        if d in sources:
            for p, r in items.items():
                sources[d].skipped.setdefault(p, r)


def _chunk_signature(job: Job, sources: dict[str, Source]) -> str:
    return digest(sorted((d, sources[d].signature) for d in set(job.plan.slots.values())))


def _relabel(frame: pd.DataFrame | None, old: str | None, new: str) -> pd.DataFrame | None:
    """A cached table under the label the model has in this study (labels are not part of the key)."""
    if frame is None or old is None:
        return None
    frame = frame.copy()
    for col in ("model", "model_b"):
        if col in frame.columns:
            frame.loc[frame[col] == old, col] = new
    return frame


def _pass(cfg: StudyConfig, vm: Any, p: PassKey, sources: dict[str, Source], jobs: list[Job], cache: Cache,
          mkey: str, dist: Dist, on_batch: Callable[[str, int], None] | None,
          timings: dict[str, float] | None = None) -> None:
    """One (dataset, view) pass: `stream` from the earliest chunk any job still needs, feeding each job only
    the chunks it has not seen; partial states saved every ``save_every`` chunks, at least every
    ``SAVE_SECONDS`` (less often where a save takes long: at most 1 / SAVE_OVERHEAD of the time); when the pass
    dies, its progress is recorded in the jobs and `_run_model` saves them."""
    src = sources[p[0]]
    key = _pk(p)
    n_chunks = len(src.chunks)
    start = min(j.done.get(key, 0) for j in jobs)
    if start >= n_chunks:
        return
    seen = [j.done.get(key, 0) for j in jobs]
    last_save, gap = time.monotonic(), SAVE_SECONDS

    def record() -> None:
        for job, k in zip(jobs, seen, strict=True):
            job.done[key] = k

    def save() -> None:
        record()
        _save_parts(jobs, cache, mkey, sources)

    def after(b: int) -> None:
        nonlocal last_save, gap
        if (b + 1) % cfg.save_every == 0 or time.monotonic() - last_save > gap:
            t0 = time.monotonic()
            save()
            last_save = time.monotonic()
            gap = max(SAVE_SECONDS, SAVE_OVERHEAD * (last_save - t0))  # large states: saved less often
        if on_batch is not None:
            on_batch(vm.name, b)

    batches = _pass_batches(src, p[1], vm.preprocessing, cfg.seed, start, timings, cfg.num_workers, _device(vm))
    view = "" if p[1] == CLEAN else f" {p[1]}"
    desc = f"{vm.name} {p[0]}{view}" + (f" [{dist.rank}/{dist.world}]" if dist.world > 1 else "")
    try:
        stream(vm, batches, [j.analysis for j in jobs], dtype=cfg.dtype, progress=cfg.progress,
               total=sum(len(c) for c in src.chunks[start:]), on_batch=after, first=start, seen=seen, desc=desc,
               timings=timings)
    except BaseException:
        batches.close()  # the reading workers end first
        record()  # what is done: `_run_model` saves every started job of the model, this pass's too
        raise
    record()
    n = sum(len(c) for c in src.chunks)
    # under torchrun the skip list also holds other ranks' images: count this shard's own
    if n and len(src.read_here if dist.world > 1 else src.skipped) >= n:
        raise InputError(f"dataset {src.name!r}: none of its {n} images could be read (first: "
                         f"{next(iter(src.skipped.items()))})")


def _save_parts(jobs: list[Job], cache: Cache, mkey: str, sources: dict[str, Source]) -> None:
    with cache.lock(mkey):
        for job in jobs:
            if any(job.done.values()):
                cache.save(job.part, {"state": job.analysis.state_dict(), "done": dict(job.done),
                                      "chunks": _chunk_signature(job, sources),
                                      "skipped": _skipped_for(job.plan, sources)})
    # the images whose batches are saved, per model (the Ctrl-C message says it): per pass, its furthest job
    furthest: dict[str, int] = {}
    for job in jobs:
        for key, k in job.done.items():
            furthest[key] = max(furthest.get(key, 0), k)
    kept = KEPT.setdefault(mkey, {})
    for key, k in furthest.items():
        name = key.split("|", 1)[0]
        if name in sources:
            kept[key] = max(kept.get(key, 0), sum(len(c) for c in sources[name].chunks[:k]))


# ---------------------------------------------------------------- pair stages


def _run_pair(cfg: StudyConfig, ap: AnalysisPlan, a: str, b: str, infos: dict[str, ModelInfo],
              mkeys: dict[str, str], sources: dict[str, Source], cache: Cache, dist: Dist, pool: _ModelPool,
              on_batch: Callable[[str, int], None] | None) -> Job:
    """A pair analysis of models (a, b): cached, resumable per chunk and sharded like a pass."""
    mc_b = pool.by_label[b]
    pkey = digest(mkeys[a], mkeys[b])
    akey = digest(pkey, _dataset_keys(ap, sources, cfg), ap.name, ap.cls.state_version, ap.params, cfg.dtype, cfg.seed)
    job = Job(ap, akey, cache.path(pkey, ap.name, akey), cache.path(pkey, ap.name, akey, (dist.rank, dist.world)))

    def make(info_a: ModelInfo, info_b: ModelInfo) -> Any:
        x = ap.cls(info_a, info_b, **ap.params)
        x.datasets, x.epoch = dict(ap.slots), mc_b.epoch
        main = ap.slots["data"]
        x._store = lambda key: cache.store_dir(mkeys[a], digest(_dataset_keys(ap, sources, cfg)["data"], main),
                                               ap.name, key)
        return x

    entry = cache.load(job.final)
    if entry is not None and entry.get("finished"):
        try:
            analysis = make(ModelInfo(**{**entry["info_a"], "name": a}), ModelInfo(**{**entry["info_b"], "name": b}))
            analysis.load_state_dict(entry["state"])
            frame = _relabel(_relabel(entry.get("frame"), entry.get("label_a"), a), entry.get("label_b"), b)
        except Exception as e:  # noqa: BLE001 - recomputed, not trusted
            _unusable(job.final, e)
        else:
            job.analysis, job.frame = analysis, frame
            job.finished, job.meta = True, {"from_cache": True}
            return job
    vm_a, vm_b = pool.get(a), pool.get(b)
    if tuple(vm_a.img_size) != tuple(vm_b.img_size) or vm_a.preprocessing != vm_b.preprocessing:
        raise InputError(f"analysis {ap.name} compares {a!r} and {b!r}, whose inputs differ (size {vm_a.img_size} "
                         f"vs {vm_b.img_size}, or preprocessing): pair analyses need models with the same input")
    job.analysis = make(vm_a.info(), vm_b.info())
    part = cache.load(job.part)
    if part is not None and part.get("chunks") == _chunk_signature(job, sources):
        try:
            job.analysis.load_state_dict(part["state"])
            job.done = {str(k): int(v) for k, v in part["done"].items()}
        except Exception as e:  # noqa: BLE001 - started again from the first chunk
            _unusable(job.part, e)
            job.analysis, job.done = make(vm_a.info(), vm_b.info()), {}
    src = sources[ap.slots["data"]]
    key = _pk((src.name, CLEAN))
    start = job.done.get(key, 0)
    last_save = time.monotonic()
    try:
        batches = _pass_batches(src, CLEAN, vm_a.preprocessing, cfg.seed, start, None, cfg.num_workers, _device(vm_a))
        for c, batch in enumerate(batches, start=start):
            if batch is not None:
                for part in batch_parts(batch):
                    job.analysis.update(vm_a, vm_b, part)
            job.done[key] = c + 1
            if (c + 1) % cfg.save_every == 0 or time.monotonic() - last_save > 120:
                _save_parts([job], cache, pkey, sources)
                last_save = time.monotonic()
            if on_batch is not None:
                on_batch(f"{a}->{b}", c)
    except BaseException:
        batches.close()
        _save_parts([job], cache, pkey, sources)
        raise
    _gather_skipped(sources, dist)
    merged = dist.gather_states([job])[0]
    if dist.is_main:
        for state in merged[1:]:
            other = make(vm_a.info(), vm_b.info())
            other.load_state_dict(state)
            job.analysis.merge(other)
        job.frame = job.analysis.finalize()
        with cache.lock(pkey):
            cache.note(pkey, pair=[a, b])
            cache.save(job.final, {"finished": True, "state": job.analysis.state_dict(), "info_a": asdict(vm_a.info()),
                                   "info_b": asdict(vm_b.info()), "frame": job.frame, "label_a": a, "label_b": b})
    dist.barrier()
    job.part.unlink(missing_ok=True)
    job.meta = {"from_cache": False}
    return job


def _versions() -> dict[str, str]:
    import timm

    from vitscope import __version__

    return {"vitscope": __version__, "torch": torch.__version__, "timm": timm.__version__,
            "python": platform.python_version()}


def _say(cfg: StudyConfig, dist: Dist, msg: str) -> None:
    """One progress line on stderr (beside the per-model bars; off with -q / progress=false)."""
    if cfg.progress and dist.is_main:
        print(msg, file=sys.stderr, flush=True)
