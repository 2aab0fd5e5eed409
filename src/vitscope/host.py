"""Where an analysis's tensors live, and one copy to the host for everything a batch hands back.

Analyses keep their sums on the features' device (a GPU: the pass never waits for it) and hand out CPU copies
in ``state_dict`` (the cache is device-independent). What must reach the host per batch (pooled vectors for a
store, a few numbers for a Python decision) is gathered into one transfer: `to_host` packs the device tensors'
bytes into one buffer there, copies it with one ``.cpu()`` and unpacks it (exact: bytes, not values, are
moved), so a batch costs one synchronisation however many tensors it returns; tensors already on the host
(a batch's ids and labels, where the loader leaves them) are copied on the host and wait for nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

_ALIGN = 8  # each packed part starts on an 8-byte boundary, so any dtype can view it

#: whether code may take a cheaper path where reading a value back costs nothing (the CPU: e.g. recomputing only
#: the rows a test selects, found with ``nonzero``); tests/test_host_syncs.py turns it off to count a GPU's path
CPU_READS = True


def reads_are_free(device: torch.device | str) -> bool:
    """Reading a tensor's values on ``device`` waits for nothing (the CPU), so a data-dependent path is cheapest."""
    return CPU_READS and torch.device(device).type == "cpu"


def to_host(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors on the host, those on a device in one transfer (same dtypes, shapes and values; detached,
    contiguous, each with its own storage); None stays None."""
    away = [t for t in tensors if t is not None and t.device.type != "cpu"]
    back = iter(_packed_to_host(away) if away else ())
    return tuple(None if t is None else next(back) if t.device.type != "cpu" else t.detach().contiguous().clone()
                 for t in tensors)


def _packed_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors of one device, copied to the host with one ``.cpu()`` of their bytes packed together."""
    dev = tensors[0].device
    parts, spans, at = [], [], 0
    for t in tensors:
        raw = t.detach().to(dev).contiguous().reshape(-1).view(torch.uint8)  # a bool or int tensor's bytes too
        pad = -len(raw) % _ALIGN
        parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=dev)] if pad else [raw]
        spans.append((at, len(raw)))
        at += len(raw) + pad
    packed = torch.cat(parts).cpu()
    # each its own storage (a copy on the host): views of one buffer as several dtypes could not be saved together
    return [packed[a:a + n].view(t.dtype).reshape(t.shape).clone() for t, (a, n) in zip(tensors, spans, strict=True)]


def on_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a no-op when it is there already. From the host (a batch's labels or masks, a state
    read from the cache) without waiting for the device's queue: a copy from the host is staged at once, so
    ``non_blocking`` is safe in that direction (not in the other: a copy to the host waits for its data)."""
    return t.to(device, non_blocking=t.device.type == "cpu")


def moved(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in it (through dicts, lists and tuples) `on_device`."""
    return _each_tensor(obj, lambda t: on_device(t, device))


def host_copies(obj: Any) -> Any:
    """``obj`` with every tensor in it (through dicts, lists and tuples) a `host_copy`: a state to hand out."""
    return _each_tensor(obj, host_copy)


def _each_tensor(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt with ``fn`` of every tensor in it, through dicts, lists and tuples; a module's state dict
    keeps its ``_metadata`` (the modules' versions `load_state_dict` reads)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: _each_tensor(v, fn) for k, v in obj.items()}
        if hasattr(obj, "_metadata"):
            out = OrderedDict(out)
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_each_tensor(v, fn) for v in obj)
    return obj


def on_host(t: torch.Tensor) -> torch.Tensor:
    """A batch's metadata (ids, labels, split flags) on the host, where the loader leaves it: no copy then."""
    return t if t.device.type == "cpu" else t.cpu()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a state tensor on the CPU (the cache is device-independent: a state saved on a GPU loads on a
    CPU machine); a copy also when it is on the CPU already, so the state handed out is not the live one."""
    return t.detach().to("cpu", copy=True)


def free_memory(device: str) -> int | None:
    """Bytes free on ``device`` now: a GPU's free memory (``torch.cuda.mem_get_info``), else the machine's
    available RAM (psutil, or /proc/meminfo); None when it cannot be told."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev.index or 0)[0])
    if dev.type != "cpu":
        return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
