"""Real-format loaders, each on a tiny fixture written here in the format's own layout, the transforms
that keep annotations on their pixels, and robust reading."""

import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitscope.data.base import Sample
from vitscope.data.loaders import (
    Cifar,
    CocoInstances,
    Davis,
    ImageFolder,
    PartImageNet,
    RevisitedRetrieval,
    SkippedImagesWarning,
    SPair71k,
    read_class_list,
)
from vitscope.data.transforms import Geometry, center_crop, collate, crop, for_model, hflip, resize
from vitscope.errors import InputError
from vitscope.models.registry import Preprocessing

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
RED, GREEN, GREY = (230, 20, 20), (20, 220, 20), (120, 120, 120)


def _save(path: Path, arr: np.ndarray, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, **kw)
    return path


def _canvas(h: int, w: int, colour=GREY) -> np.ndarray:
    return np.broadcast_to(np.array(colour, np.uint8), (h, w, 3)).copy()


def _unnormalise(x: torch.Tensor, pre: Preprocessing) -> torch.Tensor:
    return x * torch.tensor(pre.std).view(-1, 1, 1) + torch.tensor(pre.mean).view(-1, 1, 1)


def _is(colour, pixel) -> bool:
    """Whether a pixel (float in [0, 1], or uint8: transforms keep 8-bit images 8-bit) is near ``colour``."""
    p = np.asarray(pixel)
    p = p / 255 if p.dtype == np.uint8 else p.astype(float)
    return bool(np.abs(p - np.asarray(colour, float) / 255).max() < 0.25)


# ---------------------------------------------------------------- transforms


