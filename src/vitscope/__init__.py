"""vitscope: how Vision Transformers see, whatever taught them.

    import vitscope as vs
    m = vs.load_model("dino-b16")                      # registry name, timm name, or a local file
    feats = vs.extract(m, images, taps=["block3.out", "block3.attn"])
    vs.cka(X, Y)                                       # minibatch CKA, unbiased HSIC_1
    vs.metrics.attention.attention_distance(attn, m.grid_size, m.num_prefix_tokens)
    vs.plot("vitscope-runs/default", "attention_distance")   # a report figure from a run, to restyle
"""

import vitscope.threads  # noqa: F401 - first: sets OMP_WAIT_POLICY before torch starts its OpenMP runtime
from vitscope import metrics
from vitscope.capture import Capture, extract, stream
from vitscope.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    UnknownModelError,
    UnknownTapError,
    VitscopeError,
    WeightsUnavailableError,
)
from vitscope.metrics.cka import cka
from vitscope.models import REGISTRY, ModelSpec, ViTModel, load_model, save_checkpoint

__version__ = "0.1.0"


def plot(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the signature is vitscope.report.plot's
    """The figures of one analysis from its results table (a run directory, a parquet file or a DataFrame):
    `vitscope.report.plot.plot`. Imported on first use, so ``import vitscope`` does not load matplotlib."""
    from vitscope.report.plot import plot as _plot

    return _plot(*args, **kwargs)

__all__ = [
    "REGISTRY", "Capture", "CheckpointError", "ConfigError", "InputError", "ModelSpec", "UnknownModelError",
    "UnknownTapError", "ViTModel", "VitscopeError", "WeightsUnavailableError", "__version__", "cka", "extract",
    "load_model", "metrics", "plot", "save_checkpoint", "stream",
]
