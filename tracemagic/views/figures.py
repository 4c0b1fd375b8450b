"""Plotly figures: pure functions from the analyses' DataFrames to ``go.Figure``.

They read only the columns documented in ``tracemagic.analysis`` and never touch trace
files. Every string from a trace is escaped (plotly renders some HTML in labels and hover
text). Large inputs are aggregated so a figure stays small and responsive: the timeline keeps
the longest events of each lane plus busy-time bins, the memory curve keeps each bin's
extremes, the tree keeps the heaviest layers.
"""

from __future__ import annotations

from typing import Literal, Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tracemagic.views import tables
from tracemagic.views._format import esc, esc_all, fmt_bytes, shorten, unit_divisor

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
KIND_COLORS = {
    "step": "#7f7f7f",
    "cpu_op": "#1f77b4",
    "user_annotation": "#17becf",
    "kernel": "#2ca02c",
    "memcpy": "#ff7f0e",
    "memset": "#e6ab02",
}
STATUS_COLORS = {"slower": "#d62728", "faster": "#2ca02c", "added": "#ff7f0e", "removed": "#1f77b4", "same": "#c7c7c7"}


def _layout(fig: go.Figure, title: str, x: str | None = None, y: str | None = None, height: int = 420) -> go.Figure:
    fig.update_layout(
        title={"text": esc(title)},
        template=TEMPLATE,
        height=height,
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
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
        return [f"r{int(r)} · step {int(s)}" for r, s in zip(steps["rank"], steps["step"])]
    return [f"step {int(s)}" for s in steps["step"]]


# -- Overview ---------------------------------------------------------------------------------
def step_breakdown(steps: pd.DataFrame, *, unit: str = "ms", rank: int | None = None) -> go.Figure:
    """Stacked bar per step of the step-time parts (GPU kernels, communication, memcpy, ...).

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
    for column, name in tables.STEP_PARTS.items():
        if column not in steps or not (steps[column] > 0).any():
            continue
        values = steps[column].to_numpy(dtype=float) / div
        fig.add_bar(
            name=name,
            x=labels,
            y=values,
            marker_color=PART_COLORS[column],
            customdata=100 * steps[column].to_numpy(dtype=float) / np.maximum(steps["dur"].to_numpy(dtype=float), 1e-9),
            hovertemplate=f"%{{x}}<br>{name}: %{{y:.3f}} {unit} (%{{customdata:.0f}}%)<extra></extra>",
        )
    fig.update_layout(barmode="stack", legend_traceorder="normal")
    return _layout(fig, "Step time breakdown", "step", f"time ({unit})")


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
            customdata=np.stack(
                [esc_all(table["name"]), table["calls"].astype(int), table["total_us"] / div], axis=-1
            ),
            hovertemplate=f"%{{customdata[0]}}<br>self %{{x:.3f}} {unit}<br>total %{{customdata[2]:.3f}} {unit}"
            "<br>%{customdata[1]} calls<extra></extra>",
            marker_color=KIND_COLORS["cpu_op"],
            name="self time",
        )
    )
    return _layout(fig, f"Top {len(table)} ops by self time", f"self time ({unit})", None, height=max(300, 24 * len(table) + 100))


# -- Layers -----------------------------------------------------------------------------------
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
    if "rank" in layers:
        rank = int(layers["rank"].min()) if rank is None else rank
        layers = layers[layers["rank"] == rank]
    total_col, self_col = f"{metric}_us", f"self_{metric}_us"
    frame = layers.assign(layer=layers["layer"].astype(str), parent=layers["parent"].astype("string").fillna("").astype(str))
    frame = frame.drop_duplicates("layer")
    known = set(frame["layer"])
    frame.loc[~frame["parent"].isin(known), "parent"] = ""
    if len(frame) > max_nodes:
        keep = set(frame.nlargest(max_nodes, total_col)["layer"])
        parents = dict(zip(frame["layer"], frame["parent"]))
        for name in list(keep):
            p = parents.get(name, "")
            while p and p not in keep:
                keep.add(p)
                p = parents.get(p, "")
        frame = frame[frame["layer"].isin(keep)]
    div = unit_divisor(unit)
    ids = esc_all(frame["layer"])
    labels = [esc(shorten(name.rsplit(".", 1)[-1] or name, 40)) for name in frame["layer"]]
    kind = go.Icicle if style == "icicle" else go.Sunburst
    custom = np.stack(
        [ids, esc_all(frame.get("type", pd.Series("", index=frame.index))), frame[total_col] / div, frame[self_col] / div,
         frame["calls"].astype(int)],
        axis=-1,
    )
    fig = go.Figure(
        kind(
            ids=ids,
            labels=labels,
            parents=esc_all(frame["parent"]),
            values=np.maximum(frame[self_col].to_numpy(dtype=float), 0.0),
            branchvalues="remainder",
            customdata=custom,
            hovertemplate=f"%{{customdata[0]}} (%{{customdata[1]}})<br>total %{{customdata[2]:.3f}} {unit}"
            f"<br>self %{{customdata[3]:.3f}} {unit}<br>%{{customdata[4]}} calls<extra></extra>",
            maxdepth=6,
        )
    )
    return _layout(fig, title, height=520)


# -- Timeline ---------------------------------------------------------------------------------
def _window(steps: pd.DataFrame | None, step: int | None, frames: list[pd.DataFrame]) -> tuple[float, float]:
    if step is not None and steps is not None and not steps.empty:
        rows = steps[steps["step"] == step]
        if not rows.empty:
            return float(rows["ts"].min()), float((rows["ts"] + rows["dur"]).max())
    starts = [float(f["ts"].min()) for f in frames if not f.empty]
    ends = [float((f["ts"] + f["dur"]).max()) for f in frames if not f.empty]
    return (min(starts), max(ends)) if starts else (0.0, 1.0)


def _clip(frame: pd.DataFrame, lo: float, hi: float) -> pd.DataFrame:
    if frame.empty:
        return frame
    end = frame["ts"] + frame["dur"]
    return frame[(end > lo) & (frame["ts"] < hi)]


def timeline(
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    steps: pd.DataFrame | None = None,
    *,
    step: int | None = None,
    window: tuple[float, float] | None = None,
    max_events: int = 3000,
    bins: int = 200,
    unit: str = "ms",
    thread_names: Mapping[tuple[int, str], str] | None = None,
) -> go.Figure:
    """Steps, CPU ops (per rank and thread) and GPU work (per rank and stream) on a time axis.

    To stay responsive on millions of events, each lane keeps only its longest events in
    the window (``max_events`` over all lanes) and the rest become busy-time bins (one bar
    per bin, colored by how busy the lane was).

    Args:
        ops: ``trace.ops()``.
        kernels: ``trace.kernels()`` (None or empty for a CPU-only trace).
        steps: ``trace.steps()``, drawn as a lane and used to find ``step``'s window.
        step: show only this step's time window.
        window: (start, end) in µs since the trace start; overrides ``step``.
        max_events: the most individual events drawn.
        bins: busy-time bins per lane for the events not drawn individually.
        unit: time unit of the x axis.
        thread_names: (rank, thread id) -> lane name (default ``thread <id>``).

    Returns:
        Horizontal ``Bar`` traces, one per event kind, plus ``aggregated`` bins when needed.
        ``layout.meta`` holds ``{"shown": n, "total": n, "window": [lo, hi]}``.
    """
    kernels = kernels if kernels is not None else pd.DataFrame(columns=["rank", "ts", "dur"])
    steps_df = steps if steps is not None else pd.DataFrame(columns=["rank", "step", "ts", "dur"])
    lo, hi = window if window is not None else _window(steps_df, step, [ops, kernels])
    div = unit_divisor(unit)
    several = len(set(ops.get("rank", pd.Series([0])).tolist()) | set(kernels.get("rank", pd.Series([0])).tolist())) > 1

    parts = []
    cpu = _clip(ops, lo, hi)
    if steps is not None and not cpu.empty:
        cpu = cpu[cpu["kind"].astype(str) != "step"]  # drawn in the steps lane
    if not cpu.empty:
        names = thread_names or {}
        lane_keys = [names.get((int(r), str(t)), f"thread {t}") for r, t in zip(cpu["rank"], cpu["thread"].astype(str))]
        parts.append(pd.DataFrame({
            "rank": cpu["rank"].to_numpy(), "lane_key": lane_keys, "gpu": False,
            "kind": cpu["kind"].astype(str).to_numpy(), "name": cpu["name"].astype(str).to_numpy(),
            "ts": cpu["ts"].to_numpy(dtype=float), "dur": cpu["dur"].to_numpy(dtype=float),
            "depth": cpu["depth"].to_numpy(), "info": cpu["layer"].astype("string").fillna("").to_numpy(),
        }))
    gpu = _clip(kernels, lo, hi)
    if not gpu.empty:
        parts.append(pd.DataFrame({
            "rank": gpu["rank"].to_numpy(),
            "lane_key": [f"GPU {d} stream {s}" for d, s in zip(gpu["device"].astype("string").fillna("?"), gpu["stream"].astype("string").fillna("?"))],
            "gpu": True, "kind": gpu["kind"].astype(str).to_numpy(), "name": gpu["name"].astype(str).to_numpy(),
            "ts": gpu["ts"].to_numpy(dtype=float), "dur": gpu["dur"].to_numpy(dtype=float), "depth": 0,
            "info": ("launched by " + gpu["op"].astype("string").fillna("?")).to_numpy(),
        }))
    step_rows = _clip(steps_df, lo, hi)
    if not step_rows.empty:
        parts.append(pd.DataFrame({
            "rank": step_rows["rank"].to_numpy(), "lane_key": "steps", "gpu": False, "kind": "step",
            "name": [f"ProfilerStep#{int(s)}" for s in step_rows["step"]],
            "ts": step_rows["ts"].to_numpy(dtype=float), "dur": step_rows["dur"].to_numpy(dtype=float), "depth": -1, "info": "",
        }))
    title = "Timeline" + (f" — step {step}" if step is not None and window is None else "")
    if not parts:
        return empty("No events in this window.", title)
    ev = pd.concat(parts, ignore_index=True)
    ev["lane"] = [
        (f"rank {r} · {k}" if several else str(k)) for r, k in zip(ev["rank"], ev["lane_key"])
    ]
    # lane order: per rank, steps, then CPU threads, then GPU streams
    order = ev.assign(o=np.where(ev["lane_key"] == "steps", 0, np.where(ev["gpu"], 2, 1)))
    lanes = order.drop_duplicates("lane").sort_values(["rank", "o", "lane"])["lane"].tolist()
    total = len(ev)
    per_lane = max(10, max_events // max(len(lanes), 1))
    kept, rest = [], []
    for lane, group in ev.groupby("lane", sort=False):
        if len(group) <= per_lane:
            kept.append(group)
        else:
            top = group.nlargest(per_lane, "dur")
            kept.append(top)
            rest.append(group.drop(top.index))
    shown = pd.concat(kept)
    fig = go.Figure()
    lane_labels = {lane: esc(shorten(lane, 48)) for lane in lanes}
    if rest:  # drawn first: below the individual events
        agg = _busy_bins(pd.concat(rest), lo, hi, bins)
        if not agg.empty:
            fig.add_bar(
                orientation="h",
                name="aggregated",
                y=[lane_labels[l] for l in agg["lane"]],
                base=(agg["start"].to_numpy() - lo) / div,
                x=np.full(len(agg), (hi - lo) / bins / div),
                marker_color=[f"rgba(90,90,90,{0.15 + 0.75 * b:.2f})" for b in agg["busy"]],
                customdata=np.stack([agg["count"], 100 * agg["busy"]], axis=-1),
                hovertemplate="%{customdata[0]} short events<br>busy %{customdata[1]:.0f}%<extra>aggregated</extra>",
            )
    # outer events first, nested ones drawn on top of them and narrower (a flame graph per lane)
    draw_order = {"step": 0, "user_annotation": 1, "cpu_op": 2}
    kinds = sorted(shown["kind"].unique(), key=lambda k: (draw_order.get(k, 3), k))
    for kind in kinds:
        group = shown[shown["kind"] == kind].sort_values(["depth", "ts"], kind="stable")
        fig.add_bar(
            orientation="h",
            name=esc(kind),
            width=0.8 * 0.8 ** np.clip(group["depth"].to_numpy(dtype=float), 0, 6),
            y=[lane_labels[l] for l in group["lane"]],
            base=(group["ts"].to_numpy() - lo) / div,
            x=group["dur"].to_numpy() / div,
            marker_color=KIND_COLORS.get(kind, "#bcbd22"),
            customdata=np.stack([esc_all(s[:120] for s in group["name"]), esc_all(group["info"]), group["dur"] / div], axis=-1),
            hovertemplate=f"%{{customdata[0]}}<br>%{{customdata[2]:.3f}} {unit}<br>%{{customdata[1]}}<extra></extra>",
        )
    fig.update_layout(
        barmode="overlay",
        meta={"shown": int(len(shown)), "total": int(total), "window": [lo, hi]},
        yaxis={"categoryorder": "array", "categoryarray": [lane_labels[l] for l in lanes], "autorange": "reversed"},
    )
    _layout(fig, title, f"time since window start ({unit})", None, height=max(300, 34 * len(lanes) + 120))
    if rest:
        fig.add_annotation(
            text=f"{len(shown):,} of {total:,} events drawn; the rest are aggregated (grey bins)",
            showarrow=False, xref="paper", yref="paper", x=0, y=-0.18, xanchor="left", font={"size": 11},
        )
    return fig


def _busy_bins(rest: pd.DataFrame, lo: float, hi: float, bins: int) -> pd.DataFrame:
    """Per lane and bin: events not drawn and the fraction of the bin they keep busy.

    CPU events nested in others (depth > 0) are left out so time is not counted twice;
    each event's duration is split over the bins it covers.
    """
    rest = rest[rest["depth"] <= 0]
    if rest.empty:
        return pd.DataFrame(columns=["lane", "start", "busy", "count"])
    width = (hi - lo) / bins
    edges = lo + width * np.arange(bins + 1)
    out = []
    for lane, group in rest.groupby("lane", sort=False):
        start = np.clip(group["ts"].to_numpy(), lo, hi)
        end = np.clip(group["ts"].to_numpy() + group["dur"].to_numpy(), lo, hi)
        # busy time per bin = integral of the coverage, via cumulative starts/ends
        busy = np.zeros(bins)
        for s, e in ((start, end),):
            cs = np.searchsorted(edges, s, side="right") - 1
            ce = np.searchsorted(edges, e, side="right") - 1
            cs, ce = np.clip(cs, 0, bins - 1), np.clip(ce, 0, bins - 1)
            same = cs == ce
            np.add.at(busy, cs[same], (e - s)[same])
            d = ~same
            np.add.at(busy, cs[d], edges[cs[d] + 1] - s[d])
            np.add.at(busy, ce[d], e[d] - edges[ce[d]])
            # whole bins between
            full = np.zeros(bins + 1)
            np.add.at(full, cs[d] + 1, 1)
            np.add.at(full, ce[d], -1)
            busy += np.cumsum(full)[:bins] * width
        counts = np.bincount(np.clip(np.searchsorted(edges, start, side="right") - 1, 0, bins - 1), minlength=bins)
        nz = np.nonzero(counts)[0]
        out.append(pd.DataFrame({"lane": lane, "start": edges[nz], "busy": np.minimum(busy[nz] / width, 1.0), "count": counts[nz]}))
    return pd.concat(out, ignore_index=True)


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


def memory_timeline(
    memory: pd.DataFrame,
    steps: pd.DataFrame | None = None,
    *,
    step: int | None = None,
    rank: int | None = None,
    max_points: int = 3000,
    unit: str = "ms",
) -> go.Figure:
    """Allocated (solid) and reserved (dotted) bytes over time per device, step boundaries
    as vertical lines, and each device's peak marked with the op and layer that reached it.

    Args:
        memory: ``trace.memory()``.
        steps: ``trace.steps()`` for the step boundaries.
        step: only this step's events.
        rank: only this rank (default: every rank, one line per rank and device).
        max_points: the most points per line (each bin keeps its min and max).
        unit: time unit of the x axis (time since the trace start).
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
    fig = go.Figure()
    for (rank_, device), group in memory.sort_values("ts").groupby(["rank", "device"], observed=True, sort=True):
        label = esc(f"rank {rank_} · {device}" if several else f"{device}")
        small = _downsample_extremes(group, "allocated_bytes", max_points)
        fig.add_scatter(
            name=f"{label} allocated",
            x=small["ts"].to_numpy(dtype=float) / div,
            y=small["allocated_bytes"].to_numpy(dtype=float) / scale,
            mode="lines",
            line={"shape": "hv"},
            customdata=np.stack([esc_all(small["op"].astype("string").fillna("")), esc_all(small["layer"].astype("string").fillna(""))], axis=-1),
            hovertemplate=f"%{{y:.2f}} {suffix}<br>%{{customdata[0]}}<br>%{{customdata[1]}}<extra>{label}</extra>",
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
            )
        peak = group.loc[group["allocated_bytes"].idxmax()]
        where = " in ".join(esc(shorten(v, 50)) for v in (peak["op"], peak["layer"]) if isinstance(v, str) and v)
        fig.add_annotation(
            x=float(peak["ts"]) / div, y=float(peak["allocated_bytes"]) / scale,
            text=f"peak {fmt_bytes(peak['allocated_bytes'])}" + (f": {where}" if where else ""),
            showarrow=True, arrowhead=2, ax=0, ay=-30,
        )
    if steps is not None and not steps.empty:
        bounds = sorted(set(steps["ts"].tolist()))
        if step is not None:
            bounds = [float(t) for t in steps.loc[steps["step"] == step, "ts"]]
        # one layout update: add_vline per boundary is quadratic in plotly
        fig.update_layout(shapes=[
            {"type": "line", "xref": "x", "yref": "paper", "x0": float(t) / div, "x1": float(t) / div, "y0": 0, "y1": 1,
             "line": {"color": "#aaaaaa", "width": 1, "dash": "dash"}}
            for t in bounds[:200]
        ])
    return _layout(fig, title, f"time since trace start ({unit})", f"memory ({suffix})")


# -- Shapes -----------------------------------------------------------------------------------
def shapes_bar(shapes: pd.DataFrame, *, top: int = 20, unit: str = "ms", metric: str = "total_us") -> go.Figure:
    """Horizontal bars of the ``top`` (op, input shapes, dtypes) rows by ``metric``."""
    title = "Ops by input shape"
    if shapes.empty:
        return empty("No input shapes: record with record_shapes=True.", title)
    div = unit_divisor(unit)
    table = shapes.sort_values(metric, ascending=False, kind="stable").head(top).iloc[::-1]
    labels = [
        esc(shorten(f"{n} {d}", 70)) + f" #{i}"
        for i, (n, d) in enumerate(zip(table["name"].astype(str), table["input_dims"].astype("string").fillna("")))
    ]
    flops = table["tflops_per_s"].astype(float).fillna(0.0) if "tflops_per_s" in table else pd.Series(0.0, index=table.index)
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=labels,
            x=table[metric].to_numpy(dtype=float) / (div if metric.endswith("_us") else 1),
            customdata=np.stack([
                esc_all(table["name"]), esc_all(table["input_dims"]), esc_all(table["input_type"]),
                table["calls"].astype(int), flops,
            ], axis=-1),
            hovertemplate="%{customdata[0]}<br>shapes %{customdata[1]}<br>types %{customdata[2]}"
            f"<br>%{{customdata[3]}} calls, %{{x:.3f}} {unit}<br>%{{customdata[4]:.2f}} TFLOP/s<extra></extra>",
            marker_color=KIND_COLORS["cpu_op"],
        )
    )
    axis = f"{metric.removesuffix('_us').replace('_', ' ')} ({unit})" if metric.endswith("_us") else metric
    return _layout(fig, title, axis, None, height=max(300, 24 * len(table) + 100))


