"""The controlled zoo: one small ViT trained with each objective under one budget of image-views.

    from vitscope.zoo import TrainConfig, train
    card = train(TrainConfig(objective="dino", out="zoo/dino"))   # or: vitscope zoo train --objective dino

Objectives (one module each): supervised, dino, mocov3, mae, simmim, hybrid, finetune. docs/ZOO.md has
the architecture, the budget arithmetic and the commands.
"""

from vitscope._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {  # imported on first use: `vitscope zoo --help` needs no torch
    **{n: "vitscope.zoo.arch" for n in ("ZOO_ARCH", "ZooArch", "build_encoder", "encode")},
    "Objective": "vitscope.zoo.base", "OBJECTIVES": "vitscope.zoo.objectives",
    "build_objective": "vitscope.zoo.objectives",
    **{n: "vitscope.zoo.train" for n in ("ZOO_BATCH_SIZE", "ZOO_BUDGET_VIEWS", "TrainConfig", "train")},
})

__all__ = ["OBJECTIVES", "ZOO_ARCH", "ZOO_BATCH_SIZE", "ZOO_BUDGET_VIEWS", "Objective", "TrainConfig", "ZooArch",
           "build_encoder", "build_objective", "encode", "train"]
