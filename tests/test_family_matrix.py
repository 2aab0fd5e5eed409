"""Every model family vitscope supports, as tiny random timm models: the taps read what the model computes, and every
registered analysis runs on every family or refuses in one sentence.

Per family other than the Evas (their taps: tests/test_eva.py): each ``block{i}.out`` equals timm's own
``forward_intermediates`` bit for bit; ``block{i}.attn`` equals softmax(q k^T * scale) recomputed here in float64 from
the module's weights (qkv or BEiT's q/v biases, q/k norms, BEiT's relative position bias, its index built here from
the BEiT paper's definition); the prefix tokens are counted from the model's own parameters and the token views pick
the tokens they name; AIMv2's SwiGLU ``fc1`` is the gate half then the value half. Then every analysis (the studies
of test_cost's `CASES`, their models swapped, as tests/test_no_cls.py does for two register models) on every
family, the Evas among them: a table computed from the right tokens, an empty table with a warning that says why,
or a refusal in one sentence."""

import re

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from study_fixtures import run_study_text as run
from study_fixtures import with_models
from test_cost import CASES
from torch import nn

import vitscope as vs
import vitscope.analyses  # noqa: F401 - every analysis registered
from vitscope.analyses.base import ANALYSES
from vitscope.capture import token_view
from vitscope.errors import VitscopeError
from vitscope.study import load_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread is faster

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)  # a 4 x 4 grid for every family

# family: (timm name, kwargs beside TINY, prefix tokens, has a CLS token)
MODELS = {
    "supervised": ("vit_small_patch16_224", {}, 1, True),
    "deit3": ("deit3_base_patch16_224", {}, 1, True),  # layer scale (ls1, ls2)
    "clip": ("vit_base_patch16_clip_quickgelu_224", {}, 1, True),  # pre-norm (norm_pre), QuickGELU
    "dinov2_reg": ("vit_small_patch14_reg4_dinov2", {}, 5, True),  # CLS + 4 registers, no_embed_class
    "siglip": ("vit_base_patch16_siglip_224", {}, 0, False),  # no CLS, MAP attention pool, no classifier head
    "siglip_head": ("vit_base_patch16_siglip_224", {"num_classes": 10}, 0, False),  # the same with a head
    "aimv2": ("aimv2_large_patch14_224", {}, 0, False),  # no CLS, RmsNorm, SwiGLU (fc1_g, fc1_x)
    "ijepa": ("vit_huge_patch14_gap_224", {}, 0, False),  # no CLS, mean pooling
    "beit": ("beit_base_patch16_224", {"init_values": 0.1}, 1, True),  # relative position bias, q/v biases
    "dinov3": ("vit_small_patch16_dinov3", {}, 5, True),  # Eva: RoPE, CLS + 4 storage tokens
    "dinov3_qkvb": ("vit_small_patch16_dinov3_qkvb", {}, 5, True),
    "eva02": ("eva02_tiny_patch14_224", {}, 1, True),  # Eva: SwiGLU (GluMlp)
    "pe": ("vit_pe_core_tiny_patch16_384", {}, 1, True),  # Eva: Perception Encoder, attention pool
}
EVAS = ("dinov3", "dinov3_qkvb", "eva02", "pe")  # tapped by tests/test_eva.py: here in the analysis matrix only
TAPPED = [f for f in MODELS if f not in EVAS and f != "siglip_head"]
# the tap checks also on a ViT with q/k norms (none of the families above has them) and a BEiT whose relative
# position bias is one table shared by every block (the model's rel_pos_bias, passed to each block)
TAP_VARIANTS = {**{f: MODELS[f] for f in TAPPED}, "qk_norm": ("vit_small_patch16_224", {"qk_norm": True}, 1, True),
                "beit_shared": ("beit_base_patch16_224", {"init_values": 0.1, "use_shared_rel_pos_bias": True,
                                                          "use_rel_pos_bias": False}, 1, True)}

# ------------------------------------------------------------------ what each analysis gives each family

