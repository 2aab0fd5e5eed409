"""Per-block mean attention distance of freshly initialised (untrained) zoo encoders on CIFAR-10 test images.

    PYTHONPATH=src python tools/zoo_init_attention.py '{}' '{"init": "mimetic"}' \\
        '{"init": "mimetic", "pos_embed": "sincos"}'

Each argument is a JSON dict of `vitscope.zoo.arch.ZooArch` overrides; the encoder is built with
``torch.manual_seed(SEED)`` (``--seed``) and measured as the training monitor does
(`KNNMonitor.block_features`, unit square, mean over heads and the first 256 images of the monitor's
class-balanced test subset). Uniform attention on the 8x8 grid gives 0.591.
"""

from __future__ import annotations

import argparse
import json

import torch

from vitscope.zoo.arch import CIFAR_MEAN, CIFAR_STD, ZooArch, build_encoder
from vitscope.zoo.data import Augment, ViewSpec, load_data
from vitscope.zoo.knn import KNNMonitor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archs", nargs="+", help="JSON dicts of ZooArch overrides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="CIFAR-10 root (default: found as `vitscope zoo train` finds it)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = load_data(args.data, size=32, seed=0)
    mon = KNNMonitor(data, Augment(ViewSpec(n_global=1), 32, CIFAR_MEAN, CIFAR_STD, 4), 2000, 1000)
    images = data.test.images[mon.test_idx][:256]
    for kw in args.archs:
        torch.manual_seed(args.seed)
        net = build_encoder(ZooArch(**json.loads(kw)), 0).eval()
        _, _, dist = mon.block_features(net, images, 256)
        print(f"{kw:45s} " + " ".join(f"{x:.3f}" for x in dist), flush=True)


if __name__ == "__main__":
    main()
