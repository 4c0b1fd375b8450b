"""The inline dashboard: ipywidgets tabs of plotly figures over sortable, filterable tables.

Figures are shown as plotly's own mime bundle (``application/vnd.plotly.v1+json``)
inside ``widgets.Output``: that renders in JupyterLab, Notebook 7 and VS Code with plotly's
bundled extension, whose plotly.js the page loads once. The Timeline starts the same way,
and its "detail on zoom" toggle turns it into a ``go.FigureWidget`` (plotly 7: an
``anywidget``) whose events are drawn again for the visible range when the user zooms or
pans (:class:`~tracemagic.views.zoom.ZoomableFigure`); ``interactive=True`` starts with it.
It is not the default because the first ``FigureWidget`` of a kernel costs seconds: plotly
imports ``nbformat`` for it, whose ``jsonschema`` builds the ``rfc3987_syntax`` grammars
(5 to 9 s of CPU on a shared 2-core machine), and the widget sends its own copy of plotly.js
(5 MB) to the page, which evaluates it again: the Timeline showed "loading…" for 8 to 9 s.
Without anywidget, or with ``interactive=False`` / ``TRACEMAGIC_FIGUREWIDGET=0``, there is
no toggle.
Tables live in Python and only the visible page is sent to the browser, so the widget
state stays small whatever the trace size. Tabs are built on first view.

Displaying a ``Dashboard`` gives ONE mime bundle: the widget view plus the text summary
as ``text/plain``, so terminal IPython and frontends without widgets show the summary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from tracemagic.views import bundle as _bundle
from tracemagic.views import figures, flame_search, html, sections, tables
from tracemagic.views._format import esc, fmt_bytes, header, step_name, unit_divisor
from tracemagic.views.data import TraceData
from tracemagic.views.zoom import ZoomableFigure, figure_widget_available

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace import TraceTables

PLOTLY_MIME = "application/vnd.plotly.v1+json"
# not "responsive": in JupyterLab's plotly renderer a responsive figure drops its height
# and collapses to 0 px inside an ipywidgets Output
PLOTLY_CONFIG = {"displaylogo": False, "responsive": False}
#: the step selector's value for "all steps" (ipywidgets 8 shows a None value as blank)
ALL_STEPS = "all"
#: the last line of the text beside the widget: what a saved notebook shows until the cell runs again
WIDGET_HINT = "(This is the text summary: run the cell again (or trust the notebook) for the interactive dashboard.)"
PAGE_SIZES = (10, 25, 50, 100)


def figure_bundle(fig: go.Figure) -> dict[str, Any]:
    """A figure as a display bundle: plotly's mime type plus a text line."""
    spec = json.loads(pio.to_json(fig, validate=False))
    spec.setdefault("layout", {})["template"] = figures.template()
    spec["config"] = dict(PLOTLY_CONFIG)
    title = fig.layout.title.text or "figure"
    return {PLOTLY_MIME: spec, "text/plain": f"<plotly figure: {title}>"}


def figure_output(fig: go.Figure) -> widgets.Output:
    """An ``Output`` widget holding ``fig`` (works without a running kernel too)."""
    out = widgets.Output(layout=widgets.Layout(width="100%"))
    set_figure(out, fig)
    return out


def set_figure(out: widgets.Output, fig: go.Figure) -> None:
    """Replace what ``out`` shows with ``fig``."""
    out.outputs = ({"output_type": "display_data", "data": figure_bundle(fig), "metadata": {}},)


def figure_of(out: widgets.Output | ZoomableFigure) -> dict[str, Any]:
    """The plotly figure dict an ``Output`` made by :func:`figure_output` (or a zoomable
    figure widget) shows."""
    if isinstance(out, ZoomableFigure):
        spec = json.loads(pio.to_json(out.widget, validate=False))
        spec["config"] = dict(PLOTLY_CONFIG)
        return spec
    return out.outputs[0]["data"][PLOTLY_MIME]


def slot_widget(slot: widgets.Output | ZoomableFigure) -> widgets.Widget:
    """The widget that shows a figure slot."""
    return slot.widget if isinstance(slot, ZoomableFigure) else slot


