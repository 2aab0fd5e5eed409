"""docs/ZOO.md's tables of the shipped zoo must agree with the shipped cards (src/vitscope/zoo/weights/*/card.json).

Each number is compared with the card's value rounded as the page prints it; a card that changes without the page
(or a shipped model missing from it) fails here. The masked-modelling reconstruction cells are skipped while they
hold their ``<!-- RECON: ... -->`` placeholders, and checked against ``card["eval"]["reconstruction"]`` once they hold
numbers. Reads json and markdown only (no model is loaded).
"""

import copy
import json
import re
from pathlib import Path

import pytest

import vitscope.zoo
from vitscope.zoo.evaluate import FAMILY, margins

DOC = Path(__file__).resolve().parents[1] / "docs" / "ZOO.md"
WEIGHTS = Path(vitscope.zoo.__file__).resolve().parent / "weights"
PLACEHOLDER = "<!-- RECON"
NUMBER = re.compile(r"[+-]?\d+\.\d+")


def model_name(folder: str) -> str:
    return "zoo-sup" if folder == "supervised" else f"zoo-{folder}"


def shipped_cards() -> dict[str, dict]:
    """Registry name -> card, for every shipped zoo folder."""
    return {model_name(p.parent.name): json.loads(p.read_text()) for p in sorted(WEIGHTS.glob("*/card.json"))}


def table(doc: str, marker: str) -> dict[str, list[str]]:
    """The markdown table after the HTML comment starting with ``<!-- marker``: first cell -> the other cells."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"<!-- {marker}")), None)
    assert start is not None, f"docs/ZOO.md has no '<!-- {marker}' comment before its table"
    while not lines[start].startswith("|"):
        start += 1
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def attention_summary(per_block: list[float], half_width: float) -> str:
    """The scores table's attention cell: the range of the per-block change and the blocks beyond the interval."""
    lower = [str(i) for i, x in enumerate(per_block) if x < -half_width]
    higher = [str(i) for i, x in enumerate(per_block) if x > half_width]
    parts = (["more local at " + ", ".join(lower)] if lower else []) + \
        (["more global at " + ", ".join(higher)] if higher else [])
    return f"{min(per_block):+.2f} to {max(per_block):+.2f}; " + ("; ".join(parts) or f"none beyond ±{half_width:.3f}")


def best(e: dict, metric: str) -> str:
    return f"{e[f'best_{metric}']:.3f} ({e[f'best_{metric}_at']})"


def interval(m: dict) -> str:
    return f"{m['margin']:+.3f} [{m['interval'][0]:+.3f}, {m['interval'][1]:+.3f}]"


def mismatches(doc: str, cards: dict[str, dict]) -> list[str]:
    """Every disagreement between the page's tables and ``cards`` (registry name -> card), one sentence each."""
    out: list[str] = []

    def same(model: str, what: str, got: str, want: str) -> None:
        if got != want:
            out.append(f"{model}: {what} is {got!r} in docs/ZOO.md, {want!r} by its card")

    rnd = cards["zoo-random"]
    trained = {n: c for n, c in cards.items() if c.get("objective") in FAMILY}
    finetuned = {n: c for n, c in cards.items() if c.get("objective") == "finetune"}

    scores = table(doc, "scores table")
    zoo = set(trained) | {"zoo-random"}
    if set(scores) != zoo:
        out.append(f"scores table rows {sorted(scores)} are not the shipped zoo {sorted(zoo)}")
    if "zoo-random" in scores:
        row = scores["zoo-random"]
        same("zoo-random", "best-block 20-NN", row[2], best(rnd["eval"], "knn20"))
        same("zoo-random", "best-block probe", row[4], best(rnd["eval"], "probe"))
    for name, card in trained.items():
        if name not in scores:
            continue
        row, e = scores[name], card["eval"]
        family = FAMILY[card["objective"]]
        m = card.get("margins") or margins(card, rnd)  # a card not judged yet: the margins from its own numbers
        same(name, "family", row[0], family)
        same(name, "best-block 20-NN", row[2], best(e, "knn20"))
        same(name, "20-NN margin", row[3], interval(m["knn20"]))
        same(name, "best-block probe", row[4], best(e, "probe"))
        same(name, "probe margin", row[5], interval(m["probe"]))
        a = m["attn_dist_change"]
        same(name, "attention change", row[7], attention_summary(a["per_block"], a["half_width"]))
        rec, recon_cell, verdict_cell = e.get("reconstruction"), row[6], row[8]
        if family != "masked":
            same(name, "reconstruction", recon_cell, "-")
        elif PLACEHOLDER in recon_cell:
            if rec is not None:
                out.append(f"{name}: its card has a reconstruction ratio ({rec['ratio']:.3f}); fill the placeholder "
                           "in docs/ZOO.md")
        elif rec is None:
            out.append(f"{name}: docs/ZOO.md gives a reconstruction ratio ({recon_cell}) its card does not have")
        else:
            want = [f"{rec[k]:.3f}" for k in ("ratio", "ratio_lo", "ratio_hi")]
            got = re.findall(r"\d+\.\d+", recon_cell)
            same(name, "reconstruction ratio [95 %]", " ".join(got), " ".join(want))
        if PLACEHOLDER not in verdict_cell:
            bar = card.get("bar") or {}
            same(name, "verdict", verdict_cell, "passes" if bar.get("passes") else "fails")

    attn = table(doc, "attention table")
    for name, card in {"zoo-random": rnd, **trained}.items():
        b = card["eval"]["blocks"]["attn_dist"]
        same(name, "attention distance per block", " ".join(attn.get(name, ["missing"])),
             " ".join([f"{x:.3f}" for x in b] + [f"{min(b):.3f}"]))

    final = table(doc, "final-block table")
    for name, card in {"zoo-random": rnd, **trained}.items():
        e = card["eval"]
        same(name, "final-block 20-NN / probe", " ".join(final.get(name, ["missing"])),
             " ".join(f"{e[k]:.3f}" for k in ("knn20_cls", "knn20_gap", "probe_cls", "probe_gap")))

    ft = table(doc, "fine-tuned table")
    if set(ft) != set(finetuned):
        out.append(f"fine-tuned table rows {sorted(ft)} are not the shipped fine-tuned models {sorted(finetuned)}")
    for name, card in finetuned.items():
        row, e = ft.get(name, ["?"] * 5), card["eval"]
        same(name, "start", row[0], card["hparams"]["source"].removesuffix("-s0"))
        same(name, "20-NN / probe CLS", f"{row[2]} {row[3]}", f"{e['knn20_cls']:.3f} {e['probe_cls']:.3f}")
    return out


