"""Task sets built from the synthetic scenes of `vitscope.data.synthetic`: videos with per-frame masks
(mask propagation), same-class image pairs (keypoint correspondence) and an instance-retrieval split
(queries, database, revisited-style easy / hard / junk ground truth).

All are deterministic for their seed and drawn at any resolution; each implements the dataset contract
(``name``, ``classes``, ``len``, ``batches(batch_size, preprocessing, start, indices)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from vitscope.data.base import Batch, RetrievalSplit, Sample
from vitscope.data.synthetic import (
    SHAPE_CLASSES,
    SHAPES,
    Obj,
    Scene,
    _blob,
    _far_colours,
    batches_of,
    random_texture,
    render,
    sample_scene,
    to_sample,
)
from vitscope.errors import InputError
from vitscope.models.registry import Preprocessing

_EXTENT = 1.2  # every shape lies within this radius of its centre, in object units


# ---------------------------------------------------------------- videos


@dataclass(frozen=True)
class VideoPlan:
    """A video's static part (background, clutter, distractors), its targets' start and end poses
    (cx, cy, scale, angle, aspect) and the occluder's path (start, end centre)."""

    background: tuple[Obj, ...]
    background_texture: object
    targets: tuple[Obj, ...]
    ends: tuple[tuple[float, float, float, float], ...]   # end (cx, cy, scale, angle) per target
    occluder: Obj | None
    occluder_end: tuple[float, float] | None


