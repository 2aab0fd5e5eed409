"""The "source figure -> analysis" table (vitscope/source_figures.py, printed in docs/analyses.md): every figure
and table caption of the source documents has a row, and every analysis and parameter a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vitscope import source_figures
from vitscope.analyses_listing import snapshot

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
CAPTION = re.compile(r"^\**(Figure|Table) (\d+):", re.M)


def _captions(seed: str) -> set[str]:
    """Every 'Figure N:' / 'Table N:' caption that starts a line of the seed's text, as 'Fig. N' / 'Table N'."""
    (path,) = SEEDS.glob(f"{seed}_*.txt")
    return {("Fig. " if kind == "Figure" else "Table ") + n for kind, n in CAPTION.findall(path.read_text())}


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the source documents (../shared/seeds) are not beside the checkout")
@pytest.mark.parametrize("seed", ["000", "002", "003", "004"])
def test_every_caption_has_a_row(seed):
    rows = {it.item for it in source_figures.ITEMS if it.seed == seed}
    captions = _captions(seed)
    assert captions, f"no captions read from seed {seed}"
    assert not captions - rows, f"seed {seed}: figures without a row: {sorted(captions - rows)}"
    assert not rows - captions, f"seed {seed}: rows for figures the document does not have: {sorted(rows - captions)}"


def test_slides_have_rows():
    """Seed 001 (slides) has no figure numbers: its rows are slide titles, one per measured claim."""
    assert sum(it.seed == "001" for it in source_figures.ITEMS) >= 12


def test_named_analyses_and_parameters_exist():
    infos = {a.name: a for a in snapshot()}
    for it in source_figures.ITEMS:
        for name in it.analyses:
            assert name in infos, f"{it.seed} {it.item}: no analysis {name!r}"
        for p in it.params:
            where, _, value = p.partition("=")
            assert value, f"{it.seed} {it.item}: {p!r} is not NAME=VALUE"
            if ":" in where:
                assert where.split(":")[0] in ("model", "dataset"), p
                continue
            analysis, _, param = where.partition(".")
            assert analysis in it.analyses, f"{it.seed} {it.item}: {p!r} names an analysis the row does not use"
            assert param in {q.name for q in infos[analysis].params}, f"{it.seed} {it.item}: no parameter {p!r}"


def test_rows_without_an_analysis_say_why():
    for it in source_figures.ITEMS:
        if not it.analyses:
            assert len(it.note) > 20, f"{it.seed} {it.item} has neither an analysis nor a reason"


def test_markdown_has_one_row_per_item_and_no_stray_pipes():
    lines = source_figures.markdown()
    assert len(lines) == 2 + len(source_figures.ITEMS)
    assert all(line.count("|") == 7 for line in lines), "a cell contains a '|'"
