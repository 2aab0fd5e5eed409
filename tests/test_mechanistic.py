"""The mechanistic lens (attention rollout, logit lens, high-norm tokens) against slow references written here
(loops and numpy, no code shared with vitscope.metrics.mechanistic), constructed cases with expected values
derived by hand, and the accumulator protocol (merge, resume)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from test_analyses_attention import _ref_iou, _sem, _token_masks

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.metrics import mechanistic as M


def _batches(vm, n=7, bs=3, seed=1):
    return list(SyntheticShapes(n=n, seed=seed).batches(bs, vm.preprocessing))


def _stream(name, vm, batches, **params):
    a = get_analysis(name)(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def _fed(name, vm, batches, **params):
    a = get_analysis(name)(vm, **params)
    for b in batches:
        with vs.Capture(vm, a.required_taps()) as cap:
            a.update(cap(b.images), b)
    return a


def _rows(df, **where):
    for k, v in where.items():
        df = df[df[k] == v]
    return df


def _random_attention(B, H, T, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(3 * torch.randn(B, H, T, T, generator=g, dtype=torch.float64), -1) for _ in range(L)]


# ------------------------------------------------------------------------------------------------------------
# rollout: slow reference (numpy, full matrix products, one image at a time)
# ------------------------------------------------------------------------------------------------------------


def _ref_rollout(attns, fusion, ratio):
    """(B, L, T): CLS row of R_l = F_l ... F_0, matrices multiplied in full with numpy, image by image."""
    B, H, T, _ = attns[0].shape
    out = np.zeros((B, len(attns), T))
    for b in range(B):
        R = np.eye(T)
        for lay, a in enumerate(attns):
            heads = [a[b, h].numpy() for h in range(H)]
            f = {"mean": sum(heads) / H, "max": np.maximum.reduce(heads), "min": np.minimum.reduce(heads)}[fusion]
            f = f.copy()
            flat = f.reshape(-1)
            drop = [i for i in np.argsort(flat, kind="stable")[:int(ratio * T * T)] if i != 0]
            flat[drop] = 0.0
            a2 = 0.5 * f + 0.5 * np.eye(T)
            for r in range(T):
                a2[r] = a2[r] / a2[r].sum()
            R = a2 @ R
            out[b, lay] = R[0]
    return out


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.9])
def test_rollout_matches_a_loop_over_layers_on_random_attention(fusion, ratio):
    attns = _random_attention(B=3, H=4, T=7, L=4)
    got = M.attention_rollout(attns, fusion, ratio)
    assert got.shape == (3, 4, 7)
    assert got.numpy() == pytest.approx(_ref_rollout(attns, fusion, ratio), abs=1e-12)
    assert got.sum(-1).numpy() == pytest.approx(np.ones((3, 4)))  # rows of a product of row-stochastic factors


def test_identity_attention_everywhere_gives_the_residual_only_rollout():
    T = 6
    eye = torch.eye(T, dtype=torch.float64).expand(2, 3, T, T).clone()
    got = M.attention_rollout([eye] * 5, "mean", 0.0, query=2)
    assert torch.equal(got, torch.eye(T, dtype=torch.float64)[2].expand(2, 5, T))  # the token itself, exactly


def test_discard_ratio_zeroes_the_smallest_weights_but_never_the_first_tokens_own():
    fused = torch.tensor([[[0.01, 0.50, 0.49], [0.20, 0.30, 0.50], [0.05, 0.15, 0.80]]], dtype=torch.float64)
    # floor(0.45 * 9) = 4 smallest: 0.01 (entry (0, 0): kept), 0.05, 0.15, 0.20 -> zeroed
    kept = np.array([[0.01, 0.50, 0.49], [0.0, 0.30, 0.50], [0.0, 0.0, 0.80]]) * 0.5 + 0.5 * np.eye(3)
    expected = kept / kept.sum(1, keepdims=True)
    assert M.rollout_step(fused, 0.45)[0].numpy() == pytest.approx(expected, abs=1e-15)
    plain = (0.5 * fused[0].numpy() + 0.5 * np.eye(3))
    assert M.rollout_step(fused, 0.0)[0].numpy() == pytest.approx(plain / plain.sum(1, keepdims=True), abs=1e-15)
    # 1/9 of the entries rounds down to 1 discarded: the smallest is (0, 0), kept, so nothing changes
    assert torch.equal(M.rollout_step(fused, 0.12), M.rollout_step(fused, 0.0))
    with pytest.raises(ValueError, match="discard_ratio"):
        M.rollout_step(fused, 1.0)


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_rollout_analysis_maps_and_iou_match_the_references(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=6, bs=4)
    df = _stream("attention_rollout", vm, batches, head_fusion="max", discard_ratio=0.2).finalize()
    x = torch.cat([b.images for b in batches])
    feats = vs.extract(vm, x, [f"block{i}.attn" for i in range(vm.depth)])
    attns = [feats[f"block{i}.attn"].double() for i in range(vm.depth)]
    ref = _ref_rollout(attns, "max", 0.2)
    p, B = vm.num_prefix_tokens, 6
    gt = _token_masks(torch.cat([b.masks for b in batches]), vm.grid_size)
    assert (df.n_images == B).all() and (df.n_masked == B).all()
    for i in range(vm.depth):
        maps = ref[:, i, p:] / ref[:, i, p:].sum(1, keepdims=True)
        got = _rows(df, metric="rollout_map", layer=i).sort_values(["row", "col"]).value.to_numpy()
        assert got == pytest.approx(maps.mean(0), abs=1e-6)
        roll = [_ref_iou(torch.from_numpy(maps[b]), gt[b], 0.6) for b in range(B)]
        cls = [_ref_iou(attns[i][b, :, 0, p:].mean(0), gt[b], 0.6) for b in range(B)]
        for metric, vals in (("iou_rollout", roll), ("iou_cls_attention", cls),
                             ("iou_gain", [r - c for r, c in zip(roll, cls, strict=True)])):
            row = _rows(df, metric=metric, layer=i)
            assert len(row) == 1 and row.value.iloc[0] == pytest.approx(np.mean(vals), abs=1e-6)  # float32 IoU
            assert row.stderr.iloc[0] == pytest.approx(float(_sem(vals)), rel=1e-4, abs=1e-9)
    # the last block's CLS attention scored here is saliency_iou's heads-merged CLS row, exactly
    sal = _stream("saliency_iou", vm, batches, queries="cls").finalize()
    for i in range(vm.depth):
        a = _rows(sal, metric="iou_merged", layer=i).value.iloc[0]
        assert _rows(df, metric="iou_cls_attention", layer=i).value.iloc[0] == pytest.approx(a, abs=1e-12)
    # the uniform-attention reference: saliency_iou's on the same masks (itself checked against scipy's
    # hypergeometric law in test_report_noise), one row without a layer, drawn dashed in the figure
    u = _rows(df, metric="iou_uniform")
    assert len(u) == 1 and pd.isna(u.layer.iloc[0])
    assert u.value.iloc[0] == pytest.approx(_rows(sal, metric="iou_uniform").value.iloc[0], abs=1e-12)
    from vitscope.report.figures import FIGURES
    from vitscope.report.figures._common import UNIFORM_GID

    caption, fig = FIGURES["attention_rollout"](df)[0]
    lines = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == UNIFORM_GID]
    assert len(lines) == 1 and lines[0].get_ydata()[0] == pytest.approx(u.value.iloc[0])
    assert "uniform attention" in caption


@pytest.mark.parametrize("name,params,changed", [
    ("attention_rollout", {"layers": [0, 2], "discard_ratio": 0.1}, {"discard_ratio": 0.0}),
    ("gradient_rollout", {"layers": [0, 2]}, {"mass": 0.5})])
def test_merge_of_two_parts_and_resume_equal_one_pass(name, params, changed):
    vm = tiny("reg")
    batches = _batches(vm, n=7, bs=3)
    whole = _fed(name, vm, batches, **params)
    first, second = _fed(name, vm, batches[2:], **params), _fed(name, vm, batches[:2], **params)
    first.merge(second)
    part = _fed(name, vm, batches[:1], **params)
    resumed = get_analysis(name)(vm, **params)
    resumed.load_state_dict(part.state_dict())
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    for other in (first, resumed):
        got = other.finalize()
        assert list(got.columns) == list(ref.columns) and len(got) == len(ref)
        assert got.value.to_numpy(dtype=float) == pytest.approx(ref.value.to_numpy(dtype=float), rel=1e-9,
                                                               abs=1e-12, nan_ok=True)
    with pytest.raises(vs.VitscopeError, match="different settings"):
        whole.merge(get_analysis(name)(vm, **{**params, **changed}))


def test_rollout_refuses_bad_parameters_in_one_sentence():
    from vitscope.analyses.base import validate_params

    # before any model loads: the config's values against the choices the signature lists
    with pytest.raises(vs.ConfigError, match="'head_fusion' of analysis 'attention_rollout' must be one of 'mean'"):
        validate_params(get_analysis("attention_rollout"), {"head_fusion": "median"})
    with pytest.raises(vs.ConfigError, match="'readout' of analysis 'logit_lens' must be one of 'auto', 'head'"):
        validate_params(get_analysis("logit_lens"), {"readout": "heads"})
    validate_params(get_analysis("attention_rollout"), {"head_fusion": "max", "discard_ratio": 0.9})
    vm = tiny("vit")
    with pytest.raises(vs.VitscopeError, match="head_fusion"):
        get_analysis("attention_rollout")(vm, head_fusion="median")
    with pytest.raises(vs.VitscopeError, match="discard_ratio"):
        get_analysis("attention_rollout")(vm, discard_ratio=1.0)


def test_rollout_of_a_model_without_cls_token_reads_the_mean_of_its_patch_tokens():
    """No CLS row to roll out: the query is the model's own readout, the mean of the patch tokens (the rows are
    checked against whole products in tests/test_pool_taps.py); no CLS metric is reported."""
    vm = vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48, depth=2,
                       num_heads=3, class_token=False, global_pool="avg")
    a = get_analysis("attention_rollout")(vm)
    assert a.required_taps() == ["block0.attn", "block1.attn"]
    stream(vm, _batches(vm, n=2, bs=2), [a], progress=False)
    df = a.finalize()
    assert set(df["query"]) == {"mean of patch tokens"} and "iou_cls_attention" not in set(df.metric)


# ------------------------------------------------------------------------------------------------------------
# logit lens: the head applied by hand (layer norm and a matrix product), KL and agreement with numpy
# ------------------------------------------------------------------------------------------------------------


def _labelled(batches, classes):
    """The batches with labels folded into ``classes`` classes (the synthetic set has 12)."""
    return [vs.data.Batch(images=b.images, index=b.index, labels=b.labels % classes, masks=b.masks) for b in batches]


def _ref_head(vm, out):
    """Logits of a block output read as the model reads its last one, written out: layer norm, CLS, linear."""
    m = vm.model
    x = torch.nn.functional.layer_norm(out.double(), m.norm.normalized_shape, m.norm.weight.double(),
                                       m.norm.bias.double(), m.norm.eps)[:, 0]
    return (x @ m.head.weight.double().T + m.head.bias.double()).detach()


def _np_kl(p_logits, q_logits):
    """KL(softmax(q) || softmax(p)) per row, numpy."""
    def logsm(z):
        z = z - z.max(1, keepdims=True)
        return z - np.log(np.exp(z).sum(1, keepdims=True))
    lp, lq = logsm(np.asarray(p_logits)), logsm(np.asarray(q_logits))
    return (np.exp(lq) * (lq - lp)).sum(1)


def test_logit_lens_with_a_head_matches_the_head_applied_by_hand_and_is_the_model_at_the_last_block():
    from vitscope.metrics.robustness import CIFAR10_CLASSES

    vm = tiny("vit", num_classes=10)
    batches = _labelled(_batches(vm, n=10, bs=4), 10)
    a = get_analysis("logit_lens")(vm, head_classes="cifar10")
    a.configure({"data": list(CIFAR10_CLASSES)})
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    x = torch.cat([b.images for b in batches])
    y = torch.cat([b.labels for b in batches]).numpy()
    feats = vs.extract(vm, x, [f"block{i}.out" for i in range(vm.depth)] + ["logits"])
    final = feats["logits"].double().numpy()
    assert set(df.readout) == {"head"} and (df.n_images == 10).all()
    for i in range(vm.depth):
        lg = _ref_head(vm, feats[f"block{i}.out"]).numpy()
        kl = _np_kl(lg, final)
        got = _rows(df, metric="kl_to_final", layer=i)
        assert got.value.iloc[0] == pytest.approx(kl.mean(), rel=1e-4, abs=1e-6)
        assert got.stderr.iloc[0] == pytest.approx(kl.std(ddof=1) / np.sqrt(10), rel=1e-3, abs=1e-6)
        agree = _rows(df, metric="agreement_with_final", layer=i)
        assert agree.value.iloc[0] == pytest.approx(np.mean(lg.argmax(1) == final.argmax(1)))
        acc = _rows(df, metric="top1_accuracy", layer=i)
        assert acc.value.iloc[0] == pytest.approx(np.mean(lg.argmax(1) == y)) and acc.n.iloc[0] == 10
        assert acc.value_lo.iloc[0] <= acc.value.iloc[0] <= acc.value_hi.iloc[0]
    last = vm.depth - 1
    assert _rows(df, metric="kl_to_final", layer=last).value.iloc[0] == 0.0  # the model's own readout, exactly
    assert _rows(df, metric="agreement_with_final", layer=last).value.iloc[0] == 1.0
    acc_last = _rows(df, metric="top1_accuracy", layer=last).value.iloc[0]
    assert acc_last == np.mean(final.argmax(1) == y)


def test_logit_lens_of_a_registers_model_with_average_pooling_reads_blocks_as_the_model_reads_its_last():
    vm = tiny("reg", num_classes=10, global_pool="avg")  # 4 registers; norm after pooling (fc_norm), no CLS read
    m, p = vm.model, vm.num_prefix_tokens
    assert p == 5 and isinstance(m.norm, torch.nn.Identity)
    batches = _batches(vm, n=6, bs=3)
    df = _stream("logit_lens", vm, batches).finalize()
    x = torch.cat([b.images for b in batches])
    feats = vs.extract(vm, x, [f"block{i}.out" for i in range(vm.depth)])
    with torch.no_grad():
        final = m(x).double().numpy()  # the model's own forward, not a tap
    for i in range(vm.depth):  # written out: mean of the patch tokens (registers and CLS left out), layer norm, head
        pooled = feats[f"block{i}.out"][:, p:].double().mean(1)
        z = torch.nn.functional.layer_norm(pooled, m.fc_norm.normalized_shape, m.fc_norm.weight.double(),
                                           m.fc_norm.bias.double(), m.fc_norm.eps)
        lg = (z @ m.head.weight.double().T + m.head.bias.double()).detach().numpy()
        got = _rows(df, metric="kl_to_final", layer=i).value.iloc[0]
        assert got == pytest.approx(_np_kl(lg, final).mean(), rel=1e-4, abs=1e-6)
        agree = _rows(df, metric="agreement_with_final", layer=i).value.iloc[0]
        assert agree == pytest.approx(np.mean(lg.argmax(1) == final.argmax(1)))
    last = vm.depth - 1
    assert _rows(df, metric="kl_to_final", layer=last).value.iloc[0] == 0.0  # exactly the model's prediction
    assert _rows(df, metric="agreement_with_final", layer=last).value.iloc[0] == 1.0
    assert _rows(df, metric="kl_to_final", layer=0).value.iloc[0] > 0


def test_logit_lens_reports_no_accuracy_when_the_head_does_not_cover_the_classes():
    vm = tiny("vit", num_classes=10)
    a = _stream("logit_lens", vm, _batches(vm, n=4, bs=4))  # 12 synthetic classes, an unknown 10-way head
    df = a.finalize()
    assert set(df.metric) == {"kl_to_final", "agreement_with_final"}


def test_logit_lens_without_a_head_fits_one_probe_on_the_last_block_and_applies_it_everywhere():
    from vitscope.analyses.splits import stratified_test
    from vitscope.metrics.semantics import fit_probe

    vm = tiny("vit", num_classes=0)
    batches = _batches(vm, n=48, bs=8)  # 4 images of each of the 12 classes: one test image each
    with pytest.raises(vs.VitscopeError, match="classifier head"):
        get_analysis("logit_lens")(vm, readout="head")
    df = _stream("logit_lens", vm, batches, test_every=3).finalize()
    x = torch.cat([b.images for b in batches])
    ids = torch.cat([b.index for b in batches])
    y = torch.cat([b.labels for b in batches])
    feats = vs.extract(vm, x, [f"block{i}.out" for i in range(vm.depth)])
    m = vm.model
    pooled = [torch.nn.functional.layer_norm(feats[f"block{i}.out"], m.norm.normalized_shape, m.norm.weight,
                                             m.norm.bias, m.norm.eps)[:, 0].detach() for i in range(vm.depth)]
    test = stratified_test(ids, y, 3)
    assert set(df.readout) == {f"probe fitted on block {vm.depth - 1}"}
    final = fit_probe(pooled[-1][~test], y[~test], pooled[-1][test], y[test], warn=False)
    for i in range(vm.depth):
        fit = fit_probe(pooled[-1][~test], y[~test], pooled[i][test], y[test], warn=False)
        acc = _rows(df, metric="top1_accuracy", layer=i)
        assert acc.value.iloc[0] == pytest.approx(fit.accuracy, abs=1e-12) and acc.n.iloc[0] == int(test.sum())
        agree = _rows(df, metric="agreement_with_final", layer=i).value.iloc[0]
        assert agree == pytest.approx(float((fit.scores.argmax(1) == final.scores.argmax(1)).double().mean()))
    assert _rows(df, metric="kl_to_final", layer=vm.depth - 1).value.iloc[0] == 0.0
    # shards in any order and a resumed part give the same table
    whole = _fed("logit_lens", vm, batches, test_every=3)
    first, second = _fed("logit_lens", vm, batches[2:], test_every=3), _fed("logit_lens", vm, batches[:2], test_every=3)
    first.merge(second)
    resumed = get_analysis("logit_lens")(vm, test_every=3)
    resumed.load_state_dict(_fed("logit_lens", vm, batches[:1], test_every=3).state_dict())
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    for other in (first, resumed):
        assert other.finalize().value.to_numpy() == pytest.approx(ref.value.to_numpy(), abs=1e-9, nan_ok=True)


# ------------------------------------------------------------------------------------------------------------
# high-norm tokens: per-image loops over tokens in numpy, and a planted artifact
# ------------------------------------------------------------------------------------------------------------


def _np_outliers(norms, k):
    """Per row: norm > lower median + k * 1.4826 * lower-median absolute deviation, by sorting in numpy."""
    out = np.zeros(norms.shape, dtype=bool)
    for b, row in enumerate(np.asarray(norms)):
        med = np.sort(row)[(len(row) - 1) // 2]
        dev = np.abs(row - med)
        mad = np.sort(dev)[(len(dev) - 1) // 2]
        out[b] = row > med + k * 1.4826 * mad
    return out


def test_robust_outliers_match_a_sorting_reference_and_find_one_raised_token_among_equal_ones():
    g = torch.Generator().manual_seed(3)
    norms = torch.randn(5, 17, generator=g, dtype=torch.float64).exp()
    for k in (1.0, 3.0):
        assert np.array_equal(M.robust_outliers(norms, k).numpy(), _np_outliers(norms.numpy(), k))
    flat = torch.ones(2, 6, dtype=torch.float64)
    flat[1, 4] = 1.5
    assert M.robust_outliers(flat, 6.0).tolist() == [[False] * 6, [False] * 4 + [True, False]]


def _ref_high_norm(vm, batches, k):
    """Per layer: outliers per image, patch variance and foreground share of outliers and of all tokens, CLS
    attention of the next block on the outliers, min and max patch norm -- loops over images and tokens."""
    x = torch.cat([b.images for b in batches]).double()
    masks = _token_masks(torch.cat([b.masks for b in batches]), vm.grid_size).numpy()
    taps = [f"block{i}.out" for i in range(vm.depth)] + [f"block{i}.attn" for i in range(vm.depth)]
    feats = vs.extract(vm, x.float(), taps)
    p, (h, w), ps = vm.num_prefix_tokens, vm.grid_size, vm.patch_size
    B = x.shape[0]
    var = np.zeros((B, h * w))
    for b in range(B):
        for r in range(h):
            for c in range(w):
                var[b, r * w + c] = x[b, :, r * ps:(r + 1) * ps, c * ps:(c + 1) * ps].numpy().var()
    out = {}
    for i in range(vm.depth):
        norms = np.linalg.norm(feats[f"block{i}.out"][:, p:].double().numpy(), axis=-1)
        flags = _np_outliers(norms, k)
        res = {"count": flags.sum(1), "var_out": var[flags], "var_all": var.reshape(-1), "fg_out": masks[flags],
               "fg_all": masks.reshape(-1), "min": norms.min(), "max": norms.max(), "flags": flags,
               "norms": norms.reshape(-1)}
        if p > 1:  # the registers (tokens 1 .. p-1), apart from the patch tokens
            reg = np.linalg.norm(feats[f"block{i}.out"][:, 1:p].double().numpy(), axis=-1)
            res["reg_min"], res["reg_max"] = reg.min(), reg.max()
        if i + 1 < vm.depth:
            cls = feats[f"block{i + 1}.attn"][:, :, 0].double().mean(1).numpy()
            res["absorbed"] = [cls[b, p:][flags[b]].sum() for b in range(B) if flags[b].any()]
            res["uniform"] = [flags[b].sum() / cls.shape[1] for b in range(B) if flags[b].any()]
            res["registers"] = [cls[b, 1:p].sum() for b in range(B)] if p > 1 else []
        out[i] = res
    return out


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_high_norm_tokens_match_a_loop_reference(kind):
    vm = tiny(kind)
    batches = _batches(vm, n=6, bs=4)
    df = _stream("high_norm_tokens", vm, batches, k=1.0, knn=False).finalize()
    ref = _ref_high_norm(vm, batches, 1.0)
    for i, r in ref.items():
        q = _rows(df, metric="norm_quantile", layer=i, token_view="spatial")
        assert _rows(q, quantile=0.0).value.iloc[0] == pytest.approx(r["min"], rel=1e-6)  # float32 norms
        assert _rows(q, quantile=1.0).value.iloc[0] == pytest.approx(r["max"], rel=1e-6)
        assert (np.diff(q.sort_values("quantile").value.to_numpy()) >= 0).all()
        for level in (0.25, 0.5, 0.75):  # the histogram's bins are 0.01 decade (2.3 %) wide
            want = np.sort(r["norms"])[int(np.ceil(level * len(r["norms"]))) - 1]
            assert _rows(q, quantile=level).value.iloc[0] == pytest.approx(want, rel=0.024)
        assert _rows(df, metric="outliers_per_image", layer=i).value.iloc[0] == pytest.approx(r["count"].mean())
        share = _rows(df, metric="images_with_outliers", layer=i).value.iloc[0]
        assert share == pytest.approx(np.mean(r["count"] > 0))
        for metric, tokens, vals in (("patch_variance", "outliers", r["var_out"]), ("patch_variance", "all",
                                     r["var_all"]), ("foreground_share", "outliers", r["fg_out"]),
                                     ("foreground_share", "all", r["fg_all"])):
            got = _rows(df, metric=metric, layer=i, tokens=tokens)
            assert got.value.iloc[0] == pytest.approx(np.mean(vals), rel=1e-5) and got.n.iloc[0] == len(vals)
        regq = _rows(df, metric="norm_quantile", layer=i, token_view="register")
        if vm.num_prefix_tokens > 1:  # the registers' norms, reported apart from the patch tokens'
            assert _rows(regq, quantile=0.0).value.iloc[0] == pytest.approx(r["reg_min"], rel=1e-6)
            assert _rows(regq, quantile=1.0).value.iloc[0] == pytest.approx(r["reg_max"], rel=1e-6)
        else:
            assert regq.empty
        pos = _rows(df, metric="outlier_position", layer=i).sort_values(["row", "col"]).value.to_numpy()
        assert np.array_equal(pos, r["flags"].sum(0))
        if "absorbed" in r:
            got = _rows(df, metric="cls_attention_absorbed", layer=i, tokens="outliers").value.iloc[0]
            assert got == pytest.approx(np.mean(r["absorbed"]), rel=1e-5)
            got = _rows(df, metric="cls_attention_absorbed", layer=i, tokens="uniform").value.iloc[0]
            assert got == pytest.approx(np.mean(r["uniform"]), rel=1e-9)
            regs = _rows(df, metric="cls_attention_absorbed", layer=i, tokens="registers")
            if r["registers"]:
                assert regs.value.iloc[0] == pytest.approx(np.mean(r["registers"]), rel=1e-5)
                assert regs.n.iloc[0] == len(r["registers"])
            else:
                assert regs.empty
        else:
            assert _rows(df, metric="cls_attention_absorbed", layer=i).empty  # the last block: no next attention
    regs = df[df.token_view == "register"]
    assert (len(regs) > 0) == (vm.num_prefix_tokens > 1)


def _high_norm(vm, batches, **params):
    """high_norm_tokens streamed over ``batches``; its statistics pass (rule bimodal) over the same batches."""
    a = get_analysis("high_norm_tokens")(vm, **params)
    a.prepare(vm, lambda n: iter(batches))
    stream(vm, batches, [a], progress=False)
    return a


@pytest.mark.parametrize("rule", ["mad", "bimodal"])
def test_a_planted_high_norm_token_is_found_at_its_block_and_not_before(rule):
    vm = tiny("vit")
    batches = _batches(vm, n=6, bs=3)
    token, block = 5, 1  # patch token 5 (row 1, column 1 of the 4x4 grid) raised 50-fold after block 1

    def plant(module, args, out):
        out = out.clone()
        out[:, vm.num_prefix_tokens + token] *= 50
        return out

    clean = _high_norm(vm, batches, knn=False, rule=rule).finalize()
    handle = vm.model.blocks[block].register_forward_hook(plant)
    try:
        df = _high_norm(vm, batches, knn=False, rule=rule).finalize()
    finally:
        handle.remove()

    def at(table, layer):
        return _rows(table, metric="outlier_position", layer=layer, row=token // 4, col=token % 4).value.iloc[0]

    assert at(df, block) == 6  # every image
    for earlier in range(block):
        assert at(df, earlier) == at(clean, earlier) < 6
    assert _rows(df, metric="images_with_outliers", layer=block).value.iloc[0] == 1.0
    if rule == "bimodal":  # only the planted tokens, and nothing in the unplanted model (one mode everywhere)
        assert _rows(df, metric="outliers_per_image", layer=block).value.iloc[0] == 1.0
        assert (_rows(clean, metric="outliers_per_image").value == 0).all()
        assert _rows(clean, metric="norm_threshold").value.isna().all()
        thr = _rows(df, metric="norm_threshold", layer=block)
        assert thr.value.notna().all() and (thr.separation > 2).all()
        assert set(df.rule) == {set(df.rule).pop()} and "bimodal" in df.rule.iloc[0]
    else:
        assert "norm_threshold" not in set(df.metric) and "MAD" in df.rule.iloc[0]


def test_bimodal_threshold_splits_two_planted_modes_and_finds_none_in_one():
    g = torch.Generator().manual_seed(7)
    low = 1.7 + 0.05 * torch.randn(3000, generator=g, dtype=torch.float64)  # log10 norms about 50
    high = 2.7 + 0.08 * torch.randn(60, generator=g, dtype=torch.float64)  # about 500: 2 % of the tokens
    thr, sep, upper = M.bimodal_threshold(torch.cat([low, high])[torch.randperm(3060, generator=g)])
    assert float(low.max()) < thr < float(high.min())  # every planted token on its side
    assert sep > 2 and upper == pytest.approx(60 / 3060, abs=0.005)
    for one in (0.1 * torch.randn(5000, generator=g, dtype=torch.float64),  # a normal on the log scale
                torch.log10(torch.randn(5000, 48, generator=g, dtype=torch.float64).norm(dim=-1)),  # chi norms
                torch.log10(torch.empty(5000, dtype=torch.float64).exponential_(generator=g))):  # skewed
        thr, sep, _ = M.bimodal_threshold(one)
        assert thr == float("inf") and sep < 2
    assert M.bimodal_threshold(torch.ones(10, dtype=torch.float64))[0] == float("inf")
    # two separated modes of equal size: ordinary tokens split (object vs background), not an outlier mode
    halves = torch.cat([low, 2.7 + 0.05 * torch.randn(3000, generator=g, dtype=torch.float64)])
    thr, sep, upper = M.bimodal_threshold(halves)
    assert thr == float("inf") and sep > 2 and upper == pytest.approx(0.5, abs=0.01)


def test_bimodal_rule_flags_the_tokens_above_its_reported_threshold_and_resumes_with_it():
    vm = tiny("reg")
    batches = _batches(vm, n=9, bs=3)
    p = vm.num_prefix_tokens

    def plant(module, args, out):  # two patch tokens raised 30-fold after block 2, in every image
        out = out.clone()
        out[:, p + 3] *= 30
        out[:, p + 10] *= 30
        return out

    handle = vm.model.blocks[2].register_forward_hook(plant)
    try:
        params = {"rule": "bimodal", "knn": False, "layers": [1, 2]}
        whole = _high_norm(vm, batches, **params)
        df = whole.finalize()
        x = torch.cat([b.images for b in batches])
        norms = vs.extract(vm, x, ["block2.out"])["block2.out"][:, p:].double().norm(dim=-1).numpy()
        thr = _rows(df, metric="norm_threshold", layer=2).value.iloc[0]
        flags = norms > thr
        assert flags[:, [3, 10]].all()
        pos = _rows(df, metric="outlier_position", layer=2).sort_values(["row", "col"]).value.to_numpy()
        assert np.array_equal(pos, flags.sum(0))
        resumed = get_analysis("high_norm_tokens")(vm, **params)
        part = get_analysis("high_norm_tokens")(vm, **params)
        part.prepare(vm, lambda n: iter(batches))  # as a study: the statistics pass first, then the pass stops
        stream(vm, batches[:1], [part], progress=False)
        resumed.load_state_dict(part.state_dict())
        resumed.prepare(vm, lambda n: (_ for _ in ()).throw(AssertionError("no second statistics pass")))
        stream(vm, batches[1:], [resumed], progress=False)
        got = resumed.finalize()
        assert got.value.to_numpy(dtype=float) == pytest.approx(df.value.to_numpy(dtype=float), rel=1e-9,
                                                               abs=1e-12, nan_ok=True)
        with pytest.raises(vs.VitscopeError, match="different bimodal thresholds"):
            whole.merge(_high_norm(vm, batches[:1], **params))
    finally:
        handle.remove()
    with pytest.raises(vs.ConfigError, match=r"^high_norm_tokens: rule 'otsu' does not exist; choose mad or bimodal$"):
        get_analysis("high_norm_tokens")(vm, rule="otsu")
    unprepared = get_analysis("high_norm_tokens")(vm, rule="bimodal")
    with pytest.raises(vs.VitscopeError, match="prepare"):
        stream(vm, batches[:1], [unprepared], progress=False)


def test_knn_of_outlier_tokens_against_random_tokens_matches_the_semantics_rule():
    from vitscope.analyses.splits import stratified_test
    from vitscope.metrics.semantics import knn_classify

    vm = tiny("vit")
    batches = _batches(vm, n=36, bs=12)
    df = _stream("high_norm_tokens", vm, batches, k=1.0, layers=[1], test_every=3).finalize()
    x = torch.cat([b.images for b in batches])
    ids, y = torch.cat([b.index for b in batches]), torch.cat([b.labels for b in batches])
    tok = vs.extract(vm, x, ["block1.out"])["block1.out"][:, 1:].float()
    flags = torch.from_numpy(_np_outliers(tok.double().norm(dim=-1).numpy(), 1.0))
    sel = flags.any(1)
    mean_out = torch.stack([tok[b][flags[b]].mean(0) for b in range(len(tok)) if flags[b].any()]).half().float()
    S = tok.shape[1]
    rand = torch.stack([tok[b, (int(ids[b]) * 2654435761 + 2 * 40503) % S] for b in range(len(tok))])
    rand = rand[sel].half().float()
    test = stratified_test(ids[sel], y[sel], 3)
    for tokens, feats in (("outliers", mean_out), ("random_patch", rand)):
        want = knn_classify(feats[~test], y[sel][~test], feats[test], y[sel][test], ks=(20,))[20][0]
        got = _rows(df, metric="knn_accuracy", layer=1, tokens=tokens)
        assert got.value.iloc[0] == pytest.approx(want) and got.n.iloc[0] == int(test.sum())


def test_high_norm_tokens_merge_and_resume_equal_one_pass():
    vm = tiny("reg")
    batches = _batches(vm, n=9, bs=3)
    params = {"k": 1.0, "test_every": 2}
    whole = _fed("high_norm_tokens", vm, batches, **params)
    first, second = _fed("high_norm_tokens", vm, batches[2:], **params), _fed("high_norm_tokens", vm, batches[:2],
                                                                              **params)
    first.merge(second)
    resumed = get_analysis("high_norm_tokens")(vm, **params)
    resumed.load_state_dict(_fed("high_norm_tokens", vm, batches[:1], **params).state_dict())
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    for other in (first, resumed):
        got = other.finalize()
        assert len(got) == len(ref)
        assert got.value.to_numpy(dtype=float) == pytest.approx(ref.value.to_numpy(dtype=float), rel=1e-9,
                                                               abs=1e-12, nan_ok=True)


def test_every_figure_draws_from_a_two_model_run(tmp_path):
    import warnings

    import matplotlib.pyplot as plt

    from vitscope.report.figures import FIGURES

    tables: dict[str, list[pd.DataFrame]] = {}
    for kind, label, kw in (("vit", "A", {"num_classes": 10}), ("reg", "B", {"num_classes": 0})):
        vm = tiny(kind, **kw)
        vm.name = label
        analyses = [get_analysis(n)(vm, **p) for n, p in (("attention_rollout", {}), ("gradient_rollout", {}),
                                                           ("logit_lens", {"test_every": 2}), ("head_ablation", {}),
                                                           ("high_norm_tokens", {"k": 1.0, "test_every": 2}))]
        stream(vm, _batches(vm, n=12, bs=6), analyses, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # few images per class: the split warns
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
    assert FIGURES["high_norm_tokens"](tables["high_norm_tokens"][0].iloc[0:0]) == []


# ------------------------------------------------------------------------------------------------------------
# gradient rollout (Chefer et al. 2021): numpy loop, and gradients taken here with the test's own hooks
# ------------------------------------------------------------------------------------------------------------


def _ref_gradient_rollout(attns, grads):
    """(B, L, T): CLS row of R after each block, R = R + mean_h(max(grad * attn, 0)) R from I, numpy."""
    B, H, T, _ = attns[0].shape
    out = np.zeros((B, len(attns), T))
    for b in range(B):
        R = np.eye(T)
        for lay, (a, g) in enumerate(zip(attns, grads, strict=True)):
            cam = np.maximum(a[b].numpy() * g[b].numpy(), 0).mean(0)
            R = R + cam @ R
            out[b, lay] = R[0]
    return out


def test_gradient_rollout_matches_a_loop_and_is_plain_identity_without_gradient():
    attns = _random_attention(B=2, H=3, T=6, L=3, seed=4)
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(a.shape, generator=g, dtype=torch.float64) for a in attns]
    got = M.gradient_rollout(attns, grads)
    assert got.numpy() == pytest.approx(_ref_gradient_rollout(attns, grads), abs=1e-12)
    zero = M.gradient_rollout(attns, [torch.zeros_like(a) for a in attns])
    assert torch.equal(zero, torch.eye(6, dtype=torch.float64)[0].expand(2, 3, 6))


def test_gradient_rollout_analysis_uses_the_gradient_of_the_predicted_class():
    vm = tiny("vit", num_classes=5)
    batches = _batches(vm, n=5, bs=5)
    fused_before = [b.attn.fused_attn for b in vm.model.blocks]
    df = _stream("gradient_rollout", vm, batches).finalize()
    assert [b.attn.fused_attn for b in vm.model.blocks] == fused_before
    assert all(w.grad is None for w in vm.model.parameters())
    # the test's own gradients: the ViT written out here (pre-norm blocks, CLS readout) with its attention
    # probabilities as tensors of this graph
    m, H = vm.model, vm.num_heads
    h = m.patch_embed(batches[0].images)
    h = torch.cat([m.cls_token.expand(len(h), -1, -1), h], 1) + m.pos_embed
    attns = []
    for blk in m.blocks:
        B, T, D = h.shape
        q, k, v = blk.attn.qkv(blk.norm1(h)).reshape(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-2, -1) * (D // H) ** -0.5, -1)
        attns.append(a)
        h = h + blk.attn.proj((a @ v).transpose(1, 2).reshape(B, T, D))
        h = h + blk.mlp(blk.norm2(h))
    logits = m.head(m.norm(h)[:, 0])
    assert logits.detach().numpy() == pytest.approx(vs.extract(vm, batches[0].images, ["logits"])["logits"].numpy(),
                                                    abs=1e-5)
    score = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
    grads = torch.autograd.grad(score, attns)
    ref = _ref_gradient_rollout([a.detach().double() for a in attns], [g.double() for g in grads])
    p = vm.num_prefix_tokens
    for i in range(vm.depth):
        maps = ref[:, i, p:] / ref[:, i, p:].sum(1, keepdims=True)
        got = _rows(df, metric="rollout_map", layer=i).sort_values(["row", "col"]).value.to_numpy()
        assert got == pytest.approx(maps.mean(0), rel=1e-4, abs=1e-6)
    assert set(df.head_fusion) == {"gradient"} and _rows(df, metric="iou_rollout").value.notna().all()


def test_gradient_rollout_of_a_headless_model_is_empty_with_a_reason():
    vm = tiny("vit", num_classes=0)
    a = get_analysis("gradient_rollout")(vm)
    assert a.required_taps() == []
    stream(vm, _batches(vm, n=2, bs=2), [a], progress=False)
    assert len(a.finalize()) == 0
    assert "head" in a.empty_reason()  # the sentence the study says (tests/test_empty_reasons.py)


# ------------------------------------------------------------------------------------------------------------
# head ablation: the full model run from the image with one head zeroed by the test's own hook
# ------------------------------------------------------------------------------------------------------------


def _zeroed_output(vm, x, layer, head):
    """The model's output on ``x`` with head ``head`` of block ``layer`` zeroed before the projection."""
    H = vm.num_heads

    def zero(module, args):
        h = args[0].clone()
        d = h.shape[-1] // H
        h[..., head * d:(head + 1) * d] = 0
        return (h,)

    handle = vm.model.blocks[layer].attn.proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            return vm.model(x).double()
    finally:
        handle.remove()


