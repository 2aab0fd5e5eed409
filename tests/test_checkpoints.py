"""Official checkpoint layouts, written by the test from a random model, must load every weight."""

import argparse

import pytest
import torch

import vitscope as vs
from conftest import TINY, tiny
from vitscope.models.layouts import detect_format


def _random_like(sd, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()) for k, v in sd.items()}


def _source(kind="vit", seed=1, **kw):
    """A state dict with random values everywhere (so nothing can match an init by chance)."""
    return _random_like(tiny(kind, **kw).model.state_dict(), seed)


def _assert_loaded(vm, src):
    own = vm.model.state_dict()
    assert set(own) == set(src), f"missing {set(own) - set(src)}, extra {set(src) - set(own)}"
    for k, v in src.items():
        assert torch.equal(own[k], v), k
    assert vm.load_report is not None and vm.load_report.ok


def _projector(prefix, dim, hidden=32):
    return {f"{prefix}0.weight": torch.randn(hidden, dim), f"{prefix}1.weight": torch.randn(hidden),
            f"{prefix}1.bias": torch.randn(hidden), f"{prefix}1.running_mean": torch.randn(hidden),
            f"{prefix}1.running_var": torch.rand(hidden), f"{prefix}1.num_batches_tracked": torch.tensor(3),
            f"{prefix}3.weight": torch.randn(16, hidden)}


def test_mocov3_keeps_the_base_encoder(tmp_path):
    src = _source(num_classes=0)
    sd = {f"module.base_encoder.{k}": v for k, v in src.items()}
    sd.update(_projector("module.base_encoder.head.", 48))
    sd.update({f"module.momentum_encoder.{k}": v + 1 for k, v in src.items()})
    sd.update(_projector("module.momentum_encoder.head.", 48))
    sd.update(_projector("module.predictor.", 16))
    path = tmp_path / "vit-s-300ep.pth.tar"
    torch.save({"epoch": 300, "arch": "vit_small", "state_dict": sd, "optimizer": {"state": {}}}, path)
    assert detect_format(torch.load(path, weights_only=True)) == "mocov3"
    vm = vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, **TINY)
    _assert_loaded(vm, src)
    dropped = vm.load_report.dropped
    assert dropped["head.0.weight"] == "MoCo-v3 projector head"
    assert any(k.startswith("module.momentum_encoder.") for k in dropped)
    assert any(k.startswith("module.predictor.") for k in dropped)


def _dino_full(src_teacher, src_student):
    head = {"head.mlp.0.weight": torch.randn(32, 48), "head.last_layer.weight_g": torch.randn(64, 1),
            "head.last_layer.weight_v": torch.randn(64, 32)}
    return {
        "student": {**{f"module.backbone.{k}": v for k, v in src_student.items()},
                    **{f"module.{k}": v for k, v in head.items()}},
        "teacher": {**{f"backbone.{k}": v for k, v in src_teacher.items()}, **head},
        "optimizer": {"state": {}}, "epoch": 100, "args": argparse.Namespace(arch="vit_small", patch_size=8),
        "dino_loss": {"center": torch.zeros(1, 64)},
    }


def test_dino_full_checkpoint_teacher_by_default_student_on_request(tmp_path):
    teacher, student = _source(num_classes=0, seed=1), _source(num_classes=0, seed=2)
    path = tmp_path / "checkpoint.pth"
    torch.save(_dino_full(teacher, student), path)
    vm = vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, **TINY)
    _assert_loaded(vm, teacher)
    assert vm.load_report.format == "dino" and "student" in vm.load_report.dropped
    vm_s = vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, checkpoint_key="student", **TINY)
    _assert_loaded(vm_s, student)


def test_dino_backbone_only_release_file(tmp_path):
    src = _source(num_classes=0)
    path = tmp_path / "dino_deitsmall8_pretrain.pth"
    torch.save(src, path)
    _assert_loaded(vs.load_model("vit_small_patch16_224", weights=path, pretrained=False,
                                 checkpoint_format="dino", **TINY), src)


