"""The recommendations (the rows of ``tracemagic.analysis.advice``, picked here) and the
Overview's headline facts, as text.

Plain text (no markup): the views escape it where they show it.
"""

from __future__ import annotations

import pandas as pd

from tracemagic.analysis import advice as _advice
from tracemagic.views import tables
from tracemagic.views._format import fmt_bytes, fmt_count, fmt_pct, fmt_time, in_step, step_name
from tracemagic.views.data import TraceData

#: the advice's rules and thresholds (re-exported: the views' older names)
OP_ADVICE = _advice.OP_ADVICE
CPU_OP_ADVICE = _advice.CPU_OP_ADVICE
straggler = _advice.straggler


def recommendations(
    steps: pd.DataFrame,
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    peaks: pd.DataFrame | None = None,
    ranks: pd.DataFrame | None = None,
    *,
    device_memory_bytes: float | None = None,
    limit: int = 6,
) -> list[str]:
    """Up to ``limit`` one-line recommendations, most important first: the ``text`` of the
    rows ``tracemagic.analysis.advice.evaluate`` gives for these tables, or the line saying
    none fired with the closest figures (``advice.lines``).

    Args:
        steps: ``trace.steps()``.
        ops: ``trace.ops()``.
        kernels: ``trace.kernels()`` (None or empty without a GPU).
        peaks: ``trace.memory_peaks()`` rows of the scope (``tables.peaks_of``).
        ranks: ``trace.ranks()`` (for several ranks).
        device_memory_bytes: the GPU's memory, to flag a peak close to it.
        limit: the most recommendations returned.
    """
    rows = _advice.evaluate(steps, ops, kernels, peaks, ranks, device_memory_bytes=device_memory_bytes)
    return _advice.lines(rows, limit)


