"""MAE: masked autoencoder (He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022;
official code ``facebookresearch/mae``, ``models_mae.py``).

  * 75% of the patches of each image are removed at random (argsort of uniform noise, per image);
  * the encoder runs on the visible 25% only (plus CLS): `vitscope.zoo.arch.encode` with ``keep``
    calls the timm blocks on the kept tokens, the masked patches never enter it;
  * a separate light decoder (linear embed, mask tokens put back in place, fixed 2-D sin-cos position
    embedding, ``decoder_depth`` transformer blocks, linear prediction of the patch pixels);
  * loss: mean squared error on the masked patches only, against per-patch normalised pixels
    (``norm_pix_loss=True``: each target patch minus its mean, over its standard deviation).
Decoder: 96-d, 2 blocks, 3 heads here (the paper: 512-d, 8 blocks for ViT-L). The exported model is
the encoder with its final norm, as MAE's released pretraining checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import Block
from torch import nn

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode, patchify, sincos_pos_embed
from vitscope.zoo.base import Objective, random_keep
from vitscope.zoo.data import ViewBatch, ViewSpec


class MAEDecoder(nn.Module):
    def __init__(self, enc_dim: int, num_patches: int, patch: int, dim: int = 96, depth: int = 2, heads: int = 3):
        super().__init__()
        grid = int(round(num_patches**0.5))
        self.embed = nn.Linear(enc_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, grid, cls=True), persistent=False)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.pred = nn.Linear(dim, patch * patch * 3)
        nn.init.normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor, n: int) -> torch.Tensor:
        """tokens (B, 1 + K, D_enc) for the kept patch indices ``keep`` (B, K) -> (B, n, p*p*3)."""
        x = self.embed(tokens)
        b, k1, d = x.shape
        full = self.mask_token.to(x.dtype).expand(b, n, d).clone()  # x is bf16 under autocast
        full = full.scatter(1, keep.unsqueeze(-1).expand(-1, -1, d), x[:, 1:])
        x = torch.cat([x[:, :1], full], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.pred(self.norm(x))[:, 1:]


class MAE(Objective):
    name = "mae"
    family = "reconstructive"
    citation = "He et al., Masked Autoencoders Are Scalable Vision Learners (CVPR 2022)"
    summary = "75% random masking, encoder on visible tokens, light decoder, norm-pixel MSE on masked"

    def __init__(self, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, mask_ratio: float = 0.75,
                 decoder_dim: int = 96, decoder_depth: int = 2, decoder_heads: int = 3, norm_pix_loss: bool = True):
        super().__init__(arch)
        self.views = ViewSpec(n_global=1)
        self.encoder = build_encoder(arch, 0)
        self.decoder = MAEDecoder(arch.embed_dim, arch.num_patches, arch.patch_size, decoder_dim, decoder_depth,
                                  decoder_heads)
        self.mask_ratio, self.norm_pix_loss = mask_ratio, norm_pix_loss
        self._hp = {"mask_ratio": mask_ratio, "decoder_dim": decoder_dim, "decoder_depth": decoder_depth,
                    "decoder_heads": decoder_heads, "norm_pix_loss": norm_pix_loss}

    def target(self, x: torch.Tensor) -> torch.Tensor:
        t = patchify(x, self.patch_size)
        if self.norm_pix_loss:
            mean, var = t.mean(-1, keepdim=True), t.var(-1, keepdim=True)
            t = (t - mean) / (var + 1e-6) ** 0.5
        return t

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x = batch.global_views[0]
        n = self.arch.num_patches
        keep, mask = random_keep(x.shape[0], n, self.mask_ratio, batch.generator, x.device)
        tokens = encode(self.encoder, x, keep=keep)
        pred = self.decoder(tokens, keep, n).float()  # loss in fp32 under bf16 autocast
        err = ((pred - self.target(x)) ** 2).mean(-1)
        m = mask.to(err.dtype)
        loss = (err * m).sum() / m.sum()
        return loss, {"visible_mse": ((err * (1 - m)).sum() / (1 - m).sum().clamp_min(1)).item()}

    def parts(self) -> nn.Module:
        return self.decoder

    def hparams(self) -> dict[str, Any]:
        return dict(self._hp)