CASES_BY_ID = {c.name or c.analysis: c for c in CASES}  # test_cost's studies, by test id

# a model without a CLS token: what an analysis gives where it is not a table computed from other tokens (every other
# analysis computes one, or refuses in one sentence that names the CLS token)
WITHOUT_CLS = {
    # a table without rows (not written), with a warning that the model has no CLS token
    "empty": {"cls_attention_maps"},
    # the rollouts: the row a rollout reads on a model without a CLS token, by the model's ``global_pool`` (its head's
    # own readout: the attention pool's weights, or the patch tokens' mean; analyses/mechanistic/rollout.py)
    "rollout": {"map": "attention pool", "avg": "mean of patch tokens"},
}
ROLLOUTS = ("attention_rollout", "gradient_rollout")
NO_TABLE = {"similarity"}  # a cross-model analysis: one model alone gives no table
# a model without a classifier head (num_classes=0) has no predicted class: an empty table with this warning
EMPTY_WITHOUT_HEAD = {"gradient_rollout": "has no classifier head"}

# the token views an analysis's table holds by default on a model with a CLS token (its documented defaults); on one
# without, the same less 'cls', or the fallback view where 'cls' is the only one
VIEWS_WITH_CLS = {"corruptions": {"cls"}, "band_noise": {"cls"}, "shape_bias": {"cls"},
                  "retrieval": {"cls", "gap_spatial"}, "residual_cka": {"cls", "gap_spatial"}, "cka": {"cls", "gap"},
                  "semantics": {"cls", "gap", "gap_spatial", "object", "part"}}
FALLBACK_VIEW = "gap_spatial"

# (family, analysis) -> a regex the one-sentence refusal matches, where a family cannot take an analysis
REFUSED: dict[tuple[str, str], str] = {}

# (family, case id) -> why the case fails today (a defect of vitscope, reported, not fixed here)
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}

# the default run: every family on the analyses of FAST_ANALYSES (attention maps, block outputs through the head),
# the analyses that treat a model without a CLS token apart on SigLIP (no prefix token at all, an attention-pool
# head) and BEiT (CLS, relative position bias), DINOv2's registers, AIMv2's rollout, SigLIP's head; the whole matrix
# with -m slow
FAST_ANALYSES = {"attention_distance", "logit_lens"}
FAST_ON_TWO = ("cls_attention_maps", "attention_rollout", "gradient_rollout", "saliency_iou", "corruptions",
               "high_norm_tokens")
FAST_CASES = ({(f, a) for f in ("siglip", "beit") for a in FAST_ON_TWO}  # (family, case id)
              | {("aimv2", "attention_rollout"), ("dinov2_reg", "high_norm_tokens"),
                 ("siglip_head", "gradient_rollout")})


# ------------------------------------------------------------------------------------------------ models


def tiny(family: str, redraw: bool = True) -> vs.ViTModel:
    """A random tiny model of ``family``; ``redraw``: its q/k projections, biases and BEiT's relative position bias
    table re-drawn large, so that the attention is far from uniform and a missing term shows well above the
    tolerances."""
    name, extra, _, _ = TAP_VARIANTS.get(family) or MODELS[family]
    vm = vs.load_model(name, pretrained=False, **{**TINY, **extra})
    if not redraw:
        return vm
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        shared = getattr(vm.model, "rel_pos_bias", None)
        if shared is not None:
            shared.relative_position_bias_table.copy_(
                torch.randn(shared.relative_position_bias_table.shape, generator=g))
        for blk in vm.model.blocks:
            a = blk.attn
            a.qkv.weight.copy_(torch.randn(a.qkv.weight.shape, generator=g) * 0.1)
            for p in (a.qkv.bias, getattr(a, "q_bias", None), getattr(a, "v_bias", None),
                      getattr(a, "relative_position_bias_table", None)):
                if p is not None:
                    p.copy_(torch.randn(p.shape, generator=g))
    return vm


