"""Pure metrics on ViT attention tensors.

Conventions shared by every function in this module:

* ``attn`` is a floating-point tensor of shape ``(B, H, T, T)`` holding softmax probabilities: row ``q``
  (a query) is a distribution over the keys ``k`` and sums to 1.
* The token sequence is ``num_prefix_tokens`` prefix tokens (the CLS token first where the model has one,
  then its registers if any; 0 when the model has neither) followed by ``h * w`` spatial patch tokens in
  row-major order, so spatial token ``s`` sits at row ``s // w`` and column ``s % w`` of the patch grid
  ``grid_size = (h, w)``. A prefix token is not by itself a CLS token: a model can have registers and no CLS
  token (``num_prefix_tokens >= 1``, ``ViTModel.has_cls_token`` false). ``num_prefix_tokens`` cannot tell the
  two apart, so a function that reads token 0 as the CLS token (`cls_attention_maps`, ``query="cls"``) is
  called only for a model with a CLS token; the caller checks ``has_cls_token``.
* "Spatial attention" means a spatial query's row restricted to the spatial keys (prefix keys dropped) and
  renormalised to sum to 1. A row whose spatial mass is zero stays zero (the renormalisation divides by
  ``max(row_sum, EPS)``).
* Element-wise work happens in the input dtype (float32 or float64); sums that feed a metric are
  accumulated in float64. Metric tensors are returned in the input dtype unless stated otherwise.

Nothing here loops over queries or images; everything is vectorised with broadcasting, ``scatter_add`` and
index arithmetic.
"""

from vitscope.metrics.attention.distance import (  # noqa: F401 - every name of the module before the split
    attention_distance,
    attention_nmi,
    distance_in_pixels,
    distance_of_spatial,
)
from vitscope.metrics.attention.heads import (  # noqa: F401 - every name of the module before the split
    _DIRECTIONS,
    HeadTypeThresholds,
    _direction_name,
    head_types,
)
from vitscope.metrics.attention.maps import (  # noqa: F401 - every name of the module before the split
    _ANISO_EPS,
    _canvas_geometry,
    _canvas_index,
    _triangle_entropy,
    aam_statistics,
    aligned_maps,
    canvas_of_spatial,
    uniform_mass_3x3,
)
from vitscope.metrics.attention.saliency import (  # noqa: F401 - every name of the module before the split
    MASK_RULES,
    _masks_to_grid,
    _saliency_weights,
    _uniform_top_mass,
    foreground_tokens,
    saliency_iou,
    saliency_iou_merged,
    top_mass_mask,
    uniform_saliency_iou,
)
from vitscope.metrics.attention.spatial import (  # noqa: F401 - every name of the module before the split
    EPS,
    _check_attn,
    _check_grid,
    _check_prefix,
    _grid_positions,
    _renormalise,
    cls_attention_maps,
    spatial_attention,
)

__all__ = [
    "EPS",
    "HeadTypeThresholds",
    "aam_statistics",
    "aligned_maps",
    "attention_distance",
    "attention_nmi",
    "cls_attention_maps",
    "distance_in_pixels",
    "head_types",
    "saliency_iou",
    "saliency_iou_merged",
    "spatial_attention",
    "top_mass_mask",
    "uniform_saliency_iou",
]
