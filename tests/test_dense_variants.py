"""The authors' variants of the dense tasks (Walmer et al. 2023, Tables 1 and 5): the Gaussian "random" baseline,
pixel-level keypoint matching, SPair's letterbox geometry and per-category pair selection, the authors' saliency
mask rule and k-NN beside the dense tasks in the best-layer summary. Each against a slow reference written here."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from vitscope.analyses import get_analysis
from vitscope.data.synthetic_tasks import SyntheticPairs, SyntheticRetrieval, SyntheticVideos
from vitscope.models.adapter import ModelInfo
from vitscope.models.registry import Preprocessing

SEED_BASE = 20230618  # the documented base of the per-image seeds of the random features


def info(grid: int, patch: int, depth: int = 1, dim: int = 8) -> ModelInfo:
    """A stand-in model: the analyses only need its shape (one CLS token)."""
    return ModelInfo("oracle", depth, 1, dim, (grid, grid), patch, 1, True)


def gaussian(image_id: int, tokens: int, dim: int) -> torch.Tensor:
    """The random features of one image as documented: N(0, 1) per token and channel from its own seed."""
    return torch.randn(tokens, dim, generator=torch.Generator().manual_seed(SEED_BASE + int(image_id)))


def gaussian_batch(index, tokens: int, dim: int) -> torch.Tensor:
    return torch.stack([gaussian(int(i), tokens, dim) for i in index])


# ------------------------------------------------------------------------------------------------ random baseline


def test_random_propagation_row_is_the_propagation_of_per_image_gaussian_features():
    vids = SyntheticVideos(n_videos=2, n_frames=5, seed=4, size=32, occluder=False)
    pre = Preprocessing(input_size=32)
    m = info(4, 8, dim=6)
    with_random = get_analysis("propagation")(m, final_norm=False, random_baseline=True)
    reference = get_analysis("propagation")(m, final_norm=False)
    g = torch.Generator().manual_seed(1)
    for b in vids.batches(3, pre):  # videos straddle batches
        with_random.update({"block0.out": torch.randn(len(b), 17, 6, generator=g)}, b)
        reference.update({"block0.out": gaussian_batch(b.index, 17, 6)}, b)
    df, ref = with_random.finalize(), reference.finalize()
    got = df[df.video.isna()].set_index("metric")
    want = ref[ref.video.isna()].set_index("metric")
    for k in ("J", "F", "JF"):
        assert got.loc[f"{k}_random", "value"] == pytest.approx(want.loc[k, "value"], abs=1e-9)
        assert pd.isna(got.loc[f"{k}_random", "layer"])
        assert got.loc[f"{k}_chance", "value"] == pytest.approx(want.loc[f"{k}_chance", "value"])
    assert df.variant.iloc[0].startswith("random")
    best = df[df.metric == "best_JF"].iloc[0]
    assert best.random_features == pytest.approx(want.loc["JF", "value"])
    assert "variant" not in ref.columns  # the default table keeps its columns


def test_random_propagation_does_not_depend_on_batching_or_the_model_features():
    vids = SyntheticVideos(n_videos=2, n_frames=4, seed=5, size=32, occluder=False)
    pre = Preprocessing(input_size=32)
    values = []
    for bs, seed in ((2, 0), (5, 1)):
        a = get_analysis("propagation")(info(4, 8, dim=6), final_norm=False, random_baseline=True)
        g = torch.Generator().manual_seed(seed)
        for b in vids.batches(bs, pre):
            a.update({"block0.out": torch.randn(len(b), 17, 6, generator=g)}, b)
        df = a.finalize()
        values.append(df[df.metric.str.endswith("_random")].set_index(["metric", "video"]).value.sort_index())
    pd.testing.assert_series_equal(values[0], values[1])


def _slow_pck_random(pairs: SyntheticPairs, size: int, patch: int, dim: int, alpha: float) -> float:
    """PCK of the Gaussian features by a loop over pairs and keypoints: the source keypoint's token, its nearest
    target token by cosine, that token's centre within alpha * max(box h, w) of the true target point."""
    grid = size // patch
    correct = total = 0
    batches = list(pairs.batches(2 * pairs.n_pairs, Preprocessing(input_size=size)))
    b = batches[0]
    for p in range(pairs.n_pairs):
        s, t = 2 * p, 2 * p + 1
        fs = F.normalize(gaussian(int(b.index[s]), 1 + grid * grid, dim)[1:], dim=-1)
        ft = F.normalize(gaussian(int(b.index[t]), 1 + grid * grid, dim)[1:], dim=-1)
        box = b.boxes[t].double()
        ref = float(max(box[2] - box[0], box[3] - box[1]))
        for k in range(b.keypoints.shape[1]):
            if b.keypoints[s, k, 2] <= 0 or b.keypoints[t, k, 2] <= 0:
                continue
            x, y = b.keypoints[s, k, :2].tolist()
            tok = min(int(y // patch), grid - 1) * grid + min(int(x // patch), grid - 1)
            best = int(torch.argmax(ft @ fs[tok]))
            cx, cy = (best % grid + 0.5) * patch, (best // grid + 0.5) * patch
            tx, ty = b.keypoints[t, k, :2].tolist()
            correct += float(np.hypot(cx - tx, cy - ty)) <= alpha * ref
            total += 1
    return correct / total


def test_random_correspondence_rows_equal_a_loop_over_keypoints_with_the_seeded_gaussians():
    size, patch, dim = 32, 4, 5
    pairs = SyntheticPairs(n_pairs=6, seed=3, size=size, flat=True)
    a = get_analysis("correspondence")(info(size // patch, patch, dim=dim), final_norm=False, random_baseline=True)
    g = torch.Generator().manual_seed(0)
    for b in pairs.batches(3, Preprocessing(input_size=size)):  # a pair split across batches
        a.update({"block0.out": torch.randn(len(b), 1 + (size // patch) ** 2, dim, generator=g)}, b)
    df = a.finalize()
    overall = df[df.category.isna()].set_index("metric")
    for alpha in (0.1, 0.05):
        want = _slow_pck_random(pairs, size, patch, dim, alpha)
        assert overall.loc[f"pck@{alpha:g}_random", "value"] == pytest.approx(want)
    assert overall.loc["pck@0.1_random", "interval_units"] == 6
    assert df[df.metric == "best_pck@0.1"].random_features.item() == pytest.approx(
        overall.loc["pck@0.1_random", "value"])


def _slow_map(q: torch.Tensor, d: torch.Tensor, gnd: list[dict], which: str) -> float:
    """Revisited mAP by hand: rank by cosine, drop the ignored images, AP by the trapezoid over recall steps."""
    aps = []
    for qi, gt in enumerate(gnd):
        ok = gt["easy"] + gt["hard"] if which == "medium" else gt[which]
        junk = gt["junk"] + (gt["hard"] if which == "easy" else gt["easy"] if which == "hard" else [])
        if not ok:
            continue
        sims = [(float(F.cosine_similarity(q[qi], d[j], dim=0)), j) for j in range(len(d))]
        order = [j for _, j in sorted(sims, key=lambda t: (-t[0], t[1])) if j not in junk]
        ap, found = 0.0, 0
        for r, j in enumerate(order):
            if j in ok:
                p0 = 1.0 if r == 0 else found / r
                found += 1
                ap += (p0 + found / (r + 1)) / 2 / len(ok)
        aps.append(ap)
    return float(np.mean(aps))


def test_random_retrieval_rows_equal_a_hand_ranking_of_the_seeded_gaussian_cls_tokens():
    r = SyntheticRetrieval(n_queries=4, views=3, n_distractors=5, seed=2, size=32)
    dim, tokens = 6, 17
    a = get_analysis("retrieval")(info(4, 8, dim=dim), final_norm=False, views=["cls", "gap_spatial"],
                                  random_baseline=True)
    q, d = {}, {}
    g = torch.Generator().manual_seed(0)
    for b in r.batches(5, Preprocessing(input_size=32)):
        a.update({"block0.out": torch.randn(len(b), tokens, dim, generator=g)}, b)
        for i, qi, di in zip(b.index.tolist(), b.extra["query_index"].tolist(), b.extra["db_index"].tolist(),
                             strict=True):
            (q if qi >= 0 else d)[qi if qi >= 0 else di] = gaussian(i, tokens, dim)
    df = a.finalize()
    v = df.set_index(["metric", "token_view"]).value
    Q = torch.stack([q[i] for i in sorted(q)])
    Dd = torch.stack([d[i] for i in sorted(d)])
    for which in ("easy", "medium", "hard"):
        assert v[(f"mAP_{which}_random", "cls")] == pytest.approx(_slow_map(Q[:, 0], Dd[:, 0], r.gnd, which))
        assert v[(f"mAP_{which}_random", "gap_spatial")] == pytest.approx(
            _slow_map(Q[:, 1:].mean(1), Dd[:, 1:].mean(1), r.gnd, which))


# ------------------------------------------------------------------------------------------------ pixel matching


def _slow_pixel_pck(feats: torch.Tensor, b, grid: int, patch: int, alpha: float) -> float:
    """Pixel-level matching by a loop: each image's token map upsampled bilinearly to its pixels
    (F.interpolate, align_corners=False), the source feature at the keypoint's pixel, the target pixel of highest
    cosine, its centre within alpha * max(box h, w) of the true point."""
    size = grid * patch
    up = []
    for i in range(len(feats)):
        m = F.normalize(feats[i, 1:], dim=-1).T.reshape(1, -1, grid, grid)
        up.append(F.normalize(F.interpolate(m, size=(size, size), mode="bilinear", align_corners=False)[0], dim=0))
    correct = total = 0
    for p in range(len(feats) // 2):
        s, t = 2 * p, 2 * p + 1
        box = b.boxes[t].double()
        ref = float(max(box[2] - box[0], box[3] - box[1]))
        for k in range(b.keypoints.shape[1]):
            if b.keypoints[s, k, 2] <= 0 or b.keypoints[t, k, 2] <= 0:
                continue
            x, y = b.keypoints[s, k, :2].tolist()
            src = up[s][:, min(int(y), size - 1), min(int(x), size - 1)]
            cos = torch.einsum("d,dhw->hw", src, up[t])
            best = int(torch.argmax(cos))
            cy, cx = best // size + 0.5, best % size + 0.5
            tx, ty = b.keypoints[t, k, :2].tolist()
            correct += float(np.hypot(cx - tx, cy - ty)) <= alpha * ref
            total += 1
    return correct / total


def test_pixel_matching_equals_a_loop_over_upsampled_maps_and_differs_from_token_matching():
    size, patch, dim = 32, 8, 6
    grid = size // patch
    pairs = SyntheticPairs(n_pairs=5, seed=7, size=size, flat=True)
    b = next(iter(pairs.batches(10, Preprocessing(input_size=size))))
    feats = torch.randn(10, 1 + grid * grid, dim, generator=torch.Generator().manual_seed(3))
    pixel = get_analysis("correspondence")(info(grid, patch, dim=dim), final_norm=False, matching="pixel")
    token = get_analysis("correspondence")(info(grid, patch, dim=dim), final_norm=False)
    pixel.update({"block0.out": feats}, b)
    token.update({"block0.out": feats}, b)
    dp, dt = pixel.finalize(), token.finalize()
    vp = dp[dp.category.isna()].set_index("metric").value
    vt = dt[dt.category.isna()].set_index("metric").value
    for alpha in (0.1, 0.05, 0.01):
        assert vp[f"pck@{alpha:g}"] == pytest.approx(_slow_pixel_pck(feats, b, grid, patch, alpha))
    assert vp["pck@0.01_chance"] != vt["pck@0.01_chance"]  # chance: a random pixel, not a random token centre
    assert "pixel" in dp.variant.iloc[0]
    with pytest.raises(ValueError, match="matching"):
        get_analysis("correspondence")(info(grid, patch, dim=dim), matching="pixels")


def test_pixel_matching_across_batches_keeps_the_source_at_its_keypoint_pixels():
    size, patch, dim = 32, 8, 6
    grid = size // patch
    pairs = SyntheticPairs(n_pairs=3, seed=8, size=size, flat=True)
    feats = torch.randn(6, 1 + grid * grid, dim, generator=torch.Generator().manual_seed(4))
    whole = get_analysis("correspondence")(info(grid, patch, dim=dim), final_norm=False, matching="pixel")
    split = get_analysis("correspondence")(info(grid, patch, dim=dim), final_norm=False, matching="pixel")
    pre = Preprocessing(input_size=size)
    b = next(iter(pairs.batches(6, pre)))
    whole.update({"block0.out": feats}, b)
    at = 0
    for part in pairs.batches(3, pre):  # pair 1's source ends the first batch
        split.update({"block0.out": feats[at:at + len(part)]}, part)
        at += len(part)
    pd.testing.assert_series_equal(whole.finalize().value, split.finalize().value)


# ------------------------------------------------------------------------------------------------ saliency mask rule


def test_authors_mask_rule_is_bicubic_resize_above_zero_and_matches_pils_resize():
    from PIL import Image

    from vitscope.metrics.attention import foreground_tokens

    rng = np.random.default_rng(0)
    mismatch = total = 0
    for _ in range(40):
        H, W = rng.integers(16, 60, 2)
        h, w = rng.integers(2, 8, 2)
        m = np.zeros((H, W), np.uint8)
        y0, x0 = rng.integers(0, H - 4), rng.integers(0, W - 4)
        m[y0:y0 + rng.integers(1, H - y0), x0:x0 + rng.integers(1, W - x0)] = 1
        got = foreground_tokens(torch.tensor(m)[None], (int(h), int(w)), "authors")[0].numpy() > 0
        # the rule as written here: torch's antialiased bicubic of the 0/255 mask, rounded to 8 bits, > 0
        up = F.interpolate(torch.tensor(m, dtype=torch.float32)[None, None] * 255, size=(int(h), int(w)),
                           mode="bicubic", align_corners=False, antialias=True)[0, 0]
        assert np.array_equal(got, (torch.round(up.clamp(0, 255)) > 0).numpy())
        # and the authors' own call (PIL's Image.resize, bicubic by default for 8-bit masks), up to 8-bit rounding
        pil = np.array(Image.fromarray(m * 255).resize([int(w), int(h)], Image.BICUBIC)) > 0
        mismatch += int((pil != got).sum())
        total += pil.size
        coverage = foreground_tokens(torch.tensor(m)[None], (int(h), int(w)), "coverage")[0].numpy() > 0
        assert (coverage <= got).all()  # any half-covered token has bicubic mass > 0
    assert mismatch <= 0.005 * total


def test_saliency_authors_rule_changes_the_masks_not_the_attention():
    from conftest import tiny

    vm = tiny("vit")
    a = get_analysis("saliency_iou")(vm, layers=[0], mask_rule="authors")
    c = get_analysis("saliency_iou")(vm, layers=[0])
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    masks = torch.zeros(2, 32, 32)
    masks[0, 5:14, 3:20] = 1
    masks[1, 18:31, 12:30] = 1
    from vitscope.capture.engine import extract
    from vitscope.data.base import Batch

    b = Batch(images=x, masks=masks, index=torch.arange(2))
    feats = extract(vm, x, a.required_taps())
    a.update(feats, b)
    c.update(feats, b)
    da, dc = a.finalize(), c.finalize()
    assert (da.mask_rule == "authors").all() and (dc.mask_rule == "coverage").all()
    u_a = da[da.metric == "iou_uniform"].value.iloc[0]
    u_c = dc[dc.metric == "iou_uniform"].value.iloc[0]
    assert u_a != u_c  # larger masks: another reference level
    with pytest.raises(ValueError, match="mask_rule"):
        get_analysis("saliency_iou")(vm, mask_rule="bicubic")


# ------------------------------------------------------------------------------------------------ k-NN in best layers


def _semantics_table(model: str, seed: int) -> pd.DataFrame:
    """A semantics table as the analysis writes it: k-NN top-1 per (layer, view) with its binomial stderr and the
    majority-class chance, the Gaussian-feature rows (``*_chance``, no layer) and an object view to be ignored."""
    rng = np.random.default_rng(seed)
    rows = []
    for view in ("cls", "gap_spatial", "object"):
        for k in (10, 20):
            for layer in range(3):
                v = float(rng.uniform(0.2, 0.9))
                rows.append({"metric": f"knn{k}_top1", "layer": layer, "token_view": view, "value": v,
                             "stderr": float(np.sqrt(v * (1 - v) / 200)), "chance": 0.1})
            rows.append({"metric": f"knn{k}_top1_chance", "layer": None, "token_view": view,
                         "value": float(rng.uniform(0.05, 0.15)), "stderr": 0.01, "chance": 0.1})
    rows.append({"metric": "knn20_top1", "layer": 1, "token_view": "object", "value": 0.99, "stderr": 0.01,
                 "chance": 0.1})
    df = pd.DataFrame(rows)
    df["model"] = model
    return df


def test_best_layers_has_a_knn_row_per_model_with_its_best_layer_interval_and_random_features(tmp_path):
    from statistics import NormalDist

    from test_dense import _task_tables

    from vitscope.report.figures.dense import best_layer_summary, summary_figure
    from vitscope.report.run import load_run

    a, b = _task_tables("trained", 0), _task_tables("untrained", 1)
    tables = {k: pd.concat([a[k], b[k]], ignore_index=True) for k in a}
    tables["semantics"] = pd.concat([_semantics_table("trained", 0), _semantics_table("untrained", 1)],
                                    ignore_index=True)
    arch = {"depth": 2, "heads": 1, "grid": [4, 4], "patch": 8}
    models = {"trained": {**arch, "supervision": "supervised"}, "untrained": {**arch, "supervision": "random init"}}
    s = best_layer_summary(tables, models)
    knn = s[s.task == "knn"].set_index("model")
    assert set(knn.index) == {"trained", "untrained"}
    for model in knn.index:  # the maximum over layers and image-level views of 20-NN top-1, found by a loop
        sem = tables["semantics"]
        best, where, n = -1.0, None, 0
        for r in sem[(sem.model == model) & (sem.metric == "knn20_top1")].itertuples():
            if r.token_view in ("cls", "gap_spatial") and not pd.isna(r.layer):
                n += 1
                if r.value > best:
                    best, where = r.value, (int(r.layer), r.token_view)
        row = knn.loc[model]
        assert row.score == pytest.approx(best) and (row.best_layer, row.token_view) == where
        z = NormalDist().inv_cdf(1 - 0.05 / (2 * n))
        assert row.score_lo == pytest.approx(best - z * np.sqrt(best * (1 - best) / 200))
        assert row.chance == 0.1
        rand = sem[(sem.model == model) & (sem.metric == "knn20_top1_chance") & (sem.token_view == where[1])]
        assert row.random_features_score == pytest.approx(rand.value.item())
    assert knn.loc["trained", "random_init_score"] == pytest.approx(knn.loc["untrained", "score"])
    assert len(summary_figure(s)) == 1
    run = _run_dir(tmp_path, tables, models)
    assert (load_run(run).best_layers().task == "knn").sum() == 2  # the report's run reads semantics too


def _run_dir(tmp_path, tables: dict, models: dict):
    import json

    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    for name, df in tables.items():
        df.to_parquet(run / "results" / f"{name}.parquet", index=False)
    (run / "manifest.json").write_text(json.dumps({"models": models}))
    return run


@pytest.mark.slow
def test_the_report_writes_the_knn_rows_into_best_layers_parquet_and_its_table(tmp_path):
    from test_dense import _task_tables

    from vitscope.report import write_report

    tables = _task_tables("trained", 0)
    tables["semantics"] = _semantics_table("trained", 0)
    run = _run_dir(tmp_path, tables, {"trained": {"supervision": "supervised"}})
    html = write_report(run).read_text()
    written = pd.read_parquet(run / "results" / "summary" / "best_layers.parquet")
    assert (written.task == "knn").sum() == 1 and "k-NN rows" in html and "k-NN top-1" in html


# ------------------------------------------------------------------------------------------------ SPair options


def test_spair_letterbox_maps_a_keypoint_to_the_predicted_pixel_and_token(tmp_path):
    from test_data_loaders import RED, _is, _spair, _unnormalise

    from vitscope.data.loaders import SPair71k

    _spair(tmp_path)  # pair 0: source a.jpg 60 x 80 (h x w), red marker centred on pixel (row 15, col 20)
    pre = Preprocessing(input_size=48, crop_pct=0.875)
    ds = SPair71k(tmp_path, flat=True, letterbox=True)
    b = next(ds.batches(4, pre))
    assert tuple(b.images.shape[-2:]) == (48, 48)  # square model input
    # by hand: long side 80 -> 48 (scale 0.6), 60 -> 36 rows, padded by (48 - 36) // 2 = 6 rows on top
    x, y, v = b.keypoints[0, 0].tolist()
    assert v == 1 and (x, y) == pytest.approx((20.5 * 0.6, 15.5 * 0.6 + 6))
    assert (int(y // 8), int(x // 8)) == (1, 1)  # the token it lands in (patch 8): row 15.3 // 8, col 12.3 // 8
    img = _unnormalise(b.images[0], pre).permute(1, 2, 0).numpy()
    assert _is(RED, img[int(y), int(x)])  # the marker is where the keypoint says
    assert np.allclose(img[:6], 0, atol=1e-6) and np.allclose(img[42:], 0, atol=1e-6)  # black padding
    assert b.extra["ref_size"][0].item() == pytest.approx(60 * 0.6)  # box 60 x 45 in the file, scaled
    np.testing.assert_allclose(b.extra["geometry"][0].invert(np.array([[x, y]])), [[20.5, 15.5]], atol=1e-6)
    assert b.extra["framing"].startswith("letterbox")
    # the target (b.jpg, 70 x 60): long side 70 -> 48, 60 -> round(41.1) = 41 columns (each axis scaled by its own
    # ratio, as the resize does), padded by (48 - 41) // 2 = 3 on the left
    tx, ty, _ = b.keypoints[1, 0].tolist()
    assert (tx, ty) == pytest.approx((50.5 * 41 / 60 + 3, 30.5 * 48 / 70))


def _many_pairs(root, n_cat: int, n_dog: int) -> None:
    import json

    from test_data_loaders import _spair

    _spair(root)
    folder = root / "PairAnnotation" / "test"
    for f in folder.glob("*.json"):
        f.unlink()
    for k in range(n_cat + n_dog):
        cat = "cat" if k < n_cat else "dog"
        src, trg = ("a.jpg", "b.jpg") if cat == "cat" else ("c.jpg", "d.jpg")
        d = {"src_imname": src, "trg_imname": trg, "category": cat, "src_kps": [[20, 15]], "trg_kps": [[50, 30]],
             "src_bndbox": [10, 5, 70, 50], "trg_bndbox": [5, 20, 55, 60]}
        (folder / f"{k:06d}.json").write_text(json.dumps(d))


def test_spair_pairs_per_category_is_at_most_20_per_category_and_seeded(tmp_path):
    from vitscope.data.loaders import SPair71k

    _many_pairs(tmp_path, 27, 4)
    a = SPair71k(tmp_path, pairs_per_category=20)
    again = SPair71k(tmp_path, pairs_per_category=20, pair_seed=42)
    other = SPair71k(tmp_path, pairs_per_category=20, pair_seed=0)
    files = [p["file"] for p in a.pairs]
    assert files == [p["file"] for p in again.pairs]
    assert files != [p["file"] for p in other.pairs]
    cats = pd.Series([p["category"] for p in a.pairs]).value_counts()
    assert cats["cat"] == 20 and cats["dog"] == 4  # at most 20, all of a smaller category
    # the draw by hand: the cat pairs in file order, 20 of 27 by numpy's generator seeded 42
    want = sorted(np.random.default_rng(42).choice(27, 20, replace=False).tolist())
    assert [f for f in files if int(f[:6]) < 27] == [f"{k:06d}.json" for k in want]
    assert files == sorted(files)  # kept in file order
    with pytest.raises(ValueError, match="pairs_per_category"):
        SPair71k(tmp_path, pairs_per_category=0)
