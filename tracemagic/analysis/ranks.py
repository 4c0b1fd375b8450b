"""``ranks()``: per-rank step time and breakdown, communication overlap, collectives, stragglers.

Steps are compared by number across ranks. Collectives are matched across ranks by
(step, collective, n-th of that collective in the step); a rank's wait in a collective is
how much later the last rank arrived, and the straggler of a step is the rank the others
wait for (not the one with the longest step: waiting makes a step long). Only collectives
in which every rank needs every other's data (all-reduce, all-gather, reduce-scatter,
all-to-all, barrier) end together on all ranks, so only they set the clock correction and
``excess_us``; point-to-point transfers (send, recv, NCCL's SendRecv kernels outside an
all-to-all) wait for one peer, which a trace does not name, so they get no wait.

Each table is made in two parts, so that the ranks of a job need not be loaded together
(``tracemagic.load_ranks``): ``summarize`` takes what the tables need from a trace (one
rank or several: their steps, overlap and collective arrivals, small), and the tables are
computed from the summaries of all ranks (``steps_of``, ``collectives_of``,
``stragglers_of``, ``ranks_of``). A ``Trace``'s own tables are the same functions over
its one summary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tracemagic.analysis import steps as steps_module
from tracemagic.analysis._common import (
    HOST_COLLECTIVE,
    is_nccl,
    names_where,
    text,
    trace_start,
    union_length,
    values_at,
)
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import propagate

_KERNEL_COLLECTIVE = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
#: normalized collective names (lower case, letters and digits) of the collectives that end
#: together on every rank: each rank's result needs every rank's data
_ENDS_TOGETHER = re.compile(r"allreduce|allgather|reducescatter|alltoall|barrier")
#: normalized names of point-to-point transfers: each waits for one peer, not for the group
_POINT_TO_POINT = re.compile(r"^(?:send|recv|sendrecv|isend|irecv|batchisendirecv)$")
_MEANS = ("compute_us", "comm_us", "memcpy_us", "memset_us", "runtime_us", "dataloader_us", "cpu_us", "idle_us")


#: bytes per element of a collective's ``dtype`` arg (c10 ScalarType names)
_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "ComplexFloat": 8,
}  # fmt: skip
#: normalized collective -> (the message is its output, not its input; bus factor of group size n),
#: as NCCL's tests define them (nccl-tests doc/PERFORMANCE.md)
_BUS: tuple[tuple[re.Pattern[str], bool, str], ...] = (
    (re.compile(r"^allreduce"), False, "2(n-1)/n"),
    (re.compile(r"^reducescatter"), False, "(n-1)/n"),
    (re.compile(r"^allgather"), True, "(n-1)/n"),
    (re.compile(r"^alltoall"), False, "(n-1)/n"),
    (re.compile(r"^(?:broadcast|reduce|send|recv|sendrecv|isend|irecv)$"), False, "1"),
)


#: bytes per element of the ``Input type`` names of a ``nccl:*`` / ``gloo:*`` op: the TensorBoard
#: plugin's (``communication.py``, ``analyze_communication_nodes``), with double, bool and short
#: added; a type neither knows leaves the message unknown (the plugin counts it as 0 bytes)
_INPUT_TYPE_BYTES = {
    "long int": 8, "float": 4, "int": 4, "c10::Half": 2, "c10::BFloat16": 2, "unsigned char": 1,
    "double": 8, "bool": 1, "short int": 2, "signed char": 1,
}  # fmt: skip


def _input_bytes(dims: object, types: object) -> float:
    """The plugin's message size of a collective op: each input's elements × its type's bytes,
    summed (NaN where not recorded or of a type not in ``_INPUT_TYPE_BYTES``)."""
    try:
        shapes, names = json.loads(str(dims)), json.loads(str(types))
    except ValueError:
        return np.nan
    if not isinstance(shapes, list) or not isinstance(names, list) or not shapes or len(shapes) != len(names):
        return np.nan
    total = 0.0
    for shape, name in zip(shapes, names):
        if not isinstance(shape, list) or name not in _INPUT_TYPE_BYTES:
            return np.nan
        total += float(np.prod([float(x) for x in shape])) * _INPUT_TYPE_BYTES[name]
    return total


def _message(
    events: pd.DataFrame, rows: np.ndarray, does: np.ndarray, host: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Message bytes of each collective and its bus factor, NCCL tests' way.

    The message is the collective's data: ``In msg nelems`` × the dtype's size, the output
    (``Out msg nelems``) for all-gather, whose input is one rank's part. The bus factor
    turns the algorithm bandwidth (bytes / time) into the bus bandwidth: 2(n−1)/n for
    all-reduce, (n−1)/n for reduce-scatter, all-gather and all-to-all, 1 for broadcast,
    reduce and point-to-point, with n the ``Group size``: the rate each link must sustain,
    comparable with the hardware's. NaN where the trace records no sizes (older traces,
    barriers) or the collective is another; the factor is NaN where the group size is
    missing or not positive (1 for broadcast, reduce and point-to-point, which need none).

    Where the trace records no ``In msg nelems`` but the ``nccl:*`` / ``gloo:*`` op of the
    collective (``host``: its row, -1 for none) has ``Input Dims`` and ``Input type``, the
    message is the TensorBoard plugin's: its inputs' bytes (``_input_bytes``); not for
    all-gather, whose message is its output, which those args do not give.
    """
    size = (
        pd.Series(values_at(events["dtype"], rows), dtype=object)
        .map(_DTYPE_BYTES)
        .to_numpy(dtype=float, na_value=np.nan)
    )
    n = events["group_size"].to_numpy(dtype=float, na_value=np.nan)[rows]
    n[~(n > 0)] = np.nan  # a group of 0 (or none recorded) has no bus factor, and no 0-division
    nelems = {c: events[c].to_numpy(dtype=float, na_value=np.nan)[rows] for c in ("in_nelems", "out_nelems")}
    nbytes, factor = np.full(rows.size, np.nan), np.full(rows.size, np.nan)
    for pattern, output, bus in _BUS:
        hit = np.array([bool(pattern.search(str(d))) for d in does], dtype=bool) & np.isnan(factor)
        nbytes[hit] = (nelems["out_nelems" if output else "in_nelems"] * size)[hit]
        factor[hit] = {"2(n-1)/n": 2 * (n - 1) / n, "(n-1)/n": (n - 1) / n, "1": np.ones(rows.size)}[bus][hit]
        if not output:  # the plugin's comm args where the trace has no message size
            args = hit & np.isnan(nbytes) & (host >= 0)
            if args.any():
                at = host[args]
                pairs = pd.MultiIndex.from_arrays([events["input_dims"].iloc[at], events["input_type"].iloc[at]])
                codes, distinct = pd.factorize(pairs)
                nbytes[args] = np.array([_input_bytes(d, t) for d, t in distinct], dtype=float)[codes]
    return nbytes, factor


