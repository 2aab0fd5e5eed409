"""Generated cue-conflict stimuli a 32-px model can read: one large silhouette per image, whose *shape* is one
class, filled with the *texture* of another (`vitscope.analyses.robustness.ShapeBias`; docs/ROBUSTNESS.md).

Why. The cluttered scenes of `vitscope.data.synthetic` are 224-px compositions; at the zoo's 32 px their object is
a few pixels and no zoo model tells their classes apart, so a shape bias read on them is withheld as at chance.
These are made for small inputs: one silhouette filling most of the frame on a flat background, and textures
whose period (about 6 px at 32 px) spans one to two patches of a 4-px-patch ViT.

Classes (`CLASSES`): class k is the pair (shape `SHAPES[k]`, texture `TEXTURES[k]`), so one probe decides among
the same K = 8 labels whichever cue it reads. The shapes are geometric silhouettes drawn procedurally (nothing
shipped, no licence to track); the textures are two-colour patterns told apart by their geometry alone
(orientation, layout). Every image has the same colours (`PATTERN_COLOURS`, jittered, in either order; a black or
a white background): colour tells neither the class nor the set.

Sets (`CUES`; image ``index`` of a set is a function of ``(seed, index)`` alone; its classes are a balanced
function of the index, every other parameter is drawn from ``(seed, index)``, the same draws in every set):

- ``shape`` (shape-only): the class's silhouette in one flat colour, the mean of the two pattern colours (the
  texture averaged away, as Geirhos et al.'s silhouettes); label = the shape class.
- ``texture`` (texture-only): the class's texture inside a *neutral* outline, a union of three random ellipses
  about the centre of the silhouettes' mean area (another outline in every image: it carries no class); label =
  the texture class.
- ``both``: the two sets interleaved (class ``index % K``, shape-only where ``index // K`` is even): the clean set
  the shape-bias probes are fitted on, so they learn every class from either cue alone.
- ``conflict``: the silhouette of class A filled with the texture of class B != A (all K (K - 1) ordered pairs in
  turn); label = A, ``texture_label`` = B.

Pose and pattern jitter: centre +-0.04 of the frame, size 0.85-1 (the silhouette spans about 0.9 of the frame),
rotation +-12 degrees; texture frequency 5 cycles per image +-10 %, orientation +-8 degrees, random phase. Drawn
at any size (each model's input by default), with 2x supersampling below 64 px.

Balance: the shape-only and the texture-only sets are decoded at comparable rates by a linear probe on a fixed
random feature map (`random_feature_map`: a random 4x4 convolution, ReLU, global average; 0.89-0.93 vs 0.96-0.98
of held-out images, 256 images of each set, three seeds), both far above chance (1/8); a probe on raw pixels reads
the shapes (0.64-0.77) but hardly the textures (0.16-0.30: their phase is random, so every texture class has the
same mean image), which is why the reference is a feature map (`cue_decodability`). `benchmarks/silhouettes.py`
measures both references and every zoo model; the test is tests/test_silhouettes.py.

How they differ from Stylized-ImageNet (Geirhos et al., ICLR 2019): those are ImageNet photographs whose texture
is replaced by a painting's style (AdaIN style transfer), and their cue-conflict images pair a shape with a
natural texture by the same transfer, judged by an ImageNet classifier's 16-class decision. Here the shape is a
flat geometric silhouette, the texture a procedural pattern pasted inside it (a texture-silhouette conflict, not
a style transfer), the classes are 8 made-up ones, and the decision is a linear probe's per block, fitted on the
clean shape-only and texture-only sets. They are a controlled small-input analogue for models that never saw
ImageNet, not a replication: the paper's protocol on real checkpoints remains the ``cue-conflict`` format with
Geirhos' stimuli (`vitscope.data.formats.robustness.CueConflictFolder`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from vitscope.data.base import Batch, Sample
from vitscope.models.registry import Preprocessing

#: the K shape classes (class k's silhouette)
SHAPES: tuple[str, ...] = ("disc", "square", "triangle", "cross", "star", "ring", "crescent", "bowtie")
#: the K texture classes (class k's pattern), in the same order of classes
TEXTURES: tuple[str, ...] = ("horizontal stripes", "vertical stripes", "diagonal stripes", "antidiagonal stripes",
                             "checker", "dots", "grid", "zigzag")
#: class k's name: its shape and its texture
CLASSES: tuple[str, ...] = tuple(f"{s} / {t}" for s, t in zip(SHAPES, TEXTURES, strict=True))
#: the sets: interleaved clean (the probes' training images), shape-only, texture-only, cue-conflict
CUES: tuple[str, ...] = ("both", "shape", "texture", "conflict")
#: the dataset names of the two kinds of set (`vitscope.data.catalog`)
NAMES = {"clean": "synthetic-silhouettes", "conflict": "synthetic-silhouette-conflict"}
K = len(SHAPES)
#: the two colours of every pattern and the flat backgrounds (each colour jittered by +-0.05 per channel)
PATTERN_COLOURS = ((0.15, 0.25, 0.7), (0.95, 0.75, 0.2))
BACKGROUNDS = ((0.05, 0.05, 0.05), (0.95, 0.95, 0.95))
#: the textures' frequency (cycles per image) and the size of the silhouettes (half-width, image units)
FREQUENCY = 5.0
SCALE = 0.5


# ---------------------------------------------------------------- shapes (object frame u right, v down, [-1, 1])
def _polygon(u: np.ndarray, v: np.ndarray, pts: list[tuple[float, float]]) -> np.ndarray:
    """Inside a convex polygon (counter-clockwise or clockwise)."""
    sign = math.copysign(1.0, sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(pts, pts[1:] + pts[:1],
                                                                                     strict=True)))
    out = np.ones(u.shape, bool)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:] + pts[:1], strict=True):
        out &= sign * ((x1 - x0) * (v - y0) - (y1 - y0) * (u - x0)) >= 0
    return out


def _star(u: np.ndarray, v: np.ndarray, n: int = 5, r_out: float = 0.98, r_in: float = 0.42) -> np.ndarray:
    """Inside an ``n``-pointed star, a point up."""
    a = np.arctan2(u, -v)  # 0 = up
    seg = 2 * math.pi / n
    t = np.abs((a % seg) - seg / 2) / (seg / 2)  # 1 at a point, 0 between two
    # the edge from an inner vertex (angle seg/2 away, radius r_in) to the point (radius r_out), in polar form
    phi = (1 - t) * seg / 2
    x0, y0 = r_in * math.cos(seg / 2), r_in * math.sin(seg / 2)
    # radius of the line through (r_out, 0) and (x0, y0) at angle phi
    dx, dy = x0 - r_out, y0
    r_edge = (r_out * dy) / (dy * np.cos(phi) - dx * np.sin(phi))
    return np.hypot(u, v) <= r_edge


def shape_mask(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside class ``cls``'s silhouette at object-frame points (u, v)."""
    r = np.hypot(u, v)
    name = SHAPES[cls]
    if name == "disc":
        return r <= 0.92
    if name == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.78
    if name == "triangle":
        return _polygon(u, v, [(0.0, -0.98), (-0.98, 0.8), (0.98, 0.8)])
    if name == "cross":
        w = 0.32
        return ((np.abs(u) <= w) & (np.abs(v) <= 0.98)) | ((np.abs(v) <= w) & (np.abs(u) <= 0.98))
    if name == "star":
        return _star(u, v)
    if name == "ring":
        return (r <= 0.98) & (r >= 0.55)
    if name == "crescent":
        return (r <= 0.95) & (np.hypot(u - 0.45, v) >= 0.72)
    if name == "bowtie":  # two triangles meeting at the centre, left and right
        return (np.abs(v) <= 0.15 + 0.8 * np.abs(u)) & (np.abs(u) <= 0.95)
    raise ValueError(cls)


