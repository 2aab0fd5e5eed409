"""The full attention of a few images, kept compactly for the report's attention explorer
(`vitscope.analyses.attention`): click a patch, see where it looks at any block and head [Walmer et al. 2023;
the rollout of Abnar and Zuidema 2020].

The other attention analyses reduce the ``block{i}.attn`` maps (a mean, a statistic, a few chosen query rows);
this one keeps every query's row for ``keep_images`` images, 8 bits per weight with one float32 scale per row
(`quantise_rows`), so the report can draw any (block, head, query) map without a second run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pandas as pd
import torch

from vitscope.analyses.attention.maps import _KeptMaps, _png_bytes
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.kept import keep_smallest, smallest_distinct, valid_rows
from vitscope.bounds import NonNegative
from vitscope.errors import ConfigError
from vitscope.metrics import mechanistic as M

CODE_MAX = 255
"""The code of a row's largest weight: codes are ``round(a / max(a) * 255)`` in uint8."""

#: the kept per-image buffers, in the order `keep_smallest` carries them
_BUFFERS = ("attn_codes", "attn_scales", "rollout_codes", "rollout_scales", "pool_codes", "pool_scales", "pixels")


def quantise_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of non-negative weights ``(..., T)`` -> (uint8 codes ``(..., T)``, float32 scales ``(...)``), on their
    device: the scale is the row's maximum ``s`` and the codes ``round(a / s * 255)`` (0 where ``s == 0``), so
    ``c / 255 * s`` gives the weights back within ``s / 510`` and the maximum exactly (code 255)."""
    a = a.detach().float()
    s = a.amax(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s[..., None] > 0, torch.round(a / safe[..., None] * CODE_MAX), torch.zeros_like(a))
    return codes.clamp_(0, CODE_MAX).to(torch.uint8), s


def dequantise_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse of `quantise_rows` (as the report reads it): ``codes / 255 * scales`` per row, float32."""
    return codes.astype(np.float32) / np.float32(CODE_MAX) * scales[..., None].astype(np.float32)


def full_rollout(attns: list[torch.Tensor]) -> torch.Tensor:
    """``(B, L, T, T)`` float64: the rollout ``R_l = M_l R_{l-1}`` (``R_{-1} = I``) up to each of the blocks whose
    attention ``(B, H, T, T)`` is given in order from block 0, with ``M_l`` the heads' mean as 0.5 A + 0.5 I, rows
    renormalised (`vitscope.metrics.mechanistic.rollout_step`, as ``attention_rollout``), every token's row kept."""
    out, r = [], None
    for a in attns:
        m = M.rollout_step(M.fuse_heads(a.detach().double(), "mean"))
        r = m if r is None else torch.bmm(m, r)
        out.append(r)
    return torch.stack(out, 1)


