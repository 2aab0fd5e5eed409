"""The model registry: every entry builds, matches timm's own configs, and fails clearly offline."""

import re
from typing import get_args

import pytest
import timm
import torch

import vitscope as vs
from vitscope.findings import FAMILIES
from vitscope.models.registry import REGISTRY, Family

SIZES = {"s": (384, 12), "b": (768, 12), "l": (1024, 24), "h": (1280, 32)}


OFFICIAL = sorted(n for n in REGISTRY if not n.startswith("zoo-"))
ZOO = sorted(n for n in REGISTRY if n.startswith("zoo-"))


@pytest.mark.parametrize("name", OFFICIAL)
def test_entry_builds_with_the_size_its_name_says(name):
    spec = REGISTRY[name]
    with torch.device("meta"):
        model = timm.create_model(spec.arch, pretrained=False, **spec.model_kwargs)
    size, patch = re.match(r"^[a-z0-9-]+?-([slbh])(\d+)", name).groups()
    dim, depth = SIZES[size]
    assert model.embed_dim == dim and len(model.blocks) == depth
    assert model.patch_embed.patch_size[0] == int(patch)
    assert spec.family in set(get_args(Family)) - {"none"}
    assert spec.citation


# Deliberate departures from timm's configs: OpenAI's CLIP preprocessing resizes to 224 and crops 224
# (crop_pct 1.0), where timm evaluates at 0.9; SigLIP's processor resizes the whole image to 224 x 224 (no crop).
CROP_AS_TRAINED = {"clip-b16", "clip-b32", "clip-l14", "siglip2-b16"}


@pytest.mark.parametrize("name", sorted(n for n, s in REGISTRY.items() if s.weights.kind == "timm"))
def test_timm_hosted_entries_exist_and_match_timm_preprocessing(name):
    spec = REGISTRY[name]
    assert spec.timm_name in timm.list_pretrained(spec.arch + "*")
    cfg = timm.get_pretrained_cfg(spec.timm_name).to_dict()
    pre = spec.preprocessing
    assert tuple(cfg["mean"]) == pytest.approx(pre.mean) and tuple(cfg["std"]) == pytest.approx(pre.std)
    assert cfg["interpolation"] == pre.interpolation
    if "img_size" not in spec.model_kwargs:  # DINOv2 is deliberately rebuilt at 224
        assert cfg["input_size"][-1] == pre.input_size
        expected = 1.0 if name in CROP_AS_TRAINED else cfg["crop_pct"]
        assert pre.crop_pct == pytest.approx(expected)


def test_sources_families_are_all_there():
    sup = {s.supervision for s in REGISTRY.values()}
    assert {"supervised", "clip", "dino", "mocov3", "mae", "beit", "simmim", "dinov2"} <= sup
    for n in ["sup-b16", "clip-b16", "dino-b16", "mocov3-b16", "mae-b16", "beit-b16", "simmim-b16",
              "dinov2-b14", "dinov2-b14-reg"]:
        assert n in REGISTRY
    assert REGISTRY["clip-b16"].arch.endswith("quickgelu_224")
    # language supervision is a family of its own (findings group it apart from explicit labels)
    assert {REGISTRY[n].family for n in REGISTRY if n.startswith("clip-")} == {"language"}
    assert REGISTRY["sup-b16"].family == "explicit"


def test_the_registry_covers_every_objective_family_researchers_compare():
    """Supervised, language-supervised (CLIP, SigLIP 2, PE), self-distillation (DINO v1-v3), contrastive (MoCo v3),
    masked modelling (MAE, BEiT, SimMIM, EVA-02), autoregressive (AIMv2) and latent prediction (I-JEPA): one
    findings list of families, the registry's."""
    assert set(FAMILIES) == set(get_args(Family))
    want = {"dinov3-s16": "hybrid", "dinov3-b16": "hybrid", "dinov3-l16": "hybrid", "eva02-b14": "reconstructive",
            "eva02-l14": "reconstructive", "pe-core-b16": "language", "pe-core-l14": "language",
            "siglip2-b16": "language", "aimv2-l14": "autoregressive", "ijepa-h14": "latent",
            "deit3-b16": "explicit", "clip-b16-openclip": "language"}
    assert {n: REGISTRY[n].family for n in want} == want
    assert {s.family for s in REGISTRY.values()} == set(get_args(Family))
    assert REGISTRY["clip-b16-openclip"].weights.checkpoint_format == "open_clip"


@pytest.mark.parametrize("name, family, readout, prefix", [
    ("dinov3-s16", "eva", "CLS token", 5), ("eva02-b14", "eva", "mean of patch tokens", 1),
    ("pe-core-b16", "eva", "attention pool", 1), ("siglip2-b16", "vit", "attention pool", 0),
    ("aimv2-l14", "vit", "mean of patch tokens", 0), ("ijepa-h14", "vit", "mean of patch tokens", 0),
    ("deit3-b16", "vit", "CLS token", 1), ("clip-b16-openclip", "vit", "CLS token", 1)])
