"""The study runner and the command line, end to end on tiny models."""

import json

import numpy as np
import pandas as pd
import pytest
from study_fixtures import TWO_TINY_MODELS

from vitscope.cli import main
from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study

TINY_YAML = TWO_TINY_MODELS + """\
dataset: {name: synthetic-shapes, n_images: 12}
analyses:
  attention_distance: {}
  cka: {batch_size: 6, views: [gap]}
batch_size: 6
progress: false
"""


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "study.yaml"
    p.write_text(TINY_YAML)
    return p


def test_run_writes_tidy_tables_manifest_and_report(config, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", str(config), f"output_dir={out}"]) == 0
    assert "report.html" in capsys.readouterr().out
    dist = pd.read_parquet(out / "results" / "attention_distance.parquet")
    assert set(dist.model) == {"tiny-vit", "tiny-beit"}
    heads = dist[dist.metric.isin(["distance", "distance_px"])]
    assert len(heads) == 2 * 2 * 3 * 2  # models x layers x heads x (unit, px)
    uniform = dist[dist.metric.str.endswith("_uniform")]  # the uniform-attention reference, per model and unit
    assert len(uniform) == 2 * 2 and uniform.layer.isna().all() and len(dist) == len(heads) + len(uniform)
    cka = pd.read_parquet(out / "results" / "cka.parquet")
    assert {("tiny-vit", "tiny-beit")} <= set(zip(cka.model, cka.model_b, strict=True))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"]["tiny-vit"]["analyses_from_cache"] == []
    timings = manifest["models"]["tiny-vit"]["timings"]  # where the pass went: data, the forward, each update
    assert set(timings["pass_parts"]) == {"data", "forward", "attention_distance", "cka"}
    assert timings["pass_parts"]["forward"] > 0 and sum(timings["pass_parts"].values()) <= timings["pass"] + 0.02
    html = (out / "report.html").read_text()
    assert html.count("<img") >= 2 and "data:image/png;base64," in html and "src='http" not in html

    # a second run of the same study is served from the saved states, with identical results
    assert main(["run", str(config), f"output_dir={out}"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"]["tiny-vit"]["analyses_from_cache"] == ["attention_distance", "cka"]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results" / "cka.parquet"), cka)


def test_changing_a_parameter_recomputes_only_that_analysis(config, tmp_path):
    out = tmp_path / "run"
    run_study(load_config(config, [f"output_dir={out}"]))
    with pytest.raises(ConfigError, match="another config"):  # the run directory holds another config's results
        run_study(load_config(config, [f"output_dir={out}", "analyses.cka.views=[cls]"]))
    run_study(load_config(config, [f"output_dir={out}", "analyses.cka.views=[cls]"]), overwrite=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"]["tiny-vit"]["analyses_from_cache"] == ["attention_distance"]
    assert set(pd.read_parquet(out / "results" / "cka.parquet").token_view) == {"cls"}


def test_cached_rerun_loads_no_model(config, tmp_path, monkeypatch):
    import vitscope.study.pool as pool_mod

    out = tmp_path / "run"
    run_study(load_config(config, [f"output_dir={out}"]))
    first = pd.read_parquet(out / "results" / "attention_distance.parquet")

    def no_model(*a, **k):
        raise AssertionError("a finished study must not load any model")

    monkeypatch.setattr(pool_mod, "load_model", no_model)
    run_study(load_config(config, [f"output_dir={out}"]))
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results" / "attention_distance.parquet"), first)


def test_adding_an_analysis_runs_only_the_new_one(config, tmp_path):
    out = tmp_path / "run"
    run_study(load_config(config, [f"output_dir={out}", "~analyses.cka"]))
    run_study(load_config(config, [f"output_dir={out}"]), overwrite=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"]["tiny-beit"]["analyses_from_cache"] == ["attention_distance"]


def test_killed_run_resumes_and_matches_an_uninterrupted_one(config, tmp_path):
    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    run_study(load_config(config, [f"output_dir={ref_dir}", f"cache_dir={tmp_path / 'c1'}"]))
    seen: list[tuple[str, int]] = []

    class Killed(Exception):
        pass

    def kill_at_third(model, b):
        seen.append((model, b))
        if model == "tiny-beit" and b == 1:
            raise Killed

    overrides = [f"output_dir={out}", f"cache_dir={tmp_path / 'c2'}", "save_every=1", "dataset.n_images=24",
                 "batch_size=4"]
    ref_overrides = [f"output_dir={ref_dir}", f"cache_dir={tmp_path / 'c1'}", "dataset.n_images=24", "batch_size=4"]
    run_study(load_config(config, ref_overrides), overwrite=True)
    with pytest.raises(Killed):
        run_study(load_config(config, overrides), on_batch=kill_at_third)
    seen.clear()
    run_study(load_config(config, overrides), on_batch=lambda m, b: seen.append((m, b)))
    # tiny-vit finished before the kill; tiny-beit resumes after its batches 0 and 1 (saved every batch)
    assert [m for m, _ in seen] == ["tiny-beit"] * 4 and seen[0] == ("tiny-beit", 2)
    for name in ("attention_distance", "cka"):
        a = pd.read_parquet(out / "results" / f"{name}.parquet")
        b = pd.read_parquet(ref_dir / "results" / f"{name}.parquet")
        assert a.value.to_numpy() == pytest.approx(b.value.to_numpy(), rel=1e-6, nan_ok=True)


@pytest.mark.parametrize("override,needle", [
    (["batch_size=many"], "batch_size"),
    (["analyses.ckaa={}"], "cka"),
    (["dataset.n_images=0"], "n_images"),
])
def test_invalid_config_names_the_field(config, override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(config, override)


def test_cli_errors_are_one_line(capsys):
    assert main(["taps", "dino-b61"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscope: error: unknown model 'dino-b61'") and "dino-b16" in err


def test_cli_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ["sup-b16", "clip-b16", "dino-b16", "mocov3-b16", "mae-b16", "beit-b16", "simmim-b16"]:
        assert name in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("zoo-")}
    assert "untrained → classification" in rows["zoo-random-ft-cls"]  # named for what it is, as in the report
    assert "contrastive → reconstruction" in rows["zoo-mocov3-ft-rec"]
    assert " none " not in out


def test_cli_taps_prints_shapes(capsys):
    assert main(["taps", "vit_small_patch16_224"]) == 0
    out = capsys.readouterr().out
    assert "block11.attn" in out and "(1, 6, 197, 197)" in out and "(1, 197, 1152)" in out


def test_default_config_is_valid():
    cfg = load_config()
    assert cfg.models and cfg.analyses


def test_imagefolder_dataset_through_a_study(config, tmp_path):
    from PIL import Image

    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    out = tmp_path / "run"
    run_study(load_config(config, [f"output_dir={out}", "dataset.name=imagefolder", f"dataset.root={root}",
                                   "dataset.n_images=6", "~analyses.cka"]))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"]["available"] == 10 and manifest["dataset"]["n_images"] == 6  # an even spread
    dist = pd.read_parquet(out / "results" / "attention_distance.parquet")
    assert set(dist.n_images) == {6}  # an even spread of 6 of the 10 images
    with pytest.raises(ConfigError, match="dataset.root"):
        run_study(load_config(config, [f"output_dir={out}", "dataset.name=imagefolder"]))


def test_every_registered_analysis_has_a_figure_and_a_description():
    from vitscope.analyses import ANALYSES
    from vitscope.report.figures import FIGURES

    assert set(ANALYSES) <= set(FIGURES), f"no figure for {set(ANALYSES) - set(FIGURES)}"
    for name, cls in ANALYSES.items():
        assert cls.description and (cls.__doc__ or "").strip(), name


def test_default_study_lists_every_analysis():
    from vitscope.analyses import ANALYSES

    assert set(load_config().analyses) == {name for name, cls in ANALYSES.items() if cls.in_default_study}


def test_the_default_study_needs_nothing_from_the_network():
    """Every model of `vitscope run`'s default is untrained or has its weights in the package."""
    from vitscope.models.load import package_file, resolve_spec

    for m in load_config().models:
        spec = resolve_spec(m.name)
        if m.pretrained and not m.weights and spec.weights.kind != "none":
            assert spec.weights.kind == "file" and package_file(spec.weights.location).is_file(), m.name
    from vitscope.data.catalog import FORMATS
    from vitscope.study.config import study_datasets

    for d in study_datasets(load_config()).values():  # generated, or shipped in the package: no files of the user's
        assert "root" not in FORMATS[d.name].options and d.root is None, d.name


def test_the_default_study_compares_every_shipped_zoo_model_that_passes_the_bar_and_the_untrained_one():
    import warnings

    from vitscope.models.load import package_file
    from vitscope.models.registry import REGISTRY
    from vitscope.zoo.evaluate import shipped_bar_failures

    shipped = {n for n, s in REGISTRY.items() if n.startswith("zoo-") and s.weights.kind == "file"
               and package_file(s.weights.location).is_file()}
    assert {"zoo-sup", "zoo-random"} <= shipped
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        models = load_config().models
    names = {m.name for m in models}
    pretrained = {m.finetuned_from for m in models if m.finetuned_from}
    failing = {n for n in shipped if shipped_bar_failures(n)}
    base = {n for n in shipped if "-ft-" not in n}  # the zoo itself; of its fine-tuned models only the study's pair
    assert {n for n in names if "-ft-" not in n} == base - failing
    assert pretrained <= names and names <= shipped
    assert failing <= {str(w.message).split(" ")[0] for w in said}  # each one left out is named


@pytest.mark.parametrize("argv, quiet", [(["run"], False), (["-q", "run"], True), (["run", "-q"], True),
                                         (["run", "study.yaml", "batch_size=4", "--quiet"], True)])
def test_quiet_is_taken_before_or_after_the_command(argv, quiet):
    from vitscope.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.quiet is quiet and args.verbose is False


def test_a_result_warning_reaches_the_command_line_as_one_line(capsys, monkeypatch):
    """`vitscope run` on the embedded study warns about each zoo model it leaves out, and the command line prints a
    ResultWarning as one line of its own (other warnings keep Python's format)."""
    import warnings

    import vitscope.zoo.evaluate as ev
    from vitscope.cli import main
    from vitscope.errors import ResultWarning, VitscopeError

    def stop(cfg, overwrite=False, models=None):
        raise VitscopeError("stop here")

    monkeypatch.setattr(ev, "shipped_bar_failures", lambda name: ["a reason"] if name == "zoo-sup" else [])
    monkeypatch.setattr("vitscope.study.run_study", stop)
    saved = warnings.formatwarning
    try:
        with pytest.warns(ResultWarning) as caught:
            assert main(["run"]) == 2
        one = warnings.formatwarning("zoo-x is left out", ResultWarning, "/some/file.py", 89, "cfg = load(...)")
        other = warnings.formatwarning("plain", UserWarning, "/some/file.py", 89, "x = 1")
    finally:
        warnings.formatwarning = saved
    said = [str(w.message) for w in caught if w.category is ResultWarning]
    assert len(said) == 2, said  # the model left out, then how to run it anyway
    assert said[0].startswith("zoo-sup is left out of the default study: ") and "a reason" in said[0]
    assert said[1].startswith("to run it anyway, add zoo-sup to the models of a study of your own")
    assert one == "vitscope: warning: zoo-x is left out\n"
    assert "UserWarning: plain" in other and "file.py:89" in other
    assert "vitscope: error: stop here" in capsys.readouterr().err
