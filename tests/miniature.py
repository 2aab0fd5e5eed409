"""A miniature of every dataset the recipes read, written in each dataset's real on-disk layout under one
``data_root`` (the recipes' contract: each recipe dataset's ``root`` is ``${data_root}/<folder>``), so a
recipe runs end to end here with no download: a few classes, a few small images each.

`write_data_root(root)` writes it; `MINIATURE_DATASETS` names, per folder, the dataset config that reads it
with vitscope's own format (tests/test_recipes_miniature.py builds each one and reads an item).

The folders (sizes are tiny on purpose: images of 32-64 pixels, so a recipe's passes take seconds):

* ``imagenet/train``, ``imagenet/val``: ImageFolder of WordNet synset folders, the 50 ImageNet-50 ids (the
  package's ``imagenet50_classes.txt``) plus two more, ``<wnid>_<k>.JPEG``.
* ``coco/val2017/*.jpg`` + ``coco/annotations/instances_val2017.json``: instances drawn as polygons,
  compressed RLE and uncompressed RLE (a crowd), as COCO mixes them.
* ``partimagenet/images/<split>/*.JPEG`` + ``partimagenet/annotations/<split>.json`` (PartImageNet's release
  layout; categories are parts with their supercategory).
* ``davis/``: a DAVIS-2017 root, two sequences of four frames with palette annotations of two objects.
* ``spair/SPair-71k``: ``JPEGImages/<category>/``, ``PairAnnotation/<split>/*.json`` with keypoints and boxes.
* ``revisited/roxford5k``, ``revisited/rparis6k``: ``gnd_<name>.pkl`` (a protocol-2 pickle of builtin
  containers and numpy arrays, what the restricted unpickler of `vitscope.data.formats.common` accepts) +
  ``jpg/``.
* ``cue-conflict/<shape>/<shape><i>-<texture><j>.png``: Geirhos et al.'s 16 categories.
* ``imagenet16/<category>/*.JPEG``: clean images of those 16 categories (the shape-bias probes' training data).
* ``cifar10/cifar-10-batches-py``, ``cifar100/cifar-100-python``: CIFAR's python pickles.
* ``cifar10-c/``, ``cifar100-c/``: RobustBench's ``<corruption>.npy`` (5 severities stacked) + ``labels.npy``.
"""

from __future__ import annotations

import json
import pickle
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: Geirhos et al.'s 16 cue-conflict categories
CUE_CONFLICT_CATEGORIES = ("airplane", "bear", "bicycle", "bird", "boat", "bottle", "car", "cat", "chair", "clock",
                           "dog", "elephant", "keyboard", "knife", "oven", "truck")
#: synsets beyond ImageNet-50's, so the full ``imagenet`` folders hold classes the subset leaves out
EXTRA_SYNSETS = ("n01440764", "n01443537")
#: the 19 corruptions of CIFAR-10-C / CIFAR-100-C as RobustBench ships them (the 15 common ones and the 4 held out)
CIFAR_C_CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
                       "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
                       "jpeg_compression", "speckle_noise", "gaussian_blur", "spatter", "saturate")
SIZE = 48           # the side of most images (a few are not square)
PER_CLASS_TRAIN = 3
PER_CLASS_VAL = 2
PER_SEVERITY = 2    # CIFAR-C images per corruption and severity
DAVIS_FRAMES = 4

#: per data_root folder, the dataset config (`vitscope.study.slots.DatasetConfig` fields) that reads it; roots and
#: annotations are relative to the data root
MINIATURE_DATASETS: dict[str, dict[str, Any]] = {
    "imagenet": {"name": "imagefolder", "root": "imagenet"},
    "imagenet-val": {"name": "imagefolder", "root": "imagenet/val"},
    "imagenet50": {"name": "imagefolder", "root": "imagenet/train", "classes": "<imagenet50>",
                   "per_class": PER_CLASS_TRAIN},
    "coco": {"name": "coco", "root": "coco/val2017", "annotations": "coco/annotations/instances_val2017.json"},
    "partimagenet": {"name": "partimagenet", "root": "partimagenet/images/test",
                     "annotations": "partimagenet/annotations/test.json"},
    "davis": {"name": "davis2017", "root": "davis", "split": "val", "options": {"size": 32}},
    "spair": {"name": "spair71k", "root": "spair/SPair-71k", "split": "test"},
    "roxford5k": {"name": "roxford5k", "root": "revisited/roxford5k"},
    "rparis6k": {"name": "rparis6k", "root": "revisited/rparis6k"},
    "cue-conflict": {"name": "cue-conflict", "root": "cue-conflict"},
    "imagenet16": {"name": "imagefolder", "root": "imagenet16"},
    "cifar10": {"name": "cifar10", "root": "cifar10", "split": "test"},
    "cifar100": {"name": "cifar10", "root": "cifar100", "split": "test", "options": {"which": 100}},
    "cifar10-c": {"name": "corrupted", "root": "cifar10-c"},
    "cifar100-c": {"name": "corrupted", "root": "cifar100-c"},
}


