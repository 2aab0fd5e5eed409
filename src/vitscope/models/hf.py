"""Hugging Face `transformers` ViT checkpoints -> timm models, from config.json and the state dict alone.

A checkpoint is a directory as ``save_pretrained`` writes it (``config.json``, ``model.safetensors`` or
``pytorch_model.bin``, possibly sharded, and ``preprocessor_config.json``) or a hub id (``org/name``). The
family comes from ``config.json`` (``model_type``, ``architectures``; an image-text model's vision tower from
its ``vision_config``); the timm architecture is built with the config's numbers; the weights are renamed to
timm's keys (q/k/v joined, heads kept) and loaded with the same strict key accounting as every other layout
(`checkpoints.load_into`). `transformers` is never imported.

This module reads (directories, config.json, weight files and their shapes), loads (`load_dir`), builds
(`finish_build`) and fetches from the hub; the per-family part (config defaults, `architecture`,
`preprocessing`, `convert`, and the table of families and what each implies) is `vitscope.models.hf_arch`.

Three architecture arguments are vitscope's own, applied after timm builds the model (`finish_build`):
``layer_norm_eps`` (transformers' ViTs use 1e-12 where timm uses 1e-6), ``head_input='cls+mean'`` and
``attn_pool='aimv2'`` (AIMv2's attention-pooling head).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitscope.errors import CheckpointError, VitscopeError, WeightsUnavailableError
from vitscope.files import inside
from vitscope.models.checkpoints import read_checkpoint
from vitscope.models.hf_arch import (
    _AIMV2S,
    _CITATIONS,
    _NESTED,
    _SIGLIPS,
    _TEXT_TOWERS,
    DEFAULTS,
    SUPPORTED,
    aimv2_sincos,
    architecture,
    convert,
    implied_kwargs,
    preprocessing,
    resample_pos_embed,
)
from vitscope.models.hf_keys import _split_prefix
from vitscope.models.layouts import Converted
from vitscope.models.names import HF_CONFIG, is_model_dir  # noqa: F401 - is_model_dir: also used from here
from vitscope.models.registry import ModelSpec, Preprocessing, WeightSource

Tensor = torch.Tensor

CONFIG = HF_CONFIG
PREPROCESSOR = "preprocessor_config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


# --------------------------------------------------------------------------------------------------
# Recognising and reading checkpoints

def looks_like_hub_id(name: str) -> bool:
    """``org/name`` that is not a local path and not a checkpoint file name."""
    return bool(_HUB_ID.match(name)) and not Path(name).exists() and not name.endswith(
        (".pth", ".pt", ".tar", ".safetensors", ".bin", ".json"))


def read_config(directory: str | Path) -> dict[str, Any]:
    """config.json with the family's defaults filled in; raises on a model type that is not a supported ViT."""
    directory = Path(directory)
    try:
        raw = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"could not read {directory / CONFIG}: {e}") from e
    model_type = raw.get("model_type")
    if model_type in _TEXT_TOWERS:
        arch = ", ".join(raw.get("architectures") or []) or "no architectures listed"
        family, instead = _TEXT_TOWERS[model_type]
        raise CheckpointError(
            f"{directory}: model_type {model_type!r} ({arch}) is {family}'s text tower, which takes no images; "
            f"pass a {family} vision tower or full model directory instead (model_type {instead}), whose vision "
            "tower vitscope converts.")
    if model_type not in DEFAULTS:
        arch = ", ".join(raw.get("architectures") or []) or "no architectures listed"
        raise CheckpointError(
            f"{directory}: model_type {model_type!r} ({arch}) is not a Vision Transformer vitscope can convert; "
            f"the supported transformers families are {', '.join(SUPPORTED)}.")
    vision = raw.get("vision_config", {}) if model_type in _NESTED else raw  # transformers' defaults if absent
    if not isinstance(vision, Mapping):
        raise CheckpointError(f"{directory / CONFIG}: vision_config is not a mapping ({type(vision).__name__})")
    cfg = {**DEFAULTS[model_type], **vision}
    cfg["model_type"] = model_type
    for key in ("image_size", "patch_size"):  # DINOv3 and AIMv2 configs may give [height, width]
        if isinstance(cfg[key], list | tuple):
            if len(set(cfg[key])) != 1:
                raise CheckpointError(f"{directory / CONFIG}: {key} {list(cfg[key])} is not square; vitscope "
                                      "converts square image and patch sizes")
            cfg[key] = cfg[key][0]
    if model_type.startswith("siglip2"):  # NaFlex: no image size, a square grid of num_patches position embeddings
        cfg["image_size"] = math.isqrt(max(int(cfg["num_patches"]), 0)) * int(cfg["patch_size"])
    cfg["architectures"] = list(raw.get("architectures") or [])
    cfg["id2label"] = raw.get("id2label")
    cfg["num_labels"] = raw.get("num_labels")
    return cfg


