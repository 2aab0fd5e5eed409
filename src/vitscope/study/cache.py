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

The default location is per user (`default_cache_dir`), never a directory other users can write to. Not
``<output_dir>/../cache`` (an output directory under a shared one such as /tmp put the cache there, writable by
every user at predictable names), and not inside the run directory: the keys are content hashes, so one cache
serves every study of a user, which a per-run cache would lose (it is the fallback when there is no home).

Housekeeping (`vitscope cache`, without torch): reading an entry sets its mtime, so an entry's mtime is its last
use; ``<model key>/about.json`` names the model (or pair) the folder belongs to; `listing` sums the entries by
model and analysis, `prune` removes the least recently used first (`--older-than`, `--max-size`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from vitscope.errors import ConfigError, VitscopeError, first_line
from vitscope.files import disk_error, human, write_atomic  # human: also imported from here
from vitscope.models.registry import ModelSpec

log = logging.getLogger(__name__)

#: layout of an entry on disk; entries of another format are recomputed
FORMAT = 2
#: what a model folder belongs to (written by the study, read by `listing`)
ABOUT = "about.json"
#: the entries and store folders vitscope wrote in a model folder, one name per line (appended as each is
#: written): `units` and `prune` know vitscope's own files by this record, never by their names' pattern
WRITTEN = ".written"


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
        self._recorded: dict[Path, set[str]] = {}  # per model folder, the names known to be in its `WRITTEN`

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

    def finished(self, mkey: str, name: str, akey: str) -> bool:
        """Whether the finished entry is there (without creating the model's folder, as `path` does)."""
        return (self.root / mkey / f"{name}-{akey}.pt").is_file()

    def store_dir(self, mkey: str, *parts: str) -> Path:
        """A directory for an analysis's reusable products under a model's key (e.g. inversions)."""
        d = self._dir(mkey) / "store" / digest(*parts)
        d.mkdir(parents=True, exist_ok=True)
        self._record(d.parent.parent, f"store/{d.name}")
        return d

    def load(self, path: Path) -> dict[str, Any] | None:
        """The entry at ``path``, or None when there is none or it is not a readable data-only entry."""
        import torch

        if not path.is_file():
            return None
        from vitscope.models.torchfile import check_memory

        try:
            check_memory(path, quick=True)  # a pickle asking for more memory than the file holds is refused, not loaded
            entry = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                raise ValueError(f"not a vitscope cache entry of format {FORMAT}")
            frame = entry.get("frame")
            if frame is not None:
                import pandas as pd

                entry["frame"] = pd.read_parquet(io.BytesIO(frame.numpy().tobytes()))
        except Exception as e:  # noqa: BLE001 - an unreadable entry is recomputed, never trusted
            log.warning("ignoring cache entry %s (%s); it is recomputed", path, first_line(e))
            return None
        try:
            os.utime(path)  # its last use, for `prune` (a read-only cache stays as it is)
            self._record(path.parent, path.name)  # read as vitscope's own: an entry of a cache from before the record
        except (OSError, VitscopeError):
            pass
        return entry

    def note(self, mkey: str, **about: Any) -> None:
        """``<model key>/about.json``: what the folder belongs to (``model``/``source`` or ``pair``), for
        `listing`; rewritten only when it changes."""
        import json

        f = self._dir(mkey) / ABOUT
        blob = json.dumps(about, sort_keys=True).encode()
        try:
            if f.is_file() and f.read_bytes() == blob:
                return
        except OSError:
            pass
        write_atomic(f, lambda fh: fh.write(blob))

    def save(self, path: Path, entry: dict[str, Any]) -> None:
        import torch

        entry = {**entry, "format": FORMAT}
        frame = entry.get("frame")
        if frame is not None:  # the table as parquet bytes: data, read back without unpickling
            buf = io.BytesIO()
            frame.to_parquet(buf, index=False)
            entry["frame"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self._record(path.parent, path.name)  # before the entry: a kill in between leaves a name with no file
        write_atomic(path, lambda f: torch.save(entry, f))

    def _record(self, model_dir: Path, name: str) -> None:
        """Add ``name`` to the model folder's record of what vitscope wrote there (`WRITTEN`), once (the record
        is read once per folder; another process appending the same name meanwhile only repeats a line)."""
        known = self._recorded.get(model_dir)
        if known is None:
            known = self._recorded[model_dir] = _written(model_dir) or set()
        if name in known:
            return
        try:
            with open(model_dir / WRITTEN, "a") as f:  # one short line: appended whole
                f.write(name + "\n")
        except OSError as e:
            raise disk_error(e, model_dir) from e
        known.add(name)


def _written(model_dir: Path) -> set[str] | None:
    """The names vitscope recorded writing in ``model_dir``; None for a folder without a record (written
    before vitscope kept one, or not vitscope's)."""
    try:
        return {ln for ln in (model_dir / WRITTEN).read_text().splitlines() if ln}
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return set()


def model_folders(root: str | Path) -> list[Path]:
    """The model folders under ``root`` vitscope keeps a record in (`WRITTEN`): a run directory that is also its
    cache holds these as its own."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [d for d in sorted(root.iterdir()) if d.is_dir() and re.fullmatch(r"[0-9a-f]{16}", d.name)
            and _written(d) is not None]


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


# ---------------------------------------------------------------- housekeeping (`vitscope cache`; no torch)

_ENTRY = re.compile(r"^(?P<name>.+)-(?P<key>[0-9a-f]{16})(?P<part>\.part-\d+of\d+)?\.pt$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_AGE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|min|m|h|d|w)\s*$", re.IGNORECASE)
_AGE_SECONDS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``--max-size``: bytes from ``2GB`` (SI: kB, MB, GB, TB are powers of 1000), ``2GiB`` or ``2G`` (powers of
    1024, as ``du -h`` prints them) or a plain number of bytes."""
    m = _SIZE.match(str(text))
    if m is None or (m.group(3) and not m.group(2)):
        raise ConfigError(f"--max-size {text!r} is not a size: write e.g. 500MB, 2GB, 2GiB or 2G")
    number, unit, binary, b = float(m.group(1)), m.group(2).lower(), m.group(3), m.group(4)
    base = 1024 if binary or (unit and not b) else 1000
    return int(number * base ** ("kmgt".index(unit) + 1 if unit else 0))


def parse_age(text: str) -> float:
    """``--older-than``: seconds from ``30d``, ``12h``, ``90min`` / ``90m``, ``2w``, ``45s``."""
    m = _AGE.match(str(text))
    if m is None:
        raise ConfigError(f"--older-than {text!r} is not an age: write a number and a unit, e.g. 30d, 12h, 90min "
                          "or 2w")
    return float(m.group(1)) * _AGE_SECONDS[m.group(2).lower()]


@dataclass
class Unit:
    """What `prune` removes at once: one entry file, or one stored product folder (``store/<digest>``)."""

    model_dir: Path
    path: Path
    analysis: str
    size: int
    last_use: float


def _about(d: Path) -> str:
    try:
        about = json.loads((d / ABOUT).read_text())
    except (OSError, ValueError):
        return "?"
    if isinstance(about, dict) and about.get("pair"):
        return " -> ".join(str(x) for x in about["pair"])
    return str(about.get("model", "?")) if isinstance(about, dict) else "?"


def units(root: str | Path) -> list[Unit]:
    """Every entry and stored product folder vitscope recorded writing under ``root`` (`WRITTEN`); files and
    folders it has no record of are not its own, whatever their names, and are neither listed nor removed."""
    root = Path(root)
    found: list[Unit] = []
    if not root.is_dir():
        return found
    for d in sorted(p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"[0-9a-f]{16}", p.name)):
        written = _written(d) or set()
        for f in sorted(d.iterdir()):
            m = _ENTRY.match(f.name)
            try:
                if m and f.is_file() and f.name in written:
                    st = f.stat()
                    name = m.group("name") + (" (partial)" if m.group("part") else "")
                    found.append(Unit(d, f, name, st.st_size, st.st_mtime))
                elif f.name == "store" and f.is_dir():
                    for s in sorted(x for x in f.iterdir() if f"store/{x.name}" in written and x.is_dir()):
                        files = [x.stat() for x in s.rglob("*") if x.is_file()]
                        found.append(Unit(d, s, "store", sum(x.st_size for x in files),
                                          max([x.st_mtime for x in files], default=s.stat().st_mtime)))
            except OSError:  # removed meanwhile
                continue
    return found


def _unrecorded(root: Path) -> int:
    """Files named like entries in model folders vitscope kept no record in (written before it kept one, or not
    its own): neither listed nor pruned; a study that reads one records it."""
    if not root.is_dir():
        return 0
    return sum(1 for d in root.iterdir() if d.is_dir() and re.fullmatch(r"[0-9a-f]{16}", d.name)
               and _written(d) is None for f in d.iterdir() if _ENTRY.match(f.name))


def listing(root: str | Path) -> str:
    """The cache by model and analysis: entries, size and last use, and the total."""
    root = Path(root)
    found = units(root)
    old = _unrecorded(root)
    note = (f"\n{old} file(s) named like entries in folders with no record of vitscope's writing them are not "
            "listed and never pruned (written before vitscope kept records, or not its own): a study that reads "
            "one records it; remove them by hand if they are not needed\n") if old else ""
    if not found:
        return f"cache {root}: empty\n" + note
    rows: dict[tuple[str, str, str], list[Unit]] = {}
    for u in found:
        rows.setdefault((_about(u.model_dir), u.model_dir.name, u.analysis), []).append(u)
    table = [("model", "key", "analysis", "entries", "size", "last use")]
    shown = None
    for (model, key, analysis), us in sorted(rows.items()):
        first = (model, key) != shown  # a model's name and key on its first row only
        shown = (model, key)
        table.append((model if first else "", key if first else "", analysis, str(len(us)),
                      human(sum(u.size for u in us)),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(max(u.last_use for u in us)))))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) if i < 5 else c for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))).rstrip() for r in table]
    n_models = len({u.model_dir for u in found})
    lines.append(f"\ncache {root}: {human(sum(u.size for u in found))} in {len(found)} entries of {n_models} "
                 "models; `vitscope cache prune --older-than 30d` or `--max-size 2GB` removes the least recently "
                 "used")
    return "\n".join(lines) + "\n" + note


