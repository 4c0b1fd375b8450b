"""The tabs of the dashboard and the report: what each shows, built once for both.

A ``Section`` is plain data (figures, one main table, facts, bullet points), so the
ipywidgets dashboard and the static HTML report draw exactly the same views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd
import plotly.graph_objects as go

from tracemagic.analysis.lines import mark_names
from tracemagic.analysis.sites import cell_file
from tracemagic.views import cell_lines, figures, html, insights, tables
from tracemagic.views._format import fmt_bytes, fmt_dtypes, fmt_time, in_step, kernel_label, step_name, unit_divisor
from tracemagic.views.data import TraceData

#: the most ops the Graph tab draws (the rest are listed in its table)
GRAPH_MAX_NODES = 300
#: the most events the Timeline draws, at any zoom
TIMELINE_MAX_EVENTS = 3000
#: columns never worth a table column (row numbers and join keys)
HIDDEN_COLUMNS = frozenset({"row", "op_row", "parent_row", "seq", "rf_id", "external_id", "correlation", "parent"})
#: columns holding a JSON list per input (dtypes, constant values), shown as ``a, b, –``
DTYPE_COLUMNS = frozenset({"input_type", "input_types", "output_types", "concrete_inputs"})
# the columns that answer each table's question, shown first (the rest follow in the frame's order)
STEPS_FIRST = ("step", "dur", "window_dur", "gpu_busy_pct")
OPS_FIRST = ("name", "self_us", "self_pct", "total_us", "calls", "mean_us")
LAYERS_FIRST = ("layer", "type", "calls", "gpu_us", "self_gpu_us", "cpu_us", "self_cpu_us")
#: the allocations table's columns that need an allocation's address (its free found by it)
UNPAIRED_COLUMNS = ("addr", "freed_ts", "lifetime_us")
ALLOCATIONS_FIRST = ("bytes", "op", "layer", "phase", "step", "ts", "lifetime_us", "device")
SHAPES_FIRST = ("name", "input_dims", "calls", "total_us", "self_us", "gpu_us", "mean_us", "tflops_per_s")
#: on a trace with GPU work the GPU's time leads, as in the Overview and Kernels tabs
SHAPES_FIRST_GPU = ("name", "input_dims", "calls", "gpu_us", "total_us", "self_us", "mean_us", "tflops_per_s")
ROOFLINE_FIRST = ("name", "input_dims", "pct_of_roofline", "gpu_us", "calls", "bound", "tflops_per_s", "tbytes_per_s")
FLAME_FIRST = ("function", "file", "line", "cpu_us", "self_cpu_us", "gpu_us", "calls")
KERNELS_FIRST = ("kernel", "op", "total_us", "pct", "calls", "mean_us", "max_us")
#: the layers table's columns that only a GPU fills (left out of a trace without one)
GPU_LAYER_COLUMNS = ("gpu_us", "self_gpu_us", "fwd_gpu_us", "bwd_gpu_us", "tflops_per_s", "memory_bound_pct")


@dataclass
class ViewState:
    """The dashboard's controls: selected step (None = all), top-N and time unit."""

    step: int | None = None
    top: int = 15
    unit: str = "ms"

    def __post_init__(self) -> None:
        unit_divisor(self.unit)  # validates
        self.top = max(1, int(self.top))


@dataclass
class Section:
    """One tab's content.

    Attributes:
        key: the tab's key (``TABS``).
        title: the tab's title.
        figures: plotly figures, top to bottom.
        table: the main (sortable, filterable, paginated) table, already display-ready.
        table_title: a caption for the table.
        facts: (label, value) pairs shown above the figures.
        bullets: recommendations or notes, one line each.
        extra: small static tables (caption, frame) under the main one.
        side: escaped HTML shown beside the first figure (the Layers tab's tree table).
        rebuild: figure index -> a function drawing that figure again for a time window
            ``(start, end)`` in µs since the trace start (the Timeline's zoom); the
            dashboard calls it when the visible range changes.
    """

    key: str
    title: str
    figures: list[go.Figure] = field(default_factory=list)
    table: pd.DataFrame = field(default_factory=pd.DataFrame)
    table_title: str = ""
    facts: list[tuple[str, str]] = field(default_factory=list)
    bullets: list[str] = field(default_factory=list)
    extra: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    side: str = ""
    rebuild: dict[int, Callable[[tuple[float, float]], go.Figure]] = field(default_factory=dict)


