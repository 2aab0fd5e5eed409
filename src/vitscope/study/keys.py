"""Cache keys and sources, shared by the run (`study/run.py`), its passes and stages, the helper process and
the cost estimate (`study/cost.py`): a study's datasets built and cut into this shard's chunks (`source`), the
ids each selects (and the batches of the first of them: `first_images`), and the keys under which a model's and
an analysis's results are cached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from vitscope.data.catalog import build_dataset
from vitscope.data.views import CLEAN
from vitscope.errors import ConfigError, InputError
from vitscope.models.load import file_given, resolve_spec
from vitscope.study import cache
from vitscope.study.cache import digest
from vitscope.study.config import StudyConfig
from vitscope.study.distributed import Dist
from vitscope.study.plan import AnalysisPlan, Plan, label_of


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
    selected: list[int] = field(default_factory=list)  # every rank's selected ids, in order (`first_images`)
    config: str = ""     # digest of the dataset's config (in an ablated variant's model key)


def dataset_summary(src: Source) -> dict[str, Any]:
    return {"name": src.name, "format": getattr(src.dataset, "name", src.name),
            "n_images": src.n_selected, "available": len(src.dataset)}


def source(name: str, dc: Any, cfg: StudyConfig, plan: Plan, dist: Dist) -> Source:
    ds = build_dataset(dc)
    if len(ds) == 0:
        raise InputError(f"dataset {name!r} ({dc.name}) has no images")
    ids = select_ids(ds, dc.n_images)
    shard, offset = shard_ids(ids, ds, plan.align(name, cfg.batch_size), dist)
    chunks = [shard[i:i + cfg.batch_size] for i in range(0, len(shard), cfg.batch_size)]
    return Source(name, ds, chunks, digest(cfg.batch_size, shard), selection=digest(ids), offset=offset,
                  n_selected=len(ids), selected=list(ids), config=digest(asdict(dc)))


def for_model(sources: dict[str, Source], patch: int) -> dict[str, Source]:
    """``sources`` as one model reads them: a dataset tiled per model (``patch: model``) cut for its ``patch`` size
    (`vitscope.data.tiling.TiledDataset.for_patch`), the others as they are. The chunks, selection and skip
    lists stay the study's (shared, not copied): tiles are counted per item, so every patch size has the same
    fixed id chunks, shards and resume points."""
    return {name: replace(src, dataset=src.dataset.for_patch(patch))
            if getattr(src.dataset, "per_model", False) is True else src for name, src in sources.items()}


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
            [shard_ids(src.selected, src.dataset, plan.align(name, cfg.batch_size), Dist(r, world))[0]
             for r in range(world)]
        sizes = [len(s[i:i + cfg.batch_size]) for s in shards for i in range(0, len(s), cfg.batch_size)]
        if sizes and min(sizes) < need:
            where = "" if world <= 1 else f" over {world} processes"
            raise ConfigError(
                f"analysis {ap.name!r} needs at least {need} images in every batch, but the {src.n_selected} images "
                f"of dataset {name!r} in batches of {cfg.batch_size}{where} leave a batch of {min(sizes)}: choose "
                f"batch_size (at least {need}) and n_images so that no batch holds fewer")


def first_images(src: Source, pre: Any, batch_size: int) -> Callable[[int], Iterator[Any]]:
    """``n -> `` the clean batches of the first ``n`` selected images of ``src`` (every rank's selection, not
    this shard's: the same images on every rank), for `Analysis.prepare`."""
    ds = src.dataset
    if getattr(ds, "per_model", False) is True:  # tiled per model: cut for the patch size of the model ``pre`` is of
        ds = ds.for_patch(int(pre.patch_size))

    def batches(n: int) -> Iterator[Any]:
        for b in ds.batches(batch_size, pre, indices=list(src.selected[:n])):
            b.dataset, b.view = src.name, CLEAN
            yield b
    return batches


def _units(ds: Any, n: int) -> list[int] | None:
    bounds = getattr(ds, "unit_bounds", None)
    if bounds is None:
        return None
    starts = sorted({int(b) for b in bounds()} | {0})
    return [s for s in starts if s < n]


def select_ids(ds: Any, n_images: int) -> list[int]:
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


def shard_ids(ids: list[int], ds: Any, align: int, dist: Dist) -> tuple[list[int], int]:
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


# ---------------------------------------------------------------- cache keys


def statistics_dataset(spec: Any, sources: dict[str, Source]) -> str:
    """The dataset an ablation's statistics pass reads: ``spec.dataset``, else the study's first used one."""
    from vitscope.errors import ConfigError

    name = spec.dataset or next(iter(sources), None)
    if name not in sources:
        raise ConfigError(f"ablate.dataset {name!r}: no analysis of the study uses that dataset, so it is not read; "
                          f"name one of {', '.join(sources)}")
    return name


def model_key(mc: Any, sources: dict[str, Source] | None = None) -> tuple[Any, str]:
    """The model's cache key (a model with its MAE decoder, ``decoder: true``, has its own); an ablated variant's
    adds its spec and, where it has a statistics pass (mode mean, a head type), the images of that pass (dataset
    config, selection, count), which decide the resolved heads and their means (recorded in the manifest)."""
    spec = resolve_spec(mc.name)
    key = cache.model_key(spec, file_given(mc.name, mc.weights) or mc.weights, mc.pretrained, mc.checkpoint_format,
                          mc.seed, dict(mc.kwargs))
    if getattr(mc, "decoder", False):  # MAE's decoder run after the encoder: other blocks, other outputs
        key = digest(key, "decoder")
    if mc.ablate is not None:
        from vitscope.models.ablation import parse_spec

        ab = parse_spec(mc.ablate, f"model {label_of(mc)!r}: ablate")
        stats = None
        if ab.needs_statistics:
            src = (sources or {})[statistics_dataset(ab, sources or {})]
            stats = [src.name, src.config, src.selection, min(ab.images, src.n_selected)]
        key = digest(key, "ablate", ab.as_dict(), stats)
    return spec, key


def analysis_key(mkey: str, ap: AnalysisPlan, sources: dict[str, Source], cfg: StudyConfig) -> str:
    """The cache key of one analysis of one model: what decides its state."""
    return digest(mkey, dataset_keys(ap, sources, cfg), ap.name, ap.cls.state_version, ap.params, ap.views,
                  cfg.dtype, cfg.seed)


def pair_keys(mkey_a: str, mkey_b: str, ap: AnalysisPlan, sources: dict[str, Source],
              cfg: StudyConfig) -> tuple[str, str]:
    """The cache keys of a pair stage of models (a, b): its folder's (both models' keys) and its entry's."""
    pkey = digest(mkey_a, mkey_b)
    return pkey, digest(pkey, dataset_keys(ap, sources, cfg), ap.name, ap.cls.state_version, ap.params, cfg.dtype,
                        cfg.seed)


def dataset_keys(ap: AnalysisPlan, sources: dict[str, Source], cfg: StudyConfig) -> dict[str, Any]:
    """What decides each slot's pixels and batches: the dataset's spec, the ids selected, how images are resized
    (`vitscope.data.transforms.PIXELS_VERSION`: results computed from other pixels are not reused) and the
    batch size that cuts them into chunks (a forward's rounding depends on its batch: entries computed in other
    batches would differ in the last bits, so a cache entry is bit for bit what this study would compute).
    A tiled dataset adds the patch size its tiles are cut for (``tile_patch``: an integer, or 'model' where each
    model's own: that one is fixed by the model key every analysis key starts from, so models of other patch
    sizes never share a state, and a resume reads the state of its own cut)."""
    from vitscope.data.catalog import tile_patch
    from vitscope.data.transforms import PIXELS_VERSION
    from vitscope.study.config import study_datasets

    dcs = study_datasets(cfg)
    return {slot: {**asdict(dcs[name]), "selected": sources[name].selection if name in sources else None,
                   "pixels": PIXELS_VERSION, "batch_size": cfg.batch_size,
                   **({"tile_patch": tp} if (tp := tile_patch(dcs[name])) is not None else {})}
            for slot, name in ap.slots.items()}
