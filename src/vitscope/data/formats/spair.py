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
import torch

from vitscope.data.base import Batch, RaggedBatch, Sample, ragged
from vitscope.data.formats.common import FileDataset, read_rgb, require_files, runs_of_one_size
from vitscope.data.transforms import Framing, crop, hflip, resize
from vitscope.errors import InputError
from vitscope.files import inside
from vitscope.models.registry import Preprocessing

SPLITS = ("trn", "val", "test")
_VARIATIONS = ("viewpoint_variation", "scale_variation", "truncation", "occlusion", "mirror")


def select_per_category(pairs: list[dict], per_category: int, seed: int = 42) -> list[dict]:
    """At most ``per_category`` pairs of each category (``rec['category']``): each category's pairs (in file order)
    sampled without replacement by its own ``numpy.random.default_rng(seed)``, the kept ones in file order."""
    by_cat: dict[str, list[int]] = {}
    for i, rec in enumerate(pairs):
        by_cat.setdefault(rec["category"], []).append(i)
    keep: list[int] = []
    for ids in by_cat.values():
        if len(ids) <= per_category:
            keep += ids
        else:
            pick = np.random.default_rng(seed).choice(len(ids), per_category, replace=False)
            keep += [ids[j] for j in pick.tolist()]
    return [pairs[i] for i in sorted(keep)]


