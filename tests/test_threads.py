"""Threads that cannot spin: the wait policy set on import, one thread for small dense work."""

import os
import subprocess
import sys

import torch
from threadpoolctl import threadpool_info

from vitscope.threads import SMALL, few_threads


def _pools() -> set[int]:
    return {p["num_threads"] for p in threadpool_info()}


def test_small_work_runs_on_one_thread_and_restores_the_pools():
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _pools()
        with few_threads(1000):
            assert torch.get_num_threads() == 1 and _pools() == {1}
        assert torch.get_num_threads() == 2 and _pools() == before
        with few_threads(SMALL):  # large work keeps its threads
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(own)


def test_import_sets_a_passive_wait_policy_unless_the_user_chose():
    code = "import os, vitscope; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "VITSCOPE_THREADS")}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra},  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout.strip()
    assert run({}) == "PASSIVE"
    assert run({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert run({"VITSCOPE_THREADS": "off"}) == "None"


def test_a_probe_fits_on_one_thread_in_every_pool(monkeypatch):
    """The robustness lenses' and semantics' probes (a few hundred rows) run L-BFGS on one BLAS thread: with two,
    OpenBLAS's threads spun on every tiny product (17x the time per iteration beside other work)."""
    from vitscope.metrics import semantics as S

    seen = []
    real = S.minimize
    monkeypatch.setattr(S, "minimize", lambda *a, **k: (seen.append((torch.get_num_threads(), _pools())),
                                                         real(*a, **k))[1])
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(40, 8, generator=g), torch.arange(40) % 4
        for tune in (True, False):  # the tuned probe and the fixed one (the robustness lenses' default here)
            fit = S.fit_probe(x[:30], y[:30], x[30:], y[30:], tune=tune, grid=(1e-2, 1e-4))
        assert len(seen) > 2 and all(s == (1, {1}) for s in seen)
        assert torch.get_num_threads() == 2 and 0 <= fit.accuracy <= 1
    finally:
        torch.set_num_threads(own)


def test_one_thread_holds_every_pool_until_restored():
    from vitscope.threads import one_thread

    own = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _pools()
        restore = one_thread()
        assert torch.get_num_threads() == 1 and _pools() == {1}
        restore()
        assert torch.get_num_threads() == 2 and _pools() == before
    finally:
        torch.set_num_threads(own)
