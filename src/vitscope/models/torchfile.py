"""What a PyTorch file (``torch.save``: a zip archive, or the legacy stream of pickles) asks of memory, read
before `torch.load` runs: its pickle is walked by an unpickler that imports nothing and calls nothing (every
global it names becomes an inert stand-in), so the sizes the file declares are known before any tensor exists.

Why: a few kilobytes of pickle, using only globals ``torch.load(weights_only=True)`` allows, can make loading
allocate gigabytes. The legacy format allocates each storage at its declared size before reading its bytes, and
resizes a storage to fit a tensor that reaches past it; ``torch._utils._rebuild_qtensor`` allocates a quantized
tensor at its declared shape before viewing the storage; ``_rebuild_device_tensor_from_cpu_tensor`` copies a
tensor (a stride-0 view of one number can claim any shape) into a new dtype; a zip record can be compressed.
Saved tensors never need more memory than the file holds bytes (twice that for a quantized tensor, built beside
its storage), so `check_memory` refuses, in one sentence, a file whose tensors ask for more.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from vitscope.errors import CheckpointError, first_line
from vitscope.files import human

#: what loading may allocate, as a multiple of the file's size (plus `SLACK` bytes): a saved tensor's storage is
#: at most the file, a quantized tensor's rebuild allocates its size once more
FACTOR, SLACK = 2, 1 << 20

_TENSOR_REBUILDS = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_qtensor"}


class _Stub:
    """An instance of a global the file names: its call's arguments, its state and items kept, nothing run."""

    where = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        obj = object.__new__(cls)
        obj.args, obj.state, obj.items = args, None, {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)


class _Storage:
    """A storage the file declares (a persistent id): its key and size in bytes, its elements' size."""

    def __init__(self, key: str, nbytes: int, itemsize: int) -> None:
        self.key, self.nbytes, self.itemsize = key, nbytes, itemsize


def _itemsize(obj: Any, default: int = 1) -> int:
    """Bytes per element of a storage class or dtype the pickle names (looked up in torch's tables, nothing
    called)."""
    import torch

    name = getattr(obj, "where", "")
    module, _, attr = name.rpartition(".")
    if module == "torch" and attr.endswith("Storage") and attr != "UntypedStorage":
        try:
            return int(torch.serialization.StorageType(attr).dtype.itemsize)
        except (KeyError, AttributeError, RuntimeError):
            return default
    if module == "torch" and isinstance(getattr(torch, attr, None), torch.dtype):
        return int(getattr(torch, attr).itemsize)
    return default


