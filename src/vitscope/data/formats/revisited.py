"""Revisited Oxford / Paris (roxford5k, rparis6k): ``gnd_<name>.pkl`` holding ``imlist`` (database
names), ``qimlist`` (query names) and ``gnd`` (per query: 'easy', 'hard', 'junk' database indices and
'bbx' = [x0, y0, x1, y1], the query's region); images in ``jpg/<name>.jpg``."""

from __future__ import annotations

import numbers
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vitscope.data.base import Batch, RaggedBatch, RetrievalSplit, Sample, batch_parts
from vitscope.data.formats.common import FileDataset, load_data_pickle, read_rgb, require_files
from vitscope.data.synthetic_tasks import medium_hard, with_retrieval_layout
from vitscope.data.transforms import Framing, crop
from vitscope.errors import InputError
from vitscope.models.registry import Preprocessing

#: how far outside its image a query's box may reach, in image sizes (the crop pads it with zeros; a box farther
#: out would be a crop of gigabytes of padding)
BOX_MARGIN = 1.0


def _check_query(g: Any, q: int, n: int, gnd_file: Path) -> None:
    """One InputError sentence naming the file and query unless ``g`` is a dict whose 'easy', 'hard' and 'junk'
    are database indices (whole numbers 0..n-1) and whose 'bbx' is four finite numbers x0 < x1, y0 < y1."""
    who = f"{str(gnd_file)!r}: query {q}"
    if not isinstance(g, dict):
        raise InputError(f"{who} is a {type(g).__name__}, not a dict with bbx, easy, hard and junk")
    for k in ("easy", "hard", "junk"):
        ids = g.get(k, [])
        try:
            ids = list(ids)
        except TypeError:
            raise InputError(f"{who}: {k} is a {type(ids).__name__}, not a list of database indices") from None
        odd = [j for j in ids if isinstance(j, bool) or not isinstance(j, numbers.Integral)]
        if odd:
            raise InputError(f"{who}: {k} holds {odd[0]!r}, not a database index (a whole number)")
        bad = [int(j) for j in ids if not 0 <= j < n]
        if bad:
            raise InputError(f"{who} refers to database images {bad[:5]} of {n}")
    if "bbx" not in g:
        raise InputError(f"{who} has no 'bbx'")
    try:
        box = np.asarray(g["bbx"], dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{who}: bbx {g['bbx']!r} is not four numbers x0, y0, x1, y1") from None
    if box.shape != (4,) or not np.isfinite(box).all() or box[0] >= box[2] or box[1] >= box[3]:
        raise InputError(f"{who}: bbx {g['bbx']!r} is not four finite numbers x0, y0, x1, y1 with x0 < x1 and "
                         "y0 < y1")


class RevisitedRetrieval(RetrievalSplit, FileDataset):
    """Items 0..n_queries-1 are the queries (cropped to their box when ``crop_queries``, as the revisited
    protocol does), then the database. ``gnd`` is the file's; ``protocols`` the Medium / Hard positives
    and junk (`vitscope.data.synthetic_tasks.medium_hard`). ``root``: the folder holding the pkl, or its
    parent.

    Images reach the model whole by default (``crop='full'``: the long side resized to ``size`` pixels,
    default the model's input size, as DINO's ``eval_image_retrieval.py`` thumbnails them to ``imsize``;
    aspect kept, sides rounded down to the patch size); ``crop='center'``: the model's eval preprocessing."""

    def __init__(self, root: str | Path, dataset: str = "roxford5k", crop_queries: bool = True,
                 name: str | None = None, crop: str = "full", size: int | None = None):
        super().__init__()
        self.framing = Framing(crop, size, "long")
        root = Path(root)
        if not (root / f"gnd_{dataset}.pkl").is_file() and (root / dataset / f"gnd_{dataset}.pkl").is_file():
            root = root / dataset
        self.root, self.name, self.crop_queries = root, name or dataset, crop_queries
        gnd_file = root / f"gnd_{dataset}.pkl"
        self.gnd_file = gnd_file
        if not gnd_file.is_file():
            raise InputError(f"expected the revisited ground truth {str(gnd_file)!r}")
        try:
            cfg = load_data_pickle(gnd_file, encoding="latin1")  # data only: a file cannot run code
            self.imlist, self.qimlist, self.gnd = list(cfg["imlist"]), list(cfg["qimlist"]), list(cfg["gnd"])
        except (pickle.UnpicklingError, KeyError, TypeError, EOFError, ValueError, AttributeError) as e:
            raise InputError(f"{str(gnd_file)!r} is not a revisited ground truth (expected a dict with imlist, "
                             f"qimlist, gnd): {type(e).__name__}: {e}") from e
        if not self.imlist or not self.qimlist:
            raise InputError(f"{str(gnd_file)!r} lists {len(self.qimlist)} queries and {len(self.imlist)} images")
        if len(self.gnd) != len(self.qimlist):
            raise InputError(f"{str(gnd_file)!r}: {len(self.qimlist)} queries but {len(self.gnd)} gnd entries")
        n = len(self.imlist)
        for q, g in enumerate(self.gnd):
            _check_query(g, q, n, gnd_file)
        self.classes: list[str] = []
        self.files = [root / "jpg" / f"{x}.jpg" for x in self.qimlist + self.imlist]
        require_files(self.files, f"{str(gnd_file)!r} refers to")
        self.protocols = medium_hard([{k: list(g.get(k, [])) for k in ("easy", "hard", "junk")} for g in self.gnd])

    @property
    def n_queries(self) -> int:
        return len(self.qimlist)

    def unit_bounds(self) -> list[int]:
        """One unit: the ground truth refers to every database image, so the split is never subsampled."""
        return [0]

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None, flip: bool = False) -> Iterator[Batch | RaggedBatch]:
        """Model-ready batches with the retrieval layout (``extra['query_index']``, ``extra['db_index']``,
        ``extra['gnd']``: `vitscope.data.synthetic_tasks.with_retrieval_layout`); whole images of different
        sizes make a `vitscope.data.base.RaggedBatch`, each part with the layout."""
        gnd = [{k: list(g.get(k, [])) for k in ("easy", "hard", "junk")} for g in self.gnd]
        for b in super().batches(batch_size, preprocessing, start, indices, flip):
            for part in batch_parts(b):
                with_retrieval_layout(part, self.n_queries, gnd)
            yield b

    def __len__(self) -> int:
        return len(self.files)

    def load(self, i: int) -> Sample:
        s = Sample(image=read_rgb(self.files[i]), index=i,
                   extra={"path": str(self.files[i]), "role": "query" if i < self.n_queries else "database"})
        if i < self.n_queries:
            x0, y0, x1, y1 = (float(v) for v in self.gnd[i]["bbx"])
            h, w = s.image.shape[:2]
            if min(x0, x1) < -BOX_MARGIN * w or max(x0, x1) > (1 + BOX_MARGIN) * w or \
                    min(y0, y1) < -BOX_MARGIN * h or max(y0, y1) > (1 + BOX_MARGIN) * h:
                raise InputError(f"{str(self.gnd_file)!r}: query {i}'s bbx {[x0, y0, x1, y1]} lies "
                                 f"more than {BOX_MARGIN:g} image size outside its {w}x{h} image; fix the ground truth")
            s.bbox = np.array([x0, y0, x1, y1], np.float32)
            if self.crop_queries:
                top, left = int(np.floor(y0)), int(np.floor(x0))
                s = crop(s, max(top, 0), max(left, 0), int(np.ceil(y1)) - max(top, 0), int(np.ceil(x1)) - max(left, 0))
        return s
