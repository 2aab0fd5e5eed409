"""The one architecture of the controlled zoo, and the token-level forward every objective shares.

Every objective trains the same timm `VisionTransformer` (so every vitscope tap works on the result),
built from the keyword arguments held in `ZOO_ARCH`. The size was chosen from a measurement on the
2-core CPU machine the zoo is trained on (``benchmarks/zoo_throughput.py``, docs/ZOO.md): 8 blocks for
layer-wise analyses, at the cost of the 6-block, 128-wide reference, so that the slowest objective still
sees the common budget of image-views in about 45 minutes.

`encode` is the forward of `VisionTransformer.forward_features` taken apart so that the objectives can
(a) replace masked patch embeddings by a mask token before the position embedding (SimMIM, Xie et al.
2022), (b) run the blocks on the visible tokens only (MAE, He et al. 2022), and (c) feed crops smaller
than the training size with a resampled position embedding (DINO's local crops, Caron et al. 2021).
Without any of these it computes exactly what ``forward_features`` computes (tested).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from vitscope.models.registry import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    ZOO_ARCH_KWARGS,
    ZOO_PREPROCESSING_ARGS,
    ZOO_TIMM_ARCH,
    Preprocessing,
    zoo_pretrained_cfg_overlay,
)

TIMM_ARCH = ZOO_TIMM_ARCH  # the timm entry point; every size argument is overridden below
CIFAR_MEAN, CIFAR_STD = CIFAR10_MEAN, CIFAR10_STD  # the normalisation of every zoo model


@dataclass(frozen=True)
class ZooArch:
    """Size of the zoo ViT: ``timm.create_model(TIMM_ARCH, **arch.kwargs(num_classes))``."""

    img_size: int = 32
    patch_size: int = 4
    embed_dim: int = 96
    depth: int = 8
    num_heads: int = 3
    mlp_ratio: float = 4.0
    # "learned": timm's learnable position embedding; "sincos": fixed 2-D sine-cosine positions (MoCo v3,
    # MAE), set at init and not trained; the exported ViT is the same timm model either way
    pos_embed: str = "learned"
    # "timm": timm's default initialisation; "mimetic": the attention weights of every block initialised so
    # that W_q^T W_k = a Z + b I and W_v^T W_proj^T = a' Z' - b' I (Trockman & Kolter, "Mimetic
    # initialization of self-attention layers", ICML 2023; a = b = 0.7, a' = b' = 0.4, Z ~ N(0, 1/D)), the
    # structure of pretrained ViTs' attention, which makes attention local from the start (`mimetic_init`)
    init: str = "timm"

    def kwargs(self, num_classes: int = 0) -> dict[str, Any]:
        """timm keyword arguments (also what the exported checkpoint's ModelSpec stores)."""
        kw: dict[str, Any] = {k: v for k, v in asdict(self).items() if k not in ("mlp_ratio", "pos_embed", "init")}
        if self.mlp_ratio != 4.0:
            kw["mlp_ratio"] = self.mlp_ratio
        kw["num_classes"] = num_classes
        # timm's data config of the model = the zoo's preprocessing (not the factory's ImageNet config)
        kw["pretrained_cfg_overlay"] = zoo_pretrained_cfg_overlay(self.img_size, num_classes)
        return kw

    @property
    def grid(self) -> int:
        return self.img_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @classmethod
    def from_kwargs(cls, **kw: Any) -> ZooArch:
        known = {k: kw[k] for k in asdict(cls()) if k in kw}
        return cls(**known)


# The zoo's architecture: ViT with 32 px input, 4 px patches (8x8 grid + CLS = 65 tokens), 8 blocks of
# width 96 with 3 heads of 32 dims (0.91 M parameters). Measured on 1 core (CPU time per training step,
# interleaved): as fast as depth 6 x width 128 x 4 heads (128 vs 115 images/s supervised, 103 vs 93 image-
# views/s DINO) with two more layers; depth 8 x 128 costs 1.3-1.4x, depth 6 x 192 1.7-1.9x (docs/ZOO.md).
# (The numbers live with the zoo's registry entries, `vitscope.models.registry.ZOO_ARCH_KWARGS`.)
# Initialised mimetically with fixed sin-cos positions (docs/zoo-history.md, "Attention locality and the mimetic
# initialisation"): with timm's init and learned positions, attention stayed uniform (0.57-0.60 on the unit
# square, uniform 0.591) at this budget for every objective but the two MIM ones; with this init the untrained
# network's attention is already local in some blocks (0.44-0.48) and supervised training learned faster.
# zoo-random is this initialisation, untrained.
ZOO_ARCH = ZooArch(**ZOO_ARCH_KWARGS, pos_embed="sincos", init="mimetic")


def zoo_preprocessing(img_size: int = 32) -> Preprocessing:
    """How the zoo's images are fed: CIFAR statistics, no resize or crop at evaluation."""
    mean, std, _, crop, interp = ZOO_PREPROCESSING_ARGS
    return Preprocessing(mean, std, img_size, crop, interp)


def build_encoder(arch: ZooArch = ZOO_ARCH, num_classes: int = 0) -> VisionTransformer:
    """A freshly initialised zoo ViT (timm's own init; seed the global RNG around the call)."""
    import timm

    model = timm.create_model(TIMM_ARCH, pretrained=False, **arch.kwargs(num_classes))
    check_encoder(model)
    if arch.pos_embed == "sincos":
        with torch.no_grad():
            model.pos_embed.copy_(sincos_pos_embed(arch.embed_dim, arch.grid, cls=True))
        model.pos_embed.requires_grad_(False)
    elif arch.pos_embed != "learned":
        raise ValueError(f"pos_embed must be 'learned' or 'sincos', got {arch.pos_embed!r}")
    if arch.init == "mimetic":
        mimetic_init(model)
    elif arch.init != "timm":
        raise ValueError(f"init must be 'timm' or 'mimetic', got {arch.init!r}")
    return model


def _factor(dim: int, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, R) with L @ R = alpha Z + beta I, Z ~ N(0, 1/dim): L = U sqrt(S), R = sqrt(S) V^T from the SVD."""
    m = alpha * torch.randn(dim, dim) / dim**0.5 + beta * torch.eye(dim)
    u, sv, vh = torch.linalg.svd(m)
    r = sv.sqrt()
    return u * r, r[:, None] * vh


@torch.no_grad()
def mimetic_init(vit: VisionTransformer, qk: tuple[float, float] = (0.7, 0.7), vo: tuple[float, float] = (0.4, -0.4)
                 ) -> None:
    """Mimetic initialisation of every attention block (Trockman & Kolter 2023), in place, from the global RNG.

    timm computes q = x W_q^T, k = x W_k^T (``qkv.weight`` rows: q, k, v, each head a block of rows) and the
    output o W_proj^T, so summed over heads q . k = x W_q^T W_k x^T and the value path is x W_v^T W_proj^T.
    Sets W_q^T W_k = qk[0] Z1 + qk[1] I and W_v^T W_proj^T = vo[0] Z2 + vo[1] I exactly (full-rank factors,
    split over the heads); biases are left as timm sets them (zero).
    """
    for blk in vit.blocks:
        attn = blk.attn
        d = attn.qkv.in_features
        lq, rk = _factor(d, *qk)   # W_q^T = lq, W_k = rk
        lv, rp = _factor(d, *vo)   # W_v^T = lv, W_proj^T = rp
        attn.qkv.weight[:d].copy_(lq.t())
        attn.qkv.weight[d:2 * d].copy_(rk)
        attn.qkv.weight[2 * d:].copy_(lv.t())
        attn.proj.weight.copy_(rp.t())


def check_encoder(vit: torch.nn.Module) -> None:
    """`encode` handles the plain layout: one CLS token, no registers, position embedding incl. CLS."""
    if not isinstance(vit, VisionTransformer):
        raise TypeError(f"the zoo trains timm VisionTransformer models, got {type(vit).__name__}")
    if vit.cls_token is None or vit.reg_token is not None or vit.no_embed_class or vit.pos_embed is None:
        raise ValueError("the zoo's token forward needs a ViT with one CLS token, no registers, and a "
                         "position embedding that includes the CLS position")


def patch_embed(vit: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) -> (B, N, D) patch embeddings, for any H, W that are multiples of the patch size."""
    t = vit.patch_embed.proj(x).flatten(2).transpose(1, 2)
    return vit.patch_embed.norm(t)


def pos_embed(vit: VisionTransformer, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(CLS position (1, 1, D), patch positions (1, h*w, D)); resampled (bicubic) for another grid."""
    pe = vit.pos_embed
    own = tuple(vit.patch_embed.grid_size)
    if tuple(grid) != own:
        pe = resample_abs_pos_embed(pe, new_size=list(grid), old_size=list(own), num_prefix_tokens=1)
    return pe[:, :1], pe[:, 1:]


def encode(
    vit: VisionTransformer,
    x: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    mask_token: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens after the final norm, (B, 1 + N', D), CLS first.

    mask, mask_token: (B, N) bool and (1, 1, D): masked patch embeddings are replaced by the token
        before the position embedding is added (SimMIM); all N patches go through the blocks.
    keep: (B, K) indices of the patches to keep (MAE): only those K tokens (plus CLS) enter the blocks,
        in the given order; the others are never seen by the encoder.
    """
    p = vit.patch_embed.patch_size
    ph, pw = (p, p) if isinstance(p, int) else p
    grid = (x.shape[-2] // ph, x.shape[-1] // pw)
    t = patch_embed(vit, x)
    if mask is not None:
        if mask_token is None:
            raise ValueError("a mask needs a mask_token")
        w = mask.unsqueeze(-1).to(t.dtype)
        t = t * (1 - w) + mask_token.to(t.dtype) * w
    cls_pos, pos = pos_embed(vit, grid)
    t = t + pos
    if keep is not None:
        t = torch.gather(t, 1, keep.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
    cls = vit.cls_token.expand(t.shape[0], -1, -1) + cls_pos
    t = vit.pos_drop(torch.cat([cls, t], dim=1))
    t = vit.norm_pre(vit.patch_drop(t))
    for blk in vit.blocks:
        t = blk(t)
    return vit.norm(t)


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, patch*patch*C), patches in row-major order, pixels (p, q, c) inside."""
    b, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    x = x.reshape(b, c, gh, patch, gw, patch)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(b, gh * gw, patch * patch * c)


def unpatchify(t: torch.Tensor, patch: int, channels: int = 3) -> torch.Tensor:
    """Inverse of `patchify` for a square grid."""
    b, n, _ = t.shape
    g = int(round(n**0.5))
    x = t.reshape(b, g, g, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(b, channels, g * patch, g * patch)


def sincos_pos_embed(dim: int, grid: int, cls: bool = True) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding (1, [1 +] grid*grid, dim), as MAE's decoder uses."""
    if dim % 4:
        raise ValueError("sin-cos position embedding needs dim divisible by 4")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    yy, xx = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                            indexing="ij")
    parts = []
    for coord in (xx.reshape(-1), yy.reshape(-1)):
        out = coord[:, None] * omega[None]
        parts += [torch.sin(out), torch.cos(out)]
    pe = torch.cat(parts, dim=1).float()
    if cls:
        pe = torch.cat([torch.zeros(1, dim), pe], dim=0)
    return pe.unsqueeze(0)
