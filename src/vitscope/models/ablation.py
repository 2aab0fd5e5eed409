"""Head ablation as a write-hook: an ablated model variant is the same weights with a forward pre-hook on each
ablated block's attention output projection (``attn.proj``, whose input is the ``block{i}.heads`` tap: the heads'
outputs concatenated) that replaces the chosen heads' slices by 0 (``zero``) or by their mean over images at the
same token position (``mean``). Nothing is written to the weights; `Ablation.remove` takes the hooks off.

A study names a variant with ``ablate:`` on a model entry (`parse_spec`, docs/CONFIG.md)::

    {name: zoo-dino, ablate: {heads: local, mode: mean}}        # a head type, resolved per model
    {name: zoo-dino, ablate: {heads: [[3, 0], [3, 2]]}}         # (layer, head) pairs
    {name: zoo-dino, ablate: {layers: [2, 3], heads: all}}      # every head of blocks 2 and 3
    {name: zoo-dino, ablate: {layers: [3], heads: [0, 2]}}      # heads 0 and 2 of block 3

Head types (`resolve`): the rule of ``aligned_attention_maps`` (`vitscope.metrics.attention.head_types`, default
thresholds, with the mean attention distance) on the AAAM of the first ``images`` images of the statistics
dataset (``dataset``, default the study's first dataset; the first of its selection, in order, clean). ``local``
is every local type (strict_local, soft_local, axial, offset_local); any single type may be named too. The mean
(``mode: mean``) is the one `HeadAblation` uses (`head_means`): per token position, over the same first
``images`` images, of the CLEAN model's heads. Both come from one statistics pass, run when the variant is
loaded (again on a resume: the same images give the same result).

Cost: one forward per image per variant and pass, like any model, plus the statistics pass (``images`` forwards,
attention maps unfused when a head type is named) when ``mode`` is mean or ``heads`` a type."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vitscope.errors import ConfigError, VitscopeError, close_matches

MODES = ("zero", "mean")
LOCAL_TYPES = ("strict_local", "soft_local", "axial", "offset_local")
KEYS = ("heads", "layers", "mode", "images", "dataset")


def head_type_names() -> tuple[str, ...]:
    from vitscope.analyses.attention import HEAD_TYPES

    return ("local", *HEAD_TYPES)


@dataclass(frozen=True)
class AblationSpec:
    """A parsed ``ablate:`` entry. ``heads``: "all", a head type (`head_type_names`), a tuple of heads (with
    ``layers``) or of (layer, head) pairs; ``layers``: the blocks (None: every block, or those of the pairs)."""

    heads: Any
    layers: tuple[int, ...] | None = None
    mode: str = "zero"
    images: int = 500
    dataset: str | None = None

    @property
    def head_type(self) -> str | None:
        return self.heads if isinstance(self.heads, str) and self.heads != "all" else None

    @property
    def needs_statistics(self) -> bool:
        return self.mode == "mean" or self.head_type is not None

    def as_dict(self) -> dict[str, Any]:
        heads = self.heads if isinstance(self.heads, str) else [list(h) if isinstance(h, tuple) else h
                                                                for h in self.heads]
        return {"heads": heads, "layers": None if self.layers is None else list(self.layers), "mode": self.mode,
                "images": self.images if self.needs_statistics else None, "dataset": self.dataset}

    def describe(self) -> str:
        """``local heads (mean)``, ``heads 3.0, 3.2 (zero)``, ``all heads of blocks 2, 3 (zero)``."""
        blocks = "" if self.layers is None else f" of block{'s' if len(self.layers) > 1 else ''} " + ", ".join(
            str(i) for i in self.layers)
        if self.heads == "all":
            what = f"all heads{blocks or ' of every block'}"
        elif self.head_type is not None:
            what = f"{self.head_type} heads{blocks}"
        elif self.heads and isinstance(self.heads[0], tuple):
            what = "heads " + ", ".join(f"{i}.{h}" for i, h in self.heads)
        else:
            what = "heads " + ", ".join(str(h) for h in self.heads) + blocks
        return f"{what} ({self.mode})"


def default_label(name: str, spec: AblationSpec) -> str:
    """The variant's name in tables and the report when its entry gives no ``label``."""
    return f"{name} \u2212 {spec.describe()}"


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    if isinstance(value, bool) or not isinstance(value, list | tuple) or not value or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ConfigError(f"{where}.{what} must be a non-empty list of block or head numbers (0 or more); got "
                          f"{value!r}")
    return tuple(int(v) for v in value)


