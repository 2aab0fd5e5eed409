"""Writing files so that a kill or a full disk never leaves half of one behind, and says where it failed; and
following a file name that a data file gives only within its folder (`inside`); sizes as people read them
(`human`)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from vitscope.errors import InputError, VitscopeError

__all__ = ["disk_error", "human", "inside", "keep_foreign", "swap_dir", "write_atomic"]


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, renamed into place once complete. On any error the
    temporary file is removed; a full disk (or quota, or read-only file system) becomes one VitscopeError
    naming the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
        tmp.replace(path)
    except BaseException as e:
        err = disk_error(e, path.parent)
        if err is e and isinstance(e, Exception) and not isinstance(e, VitscopeError):
            # a serializer may hide the system's reason (torch's zip writer says "unexpected pos 704 vs 598"
            # when the disk fills under it): ask the file system by writing more to the same file
            refused = _refused_write(tmp)
            err = e if refused is None else disk_error(refused, path.parent)
        tmp.unlink(missing_ok=True)
        if err is e:
            raise
        raise err from e


#: bytes `_refused_write` tries to add: more than a serializer's pending record, so a full disk refuses them
PROBE_BYTES = 1 << 20


def _refused_write(path: Path) -> OSError | None:
    """The file system's own error for appending `PROBE_BYTES` to ``path`` (and syncing them), or None when it
    takes them: after a writer failed with an error that names no system error, whether the disk was full."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as e:
        return e
    try:
        left = memoryview(bytes(PROBE_BYTES))
        while len(left):  # a nearly full disk takes part of a write without an error; the next part fails
            left = left[os.write(fd, left):]
        os.fsync(fd)
    except OSError as e:
        return e
    finally:
        os.close(fd)
    return None


def swap_dir(fresh: Path, target: Path, owned: set[str], trash: Path) -> None:
    """``fresh`` (a complete folder) takes the place of ``target`` whole: ``target`` is renamed to ``trash``,
    ``fresh`` to ``target``, then `keep_foreign` empties ``trash``. ``owned``: the files of ``target`` (relative,
    posix) vitscope wrote; any other file is moved into the new ``target``, never deleted."""
    if target.is_dir():
        target.rename(trash)
        fresh.rename(target)
        keep_foreign(trash, target, owned)
    else:
        fresh.rename(target)


def keep_foreign(trash: Path, target: Path, owned: set[str]) -> None:
    """A replaced folder (``trash``; also one left by a kill between `swap_dir`'s renames): the files in
    ``owned`` deleted, every other file moved into ``target`` (left in ``trash`` where the new folder took its
    name), ``trash`` removed once empty."""
    for f in sorted(trash.rglob("*"), key=lambda p: -len(p.parts)):
        rel = f.relative_to(trash).as_posix()
        if f.is_dir() and not f.is_symlink():
            try:
                f.rmdir()
            except OSError:
                pass
        elif rel in owned:
            f.unlink()
        elif not (target / rel).exists():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            f.rename(target / rel)
    try:
        trash.rmdir()
    except OSError:
        pass


def inside(root: Path, name: str, what: str) -> Path:
    """``root / name``, refused in one InputError sentence (naming ``what``: the file and entry that gave
    ``name``) when it resolves outside ``root``: an absolute path or one climbing out with ``..`` (an annotation
    file must not make vitscope read files elsewhere); links inside ``root`` are the user's and are followed."""
    path = Path(root) / str(name)
    try:  # by the names alone: symbolic links inside the folder (images kept on another disk) are followed
        Path(os.path.normpath(path)).relative_to(os.path.normpath(root))
    except ValueError:
        raise InputError(f"{what} names {str(name)!r}, which lies outside the folder {str(root)!r}; files it "
                         "names must lie under that folder") from None
    return path


def disk_error(e: BaseException, directory: Path) -> BaseException:
    """One-sentence VitscopeError for a write that the file system refused, naming ``directory``; ``e`` itself
    when it is not such an error."""
    if not isinstance(e, Exception):
        return e
    os_err = e if isinstance(e, OSError) else e.__cause__ if isinstance(e.__cause__, OSError) else None
    code = getattr(os_err, "errno", None)
    text = str(e)
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "Disk quota" in text:
        return VitscopeError(f"no space left on the device of {directory} (or its quota is used up); free some "
                             "space or point the output or cache elsewhere, then rerun to continue")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return VitscopeError(f"cannot write to {directory} ({os.strerror(code)}); choose a writable directory")
    return e


def human(n: float) -> str:
    """``n`` bytes as people read them: "512 B", "1.5 KiB", ..., "3.2 GiB" (GiB at most)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
