"""Recipes (`vitscope recipes`, `vitscope run recipe:NAME data_root=...`): every shipped recipe loads and validates
with its placeholders resolved and its models known to the registry (or timm); the listing, an unknown recipe and a
missing data_root are one line before torch; a recipe's published numbers reach the report beside the measured
value and its interval (a fake run directory, its tables built by hand)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pandas as pd
import pytest
from test_fast_refusals import run_cli

import vitscope.analyses  # noqa: F401 - the live registry: the newest analyses' names and parameters
from vitscope.errors import ConfigError
from vitscope.study.config import (
    ModelConfig,
    StudyConfig,
    check_published,
    load_config,
    recipe_names,
    recipe_summaries,
    recipes_dir,
)

RECIPES = ("teaching-matters", "park-2023", "shekhar-2022", "merlin-2023", "wang-2023")
ROOTS = ["data_root=/srv/data", "ckpt_root=/srv/ckpts"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "README.md"


def test_the_five_recipes_are_shipped():
    assert sorted(recipe_names()) == sorted(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_validates_with_its_placeholders_resolved(name):
    from vitscope.models.load import resolve_spec

    cfg = load_config(f"recipe:{name}", ROOTS)  # the full validation: parameters off the live classes, the plan
    for m in cfg.models:
        resolve_spec(m.name)  # a registry entry or a timm architecture; no weights read
        for f in (m.weights,):
            assert f is None or f.startswith("/srv/ckpts/"), f
    for d in cfg.datasets.values():
        for path in (d.root, d.annotations, d.classes):
            assert path is None or "${" not in path
        assert d.root is None or d.root.startswith("/srv/data/"), d.root
    assert cfg.published, f"{name} carries no published numbers"
    labels = {m.label or m.name for m in cfg.models}
    assert {p["model"] for p in cfg.published} <= labels


def test_teaching_matters_has_the_20_variants_and_the_shipped_imagenet50_list():
    cfg = load_config("recipe:teaching-matters", ["data_root=/srv/data"])
    assert len(cfg.models) == 20
    classes = Path(cfg.datasets["imagenet50"].classes)
    ids = [line.split()[0] for line in classes.read_text().splitlines() if line.strip()]
    assert len(ids) == 50 and len(set(ids)) == 50 and all(i.startswith("n") for i in ids)


def test_a_command_line_override_still_applies_to_a_recipe():
    cfg = load_config("recipe:park-2023", [*ROOTS, "batch_size=8", "~analyses.tsne"])
    assert cfg.batch_size == 8 and "tsne" not in cfg.analyses


def test_recipes_are_listed_without_torch():
    code, err, imported, _ = run_cli("recipes")
    assert code == 0, err
    assert not [m for m in imported if m.split(".")[0] in ("torch", "timm", "pandas")]
    rows = recipe_summaries()
    assert [r["name"] for r in rows] == sorted(RECIPES)


def test_an_unknown_recipe_is_one_sentence_with_its_close_match():
    code, err, imported, _ = run_cli("run", "recipe:teching-matters", "data_root=/x")
    assert code == 2 and err.count("\n") == 0, err
    assert "unknown recipe 'teching-matters'" in err and "did you mean teaching-matters?" in err
    assert "torch" not in imported


def test_a_recipe_without_data_root_is_one_sentence_saying_to_pass_it():
    code, err, imported, _ = run_cli("run", "recipe:teaching-matters", "--dry-run")
    assert code == 2 and err.count("\n") == 0, err
    assert "pass data_root=/path" in err and "torch" not in imported
    with pytest.raises(ConfigError, match="pass ckpt_root=/path"):
        load_config("recipe:park-2023", ["data_root=/srv/data"])


def test_the_dry_run_needs_the_data_folders_and_says_which_is_missing(tmp_path):
    code, err, _, _ = run_cli("run", "recipe:park-2023", f"data_root={tmp_path}", f"ckpt_root={tmp_path}",
                              "--dry-run")
    assert code == 2 and err.count("\n") == 0, err
    assert str(tmp_path / "imagenet" / "val") in err and "does not exist" in err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["teaching-matters", "merlin-2023"])
def test_the_dry_run_on_the_miniature_data(name, tmp_path):
    """The dry run (passes, forwards, cache growth) on the miniature data_root of tests/miniature.py (ImageNet-50
    at its 3 images per class), with no weights read: every model of the recipe is estimated."""
    miniature = pytest.importorskip("miniature", reason="tests/miniature.py (the miniature data_root) not here")
    miniature.write_data_root(tmp_path / "data")
    from vitscope.study.cost import dry_run

    extra = ["datasets.imagenet50.per_class=3"] if name == "teaching-matters" else []
    cfg = load_config(f"recipe:{name}", [f"data_root={tmp_path / 'data'}", f"ckpt_root={tmp_path / 'ck'}",
                                         f"output_dir={tmp_path / 'o'}", f"cache_dir={tmp_path / 'c'}", *extra])
    est = dry_run(cfg)
    text = est.text()
    assert est.forwards > 0 and est.passes >= len(cfg.models), text
    assert "forward" in text


def test_docs_list_every_recipe_and_point_to_the_package_folder():
    text = DOCS.read_text()
    assert "src/vitscope/configs/recipes/" in text
    for name in RECIPES:
        assert f"`{name}`" in text and (recipes_dir() / f"{name}.yaml").is_file()


def _cfg(published: list[dict]) -> StudyConfig:
    return StudyConfig(models=[ModelConfig(name="dino-b16"), ModelConfig(name="mae-b16", label="mae")],
                       published=published)


GOOD = {"analysis": "propagation", "model": "mae", "metric": "JF", "layer": "best", "value": 0.5, "source": "x"}


@pytest.mark.parametrize("change, words", [
    ({"analysis": "propagaton"}, "unknown analysis 'propagaton'; did you mean propagation?"),
    ({"model": "mea"}, "no model labelled 'mea' in the study; did you mean mae?"),
    ({"layer": "last"}, "layer must be a block index"),
    ({"value": "0.5"}, "value must be a number"),
    ({"scale": 0}, "scale must be a positive number"),
])
def test_a_bad_published_entry_is_one_sentence(change, words):
    check_published(_cfg([GOOD]))
    with pytest.raises(ConfigError, match=None) as e:
        check_published(_cfg([{**GOOD, **change}]))
    assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="lacks source"):
        check_published(_cfg([{k: v for k, v in GOOD.items() if k != "source"}]))


def _fake_tables(rng: random.Random) -> dict[str, pd.DataFrame]:
    """A propagation table of two models x 6 layers (values and intervals at random), with per-video rows and
    chance rows beside the aggregate ones, and a semantics table with two token views."""
    rows = []
    for model in ("dino-b16", "mae"):
        for layer in range(6):
            v = rng.uniform(0.2, 0.8)
            half = rng.uniform(0.01, 0.05)
            rows.append({"model": model, "analysis": "propagation", "metric": "JF", "layer": layer, "value": v,
                         "value_lo": v - half, "value_hi": v + half, "stderr": half / 1.96, "video": None})
            rows.append({"model": model, "analysis": "propagation", "metric": "JF", "layer": layer, "value": 0.99,
                         "video": "bear"})  # a per-video row: never the published aggregate
        rows.append({"model": model, "analysis": "propagation", "metric": "JF_chance", "layer": None, "value": 0.06})
    sem = []
    for view in ("cls", "gap_spatial"):
        for layer in range(6):
            v = rng.uniform(0.1, 0.9)
            sem.append({"model": "dino-b16", "analysis": "semantics", "metric": "probe_top1", "layer": layer,
                        "token_view": view, "value": v, "stderr": rng.uniform(0.001, 0.01)})
    return {"propagation": pd.DataFrame(rows), "semantics": pd.DataFrame(sem)}


def test_published_numbers_beside_the_measured_value_and_interval():
    from vitscope.report.html import _published
    from vitscope.report.published import published_table
    from vitscope.report.run import Run

    rng = random.Random(7)
    tables = _fake_tables(rng)
    published = [
        {**GOOD, "model": "mae", "value": 0.54, "source": "Walmer et al. 2023, Table 1"},
        {"analysis": "semantics", "model": "dino-b16", "metric": "probe_top1", "token_view": "gap_spatial",
         "layer": 4, "value": 37.37, "scale": 100, "source": "Walmer et al. 2023, Table 6"},
        {"analysis": "correspondence", "model": "mae", "metric": "pck@0.1", "layer": "best", "value": 22.74,
         "scale": 100, "source": "Walmer et al. 2023, Table 1"},
        {**GOOD, "model": "dino-b16", "layer": 9, "value": 0.6, "source": "s"},
    ]
    manifest = {"config": {"published": published}, "models": {"dino-b16": {}, "mae": {}}}
    got = published_table(tables, manifest)

    # the slow reference: the aggregate rows (no video) of mae's JF, the largest by a plain loop
    best, best_row = -1.0, None
    for _, r in tables["propagation"].iterrows():
        if r["model"] == "mae" and r["metric"] == "JF" and pd.isna(r["video"]) and r["value"] > best:
            best, best_row = r["value"], r
    assert got.loc[0, "this run"] == pytest.approx(best)
    assert got.loc[0, "±"] == pytest.approx((best_row["value_hi"] - best_row["value_lo"]) / 2)
    assert got.loc[0, "layer"] == f"best ({int(best_row['layer'])})" and got.loc[0, "paper"] == 0.54
    # a fixed layer and a selector column, scaled to percent; its interval from the stderr
    ref = [r for _, r in tables["semantics"].iterrows() if r["token_view"] == "gap_spatial" and r["layer"] == 4][0]
    assert got.loc[1, "this run"] == pytest.approx(100 * ref["value"])
    assert got.loc[1, "±"] == pytest.approx(100 * 1.96 * ref["stderr"])
    # no table, no row: said so, never a number
    assert math.isnan(got.loc[2, "this run"]) and "no correspondence table" in got.loc[2, "note"]
    assert math.isnan(got.loc[3, "this run"]) and "no row" in got.loc[3, "note"]

    html = "\n".join(_published(Run(Path("."), manifest, tables)))
    assert "Published numbers" in html and "Walmer et al. 2023, Table 1" in html
    assert f"{best:.4g}" in html and f"{(best_row['value_hi'] - best_row['value_lo']) / 2:.4g}" in html
    assert _published(Run(Path("."), {"models": {}}, tables)) == []
