"""`vitscope analyses`, docs/analyses.md and the references: every analysis discoverable from the code."""

import inspect
import re
from pathlib import Path

import pytest
import torch

import vitscope as vs
from conftest import tiny
from vitscope.analyses import ANALYSES
from vitscope.analyses.catalog import compress_taps, describe, describe_all, format_markdown
from vitscope.analyses_listing import SNAPSHOT, snapshot, to_json
from vitscope.cli import main
from vitscope.errors import VitscopeError
from vitscope.references import ANALYSIS_REFERENCES, REFERENCES, SEEDS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "analyses.md"


def test_every_analysis_has_full_references():
    assert set(ANALYSIS_REFERENCES) == set(ANALYSES), "add the new analysis to vitscope/references.py"
    for name, keys in ANALYSIS_REFERENCES.items():
        assert keys, name
        for k in keys:
            ref = REFERENCES[k]
            assert "seed" not in ref.lower() and len(ref) > 40, (name, k)  # a citation, not "seed 001"
    assert set(SEEDS.values()) <= set(REFERENCES)


def test_listing_shows_every_parameter_with_type_and_default(capsys):
    assert main(["analyses"]) == 0
    out = capsys.readouterr().out
    for name, cls in ANALYSES.items():
        assert f"{name}: " in out
        skip = 3 if getattr(cls, "pair", False) else 2  # self and the model(s)
        for p in list(inspect.signature(cls.__init__).parameters.values())[skip:]:
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            assert f"    {p.name} " in out, (name, p.name)
    assert re.search(r"\n    n_images +int >= 1 = 4\n    perplexity +float > 0 = 30\.0\n", out)  # tsne's, as declared
    assert "Teaching Matters" in out and "seed 00" not in out.split("\n\n")[0]
    assert f"{len(ANALYSES)} analyses." in out


def test_one_analysis_in_full_and_an_unknown_name(capsys):
    assert main(["analyses", "saliency_iou"]) == 0
    out = capsys.readouterr().out
    assert "masks: a foreground mask" in out and "60 %" in out and "cka:" not in out  # data needs, whole docstring
    assert main(["analyses", "salency_iou"]) == 2
    err = capsys.readouterr().err
    assert "did you mean saliency_iou" in err and len(err.strip().splitlines()) == 1


def test_listed_taps_are_what_the_analysis_captures():
    """The catalog's tap line, expanded on a real 3-block model's tap list, covers what each analysis asks for."""
    vm = tiny("vit")
    for info in describe_all():
        if getattr(ANALYSES[info.name], "pair", False):  # runs both models itself: no taps from the pass
            assert info.taps.startswith("none from the pass"), info.name
            continue
        try:
            needed = ANALYSES[info.name](vm).required_taps()
        except VitscopeError:  # its defaults need an optional package: the catalog says so instead of taps
            assert info.taps.startswith("(depends on"), info.name
            continue
        assert compress_taps(needed, vm.depth) != "", info.name
        for part in info.taps.split(", "):
            kind = part.split(".")[-1]
            assert any(t.endswith("." + kind) or t == kind for t in needed) or not needed, (info.name, part)
    assert compress_taps([f"block{i}.attn" for i in range(12)], 12) == "block*.attn"
    assert compress_taps(["embed"] + [f"block{i}.out" for i in range(11)], 12) == "embed, block0-10.out"
    assert compress_taps(["block11.out"], 12) == "block11.out"
    assert describe("residual_cka").taps == "embed, block0-10.out, block*.attn_out, block*.mlp_out"


def test_shipped_listing_is_the_live_catalog():
    """`vitscope analyses` prints the snapshot (no torch); it must be what the code says today."""
    assert SNAPSHOT.read_text(encoding="utf-8") == to_json(describe_all()), \
        "src/vitscope/analyses_listing.json is stale: regenerate it with " \
        "`python -m vitscope.analyses.catalog > src/vitscope/analyses_listing.json`"
    assert snapshot() == describe_all()


