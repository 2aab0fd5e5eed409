"""Every dataset format a study can name, what each provides, and how it is built from a `DatasetConfig`.

    datasets:
      cifar: {name: cifar10-test-1k}                      # shipped with the package
      shapes: {name: synthetic-shapes, n_images: 256}     # generated
      davis: {name: davis2017, root: /data/DAVIS, split: val}

A format *provides* capabilities (`CAPABILITIES`); an analysis *needs* some of them (`Analysis.needs`), and
the study planner matches the two at config time (`vitscope.study.plan`). `vitscope datasets` prints this
catalog. A new format is one `register_format(Format(...))`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vitscope.bounds import MAX_GENERATED_IMAGES, MAX_IMAGE_SIDE, Range
from vitscope.errors import ConfigError, close_matches

#: what a dataset can provide, with the batch fields that carry it
CAPABILITIES: dict[str, str] = {
    "labels": "a class id per image (batch.labels)",
    "split": "its own train / test split (batch.is_test)",
    "masks": "a foreground mask per image (batch.masks)",
    "parts": "part ids per pixel (batch.parts)",
    "objects": "object / instance ids per pixel (batch.objects)",
    "keypoints": "named keypoints per image (batch.keypoints)",
    "videos": "frames in sequence with per-frame object masks (batch.frames, batch.sequences)",
    "pairs": "image pairs with corresponding keypoints",
    "retrieval": "queries, a database and revisited-style ground truth",
    "cue_conflict": "shape label and a conflicting texture label (batch.extra['texture_labels'])",
}


@dataclass(frozen=True)
class Format:
    name: str
    provides: frozenset[str]
    build: Callable[[Any], Any]      # DatasetConfig -> dataset
    options: tuple[str, ...]         # the DatasetConfig fields it reads (beside name, n_images, seed, size)
    description: str
    generated: bool = False          # needs no files: the planner may use it when nothing configured fits


FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    unknown = set(fmt.provides) - set(CAPABILITIES)
    if unknown:
        raise ValueError(f"format {fmt.name!r} provides unknown capabilities {sorted(unknown)}")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    if name not in FORMATS:
        hint = close_matches(name, FORMATS)
        raise ConfigError(f"unknown dataset format {name!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
                          + f" Available: {', '.join(FORMATS)}.")
    return FORMATS[name]


#: the range of every count a dataset config or a format's options may set (checked by `check_counts` when the
#: config is validated, before any model loads; a format's own loader checks its option names)
COUNT_RANGES: dict[str, Range] = {
    "n_images": Range(1), "size": Range(1, MAX_IMAGE_SIDE), "per_class": Range(1),   # DatasetConfig fields
    # generated sets' options
    "n_frames": Range(1, MAX_GENERATED_IMAGES), "n_videos": Range(1, MAX_GENERATED_IMAGES),
    "n_pairs": Range(1, MAX_GENERATED_IMAGES), "views": Range(1, MAX_GENERATED_IMAGES),
    "n_queries": Range(1, MAX_GENERATED_IMAGES), "n_distractors": Range(0, MAX_GENERATED_IMAGES),
    "tile_scale": Range(1, 64), "patch": Range(1, MAX_IMAGE_SIDE),
}


def check_counts(where: str, cfg: Any) -> None:
    """Every count of a dataset's config (its fields and ``options``; ``where`` is its key, e.g.
    ``datasets.shapes``) within `COUNT_RANGES`: one ConfigError sentence naming the key otherwise."""
    values = {k: getattr(cfg, k, None) for k in ("n_images", "size", "per_class")}
    values.update({f"options.{k}": v for k, v in dict(cfg.options or {}).items()})
    for key, value in values.items():
        r = COUNT_RANGES.get(key.removeprefix("options."))
        if r is None or value is None or (key == "options.patch" and value == PER_MODEL):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            also = f" or {PER_MODEL!r} (each model's own patch size)" if key == "options.patch" else ""
            raise ConfigError(f"{where}.{key} must be an integer{also}; got {value!r}")
        r.check(value, f"{where}.{key}")
    fmt = FORMATS.get(cfg.name)
    if fmt is not None and fmt.generated:  # drawn on the fly, but each item's parameters are kept
        Range(1, MAX_GENERATED_IMAGES, why="a generated set keeps every item's parameters").check(
            cfg.n_images, f"{where}.n_images")


def build_dataset(cfg: Any) -> Any:
    """The dataset a `DatasetConfig` describes (its ``name`` is the format)."""
    import re

    fmt = get_format(cfg.name)
    try:
        return fmt.build(cfg)
    except TypeError as e:  # an option the format's loader does not take (options reach it as keywords)
        m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if m is None:
            raise
        raise ConfigError(f"dataset format {cfg.name!r} takes no option {m.group(1)!r} (`vitscope datasets` lists "
                          "each format's options)") from None


def _need_root(cfg: Any, what: str) -> str:
    if not cfg.root:
        raise ConfigError(f"dataset format {cfg.name!r} needs `root`: {what}")
    return str(cfg.root)


def _opts(cfg: Any) -> dict[str, Any]:
    return dict(cfg.options or {})


# ---------------------------------------------------------------- generated

def _shapes(variant: str) -> Callable[[Any], Any]:
    def build(cfg: Any) -> Any:
        from vitscope.data.synthetic import SyntheticShapes

        return SyntheticShapes(n=cfg.n_images, seed=cfg.seed, size=cfg.size, variant=variant, **_opts(cfg))
    return build


_TILING = ("tiling", "tile_scale", "patch")
#: the ``patch`` option that cuts the tiles for each model's own patch size (the default of ``tiling: true``)
PER_MODEL = "model"
#: formats whose images reach the model whole by default (``crop: full``), at sizes other than its input
WHOLE_FRAME_FORMATS = frozenset({"davis2016", "davis2017", "spair71k", "roxford5k", "rparis6k"})


def tile_patch(cfg: Any) -> int | str | None:
    """The patch size a dataset config's tiles are cut for: an integer, `PER_MODEL` (``patch: model``, the default
    with ``tiling: true``: each model's own), or None for an untiled dataset."""
    o = dict(getattr(cfg, "options", None) or {})
    if not o.get("tiling"):
        return None
    patch = o.get("patch", PER_MODEL)
    return PER_MODEL if patch == PER_MODEL else patch


