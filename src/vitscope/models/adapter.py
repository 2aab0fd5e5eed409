"""`ViTModel`: one timm ViT (BEiT, or Eva) with uniform facts and tap points, whatever trained it."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from vitscope.errors import InputError, VitscopeError
from vitscope.models import taps as _taps
from vitscope.models.checkpoints import LoadReport
from vitscope.models.registry import ModelInput, ModelSpec, Preprocessing

SUPPORTED = ("timm VisionTransformer (ViT, DeiT, CLIP, DINO, MAE, DINOv2 with registers), Beit and Eva "
             "(EVA-02, DINOv3, Perception Encoder, timm's RoPE ViTs; pre-norm blocks)")


def model_family(model: nn.Module) -> str:
    from timm.models.beit import Beit
    from timm.models.eva import Eva, EvaBlock
    from timm.models.vision_transformer import VisionTransformer

    if isinstance(model, Beit):
        return "beit"
    if isinstance(model, VisionTransformer):
        return "vit"
    if isinstance(model, Eva):
        if not all(isinstance(b, EvaBlock) for b in model.blocks):
            raise VitscopeError(f"{type(model.blocks[0]).__name__} blocks (Eva with use_post_norm, such as "
                                "eva02_enormous) are not supported: the taps are defined on pre-norm blocks; "
                                f"vitscope adapts {SUPPORTED}")
        return "eva"
    raise VitscopeError(f"{type(model).__name__} is not supported; vitscope adapts {SUPPORTED}")


def describe_readout(model: nn.Module) -> str:
    """'CLS token', 'mean of patch tokens', 'attention pool (N queries)', ... : what ``model``'s head reads."""
    from timm.models.deit import VisionTransformerDistilled

    if isinstance(model, VisionTransformerDistilled):
        return "CLS and distillation tokens (two heads)"
    if getattr(model, "attn_pool", None) is not None:
        q = int(model.attn_pool.latent_len)
        return "attention pool" + (f" ({q} queries)" if q > 1 else "")
    if getattr(model, "vitscope_decoder_from", None) is not None:
        return "MAE decoder: pixels of every patch"
    pool = str(getattr(model, "global_pool", "") or "")
    return {"token": "CLS token", "avg": "mean of patch tokens", "max": "max of patch tokens",
            "avgmax": "mean and max of patch tokens", "": "every token (no pooling)"}.get(pool, pool)


@dataclass(frozen=True)
class ModelInfo:
    """What an analysis needs to know of a model, without the model: saved with cached states so results
    can be rebuilt (and compared across models) without loading any weights."""

    name: str
    depth: int
    num_heads: int
    embed_dim: int
    grid_size: tuple[int, int]
    patch_size: int
    num_prefix_tokens: int
    has_cls_token: bool
    decoder_from: int | None = None  # first MAE decoder block (`ViTModel.decoder_from`); None: no decoder


def block_label(vm: object, i: int) -> str:
    """How a report names block ``i`` of ``vm`` (a `ViTModel`, a `ModelInfo`, an analysis, or anything with a
    ``decoder_from``): 'block 3', or 'decoder 2' for the third block of an MAE decoder (`vitscope.models.mae_decoder`),
    whose blocks follow the encoder's in the tap names (``block{E + j}``)."""
    start = getattr(vm, "decoder_from", None)
    if start is not None and i >= start:
        return f"decoder {i - start}"
    return f"block {i}"