# -- Kernels ----------------------------------------------------------------------------------
def top_kernels_bar(kernels: pd.DataFrame, *, top: int = 15, by_op: bool = False, unit: str = "ms") -> go.Figure:
    """Horizontal bars of the ``top`` kernels by total GPU time (by kernel, or kernel + op)."""
    title = "Top kernels" + (" by launching op" if by_op else "")
    table = tables.top_kernels(kernels, top, by_op=by_op)
    if table.empty:
        return empty("No GPU kernels in this trace.", title)
    div = unit_divisor(unit)
    table = table.iloc[::-1]
    names = [shorten(n, 60) + (f" ← {shorten(o, 30)}" if by_op and o else "") for n, o in zip(table["name"], table.get("op", [""] * len(table)))]
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=[esc(n) + f" #{i}" for i, n in enumerate(names)],
            x=table["total_us"].to_numpy(dtype=float) / div,
            marker_color=[KIND_COLORS.get(k, "#2ca02c") for k in table["kind"]],
            customdata=np.stack([esc_all(table["name"]), table["calls"].astype(int), table["pct"]], axis=-1),
            hovertemplate=f"%{{customdata[0]}}<br>%{{x:.3f}} {unit} (%{{customdata[2]:.1f}}% of GPU time)"
            "<br>%{customdata[1]} calls<extra></extra>",
        )
    )
    return _layout(fig, title, f"GPU time ({unit})", None, height=max(300, 24 * len(table) + 100))


