"""The synthetic benchmark: determinism, ground truth aligned with pixels, variants, videos, pairs,
retrieval, and that raw pixels do not give the class away."""

import math
import warnings

import numpy as np
import pytest
import torch

from vitscope.data import SyntheticShapes, make_dataset
from vitscope.data.synthetic import (
    CLASS_TEXTURES,
    KEYPOINT_NAMES,
    PART_NAMES,
    SHAPE_CLASSES,
    SHAPES,
    TEXTURE_KINDS,
    Obj,
    Scene,
    Texture,
    part_ids,
    render,
)
from vitscope.data.synthetic_tasks import (
    EASY_LIMITS,
    SyntheticPairs,
    SyntheticRetrieval,
    SyntheticVideos,
    medium_hard,
)
from vitscope.models.registry import Preprocessing
from vitscope.study.config import DatasetConfig

FLAT_WHITE = Texture(0, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), 1.0, 0.0, 0.0, ())
FLAT_BLACK = Texture(0, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), 1.0, 0.0, 0.0, ())


def canonical(cls: int, size: int = 128, scale: float = 0.38, angle: float = 0.0):
    """Class ``cls`` alone, upright, centred, white on black."""
    obj = Obj(cls, 0.5, 0.5, scale, angle, 1.0, FLAT_WHITE, target=1)
    return render(Scene(FLAT_BLACK, (obj,), cls), size)


def _bytes(s):
    return b"".join(np.ascontiguousarray(a).tobytes() for a in (s.image, s.mask, s.parts, s.keypoints, s.bbox))


def test_same_seed_gives_identical_bytes_and_another_seed_does_not():
    a = [SyntheticShapes(n=6, seed=3).sample(i, 48) for i in range(6)]
    b = [SyntheticShapes(n=6, seed=3).sample(i, 48) for i in reversed(range(6))][::-1]  # order does not matter
    c = [SyntheticShapes(n=6, seed=4).sample(i, 48) for i in range(6)]
    assert all(_bytes(x) == _bytes(y) for x, y in zip(a, b, strict=True))
    assert all(not np.array_equal(x.image, y.image) for x, y in zip(a, c, strict=True))
    pre = Preprocessing(input_size=32)
    x1 = torch.cat([bt.images for bt in SyntheticShapes(n=5, seed=1).batches(2, pre)])
    x2 = torch.cat([bt.images for bt in SyntheticShapes(n=5, seed=1).batches(3, pre)])
    assert torch.equal(x1, x2)


def test_batches_keep_the_dataset_contract():
    ds = SyntheticShapes(n=7, seed=0)
    assert ds.name == "synthetic-shapes" and len(ds) == 7 and ds.classes == list(SHAPES) and len(ds.classes) >= 10
    pre = Preprocessing(input_size=40)
    batches = list(ds.batches(3, pre, start=2))
    assert [len(b) for b in batches] == [3, 2]
    assert torch.cat([b.index for b in batches]).tolist() == [2, 3, 4, 5, 6]
    b = batches[0]
    assert b.images.shape == (3, 3, 40, 40) and b.masks.shape == (3, 40, 40) and b.masks.dtype == torch.bool
    assert b.parts.shape == (3, 40, 40) and b.keypoints.shape[0] == 3 and b.keypoints.shape[2] == 3
    mean, std = torch.tensor(pre.mean).view(1, 3, 1, 1), torch.tensor(pre.std).view(1, 3, 1, 1)
    raw = b.images * std + mean
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5
    assert [int(x) for x in b.labels] == [ds.scene(i).label for i in (2, 3, 4)]
    only = list(ds.batches(4, pre, indices=[6, 0]))
    assert only[0].index.tolist() == [6, 0]
    # drawn at another size than the model's: images, masks and keypoints are all brought to the input size
    small = next(SyntheticShapes(n=2, seed=0, size=20).batches(2, pre))
    assert small.images.shape[-2:] == (40, 40) and small.masks.shape[-2:] == (40, 40)
    assert torch.allclose(small.keypoints[..., :2], torch.from_numpy(
        np.stack([SyntheticShapes(n=2, seed=0).sample(i, 20).keypoints[:, :2] for i in range(2)])) * 2)
    assert make_dataset(DatasetConfig(name="synthetic-shapes", n_images=5, seed=2, size=24)).n == 5


