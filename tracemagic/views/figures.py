"""Plotly figures: pure functions from the analyses' DataFrames to ``go.Figure``.

They read only the columns documented in ``tracemagic.analysis`` and never touch trace
files. Every string from a trace is escaped (plotly renders some HTML in labels and hover
text). Large inputs are aggregated so a figure stays small and responsive: the timeline keeps
the longest events of each lane plus busy-time bins, the memory curve keeps each bin's
extremes, the tree keeps the heaviest layers.
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.io.json import to_json_plotly

from tracemagic.analysis import devices
from tracemagic.analysis._common import GPU_ACTIVITY, MODULE_PREFIX
from tracemagic.analysis.sites import cell_file
from tracemagic.views import tables
from tracemagic.views._format import (
    esc,
    esc_all,
    fmt_bytes,
    fmt_dtypes,
    fmt_time,
    kernel_label,
    shorten,
    step_name,
    unique_labels,
    unit_divisor,
)
from tracemagic.views.selection import timeline_events


def hover_columns(*columns: Iterable[Any]) -> np.ndarray:
    """A trace's ``customdata``: one column per hover value, each value kept as it is.

    ``np.stack`` of names and numbers makes one text array as wide as the longest name,
    every number written as text: copied and checked by plotly, and sent, at that width
    (0.1 s for the Flame tab of a large GPU trace).
    """
    values = [
        c.to_numpy() if isinstance(c, pd.Series) else c if isinstance(c, np.ndarray) else list(c) for c in columns
    ]
    out = np.empty((len(values[0]) if values else 0, len(values)), dtype=object)
    for i, column in enumerate(values):
        out[:, i] = column
    return out


#: the plotly template of every figure. Figures do not carry it (plotly validates and copies
#: the whole template into each figure that sets it: tens of ms per figure); the views add it
#: where a figure is shown (:func:`template`), once per page in the HTML report
TEMPLATE = "plotly_white"
#: colors of the step parts (``tables.STEP_PARTS`` order)
PART_COLORS = {
    "compute_us": "#2ca02c",
    "comm_us": "#9467bd",
    "memcpy_us": "#ff7f0e",
    "memset_us": "#e6ab02",
    "runtime_us": "#8c564b",
    "dataloader_us": "#d62728",
    "cpu_us": "#1f77b4",
    "idle_us": "#c7c7c7",
}
#: colors of the phases of a step (``tables.PHASE_NAMES`` order)
PHASE_COLORS = {
    "dataloader": "#d62728",
    "forward": "#8c6bb1",
    "backward": "#e377c2",
    "optimizer": "#ff7f0e",
    "other": "#c7c7c7",
}
KIND_COLORS = {
    "step": "#7f7f7f",
    "cpu_op": "#1f77b4",
    "user_annotation": "#17becf",
    "kernel": "#2ca02c",
    "memcpy": "#ff7f0e",
    "memset": "#e6ab02",
    "layer forward": "#8c6bb1",
    "layer backward": "#e377c2",
    **{f"phase {name}": color for name, color in PHASE_COLORS.items()},
}
STATUS_COLORS = {"slower": "#d62728", "faster": "#2ca02c", "added": "#ff7f0e", "removed": "#1f77b4", "same": "#c7c7c7"}


@functools.lru_cache(maxsize=1)
def template_json() -> str:
    """``TEMPLATE`` as plotly JSON text (computed once)."""
    return to_json_plotly(pio.templates[TEMPLATE].to_plotly_json())


def template() -> dict[str, Any]:
    """``TEMPLATE`` as a plotly JSON dict (a fresh copy) for a figure's ``layout.template``."""
    return cast("dict[str, Any]", json.loads(template_json()))


#: the plot width the legend is laid out for (px): a legend wider than this wraps into more rows
LEGEND_WIDTH = 720
_TITLE_PX, _LEGEND_ROW_PX = 44, 22


def _legend_rows(fig: go.Figure) -> int:
    """How many rows the horizontal legend above the plot takes at ``LEGEND_WIDTH`` (0: no
    legend): its entries' estimated widths (text at ~7 px a character, 40 px of symbol and gap)."""
    names = [str(t.name) for t in fig.data if t.name and t.showlegend is not False]
    if fig.layout.showlegend is False or (len(names) < 2 and fig.layout.showlegend is not True) or not names:
        return 0
    rows, used = 1, 0
    for name in names:
        width = 40 + 7 * len(name)
        if used and used + width > LEGEND_WIDTH:
            rows, used = rows + 1, 0
        used += width
    return rows


#: px per character of a 12 px tick label (DejaVu Sans and Verdana, the widest of plotly's
#: fonts; Arial is narrower), and what plotly adds beside the labels
_TICK_CHAR_PX, _TICK_PAD_PX, _AXIS_TITLE_PX = 7.4, 16, 24
#: the bottom margin that holds the x axis' tick labels and title (plotly needs 53 px), the
#: right one half the last x tick label (centred on the plot's right edge)
_BOTTOM_PX, RIGHT_PX = 60, 32


def _label_chars(label: object) -> int:
    """How many characters the longest line of a (plotly HTML) label shows."""
    text = re.sub(r"<[^>]*>", "\n", str(label)) if "<" in str(label) else str(label)
    return max((len(html.unescape(line)) for line in text.split("\n")), default=0)


def tick_margin(labels: Iterable[object], *, title: bool = False, least: int = 60) -> int:
    """A left margin (px) wide enough for these y tick labels (and the axis title), so that
    plotly's automargin never has to widen it: widening it draws the whole figure a second
    time, which doubled the time to draw a figure with long labels."""
    chars = max((_label_chars(label) for label in labels), default=0)
    need = chars * _TICK_CHAR_PX + _TICK_PAD_PX + (_AXIS_TITLE_PX if title else 0) if chars else 0
    return max(least, int(math.ceil(need)))


def _layout(fig: go.Figure, title: str, x: str | None = None, y: str | None = None, height: int = 420) -> go.Figure:
    """The views' common layout: the title atop the figure, the legend in rows of its own
    between the title and the plot (never over the data or the title), axis titles. The
    margins hold the axes' labels (horizontal bars' names, :func:`tick_margin`) as drawn,
    so plotly draws the figure once instead of again with wider margins."""
    rows = _legend_rows(fig)
    top = _TITLE_PX + _LEGEND_ROW_PX * rows + (6 if rows else 6)
    names = [label for t in fig.data if getattr(t, "orientation", None) == "h" and t.y is not None for label in t.y]
    # a numeric y axis with a title: ticks of up to 5 characters (plotly needed 61 px for 4)
    left = tick_margin(names, title=y is not None, least=72 if y else 60)
    fig.update_layout(
        title={"text": esc(title), "yref": "container", "y": 1.0, "yanchor": "top", "pad": {"t": 10}},
        height=height + max(0, top - 50),
        margin={"l": left, "r": RIGHT_PX, "t": top, "b": _BOTTOM_PX},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
    )
    if x is not None:
        fig.update_xaxes(title_text=x)
    if y is not None:
        fig.update_yaxes(title_text=y)
    return fig


def empty(message: str, title: str = "") -> go.Figure:
    """A figure with no data and ``message`` in its middle (for an empty table)."""
    fig = go.Figure()
    fig.add_annotation(text=esc(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 14})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height=240)


def _step_labels(steps: pd.DataFrame) -> list[str]:
    several = steps["rank"].nunique() > 1 if "rank" in steps else False
    if several:
        return [f"r{int(r)} · {step_name(s)}" for r, s in zip(steps["rank"], steps["step"])]
    return [step_name(s) for s in steps["step"]]


# -- Overview ---------------------------------------------------------------------------------
def step_breakdown(steps: pd.DataFrame, *, unit: str = "ms", rank: int | None = None) -> go.Figure:
    """Stacked bar per step of the parts of its device window (GPU kernels, communication,
    memcpy, ...; ``steps()``'s partition of ``window_dur``).

    Args:
        steps: ``trace.steps()``.
        unit: time unit of the y axis (``µs``, ``ms``, ``s``).
        rank: show only this rank (default: every rank, labelled ``rN · step S``).

    Returns:
        One ``Bar`` trace per non-empty part, in ``tables.STEP_PARTS`` order.
    """
    if rank is not None and "rank" in steps:
        steps = steps[steps["rank"] == rank]
    if steps.empty:
        return empty("No ProfilerStep in this trace: nothing to break down per step.", "Step time breakdown")
    div = unit_divisor(unit)
    steps = steps.sort_values(["rank", "step"] if "rank" in steps else ["step"])
    labels = _step_labels(steps)
    fig = go.Figure()
    for column, name in tables.part_names(steps).items():
        if column not in steps or not (steps[column] > 0).any():
            continue
        values = steps[column].to_numpy(dtype=float) / div
        fig.add_bar(
            name=name,
            x=labels,
            y=values,
            marker_color=PART_COLORS[column],
            customdata=100
            * steps[column].to_numpy(dtype=float)
            / np.maximum(steps["window_dur"].to_numpy(dtype=float), 1e-9),
            hovertemplate=f"%{{x}}<br>{name}: %{{y:.3f}} {unit} (%{{customdata:.0f}}%)<extra></extra>",
        )
    fig.update_layout(barmode="stack", legend_traceorder="normal")
    return _layout(fig, "Step time breakdown", "step", f"time ({unit})")


