"""The input pipeline (`vitscope.data.pipeline`): chunks read in worker processes give the tables of one process,
bit for bit (a view, an unreadable JPEG, a resume in the middle); no worker outlives a failing or interrupted
study; `num_workers` is checked before any model loads."""

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from vitscope.data.formats.common import SkippedImagesWarning
from vitscope.errors import ConfigError, StudyInterrupted
from vitscope.study import load_config, run_study

TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
VIEW = "band_noise:band=2"



def _children() -> list[int]:
    """Processes whose parent is this one (every thread's children, from /proc)."""
    out = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    """Running (not ended, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _zombie_free_children() -> list[int]:
    """Live children, except multiprocessing's resource tracker: a spawn-context queue (the study helper's, in
    another test of the same worker process) starts it once for the life of the process."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return [pid for pid in _children() if _alive(pid) and pid != tracker]


@pytest.fixture
def folder(tmp_path):
    """An imagefolder of JPEGs of several sizes, one of them truncated (unreadable)."""
    from PIL import Image

    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(11):
            h, w = (40, 60) if i % 2 else (50, 37)
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / cls / f"{i}.jpg", quality=90)
    good = (root / "dog" / "4.jpg").read_bytes()
    (root / "dog" / "4.jpg").write_bytes(good[: len(good) // 3])  # truncated mid-scan: PIL refuses to decode it
    return root


def _study(tmp_path, root):
    text = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
dataset: {{name: imagefolder, root: {root}, n_images: 100}}
analyses:
  attention_distance: {{}}
  cka: {{batch_size: 4, views: [gap]}}
  seen_ids: {{views: ["{VIEW}"]}}
batch_size: 4
progress: false
"""
    p = tmp_path / "study.yaml"
    p.write_text(text)
    return p


def _tables(run_dir):
    return {f.stem: pd.read_parquet(f) for f in sorted((Path(run_dir) / "results").glob("*.parquet"))}


def _skipped(run_dir):
    return json.loads((Path(run_dir) / "manifest.json").read_text())["skipped_images"]


def test_tables_are_bit_identical_for_0_1_and_2_workers_with_a_view_an_unreadable_jpeg_and_a_resume(
        fixtures, tmp_path, folder):
    cfg = _study(tmp_path, folder)
    with pytest.warns(SkippedImagesWarning):
        ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c0'}",
                                          "num_workers=0"]))

    class Killed(Exception):
        pass

    def kill(model, b):
        if b == 2:
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'c2'}", "save_every=1", "num_workers=2"]
    with pytest.raises(Killed):  # before the chunk of the truncated image (chunk 3)
        run_study(load_config(cfg, over), on_batch=kill)
    assert _zombie_free_children() == []  # the pass's workers ended with it
    fed = []
    with pytest.warns(SkippedImagesWarning):  # said by the study's process, though a worker met the image
        out = run_study(load_config(cfg, over), on_batch=lambda m, b: fed.append(b))
    assert fed[0] == 3  # the clean pass resumed after its third chunk (the view's pass then starts at 0)
    with pytest.warns(SkippedImagesWarning):
        one = run_study(load_config(cfg, [f"output_dir={tmp_path / 'one'}", f"cache_dir={tmp_path / 'c1'}",
                                          "num_workers=1"]))
    a, b, c = _tables(ref), _tables(out), _tables(one)
    assert set(a) == set(b) == set(c) == {"attention_distance", "cka", "seen_ids"}
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=True)
        pd.testing.assert_frame_equal(a[name], c[name], check_exact=True)
    seen = a["seen_ids"]
    assert set(seen.token_view) == {"imagefolder|clean", f"imagefolder|{VIEW}"}
    assert len(seen) == 2 * 21  # every readable image once per view, the truncated one in none
    assert _skipped(ref) == _skipped(out) == _skipped(one) and [p for p, _ in next(iter(_skipped(out).values()))] == [
        str(folder / "dog" / "4.jpg")]


def test_no_worker_outlives_a_failing_or_interrupted_study(fixtures, tmp_path, folder):
    cfg = _study(tmp_path, folder)
    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'c'}", "num_workers=2"]
    before = set(_zombie_free_children())

    def fail(model, b):
        assert len(set(_zombie_free_children()) - before) == 2  # the workers are there while the pass runs
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_study(load_config(cfg, over), on_batch=fail)
    assert set(_zombie_free_children()) - before == set()

    def interrupt(model, b):
        raise KeyboardInterrupt

    with pytest.raises(StudyInterrupted):
        run_study(load_config(cfg, over), on_batch=interrupt)
    assert set(_zombie_free_children()) - before == set()


def test_an_input_error_in_a_worker_is_the_datasets_own_sentence(tmp_path):
    """An error the dataset raises while reading reaches the study as it was raised, not as a worker's traceback."""
    from vitscope.data.pipeline import chunk_batches
    from vitscope.errors import InputError

    class Broken:
        def batches(self, batch_size, pre, indices):
            if 5 in indices:
                raise InputError("image 5 is broken in a way the format refuses")
            yield torch.zeros(len(indices))

    got = []
    with pytest.raises(InputError) as e:
        for item in chunk_batches(Broken(), [[0, 1], [2, 3], [4, 5]], None, num_workers=2):
            got.append(item.k)
    assert str(e.value) == "image 5 is broken in a way the format refuses"
    assert got == [0, 1]


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "true", "[2]"])
def test_num_workers_that_is_not_a_whole_number_of_processes_is_one_sentence(tmp_path, value):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"models: [{{name: vit_small_patch16_224, pretrained: false, kwargs: {TINY}}}]\n"
                   "dataset: {name: synthetic-shapes, n_images: 8}\nanalyses: {attention_distance: {}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg, [f"num_workers={value}", f"output_dir={tmp_path / 'run'}"])
    msg = str(e.value)
    assert "num_workers" in msg and "\n" not in msg


