"""Attention analyses, streamed over the ``block{i}.attn`` taps (math in `vitscope.metrics.attention`).

Sources (full references in `vitscope.references`): Walmer et al. 2023 ("Teaching Matters", CVPR) and Park et
al. 2023 ("What do self-supervised ViTs learn?", ICLR).

Every analysis here keeps state whose size depends on the model only (sums over images, a count, and at
most ``keep_images`` per-image maps), so memory does not grow with the dataset, and merging two parts
adds their sums: a merge of two shards equals one pass over all their images (up to float64 rounding).
The sums (and the few kept maps) live on the features' device and ``update`` never waits for it: no value
reaches the host and no Python branch depends on one (tests/test_host_syncs.py counts); ``state_dict``
copies the state to the CPU, and a loaded or merged state moves to the device at its next batch.

Speed (all layers of ViT-S/16 at batch 32 must cost well under a third of the forward pass; see
benchmarks/attention.py): nothing of the size of the attention is formed beyond one temporary. The
renormalised spatial attention stays implicit (a view and per-row inverse masses, `_Spatial`); metrics
that are linear in it (AAAM, distance) are evaluated on its sum over the batch's images, with the
arithmetic of the `vitscope.metrics.attention` functions; NMI is rearranged to a single ``R log R`` pass;
the IoU of every layer, query and merged head runs as one call per batch; and the analyses of one pass
share row sums, image sums and query means of the same captured tensor (`_SHARED`).
tests/test_analyses_attention.py checks each analysis against slow loops, and the hot path against the
metric functions.

=========================  ===================================================================================
analysis                   metrics (extra columns)
=========================  ===================================================================================
``attention_distance``     ``distance``, ``distance_px`` per (layer, head) (``stderr``, ``value_lo``, ``value_hi``,
                           ``n_images``)
``attention_nmi``          ``nmi`` per (layer, head) (``stderr``, ``value_lo``, ``value_hi``, ``n_images``)
``cls_attention_maps``     ``cls_attention`` per (layer, head, grid cell) (``row``, ``col``, ``image``,
                           ``n_images``); ``image`` is missing for the average, the dataset index otherwise
``aligned_attention_maps`` ``aaam`` per (layer, head, canvas cell) (``dy``, ``dx``); ``aam_statistic`` per
                           (layer, head) (``statistic``); ``head_type`` per (layer, head) (``type``,
                           ``direction``, ``offset``, ``statistic``, ``statistic_value``, ``distance``);
                           ``head_type_count`` per type (``type``) -- all with ``n_images``
``saliency_iou``           ``iou`` per (layer, head), ``iou_best_head`` and ``iou_merged`` per layer
                           (``query``, ``stderr``, ``value_lo``, ``value_hi``, ``n_images``, ``n_skipped``)
``query_attention_maps``   ``query_attention`` per (image, query, layer, head, grid cell) and
                           ``query_attention_mean`` (mean over heads, ``head`` missing) (``query``, ``query_row``,
                           ``query_col``, ``row``, ``col``, ``image``, ``n_images``), for ``keep_images`` images
``attention_explorer``     ``attention`` and ``rollout`` per (image, layer), ``pool_attention`` per image: every
                           query's row, 8-bit codes and float32 scales as bytes (``codes``, ``scales``, ``heads``,
                           ``tokens``, ``grid_rows``, ``grid_cols``, ``prefix_tokens``, ``cls_token``), for
                           ``keep_images`` images (the report's attention explorer)
=========================  ===================================================================================

Means over images carry their spread: ``stderr`` is the standard error of the mean over images (sample
standard deviation over sqrt(n), from a streamed sum of squares) and ``value_lo`` / ``value_hi`` the 95 %
interval ``value ± 1.96 stderr``.
"""

# The submodules register their analyses on import, in the order of these lines (the registry's and the
# catalog's order, as before the split): keep it.
# isort: off
from vitscope.analyses.attention._common import HEAD_TYPES, stderr_from_sums
from vitscope.analyses.attention._common import (  # noqa: F401 - kept importable from here, as before
    _DISTANCES,
    _SHARED,
    Z95,
    _canvas_and_distance,
    _distance_matrix,
    _LayerAttention,
    _nmi,
    _PerHeadMean,
    _saliency_iou_of,
    _shared_results,
    _Spatial,
)
from vitscope.analyses.attention.head_means import AttentionDistance, AttentionNMI
from vitscope.analyses.attention.maps import AlignedAttentionMaps, CLSAttentionMaps
from vitscope.analyses.attention.maps import _cell_columns, _png_bytes  # noqa: F401 - kept importable from here, as before
from vitscope.analyses.attention.saliency import SaliencyIoU
from vitscope.analyses.attention.query_maps import QueryAttentionMaps
from vitscope.analyses.attention.explorer import AttentionExplorer
# isort: on

__all__ = [
    "HEAD_TYPES",
    "AlignedAttentionMaps",
    "AttentionDistance",
    "AttentionExplorer",
    "AttentionNMI",
    "CLSAttentionMaps",
    "QueryAttentionMaps",
    "SaliencyIoU",
    "stderr_from_sums",
]
