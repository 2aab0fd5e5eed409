"""Attention maps of chosen query tokens (`vitscope.analyses.attention`): for a few kept images, where a named
spatial query token (or the CLS token) looks, per block and head [Park et al. 2023, slides p. 4; Wang, Fig. 9].

Park et al. show that the attention of contrastive models (CL) hardly depends on the query: every query's map
is the same global map, while masked-image-modelling models (MIM) attend around the query. Drawing the maps of
a few queries side by side, per model, makes that visible; ``attention_nmi`` measures it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import pandas as pd
import torch

from vitscope.analyses.attention.maps import _cell_columns, _KeptMaps, _png_bytes
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.kept import smallest_distinct
from vitscope.bounds import Count
from vitscope.errors import ConfigError
from vitscope.host import host_copy
from vitscope.metrics import attention as A

NAMES = {"centre": "centre", "center": "centre", "corner": "corner", "cls": "cls"}
"""The query names a user may give, to the name the table uses."""


@dataclass(frozen=True)
class Query:
    """A query as the user named it: ``kind`` is ``cls``, ``index`` (a ``(row, col)`` patch position) or
    ``fraction`` (a ``(row, col)`` position as fractions of the grid's height and width, so it works at any
    resolution); ``label`` is how the table names it."""

    label: str
    kind: str
    at: tuple[float, float] = (0.0, 0.0)


def parse_query(spec: Any, who: str = "query_attention_maps") -> Query:
    """One query from its config form: a name ('centre' / 'center', 'corner' = top left, 'cls'), a pair of ints
    (a patch position) or a pair of numbers of which one is a float (fractions in [0, 1] of the grid). Raises a
    one-sentence ConfigError for anything else."""
    if isinstance(spec, str):
        name = NAMES.get(spec.strip().lower())
        if name is None:
            raise ConfigError(f"{who}: unknown query {spec!r}; give 'centre', 'corner', 'cls', a [row, col] patch "
                              "position or a [row, col] pair of fractions of the grid")
        if name == "centre":
            return Query("centre", "fraction", (0.5, 0.5))
        if name == "corner":
            return Query("corner", "index", (0, 0))
        return Query("cls", "cls")
    try:
        pair = list(spec)
    except TypeError:
        pair = []
    if len(pair) != 2 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in pair):
        raise ConfigError(f"{who}: a query must be a name or a [row, col] pair of numbers, got {spec!r}")
    if all(isinstance(v, int) for v in pair):
        r, c = int(pair[0]), int(pair[1])
        return Query(f"({r}, {c})", "index", (r, c))
    fr, fc = float(pair[0]), float(pair[1])
    if not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in (fr, fc)):
        raise ConfigError(f"{who}: the query {spec!r} has a float, so it is read as fractions of the grid, which "
                          "must lie in [0, 1]")
    return Query(f"({fr!r}, {fc!r})", "fraction", (fr, fc))


def query_cell(q: Query, grid: tuple[int, int], who: str = "query_attention_maps") -> tuple[int, int] | None:
    """The ``(row, col)`` patch a spatial query names on ``grid`` (None for the CLS query): a fraction ``f`` of a
    side of ``n`` patches is the patch that holds the point ``f n`` (the last one for ``f = 1``). Raises a
    one-sentence ConfigError for a patch position outside the grid."""
    if q.kind == "cls":
        return None
    h, w = grid
    if q.kind == "fraction":
        return min(int(q.at[0] * h), h - 1), min(int(q.at[1] * w), w - 1)
    r, c = int(q.at[0]), int(q.at[1])
    if not (0 <= r < h and 0 <= c < w):
        raise ConfigError(f"{who}: the query {q.label} is outside the model's {h}x{w} patch grid (rows 0-{h - 1}, "
                          f"columns 0-{w - 1})")
    return r, c


@register_analysis
class QueryAttentionMaps(_KeptMaps):
    """Attention maps of chosen query tokens for a few kept images, per block and head, with the mean over heads
    [Park et al. 2023, slides p. 4 (the authors' ``visualize_attn``); Wang, Fig. 9]: each query token's row of the
    ``block{i}.attn`` attention over the spatial keys (CLS and register keys dropped, renormalised to sum 1, as
    in ``cls_attention_maps``) on the patch grid. Contrastive models' maps look alike for every query (attention
    collapse), masked-image-modelling models' follow the query.

    Parameters: ``layers`` (the blocks, as the other attention analyses); ``keep_images`` (how many images: those
    with the smallest dataset index, so the choice does not depend on batch or shard order); ``queries`` (a list
    of query tokens: 'centre' (or 'center': the patch at half the height and width), 'corner' (the top-left
    patch), 'cls' (the CLS token, where the model has one), a ``[row, col]`` pair of ints (a patch position,
    checked against the model's grid when the analysis is built) or a ``[row, col]`` pair with a float (fractions
    in [0, 1] of the grid's height and width: the same place at any resolution)).

    Table: metric ``query_attention``, one row per (image, query, layer, head, grid cell), extra columns ``query``
    (its label: 'centre', 'corner', 'cls', '(r, c)' for a position, '(0.25, 0.75)' for fractions), ``query_row``
    and ``query_col`` (the query's patch on the grid; missing for 'cls'), ``row``, ``col`` (the key's patch),
    ``image`` (the dataset index) and ``n_images`` (images seen); metric ``query_attention_mean``, the same with
    the mean over heads (``head`` missing); metric ``input_image``, one row per kept image whose ``png`` column
    holds the image as the model saw it (value missing)."""

    name = "query_attention_maps"
    state_version = 1
    description = "attention maps of chosen query tokens (CLS or patches) for a few images, per layer and head"

    def __init__(self, vm: Any, layers: Any = None, keep_images: Count = 4,
                 queries: str | Sequence[str | Sequence[float]] = ("centre", "corner")):
        super().__init__(vm, layers)
        if isinstance(keep_images, bool) or not isinstance(keep_images, int) or keep_images < 1:
            raise ConfigError(f"{self.name}: keep_images must be an integer >= 1, got {keep_images!r}")
        self.keep_images = int(keep_images)
        self.queries = self._parse(queries)
        self.cells = self._cells(tuple(self.grid_size))
        L, H, Q = len(self.layers), self.num_heads, len(self.queries)
        self.kept_index = torch.zeros(0, dtype=torch.long)
        self.kept_maps = torch.zeros(0, Q, L, H, *self.grid_size, dtype=torch.float32)
        self.kept_pixels = torch.zeros(0, 3, 1, 1, dtype=torch.uint8)

    def _parse(self, queries: Any) -> list[Query]:
        """The queries, parsed and checked against the model (a CLS query needs a CLS token; no query twice)."""
        specs = [queries] if isinstance(queries, str) else list(queries) if queries is not None else []
        if not specs:
            raise ConfigError(f"{self.name}: queries is empty; name at least one query token")
        out = [parse_query(s, self.name) for s in specs]
        if any(q.kind == "cls" for q in out) and not self.has_cls_token:
            raise ConfigError(f"{self.name}: model {self.model_name!r} has no CLS token, so the query 'cls' has no "
                              "row; name patch positions instead")
        labels = [q.label for q in out]
        if len(set(labels)) < len(labels):
            raise ConfigError(f"{self.name}: a query is given twice in {labels}")
        return out

    def _cells(self, grid: tuple[int, int]) -> list[tuple[int, int] | None]:
        """Each query's patch on ``grid`` (one sentence for a position outside it)."""
        return [query_cell(q, grid, self.name) for q in self.queries]

    def _tokens(self) -> list[int]:
        """Each query's row in the attention: 0 for the CLS token, else the prefix tokens plus its patch's index."""
        w = self.grid_size[1]
        return [0 if c is None else self.num_prefix_tokens + c[0] * w + c[1] for c in self.cells]

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "keep_images": self.keep_images, "queries": [q.label for q in self.queries]}

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.cells = self._cells(tuple(grid))
        self.kept_maps = torch.zeros(0, len(self.queries), len(self.layers), self.num_heads, *grid,
                                     dtype=torch.float32)

    def state_bytes(self, n_images: int) -> int:
        h, w = self.grid_size
        maps = min(n_images, self.keep_images) * len(self.queries) * len(self.layers) * self.num_heads * h * w * 4
        return maps + min(n_images, self.keep_images) * 3 * (h * self.patch_size) * (w * self.patch_size) + 4096

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        self.n_images += len(batch)
        first = feats[f"block{self.layers[0]}.attn"]
        index = batch.index.to(first.device, torch.long)
        # only the batch's images that can be kept are read (its keep_images smallest indices)
        take, index = smallest_distinct(index, self.keep_images)
        p, tokens = self.num_prefix_tokens, self._tokens()
        per_layer = []
        for i in self.layers:
            attn = feats[f"block{i}.attn"].index_select(0, take)  # (k, H, T, T)
            per_layer.append(torch.stack([attn[:, :, t, p:] for t in tokens], dim=1))  # (k, Q, H, S)
        rows = A._renormalise(torch.stack(per_layer, dim=2).detach().float())  # (k, Q, L, H, S)
        maps = rows.reshape(*rows.shape[:-1], *self.grid_size)
        self._keep(index, maps, self._pixels(batch.images[take.to(batch.images.device)]))

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, QueryAttentionMaps)
        self._check_grid_merge(other)
        self.n_images += other.n_images
        if len(other.kept_index):  # an empty part may hold its maps on another grid: nothing to add
            dev = other.kept_index.device
            self._keep(other.kept_index, other.kept_maps.to(dev), other.kept_pixels.to(dev))

    def state_dict(self) -> dict[str, Any]:
        index, maps, pixels = self._kept()
        return {"layers": list(self.layers), "keep_images": self.keep_images,
                "queries": [q.label for q in self.queries], "grid": list(self.grid_size), "n_images": self.n_images,
                "kept_index": index, "kept_maps": host_copy(maps), "kept_pixels": pixels}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        theirs = {"layers": list(state["layers"]), "keep_images": int(state["keep_images"]),
                  "queries": list(state["queries"])}
        if theirs != self._settings():
            raise ConfigError(f"{self.name}: the saved state was computed with {theirs}, not {self._settings()}")
        self.n_images = int(state["n_images"])
        grid = (int(state["grid"][0]), int(state["grid"][1]))
        if grid != tuple(self.grid_size):
            self.grid_size = grid
            self.cells = self._cells(grid)
        self.kept_index, self.kept_maps = state["kept_index"].clone(), state["kept_maps"].clone()
        self.kept_pixels = state["kept_pixels"].clone()

    def finalize(self) -> pd.DataFrame:
        index, maps, pixels = self._kept()
        frames = []
        for k, image in enumerate(index.tolist()):
            for j, (q, cell) in enumerate(zip(self.queries, self.cells, strict=True)):
                per_head = maps[k, j]  # (L, H, h, w)
                for metric, values in (("query_attention", per_head),
                                       ("query_attention_mean", per_head.double().mean(1, keepdim=True))):
                    cols = _cell_columns(values, self.layers, ("row", "col"))
                    n = len(cols["value"])
                    head = pd.array(cols.pop("head"), dtype="Int64")
                    if metric == "query_attention_mean":
                        head = pd.array([pd.NA] * n, dtype="Int64")
                    frames.append(pd.DataFrame({
                        "metric": metric, **cols, "head": head, "query": q.label,
                        "query_row": pd.array([None if cell is None else cell[0]] * n, dtype="Int64"),
                        "query_col": pd.array([None if cell is None else cell[1]] * n, dtype="Int64"),
                        "image": pd.array([image] * n, dtype="Int64")}))
        if len(index):
            frames.append(pd.DataFrame({"metric": "input_image", "image": pd.array(index.tolist(), dtype="Int64"),
                                        "value": float("nan"), "png": [_png_bytes(p) for p in pixels]}))
        if not frames:
            return self._frame({"row": [], "col": [], "query": [], "query_row": pd.array([], dtype="Int64"),
                                "query_col": pd.array([], dtype="Int64"), "image": pd.array([], dtype="Int64"),
                                "n_images": []})
        df = pd.concat(frames, ignore_index=True)
        df["n_images"] = self.n_images
        return self.tidy(cast(Any, df))
