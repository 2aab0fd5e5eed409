"""Official checkpoint layouts -> timm state dicts: one converter per layout, next to the quirks it handles.

A layout is how a publisher's own files name and wrap a ViT's weights: the keys (``module.base_encoder.blocks.0``,
``visual.transformer.resblocks.0``), the wrappers around the state dict (``model``, ``state_dict``, ``teacher``),
and what lies beside the backbone (projection heads, decoders, momentum encoders, text towers). A converter
returns the backbone weights under timm's key names, the keys it dropped on purpose (with the reason), and the
architecture arguments the checkpoint implies (e.g. MAE fine-tuned files pool with ``fc_norm``), as `Converted`.
Reading the files and loading a `Converted` with strict key accounting is `vitscope.models.checkpoints`'s part.

  layout     files                                                      timm model; dropped on purpose
  timm       state dicts in timm's names (also under ``model``,         VisionTransformer (or what timm's own
             ``state_dict``, ``module.``)                               filter translates: original DINOv2, ...)
  mocov3     MoCo-v3 (``module.base_encoder.``), linear-probe files     VisionTransformer; momentum encoder,
                                                                        predictor, projector head
  dino       DINO training files (``teacher``/``student``), backbones   VisionTransformer; the other network,
                                                                        the DINO projection head
  mae        MAE pretrained and fine-tuned files (``model``)            VisionTransformer; pixel decoder, mask token
  beit       BEiT pretraining and fine-tuned files                      Beit; visual-token head, mask token
  simmim     SimMIM (``encoder.`` and ``decoder.``)                     Beit; pixel decoder (and BEiT's drops)
  dinov3     DINOv3's ``DinoVisionTransformer`` files                   Eva (``vit_*_patch16_dinov3``); heads,
                                                                        mask token, the zero k bias
  open_clip  open_clip's and OpenAI's CLIP state dicts                  VisionTransformer (``vit_*_clip_224``);
                                                                        the text tower

`detect_format` guesses the layout from the keys; `convert` applies one (``checkpoint_format=`` overrides).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vitscope.errors import CheckpointError

Tensor = torch.Tensor


@dataclass
class Converted:
    state_dict: dict[str, Tensor]
    format: str
    dropped: dict[str, str] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    resampled: list[str] = field(default_factory=list)  # already resampled by the converter
    notes: list[str] = field(default_factory=list)  # what the file cannot say and what was assumed for it
    #: MAE's pixel decoder and mask token under their official names, set aside by `convert_mae` (also listed in
    #: ``dropped``): `vitscope.models.mae_decoder` attaches them when the load asks for the decoder
    decoder: dict[str, Tensor] = field(default_factory=dict)


def _tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, Tensor) for v in obj.values())


def _strip(sd: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _drop(sd: dict[str, Tensor], pattern: str, reason: str, dropped: dict[str, str]) -> dict[str, Tensor]:
    rx = re.compile(pattern)
    for k in [k for k in sd if rx.search(k)]:
        dropped[k] = reason
        del sd[k]
    return sd


def _implied_kwargs(sd: Mapping[str, Tensor]) -> dict[str, Any]:
    """Architecture arguments a ViT state dict implies: classifier size, pooling, register tokens."""
    kw: dict[str, Any] = {}
    head = sd.get("head.weight")
    kw["num_classes"] = int(head.shape[0]) if head is not None and head.ndim == 2 else 0
    if "fc_norm.weight" in sd and "norm.weight" not in sd:
        kw["global_pool"] = "avg"  # fine-tuned MAE / BEiT: mean-pool, then fc_norm
    if "reg_token" in sd:
        kw["reg_tokens"] = int(sd["reg_token"].shape[1])
    return kw


# --------------------------------------------------------------------------------------------------
# Converters: one per official layout

def convert_timm(ckpt: Any) -> Converted:
    """A plain state dict in timm's names (also wrapped in ``model``/``state_dict``/``module.``).

    Other layouts timm itself knows (original DINOv2, open_clip towers that are timm models) pass through and
    are translated by timm's own ``checkpoint_filter_fn`` at load time; OpenAI CLIP / open_clip state dicts
    have their own converter (`convert_open_clip`), which accounts for the text tower it drops.
    """
    sd = _unwrap(ckpt, "the checkpoint")
    return Converted(sd, "timm", model_kwargs=_implied_kwargs(sd))


def _unwrap(ckpt: Any, what: str) -> dict[str, Tensor]:
    """The state dict inside ``model`` / ``state_dict`` / ``module`` wrappers, without a ``module.`` prefix on every
    key (DistributedDataParallel's); CheckpointError naming ``what`` when no dict of tensors is there."""
    sd = ckpt
    for key in ("model", "state_dict", "module"):
        if isinstance(sd, Mapping) and key in sd and isinstance(sd[key], Mapping):
            sd = sd[key]
    if not _tensor_dict(sd):
        raise CheckpointError(f"no state dict of tensors found in {what}")
    sd = dict(sd)
    if all(k.startswith("module.") for k in sd):
        sd = _strip(sd, "module.")
    return sd


def convert_mocov3(ckpt: Any) -> Converted:
    """MoCo-v3 (``state_dict`` with ``module.base_encoder.``, ``module.momentum_encoder.``,
    ``module.predictor.``): keep the base encoder, drop the projector MLP that replaces its head.
    Linear-probe files (``module.`` + a linear ``head``) also load."""
    sd = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else ckpt
    dropped: dict[str, str] = {}
    if any(k.startswith("module.base_encoder.") for k in sd):
        for k in sd:
            if k.startswith("module.momentum_encoder."):
                dropped[k] = "momentum encoder"
            elif k.startswith("module.predictor."):
                dropped[k] = "predictor"
        sd = _strip(sd, "module.base_encoder.")
        sd = _drop(sd, r"^head\.", "MoCo-v3 projector head", dropped)
    else:
        sd = _strip(sd, "module.") if all(k.startswith("module.") for k in sd) else dict(sd)
    return Converted(sd, "mocov3", dropped, _implied_kwargs(sd))


def _network(ckpt: Any, key: str, family: str, dropped: dict[str, str]) -> Any:
    """The ``key`` network ('teacher' or 'student') of a self-distillation training checkpoint, the other one
    recorded in ``dropped``; any other checkpoint as it is."""
    if not (isinstance(ckpt, Mapping) and ("teacher" in ckpt or "student" in ckpt)):
        return ckpt
    if key not in ckpt:
        raise CheckpointError(f"{family} checkpoint has no {key!r}; it has {sorted(ckpt)}")
    for other in ("teacher", "student"):
        if other != key and other in ckpt:
            dropped[other] = f"{family} {other} (loaded the {key})"
    return ckpt[key]


def convert_dino(ckpt: Any, key: str = "teacher") -> Converted:
    """DINO training checkpoints (``teacher``/``student``, ``module.``/``backbone.``/``head.``; the
    teacher by default) and backbone-only release files (timm names already)."""
    dropped: dict[str, str] = {}
    sd = dict(_network(ckpt, key, "DINO", dropped))
    if all(k.startswith("module.") for k in sd):
        sd = _strip(sd, "module.")
    if any(k.startswith("backbone.") for k in sd):
        sd = _drop(sd, r"^head\.", "DINO projection head", dropped)
        sd = _strip(sd, "backbone.")
    return Converted(sd, "dino", dropped, _implied_kwargs(sd))


def convert_mae(ckpt: Any) -> Converted:
    """MAE (``model``): pretrained encoders end in ``norm``; fine-tuned ones mean-pool into
    ``fc_norm`` (global_pool='avg'). The pixel decoder and mask token of visualisation files are dropped from the
    encoder's state dict (listed in ``dropped``) and kept, under their official names, in ``Converted.decoder``:
    a load that asks for the decoder (``decoder=True``) attaches them (`vitscope.models.mae_decoder`), any other
    leaves them dropped."""
    sd = dict(ckpt.get("model", ckpt))
    decoder = {k: v for k, v in sd.items() if re.search(r"^(decoder_|mask_token)", k)}
    dropped: dict[str, str] = {}
    sd = _drop(sd, r"^(decoder_|mask_token)", "MAE decoder", dropped)
    return Converted(sd, "mae", dropped, _implied_kwargs(sd), decoder=decoder)


def convert_beit(ckpt: Any) -> Converted:
    """BEiT pretraining (``model``): shared relative position bias (``rel_pos_bias.*``), ``mask_token``
    and the visual-token head ``lm_head`` (dropped). Fine-tuned files (per-block tables) also load."""
    sd = ckpt
    for key in ("model", "module"):
        if isinstance(sd, Mapping) and key in sd and isinstance(sd[key], Mapping):
            sd = sd[key]
    sd = dict(sd)
    dropped: dict[str, str] = {}
    sd = _drop(sd, r"^lm_head\.", "BEiT visual-token prediction head", dropped)
    sd = _drop(sd, r"^mask_token$", "mask token (pretraining only)", dropped)
    sd = _drop(sd, r"relative_position_index$", "recomputed by the model", dropped)
    kw = _implied_kwargs(sd)
    shared = "rel_pos_bias.relative_position_bias_table" in sd
    kw.update(use_shared_rel_pos_bias=shared, use_rel_pos_bias=not shared and any(
        k.endswith("attn.relative_position_bias_table") for k in sd))
    if "norm.weight" in sd:
        kw["global_pool"] = "token"
    kw["use_abs_pos_emb"] = "pos_embed" in sd
    return Converted(sd, "beit", dropped, kw)


def convert_simmim(ckpt: Any) -> Converted:
    """SimMIM (``model`` with ``encoder.`` and a 1x1-conv ``decoder.``): the encoder is BEiT-shaped."""
    sd = dict(ckpt.get("model", ckpt))
    dropped = {k: "SimMIM pixel decoder" for k in sd if k.startswith("decoder.")}
    conv = convert_beit(_strip(sd, "encoder.") if any(k.startswith("encoder.") for k in sd) else sd)
    conv.dropped.update(dropped)
    conv.format = "simmim"
    return conv


# --------------------------------------------------------------------------------------------------
# DINOv3 (facebookresearch/dinov3, ``DinoVisionTransformer``) -> timm's Eva (``vit_*_patch16_dinov3``)

#: official name -> Eva's, applied in turn to every key
_DINOV3_RENAMES = (
    ("storage_tokens", "reg_token"),  # DINOv3's storage tokens are registers, placed after the CLS token
    (".ls1.gamma", ".gamma_1"), (".ls2.gamma", ".gamma_2"),  # layer scale: Eva keeps bare parameters
    # SwiGLU FFN: w3(silu(w1 x) * w2 x); timm's SwiGLU: fc2(silu(fc1_g x) * fc1_x x)
    (".mlp.w1.", ".mlp.fc1_g."), (".mlp.w2.", ".mlp.fc1_x."), (".mlp.w3.", ".mlp.fc2."),
)


def _dinov3_keys(keys: Any) -> bool:
    return any(k.rpartition("backbone.")[2].removeprefix("module.") in ("storage_tokens", "rope_embed.periods")
               for k in keys)


def convert_dinov3(ckpt: Any, key: str = "teacher") -> Converted:
    """DINOv3's own checkpoints (facebookresearch/dinov3 ``DinoVisionTransformer``; the released backbone files,
    and training files with ``teacher``/``student`` and ``backbone.``) -> timm's Eva as ``vit_*_patch16_dinov3``
    builds it (global_pool='token': DINOv3's output is the normed CLS token; no classifier).

    Renamed: ``storage_tokens`` -> ``reg_token``, ``blocks.N.ls{1,2}.gamma`` -> ``gamma_{1,2}``, SwiGLU
    ``mlp.w1/w2/w3`` -> ``mlp.fc1_g/fc1_x/fc2``; ``qkv.bias`` (multiplied by ``bias_mask`` where the file has one)
    split into Eva's ``q_bias`` and ``v_bias``. The k third of that bias is dropped only when it is zero: with
    RoPE the keys are rotated per position, so a k bias would not cancel in the softmax, and timm's Eva keeps it
    at zero (a file with a non-zero k bias is refused). Dropped, each with its reason: ``mask_token``
    (pretraining only), ``bias_mask``, ``local_cls_norm`` (local crops, training only), the DINO/iBOT heads of
    training files, and ``rope_embed.periods``, which the model recomputes: the loader compares them with the
    model's own and refuses a file whose periods differ (another RoPE base or period range). A q/v bias that is
    all zero (DINOv3's distilled ViT-S/B/L) is dropped when the model is built without one (the ``_qkvb``-less
    timm names). Refused: ``cls_norm`` (untie_cls_and_patch_norms; Eva has one final norm)."""
    dropped: dict[str, str] = {}
    sd = _unwrap(_network(ckpt, key, "DINOv3", dropped), "the DINOv3 checkpoint")
    if any(k.startswith("backbone.") for k in sd):
        for k in sd:
            if not k.startswith("backbone."):
                dropped[k] = "DINOv3 training head (DINO / iBOT projection)"
        sd = _strip(sd, "backbone.")
    untied = sorted(k for k in sd if k.startswith("cls_norm."))
    if untied:
        raise CheckpointError(f"this DINOv3 checkpoint has a separate norm for the CLS and storage tokens "
                              f"({', '.join(untied)}; untie_cls_and_patch_norms), which timm's Eva does not have")
    sd = _drop(sd, r"^mask_token$", "mask token (pretraining only)", dropped)
    sd = _drop(sd, r"^local_cls_norm\.", "norm of the local crops' CLS token (DINOv3 training only)", dropped)
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        if k.endswith("attn.qkv.bias_mask"):
            dropped[k] = "mask of the k bias (applied to qkv.bias here)"
            continue
        if k.endswith("attn.qkv.bias"):
            mask = sd.get(k + "_mask")
            bias = v * mask.to(v.dtype) if mask is not None else v
            q, kb, vb = bias.chunk(3, dim=-1)
            if kb.any():
                raise CheckpointError(f"{k} of this DINOv3 checkpoint has a non-zero k bias, which timm's Eva "
                                      "fixes at zero (with RoPE it would change the attention): not convertible")
            stem = k[: -len("qkv.bias")]
            out[stem + "q_bias"], out[stem + "v_bias"] = q, vb
            dropped[k + " (k third)"] = ("k bias: zero" + (" under bias_mask" if mask is not None else "")
                                         + " (timm's Eva keeps it at zero)")
            continue
        if k == "rope_embed.periods":
            out["rope.periods"] = v  # checked against the model's own periods, then dropped (`checkpoints._eva_filter`)
            continue
        for a, b in _DINOV3_RENAMES:
            k = k.replace(a, b)
        out[k] = v
    kw: dict[str, Any] = {"num_classes": 0, "global_pool": "token"}
    if "reg_token" in out:
        kw["num_reg_tokens"] = int(out["reg_token"].shape[1])
    return Converted(out, "dinov3", dropped, kw)


def _dinov3_architecture(sd: Mapping[str, Tensor], dim: int, chans: int, patch: int,
                         depth: int) -> tuple[str, dict[str, Any], list[str]]:
    """Eva arguments of a converted DINOv3 state dict (`convert_dinov3`)."""
    periods = sd.get("rope.periods")
    if periods is not None and periods.ndim == 1 and len(periods) and dim % (4 * len(periods)) == 0:
        heads = dim // (4 * len(periods))
        notes = [f"num_heads={heads}: heads of {4 * len(periods)} read from the RoPE periods (4 per period)"]
    else:
        heads = max(dim // 64, 1)
        notes = [f"num_heads={heads} assumed (embed_dim / 64, DINOv3's convention; the file has no RoPE periods); "
                 "pass num_heads=... if the model used another"]
    biases = [v for k, v in sd.items() if k.endswith(("attn.q_bias", "attn.v_bias"))]
    kw: dict[str, Any] = {"embed_dim": dim, "depth": depth, "num_heads": heads, "patch_size": patch,
                          "in_chans": chans, "qkv_bias": any(bool(b.any()) for b in biases),
                          "num_reg_tokens": int(sd["reg_token"].shape[1]) if "reg_token" in sd else 0,
                          "init_values": 1e-5 if "blocks.0.gamma_1" in sd else None,  # values from the file
                          "num_classes": 0, "global_pool": "token"}
    gate = sd.get("blocks.0.mlp.fc1_g.weight")
    fc1 = gate if gate is not None else sd.get("blocks.0.mlp.fc1.weight")
    if fc1 is not None:
        hidden = int(fc1.shape[0])
        ratio = hidden / dim
        kw["mlp_ratio"] = ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim  # Eva takes int(dim*ratio)
    if gate is not None:  # SwiGLU; an alignment of 1 selects timm's SwiGLU with separate gate and value weights
        kw.update(swiglu_mlp=True, swiglu_align_to=1)
    notes.append("LayerNorm eps 1e-5 as in DINOv3's released models (norm_layer='layernormbf16'; not in the "
                 "weights): pass layer_norm_eps=1e-6 for a model trained with norm_layer='layernorm'")
    if not biases:
        notes.append("no qkv bias in the file")
    elif not kw["qkv_bias"]:
        notes.append("qkv bias all zero: built without one (timm's vit_*_dinov3, not _qkvb)")
    arch = "vit_base_patch16_dinov3_qkvb" if kw["qkv_bias"] else "vit_base_patch16_dinov3"
    return arch, kw, notes


# --------------------------------------------------------------------------------------------------
# open_clip's native CLIP state dict -> timm's VisionTransformer (the image tower)

#: top-level keys of the text tower (CLIP) and of a CustomTextCLIP's ``text.`` tower
_CLIP_TEXT = re.compile(r"^(token_embedding\.|positional_embedding$|transformer\.|ln_final\.|text_projection"
                        r"|logit_scale$|logit_bias$|attn_mask$|text\.)")
#: integers OpenAI's own CLIP files carry beside the weights
_OPENAI_META = ("input_resolution", "context_length", "vocab_size")
_CLIP_BLOCK = {"ln_1": "norm1", "ln_2": "norm2", "attn.in_proj_weight": "attn.qkv.weight",
               "attn.in_proj_bias": "attn.qkv.bias", "attn.out_proj": "attn.proj", "mlp.c_fc": "mlp.fc1",
               "mlp.c_proj": "mlp.fc2", "ls_1.gamma": "ls1.gamma", "ls_2.gamma": "ls2.gamma"}
_CLIP_TOP = {"conv1.weight": "patch_embed.proj.weight", "ln_pre.weight": "norm_pre.weight",
             "ln_pre.bias": "norm_pre.bias", "ln_post.weight": "norm.weight", "ln_post.bias": "norm.bias"}
#: OpenAI's CLIP ViTs (embed_dim, depth, patch, image side): the shapes for which QuickGELU is the default
_OPENAI_CLIP_VITS = {(768, 12, 32, 224): "ViT-B/32", (768, 12, 16, 224): "ViT-B/16", (1024, 24, 14, 224): "ViT-L/14",
                     (1024, 24, 14, 336): "ViT-L/14@336px"}
_ACT_NOTE = ("open_clip files do not record it: QuickGELU is OpenAI's CLIP and open_clip's '-quickgelu' models, "
             "GELU the other LAION / DataComp towers; pass act_layer='quick_gelu' or act_layer='gelu' to choose")


def _open_clip_keys(keys: list[str]) -> bool:
    keys = [k.removeprefix("module.") for k in keys]
    if any(k.startswith("visual.trunk.") for k in keys):
        return False  # an open_clip tower that is a timm model: timm's own names, under visual.trunk.
    return (any(k.startswith(("visual.conv1.", "visual.class_embedding", "visual.transformer.", "visual.layer1.",
                              "visual.attnpool.")) for k in keys)
            or ("token_embedding.weight" in keys and ("text_projection" in keys or "ln_final.weight" in keys)
                and not any(k.startswith("visual.") for k in keys)))


def convert_open_clip(ckpt: Any) -> Converted:
    """open_clip's native CLIP state dict (``model.state_dict()``, OpenAI's CLIP weights as open_clip holds them,
    the LAION / DataComp releases, and training checkpoints: ``state_dict`` with ``module.``) -> the image tower
    as timm's CLIP VisionTransformer (``vit_*_clip_224``: pre-norm, LayerNorm eps 1e-5, no patch-embedding bias).

    ``visual.conv1`` -> ``patch_embed.proj``, ``class_embedding`` -> ``cls_token``, ``positional_embedding`` ->
    ``pos_embed``, ``ln_pre`` -> ``norm_pre``, ``transformer.resblocks.N`` -> ``blocks.N`` (``ln_1/ln_2`` ->
    ``norm1/norm2``, ``attn.in_proj_*`` -> ``attn.qkv``, ``out_proj`` -> ``proj``, ``c_fc/c_proj`` ->
    ``fc1/fc2``, ``ls_1/ls_2`` -> ``ls1/ls2``), ``ln_post`` -> ``norm``, and the projection ``proj`` (D, E) ->
    the classifier ``head.weight`` (E, D), its ``head.bias`` set to zeros (open_clip's projection has none; said in
    the load report's notes). The text tower (``token_embedding``, ``transformer.*``, ``ln_final``,
    ``text_projection``, ``logit_scale``, ``positional_embedding``, a ``text.`` tower) is dropped as "text tower".

    The activation cannot be read from the weights: OpenAI's CLIP and open_clip's ``-quickgelu`` models use
    QuickGELU, the other LAION / DataComp towers GELU. With a timm name and ``weights=`` the name decides
    (``vit_base_patch16_clip_quickgelu_224`` or ``vit_base_patch16_clip_224``); a bare file gets QuickGELU when
    its tower has the shape of one of OpenAI's ViTs (B/32, B/16, L/14 at 224, L/14 at 336 pixels), GELU
    otherwise, and ``act_layer='quick_gelu'`` / ``'gelu'`` overrides either. The load report's notes say which
    one the model has. Heads are open_clip's default 64-dimensional ones (``num_heads=`` overrides). Refused,
    in one sentence: a ResNet image tower (``visual.layer1.*``, ``visual.attnpool.*``), a file with only a text
    tower, a timm-model tower (``visual.trunk.*``: load it with checkpoint_format='timm'). Keys of open_clip
    options timm's ViT lacks (attentional pooler, qk norm, scaled attention) are left unconverted, so the strict
    load names them."""
    sd: Any = ckpt
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(sd, Mapping) and wrapper in sd and isinstance(sd[wrapper], Mapping):
            sd = sd[wrapper]
    if not isinstance(sd, Mapping) or not sd or not all(isinstance(v, Tensor | int) for v in sd.values()):
        raise CheckpointError("no state dict of tensors found in the open_clip checkpoint")
    sd = dict(sd)
    if all(k.startswith("module.") for k in sd):
        sd = _strip(sd, "module.")
    resnet = sorted({".".join(k.split(".")[:2]) + ".*" for k in sd
                     if k.startswith(("visual.layer", "visual.attnpool.", "visual.bn1."))})
    if resnet:
        raise CheckpointError(f"this open_clip checkpoint has a ResNet image tower ({', '.join(resnet[:4])}): "
                              "vitscope loads Vision Transformer towers only")
    if any(k.startswith("visual.trunk.") for k in sd):
        raise CheckpointError("this open_clip checkpoint's image tower is a timm model (visual.trunk.*): load it "
                              "with checkpoint_format='timm'")
    if not any(k.startswith("visual.") for k in sd):
        text = sorted({k.split(".")[0] for k in sd if _CLIP_TEXT.match(k)})
        raise CheckpointError(f"this open_clip checkpoint holds only a text tower ({', '.join(text[:5])}): it has "
                              "no image tower (visual.*) to load")
    dropped: dict[str, str] = {}
    out: dict[str, Tensor] = {}
    notes: list[str] = []
    for k, v in sd.items():
        if not k.startswith("visual."):
            if k in _OPENAI_META:
                dropped[k] = "OpenAI CLIP metadata (not a weight)"
            elif _CLIP_TEXT.match(k):
                dropped[k] = "text tower"
            else:
                out[k] = v  # unknown: the strict load names it
            continue
        name = k[len("visual."):]
        m = re.match(r"transformer\.resblocks\.(\d+)\.(.+?)((?:\.weight|\.bias)?)$", name)
        if m and m.group(2) in _CLIP_BLOCK:
            out[f"blocks.{m.group(1)}.{_CLIP_BLOCK[m.group(2)]}{m.group(3)}"] = v
        elif name in _CLIP_TOP:
            out[_CLIP_TOP[name]] = v
        elif name == "class_embedding":
            out["cls_token"] = v.reshape(1, 1, -1)
        elif name == "positional_embedding":
            out["pos_embed"] = v.unsqueeze(0)
        elif name == "proj":
            out["head.weight"] = v.t().contiguous()
            out["head.bias"] = torch.zeros(v.shape[1], dtype=v.dtype)
            notes.append("head.bias set to zeros (open_clip's projection has no bias)")
        else:
            out[k] = v  # an open_clip option timm's ViT does not have: the strict load names it
    if "norm_pre.weight" not in out and "patch_embed.proj.weight" in out:  # no_ln_pre: timm adds a conv bias
        out["patch_embed.proj.bias"] = torch.zeros(out["patch_embed.proj.weight"].shape[0])
        notes.append("patch_embed.proj.bias set to zeros (open_clip's conv1 has no bias)")
    return Converted(out, "open_clip", dropped, {"num_classes": _implied_kwargs(out)["num_classes"]}, notes=notes)


def _clip_architecture(sd: Mapping[str, Tensor], kw: dict[str, Any],
                       notes: list[str]) -> tuple[str, dict[str, Any], list[str]]:
    """timm's CLIP ViT for a converted open_clip tower, with the activation chosen by `convert_open_clip`'s rule."""
    kw = {**kw, "class_token": True, "qkv_bias": True, "pre_norm": "norm_pre.weight" in sd}
    kw.pop("global_pool", None)
    shape = (kw["embed_dim"], kw["depth"], kw["patch_size"], kw.get("img_size"))
    openai = _OPENAI_CLIP_VITS.get(shape)
    kw["act_layer"] = "quick_gelu" if openai else "gelu"
    notes = [f"act_layer={kw['act_layer']!r} unless given ("  # first: the one a load logs
             + (f"the shape of OpenAI's {openai}" if openai else "not the shape of an OpenAI CLIP ViT")
             + f"); {_ACT_NOTE}",
             notes[0].replace("(embed_dim / 64)", "(embed_dim / 64, open_clip's head_width)")]
    return "vit_base_patch16_clip_224", kw, notes


CONVERTERS: dict[str, Callable[[Any], Converted]] = {
    "timm": convert_timm,
    "mocov3": convert_mocov3,
    "dino": convert_dino,
    "mae": convert_mae,
    "beit": convert_beit,
    "simmim": convert_simmim,
    "dinov3": convert_dinov3,
    "open_clip": convert_open_clip,
}


def detect_format(ckpt: Any) -> str:
    """Guess the layout from the keys (``checkpoint_format=`` overrides)."""
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"a checkpoint must be a dict, got {type(ckpt).__name__}")
    if "teacher" in ckpt or "student" in ckpt:
        net = ckpt.get("teacher", ckpt.get("student"))
        return "dinov3" if isinstance(net, Mapping) and _dinov3_keys(net) else "dino"
    inner = ckpt
    for key in ("state_dict", "model", "module"):
        if key in inner and isinstance(inner[key], Mapping):
            inner = inner[key]
    keys = list(inner)
    if _dinov3_keys(keys):
        return "dinov3"
    if _open_clip_keys(keys):
        return "open_clip"
    if any(k.startswith(("module.base_encoder.", "module.momentum_encoder.")) for k in keys):
        return "mocov3"
    if any(k.startswith("encoder.") for k in keys) and any(k.startswith("decoder.") for k in keys):
        return "simmim"
    if any(k.startswith("backbone.") or k.startswith("module.backbone.") for k in keys):
        return "dino"
    if any(k.startswith("rel_pos_bias.") or k.startswith("lm_head.") or k.endswith("attn.q_bias")
           for k in keys):
        return "beit"
    if any(k.startswith("decoder_") for k in keys):
        return "mae"
    return "timm"


def convert(ckpt: Any, checkpoint_format: str = "auto", dino_key: str = "teacher") -> Converted:
    fmt = detect_format(ckpt) if checkpoint_format == "auto" else checkpoint_format
    if fmt not in CONVERTERS:
        raise CheckpointError(f"unknown checkpoint_format {fmt!r}; choose one of {sorted(CONVERTERS)} or 'auto'")
    if fmt in ("dino", "dinov3"):
        return (convert_dino if fmt == "dino" else convert_dinov3)(ckpt, key=dino_key)
    return CONVERTERS[fmt](ckpt)
