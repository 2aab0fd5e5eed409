"""Representation similarity beyond CKA: functions of two feature matrices of the same n examples, (n, d) and
(n, d'), computed in float64. No I/O.

Linear family, all from one SVD per matrix (columns centred, the matrix scaled to unit Frobenius norm:
``X = U diag(s) Vᵀ``) and the cross product ``M = U_xᵀ U_y``:

* ``procrustes``   orthogonal Procrustes distance ``min_Q |X - Y Q|_F = sqrt(2 - 2 |XᵀY|_*)`` in [0, sqrt 2]
                   (Williams et al. 2021; the narrower matrix zero-padded).
* ``angular_shape`` the angular shape metric with partial whitening ``alpha`` (Williams et al. 2021; netrep's
                   ``LinearMetric``): each matrix whitened by ``alpha I + (1 - alpha) (XᵀX)^(-1/2)`` (eigenvalues
                   clipped at 1e-7), then ``arccos(|X_wᵀ Y_w|_* / (|X_w|_F |Y_w|_F))`` in [0, pi/2]. alpha = 0: CCA
                   (invariant to invertible linear maps); alpha = 1: Procrustes. Unlike netrep, inputs are scaled
                   to unit norm first, so intermediate alphas are invariant to isotropic scaling too.
* ``cca``          canonical correlations = singular values of M (numerical rank kept); ``mean_cca`` their mean.
* ``svcca``        Raghu et al. 2017: each matrix reduced to its leading singular directions holding ``keep``
                   (0.99) of its variance, then mean CCA (the truncation reads the variance spectrum: invariant
                   to rotations and scaling, not to every invertible linear map).
* ``pwcca``        Morcos et al. 2018: canonical correlations weighted by how much of X each canonical variate
                   h_i accounts for, ``sum_j |<h_i, x_j>|`` over X's neurons x_j (asymmetric: weights from X; it
                   depends on X's neuron basis, so it is invariant to scaling and to permuting or flipping neurons,
                   not to rotations).
* ``ridge_r2``     how well X predicts Y by ridge regression (penalty ``ridge`` relative to X's total variance,
                   which is 1 after scaling), scored by leave-one-out R² over all of Y's columns: the closed form
                   residuals ``(I - H) Y / (1 - h_ii)`` of the hat matrix ``H = X (XᵀX + λ I)⁻¹ Xᵀ`` on the
                   centred matrices (the centring uses every example).
* ``subspace_similarity`` Ramasesh et al. 2021 ("Anatomy of catastrophic forgetting"): the overlap of the top-k
                   principal subspaces, ``|A_kᵀ B_k|_F² / k`` in [0, 1] (the mean squared cosine of the k
                   principal angles): 1 for the same subspace, 0 for orthogonal ones. ``subspace_space``
                   (`SUBSPACE_SPACES`, `subspace_space_of`): 'features', Ramasesh et al.'s, the top-k eigenvectors
                   of the centred feature covariance (right singular vectors), meaningful only where the two
                   matrices share their feature coordinates (the same layer of one network before and after
                   training; equal widths required); 'images', the left singular vectors, the principal
                   components' scores over the n examples, so layers of different widths compare and the value
                   is invariant to rotations and isotropic scaling of either matrix (k / (n - 1) in expectation for
                   unrelated features); 'auto' (the default) features at equal widths, images otherwise. k =
                   ``subspace_k`` (10), fewer where a matrix's rank is lower (then the larger of the two counts
                   divides). Opt-in: computed only when named (`OPT_IN`; `DEFAULT_MEASURES` are the others).

Image x image family:

* ``rsa``          representational similarity analysis (Kriegeskorte et al. 2008): correlation-distance RDMs
                   ``1 - pearson(x_i, x_j)`` over the pairs i < j, compared by Spearman's rho and Kendall's tau_a.
* ``mutual_knn``   Huh et al. 2024: rows L2-normalised, each example's k nearest neighbours by cosine (itself
                   excluded) in X and in Y; the mean over examples of |N_X(i) ∩ N_Y(i)| / k. 1 for identical
                   neighbourhoods, about k / (n - 1) for independent ones.
* ``cknna``        Huh et al. 2024: unbiased HSIC of the cosine kernels K, L restricted to mutual neighbours
                   (``mask = knn_K ∩ knn_L``), normalised by the same quantity of K with itself and L with itself.

`prepare` computes the per-matrix part once (SVD, neighbours, RDM) and `compare` the pair part, so a grid of
layers costs one SVD per layer; `Prepared.permuted` reorders the examples of a prepared matrix without
recomputing it (permutation nulls). The pairwise functions below are `compare(prepare(x), prepare(y))`.

Modules: `prepared` (`Prepared`, `prepare`, the neighbour search, the decompositions), `comparison` (`compare`,
`compare_grid`, the per-measure math, the pairwise functions), `jackknife` (`jackknife_replicates`,
`jackknife_interval`, the long neighbour lists). The names of the former single module are re-exported here.
"""

from vitscope.metrics.similarity.comparison import (  # noqa: F401 - re-exported
    ASYMMETRIC,
    GRID_COLUMNS,
    RANGES,
    SIDE_TOL,
    _angular,
    _chunks,
    _cknna,
    _cross_products,
    _linear,
    _nonlinear,
    _ordered,
    _other_side,
    _pair,
    _pearson,
    _pwcca,
    _ridge_grid,
    _split,
    _subspace,
    angular_shape_metric,
    cca_correlations,
    cknna,
    compare,
    compare_grid,
    kendall_tau_a,
    mean_cca,
    mutual_knn,
    procrustes_distance,
    pwcca,
    range_of,
    ridge_r2,
    rsa,
    subspace_similarity,
    svcca,
)
from vitscope.metrics.similarity.jackknife import (  # noqa: F401 - re-exported
    _lists_without,
    _long_lists,
    jackknife_interval,
    jackknife_replicates,
)
from vitscope.metrics.similarity.prepared import (  # noqa: F401 - re-exported
    CANDIDATES,
    DEFAULT_MEASURES,
    EIGVAL_TOL,
    F32_ERROR,
    LINEAR_MEASURES,
    MEASURES,
    OPT_IN,
    RANK_TOL,
    ROWS_AT_ONCE,
    SUBSPACE_K,
    SUBSPACE_SPACES,
    FeatureError,
    Prepared,
    _check_k,
    _check_measures,
    _cosines,
    _matrix,
    _neighbour_lists,
    _svals,
    _thin_svd,
    _top_k,
    _triangle_positions,
    correlation_rdm,
    prepare,
    subspace_space_of,
)

__all__ = [
    "DEFAULT_MEASURES",
    "LINEAR_MEASURES",
    "MEASURES",
    "Prepared",
    "angular_shape_metric",
    "cca_correlations",
    "RANGES",
    "cknna",
    "compare",
    "compare_grid",
    "jackknife_interval",
    "jackknife_replicates",
    "kendall_tau_a",
    "mean_cca",
    "mutual_knn",
    "prepare",
    "procrustes_distance",
    "range_of",
    "pwcca",
    "rsa",
    "ridge_r2",
    "subspace_similarity",
    "subspace_space_of",
    "svcca",
]
