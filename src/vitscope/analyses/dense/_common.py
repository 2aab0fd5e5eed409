"""What the dense tasks share (`vitscope.analyses.dense`): the `_Dense` plumbing (layers, taps, L2-normalised
patch features, tiled items, the protocol columns, skip accounting, best-layer rows) and the intervals of their
scores (`best_interval`, `_interval`).
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

from vitscope.analyses.base import Analysis
from vitscope.capture.views import token_view
from vitscope.data.tiling import assemble
from vitscope.errors import VitscopeError
from vitscope.metrics import dense as D
from vitscope.metrics import intervals as I


class _Dense(Analysis):
    """Shared plumbing: layers, taps, patch features, skip accounting, best-layer rows."""

    headline: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, vm: Any, layers: Any = None, final_norm: bool = True, random_baseline: bool = False):
        super().__init__(vm)
        self.random_baseline = bool(random_baseline)
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
        variant = self._variant_rows()
        if variant:  # only where a non-default variant ran: a default table keeps its columns
            df["variant"] = "; ".join(variant)
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

    def _patch_features(self, feats: Mapping[str, torch.Tensor], grid: tuple[int, int], index: Any = None
                        ) -> torch.Tensor:
        """(B, L, S, D) L2-normalised patch tokens of every layer; with ``random_baseline`` one more feature set
        after the layers: the images' Gaussian random tokens (`_random_tokens`; ``index``: the images' dataset
        indices)."""
        x = torch.stack([token_view(feats[t], "spatial", self.num_prefix_tokens) for t in self.required_taps()], 1)
        s = grid[0] * grid[1]
        if x.shape[2] != s:
            raise VitscopeError(f"{self.name}: {x.shape[2]} patch tokens per image, expected {s} for the grid "
                                f"{grid}")
        if self.random_baseline:
            noise = self._random_tokens(index, 1 + s, x.shape[-1], x.device)[:, 1:]
            x = torch.cat([x.float(), noise[:, None]], 1)
        return F.normalize(x.float(), dim=-1)

    def _random_tokens(self, index: Any, tokens: int, dim: int, device: torch.device) -> torch.Tensor:
        """(B, tokens, D) the "random" baseline's features (Walmer et al. 2023, Tables 1 and 5): per image N(0, 1)
        per token and channel, seeded by the image's dataset index (`vitscope.metrics.dense.gaussian_features`),
        so they are the same in every model, shard and resume; drawn on the CPU, copied to ``device`` at once.
        Token 0 stands for the prefix (CLS) token and the last ``tokens - 1`` for the patch tokens."""
        if index is None:
            raise VitscopeError(f"{self.name}: random_baseline needs the images' dataset indices (batch.index)")
        ids = index.tolist() if torch.is_tensor(index) else [int(i) for i in index]
        noise = torch.stack([D.gaussian_features(i, (tokens, dim)) for i in ids])
        return noise.to(device, non_blocking=True)

    def _variant_rows(self) -> list[str]:
        """Which of the source's variants ran, for the table's ``variant`` column (read by the report's notes)."""
        return ["random = Gaussian features (per image, seeded by its id)"] if self.random_baseline else []

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
            x = self._patch_features(feats, grid, batch.index)
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
            x = torch.stack(grids).flatten(1, 2).float()
            if self.random_baseline:  # one Gaussian map for the whole assembled grid, as an untiled image's
                s = plan.grid[0] * plan.grid[1]
                x = torch.cat([x, self._random_tokens([int(item["index"])], 1 + s, x.shape[-1], x.device)[:, 1:]])
            yield F.normalize(x, dim=-1), plan.grid, item

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
        rand = [r["value"] for r in rows if r["metric"] == f"{metric}_random"
                and r.get("token_view") == best.get("token_view") and r.get("category") is None
                and r.get("video") is None]
        return [{"metric": f"best_{metric}", "layer": best["layer"], "token_view": best.get("token_view"),
                 "value": best["value"], "stderr": best.get("stderr", float("nan")), "value_lo": lo, "value_hi": hi,
                 "interval_units": best.get("interval_units"), "chance": chance[0] if chance else float("nan"),
                 "last_layer_value": last[0] if last else float("nan"), "task": self.name,
                 **({"random_features": rand[0]} if rand else {})}]


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
