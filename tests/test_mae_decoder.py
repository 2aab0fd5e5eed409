"""MAE's pixel decoder as more blocks of the model (`vitscope.models.mae_decoder`, ``decoder: true``): a random
checkpoint in the official ``models_mae.py`` layout, its decoder checked against a hand-run in plain torch ops."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import vitscope as vs
from vitscope.errors import ConfigError, VitscopeError
from vitscope.models.adapter import block_label

ENC = dict(embed_dim=32, depth=2, num_heads=2, patch=16, img=64)  # 4x4 patches + CLS
DEC = dict(dim=64, depth=2, heads=2)  # 64 / 32 = 2 heads: MAE's convention, no override needed
LOAD_KW = dict(num_heads=ENC["num_heads"])  # the encoder's heads (a bare file says embed_dim / 64)


def _block_params(g: torch.Generator, prefix: str, d: int, ratio: int = 4) -> dict[str, torch.Tensor]:
    r = lambda *s: 0.2 * torch.randn(*s, generator=g)  # noqa: E731
    return {f"{prefix}.norm1.weight": 1 + r(d), f"{prefix}.norm1.bias": r(d),
            f"{prefix}.attn.qkv.weight": r(3 * d, d), f"{prefix}.attn.qkv.bias": r(3 * d),
            f"{prefix}.attn.proj.weight": r(d, d), f"{prefix}.attn.proj.bias": r(d),
            f"{prefix}.norm2.weight": 1 + r(d), f"{prefix}.norm2.bias": r(d),
            f"{prefix}.mlp.fc1.weight": r(ratio * d, d), f"{prefix}.mlp.fc1.bias": r(ratio * d),
            f"{prefix}.mlp.fc2.weight": r(d, ratio * d), f"{prefix}.mlp.fc2.bias": r(d)}


def official_mae_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random MAE pretraining state dict named exactly as facebookresearch/mae ``models_mae.py`` names it."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.2 * torch.randn(*s, generator=g)  # noqa: E731
    D, p, n = ENC["embed_dim"], ENC["patch"], (ENC["img"] // ENC["patch"]) ** 2
    d = DEC["dim"]
    sd = {"cls_token": r(1, 1, D), "pos_embed": r(1, 1 + n, D), "patch_embed.proj.weight": r(D, 3, p, p),
          "patch_embed.proj.bias": r(D), "norm.weight": 1 + r(D), "norm.bias": r(D)}
    for i in range(ENC["depth"]):
        sd.update(_block_params(g, f"blocks.{i}", D))
    sd.update({"mask_token": r(1, 1, d), "decoder_embed.weight": r(d, D), "decoder_embed.bias": r(d),
               "decoder_pos_embed": r(1, 1 + n, d), "decoder_norm.weight": 1 + r(d), "decoder_norm.bias": r(d),
               "decoder_pred.weight": r(p * p * 3, d), "decoder_pred.bias": r(p * p * 3)})
    for i in range(DEC["depth"]):
        sd.update(_block_params(g, f"decoder_blocks.{i}", d))
    return sd


@pytest.fixture
def mae_file(tmp_path):
    path = tmp_path / "mae_visualize_vit_tiny.pth"
    torch.save({"model": official_mae_state_dict()}, path)
    return path


# ---------------------------------------------------------------- the reference: plain torch ops

def _ln(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _block(x, sd, prefix, heads):
    """A pre-norm transformer block by hand: x + proj(softmax(q kᵀ / √d) v), then x + fc2(gelu(fc1(ln x)))."""
    P = lambda k: sd[f"{prefix}.{k}"]  # noqa: E731
    B, T, D = x.shape
    h = _ln(x, P("norm1.weight"), P("norm1.bias"))
    qkv = (h @ P("attn.qkv.weight").T + P("attn.qkv.bias")).reshape(B, T, 3, heads, D // heads)
    q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # (B, H, T, d)
    a = torch.softmax(q @ k.transpose(-1, -2) / (D // heads) ** 0.5, dim=-1)
    o = (a @ v).transpose(1, 2).reshape(B, T, D)
    x = x + o @ P("attn.proj.weight").T + P("attn.proj.bias")
    h = _ln(x, P("norm2.weight"), P("norm2.bias"))
    m = F.gelu(h @ P("mlp.fc1.weight").T + P("mlp.fc1.bias"))
    return x + m @ P("mlp.fc2.weight").T + P("mlp.fc2.bias")


def hand_run(sd, images):
    """The MAE encoder then its decoder on every token (no masking), as models_mae.py's forward_encoder and
    forward_decoder compute them: the outputs of every block, the decoder's norm and the per-patch pixels."""
    p = ENC["patch"]
    B = images.shape[0]
    patches = images.unfold(2, p, p).unfold(3, p, p)  # (B, 3, h, w, p, p)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(B, -1, 3 * p * p)
    x = patches @ sd["patch_embed.proj.weight"].reshape(ENC["embed_dim"], -1).T + sd["patch_embed.proj.bias"]
    x = torch.cat([sd["cls_token"].expand(B, -1, -1), x], 1) + sd["pos_embed"]
    outs = []
    for i in range(ENC["depth"]):
        x = _block(x, sd, f"blocks.{i}", ENC["num_heads"])
        outs.append(x)
    x = _ln(x, sd["norm.weight"], sd["norm.bias"])
    x = x @ sd["decoder_embed.weight"].T + sd["decoder_embed.bias"] + sd["decoder_pos_embed"]
    for i in range(DEC["depth"]):
        x = _block(x, sd, f"decoder_blocks.{i}", DEC["heads"])
        outs.append(x)
    normed = _ln(x, sd["decoder_norm.weight"], sd["decoder_norm.bias"])
    pixels = (normed @ sd["decoder_pred.weight"].T + sd["decoder_pred.bias"])[:, 1:]
    return outs, normed, pixels