def _label(name: str, recorded: object, source: str) -> str:
    """A collective's name: the recorded ``Collective name`` arg, else from the event name."""
    if source == "kernel":
        if isinstance(recorded, str):
            return recorded
        match = _KERNEL_COLLECTIVE.search(name)
        return match.group(1) if match else name
    return name.split(":", 1)[1] if source == "annotation" else str(recorded)


def _key(names: pd.Series | np.ndarray) -> np.ndarray:
    """Collective names normalized for matching: lower case, letters and digits only."""
    return pd.Series(names, dtype=object).astype(str).str.lower().str.replace(r"[^a-z0-9]", "", regex=True).to_numpy()


def _collective_events(trace: TraceTables) -> tuple[np.ndarray, np.ndarray, np.ndarray, str, np.ndarray]:
    """Rows of the collectives, their names, what each does (the normalized name of the
    operation: a SendRecv kernel launched inside ``nccl:all_to_all`` is an all-to-all),
    which kind of event they are, and the row of each one's ``nccl:*`` / ``gloo:*`` op
    (the annotation itself, the one around a kernel's launch; -1 for none).

    The first kind present wins, so one collective is never counted twice: NCCL kernels
    (GPU arrival), else host annotations (``nccl:all_reduce``, ``gloo:broadcast``), else
    ``record_param_comms`` ops.
    """
    events = trace.events
    timed = (events["ph"] == "X").to_numpy()
    host = timed & kind_mask(events, "cpu_op", "user_annotation")
    host_collective = host & names_where(events["name"], HOST_COLLECTIVE)
    rows = np.flatnonzero(timed & kind_mask(events, "kernel") & is_nccl(events["name"]))
    source = "kernel"
    if not rows.size:
        rows = np.flatnonzero(host_collective)
        source = "annotation"
    if not rows.size:
        rows = np.flatnonzero(host & (events["name"] == "record_param_comms").to_numpy())
        source = "record_param_comms"
    pairs = pd.MultiIndex.from_arrays([events["name"].iloc[rows], events["collective"].iloc[rows]])
    codes, distinct = pd.factorize(pairs)
    named = np.array([_label(str(name), given, source) for name, given in distinct], dtype=object)  # per distinct name
    labels = named[codes] if codes.size else np.array([], dtype=object)
    does = _key(labels)
    recorded = events["collective"].iloc[rows].notna().to_numpy()
    host = rows if source == "annotation" else np.full(rows.size, -1, dtype=np.int64)
    if source == "kernel" and rows.size and host_collective.any():
        # what the host asked for: the collective annotation around the kernel's launch
        parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
        around = propagate(parent, depth, host_collective)
        launch = events["launch"].to_numpy()[rows]
        host = np.where(launch >= 0, around[np.maximum(launch, 0)], -1)
        found = ~recorded & (host >= 0)
        if found.any():
            host_names = values_at(events["name"], host[found])
            does[found] = _key(np.array([str(n).split(":", 1)[1] for n in host_names], dtype=object))
    return rows, labels, does, source, host


