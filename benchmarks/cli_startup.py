"""How long the command line takes to answer: each listing command, and each refusal of `vitscope run` (a config
mistake, a run directory another run is writing into: issue 41), in fresh processes, against the 1.5 s goal.

Each command runs as `python -m vitscope ...` in a new process (imports included, as a person typing it meets
them), output discarded, `--reps` times; the median and the fastest are printed beside the goal, with the
1-minute load average before and after (a busy machine stretches every number: compare with the load). A
refusal must fail (exit code not 0) and a listing succeed, or the benchmark stops.

    python benchmarks/cli_startup.py                   # --help, models, taps, datasets, analyses, the refusals
    python benchmarks/cli_startup.py --reps 9 --also "run --help" --also "taps vit_small_patch16_224"
    python benchmarks/cli_startup.py --no-refusals     # the listings only
    python benchmarks/cli_startup.py --busy 2          # beside two busy loops (a loaded 2-core machine)

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
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

GOAL_S = 1.5
COMMANDS = ["--help", "models", "taps zoo-dino", "datasets", "analyses"]

#: a one-model study (tests/study_fixtures.tiny_study_yaml), which each refusal gets wrong in one place
STUDY = """\
models:
  - {name: vit_small_patch16_224, label: tiny, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
dataset: {name: synthetic-shapes, n_images: 8}
analyses:
  cka: {batch_size: 4, views: [gap]}
batch_size: 4
progress: false
"""
#: (label, what `vitscope run STUDY` is given): each a config mistake; "busy" is the run directory another run
#: holds ({dir}: the benchmark's folder)
REFUSALS = [
    ("run: unknown analysis", "analyses.ckaa={}"),
    ("run: unknown model", "models.0.name=zoo-dnio"),
    ("run: missing folder", "dataset.name=imagefolder dataset.root={dir}/nowhere"),
    ("run: batch_size 0", "batch_size=0"),
    ("run: empty folder", "dataset.name=imagefolder dataset.root={dir}/empty"),
    ("run: unknown parameter", "analyses.cka.viewz=[gap]"),
    ("run: parameter value out of range", "analyses.similarity.n_permutations=50"),
    ("run: parameter value of the wrong type", "analyses.similarity.n_permutations=many"),
    ("run: unknown dtype", "dtype=fp8"),
    ("run: not a device", "device=gpu0"),
    ("run: another run writing", "output_dir={dir}/busy"),
]


def wall(argv: list[str], env: dict[str, str], fails: bool = False) -> float:
    """Seconds of one `python -m vitscope ARGV` in a fresh process; it must succeed, or with ``fails`` fail
    (a refusal: exit code not 0)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vitscope", *argv], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if (done.returncode != 0) != fails:
        raise SystemExit(f"vitscope {shlex.join(argv)}: exit code {done.returncode}, expected "
                         f"{'a failure' if fails else '0'}\n{done.stderr[-2000:]}")
    return took


@contextmanager
def refusal_cases(env: dict[str, str]):
    """The refusals as (label, argv) with their files in a temporary folder: the study, an empty folder, and a run
    directory a second process holds the writer lock of for as long as they are timed."""
    with tempfile.TemporaryDirectory(prefix="vitscope-refusals-") as tmp:
        d = Path(tmp)
        (d / "study.yaml").write_text(STUDY + f"output_dir: {d / 'out'}\n")
        (d / "empty").mkdir()
        (d / "busy").mkdir()
        holder = subprocess.Popen([sys.executable, "-c", (
            "import sys, time\nfrom vitscope.study import rundir\nlock = rundir.hold(sys.argv[1])\n"
            "print('held', flush=True)\ntime.sleep(3600)\n"), str(d / "busy")], env=env, stdout=subprocess.PIPE,
            text=True)
        try:
            if holder.stdout.readline().strip() != "held":
                raise SystemExit("the process that holds the busy run directory did not start")
            yield [(label, ["run", str(d / "study.yaml"), *shlex.split(args.replace("{dir}", str(d)))])
                   for label, args in REFUSALS]
        finally:
            holder.kill()
            holder.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per command (default 5)")
    ap.add_argument("--also", action="append", default=[], metavar="COMMAND", help="another command to time")
    ap.add_argument("--no-refusals", action="store_true", help="time the listing commands only")
    ap.add_argument("--busy", type=int, default=0, help="busy loops to run beside (default 0: as the machine is)")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="recompile vitscope at every start (PYTHONDONTWRITEBYTECODE=1)")
    args = ap.parse_args()
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's vitscope, whatever is installed
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Python's default: a module's bytecode is cached on its first import, so a person's second command reads it
    # (this machine's environment sets PYTHONDONTWRITEBYTECODE, which recompiles vitscope at every start)
    unset = env.pop("PYTHONDONTWRITEBYTECODE", None) is not None and not args.no_bytecode_cache
    if args.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.reps} fresh processes each"
          f"{f'; {args.busy} busy loops beside' if args.busy else ''}"
          f"{'; PYTHONDONTWRITEBYTECODE unset (bytecode cached, as by default)' if unset else ''}")
    try:
        _time_all(args, env)
    finally:
        for p in busy:
            p.kill()


def _time_all(args: argparse.Namespace, env: dict[str, str]) -> None:
    print(f"{'command':<36} {'median s':>9} {'min s':>7}  goal {GOAL_S} s")

    def time_it(label: str, argv: list[str], fails: bool = False) -> None:
        wall(argv, env, fails)  # once to warm the page cache: a first start after an install reads every file
        times = [wall(argv, env, fails) for _ in range(args.reps)]
        med = statistics.median(times)
        verdict = "ok" if med <= GOAL_S else "ABOVE"
        print(f"{label:<36} {med:>9.2f} {min(times):>7.2f}  {verdict}", flush=True)

    for command in [*COMMANDS, *args.also]:
        time_it("vitscope " + command, shlex.split(command))
    if not args.no_refusals:
        with refusal_cases(env) as cases:
            for label, argv in cases:
                time_it(label + " (refused)", argv, fails=True)
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
