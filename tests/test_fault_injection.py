"""A study killed (SIGKILL: no handler runs) at any point - mid-pass, mid-write of a cache entry or of a results
file, mid-report, or at a random time - and run again ends with the tables of an uninterrupted run, bit for
bit, and a report drawn from exactly those tables.

The study runs in a subprocess (`DRIVER`) that counts the points where it could die and, when told to, sends
itself SIGKILL at the n-th point of one kind: ``pass`` (after a batch was fed to every analysis), ``write``
(inside a write of any file: cache entries, partial states, tables, manifest, report; ``write:<text>`` counts
only writes to files whose name holds ``<text>``), ``report`` (between two figures of the report) or ``time``
(after a given number of milliseconds)."""

import json
import random
import signal
import subprocess
import sys

import pandas as pd
import pytest
from study_fixtures import TWO_TINY_MODELS

from vitscope.report.html import report_digest, results_digest
from vitscope.study import load_config, run_study

STUDY = TWO_TINY_MODELS + """\
dataset: {name: synthetic-shapes, n_images: 16}
analyses:
  attention_distance: {}
  cka: {batch_size: 4, views: [gap]}
  semantics: {ks: [3], views: [cls, gap], kmeans: false, test_every: 2}
batch_size: 4
save_every: 1
progress: false
"""

DRIVER = r'''
import json, os, signal, sys, threading, time
study, out, cache, kind, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
kind, _, only = kind.partition(":")
counts = {"pass": 0, "write": 0, "report": 0}

MAIN = os.getpid()  # the study's process; a report figure may be drawn in a forked process

def tick(k):
    counts[k] += 1
    if k == kind and counts[k] == n:
        os.kill(MAIN, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

if kind == "time":
    threading.Timer(n / 1000, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()

import vitscope.files as files
import vitscope.report.html as html

class Dying:  # a file whose every write may be the last thing this process does
    def __init__(self, f, counted): self.f, self.counted = f, counted
    def write(self, b):
        r = self.f.write(b)
        if self.counted:
            tick("write")
        return r
    def __getattr__(self, k): return getattr(self.f, k)
    def __enter__(self): return self
    def __exit__(self, *e): self.f.close()

files.open = lambda p, mode="r": Dying(open(p, mode), only in os.path.basename(p))
png = html._png
def dying_png(fig):
    tick("report")
    return png(fig)
html._png = dying_png

from vitscope.study import load_config, run_study
run_study(load_config(study, [f"output_dir={out}", f"cache_dir={cache}"]), on_batch=lambda m, b: tick("pass"))
print(json.dumps(counts))
'''


def _drive(tmp_path, run, kind="none", n=0, timeout=600):
    """One study run in a subprocess, killed at the n-th point of ``kind``; its counts when it finished, else None."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    (tmp_path / "study.yaml").write_text(STUDY)
    p = subprocess.run([sys.executable, str(driver), str(tmp_path / "study.yaml"), str(tmp_path / run),
                        str(tmp_path / f"{run}-cache"), kind, str(n)], capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode == -signal.SIGKILL:
        return None
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _assert_same_tables_and_report(run_dir, ref_dir):
    names = sorted(p.stem for p in (ref_dir / "results").glob("*.parquet"))
    assert names == ["attention_distance", "cka", "semantics"]
    assert sorted(p.stem for p in (run_dir / "results").glob("*.parquet")) == names
    for name in names:
        pd.testing.assert_frame_equal(pd.read_parquet(run_dir / "results" / f"{name}.parquet"),
                                      pd.read_parquet(ref_dir / "results" / f"{name}.parquet"), check_exact=True)
    assert report_digest(run_dir) == results_digest(run_dir) != {}  # the report shows exactly these tables
    json.loads((run_dir / "manifest.json").read_text())  # whole, not cut short
    leftovers = [p for p in run_dir.rglob("*.tmp")]
    assert leftovers == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (in this process: the tables do not depend on which process computes them)."""
    tmp = tmp_path_factory.mktemp("ref")
    (tmp / "study.yaml").write_text(STUDY)
    return run_study(load_config(tmp / "study.yaml", [f"output_dir={tmp / 'ref'}", f"cache_dir={tmp / 'c'}"]))