@pytest.fixture(params=list(TAP_VARIANTS))
def family(request):
    return request.param, tiny(request.param)


@pytest.fixture
def images():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _unfused(model: nn.Module) -> None:
    for m in model.modules():
        if getattr(m, "fused_attn", False):
            m.fused_attn = False


def prefix_count(model: nn.Module) -> tuple[int, bool]:
    """(prefix tokens, has a CLS token), counted from the model's own token parameters."""
    cls = getattr(model, "cls_token", None)
    reg = getattr(model, "reg_token", None)
    dist = getattr(model, "dist_token", None)
    n = sum(int(t.shape[1]) for t in (cls, reg, dist) if t is not None)
    return n, cls is not None


def test_the_matrix_covers_every_registered_analysis():
    assert {c.analysis for c in CASES} == set(ANALYSES)
    named = WITHOUT_CLS["empty"] | set(ROLLOUTS) | NO_TABLE | set(EMPTY_WITHOUT_HEAD) | set(VIEWS_WITH_CLS)
    assert named <= set(ANALYSES) and FAST_ANALYSES <= set(ANALYSES)
    assert {f for f, _ in FAST_CASES} <= set(MODELS) and {a for _, a in FAST_CASES} <= set(CASES_BY_ID)
    assert {f for f, _ in REFUSED} | {f for f, _ in KNOWN_DEFECTS} <= set(MODELS)


# --------------------------------------------------------------------------------------- taps, per family


def test_facts_and_prefix_tokens_counted_from_the_model(family, images):
    kind, vm = family
    _, _, npt, cls = TAP_VARIANTS[kind]
    m = vm.model
    count, has_cls = prefix_count(m)
    assert (count, has_cls) == (npt, cls)
    assert (vm.num_prefix_tokens, vm.has_cls_token) == (npt, cls)
    assert (vm.depth, vm.num_heads, vm.embed_dim, vm.patch_size, vm.grid_size) == (2, 3, 48, 8, (4, 4))
    pos = getattr(m, "pos_embed", None)
    if pos is not None:  # position embeddings for the patches, and for the prefix tokens unless no_embed_class
        assert pos.shape[1] == 16 + (0 if getattr(m, "no_embed_class", False) else npt)
    x = vs.extract(vm, images, ["block1.out"])["block1.out"]
    assert x.shape == (3, npt + 16, 48)  # the sequence holds exactly the counted prefix tokens and the grid
    info = vm.info()
    assert (info.num_prefix_tokens, info.has_cls_token) == (npt, cls)


def test_token_views_pick_the_expected_tokens(family, images):
    kind, vm = family
    _, _, npt, cls = TAP_VARIANTS[kind]
    f = vs.extract(vm, images, ["embed", "block1.out"])
    x = f["block1.out"]
    p, c = vm.num_prefix_tokens, vm.has_cls_token
    assert torch.equal(token_view(x, "spatial", p, c), x[:, -16:])
    assert torch.equal(token_view(x, "gap_spatial", p, c), x[:, -16:].mean(1))
    assert torch.equal(token_view(x, "gap", p, c), x.mean(1))
    assert torch.equal(token_view(x, "all", p, c), x)
    assert torch.equal(vs.extract(vm, images, ["block1.out"], view="spatial")["block1.out"], x[:, -16:])
    # the mean taken per batch as the tap arrives: the same tokens, the sum perhaps in another order
    torch.testing.assert_close(vs.extract(vm, images, ["block1.out"], view="gap_spatial")["block1.out"],
                               x[:, -16:].mean(1), atol=1e-6, rtol=0)
    m = vm.model
    if cls:
        assert torch.equal(vs.extract(vm, images, ["block1.out"], view="cls")["block1.out"], x[:, 0])
        # token 0 is the CLS token: at the embedding it is the model's cls_token parameter (plus its position
        # embedding where it has one, through the pre-norm where there is one)
        tok = m.cls_token[0, 0]
        pos = getattr(m, "pos_embed", None)
        if pos is not None and not getattr(m, "no_embed_class", False):
            tok = tok + pos[0, 0]
        norm_pre = getattr(m, "norm_pre", nn.Identity())
        with torch.no_grad():
            ref = norm_pre(tok.expand(3, 1, -1))[:, 0]
        torch.testing.assert_close(f["embed"][:, 0], ref, atol=1e-6, rtol=0)
    else:
        with pytest.raises(VitscopeError, match="no CLS token") as e:
            vs.extract(vm, images, ["block1.out"], view="cls")
        assert "\n" not in str(e.value)
        with pytest.raises(VitscopeError, match="no CLS token"):
            token_view(x, "cls", p, c)
    if getattr(m, "reg_token", None) is not None:  # the registers follow the CLS token
        r = m.reg_token.shape[1]
        assert int(cls) + r == npt
        tok = m.reg_token[0]
        norm_pre = getattr(m, "norm_pre", nn.Identity())
        with torch.no_grad():
            ref = norm_pre(tok.expand(3, r, -1))
        if getattr(m, "no_embed_class", False):
            torch.testing.assert_close(f["embed"][:, int(cls):npt], ref, atol=1e-6, rtol=0)


