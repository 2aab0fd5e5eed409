"""Fine-tuning any checkpoint, for classification or for reconstruction (Merlin et al., "What happens
during finetuning of ViTs: an invariance based investigation", Sec. 4 and App. B).

  * classification: the checkpoint's ViT with a (new, if the class count differs) linear head on the
    CLS token (timm's ``forward_head``), cross-entropy;
  * reconstruction: the image is rebuilt from the last layer's patch tokens by a small convolutional
    decoder, the one of Hugging Face's ``ViTForMaskedImageModeling`` that Merlin et al. based theirs on
    (a 1x1 convolution to patch*patch*3 channels, then a pixel shuffle), with an L1 loss against the
    (normalised) input; nothing is masked.
The whole network is trained. The training loop saves the encoder at the epochs asked for
(``save_epochs``, every epoch by default, and epoch 0 = the checkpoint itself), so the analyses can follow
the fine-tuning dynamics (Merlin et al. 2023, Sec. 4.4: learning / forgetting per epoch).

``init`` is anything `vitscope.load_model` accepts: a zoo checkpoint (``encoder.safetensors``), a
registry or timm name with its weights. A model with another input size is fed the 32-px views resized
to its size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitscope.models.registry import Preprocessing
from vitscope.zoo.arch import ZooArch, check_encoder, encode
from vitscope.zoo.base import Objective
from vitscope.zoo.data import ViewBatch, ViewSpec

TASKS = ("classification", "reconstruction")


class ConvDecoder(nn.Module):
    """Patch tokens (B, N, D) -> image (B, 3, H, W): Conv2d(D, p*p*3, 1) + PixelShuffle(p) (Hugging Face
    ``ViTForMaskedImageModeling.decoder``)."""

    def __init__(self, dim: int, patch: int, channels: int = 3):
        super().__init__()
        self.patch = patch
        self.net = nn.Sequential(nn.Conv2d(dim, patch * patch * channels, kernel_size=1), nn.PixelShuffle(patch))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, n, d = tokens.shape
        g = int(round(n**0.5))
        return self.net(tokens.transpose(1, 2).reshape(b, d, g, g))


class FineTune(Objective):
    name = "finetune"
    family = "explicit"
    citation = ("Merlin et al., What happens during finetuning of ViTs: an invariance based investigation "
                "(2023)")
    summary = "fine-tune a checkpoint: classification (CE on CLS) or reconstruction (conv decoder, L1)"

    def __init__(self, arch: ZooArch | None = None, num_classes: int = 10, init: str | Path | None = None,
                 task: str = "classification"):
        if init is None:
            raise ValueError("fine-tuning needs a checkpoint: init='path/to/encoder.safetensors' (or a model name)")
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        from vitscope.models import load_model

        vm = load_model(init)
        enc = vm.model
        check_encoder(enc)
        super().__init__(ZooArch(img_size=vm.img_size[0], patch_size=vm.patch_size, embed_dim=vm.embed_dim,
                                 depth=vm.depth, num_heads=vm.num_heads))
        self.init, self.task, self.source_spec = str(init), task, vm.spec
        self._pre = vm.preprocessing
        self.views = ViewSpec(n_global=1)
        self.encoder = enc.train()
        if task == "classification":
            if enc.num_classes != num_classes:
                enc.reset_classifier(num_classes)
            self.decoder = None
        else:
            self.decoder = ConvDecoder(vm.embed_dim, vm.patch_size)
            for p in enc.head.parameters():  # the old head takes no part in reconstruction
                p.requires_grad_(False)

    @property
    def preprocessing(self) -> Preprocessing:
        return self._pre

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x = batch.global_views[0]
        tokens = encode(self.encoder, x)
        if self.task == "classification":
            logits = self.encoder.forward_head(tokens)
            acc = (logits.argmax(-1) == batch.labels).float().mean()
            return F.cross_entropy(logits, batch.labels), {"train_acc": float(acc)}
        npt = self.encoder.num_prefix_tokens
        rec = self.decoder(tokens[:, npt:])
        return F.l1_loss(rec, x), {}

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's image for normalised images x (reconstruction task)."""
        if self.decoder is None:
            raise ValueError("only the reconstruction task has a decoder")
        return self.decoder(encode(self.encoder, x)[:, self.encoder.num_prefix_tokens:])

    def export_kwargs(self) -> dict[str, Any]:
        n = int(self.encoder.num_classes)
        kw = {**self.source_spec.model_kwargs, "num_classes": n}
        if "pretrained_cfg_overlay" in kw:  # a zoo model's data config, with the new head's size
            kw["pretrained_cfg_overlay"] = {**kw["pretrained_cfg_overlay"], "num_classes": n}
        return kw

    def export_fields(self) -> dict[str, str]:
        return {"family": self.source_spec.family, "supervision": f"{self.source_spec.supervision}+ft-{self.task}",
                "citation": self.citation, "arch": self.source_spec.arch}

    def hparams(self) -> dict[str, Any]:
        return {"init": self.init, "task": self.task, "source": self.source_spec.name}
