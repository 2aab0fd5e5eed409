"""What each registered analysis is, read off the code: its parameters (names, types and defaults from
the signature of its class), the taps it captures with its defaults, what the data must carry, and its
sources (`vitscope.references`). docs/analyses.md and the snapshot `vitscope analyses` prints without importing
torch (`vitscope/analyses_listing.json`: ``python -m vitscope.analyses.catalog > src/vitscope/analyses_listing.json``)
are generated from it, and tests keep both current."""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any

from vitscope.analyses.base import ANALYSES, Analysis, analysis_parameters
from vitscope.analyses_listing import AnalysisInfo, Param, format_markdown, format_text, to_json  # noqa: F401
from vitscope.bounds import annotation_text, to_spec
from vitscope.models.adapter import ModelInfo
from vitscope.references import ANALYSIS_REFERENCES

#: the model the tap lists are shown for (ViT-B/16 at 224 px: 12 blocks, 14 x 14 grid, a CLS token)
EXAMPLE_MODEL = ModelInfo("example", depth=12, num_heads=12, embed_dim=768, grid_size=(14, 14), patch_size=16,
                          num_prefix_tokens=1, has_cls_token=True)

#: parameter names with one meaning across analyses (their annotations say ``Any``)
CONVENTIONS = {
    "layers": "int | list[int] | 'all' | None",
    "taps": "str | list[str]",
    "views": "str | list[str]",
    "queries": "str | list[str]",
    "kmeans": "list[str] | bool",
    "probe": "list[str] | bool",
}


def _type_text(p: inspect.Parameter) -> str:
    ann = p.annotation
    if typing.get_origin(ann) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(ann))
    if isinstance(ann, str) and ann not in ("Any", ""):
        return ann
    if ann is not inspect.Parameter.empty and not isinstance(ann, str) and ann is not Any:
        return getattr(ann, "__name__", str(ann))
    if p.name in CONVENTIONS:
        return CONVENTIONS[p.name]
    d = p.default
    if isinstance(d, (tuple, list)):
        kinds = sorted({type(x).__name__ for x in d})
        return f"list[{' | '.join(kinds)}]" if kinds else "list"
    if d is None or d is inspect.Parameter.empty:
        return "any"
    return type(d).__name__


def parameters(cls: type[Analysis]) -> tuple[Param, ...]:
    """The keyword parameters a study config may set (``analyses.NAME.PARAM``), in signature order."""
    sig = inspect.signature(cls.__init__)
    resolved = analysis_parameters(cls)
    skip = 3 if getattr(cls, "pair", False) else 2  # self and the model (a pair analysis: both models)
    out = []
    for i, p in enumerate(sig.parameters.values()):
        if i < skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        ranged = annotation_text(resolved[p.name].annotation) if p.name in resolved else None
        d = list(p.default) if isinstance(p.default, tuple) else p.default
        q = resolved.get(p.name)
        literal = q is not None and typing.get_origin(q.annotation) is typing.Literal  # choices: listed
        out.append(Param(p.name, ranged or _type_text(q if literal else p),
                         "required" if d is inspect.Parameter.empty else repr(d)))
    return tuple(out)


def compress_taps(taps: list[str], depth: int) -> str:
    """'block0.attn, ..., block11.attn' -> 'block*.attn'; a run of blocks -> 'block0-10.out'."""
    kinds: dict[str, list[int]] = {}
    order: list[str] = []
    for t in taps:
        m = re.fullmatch(r"block(\d+)\.(\w+)", t)
        key, idx = (m.group(2), int(m.group(1))) if m else (t, -1)
        if key not in kinds:
            kinds[key] = []
            order.append(key)
        kinds[key].append(idx)
    parts = []
    for key in order:
        idx = sorted(set(kinds[key]))
        if idx == [-1]:
            parts.append(key)
        elif idx == list(range(depth)):
            parts.append(f"block*.{key}")
        elif idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 2:
            parts.append(f"block{idx[0]}-{idx[-1]}.{key}")
        else:
            parts.extend(f"block{i}.{key}" for i in idx)
    return ", ".join(parts)


def _data_text(cls: type[Analysis]) -> str:
    """What its datasets must provide (``needs``, ``inputs``: `vitscope.data.catalog.CAPABILITIES`)."""
    from vitscope.data.catalog import CAPABILITIES

    parts = [f"{c}: {CAPABILITIES.get(c, c)}" for c in sorted(cls.needs)] or ["images only"]
    for slot, caps in getattr(cls, "inputs", {}).items():
        parts.append(f"a '{slot}' dataset ({slot}_dataset=) with {', '.join(sorted(caps))}")
    return "; ".join(parts)


def describe(name: str) -> AnalysisInfo:
    cls = ANALYSES[name]
    doc = inspect.cleandoc(cls.__doc__ or "")
    try:
        if getattr(cls, "pair", False):  # runs both models itself (with gradients), no taps from the pass
            taps = "none from the pass: it runs both models of each pair itself"
        else:
            taps = compress_taps(cls(EXAMPLE_MODEL).required_taps(), EXAMPLE_MODEL.depth)
    except Exception as e:  # an analysis that needs parameters to be built: say so instead of failing
        taps = f"(depends on its parameters: {e})"
    return AnalysisInfo(name=name, description=cls.description or doc.split("\n\n")[0].replace("\n", " "),
                        doc=doc, module=cls.__module__, params=parameters(cls), taps=taps or "none",
                        data=_data_text(cls), references=tuple(ANALYSIS_REFERENCES.get(name, ())),
                        accepts=tuple(analysis_parameters(cls)), replaced=tuple(cls.replaced.items()),
                        checks=checks(cls), needs=tuple(sorted(cls.needs)),
                        inputs=tuple((slot, tuple(sorted(c))) for slot, c in (cls.inputs or {}).items()))


def checks(cls: type[Analysis]) -> tuple[tuple[str, Any], ...]:
    """(parameter, `vitscope.bounds.to_spec` of its annotation) for every parameter whose value is checked:
    what `vitscope run` checks before it imports torch (`vitscope.analyses_listing.check_study_analysis`)."""
    specs = ((name, to_spec(p.annotation)) for name, p in analysis_parameters(cls).items() if name != "**")
    return tuple((name, spec) for name, spec in specs if spec != "any")


def describe_all() -> list[AnalysisInfo]:
    return [describe(n) for n in ANALYSES]


if __name__ == "__main__":  # the snapshot `vitscope analyses` reads (vitscope/analyses_listing.py)
    import sys

    sys.stdout.write(to_json(describe_all()))
