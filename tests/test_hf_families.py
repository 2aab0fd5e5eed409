"""transformers DINOv3, SigLIP, SigLIP 2 and AIMv2 checkpoints, saved by transformers itself, load as timm models
(Eva for DINOv3, VisionTransformer for the others) whose taps equal the transformers model's own hidden states,
attentions (RoPE included) and pooled outputs, with every key accounted for; a text tower is refused."""

import json

import pytest
import torch

import vitscope as vs

T = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=32,
             patch_size=8)
NAFLEX = {k: v for k, v in SMALL.items() if k != "image_size"} | dict(num_patches=16)  # SigLIP 2: a 4x4 grid
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99,
            pad_token_id=1, bos_token_id=0, eos_token_id=2)

IMAGENET = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
HALF = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
CLIP = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
# preprocessor_config.json as each family's image processor writes it (at this test's 32 px)
PROCESSORS = {
    "dinov3": dict(image_processor_type="DINOv3ViTImageProcessorFast", do_resize=True,
                   size={"height": 32, "width": 32}, resample=2, do_normalize=True, **IMAGENET),
    "siglip": dict(image_processor_type="SiglipImageProcessor", do_resize=True, size={"height": 32, "width": 32},
                   resample=3, do_normalize=True, **HALF),
    "siglip2": dict(image_processor_type="Siglip2ImageProcessorFast", do_resize=True, max_num_patches=16,
                    patch_size=8, resample=2, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, **HALF),
    "aimv2": dict(image_processor_type="CLIPImageProcessor", do_resize=True, size={"shortest_edge": 32},
                  do_center_crop=True, crop_size={"height": 32, "width": 32}, resample=3, do_normalize=True, **CLIP),
}

# (id, config class, config arguments, model class, prefix tokens, what the pooled output is compared with,
#  what the dropped keys' reasons must mention)
CASES = [
    ("dinov3", "DINOv3ViTConfig", dict(SMALL, num_register_tokens=4), "DINOv3ViTModel", 5, "cls", ["mask token"]),
    ("dinov3-swiglu-partial-biases", "DINOv3ViTConfig",
     dict(SMALL, num_register_tokens=4, use_gated_mlp=True, hidden_act="silu", value_bias=False, proj_bias=False,
          mlp_bias=False, rope_theta=1000.0, layer_norm_eps=1e-4), "DINOv3ViTModel", 5, "cls", ["mask token"]),
    ("dinov3-no-qkv-bias", "DINOv3ViTConfig", dict(SMALL, num_register_tokens=2, query_bias=False, value_bias=False),
     "DINOv3ViTModel", 3, "cls", ["mask token"]),
    ("siglip-vision", "SiglipVisionConfig", dict(SMALL), "SiglipVisionModel", 0, "map", []),
    ("siglip-full", "SiglipConfig", dict(vision_config=SMALL, text_config=TEXT), "SiglipModel", 0, "map",
     ["text tower"]),
    ("siglip-classifier", "SiglipConfig", dict(vision_config=SMALL, text_config=TEXT, num_labels=3),
     "SiglipForImageClassification", 0, "logits", ["MAP head"]),
    ("siglip2-vision", "Siglip2VisionConfig", NAFLEX, "Siglip2VisionModel", 0, "map", []),
    ("siglip2-full", "Siglip2Config", dict(vision_config=NAFLEX, text_config=TEXT), "Siglip2Model", 0, "map",
     ["text tower"]),
    ("aimv2-vision", "Aimv2VisionConfig", dict(SMALL), "Aimv2VisionModel", 0, "map", []),  # its pooling head
    ("aimv2-biases", "Aimv2VisionConfig", dict(SMALL, qkv_bias=True, mlp_bias=False, rms_norm_eps=1e-3),
     "Aimv2VisionModel", 0, "map", []),
    ("aimv2-no-head", "Aimv2VisionConfig", dict(SMALL, use_head=False), "Aimv2VisionModel", 0, None, []),
    ("aimv2-native", "Aimv2VisionConfig", dict(SMALL, is_native=True), "Aimv2VisionModel", 0, "map", []),
    ("aimv2-full", "Aimv2Config", dict(vision_config=SMALL, text_config=TEXT), "Aimv2Model", 0, "map",
     ["image projection", "text tower"]),
]


