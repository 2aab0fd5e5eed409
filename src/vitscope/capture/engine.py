"""One forward pass per (model, batch): hooks on the requested taps only, handed to accumulators.

`Capture` is the context manager that owns the hooks (removed on exit, even on error) and runs every
block with timm's eager attention (softmax of q k^T, then times v; the fused SDPA kernel is switched off
for the pass and restored on exit). The ``attn`` tap needs the eager path, and the two paths differ by
float rounding (~1e-7): using one path whatever taps are requested keeps every number independent of what
else a pass captures (a CKA entry computed alone equals the one computed beside attention analyses, bit
for bit). Switching SDPA off only where an ``attn`` tap was requested made cache entries depend on which
study wrote them. The price: a feature-only pass pays eager attention instead of SDPA (up to ~15 % of a
CPU forward at 224 px; on a GPU the (B, H, T, T) probabilities are materialised). Each pass also checks
that what it captured is finite, and names the first tap that is not.
`extract` gathers taps for small interactive use (`dense_features`: over the tiles of one image of any size,
`vitscope.data.tiling`); `stream` is the streaming driver that every study pass goes through.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vitscope.capture.taps import check_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.data.base import batch_parts
from vitscope.errors import STOPPED_BY, VitscopeError

if TYPE_CHECKING:
    from vitscope.analyses.base import Analysis
    from vitscope.data.base import Batch
    from vitscope.data.tiling import DenseFeatures
    from vitscope.models.adapter import ViTModel

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


_ALLOCATOR_TUNED: bool | None = None

_PAUSED = threading.local()


@contextlib.contextmanager
def taps_paused() -> Iterator[None]:
    """Within it, the taps of every open `Capture` record nothing and the early stop does not fire: for an
    analysis that reruns part of the network from captured tensors (head ablation, a gradient pass), so the
    rerun neither overwrites nor holds the pass's tensors. Other hooks on the model (a user's) still run."""
    before = getattr(_PAUSED, "on", False)
    _PAUSED.on = True
    try:
        yield
    finally:
        _PAUSED.on = before


def _recording() -> bool:
    return not getattr(_PAUSED, "on", False)


def tune_allocator() -> bool:
    """Keep freed activation memory in the process (glibc only; once per process).

    glibc hands blocks above its mmap threshold (32 MB at most) back to the OS when they are freed, so
    every forward pass page-faults its large activations (attention maps, MLP hidden states) back in;
    captured taps, held until the analyses have read them, make it worse. Serving all allocations from
    the heap and never trimming it removes that cost: measured here on ViT-S/16, batch 32, 2 cores, a bare
    unfused forward went from 2.3 s to 1.6 s and capturing every tap from 3.0 s to 1.6 s
    (benchmarks/capture_overhead.py prints both). Trimming is off with M_TRIM_THRESHOLD = -1 (mallopt(3): "disables
    trimming completely"); a threshold of 2**31 - 1 still trimmed the heap whenever a pass's captured taps freed
    more than 2 GiB at once (every tap of a ViT-S at batch 32: 600,000 page faults, every tap 1.4x a bare forward
    instead of 1.0x). The price: the process keeps its peak memory.
    Set VITSCOPE_MALLOC_TUNING=0 to leave the allocator alone.
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED is not None:
        return _ALLOCATOR_TUNED
    _ALLOCATOR_TUNED = False
    if os.environ.get("VITSCOPE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        _ALLOCATOR_TUNED = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, -1))
    except (OSError, AttributeError):
        pass
    return _ALLOCATOR_TUNED


class _StopForward(Exception):
    """Raised by the last needed hook: nothing after it is read, so the rest of the pass is skipped."""


class NonFiniteError(VitscopeError, FloatingPointError):
    """A model produced NaN or infinite activations (broken weights, or an overflow in half precision)."""


class Capture:
    """Hooks for ``taps`` on ``vm``; calling it runs one forward pass and returns ``{tap: tensor}``.

    dtype: 'fp32' (default) or 'bf16'/'fp16' autocast; captured tensors are handed out as float32.
    stop_early: end the pass after the deepest requested tap (no head, no later blocks).
    check_finite: raise `NonFiniteError` naming the model and the first tap (in forward order) holding a NaN or
        an infinity (one reduction per tap and batch, one host sync per batch).
    """

    def __init__(self, vm: ViTModel, taps: Sequence[str], dtype: str = "fp32", stop_early: bool = True,
                 check_finite: bool = True):
        check_taps(list(taps), vm.taps)
        if dtype not in DTYPES:
            raise VitscopeError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.vm = vm
        self.taps = list(dict.fromkeys(taps))
        self.dtype = DTYPES[dtype]
        self.stop_early = stop_early
        self.check_finite = check_finite
        self.batches = 0  # forward passes run so far (named in a non-finite error)
        self._store: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._unfused: list[tuple[torch.nn.Module, bool]] = []
        self._active = False

    def _last_block(self) -> int | None:
        if any(parse_tap(t)[0] is None and t != "embed" for t in self.taps):
            return None  # final_norm / logits: the whole pass is needed
        idx = [parse_tap(t)[0] for t in self.taps]
        return max((i for i in idx if i is not None), default=0)

    def __enter__(self) -> Capture:
        tune_allocator()
        try:
            for module in self.vm.model.modules():  # one attention path for every pass (see the module doc)
                if getattr(module, "fused_attn", False) is True:
                    self._unfused.append((module, True))
                    module.fused_attn = False
            for tap in self.taps:
                hp = self.vm.hook_point(tap)
                if hp.needs_unfused is not None and getattr(hp.needs_unfused, "fused_attn", False):
                    self._unfused.append((hp.needs_unfused, True))
                    hp.needs_unfused.fused_attn = False
                self._handles.append(self._register(tap, hp))
            last = self._last_block() if self.stop_early else None
            if last is not None:
                def stop(module: Any, args: Any, out: Any) -> None:
                    if _recording():
                        raise _StopForward
                self._handles.append(self.vm.model.blocks[last].register_forward_hook(stop))
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def _register(self, tap: str, hp: Any) -> Any:
        store, get = self._store, hp.get
        if hp.when == "pre":
            def pre(m: Any, args: Any) -> None:
                if _recording():
                    store[tap] = get(args, None)
            return hp.module.register_forward_pre_hook(pre)

        def post(m: Any, args: Any, out: Any) -> None:
            if _recording():
                store[tap] = get(args, out)
        return hp.module.register_forward_hook(post)

    def _restore(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module, flag in self._unfused:
            module.fused_attn = flag
        self._unfused.clear()
        self._active = False

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self._active:
            raise VitscopeError("use Capture as a context manager: `with Capture(vm, taps) as cap: cap(x)`")
        self.vm.check_input(x)
        self._store.clear()
        device = next(self.vm.model.parameters()).device
        x = x.to(device)
        autocast = (torch.autocast(device.type, dtype=self.dtype) if self.dtype != torch.float32
                    else contextlib.nullcontext())
        with torch.inference_mode(), autocast, self.vm.input_size(*x.shape[-2:]):
            try:
                self.vm.model(x)
            except _StopForward:
                pass
        out = dict(self._store)
        self._store.clear()
        self.batches += 1
        if self.check_finite and out:
            self._check_finite(out)
        if self.dtype != torch.float32:
            out = {k: v.float() for k, v in out.items()}
        return out

    def _check_finite(self, out: dict[str, torch.Tensor]) -> None:
        """One sum per tap (NaN and inf survive a sum), one host sync; the slow exact test only on failure.
        ``out`` is in forward order (hooks fire in that order), so the first failing tap is where it starts."""
        sums = torch.stack([v.detach().float().sum() for v in out.values()])
        if bool(torch.isfinite(sums).all()):
            return
        for tap, v in out.items():
            if not bool(torch.isfinite(v).all()):
                cast = "" if self.dtype == torch.float32 else " (it runs in half precision: try dtype=fp32)"
                raise NonFiniteError(f"model {self.vm.name!r} produces non-finite activations (NaN or inf) from "
                                     f"tap {tap} on, in batch {self.batches - 1} of this pass{cast}; its "
                                     "weights are likely broken")


def check_view(vm: ViTModel, view: str) -> None:
    """A token view ``vm`` can give, checked before any forward pass: one sentence otherwise, naming the views it
    can give (a model without a CLS token, such as an Eva built with ``class_token=False``, has no 'cls')."""
    from vitscope.capture.views import VIEWS

    if view == "cls" and not (vm.has_cls_token and vm.num_prefix_tokens > 0):
        npt = vm.num_prefix_tokens
        if npt == 0:
            what = "it has no prefix tokens"
        else:
            what = f"its {npt} prefix token{' is a register' if npt == 1 else 's are registers'}"
        raise VitscopeError(f"{vm.name} has no CLS token ({what}); the token views it gives are "
                            f"{', '.join(repr(v) for v in VIEWS if v != 'cls')}")
    if view not in VIEWS:
        raise VitscopeError(f"unknown token view {view!r}; choose one of {', '.join(VIEWS)}")


def extract(
    vm: ViTModel,
    images: Any,
    taps: Sequence[str] | str,
    *,
    view: str | None = None,
    batch_size: int = 32,
    dtype: str = "fp32",
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Captured taps for a few images, concatenated on the CPU: ``{tap: (N, ...)}``.

    images: a (N, 3, H, W) tensor already preprocessed for ``vm``, or a list of PIL images / file
    paths (preprocessed with the model's own transform), or an iterable of such batches.
    view: apply a token view ('cls', 'gap', 'gap_spatial', 'spatial') to (B, T, D) taps as they arrive.
    Everything is kept in memory: for many images, use an analysis (`stream`) instead.
    """
    if isinstance(taps, str):
        taps = [taps]
    if view is not None:
        check_view(vm, view)
    parts: dict[str, list[torch.Tensor]] = {t: [] for t in taps}
    with Capture(vm, taps, dtype=dtype) as cap:
        for x in _progress(_image_batches(vm, images, batch_size), progress, vm.name):
            for t, v in cap(x).items():
                if view is not None and v.ndim == 3:
                    v = token_view(v, view, vm.num_prefix_tokens, vm.has_cls_token)
                parts[t].append(v.detach().cpu())
    if not any(parts.values()):
        raise VitscopeError("no images were given")
    return {t: torch.cat(v) for t, v in parts.items()}


def dense_features(vm: ViTModel, image: Any, tap: str | None = None, scale: int = 2, batch_size: int = 16,
                   dtype: str = "fp32") -> DenseFeatures:
    """Dense features of one image of any size (`vitscope.data.tiling`): resized (`tiling_size`), tiled, one
    forward per tile (`extract`, ``view='spatial'``), assembled. ``image``: a `Sample`, PIL image, (H, W, 3)
    array (uint8 or float in [0, 1]) or (3, H, W) tensor in [0, 1]; ``tap``: default the last block's output."""
    import numpy as np

    from vitscope.data.tiling import DenseFeatures, as_sample, assemble, cut_tiles, plan_tiles, tiling_size
    from vitscope.data.transforms import as_float, normalize, resize
    from vitscope.errors import InputError

    tile, patch = vm.img_size[0], vm.patch_size
    if vm.img_size[0] != vm.img_size[1]:
        raise InputError(f"tiling needs a square model input; {vm.name} takes {vm.img_size}")
    tap = tap or f"block{vm.depth - 1}.out"
    s = as_sample(image)
    h, w = tiling_size(*s.size, tile, patch, scale)
    s = resize(s, h, w, vm.preprocessing.interpolation)
    x = normalize(torch.from_numpy(np.ascontiguousarray(as_float(s.image))).permute(2, 0, 1)[None],
                  vm.preprocessing)[0]
    plan = plan_tiles(h, w, tile, patch)
    tokens = extract(vm, cut_tiles(x, plan), [tap], view="spatial", batch_size=batch_size, dtype=dtype)[tap]
    gh, gw = vm.grid_size
    if tokens.ndim != 3 or tokens.shape[1] != gh * gw:
        raise InputError(f"tap {tap!r} does not give one token per patch (shape {tuple(tokens.shape)})")
    return DenseFeatures(assemble(plan, tokens.reshape(len(plan.tiles), gh, gw, -1)), patch, plan, s.geometry)


def stream(
    vm: ViTModel,
    batches: Iterable[Batch],
    analyses: Sequence[Analysis],
    *,
    dtype: str = "fp32",
    progress: bool = True,
    total: int | None = None,
    on_batch: Callable[[int], None] | None = None,
    first: int = 0,
    seen: list[int] | None = None,
    desc: str | None = None,
    timings: dict[str, float] | None = None,
) -> int:
    """The one pass: every batch goes through the model once; each analysis gets the taps it asked for.

    first: the number of the first batch of ``batches`` (a resumed pass starts past 0).
    batches may hold None for a batch with no images (it still counts in the numbering).
    seen: per analysis, how many leading batches it has already been fed; batch b goes to analysis k only if
        seen[k] <= b. The list is updated in place right after each update, so a caller that catches an
        exception knows exactly which batches each analysis has seen (the study saves that for resume).
    on_batch(b) is called after batch b has been fed to every analysis. total: the number of images, for the
    progress bar (in images/s, with ETA). timings: if given, seconds are added under 'data' (waiting for the next
    batch), 'forward' (the capture pass) and under each analysis's name (its updates). On a GPU, 'forward' and the
    updates count the time to queue the work; the time the GPU takes shows where the host waits for it (at most
    once per batch, in an update). Returns the number of batches processed.
    """
    wanted: list[str] = []
    for a in analyses:
        for t in a.required_taps():
            if t not in wanted:
                wanted.append(t)
    seen = seen if seen is not None else [first] * len(analyses)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="img", desc=desc or vm.name, leave=False, dynamic_ncols=True)
    n = 0
    if timings is not None:
        batches = _timed(batches, timings)
    try:
        with Capture(vm, wanted, dtype=dtype) as cap:
            for b, batch in enumerate(batches, start=first):
                if batch is None:  # a chunk none of whose images could be read: counted, nothing to feed
                    for k in range(len(analyses)):
                        seen[k] = max(seen[k], b + 1)
                    if on_batch is not None:
                        on_batch(b)
                    continue
                t0 = time.perf_counter()
                # a chunk of whole frames of different sizes is a RaggedBatch: one forward per size, every part
                # captured before any analysis sees the chunk (an analysis sees all of it or none of it)
                parts = batch_parts(batch)
                feats = [cap(p.images) for p in parts]
                if timings is not None:
                    t1 = time.perf_counter()
                    timings["forward"] = timings.get("forward", 0.0) + t1 - t0
                for k, a in enumerate(analyses):
                    if seen[k] <= b:
                        for part, f in zip(parts, feats, strict=True):
                            a.update(_Subset(f, a.required_taps()), part)
                        seen[k] = b + 1
                        if timings is not None:
                            t0, t1 = t1, time.perf_counter()
                            timings[a.name] = timings.get(a.name, 0.0) + t1 - t0
                if bar is not None:
                    bar.update(len(batch))
                if on_batch is not None:
                    on_batch(b)
                n += 1
                if STOPPED_BY:  # a stop signal whose KeyboardInterrupt was lost (see `errors.STOPPED_BY`)
                    raise KeyboardInterrupt
    finally:
        if bar is not None:
            bar.close()
    return n


def _timed(batches: Iterable[Any], timings: dict[str, float]) -> Iterator[Any]:
    """``batches``, adding the seconds spent waiting for each one to ``timings['data']``."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        finally:
            timings["data"] = timings.get("data", 0.0) + time.perf_counter() - t0
        yield batch


class _Subset(Mapping[str, torch.Tensor]):
    """Read-only view of the captured taps that one analysis asked for."""

    def __init__(self, feats: dict[str, torch.Tensor], keys: Sequence[str]):
        self._feats, self._keys = feats, list(keys)

    def __getitem__(self, k: str) -> torch.Tensor:
        if k not in self._keys:
            raise KeyError(f"tap {k!r} was not declared by this analysis's required_taps()")
        return self._feats[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _image_batches(vm: ViTModel, images: Any, batch_size: int) -> Iterator[torch.Tensor]:
    from vitscope.data.preprocess import load_images

    if isinstance(images, torch.Tensor):
        if images.ndim == 3:
            images = images[None]
        for i in range(0, len(images), batch_size):
            yield images[i:i + batch_size]
        return
    if isinstance(images, list | tuple) and images and not isinstance(images[0], torch.Tensor):
        for i in range(0, len(images), batch_size):
            yield load_images(images[i:i + batch_size], vm.preprocessing)
        return
    for b in images:
        if isinstance(b, torch.Tensor):
            yield b
        else:
            yield from (p.images for p in batch_parts(b))


def _progress(it: Iterable[Any], enabled: bool, desc: str) -> Iterable[Any]:
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="batch", leave=False)