# -- Ranks ------------------------------------------------------------------------------------
RANK_PARTS = {"compute_us": "compute", "comm_us": "communication", "memcpy_us": "memcpy", "idle_us": "idle"}


def rank_breakdown(ranks: pd.DataFrame, *, unit: str = "ms") -> go.Figure:
    """Stacked bar per rank of mean step time (compute, communication, memcpy, idle), the
    slowest rank labelled and outlined."""
    title = "Per-rank breakdown (mean step)"
    if ranks.empty:
        return empty("No ranks.", title)
    div = unit_divisor(unit)
    ranks = ranks.sort_values("rank")
    slow = ranks["slowest"].astype(bool).to_numpy() if "slowest" in ranks else np.zeros(len(ranks), bool)
    labels = [f"rank {int(r)}" + (" (slowest)" if s else "") for r, s in zip(ranks["rank"], slow)]
    fig = go.Figure()
    for column, name in RANK_PARTS.items():
        if column in ranks:
            fig.add_bar(name=name, x=labels, y=ranks[column].to_numpy(dtype=float) / div, marker_color=PART_COLORS[column],
                        hovertemplate=f"%{{x}}<br>{name} %{{y:.3f}} {unit}<extra></extra>")
    other = ranks["step_us"] - sum(ranks[c] for c in RANK_PARTS if c in ranks)
    if (other > 1e-6 * ranks["step_us"].abs().max()).any():
        fig.add_bar(name="other", x=labels, y=np.maximum(other.to_numpy(dtype=float), 0) / div, marker_color="#1f77b4",
                    hovertemplate=f"%{{x}}<br>other %{{y:.3f}} {unit}<extra></extra>")
    fig.update_layout(barmode="stack")
    for label, is_slow, total in zip(labels, slow, ranks["step_us"]):
        if is_slow:
            fig.add_annotation(x=label, y=float(total) / div, text="slowest", showarrow=True, arrowhead=2, ay=-30,
                               font={"color": "#d62728"})
    return _layout(fig, title, "rank", f"mean step time ({unit})")


