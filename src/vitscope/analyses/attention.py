"""Attention analyses, streamed over the ``block{i}.attn`` taps (math in `vitscope.metrics.attention`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.metrics import attention as A


@register_analysis
class AttentionDistance(Analysis):
    """Average attention distance per layer and head [Walmer et al. 2023 §4.3; Park et al. 2023]:
    for each spatial query, sum_k A_qk * ||pos_q - pos_k|| over spatial keys (prefix keys dropped,
    rows renormalised), positions on the unit square; mean over queries and images. Reported in
    unit-square units (``distance``) and in pixels (``distance_px``)."""

    name = "attention_distance"
    description = "mean attention distance per layer and head"

    def __init__(self, vm: Any, layers: Any = None):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        self.sums = torch.zeros(len(self.layers), self.num_heads, dtype=torch.float64)

    def required_taps(self) -> list[str]:
        return [f"block{i}.attn" for i in self.layers]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        for j, i in enumerate(self.layers):
            d = A.attention_distance(feats[f"block{i}.attn"], self.grid_size, self.num_prefix_tokens)
            self.sums[j] += d.double().sum(0).cpu()
        self.n_images += len(batch)

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, AttentionDistance) and other.layers == self.layers
        self.sums += other.sums
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "sums": self.sums.clone(), "n_images": self.n_images}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.sums, self.n_images = list(state["layers"]), state["sums"].clone(), state["n_images"]

    def finalize(self) -> pd.DataFrame:
        mean = (self.sums / max(self.n_images, 1)).numpy()
        px = A.distance_in_pixels(torch.from_numpy(mean), self.grid_size, self.patch_size).numpy()
        rows = []
        for j, i in enumerate(self.layers):
            for h in range(self.num_heads):
                rows.append({"metric": "distance", "layer": i, "head": h, "value": float(mean[j, h])})
                rows.append({"metric": "distance_px", "layer": i, "head": h, "value": float(px[j, h])})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df
