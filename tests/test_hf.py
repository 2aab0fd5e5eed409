"""transformers checkpoints: each family, saved by transformers itself, loads as a timm model whose taps equal
the transformers model's own hidden states, attentions and logits; offline fetches fail in seconds."""

import json
import time

import pytest
import torch

import vitscope as vs
from vitscope.models import fetch

T = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=32,
             patch_size=8)
DINO = dict(SMALL, intermediate_size=None, mlp_ratio=2, image_size=56, patch_size=14)
CLIP_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99,
                 bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _dino(**kw):
    return {k: v for k, v in {**DINO, **kw}.items() if v is not None}


# (id, config class, config arguments, model class, what the checkpoint's final output is compared with)
CASES = [
    ("vit-classifier", "ViTConfig", dict(SMALL, num_labels=5), "ViTForImageClassification", "norm"),
    ("vit-pooler", "ViTConfig", dict(SMALL, qkv_bias=False), "ViTModel", "norm"),
    ("deit-with-teacher", "DeiTConfig", dict(SMALL, num_labels=4), "DeiTForImageClassificationWithTeacher", "norm"),
    ("deit-cls-head", "DeiTConfig", dict(SMALL, num_labels=4), "DeiTForImageClassification", "norm"),
    ("dinov2", "Dinov2Config", _dino(), "Dinov2Model", "norm"),
    ("dinov2-classifier", "Dinov2Config", _dino(num_labels=3), "Dinov2ForImageClassification", "norm"),
    ("dinov2-swiglu", "Dinov2Config", _dino(use_swiglu_ffn=True, mlp_ratio=4), "Dinov2Model", "norm"),
    ("dinov2-registers", "Dinov2WithRegistersConfig", _dino(num_register_tokens=2, num_labels=3),
     "Dinov2WithRegistersForImageClassification", "norm"),
    ("clip-vision", "CLIPVisionConfig", dict(SMALL), "CLIPVisionModel", "pooler"),
    ("clip-projection", "CLIPVisionConfig", dict(SMALL, projection_dim=24), "CLIPVisionModelWithProjection",
     "pooler"),
    ("clip-full", "CLIPConfig", dict(vision_config=SMALL, text_config=CLIP_TEXT, projection_dim=24), "CLIPModel",
     "pooler"),
    ("clip-classifier", "CLIPConfig", dict(vision_config=SMALL, text_config=CLIP_TEXT, num_labels=3),
     "CLIPForImageClassification", None),
    ("vit-mae-pretraining", "ViTMAEConfig", dict(SMALL, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                                  decoder_num_attention_heads=2, decoder_intermediate_size=64),
     "ViTMAEForPreTraining", "norm"),
    ("beit-classifier", "BeitConfig", dict(SMALL, num_labels=6, use_relative_position_bias=True,
                                           use_absolute_position_embeddings=True), "BeitForImageClassification",
     "pooler"),
    ("beit-mim", "BeitConfig", dict(SMALL, use_shared_relative_position_bias=True, use_mask_token=True,
                                    vocab_size=50), "BeitForMaskedImageModeling", "mim_norm"),
    ("beit-cls-token", "BeitConfig", dict(SMALL, use_mean_pooling=False, layer_scale_init_value=0.0,
                                          use_absolute_position_embeddings=True), "BeitModel", "norm"),
    ("data2vec-vision", "Data2VecVisionConfig", dict(SMALL, num_labels=3, use_relative_position_bias=True),
     "Data2VecVisionForImageClassification", "pooler"),
]


