"""Shape bias per category (`shape_bias_category` rows of `shape_bias`; Geirhos et al. 2019 Fig. 4, Park et al.
2023): each shape class's fraction of shape decisions, checked against loops written here, and its figure."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from test_robustness import _feed_vectors, _info

from vitscope.analyses.robustness import ShapeBias
from vitscope.data.base import Batch
from vitscope.metrics import robustness as R
from vitscope.metrics import semantics as S


def slow_category(decisions, shape, texture, c):
    """(images, kept, shape decisions, texture decisions) of the images of shape class ``c``, one by one."""
    out = [0, 0, 0, 0]
    for d, s, t in zip(decisions.tolist(), shape.tolist(), texture.tolist(), strict=True):
        if s != c:
            continue
        out[0] += 1
        if s != t:
            out[1] += 1
            out[2] += d == s
            out[3] += d == t
    return out


def test_the_per_category_tally_equals_a_loop_and_adds_up_to_the_overall_tally():
    g = torch.Generator().manual_seed(0)
    shape = torch.randint(0, 6, (300,), generator=g)
    texture = torch.randint(0, 6, (300,), generator=g)  # some agree with the shape: left out of the counts
    decisions = torch.where(torch.rand(300, generator=g) < 0.5, shape, torch.randint(0, 6, (300,), generator=g))
    got = R.shape_bias_category_tally(decisions, shape, texture, 6)
    for c in range(6):
        assert got[c].tolist() == slow_category(decisions, shape, texture, c)
    assert got.sum(0).tolist() == R.shape_bias_tally(decisions, shape, texture).tolist()
    outside = R.shape_bias_category_tally(decisions, shape, texture, 4)  # classes 4, 5 counted nowhere
    assert outside.tolist() == got[:4].tolist()


def _feed_logits(an, logits, shape, texture, bs=32):
    for s in range(0, len(logits), bs):
        b = Batch(images=torch.zeros(len(logits[s:s + bs]), 3, 1, 1), index=torch.arange(s, s + len(logits[s:s + bs])),
                  labels=shape[s:s + bs])
        b.extra["texture_labels"] = texture[s:s + bs]
        b.dataset, b.view = "cue", "clean"
        an.update({"logits": logits[s:s + bs]}, b)


def test_the_heads_per_category_shape_bias_equals_a_loop_over_its_decisions():
    classes = list(R.CIFAR10_CLASSES)
    g = torch.Generator().manual_seed(1)
    shape = torch.randint(0, 10, (200,), generator=g)
    texture = (shape + torch.randint(0, 3, (200,), generator=g)) % 10  # a third of the cues agree
    logits = torch.randn(200, 10, generator=g)
    logits[torch.arange(200), shape] += torch.rand(200, generator=g) * 2  # a head leaning to the shape
    an = ShapeBias(_info(), readout="head", head_classes="cifar10")
    an.datasets = {"data": "cue"}
    an.configure({"data": classes})
    _feed_logits(an, logits, shape, texture)
    df = an.finalize()
    cat = df[df.metric == "shape_bias_category"].set_index("category")
    decisions = logits.argmax(1)
    for c, name in enumerate(classes):
        n_all, _, n_shape, n_texture = slow_category(decisions, shape, texture, c)
        if not n_all:
            assert name not in cat.index
            continue
        row = cat.loc[name]
        want = n_shape / (n_shape + n_texture) if n_shape + n_texture else math.nan
        assert row["value"] == pytest.approx(want, nan_ok=True)
        assert (row["n"], row["n_shape"], row["n_texture"]) == (n_shape + n_texture, n_shape, n_texture)
        lo, hi, se = S.binomial_interval(want, n_shape + n_texture)
        assert row["value_lo"] == pytest.approx(lo, nan_ok=True) and row["value_hi"] == pytest.approx(hi, nan_ok=True)
        assert row["readout"] == "head"
    overall = df[df.metric == "shape_bias"].iloc[0]  # unchanged: every decision pooled
    assert overall["value"] == pytest.approx(int(cat["n_shape"].sum()) / int(cat["n"].sum()))
    back = ShapeBias(_info(), readout="head", head_classes="cifar10")  # the per-class tally is in the state
    back.load_state_dict(an.state_dict())
    pd.testing.assert_frame_equal(back.finalize(), df)


def test_the_probes_per_category_rows_add_up_to_their_overall_row_per_block():
    ytr, ycue = torch.arange(300) % 12, torch.arange(120) % 12
    tcue = (ycue + 1) % 12
    an = ShapeBias(_info(), test_every=5)
    an.datasets = {"data": "cue", "train": "train"}
    an.configure({"data": [f"c{i}" for i in range(12)], "train": [f"c{i}" for i in range(12)]})
    _feed_vectors(an, torch.eye(12)[ytr], ytr, None, "train")  # features of the shape: every decision the shape's
    _feed_vectors(an, torch.eye(12)[ycue], ycue, tcue, "cue")
    df = an.finalize()
    cat = df[df.metric == "shape_bias_category"]
    overall = df.set_index("metric")
    assert sorted(cat["category"]) == sorted(f"c{i}" for i in range(12)) and (cat["readout"] == "probe").all()
    assert int(cat["n_shape"].sum()) == int(overall.loc["n_shape", "value"])
    assert int(cat["n_texture"].sum()) == int(overall.loc["n_texture", "value"])
    assert (cat["value"] == 1.0).all() and (cat["n"] == 10).all()


def test_the_figure_draws_a_point_per_category_and_a_mean_line_per_model():
    from vitscope.report.figures import FIGURES

    rng = np.random.default_rng(0)
    rows = []
    for m in ("a", "b"):
        rows.append({"model": m, "metric": "shape_bias", "layer": None, "readout": "head", "value": 0.4})
        for c in ("cat", "dog", "car"):
            rows.append({"model": m, "metric": "shape_bias_category", "layer": None, "readout": "head",
                         "category": c, "value": rng.uniform(), "n": 5})
    df = pd.DataFrame(rows)
    figs = FIGURES["shape_bias"](df)
    assert len(figs) == 2 and "per category" in figs[1][0]
    ax = figs[1][1].axes[0]
    points = [line for line in ax.lines if line.get_marker() == "o"]
    assert sorted(len(p.get_xdata()) for p in points) == [3, 3]
    means = sorted(float(line.get_xdata()[0]) for line in ax.lines if line.get_marker() in ("None", "", None)
                   and line.get_xdata()[0] != 0.5)
    want = sorted(df[(df.metric == "shape_bias_category") & (df.model == m)]["value"].mean() for m in ("a", "b"))
    assert means == pytest.approx(want)