def test_head_ablation_equals_full_forwards_with_the_head_zeroed():
    from vitscope.metrics.robustness import CIFAR10_CLASSES

    vm = tiny("vit", num_classes=10)
    batches = _labelled(_batches(vm, n=7, bs=4), 10)
    a = get_analysis("head_ablation")(vm, head_classes="cifar10")
    a.configure({"data": list(CIFAR10_CLASSES)})
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    x = torch.cat([b.images for b in batches])
    y = torch.cat([b.labels for b in batches]).numpy()
    with torch.no_grad():
        clean = vm.model(x).double().numpy()
    for layer in range(vm.depth):
        for head in range(vm.num_heads):
            abl = _zeroed_output(vm, x, layer, head).numpy()
            kl = _np_kl(abl, clean)
            got = _rows(df, metric="kl_from_clean", layer=layer, head=head)
            assert got.value.iloc[0] == pytest.approx(kl.mean(), rel=1e-4, abs=1e-7)
            flips = _rows(df, metric="prediction_flips", layer=layer, head=head).value.iloc[0]
            assert flips == pytest.approx(np.mean(abl.argmax(1) != clean.argmax(1)))
            drop = _rows(df, metric="accuracy_drop", layer=layer, head=head).value.iloc[0]
            assert drop == pytest.approx(np.mean(clean.argmax(1) == y) - np.mean(abl.argmax(1) == y))
    # merge of two parts in another order equals one pass
    first = get_analysis("head_ablation")(vm, head_classes="cifar10")
    first.configure({"data": list(CIFAR10_CLASSES)})
    for b in batches[1:]:
        with vs.Capture(vm, first.required_taps()) as cap:
            first.update(cap(b.images), b)
    second = get_analysis("head_ablation")(vm, head_classes="cifar10")
    second.configure({"data": list(CIFAR10_CLASSES)})
    with vs.Capture(vm, second.required_taps()) as cap:
        second.update(cap(batches[0].images), batches[0])
    first.merge(second)
    assert first.finalize().value.to_numpy() == pytest.approx(df.value.to_numpy(), rel=1e-9, abs=1e-12)


