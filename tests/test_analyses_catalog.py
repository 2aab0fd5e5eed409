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
