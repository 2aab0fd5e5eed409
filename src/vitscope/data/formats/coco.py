"""COCO-style instance annotations (pycocotools): COCO itself, and PartImageNet, whose categories are
object parts grouped by supercategory. Masks come from polygons, compressed and uncompressed RLE alike
(``COCO.annToMask``).

Instances travel as Walmer et al. 2023 (§5.3, Fig. 8) use them, one region per annotation: ``objects`` (H, W)
holds instance ids 1..n (annotations in order of decreasing area, a smaller one drawn over a larger one where
they overlap), and a batch's ``extra['instance_labels']`` holds per image the (n,) label of each instance id
(``extra['instances_of']`` says which region view they serve: 'object' for COCO, 'part' for PartImageNet). The
maps go through every crop, resize, flip and tiling with the image; the labels are per id, so they need none."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitscope.data.base import Sample
from vitscope.data.formats.common import FileDataset, Unreadable, read_rgb, require_files
from vitscope.errors import InputError
from vitscope.files import inside


def load_coco(annotations: str | Path) -> Any:
    """A pycocotools ``COCO`` index of the json file, quietly."""
    from pycocotools.coco import COCO

    path = Path(annotations)
    if not path.is_file():
        raise InputError(f"annotation file {str(path)!r} does not exist (expected a COCO-format json)")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return COCO(str(path))
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise InputError(f"{str(path)!r} is not a COCO-format annotation file ({type(e).__name__}: {e}); "
                         "expected 'images', 'annotations' and 'categories'") from e


#: how far outside its image an annotation's coordinates may lie, in image sizes (polygons that extend past
#: the border are clipped; coordinates farther out are an error: pycocotools dies on some without a message)
COORD_MARGIN = 1.0


def check_annotation(ann: dict, image: dict, source: str) -> None:
    """One InputError sentence naming ``source`` (the json) and the annotation when its values are not what
    pycocotools can draw: a polygon's coordinates must be finite numbers within `COORD_MARGIN` image sizes of
    the image (``image``'s width and height), in pairs, at least three points; an RLE must match the image's
    size; a bbox must hold four finite numbers."""
    who = f"{source}: annotation {ann.get('id', '?')} (image {ann.get('image_id', '?')})"
    w, h = image.get("width"), image.get("height")
    seg = ann.get("segmentation")

    def bad(why: str) -> InputError:
        return InputError(f"{who}: {why}; fix or remove the annotation")

    def numbers(xs: Any) -> np.ndarray:
        try:
            arr = np.asarray(xs, dtype=np.float64)
        except (TypeError, ValueError):
            raise bad("its coordinates are not numbers") from None
        if arr.ndim != 1 or not np.isfinite(arr).all():
            raise bad(f"its coordinates must be finite numbers, got {_nonfinite(arr)}")
        return arr

    if isinstance(seg, list):
        for poly in seg:
            xy = numbers(poly)
            if len(xy) < 6 or len(xy) % 2:
                raise bad(f"a polygon needs x, y pairs of at least 3 points, got {len(xy)} numbers")
            if isinstance(w, int | float) and isinstance(h, int | float):
                far = np.abs(xy - np.tile([w / 2, h / 2], len(xy) // 2)) > np.tile([w, h], len(xy) // 2) * (
                    COORD_MARGIN + 0.5)
                if far.any():
                    raise bad(f"a polygon coordinate of {xy[far][0]:g} lies more than {COORD_MARGIN:g} image size "
                              f"outside the {w}x{h} image")
    elif isinstance(seg, dict):
        size = seg.get("size")
        if not (isinstance(size, list) and len(size) == 2) or (h is not None and list(size) != [h, w]):
            raise bad(f"its RLE size {size!r} is not the image's [height, width] [{h}, {w}]")
        counts = seg.get("counts")
        if isinstance(counts, list):
            c = numbers(counts)
            if (c < 0).any() or c.sum() != size[0] * size[1]:
                raise bad(f"its RLE counts must be non-negative and add up to {size[0]}x{size[1]} pixels")
        elif not isinstance(counts, str | bytes):
            raise bad("its RLE counts are neither a list nor a compressed string")
    elif seg is not None:
        raise bad(f"its segmentation is a {type(seg).__name__}, not polygons or an RLE")
    if "bbox" in ann and len(numbers(ann["bbox"])) != 4:
        raise bad("its bbox must hold 4 numbers (x, y, width, height)")


def _nonfinite(arr: np.ndarray) -> str:
    odd = arr[~np.isfinite(arr)] if arr.ndim == 1 else arr.ravel()
    return ", ".join(f"{v:g}" for v in odd[:3]) if odd.size else "an array of shape " + str(arr.shape)


def ann_mask(coco: Any, ann: dict) -> np.ndarray:
    """(H, W) bool mask of one annotation: polygons, compressed or uncompressed RLE."""
    with warnings.catch_warnings():  # pycocotools' decoder trips numpy 2's __array__(copy=) deprecation
        warnings.simplefilter("ignore", DeprecationWarning)
        return coco.annToMask(ann) > 0


class _CocoBase(FileDataset):
    def __init__(self, images: str | Path, annotations: str | Path, category_ids: Sequence[int] | None,
                 only_annotated: bool, include_crowd: bool):
        super().__init__()
        self.images_dir = Path(images)
        if not self.images_dir.is_dir():
            raise InputError(f"image folder {str(self.images_dir)!r} does not exist")
        self.coco = load_coco(annotations)
        self.include_crowd = include_crowd
        cats = sorted(self.coco.getCatIds())
        self.category_ids = list(category_ids) if category_ids is not None else cats
        unknown = sorted(set(self.category_ids) - set(cats))
        if unknown:
            raise InputError(f"category ids {unknown[:5]} are not in {str(annotations)!r} (it has {cats[:10]}...)")
        ids = sorted(self.coco.getImgIds())
        if only_annotated or category_ids is not None:
            keep = set()
            for c in self.category_ids:
                keep.update(self.coco.getImgIds(catIds=[c]))
            ids = [i for i in ids if i in keep]
        if not ids:
            raise InputError(f"{str(annotations)!r} lists no images" + (" with annotations of the chosen "
                             "categories" if only_annotated or category_ids is not None else ""))
        self.image_ids = ids
        self.files = [inside(self.images_dir, self.coco.imgs[i]["file_name"],
                             f"{Path(annotations).name}: image {i}") for i in ids]
        require_files(self.files, f"{str(annotations)!r} refers to (under {str(self.images_dir)!r})")
        for a in self.coco.dataset.get("annotations", []):
            check_annotation(a, self.coco.imgs.get(a.get("image_id"), {}), Path(annotations).name)

    def __len__(self) -> int:
        return len(self.image_ids)

    def _image_and_anns(self, i: int) -> tuple[np.ndarray, list[dict], dict]:
        info = self.coco.imgs[self.image_ids[i]]
        image = read_rgb(self.files[i])
        if (image.shape[0], image.shape[1]) != (info.get("height", image.shape[0]), info.get("width",
                                                                                           image.shape[1])):
            raise Unreadable(self.files[i], f"image is {image.shape[1]}x{image.shape[0]} but the annotation says "
                                            f"{info['width']}x{info['height']}")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=[self.image_ids[i]], catIds=self.category_ids,
                                                      iscrowd=None))
        if not self.include_crowd:
            anns = [a for a in anns if not a.get("iscrowd", 0)]
        anns = sorted(anns, key=lambda a: -float(a.get("area", 0)))  # large first: small ones stay visible
        return image, anns, info

    #: the region view the instances serve (`vitscope.analyses.semantics`)
    instances_of = "object"

    def _instances(self, shape: tuple[int, ...], anns: list[dict]) -> tuple[np.ndarray, Counter[int]]:
        """(H, W) instance ids 1..n, annotation k drawn as id k + 1 (later ones over earlier ones), and the
        pixels each category id's annotations cover (whole masks, overlaps counted in each)."""
        objects = np.zeros(shape[:2], np.int64)
        area: Counter[int] = Counter()
        for k, a in enumerate(anns):
            m = ann_mask(self.coco, a)
            objects[m] = k + 1
            area[int(a["category_id"])] += int(m.sum())
        return objects, area

    def _collate(self, chunk: list[Sample], pre: Any) -> Any:
        """The common batch, plus ``extra['instance_labels']`` (per image a (n,) int64 tensor: the label of
        instance id k at k - 1) and ``extra['instances_of']``."""
        import torch

        b = super()._collate(chunk, pre)
        if all("instance_labels" in s.extra for s in chunk):
            b.extra["instance_labels"] = [torch.as_tensor(np.asarray(s.extra["instance_labels"], np.int64))
                                          for s in chunk]
            b.extra["instances_of"] = self.instances_of
        return b


class CocoInstances(_CocoBase):
    """Images of a COCO instances json: ``objects`` (H, W) instance ids 1..n (in order of decreasing area;
    ``extra['categories'][k-1]`` is instance k's COCO category id, ``extra['instance_labels'][k-1]`` its index
    into ``classes``), ``mask`` = any instance, label = index into ``classes`` (the category names in id order)
    of the category covering the most pixels of the image, -1 for an image without annotations (an image holds
    several objects: the label serves the image-level views; the object view labels each instance)."""

    def __init__(self, images: str | Path, annotations: str | Path, category_ids: Sequence[int] | None = None,
                 only_annotated: bool = False, include_crowd: bool = True, name: str = "coco"):
        super().__init__(images, annotations, category_ids, only_annotated, include_crowd)
        self.name = name
        self.classes = [self.coco.cats[c]["name"] for c in self.category_ids]
        self._class_of = {c: k for k, c in enumerate(self.category_ids)}

    def load(self, i: int) -> Sample:
        image, anns, info = self._image_and_anns(i)
        objects, area = self._instances(image.shape, anns)
        label = self._class_of[area.most_common(1)[0][0]] if area else -1
        return Sample(image=image, label=label, mask=objects > 0, objects=objects, index=i,
                      extra={"path": str(self.files[i]), "image_id": info["id"],
                             "categories": [int(a["category_id"]) for a in anns],
                             "instance_labels": [self._class_of[int(a["category_id"])] for a in anns]})


class PartImageNet(_CocoBase):
    """PartImageNet (COCO-style json whose categories are parts, e.g. 'Quadruped Head' with supercategory
    'Quadruped'). ``parts`` (H, W): index + 1 into ``parts_names`` (category order), ``mask`` = any part,
    label = index into ``classes`` (the supercategories) of the image's dominant supercategory, -1 when
    the image has no part annotation. ``objects`` (H, W): one id per part *annotation* (1..n, decreasing area),
    ``extra['instance_labels'][k-1]`` the part id (as in ``parts``) of annotation k: the part view's regions,
    one per annotated part instance as Walmer et al. 2023 pool them (two legs are two rows, not one)."""

    instances_of = "part"

    def __init__(self, images: str | Path, annotations: str | Path, only_annotated: bool = False,
                 name: str = "partimagenet"):
        super().__init__(images, annotations, None, only_annotated, True)
        self.name = name
        cats = [self.coco.cats[c] for c in self.category_ids]
        self.part_names: list[str] = [c["name"] for c in cats]
        self.classes = list(dict.fromkeys(c.get("supercategory") or c["name"] for c in cats))
        self._part_index = {c["id"]: k + 1 for k, c in enumerate(cats)}
        self._class_of = {c["id"]: self.classes.index(c.get("supercategory") or c["name"]) for c in cats}

    def load(self, i: int) -> Sample:
        image, anns, info = self._image_and_anns(i)
        objects, area = self._instances(image.shape, anns)
        part_of = np.asarray([0] + [self._part_index[a["category_id"]] for a in anns], np.int64)
        parts = part_of[objects]  # what each pixel's visible annotation is a part of
        votes: Counter[int] = Counter()
        for c, n in area.items():
            votes[self._class_of[c]] += n
        label = votes.most_common(1)[0][0] if votes else -1
        return Sample(image=image, label=label, mask=parts > 0, parts=parts, objects=objects, index=i,
                      extra={"path": str(self.files[i]), "image_id": info["id"],
                             "instance_labels": part_of[1:].tolist()})