def test_scene_is_the_same_at_every_resolution():
    ds = SyntheticShapes(n=4, seed=5)
    for i in range(4):
        lo, hi = ds.sample(i, 32), ds.sample(i, 128)
        assert lo.label == hi.label
        np.testing.assert_allclose(hi.keypoints[:, :2], lo.keypoints[:, :2] * 4, rtol=1e-5, atol=1e-4)
        down = hi.mask.reshape(32, 4, 32, 4).mean(axis=(1, 3)) > 0.5
        iou = (down & lo.mask).sum() / max((down | lo.mask).sum(), 1)
        assert iou > 0.7


def test_part_masks_partition_the_foreground():
    ds = SyntheticShapes(n=40, seed=11)
    for i in range(40):
        s = ds.sample(i, 64)
        assert np.array_equal(s.parts > 0, s.mask)  # every object pixel has exactly one part, nothing else has one
        present = set(np.unique(s.parts[s.mask]).tolist())
        assert present <= set(part_ids(s.label))
        assert all(PART_NAMES[p - 1].startswith(SHAPES[s.label] + "/") for p in present)
    for c, cls in enumerate(SHAPE_CLASSES):  # each class's parts all show up when it is alone
        r = canonical(c)
        assert set(np.unique(r.parts[r.objects == 1]).tolist()) == set(part_ids(c)), cls.name
        assert len(cls.parts) >= 2


def test_classes_differ_by_shape():
    masks = [canonical(c, 96).objects == 1 for c in range(len(SHAPES))]
    for a in range(len(masks)):
        for b in range(a + 1, len(masks)):
            iou = (masks[a] & masks[b]).sum() / (masks[a] | masks[b]).sum()
            assert iou < 0.8, (SHAPES[a], SHAPES[b], iou)


def test_every_keypoint_is_on_its_object_when_nothing_hides_it():
    for c in range(len(SHAPES)):
        for angle in (-0.7, 0.0, 0.5):
            r = canonical(c, 160, angle=angle)
            kp = r.keypoints[1]
            assert len(kp) == len(KEYPOINT_NAMES[SHAPES[c]])
            assert kp[:, 2].all(), (SHAPES[c], angle, kp)
            assert r.objects[kp[:, 1].astype(int), kp[:, 0].astype(int)].all()


def test_keypoint_visibility_matches_the_pixels_and_ids_are_semantic():
    ds = SyntheticShapes(n=80, seed=2)
    part_of: dict[tuple[int, int], list[int]] = {}
    hidden = 0
    for i in range(80):
        s = ds.sample(i, 128)
        k = s.extra["n_keypoints"]
        assert not s.keypoints[k:].any()  # padding rows are empty
        for j, (x, y, v) in enumerate(s.keypoints[:k]):
            inside = 0 <= x < 128 and 0 <= y < 128
            if v:
                assert s.mask[int(y), int(x)]
                part_of.setdefault((s.label, j), []).append(int(s.parts[int(y), int(x)]))
            elif inside:
                assert not s.mask[int(y), int(x)]  # inside the image but not visible: something covers it
                hidden += 1
    assert hidden > 0  # occlusion happens
    # the same keypoint id falls on the same part of every instance of its class
    for key, parts in part_of.items():
        assert max(parts.count(p) for p in set(parts)) >= 0.9 * len(parts), (SHAPES[key[0]], key[1], parts)


