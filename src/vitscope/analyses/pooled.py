"""The pooled-feature store: one float16 vector per row (image, object or part) and layer, on disk.

A `PooledTable` keeps, per layer, a ``(rows, D)`` float16 matrix in an anonymous memory-mapped file
(created in ``$VITSCOPE_TMPDIR`` or the system temp folder and unlinked at once, so nothing is left behind),
plus small per-row columns in RAM: image id, label, test-split flag. Resident memory stays bounded by
what the OS keeps in its page cache, not by the number of images, so k-NN, probes and k-means on tens of
thousands of images need a few GB at most. `state_dict` hands out tensors over exactly the filled rows
(no copy); the study cache writes them with `torch.save` and maps them back with ``torch.load(mmap=True)``.
The file's blocks are reserved when it is created (``posix_fallocate``), so a full disk raises there.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitscope.files import disk_error
from vitscope.host import to_host

_COLUMNS = ("ids", "labels", "is_test")


class _Matrix:
    """A growable (rows, D) float16 matrix in an unlinked temporary file."""

    def __init__(self, dim: int, capacity: int = 1024):
        self.dim, self.n = int(dim), 0
        self.mm = self._alloc(max(int(capacity), 1))

    def _alloc(self, capacity: int) -> np.memmap:
        fd, path = tempfile.mkstemp(prefix="vitscope-pooled-", dir=os.environ.get("VITSCOPE_TMPDIR"))
        try:
            with os.fdopen(fd, "wb") as f:
                f.truncate(capacity * self.dim * 2)
                if hasattr(os, "posix_fallocate"):  # reserve the blocks now: a full disk is an error here, not a
                    try:                            # SIGBUS when a row is written into the mapping later
                        os.posix_fallocate(f.fileno(), 0, capacity * self.dim * 2)
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise disk_error(e, Path(path).parent) from e
            return np.memmap(path, dtype=np.float16, mode="r+", shape=(capacity, self.dim))
        finally:
            try:
                os.unlink(path)  # the mapping keeps the file alive until it is dropped
            except OSError:  # pragma: no cover - platforms that cannot unlink an open file
                pass

    @classmethod
    def holding(cls, rows: torch.Tensor) -> _Matrix:
        """Rows already in memory (a state read from the cache), kept as they are, without a file: the first
        append that needs room moves them into one (`append`)."""
        m = cls.__new__(cls)
        m.dim, m.n = int(rows.shape[-1]), len(rows)
        m.mm = rows.detach().to(torch.float16).contiguous().numpy()
        return m

    def append(self, rows: torch.Tensor) -> None:
        """Rows on the host, written into the file by torch (no NumPy round trip)."""
        need = self.n + len(rows)
        if need > len(self.mm):
            bigger = self._alloc(max(need, 2 * len(self.mm)))
            bigger[:self.n] = self.mm[:self.n]
            self.mm = bigger
        torch.from_numpy(self.mm[self.n:need]).copy_(rows.detach())
        self.n = need

    def tensor(self) -> torch.Tensor:
        """The filled rows as a float16 tensor sharing the file (exactly ``n`` rows of storage)."""
        return torch.from_numpy(self.mm[:self.n]) if self.n else torch.empty(0, self.dim, dtype=torch.float16)


class PooledTable:
    """Rows of pooled features for ``num_layers`` layers, with their image ids, labels and split flags."""

    def __init__(self, num_layers: int):
        self.num_layers = int(num_layers)
        self.mats: list[_Matrix] | None = None  # created at the first append, when D is known
        self.cols: dict[str, list[torch.Tensor]] = {c: [] for c in _COLUMNS}

    def __len__(self) -> int:
        return self.mats[0].n if self.mats else 0

    def append(self, feats: list[torch.Tensor], ids: torch.Tensor, labels: torch.Tensor,
               is_test: torch.Tensor) -> None:
        """``feats``: one (rows, D) tensor per layer; the columns: (rows,) each; on any one device (one copy to
        the host, `vitscope.host.to_host`)."""
        host = to_host(*(f.to(torch.float16) for f in feats), ids, labels, is_test)
        self.append_host(list(host[:len(feats)]), *host[len(feats):])

    def append_host(self, feats: list[torch.Tensor], ids: torch.Tensor, labels: torch.Tensor,
                    is_test: torch.Tensor) -> None:
        """`append` of rows already on the host (e.g. several tables' rows moved in one `vitscope.host.to_host`): no
        copy from a device, nothing that waits for one."""
        if len(feats) != self.num_layers:
            raise ValueError(f"expected features of {self.num_layers} layers, got {len(feats)}")
        if not len(ids):
            return
        if self.mats is None:
            self.mats = [_Matrix(f.shape[-1]) for f in feats]
        for m, f in zip(self.mats, feats, strict=True):
            m.append(f.to(torch.float16))
        for c, v in zip(_COLUMNS, (ids, labels, is_test), strict=True):
            self.cols[c].append(v.to(torch.bool if c == "is_test" else torch.long))

    def layer(self, j: int) -> torch.Tensor:
        """(rows, D) float16 features of the j-th layer (a view of the file)."""
        return self.mats[j].tensor() if self.mats else torch.empty(0, 0, dtype=torch.float16)

    def column(self, name: str) -> torch.Tensor:
        parts = self.cols[name]
        if len(parts) > 1:  # concatenate once; later calls reuse it
            self.cols[name] = parts = [torch.cat(parts)]
        return parts[0] if parts else torch.empty(0, dtype=torch.bool if name == "is_test" else torch.long)

    def extend(self, other: PooledTable) -> None:
        if other.mats:
            self.append([other.layer(j) for j in range(other.num_layers)],
                        *(other.column(c) for c in _COLUMNS))

    def labelled(self) -> PooledTable:
        """The rows with a class (label >= 0; -1 marks an image without one, e.g. a COCO image without annotations):
        this table where every row has one, else a copy of those rows (read once, when the table is finalized:
        a per-batch filter would make every update wait for the device)."""
        keep = self.column("labels") >= 0
        if bool(keep.all()):
            return self
        t = PooledTable(self.num_layers)
        if keep.any():
            t.append_host([self.layer(j)[keep] for j in range(self.num_layers)],
                          *(self.column(c)[keep] for c in _COLUMNS))
        return t

    def state_dict(self) -> dict[str, Any]:
        return {"layers": [self.layer(j) for j in range(self.num_layers)],
                **{c: self.column(c) for c in _COLUMNS}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PooledTable:
        t = cls(len(state["layers"]))
        if len(state["ids"]):  # the loaded rows as they are (no file written and read back for a cached rerun)
            t.mats = [_Matrix.holding(x) for x in state["layers"]]
            for c in _COLUMNS:
                t.cols[c].append(state[c].detach().cpu().to(torch.bool if c == "is_test" else torch.long))
        return t
