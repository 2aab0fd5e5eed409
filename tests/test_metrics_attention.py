"""Tests for vitscope.metrics.attention on planted attention patterns and slow loop references.

Expected values are derived by hand (closed forms in comments) or from explicit Python loops that do not
share code with the module under test.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

try:
    from vitscope.metrics import attention as att
except Exception:  # pragma: no cover - sibling modules of the package may not exist yet
    _path = Path(__file__).resolve().parents[1] / "src" / "vitscope" / "metrics" / "attention.py"
    _spec = importlib.util.spec_from_file_location("_vitscope_metrics_attention_standalone", _path)
    att = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = att
    _spec.loader.exec_module(att)

GRIDS = [(5, 5), (4, 6)]
PREFIXES = [0, 1, 5]


# ------------------------------------------------------------------------------------------------------------
# helpers (independent of the module under test)
# ------------------------------------------------------------------------------------------------------------


def coords(h: int, w: int) -> list[tuple[int, int]]:
    """Row-major (row, col) of every spatial token."""
    return [(r, c) for r in range(h) for c in range(w)]


def pointer_attention(h: int, w: int, target) -> torch.Tensor:
    """(S, S) float64 with row q one-hot on the key index target(r, c) -> (r', c')."""
    S = h * w
    A = torch.zeros(S, S, dtype=torch.float64)
    for q, (r, c) in enumerate(coords(h, w)):
        tr, tc = target(r, c)
        A[q, tr * w + tc] = 1.0
    return A


def random_spatial(B: int, H: int, S: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(B, H, S, S, generator=g, dtype=torch.float64), dim=-1).to(dtype)


def embed(spatial: torch.Tensor, p: int, seed: int = 0) -> torch.Tensor:
    """Put (B, H, S, S) row-stochastic spatial attention behind p prefix tokens with arbitrary prefix mass.

    Every spatial query gives a random fraction in [0.05, 0.95] of its mass to the prefix keys (split
    randomly among them); prefix queries get random rows. Rows of the result still sum to 1.
    """
    if p == 0:
        return spatial.clone()
    B, H, S, _ = spatial.shape
    g = torch.Generator().manual_seed(seed)
    dt = spatial.dtype
    out = torch.zeros(B, H, p + S, p + S, dtype=torch.float64)
    prefix_mass = 0.05 + 0.9 * torch.rand(B, H, S, 1, generator=g, dtype=torch.float64)
    split = torch.rand(B, H, S, p, generator=g, dtype=torch.float64)
    split = split / split.sum(-1, keepdim=True)
    out[:, :, p:, :p] = prefix_mass * split
    out[:, :, p:, p:] = (1 - prefix_mass) * spatial.to(torch.float64)
    out[:, :, :p, :] = torch.softmax(torch.randn(B, H, p, p + S, generator=g, dtype=torch.float64), -1)
    return out.to(dt)


def as_bh(A: torch.Tensor) -> torch.Tensor:
    """(S, S) -> (1, 1, S, S)."""
    return A[None, None]


def ref_renorm(A: torch.Tensor, p: int) -> torch.Tensor:
    sp = A[..., p:, p:].to(torch.float64)
    return sp / sp.sum(-1, keepdim=True)


def ref_distance(A: torch.Tensor, h: int, w: int) -> float:
    """Loop reference: A (S, S) spatial, already renormalised."""
    pts = coords(h, w)
    scale = max(h, w) - 1
    total = 0.0
    for q, (rq, cq) in enumerate(pts):
        for k, (rk, ck) in enumerate(pts):
            total += float(A[q, k]) * math.hypot(rq - rk, cq - ck) / scale
    return total / len(pts)


def ref_nmi(A: torch.Tensor) -> float:
    """Loop reference: A (S, S) spatial, already renormalised."""
    S = A.shape[0]
    a = A.tolist()
    pk = [sum(a[q][k] for q in range(S)) / S for k in range(S)]
    mi = 0.0
    for q in range(S):
        for k in range(S):
            if a[q][k] > 0:
                mi += (1 / S) * a[q][k] * math.log(a[q][k] / pk[k])
    hk = -sum(x * math.log(x) for x in pk if x > 0)
    hq = math.log(S)
    return 0.0 if hk * hq == 0 else mi / math.sqrt(hq * hk)


def ref_aligned_sum(A: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Loop reference: A (B, H, S, S) spatial renormalised; pastes each query's map one by one."""
    B, H = A.shape[:2]
    canvas = torch.zeros(H, 2 * h - 1, 2 * w - 1, dtype=torch.float64)
    for b in range(B):
        for q, (rq, cq) in enumerate(coords(h, w)):
            top, left = h - 1 - rq, w - 1 - cq
            canvas[:, top : top + h, left : left + w] += A[b, :, q].to(torch.float64).reshape(H, h, w)
    return canvas