@dataclass
class SyntheticVideos:
    """``n_videos`` clips of ``n_frames``: 1-2 target objects (ids 1, 2) moving on straight lines while
    rotating and scaling, over a static cluttered background, with an occluder sweeping across.

    Item ``i`` is frame ``i % n_frames`` of video ``i // n_frames``; each has ``objects`` (target ids),
    ``mask`` (any target), keypoints of target 1, ``frame`` and ``sequence``. `poses` gives the declared
    motion. rotation / scaling / occluder switch those parts of the motion off.
    """

    n_videos: int = 8
    n_frames: int = 16
    seed: int = 0
    size: int | None = None
    max_objects: int = 2
    rotation: bool = True
    scaling: bool = True
    occluder: bool = True
    name: str = "synthetic-videos"

    @property
    def classes(self) -> list[str]:
        return list(SHAPES)

    def __len__(self) -> int:
        return self.n_videos * self.n_frames

    def plan(self, video: int) -> VideoPlan:
        g = np.random.default_rng([self.seed, video, 7])
        a = np.random.default_rng([self.seed, video, 8])
        n = int(g.integers(1, self.max_objects + 1))
        classes = g.choice(len(SHAPE_CLASSES), size=n, replace=False)
        targets, ends = [], []
        for t, cls in enumerate(classes):
            s0 = float(g.uniform(0.12, 0.22))
            s1 = s0 * float(np.exp(g.uniform(-0.25, 0.25))) if self.scaling else s0
            aspect = float(np.exp(g.uniform(-0.15, 0.15)))
            m = _EXTENT * max(s0, s1) * math.sqrt(max(aspect, 1 / aspect)) + 0.01
            p0 = g.uniform(m, 1 - m, 2)
            step = g.uniform(0.15, 0.4) * np.array([math.cos(d := g.uniform(0, 2 * np.pi)), math.sin(d)])
            p1 = max((np.clip(p0 + step, m, 1 - m), np.clip(p0 - step, m, 1 - m)),
                     key=lambda q: float(np.abs(q - p0).sum()))  # the way with more room
            a0 = float(g.uniform(-np.pi / 4, np.pi / 4))
            a1 = a0 + float(g.uniform(-np.pi / 3, np.pi / 3)) if self.rotation else a0
            targets.append(Obj(int(cls), float(p0[0]), float(p0[1]), s0, a0, aspect, random_texture(a),
                               target=t + 1))
            ends.append((float(p1[0]), float(p1[1]), s1, a1))
        bg_tex = _far_colours(random_texture(a), targets[0].texture)
        static: list[Obj] = [_blob(g, *g.uniform(0, 1, 2), float(g.uniform(0.04, 0.14)), random_texture(a))
                             for _ in range(int(g.integers(2, 6)))]
        others = [c for c in range(len(SHAPE_CLASSES)) if c not in classes]
        static += [Obj(int(g.choice(others)), *g.uniform(0, 1, 2), float(g.uniform(0.05, 0.1)),
                       float(g.uniform(-np.pi, np.pi)), 1.0, random_texture(a)) for _ in range(int(g.integers(0, 3)))]
        occ, occ_end = None, None
        if self.occluder:
            d = g.uniform(0, 2 * np.pi)
            c0 = np.array([0.5, 0.5]) + 0.6 * np.array([math.cos(d), math.sin(d)])
            occ = _blob(g, float(c0[0]), float(c0[1]), float(g.uniform(0.1, 0.18)), random_texture(a))
            c1 = np.array([targets[0].cx, targets[0].cy]) * 2 - c0 + g.uniform(-0.1, 0.1, 2)
            occ_end = (float(c1[0]), float(c1[1]))
        return VideoPlan(tuple(static), bg_tex, tuple(targets), tuple(ends), occ, occ_end)

    def poses(self, video: int) -> np.ndarray:
        """Declared motion: (n_frames, n_targets, 5) ``cx, cy, scale, angle, aspect`` (image units, radians)."""
        p = self.plan(video)
        out = np.zeros((self.n_frames, len(p.targets), 5))
        for t in range(self.n_frames):
            for k, obj in enumerate(self._frame_objects(p, t)[1]):
                out[t, k] = (obj.cx, obj.cy, obj.scale, obj.angle, obj.aspect)
        return out

    def _frame_objects(self, p: VideoPlan, t: int) -> tuple[list[Obj], list[Obj]]:
        w = t / max(self.n_frames - 1, 1)
        targets = [replace(o, cx=(1 - w) * o.cx + w * e[0], cy=(1 - w) * o.cy + w * e[1],
                           scale=o.scale * (e[2] / o.scale) ** w, angle=(1 - w) * o.angle + w * e[3])
                   for o, e in zip(p.targets, p.ends, strict=True)]
        objs = list(p.background) + targets
        if p.occluder is not None:
            objs.append(replace(p.occluder, cx=(1 - w) * p.occluder.cx + w * p.occluder_end[0],
                                cy=(1 - w) * p.occluder.cy + w * p.occluder_end[1], angle=p.occluder.angle + w))
        return objs, targets

    def scene(self, video: int, frame: int) -> Scene:
        p = self.plan(video)
        objs, targets = self._frame_objects(p, frame)
        return Scene(p.background_texture, tuple(objs), targets[0].cls, noise=0.02,
                     noise_seed=(self.seed, video, frame, 9))

    def sample(self, i: int, size: int | None = None) -> Sample:
        video, frame = divmod(i, self.n_frames)
        s = to_sample(self.scene(video, frame), size or self.size or 224, index=i)
        return replace(s, mask=s.objects > 0, parts=None, frame=frame, sequence=f"video{video:04d}")

    def unit_bounds(self) -> list[int]:
        """The first item of every video (a video is never split across shards or subsamples)."""
        return [v * self.n_frames for v in range(self.n_videos)]

    def raw_samples(self, indices: list[int], size: int) -> Iterator[Sample]:
        """Items drawn at ``size`` (for `vitscope.data.tiling.TiledDataset`)."""
        return (self.sample(int(i), self.size or size) for i in indices)

    def sequence(self, video: int, size: int | None = None) -> list[Sample]:
        """Every frame of one video, in order."""
        return [self.sample(video * self.n_frames + t, size) for t in range(self.n_frames)]

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]:
        ids = list(range(len(self))) if indices is None else list(indices)
        size = self.size or preprocessing.input_size
        yield from batches_of((self.sample(j, size) for j in ids[start:]), batch_size, preprocessing)


# ---------------------------------------------------------------- correspondence pairs