def test_head_ablation_without_a_head_reports_the_change_of_the_pooled_output():
    vm = tiny("reg", num_classes=0)
    batches = _batches(vm, n=4, bs=4)
    df = _stream("head_ablation", vm, batches, layers=[1]).finalize()
    x = torch.cat([b.images for b in batches])
    with torch.no_grad():
        clean = vm.model(x).double()
    assert set(df.metric) == {"output_change"} and set(df.layer) == {1}
    for head in range(vm.num_heads):
        abl = _zeroed_output(vm, x, 1, head)
        want = (1 - torch.nn.functional.cosine_similarity(abl, clean, dim=-1)).mean()
        assert _rows(df, head=head).value.iloc[0] == pytest.approx(float(want), rel=1e-4, abs=1e-8)


STUDY = """
models:
  - {name: vit_small_patch16_224, label: tiny-head, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, num_classes: 10}}
  - {name: vit_small_patch16_224, label: tiny-headless, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, num_classes: 0}}
dataset: {name: synthetic-shapes, n_images: 24}
analyses:
  attention_rollout: {discard_ratio: 0.1}
  gradient_rollout: {}
  logit_lens: {test_every: 2}
  high_norm_tokens: {k: 1.0, test_every: 2}
  head_ablation: {}
batch_size: 4
progress: false
"""


