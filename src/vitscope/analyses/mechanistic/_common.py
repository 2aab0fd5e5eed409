"""Shared plumbing of the mechanistic lens (`vitscope.analyses.mechanistic`): streamed means over images
(`_Means`) and the base class of its analyses (`_Mechanistic`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from vitscope.analyses.attention import Z95, stderr_from_sums
from vitscope.analyses.base import Analysis
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, on_device


class _Means:
    """Streamed means over images of a ``shape``-d statistic: float64 sums, sums of squares and counts, kept on
    the device of the values they are given (moved there at the first `add` after a load or a merge)."""

    def __init__(self, *shape: int):
        self.sum = torch.zeros(shape, dtype=torch.float64)
        self.sumsq = torch.zeros(shape, dtype=torch.float64)
        self.count = torch.zeros(shape, dtype=torch.float64)

    def to(self, device: torch.device) -> None:
        """Move the sums to ``device`` (where the next values are)."""
        self.sum, self.sumsq, self.count = (on_device(t, device) for t in (self.sum, self.sumsq, self.count))

    def add(self, values: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Values ``(B, *shape)``; ``ok`` (same shape, bool) selects those that count (NaN never does)."""
        v = values.double()
        self.to(v.device)
        ok = ~torch.isnan(v) if ok is None else on_device(ok, v.device) & ~torch.isnan(v)
        v = torch.where(ok, v, 0.0)
        self.sum += v.sum(0)
        self.sumsq += v.square().sum(0)
        self.count += ok.sum(0)

    def merge(self, other: _Means) -> None:
        """Add ``other``'s sums (moved to this one's device)."""
        dev = self.sum.device
        self.sum += on_device(other.sum, dev)
        self.sumsq += on_device(other.sumsq, dev)
        self.count += on_device(other.count, dev)

    def state(self) -> dict[str, torch.Tensor]:
        return {"sum": host_copy(self.sum), "sumsq": host_copy(self.sumsq), "count": host_copy(self.count)}

    @classmethod
    def of_values(cls, values: torch.Tensor) -> _Means:
        """The means of ``(n,)`` values (a scalar statistic)."""
        m = cls()
        m.add(values)
        return m

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> _Means:
        m = cls(0)
        m.sum, m.sumsq, m.count = (state[k].clone() for k in ("sum", "sumsq", "count"))
        return m

    def row(self, *idx: int) -> dict[str, float]:
        """``value`` (mean; NaN without values), ``stderr`` and the 95 % interval of one entry, with ``n``."""
        s, q, n = float(self.sum[idx]), float(self.sumsq[idx]), int(self.count[idx])
        v = s / n if n else float("nan")
        se = float(stderr_from_sums(torch.tensor(s), torch.tensor(q), n))
        return {"value": v, "stderr": se, "value_lo": v - Z95 * se, "value_hi": v + Z95 * se, "n": n}


class _Mechanistic(Analysis):
    """Shared plumbing: settings that must agree to merge, and the tensors of the state. The sums (``_MEANS``,
    ``_TENSORS``, and ``_ON_DEVICE``: state a batch reads, not summed) live on the features' device between
    batches (`_to_device` at each update); ``state_dict`` hands out CPU copies."""

    in_default_study = False

    _MEANS: tuple[str, ...] = ()
    _TENSORS: tuple[str, ...] = ()
    _ON_DEVICE: tuple[str, ...] = ()

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers)}

    def _check_mergeable(self, other: Analysis) -> None:
        if type(other) is not type(self):
            raise VitscopeError(f"{self.name}: cannot merge a {type(other).__name__} into a {type(self).__name__}")
        mine, theirs = self._settings(), cast(_Mechanistic, other)._settings()
        if mine != theirs:
            raise VitscopeError(f"{self.name}: cannot merge parts computed with different settings: {mine} vs {theirs}")

    def _to_device(self, device: torch.device) -> None:
        """Move the state's sums to ``device`` (the incoming features'): a no-op after the first batch."""
        for k in self._MEANS:
            getattr(self, k).to(device)
        for k in (*self._TENSORS, *self._ON_DEVICE):
            setattr(self, k, on_device(getattr(self, k), device))

    def _add_tensors(self, other: _Mechanistic, names: Sequence[str]) -> None:
        """Add ``other``'s tensors ``names`` to this one's (moved to this one's device)."""
        for k in names:
            mine = getattr(self, k)
            mine.add_(on_device(getattr(other, k), mine.device))

    def merge(self, other: Analysis) -> None:
        self._check_mergeable(other)
        self._check_grid_merge(other)
        for k in self._MEANS:
            getattr(self, k).merge(getattr(other, k))
        self._add_tensors(cast(_Mechanistic, other), self._TENSORS)
        self.n_images += other.n_images
        self.n_masked += other.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {"settings": self._settings(), "grid": list(self.grid_size), "n_images": self.n_images,
                "n_masked": self.n_masked, **{k: getattr(self, k).state() for k in self._MEANS},
                **{k: host_copy(getattr(self, k)) for k in self._TENSORS}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k, v in state["settings"].items():
            setattr(self, k, v)
        self.grid_size = tuple(int(v) for v in state["grid"])
        self.n_images, self.n_masked = int(state["n_images"]), int(state["n_masked"])
        for k in self._MEANS:
            setattr(self, k, _Means.of(state[k]))
        for k in self._TENSORS:
            setattr(self, k, state[k].clone())
