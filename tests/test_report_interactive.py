"""The data behind the report's interactive charts and explorer (`vitscope.report.interactive`), checked against
the tables they come from, row by row (the browser tests check the page shows them)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vitscope.report import interactive as I


def _table(rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    for model in ("b", "a", "u"):
        for layer in range(4):
            for head in range(3):
                v = rng.random()
                rows.append({"model": model, "metric": "distance", "layer": layer, "head": head, "token_view": None,
                             "value": v, "value_lo": v - 0.1, "value_hi": v + 0.1})
            v = rng.random()
            rows.append({"model": model, "metric": "knn10_top1", "layer": layer, "head": None, "token_view": "cls",
                         "value": v, "stderr": 0.01 + layer / 100, "chance": 0.1})
    rows.append({"model": "a", "metric": "knn10_top1_chance", "layer": None, "token_view": "cls", "value": 0.1})
    return pd.DataFrame(rows)


def test_curves_keep_each_row_and_average_only_what_is_left_over():
    t = _table(np.random.default_rng(0))
    spec = I.Curves("x", "t", pattern=".*")
    panels = {p["label"]: p for p in I.curves(t, spec, ["a", "b", "u"])}
    assert set(panels) == {"distance", "knn10_top1 · token_view cls"}
    knn = panels["knn10_top1 · token_view cls"]
    assert list(knn["series"]) == ["a", "b", "u"]  # the study's order
    for model, s in knn["series"].items():
        for layer, y, lo, hi in zip(knn["x"], s["y"], s["lo"], s["hi"], strict=True):
            row = t[(t.model == model) & (t.metric == "knn10_top1") & (t.layer == layer)].iloc[0]
            assert y == pytest.approx(row.value, rel=1e-5)
            assert lo == pytest.approx(row.value - 1.96 * row.stderr, rel=1e-5)  # no value_lo: +- 1.96 stderr
            assert hi == pytest.approx(row.value + 1.96 * row.stderr, rel=1e-5)
    assert knn["chance"] == pytest.approx(0.1)
    dist = panels["distance"]  # three heads per layer: their mean, the band their range (said in the note)
    for model, s in dist["series"].items():
        heads = t[(t.model == model) & (t.metric == "distance")].groupby("layer")["value"]
        np.testing.assert_allclose(s["y"], heads.mean().to_numpy(), rtol=1e-5)
        np.testing.assert_allclose(s["lo"], heads.min().to_numpy(), rtol=1e-5)
        np.testing.assert_allclose(s["hi"], heads.max().to_numpy(), rtol=1e-5)
        assert s["n"] == [3] * 4
    assert "range" in dist["note"] and "not an interval" in dist["note"]


def test_chance_rows_of_a_table_without_a_chance_column():
    t = _table(np.random.default_rng(1)).drop(columns="chance")
    panel = I.curves(t, I.Curves("x", "t", ("knn10_top1",)), ["a", "b"])[0]
    assert panel["chance"] == pytest.approx(0.1)


def test_cka_diagonal_reads_both_orders_of_a_pair():
    rng = np.random.default_rng(2)
    rows = []
    for a, b in (("m1", "m2"), ("m3", "m1")):  # m1 is model_b of the second pair: the page must transpose
        for i in range(3):
            for j in range(3):
                v = rng.random()
                rows.append({"model": a, "model_b": b, "metric": "cka_minibatch", "layer": i, "layer_b": j,
                             "token_view": "gap", "value": v, "value_lo": v - 0.05, "value_hi": v + 0.05})
    t = pd.DataFrame(rows)
    panels = {p["label"]: p for p in I.cka_diagonal(I.grids(t), ["m1", "m2", "m3"])}
    vs_m1 = panels["vs m1 · gap"]
    for other in ("m2", "m3"):
        pair = t[((t.model == "m1") & (t.model_b == other)) | ((t.model == other) & (t.model_b == "m1"))]
        same = pair[pair.layer == pair.layer_b].sort_values("layer")
        np.testing.assert_allclose(vs_m1["series"][other]["y"], same.value.to_numpy(), rtol=1e-5)
    grid = I.grids(t)[0]["pairs"][1]
    assert (grid["a"], grid["b"]) == ("m3", "m1")
    m = t[(t.model == "m3")].pivot(index="layer", columns="layer_b", values="value").to_numpy()
    np.testing.assert_allclose(np.array(grid["value"]), m, rtol=1e-5)
    assert I.grids(t)[0]["range"] == [0.0, 1.0]  # CKA's own scale
    other = I.grids(t.assign(metric="procrustes"), None)[0]  # any measure: named, its range from the table
    assert other["view"] == "procrustes · gap" and other["range"] == pytest.approx([t.value.min(), t.value.max()])


def test_static_figures_replaced_by_a_chart_are_named():
    assert I.replaced("attention_distance", "Attention distance per head and layer [Walmer et al.]")
    assert I.replaced("cka", "CKA between the taps of every pair of models (gap token view): ...")
    assert not I.replaced("cka", "CKA divergence per layer between models")
    assert not I.replaced("cls_attention_maps", "Attention distance per head and layer")


def _explorer_table(sizes: dict[tuple[str, int], int]) -> pd.DataFrame:
    rows = []
    for (model, image), n in sizes.items():
        rows.append({"model": model, "metric": "attention", "image": image, "layer": 0, "heads": 1, "tokens": 2,
                     "codes": bytes(n), "scales": b"", "png": None, "grid_rows": 1, "grid_cols": 1,
                     "prefix_tokens": 1, "cls_token": True, "queries": None})
    return pd.DataFrame(rows)


def test_the_explorer_keeps_to_its_page_budget_image_by_image(monkeypatch):
    monkeypatch.setattr(I, "PAGE_BUDGET", 100)
    t = _explorer_table({("a", 0): 30, ("a", 5): 30, ("b", 1): 30, ("b", 2): 30, ("c", 0): 200})
    data = I.explorer({I.EXPLORER: t}, ["a", "b", "c"])
    # image-major: a's first (30), b's first (60), c's first is too large (left out, not stopping the others),
    # a's second (90); b's second would pass the budget
    assert {m: sorted(map(int, e["images"])) for m, e in data["models"].items()} == {"a": [0, 5], "b": [1]}
    assert data["left_out"] == {"b": 1, "c": 1}
