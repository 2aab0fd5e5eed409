"""Issue 32 (reliability, round 2): counts validated before any model loads, checkpoint lists in natural order,
weights files in the cache key, nothing vitscope did not write deleted, one writer per run directory."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Sequence

import numpy as np
import pytest
from study_fixtures import TINY_STUDY_KW, one_line_error, tiny_study_yaml

import vitscope.study.pool as pool_mod
from vitscope.analyses import ANALYSES
from vitscope.analyses.base import analysis_parameters, validate_params
from vitscope.bounds import Range, ranges_of
from vitscope.cli import main
from vitscope.errors import ConfigError

YAML = tiny_study_yaml(depth=2)


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "study.yaml"
    p.write_text(YAML)
    return p




# -- a. every count parameter has a declared range, checked at config time --------------------------------

def _ranges(tp, listed=False):
    """(range, inside a list) for every range an annotation declares, through unions and sequences."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        yield from ((r, listed) for r in ranges_of(tp))
        return
    for arg in typing.get_args(tp):
        yield from _ranges(arg, listed or origin in (list, tuple, Sequence))


def _declared() -> list[tuple[str, str, Range, bool]]:
    """(analysis, parameter, range, in a list) for every range an analysis declares."""
    return [(name, pname, r, listed) for name, cls in ANALYSES.items()
            for pname, p in analysis_parameters(cls).items() for r, listed in _ranges(p.annotation)]


def test_the_count_parameters_the_issue_names_declare_a_range():
    declared = {(a, p) for a, p, _, _ in _declared()}
    for needed in [("semantics", "ks"), ("semantics", "test_every"), ("semantics", "max_images"),
                   ("semantics", "kmeans_n_init"), ("band_noise", "n_bands"), ("band_noise", "test_every"),
                   ("cka", "batch_size"), ("residual_cka", "batch_size"), ("svd_volume", "k"),
                   ("stir", "iterations"), ("propagation", "n_last_frames")]:
        assert needed in declared, needed


