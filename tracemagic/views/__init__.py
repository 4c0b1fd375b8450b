"""Views: plotly figures, the ipywidgets dashboard, the HTML report and the text summary.

They take a ``Trace`` (or the analyses' DataFrames) and never read trace files.

- ``tracemagic.views.figures``: DataFrame -> ``plotly.graph_objects.Figure``.
- ``Dashboard(trace)``: the inline dashboard (displays as widget + text fallback).
- ``write_report(trace, path)``: one self-contained HTML file.
- ``summary(trace)``: the terminal summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.views.dashboard import Dashboard
    from tracemagic.views.report import write_report
    from tracemagic.views.text import summary

__all__ = ["Dashboard", "summary", "write_report"]


def __getattr__(name: str) -> Any:
    """``Dashboard``, ``write_report`` and ``summary``, imported on first access."""
    value: Any
    if name == "Dashboard":
        from tracemagic.views.dashboard import Dashboard as value  # noqa: N813 - the attribute asked for, by any name
    elif name == "write_report":
        from tracemagic.views.report import write_report as value
    elif name == "summary":
        from tracemagic.views.text import summary as value
    else:
        raise AttributeError(f"module 'tracemagic.views' has no attribute {name!r}")
    globals()[name] = value
    return value
