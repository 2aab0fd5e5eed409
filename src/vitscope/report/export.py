"""Every figure of a run as a separate file for a paper: ``vitscope report RUN_DIR --export DIR --format pdf``.

Each figure is redrawn from the run's tables (as `vitscope.plot` does), laid out again at the width of one
journal column (3.5 in) or of two (7.16 in) — the smaller that holds it without squeezing its panels, or the
one asked for — with its fonts kept at their printed size (6-9 pt), and saved:

* ``pdf``: vector, TrueType fonts embedded (``pdf.fonttype 42``), heat maps as embedded images;
* ``svg``: vector, glyphs as paths (no font needed to view it);
* ``png``: 300 dpi.

The figures are written into a fresh folder beside DIR, the index last, and the folder then replaces DIR
whole (`vitscope.files.swap_dir`): a killed export leaves DIR as it was, figures of an earlier export that
this one does not write are gone, and files in DIR that no export wrote are kept.

A legend wider than a quarter of the width moves from the side of the panels to below them. A figure too
large for two columns (e.g. a CKA grid of many models) keeps its own size; `figures.tsv` in DIR lists every
file with its caption and size, and says which ones.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt

from vitscope.errors import VitscopeError
from vitscope.files import disk_error, keep_foreign, swap_dir
from vitscope.report.run import load_run

FORMATS = ("pdf", "svg", "png")
COLUMN_WIDTHS = {1: 3.5, 2: 7.16}
"""Printed widths (inches) of one and of two columns (IEEE / CVPR: 3.5 and 7.16; ACL-style 3.3 and 6.9)."""
MAX_HEIGHT = 9.0
DPI = 300

RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "path", "savefig.dpi": DPI,
      "figure.dpi": 100}


def _fits(fig: plt.Figure, min_panel: float = 0.6) -> bool:
    """After a layout pass: every panel (not colour bars) is at least ``min_panel`` inches wide and tall."""
    fig.canvas.draw()
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            continue
        box = ax.get_position()
        w, h = box.width * fig.get_figwidth(), box.height * fig.get_figheight()
        if w < min_panel or h < min_panel * 0.6:
            return False
    return True


def _legends_below(fig: plt.Figure, width: float) -> None:
    """Move the figure's legends from the right of the panels to below them, in as many columns (at most 3) as
    fit ``width`` inches: on one journal column a legend at the side would leave the panels no room."""
    renderer = fig.canvas.get_renderer()
    for leg in list(fig.legends):
        handles, labels = leg.legend_handles, [t.get_text() for t in leg.get_texts()]
        title = leg.get_title().get_text() or None
        size = leg.get_texts()[0].get_fontsize() if labels else 7
        leg.remove()
        for ncols in (3, 2, 1):
            new = fig.legend(handles=handles, labels=labels, loc="outside lower center", ncols=min(ncols, len(labels)),
                             fontsize=size, frameon=False, title=title, title_fontsize=size)
            if ncols == 1 or new.get_window_extent(renderer).width <= 0.97 * width * fig.dpi:
                break
            new.remove()


def _relayout(fig: plt.Figure, columns: int | None) -> str:
    """Resize ``fig`` to a column width and lay it out again; returns what it got ('1 column', '2 columns' or
    'own size')."""
    w0, h0 = fig.get_size_inches()
    renderer = fig.canvas.get_renderer()
    panels_width = w0 - sum(leg.get_window_extent(renderer).width / fig.dpi for leg in fig.legends)
    choices = [columns] if columns else ([1, 2] if panels_width <= 5.5 else [2])
    if fig.get_layout_engine() is None:  # fixed margins: give it a layout engine for the new size
        fig.set_layout_engine("constrained")
    moved = False
    for cols in choices:
        width = COLUMN_WIDTHS[cols]
        if not moved and fig.legends and sum(leg.get_window_extent(renderer).width / fig.dpi
                                             for leg in fig.legends) > 0.25 * width:
            _legends_below(fig, width)  # a legend at the side would take the panels' room
            moved = True
        fig.set_size_inches(width, min(h0 * max(width / w0, 0.75) + (0.6 if moved else 0), MAX_HEIGHT))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "constrained_layout not applied": checked below
            if _fits(fig):
                return f"{cols} column" + ("s" if cols > 1 else "")
    fig.set_size_inches(w0, h0)
    fig.canvas.draw()
    return "own size"


def export(run_dir: str | Path, out_dir: str | Path, fmt: str = "pdf", columns: int | None = None,
           analyses: list[str] | None = None) -> list[Path]:
    """Write every figure of ``run_dir``'s report (or of ``analyses``; the dense tasks' best-layer heat table is
    ``best_layers``) into ``out_dir`` as ``<analysis>-<k>.<fmt>``; returns the files. ``columns``: 1 or 2 to force
    a width, None to choose per figure."""
    if fmt not in FORMATS:
        raise VitscopeError(f"unknown figure format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if columns not in (None, 1, 2):
        raise VitscopeError(f"columns must be 1 or 2, got {columns!r}")
    run = load_run(run_dir)
    if not run.tables:
        raise VitscopeError(f"{run_dir}: no results/*.parquet (is it a vitscope run directory?)")
    out = Path(out_dir)
    fresh = _fresh_folder(out)
    written, index = [], ["file\twidth_in\theight_in\tlayout\tcaption"]
    names = [n for n in run.figure_names() if analyses is None or n in analyses]
    with mpl.rc_context(RC):
        for name in names:
            for k, (caption, fig) in enumerate(run.figures(name), start=1):
                layout = _relayout(fig, columns)
                path = fresh / f"{name}-{k:02d}.{fmt}"
                meta = {"Title": caption[:200]} if fmt in ("pdf", "svg") else {}
                fig.savefig(path, format=fmt, dpi=DPI, metadata=meta)
                w, h = fig.get_size_inches()
                plt.close(fig)
                written.append(path)
                index.append(f"{path.name}\t{w:.2f}\t{h:.2f}\t{layout}\t{caption}")
    (fresh / INDEX).write_text("\n".join(index) + "\n", encoding="utf-8")  # last: a folder with it is complete
    swap_dir(fresh, out, _exported(out), trash=out.parent / f".{out.name}{_OLD}{time.monotonic_ns()}")
    return [out / p.name for p in written]


# -- writing: a fresh folder renamed into place ------------------------------------------------------------

INDEX = "figures.tsv"
_FRESH, _OLD = ".vitscope-export-", ".vitscope-export-old-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _exported(folder: Path) -> set[str]:
    """The files of an earlier export in ``folder`` (its index and the files the index lists): replaced by a
    new export; anything else there is the user's and stays."""
    try:
        rows = (folder / INDEX).read_text(encoding="utf-8").splitlines()[1:]
    except (OSError, UnicodeDecodeError):
        return set()
    return {INDEX} | {r.split("\t", 1)[0] for r in rows if r and "/" not in r.split("\t", 1)[0]}