@pytest.mark.parametrize("analysis,param,rng,listed", _declared(), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_a_value_outside_a_declared_range_is_one_sentence_and_the_default_passes(analysis, param, rng, listed):
    cls = ANALYSES[analysis]
    default = analysis_parameters(cls)[param].default
    if default is not inspect.Parameter.empty and default is not None:
        validate_params(cls, {param: list(default) if isinstance(default, tuple) else default})
    is_int = isinstance(default, int) or (listed and default and isinstance(default[0], int))
    outside = []
    if rng.lo is not None:
        outside.append(rng.lo - (1 if is_int else 0.5) if not rng.open_lo else rng.lo)
    if rng.hi is not None:
        outside.append(rng.hi + 1)
    if not is_int:
        outside.append(float("nan"))
    for bad in outside:
        with pytest.raises(ConfigError, match=rf"{param}.*must be.*got"):
            validate_params(cls, {param: [bad] if listed else bad})


@pytest.mark.parametrize("overrides,needle", [
    (["analyses.semantics={ks: [0, 10]}"], "'ks' of analysis 'semantics' must be at least 1; got 0"),
    (["analyses.semantics={test_every: 1}"], "'test_every' of analysis 'semantics' must be at least 2"),
    (["analyses.cka.batch_size=1"], "'batch_size' of analysis 'cka' must be at least"),
    (["analyses.band_noise={n_bands: 0}"], "'n_bands' of analysis 'band_noise' must be between 1 and"),
    (["analyses.band_noise={rms: .inf}"], "'rms' of analysis 'band_noise' must be a finite number"),
    (["dataset.options.n_frames=0", "dataset.name=synthetic-videos"], "dataset.options.n_frames must be between 1 and"),
    (["dataset.n_images=0"], "dataset.n_images must be at least 1"),
    (["batch_size=0"], "batch_size must be at least 1"),
])
def test_bad_counts_are_one_line_before_any_model_loads(config, tmp_path, capsys, no_model, overrides, needle):
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", *overrides])
    assert needle in err


# -- b. a checkpoint-list directory in natural order, and said ----------------------------------------------

def test_a_checkpoint_directory_is_read_in_natural_order_and_says_which_epoch_each_file_became(tmp_path):
    import re

    from vitscope.errors import ResultWarning
    from vitscope.study import load_config

    run = tmp_path / "ft" / "checkpoints"
    run.mkdir(parents=True)
    steps = [100, 2, 10]
    for s in steps:
        (run / f"step{s}.pt").write_bytes(b"")
    study = tmp_path / "study.yaml"
    study.write_text(YAML.replace("models:\n", f"models:\n  - {{name: vit_small_patch16_224, label: ft, "
                                               f"checkpoints: {tmp_path / 'ft'}, kwargs: {TINY_STUDY_KW}}}\n", 1))
    with pytest.warns(ResultWarning, match="epoch") as caught:
        cfg = load_config(study)
    by_step = {int(re.search(r"step(\d+)", m.weights).group(1)): m.epoch for m in cfg.models if m.epoch is not None}
    assert sorted(by_step) == sorted(steps)
    assert [by_step[s] for s in sorted(steps)] == sorted(by_step.values())  # more steps, later epoch
    said = " ".join(str(w.message) for w in caught)
    for s, e in by_step.items():
        assert f"step{s}.pt -> ft@{e}" in said


# -- c. a file is weights: random init takes none; the cache key follows the file's content ----------------

def _weights_file(path, seed=0, n=(5 << 20) // 2):
    import numpy as np

    path.write_bytes(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())
    return path


def test_pretrained_false_beside_a_weights_file_is_one_line(config, tmp_path, capsys, no_model):
    import vitscope as vs

    f = _weights_file(tmp_path / "trained.pth")
    for model in ([f"models.0.name={f}"], [f"models.0.weights={f}"]):
        err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", *model])
        assert "random init, which takes no file" in err and str(f) in err
    with pytest.raises(vs.VitscopeError, match="takes no file"):
        vs.load_model(str(f), pretrained=False)


@pytest.mark.parametrize("as_name", [True, False])
def test_a_replaced_weights_file_changes_the_cache_key_even_with_its_size_and_mtime_kept(tmp_path, as_name):
    import os

    from vitscope.study.config import ModelConfig
    from vitscope.study.run import _model_key

    f = _weights_file(tmp_path / "w.pth")
    mc = (ModelConfig(name=str(f)) if as_name else
          ModelConfig(name="vit_small_patch16_224", weights=str(f), kwargs={"img_size": 32, "patch_size": 8}))
    before = _model_key(mc)[1]
    assert _model_key(mc)[1] == before  # the key is a function of the file
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # other weights, same size; copied with the old mtime (cp -p, rsync -t)
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert _model_key(mc)[1] != before


# -- d. nothing vitscope did not write is deleted or replaced ------------------------------------------------

def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_a_directory_holding_a_users_files_is_refused_and_overwrite_keeps_them(config, tmp_path, capsys):
    from vitscope.study import rundir

    out = tmp_path / "out"
    (out / "results").mkdir(parents=True)
    (out / "results" / "mine.csv").write_text("a,b\n1,2\n")
    (out / ".results-123").mkdir()
    (out / ".results-123" / "notes.txt").write_text("keep")
    users = _files(out)
    err = one_line_error(capsys, ["run", str(config), f"output_dir={out}"])
    assert "vitscope did not write" in err and "results/mine.csv" in err and "--overwrite" in err
    assert {k: v for k, v in _files(out).items() if k != rundir.LOCK} == users  # nothing written but the lock
    for _ in range(2):  # the first run replaces nothing of the user's; the second replaces its own tables only
        assert main(["run", str(config), f"output_dir={out}", "--overwrite"]) == 0
        now = _files(out)
        assert {k: now[k] for k in users} == users
        assert any(k.startswith("results/") and k.endswith(".parquet") for k in now)
    # a rerun of the same config without --overwrite is still refused: the user's files are there
    assert "vitscope did not write" in one_line_error(capsys, ["run", str(config), f"output_dir={out}"])


def test_a_vitscope_run_directory_is_rerun_and_a_killed_swap_loses_nothing(config, tmp_path):
    from vitscope.study import rundir

    out = tmp_path / "out"
    assert main(["run", str(config), f"output_dir={out}"]) == 0
    assert rundir.foreign_entries(out) == []
    tables = sorted(p.name for p in (out / "results").glob("*.parquet"))
    assert tables and set(tables) <= set(rundir.read_manifest(out)["results_files"])
    # a run killed between moving results/ aside and putting the fresh one in place, with a user's file inside
    (out / "results" / "mine.csv").write_text("x")
    old = out / f"{rundir._OLD}1"
    (out / "results").rename(old)
    assert main(["run", str(config), f"output_dir={out}", "--overwrite"]) == 0
    assert (out / "results" / "mine.csv").read_text() == "x"
    assert not old.exists()
    assert sorted(p.name for p in (out / "results").glob("*.parquet")) == tables


def test_a_manifest_marks_a_new_run_directory_as_vitscopes(config, tmp_path, monkeypatch):
    from vitscope.study import rundir

    out = tmp_path / "out"

    def die(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(pool_mod, "load_model", die)
    with pytest.raises(RuntimeError):
        main(["run", str(config), f"output_dir={out}"])
    assert rundir.read_manifest(out) and rundir.foreign_entries(out) == []


# -- e. one writer per run directory --------------------------------------------------------------------------

def test_a_second_run_into_the_same_directory_is_refused_while_the_first_holds_it(config, tmp_path, capsys):
    import subprocess
    import sys

    from filelock import FileLock

    from vitscope.study import rundir

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom vitscope.study import rundir\nlock = rundir.hold(sys.argv[1])\n"
        "print('held', flush=True)\ntime.sleep(60)\n"), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        other = tmp_path / "other.yaml"  # another config: the refusal does not depend on it
        other.write_text(YAML.replace("batch_size: 4\n", "batch_size: 8\n"))
        for study in (config, other):
            err = one_line_error(capsys, ["run", str(study), f"output_dir={out}"])
            assert "another vitscope run is writing into" in err
        assert not (out / "results").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["run", str(config), f"output_dir={out}"]) == 0  # the lock dies with its process
    with FileLock(str(out / rundir.LOCK), timeout=0):  # and a finished run leaves it free
        pass


def test_zoo_train_refuses_to_replace_a_card_or_log_it_did_not_resume(tmp_path, capsys):
    from vitscope.zoo.train import CARD_FILE, LOG_FILE

    for name in (CARD_FILE, LOG_FILE):
        out = tmp_path / name.replace(".", "-")
        out.mkdir()
        (out / name).write_text("a user's file")
        args = ["zoo", "train", "--objective", "supervised", "--data", "synthetic", "--synthetic-n", "64", "32",
                "--budget-views", "32", "--batch-size", "16", "--knn-train", "24", "--knn-test", "12",
                "--arch", "img_size=16", "embed_dim=32", "depth=2", "num_heads=2", "--out", str(out),
                "--no-progress", "--threads", "1"]
        for extra in ([], ["--resume"]):  # --resume with no training state to resume: the same
            err = one_line_error(capsys, [*args, *extra])
            assert name in err and "another output directory" in err
        assert (out / name).read_text() == "a user's file"


# -- g. COCO annotation values checked before pycocotools; files outside the dataset refused -----------------

def _coco_with(tmp_path, change):
    import json

    from test_data_loaders import _coco_fixture

    path, _ = _coco_fixture(tmp_path)
    ann = json.loads(path.read_text())
    change(ann)
    path.write_text(json.dumps(ann))  # NaN and Infinity as Python's json writes them
    return path


def _polygon(value):
    def change(ann):
        ann["annotations"][0]["segmentation"] = [[10, 5, value, 5, 30, 20, 10, 20]]
    return change


@pytest.mark.parametrize("change,needle", [
    (_polygon(1e9), "outside the 60x40 image"),
    (_polygon(1e30), "outside the 60x40 image"),
    (_polygon(-1e9), "outside the 60x40 image"),
    (_polygon(float("nan")), "finite numbers"),
    (_polygon(float("inf")), "finite numbers"),
    (lambda a: a["annotations"][0].update(segmentation=[[10, 5]]), "at least 3 points"),
    (lambda a: a["annotations"][1]["segmentation"].update(size=[4, 4]), "RLE size"),
    (lambda a: a["annotations"][2]["segmentation"].update(counts=[10 ** 9]), "add up to"),
])
def test_coco_annotation_values_are_one_sentence_naming_file_and_annotation(tmp_path, change, needle):
    from vitscope.data.formats.coco import CocoInstances
    from vitscope.errors import InputError

    path = _coco_with(tmp_path, change)
    with pytest.raises(InputError, match=needle) as e:
        CocoInstances(tmp_path / "images", path)
    assert str(e.value).startswith("instances.json: annotation ") and "\n" not in str(e.value)


def test_coco_values_at_the_edge_of_the_stated_bound_load(tmp_path):
    from vitscope.data.formats.coco import COORD_MARGIN, CocoInstances

    w = 60  # the fixture's image width (its json says so)
    path = _coco_with(tmp_path, _polygon((1 + COORD_MARGIN) * w))  # a polygon past the border, within the bound
    assert CocoInstances(tmp_path / "images", path)[0].objects.any()


@pytest.mark.parametrize("name", ["../outside.jpg", "ABSOLUTE"])
def test_annotations_naming_files_outside_the_dataset_are_refused(tmp_path, name):
    from vitscope.data.formats.coco import CocoInstances
    from vitscope.errors import InputError

    outside = tmp_path / "outside.jpg"
    outside.write_bytes(b"not read")
    name = str(outside) if name == "ABSOLUTE" else name
    path = _coco_with(tmp_path, lambda a: a["images"][0].update(file_name=name))
    with pytest.raises(InputError, match="outside the folder"):
        CocoInstances(tmp_path / "images", path)


def test_spair_names_and_transformers_shard_lists_outside_their_folder_are_refused(tmp_path):
    import json

    from test_data_loaders import _spair

    from vitscope.data.formats.spair import SPair71k
    from vitscope.errors import InputError
    from vitscope.models.hf import weight_files

    _spair(tmp_path / "spair")
    f = sorted((tmp_path / "spair" / "PairAnnotation" / "test").glob("*.json"))[0]
    d = json.loads(f.read_text())
    (tmp_path / "secret.jpg").write_bytes(b"x")
    f.write_text(json.dumps({**d, "src_imname": "../../../secret.jpg"}))
    with pytest.raises(InputError, match=rf"{re.escape(f.name)}: src_imname .*outside the folder"):
        SPair71k(tmp_path / "spair", split="test")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": str(tmp_path / "x.bin")}}))
    with pytest.raises(InputError, match="outside the folder"):
        weight_files(hf)


# -- i. config hygiene ------------------------------------------------------------------------------------------

def test_resolvers_are_off_in_the_yaml_and_in_overrides(config, tmp_path, capsys, no_model, monkeypatch):
    secret = "vitscope-test-secret-value"
    monkeypatch.setenv("VITSCOPE_TEST_SECRET", secret)
    bad = tmp_path / "env.yaml"
    bad.write_text(YAML.replace("label: tiny", "label: ${oc.env:VITSCOPE_TEST_SECRET}"))
    for argv in (["run", str(bad)], ["run", str(config), "models.0.label=${oc.env:VITSCOPE_TEST_SECRET}"]):
        err = one_line_error(capsys, [*argv, f"output_dir={tmp_path / 'out'}"])
        assert "resolver" in err and "models.0.label" in err and secret not in err
    assert not any(secret in p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())


def test_a_binary_file_as_yaml_is_one_sentence(tmp_path, capsys, no_model):
    import numpy as np

    binary = tmp_path / "model.yaml"
    binary.write_bytes(np.random.default_rng(0).integers(128, 256, 512, dtype=np.uint8).tobytes())
    err = one_line_error(capsys, ["run", str(binary)])
    assert "model.yaml is not a text (YAML) file" in err


def test_overrides_after_a_flag_are_overrides(config, tmp_path, capsys, no_model):
    err = one_line_error(capsys, ["run", str(config), "-q", f"output_dir={tmp_path / 'out'}", "batch_size=0"])
    assert "batch_size must be at least 1" in err  # reached the config: the override was read
    err = one_line_error(capsys, ["run", str(config), "--overwrite", "analyses.semantics={ks: [0]}"])
    assert "'ks' of analysis 'semantics'" in err
    with pytest.raises(SystemExit) as e:  # a stray word is still argparse's error
        main(["run", str(config), "-q", "stray"])
    assert e.value.code == 2


# -- j. the remaining tracebacks: one sentence, exit code 2, no model loaded ------------------------------------

def _image_folder(root):
    import numpy as np
    from PIL import Image

    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / cls / f"{i}.png")
    return root