def test_mae_pretrain_and_finetuned_layouts(tmp_path):
    pre = _source(num_classes=0)
    decoder = {"mask_token": torch.randn(1, 1, 32), "decoder_embed.weight": torch.randn(32, 48),
               "decoder_pos_embed": torch.randn(1, 17, 32), "decoder_pred.weight": torch.randn(192, 32)}
    p1 = tmp_path / "mae_visualize_vit_small.pth"
    torch.save({"model": {**pre, **decoder}}, p1)
    vm = vs.load_model("vit_small_patch16_224", weights=p1, pretrained=False, **TINY)
    _assert_loaded(vm, pre)
    assert vm.load_report.format == "mae" and set(vm.load_report.dropped) == set(decoder)

    ft = _source(num_classes=10, global_pool="avg")
    assert "fc_norm.weight" in ft and "norm.weight" not in ft
    p2 = tmp_path / "mae_finetuned_vit_small.pth"
    torch.save({"model": ft}, p2)
    vm = vs.load_model("vit_small_patch16_224", weights=p2, pretrained=False, checkpoint_format="mae", **TINY)
    _assert_loaded(vm, ft)
    assert vm.model.global_pool == "avg" and vm.model.num_classes == 10


def _beit_pretrain_source():
    return _source("beit_shared", global_pool="token", num_classes=0)


def test_beit_pretrain_shared_relative_position_bias(tmp_path):
    src = _beit_pretrain_source()
    assert "rel_pos_bias.relative_position_bias_table" in src
    extra = {"mask_token": torch.randn(1, 1, 48), "lm_head.weight": torch.randn(100, 48),
             "lm_head.bias": torch.randn(100),
             "rel_pos_bias.relative_position_index": torch.zeros(17, 17, dtype=torch.long)}
    path = tmp_path / "beit_base_patch16_224_pt22k.pth"
    torch.save({"model": {**src, **extra}}, path)
    vm = vs.load_model("beit_base_patch16_224", weights=path, pretrained=False, **TINY)
    _assert_loaded(vm, src)
    assert vm.load_report.format == "beit" and set(vm.load_report.dropped) == set(extra)
    assert vm.model.rel_pos_bias is not None  # shared, as pretrained


def test_simmim_encoder_from_the_wrapper(tmp_path):
    src = _beit_pretrain_source()
    sd = {f"encoder.{k}": v for k, v in src.items()}
    sd.update({"encoder.mask_token": torch.randn(1, 1, 48), "decoder.0.weight": torch.randn(192, 48, 1, 1),
               "decoder.0.bias": torch.randn(192)})
    path = tmp_path / "simmim_pretrain__vit_base__img224__800ep.pth"
    torch.save({"model": sd, "epoch": 799, "optimizer": {"state": {}}}, path)
    vm = vs.load_model("beit_base_patch16_224", weights=path, pretrained=False, **TINY)
    _assert_loaded(vm, src)
    assert vm.load_report.format == "simmim"
    assert {"decoder.0.weight", "decoder.0.bias", "mask_token"} <= set(vm.load_report.dropped)


def test_registry_entry_converter_used_with_local_file(tmp_path):
    """mocov3-s16's entry knows its layout and its 12 heads; a tiny stand-in keeps the test fast."""
    src = _source(num_classes=0, num_heads=12, embed_dim=48)
    path = tmp_path / "m.pth.tar"
    torch.save({"state_dict": {f"module.base_encoder.{k}": v for k, v in src.items()}}, path)
    vm = vs.load_model("mocov3-s16", weights=path, img_size=32, patch_size=8, embed_dim=48, depth=3)
    assert vm.num_heads == 12
    _assert_loaded(vm, src)


def test_missing_and_unexpected_keys_are_refused_then_reported(tmp_path):
    src = _source(num_classes=0)
    broken = dict(src)
    del broken["blocks.1.mlp.fc1.weight"]
    broken["blocks.9.extra"] = torch.zeros(3)
    path = tmp_path / "broken.pth"
    torch.save(broken, path)
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, **TINY)
    msg = str(e.value)
    assert "blocks.1.mlp.fc1.weight" in msg and "blocks.9.extra" in msg and "strict=False" in msg
    vm = vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, strict=False, **TINY)
    assert vm.load_report.missing == ["blocks.1.mlp.fc1.weight"]
    assert vm.load_report.unexpected == ["blocks.9.extra"]
    assert torch.equal(vm.model.state_dict()["blocks.0.mlp.fc1.weight"], src["blocks.0.mlp.fc1.weight"])