def _always(data: TraceData, other: TraceData | None) -> bool:
    return True


@dataclass(frozen=True)
class Tab:
    """One tab of the registry (``TABS``).

    Attributes:
        key: the tab's key.
        title: its title.
        builder: ``builder(data, state)`` -> its ``Section`` (``builder(data, state, other)``
            with ``needs_other``).
        available: whether the tab shows for ``(data, other)``.
        whole_trace: it shows every step whatever the step selector says (its facts say
            so while a step is selected).
        needs_other: it compares with another trace (``other``).
    """

    key: str
    title: str
    builder: Callable[..., Section]
    available: Callable[[TraceData, TraceData | None], bool] = _always
    whole_trace: bool = False
    needs_other: bool = False


def available(data: TraceData, other: TraceData | None = None) -> list[str]:
    """The tab keys to show for this trace, in display order: Roofline and Kernels only
    with a GPU, Ranks only with several ranks, Graph only with an Execution Trace next to
    the trace, Compare only with another trace (each ``Tab.available``); Ranks alone for a
    job's summarized ranks (``load_ranks``)."""
    if data.summaries_only:  # a job's ranks (``tracemagic.load_ranks``): no events for the other tabs
        return ["ranks"]
    return [key for key, tab in TABS.items() if tab.available(data, other)]


#: ``trace.diff()``'s times of A and B (µs, the unit before the side): shown in the chosen unit
#: like every time, as ``a_ms`` ("A (ms)") and so on, beside the change (``delta_ms``)
DIFF_TIMES = {"us_a": "a", "us_b": "b", "gpu_us_a": "gpu_a", "gpu_us_b": "gpu_b"}


def display_table(
    frame: pd.DataFrame, unit: str = "ms", *, first: tuple[str, ...] = (), one_rank: bool = False
) -> pd.DataFrame:
    """A table ready to show: join-key columns dropped (and ``rank`` where the trace has one
    rank), the ``first`` columns (those that answer the table's question) moved to the
    front, µs columns converted to ``unit`` (and renamed ``*_ms`` etc.), string-like
    columns as plain text, dtype lists as ``float, float`` and addresses in hex. The
    headers users read are ``_format.header`` of these names."""
    if frame.empty and not len(frame.columns):
        return frame
    drop = [c for c in frame.columns if c in HIDDEN_COLUMNS or (one_rank and c == "rank")]
    out = frame.drop(columns=drop).reset_index(drop=True)
    if "step" in out and pd.api.types.is_integer_dtype(out["step"]) and (out["step"] < 0).any():
        # -1 is "outside any step" (``analysis.schema``): blank, and no column at all when nothing is in a step
        out["step"] = out["step"].astype("Int64").mask(out["step"] < 0)
        if out["step"].isna().all():
            out = out.drop(columns="step")
    if first:
        front = [c for c in first if c in out.columns]
        out = out[front + [c for c in out.columns if c not in front]]
    div = unit_divisor(unit)
    suffix = {"µs": "us", "ms": "ms", "s": "s"}[unit]
    renames = {}
    for column in list(out.columns):
        times = column.endswith(("_us", "_ts")) or column in ("ts", "dur", "window_dur", "self_dur", "mean", "step_us")
        if times or column in DIFF_TIMES:
            if out.empty or (
                pd.api.types.is_numeric_dtype(out[column]) and not pd.api.types.is_bool_dtype(out[column])
            ):
                out[column] = out[column].astype(float) / div
                base = DIFF_TIMES.get(column) or column.removesuffix("_us")
                renames[column] = f"{base}_{suffix}"
        elif column in DTYPE_COLUMNS:
            shown = {v: fmt_dtypes(v) for v in out[column].dropna().unique()}  # few distinct lists: each once
            out[column] = out[column].map(shown).astype(object).where(out[column].notna(), "")
        elif column == "addr" and pd.api.types.is_numeric_dtype(out[column]):
            out[column] = pd.Series(
                [f"0x{int(v):x}" if pd.notna(v) else "" for v in out[column]], index=out.index, dtype=object
            )
        elif isinstance(out[column].dtype, pd.CategoricalDtype):
            out[column] = out[column].astype("string")
    return out.rename(columns=renames)


