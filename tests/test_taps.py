"""Tap points: shapes, exact identities, real softmax attention, hooks cleaned up."""

import pytest
import torch
import torch.nn.functional as F

import vitscope as vs
from conftest import tiny


def test_every_tap_has_the_expected_shape(any_tiny, images):
    vm = any_tiny
    B, D, H = len(images), 48, 3
    T = vm.num_prefix_tokens + 16
    feats = vs.extract(vm, images, vm.taps)
    assert set(feats) == set(vm.taps)
    expected = {"norm1": (B, T, D), "qkv": (B, T, 3 * D), "attn": (B, H, T, T), "heads": (B, T, D),
                "attn_out": (B, T, D), "resid_mid": (B, T, D), "norm2": (B, T, D), "fc1": (B, T, 4 * D),
                "fc2": (B, T, D), "mlp_out": (B, T, D), "out": (B, T, D)}
    for i in range(3):
        for k, shape in expected.items():
            assert tuple(feats[f"block{i}.{k}"].shape) == shape, f"block{i}.{k}"
    assert tuple(feats["embed"].shape) == (B, T, D)
    assert tuple(feats["final_norm"].shape) == (B, T, D)
    assert feats["logits"].shape[0] == B


def test_prefix_tokens_and_grid():
    assert tiny("vit").num_prefix_tokens == 1
    reg = tiny("reg")
    assert reg.num_prefix_tokens == 5 and reg.grid_size == (4, 4) and reg.patch_size == 8
    assert tiny("beit").num_prefix_tokens == 1


def test_residual_identities_hold_exactly(any_tiny, images):
    f = vs.extract(any_tiny, images, any_tiny.taps)
    prev = f["embed"]
    for i in range(3):
        torch.testing.assert_close(f[f"block{i}.resid_mid"], prev + f[f"block{i}.attn_out"], rtol=0, atol=1e-6)
        torch.testing.assert_close(f[f"block{i}.out"], f[f"block{i}.resid_mid"] + f[f"block{i}.mlp_out"],
                                   rtol=0, atol=1e-6)
        prev = f[f"block{i}.out"]