def _save(tmp_path, config_cls, config_kw, model_cls, seed=0):
    """A transformers model with every parameter randomised (nothing left at a zero or unit init that a wrong
    mapping could match by chance), written by save_pretrained."""
    torch.manual_seed(seed)
    model = getattr(T, model_cls)(getattr(T, config_cls)(**config_kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return tmp_path


def _reference(directory, model_cls):
    """transformers' own model, read back from the same directory, unfused attention."""
    return getattr(T, model_cls).from_pretrained(directory, attn_implementation="eager").eval()


def _encoder_outputs(ref, x):
    """(encoder outputs with hidden states and attentions, logits or None) of any of the task models above."""
    kw = dict(output_hidden_states=True, output_attentions=True)
    name = type(ref).__name__
    if name.startswith("ViTMAE"):
        enc = ref.vit if hasattr(ref, "vit") else ref
        enc.config.mask_ratio = 0.0  # keep every patch, in order (noise = position)
        noise = torch.arange(x.shape[-1] * x.shape[-2] // enc.config.patch_size ** 2).float().expand(len(x), -1)
        return enc(x, noise=noise, **kw), None
    if name in ("CLIPModel", "CLIPVisionModelWithProjection"):
        out = ref.vision_model(x, **kw)
        return out, ref.visual_projection(out.pooler_output)
    if name == "BeitForMaskedImageModeling":
        return ref.beit(x, **kw), None
    base = getattr(ref, ref.base_model_prefix, ref)
    out = base(x, **kw)
    logits = ref(x).logits if hasattr(ref, "classifier") or hasattr(ref, "cls_classifier") else None
    return out, logits


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_family_matches_transformers_tap_for_tap(tmp_path, case):
    _, config_cls, config_kw, model_cls, final = case
    directory = _save(tmp_path / "ckpt", config_cls, config_kw, model_cls)
    ref = _reference(directory, model_cls)
    vm = vs.load_model(str(directory))
    assert vm.load_report.ok and not vm.load_report.missing and vm.load_report.loaded
    assert vm.depth == 3 and vm.num_heads == 4 and vm.embed_dim == 64

    size = vm.img_size[0]
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, logits = _encoder_outputs(ref, x)
    taps = ["embed"] + [f"block{i}.out" for i in range(3)] + [f"block{i}.attn" for i in range(3)]
    f = vs.extract(vm, x, taps + ["final_norm", "logits"])

    close = dict(rtol=1e-5, atol=1e-5)
    assert len(out.hidden_states) == 4
    torch.testing.assert_close(f["embed"], out.hidden_states[0], **close)
    for i in range(3):
        torch.testing.assert_close(f[f"block{i}.out"], out.hidden_states[i + 1], **close)
        torch.testing.assert_close(f[f"block{i}.attn"], out.attentions[i], **close)
    if final == "norm":  # last_hidden_state: the final norm over every token
        torch.testing.assert_close(f["final_norm"], out.last_hidden_state, **close)
    elif final == "pooler" and hasattr(vm.model, "fc_norm") and vm.model.global_pool == "avg":  # BEiT mean pool
        torch.testing.assert_close(vm.model.forward_head(vm.model.forward_features(x), pre_logits=True),
                                   out.pooler_output, **close)
    elif final == "pooler":  # CLIP: post_layernorm of the class token
        torch.testing.assert_close(f["final_norm"][:, 0], out.pooler_output, **close)
    elif final == "mim_norm":  # BEiT pretraining: the encoder's norm sits in the MIM model
        torch.testing.assert_close(f["final_norm"], ref.layernorm(out.last_hidden_state), **close)
    if logits is not None:
        assert vm.model.num_classes == logits.shape[-1]
        torch.testing.assert_close(f["logits"], logits, **close)


def test_what_is_dropped_is_said_and_the_rest_is_every_key(tmp_path):
    d = _save(tmp_path / "mae", "ViTMAEConfig", dict(SMALL, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                                     decoder_num_attention_heads=2, decoder_intermediate_size=64),
              "ViTMAEForPreTraining")
    report = vs.load_model(str(d)).load_report
    assert report.dropped and set(report.dropped.values()) == {"MAE pixel decoder"}
    assert report.format == "transformers vit_mae"
    d = _save(tmp_path / "clip", "CLIPConfig", dict(vision_config=SMALL, text_config=CLIP_TEXT), "CLIPModel")
    report = vs.load_model(str(d)).load_report
    assert "logit_scale" in report.dropped and any(k.startswith("text_model.") for k in report.dropped)
    d = _save(tmp_path / "vit", "ViTConfig", dict(SMALL), "ViTModel")
    report = vs.load_model(str(d)).load_report
    assert set(report.dropped) == {"pooler.dense.weight", "pooler.dense.bias"}


def test_sharded_checkpoints_load_every_shard(tmp_path):
    whole = _save(tmp_path / "whole", "ViTConfig", dict(SMALL), "ViTModel")
    torch.manual_seed(0)
    T.ViTModel.from_pretrained(whole).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    assert vs.load_model(str(tmp_path / "sharded")).weights_digest == vs.load_model(str(whole)).weights_digest


def test_preprocessing_comes_from_the_checkpoint_else_the_family(tmp_path):
    d = _save(tmp_path / "deit", "DeiTConfig", dict(SMALL, num_labels=4), "DeiTForImageClassification")
    pre = vs.load_model(str(d)).spec.preprocessing
    assert pre.mean == pytest.approx((0.485, 0.456, 0.406)) and pre.crop_pct == pytest.approx(0.875)
    assert pre.input_size == 32 and pre.interpolation == "bicubic"
    (d / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "size": {"shortest_edge": 40}, "do_center_crop": True,
        "crop_size": {"height": 32, "width": 32}, "resample": 2, "do_normalize": True,
        "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6], "image_processor_type": "BitImageProcessor"}))
    vm = vs.load_model(str(d))
    pre = vm.spec.preprocessing
    assert (pre.mean, pre.std, pre.input_size) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6), 32)
    assert pre.crop_pct == pytest.approx(0.8) and pre.interpolation == "bilinear" and pre.resize_size == 40


def _hidden_states_match(vm, ref, x, **ref_kw):
    with torch.no_grad():
        out = ref(x, output_hidden_states=True, **ref_kw)
    f = vs.extract(vm, x, ["embed"] + [f"block{i}.out" for i in range(vm.depth)])
    for i, t in enumerate(f):
        torch.testing.assert_close(f[t], out.hidden_states[i], rtol=1e-5, atol=1e-5)
    return out


def test_a_different_image_size_resamples_the_position_embedding_as_transformers_does(tmp_path):
    d = _save(tmp_path / "vit", "ViTConfig", dict(SMALL, num_labels=5), "ViTForImageClassification")
    vm = vs.load_model(str(d), img_size=48)
    assert vm.grid_size == (6, 6) and vm.load_report.resampled == ["pos_embed"] and vm.load_report.ok
    x = torch.randn(2, 3, 48, 48)
    out = _hidden_states_match(vm, _reference(d, "ViTForImageClassification"), x, interpolate_pos_encoding=True)
    torch.testing.assert_close(vs.extract(vm, x, "logits")["logits"], out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config_cls,model_cls", [("Dinov2Config", "Dinov2Model"),
                                                  ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel")])
def test_dinov2_is_built_at_its_processor_size_as_transformers_runs_it(tmp_path, config_cls, model_cls):
    """DINOv2's configs say 518 px and its processors crop 224: transformers interpolates the position
    embedding on the fly, vitscope once at load time, the same way (here 84 px in the config, 56 cropped)."""
    registers = dict(num_register_tokens=2) if "Registers" in config_cls else {}
    d = _save(tmp_path / "dino", config_cls, _dino(image_size=84, **registers), model_cls)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "size": {"shortest_edge": 64}, "do_center_crop": True, "crop_size": 56, "resample": 3,
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    vm = vs.load_model(str(d))
    assert vm.img_size == (56, 56) and vm.grid_size == (4, 4) and vm.load_report.resampled == ["pos_embed"]
    assert vm.spec.model_kwargs["img_size"] == 56 == vs.models.load.resolve_spec(str(d)).model_kwargs["img_size"]
    _hidden_states_match(vm, _reference(d, model_cls), torch.randn(2, 3, 56, 56))


def test_converted_models_round_trip_through_vitscope_checkpoints(tmp_path):
    """layer_norm_eps and the DINOv2 classifier are build arguments of vitscope's own: they survive a save."""
    d = _save(tmp_path / "dino", "Dinov2Config", _dino(num_labels=3, layer_norm_eps=1e-3),
              "Dinov2ForImageClassification")
    vm = vs.load_model(str(d))
    assert vm.model.norm.eps == 1e-3 and vm.spec.model_kwargs["head_input"] == "cls+mean"
    path = vs.save_checkpoint(vm.model, tmp_path / "dino.safetensors", vm.spec)
    again = vs.load_model(str(path))
    x = torch.randn(2, 3, 56, 56)
    torch.testing.assert_close(vs.extract(again, x, "logits")["logits"], vs.extract(vm, x, "logits")["logits"],
                               rtol=0, atol=0)


def test_random_init_builds_the_architecture_the_config_names(tmp_path):
    d = _save(tmp_path / "beit", "BeitConfig", dict(SMALL, use_shared_relative_position_bias=True),
              "BeitModel")
    vm = vs.load_model(str(d), pretrained=False)
    assert vm.family == "beit" and vm.load_report is None and vm.model.rel_pos_bias is not None


def test_a_model_type_that_is_not_a_vit_names_the_supported_ones(tmp_path):
    for model_type, arch in [("resnet", "ResNetForImageClassification"), ("bert", "BertModel")]:
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
        with pytest.raises(vs.CheckpointError) as e:
            vs.load_model(str(d))
        msg = str(e.value)
        assert repr(model_type) in msg and arch in msg
        assert all(t in msg for t in ("vit", "deit", "dinov2", "clip", "vit_mae", "beit", "data2vec-vision"))


def test_config_and_weights_that_disagree_get_the_key_report(tmp_path, monkeypatch):
    import vitscope.models.load as load

    d = _save(tmp_path / "vit", "ViTConfig", dict(SMALL), "ViTModel")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4, "intermediate_size": 96}))
    create = load.timm.create_model
    monkeypatch.setattr(load.timm, "create_model", lambda *a, **k: pytest.fail("strict: refused before building"))
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(str(d))
    msg = str(e.value)
    assert "num_hidden_layers is 4 in the config and 3 in the weights" in msg and "\n" not in msg
    assert "intermediate_size is 96 in the config and 128 in the weights" in msg and "strict=False" in msg
    monkeypatch.setattr(load.timm, "create_model", create)
    vm = vs.load_model(str(d), strict=False)  # what fits loads, and the key report says the rest
    assert not vm.load_report.ok and any(k.startswith("blocks.3.") for k in vm.load_report.missing)
    d = _save(tmp_path / "dino", "Dinov2Config", _dino(), "Dinov2Model")  # a classifier the weights lack
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Dinov2ForImageClassification"]}))
    with pytest.raises(vs.CheckpointError, match=r"2 missing \(left at init\): head.weight, head.bias"):
        vs.load_model(str(d))