def whole_frames(cfg: Any) -> bool:
    """Whether a dataset config's images reach the model whole, at sizes other than its input (`Framing`'s
    ``crop: full``, the default of `WHOLE_FRAME_FORMATS`): not when tiled (tiles are the input size), centre
    cropped or letterboxed to a square."""
    o = dict(getattr(cfg, "options", None) or {})
    return (getattr(cfg, "name", None) in WHOLE_FRAME_FORMATS and not o.get("tiling")
            and o.get("crop", "full") == "full" and not o.get("letterbox"))


def _tiled(ds: Any, tiling: dict[str, Any]) -> Any:
    """Options ``tiling: true`` (``tile_scale``: short side = this x the model input, default 2; ``patch``: the
    patch size the tiles are cut for, default ``model``: each model's own, as Walmer et al.'s dense extraction;
    an integer cuts them once for that size): the dataset's items as dense tiles
    (`vitscope.data.tiling.TiledDataset`)."""
    if not tiling.get("tiling"):
        return ds
    from vitscope.data.tiling import TiledDataset

    patch = tiling.get("patch", PER_MODEL)
    return TiledDataset(ds, scale=int(tiling.get("tile_scale", 2)), patch=None if patch == PER_MODEL else int(patch))


def _split_tiling(o: dict[str, Any]) -> dict[str, Any]:
    return {k: o.pop(k) for k in _TILING if k in o}