# ------------------------------------------------------------------------------------------------ pixels

def _image(rng: np.random.Generator, h: int = SIZE, w: int = SIZE) -> np.ndarray:
    """A smooth random colour image (a coarse grid upsampled) with a bright rectangle: JPEG keeps it, and the
    features differ between images."""
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR)).copy()
    y0, x0 = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
    img[y0:y0 + h // 3, x0:x0 + w // 3] = rng.integers(0, 256, 3, dtype=np.uint8)
    return img


def _save(path: Path, img: np.ndarray, **kw: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = "JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG"
    Image.fromarray(img).save(path, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}), **kw)
    return path


def _palette_png(path: Path, labels: np.ndarray) -> None:
    """A palette PNG whose indices are the object ids (DAVIS 2017's annotations)."""
    im = Image.fromarray(labels.astype(np.uint8), mode="P")
    im.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0] + [0] * (256 * 3 - 12))
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)


def _rle_uncompressed(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE: run lengths over the column-major pixels, starting with a 0-run."""
    flat = mask.flatten(order="F").astype(np.uint8)
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    runs = np.diff(bounds).tolist()
    return runs if flat[0] == 0 else [0, *runs]


def _rle_compressed(mask: np.ndarray) -> dict[str, Any]:
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode()}


def imagenet50_ids() -> list[str]:
    """The ImageNet-50 class ids: the package's shipped list when it is there, else the shared copy, else 50
    made-up synset-like ids (the miniature needs folders for whatever list the recipes name)."""
    shipped = Path(str(resources.files("vitscope") / "data" / "shipped" / "imagenet50_classes.txt"))
    for f in (shipped, Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet50_classes.txt"):
        if f.is_file():
            from vitscope.data.formats.imagefolder import read_class_list

            return read_class_list(f)[0]
    return [f"n0{2000000 + 17 * k:07d}" for k in range(50)]


# ------------------------------------------------------------------------------------------------ datasets

def write_imagenet(root: Path, rng: np.random.Generator) -> None:
    """``imagenet/{train,val}/<wnid>/<wnid>_<k>.JPEG``."""
    for wnid in [*imagenet50_ids(), *EXTRA_SYNSETS]:
        for split, n in (("train", PER_CLASS_TRAIN), ("val", PER_CLASS_VAL)):
            for k in range(n):
                _save(root / "imagenet" / split / wnid / f"{wnid}_{k}.JPEG", _image(rng))


def _coco_json(images: list[dict], cats: list[dict], anns: list[dict]) -> dict[str, Any]:
    return {"info": {"description": "vitscope miniature"}, "licenses": [], "images": images, "categories": cats,
            "annotations": anns}


def write_coco(root: Path, rng: np.random.Generator, n_images: int = 4) -> None:
    """``coco/val2017/<id:012d>.jpg`` and ``coco/annotations/instances_val2017.json``: per image a polygon
    instance, a compressed-RLE instance and, on every other image, an uncompressed-RLE crowd."""
    h, w = SIZE, SIZE + 16
    cats = [{"id": 1, "name": "person", "supercategory": "person"}, {"id": 3, "name": "car", "supercategory":
            "vehicle"}, {"id": 18, "name": "dog", "supercategory": "animal"}]
    images, anns = [], []
    yy, xx = np.mgrid[0:h, 0:w]
    for i in range(1, n_images + 1):
        name = f"{i:012d}.jpg"
        _save(root / "coco" / "val2017" / name, _image(rng, h, w))
        images.append({"id": i, "file_name": name, "height": h, "width": w})
        x0, y0 = int(rng.integers(2, 12)), int(rng.integers(2, 12))
        poly = [x0, y0, x0 + 20, y0, x0 + 20, y0 + 18, x0, y0 + 18]
        anns.append({"id": 100 * i, "image_id": i, "category_id": 1, "iscrowd": 0, "area": 360.0,
                     "bbox": [x0, y0, 20, 18], "segmentation": [[float(v) for v in poly]]})
        cy, cx = int(rng.integers(20, h - 12)), int(rng.integers(30, w - 12))
        disk = (yy - cy) ** 2 + (xx - cx) ** 2 <= 8 ** 2
        anns.append({"id": 100 * i + 1, "image_id": i, "category_id": [3, 18][i % 2], "iscrowd": 0,
                     "area": float(disk.sum()), "bbox": [cx - 8, cy - 8, 17, 17],
                     "segmentation": _rle_compressed(disk)})
        if i % 2:
            blob = (yy > h - 14) & (xx < 16)
            anns.append({"id": 100 * i + 2, "image_id": i, "category_id": 18, "iscrowd": 1,
                         "area": float(blob.sum()), "bbox": [0, h - 13, 16, 13],
                         "segmentation": {"size": [h, w], "counts": _rle_uncompressed(blob)}})
    path = root / "coco" / "annotations" / "instances_val2017.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_coco_json(images, cats, anns)))


def write_partimagenet(root: Path, rng: np.random.Generator, n_images: int = 4,
                       splits: tuple[str, ...] = ("train", "val", "test")) -> None:
    """PartImageNet's release layout: ``partimagenet/images/<split>/<wnid>_<k>.JPEG`` and
    ``partimagenet/annotations/<split>.json`` (COCO-style; categories are parts, e.g. 'Quadruped Head' of
    supercategory 'Quadruped'), two or three part polygons per image."""
    cats = [{"id": 0, "name": "Quadruped Head", "supercategory": "Quadruped"},
            {"id": 1, "name": "Quadruped Body", "supercategory": "Quadruped"},
            {"id": 2, "name": "Quadruped Foot", "supercategory": "Quadruped"},
            {"id": 3, "name": "Fish Head", "supercategory": "Fish"},
            {"id": 4, "name": "Fish Body", "supercategory": "Fish"},
            {"id": 5, "name": "Fish Fin", "supercategory": "Fish"}]
    wnids = ("n02085620", "n01440764")
    for split in splits:
        images, anns = [], []
        for i in range(n_images):
            wnid = wnids[i % 2]
            name = f"{wnid}_{i}.JPEG"
            _save(root / "partimagenet" / "images" / split / name, _image(rng))
            images.append({"id": i + 1, "file_name": name, "height": SIZE, "width": SIZE})
            base = 3 * (i % 2)
            boxes = [(4, 4, 18, 16), (14, 14, 42, 36), (30, 36, 44, 46)][: 2 + (i % 2 == 0)]
            for k, (x0, y0, x1, y1) in enumerate(boxes):
                anns.append({"id": 10 * (i + 1) + k, "image_id": i + 1, "category_id": base + k, "iscrowd": 0,
                             "area": float((x1 - x0) * (y1 - y0)), "bbox": [x0, y0, x1 - x0, y1 - y0],
                             "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]})
        path = root / "partimagenet" / "annotations" / f"{split}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_coco_json(images, cats, anns)))


def write_davis(root: Path, rng: np.random.Generator, sequences: tuple[str, ...] = ("bear", "car-shadow")) -> None:
    """A DAVIS-2017 root: ``JPEGImages/480p/<seq>/00000.jpg``, ``Annotations/480p/<seq>/00000.png`` (palette,
    objects 1 and 2 moving a pixel a frame), ``ImageSets/2017/{train,val}.txt``."""
    h, w = SIZE, SIZE + 16
    d = root / "davis"
    for seq in sequences:
        base = _image(rng, h, w)
        for t in range(DAVIS_FRAMES):
            lab = np.zeros((h, w), np.uint8)
            lab[6 + t:22 + t, 4 + 2 * t:20 + 2 * t] = 1
            lab[28:40, 36 - t:56 - t] = 2
            frame = np.roll(base, t, axis=1).copy()
            frame[lab == 1] = (220, 40, 40)
            frame[lab == 2] = (40, 200, 60)
            _save(d / "JPEGImages" / "480p" / seq / f"{t:05d}.jpg", frame)
            _palette_png(d / "Annotations" / "480p" / seq / f"{t:05d}.png", lab)
    (d / "ImageSets" / "2017").mkdir(parents=True, exist_ok=True)
    (d / "ImageSets" / "2017" / "val.txt").write_text("".join(f"{s}\n" for s in sequences))
    (d / "ImageSets" / "2017" / "train.txt").write_text("".join(f"{s}\n" for s in sequences))


def write_spair(root: Path, rng: np.random.Generator, categories: tuple[str, ...] = ("cat", "dog", "car"),
                pairs_per_category: int = 2, splits: tuple[str, ...] = ("trn", "val", "test")) -> None:
    """``spair/SPair-71k``: ``JPEGImages/<category>/<k>.jpg`` and ``PairAnnotation/<split>/<id>-<src>-<trg>:<cat>.json``
    (src/trg image names, keypoints as [x, y] pixel indices visible in both, kps_ids, boxes [x0, y0, x1, y1],
    the variation labels)."""
    d = root / "spair" / "SPair-71k"
    n_kps = 4
    pid = 0
    for cat in categories:
        kps = {}
        for k in range(pairs_per_category + 1):
            name = f"{2008000000 + k:010d}.jpg"
            h, w = SIZE + 8 * (k % 2), SIZE + 8 * ((k + 1) % 2)
            img = _image(rng, h, w)
            pts = np.stack([rng.integers(6, w - 6, n_kps), rng.integers(6, h - 6, n_kps)], axis=1)
            for x, y in pts:
                img[y - 2:y + 3, x - 2:x + 3] = (255, 255, 255)
            _save(d / "JPEGImages" / cat / name, img)
            kps[name] = (pts.tolist(), [int(pts[:, 0].min()) - 3, int(pts[:, 1].min()) - 3, int(pts[:, 0].max()) + 3,
                                        int(pts[:, 1].max()) + 3])
        names = sorted(kps)
        for split in splits:
            for k in range(pairs_per_category):
                src, trg = names[k], names[k + 1]
                rec = {"pair_id": pid, "src_imname": src, "trg_imname": trg, "category": cat,
                       "src_kps": kps[src][0], "trg_kps": kps[trg][0], "kps_ids": [str(j) for j in range(n_kps)],
                       "src_bndbox": kps[src][1], "trg_bndbox": kps[trg][1], "viewpoint_variation": k % 2,
                       "scale_variation": 0, "truncation": 0, "occlusion": 0, "mirror": 0}
                f = d / "PairAnnotation" / split / f"{pid:06d}-{src[:-4]}-{trg[:-4]}:{cat}.json"
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(json.dumps(rec))
                pid += 1


def write_revisited(root: Path, rng: np.random.Generator, n_queries: int = 2, n_database: int = 8) -> None:
    """``revisited/<name>/gnd_<name>.pkl`` + ``jpg/<name>.jpg`` for roxford5k and rparis6k: per query its box
    and easy / hard / junk database indices (numpy int64 arrays, as the released files hold them)."""
    for which in ("roxford5k", "rparis6k"):
        d = root / "revisited" / which
        qnames = [f"q_{which}_{q}" for q in range(n_queries)]
        dnames = [f"db_{which}_{k}" for k in range(n_database)]
        for n in qnames + dnames:
            _save(d / "jpg" / f"{n}.jpg", _image(rng, SIZE, SIZE + 16))
        gnd = []
        for q in range(n_queries):
            ids = np.arange(n_database)
            gnd.append({"bbx": [4.0 + q, 6.0, 40.0, 44.0 - q], "easy": ids[q::4].astype(np.int64),
                        "hard": ids[q + 1::4].astype(np.int64), "junk": ids[q + 2::8].astype(np.int64)})
        with open(d / f"gnd_{which}.pkl", "wb") as f:
            pickle.dump({"imlist": dnames, "qimlist": qnames, "gnd": gnd}, f, protocol=2)


def write_cue_conflict(root: Path, rng: np.random.Generator, per_category: int = 2) -> None:
    """``cue-conflict/<shape>/<shape><i>-<texture><j>.png``: each image's texture another category."""
    cats = CUE_CONFLICT_CATEGORIES
    for s, shape in enumerate(cats):
        for i in range(per_category):
            texture = cats[(s + 1 + i) % len(cats)]
            _save(root / "cue-conflict" / shape / f"{shape}{i + 1}-{texture}{i + 1}.png", _image(rng, 32, 32))


def write_imagenet16(root: Path, rng: np.random.Generator, per_category: int = 3) -> None:
    """``imagenet16/<category>/<category>_<k>.JPEG``: clean images of Geirhos et al.'s 16 categories (their
    16-class ImageNet), the shape-bias probes' training images."""
    for cat in CUE_CONFLICT_CATEGORIES:
        for k in range(per_category):
            _save(root / "imagenet16" / cat / f"{cat}_{k}.JPEG", _image(rng))


def write_cifar(root: Path, rng: np.random.Generator, n: int = 20) -> None:
    """``cifar10/cifar-10-batches-py`` (data_batch_1..5, test_batch, batches.meta) and
    ``cifar100/cifar-100-python`` (train, test, meta): dicts of a uint8 (n, 3072) ``data`` and the labels."""
    d10 = root / "cifar10" / "cifar-10-batches-py"
    d10.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(d10 / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         "labels": [k % 10 for k in range(n)], "filenames": [f"{k}.png" for k in range(n)]}, f)
    with open(d10 / "batches.meta", "wb") as f:
        from vitscope.metrics.robustness import CIFAR10_CLASSES

        pickle.dump({"label_names": list(CIFAR10_CLASSES), "num_cases_per_batch": n, "num_vis": 3072}, f)
    d100 = root / "cifar100" / "cifar-100-python"
    d100.mkdir(parents=True, exist_ok=True)
    for name in ("train", "test"):
        fine = [k % 100 for k in range(5 * n)]
        with open(d100 / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 256, (5 * n, 3072), dtype=np.uint8), "fine_labels": fine,
                         "coarse_labels": [k // 5 for k in fine]}, f)
    with open(d100 / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"fine{k}" for k in range(100)],
                     "coarse_label_names": [f"coarse{k}" for k in range(20)]}, f)