#: the iteration strip's bar groups: name -> (phases, color)
STRIP_GROUPS = {
    "not recorded": (("skip", "wait", "after", ""), "#c7c7c7"),
    "profiler warm-up": (("warmup",), "#9ecae1"),
    "recorded steps": (("active",), "#1f77b4"),
    "recorded by --slow": (("slow",), "#ff7f0e"),
}


#: up to this many iterations the strip labels each one (beyond, plotly's ticks are whole numbers)
STRIP_EVERY_TICK = 12


def iteration_strip(iterations: pd.DataFrame) -> go.Figure:
    """A small bar chart of every iteration's wall time (``iterations()``' ``wall_ms``),
    the recorded steps in blue and the slow ones ``--slow`` caught marked with a red ×.

    Returns:
        One ``Bar`` per non-empty group of ``STRIP_GROUPS`` (x: the iteration), and a
        ``Scatter`` of the caught slow iterations.
    """
    if iterations.empty:
        return empty("No iteration timing (not a %%chakra_trace loop).", "Every iteration")
    fig = go.Figure()
    phase = iterations["phase"].astype(str)
    for name, (phases, color) in STRIP_GROUPS.items():
        rows = iterations[phase.isin(phases)]
        if rows.empty:
            continue
        step = rows["step"].astype("Float64").fillna(-1).to_numpy(dtype=float)
        fig.add_bar(
            name=name,
            x=rows["iteration"].to_numpy(),
            y=rows["wall_ms"].to_numpy(dtype=float),
            marker_color=color,
            customdata=step,
            marker_line_width=0,
            hovertemplate="iteration %{x}: %{y:.3f} ms"
            + (" (ProfilerStep#%{customdata})" if name == "recorded steps" else "")
            + f"<extra>{esc(name)}</extra>",
        )
    caught = iterations[iterations["slow_ratio"].notna()]
    if len(caught):
        fig.add_scatter(
            name="slow, caught by --slow",
            mode="markers",
            x=caught["iteration"].to_numpy(),
            y=caught["wall_ms"].to_numpy(dtype=float),
            customdata=caught["slow_ratio"].to_numpy(dtype=float),
            marker={"symbol": "x", "color": "#d62728", "size": 9},
            hovertemplate="iteration %{x}: %{y:.3f} ms, %{customdata:.1f}× the running median<extra>slow</extra>",
        )
    fig.update_layout(bargap=0, showlegend=True)
    if len(iterations) <= STRIP_EVERY_TICK:  # whole iterations: plotly's own ticks halve a short range
        fig.update_xaxes(tick0=0, dtick=1)
    fig = _layout(fig, f"Every iteration ({len(iterations):,}): wall time", None, "ms", height=200)
    # what plotly needs (bottom 26; on the right half the last tick label of a long loop): no second
    # draw. The left one stays _layout's for a titled numeric axis: the ticks follow the live
    # timings (66 px fell 2 px short of "100"-ms ticks on a loaded machine)
    fig.update_layout(margin={"r": 24, "b": 30})
    return fig


def phase_breakdown(phases: pd.DataFrame, *, unit: str = "ms") -> go.Figure:
    """Stacked bar per step of its phases (``trace.phases()``): data loading, forward,
    backward, optimizer and other on the host (they add up to the host step) and, on a GPU
    trace, beside it the GPU time each phase launched (``step N · GPU``).

    Returns:
        One ``Bar`` trace per phase, in ``tables.PHASE_NAMES`` order.
    """
    if phases.empty:
        return empty("No ProfilerStep in this trace: no phases to show.", "Phases of each step")
    div = unit_divisor(unit)
    phases = phases.sort_values(["rank", "step"] if "rank" in phases else ["step"])
    labels = _step_labels(phases)
    gpu = bool(phases[[f"gpu_{p}_us" for p in tables.PHASE_NAMES]].notna().any().any())
    x = [f"{label} · host" for label in labels] + [f"{label} · GPU" for label in labels] if gpu else labels
    fig = go.Figure()
    for phase, name in tables.PHASE_NAMES.items():
        host = phases[f"{phase}_us"].to_numpy(dtype=float)
        values = np.concatenate([host, phases[f"gpu_{phase}_us"].to_numpy(dtype=float)]) if gpu else host
        if not (np.nan_to_num(values) > 0).any():
            continue
        share = 100 * host / np.maximum(phases["dur"].to_numpy(dtype=float), 1e-9)
        fig.add_bar(
            name=name,
            x=x,
            y=values / div,
            marker_color=PHASE_COLORS[phase],
            customdata=np.concatenate([share, np.full(len(values) - len(share), np.nan)]),
            hovertemplate=f"%{{x}}<br>{name}: %{{y:.3f}} {unit}<extra></extra>",
        )
    fig.update_layout(barmode="stack", legend_traceorder="normal")
    title = "Phases of each step (host" + (", and the GPU time each launched)" if gpu else ")")
    return _layout(fig, title, "step", f"time ({unit})")


def top_ops_bar(ops: pd.DataFrame, *, top: int = 15, unit: str = "ms") -> go.Figure:
    """Horizontal bars of the ``top`` CPU ops by self time (``trace.ops()``)."""
    table = tables.top_ops(ops, top)
    if table.empty:
        return empty("No CPU ops recorded.", "Top ops by self time")
    div = unit_divisor(unit)
    table = table.iloc[::-1]
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=[esc(shorten(n, 60)) for n in table["name"]],
            x=table["self_us"].to_numpy(dtype=float) / div,
            customdata=hover_columns(esc_all(table["name"]), table["calls"].astype(int), table["total_us"] / div),
            hovertemplate=f"%{{customdata[0]}}<br>self %{{x:.3f}} {unit}<br>total %{{customdata[2]:.3f}} {unit}"
            "<br>%{customdata[1]} calls<extra></extra>",
            marker_color=KIND_COLORS["cpu_op"],
            name="self time",
        )
    )
    return _layout(
        fig, f"Top {len(table)} ops by self time", f"self time ({unit})", None, height=max(300, 24 * len(table) + 100)
    )


# -- Layers -----------------------------------------------------------------------------------
#: the root the layers tree draws above several top-level layers
ALL_LAYERS = "all layers"


def layers_tree(
    layers: pd.DataFrame,
    *,
    metric: Literal["cpu", "gpu"] = "cpu",
    style: Literal["icicle", "sunburst"] = "icicle",
    rank: int | None = None,
    max_nodes: int = 400,
    unit: str = "ms",
) -> go.Figure:
    """The module hierarchy as an icicle (or sunburst) sized by time.

    Each node's own value is its *self* time and ``branchvalues='remainder'`` adds its
    children, so a node's size is its total time and rounding in the table never breaks
    the tree. Only the ``max_nodes`` heaviest layers (with their ancestors) are kept.

    Args:
        layers: ``trace.layers()``.
        metric: ``cpu`` or ``gpu`` time.
        style: ``icicle`` or ``sunburst``.
        rank: the rank to draw (default: the first).
        max_nodes: the most layers drawn.
        unit: time unit of the hover text.
    """
    title = f"Layers by {metric.upper()} time"
    if layers.empty:
        return empty("No layers: record with with_stack=True to see nn.Module names.", title)
    total_col, self_col = f"{metric}_us", f"self_{metric}_us"
    frame, _ = tables.layer_hierarchy(layers, by=total_col, rank=rank, max_nodes=max_nodes)
    div = unit_divisor(unit)
    ids = esc_all(frame["layer"])
    labels = [esc(shorten(name.rsplit(".", 1)[-1] or name, 40)) for name in frame["layer"]]
    kind = go.Icicle if style == "icicle" else go.Sunburst
    custom = hover_columns(
        ids,
        esc_all(frame.get("type", pd.Series("", index=frame.index))),
        frame[total_col] / div,
        frame[self_col] / div,
        frame["calls"].astype(int),
    )
    parents = esc_all(frame["parent"])
    values = np.maximum(frame[self_col].to_numpy(dtype=float), 0.0)
    if parents.count("") > 1:  # several top layers (a model and its loss): a root that says so, not a blank box
        parents = [p or ALL_LAYERS for p in parents]
        ids, labels, values = [*ids, ALL_LAYERS], [*labels, ALL_LAYERS], np.append(values, 0.0)
        parents.append("")
        custom = np.vstack(
            [custom, [ALL_LAYERS, "", float(frame.loc[frame["parent"] == "", total_col].sum()) / div, 0.0, 0]]
        )
    fig = go.Figure(
        kind(
            ids=ids,
            labels=labels,
            parents=parents,
            values=values,
            branchvalues="remainder",
            customdata=custom,
            hovertemplate=f"%{{customdata[0]}} (%{{customdata[1]}})<br>total %{{customdata[2]:.3f}} {unit}"
            f"<br>self %{{customdata[3]:.3f}} {unit}<br>%{{customdata[4]}} calls<extra></extra>",
            maxdepth=6,
            root={"color": "#e8e8e8"},
        )
    )
    return _layout(fig, title, height=520)


