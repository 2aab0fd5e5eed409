"""Head types: each head classified by the shape of its aligned aggregated attention map, with the
thresholds of the rules."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from vitscope.metrics.attention.maps import _canvas_geometry, aam_statistics

# ----------------------------------------------------------------------------------------------------
# head types
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadTypeThresholds:
    """Thresholds of :func:`head_types`; statistics as in :func:`aam_statistics`, offsets in tokens.

    Attributes:
        strict_mass_3x3: ``strict_local`` needs at least this fraction of the AAAM mass in the centre 3x3
            (self + 8 neighbours). 0.8 means the head looks almost only at the query and its immediate
            neighbours; uniform attention on a 14x14 grid puts only ~4 % there, so the rule is far from the
            global regime, and a head that leaks 20 % further out is already "soft".
        axial_anisotropy: ``axial`` needs ``max(a, 1/a) >=`` this, ``a = var_y / var_x``. 4 means a standard
            deviation at least twice as large along one axis as across it: clearly elongated, while
            Gaussian-like local heads (a ~ 1) stay well below.
        axial_band_mass: ``axial`` needs at least this fraction of mass on the centre row (horizontal) or
            centre column (vertical). 0.5: most of the mass lies exactly on the query's own row/column,
            which separates axial heads from merely stretched blobs.
        axial_min_std: ``axial`` needs a standard deviation along its axis of at least this many tokens. 1.0
            keeps a head that attends to a single neighbour (anisotropy is then huge, because the variance
            across is 0) out of ``axial``: elongation has to extend over several tokens. Row attention on a
            3x3 grid already has std 1.15.
        offset_min: ``offset_local`` needs a centre-of-mass offset of at least this many tokens. 0.5 means
            the mass centre is closer to a neighbour than to the query itself on the token grid.
        offset_peak_mass: ``offset_local`` needs at least this fraction of mass within the 3x3 around the
            (off-centre) peak, i.e. the displaced attention is itself local. 0.5: most of it sits there.
        global_entropy: ``global`` needs ``entropy_norm >=`` this (1 = uniform attention). 0.8 admits
            near-uniform heads and heads attending to a fixed region of the image (~0.84 on 14x14) but not
            local heads (a Gaussian of 1.5 tokens on 14x14 gives ~0.6).
        global_spread: ``global`` needs ``spread_norm >=`` this (1 = uniform attention). 0.5: mass reaches
            at least half as far as under uniform attention.
        global_max_locality: ``global`` needs ``locality`` (centre-3x3 mass over uniform attention's on the
            same grid, :func:`aam_statistics`) below this. 2: a head whose immediate neighbourhood gets at
            least twice its uniform share attends locally, however long its tail. This is the rule that scales
            with the grid: entropy and spread are normalised by uniform attention too, but a mixture of a
            local peak and a broad background keeps both near 1, and a local head of fixed size in tokens
            gets more "global" by them the smaller the grid (on 8x8, heads with 30-40 % of their mass in the
            centre 3x3, three times uniform's 12 %, have ``entropy_norm`` 0.82-0.88 and ``spread_norm``
            0.7-0.8).
        global_min_distance: only used when ``distance`` is passed to :func:`head_types`: ``global`` then
            also needs a mean attention distance (unit square, :func:`attention_distance`) of at least this.
            0.25 is about half the value of uniform attention on a square grid (0.56 on 14x14, 0.52 in the
            continuum limit).
        soft_peak_radius: ``soft_local`` needs the peak within this Chebyshev distance (tokens) of the
            centre. 1: peak on the query or on one of its 8 neighbours.
    """

    strict_mass_3x3: float = 0.8
    axial_anisotropy: float = 4.0
    axial_band_mass: float = 0.5
    axial_min_std: float = 1.0
    offset_min: float = 0.5
    offset_peak_mass: float = 0.5
    global_entropy: float = 0.8
    global_spread: float = 0.5
    global_max_locality: float = 2.0
    global_min_distance: float = 0.25
    soft_peak_radius: int = 1


_DIRECTIONS = ("right", "up-right", "up", "up-left", "left", "down-left", "down", "down-right")


def _direction_name(angle_deg: float) -> str:
    """One of 8 compass names for an angle counter-clockwise from "right" ("up" = +90); 45° sectors."""
    return _DIRECTIONS[int(round(angle_deg / 45.0)) % 8]


def head_types(
    aaam: Tensor,
    distance: Tensor | None = None,
    thresholds: HeadTypeThresholds | Mapping[str, float] | None = None,
) -> list[dict[str, object]]:
    """Classify each head by the shape of its aligned aggregated attention map.

    The rules are tried in this fixed order and the first that matches decides (statistics from
    :func:`aam_statistics`, thresholds ``t`` from :class:`HeadTypeThresholds`):

    1. ``"strict_local"``: peak at the centre and ``mass_3x3 >= t.strict_mass_3x3``. Statistic ``mass_3x3``.
    2. ``"axial"``: ``max(a, 1/a) >= t.axial_anisotropy`` (``a = anisotropy``) and, along the long axis,
       band mass ``>= t.axial_band_mass`` and standard deviation ``>= t.axial_min_std``. Direction
       ``"horizontal"`` (along the centre row, ``a < 1``) or ``"vertical"``. Statistic ``anisotropy``.
       Tried before ``offset_local`` so an elongated head with a one-sided bias is still axial.
    3. ``"offset_local"``: peak not at the centre, centre-of-mass ``offset >= t.offset_min`` and
       ``peak_mass_3x3 >= t.offset_peak_mass``. Direction: the centre-of-mass angle snapped to one of
       ``right, up-right, up, up-left, left, down-left, down, down-right`` (45° sectors). Statistic
       ``offset``.
    4. ``"global"``: ``entropy_norm >= t.global_entropy``, ``spread_norm >= t.global_spread`` and
       ``locality < t.global_max_locality`` (and, when ``distance`` is given, ``distance >=
       t.global_min_distance``). Statistic ``entropy_norm``.
    5. ``"soft_local"``: peak within Chebyshev distance ``t.soft_peak_radius`` of the centre (mass too spread
       for ``strict_local``, not spread enough for ``global``). Statistic ``mass_3x3``.
    6. ``"mixed"``: none of the above (e.g. several distant modes). Statistic ``entropy_norm``.

    Args:
        aaam: ``(H, 2h - 1, 2w - 1)`` aligned aggregated attention maps (:func:`aligned_maps`).
        distance: optional mean attention distance per head on the unit square, ``(H,)`` or ``(B, H)``
            (averaged over ``B``), from :func:`attention_distance`; reported and used by the ``global`` rule.
        thresholds: a :class:`HeadTypeThresholds`, a mapping of field overrides, or None for the defaults.

    Returns:
        One dict per head: ``{"head": int, "type": str, "direction": str | None, "offset": float (centre of
        mass offset length in tokens), "statistic": str, "value": float}``, plus ``"distance": float`` when
        ``distance`` is given.
    """
    if thresholds is None:
        t = HeadTypeThresholds()
    elif isinstance(thresholds, HeadTypeThresholds):
        t = thresholds
    elif isinstance(thresholds, Mapping):
        known = {f.name for f in fields(HeadTypeThresholds)}
        unknown = set(thresholds) - known
        if unknown:
            raise ValueError(f"unknown head-type thresholds {sorted(unknown)}; known: {sorted(known)}")
        t = HeadTypeThresholds(**thresholds)
    else:
        raise TypeError(f"thresholds must be HeadTypeThresholds, a mapping or None, got {type(thresholds)}")

    canvas, _, _ = _canvas_geometry(aaam)
    H = canvas.shape[0]
    stats = {k: v.tolist() for k, v in aam_statistics(canvas).items()}
    dist: list[float] | None = None
    if distance is not None:
        d = torch.as_tensor(distance, dtype=torch.float64)
        if d.ndim == 2:
            d = d.mean(dim=0)
        if d.ndim != 1 or d.shape[0] != H:
            raise ValueError(f"distance must have shape (H,) or (B, H) with H={H}, got {tuple(d.shape)}")
        dist = d.tolist()

    out: list[dict[str, object]] = []
    for i in range(H):
        s = {k: v[i] for k, v in stats.items()}
        peak_at_centre = s["peak_dy"] == 0 and s["peak_dx"] == 0
        peak_cheb = max(abs(s["peak_dy"]), abs(s["peak_dx"]))
        ratio = max(s["anisotropy"], 1.0 / s["anisotropy"])
        horizontal = s["anisotropy"] < 1.0
        band = s["mass_row"] if horizontal else s["mass_col"]
        axis_std = math.sqrt(s["var_x"] if horizontal else s["var_y"])
        direction: str | None = None
        if peak_at_centre and s["mass_3x3"] >= t.strict_mass_3x3:
            kind, stat = "strict_local", "mass_3x3"
        elif ratio >= t.axial_anisotropy and band >= t.axial_band_mass and axis_std >= t.axial_min_std:
            kind, stat = "axial", "anisotropy"
            direction = "horizontal" if horizontal else "vertical"
        elif not peak_at_centre and s["offset"] >= t.offset_min and s["peak_mass_3x3"] >= t.offset_peak_mass:
            kind, stat = "offset_local", "offset"
            direction = _direction_name(s["angle"])
        elif (
            s["entropy_norm"] >= t.global_entropy
            and s["spread_norm"] >= t.global_spread
            and s["locality"] < t.global_max_locality
            and (dist is None or dist[i] >= t.global_min_distance)
        ):
            kind, stat = "global", "entropy_norm"
        elif peak_cheb <= t.soft_peak_radius:
            kind, stat = "soft_local", "mass_3x3"
        else:
            kind, stat = "mixed", "entropy_norm"
        entry: dict[str, object] = {
            "head": i,
            "type": kind,
            "direction": direction,
            "offset": float(s["offset"]),
            "statistic": stat,
            "value": float(s[stat]),
        }
        if dist is not None:
            entry["distance"] = float(dist[i])
        out.append(entry)
    return out
