"""Issue 42 (reliability, round 3): a reading worker's death, a disk that fills inside a serializer, a run directory
that is its own cache, batch sizes in the cache keys, too many workers, unreadable images said once. The fault
matrix (every fault at every point of a study) is tests/test_fault_matrix.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from study_fixtures import TINY_STUDY_KW, tiny_study_yaml

from vitscope.cli import main
from vitscope.data.pipeline import worker_death
from vitscope.errors import ResultWarning, VitscopeError
from vitscope.study import load_config, run_study


def _images(root, n=24, bad=()):
    """An ImageFolder of ``n`` generated 32 px PNGs in two classes, and files named ``bad`` that are not images."""
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(d / f"{i:03d}.png")
    for name in bad:
        (root / name).write_bytes(b"not an image")
    return root


# -- a reading worker that dies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, said", [
    ("DataLoader worker (pid(s) 29297) exited unexpectedly", "(pid 29297) exited unexpectedly during batch 3"),
    ("DataLoader worker (pid 12) is killed by signal: Killed. ", "(pid 12) was killed by a signal (Killed) during"),
    ("DataLoader worker (pid 7) exited unexpectedly with exit code 1. Details are lost due to multiprocessing.",
     "(pid 7) exited unexpectedly with exit code 1 during"),
])
def test_each_way_torch_says_a_worker_died_becomes_one_sentence_naming_it_and_the_batch(text, said):
    err = worker_death(RuntimeError(text), "during batch 3 of 12 of imagefolder")
    assert isinstance(err, VitscopeError) and said in str(err) and "\n" not in str(err)
    assert "num_workers" in str(err)  # what to do about it
    assert worker_death(RuntimeError("CUDA out of memory"), "x") is None
    assert worker_death(ValueError(text), "x") is None


def test_a_worker_killed_mid_handover_is_the_same_sentence_not_a_broken_connection():
    """A batch in flight from a worker killed while handing it over fails as ConnectionResetError (its tensors'
    file descriptors are fetched from the dead process): the worker's exit code tells what happened."""
    from types import SimpleNamespace

    from vitscope.data import pipeline

    class Loader:  # the DataLoader iterator's shape: next() fails as the handover does, its workers are listed
        def __init__(self, *exitcodes):
            self._workers = [SimpleNamespace(pid=41 + i, exitcode=c) for i, c in enumerate(exitcodes)]

        def __next__(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(VitscopeError, match=r"an image-reading worker \(pid 42\) was killed by a signal \(SIGKILL\) "
                                            r"while batch 3 of 5 of images was read"):
        next(pipeline._worker_deaths(Loader(None, -9), [2, 3, 4], 5, "images"))
    with pytest.raises(ConnectionResetError):  # no worker died: the error is what it was
        next(pipeline._worker_deaths(Loader(None), [0], 1, "images"))


KILLING_DRIVER = r'''
import os, signal, sys
import vitscope.data.formats.imagefolder as f
MAIN = os.getpid()
load = f.ImageFolder.load
# a worker (not the study's process) dies reading the 26th image (batch 7 of 8), on the first run: the worker reads
# at most 2 batches ahead, so batches 1-5 are through the model and saved by then, however loaded the machine is
def dying_load(self, i):
    if i == 25 and os.getpid() != MAIN and not os.path.exists(sys.argv[1] + ".died"):
        open(sys.argv[1] + ".died", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return load(self, i)
f.ImageFolder.load = dying_load
from vitscope.cli import main
sys.exit(main(sys.argv[2:]))
'''


def test_a_killed_reading_worker_is_one_sentence_and_the_rerun_resumes_to_the_same_tables(tmp_path):
    images = _images(tmp_path / "images", n=32)
    study = tmp_path / "study.yaml"
    study.write_text(tiny_study_yaml().replace("{name: synthetic-shapes, n_images: 8}",
                                               f"{{name: imagefolder, root: {images}}}")
                     + "num_workers: 1\nsave_every: 1\n")
    driver = tmp_path / "driver.py"
    driver.write_text(KILLING_DRIVER)
    argv = ["-q", "run", str(study), f"output_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}"]
    p = subprocess.run([sys.executable, str(driver), str(tmp_path / "marker"), *argv], capture_output=True,
                       text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = lines[0]
    assert line.startswith("vitscope: error: an image-reading worker (pid "), line
    assert "of 8 of imagefolder" in line  # the batch: 32 images in batches of 4
    assert "with partial states of tiny (" in line and "rerun the same command to resume" in line, line
    assert (tmp_path / "marker.died").exists()
    rerun = subprocess.run([sys.executable, str(driver), str(tmp_path / "marker"), *argv], capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    ref = run_study(load_config(study, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'ref-cache'}"]))
    for name in ("cka",):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "out" / "results" / f"{name}.parquet"),
                                      pd.read_parquet(ref / "results" / f"{name}.parquet"), check_exact=True)


# -- a disk that fills inside a serializer --------------------------------------------------------------------------

FILLING = r'''
import os, sys, torch
from pathlib import Path
from vitscope.files import write_atomic
d, leave = Path(sys.argv[1]), int(sys.argv[2])
st = os.statvfs(d)
with open(d / "filler", "wb") as f:  # the disk filled up to ``leave`` bytes
    f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
try:
    write_atomic(d / "entry.pt", lambda f: torch.save({"state": torch.zeros(20000)}, f))
    print("written")
except BaseException as e:
    print(type(e).__name__, "|", e, "|", type(e.__cause__).__name__, "|", e.__cause__)
print(sorted(p.name for p in d.iterdir()))
'''


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                          capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize("leave", [0, 8192, 40960])
def test_a_disk_filling_inside_torch_save_is_the_one_sentence_of_a_full_disk(tmp_path, leave):
    """torch's zip writer reports a write the disk refused as "unexpected pos 704 vs 598" (a RuntimeError naming
    no system error) when the disk holds a few KB: `write_atomic` asks the file system and says what it is."""
    if not _can_mount():
        pytest.skip("no tmpfs can be mounted here (`unshare -rm` is not available)")
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "fill.py").write_text(FILLING)
    p = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {disk} && "
                        f"{sys.executable} {tmp_path / 'fill.py'} {disk} {leave}"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    said, files = p.stdout.strip().splitlines()
    assert said.startswith(f"VitscopeError | no space left on the device of {disk} "), said
    assert "rerun to continue" in said
    if leave:  # the serializer's own error, under the sentence
        assert "RuntimeError" in said and "unexpected pos" in said, said
    assert files == "['filler']"  # the temporary file removed, nothing half-written left


def test_a_serializer_error_with_room_on_the_disk_stays_what_it_was(tmp_path):
    from vitscope.files import write_atomic

    def broken(f):
        f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    with pytest.raises(RuntimeError, match="unexpected pos"):
        write_atomic(tmp_path / "entry.pt", broken)
    assert list(tmp_path.iterdir()) == []  # the temporary file (and the probe's bytes in it) removed


# -- a run directory that is its own cache ---------------------------------------------------------------------------

def test_an_output_dir_that_is_also_the_cache_dir_reruns_and_still_refuses_a_users_folder(tmp_path, capsys):
    study = tmp_path / "study.yaml"
    study.write_text(tiny_study_yaml())
    same = tmp_path / "same"
    argv = ["-q", "run", str(study), f"output_dir={same}", f"cache_dir={same}"]
    assert main(argv) == 0
    assert main(argv) == 0, capsys.readouterr().err  # its own cache folders are its own
    (same / "mine").mkdir()
    assert main(argv) == 2
    assert "holds files vitscope did not write (mine/)" in capsys.readouterr().err


# -- the batch size in the cache keys --------------------------------------------------------------------------------

def test_a_cache_filled_at_another_batch_size_is_not_read_back_so_tables_are_this_studys_bit_for_bit(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(tiny_study_yaml().replace("cka: {batch_size: 4, views: [gap]}", "attention_distance: {}"))
    shared = tmp_path / "shared-cache"
    run_study(load_config(study, [f"output_dir={tmp_path / 'a'}", f"cache_dir={shared}", "batch_size=3"]))
    b = run_study(load_config(study, [f"output_dir={tmp_path / 'b'}", f"cache_dir={shared}", "batch_size=8"]))
    alone = run_study(load_config(study, [f"output_dir={tmp_path / 'c'}", f"cache_dir={tmp_path / 'own'}",
                                          "batch_size=8"]))
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["analyses_read_from_cache"] == [0, 1]  # computed at batch size 8, not read from batch 3's entry
    pd.testing.assert_frame_equal(pd.read_parquet(b / "results" / "attention_distance.parquet"),
                                  pd.read_parquet(alone / "results" / "attention_distance.parquet"), check_exact=True)


# -- more workers than cores -----------------------------------------------------------------------------------------

def test_more_workers_than_cores_is_one_warning_and_the_cores(tmp_path, monkeypatch):
    import os

    study = tmp_path / "study.yaml"
    study.write_text(tiny_study_yaml())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(study, ["num_workers=99999"])
    said = [str(w.message) for w in caught if issubclass(w.category, ResultWarning)]
    assert said == [f"num_workers 99999 is more than the {cores} cores this process may use: {cores} image-reading "
                    "processes are started"]
    assert cfg.num_workers == cores
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_config(study, [f"num_workers={cores}"]).num_workers == cores
    assert not [w for w in caught if "num_workers" in str(w.message)]


# -- unreadable images said once, in one line ------------------------------------------------------------------------

def test_an_unreadable_image_is_said_once_in_one_line_whatever_the_number_of_models(tmp_path):
    images = _images(tmp_path / "images", n=15, bad=["c0/broken.png"])
    kw = TINY_STUDY_KW
    study = tmp_path / "study.yaml"
    study.write_text(f"""
models:
  - {{name: vit_small_patch16_224, label: a, pretrained: false, kwargs: {kw}}}
  - {{name: vit_small_patch16_224, label: b, pretrained: false, seed: 1, kwargs: {kw}}}
  - {{name: vit_small_patch16_224, label: c, pretrained: false, seed: 2, kwargs: {kw}}}
dataset: {{name: imagefolder, root: {images}}}
analyses:
  attention_distance: {{}}
batch_size: 4
num_workers: 0
""")
    p = subprocess.run([sys.executable, "-m", "vitscope", "-q", "run", str(study), f"output_dir={tmp_path / 'out'}"],
                       capture_output=True, text=True, timeout=600)  # Python's own warning display, not pytest's
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err  # not once per model, and not Python's file / line / source preamble
    assert lines[0].startswith("vitscope: warning: ") and "broken.png" in lines[0], lines
    assert "manifest.json" in lines[0] and ".skipped" in lines[0]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [p for p, _ in next(iter(manifest["skipped_images"].values()))] == [str(images / "c0" / "broken.png")]


@pytest.mark.parametrize("error, where", [
    (RuntimeError("unable to write to file </torch_4242_1_0>: No space left on device (28)"), "/dev/shm"),
    (OSError(28, "No space left on device", "/scratch/tmp/vitscope-pooled-x"), "/scratch/tmp"),
])
def test_a_full_disk_met_elsewhere_names_the_folder_it_was_met_in(tmp_path, capsys, monkeypatch, error, where):
    """Shared memory between the reading workers (torch's own error), or a temporary file: the sentence names
    that folder, not the run directory."""
    import vitscope.study.passes as passes

    def full(*a, **k):
        raise error

    monkeypatch.setattr(passes, "stream", full)
    study = tmp_path / "study.yaml"
    study.write_text(tiny_study_yaml())
    assert main(["-q", "run", str(study), f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vitscope: error: no space left on the device of {where} ") and err.count("\n") == 1, err