# -- Flame ------------------------------------------------------------------------------------
#: the most nodes a flame graph draws (the rest of each parent's children become one "other")
FLAME_MAX_NODES = 1500


def _flame_nodes(tree: pd.DataFrame, size: str, max_nodes: int) -> tuple[pd.DataFrame, int]:
    """The nodes a flame graph draws: those with ``size`` > 0 (GPU nodes too when sized by
    GPU time), the ``max_nodes`` heaviest with their ancestors; each parent's left-out
    children become one ``other`` child holding their total. Returns the nodes (``value``:
    the node's own remainder) and how many were left out."""
    keep = tree[tree[size] > 0]
    if size == "cpu_us":
        keep = keep[~keep["kind"].isin(GPU_ACTIVITY)]
    parent = tree["parent"].to_numpy()
    chosen = np.zeros(len(tree), dtype=bool)
    chosen[keep.sort_values(size, ascending=False, kind="stable")["node"].to_numpy()[:max_nodes]] = True
    at = np.flatnonzero(chosen)
    while at.size:  # ancestors of what is kept
        up = parent[at]
        up = up[(up >= 0) & ~chosen[np.maximum(up, 0)]]
        chosen[up] = True
        at = up
    drawn = tree[chosen].copy()
    own = "self_gpu_us" if size == "gpu_us" else "self_cpu_us"
    up = keep["parent"].to_numpy()
    left = keep[~chosen[keep["node"].to_numpy()] & ((up < 0) | chosen[np.maximum(up, 0)])]  # -1: below the root
    # a drawn node's value: its own time plus what its children that are not drawn hold
    dropped = left.groupby("parent")[size].sum()
    drawn["value"] = np.maximum(drawn[own].to_numpy(dtype=float), 0.0)
    if size == "gpu_us":  # GPU time sits on the GPU nodes: the rest of a node is its non-drawn children
        drawn["value"] = np.where(drawn["kind"].isin(GPU_ACTIVITY), drawn["value"], 0.0)
    others = pd.DataFrame(
        {
            "node": -2 - np.arange(dropped.size),
            "parent": dropped.index.to_numpy(),
            "rank": 0,
            "name": [f"other ({int(c)} nodes)" for c in left.groupby("parent").size().reindex(dropped.index)],
            "kind": "other",
            "cpu_us": 0.0,
            "gpu_us": 0.0,
            "value": dropped.to_numpy(dtype=float),
        }
    )
    if size == "gpu_us":
        others["gpu_us"] = dropped.to_numpy(dtype=float)
    else:
        others["cpu_us"] = dropped.to_numpy(dtype=float)
        others["gpu_us"] = left.groupby("parent")["gpu_us"].sum().reindex(dropped.index).to_numpy(dtype=float)
    out = pd.concat([drawn, others], ignore_index=True) if len(others) else drawn
    return out, int(len(keep) - int(chosen[keep["node"].to_numpy()].sum()))


def _frame_label(name: str, kind: str, file: object, line: object, cells: Mapping[str, int] | None = None) -> str:
    """A box's label: ``func · file.py:LINE`` for Python frames and stack lines (the file's
    base name: absolute paths fill the box; a notebook cell's ``Cell In[3]``), else the
    name, shortened."""
    named = isinstance(file, str) and cells is not None and file in cells  # IPython's <ipython-input-1-...> too
    if kind in ("python", "line") and isinstance(file, str) and file and (named or not file.startswith("<")):
        func = name.rsplit("): ", 1)[-1]
        place = cell_file(file, cells)
        where = (place if place != file else file.rsplit("/", 1)[-1]) + (
            f":{int(line)}" if line is not None and not pd.isna(line) else ""  # type: ignore[call-overload]
        )
        return shorten(f"{func} · {where}", 60)
    return shorten(name, 60)


def flame(
    tree: pd.DataFrame,
    *,
    metric: Literal["cpu", "gpu"] = "cpu",
    max_nodes: int = FLAME_MAX_NODES,
    unit: str = "ms",
    title: str | None = None,
    cells: Mapping[str, int] | None = None,
) -> go.Figure:
    """The merged call tree (``trace.call_tree()``) as an icicle flame graph: the outermost
    frames at the top, each box as wide as its time, coloured by its share of the GPU time
    launched beneath it; click a box to zoom into it, the bar above to zoom out. An
    ``nn.Module`` box is named by the tree's ``layer`` (the Layers tab's name) where it has one,
    its hover keeping torch's instance name (``module BertLayer_0``).

    Args:
        tree: ``trace.call_tree()`` (or ``call_tree(user_only=True)``).
        metric: box widths by ``cpu`` time (kernels, which have none, are left out: their
            time is in the colour) or ``gpu`` time (the kernels at the bottom).
        max_nodes: the most boxes drawn (``FLAME_MAX_NODES``): the heaviest with their
            ancestors; the rest of each parent's children are one ``other`` box, and the
            title says how many were merged.
        unit: time unit of the hover text.
        title: the figure's title (default: says what the widths are).
        cells: notebook cells' files -> execution counts (``trace.cell_numbers``): their
            frames are labelled ``Cell In[3]:LINE``.
    """
    size = f"{metric}_us"
    title = title or f"Call tree by {metric.upper()} time (click a box to zoom)"
    if tree.empty or not (tree[size] > 0).any():
        what = "GPU work" if metric == "gpu" else "CPU events"
        return empty(f"No {what} in the call tree.", title)
    nodes, merged = _flame_nodes(tree, size, max_nodes)
    div = unit_divisor(unit)
    gpu_total = float(tree.loc[tree["parent"] < 0, "gpu_us"].sum())
    share = nodes["gpu_us"].to_numpy(dtype=float) / gpu_total if gpu_total > 0 else np.zeros(len(nodes))
    # one explicit root above the top nodes (plotly's implied one would be drawn dark)
    top = nodes["parent"] < 0
    ids = ["all"] + [str(int(n)) for n in nodes["node"]]
    parents = [""] + ["all" if p < 0 else str(int(p)) for p in nodes["parent"]]
    raw = nodes["name"].astype(str).tolist()
    # an nn.Module box named as the Layers tab names it (the capture's attribute path), where known
    layer = [v if isinstance(v, str) and v else None for v in nodes.get("layer", pd.Series(None, index=nodes.index))]
    names = ["all"] + [lay or n for n, lay in zip(raw, layer)]
    if cells:  # a notebook cell's frame hovers as ``Cell In[3](165): forward``, not its temporary file
        files = nodes.get("file", pd.Series(None, index=nodes.index))
        names = ["all"] + [
            n.replace(f, cell_file(f, cells), 1) if isinstance(f, str) and f in cells else n
            for n, f in zip(names[1:], files)
        ]
    labels = ["all"] + [
        esc(_frame_label(lay or n, k, f, ln, cells))
        for n, lay, k, f, ln in zip(
            raw,
            layer,
            nodes["kind"].astype(str),
            nodes.get("file", pd.Series(None, index=nodes.index)),
            nodes.get("line", pd.Series(None, index=nodes.index)),
        )
    ]
    # the hover's kind of a named layer keeps the trace's instance name: ``module BertLayer_0``
    kinds = ["all"] + [
        f"{k} {n.removeprefix(MODULE_PREFIX)}" if lay else k for k, n, lay in zip(nodes["kind"].astype(str), raw, layer)
    ]
    cpu = np.append(nodes.loc[top, "cpu_us"].sum(), nodes["cpu_us"].to_numpy(dtype=float))
    gpu = np.append(gpu_total, nodes["gpu_us"].to_numpy(dtype=float))
    share = np.append(0.0, share)
    custom = hover_columns(
        esc_all(names),
        esc_all(kinds),
        cpu / div,
        gpu / div,
        gpu / gpu_total * 100.0 if gpu_total > 0 else np.zeros(len(ids)),
    )
    values = np.append(0.0, nodes["value"].to_numpy(dtype=float))
    fig = go.Figure(
        go.Icicle(
            ids=ids,
            labels=labels,
            parents=parents,
            values=values,
            branchvalues="remainder",
            customdata=custom,
            marker={
                "colors": share,
                "colorscale": "YlOrRd",
                "cmin": 0.0,
                "cmax": max(float(share.max(initial=0.0)), 1e-9),
                "showscale": gpu_total > 0,
                "colorbar": {"title": {"text": "GPU share"}, "tickformat": ".0%"},
            },
            hovertemplate=f"%{{customdata[0]}} (%{{customdata[1]}})<br>CPU %{{customdata[2]:.3f}} {unit}"
            f"<br>GPU %{{customdata[3]:.3f}} {unit} (%{{customdata[4]:.1f}}% of the GPU time)<extra></extra>",
            tiling={"orientation": "v"},
            maxdepth=12,
            root={"color": "#e8e8e8"},
        )
    )
    if merged:
        title = f"{title}; {merged:,} smaller boxes merged, one other box per parent"
    fig = _layout(fig, title, height=560)
    if gpu_total > 0:  # room for the colour bar (plotly widens the margin to 126 px: a second draw)
        fig.update_layout(margin={"r": 130})
    return fig