#: the columns of ``collectives()``, in order (its contract in ``analysis.schema``)
COLLECTIVE_COLUMNS = tuple(TABLES["collectives"].names)

#: the kinds of collective events, best first (see ``_collective_events``)
SOURCES = ("kernel", "annotation", "record_param_comms")


@dataclass
class Summary:
    """What the cross-rank tables need of one or more ranks (a few rows per step and per
    collective; picklable, so a worker can send it).

    Attributes:
        steps: the ranks' ``steps()`` table.
        overlap: ``overlap()`` (per rank).
        arrivals: the ranks' collectives before matching: ``rank, step, collective, seq,
            ts, dur, arrival_us, key, together, p2p, bytes, bus_factor`` (``collectives`` minus the waits
            and bandwidths).
        source: the kind of event the collectives are (``SOURCES``).
    """

    steps: pd.DataFrame
    overlap: pd.Series
    arrivals: pd.DataFrame
    source: str


def summarize(trace: TraceTables) -> Summary:
    """The ``Summary`` of a trace's ranks (computed once per trace)."""
    return trace.shared(
        Shared.RANK_SUMMARY, lambda: Summary(trace.table(steps_module.steps), overlap(trace), *_arrivals(trace))
    )


def _arrivals(trace: TraceTables) -> tuple[pd.DataFrame, str]:
    """The collectives of ``trace`` with each rank's arrival and ``seq``, not yet matched."""
    rows, labels, does, source, host = _collective_events(trace)
    frame = steps_module.windows(trace)
    window = steps_module.window_of(trace, frame)[rows]
    events = trace.events
    ts = events["ts"].to_numpy()[rows]
    nbytes, factor = _message(events, rows, does, host)
    out = pd.DataFrame(
        {
            "rank": events["rank"].to_numpy()[rows],
            "step": events["step"].to_numpy()[rows],
            "collective": text(np.asarray(labels, dtype=object)),
            "ts": ts - trace_start(trace),
            "dur": events["dur"].to_numpy()[rows],
            "arrival_us": ts - frame["start"].to_numpy()[np.maximum(window, 0)],
            "key": _key(labels),
            "together": pd.Series(does, dtype=object).str.contains(_ENDS_TOGETHER).to_numpy(dtype=bool),
            "p2p": pd.Series(does, dtype=object).str.match(_POINT_TO_POINT).to_numpy(dtype=bool),
            "bytes": nbytes,
            "bus_factor": factor,
        }
    )[window >= 0]
    out = out.sort_values(["rank", "step", "ts"], kind="stable")
    out.insert(3, "seq", out.groupby(["rank", "step", "key"]).cumcount())
    return out, source


