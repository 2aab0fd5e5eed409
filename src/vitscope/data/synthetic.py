"""Generated images that need no download: a cluttered shape benchmark with dense ground truth.

Every image is one *scene*: a textured background with clutter blobs, distractor shapes (other classes,
smaller, possibly cut by the border or in front), the labelled object, and sometimes an occluder. The
class is the object's *shape*: 12 classes, each a composition of named parts (`SHAPE_CLASSES`) with
named keypoints (tips, corners, part centres) in the object's own frame. Position, scale, rotation
(+-45 degrees, so left/right keypoint names keep their meaning), aspect, colour and texture are random.

A scene is sampled from ``(seed, index)`` alone (the variants below share everything but the labelled
object's texture, and the background's colours where they would be too close to it) and drawn at any
resolution with vectorised numpy; the same seed gives the same bytes. Ground truth, aligned with the
pixels: the visible foreground mask, part ids (global ids into `PART_NAMES`, a partition of the
foreground), keypoints ``(K, 3) x, y, visible`` (visible = the pixel under the point shows the object:
occluded or outside -> 0), the object's unoccluded box, and the visible fraction.

Variants: ``random`` (texture random), ``texture-bound`` (each class wears its own texture,
`CLASS_TEXTURES`), ``cue-conflict`` (shape of class A wearing the bound texture of class B != A;
``texture_label`` = B). Videos, correspondence pairs and the instance-retrieval split are in
`vitscope.data.synthetic_tasks`, built from the same scenes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vitscope.data.base import Batch, Sample
from vitscope.models.registry import Preprocessing

# ---------------------------------------------------------------- shape table (object frame: u right, v down)
# E ellipse (cx, cy, rx, ry)   R rectangle (cx, cy, half w, half h)   C capsule (x0, y0, x1, y1, radius)
# P convex polygon ((x, y), ...)   A annulus (cx, cy, r_out, r_in). Parts are painted in table order
# (a later part wins where two overlap), so part masks partition the object.


@dataclass(frozen=True)
class ShapeClass:
    """A class: parts (name, primitives) in paint order and keypoints (name, u, v) in the object frame."""

    name: str
    parts: tuple[tuple[str, tuple[tuple, ...]], ...]
    keypoints: tuple[tuple[str, float, float], ...]


def _mirror(prim: tuple) -> tuple:
    """The primitive mirrored top/bottom (v -> -v)."""
    if prim[0] == "P":
        return ("P", tuple((x, -y) for x, y in reversed(prim[1])))
    if prim[0] == "C":
        return ("C", prim[1], -prim[2], prim[3], -prim[4], prim[5])
    return (prim[0], prim[1], -prim[2], *prim[3:])


def _dome(rx: float, ry: float, n: int = 9) -> tuple:
    t = np.linspace(np.pi, 2 * np.pi, n)
    return ("P", tuple((round(float(rx * np.cos(a)), 4), round(float(ry * np.sin(a)), 4)) for a in t))


_LEG = [("C", x, -0.2, x + 0.12, -0.82, 0.06) for x in (-0.15, 0.12, 0.4)]
_FLETCH = ("P", ((-0.5, 0.0), (-0.78, -0.32), (-0.98, -0.32), (-0.72, 0.0)))
_FIN = ("P", ((-0.24, 0.25), (-0.62, 0.8), (-0.24, 0.62)))

SHAPE_CLASSES: tuple[ShapeClass, ...] = (
    ShapeClass("snowman", (
        ("body", (("E", 0, 0.42, 0.52, 0.5),)),
        ("head", (("E", 0, -0.3, 0.34, 0.32),)),
        ("hat", (("R", 0, -0.78, 0.24, 0.17), ("R", 0, -0.62, 0.38, 0.07))),
    ), (("hat_top", 0, -0.86), ("head_centre", 0, -0.3), ("body_centre", 0, 0.42), ("body_bottom", 0, 0.84),
        ("body_left", -0.44, 0.42), ("body_right", 0.44, 0.42), ("brim_left", -0.32, -0.62),
        ("brim_right", 0.32, -0.62))),
    ShapeClass("mushroom", (
        ("stem", (("R", 0, 0.45, 0.2, 0.47),)),
        ("cap", (_dome(0.95, 0.75),)),
    ), (("cap_top", 0, -0.64), ("cap_left", -0.82, -0.07), ("cap_right", 0.82, -0.07), ("stem_centre", 0, 0.45),
        ("stem_bottom", 0, 0.85))),
    ShapeClass("tree", (
        ("trunk", (("R", 0, 0.65, 0.14, 0.3),)),
        ("canopy", (("P", ((0, -0.98), (-0.75, 0.38), (0.75, 0.38))),)),
    ), (("top", 0, -0.8), ("canopy_left", -0.6, 0.3), ("canopy_right", 0.6, 0.3), ("canopy_centre", 0, 0.0),
        ("trunk_bottom", 0, 0.88))),
    ShapeClass("house", (
        ("chimney", (("R", 0.45, -0.6, 0.1, 0.22),)),
        ("walls", (("R", 0, 0.38, 0.68, 0.52),)),
        ("roof", (("P", ((0, -0.95), (-0.88, -0.12), (0.88, -0.12))),)),
        ("door", (("R", -0.25, 0.62, 0.16, 0.28),)),
        ("window", (("R", 0.35, 0.3, 0.15, 0.13),)),
    ), (("roof_top", 0, -0.8), ("roof_left", -0.74, -0.17), ("roof_right", 0.74, -0.17),
        ("wall_bottom_left", -0.6, 0.84), ("wall_bottom_right", 0.6, 0.84), ("door_centre", -0.25, 0.62),
        ("chimney_top", 0.45, -0.74), ("window_centre", 0.35, 0.3))),
    ShapeClass("fish", (
        ("tail", (("P", ((-0.42, 0), (-0.98, -0.55), (-0.98, 0.55))),)),
        ("fin", (("P", ((0.05, -0.3), (-0.32, -0.72), (0.38, -0.32))),)),
        ("body", (("E", 0.12, 0, 0.66, 0.38),)),
        ("eye", (("E", 0.5, -0.08, 0.09, 0.09),)),
    ), (("nose", 0.7, 0.0), ("tail_top", -0.88, -0.36), ("tail_bottom", -0.88, 0.36), ("fin_tip", -0.17, -0.59),
        ("eye", 0.5, -0.08), ("body_centre", 0.1, 0.12))),
    ShapeClass("key", (
        ("bow", (("A", -0.58, 0, 0.38, 0.17),)),
        ("shaft", (("R", 0.22, 0, 0.62, 0.1),)),
        ("teeth", (("R", 0.5, 0.2, 0.07, 0.13), ("R", 0.72, 0.22, 0.07, 0.15))),
    ), (("bow_left", -0.86, 0.0), ("bow_top", -0.58, -0.28), ("bow_bottom", -0.58, 0.28), ("shaft_tip", 0.78, 0.0),
        ("tooth_1", 0.5, 0.25), ("tooth_2", 0.72, 0.28))),
    ShapeClass("lamp", (
        ("pole", (("R", 0, 0.27, 0.07, 0.57),)),
        ("shade", (("P", ((-0.3, -0.92), (0.3, -0.92), (0.62, -0.3), (-0.62, -0.3))),)),
        ("base", (("E", 0, 0.82, 0.52, 0.14),)),
    ), (("shade_top_left", -0.24, -0.84), ("shade_top_right", 0.24, -0.84), ("shade_bottom_left", -0.5, -0.36),
        ("shade_bottom_right", 0.5, -0.36), ("base_left", -0.38, 0.82), ("base_right", 0.38, 0.82),
        ("pole_centre", 0, 0.3))),
    ShapeClass("table", (
        ("legs", (("R", -0.72, 0.3, 0.08, 0.55), ("R", 0.72, 0.3, 0.08, 0.55))),
        ("top", (("R", 0, -0.3, 0.92, 0.12),)),
    ), (("top_left", -0.84, -0.3), ("top_right", 0.84, -0.3), ("top_centre", 0, -0.3), ("left_foot", -0.72, 0.78),
        ("right_foot", 0.72, 0.78))),
    ShapeClass("arrow", (
        ("shaft", (("R", -0.1, 0, 0.62, 0.07),)),
        ("head", (("P", ((0.98, 0), (0.5, -0.36), (0.5, 0.36))),)),
        ("fletching", (_FLETCH, _mirror(_FLETCH))),
    ), (("tip", 0.84, 0.0), ("barb_top", 0.58, -0.24), ("barb_bottom", 0.58, 0.24), ("nock", -0.64, 0.0),
        ("fletch_top", -0.8, -0.22), ("fletch_bottom", -0.8, 0.22))),
    ShapeClass("bug", (
        ("legs", tuple(_LEG + [_mirror(p) for p in _LEG])),
        ("antennae", (("C", -0.72, -0.1, -0.95, -0.45, 0.045), ("C", -0.72, 0.1, -0.95, 0.45, 0.045))),
        ("body", (("E", 0.1, 0, 0.52, 0.32),)),
        ("head", (("E", -0.58, 0, 0.22, 0.2),)),
    ), (("head_centre", -0.58, 0.0), ("rear", 0.52, 0.0), ("leg_front_top", -0.04, -0.76),
        ("leg_mid_top", 0.23, -0.76), ("leg_back_top", 0.51, -0.76), ("leg_front_bottom", -0.04, 0.76),
        ("leg_mid_bottom", 0.23, 0.76), ("leg_back_bottom", 0.51, 0.76), ("antenna_top", -0.92, -0.41),
        ("antenna_bottom", -0.92, 0.41))),
    ShapeClass("stickman", (
        ("legs", (("C", 0, 0.2, -0.42, 0.92, 0.085), ("C", 0, 0.2, 0.42, 0.92, 0.085))),
        ("arms", (("C", 0, -0.35, -0.6, -0.05, 0.075), ("C", 0, -0.35, 0.6, -0.05, 0.075))),
        ("torso", (("C", 0, -0.5, 0, 0.2, 0.1),)),
        ("head", (("E", 0, -0.74, 0.21, 0.21),)),
    ), (("head", 0, -0.74), ("neck", 0, -0.48), ("hip", 0, 0.17), ("left_hand", -0.56, -0.07),
        ("right_hand", 0.56, -0.07), ("left_foot", -0.39, 0.86), ("right_foot", 0.39, 0.86))),
    ShapeClass("rocket", (
        ("fins", (_FIN, ("P", tuple((-x, y) for x, y in reversed(_FIN[1]))))),
        ("flame", (("P", ((-0.14, 0.64), (0.14, 0.64), (0, 0.98))),)),
        ("body", (("R", 0, 0.08, 0.24, 0.58),)),
        ("nose", (("P", ((0, -0.98), (-0.24, -0.48), (0.24, -0.48))),)),
        ("window", (("E", 0, -0.12, 0.12, 0.12),)),
    ), (("nose_tip", 0, -0.82), ("left_fin_tip", -0.5, 0.68), ("right_fin_tip", 0.5, 0.68), ("window", 0, -0.12),
        ("flame_tip", 0, 0.86), ("body_centre", 0, 0.35))),
)

SHAPES: tuple[str, ...] = tuple(c.name for c in SHAPE_CLASSES)
PART_NAMES: tuple[str, ...] = tuple(f"{c.name}/{p}" for c in SHAPE_CLASSES for p, _ in c.parts)
_PART_OFFSET = np.cumsum([0] + [len(c.parts) for c in SHAPE_CLASSES])
KEYPOINT_NAMES: dict[str, tuple[str, ...]] = {c.name: tuple(k[0] for k in c.keypoints) for c in SHAPE_CLASSES}
MAX_KEYPOINTS = max(len(c.keypoints) for c in SHAPE_CLASSES)


def part_ids(cls: int) -> range:
    """The global part ids (values in the parts map) of class ``cls``."""
    return range(int(_PART_OFFSET[cls]) + 1, int(_PART_OFFSET[cls + 1]) + 1)


def _compile(prim: tuple) -> tuple:
    """A primitive with its constants precomputed (what `_inside` evaluates)."""
    kind = prim[0]
    if kind == "E":
        _, cx, cy, rx, ry = prim
        return ("E", cx, cy, 1 / rx ** 2, 1 / ry ** 2)
    if kind == "A":
        _, cx, cy, ro, ri = prim
        return ("A", cx, cy, ro * ro, ri * ri)
    if kind == "C":
        _, x0, y0, x1, y1, r = prim
        dx, dy = x1 - x0, y1 - y0
        return ("C", x0, y0, dx, dy, 1 / (dx * dx + dy * dy), r * r)
    if kind == "P":  # half-planes a u + b v + c >= 0, one per edge
        pts = [(float(x), float(y)) for x, y in prim[1]]
        edges = list(zip(pts, pts[1:] + pts[:1], strict=True))
        sign = math.copysign(1.0, sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in edges))
        planes = []
        for (x0, y0), (x1, y1) in edges:
            a, b = -sign * (y1 - y0), sign * (x1 - x0)
            planes.append((a, b, -(a * x0 + b * y0)))
        return ("P", tuple(planes))
    if kind == "R":
        return prim
    raise ValueError(f"unknown primitive {kind!r}")


def _inside(prim: tuple, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Boolean mask of the points (u, v) inside a compiled primitive."""
    kind = prim[0]
    if kind == "E":
        _, cx, cy, irx, iry = prim
        du, dv = u - cx, v - cy
        return du * du * irx + dv * dv * iry <= 1
    if kind == "R":
        _, cx, cy, hw, hh = prim
        return (np.abs(u - cx) <= hw) & (np.abs(v - cy) <= hh)
    if kind == "A":
        _, cx, cy, ro2, ri2 = prim
        du, dv = u - cx, v - cy
        r2 = du * du + dv * dv
        return (r2 <= ro2) & (r2 >= ri2)
    if kind == "C":
        _, x0, y0, dx, dy, inv, r2 = prim
        du, dv = u - x0, v - y0
        t = np.clip((du * dx + dv * dy) * inv, 0, 1)
        du -= t * dx
        dv -= t * dy
        return du * du + dv * dv <= r2
    out = None
    for a, b, c in prim[1]:
        h = a * u + b * v >= -c
        out = h if out is None else out & h
    return out


