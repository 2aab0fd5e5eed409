"""Pure functions on arrays and tensors: no I/O, no models.

`vs.metrics.attention` works on attention tensors (B, H, T, T); `vs.metrics.cka` on features.
"""

from vitscope.metrics import attention, cka, dense, geometry, semantics, similarity

__all__ = ["attention", "cka", "dense", "geometry", "semantics", "similarity"]