# ------------------------------------------------------------------------------------------------------------
# spatial attention, CLS maps, prefix handling
# ------------------------------------------------------------------------------------------------------------


def test_spatial_attention_drops_prefix_and_renormalises():
    attn = torch.softmax(torch.randn(2, 3, 5 + 12, 5 + 12, dtype=torch.float64), dim=-1)
    out = att.spatial_attention(attn, 5)
    assert out.shape == (2, 3, 12, 12)
    torch.testing.assert_close(out, ref_renorm(attn, 5))
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3, 12, dtype=torch.float64))


def test_spatial_attention_zero_row_stays_finite():
    S, p = 4, 1
    attn = torch.zeros(1, 1, p + S, p + S)
    attn[..., :, 0] = 1.0  # every query puts all its mass on CLS
    attn[0, 0, 2, :] = torch.tensor([0.5, 0.0, 0.25, 0.25, 0.0])  # one spatial row with some mass
    out = att.spatial_attention(attn, p)
    assert torch.isfinite(out).all()
    assert out[0, 0, 0].abs().sum() == 0  # zero row stays zero
    torch.testing.assert_close(out[0, 0, 1], torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("p", PREFIXES)
def test_prefix_tokens_do_not_change_spatial_results(grid, p):
    h, w = grid
    S = h * w
    spatial = random_spatial(2, 3, S, seed=1)
    base = spatial  # p = 0
    with_prefix = embed(spatial, p, seed=2)
    torch.testing.assert_close(att.spatial_attention(with_prefix, p), att.spatial_attention(base, 0))
    torch.testing.assert_close(
        att.attention_distance(with_prefix, grid, p), att.attention_distance(base, grid, 0)
    )
    torch.testing.assert_close(att.aligned_maps(with_prefix, grid, p), att.aligned_maps(base, grid, 0))
    torch.testing.assert_close(att.attention_nmi(with_prefix, p), att.attention_nmi(base, 0))
    masks = torch.zeros(2, h, w, dtype=torch.bool)
    masks[:, 1:3, 1:4] = True
    torch.testing.assert_close(
        att.saliency_iou(with_prefix, masks, grid, p, query="mean"),
        att.saliency_iou(base, masks, grid, 0, query="mean"),
    )


@pytest.mark.parametrize("p", [1, 5])
def test_cls_attention_maps_shape_and_renormalisation(p):
    h, w = 4, 6
    S = h * w
    attn = embed(random_spatial(2, 3, S, seed=3), p, seed=4)
    # plant the CLS row: 30 % on prefix keys, the rest on a known spatial distribution
    g = torch.Generator().manual_seed(5)
    planted = torch.rand(2, 3, S, generator=g, dtype=torch.float64)
    planted = planted / planted.sum(-1, keepdim=True)
    attn[:, :, 0, :p] = 0.3 / p
    attn[:, :, 0, p:] = 0.7 * planted
    maps = att.cls_attention_maps(attn, (h, w), p)
    assert maps.shape == (2, 3, h, w)
    torch.testing.assert_close(maps.sum(dim=(-2, -1)), torch.ones(2, 3, dtype=torch.float64))
    # row-major: token (r, c) is planted index r * w + c
    torch.testing.assert_close(maps[1, 2, 3, 1], planted[1, 2, 3 * w + 1])
    torch.testing.assert_close(maps.reshape(2, 3, S), planted)


def test_cls_attention_maps_requires_cls():
    attn = random_spatial(1, 1, 6, seed=0)
    with pytest.raises(ValueError, match="CLS"):
        att.cls_attention_maps(attn, (2, 3), 0)


# ------------------------------------------------------------------------------------------------------------
# planted patterns
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("p", PREFIXES)
def test_strictly_local_heads(grid, p):
    h, w = grid
    S = h * w
    eye = torch.eye(S, dtype=torch.float64).expand(2, 3, S, S)
    attn = embed(eye, p, seed=7)
    assert torch.allclose(att.attention_distance(attn, grid, p), torch.zeros(2, 3, dtype=torch.float64))
    aaam = att.aligned_maps(attn, grid, p)
    assert aaam.shape == (3, 2 * h - 1, 2 * w - 1)
    expected = torch.zeros(3, 2 * h - 1, 2 * w - 1, dtype=torch.float64)
    expected[:, h - 1, w - 1] = 1.0
    torch.testing.assert_close(aaam, expected)
    types = att.head_types(aaam)
    assert [t["type"] for t in types] == ["strict_local"] * 3
    assert all(t["direction"] is None and t["offset"] == pytest.approx(0.0) for t in types)
    assert [t["head"] for t in types] == [0, 1, 2]
    assert types[0]["statistic"] == "mass_3x3" and types[0]["value"] == pytest.approx(1.0)
    # identity is a one-to-one map of queries to keys: NMI = 1
    torch.testing.assert_close(att.attention_nmi(attn, p), torch.ones(2, 3, dtype=torch.float64))


OFFSETS = [
    ("right", (0, 1)),
    ("left", (0, -1)),
    ("up", (-1, 0)),
    ("down", (1, 0)),
    ("down-right", (1, 1)),
    ("up-left", (-1, -1)),
]


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize(("name", "step"), OFFSETS)
def test_offset_local_heads(grid, name, step):
    h, w = grid
    dy, dx = step

    def target(r, c):
        # attend to the neighbour at (r + dy, c + dx) when it exists, otherwise to self
        if 0 <= r + dy < h and 0 <= c + dx < w:
            return r + dy, c + dx
        return r, c

    p = 1
    attn = embed(as_bh(pointer_attention(h, w, target)).expand(2, 1, -1, -1), p, seed=11)
    # by hand: (h - |dy|)(w - |dx|) of the h*w queries have the neighbour, the rest attend to themselves
    frac = (h - abs(dy)) * (w - abs(dx)) / (h * w)
    aaam = att.aligned_maps(attn, grid, p)
    expected = torch.zeros(1, 2 * h - 1, 2 * w - 1, dtype=torch.float64)
    expected[0, h - 1, w - 1] = 1 - frac
    expected[0, h - 1 + dy, w - 1 + dx] = frac
    torch.testing.assert_close(aaam, expected)

    stats = att.aam_statistics(aaam)
    assert stats["com_dy"].item() == pytest.approx(frac * dy)
    assert stats["com_dx"].item() == pytest.approx(frac * dx)
    assert stats["peak_dy"].item() == dy and stats["peak_dx"].item() == dx

    (ht,) = att.head_types(aaam)
    assert ht["type"] == "offset_local"
    assert ht["direction"] == name
    assert ht["offset"] == pytest.approx(frac * math.hypot(dy, dx))
    assert ht["statistic"] == "offset"

    # distance by hand: frac of queries look one step of length hypot(dy, dx) tokens away
    expected_distance = frac * math.hypot(dy, dx) / (max(h, w) - 1)
    torch.testing.assert_close(
        att.attention_distance(attn, grid, p), torch.full((2, 1), expected_distance, dtype=torch.float64)
    )


def test_offset_local_right_on_5x5_by_hand():
    # 20 of 25 queries attend right, the 5 in the last column attend to themselves: com = (0, 0.8)
    attn = as_bh(pointer_attention(5, 5, lambda r, c: (r, c + 1) if c < 4 else (r, c)))
    stats = att.aam_statistics(att.aligned_maps(attn, (5, 5), 0))
    assert stats["com_dy"].item() == pytest.approx(0.0)
    assert stats["com_dx"].item() == pytest.approx(0.8)
    assert stats["angle"].item() == pytest.approx(0.0)
    assert stats["var_x"].item() == pytest.approx(0.8 * 0.2)  # Bernoulli(0.8) variance


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("axis", ["horizontal", "vertical"])
def test_axial_heads(grid, axis):
    h, w = grid
    S = h * w
    A = torch.zeros(S, S, dtype=torch.float64)
    for q, (rq, cq) in enumerate(coords(h, w)):
        for k, (rk, ck) in enumerate(coords(h, w)):
            if (axis == "horizontal" and rk == rq) or (axis == "vertical" and ck == cq):
                A[q, k] = 1.0
    A = A / A.sum(-1, keepdim=True)
    attn = embed(as_bh(A).expand(1, 2, -1, -1), 1, seed=3)
    aaam = att.aligned_maps(attn, grid, 1)
    stats = att.aam_statistics(aaam)
    # the offset along the axis is the difference of two independent uniforms on {0..n-1}:
    # variance 2 * (n^2 - 1) / 12 = (n^2 - 1) / 6; none across the axis
    if axis == "horizontal":
        torch.testing.assert_close(stats["mass_row"], torch.ones(2, dtype=torch.float64))
        torch.testing.assert_close(stats["var_x"], torch.full((2,), (w * w - 1) / 6, dtype=torch.float64))
        torch.testing.assert_close(stats["var_y"], torch.zeros(2, dtype=torch.float64))
    else:
        torch.testing.assert_close(stats["mass_col"], torch.ones(2, dtype=torch.float64))
        torch.testing.assert_close(stats["var_y"], torch.full((2,), (h * h - 1) / 6, dtype=torch.float64))
        torch.testing.assert_close(stats["var_x"], torch.zeros(2, dtype=torch.float64))
    types = att.head_types(aaam)
    assert [t["type"] for t in types] == ["axial", "axial"]
    assert [t["direction"] for t in types] == [axis, axis]
    assert types[0]["statistic"] == "anisotropy"


def ref_mean_pair_distance(h: int, w: int) -> float:
    """Mean over all ordered pairs of grid points of the Euclidean distance, divided by max(h, w) - 1."""
    pts = list(itertools.product(range(h), range(w)))
    total = 0.0
    for r1, c1 in pts:
        for r2, c2 in pts:
            total += math.sqrt((r1 - r2) ** 2 + (c1 - c2) ** 2)
    return total / len(pts) ** 2 / (max(h, w) - 1)


@pytest.mark.parametrize("grid", [(5, 5), (4, 6)])
@pytest.mark.parametrize("p", [0, 1, 5])
def test_uniform_attention_is_global_with_closed_form_distance(grid, p):
    h, w = grid
    S = h * w
    attn = embed(torch.full((2, 2, S, S), 1.0 / S, dtype=torch.float64), p, seed=5)
    torch.testing.assert_close(
        att.attention_distance(attn, grid, p),
        torch.full((2, 2), ref_mean_pair_distance(h, w), dtype=torch.float64),
    )
    aaam = att.aligned_maps(attn, grid, p)
    stats = att.aam_statistics(aaam)
    torch.testing.assert_close(stats["spread_norm"], torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(stats["entropy_norm"], torch.ones(2, dtype=torch.float64))
    types = att.head_types(aaam)
    assert [t["type"] for t in types] == ["global", "global"]
    # all rows identical: no information about the query in the key
    torch.testing.assert_close(att.attention_nmi(attn, p), torch.zeros(2, 2, dtype=torch.float64))


def test_uniform_distance_on_5x5_known_value():
    # sanity of the loop reference itself: 1x2 grid, uniform: pairs (0,0),(0,1),(1,0),(1,1) -> mean 0.5
    assert ref_mean_pair_distance(1, 2) == pytest.approx(0.5)
    attn = as_bh(torch.full((2, 2), 0.5, dtype=torch.float64))
    assert att.attention_distance(attn, (1, 2), 0).item() == pytest.approx(0.5)


def test_fixed_token_distance_and_nmi():
    h, w = 4, 6
    tr, tc = 1, 4
    A = pointer_attention(h, w, lambda r, c: (tr, tc))
    attn = embed(as_bh(A).expand(2, 1, -1, -1), 1, seed=9)
    expected = sum(math.hypot(r - tr, c - tc) for r, c in coords(h, w)) / (h * w) / (max(h, w) - 1)
    torch.testing.assert_close(
        att.attention_distance(attn, (h, w), 1), torch.full((2, 1), expected, dtype=torch.float64)
    )
    torch.testing.assert_close(att.attention_nmi(attn, 1), torch.zeros(2, 1, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------------------
# NMI
# ------------------------------------------------------------------------------------------------------------


def test_nmi_identical_rows_permutation_and_mixtures():
    S = 12
    g = torch.Generator().manual_seed(0)
    row = torch.softmax(torch.randn(S, generator=g, dtype=torch.float64), -1)
    identical = row.expand(S, S)
    perm = torch.eye(S, dtype=torch.float64)[torch.randperm(S, generator=g)]
    uniform = torch.full((S, S), 1.0 / S, dtype=torch.float64)
    assert att.attention_nmi(as_bh(identical), 0).item() == pytest.approx(0.0, abs=1e-12)
    assert att.attention_nmi(as_bh(perm), 0).item() == pytest.approx(1.0)
    lams = [0.1, 0.4, 0.7, 0.95]
    vals = [att.attention_nmi(as_bh(lam * perm + (1 - lam) * uniform), 0).item() for lam in lams]
    assert all(0.0 < v < 1.0 for v in vals)
    assert vals == sorted(vals)  # more permutation, more information
    for lam, v in zip(lams, vals, strict=True):
        assert v == pytest.approx(ref_nmi(lam * perm + (1 - lam) * uniform))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nmi_random_matches_loop_reference(dtype):
    p, S = 2, 10
    attn = embed(random_spatial(2, 2, S, seed=21), p, seed=22).to(dtype)
    out = att.attention_nmi(attn, p)
    assert out.dtype == dtype and out.shape == (2, 2)
    A = ref_renorm(attn, p)
    ref = torch.tensor([[ref_nmi(A[b, hh]) for hh in range(2)] for b in range(2)], dtype=torch.float64)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=tol, atol=tol)


def test_nmi_sparse_rows_with_zeros():
    # half the queries attend to key 0, half to key 1: MI = log 2, H(k) = log 2, H(q) = log 4
    A = torch.zeros(4, 4, dtype=torch.float64)
    A[:2, 0] = 1.0
    A[2:, 1] = 1.0
    expected = math.log(2) / math.sqrt(math.log(4) * math.log(2))
    assert att.attention_nmi(as_bh(A), 0).item() == pytest.approx(expected)
    assert ref_nmi(A) == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------------------
# distance and aligned maps against loop references
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_distance_random_matches_loop_reference(dtype):
    h, w, p = 4, 6, 2
    attn = embed(random_spatial(2, 3, h * w, seed=31), p, seed=32).to(dtype)
    out = att.attention_distance(attn, (h, w), p)
    assert out.dtype == dtype and out.shape == (2, 3)
    A = ref_renorm(attn, p)
    ref = torch.tensor(
        [[ref_distance(A[b, hh], h, w) for hh in range(3)] for b in range(2)], dtype=torch.float64
    )
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=tol, atol=tol)


def test_distance_in_pixels():
    assert att.distance_in_pixels(0.5, (14, 14), 16) == pytest.approx(0.5 * 16 * 13)
    t = att.distance_in_pixels(torch.tensor([0.0, 1.0]), (4, 6), 14)
    torch.testing.assert_close(t, torch.tensor([0.0, 14.0 * 5]))
    # one right step on a 4x6 grid is one patch: 1 / 5 unit -> 14 px
    assert att.distance_in_pixels(1 / 5, (4, 6), 14) == pytest.approx(14.0)


@pytest.mark.parametrize(("grid", "p"), [((4, 5), 1), ((3, 3), 0), ((2, 6), 5)])
def test_aligned_maps_random_matches_loop_reference_over_batch(grid, p):
    h, w = grid
    B, H = 3, 2
    attn = embed(random_spatial(B, H, h * w, seed=41), p, seed=42)
    ref_sum = ref_aligned_sum(ref_renorm(attn, p), h, w)
    canvas, n_maps = att.aligned_maps(attn, grid, p, reduce="sum")
    assert isinstance(n_maps, int) and n_maps == B * h * w  # queries x images, not queries alone
    assert canvas.dtype == torch.float64
    torch.testing.assert_close(canvas, ref_sum)
    mean = att.aligned_maps(attn, grid, p)
    torch.testing.assert_close(mean, ref_sum / (B * h * w))
    torch.testing.assert_close(mean.sum(dim=(-2, -1)), torch.ones(H, dtype=torch.float64))
    # streaming: sums and counts over two chunks give the same mean
    c1, n1 = att.aligned_maps(attn[:1], grid, p, reduce="sum")
    c2, n2 = att.aligned_maps(attn[1:], grid, p, reduce="sum")
    assert n1 + n2 == n_maps
    torch.testing.assert_close((c1 + c2) / (n1 + n2), mean)


def test_aligned_maps_float32_keeps_dtype():
    attn = random_spatial(2, 2, 12, seed=3, dtype=torch.float32)
    out = att.aligned_maps(attn, (3, 4), 0)
    assert out.dtype == torch.float32
    ref = ref_aligned_sum(ref_renorm(attn, 0), 3, 4) / 24
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# AAAM statistics and head types
# ------------------------------------------------------------------------------------------------------------


def test_aam_statistics_by_hand():
    # 3x3 grid -> 5x5 canvas, centre (2, 2). Half the mass on the centre, half two cells to the right.
    canvas = torch.zeros(5, 5, dtype=torch.float64)
    canvas[2, 2] = 0.5
    canvas[2, 4] = 0.5
    s = {k: v.item() for k, v in att.aam_statistics(canvas).items()}
    assert s["com_dy"] == pytest.approx(0.0) and s["com_dx"] == pytest.approx(1.0)
    assert s["offset"] == pytest.approx(1.0) and s["angle"] == pytest.approx(0.0)
    assert s["var_x"] == pytest.approx(1.0) and s["var_y"] == pytest.approx(0.0)
    assert s["spread"] == pytest.approx(1.0)
    assert s["spread_norm"] == pytest.approx(1.0 / math.sqrt((8 + 8) / 6))
    assert s["anisotropy"] < 1e-5
    assert s["mass_center"] == pytest.approx(0.5) and s["mass_3x3"] == pytest.approx(0.5)
    assert s["mass_row"] == pytest.approx(1.0) and s["mass_col"] == pytest.approx(0.5)
    assert s["entropy"] == pytest.approx(math.log(2))
    # tie between the centre and (0, +2): broken towards the centre
    assert (s["peak_dy"], s["peak_dx"]) == (0.0, 0.0)
    assert s["peak_mass_3x3"] == pytest.approx(0.5)


def test_aam_statistics_unnormalised_and_direction_angle():
    # mass up-left of the centre, canvas not normalised (scale must not matter)
    canvas = torch.zeros(2, 7, 9, dtype=torch.float64)  # 4x5 grid
    canvas[0, 3 - 1, 4 - 1] = 3.0  # (dy, dx) = (-1, -1)
    canvas[1, 3 + 2, 4] = 7.0  # (dy, dx) = (+2, 0): straight down
    s = att.aam_statistics(canvas)
    assert s["angle"][0].item() == pytest.approx(135.0)
    assert s["angle"][1].item() == pytest.approx(-90.0)
    assert s["offset"][0].item() == pytest.approx(math.sqrt(2))
    assert s["peak_dy"].tolist() == [-1.0, 2.0] and s["peak_dx"].tolist() == [-1.0, 0.0]
    torch.testing.assert_close(s["entropy"], torch.zeros(2, dtype=torch.float64))
    types = att.head_types(canvas)
    assert [(t["type"], t["direction"]) for t in types] == [
        ("offset_local", "up-left"),
        ("offset_local", "down"),
    ]
    assert types[1]["offset"] == pytest.approx(2.0)


def test_head_types_threshold_overrides():
    attn = as_bh(pointer_attention(5, 5, lambda r, c: (r, c + 1) if c < 4 else (r, c)))
    aaam = att.aligned_maps(attn, (5, 5), 0)
    assert att.head_types(aaam)[0]["type"] == "offset_local"
    # the offset 0.8 is below a 2-token requirement: peak next to the centre -> soft_local
    strict = att.HeadTypeThresholds(offset_min=2.0)
    assert att.head_types(aaam, thresholds=strict)[0]["type"] == "soft_local"
    assert att.head_types(aaam, thresholds={"offset_min": 2.0})[0]["type"] == "soft_local"
    with pytest.raises(ValueError, match="unknown"):
        att.head_types(aaam, thresholds={"offset_minimum": 2.0})


def test_head_types_soft_local_and_distance_gate():
    # each query attends uniformly to its 5x5 neighbourhood (clipped) on a 9x9 grid: local but not strict
    h = w = 9
    S = h * w
    A = torch.zeros(S, S, dtype=torch.float64)
    for q, (rq, cq) in enumerate(coords(h, w)):
        for k, (rk, ck) in enumerate(coords(h, w)):
            if abs(rq - rk) <= 2 and abs(cq - ck) <= 2:
                A[q, k] = 1.0
    A = A / A.sum(-1, keepdim=True)
    uniform = torch.full((S, S), 1.0 / S, dtype=torch.float64)
    attn = torch.stack([A, uniform])[None]  # (1, 2, S, S)
    aaam = att.aligned_maps(attn, (h, w), 0)
    dist = att.attention_distance(attn, (h, w), 0)
    types = att.head_types(aaam, distance=dist)
    assert [t["type"] for t in types] == ["soft_local", "global"]
    assert types[1]["distance"] == pytest.approx(dist[0, 1].item())
    # a (made-up) small attention distance vetoes "global": the peak is at the centre -> soft_local
    vetoed = att.head_types(aaam, distance=torch.tensor([0.1, 0.1]))
    assert vetoed[1]["type"] == "soft_local"
    with pytest.raises(ValueError, match="distance"):
        att.head_types(aaam, distance=torch.zeros(3))


# ------------------------------------------------------------------------------------------------------------
# top-mass sets and saliency IoU
# ------------------------------------------------------------------------------------------------------------


def test_top_mass_mask_hand_examples():
    t = torch.tensor
    assert att.top_mass_mask(t([0.5, 0.3, 0.1, 0.1]), 0.6).tolist() == [True, True, False, False]
    assert att.top_mass_mask(t([0.1, 0.5, 0.1, 0.3]), 0.6).tolist() == [False, True, False, True]
    # the first token alone already holds 0.5 >= 0.5: no second token
    assert att.top_mass_mask(t([0.5, 0.25, 0.25]), 0.5).tolist() == [True, False, False]
    # ties: lower index first
    assert att.top_mass_mask(t([0.25, 0.25, 0.25, 0.25]), 0.4).tolist() == [True, True, False, False]
    # zero weights never needed, even for mass = 1
    assert att.top_mass_mask(t([0.0, 0.7, 0.3, 0.0]), 1.0).tolist() == [False, True, True, False]
    # batched, and unnormalised weights use the fraction of their own total
    batch = t([[0.5, 0.3, 0.1, 0.1], [1.0, 3.0, 0.0, 6.0]])
    assert att.top_mass_mask(batch, 0.6).tolist() == [[True, True, False, False], [False, False, False, True]]
    with pytest.raises(ValueError, match="mass"):
        att.top_mass_mask(t([1.0]), 0.0)


def cls_attention_with_rows(rows: torch.Tensor, p: int, cls_self: float = 0.37) -> torch.Tensor:
    """(B, H, T, T) whose CLS row gives cls_self to prefix keys and (1 - cls_self) * rows to spatial keys."""
    B, H, S = rows.shape
    attn = embed(random_spatial(B, H, S, seed=77), p, seed=78)
    attn[:, :, 0, :p] = cls_self / p
    attn[:, :, 0, p:] = (1 - cls_self) * rows
    return attn


def test_saliency_iou_cls_by_hand():
    h = w = 4
    S = h * w

    def idx(r, c):
        return r * w + c

    rows = torch.zeros(1, 2, S, dtype=torch.float64)
    # head 0: 0.4 at (1,1), 0.3 at (1,2), 0.2 at (2,1), 0.1 spread over the other 13 tokens
    rows[0, 0] = 0.1 / 13
    rows[0, 0, idx(1, 1)], rows[0, 0, idx(1, 2)], rows[0, 0, idx(2, 1)] = 0.4, 0.3, 0.2
    # head 1: 0.7 at (2,2), the rest spread evenly
    rows[0, 1] = 0.3 / 15
    rows[0, 1, idx(2, 2)] = 0.7
    attn = cls_attention_with_rows(rows, p=2)
    gt = torch.zeros(1, h, w, dtype=torch.bool)
    gt[0, 1, 1] = gt[0, 2, 1] = gt[0, 2, 2] = True
    # head 0 keeps {(1,1), (1,2)} (0.4 < 0.6, then 0.7): inter {(1,1)} = 1, union 4 -> 0.25
    # head 1 keeps {(2,2)}: inter 1, union 3 -> 1/3
    iou = att.saliency_iou(attn, gt, (h, w), 2, mass=0.6, query="cls")
    torch.testing.assert_close(iou, torch.tensor([[0.25, 1 / 3]], dtype=torch.float64))
    # with mass 0.9 head 0 keeps (1,1), (1,2), (2,1): inter 2, union 4 -> 0.5
    iou9 = att.saliency_iou(attn, gt, (h, w), 2, mass=0.9, query="cls")
    assert iou9[0, 0].item() == pytest.approx(0.5)


def test_saliency_iou_mean_query_by_hand():
    h, w = 2, 3
    S = h * w
    # every spatial query has the same row: mean over queries equals that row
    row = torch.tensor([0.05, 0.6, 0.05, 0.1, 0.15, 0.05], dtype=torch.float64)
    attn = embed(row.expand(1, 1, S, S).clone(), 1, seed=3)
    gt = torch.tensor([[[False, True, True], [False, True, False]]])
    # mass 0.7: keep token 1 (0.6), then token 4 (0.15): {1, 4}; gt {1, 2, 4}: IoU 2/3
    iou = att.saliency_iou(attn, gt, (h, w), 1, mass=0.7, query="mean")
    assert iou.item() == pytest.approx(2 / 3)


def test_saliency_iou_pixel_masks_are_area_downsampled():
    h = w = 4
    S = h * w
    rows = torch.full((1, 1, S), 0.02, dtype=torch.float64)
    rows[0, 0, :4] = 0.2  # top row 0.8, rest 0.24: renormalised, the top row holds 0.77 (3 tokens: 0.58)
    rows = rows / rows.sum(-1, keepdim=True)
    attn = cls_attention_with_rows(rows, p=1)
    # 8x8 pixel mask, 2x2 pixels per patch; top row of patches covered 4/4, 3/4, 2/4, 1/4
    px = torch.zeros(1, 8, 8, dtype=torch.bool)
    px[0, 0:2, 0:2] = True
    px[0, 0:2, 2:4] = True
    px[0, 1, 2] = False  # 3 of 4
    px[0, 0, 4:6] = True  # 2 of 4 -> foreground (>= 0.5)
    px[0, 0, 6] = True  # 1 of 4 -> background
    token_gt = torch.zeros(1, h, w, dtype=torch.bool)
    token_gt[0, 0, :3] = True
    # the top-mass set at 0.6 is the 4 top-row tokens; gt has 3 of them: IoU 3/4
    iou_px = att.saliency_iou(attn, px, (h, w), 1, query="cls")
    iou_tok = att.saliency_iou(attn, token_gt, (h, w), 1, query="cls")
    assert iou_tok.item() == pytest.approx(0.75)
    assert iou_px.item() == pytest.approx(0.75)
    # float pixel masks in [0, 1] work the same way
    assert att.saliency_iou(attn, px.double(), (h, w), 1).item() == pytest.approx(0.75)


def test_saliency_iou_merged_averages_heads_first():
    h, w = 4, 4
    S = h * w
    a, b = 5, 10
    rows = torch.full((1, 2, S), 0.3 / 15, dtype=torch.float64)
    rows[0, 0, a] = 0.7
    rows[0, 1, b] = 0.7
    attn = cls_attention_with_rows(rows, p=1)
    gt = torch.zeros(1, h, w, dtype=torch.bool)
    gt.view(1, -1)[0, a] = True
    per_head = att.saliency_iou(attn, gt, (h, w), 1)
    torch.testing.assert_close(per_head, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    # merged: (0.7 + 0.02) / 2 = 0.36 on a and b each, 0.02 elsewhere -> both kept at mass 0.6 -> IoU 1/2
    merged = att.saliency_iou_merged(attn, gt, (h, w), 1)
    assert merged.shape == (1,)
    assert merged.item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------------------
# errors and dtypes
# ------------------------------------------------------------------------------------------------------------


def test_input_errors():
    good = random_spatial(1, 2, 1 + 12, seed=0)
    with pytest.raises(ValueError, match="4-D"):
        att.attention_distance(good[0], (3, 4), 1)
    with pytest.raises(ValueError, match="square"):
        att.spatial_attention(good[..., :-1], 1)
    with pytest.raises(ValueError, match="T=13"):
        att.attention_distance(good, (4, 4), 1)  # 1 + 16 != 13
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        att.aligned_maps(good, (3, 4), 2)  # 2 + 12 != 13
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        att.spatial_attention(good, -1)
    with pytest.raises(ValueError, match="no spatial token"):
        att.attention_nmi(good, 13)
    with pytest.raises(ValueError, match="reduce"):
        att.aligned_maps(good, (3, 4), 1, reduce="max")
    with pytest.raises(ValueError, match="query"):
        att.saliency_iou(good, torch.zeros(1, 3, 4, dtype=torch.bool), (3, 4), 1, query="max")
    with pytest.raises(ValueError, match="batch"):
        att.saliency_iou(good, torch.zeros(2, 3, 4, dtype=torch.bool), (3, 4), 1)
    with pytest.raises(ValueError, match="odd"):
        att.aam_statistics(torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="floating"):
        att.spatial_attention(torch.zeros(1, 1, 4, 4, dtype=torch.long), 0)


def test_float32_outputs_match_float64():
    h, w, p = 3, 5, 1
    attn64 = embed(random_spatial(2, 2, h * w, seed=8), p, seed=9)
    attn32 = attn64.float()
    for fn in (
        lambda a: att.attention_distance(a, (h, w), p),
        lambda a: att.attention_nmi(a, p),
        lambda a: att.aligned_maps(a, (h, w), p),
        lambda a: att.cls_attention_maps(a, (h, w), p),
    ):
        out32, out64 = fn(attn32), fn(attn64)
        assert out32.dtype == torch.float32 and out64.dtype == torch.float64
        torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# head types on the grids of real models: the thresholds scale with the grid
# ------------------------------------------------------------------------------------------------------------


def gaussian_attention(h: int, w: int, sigma: float) -> torch.Tensor:
    """(S, S): each query attends with weight exp(-d^2 / 2 sigma^2) to the keys d tokens away, by loops."""
    pts = coords(h, w)
    A = torch.tensor([[math.exp(-((r - r2) ** 2 + (c - c2) ** 2) / (2 * sigma * sigma)) for r2, c2 in pts]
                      for r, c in pts], dtype=torch.float64)
    return A / A.sum(-1, keepdim=True)


def peak_over_background(h: int, w: int, local: float) -> torch.Tensor:
    """(S, S): each query gives ``local`` of its mass evenly to its (clipped) 3x3 neighbourhood and the rest
    evenly to every key: a local peak on a broad background, like the AAAMs of zoo-simmim's blocks 2-4."""
    pts = coords(h, w)
    S = h * w
    A = torch.full((S, S), (1 - local) / S, dtype=torch.float64)
    for q, (r, c) in enumerate(pts):
        near = [k for k, (r2, c2) in enumerate(pts) if abs(r - r2) <= 1 and abs(c - c2) <= 1]
        A[q, near] += local / len(near)
    return A


@pytest.mark.parametrize("grid", [(8, 8), (14, 14), (16, 16)])
def test_clearly_local_heads_are_not_global_on_any_grid(grid):
    h, w = grid
    S = h * w
    heads = [gaussian_attention(h, w, 1.0), gaussian_attention(h, w, 1.5), peak_over_background(h, w, 0.3),
             torch.full((S, S), 1.0 / S, dtype=torch.float64)]
    attn = torch.stack(heads)[None]
    aaam = att.aligned_maps(attn, grid, 0)
    dist = att.attention_distance(attn, grid, 0)
    types = [t["type"] for t in att.head_types(aaam, distance=dist)]
    assert types[:3] == ["strict_local", "soft_local", "soft_local"]
    assert types[3] == "global"
    # locality by hand: uniform attention's centre-3x3 mass is (3h - 2)(3w - 2) / (h w)^2, its locality 1
    assert att.uniform_mass_3x3(grid) == pytest.approx((3 * h - 2) * (3 * w - 2) / (h * w) ** 2)
    stats = att.aam_statistics(aaam)
    assert stats["locality"][3].item() == pytest.approx(1.0)
    # the peak over background keeps entropy and spread near uniform's: without the locality rule (the old
    # classifier) it was called global on every grid
    assert stats["entropy_norm"][2] > 0.85 and stats["spread_norm"][2] > 0.8
    old = att.head_types(aaam, distance=dist, thresholds={"global_max_locality": math.inf})
    assert old[2]["type"] == "global"
