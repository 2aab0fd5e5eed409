"""The helper process (study/helper.py): the same tables as one process, and a failing helper costs no result."""

import json
import logging
import os
import time

import pandas as pd
import pytest

from vitscope.study import helper as H
from vitscope.study import load_config, run_study

YAML = """
models:
{models}
dataset: {{name: synthetic-shapes, n_images: 24}}
analyses:
  attention_distance: {{}}
  cka: {{batch_size: 8, views: [gap]}}
  semantics: {{ks: [3], test_every: 3, views: [cls]}}
batch_size: 8
progress: false
"""
MODEL = ("  - {{name: vit_small_patch16_224, label: m{i}, pretrained: false, seed: {i}, "
         "kwargs: {{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}}}")


def _config(tmp_path, name, n_models=4):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(YAML.format(models="\n".join(MODEL.format(i=i) for i in range(n_models))))
    return load_config(cfg, [f"output_dir={tmp_path / name}", f"cache_dir={tmp_path / (name + '-cache')}"])


def _helper_claims_first(monkeypatch):
    """The study's process claims from the shared list only once the helper has claimed a model: tiny models
    are done before the helper has started, and these tests need both processes to compute."""
    import time

    real = H.Helper.claim

    def claim(self):  # noqa: ANN001
        end = time.monotonic() + 120
        while not self.claimed_by_helper(set()) and self._proc.is_alive() and time.monotonic() < end:
            time.sleep(0.05)
        return real(self)

    monkeypatch.setattr(H.Helper, "claim", claim)


def test_a_study_with_a_helper_process_writes_the_tables_of_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "MIN_IMAGES", 0)  # the tiny study would not pay for a process otherwise
    _helper_claims_first(monkeypatch)
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    helped = run_study(_config(tmp_path, "helped"))
    manifest = json.loads((helped / "manifest.json").read_text())
    by_helper = [m for m, meta in manifest["models"].items() if meta.get("helper_process")]
    assert by_helper and set(by_helper) < {"m0", "m1", "m2", "m3"}  # each model once, by whichever was free
    assert manifest["analyses_read_from_cache"] == [0, 12]  # computed in this run, not "from the cache"
    monkeypatch.setenv("VITSCOPE_WORKERS", "1")
    alone = run_study(_config(tmp_path, "alone"))
    assert not any(m.get("helper_process") for m in json.loads((alone / "manifest.json").read_text())["models"]
                   .values())
    for name in ("attention_distance", "cka", "semantics"):
        a = pd.read_parquet(helped / "results" / f"{name}.parquet")
        b = pd.read_parquet(alone / "results" / f"{name}.parquet")
        assert len(a) == len(b) > 0 and set(a.model) == {"m0", "m1", "m2", "m3"}
        pd.testing.assert_series_equal(a.value, b.value, rtol=1e-6, atol=1e-9)


def test_no_helper_where_it_cannot_pay(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    run = run_study(_config(tmp_path, "small"))  # 24 images per model: below MIN_IMAGES
    assert not any(m.get("helper_process") for m in json.loads((run / "manifest.json").read_text())["models"].values())


def test_a_failing_helper_is_reported_and_leaves_the_model_to_the_study(tmp_path, caplog):
    helper = H.Helper().assign(_config(tmp_path, "x"), ["no-such-model"])  # fails in the child: no such model
    try:
        with caplog.at_level(logging.WARNING, logger="vitscope.study.helper"):
            assert helper.wait_for("no-such-model") is None
    finally:
        helper.close()
    assert "KeyError" in caplog.text and "computes no-such-model itself" in caplog.text


def test_a_stopped_helper_is_given_up_and_leaves_the_model_to_the_study(tmp_path, caplog):
    """Issue 42: a SIGSTOPped helper made the study wait forever, silently. Stopped for the given time, it is
    ended and the study computes the model itself (said in one warning)."""
    import signal

    helper = H.Helper()
    try:
        assert helper.wait_ready(120)
        os.kill(helper._proc.pid, signal.SIGSTOP)
        helper.assign(_config(tmp_path, "x"), ["m0"])
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="vitscope.study.helper"):
            assert helper.wait_for("m0", stopped_for=2.0) is None
        assert time.monotonic() - t0 < 30 and not helper._proc.is_alive()
    finally:
        helper.close()
    assert "has been stopped for 2 s" in caplog.text and "computes m0 itself" in caplog.text


@pytest.mark.parametrize("value,want", [("1", 1), ("2", 2), ("3", 3), ("x", 1), ("0", 1)])
def test_workers_reads_the_environment(monkeypatch, value, want):
    from vitscope.threads import workers

    monkeypatch.setenv("VITSCOPE_WORKERS", value)
    assert workers() == want