def test_a_directory_without_config_says_what_it_needs(tmp_path):
    with pytest.raises(vs.VitscopeError, match="no config.json"):
        vs.load_model(str(tmp_path))
    d = _save(tmp_path / "vit", "ViTConfig", dict(SMALL), "ViTModel")
    with pytest.raises(vs.CheckpointError, match="needs its config.json: pass the directory"):
        vs.load_model(str(d), weights=str(d / "model.safetensors"))


# -- hub ids and offline behaviour ---------------------------------------------------------------------

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache of its own, HF_HUB_OFFLINE=1 (as in every test), fresh connection probes."""
    import huggingface_hub.constants as c

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(fetch, "_probes", {})
    return cache


def _put_in_cache(cache, repo_id, files):
    """The hub cache's layout: models--org--name/{refs/main, snapshots/<commit>/<file>}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in files:
        (snap / f.name).write_bytes(f.read_bytes())
    return snap


def test_hub_id_offline_fails_in_seconds_naming_the_repo_and_files(hub_cache):
    t0 = time.perf_counter()
    with pytest.raises(vs.WeightsUnavailableError) as e:
        vs.load_model("facebook/dinov2-small")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "facebook/dinov2-small" in msg and "HF_HUB_OFFLINE" in msg and "not in the local hub cache" in msg
    assert "config.json" in msg and "model.safetensors" in msg and "weights='/path/to/dir'" in msg