# ---------------------------------------------------------------- textures (image frame x right, y down, [0, 1])
def texture_pattern(cls: int, x: np.ndarray, y: np.ndarray, freq: float, theta: float, phase: tuple[float, float]
                    ) -> np.ndarray:
    """Class ``cls``'s two-colour pattern: where colour 2 is (bool), at image points (x, y); ``freq``: cycles per
    image, ``theta``: the pattern's orientation jitter (radians), ``phase``: two phases in [0, 1)."""
    name = TEXTURES[cls]
    base = {"horizontal stripes": math.pi / 2, "vertical stripes": 0.0, "diagonal stripes": math.pi / 4,
            "antidiagonal stripes": -math.pi / 4, "zigzag": math.pi / 2}.get(name, 0.0)
    c, s = math.cos(base + theta), math.sin(base + theta)
    a = (c * x + s * y) * freq + phase[0]
    b = (c * y - s * x) * freq + phase[1]
    fa, fb = a - np.floor(a), b - np.floor(b)
    if name.endswith("stripes"):
        return fa < 0.5
    if name == "checker":
        return (fa < 0.5) ^ (fb < 0.5)
    if name == "dots":
        return (fa - 0.5) ** 2 + (fb - 0.5) ** 2 < 0.33 ** 2
    if name == "grid":
        return (fa < 0.28) | (fb < 0.28)
    if name == "zigzag":  # bands along x whose offset follows a triangle wave: chevrons
        z = a + 0.5 * np.abs(2 * fb - 1)
        return z - np.floor(z) < 0.5
    raise ValueError(cls)