@register_analysis
class AttentionExplorer(_KeptMaps):
    """The full attention of every query token, every chosen block and head, for a few kept images, stored in 8
    bits for the report's attention explorer (click a patch: its map at any block and head) [Walmer et al. 2023;
    Abnar and Zuidema 2020 for the rollout].

    Parameters: ``layers`` (the blocks, as the other attention analyses; default all); ``keep_images`` (how many
    images: those with the smallest dataset index, whatever the order of batches or shards; 0 keeps none, and the
    table is empty with that reason).

    Quantisation: each row ``a >= 0`` (one query's weights over all ``T`` keys, prefix tokens included) is kept as
    its scale ``s = max(a)`` (float32) and codes ``c = round(a / s * 255)`` (uint8; 0 where ``s == 0``); the
    weights are ``c / 255 * s`` within ``s / 510``, the largest one exactly. That is ``T*T + 4*T`` bytes per image,
    block and head (ViT-B/16 at 224: 39 KB; all 12 x 12 heads and the rollout 6 MB per image), quantised on the
    model's device; the state holds only the kept images' codes and scales.

    Rollout: per kept image and chosen block l, ``R_l = M_l M_{l-1} ... M_0`` with ``M_j`` the head mean of block
    j's attention (all tokens) as ``0.5 A + 0.5 I``, rows renormalised (``attention_rollout``'s convention). The
    product runs over every block from 0 to l, chosen or not (the rollout up to block l, as ``attention_rollout``
    computes it), so the analysis captures the attention of blocks 0 .. max(layers).

    Table (one row per item; ``value`` missing; every row carries ``grid_rows``, ``grid_cols`` (the patch grid),
    ``prefix_tokens`` (CLS and register tokens, first in T), ``cls_token`` (whether token 0 is a CLS token) and
    ``n_images``; spatial token t >= prefix_tokens is grid cell (r, c) with t - prefix_tokens = r * grid_cols + c):

    * ``attention``: per (image, layer): ``image`` (dataset index), ``heads`` H, ``tokens`` T, ``codes`` (bytes of
      uint8 (H, T, T), C order, [head, query, key]), ``scales`` (bytes of little-endian float32 (H, T));
    * ``rollout``: per (image, layer): ``codes`` uint8 (T, T), ``scales`` float32 (T,), ``tokens`` T, ``heads``
      missing;
    * ``pool_attention`` (a model with an attention pool only, the ``pool_attn`` tap): per image, ``layer`` missing,
      ``codes`` uint8 (H, Q, T), ``scales`` float32 (H, Q), ``heads`` H, ``queries`` Q, ``tokens`` T;
    * ``input_image``: per image, its ``png`` bytes (the image as the model saw it), as ``cls_attention_maps``.

    It feeds the report's attention explorer."""

    name = "attention_explorer"
    state_version = 1
    description = "every query's attention and rollout per block and head for a few images, 8-bit, for the explorer"

    def __init__(self, vm: Any, layers: Any = None, keep_images: NonNegative = 2):
        super().__init__(vm, layers)
        if isinstance(keep_images, bool) or not isinstance(keep_images, int) or keep_images < 0:
            raise ConfigError(f"{self.name}: keep_images must be an integer >= 0, got {keep_images!r}")
        self.keep_images = int(keep_images)
        if not self.keep_images:
            self.no_rows_because = "keep_images is 0, so no image's attention is kept"
        self.has_pool = bool(getattr(vm, "has_attention_pool", False))  # a ModelInfo (cached state): from the state
        self.kept_index = torch.zeros(0, dtype=torch.long)
        self.kept = self._empty_buffers()

    def _empty_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers of no image (their trailing shapes are set by the first images kept)."""
        return {k: torch.zeros(0, dtype=torch.uint8 if k.endswith(("codes", "pixels")) else torch.float32)
                for k in _BUFFERS}

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "keep_images": self.keep_images, "has_pool": self.has_pool}

    def required_taps(self) -> list[str]:
        if not self.keep_images:
            return []
        return [f"block{i}.attn" for i in range(max(self.layers) + 1)] + (["pool_attn"] if self.has_pool else [])

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.kept = self._empty_buffers()

    def _tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    def state_bytes(self, n_images: int) -> int:
        k, T, L, H = min(n_images, self.keep_images), self._tokens(), len(self.layers), self.num_heads
        per_image = (L * H + L) * (T * T + 4 * T) + 3 * (self.grid_size[0] * self.patch_size) * (
            self.grid_size[1] * self.patch_size)
        return k * per_image + 4096

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if not self.keep_images:
            self.n_images += len(batch)
            return
        self.pass_grid(batch)
        self.n_images += len(batch)
        first = feats["block0.attn"]
        # only the batch's images that can be kept are read (its keep_images smallest indices)
        take, index = smallest_distinct(batch.index.to(first.device, torch.long), self.keep_images)
        attns = [feats[f"block{i}.attn"].index_select(0, take) for i in range(max(self.layers) + 1)]
        codes, scales = quantise_rows(torch.stack([attns[i] for i in self.layers], 1))  # (k, L, H, T, T)
        rollout = full_rollout(attns)[:, self.layers]  # (k, L, T, T)
        r_codes, r_scales = quantise_rows(rollout.float())
        new = {"attn_codes": codes, "attn_scales": scales, "rollout_codes": r_codes, "rollout_scales": r_scales}
        if self.has_pool:
            new["pool_codes"], new["pool_scales"] = quantise_rows(feats["pool_attn"].index_select(0, take))
        else:
            new["pool_codes"] = torch.zeros(len(take), 0, dtype=torch.uint8, device=first.device)
            new["pool_scales"] = torch.zeros(len(take), 0, dtype=torch.float32, device=first.device)
        new["pixels"] = self._pixels(batch.images[take.to(batch.images.device)])
        self._keep_all(index, new)

    def _keep_all(self, index: torch.Tensor, new: Mapping[str, torch.Tensor]) -> None:
        """Keep the ``keep_images`` smallest distinct dataset indices among those kept and the new ones (on the
        new ones' device); the first images decide the buffers' trailing shapes."""
        if len(index) == 0:
            return
        if len(self.kept_index) == 0:
            self.kept = {k: torch.zeros(0, *new[k].shape[1:], dtype=new[k].dtype) for k in _BUFFERS}
        self.kept_index, rows = keep_smallest(self.keep_images, self.kept_index, [self.kept[k] for k in _BUFFERS],
                                              index, [new[k] for k in _BUFFERS])
        self.kept = dict(zip(_BUFFERS, rows, strict=True))

    def _kept_rows(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The kept indices and buffers on the CPU, without the rows that hold no image."""
        index, rows = valid_rows(self.kept_index, [self.kept[k] for k in _BUFFERS])
        return index, dict(zip(_BUFFERS, rows, strict=True))

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        assert isinstance(other, AttentionExplorer)
        self._check_grid_merge(other)
        self.n_images += other.n_images
        if len(other.kept_index):  # an empty part may hold buffers of another grid: nothing to add
            dev = other.kept_index.device
            self._keep_all(other.kept_index, {k: v.to(dev) for k, v in other.kept.items()})

    def state_dict(self) -> dict[str, Any]:
        index, kept = self._kept_rows()
        return {"layers": list(self.layers), "keep_images": self.keep_images, "has_pool": self.has_pool,
                "grid": list(self.grid_size), "n_images": self.n_images, "kept_index": index, **kept}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.has_pool = bool(state["has_pool"])
        theirs = {"layers": list(state["layers"]), "keep_images": int(state["keep_images"]),
                  "has_pool": self.has_pool}
        if theirs != self._settings():
            raise ConfigError(f"{self.name}: the saved state was computed with {theirs}, not {self._settings()}")
        self.n_images = int(state["n_images"])
        self.grid_size = (int(state["grid"][0]), int(state["grid"][1]))
        self.kept_index = state["kept_index"].clone()
        self.kept = {k: state[k].clone() for k in _BUFFERS}

    def _common(self) -> dict[str, Any]:
        """The columns every row carries: the grid and the prefix tokens (how T maps onto the grid)."""
        return {"grid_rows": int(self.grid_size[0]), "grid_cols": int(self.grid_size[1]),
                "prefix_tokens": int(self.num_prefix_tokens), "cls_token": bool(self.has_cls_token)}

    def finalize(self) -> pd.DataFrame:
        index, kept = self._kept_rows()
        rows: list[dict[str, Any]] = []
        T = self._tokens()
        for k, image in enumerate(index.tolist()):
            for j, layer in enumerate(self.layers):
                a, s = kept["attn_codes"][k, j], kept["attn_scales"][k, j]
                rows.append({"metric": "attention", "image": image, "layer": layer, "heads": int(a.shape[0]),
                             "tokens": T, "codes": _bytes(a), "scales": _bytes(s)})
                rows.append({"metric": "rollout", "image": image, "layer": layer, "heads": None, "tokens": T,
                             "codes": _bytes(kept["rollout_codes"][k, j]),
                             "scales": _bytes(kept["rollout_scales"][k, j])})
            if self.has_pool:
                p = kept["pool_codes"][k]
                rows.append({"metric": "pool_attention", "image": image, "layer": None, "heads": int(p.shape[0]),
                             "queries": int(p.shape[1]), "tokens": T, "codes": _bytes(p),
                             "scales": _bytes(kept["pool_scales"][k])})
            rows.append({"metric": "input_image", "image": image, "layer": None, "png": _png_bytes(kept["pixels"][k])})
        if not rows:
            return self._frame({"image": pd.array([], dtype="Int64"), "heads": pd.array([], dtype="Int64"),
                                "tokens": pd.array([], dtype="Int64"), "codes": [], "scales": [],
                                **{c: [] for c in self._common()}, "n_images": []})
        df = pd.DataFrame(rows)
        for c in ("image", "layer", "heads", "tokens", *(("queries",) if "queries" in df else ())):
            df[c] = pd.array([None if pd.isna(v) else int(v) for v in df[c]], dtype="Int64")
        df["value"] = float("nan")
        for c, v in self._common().items():
            df[c] = v
        df["n_images"] = self.n_images
        return self.tidy(cast(Any, df))


def _bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's values as C-order bytes (float32 little-endian, uint8 as is): what the report decodes."""
    arr = t.contiguous().numpy()
    if arr.dtype == np.float32:
        arr = arr.astype("<f4", copy=False)
    return arr.tobytes(order="C")
