"""COCO object level and PartImageNet part level as Walmer et al. 2023 measure them (§5.3, Fig. 8): one
mask-weighted mean of patch tokens per annotated instance, labelled by its category (or part); k-means with the
authors' k; dense tiling of both formats with their maps cut like the image."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.models.registry import Preprocessing

PRE = Preprocessing(input_size=32, crop_pct=1.0)  # 32 x 32 files: the model sees them as they are
CATS = [{"id": 3, "name": "cat"}, {"id": 5, "name": "dog"}, {"id": 9, "name": "kite"}]


def _rle(mask: np.ndarray, compressed: bool) -> dict:
    from pycocotools import mask as mask_utils

    if compressed:
        rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
        return {"size": rle["size"], "counts": rle["counts"].decode()}
    flat = mask.astype(np.uint8).ravel(order="F")  # column-major runs, starting with zeros
    counts, cur, n = [], 0, 0
    for v in flat:
        if v != cur:
            counts.append(n)
            cur, n = v, 0
        n += 1
    counts.append(n)
    return {"size": list(mask.shape), "counts": counts}


def _write_coco(root: Path, n_images: int, h: int = 32, w: int = 32, seed: int = 0, tiny_one: bool = True
                ) -> tuple[Path, list[list[dict]]]:
    """``n_images`` images (even ones PNG, odd ones JPEG) with 2-3 non-overlapping instances each, one per
    quadrant, drawn as polygons, compressed or uncompressed RLE; image 0 also holds a 4x4-pixel instance (below
    half a token). The image is each instance's colour on black. Returns the json and, per image, its
    annotations."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(40, 255, size=(16, 3))
    images, anns, per_image = [], [], []
    yy, xx = np.mgrid[0:h, 0:w]
    for i in range(n_images):
        name = f"im{i}.png" if i % 2 == 0 else f"im{i}.jpg"
        canvas = np.zeros((h, w, 3), np.uint8)
        mine = []
        quads = rng.permutation(4)[:rng.integers(2, 4)]
        for j, q in enumerate(quads.tolist()):
            y0, x0 = (q // 2) * (h // 2), (q % 2) * (w // 2)
            a0, b0 = y0 + int(rng.integers(0, 3)), x0 + int(rng.integers(0, 3))
            a1, b1 = y0 + h // 2 - int(rng.integers(0, 3)), x0 + w // 2 - int(rng.integers(0, 3))
            kind = (i + j) % 3
            if kind == 0:  # a polygon (a rectangle)
                seg = [[b0, a0, b1, a0, b1, a1, b0, a1]]
                box = np.zeros((h, w), bool)
                box[a0:a1, b0:b1] = True
            else:  # an ellipse as an RLE
                cy, cx, ry, rx = (a0 + a1) / 2, (b0 + b1) / 2, (a1 - a0) / 2, (b1 - b0) / 2
                box = ((yy + 0.5 - cy) / ry) ** 2 + ((xx + 0.5 - cx) / rx) ** 2 <= 1
                seg = _rle(box, compressed=kind == 1)
            cat = CATS[int(rng.integers(0, 3))]["id"]
            a = {"id": len(anns) + 1, "image_id": i + 1, "category_id": cat, "iscrowd": 0,
                 "area": float(box.sum()) + 0.01 * j, "bbox": [b0, a0, b1 - b0, a1 - a0], "segmentation": seg}
            canvas[box] = colours[len(anns) % 16]
            anns.append(a)
            mine.append(a)
        if tiny_one and i == 0:  # 16 pixels: a quarter token, left out at min_region_tokens = 0.5
            q = next(q for q in range(4) if q not in quads)
            y0, x0 = (q // 2) * (h // 2) + 4, (q % 2) * (w // 2) + 4
            a = {"id": len(anns) + 1, "image_id": 1, "category_id": 3, "iscrowd": 0, "area": 16.0,
                 "bbox": [x0, y0, 4, 4], "segmentation": [[x0, y0, x0 + 4, y0, x0 + 4, y0 + 4, x0, y0 + 4]]}
            anns.append(a)
            mine.append(a)
        (root / "images").mkdir(parents=True, exist_ok=True)
        Image.fromarray(canvas).save(root / "images" / name, **({"quality": 98} if name.endswith("jpg") else {}))
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        per_image.append(mine)
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATS}))
    return path, per_image