def _kill_then_finish(tmp_path, ref_dir, kills):
    """Kill runs of the same study at the given points, one after another, then finish it; compare."""
    for kind, n in kills:
        assert _drive(tmp_path, "run", kind, n) is None, f"the run was not killed at {kind} {n}"
    run_study(load_config(tmp_path / "study.yaml", [f"output_dir={tmp_path / 'run'}",
                                                    f"cache_dir={tmp_path / 'run-cache'}"]))
    _assert_same_tables_and_report(tmp_path / "run", ref_dir)


def test_killed_mid_save_mid_pass_then_mid_report_then_rerun_matches_an_uninterrupted_run(tmp_path, reference):
    # partial states are written after every batch (3 analyses, ~200 write calls per batch): the 1000th write
    # falls inside the 2nd model's second save; the rerun resumes that model from its first batch and dies
    # drawing the report's 2nd figure; the last run finishes
    _kill_then_finish(tmp_path, reference, [("write:.part-", 1000), ("report", 2)])


@pytest.fixture(scope="module")
def counts(tmp_path_factory, reference):
    """How many kill points of each kind an uninterrupted subprocess run passes (it also matches the reference)."""
    tmp = tmp_path_factory.mktemp("count")
    counts = _drive(tmp, "ref")
    _assert_same_tables_and_report(tmp / "ref", reference)
    assert counts["pass"] == 8 and counts["write"] > 20 and counts["report"] >= 3
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_killed_at_random_points_then_rerun_matches_an_uninterrupted_run(tmp_path, reference, counts, seed):
    rng = random.Random(seed)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["pass", "write", "write", "report", "time"])
        n = rng.randint(1000, 20000) if kind == "time" else rng.randint(1, counts[kind])
        _drive(tmp_path, "run", kind, n)  # may finish before its point: later runs then read everything back
    run_study(load_config(tmp_path / "study.yaml", [f"output_dir={tmp_path / 'run'}",
                                                    f"cache_dir={tmp_path / 'run-cache'}"]))
    _assert_same_tables_and_report(tmp_path / "run", reference)


EXPORT_DRIVER = r'''
import os, signal, sys
import matplotlib.figure
run_dir, out, n, only = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] or None
calls = [0]
save = matplotlib.figure.Figure.savefig
def dying_savefig(self, path, *a, **k):  # the n-th figure: half of its file lands, then the process dies
    save(self, path, *a, **k)
    calls[0] += 1
    if calls[0] == n:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
matplotlib.figure.Figure.savefig = dying_savefig
from vitscope.report.export import export
export(run_dir, out, "pdf", analyses=only)
print(calls[0])
'''


def _export(tmp_path, run_dir, out, n, only=()):
    driver = tmp_path / "export_driver.py"
    driver.write_text(EXPORT_DRIVER)
    p = subprocess.run([sys.executable, str(driver), str(run_dir), str(out), str(n), *only], capture_output=True,
                       text=True, timeout=600)
    if p.returncode == -signal.SIGKILL:
        return None
    assert p.returncode == 0, p.stderr[-3000:]
    return int(p.stdout.strip().splitlines()[-1])


def _export_files(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} if out.is_dir() else {}


def _assert_complete_export(out):
    """An index listing exactly the figure files there, each a whole PDF."""
    listed = [r.split("\t")[0] for r in (out / "figures.tsv").read_text().splitlines()[1:]]
    assert sorted(listed) == sorted(p.name for p in out.glob("*.pdf"))
    for name in listed:
        assert (out / name).read_bytes().rstrip().endswith(b"%%EOF"), name  # not cut short


def test_a_killed_export_leaves_the_previous_one_and_a_new_one_drops_stale_figures(tmp_path, reference):
    out = tmp_path / "figs"
    total = _export(tmp_path, reference, out, 0)  # never killed: how many figures it draws
    assert total and total >= 3
    _assert_complete_export(out)
    (out / "notes.txt").write_text("mine")  # a file no export wrote
    before = _export_files(out)
    for n in sorted({1, total}):  # killed at the first and at the last figure (its index not yet written)
        assert _export(tmp_path, reference, out, n) is None
        assert _export_files(out) == before  # the previous export, whole, and the user's file
    fewer = ["attention_distance"]
    assert 0 < _export(tmp_path, reference, out, 0, fewer) < total
    _assert_complete_export(out)
    assert all(p.name.startswith("attention_distance-") for p in out.glob("*.pdf"))  # stale figures gone
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".figs")] == []  # leftovers cleared
