"""Report: figures (one function per analysis in `figures`) and the self-contained HTML page."""

from vitscope.report.html import write_report

__all__ = ["write_report"]
