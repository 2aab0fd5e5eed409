"""Centered kernel alignment (CKA) between two sets of features of the same examples.

Three estimators are provided:

* ``"minibatch"`` -- minibatch linear CKA with the unbiased HSIC_1 estimator (Song et al. 2012; Nguyen,
  Raghu & Kornblith 2021, "Do wide and deep networks learn the same things?"). For minibatches
  ``b = 1..B`` with linear Grams ``K_b = X_b X_bᵀ`` and ``L_b = Y_b Y_bᵀ``::

      CKA = mean_b HSIC_1(K_b, L_b) / sqrt(mean_b HSIC_1(K_b, K_b) * mean_b HSIC_1(L_b, L_b))

  and, with ``K̃``, ``L̃`` the Grams with their diagonal set to zero (no centring)::

      HSIC_1(K, L) = [tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1) / ((n-1)(n-2)) - 2/(n-2) 1ᵀK̃L̃1] / (n(n-3))

  which needs ``n >= 4`` examples per minibatch. Batches are averaged with equal weight per batch by
  default (see :func:`minibatch_cka`).
* ``"full"`` (alias ``"linear"``) -- biased full-batch linear CKA (Kornblith et al. 2019).
* ``"rbf"`` -- biased full-batch RBF-kernel CKA with a median-distance bandwidth (Kornblith et al. 2019).

Features may be ``(N, D)`` or ``(N, T, D)``; a token axis is flattened into ``T * D`` features.
All functions are pure (no I/O); every accumulation is done in float64.

Modules, one per concept: `common` (input handling, shared constants), `hsic` (Grams, HSIC_1), `from_grams`
(CKA matrices from Grams, their standard error), `features` (CKA of two feature matrices, cosine similarity).
The names of the former single module are re-exported here.
"""

from vitscope.metrics.cka.common import (  # noqa: F401 - re-exported
    ESTIMATORS,
    FEW_CKA_EXAMPLES,
    MIN_HSIC1_EXAMPLES,
    ArrayLike,
    _as_float_tensor,
    _check_finite,
    _check_square,
    _flatten_features,
    _prepare_pair,
    _to_float64,
)
from vitscope.metrics.cka.features import (  # noqa: F401 - re-exported
    _centre_gram,
    _gram_rbf,
    _linear_cka,
    _median,
    _minibatch_cka,
    _rbf_cka,
    cka,
    cosine_similarity_matrix,
    linear_cka,
    minibatch_cka,
    rbf_cka,
)
from vitscope.metrics.cka.from_grams import (  # noqa: F401 - re-exported
    _batch_weights,
    _cka_over_groups,
    _cka_ratio,
    _hsic1_parts,
    _Parts,
    _weighted_hsic_sums,
    cka_from_gram_list,
    cka_from_gram_streams,
    cka_from_grams,
    cka_stderr_from_gram_streams,
)
from vitscope.metrics.cka.hsic import (  # noqa: F401 - re-exported
    _BUFFERS,
    _CHUNK_VALUES,
    CHUNKED_GRAM_MIN_FEATURES,
    _check_hsic1_size,
    _chunk_buffer,
    _combine_hsic1_terms,
    _zero_diagonal,
    gram_linear,
    gram_matrix,
    hsic1,
    hsic1_cross,
)

__all__ = [
    "ESTIMATORS",
    "FEW_CKA_EXAMPLES",
    "MIN_HSIC1_EXAMPLES",
    "cka",
    "cka_from_gram_list",
    "cka_from_gram_streams",
    "cka_from_grams",
    "cosine_similarity_matrix",
    "gram_linear",
    "gram_matrix",
    "hsic1",
    "hsic1_cross",
    "linear_cka",
    "minibatch_cka",
    "rbf_cka",
]