# -- Timeline ---------------------------------------------------------------------------------
def timeline(
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    steps: pd.DataFrame | None = None,
    *,
    step: int | None = None,
    window: tuple[float, float] | None = None,
    origin: float | None = None,
    max_events: int = 3000,
    bins: int = 200,
    unit: str = "ms",
    thread_names: Mapping[tuple[int, str], str] | None = None,
    spans: pd.DataFrame | None = None,
    phase_spans: pd.DataFrame | None = None,
) -> go.Figure:
    """Steps, phases, layers, CPU ops (per rank and thread) and GPU work (per rank and stream) on a
    time axis.

    Draws ``selection.timeline_events``: each lane's longest events in the window
    (``max_events`` over all lanes) and, for the rest, busy-time bins (one bar per bin,
    colored by how busy the lane was), so a window of millions of events is drawn in a
    fraction of a second.

    Args:
        ops: ``trace.ops()``.
        kernels: ``trace.kernels()`` (None or empty for a CPU-only trace).
        steps: ``trace.steps()``, drawn as a lane and used to find ``step``'s window.
        step: show only this step's time window.
        window: (start, end) in µs since the trace start; overrides ``step``.
        origin: the time (µs since the trace start) the x axis counts from (default: the
            window's start). A zoomed view keeps the origin of the view it zooms into, so
            its x values stay comparable.
        max_events: the most individual events drawn.
        bins: busy-time bins per lane for the events not drawn individually.
        unit: time unit of the x axis.
        thread_names: (rank, thread id) -> lane name (default ``thread <id>``).
        spans: ``layer_spans()`` (``rank, layer, phase, ts, dur``): a ``layers`` lane per
            rank, under its steps, with a bar per forward or backward span of a top-level
            layer; None or empty: no lane.
        phase_spans: ``phase_spans()``: a ``phases`` lane per rank, under its steps (data
            loading, forward, backward, optimizer); None or empty: no lane.

    Returns:
        Horizontal ``Bar`` traces, one per event kind, plus ``aggregated`` bins when needed.
        ``layout.meta`` holds ``{"shown": n, "total": n, "window": [lo, hi], "origin": t}``.
    """
    events = timeline_events(
        ops,
        kernels,
        steps,
        step=step,
        window=window,
        max_events=max_events,
        bins=bins,
        thread_names=thread_names,
        spans=spans,
        phase_spans=phase_spans,
    )
    lo, hi = events.attrs["window"]
    origin = lo if origin is None else float(origin)
    div = unit_divisor(unit)
    title = "Timeline" + (f" — step {step}" if step is not None and window is None else "")
    if events.empty:
        return empty("No events in this window.", title)
    lanes: list[str] = events.attrs["lanes"]
    total: int = events.attrs["total"]
    label = {lane: esc(shorten(lane, 48)) for lane in lanes}
    aggregated = events["kind"] == "aggregated"
    agg, shown = events[aggregated], events[~aggregated]
    fig = go.Figure()
    if not agg.empty:  # drawn first: below the individual events
        fig.add_bar(
            orientation="h",
            name="aggregated",
            y=[label[lane] for lane in agg["lane"]],
            base=(agg["ts"].to_numpy() - origin) / div,
            x=agg["dur"].to_numpy() / div,
            marker_color=[f"rgba(90,90,90,{0.15 + 0.75 * b:.2f})" for b in agg["busy"]],
            customdata=np.stack([agg["count"], 100 * agg["busy"]], axis=-1),
            hovertemplate="%{customdata[0]} short events<br>busy %{customdata[1]:.0f}%<extra>aggregated</extra>",
        )
    # outer events first, nested ones drawn on top of them and narrower (a flame graph per lane)
    draw_order = {
        "step": 0,
        "phase dataloader": 0.1,
        "phase forward": 0.2,
        "phase backward": 0.3,
        "phase optimizer": 0.4,
        "layer forward": 1,
        "layer backward": 2,
        "user_annotation": 3,
        "cpu_op": 4,
    }
    kinds = sorted(shown["kind"].unique(), key=lambda k: (draw_order.get(k, 5), k))
    for kind in kinds:
        group = shown[shown["kind"] == kind].sort_values(["depth", "ts"], kind="stable")
        named = (
            {
                "text": [esc(shorten(n.rsplit(".", 1)[-1], 24)) for n in group["name"]],
                "textposition": "inside",
                "insidetextanchor": "middle",
                "textangle": 0,
                "textfont": {"size": 10},
            }
            if kind.startswith(("layer ", "phase "))
            else {}
        )
        fig.add_bar(
            orientation="h",
            name=esc(kind),
            showlegend=not kind.startswith("phase "),  # its bars say their phase: no legend to cover the plot
            width=0.8 * 0.8 ** np.clip(group["depth"].to_numpy(dtype=float), 0, 6),
            y=[label[lane] for lane in group["lane"]],
            base=(group["ts"].to_numpy(dtype=float) - origin) / div,
            x=group["dur"].to_numpy(dtype=float) / div,
            marker_color=KIND_COLORS.get(kind, "#bcbd22"),
            customdata=hover_columns(
                esc_all(s[:120] for s in group["name"]), esc_all(group["info"]), group["dur"] / div
            ),
            hovertemplate=f"%{{customdata[0]}}<br>%{{customdata[2]:.3f}} {unit}<br>%{{customdata[1]}}<extra></extra>",
            **named,
        )
    fig.update_layout(
        barmode="overlay",
        uniformtext={"minsize": 8, "mode": "hide"},
        meta={"shown": int(len(shown)), "total": int(total), "window": [lo, hi], "origin": origin},
        yaxis={"categoryorder": "array", "categoryarray": [label[lane] for lane in lanes], "autorange": "reversed"},
    )
    # what was left out is said in the axis title: a note of its own under the axis would overlap it
    note = f" · {len(shown):,} of {total:,} events drawn, the rest in grey bins" if len(shown) < total else ""
    _layout(fig, title, f"time since window start ({unit}){note}", None, height=max(300, 34 * len(lanes) + 120))
    return fig


