"""attention_explorer: the kept 8-bit attention decodes (as the report reads the table's bytes, here with numpy
alone) to the raw ``block{i}.attn`` / ``pool_attn`` taps within the contract's bound ``s / 510``; the rollout
equals a float64 numpy loop over the raw taps; the kept images are the smallest dataset indices whatever the
batch order, and merge and resume give the one-pass table; models without CLS, with registers and with an
attention pool describe their prefix tokens; keep_images=0 is an empty table with its reason."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from study_fixtures import fed_by_hand, run_analysis, shapes_batches

import vitscope as vs
from conftest import TINY, tiny
from vitscope.analyses import get_analysis
from vitscope.analyses.attention.explorer import quantise_rows
from vitscope.analyses.base import validate_params
from vitscope.capture import stream
from vitscope.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "attention_explorer"


def _model(**kw) -> vs.ViTModel:
    """A tiny random ViT with wide random weights (peaked attention: rows far from uniform test the codes)."""
    torch.manual_seed(0)
    vm = vs.load_model("vit_small_patch16_224", pretrained=False, **{**TINY, **kw})
    for p in vm.model.parameters():
        p.data.normal_(0, 0.2)
    return vm


_batches = shapes_batches


def _run(vm, batches, **params):
    return run_analysis(NAME, vm, batches, **params)


def _raw(vm, batches, taps):
    """dataset index -> {tap: float64 numpy array of that image}, each batch extracted as the pass saw it."""
    out = {}
    for b in batches:
        feats = vs.extract(vm, b.images, taps)
        for k, i in enumerate(b.index.tolist()):
            out[i] = {t: feats[t][k].double().numpy() for t in taps}
    return out


def _decode(row, shape):
    """A table row's codes and scales -> (float64 weights of ``shape``, scales ``shape[:-1]``), by numpy alone."""
    codes = np.frombuffer(row["codes"], dtype=np.uint8).reshape(shape)
    scales = np.frombuffer(row["scales"], dtype="<f4").reshape(shape[:-1])
    return codes, scales, codes.astype(np.float64) / 255.0 * scales.astype(np.float64)[..., None]


def _close(got, ref, scales):
    """Within the contract's bound ``s / 510`` of each row (plus float slack)."""
    bound = scales.astype(np.float64)[..., None] / 510.0 + 1e-6
    assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) - bound))


def _check_attention(vm, df, batches, images):
    """Every kept image's every (layer, head, query) row decodes to the raw tap's row; every row's max is code 255
    and dequantises to its scale exactly."""
    raw = _raw(vm, batches, [f"block{i}.attn" for i in range(vm.depth)])
    H, T = vm.num_heads, vm.num_tokens
    rows = df[df.metric == "attention"]
    assert sorted(set(rows.image.tolist())) == images
    for _, row in rows.iterrows():
        assert (row.heads, row.tokens) == (H, T)
        ref = raw[int(row.image)][f"block{int(row.layer)}.attn"]
        codes, scales, got = _decode(row, (H, T, T))
        _close(got, ref, scales)
        assert np.all(codes.max(-1) == 255)
        s = scales[..., None]
        assert np.all(codes.astype(np.float32).max(-1, keepdims=True) / np.float32(255) * s == s)
        np.testing.assert_allclose(scales, ref.max(-1), rtol=1e-6, atol=1e-7)


def _rollout_reference(attns):
    """float64 rollout over blocks 0 .. L-1 with explicit loops over the heads: R_l = M_l R_{l-1}, R_{-1} = I."""
    T = attns[0].shape[-1]
    r, out = np.eye(T), []
    for a in attns:
        mean = sum(a[h] for h in range(a.shape[0])) / a.shape[0]
        m = 0.5 * mean + 0.5 * np.eye(T)
        m = m / m.sum(1, keepdims=True)
        r = m @ r
        out.append(r)
    return out


def test_quantise_rows_against_a_slow_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 4, 7, generator=g) ** 3
    a[0, 1] = 0.0  # a row of zeros: scale 0, codes 0
    codes, scales = quantise_rows(a)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    for i in range(3):
        for j in range(4):
            row = [float(x) for x in a[i, j]]
            s = max(row)
            assert float(scales[i, j]) == pytest.approx(s, rel=1e-7)
            want = [0 if s == 0 else int(np.floor(x / s * 255 + 0.5)) for x in row]
            assert codes[i, j].tolist() == want
            for c, x in zip(want, row, strict=True):
                assert abs(c / 255 * s - x) <= s / 510 + 1e-7


