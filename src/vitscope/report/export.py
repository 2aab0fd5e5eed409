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

Every figure comes out 3.5 or 7.16 in wide (`_relayout`), at most `MAX_HEIGHT` high, its panels keeping
their shape: a row of panels too long for two columns wraps into more rows (a tall column of them into more
columns), a legend wider than a quarter of the width moves from the side of the panels to below them, titles
and axis labels longer than their panel break into lines, a colour bar placed by hand is laid out again beside
its panels, and a panel with nothing in it is left out. `figures.tsv` in DIR lists every file with its size,
its layout (the panels' rows when they were wrapped; "crowded" where no arrangement kept every panel at least
`MIN_PANEL` and every text clear of the others: the least crowded one is written) and its caption.
"""

from __future__ import annotations

import math
import os
import textwrap
import time
import warnings
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.gridspec import GridSpec
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox

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


MIN_PANEL = (0.8, 0.6)
"""Inches: a panel (colour bars aside) narrower or lower than this is squeezed, and the figure is laid out otherwise."""


def _is_colorbar(ax: plt.Axes) -> bool:
    return hasattr(ax, "_colorbar") or ax.get_label() == "<colorbar>"


def _panels(fig: plt.Figure) -> list[plt.Axes]:
    return [ax for ax in fig.axes if not _is_colorbar(ax) and ax.get_visible()]


def _drop_empty(fig: plt.Figure) -> None:
    """Panels with nothing in them (no line, collection, image, patch, text or legend: a grid's unused cells)
    are removed: a printed figure has no empty panel, and the others take their place."""
    for ax in _panels(fig):
        if not (ax.lines or ax.collections or ax.images or ax.patches or ax.texts or ax.artists
                or ax.get_legend() is not None):
            ax.remove()


def _colorbars_beside_panels(fig: plt.Figure) -> None:
    """Colour bars placed by hand (``fig.add_axes`` in a margin that fixed margins reserved) are drawn again
    beside the panels they scale, where the layout engine places them: at another size the hand-placed one
    would cover panels."""
    for cax in [ax for ax in fig.axes if hasattr(ax, "_colorbar")]:
        if hasattr(cax, "_colorbar_info") or cax.get_subplotspec() is not None:
            continue  # made with ax=...: laid out with its panels already
        cb = cax._colorbar  # noqa: SLF001
        panels = _panels(fig)
        users = [ax for ax in panels if any(getattr(m, "cmap", None) is not None and m.cmap.name == cb.cmap.name
                                            for m in [*ax.images, *ax.collections])] or panels
        axis = cax.yaxis if cb.orientation == "vertical" else cax.xaxis
        label, size = axis.label.get_text(), axis.label.get_fontsize()
        ticks = axis.get_ticklabels()
        tick_size = ticks[0].get_fontsize() if ticks else 6
        fig.delaxes(cax)
        if not users:
            continue
        new = fig.colorbar(cb.mappable, ax=users, orientation=cb.orientation, extend=cb.extend, fraction=0.046,
                           pad=0.03)
        new.set_label(label, fontsize=size)
        new.ax.tick_params(labelsize=tick_size)


def _grid(fig: plt.Figure) -> tuple[GridSpec, list[plt.Axes]] | None:
    """The figure's grid and its panels in reading order, when every panel fills one cell of one grid (panels
    that can be wrapped into other rows); None otherwise."""
    panels = _panels(fig)
    specs = [ax.get_subplotspec() for ax in panels]
    if not panels or any(s is None for s in specs):
        return None
    gs = specs[0].get_gridspec()
    if type(gs) is not GridSpec or any(s.get_gridspec() is not gs for s in specs):
        return None
    cells = [(s.rowspan.start, s.colspan.start) for s in specs]
    if any(len(s.rowspan) != 1 or len(s.colspan) != 1 for s in specs) or len(set(cells)) != len(cells):
        return None
    order = sorted(range(len(panels)), key=lambda k: cells[k])
    return gs, [panels[k] for k in order]


def _regrid(fig: plt.Figure, grid: tuple[GridSpec, list[plt.Axes]], ncols: int) -> int:
    """Put the panels of ``grid`` in reading order into rows of ``ncols`` (in the figure's own grid when that has
    ``ncols`` columns); panels sharing an axis whose inner ones hid its tick labels show them on the outer panels
    of the new rows. Returns the number of rows."""
    gs0, panels = grid
    if ncols == gs0.ncols:
        gs = gs0
        cells = [(s.rowspan.start, s.colspan.start) for s in (ax.get_subplotspec() for ax in panels)]
        if ncols == getattr(fig, "_vitscope_ncols", ncols):  # never moved: as the figure drew them
            return len({r for r, _ in cells})
        cells = [(k // ncols, k % ncols) for k in range(len(panels))]
    else:
        gs = GridSpec(math.ceil(len(panels) / ncols), ncols, figure=fig)
        cells = [(k // ncols, k % ncols) for k in range(len(panels))]
    if not hasattr(fig, "_vitscope_ncols"):  # before the first move: which panels hid shared tick labels
        for ax in panels:
            ax._vitscope_inner = (_hides_inner(ax, "y"), _hides_inner(ax, "x"))  # noqa: SLF001
    fig._vitscope_ncols = ncols  # noqa: SLF001
    taken = set(cells)
    for ax, (r, c) in zip(panels, cells, strict=True):
        ax.set_subplotspec(gs[r, c])
        inner_y, inner_x = ax._vitscope_inner  # noqa: SLF001
        if inner_y:
            ax.yaxis.set_tick_params(which="both", labelleft=not any((r, k) in taken for k in range(c)))
        if inner_x:
            below = any((k, c) in taken for k in range(r + 1, r + len(panels)))
            ax.xaxis.set_tick_params(which="both", labelbottom=not below)
    return len({r for r, _ in cells})


def _hides_inner(ax: plt.Axes, which: str) -> bool:
    """Whether ``ax`` shares its ``which`` axis with other panels and some of them hide its tick labels (inner
    panels of a grid with shared axes)."""
    shared = (ax.get_shared_y_axes() if which == "y" else ax.get_shared_x_axes()).get_siblings(ax)
    key = "labelleft" if which == "y" else "labelbottom"
    return len(shared) > 1 and any(not getattr(a, f"{which}axis").get_tick_params().get(key, True) for a in shared)


def _fit_labels(fig: plt.Figure) -> bool:
    """Titles and axis labels longer than their panel and half the gap to the next (along the text) break into
    more lines, so that they do not run into the neighbouring panels' (matplotlib wraps them at the figure's edge
    only), nor past the figure's edge; one whose longest word is still longer takes a smaller font (not under
    6 pt), then breaks at its hyphens. Whether any changed."""
    renderer = fig.canvas.get_renderer()
    changed = False
    cells = {ax: ax.get_position(original=True).transformed(fig.transFigure) for ax in _panels(fig)}

    def pitch(box: Bbox, upright: bool) -> float:  # to the next panel's centre along the text
        if upright:
            near = [abs(b.y0 + b.y1 - box.y0 - box.y1) / 2 for b in cells.values() if b.x0 < box.x1 and box.x0 < b.x1]
        else:
            near = [abs(b.x0 + b.x1 - box.x0 - box.x1) / 2 for b in cells.values() if b.y0 < box.y1 and box.y0 < b.y1]
        return min([d for d in near if d > 1] or [math.inf])

    for ax, box in cells.items():
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            s = text.get_text()
            if not s.strip() or not text.get_visible():
                continue
            upright = abs(text.get_rotation() % 180 - 90) < 1
            ext = text.get_window_extent(renderer)
            middle, end = ((ext.y0 + ext.y1) / 2, fig.bbox.height) if upright else ((ext.x0 + ext.x1) / 2,
                                                                                 fig.bbox.width)
            cell = box.height if upright else box.width  # into half the gap to the next panel at most
            room = min((cell + pitch(box, upright)) / 2, 2 * middle - 4, 2 * (end - middle) - 4)
            length = ext.height if upright else ext.width
            if length <= 1.02 * room + 2:
                continue
            changed = True
            text.set_text(_refill(s, max(10, int(max(map(len, s.split("\n"))) * room / length)), hyphens=False))
            # a word longer than the room: a smaller font (6 pt at least), then the word broken at its hyphens
            ext = text.get_window_extent(renderer)
            length = ext.height if upright else ext.width
            if length > room + 2:
                text.set_fontsize(max(6.0, text.get_fontsize() * room / length))
                ext = text.get_window_extent(renderer)
                length = ext.height if upright else ext.width
            if length > room + 2:
                longest = max(map(len, text.get_text().split("\n")))
                text.set_text(_refill(text.get_text(), max(4, int(longest * room / length)), hyphens=True))
    return changed


def _refill(text: str, chars: int, hyphens: bool) -> str:
    """``text`` broken into lines of at most ``chars`` characters at spaces (and at hyphens: ``hyphens``), its own
    line breaks kept; a word longer than that stays whole."""
    return "\n".join(textwrap.fill(line, chars, break_long_words=False, break_on_hyphens=hyphens) or line
                     for line in text.split("\n"))


def _text_extents(fig: plt.Figure) -> list[tuple[str, np.ndarray]]:
    """Each drawn text of the figure (titles, axis and tick labels, notes, legends as a whole) with the corners
    (display pixels, after a draw) of the rectangle it is drawn in, turned with it."""
    renderer = fig.canvas.get_renderer()
    out, skip = [], set()
    for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        if leg is None:
            continue
        skip.update(id(t) for t in leg.findobj(Text))
        if leg.get_visible():
            out.append(("a legend", _corners(leg.get_window_extent(renderer))))
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            ticks = axis.get_major_ticks() + axis.get_minor_ticks()
            skip.update(id(t) for tick in ticks for t in (tick.label1, tick.label2))
            if not (ax.get_visible() and ax.axison and axis.get_visible()):
                continue
            for tick in axis._update_ticks():  # noqa: SLF001  (the ticks it draws: those in view)
                for t in (tick.label1, tick.label2):
                    if t.get_visible() and t.get_text().strip():
                        out.append((f"tick label {t.get_text()!r}", _text_corners(t, renderer)))
    for t in fig.findobj(Text):
        if id(t) in skip or not t.get_visible() or not t.get_text().strip() or t.figure is None:
            continue
        if t.axes is not None and not t.axes.get_visible():
            continue
        out.append((repr(t.get_text()), _text_corners(t, renderer)))
    return out


def _corners(box: Bbox) -> np.ndarray:
    return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])


def _text_corners(t: Text, renderer: object) -> np.ndarray:
    """The rectangle a text is drawn in: its extent when level, else its unturned extent turned by its angle
    about the extent's centre (the extent of a turned text is the box around that rectangle)."""
    box = t.get_window_extent(renderer)
    angle = t.get_rotation() % 180
    if angle in (0, 90):
        return _corners(box)
    t.set_rotation(0)
    level = t.get_window_extent(renderer)
    t.set_rotation(angle)
    a = np.deg2rad(angle)
    turn = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    half = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]]) * [level.width / 2, level.height / 2]
    return half @ turn.T + [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2]