_COMPILED: tuple[tuple[tuple[int, tuple[tuple, ...]], ...], ...] = tuple(
    tuple((int(_PART_OFFSET[k]) + j + 1, tuple(_compile(p) for p in prims)) for j, (_, prims) in enumerate(c.parts))
    for k, c in enumerate(SHAPE_CLASSES))


# ---------------------------------------------------------------- textures
def _frac(x: np.ndarray) -> np.ndarray:
    return x - np.floor(x)


TEXTURE_KINDS = ("flat", "stripes", "checker", "dots", "rings", "plaid", "blobs", "grid")


@dataclass(frozen=True)
class Texture:
    """A two-colour pattern in the frame it is evaluated in (object frame for objects, image for the
    background): ``freq`` cycles per unit, orientation ``theta``, ``waves`` (4, 3) for the blob pattern."""

    kind: int
    c1: tuple[float, float, float]
    c2: tuple[float, float, float]
    freq: float
    theta: float
    phase: float
    waves: tuple[tuple[float, float, float], ...]

    def __call__(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Colours (N, 3) float32 at points (N,) (u, v float32; all arithmetic stays in float32)."""
        k = TEXTURE_KINDS[self.kind]
        c1 = np.asarray(self.c1, np.float32)
        if k == "flat":
            return np.broadcast_to(c1, (len(u), 3)).copy()
        tau, f = 2 * math.pi, self.freq
        c, s = math.cos(self.theta) * f, math.sin(self.theta) * f
        a = c * u + s * v
        if k == "stripes":
            w = np.sin(tau * a + self.phase) > 0
        elif k == "grid":
            w = (_frac(a + self.phase) < 0.22) | (_frac(c * v - s * u) < 0.22)
        elif k == "dots":
            w = (_frac(a + self.phase) - 0.5) ** 2 + (_frac(c * v - s * u) - 0.5) ** 2 < 0.09
        elif k == "rings":
            w = np.sin(tau * np.sqrt(a * a + (c * v - s * u) ** 2) + self.phase) > 0
        elif k == "checker":
            w = np.sin(tau * a + self.phase) * np.sin(tau * (c * v - s * u)) > 0
        elif k == "plaid":
            w = np.sin(tau * a + self.phase) + np.sin(tau * (c * v - s * u))
            w = 0.5 + 0.25 * w
        else:  # blobs: the sign of a sum of four random plane waves
            z = None
            for kx, ky, ph in self.waves:
                t = np.sin((tau * f * kx) * u + (tau * f * ky) * v + ph)
                z = t if z is None else z + t
            w = z > 0
        w = np.asarray(w, dtype=np.float32)[:, None]
        return c1 + w * (np.asarray(self.c2, np.float32) - c1)


class Draws:
    """Uniform numbers served from blocks of one generator (one numpy call per 64 numbers: scene sampling
    makes ~100 small draws, and numpy's per-call overhead dominated it)."""

    def __init__(self, rng: np.random.Generator | Draws):
        self.rng = rng.rng if isinstance(rng, Draws) else rng
        self._buf: list[float] = []
        self._i = 0

    def random(self) -> float:
        i = self._i
        if i >= len(self._buf):
            self._buf, i = self.rng.random(64).tolist(), 0
        self._i = i + 1
        return self._buf[i]

    def take(self, n: int) -> list[float]:
        """The next ``n`` numbers (same values as ``n`` calls of `random`)."""
        if len(self._buf) - self._i < n:
            self._buf, self._i = self._buf[self._i:] + self.rng.random(max(64, n)).tolist(), 0
        out = self._buf[self._i:self._i + n]
        self._i += n
        return out

    def uniform(self, lo: float = 0.0, hi: float = 1.0) -> float:
        return lo + (hi - lo) * self.random()

    def integers(self, lo: int, hi: int | None = None) -> int:
        lo, hi = (0, lo) if hi is None else (lo, hi)
        return min(lo + int(self.random() * (hi - lo)), hi - 1)

    def choice(self, seq: list | tuple) -> object:
        return seq[self.integers(len(seq))]


def _draws(rng: np.random.Generator | Draws) -> Draws:
    return rng if isinstance(rng, Draws) else Draws(rng)


def random_texture(rng: np.random.Generator | Draws, kind: int | None = None) -> Texture:
    """A random texture; always the same number of draws, so later draws do not depend on the kind."""
    r = _draws(rng).take(22)
    k = min(int(r[0] * len(TEXTURE_KINDS)), len(TEXTURE_KINDS) - 1)
    waves = tuple((2 * r[j] - 1, 2 * r[j + 1] - 1, math.pi * (2 * r[j + 2] - 1)) for j in range(10, 22, 3))
    return Texture(k if kind is None else kind, tuple(r[1:4]), tuple(r[4:7]), 1.2 + 2.8 * r[7], math.pi * r[8],
                   2 * math.pi * r[9], waves)


# texture-bound variant: (kind, colour 1, colour 2, freq, theta) per class, each combination unique
CLASS_TEXTURES: tuple[tuple[str, tuple, tuple, float, float], ...] = (
    ("stripes", (0.85, 0.1, 0.1), (0.95, 0.95, 0.9), 3.0, 0.0),
    ("checker", (0.1, 0.2, 0.8), (0.95, 0.85, 0.1), 2.5, 0.3),
    ("dots", (0.1, 0.55, 0.15), (0.05, 0.05, 0.05), 3.5, 0.0),
    ("rings", (0.9, 0.5, 0.05), (0.3, 0.05, 0.4), 3.0, 0.0),
    ("plaid", (0.0, 0.6, 0.7), (0.95, 0.4, 0.6), 2.5, 0.8),
    ("blobs", (0.5, 0.3, 0.1), (0.9, 0.85, 0.6), 1.5, 0.0),
    ("grid", (0.95, 0.95, 0.95), (0.1, 0.1, 0.5), 3.0, 0.5),
    ("stripes", (0.2, 0.2, 0.2), (0.95, 0.9, 0.2), 4.0, 1.2),
    ("checker", (0.95, 0.3, 0.6), (0.2, 0.6, 0.2), 4.0, 0.0),
    ("dots", (0.95, 0.95, 0.6), (0.7, 0.1, 0.2), 2.0, 0.5),
    ("rings", (0.2, 0.5, 0.95), (0.95, 0.95, 0.95), 4.5, 0.0),
    ("grid", (0.9, 0.6, 0.2), (0.3, 0.1, 0.05), 2.0, 0.0),
)


def class_texture(cls: int, rng: np.random.Generator | Draws) -> Texture:
    """Class ``cls``'s bound texture, with a little jitter of colour (+-0.05), phase, scale and angle."""
    kind, c1, c2, freq, theta = CLASS_TEXTURES[cls]
    t = random_texture(rng)  # the jitter comes from a random texture's draws
    j = [0.1 * (x - 0.5) for x in (*t.c1, *t.c2)]
    return Texture(TEXTURE_KINDS.index(kind), tuple(min(max(c + e, 0.0), 1.0) for c, e in zip(c1, j[:3], strict=True)),
                   tuple(min(max(c + e, 0.0), 1.0) for c, e in zip(c2, j[3:], strict=True)),
                   freq * (0.9 + 0.2 * (t.freq - 1.2) / 2.8), theta + 0.2 * (t.theta / math.pi - 0.5), t.phase,
                   t.waves)


# ---------------------------------------------------------------- scenes


@dataclass(frozen=True)
class Obj:
    """One thing in a scene. cls >= 0: a shape class; cls = -1: a blob made of ``prims``. Pose: centre
    (cx, cy) and scale (object half-size) in image units (the image is [0, 1]^2), angle in radians,
    aspect = width / height stretch. target: object id in the ground truth (0 = not a target)."""

    cls: int
    cx: float
    cy: float
    scale: float
    angle: float
    aspect: float
    texture: Texture
    target: int = 0
    prims: tuple = ()

    def frame(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Image coordinates (units) -> object frame (u, v); float32 in, float32 out."""
        r = math.sqrt(self.aspect)
        c, s = math.cos(self.angle), math.sin(self.angle)
        cu, cv = c / (self.scale * r), r / self.scale * c
        su, sv = s / (self.scale * r), r / self.scale * s
        dx, dy = x - self.cx, y - self.cy
        return cu * dx + su * dy, cv * dy - sv * dx

    def to_image(self, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Object frame -> image coordinates (units)."""
        c, s = math.cos(self.angle), math.sin(self.angle)
        r = math.sqrt(self.aspect)
        a, b = u * self.scale * r, v * self.scale / r
        return self.cx + c * a - s * b, self.cy + s * a + c * b

    @property
    def reach(self) -> float:
        """Radius (units) of a disc around the centre that holds the whole object."""
        return self.scale * 1.42 * math.sqrt(max(self.aspect, 1 / self.aspect))


@dataclass(frozen=True)
class Scene:
    """Background texture, objects in paint order, pixel-noise level and seed, and the labels."""

    background: Texture
    objects: tuple[Obj, ...]
    label: int
    texture_label: int | None = None
    noise: float = 0.0
    noise_seed: tuple[int, ...] = (0,)
    instance: int | None = None


def _blob(rng: np.random.Generator | Draws, cx: float, cy: float, size: float, texture: Texture) -> Obj:
    d = _draws(rng)
    kind, a, b, angle = d.integers(4), d.uniform(0.4, 1.0), d.uniform(0.4, 1.0), d.uniform(0, math.pi)
    prims = (("E", 0, 0, a, b), ("R", 0, 0, a, b * 0.8), ("C", -a, 0, a, 0, b * 0.5),
             ("P", ((0, -b), (-a, b), (a, b))))[kind]
    return Obj(-1, cx, cy, size, angle, 1.0, texture, prims=(_compile(prims),))


def _far_colours(t: Texture, ref: Texture) -> Texture:
    """``t`` with its colours inverted when its mean is too close to ``ref``'s (keeps the object visible)."""
    if sum(abs((p + q - r - s) / 2) for p, q, r, s in zip(t.c1, t.c2, ref.c1, ref.c2, strict=True)) >= 0.45:
        return t
    return replace(t, c1=tuple(1 - c for c in t.c1), c2=tuple(1 - c for c in t.c2))


def sample_scene(seed: int, index: int, variant: str = "random", label: int | None = None,
                 stream: int = 0) -> Scene:
    """The scene of image ``index``. Geometry and appearance come from separate random streams, so the
    variants ('random', 'texture-bound', 'cue-conflict') differ only in the labelled object's texture.
    label: force the class (the rest of the scene is unchanged); stream: a separate family of scenes."""
    g = Draws(np.random.default_rng([seed, index, 0, stream]))
    a = Draws(np.random.default_rng([seed, index, 1, stream]))
    k = len(SHAPE_CLASSES)
    drawn = g.integers(k)
    label = drawn if label is None else int(label)
    scale = g.uniform(0.2, 0.38)
    m = 0.75 * scale
    cx, cy = g.uniform(m, 1 - m), g.uniform(m, 1 - m)
    main_tex = random_texture(a)
    texture_label = None
    if variant in ("texture-bound", "cue-conflict"):  # own stream: the rest of the scene stays the same
        b = Draws(np.random.default_rng([seed, index, 3, stream]))
        texture_label = label if variant == "texture-bound" else (label + 1 + b.integers(k - 1)) % k
        main_tex = class_texture(texture_label, b)
    elif variant != "random":
        raise ValueError(f"unknown variant {variant!r}; choose random, texture-bound or cue-conflict")
    background = _far_colours(random_texture(a), main_tex)
    objs: list[Obj] = []
    for _ in range(g.integers(2, 6)):  # clutter blobs
        objs.append(_blob(g, g.random(), g.random(), g.uniform(0.04, 0.16), random_texture(a)))
    others = [c for c in range(k) if c != label]
    for _ in range(g.integers(0, 3)):  # distractor shapes behind, anywhere (partly out of frame too)
        objs.append(Obj(g.choice(others), g.uniform(-0.05, 1.05), g.uniform(-0.05, 1.05),
                        scale * g.uniform(0.3, 0.6), g.uniform(-math.pi, math.pi), math.exp(g.uniform(-0.3, 0.3)),
                        random_texture(a)))
    objs.append(Obj(label, cx, cy, scale, g.uniform(-math.pi / 4, math.pi / 4), math.exp(g.uniform(-0.2, 0.2)),
                    main_tex, target=1))
    if g.random() < 0.25:  # a small distractor shape in front
        d, t = scale * g.uniform(0.7, 1.3), g.uniform(0, 2 * math.pi)
        objs.append(Obj(g.choice(others), cx + d * math.cos(t), cy + d * math.sin(t), scale * g.uniform(0.25, 0.45),
                        g.uniform(-math.pi, math.pi), 1.0, random_texture(a)))
    if g.random() < 0.35:  # an occluding blob
        d, t = scale * g.uniform(0.4, 1.0), g.uniform(0, 2 * math.pi)
        objs.append(_blob(g, cx + d * math.cos(t), cy + d * math.sin(t), scale * g.uniform(0.2, 0.45),
                          random_texture(a)))
    return Scene(background, tuple(objs), label, texture_label, g.uniform(0, 0.05), (seed, index, 2, stream))


@dataclass
class Rendered:
    """A drawn scene: image (S, S, 3) float32 in [0, 1]; objects (S, S) int16 target ids (0 = none);
    parts (S, S) int16 global part ids of the visible target pixels; keypoints {target: (K, 3)};
    boxes {target: (4,) unoccluded box}; visible {target: visible / unoccluded pixels}."""

    image: np.ndarray
    objects: np.ndarray
    parts: np.ndarray
    keypoints: dict[int, np.ndarray] = field(default_factory=dict)
    boxes: dict[int, np.ndarray] = field(default_factory=dict)
    visible: dict[int, float] = field(default_factory=dict)


def render(scene: Scene, size: int) -> Rendered:
    """Draw ``scene`` at ``size`` x ``size`` pixels (vectorised; work per object is limited to its box)."""
    S = int(size)
    coords = (np.arange(S, dtype=np.float32) + 0.5) / S
    img = scene.background(np.tile(coords, S), np.repeat(coords, S)).reshape(S, S, 3)
    owner = np.zeros((S, S), np.int16)
    parts = np.zeros((S, S), np.int16)
    full: dict[int, int] = {}
    boxes: dict[int, np.ndarray] = {}
    for obj in scene.objects:
        r = obj.reach
        y0, y1 = max(0, int((obj.cy - r) * S)), min(S, int(np.ceil((obj.cy + r) * S)))
        x0, x1 = max(0, int((obj.cx - r) * S)), min(S, int(np.ceil((obj.cx + r) * S)))
        if y1 <= y0 or x1 <= x0:
            continue
        u, v = obj.frame(coords[None, x0:x1], coords[y0:y1, None])
        pid = np.zeros(u.shape, np.int16)
        for part, prims in (_COMPILED[obj.cls] if obj.cls >= 0 else ((1, obj.prims),)):
            for p in prims:
                pid[_inside(p, u, v)] = part
        m = pid > 0
        if not m.any():
            continue
        img[y0:y1, x0:x1][m] = obj.texture(u[m], v[m])
        owner[y0:y1, x0:x1][m] = obj.target
        parts[y0:y1, x0:x1][m] = pid[m] if obj.target else 0
        if obj.target:
            full[obj.target] = int(m.sum())
            rows, cols = np.nonzero(m)
            boxes[obj.target] = np.array([x0 + cols.min(), y0 + rows.min(), x0 + cols.max() + 1,
                                          y0 + rows.max() + 1], np.float32)
    if scene.noise > 0:  # luminance noise, uniform with standard deviation ``noise``
        noise = np.random.default_rng(list(scene.noise_seed)).random((S, S, 1), dtype=np.float32)
        img += (noise - 0.5) * np.float32(scene.noise * 12 ** 0.5)
    img = np.clip(img, 0, 1, out=img)
    out = Rendered(img, owner, parts, boxes=boxes)
    for obj in scene.objects:
        if obj.target:
            out.keypoints[obj.target] = keypoints(obj, owner, S)
            out.visible[obj.target] = float((owner == obj.target).sum()) / max(full.get(obj.target, 0), 1)
    return out


def keypoints(obj: Obj, owner: np.ndarray, size: int) -> np.ndarray:
    """(K, 3) ``x, y, visible`` in pixels; visible = inside the image and the pixel shows this object."""
    kps = SHAPE_CLASSES[obj.cls].keypoints
    x, y = obj.to_image(np.array([k[1] for k in kps]), np.array([k[2] for k in kps]))
    x, y = x * size, y * size
    inside = (x >= 0) & (x < size) & (y >= 0) & (y < size)
    vis = np.zeros(len(kps), bool)
    xi, yi = np.floor(x[inside]).astype(int), np.floor(y[inside]).astype(int)
    vis[inside] = owner[yi, xi] == obj.target
    return np.stack([x, y, vis.astype(np.float64)], axis=1).astype(np.float32)


def to_sample(scene: Scene, size: int, index: int = -1) -> Sample:
    """A scene drawn as a `Sample` (target 1 = the labelled object)."""
    r = render(scene, size)
    kp = np.zeros((MAX_KEYPOINTS, 3), np.float32)
    k = r.keypoints.get(1)
    if k is not None:
        kp[:len(k)] = k
    extra = {"visible_fraction": r.visible.get(1, 0.0), "n_keypoints": 0 if k is None else len(k)}
    if scene.texture_label is not None:
        extra["texture_label"] = scene.texture_label
    if scene.instance is not None:
        extra["instance"] = scene.instance
    return Sample(image=r.image, label=scene.label, mask=r.objects == 1, parts=r.parts.astype(np.int64),
                  objects=r.objects.astype(np.int64), keypoints=kp,
                  bbox=r.boxes.get(1, np.zeros(4, np.float32)), index=index, extra=extra)


def draw(index: int, size: int, seed: int = 0, variant: str = "random") -> tuple[np.ndarray, np.ndarray, int]:
    """Image (size, size, 3) float32 in [0, 1], foreground mask (size, size) bool, class id."""
    scene = sample_scene(seed, index, variant)
    r = render(scene, size)
    return r.image, r.objects == 1, scene.label


def batches_of(samples: Iterator[Sample], batch_size: int, pre: Preprocessing,
               extra_keys: tuple[str, ...] = ()) -> Iterator[Batch]:
    """Group samples into normalised batches (resized to ``pre.input_size`` when drawn at another size);
    ``extra_keys``: per-sample ``extra`` values stacked into ``batch.extra``."""
    from vitscope.data.transforms import collate, resize

    chunk: list[Sample] = []

    def emit() -> Batch:
        fitted = [s if s.size == (pre.input_size,) * 2 else resize(s, pre.input_size, pre.input_size)
                  for s in chunk]
        b = collate(fitted, pre)
        for key in extra_keys:
            b.extra[key] = torch.tensor([s.extra[key] for s in chunk])
        return b

    for s in samples:
        chunk.append(s)
        if len(chunk) == batch_size:
            yield emit()
            chunk = []
    if chunk:
        yield emit()


VARIANT_NAMES = {"random": "synthetic-shapes", "texture-bound": "synthetic-shapes-textured",
                 "cue-conflict": "synthetic-cue-conflict"}


@dataclass
class SyntheticShapes:
    """``n`` generated scenes; ``size`` None = each model's own input size. ``variant``: 'random'
    (texture random), 'texture-bound' (class textures) or 'cue-conflict' (labels: shape; texture label in
    ``batch.extra['texture_labels']``). Batches carry masks, parts, objects, keypoints and boxes."""

    n: int = 256
    seed: int = 0
    size: int | None = None
    variant: str = "random"
    name: str = ""

    def __post_init__(self) -> None:
        if self.variant not in VARIANT_NAMES:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANT_NAMES)}")
        self.name = self.name or VARIANT_NAMES[self.variant]

    @property
    def classes(self) -> list[str]:
        return list(SHAPES)

    @property
    def part_names(self) -> list[str]:
        """Names of the part ids 1, 2, ... (``class/part``)."""
        return list(PART_NAMES)

    def keypoint_names(self, label: int) -> tuple[str, ...]:
        return KEYPOINT_NAMES[SHAPES[label]]

    def __len__(self) -> int:
        return self.n

    def scene(self, i: int) -> Scene:
        return sample_scene(self.seed, i, self.variant)

    def sample(self, i: int, size: int | None = None) -> Sample:
        """Image ``i`` as a `Sample` at ``size`` pixels (default: the dataset's size, else 224)."""
        return to_sample(self.scene(i), size or self.size or 224, index=i)

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]:
        """Batches from image ``start`` on (or of ``indices``), drawn at ``size`` or the model's input size."""
        ids = list(range(self.n)) if indices is None else list(indices)
        size = self.size or preprocessing.input_size
        keys = ("texture_label",) if self.variant != "random" else ()
        for b in batches_of((self.sample(j, size) for j in ids[start:]), batch_size, preprocessing, keys):
            if keys:
                b.extra["texture_labels"] = b.extra.pop("texture_label")
            b.extra["class_names"] = self.classes
            yield b
