"""The transformers families vitscope converts, per ``model_type``: what a config.json leaves out (transformers'
defaults), the timm architecture and arguments a config implies (`architecture`), the preprocessing
(`preprocessing`), and the state dict renamed to timm's keys (`convert`; the key rules are in hf_keys.py). Nothing
here reads a file: `vitscope.models.hf` reads directories and config.json, checks sizes, fetches and builds.

  model_type                timm model                      what the checkpoint implies
  vit, vit_mae              VisionTransformer               LayerNorm eps 1e-12; HF pooler (dense+tanh) dropped
  deit                      VisionTransformer (reg_tokens=1) the distillation token is a second prefix token;
                            or VisionTransformerDistilled    ... with both heads (logits = mean of the two)
  dinov2(_with_registers)   VisionTransformer               layer scale, registers, SwiGLU for the giant;
                                                            classifier on [CLS, mean of patches] (`hf.ClsMeanHead`)
  clip, clip_vision_model   VisionTransformer               pre-norm, QuickGELU, projection as the head
  beit, data2vec-vision     Beit                            q/v biases, relative position bias (per block or
                                                            shared), layer scale, mean pooling into fc_norm
  dinov3_vit                Eva (timm's *_dinov3[_qkvb])    CLS + storage tokens (``reg_token``), RoPE on the
                                                            patch tokens ('dinov3' type, rotate-half, any input
                                                            size), layer scale, q/v biases (no key bias), SwiGLU
                                                            for the gated ones; CLS after the final norm pools
  siglip, siglip_vision_model VisionTransformer             no class token, GELU (tanh), the MAP head as timm's
                            (global_pool='map')             AttentionPoolLatent (``attn_pool``: in_proj split into
                                                            q and kv); full SiglipModel: the text tower dropped;
                                                            the classifier: mean of the normalised tokens
  siglip2, siglip2_vision_model  as SigLIP                  NaFlex: see below
  aimv2, aimv2_vision_model VisionTransformer (timm aimv2)  RMSNorm, SwiGLU (fc1_g/fc1_x), no class token, mean
                                                            pooling; the attention-pooling head, the image
                                                            projection and the text tower are dropped; native
                                                            resolution: the sine-cosine position embedding is
                                                            computed for the grid the model is built at

SigLIP 2 in transformers is the NaFlex variant: the processor cuts each image, resized to keep its aspect ratio
within ``max_num_patches``, into patches flattened as (row, column, channel) that an nn.Linear embeds, and the
stored square grid of position embeddings is resized to each image's patch grid. The conversion is to a fixed
square input at the stored grid (``sqrt(num_patches) * patch_size`` pixels a side), where the linear layer is
exactly a stride-``patch_size`` convolution and the position embeddings are used as stored. Not reproduced:
variable aspect ratios and sequence lengths (other square sizes interpolate the position embeddings bicubically,
not with NaFlex's antialiased bilinear resize), and padding masks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vitscope.errors import CheckpointError
from vitscope.models.hf_keys import (
    _AIMV2_RULES,
    _BEIT_RULES,
    _CLIP_RULES,
    _DINOV3_GATED_MLP,
    _DINOV3_MLP,
    _DINOV3_RULES,
    _DROP_BASE,
    _SIGLIP_RULES,
    _VIT_RULES,
    _join_qkv,
    _rename,
    _split_prefix,
    linear_patches_to_conv,
    split_in_proj,
)
from vitscope.models.layouts import Converted
from vitscope.models.registry import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INCEPTION_MEAN,
    INCEPTION_STD,
    Preprocessing,
)

Tensor = torch.Tensor

# transformers' config defaults (what a config.json may leave out), per family
_VIT = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            hidden_act="gelu", layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3, qkv_bias=True)
_DINOV2 = dict(_VIT, intermediate_size=None, mlp_ratio=4.0, layer_norm_eps=1e-6, patch_size=14,
               layerscale_value=1.0, use_swiglu_ffn=False)
_CLIP = dict(_VIT, hidden_act="quick_gelu", layer_norm_eps=1e-5, patch_size=32, projection_dim=512)
_BEIT = dict(_VIT, use_absolute_position_embeddings=False, use_relative_position_bias=False,
             use_shared_relative_position_bias=False, layer_scale_init_value=0.1, use_mean_pooling=True)
_DINOV3 = dict(_VIT, hidden_size=384, num_attention_heads=6, intermediate_size=1536, layer_norm_eps=1e-5,
               rope_theta=100.0, query_bias=True, key_bias=False, value_bias=True, proj_bias=True, mlp_bias=True,
               layerscale_value=1.0, use_gated_mlp=False, num_register_tokens=0)
_SIGLIP = dict(_VIT, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True)
_SIGLIP2 = dict(_SIGLIP, num_patches=256)
_AIMV2 = dict(_VIT, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=8,
              hidden_act="silu", patch_size=14, rms_norm_eps=1e-5, qkv_bias=False, mlp_bias=False, use_head=True,
              is_native=False)
DEFAULTS: dict[str, dict[str, Any]] = {
    "vit": _VIT, "deit": _VIT, "vit_mae": _VIT, "dinov2": _DINOV2,
    "dinov2_with_registers": dict(_DINOV2, patch_size=16, num_register_tokens=4),
    "clip": _CLIP, "clip_vision_model": _CLIP, "beit": _BEIT, "data2vec-vision": _BEIT,
    "dinov3_vit": _DINOV3, "siglip": _SIGLIP, "siglip_vision_model": _SIGLIP, "siglip2": _SIGLIP2,
    "siglip2_vision_model": _SIGLIP2, "aimv2": _AIMV2, "aimv2_vision_model": _AIMV2,
}
SUPPORTED = tuple(DEFAULTS)
#: families whose config.json nests the vision tower's numbers in ``vision_config`` (image-text models)
_NESTED = ("clip", "siglip", "siglip2", "aimv2")
_SIGLIPS = ("siglip", "siglip_vision_model", "siglip2", "siglip2_vision_model")
_AIMV2S = ("aimv2", "aimv2_vision_model")
#: text towers saved on their own: (the model they belong to, what to pass instead)
_TEXT_TOWERS = {
    "clip_text_model": ("CLIP", "clip_vision_model or clip"),
    "siglip_text_model": ("SigLIP", "siglip_vision_model or siglip"),
    "siglip2_text_model": ("SigLIP 2", "siglip2_vision_model or siglip2"),
    "aimv2_text_model": ("AIMv2", "aimv2_vision_model or aimv2"),
}

# Preprocessing when the checkpoint has no preprocessor_config.json: the family's image processor defaults
# (DINOv2 and ViT-MAE: the normalisation they were trained with).
_FAMILY_PRE: dict[str, tuple[tuple[float, ...], tuple[float, ...], float, str]] = {
    "vit": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bilinear"),
    "deit": (IMAGENET_MEAN, IMAGENET_STD, 224 / 256, "bicubic"),
    "vit_mae": (IMAGENET_MEAN, IMAGENET_STD, 1.0, "bicubic"),
    "dinov2": (IMAGENET_MEAN, IMAGENET_STD, 224 / 256, "bicubic"),
    "dinov2_with_registers": (IMAGENET_MEAN, IMAGENET_STD, 224 / 256, "bicubic"),
    "clip": (CLIP_MEAN, CLIP_STD, 1.0, "bicubic"),
    "clip_vision_model": (CLIP_MEAN, CLIP_STD, 1.0, "bicubic"),
    "beit": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bicubic"),
    "data2vec-vision": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bicubic"),
    "dinov3_vit": (IMAGENET_MEAN, IMAGENET_STD, 1.0, "bilinear"),
    "siglip": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bicubic"),
    "siglip_vision_model": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bicubic"),
    "siglip2": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bilinear"),
    "siglip2_vision_model": (INCEPTION_MEAN, INCEPTION_STD, 1.0, "bilinear"),
    "aimv2": (CLIP_MEAN, CLIP_STD, 1.0, "bicubic"),
    "aimv2_vision_model": (CLIP_MEAN, CLIP_STD, 1.0, "bicubic"),
}
_PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}

_CITATIONS = {
    "vit": "Dosovitskiy et al., An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale "
           "(ICLR 2021)",
    "deit": "Touvron et al., Training data-efficient image transformers & distillation through attention "
            "(ICML 2021)",
    "vit_mae": "He et al., Masked Autoencoders Are Scalable Vision Learners (CVPR 2022)",
    "dinov2": "Oquab et al., DINOv2: Learning Robust Visual Features without Supervision (TMLR 2024)",
    "dinov2_with_registers": "Oquab et al., DINOv2: Learning Robust Visual Features without Supervision "
                             "(TMLR 2024); Darcet et al., Vision Transformers Need Registers (ICLR 2024)",
    "clip": "Radford et al., Learning Transferable Visual Models From Natural Language Supervision (ICML 2021)",
    "beit": "Bao et al., BEiT: BERT Pre-Training of Image Transformers (ICLR 2022)",
    "data2vec-vision": "Baevski et al., data2vec: A General Framework for Self-supervised Learning in Speech, "
                       "Vision and Language (ICML 2022)",
}
_CITATIONS.update({
    "dinov3_vit": "Siméoni et al., DINOv3 (2025)",
    "siglip": "Zhai et al., Sigmoid Loss for Language Image Pre-Training (ICCV 2023)",
    "siglip2": "Tschannen et al., SigLIP 2: Multilingual Vision-Language Encoders with Improved Semantic "
               "Understanding, Localization, and Dense Features (2025)",
    "aimv2": "Fini et al., Multimodal Autoregressive Pre-training of Large Vision Encoders (CVPR 2025)",
})
for _mt in ("clip", "siglip", "siglip2", "aimv2"):
    _CITATIONS[f"{_mt}_vision_model"] = _CITATIONS[_mt]

_ACT = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
        "relu": "relu", "silu": "silu", "swish": "silu"}


# --------------------------------------------------------------------------------------------------
# Architecture and preprocessing from the config

def _ratio(hidden: int, dim: int) -> float:
    """An mlp_ratio for which timm's ``int(dim * ratio)`` gives exactly ``hidden``."""
    r = hidden / dim
    return r if int(dim * r) == hidden else (hidden + 0.5) / dim


