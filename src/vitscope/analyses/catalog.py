"""What each registered analysis is, read off the code: its parameters (names, types and defaults from
the signature of its class), the taps it captures with its defaults, what the data must carry, and its
sources (`vitscope.references`). `vitscope analyses` prints it; docs/analyses.md is generated from it
(`vitscope analyses --markdown`), and a test keeps that file current."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

from vitscope.analyses.base import ANALYSES, Analysis, analysis_parameters
from vitscope.bounds import annotation_text
from vitscope.models.adapter import ModelInfo
from vitscope.references import ANALYSIS_REFERENCES, REFERENCES, SEEDS, short_citation

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
CONVENTION_NOTES = {
    "layers": "block indices, negative from the end; None or 'all' = every block",
    "taps": "tap names or patterns such as 'block*.out' (`vitscope taps MODEL`)",
    "views": "token views: cls, gap, gap_spatial, spatial, all",
}


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: Any

    def default_text(self) -> str:
        d = self.default
        if isinstance(d, tuple):
            d = list(d)
        return "required" if d is inspect.Parameter.empty else repr(d)


@dataclass(frozen=True)
class AnalysisInfo:
    name: str
    description: str
    doc: str
    module: str
    params: tuple[Param, ...]
    taps: str
    data: str
    references: tuple[str, ...]  # keys of vitscope.references.REFERENCES

    @property
    def full_references(self) -> list[str]:
        return [REFERENCES[k] for k in self.references]


def _type_text(p: inspect.Parameter) -> str:
    ann = p.annotation
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
        out.append(Param(p.name, ranged or _type_text(p), p.default))
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
                        data=_data_text(cls), references=tuple(ANALYSIS_REFERENCES.get(name, ())))


def describe_all() -> list[AnalysisInfo]:
    return [describe(n) for n in ANALYSES]


def format_text(infos: list[AnalysisInfo], full: bool = False) -> str:
    """The listing `vitscope analyses` prints: per analysis its line, parameters, taps, data, sources."""
    lines: list[str] = []
    for a in infos:
        lines.append(f"{a.name}: {a.description}")
        if full and a.doc:
            lines += ["", *("    " + x if x else "" for x in a.doc.splitlines()), ""]
        if a.params:
            w = max(len(p.name) for p in a.params)
            lines.append(f"  parameters (analyses.{a.name}.NAME=VALUE):")
            for p in a.params:
                lines.append(f"    {p.name:<{w}}  {p.type} = {p.default_text()}")
        else:
            lines.append("  parameters: none")
        lines.append(f"  taps:  {a.taps}  (a 12-block ViT, default parameters)")
        lines.append(f"  data:  {a.data}")
        for i, ref in enumerate(a.full_references):
            lines.append(f"  {'source:' if i == 0 else '       '} {ref}")
        lines.append("")
    if not full:
        lines.append(f"{len(infos)} analyses. Set parameters in a study config under `analyses:` or as overrides, "
                     "e.g. `vitscope run analyses.tsne.n_images=8`; `vitscope analyses NAME` prints one in full.")
    return "\n".join(lines).rstrip() + "\n"


def format_markdown(infos: list[AnalysisInfo]) -> str:
    """docs/analyses.md: the same information as a reference page."""
    out = ["# Analyses", "",
           "Generated by `vitscope analyses --markdown` from the code (`vitscope/analyses/catalog.py`); "
           "a test fails when this file is out of date. Parameters go under `analyses: NAME: {...}` in a study "
           "config or on the command line (`vitscope run analyses.cka.views=[gap]`). Taps are listed for a "
           "12-block ViT with the default parameters.", "",
           "Conventions: " + "; ".join(f"`{k}`: {v}" for k, v in CONVENTION_NOTES.items()) + ".", "",
           "| analysis | what | sources |", "|---|---|---|"]
    for a in infos:
        cites = ", ".join(short_citation(k) for k in a.references) or "-"
        out.append(f"| [`{a.name}`](#{a.name}) | {a.description} | {cites} |")
    for a in infos:
        out += ["", f"## {a.name}", "", _markdown_doc(a.doc) if a.doc else a.description, ""]
        out += ["| parameter | type | default |", "|---|---|---|"]
        out += [f"| `{p.name}` | `{p.type.replace('|', chr(92) + '|')}` | `{p.default_text()}` |" for p in a.params]
        out += ["", f"- taps: `{a.taps}`", f"- data: {a.data}", f"- code: `{a.module}`"]
        out += [f"- source: {r}" for r in a.full_references]
    used = sorted({k for a in infos for k in a.references}, key=lambda k: short_citation(k))
    seed_of = {k: s for s, k in SEEDS.items()}
    out += ["", "## References", "",
            "The project's five source documents (seed 000-004) are marked.", ""]
    out += [f"- **{short_citation(k)}**{f' (seed {seed_of[k]})' if k in seed_of else ''}: {REFERENCES[k]}"
            for k in used]
    return "\n".join(out) + "\n"


def _markdown_doc(doc: str) -> str:
    """A docstring as markdown: each paragraph on one line, except lists (kept) and aligned blocks (fenced)."""
    paras = []
    for para in doc.split("\n\n"):
        lines = para.splitlines()
        if lines[0].startswith(("* ", "- ")):
            paras.append(para)
        elif any(x.startswith(" ") for x in lines[1:]):
            paras.append("```text\n" + para + "\n```")
        else:
            paras.append(" ".join(x.strip() for x in lines))
    return "\n\n".join(paras)
