"""transformers state-dict keys -> timm keys: the per-family renaming tables of `vitscope.models.hf` and the
helpers that apply them (renaming, joining q/k/v, splitting nn.MultiheadAttention's packed projection, SigLIP 2's
linear patch embedding as a convolution kernel, splitting off the task model's prefix). Pure tables and dict
work on tensors; `hf.convert` applies them to a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------------
# Weights: transformers names -> timm names

_BASE_PREFIXES = ("vit.", "deit.", "dinov2.", "dinov2_with_registers.", "beit.", "data2vec_vision.",
                  "vision_model.")
_DROP_BASE = [  # (pattern on the base model's keys, reason)
    (r"^embeddings\.mask_token$", "mask token (masked-image-modelling pretraining only)"),
    (r"^embeddings\.position_ids$", "position ids (recomputed by the model)"),
    (r"relative_position_index$", "relative position index (recomputed by the model)"),
    (r"^pooler\.dense\.", "transformers pooler (dense + tanh on the class token; not part of a timm ViT)"),
]
_L = r"^encoder\.layers?\.(\d+)\."  # 'encoder.layer.N.' (ViT, BEiT, DINOv2) or 'encoder.layers.N.' (CLIP)
_VIT_RULES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.(weight|bias)$", r"patch_embed.proj.\1"),
    (r"^embeddings\.register_tokens$", "reg_token"),
    (_L + r"attention\.attention\.(query|key|value)\.(weight|bias)$", r"blocks.\1.attn.\2.\3"),
    (_L + r"attention\.output\.dense\.(weight|bias)$", r"blocks.\1.attn.proj.\2"),
    (_L + r"(?:layernorm_before|norm1)\.(weight|bias)$", r"blocks.\1.norm1.\2"),
    (_L + r"(?:layernorm_after|norm2)\.(weight|bias)$", r"blocks.\1.norm2.\2"),
    (_L + r"(?:intermediate\.dense|mlp\.fc1|mlp\.weights_in)\.(weight|bias)$", r"blocks.\1.mlp.fc1.\2"),
    (_L + r"(?:output\.dense|mlp\.fc2|mlp\.weights_out)\.(weight|bias)$", r"blocks.\1.mlp.fc2.\2"),
    (_L + r"layer_scale1\.lambda1$", r"blocks.\1.ls1.gamma"),
    (_L + r"layer_scale2\.lambda1$", r"blocks.\1.ls2.gamma"),
    (r"^layernorm\.(weight|bias)$", r"norm.\1"),
]
_CLIP_RULES = [
    (r"^embeddings\.class_embedding$", "cls_token"),
    (r"^embeddings\.position_embedding\.weight$", "pos_embed"),
    (r"^embeddings\.patch_embedding\.weight$", "patch_embed.proj.weight"),
    (r"^pre_layrnorm\.(weight|bias)$", r"norm_pre.\1"),
    (_L + r"self_attn\.(q|k|v)_proj\.(weight|bias)$", r"blocks.\1.attn.\2.\3"),
    (_L + r"self_attn\.out_proj\.(weight|bias)$", r"blocks.\1.attn.proj.\2"),
    (_L + r"layer_norm1\.(weight|bias)$", r"blocks.\1.norm1.\2"),
    (_L + r"layer_norm2\.(weight|bias)$", r"blocks.\1.norm2.\2"),
    (_L + r"mlp\.(fc1|fc2)\.(weight|bias)$", r"blocks.\1.mlp.\2.\3"),
    (r"^post_layernorm\.(weight|bias)$", r"norm.\1"),
]
_BEIT_RULES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.(weight|bias)$", r"patch_embed.proj.\1"),
    (r"^encoder\.relative_position_bias\.relative_position_bias_table$", "rel_pos_bias.relative_position_bias_table"),
    (_L + r"attention\.attention\.relative_position_bias\.relative_position_bias_table$",
     r"blocks.\1.attn.relative_position_bias_table"),
    (_L + r"attention\.attention\.(query|key|value)\.(weight|bias)$", r"blocks.\1.attn.\2.\3"),
    (_L + r"attention\.output\.dense\.(weight|bias)$", r"blocks.\1.attn.proj.\2"),
    (_L + r"layernorm_before\.(weight|bias)$", r"blocks.\1.norm1.\2"),
    (_L + r"layernorm_after\.(weight|bias)$", r"blocks.\1.norm2.\2"),
    (_L + r"intermediate\.dense\.(weight|bias)$", r"blocks.\1.mlp.fc1.\2"),
    (_L + r"output\.dense\.(weight|bias)$", r"blocks.\1.mlp.fc2.\2"),
    (_L + r"lambda_1$", r"blocks.\1.gamma_1"),
    (_L + r"lambda_2$", r"blocks.\1.gamma_2"),
    (r"^layernorm\.(weight|bias)$", r"norm.\1"),
    (r"^pooler\.layernorm\.(weight|bias)$", r"fc_norm.\1"),
]

# DINOv3 (`DINOv3ViTModel`): its blocks are saved as ``layer.N`` (``model.layer.N`` in the module tree, which
# transformers renames on loading); the MLP is a plain or a gated one
_D3 = r"^(?:model\.)?layer\.(\d+)\."
_DINOV3_RULES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.register_tokens$", "reg_token"),  # DINOv3's storage tokens
    (r"^embeddings\.patch_embeddings\.(weight|bias)$", r"patch_embed.proj.\1"),
    (_D3 + r"attention\.(q|k|v)_proj\.(weight|bias)$", r"blocks.\1.attn.\2.\3"),
    (_D3 + r"attention\.o_proj\.(weight|bias)$", r"blocks.\1.attn.proj.\2"),
    (_D3 + r"(norm1|norm2)\.(weight|bias)$", r"blocks.\1.\2.\3"),
    (_D3 + r"layer_scale1\.lambda1$", r"blocks.\1.gamma_1"),  # Eva's layer scale: bare parameters
    (_D3 + r"layer_scale2\.lambda1$", r"blocks.\1.gamma_2"),
    (_D3 + r"mlp\.down_proj\.(weight|bias)$", r"blocks.\1.mlp.fc2.\2"),
    (r"^norm\.(weight|bias)$", r"norm.\1"),
]
_DINOV3_MLP = [(_D3 + r"mlp\.up_proj\.(weight|bias)$", r"blocks.\1.mlp.fc1.\2")]
_DINOV3_GATED_MLP = [  # timm's SwiGLU: fc2(silu(fc1_g(x)) * fc1_x(x))
    (_D3 + r"mlp\.gate_proj\.(weight|bias)$", r"blocks.\1.mlp.fc1_g.\2"),
    (_D3 + r"mlp\.up_proj\.(weight|bias)$", r"blocks.\1.mlp.fc1_x.\2"),
]
# SigLIP / SigLIP 2 vision towers: CLIP's layer names, a patch bias, no class token, and the MAP head
# (``head.*``: a probe attending to the tokens through nn.MultiheadAttention, then LayerNorm + MLP), which is
# timm's AttentionPoolLatent; its packed ``in_proj`` is split into q and kv by `split_in_proj`
_SIGLIP_RULES = [
    (r"^embeddings\.patch_embedding\.(weight|bias)$", r"patch_embed.proj.\1"),
    *_CLIP_RULES,
    (r"^head\.probe$", "attn_pool.latent"),
    (r"^head\.attention\.in_proj_(weight|bias)$", r"attn_pool.in_proj.\1"),
    (r"^head\.attention\.out_proj\.(weight|bias)$", r"attn_pool.proj.\1"),
    (r"^head\.layernorm\.(weight|bias)$", r"attn_pool.norm.\1"),
    (r"^head\.mlp\.(fc1|fc2)\.(weight|bias)$", r"attn_pool.mlp.\1.\2"),
]
# AIMv2 vision towers: RMSNorm after the patch projection and in the blocks, SwiGLU ``ffn``
_AIMV2_RULES = [
    (r"^embeddings\.patch_embed\.(weight|bias)$", r"patch_embed.proj.\1"),
    (r"^embeddings\.rms_norm\.weight$", "patch_embed.norm.weight"),
    (r"^embeddings\.position_embedding\.weight$", "pos_embed"),
    (_L + r"attention\.(q|k|v)_proj\.(weight|bias)$", r"blocks.\1.attn.\2.\3"),
    (_L + r"attention\.out_proj\.(weight|bias)$", r"blocks.\1.attn.proj.\2"),
    (_L + r"rms_norm1\.weight$", r"blocks.\1.norm1.weight"),
    (_L + r"rms_norm2\.weight$", r"blocks.\1.norm2.weight"),
    (_L + r"ffn\.gate_proj\.(weight|bias)$", r"blocks.\1.mlp.fc1_g.\2"),
    (_L + r"ffn\.up_proj\.(weight|bias)$", r"blocks.\1.mlp.fc1_x.\2"),
    (_L + r"ffn\.down_proj\.(weight|bias)$", r"blocks.\1.mlp.fc2.\2"),
    (r"^rms_norm\.weight$", "norm.weight"),
]
_QKV = {"query": "q", "key": "k", "value": "v", "q": "q", "k": "k", "v": "v"}


def _rename(sd: Mapping[str, Tensor], rules: list[tuple[str, str]]) -> dict[str, Tensor]:
    """Keys matching a rule are renamed; the others keep their name (and are reported as unexpected)."""
    compiled = [(re.compile(p), r) for p, r in rules]
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        for rx, repl in compiled:
            m = rx.match(k)
            if m:
                k = m.expand(repl)
                break
        out[k] = v
    return out


def _join_qkv(sd: dict[str, Tensor], beit: bool) -> dict[str, Tensor]:
    """``blocks.N.attn.{query,key,value}.*`` -> timm's fused ``qkv`` (BEiT: ``q_bias``/``v_bias``, no k bias).
    Blocks missing one of the three keep the separate names, so the strict report names them."""
    rx = re.compile(r"^blocks\.(\d+)\.attn\.(query|key|value|q|k|v)\.(weight|bias)$")
    parts: dict[tuple[str, str], dict[str, str]] = {}
    for k in sd:
        m = rx.match(k)
        if m:
            parts.setdefault((m.group(1), m.group(3)), {})[_QKV[m.group(2)]] = k
    for (i, kind), names in parts.items():
        if kind == "bias" and beit and "k" not in names and set(names) == {"q", "v"}:
            sd[f"blocks.{i}.attn.q_bias"] = sd.pop(names["q"])
            sd[f"blocks.{i}.attn.v_bias"] = sd.pop(names["v"])
        elif set(names) == {"q", "k", "v"}:
            sd[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([sd.pop(names[c]) for c in "qkv"])
    return sd


def split_in_proj(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """nn.MultiheadAttention's packed ``in_proj`` (q, k, v stacked) -> AttentionPoolLatent's ``q`` and ``kv``."""
    for kind in ("weight", "bias"):
        packed = sd.pop(f"attn_pool.in_proj.{kind}", None)
        if packed is not None:
            dim = packed.shape[0] // 3
            sd[f"attn_pool.q.{kind}"], sd[f"attn_pool.kv.{kind}"] = packed[:dim], packed[dim:]
    return sd


def linear_patches_to_conv(weight: Tensor, patch: int, channels: int) -> Tensor:
    """SigLIP 2's patch embedding, an nn.Linear over patches its image processor flattens as (row in the patch,
    column in the patch, channel) (``convert_image_to_patches``), as the (D, C, p, p) kernel of a stride-p
    convolution that computes the same."""
    return weight.reshape(weight.shape[0], patch, patch, channels).permute(0, 3, 1, 2).contiguous()


def _split_prefix(sd: Mapping[str, Tensor]) -> tuple[str, dict[str, Tensor], dict[str, Tensor]]:
    """(prefix, base model keys without it, the task model's own keys: heads, decoders, text tower)."""
    for p in _BASE_PREFIXES:
        if any(k.startswith(p + "embeddings.") for k in sd):
            return (p, {k[len(p):]: v for k, v in sd.items() if k.startswith(p)},
                    {k: v for k, v in sd.items() if not k.startswith(p)})
    return "", dict(sd), {}

