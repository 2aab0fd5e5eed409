"""A mechanistic lens: attention rollout (plain and gradient-weighted), the logit lens, high-norm artifact tokens
and head ablation (math in `vitscope.metrics.mechanistic`).

=========================  ===================================================================================
analysis                   metrics (extra columns)
=========================  ===================================================================================
``attention_rollout``      ``rollout_map`` per (layer, grid cell) (``row``, ``col``); ``iou_rollout``,
                           ``iou_cls_attention``, ``iou_gain`` per layer (``stderr``, ``value_lo``,
                           ``value_hi``, ``n``); all with ``n_images``, ``n_masked``
``gradient_rollout``       as ``attention_rollout`` (``head_fusion`` = ``gradient``)
``logit_lens``             ``top1_accuracy`` per layer (``value_lo``, ``value_hi``, ``n``, ``readout``);
                           ``kl_to_final``, ``agreement_with_final`` per layer (intervals, ``readout``)
``high_norm_tokens``       ``norm_quantile`` per (layer, quantile) (``quantile``, ``token_view``), all with ``rule``;
                           ``outliers_per_image``, ``images_with_outliers``, ``patch_variance``,
                           ``foreground_share``, ``cls_attention_absorbed`` per layer (``tokens``:
                           outliers / all, intervals); ``outlier_position`` per (layer, cell); ``knn_accuracy``
                           per layer (``tokens``: outliers / random_patch); ``norm_threshold`` per layer
                           (rule bimodal: ``separation``, ``upper_share``)
``head_ablation``          ``kl_from_clean``, ``prediction_flips``, ``accuracy_drop`` (or ``output_change``) per
                           (layer, head) or per layer (``heads`` = all) (``stderr``, ``value_lo``, ``value_hi``,
                           ``n``, ``mode``: zero / mean, ``heads``)
``block_updates``          ``attn_update``, ``mlp_update``, ``attn_share``, ``mlp_share``, ``displacement`` per
                           (layer, ``token_view``), ``unison_cosine``, ``unison_share`` per layer (spatial) (t
                           intervals); ``token_position`` per (image, layer, token) (``x_before`` ... ``y_after``)
``head_agreement``         a pair analysis (model A, ``model_b``): ``kendall_tau`` per ``k`` (``k_used``),
                           ``top1_f1``, ``top1_agreement`` of the two models' own heads (``stderr``, ``value_lo``,
                           ``value_hi``, ``n``); its state keeps a few numbers per image, merged by concatenation
=========================  ===================================================================================

Every state is sums and counts of a size fixed by the model (and, for the probe and the k-NN, at most
``max_images`` pooled rows), so parts merge by addition (shards, resume); head_ablation's mean and the bimodal
norm thresholds come from a statistics pass over the same images in every part (`Analysis.prepare`), and parts
merge only when theirs agree. Rollout, the high-norm tokens and the block updates are in the embedded default
study (``in_default_study``: cheap beside its pass); the others cost extra passes, a probe or a pair of models,
and a study names them.
"""

# The submodules register their analyses on import, in the order of these lines (the registry's and the
# catalog's order, as before the split): keep it.
# isort: off
from vitscope.analyses.mechanistic._common import _Means, _Mechanistic  # noqa: F401 - kept importable from here, as before
from vitscope.analyses.mechanistic.rollout import AttentionRollout, GradientRollout
from vitscope.analyses.mechanistic.logit_lens import LENS_READOUTS, LogitLens
from vitscope.analyses.mechanistic.high_norm import NORM_BINS, NORM_RULES, QUANTILES, HighNormTokens
from vitscope.analyses.mechanistic.high_norm import _quantiles, _random_token  # noqa: F401 - kept importable from here, as before
from vitscope.analyses.mechanistic.ablation import ABLATION_MODES, ABLATION_SETS, HeadAblation
from vitscope.analyses.mechanistic.block_updates import BlockUpdates
from vitscope.analyses.mechanistic.head_agreement import HeadAgreement
# isort: on

__all__ = [
    "ABLATION_MODES",
    "ABLATION_SETS",
    "LENS_READOUTS",
    "NORM_BINS",
    "NORM_RULES",
    "QUANTILES",
    "AttentionRollout",
    "BlockUpdates",
    "GradientRollout",
    "HeadAblation",
    "HeadAgreement",
    "HighNormTokens",
    "LogitLens",
]
