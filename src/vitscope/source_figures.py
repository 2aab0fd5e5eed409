"""Every figure and table of the five source documents (``../shared/seeds/``, `vitscope.references.SEEDS`) and
what in vitscope computes it: the analyses, the authors' settings as parameters, and, where vitscope departs
from the authors' code or cannot run the item, why. `vitscope analyses --markdown` prints it as the
"Source figure -> analysis" table of docs/analyses.md; tests/test_source_figures.py checks that every
analysis and parameter named here exists.

Parameters are written ``analysis.param=value`` (the study config's ``analyses.<analysis>.<param>``); ``model:``
and ``dataset:`` name options of a model or dataset entry. A leaf module: plain data, no imports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceItem:
    """One figure or table. ``analyses``: what computes it (empty: nothing here does, ``note`` says why);
    ``params``: the authors' settings (``analysis.param=value``, ``model:key=value``, ``dataset:key=value``);
    ``note``: how vitscope's default departs from the authors' and which parameter selects theirs, or why the
    item is not an analysis."""

    seed: str
    item: str
    shows: str
    analyses: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    note: str = ""


def _i(seed: str, item: str, shows: str, analyses: str = "", params: str = "", note: str = "") -> SourceItem:
    return SourceItem(seed, item, shows, tuple(analyses.split()), tuple(params.split()), note)


_NOT_ANALYSIS = "an illustration of a method, not a measurement"

ITEMS: tuple[SourceItem, ...] = (
    # -- 000: Shekhar et al. 2022 -------------------------------------------------------------------------
    _i("000", "Fig. 1", "CKA between all pairs of layers, contrastive vs reconstructive ViT-B/16", "cka",
       "cka.batch_size=32 cka.taps=block*.out",
       "1,024 images in minibatches of 32 as in the paper: a dataset entry with n_images: 1024"),
    _i("000", "Fig. 2", "CKA per sub-layer type (LayerNorm-1, MHSA-QKV, MLP-FC1), MoCo v3 vs MAE", "cka",
       "cka.taps=block*.norm1,block*.qkv,block*.fc1"),
    _i("000", "Fig. 3", "20-NN accuracy per block (CLS, GAP, GAP without CLS) and the linear probe", "semantics",
       "semantics.ks=20 semantics.views=cls,gap,gap_spatial semantics.probe=cls,gap_spatial"),
    _i("000", "Fig. 4", "Kendall's tau of the top-5/10/100 class ranks and top-1 F1 between models", "head_agreement",
       "", "from the models' own heads (both loaded with a classification head over the same classes); the paper "
       "ranks a linear probe's outputs, which it trained on ImageNet"),
    _i("000", "Fig. 5", "CKA between MoCo v3 and MAE before and after fine-tuning", "cka",
       "cka.taps=block*.out", "pretrained and fine-tuned checkpoints as models of one study: the cross-model grids"),
    _i("000", "Fig. 6", "CKA before and after fine-tuning per layer type", "cka",
       "cka.taps=block*.norm1,block*.qkv,block*.fc1"),
    # -- 001: Park et al. 2023 (slides: items by slide title) ---------------------------------------------
    _i("001", "CL and MIM may not be a silver bullet", "linear-probe, fine-tuning and dense accuracies of "
       "published models", "", "", "the authors' training and fine-tuning results; vitscope's per-layer probe "
       "(semantics) measures the linear-probe side"),
    _i("001", "Self-attentions of CL capture global relationships", "attention maps of chosen query tokens per "
       "head and block, MoCo v3 vs SimMIM", "query_attention_maps", "query_attention_maps.queries=centre,corner"),
    _i("001", "CL mainly captures global relations", "attention distance per head and depth",
       "attention_distance"),
    _i("001", "Self-attentions of CL collapse into homogeneity", "NMI between queries and keys per depth",
       "attention_nmi"),
    _i("001", "The attention collapse reduces the diversity", "mini-batch CKA between heads, depths and tokens",
       "diversity"),
    _i("001", "CL and MIM transform representations differently", "tokens of one or two images before and after "
       "a block (CL translates all tokens in unison)", "block_updates"),
    _i("001", "SVD analysis: token-level and image-level", "singular values of token and image representations",
       "svd_volume"),
    _i("001", "Token-level t-SNE visualization", "t-SNE of the tokens of a few images", "tsne"),
    _i("001", "Fourier analysis", "relative log amplitude of the representations' Fourier transform", "fourier"),
    _i("001", "CL is shape-biased whereas MIM is texture-biased", "shape bias on Stylized ImageNet, per category "
       "and its mean", "shape_bias", "", "the cue-conflict images (Geirhos et al.) stand in for Stylized ImageNet"),
    _i("001", "Robustness to low- and high-frequency noise", "accuracy drop under band-limited noise, window "
       "0.1 pi", "band_noise", "band_noise.width=0.3141592653589793"),
    _i("001", "Later layers of CL and early layers of MIM are important", "linear-probe accuracy per depth",
       "semantics", "semantics.probe=cls,gap_spatial semantics.standardize=false",
       "the slides' probe is trained by SGD on all of ImageNet: semantics.probe_solver=sgd streams every "
       "stored training row (max_images at least the dataset's size); the default fits L-BFGS on max_images"),
    _i("001", "Self-attentions in CL and MLPs in MIM are important", "accuracy when heads or MLPs are removed",
       "head_ablation", "model:ablate={mlp:all}", "MLP blocks are ablated as a model variant (ablate: mlp), "
       "heads by head_ablation or ablate: heads"),
    _i("001", "MAE: the decoder takes the low frequencies", "Fourier analysis of encoder and decoder blocks",
       "fourier", "model:decoder=true", "the decoder runs on all tokens, none masked"),
    _i("001", "CL and MIM are complementary", "a hybrid (1 - lambda) L_MIM + lambda L_CL: accuracy, attention, "
       "Fourier", "attention_distance fourier", "", "the hybrid model is the zoo's `hybrid` objective (vitscope "
       "zoo); the published hybrid's accuracies are the authors' training results"),
    # -- 002: Merlin et al. 2023 --------------------------------------------------------------------------
    _i("002", "Fig. 1", "learning, forgetting and cka divergence per layer, classification vs reconstruction "
       "fine-tuning (CIFAR-10)", "stir"),
    _i("002", "Fig. 2", "learning and forgetting per layer from different pretraining data", "stir"),
    _i("002", "Fig. 3", "cka divergence per layer from different pretraining data", "stir cka"),
    _i("002", "Fig. 4", "Invariance Flow Matrix, classification and reconstruction (CIFAR-10)", "stir"),
    _i("002", "Fig. 5", "learning and forgetting per fine-tuning epoch", "stir",
       "", "a `checkpoints:` list of the fine-tuning epochs"),
    _i("002", "Fig. 6", "mean CIFAR-10-C accuracy against the spread of forgetting over layers 2-12",
       "stir corruptions", "", "the correlation's target is accuracy under corruptions vitscope generates on "
       "the STIR images; the paper's pre-corrupted CIFAR-10-C/100-C sets are not read yet"),
    _i("002", "Table 1", "accuracy of the pretrained and fine-tuned models", "logit_lens",
       "logit_lens.readout=head", "the last block's row is the model's own accuracy"),
    _i("002", "Fig. 7", "as Fig. 1, CIFAR-100", "stir"),
    _i("002", "Fig. 8", "as Fig. 1, EuroSAT", "stir", "", "EuroSAT as an imagefolder dataset"),
    _i("002", "Fig. 9", "as Fig. 1, Oxford-IIIT Pet", "stir", "", "Oxford-IIIT Pet as an imagefolder dataset"),
    _i("002", "Fig. 10", "Invariance Flow Matrix, CIFAR-100", "stir"),
    _i("002", "Fig. 11", "learning and forgetting per epoch, CIFAR-100", "stir",
       "", "a `checkpoints:` list of the fine-tuning epochs"),
    _i("002", "Fig. 12", "cka divergence per epoch", "cka stir", "", "a `checkpoints:` list"),
    _i("002", "Fig. 13", "test accuracy per epoch at each corruption level", "corruptions", "",
       "a `checkpoints:` list"),
    _i("002", "Fig. 14", "the correlation computed up to each epoch", "", "",
       "not yet: the per-epoch correlation series and the hypothesis search (App. E.1) are not analyses yet"),
    _i("002", "Fig. 15", "as Fig. 6, two optimizers", "stir corruptions", "", "as Fig. 6"),
    # -- 003: Walmer et al. 2023 --------------------------------------------------------------------------
    _i("003", "Fig. 1", "overview: attention maps, CKA, clustering, downstream tasks",
       "cls_attention_maps cka semantics propagation", "", "its panels are Figs. 2, 6, 8 and 10"),
    _i("003", "Fig. 2", "average CLS attention maps over 5,000 images per layer and head", "cls_attention_maps"),
    _i("003", "Fig. 3", "Aligned Aggregated Attention Maps; strict, soft, axial and offset local heads",
       "aligned_attention_maps"),
    _i("003", "Fig. 4", "average attention distance per head and layer", "attention_distance"),
    _i("003", "Fig. 5", "IoU of CLS and mean spatial attention with the salient foreground", "saliency_iou",
       "saliency_iou.queries=cls,mean saliency_iou.mass=0.6 saliency_iou.mask_rule=authors",
       "default mask rule: a token is foreground when the mask covers half of it; the authors' (bicubic "
       "resize, any value > 0) is mask_rule=authors"),
    _i("003", "Fig. 6", "CKA of the final layer between models, CLS and spatial tokens", "cka",
       "cka.taps=block-1.out cka.views=cls,all"),
    _i("003", "Fig. 7", "k-means purity, NMI, ARI with image labels (ImageNet-50), CLS and pooled spatial",
       "semantics", "semantics.kmeans=cls,gap_spatial"),
    _i("003", "Fig. 8", "k-means on object-level (COCO) and part-level (PartImageNet) spatial features",
       "semantics", "semantics.kmeans=object,part semantics.kmeans_k=80",
       "one mask-weighted token mean per annotated instance (COCO) or part annotation (PartImageNet)"),
    _i("003", "Fig. 9", "k-NN top-1 on ImageNet (CLS) and retrieval mAP on ROxford5k", "semantics retrieval",
       "semantics.ks=20 semantics.views=cls retrieval.views=cls"),
    _i("003", "Fig. 10", "DAVIS propagation J&F and SPair-71k PCK per layer", "propagation correspondence",
       "dataset:tiling=true correspondence.matching=pixel",
       "dense tiling is a dataset option; SPair's authors' variant: pixel-level matching, letterboxed input "
       "(dataset:letterbox=true), 20 pairs per category (dataset:pairs_per_category=20)"),
    _i("003", "Table 1", "best value and layer per model and task, with a random baseline",
       "propagation correspondence retrieval semantics",
       "propagation.random_baseline=true correspondence.random_baseline=true retrieval.random_baseline=true",
       "results/summary/best_layers.parquet and the report's best-layer table, k-NN beside the dense tasks; "
       "the 'random' row: Gaussian features through the same propagation, matching and retrieval"),
    _i("003", "Table 2", "the 20 ViT variants", "", "", "models, not a measurement: the registry lists them "
       "(vitscope models)"),
    _i("003", "Table 3", "summary of the observations", "", "", "text; the report's summary states each "
       "finding with its uncertainty"),
    _i("003", "Table 4", "dense vs normal feature extraction on DAVIS", "propagation", "dataset:tiling=true",
       "two dataset entries, tiling true and false"),
    _i("003", "Fig. 11", "every CLS attention map of every head and layer for single images",
       "cls_attention_maps", "cls_attention_maps.keep_images=4"),
    _i("003", "Fig. 12", "as Fig. 11, another image", "cls_attention_maps"),
    _i("003", "Fig. 13", "CLS maps of the last layer's first head for many models", "cls_attention_maps"),
    _i("003", "Fig. 14", "offset local heads in every model", "aligned_attention_maps"),
    _i("003", "Fig. 15", "attention distance of every variant against normalised depth", "attention_distance"),
    _i("003", "Fig. 16", "saliency IoU of every variant on COCO and PartImageNet", "saliency_iou"),
    _i("003", "Fig. 17", "average CLS attention of every head of every variant", "cls_attention_maps"),
    _i("003", "Fig. 18", "AAAM of every head of every variant", "aligned_attention_maps"),
    _i("003", "Fig. 19", "final-layer CKA between variants, CLS and spatial", "cka",
       "cka.taps=block-1.out cka.views=cls,all"),
    _i("003", "Fig. 20", "CKA across the layers of the B/16 models", "cka", "cka.taps=block*.out"),
    _i("003", "Fig. 21", "CKA across MAE Base, Large and Huge", "cka"),
    _i("003", "Fig. 22", "CKA across BEiT Base and Large", "cka"),
    _i("003", "Fig. 23", "residual connection: skip path vs branch output CKA", "residual_cka"),
    _i("003", "Fig. 24", "image-level clustering of CLS features, every variant", "semantics",
       "semantics.kmeans=cls"),
    _i("003", "Fig. 25", "image-level clustering of pooled spatial features", "semantics",
       "semantics.kmeans=gap_spatial"),
    _i("003", "Fig. 26", "object-level clustering on COCO", "semantics",
       "semantics.kmeans=object semantics.kmeans_k=80"),
    _i("003", "Fig. 27", "part-level clustering on PartImageNet", "semantics", "semantics.kmeans=part"),
    _i("003", "Table 5", "best value and layer per task, every variant",
       "propagation correspondence retrieval semantics", "", "as Table 1"),
    _i("003", "Fig. 28", "k-NN on ImageNet, every variant", "semantics", "semantics.ks=20"),
    _i("003", "Fig. 29", "ROxford5k and RParis6k retrieval, every variant", "retrieval"),
    _i("003", "Fig. 30", "DAVIS propagation, every variant", "propagation"),
    _i("003", "Fig. 31", "SPair-71k correspondence, every variant", "correspondence"),
    _i("003", "Table 6", "linear probe accuracy on ImageNet-1k val, with and without BatchNorm", "semantics",
       "semantics.probe_solver=sgd semantics.standardize=false",
       "the 'no BN' rows fit on unstandardised features (standardize=false); the paper's probe trains on all of "
       "ImageNet by SGD: probe_solver=sgd streams every stored training row from disk, with max_images at least "
       "the dataset's size (the default L-BFGS fits the first max_images = 5,000 in memory)"),
    # -- 004: Wang 2023 -----------------------------------------------------------------------------------
    _i("004", "Fig. 1", "SimCLR", "", "", _NOT_ANALYSIS),
    _i("004", "Fig. 2", "MoCo", "", "", _NOT_ANALYSIS),
    _i("004", "Fig. 3", "SimMIM", "", "", _NOT_ANALYSIS),
    _i("004", "Fig. 4", "MAE architecture", "", "", _NOT_ANALYSIS),
    _i("004", "Fig. 5", "CL vs MM: linear probing, scalability, detection with Mask R-CNN on COCO", "", "",
       "detection and segmentation fine-tuning cannot run here: they train a detector per model"),
    _i("004", "Fig. 6", "low and high frequencies of a photograph", "", "", _NOT_ANALYSIS),
    _i("004", "Fig. 8", "linear probing accuracy of intermediate layers", "semantics",
       "semantics.probe=cls,gap_spatial"),
    _i("004", "Fig. 9", "self-attention maps of chosen queries, MoCo v3 vs SimMIM", "query_attention_maps"),
    _i("004", "Fig. 10", "receptive fields (attention distance) of CL vs MM", "attention_distance"),
    _i("004", "Fig. 11", "attention collapse by NMI", "attention_nmi"),
    _i("004", "Fig. 12", "cosine similarity of heads, depths and tokens", "diversity"),
    _i("004", "Fig. 13", "CL moves all tokens in unison, MM transforms tokens individually", "block_updates"),
)


def markdown() -> list[str]:
    """The table of docs/analyses.md: one row per item, grouped by source document."""
    lines = ["| source | item | what it shows | analysis | the authors' settings | note |",
             "|---|---|---|---|---|---|"]
    for it in ITEMS:
        how = ", ".join(f"`{a}`" for a in it.analyses) or "none"
        params = " ".join(f"`{p}`" for p in it.params)
        lines.append(f"| {it.seed} | {it.item} | {it.shows} | {how} | {params} | {it.note} |")
    return lines
