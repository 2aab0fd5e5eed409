"""How fast a report opens in headless Chromium, and how large it is, in one run.

    python benchmarks/report_open.py RUN_DIR [--reps 5]      # a run directory with report.html

Printed: the page's size against its budget (2 x 6.1 MB, the static report's size when the explorer was
asked for), and per load the time from navigation to the page's scripts having built every chart, grid and the
explorer (`window.vitscope.readyMs`, the goal: interactive within 2 s), with DOMContentLoaded and the load event
beside it. Each load is a fresh profile and a cold page (no cache between loads). Needs chromium, chromedriver
and selenium (the test extra).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BUDGET_MB = 2 * 6.1


def open_once(report: Path) -> dict[str, float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    with tempfile.TemporaryDirectory() as profile:
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-background-networking", f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=opts)
        try:
            driver.set_window_size(1200, 1000)
            driver.get(report.resolve().as_uri())
            driver.set_script_timeout(30)
            return driver.execute_async_script(
                "const done = arguments[0]; const t = performance.timing;"
                "(function wait() { if (window.vitscope && window.vitscope.ready && t.loadEventEnd) done({"
                " ready: window.vitscope.readyMs, dom: t.domContentLoadedEventEnd - t.navigationStart,"
                " load: t.loadEventEnd - t.navigationStart}); else setTimeout(wait, 20); })();")
        finally:
            driver.quit()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    report = args.run_dir / "report.html"
    if not report.is_file():
        print(f"{report} does not exist: run a study first (vitscope run output_dir={args.run_dir})", file=sys.stderr)
        return 2
    size = report.stat().st_size / 1e6
    print(f"report.html: {size:.2f} MB ({size / BUDGET_MB:.2f} of the {BUDGET_MB:.1f} MB budget)")
    loads = [open_once(report) for _ in range(args.reps)]
    for k in ("ready", "dom", "load"):
        vals = [x[k] for x in loads]
        each = ", ".join(f"{v:.0f}" for v in vals)
        print(f"{k:6s} ms: median {statistics.median(vals):7.0f}  max {max(vals):7.0f}  ({each})")
    print(f"interactive within 2 s: {'yes' if max(x['ready'] for x in loads) <= 2000 else 'no'} (max of {args.reps})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
