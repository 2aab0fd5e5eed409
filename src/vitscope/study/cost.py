"""What a study will cost, before it runs (`vitscope run --dry-run`, and the paragraph a run prints before its
first forward): passes, images per pass, forwards, how much the cache grows, the memory of the largest batch's
captured taps, and the finalize steps that grow faster than linearly.

The forwards are every forward call of the run: one per chunk of each (model, dataset, view) pass, an ablated
variant's statistics pass, the calls the analyses make themselves (statistics passes in ``prepare``, a forward
and backward per batch, reruns of later blocks: `Analysis.own_forwards`) and every call of the pair stages
(inversions with gradients among them: `PairAnalysis.own_forwards`), each declared by its analysis from its
parameters, the architecture and the sizes of its data. A call followed by a backward counts as `1 + BACKWARD`
forwards' work in the hours; rows that leave the forward after an earlier block count only the blocks they pass.

No weights are read: each model's architecture is built by timm on the meta device (shapes, no storage), from
the registry entry, the timm name and the config's ``kwargs``, or the metadata a vitscope checkpoint stores;
the analyses are instantiated on that model, so the taps and sizes are theirs (`Analysis.required_taps`,
`state_bytes`, `superlinear`). Only a checkpoint without metadata (its architecture is read off its tensors)
gets no estimate, which the paragraph says. Captured taps are float32 (`capture.Capture` hands them out so);
attention maps are B x heads x T x T per block. Images are the model's native size; whole-frame datasets
(several sizes) are estimated at it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from vitscope.errors import ConfigError
from vitscope.host import free_memory  # noqa: F401 - the tap-memory checks here; its home is host.py
from vitscope.models.load import check_build  # noqa: F401 - its old home
from vitscope.study.plan import Plan, label_of

#: bytes of a captured element (taps are handed out as float32, whatever the forward's dtype)
TAP_BYTES = 4

#: a run estimated to take longer than this many hours of forwards is warned about before it starts (not refused)
MAX_HOURS = 24

#: forwards' work of a backward pass (a forward call with gradients costs 1 + BACKWARD forwards)
BACKWARD = 2

#: sustained multiply-adds x 2 per second of a ViT forward, by device type: a time estimate's throughput (an order of
#: magnitude: a few CPU cores in float32, one recent GPU in half precision)
FLOPS_PER_SECOND = {"cpu": 1e11, "cuda": 5e13, "mps": 5e12}


def forward_flops(vm: Any) -> int:
    """Floating-point operations of one image's forward: per block, the qkv, projection and MLP matrices (2 per
    multiply-add) over every token, and the attention's two T x T products."""
    from torch import nn

    t, d = vm.num_tokens, vm.embed_dim
    matrices = sum(m.in_features * m.out_features for m in vm.model.blocks[0].modules() if isinstance(m, nn.Linear))
    per_block = 2 * t * (matrices or 12 * d * d) + 4 * t * t * d  # any MLP: plain, packed or separate SwiGLU
    return int(vm.depth * per_block)


def _fc1_width(mlp: Any) -> int:
    """Width of the ``fc1`` tap: the first MLP linear's outputs, or a SwiGLU's gate and value halves together."""
    fc1 = getattr(mlp, "fc1", None)
    if fc1 is not None:
        return int(fc1.out_features)
    return int(mlp.fc1_g.out_features + mlp.fc1_x.out_features)


def forwards_flops(vm: Any, f: Any) -> int:
    """Floating-point operations of the forward calls ``f`` (a `vitscope.analyses.base.Forwards`) on ``vm``: their
    block passes at `forward_flops` per image and block, times 1 + `BACKWARD` when each has a backward."""
    work = forward_flops(vm) * f.images if f.blocks is None else forward_flops(vm) * f.blocks // max(vm.depth, 1)
    return int(work * (1 + BACKWARD if f.gradients else 1))