def test_block_outputs_equal_timm_forward_intermediates_bit_for_bit(family, images):
    kind, vm = family
    f = vs.extract(vm, images, ["block0.out", "block1.out", "logits"])
    _unfused(vm.model)  # the capture runs timm's eager attention; the reference must too, for equality
    npt = TAP_VARIANTS[kind][2]
    with torch.no_grad():
        inter = vm.model.forward_intermediates(images, indices=[0, 1], output_fmt="NLC", intermediates_only=True,
                                               return_prefix_tokens=npt > 0)
        logits = vm.model(images)
    assert len(inter) == 2
    for i, y in enumerate(inter):
        ref = torch.cat([y[1], y[0]], dim=1) if npt else y
        assert ref.shape == (3, npt + 16, 48)
        assert torch.equal(f[f"block{i}.out"], ref), f"block{i}.out"
    assert torch.equal(f["logits"], logits)


def _norm64(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm`` (a LayerNorm, an RMSNorm or an Identity) applied to ``x`` in float64, written out here."""
    x = x.double()
    if isinstance(norm, nn.Identity):
        return x
    w = norm.weight.double()
    if isinstance(norm, nn.LayerNorm):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + norm.eps) * w
        return y + norm.bias.double() if norm.bias is not None else y
    assert type(norm).__name__ == "RmsNorm", type(norm)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * w


def _beit_relative_bias(module: nn.Module, grid: tuple[int, int]) -> torch.Tensor:
    """(heads, T, T): BEiT's relative position bias for a CLS token and an h x w grid, from the table of ``module`` (a
    block's attention, or the model's shared ``rel_pos_bias``).
    Index of patch pair (p, q) at rows/cols (i1, j1), (i2, j2): (i1 - i2 + h - 1) * (2w - 1) + (j1 - j2 + w - 1);
    the three last entries: CLS to a patch, a patch to CLS, CLS to CLS."""
    h, w = grid
    n = (2 * h - 1) * (2 * w - 1)
    table = module.relative_position_bias_table.double()
    assert table.shape[0] == n + 3
    coords = [(i, j) for i in range(h) for j in range(w)]
    idx = torch.empty(h * w + 1, h * w + 1, dtype=torch.long)
    idx[0, :] = n
    idx[:, 0] = n + 1
    idx[0, 0] = n + 2
    for p, (i1, j1) in enumerate(coords):
        for q, (i2, j2) in enumerate(coords):
            idx[p + 1, q + 1] = (i1 - i2 + h - 1) * (2 * w - 1) + (j1 - j2 + w - 1)
    return table[idx].permute(2, 0, 1)


def _attention_reference(vm: vs.ViTModel, blk: nn.Module, x_in: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """softmax(q k^T * head_dim^-0.5 [+ BEiT's relative bias]) from the block input and the module's weights, in
    float64; ``bias``: BEiT's relative position bias added (the block's own table, or the model's shared one)."""
    attn = blk.attn
    x = _norm64(blk.norm1, x_in)
    w = attn.qkv.weight.double()
    if getattr(attn, "q_bias", None) is not None:  # BEiT: q and v biases, k none
        b = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias]).double()
    else:
        b = attn.qkv.bias.double() if attn.qkv.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    qkv = x @ w.T + b
    B, T, _ = qkv.shape
    H = vm.num_heads
    q, k, _ = qkv.reshape(B, T, 3, H, -1).permute(2, 0, 3, 1, 4)
    q = _norm64(getattr(attn, "q_norm", nn.Identity()), q)  # BEiT's attention has no q/k norms
    k = _norm64(getattr(attn, "k_norm", nn.Identity()), k)
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    shared = getattr(vm.model, "rel_pos_bias", None)
    for table in (attn, shared):
        if bias and getattr(table, "relative_position_bias_table", None) is not None:
            logits = logits + _beit_relative_bias(table, vm.grid_size)
    return logits.softmax(-1)


