"""`load_model`: a registry name, any timm ViT name, a local checkpoint, or a transformers checkpoint
(directory or hub id) -> `ViTModel`."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import timm
import torch

from vitscope.bounds import ARCH_RANGES, check_arch  # noqa: F401 - ARCH_RANGES: its old home (no torch there)
from vitscope.errors import (
    CheckpointError,
    ConfigError,
    VitscopeError,
    WeightsUnavailableError,
    first_line,
)
from vitscope.models import checkpoints as ck
from vitscope.models import fetch as net
from vitscope.models import hf, layouts
from vitscope.models.adapter import ViTModel
from vitscope.models.names import (  # noqa: F401 - also used from here
    file_given,
    no_decoder,
    random_init_takes_no_file,
    unknown_model,
)
from vitscope.models.registry import CLIP_PREPROCESSING, REGISTRY, ModelSpec, Preprocessing, WeightSource

log = logging.getLogger(__name__)

_LOCAL_HINT = "download the file elsewhere and pass weights='/path/to/file' (or pretrained=False for random init)"


def load_model(
    name_or_path: str | Path,
    weights: str | Path | None = None,
    *,
    pretrained: bool = True,
    checkpoint_format: str = "auto",
    checkpoint_key: str = "teacher",
    strict: bool = True,
    trust_checkpoint: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
    decoder: bool = False,
    decoder_num_heads: int | None = None,
    **model_kwargs: Any,
) -> ViTModel:
    """Build a ViT and load its weights.

    name_or_path: a registry name (``vitscope models``), a timm model name (``vit_small_patch16_224``,
        optionally with a pretrained tag), a checkpoint file (vitscope's own store the architecture;
        for others it is read off the tensor shapes, heads assumed 64-dimensional, override with
        ``num_heads=``, or pass the timm name and ``weights=`` to be explicit), or a Hugging Face
        `transformers` checkpoint: a directory with config.json (as ``save_pretrained`` writes it) or a hub
        id such as ``facebook/dinov2-small`` (ViT, DeiT, DINOv2, CLIP, ViT-MAE, BEiT, Data2Vec-vision, DINOv3,
        SigLIP and SigLIP 2 vision towers, AIMv2).
    weights: a local checkpoint (or URL) in any supported layout: timm, MoCo-v3, DINO, MAE, BEiT,
        SimMIM, DINOv3's official files (``dinov3``), open_clip's own state_dict (``open_clip``), or a
        transformers directory; auto-detected, or forced with ``checkpoint_format``.
        Overrides the entry's own source.
    pretrained: fetch the entry's weights when ``weights`` is not given; False = random init (seeded).
    checkpoint_key: which network of a DINO training checkpoint to load ('teacher' or 'student').
    strict: refuse checkpoints that leave any weight at init or bring unknown keys.
    decoder: also run MAE's pixel decoder, from an MAE checkpoint that keeps it (`vitscope.models.mae_decoder`:
        its blocks follow the encoder's, on all tokens, no masking); ConfigError naming the model when the
        checkpoint has none. ``decoder_num_heads``: its heads (default decoder_embed_dim / 32, MAE's convention).
    model_kwargs: passed to ``timm.create_model`` (e.g. ``img_size=448``, ``depth=2`` for tiny tests).
    """
    file = file_given(name_or_path, None)
    if file and not pretrained:
        raise VitscopeError(random_init_takes_no_file(file))
    spec = resolve_spec(name_or_path)
    if Path(str(name_or_path)).is_file() and weights is None:
        weights = name_or_path
    kwargs = {**spec.model_kwargs, **model_kwargs}
    report = None
    conv = None
    if decoder and weights is None and not (pretrained and spec.weights.kind in ("url", "file")):
        raise ConfigError(no_decoder(spec.name, "it loads no checkpoint file"))
    if weights is None and pretrained and spec.weights.kind == "hf":
        location = spec.weights.location
        weights = location if Path(location).is_dir() else hf.fetch(location, spec.name)
    if weights is not None and hf.is_model_dir(weights):  # transformers: the config decides the architecture
        source = str(weights)
        arch, conv, pre = hf.load_dir(source, spec.model_kwargs, model_kwargs, strict=strict)
        spec = replace(spec, arch=arch, preprocessing=pre)
        kwargs = conv.model_kwargs
        model = _create(spec.arch, kwargs, seed)
        report = ck.load_into(model, conv, source=Path(source).name, strict=strict)
        log.info("%s: %s", spec.name, report.summary())
    elif weights is not None:
        source = str(weights)
        fmt = checkpoint_format if checkpoint_format != "auto" else spec.weights.checkpoint_format
        if fmt == "hf":
            raise CheckpointError(f"{spec.name} is a transformers checkpoint, which needs its config.json: pass the "
                                  f"directory holding config.json and the weights, not {source!r}")
        ckpt = ck.read_checkpoint(_fetch(source, spec), trust=trust_checkpoint)
        conv = layouts.convert(ckpt, fmt, dino_key=checkpoint_key)
        if not spec.arch:  # a bare checkpoint file: read the architecture off its tensors
            arch, inferred, notes = ck.infer_architecture(conv.state_dict, conv.format)
            spec = replace(spec, arch=arch, notes="; ".join(notes))
            if conv.format == "open_clip":  # OpenAI's normalisation, open_clip's default for its ViTs
                spec = replace(spec, preprocessing=CLIP_PREPROCESSING)
            log.warning("%s: architecture inferred from the checkpoint (%s); %s", spec.name, arch, notes[0])
            kwargs = {**inferred, **conv.model_kwargs, **model_kwargs}
        else:
            kwargs = {**spec.model_kwargs, **conv.model_kwargs, **model_kwargs}
        model = _create(spec.arch, kwargs, seed)
        report = ck.load_into(model, conv, source=Path(source).name, strict=strict)
        log.info("%s: %s", spec.name, report.summary())
    elif not pretrained or spec.weights.kind == "none":
        model = _create(spec.arch, kwargs, seed)
    elif spec.weights.kind == "timm":
        model = _create_timm_pretrained(spec, kwargs)
        report = ck.LoadReport(source=spec.timm_name, format="timm (strict load by timm)")
        report.loaded = list(model.state_dict())
    elif spec.weights.kind in ("url", "file"):
        path = _fetch(spec.weights.location, spec)
        if spec.weights.kind == "file":
            path = str(package_file(path))
            if not Path(path).is_file():
                raise WeightsUnavailableError(
                    f"{spec.name}: its weights file {path} is not in this installation; pass "
                    f"weights='/path/to/encoder.safetensors' ({spec.notes})")
        conv = layouts.convert(ck.read_checkpoint(path, trust=trust_checkpoint), spec.weights.checkpoint_format,
                          dino_key=checkpoint_key)
        kwargs = {**spec.model_kwargs, **conv.model_kwargs, **model_kwargs}
        model = _create(spec.arch, kwargs, seed)
        report = ck.load_into(model, conv, source=Path(path).name, strict=strict)
    else:  # manual
        raise WeightsUnavailableError(
            f"{spec.name} weights have no direct download link: get them from {spec.weights.location}, "
            f"then pass weights='/path/to/file' (checkpoint_format={spec.weights.checkpoint_format!r}).")
    if decoder:
        _attach_decoder(model, conv, spec.name, report, decoder_num_heads)
    model.to(device)
    return ViTModel(model=model, name=spec.name, spec=replace(spec, model_kwargs=kwargs), load_report=report)


def _attach_decoder(model: torch.nn.Module, conv: Any, name: str, report: ck.LoadReport | None,
                    num_heads: int | None) -> None:
    """`mae_decoder.attach_decoder` with the converted checkpoint's decoder; the report moves its keys from
    dropped to loaded and says what was assumed."""
    from vitscope.models import mae_decoder

    if conv is None or not conv.decoder:
        raise ConfigError(no_decoder(name, "its checkpoint has none"
                                     + (f" ({conv.format} layout)" if conv is not None else "")))
    notes = mae_decoder.attach_decoder(model, conv.decoder, num_heads)
    if report is not None:
        for k in conv.decoder:
            report.dropped.pop(k, None)
        report.loaded += list(conv.decoder)
        report.notes += notes
    log.info("%s: %s", name, "; ".join(notes))


def resolve_spec(name_or_path: str | Path) -> ModelSpec:
    """Registry entry, ad-hoc entry for a timm name, or the entry stored in a vitscope checkpoint."""
    name = str(name_or_path)
    if name in REGISTRY:
        return REGISTRY[name]
    path = Path(name)
    if path.is_file():
        meta = read_vitscope_metadata(path)
        if meta is None:  # architecture read off the tensors once the checkpoint is converted
            return ModelSpec(path.stem, "", "none", "unknown", WeightSource("file", str(path)))
        return meta
    if path.is_dir():
        if hf.is_model_dir(path):
            return hf.spec_for(path, path.name, str(path))
        raise VitscopeError(f"directory {name!r} has no config.json; vitscope reads transformers checkpoint "
                            "directories (config.json and weights) or single checkpoint files")
    arch, _, tag = name.partition(".")
    if timm.is_model(arch):
        pre = _timm_preprocessing(name)
        source = WeightSource("timm", tag) if tag else WeightSource("timm", _default_tag(arch))
        return ModelSpec(name, arch, "none", "unknown", source, pre)
    if hf.looks_like_hub_id(name):  # a transformers checkpoint on the hub: its config.json is enough here
        return hf.spec_for(hf.fetch(name, name, weights=False), name, name)
    if path.suffix in (".pth", ".pt", ".tar", ".safetensors", ".bin") or "/" in name:
        raise VitscopeError(f"checkpoint file {name!r} does not exist")
    raise unknown_model(name, timm.list_models())  # `vitscope run` refuses it before torch: models/names.py


def _default_tag(arch: str) -> str:
    tags = timm.list_pretrained(arch)
    return tags[0].partition(".")[2] if tags else ""


def _timm_preprocessing(name: str) -> Preprocessing:
    try:
        cfg = timm.get_pretrained_cfg(name if "." in name else (timm.list_pretrained(name) or [name])[0])
    except Exception:  # noqa: BLE001 - fall back to ImageNet defaults
        cfg = None
    if cfg is None:
        return Preprocessing()
    c = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    return Preprocessing(tuple(c.get("mean", Preprocessing.mean)), tuple(c.get("std", Preprocessing.std)),
                         int(c.get("input_size", (3, 224, 224))[-1]), float(c.get("crop_pct", 0.875)),
                         str(c.get("interpolation", "bicubic")))


def _eva_names(arch: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A state dict's implied ``reg_tokens`` (a ViT's argument) as an Eva's ``num_reg_tokens``: the register tokens
    of a saved DINOv3 or RoPE ViT are the same tensor, ``reg_token``, under another argument name."""
    if "reg_tokens" not in kwargs or not timm.is_model(arch) or \
            timm.models.model_entrypoint(arch).__module__ != "timm.models.eva":
        return kwargs
    out = dict(kwargs)
    out.setdefault("num_reg_tokens", out.pop("reg_tokens"))
    out.pop("reg_tokens", None)
    return out


def _create(arch: str, kwargs: dict[str, Any], seed: int) -> torch.nn.Module:
    check_arch(kwargs, arch)
    timm_kwargs, extra = hf.split_build_kwargs(_eva_names(arch, kwargs))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return hf.finish_build(timm.create_model(arch, pretrained=False, **timm_kwargs), extra)
        except TypeError as e:
            raise VitscopeError(f"timm could not build {arch} with {kwargs}: {e}") from e


def _create_timm_pretrained(spec: ModelSpec, kwargs: dict[str, Any]) -> torch.nn.Module:
    """timm's own download, after a connection probe: offline, the hub cache only, failing in seconds."""
    timm_kwargs, extra = hf.split_build_kwargs(kwargs)
    overlay: dict[str, Any] = {}
    reason, cached, url = net.timm_weights(spec.timm_name)
    if reason is not None:
        if cached is None:
            raise WeightsUnavailableError(
                f"{spec.name}: cannot download the {spec.timm_name} weights ({reason}) and they are not in the "
                f"local cache; download {url} elsewhere and pass weights='/path/to/{Path(url).name}' "
                "(or pretrained=False for random init).")
        overlay["pretrained_cfg_overlay"] = {"file": cached}
    try:
        return hf.finish_build(timm.create_model(spec.timm_name, pretrained=True, **overlay, **timm_kwargs), extra)
    except Exception as e:  # noqa: BLE001 - no network to the hub shows up as many exception types
        if isinstance(e, TypeError):  # bad model arguments, not a download problem
            raise
        raise WeightsUnavailableError(
            f"could not fetch {spec.timm_name} weights for {spec.name} from the Hugging Face hub "
            f"({type(e).__name__}); {_LOCAL_HINT}.") from e


def package_file(location: str) -> Path:
    """A registry entry's ``file`` location: absolute as is, else relative to the vitscope package."""
    p = Path(location)
    return p if p.is_absolute() else Path(__file__).resolve().parents[1] / p


def _fetch(location: str, spec: ModelSpec) -> str:
    """A local path as is; a URL through torch.hub's cache (downloaded once, if the network allows)."""
    if "://" not in location:
        return location
    from torch.hub import download_url_to_file, get_dir

    cached = Path(get_dir()) / "checkpoints" / Path(location.split("?")[0]).name
    if cached.is_file():
        return str(cached)
    reason = net.unreachable(location)
    if reason is not None:
        raise WeightsUnavailableError(
            f"{spec.name}: cannot download {location} ({reason}); {_LOCAL_HINT}, or place it at {cached}.")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        download_url_to_file(location, str(cached), progress=True)
    except Exception as e:  # noqa: BLE001
        cached.unlink(missing_ok=True)
        raise WeightsUnavailableError(
            f"could not download {spec.name} weights from {location} ({type(e).__name__}); {_LOCAL_HINT}, "
            f"or place it at {cached}.") from e
    return str(cached)


# -- vitscope's own checkpoints: safetensors with the spec in the metadata -----------------------------

def save_checkpoint(model: torch.nn.Module, path: str | Path, spec: ModelSpec, half: bool = False) -> Path:
    """Write a safetensors file that `load_model(path)` can rebuild without being told the architecture."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    sd = {k: (v.half() if half and v.is_floating_point() else v).contiguous()
          for k, v in model.state_dict().items()}
    meta = {"vitscope.spec": json.dumps(asdict(spec))}
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(sd, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def read_vitscope_metadata(path: Path) -> ModelSpec | None:
    if path.suffix != ".safetensors":
        return None
    from safetensors import SafetensorError, safe_open

    ck.check_checkpoint_file(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except SafetensorError as e:
        raise ck.CheckpointError(f"{str(path)!r} is not a valid safetensors file ({e}); the file is corrupt or "
                                 "truncated") from e
    raw = meta.get("vitscope.spec")
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        pre = d.pop("preprocessing")
        pre = Preprocessing(tuple(pre["mean"]), tuple(pre["std"]), pre["input_size"], pre["crop_pct"],
                            pre["interpolation"])
        d["weights"] = WeightSource("file", str(path), "timm")
        spec = ModelSpec(preprocessing=pre, **d)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ck.CheckpointError(f"{str(path)!r}: its vitscope.spec metadata is not what save_checkpoint writes "
                                 f"({type(e).__name__}: {first_line(e)}); rewrite the file with save_checkpoint"
                                 ) from None
    if not isinstance(spec.arch, str) or not timm.is_model(spec.arch):  # a timm architecture, never a hub lookup
        raise ck.CheckpointError(f"{str(path)!r}: its vitscope.spec names {spec.arch!r}, which is not a timm "
                                 "architecture (files name architectures, never hub repositories)")
    return spec


#: what a failed build says about its arguments (timm's checks are asserts, TypeErrors and ValueErrors); any other
#: exception on the meta device is not taken as the config's fault
_BUILD_ERRORS = (TypeError, ValueError, AssertionError, KeyError)


def check_build(mc: Any) -> None:
    """Before any model loads (`vitscope.study.config.preflight`): a model that timm builds from its name and
    ``kwargs`` alone (random init, timm's own weights) is built on the meta device (shapes, no storage) with the
    arguments the load will use, so arguments timm refuses (``embed_dim`` not divisible by ``num_heads``, an
    unknown or mistyped keyword) are one ConfigError sentence, and a model whose float32 parameters exceed the
    memory free here (each size within its bound, their product not) is refused instead of allocated. Models
    whose architecture comes from a file (a checkpoint, a transformers directory, a registry entry's weights) are
    checked against that file elsewhere."""
    from vitscope.files import human
    from vitscope.host import free_memory

    if file_given(mc.name, mc.weights) or mc.weights:
        return
    spec = resolve_spec(mc.name)
    if not spec.arch or (mc.pretrained and spec.weights.kind not in ("none", "timm")):
        return
    kwargs = {**spec.model_kwargs, **(mc.kwargs or {})}
    try:
        with torch.device("meta"):
            model = _create(spec.arch, kwargs, 0)
    except ConfigError:
        raise
    except (VitscopeError, *_BUILD_ERRORS) as e:
        cause = e.__cause__ if e.__cause__ is not None else e  # _create's "timm could not build" wraps TypeErrors
        raise ConfigError(f"timm cannot build {spec.arch} with kwargs {kwargs}: {first_line(cause)}") from None
    except Exception:  # noqa: BLE001 - the meta device itself, not the arguments: the load says what is wrong
        return
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    free = free_memory("cpu")
    if free is not None and n * 4 > free:
        raise ConfigError(f"{spec.arch} with kwargs {kwargs} has {n:,} parameters, {human(n * 4)} in float32, more "
                          f"than the {human(free)} of memory free here: choose a smaller embed_dim, depth or mlp_ratio")
