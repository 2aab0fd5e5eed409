"""Data: the sample and batch types, transforms, built-in generated sets, and real-format loaders.

Generated (no download): `SyntheticShapes` (classification with masks, parts, keypoints; variants
'random', 'texture-bound', 'cue-conflict'), and in `vitscope.data.synthetic_tasks` videos, pairs and an
instance-retrieval split. Real formats: `vitscope.data.loaders`. Dense tiling: `vitscope.data.tiling`.
"""

from vitscope.data.base import Batch, Sample
from vitscope.data.synthetic import VARIANT_NAMES, SyntheticShapes
from vitscope.data.synthetic_tasks import SyntheticPairs, SyntheticRetrieval, SyntheticVideos

__all__ = ["DATASETS", "Batch", "Sample", "SyntheticPairs", "SyntheticRetrieval", "SyntheticShapes",
           "SyntheticVideos", "make_dataset"]

DATASETS = {name: variant for variant, name in VARIANT_NAMES.items()}


def make_dataset(cfg):  # noqa: ANN001, ANN201 - DatasetConfig -> Dataset
    """The dataset a study's `DatasetConfig` describes; its ``name`` is a format of `vitscope.data.catalog`
    (`vitscope datasets` lists them)."""
    from vitscope.data.catalog import build_dataset

    return build_dataset(cfg)
