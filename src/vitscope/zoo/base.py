"""What every zoo objective is: an `nn.Module` that turns a batch of views into a loss.

The training loop (`vitscope.zoo.train`) knows nothing about any objective beyond this interface:
``views`` (what the data pipeline must produce), ``forward(batch) -> (loss, metrics)``, the hooks
around the optimiser step (EMA teachers), and ``export()`` (the network saved as the zoo model).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from vitscope.models.registry import Preprocessing
from vitscope.zoo.arch import ZOO_ARCH, ZooArch, zoo_preprocessing
from vitscope.zoo.data import ViewBatch, ViewSpec


class Objective(nn.Module):
    """Base class. Subclasses set ``name``, ``family``, ``citation``, ``views`` and ``encoder``."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = "none"  # registry family of the exported model
    citation: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init__(self, arch: ZooArch = ZOO_ARCH):
        super().__init__()
        self.arch = arch
        self.views = ViewSpec()

    # -- what the loop needs -------------------------------------------------------------------------
    @property
    def img_size(self) -> int:
        return self.arch.img_size

    @property
    def patch_size(self) -> int:
        return self.arch.patch_size

    @property
    def preprocessing(self) -> Preprocessing:
        return zoo_preprocessing(self.img_size)

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:  # pragma: no cover
        raise NotImplementedError

    def set_progress(self, step: int, total: int) -> None:
        """Called before the forward of step ``step`` (schedules that depend on training progress)."""

    def before_optimizer_step(self, step: int, total: int) -> None:
        """Called after backward, before clipping and the optimiser step (e.g. freezing a layer)."""

    @torch.no_grad()
    def after_optimizer_step(self, step: int, total: int) -> None:
        """Called after the optimiser step (EMA teachers)."""

    def export(self) -> nn.Module:
        """The timm ViT saved as the zoo model (the teacher for DINO, the base encoder for MoCo)."""
        return self.encoder

    def parts(self) -> nn.Module | None:
        """The trained parts besides the encoder that the objective's own held-out loss needs (saved beside the
        encoder as ``decoder.safetensors``); None when the bar judges the encoder's features alone."""
        return None

    def export_kwargs(self) -> dict[str, Any]:
        """timm keyword arguments of the exported network."""
        return self.arch.kwargs(int(getattr(self.export(), "num_classes", 0)))

    def export_fields(self) -> dict[str, str]:
        """ModelSpec fields of the exported model."""
        from vitscope.zoo.arch import TIMM_ARCH

        return {"family": self.family, "supervision": self.name, "citation": self.citation, "arch": TIMM_ARCH}

    def hparams(self) -> dict[str, Any]:
        """Objective hyper-parameters recorded in the card (and checked on resume)."""
        return {}

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]


# -- shared pieces --------------------------------------------------------------------------------------

def cosine_ramp(base: float, final: float, step: int, total: int) -> float:
    """base -> final along half a cosine over ``total`` steps (EMA momentum schedule of BYOL/DINO/MoCo v3)."""
    t = min(max(step, 0), max(total, 1)) / max(total, 1)
    return final - (final - base) * (math.cos(math.pi * t) + 1) / 2


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """teacher <- m * teacher + (1 - m) * student, parameter by parameter (buffers are not averaged)."""
    for pt, ps in zip(teacher.parameters(), student.parameters(), strict=True):
        pt.mul_(momentum).add_(ps.detach(), alpha=1 - momentum)


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy that receives no gradients (a teacher / momentum network)."""
    import copy

    teacher = copy.deepcopy(module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def build_mlp(in_dim: int, hidden: int, out_dim: int, layers: int, last_bn: bool = True) -> nn.Sequential:
    """MoCo v3's projector / predictor MLP: Linear-BN-ReLU blocks, BN without affine after the last
    Linear (Chen, Xie, He 2021, `moco-v3/moco/builder.py: _build_mlp`)."""
    mods: list[nn.Module] = []
    for i in range(layers):
        d1 = in_dim if i == 0 else hidden
        d2 = out_dim if i == layers - 1 else hidden
        mods.append(nn.Linear(d1, d2, bias=False))
        if i < layers - 1:
            mods += [nn.BatchNorm1d(d2), nn.ReLU(inplace=True)]
        elif last_bn:
            mods.append(nn.BatchNorm1d(d2, affine=False))
    return nn.Sequential(*mods)


def random_keep(batch: int, n: int, ratio: float, g: torch.Generator, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """MAE's per-sample random masking: (keep indices (B, K) in shuffled order, mask (B, N) bool, True =
    hidden). K = round(n * (1 - ratio)); from argsort of uniform noise (He et al. 2022). Drawn on the generator's
    device (the step's CPU generator: the same masks on every device), then moved to ``device``."""
    n_keep = max(1, int(round(n * (1 - ratio))))
    noise = torch.rand(batch, n, generator=g)
    shuffle = torch.argsort(noise, dim=1)
    keep = shuffle[:, :n_keep]
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask.scatter_(1, keep, False)
    return (keep, mask) if device is None else (keep.to(device), mask.to(device))


def block_mask(batch: int, grid: int, ratio: float, block: int, g: torch.Generator,
               device: torch.device | str | None = None) -> torch.Tensor:
    """SimMIM's random masking at a coarser resolution: (B, grid*grid) bool, True = masked; masks
    ``ceil(ratio * blocks)`` random ``block`` x ``block`` squares of patches (Xie et al. 2022, Sec. 3.1). Drawn
    on the generator's device, then moved to ``device``."""
    if grid % block:
        block = 1
    cg = grid // block
    n_mask = int(math.ceil(ratio * cg * cg))
    order = torch.argsort(torch.rand(batch, cg * cg, generator=g), dim=1)
    coarse = torch.zeros(batch, cg * cg, dtype=torch.bool)
    coarse.scatter_(1, order[:, :n_mask], True)
    fine = coarse.view(batch, cg, 1, cg, 1).expand(batch, cg, block, cg, block).reshape(batch, grid * grid)
    return fine if device is None else fine.to(device)