# -- Memory -----------------------------------------------------------------------------------
def _downsample_extremes(frame: pd.DataFrame, column: str, max_points: int) -> pd.DataFrame:
    """At most ~``max_points`` rows: each bin's first, min and max rows (peaks survive)."""
    if len(frame) <= max_points:
        return frame
    nbins = max(max_points // 4, 1)
    pos = np.arange(len(frame)) * nbins // len(frame)
    values = np.nan_to_num(frame[column].to_numpy(dtype=float), nan=0.0)
    order = np.lexsort((values, pos))  # by bin, then value
    starts = np.searchsorted(pos[order], np.arange(nbins))
    ends = np.append(starts[1:], len(order)) - 1
    first = np.searchsorted(pos, np.arange(nbins))
    last = np.append(first[1:], len(pos)) - 1
    keep = np.unique(np.concatenate([order[starts], order[ends], first, last]))
    return frame.iloc[keep]


def _byte_scale(peak: float) -> tuple[float, str]:
    return (1024**3, "GiB") if peak >= 1024**3 else (1024**2, "MiB") if peak >= 1024**2 else (1024, "KiB")


#: colors of layer spans (cycled per layer)
LAYER_COLORS = (
    "#4c78a8",
    "#f58518",
    "#54a24b",
    "#e45756",
    "#72b7b2",
    "#b279a2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
    "#eeca3b",
)
#: colors of the allocation categories of torch's memory profile
CATEGORY_COLORS = {
    "before_capture": "#d9d9d9",
    "parameter": "#4c78a8",
    "optimizer_state": "#9d755d",
    "input": "#72b7b2",
    "temporary": "#bab0ac",
    "activation": "#f58518",
    "gradient": "#54a24b",
    "autograd_detail": "#b279a2",
    "unknown": "#e45756",
}


def _spans_in(
    spans: pd.DataFrame | None, lo: float, hi: float, rank: int | None, step: int | None, max_spans: int
) -> pd.DataFrame:
    """The layer spans to draw: in ``[lo, hi]`` (and ``step``, ``rank``), the longest ``max_spans``."""
    if spans is None or spans.empty:
        return pd.DataFrame(columns=["rank", "layer", "phase", "ts", "dur", "step", "calls"])
    if rank is not None:
        spans = spans[spans["rank"] == rank]
    spans = tables.select_step(spans, step)
    end = spans["ts"] + spans["dur"]
    spans = spans[(end >= lo) & (spans["ts"] <= hi)]
    if len(spans) > max_spans:
        spans = spans.nlargest(max_spans, "dur").sort_values("ts", kind="stable")
    return spans


#: the left margin of both memory charts (px), so their time axes line up
MEMORY_LEFT_MARGIN = 110


def memory_timeline(
    memory: pd.DataFrame,
    steps: pd.DataFrame | None = None,
    *,
    spans: pd.DataFrame | None = None,
    step: int | None = None,
    rank: int | None = None,
    max_points: int = 3000,
    max_spans: int = 400,
    unit: str = "ms",
    peaks: pd.DataFrame | None = None,
) -> go.Figure:
    """Allocated (solid) and reserved (dotted) bytes over time per device, step boundaries
    as vertical lines, each device's peak marked with the op and layer that reached it
    (given ``peaks``), and (given ``spans``) a lane under the curve with the top-level
    layers' forward and backward spans.

    Args:
        memory: ``trace.memory()``.
        steps: ``trace.steps()`` for the step boundaries.
        spans: ``layer_spans()`` (``rank, layer, phase, ts, dur, step``); None: no lane.
        step: only this step's events.
        rank: only this rank (default: every rank, one line per rank and device).
        max_points: the most points per line (each bin keeps its min and max).
        max_spans: the most layer spans drawn (the longest ones).
        unit: time unit of the x axis (time since the trace start).
        peaks: ``trace.memory_peaks()``: the peaks of ``step`` (of the whole trace for
            None) are marked; None marks none.
    """
    title = "Memory" + (f" — step {step}" if step is not None else "")
    if rank is not None:
        memory = memory[memory["rank"] == rank]
        steps = steps[steps["rank"] == rank] if steps is not None and not steps.empty else steps
    memory = tables.select_step(memory, step)
    if memory.empty:
        return empty("No memory events: record with profile_memory=True.", title)
    div = unit_divisor(unit)
    scale, suffix = _byte_scale(float(memory[["allocated_bytes", "reserved_bytes"]].max().max() or 0))
    several = memory["rank"].nunique() > 1
    lane = _spans_in(
        spans,
        float(memory["ts"].min()),
        float(memory["ts"].max()),
        rank if rank is not None else (None if several else int(memory["rank"].iloc[0])),
        step,
        max_spans,
    )
    if not lane.empty:
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.82, 0.18], vertical_spacing=0.03)
    else:
        fig = go.Figure()
    row = {"row": 1, "col": 1} if not lane.empty else {}
    for (rank_, device), group in memory.sort_values("ts").groupby(["rank", "device"], observed=True, sort=True):
        label = esc(f"rank {rank_} · {device}" if several else f"{device}")
        small = _downsample_extremes(group, "allocated_bytes", max_points)
        fig.add_scatter(
            name=f"{label} allocated",
            x=small["ts"].to_numpy(dtype=float) / div,
            y=small["allocated_bytes"].to_numpy(dtype=float) / scale,
            mode="lines",
            line={"shape": "hv"},
            customdata=hover_columns(
                esc_all(small["op"].astype("string").fillna("")), esc_all(small["layer"].astype("string").fillna(""))
            ),
            hovertemplate=f"%{{y:.2f}} {suffix}<br>%{{customdata[0]}}<br>%{{customdata[1]}}<extra>{label}</extra>",
            **row,
        )
        if group["reserved_bytes"].notna().any() and (group["reserved_bytes"] > 0).any():
            small_r = _downsample_extremes(group, "reserved_bytes", max_points)
            fig.add_scatter(
                name=f"{label} reserved",
                x=small_r["ts"].to_numpy(dtype=float) / div,
                y=small_r["reserved_bytes"].to_numpy(dtype=float) / scale,
                mode="lines",
                line={"shape": "hv", "dash": "dot"},
                hovertemplate=f"reserved %{{y:.2f}} {suffix}<extra>{label}</extra>",
                **row,
            )
    marked = pd.DataFrame() if peaks is None or peaks.empty else tables.peaks_of(peaks, step)
    if rank is not None and not marked.empty:
        marked = marked[marked["rank"] == rank]
    first, last = float(memory["ts"].min()), float(memory["ts"].max())
    for _, peak in marked.iterrows():
        where = " in ".join(esc(shorten(v, 50)) for v in (peak["op"], peak["layer"]) if isinstance(v, str) and v)
        at = (float(peak["ts"]) - first) / (last - first) if last > first else 0.5
        fig.add_annotation(  # its text runs into the plot, not off its left or right edge
            x=float(peak["ts"]) / div,
            y=float(peak["peak_bytes"]) / scale,
            xref="x",
            yref="y",
            text=f"peak {fmt_bytes(peak['peak_bytes'])}" + (f": {where}" if where else ""),
            showarrow=True,
            arrowhead=2,
            ax=0,
            ay=-30,
            xanchor="left" if at < 0.3 else "right" if at > 0.7 else "center",
        )
    if not lane.empty:
        names = list(dict.fromkeys(lane["layer"].astype(str)))
        color = {n: LAYER_COLORS[i % len(LAYER_COLORS)] for i, n in enumerate(names)}
        for phase in ("forward", "backward"):
            part = lane[lane["phase"] == phase]
            if part.empty:
                continue
            layer_names = part["layer"].astype(str).tolist()
            fig.add_bar(
                orientation="h",
                name=f"layer {phase}",
                showlegend=False,
                y=[phase] * len(part),
                base=part["ts"].to_numpy(dtype=float) / div,
                x=part["dur"].to_numpy(dtype=float) / div,
                marker={
                    "color": [color[n] for n in layer_names],
                    "opacity": 0.85 if phase == "forward" else 0.55,
                    "line": {"width": 0},
                },
                text=[esc(shorten(n.rsplit(".", 1)[-1], 24)) for n in layer_names],
                textposition="inside",
                insidetextanchor="middle",
                textfont={"size": 10},
                customdata=hover_columns(
                    esc_all(layer_names),
                    part["dur"].to_numpy(dtype=float) / div,
                    part["calls"].to_numpy() if "calls" in part else np.ones(len(part)),
                ),
                hovertemplate=f"%{{customdata[0]}} ({phase})<br>%{{customdata[1]:.3f}} {unit}<extra></extra>",
                row=2,
                col=1,
            )
        # no legend entry per layer: each bar says its layer (inside, and on hover), and a
        # legend of layers beside the curve's would push the plot off the category chart's axis
        fig.update_layout(barmode="overlay", uniformtext={"minsize": 8, "mode": "hide"})
        fig.update_yaxes(
            categoryorder="array",
            categoryarray=["forward", "backward"],
            autorange="reversed",
            row=2,
            col=1,
            showgrid=False,
            title_text="layers",
        )
    if steps is not None and not steps.empty:
        bounds = sorted(set(steps["ts"].tolist()))
        if step is not None:
            bounds = [float(t) for t in steps.loc[steps["step"] == step, "ts"]]
        # one layout update: add_vline per boundary is quadratic in plotly
        fig.update_layout(
            shapes=[
                {
                    "type": "line",
                    "xref": "x",
                    "yref": "paper",
                    "x0": float(t) / div,
                    "x1": float(t) / div,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": "#aaaaaa", "width": 1, "dash": "dash"},
                }
                for t in bounds[:200]
            ]
        )
    fig = _layout(fig, title, None, None, height=480 if not lane.empty else 420)
    fig.update_yaxes(title_text=f"memory ({suffix})", **row)
    fig.update_xaxes(title_text=f"time since trace start ({unit})", **({"row": 2, "col": 1} if not lane.empty else {}))
    # the x range is the events' (a step boundary or a span outside it does not widen it), shared
    # with the category chart under it (``memory_categories(x_range=...)``), whose margins are the same
    pad = 0.01 * (float(memory["ts"].max()) - float(memory["ts"].min()))  # the last step of the curve off the edge
    x_range = [(float(memory["ts"].min()) - pad) / div, (float(memory["ts"].max()) + pad) / div]
    if x_range[1] > x_range[0]:
        fig.update_xaxes(range=x_range)
    fig.update_layout(
        margin={"l": MEMORY_LEFT_MARGIN},
        meta={"spans": int(len(lane)), "spans_total": int(0 if spans is None else len(spans)), "x_range": x_range},
    )
    return fig


