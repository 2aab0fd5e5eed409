"""Each source paper's recipe cost on one GPU, from its dry run, on a count-faithful stand-in data_root.

``vitscope run recipe:NAME --dry-run`` counts each dataset's images from disk, so its estimate needs the data in
place. This tool writes, in a temporary folder, every dataset folder of the recipes' data_root contract (the same
layout as tests/miniature.py) with the real datasets' image counts, whole frames at their typical sizes (the tiled
dense passes depend on them), and every file tiny: one constant-colour image per size, hard-linked under every
name; CIFAR-10-C / CIFAR-100-C as sparse zero arrays of the real shape (the reader only memory-maps them and reads
their shape). Then it runs each recipe's dry run and prints a markdown table: models, forwards, images, hours of
forwards on one GPU (the flops-based estimate at ``FLOPS_PER_SECOND['cuda']``), cache growth.

A machine without a GPU refuses ``device=cuda`` (the config's check of the driver), so the dry run runs with the
recipe's device (cpu) and its flops are priced at the GPU's throughput (`Estimate.hours` with ``device='cuda'``):
the counts and flops do not depend on the device. A recipe whose dry run fails gets its error in its row.

    python tools/recipe_costs.py [--recipes NAME ...] [--keep DIR]

Real counts (the source of each is beside its constant below)."""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

# ------------------------------------------------------------------------------------------------ real counts

#: ImageNet-50 (Teaching Matters §3: "50 representative categories ... 100 images per class", 5,000 images); the
#: recipe reads them from imagenet/train with per_class 100, so 100 per class are written
IMAGENET50_PER_CLASS = 100
#: ImageNet ILSVRC-2012 validation: 1,000 classes x 50 images = 50,000
IMAGENET_VAL_CLASSES, IMAGENET_VAL_PER_CLASS = 1000, 50
#: COCO val2017: 5,000 images, of which 48 have no instance annotation (4,952 annotated)
COCO_VAL, COCO_UNANNOTATED = 5000, 48
#: PartImageNet (He et al. 2022, ~24,000 images of 158 classes, split by class): validation split size as recalled
#: from the release's val.json, NOT verified here (no download); the other splits are not read by the recipes
PARTIMAGENET_VAL = 1206
#: DAVIS-2017 val (ImageSets/2017/val.txt): 30 sequences, 1,999 frames at 480p; frames per sequence from the release
DAVIS_VAL = {"bike-packing": 69, "blackswan": 50, "bmx-trees": 80, "breakdance": 84, "camel": 90,
             "car-roundabout": 75, "car-shadow": 40, "cows": 104, "dance-twirl": 90, "dog": 60, "dogs-jump": 66,
             "drift-chicane": 52, "drift-straight": 50, "goat": 90, "gold-fish": 78, "horsejump-high": 50,
             "india": 81, "judo": 34, "kite-surf": 50, "lab-coat": 47, "libby": 49, "loading": 50,
             "mbike-trick": 79, "motocross-jump": 40, "paragliding-launch": 80, "parkour": 100, "pigs": 79,
             "scooter-black": 43, "shooting": 40, "soapbox": 99}
#: SPair-71k (Min et al. 2019): test split 12,234 pairs over 18 categories, 100 images per category; the
#: per-category split of the pairs is spread evenly here (the recipe draws 20 per category)
SPAIR_TEST_PAIRS, SPAIR_IMAGES_PER_CATEGORY = 12234, 100
SPAIR_CATEGORIES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "dog",
                    "horse", "motorbike", "person", "pottedplant", "sheep", "train", "tvmonitor")
#: Revisited Oxford / Paris (Radenovic et al. 2018): database images + 70 queries each
REVISITED = {"roxford5k": (4993, 70), "rparis6k": (6322, 70)}
#: cue-conflict stimuli (Geirhos et al. 2019): 1,280 images, 16 categories x 80
CUE_CONFLICT_CATEGORIES = ("airplane", "bear", "bicycle", "bird", "boat", "bottle", "car", "cat", "chair", "clock",
                           "dog", "elephant", "keyboard", "knife", "oven", "truck")