def _fresh_folder(out: Path) -> Path:
    """An empty folder beside ``out`` that the export fills; leftovers of a killed export (a fresh folder never
    renamed into place: only figure files and an index; a replaced export: its foreign files moved back) are
    dealt with first. One sentence when ``out`` is a file or its parent cannot be written."""
    if out.exists() and not out.is_dir():
        raise VitscopeError(f"--export {str(out)!r} is a file; give a directory for the figures")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for p in parent.glob(f".{out.name}{_OLD}*"):  # killed between the two renames: out is the new export
            out.mkdir(exist_ok=True)
            keep_foreign(p, out, _exported(p))
        for p in parent.glob(f".{out.name}{_FRESH}*-*"):  # killed while drawing: only its figures inside
            pid = p.name.removeprefix(f".{out.name}{_FRESH}").split("-")[0]
            if p.is_dir() and pid.isdigit() and not _alive(int(pid)):
                for f in p.iterdir():
                    if f.name == INDEX or f.suffix[1:] in FORMATS:
                        f.unlink()
                if not any(p.iterdir()):
                    p.rmdir()
        fresh = parent / f".{out.name}{_FRESH}{os.getpid()}-{time.monotonic_ns()}"
        fresh.mkdir()
    except OSError as e:
        err = disk_error(e, parent)
        raise (err if err is not e else VitscopeError(f"cannot write the figures beside {str(out)!r} "
                                                      f"({e.strerror or e}); choose another --export directory")
               ) from None
    return fresh