@dataclass
class Estimate:
    passes: int = 0                                    # (model, dataset, view) passes left to run
    images: dict[str, int] = field(default_factory=dict)  # "dataset view" -> images per pass
    forwards: int = 0                                  # forward calls in total (passes, statistics, analyses, pairs)
    forward_images: int = 0                            # images through them, every call together
    gradients: int = 0                                 # of those calls, the ones followed by a backward
    own: dict[str, list[int]] = field(default_factory=dict)  # analysis -> its own [calls, images, with gradients]
    cache_bytes: int = 0                               # what the cache grows by
    tap_bytes: int = 0                                 # captured taps of the largest batch
    largest: str = ""                                  # which batch that is
    largest_batch: int = 0                             # its images
    superlinear: list[str] = field(default_factory=list)
    pairs: list[str] = field(default_factory=list)    # each pair stage in words: what it costs, or cached
    notes: list[str] = field(default_factory=list)
    flops: int = 0                                     # of every forward (and backward): `forwards_flops`
    device: str = "cpu"
    n_models: int = 0
    cached: int = 0                                    # (model, analysis) results already in the cache
    total: int = 0                                     # (model, analysis) results of the study

    @property
    def hours(self) -> float:
        """Hours of forwards at `FLOPS_PER_SECOND` of the device."""
        import torch

        return self.flops / FLOPS_PER_SECOND.get(torch.device(self.device).type, FLOPS_PER_SECOND["cpu"]) / 3600

    def warning(self) -> str | None:
        """A sentence when the run is estimated beyond `MAX_HOURS`, else None."""
        if self.hours <= MAX_HOURS:
            return None
        return (f"this run is estimated at about {self.hours:,.0f} hours of forwards on {self.device}, more than "
                f"{MAX_HOURS} hours; fewer images, models or views shorten it (it starts anyway)")

    def text(self) -> str:
        """One paragraph."""
        from vitscope.study.cache import human

        views = ", ".join(f"{k}: {v}" for k, v in self.images.items())
        said = [f"cost: {self.passes} passes (models x datasets x views; images per pass: {views or 'none'}), "
                f"{self.forwards} forwards in total over {self.forward_images:,} images"
                + (f" ({self.gradients} of them with gradients)" if self.gradients else "")]
        if self.cached:
            said.append(f"{self.cached} of {self.total} model x analysis results already in the cache")
        if self.flops:
            said.append(f"about {self.hours:.2g} hours of forwards on {self.device}")
        said.append(f"the cache grows by about {human(self.cache_bytes)}")
        if self.largest:
            said.append(f"the largest batch's captured taps take {human(self.tap_bytes)} ({self.largest})")
        if self.superlinear:
            said.append("finalize steps that grow faster than linearly: " + "; ".join(self.superlinear))
        if self.own:
            said.append("forwards the analyses make themselves, beside the passes: " + "; ".join(
                f"{name}: {_calls(c, i, g)}" for name, (c, i, g) in self.own.items()))
        if self.pairs:
            said.append("pair stages (after both models' passes): " + "; ".join(self.pairs))
        warning = self.warning()
        return (", ".join(said[:2]) + "; " + "; ".join(said[2:]) + "." + "".join(f" Note: {n}." for n in self.notes)
                + (f" Warning: {warning}." if warning else ""))


def _calls(calls: int, images: int, gradients: int) -> str:
    """Forward calls in words: '222 forward calls over 82,112 images, 200 of them with gradients'."""
    said = f"{calls:,} forward call{'s' if calls != 1 else ''} over {images:,} images"
    if gradients:
        said += ", with gradients" if gradients == calls else f", {gradients:,} of them with gradients"
    return said


def architecture(mc: Any, builds: dict[str, Any] | None = None) -> Any:
    """``mc``'s model as timm builds it on the meta device (a `ViTModel` without weights), or a sentence
    (str) saying why it cannot be had without reading the weights. ``builds`` caches equal architectures."""
    import torch

    from vitscope.errors import VitscopeError
    from vitscope.models.adapter import ViTModel
    from vitscope.models.load import _create, resolve_spec

    try:
        spec = resolve_spec(mc.name)
    except VitscopeError as e:
        return str(e)
    if not spec.arch:
        return f"{label_of(mc)}: its architecture is read off the checkpoint's tensors, so it is not estimated"
    kwargs = {**spec.model_kwargs, **(mc.kwargs or {})}
    key = json.dumps([spec.arch, kwargs], sort_keys=True, default=str)
    if builds is not None and key in builds:
        model = builds[key]
    else:
        try:
            with torch.device("meta"):
                model = _create(spec.arch, kwargs, 0)
        except Exception as e:  # noqa: BLE001 - an estimate, never the reason a run fails
            return f"{label_of(mc)}: timm could not build {spec.arch} on the meta device ({type(e).__name__})"
        if builds is not None:
            builds[key] = model
    return ViTModel(model=model, name=label_of(mc), spec=replace(spec, model_kwargs=kwargs))