def _num_labels(cfg: Mapping[str, Any]) -> int:
    if cfg.get("id2label"):
        return len(cfg["id2label"])
    return int(cfg.get("num_labels") or 2)  # transformers' default is 2 labels


def _has(cfg: Mapping[str, Any], suffix: str) -> bool:
    return any(a.endswith(suffix) for a in cfg["architectures"])


def _activation(cfg: Mapping[str, Any]) -> str:
    act = cfg["hidden_act"]
    if act not in _ACT:
        raise CheckpointError(f"hidden_act {act!r} has no timm counterpart here; supported: {', '.join(_ACT)}")
    return _ACT[act]


def architecture(cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The timm architecture and its arguments for a (filled-in) config; `convert` refines them from the
    weights (head size, pooling), as the other converters do."""
    mt = cfg["model_type"]
    dim = int(cfg["hidden_size"])
    kw: dict[str, Any] = {
        "img_size": int(cfg["image_size"]), "patch_size": int(cfg["patch_size"]), "in_chans": int(cfg["num_channels"]),
        "embed_dim": dim, "depth": int(cfg["num_hidden_layers"]), "num_heads": int(cfg["num_attention_heads"]),
        "layer_norm_eps": float(cfg["layer_norm_eps"]),
    }
    if mt in ("beit", "data2vec-vision"):
        if cfg["hidden_act"] != "gelu":
            raise CheckpointError(f"a BEiT with hidden_act {cfg['hidden_act']!r} has no timm counterpart")
        mim = _has(cfg, "ForMaskedImageModeling")
        mean_pool = bool(cfg["use_mean_pooling"]) and not mim
        ls = float(cfg["layer_scale_init_value"])
        kw.update(mlp_ratio=_ratio(int(cfg["intermediate_size"]), dim), qkv_bias=True,
                  use_abs_pos_emb=bool(cfg["use_absolute_position_embeddings"]),
                  use_rel_pos_bias=bool(cfg["use_relative_position_bias"]),
                  use_shared_rel_pos_bias=bool(cfg["use_shared_relative_position_bias"]),
                  init_values=ls if ls > 0 else 0.0, global_pool="avg" if mean_pool else "token",
                  num_classes=_num_labels(cfg) if _has(cfg, "ForImageClassification") else 0)
        return "beit_base_patch16_224", kw
    if mt == "dinov3_vit":
        return _dinov3_architecture(cfg, kw)
    if mt in _AIMV2S:
        return _aimv2_architecture(cfg, kw)
    kw.update(act_layer=_activation(cfg), qkv_bias=bool(cfg.get("qkv_bias", True)), class_token=True,
              global_pool="token", num_classes=0)
    arch = "vit_base_patch16_224"
    if mt in ("dinov2", "dinov2_with_registers"):
        hidden = int(dim * float(cfg["mlp_ratio"]))
        kw["init_values"] = float(cfg["layerscale_value"]) or 1e-6  # always there (0 would drop it in timm)
        if cfg["use_swiglu_ffn"]:  # transformers keeps 2/3 of the width, rounded up to a multiple of 8
            hidden = 2 * ((int(hidden * 2 / 3) + 7) // 8 * 8)  # timm's packed SwiGLU: both halves in fc1
            arch = "vit_giant_patch14_dinov2"  # the timm model that builds a SwiGLU MLP (SiLU gate)
            kw.pop("act_layer")
        kw["mlp_ratio"] = _ratio(hidden, dim)
        if mt == "dinov2_with_registers" and int(cfg["num_register_tokens"]) > 0:
            kw.update(reg_tokens=int(cfg["num_register_tokens"]), no_embed_class=True)
        if _has(cfg, "ForImageClassification"):
            kw.update(num_classes=_num_labels(cfg), global_pool="", head_input="cls+mean")
        return arch, kw
    kw["mlp_ratio"] = _ratio(int(cfg["intermediate_size"]), dim)
    if mt in ("clip", "clip_vision_model"):
        kw["pre_norm"] = True
        if _has(cfg, "ForImageClassification"):  # mean of the un-normalised patch tokens, then the classifier
            kw.update(global_pool="avg", fc_norm=False, final_norm=False, num_classes=_num_labels(cfg))
        elif _has(cfg, "WithProjection") or "CLIPModel" in cfg["architectures"]:
            kw["num_classes"] = int(cfg["projection_dim"])
        return arch, kw
    if mt in _SIGLIPS:  # no class token; the MAP head pools, or the classifier averages the normalised tokens
        classifier = _has(cfg, "ForImageClassification")
        kw.update(class_token=False, global_pool="map" if cfg["vision_use_head"] and not classifier else "avg",
                  fc_norm=False, num_classes=_num_labels(cfg) if classifier else 0)
        return "vit_base_patch16_siglip_224", kw
    if mt == "deit":
        if _has(cfg, "WithTeacher"):
            kw["num_classes"] = _num_labels(cfg)
            return "deit_base_distilled_patch16_224", kw
        kw["reg_tokens"] = 1  # the distillation token, read by no head here
    if _has(cfg, "ForImageClassification"):
        kw["num_classes"] = _num_labels(cfg)
    return arch, kw


#: timm's DINOv3 names by (width, gated MLP); the arguments `_dinov3_architecture` passes decide the model
_DINOV3_ARCH = {(384, False): "vit_small_patch16_dinov3", (384, True): "vit_small_plus_patch16_dinov3",
                (768, False): "vit_base_patch16_dinov3", (1024, False): "vit_large_patch16_dinov3",
                (1280, True): "vit_huge_plus_patch16_dinov3", (4096, True): "vit_7b_patch16_dinov3"}


def _dinov3_architecture(cfg: Mapping[str, Any], kw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """DINOv3 as timm's Eva: a class token and ``num_register_tokens`` storage tokens (timm's ``reg_token``), no
    absolute position embedding, RoPE on the patch tokens only (timm's 'dinov3' type: patch centres in [-1, 1],
    rotate-half pairs, period ``rope_theta``; any input size), layer scale, q and v biases (timm's Eva has no key
    bias), pooling on the class token after the final norm (``pooler_output``)."""
    dim = int(cfg["hidden_size"])
    gated = bool(cfg["use_gated_mlp"])
    if cfg["key_bias"]:
        raise CheckpointError("a DINOv3 with key_bias=True has no timm counterpart (timm's Eva has no key bias, "
                              "and under RoPE it changes the attention)")
    act = cfg["hidden_act"]
    if act not in (("silu", "swish") if gated else ("gelu",)):
        raise CheckpointError(f"a DINOv3 with {'a gated' if gated else 'a plain'} MLP and hidden_act {act!r} has no "
                              f"timm counterpart (timm's Eva uses {'SiLU' if gated else 'GELU'} there)")
    qkv_bias = bool(cfg["query_bias"] or cfg["value_bias"])  # one that is absent is loaded as zeros
    kw.update(qkv_bias=qkv_bias, class_token=True, num_reg_tokens=int(cfg["num_register_tokens"]),
              use_abs_pos_emb=False, use_rot_pos_emb=True, rope_type="dinov3",
              rope_temperature=float(cfg["rope_theta"]), rope_rotate_half=True, dynamic_img_size=True,
              init_values=float(cfg["layerscale_value"]) or 1e-5,  # always there (0 or None would drop it)
              mlp_ratio=_ratio(int(cfg["intermediate_size"]), dim), swiglu_mlp=gated,
              # align_to=1: timm's SwiGLU with separate fc1_g/fc1_x at exactly intermediate_size
              swiglu_align_to=1 if gated else 0,
              use_fc_norm=False, global_pool="token", num_classes=0)
    arch = _DINOV3_ARCH.get((dim, gated), "vit_small_plus_patch16_dinov3" if gated else "vit_small_patch16_dinov3")
    return (arch + "_qkvb" if qkv_bias and not arch.startswith("vit_7b") else arch), kw


def _aimv2_architecture(cfg: Mapping[str, Any], kw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """AIMv2's vision tower as timm's aimv2 VisionTransformer: RMSNorm (after the patch projection, in the
    blocks, at the end), SwiGLU, no class token. With its attention-pooling head (``use_head``, transformers'
    default) the model pools with it, as timm's ``attn_pool`` shaped by `hf.finish_build` (``attn_pool='aimv2'``:
    the learned query used as it is, no projection of it, no MLP after the pool); without one, timm's mean of the
    tokens. A native-resolution AIMv2 (``is_native``) computes its position embedding; `load_dir` computes it for
    the grid the model is built at (`aimv2_sincos`)."""
    if cfg["is_native"] and int(cfg["hidden_size"]) % 4:
        raise CheckpointError(f"a native-resolution AIMv2 needs a hidden_size divisible by 4 (its sine-cosine "
                              f"position embedding); got {cfg['hidden_size']}")
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise CheckpointError(f"an AIMv2 with hidden_act {cfg['hidden_act']!r} has no timm counterpart (SwiGLU)")
    kw.update(layer_norm_eps=float(cfg["rms_norm_eps"]), qkv_bias=bool(cfg["qkv_bias"]),
              proj_bias=bool(cfg["qkv_bias"] or cfg["mlp_bias"]),  # one that is absent is loaded as zeros
              class_token=False, fc_norm=False, global_pool="avg", num_classes=0,
              mlp_ratio=_ratio(int(cfg["intermediate_size"]), int(cfg["hidden_size"])))
    if cfg.get("use_head", True):
        kw.update(global_pool="map", attn_pool="aimv2")
    return "aimv2_large_patch14_224", kw


def preprocessing(cfg: Mapping[str, Any], pre: Mapping[str, Any] | None) -> Preprocessing:
    """From preprocessor_config.json when there is one, else the family's defaults at the config's size.

    transformers' ViT/BEiT processors resize both sides to the size (no crop); vitscope resizes the short
    side and centre-crops, which is the same for square images.
    """
    mean, std, crop_pct, interp = _FAMILY_PRE[cfg["model_type"]]
    size = int(cfg["image_size"])
    if not pre:
        return Preprocessing(tuple(mean), tuple(std), size, crop_pct, interp)  # type: ignore[arg-type]

    def side(s: Any) -> int | None:
        if isinstance(s, int | float):
            return int(s)
        if isinstance(s, Mapping):
            if s.get("shortest_edge"):
                return int(s["shortest_edge"])
            if s.get("height") and s.get("width"):
                return int(min(s["height"], s["width"]))
        return None

    if pre.get("do_normalize", True):
        mean = tuple(pre.get("image_mean", mean))
        std = tuple(pre.get("image_std", std))
    else:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    resize = side(pre.get("size")) if pre.get("do_resize", True) else None
    crop = side(pre.get("crop_size")) if pre.get("do_center_crop", False) else None
    input_size = crop or resize or size
    crop_pct = input_size / resize if (crop and resize) else 1.0
    interp = _PIL_RESAMPLE.get(pre.get("resample"), interp)  # type: ignore[arg-type]
    return Preprocessing(mean, std, input_size, round(crop_pct, 6), interp)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Weights: transformers' keys -> timm's

def convert(sd: Mapping[str, Tensor], cfg: Mapping[str, Any]) -> tuple[str, Converted]:
    """A transformers state dict and its (filled-in) config -> (timm architecture, timm-named weights with
    the architecture arguments they imply and the keys dropped on purpose)."""
    mt = cfg["model_type"]
    arch, kw = architecture(cfg)
    prefix, base, top = _split_prefix(sd)
    dropped: dict[str, str] = {}  # under the checkpoint's own names
    for pattern, reason in _DROP_BASE:
        rx = re.compile(pattern)
        for k in [k for k in base if rx.search(k)]:
            dropped[prefix + k] = reason
            del base[k]
    family = _FAMILY_CONVERTERS.get(mt)
    if family is not None:
        out = family(base, cfg, kw, prefix, dropped)
        _top_keys(top, out, dropped, mt)
        return arch, Converted(out, f"transformers {mt}", dropped, kw)
    beit = mt in ("beit", "data2vec-vision")
    clip = mt in ("clip", "clip_vision_model")
    out = _rename(base, _BEIT_RULES if beit else _CLIP_RULES if clip else _VIT_RULES)
    out = _join_qkv(out, beit)
    if clip:
        if "cls_token" in out:
            out["cls_token"] = out["cls_token"].reshape(1, 1, -1)
        if "pos_embed" in out and out["pos_embed"].ndim == 2:
            out["pos_embed"] = out["pos_embed"].unsqueeze(0)
    if mt == "deit" and "embeddings.distillation_token" in out:
        out["dist_token" if arch.startswith("deit") else "reg_token"] = out.pop("embeddings.distillation_token")
    if kw.get("reg_tokens") and kw.get("no_embed_class") and "pos_embed" in out and "cls_token" in out:
        # DINOv2 with registers adds the class token's position before inserting the registers, which carry
        # none; timm's no_embed_class model holds the sum in cls_token (as timm's own DINOv2 filter does)
        out["cls_token"] = out["cls_token"] + out["pos_embed"][:, :1]
        out["pos_embed"] = out["pos_embed"][:, 1:]

    for k, v in top.items():  # the task model's own keys
        if re.match(r"^(classifier|cls_classifier)\.(weight|bias)$", k):
            out["head." + k.split(".")[-1]] = v
        elif re.match(r"^distillation_classifier\.(weight|bias)$", k):
            out["head_dist." + k.split(".")[-1]] = v
        elif k == "visual_projection.weight":
            out["head.weight"] = v
            out["head.bias"] = torch.zeros(v.shape[0], dtype=v.dtype)  # timm's head has a bias; CLIP's none
        elif k.startswith(("text_model.", "text_projection.")) or k == "logit_scale":
            dropped[k] = "CLIP text tower"
        elif k.startswith("lm_head."):
            dropped[k] = "BEiT visual-token prediction head"
        elif k.startswith("decoder."):
            dropped[k] = "MAE pixel decoder" if mt == "vit_mae" else "masked-image-modelling decoder"
        elif beit and re.match(r"^layernorm\.(weight|bias)$", k):
            if "norm." + k.split(".")[-1] in out:  # the encoder has its own final norm: this one is the head's
                dropped[k] = "BEiT MIM head's norm (after the encoder's own)"
            else:  # BEiT pretraining: the encoder's final norm lives in the MIM model
                out["norm." + k.split(".")[-1]] = v
        else:
            out[k] = v  # reported as unexpected

    # refine what the config implied with what the weights hold (a head the config names but the weights
    # lack stays in the architecture: the strict report then says it is missing)
    head = out.get("head.weight")
    if head is not None and head.ndim == 2:
        kw["num_classes"] = int(head.shape[0])
    if clip and "norm.weight" in out and kw.get("final_norm") is False:
        for k in ("weight", "bias"):
            if out.pop(f"norm.{k}", None) is not None:
                dropped[f"{prefix}post_layernorm.{k}"] = "unused by CLIP's classifier (un-normalised patch tokens)"
    if beit:
        if "fc_norm.weight" in out:
            kw["global_pool"] = "avg"
        elif "norm.weight" in out:
            kw["global_pool"] = "token"
        kw["use_shared_rel_pos_bias"] = "rel_pos_bias.relative_position_bias_table" in out
        kw["use_rel_pos_bias"] = any(k.endswith("attn.relative_position_bias_table") for k in out)
        kw["use_abs_pos_emb"] = "pos_embed" in out
    return arch, Converted(out, f"transformers {mt}", dropped, kw)


def _zeros_for(out: dict[str, Tensor], keys: list[str]) -> None:
    """Biases a checkpoint's config says it has not (``*_bias: false``) where the timm model has one: zeros,
    which compute the same (the key accounting then lists them as loaded)."""
    for k in keys:
        w = out.get(k.rsplit(".", 1)[0] + ".weight")
        if k not in out and w is not None:
            out[k] = torch.zeros(w.shape[0], dtype=w.dtype)


def _layers(out: Mapping[str, Tensor]) -> list[int]:
    return sorted({int(m.group(1)) for k in out if (m := re.match(r"^blocks\.(\d+)\.", k))})


def _convert_dinov3(base: dict[str, Tensor], cfg: Mapping[str, Any], kw: dict[str, Any], prefix: str,
                    dropped: dict[str, str]) -> dict[str, Tensor]:
    """DINOv3 -> timm's Eva names: q/k/v joined into ``qkv`` with the q and v biases as Eva's ``q_bias`` and
    ``v_bias``, layer scales as ``gamma_1``/``gamma_2``, storage tokens as ``reg_token``."""
    out = _rename(base, _DINOV3_RULES + (_DINOV3_GATED_MLP if kw["swiglu_mlp"] else _DINOV3_MLP))
    blocks = _layers(out)
    absent = [c for c, key in (("q", "query_bias"), ("v", "value_bias")) if kw["qkv_bias"] and not cfg[key]]
    _zeros_for(out, [f"blocks.{i}.attn.{c}.bias" for i in blocks for c in absent])
    if not cfg["proj_bias"]:
        _zeros_for(out, [f"blocks.{i}.attn.proj.bias" for i in blocks])
    if not cfg["mlp_bias"]:
        _zeros_for(out, [f"blocks.{i}.mlp.{fc}.bias" for i in blocks for fc in ("fc1", "fc1_g", "fc1_x", "fc2")])
    return _join_qkv(out, beit=True)  # no key bias: q and v biases kept apart, as Eva holds them


def _convert_siglip(base: dict[str, Tensor], cfg: Mapping[str, Any], kw: dict[str, Any], prefix: str,
                    dropped: dict[str, str]) -> dict[str, Tensor]:
    """SigLIP and SigLIP 2 vision towers -> timm's VisionTransformer names (no class token; the MAP head as
    ``attn_pool``). SigLIP 2's linear patch embedding becomes the equivalent convolution kernel, and its
    position embedding grid is used as stored (the size the model is built at)."""
    out = split_in_proj(_join_qkv(_rename(base, _SIGLIP_RULES), beit=False))
    if "pos_embed" in out and out["pos_embed"].ndim == 2:
        out["pos_embed"] = out["pos_embed"].unsqueeze(0)
    if "attn_pool.latent" in out and kw["global_pool"] != "map":  # the classifier averages the tokens instead
        for k in [k for k in out if k.startswith("attn_pool.")]:
            del out[k]
        for k in [k for k in base if k.startswith("head.")]:
            dropped[prefix + k] = "MAP head (unused by the classifier, which averages the tokens)"
    w = out.get("patch_embed.proj.weight")
    if w is not None and w.ndim == 2:
        out["patch_embed.proj.weight"] = linear_patches_to_conv(w, int(cfg["patch_size"]), int(cfg["num_channels"]))
    return out


def _convert_aimv2(base: dict[str, Tensor], cfg: Mapping[str, Any], kw: dict[str, Any], prefix: str,
                   dropped: dict[str, str]) -> dict[str, Tensor]:
    """AIMv2 vision towers -> timm's aimv2 names (gate_proj/up_proj/down_proj as SwiGLU's fc1_g/fc1_x/fc2); the
    attention-pooling head as timm's ``attn_pool`` (its query ``cls_token`` as the latent, k_proj and v_proj
    joined as kv, output_proj as proj) where the architecture pools with it."""
    head = {k[len("head."):]: base.pop(k) for k in [k for k in base if k.startswith("head.")]}
    out = _join_qkv(_rename(base, _AIMV2_RULES), beit=False)
    if head and kw.get("global_pool") == "map":
        out["attn_pool.latent"] = head.pop("cls_token")
        for part in ("weight", "bias"):
            kv = [head.pop(f"{p}_proj.{part}", None) for p in "kv"]
            if all(t is not None for t in kv):
                out[f"attn_pool.kv.{part}"] = torch.cat(kv)
            out.update({f"attn_pool.proj.{part}": head.pop(f"output_proj.{part}")} if f"output_proj.{part}" in head
                       else {})
        out.update({f"head.{k}": v for k, v in head.items()})  # anything else: reported as unexpected
    else:
        for k in head:
            dropped[f"{prefix}head.{k}"] = "AIMv2 attention-pooling head (the config says use_head is off)"
    if "pos_embed" in out and out["pos_embed"].ndim == 2:
        out["pos_embed"] = out["pos_embed"].unsqueeze(0)
    blocks = _layers(out)
    if kw["proj_bias"] and not cfg["qkv_bias"]:
        _zeros_for(out, [f"blocks.{i}.attn.proj.bias" for i in blocks])
    if kw["proj_bias"] and not cfg["mlp_bias"]:
        _zeros_for(out, [f"blocks.{i}.mlp.{fc}.bias" for i in blocks for fc in ("fc1_g", "fc1_x", "fc2")])
    return out


_FAMILY_CONVERTERS = {"dinov3_vit": _convert_dinov3, **dict.fromkeys(_SIGLIPS, _convert_siglip),
                      **dict.fromkeys(_AIMV2S, _convert_aimv2)}


def _top_keys(top: Mapping[str, Tensor], out: dict[str, Tensor], dropped: dict[str, str], mt: str) -> None:
    """The keys of an image-text model or classifier outside its vision tower (SigLIP, AIMv2)."""
    family = "SigLIP 2" if mt.startswith("siglip2") else "SigLIP" if mt.startswith("siglip") else "AIMv2"
    for k, v in top.items():
        if re.match(r"^classifier\.(weight|bias)$", k):
            out["head." + k.split(".")[-1]] = v
        elif k.startswith(("text_model.", "text_projection.")) or k in ("logit_scale", "logit_bias"):
            dropped[k] = f"{family} text tower"
        elif k.startswith("visual_projection."):
            dropped[k] = "AIMv2 image projection (the pooled output into the text embedding space)"
        else:
            out[k] = v  # reported as unexpected


def implied_kwargs(cfg: Mapping[str, Any], pre: Preprocessing) -> dict[str, Any]:
    """The architecture a checkpoint implies before its weights are read: the config's, built at the size its
    preprocessing produces (DINOv2's config says 518 px, its processor crops 224, where transformers
    interpolates the position embeddings on the fly)."""
    return {**architecture(cfg)[1], "img_size": pre.input_size}


def aimv2_sincos(grid: int, dim: int) -> Tensor:
    """A native-resolution AIMv2's position embedding, which transformers computes per image and does not store
    (``build_2d_sinusoidal_position_embedding``, period 10000, float64, in the layout AIMv2 was trained with:
    [sin w | cos w | sin h | cos h], rows outer), for a grid x grid patch grid as timm's (1, N, D) pos_embed."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    axis = torch.arange(grid, dtype=torch.float64)
    rows, cols = (a.flatten().outer(omega) for a in torch.meshgrid(axis, axis, indexing="ij"))
    return torch.cat([cols.sin(), cols.cos(), rows.sin(), rows.cos()], dim=1).float().unsqueeze(0)


def resample_pos_embed(pos: Tensor, old: int, new: int, antialias: bool = False) -> Tensor:
    """A (1, prefix + old*old, D) position embedding on a new*new grid, prefix rows kept, interpolated the way
    transformers does on the fly (bicubic, align_corners=False, float32), so both compute the same function."""
    prefix = pos.shape[1] - old * old
    grid = pos[:, prefix:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(grid.float(), size=(new, new), mode="bicubic", align_corners=False,
                                           antialias=antialias).to(pos.dtype)
    return torch.cat([pos[:, :prefix], grid.permute(0, 2, 3, 1).reshape(1, new * new, -1)], dim=1)
