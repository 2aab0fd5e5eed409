"""Whole frames at any aspect ratio: ViTs on non-square inputs (position embeddings interpolated), analyses on
a rectangular token grid, chunks of images of different sizes (RaggedBatch), and the dense protocols at the
data's own resolution (DAVIS scored at the annotation's size with void as background, SPair-71k PCK in the
file's pixels with no keypoint lost to a crop)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_analyses_attention import _ref_aaam
from test_dense import _slow_f

from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import Capture, stream
from vitscope.data.base import Batch, RaggedBatch
from vitscope.data.transforms import Framing, whole_frame_size
from vitscope.errors import InputError, VitscopeError
from vitscope.metrics import attention as A
from vitscope.metrics import dense as D
from vitscope.models.registry import ModelInput, Preprocessing

# ------------------------------------------------------------------------------------------------ models


def test_a_vit_on_a_rectangular_input_equals_timm_built_with_dynamic_img_size():
    import timm

    vm = tiny("vit")  # 32 x 32 input, patch 8
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                            depth=3, num_heads=3, dynamic_img_size=True)
    ref.load_state_dict(vm.model.state_dict())
    ref.eval()
    for blk in ref.blocks:
        blk.attn.fused_attn = False
    x = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(0))
    with Capture(vm, ["block2.out", "block1.attn"]) as cap:
        got = cap(x)
        square = cap(x[..., :32, :32])
    out = {}
    ref.blocks[2].register_forward_hook(lambda m, i, o: out.__setitem__("o", o))
    with torch.no_grad():
        ref.forward_features(x)
    assert got["block2.out"].shape == (2, 1 + 5 * 8, 48) and got["block1.attn"].shape[-1] == 41
    assert torch.equal(got["block2.out"], out["o"])
    # the native size is untouched: the switch is undone after the rectangular pass, bit for bit
    assert not vm.model.dynamic_img_size and vm.model.patch_embed.strict_img_size
    with Capture(vm, ["block2.out"]) as cap:
        assert torch.equal(cap(x[..., :32, :32])["block2.out"], square["block2.out"])
    with pytest.raises(InputError, match="multiples of the patch size 8"):
        with Capture(vm, ["block0.out"]) as cap:
            cap(torch.zeros(1, 3, 36, 64))


def test_beit_refuses_other_input_sizes_in_one_sentence():
    vm = tiny("beit")
    assert not vm.preprocessing.any_size and tiny("vit").preprocessing.any_size
    with pytest.raises(InputError, match="relative position bias.*crop: center"):
        with Capture(vm, ["block0.out"]) as cap:
            cap(torch.zeros(1, 3, 32, 48))
    s = _sample(np.zeros((30, 50, 3), np.uint8))
    with pytest.raises(InputError, match="crop: center"):
        Framing("full").apply(s, vm.preprocessing)


def test_whole_frame_size_keeps_the_aspect_and_rounds_sides_down_to_the_patch():
    assert whole_frame_size(480, 854, 480, 16) == (480, 848)
    assert whole_frame_size(480, 854, 480, 14) == (476, 854)
    assert whole_frame_size(854, 480, 224, 16, side="long") == (224, 112)
    assert whole_frame_size(10, 1000, 8, 16) == (16, 800)  # at least one patch
    assert Framing("full", 480).describe() == "full frame, short side 480"
    assert Framing("center").describe(Preprocessing(input_size=224)) == "centre crop 224"
    with pytest.raises(InputError, match="crop must be one of full, center"):
        Framing("middle")


# ------------------------------------------------------------------------------------------------ grids


def _brute_distance(attn: torch.Tensor, h: int, w: int, p: int) -> np.ndarray:
    """Per image and head: mean over spatial queries of sum_k a_qk |pos_q - pos_k|, the spatial row renormalised,
    positions (row, col) / (max(h, w) - 1); a loop over queries and keys."""
    a = attn.double().numpy()
    B, H = a.shape[:2]
    out = np.zeros((B, H))
    scale = max(h, w) - 1
    for b in range(B):
        for hd in range(H):
            total = 0.0
            for q in range(h * w):
                row = a[b, hd, p + q, p:] / a[b, hd, p + q, p:].sum()
                qy, qx = divmod(q, w)
                for k in range(h * w):
                    ky, kx = divmod(k, w)
                    total += row[k] * math.hypot(qy - ky, qx - kx) / scale
            out[b, hd] = total / (h * w)
    return out


def test_attention_distance_on_a_10x16_grid_equals_a_brute_force_loop():
    g = torch.Generator().manual_seed(1)
    h, w, p = 10, 16, 1
    attn = torch.softmax(torch.randn(1, 2, p + h * w, p + h * w, generator=g) * 3, -1)
    got = A.attention_distance(attn, (h, w), p)
    assert np.allclose(got.double().numpy(), _brute_distance(attn, h, w, p), atol=1e-5)
    # the square code path on a square input is the same function: a 16 x 16 crop of keys would differ, so check
    # transposition symmetry instead: a 16 x 10 grid with the attention transposed gives the same distances
    perm = torch.arange(h * w).reshape(h, w).T.flatten()
    idx = torch.cat([torch.arange(p), p + perm])
    at = attn[:, :, idx][:, :, :, idx]
    assert torch.allclose(A.attention_distance(at, (w, h), p), got, atol=1e-6)


def _batch(x: torch.Tensor, start: int = 0) -> Batch:
    return Batch(images=x, index=torch.arange(start, start + len(x)))


def test_attention_and_fourier_analyses_run_on_a_rectangular_grid_and_refuse_a_second_grid():
    vm = tiny("vit")
    x = torch.randn(3, 3, 40, 64, generator=torch.Generator().manual_seed(2))
    names = ["attention_distance", "aligned_attention_maps", "fourier", "cls_attention_maps", "diversity"]
    analyses = [get_analysis(n)(vm) for n in names]
    stream(vm, [_batch(x)], analyses, progress=False)
    dist, aligned, fourier, cls_maps, diversity = analyses
    with Capture(vm, [f"block{i}.attn" for i in range(3)]) as cap:
        feats = cap(x)
    direct = torch.stack([A.attention_distance(feats[f"block{i}.attn"], (5, 8), 1).double() for i in range(3)], 1)
    assert torch.allclose(dist.mean(), direct.mean(0), atol=1e-6)
    px = dist.finalize()
    px = px[px.metric == "distance_px"].value.to_numpy()
    assert np.allclose(px, (direct.mean(0) * 8 * (8 - 1)).flatten().numpy(), atol=1e-4)
    assert aligned.canvas.shape[-2:] == (9, 15) and cls_maps.sums.shape[-2:] == (5, 8)
    for i in range(3):  # each query's map placed around it on the 5 x 8 grid, as the loop reference does
        ref = _ref_aaam(feats[f"block{i}.attn"].double(), (5, 8), 1)
        got = aligned.finalize()
        got = got[(got.metric == "aaam") & (got.layer == i)].sort_values(["head", "dy", "dx"])
        assert got.dy.min() == -4 and got.dx.max() == 7
        assert got.value.to_numpy() == pytest.approx(ref.reshape(-1).numpy(), abs=1e-6)
    assert diversity.hsic_tokens.shape[-1] == 40
    table = fourier.finalize()
    assert len(table[(table.metric == "delta_log_amp") & (table.layer == 0)]) == min(5 - 5 // 2, 8 - 8 // 2)
    for a in analyses:  # states round-trip with their grid
        b = type(a)(vm)
        b.load_state_dict(a.state_dict())
        assert tuple(b.grid_size) == (5, 8)
    other = get_analysis("fourier")(vm)
    stream(vm, [_batch(x)], [other], progress=False)
    with pytest.raises(VitscopeError, match="one token grid"):
        stream(vm, [_batch(x[..., :32, :32], 3)], [other], progress=False, first=1)


def test_a_ragged_chunk_runs_one_forward_per_size_and_equals_one_image_at_a_time():
    vm = tiny("vit")
    g = torch.Generator().manual_seed(3)
    imgs = [torch.randn(1, 3, 32, 48, generator=g), torch.randn(1, 3, 32, 48, generator=g),
            torch.randn(1, 3, 48, 32, generator=g)]
    parts = [_batch(torch.cat(imgs[:2]), 0), _batch(imgs[2], 2)]
    for b in parts:
        b.extra["db_index"] = torch.where(b.index > 0, b.index - 1, -1)
        b.extra["query_index"] = torch.where(b.index == 0, 0, -1)
        b.extra["gnd"] = [{"easy": [0], "hard": [], "junk": []} if i == 0 else None for i in b.index.tolist()]
    ragged = RaggedBatch(parts)
    ragged.dataset = "d"
    assert len(ragged) == 3 and ragged.index.tolist() == [0, 1, 2] and parts[1].dataset == "d"
    one = get_analysis("retrieval")(vm)
    assert stream(vm, [ragged], [one], progress=False) == 1
    singles = get_analysis("retrieval")(vm)
    for i in range(3):
        b = _batch(imgs[i], i)
        for k in ("db_index", "query_index"):
            b.extra[k] = parts[i // 2].extra[k][i % 2:i % 2 + 1]
        b.extra["gnd"] = [parts[i // 2].extra["gnd"][i % 2]]
        stream(vm, [b], [singles], progress=False)
    ta, tb = one.finalize(), singles.finalize()
    assert np.allclose(ta.value.to_numpy(float), tb.value.to_numpy(float), equal_nan=True)
    assert set(ta.input_size) == {"32x48; 48x32"}
    assert (ta.layer.dropna() == 3).any()  # the final norm's output is a layer (depth 3)


# ------------------------------------------------------------------------------------------------ DAVIS


def _sample(image: np.ndarray):
    from vitscope.data.base import Sample

    return Sample(image=image)


def _slow_jf(labels: np.ndarray, pred: np.ndarray, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The DAVIS semi-supervised scores written out: per object, the true mask is ``labels == id`` (void is
    then background), J the IoU by counting (1 for two empty masks), F the slow boundary F (distance transforms)."""
    J, Fm = np.zeros((len(pred), len(ids))), np.zeros((len(pred), len(ids)))
    for n, p in enumerate(pred):
        for k, i in enumerate(ids):
            gt, pr = labels == i, p == i
            inter, union = int(np.logical_and(gt, pr).sum()), int(np.logical_or(gt, pr).sum())
            J[n, k] = 1.0 if union == 0 else inter / union
            Fm[n, k] = _slow_f(gt, pr)
    return J, Fm