def tap_elements(vm: Any, tap: str) -> int:
    """Numbers one image's ``tap`` holds (`capture/taps.py` lists the shapes)."""
    from vitscope.capture.taps import parse_tap

    t, d = vm.num_tokens, vm.embed_dim
    _block, kind = parse_tap(tap)
    if kind == "attn":
        return vm.num_heads * t * t
    if kind == "qkv":
        return 3 * t * d
    if kind == "fc1":
        return t * _fc1_width(vm.model.blocks[0].mlp)
    if kind == "logits":
        return int(getattr(vm.model, "num_classes", 0) or d)
    if kind == "pool":
        return d
    if kind == "pool_attn":
        pool = vm.model.attn_pool
        return int(pool.num_heads * pool.latent_len) * t
    return t * d


def estimate(cfg: Any, plan: Plan, sources: dict[str, Any], cache: Any, labels: Iterable[str] | None = None,
             notes: Iterable[str] = ()) -> Estimate:
    """The cost of running ``plan`` now: only the (model, analysis) results and the pair stages ``cache`` lacks
    (all of them for an empty cache), of the models ``labels`` (all by default; a slice, which runs no pair
    stage)."""
    from vitscope.study.keys import analysis_key as _analysis_key
    from vitscope.study.keys import model_key as _model_key

    est = Estimate(notes=list(notes), device=str(getattr(cfg, "device", "cpu")))
    wanted = set(labels) if labels is not None else None
    single = [ap for ap in plan.analyses if not ap.pair]
    builds: dict[str, Any] = {}
    n_of = {d: sum(len(c) for c in s.chunks) for d, s in sources.items()}
    batch_of = {d: max((len(c) for c in s.chunks), default=0) for d, s in sources.items()}
    for mc in plan.models:
        label = label_of(mc)
        if wanted is not None and label not in wanted:
            continue
        est.n_models += 1
        try:
            mkey = _model_key(mc, sources)[1]
        except Exception:  # noqa: BLE001 - a file that is not there (a dry run notes it): nothing cached
            mkey = None
        todo = []
        for ap in single:
            if not ap.runs_on(label):  # its `models` leave this one out
                continue
            est.total += 1
            if mkey is not None and cache.finished(mkey, ap.name, _analysis_key(mkey, ap, sources, cfg)):
                est.cached += 1
            else:
                todo.append(ap)
        passes = []
        for ap in todo:
            passes += [p for p in ap.passes if p not in passes]
        est.passes += len(passes)
        for d, v in passes:
            est.images[f"{d} {v}"] = n_of[d]
            est.forwards += len(sources[d].chunks)
            est.forward_images += pass_images(sources[d], mc, builds)  # a tiled dataset: its tiles
        if not todo:
            continue
        stats = _statistics_images(mc, sources)  # an ablated variant's statistics pass, when it has one
        if stats:
            est.forwards += math.ceil(stats / max(int(getattr(cfg, "batch_size", 1)), 1))
            est.forward_images += stats
        vm = architecture(mc, builds)
        if isinstance(vm, str):
            if not any(vm in n for n in est.notes):
                est.notes.append(vm)
            continue
        analyses = {ap.name: ap.cls(vm, **ap.params) for ap in todo}
        for ap in todo:
            est.cache_bytes += analyses[ap.name].state_bytes(n_of[ap.slots["data"]])
            for step in analyses[ap.name].superlinear(n_of[ap.slots["data"]]):
                if f"{step} ({ap.name})" not in est.superlinear:
                    est.superlinear.append(f"{step} ({ap.name})")
            own = analyses[ap.name].own_forwards(vm, data_sizes(ap.slots["data"], plan, sources, cfg))
            if own:
                counted = _count(est, own, {"": vm})
                est.own[ap.name] = [x + y for x, y in zip(est.own.get(ap.name, [0, 0, 0]), counted, strict=True)]
        est.flops += stats * forward_flops(vm)
        for d, v in passes:
            est.flops += pass_images(sources[d], mc, builds) * forward_flops(vm)
            taps: list[str] = []
            for ap in todo:
                if (d, v) in ap.passes:
                    taps += [t for t in analyses[ap.name].required_taps() if t not in taps]
            size = batch_of[d] * TAP_BYTES * sum(tap_elements(vm, t) for t in taps)
            if size > est.tap_bytes:
                est.tap_bytes = size
                est.largest = f"{label} on {d} {v}: {batch_of[d]} images x {len(taps)} taps"
                est.largest_batch = batch_of[d]
    if wanted is None:  # a slice of the models runs no pair stage
        _pair_stages(est, cfg, plan, sources, cache, builds)
    return est


