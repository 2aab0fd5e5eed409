"""Threads that do not spin: how vitscope keeps a study's CPU time the same on a busy machine.

Measured (issue 20): beside other jobs on 2 cores, the default study took 5x the CPU time it takes on a
quiet machine. Two kinds of waiting threads spent it: OpenMP threads (torch's and scikit-learn's) spin at
every barrier before they sleep, and OpenBLAS's threads (numpy, scipy) spin after every call; when a
partner thread is descheduled by another process, the spinning burns whole time slices. So:

* `OMP_WAIT_POLICY=PASSIVE` is set when vitscope is imported (a waiting OpenMP thread sleeps at once). It
  must be in the environment before an OpenMP runtime starts, so it takes effect for the runtimes loaded
  after `import vitscope` (scikit-learn's always; torch's when vitscope is imported first, as the `vitscope`
  command does). A value the user set is kept; `VITSCOPE_THREADS=off` leaves the environment alone.
* `few_threads` runs the small dense work of a study (probes, k-means, t-SNE, the report's drawing) on one
  thread of every pool (BLAS, OpenMP, torch): on arrays of a few hundred rows a second thread saves less
  than its synchronisation costs, and one thread cannot wait for another.

The forward passes keep torch's threads: they are large enough to gain from them, and with the passive
policy their waits sleep.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def enabled() -> bool:
    return os.environ.get("VITSCOPE_THREADS", "on").lower() not in ("off", "0", "false")


def set_wait_policy() -> None:
    """`OMP_WAIT_POLICY=PASSIVE` unless the user chose a policy (or turned vitscope's off)."""
    if enabled():
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def workers() -> int:
    """Processes a study may use on this machine: 2 where two cores are usable (a helper process for the models,
    two for drawing the report), else 1. ``VITSCOPE_WORKERS`` overrides (1 = everything in one process)."""
    env = os.environ.get("VITSCOPE_WORKERS", "").strip()
    if env:
        return max(1, int(env)) if env.isdigit() else 1
    cores = usable_cores()
    return max(1, min(2, cores))


def die_with_parent() -> None:
    """Make this (child) process die when its parent does, on Linux (``PR_SET_PDEATHSIG``): a helper or drawing
    process must not outlive a study killed with SIGKILL (it would hold the study's pipes open and keep
    working for nobody). Elsewhere a no-op. Everywhere, Ctrl-C ends it at once and silently (SIGINT's default
    action, not Python's KeyboardInterrupt, whose traceback would print beside the one line the study's process
    says; the helper starts with SIGINT blocked, so the study ends it instead)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    exit_with_parent()


def exit_with_parent() -> None:
    """The kernel kills this (child) process when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere a
    no-op); signal handlers are left as they are (a DataLoader worker keeps torch's)."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(1)


#: below this many numbers (rows x features) an array's dense work runs on one thread (`few_threads(size)`)
SMALL = 2**21


@contextlib.contextmanager
def few_threads(size: int = 0) -> Iterator[None]:
    """One thread in every BLAS / OpenMP pool and in torch for the duration (restored after), when the work's
    arrays hold fewer than `SMALL` numbers (``size``; 0 = always); larger work keeps every thread."""
    if not enabled() or size >= SMALL:
        yield
        return
    restore = one_thread()
    try:
        yield
    finally:
        restore()


def one_thread() -> Callable[[], None]:
    """One thread in every pool of this process (torch's; BLAS and OpenMP too unless vitscope's thread
    settings are off) until the returned function restores them: for a process that shares two cores with
    another (a study beside its helper; study/helper.py)."""
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    limiter = threadpool_limits(limits=1) if enabled() else None  # before torch's: it records torch's OpenMP pool
    torch.set_num_threads(1)

    def restore() -> None:
        if limiter is not None:
            limiter.restore_original_limits()
        torch.set_num_threads(before)

    return restore


def single_threaded(fn: F) -> F:
    """`few_threads` around every call of ``fn`` (whatever its size: for work that is always small)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with few_threads():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


set_wait_policy()  # on import: `vitscope/__init__.py` imports this module before anything loads torch
