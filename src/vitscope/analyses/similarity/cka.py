"""The CKA analyses on kept minibatch Grams (`vitscope.analyses.similarity.grams`):

  cka            every pair of the requested taps per token view, within the model; across models in `cross`
                 (with `cka_divergence` = 1 - CKA for the same tap in two models, Merlin et al. 2023 eq. 4)
  residual_cka   skip path (block input) vs branch outputs (attn_out, mlp_out), all block pairs (Walmer et al. 2023 D.4)

and their interval (`_with_interval`: value ± t(units - 1) stderr).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis, views_with_cls
from vitscope.analyses.similarity.grams import CkaBatch, GramGroups, _host_split
from vitscope.capture.taps import expand_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.metrics import cka as C
from vitscope.metrics.intervals import t_quantile


class _GramAnalysis(Analysis):
    """Shared plumbing: a `GramGroups`, Grams kept per stream and batch, merge by concatenation."""

    def __init__(self, vm: Any, batch_size: CkaBatch = 32):
        super().__init__(vm)
        self.batch_size = int(batch_size)
        self.groups = GramGroups(self.batch_size)
        self.grams: dict[str, list[torch.Tensor]] = {}  # stream -> one (n, n) Gram per CKA batch
        self.gram_ids: list[torch.Tensor] = []

    def _streams(self, feats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_bytes(self, n_images: int) -> int:
        """A float32 Gram of ``batch_size`` x ``batch_size`` per group and stream, plus the features of the last,
        open group (``n_images`` not a multiple of ``batch_size``), which the finished state keeps."""
        taps, views = len(self.required_taps()), list(getattr(self, "views", ["all"]))
        tokens = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        width = sum((self.embed_dim or 0) * (tokens if v in ("all", "spatial") else 1) for v in views)
        return 4 * taps * (n_images * self.batch_size * len(views) + (n_images % self.batch_size) * width)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self._store(self.groups.add(self._streams(feats), batch.index, batch.extra.get("position")))
        self.n_images += len(batch)

    def _store(self, closed: list[tuple[torch.Tensor, dict]]) -> None:
        for ids, grams in closed:
            for k, g in grams.items():
                self.grams.setdefault(k, []).append(g)
            self.gram_ids.append(ids)

    def merge(self, other: Analysis) -> None:
        """Append another part (a shard, a resumed part). Open groups are closed first: a part's last
        partial group becomes a smaller CKA batch of its own."""
        assert isinstance(other, type(self))
        other = other._finished()
        self._store(self.groups.flush())
        for k, gs in other.grams.items():
            self.grams.setdefault(k, []).extend(gs)
        self.gram_ids.extend(other.gram_ids)
        self.n_images += other.n_images

    def _finished(self) -> _GramAnalysis:
        """A copy with the open group closed, its Grams on the host (where the CKA tables are reduced)."""
        done = copy.copy(self)
        done.load_state_dict(self.state_dict())
        done._store(done.groups.flush())
        return done

    def state_dict(self) -> dict[str, Any]:
        """CPU tensors: the Grams (kept on the features' device during the pass) copied in one transfer."""
        keys = list(self.grams)
        moved = _host_split(*(self.grams[k] for k in keys))
        return {"batch_size": self.batch_size, "n_images": self.n_images, "groups": self.groups.state_dict(),
                "grams": dict(zip(keys, moved, strict=True)), "gram_ids": list(self.gram_ids)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch_size, self.n_images = int(state["batch_size"]), int(state["n_images"])
        self.groups = GramGroups(self.batch_size)
        self.groups.load_state_dict(state["groups"])
        self.grams = {k: list(v) for k, v in state["grams"].items()}
        self.gram_ids = list(state["gram_ids"])

    def n_batches(self) -> int:
        """The minibatches the CKA estimate and its standard error average (at least 4 images each)."""
        done = self._finished()
        first = next(iter(done.grams.values()), [])
        return sum(1 for g in first if int(g.shape[-1]) >= C.MIN_HSIC1_EXAMPLES)

    def cka_matrix(self, keys_a: list[str], keys_b: list[str] | None = None,
                   other: _GramAnalysis | None = None, stderr: bool = False) -> torch.Tensor:
        """(A, B) minibatch CKA between streams ``keys_a`` of this model and ``keys_b`` of ``other`` (this
        model if None): one batched reduction for the whole grid, self-HSICs computed once per stream.
        ``stderr``: its standard error instead, by batch means (`cka_stderr_from_gram_streams`)."""
        a = self._finished()
        b = a if other is None else other._finished()
        order = list(range(len(a.gram_ids)))
        if other is not None:
            order = _alignment(a.gram_ids, b.gram_ids)
            if order is None:
                raise ValueError(f"{self.model_name} and {other.model_name} saw different images or batches; "
                                 "cross-model CKA needs the same images in the same CKA batches")
        streams_b = None
        if keys_b is not None or other is not None:
            streams_b = [[b.grams[k][i] for i in order] for k in (keys_b or keys_a)]
        fn = C.cka_stderr_from_gram_streams if stderr else C.cka_from_gram_streams
        return fn([a.grams[k] for k in keys_a], streams_b)


def _alignment(ids_a: list[torch.Tensor], ids_b: list[torch.Tensor]) -> list[int] | None:
    """For each CKA batch of A, the index of B's batch with the same image ids (batches may arrive in any
    order: shards, resumed parts). None if the two did not see the same batches."""
    where = {tuple(ids.tolist()): i for i, ids in enumerate(ids_b)}
    order = [where.get(tuple(ids.tolist()), -1) for ids in ids_a]
    if len(ids_a) != len(ids_b) or -1 in order:
        return None
    return order


def _key(view: str, tap: str) -> str:
    return f"{view}|{tap}"


def _with_interval(value: float, stderr: float, units: int) -> dict[str, float]:
    """``value``, ``stderr`` and the 95 % interval ``value ± t(units - 1) stderr``: the standard error is estimated
    from ``units`` batch means (CKA's minibatches) or values (images), so Student's t, not 1.96 (at 16 minibatches
    1.96 covered 92 %; benchmarks/calibration.py)."""
    half = t_quantile(units - 1) * stderr
    return {"value": value, "stderr": stderr, "value_lo": value - half, "value_hi": value + half}


@register_analysis
class CKA(_GramAnalysis):
    """Minibatch linear CKA with the unbiased HSIC_1 [Nguyen et al. 2021; Shekhar et al. 2022 eq. 3-4; Walmer et al.
    2023 D.1] between every pair of the requested taps (block outputs by default; any taps, e.g. ``block*.norm1``,
    ``block*.qkv``, ``block*.fc1`` for the sub-layer grids of Shekhar et al. 2022 Fig. 2), per token view ('cls',
    'gap', 'gap_spatial', 'spatial' or 'all' = tokens flattened, Walmer et al. 2023 Fig. 6, 19). Across models
    (`cross`): model A x model B grids and, for taps present in both, ``cka_divergence`` = 1 - CKA
    (Merlin et al. 2023 eq. 4: pretrained vs fine-tuned). Every value carries ``stderr``, the spread of the
    per-minibatch CKA over the minibatches (batch means, `metrics.cka.cka_stderr_from_gram_streams`), and the
    95 % interval ``value_lo``, ``value_hi`` = value ± t(B - 1) stderr over the B minibatches (Student's t: the
    standard error rests on B batch means; benchmarks/calibration.py)."""

    name = "cka"
    state_version = 3  # 3: t intervals (minibatches - 1 degrees of freedom); 2: stderr columns
    description = "minibatch CKA (unbiased HSIC_1) between every pair of taps, within and across models"

    def __init__(self, vm: Any, taps: str | Sequence[str] = "block*.out",
                 views: str | Sequence[str] = ("cls", "gap"), batch_size: CkaBatch = 32):
        super().__init__(vm, batch_size)
        self.taps = expand_taps(list(taps) if not isinstance(taps, str) else taps, self.depth)
        self.views = views_with_cls(self, views)

    def required_taps(self) -> list[str]:
        return list(self.taps)

    def _streams(self, feats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for v in self.views:
            for t in self.taps:
                x = feats[t]
                out[_key(v, t)] = token_view(x, v, self.num_prefix_tokens, self.has_cls_token) if x.ndim == 3 else x
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "taps": list(self.taps), "views": list(self.views)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.taps, self.views = list(state["taps"]), list(state["views"])

    def matrix(self, view: str, other: CKA | None = None, stderr: bool = False) -> torch.Tensor:
        """(A, A') CKA between this model's taps and ``other``'s (itself if None) for one view (its standard
        error with ``stderr``)."""
        keys_b = None if other is None else [_key(view, t) for t in other.taps]
        return self.cka_matrix([_key(view, t) for t in self.taps], keys_b, other, stderr=stderr)

    def finalize(self) -> pd.DataFrame:
        return self._rows(None)

    def _rows(self, other: CKA | None) -> pd.DataFrame:
        b = other or self
        rows = []
        units = self.n_batches()
        for v in self.views:
            if v not in b.views:
                continue
            m = self.matrix(v, other).numpy()
            se = self.matrix(v, other, stderr=True).numpy()
            for i, ta in enumerate(self.taps):
                for j, tb in enumerate(b.taps):
                    row = {"layer": parse_tap(ta)[0], "token_view": v, "tap": ta, "model_b": b.model_name,
                           "layer_b": parse_tap(tb)[0], "tap_b": tb}
                    rows.append({**row, "metric": "cka_minibatch",
                                 **_with_interval(float(m[i, j]), float(se[i, j]), units)})
                    if other is not None and ta == tb:
                        rows.append({**row, "metric": "cka_divergence",
                                     **_with_interval(1.0 - float(m[i, j]), float(se[i, j]), units)})
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


@register_analysis
class ResidualCKA(_GramAnalysis):
    """Residual-connection CKA [Walmer et al. 2023 D.4, Fig. 23]: for every pair of blocks (i, j), CKA between the
    skip path entering block i (``embed`` for block 0, else ``block{i-1}.out``) and the branch outputs of
    block j as added to the residual stream (``attn_out``, ``mlp_out``), all from the one forward pass.
    A small diagonal means the branch writes something new; a large one, that it mostly echoes the skip."""

    name = "residual_cka"
    state_version = 3  # 3: t intervals, as `cka`; 2: stderr columns (batch means, as `cka`)
    description = "CKA between the skip path and the attention / MLP branch outputs, every pair of blocks"

    def __init__(self, vm: Any, views: str | Sequence[str] = ("cls", "gap_spatial"), batch_size: CkaBatch = 32):
        super().__init__(vm, batch_size)
        self.views = views_with_cls(self, views)

    def _skip_taps(self) -> list[str]:
        return ["embed"] + [f"block{i}.out" for i in range(self.depth - 1)]

    def required_taps(self) -> list[str]:
        return self._skip_taps() + [f"block{i}.{b}" for b in ("attn_out", "mlp_out") for i in range(self.depth)]

    def _streams(self, feats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_key(v, t): token_view(feats[t], v, self.num_prefix_tokens, self.has_cls_token)
                for v in self.views for t in self.required_taps()}

    def finalize(self) -> pd.DataFrame:
        rows = []
        skips = self._skip_taps()
        units = self.n_batches()
        for v in self.views:
            for branch in ("attn_out", "mlp_out"):
                branches = [f"block{j}.{branch}" for j in range(self.depth)]
                keys = [_key(v, t) for t in skips], [_key(v, t) for t in branches]
                m = self.cka_matrix(*keys).numpy()
                se = self.cka_matrix(*keys, stderr=True).numpy()
                for i, ts in enumerate(skips):
                    for j, tb in enumerate(branches):
                        rows.append({"metric": f"skip_vs_{branch}", "layer": i, "layer_b": j, "token_view": v,
                                     "tap": ts, "tap_b": tb, "model_b": self.model_name,
                                     **_with_interval(float(m[i, j]), float(se[i, j]), units)})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df