def _apart(p: np.ndarray, q: np.ndarray, tol: float) -> bool:
    """Whether two convex quadrilaterals are apart (overlap by no more than ``tol`` pixels): a side of one
    separates them (separating axes)."""
    for poly in (p, q):
        for k in range(4):
            edge = poly[(k + 1) % 4] - poly[k]
            norm = np.hypot(*edge)
            if norm == 0:
                continue
            n = np.array([-edge[1], edge[0]]) / norm
            a, b = p @ n, q @ n
            if min(a.max(), b.max()) - max(a.min(), b.min()) <= tol:
                return True
    return False


def _crowding(fig: plt.Figure, tol: float = 1.0) -> list[str]:
    """Pairs of drawn texts of ``fig`` (after a draw) whose rectangles overlap by more than ``tol`` pixels, and
    texts that run past the figure's edge."""
    items = _text_extents(fig)
    if not items:
        return []
    lo = np.array([c.min(0) for _, c in items])
    hi = np.array([c.max(0) for _, c in items])
    edge = np.array([fig.bbox.width, fig.bbox.height])
    out = [f"{items[i][0]} leaves the figure" for i in np.flatnonzero(((lo < -tol) | (hi > edge + tol)).any(axis=1))]
    for i in range(len(items)):
        j = np.arange(i + 1, len(items))
        near = j[(np.minimum(hi[i], hi[j]) - np.maximum(lo[i], lo[j]) > tol).all(axis=1)]
        out += [f"{items[i][0]} and {items[k][0]}" for k in near if not _apart(items[i][1], items[k][1], tol)]
    return out


