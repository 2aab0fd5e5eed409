"""Instance retrieval by CLS / spatial-mean cosine per layer, with no training (`retrieval`): revisited mAP
(Easy, Medium, Hard), with a random-ranking chance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from vitscope.analyses.base import Analysis, register_analysis, views_with_cls
from vitscope.analyses.dense._common import _Dense, _interval
from vitscope.analyses.pooled import PooledTable
from vitscope.bounds import Count
from vitscope.capture.views import token_view
from vitscope.errors import VitscopeError
from vitscope.metrics import dense as D

RETRIEVAL_VIEWS = ("cls", "gap_spatial")


@register_analysis
class Retrieval(_Dense):
    """Instance retrieval per layer with no training (Walmer et al., CVPR 2023, §6.1): every query ranks the
    database by the cosine of its CLS token (``cls``) or of its mean patch token (``gap_spatial``); mAP in
    the revisited protocol of Radenović et al. (CVPR 2018): Easy, Medium and Hard, junk images taken out of
    the ranking, queries without positives left out of the mean (and counted). Features are kept in a float16
    store on disk (one vector per image, layer and view). Chance (``mAP_*_chance``): uniformly random
    rankings.

    Protocol: revisited Oxford / Paris images reach the model whole (the dataset's ``crop: full``), queries
    cropped to their box as the revisited protocol does; the long side is resized to ``size`` (default the
    model's input size), as DINO's ``eval_image_retrieval.py`` thumbnails images to ``imsize`` (224 by
    default); sides rounded down to the patch size. Deviates from DINO: one scale only (its ``multiscale``
    option is not offered). ``crop: center`` (the model's eval crop) remains an option. The last block's
    output after the final norm is a layer (``layer`` = depth). The table's ``framing`` and ``input_size``
    columns say which protocol a run used.

    Uncertainty: each mAP carries its standard error over the queries scored and the 95 % interval ``value_lo``,
    ``value_hi`` = value ± t · stderr with (queries - 1) degrees of freedom (``interval_units`` = queries;
    benchmarks/calibration.py, docs/CALIBRATION.md).

    ``random_baseline`` (default false, so tables keep today's rows and store size): also the paper's "random"
    row (Walmer et al. 2023, Tables 1 and 5): Gaussian tokens of the model's token shape (N(0, 1) per token and
    channel, seeded by each image's dataset index, so the same in every model, shard and resume), pooled by each
    view (CLS: the first token) and ranked as a layer is, once per image: rows ``mAP_*_random`` (``layer``
    empty) and the best-layer row's ``random_features``; the table's ``variant`` column names it."""

    name = "retrieval"
    # 5: t interval (value_lo, value_hi, interval_units);
    # 4: one store for every view (a batch is one copy to the host), ground truth kept by row until read;
    # 3: stderr over queries; 2: whole images, final norm layer
    state_version = 5
    needs = frozenset({"retrieval"})
    headline = "mAP_medium"
    description = "instance retrieval per layer and view (CLS, mean patch token): revisited mAP Easy/Medium/Hard"

    def __init__(self, vm: Any, layers: Any = None, views: Any = RETRIEVAL_VIEWS, chance_repeats: Count = 32,
                 seed: int = 0, final_norm: bool = True, random_baseline: bool = False):
        super().__init__(vm, layers, final_norm, random_baseline)
        self.views = views_with_cls(self, views)
        self.chance_repeats, self.seed = int(chance_repeats), int(seed)
        # one store for all views, view-major: view v's layer j is the store's layer v * len(layers) + j; with the
        # random baseline, view v's random features follow all of them (layer len(views) * len(layers) + v)
        self.table = PooledTable(len(self.views) * (len(self.layers) + self.random_baseline))
        self.gnd: dict[int, dict[str, list[int]]] = {}
        # ground truth of queries not yet matched with their index: (row of the store, the batch's gnd entry)
        self.gnd_rows: list[tuple[int, Any]] = []

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        """One append to the store (its one copy to the host) carries every view and layer with the rows'
        query / database indices; a query's ground truth is kept beside its row and matched with its index
        when the store's columns are read (`_read_gnd`), so the batch reads no index back here."""
        if "tiling" in batch.extra:
            raise VitscopeError("retrieval ranks whole images (CLS, mean patch token): use the dataset untiled")
        if "db_index" not in batch.extra or "query_index" not in batch.extra:
            raise VitscopeError("retrieval needs extra['db_index'] and extra['query_index'] (and extra['gnd'] for "
                                "queries); use a retrieval dataset of the catalog")
        db = torch.as_tensor(batch.extra["db_index"]).long()
        q = torch.as_tensor(batch.extra["query_index"]).long()
        gnd = batch.extra.get("gnd") or [None] * len(batch)
        self._note(batch, self.grid_of(batch))
        is_query = q >= 0
        ids = torch.where(is_query, q, db)
        x = [feats[t] for t in self.required_taps()]
        first = len(self.table)
        pooled = [token_view(f, v, self.num_prefix_tokens, self.has_cls_token) for v in self.views for f in x]
        if self.random_baseline:
            noise = self._random_tokens(batch.index, x[0].shape[1], x[0].shape[2], x[0].device)
            pooled += [token_view(noise, v, self.num_prefix_tokens, self.has_cls_token) for v in self.views]
        self.table.append(pooled, ids, torch.zeros_like(ids), is_query)
        self.gnd_rows += [(first + b, g) for b, g in enumerate(gnd) if g is not None]
        self.n_images += len(batch)

    def _read_gnd(self) -> None:
        """Match the kept ground truth with the query indices of its rows (read from the store's columns; once,
        not per batch); a query row without ground truth is an error."""
        if not len(self.table):
            return
        ids, is_q = self.table.column("ids"), self.table.column("is_test")
        given = {row: g for row, g in self.gnd_rows}
        self.gnd_rows = []
        for row in torch.nonzero(is_q).flatten().tolist():
            if row in given:
                g = given[row]
                self.gnd[int(ids[row])] = {k: [int(i) for i in g.get(k, [])] for k in ("easy", "hard", "junk")}
            elif int(ids[row]) not in self.gnd:
                raise VitscopeError(f"retrieval: query {int(ids[row])} has no ground truth (extra['gnd'])")

    def _view(self, v: int, li: int) -> torch.Tensor:
        """(rows, D) float16 features of view ``v`` (its position in ``views``) at the ``li``-th layer (``li`` =
        len(layers): the random features)."""
        if li == len(self.layers):
            return self.table.layer(len(self.views) * len(self.layers) + v)
        return self.table.layer(v * len(self.layers) + li)

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Retrieval) and other.layers == self.layers and other.views == self.views
        self._read_gnd()
        other._read_gnd()
        self.table.extend(other.table)
        self.gnd.update(other.gnd)
        self.skipped.update(other.skipped)
        self.n_images += other.n_images
        self._merge_protocol(other)

    def state_dict(self) -> dict[str, Any]:
        self._read_gnd()
        return {"layers": self.layers, "views": self.views, "table": self.table.state_dict(),
                "gnd": {int(k): v for k, v in self.gnd.items()}, "skipped": dict(self.skipped),
                "n_images": self.n_images, "protocol": self._protocol_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.views = list(state["layers"]), list(state["views"])
        self._load_protocol(state)
        self.table = PooledTable.from_state(state["table"])
        self.gnd = {int(k): v for k, v in state["gnd"].items()}
        self.gnd_rows = []
        self.skipped = Counter(state["skipped"])
        self.n_images = int(state["n_images"])

    def finalize(self) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        skipped = Counter(self.skipped)
        n_q = n_db = 0
        self._read_gnd()
        t = self.table
        for vi, v in enumerate(self.views):
            if not len(t):
                continue
            ids, is_q = t.column("ids"), t.column("is_test")
            q_rows = torch.nonzero(is_q).flatten()
            q_rows = q_rows[torch.argsort(ids[q_rows])]
            d_rows = torch.nonzero(~is_q).flatten()
            d_rows = d_rows[torch.argsort(ids[d_rows])]
            queries = ids[q_rows].tolist()
            if not queries or not len(d_rows):
                continue
            col = {int(i): c for c, i in enumerate(ids[d_rows].tolist())}  # database index -> column
            gnd = [self.gnd[q] for q in queries]
            protocols = D.revisited_protocols(gnd)
            mapped = {name: [{"ok": [col.get(i, -1) for i in p["ok"]], "junk": [col[i] for i in p["junk"] if i in col]}
                             for p in prot] for name, prot in protocols.items()}
            for li, layer in enumerate([*self.layers, *(["random"] if self.random_baseline else [])]):
                f = F.normalize(self._view(vi, li).float(), dim=-1)
                scores = f[q_rows] @ f[d_rows].T
                sfx = "_random" if layer == "random" else ""
                for name, prot in mapped.items():
                    aps = D.retrieval_aps(scores, prot)
                    rows.append({"metric": f"mAP_{name}{sfx}", "layer": None if sfx else layer, "token_view": v,
                                 "value": float(np.nanmean(aps)) if np.isfinite(aps).any() else float("nan"),
                                 **_interval(torch.as_tensor(np.asarray(aps, dtype=float)))})
            for name, prot in mapped.items():
                rows.append({"metric": f"mAP_{name}_chance", "layer": None, "token_view": v,
                             "value": D.random_ranking_map(prot, len(d_rows), self.chance_repeats, self.seed)})
                missing = sum(1 for p in prot for i in p["ok"] if i < 0)
                if v == self.views[0]:
                    empty = sum(1 for p in prot if not p["ok"])
                    if empty:
                        skipped[f"query without positives ({name}; left out of its mean)"] += empty
                    if missing:
                        skipped[f"positive not in the database that was read ({name})"] += missing
            n_q, n_db = len(queries), len(d_rows)
        rows += self._best_rows(rows, "mAP_medium")
        rows += [{"metric": "skipped", "reason": r, "value": float(n)} for r, n in sorted(skipped.items())]
        df = self._table(rows)
        df["n_queries"], df["n_database"] = n_q, n_db
        return self._protocol_columns(df)