def test_hub_id_offline_loads_from_the_cache(hub_cache, tmp_path):
    d = _save(tmp_path / "ckpt", "Dinov2Config", _dino(), "Dinov2Model")
    _put_in_cache(hub_cache, "someone/tiny-dinov2", list(d.iterdir()))
    vm = vs.load_model("someone/tiny-dinov2")
    assert vm.name == "someone/tiny-dinov2" and vm.load_report.ok and vm.patch_size == 14
    assert vm.spec.weights.kind == "hf" and vm.spec.weights.location == "someone/tiny-dinov2"


def test_registry_entries_can_point_at_hub_ids(hub_cache, tmp_path, monkeypatch):
    from vitscope.models.registry import REGISTRY, ModelSpec, WeightSource

    spec = ModelSpec("tiny-hf", "vit_base_patch16_224", "explicit", "supervised",
                     WeightSource("hf", "someone/tiny-vit", "hf"), model_kwargs=dict(
                         img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4, mlp_ratio=2.0,
                         num_classes=5, layer_norm_eps=1e-12), citation="a test")
    monkeypatch.setitem(REGISTRY, "tiny-hf", spec)
    t0 = time.perf_counter()
    with pytest.raises(vs.WeightsUnavailableError, match=r"someone/tiny-vit.*config\.json.*model\.safetensors"):
        vs.load_model("tiny-hf")
    assert time.perf_counter() - t0 < 10
    d = _save(tmp_path / "ckpt", "ViTConfig", dict(SMALL, num_labels=5), "ViTForImageClassification")
    vm = vs.load_model("tiny-hf", weights=str(d))  # the way out the error names
    assert vm.load_report.ok and vm.spec.citation == "a test"
    _put_in_cache(hub_cache, "someone/tiny-vit", list(d.iterdir()))
    assert vs.load_model("tiny-hf").weights_digest == vm.weights_digest


