"""``steps()``: one row per ProfilerStep and rank, its device window partitioned by activity.

The breakdown follows the TensorBoard plugin's (``torch_tb_profiler``'s ``_find_device_steps``
and ``_update_steps_duration``), which its users know: a step's **window** starts where the
previous one ended (or at its host start, whichever is later) and ends when the host step
ends or, later, when the last device work launched by runtime calls wholly inside the host
step ends. On a GPU-bound loop the GPU runs behind the host, so the window of step *i* holds
the GPU work step *i* launched, not the host interval. Every instant of the window goes to
the highest-priority activity running then (in the order of ``CATEGORIES``), whichever step
launched it; what nothing covers is idle. The parts therefore add up to ``window_dur``. On
CPU-only traces the window is the host step.

The categories are the plugin's roles (``event_parser.py``, ``StepParser._parse_step``):
GPU kernels, communication, memcpy, memset, runtime calls, DataLoader iteration, and CPU:
every host op and annotation (cat ``cpu_op``/``operator``, ``user_annotation``) that is
none of those and no ProfilerStep, the plugin's CpuOp ("CPU Exec"). A ``record_function``
range (``## forward ##``, ``Optimizer.step#SGD.step``, ``DistributedDataParallel.forward``)
and a ``%%chakra_trace`` line mark (``tracemagic.line:N``) are host work, the Python between
their ops included: idle is time in no role at all (the plugin's Other). Where we differ
from the plugin, and why:

- the priority: communication comes right after compute (the plugin: after memcpy and
  memset), so that ``compute_us + comm_us`` is the kernels' union (``kernel_busy_us``);
  it moves only the time a copy runs under an NCCL kernel;
- a kernel is communication when ``nccl`` is in its name (the plugin: when its External id
  is that of a host range with one of five ``nccl:*`` names; recent traces hang the NCCL
  kernels off ``record_param_comms``, and the plugin counts them as compute);
- a GPU rank's host collectives (``nccl:*``, ``record_param_comms``) are CPU time, not
  communication (the plugin's): they only launch the NCCL kernels, which count as that;
  ``gloo:*`` ones, which move the data on the host, are communication on any rank, and on a
  rank without GPU activity every host collective is (``nccl|gloo|mpi|ucc|xccl:*``, the
  plugin's five ``nccl:``/``gloo:`` names);
- DataLoader is any host range named with ``DataLoader`` or ``enumerate(DataPipe)#`` (the
  plugin: ``enumerate(DataLoader)#...__next__``; the rest are its CpuOp);
- ``cuda_driver`` calls (a Triton kernel's ``cuLaunchKernel``) are runtime (the plugin
  reads no such category);
- ``gpu_user_annotation`` ranges count for nothing: they are drawn over a GPU stream, not
  host work (the plugin maps them to ``user_annotation``: CpuOp); ``python_function``
  events count for nothing in either, and neither does the old cat ``python`` here, which
  we read as ``python_function`` (the plugin's PYTHON: CpuOp).

Like the plugin, a rank's trailing steps that launched no GPU work (on a rank where some
step did), and the last one that launched under 80% of its predecessor's GPU events, are
dropped: the profiler stopped before their kernels ran or were recorded, so a ~100% idle
step would enter the mean (``_kept_steps``; ``steps().attrs['tail']`` names them). Our
own captures (a trace with a ``capture.json`` manifest) are left whole: they mark the loop's
exit and a step cut short by an error in the manifest instead (``aggregate.loop_steps``),
and a complete step that launched little (gradient accumulation) stays.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    HOST_COLLECTIVE,
    activity_rows,
    group_rows,
    is_dataloader,
    is_nccl,
    names_where,
    of_ranks,
    trace_start,
    union_length,
    values_at,
)
from tracemagic.analysis.schema import computes
from tracemagic.trace import structure
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.kineto import step_number as _step_number
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask, per_code
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import timed_rows

#: breakdown columns in priority order (a higher one wins where activities overlap)
CATEGORIES = (
    "compute_us",  # GPU kernels other than communication
    "comm_us",  # NCCL kernels, host gloo collectives; on ranks without a GPU, host time in any collective
    "memcpy_us",
    "memset_us",
    "runtime_us",  # host in CUDA/HIP runtime and driver calls
    "dataloader_us",  # host in DataLoader iteration
    "cpu_us",  # host in other CPU ops and annotations (the plugin's "CPU Exec")
)
#: host collectives of gloo, which moves the data on the host: communication on any rank
_GLOO = re.compile(r"^gloo:\w+")


_NO_STEPS = "no ProfilerStep in rank(s) {ranks}: one row (step -1) spans each such rank's whole trace"
_UNLAUNCHED = (
    "{events:,} GPU event(s) ({us:,.0f} µs) on rank {rank} have no launching runtime call in the trace "
    "(in flight when profiling began): they belong to no step"
)

_TAIL = (
    "step(s) {steps} of rank {rank} left out: the last steps launched no GPU work, or much less than "
    "the step before (the profiler stopped before recording it), as the TensorBoard plugin drops them"
)


def windows(trace: TraceTables) -> pd.DataFrame:
    """The host step windows: ``rank, step, start`` (µs, the rank's own clock), ``dur``; by rank and time.

    A rank without any ``ProfilerStep`` gets one window ``step = -1`` over all its events.
    Durations are kept as recorded, not as differences of epoch-µs times (float64 rounds
    those to 0.25 µs). Computed once per trace (``device_windows``, ``phases`` and ``ranks``
    share it); treat it as read-only.
    """
    return trace.shared(Shared.STEP_WINDOWS, lambda: _windows(trace))


def _windows(trace: TraceTables) -> pd.DataFrame:
    events = trace.events
    rows = np.flatnonzero(kind_mask(events, "step"))
    rank = events["rank"].to_numpy()[rows]
    start = events["ts"].to_numpy()[rows]
    # by rank and start (stable), then the first window of each (rank, step) number
    order = np.lexsort((start, rank))
    rows, rank, start = rows[order], rank[order], start[order]
    step = np.fromiter((_step_number(n) for n in values_at(events["name"], rows)), dtype=np.int64, count=rows.size)
    _, first = group_rows(rank, step)
    rank = rank[first].astype(np.int32, copy=False)
    frame = pd.DataFrame(
        {"rank": rank, "step": step[first], "start": start[first], "dur": events["dur"].to_numpy()[rows[first]]}
    )
    bare = sorted(set(trace.rank_ids) - set(rank.tolist()))
    if not bare:  # (in order already)
        return frame
    timed = events.loc[events["rank"].isin(bare) & events["ts"].notna(), ["rank", "ts", "dur"]]
    start_of = timed.groupby("rank")["ts"].transform("min")
    span = (
        timed.assign(start=start_of, end=timed["ts"] - start_of + timed["dur"])
        .groupby("rank")
        .agg(start=("start", "first"), dur=("end", "max"))
        .reset_index()
        .assign(step=-1)
    )
    frame = pd.concat([frame, span[["rank", "step", "start", "dur"]]], ignore_index=True)
    frame = frame.astype({"rank": np.int32, "step": np.int64})
    return frame.sort_values(["rank", "start"], kind="stable").reset_index(drop=True)


def by_rank(frame: pd.DataFrame) -> list[tuple[int, np.ndarray]]:
    """``frame.groupby("rank").indices`` (rank -> its rows, ranks ascending) of a table
    sorted by rank, without building a groupby: a trace has one rank or a few."""
    rank = frame["rank"].to_numpy()
    return [(r, np.flatnonzero(rank == r)) for r in np.unique(rank)]


def window_of(trace: TraceTables, frame: pd.DataFrame) -> np.ndarray:
    """Index into ``frame`` (a ``windows`` table) of each event's (rank, step), else -1."""
    events = trace.events

    def key(rank: np.ndarray, step: np.ndarray) -> np.ndarray:  # steps are >= -1
        return (rank.astype(np.int64) << 40) + step.astype(np.int64) + 1

    known = pd.Index(key(frame["rank"].to_numpy(), frame["step"].to_numpy()))
    return known.get_indexer(key(events["rank"].to_numpy(), events["step"].to_numpy()))


def _gpu_rows(trace: TraceTables) -> np.ndarray:
    """Rows of timed GPU activity (kernels, memcpy, memset) with a known start."""
    events = trace.events
    if not activity_rows(trace).size:  # a CPU trace: no phase test over the table
        return np.zeros(0, dtype=np.int64)
    rows = timed_rows(events, GPU_ACTIVITY)
    return rows[np.isfinite(events["ts"].to_numpy()[rows])]


def _relative(trace: TraceTables) -> np.ndarray:
    """Every event's start in µs since the trace's start (computed once per trace); its
    end is ``start + dur``, taken at the rows needed (``_ends``), not kept for every event.

    Shifted before adding ``dur``: float64 epoch-µs times round to 0.25 µs, their
    differences are exact.
    """
    return trace.shared(
        Shared.RELATIVE_TIMES, lambda: trace.events["ts"].to_numpy(dtype=np.float64) - trace_start(trace)
    )


def _ends(trace: TraceTables, start: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The ends (µs since the trace's start) of ``rows``, whose ``start`` is ``_relative(trace)[rows]``."""
    end = trace.events["dur"].to_numpy(dtype=np.float64)[rows]
    end += start  # (in place: one per-row array, not two)
    return end


def device_windows(trace: TraceTables) -> pd.DataFrame:
    """``windows`` with each step's device window: ``window_ts`` (µs since the trace's start)
    and ``window_dur`` (µs), the TensorBoard plugin's rule (see the module docstring).

    ``df.attrs['unlaunched']`` is {rank: {"events": n, "us": total}} of the GPU activity
    without a launching runtime call in the trace (work in flight when profiling began);
    it belongs to no step. ``df.attrs['tail']`` is {rank: [steps]} of the trailing steps
    dropped by the plugin's tail rule (see the module docstring). Computed once per
    trace (``steps`` and ``ranks.overlap`` share it); treat it as read-only.
    """
    return trace.shared(Shared.DEVICE_WINDOWS, lambda: _device_windows(trace))


def _device_windows(trace: TraceTables) -> pd.DataFrame:
    frame = windows(trace)
    events = trace.events
    start = _relative(trace)
    gpu = _gpu_rows(trace)
    gpu_rank = events["rank"].to_numpy()[gpu]
    gpu_start = start[gpu]
    gpu_end = _ends(trace, gpu_start, gpu)
    launch = events["launch"].to_numpy()[gpu]
    launcher = np.maximum(launch, 0)
    launch_start = np.where(launch >= 0, start[launcher], np.nan)
    launch_end = np.where(launch >= 0, _ends(trace, start[launcher], launcher), np.nan)

    host_dur = frame["dur"].to_numpy(dtype=np.float64)
    window_ts = frame["start"].to_numpy(dtype=np.float64) - trace_start(trace)
    window_dur = host_dur.copy()
    unlaunched: dict[int, dict[str, float]] = {}
    tail: dict[int, list[int]] = {}
    drop: list[int] = []
    foreign = not getattr(trace, "manifest", None)  # our captures say which steps are whole
    for rank, where in by_rank(frame):
        mine = gpu_rank == rank
        orphans = mine & (launch < 0)
        if orphans.any():
            unlaunched[int(rank)] = {"events": int(orphans.sum()), "us": float((gpu_end - gpu_start)[orphans].sum())}
        if (frame["step"].to_numpy()[where] < 0).any():
            continue  # a rank without steps: its one window spans everything already
        host_start = window_ts[where].copy()
        host_end = host_start + host_dur[where]
        # which host step wholly holds each launching runtime call (steps do not overlap)
        at = np.searchsorted(host_start, launch_start[mine], side="right") - 1
        inside = (at >= 0) & (launch_end[mine] <= host_end[np.maximum(at, 0)])
        if not inside.any():
            continue  # nothing launched inside a step: the windows stay the host steps
        first_start = np.full(where.size, np.inf)
        last_end = np.full(where.size, -np.inf)
        np.minimum.at(first_start, at[inside], gpu_start[mine][inside])
        np.maximum.at(last_end, at[inside], gpu_end[mine][inside])
        kept = _kept_steps(np.bincount(at[inside], minlength=where.size)) if foreign else where.size
        if kept < where.size:
            tail[int(rank)] = [int(s) for s in frame["step"].to_numpy()[where[kept:]]]
            drop.extend(where[kept:])
        # the first window starts past device work launched outside every step that ends
        # before the first step's own device work
        previous = host_start[0]
        if np.isfinite(first_start[0]):
            before = gpu_end[mine][~inside]
            before = before[before < first_start[0]]
            if before.size:
                previous = max(previous, float(before.max()))
        for i in range(where.size):
            begin = max(previous, host_start[i])
            stop = max(host_end[i], last_end[i], begin)
            if begin != host_start[i] or stop != host_end[i]:
                window_ts[where[i]], window_dur[where[i]] = begin, stop - begin
            previous = stop
    out = frame.assign(window_ts=window_ts, window_dur=window_dur)
    if drop:
        out = out.drop(index=drop).reset_index(drop=True)
    out.attrs["unlaunched"] = unlaunched
    out.attrs["tail"] = tail
    return out


#: the last step that launched GPU work is left out too when it launched fewer than this
#: share of the previous step's device events (the TensorBoard plugin's 0.8)
TAIL_SHARE = 0.8


def _kept_steps(launched: np.ndarray) -> int:
    """How many of a rank's steps (in time order) to keep, given the GPU events each step's
    runtime calls launched: the TensorBoard plugin's tail rule (``event_parser.py``,
    ``_update_steps_duration``, ``is_remove_tail_steps``): with several steps and GPU work
    in some, the trailing steps that launched none go, and so does the last one that did if
    it launched under ``TAIL_SHARE`` of its predecessor's ("the profiler may fail to
    capture all the kernels launched by these steps")."""
    if launched.size < 2 or not launched.any():
        return launched.size
    last = int(np.flatnonzero(launched)[-1])
    keep = last + 1
    if last > 0 and launched[last - 1] * TAIL_SHARE > launched[last]:
        keep = last
    return keep


#: a host collective (``HOST_COLLECTIVE``) or ``record_param_comms``: the host's communication
_HOST_COMM = re.compile(f"{HOST_COLLECTIVE.pattern}|^record_param_comms\\Z")


def category_masks(trace: TraceTables) -> dict[str, np.ndarray]:
    """Which events feed each breakdown category (before priorities are applied), and
    ``gloo_on_gpu`` (the ``gloo:*`` host collectives of GPU ranks, in ``comm_us``); computed
    once per trace (``steps`` and ``ranks.overlap`` share it), treat it as read-only."""
    return trace.shared(Shared.CATEGORY_MASKS, lambda: _category_masks(trace))


def _category_masks(trace: TraceTables) -> dict[str, np.ndarray]:
    events = trace.events
    names = events["name"]
    duration = per_code(events["ph"], lambda c: c == "X", False)
    duration &= events["dur"].to_numpy() > 0
    duration &= np.isfinite(events["ts"].to_numpy())
    activity = activity_rows(trace)
    # a trace without GPU activity (a CPU one): no pass over the table for each of its kinds
    idle = np.zeros_like(duration) if not activity.size else None

    def of_kind(kind: str) -> np.ndarray:
        return duration & kind_mask(events, kind) if idle is None else idle

    kernel = of_kind("kernel")
    nccl = is_nccl(names) if kernel.any() else kernel  # (only kernels are told apart by it)
    ranks = events["rank"].to_numpy()
    gpu_ranks = np.unique(ranks[activity])
    on_gpu_rank = of_ranks(ranks, gpu_ranks)
    host = duration & kind_mask(events, "cpu_op", "user_annotation")
    # (one pass over the names, tested once per name; none in most single-process traces)
    collective = names_where(names, _HOST_COMM)
    host_comm = host & ~on_gpu_rank & collective if collective.any() else collective
    del collective
    # gloo runs its collectives on the host, on a GPU rank too (the plugin's GlooOpNameSet);
    # a GPU rank's nccl:* ops only launch the NCCL kernels, which count themselves
    gloo_on_gpu = host & on_gpu_rank & names_where(names, _GLOO) if gpu_ranks.size else on_gpu_rank
    masks = {
        "compute_us": kernel & ~nccl,
        "comm_us": (kernel & nccl) | host_comm | gloo_on_gpu,
        "gloo_on_gpu": gloo_on_gpu,
        "memcpy_us": of_kind("memcpy"),
        "memset_us": of_kind("memset"),
        "runtime_us": duration & kind_mask(events, "runtime"),
        "dataloader_us": duration & is_dataloader(trace),
        # every host op and annotation (record_function ranges, the magic's line marks), the
        # plugin's CpuOp: the host is running Python between the ops inside them; the ones in
        # the categories above (DataLoader, collectives) are covered there already
        "cpu_us": host,
    }
    # kept for the trace's lifetime: a category no event feeds (a CPU trace's six GPU ones)
    # is a read-only view of one False, in no memory
    none = np.broadcast_to(np.False_, duration.shape)
    return {name: mask if mask.any() else none for name, mask in masks.items()}


def in_windows(trace: TraceTables, frame: pd.DataFrame, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window index (int32: per part, as small as it can be), start, end) of the parts of
    ``rows`` inside the windows of their rank, µs from the window's start; an event spanning
    several windows gives one part in each.

    ``frame`` is a ``device_windows`` table (windows of a rank do not overlap).
    """
    ranks = trace.events["rank"].to_numpy()
    # one rank in the whole table (the usual case): no rank per row to compare
    lone = int(ranks[0]) if ranks.size and ranks.min() == ranks.max() else None
    rank = ranks[rows] if lone is None else None
    del ranks
    start = _relative(trace)[rows]
    end = _ends(trace, start, rows)
    win_start = frame["window_ts"].to_numpy(dtype=np.float64)
    win_dur = frame["window_dur"].to_numpy(dtype=np.float64)
    win_end = win_start + win_dur
    groups, starts, ends = [], [], []
    for r, where in by_rank(frame):
        if rank is None:  # None: all of them (one rank)
            mine = None if r == lone else np.zeros(0, dtype=np.int64)
        else:
            of_rank = rank == r
            mine = None if of_rank.all() else np.flatnonzero(of_rank)
            del of_rank
        found = _rank_parts(mine, where, start, end, win_start, win_end, win_dur)
        if found is not None:
            groups.append(found[0])
            starts.append(found[1])
            ends.append(found[2])
    del rank, start, end
    if not groups:
        return np.zeros(0, dtype=np.int32), np.zeros(0), np.zeros(0)
    return joined(groups), joined(starts), joined(ends)


def _rank_parts(
    mine: np.ndarray | None,
    where: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    win_start: np.ndarray,
    win_end: np.ndarray,
    win_dur: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``in_windows`` for one rank: ``mine`` (positions in ``start``/``end``, None for all)
    against its windows ``where``; None when no part falls in one. A function of its own so
    that its per-row temporaries are freed before the next rank's (and the caller's join).
    Rows in start order, each in one window at most (the usual case), in one C pass
    (``_nesting.window_parts``) where the extension is built, else numpy (the same parts)."""
    parts = _window_parts(
        start if mine is None else start[mine], end if mine is None else end[mine], where, win_start, win_end, win_dur
    )
    if parts is not None:
        return parts if parts[0].size else None
    found = _in_one_window(
        start if mine is None else start[mine], end if mine is None else end[mine], win_start[where], win_end[where]
    )
    if found is not None:  # each row in one window at most, rows in time order (the usual case)
        lo, hit = found
        if not hit.any():
            return None
        if mine is None and hit.all():  # every row in a window: no selection, shifted in place
            return _clipped(None, None, where.astype(np.int32)[lo], start, end, win_start, win_dur)
        part = np.flatnonzero(hit)
        del hit
        group = where.astype(np.int32)[lo[part]]
        del lo
        return _clipped(mine, part, group, start, end, win_start, win_dur)
    # first window ending after the start, past the last window starting before the end
    lo = np.searchsorted(win_end[where], start if mine is None else start[mine], side="right")
    count = np.searchsorted(win_start[where], end if mine is None else end[mine], side="left")
    count -= lo
    np.maximum(count, 0, out=count)
    if not count.any():
        return None
    if count.max() == 1:  # each row in one window at most: no row repeats
        part = np.flatnonzero(count)
        del count
        group = where.astype(np.int32)[lo[part]]
    else:
        part = np.repeat(np.arange(count.size), count)
        offset = np.arange(part.size) - np.repeat(np.cumsum(count) - count, count)
        del count
        group = where.astype(np.int32)[lo[part] + offset]
        del offset
    del lo
    return _clipped(mine, part, group, start, end, win_start, win_dur)


def _window_parts(
    start: np.ndarray,
    end: np.ndarray,
    where: np.ndarray,
    win_start: np.ndarray,
    win_end: np.ndarray,
    win_dur: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``_rank_parts``' parts in one C pass (``_nesting.window_parts``); None where the
    extension is not built or the rows are not so (the numpy search does them)."""
    nesting = structure._nesting
    if nesting is None or not all(
        a.dtype == np.float64 and a.flags.c_contiguous for a in (start, end, win_start, win_end, win_dur)
    ):
        return None
    group = np.empty(start.size, dtype=np.int32)
    since, until = np.empty(start.size), np.empty(start.size)
    count = nesting.window_parts(
        start, end, win_start, win_end, win_dur, np.ascontiguousarray(where, dtype=np.int64), group, since, until
    )
    if count < 0:
        return None
    if count == start.size:
        return group, since, until
    return group[:count].copy(), since[:count].copy(), until[:count].copy()  # (not a view holding every row)


def _clipped(
    mine: np.ndarray | None,
    part: np.ndarray | None,
    group: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    win_start: np.ndarray,
    win_dur: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The parts (``part``: positions in ``mine``, in window ``group``) as ``_rank_parts``
    gives them: from their window's start, clipped to it. ``part`` None: every row of
    ``start`` and ``end`` (``mine`` None), which are shifted in place (``in_windows``'
    own per-row arrays)."""
    if part is None:
        since, until = start, end
    else:
        source = part if mine is None else mine[part]
        del part
        since = start[source]
        until = end[source]
        del source
    since -= win_start[group]
    until -= win_start[group]
    length = win_dur[group]
    return group, np.clip(since, 0.0, length, out=since), np.clip(until, 0.0, length, out=until)


def _in_one_window(
    start: np.ndarray, end: np.ndarray, win_start: np.ndarray, win_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """For rows sorted by start (no NaN) and sorted windows of one rank, where no row
    reaches into two windows: the first window ending after each start (``searchsorted(
    win_end, start, 'right')``) and whether the row reaches into it (the window starts
    before the row ends). Without a search per row: the rows where each window ends are
    found instead (the windows are few). None where the rows or windows are not so (the
    caller searches per row)."""
    if not start.size or np.isnan(start).any() or np.isnan(end).any():
        return None
    if np.isnan(win_start).any() or np.isnan(win_end).any():
        return None
    if (start[1:] < start[:-1]).any() or (win_end[1:] < win_end[:-1]).any() or (win_start[1:] < win_start[:-1]).any():
        return None
    # a row is past window j from the first row starting at or after its end on
    past = np.searchsorted(start, win_end, side="left")
    lo = np.repeat(np.arange(win_end.size + 1), np.diff(past, prepend=0, append=start.size))
    del past
    after = np.append(win_start, [np.inf, np.inf])  # (no window past the last)
    hit = after[lo] < end
    if (hit & (after[lo + 1] < end)).any():  # a row reaching into the next window too
        return None
    return lo, hit


def joined(pieces: list[np.ndarray] | tuple[np.ndarray, ...]) -> np.ndarray:
    """``np.concatenate(pieces)``, without the copy where one piece holds every value (the
    others empty, of the same dtype): the per-row arrays of a one-rank trace."""
    full = [p for p in pieces if p.size]
    if len(full) == 1 and all(p.dtype == full[0].dtype for p in pieces):
        return full[0]
    return np.concatenate(pieces)


@computes("steps")
def steps(trace: TraceTables) -> pd.DataFrame:
    """One row per step and rank: host and device time and the device window's partition.

    Columns: ``rank``, ``step`` (ProfilerStep number, -1 where a rank has none), ``ts``
    (host start, µs since the trace's start), ``dur`` (the host ProfilerStep's µs),
    ``window_ts``, ``window_dur`` (the device window, see the module docstring), then
    ``CATEGORIES`` and ``idle_us``, which add up to ``window_dur``; ``gpu_busy_us`` (union of
    all GPU activity of the rank — kernels, memcpy, memset, every stream — inside the
    window) and ``gpu_idle_us`` (``window_dur - gpu_busy_us``); ``kernel_busy_us`` (union
    of the kernels alone, NCCL's included, memcpy and memset not: ``kernel_busy_us /
    window_dur`` is the TensorBoard plugin's "GPU Utilization", ``gpu_metrics_parser.py``,
    which it computes per device over the span from the first step's start to the last
    one's end; ours is per rank, all its devices together, over the windows); NaN on ranks
    without GPU activity. ``df.attrs['note']`` says when rows span whole traces, when GPU work was in
    flight when profiling began (``df.attrs['unlaunched']``: {rank: {"events", "us"}}) and
    which trailing steps were dropped because they launched no (or too little) GPU work
    (``df.attrs['tail']``: {rank: [steps]}, the TensorBoard plugin's rule, see the module
    docstring).
    """
    frame = device_windows(trace)
    groups = len(frame)
    masks = category_masks(trace)
    covered = kernel_busy = np.zeros(groups)
    parts: dict[str, np.ndarray] = {}
    so_far: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for name in CATEGORIES:
        rows = np.flatnonzero(masks[name])
        total = covered  # a category no event feeds covers nothing more (a CPU trace's GPU ones)
        if rows.size:
            so_far.append(in_windows(trace, frame, rows))
            group, start, end = (joined(column) for column in zip(*so_far))
            total = union_length(group, start, end, groups)
        del rows
        parts[name] = total - covered
        covered = total
        if name == "comm_us":
            kernel_busy = total  # compute_us and comm_us hold kernels alone on GPU ranks, but for gloo
    if masks["gloo_on_gpu"].any():
        kernels = masks["compute_us"] | (masks["comm_us"] & ~masks["gloo_on_gpu"])
        kernel_busy = union_length(*in_windows(trace, frame, np.flatnonzero(kernels)), groups)
    window_dur = frame["window_dur"].to_numpy(dtype=np.float64)
    gpu = _gpu_rows(trace)
    busy = union_length(*in_windows(trace, frame, gpu), groups) if gpu.size else np.zeros(groups)
    events = trace.events
    gpu_ranks = np.unique(events["rank"].to_numpy()[activity_rows(trace)])
    has_gpu = np.isin(frame["rank"].to_numpy(), gpu_ranks)
    out = pd.DataFrame(
        {
            "rank": frame["rank"].to_numpy(),
            "step": frame["step"].to_numpy(),
            "ts": frame["start"].to_numpy() - trace_start(trace),
            "dur": frame["dur"].to_numpy(),
            "window_ts": frame["window_ts"].to_numpy(),
            "window_dur": window_dur,
            **parts,
            "idle_us": window_dur - covered,
            "gpu_busy_us": np.where(has_gpu, busy, np.nan),
            "gpu_idle_us": np.where(has_gpu, window_dur - busy, np.nan),
            "kernel_busy_us": np.where(has_gpu, kernel_busy, np.nan),
        }
    )
    return _noted(out, frame.attrs["unlaunched"], frame.attrs["tail"])


def _noted(out: pd.DataFrame, unlaunched: dict[int, dict[str, float]], tail: dict[int, list[int]]) -> pd.DataFrame:
    """``out`` (a ``steps`` table) with its ``attrs``: ``unlaunched``, ``tail`` and the ``note``."""
    notes = []
    bare = sorted(int(r) for r in out["rank"].to_numpy()[out["step"].to_numpy() < 0])
    if bare:
        notes.append(_NO_STEPS.format(ranks=", ".join(map(str, bare))))
    notes += [_UNLAUNCHED.format(rank=rank, **found) for rank, found in sorted(unlaunched.items())]
    notes += [_TAIL.format(steps=", ".join(map(str, dropped)), rank=rank) for rank, dropped in sorted(tail.items())]
    if notes:
        out.attrs["note"] = "; ".join(notes)
    out.attrs["unlaunched"] = unlaunched
    out.attrs["tail"] = tail
    return out


def combine(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """The ``steps`` table of several ranks from theirs (each computed on its own rank, all
    on one time zero, see ``_common.trace_start``), in the order given: equal to ``steps``
    of the ranks loaded together."""
    out = pd.concat(tables, ignore_index=True) if len(tables) > 1 else tables[0].copy()
    out.attrs = {}
    unlaunched = {rank: found for table in tables for rank, found in table.attrs.get("unlaunched", {}).items()}
    tail = {rank: dropped for table in tables for rank, dropped in table.attrs.get("tail", {}).items()}
    return _noted(out, unlaunched, tail)