def test_the_new_families_build_with_their_prefix_tokens_and_readout(name, family, readout, prefix):
    spec = REGISTRY[name]
    with torch.device("meta"):
        model = timm.create_model(spec.arch, pretrained=False, **spec.model_kwargs)
    vm = vs.ViTModel(model, name, spec)
    assert (vm.family, vm.readout, vm.num_prefix_tokens) == (family, readout, prefix)


def test_beit_entry_is_the_pretrained_not_finetuned_architecture():
    spec = REGISTRY["beit-b16"]
    assert spec.weights.kind == "url" and "pt22k" in spec.weights.location and "ft" not in spec.weights.location
    with torch.device("meta"):
        m = timm.create_model(spec.arch, **spec.model_kwargs)
    assert m.rel_pos_bias is not None and m.blocks[0].attn.relative_position_bias_table is None


def test_unknown_name_suggests_close_ones():
    with pytest.raises(vs.UnknownModelError) as e:
        vs.load_model("dino-b61")
    assert "dino-b16" in str(e.value) and "vitscope models" in str(e.value)
    with pytest.raises(vs.UnknownModelError, match="vit_small_patch16_224"):
        vs.load_model("vit_smal_patch16_224")


def test_hub_download_failure_says_how_to_use_a_local_file():
    with pytest.raises(vs.WeightsUnavailableError, match=r"weights='/path/to/model\.safetensors'"):
        vs.load_model("dino-s16")  # HF_HUB_OFFLINE=1 in the tests


def test_url_download_failure_says_how_to_use_a_local_file(monkeypatch, tmp_path):
    import torch.hub

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))

    def no_network(url, dst, progress=True):
        raise OSError("Name or service not known")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    with pytest.raises(vs.WeightsUnavailableError) as e:
        vs.load_model("mocov3-b16")
    assert "weights='/path/to/file'" in str(e.value) and "vit-b-300ep.pth.tar" in str(e.value)
    assert not list(tmp_path.rglob("*.tar"))  # no half-written file left behind


def test_manual_entry_points_to_the_download_page():
    with pytest.raises(vs.WeightsUnavailableError, match="github.com/microsoft/SimMIM"):
        vs.load_model("simmim-b16")


def test_random_init_is_deterministic_and_seeded():
    a = vs.load_model("vit_small_patch16_224", pretrained=False, depth=2, seed=3)
    b = vs.load_model("vit_small_patch16_224", pretrained=False, depth=2, seed=3)
    c = vs.load_model("vit_small_patch16_224", pretrained=False, depth=2, seed=4)
    assert a.weights_digest == b.weights_digest != c.weights_digest


def test_timm_name_gets_timm_preprocessing():
    vm = vs.load_model("vit_base_patch16_clip_224.openai", pretrained=False, depth=1)
    assert vm.preprocessing.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))


def test_zoo_entries_are_the_zoo_architecture_and_every_objective_is_there():
    from vitscope.zoo import OBJECTIVES, ZOO_ARCH

    base = {n for n in ZOO if "-ft-" not in n}
    assert base == {"zoo-sup", "zoo-dino", "zoo-mocov3", "zoo-mae", "zoo-simmim", "zoo-hybrid", "zoo-random"}
    assert {REGISTRY[n].supervision for n in base} - {"random init"} <= set(OBJECTIVES)
    # the fine-tuned zoo (Merlin et al.'s experiments, docs/INVARIANCE.md)
    assert set(ZOO) - base == {"zoo-mocov3-ft-cls", "zoo-mae-ft-cls", "zoo-random-ft-cls", "zoo-mocov3-ft-rec",
                               "zoo-mae-ft-rec"}
    for n in ZOO:
        vm = vs.load_model(n, pretrained=False)
        assert (vm.depth, vm.embed_dim, vm.patch_size, vm.grid_size) == (ZOO_ARCH.depth, ZOO_ARCH.embed_dim,
                                                                         ZOO_ARCH.patch_size, (ZOO_ARCH.grid,) * 2)


@pytest.mark.parametrize("name", [n for n in ZOO if REGISTRY[n].weights.kind == "file"])
def test_shipped_zoo_weights_load_strictly_and_were_trained_as_their_entry_says(name):
    from vitscope.models.load import package_file, read_vitscope_metadata

    f = package_file(REGISTRY[name].weights.location)
    if not f.is_file():
        pytest.skip(f"{name} is not trained yet")
    vm = vs.load_model(name)
    assert not vm.load_report.missing and not vm.load_report.unexpected
    trained = read_vitscope_metadata(f)  # the spec the trainer wrote into the file
    assert trained.preprocessing == REGISTRY[name].preprocessing
    assert trained.model_kwargs == REGISTRY[name].model_kwargs and trained.arch == REGISTRY[name].arch
    assert trained.family == REGISTRY[name].family


def test_a_missing_shipped_file_says_how_to_point_at_one(monkeypatch):
    from dataclasses import replace

    from vitscope.models.registry import WeightSource

    spec = replace(REGISTRY["zoo-mae"], name="zoo-gone", weights=WeightSource("file", "zoo/weights/gone/x.safetensors"))
    monkeypatch.setitem(REGISTRY, "zoo-gone", spec)
    with pytest.raises(vs.errors.WeightsUnavailableError, match=r"weights='/path/to/encoder.safetensors'"):
        vs.load_model("zoo-gone")
