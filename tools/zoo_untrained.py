"""The zoo's untrained network at a seed, evaluated with the zoo bar's protocol (`vitscope.zoo.evaluate.evaluate`:
full CIFAR-10, every block, 20-NN and linear probe): the bar's reference and its spread over seeds.

    PYTHONPATH=src python tools/zoo_untrained.py [--init current|first] [--seed N] [--out DIR]   (~8 min, 1 thread)

`--init current` (default): the zoo's architecture (mimetic attention, sin-cos positions), i.e. zoo-random at
seed 0; `--init first`: the first zoo's (timm's initialisation, learned positions; docs/zoo-history.md).
Default OUT: zoo-runs/untrained-INIT-sSEED.
"""
import argparse
import json
from pathlib import Path

import torch

from vitscope.models.registry import ZOO_ARCH_KWARGS
from vitscope.zoo.arch import ZOO_ARCH, ZooArch
from vitscope.zoo.evaluate import evaluate, write_untrained


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", choices=["current", "first"], default="current")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    out = a.out or Path(f"zoo-runs/untrained-{a.init}-s{a.seed}")
    torch.set_num_threads(1)
    # "first": the dataclass defaults, init "timm" and pos_embed "learned"
    arch = ZOO_ARCH if a.init == "current" else ZooArch(**ZOO_ARCH_KWARGS)
    weights = write_untrained(out, seed=a.seed, arch=arch)
    e = evaluate(weights)
    (out / "eval.json").write_text(json.dumps(e, indent=1) + "\n")
    print({k: e[k] for k in ("knn20_cls", "probe_cls", "best_knn20", "best_probe", "min_attn_dist")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
