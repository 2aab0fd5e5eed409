"""DINOv3's and open_clip's own checkpoint layouts: files written under the official key names (open_clip's by
open_clip itself, DINOv3's renamed here from the official repository's module names) load into timm models
whose every block output and final output equal the original's."""

import pytest
import timm
import torch

import vitscope as vs
from vitscope.models.checkpoints import infer_architecture
from vitscope.models.layouts import convert, detect_format

CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _perturb(module, seed):
    """Every parameter moved off its init (LayerNorm weights away from 1, biases away from 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module.eval()


def _one_sentence(e):
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def _block_outputs(blocks, run):
    """Outputs of each module in ``blocks`` while ``run()`` executes, batch first."""
    outs, hooks = [], [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in blocks]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return outs, result


# --------------------------------------------------------------------------------------------------
# open_clip

def _clip(quick_gelu, width=128, head_width=64, seed=0, **vision):
    open_clip = pytest.importorskip("open_clip")
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(seed)
    model = open_clip.model.CLIP(
        embed_dim=32, quick_gelu=quick_gelu,
        vision_cfg=CLIPVisionCfg(layers=2, width=width, head_width=head_width, patch_size=8, image_size=32, **vision),
        text_cfg=CLIPTextCfg(context_length=8, vocab_size=50, width=32, heads=2, layers=1))
    return _perturb(model, seed + 1)


def _compare_clip(clip, vm, x):
    blocks = clip.visual.transformer.resblocks
    outs, want = _block_outputs(blocks, lambda: clip.encode_image(x))
    got = vs.extract(vm, x, [f"block{i}.out" for i in range(len(blocks))] + ["logits"])
    for i, o in enumerate(outs):
        o = o if o.shape[0] == x.shape[0] else o.transpose(0, 1)  # open_clip blocks may run sequence first
        torch.testing.assert_close(got[f"block{i}.out"], o, **CLOSE)
    torch.testing.assert_close(got["logits"], want, **CLOSE)
    with torch.no_grad():
        torch.testing.assert_close(vm.model(x), want, **CLOSE)


@pytest.mark.parametrize("quick_gelu", [True, False])
def test_open_clip_state_dict_loads_the_image_tower(tmp_path, quick_gelu):
    clip = _clip(quick_gelu)
    sd = clip.state_dict()
    path = tmp_path / "open_clip.pt"
    torch.save(sd, path)
    assert detect_format(torch.load(path, weights_only=True)) == "open_clip"
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    act = {"act_layer": "quick_gelu"} if quick_gelu else {}  # the file cannot say; GELU is the default here
    vm = vs.load_model(path, **act)
    _compare_clip(clip, vm, x)
    report = vm.load_report
    assert report.ok and report.format == "open_clip"
    assert set(report.loaded) == set(vm.model.state_dict())
    text = [k for k in sd if not k.startswith("visual.")]
    assert text and {k: report.dropped.get(k) for k in text} == {k: "text tower" for k in text}
    assert not [k for k in sd if k.startswith("visual.") and k in report.dropped]
    name = "QuickGELU" if quick_gelu else "GELU"
    assert any(n.startswith(f"activation {name} ") for n in report.notes), report.notes
    assert any("head.bias" in n for n in report.notes)
    assert "act_layer=" in vm.spec.notes
    # fed as open_clip feeds its ViTs (OpenAI's mean and std), not with ImageNet's
    assert vm.preprocessing.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert vm.preprocessing.std == pytest.approx((0.26862954, 0.26130258, 0.27577711))


def test_open_clip_activation_is_the_callers_choice(tmp_path):
    clip = _clip(quick_gelu=True, seed=3)
    path = tmp_path / "quickgelu.pt"
    torch.save(clip.state_dict(), path)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = clip.encode_image(x)
        wrong = vs.load_model(path).model(x)
    assert not torch.allclose(wrong, want, **CLOSE)  # GELU where the tower used QuickGELU: other numbers
    # the timm name decides when given with weights=
    vm = vs.load_model("vit_base_patch16_clip_quickgelu_224", weights=path, img_size=32, patch_size=8,
                       embed_dim=128, depth=2, num_heads=2, num_classes=32)
    _compare_clip(clip, vm, x)
    assert any(n.startswith("activation QuickGELU") for n in vm.load_report.notes)
    vm = vs.load_model("clip-b16", weights=path, img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2)
    _compare_clip(clip, vm, x)  # vitscope's OpenAI CLIP entry with the file


def test_open_clip_heads_other_than_64_wide_need_num_heads(tmp_path):
    clip = _clip(quick_gelu=False, width=64, head_width=32, seed=7)  # 2 heads of 32
    path = tmp_path / "narrow_heads.pt"
    torch.save({"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in clip.state_dict().items()}},
               path)  # an open_clip training checkpoint
    vm = vs.load_model(path, num_heads=2)
    assert vm.num_heads == 2
    _compare_clip(clip, vm, torch.randn(1, 3, 32, 32))


def test_open_clip_default_activation_follows_openai_shapes():
    pytest.importorskip("open_clip")
    from open_clip.model import CLIPVisionCfg, _build_vision_tower

    def arch(**cfg):
        with torch.device("meta"):
            tower = _build_vision_tower(512, CLIPVisionCfg(**cfg))
        sd = {f"visual.{k}": v for k, v in tower.state_dict().items()}
        return infer_architecture(convert(sd).state_dict, "open_clip")

    name, kw, notes = arch(layers=12, width=768, patch_size=16, image_size=224)  # OpenAI's ViT-B/16
    assert (name, kw["act_layer"], kw["embed_dim"], kw["depth"], kw["img_size"]) == \
        ("vit_base_patch16_clip_224", "quick_gelu", 768, 12, 224)
    assert "ViT-B/16" in notes[0] and "quick_gelu" in notes[0]
    _, kw, notes = arch(layers=12, width=768, patch_size=16, image_size=256)  # not an OpenAI shape
    assert kw["act_layer"] == "gelu" and "not the shape" in notes[0]


def test_open_clip_resnet_and_text_only_files_are_refused(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    rn = open_clip.model.CLIP(embed_dim=32, vision_cfg=CLIPVisionCfg(layers=(1, 1, 1, 1), width=8, head_width=8,
                                                                     image_size=64),
                              text_cfg=CLIPTextCfg(context_length=8, vocab_size=50, width=32, heads=2, layers=1))
    sd = rn.state_dict()
    torch.save(sd, tmp_path / "rn.pt")
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(tmp_path / "rn.pt")
    msg = _one_sentence(e)
    assert "ResNet" in msg and "visual.layer1" in msg and "visual.attnpool" in msg

    torch.save({k: v for k, v in sd.items() if not k.startswith("visual.")}, tmp_path / "text.pt")
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(tmp_path / "text.pt")
    msg = _one_sentence(e)
    assert "only a text tower" in msg and "token_embedding" in msg


# --------------------------------------------------------------------------------------------------
# DINOv3

def _eva(arch, embed_dim=64, num_heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = timm.create_model(arch, pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=embed_dim,
                          num_heads=num_heads, num_classes=0, global_pool="token", **kw)
    return _perturb(m, seed + 1)


def _official_names(model, k_bias=0.0, local_cls_norm=False, periods_dtype=torch.float32, base=100.0):
    """The Eva's weights under facebookresearch/dinov3's names (DinoVisionTransformer: cls_token, storage_tokens,
    mask_token, patch_embed.proj, rope_embed.periods, blocks.N.{norm1, attn.qkv (+ bias_mask), attn.proj, ls1,
    norm2, mlp.fc1/fc2 or SwiGLU w1/w2/w3, ls2}, norm), written here from those names, not by vitscope."""
    sd = model.state_dict()
    dim = model.embed_dim
    swiglu = any(".mlp.fc1_g." in k for k in sd)
    out = {}
    for k, v in sd.items():
        if k == "reg_token":
            out["storage_tokens"] = v
        elif k.endswith((".attn.q_bias", ".attn.v_bias")):
            continue  # below, as one qkv.bias
        elif k.endswith(".gamma_1") or k.endswith(".gamma_2"):
            out[k.replace(".gamma_", ".ls") + ".gamma"] = v
        elif swiglu and ".mlp." in k:
            layer = {"fc1_g": "w1", "fc1_x": "w2", "fc2": "w3"}[k.split(".mlp.")[1].split(".")[0]]
            out[k.split(".mlp.")[0] + f".mlp.{layer}." + k.rsplit(".", 1)[1]] = v
        else:
            out[k] = v
    g = torch.Generator().manual_seed(11)
    for i in range(len(model.blocks)):
        q = sd.get(f"blocks.{i}.attn.q_bias", torch.zeros(dim))
        v = sd.get(f"blocks.{i}.attn.v_bias", torch.zeros(dim))
        out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([q, k_bias * torch.randn(dim, generator=g), v])
        out[f"blocks.{i}.attn.qkv.bias_mask"] = torch.cat([torch.ones(dim), torch.zeros(dim), torch.ones(dim)])
    out["mask_token"] = torch.randn(1, dim, generator=g)
    head_dim = dim // model.blocks[0].attn.num_heads
    out["rope_embed.periods"] = (base ** (2 * torch.arange(head_dim // 4) / (head_dim // 2))).to(periods_dtype)
    if local_cls_norm:
        out["local_cls_norm.weight"], out["local_cls_norm.bias"] = torch.randn(dim), torch.randn(dim)
    return out


def _compare_eva(eva, vm, x):
    outs, want = _block_outputs(eva.blocks, lambda: eva(x))
    got = vs.extract(vm, x, [f"block{i}.out" for i in range(len(eva.blocks))] + ["logits"])
    for i, o in enumerate(outs):
        torch.testing.assert_close(got[f"block{i}.out"], o, **CLOSE)
    torch.testing.assert_close(got["logits"], want, **CLOSE)


CASES = {
    "vit_small_patch16_dinov3": {},  # zero qkv bias in the file, masked k bias: built without qkv bias
    "vit_small_patch16_dinov3_qkvb": {"k_bias": 1.0, "local_cls_norm": True},
    "vit_small_plus_patch16_dinov3": {"k_bias": 1.0, "periods_dtype": torch.bfloat16},  # SwiGLU
}


@pytest.mark.parametrize("arch", list(CASES))
def test_dinov3_official_checkpoint_loads_into_eva(tmp_path, arch):
    eva = _eva(arch, mlp_ratio=2.5) if "plus" in arch else _eva(arch)
    sd = _official_names(eva, **CASES[arch])
    path = tmp_path / "dinov3_official.pth"
    torch.save(sd, path)
    assert detect_format(torch.load(path, weights_only=True)) == "dinov3"
    vm = vs.load_model(path)  # the architecture read off the tensors
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    _compare_eva(eva, vm, x)
    assert vm.num_heads == 2  # from the RoPE periods: 32-wide heads, where embed_dim / 64 says 1
    assert vm.num_prefix_tokens == 5
    assert ("q_bias" in dict(vm.model.blocks[0].attn.named_parameters())) == ("qkvb" in arch)
    assert ("fc1_g" in dict(vm.model.blocks[0].mlp.named_children())) == ("plus" in arch)
    report = vm.load_report
    assert report.ok and set(report.loaded) == set(vm.model.state_dict())
    dropped = report.dropped
    assert {"mask_token", "rope_embed.periods", "blocks.0.attn.qkv.bias_mask", "blocks.1.attn.qkv.bias (k third)"} \
        <= set(dropped)
    assert "pretraining" in dropped["mask_token"] and "recomputed" in dropped["rope_embed.periods"]
    if CASES[arch].get("local_cls_norm"):
        assert "local_cls_norm.weight" in dropped
    if "qkvb" not in arch and "plus" not in arch:
        assert "all zero" in dropped["blocks.0.attn.q_bias"]
    # the timm name given, with weights=: same numbers
    vm2 = vs.load_model(arch, weights=path, img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2,
                        **({"mlp_ratio": 2.5} if "plus" in arch else {}))
    _compare_eva(eva, vm2, x)


def test_dinov3_bad_files_are_refused_in_one_sentence(tmp_path):
    eva = _eva("vit_small_patch16_dinov3_qkvb", seed=4)
    sd = _official_names(eva)
    broken = {k: v for k, v in sd.items() if k != "blocks.1.attn.qkv.weight"}
    torch.save(broken, tmp_path / "missing.pth")
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(tmp_path / "missing.pth")
    assert "blocks.1.attn.qkv.weight" in _one_sentence(e)

    unmasked = {k: v for k, v in _official_names(eva, k_bias=1.0).items() if not k.endswith("bias_mask")}
    torch.save(unmasked, tmp_path / "k_bias.pth")
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(tmp_path / "k_bias.pth")
    assert "k bias" in _one_sentence(e)

    torch.save(_official_names(eva, base=1000.0), tmp_path / "periods.pth")
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(tmp_path / "periods.pth")
    assert "rope_embed.periods" in _one_sentence(e)

    torch.save({**sd, "cls_norm.weight": torch.ones(64), "cls_norm.bias": torch.zeros(64)}, tmp_path / "untied.pth")
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(tmp_path / "untied.pth")
    assert "cls_norm.weight" in _one_sentence(e)


def test_dinov3_training_file_teacher_backbone(tmp_path):
    teacher, student = _eva("vit_small_patch16_dinov3_qkvb", seed=8), _eva("vit_small_patch16_dinov3_qkvb", seed=9)
    heads = {"dino_head.mlp.0.weight": torch.randn(16, 64), "ibot_head.mlp.0.weight": torch.randn(16, 64)}
    ckpt = {"teacher": {**{f"backbone.{k}": v for k, v in _official_names(teacher).items()}, **heads},
            "student": {**{f"backbone.{k}": v for k, v in _official_names(student).items()}, **heads},
            "iteration": torch.tensor(10)}
    torch.save(ckpt, tmp_path / "training.pth")
    assert detect_format(torch.load(tmp_path / "training.pth", weights_only=True)) == "dinov3"
    x = torch.randn(1, 3, 32, 32)
    vm = vs.load_model(tmp_path / "training.pth")
    _compare_eva(teacher, vm, x)
    assert "DINOv3 student" in vm.load_report.dropped["student"]
    assert "training head" in vm.load_report.dropped["dino_head.mlp.0.weight"]
    _compare_eva(student, vs.load_model(tmp_path / "training.pth", checkpoint_key="student"), x)


def test_a_torchscript_archive_is_refused_in_one_sentence_without_loading_it(tmp_path, monkeypatch):
    """OpenAI's original CLIP .pt files are TorchScript archives: refused before torch reads them (no torch.jit.load,
    which would build the archive's code), in one sentence saying what to pass instead."""
    path = tmp_path / "ViT-B-16.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("the archive was loaded"))
    with pytest.raises(vs.errors.CheckpointError) as e:
        vs.load_model(str(path))
    assert "TorchScript archive" in str(e.value) and "open_clip_pytorch_model.bin" in str(e.value)
    assert "\n" not in str(e.value)
