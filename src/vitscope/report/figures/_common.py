"""Shared plotting helpers: every figure module returns a list of (title, matplotlib Figure)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Figures = list[tuple[str, plt.Figure]]
