"""Head and MLP ablation as write-hooks: an ablated model variant is the same weights with a forward pre-hook on
each ablated block's attention output projection (``attn.proj``, whose input is the ``block{i}.heads`` tap: the
heads' outputs concatenated) that replaces the chosen heads' slices by 0 (``zero``) or by their mean over images
at the same token position (``mean``), and/or a forward hook on each ablated block's MLP output (``mlp.fc2``, the
``block{i}.fc2`` tap, before layer scale ``ls2``; ViT, BEiT and timm's Eva alike) that replaces it the same way:
Park et al.'s "self-attention matters in CL, MLPs in MIM" as a variant every analysis re-measures. The hook sits
on ``fc2`` rather than on the ``mlp`` module so that the ``block{i}.fc2`` tap of the variant reads the ablated
output, as ``block{i}.heads`` does for heads (``fc2`` is the MLP's last layer: its output is the MLP's, dropout
aside). Nothing is written to the weights; `Ablation.remove` takes the hooks off.

A study names a variant with ``ablate:`` on a model entry (`parse_spec`, docs/CONFIG.md)::

    {name: zoo-dino, ablate: {heads: local, mode: mean}}        # a head type, resolved per model
    {name: zoo-dino, ablate: {heads: [[3, 0], [3, 2]]}}         # (layer, head) pairs
    {name: zoo-dino, ablate: {layers: [2, 3], heads: all}}      # every head of blocks 2 and 3
    {name: zoo-dino, ablate: {layers: [3], heads: [0, 2]}}      # heads 0 and 2 of block 3
    {name: zoo-mae, ablate: {mlp: [2, 3], mode: zero}}          # the MLPs of blocks 2 and 3
    {name: zoo-mae, ablate: {mlp: all, mode: mean}}             # every block's MLP, by its mean
    {name: zoo-mae, ablate: {heads: all, layers: [0], mlp: [0]}}  # block 0's heads and MLP together

Head types (`resolve`): the rule of ``aligned_attention_maps`` (`vitscope.metrics.attention.head_types`, default
thresholds, with the mean attention distance) on the AAAM of the first ``images`` images of the statistics
dataset (``dataset``, default the study's first dataset; the first of its selection, in order, clean). ``local``
is every local type (strict_local, soft_local, axial, offset_local); any single type may be named too. The mean
(``mode: mean``) is the one `HeadAblation` uses (`head_means`): per token position, over the same first
``images`` images, of the CLEAN model's heads; an MLP's mean is the same average of the clean model's
``block{i}.fc2`` (`tap_means`). All come from one statistics pass, run when the variant is loaded (again on a
resume: the same images give the same result). ``mode`` applies to heads and MLPs alike; ``layers`` picks the
blocks of ``heads`` only (``mlp`` names its own blocks).

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
KEYS = ("heads", "layers", "mlp", "mode", "images", "dataset")


def head_type_names() -> tuple[str, ...]:
    from vitscope.analyses.attention import HEAD_TYPES

    return ("local", *HEAD_TYPES)


@dataclass(frozen=True)
class AblationSpec:
    """A parsed ``ablate:`` entry. ``heads``: "all", a head type (`head_type_names`), a tuple of heads (with
    ``layers``) or of (layer, head) pairs, or None (no head ablated); ``layers``: the blocks of ``heads`` (None:
    every block, or those of the pairs); ``mlp``: None, "all" or a tuple of the blocks whose MLP is ablated."""

    heads: Any = None
    layers: tuple[int, ...] | None = None
    mode: str = "zero"
    images: int = 500
    dataset: str | None = None
    mlp: Any = None

    @property
    def head_type(self) -> str | None:
        return self.heads if isinstance(self.heads, str) and self.heads != "all" else None

    @property
    def needs_statistics(self) -> bool:
        return self.mode == "mean" or self.head_type is not None

    def as_dict(self) -> dict[str, Any]:
        """The canonical form (the cache key's): ``mlp`` only when given, so a heads-only spec keeps its key."""
        heads = self.heads if self.heads is None or isinstance(self.heads, str) else [
            list(h) if isinstance(h, tuple) else h for h in self.heads]
        out = {"heads": heads, "layers": None if self.layers is None else list(self.layers), "mode": self.mode,
               "images": self.images if self.needs_statistics else None, "dataset": self.dataset}
        if self.mlp is not None:
            out["mlp"] = self.mlp if isinstance(self.mlp, str) else list(self.mlp)
        return out

    def describe(self) -> str:
        """``local heads (mean)``, ``heads 3.0, 3.2 (zero)``, ``all heads of blocks 2, 3 (zero)``, ``MLPs of blocks
        2, 3 (zero)``, ``heads 0.1 + MLP of block 0 (mean)``."""
        parts = ([] if self.heads is None else [self._heads_text()]) + ([] if self.mlp is None else [self._mlp_text()])
        return f"{' + '.join(parts)} ({self.mode})"

    def _mlp_text(self) -> str:
        if self.mlp == "all":
            return "MLPs of every block"
        return f"MLP{'s' if len(self.mlp) > 1 else ''} of block{'s' if len(self.mlp) > 1 else ''} " + ", ".join(
            str(i) for i in self.mlp)

    def _heads_text(self) -> str:
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
        return what


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
                          f"{{layers: [2], heads: all}}, {{mlp: [2, 3]}}); got {raw!r}")
    for k in raw:
        if k not in KEYS:
            hint = close_matches(str(k), KEYS, n=1)
            raise ConfigError(f"{where}: unknown key {str(k)!r}; "
                              + (f"did you mean {hint[0]!r}?" if hint else f"the keys are {', '.join(KEYS)}"))
    if "heads" not in raw and "mlp" not in raw:
        raise ConfigError(f"{where} needs `heads` (all, a head type ({', '.join(head_type_names())}), a list of "
                          "[layer, head] pairs, or a list of heads with `layers`) or `mlp` (all or a list of blocks)")
    mode = check_choice(raw.get("mode", "zero"), MODES, where, "mode", "zero or mean")
    images = raw.get("images", 500)
    if isinstance(images, bool) or not isinstance(images, int) or images < 1:
        raise ConfigError(f"{where}.images must be a whole number of images, 1 or more; got {images!r}")
    dataset = raw.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise ConfigError(f"{where}.dataset must name one of the study's datasets; got {dataset!r}")
    layers = None if raw.get("layers") is None else _ints(list(raw["layers"]), where, "layers")
    mlp = _parse_mlp(raw["mlp"], where) if "mlp" in raw else None
    if "heads" not in raw:
        if layers is not None:
            raise ConfigError(f"{where}: `layers` picks the blocks of `heads`, and no `heads` is given; name the "
                              "ablated MLPs' blocks in `mlp` instead")
        return AblationSpec(None, None, mode, int(images), dataset, mlp)
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
    return AblationSpec(heads, layers, mode, int(images), dataset, mlp)


