"""DAVIS video object segmentation: ``JPEGImages/<res>/<seq>/00000.jpg`` frames with
``Annotations/<res>/<seq>/00000.png`` masks and ``ImageSets`` split lists.

2016: one object per sequence, binary masks (0 / 255 greyscale); 2017: several objects, palette PNGs
whose indices are the object ids. Split lists: ``ImageSets/<year>/<split>.txt`` with one sequence name
per line, or DAVIS 2016's original ``ImageSets/<res>/<split>.txt`` with one ``image annotation`` pair
per line. A frame without an annotation (e.g. test-dev after frame 0) has ``objects`` None.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitscope.data.base import Sample
from vitscope.data.formats.common import FileDataset, Unreadable, read_label_png, read_rgb
from vitscope.data.transforms import Framing
from vitscope.errors import InputError


def _split_sequences(root: Path, year: int, split: str, resolution: str) -> list[str]:
    named = root / "ImageSets" / str(year) / f"{split}.txt"
    pairs = root / "ImageSets" / resolution / f"{split}.txt"
    if named.is_file():
        return [ln.strip() for ln in named.read_text().splitlines() if ln.strip()]
    if pairs.is_file():
        seqs: list[str] = []
        for ln in pairs.read_text().splitlines():
            if ln.strip():
                seq = Path(ln.split()[0]).parent.name
                if seq not in seqs:
                    seqs.append(seq)
        return seqs
    raise InputError(f"no split list for DAVIS {year} {split!r}: expected {str(named)!r} (sequence names) or "
                     f"{str(pairs)!r} (image / annotation pairs)")


class Davis(FileDataset):
    """Every frame of the split's sequences, in order. Sample: ``objects`` (object ids, 0 = background;
    2016: 0/1), ``mask`` = any object, ``frame``, ``sequence``; label = the sequence's index in
    ``classes`` (= ``sequences``). `sequence_indices` gives one video's items.

    Frames reach the model whole by default, as DINO's protocol has them (``crop='full'``: the short side
    resized to ``size`` = 480 pixels, the aspect ratio kept, each side rounded down to a multiple of the
    model's patch size; the annotation at the file's resolution travels beside, for scoring there);
    ``crop='center'``: the model's eval preprocessing (short side resized, centre crop)."""

    def __init__(self, root: str | Path, year: int = 2017, split: str = "val", resolution: str = "480p",
                 sequences: list[str] | None = None, name: str | None = None, crop: str = "full",
                 size: int | None = 480):
        super().__init__()
        self.framing = Framing(crop, size, "short")
        if year not in (2016, 2017):
            raise InputError(f"DAVIS comes as 2016 or 2017; got year={year}")
        self.root, self.year, self.resolution = Path(root), year, resolution
        self.name = name or f"davis{year}-{split}"
        img_root = self.root / "JPEGImages" / resolution
        ann_root = self.root / "Annotations" / resolution
        if not img_root.is_dir():
            raise InputError(f"expected DAVIS frames under {str(img_root)!r} (JPEGImages/{resolution}/<seq>/00000.jpg)")
        self.sequences = list(sequences) if sequences is not None else _split_sequences(self.root, year, split,
                                                                                         resolution)
        if not self.sequences:
            raise InputError(f"the DAVIS {year} {split!r} split names no sequences")
        self.classes = list(self.sequences)
        self.frames: list[tuple[int, int, Path, Path | None]] = []  # (sequence, frame, image, annotation)
        for s, seq in enumerate(self.sequences):
            folder = img_root / seq
            jpgs = sorted(folder.glob("*.jpg")) if folder.is_dir() else []
            if not jpgs:
                raise InputError(f"sequence {seq!r} has no frames: expected {str(folder)}/00000.jpg, ...")
            stems = {p.stem for p in jpgs}
            anns = {p.stem: p for p in (ann_root / seq).glob("*.png")} if (ann_root / seq).is_dir() else {}
            orphans = sorted(set(anns) - stems)
            if orphans:
                raise InputError(f"annotations of sequence {seq!r} refer to missing frames: "
                                 f"{', '.join(str(img_root / seq / (o + '.jpg')) for o in orphans[:3])}")
            if jpgs[0].stem not in anns:
                raise InputError(f"sequence {seq!r} has no annotation of its first frame: expected "
                                 f"{str(ann_root / seq / (jpgs[0].stem + '.png'))!r}")
            self.frames += [(s, t, p, anns.get(p.stem)) for t, p in enumerate(jpgs)]

    def __len__(self) -> int:
        return len(self.frames)

    def unit_bounds(self) -> list[int]:
        """The first item of every sequence (a video is never split across shards or subsamples)."""
        return [i for i, f in enumerate(self.frames) if f[1] == 0]

    def sequence_indices(self, sequence: str) -> list[int]:
        """The items of one sequence, in frame order."""
        s = self.sequences.index(sequence)
        return [i for i, f in enumerate(self.frames) if f[0] == s]

    def load(self, i: int) -> Sample:
        s, t, img_path, ann_path = self.frames[i]
        image = read_rgb(img_path)
        objects = None
        if ann_path is not None:
            labels = read_label_png(ann_path)
            if labels.shape != image.shape[:2]:
                raise Unreadable(ann_path, f"annotation is {labels.shape[1]}x{labels.shape[0]}, frame is "
                                           f"{image.shape[1]}x{image.shape[0]}")
            objects = (labels > (127 if labels.max() > 1 else 0)).astype(np.int64) if self.year == 2016 else labels
        return Sample(image=image, label=s, mask=None if objects is None else objects > 0, objects=objects,
                      frame=t, sequence=self.sequences[s], index=i,
                      extra={"path": str(img_path), "annotation": None if ann_path is None else str(ann_path)})
