"""CL + MIM hybrid: L = (1 - lambda) L_MIM + lambda L_CL on one encoder (Park et al., "What do
self-supervised ViTs learn?", ICLR 2023, the "CL + MIM" slide).

Here L_MIM is SimMIM's loss and L_CL MoCo v3's, both as in their own modules. Each image gives two
contrastive views (MoCo v3 augmentations); each view is masked SimMIM-style and goes through the
encoder once: its patch tokens are reconstructed (L_MIM, averaged over the two views) and its CLS token
is the MoCo query (L_CL); the momentum encoder sees the unmasked views, as the teacher does in iBOT
(Zhou et al. 2022). So the hybrid costs one student pass per view, like MoCo v3. lambda = 0 is SimMIM
on contrastive views, lambda = 1 MoCo v3 with masked queries. The slides give no value for lambda; it is a
parameter (default 0.5).
"""

from __future__ import annotations

from typing import Any

import torch

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode
from vitscope.zoo.base import Objective
from vitscope.zoo.data import ViewBatch, ViewSpec
from vitscope.zoo.mocov3 import MoCoParts
from vitscope.zoo.simmim import SimMIMParts


class Hybrid(Objective):
    name = "hybrid"
    family = "hybrid"
    citation = "Park et al., What do self-supervised ViTs learn? (ICLR 2023)"
    summary = "(1-lambda) SimMIM + lambda MoCo v3 on one encoder (masked queries, unmasked keys)"

    def __init__(self, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, lam: float = 0.5, mask_ratio: float = 0.6,
                 mask_block: int = 2, hidden: int = 1024, out_dim: int = 256, temperature: float = 0.2,
                 momentum: float = 0.99):
        super().__init__(arch)
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lambda must be in [0, 1], got {lam}")
        self.lam = lam
        self.views = ViewSpec(n_global=2, colour=True)
        self.encoder = build_encoder(arch, 0)
        self.mim = SimMIMParts(arch, mask_ratio, mask_block)
        self.moco = MoCoParts(self.encoder, arch.embed_dim, hidden, out_dim, temperature, momentum)

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x = torch.cat(batch.global_views)
        mask = self.mim.mask(x.shape[0], batch.generator, x.device)
        tokens = encode(self.encoder, x, mask=mask, mask_token=self.mim.mask_token)
        l_mim = self.mim.loss(tokens, x, mask)
        l_cl = self.moco.loss(self.moco.queries(tokens[:, 0]), self.moco.keys(x))
        loss = (1 - self.lam) * l_mim + self.lam * l_cl
        return loss, {"loss_mim": l_mim.item(), "loss_cl": l_cl.item()}

    def set_progress(self, step: int, total: int) -> None:
        self.moco.set_progress(step, total)

    @torch.no_grad()
    def after_optimizer_step(self, step: int, total: int) -> None:
        self.moco.update(self.encoder)

    def hparams(self) -> dict[str, Any]:
        return {"lam": self.lam, **self.mim.hparams(), **self.moco.hparams()}
