"""DINO: self-distillation with no labels (Caron et al., ICCV 2021; official code ``facebookresearch/dino``).

A student (encoder + DINO head) matches, on every view, the sharpened and centred output of an EMA
teacher that sees only the global views:
  * multi-crop: 2 global crops at the training size + ``n_local`` local crops at half the side (the
    student sees all, the teacher the 2 globals); every (teacher global, student view) pair of
    different views is a cross-entropy term, averaged (``DINOLoss``);
  * teacher output: softmax((t - c) / tau_t) with tau_t = 0.04 (sharpening) and the centre c an EMA
    (0.9) of the teacher's batch means (centring); student: log-softmax(s / 0.1);
  * DINO head: 3-layer MLP (Linear-BN-GELU, DINO's ``use_bn_in_head``) -> L2-normalised bottleneck ->
    weight-normalised linear layer whose norm is fixed to 1 (``norm_last_layer=True``). Batch norm in the
    head is what lets the teacher sharpen at this scale: an untrained ViT's CLS tokens are nearly alike, so
    without it every image lands on the same prototypes, centring cancels them and the teacher's output stays
    near uniform (the first zoo-dino: entropy 7.2 of log 4096 = 8.3); batch norm spreads the batch over the
    prototypes from the first step (docs/zoo-history.md, "DINO: the teacher that stayed uniform");
  * teacher <- EMA of the student, momentum on a cosine from ``momentum`` to 1 (the paper: 0.996 for
    100+ epochs; 0.98 here because the zoo budget is under a thousand steps: the teacher averages over
    ~50 steps at first rather than ~250 of ~1000);
  * multi-crop with 2 local crops (the paper: 6-10): at a fixed budget of image-views, fewer crops per image
    buy more optimisation steps (781 instead of 558 at 250,000 views); measured (docs/zoo-history.md), the
    2-crop run beat the 6-crop one (momentum 0.99) on every measure (docs/ZOO.md);
  * the exported model is the teacher's backbone, as in DINO's released weights.
Head sizes are scaled down for the small model (hidden 1024, bottleneck 128, 1024 prototypes; the paper:
2048, 256, 65536): the teacher scores 2 x 128 global views per step, and a sharp, diverse target needs
prototypes of the order of the batch, not 30 times more.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitscope.zoo.arch import ZOO_ARCH, ZooArch, build_encoder, encode
from vitscope.zoo.base import Objective, cosine_ramp, ema_update, frozen_copy
from vitscope.zoo.data import ViewBatch, ViewSpec


class WeightNormLinear(nn.Module):
    """Linear layer W = g * v / ||v|| (row-wise), no bias; g fixed to 1 when ``norm_fixed``.

    DINO builds it with ``nn.utils.weight_norm`` and sets ``weight_g = 1``, ``requires_grad=False``.
    """

    def __init__(self, in_dim: int, out_dim: int, norm_fixed: bool = True):
        super().__init__()
        self.weight_v = nn.Parameter(torch.empty(out_dim, in_dim))
        nn.init.trunc_normal_(self.weight_v, std=0.02)
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=not norm_fixed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True)
        return F.linear(x, w)


class DINOHead(nn.Module):
    """MLP -> L2-normalised bottleneck -> weight-normalised prototypes (``dino/vision_transformer.py``)."""

    def __init__(self, in_dim: int, out_dim: int = 4096, hidden: int = 1024, bottleneck: int = 128,
                 layers: int = 3, norm_last_layer: bool = True, use_bn: bool = False):
        super().__init__()
        mods: list[nn.Module] = []
        d = in_dim
        for _ in range(layers - 1):
            # use_bn: DINO's ``use_bn_in_head`` (Linear-BN-GELU), the official option for small batches / ResNets
            mods += [nn.Linear(d, hidden), *([nn.BatchNorm1d(hidden)] if use_bn else []), nn.GELU()]
            d = hidden
        mods.append(nn.Linear(d, bottleneck))
        self.mlp = nn.Sequential(*mods)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = WeightNormLinear(bottleneck, out_dim, norm_fixed=norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class DINO(Objective):
    name = "dino"
    family = "contrastive"
    citation = "Caron et al., Emerging Properties in Self-Supervised Vision Transformers (ICCV 2021)"
    summary = "self-distillation: EMA teacher, centring + sharpening, multi-crop (2 global + local)"

    def __init__(self, arch: ZooArch = ZOO_ARCH, num_classes: int = 10, n_local: int = 2, out_dim: int = 1024,
                 hidden: int = 1024, bottleneck: int = 128, student_temp: float = 0.1, teacher_temp: float = 0.04,
                 center_momentum: float = 0.9, momentum: float = 0.98, freeze_last_layer_steps: int = 0,
                 warmup_teacher_temp: float | None = None, teacher_temp_warmup_frac: float = 0.0,
                 norm_last_layer: bool = True, use_bn: bool = True):
        super().__init__(arch)
        self.views = ViewSpec(n_global=2, n_local=n_local, global_scale=(0.4, 1.0), local_scale=(0.05, 0.4),
                              colour=True)
        self.encoder = build_encoder(arch, 0)
        self.head = DINOHead(arch.embed_dim, out_dim, hidden, bottleneck, norm_last_layer=norm_last_layer,
                             use_bn=use_bn)
        self.norm_last_layer, self.use_bn = norm_last_layer, use_bn
        self.teacher = frozen_copy(self.encoder)
        self.teacher_head = frozen_copy(self.head)
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.n_local, self.out_dim, self.hidden, self.bottleneck = n_local, out_dim, hidden, bottleneck
        self.student_temp, self.teacher_temp = student_temp, teacher_temp
        self.center_momentum, self.base_momentum = center_momentum, momentum
        self.freeze_last_layer_steps = freeze_last_layer_steps
        self.momentum = momentum
        # teacher temperature: linear from warmup_teacher_temp to teacher_temp over the first
        # teacher_temp_warmup_frac of the steps, then constant (DINO's warmup_teacher_temp(_epochs))
        self.warmup_teacher_temp = teacher_temp if warmup_teacher_temp is None else warmup_teacher_temp
        self.teacher_temp_warmup_frac = teacher_temp_warmup_frac
        self.current_teacher_temp = self.warmup_teacher_temp

    def _student(self, views: list[torch.Tensor]) -> torch.Tensor:
        return self.head(encode(self.encoder, torch.cat(views))[:, 0])

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        student = [self._student(batch.global_views)]
        if batch.local_views:
            student.append(self._student(batch.local_views))
        s = torch.cat(student).float() / self.student_temp  # fp32 under autocast
        s_chunks = s.chunk(len(batch.global_views) + len(batch.local_views))
        with torch.no_grad():
            t_raw = self.teacher_head(encode(self.teacher, torch.cat(batch.global_views))[:, 0]).float()
            t = F.softmax((t_raw - self.center) / self.current_teacher_temp, dim=-1)
        t_chunks = t.chunk(len(batch.global_views))
        total, terms = s.new_zeros(()), 0
        for iq, q in enumerate(t_chunks):
            for v, sv in enumerate(s_chunks):
                if v == iq:
                    continue
                total = total + torch.sum(-q * F.log_softmax(sv, dim=-1), dim=-1).mean()
                terms += 1
        loss = total / terms
        with torch.no_grad():
            # cross-entropy = teacher entropy + KL(teacher || student): the two collapse monitors of DINO
            # (Caron et al. 2021, Sec. 5.3): uniform collapse -> entropy = log K, one-hot -> entropy = 0.
            # every teacher view is paired with the same number of student views
            mean_ent = (-(t * torch.log(t.clamp_min(1e-12))).sum(-1)).mean()
            # entropy of the batch's mean teacher output: how many prototypes the batch uses in all; low
            # per-image entropy with a high batch entropy is a healthy teacher, both low is one-hot collapse
            p_bar = t.mean(0)
            batch_ent = -(p_bar * torch.log(p_bar.clamp_min(1e-12))).sum()
            if self.training:
                self.center.mul_(self.center_momentum).add_(t_raw.mean(0, keepdim=True),
                                                            alpha=1 - self.center_momentum)
        return loss, {"teacher_entropy": float(mean_ent), "teacher_batch_entropy": float(batch_ent),
                      "kl": float(loss.detach() - mean_ent),
                      "momentum": self.momentum, "teacher_temp": self.current_teacher_temp}

    def before_optimizer_step(self, step: int, total: int) -> None:
        if step < self.freeze_last_layer_steps:
            for p in self.head.last_layer.parameters():
                p.grad = None

    def set_progress(self, step: int, total: int) -> None:
        self.momentum = cosine_ramp(self.base_momentum, 1.0, step, total)
        warm = self.teacher_temp_warmup_frac * total
        f = min(step / warm, 1.0) if warm > 0 else 1.0
        self.current_teacher_temp = self.warmup_teacher_temp + f * (self.teacher_temp - self.warmup_teacher_temp)

    @torch.no_grad()
    def after_optimizer_step(self, step: int, total: int) -> None:
        ema_update(self.teacher, self.encoder, self.momentum)
        ema_update(self.teacher_head, self.head, self.momentum)

    def export(self) -> nn.Module:
        return self.teacher

    def hparams(self) -> dict[str, Any]:
        return {"n_local": self.n_local, "out_dim": self.out_dim, "hidden": self.hidden,
                "bottleneck": self.bottleneck, "student_temp": self.student_temp,
                "teacher_temp": self.teacher_temp, "center_momentum": self.center_momentum,
                "momentum": self.base_momentum, "freeze_last_layer_steps": self.freeze_last_layer_steps,
                "warmup_teacher_temp": self.warmup_teacher_temp,
                "teacher_temp_warmup_frac": self.teacher_temp_warmup_frac, "norm_last_layer": self.norm_last_layer,
                "use_bn": self.use_bn}