class TableView:
    """A sortable, filterable, paginated table widget over a DataFrame kept in Python.

    Args:
        frame: the rows (already aggregated for display).
        caption: shown above the table.
        page_size: rows per page.
    """

    def __init__(self, frame: pd.DataFrame, caption: str = "", page_size: int = 25) -> None:
        self.caption = caption
        self.filter = widgets.Text(
            placeholder="filter rows…", continuous_update=False, layout=widgets.Layout(width="220px")
        )
        self.sort = widgets.Dropdown(description="sort", layout=widgets.Layout(width="240px"))
        self.descending = widgets.ToggleButton(
            value=True, description="desc", tooltip="sort descending", layout=widgets.Layout(width="64px")
        )
        self.page_size = widgets.Dropdown(
            options=PAGE_SIZES,
            value=page_size if page_size in PAGE_SIZES else 25,
            description="rows",
            style={"description_width": "initial"},
            layout=widgets.Layout(width="120px"),
        )
        self.prev = widgets.Button(description="◀", layout=widgets.Layout(width="40px"), tooltip="previous page")
        self.next = widgets.Button(description="▶", layout=widgets.Layout(width="40px"), tooltip="next page")
        self.status = widgets.Label()
        self.html = widgets.HTML()
        self.title = widgets.HTML()  # the caption, above the table's own controls
        self.page = 0
        self._quiet = False
        self.frame = pd.DataFrame()
        for control in (self.filter, self.sort, self.descending, self.page_size):
            control.observe(self._changed, names="value")
        self.descending.observe(self._direction, names="value")  # the toggle says the order it sorts in
        self.prev.on_click(lambda _: self.go(self.page - 1))
        self.next.on_click(lambda _: self.go(self.page + 1))
        self.widget = widgets.VBox(
            [
                self.title,
                widgets.HBox(
                    [self.filter, self.sort, self.descending, self.page_size, self.prev, self.next, self.status]
                ),
                self.html,
            ]
        )
        self.set_frame(frame, caption)

    def set_frame(self, frame: pd.DataFrame, caption: str | None = None) -> None:
        """Show new rows (keeping the filter and, when the column still exists, the sort)."""
        self.frame = frame.reset_index(drop=True)
        if caption is not None:
            self.caption = caption
        previous = self.sort.value
        options = [("table order", "")] + [(header(c), str(c)) for c in self.frame.columns]
        self._quiet = True
        try:
            self.sort.options = options
            self.sort.value = previous if previous in [v for _, v in options] else ""
        finally:
            self._quiet = False
        self.page = 0
        self.render()

    def view(self) -> pd.DataFrame:
        """The rows after the text filter and the sort (all pages)."""
        frame = tables.filter_rows(self.frame, self.filter.value)
        return tables.sort_rows(frame, self.sort.value or None, ascending=not self.descending.value)

    @property
    def pages(self) -> int:
        """How many pages the filtered rows fill."""
        return max(1, -(-len(self.view()) // int(self.page_size.value)))

    def go(self, page: int) -> None:
        """Show page ``page`` (clamped to the pages there are)."""
        self.page = min(max(page, 0), self.pages - 1)
        self.render()

    def _direction(self, change: dict[str, Any]) -> None:
        self.descending.description = "desc" if change["new"] else "asc"
        self.descending.tooltip = "sort descending" if change["new"] else "sort ascending"

    def _changed(self, _: Any) -> None:
        if self._quiet:
            return
        self.page = 0
        self.render()

    def render(self) -> None:
        """Redraw the visible page."""
        rows = self.view()
        size = int(self.page_size.value)
        pages = max(1, -(-len(rows) // size))
        self.page = min(self.page, pages - 1)
        shown = rows.iloc[self.page * size : (self.page + 1) * size]
        self.title.value = html.style() + (f'<div class="tm-caption">{esc(self.caption)}</div>' if self.caption else "")
        self.html.value = html.style() + html.table(shown)
        self.status.value = (
            f"{len(rows):,} rows"
            + (f" (of {len(self.frame):,})" if len(rows) != len(self.frame) else "")
            + f" · page {self.page + 1}/{pages}"
        )
        self.prev.disabled = self.page == 0
        self.next.disabled = self.page >= pages - 1


class Dashboard:
    """The interactive dashboard of one trace (optionally compared with another).

    Args:
        trace: a loaded ``Trace``.
        title: the heading (default: the trace's file name).
        other: a second ``Trace``; adds the Compare tab (this trace is A, ``other`` is B).
        step: the step selected at first (default: all steps).
        top: how many bars the top-N charts show.
        unit: time unit, ``µs`` or ``ms``.
        force_widget: force (True) or suppress (False) the widget in the display bundle;
            default: only when running in a kernel, so terminal IPython builds no widget.
        interactive: True: draw the Timeline as a ``FigureWidget`` that re-samples its
            events to the visible range on zoom and pan, from the start; None (default):
            a static Timeline with a "detail on zoom" toggle that makes it one (when
            anywidget is installed and ``TRACEMAGIC_FIGUREWIDGET`` is not ``0``); False:
            static figures, no toggle.
        caption: plain-text lines shown under the heading (a capture's status, folder,
            files and notes), so the widget hides nothing its text fallback says.
        other_before: ``other`` is the earlier run this one is compared with (a capture's
            ``--vs``): the Compare tab takes it as A and this trace as B.

    Attributes:
        data: the analyses' tables (``TraceData``), computed once.
        keys: the tabs shown, in order.
    """

    def __init__(
        self,
        trace: TraceTables,
        *,
        title: str | None = None,
        other: TraceTables | None = None,
        step: int | None = None,
        top: int = 15,
        unit: str = "ms",
        force_widget: bool | None = None,
        interactive: bool | None = None,
        caption: Sequence[str] = (),
        other_before: bool = False,
    ) -> None:
        #: whether the Timeline can become a zoomable FigureWidget (its toggle shows)
        self.zoom_available = figure_widget_available() if interactive is None else bool(interactive)
        #: whether it is one now (the toggle's value)
        self.interactive = bool(interactive)
        self.data = trace if isinstance(trace, TraceData) else TraceData(trace)
        self.other = None if other is None else other if isinstance(other, TraceData) else TraceData(other)
        self.title = title or (f"{self.data.name} vs {self.other.name}" if self.other else self.data.name)
        self.state = sections.ViewState(step=step, top=top, unit=unit)
        self.keys = sections.available(self.data, self.other)
        self.force_widget = force_widget
        self.caption = [str(line) for line in caption]
        self.other_before = other_before
        self._widget: widgets.VBox | None = None
        self._built: dict[str, tuple[Any, ...]] = {}
        self._tabs: dict[str, dict[str, Any]] = {}
        self._text: str | None = None
        self.on_saved: Callable[[Path], None] | None = None

    # -- content ------------------------------------------------------------------------
    def _state_key(self, key: str) -> tuple[Any, ...]:
        step = self.state.step if key in sections.STEP_DEPENDENT else None
        return (step, self.state.top, self.state.unit)

    def section(self, key: str) -> sections.Section:
        """The content of tab ``key`` under the current controls."""
        return sections.build(key, self.data, self.state, self.other, other_before=self.other_before)

    def text(self, width: int = 100) -> str:
        """The text summary (the ``text/plain`` fallback)."""
        from tracemagic.views.text import summary

        if self._text is None or width != 100:
            text = summary(self.data, width=width) if not self.data.summaries_only else self._ranks_text()
            if self.other is not None:
                text += f"\n\n(compared with {self.other.name}: see the Compare tab or `tracemagic diff`)"
            if width != 100:
                return text
            self._text = text
        return self._text

    def _ranks_text(self) -> str:
        """The text of a job's summarized ranks: its Ranks table."""
        section = self.section("ranks")
        facts = [f"{label}: {value}" for label, value in section.facts]
        return "\n".join([f"tracemagic · {self.title}", *facts, section.table.to_string(index=False)])

    # -- the widget ---------------------------------------------------------------------
    @property
    def widget(self) -> widgets.VBox:
        """The ipywidgets layout (built on first access, Overview tab rendered)."""
        if self._widget is None:
            self._widget = self._build()
            self._ensure(self.keys[0])
        return self._widget

    def _build(self) -> widgets.VBox:
        steps = self.data.step_ids
        self.step_control = widgets.Dropdown(
            options=[("all steps", ALL_STEPS)] + [(step_name(s), s) for s in steps],
            value=self.state.step if self.state.step in steps else ALL_STEPS,
            description="step",
            layout=widgets.Layout(width="180px"),
        )
        self.top_control = widgets.BoundedIntText(
            value=self.state.top, min=1, max=200, description="top N", layout=widgets.Layout(width="140px")
        )
        self.unit_control = widgets.ToggleButtons(
            options=["µs", "ms"],
            value=self.state.unit if self.state.unit in ("µs", "ms") else "ms",
            style={"button_width": "44px"},
        )
        default_path = f"{Path(self.data.name).name.split('.')[0] or 'trace'}.report.html"
        # sized to their text: the name box holds a file name, the button its whole label
        self.report_path = widgets.Text(
            value=default_path,
            description="report",
            style={"description_width": "initial"},
            layout=widgets.Layout(width=f"{min(max(len(default_path), 24), 60) + 8}ch"),
        )
        self.save_button = widgets.Button(
            description="Save HTML report",
            icon="download",
            button_style="primary",
            layout=widgets.Layout(width="auto", min_width="170px"),
        )
        self.save_status = widgets.HTML()
        for control in (self.step_control, self.top_control, self.unit_control):
            control.observe(self._controls_changed, names="value")
        self.save_button.on_click(lambda _: self.save_report())

        self.tab = widgets.Tab()
        children = []
        for key in self.keys:
            box = widgets.VBox([widgets.HTML("<i>loading…</i>")], layout=widgets.Layout(width="100%"))
            children.append(box)
            self._tabs[key] = {"box": box}
        self.tab.children = children
        self.tab.titles = tuple(sections.TITLES[k] for k in self.keys)
        self.tab.observe(lambda _: self._ensure(self.current), names="selected_index")
        lines = "".join(f"<div>{esc(line)}</div>" for line in self.caption)
        header = widgets.HTML(
            html.style()
            + f'<div class="tm-caption" style="font-size:15px">tracemagic · {esc(self.title)}</div>'
            + (
                f'<div class="tm-caption" style="font-family:monospace;white-space:pre-wrap">{lines}</div>'
                if lines
                else ""
            )
        )
        strip = self.strip()
        root = widgets.VBox(
            [
                header,
                *([figure_output(strip)] if strip is not None else []),
                widgets.HBox([self.step_control, self.top_control, self.unit_control]),
                widgets.HBox([self.report_path, self.save_button, self.save_status]),
                self.tab,
            ]
        )
        self.tab.selected_index = 0
        return root

    def strip(self) -> go.Figure | None:
        """The header's strip of every iteration (``figures.iteration_strip``), or None for a
        trace without iteration timing (not a ``%%chakra_trace`` loop)."""
        if self.data.summaries_only or self.data.iterations.empty:
            return None
        return figures.iteration_strip(self.data.iterations)

    @property
    def controls(self) -> dict[str, widgets.Widget]:
        """The control widgets: ``step``, ``top``, ``unit``, ``report_path``, ``save``, ``tabs``."""
        self.widget  # noqa: B018 - builds them
        return {
            "step": self.step_control,
            "top": self.top_control,
            "unit": self.unit_control,
            "report_path": self.report_path,
            "save": self.save_button,
            "tabs": self.tab,
        }

    @property
    def current(self) -> str:
        """The key of the selected tab."""
        return self.keys[self.tab.selected_index or 0]

    def select(self, key: str) -> None:
        """Select (and build) tab ``key``."""
        self.widget  # noqa: B018
        self.tab.selected_index = self.keys.index(key)
        self._ensure(key)

    def render_all(self) -> None:
        """Build every tab now (for saving the notebook with all views, and for tests)."""
        for key in self.keys:
            self._ensure(key)

    def _controls_changed(self, _: Any) -> None:
        step = self.step_control.value
        self.state = sections.ViewState(
            step=None if step == ALL_STEPS else step, top=int(self.top_control.value or 1), unit=self.unit_control.value
        )
        self._ensure(self.current)

    def _ensure(self, key: str) -> None:
        """Build or refresh tab ``key`` if the controls changed since it was drawn."""
        if self._widget is None:
            self.widget  # noqa: B018 - builds the layout (and the first tab)
        state = self._state_key(key)
        if self._built.get(key) == state:
            return
        try:
            section = self.section(key)
        except Exception as exc:  # noqa: BLE001 - one tab's failure must not break the others
            self._tabs[key]["box"].children = [
                widgets.HTML(f"<b>This view failed:</b> {esc(type(exc).__name__)}: {esc(exc)}")
            ]
            self._built[key] = state
            return
        tab = self._tabs[key]
        if section.rebuild and self.zoom_available and "zoom" not in tab:
            tab["zoom"] = widgets.ToggleButton(
                value=self.interactive,
                description="detail on zoom",
                icon="search-plus",
                tooltip="draw the events of the visible range again when you zoom or pan "
                "(a plotly FigureWidget: its first start in a kernel takes seconds)",
                layout=widgets.Layout(width="150px"),
            )
            tab["zoom"].observe(lambda change, key=key: self._zoom_toggled(key, bool(change["new"])), names="value")
        top_html = html.facts(section.facts) + html.bullets(
            section.bullets, "Recommendations" if key == "overview" else ""
        )
        first = "table" not in tab
        if first:
            tab["info"] = widgets.HTML()
            tab["figures"] = []
            tab["side"] = widgets.HTML(layout=widgets.Layout(flex="1 1 520px", min_width="460px", overflow="auto"))
            tab["extra"] = widgets.VBox()
            tab["extras"] = []
        else:
            tab["table"].set_frame(section.table, section.table_title)
        old_slots = tab["figures"]
        slots = [
            self._slot(fig, section.rebuild.get(i), old_slots[i] if i < len(old_slots) else None)
            for i, fig in enumerate(section.figures)
        ]
        for stale in old_slots[len(slots) :]:
            if isinstance(stale, ZoomableFigure):
                stale.close()
        tab["figures"] = slots
        tab["side"].value = section.side
        shown = [slot_widget(s) for s in slots]
        if section.side and shown:  # the side panel (the Layers tab's tree table) beside the first figure
            shown[0].layout.flex = "1 1 480px"
            shown[0].layout.width = "auto"
            shown = [self._beside(tab, shown[0]), *shown[1:]]
        search = self._flame_search(key, section.figures)
        head = [tab["info"], *([tab["zoom"]] if "zoom" in tab else []), *search, *shown]
        tab["info"].value = html.style() + top_html
        if first:  # the figures reach the page before the table's dozen widgets are made and sent
            tab["box"].children = head
            tab["table"] = TableView(section.table, section.table_title)
        tab["box"].children = [*head, tab["table"].widget, tab["extra"]]
        # each small table with its own filter, sort and pages (one table view per caption, kept across redraws)
        views: list[TableView] = tab["extras"]
        for i, (caption, frame) in enumerate(section.extra):
            if i < len(views):
                views[i].set_frame(frame, caption)
            else:
                views.append(TableView(frame, caption))
        del views[len(section.extra) :]
        tab["extra"].children = [view.widget for view in views]
        self._built[key] = state

    @staticmethod
    def _beside(tab: dict[str, Any], figure: widgets.Widget) -> widgets.HBox:
        """The box holding ``figure`` and the tab's side panel: the same box at every redraw, so
        the page keeps the figure's view. A new box would draw its figures again from the
        browser's copy, where JupyterLab's plotly renderer has stored a PNG snapshot: the
        figure would come back as that still image (no hover, no zoom) until the mouse entered it."""
        box: widgets.HBox | None = tab.get("beside")
        if box is None or box.children[0] is not figure:
            box = tab["beside"] = widgets.HBox(
                [figure, tab["side"]],
                layout=widgets.Layout(width="100%", align_items="flex-start", flex_flow="row wrap"),
            )
        return box

    def _flame_search(self, key: str, figs: list[go.Figure]) -> list[widgets.Widget]:
        """The search box above the Flame tab's graphs (``views.flame_search``)."""
        if key != "flame" or not any(t.type == "icicle" for fig in figs for t in fig.data):
            return []
        tab = self._tabs[key]
        tab["flame_figs"] = list(figs)
        if "search" not in tab:
            # searched on Enter, as the tables' filters: each search draws the graphs again (seconds
            # for a big trace's hundreds of boxes), which must not happen at every key typed
            tab["search"] = widgets.Text(
                placeholder="search boxes…",
                description="search",
                continuous_update=False,
                layout=widgets.Layout(width="320px"),
            )
            tab["hits"] = widgets.HTML()
            tab["search"].observe(lambda change, key=key: self.search_flame(key, str(change["new"])), names="value")
            tab["search_box"] = widgets.HBox([tab["search"], tab["hits"]])  # kept: see _beside
        if tab["search"].value:
            self.search_flame(key, tab["search"].value)
        return [tab["search_box"]]

    def search_flame(self, key: str, query: str) -> int:
        """Highlight the boxes of tab ``key``'s flame graphs whose label holds ``query``
        (all drawn as before for ''); how many match."""
        tab = self._tabs[key]
        found, redraw = 0, []
        for slot, fig in zip(tab["figures"], tab.get("flame_figs", [])):
            if isinstance(slot, widgets.Output) and any(t.type == "icicle" for t in fig.data):
                drawn, hits = flame_search.highlight(fig, query)
                found += hits
                redraw.append((slot, drawn))
        tab["hits"].value = f"{found:,} boxes match" if query.strip() else ""  # said before the slow redraw
        for slot, drawn in redraw:
            set_figure(slot, drawn)
        return found

    def _zoom_toggled(self, key: str, on: bool) -> None:
        """The "detail on zoom" toggle: the Timeline as a zoomable FigureWidget, or static."""
        self.interactive = on
        self._built.pop(key, None)
        self._ensure(key)

    def _slot(
        self,
        fig: go.Figure,
        rebuild: Callable[[tuple[float, float]], go.Figure] | None,
        old: widgets.Output | ZoomableFigure | None,
    ) -> widgets.Output | ZoomableFigure:
        """The widget for one figure: a zoomable ``FigureWidget`` where the section can draw
        the figure again for a window (and widgets are interactive), else an ``Output``."""
        if rebuild is not None and self.interactive:
            if isinstance(old, ZoomableFigure):  # same widget, new content (one FigureWidget per tab)
                old.reset(fig, rebuild, unit_divisor=unit_divisor(self.state.unit))
                return old
            try:
                return ZoomableFigure(fig, rebuild, unit_divisor=unit_divisor(self.state.unit), config=PLOTLY_CONFIG)
            except ImportError:  # anywidget missing after all: the static figure
                self.interactive = self.zoom_available = False
        if isinstance(old, ZoomableFigure):
            old.close()
            old = None
        if isinstance(old, widgets.Output):
            set_figure(old, fig)
            return old
        return figure_output(fig)

    def zoomable(self, key: str) -> ZoomableFigure | None:
        """Tab ``key``'s zoomable figure (the Timeline's), or None where it is static."""
        self._ensure(key)
        return next((s for s in self._tabs[key]["figures"] if isinstance(s, ZoomableFigure)), None)

    def figures(self, key: str) -> list[dict[str, Any]]:
        """The figure dicts tab ``key`` shows now (building it if needed)."""
        self._ensure(key)
        return [figure_of(out) for out in self._tabs[key]["figures"]]

    def table(self, key: str) -> TableView:
        """The table widget of tab ``key``."""
        self._ensure(key)
        return self._tabs[key]["table"]

    def info_html(self, key: str) -> str:
        """The HTML of tab ``key``'s facts and recommendations."""
        self._ensure(key)
        return self._tabs[key]["info"].value

    # -- actions ------------------------------------------------------------------------
    def save_report(self, path: str | Path | None = None) -> Path | None:
        """Write the standalone HTML report (the button's action); returns its path, or
        None after showing the error in the dashboard."""
        from tracemagic.views.report import write_report

        target = Path(
            path if path is not None else (self.report_path.value if self._widget else "report.html")
        ).expanduser()
        try:
            written = write_report(
                self.data, target, other=self.other, title=self.title, other_before=self.other_before
            )
        except Exception as exc:
            if self._widget is not None:
                self.save_status.value = f'<span style="color:#b00">could not save: {esc(exc)}</span>'
            if path is not None:
                raise
            return None
        if self._widget is not None:
            self.save_status.value = f"saved {esc(written)} ({esc(fmt_bytes(written.stat().st_size))})"
        if self.on_saved is not None:
            self.on_saved(written)
        return written

    def widget_state_bytes(self) -> int:
        """Size of the widget state a notebook would save for this dashboard (bytes of JSON)."""
        from ipywidgets.embed import dependency_state

        return len(json.dumps(dependency_state(self.widget, drop_defaults=True)).encode())

    # -- display ------------------------------------------------------------------------
    def _wants_widget(self) -> bool:
        if self.force_widget is not None:
            return self.force_widget
        try:
            from IPython import get_ipython
        except ImportError:  # pragma: no cover
            return False
        shell = get_ipython()
        return shell is not None and getattr(shell, "kernel", None) is not None

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget (in a kernel) and the text summary; beside the widget the text ends with
        :data:`WIDGET_HINT`, since a saved notebook opened later shows only the text until the
        cell runs again. Only the MIME types ``include`` names (all when None), none that
        ``exclude`` names: the widget is built, and the text computed, only when asked for."""
        bundle: dict[str, Any] = {}
        widget = self._wants_widget() and _bundle.wanted(_bundle.WIDGET_MIME, include, exclude)
        if widget:
            bundle.update(self.widget._repr_mimebundle_())
        if _bundle.wanted(_bundle.TEXT_MIME, include, exclude):
            bundle[_bundle.TEXT_MIME] = f"{self.text()}\n\n{WIDGET_HINT}" if widget else self.text()
        return _bundle.select(bundle, include, exclude)

    def __repr__(self) -> str:
        return f"<tracemagic Dashboard: {self.title}, tabs {', '.join(self.keys)}>"
