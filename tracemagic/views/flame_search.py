"""Search in the flame graph: the boxes whose label holds a text are highlighted, the others
greyed (plotly's icicle has no search box of its own).

The report does it in the page (``report._SCRIPT``: the same colours in the view it draws,
the count over every box);
the dashboard draws the figure again with :func:`highlight` when its search box changes.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

#: a matching box's colour, and the others'
MATCH_COLOR = "#2b7bff"
OTHER_COLOR = "#e6e6e6"


def matches(labels: list[str] | tuple[str, ...], query: str) -> list[bool]:
    """Per label (as the figure holds it, HTML-escaped), whether it holds ``query``
    (case-insensitive); all False for an empty query."""
    needle = query.strip().lower()
    if not needle:
        return [False] * len(labels)
    return [needle in html.unescape(str(label)).lower() for label in labels]


def highlight(fig: go.Figure, query: str) -> tuple[go.Figure, int]:
    """``fig`` with the boxes of its icicles whose label holds ``query`` in ``MATCH_COLOR``
    and the others in ``OTHER_COLOR`` (the colour bar hidden), and how many boxes match;
    ``fig`` itself for an empty query."""
    if not query.strip():
        return fig, 0
    out = go.Figure(fig)
    found = 0
    for trace in out.data:
        if trace.type != "icicle" or trace.labels is None:
            continue
        hit = matches(list(trace.labels), query)
        found += sum(hit)
        trace.marker.colors = [MATCH_COLOR if h else OTHER_COLOR for h in hit]
        trace.marker.showscale = False
    return out, found
