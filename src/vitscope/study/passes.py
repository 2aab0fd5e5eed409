"""A model's streamed passes: every unfinished analysis of one model (a `Job` each) fed from one forward pass
per (dataset, view) it needs, resumable per chunk from the partial states saved in the cache, and sharded
under torchrun (`run_model`); the chunks of a pass read as batches (`pass_batches`).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import EMPTY_MODEL, EMPTY_REASON, PairAnalysis, explain_empty, has_cross
from vitscope.capture import stream
from vitscope.data.base import batch_parts
from vitscope.data.pipeline import worker_death
from vitscope.data.views import CLEAN, apply_view
from vitscope.errors import InputError, ResultWarning
from vitscope.models.adapter import ModelInfo
from vitscope.study.cache import Cache, digest
from vitscope.study.config import StudyConfig
from vitscope.study.distributed import Dist
from vitscope.study.keys import Source, analysis_key, first_images, for_model, model_key
from vitscope.study.plan import AnalysisPlan
from vitscope.study.pool import ModelPool

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


def pass_key(p: PassKey) -> str:
    return f"{p[0]}|{p[1]}"


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


def pass_batches(src: Source, view: str, pre: Any, seed: int, start: int, timings: dict[str, float] | None,
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
                           transform=functools.partial(viewed, inplace=True) if on_host and viewed else None,
                           known_skips=src.skipped)
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


def device_of(vm: Any) -> torch.device:
    return next(vm.model.parameters()).device


def _relate(analysis: Any, ap: AnalysisPlan, mc: Any, device: str) -> None:
    analysis.datasets = dict(ap.slots)
    if not isinstance(analysis, PairAnalysis):
        analysis.finetuned_from = mc.finetuned_from
        analysis.device = torch.device(device)
    analysis.epoch = mc.epoch


def run_model(cfg: StudyConfig, mc: Any, label: str, plans: list[AnalysisPlan], sources: dict[str, Source],
              cache: Cache, dist: Dist, pool: ModelPool, on_batch: Callable[[str, int], None] | None,
              say_empty: bool = True) -> tuple[ModelInfo, list[Job], dict[str, Any]]:
    """Every analysis of ``plans`` that runs on this model (`AnalysisPlan.runs_on`, its ``models``): read back
    where finished in the cache, else fed its passes, merged and finalized (and cached). ``say_empty``: a table
    without rows is a ResultWarning with its reason (`explain`);
    the helper process leaves that to the study's process, which reads its models back."""
    from vitscope.models.registry import get_spec  # noqa: F401 - registry loaded before resolve_spec

    spec, mkey = model_key(mc, sources)
    shard = (dist.rank, dist.world)
    jobs = []
    for ap in plans:
        if not ap.runs_on(label):  # its `models` leave this one out: no pass, entry, refusal or empty reason
            continue
        akey = analysis_key(mkey, ap, sources, cfg)
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
                frame = relabel(entry.get("frame"), entry.get("label"), label)
                meta = dict(entry.get("model_meta", {}))
            except Exception as e:  # noqa: BLE001 - data of the wrong fields or types: recomputed, not trusted
                unusable(job.final, e)
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
        check_frames(vm, todo, sources)
        sources = for_model(sources, vm.patch_size)  # a dataset tiled per model: cut for this model's patch size
        info = vm.info()
        mmeta.update({"weights_digest": vm.weights_digest, "family": vm.family, "depth": vm.depth,
                      "heads": vm.num_heads, "grid": list(vm.grid_size), "patch": vm.patch_size,
                      "prefix_tokens": vm.num_prefix_tokens, "cls_token": vm.has_cls_token, "readout": vm.readout,
                      "load_report": vm.load_report.summary() if vm.load_report else "random initialisation"})
        if getattr(vm, "ablation", None) is not None:  # the resolved heads, with the spec and statistics images
            mmeta["ablation"] = vm.ablation.meta
        for job in todo:
            job.analysis = job.plan.cls(vm, **job.plan.params)
            _relate(job.analysis, job.plan, mc, cfg.device)
            job.analysis.configure({slot: getattr(sources[d].dataset, "classes", None)
                                    for slot, d in job.plan.slots.items()})

            def fresh(job: Job = job) -> Any:
                a = job.plan.cls(vm, **job.plan.params)
                _relate(a, job.plan, mc, cfg.device)
                a.configure({slot: getattr(sources[d].dataset, "classes", None) for slot, d in job.plan.slots.items()})
                return a

            part = load_part(job, cache, sources, fresh)
            if part is not None:
                _restore_skipped(part, sources, job.plan)
        for job in todo:
            if not isinstance(job.analysis, PairAnalysis):
                main = sources[job.plan.slots["data"]]
                job.analysis.prepare(vm, first_images(main, vm.preprocessing, cfg.batch_size))
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
            save_parts(todo, cache, mkey, sources)
            raise
        timings["pass"] = round(time.perf_counter() - t0, 2)
        timings["pass_parts"] = {k: round(v, 4) for k, v in updates.items()}  # data wait, forward, each update
        gather_skipped(sources, dist)
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
        if dist.is_main and say_empty:
            explain(job, label)
    if timings:
        mmeta = {**mmeta, "timings": timings}
    assert info is not None or not jobs
    return info, jobs, mmeta  # type: ignore[return-value]