def facts(data: TraceData, step: int | None = None) -> list[tuple[str, str]]:
    """Headline (label, value) pairs for the Overview: devices, ranks, steps, step time
    and its breakdown, kernels, peak memory, events; of one step given ``step``.

    Per-step figures are those of one rank's step, as ``steps()`` rows (one per rank and
    step) give them: the mean step, its shares and the kernels per step (:func:`kernels_text`)
    are means over the rows; counts over the trace (kernels, events, GPU work in flight) are
    totals of all ranks, and the kernels counted are those of the steps."""
    out: list[tuple[str, str]] = [("trace", data.name)]
    counts = pd.Series(data.devices).value_counts()
    devices = ", ".join(f"{n} × {name}" if n > 1 else name for name, n in counts.items())
    memory_bytes = device_memory(data)
    if memory_bytes:
        devices += f" ({fmt_bytes(memory_bytes)} each)" if len(data.devices) > 1 else f" ({fmt_bytes(memory_bytes)})"
    kernels = data.kernels
    if len(data.devices) > 1 and not kernels.empty:  # the metadata lists every GPU the process could see
        used = sorted({int(d) for d in kernels["device"].dropna()})
        if 0 < len(used) < len(data.devices):
            devices += f" visible; work on GPU {', '.join(map(str, used))}"
    out.append(("devices", devices))
    if data.several_ranks:
        out.append(
            (
                "ranks",
                f"{len(data.rank_ids)} ({', '.join(map(str, data.rank_ids[:16]))}"
                f"{'…' if len(data.rank_ids) > 16 else ''})",
            )
        )
    steps = data.steps
    chosen = tables.select_step(steps, step)
    if steps.empty:
        cut = [f"step {s} {tables.UNCOUNTED_ENDS[e]}" for s, e in data.uncounted_steps.items()]
        # a capture whose only steps ended early (the cell raised in its first recorded step)
        out.append(("steps", f"none complete ({'; '.join(cut)})" if cut else "none (no ProfilerStep in the trace)"))
    else:
        mean = tables.step_means(chosen)
        numbered = [s for s in data.step_ids if s >= 0]
        listed = f"{len(numbered)} ({', '.join(map(str, numbered[:12]))}{'…' if len(numbered) > 12 else ''})"
        if len(numbered) < len(data.step_ids):  # step -1: a rank without ProfilerStep, one span
            listed = (
                "none (no ProfilerStep: the whole trace is one span)"
                if not numbered
                else listed + "; ranks without ProfilerStep: one span each (step -1)"
            )
        for end, what in tables.UNCOUNTED_ENDS.items():
            left_out = [str(s) for s, e in data.uncounted_steps.items() if e == end]
            if left_out:
                listed += f"; step {', '.join(left_out)} {what} and is not counted"
        out.append(("steps", listed))
        step_us = float(mean["step_us"])
        if step is None:
            durs = steps["window_dur"].astype(float)
            out.append(
                (
                    "mean step",
                    fmt_time(step_us) + (f" (median {fmt_time(float(durs.median()))})" if len(durs) >= 3 else ""),
                )
            )
        else:
            out.append((step_name(step), fmt_time(step_us) + (" (mean over ranks)" if len(chosen) > 1 else "")))
        share = tables.step_shares(mean)
        parts = [
            (name, float(share[col]))
            for col, name in tables.part_names(steps).items()
            if col in share and float(share[col]) >= 0.005
        ]  # NaN (no step) is never
        out.append(("breakdown", ", ".join(f"{name} {fmt_pct(p)}" for name, p in sorted(parts, key=lambda x: -x[1]))))
        phased = phase_text(data, step)
        if phased:
            out.append(("phases", phased))
        if share["gpu_busy_us"] == share["gpu_busy_us"]:  # NaN without a GPU
            busy = float(share["gpu_busy_us"])
            out.append(("GPU", f"busy {fmt_pct(busy)}, idle {fmt_pct(1.0 - busy)} of the step"))
            if "kernel_busy_us" in share:  # the TensorBoard plugin's figure: kernels alone
                out.append(
                    (
                        "GPU utilization",
                        f"{fmt_pct(float(share['kernel_busy_us']))} (kernels only, the "
                        "TensorBoard plugin's; busy counts memcpy and memset too)",
                    )
                )
        unlaunched = steps.attrs.get("unlaunched") or {}
        if unlaunched:
            events = sum(int(v["events"]) for v in unlaunched.values())
            us = sum(float(v["us"]) for v in unlaunched.values())
            on = f" on rank{'s' if len(unlaunched) > 1 else ''} {', '.join(map(str, sorted(unlaunched)))}"
            out.append(
                (
                    "in flight",
                    f"{events:,} GPU events ({fmt_time(us)}){on if data.several_ranks else ''} running when "
                    "profiling began, in no step",
                )
            )
    kernel_text = kernels_text(tables.kernel_rate(tables.select_step(kernels, step), chosen), step)
    if kernel_text:
        out.append(("kernels", kernel_text))
    peaks = tables.peaks_of(data.memory_peaks, step)
    if not peaks.empty:
        top = peaks.sort_values("peak_bytes", ascending=False).head(4)
        out.append(
            (
                "peak memory" + in_step(step),
                "; ".join(
                    (f"rank {row['rank']} · " if data.several_ranks else "") + peak_text(row, step)
                    for _, row in top.iterrows()
                ),
            )
        )
    if data.has_gpu and step is None:
        gaps = roofline_gaps(data.efficiency, 1)  # only a gap worth ROOFLINE_MIN_SHARE of the GPU time
        if gaps:
            out.append(("furthest below its roof", gaps[0]))
    table = getattr(data.trace, "events", None)
    if table is not None:
        out.append(("events", f"{len(table):,}"))
    return out


def kernels_text(rate: pd.Series, step: int | None = None) -> str:
    """The Overview's kernels (``aggregate.kernel_rate``) as text: those of the steps, per
    step of one rank as the mean step beside it, their mean length, and (all steps) how
    many ran outside the steps, not counted; '' without kernels."""
    count = int(rate["kernels"])
    outside = int(rate["outside"]) if step is None else 0
    if not count and not outside:
        return ""
    per = "per step and rank" if rate["ranks"] > 1 else "per step"
    text = (
        f"{count:,} ({fmt_count(float(rate['per_step']))} {per}, {fmt_time(float(rate['mean_us']))} on average)"
        if count
        else "none in the steps"
    )
    return text + (f"; {outside:,} outside the steps not counted" if outside else "")


