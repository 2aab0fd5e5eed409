"""How long the command line takes to answer: each listing command in fresh processes, against the 1.5 s goal.

Each command runs as `python -m vitscope ...` in a new process (imports included, as a person typing it meets
them), output discarded, `--reps` times; the median and the fastest are printed beside the goal, with the
1-minute load average before and after (a busy machine stretches every number: compare with the load).

    python benchmarks/cli_startup.py                   # --help, models, taps, datasets, analyses
    python benchmarks/cli_startup.py --reps 9 --also "run --help" --also "taps vit_small_patch16_224"

`taps NAME` of a registry entry prints a shipped listing; of any other model it builds the model (torch and
timm: seconds). What a command imports: `python -X importtime -m vitscope COMMAND 2> imports.txt`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 1.5
COMMANDS = ["--help", "models", "taps zoo-dino", "datasets", "analyses"]


def wall(argv: list[str], env: dict[str, str]) -> float:
    """Seconds of one `python -m vitscope ARGV` in a fresh process (it must succeed)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vitscope", *argv], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per command (default 5)")
    ap.add_argument("--also", action="append", default=[], metavar="COMMAND", help="another command to time")
    args = ap.parse_args()
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's vitscope, whatever is installed
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.reps} fresh processes each")
    print(f"{'command':<32} {'median s':>9} {'min s':>7}  goal {GOAL_S} s")
    for command in [*COMMANDS, *args.also]:
        argv = shlex.split(command)
        wall(argv, env)  # once to warm the page cache: a first start after an install reads every file
        times = [wall(argv, env) for _ in range(args.reps)]
        med = statistics.median(times)
        verdict = "ok" if med <= GOAL_S else "ABOVE"
        print(f"{'vitscope ' + command:<32} {med:>9.2f} {min(times):>7.2f}  {verdict}")
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
