"""The Source tab's listing: the captured cell's own text, each line with its figures
(``trace.lines()``), heat-coloured; and the hottest line the Overview names."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tracemagic.views._format import esc, fmt_bytes, fmt_time, shorten, unit_divisor
from tracemagic.views.figures import RIGHT_PX, tick_margin

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
    texts = [cell[n] if n in cell else _text_of(lines, n) for n in numbers]
    out.insert(1, "text", pd.array(texts, dtype="str"))
    out.attrs.update(lines.attrs)
    return out


def _text_of(lines: pd.DataFrame, number: int) -> str:
    hit = lines.loc[lines["line"] == number, "text"]
    return str(hit.iloc[0]) if len(hit) else ""


def _heat(values: np.ndarray) -> list[str]:
    """A background colour per value: white for 0 or none, red for the largest."""
    values = np.nan_to_num(values.astype(float), nan=0.0)
    top = float(values.max(initial=0.0))
    share = values / top if top > 0 else np.zeros(values.size)
    colours = _COLD + np.outer(np.clip(share, 0, 1) * 0.75, _HOT - _COLD)
    return [f"rgb({int(r)},{int(g)},{int(b)})" for r, g, b in colours]


def _cell(column: str, value: object, div: float) -> str:
    """One figure of the listing as text ("" for none)."""
    if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
        return ""
    number = float(value)  # type: ignore[arg-type]
    if column == "line":
        return str(int(number))
    if column.endswith("_us"):
        return f"{number / div:,.3f}"
    if column == "step_pct":
        return f"{number:.1f}%"
    if column == "calls":
        return f"{number:,.2f}".rstrip("0").rstrip(".")
    return fmt_bytes(number)


def listing_html(frame: pd.DataFrame, *, unit: str = "ms", has_gpu: bool = False) -> str:
    """The cell as an HTML table (no script, every text escaped): each line's code, as
    indented as written (a line too long for the width wraps, so that the figures stay in
    sight), and its figures; the code and time cells heat-coloured by the line's own (self)
    time, the memory cells by the bytes it holds at the peak.

    Args:
        frame: :func:`listing`.
        unit: time unit of the time columns.
        has_gpu: show the GPU column (and colour the code by GPU time too).
    """
    div = unit_divisor(unit)
    shown = [c for c in COLUMNS if c != "gpu_us" or has_gpu]
    self_cpu = frame["self_cpu_us"].to_numpy(dtype=float, na_value=np.nan)
    self_gpu = frame["self_gpu_us"].to_numpy(dtype=float, na_value=np.nan)
    held = frame["self_peak_bytes"].to_numpy(dtype=float, na_value=np.nan)
    cpu_heat, gpu_heat, mem_heat = _heat(self_cpu), _heat(self_gpu), _heat(held)
    both = np.fmax(
        np.nan_to_num(self_cpu) / max(float(np.nanmax(self_cpu, initial=0.0)), 1e-12),
        np.nan_to_num(self_gpu) / max(float(np.nanmax(self_gpu, initial=0.0)), 1e-12) if has_gpu else 0.0,
    )
    heats = {
        "text": _heat(both),
        "cpu_us": cpu_heat,
        "self_cpu_us": cpu_heat,
        "step_pct": cpu_heat,
        "gpu_us": gpu_heat,
        "alloc_bytes": mem_heat,
        "peak_bytes": mem_heat,
    }
    head = "".join(f"<th>{esc(COLUMNS[c] + (f' ({unit})' if c.endswith('_us') else ''))}</th>" for c in shown)
    rows = []
    records = frame[shown].to_dict("records")
    for i, record in enumerate(records):
        cells = []
        for c in shown:
            style = f' style="background:{heats[c][i]}"' if c in heats else ""
            if c == "text":
                cells.append(f'<td class="tm-code"{style}><code>{esc(str(record[c]))}</code></td>')
            else:
                cells.append(f'<td class="tm-num"{style}>{esc(_cell(c, record[c], div))}</td>')
        rows.append(f'<tr data-line="{int(record["line"])}">{"".join(cells)}</tr>')
    return (
        '<div class="tm-source"><style>.tm-source{overflow-x:auto}'
        ".tm-source table{border-collapse:collapse;font-size:12px}"
        ".tm-source td,.tm-source th{padding:1px 6px;border-bottom:1px solid #eee;white-space:nowrap}"
        # headers wrap ("allocated/step" over two lines): they, not the figures, set the columns' widths
        ".tm-source th{white-space:normal;vertical-align:bottom}"
        # a long line wraps (its indent kept) so the figures' columns stay in sight at 1024 px; at
        # words first, and never narrower than a short statement (it broke ``loss = model(x)``
        # into five lines of a few letters where the figures took the width); a listing wider
        # than its panel scrolls in it
        ".tm-source .tm-num{text-align:right}.tm-source td.tm-code{white-space:normal;min-width:10em}"
        ".tm-source .tm-code code{white-space:pre-wrap;overflow-wrap:break-word}</style>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def lines_bar(frame: pd.DataFrame, *, unit: str = "ms", has_gpu: bool = False, top: int = 15) -> go.Figure:
    """The ``top`` lines by own time as horizontal bars (self CPU; self GPU beside it on a GPU)."""
    div = unit_divisor(unit)
    ran = frame[frame["self_cpu_us"].notna()]
    if ran.empty:
        fig = go.Figure()
        fig.update_layout(title="No marked line ran in the steps")
        return fig
    key = "self_gpu_us" if has_gpu and float(ran["self_gpu_us"].max()) > 0 else "self_cpu_us"
    ran = ran.sort_values(key, ascending=False).head(top).iloc[::-1]
    labels = [f"L{int(n)} {shorten(str(t).strip(), 40)}" for n, t in zip(ran["line"], ran["text"])]
    fig = go.Figure()
    fig.add_bar(
        name="self CPU",
        y=labels,
        x=ran["self_cpu_us"].to_numpy(dtype=float) / div,
        orientation="h",
        marker_color="#1f77b4",
        hovertemplate=f"%{{y}}<br>self CPU %{{x:.3f}} {unit} per step<extra></extra>",
    )
    if has_gpu:
        fig.add_bar(
            name="self GPU",
            y=labels,
            x=ran["self_gpu_us"].to_numpy(dtype=float) / div,
            orientation="h",
            marker_color="#2ca02c",
            hovertemplate=f"%{{y}}<br>self GPU %{{x:.3f}} {unit} per step<extra></extra>",
        )
    fig.update_layout(
        title="Lines by their own time per step (nested lines apart)",
        barmode="group",
        xaxis_title=f"{unit} per step",
        height=max(260, 40 + 26 * len(ran)),
        # as wide as the labels: plotly's automargin widening it would draw the figure twice
        # (on the right the legend of the two bars: "self CPU", "self GPU", else half the
        # last x tick label, whose width depends on the times)
        margin={"l": tick_margin(labels, least=10), "r": 120 if len(fig.data) > 1 else RIGHT_PX, "t": 50, "b": 56},
        yaxis={"automargin": True},
    )
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