def _run_dir_with(tmp_path, table_bytes=None):
    import pandas as pd

    run = tmp_path / "rundir"
    (run / "results").mkdir(parents=True)
    if table_bytes is None:
        pd.DataFrame({"model": ["m"], "value": [1.0]}).to_parquet(run / "results" / "cka.parquet")
    else:
        (run / "results" / "cka.parquet").write_bytes(table_bytes)
    return run


ZOO_TRAIN = ["zoo", "train", "--objective", "dino", "--data", "synthetic", "--no-progress"]

POOR = [  # (name, argv built from tmp_path and the study config, what the sentence says)
    ("unknown dataset option", lambda t, c: ["run", str(c), f"output_dir={t / 'o'}", "dataset.options.bogus=1"],
     "takes no option 'bogus'"),
    ("output_dir is the image folder", lambda t, c: ["run", str(c), f"output_dir={_image_folder(t / 'imgs')}"],
     "vitscope did not write"),
    ("report of a malformed table", lambda t, c: ["report", str(_run_dir_with(t, b"PAR1 not a table"))],
     "is not a table vitscope wrote"),
    ("report of a malformed manifest", lambda t, c: ["report", str(_bad_manifest(_run_dir_with(t)))],
     "is not a vitscope manifest"),
    ("--export to a file", lambda t, c: ["report", str(_run_dir_with(t)), "--export", str(_a_file(t))],
     "is a file; give a directory"),
    ("zoo train --arch of the wrong type", lambda t, c: [*ZOO_TRAIN, "--arch", "depth=x", "--out", str(t / "z")],
     "--arch depth must be int"),
    ("zoo evaluate of no run", lambda t, c: ["zoo", "evaluate", str(t / "none")], "has no card.json"),
    ("zoo findings of no run", lambda t, c: ["zoo", "findings", str(t / "none")], "has no manifest.json"),
    ("a tiny checkpoint asking for gigabytes", lambda t, c: ["run", str(c), f"output_dir={t / 'o'}",
                                                            f"models.0.name={_hostile_pth(t)}",
                                                            "models.0.pretrained=true"],
     "more than saved tensors ever need"),
    ("a transformers config wider than its weights", lambda t, c: ["run", str(c), f"output_dir={t / 'o'}",
                                                                  f"models.0.name={_hf_dir(t)}",
                                                                  "models.0.pretrained=true"],
     "hidden_size is 100000 in the config and 64 in the weights"),
]


