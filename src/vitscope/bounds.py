"""Declared ranges of numeric parameters, checked before any model loads.

A range is declared once, beside the parameter: an analysis annotates its ``__init__`` argument
(``k: Count = 32``, ``ks: Sequence[Count]``, ``rms: Annotated[float, Range(0, open_lo=True)]``) and
`vitscope.analyses.base.validate_params` reads the annotation; a dataset format declares its options' ranges
in `vitscope.data.catalog` (``OPTION_RANGES``). A value outside its range is one `ConfigError` sentence naming
the parameter, the range and the value (``k = 0`` would otherwise write a ``knn0_top1`` row with a number).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from vitscope.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """``lo <= value <= hi`` (``lo < value`` with ``open_lo``); ``None`` leaves a side open. ``why`` is said
    after the range when the value is outside it."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    why: str = ""
    or_zero: bool = False  # 0 is accepted too (a count where 0 turns something off)

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):  # nan, inf: no parameter means anything at infinity
            return False
        if self.or_zero and value == 0:
            return True
        if self.lo is not None and (value <= self.lo if self.open_lo else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        def num(x: float) -> str:
            return f"{x:g}" if isinstance(x, float) else str(x)

        if self.or_zero:
            return f"0 or {Range(self.lo, self.hi, self.open_lo).describe()}"
        if self.lo is not None and self.hi is not None and not self.open_lo:
            return f"between {num(self.lo)} and {num(self.hi)}"
        parts = []
        if self.lo is not None:
            parts.append(("greater than " if self.open_lo else "at least ") + num(self.lo))
        if self.hi is not None:
            parts.append(f"at most {num(self.hi)}")
        return " and ".join(parts)

    def short(self) -> str:
        """``>= 1``, ``> 0``, ``1..5``: the range in a listing of parameters."""
        def num(x: float) -> str:
            return f"{x:g}" if isinstance(x, float) else str(x)

        if self.or_zero:
            return f"0 or {Range(self.lo, self.hi, self.open_lo).short()}"
        if self.lo is not None and self.hi is not None and not self.open_lo:
            return f"{num(self.lo)}..{num(self.hi)}"
        parts = [f"{'>' if self.open_lo else '>='} {num(self.lo)}"] if self.lo is not None else []
        return ", ".join(parts + ([f"<= {num(self.hi)}"] if self.hi is not None else []))

    def check(self, value: Any, what: str) -> None:
        """One ConfigError sentence when the number ``value`` of ``what`` is outside the range (non-numbers
        are the type check's business)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return
        if not self.holds(value):
            rule = self.describe() if math.isfinite(value) else f"a finite number {self.describe()}"
            raise ConfigError(f"{what} must be {rule}" + (f" ({self.why})" if self.why else "") + f"; got {value!r}")


def AtLeast(lo: float, why: str = "") -> Range:  # noqa: N802 - reads as a type in annotations
    return Range(lo, why=why)


# -- what a machine can be asked for: stated limits, refused before anything is allocated --------------------

#: pixels on an image side: generated images, whole frames, a model's input (4096 px at patch 16 is 65,536
#: tokens, whose attention matrix alone is 17 GB per head and image in float32)
MAX_IMAGE_SIDE = 4096
#: images of a generated data set (its items are drawn on the fly; their parameters are kept per item)
MAX_GENERATED_IMAGES = 1_000_000
#: blocks and channels of a model built from a config (timm arguments, a transformers config.json)
MAX_DEPTH, MAX_WIDTH = 256, 16384

#: the ranges of the architecture arguments a config may give (timm kwargs, or read off a transformers
#: config.json): sizes no machine holds are one sentence before timm allocates the model
ARCH_RANGES = {"img_size": Range(1, MAX_IMAGE_SIDE), "patch_size": Range(1, MAX_IMAGE_SIDE),
               "depth": Range(1, MAX_DEPTH), "embed_dim": Range(1, MAX_WIDTH), "num_heads": Range(1, MAX_WIDTH),
               "mlp_ratio": Range(0, 64, open_lo=True)}


def check_arch(kwargs: Mapping[str, Any], who: str) -> None:
    """Every architecture argument of ``kwargs`` within `ARCH_RANGES` (``img_size`` also as a pair): one
    ConfigError sentence naming ``who`` and the argument otherwise (`vitscope.models.load` builds no model
    outside them; a study config is checked before torch is imported)."""
    for key, r in ARCH_RANGES.items():
        value = kwargs.get(key)
        for v in value if isinstance(value, list | tuple) else [value]:
            if v is not None:
                r.check(v, f"{who}: {key}")


#: iterations of an optimisation (probe, t-SNE, inversion) and restarts of k-means: beyond these a run takes
#: hours for no change in its numbers
MAX_ITERATIONS, MAX_RESTARTS = 100_000, 1000
#: iterations of an optimisation
Iterations = Annotated[int, Range(1, MAX_ITERATIONS, why="beyond that a run takes hours")]
#: restarts of k-means
Restarts = Annotated[int, Range(1, MAX_RESTARTS, why="beyond that a run takes hours")]

#: a count of things: 1 or more
Count = Annotated[int, Range(1)]
#: 0 or more
NonNegative = Annotated[int, Range(0)]
#: a number greater than 0
Positive = Annotated[float, Range(0, open_lo=True)]
#: a share: 0 to 1
Fraction = Annotated[float, Range(0, 1)]


def ranges_of(tp: Any) -> list[Range]:
    """The ranges an ``Annotated[...]`` annotation declares (none for any other)."""
    if typing.get_origin(tp) is Annotated:
        return [m for m in tp.__metadata__ if isinstance(m, Range)]
    return []


def annotation_text(tp: Any) -> str | None:
    """``int >= 1``, ``Sequence[int 1..5] | None``: an annotation that declares a range, written out for a
    listing of parameters (`vitscope analyses`); None for one that declares none."""
    if not _has_range(tp):
        return None

    def text(t: Any) -> str:
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is Annotated:
            return " ".join([text(args[0]), *(r.short() for r in ranges_of(t))])
        if origin in (typing.Union, types.UnionType):
            return " | ".join(text(a) for a in args)
        if t is type(None):
            return "None"
        if origin is not None:
            return f"{getattr(origin, '__name__', str(origin))}[{', '.join(text(a) for a in args)}]"
        return getattr(t, "__name__", str(t))

    return text(tp)


def _has_range(tp: Any) -> bool:
    return bool(ranges_of(tp)) or any(_has_range(a) for a in typing.get_args(tp) if not isinstance(a, Range))


def check_annotated(value: Any, tp: Any, what: str) -> None:
    """Every range ``tp`` declares for ``value``, through ``X | None``, sequences and mappings (their values):
    one ConfigError sentence naming ``what`` (and the item) at the first value outside its range."""
    if typing.get_origin(tp) is Annotated:
        for r in ranges_of(tp):
            r.check(value, what)
        tp = typing.get_args(tp)[0]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is not type(None) and value is not None and _plausible(value, a):
                check_annotated(value, a, what)
        return
    if origin in (Sequence, list, tuple) and isinstance(value, list | tuple) and args:
        for v in value:
            check_annotated(v, args[0], f"every item of {what}")
    elif origin in (Mapping, dict) and isinstance(value, Mapping) and len(args) == 2:
        for k, v in value.items():
            check_annotated(v, args[1], f"{what}.{k}")


def _plausible(value: Any, tp: Any) -> bool:
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp
    origin = typing.get_origin(base) or base
    if origin in (int, float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin in (Sequence, list, tuple):
        return isinstance(value, list | tuple)
    if origin in (Mapping, dict):
        return isinstance(value, Mapping)
    return False


# -- the type of a value: checked against the annotation, or against its spec in the shipped snapshot ----------

def _union_args(tp: Any) -> tuple[Any, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else None


def conforms(value: Any, tp: Any) -> bool:
    """``value`` of the type ``tp`` (as a study config gives it: ints for ``int``, numbers for ``float``, lists
    for ``Sequence[...]``; ``Any``, an unannotated parameter and what cannot be judged are not checked)."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    if typing.get_origin(tp) is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    alts = _union_args(tp)
    if alts is not None:
        return any(conforms(value, a) for a in alts)
    if tp is None or tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if origin in (Sequence, list, tuple):
        item = args[0] if args else Any
        return isinstance(value, list | tuple) and all(conforms(v, item) for v in value)
    if origin in (Mapping, dict):
        k, v = args if len(args) == 2 else (Any, Any)
        return isinstance(value, Mapping) and all(conforms(a, k) and conforms(b, v) for a, b in value.items())
    try:
        return isinstance(value, origin)
    except TypeError:
        return True


def describe(tp: Any) -> str:
    """``an integer``, ``a list of strings or null``: what ``tp`` takes, in a sentence."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    alts = _union_args(tp)
    if alts is not None:
        return " or ".join(describe(a) for a in alts)
    if tp is None or tp is type(None):
        return "null"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Any: "anything"}
    if tp in names:
        return names[tp]
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if origin in (Sequence, list, tuple):
        inner = describe(args[0]) if args else "anything"
        return "a list" + ("" if inner == "anything" else f" of {inner.removeprefix('an ').removeprefix('a ')}s")
    if origin in (Mapping, dict):
        if len(args) == 2 and Any not in args:
            k, v = (describe(a).removeprefix("an ").removeprefix("a ") for a in args)
            return f"a mapping of {k}s to {v}s"
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any, what: str) -> None:
    """``value`` of the type ``tp`` and within every range it declares, else one ConfigError sentence naming
    ``what`` (`vitscope.analyses.base.validate_params`; `vitscope run` checks the snapshot's specs before torch)."""
    if not conforms(value, tp):
        raise ConfigError(f"{what} must be {describe(tp)}, got {value!r} ({type(value).__name__})")
    check_annotated(value, tp, what)


class _Unchecked(Exception):
    """An annotation (or a part of one) that a spec cannot say: a class, a callable, a forward reference."""


_PLAIN = {bool: "bool", int: "int", float: "float", str: "str"}
_JSON_SCALARS = (type(None), bool, int, float, str)


def to_spec(tp: Any) -> Any:
    """``tp`` as a JSON-able spec that `from_spec` turns back into an annotation checking values as ``tp`` does:
    ``"any"`` (not checked), ``"null"``, ``"bool"``, ``"int"``, ``"float"``, ``"str"``, ``{"literal": [...]}``,
    ``{"union": [...]}``, ``{"list": item}``, ``{"mapping": [key, value]}`` and ``{"annotated": spec, "ranges":
    [Range fields]}``. An annotation that has a part no spec says (a class, a callable, a forward reference) is
    ``"any"`` as a whole, so what is checked is checked with the sentence the annotation itself gives."""
    try:
        return _spec(tp)
    except _Unchecked:
        return "any"


def _spec(tp: Any) -> Any:
    if tp is Any or tp is inspect.Parameter.empty:
        return "any"
    if tp is None or tp is type(None):
        return "null"
    if isinstance(tp, type) and tp in _PLAIN:
        return _PLAIN[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        ranges = [{f.name: _scalar(getattr(r, f.name)) for f in dataclasses.fields(Range)} for r in ranges_of(tp)]
        return {"annotated": _spec(args[0]), "ranges": ranges} if ranges else _spec(args[0])
    if origin is Literal:
        return {"literal": [_scalar(a) for a in args]}
    if origin in (typing.Union, types.UnionType):
        return {"union": [_spec(a) for a in args]}
    origin = origin or tp
    if origin in (Sequence, list, tuple):
        return {"list": _spec(args[0]) if args else "any"}
    if origin in (Mapping, dict):
        k, v = args if len(args) == 2 else (Any, Any)
        return {"mapping": [_spec(k), _spec(v)]}
    raise _Unchecked(tp)


def _scalar(x: Any) -> Any:
    if type(x) not in _JSON_SCALARS:
        raise _Unchecked(x)
    return x


def from_spec(spec: Any) -> Any:
    """The annotation a `to_spec` spec stands for (``Any`` for ``"any"``, ``None`` or what it does not know)."""
    if isinstance(spec, str):
        return {"any": Any, "null": type(None), "bool": bool, "int": int, "float": float, "str": str}.get(spec, Any)
    if not isinstance(spec, Mapping):
        return Any
    if "annotated" in spec:
        ranges = tuple(Range(**r) for r in spec.get("ranges", ()))
        base = from_spec(spec["annotated"])
        return Annotated[(base, *ranges)] if ranges else base
    if "literal" in spec:
        return Literal[tuple(spec["literal"])]
    if "union" in spec:
        return typing.Union[tuple(from_spec(s) for s in spec["union"])]  # noqa: UP007 - built from a list
    if "list" in spec:
        return Sequence[from_spec(spec["list"])]
    if "mapping" in spec:
        k, v = spec["mapping"]
        return Mapping[from_spec(k), from_spec(v)]
    return Any