def test_cue_conflict_images_wear_another_class_texture_on_an_unchanged_shape():
    n = 30
    plain = SyntheticShapes(n=n, seed=7)
    bound = SyntheticShapes(n=n, seed=7, variant="texture-bound")
    conflict = SyntheticShapes(n=n, seed=7, variant="cue-conflict")
    assert conflict.name == "synthetic-cue-conflict"
    assert make_dataset(DatasetConfig(name="synthetic-cue-conflict", n_images=3)).variant == "cue-conflict"
    texture_labels = []
    for i in range(n):
        p, b, c = plain.sample(i, 64), bound.sample(i, 64), conflict.sample(i, 64)
        assert p.label == b.label == c.label
        assert np.array_equal(p.mask, c.mask) and np.array_equal(p.parts, c.parts)  # same geometry
        assert np.array_equal(p.keypoints, c.keypoints) and np.array_equal(p.mask, b.mask)
        assert b.extra["texture_label"] == b.label
        t = c.extra["texture_label"]
        assert t != c.label
        texture_labels.append(t)
        kind, c1, c2 = CLASS_TEXTURES[t][:3]
        main = next(o for o in conflict.scene(i).objects if o.target)
        assert TEXTURE_KINDS[main.texture.kind] == kind
        # the object's pixels lie between the two colours of class t's texture (jitter +-0.05, noise)
        px = c.image[c.mask]
        a, d = np.asarray(c1), np.asarray(c2) - np.asarray(c1)
        w = np.clip(((px - a) @ d) / (d @ d), 0, 1)
        dist = np.linalg.norm(px - (a + w[:, None] * d), axis=1)
        assert np.quantile(dist, 0.95) < 0.3
    assert len(set(texture_labels)) > 5
    batch = next(conflict.batches(4, Preprocessing(input_size=32)))
    assert (batch.extra["texture_labels"] != batch.labels).all()


def _centroid(mask):
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean() + 0.5, ys.mean() + 0.5])


def test_video_masks_follow_the_declared_motion():
    size = 96
    vids = SyntheticVideos(n_videos=3, n_frames=6, seed=1, size=size, max_objects=1, occluder=False)
    for v in range(3):
        poses = vids.poses(v)[:, 0]
        frames = vids.sequence(v)
        cls = frames[0].label
        # the class's centroid in its own frame, from a large upright render
        ref = canonical(cls, 400, scale=0.4)
        c = _centroid(ref.objects == 1) / 400
        u, w = (c[0] - 0.5) / 0.4, (c[1] - 0.5) / 0.4
        moved = np.linalg.norm(poses[-1, :2] - poses[0, :2]) * size
        assert moved > 5
        for t, s in enumerate(frames):
            assert s.frame == t and s.sequence == f"video{v:04d}" and s.index == v * 6 + t
            cx, cy, scale, angle, aspect = poses[t]
            r = math.sqrt(aspect)
            a, b = u * scale * r, w * scale / r
            expected = np.array([cx + math.cos(angle) * a - math.sin(angle) * b,
                                 cy + math.sin(angle) * a + math.cos(angle) * b]) * size
            assert np.abs(_centroid(s.objects == 1) - expected).max() < 0.75, (v, t)
            assert np.array_equal(s.mask, s.objects > 0)
    occluded = SyntheticVideos(n_videos=4, n_frames=8, seed=1, size=48)
    areas = [[(s.objects == 1).sum() for s in occluded.sequence(v)] for v in range(4)]
    assert any(min(a) < 0.8 * max(a) for a in areas)  # the occluder does cover the object in some frames
    b = next(occluded.batches(8, Preprocessing(input_size=48)))
    assert b.frames.tolist() == list(range(8)) and b.sequences == ["video0000"] * 8 and b.objects is not None


def test_pairs_share_the_class_and_the_meaning_of_keypoint_rows():
    pairs = SyntheticPairs(n_pairs=24, seed=0, size=128)
    agree = total = 0
    for p in range(24):
        a, b = pairs.pair(p)
        assert a.label == b.label and not np.array_equal(a.image, b.image)
        for ka, kb in zip(a.keypoints, b.keypoints, strict=True):
            if ka[2] and kb[2]:
                total += 1
                agree += a.parts[int(ka[1]), int(ka[0])] == b.parts[int(kb[1]), int(kb[0])]
    assert total > 50 and agree >= 0.9 * total
    batch = next(pairs.batches(4, Preprocessing(input_size=64)))
    tgt = batch.extra["target"]
    assert torch.equal(batch.labels, tgt.labels) and tgt.images.shape == batch.images.shape
    assert torch.equal(batch.extra["common"], (batch.keypoints[..., 2] > 0) & (tgt.keypoints[..., 2] > 0))


