"""The text summary: steps, top layers, top ops, peak memory and recommendations as a
terminal table (the dashboard's ``text/plain`` fallback and ``tracemagic summary``)."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from tracemagic.views import cell_lines, insights, tables
from tracemagic.views._format import fmt_bytes, fmt_time, kernel_label, shorten
from tracemagic.views.data import TraceData

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace import TraceTables

#: short column names of the step parts for narrow terminals
SHORT_PARTS = {
    "compute_us": "kernels",
    "comm_us": "comm",
    "memcpy_us": "memcpy",
    "memset_us": "memset",
    "runtime_us": "runtime",
    "dataloader_us": "data",
    "cpu_us": "CPU only",
    "idle_us": "idle",
}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def clean(text: object) -> str:
    """Text safe for a terminal: control characters (ANSI escapes included) and the line
    and paragraph separators become ``?``; invisible format characters (Unicode category
    ``Cf``: the bidirectional embeddings, overrides and isolates U+202A–U+202E and
    U+2066–U+2069, marks, zero-width characters, the BOM, ...) are removed, so a name
    cannot reorder or hide the text shown around it."""
    text = _CONTROL.sub("?", str(text))
    if text.isascii():
        return text
    return "".join(ch for ch in text if unicodedata.category(ch) != "Cf")


def render_table(
    rows: Sequence[Sequence[object]], headers: Sequence[str], width: int, *, flex: int | None = 0
) -> list[str]:
    """Rows as aligned text lines no wider than ``width``.

    Column ``flex`` (the name column) is left-aligned and cut to fit; the others are
    right-aligned. ``flex=None``: all right-aligned, nothing cut.
    """
    cells = [[clean(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    if flex is not None:
        fixed = sum(w for i, w in enumerate(widths) if i != flex) + 2 * (len(headers) - 1)
        widths[flex] = max(8, min(widths[flex], width - fixed))

    def line(values: Sequence[str]) -> str:
        out = []
        for i, (v, w) in enumerate(zip(values, widths)):
            v = shorten(v, w)
            out.append(v.ljust(w) if i == flex else v.rjust(w))
        return "  ".join(out).rstrip()

    lines = [line(list(headers)), line(["─" * w for w in widths]), *(line(r) for r in cells)]
    return [shorten(text, width) for text in lines]


def summary(trace: TraceTables | TraceData, width: int = 100, *, top: int = 10) -> str:
    """A plain-text summary of a trace.

    Args:
        trace: a loaded ``Trace`` (or the ``TraceData`` a dashboard already holds).
        width: the most characters per line.
        top: rows in the top layers and top ops tables.

    Returns:
        Lines: a header of facts, the steps with their breakdown, the top layers, the top
        ops by self time, the peak memory per device and the recommendations.
    """
    data = trace if isinstance(trace, TraceData) else TraceData(trace)
    width = max(int(width), 40)
    out: list[str] = []
    title = f"tracemagic · {clean(data.name)}"
    out += [shorten(title, width), "═" * min(len(title), width)]
    for label, value in insights.facts(data)[1:]:
        out.append(shorten(f"{label:>12}: {clean(value)}", width))
    if data.has_line_marks and (hot := cell_lines.hottest_text(data.lines, has_gpu=data.has_gpu)):
        out.append(shorten(f"{'hottest line':>12}: {clean(hot)}", width))

    steps = data.steps
    if not steps.empty:
        several = data.several_ranks
        gpu = tables.part_names(steps) is tables.STEP_PARTS
        short = SHORT_PARTS if gpu else {**SHORT_PARTS, "cpu_us": "CPU ops"}
        cols = [c for c in tables.STEP_PARTS if c in steps and (steps[c] >= 0.005 * steps["window_dur"]).any()]
        headers = (["rank"] if several else []) + ["step", "time"] + [short[c] for c in cols]
        frame = steps.sort_values(["rank", "step"]).head(40)
        rows = [
            ([str(int(r["rank"]))] if several else [])
            + [str(int(r["step"])), fmt_time(float(r["window_dur"]), "ms")]
            + [
                f"{100 * float(r[c]) / float(r['window_dur']):.0f}%" if float(r["window_dur"]) > 0 else "–"
                for c in cols
            ]
            for _, r in frame.iterrows()
        ]
        caption = (
            "Steps (share of each step's device window; kernels = GPU kernels, CPU only = host work, GPU idle)"
            if gpu
            else "Steps (share of each step)"
        )
        out += ["", shorten(caption, width)] + render_table(rows, headers, width, flex=None)
        if len(steps) > len(frame):
            out.append(f"… {len(steps) - len(frame)} more steps")

    layers = data.layers
    if not layers.empty:
        metric = tables.layer_metric(layers)
        frame = tables.top_layers(layers, top)
        gpu = data.has_gpu  # a CPU-only trace has no GPU column to show
        rows = [
            [r["layer"], str(r.get("type", "")), f"{int(r['calls']):,}", fmt_time(float(r["cpu_us"]), "ms")]
            + ([fmt_time(float(r["gpu_us"]), "ms")] if gpu else [])
            for _, r in frame.iterrows()
        ]
        headers = ["layer", "type", "calls", "CPU"] + (["GPU"] if gpu else [])
        out += ["", f"Top layers (by {metric[:3].upper()} time)"] + render_table(rows, headers, width)

    ops = tables.top_ops(data.ops, top)
    if not ops.empty:
        rows = [
            [
                r["name"],
                f"{int(r['calls']):,}",
                fmt_time(float(r["self_us"]), "ms"),
                fmt_time(float(r["total_us"]), "ms"),
                f"{float(r['self_pct']):.1f}%",
            ]
            for _, r in ops.iterrows()
        ]
        out += ["", "Top ops (by self CPU time)"] + render_table(
            rows, ["op", "calls", "self", "total", "self %"], width
        )

    if data.has_gpu:
        kern = tables.top_kernels(data.kernels, min(top, 5))
        if not kern.empty:
            rows = [
                [
                    kernel_label(r["name"], width) if r["kind"] == "kernel" else r["name"],
                    f"{int(r['calls']):,}",
                    fmt_time(float(r["total_us"]), "ms"),
                    f"{float(r['pct']):.1f}%",
                ]
                for _, r in kern.iterrows()
            ]
            out += ["", "Top kernels (by GPU time)"] + render_table(rows, ["kernel", "calls", "total", "GPU %"], width)

    peaks = tables.peaks_of(data.memory_peaks)
    if not peaks.empty:
        rows = [
            [
                (f"rank {int(r['rank'])} · " if data.several_ranks else "") + str(r["device"]),
                fmt_bytes(r["peak_bytes"]),
                fmt_bytes(r["start_bytes"]),
                _where(r),
            ]
            for _, r in peaks.iterrows()
        ]
        out += ["", "Peak memory (allocated; at start = already allocated when the capture began)"]
        out += render_table(rows, ["device", "peak", "at start", "reached in"], width, flex=3)

    tips = insights.for_trace(data)
    if tips:
        out += ["", "Recommendations"] + [shorten(f"• {clean(t)}", width) for t in tips]
    for name, problem in data.problems.items():
        out.append(shorten(f"! {name} unavailable: {clean(problem)}", width))
    return "\n".join(out)


def _where(row: pd.Series) -> str:
    parts = [str(v) for v in (row.get("op"), row.get("layer")) if isinstance(v, str) and v]
    return " in ".join(parts)


def diff_summary(a: TraceTables | TraceData, b: TraceTables | TraceData, width: int = 100, *, top: int = 15) -> str:
    """A plain-text comparison of two traces: mean step time and the biggest changes by op
    and by layer (``trace.diff``), A being the baseline."""
    da = a if isinstance(a, TraceData) else TraceData(a)
    db = b if isinstance(b, TraceData) else TraceData(b)
    width = max(int(width), 40)
    out = [shorten(f"tracemagic diff · A = {clean(da.name)} · B = {clean(db.name)}", width)]
    change = tables.mean_step_change(da.steps, db.steps)
    if change is not None:
        out.append(f"mean step: {fmt_time(change[0])} → {fmt_time(change[1])} ({change[2]:+.1f}%)")
    diff = da.diff(db)
    for level in ("op", "layer"):
        frame = tables.biggest_changes(diff, level, top)
        if frame.empty:
            continue
        rows = [
            [
                r["name"],
                str(r["status"]),
                fmt_time(_num(r["us_a"]), "ms"),
                fmt_time(_num(r["us_b"]), "ms"),
                f"{_num(r['delta_us']) / 1000:+,.3f} ms",
            ]
            for _, r in frame.iterrows()
        ]
        out += ["", f"Biggest changes by {level} (B − A)"] + render_table(rows, [level, "status", "A", "B", "Δ"], width)
    if diff.empty:
        out.append("no differences found (or the diff analysis is unavailable)")
    for name, problem in {**da.problems, **db.problems}.items():
        out.append(shorten(f"! {name} unavailable: {clean(problem)}", width))
    return "\n".join(out)


def _num(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if number != number else number