def steps_of(summaries: list[Summary]) -> pd.DataFrame:
    """``steps()`` of all the ranks summarized (summaries in rank order)."""
    return steps_module.combine([s.steps for s in summaries])


@computes("collectives")
def collectives(trace: TraceTables) -> pd.DataFrame:
    """Every collective on every rank, matched across ranks, with each rank's wait.

    Columns: ``rank``, ``step``, ``collective`` (name as recorded), ``seq`` (n-th of that
    collective in the step on that rank, from 0), ``ts`` (µs since the trace's start),
    ``dur``, ``arrival_us`` (start minus the rank's step start: the step-aligned clock),
    ``wait_us`` (the latest matched rank's arrival minus this rank's: time spent waiting
    for the slowest, on the ranks' common clock), ``excess_us`` (duration minus the
    shortest matched duration: the same wait estimated without any clock, since such a
    collective ends together on all ranks), ``transfer_us`` (the rest of the duration,
    ``dur − excess_us``: the time spent moving data once the last rank arrived, so that
    ``excess_us + transfer_us = dur``; where the wait is unknown, ``dur``, an upper bound),
    ``ranks`` (how many ranks have this
    collective), ``source`` (kernel | annotation | record_param_comms). Wait columns are
    NaN where only one rank has it, and for point-to-point transfers (send, recv, SendRecv
    kernels not launched by an all-to-all: their wait is for one peer, which the trace
    does not name); ``excess_us`` is NaN too for collectives that need not end together
    (broadcast, reduce, gather, scatter: the root leaves at another time). ``bytes`` (the
    message: ``In msg nelems`` × dtype size, all-gather's output), ``algbw_gbps`` (bytes over
    ``transfer_us``, GB/s = 10⁹ bytes/s) and ``busbw_gbps`` (algbw × the NCCL tests' bus factor for the
    collective and ``Group size``: 2(n−1)/n all-reduce, (n−1)/n reduce-scatter, all-gather,
    all-to-all, 1 broadcast, reduce and point-to-point); NaN where the trace records no
    message sizes. Collectives outside every step window are left out.

    The common clock is the trace's own (ranks of a job record synchronized wall-clock
    times), corrected for NCCL kernels by each rank's offset estimated from the ends of the
    collectives that end together (all-reduce, all-gather, reduce-scatter, all-to-all,
    barrier; ``df.attrs['clock_offset_us']``). Step starts are no common clock: ranks begin
    a step at different moments, and that lateness is what a straggler is.
    """
    return collectives_of([summarize(trace)])