def test_the_pair_stages_models_stay_in_the_study_process_and_the_tables_equal_one_process(tmp_path, monkeypatch):
    """With a pair stage (STIR between m4 and m3, named against the study order), the helper takes half of the
    other models (the old every-second rule gave it m3), so the study's process runs the pair stage while the
    helper still computes; the study's own models go first. Tables (row order included) and the manifest's
    model order equal one process's."""
    monkeypatch.setattr(H, "MIN_IMAGES", 0)
    _helper_claims_first(monkeypatch)
    yaml = YAML.format(models="\n".join(MODEL.format(i=i) for i in range(6))).replace(
        "\nbatch_size: 8", "\n  stir: {iterations: 1, corruptions: none, pairs: [[m4, m3]]}\nbatch_size: 8")

    def config(name):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml)
        return load_config(cfg, [f"output_dir={tmp_path / name}", f"cache_dir={tmp_path / (name + '-cache')}"])

    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    helped = run_study(config("helped"))
    manifest = json.loads((helped / "manifest.json").read_text())
    by_helper = {m for m, meta in manifest["models"].items() if meta.get("helper_process")}
    assert by_helper and not by_helper & {"m3", "m4"}  # the pair stage's models stay in the study's process
    assert list(manifest["models"]) == [f"m{i}" for i in range(6)] and "stir:m4" in manifest["models"]["m3"]["pairs"]
    monkeypatch.setenv("VITSCOPE_WORKERS", "1")
    alone = run_study(config("alone"))
    assert list(json.loads((alone / "manifest.json").read_text())["models"]) == list(manifest["models"])
    for name in ("attention_distance", "cka", "semantics", "stir"):
        a = pd.read_parquet(helped / "results" / f"{name}.parquet")
        b = pd.read_parquet(alone / "results" / f"{name}.parquet")
        assert len(a) == len(b) > 0
        pd.testing.assert_frame_equal(a.drop(columns="value"), b.drop(columns="value"))  # same rows, same order
        pd.testing.assert_series_equal(a.value, b.value, rtol=1e-6, atol=1e-9)


def test_the_shared_list_leaves_out_pair_models_and_falls_back_to_every_model(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(H, "MIN_IMAGES", 0)
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    labels = [f"m{i}" for i in range(8)]

    def plan(pairs):
        return SimpleNamespace(analyses=[SimpleNamespace(pair=True, pairs=pairs, passes=[])])

    assert H.delegated(plan([]), {}, labels) == labels
    assert H.delegated(plan([("m6", "m7")]), {}, labels) == labels[:6]  # the default study's shape: the pair last
    assert H.delegated(plan([("m0", "m1"), ("m2", "m3"), ("m4", "m5")]), {}, labels) == ["m6", "m7"]
    # one model outside the pairs: nothing to share but it, so every model goes on the list
    assert H.delegated(plan([("m0", "m1"), ("m2", "m3"), ("m4", "m5"), ("m6", "m0")]), {}, labels) == labels


def test_each_claim_takes_the_next_model_once_from_either_process():
    """The shared list's counter: claims from the study's process and the helper's interleave, each model goes
    to exactly one of them, in list order."""
    import multiprocessing as mp

    counter = mp.get_context("spawn").Value("i", 0)
    labels = [f"m{i}" for i in range(5)]
    got = [H._claim(counter, labels) for _ in range(7)]
    assert got == [*labels, None, None]


def test_vitscope_run_starts_the_helper_before_its_own_imports_and_hands_it_the_models(tmp_path, monkeypatch):
    """`vitscope run` starts the helper once the config's checks that need no torch have passed, before those that
    import torch and timm (seconds on the study's core), gives that same process its models, and leaves none
    waiting; tables equal one process's."""
    from vitscope.cli import main
    from vitscope.study import config as C

    monkeypatch.setattr(H, "MIN_IMAGES", 0)
    _helper_claims_first(monkeypatch)
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    events, made = [], []
    real_init, real_checks = H.Helper.__init__, C._check_with_torch

    def init(self):  # noqa: ANN001
        events.append("helper")
        real_init(self)
        made.append(self)

    monkeypatch.setattr(H.Helper, "__init__", init)
    monkeypatch.setattr(C, "_check_with_torch", lambda *a, **k: (events.append("torch"), real_checks(*a, **k))[1])
    cfg = tmp_path / "study.yaml"
    cfg.write_text(YAML.format(models="\n".join(MODEL.format(i=i) for i in range(4))))
    assert main(["run", str(cfg), f"output_dir={tmp_path / 'cli'}", f"cache_dir={tmp_path / 'cli-cache'}"]) == 0
    assert events[:2] == ["helper", "torch"] and H._WAITING is None and not made[0]._proc.is_alive()
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert any(meta.get("helper_process") for meta in manifest["models"].values())
    monkeypatch.setenv("VITSCOPE_WORKERS", "1")
    alone = run_study(_config(tmp_path, "alone"))
    for name in ("attention_distance", "cka", "semantics"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "cli" / "results" / f"{name}.parquet"),
                                      pd.read_parquet(alone / "results" / f"{name}.parquet"), rtol=1e-6, atol=1e-9)