@pytest.mark.skipif(__import__("shutil").which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.slow  # merge and resume are checked in process; torchrun itself by tests/test_distributed.py
def test_two_process_torchrun_equals_one_process(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY)
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitscope", "--quiet", "run", str(cfg),
                    f"output_dir={sharded}", f"cache_dir={tmp_path / 'c2'}"], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "vitscope", "--quiet", "run", str(cfg), f"output_dir={single}",
                    f"cache_dir={tmp_path / 'c1'}"], check=True, timeout=300)
    for name in ("attention_rollout", "gradient_rollout", "logit_lens", "high_norm_tokens", "head_ablation"):
        a = pd.read_parquet(sharded / "results" / f"{name}.parquet")
        b = pd.read_parquet(single / "results" / f"{name}.parquet")
        assert len(a) == len(b) > 0, name
        assert a.value.to_numpy(dtype=float) == pytest.approx(b.value.to_numpy(dtype=float), rel=1e-6, abs=1e-9,
                                                              nan_ok=True), name
    assert '"world_size": 2' in (sharded / "manifest.json").read_text()


def test_reruns_record_nothing_into_the_open_capture_and_keep_other_hooks():
    from vitscope.capture.engine import taps_paused

    vm = tiny("vit", num_classes=10)
    batch = _batches(vm, n=3, bs=3)[0]
    calls = []
    handle = vm.model.blocks[1].register_forward_hook(lambda m, a, out: calls.append(out.shape[0]))
    try:
        for name in ("head_ablation", "gradient_rollout"):
            a = get_analysis(name)(vm)
            taps = a.required_taps() + ["block0.out"]  # block0.out: also a tap no analysis here reads
            with vs.Capture(vm, taps) as cap:
                feats = cap(batch.images)
                calls.clear()
                a.update(feats, batch)
                assert cap._store == {}, name  # the rerun blocks' taps wrote nothing
            assert calls, name  # a hook that is not a tap still ran on the rerun
    finally:
        handle.remove()
    with vs.Capture(vm, ["block0.out"]) as cap:  # early stop after block 0: paused, the full model runs
        with taps_paused(), torch.no_grad():
            assert vm.model(batch.images).shape == (3, 10)
        assert set(cap(batch.images)) == {"block0.out"}


