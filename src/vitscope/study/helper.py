"""A second process for a study on a machine with two cores: it and the study's own process take the models from
one shared list (whoever is free takes the next) and compute their analyses into the cache, each process on
one thread.

Why: a small model's forward passes keep two cores busy, but most of a small-model study is single-threaded
work around them (the analyses' updates and finalize: probes, k-means, t-SNE); two processes of one thread
each overlap one model's finalize with another's forwards. The study's process stays the only one that writes
results: it reads the helper's models back from the cache (exactly as a rerun would) and runs the pair stages
(whose models it computes itself, first, so a pair stage runs while the helper still computes),
the cross-model stage, the tables and the report itself. If the helper fails or dies, the study computes the
model itself: the helper can cost time, never a result. Not torchrun's shards for this: they split images, so
every rank still runs every model's finalize; the helper splits models.

When: `vitscope.threads.workers()` is 2 (two usable cores; ``VITSCOPE_WORKERS=1`` turns it off), one process
(not under torchrun), no ``on_batch`` hook (tests that interrupt runs), and at least `MIN_MODELS` models with
work left whose passes cover at least `MIN_IMAGES` images each: below that, starting a process (importing
torch and vitscope, a few seconds) costs more than it saves.

Reading: the helper reads its passes' images itself (``num_workers: 0`` in its copy of the config,
`helper_config`), also for datasets that read files, where ``num_workers: null`` gives a pass reading workers
(`vitscope.data.pipeline.auto_workers`). A daemonic process may not start children, and a helper that started its
own workers would put four busy processes on two cores for a small gain: reading is about a tenth of a model's pass
(the default study with 1,000 CIFAR-10 JPEGs from an image folder). Reading in its one thread keeps the helper
daemonic, so it still ends with the study in every path (`close`, `dismiss`, the kernel's ``PR_SET_PDEATHSIG``,
multiprocessing's exit handler), with no worker of its own to end. The study's process keeps its ``num_workers``:
without its worker while a helper runs, that study took the same time within the machine's noise
(`benchmarks/study.py --imagefolder`). Which process read which images does not change a result: the chunks of a
pass are fixed, and a chunk's pixels do not depend on where it is read (`vitscope.data.pipeline`).

Started early: `vitscope run` starts the helper (`prespawn`) before it imports torch and timm itself, when
the config lists at least `MIN_MODELS` models, so the helper's imports run on the core the study's own imports
leave idle; the study then hands it its models (`start`) or dismisses it (`dismiss`). A run that starts no
helper early starts one when it needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MIN_MODELS = 4
MIN_IMAGES = 1000


def _images_per_model(plan: Any, sources: dict[str, Any]) -> int:
    """The images of the passes the single-model analyses make (on the model that runs all of them: an analysis's
    `models` may leave some out of others' passes), to judge whether a helper pays."""
    passes = {p for ap in plan.analyses if not ap.pair for p in ap.passes}
    return sum(sum(len(c) for c in sources[d].chunks) for d, _view in passes)


def delegated(plan: Any, sources: dict[str, Any], pending: list[str]) -> list[str]:
    """The shared list of models (labels, in study order) the helper and the study's process claim from: the
    models with work left that no pair stage needs, where at least two are. The study's process computes a pair
    stage's models itself first and runs the stage while the helper claims from the list, then claims from it too
    (whoever is free takes the next model). Without such models, every model with work left."""
    from vitscope.threads import workers

    if workers() < 2 or len(pending) < MIN_MODELS or _images_per_model(plan, sources) < MIN_IMAGES:
        return []
    in_pairs = {x for ap in plan.analyses for pair in ap.pairs for x in pair}
    free = [lab for lab in pending if lab not in in_pairs]
    return free if len(free) >= 2 else list(pending)


STOPPED_SECONDS = 60.0  # a helper stopped this long is given up (its models computed by the study)


class Helper:
    """The helper process: imports the study's modules, waits for its models (`assign`), computes them in order
    and reports each as it is cached."""

    def __init__(self) -> None:
        import multiprocessing as mp

        # spawn, not fork: the study's process has torch's thread pools running
        ctx = mp.get_context("spawn")
        _quiet_resource_tracker()
        self.labels: list[str] = []  # the shared list: each process claims its next model from it
        self._next: Any = ctx.Value("i", 0)  # the first unclaimed position of ``labels``
        self._inbox: Any = ctx.Queue()
        self._queue: Any = ctx.Queue()
        self._proc = ctx.Process(target=_main, args=(self._inbox, self._queue, self._next), daemon=True,
                                 name="vitscope-helper")
        # Ctrl-C blocked while it starts (the mask is inherited): a child still importing would print a
        # traceback; once running, it ignores SIGINT (`die_with_parent`) and the study ends it
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") \
            else None
        try:
            self._proc.start()
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self._done: dict[str, dict[str, Any]] = {}
        self._failed: str | None = None
        self._ready = False

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the helper has imported the study's modules (benchmarks start their clock after it)."""
        import time

        end = time.monotonic() + timeout
        while not self._ready and self._proc.is_alive() and time.monotonic() < end:
            try:
                self._note(*self._queue.get(timeout=0.2))
            except queue.Empty:
                continue
        return self._ready

    def assign(self, cfg: Any, labels: list[str]) -> Helper:
        """Give the helper the shared list of models: it claims them one at a time, in this order, as the study's
        process does with `claim` once its own models are done (whoever is free takes the next)."""
        self.labels = list(labels)
        self._inbox.put((helper_config(cfg), self.labels))
        return self

    def finished(self) -> list[str]:
        """The models the helper has cached so far (without waiting), in the order it finished them."""
        while True:
            try:
                self._note(*self._queue.get_nowait())
            except queue.Empty:
                return list(self._done)

    def _note(self, kind: str, got: Any, info: Any) -> None:
        """One message of the helper's: a model cached, its imports done, or what stopped it."""
        if kind == "done":
            self._done[got] = info
        elif kind == "ready":
            self._ready = True
        else:
            self._failed = f"{got}: {info}"

    def claim(self) -> str | None:
        """The next unclaimed model of the shared list, now this process's to compute (None: all claimed)."""
        return _claim(self._next, self.labels)

    def claimed_by_helper(self, own: set[str]) -> list[str]:
        """The models of the shared list claimed so far that this process did not claim (``own``)."""
        with self._next.get_lock():
            upto = self._next.value
        return [lab for lab in self.labels[:upto] if lab not in own]

    def wait_for(self, label: str, stopped_for: float = STOPPED_SECONDS) -> dict[str, Any] | None:
        """Block until the helper has cached ``label`` (its timings), or None when it cannot: it failed, died,
        or has been stopped (SIGSTOP, a suspended job) for ``stopped_for`` seconds; the study then computes the
        model itself (a stopped helper is ended, so it cannot take more models when it continues)."""
        import time

        stopped_since = None
        while label not in self._done and self._failed is None:
            try:
                self._note(*self._queue.get(timeout=1.0))
            except queue.Empty:
                if not self._proc.is_alive():
                    self._failed = f"the helper process ended (exit code {self._proc.exitcode})"
                elif _is_stopped(self._proc.pid):
                    stopped_since = stopped_since or time.monotonic()
                    if time.monotonic() - stopped_since >= stopped_for:
                        self._failed = f"the helper process has been stopped for {stopped_for:.0f} s"
                        self._proc.kill()
                        self._proc.join(timeout=10)
                else:
                    stopped_since = None
        if label in self._done:
            return self._done[label]
        log.warning("helper process: %s; the study computes %s itself", self._failed, label)
        return None

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(timeout=10)
        self._queue.close()
        self._inbox.close()


_WAITING: Helper | None = None  # started by `prespawn`, not yet given its models

#: the warning filter `_quiet_resource_tracker` hands multiprocessing's resource tracker
_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (a process of its own, which outlives a killed study to unlink the
    helper's queue and counter semaphores) with its warnings off: after a SIGKILL of the study it would print
    "There appear to be 7 leaked semaphore objects to clean up at shutdown" on the study's stderr, the only
    line of a run that said nothing else, about a cleanup it does anyway. The tracker takes Python's ``-W``
    options from ``sys.warnoptions`` when it starts (this process's own warning filters are unchanged)."""
    import sys
    from multiprocessing import resource_tracker

    if _TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_QUIET)
    resource_tracker.ensure_running()


def helper_config(cfg: Any) -> Any:
    """The helper's copy of the study's config: no progress bars, and its passes read their images in the helper
    itself (``num_workers: 0``; a daemonic process cannot start reading workers, and the two cores are taken)."""
    return dataclasses.replace(cfg, progress=False, num_workers=0)


def _is_stopped(pid: int | None) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP; state T in /proc on Linux); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def models_listed(config: str | Path | None) -> int:
    """How many models a study config lists, read cheaply (plain YAML, no validation; 0 when it cannot tell):
    whether starting a helper early may pay."""
    import yaml

    try:
        if config is None:
            from importlib.resources import files

            text = files("vitscope.configs").joinpath("default.yaml").read_text(encoding="utf-8")
        else:
            text = Path(config).read_text(encoding="utf-8")
        models = yaml.safe_load(text).get("models")
    except Exception:  # noqa: BLE001 - a heuristic: the config's own checks say what is wrong with it
        return 0
    return len(models) if isinstance(models, list) else 0


def prespawn(config: str | Path | None) -> None:
    """Start a helper before the study's imports where one may be used: two usable cores (`workers`), not under
    torchrun, at least `MIN_MODELS` models in the config. `start` hands it its models, `dismiss` ends it."""
    global _WAITING
    from vitscope.threads import workers

    world = os.environ.get("WORLD_SIZE", "1")
    if _WAITING is not None or workers() < 2 or (world.isdigit() and int(world) > 1) \
            or models_listed(config) < MIN_MODELS:
        return
    _WAITING = Helper()


def start(cfg: Any, labels: list[str]) -> Helper:
    """A helper computing ``labels``: the one started early if there is one, else a new one."""
    global _WAITING
    helper, _WAITING = (_WAITING or Helper()), None
    return helper.assign(cfg, labels)


def dismiss() -> None:
    """End a helper started early that was given no models (the study needed none, or stopped before)."""
    global _WAITING
    if _WAITING is not None:
        _WAITING.close()
        _WAITING = None


def _claim(counter: Any, labels: list[str]) -> str | None:
    with counter.get_lock():
        i = counter.value
        if i >= len(labels):
            return None
        counter.value = i + 1
    return labels[i]


def _main(inbox: Any, out: Any, counter: Any) -> None:
    import time

    from vitscope.threads import die_with_parent, one_thread

    die_with_parent()  # first: a study that dies while this process imports takes it along
    # the study's imports (torch, timm), while the study makes its own
    from vitscope.study.cache import Cache, default_cache_dir
    from vitscope.study.distributed import Dist
    from vitscope.study.keys import source
    from vitscope.study.passes import run_model
    from vitscope.study.plan import label_of, make_plan
    from vitscope.study.pool import ModelPool

    out.put(("ready", None, None))
    cfg, labels = inbox.get()  # a helper not needed is ended (`dismiss`) while it waits here
    one_thread()  # every pool of this process (torch, BLAS, OpenMP): the study's process holds the other core
    label = "setup"
    try:
        plan = make_plan(cfg)
        dist = Dist()
        cache = Cache(cfg.cache_dir or default_cache_dir(Path(cfg.output_dir)))
        sources = {name: source(name, dc, cfg, plan, dist) for name, dc in plan.datasets.items()}
        single = [ap for ap in plan.analyses if not ap.pair]
        by_label = {label_of(m): m for m in plan.models}
        pool = ModelPool(cfg, plan, sources)
        while (claimed := _claim(counter, labels)) is not None:  # until the shared list is all claimed
            label = claimed
            t0 = time.perf_counter()
            _info, _jobs, mmeta = run_model(cfg, by_label[label], label, single, sources, cache, dist, pool, None,
                                             say_empty=False)  # said by the study's process
            pool.clear()
            out.put(("done", label, {"seconds": round(time.perf_counter() - t0, 2),
                                     "timings": mmeta.get("timings", {})}))
    except BaseException as e:  # noqa: BLE001 - reported to the study, which computes the model itself
        out.put(("failed", label, f"{type(e).__name__}: {e}"))