def blob_mask(x: np.ndarray, y: np.ndarray, ellipses: tuple[tuple[float, ...], ...]) -> np.ndarray:
    """The neutral outline: inside any of the ``ellipses`` (cx, cy, rx, ry, angle) in image units."""
    out = np.zeros(x.shape, bool)
    for cx, cy, rx, ry, ang in ellipses:
        c, s = math.cos(ang), math.sin(ang)
        dx, dy = x - cx, y - cy
        p, q = (c * dx + s * dy) / rx, (c * dy - s * dx) / ry
        out |= p * p + q * q <= 1
    return out


# ---------------------------------------------------------------- one image
@dataclass(frozen=True)
class Stimulus:
    """One image: its classes (``shape`` / ``texture``: a class, or -1 for the flat fill / the neutral outline),
    its label, its set and its drawn parameters."""

    shape: int
    texture: int
    label: int
    cue: str
    params: dict

    @property
    def kind(self) -> int:
        """0 shape-only, 1 texture-only, 2 cue-conflict."""
        return 2 if self.shape >= 0 and self.texture >= 0 else (0 if self.shape >= 0 else 1)


def classes_of(cue: str, index: int) -> tuple[int, int, int]:
    """(shape class or -1, texture class or -1, label) of image ``index`` of set ``cue``: balanced by the index."""
    k = index % K
    if cue == "shape":
        return k, -1, k
    if cue == "texture":
        return -1, k, k
    if cue == "both":
        return (k, -1, k) if (index // K) % 2 == 0 else (-1, k, k)
    if cue == "conflict":
        return k, (k + 1 + (index // K) % (K - 1)) % K, k
    raise ValueError(f"unknown cue set {cue!r}; choose {', '.join(CUES)}")


def stimulus(seed: int, index: int, cue: str) -> Stimulus:
    """Image ``index`` of set ``cue``: its classes and every random parameter, from ``(seed, index)`` alone."""
    shape, texture, label = classes_of(cue, index)
    r = np.random.default_rng([int(seed), int(index), 4242]).random(32)
    jit = 0.1 * (r[10:16] - 0.5)
    c1, c2 = (np.clip(np.asarray(c) + j, 0, 1).astype(np.float32)
              for c, j in zip(PATTERN_COLOURS, (jit[:3], jit[3:]), strict=True))
    if r[16] < 0.5:
        c1, c2 = c2, c1
    params = {
        "cx": 0.5 + 0.08 * (r[0] - 0.5), "cy": 0.5 + 0.08 * (r[1] - 0.5), "scale": SCALE * (0.85 + 0.15 * r[2]),
        "angle": math.radians(24 * (r[3] - 0.5)), "freq": FREQUENCY * (0.9 + 0.2 * r[4]),
        "theta": math.radians(16 * (r[5] - 0.5)), "phase": (float(r[6]), float(r[7])),
        "bg": np.asarray(BACKGROUNDS[int(r[8] < 0.5)], np.float32), "c1": c1, "c2": c2,
        "ellipses": tuple((0.5 + 0.2 * (r[17 + 5 * i] - 0.5), 0.5 + 0.2 * (r[18 + 5 * i] - 0.5),
                           0.24 + 0.14 * r[19 + 5 * i], 0.24 + 0.14 * r[20 + 5 * i], math.pi * r[21 + 5 * i])
                          for i in range(3)),
    }
    return Stimulus(shape, texture, label, cue, params)


def render(st: Stimulus, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(image (size, size, 3) float32 in [0, 1], object mask (size, size) bool), drawn with ``ceil(64 / size)``
    samples per pixel side below 64 px."""
    S = int(size)
    ss = math.ceil(64 / S) if S < 64 else 1
    n = S * ss
    coords = (np.arange(n, dtype=np.float32) + 0.5) / n
    x, y = np.meshgrid(coords, coords)
    p = st.params
    if st.shape >= 0:
        ca, sa = math.cos(p["angle"]), math.sin(p["angle"])
        dx, dy = (x - p["cx"]) / p["scale"], (y - p["cy"]) / p["scale"]
        inside = shape_mask(st.shape, ca * dx + sa * dy, ca * dy - sa * dx)
    else:
        inside = blob_mask(x, y, p["ellipses"])
    if st.texture >= 0:
        w = texture_pattern(st.texture, x, y, p["freq"], p["theta"], p["phase"])
        fill = np.where(w[..., None], p["c2"], p["c1"])
    else:
        fill = (p["c1"] + p["c2"]) / 2
    img = np.where(inside[..., None], fill, p["bg"]).astype(np.float32)
    if ss > 1:
        img = img.reshape(S, ss, S, ss, 3).mean(axis=(1, 3))
        inside = inside.reshape(S, ss, S, ss).mean(axis=(1, 3)) >= 0.5
    return np.ascontiguousarray(img, dtype=np.float32), inside


@dataclass
class Silhouettes:
    """``n`` generated silhouette stimuli of set ``cue`` (`CUES`); ``size`` None = each model's input size.
    Batches carry ``extra['class_names']`` and ``extra['cue']`` (per image: 0 shape-only, 1 texture-only, 2
    cue-conflict), and for the ``conflict`` set ``extra['texture_labels']``."""

    n: int = 128
    seed: int = 0
    size: int | None = None
    cue: str = "both"
    name: str = ""

    def __post_init__(self) -> None:
        if self.cue not in CUES:
            raise ValueError(f"unknown cue set {self.cue!r}; choose {', '.join(CUES)}")
        self.name = self.name or NAMES["conflict" if self.cue == "conflict" else "clean"]

    @property
    def classes(self) -> list[str]:
        return list(CLASSES)

    def __len__(self) -> int:
        return self.n

    def index_labels(self) -> list[int]:
        """The class of every id without drawing an image (a study's class-balanced selection reads it)."""
        return [classes_of(self.cue, i)[2] for i in range(self.n)]

    def stimulus(self, i: int) -> Stimulus:
        return stimulus(self.seed, i, self.cue)

    def sample(self, i: int, size: int | None = None) -> Sample:
        """Image ``i`` as a `Sample` at ``size`` pixels (default: the dataset's size, else 32)."""
        st = self.stimulus(i)
        img, mask = render(st, size or self.size or 32)
        extra: dict = {"cue": st.kind}
        if st.cue == "conflict":
            extra["texture_label"] = st.texture
        return Sample(image=img, label=st.label, mask=mask, index=i, extra=extra)

    def batches(self, batch_size: int, preprocessing: Preprocessing, start: int = 0,
                indices: list[int] | None = None) -> Iterator[Batch]:
        """Batches from image ``start`` on (or of ``indices``), drawn at ``size`` or the model's input size."""
        from vitscope.data.synthetic import batches_of

        ids = list(range(self.n)) if indices is None else list(indices)
        size = self.size or preprocessing.input_size
        keys = ("cue", "texture_label") if self.cue == "conflict" else ("cue",)
        for b in batches_of((self.sample(j, size) for j in ids[start:]), batch_size, preprocessing, keys):
            if "texture_label" in b.extra:
                b.extra["texture_labels"] = b.extra.pop("texture_label")
            b.extra["class_names"] = self.classes
            yield b


# ---------------------------------------------------------------- the balance check
def images(cue: str, n: int, seed: int = 0, size: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images (n, size, size, 3) float32, labels (n,), texture labels (n,), -1 where none) of a set."""
    ds = Silhouettes(n=n, seed=seed, size=size, cue=cue)
    out = [ds.stimulus(i) for i in range(n)]
    return (np.stack([render(st, size)[0] for st in out]), np.array([st.label for st in out]),
            np.array([st.texture for st in out]))


def random_feature_map(x: np.ndarray, channels: int = 256, seed: int = 0) -> np.ndarray:
    """The reference observer of the balance check: a fixed random 4x4 convolution (stride 2, ``channels``
    filters with weights N(0, 1/49) and biases N(0, 0.09), seeded) on the pixels minus 0.5, ReLU, averaged over
    the image: (n, H, W, 3) -> (n, channels). Neither shape- nor texture-minded by training: it has none."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    w = torch.randn(channels, 3, 4, 4, generator=g) / 7
    b = torch.randn(channels, generator=g) * 0.3
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).permute(0, 3, 1, 2) - 0.5
    return torch.relu(torch.nn.functional.conv2d(t, w, b, stride=2)).mean((2, 3)).numpy()


def probe_accuracy(features: np.ndarray, labels: np.ndarray, test_every: int = 5) -> tuple[float, int]:
    """(held-out accuracy, test images) of the default study's shape-bias probe (`fit_probe`: standardised
    features, weight decay 1e-4, 100 L-BFGS iterations) fitted on a set's features, scored on its stratified
    test split (`vitscope.metrics.semantics.stratified_test`: every ``test_every``-th image of each class)."""
    import torch

    from vitscope.metrics.semantics import fit_probe, stratified_test

    y = torch.as_tensor(labels).long()
    test = stratified_test(torch.arange(len(y)), y, test_every)
    x = torch.as_tensor(np.asarray(features, np.float32))
    fit = fit_probe(x[~test], y[~test], x[test], y[test], weight_decay=1e-4, max_iter=100, num_classes=K,
                    warn=False)
    return float(fit.accuracy), int(test.sum())


def cue_decodability(features: object, n: int = 256, seed: int = 0, size: int = 32) -> dict[str, float]:
    """How well ``features`` ((n, size, size, 3) images -> (n, D)) tell the shape classes on the shape-only set
    and the texture classes on the texture-only set (`probe_accuracy`, one probe per set): ``{'shape': ...,
    'texture': ..., 'chance': 1 / K, 'n_test': ...}``. The stimuli are balanced when the two are comparable on a
    reference observer (`random_feature_map`)."""
    out: dict[str, float] = {"chance": 1 / K}
    for cue in ("shape", "texture"):
        x, y, _ = images(cue, n, seed, size)
        out[cue], out["n_test"] = probe_accuracy(features(x), y)  # type: ignore[operator]
    return out