def check_frames(vm: Any, jobs: list[Job], sources: dict[str, Source]) -> None:
    """A loaded model that takes its own input size only (``any_size`` False: BEiT, an Eva without dynamic size,
    an MAE decoder) refused, before any of its passes, where one of ``jobs`` reads a dataset of whole frames
    (``framing.crop`` 'full'): the sentence the config check says where the registry entry tells
    (`vitscope.models.names.whole_frames_refused`)."""
    from vitscope.errors import ConfigError
    from vitscope.models.names import fixed_size_reason, whole_frames_refused

    if vm.any_size:
        return
    from vitscope.data.tiling import TiledDataset

    for job in jobs:
        for name in dict.fromkeys(job.plan.slots.values()):
            ds = sources[name].dataset
            if isinstance(ds, TiledDataset):  # tiles are the model's input size (the base's framing is not)
                continue
            framing = getattr(ds, "framing", None)
            if getattr(framing, "crop", None) == "full" and not getattr(ds, "letterbox", False):
                dynamic = bool(getattr(vm.model, "dynamic_img_size", False))
                why = fixed_size_reason(vm.family, dynamic, vm.decoder_from is not None) or "it takes one input size"
                raise ConfigError(whole_frames_refused(vm.name, name, why))


def explain(job: Job, model: str) -> None:
    """No analysis returns nothing silently: a table of ``job`` without rows for ``model`` (a label, or a pair's)
    gets its reason (`vitscope.analyses.base.explain_empty`, derived from the state, so also on a cache hit),
    said once as a ResultWarning (`say_no_rows`) and carried in the table's ``attrs`` to the run's
    results/summary/empty.parquet and the report. An analysis with a cross-model part is judged after that stage
    instead (`vitscope.study.stages.cross_stage`): its rows for this model may come from there."""
    if has_cross(type(job.analysis)) or (job.frame is not None and len(job.frame)):
        return
    job.frame = explain_empty(job.analysis, job.frame, model)
    say_no_rows(job.name, job.frame, isinstance(job.analysis, PairAnalysis))


def say_no_rows(name: str, frame: pd.DataFrame, pair: bool = False) -> None:
    """The one ResultWarning sentence for a table ``explain_empty`` marked: the analysis, the model and why."""
    what = "model pair" if pair else "model"
    warnings.warn(f"{name}: no rows for {what} {frame.attrs[EMPTY_MODEL]!r}: {frame.attrs[EMPTY_REASON]}",
                  ResultWarning, stacklevel=3)


