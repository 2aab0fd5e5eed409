"""Representation inversion and STIR, the invariance lens of Merlin et al., "What happens during finetuning of
ViTs: an invariance based investigation" (2023), built on STIR of Nanda et al., "Measuring Representational
Robustness of Neural Networks Through Shared Invariances" (ICML 2022).

    inv = invert(vm, images, ["block3.out", "block7.out"])     # X' from noise with vm[j](X') ~ vm[j](X)
    inv.images        # (L, B, 3, H, W) normalised like ``images``; inv.rel_error (L, B) best relative error
    stir(m2, m1, images, taps2, taps1)                           # tidy frame of STIR(m2[i] | m1[j])

The optimisation is the one of the public STIR code (github.com/nvedant07/STIR, ``stir/stir.py``: a
'super-noise' start, ``step_size 0.5``, ``constraint 'unconstrained'``, ``use_best True``, the loss
``LPNormLossSingleModel`` of ``stir/attack/losses.py``: ||m(X') - m(X)||_2 / ||m(X)||_2 per image; the step
``UnconstrainedStep`` of github.com/nvedant07/deep-learning-base ``attack/attack_steps.py`` that the ViT
experiments of Merlin et al. ran with: x + 0.5 * g / (||g||_2 + 1e-10) per image, then a clamp to [0, 1]).
Here the pixels live in [0, 1] and are normalised with the model's own mean / std before the forward, so the
clamp is the valid pixel range of the model's preprocessing. The seed's start, ``torch.randn`` clamped to
[0, 1] by its input normaliser, is ``init='noise'``; each image's noise is drawn from its own generator
(seed, repeat, image id), so an inversion does not depend on the batch it came in (resumable, shardable).
Math on STIR values (learning, forgetting, flow, Pearson) is in `vitscope.metrics.invariance`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from vitscope.capture.taps import check_taps, parse_tap
from vitscope.capture.views import VIEWS, token_view
from vitscope.errors import InputError, VitscopeError
from vitscope.host import to_host
from vitscope.metrics import invariance as M
from vitscope.metrics.invariance import (  # noqa: F401  (re-exported: the public API of the lens)
    cka_divergence,
    flow_matrix,
    flow_summary,
    forgetting,
    learning,
    pearson,
)
from vitscope.models.adapter import ViTModel

__all__ = [
    "Inversion",
    "StirSums",
    "cka_divergence",
    "check_pair",
    "flow_matrix",
    "flow_summary",
    "forgetting",
    "invert",
    "learning",
    "pearson",
    "stir",
]

INITS = ("noise", "uniform", "gray")
#: the public STIR code's settings (see the module docstring); Merlin et al. ran 50 iterations (Sec. 4)
DEFAULT_ITERATIONS = 50
DEFAULT_STEP = 0.5


class _Stop(Exception):
    pass


@dataclass
class Inversion:
    """The result of `invert`: ``images`` (L, B, 3, H, W) in the model's normalised input space, ``pixels``
    the same in [0, 1]; ``rel_error`` (L, B) the relative error of each kept iterate; ``history`` (T + 1, L,
    B) the relative error of every iterate (last row: after the last step) when asked for; ``diverged`` (L, B)
    True where no iterate had a finite error (those images keep their start)."""

    images: torch.Tensor
    pixels: torch.Tensor
    rel_error: torch.Tensor
    diverged: torch.Tensor
    taps: list[str]
    history: torch.Tensor | None = None


def _stop_key(tap: str, depth: int) -> int:
    idx, kind = parse_tap(tap)
    if idx is not None:
        return idx
    return {"embed": -1, "final_norm": depth, "pool_attn": depth + 1, "pool": depth + 1, "logits": depth + 2}[kind]


def _norm_consts(vm: ViTModel, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pre = vm.preprocessing
    mean = torch.tensor(pre.mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std = torch.tensor(pre.std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    return mean, std


def _flat(x: torch.Tensor, view: str, vm: ViTModel) -> torch.Tensor:
    if x.ndim == 3:
        x = token_view(x, view, vm.num_prefix_tokens, vm.has_cls_token)
    return x.reshape(x.shape[0], -1)


class _GroupForward:
    """One forward of row groups, each read at its own tap: rows are ordered by the depth of their tap, a
    group's rows leave the batch right after the block that holds its tap, and the pass ends after the
    deepest tap needed. Hooks are the capture engine's hook points (`ViTModel.hook_point`)."""

    def __init__(self, vm: ViTModel, taps: list[str]):
        self.vm = vm
        self.taps = taps
        self.store: dict[str, torch.Tensor] = {}
        self.handles: list = []
        self.unfused: list = []
        self.rows: list[int] = []

    def __enter__(self) -> _GroupForward:
        vm, depth = self.vm, self.vm.depth
        blocks = vm.model.blocks
        try:
            for t in dict.fromkeys(self.taps):
                hp = vm.hook_point(t)
                if hp.needs_unfused is not None and getattr(hp.needs_unfused, "fused_attn", False):
                    self.unfused.append(hp.needs_unfused)
                    hp.needs_unfused.fused_attn = False
                get = hp.get
                if hp.when == "pre":
                    self.handles.append(hp.module.register_forward_pre_hook(
                        lambda m, a, t=t, get=get: self.store.__setitem__(t, get(a, None))))
                else:
                    self.handles.append(hp.module.register_forward_hook(
                        lambda m, a, o, t=t, get=get: self.store.__setitem__(t, get(a, o))))
            stops = sorted({_stop_key(t, depth) for t in self.taps})
            last = stops[-1]
            for s in stops:
                if s >= depth or (s == last and s >= 0):
                    continue

                def drop(n_of_stop: int = s):
                    return sum(n for t, n in zip(self.taps, self.rows, strict=True)
                               if _stop_key(t, depth) == n_of_stop)

                if s == -1:
                    def pre(m, args, drop=drop):
                        if len(self.taps) and _stop_key(self.taps[-1], depth) == -1:
                            raise _Stop
                        return (args[0][drop():],) + tuple(args[1:])
                    self.handles.append(blocks[0].register_forward_pre_hook(pre))
                else:
                    self.handles.append(blocks[s].register_forward_hook(lambda m, a, o, drop=drop: o[drop():]))
            if 0 <= last < depth:
                def stop(m, a, o):
                    raise _Stop
                self.handles.append(blocks[last].register_forward_hook(stop))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for m in self.unfused:
            m.fused_attn = True
        self.unfused.clear()

    def __call__(self, x: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """x: the rows of every group, groups in ``self.taps`` order (sorted by depth); rows: rows per group."""
        self.rows = rows
        self.store.clear()
        try:
            self.vm.model(x)
        except _Stop:
            pass
        depth = self.vm.depth
        out, start = [], 0
        dropped = {}  # rows gone before each group's stop
        for t, n in zip(self.taps, rows, strict=True):
            s = _stop_key(t, depth)
            gone = sum(m for u, m in zip(self.taps, rows, strict=True) if _stop_key(u, depth) < s and s >= 0
                       and _stop_key(u, depth) < depth)
            dropped[t] = gone
            out.append(self.store[t][start - gone:start - gone + n])
            start += n
        self.store.clear()
        return out


def _start_noise(init: str, ids: torch.Tensor, shape: tuple[int, ...], seed: int, repeat: int) -> torch.Tensor:
    out = torch.empty((len(ids), *shape))
    for r, i in enumerate(ids.tolist()):
        s = int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(repeat), int(i) & 0xFFFFFFFF]).generate_state(1)[0])
        g = torch.Generator().manual_seed(s)
        if init == "noise":
            out[r] = torch.randn(shape, generator=g).clamp_(0, 1)
        elif init == "uniform":
            out[r] = torch.rand(shape, generator=g)
        else:
            out[r] = 0.5
    return out


