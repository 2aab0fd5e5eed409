"""The content-addressed cache of accumulator states, shared by every study that points at it.

    <cache_dir>/<model key>/<analysis>-<analysis key>.pt            finished state (+ meta)
    <cache_dir>/<model key>/<analysis>-<analysis key>.part-<r>of<w>.pt   partial state of shard r (resume)

The model key hashes what determines the weights and the inputs without loading the model (registry
entry or timm name, architecture arguments, weight source with the file's size and mtime, seed of a
random init, preprocessing); the analysis key adds the analysis name and parameters, the dataset spec,
the dtype and the vitscope version. Writes go to a temporary file renamed into place, so a killed run
never leaves a corrupt entry; a file lock per model directory keeps two runs from interleaving writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from vitscope.models.registry import ModelSpec


def digest(*parts: Any) -> str:
    from vitscope import __version__

    blob = json.dumps([__version__, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_key(spec: ModelSpec, weights: str | None, pretrained: bool, checkpoint_format: str, seed: int,
              kwargs: dict[str, Any]) -> str:
    src: Any = weights
    local_dir = weights or (spec.weights.location if pretrained and spec.weights.kind == "hf" else None)
    if weights and "://" not in weights and Path(weights).is_file():
        st = Path(weights).stat()
        src = [str(Path(weights).resolve()), st.st_size, st.st_mtime_ns]
    elif local_dir and Path(local_dir).is_dir():  # a transformers checkpoint directory: its files
        files = sorted(f for f in Path(local_dir).iterdir() if f.is_file())
        src = [str(Path(local_dir).resolve())] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    elif not weights and pretrained and spec.weights.kind == "file":  # shipped weights: their content decides
        from vitscope.models.load import package_file

        f = package_file(spec.weights.location)
        src = hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None
    return digest(asdict(spec), src, pretrained, checkpoint_format, seed if (not pretrained and not weights) else None,
                  kwargs)


def default_cache_dir(output_dir: str | Path) -> Path:
    """Where a study keeps its cache when the config names none: inside its own run directory."""
    return Path(output_dir) / "cache"


class Cache:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _dir(self, mkey: str) -> Path:
        d = self.root / mkey
        d.mkdir(parents=True, exist_ok=True)
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
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # noqa: BLE001 - an unreadable entry is recomputed, never trusted
            return None

    def save(self, path: Path, entry: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(entry, tmp)
        tmp.replace(path)