# ---------------------------------------------------------------- tests

def test_decoder_taps_equal_a_hand_run_of_the_official_weights(mae_file):
    vm = vs.load_model(str(mae_file), decoder=True, **LOAD_KW)
    E, L = ENC["depth"], ENC["depth"] + DEC["depth"]
    assert vm.decoder_from == E and vm.depth == L and vm.info().decoder_from == E
    assert vm.model.num_classes == 0 and not vm.any_size
    rep = vm.load_report
    assert not rep.dropped
    assert {"decoder_embed.weight", "mask_token", "decoder_blocks.1.mlp.fc2.bias"} <= set(rep.loaded)
    images = torch.randn(3, 3, ENC["img"], ENC["img"], generator=torch.Generator().manual_seed(1))
    taps = [f"block{i}.out" for i in range(L)] + ["final_norm", "logits"]
    got = vs.extract(vm, images, taps)
    outs, normed, pixels = hand_run({k: v.double() for k, v in official_mae_state_dict().items()}, images.double())
    for i in range(L):
        torch.testing.assert_close(got[f"block{i}.out"].double(), outs[i], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got["final_norm"].double(), normed, atol=2e-5, rtol=1e-4)
    n = (ENC["img"] // ENC["patch"]) ** 2
    assert got["logits"].shape == (3, n, ENC["patch"] ** 2 * 3)
    torch.testing.assert_close(got["logits"].double(), pixels, atol=2e-5, rtol=1e-4)


def test_decoder_block_internals_are_real_taps(mae_file):
    """Hooks on the decoder's timm blocks: attention rows sum to 1 over all tokens, out = resid_mid + mlp_out."""
    vm = vs.load_model(str(mae_file), decoder=True, **LOAD_KW)
    images = torch.randn(2, 3, ENC["img"], ENC["img"])
    got = vs.extract(vm, images, ["block3.attn", "block3.resid_mid", "block3.mlp_out", "block3.out"])
    assert got["block3.attn"].shape == (2, DEC["heads"], 17, 17)
    torch.testing.assert_close(got["block3.attn"].sum(-1), torch.ones(2, DEC["heads"], 17))
    torch.testing.assert_close(got["block3.out"], got["block3.resid_mid"] + got["block3.mlp_out"])


def test_without_decoder_the_file_loads_as_before(mae_file):
    vm = vs.load_model(str(mae_file), **LOAD_KW)
    sd = official_mae_state_dict()
    decoder_keys = {k for k in sd if k.startswith("decoder_") or k == "mask_token"}
    assert vm.decoder_from is None and vm.depth == ENC["depth"] and vm.any_size
    assert set(vm.load_report.dropped) == decoder_keys
    assert all(r == "MAE decoder" for r in vm.load_report.dropped.values())
    assert set(vm.load_report.loaded) == set(sd) - decoder_keys


def test_decoder_heads_override_and_convention(mae_file):
    vm = vs.load_model(str(mae_file), decoder=True, decoder_num_heads=4, **LOAD_KW)
    assert int(vm.model.blocks[ENC["depth"]].attn.num_heads) == 4
    assert any("decoder_num_heads" in n for n in vs.load_model(str(mae_file), decoder=True, **LOAD_KW)
               .load_report.notes)


def _one_sentence(e: BaseException, name: str) -> None:
    msg = str(e)
    assert "\n" not in msg and name in msg and "decoder" in msg


def test_decoder_on_a_model_without_one_is_one_sentence(tmp_path):
    sd = {k: v for k, v in official_mae_state_dict().items() if not k.startswith(("decoder_", "mask_token"))}
    path = tmp_path / "encoder_only.pth"
    torch.save({"model": sd}, path)
    with pytest.raises(ConfigError) as e:
        vs.load_model(str(path), decoder=True, **LOAD_KW)
    _one_sentence(e.value, "encoder_only")
    with pytest.raises(ConfigError) as e:
        vs.load_model("vit_small_patch16_224", pretrained=False, decoder=True, depth=1)
    _one_sentence(e.value, "vit_small_patch16_224")


def test_config_refuses_decoder_without_a_checkpoint(tmp_path):
    from vitscope.study import load_config

    (tmp_path / "s.yaml").write_text("""
models:
  - {name: vit_small_patch16_224, label: rnd, pretrained: false, decoder: true,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
dataset: {name: synthetic-shapes, n_images: 8}
analyses: {fourier: {}}
""")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "s.yaml")
    _one_sentence(e.value, "rnd")