def test_an_early_helper_only_where_it_may_pay_and_dismissed_when_not_needed(tmp_path, monkeypatch):
    from vitscope.cli import main

    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    four, two = tmp_path / "four.yaml", tmp_path / "two.yaml"
    four.write_text(YAML.format(models="\n".join(MODEL.format(i=i) for i in range(4))))
    two.write_text(YAML.format(models="\n".join(MODEL.format(i=i) for i in range(2))))
    assert H.models_listed(four) == 4 and H.models_listed(two) == 2 and H.models_listed(None) >= H.MIN_MODELS
    assert H.models_listed(tmp_path / "missing.yaml") == 0
    H.prespawn(two)  # too few models to pay
    assert H._WAITING is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: no helper
    H.prespawn(four)
    assert H._WAITING is None
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("VITSCOPE_WORKERS", "1")
    H.prespawn(four)
    assert H._WAITING is None
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    made = []
    real_init = H.Helper.__init__
    monkeypatch.setattr(H.Helper, "__init__", lambda self: (real_init(self), made.append(self))[0])
    # four models, but 24 images each: below MIN_IMAGES, the study dismisses the helper it started early
    assert main(["run", str(four), f"output_dir={tmp_path / 'o'}", f"cache_dir={tmp_path / 'c'}"]) == 0
    assert len(made) == 1 and H._WAITING is None and not made[0]._proc.is_alive()
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert not any(m.get("helper_process") for m in manifest["models"].values())


def test_an_early_helper_says_when_its_imports_are_done_and_ends_when_dismissed(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    four = tmp_path / "four.yaml"
    four.write_text(YAML.format(models="\n".join(MODEL.format(i=i) for i in range(4))))
    H.prespawn(four)
    waiting = H._WAITING
    try:
        assert waiting is not None and waiting.wait_ready(timeout=120) and waiting._proc.is_alive()
    finally:
        H.dismiss()
    assert H._WAITING is None and not waiting._proc.is_alive()


def _png_folder(root, n_per_class=24, size=32):
    """An ImageFolder of generated PNGs: two classes (dark and light), ``n_per_class`` images of ``size`` px each."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(("dark", "light")):
        (root / name).mkdir(parents=True)
        for i in range(n_per_class):
            pixels = rng.integers(0, 128, (size, size, 3)) + 127 * c
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i:03d}.png")
    return root


def _descendants(pid):
    """The processes below ``pid`` (children, their children, ...), as {pid: command line}, read from /proc."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    found[child] = ""
                todo.append(child)
    return found


def test_an_imagefolder_study_with_a_helper_writes_the_tables_of_one_process_and_leaves_no_process(tmp_path,
                                                                                                  monkeypatch):
    """A dataset that reads files: ``num_workers: null`` gives its passes reading workers (the usable cores minus
    one), which a daemonic helper could not start ("daemonic processes are not allowed to have children"), so the
    study computed every model itself. The helper computes models of such a study too, the tables equal one
    process's bit for bit, and no process is left behind."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("reading workers need two usable cores (num_workers: null is 0 on one)")
    root = _png_folder(tmp_path / "pngs")
    monkeypatch.setattr(H, "MIN_IMAGES", 0)
    _helper_claims_first(monkeypatch)
    pids = []
    real_init = H.Helper.__init__
    monkeypatch.setattr(H.Helper, "__init__", lambda self: (real_init(self), pids.append(self._proc.pid))[0])
    yaml = YAML.format(models="\n".join(MODEL.format(i=i) for i in range(4))).replace(
        "{name: synthetic-shapes, n_images: 24}", f"{{name: imagefolder, root: '{root}', n_images: 48}}")

    def config(name):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml)
        return load_config(cfg, [f"output_dir={tmp_path / name}", f"cache_dir={tmp_path / (name + '-cache')}"])

    before = set(_descendants(os.getpid()))
    monkeypatch.setenv("VITSCOPE_WORKERS", "2")
    helped = run_study(config("helped"))
    manifest = json.loads((helped / "manifest.json").read_text())
    by_helper = [m for m, meta in manifest["models"].items() if meta.get("helper_process")]
    assert by_helper and set(by_helper) < {"m0", "m1", "m2", "m3"}
    assert manifest["analyses_read_from_cache"] == [0, 12] and not manifest["skipped_images"]
    left = {p: cmd for p, cmd in _descendants(os.getpid()).items()
            if p not in before and "resource_tracker" not in cmd}  # multiprocessing's tracker lives as long as this
    assert len(pids) == 1 and not left, left
    monkeypatch.setenv("VITSCOPE_WORKERS", "1")
    alone = run_study(config("alone"))
    assert not any(m.get("helper_process") for m in json.loads((alone / "manifest.json").read_text())["models"]
                   .values())
    for name in ("attention_distance", "cka", "semantics"):
        a = pd.read_parquet(helped / "results" / f"{name}.parquet")
        b = pd.read_parquet(alone / "results" / f"{name}.parquet")
        assert len(a) > 0 and set(a.model) == {"m0", "m1", "m2", "m3"}
        pd.testing.assert_frame_equal(a, b, check_exact=True)  # bit for bit
