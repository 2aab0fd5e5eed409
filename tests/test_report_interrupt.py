"""Ctrl-C while the report's figures are drawn in their processes: one line, exit 130, within seconds, and no
process left; a second Ctrl-C ends the exit at once, with no traceback either (the drawing processes used to die
with the first, breaking the pool, whose manager thread then printed CPython's InvalidStateError)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_study_cli import TINY_YAML

#: `vitscope report RUN` with every analysis's figures slowed to 1 s, and a file that says drawing has begun
SLOW_REPORT = """
import pathlib, sys, time
import vitscope.report.html as html
draw = html._draw
def slow(run, name):
    pathlib.Path(sys.argv[-1] + '.drawing').touch()
    time.sleep(1.0)
    return draw(run, name)
html._draw = slow
from vitscope.cli import main
sys.argv = ['vitscope', 'report', sys.argv[-1]]
raise SystemExit(main())
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from vitscope.study import load_config, run_study

    d = tmp_path_factory.mktemp("interrupt")
    (d / "study.yaml").write_text(TINY_YAML)
    more = ["analyses.attention_nmi={}", "analyses.svd_volume={}", "analyses.fourier={}",
            "analyses.attention_explorer={keep_images: 1}"]  # figures enough for both drawing processes
    return run_study(load_config(d / "study.yaml", [f"output_dir={d / 'run'}", *more]))


def _interrupt(run_dir, gaps: list[float]) -> tuple[int, str, float, int]:
    """Start the slow report, send SIGINT to its process group once drawing began and again after each of
    ``gaps`` seconds; (exit code, output, seconds from the first SIGINT to the exit, its process group)."""
    marker = run_dir.with_name(run_dir.name + ".drawing")
    marker.unlink(missing_ok=True)
    env = {**os.environ, "VITSCOPE_WORKERS": "2"}
    p = subprocess.Popen([sys.executable, "-c", SLOW_REPORT, str(run_dir)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[0].decode()
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)
        t = time.monotonic()
        for gap in gaps:
            time.sleep(gap)
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:  # already gone
                break
        out = p.communicate(timeout=30)[0].decode()
        return p.returncode, out, time.monotonic() - t, p.pid
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def _group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ctrl_c_while_drawing_is_one_line_and_stops_the_drawing_processes(run_dir):
    from vitscope.report.html import report_workers

    if report_workers() < 2:
        pytest.skip("the figures are drawn in this process here")
    code, out, seconds, group = _interrupt(run_dir, [])
    assert code == 130, out
    assert out.strip().splitlines()[-1] == "vitscope: interrupted" and "Traceback" not in out, out
    assert seconds < 10  # the figures in hand are not finished first
    deadline = time.monotonic() + 5
    while not _group_gone(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_gone(group)  # no drawing process left behind


def test_a_second_ctrl_c_ends_the_exit_without_a_traceback(run_dir):
    from vitscope.report.html import report_workers

    if report_workers() < 2:
        pytest.skip("the figures are drawn in this process here")
    code, out, _, _ = _interrupt(run_dir, [0.05])
    assert code in (130, -signal.SIGINT), out
    assert "Traceback" not in out and "vitscope: interrupted" in out, out