@dataclass
class SyntheticPairs:
    """``n_pairs`` image pairs of the same class, different instances (colour, texture, pose, background).

    Batches hold the source images; ``batch.extra['target']`` is the `Batch` of the target images, and
    keypoint row k is the same semantic keypoint in both (``extra['common']``: visible in both).

    ``flat=True`` (the form a study pass needs: every image goes through the model): item 2p is the source and
    2p + 1 the target of pair p, with ``extra['pair']``, ``extra['role']`` (0 source, 1 target) and
    ``extra['category']`` (class names); `unit_bounds` keeps a pair together.
    """

    n_pairs: int = 64
    seed: int = 0
    size: int | None = None
    name: str = "synthetic-pairs"
    flat: bool = False

    @property
    def classes(self) -> list[str]:
        return list(SHAPES)

    def __len__(self) -> int:
        return 2 * self.n_pairs if self.flat else self.n_pairs

    def unit_bounds(self) -> list[int]:
        """Flat: every pair's source item (a pair is one unit); else every item."""
        return list(range(0, len(self), 2 if self.flat else 1))

    def raw_samples(self, indices: list[int], size: int) -> Iterator[Sample]:
        """Flat items drawn at ``size`` with ``pair``, ``role`` and ``category`` (for tiling)."""
        if not self.flat:
            raise InputError("only flat pairs (flat=True) can be tiled")
        last: tuple[int, tuple[Sample, Sample]] | None = None
        for i in indices:
            p, role = divmod(int(i), 2)
            if last is None or last[0] != p:
                last = (p, self.pair(p, self.size or size))
            s = last[1][role]
            yield replace(s, index=int(i), extra={**s.extra, "pair": p, "role": role,
                                                  "category": SHAPES[s.label]})

    def pair(self, p: int, size: int | None = None) -> tuple[Sample, Sample]:
        size = size or self.size or 224
        cls = int(np.random.default_rng([self.seed, p, 21]).integers(len(SHAPE_CLASSES)))
        src = to_sample(sample_scene(self.seed, p, label=cls, stream=1), size, index=p)
        trg = to_sample(sample_scene(self.seed, p, label=cls, stream=2), size, index=p)
        return src, trg

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]:
        ids = list(range(len(self))) if indices is None else list(indices)
        size = self.size or preprocessing.input_size
        if self.flat:
            yield from flat_pair_batches(ids[start:], batch_size, preprocessing, lambda p: self.pair(p, size),
                                         list(SHAPES))
            return
        for i in range(start, len(ids), batch_size):
            pairs = [self.pair(p, size) for p in ids[i:i + batch_size]]
            src = next(batches_of(iter([a for a, _ in pairs]), len(pairs), preprocessing))
            trg = next(batches_of(iter([b for _, b in pairs]), len(pairs), preprocessing))
            src.extra["target"] = trg
            src.extra["common"] = (src.keypoints[..., 2] > 0) & (trg.keypoints[..., 2] > 0)
            yield src


def flat_pair_batches(ids: list[int], batch_size: int, preprocessing: Preprocessing,
                      pair: Callable[[int], tuple[Sample, Sample]], classes: list[str]) -> Iterator[Batch]:
    """Batches of flattened pairs: item i is side ``i % 2`` (0 source, 1 target) of pair ``i // 2``, with
    ``extra['pair']``, ``extra['role']`` and ``extra['category']``; each pair is made once."""
    cache: dict[int, tuple[Sample, Sample]] = {}

    def samples() -> Iterator[Sample]:
        for i in ids:
            p, role = divmod(int(i), 2)
            if p not in cache:
                cache.clear()
                cache[p] = pair(p)
            s = cache[p][role]
            yield replace(s, index=int(i), extra={**s.extra, "pair": p, "role": role})

    for b in batches_of(samples(), batch_size, preprocessing, ("pair", "role")):
        b.extra["category"] = [classes[int(c)] for c in b.labels] if b.labels is not None else None
        yield b


# ---------------------------------------------------------------- instance retrieval


@dataclass(frozen=True)
class View:
    """How a database view differs from its query: rotation (radians), log scale and log aspect change,
    occluded fraction of the object (measured), and the resulting difficulty."""

    angle: float
    log_scale: float
    log_aspect: float
    occluded: float
    difficulty: str


EASY_LIMITS = {"angle": math.radians(20), "log_scale": math.log(1.25), "log_aspect": math.log(1.15),
               "occluded": 0.2}
JUNK_OCCLUDED = 0.7


