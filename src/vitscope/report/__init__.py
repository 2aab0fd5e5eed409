"""Report: figures (one function per analysis in `figures`), the self-contained HTML page, the figures as
files for a paper (`export`) and any figure from a table in a notebook (`plot`)."""

from vitscope.report.export import export
from vitscope.report.html import write_report
from vitscope.report.plot import plot

__all__ = ["export", "plot", "write_report"]
