"""The first zoo's untrained network (timm's initialisation, learned positions, seed 0) evaluated with the zoo
bar's protocol (`vitscope.zoo.evaluate.evaluate`: full CIFAR-10, every block, 20-NN and linear probe), to
compare with zoo-random (the mimetic initialisation every objective now starts from; docs/ZOO.md, round 4).

    PYTHONPATH=src python tools/zoo_random_timm.py [OUT_DIR]      (default zoo-runs/random-timm; ~8 min, 1 thread)
"""
import json
import sys
from pathlib import Path

import torch

from vitscope.models.registry import ZOO_ARCH_KWARGS
from vitscope.zoo.arch import ZooArch
from vitscope.zoo.evaluate import evaluate, write_untrained


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "zoo-runs/random-timm")
    torch.set_num_threads(1)
    # the dataclass defaults: init "timm", pos_embed "learned" (the first zoo's architecture)
    weights = write_untrained(out, seed=0, arch=ZooArch(**ZOO_ARCH_KWARGS))
    e = evaluate(weights)
    (out / "eval.json").write_text(json.dumps(e, indent=1) + "\n")
    print({k: e[k] for k in ("knn20_cls", "probe_cls", "best_knn20", "best_probe", "min_attn_dist")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