def _manual_attention(vm, x_in, blk):
    """softmax(q k^T * scale) from the block input, with weights read off the module: no hooks."""
    attn = blk.attn
    x = F.layer_norm(x_in, (x_in.shape[-1],), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
    bias = attn.qkv.bias
    if getattr(attn, "q_bias", None) is not None:
        bias = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
    qkv = x @ attn.qkv.weight.T + (bias if bias is not None else 0)
    B, T, _ = qkv.shape
    h = attn.num_heads
    q, k, _ = qkv.reshape(B, T, 3, h, -1).permute(2, 0, 3, 1, 4)
    logits = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if getattr(attn, "relative_position_bias_table", None) is not None:
        table, index = attn.relative_position_bias_table, attn.relative_position_index
        logits = logits + table[index.view(-1)].view(T, T, h).permute(2, 0, 1)
    return logits.softmax(-1)


@pytest.mark.parametrize("kind", ["vit", "reg", "beit"])
def test_attention_is_the_real_softmax(kind, images):
    vm = tiny(kind)
    f = vs.extract(vm, images, ["embed", "block0.attn", "block0.out", "block1.attn"])
    torch.testing.assert_close(f["block0.attn"].sum(-1), torch.ones(5, 3, vm.num_tokens), atol=1e-5, rtol=0)
    with torch.no_grad():
        ref0 = _manual_attention(vm, f["embed"], vm.model.blocks[0])
        ref1 = _manual_attention(vm, f["block0.out"], vm.model.blocks[1])
    torch.testing.assert_close(f["block0.attn"], ref0, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(f["block1.attn"], ref1, atol=1e-5, rtol=1e-4)


def test_shared_relative_position_bias_is_in_the_attention(images):
    vm = tiny("beit_shared")
    torch.nn.init.normal_(vm.model.rel_pos_bias.relative_position_bias_table, std=2.0)
    f = vs.extract(vm, images, ["embed", "block0.attn"])
    blk = vm.model.blocks[0]
    with torch.no_grad():
        no_bias = _manual_attention(vm, f["embed"], blk)
        shared = vm.model.rel_pos_bias()
        x = F.layer_norm(f["embed"], (48,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
        a = blk.attn
        qkv = F.linear(x, a.qkv.weight, torch.cat([a.q_bias, torch.zeros_like(a.q_bias), a.v_bias]))
        q, k, _ = qkv.reshape(5, 17, 3, 3, -1).permute(2, 0, 3, 1, 4)
        ref = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + shared).softmax(-1)
    torch.testing.assert_close(f["block0.attn"], ref, atol=1e-5, rtol=1e-4)
    assert (f["block0.attn"] - no_bias).abs().max() > 1e-2  # the bias matters, so the test can fail


def test_logits_unchanged_by_capture_and_by_fused_vs_unfused(any_tiny, images):
    vm = any_tiny
    with torch.no_grad():
        bare_fused = vm.model(images)
    assert any(getattr(b.attn, "fused_attn", False) for b in vm.model.blocks)
    captured = vs.extract(vm, images, vm.taps)["logits"]  # every tap, attention unfused
    # fused SDPA vs the explicit softmax path: same math, different kernels; 1e-5 is float32 noise here
    torch.testing.assert_close(captured, bare_fused, atol=1e-5, rtol=1e-5)
    for b in vm.model.blocks:
        b.attn.fused_attn = False
    with torch.no_grad():
        bare_unfused = vm.model(images)
    torch.testing.assert_close(captured, bare_unfused, atol=0, rtol=0)


def test_one_attention_path_whatever_taps_are_asked_for(images):
    """Every pass runs timm's eager attention in every block (the attn tap needs it; SDPA rounds differently),
    so what a tap holds does not depend on which other taps the pass captures; fused SDPA is restored after."""
    vm = tiny("vit")
    seen = []

    class Spy(vs.Capture):
        def __call__(self, x):
            seen.append([b.attn.fused_attn for b in vm.model.blocks])
            return super().__call__(x)

    with Spy(vm, ["block0.out", "block2.fc1"]) as cap:
        alone = cap(images)["block2.fc1"]
    with Spy(vm, ["block1.attn", "block2.fc1"]) as cap:
        beside = cap(images)["block2.fc1"]
    assert seen == [[False, False, False], [False, False, False]]
    assert all(b.attn.fused_attn for b in vm.model.blocks)
    assert torch.equal(alone, beside)


def test_hooks_removed_after_an_error(images):
    vm = tiny("vit")
    with pytest.raises(vs.InputError):
        with vs.Capture(vm, ["block1.attn", "block2.out"]) as cap:
            cap(images[:, :, :15])  # not a multiple of the patch size
    for m in vm.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(b.attn.fused_attn for b in vm.model.blocks)


def test_early_stop_gives_the_same_values(images):
    vm = tiny("vit")
    early = vs.extract(vm, images, ["block1.out"])["block1.out"]
    full = vs.extract(vm, images, ["block1.out", "logits"])["block1.out"]
    torch.testing.assert_close(early, full, atol=0, rtol=0)


def test_unknown_tap_lists_valid_ones():
    vm = tiny("vit")
    with pytest.raises(vs.UnknownTapError) as e:
        vs.extract(vm, torch.zeros(1, 3, 32, 32), ["block1.atn"])
    assert "block1.attn" in str(e.value) and "vitscope taps" in str(e.value)
    with pytest.raises(vs.UnknownTapError):
        vs.extract(vm, torch.zeros(1, 3, 32, 32), ["block7.out"])


def test_bad_images_give_clear_errors(tmp_path):
    vm = tiny("vit")
    with pytest.raises(vs.InputError, match="multiples of the patch size 8.*got 36x36"):
        vs.extract(vm, torch.zeros(2, 3, 36, 36), ["block0.out"])
    with pytest.raises(vs.InputError, match="NaN"):
        vs.extract(vm, torch.full((1, 3, 32, 32), float("nan")), ["block0.out"])
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(vs.InputError, match="broken.jpg"):
        vs.extract(vm, [str(bad)], ["block0.out"])


def test_images_from_files_use_the_model_preprocessing(tmp_path):
    from PIL import Image

    vm = tiny("vit")
    arr = (torch.rand(40, 50, 3) * 255).to(torch.uint8).numpy()
    p = tmp_path / "x.png"
    Image.fromarray(arr).save(p)
    f = vs.extract(vm, [str(p), Image.fromarray(arr)], ["block0.out"], view="cls")
    assert f["block0.out"].shape == (2, 48)
    torch.testing.assert_close(f["block0.out"][0], f["block0.out"][1])


def test_token_views():
    from vitscope.capture import token_view

    x = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    torch.testing.assert_close(token_view(x, "cls", 2), x[:, 0])
    torch.testing.assert_close(token_view(x, "gap_spatial", 2), x[:, 2:].mean(1))
    torch.testing.assert_close(token_view(x, "gap", 2), x.mean(1))
    assert token_view(x, "spatial", 2).shape == (2, 4, 3)
    with pytest.raises(vs.VitscopeError, match="no CLS"):
        token_view(x, "cls", 0, has_cls=False)


def test_bf16_autocast_is_close_to_fp32(images):
    vm = tiny("vit")
    a = vs.extract(vm, images, ["block2.out"])["block2.out"]
    b = vs.extract(vm, images, ["block2.out"], dtype="bf16")["block2.out"]
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert not torch.equal(a, b)
