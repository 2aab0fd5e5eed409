"""The generated silhouette cue-conflict stimuli (`vitscope.data.silhouettes`): deterministic, balanced, read by
shape_bias as its protocol says, and what the default study's shape_bias shows on them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from vitscope.analyses.robustness import ShapeBias, known_classes
from vitscope.data import silhouettes as SL
from vitscope.data.catalog import FORMATS, build_dataset
from vitscope.errors import ConfigError
from vitscope.models.adapter import ModelInfo
from vitscope.models.registry import Preprocessing

PRE = Preprocessing(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), input_size=32, crop_pct=1.0)


def test_an_image_is_a_function_of_seed_and_index_alone():
    a = SL.Silhouettes(n=40, seed=3, cue="conflict")
    s = a.sample(17)
    assert s.image.shape == (32, 32, 3) and s.image.dtype == np.float32 and 0 <= s.image.min() <= s.image.max() <= 1
    assert np.array_equal(s.image, SL.Silhouettes(n=5, seed=3, cue="conflict").sample(17).image)
    assert not np.array_equal(s.image, SL.Silhouettes(n=40, seed=4, cue="conflict").sample(17).image)
    assert SL.Silhouettes(n=40, seed=3).sample(17, 64).image.shape == (64, 64, 3)  # any size: each model's input
    # a batch of some ids is those ids' images, in order, with their labels, cues and texture labels
    b = next(a.batches(3, PRE, indices=[17, 2, 30]))
    assert b.index.tolist() == [17, 2, 30] and b.labels.tolist() == [a.stimulus(i).label for i in (17, 2, 30)]
    assert b.extra["texture_labels"].tolist() == [a.stimulus(i).texture for i in (17, 2, 30)]
    assert b.extra["cue"].tolist() == [2, 2, 2] and b.extra["class_names"] == list(SL.CLASSES)
    want = (torch.from_numpy(s.image).permute(2, 0, 1) - 0.5) / 0.25
    assert torch.allclose(b.images[0], want, atol=1e-6)


def test_sets_are_balanced_and_the_conflicts_pair_every_two_different_classes():
    both = SL.Silhouettes(n=128, cue="both")
    st = [both.stimulus(i) for i in range(128)]
    assert both.index_labels() == [s.label for s in st]
    for kind, field in ((0, "shape"), (1, "texture")):  # 8 shape-only and 8 texture-only images of every class
        assert np.bincount([s.label for s in st if s.kind == kind], minlength=SL.K).tolist() == [8] * SL.K
        assert all(getattr(s, field) == s.label for s in st if s.kind == kind)
    assert {s.kind for s in st} == {0, 1} and all((s.shape < 0) != (s.texture < 0) for s in st)
    pairs = [(s.shape, s.texture) for s in (SL.stimulus(0, i, "conflict") for i in range(SL.K * (SL.K - 1)))]
    assert len(set(pairs)) == SL.K * (SL.K - 1) and all(a != b for a, b in pairs)
    # the neutral outline of the texture-only images has the silhouettes' mean area (the texture's share of the image)
    area = {cue: np.mean([SL.Silhouettes(n=160, cue=cue).sample(i).mask.mean() for i in range(160)])
            for cue in ("shape", "texture")}
    assert abs(area["shape"] - area["texture"]) < 0.03, area


def test_colour_is_the_same_in_every_set():
    """Every image's colours come from one distribution: no colour tells the class or the set (shape-only images
    are filled with the mean of the pattern colours)."""
    means = {}
    for cue in ("shape", "texture", "conflict"):
        x, _, _ = SL.images(cue, 160, seed=1)
        fg = [img[SL.render(SL.stimulus(1, i, cue), 32)[1]].mean(0) for i, img in enumerate(x)]
        means[cue] = np.mean(fg, 0)
    for cue in ("texture", "conflict"):
        assert np.abs(means[cue] - means["shape"]).max() < 0.05, means


def test_shape_only_and_texture_only_are_decoded_at_comparable_rates_by_a_fixed_random_feature_map():
    """The balance check: the reference observer (a fixed random convolution, no training) reads the shape classes
    from the shape-only set and the texture classes from the texture-only set about equally well, both far above
    chance. Raw pixels read the shapes but not the textures (random phase: every texture class has the same mean
    image), which is why the reference is a feature map."""
    ref = SL.cue_decodability(SL.random_feature_map, n=256)
    assert ref["shape"] > 0.75 and ref["texture"] > 0.75, ref
    assert abs(ref["shape"] - ref["texture"]) < 0.12, ref
    pixels = SL.cue_decodability(lambda x: x.reshape(len(x), -1), n=256)
    assert pixels["shape"] > 3 * pixels["chance"] and pixels["texture"] < 0.4, pixels


def _vectors(batch, which):
    """A hand-made model: one-hot of the image's shape class (``which='shape'``) or texture class ('texture'),
    where the image has one; where it has none (a texture-only image for the shape model, a shape-only image for the
    texture model), a vector of noise that carries no class."""
    n = len(batch)
    kind = batch.extra["cue"]
    if "texture_labels" in batch.extra:
        cls = batch.labels if which == "shape" else batch.extra["texture_labels"]
        has = torch.ones(n, dtype=torch.bool)
    else:
        cls, has = batch.labels, kind == (0 if which == "shape" else 1)
    g = torch.Generator().manual_seed(int(batch.index[0]))
    v = 0.1 * torch.randn(n, SL.K, generator=g)
    return v + torch.eye(SL.K)[cls] * has[:, None]


@pytest.mark.parametrize("which, want", [("texture", 0.0), ("shape", 1.0)])
def test_a_model_that_sees_only_one_cue_has_the_shape_bias_of_that_cue(which, want):
    """On the default study's sets (128 clean, 64 cue-conflict images), a model whose features carry only the texture
    decides every cue-conflict image by its texture (shape bias 0), one that carries only the shape by its shape
    (1); either is above chance on the clean images (it reads half of them), so its bias is reported, with an
    interval."""
    clean = SL.Silhouettes(n=128, seed=0, cue="both")
    cue = SL.Silhouettes(n=64, seed=1, cue="conflict")
    an = ShapeBias(ModelInfo("m", 1, 1, SL.K, (1, 1), 32, 1, True), probe_tune=False, probe_max_iter=100)
    an.datasets = {"data": cue.name, "train": clean.name}
    an.configure({"data": clean.classes, "train": cue.classes})
    for ds in (clean, cue):
        for b in ds.batches(64, PRE):
            v = _vectors(b, which)
            b.dataset, b.view = ds.name, "clean"
            an.update({"block0.out": torch.stack([v, torch.zeros_like(v)], dim=1)}, b)
    df = an.finalize()
    bias = df[df.metric == "shape_bias"].iloc[0]
    clean_acc = df[df.metric == "clean_accuracy"].iloc[0]
    assert clean_acc["value_lo"] > clean_acc["chance"] == 1 / SL.K
    assert abs(bias["value"] - want) <= 0.05 and bias["value_lo"] <= bias["value"] <= bias["value_hi"], bias
    v = df.set_index("metric")["value"]
    assert v["n_shape" if want else "n_texture"] >= 56 and v["n_images"] == 64


def test_formats_by_name_and_their_classes():
    from types import SimpleNamespace

    def cfg(name, **o):
        return SimpleNamespace(name=name, n_images=16, seed=2, size=None, options=o)

    ds = build_dataset(cfg("synthetic-silhouettes", cue="texture"))
    assert ds.cue == "texture" and len(ds) == 16 and ds.name == "synthetic-silhouettes"
    assert build_dataset(cfg("synthetic-silhouettes")).cue == "both"
    conflict = build_dataset(cfg("synthetic-silhouette-conflict"))
    assert conflict.cue == "conflict" and conflict.name == "synthetic-silhouette-conflict"
    assert "cue_conflict" in FORMATS["synthetic-silhouette-conflict"].provides
    assert "cue_conflict" not in FORMATS["synthetic-silhouettes"].provides
    with pytest.raises(ConfigError, match="option cue 'conflict' is not a clean set"):
        build_dataset(cfg("synthetic-silhouettes", cue="conflict"))
    for name in SL.NAMES.values():
        assert known_classes(name) == list(SL.CLASSES)


def test_figure_names_the_models_at_chance_and_draws_the_untrained_level_and_the_half_line():
    from vitscope.report.figures import FIGURES
    from vitscope.report.figures._common import UNTRAINED_COLOR, context

    rows = []
    for m, values in [("a", [0.3, 0.4, np.nan]), ("base", [0.2, 0.15, 0.1]), ("flat", [np.nan] * 3)]:
        for layer, v in enumerate(values):
            rows.append({"model": m, "metric": "shape_bias", "layer": layer, "readout": "probe", "value": v,
                         "value_lo": v - 0.1, "value_hi": v + 0.1,
                         "reason": "readout at chance: ..." if np.isnan(v) else None})
    with context(models=["a", "base", "flat"], untrained=["base"]):
        (caption, fig), = FIGURES["shape_bias"](pd.DataFrame(rows))
        per_block = fig.axes[1]
        drawn = {line.get_label(): line for line in per_block.lines}
    assert "flat" in caption and "at chance at every block" in caption.replace("Probes at chance", "at chance")
    assert "base" in caption and "untrained" in caption and "Gaps" in caption and "(a)" in caption
    assert "flat" not in drawn and "a" in drawn  # at chance everywhere: named, not drawn
    base = drawn["base (untrained)"]
    assert base.get_color() == UNTRAINED_COLOR and base.get_linestyle() == "--"
    assert any("flat" in t.get_text() for t in per_block.texts)
    half = drawn["0.5: no preference"]
    assert list(half.get_ydata()) == [0.5, 0.5]
    assert len(per_block.collections) == 2  # the 95 % bands of the two models drawn


def test_default_study_shape_bias_on_the_silhouettes_has_values_with_intervals():
    """The default study's shape_bias, as its plan makes it (its datasets and parameters; the passes fed as the
    engine feeds them), for zoo-sup, a self-supervised model and the untrained one: each clean readout is above chance
    beyond its interval at its best block, and every block above chance has a shape bias with its 95 % interval."""
    import vitscope as vs
    from vitscope.analyses._drive import run_passes
    from vitscope.study import load_config
    from vitscope.study.plan import make_plan

    plan = make_plan(load_config())
    ap = next(a for a in plan.analyses if a.name == "shape_bias")
    data = {slot: build_dataset(plan.datasets[name]) for slot, name in ap.slots.items()}
    assert {d.name for d in data.values()} == set(SL.NAMES.values())
    assert (len(data["train"]), len(data["data"])) == (128, 64)
    for model in ("zoo-sup", "zoo-dino", "zoo-random"):
        vm = vs.load_model(model)
        an = ShapeBias(vm, **ap.params)
        run_passes(an, vm, data, batch_size=64)
        an.datasets = dict(ap.slots)
        g = an.finalize()
        acc = g[g.metric == "clean_accuracy"].set_index("layer")
        best = acc["value"].idxmax()
        assert acc.loc[best, "value_lo"] > acc.loc[best, "chance"], (model, acc)
        bias = g[g.metric == "shape_bias"].set_index("layer")
        above = acc.index[acc["value_lo"] > acc["chance"]]
        b = bias.loc[above]
        assert b["value"].notna().all() and b["reason"].isna().all(), (model, b)
        assert ((b["value_lo"] <= b["value"]) & (b["value"] <= b["value_hi"]) & (b["value_hi"] > b["value_lo"])).all()
