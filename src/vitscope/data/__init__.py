"""Data: the batch type, preprocessing, and built-in datasets."""

from vitscope.data.base import Batch
from vitscope.data.synthetic import SyntheticShapes

__all__ = ["Batch", "SyntheticShapes", "make_dataset"]


def make_dataset(cfg):  # noqa: ANN001, ANN201 - DatasetConfig -> Dataset
    """The dataset a study config names."""
    from vitscope.errors import ConfigError

    if cfg.name == "synthetic-shapes":
        return SyntheticShapes(n=cfg.n_images, seed=cfg.seed, size=cfg.size)
    raise ConfigError(f"unknown dataset {cfg.name!r}; available: synthetic-shapes")