def _parse_mlp(value: Any, where: str) -> Any:
    """``mlp:``: "all" or the sorted distinct block numbers; ConfigError in one sentence otherwise."""
    if isinstance(value, str):
        if value != "all":
            raise ConfigError(f"{where}.mlp: {value!r} is not `all`; give `all` or a list of block numbers")
        return value
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}.mlp must be `all` or a non-empty list of block numbers (0 or more); got "
                          f"{value!r}")
    return tuple(sorted(set(_ints(list(value), where, "mlp"))))


def check_bounds(spec: AblationSpec, depth: int, num_heads: int, who: str) -> None:
    """Block and head numbers within the model (depth blocks of num_heads heads): VitscopeError in one sentence."""
    blocks = set(spec.layers or ()) | ({i for i, _ in spec.heads} if _pairs(spec) else set())
    blocks |= set(spec.mlp) if spec.mlp is not None and not isinstance(spec.mlp, str) else set()
    heads = {h for _, h in spec.heads} if _pairs(spec) else (
        set(spec.heads) if spec.heads is not None and not isinstance(spec.heads, str) else set())
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
    taps = [f"block{i}.heads" for i in layers]
    means, n = tap_means(vm, taps, first_images, n_images, who, extra, extra_taps)
    return (torch.stack([means[t] for t in taps]) if taps else torch.zeros(0, dtype=torch.float64)), n


def tap_means(vm: Any, taps: Iterable[str], first_images: Callable[[int], Iterable[Any]], n_images: int,
              who: str, extra: Callable[[Mapping[str, torch.Tensor], Any], None] | None = None,
              extra_taps: Iterable[str] = ()) -> tuple[dict[str, torch.Tensor], int]:
    """``({tap: (T, D) float64}, n)``: each ``(B, T, D)`` tap's mean per token position over the first
    ``n_images`` images, on the model as it is (`head_means`; ``block{i}.fc2`` for an MLP's mean). One pass
    serves heads and MLPs: the statistics of a variant cost one forward per image whatever it ablates."""
    from vitscope.capture.engine import Capture

    taps = list(dict.fromkeys(taps))
    total: dict[str, torch.Tensor] = {}
    n = 0
    with Capture(vm, list(dict.fromkeys([*taps, *extra_taps]))) as cap:
        for b in first_images(n_images):
            feats = cap(b.images)
            if extra is not None:
                extra(feats, b)
            for t in taps:
                x = feats[t].double().sum(0).cpu()  # (T, D)
                if t in total and x.shape != total[t].shape:
                    raise VitscopeError(f"{who}: mode 'mean' needs one token grid, but the images of its statistics "
                                        f"pass have {total[t].shape[0]} and {x.shape[0]} tokens (whole frames of "
                                        "different sizes): give the dataset one image size")
                total[t] = x if t not in total else total[t] + x
            n += len(b.images)
    if not n:
        raise VitscopeError(f"{who}: no image to compute the statistics over")
    return {t: v / n for t, v in total.items()}, n


