"""Minibatch Grams for CKA (math in `vitscope.metrics.cka`): the rows of feature streams grouped into CKA
batches of n images in arrival order (`GramGroups`), each group kept as its n x n float32 Gram.

Per feature stream (a tap seen through a token view) only the n x n Gram of each minibatch of n images is
kept (n = 32: 4 KB per batch in float32), images grouped in arrival order and the groups' image ids recorded,
so two models fed the same images produce aligned Grams. Any pair of streams, within a model or across
models computed in separate runs, is then a batched reduction over batches (`cka_from_gram_streams`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import torch

from vitscope.bounds import Range
from vitscope.host import to_host
from vitscope.metrics import cka as C

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