def _bad_manifest(run):
    (run / "manifest.json").write_bytes(b"\xff\xfe not json")
    return run


def _a_file(t):
    (t / "figs.pdf").write_text("x")
    return t / "figs.pdf"


@pytest.mark.parametrize("name,argv,needle", POOR, ids=[p[0] for p in POOR])
def test_poor_cases_are_one_sentence_exit_2_no_model(config, tmp_path, capsys, no_model, name, argv, needle):
    err = one_line_error(capsys, argv(tmp_path, config))
    assert needle in err, err


def test_a_data_only_cache_entry_with_wrong_fields_is_recomputed_not_a_traceback(config, tmp_path, caplog):
    import pandas as pd
    import torch

    from vitscope.study.cache import FORMAT

    cache = tmp_path / "cache"
    args = ["run", str(config), f"output_dir={tmp_path / 'a'}", f"cache_dir={cache}"]
    assert main(args) == 0
    ref = pd.read_parquet(tmp_path / "a" / "results" / "cka.parquet")
    entries = [p for p in cache.rglob("*.pt") if ".part-" not in p.name]
    assert entries
    for p in entries:  # data only, readable, but not what the analysis wrote
        torch.save({"format": FORMAT, "finished": True, "info": {"bogus": 1}, "state": [1, 2]}, p)
    assert main(["run", str(config), f"output_dir={tmp_path / 'b'}", f"cache_dir={cache}"]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "b" / "results" / "cka.parquet"), ref)
    assert "it is recomputed" in caplog.text


# -- Deliver 6: sizes no machine holds refused before anything is allocated -------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (["dataset.n_images=1000000000"], "dataset.n_images must be between 1 and"),
    (["dataset.size=100000"], "dataset.size must be between 1 and"),
    (["models.0.kwargs.img_size=100000"], "models[0].kwargs: img_size must be between 1 and"),
    (["models.0.kwargs.depth=1000000000"], "models[0].kwargs: depth must be between 1 and"),
    (["analyses.semantics={kmeans_n_init: 1000000}"], "'kmeans_n_init' of analysis 'semantics' must be between"),
    (["analyses.band_noise={n_bands: 100000}"], "'n_bands' of analysis 'band_noise' must be between"),
])
def test_absurd_resource_requests_are_refused_before_anything_is_allocated(config, tmp_path, capsys, no_model,
                                                                          overrides, needle):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", *overrides])
    assert needle in err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing big allocated