def mlp_output(blk: Any) -> Any:
    """The module whose output is block ``blk``'s MLP output before layer scale: ``mlp.fc2`` (the ``block{i}.fc2``
    tap's module, the MLP's last layer in timm's Mlp, GluMlp and SwiGLU), else the ``mlp`` module itself."""
    fc2 = getattr(blk.mlp, "fc2", None)
    return blk.mlp if fc2 is None else fc2


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
    {block: (T, D)} for mode mean, ``meta`` what the manifest records; ``mlp`` the blocks whose MLP output is
    replaced, ``mlp_means`` {block: (T, D)} their means for mode mean."""

    spec: AblationSpec
    heads: dict[int, list[int]]
    means: dict[int, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    mlp: list[int] = field(default_factory=list)
    mlp_means: dict[int, torch.Tensor] = field(default_factory=dict)

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
        for i in self.mlp:
            self.handles.append(mlp_output(vm.model.blocks[i]).register_forward_hook(
                self._mlp_hook(vm.name, i, self.mlp_means.get(i))))
        return self

    @staticmethod
    def _mlp_hook(name: str, i: int, mean: torch.Tensor | None) -> Callable[..., torch.Tensor]:
        """The forward hook of block ``i``'s MLP output: zeros (``mean`` None) or ``mean`` (T, D) per image."""

        def hook(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if mean is None:
                return torch.zeros_like(out)
            if mean.shape[0] != out.shape[-2]:
                raise VitscopeError(f"{name}: the MLP's mean (mode mean) covers {mean.shape[0]} tokens, but this "
                                    f"batch has {out.shape[-2]} in block {i} (images of another size than the "
                                    "statistics pass's): give the datasets one image size, or mode zero")
            return mean.to(out.device, out.dtype).expand(out.shape).contiguous()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def resolve(vm: Any, spec: AblationSpec, first_images: Callable[[int], Iterable[Any]] | None,
            who: str) -> Ablation:
    """The heads and MLPs ``spec`` ablates on ``vm`` and, where needed, their means: one statistics pass over the
    first ``spec.images`` images (`tap_means`, with the AAAM of ``aligned_attention_maps`` when ``heads`` is a
    type). Not installed yet (`Ablation.install`)."""
    check_bounds(spec, vm.depth, vm.num_heads, who)
    layers = list(spec.layers) if spec.layers is not None else list(range(vm.depth))
    H = vm.num_heads
    chosen: dict[int, list[int]] = {}
    types: dict[tuple[int, int], str] = {}
    meta: dict[str, Any] = {"spec": spec.as_dict()}
    mlp = [] if spec.mlp is None else list(range(vm.depth)) if spec.mlp == "all" else list(spec.mlp)
    if spec.heads is None:
        layers = []
    elif spec.heads == "all":
        chosen = {i: list(range(H)) for i in layers}
    elif _pairs(spec):
        for i, h in spec.heads:
            chosen.setdefault(i, []).append(h)
    elif spec.head_type is None:
        chosen = {i: list(spec.heads) for i in layers}
    means: dict[int, torch.Tensor] = {}
    mlp_means: dict[int, torch.Tensor] = {}
    if spec.needs_statistics:
        if first_images is None:
            raise VitscopeError(f"{who}: the ablation needs a statistics pass over the first images of a dataset")
        aam = None
        if spec.head_type is not None:
            from vitscope.analyses.attention import AlignedAttentionMaps

            aam = AlignedAttentionMaps(vm, layers=layers)
        mean_layers = layers if spec.head_type is not None else sorted(chosen)
        taps = [*(f"block{i}.heads" for i in mean_layers), *(f"block{i}.fc2" for i in mlp)]
        total, n = tap_means(vm, taps if spec.mode == "mean" else [], first_images, spec.images, who,
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
            means = {i: total[f"block{i}.heads"] for i in chosen}
            mlp_means = {i: total[f"block{i}.fc2"] for i in mlp}
    chosen = {i: sorted(hs) for i, hs in sorted(chosen.items()) if hs}
    meta["heads"] = [[i, h] for i, hs in chosen.items() for h in hs]
    if spec.mlp is not None:
        meta["mlp"] = mlp
    return Ablation(spec, chosen, means, meta, mlp=mlp, mlp_means=mlp_means)


def head_types_of(aam: Any) -> dict[tuple[int, int], str]:
    """{(layer, head): type} from an ``aligned_attention_maps`` state, by its rule (default thresholds)."""
    from vitscope.metrics import attention as A

    aaam = aam.aaam()
    dist = aam.distance / max(aam.n_images, 1)
    return {(i, int(t["head"])): str(t["type"]) for j, i in enumerate(aam.layers)
            for t in A.head_types(aaam[j], distance=dist[j], thresholds=aam.thresholds)}