def phase_text(data: TraceData, step: int | None = None) -> str:
    """The mean step's phases (``trace.phases()``) as text, largest first: the host's shares
    of the host step, and the GPU time each phase launched; '' without phases."""
    phases = phases_of(data, step)
    if phases is None or phases.empty:
        return ""
    mean = tables.phase_means(phases)
    dur = float(mean["dur"])
    if not dur > 0:
        return ""
    host = sorted(((name, float(mean[f"{p}_us"]) / dur) for p, name in tables.PHASE_NAMES.items()), key=lambda x: -x[1])
    text = ", ".join(f"{name} {fmt_pct(v)}" for name, v in host if v >= 0.005) + " of the host step"
    gpu = {name: float(mean[f"gpu_{p}_us"]) for p, name in tables.PHASE_NAMES.items()}
    if all(v == v for v in gpu.values()) and sum(gpu.values()) > 0:
        text += "; GPU time launched: " + ", ".join(
            f"{name} {fmt_time(v)}" for name, v in sorted(gpu.items(), key=lambda x: -x[1]) if v > 0
        )
    return text


def peak_text(row: pd.Series, step: int | None = None, *, device: bool = True) -> str:
    """One ``memory_peaks()`` row as text: the peak, what was allocated before the scope
    began, and the peak reserved bytes where recorded."""
    text = (f"{row['device']}: " if device else "") + f"{fmt_bytes(row['peak_bytes'])} ("
    text += f"{fmt_bytes(row['start_bytes'])} already allocated at the {'capture' if step is None else 'step'}'s start"
    reserved = row.get("peak_reserved_bytes")
    if reserved is not None and pd.notna(reserved) and float(reserved) > 0:
        text += f"; reserved {fmt_bytes(reserved)}"
    return text + ")"


def roofline_gaps(efficiency: pd.DataFrame, limit: int = 3) -> list[str]:
    """The largest gaps between ops and their roof as text (``analysis.advice.roofline_gaps``:
    those losing at least ``ROOFLINE_MIN_SHARE`` of the GPU time)."""
    return [str(text) for text in _advice.roofline_gaps(efficiency, limit)["text"]]


def roofline_bullets(efficiency: pd.DataFrame, limit: int = 3) -> list[str]:
    """The Roofline tab's bullets: :func:`roofline_gaps`, or, where none loses enough GPU
    time to be named, a line saying so with the largest loss (never nothing)."""
    gaps = roofline_gaps(efficiency, limit)
    if gaps:
        return gaps
    largest = _advice.roofline_gaps(efficiency, 1, min_share=0.0)
    if largest.empty:
        return []
    return [
        f"No op × shape loses {fmt_pct(_advice.ROOFLINE_MIN_SHARE)} of the GPU time of ops with shapes to its "
        f"roof; the largest loss: {largest['evidence'].iloc[0]}."
    ]


def device_memory(data: TraceData) -> float | None:
    """The GPU memory the trace's metadata gives (the first device's), or None."""
    return _advice.device_memory(getattr(data.trace, "devices", []) or [])


def advice(data: TraceData, step: int | None = None) -> pd.DataFrame:
    """``trace.advice(step)``: the same rows, cell lines named (a failed analysis is an empty
    table); a job's summarized ranks (no events) are advised from the tables they hold."""
    key = "advice" if step is None else f"advice:step {step}"
    if not data.summaries_only:
        return data.table(key, compute=lambda: data.trace.table(_advice.advice, *(() if step is None else (step,))))
    return data.table(
        key,
        compute=lambda: _advice.evaluate(
            tables.select_step(data.steps, step),
            tables.select_step(data.ops, step),
            tables.select_step(data.kernels, step) if data.has_gpu else None,
            tables.peaks_of(data.memory_peaks, step),
            data.ranks if data.several_ranks and step is None else None,
            device_memory_bytes=device_memory(data),
            step=step,
        ),
    )


def phases_of(data: TraceData, step: int | None = None) -> pd.DataFrame | None:
    """``trace.phases()`` rows of the loop's steps (:attr:`TraceData.steps`), of ``step`` given
    one; None for a job's summarized ranks (no events)."""
    if data.summaries_only:
        return None
    return tables.of_steps(data.phases, tables.select_step(data.steps, step))


def for_trace(data: TraceData, limit: int = 6, step: int | None = None) -> list[str]:
    """The first ``limit`` recommendations (:func:`advice`'s ``text``) for a ``TraceData``
    (of one step, given ``step``), or the line saying none fired with the closest figures:
    never nothing (``advice.lines``)."""
    return _advice.lines(advice(data, step), limit)