def test_num_workers_set_in_code_is_checked_before_any_model_loads(tmp_path, monkeypatch):
    import vitscope.study.pool as pool

    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_text(f"models: [{{name: vit_small_patch16_224, pretrained: false, kwargs: {TINY}}}]\n"
                        "dataset: {name: synthetic-shapes, n_images: 8}\nanalyses: {attention_distance: {}}\n")
    cfg = load_config(cfg_file, [f"output_dir={tmp_path / 'run'}"])
    cfg.num_workers = -2
    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="num_workers"):
        run_study(cfg)


def test_auto_workers_read_files_in_workers_and_generated_images_here(folder, monkeypatch):
    from vitscope.data import pipeline
    from vitscope.data.catalog import build_dataset
    from vitscope.study.config import DatasetConfig

    monkeypatch.setattr(pipeline, "usable_cores", lambda: 4)
    files = build_dataset(DatasetConfig(name="imagefolder", root=str(folder)))
    assert pipeline.auto_workers(files) == 3
    for name in ("synthetic-shapes", "cifar10-test-1k"):
        assert pipeline.auto_workers(build_dataset(DatasetConfig(name=name, n_images=8))) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two processes share the four cores
    assert pipeline.auto_workers(files) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(pipeline, "usable_cores", lambda: 1)
    assert pipeline.auto_workers(files) == 0


KILLED_STUDY = """
import sys, time
from pathlib import Path
from vitscope.study import load_config, run_study

marker = Path(sys.argv[2])


def wait(model, b):
    marker.write_text("in a pass")
    time.sleep(600)


run_study(load_config(sys.argv[1], sys.argv[3:]), on_batch=wait)
"""


def test_workers_die_when_the_study_process_is_killed(tmp_path, folder):
    """SIGKILL leaves the study no chance to end its workers: the kernel ends them (PR_SET_PDEATHSIG)."""
    import signal
    import subprocess
    import sys
    import time

    script, marker = tmp_path / "study.py", tmp_path / "marker"
    script.write_text(KILLED_STUDY)
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"models: [{{name: vit_small_patch16_224, pretrained: false, kwargs: {TINY}}}]\n"
                   f"dataset: {{name: imagefolder, root: {folder}}}\nanalyses: {{attention_distance: {{}}}}\n"
                   "batch_size: 2\nprogress: false\n")
    proc = subprocess.Popen([sys.executable, str(script), str(cfg), str(marker), "num_workers=2",
                             f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'c'}"],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the study did not reach its first batch"
            time.sleep(0.2)
        workers = []
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            workers += [int(p) for p in (task / "children").read_text().split()]
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # at once: torch's own watchdog would end an orphaned worker only after its 5 s status interval
        deadline = time.monotonic() + 2.5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
