"""Video object segmentation by label propagation per layer, with no training (`propagation`; DINO's
protocol): J, F, J&F, with a constant-feature chance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.dense._common import _Dense, _interval
from vitscope.bounds import Count, NonNegative, Positive
from vitscope.errors import VitscopeError
from vitscope.host import host_copies, moved
from vitscope.metrics import dense as D


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
    docs/CALIBRATION.md).

    ``random_baseline`` (default false, so tables keep today's rows and cost): also the paper's "random" row
    (Walmer et al. 2023, Tables 1 and 5): Gaussian features of the tokens' shape, N(0, 1) per token and channel,
    seeded by each frame's dataset index (the same in every model, shard and resume), propagated exactly as a
    layer is, once per video (not per layer): rows ``J_random``, ``F_random``, ``JF_random`` (and ``video_*``)
    with ``layer`` empty, and the best-layer row's ``random_features`` column. The constant-feature chance stays
    beside it; the table's ``variant`` column names the baseline that ran."""

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
                 bound_th: float = D.BOUND_TH, skip_last: bool = True, final_norm: bool = True,
                 random_baseline: bool = False):
        super().__init__(vm, layers, final_norm, random_baseline)
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
        x = self._patch_features(feats, grid, batch.index)
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
            sets = [*self.layers, *(["random"] if self.random_baseline else []), None]  # J, F rows: layers, random,
            for k, set_ in enumerate(sets):                                                  # then constant features
                sfx = "" if set_ not in (None, "random") else "_chance" if set_ is None else "_random"
                layer = set_ if set_ != "random" else None
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
