"""Class-per-folder image sets (``root/<class>/<image>``), with the ImageNet-subset selection: a class-id
list file (one id per line, optionally followed by a display name, as ``imagenet50_classes.txt``) and
the first N sorted files of each class."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vitscope.data.base import Sample
from vitscope.data.formats.common import IMAGE_EXTENSIONS, FileDataset, image_files, read_rgb
from vitscope.errors import InputError, close_matches


def read_class_list(path: str | Path) -> tuple[list[str], list[str]]:
    """(folder ids, display names) from a class list file: ``<id> [name...]`` per line; blank lines and
    ``#`` comments are ignored; the name defaults to the id."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"class list {str(path)!r} does not exist (expected one class id per line)")
    ids, names = [], []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split(maxsplit=1)
        ids.append(parts[0])
        names.append(parts[1].strip() if len(parts) > 1 else parts[0])
    if not ids:
        raise InputError(f"class list {str(path)!r} names no classes (expected one class id per line)")
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise InputError(f"class list {str(path)!r} names classes more than once: {', '.join(dup[:5])}")
    return ids, names


class ImageFolder(FileDataset):
    """``root/<class>/<image>``; label = position of the class in ``classes``.

    classes: None = every sub-folder, sorted (torchvision's order); a list of folder names, or the path
    of a class list file (then labels follow the file's order and ``class_names`` its names).
    per_class: keep the first N files of each class in sorted file-name order (the ImageNet-50 subset:
    ``ImageFolder(train_dir, 'imagenet50_classes.txt', per_class=100)``); a class with fewer raises
    unless ``strict=False``.
    test_root: a second folder of the same classes whose images form the test split (``sample.is_test``;
    k-NN and probes train on the rest). When ``root`` itself holds ``train/`` and ``test/`` (or ``val/``)
    folders and no ``test_root`` is given, those are used (CIFAR-10 as an ImageFolder, ImageNet layouts).
    """

    def __init__(self, root: str | Path, classes: str | Path | Sequence[str] | None = None,
                 per_class: int | None = None, extensions: Sequence[str] = IMAGE_EXTENSIONS,
                 name: str | None = None, strict: bool = True, test_root: str | Path | None = None):
        super().__init__()
        self.root = Path(root)
        self.name = name or f"imagefolder:{self.root.name}"
        if test_root is None and (self.root / "train").is_dir():
            test_root = next((self.root / t for t in ("test", "val") if (self.root / t).is_dir()), None)
            if test_root is not None:
                self.root = self.root / "train"
        self.is_test: list[bool] | None = None
        if test_root is not None:
            train = ImageFolder(self.root, classes, per_class, extensions, name, strict)
            test = ImageFolder(test_root, train.classes, per_class, extensions, name, strict)
            self.classes, self.class_names = train.classes, train.class_names
            self.files, self.labels = train.files + test.files, train.labels + test.labels
            self.is_test = [False] * len(train.files) + [True] * len(test.files)
            return
        if not self.root.is_dir():
            raise InputError(f"expected a folder of class folders (root/<class>/<images>) at {str(self.root)!r}; "
                             "it does not exist")
        present = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if classes is None:
            ids, names = present, present
        elif isinstance(classes, str | Path):
            ids, names = read_class_list(classes)
        else:
            ids, names = list(classes), list(classes)
        if not ids:
            raise InputError(f"{str(self.root)!r} holds no class folders (expected root/<class>/<image files>)")
        missing = [c for c in ids if c not in present]
        if missing:
            hint = close_matches(missing[0], present, n=3)
            raise InputError(f"{len(missing)} of {len(ids)} classes have no folder under {str(self.root)!r}: "
                             f"{', '.join(missing[:5])}" + (f" (did you mean {', '.join(hint)}?)" if hint else ""))
        self.classes: list[str] = list(ids)
        self.class_names: list[str] = list(names)
        self.files: list[Path] = []
        self.labels: list[int] = []
        for label, c in enumerate(ids):
            files = image_files(self.root / c, extensions)
            if not files:
                raise InputError(f"class folder {str(self.root / c)!r} holds no images (expected files ending in "
                                 f"{', '.join(extensions)})")
            if per_class is not None:
                if strict and len(files) < per_class:
                    raise InputError(f"class folder {str(self.root / c)!r} holds {len(files)} images; the subset "
                                     f"takes the first {per_class} sorted files of each class")
                files = files[:per_class]
            self.files += files
            self.labels += [label] * len(files)

    def __len__(self) -> int:
        return len(self.files)

    def index_labels(self) -> list[int]:
        """The class of every item, from the index (no image is read)."""
        return [int(v) for v in self.labels]

    def load(self, i: int) -> Sample:
        return Sample(image=read_rgb(self.files[i]), label=self.labels[i], index=i,
                      is_test=None if self.is_test is None else self.is_test[i], extra={"path": str(self.files[i])})