def memory_categories(
    categories: pd.DataFrame,
    steps: pd.DataFrame | None = None,
    *,
    step: int | None = None,
    rank: int | None = None,
    max_points: int = 2000,
    unit: str = "ms",
    x_range: Sequence[float] | None = None,
) -> go.Figure:
    """Memory stacked by allocation category (parameter, optimizer state, activation,
    gradient, ...) over time, from ``trace.memory_categories()``.

    Args:
        categories: ``trace.memory_categories()``.
        steps: ``trace.steps()``, for ``step``'s window.
        step: only this step's time window.
        rank: the rank drawn (default: the lowest); one device (the first).
        max_points: the most points drawn (each bin keeps the extremes of the total).
        unit: time unit of the x axis.
        x_range: the x axis' range (``unit`` since the trace start), to line up with the
            memory curve above it (its ``layout.meta["x_range"]``); None: the samples'.
    """
    title = "Memory by category" + (f" — step {step}" if step is not None else "")
    if categories is None or categories.empty:
        note = (
            categories.attrs.get("note") if categories is not None else None
        ) or "No memory profile by category: capture with the memory timeline on (memory_timeline_<rank>.json)."
        return empty(note, title)
    frame = categories
    rank = int(frame["rank"].min()) if rank is None else rank
    frame = frame[frame["rank"] == rank]
    if "device" in frame and len(frame):
        frame = frame[frame["device"] == frame["device"].iloc[0]]
    if step is not None and steps is not None and not steps.empty:
        rows = (
            steps[(steps["step"] == step) & (steps["rank"] == rank)]
            if "rank" in steps
            else steps[steps["step"] == step]
        )
        if not rows.empty:
            lo, hi = float(rows["ts"].min()), float((rows["ts"] + rows["dur"]).max())
            frame = frame[(frame["ts"] >= lo) & (frame["ts"] <= hi)]
    if frame.empty:
        return empty("No memory profile samples in this window.", title)
    frame = _downsample_extremes(frame.sort_values("ts", kind="stable"), "total_bytes", max_points)
    names = [c for c in (categories.attrs.get("categories") or CATEGORY_COLORS) if c in frame]
    scale, suffix = _byte_scale(float(frame["total_bytes"].max() or 0))
    div = unit_divisor(unit)
    fig = go.Figure()
    x = frame["ts"].to_numpy(dtype=float) / div
    for name in names:
        values = frame[name].to_numpy(dtype=float)
        if not np.nansum(values) > 0:
            continue
        fig.add_scatter(
            name=esc(name.replace("_", " ")),
            x=x,
            y=values / scale,
            mode="lines",
            stackgroup="categories",
            line={"shape": "hv", "width": 0.5, "color": CATEGORY_COLORS.get(name)},
            hovertemplate=f"{esc(name.replace('_', ' '))}: %{{y:.2f}} {suffix}<extra></extra>",
        )
    clock = categories.attrs.get("clock")
    fig = _layout(fig, title, f"time since trace start ({unit})", f"memory ({suffix})")
    fig.update_layout(margin={"l": MEMORY_LEFT_MARGIN})
    if x_range is not None and len(x_range) == 2 and x_range[1] > x_range[0] and clock != "own":
        fig.update_xaxes(range=[float(x_range[0]), float(x_range[1])])
    if clock == "own":
        fig.add_annotation(
            text="the memory profile's clock could not be matched to the trace: its time starts at 0",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0,
            y=-0.2,
            xanchor="left",
            font={"size": 11},
        )
    return fig


# -- Shapes -----------------------------------------------------------------------------------
def shapes_bar(shapes: pd.DataFrame, *, top: int = 20, unit: str = "ms", metric: str = "total_us") -> go.Figure:
    """Horizontal bars of the ``top`` (op, input shapes, dtypes) rows by ``metric`` (ties in
    the frame's order)."""
    title = "Ops by input shape" + (", by GPU time" if metric == "gpu_us" else "")
    if shapes.empty:
        return empty("No input shapes: record with record_shapes=True.", title)
    div = unit_divisor(unit)
    table = shapes.sort_values(metric, ascending=False, kind="stable").head(top)
    labels = unique_labels(
        esc(shorten(f"{n} {d}".strip(), 70))
        for n, d in zip(table["name"].astype(str), table["input_dims"].astype("string").fillna(""))
    )[::-1]
    table = table.iloc[::-1]
    rates = table["tflops_per_s"].astype(float) if "tflops_per_s" in table else pd.Series(np.nan, index=table.index)
    flops = ["n/a" if not np.isfinite(v) else f"{v:.3g} TFLOP/s" for v in rates]  # unknown FLOPs are not 0
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=labels,
            x=table[metric].to_numpy(dtype=float) / (div if metric.endswith("_us") else 1),
            customdata=hover_columns(
                esc_all(table["name"]),
                esc_all(table["input_dims"]),
                esc_all(map(fmt_dtypes, table["input_type"])),
                table["calls"].astype(int),
                flops,
            ),
            hovertemplate="%{customdata[0]}<br>shapes %{customdata[1]}<br>types %{customdata[2]}"
            f"<br>%{{customdata[3]}} calls, %{{x:.3f}} {unit}{' GPU' if metric == 'gpu_us' else ''}"
            "<br>%{customdata[4]}<extra></extra>",
            marker_color=KIND_COLORS["cpu_op"],
        )
    )
    name = "GPU" if metric == "gpu_us" else metric.removesuffix("_us").replace("_", " ")
    axis = f"{name} ({unit})" if metric.endswith("_us") else metric
    return _layout(fig, title, axis, None, height=max(300, 24 * len(table) + 100))


# -- Roofline ---------------------------------------------------------------------------------
BOUND_COLORS = {"compute": "#d62728", "memory": "#1f77b4"}


def roofline(efficiency: pd.DataFrame, *, top: int = 200, unit: str = "ms") -> go.Figure:
    """Log-log roofline: arithmetic intensity (FLOP/byte) against achieved TFLOP/s, one point
    per op × shape (``trace.efficiency()`` rows with both figures), sized by GPU time,
    colored by bound, under each device roof ``min(peak TFLOP/s, intensity × TB/s)``.
    Hover shows the op, shapes, dtypes, layers (``efficiency.attrs['layers']``), the user code
    that called it (``attrs['where']``, joined by ``views.data``) and the %
    of the roof. The ``top`` rows by GPU time are drawn."""
    title = "Roofline: achieved FLOP/s against arithmetic intensity"
    if efficiency.empty:
        return empty("No op ran on a GPU with recorded shapes: record with record_shapes=True on a GPU.", title)
    layers = list(efficiency.attrs.get("layers") or [""] * len(efficiency))
    where = list(efficiency.attrs.get("where") or [""] * len(efficiency))  # the views' join (analysis.sites)
    frame = efficiency.assign(
        _layers=layers if len(layers) == len(efficiency) else [""] * len(efficiency),
        _where=where if len(where) == len(efficiency) else [""] * len(efficiency),
    )
    frame = frame[(frame["intensity"] > 0) & (frame["tflops_per_s"] > 0)]
    if frame.empty:
        return empty("No op here has both FLOPs and bytes from its shapes (see trace.efficiency()).", title)
    frame = frame.sort_values("gpu_us", ascending=False, kind="stable").head(top)
    div = unit_divisor(unit)
    fig = go.Figure()
    lo = float(frame["intensity"].min()) / 4
    hi = float(frame["intensity"].max()) * 4
    roofs = frame[["device", "peak_tflops", "peak_tbytes_per_s"]].drop_duplicates().dropna(subset=["peak_tbytes_per_s"])
    if roofs["peak_tflops"].notna().any():  # integer ops have no compute peak: the float roofs are drawn
        roofs = roofs.dropna(subset=["peak_tflops"])
    for i, roof in enumerate(roofs.itertuples()):
        peak, bandwidth = float(roof.peak_tflops), float(roof.peak_tbytes_per_s)
        ridge = peak / bandwidth if peak == peak else hi
        xs = np.array([min(lo, ridge / 4), ridge, max(hi, ridge * 4)]) if peak == peak else np.array([lo, hi])
        ys = np.minimum(peak, xs * bandwidth) if peak == peak else xs * bandwidth
        precision = _roof_precision(roof.device, peak)
        label = (
            f"{roof.device or 'given peaks'}"
            + (f" {precision}" if precision else "")
            + f" roof: {bandwidth:g} TB/s"
            + (f", {_flops_text(peak * 1e12)}" if peak == peak else "")
        )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                name=esc(label),
                line={"color": "#444", "width": 1.5, "dash": ROOF_DASHES[i % len(ROOF_DASHES)]},
                hovertemplate=esc(label) + "<extra></extra>",
            )
        )
    sizes = frame["gpu_us"].to_numpy(dtype=float)
    marker = 8 + 32 * np.sqrt(sizes / max(float(sizes.max()), 1e-9))
    for bound in ("compute", "memory", None):
        part = frame[frame["bound"].astype("string").fillna("unknown") == (bound or "unknown")]
        if part.empty:
            continue
        pct = [
            "n/a" if v != v else "<1% of its roof" if 0 < v < 0.5 else f"{v:.0f}% of its roof"
            for v in part["pct_of_roofline"].astype(float)
        ]
        rates = ["n/a" if v != v else _flops_text(v * 1e12) for v in part["tflops_per_s"].astype(float)]
        fig.add_trace(
            go.Scatter(
                x=part["intensity"],
                y=part["tflops_per_s"],
                mode="markers",
                name=f"{bound or 'unknown'}-bound",
                marker={
                    "size": marker[frame.index.get_indexer(part.index)],
                    "color": BOUND_COLORS.get(bound or "", "#7f7f7f"),
                    "opacity": 0.7,
                    "line": {"width": 0.5, "color": "#333"},
                },
                customdata=hover_columns(
                    esc_all(part["name"]),
                    esc_all(part["input_dims"]),
                    esc_all(map(fmt_dtypes, part["input_type"])),
                    esc_all(part["_layers"].replace("", "none")),
                    part["gpu_us"].to_numpy(dtype=float) / div,
                    part["calls"].astype(int),
                    pct,
                    esc_all(part["_where"].replace("", "unknown")),
                    rates,
                ),
                hovertemplate="%{customdata[0]}<br>shapes %{customdata[1]}<br>types %{customdata[2]}"
                "<br>layer %{customdata[3]}<br>code %{customdata[7]}<br>%{customdata[5]} calls, %{customdata[4]:.3f} "
                + unit
                + "<br>%{x:.3g} FLOP/byte, %{customdata[8]}, %{customdata[6]}<extra></extra>",
            )
        )
    fig = _layout(fig, title, "arithmetic intensity (FLOP/byte)", "achieved FLOP/s", height=480)
    fig.update_xaxes(type="log")
    # one tick per decade, in words (1 GFLOP/s, 10 TFLOP/s): plotly's SI ticks of TFLOP/s read "100µ"
    values = np.concatenate([frame["tflops_per_s"].to_numpy(dtype=float), roofs["peak_tflops"].to_numpy(dtype=float)])
    values = values[np.isfinite(values) & (values > 0)]
    low, high = int(np.floor(np.log10(values.min()))), int(np.ceil(np.log10(values.max())))
    ticks = [10.0**k for k in range(low, high + 1)]
    text = [_flops_text(t * 1e12) for t in ticks]
    fig.update_yaxes(type="log", tickvals=ticks, ticktext=text)
    fig.update_layout(margin={"l": tick_margin(text, title=True)})
    return fig