def _family(case_id):
    return case_id.split("-")[0]


def _save(directory, config_cls, config_kw, model_cls, seed=0):
    """A transformers model with every parameter randomised (nothing left at a zero or unit init that a wrong
    mapping could match by chance; q and k drawn larger, so that attention is far from uniform and RoPE moves it
    by much more than the tolerance), written by save_pretrained with its family's preprocessor config."""
    torch.manual_seed(seed)
    model = getattr(T, model_cls)(getattr(T, config_cls)(**config_kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.3 if ("q_proj" in name or "k_proj" in name) else 0.1) * torch.randn_like(p))
    model.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PROCESSORS[_family(directory.name)]))
    return directory


def _patchify(x, patch):
    """Images -> SigLIP 2's flattened patches, written from its image processor's layout (row in the patch,
    column in the patch, channel); checked against the processor itself below."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


def _vision_outputs(ref, x):
    """(vision tower outputs with hidden states and attentions, classifier logits or None), eager attention."""
    kw = dict(output_hidden_states=True, output_attentions=True)
    name = type(ref).__name__
    tower = ref.vision_model if hasattr(ref, "vision_model") else ref
    if name.startswith("Siglip2"):
        n, grid = x.shape[-1] // 8, x.shape[0]
        kw.update(pixel_attention_mask=torch.ones(grid, n * n, dtype=torch.long),
                  spatial_shapes=torch.tensor([[n, n]] * grid))
        return tower(_patchify(x, 8), **kw), None
    out = tower(x, **kw)
    return out, (ref(x).logits if name.endswith("ForImageClassification") else None)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_family_matches_transformers_tap_for_tap(tmp_path, case):
    case_id, config_cls, config_kw, model_cls, prefix, pooled, dropped = case
    directory = _save(tmp_path / case_id, config_cls, config_kw, model_cls)
    ref = getattr(T, model_cls).from_pretrained(directory, attn_implementation="eager").eval()
    vm = vs.load_model(str(directory))

    report = vm.load_report
    assert report.ok and not report.missing and not report.unexpected and not report.mismatched
    assert set(report.loaded) == set(vm.model.state_dict())  # every weight of the timm model came from the file
    assert all(any(word in why for word in dropped) for why in report.dropped.values())
    assert all(any(word in why for why in report.dropped.values()) for word in dropped)
    assert (vm.family, vm.depth, vm.num_heads, vm.embed_dim, vm.grid_size) == (
        "eva" if case_id.startswith("dinov3") else "vit", 2, 3, 48, (4, 4))
    assert vm.num_prefix_tokens == prefix and vm.has_cls_token is case_id.startswith("dinov3")
    assert vm.num_tokens == prefix + 16

    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, logits = _vision_outputs(ref, x)
    taps = ["embed", "final_norm", "logits"] + [f"block{i}.{t}" for i in range(2) for t in ("out", "attn")]
    f = vs.extract(vm, x, taps)

    close = dict(rtol=1e-5, atol=1e-5)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    torch.testing.assert_close(f["embed"], out.hidden_states[0], **close)
    if case_id.startswith("siglip2"):  # a convolution sums the patch in another order than SigLIP 2's nn.Linear:
        close = dict(rtol=1e-4, atol=1e-4)  # ~1e-6 apart at the embedding, which peaked attention amplifies
    for i in range(2):
        torch.testing.assert_close(f[f"block{i}.out"], out.hidden_states[i + 1], **close)
        torch.testing.assert_close(f[f"block{i}.attn"], out.attentions[i], **close)
        assert out.attentions[i].amax(-1).mean() > 2 / vm.num_tokens  # far from uniform: positions matter
    torch.testing.assert_close(f["final_norm"], out.last_hidden_state, **close)
    with torch.no_grad():
        head_input = vm.model.forward_head(vm.model.forward_features(x), pre_logits=True)
    if pooled in ("cls", "map"):  # DINOv3: the normalised class token; SigLIP: the MAP head
        torch.testing.assert_close(head_input, out.pooler_output, **close)
        torch.testing.assert_close(f["logits"], out.pooler_output, **close)  # headless: the pooled feature
        torch.testing.assert_close(vs.extract(vm, x, ["pool"])["pool"], out.pooler_output, **close)
    elif pooled == "logits":  # SigLIP's classifier: mean of the normalised tokens, then a linear layer
        torch.testing.assert_close(f["logits"], logits, **close)
        assert vm.model.num_classes == 3


def test_dinov3_runs_at_other_sizes_as_transformers_does(tmp_path):
    """RoPE is computed for the input's grid on every pass (no position table to resample): a 48x40 input gives
    transformers' hidden states and attentions, storage tokens and all."""
    d = _save(tmp_path / "dinov3", "DINOv3ViTConfig", dict(SMALL, num_register_tokens=4), "DINOv3ViTModel")
    ref = T.DINOv3ViTModel.from_pretrained(d, attn_implementation="eager").eval()
    vm = vs.load_model(str(d))
    assert vm.any_size
    x = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ref(x, output_hidden_states=True, output_attentions=True)
    with vm.input_size(48, 40):
        f = vs.extract(vm, x, ["block1.out", "block1.attn", "final_norm"])
    assert f["block1.attn"].shape[-1] == 5 + 6 * 5
    torch.testing.assert_close(f["block1.out"], out.hidden_states[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f["block1.attn"], out.attentions[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f["final_norm"], out.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_native_aimv2_computes_its_position_embedding_at_the_size_it_is_built(tmp_path):
    d = _save(tmp_path / "aimv2", "Aimv2VisionConfig", dict(SMALL, is_native=True), "Aimv2VisionModel")
    ref = T.Aimv2VisionModel.from_pretrained(d, attn_implementation="eager").eval()
    vm = vs.load_model(str(d), img_size=48)
    assert vm.grid_size == (6, 6) and vm.load_report.ok and "pos_embed" in vm.load_report.loaded
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ref(x, output_hidden_states=True)
    f = vs.extract(vm, x, ["embed", "block1.out", "final_norm"])
    torch.testing.assert_close(f["embed"], out.hidden_states[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f["block1.out"], out.hidden_states[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f["final_norm"], out.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_converted_models_round_trip_through_vitscope_checkpoints(tmp_path):
    """The RMSNorm build (with its eps, a vitscope build argument) and the MAP head survive save_checkpoint."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    for name, config_cls, kw, model_cls in [
        ("aimv2", "Aimv2VisionConfig", dict(SMALL, rms_norm_eps=1e-3), "Aimv2VisionModel"),
        ("siglip", "SiglipVisionConfig", dict(SMALL), "SiglipVisionModel"),
    ]:
        vm = vs.load_model(str(_save(tmp_path / name, config_cls, kw, model_cls)))
        again = vs.load_model(str(vs.save_checkpoint(vm.model, tmp_path / f"{name}.safetensors", vm.spec)))
        assert type(again.model) is type(vm.model) and again.num_prefix_tokens == vm.num_prefix_tokens
        assert [m.eps for m in again.model.modules() if hasattr(m, "eps")] == [
            m.eps for m in vm.model.modules() if hasattr(m, "eps")]
        torch.testing.assert_close(vs.extract(again, x, "final_norm")["final_norm"],
                                   vs.extract(vm, x, "final_norm")["final_norm"], rtol=0, atol=0)


def test_siglip2_patch_layout_is_its_image_processors(tmp_path):
    """The flattening the conversion assumes (and `_patchify` writes) is the one transformers' SigLIP 2 image
    processor produces: its patches of an image that needs no resizing equal ours, in order."""
    import numpy as np

    d = tmp_path / "siglip2"
    d.mkdir()
    (d / "preprocessor_config.json").write_text(json.dumps(PROCESSORS["siglip2"]))
    processor = T.AutoImageProcessor.from_pretrained(d)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    got = processor(images=[image], return_tensors="pt")
    assert got["spatial_shapes"].tolist() == [[4, 4]]
    x = (torch.from_numpy(image).permute(2, 0, 1).float()[None] / 255 - 0.5) / 0.5
    torch.testing.assert_close(got["pixel_values"][:, :16], _patchify(x, 8), rtol=0, atol=1e-5)


def test_preprocessing_and_architecture_come_from_the_directory(tmp_path):
    d = _save(tmp_path / "dinov3", "DINOv3ViTConfig", dict(SMALL, num_register_tokens=4), "DINOv3ViTModel")
    vm = vs.load_model(str(d))
    pre = vm.spec.preprocessing
    assert (pre.mean, pre.std, pre.input_size, pre.interpolation) == (
        (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 32, "bilinear")
    assert vm.spec.arch == "vit_small_patch16_dinov3_qkvb" and "DINOv3" in vm.spec.citation
    assert type(vm.model).__name__ == "Eva" and vm.model.reg_token.shape == (1, 4, 48)

    d = _save(tmp_path / "siglip2", "Siglip2VisionConfig", NAFLEX, "Siglip2VisionModel")
    (d / "preprocessor_config.json").unlink()  # the family's defaults, at the stored grid's size
    vm = vs.load_model(str(d))
    pre = vm.spec.preprocessing
    assert (pre.mean, pre.std, pre.input_size, pre.interpolation) == ((0.5,) * 3, (0.5,) * 3, 32, "bilinear")
    assert "SigLIP 2" in vm.spec.citation and vm.model.global_pool == "map"

    d = _save(tmp_path / "aimv2", "Aimv2VisionConfig", dict(SMALL), "Aimv2VisionModel")
    vm = vs.load_model(str(d))
    assert vm.spec.preprocessing.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert "AIMv2" in vm.spec.citation or "Autoregressive" in vm.spec.citation
    assert type(vm.model.norm).__name__ == "RmsNorm" and vm.model.norm.eps == pytest.approx(1e-5)
    d = _save(tmp_path / "siglip", "SiglipVisionConfig", dict(SMALL), "SiglipVisionModel")
    assert "Sigmoid Loss" in vs.load_model(str(d)).spec.citation


def test_a_siglip_text_tower_is_refused_in_one_sentence(tmp_path):
    d = tmp_path / "siglip-text"
    torch.manual_seed(0)
    T.SiglipTextModel(T.SiglipTextConfig(**TEXT)).save_pretrained(d)
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(str(d))
    msg = str(e.value)
    assert "\n" not in msg and msg.count(". ") == 0
    assert "siglip_text_model" in msg and "SiglipTextModel" in msg and "text tower" in msg
    assert "siglip_vision_model" in msg  # what to pass instead


def test_config_sizes_that_disagree_with_the_weights_are_refused_before_building(tmp_path, monkeypatch):
    import vitscope.models.load as load

    monkeypatch.setattr(load.timm, "create_model", lambda *a, **k: pytest.fail("no model may be built"))
    for case_id, change, needle in [
        ("dinov3", dict(num_hidden_layers=3), "num_hidden_layers is 3 in the config and 2 in the weights"),
        ("siglip", dict(image_size=40), "image_size is 40 in the config and 32 (16 position embeddings)"),
        ("siglip2", dict(num_patches=25), "num_patches is 25 in the config and 16 in the weights"),
        ("aimv2", dict(intermediate_size=64), "intermediate_size is 64 in the config and 96 in the weights"),
    ]:
        config_cls, kw, model_cls = {"dinov3": ("DINOv3ViTConfig", SMALL, "DINOv3ViTModel"),
                                     "siglip": ("SiglipVisionConfig", SMALL, "SiglipVisionModel"),
                                     "siglip2": ("Siglip2VisionConfig", NAFLEX, "Siglip2VisionModel"),
                                     "aimv2": ("Aimv2VisionConfig", SMALL, "Aimv2VisionModel")}[case_id]
        d = _save(tmp_path / case_id, config_cls, kw, model_cls)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(vs.CheckpointError) as e:
            vs.load_model(str(d))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_dinov3_with_a_key_bias_is_refused_before_building(tmp_path, monkeypatch):
    """timm's Eva has no key bias, and under RoPE one changes the attention: no model is built."""
    import vitscope.models.load as load

    d = _save(tmp_path / "dinov3", "DINOv3ViTConfig", dict(SMALL, key_bias=True), "DINOv3ViTModel")
    monkeypatch.setattr(load.timm, "create_model", lambda *a, **k: pytest.fail("no model may be built"))
    with pytest.raises(vs.CheckpointError, match="key_bias") as e:
        vs.load_model(str(d))
    assert "\n" not in str(e.value)