def _videos(cfg: Any) -> Any:
    from vitscope.data.synthetic_tasks import SyntheticVideos

    o = _opts(cfg)
    tiling = _split_tiling(o)
    n_frames = int(o.pop("n_frames", 16))
    n_videos = int(o.pop("n_videos", max(1, cfg.n_images // n_frames)))
    return _tiled(SyntheticVideos(n_videos=n_videos, n_frames=n_frames, seed=cfg.seed, size=cfg.size, **o), tiling)


def _pairs(cfg: Any) -> Any:
    from vitscope.data.synthetic_tasks import SyntheticPairs

    o = _opts(cfg)
    tiling = _split_tiling(o)
    return _tiled(SyntheticPairs(n_pairs=int(o.pop("n_pairs", max(1, cfg.n_images // 2))), seed=cfg.seed,
                                 size=cfg.size, flat=bool(o.pop("flat", True)), **o), tiling)


def _retrieval(cfg: Any) -> Any:
    from vitscope.data.synthetic_tasks import SyntheticRetrieval

    o = _opts(cfg)
    views = int(o.pop("views", 4))
    n_queries = int(o.pop("n_queries", max(1, cfg.n_images // (views + 3))))
    n_distractors = int(o.pop("n_distractors", 2 * n_queries))
    return SyntheticRetrieval(n_queries=n_queries, views=views, n_distractors=n_distractors, seed=cfg.seed,
                              size=cfg.size, **o)


def _silhouettes(conflict: bool) -> Callable[[Any], Any]:
    def build(cfg: Any) -> Any:
        from vitscope.data.silhouettes import CUES, Silhouettes

        o = _opts(cfg)
        cue = "conflict" if conflict else o.pop("cue", "both")
        if cue not in CUES[:3] and not conflict:
            raise ConfigError(f"dataset format {cfg.name!r}: option cue {cue!r} is not a clean set; choose both, "
                              "shape or texture (the cue-conflict images are the format synthetic-silhouette-conflict)")
        return Silhouettes(n=cfg.n_images, seed=cfg.seed, size=cfg.size, cue=cue, **o)
    return build


_SHAPES_PROVIDE = frozenset({"labels", "masks", "parts", "objects", "keypoints"})
register_format(Format("synthetic-shapes", _SHAPES_PROVIDE, _shapes("random"), ("options",),
                       "generated scenes: 12 shape classes with random textures, masks, parts, keypoints",
                       generated=True))
register_format(Format("synthetic-shapes-textured", _SHAPES_PROVIDE, _shapes("texture-bound"), ("options",),
                       "generated scenes, each class wearing its own texture", generated=True))
register_format(Format("synthetic-cue-conflict", _SHAPES_PROVIDE | {"cue_conflict"}, _shapes("cue-conflict"),
                       ("options",), "generated scenes: the shape of one class wearing the texture of another",
                       generated=True))
register_format(Format("synthetic-silhouettes", frozenset({"labels"}), _silhouettes(False), ("options",),
                       "generated 32-px silhouettes for shape vs texture: 8 classes, each a shape and a texture; "
                       "option cue: both (default: shape-only and texture-only images interleaved, each labelled "
                       "by its cue; the shape_bias probes' training set), shape or texture", generated=True))
register_format(Format("synthetic-silhouette-conflict", frozenset({"labels", "cue_conflict"}), _silhouettes(True),
                       ("options",), "generated 32-px cue-conflict silhouettes: the shape of one class filled with "
                       "the texture of another (the classes of synthetic-silhouettes)", generated=True))
register_format(Format("synthetic-videos", frozenset({"videos", "masks", "objects", "keypoints"}), _videos,
                       ("options",), "generated videos (options: n_frames, n_videos, tiling; n_images = frames "
                       "in all)", generated=True))
register_format(Format("synthetic-pairs", frozenset({"pairs", "keypoints", "labels"}), _pairs, ("options",),
                       "generated same-class image pairs with corresponding keypoints, flattened (item 2p source, "
                       "2p + 1 target; n_images = images, 2 per pair; options: n_pairs, tiling)", generated=True))
register_format(Format("synthetic-retrieval", frozenset({"retrieval"}), _retrieval, ("options",),
                       "generated instance retrieval: queries, database, easy / hard / junk ground truth "
                       "(options: views, n_queries, n_distractors)", generated=True))


# ---------------------------------------------------------------- shipped

def _cifar_1k(cfg: Any) -> Any:
    from vitscope.data.formats.shipped import Cifar10Test1k

    return Cifar10Test1k(**_opts(cfg))


register_format(Format("cifar10-test-1k", frozenset({"labels"}), _cifar_1k, (),
                       "1,000 CIFAR-10 test photographs shipped with the package (100 per class; "
                       "vitscope/data/shipped/README.md)"))


# ---------------------------------------------------------------- real formats on disk

def _imagefolder(cfg: Any) -> Any:
    from vitscope.data.formats import ImageFolder

    return ImageFolder(_need_root(cfg, "the folder of class folders"), classes=cfg.classes, per_class=cfg.per_class,
                       test_root=cfg.test_root, **_opts(cfg))


def _cifar10(cfg: Any) -> Any:
    from vitscope.data.formats import Cifar

    return Cifar(_need_root(cfg, "the folder holding cifar-10-batches-py"), train=(cfg.split or "test") == "train",
                 **_opts(cfg))


def _coco(cfg: Any) -> Any:
    from vitscope.data.formats import CocoInstances

    if not cfg.annotations:
        raise ConfigError("dataset format 'coco' needs `annotations`: the instances_*.json file")
    o = _opts(cfg)
    tiling = _split_tiling(o)
    return _tiled(CocoInstances(_need_root(cfg, "the folder of images"), cfg.annotations, **o), tiling)


def _partimagenet(cfg: Any) -> Any:
    from vitscope.data.formats import PartImageNet

    if not cfg.annotations:
        raise ConfigError("dataset format 'partimagenet' needs `annotations`: the split's COCO-style json file")
    o = _opts(cfg)
    tiling = _split_tiling(o)
    return _tiled(PartImageNet(_need_root(cfg, "the folder of images"), cfg.annotations, **o), tiling)


def _davis(year: int) -> Callable[[Any], Any]:
    def build(cfg: Any) -> Any:
        from vitscope.data.formats import Davis

        o = _opts(cfg)
        tiling = _split_tiling(o)
        if cfg.size:
            o.setdefault("size", cfg.size)
        return _tiled(Davis(_need_root(cfg, "the DAVIS folder (JPEGImages, Annotations, ImageSets)"), year=year,
                            split=cfg.split or "val", **o), tiling)
    return build


def _spair(cfg: Any) -> Any:
    from vitscope.data.formats import SPair71k

    o = _opts(cfg)
    tiling = _split_tiling(o)
    o.setdefault("flat", True)
    o.setdefault("seed", cfg.seed)
    if cfg.size:
        o.setdefault("size", cfg.size)
    return _tiled(SPair71k(_need_root(cfg, "the SPair-71k folder (JPEGImages, PairAnnotation, ...)"),
                           split=cfg.split or "test", **o), tiling)


def _revisited(which: str) -> Callable[[Any], Any]:
    def build(cfg: Any) -> Any:
        from vitscope.data.formats import RevisitedRetrieval

        o = _opts(cfg)
        if cfg.size:
            o.setdefault("size", cfg.size)
        return RevisitedRetrieval(_need_root(cfg, f"the folder holding gnd_{which}.pkl and jpg/"), dataset=which,
                                  **o)
    return build


register_format(Format("imagefolder", frozenset({"labels", "split"}), _imagefolder,
                       ("root", "classes", "per_class", "test_root", "options"),
                       "root/<class>/<image>; a split from root/train + root/test|val or test_root"))
register_format(Format("cifar10", frozenset({"labels"}), _cifar10, ("root", "split", "options"),
                       "CIFAR-10 in its python-batches layout (split: test | train)"))
register_format(Format("coco", frozenset({"labels", "masks", "objects"}), _coco, ("root", "annotations", "options"),
                       "COCO instances: images folder + instances json; objects = one id per annotated instance, "
                       "each labelled with its category (the semantics object view), label = the category "
                       "covering most of the image (options: category_ids, only_annotated, include_crowd, tiling)"))
register_format(Format("partimagenet", frozenset({"labels", "masks", "parts", "objects"}), _partimagenet,
                       ("root", "annotations", "options"), "PartImageNet: images folder + COCO-style part json; "
                       "objects = one id per part annotation, each labelled with its part (the semantics part "
                       "view), label = the dominant supercategory (options: only_annotated, tiling)"))
_VIDEO = frozenset({"videos", "masks", "objects"})
register_format(Format("davis2016", _VIDEO, _davis(2016), ("root", "split", "options"),
                       "DAVIS 2016 (single object) video segmentation (options: crop = full | center, "
                       "size = short side, default 480; tiling)"))
register_format(Format("davis2017", _VIDEO, _davis(2017), ("root", "split", "options"),
                       "DAVIS 2017 (multi-object palettes) video segmentation (options: crop = full | center, "
                       "size = short side, default 480; tiling)"))
register_format(Format("spair71k", frozenset({"pairs", "keypoints", "labels"}), _spair, ("root", "split", "options"),
                       "SPair-71k keypoint correspondence pairs, flattened (split: trn | val | test; options: "
                       "n_pairs = a sample drawn without replacement with the dataset's seed, crop = full | center, "
                       "size = short side, default the model input; letterbox = true: the authors' long side + "
                       "padding; pairs_per_category, pair_seed = 42: the authors' per-category selection; tiling)"))
register_format(Format("roxford5k", frozenset({"retrieval"}), _revisited("roxford5k"), ("root", "options"),
                       "revisited Oxford: gnd_roxford5k.pkl + jpg/ (options: crop = full | center, size = long side, "
                       "default the model input)"))
register_format(Format("rparis6k", frozenset({"retrieval"}), _revisited("rparis6k"), ("root", "options"),
                       "revisited Paris: gnd_rparis6k.pkl + jpg/ (options: crop = full | center, size = long side, "
                       "default the model input)"))


def describe() -> str:
    """The catalog as text (`vitscope datasets`)."""
    lines = []
    w = max(len(n) for n in FORMATS)
    for fmt in FORMATS.values():
        opts = ", ".join(o for o in fmt.options) or "-"
        lines.append(f"{fmt.name:<{w}}  {fmt.description}")
        lines.append(f"{'':<{w}}  provides: {', '.join(sorted(fmt.provides))}; options: {opts}"
                     + ("; generated, no files" if fmt.generated else ""))
    lines.append("")
    lines.append("Every format also takes n_images (at most this many items; whole videos / pairs), seed and size "
                 "(None = each model's input size).")
    return "\n".join(lines)


# ---------------------------------------------------------------- robustness stimuli on disk

def _cue_conflict(cfg: Any) -> Any:
    from vitscope.data.formats import CueConflictFolder

    return CueConflictFolder(_need_root(cfg, "the folder of shape-category folders of <shape><i>-<texture><j>.png"),
                             **_opts(cfg))


def _corrupted(cfg: Any) -> Any:
    from vitscope.data.formats import CorruptedFolder

    return CorruptedFolder(_need_root(cfg, "the ImageNet-C (<corruption>/<severity>/<class>/) or CIFAR-10-C "
                                           "(<corruption>.npy, labels.npy) folder"), **_opts(cfg))


register_format(Format("cue-conflict", frozenset({"labels", "cue_conflict"}), _cue_conflict, ("root", "options"),
                       "cue-conflict images of Geirhos et al. (ICLR 2019): root/<shape>/<shape><i>-<texture><j>.png"))
register_format(Format("corrupted", frozenset({"labels"}), _corrupted, ("root", "options"),
                       "pre-corrupted images, ImageNet-C or CIFAR-10-C layout (options: corruptions, severities); "
                       "scored by the corruptions analysis with the model's head"))
