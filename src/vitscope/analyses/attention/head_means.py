"""Per-head means over images of each layer's attention: attention distance and attention NMI
(`vitscope.analyses.attention`).
"""

from __future__ import annotations

import pandas as pd
import torch

from vitscope.analyses.attention._common import (
    _nmi,
    _PerHeadMean,
    _Spatial,
)
from vitscope.analyses.base import register_analysis
from vitscope.metrics import attention as A


@register_analysis
class AttentionDistance(_PerHeadMean):
    """Average attention distance per layer and head [Walmer et al. 2023 §4.3; Park et al. 2023]:
    for each spatial query, sum_k A_qk * ||pos_q - pos_k|| over spatial keys (prefix keys dropped,
    rows renormalised), positions on the unit square; mean over queries and images. Reported in
    unit-square units (``distance``) and in pixels (``distance_px``), each with its standard error over
    images (``stderr``) and 95 % interval (``value_lo``, ``value_hi``). The reference: ``distance_uniform`` and
    ``distance_px_uniform`` (no layer nor head), the distance of uniform attention on the same grid (every query
    attending to every spatial key alike: the mean distance between two grid positions), the level of attention
    with no preference for near or far."""

    name = "attention_distance"
    description = "mean attention distance per layer and head"
    state_version = 3  # 3: the uniform-attention reference rows; 2: sums of squares (stderr over images)

    def batch_values(self, sps: list[_Spatial]) -> torch.Tensor:
        return torch.stack([sp.image_distance(self.grid_size) for sp in sps])

    def finalize(self) -> pd.DataFrame:
        mean, se = self.mean(), self.stderr()
        px = A.distance_in_pixels(1.0, self.grid_size, self.patch_size)
        rows = self._stat_rows("distance", mean, se) + self._stat_rows("distance_px", mean * px, se * px)
        S = self.grid_size[0] * self.grid_size[1]
        uniform = float(A.distance_of_spatial(torch.full((S, S), 1.0 / S, dtype=torch.float64), self.grid_size))
        rows += [{"metric": "distance_uniform", "layer": None, "head": None, "value": uniform},
                 {"metric": "distance_px_uniform", "layer": None, "head": None, "value": uniform * px}]
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df


@register_analysis
class AttentionNMI(_PerHeadMean):
    """Attention collapse as the normalised mutual information NMI(q, k) between spatial queries and
    keys, per layer and head [Park et al. 2023, "attention collapse"]: p(q) uniform over the
    spatial queries, p(k|q) the renormalised spatial attention; NMI = MI / sqrt(H(q) H(k)), computed per
    image and averaged over images. Near 0: every query attends alike (collapse); 1: one-to-one.

    Table: metric ``nmi`` per (layer, head), extra columns ``stderr`` (over images), ``value_lo``,
    ``value_hi`` (95 % interval) and ``n_images``."""

    name = "attention_nmi"
    description = "NMI between spatial queries and keys per layer and head (attention collapse)"

    def batch_values(self, sps: list[_Spatial]) -> torch.Tensor:
        return _nmi(sps)

    def finalize(self) -> pd.DataFrame:
        mean = self.mean() if self.n_images else torch.full_like(self.sums, float("nan"))
        df = self.tidy(self._stat_rows("nmi", mean, self.stderr()))
        df["n_images"] = self.n_images
        return df