# ------------------------------------------------------------------------------------------------------------
# mean-ablation: against a hand-edited copy of the model whose attention branch returns a constant
# ------------------------------------------------------------------------------------------------------------


class _Constant(torch.nn.Module):
    """Stands in for ``block.attn``: returns ``value`` (T, D) for every image, whatever it is given."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x, *args, **kwargs):
        return self.value.to(x.dtype).expand(x.shape[0], -1, -1)


def _attn_branch_mean(vm, x, layer):
    """The mean over images of ``block[layer].attn``'s output at each token position, by the test's own hook."""
    kept = []
    handle = vm.model.blocks[layer].attn.register_forward_hook(lambda m, a, out: kept.append(out.detach()))
    try:
        with torch.no_grad():
            vm.model(x)
    finally:
        handle.remove()
    return torch.cat(kept).double().mean(0)


@pytest.mark.parametrize("mean_images", [4, 100])
def test_mean_ablation_of_every_head_of_a_block_equals_its_attention_branch_replaced_by_its_mean(mean_images):
    import copy

    from vitscope.analyses._drive import run_passes

    vm = tiny("vit", num_classes=10)
    layer, n = 1, 7
    ds = SyntheticShapes(n=n, seed=1)
    a = get_analysis("head_ablation")(vm, layers=[layer], mode="mean", heads="all", mean_images=mean_images)
    run_passes(a, vm, {"data": ds}, batch_size=3)
    df = a.finalize()
    x = torch.cat([b.images for b in ds.batches(n, vm.preprocessing)])
    # the reference: the first min(mean_images, n) images in dataset order, averaged per token position
    edited = copy.deepcopy(vm.model)
    edited.blocks[layer].attn = _Constant(_attn_branch_mean(vm, x[:mean_images], layer).float())
    with torch.no_grad():
        want, clean = edited(x).double(), vm.model(x).double()
    assert a.mean_n == min(mean_images, n)
    with vs.Capture(vm, [f"block{layer - 1}.out"]) as cap:
        got = a._ablated(cap(x)[f"block{layer - 1}.out"], layer)[0].double()
    assert got.numpy() == pytest.approx(want.numpy(), rel=1e-4, abs=1e-5)
    assert not np.allclose(want.numpy(), clean.numpy(), atol=1e-3)  # the ablation changes the output
    kl = _rows(df, metric="kl_from_clean", layer=layer)
    assert len(kl) == 1 and kl["head"].isna().all() and set(df["heads"]) == {"all"} and set(df["mode"]) == {"mean"}
    assert kl.value.iloc[0] == pytest.approx(_np_kl(want.numpy(), clean.numpy()).mean(), rel=1e-4, abs=1e-7)
    flips = _rows(df, metric="prediction_flips", layer=layer).value.iloc[0]
    assert flips == pytest.approx(np.mean(want.numpy().argmax(1) != clean.numpy().argmax(1)))


def test_zero_ablation_of_every_head_leaves_the_projection_bias_alone():
    import copy

    vm = tiny("vit", num_classes=0)
    batches = _batches(vm, n=5, bs=5)
    df = _stream("head_ablation", vm, batches, layers=[2], heads="all").finalize()
    x = batches[0].images
    edited = copy.deepcopy(vm.model)
    T = vm.num_prefix_tokens + vm.grid_size[0] * vm.grid_size[1]
    bias = vm.model.blocks[2].attn.proj.bias.detach()
    edited.blocks[2].attn = _Constant(bias.expand(T, -1))
    with torch.no_grad():
        want, clean = edited(x).double(), vm.model(x).double()
    change = (1 - torch.nn.functional.cosine_similarity(want, clean, dim=-1)).mean()
    assert _rows(df, metric="output_change", layer=2).value.iloc[0] == pytest.approx(float(change), rel=1e-4,
                                                                                      abs=1e-8)


def _mean_prepared(vm, batches, **params):
    a = get_analysis("head_ablation")(vm, mode="mean", **params)
    a.prepare(vm, lambda n: iter(batches))
    return a


def test_zero_and_mean_ablation_differ_and_mean_ablation_is_deterministic():
    vm = tiny("vit", num_classes=10)
    batches = _batches(vm, n=6, bs=3)
    zero = _stream("head_ablation", vm, batches, layers=[0, 2]).finalize()
    runs = []
    for _ in range(2):
        a = _mean_prepared(vm, batches, layers=[0, 2])
        stream(vm, batches, [a], progress=False)
        runs.append(a.finalize())
    kz = _rows(zero, metric="kl_from_clean").value.to_numpy()
    km = _rows(runs[0], metric="kl_from_clean").value.to_numpy()
    assert len(kz) == len(km) == 2 * vm.num_heads and (km > 0).all()
    assert not np.allclose(kz, km, rtol=1e-2)
    pd.testing.assert_frame_equal(runs[0], runs[1])
    assert set(zero["mode"]) == {"zero"} and "mean_images" not in zero.columns
    assert set(runs[0]["mean_images"]) == {6}


def test_mean_ablation_merges_and_resumes_with_the_mean_it_saved():
    vm = tiny("reg", num_classes=10)
    batches = _batches(vm, n=7, bs=3)
    params = {"layers": [1, 2], "heads": "each"}

    def fed(part):
        a = _mean_prepared(vm, batches, **params)
        for b in part:
            with vs.Capture(vm, a.required_taps()) as cap:
                a.update(cap(b.images), b)
        return a

    whole = fed(batches)
    first, second = fed(batches[2:]), fed(batches[:2])
    first.merge(second)
    resumed = get_analysis("head_ablation")(vm, mode="mean", **params)
    resumed.load_state_dict(fed(batches[:1]).state_dict())

    def no_images(n):
        raise AssertionError("a resumed state has its mean: no statistics pass")

    resumed.prepare(vm, no_images)
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    for other in (first, resumed):
        got = other.finalize()
        assert len(got) == len(ref) == 2 * vm.num_heads * 2
        assert got.value.to_numpy(dtype=float) == pytest.approx(ref.value.to_numpy(dtype=float), rel=1e-9, abs=1e-12)
    other = get_analysis("head_ablation")(vm, mode="mean", **params)
    other.prepare(vm, lambda n: iter(batches[1:]))  # a mean over other images
    with pytest.raises(vs.VitscopeError, match="different means"):
        whole.merge(other)
    with pytest.raises(vs.VitscopeError, match="different settings"):
        whole.merge(get_analysis("head_ablation")(vm, mode="zero", **params))
    unprepared = get_analysis("head_ablation")(vm, mode="mean", **params)
    with vs.Capture(vm, unprepared.required_taps()) as cap, pytest.raises(vs.VitscopeError, match="prepare"):
        unprepared.update(cap(batches[0].images), batches[0])


def test_head_ablation_refuses_an_unknown_mode_or_set_in_one_sentence():
    from vitscope.analyses.base import validate_params

    with pytest.raises(vs.ConfigError, match="'mode' of analysis 'head_ablation' must be one of 'zero', 'mean'"):
        validate_params(get_analysis("head_ablation"), {"mode": "median"})
    with pytest.raises(vs.ConfigError, match="mean_images"):
        validate_params(get_analysis("head_ablation"), {"mean_images": 0})
    vm = tiny("vit")
    with pytest.raises(vs.ConfigError, match=r"^head_ablation: mode 'median' does not exist; choose zero or mean$"):
        get_analysis("head_ablation")(vm, mode="median")
    with pytest.raises(vs.ConfigError, match=r"^head_ablation: heads 'some' does not exist; choose each or all$"):
        get_analysis("head_ablation")(vm, heads="some")


def test_a_study_with_mean_ablation_is_cached_and_resumes_to_the_same_table(tmp_path):
    from vitscope.study import load_config, run_study

    cfg = tmp_path / "study.yaml"
    cfg.write_text("""