def test_attention_is_the_softmax_of_the_module_s_own_q_and_k(family, images):
    kind, vm = family
    f = vs.extract(vm, images, ["embed", "block0.attn", "block0.out", "block1.attn"])
    T = vm.num_tokens
    for i, x_in in enumerate([f["embed"], f["block0.out"]]):
        a = f[f"block{i}.attn"]
        assert a.shape == (3, 3, T, T)
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-6, rtol=0)
        with torch.no_grad():
            ref = _attention_reference(vm, vm.model.blocks[i], x_in)
        torch.testing.assert_close(a, ref.float(), atol=1e-6, rtol=0)
        assert (ref.max(-1).values > 2.0 / T).any()  # far from uniform: a wrong term would show
        if kind.startswith("beit"):  # the test sees the relative position bias: without it the maps differ
            with torch.no_grad():
                no_bias = _attention_reference(vm, vm.model.blocks[i], x_in, bias=False)
            assert (a - no_bias.float()).abs().max() > 1e-2


def test_residual_and_branch_identities_hold(family, images):
    """The residual stream is the sum of its branches exactly, and ``heads`` is attn @ v from the attn and qkv taps
    (after layer scale, QuickGELU, SwiGLU, RMSNorm, BEiT's gammas and bare q/v biases alike)."""
    kind, vm = family
    taps = ["embed", "final_norm"] + [f"block{i}.{t}" for i in range(2) for t in
                                      ("norm1", "qkv", "attn", "heads", "attn_out", "resid_mid", "norm2", "mlp_out",
                                       "out")]
    f = vs.extract(vm, images, taps)
    prev = f["embed"]
    for i, blk in enumerate(vm.model.blocks):
        p = f"block{i}."
        assert torch.equal(f[p + "resid_mid"], prev + f[p + "attn_out"])
        assert torch.equal(f[p + "out"], f[p + "resid_mid"] + f[p + "mlp_out"])
        B, T, _ = f[p + "qkv"].shape
        v = f[p + "qkv"].reshape(B, T, 3, vm.num_heads, -1)[:, :, 2].transpose(1, 2)
        heads = (f[p + "attn"] @ v).transpose(1, 2).reshape(B, T, -1)
        torch.testing.assert_close(f[p + "heads"], heads, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(f[p + "norm1"], _norm64(blk.norm1, prev).float(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(f[p + "norm2"], _norm64(blk.norm2, f[p + "resid_mid"]).float(), atol=1e-5,
                                       rtol=1e-5)
        prev = f[p + "out"]
    with torch.no_grad():
        assert torch.equal(f["final_norm"], vm.model.norm(prev))


def test_swiglu_fc1_is_the_gate_half_then_the_value_half(images):
    vm = tiny("aimv2")
    assert type(vm.model.blocks[0].mlp).__name__ == "SwiGLU"
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the MLP re-drawn large, so that its output shows the order of the halves
        for blk in vm.model.blocks:
            for lin in (blk.mlp.fc1_g, blk.mlp.fc1_x, blk.mlp.fc2):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
    taps = [f"block{i}.{t}" for i in range(2) for t in ("norm2", "fc1", "fc2")]
    f = vs.extract(vm, images, taps)
    for i, blk in enumerate(vm.model.blocks):
        mlp, x = blk.mlp, f[f"block{i}.norm2"].double()
        hidden = mlp.fc2.in_features
        gate = x @ mlp.fc1_g.weight.double().T + (0 if mlp.fc1_g.bias is None else mlp.fc1_g.bias.double())
        value = x @ mlp.fc1_x.weight.double().T + (0 if mlp.fc1_x.bias is None else mlp.fc1_x.bias.double())
        h = f[f"block{i}.fc1"]
        assert h.shape == (3, vm.num_tokens, 2 * hidden)
        torch.testing.assert_close(h, torch.cat([gate, value], -1).float(), atol=1e-5, rtol=1e-5)
        # and fc2 reads silu(gate) * value: the halves are in that order
        with torch.no_grad():
            g, v = h.double().chunk(2, -1)
            ref = mlp.fc2(mlp.norm((F.silu(g) * v).float()))
            swapped = mlp.fc2(mlp.norm((F.silu(v) * g).float()))
        torch.testing.assert_close(f[f"block{i}.fc2"], ref, atol=1e-5, rtol=1e-5)
        assert (f[f"block{i}.fc2"] - swapped).abs().max() > 1e-3


@pytest.mark.parametrize("fam", list(MODELS))
def test_the_dry_run_sizes_every_tap_and_counts_the_forwards_of_every_family(fam, tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from vitscope.study import cost

    vm = tiny(fam, redraw=False)
    f = vs.extract(vm, torch.randn(1, 3, 32, 32), vm.taps)
    for t in vm.taps:  # one image's numbers, as captured (pool and pool_attn included where the model has them)
        assert cost.tap_elements(vm, t) == f[t][0].numel(), t
    if vm.family != "eva":  # the blocks' matrix products as torch counts them (an Eva's blocks need its RoPE)
        x = f["embed"]
        for block in vm.model.blocks:  # the eager path: torch's counter does not count the CPU's fused attention
            block.attn.fused_attn = False
        with FlopCounterMode(display=False) as counted, torch.no_grad():
            for block in vm.model.blocks:
                x = block(x)
        assert cost.forward_flops(vm) == counted.get_total_flops()
    assert cost.forward_flops(vm) > 0
    study = family_study(CASES_BY_ID["attention_distance"].study, fam)
    (tmp_path / "study.yaml").write_text(study)
    cfg = load_config(tmp_path / "study.yaml", [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    est = cost.dry_run(cfg)
    assert est.forwards == 2 and est.flops > 0  # 8 images in batches of 4
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ every analysis on every family


def family_study(text: str, family: str) -> str:
    """test_cost's study ``text`` with its tiny ViTs made tiny models of ``family``."""
    name, extra, _, _ = MODELS[family]
    return with_models(text, name, extra)


def _text_values(df: pd.DataFrame) -> dict[str, set[str]]:
    """The values of each text column (not numbers, not bytes such as stored images)."""
    out = {}
    for col in df.columns:
        if pd.api.types.is_numeric_dtype(df[col]) or col in ("model", "model_key", "model_b"):
            continue
        vals = df[col].dropna()
        if vals.map(lambda v: isinstance(v, bytes | bytearray)).any():
            continue
        out[col] = set(vals.astype(str))
    return out


def _params():
    out = []
    for fam in MODELS:
        for c in CASES:
            cid = c.name or c.analysis
            marks = []
            if c.analysis not in FAST_ANALYSES and (fam, cid) not in FAST_CASES:
                marks.append(pytest.mark.slow)
            if (fam, cid) in KNOWN_DEFECTS:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_DEFECTS[(fam, cid)]))
            out.append(pytest.param(c, fam, id=f"{cid}-{fam}", marks=marks))
    return out


def has_head(fam: str) -> bool:
    """Whether the family's tiny model has a classifier head (a linear layer to its classes), read off the model."""
    name, extra, _, _ = MODELS[fam]
    vm = vs.load_model(name, pretrained=False, **{**TINY, **extra})
    head = vm.model.get_classifier()
    return isinstance(head, nn.Linear) and head.out_features > 0


@pytest.mark.parametrize("case, fam", _params())
def test_every_analysis_runs_on_every_family_or_refuses_in_one_sentence(case, fam, tmp_path):
    name = case.analysis
    _, _, npt, cls = MODELS[fam]
    try:
        tables, said = run(tmp_path, family_study(case.study, fam))
    except VitscopeError as e:  # a refusal: one sentence that says why
        msg = str(e)
        assert "\n" not in msg, msg
        if (fam, name) in REFUSED:
            assert re.search(REFUSED[(fam, name)], msg), msg
        else:
            assert not cls and "CLS" in msg, msg  # only the lack of a CLS token may stop an analysis
        return
    assert (fam, name) not in REFUSED, f"{name} ran on {fam}, which it was expected to refuse"
    if name in NO_TABLE:
        assert name not in tables
        return
    no_cls_said = [s for s in said if "has no CLS token" in s]
    if cls:
        assert not no_cls_said, no_cls_said
    rollout_empty = name in ROLLOUTS and WITHOUT_CLS["rollout"] == "empty"
    if not cls and (name in WITHOUT_CLS["empty"] or rollout_empty):  # an empty table is not written
        assert tables.get(name, pd.DataFrame()).empty and no_cls_said, said
        return
    if name in EMPTY_WITHOUT_HEAD and not has_head(fam):
        assert tables.get(name, pd.DataFrame()).empty, tables[name]
        assert any(EMPTY_WITHOUT_HEAD[name] in s for s in said), said
        return
    df = tables[name]
    assert not df.empty
    text = _text_values(df)
    metrics = {str(m).lower() for m in df.metric.unique()}
    views = set(df.token_view.dropna()) if "token_view" in df else set()
    if not cls:
        for col, vals in text.items():  # no 'cls' token view, query or readout anywhere in the table
            assert "cls" not in vals, (col, sorted(vals))
        assert not any("cls" in m for m in metrics)  # no CLS attention metric
    if name in VIEWS_WITH_CLS:
        expected = VIEWS_WITH_CLS[name] if cls else (VIEWS_WITH_CLS[name] - {"cls"} or {FALLBACK_VIEW})
        assert views == expected, views
    if name == "saliency_iou":  # the CLS query where there is a CLS token; the mean query always
        assert set(df["query"]) == ({"cls", "mean"} if cls else {"mean"})
        assert any("query 'cls' is skipped" in s for s in said) is not cls, said
    if name == "high_norm_tokens":  # registers: the prefix tokens other than the CLS token, reported apart
        assert ("register" in views) is (npt > int(cls)), views
    if name in ROLLOUTS:  # the row rolled out: the CLS token's, else what the model's head reads
        assert set(df["query"]) == {"cls" if cls else WITHOUT_CLS["rollout"][global_pool(fam)]}
    if name == "logit_lens":  # the model's own head where it has one, else a probe on the last block
        expected = {"head"} if has_head(fam) else {"probe fitted on block 1"}
        assert set(df.readout) == expected, set(df.readout)
        if expected == {"head"}:  # the last block read as the model reads it: the model's own prediction
            last = df[df.layer == 1].set_index("metric").value
            assert last["kl_to_final"] == pytest.approx(0, abs=1e-9)
            assert last["agreement_with_final"] == 1


def global_pool(fam: str) -> str:
    """The family's ``global_pool`` (how its head reads the tokens), read off the model."""
    name, extra, _, _ = MODELS[fam]
    return vs.load_model(name, pretrained=False, **{**TINY, **extra}).model.global_pool
