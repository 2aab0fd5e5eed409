"""Tap points: every place an activation can be read, by a stable name, on each supported architecture.

Per block i (0-based):
  block{i}.norm1      output of the first LayerNorm                            (B, T, D)
  block{i}.qkv        output of the fused q/k/v projection                     (B, T, 3*D)
  block{i}.attn       softmax attention probabilities, the real ones           (B, H, T, T)
  block{i}.heads      per-head attention outputs (attn @ v), heads concatenated (B, T, D)
                      before the output projection: head h is [..., h*D/H:(h+1)*D/H]
  block{i}.attn_out   attention branch as added to the residual stream         (B, T, D)
                      (after proj and layer scale, if any)
  block{i}.resid_mid  residual stream between the attention and MLP sub-blocks (B, T, D)
  block{i}.norm2      output of the second LayerNorm                           (B, T, D)
  block{i}.fc1        first MLP linear, before the activation                  (B, T, 4*D)
  block{i}.fc2        second MLP linear                                        (B, T, D)
  block{i}.mlp_out    MLP branch as added to the residual stream (after layer scale)
  block{i}.out        residual stream after the block                          (B, T, D)
plus embed (the residual stream entering block 0: patches + prefix tokens + position embedding, after
any pre-norm), final_norm (after the last norm), pool and logits (the model's output: class logits, or the
pooled feature for headless models), and on a model with an attention-pool head pool_attn:
  pool       the image vector the model's head reads (B, D), as its own pooling gives it, before fc_norm and the
             classifier: the CLS token ('token' pooling), the mean of the patch tokens ('avg'), or the attention
             pool's output (SigLIP's MAP head, PE's attention pool; timm's ``AttentionPoolLatent``). Which one is
             the model's *readout* (`ViTModel.readout`). Not on a model that pools in its head (``global_pool=''``)
             or on a distilled DeiT (two tokens, two heads).
  pool_attn  the attention pool's query attention over the tokens it pools (B, H, Q, T), Q its learned queries
             (1 for SigLIP and PE): softmax(q kᵀ scale) recomputed from the pool's keys (its kv projection's
             output) and its query (timm fuses the attention); key index t is token t of the sequence, the
             prefix tokens a pool does not see (a ViT's pool_include_prefix=False) given weight 0, so rows sum
             to 1 over the tokens it reads.

Identities that hold exactly (and are tested): resid_mid = block input + attn_out, out = resid_mid +
mlp_out. Each tap is a forward (or pre-forward) hook on a real module of the timm model; nothing is
recomputed except BEiT's qkv (timm calls F.linear directly there) and its layer-scaled branches
(gamma is a bare parameter), which are recomputed from the hooked tensors with the model's own weights.

Eva (EVA-02, DINOv3, Perception Encoder; family 'eva') has every tap, with these differences:
  qkv       q, k, v before the q/k norms and RoPE, concatenated as a fused projection lays them out
            (B, T, (H + 2 * H_kv) * d): with q/v biases as bare parameters, the F.linear timm calls,
            recomputed with the model's weights (the bias added to the projection's output when
            ``qkv_bias_separate``); with separate q_proj/k_proj/v_proj (EVA-02 B/L, GQA), their three
            outputs recomputed from the attention input and concatenated.
  attn      the softmax output, RoPE applied to q and k of the patch tokens as the model applies it (prefix
            tokens are not rotated), eager path.
  heads     attn @ v, heads concatenated, before the attention's inner norm (EVA-02's scale_attn_inner),
            its output gate and proj (the input of ``attn.norm``, an Identity when there is no inner norm).
  attn_out, mlp_out  the branches times gamma_1 / gamma_2 (layer scale as bare parameters, as BEiT).
  fc1       the first MLP linear before the activation: (B, T, hidden) for a plain MLP; for a gated MLP
            (SwiGLU) the gate half then the value half (B, T, 2 * hidden): GluMlp's packed fc1 as it is,
            SwiGLU's fc1_g and fc1_x recomputed from the MLP input and concatenated in that order.
  embed     the residual stream entering block 0 (after norm_pre, PE's pre-LayerNorm); RoPE is not in it (it
            acts inside attention only).
  final_norm  ``model.norm``: an Identity where the model normalises after pooling instead (EVA-02, avg
            pool: ``fc_norm``), so there it equals the last block's output.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vitscope.errors import UnknownTapError, close_matches, preview

BLOCK_TAPS = ("norm1", "qkv", "attn", "heads", "attn_out", "resid_mid", "norm2", "fc1", "fc2", "mlp_out", "out")
GLOBAL_TAPS = ("embed", "final_norm", "pool", "logits")
POOL_ATTN = "pool_attn"  # only on a model with an attention-pool head
_BLOCK_RX = re.compile(r"^block(-?\d+)\.(\w+)$")

Getter = Callable[[tuple, object], torch.Tensor]  # (forward args, output) -> tensor


@dataclass(frozen=True)
class HookPoint:
    """Where and how a tap is read: a module, pre- or post-forward, and how to get the tensor."""

    module: nn.Module
    when: Literal["pre", "post"]
    get: Getter
    needs_unfused: nn.Module | None = None  # attention module whose fused (SDPA) path must be off


def tap_names(depth: int, pool: bool = True, pool_attn: bool = False) -> list[str]:
    """Every tap of a model of ``depth`` blocks, in forward order; ``pool``: whether it has the ``pool`` tap (a
    model whose head reads one pooled vector), ``pool_attn``: whether it has an attention-pool head."""
    blocks = [f"block{i}.{t}" for i in range(depth) for t in BLOCK_TAPS]
    return ["embed", *blocks, "final_norm", *([POOL_ATTN] if pool_attn else []), *(["pool"] if pool else []),
            "logits"]


def parse_tap(name: str) -> tuple[int | None, str]:
    """``'block3.attn'`` -> (3, 'attn'); ``'embed'`` -> (None, 'embed')."""
    m = _BLOCK_RX.match(name)
    if m:
        return int(m.group(1)), m.group(2)
    return None, name


def expand_taps(patterns: list[str] | str, depth: int) -> list[str]:
    """Expand ``'*.out'``/``'block*.attn'``-style patterns (fnmatch) to tap names, keeping order.
    Negative block indices count from the end: ``'block-1.out'`` is the last block's output."""
    import fnmatch

    if isinstance(patterns, str):
        patterns = [patterns]
    names = tap_names(depth)
    out: list[str] = []
    for p in patterns:
        if any(c in p for c in "*?["):
            hits = [n for n in names if fnmatch.fnmatchcase(n, p)]
            if not hits:
                raise UnknownTapError(f"tap pattern {p!r} matches no tap of this model")
            out.extend(h for h in hits if h not in out)
        else:
            idx, kind = parse_tap(p)
            if idx is not None and idx < 0:
                p = f"block{idx + depth}.{kind}"
            if p not in out:
                out.append(p)
    return out