def kernel_names(frame: pd.DataFrame) -> pd.DataFrame:
    """A kernels table (``top_kernels``) with each kernel's readable name first (``kernel``:
    ``_format.kernel_label``, return type, namespaces and arguments dropped) and its full
    signature last (``signature``, the frame's ``name``), where the filter finds it too."""
    if "name" not in frame:
        return frame
    names = frame["name"].astype(str)
    kinds = frame["kind"].astype(str) if "kind" in frame else pd.Series("kernel", index=frame.index)
    labels = [kernel_label(n, 200) if k == "kernel" else n for n, k in zip(names, kinds)]
    out = frame.drop(columns="name").assign(signature=names)
    out.insert(0, "kernel", labels)
    return out


def build(
    key: str,
    data: TraceData,
    state: ViewState | None = None,
    other: TraceData | None = None,
    *,
    other_before: bool = False,
) -> Section:
    """The content of tab ``key`` for ``data`` under ``state``.

    A tab that compares (Compare) takes ``data`` as A and ``other`` as B, or, with
    ``other_before``, ``other`` as A: the earlier run a capture is compared with (``--vs``),
    so that its changes read from that run to this one, as the capture's summary line does.

    Raises:
        ValueError: an unknown key, or ``compare`` without ``other``.
    """
    state = state or ViewState()
    tab = TABS.get(key)
    if tab is None:
        raise ValueError(f"unknown tab {key!r}; tabs are {', '.join(TABS)}")
    if tab.needs_other:
        if other is None:
            raise ValueError(f"the {key} tab needs another trace (other=...)")
        section = tab.builder(other, state, data) if other_before else tab.builder(data, state, other)
    else:
        section = tab.builder(data, state)
    if tab.whole_trace and state.step is not None:
        section.facts.insert(
            0, ("steps", f"all steps: this tab does not follow the step selector ({step_name(state.step)})")
        )
    return section


def _overview(data: TraceData, state: ViewState) -> Section:
    one_rank = not data.several_ranks
    kernels = tables.select_step(data.kernels, state.step)
    step_table = tables.step_table(data.steps)
    # a part of the step that is 0 in every step (no communication on one process) is no column
    step_table = step_table.drop(
        columns=[c for c in tables.STEP_PARTS if c in step_table and not step_table[c].fillna(0).astype(float).any()]
    )
    ops = tables.select_step(data.ops, state.step)
    steps = data.steps
    fig = figures.step_breakdown(steps, unit=state.unit)
    phases = insights.phases_of(data)
    phase_fig = figures.phase_breakdown(phases if phases is not None else data.phases, unit=state.unit)
    for figure in (fig, phase_fig):
        if state.step is not None and figure.data:
            labels = list(figure.data[0].x)
            chosen = [i for i, label in enumerate(labels) if step_name(state.step) in label.split(" · ")]
            for trace in figure.data:
                trace.marker.opacity = [1.0 if i in chosen else 0.35 for i in range(len(labels))]
    section = Section(
        "overview",
        TITLES["overview"],
        # on a GPU the time that matters is the GPU's: the kernels lead, by GPU time
        figures=[
            fig,
            phase_fig,
            figures.top_kernels_bar(kernels, top=state.top, unit=state.unit)
            if data.has_gpu
            else figures.top_ops_bar(ops, top=state.top, unit=state.unit),
        ],
        table=display_table(step_table, state.unit, first=STEPS_FIRST, one_rank=one_rank),
        table_title="Steps",
        facts=insights.facts(data, state.step),
        bullets=insights.for_trace(data, step=state.step),
    )
    if data.has_line_marks and (hot := cell_lines.hottest_text(data.lines, has_gpu=data.has_gpu)):
        # lines() is per step over all of them: said so where one step is chosen
        over = (
            "Source tab"
            if state.step is None
            else f"the mean of all steps, not only {step_name(state.step)}: Source tab"
        )
        section.facts.append(("hottest line", f"{hot} ({over})"))
    in_this = in_step(state.step)
    if data.has_gpu:
        section.extra.append(
            (
                f"Top kernels{in_this} (by GPU time)",
                display_table(kernel_names(tables.top_kernels(kernels, state.top)), state.unit, first=KERNELS_FIRST),
            )
        )
    layers = data.layers_in(state.step)
    if not layers.empty:
        top_layers = tables.top_layers(layers, state.top)
        cols = [
            c
            for c in ("rank", "layer", "type", "calls", "cpu_us", "self_cpu_us") + (("gpu_us",) if data.has_gpu else ())
            if c in top_layers
        ]
        section.extra.append(
            (
                "Top layers" + in_this,
                display_table(top_layers[cols], state.unit, first=LAYERS_FIRST, one_rank=one_rank),
            )
        )
    section.extra.append(
        (
            "Top ops" + in_this,
            display_table(tables.top_ops(ops, state.top), state.unit, first=OPS_FIRST),
        )
    )
    for name, problem in data.problems.items():
        section.bullets.append(f"The {name} analysis failed, its view is empty: {problem}")
    return section