def _masks(path: Path, anns: list[dict]) -> list[np.ndarray]:
    """Each annotation's mask by pycocotools itself."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # pycocotools under numpy 2
        coco = COCO(str(path))
        return [coco.annToMask(a).astype(bool) for a in anns]


def _reference(feats: torch.Tensor, path: Path, per_image: list[list[dict]], label_of: dict[int, int],
               patch: int = 8, min_tokens: float = 0.5) -> tuple[torch.Tensor, list[int], list[int]]:
    """A slow loop over the annotations: per instance (largest first), its mask's share of each token's pixels,
    normalised, times the patch tokens; instances under ``min_tokens`` tokens' worth left out. Returns the
    vectors, their labels and their images."""
    vecs, labels, images = [], [], []
    for i, anns in enumerate(per_image):
        order = sorted(anns, key=lambda a: -a["area"])
        for a, m in zip(order, _masks(path, order), strict=True):
            gh, gw = m.shape[0] // patch, m.shape[1] // patch
            w = np.zeros((gh, gw))
            for r in range(gh):
                for c in range(gw):
                    w[r, c] = m[r * patch:(r + 1) * patch, c * patch:(c + 1) * patch].mean()
            if w.sum() < min_tokens:
                continue
            w = torch.from_numpy(w.ravel() / w.sum()).float()
            vecs.append(w @ feats[i])
            labels.append(label_of[a["category_id"]])
            images.append(i)
    return torch.stack(vecs), labels, images


def test_coco_gives_instances_their_category_labels_and_image_labels(tmp_path):
    from vitscope.data.formats import CocoInstances

    path, per_image = _write_coco(tmp_path, 4)
    ds = CocoInstances(tmp_path / "images", path)
    label_of = {c["id"]: k for k, c in enumerate(CATS)}
    for i, anns in enumerate(per_image):
        s = ds[i]
        order = sorted(anns, key=lambda a: -a["area"])
        assert s.extra["instance_labels"] == [label_of[a["category_id"]] for a in order]
        for k, m in enumerate(_masks(path, order)):
            assert np.array_equal(s.objects == k + 1, m)  # non-overlapping: every instance whole
        area: dict[int, int] = {}
        for a, m in zip(order, _masks(path, order), strict=True):
            area[a["category_id"]] = area.get(a["category_id"], 0) + int(m.sum())
        assert s.label == label_of[max(area, key=area.get)]
    b = next(ds.batches(4, PRE))
    assert b.labels.tolist() == [ds[i].label for i in range(4)]
    assert b.extra["instances_of"] == "object"
    assert [t.tolist() for t in b.extra["instance_labels"]] == [ds[i].extra["instance_labels"] for i in range(4)]


@pytest.fixture(scope="module")
def coco_run(tmp_path_factory):
    """A semantics run (object view) on 40 generated COCO images; its tables, the reference and the ids."""
    from vitscope.data.formats import CocoInstances

    root = tmp_path_factory.mktemp("coco")
    path, per_image = _write_coco(root, 40)
    ds = CocoInstances(root / "images", path)
    vm = tiny("vit", depth=2)
    batches = list(ds.batches(8, PRE))
    a = get_analysis("semantics")(vm, layers=[1], views=["cls", "object"], ks=(5,), probe=False,
                                  kmeans=["object"], kmeans_k={"object": 80})
    stream(vm, batches, [a], progress=False)
    x = torch.cat([b.images for b in batches])
    f = vs.extract(vm, x, ["block1.out"], view="spatial")["block1.out"]
    ref = _reference(f, path, per_image, {c["id"]: k for k, c in enumerate(CATS)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = a.finalize()
    return a, df, ref, torch.cat([b.index for b in batches])


def test_object_rows_are_one_mask_weighted_mean_per_instance(coco_run):
    a, _, (vecs, labels, images), ids = coco_run
    t = a.tables["object"]
    assert len(t) == len(vecs) > 80  # one row per instance (the tiny one left out)
    assert torch.allclose(t.layer(0).float(), vecs.half().float(), atol=2e-3, rtol=1e-3)
    assert t.column("labels").tolist() == labels
    assert t.column("ids").tolist() == ids[images].tolist()


def test_kmeans_uses_the_k_asked_for_per_view(coco_run):
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score

    a, df, (vecs, labels, _), _ = coco_run
    obj = df[(df.token_view == "object") & (df.metric == "kmeans_purity")]
    assert obj.k.tolist() == [80]
    pred = KMeans(n_clusters=80, n_init=1, random_state=0).fit_predict(a.tables["object"].layer(0).float().numpy())
    y = np.asarray(labels)
    purity = sum(np.bincount(y[pred == c]).max() for c in np.unique(pred)) / len(y)
    assert obj.value.item() == pytest.approx(purity)
    nmi = df[(df.token_view == "object") & (df.metric == "kmeans_nmi")].value.item()
    assert nmi == pytest.approx(normalized_mutual_info_score(y, pred))
    assert "kmeans_purity" not in set(df[df.token_view == "cls"].metric)  # not asked for there
    assert {"knn5_top1", "kmeans_purity_chance"} <= set(df[df.token_view == "object"].metric)


def test_kmeans_k_defaults_to_classes_and_checks_its_value():
    from vitscope.errors import ConfigError

    vm = tiny("vit", depth=1)
    cls = get_analysis("semantics")
    assert cls(vm).kmeans_k == "classes"
    assert cls(vm, kmeans_k=80).kmeans_k == 80
    for bad in (1, "many", {"object": 0}, True):
        with pytest.raises(ConfigError, match="kmeans_k"):
            cls(vm, kmeans_k=bad)
    a = cls(vm, kmeans_k=5)
    y = torch.tensor([0, 1, 0, 1])
    with pytest.warns(Warning, match="kmeans_k = 5"):
        assert a._kmeans_clusters("cls", y) is None
    assert cls(vm)._kmeans_clusters("cls", y) == 2


def _write_partimagenet(root: Path) -> tuple[Path, list[list[dict]]]:
    """Two 32x32 images; image 0 has two 'Quadruped Leg' annotations apart and a head, image 1 a fin."""
    cats = [{"id": 0, "name": "Quadruped Head", "supercategory": "Quadruped"},
            {"id": 1, "name": "Quadruped Leg", "supercategory": "Quadruped"},
            {"id": 2, "name": "Fish Fin", "supercategory": "Fish"}]
    rects = [[(0, 1, 2, 2, 14, 14), (1, 1, 18, 2, 30, 14), (2, 0, 2, 18, 16, 30)], [(3, 2, 4, 4, 28, 20)]]
    anns, per_image = [], []
    for i, rs in enumerate(rects):
        mine = []
        for aid, cat, x0, y0, x1, y1 in rs:
            a = {"id": aid + 1, "image_id": i + 1, "category_id": cat, "iscrowd": 0,
                 "area": float((x1 - x0) * (y1 - y0)) - 0.1 * aid, "bbox": [x0, y0, x1 - x0, y1 - y0],
                 "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]}
            anns.append(a)
            mine.append(a)
        per_image.append(mine)
        (root / "images").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((32, 32, 3), 60 * (i + 1), np.uint8)).save(root / "images" / f"n{i}.png")
    path = root / "parts.json"
    path.write_text(json.dumps({"images": [{"id": i + 1, "file_name": f"n{i}.png", "height": 32, "width": 32}
                                           for i in range(2)], "annotations": anns, "categories": cats}))
    return path, per_image


def test_partimagenet_part_view_has_one_row_per_part_annotation(tmp_path):
    from vitscope.data.formats import PartImageNet

    path, per_image = _write_partimagenet(tmp_path)
    ds = PartImageNet(tmp_path / "images", path)
    s = ds[0]
    assert s.extra["instance_labels"] == [1, 2, 2]  # the head (largest), then two legs (part ids as in `parts`)
    assert len(np.unique(s.objects[s.objects > 0])) == 3 and len(np.unique(s.parts[s.parts > 0])) == 2
    assert np.array_equal(s.parts > 0, s.objects > 0) and s.label == 0
    vm = tiny("vit", depth=2)
    batches = list(ds.batches(2, PRE))
    assert batches[0].extra["instances_of"] == "part"
    a = get_analysis("semantics")(vm, layers=[1], views=["part"], ks=(1,), probe=False, kmeans=False)
    stream(vm, batches, [a], progress=False)
    f = vs.extract(vm, batches[0].images, ["block1.out"], view="spatial")["block1.out"]
    vecs, labels, images = _reference(f, path, per_image, {0: 1, 1: 2, 2: 3})
    t = a.tables["part"]
    assert len(t) == 4 and t.column("labels").tolist() == labels == [1, 2, 2, 3] and images == [0, 0, 0, 1]
    assert torch.allclose(t.layer(0).float(), vecs.half().float(), atol=2e-3, rtol=1e-3)


def test_without_instances_the_object_view_pools_the_mask_with_the_image_label(tmp_path):
    """Datasets without ``instance_labels`` keep the old object view: one row per image."""
    from vitscope.data.formats import CocoInstances

    path, _ = _write_coco(tmp_path, 4, tiny_one=False)
    batches = list(CocoInstances(tmp_path / "images", path).batches(4, PRE))
    for b in batches:
        del b.extra["instance_labels"]
    vm = tiny("vit", depth=1)
    a = get_analysis("semantics")(vm, layers=[0], views=["object"], ks=(1,), probe=False, kmeans=False)
    stream(vm, batches, [a], progress=False)
    assert a.tables["object"].column("labels").tolist() == batches[0].labels.tolist()


@pytest.mark.parametrize("fmt", ["coco", "partimagenet"])
def test_tiling_cuts_the_maps_with_the_image(tmp_path, fmt):
    from vitscope.data.catalog import build_dataset
    from vitscope.data.tiling import TiledDataset, cut_tiles
    from vitscope.data.transforms import _nearest

    path, per_image = _write_coco(tmp_path, 3, h=40, w=56, tiny_one=False)
    cfg = SimpleNamespace(name=fmt, root=str(tmp_path / "images"), annotations=str(path),
                          options={"tiling": True, "patch": 8})
    ds = build_dataset(cfg)
    assert isinstance(ds, TiledDataset)
    pre = Preprocessing(input_size=16, crop_pct=1.0)
    (b,) = list(ds.batches(3, pre))
    mean, std = torch.tensor(pre.mean)[:, None, None], torch.tensor(pre.std)[:, None, None]
    for i, item in enumerate(b.extra["tiling"]["items"]):
        plan = item["plan"]
        assert (plan.height, plan.width) == (32, 48)
        order = sorted(per_image[i], key=lambda a: -a["area"])
        truth = np.zeros((40, 56), np.int64)
        for k, m in enumerate(_masks(path, order)):
            truth[m] = k + 1
        objects = item["objects"].numpy()
        assert np.array_equal(objects, _nearest(truth, 32, 48))  # the instance map at the tiled resolution
        assert np.array_equal(item["mask"].numpy(), objects > 0)
        if fmt == "partimagenet":
            assert item["parts"] is not None and np.array_equal(item["parts"].numpy() > 0, objects > 0)
        tiles = b.images[item["first"]:item["first"] + len(plan.tiles)] * std + mean
        maps = cut_tiles(torch.from_numpy(objects)[None], plan)[:, 0]
        colours = {}  # each instance's colour, from its pixels in the tiles: one colour per id where the maps say
        for t, m in zip(tiles, maps, strict=True):
            for k in m.unique().tolist():
                px = t[:, m == k].T
                colours.setdefault(k, []).append(px)
        for k, pxs in colours.items():
            px = torch.cat(pxs)
            centre = px.median(0).values
            close = (px - centre).abs().max(1).values < 0.08
            assert close.float().mean() > 0.8, (fmt, i, k)  # a misplaced map would mix colours
            if k == 0:
                assert centre.max() < 0.05  # background is black


def test_an_image_without_annotations_gives_no_image_level_row(tmp_path):
    """COCO labels an image without annotations -1 (no class): it is no class of the image-level views."""
    from vitscope.data.formats import CocoInstances

    path, per_image = _write_coco(tmp_path, 6)
    doc = json.loads(path.read_text())
    dropped = doc["images"][2]["id"]
    doc["annotations"] = [a for a in doc["annotations"] if a["image_id"] != dropped]
    path.write_text(json.dumps(doc))
    ds = CocoInstances(tmp_path / "images", path)
    batches = list(ds.batches(6, PRE))
    assert (batches[0].labels < 0).sum() == 1
    vm = tiny("vit", depth=2)
    a = get_analysis("semantics")(vm, layers=[1], views=["cls", "object"], ks=(2,), probe=False, kmeans=False)
    stream(vm, batches, [a], progress=False)
    assert len(a.tables["cls"]) == 6  # kept while streaming (no per-batch filter), dropped when finalized
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.finalize()
    cls_ids = a.tables["cls"].column("ids").tolist()
    assert len(cls_ids) == 5 and int(batches[0].index[batches[0].labels < 0]) not in cls_ids
    assert (a.tables["cls"].column("labels") >= 0).all() and (a.tables["object"].column("labels") >= 0).all()
