"""SPair-71k semantic correspondence: ``PairAnnotation/<split>/*.json`` (one pair per file: src_imname,
trg_imname, category, src_kps / trg_kps ([x, y] per keypoint, visible in both), kps_ids, src_bndbox /
trg_bndbox [x0, y0, x1, y1], plus viewpoint / scale / truncation / occlusion labels) and images in
``JPEGImages/<category>/``. SPair's coordinates are pixel indices; they get +0.5 here (vitscope's
continuous convention), which moves every point and box corner alike and keeps distances and box sizes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from vitscope.data.base import Batch, Sample
from vitscope.data.formats.common import FileDataset, read_rgb, require_files
from vitscope.data.transforms import for_model
from vitscope.errors import InputError
from vitscope.models.registry import Preprocessing

SPLITS = ("trn", "val", "test")
_VARIATIONS = ("viewpoint_variation", "scale_variation", "truncation", "occlusion", "mirror")


class SPair71k(FileDataset):
    """Item i = pair i (files sorted by name). `pair(i)` -> (source, target) Samples with ``keypoints``
    (K, 3) in the same keypoint order, ``bbox``, label = category index, ``extra['kps_ids']``.
    ``batches`` yields the sources with ``extra['target']`` the batch of targets (as
    `vitscope.data.synthetic_tasks.SyntheticPairs`)."""

    def __init__(self, root: str | Path, split: str = "test", categories: list[str] | None = None,
                 name: str | None = None):
        super().__init__()
        self.root = Path(root)
        if split not in SPLITS:
            raise InputError(f"SPair-71k splits are {', '.join(SPLITS)}; got {split!r}")
        self.name = name or f"spair71k-{split}"
        folder = self.root / "PairAnnotation" / split
        files = sorted(folder.glob("*.json")) if folder.is_dir() else []
        if not files:
            raise InputError(f"no pair annotations in {str(folder)!r} (expected PairAnnotation/{split}/*.json)")
        img_root = self.root / "JPEGImages"
        cats = sorted(p.name for p in img_root.iterdir() if p.is_dir()) if img_root.is_dir() else []
        self.pairs: list[dict] = []
        for f in files:
            try:
                d = json.loads(f.read_text())
                rec = {k: d[k] for k in ("src_imname", "trg_imname", "category", "src_kps", "trg_kps",
                                         "src_bndbox", "trg_bndbox")}
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InputError(f"{str(f)!r} is not a SPair-71k pair annotation ({type(e).__name__}: {e})") from e
            if categories is not None and rec["category"] not in categories:
                continue
            rec["kps_ids"] = d.get("kps_ids", list(range(len(rec["src_kps"]))))
            rec.update({k: d[k] for k in _VARIATIONS if k in d})
            rec["file"] = f.name
            if len(rec["src_kps"]) != len(rec["trg_kps"]):
                raise InputError(f"{str(f)!r}: {len(rec['src_kps'])} source but {len(rec['trg_kps'])} target keypoints")
            self.pairs.append(rec)
        if not self.pairs:
            raise InputError(f"no pairs of categories {categories} in {str(folder)!r}")
        self.classes = cats or sorted({p["category"] for p in self.pairs})
        unknown = sorted({p["category"] for p in self.pairs} - set(self.classes))
        if unknown:
            raise InputError(f"pairs refer to categories without an image folder under {str(img_root)!r}: {unknown}")
        require_files([self._path(p, "src") for p in self.pairs] + [self._path(p, "trg") for p in self.pairs],
                      f"the pair annotations in {str(folder)!r} refer to")

    def _path(self, rec: dict, side: str) -> Path:
        return self.root / "JPEGImages" / rec["category"] / rec[f"{side}_imname"]

    def __len__(self) -> int:
        return len(self.pairs)

    def _side(self, i: int, side: str) -> Sample:
        rec = self.pairs[i]
        kps = np.asarray(rec[f"{side}_kps"], dtype=np.float32).reshape(-1, 2) + 0.5
        kp = np.concatenate([kps, np.ones((len(kps), 1), np.float32)], axis=1)
        box = np.asarray(rec[f"{side}_bndbox"], dtype=np.float32) + 0.5
        path = self._path(rec, side)
        return Sample(image=read_rgb(path), label=self.classes.index(rec["category"]), keypoints=kp, bbox=box,
                      index=i, extra={"path": str(path), "kps_ids": list(rec["kps_ids"]),
                                      **{k: rec[k] for k in _VARIATIONS if k in rec}})

    def load(self, i: int) -> tuple[Sample, Sample]:  # type: ignore[override]
        return self._side(i, "src"), self._side(i, "trg")

    pair = load

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None, flip: bool = False) -> Iterator[Batch]:
        ids = list(range(len(self))) if indices is None else list(indices)
        chunk: list[tuple[Sample, Sample]] = []
        for src, trg in self.items(ids[start:]):
            chunk.append((for_model(src, preprocessing, flip), for_model(trg, preprocessing, flip)))
            if len(chunk) == batch_size:
                yield self._pair_batch(chunk, preprocessing)
                chunk = []
        if chunk:
            yield self._pair_batch(chunk, preprocessing)

    def _pair_batch(self, chunk: list[tuple[Sample, Sample]], pre: Preprocessing) -> Batch:
        src = self._collate([a for a, _ in chunk], pre)
        trg = self._collate([b for _, b in chunk], pre)
        src.extra["target"] = trg
        src.extra["common"] = (src.keypoints[..., 2] > 0) & (trg.keypoints[..., 2] > 0)
        src.extra["kps_ids"] = [a.extra["kps_ids"] for a, _ in chunk]
        return src
