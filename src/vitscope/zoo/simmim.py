"""SimMIM (Xie et al., "SimMIM: A Simple Framework for Masked Image Modeling", CVPR 2022; official code
``microsoft/SimMIM``, ``models/simmim.py``).

  * random masking of ``mask_ratio`` = 60% of the image in squares of ``mask_block`` x ``mask_block``
    patches (the paper: 32-px squares on 16-px patches; here 8-px squares on 4-px patches);
  * a learnable mask token replaces the masked patch embeddings inside the encoder, before the position
    embedding is added; every token goes through every block (BEiT-style, no separate decoder);
  * a linear prediction head maps each patch token to its patch's pixels (the paper's 1x1 convolution
    + pixel shuffle, which is the same map);
  * loss: L1 between prediction and the normalised input pixels, averaged over masked pixels only.
The mask token and head are not part of the exported encoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode, patchify
from vitscope.zoo.base import Objective, block_mask
from vitscope.zoo.data import ViewBatch, ViewSpec


class SimMIMParts(nn.Module):
    """Mask token, masking, prediction head and loss (shared by SimMIM and the hybrid)."""

    def __init__(self, arch: ZooArch, mask_ratio: float = 0.6, mask_block: int = 2):
        super().__init__()
        self.arch, self.mask_ratio, self.mask_block = arch, mask_ratio, mask_block
        self.mask_token = nn.Parameter(torch.zeros(1, 1, arch.embed_dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = nn.Linear(arch.embed_dim, arch.patch_size**2 * 3)

    def mask(self, batch: int, g: torch.Generator, device: torch.device | None = None) -> torch.Tensor:
        return block_mask(batch, self.arch.grid, self.mask_ratio, self.mask_block, g, device)

    def loss(self, tokens: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens (B, 1 + N, D) of the masked images, x (B, 3, H, W) the normalised images."""
        err = (self.head(tokens[:, 1:]).float() - patchify(x, self.arch.patch_size)).abs().mean(-1)  # fp32 loss
        m = mask.to(err.dtype)
        return (err * m).sum() / (m.sum() + 1e-5)

    def hparams(self) -> dict[str, Any]:
        return {"mask_ratio": self.mask_ratio, "mask_block": self.mask_block}


class SimMIM(Objective):
    name = "simmim"
    family = "reconstructive"
    citation = "Xie et al., SimMIM: A Simple Framework for Masked Image Modeling (CVPR 2022)"
    summary = "mask token inside the encoder (60%, 2x2-patch blocks), linear head, L1 on masked pixels"

    def __init__(self, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, mask_ratio: float = 0.6, mask_block: int = 2):
        super().__init__(arch)
        self.views = ViewSpec(n_global=1)
        self.encoder = build_encoder(arch, 0)
        self.mim = SimMIMParts(arch, mask_ratio, mask_block)

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x = batch.global_views[0]
        mask = self.mim.mask(x.shape[0], batch.generator, x.device)
        tokens = encode(self.encoder, x, mask=mask, mask_token=self.mim.mask_token)
        return self.mim.loss(tokens, x, mask), {}

    def parts(self) -> nn.Module:
        return self.mim

    def hparams(self) -> dict[str, Any]:
        return self.mim.hparams()
