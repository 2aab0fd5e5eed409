"""The objectives by name, and how to build one reproducibly."""

from __future__ import annotations

from typing import Any

import torch

from vitscope.zoo.arch import ZOO_ARCH, ZooArch
from vitscope.zoo.base import Objective
from vitscope.zoo.dino import DINO
from vitscope.zoo.finetune import FineTune
from vitscope.zoo.hybrid import Hybrid
from vitscope.zoo.mae import MAE
from vitscope.zoo.mocov3 import MoCoV3
from vitscope.zoo.simmim import SimMIM
from vitscope.zoo.supervised import Supervised

OBJECTIVES: dict[str, type[Objective]] = {
    c.name: c for c in (Supervised, DINO, MoCoV3, MAE, SimMIM, Hybrid, FineTune)
}


def build_objective(name: str, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, seed: int = 0,
                    **kwargs: Any) -> Objective:
    """The objective ``name`` with freshly initialised networks; the same seed gives the same weights
    (initialisation draws from the global RNG inside a fork, seeded with ``seed``)."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return OBJECTIVES[name](arch=arch, num_classes=num_classes, **kwargs)
