"""Capture: tap names, token views, and the one-pass engine."""

from vitscope.capture.engine import Capture, dense_features, extract, stream
from vitscope.capture.taps import BLOCK_TAPS, GLOBAL_TAPS, expand_taps, tap_names
from vitscope.capture.views import VIEWS, token_view

__all__ = ["BLOCK_TAPS", "GLOBAL_TAPS", "VIEWS", "Capture", "dense_features", "expand_taps", "extract", "stream",
           "tap_names", "token_view"]
