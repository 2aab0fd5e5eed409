"""The command line as a person meets it: listings that start without torch, config errors in one sentence
with the close match, Ctrl-C in one line; and the shipped listings equal to what the code says."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from study_fixtures import TWO_TINY_MODELS

from vitscope.cli import main
from vitscope.models.registry import REGISTRY
from vitscope.taps_listing import live_text, snapshot

SRC = str(Path(__file__).resolve().parents[1] / "src")
HEAVY = ("torch", "timm", "matplotlib", "sklearn")


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, **kw)


@pytest.mark.parametrize("argv", [["--help"], ["models"], ["datasets"], ["analyses"], ["analyses", "cka"],
                                  ["taps", "zoo-dino"], ["zoo", "--help"]])
def test_listings_import_neither_torch_nor_timm(argv):
    """What makes them start in a second (benchmarks/cli_startup.py measures it): none of the heavy packages
    is imported, and the command still prints its listing."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import sys\nfrom vitscope.cli import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], 'RC', rc)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300)
    last = p.stdout.strip().splitlines()[-1]
    assert last == "HEAVY [] RC 0", (last, p.stderr[-2000:])
    assert len(p.stdout.splitlines()) > 5  # it listed something


def test_the_light_metrics_and_the_light_model_checks_import_no_torch():
    """`vitscope.metrics` imports its submodules on first use, so the numpy ones (intervals, similarity,
    robustness' intervals) and the config checks' model names and weights files come without torch; the
    package still gives every submodule."""
    p = _python("import sys\n"
                "import vitscope.metrics.intervals, vitscope.metrics.similarity, vitscope.models.names\n"
                f"assert not [m for m in {HEAVY!r} if m in sys.modules], [m for m in {HEAVY!r} if m in sys.modules]\n"
                "import vitscope.metrics as M\n"
                "assert M.similarity.mean_cca and M.cka.linear_cka and M.attention.attention_distance\n"
                "print('OK')\n")
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stderr[-2000:]


def test_import_vitscope_is_lazy_and_keeps_its_public_api():
    p = _python("import sys, vitscope as vs\n"
                f"assert not [m for m in {HEAVY!r} if m in sys.modules], 'heavy at import'\n"
                "import matplotlib.figure, torch\n"
                "from vitscope.models.adapter import ViTModel\n"
                "from vitscope.report.plot import plot\n"
                "for name in vs.__all__:\n"
                "    assert getattr(vs, name) is not None, name\n"
                "assert vs.ViTModel is ViTModel and vs.plot is plot and callable(vs.cka) and callable(vs.load_model)\n"
                "assert vs.metrics.attention.attention_distance and 'load_model' in dir(vs)\n"
                "assert vs.REGISTRY['zoo-dino'].name == 'zoo-dino'\n"
                "import types, vitscope.zoo.train\n"  # a submodule of an exported name's: the export stays
                "from vitscope.zoo import TrainConfig, train\n"
                "assert callable(train) and not isinstance(train, types.ModuleType) and TrainConfig\n"
                "try:\n    vs.no_such_name\nexcept AttributeError as e:\n    print('OK', e)\n")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("OK") and "no_such_name" in p.stdout


def test_taps_listing_of_registry_entries_is_what_building_them_prints():
    """The shipped snapshot covers exactly the registry, and for small entries equals a live build (the slow
    test below builds every one)."""
    shipped = snapshot()
    assert set(shipped) == set(REGISTRY), \
        "src/vitscope/taps_listing.json is stale: `python -m vitscope.taps_listing > src/vitscope/taps_listing.json`"
    for name in ("zoo-dino", "zoo-mae-ft-cls", "sup-s16", "dinov2-s14-reg"):
        assert shipped[name] == live_text(name), name


@pytest.mark.slow
def test_taps_listing_of_every_registry_entry_is_what_building_it_prints():
    shipped = snapshot()
    for name in REGISTRY:
        assert shipped[name] == live_text(name), name


def test_taps_of_a_timm_name_or_other_weights_is_built_live(capsys):
    assert main(["taps", "vit_small_patch16_224"]) == 0  # not in the registry: built
    assert "(1, 6, 197, 197)" in capsys.readouterr().out


