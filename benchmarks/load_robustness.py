"""The default study on a quiet machine and beside busy-looping processes: wall and CPU time, in one run.

Each measurement is `vitscope run` (the embedded default study, or a config you pass) in a fresh process
from a cold cache, with N processes spinning in `while True: pass` beside it (N = 0: quiet; default N = the
number of cores, what issue 20 measured). Printed per variant: wall seconds, CPU seconds of the study's
process (user + sys, from getrusage of children), and the loaded / quiet ratios (goals: wall <= 3x, CPU
about 1x). Variants are environments to compare, e.g. the thread policy vitscope picks against one you
force:

    python benchmarks/load_robustness.py                          # vitscope's own policy, quiet vs loaded
    python benchmarks/load_robustness.py --variant default \\
        --variant "spin:VITSCOPE_THREADS=off OMP_WAIT_POLICY=ACTIVE"     # compare with busy-waiting threads
    python benchmarks/load_robustness.py --reps 3 -- models='[{name: zoo-sup}]'   # overrides for `run`

"Quiet" is only as quiet as the machine: the script prints the 1-minute load average before each run; on a
shared machine read the ratios between variants measured side by side, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time


def _spin() -> None:
    while True:
        pass


def run_once(env_extra: dict[str, str], busy: int, overrides: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one cold `vitscope run` beside ``busy`` spinning processes."""
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        time.sleep(0.5 if busy else 0)
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, **env_extra}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "vitscope", "run", "-q", f"output_dir={tmp}/run",
                            f"cache_dir={tmp}/cache", *overrides], env=env, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        for p in spinners:
            p.kill()
            p.join()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes beside the loaded run")
    ap.add_argument("--reps", type=int, default=1, help="runs per (variant, condition); the median is printed")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:KEY=VALUE KEY=VALUE ... environment of one variant ('default' = as is)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for `vitscope run` (after --)")
    args = ap.parse_args()
    variants: dict[str, dict[str, str]] = {}
    for v in args.variant or ["default"]:
        name, _, rest = v.partition(":")
        variants[name] = dict(kv.split("=", 1) for kv in rest.split()) if rest else {}
    print(f"{os.cpu_count()} cores; loaded = {args.busy} busy-looping processes beside the run; "
          f"{args.reps} run(s) each, median; overrides: {' '.join(args.overrides) or '-'}")
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        for name, env in variants.items():  # interleaved: a drift in the machine's load hits every variant alike
            for busy in (0, args.busy):
                load = os.getloadavg()[0]
                wall, cpu = run_once(env, busy, args.overrides)
                results.setdefault((name, busy), []).append((wall, cpu))
                print(f"  [{rep + 1}/{args.reps}] {name:<12} {'loaded' if busy else 'quiet':<6} wall {wall:7.1f} s"
                      f"  CPU {cpu:7.1f} s  (load average before: {load:.1f})", flush=True)

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    print(f"{'variant':<12} {'quiet wall':>10} {'quiet CPU':>10} {'loaded wall':>12} {'loaded CPU':>11} "
          f"{'wall ratio':>10} {'CPU ratio':>10}")
    for name in variants:
        qw, qc = (med([r[i] for r in results[(name, 0)]]) for i in (0, 1))
        lw, lc = (med([r[i] for r in results[(name, args.busy)]]) for i in (0, 1))
        print(f"{name:<12} {qw:9.1f}s {qc:9.1f}s {lw:11.1f}s {lc:10.1f}s {lw / qw:9.2f}x {lc / qc:9.2f}x")
    print("goals (issue 20): loaded wall <= 3x quiet wall, loaded CPU about the quiet CPU")


if __name__ == "__main__":
    main()
