"""Dense downstream tasks with no training, per layer (math in `vitscope.metrics.dense`), after Walmer et al.,
"Teaching Matters: Investigating the Role of Supervision in Vision Transformers", CVPR 2023 (§6, Tables 1
and 5): which layer of which model is best for local tasks.

  propagation     video object segmentation by label propagation (DINO's protocol): J, F, J&F
  correspondence  keypoint correspondence by nearest patch feature: PCK@0.1 / 0.05 / 0.01
  retrieval       instance retrieval by CLS / spatial-mean cosine: revisited mAP (Easy, Medium, Hard)

Every one reports, per model, its best layer (``metric = 'best_<headline>'``, ``layer`` = the block) beside
the task's chance level (``<metric>_chance``): propagation with constant features, a uniformly random target
token, a uniformly random ranking. The overall per-layer scores carry their ``stderr`` and 95 % interval
(``value_lo``, ``value_hi``), and so does the best-layer row, so a best layer within noise of chance can be told
apart (`vitscope.report.figures.dense.best_layer_summary`). The units of those intervals are the independent ones:
videos (objects of a video share its difficulty), image pairs (keypoints of a pair share it), queries; the
standard error is cluster-robust over them and the interval uses Student's t with (units - 1) degrees of freedom
(`vitscope.metrics.intervals`), because value ± 1.96 stderr over the objects of the default study's 2 videos, or
over the keypoints of its 32 pairs, covers 68-78 % (benchmarks/calibration.py, docs/CALIBRATION.md). The best-layer
row's interval is simultaneous over the layers it was chosen from (Bonferroni: level 1 - 0.05 / layers), so it
still holds for the layer that came out best. What each expects of the batches it is fed (the dataset formats in
`vitscope.data.synthetic_tasks` and `vitscope.data.formats` provide it):

  propagation     ``objects`` (B, H, W) label maps at the model input (0 background, 255 void), ``sequences``
                  and ``frames``; frames of a video consecutive, in order (a video is one unit).
  correspondence  flattened pairs: item 2p the source, 2p + 1 the target of pair p, ``extra['pair']`` and
                  ``extra['role']`` (0 source, 1 target), ``keypoints`` (B, K, 3) with row k the same
                  semantic keypoint in both images, ``boxes`` (the object's box) or ``extra['ref_size']``
                  (max(bbox h, w) in the model input's pixels), ``extra['category']`` (names) or ``labels``.
  retrieval       ``extra['db_index']`` (B,) database index (-1 for queries), ``extra['query_index']`` (B,)
                  (-1 for database images) and ``extra['gnd']`` (per query: 'easy', 'hard', 'junk'
                  database indices; None for database images).

Inputs that cannot be scored are counted, never dropped silently: rows ``metric = 'skipped'`` with the
``reason`` and the count (a video without an annotated first frame, a pair without a keypoint visible in
both images, a query without positives in a protocol, ...).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.pooled import PooledTable
from vitscope.bounds import Count, NonNegative, Positive
from vitscope.capture.views import token_view
from vitscope.data.tiling import assemble
from vitscope.errors import VitscopeError
from vitscope.host import host_copies, moved
from vitscope.metrics import dense as D
from vitscope.metrics import intervals as I


class _Dense(Analysis):
    """Shared plumbing: layers, taps, patch features, skip accounting, best-layer rows."""

    headline: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, vm: Any, layers: Any = None, final_norm: bool = True):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        if final_norm and self.depth not in self.layers:
            self.layers.append(self.depth)  # layer = depth: the last block's output after the final norm
        self.skipped: Counter[str] = Counter()
        self.protocol: dict[str, list[str]] = {"framing": [], "input": []}

    def required_taps(self) -> list[str]:
        return ["final_norm" if i == self.depth else f"block{i}.out" for i in self.layers]

    def layers_param(self, layers: Any) -> list[int]:
        """Blocks as for every analysis, plus ``depth`` itself: the output of the final norm (DINO's features)."""
        if layers is None or layers == "all":
            return list(range(self.depth))
        items = [layers] if isinstance(layers, int) else list(layers)
        blocks = super().layers_param([i for i in items if i != self.depth])
        return blocks + [self.depth] * (self.depth in items)

    def _note(self, batch: Any, grid: tuple[int, int]) -> None:
        """Record the protocol a batch was drawn under (its framing and the model input's size) for the table."""
        framing = batch.extra.get("framing") or ("tiled" if "tiling" in batch.extra else None)
        size = f"{grid[0] * self.patch_size}x{grid[1] * self.patch_size}"
        for key, v in (("framing", framing), ("input", size)):
            if v is not None and v not in self.protocol[key]:
                self.protocol[key].append(v)

    def _protocol_columns(self, df: pd.DataFrame) -> pd.DataFrame:
        """The protocol settings as columns: ``framing`` (whole frame / centre crop and its size) and
        ``input_size`` (the model inputs' H x W; several when images differ)."""
        df["framing"] = "; ".join(self.protocol["framing"]) or None
        inputs = self.protocol["input"]
        df["input_size"] = "; ".join(inputs[:4]) + (f"; ... ({len(inputs)} sizes)" if len(inputs) > 4 else "") \
            if inputs else None
        return df

    def _protocol_state(self) -> dict[str, Any]:
        return {k: list(v) for k, v in self.protocol.items()}

    def _load_protocol(self, state: Mapping[str, Any]) -> None:
        p = state.get("protocol") or {}
        self.protocol = {"framing": list(p.get("framing", [])), "input": list(p.get("input", []))}

    def _merge_protocol(self, other: _Dense) -> None:
        for k, vs in other.protocol.items():
            for v in vs:
                if v not in self.protocol[k]:
                    self.protocol[k].append(v)

    def _patch_features(self, feats: Mapping[str, torch.Tensor], grid: tuple[int, int]) -> torch.Tensor:
        """(B, L, S, D) L2-normalised patch tokens of every layer."""
        x = torch.stack([token_view(feats[t], "spatial", self.num_prefix_tokens) for t in self.required_taps()], 1)
        s = grid[0] * grid[1]
        if x.shape[2] != s:
            raise VitscopeError(f"{self.name}: {x.shape[2]} patch tokens per image, expected {s} for the grid "
                                f"{grid}")
        return F.normalize(x.float(), dim=-1)

    def _items(self, feats: Mapping[str, torch.Tensor], batch: Any
               ) -> Iterator[tuple[torch.Tensor, tuple[int, int], dict[str, Any]]]:
        """Per item (image) of the batch: its L2-normalised patch features (L, S, D), its token grid and its
        annotations (``index``, ``objects``, ``keypoints``, ``bbox``, ``label``, ``frame``, ``sequence``,
        ``pair``, ``role``, ``category``, ``ref_size``). Tiled batches (`vitscope.data.tiling.TiledDataset`)
        are assembled into one grid per item."""
        tiling = batch.extra.get("tiling")
        if tiling is None:
            grid = self.grid_of(batch)
            self._note(batch, grid)
            x = self._patch_features(feats, grid)
            for b in range(len(batch)):
                yield x[b], grid, _plain_item(batch, b)
            return
        if int(tiling["patch"]) != self.patch_size:
            raise VitscopeError(f"{self.name}: the tiled dataset was cut for patch size {tiling['patch']}, the model "
                                f"has {self.patch_size}; set the dataset's option patch: {self.patch_size}")
        t = int(tiling["tile"]) // self.patch_size
        spatial = [token_view(feats[tap], "spatial", self.num_prefix_tokens) for tap in self.required_taps()]
        if spatial[0].shape[1] != t * t:
            raise VitscopeError(f"{self.name}: {spatial[0].shape[1]} patch tokens per tile, expected {t * t}")
        for item in tiling["items"]:
            plan, first = item["plan"], int(item["first"])
            self._note(batch, plan.grid)
            n = len(plan.tiles)
            grids = [assemble(plan, f[first:first + n].reshape(n, t, t, -1)) for f in spatial]
            yield F.normalize(torch.stack(grids).flatten(1, 2).float(), dim=-1), plan.grid, item

    def _table(self, rows: list[dict[str, Any]], *columns: str) -> pd.DataFrame:
        """`tidy` with the columns every table of this analysis has, present even when empty."""
        df = self.tidy(rows)
        for c in (*columns, "reason", "task", "chance", "last_layer_value", "value_lo", "value_hi", "interval_units"):
            if c not in df.columns:
                df[c] = None
        return df

    def _skip_rows(self) -> list[dict[str, Any]]:
        return [{"metric": "skipped", "reason": r, "value": float(n)} for r, n in sorted(self.skipped.items())]

    def _best_rows(self, rows: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
        """``best_<metric>``: the best layer (and token view) and its score, with the chance level beside it; its
        ``stderr`` is the layer's, its interval (`best_interval`) simultaneous over the candidates."""
        cand = [r for r in rows if r["metric"] == metric and r.get("layer") is not None
                and not _nan(r["value"]) and r.get("video") is None and r.get("category") is None]
        if not cand:
            return []
        best = max(cand, key=lambda r: (r["value"], -r["layer"]))
        lo, hi = best_interval(best, len(cand))
        chance = [r["value"] for r in rows if r["metric"] == f"{metric}_chance"
                  and r.get("token_view") == best.get("token_view") and r.get("category") is None
                  and r.get("video") is None]
        last = [r["value"] for r in cand
                if r["layer"] == self.layers[-1] and r.get("token_view") == best.get("token_view")]
        return [{"metric": f"best_{metric}", "layer": best["layer"], "token_view": best.get("token_view"),
                 "value": best["value"], "stderr": best.get("stderr", float("nan")), "value_lo": lo, "value_hi": hi,
                 "interval_units": best.get("interval_units"), "chance": chance[0] if chance else float("nan"),
                 "last_layer_value": last[0] if last else float("nan"), "task": self.name}]


def _plain_item(batch: Any, b: int) -> dict[str, Any]:
    """Item b's annotations from an untiled batch."""
    ex = batch.extra

    def at(key: str) -> Any:
        v = ex.get(key)
        if v is None:
            return None
        return v[b].item() if torch.is_tensor(v) else v[b]

    source = ex.get("source_objects")
    geometry = ex.get("geometry")
    return {"index": int(batch.index[b]),
            "objects": batch.objects[b] if batch.objects is not None else None,
            "source_objects": source[b] if source is not None else None,
            "geometry": geometry[b] if geometry is not None else None,
            "source_ref_size": at("source_ref_size"),
            "keypoints": batch.keypoints[b] if batch.keypoints is not None else None,
            "bbox": batch.boxes[b] if batch.boxes is not None else None,
            "label": int(batch.labels[b]) if batch.labels is not None else None,
            "frame": int(batch.frames[b]) if batch.frames is not None else None,
            "sequence": batch.sequences[b] if batch.sequences is not None else None,
            "pair": at("pair"), "role": at("role"), "category": at("category"), "ref_size": at("ref_size")}


def best_interval(row: Mapping[str, Any], candidates: int, level: float = 0.95) -> tuple[float, float]:
    """The interval of a best-layer row: ``value ± t · stderr`` with the t quantile (``interval_units - 1`` degrees
    of freedom) at level ``1 - (1 - level) / candidates`` (Bonferroni over the layers and views the best was chosen
    from), so it covers the chosen layer's score with probability ``level`` or more whichever layer came out best (a
    plain 95 % interval of the maximum of 8 layers at chance lies above chance up to 1 - 0.975^8 = 18 % of the time).
    NaN without a standard error or with fewer than two units."""
    se, units = float(row.get("stderr", float("nan"))), row.get("interval_units")
    if _nan(units) or units < 2 or not math.isfinite(se):
        return float("nan"), float("nan")
    half = I.t_quantile(int(units) - 1, 1 - (1 - level) / max(int(candidates), 1)) * se
    return float(row["value"]) - half, float(row["value"]) + half


def _interval(x: torch.Tensor, clusters: torch.Tensor | None = None) -> dict[str, Any]:
    """``stderr``, ``value_lo``, ``value_hi`` and ``interval_units`` of the mean of the finite values of ``x``
    (`vitscope.metrics.intervals.cluster_interval`: cluster-robust over ``clusters``, one label per value, else
    every value its own unit; Student's t); NaN with fewer than two units."""
    x = x.double().cpu().numpy()
    c = None if clusters is None else clusters.cpu().numpy()
    _, se, lo, hi = I.cluster_interval(x, c)
    keep = np.isfinite(x)
    units = len(np.unique(c[keep])) if c is not None else int(keep.sum())
    return {"stderr": se, "value_lo": lo, "value_hi": hi, "interval_units": units}


def _nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


# ================================================================================================ propagation


@register_analysis
class Propagation(_Dense):
    """Video object segmentation by label propagation, per layer, with no training (DINO's protocol, Caron et
    al. 2021, ``eval_video_segmentation.py``): the first frame's annotation is carried to each later frame from
    the first frame and the last ``n_last_frames`` (7) frames' predictions, by the affinity exp(cos / 0.1) of
    patch tokens within a neighbourhood of ``radius`` (12) tokens, top ``topk`` (5) kept; J (region IoU), F
    (boundary F-measure, DAVIS tolerance) and J&F per layer, per video and overall (the mean over objects of
    every video, DAVIS's global score), multi-object label maps included. Frames 1 .. n-2 are scored, as the
    DAVIS semi-supervised evaluation does (``skip_last=False`` scores the last frame too). Each frame's
    features are computed once per layer (one forward) and kept only while they are context. Chance
    (``*_chance``): the same propagation with constant features (every key in the neighbourhood equally
    similar: each token gets the mean label of its neighbourhood in the context frames).

    Protocol, where it follows the sources and where it deviates. Follows DINO: DAVIS frames whole at their
    aspect ratio, short side 480 (the dataset's ``crop: full``, ``size: 480``); the first frame's labels read
    at the token grid from the annotation at its own resolution; predictions upsampled bilinearly to the model
    input, normalised per channel, argmax, then resized (nearest) to the annotation's resolution and scored
    there; the last block's output after the final norm is a layer (``layer`` = depth, ``final_norm: true``).
    Follows the DAVIS evaluation: void pixels (255) count as background (its semi-supervised masks are
    ``labels == id``). Deviates: the long side is rounded down to a multiple of the patch size (854 -> 848 at
    patch 16), where DINO rounds it down to a multiple of 64 (832), because 64 is not a multiple of every
    patch size (14); ``crop: center`` (the model's eval crop) remains an option, which loses objects at the
    frame's sides. The table's ``framing``, ``input_size``, ``scored_at`` and ``frames_scored`` columns say
    which protocol a run used. The default study's generated videos are square and drawn at the model's
    input size, so they are whole frames as they are.

    Uncertainty: the overall J, F and J&F carry a standard error clustered by video (objects of one video share
    its difficulty; with one object per video it is the plain error over objects) and the 95 % interval
    ``value_lo``, ``value_hi`` = value ± t · stderr, Student's t with (videos - 1) degrees of freedom
    (`vitscope.metrics.intervals.cluster_interval`; ``interval_units`` = videos). The value ± 1.96 stderr over
    objects it replaces covered 68-88 % of the time in simulations of 2-30 videos (benchmarks/calibration.py,
    docs/CALIBRATION.md)."""

    name = "propagation"
    # 6: stderr clustered by video, t interval (value_lo, value_hi, interval_units);
    # 5: the video in progress on the features' device (a state holds it on the CPU); 4: the context in one buffer,
    # a wide video's transposed; 3: stderr over objects; 2: whole frames scored at the annotation's resolution, void
    # as background, final norm
    state_version = 6
    needs = frozenset({"videos", "objects"})
    headline = "JF"
    description = "video mask propagation (DINO protocol) per layer: J, F, J&F, with a constant-feature chance"

    def __init__(self, vm: Any, layers: Any = None, n_last_frames: Count = D.N_LAST_FRAMES,
                 radius: NonNegative = D.NEIGHBOURHOOD, topk: Count = D.TOPK, temperature: Positive = D.TEMPERATURE,
                 bound_th: float = D.BOUND_TH, skip_last: bool = True, final_norm: bool = True):
        super().__init__(vm, layers, final_norm)
        self.n_last_frames, self.radius, self.topk = int(n_last_frames), int(radius), int(topk)
        self.temperature, self.bound_th, self.skip_last = float(temperature), float(bound_th), bool(skip_last)
        self._near: dict[tuple[tuple[int, int], torch.device], torch.Tensor] = {}
        self.videos: list[dict[str, Any]] = []   # finished: per-object mean J and F per layer (+ chance)
        self.scored_at: list[str] = []           # 'annotation HxW' / 'model input HxW' per size seen
        self.cur: dict[str, Any] | None = None   # the video in progress (bounded: 1 + n_last_frames frames)
        self.unscored_frames = 0

    # -- streaming -----------------------------------------------------------------------------------
    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        """Frames in order: a frame's propagation reads the predictions of the frames before it, so a video is a
        loop over its frames, each step tensor ops on the features' device that read nothing back. What Python
        decides on (the frames' indices and numbers, the object ids of a frame that may start a video) is read in
        one copy for the batch (`_read`)."""
        items, index, frames = self._frame_items(feats, batch)
        if not items:
            return
        if self.cur is not None:
            self.cur = moved(self.cur, items[0]["x"].device)  # a loaded state's video goes on with the features
        starts = self._may_start(items)
        index, frames, ids = self._read(index, frames, [items[b]["objects"] for b in starts])
        first_ids = dict(zip(starts, ids, strict=True))
        for b, it in enumerate(items):
            self._frame(it["sequence"], frames[b], it["x"], it["objects"], index[b], it["grid"], first_ids.get(b))
            self.n_images += 1

    def _frame_items(self, feats: Mapping[str, torch.Tensor], batch: Any) -> tuple[list[dict[str, Any]], Any, Any]:
        """The batch's frames (``x`` (L, S, D) features, ``grid``, ``sequence``, ``objects``: the annotation,
        at the file's resolution when the dataset keeps it (whole frames)), with their dataset indices and frame
        numbers as the batch holds them (tensors, or lists for a tiled batch)."""
        if "tiling" in batch.extra:
            items, index, frames = [], [], []
            for x, grid, it in self._items(feats, batch):
                objects = it.get("source_objects") if it.get("source_objects") is not None else it.get("objects")
                items.append({"x": x, "grid": grid, "sequence": it.get("sequence"), "objects": objects})
                index.append(int(it["index"]))
                frames.append(it.get("frame"))
            return items, index, frames
        grid = self.grid_of(batch)
        self._note(batch, grid)
        x = self._patch_features(feats, grid)
        src, objects, seqs = batch.extra.get("source_objects"), batch.objects, batch.sequences
        items = [{"x": x[b], "grid": grid, "sequence": seqs[b] if seqs is not None else None,
                  "objects": src[b] if src is not None and src[b] is not None else
                  objects[b] if objects is not None else None} for b in range(len(batch))]
        return items, batch.index, batch.frames if batch.frames is not None else [None] * len(batch)

    def _may_start(self, items: list[dict[str, Any]]) -> list[int]:
        """Positions of the annotated frames that may start a video: no sequence name, or another than the frame
        before (a frame 0 inside a named sequence also starts one: its object ids are read then, `_start`)."""
        prev = self.cur["sequence"] if self.cur is not None else None
        out = []
        for b, it in enumerate(items):
            seq = it["sequence"]
            if it["objects"] is not None and (seq is None or seq != prev or (b == 0 and self.cur is None)):
                out.append(b)
            prev = seq
        return out

    @staticmethod
    def _read(index: Any, frames: Any, maps: list[torch.Tensor]) -> tuple[list[int], list[Any], list[Any]]:
        """One copy to Python for a batch: the frames' indices and numbers (those held in tensors) and, per map
        of ``maps``, its object ids (`metrics.dense.label_presence`: a fixed size, so all fit in the copy; None
        for a map with values outside 0 .. 255)."""
        held = [v for v in (index, frames) if torch.is_tensor(v)]
        parts = [v.long().flatten() for v in held] + [D.label_presence(m) for m in maps]
        vals = torch.cat(parts).tolist() if parts else []
        at = 0
        out = []
        for v in (index, frames):
            if torch.is_tensor(v):
                n = v.numel()
                out.append(vals[at:at + n])
                at += n
            else:
                out.append(list(v))
        ids = [D.present_objects(vals[at + 257 * i:at + 257 * (i + 1)]) for i in range(len(maps))]
        return out[0], out[1], ids

    def near(self, grid: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        key = (tuple(grid), torch.device(device))
        if key not in self._near:
            self._near[key] = D.neighbourhood(grid, self.radius, device)
        return self._near[key]

    @staticmethod
    def _work(grid: tuple[int, int]) -> tuple[tuple[int, int], bool]:
        """The grid propagation works on: a wide frame transposed (tokens column-major), so that
        `metrics.dense.propagate`'s bands of rows run along the long side, where the neighbourhood saves most."""
        h, w = grid
        return ((w, h), True) if w > h else ((h, w), False)

    @staticmethod
    def _turn(t: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Tokens (dim -1 if ``t`` holds labels (.., C, S), else dim -2) of a row-major ``grid`` <-> the
        transposed grid's order (an involution given the grid it is in)."""
        h, w = grid
        return t.unflatten(-1, (h, w)).transpose(-1, -2).flatten(-2)

    def _frame(self, seq: str | None, frame: int | None, x: torch.Tensor, objects: torch.Tensor | None,
               item: int, grid: tuple[int, int], ids: list[int] | None = None) -> None:
        cur = self.cur
        new = cur is None or seq is None or seq != cur["sequence"] or (frame is not None and frame == 0)
        if not new and frame is not None and cur["last_frame"] is not None and frame != cur["last_frame"] + 1:
            raise VitscopeError(f"propagation: video {seq!r} jumps from frame {cur['last_frame']} to {frame}; "
                                "frames of a video must arrive in order (a video is one unit)")
        if new:
            self._close()
            self._start(seq, frame, x, objects, item, grid, ids)
            return
        if tuple(cur["grid"]) != tuple(grid):
            raise VitscopeError(f"propagation: frames of video {seq!r} have token grids {tuple(cur['grid'])} and "
                                f"{tuple(grid)}; a video's frames must share one size")
        cur["n_frames"] += 1
        cur["last_frame"] = frame
        if cur.get("skip"):
            return
        # context, labels and predictions are kept in the working grid's token order (`_work`)
        work, turned = self._work(grid)
        x = self._turn(x.transpose(1, 2), grid).transpose(1, 2) if turned else x
        # the context frames' features sit in one (L, S, slots, D) buffer (slot 0 the first frame, then a ring of
        # the last n_last_frames), the layout `propagate` reads a band of keys from without a copy
        n, buf = cur["n_ctx"], cur["ctx"]
        lab = torch.stack([cur["labels"][i][0] for i in range(n)], 1)                         # (L, n, C, S)
        near = self.near(work, x.device)
        probs = D.propagate(x, buf[:, :, :n].transpose(1, 2), lab, work, self.radius, self.topk, self.temperature,
                            near)                                                          # (L, C, S)
        cprobs = D.neighbourhood_mean(torch.stack([cur["labels"][i][1] for i in range(n)], 1), near)  # (1, C, S)
        if self.n_last_frames:
            slot = cur["next"]  # the oldest of the last frames, or a free slot
            buf[:, :, slot] = x
            cur["labels"][slot] = (probs, cprobs)
            cur["next"] = 1 + slot % self.n_last_frames
            cur["n_ctx"] = min(n + 1, 1 + self.n_last_frames)
        if turned:
            probs, cprobs = self._turn(probs, work), self._turn(cprobs, work)
        cur["last_scored"] = objects is not None
        if objects is None:
            self.unscored_frames += 1
            return
        pred = D.tokens_to_labels(torch.cat([probs, cprobs]), grid, tuple(objects.shape[-2:]),
                                  (grid[0] * self.patch_size, grid[1] * self.patch_size))  # 0 or 1 + object
        j, f = D.jf_objects(objects.long(), pred, cur["objects"], self.bound_th, pred_index=True)  # (L + 1, K)
        h, w = objects.shape[-2:]
        where = "model input" if (h, w) == (grid[0] * self.patch_size, grid[1] * self.patch_size) else "annotation"
        at = f"{where} {h}x{w}"
        if at not in self.scored_at and len(self.scored_at) < 8:
            self.scored_at.append(at)
        cur["scores"].append((j, f))

    def _start(self, seq: str | None, frame: int | None, x: torch.Tensor, objects: torch.Tensor | None,
               item: int, grid: tuple[int, int], ids: list[int] | None = None) -> None:
        """Open a video at its first frame: the object ids of its annotation (``ids`` when the batch's copy read
        them, else read here) and the first frame's features and token labels as the context."""
        cur: dict[str, Any] = {"sequence": seq if seq is not None else f"item{item}", "last_frame": frame,
                               "n_frames": 1, "scores": [], "first_item": item, "grid": list(grid)}
        self.cur = cur
        if frame not in (None, 0):
            cur["skip"] = "video does not start at frame 0"
        elif objects is None:
            cur["skip"] = "no annotated first frame"
        else:
            if ids is None:  # a frame 0 inside its sequence, or label values beyond 255: read on its own
                ids = [int(k) for k in torch.unique(objects).tolist() if k not in (0, D.VOID)]
            if not ids:
                cur["skip"] = "no object in the first frame's annotation"
            else:
                y = D.labels_to_tokens(objects.long(), grid, ids).to(x.device, non_blocking=True)  # (C, S)
                if self._work(grid)[1]:  # kept in the working grid's order (`_frame`)
                    x, y = self._turn(x.transpose(1, 2), grid).transpose(1, 2), self._turn(y, grid)
                L, S, Dm = x.shape
                buf = x.new_zeros(L, S, 1 + self.n_last_frames, Dm)  # zeros: a saved state is
                buf[:, :, 0] = x                                                     # the same bytes every time
                cur.update(objects=ids, ctx=buf, n_ctx=1, next=1,
                           labels=[(y[None].expand(L, -1, -1).clone(), y[None].clone())] + [None] * self.n_last_frames)

    def _close(self) -> None:
        cur, self.cur = self.cur, None
        if cur is None:
            return
        if cur.get("skip"):
            self.skipped[cur["skip"]] += 1
            return
        scores = cur["scores"]
        if self.skip_last and cur.get("last_scored"):
            scores = scores[:-1]  # DAVIS scores frames 1 .. n-2
        if not scores:
            self.skipped["video without a scored frame (DAVIS scores frames 1 .. n-2)" if self.skip_last
                         else "video without a scored frame"] += 1
            return
        j = torch.stack([s[0] for s in scores]).mean(0)  # (L + 1, K): per-object mean over frames
        f = torch.stack([s[1] for s in scores]).mean(0)
        self.videos.append({"sequence": cur["sequence"], "n_frames": cur["n_frames"], "objects": cur["objects"],
                            "scored_frames": len(scores), "J": j, "F": f})

    # -- protocol --------------------------------------------------------------------------------------
    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Propagation) and other.layers == self.layers
        self._close()
        other._close()
        self._merge_protocol(other)
        self.scored_at += [a for a in other.scored_at if a not in self.scored_at]
        self.videos += other.videos
        self.skipped.update(other.skipped)
        self.n_images += other.n_images
        self.unscored_frames += other.unscored_frames

    def state_dict(self) -> dict[str, Any]:
        cur = None
        if self.cur is not None:
            cur = {k: v for k, v in self.cur.items() if k != "labels"}
            if "labels" in self.cur:
                cur["labels"] = [None if q is None else list(q) for q in self.cur["labels"]]
        return {"layers": self.layers, "videos": host_copies(self.videos), "cur": host_copies(cur),
                "skipped": dict(self.skipped),
                "n_images": self.n_images, "unscored_frames": self.unscored_frames, "protocol": self._protocol_state(),
                "scored_at": list(self.scored_at)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers = list(state["layers"])
        self._load_protocol(state)
        self.scored_at = list(state.get("scored_at", []))
        self.videos = [dict(v) for v in state["videos"]]
        cur = state["cur"]
        self.cur = None if cur is None else {**cur, "scores": [tuple(s) for s in cur["scores"]]}
        if self.cur is not None and "labels" in self.cur:
            self.cur["labels"] = [None if q is None else tuple(q) for q in self.cur["labels"]]
        self.skipped = Counter(state["skipped"])
        self.n_images, self.unscored_frames = int(state["n_images"]), int(state["unscored_frames"])

    def finalize(self) -> pd.DataFrame:
        self._close()
        rows: list[dict[str, Any]] = []
        if self.videos:
            self.videos = moved(self.videos, "cpu")
            j = torch.cat([v["J"] for v in self.videos], 1)  # (L + 1, all objects)
            f = torch.cat([v["F"] for v in self.videos], 1)
            video = torch.cat([torch.full((v["J"].shape[1],), i) for i, v in enumerate(self.videos)])  # per object
            for k, layer in enumerate([*self.layers, None]):
                sfx = "" if layer is not None else "_chance"
                jm, fm = float(j[k].mean()), float(f[k].mean())
                rows += [{"metric": "J" + sfx, "layer": layer, "value": jm, **_interval(j[k], video)},
                         {"metric": "F" + sfx, "layer": layer, "value": fm, **_interval(f[k], video)},
                         {"metric": "JF" + sfx, "layer": layer, "value": (jm + fm) / 2,
                          **_interval((j[k] + f[k]) / 2, video)}]
                for v in self.videos:
                    vj, vf = float(v["J"][k].mean()), float(v["F"][k].mean())
                    rows += [{"metric": "video_J" + sfx, "layer": layer, "value": vj, "video": v["sequence"]},
                             {"metric": "video_F" + sfx, "layer": layer, "value": vf, "video": v["sequence"]},
                             {"metric": "video_JF" + sfx, "layer": layer, "value": (vj + vf) / 2,
                              "video": v["sequence"]}]
        for r in rows:
            r["token_view"] = "spatial"
        rows += self._best_rows(rows, "JF")
        rows += self._skip_rows()
        if self.unscored_frames:
            rows.append({"metric": "skipped", "reason": "frame without annotation (propagated, not scored)",
                         "value": float(self.unscored_frames)})
        df = self._table(rows, "video")
        df["n_videos"] = len(self.videos)
        df["n_objects"] = sum(len(v["objects"]) for v in self.videos)
        df = self._protocol_columns(df)
        df["frames_scored"] = "1 .. n-2 (DAVIS)" if self.skip_last else "1 .. n-1"
        df["scored_at"] = "; ".join(self.scored_at) or None
        return df


# ================================================================================================ correspondence


#: the correspondence sums kept per category (a row each), the rest (skips) for all
_CATEGORY_SUMS = ("correct", "chance", "keypoints", "pairs", "correct_sq", "correct_kp", "keypoints_sq")

#: the reasons a correspondence item is not scored, in the order of its skip counts
_PAIR_SKIPS = ("source without its target", "target without its source",
               "pair without a keypoint visible in both images", "pair whose target object has an empty box")


def _batch_column(batch: Any) -> Any:
    """An untiled batch's annotation columns by the names `_plain_item` gives its items' annotations."""
    fields = {"keypoints": batch.keypoints, "bbox": batch.boxes, "label": batch.labels}

    def column(key: str) -> Any:
        return fields[key] if key in fields else batch.extra.get(key)
    return column


def _item_column(item: Mapping[str, Any]) -> Any:
    """One item's annotations (a tiled item's) as columns of length 1."""
    def column(key: str) -> Any:
        v = item.get(key)
        if v is None:
            return None
        return torch.as_tensor(v)[None] if key in ("keypoints", "bbox") else [v]
    return column


@register_analysis
class Correspondence(_Dense):
    """Keypoint correspondence per layer with no training (Walmer et al., CVPR 2023, §6.3 / E.1): for each
    image pair and each source keypoint visible in both images, the nearest neighbour (cosine) of the patch
    token holding the source keypoint among the target's patch tokens; the prediction is that token's centre.
    PCK@alpha = share of keypoints predicted within alpha * max(bbox h, w) of the target object (alpha = 0.1,
    0.05, 0.01), per layer, per category, over all keypoints and as the mean over categories. Chance
    (``pck@a_chance``): a uniformly random target token.

    Protocol: SPair-71k images reach the model whole (the dataset's ``crop: full``; short side ``size``,
    default the model's input size, aspect kept, sides rounded down to the patch size), so no keypoint is lost
    to a crop, and distances are measured in the file's pixels (token centres mapped back through the
    resize) against alpha * max(bbox h, w) of the box at its original size, as SPair-71k's PCK is defined.
    The input size is vitscope's choice (a ``size`` option), not a number taken from the source. With
    ``crop: center`` (the model's eval crop) keypoints outside the crop are not counted. The last block's
    output after the final norm is a layer (``layer`` = depth). The table's ``framing`` and ``input_size``
    columns say which protocol a run used.

    Uncertainty: the overall PCK carries a standard error clustered by image pair (the keypoints of one pair share
    its difficulty, so they are not independent trials) and the 95 % interval ``value_lo``, ``value_hi`` = value ±
    t · stderr with (pairs - 1) degrees of freedom (`vitscope.metrics.intervals.ratio_interval`, from per-pair
    sums; ``interval_units`` = pairs). The binomial error over keypoints it replaces covered 68-78 % of the time
    in simulations where pairs differ in difficulty (intra-pair correlation 0.2-0.33; benchmarks/calibration.py,
    docs/CALIBRATION.md)."""

    name = "correspondence"
    # 5: per-pair moment sums (correct_sq, correct_kp, keypoints_sq), stderr clustered by pair, t interval;
    # 4: sums per category in tensors on the features' device, the last item kept for a pair across batches;
    # 3: stderr over keypoints; 2: whole images, PCK in the file's pixels, final norm layer
    state_version = 5
    needs = frozenset({"pairs", "keypoints"})
    headline = "pck@0.1"
    description = "keypoint correspondence by nearest patch token per layer: PCK@0.1/0.05/0.01 per category"

    def __init__(self, vm: Any, layers: Any = None, alphas: Any = D.PCK_ALPHAS, final_norm: bool = True):
        super().__init__(vm, layers, final_norm)
        self.alphas = tuple(float(a) for a in alphas)
        self.cat_names: list[str] = []
        L, A = len(self.layers), len(self.alphas)
        # per category (row c: cat_names[c]): correct counts (L, A), chance sums (A,), keypoints, pairs, and over
        # its pairs the sums of correct² and correct x keypoints (L, A) and of keypoints² (the pair-level moments of
        # `vitscope.metrics.intervals.ratio_interval`); and the skip counts of _PAIR_SKIPS
        self.sums: dict[str, torch.Tensor] = {
            "correct": torch.zeros(0, L, A, dtype=torch.long), "chance": torch.zeros(0, A, dtype=torch.float64),
            "keypoints": torch.zeros(0, dtype=torch.long), "pairs": torch.zeros(0, dtype=torch.long),
            "correct_sq": torch.zeros(0, L, A, dtype=torch.long), "correct_kp": torch.zeros(0, L, A, dtype=torch.long),
            "keypoints_sq": torch.zeros(0, dtype=torch.long),
            "skips": torch.zeros(len(_PAIR_SKIPS), dtype=torch.long)}
        # the last item seen (a source waits there for its target in the next batch): its features at its
        # keypoints' tokens (L, K, D), keypoints (K, 3), pair () and whether it is a source ()
        self.last: dict[str, torch.Tensor] | None = None

    @property
    def cats(self) -> dict[str, dict[str, Any]]:
        """Per category: ``correct`` (L, A) and ``chance`` (A,) on the CPU, ``keypoints`` and ``pairs`` (ints)."""
        s = {k: v.cpu() for k, v in self.sums.items()}
        return {name: {"correct": s["correct"][c], "chance": s["chance"][c], "keypoints": int(s["keypoints"][c]),
                       "pairs": int(s["pairs"][c])} for c, name in enumerate(self.cat_names)}

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        """Every item of the batch is scored at once as the target of the item before it (the first item: of
        the last item of the previous batch), a 0/1 weight keeping only real pairs (a source followed by its
        target) with a keypoint visible in both and a non-empty box; the sums stay on the features' device.
        Nothing is read back (a labels-only dataset reads its labels, for the category names)."""
        if batch.extra.get("tiling") is None:
            grid = self.grid_of(batch)
            self._note(batch, grid)
            x = self._patch_features(feats, grid)
            self._score(x, grid, self._annotations(len(batch), _batch_column(batch), x.device))
            self.n_images += len(batch)
            return
        for x, grid, it in self._items(feats, batch):  # a tiled item's grid is its own: one at a time
            self._score(x[None], grid, self._annotations(1, _item_column(it), x.device))
            self.n_images += 1

    def _annotations(self, n: int, column: Any, device: torch.device) -> dict[str, torch.Tensor]:
        """The n items' annotations as tensors on ``device``: ``pair``, ``role`` (n,), ``kp`` (n, K, 3) float64,
        ``size`` (n,) the PCK reference size, ``scale`` and ``shift`` (n, 2) (model-input pixels -> the pixels
        PCK is measured in: (xy - shift) / scale), ``cat`` (n,) rows of the category sums. ``column(key)`` is the
        n items' value of an annotation (a tensor or a list) or None."""
        pair, role, kp = column("pair"), column("role"), column("keypoints")
        if pair is None or role is None:
            raise VitscopeError("correspondence needs flattened pairs (extra['pair'], extra['role']: item 2p the "
                                "source, 2p + 1 the target); use a pairs dataset of the catalog")
        if kp is None:
            raise VitscopeError("correspondence needs keypoints (B, K, 3) in the batches")
        geo, src_ref, ref, box = column("geometry"), column("source_ref_size"), column("ref_size"), column("bbox")
        in_source = [src_ref is not None and geo is not None and geo[b] is not None for b in range(n)]
        if ref is not None:
            size = torch.as_tensor(ref, dtype=torch.float64)
        elif box is not None:
            bx = torch.as_tensor(box).double()
            size = torch.maximum(bx[:, 2] - bx[:, 0], bx[:, 3] - bx[:, 1])
        elif all(in_source):
            size = torch.zeros(n, dtype=torch.float64)
        else:
            raise VitscopeError("correspondence needs the target object's box (boxes) or extra['ref_size']")
        if any(in_source):  # scored in the file's pixels: PCK relative to the box at the original size
            size = torch.where(torch.tensor(in_source), torch.as_tensor(src_ref, dtype=torch.float64), size)
        maps = [(g.sx, g.sy, g.tx, g.ty) if s else (1.0, 1.0, 0.0, 0.0) for g, s in zip(geo or [None] * n, in_source,
                                                                                          strict=True)]
        maps = torch.tensor(maps, dtype=torch.float64).view(n, 4)
        cats = torch.tensor([self._category_row(c) for c in self._categories(n, column)], dtype=torch.long)
        out = {"pair": torch.as_tensor(pair).long(), "role": torch.as_tensor(role).long(),
               "kp": torch.as_tensor(kp).double(), "size": size, "scale": maps[:, :2], "shift": maps[:, 2:],
               "cat": cats}
        # to the device without a stream synchronisation (a pageable host source is staged at once)
        return {k: v.to(device, non_blocking=True) for k, v in out.items()}

    @staticmethod
    def _categories(n: int, column: Any) -> list[str]:
        """The n items' category names: ``category``, else the class label, else 'all'."""
        cats, labels = column("category"), column("label")
        if cats is None:
            cats = [None] * n
        if labels is not None and any(c is None for c in cats):
            labels = labels.tolist() if torch.is_tensor(labels) else list(labels)  # a labels-only dataset
        return [str(c) if c is not None else str(int(labels[b])) if labels is not None else "all"
                for b, c in enumerate(cats)]

    def _category_row(self, name: str) -> int:
        """The row of a category in the sums, a zero row appended for a new one."""
        if name not in self.cat_names:
            self.cat_names.append(name)
            for k in _CATEGORY_SUMS:
                v = self.sums[k]
                self.sums[k] = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
        return self.cat_names.index(name)

    def _previous(self, x: torch.Tensor, K: int) -> dict[str, torch.Tensor]:
        """The last item kept from the previous batch, its keypoints cut or padded (not visible) to K: an item
        that is no source (nothing kept) when there is none."""
        L, Dm = x.shape[1], x.shape[3]
        last = self.last
        if last is None:
            return {"x": x.new_zeros(L, K, Dm), "kp": torch.zeros(K, 3, dtype=torch.float64, device=x.device),
                    "pair": torch.full((), -1, dtype=torch.long, device=x.device),
                    "source": torch.zeros((), dtype=torch.bool, device=x.device)}
        last = {k: v.to(x.device) for k, v in last.items()}
        k = min(K, last["kp"].shape[0])
        xs, kp = x.new_zeros(L, K, Dm), torch.zeros(K, 3, dtype=torch.float64, device=x.device)
        xs[:, :k], kp[:k] = last["x"][:, :k], last["kp"][:k]
        return {**last, "x": xs, "kp": kp}

    def _score(self, x: torch.Tensor, grid: tuple[int, int], a: dict[str, torch.Tensor]) -> None:
        """Score items (B, L, S, D) as targets of the items before them and add to the sums (all tensor ops)."""
        B, L, S, Dm = x.shape
        kp = a["kp"]
        K = kp.shape[1]
        self.sums = {k: v.to(x.device) for k, v in self.sums.items()}
        tok = self._token_of(kp[..., :2].reshape(-1, 2), grid).view(B, K)
        own = torch.gather(x, 2, tok[:, None, :, None].expand(B, L, K, Dm))             # (B, L, K, D) sources
        last = self._previous(x, K)
        is_src = a["role"] == 0
        prev_x = torch.cat([last["x"][None], own[:-1]])
        prev_kp = torch.cat([last["kp"][None], kp[:-1]])
        prev_pair = torch.cat([last["pair"][None], a["pair"][:-1]])
        prev_src = torch.cat([last["source"][None], is_src[:-1]])
        self.last = {"x": own[-1].clone(), "kp": kp[-1].clone(), "pair": a["pair"][-1].clone(),
                     "source": is_src[-1].clone()}  # copies: views would keep the whole batch's tensors alive
        paired = ~is_src & prev_src & (prev_pair == a["pair"])
        common = (prev_kp[..., 2] > 0) & (kp[..., 2] > 0)                                # (B, K)
        shown = common.any(1)
        boxed = a["size"] > 0
        scored = paired & shown & boxed
        self.sums["skips"] += torch.stack([is_src & prev_src, ~is_src & ~paired, paired & ~shown,
                                           paired & shown & ~boxed]).sum(1)
        correct, chance = D.pck_counts(prev_x, x, kp[..., :2], self.centres(grid, x.device), a["size"],
                                     a["scale"], a["shift"], common & scored[:, None], self.alphas)
        cat = a["cat"]
        counted = (common & scored[:, None]).sum(1)  # (B,) keypoints scored per pair (0: not a scored pair)
        self.sums["correct"].index_add_(0, cat, correct)
        self.sums["chance"].index_add_(0, cat, chance)
        self.sums["keypoints"].index_add_(0, cat, counted)
        self.sums["pairs"].index_add_(0, cat, scored.long())
        self.sums["correct_sq"].index_add_(0, cat, correct.square())
        self.sums["correct_kp"].index_add_(0, cat, correct * counted[:, None, None])
        self.sums["keypoints_sq"].index_add_(0, cat, counted.square())

    def _token_of(self, xy: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        gh, gw = grid
        p = self.patch_size
        col = torch.clamp(torch.floor(xy[:, 0] / p), 0, gw - 1).long()
        row = torch.clamp(torch.floor(xy[:, 1] / p), 0, gh - 1).long()
        return row * gw + col

    def centres(self, grid: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(S, 2) x, y pixel centre of each token of a grid."""
        p = self.patch_size
        ys, xs = torch.meshgrid((torch.arange(grid[0], device=device) + 0.5) * p,
                                (torch.arange(grid[1], device=device) + 0.5) * p, indexing="ij")
        return torch.stack([xs.flatten(), ys.flatten()], 1).double()

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Correspondence) and other.layers == self.layers and other.alphas == self.alphas
        dev = self.sums["skips"].device
        rows = torch.tensor([self._category_row(c) for c in other.cat_names], dtype=torch.long, device=dev)
        for k, v in other.sums.items():
            if k == "skips":
                self.sums[k] = self.sums[k] + v.to(dev)
            else:
                self.sums[k] = self.sums[k].index_add(0, rows, v.to(dev))
        self.skipped.update(other.skipped)
        self.n_images += other.n_images
        self._merge_protocol(other)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "alphas": list(self.alphas), "cat_names": list(self.cat_names),
                "sums": host_copies(self.sums), "last": host_copies(self.last),
                "skipped": dict(self.skipped), "n_images": self.n_images, "protocol": self._protocol_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.alphas = list(state["layers"]), tuple(state["alphas"])
        self._load_protocol(state)
        self.cat_names = list(state["cat_names"])
        self.sums = host_copies(state["sums"])  # copies: the sums grow in place, the caller's state stays as it was
        self.last = host_copies(state["last"])
        self.skipped = Counter(state["skipped"])
        self.n_images = int(state["n_images"])

    def finalize(self) -> pd.DataFrame:
        if self.last is not None:
            self.sums["skips"][0] += self.last["source"].to(self.sums["skips"].device)  # a source without its target
            self.last = None
        skipped = self.skipped + Counter(dict(zip(_PAIR_SKIPS, self.sums["skips"].tolist(), strict=True)))
        rows: list[dict[str, Any]] = []
        every = self.cats
        cats = {k: v for k, v in sorted(every.items()) if v["keypoints"] > 0}
        if cats:
            correct = sum(v["correct"] for v in cats.values())
            n = sum(v["keypoints"] for v in cats.values())
            chance = sum(v["chance"] for v in cats.values())
            rows_of = [c for c, name in enumerate(self.cat_names) if name in cats]
            moments = {k: self.sums[k].cpu()[rows_of].sum(0).double().tolist()
                       for k in ("correct_sq", "correct_kp", "keypoints_sq")}
            pairs = sum(v["pairs"] for v in cats.values())
            for a, alpha in enumerate(self.alphas):
                m = f"pck@{alpha:g}"
                per_cat = {k: v["correct"][:, a].double() / v["keypoints"] for k, v in cats.items()}
                for li, layer in enumerate(self.layers):
                    p = float(correct[li, a]) / n
                    _, se, lo, hi = I.ratio_interval(float(correct[li, a]), float(n), moments["correct_sq"][li][a],
                                                     moments["correct_kp"][li][a], moments["keypoints_sq"], pairs)
                    rows.append({"metric": m, "layer": layer, "value": p, "stderr": se, "value_lo": lo,
                                 "value_hi": hi, "interval_units": pairs})
                    rows.append({"metric": m + "_catmean", "layer": layer,
                                 "value": float(np.mean([float(p[li]) for p in per_cat.values()]))})
                    for k, p in per_cat.items():
                        rows.append({"metric": m, "layer": layer, "value": float(p[li]), "category": k})
                rows.append({"metric": m + "_chance", "layer": None, "value": float(chance[a]) / n})
                cat_chance = {k: float(v["chance"][a]) / v["keypoints"] for k, v in cats.items()}
                rows.append({"metric": m + "_catmean_chance", "layer": None,
                             "value": float(np.mean(list(cat_chance.values())))})
                rows += [{"metric": m + "_chance", "layer": None, "value": c, "category": k}
                         for k, c in cat_chance.items()]
        for r in rows:
            r["token_view"] = "spatial"
        rows += self._best_rows(rows, "pck@0.1")
        rows += [{"metric": "skipped", "reason": r, "value": float(n)} for r, n in sorted(skipped.items())]
        df = self._table(rows, "category")
        df["n_pairs"] = sum(v["pairs"] for v in every.values())
        df["n_keypoints"] = sum(v["keypoints"] for v in every.values())
        return self._protocol_columns(df)


# ================================================================================================ retrieval


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
    benchmarks/calibration.py, docs/CALIBRATION.md)."""

    name = "retrieval"
    # 5: t interval (value_lo, value_hi, interval_units);
    # 4: one store for every view (a batch is one copy to the host), ground truth kept by row until read;
    # 3: stderr over queries; 2: whole images, final norm layer
    state_version = 5
    needs = frozenset({"retrieval"})
    headline = "mAP_medium"
    description = "instance retrieval per layer and view (CLS, mean patch token): revisited mAP Easy/Medium/Hard"

    def __init__(self, vm: Any, layers: Any = None, views: Any = RETRIEVAL_VIEWS, chance_repeats: Count = 32,
                 seed: int = 0, final_norm: bool = True):
        super().__init__(vm, layers, final_norm)
        views = [views] if isinstance(views, str) else list(views)
        self.views = [v for v in views if v != "cls" or self.has_cls_token]
        self.chance_repeats, self.seed = int(chance_repeats), int(seed)
        # one store for all views, view-major: view v's layer j is the store's layer v * len(layers) + j
        self.table = PooledTable(len(self.views) * len(self.layers))
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
        self.table.append([token_view(f, v, self.num_prefix_tokens, self.has_cls_token) for v in self.views for f in x],
                          ids, torch.zeros_like(ids), is_query)
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
        """(rows, D) float16 features of view ``v`` (its position in ``views``) at the ``li``-th layer."""
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
            for li, layer in enumerate(self.layers):
                f = F.normalize(self._view(vi, li).float(), dim=-1)
                scores = f[q_rows] @ f[d_rows].T
                for name, prot in mapped.items():
                    aps = D.retrieval_aps(scores, prot)
                    rows.append({"metric": f"mAP_{name}", "layer": layer, "token_view": v,
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


__all__ = ["Correspondence", "Propagation", "Retrieval"]