def write_cifar_c(root: Path, rng: np.random.Generator) -> None:
    """RobustBench's CIFAR-10-C / CIFAR-100-C: ``<corruption>.npy`` (5 x n uint8 images, severity 1 first) and
    ``labels.npy`` (5 x n uint8 labels, the same n repeated per severity)."""
    for folder, n_classes in (("cifar10-c", 10), ("cifar100-c", 100)):
        d = root / folder
        d.mkdir(parents=True, exist_ok=True)
        labels = np.tile(np.arange(PER_SEVERITY) * 37 % n_classes, 5).astype(np.uint8)
        np.save(d / "labels.npy", labels)
        for c in CIFAR_C_CORRUPTIONS:
            np.save(d / f"{c}.npy", rng.integers(0, 256, (5 * PER_SEVERITY, 32, 32, 3), dtype=np.uint8))


def write_data_root(root: Path, seed: int = 0) -> Path:
    """Every folder of the recipes' data_root contract under ``root`` (created), in each dataset's real on-disk
    layout, drawn from ``seed``; returns ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for write in (write_imagenet, write_coco, write_partimagenet, write_davis, write_spair, write_revisited,
                  write_cue_conflict, write_imagenet16, write_cifar, write_cifar_c):
        write(root, rng)
    return root


def dataset_config(root: Path, key: str, **extra: Any) -> Any:
    """The `DatasetConfig` of `MINIATURE_DATASETS[key]` with its paths under the data root ``root``
    (``<imagenet50>``: the ImageNet-50 class list, written beside the data when the package ships none)."""
    from vitscope.study.slots import DatasetConfig

    spec = {**MINIATURE_DATASETS[key], **extra}
    for k in ("root", "annotations"):
        if k in spec:
            spec[k] = str(Path(root) / spec[k])
    if spec.get("classes") == "<imagenet50>":
        listing = Path(root) / "imagenet50_classes.txt"
        listing.write_text("".join(f"{c}\n" for c in imagenet50_ids()))
        spec["classes"] = str(listing)
    return DatasetConfig(**spec)


# ------------------------------------------------------------------------------------------------ stand-in models

#: the size every stand-in model is built at: a random network of the entry's own architecture (ViT, BEiT, Eva:
#: its CLS, register tokens, pooling and head as the entry has them), 2 blocks of width 32 at 32 px, patch 8
STAND_IN_SIZE: dict[str, Any] = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}


def stand_in_kwargs(name: str, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """timm kwargs that make the model ``name`` (a registry or timm name) a tiny random stand-in of its own
    family: the config's ``kwargs`` with the sizes of `STAND_IN_SIZE` over them (a BEiT also gets layer scale,
    as the real ones have; the MLP ratio of a CLIP / SigLIP tower is kept, timm's default)."""
    from vitscope.models.load import resolve_spec

    spec = resolve_spec(name)
    out = {**(kwargs or {}), **STAND_IN_SIZE}
    arch = spec.arch or ""
    if arch.startswith("beit"):
        out.setdefault("init_values", 0.1)
    return out


