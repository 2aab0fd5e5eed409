"""What every file-backed dataset shares: robust image reading, skip accounting, model-ready batches.

Reading is robust in one precise sense: an image (or its annotation file) that cannot be decoded -
truncated, corrupt, not an image - is skipped, recorded in ``dataset.skipped`` as ``(path, reason)``
and reported by one warning when the pass ends; a pass in which nothing could be read raises. Layout
problems (a missing folder, no images, annotations naming files that are not there) are found when the
dataset is built and raise `vitscope.errors.InputError` saying what was expected.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitscope.data.base import Batch, RaggedBatch, Sample, ragged
from vitscope.data.preprocess import to_rgb
from vitscope.data.transforms import Framing, collate
from vitscope.errors import InputError, VitscopeWarning
from vitscope.models.registry import Preprocessing

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


class SkippedImagesWarning(VitscopeWarning):
    """Some images of a pass could not be read and were left out (listed in ``dataset.skipped``, and in a study's
    manifest.json under ``skipped_images``)."""


class NothingReadable(InputError):
    """None of the images asked for could be read (the study planner counts such chunks and goes on)."""


class Unreadable(Exception):
    """A file that could not be decoded; ``path`` and ``reason`` go into ``dataset.skipped``."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


def open_image(path: str | Path) -> Any:
    """A fully decoded PIL image (decoding errors surface here, not later)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except FileNotFoundError as e:
        raise Unreadable(path, "file not found") from e
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise Unreadable(path, f"{type(e).__name__}: {e}") from e


def read_rgb(path: str | Path) -> np.ndarray:
    """(H, W, 3) uint8; high-bit-depth images scaled to 8 bits, not clipped (`vitscope.data.preprocess.to_rgb`).
    JPEGs are decoded by `decode_jpeg` where it can (the same pixels as PIL, in half the time), the rest by PIL."""
    arr = decode_jpeg(path)
    return arr if arr is not None else np.asarray(to_rgb(open_image(path)))


def decode_jpeg(path: str | Path) -> np.ndarray | None:
    """A colour (YCbCr / RGB) or greyscale JPEG decoded by torchvision's libjpeg-turbo, as (H, W, 3) uint8; None
    for anything else, which PIL then reads (and, for a file neither can decode, says why it is unreadable).

    Why: PIL's decode of an 854x480 JPEG, with the copies ``open_image``, ``convert('RGB')`` and the array
    make, took 2.4 ms on one core; this takes 1.1 ms, and it is the largest cost of reading an image once the
    resize is done in uint8. The pixels are PIL's: both decode with libjpeg-turbo's defaults (accurate integer
    IDCT, fancy upsampling; greyscale repeated into three channels as ``convert('RGB')`` does), which
    tests/test_data_loaders.py checks against PIL itself. Left to PIL: CMYK / YCCK JPEGs (PIL's own colour
    conversion), images above PIL's ``MAX_IMAGE_PIXELS`` (its decompression-bomb warning or refusal), and any
    file libjpeg complains about (a truncated or corrupt one: torchvision raises on libjpeg's warnings). torchvision
    0.29 deprecates its image decoders (for TorchCodec); where they are gone, every file goes to PIL."""
    try:
        with open(path, "rb") as f:
            if f.read(3) != b"\xff\xd8\xff":  # not a JPEG: PIL reads it, the file read once
                return None
            f.seek(0)
            data = f.read()
    except OSError:
        return None
    try:
        from PIL import Image
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as tv_decode_jpeg

        # the header first (PIL reads no pixels here): a file claiming more pixels than PIL's limit, or another
        # colour space, goes to PIL before anything is allocated for it
        with Image.open(io.BytesIO(data)) as im:
            (w0, h0), mode = im.size, im.mode
        limit = Image.MAX_IMAGE_PIXELS
        if mode not in ("RGB", "L") or (limit is not None and w0 * h0 > limit):
            return None
        with warnings.catch_warnings():  # torchvision >= 0.29 says on each call that its decoders are deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            x = tv_decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.UNCHANGED)
    except Exception:  # noqa: BLE001 - PIL reads it, or says why it cannot (also once torchvision drops it)
        return None
    c, h, w = x.shape
    if c not in (1, 3) or (h, w) != (h0, w0):
        return None
    return np.ascontiguousarray(x.expand(3, h, w).permute(1, 2, 0).numpy())


def read_label_png(path: str | Path) -> np.ndarray:
    """(H, W) integer labels of a palette / greyscale PNG (palette indices, not colours)."""
    im = open_image(path)
    if im.mode in ("P", "L", "I", "I;16", "1"):
        return np.asarray(im).astype(np.int64)
    raise Unreadable(path, f"expected a palette or greyscale label PNG, got mode {im.mode}")


# What the data files read with pickle hold (the revisited ground truth, CIFAR's python batches): builtin
# containers and scalars, numpy arrays and scalars. Nothing else is looked up, so a file cannot run code.
_PICKLE_GLOBALS = {
    **{(m, n): True for m in ("builtins", "__builtin__")
       for n in ("dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray", "str", "int", "float", "complex",
                 "bool")},
    ("collections", "OrderedDict"): True,
    ("_codecs", "encode"): True,  # how protocol 2 stores bytes (numpy buffers) written by Python 3
    ("numpy", "ndarray"): True,
    ("numpy", "dtype"): True,
    **{(f"numpy.{core}.multiarray", n): True for core in ("core", "_core") for n in ("_reconstruct", "scalar")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): True for core in ("core", "_core")},  # protocol 5 arrays
}


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_GLOBALS and not (module == "numpy.dtypes" and name.endswith("DType")):
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a data file has no use for")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core under numpy 2
            return super().find_class(module, name)


def load_data_pickle(path: str | Path, encoding: str = "ASCII") -> Any:
    """Unpickle a data file that may only hold builtin containers and scalars and numpy arrays; anything else
    (a class, a function: what a payload needs to run code) raises `pickle.UnpicklingError` before it is
    looked up. ``encoding``: for Python 2 pickles ('latin1' for numpy arrays, as numpy advises)."""
    with open(path, "rb") as f:
        return _DataUnpickler(f, encoding=encoding).load()


def image_files(folder: Path, extensions: Sequence[str] = IMAGE_EXTENSIONS) -> list[Path]:
    """Image files directly in ``folder``, sorted by name."""
    ext = tuple(e.lower() for e in extensions)
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in ext)


def missing_files(paths: Iterable[Path]) -> list[Path]:
    """The paths that do not exist (one directory listing per folder, not one stat per file)."""
    listing: dict[Path, set[str]] = {}
    out = []
    for p in paths:
        d = p.parent
        if d not in listing:
            listing[d] = {q.name for q in d.iterdir()} if d.is_dir() else set()
        if p.name not in listing[d]:
            out.append(p)
    return out


def require_files(paths: Sequence[Path], what: str) -> None:
    """InputError naming the first few of ``paths`` that are missing."""
    miss = missing_files(paths)
    if miss:
        shown = ", ".join(str(m) for m in miss[:5]) + (f", ... ({len(miss) - 5} more)" if len(miss) > 5 else "")
        raise InputError(f"{len(miss)} of {len(paths)} files that {what} are missing: {shown}")


class FileDataset:
    """Base of the file-format loaders: subclasses set ``name``, ``classes`` and implement ``__len__`` and
    ``load(i) -> Sample`` (raising `Unreadable` for a file that cannot be decoded)."""

    name: str = "files"
    classes: list[str]
    #: how images reach the model (`vitscope.data.transforms.Framing`); formats whose protocol is full-frame
    #: (DAVIS, SPair-71k, revisited Oxford / Paris) set ``crop='full'`` by default
    framing: Framing = Framing()
    #: items cost a file's decoding (a study reads them in worker processes: `vitscope.data.pipeline`); False
    #: for formats that hold their images in memory
    reads_files: bool = True

    def __init__(self) -> None:
        self.skipped: list[tuple[str, str]] = []
        self._skipped_paths: set[str] = set()

    def __len__(self) -> int:
        raise NotImplementedError

    def load(self, i: int) -> Sample:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Sample:
        """Sample ``i`` at the file's resolution; an unreadable file raises InputError."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.name} has {len(self)} items; got index {i}")
        try:
            return self.load(i)
        except Unreadable as e:
            raise InputError(f"could not read {e.path}: {e.reason}") from e

    def _skip(self, e: Unreadable, new: list[tuple[str, str]]) -> None:
        new.append((e.path, e.reason))
        self.note_skipped(e.path, e.reason)

    def note_skipped(self, path: str, reason: str) -> None:
        """Record an unreadable image once (also one that a worker process's copy of the dataset met)."""
        if path not in self._skipped_paths:
            self._skipped_paths.add(path)
            self.skipped.append((path, reason))

    def _report(self, new: list[tuple[str, str]], tried: int, read: int, finished: bool) -> None:
        if new:
            shown = "; ".join(f"{p} ({r})" for p, r in new[:3]) + (f"; ... ({len(new) - 3} more)"
                                                                    if len(new) > 3 else "")
            warnings.warn(f"{self.name}: {len(new)} of {tried} images could not be read and were skipped: {shown}. "
                          "A study's manifest.json lists every one (skipped_images); code reads the dataset's .skipped",
                          SkippedImagesWarning, stacklevel=3)
        if finished and tried and not read:
            raise NothingReadable(f"{self.name}: none of the {tried} images could be read (first: {new[0][0]}: "
                             f"{new[0][1]})")

    def items(self, indices: Iterable[int]) -> Iterator[Any]:
        """``load(i)`` for each index, unreadable ones skipped, recorded and reported once at the end."""
        new: list[tuple[str, str]] = []
        tried = read = 0
        finished = False
        try:
            for i in indices:
                tried += 1
                try:
                    item = self.load(i)
                except Unreadable as e:
                    self._skip(e, new)
                    continue
                read += 1
                yield item
            finished = True
        finally:
            self._report(new, tried, read, finished)

    def raw_samples(self, indices: Iterable[int], size: int | None = None) -> Iterator[Any]:
        """Readable items at the files' resolution (``size`` is ignored; for `vitscope.data.tiling.TiledDataset`)."""
        yield from self.items(indices)

    def samples(self, indices: Iterable[int] | None = None) -> Iterator[Sample]:
        """Readable samples at their own resolution."""
        yield from self.items(range(len(self)) if indices is None else indices)

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None, flip: bool = False) -> Iterator[Batch | RaggedBatch]:
        """Model-ready batches (`framing`: centre crop, or whole frames; annotations follow; optional flip);
        ``index`` holds the dataset ids of the images actually read. Whole frames of different sizes in one
        chunk make a `vitscope.data.base.RaggedBatch` (runs of one size)."""
        ids = list(range(len(self))) if indices is None else list(indices)
        chunk: list[Sample] = []
        for s in self.items(ids[start:]):
            chunk.append(self.frame(s, preprocessing, flip))
            if len(chunk) == batch_size:
                yield self.collate_chunk(chunk, preprocessing)
                chunk = []
        if chunk:
            yield self.collate_chunk(chunk, preprocessing)

    def frame(self, s: Sample, pre: Preprocessing, flip: bool = False) -> Sample:
        """One sample as the model sees it (`framing`)."""
        return self.framing.apply(s, pre, flip)

    def collate_chunk(self, chunk: list[Sample], pre: Preprocessing) -> Batch | RaggedBatch:
        """A chunk's samples -> a batch, or a `RaggedBatch` of runs of one size."""
        return ragged([self._collate(r, pre) for r in runs_of_one_size(chunk)])

    def _collate(self, chunk: list[Sample], pre: Preprocessing) -> Batch:
        b = collate(chunk, pre)
        b.extra["geometry"] = [s.geometry for s in chunk]
        if getattr(self, "classes", None) is not None:
            b.extra["class_names"] = self.classes  # what the labels mean (robustness readouts match heads by name)
        if all("path" in s.extra for s in chunk):
            b.extra["paths"] = [s.extra["path"] for s in chunk]
        if all("source_objects" in s.extra for s in chunk):
            b.extra["source_objects"] = [torch.as_tensor(np.asarray(s.extra["source_objects"])).long() for s in chunk]
        b.extra["framing"] = self.framing.describe(pre)
        return b


def runs_of_one_size(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive samples grouped into runs of one image size (one forward each), in order."""
    runs: list[list[Sample]] = []
    for s in samples:
        if runs and runs[-1][0].size == s.size:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs
