"""Data: the sample and batch types, transforms, built-in generated sets, and real-format loaders.

Generated (no download): `SyntheticShapes` (classification with masks, parts, keypoints; variants
'random', 'texture-bound', 'cue-conflict'), `Silhouettes` (32-px shape-only, texture-only and cue-conflict
stimuli for shape vs texture bias), and in `vitscope.data.synthetic_tasks` videos, pairs and an
instance-retrieval split. Real formats: `vitscope.data.loaders`. Dense tiling: `vitscope.data.tiling`.
"""

from typing import Any

from vitscope._lazy import lazy_exports

_getattr, __dir__ = lazy_exports(__name__, {
    "Batch": "vitscope.data.base", "Sample": "vitscope.data.base", "SyntheticShapes": "vitscope.data.synthetic",
    "Silhouettes": "vitscope.data.silhouettes",
    **{n: "vitscope.data.synthetic_tasks" for n in ("SyntheticPairs", "SyntheticRetrieval", "SyntheticVideos")},
})

__all__ = ["DATASETS", "Batch", "Sample", "Silhouettes", "SyntheticPairs", "SyntheticRetrieval", "SyntheticShapes",
           "SyntheticVideos", "make_dataset"]


def __getattr__(name: str) -> Any:
    """The exports above on first use (torch comes with them); ``DATASETS``: generated set name -> variant."""
    if name == "DATASETS":
        from vitscope.data.synthetic import VARIANT_NAMES

        return {n: variant for variant, n in VARIANT_NAMES.items()}
    return _getattr(name)


def make_dataset(cfg):  # noqa: ANN001, ANN201 - DatasetConfig -> Dataset
    """The dataset a study's `DatasetConfig` describes; its ``name`` is a format of `vitscope.data.catalog`
    (`vitscope datasets` lists them)."""
    from vitscope.data.catalog import build_dataset

    return build_dataset(cfg)