def _layers(data: TraceData, state: ViewState) -> Section:
    layers = data.layers_in(state.step)
    metric: Literal["cpu", "gpu"] = "gpu" if tables.layer_metric(layers) == "gpu_us" else "cpu"
    table = tables.layers_table(layers)
    if not data.has_gpu:
        table = table.drop(columns=[c for c in GPU_LAYER_COLUMNS if c in table])
    return Section(
        "layers",
        TITLES["layers"],
        figures=[figures.layers_tree(layers, metric=metric, unit=state.unit)],
        table=display_table(table, state.unit, first=LAYERS_FIRST, one_rank=not data.several_ranks),
        table_title="Layers" + in_step(state.step) + " (self = time not in child layers)",
        side=html.layer_tree(layers, metric=metric, unit=state.unit) if not layers.empty else "",
        bullets=_compiled_note(layers),
    )


def _compiled_note(layers: pd.DataFrame) -> list[str]:
    """What the Layers tab cannot show when the trace ran ``torch.compile``'d code."""
    regions = sum((layers.attrs.get("compiled_regions") or {}).values())
    if not regions:
        return []
    names = sorted({name for per_rank in (layers.attrs.get("compiled_layers") or {}).values() for name in per_rank})
    head = f"torch.compile: {regions:,} compiled region call(s)"
    if not names:
        return [
            f"{head}, outside any nn.Module event (a compiled function, or no with_stack): submodule timing "
            "is not available inside compiled regions, and their ops and kernels belong to no layer."
        ]
    return [
        f"{head}, in {', '.join(names)}. Submodule timing is not available inside compiled regions: dynamo "
        "inlines the submodules into one graph, so their ops and kernels count as the compiled module's own "
        "time (forward and backward)."
    ]


def _numeric(frame: pd.DataFrame, columns: tuple[str, ...] = ("ts", "dur", "depth", "rank")) -> pd.DataFrame:
    """``frame`` with its time columns as plain numpy floats (fast to slice again and again)."""
    present = {c: frame[c].to_numpy(dtype=float) for c in columns if c in frame and c != "rank"}
    if "rank" in frame:
        present["rank"] = frame["rank"].to_numpy(dtype="int64", na_value=0)
    return frame.assign(**present) if present and len(frame) else frame