CUE_CONFLICT_PER_CATEGORY = 80
#: Geirhos et al.'s 16-class ImageNet (clean images of the cue-conflict categories): the recipes take per_class 100;
#: each category is assumed to hold at least 100
IMAGENET16_PER_CLASS = 100
#: CIFAR-10 / CIFAR-100: 50,000 train, 10,000 test
CIFAR_TRAIN, CIFAR_TEST = 50000, 10000
#: CIFAR-10-C / CIFAR-100-C (Hendrycks & Dietterich 2019, RobustBench files): 19 corruptions x 5 severities x 10,000
CIFAR_C_CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
                       "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
                       "jpeg_compression", "speckle_noise", "gaussian_blur", "spatter", "saturate")
CIFAR_C_ROWS = 5 * CIFAR_TEST

#: (width, height) of whole frames, where a tiled or whole-image pass depends on the size: DAVIS 480p; typical
#: COCO, PASCAL-sized (SPair, PartImageNet's ImageNet photos), Oxford/Paris (Flickr 1024 x 768) images
DAVIS_SIZE, COCO_SIZE, PASCAL_SIZE, REVISITED_SIZE = (854, 480), (640, 480), (500, 375), (1024, 768)
#: ImageFolder images are resized to the model input, so theirs does not matter
SMALL = (32, 32)


# ------------------------------------------------------------------------------------------------ writing


class Linker:
    """Writes one constant-colour image per (size, suffix) once and hard-links it under every other name (a
    copy where links fail), so tens of thousands of files take seconds and almost no disk."""

    def __init__(self, store: Path):
        self.store, self.made = store, {}
        store.mkdir(parents=True, exist_ok=True)

    def put(self, path: Path, size: tuple[int, int], suffix: str | None = None) -> None:
        suffix = suffix or path.suffix.lower()
        key = (size, suffix)
        if key not in self.made:
            buf = io.BytesIO()
            img = Image.new("RGB", size, (120, 90, 60))
            img.save(buf, format="PNG" if suffix == ".png" else "JPEG", quality=90)
            self.made[key] = self.store / f"{size[0]}x{size[1]}{suffix}"
            self.made[key].write_bytes(buf.getvalue())
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.made[key], path)
        except OSError:
            shutil.copyfile(self.made[key], path)


def imagenet_synsets() -> list[str]:
    """The 1,000 ImageNet-1k synsets (timm's list), the ImageNet-50 ones first so both folders agree."""
    from importlib import resources

    sub = imagenet50_ids()
    listed = (resources.files("timm") / "data" / "_info" / "imagenet_synsets.txt").read_text().split()
    return sub + [s for s in listed if s not in sub][: IMAGENET_VAL_CLASSES - len(sub)]


def imagenet50_ids() -> list[str]:
    """The ImageNet-50 class ids the package ships (the recipe's ``${shipped}/imagenet50_classes.txt``)."""
    from importlib import resources

    from vitscope.data.formats.imagefolder import read_class_list

    return read_class_list(Path(str(resources.files("vitscope") / "data" / "shipped" / "imagenet50_classes.txt")))[0]


def write_imagenet(root: Path, ln: Linker) -> None:
    """imagenet/train: ImageNet-50's classes x 100; imagenet/val: 1,000 classes x 50."""
    for wnid in imagenet50_ids():
        for k in range(IMAGENET50_PER_CLASS):
            ln.put(root / "imagenet" / "train" / wnid / f"{wnid}_{k}.JPEG", SMALL)
    for wnid in imagenet_synsets():
        for k in range(IMAGENET_VAL_PER_CLASS):
            ln.put(root / "imagenet" / "val" / wnid / f"ILSVRC2012_val_{wnid}_{k}.JPEG", SMALL)


