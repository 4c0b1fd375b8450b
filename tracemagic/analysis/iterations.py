"""Every iteration of a ``%%chakra_trace`` loop, and whether the recorded ones were typical.

The capture times every iteration of the stepped loop, recorded or not (the manifest's
``loop_timing``: ``tracemagic.trace.layout.LoopTiming``); ``iterations(trace)`` (or
``from_manifest``) makes it a table, and :func:`window_check` says whether the steps the
profiler recorded look like the rest of the loop. Nothing here reads a file: the manifest
comes with the trace (``trace.manifest``) or the capture.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd

from tracemagic.analysis._text import fmt_pct
from tracemagic.analysis.schema import TABLES, computes

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import TraceTables

#: the columns of ``iterations()`` (its contract in ``tracemagic.analysis.schema``)
COLUMNS = TABLES["iterations"].names
#: iterations the profiler recorded or prepared (their time holds its overhead)
PROFILED = ("warmup", "active", "slow")
#: ``window_check``: the recorded steps' median differs from the steady state's by this
#: share or more
UNTYPICAL_SHARE = 0.20
#: ``window_check``: the loop's first iterations (compilation, cache warm-up, first
#: allocations): never part of the steady state, and a window holding one of them in a
#: compiled model is not typical whatever its time
FIRST_ITERATIONS = 2
#: ``window_check``: the fewest unrecorded iterations for a steady-state median
MIN_STEADY = 3
#: ``window_check``: the steady state's own spread, as quantiles: a recorded median inside
#: it is typical however far from the median (a noisy loop's steps differ by chance)
STEADY_RANGE = (0.10, 0.90)


def from_manifest(manifest: Mapping[str, Any] | None) -> pd.DataFrame:
    """The ``iterations()`` table of a capture's manifest (empty without ``loop_timing``).

    Columns (``COLUMNS``): ``iteration``, ``wall_ms``, ``gpu_ms`` (NaN without CUDA),
    ``step`` (the ``ProfilerStep`` number it was recorded as, NA if not), ``phase``
    (``skip``, ``wait``, ``warmup``, ``active``, ``after``: past the schedule, ``slow``:
    recorded by ``--slow``), ``slow_ratio`` (an iteration ``--slow`` caught: its time
    over the running median; NaN otherwise) and ``slow_trace`` (the ``k`` of
    ``kineto_trace_<rank>_slow<k>.json`` that recorded it, NA otherwise).
    """
    timing = (manifest or {}).get("loop_timing") or {}
    wall = np.asarray(timing.get("wall_ms") or [], dtype=float)
    n = len(wall)
    gpu = np.full(n, np.nan)
    gpu_ms = timing.get("gpu_ms") or []
    gpu[: min(n, len(gpu_ms))] = np.asarray(gpu_ms[:n], dtype=float)
    phase = np.full(n, "", dtype=object)
    for name, first, count in timing.get("phases") or []:
        phase[int(first) : int(first) + int(count)] = str(name)
    step = pd.array([pd.NA] * n, dtype="Int64")
    for iteration, number in timing.get("recorded") or []:
        if 0 <= int(iteration) < n:
            step[int(iteration)] = int(number)
    ratio = np.full(n, np.nan)
    trace_k = pd.array([pd.NA] * n, dtype="Int64")
    for k, catch in enumerate(timing.get("slow") or [], start=1):
        at, recorded = int(catch.get("iteration", -1)), int(catch.get("recorded", -1))
        if 0 <= at < n:
            ratio[at] = float(catch.get("ratio", np.nan))
        if catch.get("path") and 0 <= recorded < n:
            trace_k[recorded] = k
    return pd.DataFrame(
        {
            "iteration": np.arange(n, dtype="int64"),
            "wall_ms": wall,
            "gpu_ms": gpu,
            "step": step,
            "phase": pd.array(phase.astype(str), dtype="str") if n else pd.array([], dtype="str"),
            "slow_ratio": ratio,
            "slow_trace": trace_k,
        }
    )[COLUMNS]


@computes("iterations")
def iterations(trace: TraceTables) -> pd.DataFrame:
    """Every iteration of the capture's stepped loop (``from_manifest`` of ``trace.manifest``;
    empty for a trace not written by ``%%chakra_trace``)."""
    return from_manifest(getattr(trace, "manifest", None))


class WindowCheck(NamedTuple):
    """Whether the recorded steps look like the loop's steady state.

    Attributes:
        recorded_ms: the median wall time of the recorded (``active``) iterations.
        steady_ms: the median of the unrecorded iterations past the first
            ``FIRST_ITERATIONS`` (the steady state; NaN with fewer than ``MIN_STEADY``).
        change: ``recorded_ms / steady_ms - 1``.
        first: the recorded iterations among the loop's first ``FIRST_ITERATIONS``.
        text: the sentence the Overview shows.
    """

    recorded_ms: float
    steady_ms: float
    change: float
    first: list[int]
    text: str


def window_check(table: pd.DataFrame, compiled: bool = False) -> WindowCheck | None:
    """The note the Overview shows when the recorded steps are not typical of the loop,
    or None when they are (or there is too little to tell).

    Not typical: their median time differs from the steady state's by ``UNTYPICAL_SHARE``
    or more and lies outside the steady state's own ``STEADY_RANGE`` (its 10th to 90th
    percentile: in a noisy loop a median of a few steps differs by chance), or
    (``compiled``: the trace ran ``torch.compile``'d code) they include one of the loop's
    first ``FIRST_ITERATIONS`` iterations. The time compared is the GPU time
    where every iteration has one (CUDA), else the wall time. The recorded steps carry the
    profiler's own overhead (a step of a few ms with many small ops can take 20% longer
    recorded), which the note says; a window on steps that are really different (the
    first, compiling or warming iterations; a periodic checkpoint) differs by far more.

    Args:
        table: ``iterations()``.
        compiled: whether the trace holds compiled regions.
    """
    if table.empty:
        return None
    active = table[table["phase"] == "active"]
    steady = table[~table["phase"].isin(PROFILED) & (table["iteration"] >= FIRST_ITERATIONS)]
    if active.empty:
        return None
    # GPU time where every iteration has one: the profiler's CPU-side overhead barely shows in it
    column = "gpu_ms" if table["gpu_ms"].notna().all() else "wall_ms"
    recorded = float(active[column].median())
    steady_ms = float(steady[column].median()) if len(steady) >= MIN_STEADY else float("nan")
    change = recorded / steady_ms - 1 if steady_ms > 0 else float("nan")
    first = [int(i) for i in active["iteration"] if i < FIRST_ITERATIONS]
    low, high = (float(steady[column].quantile(q)) for q in STEADY_RANGE) if len(steady) else (np.nan, np.nan)
    off = change == change and abs(change) >= UNTYPICAL_SHARE and not low <= recorded <= high
    if not off and not (compiled and first):
        return None
    steps = ", ".join(str(int(s)) for s in active["step"].dropna())
    what = "GPU time" if column == "gpu_ms" else "wall time"
    parts = []
    if off:
        parts.append(
            f"their median {what} {recorded:.3g} ms is {fmt_pct(abs(change))} "
            f"{'above' if change > 0 else 'below'} the loop's steady-state median {steady_ms:.3g} ms "
            f"({len(steady):,} unrecorded iterations; the profiler's own overhead is part of the difference)"
        )
    if compiled and first:
        parts.append(
            f"they include the loop's first iteration(s) {', '.join(map(str, first))} of a compiled model (compilation)"
        )
    text = (
        f"The recorded steps ({steps}) are not typical of the loop: {'; '.join(parts)}. Move the window with "
        "--wait/--skip-first, or see the iteration strip."
    )
    return WindowCheck(recorded, steady_ms, change, first, text)
