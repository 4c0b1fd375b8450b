"""A plotly ``FigureWidget`` that draws again what the visible x range needs.

The Timeline of a trace of millions of events cannot send every event to the browser: it
draws the longest events of each lane and aggregates the rest into busy-time bins. When the
user zooms or pans, :class:`ZoomableFigure` observes ``layout.xaxis.range``, asks the
section's ``rebuild(window)`` for the events of the new window (with the same cap on the
events drawn) and updates the widget's traces in place. Changes are debounced: a burst of
range changes (scroll-zoom, dragging) redraws once, ``debounce_s`` after the last one.

plotly 7's ``FigureWidget`` is an ``anywidget``; where that is not installed,
:func:`figure_widget_available` is False and the dashboard keeps its static figures.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go

from tracemagic.views.figures import TEMPLATE

#: trace properties that carry per-event data (replaced on every redraw)
_DATA_PROPS = ("x", "y", "base", "width", "customdata", "text", "hovertemplate", "orientation", "marker")
#: set TRACEMAGIC_FIGUREWIDGET=0 to keep static figures (frontends without anywidget)
ENV_SWITCH = "TRACEMAGIC_FIGUREWIDGET"


def figure_widget_available() -> bool:
    """Whether ``go.FigureWidget`` can be built here (anywidget installed) and is not
    switched off with ``TRACEMAGIC_FIGUREWIDGET=0``."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    # found, not imported: importing it (and the FigureWidget) waits until one is built
    return importlib.util.find_spec("anywidget") is not None


class ZoomableFigure:
    """A ``FigureWidget`` over ``fig`` whose events follow the visible x range.

    Args:
        fig: the figure at its base window (``layout.meta``: ``window`` [lo, hi] in µs,
            ``origin`` the µs value of x = 0).
        rebuild: window (µs since the trace start) -> the figure for that window, drawn
            with the same origin, unit and cap.
        unit_divisor: µs per x unit (1000 for ms).
        debounce_s: wait this long after the last range change before redrawing (0:
            redraw at once). Outside a running event loop (plain Python, tests) redraws
            happen at once.
        config: plotly config for the widget.

    Attributes:
        widget: the ``go.FigureWidget``.
        window: the window (µs) the widget's events are drawn for.
        redraws: how many times the events were drawn again.
    """

    def __init__(
        self,
        fig: go.Figure,
        rebuild: Callable[[tuple[float, float]], go.Figure],
        *,
        unit_divisor: float,
        debounce_s: float = 0.25,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.debounce_s = debounce_s
        self.redraws = 0
        self.error: str | None = None
        self._pending: tuple[float, float] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._quiet = False
        self.widget = go.FigureWidget(fig)
        self.widget.layout.template = TEMPLATE  # figures do not carry it (figures.TEMPLATE)
        if config:
            self.widget._config = dict(config)
        self._start(fig, rebuild, unit_divisor)
        self.widget.layout.on_change(self._range_changed, "xaxis.range")

    def _start(self, fig: go.Figure, rebuild: Callable[[tuple[float, float]], go.Figure], unit_divisor: float) -> None:
        meta = dict(fig.layout.meta or {})
        self.rebuild = rebuild
        self.div = float(unit_divisor)
        lo, hi = (float(v) for v in meta.get("window", (0.0, 1.0)))
        self.base = (lo, hi)
        self.origin = float(meta.get("origin", lo))
        self.window = self.base
        self._lanes = list(self.widget.layout.yaxis.categoryarray or ())
        if self._lanes:
            # an invisible trace across the base window: double-click (autorange) returns to it
            self.widget.add_scatter(
                x=[(lo - self.origin) / self.div, (hi - self.origin) / self.div],
                y=[self._lanes[0]] * 2,
                mode="markers",
                marker={"opacity": 0},
                hoverinfo="skip",
                showlegend=False,
                name="extent",
            )

    def reset(
        self, fig: go.Figure, rebuild: Callable[[tuple[float, float]], go.Figure], *, unit_divisor: float
    ) -> None:
        """Show ``fig`` (a new base window: another step or unit) in the same widget."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._pending = None
        self._quiet = True
        try:
            with self.widget.batch_update():
                self.widget.data = []
            self.widget.add_traces(list(fig.data))
            layout = fig.layout.to_plotly_json()
            layout.setdefault("annotations", [])
            layout.setdefault("shapes", [])
            layout.setdefault("xaxis", {}).update(range=None, autorange=True)
            self.widget.update_layout(layout, overwrite=True)
            self._start(fig, rebuild, unit_divisor)
        finally:
            self._quiet = False

    # -- range changes ------------------------------------------------------------------
    def _range_changed(self, _layout: Any, xrange: Any) -> None:
        if self._quiet or xrange is None or len(xrange) != 2:
            return
        try:
            a, b = float(xrange[0]), float(xrange[1])
        except (TypeError, ValueError):  # dates or categories: not a time axis
            return
        if b < a:
            a, b = b, a
        self._pending = (self.origin + a * self.div, self.origin + b * self.div)
        self._schedule()

    def _schedule(self) -> None:
        if self.debounce_s <= 0:
            self.flush()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread: plain Python
            self.flush()
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = loop.call_later(self.debounce_s, self.flush)

    def set_range(self, start: float, end: float) -> None:
        """Show x from ``start`` to ``end`` (axis units), as a user's zoom would."""
        self.widget.layout.xaxis.range = (start, end)

    def flush(self) -> None:
        """Redraw now for the last range seen (if it differs from the drawn window)."""
        self._handle = None
        window, self._pending = self._pending, None
        if window is None:
            return
        lo, hi = window
        span = max(hi - lo, 1e-9)
        if abs(lo - self.window[0]) <= 1e-3 * span and abs(hi - self.window[1]) <= 1e-3 * span:
            return  # the same window again (e.g. the frontend echoing our own range)
        try:
            fig = self.rebuild((lo, hi))
        except Exception as exc:  # noqa: BLE001 - a failed redraw keeps the last view, never raises into the kernel
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.error = None
        self.window = (lo, hi)
        self.redraws += 1
        self._apply(fig)

    # -- updating the widget in place -----------------------------------------------------
    def _apply(self, fig: go.Figure) -> None:
        new = {t.name: t for t in fig.data}
        added = []
        with self.widget.batch_update():
            for trace in self.widget.data:
                if trace.name == "extent":
                    continue
                source = new.pop(trace.name, None)
                if source is None:  # nothing of this kind in the window: keep the (empty) trace and its legend state
                    trace.update(x=[], y=[], base=[] if trace.type == "bar" else None, customdata=None, text=None)
                    continue
                props = source.to_plotly_json()
                trace.update({k: props.get(k) for k in _DATA_PROPS if k in props or k in ("customdata", "text")})
            added = list(new.values())
            layout = fig.layout
            self.widget.layout.meta = layout.meta
            self.widget.layout.annotations = layout.annotations
            lanes = list(layout.yaxis.categoryarray or ())
            missing = [lane for lane in lanes if lane not in self._lanes]
            if missing:
                self._lanes += missing
                self.widget.layout.yaxis.categoryarray = self._lanes
        if added:
            self.widget.add_traces(added)

    def close(self) -> None:
        """Close the widget (its comm) and drop a pending redraw."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.widget.close()