def difficulty(angle: float, log_scale: float, log_aspect: float, occluded: float) -> str:
    """'junk' when most of the object is hidden, 'easy' when every change is within `EASY_LIMITS`, else 'hard'."""
    if occluded >= JUNK_OCCLUDED:
        return "junk"
    easy = (abs(angle) < EASY_LIMITS["angle"] and abs(log_scale) < EASY_LIMITS["log_scale"]
            and abs(log_aspect) < EASY_LIMITS["log_aspect"] and occluded < EASY_LIMITS["occluded"])
    return "easy" if easy else "hard"


@dataclass
class SyntheticRetrieval(RetrievalSplit):
    """Instance retrieval: ``n_queries`` query images, one per instance (shape + colours + texture), and a
    database of ``views`` other views of each (new background, clutter; the first half small changes,
    the rest large rotation / scale / aspect changes and occlusion) plus ``n_distractors`` images of
    other instances of the same classes.

    Items 0..n_queries-1 are the queries, then the database. `gnd` follows the revisited Oxford/Paris
    format (per query: database indices 'easy', 'hard', 'junk'), difficulty from the measured change
    (`difficulty`); `instances` gives every item's instance id. Batches carry ``extra['instance']``.
    """

    n_queries: int = 24
    views: int = 4
    n_distractors: int = 48
    seed: int = 0
    size: int | None = None
    name: str = "synthetic-retrieval"
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def classes(self) -> list[str]:
        return list(SHAPES)

    @property
    def n_database(self) -> int:
        return self.n_queries * self.views + self.n_distractors

    def __len__(self) -> int:
        return self.n_queries + self.n_database

    def _instance(self, inst: int) -> tuple[int, object, float]:
        g = np.random.default_rng([self.seed, inst, 31])
        return int(g.integers(len(SHAPE_CLASSES))), random_texture(g), float(np.exp(g.uniform(-0.15, 0.15)))

    def instance_of(self, i: int) -> int:
        """Instance id of item ``i`` (queries: 0..n_queries-1; distractor images: their own ids)."""
        if i < self.n_queries:
            return i
        j = i - self.n_queries
        if j < self.n_queries * self.views:
            return j // self.views
        return self.n_queries + j - self.n_queries * self.views

    @cached_property
    def instances(self) -> np.ndarray:
        return np.array([self.instance_of(i) for i in range(len(self))])

    def _view_params(self, i: int) -> tuple[int, int, tuple[float, float, float, bool]]:
        """(instance, kind: 0 query / 1 small change / 2 large change / 3 distractor,
        (d_angle, d_log_scale, d_log_aspect, occluder))."""
        inst = self.instance_of(i)
        if i < self.n_queries:
            return inst, 0, (0.0, 0.0, 0.0, False)
        j = i - self.n_queries
        g = np.random.default_rng([self.seed, i, 32])
        if j >= self.n_queries * self.views:
            return inst, 3, (float(g.uniform(-0.5, 0.5)), float(g.uniform(-0.3, 0.3)), 0.0, bool(g.uniform() < 0.3))
        if j % self.views < (self.views + 1) // 2:
            return inst, 1, (float(g.uniform(-0.12, 0.12)), float(g.uniform(-0.1, 0.1)),
                             float(g.uniform(-0.05, 0.05)), False)
        sign = g.choice([-1.0, 1.0], 3)
        return inst, 2, (float(sign[0] * g.uniform(math.radians(25), math.radians(60))),
                         float(sign[1] * g.uniform(0.25, 0.45)), float(sign[2] * g.uniform(0.1, 0.3)),
                         bool(g.uniform() < 0.7))

    def scene(self, i: int) -> Scene:
        inst, kind, (da, ds, dasp, occluder) = self._view_params(i)
        cls, texture, aspect = self._instance(inst)
        q = np.random.default_rng([self.seed, inst, 33])  # the query's pose
        angle, scale = float(q.uniform(-np.pi / 6, np.pi / 6)), float(q.uniform(0.25, 0.32))
        base = sample_scene(self.seed, i, label=cls, stream=3)  # new background and clutter per view
        g = np.random.default_rng([self.seed, i, 34])
        scale = scale * math.exp(ds)
        aspect = aspect * math.exp(dasp)
        m = _EXTENT * scale * math.sqrt(max(aspect, 1 / aspect))
        cx, cy = g.uniform(min(m, 0.5), max(1 - m, 0.5), 2)
        main = Obj(cls, float(cx), float(cy), scale, angle + da, aspect, texture, target=1)
        behind = next(k for k, o in enumerate(base.objects) if o.target)
        objs = [*base.objects[:behind], main]  # the clutter and distractors behind, not the base's object
        if occluder:
            d, t = scale * float(g.uniform(0.2, 0.6)), g.uniform(0, 2 * np.pi)
            objs.append(_blob(g, float(cx + d * math.cos(t)), float(cy + d * math.sin(t)),
                              scale * float(g.uniform(0.6, 0.9)), random_texture(g)))
        return Scene(_far_colours(base.background, texture), tuple(objs), cls, noise=base.noise,
                     noise_seed=(self.seed, i, 35), instance=inst)

    def view(self, i: int) -> View | None:
        """The change from item ``i``'s query (None for queries and distractors); occlusion measured at 96 px."""
        if i not in self._cache:
            inst, kind, (da, ds, dasp, _) = self._view_params(i)
            if kind in (0, 3):
                self._cache[i] = None
            else:
                occluded = 1.0 - render(self.scene(i), 96).visible.get(1, 0.0)
                self._cache[i] = View(da, ds, dasp, occluded, difficulty(da, ds, dasp, occluded))
        return self._cache[i]

    @cached_property
    def gnd(self) -> list[dict[str, list[int]]]:
        """Per query: database indices (0 = first database item) of its 'easy', 'hard' and 'junk' views."""
        out = []
        for q in self.queries:
            d: dict[str, list[int]] = {"easy": [], "hard": [], "junk": []}
            for v in range(self.views):
                i = self.n_queries + q * self.views + v
                d[self.view(i).difficulty].append(i - self.n_queries)
            out.append(d)
        return out

    def sample(self, i: int, size: int | None = None) -> Sample:
        s = to_sample(self.scene(i), size or self.size or 224, index=i)
        s.extra["role"] = "query" if i < self.n_queries else "database"
        return s

    def unit_bounds(self) -> list[int]:
        """One unit: the ground truth refers to every database image, so the split is never subsampled."""
        return [0]

    def raw_samples(self, indices: list[int], size: int) -> Iterator[Sample]:
        return (self.sample(int(i), self.size or size) for i in indices)

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]:
        """Batches with ``extra['instance']`` and the retrieval layout: ``extra['query_index']`` /
        ``extra['db_index']`` (-1 where it does not apply) and ``extra['gnd']`` (the query's easy / hard / junk
        database indices, None for database images)."""
        ids = list(range(len(self))) if indices is None else list(indices)
        size = self.size or preprocessing.input_size
        for b in batches_of((self.sample(j, size) for j in ids[start:]), batch_size, preprocessing,
                            ("instance",)):
            yield with_retrieval_layout(b, self.n_queries, self.gnd)