def read_preprocessor(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / PREPROCESSOR
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"could not read {path}: {e}") from e


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory (all shards when it is sharded), safetensors first."""
    directory = Path(directory)
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            index = json.loads(path.read_text())
            shards = [inside(directory, s, f"{directory / name}: weight_map")
                      for s in sorted(set(index.get("weight_map", {}).values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise CheckpointError(f"{directory}: shards listed in {name} are missing: {', '.join(missing)}")
            return shards
        return [path]
    raise CheckpointError(f"{directory} has a config.json but no weights ({' or '.join(WEIGHT_FILES[::2])})")


def weight_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every weight of a checkpoint directory, read from the safetensors headers (or the pickles
    of ``pytorch_model.bin``, walked without building a tensor): no weight is read."""
    from safetensors import SafetensorError, safe_open

    from vitscope.models.checkpoints import check_checkpoint_file
    from vitscope.models.torchfile import declared_shapes

    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(directory):
        check_checkpoint_file(f)
        if f.suffix != ".safetensors":
            shapes.update(declared_shapes(f))
            continue
        try:
            with safe_open(str(f), "pt") as h:
                shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})  # noqa: SIM118
        except SafetensorError as e:
            raise CheckpointError(f"{str(f)!r} is not a valid safetensors file ({e}); the file is corrupt or "
                                  "truncated") from e
    return shapes


#: sizes a config may give that its weights do not hold, with strict=False: the blocks or MLP widths that fit load
_PARTIAL = ("num_hidden_layers", "intermediate_size", "mlp_ratio")
#: where `check_sizes` reads the sizes: patch projections, blocks, first MLP layers (per family)
_PATCH_KEYS = ("embeddings.patch_embeddings.projection.weight", "embeddings.patch_embedding.weight",
               "embeddings.patch_embeddings.weight", "embeddings.patch_embed.weight")
_LAYER = r"^(?:encoder\.layers?|(?:model\.)?layer)\.(\d+)\."
_LAYER_PREFIXES = ("encoder.layer.", "encoder.layers.", "layer.", "model.layer.")
_FC1_KEYS = ("intermediate.dense", "mlp.fc1", "mlp.weights_in", "mlp.up_proj", "ffn.gate_proj")


def check_sizes(directory: str | Path, cfg: Mapping[str, Any], strict: bool = True) -> None:
    """The config's sizes (hidden_size, num_hidden_layers, intermediate_size or DINOv2's mlp_ratio, patch_size,
    image_size, num_channels) against the shapes of its weights (`weight_shapes`: headers only), before any model
    is built: a config claiming sizes its weights do not have would otherwise build (allocate) that model first.
    One CheckpointError sentence naming each key and both values; with strict=False only the depth and MLP width
    may differ (what fits is then loaded and reported)."""
    directory = Path(directory)
    base = _split_prefix(weight_shapes(directory))[1]

    def num(key: str) -> int:
        try:
            return int(cfg[key])
        except (TypeError, ValueError, KeyError):
            raise CheckpointError(f"{directory / CONFIG}: {key} must be a whole number; got {cfg.get(key)!r}"
                                  ) from None

    held: dict[str, int] = {}
    proj = next((base[k] for k in _PATCH_KEYS if k in base), None)
    if proj is not None and len(proj) == 4:
        held.update(hidden_size=proj[0], num_channels=proj[1], patch_size=proj[2])
    elif proj is not None and len(proj) == 2:  # SigLIP 2: a linear layer over flattened patches
        held["hidden_size"] = proj[0]
    layers = {int(m.group(1)) for k in base if (m := re.match(_LAYER, k))}
    if layers:
        held["num_hidden_layers"] = max(layers) + 1
    fc1 = next((base[k] for k in (f"{layer}0.{mlp}.weight" for layer in _LAYER_PREFIXES for mlp in _FC1_KEYS)
                if k in base), None)
    pos = base.get("embeddings.position_embeddings", base.get("embeddings.position_embedding.weight"))
    said: list[tuple[str, Any, int]] = [(k, num(k), v) for k, v in held.items() if num(k) != v]
    if proj is not None and len(proj) == 2 and not said and num("num_channels") * num("patch_size") ** 2 != proj[1]:
        said.append(("patch_size", num("patch_size"), f"{proj[1]} values per patch"))
    if fc1 is not None and len(fc1) == 2 and "hidden_size" not in {k for k, _, _ in said}:
        dinov2 = cfg["model_type"].startswith("dinov2")
        kw = architecture(cfg)[1]
        width = int(kw["embed_dim"] * kw["mlp_ratio"])  # timm's MLP width, as the model would be built
        if width != fc1[0]:
            said.append(("mlp_ratio" if dinov2 else "intermediate_size",
                         f"{cfg['mlp_ratio']} (an MLP {width} wide)" if dinov2 else num("intermediate_size"),
                         fc1[0]))
    if pos is not None and len(pos) >= 2 and cfg["model_type"].startswith("siglip2"):
        if pos[-2] != num("num_patches"):
            said.append(("num_patches", num("num_patches"), pos[-2]))
    elif pos is not None and len(pos) >= 2 and "patch_size" not in {k for k, _, _ in said}:
        # the class (and distillation) token's; SigLIP and AIMv2 have none
        tokens = pos[-2] - {"deit": 2, **dict.fromkeys(_SIGLIPS + _AIMV2S, 0)}.get(cfg["model_type"], 1)
        side = math.isqrt(max(tokens, 0))
        patch = num("patch_size")
        if side * side != tokens or side != num("image_size") // patch:
            said.append(("image_size", num("image_size"), f"{side * patch} ({pos[-2]} position embeddings)"))
    if said and (strict or any(k not in _PARTIAL for k, _, _ in said)):
        way = ", or pass strict=False to load what fits" if all(k in _PARTIAL for k, _, _ in said) else ""
        raise CheckpointError(
            f"{directory / CONFIG} does not describe its weights: "
            + ", ".join(f"{k} is {c} in the config and {w} in the weights" for k, c, w in said)
            + f"; correct config.json{way} (nothing was built)")


