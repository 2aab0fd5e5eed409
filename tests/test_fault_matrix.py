"""The fault matrix (issue 42): every way a study's run can die, at three points of the study, ends in at most
one line of stderr and no traceback, leaves no process behind, and the rerun gives tables bit-identical to an
uninterrupted run.

Faults: SIGINT (Ctrl-C), SIGTERM (a cluster's time limit), SIGHUP (a closed terminal), SIGKILL of the study's
process, SIGKILL of an image-reading worker, SIGKILL of the helper process, the cache's disk full, the output's
disk full. Points: mid-pass (the third batch the study's process computes), the cross-model stage, drawing the
report (the first figure drawn: the figures are drawn in forked processes, which inherit the fault, and the
first of them to draw brings it about, once). The study runs `vitscope run -q` in a subprocess of its own session
(`DRIVER`), which brings the fault about from inside at the point; the disks are small tmpfs mounts in a user and
mount namespace (`unshare -rm`), filled at the point and emptied before the rerun. A reading worker and the
helper exist only while models are computed, so those two faults have no case at the later points.

Every (fault, point) runs with ``-m slow``; one case per fault runs in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

MODELS = "".join(f"""
  - name: vit_small_patch16_224
    label: m{i}
    pretrained: false
    seed: {i}
    kwargs: {{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}""" for i in range(4))

STUDY = f"""models:{MODELS}
dataset: {{name: imagefolder, root: IMAGES}}
analyses:
  attention_distance: {{}}
  cka: {{batch_size: 8, views: [gap]}}
batch_size: 8
num_workers: 1
save_every: 1
"""

# the study's run with a fault brought about from inside at a point: `python DRIVER FAULT POINT ARGS...`
DRIVER = r'''
import os, signal, sys, time
fired = []

def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out

def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""

def fill(folder):  # the disk's every free byte taken by a file of the test's
    with open(os.path.join(folder, "filler"), "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass

def fire():
    if fired:
        return
    fired.append(1)
    if fault in ("SIGINT", "SIGTERM", "SIGHUP", "SIGKILL"):
        os.kill(MAIN, getattr(signal, fault))
        if fault == "SIGKILL":
            time.sleep(5)
    elif fault in ("worker", "helper"):
        mine = cmdline(MAIN)
        if fault == "worker":  # forked by the DataLoader: the study's own command line
            who = [p for p in children(MAIN) if cmdline(p) == mine]
        else:  # spawned by multiprocessing
            who = [p for p in children(MAIN) if "spawn_main" in cmdline(p)]
        assert who, f"no {fault} process to kill"
        for p in who:
            os.kill(p, signal.SIGKILL)
        time.sleep(0.5)
    else:
        fill(disk)

if __name__ == "__main__":  # not in a process multiprocessing spawns (it imports this file as __mp_main__)
    fault, point, disk, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    MAIN = os.getpid()
    if fault != "none" and point == "pass":
        import vitscope.study.passes as passes
        stream = passes.stream
        count = [0]
        def counted(*a, **k):
            inner = k.get("on_batch")
            def on_batch(b):
                if inner is not None:
                    inner(b)
                count[0] += 1
                if count[0] == 3:
                    fire()
            k["on_batch"] = on_batch
            return stream(*a, **k)
        passes.stream = counted
    elif fault != "none" and point == "cross":
        import vitscope.study.run as run
        cross = run.cross_stage
        def dying_cross(*a, **k):
            fire()
            return cross(*a, **k)
        run.cross_stage = dying_cross
    elif fault != "none" and point == "report":
        import vitscope.report.html as html
        png = html._png
        drawn = [0]
        def first_in_the_run():  # the figures are drawn in forked processes: one fault for the whole run
            try:
                os.close(os.open(os.path.join(disk + "-fired"), os.O_CREAT | os.O_EXCL))
                return True
            except FileExistsError:
                return False
        def dying_png(fig):
            drawn[0] += 1
            if drawn[0] == 1 and first_in_the_run():
                fire()
            return png(fig)
        html._png = dying_png

    import vitscope.study.helper as helper
    helper.MIN_IMAGES = 0  # the study's 96 images: the helper takes part
    from vitscope.cli import main
    sys.exit(main(argv))
'''

# one case, from the faulted run to the rerun, in one process (under `unshare -rm` for the disk faults: the tmpfs
# lives as long as its namespace): `python RUNNER CASE.json`; prints what it saw as JSON
RUNNER = r'''
import json, os, shutil, signal, subprocess, sys, time
case = json.load(open(sys.argv[1]))
disk = case["disk"]
if case["mount"]:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", disk], check=True)
env = {**os.environ, "VITSCOPE_WORKERS": "2", "PYTHONUNBUFFERED": "1"}

def session(sid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out

def run(fault, point):
    p = subprocess.Popen([sys.executable, case["driver"], fault, point, disk, *case["argv"]], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
    end = time.monotonic() + 15
    while session(p.pid) and time.monotonic() < end:
        time.sleep(0.2)
    left = [open(f"/proc/{q}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120] for q in session(p.pid)]
    for q in session(p.pid):
        os.kill(q, signal.SIGKILL)
    return {"rc": p.returncode, "stderr": err, "left": left}

said = {"faulted": run(case["fault"], case["point"])}
try:
    os.remove(os.path.join(disk, "filler"))
except FileNotFoundError:
    pass
said["rerun"] = run("none", "none")
results = os.path.join(case["out"], "results")
if os.path.isdir(results):
    shutil.copytree(results, case["copy"])
print(json.dumps(said))
'''

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
FAULTS = (*SIGNALS, "SIGKILL", "worker", "helper", "cache-disk", "output-disk")
POINTS = ("pass", "cross", "report")
#: one case per fault in CI; the rest of the matrix with -m slow. The report point is slow only: its fault fires in
#: the first process that draws a figure, and the helper process (spawned, without the fault) may draw them all on a
#: loaded machine, so in a full suite the case can end with no fault at all
FAST = {("SIGINT", "cross"), ("SIGTERM", "pass"), ("SIGHUP", "cross"), ("SIGKILL", "pass"), ("worker", "pass"),
        ("helper", "pass"), ("cache-disk", "pass"), ("output-disk", "cross")}


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True, timeout=30)
    return probe.returncode == 0


def _cases():
    for fault in FAULTS:
        for point in POINTS:
            if fault in ("worker", "helper") and point != "pass":
                continue  # no such process outside the models' passes
            marks = [] if (fault, point) in FAST else [pytest.mark.slow]
            yield pytest.param(fault, point, marks=marks, id=f"{fault}-{point}")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """An ImageFolder of 96 generated 32 px PNGs in two classes (files: the reading workers take part)."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for i in range(48):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{i:02d}.png")
    return root