def inversion_chunks(n_taps: int, n_images: int, max_rows: int | None = None) -> list[list[tuple[int, int, int]]]:
    """How `invert` splits its ``n_taps x n_images`` rows (one group of rows per tap, in depth order) into the
    chunks it optimises one after the other, each with one forward per step: whole groups where ``max_rows``
    (None: all rows) allows, else rows within each group; a chunk is a list of (group, first row, rows)."""
    max_rows = max(int(max_rows or n_taps * n_images), 1)
    pieces: list[tuple[int, int, int]] = []  # (group, first row, n rows)
    per = max(1, min(n_images, max_rows))
    for g in range(n_taps):
        for s in range(0, n_images, per):
            pieces.append((g, s, min(per, n_images - s)))
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    for p in pieces:
        if cur and sum(q[2] for q in cur) + p[2] > max_rows:
            chunks.append(cur)
            cur = []
        cur.append(p)
    if cur:
        chunks.append(cur)
    return chunks


def invert(
    vm: ViTModel,
    images: torch.Tensor,
    taps: str | Sequence[str],
    *,
    iterations: int = DEFAULT_ITERATIONS,
    step_size: float = DEFAULT_STEP,
    init: str = "noise",
    seed: int = 0,
    repeat: int = 0,
    ids: torch.Tensor | None = None,
    view: str = "all",
    keep_best: bool = True,
    max_rows: int | None = None,
    history: bool = False,
) -> Inversion:
    """Invert ``vm``'s representation of ``images`` at each of ``taps``: X' from noise minimising
    ||vm[tap](X') - vm[tap](X)||_2 / ||vm[tap](X)||_2 per image with normalised-gradient steps
    ``u += step_size * g / ||g||`` in [0, 1] pixel space, clamped to [0, 1] after each step (the valid range of
    the model's preprocessing), keeping each image's best iterate (``keep_best``; else the last one).

    images: (B, 3, H, W) normalised with ``vm.preprocessing`` (what the study's batches hold). taps: one tap or
    several; several run as one batched optimisation (L * B rows, each group's loss at its own tap, the rows
    of shallow taps leaving the forward after their block, the forward ending after the deepest tap),
    split into chunks of at most ``max_rows`` rows (results do not depend on it). ids: the images' ids (their
    start noise is drawn per (seed, repeat, id)); default 0..B-1. view: the token view whose features are
    matched ('all': every token, the public STIR code's choice for ViTs). The target representation is read
    without autograd, the model's parameters get no gradients, and the input gradient is the only one formed.
    """
    if isinstance(taps, str):
        taps = [taps]
    taps = list(taps)
    if not taps:
        raise VitscopeError("invert: give at least one tap")
    if len(set(taps)) != len(taps):
        raise VitscopeError(f"invert: taps repeat: {taps}")
    check_taps(taps, vm.taps)
    if view not in VIEWS:
        raise VitscopeError(f"invert: unknown token view {view!r}; choose one of {', '.join(VIEWS)}")
    if init not in INITS:
        raise VitscopeError(f"invert: unknown init {init!r}; choose one of {', '.join(INITS)}")
    if not (isinstance(iterations, int) and iterations >= 0):
        raise VitscopeError(f"invert: iterations must be a non-negative integer, got {iterations!r}")
    if not (step_size > 0 and math.isfinite(step_size)):
        raise VitscopeError(f"invert: step_size must be positive, got {step_size!r}")
    vm.check_input(images)
    device = next(vm.model.parameters()).device
    x = images.detach().to(device=device, dtype=torch.float32).clone()
    b = len(x)
    ids = torch.arange(b) if ids is None else torch.as_tensor(ids).cpu().long()
    if len(ids) != b:
        raise VitscopeError(f"invert: {len(ids)} ids for {b} images")
    mean, std = _norm_consts(vm, device)

    # groups in depth order; the result is returned in the caller's order
    order = sorted(range(len(taps)), key=lambda k: _stop_key(taps[k], vm.depth))
    sorted_taps = [taps[k] for k in order]
    with torch.inference_mode():
        from vitscope.capture.engine import Capture

        with Capture(vm, sorted_taps) as cap:
            feats = cap(x)
    targets = [_flat(feats[t], view, vm).clone() for t in sorted_taps]  # plain tensors, no graph
    del feats
    tnorm = [t.norm(dim=1).clamp_min(1e-12) for t in targets]

    start = _start_noise(init, ids, tuple(x.shape[1:]), seed, repeat).to(device)
    n_l = len(sorted_taps)
    chunks = inversion_chunks(n_l, b, max_rows)

    best_u = start.unsqueeze(0).repeat(n_l, 1, 1, 1, 1)
    best_err = torch.full((n_l, b), math.inf)
    hist = torch.full((iterations + 1, n_l, b), math.nan) if history else None
    params = [p for p in vm.model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        for chunk in chunks:
            ctaps = [sorted_taps[g] for g, _, _ in chunk]
            # one group per distinct tap in the forward: merge pieces of the same tap
            utaps = list(dict.fromkeys(ctaps))
            rows = [sum(n for (g, _, n) in chunk if sorted_taps[g] == t) for t in utaps]
            u = torch.cat([start[s:s + n] for _, s, n in chunk])
            # per distinct tap: its target rows, in the order of the chunk's pieces
            tg = [torch.cat([targets[g][s:s + n] for g, s, n in chunk if sorted_taps[g] == t]) for t in utaps]
            tn = torch.cat([tnorm[g][s:s + n] for g, s, n in chunk])
            cb_u = torch.cat([best_u[g, s:s + n] for g, s, n in chunk])
            cb_e = torch.full((len(u),), math.inf)
            ch = torch.full((iterations + 1, len(u)), math.nan) if history else None
            with _GroupForward(vm, utaps) as fwd:
                for it in range(iterations + 1):
                    last = it == iterations
                    with torch.set_grad_enabled(not last):
                        uu = u.detach().requires_grad_(not last)
                        outs = fwd((uu - mean) / std, rows)
                        err = torch.cat([(_flat(o, view, vm) - t).norm(dim=1) for o, t in zip(outs, tg,
                                                                                              strict=True)]) / tn
                        if not last:
                            (grad,) = torch.autograd.grad(err.sum(), uu)
                    e = err.detach().cpu()
                    if ch is not None:
                        ch[it] = e
                    better = (e < cb_e) if keep_best else torch.full_like(e, last, dtype=torch.bool)
                    if bool(better.any()):
                        cb_e = torch.where(better, e, cb_e)
                        cb_u[better.to(cb_u.device)] = u[better.to(u.device)].detach()
                    if last:
                        break
                    with torch.no_grad():
                        g = grad.reshape(len(u), -1)
                        gn = g.norm(dim=1)
                        ok = torch.isfinite(gn)
                        scale = torch.where(ok, step_size / (gn + 1e-10), torch.zeros_like(gn))
                        g = torch.where(ok[:, None], g, torch.zeros_like(g))
                        u = (u - (g * scale[:, None]).view_as(u)).clamp_(0, 1)
            off = 0
            for g_, s, n in chunk:
                best_u[g_, s:s + n] = cb_u[off:off + n]
                best_err[g_, s:s + n] = cb_e[off:off + n]
                if hist is not None:
                    hist[:, g_, s:s + n] = ch[:, off:off + n]
                off += n
    finally:
        for p in params:
            p.requires_grad_(True)
    diverged = ~torch.isfinite(best_err)
    back = [order.index(k) for k in range(n_l)]
    best_u, best_err, diverged = best_u[back], best_err[back], diverged[back]
    if hist is not None:
        hist = hist[:, back]
    pix = best_u.cpu()
    normed = (best_u - mean.unsqueeze(0)) / std.unsqueeze(0)
    return Inversion(images=normed.cpu(), pixels=pix, rel_error=best_err, diverged=diverged, taps=list(taps),
                     history=hist)


def check_pair(vm_a: ViTModel, vm_b: ViTModel) -> None:
    """STIR compares two models on the same images: same input size and the same preprocessing."""
    pa, pb = vm_a.preprocessing, vm_b.preprocessing
    if vm_a.img_size != vm_b.img_size:
        raise InputError(f"STIR needs two models with the same input: {vm_a.name} takes {vm_a.img_size[0]}x"
                         f"{vm_a.img_size[1]} images and {vm_b.name} {vm_b.img_size[0]}x{vm_b.img_size[1]}.")
    if (tuple(pa.mean), tuple(pa.std)) != (tuple(pb.mean), tuple(pb.std)):
        raise InputError(f"STIR needs two models with the same input: {vm_a.name} normalises with mean "
                         f"{tuple(pa.mean)} / std {tuple(pa.std)} and {vm_b.name} with mean {tuple(pb.mean)} / "
                         f"std {tuple(pb.std)}, so the same image would be two different inputs.")


def encoder_digest(vm: ViTModel) -> str:
    """sha256 over the encoder's parameters and buffers (the classifier head left out: no tap but ``logits``
    reads it, and a fine-tuning run's epoch 0 is its start with a new head)."""
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(vm.model.state_dict().items()):
        if k.startswith("head."):
            continue
        h.update(k.encode())
        h.update(str(tuple(v.shape)).encode())
        h.update(v.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def same_weights(vm_a: ViTModel, vm_b: ViTModel, taps: Sequence[str] = ()) -> bool:
    """The same model as far as ``taps`` can tell: the same object, or the same encoder weights (the head counts
    only when a tap reads the logits)."""
    if vm_a is vm_b:
        return True
    if vm_a.model.__class__ is not vm_b.model.__class__:
        return False
    if "logits" in taps:
        return vm_a.weights_digest == vm_b.weights_digest
    return encoder_digest(vm_a) == encoder_digest(vm_b)


def terms_on_host(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`vitscope.metrics.invariance.hsic_terms_both` of every (x, y) pair, wherever the features live, as two
    (len(pairs), 3) float64 host tensors (unbiased, biased): one copy for all of them."""
    terms = [M.hsic_terms_both(x, y) for x, y in pairs]
    unbiased, biased = to_host(torch.stack([u for u, _ in terms]), torch.stack([b for _, b in terms]))
    return unbiased, biased


class StirSums:
    """Summed HSIC_1 terms for STIR(m2[i] | m1[j]) over minibatches: ``sums`` (R repeats, J inverted taps, I
    measured taps, 3) float64 (cross, self clean, self inverted), and ``batches`` / ``images`` / ``diverged``
    (R, J) counts. Merging shards or a resumed part is an addition.

    Beside them, the public STIR code's estimator: ``last`` (R, J, I, 3) the biased terms
    (`vitscope.metrics.invariance.hsic_terms_both`) of the last batch, the one whose ``key`` (its highest image
    id) is largest, and ``last_key`` (R, J) that key (-1: none yet); merging keeps, per (repeat, tap), the part
    with the larger key, so shards and resumed runs pick the batch an uninterrupted run ends with."""

    KEYS = ("sums", "batches", "images", "diverged", "err_sum", "last", "last_key")

    def __init__(self, repeats: int, n_inv: int, n_meas: int):
        self.sums = torch.zeros(repeats, n_inv, n_meas, 3, dtype=torch.float64)
        self.batches = torch.zeros(repeats, n_inv, dtype=torch.long)
        self.images = torch.zeros(repeats, n_inv, dtype=torch.long)
        self.diverged = torch.zeros(repeats, n_inv, dtype=torch.long)
        self.err_sum = torch.zeros(repeats, n_inv, dtype=torch.float64)
        self.last = torch.zeros(repeats, n_inv, n_meas, 3, dtype=torch.float64)
        self.last_key = torch.full((repeats, n_inv), -1, dtype=torch.long)

    def add(self, r: int, j: int, clean: list[torch.Tensor], inverted: list[torch.Tensor],
            keep: torch.Tensor, rel_error: torch.Tensor, key: int = 0) -> None:
        """clean / inverted: per measured tap, (B, F) features of X and of X'_j; keep: (B,) rows whose
        inversion did not diverge (a batch with fewer than 4 of them adds nothing); key: the batch's highest
        image id (which batch is the last)."""
        n_keep = int(keep.sum())
        self.diverged[r, j] += len(keep) - n_keep
        if n_keep < 4:
            return
        newest = int(key) > int(self.last_key[r, j])
        rows = keep.to(clean[0].device)  # the inversion's flags are on the host, the features on their device
        pairs = [(c[rows], v[rows]) for c, v in zip(clean, inverted, strict=True)]
        unbiased, biased = terms_on_host(pairs)
        self.sums[r, j] += unbiased
        if newest:
            self.last[r, j] = biased
        if newest:
            self.last_key[r, j] = int(key)
        self.batches[r, j] += 1
        self.images[r, j] += n_keep
        self.err_sum[r, j] += float(rel_error[keep].double().sum())

    def merge(self, other: StirSums) -> None:
        for k in ("sums", "batches", "images", "diverged", "err_sum"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        theirs = other.last_key > self.last_key
        self.last = torch.where(theirs[..., None, None], other.last, self.last)
        self.last_key = torch.where(theirs, other.last_key, self.last_key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).clone() for k in self.KEYS}

    def load_state_dict(self, state: dict) -> None:
        for k in self.KEYS:
            setattr(self, k, torch.as_tensor(state[k]).clone())

    def values(self, estimator: str = "minibatch_unbiased") -> torch.Tensor:
        """(R, J, I) STIR per repeat (NaN where no batch counted), with ``estimator`` one of
        `vitscope.metrics.invariance.CKA_ESTIMATORS`."""
        M.check_cka_estimator(estimator)
        out = M.stir_from_sums(self.sums if estimator == "minibatch_unbiased" else self.last)
        out[(self.batches == 0)[..., None].expand_as(out)] = math.nan
        return out


def measure(vm: ViTModel, x: torch.Tensor, taps: list[str], view: str) -> list[torch.Tensor]:
    """(B, F) features of ``x`` at each tap, through ``view``, in one inference pass."""
    from vitscope.capture.engine import Capture

    with torch.inference_mode(), Capture(vm, taps) as cap:
        feats = cap(x)
    return [_flat(feats[t], view, vm).clone() for t in taps]


def stir(
    m2: ViTModel,
    m1: ViTModel,
    images: torch.Tensor,
    taps2: str | Sequence[str],
    taps1: str | Sequence[str],
    *,
    iterations: int = DEFAULT_ITERATIONS,
    step_size: float = DEFAULT_STEP,
    repeats: int = 1,
    seed: int = 0,
    view: str = "all",
    match_view: str = "all",
    batch_size: int = 32,
    init: str = "noise",
    cka_estimator: str = "minibatch_unbiased",
) -> pd.DataFrame:
    """STIR(m2[i] | m1[j]) for every i in ``taps2`` and j in ``taps1`` on ``images`` (N, 3, H, W), normalised
    for both models: one inversion of m1 per (j, image, repeat) serves every i; CKA is the minibatch CKA
    (unbiased HSIC_1) over consecutive batches of ``batch_size`` images, summed over all of them; ``view`` is
    the token view CKA compares ('all': every token, as the public STIR code), ``match_view`` the one the
    inversion matches. ``cka_estimator='last_batch_biased'``: the public STIR code's CKA instead, the biased
    linear CKA of the last batch alone. STIR of a model with itself at the same tap is 1 by definition (Nanda
    et al.; Merlin et al. Sec. 3.1); the measured value is in ``measured``.
    Returns columns tap_inverted, tap_measured, stir (mean over repeats), spread (std over repeats),
    measured, repeats, images, diverged, rel_error (mean relative error of the inversions), cka_estimator."""
    taps2 = [taps2] if isinstance(taps2, str) else list(taps2)
    taps1 = [taps1] if isinstance(taps1, str) else list(taps1)
    M.check_cka_estimator(cka_estimator)
    check_pair(m1, m2)
    check_taps(taps1, m1.taps)
    check_taps(taps2, m2.taps)
    sums = StirSums(repeats, len(taps1), len(taps2))
    for s in range(0, len(images), batch_size):
        x = images[s:s + batch_size]
        ids = torch.arange(s, s + len(x))
        clean = measure(m2, x, taps2, view)
        for r in range(repeats):
            inv = invert(m1, x, taps1, iterations=iterations, step_size=step_size, init=init, seed=seed,
                         repeat=r, ids=ids, view=match_view)
            for j in range(len(taps1)):
                feats = measure(m2, inv.images[j], taps2, view)
                sums.add(r, j, clean, feats, ~inv.diverged[j], inv.rel_error[j], key=s + len(x) - 1)
    return stir_table(sums, taps1, taps2, same_weights(m1, m2, taps1 + taps2), cka_estimator)


def stir_table(sums: StirSums, taps_inv: list[str], taps_meas: list[str], same_model: bool,
               cka_estimator: str = "minibatch_unbiased") -> pd.DataFrame:
    """One row per (inverted tap, measured tap); a cell without a single usable batch (every inversion
    diverged) is left out with a warning, so the table holds no NaN."""
    import warnings

    vals = sums.values(cka_estimator)  # (R, J, I)
    rows = []
    for j, tj in enumerate(taps_inv):
        if int(sums.batches[:, j].sum()) == 0:
            warnings.warn(f"STIR: the inversions at {tj} diverged (non-finite error) for "
                          f"{int(sums.diverged[:, j].sum())} images and no batch kept 4 usable ones, so "
                          f"STIR given {tj} is left out.", RuntimeWarning, stacklevel=3)
    for j, tj in enumerate(taps_inv):
        n_img = int(sums.images[:, j].sum())
        err = float(sums.err_sum[:, j].sum() / n_img) if n_img else math.nan
        for i, ti in enumerate(taps_meas):
            v = vals[:, j, i]
            ok = v[torch.isfinite(v)]
            if not len(ok):
                continue
            mean = float(ok.mean()) if len(ok) else math.nan
            spread = float(ok.std(unbiased=True)) if len(ok) > 1 else (0.0 if len(ok) else math.nan)
            value = 1.0 if (same_model and ti == tj) else mean
            rows.append({"tap_inverted": tj, "tap_measured": ti, "stir": value,
                         "spread": 0.0 if (same_model and ti == tj) else spread, "measured": mean,
                         "repeats": len(ok), "images": n_img, "diverged": int(sums.diverged[:, j].sum()),
                         "rel_error": err, "cka_estimator": cka_estimator})
    return pd.DataFrame(rows)