def test_the_snapshot_checks_each_parameter_as_its_annotation_does():
    """`vitscope run` checks values off the snapshot's specs before torch (`vitscope.bounds.to_spec`): for every
    parameter of every analysis the spec's annotation takes the default and refuses what the annotation refuses,
    with the same sentence."""
    from vitscope.analyses.base import analysis_parameters
    from vitscope.bounds import check_value, from_spec, to_spec
    from vitscope.errors import ConfigError

    def verdict(value, tp):
        try:
            check_value(value, tp, "p")
        except ConfigError as e:
            return str(e)
        return None

    probes = [-1, 0, 1, 2, 4, 99, 0.5, 1.5, -0.5, 1e9, float("nan"), "x", "mean", "", [1, 2], [0.5, 2], ["a", "b"],
              ["a", 1], [], None, True, False, {"a": 1}, {"a": "b"}, {1: 2.0}]
    checked = 0
    for name, cls in ANALYSES.items():
        for param, p in analysis_parameters(cls).items():
            spec = to_spec(p.annotation)
            if spec == "any":
                continue
            checked += 1
            tp = from_spec(spec)
            if p.default is not inspect.Parameter.empty:
                default = list(p.default) if isinstance(p.default, tuple) else p.default
                assert verdict(default, tp) is None, (name, param, p.default)
            for v in probes:
                assert verdict(v, tp) == verdict(v, p.annotation), (name, param, v)
    assert checked > 50
    assert {a.name: dict(a.checks) for a in snapshot()}["similarity"]["n_permutations"] == \
        to_spec(analysis_parameters(ANALYSES["similarity"])["n_permutations"].annotation)


def test_a_spec_round_trips_what_it_can_say_and_leaves_the_rest_unchecked():
    import json
    from collections.abc import Callable, Mapping, Sequence
    from typing import Annotated, Any, ForwardRef, Literal, Optional

    from vitscope.bounds import Range, conforms, from_spec, to_spec

    said = [int, float, bool, str, type(None), None, Any, list, dict, tuple[int, ...], Sequence[str] | None,
            Optional[Annotated[int, Range(1)]], Literal["a", 1, 2.5, True], Mapping[str, float] | None,  # noqa: UP045
            Annotated[float, Range(0, 1, open_lo=True, why="w"), Range(hi=0.5)], dict[str, Sequence[int]]]
    for tp in said:
        spec = to_spec(tp)
        assert json.loads(json.dumps(spec)) == spec and to_spec(from_spec(spec)) == spec, tp
    assert to_spec(Any) == to_spec(inspect.Parameter.empty) == "any" and from_spec("any") is Any
    for unsaid in [torch.device, Callable[[int], int], ForwardRef("Foo"), "Foo", str | torch.device,
                   Sequence[torch.device], Annotated[int, "a note"] | Path]:
        assert to_spec(unsaid) == "any", unsaid  # a class, a callable, a forward reference: the analysis judges it
    assert not conforms(2, from_spec(to_spec(Literal[1, True]))) and conforms(True, from_spec(to_spec(Literal[True])))
    assert not conforms(True, from_spec(to_spec(Literal[1])))


def test_docs_page_is_generated_from_the_code():
    assert DOCS.read_text() == format_markdown(describe_all()), \
        "docs/analyses.md is stale: regenerate it with `vitscope analyses --markdown > docs/analyses.md`"


def test_cka_takes_what_extract_returns_for_one_tap(images):
    vm = tiny("vit")
    a = vs.extract(vm, images, "block1.out")
    b = vs.extract(vm, images, "block2.out", view="gap")
    assert vs.cka(a, b) == pytest.approx(vs.cka(a["block1.out"], b["block2.out"]))
    both = vs.extract(vm, images, ["block1.out", "block2.out"])
    with pytest.raises(ValueError, match=r"dict of 2 taps .*pass one tap's features, e\.g\. x\['block1\.out'\]"):
        vs.cka(both, b)
    with pytest.raises(ValueError, match="numeric features"):
        vs.cka([a, b, a, b], torch.zeros(4, 3))


@pytest.mark.parametrize("make", ["missing", "empty", "no_results"])
def test_report_on_a_directory_without_results_is_one_line(make, tmp_path, capsys):
    d = tmp_path / "run"
    if make != "missing":
        d.mkdir()
    if make == "no_results":
        (d / "results").mkdir()
        (d / "manifest.json").write_text("{}")
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vitscope: error:") and str(d) in err
    assert ("not a directory" in err) == (make == "missing")
    assert not (d / "report.html").exists()
