"""Geometry of representations per layer (math in `vitscope.metrics.geometry`): how much volume tokens and
images occupy, and how much high-frequency amplitude the token maps carry [seed 001]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.capture.taps import expand_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.metrics import geometry as G


class _PerTap(Analysis):
    """Shared plumbing: per-tap float64 sums, merged by addition."""

    _sums: tuple[str, ...] = ()

    def __init__(self, vm: Any, taps: Any = "block*.out"):
        super().__init__(vm)
        self.taps = expand_taps(list(taps) if not isinstance(taps, str) else taps, self.depth)

    def required_taps(self) -> list[str]:
        return list(self.taps)

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, type(self)) and other.taps == self.taps
        for k in self._sums:
            mine, theirs = getattr(self, k), getattr(other, k)
            setattr(self, k, {t: mine[t] + theirs[t] for t in mine} if isinstance(mine, dict) else mine + theirs)
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"taps": list(self.taps), "n_images": self.n_images,
                **{k: {t: v.clone() for t, v in getattr(self, k).items()} for k in self._sums}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.taps, self.n_images = list(state["taps"]), int(state["n_images"])
        for k in self._sums:
            setattr(self, k, {t: v.clone() for t, v in state[k].items()})


@register_analysis
class SVDVolume(_PerTap):
    """Volume occupied by tokens and images, per layer [seed 001 "SVD analysis"]: token level, the log
    eigenvalues of the covariance of each image's patch tokens, averaged over images; image level, the log
    eigenvalues of the covariance of the images' pooled patch tokens (GAP without prefix), from streamed
    moments. Rows: the spectra (``index`` = rank of the eigenvalue) and ``*_log_volume`` = their mean over
    the top ``k`` eigenvalues (a larger volume = representations spread over more directions)."""

    name = "svd_volume"
    description = "token- and image-level covariance spectra (log eigenvalues) per layer"
    _sums = ("tok", "sx", "sxx")

    def __init__(self, vm: Any, taps: Any = "block*.out", k: int = 32):
        super().__init__(vm, taps)
        self.k = int(k)
        self.tok: dict[str, torch.Tensor] = {}
        self.sx: dict[str, torch.Tensor] = {}
        self.sxx: dict[str, torch.Tensor] = {}

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        for t in self.taps:
            spatial = token_view(feats[t], "spatial", self.num_prefix_tokens, self.has_cls_token)
            tok = G.token_log_spectrum(spatial).sum(0)
            pooled = spatial.double().mean(1)
            self.tok[t] = self.tok[t] + tok if t in self.tok else tok
            self.sx[t] = self.sx[t] + pooled.sum(0) if t in self.sx else pooled.sum(0)
            self.sxx[t] = self.sxx[t] + pooled.T @ pooled if t in self.sxx else pooled.T @ pooled
        self.n_images += len(batch)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "k": self.k}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.k = int(state["k"])

    def finalize(self) -> pd.DataFrame:
        rows = []
        for t in self.taps:
            layer = parse_tap(t)[0]
            tok = (self.tok[t] / self.n_images).tolist()
            img = G.spectrum_from_moments(self.sx[t], self.sxx[t], self.n_images).clamp_min(G.EPS).log().tolist()
            for level, spec in (("token", tok), ("image", img)):
                for i, v in enumerate(spec):
                    rows.append({"metric": f"{level}_log_eigenvalue", "layer": layer, "tap": t, "index": i,
                                 "value": v})
                top = spec[: self.k]
                rows.append({"metric": f"{level}_log_volume", "layer": layer, "tap": t, "index": None,
                             "value": sum(top) / len(top)})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df


@register_analysis
class Fourier(_PerTap):
    """Fourier analysis of token maps per layer [seed 001; Park & Kim 2022]: patch tokens as (D, h, w)
    maps, 2-D FFT per channel, log amplitude averaged over channels and images; Δ log amplitude = log A(f)
    - log A(0) along the diagonal from the centre. Rows: the whole curve (``freq`` in units of π) and
    ``high_freq_delta_log_amp`` at the highest frequency (closer to 0 = more high-frequency content)."""

    name = "fourier"
    description = "relative log amplitude of token maps vs spatial frequency, per layer"
    _sums = ("amp",)

    def __init__(self, vm: Any, taps: Any = "block*.out"):
        super().__init__(vm, taps)
        self.amp: dict[str, torch.Tensor] = {}

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        for t in self.taps:
            spatial = token_view(feats[t], "spatial", self.num_prefix_tokens, self.has_cls_token)
            a = G.log_amplitude_map(spatial, self.grid_size).sum(0)
            self.amp[t] = self.amp[t] + a if t in self.amp else a
        self.n_images += len(batch)

    def finalize(self) -> pd.DataFrame:
        rows = []
        for t in self.taps:
            layer = parse_tap(t)[0]
            freq, delta = G.diagonal_profile(self.amp[t] / self.n_images)
            for f, d in zip(freq.tolist(), delta.tolist(), strict=True):
                rows.append({"metric": "delta_log_amp", "layer": layer, "tap": t, "freq": f, "value": d})
            rows.append({"metric": "high_freq_delta_log_amp", "layer": layer, "tap": t, "freq": float(freq[-1]),
                         "value": float(delta[-1])})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df