def _arg0(args: tuple, out: object) -> torch.Tensor:
    return args[0]


def _output(args: tuple, out: object) -> torch.Tensor:
    return out  # type: ignore[return-value]


def _scaled(gamma: nn.Parameter | None) -> Getter:
    if gamma is None:
        return _output
    return lambda args, out: gamma * out  # type: ignore[operator]


def _beit_qkv(attn: nn.Module) -> Getter:
    def get(args: tuple, out: object) -> torch.Tensor:
        x = args[0]
        if attn.q_bias is None:
            return attn.qkv(x)
        bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        return F.linear(x, attn.qkv.weight, bias)
    return get


def _eva_qkv(attn: nn.Module) -> Getter:
    """q, k, v as EvaAttention / AttentionRope compute them from the attention input, before q/k norm and RoPE."""
    def fused_bias(args: tuple, out: object) -> torch.Tensor:
        bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        return F.linear(args[0], attn.qkv.weight, bias)

    def separate(args: tuple, out: object) -> torch.Tensor:
        x = args[0]
        return torch.cat((attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)), dim=-1)
    return separate if attn.qkv is None else fused_bias


def _swiglu_fc1(mlp: nn.Module) -> Getter:
    """timm's SwiGLU (separate fc1_g and fc1_x): the gate half then the value half, as GluMlp packs them."""
    def get(args: tuple, out: object) -> torch.Tensor:
        x = args[0]
        return torch.cat((mlp.fc1_g(x), mlp.fc1_x(x)), dim=-1)
    return get


def _fc1(mlp: nn.Module) -> HookPoint:
    if getattr(mlp, "fc1", None) is not None:
        return HookPoint(mlp.fc1, "post", _output)
    return HookPoint(mlp, "pre", _swiglu_fc1(mlp))


def has_pool(model: nn.Module) -> bool:
    """Whether ``model``'s head reads one pooled vector through ``fc_norm`` (the ``pool`` tap)."""
    from timm.models.deit import VisionTransformerDistilled

    if isinstance(model, VisionTransformerDistilled) or not hasattr(model, "fc_norm"):
        return False
    return getattr(model, "attn_pool", None) is not None or bool(getattr(model, "global_pool", ""))


def _pool_attention(model: nn.Module) -> Getter:
    """timm's ``AttentionPoolLatent``: its queries' attention over its input, (B, H, Q, T), prefix keys it does not
    see padded with 0 (see the module doc); read at the pool's ``kv`` projection, whose output holds the keys."""
    pool = model.attn_pool
    skipped = 0 if getattr(model, "pool_include_prefix", True) else int(model.num_prefix_tokens)

    def get(args: tuple, out: object) -> torch.Tensor:
        kv: torch.Tensor = out  # type: ignore[assignment]
        B, N, _ = kv.shape
        q = pool.q(pool.latent.expand(B, -1, -1)).reshape(B, pool.latent_len, pool.num_heads, pool.head_dim)
        k = kv.reshape(B, N, 2, pool.num_heads, pool.head_dim)[:, :, 0]
        q, k = pool.q_norm(q.transpose(1, 2)), pool.k_norm(k.transpose(1, 2))
        attn = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return F.pad(attn, (skipped, 0)) if skipped else attn
    return get