def test_retrieval_positives_are_the_same_instance_and_hard_means_harder():
    r = SyntheticRetrieval(n_queries=10, views=4, n_distractors=12, seed=3, size=64)
    assert len(r) == 10 + 40 + 12 and r.database[0] == 10
    inst = r.instances
    for q, g in enumerate(r.gnd):
        pos = g["easy"] + g["hard"] + g["junk"]
        assert len(pos) == 4 and g["easy"]
        assert all(inst[r.n_queries + j] == inst[q] for j in pos)
        qscene = r.scene(q)
        qmain = next(o for o in qscene.objects if o.target)
        for j in pos:  # same shape, colours and texture; another background
            s = r.scene(r.n_queries + j)
            m = next(o for o in s.objects if o.target)
            assert (m.cls, m.texture) == (qmain.cls, qmain.texture)
            assert s.background != qscene.background
    negatives = set(inst[r.n_queries + 40:].tolist())
    assert not negatives & set(inst[:10].tolist())
    views = [r.view(r.n_queries + j) for j in range(40)]
    easy = [v for v in views if v.difficulty == "easy"]
    hard = [v for v in views if v.difficulty == "hard"]
    assert easy and hard
    for v in easy:
        assert abs(v.angle) < EASY_LIMITS["angle"] and v.occluded < EASY_LIMITS["occluded"]
    for v in hard:
        assert (abs(v.angle) >= EASY_LIMITS["angle"] or abs(v.log_scale) >= EASY_LIMITS["log_scale"]
                or abs(v.log_aspect) >= EASY_LIMITS["log_aspect"] or v.occluded >= EASY_LIMITS["occluded"])
    assert np.mean([abs(v.angle) for v in hard]) > 2 * np.mean([abs(v.angle) for v in easy])
    assert np.mean([v.occluded for v in hard]) > np.mean([v.occluded for v in easy])
    protocols = medium_hard(r.gnd)
    assert protocols["hard"][0]["ok"] == r.gnd[0]["hard"] and set(r.gnd[0]["easy"]) <= set(protocols["hard"][0]["junk"])
    b = next(r.batches(8, Preprocessing(input_size=32)))
    assert b.extra["instance"].tolist() == inst[:8].tolist()


def _probe_accuracy(n_train: int, n_test: int, C: float) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    ds = SyntheticShapes(n=n_train + n_test, seed=0, size=32)
    X = np.stack([ds.sample(i).image.reshape(-1) for i in range(len(ds))])
    y = np.array([ds.scene(i).label for i in range(len(ds))])
    scaler = StandardScaler().fit(X[:n_train])
    # one BLAS thread: on a shared 2-core machine threaded BLAS made this 6x slower, not faster
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore")  # convergence warnings: the probe is fitted well enough to judge
        clf = LogisticRegression(C=C, max_iter=200, tol=1e-3).fit(scaler.transform(X[:n_train]), y[:n_train])
    return float(clf.score(scaler.transform(X[n_train:]), y[n_train:]))


# 12 classes: chance is 1/12. A linear read-out of raw pixels above 3x chance would mean colour, position
# or area statistics carry the class, not shape; the benchmark must stay below that.
PROBE_BOUND = 3 / len(SHAPES)


def test_a_linear_probe_on_raw_pixels_is_far_from_solving_it_quick():
    assert _probe_accuracy(800, 400, C=1.0) < PROBE_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("C", [1e-2, 1.0])
def test_a_linear_probe_on_raw_pixels_is_far_from_solving_it(C):
    assert _probe_accuracy(2500, 1000, C=C) < PROBE_BOUND
