"""Analyses: streaming accumulators, registered by name (`vitscope.analyses.ANALYSES`).

One module per family of questions: `attention` (how heads route information), `similarity` (CKA,
diversity), `geometry` (SVD volume, Fourier), `semantics` (k-NN, probes, k-means, agreement), `dense`
(mask propagation, keypoint correspondence, instance retrieval, per layer, no training),
`invariance` (STIR between two models: learning, forgetting, Invariance Flow of a fine-tuning),
`mechanistic` (attention rollout, logit lens, high-norm artifact tokens).
"""

from vitscope.analyses import (  # noqa: F401 - registers the analyses
    attention,
    dense,
    geometry,
    invariance,
    mechanistic,
    robustness,
    semantics,
    similarity,
)
from vitscope.analyses.base import ANALYSES, COLUMNS, Analysis, get_analysis, register_analysis

__all__ = ["ANALYSES", "COLUMNS", "Analysis", "get_analysis", "register_analysis"]