def _squeezed(fig: plt.Figure) -> list[str]:
    """Panels (colour bars aside) smaller than `MIN_PANEL` as laid out."""
    w, h = fig.get_size_inches()
    out = []
    for ax in _panels(fig):
        box = ax.get_position(original=True)
        if box.width * w < MIN_PANEL[0] - 0.01 or box.height * h < MIN_PANEL[1] - 0.01:
            out.append(f"{ax.get_title()!r} {box.width * w:.2f} x {box.height * h:.2f} in")
    return out


def _draw(fig: plt.Figure) -> bool:
    """Draw ``fig`` (its layout engine lays it out); whether the layout was applied (not when the panels would
    have no room left: the figure is too small for its labels)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        fig.draw_without_rendering()  # laid out and measured, not rasterised
    collapsed = [w for w in caught if "not applied" in str(w.message)]  # this layout is tried, not the last
    for w in caught:
        if w not in collapsed:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return not collapsed


def _size(fig: plt.Figure, width: float, rows: int, shape: tuple[float, float], height: float) -> None:
    """Lay ``fig`` out ``width`` inches wide, its height chosen (at most `MAX_HEIGHT`) so that its panels, ``rows``
    of them one above the other, keep their shape (``shape``: height / width and the height they were drawn at,
    which they do not exceed); a heat map of fixed aspect gives back the height it leaves empty. ``height``: a
    first guess. Panels all of fixed aspect (heat maps, images; laid out compressed) are as wide as the width lets
    them be, and the figure as high as they then need."""
    if _fixed_aspect(fig):
        fig.set_size_inches(width, MAX_HEIGHT)
        _draw(fig)
        for _ in range(2):
            if not _fit_labels(fig):
                break
            _draw(fig)
        tight = fig.get_tightbbox(fig.canvas.get_renderer())
        fig.set_size_inches(width, min(max(tight.height + 0.1, 1.0), MAX_HEIGHT))
        _draw(fig)
        if _fit_labels(fig):  # a y label longer than its panel now reaching past the figure's edge
            _draw(fig)
        return
    last: tuple[float, float] | None = None  # (height, how much lower the panels were than wanted) of the last try
    fitted = 0
    for _ in range(5):
        fig.set_size_inches(width, min(max(height, 1.0), MAX_HEIGHT))
        if not _draw(fig) and fig.get_figheight() < MAX_HEIGHT:  # too low for its labels: no layout to measure
            height, last = 1.5 * fig.get_figheight(), None
            continue
        boxes = [ax.get_position(original=True) for ax in _panels(fig)]
        if not boxes:
            return
        relabelled = fitted < 2 and _fit_labels(fig)  # twice at most: narrower panels would break them again
        fitted += 1
        h = fig.get_figheight()
        short = _panel_height(float(np.median([b.width for b in boxes])) * width, shape) \
            - float(np.median([b.height for b in boxes])) * h
        if not relabelled and (abs(short) < 0.05 or (short > 0 and h >= MAX_HEIGHT)):
            break
        slope = (h - last[0]) / (short - last[1]) if last and abs(short - last[1]) > 1e-3 else -rows
        height = h - short * min(max(slope, -4 * rows), -0.5)  # a secant step once two tries show the slope
        last = None if relabelled else (h, short)
    else:
        fig.set_size_inches(width, min(max(height, 1.0), MAX_HEIGHT))
        _draw(fig)
    slack = []  # per panel: the height of its cell its drawn box leaves empty (a heat map of fixed aspect)
    for ax in _panels(fig):
        cell, drawn = ax.get_position(original=True), ax.get_position()
        h = fig.get_figheight()
        slack.append(min(cell.height - drawn.height, cell.height - (MIN_PANEL[1] + 0.1) / h) * h)
    if slack and min(slack) > 0.1:
        fig.set_size_inches(width, max(fig.get_figheight() - rows * min(slack), 1.0))
        _draw(fig)


def _fixed_aspect(fig: plt.Figure) -> bool:
    """Whether every panel keeps a fixed aspect (heat maps and images drawn square-celled)."""
    panels = _panels(fig)
    return bool(panels) and all(ax.get_aspect() != "auto" for ax in panels)


def _panel_height(width: float, shape: tuple[float, float]) -> float:
    """The height of a panel ``width`` inches wide of ``shape`` (height / width, height drawn at): its shape,
    no taller than it was drawn, no lower than `MIN_PANEL`."""
    return max(min(width * shape[0], shape[1]), MIN_PANEL[1] + 0.1)


def _side_legends(fig: plt.Figure) -> list[Legend]:
    """The figure's legends and those of its panels that stand right of their panel (outside it)."""
    renderer = fig.canvas.get_renderer()
    beside = [ax.get_legend() for ax in _panels(fig) if ax.get_legend() is not None
              and ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1 - 1]
    return [*fig.legends, *beside]


