"""MoCo v3 (Chen, Xie, He, "An Empirical Study of Training Self-Supervised Vision Transformers", ICCV 2021;
official code ``facebookresearch/moco-v3``, ``moco/builder.py``).

Two augmented views of each image; the base encoder + projector + predictor gives q1, q2, the momentum
encoder (EMA of base encoder + projector, no predictor) gives k1, k2; the loss is the symmetric InfoNCE
ctr(q1, k2) + ctr(q2, k1), with ctr(q, k) = CE(q k^T / T, diagonal) * 2T over the other images of the
batch as negatives, T = 0.2. Projector: 3 layers, predictor: 2 layers, BN in both (last BN without
affine); hidden 1024, output 256 here (the paper: 4096, 256). The momentum follows a cosine from 0.99
to 1. The exported model is the base encoder (the paper's released backbones).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode
from vitscope.zoo.base import Objective, build_mlp, cosine_ramp, ema_update, frozen_copy
from vitscope.zoo.data import ViewBatch, ViewSpec


def info_nce(q: torch.Tensor, k: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo v3's ``contrastive_loss``: the positives are on the diagonal of the (B, B) logits."""
    with torch.autocast(q.device.type, enabled=False):  # the logits in fp32 under bf16 autocast, on any device
        q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
        logits = q @ k.t() / temperature
    labels = torch.arange(q.shape[0], device=q.device)
    return F.cross_entropy(logits, labels) * (2 * temperature)


class MoCoParts(nn.Module):
    """Projector, predictor and the momentum copies of an encoder (shared by MoCo v3 and the hybrid)."""

    def __init__(self, encoder: nn.Module, dim: int, hidden: int = 1024, out_dim: int = 256,
                 temperature: float = 0.2, momentum: float = 0.99):
        super().__init__()
        self.projector = build_mlp(dim, hidden, out_dim, 3)
        self.predictor = build_mlp(out_dim, hidden, out_dim, 2)
        self.momentum_encoder = frozen_copy(encoder)
        self.momentum_projector = frozen_copy(self.projector)
        self.hidden, self.out_dim, self.temperature, self.base_momentum = hidden, out_dim, temperature, momentum
        self.momentum = momentum

    def queries(self, cls: torch.Tensor) -> torch.Tensor:
        """(2B, D) CLS features of views 1 then 2 -> queries; BN statistics per view, as in MoCo v3."""
        return torch.cat([self.predictor(self.projector(c)) for c in cls.chunk(2)])

    @torch.no_grad()
    def keys(self, views: torch.Tensor) -> torch.Tensor:
        """(2B, 3, H, W) unmasked views 1 then 2 -> momentum keys (one encoder pass, BN per view)."""
        cls = encode(self.momentum_encoder, views)[:, 0]
        return torch.cat([self.momentum_projector(c) for c in cls.chunk(2)])

    def loss(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Symmetric loss from (2B, .) queries and keys of views 1 then 2."""
        q1, q2 = q.chunk(2)
        k1, k2 = k.chunk(2)
        return info_nce(q1, k2, self.temperature) + info_nce(q2, k1, self.temperature)

    def set_progress(self, step: int, total: int) -> None:
        self.momentum = cosine_ramp(self.base_momentum, 1.0, step, total)

    @torch.no_grad()
    def update(self, encoder: nn.Module) -> None:
        """momentum networks <- EMA of the online ones, at the momentum of the current step."""
        ema_update(self.momentum_encoder, encoder, self.momentum)
        ema_update(self.momentum_projector, self.projector, self.momentum)

    def hparams(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "out_dim": self.out_dim, "temperature": self.temperature,
                "momentum": self.base_momentum}


class MoCoV3(Objective):
    name = "mocov3"
    family = "contrastive"
    citation = "Chen, Xie, He, An Empirical Study of Training Self-Supervised Vision Transformers (ICCV 2021)"
    summary = "momentum encoder, projector + predictor, symmetric InfoNCE (T=0.2), 2 views"

    def __init__(self, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, hidden: int = 1024, out_dim: int = 256,
                 temperature: float = 0.2, momentum: float = 0.99):
        super().__init__(arch)
        self.views = ViewSpec(n_global=2, colour=True)
        self.encoder = build_encoder(arch, 0)
        self.moco = MoCoParts(self.encoder, arch.embed_dim, hidden, out_dim, temperature, momentum)

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x = torch.cat(batch.global_views)
        q = self.moco.queries(encode(self.encoder, x)[:, 0])
        k = self.moco.keys(x)
        return self.moco.loss(q, k), {"momentum": self.moco.momentum}

    def set_progress(self, step: int, total: int) -> None:
        self.moco.set_progress(step, total)

    @torch.no_grad()
    def after_optimizer_step(self, step: int, total: int) -> None:
        self.moco.update(self.encoder)

    def hparams(self) -> dict[str, Any]:
        return self.moco.hparams()
