"""Views: a dataset under a deterministic perturbation, made on the fly per (image, view, seed).

A view is a function ``f(x01, index, seed, **kwargs) -> x01'`` on a batch of images in [0, 1] that are already
resized and cropped for the model (B, 3, H, W); the engine un-normalises each batch with the model's mean and
std, applies the view, clamps to [0, 1] and normalises again (`apply_view`). Randomness comes only from
`image_generator(seed, view_key, image_id)`, so every model, shard and resumed run sees the same pixels.

Specs, as analyses list them (`Analysis.views`): ``"clean"`` (the identity) or ``"kind:arg=value,..."``, e.g.
``"band_noise:band=3"`` or ``"corruption:name=fog,severity=2"``. Kinds are registered with `register_view`.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from vitscope.errors import ConfigError, close_matches

CLEAN = "clean"
VIEW_KINDS: dict[str, Callable[..., torch.Tensor]] = {}


def register_view(kind: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    def deco(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if kind in VIEW_KINDS and VIEW_KINDS[kind] is not fn:
            raise ValueError(f"view kind {kind!r} is registered twice")
        VIEW_KINDS[kind] = fn
        return fn
    return deco


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_view(spec: str) -> tuple[str, dict[str, Any]]:
    """``"kind:a=1,b=x"`` -> ``("kind", {"a": 1, "b": "x"})``; ``"clean"`` -> ``("clean", {})``."""
    spec = str(spec).strip()
    kind, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq:
            raise ConfigError(f"view {spec!r}: expected arguments as name=value, got {part!r}")
        kwargs[k.strip()] = _value(v.strip())
    return kind.strip(), kwargs


def view_key(spec: str) -> str:
    """The canonical spelling of a view (arguments sorted): part of cache keys and of tables."""
    kind, kwargs = parse_view(spec)
    if kind == CLEAN:
        return CLEAN
    return kind + (":" + ",".join(f"{k}={kwargs[k]}" for k in sorted(kwargs)) if kwargs else "")


def check_view(spec: str) -> str:
    """Validate a spec against the registered kinds and their arguments; returns its key. Raises ConfigError."""
    _load_builtin_kinds()
    kind, kwargs = parse_view(spec)
    if kind == CLEAN:
        return CLEAN
    if kind not in VIEW_KINDS:
        hint = close_matches(kind, VIEW_KINDS)
        raise ConfigError(f"unknown view kind {kind!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
                          + f" Known: {', '.join(sorted(VIEW_KINDS)) or 'none'}.")
    sig = inspect.signature(VIEW_KINDS[kind])
    params = list(sig.parameters.values())[3:]  # after x01, index, seed
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params}
    for k in kwargs:
        if k not in names and not accepts_any:
            raise ConfigError(f"view {spec!r}: {kind} takes no argument {k!r}; it takes {', '.join(sorted(names))}")
    missing = [p.name for p in params if p.default is p.empty and p.kind is p.KEYWORD_ONLY and p.name not in kwargs]
    if missing:
        raise ConfigError(f"view {spec!r}: {kind} needs {', '.join(missing)}")
    return view_key(spec)


def image_generator(seed: int, key: str, image_id: int) -> torch.Generator:
    """A generator seeded by (study seed, view key, image id) alone: the same noise for every model and shard."""
    h = hashlib.sha256(f"{int(seed)}|{key}|{int(image_id)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def apply_view(images: torch.Tensor, index: torch.Tensor, spec: str, mean: tuple[float, ...], std: tuple[float, ...],
               seed: int, inplace: bool = False) -> torch.Tensor:
    """Normalised images -> the same images under view ``spec``, normalised again; with ``inplace``, written
    into ``images``' own storage (a worker's batch in shared memory stays there: no copy to send it)."""
    kind, kwargs = parse_view(spec)
    if kind == CLEAN:
        return images
    _load_builtin_kinds()
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    x01 = (images * s).add_(m).clamp_(0, 1)  # in place where the numbers allow: batch-sized buffers cost
    out = VIEW_KINDS[kind](x01, index, seed, **kwargs)
    if out.shape != images.shape:
        raise ValueError(f"view {spec!r} changed the batch's shape {tuple(images.shape)} -> {tuple(out.shape)}")
    return torch.clamp(out, 0, 1, out=images if inplace else None).sub_(m).div_(s)


def _load_builtin_kinds() -> None:
    """Import the modules that register the built-in kinds (perturbations live beside the lenses that use them)."""
    import importlib

    for mod in ("vitscope.data.perturb",):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
