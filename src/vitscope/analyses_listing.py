"""What `vitscope analyses` prints, without torch: each analysis as an `AnalysisInfo` (its parameters, taps,
data and sources), its text and markdown (docs/analyses.md), and the snapshot of the live catalog shipped in
the package (`analyses_listing.json`). The live catalog is read off the analysis classes
(`vitscope.analyses.catalog.describe_all`), which imports torch and every analysis (seconds); the command line
reads the snapshot instead, and a test keeps the snapshot equal to the live catalog
(`python -m vitscope.analyses.catalog > src/vitscope/analyses_listing.json` regenerates it)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitscope import source_figures
from vitscope.bounds import check_value, from_spec
from vitscope.errors import ConfigError, close_matches, unknown_name
from vitscope.references import REFERENCES, SEEDS, short_citation

SNAPSHOT = Path(__file__).with_name("analyses_listing.json")

#: what the parameters of one meaning across analyses take (docs/analyses.md's conventions line)
CONVENTION_NOTES = {
    "layers": "block indices, negative from the end; None or 'all' = every block",
    "taps": "tap names or patterns such as 'block*.out' (`vitscope taps MODEL`)",
    "views": "token views: cls, gap, gap_spatial, spatial, all",
}


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: str  # as the listing shows it: the default's repr, or "required"


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
    #: every parameter name a study config may give it (its own and those it hands on to its parent class),
    #: ``**`` last when it takes any other name too (`vitscope.analyses.base.analysis_parameters`)
    accepts: tuple[str, ...] = ()
    replaced: tuple[tuple[str, str], ...] = ()  # parameters it no longer takes, and the sentence saying why
    #: (parameter, spec of its annotation: `vitscope.bounds.to_spec`) for every parameter of ``accepts`` whose
    #: type or range is checked, so `vitscope run` refuses a bad value before it imports torch
    checks: tuple[tuple[str, Any], ...] = ()
    #: what its main dataset must provide, and its further inputs' (`vitscope.data.catalog.CAPABILITIES`), so
    #: `vitscope run` matches the study's datasets with it (`vitscope.study.slots`) before it imports torch
    needs: tuple[str, ...] = ()
    inputs: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def full_references(self) -> list[str]:
        return [REFERENCES[k] for k in self.references]


def to_json(infos: list[AnalysisInfo]) -> str:
    """The snapshot's text: every analysis in registry order."""
    return json.dumps([dataclasses.asdict(a) for a in infos], indent=1, ensure_ascii=False) + "\n"


def snapshot(names: list[str] | None = None) -> list[AnalysisInfo]:
    """The shipped snapshot's analyses (``names``: only these, in that order; an unknown one is one sentence
    with the close matches)."""
    infos = {}
    for d in json.loads(SNAPSHOT.read_text(encoding="utf-8")):
        d["params"] = tuple(Param(**p) for p in d["params"])
        d["references"] = tuple(d["references"])
        d["accepts"] = tuple(d.get("accepts", ()))
        d["replaced"] = tuple(tuple(r) for r in d.get("replaced", ()))
        d["checks"] = tuple((c[0], c[1]) for c in d.get("checks", ()))
        d["needs"] = tuple(d.get("needs", ()))
        d["inputs"] = tuple((slot, tuple(caps)) for slot, caps in d.get("inputs", ()))
        infos[d["name"]] = AnalysisInfo(**d)
    for name in names or []:
        if name not in infos:
            raise unknown_name("analysis", name, infos)
    return [infos[n] for n in names] if names else list(infos.values())


#: keys the study planner adds to an analysis's parameters itself (which dataset it runs on, also any
#: ``<slot>_dataset``; which models or model pairs), read by the planner (study/plan.py), not by the analysis;
#: study/plan.py's ``PLANNER_KEYS`` is the same tuple
PLANNER_KEYS = ("dataset", "pairs", "models")


def planner_key(key: str) -> bool:
    return key in PLANNER_KEYS or key.endswith("_dataset")


