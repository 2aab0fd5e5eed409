"""Pure functions on arrays and tensors: no I/O, no models.

`vs.metrics.attention` works on attention tensors (B, H, T, T); `vs.metrics.cka` on features. The submodules are
imported on first use, so that a light one (``intervals``, ``similarity``) does not bring torch with it.
"""

from vitscope._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {}, submodules=("attention", "cka", "dense", "geometry", "semantics",
                                                              "similarity"))

__all__ = ["attention", "cka", "dense", "geometry", "semantics", "similarity"]
