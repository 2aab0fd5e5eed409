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
    """The dataset a study config names: 'synthetic-shapes', 'synthetic-shapes-textured' (each class wears
    its own texture) or 'synthetic-cue-conflict' (shape of one class, texture of another)."""
    from vitscope.errors import ConfigError

    if cfg.name in DATASETS:
        return SyntheticShapes(n=cfg.n_images, seed=cfg.seed, size=cfg.size, variant=DATASETS[cfg.name])
    if cfg.name == "imagefolder":
        from vitscope.data.loaders import ImageFolder

        if not getattr(cfg, "root", None):
            raise ConfigError("dataset.root: the imagefolder dataset needs the folder of class folders")
        return ImageFolder(cfg.root, classes=getattr(cfg, "classes", None), per_class=getattr(cfg, "per_class", None),
                           test_root=getattr(cfg, "test_root", None))
    raise ConfigError(f"unknown dataset {cfg.name!r}; available: {', '.join([*DATASETS, 'imagefolder'])}")