def test_wrong_shapes_are_refused(tmp_path):
    src = _source(num_classes=0)
    path = tmp_path / "wide.pth"
    torch.save(src, path)
    with pytest.raises(vs.CheckpointError, match="wrong shape"):
        vs.load_model("vit_small_patch16_224", weights=path, pretrained=False,
                      **{**TINY, "embed_dim": 96, "num_heads": 3})


def test_position_embedding_resampled_for_another_image_size(tmp_path):
    src = _source(num_classes=0)
    path = tmp_path / "s.pth"
    torch.save(src, path)
    vm = vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, **{**TINY, "img_size": 48})
    assert vm.grid_size == (6, 6) and vm.load_report.resampled == ["pos_embed"]
    assert torch.equal(vm.model.state_dict()["blocks.2.attn.qkv.weight"], src["blocks.2.attn.qkv.weight"])


def test_vitscope_checkpoint_round_trip(tmp_path):
    vm = tiny("reg")
    path = vs.save_checkpoint(vm.model, tmp_path / "zoo.safetensors", vm.spec)
    back = vs.load_model(path)
    _assert_loaded(back, vm.model.state_dict())
    assert back.num_prefix_tokens == 5 and back.depth == 3


class Cfg:  # stands for e.g. a yacs config node stored in a training checkpoint
    pass


def test_unpicklable_objects_need_trust(tmp_path):
    path = tmp_path / "odd.pth"
    torch.save({"model": _source(num_classes=0), "config": Cfg()}, path)
    with pytest.raises(vs.CheckpointError, match="trust_checkpoint=True"):
        vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, **TINY)
    vm = vs.load_model("vit_small_patch16_224", weights=path, pretrained=False, trust_checkpoint=True, **TINY)
    assert vm.load_report.ok


def test_unknown_format_and_missing_file():
    with pytest.raises(vs.CheckpointError, match="does not exist"):
        vs.load_model("vit_small_patch16_224", weights="/nonexistent/ckpt.pth", pretrained=False)
    from vitscope.models.layouts import convert

    with pytest.raises(vs.CheckpointError, match="mocov3"):
        convert({"a": torch.zeros(1)}, "moco")


@pytest.mark.parametrize("layout", ["timm", "dino_full", "mae_ft", "reg", "beit_pretrain"])
def test_bare_checkpoint_file_loads_with_its_architecture_read_off_the_tensors(tmp_path, layout):
    heads64 = {**TINY, "embed_dim": 128, "num_heads": 2}  # 64-dim heads: what inference assumes
    ckpt = None
    if layout == "timm":
        src = _source(num_classes=7, **heads64)
    elif layout == "dino_full":
        src = _source(num_classes=0, **heads64)
        ckpt = _dino_full(src, src)
    elif layout == "mae_ft":
        src = _source(num_classes=10, global_pool="avg", **heads64)
        ckpt = {"model": src}
    elif layout == "reg":
        src = _source("reg", num_classes=0, **heads64)
    else:
        src = _source("beit_shared", global_pool="token", num_classes=0, **heads64)
        ckpt = {"model": {**src, "lm_head.weight": torch.randn(10, 128)}}
    path = tmp_path / f"{layout}.pth"
    torch.save(src if ckpt is None else ckpt, path)
    vm = vs.load_model(path)
    _assert_loaded(vm, src)
    assert (vm.depth, vm.num_heads, vm.patch_size, vm.grid_size) == (3, 2, 8, (4, 4))
    assert vm.name == layout


def test_bare_checkpoint_heads_can_be_overridden(tmp_path):
    src = _source(num_classes=0)  # 48-dim, 3 heads of 16: not the 64-dim convention
    torch.save(src, tmp_path / "odd.pth")
    vm = vs.load_model(tmp_path / "odd.pth", num_heads=3)
    _assert_loaded(vm, src)
    assert vm.num_heads == 3
