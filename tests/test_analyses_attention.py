"""The streaming attention analyses (CLS maps, AAAM + head types, saliency IoU, NMI) fed by the real engine
agree with slow loop references written here (no code shared with vitscope.metrics), merge and resume
like one pass, keep bounded state, and their figures draw."""

from __future__ import annotations

import gc
import io
import math
import warnings
import weakref

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import vitscope as vs
from conftest import tiny
from vitscope.analyses import COLUMNS, get_analysis
from vitscope.capture import stream
from vitscope.data import Batch, SyntheticShapes
from vitscope.metrics import attention as A
from vitscope.report.figures import FIGURES

NEW = ["cls_attention_maps", "aligned_attention_maps", "saliency_iou", "attention_nmi"]


def _batches(vm, n=7, bs=3, seed=1, indices=None):
    return list(SyntheticShapes(n=n, seed=seed).batches(bs, vm.preprocessing, indices=indices))


def _stream(name, vm, batches, **params):
    a = get_analysis(name)(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def _attn(vm, batches, layers=None):
    layers = range(vm.depth) if layers is None else layers
    x = torch.cat([b.images for b in batches])
    feats = vs.extract(vm, x, [f"block{i}.attn" for i in layers])
    return {i: feats[f"block{i}.attn"].double() for i in layers}


def _values(df, **where):
    for k, v in where.items():
        df = df[df[k] == v]
    return df


# ------------------------------------------------------------------------------------------------------------
# slow references: explicit loops, no vitscope.metrics
# ------------------------------------------------------------------------------------------------------------


def _spatial_row(attn, b, hd, q, p):
    """Spatial query q's row over the spatial keys, renormalised (q = -1: the CLS row)."""
    row = attn[b, hd, (0 if q < 0 else p + q), p:]
    return row / row.sum()


def _ref_cls_maps(attn, grid, p):
    """(B, H, h, w): the CLS row over spatial keys, renormalised, per image and head, by loops."""
    B, H = attn.shape[:2]
    h, w = grid
    out = torch.zeros(B, H, h, w, dtype=torch.float64)
    for b in range(B):
        for hd in range(H):
            row = _spatial_row(attn, b, hd, -1, p)
            for k in range(h * w):
                out[b, hd, k // w, k % w] = row[k]
    return out


def _ref_aaam(attn, grid, p):
    """(H, 2h-1, 2w-1): each query's map placed with the query at the centre, averaged over queries x images."""
    B, H = attn.shape[:2]
    h, w = grid
    canvas = torch.zeros(H, 2 * h - 1, 2 * w - 1, dtype=torch.float64)
    for b in range(B):
        for hd in range(H):
            for q in range(h * w):
                row = _spatial_row(attn, b, hd, q, p)
                qy, qx = divmod(q, w)
                for k in range(h * w):
                    ky, kx = divmod(k, w)
                    canvas[hd, h - 1 + ky - qy, w - 1 + kx - qx] += float(row[k])
    return canvas / (B * h * w)


def _ref_distance(attn, grid, p):
    """(H,): mean over images and queries of sum_k a_qk |pos_q - pos_k| on the unit square."""
    B, H = attn.shape[:2]
    h, w = grid
    out = torch.zeros(H, dtype=torch.float64)
    for b in range(B):
        for hd in range(H):
            for q in range(h * w):
                row = _spatial_row(attn, b, hd, q, p)
                qy, qx = divmod(q, w)
                for k in range(h * w):
                    ky, kx = divmod(k, w)
                    out[hd] += float(row[k]) * math.hypot(qy - ky, qx - kx) / (max(h, w) - 1)
    return out / (B * h * w)


def _ref_distance_per_image(attn, grid, p):
    """(B, H): per image, the mean over queries of sum_k a_qk |pos_q - pos_k| on the unit square, by loops."""
    B, H = attn.shape[:2]
    h, w = grid
    out = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        for hd in range(H):
            for q in range(h * w):
                row = _spatial_row(attn, b, hd, q, p)
                qy, qx = divmod(q, w)
                out[b, hd] += sum(float(row[k]) * math.hypot(qy - k // w, qx - k % w) for k in range(h * w))
    return out / ((max(h, w) - 1) * h * w)


def _sem(values):
    """numpy's standard error of the mean (ddof 1) along axis 0, NaNs left out."""
    v = np.asarray(values, dtype=float)
    n = np.sum(~np.isnan(v), axis=0)
    return np.nanstd(v, axis=0, ddof=1) / np.sqrt(n)


def _ref_nmi(attn, p):
    """(B, H): NMI(q, k) with p(q) = 1/S, by loops over q and k."""
    B, H, T, _ = attn.shape
    S = T - p
    out = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        for hd in range(H):
            rows = [_spatial_row(attn, b, hd, q, p).tolist() for q in range(S)]
            pk = [sum(rows[q][k] for q in range(S)) / S for k in range(S)]
            mi = sum(rows[q][k] / S * math.log(rows[q][k] / pk[k])
                     for q in range(S) for k in range(S) if rows[q][k] > 0)
            hk = -sum(x * math.log(x) for x in pk if x > 0)
            out[b, hd] = mi / math.sqrt(hk * math.log(S))
    return out


def _token_masks(masks, grid):
    """(B, S) bool: a token is foreground iff at least half of its pixels are (pixel size divisible by grid)."""
    B, Hp, Wp = masks.shape
    h, w = grid
    blocks = masks.double().reshape(B, h, Hp // h, w, Wp // w).mean(dim=(2, 4))
    return (blocks >= 0.5).reshape(B, h * w)


def _ref_iou(weights, gt, mass):
    """IoU of the smallest top-weight token set holding `mass` of the weight (sorted in Python) with gt."""
    order = sorted(range(len(weights)), key=lambda i: -float(weights[i]))  # stable: ties keep index order
    total, acc, chosen = float(sum(weights)), 0.0, set()
    for i in order:
        if acc >= mass * total:
            break
        chosen.add(i)
        acc += float(weights[i])
    truth = {i for i in range(len(gt)) if gt[i]}
    union = chosen | truth
    return len(chosen & truth) / len(union) if union else math.nan


def _query_weights(attn, b, hd, query, p):
    """The query's weights over the spatial tokens: the CLS row, or the mean of the spatial rows."""
    S = attn.shape[-1] - p
    if query == "cls":
        return _spatial_row(attn, b, hd, -1, p)
    return sum(_spatial_row(attn, b, hd, q, p) for q in range(S)) / S


# ------------------------------------------------------------------------------------------------------------
# each analysis against its reference, through the real engine
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_cls_attention_maps_average_and_single_images(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=7, bs=3)
    table = _stream("cls_attention_maps", vm, batches, keep_images=2).finalize()
    attn = _attn(vm, batches)
    h, w = vm.grid_size
    df = table[table.metric == "cls_attention"]
    assert len(df) == 3 * 3 * h * w * (1 + 2)
    assert set(df.columns) >= set(COLUMNS) | {"row", "col", "image", "n_images"}
    assert (table.n_images == 7).all()
    # the two kept images as the model saw them: its input with the normalisation undone, 8 bits
    images = table[table.metric == "input_image"]
    assert images.image.tolist() == [0, 1] and images.value.isna().all()
    x = torch.cat([b.images for b in batches])[:2]
    pre = vm.preprocessing
    want = (x * torch.tensor(pre.std).view(1, 3, 1, 1) + torch.tensor(pre.mean).view(1, 3, 1, 1)) * 255
    for k, png in enumerate(images.png):
        got = torch.from_numpy(np.array(Image.open(io.BytesIO(png)).convert("RGB"))).permute(2, 0, 1).float()
        assert got.shape == want[k].shape and (got - want[k].clamp(0, 255)).abs().max() <= 0.51
    for i in range(3):
        ref = _ref_cls_maps(attn[i], vm.grid_size, vm.num_prefix_tokens)
        avg = df[(df.layer == i) & df.image.isna()].sort_values(["head", "row", "col"])
        assert avg.value.to_numpy() == pytest.approx(ref.mean(0).reshape(-1).numpy(), abs=1e-6)
        for img in (0, 1):  # the two smallest dataset indices
            one = _values(df, layer=i, image=img).sort_values(["head", "row", "col"])
            assert one.value.to_numpy() == pytest.approx(ref[img].reshape(-1).numpy(), abs=1e-6)
    assert sorted(df.image.dropna().unique().tolist()) == [0, 1]
    # each map is a distribution over the grid
    sums = df.groupby(["layer", "head", "image"], dropna=False)["value"].sum()
    assert sums.to_numpy() == pytest.approx(1.0, abs=1e-5)


def test_keep_images_is_bounded_and_keeps_the_smallest_indices_in_any_order():
    vm = tiny("vit")
    order = [9, 4, 11, 2, 7, 0, 5, 10, 3, 1, 8, 6]
    batches = _batches(vm, n=12, bs=4, indices=order)
    a = get_analysis("cls_attention_maps")(vm, keep_images=3)
    sizes = []
    for b in batches:
        with vs.Capture(vm, a.required_taps()) as cap:
            a.update(cap(b.images), b)
        st = a.state_dict()
        sizes.append((tuple(st["kept_maps"].shape), tuple(st["sums"].shape)))
    assert sizes[0][0][0] == 3 and len(set(sizes)) == 1  # state does not grow with the number of images
    assert a.kept_index.tolist() == [0, 1, 2]  # they arrive in the 2nd, 3rd and 1st batch
    df = a.finalize()
    assert df[df.metric == "input_image"].image.tolist() == [0, 1, 2]
    attn = _attn(vm, batches, [2])[2]
    ref = _ref_cls_maps(attn, vm.grid_size, vm.num_prefix_tokens)
    for img in (0, 1, 2):
        got = _values(df, layer=2, image=img).sort_values(["head", "row", "col"]).value.to_numpy()
        assert got == pytest.approx(ref[order.index(img)].reshape(-1).numpy(), abs=1e-6)
    none = get_analysis("cls_attention_maps")(vm, keep_images=0)
    stream(vm, batches, [none], progress=False)
    assert none.finalize().image.isna().all()


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_aligned_maps_and_head_types_match_loop_reference(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=5, bs=2)
    df = _stream("aligned_attention_maps", vm, batches).finalize()
    attn = _attn(vm, batches)
    h, w = vm.grid_size
    p = vm.num_prefix_tokens
    for i in range(3):
        ref = _ref_aaam(attn[i], vm.grid_size, p)
        got = _values(df, metric="aaam", layer=i).sort_values(["head", "dy", "dx"])
        assert got.dy.min() == -(h - 1) and got.dx.max() == w - 1
        assert got.value.to_numpy() == pytest.approx(ref.reshape(-1).numpy(), abs=1e-6)
        # normalised by the number of maps added (images x queries): each head's AAAM sums to 1
        assert got.groupby("head")["value"].sum().to_numpy() == pytest.approx(1.0, abs=1e-6)
        centre = _values(got, dy=0, dx=0).value.to_numpy()
        self_attn = [sum(float(_spatial_row(attn[i], b, hd, q, p)[q]) for b in range(5) for q in range(h * w))
                     / (5 * h * w) for hd in range(3)]
        assert centre == pytest.approx(self_attn, abs=1e-6)
        dist = _ref_distance(attn[i], vm.grid_size, p)
        types = _values(df, metric="head_type", layer=i).sort_values("head")
        assert types.distance.to_numpy() == pytest.approx(dist.numpy(), abs=1e-6)
        expected = A.head_types(ref, distance=dist)  # the classifier itself is tested in test_metrics_attention
        assert types.type.tolist() == [t["type"] for t in expected]
        assert (types.value == 1).all()
        stats = _values(df, metric="aam_statistic", layer=i, statistic="mass_center").sort_values("head")
        assert stats.value.to_numpy() == pytest.approx(centre, abs=1e-6)
    counts = _values(df, metric="head_type_count")
    assert sorted(counts.type) == sorted(["strict_local", "soft_local", "axial", "offset_local", "global", "mixed"])
    assert counts.value.sum() == 9
    tally = _values(df, metric="head_type").type.value_counts()
    for t, c in zip(counts.type, counts.value, strict=True):
        assert c == tally.get(t, 0)


@pytest.mark.parametrize("kind", ["vit", "beit"])
def test_attention_nmi_matches_loop_reference(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=5, bs=2)
    df = _stream("attention_nmi", vm, batches).finalize()
    attn = _attn(vm, batches)
    assert (df.metric == "nmi").all() and len(df) == 9 and (df.n_images == 5).all()
    for i in range(3):
        per_image = _ref_nmi(attn[i], vm.num_prefix_tokens)
        got = _values(df, layer=i).sort_values("head")
        assert got.value.to_numpy() == pytest.approx(per_image.mean(0).numpy(), abs=1e-6)
        assert got.stderr.to_numpy() == pytest.approx(_sem(per_image.numpy()), rel=1e-4, abs=1e-8)
        assert got.value_lo.to_numpy() == pytest.approx((got.value - 1.959964 * got.stderr).to_numpy())
        assert got.value_hi.to_numpy() == pytest.approx((got.value + 1.959964 * got.stderr).to_numpy())


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_attention_distance_stderr_matches_numpy_over_images(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=7, bs=3)
    df = _stream("attention_distance", vm, batches).finalize()
    attn = _attn(vm, batches)
    px = vm.patch_size * (max(vm.grid_size) - 1)
    for i in range(3):
        per_image = _ref_distance_per_image(attn[i], vm.grid_size, vm.num_prefix_tokens).numpy()
        for metric, scale in (("distance", 1.0), ("distance_px", px)):
            got = _values(df, metric=metric, layer=i).sort_values("head")
            assert got.value.to_numpy() == pytest.approx(per_image.mean(0) * scale, rel=1e-6)
            assert got.stderr.to_numpy() == pytest.approx(_sem(per_image) * scale, rel=1e-4)
            assert (got.value_lo < got.value).all() and (got.value < got.value_hi).all()


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_saliency_iou_matches_a_sorting_reference(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=6, bs=4)
    df = _stream("saliency_iou", vm, batches).finalize()
    attn = _attn(vm, batches)
    gt = _token_masks(torch.cat([b.masks for b in batches]), vm.grid_size)
    p, B = vm.num_prefix_tokens, 6
    assert (df.n_images == 6).all() and (df.n_skipped == 0).all()
    for i in range(3):
        merged_attn = attn[i].mean(1, keepdim=True)
        for query in ("cls", "mean"):
            per_head = []
            per_image = []
            for hd in range(3):
                ious = [_ref_iou(_query_weights(attn[i], b, hd, query, p), gt[b], 0.6) for b in range(B)]
                per_image.append(ious)
                per_head.append(sum(x for x in ious if not math.isnan(x)) / sum(not math.isnan(x) for x in ious))
            rows = _values(df, metric="iou", layer=i, query=query).sort_values("head")
            assert rows.value.to_numpy() == pytest.approx(per_head, rel=1e-6)
            assert rows.stderr.to_numpy() == pytest.approx(_sem(np.array(per_image).T), rel=1e-4, abs=1e-9)
            best = _values(df, metric="iou_best_head", layer=i, query=query)
            assert len(best) == 1 and best.value.iloc[0] == pytest.approx(max(per_head))
            assert per_head[int(best["head"].iloc[0])] == pytest.approx(max(per_head))
            merged = [_ref_iou(_query_weights(merged_attn, b, 0, query, p), gt[b], 0.6) for b in range(B)]
            got_m = _values(df, metric="iou_merged", layer=i, query=query)
            assert got_m.value.iloc[0] == pytest.approx(sum(merged) / B, rel=1e-6)
            assert got_m.stderr.iloc[0] == pytest.approx(float(_sem(merged)), rel=1e-4, abs=1e-9)
            assert got_m["head"].isna().all()


def test_saliency_counts_images_without_masks_and_never_crashes():
    vm = tiny("vit")
    batches = _batches(vm, n=9, bs=3)
    nomask = Batch(images=batches[1].images, index=batches[1].index, labels=batches[1].labels, masks=None)
    with_gap = _stream("saliency_iou", vm, [batches[0], nomask, batches[2]], queries="mean", layers=[0, -1])
    only_masked = _stream("saliency_iou", vm, [batches[0], batches[2]], queries="mean", layers=[0, -1])
    with pytest.warns(UserWarning, match="3 image"):
        df = with_gap.finalize()
    ref = only_masked.finalize()
    assert (df.n_skipped == 3).all() and (df.n_images == 6).all()
    assert set(df["query"]) == {"mean"} and set(df[df.metric != "iou_uniform"].layer) == {0, 2}
    assert df[df.metric == "iou_uniform"].layer.isna().all()  # the uniform-attention reference: no layer
    assert df.value.to_numpy() == pytest.approx(ref.value.to_numpy())
    none = _stream("saliency_iou", vm, [nomask], layers=[0])
    with pytest.warns(UserWarning, match="no foreground mask"):
        empty = none.finalize()
    assert (empty.n_images == 0).all() and empty.value.isna().all() and len(empty) > 0


def test_model_without_cls_token():
    vm = vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48, depth=2,
                       num_heads=3, class_token=False, global_pool="avg")
    assert vm.num_prefix_tokens == 0 and not vm.has_cls_token
    batches = _batches(vm, n=4, bs=2)
    analyses = [get_analysis(n)(vm) for n in NEW]
    assert analyses[0].required_taps() == []  # nothing to capture (and no fused attention switched off)
    stream(vm, batches, analyses, progress=False)
    cls_df = analyses[0].finalize()  # no rows, and the reason the study says (`empty_reason`)
    assert len(cls_df) == 0 and list(cls_df.columns[:len(COLUMNS)]) == COLUMNS
    assert "no CLS token" in analyses[0].empty_reason()
    with pytest.warns(UserWarning, match="no CLS token"):
        sal = analyses[2].finalize()
    assert set(sal["query"]) == {"mean"} and sal.value.notna().all()
    attn = _attn(vm, batches)
    aam = analyses[1].finalize()
    got = _values(aam, metric="aaam", layer=1).sort_values(["head", "dy", "dx"]).value.to_numpy()
    assert got == pytest.approx(_ref_aaam(attn[1], vm.grid_size, 0).reshape(-1).numpy(), abs=1e-6)
    nmi = analyses[3].finalize()
    got = _values(nmi, layer=0).sort_values("head").value.to_numpy()
    assert got == pytest.approx(_ref_nmi(attn[0], 0).mean(0).numpy(), abs=1e-6)


# ------------------------------------------------------------------------------------------------------------
# protocol: merge, resume, bounded state
# ------------------------------------------------------------------------------------------------------------


def _fed(name, vm, batches, **params):
    a = get_analysis(name)(vm, **params)
    for b in batches:
        with vs.Capture(vm, a.required_taps()) as cap:
            a.update(cap(b.images), b)
    return a


def _same_table(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    other = [c for c in a.columns if c not in ("value", "statistic_value", "distance", "offset")]
    pd.testing.assert_frame_equal(a[other].reset_index(drop=True), b[other].reset_index(drop=True))
    for c in ("value", "statistic_value", "distance", "offset"):
        if c in a.columns:
            assert a[c].to_numpy(dtype=float) == pytest.approx(b[c].to_numpy(dtype=float), rel=1e-6, abs=1e-9,
                                                               nan_ok=True)


@pytest.mark.parametrize("name,params", [("cls_attention_maps", {"keep_images": 3}),
                                         ("aligned_attention_maps", {}), ("saliency_iou", {}),
                                         ("attention_nmi", {}), ("attention_distance", {})])
def test_merge_of_two_parts_and_resume_equal_one_pass(name, params):
    vm = tiny("reg")
    batches = _batches(vm, n=7, bs=3)  # batches of 3, 3, 1
    whole = _fed(name, vm, batches, **params)
    first, second = _fed(name, vm, batches[2:], **params), _fed(name, vm, batches[:2], **params)
    first.merge(second)  # the later images first: kept single-image maps must not depend on the order
    part = _fed(name, vm, batches[:1], **params)
    state = part.state_dict()
    for v in state.values():  # tensors and plain Python values only
        assert isinstance(v, torch.Tensor | int | float | str | list | dict | tuple | type(None))
    resumed = get_analysis(name)(vm, **params)
    resumed.load_state_dict(state)
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    for other in (first, resumed):
        _same_table(other.finalize(), ref)
    # state has the same size after 3 and after 7 images
    shapes = {k: tuple(v.shape) for k, v in whole.state_dict().items() if isinstance(v, torch.Tensor)}
    assert shapes == {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_merge_refuses_different_settings():
    vm = tiny("vit")
    a = get_analysis("saliency_iou")(vm, mass=0.6)
    with pytest.raises(vs.VitscopeError, match="different settings"):
        a.merge(get_analysis("saliency_iou")(vm, mass=0.5))
    with pytest.raises(vs.VitscopeError, match="cannot merge"):
        a.merge(get_analysis("attention_nmi")(vm))


# ------------------------------------------------------------------------------------------------------------
# planted attention: hand-built feats, expected values derived by hand
# ------------------------------------------------------------------------------------------------------------


def _planted(h=4, w=4, B=2):
    """(B, 3, 1 + S, 1 + S) attention of a 1-prefix model; every row gives 0.25 of its mass to the CLS key.

    head 0: each spatial query attends to itself (strict local);
    head 1: uniform over the spatial keys (global);
    head 2: each query attends to its right neighbour, the last column to itself (offset local, right).
    The CLS query (row 0) attends uniformly to the 4 tokens (0, 0), (0, 1), (0, 2), (1, 0) in every head."""
    S = h * w
    spatial = torch.zeros(3, S, S, dtype=torch.float64)
    for q in range(S):
        r, c = divmod(q, w)
        spatial[0, q, q] = 1.0
        spatial[1, q, :] = 1.0 / S
        spatial[2, q, q + 1 if c < w - 1 else q] = 1.0
    attn = torch.zeros(B, 3, 1 + S, 1 + S, dtype=torch.float64)
    attn[:, :, 1:, 0] = 0.25
    attn[:, :, 1:, 1:] = 0.75 * spatial
    fg = [0, 1, 2, w]
    attn[:, :, 0, [1 + k for k in fg]] = 1.0 / len(fg)
    return attn, fg


def test_planted_attention_end_to_end():
    vm = tiny("vit")  # 4x4 grid, 1 prefix token, 3 heads
    attn, fg = _planted()
    h, w = vm.grid_size
    masks = torch.zeros(2, 32, 32, dtype=torch.bool)  # pixel masks: 8x8 pixels per token
    for k in fg:
        r, c = divmod(k, w)
        masks[:, 8 * r:8 * r + 8, 8 * c:8 * c + 8] = True
    batch = Batch(images=torch.zeros(2, 3, 32, 32), index=torch.tensor([5, 3]), masks=masks)
    feats = {"block0.attn": attn.float()}
    aligned = get_analysis("aligned_attention_maps")(vm, layers=[0])
    nmi = get_analysis("attention_nmi")(vm, layers=[0])
    cls = get_analysis("cls_attention_maps")(vm, layers=[0], keep_images=1)
    sal = get_analysis("saliency_iou")(vm, layers=[0])
    for a in (aligned, nmi, cls, sal):
        a.update(feats, batch)

    types = _values(aligned.finalize(), metric="head_type").sort_values("head")
    assert types.type.tolist() == ["strict_local", "global", "offset_local"]
    assert types.direction.tolist()[2] == "right"
    # head 2: 12 of 16 queries look one token right -> centre of mass offset 0.75 tokens
    assert types.offset.tolist()[2] == pytest.approx(0.75)
    # identity: NMI 1; uniform: 0. Right pointer: one-hot rows, so MI = H(k); keys of columns 1, 2 get 1/16 each
    # (8 keys), of column 3 2/16 (4 keys, hit from the left and by themselves): H(k) = 3.5 log 2, and
    # NMI = H(k) / sqrt(H(k) log 16) = sqrt(3.5 / 4)
    got = _values(nmi.finalize(), metric="nmi").sort_values("head").value.to_numpy()
    assert got == pytest.approx([1.0, 0.0, math.sqrt(3.5 / 4)], abs=1e-6)

    cls_df = cls.finalize()
    avg = cls_df[(cls_df["head"] == 1) & cls_df.image.isna()]
    on = avg[(avg.row * w + avg.col).isin(fg)]
    assert len(on) == 4 and on.value.to_numpy() == pytest.approx(0.25) and avg.value.sum() == pytest.approx(1.0)
    assert cls_df.image.dropna().unique().tolist() == [3]
    # CLS attends uniformly to the 4 foreground tokens: 2 hold 50% < 60%, 3 hold 75%: 3 tokens, IoU 3/4
    sal_df = sal.finalize()
    assert _values(sal_df, metric="iou", query="cls").value.to_numpy() == pytest.approx(0.75)
    assert _values(sal_df, metric="iou_merged", query="cls").value.to_numpy() == pytest.approx(0.75)


def test_rows_without_spatial_mass_fall_back_to_the_exact_computation():
    vm = tiny("vit")
    attn, _ = _planted(B=3)
    attn[1, :, 5, :] = 0.0
    attn[1, :, 5, 0] = 1.0  # image 1, query 4: all mass on the CLS key, spatial row is empty (counted as zeros)
    batch = Batch(images=torch.zeros(3, 3, 32, 32), index=torch.arange(3))
    a = get_analysis("aligned_attention_maps")(vm, layers=[0, 1])
    a.update({"block0.attn": attn, "block1.attn": _planted(B=3)[0]}, batch)  # block 1: every row has mass
    df = a.finalize()
    # by hand, head 0 (identity): 3 images x 16 maps = 48, of which 47 put mass 1 on the centre (block 0)
    centre = _values(df, metric="aaam", head=0, dy=0, dx=0).sort_values("layer").value.to_numpy()
    assert centre == pytest.approx([47 / 48, 1.0])
    # head 1 (uniform): the empty row counts as distance 0 instead of its own uniform distance, which for token
    # (1, 0) is the mean over the 16 keys of |(1, 0) - (r, c)| / 3 (unit square)
    d = _values(df, metric="head_type", head=1).sort_values("layer").distance.to_numpy()
    uniform = _ref_distance(_planted(B=1)[0], vm.grid_size, 1)[1].item()
    own = sum(math.hypot(1 - r, c) for r in range(4) for c in range(4)) / 16 / 3
    assert d == pytest.approx([uniform - own / 48, uniform])


def test_reductions_shared_between_analyses_do_not_keep_attention_alive_or_go_stale():
    from vitscope.analyses import attention as module

    vm = tiny("vit")
    batch = Batch(images=torch.zeros(2, 3, 32, 32), index=torch.arange(2))
    attn, _ = _planted(B=2)
    before = len(module._SHARED)
    first = get_analysis("attention_distance")(vm, layers=[0])
    first.update({"block0.attn": attn}, batch)  # computes and shares the row sums and image sum of attn
    uniform = torch.full_like(attn, 1.0 / attn.shape[-1])
    attn.copy_(uniform)  # in place: what was shared for attn no longer holds
    again = get_analysis("attention_distance")(vm, layers=[0])
    again.update({"block0.attn": attn}, batch)
    fresh = get_analysis("attention_distance")(vm, layers=[0])
    fresh.update({"block0.attn": uniform.clone()}, batch)
    assert again.sums.numpy() == pytest.approx(fresh.sums.numpy())
    assert not torch.allclose(first.sums, fresh.sums)
    ref = weakref.ref(attn)
    del attn
    gc.collect()
    assert ref() is None and len(module._SHARED) == before  # entries die with their tensors


# ------------------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------------------


def test_every_figure_draws_from_a_two_model_run(tmp_path):
    tables: dict[str, list[pd.DataFrame]] = {}
    for kind, label in (("vit", "A"), ("reg", "B")):
        vm = tiny(kind)
        vm.name = label
        analyses = [get_analysis(n)(vm) for n in [*NEW, "attention_distance"]]
        stream(vm, _batches(vm, n=4, bs=4), analyses, progress=False)
        for a in analyses:
            tables.setdefault(a.name, []).append(a.finalize())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pandas/matplotlib warnings from the figure code
        for name, parts in tables.items():
            path = tmp_path / f"{name}.parquet"
            pd.concat(parts, ignore_index=True).to_parquet(path, index=False)  # as the study stores them
            figs = FIGURES[name](pd.read_parquet(path))
            assert len(figs) >= 1, name
            for title, fig in figs:
                assert isinstance(title, str) and title and isinstance(fig, plt.Figure)
                plt.close(fig)
    assert FIGURES["cls_attention_maps"](tables["cls_attention_maps"][0].iloc[0:0]) == []


@pytest.mark.parametrize("seed", range(6))
def test_kept_rows_are_the_smallest_distinct_ids_in_fixed_size_buffers(seed):
    """`keep_smallest` over random batches (repeated ids, within a batch and across batches) equals a Python
    reference (the first row seen of each of the k smallest ids), once the `NO_ID` rows are dropped."""
    from vitscope.analyses.kept import NO_ID, keep_smallest, smallest_distinct, valid_rows

    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 6, (), generator=g))
    ids, rows = torch.zeros(0, dtype=torch.long), [torch.zeros(0, 2)]
    first: dict[int, torch.Tensor] = {}
    for _ in range(5):
        n = int(torch.randint(1, 7, (), generator=g))
        new = torch.randint(0, 12, (n,), generator=g)
        vals = torch.randn(n, 2, generator=g)
        pos, cand = smallest_distinct(new, k)
        assert len(cand) == min(k, n) and cand.tolist() == sorted(cand.tolist())
        ids, rows = keep_smallest(k, ids, rows, cand, [vals[pos]])
        assert len(ids) <= k
        for i, v in zip(new.tolist(), vals, strict=True):
            first.setdefault(i, v)
        want = sorted(first)[:k]
        got, (got_rows,) = valid_rows(ids, rows)
        assert got.tolist() == want and (ids[len(want):] == NO_ID).all()
        assert torch.equal(got_rows, torch.stack([first[i] for i in want]))