def _eva_hook_point(blk: nn.Module, kind: str) -> HookPoint:
    """Block taps on a timm Eva pre-norm block (`timm.models.eva.EvaBlock`): see the module doc."""
    attn, mlp = blk.attn, blk.mlp
    if kind == "qkv":
        if attn.qkv is not None and getattr(attn, "q_bias", None) is None:
            return HookPoint(attn.qkv, "post", _output)
        if attn.qkv is not None and getattr(attn, "qkv_bias_separate", False):
            # timm adds the bias in place (qkv += bias) after the projection's forward hook has run
            return HookPoint(attn.qkv, "post",
                             lambda args, out: out + torch.cat((attn.q_bias, attn.k_bias, attn.v_bias)))
        return HookPoint(attn, "pre", _eva_qkv(attn))
    if kind == "fc1":
        return _fc1(mlp)
    table: dict[str, Callable[[], HookPoint]] = {
        "norm1": lambda: HookPoint(blk.norm1, "post", _output),
        "attn": lambda: HookPoint(attn.attn_drop, "post", _output, needs_unfused=attn),
        "heads": lambda: HookPoint(attn.norm, "pre", _arg0),
        "attn_out": lambda: HookPoint(attn, "post", _scaled(blk.gamma_1)),
        "resid_mid": lambda: HookPoint(blk.norm2, "pre", _arg0),
        "norm2": lambda: HookPoint(blk.norm2, "post", _output),
        "fc2": lambda: HookPoint(mlp.fc2, "post", _output),
        "mlp_out": lambda: HookPoint(mlp, "post", _scaled(blk.gamma_2)),
        "out": lambda: HookPoint(blk, "post", _output),
    }
    return table[kind]()


def hook_point(model: nn.Module, family: str, tap: str) -> HookPoint:
    """The hook that reads ``tap`` on ``model`` (family 'vit' = timm VisionTransformer, 'beit' = Beit, 'eva' =
    Eva)."""
    idx, kind = parse_tap(tap)
    if idx is None:
        if kind == "embed":
            return HookPoint(model.blocks[0], "pre", _arg0)
        if kind == "final_norm":
            return HookPoint(model.norm, "post", _output)
        if kind == "pool" and has_pool(model):
            return HookPoint(model.fc_norm, "pre", _arg0)
        if kind == POOL_ATTN and getattr(model, "attn_pool", None) is not None:
            return HookPoint(model.attn_pool.kv, "post", _pool_attention(model))
        if kind == "logits":
            return HookPoint(model, "post", _output)
        raise KeyError(tap)
    if idx >= len(model.blocks) or kind not in BLOCK_TAPS:
        raise KeyError(tap)
    blk = model.blocks[idx]
    if family == "eva":
        return _eva_hook_point(blk, kind)
    attn = blk.attn
    beit = family == "beit"
    table: dict[str, HookPoint] = {
        "norm1": HookPoint(blk.norm1, "post", _output),
        "qkv": (HookPoint(attn, "pre", _beit_qkv(attn)) if beit and getattr(attn, "q_bias", None) is not None
                else HookPoint(attn.qkv, "post", _output)),
        "attn": HookPoint(attn.attn_drop, "post", _output, needs_unfused=attn),
        "heads": HookPoint(attn.proj, "pre", _arg0),
        "attn_out": (HookPoint(attn, "post", _scaled(blk.gamma_1)) if beit
                     else HookPoint(blk.ls1, "post", _output)),
        "resid_mid": HookPoint(blk.norm2, "pre", _arg0),
        "norm2": HookPoint(blk.norm2, "post", _output),
        "fc1": _fc1(blk.mlp),
        "fc2": HookPoint(blk.mlp.fc2, "post", _output),
        "mlp_out": (HookPoint(blk.mlp, "post", _scaled(blk.gamma_2)) if beit
                    else HookPoint(blk.ls2, "post", _output)),
        "out": HookPoint(blk, "post", _output),
    }
    return table[kind]


def check_taps(taps: list[str], valid: list[str]) -> None:
    valid_set = set(valid)
    for t in taps:
        if t not in valid_set:
            hint = close_matches(t, valid, n=4)
            msg = f"unknown tap {t!r}"
            if hint:
                msg += f"; did you mean {', '.join(hint)}?"
            raise UnknownTapError(f"{msg} Valid taps for this model: {preview(valid, 14)} "
                                  "(`vitscope taps MODEL` lists them all).")
