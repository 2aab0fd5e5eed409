"""Public robustness stimuli in their published layouts.

`CueConflictFolder`: the cue-conflict images of Geirhos et al., "ImageNet-trained CNNs are biased towards
texture; increasing shape bias improves accuracy and robustness" (ICLR 2019), as distributed in
``rgeirhos/texture-vs-shape`` (``stimuli/style-transfer-preprocessed-512``) and bethgelab/model-vs-human
(``cue-conflict``): one folder per shape category holding ``<shape><i>-<texture><j>.png``. Labels are the
shape's position in the sorted category list, the texture's in ``batch.extra['texture_labels']``.

`CorruptedFolder`: pre-corrupted images, ImageNet-C layout (``root/<corruption>/<severity>/<class>/<image>``,
Hendrycks & Dietterich, ICLR 2019) or CIFAR-10-C layout (``root/<corruption>.npy``, 5 x 10000 images,
severity 1 first, and ``root/labels.npy``); each image's corruption and severity in ``batch.extra``
(``corruption``: list of names, ``severity``: (B,) long).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from vitscope.data.base import Batch, Sample
from vitscope.data.formats.common import FileDataset, image_files, read_rgb
from vitscope.errors import InputError, first_line

#: CIFAR-100's fine labels in their official order (alphabetical; the label ids of CIFAR-100-C's labels.npy)
CIFAR100_CLASSES: tuple[str, ...] = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish",
    "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
    "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange",
    "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
    "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk",
    "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
    "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale",
    "willow_tree", "wolf", "woman", "worm")
#: the ``classes`` option of the .npy layout: which label space labels.npy holds
NPY_CLASSES = ("auto", "cifar10", "cifar100")

CUE_CONFLICT_NAME = re.compile(r"^(?P<shape>[a-z]+)(?P<i>\d+)-(?P<texture>[a-z]+)(?P<j>\d+)$")


class CueConflictFolder(FileDataset):
    """Cue-conflict images in the layout of Geirhos et al.: ``root/<shape>/<shape><i>-<texture><j>.png``.
    Every file name must parse and name categories that have a folder; one sentence names the first
    offenders otherwise (at construction, before any model runs)."""

    def __init__(self, root: str | Path, name: str | None = None):
        super().__init__()
        self.root = Path(root)
        self.name = name or "cue-conflict"
        if not self.root.is_dir():
            raise InputError(f"expected a cue-conflict folder (root/<shape>/<shape><i>-<texture><j>.png) at "
                             f"{str(self.root)!r}; it does not exist")
        self.classes: list[str] = sorted(p.name for p in self.root.iterdir()
                                         if p.is_dir() and not p.name.startswith("."))
        if len(self.classes) < 2:
            raise InputError(f"{str(self.root)!r} holds {len(self.classes)} category folders; a cue-conflict set "
                             "has one folder per shape category (Geirhos et al.: 16)")
        index = {c: k for k, c in enumerate(self.classes)}
        self.files: list[Path] = []
        self.labels: list[int] = []
        self.texture_labels: list[int] = []
        bad: list[str] = []
        for c in self.classes:
            for f in image_files(self.root / c):
                m = CUE_CONFLICT_NAME.match(f.stem)
                if m is None or m["shape"] != c or m["texture"] not in index:
                    bad.append(f"{c}/{f.name}")
                    continue
                self.files.append(f)
                self.labels.append(index[c])
                self.texture_labels.append(index[m["texture"]])
        if bad:
            raise InputError(f"{len(bad)} files in {str(self.root)!r} are not named <shape><i>-<texture><j> with the "
                             f"shape its folder and the texture another category folder, e.g. {', '.join(bad[:3])}")
        if not self.files:
            raise InputError(f"{str(self.root)!r} holds no images in its category folders")

    def __len__(self) -> int:
        return len(self.files)

    def index_labels(self) -> list[int]:
        """The class of every item, from the index (no image is read)."""
        return [int(v) for v in self.labels]

    def load(self, i: int) -> Sample:
        return Sample(image=read_rgb(self.files[i]), label=self.labels[i], index=i,
                      extra={"path": str(self.files[i]), "texture_label": self.texture_labels[i]})

    def _collate(self, chunk: list[Sample], pre) -> Batch:  # noqa: ANN001 - Preprocessing
        b = super()._collate(chunk, pre)
        b.extra["texture_labels"] = torch.tensor([s.extra["texture_label"] for s in chunk], dtype=torch.long)
        return b


class CorruptedFolder(FileDataset):
    """Pre-corrupted images in the ImageNet-C or the CIFAR-10-C / CIFAR-100-C layout (detected); ``corruptions`` /
    ``severities`` restrict what is read. Class names: the ImageNet-C class folders (sorted), or, for the .npy
    layout, CIFAR-10's or CIFAR-100's: ``classes`` 'cifar10' / 'cifar100', or 'auto' (default: CIFAR-100 when
    labels.npy holds a label above 9, else CIFAR-10; a small CIFAR-100-C subset whose labels all fall below 10
    needs ``classes: cifar100``). ``images_per_level``: that many images of each severity (a random sample,
    seeded by ``seed``, the same rows in every corruption and severity: Merlin et al. use 1,000 per level)."""

    def __init__(self, root: str | Path, corruptions: list[str] | None = None, severities: list[int] | None = None,
                 name: str | None = None, classes: str = "auto", images_per_level: int | None = None,
                 seed: int = 0):
        from vitscope.data.perturb import CORRUPTIONS

        super().__init__()
        if classes not in NPY_CLASSES:
            raise InputError(f"corrupted: classes {classes!r} is not a label space of the .npy layout; choose "
                             f"{', '.join(NPY_CLASSES)}")
        if images_per_level is not None and int(images_per_level) < 1:
            raise InputError(f"corrupted: images_per_level must be at least 1, got {images_per_level}")
        self.root = Path(root)
        self.name = name or f"corrupted:{self.root.name}"
        if not self.root.is_dir():
            raise InputError(f"expected a folder of corrupted images (ImageNet-C or CIFAR-10-C layout) at "
                             f"{str(self.root)!r}; it does not exist")
        sev = [int(s) for s in (severities or (1, 2, 3, 4, 5))]
        if any(not 1 <= s <= 5 for s in sev):
            raise InputError(f"corruption severities are 1..5; got {severities}")
        self.entries: list[tuple[str, int, int, Path | int]] = []  # corruption, severity, label, file or row
        self.arrays: dict[str, np.ndarray] = {}
        npys = sorted(p.stem for p in self.root.glob("*.npy") if p.stem != "labels")
        if npys:  # CIFAR-10-C / CIFAR-100-C
            if not (self.root / "labels.npy").is_file():
                raise InputError(f"{str(self.root)!r} holds .npy files but no labels.npy (the CIFAR-10-C layout)")
            labels = _npy(self.root / "labels.npy", "an integer label per image", ndim=1)
            self.classes = _npy_classes(labels, classes, self.root / "labels.npy")
            names = corruptions or npys
            self._check(names, npys, CORRUPTIONS)
            for c in names:
                arr = _npy(self.root / f"{c}.npy", "uint8 images (N, H, W, 3)", ndim=4, mmap_mode="r")
                per = len(arr) // 5
                if len(labels) < len(arr):
                    raise InputError(f"{str(self.root / 'labels.npy')!r} holds {len(labels)} labels for the "
                                     f"{len(arr)} images of {c}.npy")
                self.arrays[c] = arr
                rows = _level_rows(per, images_per_level, seed)
                for s in sev:
                    self.entries += [(c, s, int(labels[(s - 1) * per + r]), (s - 1) * per + r) for r in rows]
        else:  # ImageNet-C
            present = sorted(p.name for p in self.root.iterdir() if p.is_dir())
            names = corruptions or [p for p in present if p in CORRUPTIONS]
            self._check(names, present, CORRUPTIONS)
            classes: list[str] | None = None
            for c in names:
                for s in sev:
                    d = self.root / c / str(s)
                    if not d.is_dir():
                        raise InputError(f"{str(d)!r} does not exist (ImageNet-C layout: <corruption>/<severity>/"
                                         "<class>/<image>)")
                    cls = sorted(p.name for p in d.iterdir() if p.is_dir())
                    if classes is None:
                        classes = cls
                    elif cls != classes:
                        raise InputError(f"{str(d)!r} holds other class folders than {names[0]}/{sev[0]}")
                    for k, cl in enumerate(cls):
                        self.entries += [(c, s, k, f) for f in image_files(d / cl)]
            self.classes = classes or []
        if not self.entries:
            raise InputError(f"{str(self.root)!r} holds no corrupted images")

    @staticmethod
    def _check(names: list[str], present: list[str], known: tuple[str, ...]) -> None:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InputError(f"{', '.join(unknown)} are not ImageNet-C / CIFAR-10-C corruptions "
                             f"({', '.join(known)})")
        missing = [n for n in names if n not in present]
        if missing:
            raise InputError(f"the corruptions {', '.join(missing)} are not in the folder (present: "
                             f"{', '.join(present) or 'none'})")

    def __len__(self) -> int:
        return len(self.entries)

    def index_labels(self) -> list[int]:
        """The class of every item, from the index (no image is read)."""
        return [int(v) for v in (e[2] for e in self.entries)]

    def load(self, i: int) -> Sample:
        c, s, label, src = self.entries[i]
        img = np.asarray(self.arrays[c][src]) if isinstance(src, int) else read_rgb(src)
        return Sample(image=img, label=label, index=i, extra={"corruption": c, "severity": s})

    def _collate(self, chunk: list[Sample], pre) -> Batch:  # noqa: ANN001 - Preprocessing
        b = super()._collate(chunk, pre)
        b.extra["corruption"] = [s.extra["corruption"] for s in chunk]
        b.extra["severity"] = torch.tensor([s.extra["severity"] for s in chunk], dtype=torch.long)
        return b


def _npy_classes(labels: np.ndarray, classes: str, path: Path) -> list[str]:
    """CIFAR-10's or CIFAR-100's class names for the labels of a .npy set (``classes``: 'auto' decides by the
    largest label); one InputError sentence when a label falls outside that label space."""
    if classes == "auto":
        classes = "cifar100" if len(labels) and int(labels.max()) >= 10 else "cifar10"
    if classes == "cifar10":
        from vitscope.metrics.robustness import CIFAR10_CLASSES as names
    else:
        names = CIFAR100_CLASSES
    if labels.dtype.kind not in "iu" or (len(labels) and not 0 <= labels.min() <= labels.max() < len(names)):
        raise InputError(f"{str(path)!r} must hold class ids 0..{len(names) - 1} ({classes}), got {labels.dtype} "
                         f"values {labels.min() if len(labels) else ''}..{labels.max() if len(labels) else ''}")
    return list(names)


def _level_rows(per: int, images_per_level: int | None, seed: int) -> list[int]:
    """Rows within one severity's block: all, or a sorted random sample of ``images_per_level`` (seeded, so the
    same rows in every corruption and severity)."""
    if images_per_level is None or int(images_per_level) >= per:
        return list(range(per))
    pick = np.random.default_rng(int(seed)).choice(per, size=int(images_per_level), replace=False)
    return sorted(int(r) for r in pick)


def _npy(path: Path, what: str, ndim: int, mmap_mode: str | None = None) -> np.ndarray:
    """A CIFAR-10-C array: numbers only (an object array would need pickle, which is refused), of ``ndim``
    dimensions; one InputError sentence naming the file otherwise."""
    try:
        arr = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{str(path)!r} is not a plain .npy array of {what} ({first_line(e)})") from None
    if arr.ndim != ndim or arr.dtype.kind not in "iub":
        raise InputError(f"{str(path)!r} must hold {what}; got {arr.dtype} of shape {arr.shape}")
    return arr