def _timeline(data: TraceData, state: ViewState) -> Section:
    spans, phase_spans = data.layer_spans, data.phase_spans
    all_ops = data.ops
    if data.has_line_marks:  # a cell's line marks named as the Source tab names their lines
        all_ops = all_ops.assign(name=mark_names(all_ops["name"], data.cell_lines))
    fig = figures.timeline(
        all_ops,
        data.kernels,
        data.steps,
        step=state.step,
        unit=state.unit,
        thread_names=data.thread_names,
        max_events=TIMELINE_MAX_EVENTS,
        spans=spans,
        phase_spans=phase_spans,
    )
    ops = tables.select_step(all_ops, state.step)
    meta = fig.layout.meta or {}
    facts = [("events drawn", f"{meta.get('shown', 0):,} of {meta.get('total', 0):,}")] if meta else []
    if state.step is None and len(data.step_ids) > 1:
        facts.append(("tip", "pick a step to zoom into one step's window"))
    rebuild: dict[int, Callable[[tuple[float, float]], go.Figure]] = {}
    if meta and "origin" in meta:
        origin, unit, names = float(meta["origin"]), state.unit, data.thread_names
        frames: dict[str, pd.DataFrame] = {}

        def redraw(window: tuple[float, float]) -> go.Figure:
            if not frames:  # once: numeric copies, so each zoom only slices arrays
                frames.update(ops=_numeric(all_ops), kernels=_numeric(data.kernels), steps=data.steps)
            return figures.timeline(
                frames["ops"],
                frames["kernels"],
                frames["steps"],
                window=window,
                origin=origin,
                unit=unit,
                thread_names=names,
                max_events=TIMELINE_MAX_EVENTS,
                spans=spans,
                phase_spans=phase_spans,
            )

        rebuild[0] = redraw
    section = Section(
        "timeline",
        TITLES["timeline"],
        figures=[fig],
        table=display_table(tables.top_ops(ops), state.unit, first=OPS_FIRST),
        table_title="Ops" + in_step(state.step),
        facts=facts,
        rebuild=rebuild,
    )
    wrappers = tables.top_wrappers(ops, state.top)
    if not wrappers.empty:  # apart from the ops: their totals hold the ops inside
        section.extra.append(
            (
                "Annotations and wrappers (DataLoader, optimizer; their time holds the ops above)",
                display_table(wrappers, state.unit),
            )
        )
    return section


def _memory(data: TraceData, state: ViewState) -> Section:
    memory = data.memory
    peaks = tables.peaks_of(data.memory_peaks_where(), state.step)
    facts = [
        (
            (f"rank {row['rank']} · " if data.several_ranks else "") + f"peak {row['device']}" + in_step(state.step),
            insights.peak_text(row, state.step, device=False)
            + (f" at {fmt_time(float(row['ts']))}" if pd.notna(row["ts"]) else "")
            + "".join(f" · {v}" for v in (row["op"], row["layer"], row.get("where")) if isinstance(v, str) and v),
        )
        for _, row in peaks.iterrows()
    ]
    spans = data.layer_spans if not memory.empty else None
    figs = [
        figures.memory_timeline(
            memory, data.steps, spans=spans, step=state.step, unit=state.unit, peaks=data.memory_peaks
        )
    ]
    categories = data.memory_categories
    if not categories.empty:
        figs.append(
            figures.memory_categories(
                categories,
                data.steps,
                step=state.step,
                unit=state.unit,
                x_range=(figs[0].layout.meta or {}).get("x_range"),
            )
        )
    uncounted = categories.attrs.get("uncounted") or {}
    for rank, held in uncounted.items():
        facts.append(
            (
                (f"rank {rank} · " if data.several_ranks else "") + "not in the allocator's totals",
                ", ".join(f"{name.replace('_', ' ')} {fmt_bytes(b)}" for name, b in held.items())
                + " of tensors made before the capture (the CPU allocator counts only blocks allocated while "
                "profiling)",
            )
        )
    meta = figs[0].layout.meta or {}
    if meta.get("spans"):
        facts.append(
            (
                "layer spans",
                f"{meta['spans']:,} forward/backward spans of the top-level layers"
                + (f" (the longest of {meta['spans_total']:,})" if meta.get("spans_total", 0) > meta["spans"] else ""),
            )
        )
    allocations = tables.select_step(data.allocations_where(), state.step).head(5000)
    if not allocations.empty and "addr" in allocations and allocations["addr"].isna().all():
        # old-style [memory] events carry no address: no allocation is paired with its free
        allocations = allocations.drop(columns=[c for c in UNPAIRED_COLUMNS if c in allocations])
        facts.append(("lifetimes", "unknown: these memory events carry no address to pair an allocation with its free"))
    return Section(
        "memory",
        TITLES["memory"],
        figures=figs,
        table=display_table(allocations, state.unit, first=ALLOCATIONS_FIRST, one_rank=not data.several_ranks),
        table_title="Biggest allocations" + in_step(state.step),
        facts=facts,
    )