def test_timm_hub_weights_offline_fail_in_seconds_naming_the_file(hub_cache):
    t0 = time.perf_counter()
    with pytest.raises(vs.WeightsUnavailableError) as e:
        vs.load_model("dino-b16")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "https://huggingface.co/timm/vit_base_patch16_224.dino/resolve/main/model.safetensors" in msg
    assert "weights='/path/to/model.safetensors'" in msg


def test_timm_hub_weights_offline_load_from_the_cache(hub_cache, tmp_path):
    from safetensors.torch import save_file

    small = dict(img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3)
    src = vs.load_model("vit_small_patch16_224", pretrained=False, seed=5, num_classes=0, **small)
    save_file(src.model.state_dict(), str(tmp_path / "model.safetensors"))
    _put_in_cache(hub_cache, "timm/vit_small_patch16_224.dino", [tmp_path / "model.safetensors"])
    vm = vs.load_model("vit_small_patch16_224.dino", **small)
    assert vm.weights_digest == src.weights_digest


def test_unreachable_url_fails_in_seconds(hub_cache, monkeypatch):
    """A firewall that drops packets: the probe gives up after PROBE_SECONDS, the download is never tried."""
    import socket

    import torch.hub

    from vitscope.models.registry import REGISTRY, ModelSpec, WeightSource

    def silent(*a, **k):  # what a dropping firewall looks like from here
        time.sleep(5)
        raise TimeoutError("timed out")

    def never(*a, **k):
        raise AssertionError("no download without a connection")

    monkeypatch.setattr(socket, "create_connection", silent)
    monkeypatch.setattr(torch.hub, "download_url_to_file", never)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub_cache))
    monkeypatch.setattr(fetch, "PROBE_SECONDS", 1.0)
    url = "https://weights.example.org/models/vit-s-42.pth"
    monkeypatch.setitem(REGISTRY, "far-away", ModelSpec("far-away", "vit_small_patch16_224", "none", "unknown",
                                                        WeightSource("url", url)))
    t0 = time.perf_counter()
    with pytest.raises(vs.WeightsUnavailableError) as e:
        vs.load_model("far-away")
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert url in msg and "no answer from weights.example.org:443" in msg and "weights='/path/to/file'" in msg