def rank_step_heatmap(steps: pd.DataFrame, *, unit: str = "ms", column: str = "dur") -> go.Figure:
    """Rank × step heatmap of ``column`` (step time by default)."""
    title = "Step time per rank and step"
    if steps.empty:
        return empty("No ProfilerStep in this trace.", title)
    div = unit_divisor(unit)
    grid = steps.pivot_table(index="rank", columns="step", values=column, aggfunc="sum") / div
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(dtype=float),
            x=[f"step {int(s)}" for s in grid.columns],
            y=[f"rank {int(r)}" for r in grid.index],
            colorscale="Reds",
            colorbar={"title": {"text": unit}},
            hovertemplate=f"%{{y}} %{{x}}<br>%{{z:.3f}} {unit}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, title, "step", "rank", height=max(260, 28 * len(grid) + 140))


# -- Compare ----------------------------------------------------------------------------------
def diff_bars(diff: pd.DataFrame, *, level: str = "op", top: int = 20, unit: str = "ms") -> go.Figure:
    """Horizontal bars of the ``top`` changes (by |delta|) between two traces at ``level``."""
    title = f"Biggest changes by {level} (B − A)"
    frame = diff[diff["level"] == level] if "level" in diff else diff
    if frame.empty:
        return empty("Nothing to compare at this level.", title)
    div = unit_divisor(unit)
    frame = frame.reindex(frame["delta_us"].abs().sort_values(ascending=False, kind="stable").index).head(top).iloc[::-1]
    fig = go.Figure()
    for status, group in frame.groupby("status", sort=False):
        fig.add_bar(
            orientation="h",
            name=esc(status),
            y=[esc(shorten(n, 60)) for n in group["name"].astype(str)],
            x=group["delta_us"].to_numpy(dtype=float) / div,
            marker_color=STATUS_COLORS.get(str(status), "#7f7f7f"),
            customdata=np.stack([esc_all(group["name"]), group["us_a"].fillna(0) / div, group["us_b"].fillna(0) / div], axis=-1),
            hovertemplate=f"%{{customdata[0]}}<br>A %{{customdata[1]:.3f}} {unit} → B %{{customdata[2]:.3f}} {unit}"
            f"<br>Δ %{{x:+.3f}} {unit}<extra>%{{fullData.name}}</extra>",
        )
    fig.update_layout(barmode="overlay", yaxis={"categoryorder": "array", "categoryarray": [esc(shorten(n, 60)) for n in frame["name"].astype(str)]})
    return _layout(fig, title, f"change in time ({unit})", None, height=max(300, 24 * len(frame) + 100))


__all__ = [
    "diff_bars",
    "empty",
    "layers_tree",
    "memory_timeline",
    "rank_breakdown",
    "rank_step_heatmap",
    "shapes_bar",
    "step_breakdown",
    "timeline",
    "top_kernels_bar",
    "top_ops_bar",
]
