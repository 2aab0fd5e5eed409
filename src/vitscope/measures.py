"""Which way each representation-similarity measure points, declared once: a **similarity** is larger for more
alike representations, a **distance** smaller. The findings' re-check under every measure (`vitscope.findings`)
and the report's colour scales (`vitscope.report.figures.similarity`) read it here. No imports beyond the
standard library: the command line's listings may use it.

Metric names as the tables write them: ``angular_shape_alpha=0.5`` is the measure ``angular_shape`` at one
partial whitening, ``ridge_r2_reverse`` the measure ``ridge_r2`` in the other direction of a pair.
"""

from __future__ import annotations

SIMILARITY, DISTANCE = "similarity", "distance"

#: every between-representation measure of vitscope's tables, by its base name (suffixes stripped, `base`)
DIRECTION: dict[str, str] = {
    "cka_minibatch": SIMILARITY,  # `cka`: minibatch linear CKA, in [0, 1]
    "cka_divergence": DISTANCE,  # `cka`: 1 - CKA of the same tap in two models (Merlin et al. 2023 eq. 4)
    "procrustes": DISTANCE,  # `similarity`: orthogonal Procrustes distance, in [0, sqrt 2]
    "angular_shape": DISTANCE,  # `similarity`: angular shape metric, in [0, pi / 2]
    "mean_cca": SIMILARITY,
    "svcca": SIMILARITY,
    "pwcca": SIMILARITY,
    "ridge_r2": SIMILARITY,  # leave-one-out R² of one representation predicting the other
    "rsa_spearman": SIMILARITY,
    "rsa_kendall": SIMILARITY,
    "mutual_knn": SIMILARITY,
    "cknna": SIMILARITY,
    # `similarity`, opt-in: Ramasesh et al. 2021's overlap of the top-k principal subspaces, in [0, 1]
    "subspace_similarity": SIMILARITY,
}

#: measures with two directions of a pair (X predicts / weights Y): a table's ``*_reverse`` rows hold the other
ASYMMETRIC = ("pwcca", "ridge_r2", "cknna")  # = vitscope.metrics.similarity.ASYMMETRIC (tested)


def base(metric: str) -> str:
    """The measure a metric name belongs to: ``angular_shape_alpha=0.5`` -> ``angular_shape``,
    ``ridge_r2_reverse`` -> ``ridge_r2``."""
    return metric.split("_alpha=")[0].removesuffix("_reverse")


def direction(metric: str) -> str | None:
    """SIMILARITY or DISTANCE for a measure of `DIRECTION` (any suffix), None for any other metric."""
    return DIRECTION.get(base(metric))


def is_distance(metric: str) -> bool:
    return direction(metric) == DISTANCE


def alike_sign(metric: str) -> int:
    """+1 when a larger value means more alike, -1 when a smaller one does (a distance); KeyError for a metric
    that is not a declared measure."""
    d = direction(metric)
    if d is None:
        raise KeyError(f"{metric!r} is not a similarity measure vitscope.measures declares")
    return -1 if d == DISTANCE else 1
