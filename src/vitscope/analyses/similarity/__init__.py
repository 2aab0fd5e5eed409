"""Representation similarity: minibatch CKA from cached Gram matrices (math in `vitscope.metrics.cka`), and
measures beyond CKA (math in `vitscope.metrics.similarity`).

Per feature stream (a tap seen through a token view) only the n x n Gram of each minibatch of n images is
kept (n = 32: 4 KB per batch in float32), images grouped in arrival order and the groups' image ids recorded,
so two models fed the same images produce aligned Grams. Any pair of streams, within a model or across
models computed in separate runs, is then a batched reduction over batches (`cka_from_gram_streams`).

Analyses here, one module per concept:
  cka            every pair of the requested taps per token view, within the model; across models in `cross`
                 (with `cka_divergence` = 1 - CKA for the same tap in two models, Merlin et al. 2023 eq. 4)
                 (`cka`, on the Grams of `grams`)
  residual_cka   skip path (block input) vs branch outputs (attn_out, mlp_out), all block pairs (Walmer et al. 2023 D.4)
                 (`cka`)
  diversity      similarity between heads, between spatial tokens, and before/after attention, by minibatch
                 CKA and by cosine similarity (Park et al. 2023; Wang 2023) (`diversity`)
  similarity     measures beyond CKA (Procrustes, shape metric, CCA family, RSA, mutual k-NN, CKNNA, ridge
                 R²) on a seeded subset of images kept in float16, within and across models, with permutation
                 nulls and jackknife intervals (`vitscope.metrics.similarity`) (`measures`, its subset: `subset`)

The names of the former single module are re-exported here (`vitscope.analyses.similarity.CKA`, ...).
"""

# The import order is the registration order (cka, residual_cka, diversity, similarity): `cka` before
# `diversity` before `measures`, which isort's alphabetical order keeps.
from vitscope.analyses.similarity.cka import (  # noqa: F401 - re-exported
    CKA,
    ResidualCKA,
    _alignment,
    _GramAnalysis,
    _key,
    _with_interval,
)
from vitscope.analyses.similarity.diversity import Diversity, _depth_cka, _mean_offdiag_cka, _stderr  # noqa: F401
from vitscope.analyses.similarity.grams import (  # noqa: F401 - re-exported
    SHIFT_MIN_ENERGY,
    CkaBatch,
    GramGroups,
    _gram,
    _grouped_gram,
    _host_lists,
    _host_split,
    _needs_shift,
    _reference,
)
from vitscope.analyses.similarity.measures import (  # noqa: F401 - re-exported
    GRIDS,
    NULL_PAIRS,
    POOLED_VIEWS,
    WITHOUT_NULL,
    Groups,
    Permutations,
    Similarity,
    _is_distance,
    _matched,
)
from vitscope.analyses.similarity.subset import _MIX, _shr, _signed, subset_keys  # noqa: F401