def test_a_transformers_config_of_absurd_size_is_refused_before_timm_builds_it(tmp_path, monkeypatch):
    import vitscope.models.load as load
    from vitscope.bounds import MAX_WIDTH
    from vitscope.errors import ConfigError

    def no_build(*a, **k):
        raise AssertionError("timm must not be asked to build it")

    monkeypatch.setattr(load.timm, "create_model", no_build)
    with pytest.raises(ConfigError, match="embed_dim must be between"):
        load._create("vit_small_patch16_224", {"embed_dim": MAX_WIDTH + 1}, 0)


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.update(arch="hf-hub:someone/model"), "not a timm architecture"),
    (lambda d: d.pop("preprocessing"), "vitscope.spec metadata is not what save_checkpoint writes"),
    (lambda d: d.update(unexpected=1), "vitscope.spec metadata is not what save_checkpoint writes"),
])
def test_a_checkpoints_spec_metadata_is_one_sentence_and_never_a_hub_lookup(tmp_path, monkeypatch, change, needle):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import vitscope as vs
    import vitscope.models.load as load
    from vitscope.models import save_checkpoint

    vm = vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48, depth=2,
                       num_heads=3)
    path = save_checkpoint(vm.model, tmp_path / "m.safetensors", vm.spec)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    spec = json.loads(meta["vitscope.spec"])
    change(spec)
    save_file(load_file(str(path)), str(path), metadata={**meta, "vitscope.spec": json.dumps(spec)})
    monkeypatch.setattr(load.timm, "create_model", lambda *a, **k: pytest.fail("no model may be built"))
    with pytest.raises(vs.VitscopeError, match=needle) as e:
        vs.load_model(str(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("labels,images,needle", [
    (np.arange(4) + 98, np.zeros((20, 4, 4, 3), np.uint8), "must hold class ids 0..99"),  # above CIFAR-100's
    (np.arange(4) - 1, np.zeros((20, 4, 4, 3), np.uint8), "must hold class ids 0..9"),  # a negative id
    (np.zeros(4, np.int64), np.array([None] * 20, dtype=object), "not a plain .npy array"),
])
def test_cifar10c_arrays_that_are_not_plain_numbers_or_labels_out_of_range_are_one_sentence(tmp_path, labels, images,
                                                                                             needle):
    from vitscope.data.formats.robustness import CorruptedFolder
    from vitscope.errors import InputError

    np.save(tmp_path / "labels.npy", labels)
    np.save(tmp_path / "fog.npy", images, allow_pickle=True)
    with pytest.raises(InputError, match=needle):
        CorruptedFolder(tmp_path)


# -- Unverified 1: a tiny pickle that asks an allowed global for gigabytes -------------------------------------

HOSTILE = r'''
import collections, io, pickle, struct, sys, zipfile
import torch

class Storage:  # a persistent id: (storage class, key, numel)
    def __init__(self, cls, numel):
        self.cls, self.numel = cls, numel

class Call:  # fn(*args), pickled as GLOBAL fn + REDUCE: what torch.save writes for a tensor
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
    def __reduce__(self):
        return self.fn, self.args

class Pickler(pickle.Pickler):
    def __init__(self, f, legacy):
        super().__init__(f, protocol=2)
        self.legacy = legacy
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            pid = ("storage", obj.cls, "0", "cpu", obj.numel)
            return pid + (None,) if self.legacy else pid
        return None

def tensor(storage, size, stride):
    return Call(torch._utils._rebuild_tensor_v2, storage, 0, size, stride, False, collections.OrderedDict())

def payload(kind):
    """(legacy format?, the state dict): 16 stored bytes each time, asking for 8 GiB or more."""
    floats = Storage(torch.FloatStorage, 4)
    if kind == "legacy storage of 2**31 floats":
        return True, {"w": tensor(Storage(torch.FloatStorage, 2 ** 31), (4,), (1,))}
    if kind == "legacy tensor of 2**31 x 4 floats over 4":
        return True, {"w": tensor(floats, (2 ** 31, 4), (4, 1))}
    if kind == "quantized tensor of 2**33 bytes":
        q = Call(torch._utils._rebuild_qtensor, Storage(torch.QInt8Storage, 16), 0, (2 ** 33,), (0,),
                 (torch.per_tensor_affine, 1.0, 0), False, collections.OrderedDict())
        return False, {"w": q}
    if kind == "a stride-0 view copied to 2**30 doubles":
        view = tensor(floats, (2 ** 30,), (0,))
        return False, {"w": Call(torch._utils._rebuild_device_tensor_from_cpu_tensor, view, torch.float64, "cpu",
                                 False)}
    raise ValueError(kind)

def write(path, kind):
    legacy, obj = payload(kind)
    main = io.BytesIO()
    Pickler(main, legacy).dump(obj)
    if legacy:
        from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION
        info = dict(protocol_version=PROTOCOL_VERSION, little_endian=True, type_sizes=dict(short=2, int=4, long=4))
        head = b"".join(pickle.dumps(x, 2) for x in (MAGIC_NUMBER, PROTOCOL_VERSION, info))
        data = head + main.getvalue() + pickle.dumps(["0"], 2) + struct.pack("<q", 4) + bytes(16)
        open(path, "wb").write(data)
        return
    torch.save({"w": torch.zeros(4)}, path)  # torch's own archive, its pickle replaced
    with zipfile.ZipFile(path) as z:
        records = {n: z.read(n) for n in z.namelist()}
    records[next(n for n in records if n.endswith("data.pkl"))] = main.getvalue()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, d in records.items():
            z.writestr(n, d)
'''

HOSTILE_KINDS = ["legacy storage of 2**31 floats", "legacy tensor of 2**31 x 4 floats over 4",
                 "quantized tensor of 2**33 bytes", "a stride-0 view copied to 2**30 doubles"]

LOAD_UNDER_1GB = HOSTILE + r'''
import json, resource
import vitscope as vs
out = {}
for i, kind in enumerate(sys.argv[2:]):
    path = f"{sys.argv[1]}/hostile{i}.pth"
    write(path, kind)
    vm_size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + 2 ** 30, resource.RLIM_INFINITY))  # 1 GiB more, at most
    try:
        vs.load_model(path)
        out[kind] = ["loaded", "", 0]
    except Exception as e:
        out[kind] = [type(e).__name__, str(e), 0]
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    import os
    out[kind][2] = os.path.getsize(path)
print(json.dumps(out))
'''


def test_a_tiny_pickle_asking_allowed_globals_for_gigabytes_is_refused_before_allocating(tmp_path):
    """Each file is about a kilobyte and uses only globals torch.load(weights_only=True) allows; loading it runs
    with 1 GiB of address space to spare, so an allocation of what it asks for would fail as such."""
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", LOAD_UNDER_1GB, str(tmp_path), *HOSTILE_KINDS], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for kind in HOSTILE_KINDS:
        error, message, size = out[kind]
        assert size < 4096, (kind, size)
        assert error == "CheckpointError", (kind, error, message)
        assert "\n" not in message and "hostile" in message, (kind, message)
        assert "ask for" in message and "more than saved tensors ever need" in message, (kind, message)


LOAD_STATES_UNDER_1GB = HOSTILE + r'''
import json, resource
from pathlib import Path
from vitscope.study.cache import Cache
from vitscope.zoo.train import load_state
out = {}
for i, kind in enumerate(sys.argv[2:]):
    path = Path(sys.argv[1]) / f"entry{i}.pt"
    write(path, kind)
    vm_size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + 2 ** 30, resource.RLIM_INFINITY))  # 1 GiB more, at most
    cached = Cache(Path(sys.argv[1])).load(path)
    try:
        load_state(path)
        state = "loaded"
    except Exception as e:
        state = f"{type(e).__name__}: {e}"
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out[kind] = [cached is None, state]
print(json.dumps(out))
'''


def test_a_cache_entry_or_training_state_asking_for_gigabytes_is_refused_before_loading(tmp_path):
    """The same tiny pickles planted as a study cache entry (read back with mmap) and as a zoo training state:
    the entry is ignored (recomputed) and the state refused in one sentence, each under a 1 GiB limit."""
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", LOAD_STATES_UNDER_1GB, str(tmp_path), *HOSTILE_KINDS],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for kind in HOSTILE_KINDS:
        ignored, state = out[kind]
        assert ignored, kind
        assert state.startswith("VitscopeError: cannot resume from") and "ask for" in state, (kind, state)
        assert "MemoryError" not in state and "\n" not in state, (kind, state)


def test_torch_files_within_their_size_still_load(tmp_path):
    """A stride-0 view of a saved tensor, shared storages, a Parameter, the argparse.Namespace of official files,
    in both formats: loaded as before, and their shapes read off the pickle alone."""
    import argparse
    from collections import OrderedDict

    import torch

    from vitscope.models.checkpoints import read_checkpoint
    from vitscope.models.torchfile import declared_shapes

    base = torch.randn(6, 4)
    sd = OrderedDict(a=base, b=base[2:], c=torch.ones(1).expand(1000), d=torch.nn.Parameter(torch.zeros(3)))
    for legacy in (False, True):
        path = tmp_path / f"ok{legacy}.pth"
        torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
        got = read_checkpoint(path)
        assert {k: tuple(v.shape) for k, v in got.items()} == declared_shapes(path) == {
            "a": (6, 4), "b": (4, 4), "c": (1000,), "d": (3,)}
        torch.testing.assert_close(got["b"], base[2:])
    torch.save({"model": sd, "args": argparse.Namespace(lr=0.1)}, tmp_path / "train.pth")
    assert read_checkpoint(tmp_path / "train.pth")["args"].lr == 0.1


def _hostile_pth(t):
    import runpy

    ns = runpy.run_path(str(_write_text(t / "hostile_gen.py", HOSTILE)))
    ns["write"](str(t / "hostile.pth"), "legacy storage of 2**31 floats")
    return t / "hostile.pth"


def _write_text(path, text):
    path.write_text(text)
    return path


def _hf_dir(t):
    """A transformers ViT directory whose config.json claims a width of 100,000 beside weights 64 wide."""
    import json

    import torch
    from safetensors.torch import save_file

    d = t / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 100000, "num_hidden_layers": 1,
                                               "image_size": 32, "patch_size": 8}))
    save_file({"embeddings.patch_embeddings.projection.weight": torch.zeros(64, 3, 8, 8),
               "encoder.layer.0.intermediate.dense.weight": torch.zeros(256, 64)}, str(d / "model.safetensors"))
    return d


