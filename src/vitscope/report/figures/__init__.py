"""Every figure vitscope draws: one module per analysis family, one function per figure.

Each module maps analysis names to functions taking that analysis's tidy table and returning a list
of (title, matplotlib Figure); `FIGURES` merges them for the report.
"""

from collections.abc import Callable

import pandas as pd

from vitscope.report.figures import (
    attention,
    dense,
    geometry,
    invariance,
    mechanistic,
    robustness,
    semantics,
    similarity,
)
from vitscope.report.figures._common import Figures

FIGURES: dict[str, Callable[[pd.DataFrame], Figures]] = {}
for _module in (attention, similarity, geometry, semantics, robustness, dense, invariance, mechanistic):
    FIGURES.update(_module.FIGURES)

__all__ = ["FIGURES", "Figures"]
