"""Short model names -> everything needed to build, load and feed the model.

One entry per (supervision, size). Like timm's pretrained configs, an entry carries the architecture,
where its weights live, the preprocessing the weights were trained with, and who to cite. Entries
whose weights timm hosts name a timm tag; the others name the official file (URL) and the checkpoint
layout it is in, which `vitscope.models.layouts` converts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vitscope.errors import UnknownModelError, close_matches

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INCEPTION_MEAN = (0.5, 0.5, 0.5)
INCEPTION_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # train split; the normalisation of every zoo model
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# The controlled zoo's ViT (`vitscope.zoo`): 32 px input, 4 px patches (8x8 grid + CLS), 8 blocks of width
# 96, 3 heads; built as timm's vit_small_patch16_224 with these sizes. Chosen by measurement: docs/ZOO.md.
ZOO_TIMM_ARCH = "vit_small_patch16_224"
ZOO_ARCH_KWARGS = {"img_size": 32, "patch_size": 4, "embed_dim": 96, "depth": 8, "num_heads": 3}
ZOO_PREPROCESSING_ARGS = (CIFAR10_MEAN, CIFAR10_STD, 32, 1.0, "bilinear")  # no resize or crop at 32 px


def zoo_pretrained_cfg_overlay(img_size: int = 32, num_classes: int = 0) -> dict[str, Any]:
    """timm ``pretrained_cfg_overlay`` of a zoo model: the preprocessing vitscope feeds it with.

    Without it timm reports the factory's ImageNet-21k config (mean/std 0.5, 224 px, crop 0.9, a URL of
    weights the zoo never used), so ``timm.data.resolve_data_config(model=m)`` would build the wrong input.
    """
    mean, std, _, crop, interp = ZOO_PREPROCESSING_ARGS
    # lists, not tuples: the same value after the JSON round trip of a checkpoint's stored spec
    return {"mean": list(mean), "std": list(std), "input_size": [3, img_size, img_size], "crop_pct": crop,
            "crop_mode": "center", "interpolation": interp, "num_classes": num_classes, "url": "", "hf_hub_id": "",
            "tag": "vitscope-zoo", "fixed_input_size": True}

#: objective families: explicit labels (supervised), language supervision (CLIP, SigLIP, PE: image-text
#: contrastive, a family of its own in findings and figures), self-supervised contrastive / self-distillation,
#: masked reconstruction (MAE, BEiT, SimMIM, EVA-02's masked modelling of CLIP features), both (DINOv2/v3: DINO with
#: iBOT's masked modelling), autoregressive prediction of patches (AIMv2), prediction in latent space (I-JEPA), or
#: none (an untrained network). `vitscope.findings.FAMILIES` lists the same names (kept torch-free there).
Family = Literal["explicit", "language", "contrastive", "reconstructive", "hybrid", "autoregressive", "latent", "none"]
SourceKind = Literal["timm", "hf", "url", "file", "manual", "none"]


@dataclass(frozen=True)
class WeightSource:
    """Where the weights of an entry come from.

    kind: ``timm`` (``location`` is a pretrained tag timm fetches from the Hugging Face hub),
    ``hf`` (a hub repo id), ``url`` (an official file), ``file`` (a path, relative to the package for
    shipped checkpoints), ``manual`` (no stable direct link: ``location`` is the page to download from),
    ``none`` (random initialisation).
    """

    kind: SourceKind
    location: str = ""
    checkpoint_format: str = "auto"

    def describe(self) -> str:
        return f"{self.kind}:{self.location}" if self.location else self.kind


@dataclass(frozen=True)
class Preprocessing:
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    input_size: int = 224
    crop_pct: float = 0.875
    interpolation: str = "bicubic"

    @property
    def resize_size(self) -> int:
        """Short side before the centre crop (e.g. 256 for 224 at crop_pct 0.875)."""
        return int(round(self.input_size / self.crop_pct))


@dataclass(frozen=True)
class ModelInput(Preprocessing):
    """A loaded model's preprocessing plus what whole-frame datasets need of the model: its ``patch_size``
    (sides of a non-square input are rounded to multiples of it) and whether it takes other input sizes at
    all (``any_size``). `vitscope.models.adapter.ViTModel.preprocessing` hands this out; registry entries
    keep plain `Preprocessing` (so model cache keys do not change)."""

    patch_size: int = 16
    any_size: bool = True


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    family: Family
    supervision: str
    weights: WeightSource
    preprocessing: Preprocessing = field(default_factory=Preprocessing)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    citation: str = ""
    notes: str = ""

    @property
    def timm_name(self) -> str:
        """``arch.tag`` when timm hosts the weights, else the bare architecture."""
        if self.weights.kind == "timm" and self.weights.location:
            return f"{self.arch}.{self.weights.location}"
        return self.arch


def describe_family(family: str | None, supervision: str | None, finetuned_from: str | None = None) -> str:
    """What a model is, for a reader: its objective family ("untrained" for a random initialisation), and for a
    fine-tuned model its start's family plus what it was tuned for, read off the supervision the fine-tuning
    trainer writes ("random init+ft-classification" -> "untrained → classification")."""
    start, _, tuned = str(supervision or "").partition("+ft-")
    base = "untrained" if family in (None, "none") or start == "random init" else str(family)
    if not tuned and finetuned_from:
        tuned = "fine-tuned"
    return f"{base} → {tuned}" if tuned else base


REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in REGISTRY:
        raise ValueError(f"model {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        hint = close_matches(name, REGISTRY)
        msg = f"unknown model {name!r}"
        msg += f"; did you mean {', '.join(hint)}?" if hint else "."
        raise UnknownModelError(msg + " `vitscope models` lists the registry; any timm ViT name works too.") from None


def list_specs() -> list[ModelSpec]:
    return list(REGISTRY.values())


# ---------------------------------------------------------------------------------------------------
# Citations
_AUGREG = "Steiner et al., How to train your ViT? (TMLR 2022)"
_CLIP = "Radford et al., Learning Transferable Visual Models From Natural Language Supervision (ICML 2021)"
_DINO = "Caron et al., Emerging Properties in Self-Supervised Vision Transformers (ICCV 2021)"
_MOCO = "Chen, Xie, He, An Empirical Study of Training Self-Supervised Vision Transformers (ICCV 2021)"
_MAE = "He et al., Masked Autoencoders Are Scalable Vision Learners (CVPR 2022)"
_BEIT = "Bao et al., BEiT: BERT Pre-Training of Image Transformers (ICLR 2022)"
_SIMMIM = "Xie et al., SimMIM: A Simple Framework for Masked Image Modeling (CVPR 2022)"
_DINOV2 = "Oquab et al., DINOv2: Learning Robust Visual Features without Supervision (TMLR 2024)"
_REG = "Darcet et al., Vision Transformers Need Registers (ICLR 2024)"

_SUP_PRE = Preprocessing(INCEPTION_MEAN, INCEPTION_STD, 224, 0.9, "bicubic")
CLIP_PREPROCESSING = Preprocessing(CLIP_MEAN, CLIP_STD, 224, 1.0, "bicubic")  # OpenAI CLIP's: resize, crop 224
_DINO_PRE = Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 0.9, "bicubic")
# DINOv2 weights are trained at 518 px; vitscope builds them at 224 (timm resamples the position
# embedding) so their grid (16x16) is comparable with the /16 models. Pass img_size=518 for the original.
_DINOV2_PRE = Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 1.0, "bicubic")
_MOCO_PRE = Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 0.875, "bilinear")
_BEIT_PRE = Preprocessing(INCEPTION_MEAN, INCEPTION_STD, 224, 0.9, "bicubic")
_SIMMIM_PRE = Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 0.875, "bicubic")

_BEIT_PRETRAIN_KW = {"use_shared_rel_pos_bias": True, "use_rel_pos_bias": False, "global_pool": "token",
                     "num_classes": 0}

for _size, _arch in [("s16", "vit_small_patch16_224"), ("b16", "vit_base_patch16_224"),
                     ("b8", "vit_base_patch8_224"), ("b32", "vit_base_patch32_224"),
                     ("l16", "vit_large_patch16_224")]:
    register(ModelSpec(
        f"sup-{_size}", _arch, "explicit", "supervised",
        WeightSource("timm", "augreg_in21k_ft_in1k"), _SUP_PRE, citation=_AUGREG,
        notes="ImageNet-21k pretraining, ImageNet-1k fine-tuning (AugReg)."))

for _size, _arch in [("b16", "vit_base_patch16_clip_quickgelu_224"),
                     ("b32", "vit_base_patch32_clip_quickgelu_224"),
                     ("l14", "vit_large_patch14_clip_quickgelu_224")]:
    register(ModelSpec(
        f"clip-{_size}", _arch, "language", "clip",
        WeightSource("timm", "openai"), CLIP_PREPROCESSING, {"num_classes": 0}, citation=_CLIP,
        notes="OpenAI image tower with QuickGELU, as trained. Language supervision is a family of its own "
              "(Walmer et al. 2023 group CLIP with explicit supervision; --family clip-b16=explicit does so)."))

for _size, _arch in [("s16", "vit_small_patch16_224"), ("s8", "vit_small_patch8_224"),
                     ("b16", "vit_base_patch16_224"), ("b8", "vit_base_patch8_224")]:
    register(ModelSpec(
        f"dino-{_size}", _arch, "contrastive", "dino",
        WeightSource("timm", "dino"), _DINO_PRE, {"num_classes": 0}, citation=_DINO,
        notes="Teacher backbone. Official full checkpoints (teacher/student) load with weights=PATH."))

register(ModelSpec(
    "mocov3-s16", "vit_small_patch16_224", "contrastive", "mocov3",
    WeightSource("url", "https://dl.fbaipublicfiles.com/moco-v3/vit-s-300ep/vit-s-300ep.pth.tar", "mocov3"),
    _MOCO_PRE, {"num_classes": 0, "num_heads": 12}, citation=_MOCO,
    notes="MoCo-v3's ViT-S has 12 heads (not timm's 6). Base encoder; projector head dropped."))
register(ModelSpec(
    "mocov3-b16", "vit_base_patch16_224", "contrastive", "mocov3",
    WeightSource("url", "https://dl.fbaipublicfiles.com/moco-v3/vit-b-300ep/vit-b-300ep.pth.tar", "mocov3"),
    _MOCO_PRE, {"num_classes": 0}, citation=_MOCO,
    notes="300-epoch pretraining; base encoder, projector head dropped."))

for _size, _arch in [("b16", "vit_base_patch16_224"), ("l16", "vit_large_patch16_224"),
                     ("h14", "vit_huge_patch14_224")]:
    register(ModelSpec(
        f"mae-{_size}", _arch, "reconstructive", "mae",
        WeightSource("timm", "mae"), _DINO_PRE, {"num_classes": 0}, citation=_MAE,
        notes="Pretrained encoder only (no fine-tuning), final `norm` kept."))

for _size, _arch in [("b16", "beit_base_patch16_224"), ("l16", "beit_large_patch16_224")]:
    _file = "base" if _size == "b16" else "large"
    register(ModelSpec(
        f"beit-{_size}", _arch, "reconstructive", "beit",
        WeightSource("url", "https://conversationhub.blob.core.windows.net/beit-share-public/beit/"
                            f"beit_{_file}_patch16_224_pt22k.pth", "beit"),
        _BEIT_PRE, dict(_BEIT_PRETRAIN_KW), citation=_BEIT,
        notes="Self-supervised pretraining on ImageNet-22k only (no fine-tuning); shared relative "
              "position bias."))

register(ModelSpec(
    "simmim-b16", "beit_base_patch16_224", "reconstructive", "simmim",
    WeightSource("manual", "https://github.com/microsoft/SimMIM (ViT-B, 800 epochs, pretrain)", "simmim"),
    _SIMMIM_PRE, dict(_BEIT_PRETRAIN_KW), citation=_SIMMIM,
    notes="SimMIM's ViT is BEiT-shaped (shared relative position bias, layer scale); the encoder is kept."))

for _size, _arch in [("s14", "vit_small_patch14"), ("b14", "vit_base_patch14"), ("l14", "vit_large_patch14")]:
    register(ModelSpec(
        f"dinov2-{_size}", f"{_arch}_dinov2", "hybrid", "dinov2",
        WeightSource("timm", "lvd142m"), _DINOV2_PRE, {"num_classes": 0, "img_size": 224}, citation=_DINOV2,
        notes="DINO + iBOT (masked modelling) objective, LVD-142M data; built at 224 px."))
    register(ModelSpec(
        f"dinov2-{_size}-reg", f"{_arch}_reg4_dinov2", "hybrid", "dinov2",
        WeightSource("timm", "lvd142m"), _DINOV2_PRE, {"num_classes": 0, "img_size": 224},
        citation=f"{_DINOV2}; {_REG}", notes="With 4 register tokens (5 prefix tokens in all)."))

# The families researchers reach for now (issue 45's registry): timm hosts every one's weights except the CLIP
# tower read in open_clip's own layout. Built at the released size unless said; DINOv3 at 224 px (its RoPE takes any
# size; timm's config says 256) so its grid matches the /16 models'.
_DINOV3 = "Siméoni et al., DINOv3 (arXiv:2508.10104, 2025)"
_EVA02 = "Fang et al., EVA-02: A Visual Representation for Neon Genesis (Image and Vision Computing 2024)"
_PE = ("Bolya et al., Perception Encoder: The best visual embeddings are not at the output of the network "
       "(arXiv:2504.13181, 2025)")
_SIGLIP2 = ("Tschannen et al., SigLIP 2: Multilingual Vision-Language Encoders with Improved Semantic Understanding, "
            "Localization, and Dense Features (arXiv:2502.14786, 2025)")
_AIMV2 = "Fini et al., Multimodal Autoregressive Pre-training of Large Vision Encoders (CVPR 2025)"
_IJEPA = ("Assran et al., Self-Supervised Learning from Images with a Joint-Embedding Predictive Architecture "
          "(CVPR 2023)")
_DEIT3 = "Touvron, Cord, Jégou, DeiT III: Revenge of the ViT (ECCV 2022)"
_OPENCLIP = "Ilharco et al., OpenCLIP (software, 2021); Cherti et al., Reproducible scaling laws for CLIP (CVPR 2023)"
_HALF = Preprocessing(INCEPTION_MEAN, INCEPTION_STD, 224, 1.0, "bicubic")

for _size, _arch in [("s16", "vit_small_patch16_dinov3"), ("b16", "vit_base_patch16_dinov3"),
                     ("l16", "vit_large_patch16_dinov3")]:
    register(ModelSpec(
        f"dinov3-{_size}", _arch, "hybrid", "dinov3", WeightSource("timm", "lvd1689m"),
        Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 1.0, "bicubic"),
        {"num_classes": 0, "img_size": 224, "global_pool": "token"}, citation=_DINOV3,
        notes="timm Eva: RoPE, 4 storage (register) tokens beside CLS, layer scale; LVD-1689M data; the S/B/L are "
              "distilled from the 7B. Read out by the normed CLS token, DINOv3's own output (timm's default pools "
              "the patch mean). Official files (facebookresearch/dinov3 layout) load with weights=PATH."))
for _size, _arch in [("b14", "eva02_base_patch14_224"), ("l14", "eva02_large_patch14_224")]:
    register(ModelSpec(
        f"eva02-{_size}", _arch, "reconstructive", "eva02-mim", WeightSource("timm", "mim_in22k"),
        Preprocessing(CLIP_MEAN, CLIP_STD, 224, 0.9, "bicubic"), {"num_classes": 0}, citation=_EVA02,
        notes="timm Eva: RoPE, SwiGLU, sub-LN; the masked-image-modelling stage (EVA-CLIP features as targets, "
              "ImageNet-22k), before any fine-tuning."))
for _size, _arch, _px in [("b16", "vit_pe_core_base_patch16_224", 224), ("l14", "vit_pe_core_large_patch14_336", 336)]:
    register(ModelSpec(
        f"pe-core-{_size}", _arch, "language", "pe-core", WeightSource("timm", "fb"),
        Preprocessing(INCEPTION_MEAN, INCEPTION_STD, _px, 1.0, "bicubic"), {"num_classes": 0}, citation=_PE,
        notes=f"Perception Encoder core image tower (timm Eva, RoPE, CLS token, attention-pool head) at {_px} px; "
              "the CLIP projection head is dropped (the pool's output is the readout)."))
register(ModelSpec(
    "siglip2-b16", "vit_base_patch16_siglip_224", "language", "siglip2", WeightSource("timm", "v2_webli"),
    _HALF, {"num_classes": 0}, citation=_SIGLIP2,
    notes="No CLS token: the MAP attention-pool head is the readout (taps pool, pool_attn). Fixed 224 px "
          "variant (not NaFlex)."))
register(ModelSpec(
    "aimv2-l14", "aimv2_large_patch14_224", "autoregressive", "aimv2", WeightSource("timm", "apple_pt"),
    CLIP_PREPROCESSING, {"num_classes": 0}, citation=_AIMV2,
    notes="No CLS token, RMSNorm, SwiGLU; pretrained with a causal multimodal decoder (pixels and text); timm pools "
          "the mean of the patch tokens."))
register(ModelSpec(
    "ijepa-h14", "vit_huge_patch14_gap_224", "latent", "ijepa", WeightSource("timm", "in1k_ijepa"),
    Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 0.9, "bicubic"), {"num_classes": 0}, citation=_IJEPA,
    notes="Target encoder, ImageNet-1k; no CLS token (the mean of the patch tokens is the readout)."))
register(ModelSpec(
    "deit3-b16", "deit3_base_patch16_224", "explicit", "supervised", WeightSource("timm", "fb_in22k_ft_in1k"),
    Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 224, 1.0, "bicubic"), citation=_DEIT3,
    notes="Supervised with DeiT III's recipe (3-Augment, layer scale), ImageNet-21k then 1k; ImageNet head kept."))
register(ModelSpec(
    "clip-b16-openclip", "vit_base_patch16_clip_quickgelu_224", "language", "clip",
    WeightSource("url", "https://huggingface.co/timm/vit_base_patch16_clip_224.openai/resolve/main/"
                        "open_clip_pytorch_model.bin", "open_clip"),
    CLIP_PREPROCESSING, {"num_classes": 512}, citation=f"{_CLIP}; {_OPENCLIP}",
    notes="OpenAI's ViT-B/16 read from open_clip's own state_dict (visual.transformer.resblocks.*; text tower "
          "dropped; visual.proj as the head); the same weights as clip-b16."))

# The controlled zoo (`vitscope zoo`, docs/ZOO.md): one small ViT per objective, same data (CIFAR-10) and
# budget; the weights ship with the package (float16 safetensors), paths relative to the package.
_ZOO_PRE = Preprocessing(*ZOO_PREPROCESSING_ARGS)
for _name, _objective, _family, _citation in [
        ("zoo-sup", "supervised", "explicit", "Dosovitskiy et al., An Image is Worth 16x16 Words (ICLR 2021)"),
        ("zoo-dino", "dino", "contrastive", _DINO), ("zoo-mocov3", "mocov3", "contrastive", _MOCO),
        ("zoo-mae", "mae", "reconstructive", _MAE), ("zoo-simmim", "simmim", "reconstructive", _SIMMIM),
        ("zoo-hybrid", "hybrid", "hybrid", "Park et al., What do self-supervised ViTs learn? (ICLR 2023)")]:
    register(ModelSpec(
        _name, ZOO_TIMM_ARCH, _family, _objective,
        WeightSource("file", f"zoo/weights/{_objective}/encoder.safetensors", "timm"), _ZOO_PRE,
        {**ZOO_ARCH_KWARGS, "num_classes": 10 if _objective == "supervised" else 0,
         "pretrained_cfg_overlay": zoo_pretrained_cfg_overlay(32, 10 if _objective == "supervised" else 0)},
        citation=_citation,
        notes=f"vitscope controlled zoo, trained on CIFAR-10 (card: zoo/weights/{_objective}/card.json); "
              f"retrain: vitscope zoo train --objective {_objective} --out DIR"))
register(ModelSpec(  # a file, not a seeded timm init: the zoo initialises mimetically with fixed sin-cos positions
    "zoo-random", ZOO_TIMM_ARCH, "none", "random init",
    WeightSource("file", "zoo/weights/random/encoder.safetensors", "timm"), _ZOO_PRE,
    {**ZOO_ARCH_KWARGS, "num_classes": 0, "pretrained_cfg_overlay": zoo_pretrained_cfg_overlay(32, 0)}, citation="",
    notes="the zoo's architecture as every objective starts it (seed 0), untrained: what the architecture gives for "
          "free; written by tools/ship_zoo.py --random"))

# Fine-tuned zoo models, the experiments of Merlin et al. on the zoo (docs/INVARIANCE.md): a contrastive
# (MoCo v3), a masked-modelling (MAE) and the untrained start, fine-tuned on CIFAR-10 for classification
# (encoder + 10-class head) or reconstruction (encoder). Folder zoo/weights/<init>-ft-<task>/: the final
# encoder, its card and log, and for one run the per-epoch checkpoints (checkpoints/encoder_epochNNN).
_MERLIN = "Merlin et al., What happens during finetuning of ViTs: an invariance based investigation (2023)"
for _init, _task in [("mocov3", "cls"), ("mae", "cls"), ("random", "cls"), ("mocov3", "rec"), ("mae", "rec")]:
    _start = ("--init zoo-random" if _init == "random"
              else f"--init src/vitscope/zoo/weights/{_init}/encoder.safetensors")
    register(ModelSpec(  # family and supervision as the fine-tuning trainer writes them into the file
        f"zoo-{_init}-ft-{_task}", ZOO_TIMM_ARCH,
        {"mocov3": "contrastive", "mae": "reconstructive", "random": "none"}[_init],
        f"{'random init' if _init == 'random' else _init}"
        f"+ft-{'classification' if _task == 'cls' else 'reconstruction'}",
        WeightSource("file", f"zoo/weights/{_init}-ft-{_task}/encoder.safetensors", "timm"), _ZOO_PRE,
        {**ZOO_ARCH_KWARGS, "num_classes": 10 if _task == "cls" else 0,
         "pretrained_cfg_overlay": zoo_pretrained_cfg_overlay(32, 10 if _task == "cls" else 0)}, citation=_MERLIN,
        notes=f"zoo-{_init} fine-tuned on CIFAR-10 ({'classification' if _task == 'cls' else 'reconstruction'}); "
              f"train: vitscope zoo train --objective finetune {_start} --task "
              f"{'classification' if _task == 'cls' else 'reconstruction'} --out DIR --epochs 8 "
              "--epoch-views 10000 --threads 1, then tools/ship_zoo.py DIR "
              f"{_init}-ft-{_task}"))