def _shapes(data: TraceData, state: ViewState) -> Section:
    shapes = data.shapes
    facts = []
    if not shapes.empty and not shapes["input_dims"].astype("string").fillna("").str.len().gt(0).any():
        facts.append(("input shapes", "none in this trace (recorded without record_shapes=True): ops by name only"))
    # a GPU trace ranks op × shapes by GPU time (ties by total CPU time), as its other top lists;
    # by CPU time where none of them launched GPU work
    gpu = data.has_gpu and "gpu_us" in shapes and bool((shapes["gpu_us"] > 0).any())
    order = ["gpu_us", "total_us"] if gpu else ["total_us"]
    ranked = shapes.sort_values(order, ascending=False, kind="stable") if not shapes.empty else shapes
    table = data.shapes_where().sort_values(order, ascending=False, kind="stable") if not shapes.empty else shapes
    return Section(
        "shapes",
        TITLES["shapes"],
        figures=[figures.shapes_bar(ranked, top=state.top, unit=state.unit, metric=order[0])],
        table=display_table(
            table.drop(columns=[] if data.has_gpu else [c for c in ("gpu_us",) if c in shapes]),
            state.unit,
            first=SHAPES_FIRST_GPU if order[0] == "gpu_us" else SHAPES_FIRST,
            one_rank=not data.several_ranks,
        ),
        table_title="Op × input shapes × dtypes",
        facts=facts,
    )


def _roofline(data: TraceData, state: ViewState) -> Section:
    efficiency = data.efficiency_where()
    facts = []
    devices = efficiency["device"].dropna().astype(str).unique().tolist() if not efficiency.empty else []
    if devices:
        facts.append(
            ("device", ", ".join(devices) + " (peaks from the vendor datasheets: tracemagic.analysis.devices)")
        )
    elif not efficiency.empty:
        facts.append(
            ("device", "not recognised: pass its peaks, trace.efficiency(peaks={'bf16': ..., 'tbytes_per_s': ...})")
        )
    if not efficiency.empty:
        modelled, total = tables.modelled_gpu_us(efficiency)
        facts.append(
            ("modelled", f"{fmt_time(modelled)} of {fmt_time(total)} GPU time in ops with shapes has a cost model")
        )
    return Section(
        "roofline",
        TITLES["roofline"],
        figures=[figures.roofline(efficiency, unit=state.unit)],
        table=display_table(efficiency, state.unit, first=ROOFLINE_FIRST, one_rank=not data.several_ranks),
        table_title="Op × input shapes × dtypes against the device roofline (flops and bytes per call)",
        facts=facts,
        bullets=insights.roofline_bullets(efficiency),
    )


def _kernels(data: TraceData, state: ViewState) -> Section:
    kernels = tables.select_step(data.kernels, state.step)
    return Section(
        "kernels",
        TITLES["kernels"],
        figures=[
            figures.top_kernels_bar(kernels, top=state.top, unit=state.unit),
            figures.top_kernels_bar(kernels, top=state.top, by_op=True, unit=state.unit),
        ],
        table=display_table(kernel_names(data.kernel_table(kernels)), state.unit, first=KERNELS_FIRST),
        table_title="Kernels by kernel + launching op" + in_step(state.step),
    )