def with_retrieval_layout(b: Batch, n_queries: int, gnd: list[dict[str, list[int]]]) -> Batch:
    """Add ``query_index``, ``db_index`` and ``gnd`` to a batch of a `RetrievalSplit` (items 0..n_queries-1
    the queries, then the database)."""
    idx = b.index.long()
    b.extra["query_index"] = torch.where(idx < n_queries, idx, torch.full_like(idx, -1))
    b.extra["db_index"] = torch.where(idx >= n_queries, idx - n_queries, torch.full_like(idx, -1))
    b.extra["gnd"] = [gnd[i] if i < n_queries else None for i in idx.tolist()]
    return b


def medium_hard(gnd: list[dict[str, list[int]]]) -> dict[str, list[dict[str, list[int]]]]:
    """The revisited protocols from an easy/hard/junk ground truth: Medium (positives easy + hard, junk
    ignored) and Hard (positives hard; easy and junk ignored), each as ``{'ok': [...], 'junk': [...]}``."""
    return {
        "medium": [{"ok": g["easy"] + g["hard"], "junk": list(g["junk"])} for g in gnd],
        "hard": [{"ok": list(g["hard"]), "junk": g["junk"] + g["easy"]} for g in gnd],
    }


__all__ = ["EASY_LIMITS", "JUNK_OCCLUDED", "SyntheticPairs", "SyntheticRetrieval", "SyntheticVideos", "VideoPlan",
           "View", "difficulty", "flat_pair_batches", "medium_hard", "with_retrieval_layout"]
