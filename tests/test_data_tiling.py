"""Dense tiling: every token comes from exactly one tile, and assembling per-tile features reproduces a
known function of absolute position."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny
from vitscope.capture import dense_features, extract
from vitscope.data.tiling import assemble, cut_tiles, plan_tiles, tiling_size
from vitscope.errors import InputError

CASES = [(448, 448, 224, 16), (448, 672, 224, 16), (448, 720, 224, 16), (464, 448, 224, 16),
         (64, 104, 32, 8), (72, 64, 32, 8), (32, 32, 32, 8), (518, 700, 224, 14)]


@pytest.mark.parametrize("h,w,tile,patch", CASES)
def test_every_token_is_covered_exactly_once(h, w, tile, patch):
    plan = plan_tiles(h, w, tile, patch)
    t = tile // patch
    count = np.zeros(plan.grid, int)
    for tl in plan.tiles:
        assert 0 <= tl.y and tl.y + tile <= h and 0 <= tl.x and tl.x + tile <= w  # inside the image
        (r0, r1), (c0, c1) = tl.rows, tl.cols
        assert 0 <= r0 < r1 <= t and 0 <= c0 < c1 <= t
        # a kept token sits at the same image position as the grid cell it is written to
        assert tl.y // patch + r0 == tl.dst_y and tl.x // patch + c0 == tl.dst_x
        count[tl.dst_y:tl.dst_y + r1 - r0, tl.dst_x:tl.dst_x + c1 - c0] += 1
    assert (count == 1).all()
    full = [tl for tl in plan.tiles if tl.rows == (0, t) and tl.cols == (0, t)]
    assert len(full) == (h // tile) * (w // tile)  # the regular tiles do not overlap and are kept whole
    starts = {(tl.y, tl.x) for tl in plan.tiles}
    assert len(starts) == len(plan.tiles)


def _coordinate_image(h, w):
    """Channels: row and column index of each pixel (float64)."""
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    return torch.stack([ys, xs, torch.zeros_like(ys)])


def _fake_model(tiles, patch):
    """A 'ViT' whose token for a patch is the mean pixel coordinate of the patch: (N, t, t, 3)."""
    return F.avg_pool2d(tiles, patch).permute(0, 2, 3, 1)


@pytest.mark.parametrize("h,w,tile,patch", CASES)
def test_assembled_grid_reproduces_a_known_function_of_position(h, w, tile, patch):
    plan = plan_tiles(h, w, tile, patch)
    grid = assemble(plan, _fake_model(cut_tiles(_coordinate_image(h, w), plan), patch))
    gh, gw = plan.grid
    assert grid.shape == (gh, gw, 3)
    centre = (patch - 1) / 2  # mean of the pixel indices in a patch
    rows = torch.arange(gh, dtype=torch.float64)[:, None].expand(gh, gw) * patch + centre
    cols = torch.arange(gw, dtype=torch.float64)[None, :].expand(gh, gw) * patch + centre
    assert torch.equal(grid[..., 0], rows) and torch.equal(grid[..., 1], cols)


def test_the_edge_tile_keeps_only_the_tokens_no_regular_tile_covers():
    """48 px wide, 32 px tiles, 8 px patches: one regular tile covers tokens 0-3; the 16 px left over are
    covered by a tile at x = 16 whose first two tokens (image tokens 2, 3) are dropped."""
    h, w, tile, patch = 32, 48, 32, 8
    plan = plan_tiles(h, w, tile, patch)
    edge = [tl for tl in plan.tiles if tl.cols != (0, tile // patch)]
    assert len(edge) == 1 and edge[0].x == w - tile and edge[0].cols == (2, 4) and edge[0].dst_x == 4


def test_tiling_size_short_side_twice_the_input_long_side_a_patch_multiple():
    for h, w in [(375, 500), (500, 375), (480, 854), (224, 224), (100, 1000)]:
        th, tw = tiling_size(h, w, 224, 16)
        assert min(th, tw) == 448 and th % 16 == 0 and tw % 16 == 0
        long, short = max(h, w), min(h, w)
        assert abs(max(th, tw) - long * 448 / short) <= 8  # rounded to the nearest multiple of 16
        assert (th >= tw) == (h >= w)
    with pytest.raises(InputError):
        plan_tiles(40, 52, 32, 8)
    with pytest.raises(InputError):
        plan_tiles(24, 64, 32, 8)


def test_dense_features_of_a_tiny_vit_equal_the_features_of_each_tile():
    vm = tiny("vit")  # 32 x 32 input, patch 8
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (50, 83, 3), dtype=np.uint8)
    d = dense_features(vm, image)
    h, w = tiling_size(50, 83, 32, 8)
    assert (d.plan.height, d.plan.width) == (h, w) and d.features.shape == (h // 8, w // 8, vm.embed_dim)
    # recompute each tile with a plain forward on the same resized, normalised image
    from vitscope.data.base import Sample
    from vitscope.data.transforms import as_float, normalize, resize

    s = resize(Sample(image=image), h, w, vm.preprocessing.interpolation)
    x = normalize(torch.from_numpy(as_float(s.image)).permute(2, 0, 1)[None], vm.preprocessing)[0]
    tap = f"block{vm.depth - 1}.out"
    for tl in d.plan.tiles:
        ref = extract(vm, x[None, :, tl.y:tl.y + 32, tl.x:tl.x + 32], [tap], view="spatial")[tap][0].reshape(4, 4, -1)
        (r0, r1), (c0, c1) = tl.rows, tl.cols
        got = d.features[tl.dst_y:tl.dst_y + r1 - r0, tl.dst_x:tl.dst_x + c1 - c0]
        assert torch.allclose(got, ref[r0:r1, c0:c1], atol=1e-5)
    centres = d.token_centres()
    assert centres.shape == (h // 8, w // 8, 2)
    assert (centres[..., 0] > 0).all() and (centres[..., 0] < 83).all() and (centres[..., 1] < 50).all()
    np.testing.assert_array_equal(d.token_at(centres.reshape(-1, 2)),
                                  np.stack(np.meshgrid(np.arange(h // 8), np.arange(w // 8), indexing="ij"),
                                           -1).reshape(-1, 2))
