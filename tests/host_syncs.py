"""Count the points where code waits for the accelerator: the tensor operations that copy a value to the host
(``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a tensor as a Python bool / int / float / array, ``.to``
a CPU device) or whose output size depends on the values (``nonzero``, ``unique``, boolean indexing, ...), each
of which stalls a GPU until its queue drains. On the CPU none of them waits, but they are the same calls: counted
here by a `TorchFunctionMode`, so the rule "at most one host synchronisation per batch" is tested without a GPU.
The one call not seen on a CPU: ``.to(device)`` of a tensor already on that device (free), so code copies to
the host with ``.cpu()`` (always counted) and moves state to the features' device with ``.to(device)``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# methods that hand a value to Python or NumPy
_TO_HOST = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__"}
# operations whose output size depends on the values (the host must see them to allocate the output)
_DATA_SIZED = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere", "bincount", "histc",
               "repeat_interleave", "nonzero_static"}


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name in _TO_HOST or name in _DATA_SIZED:
        return not (name == "nonzero_static" or (name == "repeat_interleave" and "output_size" in kwargs))
    if name == "to":  # a copy to another device; ``.to(x.device)`` of a tensor already there is free
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return src is not None and any(torch.device(a) != src.device for a in targets)
    if name == "__getitem__" and len(args) > 1:  # boolean-mask indexing
        keys = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys)
    return False


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as s: ...`` -> ``s.count`` host synchronisations, ``s.where`` by operation name."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.where[getattr(func, "__name__", str(func))] += 1
        return func(*args, **kwargs)
