"""The Source tab's listing: the captured cell's own text, each line with its figures
(``trace.lines()``), heat-coloured; and the hottest line the Overview names."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tracemagic.views._format import fmt_bytes, fmt_time, shorten, unit_divisor

#: the listing's columns: lines() column -> header
COLUMNS = {
    "line": "line",
    "text": "code",
    "cpu_us": "CPU",
    "self_cpu_us": "self CPU",
    "gpu_us": "GPU",
    "step_pct": "% of step",
    "calls": "calls/step",
    "alloc_bytes": "allocated/step",
    "peak_bytes": "live at peak",
}
#: white to red: the share of the hottest line
_COLD, _HOT = np.array([255, 255, 255]), np.array([214, 39, 40])


def listing(lines: pd.DataFrame, cell: dict[int, str]) -> pd.DataFrame:
    """Every line of the cell (``cell``: its text by line) with its ``lines()`` row, in line
    order; NaN figures for lines that ran no marked statement in the steps (blank lines,
    comments, ``def`` bodies, code before or after the loop). Without the cell's text, the
    ``lines()`` rows alone."""
    numbers = sorted(set(cell) | set(lines["line"].astype(int).tolist()))
    frame = pd.DataFrame({"line": np.asarray(numbers, dtype=np.int64)})
    out = frame.merge(lines.drop(columns=["text"]), on="line", how="left")
    out.insert(1, "text", pd.array([cell.get(n, "") if n in cell else _text_of(lines, n) for n in numbers], dtype="str"))
    out.attrs.update(lines.attrs)
    return out


def _text_of(lines: pd.DataFrame, number: int) -> str:
    hit = lines.loc[lines["line"] == number, "text"]
    return str(hit.iloc[0]) if len(hit) else ""


def _heat(values: np.ndarray) -> list[str]:
    """A fill colour per value: white for 0 or none, red for the largest."""
    values = np.nan_to_num(values.astype(float), nan=0.0)
    top = float(values.max(initial=0.0))
    share = values / top if top > 0 else np.zeros(values.size)
    colours = _COLD + np.outer(np.clip(share, 0, 1) * 0.75, _HOT - _COLD)
    return [f"rgb({int(r)},{int(g)},{int(b)})" for r, g, b in colours]


def source_listing(frame: pd.DataFrame, *, unit: str = "ms", has_gpu: bool = False) -> go.Figure:
    """The cell as a table: each line's code and figures, the time cells heat-coloured by
    the line's own (self) time, the memory cells by bytes live at the peak.

    Args:
        frame: :func:`listing`.
        unit: time unit of the time columns.
        has_gpu: show the GPU column.
    """
    div = unit_divisor(unit)
    shown = [c for c in COLUMNS if c != "gpu_us" or has_gpu]

    def fmt(column: str, value: object) -> str:
        if value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA:
            return ""
        if column == "line":
            return str(int(value))  # type: ignore[call-overload]
        if column == "text":
            return str(value).replace(" ", "\u00a0")  # keep the indentation
        number = float(value)  # type: ignore[arg-type]
        if column.endswith("_us"):
            return f"{number / div:,.3f}"
        if column == "step_pct":
            return f"{number:.1f}%"
        if column == "calls":
            return f"{number:g}"
        return fmt_bytes(number)

    cells = [[fmt(c, v) for v in frame[c].tolist()] for c in shown]
    self_cpu = frame["self_cpu_us"].to_numpy(dtype=float, na_value=np.nan)
    self_gpu = frame["self_gpu_us"].to_numpy(dtype=float, na_value=np.nan)
    peak = frame["self_peak_bytes"].to_numpy(dtype=float, na_value=np.nan)
    white = ["rgb(255,255,255)"] * len(frame)
    cpu_heat, gpu_heat, mem_heat = _heat(self_cpu), _heat(self_gpu), _heat(peak)
    code_heat = _heat(np.fmax(np.nan_to_num(self_gpu) / max(np.nanmax(self_gpu, initial=0), 1e-12),
                              np.nan_to_num(self_cpu) / max(np.nanmax(self_cpu, initial=0), 1e-12))
                      if has_gpu else self_cpu)
    fills = {"text": code_heat, "cpu_us": cpu_heat, "self_cpu_us": cpu_heat, "step_pct": cpu_heat, "gpu_us": gpu_heat,
             "alloc_bytes": mem_heat, "peak_bytes": mem_heat}
    headers = [COLUMNS[c] + (f" ({unit})" if c.endswith("_us") else "") for c in shown]
    fig = go.Figure(go.Table(
        columnwidth=[40 if c == "line" else 420 if c == "text" else 90 for c in shown],
        header=dict(values=headers, align=["right" if c != "text" else "left" for c in shown], fill_color="#f0f0f0"),
        cells=dict(values=cells, align=["right" if c != "text" else "left" for c in shown],
                   fill_color=[fills.get(c, white) for c in shown],
                   font=dict(family=["monospace" if c == "text" else "sans-serif" for c in shown], size=12)),
    ))
    fig.update_layout(title="The cell, line by line (per mean step; a line's time holds its nested lines')",
                      height=min(120 + 24 * len(frame), 900), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def hottest(lines: pd.DataFrame, *, has_gpu: bool = False) -> pd.Series | None:
    """The ``lines()`` row with the most own time (GPU where the trace has GPU work beneath
    the lines, else CPU); None without rows."""
    if lines.empty:
        return None
    column = "self_gpu_us" if has_gpu and float(lines["self_gpu_us"].max()) > 0 else "self_cpu_us"
    return lines.loc[lines[column].astype(float).idxmax()]


def hottest_text(lines: pd.DataFrame, *, has_gpu: bool = False) -> str | None:
    """The Overview's fact naming the hottest line: ``line 7 `y = model(x)`: 3.1 ms CPU
    (42% of the step), 2.0 ms GPU``; None without line marks."""
    row = hottest(lines, has_gpu=has_gpu)
    if row is None:
        return None
    code = shorten(str(row["text"]).strip(), 60)
    text = f"line {int(row['line'])}" + (f" `{code}`" if code else "")
    own, total = float(row["self_cpu_us"]), float(row["cpu_us"])
    pct = f"{float(row['step_pct']):.0f}% of the step" if pd.notna(row["step_pct"]) else ""
    if total - own > 0.01 * total + 0.01:  # a compound line: its nested lines' time is not its own
        text += f": {fmt_time(own)} CPU per step of its own" + (f", {pct} with its nested lines" if pct else "")
    else:
        text += f": {fmt_time(own)} CPU per step" + (f" ({pct})" if pct else "")
    if has_gpu and float(row["gpu_us"]) > 0:
        text += f", {fmt_time(float(row['gpu_us']))} GPU"
    return text