def letterbox(s: Sample, size: int, patch: int = 16, interpolation: str = "bicubic") -> Sample:
    """The authors' input geometry: the long side resized to ``size`` (rounded down to a multiple of ``patch``),
    aspect kept (the short side rounded to the nearest pixel), then zero-padded, centred, to a square (padding
    offsets ``(size - side) // 2`` at the top and left). Annotations follow (`resize`, `crop`), the geometry
    records the map from the file's pixels."""
    side = max(patch, int(size) // patch * patch)
    h, w = s.size
    scale = side / max(h, w)
    nh, nw = max(1, int(round(h * scale))), max(1, int(round(w * scale)))
    out = resize(s, nh, nw, interpolation=interpolation)
    return crop(out, -((side - nh) // 2), -((side - nw) // 2), side, side)


def _check_pair(rec: dict, d: dict, f: Path) -> None:
    """One InputError sentence naming the file unless the pair's keypoints are [x, y] pairs of finite numbers,
    as many on each side (and as many ``kps_ids``), and each box four finite numbers x0 <= x1, y0 <= y1: a NaN
    would otherwise score as a miss, and a malformed list fail later as a traceback."""
    def bad(why: str) -> InputError:
        return InputError(f"{str(f)!r}: {why}; fix or remove the pair annotation")

    def finite(key: str) -> np.ndarray:
        try:
            arr = np.asarray(rec[key], dtype=np.float64)
        except (TypeError, ValueError):
            raise bad(f"{key} {rec[key]!r} is not numbers") from None
        if not np.isfinite(arr).all():
            raise bad(f"{key} holds {arr[~np.isfinite(arr)][0]:g}, not a finite number")
        return arr

    n = {}
    for side in ("src", "trg"):
        kps = finite(f"{side}_kps")
        if kps.size and (kps.ndim != 2 or kps.shape[1] != 2):
            raise bad(f"{side}_kps must be a list of [x, y] pairs, got an array of shape {kps.shape}")
        n[side] = len(kps)
        box = finite(f"{side}_bndbox")
        if box.shape != (4,) or box[0] > box[2] or box[1] > box[3]:
            raise bad(f"{side}_bndbox {rec[f'{side}_bndbox']!r} is not four numbers x0, y0, x1, y1 with x0 <= x1 "
                      "and y0 <= y1")
    if n["src"] != n["trg"]:
        raise bad(f"{n['src']} source but {n['trg']} target keypoints")
    ids = d.get("kps_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != n["src"]):
        raise bad(f"kps_ids must list one id per keypoint ({n['src']}), got {ids!r}")


class SPair71k(FileDataset):
    """Item i = pair i (files sorted by name). `pair(i)` -> (source, target) Samples with ``keypoints``
    (K, 3) in the same keypoint order, ``bbox``, label = category index, ``extra['kps_ids']``.
    ``batches`` yields the sources with ``extra['target']`` the batch of targets (as
    `vitscope.data.synthetic_tasks.SyntheticPairs`).

    ``n_pairs``: a sample of that many pairs, drawn without replacement with ``seed`` (kept in file order).
    ``flat=True`` (the form a study pass needs): item 2p is the source and 2p + 1 the target of pair p, with
    ``extra['pair']``, ``extra['role']``, ``extra['category']`` and ``extra['ref_size']`` = max(h, w) of the
    object's box in the model input's pixels (the file's box scaled by the resize, before the crop clips it),
    ``extra['source_ref_size']`` the same in the file's pixels.

    Images reach the model whole by default (``crop='full'``: short side ``size`` pixels, default the model's
    input size, aspect kept, sides rounded down to the patch size), so no keypoint is lost to a crop, and PCK
    is scored in the file's pixels against the box at its original size; ``crop='center'``: the model's
    eval preprocessing (keypoints outside the crop are marked not visible and left out).

    Walmer et al.'s (2023, ``vit_analysis``) protocol, offered beside (defaults keep vitscope's):

    * ``letterbox=True``: the long side resized to ``size`` (default the model's input size, rounded down to the
      patch size), aspect kept, the short side padded with zeros (black), centred, to a square ``size`` x ``size``
      input (`letterbox`). Every keypoint stays in the image, as with ``crop='full'``, but the model sees the
      square input it was trained on, at a smaller object scale, and padding tokens; vitscope's whole frame keeps
      the short side at ``size`` and feeds a non-square input instead. Keypoints and boxes follow the geometry,
      so PCK is still scored in the file's pixels.
    * ``pairs_per_category=20, pair_seed=42``: at most that many pairs of each category, drawn without
      replacement by ``numpy.random.default_rng(pair_seed)`` per category (each category's draw independent of
      the others), kept in file order; the authors evaluate 20 pairs per category with seed 42 where vitscope
      otherwise takes every pair (or ``n_pairs`` over all categories, drawn after this selection)."""

    def __init__(self, root: str | Path, split: str = "test", categories: list[str] | None = None,
                 name: str | None = None, n_pairs: int | None = None, seed: int = 0, flat: bool = False,
                 crop: str = "full", size: int | None = None, letterbox: bool = False,
                 pairs_per_category: int | None = None, pair_seed: int = 42):
        super().__init__()
        self.framing = Framing(crop, size, "short")
        self.letterbox = bool(letterbox)
        if pairs_per_category is not None and int(pairs_per_category) < 1:
            raise InputError(f"pairs_per_category must be a positive number of pairs; got {pairs_per_category}")
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
            _check_pair(rec, d, f)
            rec["kps_ids"] = d.get("kps_ids", list(range(len(rec["src_kps"]))))
            rec.update({k: d[k] for k in _VARIATIONS if k in d})
            rec["file"] = f.name
            self.pairs.append(rec)
        if not self.pairs:
            raise InputError(f"no pairs of categories {categories} in {str(folder)!r}")
        if pairs_per_category is not None:
            self.pairs = select_per_category(self.pairs, int(pairs_per_category), int(pair_seed))
        if n_pairs is not None and n_pairs < len(self.pairs):
            keep = np.random.default_rng(seed).choice(len(self.pairs), int(n_pairs), replace=False)
            self.pairs = [self.pairs[i] for i in sorted(keep.tolist())]
        self.flat = bool(flat)
        self.classes = cats or sorted({p["category"] for p in self.pairs})
        unknown = sorted({p["category"] for p in self.pairs} - set(self.classes))
        if unknown:
            raise InputError(f"pairs refer to categories without an image folder under {str(img_root)!r}: {unknown}")
        require_files([self._path(p, "src") for p in self.pairs] + [self._path(p, "trg") for p in self.pairs],
                      f"the pair annotations in {str(folder)!r} refer to")

    def frame(self, s: Sample, pre: Preprocessing, flip: bool = False) -> Sample:
        """One image as the model sees it: `letterbox` with ``letterbox=True``, else the dataset's framing."""
        if not self.letterbox:
            return super().frame(s, pre, flip)
        out = letterbox(s, self.framing.size or pre.input_size, int(getattr(pre, "patch_size", 16)),
                        pre.interpolation)
        return hflip(out) if flip else out

    def _collate(self, chunk: list[Sample], pre: Preprocessing) -> Batch:
        b = super()._collate(chunk, pre)
        if self.letterbox:
            b.extra["framing"] = f"letterbox (long side, padded square) {chunk[0].size[0]}"
        return b

    def _path(self, rec: dict, side: str) -> Path:
        return inside(self.root / "JPEGImages", f"{rec['category']}/{rec[f'{side}_imname']}",
                      f"{rec['file']}: {side}_imname")

    def __len__(self) -> int:
        return 2 * len(self.pairs) if self.flat else len(self.pairs)

    def unit_bounds(self) -> list[int]:
        """Flat: every pair's source item (a pair is one unit); else every item."""
        return list(range(0, len(self), 2 if self.flat else 1))

    def _side(self, i: int, side: str) -> Sample:
        rec = self.pairs[i]
        kps = np.asarray(rec[f"{side}_kps"], dtype=np.float32).reshape(-1, 2) + 0.5
        kp = np.concatenate([kps, np.ones((len(kps), 1), np.float32)], axis=1)
        box = np.asarray(rec[f"{side}_bndbox"], dtype=np.float32) + 0.5
        path = self._path(rec, side)
        return Sample(image=read_rgb(path), label=self.classes.index(rec["category"]), keypoints=kp, bbox=box,
                      index=i, extra={"path": str(path), "kps_ids": list(rec["kps_ids"]),
                                      **{k: rec[k] for k in _VARIATIONS if k in rec}})

    def pair(self, i: int) -> tuple[Sample, Sample]:
        """(source, target) of pair i."""
        return self._side(i, "src"), self._side(i, "trg")

    def load(self, i: int) -> Sample | tuple[Sample, Sample]:  # type: ignore[override]
        if self.flat:
            p, role = divmod(i, 2)
            s = self._side(p, "trg" if role else "src")
            s.extra.update(pair=p, role=role, category=self.classes[s.label])
            s.index = i
            return s
        return self.pair(i)

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None, flip: bool = False) -> Iterator[Batch]:
        ids = list(range(len(self))) if indices is None else list(indices)
        if self.flat:
            yield from self._flat_batches(batch_size, preprocessing, ids[start:], flip)
            return
        chunk: list[tuple[Sample, Sample]] = []
        for src, trg in self.items(ids[start:]):
            chunk.append((self.frame(src, preprocessing, flip), self.frame(trg, preprocessing, flip)))
            if len(chunk) == batch_size:
                yield self._pair_chunk(chunk, preprocessing)
                chunk = []
        if chunk:
            yield self._pair_chunk(chunk, preprocessing)

    def _pair_chunk(self, chunk: list[tuple[Sample, Sample]], pre: Preprocessing) -> Batch | RaggedBatch:
        """Runs of pairs whose sources share a size and whose targets share a size (whole images differ)."""
        runs: list[list[tuple[Sample, Sample]]] = []
        for a, b in chunk:
            if runs and (runs[-1][0][0].size, runs[-1][0][1].size) == (a.size, b.size):
                runs[-1].append((a, b))
            else:
                runs.append([(a, b)])
        return ragged([self._pair_batch(r, pre) for r in runs])

    def _flat_batches(self, batch_size: int, pre: Preprocessing, ids: list[int], flip: bool
                      ) -> Iterator[Batch | RaggedBatch]:
        chunk: list[Sample] = []
        for s in self.items(ids):
            side = self.frame(s, pre, flip)
            box = np.asarray(s.bbox, np.float64)
            ref = float(max(box[2] - box[0], box[3] - box[1]))
            side.extra["ref_size"] = ref * abs(side.geometry.sx)
            side.extra["source_ref_size"] = ref
            chunk.append(side)
            if len(chunk) == batch_size:
                yield self._flat_chunk(chunk, pre)
                chunk = []
        if chunk:
            yield self._flat_chunk(chunk, pre)

    def _flat_chunk(self, chunk: list[Sample], pre: Preprocessing) -> Batch | RaggedBatch:
        return ragged([self._flat_batch(r, pre) for r in runs_of_one_size(chunk)])

    def _flat_batch(self, chunk: list[Sample], pre: Preprocessing) -> Batch:
        b = self._collate(chunk, pre)
        b.extra["pair"] = torch.tensor([s.extra["pair"] for s in chunk])
        b.extra["role"] = torch.tensor([s.extra["role"] for s in chunk])
        b.extra["ref_size"] = torch.tensor([s.extra["ref_size"] for s in chunk], dtype=torch.float64)
        b.extra["source_ref_size"] = torch.tensor([s.extra["source_ref_size"] for s in chunk], dtype=torch.float64)
        b.extra["category"] = [self.classes[s.label] for s in chunk]
        b.extra["kps_ids"] = [s.extra["kps_ids"] for s in chunk]
        return b

    def _pair_batch(self, chunk: list[tuple[Sample, Sample]], pre: Preprocessing) -> Batch:
        src = self._collate([a for a, _ in chunk], pre)
        trg = self._collate([b for _, b in chunk], pre)
        src.extra["target"] = trg
        src.extra["common"] = (src.keypoints[..., 2] > 0) & (trg.keypoints[..., 2] > 0)
        src.extra["kps_ids"] = [a.extra["kps_ids"] for a, _ in chunk]
        return src