class _Inert(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The pure-Python unpickler (a dict memo: no table sized by an index the file gives), every global an
    inert `_Stub` class (OrderedDict excepted, which is a plain container), every persistent id a `_Storage`."""

    def __init__(self, f: Any, legacy: bool) -> None:
        super().__init__(f)
        self.legacy = legacy
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        return type(str(name), (_Stub,), {"where": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage")):
            return _Stub()  # a module source or anything else: torch refuses what it does not know
        storage_type, key, numel = pid[1], str(pid[2]), pid[4]
        itemsize = _itemsize(storage_type)
        nbytes = numel * itemsize if isinstance(numel, int) and numel >= 0 else 0
        st = self.storages.get(key)
        if st is None or nbytes > st.nbytes:
            st = self.storages[key] = _Storage(key, nbytes, itemsize)
        return st


def _ints(x: Any) -> tuple[int, ...] | None:
    if isinstance(x, _Stub) and x.where == "torch.Size" and x.args:
        x = x.args[0]
    if isinstance(x, tuple | list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        return tuple(x)
    return None


def _shape(obj: Any) -> tuple[int, ...] | None:
    """The shape of a tensor the pickle rebuilds (through a Parameter), or None."""
    if not isinstance(obj, _Stub):
        return None
    fn = obj.where.rpartition(".")[2]
    if fn == "_rebuild_parameter" or fn == "_rebuild_parameter_with_state":
        return _shape(obj.args[0]) if obj.args else None
    if fn in _TENSOR_REBUILDS and len(obj.args) >= 3:
        return _ints(obj.args[2])
    return None


def _walk(root: Any, limit: int = 10_000_000) -> list[Any]:
    """Every object reachable from ``root`` (once each: a pickle can refer to itself)."""
    seen: set[int] = set()
    out, todo = [], [root]
    while todo and len(out) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None)):
            continue
        seen.add(id(obj))
        out.append(obj)
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            todo += list(obj)
        elif isinstance(obj, _Stub):
            todo += [*obj.args, obj.state, *obj.items.values()]
    return out


def _asked_bytes(root: Any, storages: dict[str, _Storage]) -> int:
    """Bytes loading would allocate: the storages, what tensors reaching past theirs resize them to, quantized
    tensors (allocated at their shape), and copies into a new dtype."""
    asked = sum(s.nbytes for s in storages.values())
    for obj in _walk(root):
        if not isinstance(obj, _Stub):
            continue
        fn = obj.where.rpartition(".")[2]
        if fn in _TENSOR_REBUILDS and len(obj.args) >= 4 and isinstance(obj.args[0], _Storage):
            st, offset, size, stride = obj.args[0], obj.args[1], _ints(obj.args[2]), _ints(obj.args[3])
            itemsize = _itemsize(obj.args[6], st.itemsize) if fn == "_rebuild_tensor_v3" and len(obj.args) > 6 \
                else st.itemsize
            if size is None or any(s < 0 for s in size):
                continue
            if fn == "_rebuild_qtensor":
                asked += math.prod(size) * itemsize
            if stride is not None and isinstance(offset, int) and len(stride) == len(size) and all(size):
                extent = (offset + sum((s - 1) * abs(t) for s, t in zip(size, stride, strict=True)) + 1) * itemsize
                if extent > st.nbytes:
                    asked += extent
        elif fn == "_rebuild_device_tensor_from_cpu_tensor" and obj.args:
            size = _shape(obj.args[0])
            if size is not None and all(s >= 0 for s in size):
                asked += math.prod(size) * _itemsize(obj.args[1] if len(obj.args) > 1 else None, 8)
    return asked


def _read(path: Path) -> tuple[Any, dict[str, _Storage]]:
    """(the object the file pickles, as stand-ins; the storages it declares)."""
    size = path.stat().st_size
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            unpacked = sum(i.file_size for i in infos)
            if unpacked > size:
                raise CheckpointError(
                    f"{str(path)!r} is not a checkpoint to load: its archive unpacks to {human(unpacked)} from a "
                    f"file of {human(size)} (torch.save writes its records uncompressed); the file is corrupt "
                    "or made to exhaust memory")
            pkl = [i for i in infos if i.filename.endswith("data.pkl")]
            if not pkl:
                raise CheckpointError(f"{str(path)!r} is a zip archive without the data.pkl of a PyTorch file; the "
                                      "file is corrupt or of another kind")
            data = z.read(pkl[0])
        u = _Inert(io.BytesIO(data), legacy=False)
        return u.load(), u.storages
    with open(path, "rb") as f:
        for _ in range(3):  # magic number, protocol version, system info
            _Inert(f, legacy=True).load()
        u = _Inert(f, legacy=True)
        return u.load(), u.storages


#: the globals through which a zip-format file can ask for more memory than its records hold (elsewhere torch
#: itself refuses a storage whose declared size differs from its record, or a tensor reaching past its storage)
_ALLOCATING = (b"_rebuild_qtensor", b"_rebuild_device_tensor_from_cpu_tensor")


def check_memory(path: str | Path, quick: bool = False) -> Any:
    """Refuse, in one CheckpointError sentence naming the file, a PyTorch file whose tensors ask for more memory
    than `FACTOR` times its size; returns the stand-in of what it pickles (for `declared_shapes`). ``quick``: a
    zip-format file whose records unpack within its size and whose pickle names none of `_ALLOCATING` is passed
    without walking its pickle (returns None): what vitscope's own cache writes, checked in a fraction of the
    walk's time (a pickle can only name a global by spelling it)."""
    path = Path(path)
    size = path.stat().st_size
    if quick and zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                infos = z.infolist()
                pkl = [i for i in infos if i.filename.endswith("data.pkl")]
                if pkl and sum(i.file_size for i in infos) <= size:
                    data = z.read(pkl[0])
                    if not any(name in data for name in _ALLOCATING):
                        return None
        except Exception:  # noqa: BLE001 - the full check below says what is wrong
            pass
    try:
        root, storages = _read(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load would fail on it too
        raise CheckpointError(f"could not read {str(path)!r} as a checkpoint ({type(e).__name__}: {first_line(e)}); "
                              "the file is corrupt or truncated") from None
    asked = _asked_bytes(root, storages)
    if asked > FACTOR * size + SLACK:
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint to load: its tensors ask for {human(asked)} of memory from a file "
            f"of {human(size)}, more than saved tensors ever need; the file is corrupt or made to exhaust memory")
    return root


def declared_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors of a PyTorch state-dict file (also under ``state_dict``), read from its
    pickle alone after `check_memory`; no tensor is built."""
    root = check_memory(path)
    if isinstance(root, dict) and isinstance(root.get("state_dict"), dict):
        root = root["state_dict"]
    items = root.items if isinstance(root, _Stub) else root
    if not isinstance(items, dict):
        return {}
    return {str(k): s for k, v in items.items() if (s := _shape(v)) is not None}