# -- Unverified 3: a run estimated beyond MAX_HOURS is warned about before it starts, and not refused ------------

def test_a_run_estimated_beyond_the_stated_hours_is_warned_about_before_it_starts(config, tmp_path, capsys,
                                                                                 monkeypatch, no_model):
    import vitscope.study.cost as cost

    argv = ["run", str(config), f"output_dir={tmp_path / 'out'}"]
    assert main([*argv, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "hours of forwards on cpu" in said and "Warning" not in said  # 8 tiny images: seconds
    flops = cost.Estimate(flops=1, device="cpu")
    assert flops.hours == 1 / cost.FLOPS_PER_SECOND["cpu"] / 3600

    monkeypatch.setitem(cost.FLOPS_PER_SECOND, "cpu", 1.0)  # a device this slow makes the same run take days
    assert main([*argv, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert f"more than {cost.MAX_HOURS} hours" in said and "Warning: this run is estimated at about" in said
    with pytest.raises(AssertionError, match="before any model loads"):  # the run starts: its first model load
        main(argv)
    err = capsys.readouterr().err
    assert err.startswith("vitscope: warning: this run is estimated at about") and "it starts anyway" in err


# -- Unverified POOR cases, found again in a re-check: pair order, STIR's short batch, timm kwargs, SPair / rOxford --

def _pair_study(t, order, pairs, n_images=8):
    models = {"a": f"{{name: vit_small_patch16_224, label: a, pretrained: false, seed: 0, kwargs: {TINY_STUDY_KW}}}",
              "b": f"{{name: vit_small_patch16_224, label: b, pretrained: false, seed: 1, kwargs: {TINY_STUDY_KW}}}"}
    p = t / f"pair-{''.join(order)}-{n_images}.yaml"
    p.write_text("models:\n" + "".join(f"  - {models[m]}\n" for m in order) + f"""
dataset: {{name: synthetic-shapes, n_images: {n_images}}}
analyses:
  stir: {{iterations: 1, corruptions: none, pairs: {pairs}}}
batch_size: 4
progress: false
""")
    return p


def test_a_pair_naming_its_models_against_the_studys_order_runs_after_both_passes(tmp_path):
    """pairs: [[b, a]] with a listed first stopped with KeyError 'b' (the pair stage ran after a's pass, b not yet
    loaded); it now runs after the later of the two passes and equals the study that lists b first."""
    import json

    import pandas as pd

    tables = []
    for order in (["a", "b"], ["b", "a"]):
        out = tmp_path / f"run-{''.join(order)}"
        assert main(["run", str(_pair_study(tmp_path, order, "[[b, a]]")), f"output_dir={out}",
                     f"cache_dir={tmp_path / ('cache' + ''.join(order))}"]) == 0
        df = pd.read_parquet(out / "results" / "stir.parquet")
        assert set(df.model) == {"b"} and set(df.model_b.dropna()) == {"a"} and len(df)
        tables.append(df.sort_values(list(df.columns.drop("value"))).reset_index(drop=True))
        assert "stir:b" in json.loads((out / "manifest.json").read_text())["models"]["a"]["pairs"]
    pd.testing.assert_frame_equal(tables[0], tables[1])


def test_a_stir_selection_leaving_a_batch_under_4_images_is_one_sentence_before_any_model_loads(tmp_path, capsys,
                                                                                                no_model):
    from vitscope.study import load_config
    from vitscope.study.distributed import Dist
    from vitscope.study.plan import make_plan
    from vitscope.study.run import _source, check_batch_sizes

    err = one_line_error(capsys, ["run", str(_pair_study(tmp_path, ["a", "b"], "[[a, b]]", 9)),
                                  f"output_dir={tmp_path / 'o'}"])
    assert "analysis 'stir' needs at least 4 images in every batch" in err and "leave a batch of 1" in err
    assert not (tmp_path / "o" / "results").exists()
    cfg = load_config(_pair_study(tmp_path, ["a", "b"], "[[a, b]]", 12), [f"output_dir={tmp_path / 'p'}"])
    plan = make_plan(cfg)
    sources = {n: _source(n, dc, cfg, plan, Dist()) for n, dc in plan.datasets.items()}
    check_batch_sizes(cfg, plan, sources)  # 3 batches of 4, in one process and in two
    check_batch_sizes(cfg, plan, sources, world=2)
    cfg.batch_size = 5  # 5, 5, 2
    sources = {n: _source(n, dc, cfg, plan, Dist()) for n, dc in plan.datasets.items()}
    with pytest.raises(ConfigError, match="in batches of 5 over 2 processes leave a batch of 2"):
        check_batch_sizes(cfg, plan, sources, world=2)
    assert main(["run", str(_pair_study(tmp_path, ["a", "b"], "[[a, b]]", 9)), "--dry-run",
                 f"output_dir={tmp_path / 'o'}"]) == 0
    assert "needs at least 4 images in every batch" in capsys.readouterr().out  # the dry run notes it


@pytest.mark.parametrize("kwargs,needle", [
    (["models.0.kwargs.embed_dim=50"], "dim should be divisible by num_heads"),  # timm's assert: was a traceback
    (["models.0.kwargs.bogus=1"], "unexpected keyword argument 'bogus'"),
    (["models.0.kwargs.num_heads=x"], "timm cannot build vit_small_patch16_224 with kwargs"),
])
def test_timm_kwargs_it_refuses_are_one_sentence_before_any_model_loads(config, tmp_path, capsys, no_model, kwargs,
                                                                         needle):
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", *kwargs])
    assert needle in err and "models[0] (tiny)" in err


def test_a_model_whose_parameters_exceed_the_free_memory_is_refused_before_it_is_built(config, tmp_path, capsys,
                                                                                       no_model):
    """Each size within its bound (width 16384, 256 blocks), their product 825 billion parameters (3 TiB): refused
    from the architecture built on the meta device, nothing allocated."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", "models.0.kwargs.depth=256",
                                  "models.0.kwargs.embed_dim=16384", "models.0.kwargs.num_heads=16"])
    assert "824,708,121,576 parameters" in err and "of memory free here" in err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def _spair_with(t, change):
    import json

    from test_data_loaders import _spair

    _spair(t / "spair")
    f = sorted((t / "spair" / "PairAnnotation" / "test").glob("*.json"))[0]
    d = json.loads(f.read_text())
    change(d)
    f.write_text(json.dumps(d))
    return t / "spair"


def _revisited_with(t, change):
    import pickle

    from test_data_loaders import _revisited

    _revisited(t)
    p = t / "roxford5k" / "gnd_roxford5k.pkl"
    g = pickle.loads(p.read_bytes())
    change(g)
    p.write_bytes(pickle.dumps(g))
    return t


def _gnd(**kw):
    return lambda g: g["gnd"][0].update(kw)


ANNOTATIONS = [  # (name, dataset kind, change, what the sentence says): each was a traceback or a silent number
    ("spair keypoints not numbers", "spair", lambda d: d.update(src_kps="xy"), "src_kps 'xy' is not numbers"),
    ("spair keypoint of one number", "spair", lambda d: d.update(src_kps=[[1], [2]]), "list of [x, y] pairs"),
    ("spair NaN keypoint", "spair", lambda d: d.update(trg_kps=[[float("nan"), 3], [4, 5]]),
     "trg_kps holds nan, not a finite number"),
    ("spair box of 3", "spair", lambda d: d.update(src_bndbox=[1, 2, 3]), "src_bndbox [1, 2, 3] is not four numbers"),
    ("spair box not numbers", "spair", lambda d: d.update(trg_bndbox="box"), "trg_bndbox 'box' is not numbers"),
    ("spair kps_ids short", "spair", lambda d: d.update(kps_ids=[1]), "kps_ids must list one id per keypoint"),
    ("roxford gnd entry not a dict", "revisited", lambda g: g.update(gnd=[[1, 2]]), "query 0 is a list, not a dict"),
    ("roxford bbx of 3", "revisited", _gnd(bbx=[1, 2, 3]), "bbx [1, 2, 3] is not four finite numbers"),
    ("roxford NaN bbx", "revisited", _gnd(bbx=[float("nan"), 2, 3, 4]), "is not four finite numbers"),
    ("roxford bbx not numbers", "revisited", _gnd(bbx="abc"), "bbx 'abc' is not four numbers"),
    ("roxford index not a number", "revisited", _gnd(easy=["a"]), "easy holds 'a', not a database index"),
    ("roxford fractional index", "revisited", _gnd(hard=[0.5]), "hard holds 0.5, not a database index"),
]


@pytest.mark.parametrize("name,kind,change,needle", ANNOTATIONS, ids=[a[0] for a in ANNOTATIONS])
def test_spair_and_revisited_annotation_values_are_one_sentence_naming_the_file(tmp_path, name, kind, change, needle):
    from vitscope.data.formats.revisited import RevisitedRetrieval
    from vitscope.data.formats.spair import SPair71k
    from vitscope.errors import InputError

    with pytest.raises(InputError) as e:
        if kind == "spair":
            SPair71k(_spair_with(tmp_path, change), split="test")
        else:
            RevisitedRetrieval(_revisited_with(tmp_path, change), "roxford5k")
    said = str(e.value)
    assert needle in said and "\n" not in said, said
    assert ("PairAnnotation" in said and ".json" in said) if kind == "spair" else "gnd_roxford5k.pkl" in said


@pytest.mark.parametrize("far", [1e5, 1e30])
def test_a_revisited_query_box_far_outside_its_image_is_one_sentence_not_a_crop_of_gigabytes(tmp_path, far):
    """A 1e5 box was cropped (zero-padded) to 100,000 x 100,000 pixels: 30 GB; 1e30 failed inside numpy."""
    from vitscope.data.formats.revisited import RevisitedRetrieval
    from vitscope.errors import InputError

    ds = RevisitedRetrieval(_revisited_with(tmp_path, _gnd(bbx=[0.0, 0.0, far, far])), "roxford5k")
    with pytest.raises(InputError, match=r"gnd_roxford5k\.pkl': query 0's bbx .* lies more than 1 image size outside "
                                         r"its 40x30 image"):
        ds[0]
    near = RevisitedRetrieval(_revisited_with(tmp_path / "near", _gnd(bbx=[5.0, 4.0, 60.0, 50.0])), "roxford5k")
    assert near[0].image.shape == (46, 55, 3)  # past the border, within the bound: padded as before


def test_the_run_directory_lock_is_held_from_the_first_batch_to_the_report(config, tmp_path, monkeypatch):
    """BAD 2: the lock is not only taken at the start: another writer is refused at the first batch and while the
    report (the run's last step) is written, and may write once the run is over."""
    from filelock import FileLock, Timeout

    import vitscope.report as report
    from vitscope.study import rundir

    out = tmp_path / "out"
    seen = []

    def other_writer(*_):
        with pytest.raises(Timeout):
            FileLock(str(out / rundir.LOCK), timeout=0).acquire()
        seen.append(True)

    write_report = report.write_report
    monkeypatch.setattr(report, "write_report", lambda d: (other_writer(), write_report(d))[1])
    from vitscope.study import load_config, run_study

    run_study(load_config(config, [f"output_dir={out}"]), on_batch=lambda *a: other_writer() if not seen else None)
    assert len(seen) == 2
    with FileLock(str(out / rundir.LOCK), timeout=0):
        pass


@pytest.mark.parametrize("device", ["meta", "xla", "cpu:0x"])
def test_a_device_a_study_cannot_run_on_is_one_sentence_before_any_model_loads(config, tmp_path, capsys, no_model,
                                                                               device):
    """Issue 42: `device: meta` / `xla` passed validation and failed after the model loaded, with a traceback."""
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", f"device={device}"])
    assert f"device {device!r}" in err and ("cpu, cuda, mps" in err or "is not a device name" in err), err
