"""The errors vitscope raises on bad input. Each message is meant to be read by a person: what went
wrong, and what to do about it, in one or two sentences."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class VitscopeError(Exception):
    """Base class of every error vitscope raises on purpose."""


class UnknownModelError(VitscopeError, KeyError):
    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class WeightsUnavailableError(VitscopeError, RuntimeError):
    """Weights could not be fetched (no network to the hub, or a manual download)."""


class CheckpointError(VitscopeError, ValueError):
    """A checkpoint whose keys or shapes do not fit the model."""


class UnknownTapError(VitscopeError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InputError(VitscopeError, ValueError):
    """Images the model cannot take (size, channels, dtype, NaNs)."""


class ConfigError(VitscopeError, ValueError):
    """A study config that does not validate."""


#: the stop signals (SIGTERM, SIGHUP) received by `vitscope run`, newest last (`cli._stop_as_ctrl_c`): a pass checks
#: it after each batch, since the KeyboardInterrupt the handler raises is lost when it lands in a weakref callback
#: or a __del__ (Python prints and ignores exceptions there)
STOPPED_BY: list[int] = []


class WorkerDied(VitscopeError):
    """A process reading images for a pass died (the kernel's out-of-memory killer, a kill): one sentence naming
    it and the batch; a study adds what its cache kept and that rerunning resumes."""


class StudyInterrupted(KeyboardInterrupt):
    """Ctrl-C during a study, with what the cache holds by then (``str(e)``: one sentence for the command line,
    which rerunning the same command resumes from)."""


class VitscopeWarning(UserWarning):
    """A warning meant for a person: the command line prints it as one line, ``vitscope: warning: ...``."""


class ResultWarning(VitscopeWarning):
    """A result was computed but means little: one class (every accuracy is 1.0, which is chance), fewer test
    images than classes, a probe trained on a single class."""


def close_matches(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """Closest names first; substring matches count as close too."""
    candidates = list(candidates)
    out = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    low = name.lower()
    for c in candidates:
        if len(out) >= n:
            break
        if c not in out and (low in c.lower() or c.lower() in low):
            out.append(c)
    return out


def unknown_name(what: str, name: str, names: Iterable[str]) -> VitscopeError:
    """The one sentence for a name that is not one of ``names``: "unknown WHAT 'name'; did you mean ...?
    Available: ...". """
    names = list(names)
    hint = close_matches(name, names)
    return VitscopeError(f"unknown {what} {name!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
                         + f" Available: {', '.join(sorted(names))}.")


def preview(names: Iterable[str], limit: int = 12) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def first_line(e: BaseException, limit: int = 200) -> str:
    """The gist of an exception for a one-sentence message: what a data-only unpickler refused, else the first
    line of its text."""
    text = str(e)
    m = re.search(r"(?:unsupported global: GLOBAL|unsupported GLOBAL|it refers to) ([\w.]+)", text, re.IGNORECASE)
    if m:
        return f"it refers to {m.group(1)}, which is not data"
    line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return line[:limit]


def check_choice(value: object, choices: tuple[str, ...], who: str, what: str, hint: str) -> str:
    """``value`` when it is one of ``choices``; else one sentence: "WHO: WHAT 'value' does not exist; choose HINT"."""
    if value not in choices:
        raise ConfigError(f"{who}: {what} {value!r} does not exist; choose {hint}")
    return str(value)
