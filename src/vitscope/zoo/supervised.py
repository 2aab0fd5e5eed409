"""Supervised: cross-entropy on the CLS token's class logits (the explicit-supervision reference).

As in the original ViT (Dosovitskiy et al., ICLR 2021): the classifier reads the CLS token after the
final norm (timm's ``global_pool='token'``). The exported model keeps its 10-way head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode
from vitscope.zoo.base import Objective
from vitscope.zoo.data import ViewBatch, ViewSpec


class Supervised(Objective):
    name = "supervised"
    family = "explicit"
    citation = "Dosovitskiy et al., An Image is Worth 16x16 Words (ICLR 2021)"
    summary = "cross-entropy on CLS (one cropped + flipped view)"

    def __init__(self, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, label_smoothing: float = 0.0):
        super().__init__(arch)
        self.views = ViewSpec(n_global=1)
        self.encoder = build_encoder(arch, num_classes)
        self.label_smoothing = label_smoothing

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.encoder.forward_head(encode(self.encoder, batch.global_views[0])).float()  # loss in fp32
        loss = F.cross_entropy(logits, batch.labels, label_smoothing=self.label_smoothing)
        acc = (logits.argmax(-1) == batch.labels).float().mean()
        return loss, {"train_acc": float(acc)}

    def hparams(self) -> dict[str, Any]:
        return {"label_smoothing": self.label_smoothing}
