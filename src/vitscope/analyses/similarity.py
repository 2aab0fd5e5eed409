"""Representation similarity: minibatch CKA from cached Gram matrices (math in `vitscope.metrics.cka`).

Per feature stream (a tap seen through a token view) only the n x n Gram of each minibatch of n images is
kept (n = 32: 4 KB per batch in float32), images grouped in arrival order and the groups' image ids recorded,
so two models fed the same images produce aligned Grams. Any pair of streams, within a model or across
models computed in separate runs, is then a batched reduction over batches (`cka_from_gram_streams`).

Analyses here:
  cka            every pair of the requested taps per token view, within the model; across models in `cross`
                 (with `cka_divergence` = 1 - CKA for the same tap in two models, Merlin et al. 2023 eq. 4)
  residual_cka   skip path (block input) vs branch outputs (attn_out, mlp_out), all block pairs (Walmer et al. 2023 D.4)
  diversity      similarity between heads, between spatial tokens, and before/after attention, by minibatch
                 CKA and by cosine similarity (Park et al. 2023; Wang 2023)
  similarity     measures beyond CKA (Procrustes, shape metric, CCA family, RSA, mutual k-NN, CKNNA, ridge
                 R²) on a seeded subset of images kept in float16, within and across models, with permutation
                 nulls and jackknife intervals (`vitscope.metrics.similarity`)
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import numpy as np
import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.bounds import Count, Fraction, Positive, Range
from vitscope.capture.taps import expand_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.errors import ConfigError, ResultWarning, VitscopeError, unknown_name
from vitscope.host import on_device, to_host
from vitscope.metrics import cka as C
from vitscope.metrics import similarity as M
from vitscope.metrics.intervals import t_quantile
from vitscope.threads import few_threads

#: permutations of a null: 0 for none, else enough for a p-value of 0.01
Permutations = Annotated[int, Range(99, or_zero=True, why="a p-value needs 99 permutations to reach 0.01")]
#: groups of images of the jackknife: 0 for no intervals
Groups = Annotated[int, Range(2, 1000, or_zero=True, why="a jackknife needs 2 groups; beyond 1000 it takes hours")]
#: which layer pairs across models get nulls and intervals
NULL_PAIRS = ("last", "matched", "all", "none")
#: which layer pairs the measures are computed for: across models, each layer with the other model's at the same
#: relative depth ('matched'), or every pair ('cross'); 'full' adds every pair within each model
GRIDS = ("matched", "cross", "full")

#: images per CKA batch: the unbiased HSIC estimator needs at least C.MIN_HSIC1_EXAMPLES
CkaBatch = Annotated[int, Range(C.MIN_HSIC1_EXAMPLES,
                                why="the unbiased HSIC estimator needs that many images per batch")]


class GramGroups:
    """Groups the rows of several feature streams into CKA minibatches of ``n`` images, in arrival order.

    ``add`` returns the groups it completed, each as (image ids, {stream: n x n float32 Gram}). A stream is
    shifted by a fixed reference (its first group's mean) before the Gram when that mean carries a good part
    of the features' energy (see `_needs_shift`): HSIC_1 is unchanged by a constant shift, and the float32
    product keeps its precision. The Grams are exact products of the float32 features: the float64 reduction
    loses nothing by their being kept in float32. Rows of an open group wait (at most n - 1); a batch that
    fills whole groups is used in place, without a copy. A stream whose key starts with ``*`` is a group of
    G streams given as (B, G, F): its Grams come out stacked (G, n, n), computed in one batched product
    (e.g. one stream per head or per token position).

    Everything computed stays on the features' device (Grams, open rows, references); per batch the host reads
    only the batch's image ids and positions, which decide the groups, in one transfer (`_host_lists`). The
    decision whether a stream is shifted is a device tensor until then: it travels with the next batch's ids
    (or is read by `ref`, `flush` and `state_dict`, which may wait).
    """

    def __init__(self, n: int):
        if n < C.MIN_HSIC1_EXAMPLES:
            raise ValueError(f"CKA batch_size must be at least {C.MIN_HSIC1_EXAMPLES}")
        self.n = n
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_ids: list[int] = []
        self.pending_pos: list[int] = []
        self.next_pos = 0  # the position the next row takes when a batch gives none
        self._ref: dict[str, torch.Tensor | None] = {}  # decided: the reference, None = no shift
        self._undecided: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # stream -> (mean, shift? 0-d bool)

    @property
    def ref(self) -> dict[str, torch.Tensor | None]:
        """{stream: the reference subtracted before its Grams, or None}: the streams seen so far (waits for the
        device when a decision is still on it)."""
        self._decide([bool(s) for _, s in self._undecided.values()])
        return dict(self._ref)

    def _decide(self, shifts: Sequence[bool]) -> None:
        """Settle the undecided streams, in order, with the host's reading of their shift flags."""
        for (k, (mean, _)), shift in zip(list(self._undecided.items()), shifts, strict=True):
            self._ref[k] = mean if shift else None
        self._undecided = {}

    def add(self, feats: Mapping[str, torch.Tensor], ids: torch.Tensor,
            positions: torch.Tensor | None = None) -> list[tuple[torch.Tensor, dict]]:
        """``positions``: each row's position in the study's selection of images (`batch.extra['position']`).
        Group g holds the rows at positions g n .. (g + 1) n - 1, so an unreadable image makes its own group
        smaller instead of shifting every later group, and a shard (cut at a multiple of n) forms the groups
        one process forms. Without positions, rows are numbered in arrival order."""
        rows = {k: x.reshape(x.shape[0], x.shape[1], -1) if k.startswith("*") else x.reshape(x.shape[0], -1)
                for k, x in feats.items()}
        flags = [s for _, s in self._undecided.values()]
        new_ids, pos, shifts = _host_lists(ids, positions, flags)
        self._decide(shifts)
        if positions is None:
            pos = list(range(self.next_pos, self.next_pos + len(new_ids)))
        self.next_pos = pos[-1] + 1 if pos else self.next_pos
        if self.pending_ids:
            rows = {k: torch.cat([self.pending[k].to(x.device), x]) for k, x in rows.items()}
        return self._close(rows, self.pending_ids + new_ids, self.pending_pos + pos, final=False)

    def flush(self) -> list[tuple[torch.Tensor, dict]]:
        self._decide([bool(s) for _, s in self._undecided.values()])
        return self._close(self.pending, self.pending_ids, self.pending_pos, final=True)

    def _close(self, rows: dict[str, torch.Tensor], ids: list[int], pos: list[int],
               final: bool) -> list[tuple[torch.Tensor, dict]]:
        """Cut the rows into the groups their positions (increasing: one run per group) complete; the last,
        open group's rows wait unless ``final``."""
        out = []
        group = [p // self.n for p in pos]
        start = 0
        while start < len(ids):
            stop = start + 1
            while stop < len(ids) and group[stop] == group[start]:
                stop += 1
            if stop == len(ids) and not final and stop - start < self.n:  # open: its positions may still come
                break
            out.append((torch.tensor(ids[start:stop], dtype=torch.long),
                        self._grams({k: x[start:stop] for k, x in rows.items()})))
            start = stop
        # copies, not views: a view of one row would keep (and save into the cache) the batch's whole tensor
        self.pending = {k: x[start:].clone() for k, x in rows.items()} if start < len(ids) else {}
        self.pending_ids, self.pending_pos = ids[start:], pos[start:]
        return out

    def _grams(self, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        grams = {}
        for k, x in rows.items():
            gram = _grouped_gram if k.startswith("*") else _gram
            if k in self._ref:
                ref = self._ref[k]
                if ref is not None and ref.device != x.device:  # a loaded state meets the features' device
                    ref = self._ref[k] = ref.to(x.device)
                grams[k] = gram(x, ref)
                continue
            if k not in self._undecided:  # first group: shift only if the mean matters, judged from the plain Gram
                g = gram(x, None)
                self._undecided[k] = (_reference(x), _needs_shift(g))
            else:  # a later group before the host has read the decision: both Grams, one kept
                g = gram(x, None)
            mean, shift = self._undecided[k]
            grams[k] = torch.where(shift, gram(x, mean), g)
        return grams

    def state_dict(self) -> dict[str, Any]:
        """CPU tensors (a state saved on a GPU loads anywhere)."""
        ref = self.ref
        refs = [r for r in ref.values() if r is not None]
        pending, refs = _host_split(list(self.pending.values()), refs)
        it = iter(refs)
        return {"n": self.n, "pending": dict(zip(self.pending, pending, strict=True)),
                "pending_ids": torch.tensor(self.pending_ids, dtype=torch.long),
                "ref": {k: None if r is None else next(it) for k, r in ref.items()},
                "pending_pos": torch.tensor(self.pending_pos, dtype=torch.long), "next_pos": self.next_pos}

    def load_state_dict(self, s: Mapping[str, Any]) -> None:
        self.n, self.pending, self._ref = s["n"], dict(s["pending"]), dict(s["ref"])
        self._undecided = {}
        self.pending_ids = [int(i) for i in s["pending_ids"].tolist()]
        n_pending = len(self.pending_ids)  # a state saved before positions: its rows numbered in arrival order
        self.next_pos = int(s.get("next_pos", n_pending))
        pos = s.get("pending_pos")
        self.pending_pos = (list(range(self.next_pos - n_pending, self.next_pos)) if pos is None
                            else [int(p) for p in pos.tolist()])


def _host_lists(ids: torch.Tensor, positions: torch.Tensor | None,
                flags: Sequence[torch.Tensor]) -> tuple[list[int], list[int], list[bool]]:
    """(ids, positions (empty without), flags) as Python values: the flags (0-d, on the features' device) in one
    transfer (`to_host`), joined on the host with the ids and positions (there already) and read with one
    ``tolist``."""
    parts = [ids.reshape(-1).long()]
    if positions is not None:
        parts.append(positions.reshape(-1).long())
    if flags:
        parts.append(torch.stack([f.reshape(()).long() for f in flags]))
    values = torch.cat(to_host(*parts)).tolist()
    n = len(ids)
    pos = values[n:2 * n] if positions is not None else []
    return values[:n], pos, [bool(v) for v in values[len(values) - len(flags):]]


def _host_split(*groups: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Lists of tensors copied to the host in one transfer (no copy for those already there), same grouping."""
    flat = [t for g in groups for t in g]
    if any(t.device.type != "cpu" for t in flat):
        flat = list(to_host(*flat))
    out, at = [], 0
    for g in groups:
        out.append(flat[at:at + len(g)])
        at += len(g)
    return out


SHIFT_MIN_ENERGY = 0.1


def _needs_shift(g: torch.Tensor) -> torch.Tensor:
    """Whether (a 0-d bool tensor, on the Gram's device) the first group's mean carries at least
    SHIFT_MIN_ENERGY of the features' energy, read off its plain Gram(s) (n, n) or (G, n, n): |mean|^2 =
    1ᵀK1 / n^2 and mean |x|^2 = tr(K) / n.

    The shift exists for precision only (HSIC_1 is shift-invariant): a float32 Gram loses digits in proportion
    to mean energy / centred energy. Below 10% of the energy in the mean that loss is at most ~1.1x that of
    centred features, and skipping the shift saves a subtraction per Gram. Reading the ratio off the Gram
    costs nothing more; when the shift is needed, the first group's Gram is computed once more, shifted."""
    n = g.shape[-1]
    mean_energy = g.sum(dim=(-2, -1)) / (n * n)
    energy = g.diagonal(dim1=-2, dim2=-1).sum(dim=-1) / n
    return (mean_energy >= SHIFT_MIN_ENERGY * energy).any()


def _reference(x: torch.Tensor) -> torch.Tensor:
    """The mean of the rows, (F,) or (G, F), in float32."""
    return x.float().mean(0)


def _gram(x: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """(n, F) rows -> (n, n) float32 Gram after subtracting the (F,) reference (`metrics.cka.gram_matrix`)."""
    return C.gram_matrix(x, ref, torch.float32)


def _grouped_gram(x: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """(n, G, F) rows of G streams -> (G, n, n) float32 Grams, after subtracting the (G, F) reference."""
    x = x.float()
    xc = (x if ref is None else x - ref).transpose(0, 1)  # (G, n, F)
    return torch.bmm(xc, xc.transpose(1, 2))


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
        views = [views] if isinstance(views, str) else list(views)
        if not self.has_cls_token:
            views = [v for v in views if v != "cls"]
        self.views = views

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
        views = [views] if isinstance(views, str) else list(views)
        self.views = [v for v in views if v != "cls" or self.has_cls_token]

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


@register_analysis
class Diversity(Analysis):
    """Representation diversity inside self-attention [Park et al. 2023 "The attention collapse reduces the
    diversity"; Wang 2023 Fig. 12], per layer, by minibatch CKA and by cosine similarity:

    heads   between the per-head attention outputs (``block{i}.heads``, attn @ v per head, all tokens
            flattened for CKA; per token for cosine): mean over head pairs h != h'.
    tokens  between spatial positions: CKA between position p and p' across images (each position a
            representation of the images), mean over p != p'; cosine between the spatial tokens of an
            image, mean over pairs and images.
    depth   before vs after self-attention: the block input against ``resid_mid`` (input + attention
            branch), CKA across images (all tokens flattened) and cosine per token.
    High similarity = low diversity (contrastive models in late layers, per the sources).
    Only sums are kept (HSIC sums per CKA batch group, cosine sums): memory is constant in the images.

    Each value carries ``stderr`` and the 95 % interval ``value_lo``, ``value_hi`` (value ± t stderr, with the
    units - 1 degrees of freedom): for the cosines, over images (a sum of squares of the per-image values); for
    the CKAs, by batch means (the value of each CKA minibatch alone, their spread over the minibatches, as `cka`).
    """

    name = "diversity"
    state_version = 3  # 3: t intervals (CKA: groups - 1 degrees of freedom); 2: sums of squares (stderr)
    description = "similarity between heads, between spatial tokens, and before/after attention (CKA, cosine)"

    def __init__(self, vm: Any, layers: Any = None, batch_size: CkaBatch = 32):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        self.batch_size = int(batch_size)
        self.groups = GramGroups(self.batch_size)
        L, H, S = len(self.layers), self.num_heads, self.grid_size[0] * self.grid_size[1]
        self.hsic_heads = torch.zeros(L, H, H, dtype=torch.float64)
        self.hsic_tokens = torch.zeros(L, S, S, dtype=torch.float64)
        self.hsic_depth = torch.zeros(L, 3, dtype=torch.float64)  # (K,L), (K,K), (L,L)
        self.n_groups = 0
        self.cos_heads = torch.zeros(L, dtype=torch.float64)
        self.cos_tokens = torch.zeros(L, dtype=torch.float64)
        self.cos_depth = torch.zeros(L, dtype=torch.float64)
        self.cos_sq = torch.zeros(3, L, dtype=torch.float64)  # per-image sums of squares: heads, tokens, depth
        self.cka_group = torch.zeros(2, 3, L, dtype=torch.float64)  # per-group CKA: sums, sums of squares

    def _input_tap(self, i: int) -> str:
        return "embed" if i == 0 else f"block{i - 1}.out"

    def state_bytes(self, n_images: int) -> int:
        """The token sums (float64, S x S per layer) and the rows of the last, open CKA group, which the finished
        state keeps: per image and layer the heads' Gram rows, the spatial tokens, the input and ``resid_mid``."""
        S = self.grid_size[0] * self.grid_size[1]
        T, D = self.num_prefix_tokens + S, self.embed_dim or 0
        per_image = self.num_heads * T * (T - 1) // 2 + S * D + 2 * T * D
        return 4 * (n_images % self.batch_size) * len(self.layers) * per_image + 8 * len(self.layers) * S * S

    def required_taps(self) -> list[str]:
        taps = []
        for i in self.layers:
            taps += [f"block{i}.heads", self._input_tap(i), f"block{i}.resid_mid", f"block{i}.out"]
        return list(dict.fromkeys(taps))

    def on_grid(self, grid: tuple[int, int]) -> None:
        S = grid[0] * grid[1]
        self.hsic_tokens = torch.zeros(len(self.layers), S, S, dtype=torch.float64)

    def _on_device(self, device: torch.device) -> None:
        """Move the sums to the features' device (once: at the first batch, or after a load or merge)."""
        for name in self._TENSORS:
            setattr(self, name, on_device(getattr(self, name), device))

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        self._on_device(feats[f"block{self.layers[0]}.heads"].device)
        P, H = self.num_prefix_tokens, self.num_heads
        streams: dict[str, torch.Tensor] = {}
        for j, i in enumerate(self.layers):
            heads = feats[f"block{i}.heads"].float()
            B, T, D = heads.shape
            per_head = heads.reshape(B, T, H, D // H)
            # cosines of unit vectors in float32 (bounded terms), summed in float64. The sum over head pairs
            # h != g of <u_h, u_g> is |sum_h u_h|^2 - sum_h |u_h|^2, and |u_h|^2 is 1 (0 for a zero head):
            # one pass over the heads instead of an H x H contraction
            norm = torch.linalg.vector_norm(per_head, dim=-1, keepdim=True)
            u_sum = (per_head / norm.clamp_min(1e-12)).sum(2)
            per_image = (u_sum.square().sum(dim=(1, 2), dtype=torch.float64) - (norm > 0).sum(dim=(1, 2, 3))) \
                / (H * (H - 1)) / T
            self.cos_heads[j] += per_image.sum()
            self.cos_sq[0, j] += per_image.square().sum()
            spatial = feats[f"block{i}.out"][:, P:].float()
            v = torch.nn.functional.normalize(spatial, dim=-1)
            S = v.shape[1]
            tot = (v.sum(1).double().pow(2).sum(-1) - S) / (S * (S - 1))  # mean over pairs p != p' per image
            self.cos_tokens[j] += tot.sum()
            self.cos_sq[1, j] += tot.square().sum()
            x_in, x_mid = feats[self._input_tap(i)].float(), feats[f"block{i}.resid_mid"].float()
            dot = (x_in * x_mid).sum(-1)
            norms = torch.linalg.vector_norm(x_in, dim=-1) * torch.linalg.vector_norm(x_mid, dim=-1)
            cos = dot / norms.clamp_min(1e-8)
            per_image = cos.mean(1, dtype=torch.float64)
            self.cos_depth[j] += per_image.sum()
            self.cos_sq[2, j] += per_image.square().sum()
            streams[f"*h{j}"] = per_head.permute(0, 2, 1, 3)  # (B, H, T, hd): one stream per head
            streams[f"*t{j}"] = spatial  # (B, S, D): one stream per spatial position
            streams[f"in{j}"], streams[f"mid{j}"] = feats[self._input_tap(i)], feats[f"block{i}.resid_mid"]
        self._reduce(self.groups.add(streams, batch.index, batch.extra.get("position")))
        self.n_images += len(batch)

    def _reduce(self, closed: list[tuple[torch.Tensor, dict]]) -> None:
        for _ids, grams in closed:
            if len(_ids) < C.MIN_HSIC1_EXAMPLES:
                warnings.warn(f"diversity: a last CKA batch of {len(_ids)} images "
                              "is too small for HSIC_1 and was left out of the CKA terms", stacklevel=2)
                continue
            self.n_groups += 1
            for j in range(len(self.layers)):
                gh = grams[f"*h{j}"][:, None]  # (H, 1, n, n)
                heads = C.hsic1_cross(gh, gh)[:, :, 0]
                self.hsic_heads[j] += heads
                gt = grams[f"*t{j}"][:, None]  # (S, 1, n, n)
                tokens = C.hsic1_cross(gt, gt)[:, :, 0]
                self.hsic_tokens[j] += tokens
                k, m = grams[f"in{j}"], grams[f"mid{j}"]
                depth = torch.stack([C.hsic1(k, m), C.hsic1(k, k), C.hsic1(m, m)])
                self.hsic_depth[j] += depth
                # this group's own CKA values, for the spread over groups (batch means)
                one = torch.stack([_mean_offdiag_cka(heads), _mean_offdiag_cka(tokens), _depth_cka(depth)])
                self.cka_group[0, :, j] += one
                self.cka_group[1, :, j] += one.square()

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Diversity) and other.layers == self.layers
        self._check_grid_merge(other)
        other = other._finished()
        self._reduce(self.groups.flush())
        for name in self._TENSORS:
            mine = getattr(self, name)
            setattr(self, name, mine + getattr(other, name).to(mine.device))
        self.n_groups += other.n_groups
        self.n_images += other.n_images

    def _finished(self) -> Diversity:
        done = copy.copy(self)
        done.load_state_dict(self.state_dict())
        done._reduce(done.groups.flush())
        return done

    _TENSORS = ("hsic_heads", "hsic_tokens", "hsic_depth", "cos_heads", "cos_tokens", "cos_depth", "cos_sq",
                "cka_group")

    def state_dict(self) -> dict[str, Any]:
        """CPU tensors (copies: the sums keep growing), whatever device the pass ran on."""
        s = dict(zip(self._TENSORS, to_host(*(getattr(self, k) for k in self._TENSORS)), strict=True))
        return {**s, "layers": list(self.layers), "batch_size": self.batch_size, "n_images": self.n_images,
                "grid": list(self.grid_size),
                "n_groups": self.n_groups, "groups": self.groups.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in self._TENSORS:
            setattr(self, k, state[k].clone())
        self.layers, self.batch_size = list(state["layers"]), int(state["batch_size"])
        self.n_images, self.n_groups = int(state["n_images"]), int(state["n_groups"])
        self.grid_size = tuple(int(v) for v in state.get("grid", self.grid_size))
        self.groups = GramGroups(self.batch_size)
        self.groups.load_state_dict(state["groups"])

    def finalize(self) -> pd.DataFrame:
        d = self._finished()
        n = max(d.n_images, 1)
        cos_se = _stderr(torch.stack([d.cos_heads, d.cos_tokens, d.cos_depth]), d.cos_sq, d.n_images)
        cka_se = _stderr(d.cka_group[0], d.cka_group[1], d.n_groups)
        rows = []
        for j, i in enumerate(d.layers):
            values = {"cosine_heads": float(d.cos_heads[j] / n), "cosine_tokens": float(d.cos_tokens[j] / n),
                      "cosine_depth": float(d.cos_depth[j] / n),
                      "cka_heads": float(_mean_offdiag_cka(d.hsic_heads[j])),
                      "cka_tokens": float(_mean_offdiag_cka(d.hsic_tokens[j])),
                      "cka_depth": float(_depth_cka(d.hsic_depth[j]))}
            ses = {"cosine_heads": cos_se[0, j], "cosine_tokens": cos_se[1, j], "cosine_depth": cos_se[2, j],
                   "cka_heads": cka_se[0, j], "cka_tokens": cka_se[1, j], "cka_depth": cka_se[2, j]}
            rows += [{"metric": k, "layer": i,
                      **_with_interval(v, float(ses[k]), d.n_groups if k.startswith("cka") else d.n_images)}
                     for k, v in values.items()]
        df = self.tidy(rows)
        df["n_images"] = d.n_images
        return df


def _stderr(sums: torch.Tensor, sumsq: torch.Tensor, n: int) -> torch.Tensor:
    """Standard error of a mean from the sum and sum of squares of ``n`` values (ddof 1); NaN below 2."""
    if n < 2:
        return torch.full_like(sums, float("nan"))
    var = (sumsq - sums.square() / n) / (n - 1)
    return torch.sqrt(var.clamp_min(0) / n)


def _depth_cka(hsic: torch.Tensor) -> torch.Tensor:
    """CKA (0-d tensor, on ``hsic``'s device) from the three HSIC terms (K,L), (K,K), (L,L)."""
    kl, kk, ll = hsic
    return kl / (kk * ll).sqrt()


def _mean_offdiag_cka(hsic: torch.Tensor) -> torch.Tensor:
    """The mean CKA over the pairs i != j of an (m, m) HSIC matrix (0-d tensor, on its device; NaN pairs
    count as 0)."""
    d = hsic.diagonal().clamp_min(0).sqrt()
    cka = hsic / (d[:, None] * d[None, :])
    n = cka.shape[0]
    return (cka.nansum() - cka.diagonal().nansum()) / (n * (n - 1))


# ----------------------------------------------------------------------------------------------------------
# similarity: measures beyond CKA on a seeded subset of images
# ----------------------------------------------------------------------------------------------------------

#: token views whose features are one vector per image (the measures need (n, d) with d a layer's width)
POOLED_VIEWS = ("cls", "gap", "gap_spatial")
_MIX = 0x9E3779B97F4A7C15


def subset_keys(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """A pseudo-random int64 key per image id (splitmix64 of the id and the seed): the images kept are the
    ``n_subset`` smallest keys, so the subset depends on the ids alone, never on arrival order, shards or
    resumption, and two models fed the same images keep the same ones.

    Computed in int64 tensor arithmetic on the ids' device (no copy to the host): additions and products wrap
    modulo 2^64 as the uint64 ones do, and the logical right shifts are arithmetic shifts with the sign bits
    masked off, so the bits are those of the uint64 recipe."""
    z = ids.long() + _signed((int(seed) * _MIX + _MIX) % 2 ** 64)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return _shr(z, 1)


def _signed(c: int) -> int:
    """The int64 with the bits of the uint64 ``c``."""
    return c - 2 ** 64 if c >= 2 ** 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (as uint64) by ``s`` in 1..63."""
    return (z >> s) & ((1 << (64 - s)) - 1)


@register_analysis
class Similarity(Analysis):
    """Representation similarity beyond CKA (math in `vitscope.metrics.similarity`) between the layers of every
    pair of models (`cross`): orthogonal Procrustes distance and the angular shape
    metric at partial whitenings ``alphas`` (0 = CCA, 1 = Procrustes; Williams et al. 2021; 0 and 1 by default,
    which come from the CCA and Procrustes decompositions; each other alpha, 0.5 say, adds a decomposition per
    pair and permutation), mean CCA, SVCCA
    (Raghu et al. 2017), PWCCA (Morcos et al. 2018; weights from ``layer``), RSA of correlation-distance RDMs
    by Spearman and Kendall's tau_a (Kriegeskorte et al. 2008), mutual k-NN and CKNNA (Huh et al. 2024) and
    leave-one-out ridge R² (``layer`` predicts ``layer_b``; across models also the reverse, ``*_reverse``).
    PWCCA, ridge R² and CKNNA change with the order of the pair (`ASYMMETRIC`): within a model every ordered
    pair of layers has its own row, the others are copied to (j, i). ``measures`` picks them; distances
    (procrustes, angular_shape) are small for similar representations.

    ``grid`` says which layer pairs: 'matched' (the default), each layer of A with B's layer at the same
    relative depth, a profile through depth; 'cross', every layer of A with every layer of B; 'full', those and
    every pair of layers within each model (layer x layer, what `cka` gives cheaply for CKA). A pair costs a
    cross product and a few r x r decompositions (see Cost), so 'cross' costs 13x 'matched' for 13 taps and 'full'
    about twice 'cross'; the map of every tap by the shape metric needs 'full'.

    One pooled ``view`` ('cls', 'gap' or 'gap_spatial') of each tap. The measures need whole feature
    matrices, so the analysis keeps a seeded random subset of ``n_subset`` images in float16: the images whose
    keys (a hash of image id and ``seed``, `subset_keys`) are smallest, which makes the subset the same for
    every model, shard and resumed run. RSA uses the first ``rsa_images`` of them (its RDM and Kendall's tau
    grow with the square of the images). Rows record ``n_images`` (the images a value was computed on) and
    ``images_seen``.

    Across models, for the pairs ``null_pairs`` names ('last': the two models' last taps, the pair the findings
    read, the default; 'matched': each layer of A with B's layer at the same relative depth; 'all'; 'none'),
    every score gets:

    * a permutation null: B's images shuffled ``n_permutations`` times (0, or at least 99 so that a p-value can
      reach 0.01): ``null_mean``, ``null_q05``, ``null_q95``, ``n_permutations`` and ``p_value`` = (1 + the
      shuffles scoring at least as well) / (1 + n_permutations), in the direction the measure improves. Not
      for ridge R² (`WITHOUT_NULL`): it is out of sample, so its chance level is 0 (unrelated features
      score at most 0 in expectation), and its interval against 0 is the test;
    * a 95 % interval from a delete-a-group jackknife over images: the kept images are dealt into ``n_groups``
      groups G (0 for none; by their rank in the seeded subset, so the groups are random and the same for both
      models), the measure is computed again without each group, and ``stderr`` = sqrt((G - 1) / G · sum_g
      (v_g - mean v)²); ``value_lo``, ``value_hi`` = value ± t(G - 1) · stderr, clipped to the measure's range
      (`metrics.similarity.RANGES`); ``n_groups``. Why not a bootstrap: a resample with replacement holds about
      63 % distinct images, and the CCA family, the shape metric and ridge's leave-one-out depend on the number
      of distinct images (mean CCA of independent random features is 0.44 at 380 images and 0.34 at 600), so
      the bootstrap's intervals missed their own estimate; a duplicated image is also its own nearest neighbour
      and a zero distance, which ruled it out for the neighbour and RDM measures. A jackknife replicate holds
      distinct images only, so every measure gets an interval. What it covers: the value the measure takes, on
      average, on this many images drawn from the same distribution. These measures are biased with respect to
      their infinite-sample value (CCA of unrelated features is far from 0 when n is a few times the width), so
      compare models at the same ``n_images``, as the analysis does. Coverage: `benchmarks/calibration.py`
      (docs/CALIBRATION.md).

    Cost: each tap is prepared once (an SVD; its k-NN lists, from float32 candidates ordered at float64; its
    RDM); a grid's cross products come from one matrix product per tap (`metrics.similarity.compare_grid`); each
    pair then takes one eigendecomposition of an r x r matrix with vectors (r = the layer's rank, 384 for ViT-S:
    CCA, and PWCCA both ways) and two values-only ones (Procrustes, SVCCA; one more per alpha other than 0 and 1),
    and ridge two products of n rows (both ways). A tested pair adds ``n_permutations`` such comparisons without
    ridge (on float32 bases, `Prepared.single`) and ``n_groups`` of its two taps prepared again without a group
    (their neighbour lists filtered from long lists searched once). Memory: the subset (``n_subset`` x width x 2
    bytes per tap); every tap's float64 basis (n x r: 6 MB at n = 2000), one n x n neighbour score at a time
    (16 MB) and products of n x 2048 (33 MB). `benchmarks/similarity.py` measures it against CKA's time on the
    same features (two ViT-S/16, 13 taps, 2,048 images, one thread; 2026-11-28, quiet: load 0.5-0.9 on 2 cores):
    the default (13 matched pairs, 99 permutations and a 10-group jackknife of the last pair) 12.7-13.3 s
    against CKA's 1.42-1.43 s, 9.0-9.3x (9.1-9.8x over four runs; 23.9 s, 11.9x, with 20 groups, alpha 0.5
    and ridge's null; 83 s with the full grids): the pairs with every tap prepared 3.8-4.1 s, the permutations
    5.7-5.9 s, the jackknife 1.8-2.0 s. The floor, mean CCA alone over the same pairs, permutations and
    jackknife (a cross product and one decomposition per pair and replicate), is 4.2-4.3 s (2.9-3.0x); each
    linear measure alone costs 2.9-6.2 s (PWCCA the most), the neighbour and RDM measures 0.8-2.2 s. ``grid:
    full`` (both models' 13 x 13 grids and the cross grid) took 52.5 s (``--grid full``, the same
    conditions)."""

    state_version = 5  # 2: CKNNA is asymmetric: its (j, i) rows within a model and *_reverse across models;
    # 3: jackknife intervals (stderr) instead of the bootstrap's, 99 permutations, the last pair by default;
    # 4: ``grid``, 'matched' by default (the full grids on request); 5: alphas 0 and 1 by default, 10 jackknife
    # groups, no permutation null for ridge R² (its chance level is 0)
    replaced = {"n_bootstrap": "its bootstrap intervals missed their own estimates (a resample's duplicated "
                               "images change the CCA family, the shape metric, ridge and the neighbours); "
                               "a jackknife over n_groups groups of images gives the intervals now"}

    name = "similarity"
    in_default_study = False  # its measures and nulls cost many times CKA (benchmarks/similarity.py)
    description = ("Procrustes, shape metric, CCA / SVCCA / PWCCA, RSA, mutual k-NN, CKNNA and ridge R² between "
                   "layers, within and across models, with permutation nulls and jackknife intervals")

    def __init__(self, vm: Any, taps: str | Sequence[str] = "block*.out", view: str = "gap",
                 measures: Sequence[str] = tuple(M.MEASURES), n_subset: Annotated[int, Range(5)] = 2000,
                 seed: int = 0, alphas: Sequence[Fraction] = (0.0, 1.0), k: Count = 10,
                 rsa_images: Annotated[int, Range(5)] = 200, ridge: Positive = 1e-3,
                 n_permutations: Permutations = 99, n_groups: Groups = 10, null_pairs: str = "last",
                 grid: str = "matched"):
        super().__init__(vm)
        self.taps = expand_taps(list(taps) if not isinstance(taps, str) else taps, self.depth)
        if view not in POOLED_VIEWS:
            raise ConfigError(f"similarity: view {view!r} is not one vector per image; choose one of "
                              f"{', '.join(POOLED_VIEWS)}")
        if view == "cls" and not self.has_cls_token:
            raise ConfigError("similarity: this model has no CLS token; use the view 'gap' or 'gap_spatial'")
        self.view = view
        measures = [measures] if isinstance(measures, str) else list(measures)
        for m in measures:
            if m not in M.MEASURES:
                raise unknown_name("similarity measure", m, M.MEASURES)
        self.measures = [m for m in M.MEASURES if m in measures]
        if null_pairs not in NULL_PAIRS:
            raise unknown_name("similarity null_pairs", null_pairs, NULL_PAIRS)
        if grid not in GRIDS:
            raise unknown_name("similarity grid", grid, GRIDS)
        self.grid = grid
        if ("mutual_knn" in self.measures or "cknna" in self.measures) and int(k) >= int(n_subset):
            raise ConfigError(f"similarity: k = {k} neighbours needs n_subset above it, got {n_subset}")
        self.n_subset, self.seed, self.k = int(n_subset), int(seed), int(k)
        self.alphas, self.rsa_images, self.ridge = [float(a) for a in alphas], int(rsa_images), float(ridge)
        self.n_permutations, self.n_groups, self.null_pairs = int(n_permutations), int(n_groups), null_pairs
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys = torch.empty(0, dtype=torch.long)
        self.feats: dict[str, torch.Tensor] = {}  # tap -> (rows, D) float16, rows ordered by key

    def required_taps(self) -> list[str]:
        return list(self.taps)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        rows = {t: token_view(feats[t], self.view, self.num_prefix_tokens, self.has_cls_token)
                if feats[t].ndim == 3 else feats[t] for t in self.taps}
        ids = batch.index.long()
        *host, ids = to_host(*(rows[t].detach().to(torch.float16) for t in self.taps), ids)
        self._keep(ids, subset_keys(ids, self.seed), dict(zip(self.taps, host, strict=True)))
        self.n_images += len(ids)

    def _keep(self, ids: torch.Tensor, keys: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
        """Add rows and keep the ``n_subset`` with the smallest (key, id), in that order."""
        if not len(ids):
            return
        ids, keys = torch.cat([self.ids, ids]), torch.cat([self.keys, keys])
        feats = {t: torch.cat([self.feats[t], x]) if t in self.feats else x for t, x in rows.items()}
        order = torch.argsort(ids, stable=True)
        order = order[torch.argsort(keys[order], stable=True)][:self.n_subset]
        self.ids, self.keys = ids[order], keys[order]
        self.feats = {t: x[order].contiguous() for t, x in feats.items()}

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Similarity) and other.taps == self.taps and other.view == self.view
        self._keep(other.ids, other.keys, other.feats)
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"taps": list(self.taps), "view": self.view, "n_images": self.n_images, "ids": self.ids,
                "keys": self.keys, "feats": dict(self.feats)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.taps, self.view, self.n_images = list(state["taps"]), str(state["view"]), int(state["n_images"])
        self.ids, self.keys, self.feats = state["ids"], state["keys"], dict(state["feats"])

    # -- finalize ---------------------------------------------------------------------------------------------

    def _check_kept(self) -> None:
        if len(self.ids) < 5:
            raise VitscopeError(f"similarity: {self.model_name} kept {len(self.ids)} images; the measures need at "
                                "least 5 (give the dataset more images)")

    def _prepared(self, rows: Any = None) -> list[M.Prepared]:
        self._check_kept()
        return [M.prepare(self.feats[t] if rows is None else self.feats[t][rows], self.measures, k=self.k,
                          rsa_images=self.rsa_images, name=f"{self.model_name} {t}") for t in self.taps]

    def _compare(self, pa: M.Prepared, pb: M.Prepared, measures: Sequence[str] | None = None) -> dict[str, float]:
        return M.compare(pa, pb, measures or self.measures, alphas=self.alphas, ridge=self.ridge)

    def _n_of(self, metric: str) -> int:
        return min(self.rsa_images, len(self.ids)) if metric.startswith("rsa") else len(self.ids)

    def _row(self, other: Similarity, i: int, j: int, metric: str, value: float) -> dict[str, Any]:
        ta, tb = self.taps[i], other.taps[j]
        return {"metric": metric, "layer": parse_tap(ta)[0], "layer_b": parse_tap(tb)[0], "tap": ta, "tap_b": tb,
                "token_view": self.view, "model_b": other.model_name, "value": value,
                "n_images": self._n_of(metric), "images_seen": self.n_images}

    def finalize(self) -> pd.DataFrame:
        if self.grid != "full":  # the measures across models only (`cross`): no rows within the model
            self._check_kept()
            return self.tidy([])
        with few_threads():
            prep = self._prepared()
            asym = [m for m in M.ASYMMETRIC if m in self.measures]
            n = len(prep)
            got = M.compare_grid(prep, prep, [(i, j) for i in range(n) for j in range(i, n)], self.measures,
                                 alphas=self.alphas, ridge=self.ridge, reverse=asym)
            rows = []
            for i, j in itertools.product(range(n), repeat=2):
                if i <= j:
                    for metric, v in got[i, j].items():
                        if metric.endswith("_reverse"):
                            continue
                        rows.append(self._row(self, i, j, metric, v))
                        if i != j and metric not in asym:
                            rows.append(self._row(self, j, i, metric, v))
                else:  # the asymmetric measures of (i, j): the reverse ones of (j, i)
                    rows += [self._row(self, i, j, m, got[j, i][f"{m}_reverse"]) for m in asym]
        return self.tidy(rows)

    @classmethod
    def cross(cls, analyses: list[Analysis]) -> pd.DataFrame | None:
        frames = []
        if len(analyses) < 2 and analyses and analyses[0].grid != "full":
            warnings.warn(f"similarity compares models: with one model and grid '{analyses[0].grid}' it computes "
                          "nothing (set grid: full for every pair of layers within the model)", ResultWarning,
                          stacklevel=2)
        prepared: dict[int, list[M.Prepared]] = {}  # each model's taps prepared once for all its pairs

        def prep(k: int) -> list[M.Prepared]:
            if k not in prepared:
                with few_threads():
                    prepared[k] = analyses[k]._prepared()
            return prepared[k]

        for i, a in enumerate(analyses):
            for j in range(i + 1, len(analyses)):
                b = analyses[j]
                assert isinstance(a, Similarity) and isinstance(b, Similarity)
                if not torch.equal(a.ids, b.ids) or a.view != b.view:
                    warnings.warn(f"similarity: {a.model_name} and {b.model_name} saw different images "
                                  f"(or token views); the pair is left out", stacklevel=2)
                    continue
                frames.append(a._cross_rows(b, prep(i), prep(j)))
            prepared.pop(i, None)  # model i has no later pairs
        return pd.concat(frames, ignore_index=True) if frames else None

    def _grid_pairs(self, other: Similarity) -> list[tuple[int, int]]:
        """The layer pairs across the two models that ``grid`` computes."""
        na, nb = len(self.taps), len(other.taps)
        if self.grid == "matched":
            return _matched(na, nb)
        return list(itertools.product(range(na), range(nb)))

    def _tested_pairs(self, other: Similarity) -> list[tuple[int, int]]:
        """The layer pairs ``null_pairs`` names ('all': every pair the grid computes), which get nulls and
        intervals."""
        na, nb = len(self.taps), len(other.taps)
        if self.null_pairs == "none" or not (self.n_permutations or self.n_groups):
            return []
        if self.null_pairs == "all":
            return self._grid_pairs(other)
        if self.null_pairs == "last":
            return [(na - 1, nb - 1)]
        return _matched(na, nb)

    def _cross_rows(self, other: Similarity, pa: list[M.Prepared], pb: list[M.Prepared]) -> pd.DataFrame:
        with few_threads():
            rev = [m for m in M.ASYMMETRIC if m in self.measures]
            grid = M.compare_grid(pa, pb, self._grid_pairs(other), self.measures, alphas=self.alphas,
                                  ridge=self.ridge, reverse=rev)
            rows: dict[tuple[int, int, str], dict[str, Any]] = {}
            for (i, j), got in grid.items():
                for metric, v in got.items():
                    rows[i, j, metric] = self._row(other, i, j, metric, v)
            tested = self._tested_pairs(other)
            jack = self._jackknife(other, tested, rev)
            for i, j in tested:
                null = self._null(pa[i], pb[j], rev, i, j)
                for metric, row in ((m, r) for (a, b, m), r in rows.items() if (a, b) == (i, j)):
                    v = np.asarray(null.get(metric, []), dtype=float)
                    if len(v):
                        as_good = v <= row["value"] if _is_distance(metric) else v >= row["value"]
                        row.update(null_mean=float(v.mean()), null_q05=float(np.quantile(v, 0.05)),
                                   null_q95=float(np.quantile(v, 0.95)), n_permutations=len(v),
                                   p_value=float((1 + as_good.sum()) / (1 + len(v))))
                    reps = jack.get((i, j), {}).get(metric)
                    if reps is not None:
                        se, lo, hi = M.jackknife_interval(row["value"], reps, M.range_of(metric))
                        row.update(stderr=se, value_lo=lo, value_hi=hi, n_groups=len(reps))
        return self.tidy(list(rows.values()))

    def _rng(self, *stream: int) -> Any:
        return np.random.default_rng([self.seed, *stream])

    def _null(self, pa: M.Prepared, pb: M.Prepared, rev: list[str], i: int, j: int) -> dict[str, list[float]]:
        """Scores with B's images shuffled: the RDM's images among themselves, the rest among themselves. All
        the shuffles of one pair in one `compare_grid` (their cross products in one matrix product)."""
        n, m_rsa = len(self.ids), min(self.rsa_images, len(self.ids))
        shuffled = []
        pa, pb = pa.single(), pb.single()  # a shuffle's score needs a few digits: float32 products, 2x faster
        for p in range(self.n_permutations):
            g = self._rng(1, i, j, p)
            shuffled.append(pb.permuted(np.concatenate([g.permutation(m_rsa), m_rsa + g.permutation(n - m_rsa)])))
        measures = [m for m in self.measures if m not in WITHOUT_NULL]
        if not measures:
            return {}
        grid = M.compare_grid([pa], shuffled, [(0, p) for p in range(len(shuffled))], measures,
                              alphas=self.alphas, ridge=self.ridge, reverse=[m for m in rev if m in measures])
        out: dict[str, list[float]] = {}
        for p in range(len(shuffled)):
            for metric, v in grid[0, p].items():
                out.setdefault(metric, []).append(v)
        return out

    def _jackknife(self, other: Similarity, pairs: list[tuple[int, int]], rev: list[str]
                   ) -> dict[tuple[int, int], dict[str, list[float]]]:
        """Per pair, every measure computed again without each of ``n_groups`` groups of images
        (`metrics.similarity.jackknife_replicates`): {pair: {metric: [value without group g, ...]}}."""
        n, g_count = len(self.ids), self.n_groups
        if not pairs or not g_count:
            return {}
        if g_count > n // 2:
            warnings.warn(f"similarity: {n} kept images are too few for {g_count} jackknife groups of at "
                          "least 2; the pairs get no interval", ResultWarning, stacklevel=2)
            return {}
        return M.jackknife_replicates([self.feats[t] for t in self.taps], [other.feats[t] for t in other.taps],
                                      pairs, g_count, self.measures, k=self.k, rsa_images=self.rsa_images,
                                      alphas=self.alphas, ridge=self.ridge, reverse=rev)


#: measures without a permutation null: leave-one-out ridge R² is out of sample, so unrelated features score
#: at most 0 in expectation (each held-out image is predicted by a noisy mean: about -r / (n - r) for r
#: directions) and 0 is its chance level; its jackknife interval against 0 is the test. Its shuffles
#: cost two products of n rows each, a fifth of a permutation's time.
WITHOUT_NULL = ("ridge_r2",)


def _matched(na: int, nb: int) -> list[tuple[int, int]]:
    """Each of A's ``na`` layers with B's layer at the same relative depth (the first with the first, the last
    with the last)."""
    return sorted({(i, round(i * (nb - 1) / max(na - 1, 1))) for i in range(na)})


def _is_distance(metric: str) -> bool:
    return metric.startswith(("procrustes", "angular_shape"))
