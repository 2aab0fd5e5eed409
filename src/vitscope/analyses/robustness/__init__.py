"""Robustness lenses per layer (math in `vitscope.metrics.robustness`, perturbations in
`vitscope.data.perturb`): shape vs texture bias, frequency-band noise, common corruptions.

Every number needs class decisions, from one of two *readouts* (column ``readout``):

- ``head``: the model's own classifier, when its label space covers the dataset's classes: an ImageNet-1k
  head on the 16 cue-conflict categories through the 16-class mapping of Geirhos et al. (ICLR 2019; the
  mean probability of each category's ImageNet classes), on a 1000-class ImageNet dataset directly; a zoo
  model's CIFAR-10 head on CIFAR-10. One decision per image (``layer`` empty).
- ``probe``: at every layer, a linear probe (`vitscope.metrics.semantics.linear_probe`, as the semantics
  analysis fits) on the pooled tokens (CLS, else the mean of the patch tokens) of clean images of the same
  classes: for ``shape_bias`` the ``train`` input (in the default study the generated `synthetic-silhouettes`,
  shape-only and texture-only images each labelled by its cue, so the probe learns every class from either cue;
  `vitscope.data.silhouettes`), for ``band_noise`` / ``corruptions`` the clean
  images of the dataset's own train split (``batch.is_test``), else of the stratified split of
  `vitscope.analyses.splits` (per class, every ``test_every``-th image in id order is a test image; decided
  in ``finalize``, so perturbed views keep every image's features until then), scored on its test split,
  clean and perturbed. The probe picks its weight decay by cross-validation on its training images, as
  semantics' does (``probe_tune``, ``probe_grid``, ``probe_folds``, ``probe_max_iter``); probe rows record
  ``n_train``, ``n_test``, ``probe_weight_decay`` and ``probe_iterations``, and a class without training
  images or with fewer than two test images warns, naming it.

A readout whose clean accuracy is within noise of chance (its 95 % Wilson interval reaches the majority-class
rate) decides nothing worth reading: its bias or robustness figures (``shape_bias``; ``drop``;
``relative_drop``, ``mca_relative_drop``) are left empty (NaN) and the column ``reason`` says why
(`chance_reason`); the clean accuracy rows carry ``chance``, ``value_lo`` and ``value_hi``.

``readout: auto`` computes both where possible (the head where it covers the data; probes where clean
training images exist), ``head`` / ``probe`` one of them; neither possible fails at configuration with one
sentence. Perturbations are views of the main dataset (`views()`), one forward pass each, shared by every
model and cached like the clean pass; the images are generated on the fly, deterministic per (image, view,
seed).
"""

# The submodules register their analyses on import, in the order of these lines (the registry's and the
# catalog's order, as before the split): keep it.
# isort: off
from vitscope.analyses.robustness._common import (
    HEAD_SPACES,
    PROBE_COLUMNS,
    READOUTS,
    Bands,
    Severity,
    chance_reason,
    check_head_classes,
    decision_rows,
    head_covers,
    head_label_space,
    head_scores,
    known_classes,
    shape_bias_interval,
)
from vitscope.analyses.robustness._common import (  # noqa: F401 - kept importable from here, as before
    _clean_columns,
    _parse_view,
    _reason_of,
    _Robustness,
    _with_reason,
)
from vitscope.analyses.robustness.shape_bias import ShapeBias
from vitscope.analyses.robustness.perturbed import BandNoise, Corruptions
from vitscope.analyses.robustness.perturbed import _band_of, _corruption_of, _ViewAccuracy  # noqa: F401 - kept importable from here, as before
# isort: on

__all__ = [
    "HEAD_SPACES",
    "PROBE_COLUMNS",
    "READOUTS",
    "BandNoise",
    "Bands",
    "Corruptions",
    "Severity",
    "ShapeBias",
    "chance_reason",
    "check_head_classes",
    "decision_rows",
    "head_covers",
    "head_label_space",
    "head_scores",
    "known_classes",
    "shape_bias_interval",
]
