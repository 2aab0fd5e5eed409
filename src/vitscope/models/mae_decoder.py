"""The MAE pixel decoder as more blocks of the model (``decoder: true`` on a model entry, ``load_model(...,
decoder=True)``): Park et al. (2023, "What do self-supervised ViTs learn?") read MAE's decoder beside its encoder
("the decoder takes the low frequencies"), so vitscope can tap it like any block.

The official decoder (facebookresearch/mae ``models_mae.py``: ``forward_encoder``, ``forward_decoder``) is
``x = norm(encoder blocks(...))``; ``x = decoder_embed(x)``; mask tokens appended and unshuffled;
``x = x + decoder_pos_embed``; ``decoder_blocks``; ``decoder_norm``; ``decoder_pred``; the CLS token removed. Here
nothing is masked: the official decoder is trained on the visible tokens plus mask tokens in the masked places;
with no masking every token is visible, so the decoder reads the encoder's output at every position (CLS included),
which is what Park et al. analyse. ``mask_token`` is kept as a parameter (loaded, accounted for) but unused.

How it is built (`attach_decoder`): the loaded timm ``VisionTransformer`` (the MAE encoder) keeps its class, so
every tap, hook and input check of a ViT still applies; its ``blocks`` become the encoder blocks followed by the
decoder blocks (timm ``Block``s, so ``norm1``, ``attn``, ``mlp``, ... are real modules the taps hook). The first
decoder block is a `DecoderEntryBlock`: it applies the encoder's final norm, ``decoder_embed`` and
``decoder_pos_embed`` to its input before its own forward, so ``block{E}.out`` is that block's output and
``block{E-1}.out`` the last encoder block's (E = `decoder_from`, the encoder's depth). The model's ``norm`` is
``decoder_norm`` (the ``final_norm`` tap) and its head ``decoder_pred`` (the ``logits`` tap: (B, N, p*p*3), the
pixels predicted for each patch, prefix tokens dropped, as the official code does). ``num_classes`` is 0: analyses
that need a classifier head refuse the model in one sentence (as for any headless model). Inputs must be of the
model's own size (the decoder's position embedding is fixed; `ViTModel.any_size` is False).

Identities that do not hold on the entry block: its ``resid_mid`` is the handed-over stream (after
``decoder_embed`` and the position embedding) plus ``attn_out``, not the previous block's ``out`` plus it.

What the weights cannot say: the decoder's number of heads (``num_heads`` is decoder_embed_dim / 32, MAE's
convention: 16 heads of 32 for its 512-wide decoder, unless given as ``decoder_num_heads``), said in the load
report's notes; LayerNorm eps 1e-6 as MAE's ``norm_layer``.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch
from torch import nn

from vitscope.errors import CheckpointError, ConfigError

Tensor = torch.Tensor

MAE_HEAD_DIM = 32  # MAE's decoder: 512 wide, 16 heads


def _block_type() -> type[nn.Module]:
    from timm.models.vision_transformer import Block

    return Block


def _entry_block_class() -> type[nn.Module]:
    Block = _block_type()

    class DecoderEntryBlock(Block):  # type: ignore[misc, valid-type]
        """The first MAE decoder block: the encoder's final norm, ``decoder_embed`` and ``decoder_pos_embed``
        applied to its input (the last encoder block's output), then the block's own forward."""

        def __init__(self, encoder_norm: nn.Module, in_dim: int, num_tokens: int, dim: int, **block_kw: Any):
            super().__init__(dim, **block_kw)
            self.encoder_norm = encoder_norm
            self.decoder_embed = nn.Linear(in_dim, dim)
            self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_tokens, dim), requires_grad=False)
            self.mask_token = nn.Parameter(torch.zeros(1, 1, dim), requires_grad=False)  # unused: no masking

        def forward(self, x: Tensor, *args: Any, **kw: Any) -> Tensor:
            if x.shape[1] != self.decoder_pos_embed.shape[1]:
                raise CheckpointError(f"the MAE decoder's position embedding has {self.decoder_pos_embed.shape[1]} "
                                      f"tokens, the input {x.shape[1]}: give the model images of its own size")
            x = self.decoder_embed(self.encoder_norm(x)) + self.decoder_pos_embed
            return super().forward(x, *args, **kw)

    return DecoderEntryBlock


class DecoderPred(nn.Module):
    """``decoder_pred`` as the model's head: pixels per patch, (B, N, p*p*C), the prefix tokens dropped (the
    official ``x[:, 1:, :]``)."""

    def __init__(self, dim: int, out: int, num_prefix_tokens: int):
        super().__init__()
        self.pred = nn.Linear(dim, out)
        self.num_prefix_tokens = num_prefix_tokens

    def forward(self, x: Tensor) -> Tensor:
        return self.pred(x)[:, self.num_prefix_tokens:]


def decoder_shape(sd: dict[str, Tensor], encoder_dim: int, num_heads: int | None = None
                  ) -> tuple[dict[str, Any], list[str]]:
    """The decoder's sizes read off its official state dict (embed dim, depth, MLP ratio, qkv bias, tokens,
    output size), the heads by MAE's convention unless ``num_heads`` is given; (sizes, notes)."""
    need = ("decoder_embed.weight", "decoder_pos_embed", "decoder_norm.weight", "decoder_pred.weight")
    missing = [k for k in need if k not in sd]
    depth = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"decoder_blocks\.(\d+)\.", k))), default=-1)
    if missing or not depth:
        absent = ", ".join(missing) or "decoder_blocks.*"
        raise CheckpointError(f"the MAE decoder in this checkpoint is incomplete (missing {absent})")
    dim, in_dim = (int(s) for s in sd["decoder_embed.weight"].shape)
    if in_dim != encoder_dim:
        raise CheckpointError(f"the MAE decoder reads {in_dim}-dimensional tokens, the encoder writes {encoder_dim}")
    notes = []
    if num_heads is None:
        num_heads = max(dim // MAE_HEAD_DIM, 1)
        notes.append(f"decoder num_heads={num_heads} assumed (decoder_embed_dim / {MAE_HEAD_DIM}, MAE's 16 heads of "
                     "its 512-wide decoder); pass decoder_num_heads=... if the model used another")
    if dim % num_heads:
        raise ConfigError(f"the MAE decoder is {dim} wide, which {num_heads} heads do not divide")
    fc1 = sd.get("decoder_blocks.0.mlp.fc1.weight")
    sizes = {"dim": dim, "in_dim": in_dim, "depth": depth, "num_heads": num_heads,
             "mlp_ratio": (fc1.shape[0] / dim) if fc1 is not None else 4.0,
             "qkv_bias": "decoder_blocks.0.attn.qkv.bias" in sd,
             "num_tokens": int(sd["decoder_pos_embed"].shape[1]), "out": int(sd["decoder_pred.weight"].shape[0])}
    return sizes, notes


def _module_keys(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Official decoder names -> the names of the modules `attach_decoder` builds (relative to the model)."""
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        m = re.match(r"decoder_blocks\.(\d+)\.(.+)$", k)
        if m:
            out[f"decoder_blocks.{m.group(1)}.{m.group(2)}"] = v
        elif k.startswith("decoder_embed.") or k in ("decoder_pos_embed", "mask_token"):
            out[f"decoder_blocks.0.{k}"] = v
        elif k.startswith("decoder_norm."):
            out["decoder_norm." + k.removeprefix("decoder_norm.")] = v
        elif k.startswith("decoder_pred."):
            out["decoder_pred.pred." + k.removeprefix("decoder_pred.")] = v
        else:
            out[k] = v  # unknown: the strict load names it
    return out


def attach_decoder(model: nn.Module, sd: dict[str, Tensor], num_heads: int | None = None) -> list[str]:
    """Append the MAE decoder of the official state dict ``sd`` (`DECODER_KEYS`, official names) to ``model``, a
    loaded timm VisionTransformer (the MAE encoder), in place, as the module doc says: blocks = encoder blocks +
    decoder blocks, norm = decoder_norm, head = decoder_pred, no pooling, no classes. Every decoder key must load
    (CheckpointError naming the others otherwise). Returns the notes for the load report."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer) or not isinstance(model.fc_norm, nn.Identity):
        raise ConfigError("the MAE decoder attaches to a pretrained MAE encoder (a timm VisionTransformer ending in "
                          "its norm); this model is not one")
    s, notes = decoder_shape(sd, int(model.embed_dim), num_heads)
    tokens = int(model.patch_embed.num_patches) + int(model.num_prefix_tokens)
    if s["num_tokens"] != tokens:
        raise CheckpointError(f"the MAE decoder's position embedding holds {s['num_tokens']} tokens, the encoder "
                              f"makes {tokens}: build the model at the checkpoint's image size")
    kw = {"num_heads": s["num_heads"], "mlp_ratio": s["mlp_ratio"], "qkv_bias": s["qkv_bias"],
          "norm_layer": partial(nn.LayerNorm, eps=1e-6)}
    Block = _block_type()
    blocks = [_entry_block_class()(model.norm, s["in_dim"], tokens, s["dim"], **kw),
              *(Block(s["dim"], **kw) for _ in range(s["depth"] - 1))]
    decoder = nn.Module()
    decoder.decoder_blocks = nn.ModuleList(blocks)
    decoder.decoder_norm = nn.LayerNorm(s["dim"], eps=1e-6)
    decoder.decoder_pred = DecoderPred(s["dim"], s["out"], int(model.num_prefix_tokens))
    _load_strict(decoder, _module_keys(sd))
    decoder.to(next(model.parameters()).device)
    model.vitscope_decoder_from = len(model.blocks)
    model.blocks = nn.Sequential(*model.blocks, *decoder.decoder_blocks)
    model.norm = decoder.decoder_norm
    model.head = decoder.decoder_pred
    model.global_pool, model.num_classes = "", 0
    model.eval()
    return [f"MAE decoder attached: {s['depth']} blocks {s['dim']} wide after the {model.vitscope_decoder_from} "
            "encoder blocks, run on all tokens (no masking)", *notes]


def _load_strict(module: nn.Module, sd: dict[str, Tensor]) -> None:
    own = {k: v for k, v in module.state_dict().items() if ".encoder_norm." not in k}  # the encoder's, loaded
    bad = sorted(set(own) ^ set(sd)) + sorted(k for k in own if k in sd and own[k].shape != sd[k].shape)
    if bad:
        raise CheckpointError(f"the MAE decoder in this checkpoint does not fit the decoder its sizes imply: "
                              f"{', '.join(bad[:6])}")
    module.load_state_dict(sd, strict=False)


def decoder_from(model: nn.Module) -> int | None:
    """The index of ``model``'s first decoder block (its encoder's depth), None for a model without one."""
    return getattr(model, "vitscope_decoder_from", None)