#: line styles of the roofs (a device has one per precision drawn)
ROOF_DASHES = ("solid", "dash", "dot", "dashdot")
_FLOP_PREFIXES = ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1e3, "kFLOP/s"))


def _flops_text(flops_per_s: float) -> str:
    """A rate in FLOP/s with its SI prefix: ``1.2e11`` -> ``120 GFLOP/s``."""
    for factor, name in _FLOP_PREFIXES:
        if flops_per_s >= factor:
            return f"{flops_per_s / factor:.3g} {name}"
    return f"{flops_per_s:.3g} FLOP/s"


def _roof_precision(device: Any, peak: float) -> str:
    """The precision(s) whose datasheet peak ``peak`` is on ``device`` (``TF32``,
    ``FP64/FP32``), or '' for peaks given by the user or a device not in the table."""
    if not isinstance(device, str) or peak != peak:
        return ""
    for row in devices.PEAKS:
        if row.name == device:
            return "/".join(p.upper() for p in devices.PRECISIONS if getattr(row, p) == peak)
    return ""


# -- Kernels ----------------------------------------------------------------------------------
def top_kernels_bar(kernels: pd.DataFrame, *, top: int = 15, by_op: bool = False, unit: str = "ms") -> go.Figure:
    """Horizontal bars of the ``top`` kernels by total GPU time (by kernel, or kernel + op)."""
    title = f"Top {top} kernels" + (" with their launching op" if by_op else "") + " by GPU time"
    table = tables.top_kernels(kernels, top, by_op=by_op)
    if table.empty:
        return empty("No GPU kernels in this trace.", title)
    div = unit_divisor(unit)
    names = [
        (kernel_label(n, 50 if by_op else 60) if k == "kernel" else shorten(n, 60))
        + (f" ← {shorten(o, 30)}" if by_op and o else "")
        for n, k, o in zip(table["name"], table["kind"], table.get("op", [""] * len(table)))
    ]
    labels = unique_labels(esc(n) for n in names)[::-1]
    table = table.iloc[::-1]
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=labels,
            x=table["total_us"].to_numpy(dtype=float) / div,
            marker_color=[KIND_COLORS.get(k, "#2ca02c") for k in table["kind"]],
            customdata=hover_columns(esc_all(table["name"]), table["calls"].astype(int), table["pct"]),
            hovertemplate=f"%{{customdata[0]}}<br>%{{x:.3f}} {unit} (%{{customdata[2]:.1f}}% of GPU time)"
            "<br>%{customdata[1]} calls<extra></extra>",
        )
    )
    return _layout(fig, title, f"GPU time ({unit})", None, height=max(300, 24 * len(table) + 100))


# -- Ranks ------------------------------------------------------------------------------------
def rank_breakdown(ranks: pd.DataFrame, *, unit: str = "ms") -> go.Figure:
    """Stacked bar per rank of the mean step's parts (the same parts and colors as
    :func:`step_breakdown`), the straggler (``slowest``: the rank the others wait for,
    often the one with the *shortest* step) labelled."""
    title = "Per-rank breakdown (mean step)"
    if ranks.empty:
        return empty("No ranks.", title)
    div = unit_divisor(unit)
    ranks = ranks.sort_values("rank")
    slow = ranks["slowest"].astype(bool).to_numpy() if "slowest" in ranks else np.zeros(len(ranks), bool)
    labels = [f"rank {int(r)}" + (" (straggler)" if s else "") for r, s in zip(ranks["rank"], slow)]
    fig = go.Figure()
    parts = tables.part_names(ranks)
    for column, name in parts.items():
        if column in ranks and (ranks[column] > 0).any():
            fig.add_bar(
                name=name,
                x=labels,
                y=ranks[column].to_numpy(dtype=float) / div,
                marker_color=PART_COLORS[column],
                hovertemplate=f"%{{x}}<br>{name} %{{y:.3f}} {unit}<extra></extra>",
            )
    other = ranks["step_us"] - sum(ranks[c] for c in parts if c in ranks)
    if (other > 1e-6 * ranks["step_us"].abs().max()).any():
        fig.add_bar(
            name="other",
            x=labels,
            y=np.maximum(other.to_numpy(dtype=float), 0) / div,
            marker_color="#7f7f7f",
            hovertemplate=f"%{{x}}<br>other %{{y:.3f}} {unit}<extra></extra>",
        )
    fig.update_layout(barmode="stack", legend_traceorder="normal")
    for label, is_slow, total in zip(labels, slow, ranks["step_us"]):
        if is_slow:
            fig.add_annotation(
                x=label,
                y=float(total) / div,
                text="the others wait for it",
                showarrow=True,
                arrowhead=2,
                ay=-30,
                font={"color": "#d62728"},
            )
    return _layout(fig, title, "rank", f"mean step time ({unit})")


def rank_step_heatmap(steps: pd.DataFrame, *, unit: str = "ms", column: str = "window_dur") -> go.Figure:
    """Rank × step heatmap of ``column`` (step time by default: the device window, as the
    Ranks breakdown and ``ranks()``'s ``step_us``)."""
    title = "Step time per rank and step"
    if steps.empty:
        return empty("No ProfilerStep in this trace.", title)
    div = unit_divisor(unit)
    grid = steps.pivot_table(index="rank", columns="step", values=column, aggfunc="sum") / div
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(dtype=float),
            x=[step_name(s) for s in grid.columns],
            y=[f"rank {int(r)}" for r in grid.index],
            colorscale="Reds",
            colorbar={"title": {"text": unit}},
            hovertemplate=f"%{{y}} %{{x}}<br>%{{z:.3f}} {unit}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    fig = _layout(fig, title, "step", "rank", height=max(260, 28 * len(grid) + 140))
    # the rank names and the colour bar on the right (plotly widens 32 px to 94): drawn once
    fig.update_layout(margin={"l": tick_margin(fig.data[0].y, title=True), "r": 110})
    return fig