def _flame(data: TraceData, state: ViewState) -> Section:
    """The call tree as a flame graph (user code only where the trace has user frames) and
    the functions (``source()``) as the table."""
    functions = data.source
    user_rows = functions[functions["user"]] if len(functions) else functions
    user_only = len(user_rows) > 0
    tree = data.call_tree(user_only)
    facts = [
        (
            "frames",
            "user code only: library frames (torch, the standard library, built-ins) are hidden, "
            "what ran inside them hangs below the nearest user frame"
            if user_only
            else "every frame"
            if len(functions)
            else "no Python frames or call stacks: ops and kernels only",
        )
    ]
    cells = data.cells
    figs = [
        figures.flame(
            tree,
            unit=state.unit,
            title="Call tree by CPU time" + (", user code only" if user_only else "") + " (click a box to zoom)",
            cells=cells,
        )
    ]
    if data.has_gpu:
        figs.append(
            figures.flame(
                tree,
                metric="gpu",
                unit=state.unit,
                title="GPU time by launching stack" + (", user code only" if user_only else ""),
                cells=cells,
            )
        )
    table = (user_rows if user_only else functions).drop(columns=["name"])
    if cells and len(table):  # a notebook cell's file as tracebacks name it (``Cell In[3]``)
        table = table.assign(file=[cell_file(f, cells) if isinstance(f, str) else f for f in table["file"]])
    return Section(
        "flame",
        TITLES["flame"],
        figures=figs,
        table=display_table(table, state.unit, first=FLAME_FIRST, one_rank=not data.several_ranks),
        table_title=("User functions" if user_only else "Functions and call-site lines")
        + " (cpu = inclusive, self = not in a child Python frame; trace.source() has them all)",
        facts=facts,
    )


def _ranks(data: TraceData, state: ViewState) -> Section:
    ranks = data.ranks
    facts = []
    straggler = insights.straggler(ranks)
    if straggler is not None:
        facts.append(("straggler", straggler[1]))
    return Section(
        "ranks",
        TITLES["ranks"],
        figures=[
            figures.rank_breakdown(ranks, unit=state.unit),
            figures.rank_step_heatmap(data.steps, unit=state.unit),
        ],
        table=display_table(ranks, state.unit),
        table_title="Ranks",
        facts=facts,
    )


def _graph(data: TraceData, state: ViewState) -> Section:
    steps = data.et_steps
    facts: list[tuple[str, str]] = []
    if state.step is not None and state.step in steps:
        step: int | None = state.step
    elif steps:
        step = steps[0]
        facts.append(
            (
                "step",
                f"{step} ("
                + (f"{step_name(state.step)} is not in the Execution Trace; " if state.step is not None else "")
                + "pick a step to see another)",
            )
        )
    else:
        step = None
    nodes, edges = data.et_graph(step)
    if "et_graph" in data.problems:
        facts.append(("Execution Trace", f"could not be read: {data.problems['et_graph']}"))
    total = len(nodes)
    if total:
        timed = int(nodes["dur"].notna().sum()) if "dur" in nodes else 0
        facts += [
            (
                "ops",
                f"{total:,} (outermost operators"
                + (f"; the first {GRAPH_MAX_NODES:,} drawn" if total > GRAPH_MAX_NODES else "")
                + ")",
            ),
            ("data dependencies", f"{len(edges):,}"),
            ("timed by Kineto", f"{timed:,} of {total:,} ({100 * timed / total:.0f}%)"),
        ]
    fig = figures.op_graph(nodes, edges, step=step, max_nodes=GRAPH_MAX_NODES, unit=state.unit)
    table = nodes.copy()
    if total:
        table["reads_from"] = table["id"].map(edges["dst"].value_counts()).fillna(0).astype(int)
        table["feeds"] = table["id"].map(edges["src"].value_counts()).fillna(0).astype(int)
        table = table.drop(columns=[c for c in ("ts", "row", "depth", "step") if c in table])
    return Section(
        "graph",
        TITLES["graph"],
        figures=[fig],
        table=display_table(table, state.unit),
        table_title="Execution Trace ops" + in_step(step),
        facts=facts,
        bullets=[
            "Ops are the Execution Trace's outermost operators; a line joins an op to the op that produced a "
            "tensor it reads (Chakra's data dependencies); colors are durations from the Kineto trace."
        ],
    )