@dataclass
class ViTModel:
    """A loaded model and what vitscope needs to know about it.

    Attributes: ``model`` (the timm module, in eval mode), ``name``, ``spec`` (the registry entry or an
    ad-hoc one), ``family`` ('vit', 'beit' or 'eva'), ``load_report`` (key accounting, None for random init).
    """

    model: nn.Module
    name: str
    spec: ModelSpec
    load_report: LoadReport | None = None

    def __post_init__(self) -> None:
        self.family = model_family(self.model)
        self.model.eval()

    # -- architecture facts -------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    @property
    def decoder_from(self) -> int | None:
        """Where an MAE decoder's blocks start (the encoder's depth; ``decoder: true``), None without one: blocks
        from here on are the decoder's (`block_label` names them), ``final_norm`` is its norm and ``logits`` its
        pixel prediction (`vitscope.models.mae_decoder`)."""
        from vitscope.models.mae_decoder import decoder_from

        return decoder_from(self.model)

    @property
    def num_heads(self) -> int:
        return int(self.model.blocks[0].attn.num_heads)

    @property
    def embed_dim(self) -> int:
        return int(self.model.embed_dim)

    @property
    def num_prefix_tokens(self) -> int:
        """CLS plus register tokens, at the front of the sequence (0 for an Eva with neither)."""
        if self.family == "beit":
            return 1
        return int(self.model.num_prefix_tokens)

    @property
    def has_cls_token(self) -> bool:
        return getattr(self.model, "cls_token", None) is not None

    @property
    def patch_size(self) -> int:
        p = self.model.patch_embed.patch_size
        return int(p[0] if isinstance(p, tuple | list) else p)

    @property
    def grid_size(self) -> tuple[int, int]:
        g = self.model.patch_embed.grid_size
        return int(g[0]), int(g[1])

    @property
    def img_size(self) -> tuple[int, int]:
        s = self.model.patch_embed.img_size
        return int(s[0]), int(s[1])

    @property
    def num_tokens(self) -> int:
        h, w = self.grid_size
        return self.num_prefix_tokens + h * w

    @property
    def preprocessing(self) -> ModelInput:
        """The registry's preprocessing at the model's input size, with its patch size and whether it takes
        other input sizes (`ModelInput`)."""
        from dataclasses import asdict

        pre: Preprocessing = self.spec.preprocessing
        fields = {k: v for k, v in asdict(pre).items() if k not in ("patch_size", "any_size")}
        fields["input_size"] = self.img_size[0]
        return ModelInput(**fields, patch_size=self.patch_size, any_size=self.any_size)

    @property
    def any_size(self) -> bool:
        """Whether the model runs on inputs of another size than ``img_size`` (any sides that are multiples of
        the patch size, position embeddings interpolated to the token grid). ViTs do (timm's
        ``dynamic_img_size`` path, switched on per forward by `input_size`); BEiT does not: its relative
        position bias tables are built for one window, and timm can only rebuild them in place
        (``set_input_size``), which would change the model for every later pass. An Eva does when it was
        built with ``dynamic_img_size=True`` (DINOv3 is, by default): timm's own forward then resamples any
        absolute position embedding and asks the rotary embedding for the input's grid on every pass
        (``rope.get_embed(shape=(H, W))``), the path the model was built for. An Eva built without it does
        not: switching the flag on for one pass is not enough, as its RoPE module then holds a table cached for
        the native grid (``feat_shape``), ignores the shape asked for, and only ``set_input_size`` rebuilds it,
        in place."""
        if self.family == "eva":
            return bool(self.model.dynamic_img_size)
        return self.family == "vit" and self.decoder_from is None  # the MAE decoder's position embedding is fixed

    def grid_of(self, height: int, width: int) -> tuple[int, int]:
        """The token grid of an input of (height, width) pixels."""
        return height // self.patch_size, width // self.patch_size

    @contextlib.contextmanager
    def input_size(self, height: int, width: int) -> Iterator[None]:
        """Run the model on (height, width) inputs inside the block: at the native size nothing changes (the
        same computation, bit for bit); at another size timm's dynamic-size path is switched on for the
        block (patch embedding without the size check, absolute position embeddings resampled bicubically
        to the token grid by ``resample_abs_pos_embed``, as ``dynamic_img_size=True`` at creation does) and
        restored on exit."""
        if (height, width) == self.img_size or not self.any_size or self.model.dynamic_img_size:
            yield
            return
        from timm.layers import Format

        pe = self.model.patch_embed
        saved = (self.model.dynamic_img_size, pe.strict_img_size, pe.flatten, pe.output_fmt)
        self.model.dynamic_img_size = True
        pe.strict_img_size, pe.flatten, pe.output_fmt = False, False, Format.NHWC
        try:
            yield
        finally:
            self.model.dynamic_img_size, pe.strict_img_size, pe.flatten, pe.output_fmt = saved

    def info(self) -> ModelInfo:
        return ModelInfo(self.name, self.depth, self.num_heads, self.embed_dim, self.grid_size, self.patch_size,
                         self.num_prefix_tokens, self.has_cls_token, self.decoder_from)

    @cached_property
    def taps(self) -> list[str]:
        """Tap names valid for this model, in forward order."""
        return _taps.tap_names(self.depth, pool=_taps.has_pool(self.model), pool_attn=self.has_attention_pool)

    @property
    def has_attention_pool(self) -> bool:
        """Whether the model pools with attention (SigLIP's MAP head, PE's attention pool): the ``pool_attn`` tap."""
        return getattr(self.model, "attn_pool", None) is not None

    @property
    def readout(self) -> str:
        """What the model's head reads, in words: the ``pool`` tap's content (see `models.taps`)."""
        return describe_readout(self.model)

    def hook_point(self, tap: str) -> _taps.HookPoint:
        _taps.check_taps([tap], self.taps)
        return _taps.hook_point(self.model, self.family, tap)

    @cached_property
    def weights_digest(self) -> str:
        """sha256 over parameter names, shapes and bytes: what a cache key needs to know of the weights."""
        h = hashlib.sha256()
        for k, v in sorted(self.model.state_dict().items()):
            h.update(k.encode())
            h.update(str(tuple(v.shape)).encode())
            h.update(v.detach().to("cpu").contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def check_input(self, x: torch.Tensor) -> None:
        """Clear errors for images the model cannot take, before any hook runs."""
        if not isinstance(x, torch.Tensor):
            raise InputError(f"expected an image tensor (B, 3, H, W), got {type(x).__name__}")
        if x.ndim != 4 or x.shape[1] != self.model.patch_embed.proj.in_channels:
            raise InputError(f"expected images of shape (B, {self.model.patch_embed.proj.in_channels}, H, W), "
                             f"got {tuple(x.shape)}")
        h, w = (int(v) for v in x.shape[-2:])
        if (h, w) != self.img_size:
            ih, iw = self.img_size
            if not self.any_size:
                why = ("its rotary position embedding is built for one token grid (it was built without "
                       "dynamic_img_size=True)" if self.family == "eva"
                       else "its MAE decoder's position embedding is built for one token grid"
                       if self.decoder_from is not None else "its relative position bias is built for one token grid")
                raise InputError(
                    f"{self.name} ({self.family}) takes {ih}x{iw} images only, got {h}x{w}: {why} (use the dataset "
                    f"option crop: center, or load the model with img_size={h} when the input is square)")
            if h % self.patch_size or w % self.patch_size:
                raise InputError(f"{self.name} takes images whose sides are multiples of the patch size "
                                 f"{self.patch_size} (position embeddings are interpolated to the token grid); "
                                 f"got {h}x{w}")
        if not torch.isfinite(x.sum()):  # NaN/inf propagate into the sum; 10x cheaper than isfinite(x)
            bad = int((~torch.isfinite(x)).sum())
            raise InputError(f"the images hold {bad} NaN or infinite values")

    def __repr__(self) -> str:
        return (f"ViTModel({self.name!r}, {self.family}, depth={self.depth}, heads={self.num_heads}, "
                f"dim={self.embed_dim}, patch={self.patch_size}, grid={self.grid_size}, "
                f"prefix_tokens={self.num_prefix_tokens})")