models:
  - {name: vit_small_patch16_224, label: tiny, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, num_classes: 10}}
dataset: {name: synthetic-shapes, n_images: 9}
analyses:
  head_ablation: {mode: mean, heads: all, mean_images: 5}
batch_size: 3
progress: false
""")
    ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c1'}"]))
    table = pd.read_parquet(ref / "results" / "head_ablation.parquet")
    assert set(table["mean_images"]) == {5} and len(table) == 2 * 2  # KL and flips per block
    fed: list[int] = []
    run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c1'}"]),
              on_batch=lambda m, b: fed.append(b))
    assert fed == []  # read back from the cache

    class Killed(Exception):
        pass

    def kill(model, b):
        fed.append(b)
        if len(fed) == 2:
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", "save_every=1", f"cache_dir={tmp_path / 'c2'}"]
    with pytest.raises(Killed):
        run_study(load_config(cfg, over), on_batch=kill)
    out = run_study(load_config(cfg, over), on_batch=lambda m, b: fed.append(b))
    assert fed == [0, 1, 2]  # the resumed run fed only the chunk left (3 chunks of 3 images)
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results" / "head_ablation.parquet"), table)


def test_norm_histogram_counts_each_norm_in_its_bin_of_its_block():
    """`HighNormTokens._hist` (index_add_ on the device) against the bins counted one norm at a time."""
    from vitscope.analyses.mechanistic import NORM_BINS, HighNormTokens

    g = torch.Generator().manual_seed(0)
    norms = (10 ** (torch.rand(3, 4, 9, generator=g, dtype=torch.float64) * 11 - 4))  # beyond both ends too
    norms[0, 0, 0] = float("nan")
    got = HighNormTokens._hist(norms)
    nb = len(NORM_BINS) - 1
    want = torch.zeros(3, nb, dtype=torch.float64)
    for layer in range(3):
        for v in norms[layer].flatten().tolist():
            b = 0 if math.isnan(v) else min(max(math.floor((math.log10(v) + 3) * 100), 0), nb - 1)
            want[layer, b] += 1
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_a_state_is_made_of_cpu_copies_that_later_batches_leave_as_they_were():
    """The sums live on the features' device between batches; ``state_dict`` hands out CPU copies (the cache is
    device-independent), not the live tensors the next batch adds to."""
    vm = tiny("vit", num_classes=10)
    batches = _batches(vm, n=12, bs=6)

    def tensors(state):
        if isinstance(state, torch.Tensor):
            return [state]
        items = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else []
        return [t for v in items for t in tensors(v)]

    for name, params in (("attention_rollout", {}), ("gradient_rollout", {}), ("logit_lens", {"test_every": 2}),
                         ("head_ablation", {}), ("high_norm_tokens", {"k": 1.0, "test_every": 2})):
        a = get_analysis(name)(vm, **params)
        stream(vm, batches[:1], [a], progress=False)
        state = a.state_dict()
        kept = [t.clone() for t in tensors(state)]
        stream(vm, batches[1:], [a], progress=False)
        assert all(t.device.type == "cpu" for t in tensors(state)), name
        assert all(torch.equal(t, k) for t, k in zip(tensors(state), kept, strict=True)), name