def test_j_and_f_at_full_resolution_equal_a_slow_davis_implementation_with_void_as_background():
    g = np.random.default_rng(0)
    H, W = 96, 170  # tolerance ceil(0.008 * 195) = 2 px
    yy, xx = np.mgrid[:H, :W]
    labels = np.zeros((H, W), np.int64)
    labels[(yy - 40) ** 2 + (xx - 60) ** 2 < 20 ** 2] = 1
    labels[(yy > 50) & (xx > 110)] = 2  # touches the right and bottom edges
    labels[:4] = D.VOID
    labels[:, -5:] = D.VOID  # void border over object 2
    pred = np.zeros((3, H, W), np.int64)
    pred[0] = np.where(labels == D.VOID, 2, labels)  # right except on the void: false positives there
    for n in (1, 2):
        cy, cx, r = g.uniform(30, 60), g.uniform(40, 80), g.uniform(10, 25)
        pred[n][(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = 1
        pred[n][(yy > g.integers(40, 70)) & (xx > g.integers(90, 130))] = 2
    j, f = D.jf_objects(torch.from_numpy(labels), torch.from_numpy(pred), [1, 2])
    sj, sf = _slow_jf(labels, pred, [1, 2])
    assert np.allclose(j.numpy(), sj, atol=1e-12) and np.allclose(f.numpy(), sf, atol=1e-12)
    assert j[0, 1] < 1.0  # the void pixels predicted as object 2 count against it, as in DAVIS
    # the same with other object ids, and the predictions given as indices (1 + the object's position)
    ids = np.array([0, 7, 3])
    relabel = np.where(labels == D.VOID, D.VOID, ids[np.minimum(labels, 2)])
    j2, f2 = D.jf_objects(torch.from_numpy(relabel), torch.from_numpy(pred), [7, 3], pred_index=True)
    assert torch.equal(j2, j) and torch.equal(f2, f)


def test_labels_upsampled_at_the_input_then_resized_nearest_to_the_annotation():
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(2, 3, 4 * 6, generator=g)
    got = D.tokens_to_labels(probs, (4, 6), (90, 130), (32, 48))
    up = torch.nn.functional.interpolate(probs.reshape(2, 3, 4, 6), size=(32, 48), mode="bilinear",
                                         align_corners=False)
    lo, hi = up.amin((-2, -1), keepdim=True), up.amax((-2, -1), keepdim=True)
    small = ((up - lo) / (hi - lo)).argmax(1).numpy()
    ref = np.zeros((2, 90, 130), np.int64)  # nearest at pixel centres: row i reads floor((i + 0.5) * 32 / 90)
    for i in range(90):
        for j in range(130):
            ref[:, i, j] = small[:, int((i + 0.5) * 32 / 90), int((j + 0.5) * 48 / 130)]
    assert got.shape == (2, 90, 130) and np.array_equal(got.numpy(), ref)
    # PIL's NEAREST (DINO's resize) agrees but at exact ties of the pixel-centre rule
    pil = np.stack([np.asarray(Image.fromarray(m.astype(np.uint8)).resize((130, 90), Image.NEAREST)) for m in small])
    rows = [i for i in range(90) if ((i + 0.5) * 32 / 90) % 1 == 0]
    cols = [j for j in range(130) if ((j + 0.5) * 48 / 130) % 1 == 0]
    keep = np.ones((90, 130), bool)
    keep[rows] = False
    keep[:, cols] = False
    assert np.array_equal(pil[:, keep], ref[:, keep])


def _palette(path: Path, labels: np.ndarray) -> None:
    im = Image.fromarray(labels.astype(np.uint8), mode="P")
    im.putpalette([0, 0, 0, 255, 255, 255] + [0] * (256 * 3 - 6))
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)


def _edge_video(root: Path, n: int = 3, h: int = 128, w: int = 320) -> None:
    """A wide video whose object (white on black) sits at the right edge and moves down one token per frame
    (32 file pixels: 16 at half size, the model's patch)."""
    for t in range(n):
        lab = np.zeros((h, w), np.uint8)
        lab[32 * t:32 * t + 64, w - 64:] = 1
        img = np.repeat((lab * 255)[..., None], 3, axis=2)
        p = root / "JPEGImages" / "480p" / "edge" / f"{t:05d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(p, quality=100)
        _palette(root / "Annotations" / "480p" / "edge" / f"{t:05d}.png", lab)


def _brightness_feats(batch: Batch, patch: int) -> dict[str, torch.Tensor]:
    """Features that identify the object: per token, the share of bright pixels and its complement."""
    bright = (batch.images.mean(1, keepdim=True) > 0).float()
    share = torch.nn.functional.avg_pool2d(bright, patch).flatten(1)
    tokens = torch.stack([share, 1 - share], -1)
    return {"block0.out": torch.cat([torch.zeros(len(tokens), 1, 2), tokens], 1)}


def test_propagation_keeps_an_object_at_the_frame_edge_that_a_centre_crop_loses(tmp_path):
    from vitscope.data.formats import Davis
    from vitscope.models.adapter import ModelInfo

    _edge_video(tmp_path)
    info = ModelInfo("oracle", 1, 1, 2, (4, 4), 16, 1, True)
    pre = ModelInput(input_size=64, crop_pct=1.0, patch_size=16)
    tables = {}
    for crop in ("full", "center"):
        ds = Davis(tmp_path, sequences=["edge"], crop=crop, size=64)
        a = get_analysis("propagation")(info, final_norm=False)
        for b in ds.batches(2, pre):
            if crop == "full":
                assert b.images.shape[-2:] == (64, 160) and b.extra["source_objects"][0].shape == (128, 320)
            a.update(_brightness_feats(b, 16), b)
        tables[crop] = a.finalize()
    full, center = tables["full"], tables["center"]
    j = full[(full.metric == "J") & full.video.isna() & (full.layer == 0)].value.item()
    assert j > 0.95, j
    assert full.scored_at.iloc[0] == "annotation 128x320" and full.framing.iloc[0] == "full frame, short side 64"
    assert full.frames_scored.iloc[0].startswith("1 .. n-2")
    assert "J" not in set(center.metric)  # the crop holds no object: nothing to propagate
    skipped = center[center.metric == "skipped"].set_index("reason").value.to_dict()
    assert skipped == {"no object in the first frame's annotation": 1.0}
    assert center.framing.iloc[0] == "centre crop 64"


# ------------------------------------------------------------------------------------------------ SPair


def _border_pair(root: Path) -> None:
    """One pair of 40 x 120 images; keypoint 0 sits at the left border (x = 0 in SPair's pixel indices)."""
    for name in ("s.jpg", "t.jpg"):
        p = root / "JPEGImages" / "cat" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((40, 120, 3), 128, np.uint8)).save(p)
    d = {"src_imname": "s.jpg", "trg_imname": "t.jpg", "category": "cat", "src_kps": [[0, 20], [60, 20]],
         "trg_kps": [[0, 21], [62, 20]], "src_bndbox": [0, 5, 100, 35], "trg_bndbox": [0, 5, 100, 35]}
    f = root / "PairAnnotation" / "test" / "000000-s-t:cat.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(d))