# -- Execution Trace graph --------------------------------------------------------------------
def _graph_levels(ids: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Topological depth of each node (longest path from a node without inputs).

    ET node ids grow in execution order, so producers come before consumers: one pass in
    id order settles every level. An edge against that order (none in a well-formed ET) is
    drawn but does not move its target.
    """
    pos = {int(i): k for k, i in enumerate(ids)}
    level = np.zeros(len(ids), dtype=np.int64)
    pairs = sorted((pos[int(s)], pos[int(d)]) for s, d in zip(src, dst) if int(s) in pos and int(d) in pos)
    by_dst: dict[int, list[int]] = {}
    for s, d in pairs:
        if s < d:
            by_dst.setdefault(d, []).append(s)
    for d in range(len(ids)):
        for s in by_dst.get(d, ()):
            level[d] = max(level[d], level[s] + 1)
    return level


def op_graph(
    nodes: pd.DataFrame,
    edges: pd.DataFrame,
    *,
    step: int | None = None,
    max_nodes: int = 300,
    unit: str = "ms",
) -> go.Figure:
    """The Execution Trace's operator graph as a layered DAG: one column per topological
    depth (an op sits one column right of the latest op whose output it reads), data
    dependencies as lines, ops colored by their Kineto duration.

    Args:
        nodes: ``et_graph(...)[0]`` (``id, name, op_schema, input_shapes, input_types,
            output_shapes, output_types, dur``, ...).
        edges: ``et_graph(...)[1]`` (``src, dst, tensor, bytes``).
        step: the ProfilerStep shown (for the title).
        max_nodes: the most ops drawn: the first ones in execution order (a prefix of the
            graph, so every edge drawn joins two drawn ops); a note says how many were left out.
        unit: time unit of the durations.

    Returns:
        A line trace ``dependencies`` and marker traces ``ops`` (with Kineto timing) and
        ``ops without timing``. ``layout.meta``: ``{"shown", "total", "edges", "levels"}``.
    """
    title = "Execution Trace op graph" + (f" — step {step}" if step is not None else "")
    if nodes is None or nodes.empty:
        return empty("The Execution Trace has no operators here.", title)
    total = len(nodes)
    nodes = nodes.sort_values("id", kind="stable").head(max_nodes).reset_index(drop=True)
    ids = nodes["id"].to_numpy(dtype=np.int64)
    kept = set(ids.tolist())
    edges = edges[edges["src"].isin(kept) & edges["dst"].isin(kept)] if not edges.empty else edges
    level = (
        _graph_levels(ids, edges["src"].to_numpy(), edges["dst"].to_numpy())
        if len(edges)
        else np.zeros(len(ids), np.int64)
    )
    # rows within a column: in execution order, centered on 0
    ypos = np.zeros(len(ids), dtype=float)
    for lv in np.unique(level):
        members = np.flatnonzero(level == lv)
        ypos[members] = np.arange(len(members)) - (len(members) - 1) / 2
    at = {int(i): k for k, i in enumerate(ids)}
    div = unit_divisor(unit)
    fig = go.Figure()
    if len(edges):
        xs: list[float | None] = []
        ys: list[float | None] = []
        for s, d in zip(edges["src"].to_numpy(), edges["dst"].to_numpy()):
            a, b = at[int(s)], at[int(d)]
            xs += [float(level[a]), float(level[b]), None]
            ys += [float(ypos[a]), float(ypos[b]), None]
        fig.add_scatter(
            x=xs,
            y=ys,
            mode="lines",
            name="dependencies",
            hoverinfo="skip",
            line={"color": "rgba(120,120,120,0.45)", "width": 1},
        )
    dur = nodes["dur"].to_numpy(dtype=float) if "dur" in nodes else np.full(len(nodes), np.nan)
    indeg = pd.Series(edges["dst"].to_numpy()).value_counts() if len(edges) else pd.Series(dtype=int)
    outdeg = pd.Series(edges["src"].to_numpy()).value_counts() if len(edges) else pd.Series(dtype=int)

    def column(name: str) -> list[str]:
        if name not in nodes:
            return [""] * len(nodes)
        values = nodes[name].astype("string").fillna("")
        shown = values.map(fmt_dtypes) if name.endswith("_types") else values  # a list as the table shows it
        return esc_all(shorten(v, 160) for v in shown)

    custom = hover_columns(
        esc_all(nodes["name"].astype(str)),
        column("op_schema"),
        column("input_shapes"),
        column("input_types"),
        column("output_shapes"),
        column("output_types"),
        [fmt_time(d) if not np.isnan(d) else "no Kineto match" for d in dur],
        [str(int(indeg.get(i, 0))) for i in ids],
        [str(int(outdeg.get(i, 0))) for i in ids],
        [str(i) for i in ids],
    )
    hover = (
        "<b>%{customdata[0]}</b> (ET node %{customdata[9]})<br>%{customdata[1]}<br>"
        "inputs %{customdata[2]} %{customdata[3]}<br>outputs %{customdata[4]} %{customdata[5]}<br>"
        "duration %{customdata[6]}<br>reads from %{customdata[7]} op(s), feeds %{customdata[8]}<extra></extra>"
    )
    labels = [esc(shorten(str(n).removeprefix("aten::"), 18)) for n in nodes["name"]]
    show_text = len(nodes) <= 60
    timed = ~np.isnan(dur)
    if timed.any():
        fig.add_scatter(
            x=level[timed],
            y=ypos[timed],
            mode="markers+text" if show_text else "markers",
            name="ops",
            text=[labels[i] for i in np.flatnonzero(timed)],
            textposition="top center",
            textfont={"size": 9},
            marker={
                "size": 12,
                "color": dur[timed] / div,
                "colorscale": "Viridis",
                "showscale": True,
                "colorbar": {"title": {"text": unit}, "thickness": 12},
                "line": {"width": 0.5, "color": "#333"},
            },
            customdata=custom[timed],
            hovertemplate=hover,
        )
    if (~timed).any():
        fig.add_scatter(
            x=level[~timed],
            y=ypos[~timed],
            mode="markers+text" if show_text else "markers",
            name="ops without timing",
            text=[labels[i] for i in np.flatnonzero(~timed)],
            textposition="top center",
            textfont={"size": 9},
            marker={"size": 11, "color": "#c7c7c7", "symbol": "diamond", "line": {"width": 0.5, "color": "#333"}},
            customdata=custom[~timed],
            hovertemplate=hover,
        )
    widest = int(np.bincount(level).max()) if len(level) else 1
    fig.update_xaxes(
        title_text="topological depth (data dependencies, left to right)", showgrid=False, zeroline=False, dtick=1
    )
    fig.update_yaxes(visible=False)
    fig.update_layout(
        meta={
            "shown": int(len(nodes)),
            "total": int(total),
            "edges": int(len(edges)),
            "levels": int(level.max() + 1 if len(level) else 0),
        }
    )
    _layout(
        fig,
        title + f" ({len(nodes):,} ops, {len(edges):,} dependencies)",
        None,
        None,
        height=int(min(900, max(380, 22 * widest + 140))),
    )
    if total > len(nodes):
        fig.add_annotation(
            text=f"showing the first {len(nodes):,} of {total:,} ops in execution order; "
            "pick a step or see the table for the rest",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0,
            y=-0.14,
            xanchor="left",
            font={"size": 11, "color": "#b00"},
        )
    return fig


# -- Compare ----------------------------------------------------------------------------------
def diff_bars(diff: pd.DataFrame, *, level: str = "op", top: int = 20, unit: str = "ms") -> go.Figure:
    """Horizontal bars of the ``top`` changes (by |delta|) between two traces at ``level``."""
    title = f"Biggest changes by {level} (B − A)"
    frame = tables.biggest_changes(diff, level, top)
    if frame.empty:
        return empty("Nothing to compare at this level.", title)
    div = unit_divisor(unit)
    frame = frame.iloc[::-1]
    fig = go.Figure()
    for status, group in frame.groupby("status", sort=False):
        fig.add_bar(
            orientation="h",
            name=esc(status),
            y=[esc(shorten(n, 60)) for n in group["name"].astype(str)],
            x=group["delta_us"].to_numpy(dtype=float) / div,
            marker_color=STATUS_COLORS.get(str(status), "#7f7f7f"),
            customdata=hover_columns(
                esc_all(group["name"]), group["us_a"].fillna(0) / div, group["us_b"].fillna(0) / div
            ),
            hovertemplate=f"%{{customdata[0]}}<br>A %{{customdata[1]:.3f}} {unit} → B %{{customdata[2]:.3f}} {unit}"
            f"<br>Δ %{{x:+.3f}} {unit}<extra>%{{fullData.name}}</extra>",
        )
    fig.update_layout(
        barmode="overlay",
        yaxis={"categoryorder": "array", "categoryarray": [esc(shorten(n, 60)) for n in frame["name"].astype(str)]},
    )
    return _layout(fig, title, f"change in time ({unit})", None, height=max(300, 24 * len(frame) + 100))


__all__ = [
    "diff_bars",
    "empty",
    "layers_tree",
    "memory_categories",
    "memory_timeline",
    "op_graph",
    "rank_breakdown",
    "rank_step_heatmap",
    "shapes_bar",
    "step_breakdown",
    "timeline",
    "top_kernels_bar",
    "top_ops_bar",
]
