"""The run directory: what vitscope owns in it, one writer at a time, and its tables swapped in whole.

    <output_dir>/manifest.json      vitscope's marker: written when a run claims the directory, and the list of
                                    the files it wrote under results/ (``results_files``)
    <output_dir>/config.yaml, report.html, results/   the rest of what vitscope writes
    <output_dir>/.vitscope.lock     held by the one run writing into the directory (`hold`)
    <output_dir>/.vitscope-*        its temporaries (a fresh results folder; the one it replaces)

Nothing vitscope did not write is deleted or replaced: a directory holding anything else (a user's file in
results/, an unknown folder) is refused in one sentence without ``--overwrite``, and with it those files stay
where they are (`foreign_entries`, `swap_tables`).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from vitscope.errors import ConfigError
from vitscope.files import keep_foreign, swap_dir, write_atomic

MANIFEST = "manifest.json"
LOCK = ".vitscope.lock"
#: vitscope's own files at the top of a run directory (besides results/)
OWN_FILES = (MANIFEST, "config.yaml", "report.html", LOCK)
#: derived tables written under results/ after a run (beside the analyses' tables, which the manifest lists): the
#: report's best layers and `vitscope findings`'s verdicts; vitscope's own, so a rerun replaces them
BEST_LAYERS_TABLE, FINDINGS_TABLE = "summary/best_layers.parquet", "summary/findings.parquet"
#: the analyses' tables that had no rows for a model, pair or the cross-model stage, and why (columns analysis,
#: model, reason): written with the tables (`study.tables.write_tables`), read by the report
EMPTY_TABLE = "summary/empty.parquet"
REPORT_RESULTS = (BEST_LAYERS_TABLE, FINDINGS_TABLE, EMPTY_TABLE)
_TMP = re.compile(r"^\.vitscope-|^\.(manifest\.json|config\.yaml|report\.html)\.\d+\.tmp$")
_FRESH, _OLD = ".vitscope-results-", ".vitscope-old-results-"


def read_manifest(out: Path) -> dict[str, Any]:
    """The run directory's manifest; {} when there is none or it is not vitscope's (no ``config_key``)."""
    try:
        m = json.loads((Path(out) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) and "config_key" in m else {}


def hold(out: Path) -> FileLock:
    """The run directory's writer lock, acquired (released by the caller, at the end of the run): a second run
    into the same directory, whatever its config, is one ConfigError sentence while this one lives."""
    lock = FileLock(str(Path(out) / LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(f"another vitscope run is writing into {str(out)!r} right now: wait for it to finish, "
                          "or choose another output_dir") from None
    return lock


def check_free(out: Path) -> None:
    """`hold`'s refusal without keeping the lock, and without creating anything: `vitscope run` says it before it
    imports torch (the run takes the lock itself before it writes; one that starts in between is refused then)."""
    if (Path(out) / LOCK).is_file():  # no lock file: no run has ever held the directory
        hold(out).release()


def own_results(manifest: dict[str, Any], out: Path) -> set[str]:
    """The files under results/ (relative, posix) vitscope wrote, by the manifest (one written before it listed
    them: the tables, ``results/*.parquet``)."""
    if not manifest:
        return set()
    if "results_files" not in manifest:
        return {p.name for p in (Path(out) / "results").glob("*.parquet")} | set(REPORT_RESULTS)
    return set(manifest["results_files"]) | set(REPORT_RESULTS)


def foreign_entries(out: Path, keep: tuple[Path, ...] = ()) -> list[str]:
    """What ``out`` holds that vitscope did not write (``keep``: further paths of its own, e.g. a cache inside
    the run directory), relative to ``out``; [] for a missing or empty directory."""
    out = Path(out)
    if not out.is_dir():
        return []
    manifest = read_manifest(out)
    mine = own_results(manifest, out)
    keep_resolved = {Path(k).resolve() for k in keep}
    found = []
    for p in sorted(out.iterdir()):
        n = p.name
        if _TMP.search(n) or p.resolve() in keep_resolved or n == LOCK:
            continue
        if n in OWN_FILES and manifest and p.is_file():
            continue
        if n == "results" and p.is_dir() and not p.is_symlink():
            found += [f"results/{f.relative_to(p).as_posix()}" for f in sorted(p.rglob("*"))
                      if not f.is_dir() and f.relative_to(p).as_posix() not in mine]
            continue
        found.append(n + ("/" if p.is_dir() else ""))
    return found


def claim(out: Path, config_key: str, overwrite: bool, keep: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Make ``out`` this run's (under `hold`): refuse, in one sentence and unless ``overwrite``, a directory
    holding files vitscope did not write or another config's results; mark a new one with a manifest.
    Returns the previous manifest ({} if none)."""
    from vitscope.errors import preview

    previous = read_manifest(out)
    if not overwrite:
        foreign = foreign_entries(out, keep)
        if foreign:
            raise ConfigError(f"output_dir {str(out)!r} holds files vitscope did not write ({preview(foreign, 4)}): "
                              "choose a new or empty output_dir, or pass --overwrite (vitscope then replaces only "
                              "its own files and keeps these)")
        if previous.get("results_key") and previous.get("config_key") != config_key:
            raise ConfigError(f"{str(out)!r} holds the results of another config: pass --overwrite to replace them, "
                              "or choose another output_dir")
    if not previous:
        write_json(out / MANIFEST, {"config_key": config_key, "results_files": [], "claimed": time.strftime("%F %T")})
    sweep(out, previous)
    return previous


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(obj, indent=2, default=str).encode()))


def swap_tables(out: Path, write: Any, names: list[str], previous: dict[str, Any]) -> list[str]:
    """``write(folder)`` writes this run's tables (``names``: their file names) into a fresh folder, which then
    replaces results/ whole; what results/ held that vitscope did not write (by ``previous``, the manifest) is
    moved into the new folder, never deleted. The manifest is told the new files before they appear, so a kill
    at any point leaves only files it lists or keeps. Returns the files under results/ vitscope now owns."""
    fresh = out / f"{_FRESH}{time.monotonic_ns()}"
    fresh.mkdir(parents=True)
    write(fresh)
    manifest = read_manifest(out) or {"config_key": None}
    before = own_results(previous, out)
    owned = sorted(before | set(names))
    write_json(out / MANIFEST, {**manifest, "results_files": owned})  # a kill from here on: every table is listed
    swap_dir(fresh, out / "results", before, trash=out / f"{_OLD}{time.monotonic_ns()}")
    return sorted(names)


def sweep(out: Path, previous: dict[str, Any]) -> None:
    """Leftovers of a killed run: a fresh results folder never swapped in (only vitscope's tables: deleted), a
    replaced one (its foreign files moved back into results/), stale temporary files of vitscope's own
    names. Nothing else is touched."""
    mine = own_results(previous, out) | own_results(read_manifest(out), out)
    for p in sorted(Path(out).iterdir()):
        if p.name.startswith(_OLD) and p.is_dir():
            (out / "results").mkdir(exist_ok=True)
            keep_foreign(p, out / "results", mine)
        elif p.name.startswith(_FRESH) and p.is_dir():
            for f in p.iterdir():
                if f.is_file() and f.suffix == ".parquet":
                    f.unlink()
            try:
                p.rmdir()
            except OSError:
                pass
        elif _TMP.search(p.name) and p.is_file() and p.name.endswith(".tmp") and str(os.getpid()) not in p.name:
            p.unlink(missing_ok=True)