def _study(folder: Path, images: Path) -> Path:
    study = folder / "study.yaml"
    study.write_text(STUDY.replace("IMAGES", str(images)))
    return study


def _tables(results: Path) -> dict[str, pd.DataFrame]:
    return {p.stem: pd.read_parquet(p) for p in sorted(results.glob("*.parquet"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, images):
    """The tables of an uninterrupted run (with the helper and a reading worker, as the faulted runs)."""
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "driver.py").write_text(DRIVER)
    argv = ["-q", "run", str(_study(tmp, images)), f"output_dir={tmp / 'out'}", f"cache_dir={tmp / 'cache'}"]
    p = subprocess.run([sys.executable, str(tmp / "driver.py"), "none", "none", str(tmp), *argv],
                       env={**os.environ, "VITSCOPE_WORKERS": "2"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((tmp / "out" / "manifest.json").read_text())
    assert any(m.get("helper_process") for m in manifest["models"].values()), "the helper computed no model"
    tables = _tables(tmp / "out" / "results")
    assert sorted(tables) == ["attention_distance", "cka"]
    return tables


#: what the faulted run must end with: its exit code, and the start of its one line of stderr (None: no line)
EXPECTED = {
    "SIGINT": (128 + signal.SIGINT, "vitscope: interrupted: "),
    "SIGTERM": (128 + signal.SIGTERM, "vitscope: interrupted by SIGTERM: "),
    "SIGHUP": (128 + signal.SIGHUP, "vitscope: interrupted by SIGHUP: "),
    "SIGKILL": (-signal.SIGKILL, None),  # no handler runs: nothing is said
    "worker": (2, "vitscope: error: an image-reading worker (pid "),
    "helper": (0, None),  # the study computes the helper's model itself
    "cache-disk": (2, "vitscope: error: no space left on the device of "),
    "output-disk": (2, "vitscope: error: no space left on the device of "),
}


@pytest.mark.parametrize("fault, point", list(_cases()))
def test_a_run_dying_of_each_fault_at_each_point_says_one_line_leaves_no_process_and_resumes_to_equal_tables(
        tmp_path, images, reference, fault, point):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = fault.endswith("disk")
    if mount and not _can_mount():
        pytest.skip("no tmpfs can be mounted here (`unshare -rm` is not available)")
    out = disk / "out" if fault == "output-disk" else tmp_path / "out"
    cache = disk / "cache" if fault == "cache-disk" else tmp_path / "cache"
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "runner.py").write_text(RUNNER)
    case = {"fault": fault, "point": point, "disk": str(disk), "mount": mount, "driver": str(tmp_path / "driver.py"),
            "argv": ["-q", "run", str(_study(tmp_path, images)), f"output_dir={out}", f"cache_dir={cache}"],
            "out": str(out), "copy": str(tmp_path / "rerun-results")}
    (tmp_path / "case.json").write_text(json.dumps(case))
    cmd = [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "case.json")]
    t0 = time.monotonic()
    p = subprocess.run(["unshare", "-rm", *cmd] if mount else cmd, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    said = json.loads(p.stdout.strip().splitlines()[-1])
    faulted, rerun = said["faulted"], said["rerun"]

    rc, line = EXPECTED[fault]
    if fault == "cache-disk" and point != "pass":
        rc, line = 0, None  # the cross-model stage and the report write nothing more into the cache: the run finishes
    lines = [ln for ln in faulted["stderr"].splitlines() if ln.strip()]
    assert "Traceback" not in faulted["stderr"] and len(lines) <= 1, faulted["stderr"][-3000:]
    assert faulted["rc"] == rc, faulted["stderr"][-3000:]
    if line is None:
        assert lines == [], lines
    else:
        assert lines and lines[0].startswith(line), lines
        if fault not in ("cache-disk", "output-disk"):  # what was kept, and that the same command resumes
            assert "rerun the same command to resume" in lines[0], lines[0]
        else:
            assert str(cache if fault == "cache-disk" else out) in lines[0], lines[0]
    assert faulted["left"] == [], f"processes left behind: {faulted['left']}"

    assert rerun["rc"] == 0 and rerun["left"] == [], rerun
    assert [ln for ln in rerun["stderr"].splitlines() if ln.strip()] == [], rerun["stderr"][-3000:]
    tables = _tables(tmp_path / "rerun-results")
    assert sorted(tables) == sorted(reference)
    for name, frame in tables.items():
        pd.testing.assert_frame_equal(frame, reference[name], check_exact=True, obj=name)
    assert time.monotonic() - t0 < 600