def _compare(data: TraceData, state: ViewState, other: TraceData) -> Section:
    diff = data.diff(other)
    facts = [("A", data.name), ("B", other.name)]
    change = tables.mean_step_change(data.steps, other.steps)
    if change is not None:
        facts.append(("mean step", f"{fmt_time(change[0])} → {fmt_time(change[1])} ({change[2]:+.0f}%)"))
    frame = tables.biggest_changes(diff)
    if not (data.has_gpu or other.has_gpu):  # two CPU traces: their GPU columns are zeros
        frame = frame.drop(columns=[c for c in ("gpu_us_a", "gpu_us_b") if c in frame])
    return Section(
        "compare",
        TITLES["compare"],
        figures=[
            figures.diff_bars(diff, level="op", top=state.top, unit=state.unit),
            figures.diff_bars(diff, level="layer", top=state.top, unit=state.unit),
        ],
        table=display_table(frame, state.unit),
        table_title="Ops and layers, A vs B",
        facts=facts,
    )


def _source(data: TraceData, state: ViewState) -> Section:
    lines = data.lines
    frame = cell_lines.listing(lines, data.cell_lines)
    steps, step_us = lines.attrs.get("steps", 0), lines.attrs.get("step_us", 0.0)
    facts = [
        (
            "lines",
            f"{len(lines):,} lines of the cell ran marked statements in the {steps:,} steps counted "
            f"(mean step {fmt_time(float(step_us))}); figures are per step",
        ),
        (
            "nesting",
            "a line's CPU, GPU and memory hold its nested lines' (the body of a for/if/with); "
            "self CPU and the heat colours do not",
        ),
    ]
    if "lines" in data.problems:
        facts.append(("lines", f"could not be computed: {data.problems['lines']}"))
    table = frame.rename(columns={"text": "code"})
    if "parent_line" in table:  # -1: a top-level statement, shown blank
        table["parent_line"] = table["parent_line"].astype("Int64").mask(table["parent_line"] < 0)
    if not data.has_gpu:
        table = table.drop(columns=[c for c in ("gpu_us", "self_gpu_us") if c in table])
    return Section(
        "source",
        TITLES_SOURCE,
        figures=[cell_lines.lines_bar(frame, unit=state.unit, has_gpu=data.has_gpu, top=state.top)],
        side=cell_lines.listing_html(frame, unit=state.unit, has_gpu=data.has_gpu),
        table=display_table(table, state.unit),
        table_title="Lines of the cell",
        facts=facts,
    )


TITLES_SOURCE = "Source"

#: every tab in display order: key -> ``Tab``
TABS: dict[str, Tab] = {
    tab.key: tab
    for tab in (
        Tab("overview", "Overview", _overview),
        Tab("layers", "Layers", _layers),
        Tab("timeline", "Timeline", _timeline),
        Tab("memory", "Memory", _memory),
        Tab("source", TITLES_SOURCE, _source, available=lambda data, other: data.has_line_marks, whole_trace=True),
        Tab("shapes", "Shapes", _shapes, whole_trace=True),
        Tab("roofline", "Roofline", _roofline, available=lambda data, other: data.has_gpu, whole_trace=True),
        Tab("kernels", "Kernels", _kernels, available=lambda data, other: data.has_gpu),
        Tab("flame", "Flame", _flame, whole_trace=True),
        Tab("ranks", "Ranks", _ranks, available=lambda data, other: data.several_ranks, whole_trace=True),
        Tab("graph", "Graph", _graph, available=lambda data, other: data.has_et),
        Tab(
            "compare",
            "Compare",
            _compare,
            available=lambda data, other: other is not None,
            whole_trace=True,
            needs_other=True,
        ),
    )
}
#: key -> title, in display order
TITLES: dict[str, str] = {key: tab.title for key, tab in TABS.items()}
#: tabs whose content depends on the selected step: all (those in ``WHOLE_TRACE`` say so)
STEP_DEPENDENT = frozenset(TABS)
#: tabs that show every step whatever the selector says (their facts say so while a step is selected)
WHOLE_TRACE = frozenset(key for key, tab in TABS.items() if tab.whole_trace)