def check_parameter_names(analysis: str, params: Mapping[str, Any], accepts: tuple[str, ...],
                          replaced: Mapping[str, str]) -> None:
    """Every name of ``params`` one that ``analysis`` takes (``accepts``, as `AnalysisInfo.accepts`; the
    planner's keys let through), else one ConfigError sentence with the closest names: the rule of
    `vitscope.analyses.base.validate_params`, which goes on to check the values' types and ranges."""
    open_ended = "**" in accepts
    names = [n for n in accepts if n != "**"]
    for key in params or {}:
        if planner_key(str(key)):
            continue
        if key in replaced and key not in accepts:
            raise ConfigError(f"analysis {analysis!r} no longer takes {key!r}: {replaced[key]}")
        if key not in names and not open_ended:
            hint = close_matches(str(key), names, n=3)
            takes = f"takes {', '.join(names)}" if names else "takes none"
            raise ConfigError(f"analysis {analysis!r} has no parameter {key!r}"
                              + (f"; did you mean {', '.join(hint)}? It {takes}." if hint else f"; it {takes}."))


def _live() -> Any:
    """`vitscope.analyses.base` when this process imported it (its registry then holds every analysis, and those
    a program or a test registered besides); None otherwise."""
    base = sys.modules.get("vitscope.analyses.base")
    return base if base is not None and getattr(base, "ANALYSES", None) else None


def analysis_names() -> list[str]:
    """The analyses a study may name: the live registry where this process imported it, else the snapshot's
    (no torch)."""
    live = _live()
    return list(live.ANALYSES) if live is not None else [a.name for a in snapshot()]


def data_needs(name: str) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(what analysis ``name``'s main dataset must provide, {input: what it must provide}), off the live registry
    where this process imported it, else off the snapshot (no torch)."""
    live = _live()
    if live is not None:
        cls = live.get_analysis(name)
        return tuple(sorted(cls.needs)), {slot: tuple(sorted(c)) for slot, c in (cls.inputs or {}).items()}
    info = snapshot([name])[0]
    return info.needs, dict(info.inputs)


def check_study_analysis(name: str, params: Mapping[str, Any] | None) -> None:
    """``name`` an analysis and ``params`` only names it takes, read off the live registry where this process
    imported it, else off the snapshot, so `vitscope run` refuses a misspelt analysis or parameter before it
    imports torch: one sentence (`unknown_name`, `check_parameter_names`). Off the snapshot the values' types and
    ranges are checked too (its ``checks``, with the sentence of `vitscope.analyses.base.validate_params`, which
    checks them off the live registry when the config is validated in full)."""
    live = _live()
    if live is not None:
        cls = live.get_analysis(name)
        check_parameter_names(name, params or {}, tuple(live.analysis_parameters(cls)), cls.replaced)
        return
    info = snapshot([name])[0]
    check_parameter_names(name, params or {}, info.accepts, dict(info.replaced))
    checks = dict(info.checks)
    for key, value in (params or {}).items():
        if not planner_key(str(key)) and key in checks:
            check_value(value, from_spec(checks[key]), f"parameter {key!r} of analysis {name!r}")


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
                lines.append(f"    {p.name:<{w}}  {p.type} = {p.default}")
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
    out += ["", "## Source figure -> analysis", "",
            "Every figure and table of the five source documents (seeds 000-004, see References), the analyses "
            "that compute it and the authors' settings (`analysis.param=value`; `model:` and `dataset:` are "
            "options of a model or dataset entry). The note says where a default departs from the authors' "
            "code and which parameter selects theirs, or why an item is not measured here. From "
            "`vitscope/source_figures.py`.", "", *source_figures.markdown()]
    for a in infos:
        out += ["", f"## {a.name}", "", _markdown_doc(a.doc) if a.doc else a.description, ""]
        out += ["| parameter | type | default |", "|---|---|---|"]
        out += [f"| `{p.name}` | `{p.type.replace('|', chr(92) + '|')}` | `{p.default}` |" for p in a.params]
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