def test_pck_counts_a_keypoint_at_the_border_on_whole_images_in_the_files_pixels(tmp_path):
    from vitscope.data.formats import SPair71k
    from vitscope.models.adapter import ModelInfo

    _border_pair(tmp_path)
    info = ModelInfo("oracle", 1, 1, 4, (2, 2), 8, 1, True)
    pre = ModelInput(input_size=16, crop_pct=1.0, patch_size=8)
    g = torch.Generator().manual_seed(5)
    out = {}
    for crop in ("full", "center"):
        ds = SPair71k(tmp_path, flat=True, crop=crop)
        a = get_analysis("correspondence")(info, final_norm=False, alphas=(0.1, 0.05))
        for b in ds.batches(2, pre):
            a.update({"block0.out": torch.randn(len(b), 1 + b.images.shape[-2] * b.images.shape[-1] // 64, 4,
                                                generator=g)}, b)
            if crop == "full":
                assert b.images.shape[-2:] == (16, 48) and b.extra["source_ref_size"].tolist() == [100.0, 100.0]
                feats_full, batch_full = a, b
        out[crop] = a.finalize()
    assert out["full"].n_keypoints.iloc[0] == 2 and out["center"].n_keypoints.iloc[0] == 1  # the crop drops one
    # PCK in the file's pixels: prediction = the chosen token's centre mapped back, threshold alpha * 100
    cats = feats_full.cats["cat"]
    assert cats["keypoints"] == 2
    geo = batch_full.extra["geometry"][1]
    centres = geo.invert(np.array([[(c + 0.5) * 8, (r + 0.5) * 8] for r in range(2) for c in range(6)]))
    gt = np.array([[0.5, 21.5], [62.5, 20.5]])
    chance = D.pck_chance(gt, 100.0, centres, (0.1, 0.05))
    assert np.allclose(cats["chance"].numpy(), [chance[0.1].sum(), chance[0.05].sum()])


