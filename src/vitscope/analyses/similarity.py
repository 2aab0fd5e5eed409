"""Representation similarity: minibatch CKA from cached Gram matrices (math in `vitscope.metrics.cka`).

Per (tap, token view) only the n x n Gram of each minibatch of n images is kept (n = 32: 8 KB per
batch), grouped by image id so that two models fed the same images produce aligned Grams. Any pair of
taps, within a model or across models computed in separate runs, is then a reduction over batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.capture.taps import expand_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.metrics import cka as C


@register_analysis
class CKA(Analysis):
    """Minibatch linear CKA with the unbiased HSIC_1 [Nguyen et al. 2021; seed 000 eq. 3-4]
    between every pair of the requested taps, per token view; across models in `cross`."""

    name = "cka"
    description = "minibatch CKA (unbiased HSIC_1) between every pair of taps, within and across models"

    def __init__(self, vm: Any, taps: Any = "block*.out", views: Any = ("cls", "gap"), batch_size: int = 32):
        super().__init__(vm)
        self.taps = expand_taps(list(taps) if not isinstance(taps, str) else taps, self.depth)
        views = [views] if isinstance(views, str) else list(views)
        if not self.has_cls_token:
            views = [v for v in views if v != "cls"]
        self.views = views
        self.batch_size = int(batch_size)
        if self.batch_size < C.MIN_HSIC1_EXAMPLES:
            raise ValueError(f"cka batch_size must be at least {C.MIN_HSIC1_EXAMPLES}")
        self.grams: dict[str, list[torch.Tensor]] = {v: [] for v in self.views}  # view -> [(A, n, n)]
        self.gram_ids: list[torch.Tensor] = []  # image ids of each Gram batch, in order
        # rows of the open (not yet full) group, per view and tap; bounded by batch_size - 1 rows
        self.pending: dict[str, list[torch.Tensor]] = {}
        self.pending_ids = torch.empty(0, dtype=torch.long)
        self.ref: dict[str, list[torch.Tensor]] = {}  # view -> per-tap reference mean (first batch)

    def required_taps(self) -> list[str]:
        return list(self.taps)

    def _pooled(self, feats: Mapping[str, torch.Tensor], view: str) -> list[torch.Tensor]:
        out = []
        for t in self.taps:
            x = feats[t]
            if x.ndim == 3:
                x = token_view(x, view, self.num_prefix_tokens, self.has_cls_token)
            out.append(x.reshape(x.shape[0], -1).float().cpu())
        return out

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        for v in self.views:
            pooled = self._pooled(feats, v)
            if v not in self.ref:
                self.ref[v] = [p.mean(0) for p in pooled]
            old = self.pending.get(v)
            self.pending[v] = pooled if old is None else [torch.cat([o, p]) for o, p in zip(old, pooled, strict=True)]
        self.pending_ids = torch.cat([self.pending_ids, batch.index.cpu().long()])
        self.n_images += len(batch)
        self._close_groups(final=False)

    def _close_groups(self, final: bool) -> None:
        """Turn every full group of ``batch_size`` pending rows into Grams (and the rest too if final)."""
        n = self.batch_size
        while len(self.pending_ids) >= n or (final and len(self.pending_ids) > 0):
            take = min(n, len(self.pending_ids))
            for v in self.views:
                rows = self.pending[v]
                self.grams[v].append(torch.stack([C.gram_linear(r[:take], self.ref[v][a])
                                                  for a, r in enumerate(rows)]))
                self.pending[v] = [r[take:] for r in rows]
            self.gram_ids.append(self.pending_ids[:take])
            self.pending_ids = self.pending_ids[take:]
        if len(self.pending_ids) == 0:
            self.pending = {}

    def merge(self, other: Analysis) -> None:
        """Append another part's Grams (a shard, or a resumed part). Open groups are closed first, so a
        part's last partial group becomes a smaller CKA batch of its own."""
        assert isinstance(other, CKA) and other.taps == self.taps and other.views == self.views
        other = other._finished()
        self._close_groups(final=True)
        for v in self.views:
            self.grams[v].extend(other.grams[v])
        self.gram_ids.extend(other.gram_ids)
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"taps": list(self.taps), "views": list(self.views), "batch_size": self.batch_size,
                "n_images": self.n_images, "grams": {v: list(g) for v, g in self.grams.items()},
                "gram_ids": list(self.gram_ids), "ref": {v: list(r) for v, r in self.ref.items()},
                "pending": {v: list(p) for v, p in self.pending.items()}, "pending_ids": self.pending_ids}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.taps, self.views = list(state["taps"]), list(state["views"])
        self.batch_size, self.n_images = int(state["batch_size"]), int(state["n_images"])
        self.grams = {v: list(g) for v, g in state["grams"].items()}
        self.gram_ids = list(state["gram_ids"])
        self.ref = {v: list(r) for v, r in state["ref"].items()}
        self.pending = {v: list(p) for v, p in state["pending"].items()}
        self.pending_ids = state["pending_ids"]

    def _finished(self) -> CKA:
        done = object.__new__(CKA)
        done.__dict__.update(self.__dict__)
        done.load_state_dict(self.state_dict())
        done._close_groups(final=True)
        return done

    def matrix(self, view: str, other: CKA | None = None) -> torch.Tensor:
        """(A, A') CKA between this model's taps and ``other``'s (itself if None) for one view."""
        a = self._finished()
        b = a if other is None else other._finished()
        if other is not None and not _aligned(a.gram_ids, b.gram_ids):
            raise ValueError(f"{self.model_name} and {other.model_name} saw different images or batches; "
                             "cross-model CKA needs the same images in the same CKA batches")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if other is not None else "default")
            return C.cka_from_gram_list(a.grams[view], None if other is None else b.grams[view])

    def finalize(self) -> pd.DataFrame:
        return self._rows(None)

    def _rows(self, other: CKA | None) -> pd.DataFrame:
        b = other or self
        rows = []
        for v in self.views:
            if v not in b.views:
                continue
            m = self.matrix(v, other).numpy()
            for i, ta in enumerate(self.taps):
                for j, tb in enumerate(b.taps):
                    rows.append({"metric": "cka_minibatch", "layer": parse_tap(ta)[0], "token_view": v,
                                 "tap": ta, "model_b": b.model_name, "layer_b": parse_tap(tb)[0], "tap_b": tb,
                                 "value": float(m[i, j])})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        df["batch_size"] = self.batch_size
        return df

    @classmethod
    def cross(cls, analyses: list[Analysis]) -> pd.DataFrame | None:
        frames = []
        for i, a in enumerate(analyses):
            for b in analyses[i + 1:]:
                assert isinstance(a, CKA) and isinstance(b, CKA)
                try:
                    frames.append(a._rows(b))
                except ValueError as e:
                    warnings.warn(str(e), stacklevel=2)
        return pd.concat(frames, ignore_index=True) if frames else None


def _aligned(ids_a: list[torch.Tensor], ids_b: list[torch.Tensor]) -> bool:
    return len(ids_a) == len(ids_b) and all(torch.equal(x, y) for x, y in zip(ids_a, ids_b, strict=True))
