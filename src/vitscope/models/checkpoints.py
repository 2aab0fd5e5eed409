"""Official checkpoint layouts -> timm state dicts, with strict key accounting.

Each supported layout has one converter below, next to the quirks it handles. A converter returns the
backbone weights under timm's key names, the keys it dropped on purpose (with the reason), and the
architecture arguments the checkpoint implies (e.g. MAE fine-tuned files pool with ``fc_norm``).
`account` then compares what arrives with what the model expects; nothing is silently left at init.
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vitscope.errors import CheckpointError, first_line, preview

Tensor = torch.Tensor


@dataclass
class Converted:
    state_dict: dict[str, Tensor]
    format: str
    dropped: dict[str, str] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    resampled: list[str] = field(default_factory=list)  # already resampled by the converter


@dataclass
class LoadReport:
    """What happened to every key. ``ok`` means every model weight came from the checkpoint."""

    source: str
    format: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    resampled: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        parts = [f"{len(self.loaded)} tensors loaded from {self.source} ({self.format} layout)"]
        if self.dropped:
            reasons = sorted(set(self.dropped.values()))
            parts.append(f"{len(self.dropped)} dropped on purpose ({'; '.join(reasons)})")
        if self.resampled:
            parts.append(f"resampled to the model's size: {preview(self.resampled)}")
        for label, keys in (("missing (left at init)", self.missing), ("unexpected", self.unexpected),
                            ("wrong shape", self.mismatched)):
            if keys:
                parts.append(f"{len(keys)} {label}: {preview(keys, 8)}")
        return "; ".join(parts)


# --------------------------------------------------------------------------------------------------
# Reading files

def check_checkpoint_file(path: str | Path) -> None:
    """Cheap checks that ``path`` can be a checkpoint, without reading its tensors: it exists, and it is a
    safetensors file with a well-formed header or a PyTorch file (zip archive or pickle) whose tensors ask for no
    more memory than its size allows (`torchfile.check_memory`, which reads the pickle alone). CheckpointError
    (one sentence) otherwise; `vitscope.study` runs this for every local file before any model loads."""
    import json

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if path.suffix == ".safetensors":
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            ok = 0 < n <= size - 8
            if ok:
                try:
                    ok = isinstance(json.loads(f.read(n)), dict)
                except ValueError:
                    ok = False
            if not ok:
                raise CheckpointError(f"{str(path)!r} is not a valid safetensors file (its header does not parse); "
                                      "the file is corrupt or truncated")
            return
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: neither a safetensors file nor a PyTorch file "
                              "(zip archive or pickle); the file is corrupt, truncated or of another kind")
    from vitscope.models.torchfile import check_memory

    check_memory(path)  # the sizes its pickle declares against its own, before torch allocates any of them


def read_checkpoint(path: str | Path, trust: bool = False) -> Any:
    """Load a checkpoint file (``.safetensors``, or a torch pickle read with ``weights_only``).

    Official training checkpoints store an ``argparse.Namespace`` of their arguments; that class is
    allowed. Anything else that needs full unpickling requires ``trust=True``.
    """
    path = Path(path)
    check_checkpoint_file(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as e:
            raise CheckpointError(f"{str(path)!r} is not a valid safetensors file ({e}); the file is corrupt or "
                                  "truncated") from e
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as e:  # noqa: BLE001 - re-raised with a way out
        if not trust and isinstance(e, pickle.UnpicklingError) and ("is blocked" in str(e) or _runs_code(str(e))):
            raise CheckpointError(f"{path.name} is not a checkpoint to load: {first_line(e)} (a name that can only "
                                  "serve to run code)") from e
        if not trust and isinstance(e, pickle.UnpicklingError) and "global" in str(e).lower():
            raise CheckpointError(
                f"{path.name} holds Python objects beyond tensors ({first_line(e)}); if you trust the file, pass "
                "trust_checkpoint=True to load_model to unpickle it fully") from e
        raise CheckpointError(f"could not read {str(path)!r} as a checkpoint ({type(e).__name__}: {first_line(e)}); "
                              "the file is corrupt or truncated") from e


# Modules whose names a checkpoint has no use for: their functions run code, files or processes (the names
# exploits are built from). A checkpoint that refers to them gets no advice to trust it.
_CODE_MODULES = {"builtins", "__builtin__", "os", "posix", "nt", "subprocess", "sys", "importlib", "runpy", "code",
                 "codeop", "pty", "shutil", "socket", "pickle", "_pickle", "marshal", "ctypes", "types", "operator",
                 "functools", "webbrowser", "platform", "io", "pathlib", "timeit", "multiprocessing", "asyncio",
                 "threading", "signal", "tempfile", "glob", "inspect", "pdb", "bdb"}


def _runs_code(message: str) -> bool:
    m = re.search(r"GLOBAL ([\w.]+)", message)
    if not m:
        return False
    module = m.group(1).rpartition(".")[0] or "builtins"  # torch names builtins without their module
    return module.split(".")[0] in _CODE_MODULES


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


def infer_architecture(sd: Mapping[str, Tensor]) -> tuple[str, dict[str, Any], list[str]]:
    """A timm architecture and its arguments read off a (converted) state dict, for checkpoint files that
    do not say what they hold. Returns (arch, kwargs, notes). Everything is read from tensor shapes except
    the number of heads, which weights cannot tell: it is taken as embed_dim / 64 (the ViT convention;
    MoCo-v3's ViT-S has 12 heads of 32) and said in the notes."""
    w = sd.get("patch_embed.proj.weight")
    if w is None or w.ndim != 4:
        raise CheckpointError("cannot tell the architecture: no patch_embed.proj.weight (is this a ViT?)")
    dim, chans, patch = int(w.shape[0]), int(w.shape[1]), int(w.shape[-1])
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not blocks:
        raise CheckpointError("cannot tell the architecture: no transformer blocks (blocks.N.*) in the checkpoint")
    beit = any(k.endswith("attn.q_bias") for k in sd) or "rel_pos_bias.relative_position_bias_table" in sd
    kw: dict[str, Any] = {"embed_dim": dim, "depth": max(blocks) + 1, "num_heads": max(dim // 64, 1),
                          "patch_size": patch, "in_chans": chans}
    fc1 = sd.get("blocks.0.mlp.fc1.weight")
    if fc1 is not None:
        kw["mlp_ratio"] = fc1.shape[0] / dim
    prefix = (1 if "cls_token" in sd else 0) + (int(sd["reg_token"].shape[1]) if "reg_token" in sd else 0)
    pos = sd.get("pos_embed")
    if pos is not None:
        n = int(pos.shape[1])
        side = int(round((n - prefix) ** 0.5))
        if side * side != n - prefix:  # position embedding without the prefix tokens
            side, kw["no_embed_class"] = int(round(n ** 0.5)), True
        kw["img_size"] = side * patch
    elif beit:
        table = sd.get("rel_pos_bias.relative_position_bias_table",
                       sd.get("blocks.0.attn.relative_position_bias_table"))
        if table is not None:
            side = (int(round((table.shape[0] - 3) ** 0.5)) + 1) // 2
            kw["img_size"] = side * patch
    notes = [f"num_heads={kw['num_heads']} assumed (embed_dim / 64); pass num_heads=... if the model used another"]
    if beit:
        return "beit_base_patch16_224", kw, notes
    kw["class_token"] = "cls_token" in sd
    kw["qkv_bias"] = "blocks.0.attn.qkv.bias" in sd
    if "blocks.0.ls1.gamma" in sd:
        kw["init_values"] = 1e-5  # layer scale present; its values come from the checkpoint
    if "norm_pre.weight" in sd:
        kw["pre_norm"] = True
    if not kw["class_token"]:
        kw.setdefault("global_pool", "avg")
    return "vit_base_patch16_224", kw, notes


# --------------------------------------------------------------------------------------------------
# Converters: one per official layout

def convert_timm(ckpt: Any) -> Converted:
    """A plain state dict in timm's names (also wrapped in ``model``/``state_dict``/``module.``).

    Other layouts timm itself knows (OpenAI CLIP, original DINOv2) pass through and are translated by
    timm's own ``checkpoint_filter_fn`` at load time.
    """
    sd = ckpt
    for key in ("model", "state_dict", "module"):
        if isinstance(sd, Mapping) and key in sd and isinstance(sd[key], Mapping):
            sd = sd[key]
    if not _tensor_dict(sd):
        raise CheckpointError("no state dict of tensors found in the checkpoint")
    sd = dict(sd)
    if all(k.startswith("module.") for k in sd):
        sd = _strip(sd, "module.")
    return Converted(sd, "timm", model_kwargs=_implied_kwargs(sd))


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


def convert_dino(ckpt: Any, key: str = "teacher") -> Converted:
    """DINO training checkpoints (``teacher``/``student``, ``module.``/``backbone.``/``head.``; the
    teacher by default) and backbone-only release files (timm names already)."""
    dropped: dict[str, str] = {}
    if isinstance(ckpt, Mapping) and ("teacher" in ckpt or "student" in ckpt):
        if key not in ckpt:
            raise CheckpointError(f"DINO checkpoint has no {key!r}; it has {sorted(ckpt)}")
        for other in ("teacher", "student"):
            if other != key and other in ckpt:
                dropped[other] = f"DINO {other} (loaded the {key})"
        sd = dict(ckpt[key])
    else:
        sd = dict(ckpt)
    if all(k.startswith("module.") for k in sd):
        sd = _strip(sd, "module.")
    if any(k.startswith("backbone.") for k in sd):
        sd = _drop(sd, r"^head\.", "DINO projection head", dropped)
        sd = _strip(sd, "backbone.")
    return Converted(sd, "dino", dropped, _implied_kwargs(sd))


def convert_mae(ckpt: Any) -> Converted:
    """MAE (``model``): pretrained encoders end in ``norm``; fine-tuned ones mean-pool into
    ``fc_norm`` (global_pool='avg'). The pixel decoder and mask token of visualisation files are dropped."""
    sd = dict(ckpt.get("model", ckpt))
    dropped: dict[str, str] = {}
    sd = _drop(sd, r"^(decoder_|mask_token)", "MAE decoder", dropped)
    return Converted(sd, "mae", dropped, _implied_kwargs(sd))


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


CONVERTERS: dict[str, Callable[[Any], Converted]] = {
    "timm": convert_timm,
    "mocov3": convert_mocov3,
    "dino": convert_dino,
    "mae": convert_mae,
    "beit": convert_beit,
    "simmim": convert_simmim,
}


def detect_format(ckpt: Any) -> str:
    """Guess the layout from the keys (``checkpoint_format=`` overrides)."""
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"a checkpoint must be a dict, got {type(ckpt).__name__}")
    if "teacher" in ckpt or "student" in ckpt:
        return "dino"
    inner = ckpt
    for key in ("state_dict", "model", "module"):
        if key in inner and isinstance(inner[key], Mapping):
            inner = inner[key]
    keys = list(inner)
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
    if fmt == "dino":
        return convert_dino(ckpt, key=dino_key)
    return CONVERTERS[fmt](ckpt)


# --------------------------------------------------------------------------------------------------
# Loading with accounting

def load_into(model: torch.nn.Module, conv: Converted, source: str, strict: bool = True) -> LoadReport:
    """Resample to the model's size (timm's own filter functions), then load, accounting for every key.

    strict: any missing, unexpected or wrongly shaped key raises `CheckpointError` listing them, and
    the model is left untouched. With strict=False what fits is loaded and the report says the rest.
    """
    sd = _timm_filter(model, conv.state_dict)
    own = model.state_dict()
    report = LoadReport(source=source, format=conv.format, dropped=dict(conv.dropped))
    report.resampled = list(conv.resampled) + [k for k in ("pos_embed", "patch_embed.proj.weight")
                        if k in conv.state_dict and k in sd and conv.state_dict[k].shape != sd[k].shape]
    fits: dict[str, Tensor] = {}
    for k, v in sd.items():
        if k not in own:
            report.unexpected.append(k)
        elif own[k].shape != v.shape:
            report.mismatched.append(f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}")
        else:
            fits[k] = v
    report.missing = [k for k in own if k not in sd]
    report.loaded = list(fits)
    if strict and not report.ok:
        raise CheckpointError(
            f"checkpoint {source} does not fit {type(model).__name__}: {report.summary()}. Pass "
            "checkpoint_format=... if the layout was guessed wrong, or strict=False to load what fits.")
    model.load_state_dict(fits, strict=False)
    return report


def _timm_filter(model: torch.nn.Module, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    from timm.models import beit, vision_transformer

    if isinstance(model, beit.Beit):
        return beit.checkpoint_filter_fn(sd, model)
    if isinstance(model, vision_transformer.VisionTransformer):
        return vision_transformer.checkpoint_filter_fn(sd, model)
    return sd