def _legends_below(fig: plt.Figure, width: float) -> None:
    """Move the figure's legends (and a panel's beside it) from the right of the panels to below them, in as
    many columns (at most 4) as fit ``width`` inches: on one journal column a legend at the side would leave the
    panels no room."""
    renderer = fig.canvas.get_renderer()
    for leg in _side_legends(fig):
        handles, labels = leg.legend_handles, [t.get_text() for t in leg.get_texts()]
        title = leg.get_title().get_text() or None
        size = leg.get_texts()[0].get_fontsize() if labels else 7
        leg.remove()
        for ncols in (4, 3, 2, 1):
            new = fig.legend(handles=handles, labels=labels, loc="outside lower center", ncols=min(ncols, len(labels)),
                             fontsize=size, frameon=False, title=title, title_fontsize=size)
            if ncols == 1 or new.get_window_extent(renderer).width <= 0.97 * width * fig.dpi:
                break
            new.remove()


def _relayout(fig: plt.Figure, columns: int | None) -> str:
    """Resize ``fig`` to a column width and lay it out again; returns what it got ('1 column' or '2 columns',
    with the rows its panels were wrapped into when they were, and 'crowded' when no arrangement kept every
    panel at least `MIN_PANEL` and every text clear of the others).

    Its panels keep their shape (height / width); one journal column is tried first for a figure whose panels
    are narrow enough. Where its row of panels does not fit the width, the panels wrap into more rows (and a
    figure too tall for `MAX_HEIGHT` into more columns, whole rows of the figure side by side); empty panels
    are dropped, colour bars placed by hand are laid out again beside their panels, legends wider than a
    quarter of the width go below the panels, and titles and axis labels longer than their panel break into
    lines."""
    _draw(fig)
    w0, h0 = fig.get_size_inches()
    renderer = fig.canvas.get_renderer()
    panels_width = w0 - sum(leg.get_window_extent(renderer).width / fig.dpi for leg in _side_legends(fig))
    before = list(fig.axes)
    _drop_empty(fig)
    _colorbars_beside_panels(fig)
    if _fixed_aspect(fig):  # heat maps of fixed aspect: no space left between them, nor above and below
        fig.set_layout_engine("compressed", w_pad=0.07)  # compressed, colour bar labels end ~0.01 in outside
        before = []
    elif not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):  # fixed margins: laid out anew
        fig.set_layout_engine("constrained")
        before = []
    if fig.axes != before:
        _draw(fig)
    boxes = [ax.get_position(original=True) for ax in _panels(fig)]
    pw0 = float(np.median([b.width for b in boxes])) * w0 if boxes else w0
    ph0 = float(np.median([b.height for b in boxes])) * h0 if boxes else h0
    shape = (ph0 / max(pw0, 1e-3), ph0)
    grid = _grid(fig)
    n = len(grid[1]) if grid else 1
    ncols0 = grid[0].ncols if grid else 1
    rows0 = len({ax.get_subplotspec().rowspan.start for ax in grid[1]}) if grid else 1
    pad = ((w0 - ncols0 * pw0) / ncols0, (h0 - rows0 * ph0) / rows0)  # beside and above a panel: labels, titles

    def guess(width: float, ncols: int, rows: int) -> float:
        below = sum(leg.get_window_extent(renderer).height / fig.dpi for leg in fig.legends
                    if leg.get_window_extent(renderer).width > 0.25 * width * fig.dpi)  # moved below the panels
        return rows * (_panel_height(width / ncols - pad[0], shape) + pad[1]) + below

    labels = [(t, t.get_text(), t.get_fontsize()) for ax in _panels(fig)
              for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    for t, *_ in labels:  # broken into lines at their panel's size (`_fit_labels`), not at the figure's edge
        t.set_wrap(False)

    def arrange(width: float, ncols: int) -> int:  # the panels in rows of ncols, the figure sized for them
        for t, text, size in labels:  # as drawn: broken into lines again for this arrangement's panels
            t.set_text(text)
            t.set_fontsize(size)
        rows = _regrid(fig, grid, ncols) if grid else rows0
        _size(fig, width, rows, shape, guess(width, ncols, rows))
        return rows

    choices = [columns] if columns else ([1, 2] if panels_width <= 5.5 else [2])
    tried: list[tuple[tuple[bool, int], int, int, int]] = []  # (how crowded, columns of the page, of panels, rows)
    moved = False
    for cols in choices:
        width = COLUMN_WIDTHS[cols]
        if moved or sum(leg.get_window_extent(renderer).width / fig.dpi for leg in _side_legends(fig)) > 0.25 * width:
            _legends_below(fig, width)  # a legend at the side would take the panels' room
            moved = True
        wrap = grid is not None and (cols == 2 or bool(columns))
        for ncols in _arrangements(n, ncols0, width, shape, wrap):
            rows = arrange(width, ncols)
            tried.append(((bool(_squeezed(fig)), len(_crowding(fig))), cols, ncols, rows))
            if tried[-1][0] == (False, 0):
                return _layout_name(cols, ncols, ncols0, rows)
    _, cols, ncols, rows = min(tried, key=lambda t: t[0])  # nothing fits whole: the least crowded
    if (cols, ncols) != tried[-1][1:3]:
        if moved:
            _legends_below(fig, COLUMN_WIDTHS[cols])
        rows = arrange(COLUMN_WIDTHS[cols], ncols)
    return _layout_name(cols, ncols, ncols0, rows) + ", crowded"


def _layout_name(cols: int, ncols: int, ncols0: int, rows: int) -> str:
    name = f"{cols} column" + ("s" if cols > 1 else "")
    return name + (f", panels in {rows} rows of {ncols}" if ncols != ncols0 else "")


def _arrangements(n: int, ncols0: int, width: float, shape: tuple[float, float], wrap: bool) -> list[int]:
    """Numbers of columns to try for ``n`` panels (``ncols0`` of them in a row now) at ``width`` inches: the
    figure's own first, then fewer (its rows wrapped), then multiples of its own (whole rows side by side, for a
    figure too tall), leaving out those whose panels would clearly be too narrow or the figure too tall."""
    if not wrap or n < 2:
        return [ncols0]

    def plausible(c: int) -> bool:
        pw = (width - 0.3) / c - 0.45  # a panel's share of the width, less its tick labels
        return pw >= MIN_PANEL[0] and math.ceil(n / c) * (_panel_height(pw, shape) + 0.55) <= MAX_HEIGHT

    fewer = [math.ceil(n / rows) for rows in range(1, n + 1)]  # rows as even as they can be: 8 panels in 4 + 4
    wider = [k * ncols0 for k in range(2, n + 1) if k * ncols0 <= n or (k - 1) * ncols0 < n]
    tried = [c for c in dict.fromkeys([ncols0, *(c for c in fewer if c < ncols0), *wider]) if 1 <= c <= n]
    return [c for c in tried if plausible(c)] or [ncols0]


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
