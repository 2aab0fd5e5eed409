"""The stages after the models' passes: the pair stages (one analysis of two related models at once, `run_pair`)
and the cross-model stage (each analysis's table across the models, from their states: `cross_stage`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import pandas as pd

from vitscope.analyses.base import EMPTY_MODEL, EMPTY_REASON, PairAnalysis, explain_empty, has_cross
from vitscope.data.base import batch_parts
from vitscope.data.views import CLEAN
from vitscope.errors import InputError, ResultWarning
from vitscope.models.adapter import ModelInfo
from vitscope.study.cache import Cache, digest
from vitscope.study.config import StudyConfig
from vitscope.study.distributed import Dist
from vitscope.study.keys import Source, dataset_keys, for_model, pair_keys
from vitscope.study.passes import (
    Job,
    device_of,
    explain,
    gather_skipped,
    load_part,
    pass_batches,
    pass_key,
    relabel,
    save_parts,
    say_no_rows,
    unusable,
)
from vitscope.study.plan import AnalysisPlan
from vitscope.study.pool import ModelPool

#: the "model" the cross-model stage's empty table is of (results/summary/empty.parquet, the report)
CROSS = "the cross-model stage"

# ---------------------------------------------------------------- pair stages


def run_pair(cfg: StudyConfig, ap: AnalysisPlan, a: str, b: str, infos: dict[str, ModelInfo],
             mkeys: dict[str, str], sources: dict[str, Source], cache: Cache, dist: Dist, pool: ModelPool,
             on_batch: Callable[[str, int], None] | None) -> Job:
    """A pair analysis of models (a, b): cached, resumable per chunk and sharded like a pass."""
    mc_b = pool.by_label[b]
    pkey, akey = pair_keys(mkeys[a], mkeys[b], ap, sources, cfg)
    job = Job(ap, akey, cache.path(pkey, ap.name, akey), cache.path(pkey, ap.name, akey, (dist.rank, dist.world)))

    def make(info_a: ModelInfo, info_b: ModelInfo) -> Any:
        x = ap.cls(info_a, info_b, **ap.params)
        x.datasets, x.epoch = dict(ap.slots), mc_b.epoch
        main = ap.slots["data"]
        x._store = lambda key: cache.store_dir(mkeys[a], digest(dataset_keys(ap, sources, cfg)["data"], main),
                                               ap.name, key)
        return x

    entry = cache.load(job.final)
    if entry is not None and entry.get("finished"):
        try:
            analysis = make(ModelInfo(**{**entry["info_a"], "name": a}), ModelInfo(**{**entry["info_b"], "name": b}))
            analysis.load_state_dict(entry["state"])
            frame = relabel(relabel(entry.get("frame"), entry.get("label_a"), a), entry.get("label_b"), b)
        except Exception as e:  # noqa: BLE001 - recomputed, not trusted
            unusable(job.final, e)
        else:
            job.analysis, job.frame = analysis, frame
            job.finished, job.meta = True, {"from_cache": True}
            if dist.is_main:
                explain(job, f"{a}->{b}")  # derived from the state read back: said on a cache hit too
            return job
    vm_a, vm_b = pool.get(a), pool.get(b)
    if tuple(vm_a.img_size) != tuple(vm_b.img_size) or vm_a.preprocessing != vm_b.preprocessing:
        raise InputError(f"analysis {ap.name} compares {a!r} and {b!r}, whose inputs differ (size {vm_a.img_size} "
                         f"vs {vm_b.img_size}, or preprocessing): pair analyses need models with the same input")
    job.analysis = make(vm_a.info(), vm_b.info())
    load_part(job, cache, sources, lambda: make(vm_a.info(), vm_b.info()))
    src = for_model(sources, vm_a.patch_size)[ap.slots["data"]]  # one patch size: the inputs are equal
    key = pass_key((src.name, CLEAN))
    start = job.done.get(key, 0)
    last_save = time.monotonic()
    try:
        batches = pass_batches(src, CLEAN, vm_a.preprocessing, cfg.seed, start, None, cfg.num_workers, device_of(vm_a))
        for c, batch in enumerate(batches, start=start):
            if batch is not None:
                for part in batch_parts(batch):
                    job.analysis.update(vm_a, vm_b, part)
            job.done[key] = c + 1
            if (c + 1) % cfg.save_every == 0 or time.monotonic() - last_save > 120:
                save_parts([job], cache, pkey, sources)
                last_save = time.monotonic()
            if on_batch is not None:
                on_batch(f"{a}->{b}", c)
    except BaseException:
        batches.close()
        save_parts([job], cache, pkey, sources)
        raise
    gather_skipped(sources, dist)
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
    if dist.is_main:
        explain(job, f"{a}->{b}")
    return job


def cross_stage(by_analysis: dict[str, list[Any]], frames: dict[str, list[pd.DataFrame]]) -> None:
    """The cross-model stage: each analysis's cross-model table, from its per-model states, after its frames
    (``frames[name][i]`` is ``by_analysis[name][i]``'s table). Nothing is silent here either: a model (or pair)
    whose own table is empty and that the cross-model table does not name either is said with its reason
    (`passes.explain`, deferred to here), and so is a cross-model table without rows (``cross_empty_reason``)."""
    for name, group in by_analysis.items():  # the cross-model stage, from the per-model states
        cls = type(group[0])
        cross = cls.cross(group, inputs=_cross_inputs(cls, by_analysis, frames)) if getattr(cls, "cross_reads", ()) \
            else cls.cross(group)
        if has_cross(cls):
            for i, a in enumerate(group):
                f = frames[name][i] if i < len(frames[name]) else None
                if (f is None or not len(f)) and not _named_in(a, cross):
                    frames[name][i] = explain_empty(a, f, _label(a))
                    say_no_rows(name, frames[name][i], isinstance(a, PairAnalysis))
        if cross is not None and len(cross):
            frames[name].append(cross)
        elif cross is not None:  # None: no cross-model part; an empty table: one that found nothing
            reason = str(cls.cross_empty_reason(group) or "").strip().rstrip(".") or "it gave no reason"
            empty = cross.copy()
            empty.attrs[EMPTY_REASON], empty.attrs[EMPTY_MODEL] = reason, CROSS
            frames[name].append(empty)
            warnings.warn(f"{name}: no rows for the cross-model stage: {reason}", ResultWarning, stacklevel=2)


def _cross_inputs(cls: type, by_analysis: dict[str, list[Any]], frames: dict[str, list[pd.DataFrame]]
                  ) -> dict[str, list[tuple[Any, pd.DataFrame]]]:
    """For a cross-model part that reads other analyses' finished per-model tables (``cls.cross_reads``, e.g.
    stir's robustness target from the corruptions analysis): ``{name: [(analysis, its table), ...]}``."""
    return {n: list(zip(by_analysis.get(n, []), frames.get(n, []), strict=False)) for n in cls.cross_reads}


def _label(a: Any) -> str:
    """A model's label, or a pair's ``a->b`` (as `run_pair` names it)."""
    return f"{a.model_a}->{a.model_b}" if isinstance(a, PairAnalysis) else a.model_name


def _named_in(a: Any, cross: pd.DataFrame | None) -> bool:
    """Whether the cross-model table has rows of ``a``'s model (as either model of a row) or of its pair."""
    if cross is None or not len(cross) or "model" not in cross.columns:
        return False
    if isinstance(a, PairAnalysis):
        return "model_b" in cross.columns and bool(((cross["model"] == a.model_a)
                                                    & (cross["model_b"] == a.model_b)).any())
    return bool((cross["model"] == a.model_name).any()
                or ("model_b" in cross.columns and (cross["model_b"] == a.model_name).any()))
