"""The first zoo's untrained network (timm's initialisation, learned positions, seed 0) evaluated with the zoo
bar's protocol (`vitscope.zoo.evaluate.evaluate`: full CIFAR-10, every block, 20-NN and linear probe), to
compare with zoo-random (the mimetic initialisation every objective now starts from; docs/ZOO.md, round 4).

    PYTHONPATH=src python tools/zoo_random_timm.py [OUT_DIR]      (default zoo-runs/random-timm; ~8 min, 1 thread)
"""
import json
import sys
from pathlib import Path

import torch

from vitscope.models import save_checkpoint
from vitscope.models.registry import ZOO_ARCH_KWARGS, ModelSpec, WeightSource
from vitscope.zoo.arch import TIMM_ARCH, ZooArch, build_encoder, zoo_preprocessing
from vitscope.zoo.evaluate import evaluate


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "zoo-runs/random-timm")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    arch = ZooArch(**ZOO_ARCH_KWARGS)  # the dataclass defaults: init "timm", pos_embed "learned"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vit = build_encoder(arch, 0)
    spec = ModelSpec("zoo-random-timm", TIMM_ARCH, "none", "random init", WeightSource("none"),
                     zoo_preprocessing(arch.img_size), arch.kwargs(0))
    save_checkpoint(vit, out / "encoder.safetensors", spec, half=True)
    e = evaluate(out / "encoder.safetensors")
    (out / "eval.json").write_text(json.dumps(e, indent=1) + "\n")
    print({k: e[k] for k in ("knn20_cls", "probe_cls", "best_knn20", "best_probe", "min_attn_dist")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