def read_state_dict(directory: str | Path) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {}
    for f in weight_files(directory):
        part = read_checkpoint(f)
        sd.update(part.get("state_dict", part) if isinstance(part, Mapping) else part)
    return sd


# --------------------------------------------------------------------------------------------------
# A directory as a registry entry, and as converted weights

def spec_for(directory: str | Path, name: str, location: str) -> ModelSpec:
    """An ad-hoc registry entry for a checkpoint directory (``location``: the directory or the hub id)."""
    cfg = read_config(directory)
    arch = architecture(cfg)[0]
    pre = preprocessing(cfg, read_preprocessor(directory))
    what = ", ".join(cfg["architectures"]) or cfg["model_type"]
    return ModelSpec(name, arch, "none", "unknown", WeightSource("hf", location, "hf"), pre,
                     implied_kwargs(cfg, pre),
                     citation=_CITATIONS[cfg["model_type"]],
                     notes=f"transformers {what} (model_type {cfg['model_type']}), converted to timm {arch}")


def load_dir(directory: str | Path, entry_kwargs: Mapping[str, Any] | None = None,
             overrides: Mapping[str, Any] | None = None, strict: bool = True) -> tuple[str, Converted, Preprocessing]:
    """Read and convert a checkpoint directory: (timm architecture, converted weights with the final
    architecture arguments, preprocessing).

    entry_kwargs: a registry entry's architecture arguments; those that differ from what the checkpoint
    implies (e.g. ``img_size=224`` for a 518 px DINOv2) are deliberate and win over the checkpoint's.
    overrides: the caller's own arguments (``load_model(..., img_size=448)``), which win over both.
    strict: as `load_model`'s; the config's sizes are checked against the weights' shapes first (`check_sizes`).
    """
    from vitscope.bounds import check_arch

    cfg = read_config(directory)
    check_sizes(directory, cfg, strict)
    check_arch(architecture(cfg)[1], str(Path(directory) / CONFIG))  # sizes no machine holds, before any weight
    pre = preprocessing(cfg, read_preprocessor(directory))
    arch, conv = convert(read_state_dict(directory), cfg)
    implied = implied_kwargs(cfg, pre)
    departures = {k: v for k, v in (entry_kwargs or {}).items() if k not in implied or implied[k] != v}
    conv.model_kwargs.update({"img_size": pre.input_size, **departures, **(overrides or {})})
    size, patch = conv.model_kwargs["img_size"], int(cfg["patch_size"])
    pos = conv.state_dict.get("pos_embed")
    if cfg["model_type"] in _AIMV2S and cfg["is_native"] and isinstance(size, int):  # computed, at the built grid
        conv.state_dict["pos_embed"] = aimv2_sincos(size // patch, int(cfg["hidden_size"]))
    elif pos is not None and isinstance(size, int) and size != int(cfg["image_size"]):
        conv.state_dict["pos_embed"] = resample_pos_embed(pos, int(cfg["image_size"]) // patch, size // patch,
                                                          antialias=cfg["model_type"] == "dinov2_with_registers")
        conv.resampled.append("pos_embed")
    return arch, conv, pre


# --------------------------------------------------------------------------------------------------
# Building: the three arguments timm does not take

BUILD_KWARGS = ("layer_norm_eps", "head_input", "attn_pool")


class ClsMeanHead(nn.Linear):
    """transformers' DINOv2 classifier: a linear layer on [class token, mean of the patch tokens]."""

    def __init__(self, dim: int, num_classes: int, num_prefix_tokens: int) -> None:
        super().__init__(2 * dim, num_classes)
        self.num_prefix_tokens = num_prefix_tokens

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(torch.cat([x[:, 0], x[:, self.num_prefix_tokens:].mean(1)], dim=-1))


def split_build_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arguments for timm.create_model, vitscope's own build arguments)."""
    return ({k: v for k, v in kwargs.items() if k not in BUILD_KWARGS},
            {k: v for k, v in kwargs.items() if k in BUILD_KWARGS})


def finish_build(model: nn.Module, extra: Mapping[str, Any]) -> nn.Module:
    eps = extra.get("layer_norm_eps")
    if eps is not None:
        from timm.layers import RmsNorm  # AIMv2's norms

        for m in model.modules():
            if isinstance(m, nn.LayerNorm | RmsNorm):
                m.eps = float(eps)
    head_input = extra.get("head_input")
    if head_input == "cls+mean":
        if getattr(model, "global_pool", None) != "" or not isinstance(model.head, nn.Linear):
            raise VitscopeError("head_input='cls+mean' needs global_pool='' and num_classes > 0")
        model.head = ClsMeanHead(model.embed_dim, model.head.out_features, model.num_prefix_tokens)
    elif head_input is not None:
        raise VitscopeError(f"unknown head_input {head_input!r}; the one supported is 'cls+mean'")
    pool = extra.get("attn_pool")
    if pool == "aimv2":  # AIMv2's attention-pooling head: the learned query as it is, k and v (with the blocks'
        ap = getattr(model, "attn_pool", None)  # qkv bias or none), an output projection, nothing after
        if ap is None:
            raise VitscopeError("attn_pool='aimv2' needs global_pool='map'")
        dim = model.embed_dim
        ap.q, ap.norm, ap.mlp = nn.Identity(), nn.Identity(), None
        ap.kv = nn.Linear(dim, 2 * dim, bias=model.blocks[0].attn.qkv.bias is not None)
    elif pool is not None:
        raise VitscopeError(f"unknown attn_pool {pool!r}; the one supported is 'aimv2'")
    return model


# --------------------------------------------------------------------------------------------------
# The hub

def fetch(repo_id: str, name: str, revision: str | None = None, weights: bool = True) -> Path:
    """The local directory of a hub checkpoint (the hub cache's snapshot), downloading what is missing.

    Offline (``HF_HUB_OFFLINE`` or no connection to the hub within a few seconds) only the cache is used,
    and a missing file fails at once with the repository and files to fetch by hand.
    """
    from vitscope.models import fetch as net

    reason = net.hub_offline()
    if reason is None:
        try:
            return _download(repo_id, revision, weights)
        except WeightsUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - a network failure after the probe: fall back to the cache
            reason = f"{type(e).__name__}: {e}".split("\n")[0]
    config = net.cached_hub_file(repo_id, [CONFIG], revision)
    directory = Path(config).parent if config else None
    if directory is not None and (not weights or any((directory / f).is_file() for f in WEIGHT_FILES)):
        return directory
    raise WeightsUnavailableError(
        f"{name}: {repo_id} is not in the local hub cache and the Hugging Face hub is unreachable ({reason}); "
        f"download {CONFIG}, {WEIGHT_FILES[0]} (or {WEIGHT_FILES[2]}) and {PREPROCESSOR} if there is one from "
        f"{net.hub_endpoint()}/{repo_id} into a directory and pass it: vs.load_model('/path/to/dir'), or "
        "weights='/path/to/dir'.")


def _download(repo_id: str, revision: str | None, weights: bool) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        directory = Path(hf_hub_download(repo_id, CONFIG, revision=revision)).parent
    except RepositoryNotFoundError as e:
        raise WeightsUnavailableError(
            f"{repo_id!r} is not a local directory, and the Hugging Face hub has no such repository (or it is "
            "private or gated: log in with `hf auth login`).") from e
    try:
        hf_hub_download(repo_id, PREPROCESSOR, revision=revision)
    except LocalEntryNotFoundError:  # a connection problem (a subclass of the "no such file" error)
        raise
    except EntryNotFoundError:
        pass
    if not weights:
        return directory
    for name in WEIGHT_FILES:
        try:
            path = Path(hf_hub_download(repo_id, name, revision=revision))
        except LocalEntryNotFoundError:
            raise
        except EntryNotFoundError:
            continue
        if name.endswith(".index.json"):
            for shard in sorted(set(json.loads(path.read_text()).get("weight_map", {}).values())):
                hf_hub_download(repo_id, shard, revision=revision)
        return directory
    raise WeightsUnavailableError(f"{repo_id} on the Hugging Face hub has a config.json but none of "
                                  f"{', '.join(WEIGHT_FILES)}")