def stand_in_load(name_or_path: Any, weights: Any = None, *, pretrained: bool = True, checkpoint_format: str = "auto",
                  seed: int = 0, device: Any = "cpu", decoder: bool = False, **kwargs: Any) -> Any:
    """What `vitscope.study.pool.load_model` becomes under the stand-ins: the entry's tiny random stand-in
    (`stand_in_kwargs`), seeded by its name and ``seed`` so two entries of one architecture differ; a checkpoint
    file (``weights``, e.g. a recipe's ``${ckpt_root}`` epochs, written by `write_checkpoint`) is loaded into it by
    vitscope's own loader, so the checkpoint path runs too."""
    import zlib

    from vitscope.models import load_model

    tiny = stand_in_kwargs(str(name_or_path), kwargs)
    if weights is not None:
        return load_model(name_or_path, weights=weights, checkpoint_format=checkpoint_format, device=device,
                          decoder=decoder, **tiny)
    return load_model(name_or_path, pretrained=False, seed=seed + zlib.crc32(str(name_or_path).encode()) % 1000,
                      device=device, **tiny)


def _official_layout(state: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A timm state dict wrapped as the release files of ``fmt`` hold it (what `vitscope.models.layouts` converts
    back): SimMIM's ``model`` of ``encoder.`` keys beside a pixel decoder, MoCo v3's ``state_dict`` of
    ``module.base_encoder.`` keys, MAE's and BEiT's ``model``; timm's own (and DINO's backbone files) as is."""
    import torch

    if fmt == "simmim":
        dim = next(v for k, v in state.items() if k.endswith("patch_embed.proj.weight")).shape[0]
        return {"model": {**{f"encoder.{k}": v for k, v in state.items()},
                          "decoder.0.weight": torch.zeros(3 * 8 * 8, dim, 1, 1), "decoder.0.bias": torch.zeros(192)},
                "epoch": 799}
    if fmt == "mocov3":
        return {"state_dict": {f"module.base_encoder.{k}": v for k, v in state.items()}, "epoch": 299}
    if fmt in ("mae", "beit"):
        return {"model": state}
    return state


def write_checkpoint(path: Path, name: str, kwargs: dict[str, Any] | None = None, seed: int = 0,
                     checkpoint_format: str = "auto") -> Path:
    """A tiny random state dict of ``name``'s stand-in at ``path``, as a training run would leave a checkpoint of
    it: in the layout ``checkpoint_format`` names (``auto``: the registry entry's own, e.g. SimMIM's release
    layout for simmim-b16; timm's for a timm name), as ``.safetensors`` or torch's format by the suffix."""
    import torch

    from vitscope.models import load_model
    from vitscope.models.load import resolve_spec

    vm = load_model(name, pretrained=False, seed=seed, **stand_in_kwargs(name, kwargs))
    state = {k: v.detach().clone().contiguous() for k, v in vm.model.state_dict().items()
             if not k.endswith("relative_position_index")}
    fmt = checkpoint_format if checkpoint_format != "auto" else resolve_spec(name).weights.checkpoint_format
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(_official_layout(state, fmt or "timm"), path)
    return path


def write_recipe_checkpoints(recipe: Path, ckpt_root: Path) -> list[Path]:
    """Every ``${ckpt_root}/...`` file the recipe ``recipe`` (its YAML) names, as `write_checkpoint` writes them for
    the model entry that names it (its ``name``, ``kwargs`` and ``checkpoint_format``); a ``checkpoints:`` list's
    files are seeded by their position, so the epochs differ."""
    import yaml

    raw = yaml.safe_load(Path(recipe).read_text()) or {}
    written = []
    for m in raw.get("models") or []:
        files = list(m.get("checkpoints") or []) if isinstance(m.get("checkpoints"), list) else []
        if isinstance(m.get("weights"), str):
            files.append(m["weights"])
        for k, f in enumerate(files):
            if "${ckpt_root}" not in str(f):
                continue
            path = Path(str(f).replace("${ckpt_root}", str(ckpt_root)))
            written.append(write_checkpoint(path, m["name"], m.get("kwargs"), seed=k + 1,
                                            checkpoint_format=m.get("checkpoint_format", "auto")))
    return written