# ------------------------------------------------------------------------------------------------ a study


def _two_shape_davis(root: Path) -> None:
    """Two videos of different aspect ratios (a chunk of 3 frames holds frames of both)."""
    for seq, (h, w) in (("wide", (48, 80)), ("tall", (80, 48))):
        for t in range(4):
            lab = np.zeros((h, w), np.uint8)
            lab[8 + 2 * t:28 + 2 * t, 10:30] = 1
            img = np.repeat((lab * 255)[..., None], 3, axis=2)
            p = root / "JPEGImages" / "480p" / seq / f"{t:05d}.jpg"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(p, quality=100)
            _palette(root / "Annotations" / "480p" / seq / f"{t:05d}.png", lab)
    (root / "ImageSets" / "2017").mkdir(parents=True)
    (root / "ImageSets" / "2017" / "val.txt").write_text("wide\ntall\n")


WHOLE_FRAME_STUDY = """
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {{img_size: 32, patch_size: 8,
     embed_dim: 48, depth: 2, num_heads: 3}}}}
datasets:
  davis: {{name: davis2017, root: {root}, split: val, size: 32}}
analyses:
  propagation: {{}}
batch_size: 3
progress: false
"""


def test_a_study_over_whole_frames_of_two_sizes_resumes_to_identical_tables(tmp_path):
    import pandas as pd

    from vitscope.study import load_config, run_study

    _two_shape_davis(tmp_path / "davis")
    cfg = tmp_path / "study.yaml"
    cfg.write_text(WHOLE_FRAME_STUDY.format(root=tmp_path / "davis"))
    ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c1'}"]))
    table = pd.read_parquet(ref / "results" / "propagation.parquet")
    assert table.n_videos.iloc[0] == 2 and set(table.layer.dropna()) == {0, 1, 2}  # 2 blocks + the final norm
    assert set(table.input_size) == {"32x48; 48x32"} and set(table.framing) == {"full frame, short side 32"}
    best = pd.read_parquet(ref / "results" / "summary" / "best_layers.parquet")
    assert best.protocol.item().startswith("full frame, short side 32; input 32x48; 48x32; scored at annotation")
    assert "full frame, short side 32" in (ref / "report.html").read_text()

    class Killed(Exception):
        pass

    fed: list[int] = []

    def kill(model, b):
        fed.append(b)
        if len(fed) == 2:  # after chunk 1: frame 3 of the wide video and frames 0-1 of the tall one
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", "save_every=1", f"cache_dir={tmp_path / 'c2'}"]
    with pytest.raises(Killed):
        run_study(load_config(cfg, over), on_batch=kill)
    out = run_study(load_config(cfg, over))
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results" / "propagation.parquet"), table)