def _coco_like(folder: Path, ann_file: Path, n: int, unannotated: int, size: tuple[int, int], ln: Linker,
               cats: list[dict], suffix: str) -> None:
    """n images of ``size`` under ``folder`` and a COCO json: one box polygon per image but the last
    ``unannotated``."""
    w, h = size
    images, anns = [], []
    for i in range(1, n + 1):
        name = f"{i:012d}{suffix}"
        ln.put(folder / name, size)
        images.append({"id": i, "file_name": name, "height": h, "width": w})
        if i <= n - unannotated:
            x0, y0, x1, y1 = w // 4, h // 4, 3 * w // 4, 3 * h // 4
            anns.append({"id": i, "image_id": i, "category_id": cats[i % len(cats)]["id"], "iscrowd": 0,
                         "area": float((x1 - x0) * (y1 - y0)), "bbox": [x0, y0, x1 - x0, y1 - y0],
                         "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]})
    ann_file.parent.mkdir(parents=True, exist_ok=True)
    ann_file.write_text(json.dumps({"info": {}, "licenses": [], "images": images, "categories": cats,
                                    "annotations": anns}))


def write_coco(root: Path, ln: Linker) -> None:
    cats = [{"id": 1, "name": "person", "supercategory": "person"}, {"id": 3, "name": "car",
                                                                     "supercategory": "vehicle"}]
    _coco_like(root / "coco" / "val2017", root / "coco" / "annotations" / "instances_val2017.json", COCO_VAL,
               COCO_UNANNOTATED, COCO_SIZE, ln, cats, ".jpg")


def write_partimagenet(root: Path, ln: Linker) -> None:
    cats = [{"id": 0, "name": "Quadruped Head", "supercategory": "Quadruped"},
            {"id": 1, "name": "Fish Body", "supercategory": "Fish"}]
    _coco_like(root / "partimagenet" / "images" / "val", root / "partimagenet" / "annotations" / "val.json",
               PARTIMAGENET_VAL, 0, PASCAL_SIZE, ln, cats, ".JPEG")


def write_davis(root: Path, ln: Linker) -> None:
    """DAVIS-2017 val at 480p: every frame and a palette annotation of one object per frame."""
    d = root / "davis"
    w, h = DAVIS_SIZE
    lab = np.zeros((h, w), np.uint8)
    lab[h // 4:h // 2, w // 4:w // 2] = 1
    png = Image.fromarray(lab, mode="P")
    png.putpalette([0, 0, 0, 128, 0, 0] + [0] * (256 * 3 - 6))
    mask = ln.store / "davis_mask.png"
    png.save(mask)
    for seq, n in DAVIS_VAL.items():
        (d / "Annotations" / "480p" / seq).mkdir(parents=True, exist_ok=True)
        for t in range(n):
            ln.put(d / "JPEGImages" / "480p" / seq / f"{t:05d}.jpg", DAVIS_SIZE)
            os.link(mask, d / "Annotations" / "480p" / seq / f"{t:05d}.png")
    (d / "ImageSets" / "2017").mkdir(parents=True, exist_ok=True)
    (d / "ImageSets" / "2017" / "val.txt").write_text("".join(f"{s}\n" for s in DAVIS_VAL))


def write_spair(root: Path, ln: Linker) -> None:
    """SPair-71k: 100 images per category, the test pairs spread evenly over the categories."""
    d = root / "spair" / "SPair-71k"
    w, h = PASCAL_SIZE
    kps = [[100, 100], [200, 150], [300, 200], [400, 250]]
    box = [50, 50, 450, 325]
    pid = 0
    for c, cat in enumerate(SPAIR_CATEGORIES):
        names = [f"{2008000000 + k:010d}" for k in range(SPAIR_IMAGES_PER_CATEGORY)]
        for name in names:
            ln.put(d / "JPEGImages" / cat / f"{name}.jpg", PASCAL_SIZE)
        n_pairs = SPAIR_TEST_PAIRS // len(SPAIR_CATEGORIES) + (c < SPAIR_TEST_PAIRS % len(SPAIR_CATEGORIES))
        folder = d / "PairAnnotation" / "test"
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(n_pairs):
            src, trg = names[k % len(names)], names[(k + 1 + k // len(names)) % len(names)]
            rec = {"pair_id": pid, "src_imname": f"{src}.jpg", "trg_imname": f"{trg}.jpg", "category": cat,
                   "src_kps": kps, "trg_kps": kps, "kps_ids": ["0", "1", "2", "3"], "src_bndbox": box,
                   "trg_bndbox": box, "src_imsize": [w, h, 3], "trg_imsize": [w, h, 3], "viewpoint_variation": 0,
                   "scale_variation": 0, "truncation": 0, "occlusion": 0, "mirror": 0}
            (folder / f"{pid:06d}-{src}-{trg}:{cat}.json").write_text(json.dumps(rec))
            pid += 1


def write_revisited(root: Path, ln: Linker) -> None:
    """roxford5k / rparis6k: gnd pickle (per query a box and easy / hard / junk indices) and every jpg."""
    for which, (n_db, n_q) in REVISITED.items():
        d = root / "revisited" / which
        dnames = [f"{which}_db_{k:05d}" for k in range(n_db)]
        qnames = [f"{which}_q_{q:02d}" for q in range(n_q)]
        for n in dnames + qnames:
            ln.put(d / "jpg" / f"{n}.jpg", REVISITED_SIZE)
        ids = np.arange(n_db, dtype=np.int64)
        gnd = [{"bbx": [100.0, 100.0, 600.0, 500.0], "easy": ids[q::140], "hard": ids[q + 70::140],
                "junk": ids[q + 1::700]} for q in range(n_q)]
        with open(d / f"gnd_{which}.pkl", "wb") as f:
            pickle.dump({"imlist": dnames, "qimlist": qnames, "gnd": gnd}, f, protocol=2)


def write_cue_conflict(root: Path, ln: Linker) -> None:
    cats = CUE_CONFLICT_CATEGORIES
    for s, shape in enumerate(cats):
        for i in range(CUE_CONFLICT_PER_CATEGORY):
            texture = cats[(s + 1 + i % (len(cats) - 1)) % len(cats)]
            ln.put(root / "cue-conflict" / shape / f"{shape}{i + 1}-{texture}{i + 1}.png", (224, 224))


def write_imagenet16(root: Path, ln: Linker) -> None:
    """imagenet16/<category>/: the recipes read 100 per category (per_class), assumed available in each."""
    for cat in CUE_CONFLICT_CATEGORIES:
        for k in range(IMAGENET16_PER_CLASS):
            ln.put(root / "imagenet16" / cat / f"{cat}_{k}.JPEG", SMALL)


def write_cifar(root: Path) -> None:
    """CIFAR-10 / CIFAR-100 python pickles at their real sizes (zeros)."""
    d10 = root / "cifar10" / "cifar-10-batches-py"
    d10.mkdir(parents=True, exist_ok=True)
    for name, n in [*((f"data_batch_{i}", CIFAR_TRAIN // 5) for i in range(1, 6)), ("test_batch", CIFAR_TEST)]:
        with open(d10 / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": np.zeros((n, 3072), np.uint8),
                         "labels": [k % 10 for k in range(n)], "filenames": [f"{k}.png" for k in range(n)]}, f)
    from vitscope.metrics.robustness import CIFAR10_CLASSES

    with open(d10 / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(CIFAR10_CLASSES), "num_cases_per_batch": CIFAR_TEST, "num_vis": 3072}, f)
    d100 = root / "cifar100" / "cifar-100-python"
    d100.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", CIFAR_TRAIN), ("test", CIFAR_TEST)):
        fine = [k % 100 for k in range(n)]
        with open(d100 / name, "wb") as f:
            pickle.dump({"data": np.zeros((n, 3072), np.uint8), "fine_labels": fine,
                         "coarse_labels": [k // 5 for k in fine]}, f)
    with open(d100 / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"fine{k}" for k in range(100)],
                     "coarse_label_names": [f"coarse{k}" for k in range(20)]}, f)


def write_cifar_c(root: Path) -> None:
    """<corruption>.npy as sparse zero arrays of the real (50,000, 32, 32, 3) shape (the reader memory-maps them),
    labels.npy the real length."""
    for folder, n_classes in (("cifar10-c", 10), ("cifar100-c", 100)):
        d = root / folder
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "labels.npy", (np.arange(CIFAR_C_ROWS) % n_classes).astype(np.uint8))
        for c in CIFAR_C_CORRUPTIONS:
            arr = np.lib.format.open_memmap(d / f"{c}.npy", mode="w+", dtype=np.uint8, shape=(CIFAR_C_ROWS, 32, 32, 3))
            del arr  # never touched: the file stays sparse


#: the data_root folders written here at real counts; any other folder comes from tests/miniature.py (its counts)
FAITHFUL = ("imagenet", "imagenet16", "coco", "partimagenet", "davis", "spair", "revisited", "cue-conflict",
            "cifar10", "cifar100", "cifar10-c", "cifar100-c")


def write_miniature(root: Path) -> list[str]:
    """tests/miniature.py's data_root (every folder of the current contract, a few images each) under ``root``,
    so a folder the recipes gained since this tool was written still exists; returns the folders it wrote that
    this tool does not rewrite at real counts (their counts are the miniature's)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not (tests / "miniature.py").is_file():
        return []
    sys.path.insert(0, str(tests))
    try:
        import miniature
    finally:
        sys.path.remove(str(tests))
    miniature.write_data_root(root)
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in FAITHFUL
                  and not p.name.startswith("."))


def write_data_root(root: Path) -> list[str]:
    """Every folder of the recipes' data_root contract under ``root``: the miniature's, then those of `FAITHFUL`
    rewritten at the real counts; returns the folders left at the miniature's counts."""
    root.mkdir(parents=True, exist_ok=True)
    left = write_miniature(root)
    for name in FAITHFUL:
        shutil.rmtree(root / name, ignore_errors=True)
    ln = Linker(root / ".images")
    for write in (write_imagenet, write_imagenet16, write_coco, write_partimagenet, write_davis, write_spair,
                  write_revisited, write_cue_conflict):
        write(root, ln)
    write_cifar(root)
    write_cifar_c(root)
    return left


# ------------------------------------------------------------------------------------------------ dry runs


def recipe_cost(name: str, data_root: Path, work: Path, overrides: list[str] = ()) -> dict:
    """The dry run of recipe ``name`` on ``data_root`` (with the config ``overrides``, key=value), its hours
    priced on one GPU; or its error."""
    from vitscope.study.cache import human
    from vitscope.study.config import load_config
    from vitscope.study.cost import dry_run

    row = {"recipe": name}
    try:
        cfg = load_config(f"recipe:{name}", [f"data_root={data_root}", f"ckpt_root={work / 'ckpts'}",
                                             f"output_dir={work / 'out' / name}", f"cache_dir={work / 'cache'}",
                                             *overrides])
        row["models"] = len(cfg.models)
        est = dry_run(cfg)
    except Exception as e:  # noqa: BLE001 - a failing recipe is a row of the table, not the end of the tool
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    gpu = replace(est, device="cuda")
    row.update(forwards=est.forwards, images=est.forward_images, hours=gpu.hours, cache=human(est.cache_bytes),
               notes=[n for n in est.notes if "does not exist" not in n],
               own={a: c[1] for a, c in sorted(est.own.items(), key=lambda kv: -kv[1][1])})
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``."""
    out = ["| recipe | models | forwards | images through them | hours on one GPU (estimate) | cache growth |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['recipe']} | {r.get('models', '?')} | dry run failed: {r['error']} | | | |")
        else:
            out.append(f"| {r['recipe']} | {r['models']} | {r['forwards']:,} | {r['images']:,} | {r['hours']:.2g} | "
                       f"{r['cache']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from vitscope.study.config import recipe_names
    from vitscope.study.cost import FLOPS_PER_SECOND

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="*", default=None, help="recipe names (default: every recipe)")
    p.add_argument("--keep", type=Path, default=None, help="write the data_root here and keep it (reused if there)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every recipe run (repeatable), e.g. to try a fix of a failing one")
    args = p.parse_args(argv)
    names = args.recipes or recipe_names()
    work = Path(tempfile.mkdtemp(prefix="recipe_costs_")) if args.keep is None else args.keep
    try:
        t0 = time.time()
        data_root = work / "data"
        done = data_root / ".done"
        if not done.is_file():
            done.parent.mkdir(parents=True, exist_ok=True)
            left = write_data_root(data_root)
            done.write_text(json.dumps(left))
        left = json.loads(done.read_text())
        print(f"data_root written in {time.time() - t0:.0f} s", file=sys.stderr)
        rows = []
        for name in names:
            t1 = time.time()
            rows.append(recipe_cost(name, data_root, work, args.set))
            print(f"{name}: {time.time() - t1:.0f} s", file=sys.stderr)
        print(f"Dry-run estimates of {datetime.date.today().isoformat()} (flops at "
              f"{FLOPS_PER_SECOND['cuda']:.0e}/s for one GPU; not measurements):\n")
        print(table(rows))
        if args.set:
            print(f"\nWith the overrides {' '.join(args.set)}.")
        if left:
            print(f"\nFolders at the miniature's counts (tests/miniature.py), not the real ones: {', '.join(left)}")
        for r in rows:
            for n in r.get("notes", []):
                print(f"\n- {r['recipe']}: {n}")
            if r.get("own"):
                print(f"\n- {r['recipe']}: images of the analyses' own forwards: "
                      + ", ".join(f"{a} {n:,}" for a, n in r["own"].items()))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