def test_decoder_model_has_its_own_cache_key(mae_file):
    from vitscope.study.config import ModelConfig
    from vitscope.study.keys import model_key

    plain = ModelConfig(name=str(mae_file), kwargs=dict(LOAD_KW))
    dec = ModelConfig(name=str(mae_file), kwargs=dict(LOAD_KW), decoder=True)
    assert model_key(plain)[1] != model_key(dec)[1]
    assert model_key(dec)[1] == model_key(ModelConfig(name=str(mae_file), kwargs=dict(LOAD_KW), decoder=True))[1]


def test_head_readouts_refuse_the_decoder(mae_file):
    from vitscope.analyses import get_analysis

    vm = vs.load_model(str(mae_file), decoder=True, **LOAD_KW)
    with pytest.raises(VitscopeError) as e:
        get_analysis("logit_lens")(vm, readout="head")
    assert "\n" not in str(e.value) and "head" in str(e.value)


def test_block_label():
    class M:
        decoder_from = 12

    assert block_label(M(), 3) == "block 3" and block_label(M(), 12) == "decoder 0" and block_label(M(), 14) == \
        "decoder 2"
    assert block_label(object(), 14) == "block 14"


def test_fourier_study_labels_decoder_blocks(tmp_path, mae_file):
    from study_fixtures import run_study_text

    from vitscope.report.figures.geometry import fourier

    tables, _ = run_study_text(tmp_path, f"""
models:
  - {{name: {mae_file}, label: mae-dec, decoder: true, kwargs: {{num_heads: 2}}}}
dataset: {{name: synthetic-shapes, n_images: 4}}
analyses: {{fourier: {{}}}}
batch_size: 4
progress: false
""")
    df = tables["fourier"]
    high = df[df.metric == "high_freq_delta_log_amp"].sort_values("layer")
    assert list(high["layer"]) == [0, 1, 2, 3]
    assert list(high["block_label"]) == ["block 0", "block 1", "decoder 0", "decoder 1"]
    figs = fourier(df)
    ticks = [t.get_text() for t in figs[0][1].axes[0].get_xticklabels()]
    assert "decoder 1" in ticks and "block 0" in ticks


def test_block_updates_reads_the_decoders_first_block_from_its_embedded_input(mae_file):
    """The stream entering the decoder is the encoder's output normed and embedded at the decoder's width: the
    displacement of the first decoder block is measured from it (not from the encoder's last output, another width),
    and the rows name the decoder's blocks; the token picture keeps blocks of both widths."""
    import numpy as np

    from vitscope.analyses import get_analysis
    from vitscope.capture import stream
    from vitscope.data import SyntheticShapes

    vm = vs.load_model(str(mae_file), decoder=True, **LOAD_KW)
    E = ENC["depth"]
    batches = list(SyntheticShapes(n=4, seed=0).batches(4, vm.preprocessing))
    a = get_analysis("block_updates")(vm, picture_layers=[E - 1, E], keep_images=1)
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    sd = {k: v.double() for k, v in official_mae_state_dict().items()}
    outs, _, _ = hand_run(sd, batches[0].images.double())
    x = _ln(outs[E - 1], sd["norm.weight"], sd["norm.bias"])
    x_in = x @ sd["decoder_embed.weight"].T + sd["decoder_embed.bias"] + sd["decoder_pos_embed"]
    disp = ((outs[E] - x_in).norm(dim=-1) / x_in.norm(dim=-1))[:, 1:].mean(1).mean().item()
    row = df[(df.metric == "displacement") & (df.layer == E) & (df.token_view == "spatial")]
    assert row.value.item() == pytest.approx(disp, rel=1e-4)
    assert row.block_label.item() == "decoder 0"
    assert set(df[df.metric == "token_position"].layer) == {E - 1, E}
    assert np.isfinite(df[df.metric == "token_position"].x_after).all()


def test_the_decoder_model_beside_the_encoder_alone_gets_its_own_label(tmp_path, mae_file):
    from vitscope.study import load_config

    (tmp_path / "s.yaml").write_text(f"""
models:
  - {{name: {mae_file}, kwargs: {{num_heads: 2}}}}
  - {{name: {mae_file}, decoder: true, kwargs: {{num_heads: 2}}}}
dataset: {{name: synthetic-shapes, n_images: 8}}
analyses: {{fourier: {{}}}}
""")
    labels = [m.label or m.name for m in load_config(tmp_path / "s.yaml").models]
    assert labels == [str(mae_file), f"{mae_file} + decoder"]