def test_probe_says_offline_when_nothing_listens(monkeypatch):
    import socket

    monkeypatch.setattr(fetch, "_probes", {})
    with socket.socket() as s:  # a port that was free a moment ago: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    assert "cannot connect to 127.0.0.1" in fetch.unreachable(f"http://127.0.0.1:{port}/x.pth")
    assert time.perf_counter() - t0 < 3
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        assert fetch.unreachable(f"http://127.0.0.1:{srv.getsockname()[1]}/x.pth") is None


def test_study_cache_key_follows_the_directory_files(tmp_path):
    """A study keys a transformers directory by its files (as single checkpoint files by path, size, mtime)."""
    import os

    from vitscope.models.load import resolve_spec
    from vitscope.study.cache import model_key

    d = _save(tmp_path / "vit", "ViTConfig", dict(SMALL), "ViTModel")
    spec = resolve_spec(str(d))
    key = model_key(spec, None, True, "auto", 0, {})
    assert key == model_key(resolve_spec(str(d)), None, True, "auto", 0, {})
    assert model_key(spec, str(d), True, "auto", 0, {}) == key  # weights=dir is the same checkpoint
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_key(spec, None, True, "auto", 0, {}) != key


# -- a config whose sizes its weights do not have: refused from the headers, before any model is built ------------

@pytest.mark.parametrize("change,needle", [
    (dict(hidden_size=100000), "hidden_size is 100000 in the config and 64 in the weights"),
    (dict(num_hidden_layers=10 ** 9), "num_hidden_layers is 1000000000 in the config and 3 in the weights"),
    (dict(hidden_size=8192, num_hidden_layers=64, intermediate_size=32768), "hidden_size is 8192 in the config"),
    (dict(patch_size=4), "patch_size is 4 in the config and 8 in the weights"),
    (dict(num_channels=1), "num_channels is 1 in the config and 3 in the weights"),
    (dict(image_size=64), "image_size is 64 in the config and 32 (17 position embeddings) in the weights"),
])
@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_config_sizes_that_disagree_with_the_weights_are_one_sentence_before_building(tmp_path, monkeypatch, change,
                                                                                   needle, weights):
    import resource

    import vitscope.models.load as load
    from vitscope.models import hf

    d = _save(tmp_path / "vit", "ViTConfig", dict(SMALL), "ViTModel")
    if weights == "pytorch_model.bin":
        _as_bin(d)
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **change}))
    monkeypatch.setattr(load.timm, "create_model", lambda *a, **k: pytest.fail("no model may be built"))
    monkeypatch.setattr(hf, "read_state_dict", lambda *a: pytest.fail("no weight may be read"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(vs.CheckpointError) as e:
        vs.load_model(str(d))
    assert needle in str(e.value) and str(d / "config.json") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(vs.VitscopeError) as e:  # what fits loads with strict=False: these are refused still
        vs.load_model(str(d), strict=False)
    assert str(d / "config.json") in str(e.value) and "\n" not in str(e.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_a_consistent_directory_passes_the_size_check_in_every_family(tmp_path):
    from vitscope.models import hf

    for name, config_cls, config_kw, model_cls, _ in CASES:
        d = _save(tmp_path / name, config_cls, config_kw, model_cls)
        hf.check_sizes(d, hf.read_config(d))  # raises on any disagreement
    d = _as_bin(_save(tmp_path / "bin", "DeiTConfig", dict(SMALL, num_labels=4),
                      "DeiTForImageClassificationWithTeacher"))
    assert vs.load_model(str(d)).load_report.ok


def _as_bin(d):
    """The directory's weights as pytorch_model.bin (a torch.save'd state dict), its safetensors file removed."""
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    return d
