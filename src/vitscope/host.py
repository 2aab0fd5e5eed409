"""One copy to the host for everything a batch hands back.

Analyses keep their sums on the features' device (a GPU: the pass never waits for it); what must reach the host
per batch (pooled vectors for a store, a few counts for a Python decision) is gathered into one transfer:
`to_host` packs the tensors' bytes into one buffer on their device, copies it with one ``.cpu()`` and unpacks
views of it (exact: bytes, not values, are moved), so a batch costs one synchronisation however many tensors
it returns. On the CPU the packing is one small extra copy, and the same code runs as on a GPU.
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors, copied to the host in one transfer (same dtypes, shapes and values; detached, contiguous,
    each with its own storage)."""
    if not tensors:
        return ()
    dev = tensors[0].device
    parts, spans, at = [], [], 0
    for t in tensors:
        raw = t.detach().to(dev).contiguous().reshape(-1).view(torch.uint8)  # a bool or int tensor's bytes too
        pad = -len(raw) % _ALIGN  # each part starts on an 8-byte boundary, so any dtype can view it
        parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=dev)] if pad else [raw]
        spans.append((at, len(raw)))
        at += len(raw) + pad
    packed = torch.cat(parts).cpu()
    # each its own storage (a copy on the host): views of one buffer as several dtypes could not be saved together
    return tuple(packed[a:a + n].view(t.dtype).reshape(t.shape).clone()
                 for t, (a, n) in zip(tensors, spans, strict=True))


_ALIGN = 8
