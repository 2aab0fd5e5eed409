"""Checkpoint files -> timm models, with strict key accounting.

Reading a file without running its code (`check_checkpoint_file`, `read_checkpoint`: safetensors, or a torch
pickle read with ``weights_only``), telling the architecture a converted state dict holds (`infer_architecture`),
and loading it (`load_into`): what arrives is compared with what the model expects, every key is accounted for
in a `LoadReport`, and nothing is silently left at init. The per-publisher layouts (converters to timm's key
names, `convert`, `detect_format`) are in `vitscope.models.layouts`.
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vitscope.errors import CheckpointError, first_line, preview
from vitscope.models.layouts import _ACT_NOTE, Converted, _clip_architecture, _dinov3_architecture

Tensor = torch.Tensor


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
    notes: list[str] = field(default_factory=list)  # assumptions the weights cannot confirm (e.g. the activation)

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
        parts += self.notes
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


def _torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (a zip holding ``constants.pkl`` and ``code/``), read as a zip
    listing only."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


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
    if _torchscript(path):
        raise CheckpointError(
            f"{path.name} is a TorchScript archive (as OpenAI's original CLIP files are), not a state dict, and "
            "vitscope reads weights only: use the state dict of the same model (open_clip's "
            "open_clip_pytorch_model.bin), or, for a file you trust, save torch.jit.load(path).state_dict() with "
            "torch.save and pass that")
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


# --------------------------------------------------------------------------------------------------
# The architecture a converted state dict holds (per layout: `layouts._dinov3_architecture`,
# `layouts._clip_architecture`)

def infer_architecture(sd: Mapping[str, Tensor], fmt: str = "") -> tuple[str, dict[str, Any], list[str]]:
    """A timm architecture and its arguments read off a (converted) state dict, for checkpoint files that
    do not say what they hold; ``fmt`` is the layout the converter read (`Converted.format`). Returns (arch,
    kwargs, notes). Everything is read from tensor shapes except what weights cannot tell, said in the notes:
    the number of heads is taken as embed_dim / 64 (the ViT convention; MoCo-v3's ViT-S has 12 heads of 32)
    unless the file shows the head size (DINOv3's RoPE periods); an open_clip tower's activation
    (`_clip_architecture`)."""
    w = sd.get("patch_embed.proj.weight")
    if w is None or w.ndim != 4:
        raise CheckpointError("cannot tell the architecture: no patch_embed.proj.weight (is this a ViT?)")
    dim, chans, patch = int(w.shape[0]), int(w.shape[1]), int(w.shape[-1])
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not blocks:
        raise CheckpointError("cannot tell the architecture: no transformer blocks (blocks.N.*) in the checkpoint")
    if fmt == "dinov3":
        return _dinov3_architecture(sd, dim, chans, patch, max(blocks) + 1)
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
    if fmt == "open_clip":
        return _clip_architecture(sd, kw, notes)
    return "vit_base_patch16_224", kw, notes


# --------------------------------------------------------------------------------------------------
# Loading with accounting

def load_into(model: torch.nn.Module, conv: Converted, source: str, strict: bool = True) -> LoadReport:
    """Resample to the model's size (timm's own filter functions), then load, accounting for every key.

    strict: any missing, unexpected or wrongly shaped key raises `CheckpointError` listing them, and
    the model is left untouched. With strict=False what fits is loaded and the report says the rest.
    """
    report = LoadReport(source=source, format=conv.format, dropped=dict(conv.dropped), notes=list(conv.notes))
    sd = _timm_filter(model, conv.state_dict, conv.format, report)
    own = model.state_dict()
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


def _timm_filter(model: torch.nn.Module, sd: dict[str, Tensor], fmt: str = "",
                 report: LoadReport | None = None) -> dict[str, Tensor]:
    from timm.models import beit, eva, vision_transformer

    report = report if report is not None else LoadReport(source="", format=fmt)
    if fmt == "open_clip":
        act = getattr(getattr(getattr(model, "blocks", [None])[0], "mlp", None), "act", None)
        if act is not None:
            report.notes.append(f"activation {type(act).__name__} ({_ACT_NOTE})")
    if isinstance(model, eva.Eva):
        return _eva_filter(model, sd, report) if fmt == "dinov3" else sd
    if isinstance(model, beit.Beit):
        return beit.checkpoint_filter_fn(sd, model)
    if isinstance(model, vision_transformer.VisionTransformer):
        return vision_transformer.checkpoint_filter_fn(sd, model)
    return sd


def _eva_filter(model: torch.nn.Module, sd: dict[str, Tensor], report: LoadReport) -> dict[str, Tensor]:
    """A converted DINOv3 state dict against the Eva it loads into: RoPE periods compared with the model's
    (then dropped), all-zero q/v biases dropped when the model has none, then timm's own filter (patch
    embedding resampled to the model's patch size)."""
    from timm.models import eva

    sd = dict(sd)
    own = model.state_dict()
    periods = sd.pop("rope.periods", None)
    if periods is not None:
        mine = getattr(getattr(model, "rope", None), "periods", None)
        tol = 4 * torch.finfo(periods.dtype).eps if periods.is_floating_point() else 0.0
        if mine is None or mine.shape != periods.shape or not torch.allclose(
                periods.double(), mine.double(), rtol=tol, atol=0.0):
            report.mismatched.append(
                "rope_embed.periods (the file's RoPE periods are not the model's: another head size, RoPE base "
                "or period range)")
        else:
            report.dropped["rope_embed.periods"] = "RoPE periods: recomputed by the model (equal to the file's)"
    for k in [k for k in sd if k.endswith(("attn.q_bias", "attn.v_bias")) and k not in own]:
        if not sd[k].any():
            report.dropped[k] = "qkv bias all zero: the model is built without one"
            del sd[k]
    return eva.checkpoint_filter_fn(sd, model)