def load_part(job: Job, cache: Cache, sources: dict[str, Source], fresh: Callable[[], Any]) -> dict | None:
    """``job``'s saved part loaded into ``job.analysis`` when it was made from the same chunks (returned); a part
    that cannot be loaded is said (`unusable`) and the job starts again from the first chunk with ``fresh()``'s
    analysis (None, as without a part)."""
    part = cache.load(job.part)
    if part is None or part.get("chunks") != chunk_signature(job, sources):
        return None
    try:
        job.analysis.load_state_dict(part["state"])
        job.done = {str(k): int(v) for k, v in part["done"].items()}
    except Exception as e:  # noqa: BLE001 - started again from the first chunk
        unusable(job.part, e)
        job.analysis, job.done = fresh(), {}
        return None
    return part


def unusable(path: Path, e: Exception) -> None:
    """A cache entry that reads as data but whose fields or types do not fit its analysis (another layout, a
    hand-edited file): said once, and recomputed instead of stopping every rerun with a traceback."""
    from vitscope.errors import first_line

    log.warning("ignoring cache entry %s (%s: %s); it is recomputed", path, type(e).__name__, first_line(e))


def gather_skipped(sources: dict[str, Source], dist: Dist) -> None:
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


def chunk_signature(job: Job, sources: dict[str, Source]) -> str:
    return digest(sorted((d, sources[d].signature) for d in set(job.plan.slots.values())))


def relabel(frame: pd.DataFrame | None, old: str | None, new: str) -> pd.DataFrame | None:
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
    dies, its progress is recorded in the jobs and `run_model` saves them."""
    src = sources[p[0]]
    key = pass_key(p)
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
        save_parts(jobs, cache, mkey, sources)

    def after(b: int) -> None:
        nonlocal last_save, gap
        if (b + 1) % cfg.save_every == 0 or time.monotonic() - last_save > gap:
            t0 = time.monotonic()
            save()
            last_save = time.monotonic()
            gap = max(SAVE_SECONDS, SAVE_OVERHEAD * (last_save - t0))  # large states: saved less often
        if on_batch is not None:
            on_batch(vm.name, b)

    batches = pass_batches(src, p[1], vm.preprocessing, cfg.seed, start, timings, cfg.num_workers, device_of(vm))
    view = "" if p[1] == CLEAN else f" {p[1]}"
    desc = f"{vm.name} {p[0]}{view}" + (f" [{dist.rank}/{dist.world}]" if dist.world > 1 else "")
    try:
        stream(vm, batches, [j.analysis for j in jobs], dtype=cfg.dtype, progress=cfg.progress,
               total=sum(len(c) for c in src.chunks[start:]), on_batch=after, first=start, seen=seen, desc=desc,
               timings=timings)
    except BaseException as e:
        batches.close()  # the reading workers end first
        record()  # what is done: `run_model` saves every started job of the model, this pass's too
        # a reading worker's death said by torch's SIGCHLD handler wherever the pass stood: named with the batch
        died = worker_death(e, f"during batch {max(seen) + 1} of {n_chunks} of {src.name}")
        if died is not None:
            raise died from None
        raise
    record()
    n = sum(len(c) for c in src.chunks)
    # under torchrun the skip list also holds other ranks' images: count this shard's own
    if n and len(src.read_here if dist.world > 1 else src.skipped) >= n:
        raise InputError(f"dataset {src.name!r}: none of its {n} images could be read (first: "
                         f"{next(iter(src.skipped.items()))})")


def save_parts(jobs: list[Job], cache: Cache, mkey: str, sources: dict[str, Source]) -> None:
    with cache.lock(mkey):
        for job in jobs:
            if any(job.done.values()):
                cache.save(job.part, {"state": job.analysis.state_dict(), "done": dict(job.done),
                                      "chunks": chunk_signature(job, sources),
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