@pytest.mark.parametrize("layers", [None, [0, 2]])
def test_attention_and_rollout_decode_to_the_raw_taps(layers):
    vm = _model()
    batches = _batches(vm)
    df = _run(vm, batches, keep_images=2, layers=layers).finalize()
    chosen = list(range(vm.depth)) if layers is None else layers
    assert (df.n_images == 5).all() and df.value.isna().all()
    assert sorted(df[df.metric == "input_image"].image.tolist()) == [0, 1]
    assert df[df.metric == "input_image"].png.map(lambda b: b[:8] == b"\x89PNG\r\n\x1a\n").all()
    att = df[df.metric == "attention"]
    assert sorted(att.layer.unique().tolist()) == chosen and len(att) == 2 * len(chosen)
    _check_attention(vm, df, batches, [0, 1])
    assert "pool_attention" not in set(df.metric)
    # rollout: all blocks 0 .. l multiplied, whichever layers are chosen
    raw = _raw(vm, batches, [f"block{i}.attn" for i in range(vm.depth)])
    T = vm.num_tokens
    roll = df[df.metric == "rollout"]
    assert len(roll) == 2 * len(chosen) and roll.heads.isna().all() and (roll.tokens == T).all()
    for _, row in roll.iterrows():
        ref = _rollout_reference([raw[int(row.image)][f"block{i}.attn"] for i in range(vm.depth)])[int(row.layer)]
        codes, scales, got = _decode(row, (T, T))
        _close(got, ref, scales)
        assert np.all(codes.max(-1) == 255)
    for c in ("grid_rows", "grid_cols", "prefix_tokens", "cls_token"):
        assert df[c].notna().all()
    assert (df.grid_rows == 4).all() and (df.grid_cols == 4).all() and (df.prefix_tokens == 1).all()
    assert df.cls_token.all()


def _fed(vm, batches, **params):
    return fed_by_hand(NAME, vm, batches, **params)


def test_kept_images_merge_and_resume_equal_one_pass():
    vm = _model(global_pool="map")  # the pool's buffers travel too
    order = [6, 2, 5, 0, 4, 1, 3]  # the kept images (0, 1, 2) arrive out of order, across shards
    batches = _batches(vm, n=7, bs=3, indices=order)  # batches of 3, 3, 1
    params = {"keep_images": 3, "layers": [0, 2]}
    whole = _fed(vm, batches, **params)
    ref = whole.finalize()
    assert ref[ref.metric == "input_image"].image.tolist() == [0, 1, 2]
    assert sorted(set(ref[ref.metric == "attention"].image)) == [0, 1, 2]
    first, second = _fed(vm, batches[2:], **params), _fed(vm, batches[:2], **params)
    first.merge(second)  # the later images first
    part = _fed(vm, batches[:1], **params)
    state = part.state_dict()
    for v in state.values():
        assert isinstance(v, torch.Tensor | int | float | str | list | dict | bool)
        if isinstance(v, torch.Tensor):
            assert v.device.type == "cpu"
    resumed = get_analysis(NAME)(vm, **params)
    resumed.load_state_dict(state)
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    reloaded = get_analysis(NAME)(vm, **params)
    reloaded.load_state_dict(whole.state_dict())
    for other in (first, resumed, reloaded):
        pd.testing.assert_frame_equal(other.finalize().reset_index(drop=True), ref.reset_index(drop=True))
    _check_attention(vm, ref, batches, [0, 1, 2])
    with pytest.raises(ConfigError, match="saved state"):
        get_analysis(NAME)(vm, keep_images=2, layers=[0, 2]).load_state_dict(state)


@pytest.mark.parametrize("kind,prefix,cls", [("no_cls", 2, False), ("reg", 5, True)])
def test_prefix_tokens_without_cls_and_with_registers(kind, prefix, cls):
    vm = (_model(class_token=False, reg_tokens=2, global_pool="avg") if kind == "no_cls" else tiny("reg"))
    assert (vm.num_prefix_tokens, vm.has_cls_token) == (prefix, cls)
    batches = _batches(vm, n=3)
    df = _run(vm, batches, keep_images=2).finalize()
    assert len(df) and (df.prefix_tokens == prefix).all() and (df.cls_token == cls).all()
    assert (df[df.metric == "attention"].tokens == prefix + 16).all()
    _check_attention(vm, df, batches, [0, 1])


def test_attention_pool_rows_decode_to_the_pool_tap():
    vm = _model(global_pool="map")
    assert vm.has_attention_pool
    batches = _batches(vm, n=3)
    a = _run(vm, batches, keep_images=2)
    assert "pool_attn" in a.required_taps()
    df = a.finalize()
    raw = _raw(vm, batches, ["pool_attn"])
    pool = df[df.metric == "pool_attention"]
    assert pool.image.tolist() == [0, 1] and pool.layer.isna().all()
    T = vm.num_tokens
    for _, row in pool.iterrows():
        ref = raw[int(row.image)]["pool_attn"]
        H, Q = ref.shape[:2]
        assert (row.heads, row.queries, row.tokens) == (H, Q, T)
        codes, scales, got = _decode(row, (H, Q, T))
        _close(got, ref, scales)
        assert np.all(codes.max(-1) == 255)


def test_keep_images_zero_is_an_empty_table_with_a_reason():
    vm = tiny("vit")
    a = get_analysis(NAME)(vm, keep_images=0)
    assert a.required_taps() == []
    stream(vm, _batches(vm, n=2), [a], progress=False)
    assert len(a.finalize()) == 0
    assert "keep_images is 0" in a.empty_reason()
    validate_params(get_analysis(NAME), {"keep_images": 0, "layers": [0]})
    for bad in ({"keep_images": -1}, {"keep_images": 1.5}):
        with pytest.raises(ConfigError) as e:
            validate_params(get_analysis(NAME), bad)
        assert "\n" not in str(e.value)
