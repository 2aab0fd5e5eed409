"""vitscope: how Vision Transformers see, whatever taught them.

    import vitscope as vs
    m = vs.load_model("dino-b16")                      # registry name, timm name, or a local file
    feats = vs.extract(m, images, taps=["block3.out", "block3.attn"])
    vs.cka(X, Y)                                       # minibatch CKA, unbiased HSIC_1
    vs.metrics.attention.attention_distance(attn, m.grid_size, m.num_prefix_tokens)
    fig = vs.plot("vitscope-runs/default", "attention_distance")   # a report figure from a run, to restyle

Every name below is imported on first use (PEP 562), so ``import vitscope`` (and the command line's listings)
loads neither torch nor timm nor matplotlib until something needs them.
"""

import vitscope.threads  # noqa: F401 - first: sets OMP_WAIT_POLICY before torch starts its OpenMP runtime
from vitscope._lazy import lazy_exports
from vitscope.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    UnknownModelError,
    UnknownTapError,
    VitscopeError,
    WeightsUnavailableError,
)

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(__name__, {
    "Capture": "vitscope.capture.engine", "extract": "vitscope.capture.engine", "stream": "vitscope.capture.engine",
    "cka": "vitscope.metrics.cka",
    "REGISTRY": "vitscope.models.registry", "ModelSpec": "vitscope.models.registry",
    "ViTModel": "vitscope.models.adapter", "load_model": "vitscope.models.load",
    "save_checkpoint": "vitscope.models.load",
    "plot": "vitscope.report.plot",
}, submodules=("metrics",))

__all__ = [
    "REGISTRY", "Capture", "CheckpointError", "ConfigError", "InputError", "ModelSpec", "UnknownModelError",
    "UnknownTapError", "ViTModel", "VitscopeError", "WeightsUnavailableError", "__version__", "cka", "extract",
    "load_model", "metrics", "plot", "save_checkpoint", "stream",
]
