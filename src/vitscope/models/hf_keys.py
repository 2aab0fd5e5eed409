"""transformers state-dict keys -> timm keys: the per-family renaming tables of `vitscope.models.hf` and the
helpers that apply them (renaming, joining q/k/v, splitting off the task model's prefix). Pure tables and dict
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


def _split_prefix(sd: Mapping[str, Tensor]) -> tuple[str, dict[str, Tensor], dict[str, Tensor]]:
    """(prefix, base model keys without it, the task model's own keys: heads, decoders, text tower)."""
    for p in _BASE_PREFIXES:
        if any(k.startswith(p + "embeddings.") for k in sd):
            return (p, {k[len(p):]: v for k, v in sd.items() if k.startswith(p)},
                    {k: v for k, v in sd.items() if not k.startswith(p)})
    return "", dict(sd), {}