def parse_spec(raw: Any, where: str) -> AblationSpec:
    """``raw`` (a model entry's ``ablate:``) as an `AblationSpec`; ConfigError in one sentence naming ``where``."""
    from vitscope.errors import check_choice

    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a mapping ({{heads: local, mode: mean}}, {{heads: [[3, 0]]}}, "
                          f"{{layers: [2], heads: all}}); got {raw!r}")
    for k in raw:
        if k not in KEYS:
            hint = close_matches(str(k), KEYS, n=1)
            raise ConfigError(f"{where}: unknown key {str(k)!r}; "
                              + (f"did you mean {hint[0]!r}?" if hint else f"the keys are {', '.join(KEYS)}"))
    if "heads" not in raw:
        raise ConfigError(f"{where} needs `heads`: all, a head type ({', '.join(head_type_names())}), a list of "
                          "[layer, head] pairs, or a list of heads with `layers`")
    mode = check_choice(raw.get("mode", "zero"), MODES, where, "mode", "zero or mean")
    images = raw.get("images", 500)
    if isinstance(images, bool) or not isinstance(images, int) or images < 1:
        raise ConfigError(f"{where}.images must be a whole number of images, 1 or more; got {images!r}")
    dataset = raw.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise ConfigError(f"{where}.dataset must name one of the study's datasets; got {dataset!r}")
    layers = None if raw.get("layers") is None else _ints(list(raw["layers"]), where, "layers")
    heads: Any = raw["heads"]
    if isinstance(heads, str):
        if heads != "all" and heads not in head_type_names():
            hint = close_matches(heads, ("all", *head_type_names()), n=3)
            raise ConfigError(f"{where}.heads: {heads!r} is neither `all` nor a head type"
                              + (f"; did you mean {', '.join(hint)}?" if hint else "")
                              + f" Head types: {', '.join(head_type_names())}.")
    elif isinstance(heads, list | tuple) and heads and all(isinstance(h, list | tuple) for h in heads):
        if layers is not None:
            raise ConfigError(f"{where}: give either [layer, head] pairs in `heads` or `layers` with a list of heads, "
                              "not both")
        pairs = []
        for h in heads:
            pair = _ints(list(h), where, "heads")
            if len(pair) != 2:
                raise ConfigError(f"{where}.heads: each pair is [layer, head]; got {list(h)!r}")
            pairs.append(pair)
        heads = tuple(sorted(set(pairs)))
    else:
        heads = tuple(sorted(set(_ints(heads, where, "heads"))))
        if layers is None:
            raise ConfigError(f"{where}: a list of heads needs `layers` (the blocks whose heads {list(heads)} are "
                              "ablated), or give [layer, head] pairs")
    if layers is not None:
        layers = tuple(sorted(set(layers)))
    return AblationSpec(heads, layers, mode, int(images), dataset)


def check_bounds(spec: AblationSpec, depth: int, num_heads: int, who: str) -> None:
    """Block and head numbers within the model (depth blocks of num_heads heads): VitscopeError in one sentence."""
    blocks = set(spec.layers or ()) | ({i for i, _ in spec.heads} if _pairs(spec) else set())
    heads = {h for _, h in spec.heads} if _pairs(spec) else (set(spec.heads) if not isinstance(spec.heads, str)
                                                              else set())
    if blocks and max(blocks) >= depth:
        raise ConfigError(f"{who}: block {max(blocks)} is out of range: the model has {depth} blocks (0..{depth - 1})")
    if heads and max(heads) >= num_heads:
        raise ConfigError(f"{who}: head {max(heads)} is out of range: the model has {num_heads} heads per block "
                          f"(0..{num_heads - 1})")


def _pairs(spec: AblationSpec) -> bool:
    return not isinstance(spec.heads, str) and bool(spec.heads) and isinstance(spec.heads[0], tuple)


# ---------------------------------------------------------------- the shared pieces (also `HeadAblation`'s)


def head_means(vm: Any, layers: Iterable[int], first_images: Callable[[int], Iterable[Any]], n_images: int,
               who: str, extra: Callable[[Mapping[str, torch.Tensor], Any], None] | None = None,
               extra_taps: Iterable[str] = ()) -> tuple[torch.Tensor, int]:
    """``((layers, T, D) float64, n)``: the mean of ``block{i}.heads`` per token position over the first
    ``n_images`` images (``first_images(n)`` yields their batches), on the model as it is (clean: run it before
    any ablation hook). ``extra(feats, batch)`` sees each batch's taps too (``extra_taps`` captured beside)."""
    from vitscope.capture.engine import Capture

    layers = list(layers)
    taps = [f"block{i}.heads" for i in layers]
    total: torch.Tensor | None = None
    n = 0
    with Capture(vm, list(dict.fromkeys([*taps, *extra_taps]))) as cap:
        for b in first_images(n_images):
            feats = cap(b.images)
            if extra is not None:
                extra(feats, b)
            if not taps:
                n += len(b.images)
                continue
            x = torch.stack([feats[t].double().sum(0) for t in taps]).cpu()  # (L, T, D)
            if total is not None and x.shape != total.shape:
                raise VitscopeError(f"{who}: mode 'mean' needs one token grid, but the images of its statistics "
                                    f"pass have {total.shape[1]} and {x.shape[1]} tokens (whole frames of different "
                                    "sizes): give the dataset one image size")
            total = x if total is None else total + x
            n += len(b.images)
    if not n:
        raise VitscopeError(f"{who}: no image to compute the statistics over")
    return (total / n if total is not None else torch.zeros(0, dtype=torch.float64)), n


