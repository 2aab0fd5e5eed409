"""Writing files so that a kill or a full disk never leaves half of one behind, and says where it failed."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from vitscope.errors import VitscopeError

__all__ = ["disk_error", "write_atomic"]


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
        tmp.unlink(missing_ok=True)
        err = disk_error(e, path.parent)
        if err is e:
            raise
        raise err from e


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
