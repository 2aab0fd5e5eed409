"""The content-addressed cache of accumulator states, shared by every study that points at it.

    <cache_dir>/<model key>/<analysis>-<analysis key>.pt            finished state (+ meta)
    <cache_dir>/<model key>/<analysis>-<analysis key>.part-<r>of<w>.pt   partial state of shard r (resume)

The model key hashes what determines the weights and the inputs without loading the model (registry
entry or timm name, architecture arguments, weight source with the file's `file_fingerprint`, seed of a
random init, preprocessing); the analysis key adds the analysis name and parameters, the dataset spec,
the dtype and the vitscope version. Writes go to a temporary file renamed into place, so a killed run
never leaves a corrupt entry; a file lock per model directory keeps two runs from interleaving writes.

Entries are data, never code: tensors, numbers, strings, bools, None and their lists, tuples and dicts,
read back with ``torch.load(weights_only=True)`` (no class or function is on its allow-list), and the
finished table as parquet bytes in a uint8 tensor. An entry holding anything else (a pickled object, a
file of another format) is not read: it is recomputed and overwritten. ``mmap=True`` maps the tensors
of an entry instead of reading them (the semantics analysis's pooled features).

The default location is per user (`default_cache_dir`), never a directory other users can write to.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from vitscope.errors import first_line
from vitscope.files import disk_error, write_atomic
from vitscope.models.registry import ModelSpec

log = logging.getLogger(__name__)

#: layout of an entry on disk; entries of another format are recomputed
FORMAT = 2


def digest(*parts: Any) -> str:
    from vitscope import __version__

    blob = json.dumps([__version__, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: bytes read from each end of a weights file for its fingerprint
FINGERPRINT_BYTES = 1 << 20


def file_fingerprint(path: str | Path) -> list[Any]:
    """What decides a local weights file's content, cheaply: its size, mtime (ns) and the sha256 of its first and
    last MiB. A file replaced by other weights changes it (even copied with its size and mtime kept), so the
    results computed from the old file are not reused."""
    p = Path(path)
    st = p.stat()
    h = hashlib.sha256()
    with p.open("rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        if st.st_size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, st.st_size - FINGERPRINT_BYTES))
            h.update(f.read(FINGERPRINT_BYTES))
    return [st.st_size, st.st_mtime_ns, h.hexdigest()]


def model_key(spec: ModelSpec, weights: str | None, pretrained: bool, checkpoint_format: str, seed: int,
              kwargs: dict[str, Any]) -> str:
    """``weights``: the local file or transformers directory the entry loads (its name when that is a file,
    `vitscope.models.load.file_given`), whose content fingerprint is part of the key."""
    src: Any = weights
    local_dir = weights or (spec.weights.location if pretrained and spec.weights.kind == "hf" else None)
    if weights and "://" not in weights and Path(weights).is_file():
        src = [str(Path(weights).resolve()), *file_fingerprint(weights)]
    elif local_dir and Path(local_dir).is_dir():  # a transformers checkpoint directory: its files
        files = sorted(f for f in Path(local_dir).iterdir() if f.is_file())
        src = [str(Path(local_dir).resolve())] + [[f.name, *file_fingerprint(f)] for f in files]
    elif not weights and pretrained and spec.weights.kind == "file":  # shipped weights: their content decides
        from vitscope.models.load import package_file

        f = package_file(spec.weights.location)
        src = hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None
    return digest(asdict(spec), src, pretrained, checkpoint_format, seed if (not pretrained and not weights) else None,
                  kwargs)


def user_cache_root() -> Path | None:
    """vitscope's folder in this user's cache directory: ``$VITSCOPE_CACHE_DIR`` if set, else the platform's
    (``$XDG_CACHE_HOME/vitscope`` or ``~/.cache/vitscope`` on Linux, ``~/Library/Caches/vitscope`` on macOS,
    ``%LOCALAPPDATA%/vitscope`` on Windows); None when there is no home directory to put it in."""
    env = os.environ.get("VITSCOPE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "vitscope"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute() and sys.platform != "darwin":
        return Path(xdg) / "vitscope"
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        return None
    if not home.is_dir():
        return None
    return home / ("Library/Caches" if sys.platform == "darwin" else ".cache") / "vitscope"


def default_cache_dir(output_dir: str | Path) -> Path:
    """Where a study keeps its states when the config names no ``cache_dir``: ``<user cache>/states``, shared
    by every study of this user (the keys are content hashes, so sharing is safe and is the point), and
    never a directory other users can write to; inside the run directory (``<output_dir>/cache``) when the
    user has no cache directory."""
    root = user_cache_root()
    return root / "states" if root is not None else Path(output_dir) / "cache"


class Cache:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._swept: set[str] = set()

    def _dir(self, mkey: str) -> Path:
        d = self.root / mkey
        if not d.is_dir():
            try:
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
                d.mkdir(exist_ok=True)
            except OSError as e:
                raise disk_error(e, self.root) from e
        elif mkey not in self._swept:
            _sweep_temporaries(d)
        self._swept.add(mkey)
        return d

    def lock(self, mkey: str) -> FileLock:
        return FileLock(str(self._dir(mkey) / ".lock"), timeout=-1)

    def path(self, mkey: str, name: str, akey: str, shard: tuple[int, int] | None = None) -> Path:
        suffix = "" if shard is None else f".part-{shard[0]}of{shard[1]}"
        return self._dir(mkey) / f"{name}-{akey}{suffix}.pt"

    def store_dir(self, mkey: str, *parts: str) -> Path:
        """A directory for an analysis's reusable products under a model's key (e.g. inversions)."""
        d = self._dir(mkey) / "store" / digest(*parts)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def load(self, path: Path) -> dict[str, Any] | None:
        """The entry at ``path``, or None when there is none or it is not a readable data-only entry."""
        if not path.is_file():
            return None
        try:
            entry = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                raise ValueError(f"not a vitscope cache entry of format {FORMAT}")
            frame = entry.get("frame")
            if frame is not None:
                import pandas as pd

                entry["frame"] = pd.read_parquet(io.BytesIO(frame.numpy().tobytes()))
            return entry
        except Exception as e:  # noqa: BLE001 - an unreadable entry is recomputed, never trusted
            log.warning("ignoring cache entry %s (%s); it is recomputed", path, first_line(e))
            return None

    def save(self, path: Path, entry: dict[str, Any]) -> None:
        entry = {**entry, "format": FORMAT}
        frame = entry.get("frame")
        if frame is not None:  # the table as parquet bytes: data, read back without unpickling
            buf = io.BytesIO()
            frame.to_parquet(buf, index=False)
            entry["frame"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        write_atomic(path, lambda f: torch.save(entry, f))


def _sweep_temporaries(d: Path, older_than: float = 3600.0) -> None:
    """Remove temporary files a killed writer left behind (an hour old: no write in progress takes that long)."""
    import time

    now = time.time()
    for tmp in d.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > older_than:
                tmp.unlink()
        except OSError:
            pass