def _remove_if_only_ours(d: Path) -> None:
    """Remove a model folder whose entries are gone when all it still holds is vitscope's own (its lock,
    about.json, a stale temporary of `write_atomic`); a file anyone else put there keeps the folder and itself."""
    left = list(d.iterdir())
    ours = [f for f in left if f.is_file() and (f.name in (".lock", ABOUT, WRITTEN)
                                                or re.fullmatch(r"\..+\.\d+\.tmp", f.name))]
    if len(ours) < len(left):
        return
    for f in ours:
        f.unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:  # something arrived meanwhile
        pass


def prune(root: str | Path, older_than: float | None = None, max_size: int | None = None,
          now: float | None = None) -> tuple[list[Unit], int]:
    """Remove the entries last used more than ``older_than`` seconds ago, then, least recently used first, until
    the cache holds at most ``max_size`` bytes. A model folder a study is saving into right now (its lock is
    held) is left alone. Returns what was removed and the bytes left."""
    import shutil

    root = Path(root)
    if root.is_dir() and not os.access(root, os.W_OK):
        raise VitscopeError(f"the cache directory {str(root)!r} cannot be written to (read-only, or not yours), so "
                            "nothing can be removed from it")
    now = time.time() if now is None else now
    found = sorted(units(root), key=lambda u: (u.last_use, str(u.path)))
    total = sum(u.size for u in found)
    doomed = []
    for u in found:
        old = older_than is not None and now - u.last_use > older_than
        big = max_size is not None and total > max_size
        if old or big:
            doomed.append(u)
            total -= u.size
    removed: list[Unit] = []
    for d in sorted({u.model_dir for u in doomed}):
        lock = FileLock(str(d / ".lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            log.warning("cache folder %s is being written by a study; left as it is", d)
            continue
        except OSError as e:
            raise disk_error(e, d) from e
        try:
            for u in (u for u in doomed if u.model_dir == d):
                try:
                    shutil.rmtree(u.path) if u.path.is_dir() else u.path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise VitscopeError(f"cannot remove {str(u.path)!r} from the cache ({e.strerror or e}); "
                                        "prune a cache you can write to") from None
                removed.append(u)
            store = d / "store"
            if store.is_dir() and not any(store.iterdir()):
                store.rmdir()
            _remove_if_only_ours(d)
        finally:
            lock.release()
    left = sum(u.size for u in units(root))
    return removed, left