@pytest.mark.parametrize("yaml_line,override,sentence", [
    ("photos: {name: synthetic-shapes, n_image: 8}", None,
     "datasets.photos: unknown key 'n_image'; did you mean 'n_images'?"),
    ("photos: {name: synthetic-shapes, n_images: 8}", "batch_sise=4",
     "the study config: unknown key 'batch_sise'; did you mean 'batch_size'?"),
    ("photos: {name: synthetic-shapes, n_images: 8}", "models.0.pretraned=false",
     "models[0]: unknown key 'pretraned'; did you mean 'pretrained'?"),
    ("photos: {name: synthetic-shapes, n_images: eight}", None,
     "datasets.photos.n_images must be an integer, not 'eight'"),
    ("photos: {name: synthetic-shapes, n_images: 8}", "progress=maybe", "progress must be true or false, not 'maybe'"),
])
def test_a_config_error_is_one_sentence_with_the_close_match(tmp_path, yaml_line, override, sentence):
    study = tmp_path / "study.yaml"
    study.write_text(TWO_TINY_MODELS + f"datasets:\n  {yaml_line}\nanalyses: {{cka: {{}}}}\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "vitscope", "run", str(study), *([override] if override else [])]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr == f"vitscope: error: {sentence}\n"  # nothing of OmegaConf's full_key / object_type lines


def _default_signals() -> None:
    """In the child, before it starts Python: the default action for the stop signals. A shell sets SIGINT to
    'ignored' for a job started with `&` and a child inherits that (Python then installs no KeyboardInterrupt):
    this test, run in the background, saw exit 0 where the study should have stopped (issue 42)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _interrupted_study(tmp_path, sig: int, name: str = "run"):
    """A two-model study sent ``sig`` once the first model's pass has saved a partial state; returns the process
    (ended), its stdout and stderr, and the config. The pass is long (60 batches, each saved) so that the signal
    lands inside it even when this process is descheduled for a while."""
    study = tmp_path / f"{name}.yaml"
    study.write_text(TWO_TINY_MODELS + "dataset: {name: synthetic-shapes, n_images: 480}\n"
                     "analyses: {attention_distance: {}}\nbatch_size: 8\nsave_every: 1\nprogress: false\n"
                     f"output_dir: {tmp_path / name}\ncache_dir: {tmp_path / (name + '-cache')}\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "VITSCOPE_WORKERS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "vitscope", "run", str(study)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, preexec_fn=_default_signals)
    deadline = time.monotonic() + 300
    # a saved partial state, not the temporary file it is written through (".NAME.part-...pt.PID.tmp": pathlib's
    # `*` matches a leading dot, so under load the signal could land before anything was saved)
    while not list((tmp_path / (name + "-cache")).glob("*/[!.]*.part-*.pt")) and p.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, ("the study ended before it could be interrupted", p.communicate())
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    return p, out, err, study, env


@pytest.mark.parametrize("sig, said", [pytest.param(signal.SIGINT, "interrupted: ", id="SIGINT"),
                                       pytest.param(signal.SIGTERM, "interrupted by SIGTERM: ", id="SIGTERM"),
                                       pytest.param(signal.SIGHUP, "interrupted by SIGHUP: ", id="SIGHUP",
                                                    marks=pytest.mark.slow)])
def test_a_stop_signal_during_a_study_is_one_line_saying_what_is_saved_and_how_to_resume(tmp_path, sig, said):
    """Ctrl-C (SIGINT), a cluster's time limit (SIGTERM) or a closed terminal (SIGHUP) once the first model's
    pass has saved a partial state: exit code 128 + the signal, one line on stderr naming the cache and the
    model with partial states, no traceback."""
    p, out, err, _, _ = _interrupted_study(tmp_path, sig)
    assert p.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    assert err.startswith("vitscope: " + said) and "rerun the same command to resume" in err, err[-3000:]
    assert "of 2 models" in err and str(tmp_path / "run-cache") in err and "with partial states of tiny-" in err, err
    assert re.search(r"\(\d[\d,]* images of its passes kept\)", err), err  # what a rerun does not compute again
    assert "results:" not in out, (out, err)  # it did not finish


def test_a_study_stopped_by_sigterm_resumes_to_the_tables_of_an_uninterrupted_run(tmp_path):
    p, _, err, study, env = _interrupted_study(tmp_path, signal.SIGTERM)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    again = subprocess.run([sys.executable, "-m", "vitscope", "--quiet", "run", str(study)], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    whole = subprocess.run([sys.executable, "-m", "vitscope", "--quiet", "run", str(study),
                            f"output_dir={tmp_path / 'whole'}", f"cache_dir={tmp_path / 'whole-cache'}"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a = pd.read_parquet(tmp_path / "run" / "results" / "attention_distance.parquet")
    b = pd.read_parquet(tmp_path / "whole" / "results" / "attention_distance.parquet")
    pd.testing.assert_frame_equal(a, b)  # bit for bit


@pytest.mark.parametrize("argv", [["datasets"], ["analyses", "--markdown"]])
def test_a_reader_that_leaves_early_ends_a_listing_quietly(argv):
    """`vitscope datasets | head -1`: the pipe is closed before the listing is written (the read end closed at
    once, before the process has started); no traceback, the exit status of a process killed by SIGPIPE."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "vitscope", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert err == ""


def test_a_stop_signal_whose_interrupt_was_lost_still_ends_the_pass_after_its_batch():
    """The handler's KeyboardInterrupt is printed and ignored when it lands in a weakref callback or a __del__
    (seen: SIGTERM in attention's cache-forget callback, and the study finished with exit 0); the pass checks
    the recorded signal after each batch."""
    from conftest import tiny
    from vitscope.analyses import get_analysis
    from vitscope.capture import stream
    from vitscope.data import SyntheticShapes
    from vitscope.errors import STOPPED_BY

    vm = tiny("vit")
    batches = list(SyntheticShapes(n=12, seed=0).batches(4, vm.preprocessing))
    seen = []
    STOPPED_BY.append(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            stream(vm, batches, [get_analysis("attention_distance")(vm)], progress=False, on_batch=seen.append)
    finally:
        STOPPED_BY.clear()
    assert seen == [0]  # the first batch was finished (and saved by a study), then the pass stopped
