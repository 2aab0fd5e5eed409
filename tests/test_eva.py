"""timm's Eva (DINOv3, EVA-02, Perception Encoder, RoPE ViTs): facts, taps against timm's own forward, and the
attention tap against softmax(q k^T * scale) with rotary position embeddings applied by an implementation
written here (complex multiplication of coordinate pairs, RoFormer eq. 13-14), not timm's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitscope as vs
from vitscope.capture import token_view

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)

# kind: (timm name, prefix tokens, has CLS, RoPE pairs (x_j, x_{j+d/2}) instead of (x_{2j}, x_{2j+1}), any_size)
VARIANTS = {
    "dinov3": ("vit_small_patch16_dinov3", 5, True, True, True),  # CLS + 4 storage tokens, no qkv bias
    "dinov3_qkvb": ("vit_small_patch16_dinov3_qkvb", 5, True, True, True),  # q and v biases, k none
    "eva02": ("eva02_tiny_patch14_224", 1, True, False, False),  # fused qkv, packed SwiGLU (GluMlp)
    "eva02_sep": ("eva02_base_patch14_224", 1, True, False, False),  # q_proj/k_proj/v_proj, SwiGLU, inner norms
    "pe": ("vit_pe_core_tiny_patch16_384", 1, True, False, False),  # AttentionRope, pre-norm, attention pool
    "no_cls": ("vit_medium_patch16_rope_reg1_gap_256", 1, False, False, False),  # one register, no CLS
}


def tiny_eva(kind: str) -> vs.ViTModel:
    """A random tiny Eva whose attention is far from uniform (projections and biases re-drawn large), so that
    RoPE and the biases change the probabilities by much more than the tolerances."""
    vm = vs.load_model(VARIANTS[kind][0], pretrained=False, **TINY)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for blk in vm.model.blocks:
            a = blk.attn
            for lin in (a.qkv, a.q_proj, a.k_proj, a.v_proj):
                if lin is not None:
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
                    if lin.bias is not None:
                        lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
            for p in (getattr(a, "q_bias", None), getattr(a, "v_bias", None)):
                if p is not None:
                    p.copy_(torch.randn(p.shape, generator=g))
    return vm


@pytest.fixture(params=list(VARIANTS))
def eva(request):
    return request.param, tiny_eva(request.param)


@pytest.fixture
def images():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_facts(eva):
    kind, vm = eva
    _, npt, cls, _, any_size = VARIANTS[kind]
    assert vm.family == "eva"
    assert (vm.depth, vm.num_heads, vm.embed_dim, vm.patch_size, vm.grid_size) == (2, 3, 48, 8, (4, 4))
    assert vm.num_prefix_tokens == npt == vm.model.num_prefix_tokens
    assert vm.has_cls_token is cls
    assert vm.num_tokens == npt + 16
    assert vm.any_size is any_size
    info = vm.info()
    assert (info.num_prefix_tokens, info.has_cls_token) == (npt, cls)


def test_every_tap_is_captured_with_its_shape(eva, images):
    kind, vm = eva
    f = vs.extract(vm, images, vm.taps)
    assert list(f) == vm.taps
    B, T, D = 3, vm.num_tokens, 48
    hidden = vm.model.blocks[0].mlp.fc2.in_features
    glu = kind.startswith("eva02")
    for i in range(2):
        shapes = {"norm1": (B, T, D), "qkv": (B, T, 3 * D), "attn": (B, 3, T, T), "heads": (B, T, D),
                  "attn_out": (B, T, D), "resid_mid": (B, T, D), "norm2": (B, T, D),
                  "fc1": (B, T, 2 * hidden if glu else hidden), "fc2": (B, T, D), "mlp_out": (B, T, D),
                  "out": (B, T, D)}
        for k, shape in shapes.items():
            assert tuple(f[f"block{i}.{k}"].shape) == shape, f"block{i}.{k}"


def _unfused(model: nn.Module) -> None:
    for m in model.modules():
        if getattr(m, "fused_attn", False):
            m.fused_attn = False


def test_block_outputs_equal_timm_forward_intermediates_bit_for_bit(eva, images):
    kind, vm = eva
    f = vs.extract(vm, images, ["embed", "block0.out", "block1.out", "final_norm", "logits"])
    _unfused(vm.model)  # the capture runs timm's eager attention; the reference must too, for equality
    npt = vm.num_prefix_tokens
    with torch.no_grad():
        inter = vm.model.forward_intermediates(images, indices=[0, 1], output_fmt="NLC", intermediates_only=True,
                                               return_prefix_tokens=npt > 0)
        logits = vm.model(images)
    for i, y in enumerate(inter):
        ref = torch.cat([y[1], y[0]], dim=1) if npt else y
        assert torch.equal(f[f"block{i}.out"], ref), f"block{i}.out"
    assert torch.equal(f["logits"], logits)
    with torch.no_grad():  # the embedding as Eva.forward_features builds it
        x, _ = vm.model._pos_embed(vm.model.patch_embed(images))
        assert torch.equal(f["embed"], vm.model.norm_pre(x))
        assert torch.equal(f["final_norm"], vm.model.norm(f["block1.out"]))


def test_residual_and_branch_identities_hold_exactly(eva, images):
    kind, vm = eva
    f = vs.extract(vm, images, vm.taps)
    prev = f["embed"]
    for i, blk in enumerate(vm.model.blocks):
        p = f"block{i}."
        assert torch.equal(f[p + "resid_mid"], prev + f[p + "attn_out"])
        assert torch.equal(f[p + "out"], f[p + "resid_mid"] + f[p + "mlp_out"])
        with torch.no_grad():
            assert torch.equal(f[p + "norm1"], blk.norm1(prev))
            ref = _qkv_reference(blk.attn, f[p + "norm1"]).float()
            torch.testing.assert_close(f[p + "qkv"], ref, atol=1e-5, rtol=1e-5)
            assert torch.equal(f[p + "norm2"], blk.norm2(f[p + "resid_mid"]))
            # heads = attn @ v per head, from the attn and qkv taps (q, k, v laid out (3, H, d) as a fused qkv)
            B, T, _ = f[p + "qkv"].shape
            v = f[p + "qkv"].reshape(B, T, 3, 3, -1)[:, :, 2].transpose(1, 2)
            heads = (f[p + "attn"] @ v).transpose(1, 2).reshape(B, T, -1)
            torch.testing.assert_close(f[p + "heads"], heads, atol=1e-5, rtol=1e-5)
            # fc2 = the MLP's second linear applied to act(fc1) (a gated MLP: act(gate half) * value half)
            mlp, h = blk.mlp, f[p + "fc1"]
            if isinstance(mlp.act, nn.SiLU) and h.shape[-1] == 2 * mlp.fc2.in_features:
                g, val = h.chunk(2, dim=-1)
                hid = F.silu(g) * val
            else:
                hid = mlp.act(h)
            torch.testing.assert_close(f[p + "fc2"], mlp.fc2(mlp.norm(hid)), atol=1e-5, rtol=1e-5)
        prev = f[p + "out"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool) -> torch.Tensor:
    """RoPE on the last dim of x (…, T, d): each coordinate pair (a, b) read as a + ib and multiplied by
    exp(i theta). Pairs are (x_j, x_{j + d/2}) when ``half``, else (x_{2j}, x_{2j+1}); cos/sin: (T, d/2)."""
    d = x.shape[-1]
    a, b = (x[..., : d // 2], x[..., d // 2:]) if half else (x[..., 0::2], x[..., 1::2])
    z = torch.complex(a.double(), b.double()) * torch.complex(cos.double(), sin.double())
    if half:
        out = torch.cat([z.real, z.imag], dim=-1)
    else:
        out = torch.stack([z.real, z.imag], dim=-1).reshape(x.shape)
    return out


def _angles(vm: vs.ViTModel, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each patch token's rotation angles (T - prefix, d/2), read off the model's RoPE table
    (the model's parameterisation of position, as BEiT's bias table is), with the pair convention checked: a
    table for pairs (x_j, x_{j+d/2}) repeats its halves, one for (x_{2j}, x_{2j+1}) repeats each entry."""
    m = vm.model
    emb = m.rope.get_embed(shape=list(vm.grid_size)) if m.dynamic_img_size else m.rope.get_embed()
    sin, cos = emb.chunk(2, dim=-1)
    d = sin.shape[-1]
    if half:
        assert torch.equal(sin[:, : d // 2], sin[:, d // 2:]) and torch.equal(cos[:, : d // 2], cos[:, d // 2:])
        return cos[:, : d // 2], sin[:, : d // 2]
    assert torch.equal(sin[:, 0::2], sin[:, 1::2]) and torch.equal(cos[:, 0::2], cos[:, 1::2])
    return cos[:, 0::2], sin[:, 0::2]


def _qkv_reference(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """q, k, v side by side (B, T, 3 * D) from the attention input and the module's weights, in float64 (k has
    no bias in Eva: its fused k_bias is a zero buffer, its k_proj has none)."""
    if attn.qkv is not None:
        w = attn.qkv.weight
        bias = attn.qkv.bias
        if getattr(attn, "q_bias", None) is not None:
            bias = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
    else:
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        parts = [attn.q_proj.bias, torch.zeros(attn.k_proj.out_features), attn.v_proj.bias]
        bias = None if attn.q_proj.bias is None else torch.cat(parts)
    return x.double() @ w.double().T + (0 if bias is None else bias.double())


def _attention_reference(vm: vs.ViTModel, x_in: torch.Tensor, blk: nn.Module, half: bool,
                         rope: bool = True) -> torch.Tensor:
    """softmax(q k^T * scale) from the block input and the module's weights, in float64, RoPE on the patch
    tokens' q and k (prefix tokens unrotated)."""
    attn, norm1 = blk.attn, blk.norm1
    assert isinstance(norm1, nn.LayerNorm) and isinstance(attn.q_norm, nn.Identity)
    x = F.layer_norm(x_in.double(), norm1.normalized_shape, norm1.weight.double(), norm1.bias.double(), norm1.eps)
    qkv = _qkv_reference(attn, x)
    B, T, _ = qkv.shape
    q, k, _ = qkv.reshape(B, T, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    if rope:
        npt = vm.num_prefix_tokens
        cos, sin = _angles(vm, half)
        q = torch.cat([q[:, :, :npt], _rotate(q[:, :, npt:], cos, sin, half)], dim=2)
        k = torch.cat([k[:, :, :npt], _rotate(k[:, :, npt:], cos, sin, half)], dim=2)
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return logits.softmax(-1)


def test_attention_is_the_softmax_with_rope_applied(eva, images):
    kind, vm = eva
    half = VARIANTS[kind][3]
    assert all(b.attn.rotate_half is half for b in vm.model.blocks)
    f = vs.extract(vm, images, ["embed", "block0.attn", "block0.out", "block1.attn"])
    for i, x_in in enumerate([f["embed"], f["block0.out"]]):
        a = f[f"block{i}.attn"]
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-6, rtol=0)
        with torch.no_grad():
            ref = _attention_reference(vm, x_in, vm.model.blocks[i], half)
            no_rope = _attention_reference(vm, x_in, vm.model.blocks[i], half, rope=False)
        torch.testing.assert_close(a, ref.float(), atol=1e-6, rtol=0)
        assert (a - no_rope.float()).abs().max() > 1e-2  # the test sees RoPE: without it the maps differ


def test_attention_pairs_convention_matters(images):
    """The other pair convention gives other probabilities: the reference pins the convention down."""
    vm = tiny_eva("dinov3")
    f = vs.extract(vm, images, ["embed", "block0.attn"])
    blk = vm.model.blocks[0]
    with torch.no_grad():
        cos, sin = _angles(vm, half=True)
        # pairs (x_{2j}, x_{2j+1}) with the same angles (DINOv3 has no qkv bias)
        x = F.layer_norm(f["embed"], blk.norm1.normalized_shape, blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
        q, k, _ = blk.attn.qkv(x).reshape(3, vm.num_tokens, 3, 3, -1).permute(2, 0, 3, 1, 4)
        npt = vm.num_prefix_tokens
        q = torch.cat([q[:, :, :npt], _rotate(q[:, :, npt:], cos, sin, False).float()], dim=2)
        k = torch.cat([k[:, :, :npt], _rotate(k[:, :, npt:], cos, sin, False).float()], dim=2)
        other = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1)
    assert (f["block0.attn"] - other).abs().max() > 1e-2


def test_token_views_pick_the_expected_tokens(eva, images):
    kind, vm = eva
    npt, cls = VARIANTS[kind][1], VARIANTS[kind][2]
    x = vs.extract(vm, images, ["block1.out"])["block1.out"]
    assert torch.equal(token_view(x, "spatial", vm.num_prefix_tokens, vm.has_cls_token), x[:, npt:])
    assert torch.equal(token_view(x, "gap_spatial", vm.num_prefix_tokens, vm.has_cls_token), x[:, npt:].mean(1))
    assert torch.equal(token_view(x, "gap", vm.num_prefix_tokens, vm.has_cls_token), x.mean(1))
    if cls:
        assert torch.equal(vs.extract(vm, images, ["block1.out"], view="cls")["block1.out"], x[:, 0])
    else:
        msg = "has no CLS token \\(its 1 prefix token is a register\\); the token views it gives are 'spatial', " \
              "'gap', 'gap_spatial', 'all'"
        with pytest.raises(vs.VitscopeError, match=msg):
            vs.extract(vm, images, ["block1.out"], view="cls")


def test_fused_attention_restored_and_unsized_inputs_refused(images):
    vm = tiny_eva("eva02")
    assert all(b.attn.fused_attn for b in vm.model.blocks)
    vs.extract(vm, images, ["block0.attn"])
    assert all(b.attn.fused_attn for b in vm.model.blocks)
    with pytest.raises(vs.VitscopeError, match="rotary position embedding"):
        vs.extract(vm, torch.randn(1, 3, 48, 48), ["block0.out"])


def test_dinov3_takes_other_input_sizes():
    vm = tiny_eva("dinov3")
    x = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(3))
    f = vs.extract(vm, x, ["block0.attn", "block1.out"])
    assert f["block1.out"].shape == (2, 5 + 6 * 5, 48)
    torch.testing.assert_close(f["block0.attn"].sum(-1), torch.ones(2, 3, 35), atol=1e-6, rtol=0)


def test_post_norm_eva_is_refused():
    with pytest.raises(vs.VitscopeError, match="use_post_norm"):
        vs.load_model("eva02_enormous_patch14_clip_224", pretrained=False, **TINY)


def test_qkv_with_the_bias_added_separately(images):
    """``qkv_bias_separate``: timm adds the bias in place after the projection; the tap holds the sum."""
    vm = tiny_eva("eva02")
    for b in vm.model.blocks:
        b.attn.qkv_bias_separate = True
    f = vs.extract(vm, images, ["block0.norm1", "block0.qkv", "block1.out"])
    a = vm.model.blocks[0].attn
    with torch.no_grad():
        assert torch.equal(f["block0.qkv"], a.qkv(f["block0.norm1"]) + torch.cat((a.q_bias, a.k_bias, a.v_bias)))
        _unfused(vm.model)
        ref = vm.model.forward_intermediates(images, indices=[1], output_fmt="NLC", intermediates_only=True,
                                             return_prefix_tokens=True)[0]
    assert torch.equal(f["block1.out"], torch.cat([ref[1], ref[0]], dim=1))


def test_a_saved_eva_with_registers_loads_back_as_it_was(eva, images, tmp_path):
    """save_checkpoint then load_model(file): the register tokens a ViT state dict implies (reg_tokens) are an Eva's
    num_reg_tokens; the reloaded model computes what the saved one did, bit for bit."""
    _, eva = eva
    path = tmp_path / "eva.safetensors"
    vs.save_checkpoint(eva.model, path, eva.spec)
    back = vs.load_model(str(path))
    assert back.family == "eva" and back.num_prefix_tokens == eva.num_prefix_tokens and back.load_report.ok
    with torch.no_grad():
        assert torch.equal(back.model(images), eva.model(images))
