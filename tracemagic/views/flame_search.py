"""Search in the flame graph: the boxes whose label, or full name or kind (the hover's),
holds a text are highlighted, the others greyed (plotly's icicle has no search box of its own).

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


def searched_text(trace: go.Icicle) -> list[str]:
    """Per box, what the search looks in: its label, and the full name and the kind its hover
    shows (``figures.flame``'s first two ``customdata`` columns: a frame's file, a module
    box's torch name ``module BertLayer_0``), HTML-escaped as the figure holds them."""
    labels = [str(label) for label in trace.labels]
    custom = trace.customdata
    if custom is None or len(custom) != len(labels):
        return labels
    return ["\n".join(str(v) for v in (label, *row[:2]) if v is not None) for label, row in zip(labels, custom)]


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
        hit = matches(searched_text(trace), query)
        found += sum(hit)
        trace.marker.colors = [MATCH_COLOR if h else OTHER_COLOR for h in hit]
        trace.marker.showscale = False
    return out, found