def pass_images(src: Any, mc: Any, builds: dict[str, Any]) -> int:
    """Images through the model in one pass of ``mc`` over ``src``'s chunks: its images, or for a tiled dataset
    its tiles at the model's input and patch size (`TiledDataset.count_tiles`; a dataset tiled per model is cut
    for each model's own patch size)."""
    n = sum(len(c) for c in src.chunks)
    count = getattr(src.dataset, "count_tiles", None)
    if count is None:
        return n
    vm = architecture(mc, builds)
    tile, patch = (None, None) if isinstance(vm, str) else (int(vm.img_size[0]), int(vm.patch_size))
    return int(count([i for c in src.chunks for i in c], tile, patch))


def data_sizes(name: str, plan: Plan, sources: dict[str, Any], cfg: Any) -> Any:
    """What an analysis whose main dataset is ``name`` declares its own forwards from (`DataSizes`): the images
    of each chunk, the images selected, the batch size, and the number of classes of a dataset with labels."""
    from vitscope.analyses.base import DataSizes
    from vitscope.data.catalog import get_format

    src = sources[name]
    classes = None
    if "labels" in get_format(plan.datasets[name].name).provides:
        classes = len(getattr(src.dataset, "classes", None) or ())
    return DataSizes(tuple(len(c) for c in src.chunks), int(src.n_selected),
                     int(getattr(cfg, "batch_size", 1) or 1), classes)


def _count(est: Estimate, forwards: Iterable[Any], models: dict[str, Any]) -> tuple[int, int, int]:
    """Add ``forwards`` (`Forwards`, each run on ``models[f.model]``) to ``est``: calls, images, flops; returns
    (calls, images, calls with gradients)."""
    calls = images = gradients = 0
    for f in forwards:
        calls += f.calls
        images += f.images
        gradients += f.calls if f.gradients else 0
        est.flops += forwards_flops(models[f.model], f)
    est.forwards += calls
    est.forward_images += images
    est.gradients += gradients
    return calls, images, gradients


def _pair_stages(est: Estimate, cfg: Any, plan: Plan, sources: dict[str, Any], cache: Any,
                 builds: dict[str, Any]) -> None:
    """Every pair stage the cache lacks: its forward calls (`PairAnalysis.own_forwards` over its pass of the
    main dataset) into ``est``, and a sentence each in ``est.pairs``. Products a stage keeps for later ones
    (`Forwards.once`: model A's inversions) count at their first stage, and not at all where a stage that made
    them is in the cache (the study cache kept them beside it)."""
    by_label = {label_of(m): m for m in plan.models}
    made: set[tuple[str, ...]] = set()
    for ap in plan.analyses:
        for a, b in ap.pairs:
            d = ap.slots["data"]
            said = f"{ap.name} {a} -> {b} on the {sum(len(c) for c in sources[d].chunks):,} images of {d}"
            finished = _pair_finished(cfg, ap, by_label[a], by_label[b], sources, cache)
            vm_a, vm_b = architecture(by_label[a], builds), architecture(by_label[b], builds)
            unknown = [vm for vm in (vm_a, vm_b) if isinstance(vm, str)]
            if unknown:
                if not finished:
                    est.notes += [vm for vm in unknown if not any(vm in n for n in est.notes)]
                est.pairs.append(f"{said}: {'in the cache' if finished else 'not estimated'}")
                continue
            stage = ap.cls(vm_a.info(), vm_b.info(), **ap.params)
            stage.datasets = dict(ap.slots)
            forwards = stage.own_forwards(vm_a, vm_b, data_sizes(d, plan, sources, cfg))
            kept = {f: (ap.name, a if f.model == "a" else b, d, f.once) for f in forwards if f.once}
            forwards = [f for f in forwards if kept.get(f) not in made]  # made by an earlier stage
            made.update(kept.values())  # a finished stage kept its products in the same cache
            if finished:
                est.pairs.append(f"{said}: in the cache")
                continue
            calls, images, gradients = _count(est, forwards, {"a": vm_a, "b": vm_b})
            est.pairs.append(f"{said}: {_calls(calls, images, gradients)}")