def replace_heads(h: torch.Tensor, num_heads: int, heads: Iterable[int] | None, mean: torch.Tensor | None) -> None:
    """In place: the slices of ``heads`` (None: every head) of ``h`` (``(..., T, D)``, heads concatenated along D)
    set to 0 (``mean`` None) or to ``mean`` (``(T, D)``, broadcast over the leading dimensions)."""
    view = h.view(*h.shape[:-1], num_heads, h.shape[-1] // num_heads)
    fill: Any = 0.0 if mean is None else mean.to(h.device, h.dtype).view(h.shape[-2], num_heads, -1)
    if heads is None:
        view[...] = fill
        return
    for g in heads:
        view[..., g, :] = fill if mean is None else fill[:, g]


# ---------------------------------------------------------------- the variant


@dataclass
class Ablation:
    """The hooks of one ablated variant on a loaded model: ``heads`` {block: [head, ...]} resolved, ``means``
    {block: (T, D)} for mode mean, ``meta`` what the manifest records."""

    spec: AblationSpec
    heads: dict[int, list[int]]
    means: dict[int, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def install(self, vm: Any) -> Ablation:
        H = vm.num_heads
        for i, heads in self.heads.items():
            mean = self.means.get(i)
            every = None if len(heads) == H else heads

            def hook(module: Any, args: tuple, every: Any = every, mean: Any = mean, i: int = i) -> tuple:
                h = args[0].clone()
                if mean is not None and mean.shape[0] != h.shape[-2]:
                    raise VitscopeError(f"{vm.name}: the heads' means (mode mean) cover {mean.shape[0]} tokens, but "
                                        f"this batch has {h.shape[-2]} in block {i} (images of another size than "
                                        "the statistics pass's): give the datasets one image size, or mode zero")
                replace_heads(h, H, every, mean)
                return (h, *args[1:])

            self.handles.append(vm.model.blocks[i].attn.proj.register_forward_pre_hook(hook))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def resolve(vm: Any, spec: AblationSpec, first_images: Callable[[int], Iterable[Any]] | None,
            who: str) -> Ablation:
    """The heads ``spec`` ablates on ``vm`` and, where needed, their means: one statistics pass over the first
    ``spec.images`` images (`head_means`, with the AAAM of ``aligned_attention_maps`` when ``heads`` is a type).
    Not installed yet (`Ablation.install`)."""
    check_bounds(spec, vm.depth, vm.num_heads, who)
    layers = list(spec.layers) if spec.layers is not None else list(range(vm.depth))
    H = vm.num_heads
    chosen: dict[int, list[int]] = {}
    types: dict[tuple[int, int], str] = {}
    meta: dict[str, Any] = {"spec": spec.as_dict()}
    if spec.heads == "all":
        chosen = {i: list(range(H)) for i in layers}
    elif _pairs(spec):
        for i, h in spec.heads:
            chosen.setdefault(i, []).append(h)
    elif spec.head_type is None:
        chosen = {i: list(spec.heads) for i in layers}
    means: dict[int, torch.Tensor] = {}
    if spec.needs_statistics:
        if first_images is None:
            raise VitscopeError(f"{who}: the ablation needs a statistics pass over the first images of a dataset")
        aam = None
        if spec.head_type is not None:
            from vitscope.analyses.attention import AlignedAttentionMaps

            aam = AlignedAttentionMaps(vm, layers=layers)
        mean_layers = layers if spec.head_type is not None else sorted(chosen)
        total, n = head_means(vm, mean_layers if spec.mode == "mean" else [], first_images, spec.images, who,
                              extra=None if aam is None else aam.update,
                              extra_taps=() if aam is None else aam.required_taps())
        meta["statistics_images"] = n
        if aam is not None:
            types = head_types_of(aam)
            wanted = LOCAL_TYPES if spec.head_type == "local" else (spec.head_type,)
            for (i, h), t in sorted(types.items()):
                if t in wanted:
                    chosen.setdefault(i, []).append(h)
            meta["head_types"] = {f"{i}.{h}": t for (i, h), t in sorted(types.items())}
        if spec.mode == "mean":
            means = {i: total[mean_layers.index(i)] for i in chosen}
    chosen = {i: sorted(hs) for i, hs in sorted(chosen.items()) if hs}
    meta["heads"] = [[i, h] for i, hs in chosen.items() for h in hs]
    return Ablation(spec, chosen, means, meta)


def head_types_of(aam: Any) -> dict[tuple[int, int], str]:
    """{(layer, head): type} from an ``aligned_attention_maps`` state, by its rule (default thresholds)."""
    from vitscope.metrics import attention as A

    aaam = aam.aaam()
    dist = aam.distance / max(aam.n_images, 1)
    return {(i, int(t["head"])): str(t["type"]) for j, i in enumerate(aam.layers)
            for t in A.head_types(aaam[j], distance=dist[j], thresholds=aam.thresholds)}
