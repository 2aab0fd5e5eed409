"""Attention maps (`vitscope.analyses.attention`): the average (and a few single-image) CLS attention maps,
and the aligned aggregated attention maps (AAAM) with their head types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import pandas as pd
import torch

from vitscope.analyses.attention._common import (
    HEAD_TYPES,
    _canvas_and_distance,
    _LayerAttention,
    _Spatial,
)
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.kept import keep_smallest, smallest_distinct, valid_rows
from vitscope.bounds import NonNegative
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, moved, on_device
from vitscope.metrics import attention as A


def _png_bytes(pixels: torch.Tensor) -> bytes:
    """``(3, H, W)`` uint8 -> PNG file bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _cell_columns(values: torch.Tensor, layers: Sequence[int], names: tuple[str, str],
                  offsets: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """Columns layer, head, <names[0]>, <names[1]>, value of a ``(L, H, R, C)`` grid, row-major."""
    L, H, R, C = values.shape
    lay = torch.tensor(list(layers), dtype=torch.long)
    idx = torch.arange(L * H * R * C)
    return {
        "layer": lay[idx // (H * R * C)].numpy(),
        "head": ((idx // (R * C)) % H).numpy(),
        names[0]: ((idx // C) % R - offsets[0]).numpy(),
        names[1]: (idx % C - offsets[1]).numpy(),
        "value": values.reshape(-1).double().cpu().numpy(),
    }


class _KeptMaps(_LayerAttention):
    """Maps of a few kept images (``kept_index``, ``kept_maps``, ``kept_pixels``): those with the ``keep_images``
    smallest dataset indices, whatever the order batches or shards arrive in, with the images as the model saw
    them, un-normalised with ``pixel_mean``/``pixel_std`` (the model's normalisation, None where unknown: a cached
    state's model info has none)."""

    def __init__(self, vm: Any, layers: Any = None):
        super().__init__(vm, layers)
        pre = getattr(vm, "preprocessing", None)  # a loaded model has it; a ModelInfo (cached state) does not
        self.pixel_mean = tuple(float(x) for x in pre.mean) if pre is not None else None
        self.pixel_std = tuple(float(x) for x in pre.std) if pre is not None else None

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` model inputs -> uint8 images as the model saw them (on their device): normalisation
        undone with the model's mean and std (each image scaled to its own range when they are not known)."""
        x = images.detach().float()
        if self.pixel_mean is not None and self.pixel_std is not None:
            std = torch.tensor(self.pixel_std, device=x.device).view(1, 3, 1, 1)
            x = x * std + torch.tensor(self.pixel_mean, device=x.device).view(1, 3, 1, 1)
        else:
            lo = x.amin(dim=(1, 2, 3), keepdim=True)
            x = (x - lo) / (x.amax(dim=(1, 2, 3), keepdim=True) - lo).clamp_min(1e-12)
        return (x.clamp(0, 1) * 255).round().to(torch.uint8)

    def _keep(self, index: torch.Tensor, maps: torch.Tensor, pixels: torch.Tensor) -> None:
        """Keep the ``keep_images`` smallest distinct dataset indices among those kept and the new ones, on the
        new ones' device (`vitscope.analyses.kept`: ``kept_index`` may end in `NO_ID` rows, dropped on save)."""
        if len(index) == 0:
            return
        if len(self.kept_index) == 0:  # the first images decide the size of the kept pixels
            self.kept_pixels = torch.zeros(0, *pixels.shape[1:], dtype=torch.uint8)
        self.kept_index, (self.kept_maps, self.kept_pixels) = keep_smallest(
            self.keep_images, self.kept_index, [self.kept_maps, self.kept_pixels], index, [maps, pixels])

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept indices, maps and pixels on the CPU, without the rows that hold no image."""
        index, (maps, pixels) = valid_rows(self.kept_index, [self.kept_maps, self.kept_pixels])
        return index, maps, pixels


@register_analysis
class CLSAttentionMaps(_KeptMaps):
    """Average CLS attention map per layer and head [Walmer et al. 2023 §4.1, Fig. 11-13]:
    the CLS query's row over the spatial keys (CLS and register keys dropped, renormalised), on the patch
    grid, averaged over all images (a float64 sum and a count). The maps of single images are kept too,
    for the ``keep_images`` images with the smallest dataset index (bounded memory, independent of the
    order in which batches or shards arrive), with those images as the model saw them (after its resize
    and crop, un-normalised, 8 bits), so the report can draw each map over its image.

    Table: metric ``cls_attention``, one row per (layer, head, grid cell), extra columns ``row``, ``col``
    (patch grid coordinates), ``image`` (missing for the average over images, the dataset index for a
    single image's map) and ``n_images`` (images in the average); metric ``input_image``, one row per kept
    image (``image`` = its index, value missing) whose ``png`` column holds the image as PNG bytes. A model
    without CLS token has no such map: the analysis captures nothing and returns an empty table, whose reason
    the study says."""

    name = "cls_attention_maps"
    state_version = 2  # 2: the kept images' pixels
    description = "average (and a few single-image) CLS attention maps per layer and head"

    def __init__(self, vm: Any, layers: Any = None, keep_images: NonNegative = 4):
        super().__init__(vm, layers)
        if not self.has_cls_token:
            self.no_rows_because = "the model has no CLS token, so there is no CLS attention map"
        if int(keep_images) < 0:
            raise VitscopeError(f"{self.name}: keep_images must be >= 0, got {keep_images}")
        self.keep_images = int(keep_images)
        h, w = self.grid_size
        L, H = len(self.layers), self.num_heads
        self.sums = torch.zeros(L, H, h, w, dtype=torch.float64)
        self.kept_index = torch.zeros(0, dtype=torch.long)
        self.kept_maps = torch.zeros(0, L, H, h, w, dtype=torch.float32)
        self.kept_pixels = torch.zeros(0, 3, 1, 1, dtype=torch.uint8)

    def required_taps(self) -> list[str]:
        return super().required_taps() if self.has_cls_token else []

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "keep_images": self.keep_images}

    def on_grid(self, grid: tuple[int, int]) -> None:
        L, H = len(self.layers), self.num_heads
        self.sums = torch.zeros(L, H, *grid, dtype=torch.float64)
        self.kept_maps = torch.zeros(0, L, H, *grid, dtype=torch.float32)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if self.has_cls_token:
            self.pass_grid(batch)
        self.n_images += len(batch)
        if not self.has_cls_token:
            return
        maps = torch.stack([A.cls_attention_maps(feats[f"block{i}.attn"], self.grid_size, self.num_prefix_tokens)
                            for i in self.layers], dim=1)  # (B, L, H, h, w)
        self.sums = on_device(self.sums, maps.device)
        self.sums += maps.sum(0, dtype=torch.float64)
        if self.keep_images:
            index = batch.index.to(maps.device, torch.long)
            # only the batch's images that can be kept are converted (its keep_images smallest indices)
            take, index = smallest_distinct(index, self.keep_images)
            self._keep(index, maps[take].detach().float(), self._pixels(batch.images[take.to(batch.images.device)]))

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, CLSAttentionMaps)
        self._check_grid_merge(other)
        self.sums += other.sums.to(self.sums.device)
        self.n_images += other.n_images
        if self.keep_images:
            dev = self.sums.device
            self._keep(other.kept_index.to(dev), other.kept_maps.to(dev), other.kept_pixels.to(dev))

    def state_dict(self) -> dict[str, Any]:
        index, maps, pixels = self._kept()
        return {"layers": list(self.layers), "keep_images": self.keep_images, "n_images": self.n_images,
                "sums": host_copy(self.sums), "kept_index": index, "kept_maps": maps, "kept_pixels": pixels}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.keep_images = list(state["layers"]), int(state["keep_images"])
        self.n_images = int(state["n_images"])
        self.sums, self.kept_index = state["sums"].clone(), state["kept_index"].clone()
        self.kept_maps, self.kept_pixels = state["kept_maps"].clone(), state["kept_pixels"].clone()
        self.grid_size = (int(self.sums.shape[-2]), int(self.sums.shape[-1]))

    def average(self) -> torch.Tensor:
        """``(layers, heads, h, w)`` float64 average CLS map (zeros before any image), on the CPU."""
        return self.sums.cpu() / max(self.n_images, 1)

    def finalize(self) -> pd.DataFrame:
        if not self.has_cls_token:  # said by the study with its reason (`empty_reason`: ``no_rows_because``)
            return self._frame({"row": [], "col": [], "image": pd.array([], dtype="Int64"), "n_images": []})
        kept_index, kept_maps, kept_pixels = self._kept()
        parts = [(None, self.average())] if self.n_images else []
        parts += [(int(i), m) for i, m in zip(kept_index.tolist(), kept_maps, strict=True)]
        frames = [pd.DataFrame({**_cell_columns(maps, self.layers, ("row", "col")),
                                "image": pd.array([image] * maps.numel(), dtype="Int64")})
                  for image, maps in parts]
        if not frames:
            return self._frame({"row": [], "col": [], "image": pd.array([], dtype="Int64"), "n_images": []})
        df = pd.concat(frames, ignore_index=True)
        df["metric"] = "cls_attention"
        if len(kept_index):
            df = pd.concat([df, pd.DataFrame({
                "metric": "input_image", "image": pd.array(kept_index.tolist(), dtype="Int64"),
                "value": float("nan"), "png": [_png_bytes(p) for p in kept_pixels]})], ignore_index=True)
        df["n_images"] = self.n_images
        return self.tidy(cast(Any, df))


@register_analysis
class AlignedAttentionMaps(_LayerAttention):
    """Aligned Aggregated Attention Maps (AAAM) and automatic head types per layer and head [Walmer et al.
    2023 (Walmer et al. 2023) §4.2, Fig. 5-6; the attention distance of §4.3 / Park et al. 2023 feeds the
    ``global`` rule].

    Each spatial query's map over the spatial keys (prefix keys dropped, renormalised) is added into a
    ``(2h-1) x (2w-1)`` canvas with the query at the centre; the state keeps the float64 canvas sums per
    (layer, head) and the number of maps added (``images x h*w``: every query of every image), and the
    AAAM is their ratio, so each head's AAAM sums to 1. The mean attention distance per (layer, head) is
    accumulated in the same pass. At ``finalize`` each head's AAAM is summarised
    (:func:`~vitscope.metrics.attention.aam_statistics`) and classified
    (:func:`~vitscope.metrics.attention.head_types`, thresholds overridable with ``thresholds``) as
    strict_local, soft_local, axial, offset_local, global or mixed. The paper classified by eye.

    Table (all rows carry ``n_images``):

    * ``aaam``: one row per (layer, head, canvas cell); ``dy``, ``dx`` = key position relative to the query
      (rows down, columns right), value = mean attention.
    * ``aam_statistic``: one row per (layer, head, statistic); ``statistic`` names it (``offset``,
      ``spread_norm``, ``entropy_norm``, ``anisotropy``, ``mass_3x3``, ... see ``aam_statistics``).
    * ``head_type``: one row per (layer, head), value 1; ``type``, ``direction`` (axial: horizontal or
      vertical; offset_local: one of 8 compass directions; else missing), ``offset`` (centre-of-mass offset,
      tokens), ``statistic`` / ``statistic_value`` (the statistic that decided), ``distance`` (mean attention
      distance, unit square).
    * ``head_type_count``: one row per type (all six, zeros included) with layer and head missing;
      value = number of the model's analysed heads of that ``type``.
    """

    name = "aligned_attention_maps"
    state_version = 2  # 2: head types with the grid-scaled locality rule (the cached tables held the old ones)
    description = "aligned aggregated attention maps (AAAM) and head types per layer and head"

    def __init__(self, vm: Any, layers: Any = None, thresholds: Mapping[str, float] | None = None):
        super().__init__(vm, layers)
        self.thresholds = dict(thresholds) if thresholds else {}
        A.head_types(torch.zeros(1, 1, 1), thresholds=self.thresholds)  # unknown threshold names fail here
        h, w = self.grid_size
        L, H = len(self.layers), self.num_heads
        self.canvas = torch.zeros(L, H, 2 * h - 1, 2 * w - 1, dtype=torch.float64)
        self.distance = torch.zeros(L, H, dtype=torch.float64)
        self.n_maps = 0

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "thresholds": dict(self.thresholds)}

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.canvas = torch.zeros(len(self.layers), self.num_heads, 2 * grid[0] - 1, 2 * grid[1] - 1,
                                  dtype=torch.float64)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        sps = [_Spatial(feats[f"block{i}.attn"], self.num_prefix_tokens) for i in self.layers]
        canvas, dist = _canvas_and_distance(sps, self.grid_size)
        self.canvas, self.distance = moved((self.canvas, self.distance), dist.device)
        self.canvas += cast(torch.Tensor, canvas)
        self.distance += dist
        self.n_maps += len(batch) * self.grid_size[0] * self.grid_size[1]
        self.n_images += len(batch)

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, AlignedAttentionMaps)
        self._check_grid_merge(other)
        self.canvas += other.canvas.to(self.canvas.device)
        self.distance += other.distance.to(self.distance.device)
        self.n_maps += other.n_maps
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "thresholds": dict(self.thresholds), "canvas": host_copy(self.canvas),
                "distance": host_copy(self.distance), "n_maps": self.n_maps, "n_images": self.n_images}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.thresholds = list(state["layers"]), dict(state["thresholds"])
        self.canvas, self.distance = state["canvas"].clone(), state["distance"].clone()
        self.grid_size = ((int(self.canvas.shape[-2]) + 1) // 2, (int(self.canvas.shape[-1]) + 1) // 2)
        self.n_maps, self.n_images = int(state["n_maps"]), int(state["n_images"])

    def aaam(self) -> torch.Tensor:
        """``(layers, heads, 2h-1, 2w-1)`` float64: canvas sums over the number of maps added (on the CPU)."""
        return self.canvas.cpu() / max(self.n_maps, 1)

    def finalize(self) -> pd.DataFrame:
        if self.n_images == 0:
            return self._frame({"dy": [], "dx": [], "n_images": []})
        h, w = self.grid_size
        aaam = self.aaam()
        dist = self.distance.cpu() / self.n_images
        frames = [pd.DataFrame({"metric": "aaam", **_cell_columns(aaam, self.layers, ("dy", "dx"), (h - 1, w - 1))})]
        rows: list[dict[str, Any]] = []
        counts = dict.fromkeys(HEAD_TYPES, 0)
        for j, i in enumerate(self.layers):
            for stat, v in A.aam_statistics(aaam[j]).items():
                rows += [{"metric": "aam_statistic", "layer": i, "head": hd, "statistic": stat, "value": float(x)}
                         for hd, x in enumerate(v.tolist())]
            for t in A.head_types(aaam[j], distance=dist[j], thresholds=self.thresholds):
                counts[str(t["type"])] = counts.get(str(t["type"]), 0) + 1
                rows.append({"metric": "head_type", "layer": i, "head": t["head"], "value": 1.0,
                             "type": t["type"], "direction": t["direction"], "offset": t["offset"],
                             "statistic": t["statistic"], "statistic_value": t["value"], "distance": t["distance"]})
        rows += [{"metric": "head_type_count", "type": k, "value": float(c)} for k, c in counts.items()]
        frames.append(pd.DataFrame(rows))
        df = pd.concat(frames, ignore_index=True)
        df["n_images"] = self.n_images
        return self.tidy(cast(Any, df))