@pytest.fixture(scope="module")
def doc() -> str:
    if not DOC.is_file():
        pytest.skip("docs/ZOO.md is not here (not a source checkout)")
    return DOC.read_text()


def test_zoo_doc_tables_agree_with_the_shipped_cards(doc):
    bad = mismatches(doc, shipped_cards())
    assert not bad, ("docs/ZOO.md disagrees with the shipped cards (regenerate its tables under 'Results'):\n"
                     + "\n".join(bad))


def test_zoo_doc_check_fails_when_a_card_changes(doc):
    cards = shipped_cards()
    for name, field, delta in (("zoo-sup", "best_knn20", 0.01), ("zoo-random", "best_probe", -0.01),
                               ("zoo-mocov3", "probe_cls", 0.002)):
        changed = copy.deepcopy(cards)
        changed[name]["eval"][field] += delta
        changed[name].pop("margins", None)  # margins recomputed from the changed numbers
        assert mismatches(doc, changed), f"a change of {name}'s {field} went unnoticed"
    changed = copy.deepcopy(cards)
    changed["zoo-dino"]["bar"]["passes"] = not changed["zoo-dino"]["bar"]["passes"]
    assert any("verdict" in m for m in mismatches(doc, changed))
    changed = copy.deepcopy(cards)
    changed["zoo-hybrid"]["margins"]["knn20"]["interval"][0] += 0.01
    assert any("20-NN margin" in m for m in mismatches(doc, changed))


def test_zoo_doc_reconstruction_cells_are_checked_once_filled(doc):
    """Placeholders pass while the cards have no reconstruction; numbers are compared with the card's once there."""
    cards = copy.deepcopy(shipped_cards())
    rec = {"ratio": 0.61234, "ratio_lo": 0.60111, "ratio_hi": 0.62345}
    for obj in ("mae", "simmim"):
        cards[f"zoo-{obj}"]["eval"]["reconstruction"] = rec
        cards[f"zoo-{obj}"]["bar"] = {"passes": True}
    filled = doc
    for obj in ("mae", "simmim"):
        filled = filled.replace(f"| <!-- RECON: {obj} --> | ", "| 0.612 [0.601, 0.623] | ", 1)
        filled = filled.replace(f"| <!-- RECON: {obj} --> |", "| passes |", 1)
    if filled == doc:
        pytest.skip("the reconstruction cells hold numbers already (checked by the first test)")
    assert mismatches(filled, cards) == []
    assert any("fill the placeholder" in m for m in mismatches(doc, cards))  # card has a number, the page does not
    wrong = filled.replace("0.612 [0.601, 0.623]", "0.613 [0.601, 0.623]", 1)
    assert any("reconstruction ratio" in m for m in mismatches(wrong, cards))
    cards["zoo-mae"]["bar"] = {"passes": False}
    assert any("zoo-mae: verdict" in m for m in mismatches(filled, cards))
