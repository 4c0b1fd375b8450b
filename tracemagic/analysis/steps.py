"""``steps()``: one row per ProfilerStep and rank, its wall time partitioned by activity.

The partition follows the TensorBoard plugin's step breakdown: every instant of the step's
wall interval goes to the highest-priority activity running then, in the order of
``CATEGORIES``; what nothing covers is idle. The parts therefore add up to ``dur``.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from tracemagic.analysis._common import GPU_ACTIVITY, HOST_COLLECTIVE, is_dataloader, is_nccl, names_where, trace_start, union_length
from tracemagic.trace.model import Trace
from tracemagic.trace.normalize import kind_mask

#: breakdown columns in priority order (a higher one wins where activities overlap)
CATEGORIES = (
    "compute_us",  # GPU kernels other than communication
    "comm_us",  # NCCL kernels; on CPU-only ranks, host time in collectives (gloo, ...)
    "memcpy_us",
    "memset_us",
    "runtime_us",  # host in CUDA/HIP runtime and driver calls
    "dataloader_us",  # host in DataLoader iteration
    "cpu_us",  # host in other CPU ops
)
_STEP_NUMBER = re.compile(r"ProfilerStep#(\d+)")


def _step_number(name: object) -> int:
    """N of a ``ProfilerStep#N`` name (the step events are those so named)."""
    match = _STEP_NUMBER.match(str(name))
    if match is None:
        raise ValueError(f"not a ProfilerStep#N name: {name!r}")
    return int(match.group(1))


_NO_STEPS = "no ProfilerStep in rank(s) {ranks}: one row (step -1) spans each such rank's whole trace"


def windows(trace: Trace) -> pd.DataFrame:
    """The step windows: ``rank, step, start`` (µs, the rank's own clock), ``dur``; by rank and time.

    A rank without any ``ProfilerStep`` gets one window ``step = -1`` over all its events.
    Durations are kept as recorded, not as differences of epoch-µs times (float64 rounds
    those to 0.25 µs).
    """
    events = trace.events
    is_step = (events["kind"] == "step").to_numpy()
    names = events["name"][is_step].to_numpy(dtype=object)
    frame = pd.DataFrame(
        {
            "rank": events["rank"].to_numpy()[is_step],
            "step": [_step_number(n) for n in names],
            "start": events["ts"].to_numpy()[is_step],
            "dur": events["dur"].to_numpy()[is_step],
        }
    )
    frame = frame.sort_values(["rank", "start"], kind="stable").drop_duplicates(["rank", "step"])
    bare = sorted(set(trace.ranks) - set(frame["rank"]))
    if bare:
        timed = events.loc[events["rank"].isin(bare) & events["ts"].notna(), ["rank", "ts", "dur"]]
        start = timed.groupby("rank")["ts"].transform("min")
        span = (
            timed.assign(start=start, end=timed["ts"] - start + timed["dur"])
            .groupby("rank")
            .agg(start=("start", "first"), dur=("end", "max"))
            .reset_index()
            .assign(step=-1)
        )
        frame = pd.concat([frame, span[["rank", "step", "start", "dur"]]], ignore_index=True)
    frame = frame.astype({"rank": np.int32, "step": np.int64})
    return frame.sort_values(["rank", "start"], kind="stable").reset_index(drop=True)


def window_of(trace: Trace, frame: pd.DataFrame) -> np.ndarray:
    """Index into ``frame`` (a ``windows`` table) of each event's (rank, step), else -1."""
    events = trace.events

    def key(rank: np.ndarray, step: np.ndarray) -> np.ndarray:  # steps are >= -1
        return (rank.astype(np.int64) << 40) + step.astype(np.int64) + 1

    known = pd.Index(key(frame["rank"].to_numpy(), frame["step"].to_numpy()))
    return known.get_indexer(key(events["rank"].to_numpy(), events["step"].to_numpy()))


def category_masks(trace: Trace) -> dict[str, np.ndarray]:
    """Which events feed each breakdown category (before priorities are applied)."""
    events = trace.events
    duration = (events["ph"] == "X").to_numpy() & (events["dur"].to_numpy() > 0)
    kernel = duration & kind_mask(events, "kernel")
    nccl = is_nccl(events["name"])
    ranks = events["rank"].to_numpy()
    gpu_ranks = np.unique(ranks[kind_mask(events, *GPU_ACTIVITY)])
    cpu_only = ~np.isin(ranks, gpu_ranks)
    host = duration & kind_mask(events, "cpu_op", "user_annotation")
    host_comm = host & cpu_only & (
        names_where(events["name"], HOST_COLLECTIVE) | (events["name"] == "record_param_comms").to_numpy()
    )
    return {
        "compute_us": kernel & ~nccl,
        "comm_us": (kernel & nccl) | host_comm,
        "memcpy_us": duration & kind_mask(events, "memcpy"),
        "memset_us": duration & kind_mask(events, "memset"),
        "runtime_us": duration & kind_mask(events, "runtime"),
        "dataloader_us": duration & is_dataloader(trace),
        "cpu_us": duration & kind_mask(events, "cpu_op"),
    }


def clipped(
    trace: Trace, frame: pd.DataFrame, window: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window index, start, end) of ``rows`` clipped to their step window, µs from its start.

    ``window`` is ``window_of(trace, frame)``; rows outside every window are dropped.
    """
    events = trace.events
    group = window[rows]
    inside = group >= 0
    rows, group = rows[inside], group[inside]
    origin = frame["start"].to_numpy()[group]
    length = frame["dur"].to_numpy()[group]
    start = events["ts"].to_numpy()[rows] - origin
    end = start + events["dur"].to_numpy()[rows]
    return group, np.clip(start, 0.0, length), np.clip(end, 0.0, length)


def steps(trace: Trace) -> pd.DataFrame:
    """One row per step and rank: wall time and its partition by activity.

    Columns: ``rank``, ``step`` (ProfilerStep number, -1 where a rank has none), ``ts``
    (start, µs since the trace's start), ``dur`` (µs), then ``CATEGORIES`` and ``idle_us``,
    which add up to ``dur``. GPU events belong to the step that launched them and are
    clipped to its wall interval. ``df.attrs['note']`` says when rows span whole traces.
    """
    frame = windows(trace)
    groups = len(frame)
    masks = category_masks(trace)
    window = window_of(trace, frame)
    covered = np.zeros(groups)
    parts: dict[str, np.ndarray] = {}
    so_far: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for name in CATEGORIES:
        so_far.append(clipped(trace, frame, window, np.flatnonzero(masks[name])))
        group, start, end = (np.concatenate(column) for column in zip(*so_far))
        total = union_length(group, start, end, groups)
        parts[name] = total - covered
        covered = total
    dur = frame["dur"].to_numpy()
    out = pd.DataFrame(
        {
            "rank": frame["rank"].to_numpy(),
            "step": frame["step"].to_numpy(),
            "ts": frame["start"].to_numpy() - trace_start(trace),
            "dur": dur,
            **parts,
            "idle_us": dur - covered,
        }
    )
    bare = sorted(int(r) for r in frame.loc[frame["step"] < 0, "rank"])
    if bare:
        out.attrs["note"] = _NO_STEPS.format(ranks=", ".join(map(str, bare)))
    return out