def collectives_of(summaries: list[Summary]) -> pd.DataFrame:
    """``collectives()`` of all the ranks summarized (summaries in rank order).

    The kind of event that counts is the best any rank has (a rank with only host
    annotations adds none when others have NCCL kernels), as for ranks loaded together.
    """
    source = min((s.source for s in summaries), key=SOURCES.index)
    frames = [s.arrivals for s in summaries if s.source == source]
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    match = out.groupby(["step", "key", "seq"])
    count = match["rank"].transform("size")
    shared = count > 1
    together = shared & out["together"]
    offsets = _clock_offsets(out, match, together) if source == "kernel" else pd.Series(dtype=float)
    arrival = out["ts"] - out["rank"].map(offsets).fillna(0.0)
    out = out.assign(
        wait_us=(arrival.groupby([out["step"], out["key"], out["seq"]]).transform("max") - arrival).where(
            shared & ~out["p2p"]
        ),
        excess_us=(out["dur"] - match["dur"].transform("min")).where(together),
        ranks=count.to_numpy(),
        source=source,
    )
    # the transfer: the duration less the wait for the last rank (``excess_us``) where known
    out["transfer_us"] = out["dur"] - out["excess_us"].fillna(0.0)
    transfer_s = out["transfer_us"].to_numpy() * 1e-6
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(transfer_s > 0, out["bytes"].to_numpy(dtype=float) / transfer_s / 1e9, np.nan)
    out = out.assign(algbw_gbps=algbw, busbw_gbps=algbw * out["bus_factor"].to_numpy(dtype=float))
    out = out[list(COLLECTIVE_COLUMNS)].sort_values(["step", "ts", "rank"], kind="stable").reset_index(drop=True)
    out.attrs["clock_offset_us"] = {int(rank): float(value) for rank, value in offsets.items()}
    return out


def _clock_offsets(out: pd.DataFrame, match: pd.core.groupby.DataFrameGroupBy, together: pd.Series) -> pd.Series:
    """Per rank: how far its clock runs ahead of the others (µs), from NCCL kernel ends.

    A collective in which every rank needs every other's data (``together``: matched and
    of that kind) ends at the same moment on every rank, so the median gap between a
    rank's end and the median end of each such collective is its clock offset (near 0
    when ranks share a clock). Other kernels (a send ends when its peer has the data)
    are no evidence.
    """
    end = out["ts"] + out["dur"]
    lag = end - end.groupby([out["step"], out["key"], out["seq"]]).transform("median")
    return lag[together].groupby(out["rank"][together]).median()


@computes("stragglers")
def stragglers(trace: TraceTables) -> pd.DataFrame:
    """The straggler of each step: the rank the others wait for.

    Where collectives are matched across ranks in a step, the straggler is the rank with
    the least total wait in them (it arrives last); otherwise the rank with the longest
    step. One row per step present on two or more ranks. Step times are the device
    windows' (``steps()``'s ``window_dur``).

    Columns: ``step``, ``rank`` (the straggler), ``by`` (collectives | step_time),
    ``step_us`` (its step time), ``median_step_us`` (over ranks), ``wait_us`` (its total
    collective wait in the step), ``median_wait_us`` (over ranks).
    """
    return stragglers_of([summarize(trace)])


def stragglers_of(summaries: list[Summary]) -> pd.DataFrame:
    """``stragglers()`` of all the ranks summarized (summaries in rank order)."""
    return _stragglers(steps_of(summaries), collectives_of(summaries))


def _stragglers(steps: pd.DataFrame, found: pd.DataFrame) -> pd.DataFrame:
    waits = found.groupby(["rank", "step"])["wait_us"].sum(min_count=1).rename("wait_us")
    table = steps[["rank", "step", "window_dur"]].rename(columns={"window_dur": "dur"}).join(waits, on=["rank", "step"])
    rows = []
    for step, group in table.groupby("step"):  # one per step
        if len(group) < 2:
            continue
        by_wait = group["wait_us"].notna().sum() >= 2
        pick = group.loc[group["wait_us"].idxmin()] if by_wait else group.loc[group["dur"].idxmax()]
        rows.append(
            {
                "step": int(step),
                "rank": int(pick["rank"]),
                "by": "collectives" if by_wait else "step_time",
                "step_us": float(pick["dur"]),
                "median_step_us": float(group["dur"].median()),
                "wait_us": float(pick["wait_us"]),
                "median_wait_us": float(group["wait_us"].median()),
            }
        )
    return pd.DataFrame(rows, columns=TABLES["stragglers"].names) if rows else TABLES["stragglers"].empty()


