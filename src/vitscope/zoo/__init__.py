"""The controlled zoo: one small ViT trained with each objective under one budget of image-views.

    from vitscope.zoo import TrainConfig, train
    card = train(TrainConfig(objective="dino", out="zoo/dino"))   # or: vitscope zoo train --objective dino

Objectives (one module each): supervised, dino, mocov3, mae, simmim, hybrid, finetune. docs/ZOO.md has
the architecture, the budget arithmetic and the commands.
"""

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode
from vitscope.zoo.base import Objective
from vitscope.zoo.objectives import OBJECTIVES, build_objective
from vitscope.zoo.train import ZOO_BATCH_SIZE, ZOO_BUDGET_VIEWS, TrainConfig, train

__all__ = ["OBJECTIVES", "ZOO_ARCH", "ZOO_BATCH_SIZE", "ZOO_BUDGET_VIEWS", "Objective", "TrainConfig", "ZooArch",
           "build_encoder", "build_objective", "encode", "train"]