def _marked_sample() -> Sample:
    img = _canvas(90, 130)
    img[20:29, 80:89] = RED  # a 9x9 marker; its centre pixel (row 24, col 84) has centre (84.5, 24.5)
    mask = np.zeros((90, 130), bool)
    mask[20:29, 80:89] = True
    parts = mask.astype(np.int64) * 2
    kp = np.array([[84.5, 24.5, 1.0], [3.0, 85.0, 1.0]], np.float32)  # the second one leaves any centre crop
    return Sample(image=img, mask=mask, parts=parts, objects=mask.astype(np.int64), keypoints=kp,
                  bbox=np.array([80, 20, 89, 29], np.float32))


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("input_size,crop_pct", [(64, 0.875), (48, 1.0), (96, 0.9)])
def test_masks_and_keypoints_stay_on_their_pixels_through_the_model_transform(flip, input_size, crop_pct):
    pre = Preprocessing(input_size=input_size, crop_pct=crop_pct)
    src = _marked_sample()
    out = for_model(src, pre, flip)
    assert out.image.shape == (input_size, input_size, 3) and out.mask.shape == (input_size, input_size)
    (x, y, v), (_, _, v2) = out.keypoints
    assert v == 1 and v2 == 0  # the marker stays in view, the far-left point is cropped away
    r, c = int(y), int(x)
    assert _is(RED, out.image[r, c]) and out.mask[r, c] and out.parts[r, c] == 2 and out.objects[r, c] == 1
    assert not out.mask[(r + input_size // 2) % input_size, c]
    x0, y0, x1, y1 = out.bbox
    assert x0 <= x <= x1 and y0 <= y <= y1 and out.mask[int(y0):int(np.ceil(y1)), int(x0):int(np.ceil(x1))].mean() > .5
    assert isinstance(out.geometry, Geometry) and (out.geometry.src_height, out.geometry.src_width) == (90, 130)
    np.testing.assert_allclose(out.geometry.apply(src.keypoints[:, :2]), out.keypoints[:, :2], atol=1e-4)
    np.testing.assert_allclose(out.geometry.invert(out.keypoints[:, :2]), src.keypoints[:, :2], atol=1e-3)


@pytest.mark.parametrize("f", [2, 3, 4])
def test_nearest_resize_of_label_maps_is_pixel_centre_aligned(f):
    rows = np.arange(8 * f)[:, None].repeat(5, 1)
    down = resize(Sample(image=_canvas(8 * f, 5), mask=rows > -1, objects=rows), 8, 5).objects[:, 0]
    assert down.tolist() == [int((k + 0.5) * f) for k in range(8)]  # output pixel centre (k + .5) * f
    up = resize(Sample(image=_canvas(8, 5), objects=np.arange(8)[:, None].repeat(5, 1)), 8 * f, 5).objects[:, 0]
    assert up.tolist() == [int((i + 0.5) / f) for i in range(8 * f)]


def test_each_transform_moves_a_marker_and_its_keypoint_together():
    s = _marked_sample()
    for op in (lambda t: resize(t, 45, 260), lambda t: crop(t, 10, 70, 30, 30), hflip,
               lambda t: center_crop(t, 60), lambda t: crop(t, -5, 75, 40, 40)):  # the last one pads
        out = op(s)
        x, y, v = out.keypoints[0]
        assert v == 1 and _is(RED, out.image[int(y), int(x)] / 255 if out.image.dtype == np.uint8 else
                              out.image[int(y), int(x)]) and out.mask[int(y), int(x)]
    padded = crop(s, -5, 75, 40, 40)
    assert (padded.image[:5] == 0).all() and not padded.mask[:5].any()


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photograph-like 8-bit image: smooth colour fields (PIL's bicubic upsampling of coarse noise) with fine
    texture, so resizing it exercises every tap of the kernel."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)).resize((w, h),
                                                                                                        Image.BICUBIC)
    return (np.asarray(coarse, np.int16) + rng.integers(-20, 21, (h, w, 3))).clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
@pytest.mark.parametrize("src,dst", [((480, 854), (224, 398)), ((375, 500), (256, 341)), ((60, 90), (150, 225))])
def test_8_bit_images_are_resized_as_pil_resizes_them(src, dst, interpolation):
    """timm's eval transform resizes the PIL image (torchvision's Resize: PIL's Image.resize); the 8-bit
    resize here is that algorithm (torch's uint8 kernel, fixed point like PIL's): uint8 out, identical to PIL's
    on almost every pixel and at most 2 grey levels off (rounding), shrinking (antialiased) and enlarging."""
    img = _photo(*src)
    out = resize(Sample(image=img), *dst, interpolation=interpolation).image
    mode = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}[interpolation]
    ref = np.asarray(Image.fromarray(img).resize(dst[::-1], mode)).astype(int)
    assert out.dtype == np.uint8 and out.shape == (*dst, 3)
    diff = np.abs(out.astype(int) - ref)
    assert diff.max() <= 2 and (diff == 0).mean() > 0.98 and diff.mean() < 0.02


def test_float_images_are_resized_in_float_and_8_bit_crops_normalised_at_collate():
    img = _photo(60, 90)
    f = resize(Sample(image=img.astype(np.float32) / 255), 30, 45).image
    u = resize(Sample(image=img), 30, 45).image
    assert f.dtype == np.float32 and 0 <= f.min() and f.max() <= 1
    # the same resize, unrounded (PIL's algorithm rounds to 8 bits after each of its two 1-d passes)
    assert np.abs(f * 255 - u).max() <= 2.0 and np.abs(f * 255 - u).mean() < 0.5
    pre = Preprocessing(mean=(0.2, 0.4, 0.6), std=(0.5, 0.25, 0.125), input_size=30, crop_pct=1.0)
    b = collate([Sample(image=u, index=0), Sample(image=u.astype(np.float32) / 255, index=1)], pre)
    by_hand = (torch.tensor(u, dtype=torch.float64).permute(2, 0, 1) / 255 - torch.tensor(pre.mean)[:, None, None]) \
        / torch.tensor(pre.std)[:, None, None]
    assert b.images.dtype == torch.float32 and torch.allclose(b.images[0].double(), by_hand, atol=1e-5)
    only_u8 = collate([Sample(image=u, index=0)], pre)
    assert torch.allclose(only_u8.images[0].double(), by_hand, atol=1e-5)


@pytest.mark.parametrize("kind", ["q90", "444", "422", "progressive", "optimized", "grey", "cmyk"])
def test_jpegs_read_as_pil_reads_them(tmp_path, kind):
    """read_rgb decodes colour and greyscale JPEGs with torchvision (faster): the pixels must be PIL's own decode
    with convert('RGB') (what timm's eval transform starts from), bit for bit; CMYK goes to PIL."""
    from vitscope.data.formats.common import decode_jpeg, read_rgb

    img = _photo(97, 171)
    kw = {"q90": {"quality": 90}, "444": {"quality": 95, "subsampling": 0}, "422": {"quality": 75, "subsampling": 1},
          "progressive": {"quality": 85, "progressive": True}, "optimized": {"quality": 50, "optimize": True},
          "grey": {"quality": 90}, "cmyk": {"quality": 90}}[kind]
    im = Image.fromarray(img[..., 0]) if kind == "grey" else Image.fromarray(img)
    (im.convert("CMYK") if kind == "cmyk" else im).save(tmp_path / "x.jpg", **kw)
    with Image.open(tmp_path / "x.jpg") as ref:
        want = np.asarray(ref.convert("RGB"))
    got = read_rgb(tmp_path / "x.jpg")
    assert got.dtype == np.uint8 and got.shape == (97, 171, 3) and np.array_equal(got, want)
    assert (decode_jpeg(tmp_path / "x.jpg") is None) == (kind == "cmyk")


def test_a_truncated_jpeg_is_left_to_pil_and_unreadable(tmp_path):
    from vitscope.data.formats.common import Unreadable, decode_jpeg, read_rgb

    Image.fromarray(_photo(97, 171)).save(tmp_path / "x.jpg", quality=90)
    data = (tmp_path / "x.jpg").read_bytes()
    (tmp_path / "x.jpg").write_bytes(data[: len(data) // 3])
    assert decode_jpeg(tmp_path / "x.jpg") is None
    with pytest.raises(Unreadable):
        read_rgb(tmp_path / "x.jpg")


def test_a_jpeg_claiming_more_pixels_than_pils_limit_is_never_decoded_by_torchvision(tmp_path, monkeypatch):
    """A small file can claim a huge image: its size is read from the header (no pixels) and such a file goes to
    PIL, whose decompression-bomb check refuses it in one sentence, before torchvision allocates anything."""
    import torchvision.io

    from vitscope.data.formats.common import Unreadable, decode_jpeg, read_rgb

    Image.fromarray(_photo(97, 171)).save(tmp_path / "x.jpg", quality=90)
    calls = []
    real = torchvision.io.decode_jpeg
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert decode_jpeg(tmp_path / "x.jpg") is not None and calls == [1]  # within the limit: torchvision decodes
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 97 * 171 // 3)  # the file is now over twice the limit
    assert decode_jpeg(tmp_path / "x.jpg") is None and calls == [1]
    with pytest.raises(Unreadable, match="DecompressionBomb"):
        read_rgb(tmp_path / "x.jpg")


# ---------------------------------------------------------------- ImageFolder


def _folder(root: Path, classes=("n003", "n001", "n002"), per=4, size=(20, 30)) -> Path:
    for k, c in enumerate(classes):
        for j in reversed(range(per)):  # written out of order: selection must sort
            _save(root / c / f"img_{j:02d}.png", _canvas(*size, colour=(40 * k, 200 - 40 * k, 90 + j)))
    return root


def test_image_folder_labels_sorted_classes_and_takes_the_first_files_of_each(tmp_path):
    root = _folder(tmp_path / "train")
    (root / "n002" / "notes.txt").write_text("not an image")
    ds = ImageFolder(root)
    assert ds.classes == ["n001", "n002", "n003"] and len(ds) == 12
    s = ds[0]
    assert s.label == 0 and s.image.shape == (20, 30, 3) and Path(s.extra["path"]).name == "img_00.png"
    lst = tmp_path / "classes.txt"
    lst.write_text("# subset\nn003 Third class\n\nn001 First\n")
    sub = ImageFolder(root, lst, per_class=2)
    assert sub.classes == ["n003", "n001"] and sub.class_names == ["Third class", "First"]
    assert [Path(p).name for p in map(str, sub.files)] == ["img_00.png", "img_01.png"] * 2
    assert sub.labels == [0, 0, 1, 1]
    batches = list(sub.batches(3, Preprocessing(input_size=16, crop_pct=1.0)))
    assert [len(b) for b in batches] == [3, 1] and batches[0].images.shape == (3, 3, 16, 16)
    assert torch.cat([b.labels for b in batches]).tolist() == [0, 0, 1, 1]
    with pytest.raises(InputError, match="holds 4 images"):
        ImageFolder(root, ["n001"], per_class=5)


def test_imagenet50_class_list_selects_its_classes_in_file_order(tmp_path):
    path = SHARED / "imagenet50_classes.txt"
    if not path.is_file():
        pytest.skip("shared/data/imagenet50_classes.txt is not here")
    ids, names = read_class_list(path)
    assert len(ids) == 50 and len(set(ids)) == 50 and all(i.startswith("n") for i in ids)
    root = tmp_path / "train"
    for c in [*ids, "n99999999"]:  # one more class on disk than in the list
        for j in range(3):
            _save(root / c / f"{c}_{j}.JPEG", _canvas(8, 8), quality=90)
    ds = ImageFolder(root, path, per_class=2)
    assert ds.classes == ids and ds.class_names == names and len(ds) == 100
    assert all(f.name.endswith(("_0.JPEG", "_1.JPEG")) for f in ds.files)


def test_layout_errors_say_what_was_expected(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        ImageFolder(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no class folders"):
        ImageFolder(tmp_path / "empty")
    root = _folder(tmp_path / "t", classes=("a", "b"), per=2)
    (root / "c").mkdir()
    with pytest.raises(InputError, match=r"class folder .*c' holds no images"):
        ImageFolder(root)
    with pytest.raises(InputError, match="have no folder"):
        ImageFolder(root, ["a", "zebra"])


def test_a_truncated_image_is_skipped_counted_and_reported_once(tmp_path):
    root = _folder(tmp_path / "t", classes=("a", "b"), per=3)
    good = _save(root / "a" / "img_10.jpg", _canvas(40, 40, RED), quality=95)
    data = good.read_bytes()
    (root / "a" / "img_11.jpg").write_bytes(data[: len(data) // 2])  # truncated JPEG
    (root / "b" / "img_12.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")  # not an image at all
    ds = ImageFolder(root)
    assert len(ds) == 9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(ds.batches(4, Preprocessing(input_size=16, crop_pct=1.0)))
    reports = [w for w in caught if issubclass(w.category, SkippedImagesWarning)]
    assert len(reports) == 1 and "2 of 9 images" in str(reports[0].message)
    assert sorted(Path(p).name for p, _ in ds.skipped) == ["img_11.jpg", "img_12.png"]
    assert all("truncated" in r or "Error" in r for _, r in ds.skipped)
    got = torch.cat([b.index for b in batches]).tolist()
    bad = [i for i, f in enumerate(ds.files) if f.name in ("img_11.jpg", "img_12.png")]
    assert got == [i for i in range(9) if i not in bad]  # nothing else is lost, order kept
    with pytest.raises(InputError, match="could not read"):
        ds[bad[0]]
    with warnings.catch_warnings():  # a pass over unreadable images only fails instead of yielding nothing
        warnings.simplefilter("ignore")
        with pytest.raises(InputError, match="none of the 2 images"):
            list(ds.batches(4, Preprocessing(input_size=16), indices=bad))


def test_cifar10_jpeg_copy_reads_through_image_folder():
    root = SHARED / "cifar10" / "test"
    if not root.is_dir():
        pytest.skip("shared/data/cifar10 is not here")
    ds = ImageFolder(root, per_class=3)
    assert len(ds.classes) == 10 and "airplane" in ds.classes and len(ds) == 30
    b = next(ds.batches(30, Preprocessing(input_size=32, crop_pct=1.0)))
    assert b.images.shape == (30, 3, 32, 32) and sorted(set(b.labels.tolist())) == list(range(10))


# ---------------------------------------------------------------- CIFAR python files


def _cifar_files(folder: Path, n: int = 6) -> np.ndarray:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": [i % 10 for i in range(n)]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return data


def test_cifar_python_files_load_through_torchvision(tmp_path):
    with pytest.raises(InputError, match="expected the CIFAR-10 python files"):
        Cifar(tmp_path)
    data = _cifar_files(tmp_path / "cifar-10-batches-py")
    ds = Cifar(tmp_path)
    assert len(ds) == 6 and ds.classes[3] == "class3"
    s = ds[4]
    assert s.label == 4 and np.array_equal(s.image, data[4].reshape(3, 32, 32).transpose(1, 2, 0))
    assert len(Cifar(tmp_path / "cifar-10-batches-py", train=True)) == 30
    with pytest.raises(InputError, match="did not load"):  # md5 sums of the real release do not match
        Cifar(tmp_path, verify=True)


# ---------------------------------------------------------------- COCO / PartImageNet


def _rle_uncompressed(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE: run lengths over the column-major pixels, starting with a 0-run."""
    flat = mask.flatten(order="F").astype(np.uint8)
    runs, cur, n = [], 0, 0
    for v in flat:
        if v != cur:
            runs.append(n)
            cur, n = v, 0
        n += 1
    runs.append(n)
    return runs


def _coco_fixture(root: Path, drop_file: bool = False) -> tuple[Path, dict]:
    from pycocotools import mask as mask_utils

    h, w = 40, 60
    yy, xx = np.mgrid[0:h, 0:w]
    disk = ((yy - 25) ** 2 + (xx - 45) ** 2 <= 8 ** 2).astype(np.uint8)
    blob = ((yy > 8) & (yy < 30) & (xx > 5) & (xx < 20)).astype(np.uint8)
    rle = mask_utils.encode(np.asfortranarray(disk))
    rle["counts"] = rle["counts"].decode()
    _save(root / "images" / "a.jpg", _canvas(h, w), quality=95)
    if not drop_file:
        _save(root / "images" / "b.jpg", _canvas(h, w), quality=95)
    ann = {
        "images": [{"id": 1, "file_name": "a.jpg", "height": h, "width": w},
                   {"id": 2, "file_name": "b.jpg", "height": h, "width": w},
                   {"id": 3, "file_name": "a.jpg", "height": h, "width": w}],
        "categories": [{"id": 1, "name": "box"}, {"id": 7, "name": "disk"}],
        "annotations": [
            {"id": 10, "image_id": 1, "category_id": 1, "iscrowd": 0, "area": 300.0, "bbox": [10, 5, 20, 15],
             "segmentation": [[10, 5, 30, 5, 30, 20, 10, 20]]},
            {"id": 11, "image_id": 1, "category_id": 7, "iscrowd": 0, "area": float(disk.sum()),
             "bbox": [37, 17, 17, 17], "segmentation": rle},
            {"id": 12, "image_id": 2, "category_id": 7, "iscrowd": 1, "area": float(blob.sum()),
             "bbox": [6, 9, 14, 21], "segmentation": {"size": [h, w], "counts": _rle_uncompressed(blob)}},
        ],
    }
    path = root / "instances.json"
    path.write_text(json.dumps(ann))
    return path, {"disk": disk.astype(bool), "blob": blob.astype(bool)}


def test_coco_instances_masks_from_polygons_and_both_kinds_of_rle(tmp_path):
    path, truth = _coco_fixture(tmp_path)
    ds = CocoInstances(tmp_path / "images", path, only_annotated=True)
    assert ds.classes == ["box", "disk"] and len(ds) == 2
    a = ds[0]
    assert a.extra["categories"] == [1, 7]  # the larger instance first
    assert (a.objects[7:18, 12:28] == 1).all() and not a.objects[30:, :5].any()  # polygon
    assert np.array_equal(a.objects == 2, truth["disk"])  # compressed RLE, exactly
    assert np.array_equal(a.mask, a.objects > 0)
    b = ds[1]
    assert np.array_equal(b.objects == 1, truth["blob"]) and b.extra["categories"] == [7]  # uncompressed RLE
    assert not CocoInstances(tmp_path / "images", path, include_crowd=False)[1].mask.any()
    disk_only = CocoInstances(tmp_path / "images", path, category_ids=[7])
    assert len(disk_only) == 2 and disk_only.classes == ["disk"] and disk_only[0].extra["categories"] == [7]
    batch = next(ds.batches(2, Preprocessing(input_size=32, crop_pct=1.0)))
    assert batch.objects.shape == (2, 32, 32) and set(batch.objects.unique().tolist()) <= {0, 1, 2}
    assert batch.labels.tolist() == [0, 1] and batch.masks.any()  # image 1: the box outweighs the disk
    assert [t.tolist() for t in batch.extra["instance_labels"]] == [[0, 1], [1]]


def test_coco_annotation_naming_a_missing_image_fails_at_once(tmp_path):
    path, _ = _coco_fixture(tmp_path, drop_file=True)
    with pytest.raises(InputError, match=r"missing: .*b\.jpg"):
        CocoInstances(tmp_path / "images", path)
    with pytest.raises(InputError, match="does not exist"):
        CocoInstances(tmp_path / "images", tmp_path / "none.json")


def test_partimagenet_parts_and_object_label(tmp_path):
    _save(tmp_path / "images" / "n1_1.JPEG", _canvas(30, 40), quality=95)
    _save(tmp_path / "images" / "n1_2.JPEG", _canvas(30, 40), quality=95)
    ann = {
        "images": [{"id": 5, "file_name": "n1_1.JPEG", "height": 30, "width": 40},
                   {"id": 6, "file_name": "n1_2.JPEG", "height": 30, "width": 40}],
        "categories": [{"id": 0, "name": "Quadruped Head", "supercategory": "Quadruped"},
                       {"id": 1, "name": "Quadruped Body", "supercategory": "Quadruped"},
                       {"id": 2, "name": "Fish Fin", "supercategory": "Fish"}],
        "annotations": [
            {"id": 1, "image_id": 5, "category_id": 1, "iscrowd": 0, "area": 400.0, "bbox": [5, 5, 30, 20],
             "segmentation": [[5, 5, 35, 5, 35, 25, 5, 25]]},
            {"id": 2, "image_id": 5, "category_id": 0, "iscrowd": 0, "area": 36.0, "bbox": [28, 2, 8, 8],
             "segmentation": [[28, 2, 36, 2, 36, 10, 28, 10]]},
            {"id": 3, "image_id": 5, "category_id": 2, "iscrowd": 0, "area": 4.0, "bbox": [0, 26, 3, 3],
             "segmentation": [[0, 26, 3, 26, 3, 29, 0, 29]]},
        ],
    }
    (tmp_path / "train.json").write_text(json.dumps(ann))
    ds = PartImageNet(tmp_path / "images", tmp_path / "train.json")
    assert ds.classes == ["Quadruped", "Fish"] and ds.part_names[:2] == ["Quadruped Head", "Quadruped Body"]
    s = ds[0]
    assert s.label == 0  # the body and head outweigh the fin
    assert s.parts[15, 10] == 2 and s.parts[5, 31] == 1 and s.parts[27, 1] == 3 and s.parts[28, 20] == 0
    assert np.array_equal(s.mask, s.parts > 0)
    assert ds[1].label == -1 and not ds[1].mask.any()
    b = next(ds.batches(2, Preprocessing(input_size=20, crop_pct=1.0)))
    assert b.labels.tolist() == [0, -1] and b.parts.shape == (2, 20, 20)


# ---------------------------------------------------------------- DAVIS


def _palette_png(path: Path, labels: np.ndarray) -> None:
    im = Image.fromarray(labels.astype(np.uint8), mode="P")
    im.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0] + [0] * (256 * 3 - 9))
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)


def _davis(root: Path, year: int) -> dict[str, list[np.ndarray]]:
    truth = {}
    for seq, n in (("bear", 3), ("car", 2)):
        truth[seq] = []
        for t in range(n):
            _save(root / "JPEGImages" / "480p" / seq / f"{t:05d}.jpg", _canvas(24, 32), quality=95)
            lab = np.zeros((24, 32), np.uint8)
            lab[4 + t:12 + t, 3:10] = 1
            if year == 2017:
                lab[15:20, 20 + t:28 + t] = 2
                _palette_png(root / "Annotations" / "480p" / seq / f"{t:05d}.png", lab)
            else:
                _save(root / "Annotations" / "480p" / seq / f"{t:05d}.png", lab * 255)
            truth[seq].append(lab)
    return truth


def test_davis2017_palette_masks_with_several_objects(tmp_path):
    truth = _davis(tmp_path, 2017)
    (tmp_path / "ImageSets" / "2017").mkdir(parents=True)
    (tmp_path / "ImageSets" / "2017" / "val.txt").write_text("bear\ncar\n")
    ds = Davis(tmp_path, year=2017, split="val")
    assert len(ds) == 5 and ds.sequences == ["bear", "car"] and ds.sequence_indices("car") == [3, 4]
    s = ds[1]
    assert (s.frame, s.sequence) == (1, "bear") and np.array_equal(s.objects, truth["bear"][1])
    assert set(np.unique(s.objects).tolist()) == {0, 1, 2} and np.array_equal(s.mask, s.objects > 0)
    b = next(ds.batches(5, Preprocessing(input_size=16, crop_pct=1.0), indices=ds.sequence_indices("bear")))
    assert b.frames.tolist() == [0, 1, 2] and b.sequences == ["bear"] * 3
    assert set(b.objects.unique().tolist()) == {0, 1, 2}  # ids survive resizing (nearest)


def test_davis2016_binary_masks_and_the_original_pair_list(tmp_path):
    truth = _davis(tmp_path, 2016)
    (tmp_path / "ImageSets" / "480p").mkdir(parents=True)
    (tmp_path / "ImageSets" / "480p" / "val.txt").write_text(
        "".join(f"/JPEGImages/480p/car/{t:05d}.jpg /Annotations/480p/car/{t:05d}.png\n" for t in range(2)))
    ds = Davis(tmp_path, year=2016, split="val")
    assert ds.sequences == ["car"] and len(ds) == 2
    assert np.array_equal(ds[1].objects, truth["car"][1].astype(np.int64))


def test_davis_layout_errors(tmp_path):
    _davis(tmp_path, 2017)
    with pytest.raises(InputError, match="no split list"):
        Davis(tmp_path, year=2017, split="val")
    _palette_png(tmp_path / "Annotations" / "480p" / "car" / "00007.png", np.zeros((24, 32), np.uint8))
    with pytest.raises(InputError, match="refer to missing frames"):
        Davis(tmp_path, sequences=["car"])
    (tmp_path / "Annotations" / "480p" / "bear" / "00000.png").unlink()
    with pytest.raises(InputError, match="first frame"):
        Davis(tmp_path, sequences=["bear"])
    with pytest.raises(InputError, match="no frames"):
        Davis(tmp_path, sequences=["ghost"])


# ---------------------------------------------------------------- SPair-71k


def _spair(root: Path, missing: bool = False) -> None:
    def image(name, cat, pts, h=60, w=80):
        img = _canvas(h, w)
        for (x, y), colour in zip(pts, (RED, GREEN), strict=True):
            img[y - 4:y + 5, x - 4:x + 5] = colour  # centred on pixel (row y, col x)
        _save(root / "JPEGImages" / cat / name, img, quality=98)

    image("a.jpg", "cat", [(20, 15), (60, 40)])
    image("b.jpg", "cat", [(50, 30), (15, 45)], h=70, w=60)
    image("c.jpg", "dog", [(30, 30), (50, 20)])
    if not missing:
        image("d.jpg", "dog", [(40, 25), (10, 10)])
    pairs = [("a.jpg", "b.jpg", "cat", [[20, 15], [60, 40]], [[50, 30], [15, 45]]),
             ("c.jpg", "d.jpg", "dog", [[30, 30], [50, 20]], [[40, 25], [10, 10]])]
    for k, (src, trg, cat, sk, tk) in enumerate(pairs):
        d = {"pair_id": k, "src_imname": src, "trg_imname": trg, "category": cat, "src_kps": sk, "trg_kps": tk,
             "kps_ids": [3, 5], "src_bndbox": [10, 5, 70, 50], "trg_bndbox": [5, 20, 55, 60],
             "viewpoint_variation": 1, "scale_variation": 0, "truncation": 0, "occlusion": 0}
        f = root / "PairAnnotation" / "test" / f"{k:06d}-{src[:-4]}-{trg[:-4]}:{cat}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(d))


@pytest.mark.parametrize("flip", [False, True])
def test_spair_pairs_keep_keypoints_on_their_markers(tmp_path, flip):
    _spair(tmp_path)
    ds = SPair71k(tmp_path, split="test", crop="center")  # the crop path (whole images: tests/test_frames.py)
    assert ds.classes == ["cat", "dog"] and len(ds) == 2
    src, trg = ds.pair(0)
    np.testing.assert_allclose(src.keypoints, [[20.5, 15.5, 1], [60.5, 40.5, 1]])
    np.testing.assert_allclose(trg.bbox, [5.5, 20.5, 55.5, 60.5])
    assert src.label == 0 and src.extra["kps_ids"] == [3, 5] and src.extra["viewpoint_variation"] == 1
    pre = Preprocessing(input_size=48, crop_pct=0.875)
    batch = next(ds.batches(2, pre, flip=flip))
    assert batch.labels.tolist() == [0, 1]
    for b in (batch, batch.extra["target"]):
        for i in range(2):
            img = _unnormalise(b.images[i], pre).permute(1, 2, 0).numpy()
            for k, colour in enumerate((RED, GREEN)):
                x, y, v = b.keypoints[i, k].tolist()
                if v:
                    assert _is(colour, img[int(y), int(x)]), (i, k, img[int(y), int(x)])
    assert batch.extra["common"].any()


def test_spair_pair_naming_a_missing_image_fails_at_once(tmp_path):
    _spair(tmp_path, missing=True)
    with pytest.raises(InputError, match=r"d\.jpg"):
        SPair71k(tmp_path)
    with pytest.raises(InputError, match="splits are"):
        SPair71k(tmp_path, split="train")


# ---------------------------------------------------------------- revisited Oxford / Paris


def _revisited(root: Path, missing: bool = False) -> None:
    names = ["all_souls_000013", "d0", "d1", "d2"]
    for n in names[:3] if missing else names:
        img = _canvas(30, 40)
        img[4:16, 5:25] = RED  # the query's region
        _save(root / "roxford5k" / "jpg" / f"{n}.jpg", img, quality=95)
    gnd = {"imlist": ["d0", "d1", "d2"], "qimlist": ["all_souls_000013"],
           "gnd": [{"bbx": [5.0, 4.0, 25.0, 16.0], "easy": [0], "hard": [2], "junk": [1]}]}
    with open(root / "roxford5k" / "gnd_roxford5k.pkl", "wb") as f:
        pickle.dump(gnd, f)


def test_revisited_oxford_queries_are_cropped_and_protocols_follow_gnd(tmp_path):
    _revisited(tmp_path)
    ds = RevisitedRetrieval(tmp_path, "roxford5k")
    assert len(ds) == 4 and ds.queries == [0] and ds.database == [1, 2, 3]
    q = ds[0]
    assert q.image.shape == (12, 20, 3) and q.extra["role"] == "query" and _is(RED, q.image.mean((0, 1)) / 255)
    np.testing.assert_allclose(q.bbox, [0, 0, 20, 12])
    np.testing.assert_allclose(q.geometry.invert(np.array([[0.0, 0.0]])), [[5.0, 4.0]])
    assert ds[1].image.shape == (30, 40, 3) and ds[1].extra["role"] == "database"
    assert ds.protocols["medium"][0] == {"ok": [0, 2], "junk": [1]}
    assert ds.protocols["hard"][0] == {"ok": [2], "junk": [1, 0]}
    assert RevisitedRetrieval(tmp_path / "roxford5k", crop_queries=False)[0].image.shape == (30, 40, 3)


def test_revisited_ground_truth_naming_a_missing_image_fails_at_once(tmp_path):
    _revisited(tmp_path, missing=True)
    with pytest.raises(InputError, match=r"d2\.jpg"):
        RevisitedRetrieval(tmp_path, "roxford5k")
    with pytest.raises(InputError, match="gnd_rparis6k.pkl"):
        RevisitedRetrieval(tmp_path, "rparis6k")


# ---------------------------------------------------------------- high bit depth


def _png16(path: Path, arr: np.ndarray) -> Path:
    """A 16-bit PNG written by hand (PIL writes 16-bit greyscale but not 16-bit RGB)."""
    import struct
    import zlib

    h, w = arr.shape[:2]
    colour_type = 0 if arr.ndim == 2 else 2
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("channels", [1, 3])
def test_16_bit_pngs_are_scaled_to_8_bits_not_clipped(tmp_path, channels):
    from vitscope.data.preprocess import load_images

    rng = np.random.default_rng(0)
    shape = (24, 24) if channels == 1 else (24, 24, 3)
    arr = rng.integers(20000, 56000, shape).astype(np.uint16)  # mean 8-bit value ~148, most values > 255
    _png16(tmp_path / "a" / "x.png", arr)
    _png16(tmp_path / "b" / "y.png", arr)
    truth = arr / 257.0
    if channels == 1:
        truth = np.repeat(truth[..., None], 3, axis=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scaled exactly: nothing to warn about
        img = ImageFolder(tmp_path)[0].image
    assert img.dtype == np.uint8 and img.shape == (24, 24, 3)
    assert abs(img.mean() - truth.mean()) < 0.5 and np.abs(img - truth).max() <= 1.0
    # the path `extract` takes for image files: the same pixels, normalised
    pre = Preprocessing(mean=(0, 0, 0), std=(1, 1, 1), input_size=24, crop_pct=1.0)
    x = load_images([tmp_path / "a" / "x.png"], pre)
    assert abs(float(x.mean()) * 255 - truth.mean()) < 0.5