def overlap(trace: TraceTables) -> pd.Series:
    """Per rank: % of communication-kernel time during which a compute kernel also runs.

    Computed over the GPU activity inside the steps' device windows (see ``steps()``);
    NaN for a rank without communication kernels.
    """
    frame = steps_module.device_windows(trace)
    masks = steps_module.category_masks(trace)
    comm_kernels = masks["comm_us"] & kind_mask(trace.events, "kernel")
    ranks = frame["rank"].to_numpy()
    measured = [
        steps_module.in_windows(trace, frame, np.flatnonzero(rows)) for rows in (comm_kernels, masks["compute_us"])
    ]
    comm = union_length(*measured[0], len(frame))
    compute = union_length(*measured[1], len(frame))
    group, start, end = (np.concatenate(c) for c in zip(*measured))
    both = union_length(group, start, end, len(frame))
    shared = pd.Series(comm + compute - both).groupby(ranks).sum()
    comm_total = pd.Series(comm).groupby(ranks).sum()
    return (100.0 * shared / comm_total.where(comm_total > 0)).rename("overlap_pct")


@computes("ranks")
def ranks(trace: TraceTables) -> pd.DataFrame:
    """One row per rank: mean step time and breakdown, overlap, waits, the slowest rank.

    Columns: ``rank``; ``steps`` (count); ``step_us`` (mean step time: the device window,
    ``steps()``'s ``window_dur``); the mean per step of ``compute_us``, ``comm_us``,
    ``memcpy_us``, ``memset_us``, ``runtime_us``, ``dataloader_us``, ``cpu_us``,
    ``idle_us`` (see ``steps()``; they add up to ``step_us``); ``gpu_idle_pct`` (% of the
    windows in which no GPU activity runs, NaN without a GPU); ``overlap_pct`` (% of
    communication-kernel time overlapped by compute kernels, NaN without communication
    kernels); ``wait_us`` (mean per step of the time
    spent waiting for other ranks in collectives, NaN when none are matched);
    ``straggler_steps`` (steps in which this rank was the straggler, see ``stragglers``);
    ``slowest`` (bool: the rank that was the straggler most often, ties broken by the
    longer mean step; with a single rank, that rank).
    """
    return ranks_of([summarize(trace)])


def ranks_of(summaries: list[Summary]) -> pd.DataFrame:
    """``ranks()`` of all the ranks summarized (summaries in rank order)."""
    table = steps_of(summaries)
    grouped = table.groupby("rank")
    out = grouped.agg(steps=("step", "size"), step_us=("window_dur", "mean"), **{m: (m, "mean") for m in _MEANS})
    idle, window = grouped["gpu_idle_us"].sum(min_count=1), grouped["window_dur"].sum()
    out["gpu_idle_pct"] = 100.0 * idle / window.where(window > 0)
    overlaps = [s.overlap for s in summaries]
    out = out.join(pd.concat(overlaps) if len(overlaps) > 1 else overlaps[0])
    found = collectives_of(summaries)
    waits = found.groupby(["rank", "step"])["wait_us"].sum(min_count=1)
    out["wait_us"] = waits.groupby(level="rank").mean().reindex(out.index)
    late = _stragglers(table, found)["rank"].value_counts()
    out["straggler_steps"] = late.reindex(out.index, fill_value=0).astype(np.int64)
    order = out.sort_values(["straggler_steps", "step_us"], ascending=False, kind="stable")
    out["slowest"] = out.index == order.index[0] if len(out) else []
    return out.reset_index()
