"""Feed an analysis its passes by hand, the way the study engine does (clean pass of every dataset it reads,
then each view of the main dataset): for tests, benchmarks and notebooks before a study is set up.

    run_passes(analysis, vm, {"data": cue_conflict, "train": shapes}, batch_size=64)

A view's batch is the clean batch through `vitscope.data.views.apply_view`, as in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from vitscope.capture.engine import Capture
from vitscope.data.views import apply_view


def run_passes(analysis: Any, vm: Any, datasets: Mapping[str, Any], batch_size: int = 64, seed: int = 0,
               views: list[str] | None = None, n_images: int | None = None) -> dict[str, float]:
    """Run every pass ``analysis`` subscribes to; returns seconds spent in perturbation, forward and update."""
    analysis.datasets = {slot: ds.name for slot, ds in datasets.items()}
    model = getattr(vm, "model", None)
    if model is not None:  # where finalize computes, as in a study
        analysis.device = next(model.parameters()).device
    if hasattr(analysis, "configure"):
        analysis.configure({slot: getattr(ds, "classes", None) for slot, ds in datasets.items()})
    views = views if views is not None else type(analysis).views(getattr(analysis, "params", {}))
    pre = vm.preprocessing
    t = {"perturb": 0.0, "forward": 0.0, "update": 0.0}
    passes = [(slot, "clean") for slot in datasets if slot != "data"] + [("data", v) for v in views]
    ids = {slot: list(range(min(len(ds), n_images or len(ds)))) for slot, ds in datasets.items()}
    if "data" in datasets and hasattr(analysis, "prepare"):
        main = datasets["data"]
        analysis.prepare(vm, lambda n: main.batches(batch_size, pre, indices=ids["data"][:n]))
    with Capture(vm, analysis.required_taps()) as cap:
        for slot, view in passes:
            ds = datasets[slot]
            for b in ds.batches(batch_size, pre, indices=ids[slot]):
                b.dataset, b.view = ds.name, view
                t0 = time.perf_counter()
                b.images = apply_view(b.images, b.index, view, pre.mean, pre.std, seed)
                t1 = time.perf_counter()
                feats = cap(b.images)
                t2 = time.perf_counter()
                analysis.update(feats, b)
                t3 = time.perf_counter()
                t["perturb"] += t1 - t0
                t["forward"] += t2 - t1
                t["update"] += t3 - t2
    return t
