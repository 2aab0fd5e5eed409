"""Issue 41, item 5 (fast refusals): every config mistake of `vitscope run`, and a run directory another run is
writing into, is one sentence before torch is imported (well under the 1.5 s goal on a quiet machine, not the 5-14
s of torch, timm and the analyses; benchmarks/cli_startup.py times them). Each case runs the command in a fresh
process under ``-X importtime``, which lists every module imported: torch must not be among them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from study_fixtures import tiny_study_yaml

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: a regression guard only (a busy two-core machine stretches everything); the real guard is "no torch"
BOUND_S = 10.0


def run_cli(*argv: str) -> tuple[int, str, list[str], float]:
    """``python -X importtime -m vitscope ARGV`` in a fresh process: (exit code, its lines on stderr that are not
    import times, the modules it imported, seconds)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "vitscope", *argv], env=env, text=True,
                       capture_output=True, timeout=120)
    took = time.perf_counter() - t0
    lines = p.stderr.splitlines()
    imported = [line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")]
    said = [line for line in lines if not line.startswith("import time:")]
    return p.returncode, "\n".join(said), imported, took


@pytest.fixture
def study(tmp_path):
    p = tmp_path / "study.yaml"
    p.write_text(tiny_study_yaml() + f"output_dir: {tmp_path / 'out'}\n")
    return p


def refused_before_torch(argv: list[str], *words: str) -> str:
    code, err, imported, took = run_cli("run", *argv)
    assert code == 2, (code, err)
    assert err.startswith("vitscope: error: ") and err.count("\n") == 0 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    heavy = [m for m in imported if re.match(r"(torch|timm|pandas|matplotlib|sklearn|scipy)(\.|$)", m)]
    assert not heavy, f"imported before the refusal: {heavy[:5]}"
    assert took < BOUND_S, f"{took:.1f} s to refuse {argv}"
    return err


def test_an_unknown_analysis_is_refused_before_torch_with_its_close_matches(study):
    refused_before_torch([str(study), "analyses.ckaa={}"], "analyses.ckaa: unknown analysis 'ckaa'",
                         "did you mean cka?")


def test_an_unknown_parameter_of_an_analysis_is_refused_before_torch(study):
    refused_before_torch([str(study), "analyses.cka.viewz=[gap]"], "analyses.cka: analysis 'cka' has no parameter "
                         "'viewz'; did you mean views?")


#: (override, the sentence `vitscope.analyses.base.validate_params` says): a bad value of an analysis parameter
BAD_VALUES = [
    ("analyses.similarity.n_permutations=many",
     "parameter 'n_permutations' of analysis 'similarity' must be an integer, got 'many' (str)"),
    ("analyses.similarity.n_permutations=50",
     "parameter 'n_permutations' of analysis 'similarity' must be 0 or at least 99 (a p-value needs 99 permutations "
     "to reach 0.01); got 50"),
    ("analyses.similarity.alphas=[0.5,2]",
     "every item of parameter 'alphas' of analysis 'similarity' must be between 0 and 1; got 2"),
    ("analyses.attention_rollout.head_fusion=median",
     "parameter 'head_fusion' of analysis 'attention_rollout' must be one of 'mean', 'max', 'min', got 'median' (str)"),
    ("analyses.cka.views=[gap,3]", "parameter 'views' of analysis 'cka' must be a string or a list of strings, "
     "got ['gap', 3] (list)"),
]


@pytest.mark.parametrize("override,sentence", BAD_VALUES, ids=[o.split("=")[0] for o, _ in BAD_VALUES])
def test_a_bad_value_of_an_analysis_parameter_is_refused_before_torch(study, override, sentence):
    name = override.split(".")[1]
    err = refused_before_torch([str(study), override], f"analyses.{name}: {sentence}")
    assert err == f"vitscope: error: analyses.{name}: {sentence}", err


def test_the_snapshot_refuses_parameter_values_as_the_analyses_do(monkeypatch):
    import yaml

    import vitscope.analyses_listing as listing
    from vitscope.analyses import get_analysis
    from vitscope.analyses.base import validate_params
    from vitscope.errors import ConfigError

    monkeypatch.setattr(listing, "_live", lambda: None)  # as `vitscope run` before torch: the snapshot's checks
    for override, sentence in BAD_VALUES:
        key, value = override.split("=")
        _, name, param = key.split(".")
        params = {param: yaml.safe_load(value), "dataset": "x"}
        with pytest.raises(ConfigError) as light:
            listing.check_study_analysis(name, params)
        with pytest.raises(ConfigError) as full:
            validate_params(get_analysis(name), params)
        assert str(light.value) == str(full.value) == sentence, override
    listing.check_study_analysis("similarity", {"n_permutations": 0, "alphas": [0.5, 1], "dataset": "x"})
    listing.check_study_analysis("stir", {"anything": "at all"})  # open-ended: the analysis judges it


def test_an_unknown_model_is_refused_before_torch_with_registry_and_timm_matches(study):
    refused_before_torch([str(study), "models.0.name=zoo-dnio"], "models[0] (tiny): unknown model 'zoo-dnio'",
                         "did you mean zoo-dino")
    refused_before_torch([str(study), "models.0.name=vit_smal_patch16_224"], "unknown model 'vit_smal_patch16_224'",
                         "did you mean vit_small_patch16_224")


def test_a_batch_size_of_zero_is_refused_before_torch(study):
    refused_before_torch([str(study), "batch_size=0"], "batch_size must be at least 1; got 0")


def test_a_missing_or_empty_data_folder_is_refused_before_torch(study, tmp_path):
    missing = tmp_path / "nowhere"
    refused_before_torch([str(study), "dataset.name=imagefolder", f"dataset.root={missing}"],
                         f"dataset.root '{missing}' does not exist", "imagefolder")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused_before_torch([str(study), "dataset.name=imagefolder", f"dataset.root={empty}"],
                         f"dataset.root '{empty}' is an empty folder")


def test_a_misspelt_dataset_format_is_refused_before_torch(study):
    refused_before_torch([str(study), "dataset.name=imagefolderr"], "dataset.name: unknown dataset format "
                         "'imagefolderr'; did you mean imagefolder")


def test_a_run_directory_another_run_is_writing_is_refused_before_torch(study, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom vitscope.study import rundir\nlock = rundir.hold(sys.argv[1])\n"
        "print('held', flush=True)\ntime.sleep(120)\n"), str(out)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert holder.stdout.readline().strip() == "held"
        refused_before_torch([str(study), f"output_dir={out}"], "another vitscope run is writing into")
    finally:
        holder.kill()
        holder.wait()
    assert not (out / "results").exists()


def test_the_embedded_study_refuses_before_torch_too(tmp_path):
    refused_before_torch(["batch_size=0", f"output_dir={tmp_path / 'out'}"], "batch_size must be at least 1")


# -- the light checks say what the full ones say -------------------------------------------------------------

def test_the_light_model_check_knows_every_timm_name_and_says_what_loading_says():
    import timm
    from timm.models import _registry

    from vitscope.errors import VitscopeError
    from vitscope.models.load import resolve_spec
    from vitscope.models.names import check_name, timm_models

    assert timm_models() == timm.list_models()  # read off the sources, in timm's order
    for name in [*timm.list_models(), *_registry._deprecated_models, "vit_small_patch16_224.augreg_in21k"]:
        check_name(name)  # known: never refused here
    for typo in ("zoo-dnio", "vit_smal_patch16_224", "dieno-s16"):
        with pytest.raises(VitscopeError) as light:
            check_name(typo)
        with pytest.raises(VitscopeError) as full:
            resolve_spec(typo)
        assert str(light.value) == str(full.value)
    for left_to_loading in ("facebook/dinov2-small", "missing.pth", "zoo-dino", "hf-hub:timm/x"):
        check_name(left_to_loading)


def test_the_snapshot_refuses_parameter_names_as_the_analyses_do():
    from vitscope.analyses import get_analysis
    from vitscope.analyses.base import validate_params
    from vitscope.analyses_listing import check_parameter_names, snapshot
    from vitscope.errors import ConfigError

    cases = [("cka", {"viewz": ["gap"]}), ("similarity", {"n_bootstrap": 10}), ("shape_bias", {"probe_tunee": False}),
             ("semantics", {"dataset": "x", "train_dataset": "y", "kss": [1]})]
    for name, params in cases:
        info = snapshot([name])[0]
        with pytest.raises(ConfigError) as light:
            check_parameter_names(name, params, info.accepts, dict(info.replaced))
        with pytest.raises(ConfigError) as full:
            validate_params(get_analysis(name), params)
        assert str(light.value) == str(full.value), name
    for name, params in [("shape_bias", {"probe_tune": False, "train_dataset": "s"}), ("stir", {"anything": 1})]:
        info = snapshot([name])[0]
        check_parameter_names(name, params, info.accepts, dict(info.replaced))  # inherited, open-ended: taken


def test_the_lock_check_creates_nothing_and_leaves_the_directory_free(tmp_path):
    from filelock import FileLock

    from vitscope.study import rundir

    out = tmp_path / "out"
    out.mkdir()
    rundir.check_free(out)
    assert list(out.iterdir()) == []
    rundir.hold(out).release()
    rundir.check_free(out)
    with FileLock(str(out / rundir.LOCK), timeout=0):
        pass


@pytest.mark.parametrize("override,words", [
    ("dtype=fp8", ("unknown dtype 'fp8'", "Choose one of fp32")),
    ("device=gpu0", ("device 'gpu0' is not a device name", "did you mean cuda?")),
    ("device=xla", ("vitscope runs studies on cpu, cuda, mps", "not on xla")),
])
def test_a_wrong_dtype_or_device_is_refused_before_torch(study, override, words):
    refused_before_torch([str(study), override], *words)


def test_a_random_init_beside_a_weights_file_is_refused_before_torch(study, tmp_path):
    weights = tmp_path / "w.pth"
    weights.write_bytes(b"not read")
    refused_before_torch([str(study), f"models.0.weights={weights}", "models.0.pretrained=false"],
                         "is a weights file, and pretrained: false asks for a random init")


def test_an_analysis_naming_a_dataset_the_study_lacks_is_refused_before_torch(study):
    refused_before_torch([str(study), "analyses.cka.dataset=shapez"],
                         "analyses.cka.dataset: no dataset named 'shapez' in the study")
    refused_before_torch([str(study), "analyses.cka.dataset=[1]"], "must name one of the study's datasets")


def test_an_analysis_whose_data_no_dataset_provides_is_refused_before_torch(study):
    """The planner's matching (`vitscope.study.slots`) from the shipped listing: propagation needs videos with
    objects, which generated shapes do not provide; a `*_dataset` key that names no input."""
    refused_before_torch([str(study), "analyses.propagation={}"],
                         "analyses.propagation needs a dataset with objects, videos", "synthetic-videos")
    refused_before_torch([str(study), "analyses.cka.images_dataset=x"],
                         "cka has no such input (its only input: dataset)")



#: issue 42's bad input: (arguments after the study, words of the one sentence)
BAD_RUNS = [
    (["num_workers=-1"], ("num_workers must be a whole number of processes, 0 or more",)),
    (["num_workers=two"], ("num_workers must be an integer (or null), not 'two'",)),
    (["dtype=fp9"], ("unknown dtype 'fp9'",)),
    (["--models", "0/2"], ("--models 0/2", "between 1 and 2")),
    (["--models", "a/b"], ("--models 'a/b' is not K/N",)),
    (["--models", "3/2"], ("--models 3/2", "between 1 and 2")),
    (["--models", "2/2"], ("slice 2 of 2 holds none",)),  # the study has one model
]


@pytest.mark.parametrize("argv, words", BAD_RUNS, ids=[" ".join(a) for a, _ in BAD_RUNS])
def test_bad_workers_dtype_and_slices_are_refused_before_torch(study, argv, words):
    refused_before_torch([str(study), *argv], *words)


@pytest.mark.skipif(Path("/dev/nvidia0").exists() or Path("/dev/kfd").exists() or Path("/dev/dxg").exists()
                    or Path("/proc/driver/nvidia").exists(), reason="this machine has a GPU driver: torch decides")
def test_cuda_on_a_machine_without_a_gpu_driver_is_refused_before_torch(study):
    refused_before_torch([str(study), "device=cuda"], "device 'cuda' was asked for", "set device=cpu")


@pytest.mark.parametrize("model, analysis, words", [
    ("siglip2-b16", "stir={view: cls}", "analyses.stir.view: models[0] (tiny) has no CLS token"),
    ("ijepa-h14", "corruptions={token_view: cls}", "analyses.corruptions.token_view: models[0] (tiny)"),
    ("vit_small_patch16_224", "similarity={view: cls}", "models[0] (tiny) has no CLS token"),  # class_token: false
])
def test_the_cls_view_of_a_model_known_to_have_none_is_refused_before_torch(tmp_path, model, analysis, words):
    """A registry entry whose shipped taps listing has no CLS token, or a model built with class_token false, asked
    for 'cls' as an analysis's one token view: refused at config time, naming the views it gives."""
    text = tiny_study_yaml().replace("name: vit_small_patch16_224", f"name: {model}")
    if model == "vit_small_patch16_224":
        text = text.replace("kwargs: {", "kwargs: {class_token: false, global_pool: avg, ")
    p = tmp_path / "study.yaml"
    p.write_text(text + f"output_dir: {tmp_path / 'out'}\n")
    err = refused_before_torch([str(p), f"analyses.{analysis}"], words,
                               "the token views it gives are 'spatial', 'gap', 'gap_spatial'")
    assert "label: tiny" in text and err


def test_the_cls_view_of_a_model_with_one_passes_the_config_check(tmp_path):
    from vitscope.study.config import load_config

    p = tmp_path / "study.yaml"
    p.write_text(tiny_study_yaml().replace("name: vit_small_patch16_224", "name: dinov3-s16") +
                 f"output_dir: {tmp_path / 'out'}\n")
    # DINOv3: a CLS token and 4 storage tokens
    cfg = load_config(p, ["analyses.corruptions={corruptions: noise, token_view: cls}"])
    assert cfg.analyses["corruptions"]["token_view"] == "cls"
