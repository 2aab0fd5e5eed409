"""The input pipeline of a study pass: fixed id chunks read, framed and collated in worker processes.

Chunk k of a pass is one item of a map-style `torch.utils.data.Dataset` (`Chunks`), made by the dataset's own
``batches(len(ids), pre, indices=ids)``, so a chunk is one batch whatever the number of workers: the
composition and order of the batches, resume, torchrun shards and the images skipped as unreadable are those
of a single process. torch's `DataLoader` (``batch_size=None``, the chunk numbers as its sampler) hands
the chunks out in order, with a bounded prefetch (``prefetch_factor`` chunks per worker) and, when the model
sits on a GPU, in pinned memory, so the copy to the device can be non-blocking.

A view (band noise, a corruption) is computed on the model's device: on a GPU after the copy, in the study's
process; on the CPU it is the chunk's ``transform``, computed where the chunk is read, so the workers take it
over too (the study's process then only runs the model). Views are per image deterministic, and a transform
runs on one thread in the study's process too (as in a worker: the last bits of some kernels, e.g. band noise's,
depend on the thread count), so the pixels do not depend on the number of workers.

What a worker's copy of the dataset learns does not reach the study's process by itself, so each chunk
travels with it: the images it could not read (``(path, reason)``) and the warnings it raised (re-emitted
in the study's process). A `vitscope.errors.VitscopeError` raised while reading (a dataset's one sentence)
travels as the chunk's error and is raised again as it was, not wrapped in the worker's traceback.

Workers die with the study: the iterator is shut down when the pass ends, fails or is interrupted
(`chunk_batches` closes it in a ``finally``), and each worker asks the kernel to kill it when the
study's process dies (``PR_SET_PDEATHSIG``), also after a SIGKILL. Ctrl-C reaches the workers too; torch's
worker loop ends quietly on it, and the study's process says its one line.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vitscope.data.base import batch_parts
from vitscope.errors import VitscopeError, WorkerDied
from vitscope.threads import usable_cores


def reads_files(dataset: Any) -> bool:
    """Whether a dataset's items cost a file's decoding (images in memory or generated do not)."""
    base = getattr(dataset, "base", None)  # a tiled dataset reads what its base reads
    if base is not None and base is not dataset:
        return reads_files(base)
    return bool(getattr(dataset, "reads_files", False))


def auto_workers(dataset: Any) -> int:
    """``num_workers: null``: the usable cores minus one (the study's own process), at least 0, for datasets that
    decode files, the cores shared among torchrun's processes on this machine (``LOCAL_WORLD_SIZE``); 0 for
    images in memory or generated, where a worker's start and the copy of each batch between processes cost
    more than the reading they would take over."""
    if not reads_files(dataset):
        return 0
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(0, usable_cores() // max(1, int(local) if local.isdigit() else 1) - 1)


@dataclass
class Chunk:
    """One chunk as read: its batch (None when none of its images could be read), the images skipped as
    unreadable, the warnings raised while reading it, or the error that stopped it; ``transform_seconds``: the
    time its ``transform`` took."""

    k: int
    batch: Any = None
    transform_seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    warned: list[tuple[type[Warning], str]] = field(default_factory=list)
    error: VitscopeError | None = None

    def pin_memory(self) -> Chunk:
        """Pinned images (the DataLoader's pinning thread calls this), so their copy to a GPU need not wait."""
        if self.batch is not None:
            for part in batch_parts(self.batch):
                part.images = part.images.pin_memory()
        return self


class Chunks(torch.utils.data.Dataset):
    """Map-style dataset over the chunk numbers of a pass: item k is chunk k, read, framed and collated, then
    each part's images passed through ``transform(images, index)`` where one is given."""

    def __init__(self, dataset: Any, chunks: Sequence[Sequence[int]], preprocessing: Any,
                 transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        self.dataset, self.chunks, self.preprocessing = dataset, [list(c) for c in chunks], preprocessing
        self.transform = transform

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> Chunk:
        from vitscope.data.formats.common import NothingReadable

        ids = self.chunks[k]
        skipped = getattr(self.dataset, "skipped", None)
        before = len(skipped) if skipped is not None else 0
        out = Chunk(k)
        with warnings.catch_warnings(record=True) as caught:
            try:
                got = list(self.dataset.batches(len(ids), self.preprocessing, indices=ids))
            except NothingReadable:
                got = []
            except VitscopeError as e:
                out.error = e
                got = []
        out.warned = [(w.category, str(w.message)) for w in caught]
        if skipped is not None:
            out.skipped = [(str(p), str(r)) for p, r in self.dataset.skipped[before:]]
        if got:
            out.batch = got[0] if len(got) == 1 else concat(got)
            if self.transform is not None:
                t0, threads = time.perf_counter(), torch.get_num_threads()
                torch.set_num_threads(1)  # as in a worker: some kernels' last bits depend on the thread count
                try:
                    for part in batch_parts(out.batch):
                        part.images = self.transform(part.images, part.index)
                finally:
                    torch.set_num_threads(threads)
                out.transform_seconds = time.perf_counter() - t0
        return out


def concat(batches: list[Any]) -> Any:
    """Several batches of one chunk (a dataset that yielded it in pieces) as one, or a `RaggedBatch` of runs."""
    from vitscope.data.base import Batch, RaggedBatch

    parts = [p for b in batches for p in batch_parts(b)]
    if len({tuple(p.images.shape[1:]) for p in parts}) > 1:
        return RaggedBatch(parts)
    first = batches[0]
    out = Batch(images=torch.cat([b.images for b in batches]), index=torch.cat([b.index for b in batches]))
    for f in ("labels", "masks", "parts", "objects", "keypoints", "boxes", "frames", "is_test"):
        vals = [getattr(b, f) for b in batches]
        if all(v is not None for v in vals):
            setattr(out, f, torch.cat(vals))
    if all(b.sequences is not None for b in batches):
        out.sequences = [s for b in batches for s in b.sequences]
    out.extra = dict(first.extra)
    return out


# workers start per pass: forked where the platform can (a started worker has every module already; a
# spawned one imports torch and vitscope again, seconds per pass), else the platform's default
_CONTEXT = "fork" if "fork" in multiprocessing.get_all_start_methods() and sys.platform.startswith("linux") else None


def _same(item: Chunk) -> Chunk:
    return item


def _worker_init(_worker_id: int) -> None:
    """A worker that outlives the study's process would read for nobody: the kernel kills it (Linux)."""
    from vitscope.threads import exit_with_parent

    exit_with_parent()


_WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) "
                          r"(is killed by signal: [^.]+|exited unexpectedly(?: with exit code -?\d+)?)")


def worker_death(e: BaseException, where: str) -> WorkerDied | None:
    """The DataLoader's error for a reading worker that died (the kernel's out-of-memory killer, a kill: "exited
    unexpectedly" when the batch is awaited, "is killed by signal" from its SIGCHLD handler anywhere else) as one
    sentence naming the worker and ``where`` (the batch); None for any other error."""
    m = _WORKER_DIED.search(str(e)) if isinstance(e, RuntimeError) else None
    if m is None:
        return None
    how = m.group(2)
    if how.startswith("is killed by signal: "):
        how = f"was killed by a signal ({how.removeprefix('is killed by signal: ')})"
    return _died(m.group(1).strip(), how, where)


def _died(pid: Any, how: str, where: str) -> WorkerDied:
    return WorkerDied(f"an image-reading worker (pid {pid}) {how} {where} (the kernel's out-of-memory killer ends "
                      "workers when memory runs out: fewer num_workers or a smaller batch_size need less)")


def _dead_worker(it: Any, where: str) -> WorkerDied | None:
    """A worker of the DataLoader iterator ``it`` that has ended with a failure, as `_died`'s sentence: a batch
    in flight from a worker killed mid-handover fails as a broken connection (its tensors' file descriptors
    are fetched from the dead process), not as the DataLoader's own error."""
    import signal

    end = time.monotonic() + 1.0
    while True:  # the worker may not be reaped yet when its connection breaks
        for w in getattr(it, "_workers", None) or []:
            code = w.exitcode
            if code:
                name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else None
                return _died(w.pid, f"was killed by a signal ({name})" if name else f"exited with code {code}",
                             where)
        if time.monotonic() > end:
            return None
        time.sleep(0.05)


def _worker_deaths(it: Iterator[Chunk], order: list[int], n_chunks: int, name: str) -> Iterator[Chunk]:
    """``it``'s chunks; a reading worker that died while one was read becomes `worker_death`'s sentence."""
    for k in order:
        try:
            item = next(it)
        except StopIteration:
            return
        except (RuntimeError, OSError, EOFError) as e:
            where = f"while batch {k + 1} of {n_chunks} of {name} was read"
            died = worker_death(e, where) or _dead_worker(it, where)
            if died is None:
                raise
            raise died from None
        yield item


def chunk_batches(dataset: Any, chunks: Sequence[Sequence[int]], preprocessing: Any, start: int = 0,
                  num_workers: int = 0, pin_memory: bool = False,
                  transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  known_skips: Container[str] | None = None) -> Iterator[Chunk]:
    """Chunks ``start``.. of a pass, in order, read (and ``transform``-ed, `Chunks`) by ``num_workers`` worker
    processes (0: in this process);
    the images each chunk skipped are added to ``dataset.skipped`` here and its warnings re-emitted (a skipped-image
    warning only when it names an image not in ``known_skips``: a study says each once, not once per model); an
    error raised while reading is raised here. Workers are shut down when the iterator ends or is closed."""
    from vitscope.data.formats.common import SkippedImagesWarning

    order = list(range(start, len(chunks)))
    workers = max(0, min(int(num_workers), len(order)))
    loader = torch.utils.data.DataLoader(
        Chunks(dataset, chunks, preprocessing, transform), batch_size=None, sampler=order, num_workers=workers,
        collate_fn=_same, pin_memory=pin_memory, worker_init_fn=_worker_init if workers else None,
        prefetch_factor=2 if workers else None, persistent_workers=False,
        multiprocessing_context=_CONTEXT if workers else None)
    it = iter(loader)
    try:
        for item in _worker_deaths(it, order, len(chunks), getattr(dataset, "name", "the dataset")):
            note = getattr(dataset, "note_skipped", None)
            if workers and note is not None:
                for path, reason in item.skipped:  # what the worker's copy of the dataset recorded
                    note(path, reason)
            for category, message in item.warned:  # recorded while reading: said here, in reading order
                if known_skips is not None and issubclass(category, SkippedImagesWarning) \
                        and all(path in known_skips for path, _ in item.skipped):
                    continue  # said by an earlier pass over the same images (another model's)
                warnings.warn(message, category, stacklevel=2)
            if item.error is not None:
                raise item.error
            yield item
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)  # at once, not when the iterator is collected
        if shutdown is not None:
            shutdown()