def _pair_finished(cfg: Any, ap: Any, mc_a: Any, mc_b: Any, sources: dict[str, Any], cache: Any) -> bool:
    """Whether ``cache`` holds the finished pair stage (``ap``, A, B), under the key `stages.run_pair` gives it."""
    from vitscope.study.keys import model_key as _model_key
    from vitscope.study.keys import pair_keys

    try:
        pkey, akey = pair_keys(_model_key(mc_a, sources)[1], _model_key(mc_b, sources)[1], ap, sources, cfg)
    except Exception:  # noqa: BLE001 - a file that is not there (a dry run notes it): nothing cached
        return False
    return bool(cache.finished(pkey, ap.name, akey))


def _statistics_images(mc: Any, sources: dict[str, Any]) -> int:
    """The images of an ablated variant's statistics pass (`vitscope.models.ablation`): 0 for a model or a
    variant without one."""
    if getattr(mc, "ablate", None) is None:
        return 0
    from vitscope.models.ablation import parse_spec
    from vitscope.study.keys import statistics_dataset as _statistics_dataset

    spec = parse_spec(mc.ablate, "ablate")
    if not spec.needs_statistics:
        return 0
    return min(spec.images, sources[_statistics_dataset(spec, sources)].n_selected)


def announce(cfg: Any, plan: Plan, sources: dict[str, Any], cache: Any, dist: Any,
             labels: Iterable[str] | None = None) -> None:
    """Before a run's first forward: the estimate as one paragraph (unless progress is off), and the refusal of
    a batch whose captured taps do not fit (`check_memory`). An estimate that fails is logged, never fatal."""
    import logging
    import sys

    try:
        est = estimate(cfg, plan, sources, cache, labels)
    except Exception as e:  # noqa: BLE001 - the estimate is advice; the run itself says what is wrong
        logging.getLogger(__name__).warning("no cost estimate (%s: %s)", type(e).__name__, e)
        return
    if cfg.progress and dist.is_main:
        print(est.text(), file=sys.stderr, flush=True)
    elif dist.is_main and est.warning():  # said even with progress off: a warning, never a refusal
        print(f"vitscope: warning: {est.warning()}", file=sys.stderr, flush=True)
    check_memory(est, cfg)


def check_memory(est: Estimate, cfg: Any) -> None:
    """Refuse, in one sentence, a study one batch of whose captured taps does not fit the device's free memory."""
    from vitscope.study.cache import human

    free = free_memory(cfg.device)
    if free is None or est.tap_bytes <= free:
        return
    fits = int(free // (est.tap_bytes / max(est.largest_batch, 1)))
    raise ConfigError(f"one batch's captured taps ({est.largest}) take {human(est.tap_bytes)}, more than the "
                      f"{human(free)} free on {cfg.device}: lower batch_size (to at most {fits}), or ask for "
                      "fewer taps")


def dry_run(cfg: Any, models: tuple[int, int] | None = None) -> Estimate:
    """`vitscope run --dry-run`: the estimate of running ``cfg`` now, without reading any weights or writing
    anything (no output or cache directory is created; a weights file that is not there is noted, not an
    error)."""
    from pathlib import Path

    from vitscope.study.cache import Cache, default_cache_dir, human
    from vitscope.study.config import preflight, slice_models
    from vitscope.study.distributed import Dist
    from vitscope.study.keys import check_batch_sizes
    from vitscope.study.keys import source as _source
    from vitscope.study.plan import make_plan

    notes = preflight(cfg, dry_run=True)
    plan = make_plan(cfg)
    labels = [label_of(m) for m in slice_models(cfg.models, *models)] if models is not None else None
    sources = {name: _source(name, dc, cfg, plan, Dist()) for name, dc in plan.datasets.items()}
    try:
        check_batch_sizes(cfg, plan, sources)
    except ConfigError as e:
        notes.append(f"{e} (a real run stops there)")
    cache = Cache(Path(cfg.cache_dir or default_cache_dir(Path(cfg.output_dir))))
    est = estimate(cfg, plan, sources, cache, labels, notes)
    free = free_memory(cfg.device)
    if free is not None and est.tap_bytes > free:
        est.notes.append(f"a real run refuses this: the largest batch's taps exceed the {human(free)} free on "
                         f"{cfg.device}")
    return est

