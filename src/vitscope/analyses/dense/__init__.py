"""Dense downstream tasks with no training, per layer (math in `vitscope.metrics.dense`), after Walmer et al.,
"Teaching Matters: Investigating the Role of Supervision in Vision Transformers", CVPR 2023 (§6, Tables 1
and 5): which layer of which model is best for local tasks.

  propagation     video object segmentation by label propagation (DINO's protocol): J, F, J&F
  correspondence  keypoint correspondence by nearest patch feature: PCK@0.1 / 0.05 / 0.01
  retrieval       instance retrieval by CLS / spatial-mean cosine: revisited mAP (Easy, Medium, Hard)

Every one reports, per model, its best layer (``metric = 'best_<headline>'``, ``layer`` = the block) beside
the task's chance level (``<metric>_chance``): propagation with constant features, a uniformly random target
token, a uniformly random ranking. The overall per-layer scores carry their ``stderr`` and 95 % interval
(``value_lo``, ``value_hi``), and so does the best-layer row, so a best layer within noise of chance can be told
apart (`vitscope.report.figures.dense.best_layer_summary`). The units of those intervals are the independent ones:
videos (objects of a video share its difficulty), image pairs (keypoints of a pair share it), queries; the
standard error is cluster-robust over them and the interval uses Student's t with (units - 1) degrees of freedom
(`vitscope.metrics.intervals`), because value ± 1.96 stderr over the objects of the default study's 2 videos, or
over the keypoints of its 32 pairs, covers 68-78 % (benchmarks/calibration.py, docs/CALIBRATION.md). The best-layer
row's interval is simultaneous over the layers it was chosen from (Bonferroni: level 1 - 0.05 / layers), so it
still holds for the layer that came out best. What each expects of the batches it is fed (the dataset formats in
`vitscope.data.synthetic_tasks` and `vitscope.data.formats` provide it):

  propagation     ``objects`` (B, H, W) label maps at the model input (0 background, 255 void), ``sequences``
                  and ``frames``; frames of a video consecutive, in order (a video is one unit).
  correspondence  flattened pairs: item 2p the source, 2p + 1 the target of pair p, ``extra['pair']`` and
                  ``extra['role']`` (0 source, 1 target), ``keypoints`` (B, K, 3) with row k the same
                  semantic keypoint in both images, ``boxes`` (the object's box) or ``extra['ref_size']``
                  (max(bbox h, w) in the model input's pixels), ``extra['category']`` (names) or ``labels``.
  retrieval       ``extra['db_index']`` (B,) database index (-1 for queries), ``extra['query_index']`` (B,)
                  (-1 for database images) and ``extra['gnd']`` (per query: 'easy', 'hard', 'junk'
                  database indices; None for database images).

Inputs that cannot be scored are counted, never dropped silently: rows ``metric = 'skipped'`` with the
``reason`` and the count (a video without an annotated first frame, a pair without a keypoint visible in
both images, a query without positives in a protocol, ...).

One module per task (`propagation`, `correspondence`, `retrieval`), their shared plumbing and intervals in
`_common`; the names of the former single module are re-exported here (`vitscope.analyses.dense.best_interval`, ...).
"""

# isort: off
# The import order is the registration order (propagation, correspondence, retrieval), which the analysis
# registry, `vitscope analyses` and the listing keep: not alphabetical, so isort must leave it.
from vitscope.analyses.dense.propagation import Propagation
from vitscope.analyses.dense.correspondence import (  # noqa: F401 - re-exported
    _CATEGORY_SUMS,
    _PAIR_SKIPS,
    Correspondence,
    _batch_column,
    _item_column,
)
from vitscope.analyses.dense.retrieval import RETRIEVAL_VIEWS, Retrieval  # noqa: F401 - re-exported
# isort: on
from vitscope.analyses.dense._common import _Dense, _interval, _nan, _plain_item, best_interval  # noqa: F401
from vitscope.metrics import dense as D  # noqa: F401 - re-exported: `analyses.dense.D` is the metrics module
from vitscope.metrics import intervals as I  # noqa: F401 - re-exported, as the former module had it

__all__ = ["Correspondence", "Propagation", "Retrieval"]
