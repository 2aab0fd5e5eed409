"""Accumulators stay on the features' device: every analysis's ``update`` synchronises with the host at most once
per batch (`host_syncs.HostSyncs` counts the calls that would stall a GPU), run over the embedded default study's
analyses plus the lenses it leaves out, on the untrained zoo model, two batches per pass.

Code that takes a cheaper path where reading values back costs nothing (`vitscope.host.reads_are_free`: the
CPU) is counted on the path a GPU takes. The pair stage (``stir``) is left out: its update is not an
accumulator but an optimisation (inversions by gradient steps) that reads its stopping rule back every step."""

from __future__ import annotations

import collections
import io
import warnings

import pytest
import torch
from host_syncs import HostSyncs

from vitscope.analyses.base import Analysis

EXTRA = ["analyses.head_ablation={}", "analyses.logit_lens={}", "analyses.similarity={}"]


def _subclasses(c: type) -> list[type]:
    return [s for d in c.__subclasses__() for s in (d, *_subclasses(d))]


@pytest.fixture(scope="module")
def syncs(tmp_path_factory) -> dict[str, list[collections.Counter]]:
    import vitscope.host
    from vitscope.study import load_config, run_study

    seen: dict[str, list[collections.Counter]] = collections.defaultdict(list)
    mp = pytest.MonkeyPatch()
    mp.setattr(vitscope.host, "CPU_READS", False)  # count the path a GPU takes, not the CPU's shortcuts
    for cls in set(_subclasses(Analysis)):
        if "update" in cls.__dict__:
            def update(self, feats, batch, _orig=cls.__dict__["update"]):
                with HostSyncs() as s:
                    _orig(self, feats, batch)
                seen[self.name].append(s.where)
            mp.setattr(cls, "update", update)
    d = tmp_path_factory.mktemp("syncs")
    over = ["models=[{name: zoo-random}]", "~analyses.stir", f"output_dir={d}/out", f"cache_dir={d}/cache",
            "batch_size=32", "num_workers=0", *EXTRA] + [
        f"datasets.{k}.n_images=64" for k in ("cifar10", "shapes", "cifar10-128", "silhouettes", "cue-conflict",
                                              "pairs")] + [
        "datasets.videos.n_images=40", "datasets.videos.options.n_frames=5"]  # 8 videos of 5 frames: two batches
    try:
        with warnings.catch_warnings():  # 64 images may leave some readouts without a held-out split: said, not raised
            warnings.simplefilter("ignore", UserWarning)
            run_study(load_config(None, over))
    finally:
        mp.undo()
    return seen


def _names() -> list[str]:
    from vitscope.study import load_config

    cfg = load_config(None, EXTRA)
    return sorted(n for n in cfg.analyses if n != "stir")


@pytest.mark.parametrize("name", _names())
def test_at_most_one_host_synchronisation_per_batch(syncs, name):
    calls = syncs[name]
    assert len(calls) >= 2, f"{name} saw {len(calls)} batches; the check needs several"
    worst = max(calls, key=lambda c: sum(c.values()))
    assert sum(worst.values()) <= 1, f"{name}: {sum(worst.values())} host synchronisations in one batch: {dict(worst)}"


def test_the_counter_sees_what_would_stall_a_gpu():
    x = torch.randn(4, 3)
    with HostSyncs() as s:
        x.to(x.device), x.to(torch.float64), x.sum(0), x + 1, x[torch.tensor([0, 2])]  # none waits
    assert s.count == 0, dict(s.where)
    with HostSyncs() as s:
        x.sum().item(), x.tolist(), x.cpu(), x.numpy(), bool(x[0, 0] > 0), float(x[0, 0]), int(x[0, 0] > 0)
        x[x > 0], torch.nonzero(x), torch.unique(x), torch.bincount(torch.tensor([1, 2]))
    assert s.where == collections.Counter({"item": 1, "tolist": 1, "cpu": 1, "numpy": 1, "__bool__": 1,
                                           "__float__": 1, "__int__": 1, "__getitem__": 1, "nonzero": 1,
                                           "unique": 1, "bincount": 1}), dict(s.where)


def test_to_host_moves_many_tensors_in_one_copy_exactly():
    """The packing a device's tensors go through (`_packed_to_host`, run here on CPU tensors): one copy, exact,
    each result its own storage; `to_host` copies host tensors on the host (no synchronisation) and keeps None."""
    from vitscope.host import _packed_to_host, to_host

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    tensors = [x, x.t(), x[:, 1:4], torch.randint(-9, 9, (3,), generator=g), torch.rand(4, generator=g) > 0.5,
               x.half(), x.double()[:1], torch.empty(0, 3), torch.tensor(2.5), torch.randint(0, 255, (3,)).byte()]
    with HostSyncs() as s:
        got = _packed_to_host(tensors)
    assert s.count == 1, dict(s.where)
    for want, have in zip(tensors, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape and have.device.type == "cpu"
        assert torch.equal(have, want)
    torch.save(list(got), io.BytesIO())  # each has its own storage: saved together, as a state is
    with HostSyncs() as s:
        kept = to_host(x, None, tensors[3])
    assert s.count == 0 and kept[1] is None and torch.equal(kept[0], x) and torch.equal(kept[2], tensors[3])
    assert kept[0].data_ptr() != x.data_ptr()  # a copy: the caller may change x
