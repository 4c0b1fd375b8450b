"""``memory()``: the allocator timeline per device, its peaks, the biggest allocations, and
the timeline stacked by category (parameter, activation, gradient, ...) when the capture
recorded torch's memory profile next to the Kineto trace."""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    columns_at,
    in_order,
    layer_text,
    memory_holders,
    name_text,
    take_codes,
    text_take,
    trace_start,
)
from tracemagic.analysis.attribution import attribution
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.model import TraceTables

#: c10 ``DeviceType`` numbers -> torch device names (ROCm builds report HIP = 6; torch calls it cuda)
DEVICE_TYPES = {0: "cpu", 1: "cuda", 6: "cuda", 12: "xpu", 13: "mps", 15: "hpu", 19: "mtia", 20: "privateuseone"}
#: category index of ``MemoryProfileTimeline.export_memory_timeline_raw`` rows, in torch's order
CATEGORIES = (
    "parameter",
    "optimizer_state",
    "input",
    "temporary",
    "activation",
    "gradient",
    "autograd_detail",
    "unknown",
)
#: a timeline this far (µs) outside the Kineto trace is on another clock
_CLOCK_SLACK_US = 60e6
#: the events columns the memory table is made of (only these are gathered)
_USED = ["rank", "ts", "device_type", "device", "total_allocated", "total_reserved", "bytes", "step", "addr"]


def device_names(
    device_type: pd.Series | pd.api.extensions.ExtensionArray, device: pd.Series | pd.api.extensions.ExtensionArray
) -> tuple[np.ndarray, np.ndarray]:
    """``'cpu'``, ``'cuda:0'``, ... from the ``Device Type`` and ``Device Id`` args: the
    distinct names (object array) and, per row, the index of its name."""
    kind = device_type.to_numpy(dtype=np.int64, na_value=-1)
    index = device.to_numpy(dtype=np.int64, na_value=-1)
    # factorized, then the few distinct keys sorted (``np.unique(..., return_inverse=True)``
    # sorts every row)
    key = (kind << 32) + index + 1
    if key.size and key.min() == key.max():  # one device (the usual case): no hashing of every row
        codes, found = np.zeros(key.size, dtype=np.intp), key[:1]
    else:
        codes, found = pd.factorize(key)
    order = np.argsort(found)
    keys = found[order]
    position = np.empty(order.size, dtype=np.intp)
    position[order] = np.arange(order.size)
    inverse = np.take(position, codes)
    labels = []
    for k, i in zip(keys >> 32, (keys & 0xFFFFFFFF) - 1):
        name = DEVICE_TYPES.get(int(k), f"device{int(k)}")
        labels.append(name if name == "cpu" or i < 0 else f"{name}:{int(i)}")
    return np.asarray(labels, dtype=object), inverse


@computes("memory")
def memory(trace: TraceTables) -> pd.DataFrame:
    """Every ``[memory]`` event, one row each, ordered by rank and time.

    Columns: ``rank``; ``ts`` (µs since the trace's start); ``device`` ('cpu', 'cuda:N');
    ``allocated_bytes`` (the allocator's ``Total Allocated`` after the event); ``reserved_bytes``
    (``Total Reserved``, NA where not recorded); ``delta_bytes`` (signed: + allocation,
    - free); ``op`` (innermost enclosing CPU op, None if none) and ``op_row``; ``layer``
    (the layer the time belongs to, backward work included: see ``layers()``); ``phase``
    ('forward' | 'backward', None outside layers and backward ops); ``step`` (-1 outside
    steps); ``addr``; ``row`` (position in ``trace.events``).

    Traces without totals (older ones) get ``allocated_bytes`` rebuilt per device as the
    running sum of deltas from 0 at the trace start, raised by the smallest constant that
    keeps it non-negative (frees of blocks allocated before the capture);
    ``df.attrs['reconstructed']`` {rank: [devices]} and ``df.attrs['baseline_bytes']``
    {rank: {device: bytes added}} say where, and ``df.attrs['note']`` says how.
    """
    events = trace.events
    rows, holder = memory_holders(trace)
    # column by column at the memory rows (a frame of them taken at once copies each twice)
    picked = columns_at(events, _USED, rows)
    att = attribution(trace)
    found = holder >= 0
    safe = np.maximum(holder, 0)
    op_rows = take_codes(events["op"].to_numpy(), holder)  # (-1 where no op holds the event)
    layer_rows = take_codes(att.module, holder)
    backward = found & np.take(att.backward, safe)
    phase = np.where(backward, 1, np.where(layer_rows >= 0, 0, -1))
    # (as arrays: a Series of each costs ~0.3 ms in a fresh process)
    devices, device = device_names(pd.array(picked["device_type"], copy=False), pd.array(picked["device"], copy=False))
    rank = np.asarray(picked["rank"])
    ts = np.asarray(picked["ts"], dtype=np.float64)
    ts -= trace_start(trace)  # (in place: taken at the rows, the array is this table's own)
    allocated = pd.array(picked["total_allocated"], copy=False)
    complete = not allocated.isna().any()  # every event has its total (recent traces): nothing to rebuild
    columns = {
        "rank": rank,
        "ts": ts,
        "device": text_take(devices, device),
        "allocated_bytes": allocated.to_numpy(dtype=np.int64) if complete else allocated,
        "reserved_bytes": picked["total_reserved"],
        "delta_bytes": pd.array(picked["bytes"], copy=False).to_numpy(dtype=np.int64, na_value=0),
        "op": name_text(trace, op_rows),
        "op_row": op_rows,
        "layer": layer_text(trace, layer_rows),
        "phase": text_take(np.array(["forward", "backward"], dtype=object), phase),
        "step": picked["step"],
        "addr": picked["addr"],
        "row": rows.copy(),  # (the shared rows of ``memory_holders``: the frame holds its own)
    }
    if not complete:
        columns["_device"] = rank.astype(np.int64) * (len(devices) + 1) + device  # one key per (rank, device)
    table = pd.DataFrame(columns, copy=False)  # every column is made here: no second copy of each
    # (rows in increasing row order: sorted by (rank, ts) is sorted by (rank, ts, row))
    if not in_order(rank, ts):  # (the events come in time order: rarely sorted again)
        table = table.sort_values(["rank", "ts", "row"], kind="stable").reset_index(drop=True)
    if complete:
        table.attrs["reconstructed"] = {}
        table.attrs["baseline_bytes"] = {}
        return table
    return _fill_allocated(table)


def _fill_allocated(table: pd.DataFrame) -> pd.DataFrame:
    """Rebuild ``allocated_bytes`` from deltas on devices whose events carry no totals
    (``table['_device']`` keys the (rank, device) pairs; it is dropped here): for a table
    where some event has no total (``memory`` makes the others itself)."""
    keys = table.pop("_device")
    table.attrs["reconstructed"] = {}
    table.attrs["baseline_bytes"] = {}
    missing = table["allocated_bytes"].isna().groupby(keys).transform("all").to_numpy()
    running = table["delta_bytes"].groupby(keys).cumsum()
    baseline = (-running.groupby(keys).transform("min")).clip(lower=0)
    rebuilt = (running + baseline).to_numpy(dtype=np.int64)
    known = table["allocated_bytes"].groupby(keys).ffill().fillna(0).to_numpy(dtype=np.int64)
    table["allocated_bytes"] = np.where(missing, rebuilt, known)
    reconstructed: dict[int, list[str]] = {}
    baselines: dict[int, dict[str, int]] = {}
    for (rank, device), base in (
        table.loc[missing].assign(b=baseline[missing]).groupby(["rank", "device"])["b"].first().items()
    ):
        reconstructed.setdefault(int(rank), []).append(str(device))
        baselines.setdefault(int(rank), {})[str(device)] = int(base)
    table.attrs["reconstructed"] = reconstructed
    table.attrs["baseline_bytes"] = baselines
    if reconstructed:
        table.attrs["note"] = (
            "the trace records no allocator totals: allocated_bytes is the running sum of the "
            "deltas from 0 at the trace start, plus baseline_bytes where frees of earlier blocks "
            "would make it negative"
        )
    return table


@computes("memory_peaks")
def peaks(trace: TraceTables) -> pd.DataFrame:
    """The highest ``allocated_bytes`` per rank, device and step, and over the whole trace,
    with what was already allocated when that scope began.

    Columns: ``rank``, ``device``, ``step`` (Int64; NA for the whole-trace row),
    ``peak_bytes`` (the highest ``allocated_bytes`` recorded in the scope: the allocator's
    ``Total Allocated``), ``start_bytes`` (allocated when the scope began, before its first
    event: that event's ``allocated_bytes`` minus its ``delta_bytes``; memory allocated
    before the capture for the whole-trace row), ``peak_reserved_bytes`` (NA where not
    recorded), ``ts`` (when the peak was first reached), ``op``, ``layer``, ``phase`` (of
    the event that reached it), ``delta_bytes`` (that event's allocation).
    """
    table = trace.table(memory)
    columns = TABLES["memory_peaks"].names
    if table.empty:
        return TABLES["memory_peaks"].empty()
    parts = []
    for keys, scope in ((["rank", "device", "step"], table[table["step"] >= 0]), (["rank", "device"], table)):
        if scope.empty:
            continue
        grouped = scope.groupby(keys, sort=True)
        at = table.loc[grouped["allocated_bytes"].idxmax().to_numpy()].reset_index(drop=True)
        first = grouped[["allocated_bytes", "delta_bytes"]].first()  # the table is in time order
        at["start_bytes"] = (first["allocated_bytes"] - first["delta_bytes"]).to_numpy(dtype=np.int64)
        at["peak_reserved_bytes"] = grouped["reserved_bytes"].max().to_numpy()
        if "step" not in keys:
            at["step"] = pd.NA
        parts.append(at)
    out = pd.concat(parts, ignore_index=True).rename(columns={"allocated_bytes": "peak_bytes"})
    out["step"] = out["step"].astype("Int64")
    out["peak_reserved_bytes"] = out["peak_reserved_bytes"].astype("Int64")
    return (
        out[columns].sort_values(["rank", "device", "step"], kind="stable", na_position="last").reset_index(drop=True)
    )


@computes("biggest_allocations")
def biggest_allocations(trace: TraceTables, n: int | None = 10) -> pd.DataFrame:
    """The ``n`` largest single allocations (all of them for None), with when (and
    whether) they were freed.

    Columns: ``rank``, ``ts``, ``device``, ``bytes``, ``op``, ``layer``, ``phase``, ``step``,
    ``addr``, ``freed_ts`` and ``lifetime_us`` (NA when not freed within the trace or the
    trace records no addresses).
    """
    table = trace.table(memory)
    by = ["rank", "device", "addr", "ts", "row"]
    ordered = table.dropna(subset=["addr"]).sort_values(by, kind="stable")
    nxt = ordered.shift(-1)
    freed = (nxt["rank"] == ordered["rank"]) & (nxt["device"] == ordered["device"]) & (nxt["addr"] == ordered["addr"])
    freed &= nxt["delta_bytes"] < 0
    table["freed_ts"] = nxt["ts"].where(freed.fillna(False)).reindex(table.index)
    allocations = table[table["delta_bytes"] > 0].sort_values(
        ["delta_bytes", "ts"], ascending=[False, True], kind="stable"
    )
    out = (allocations if n is None else allocations.head(n)).rename(columns={"delta_bytes": "bytes"})
    out["lifetime_us"] = out["freed_ts"] - out["ts"]
    columns = TABLES["biggest_allocations"].names
    return out[columns].reset_index(drop=True)


def stack(rows: np.ndarray) -> pd.DataFrame:
    """Bytes held per category after each distinct timestamp (ns) of raw timeline rows.

    Rows with ts -1 (allocated before the capture) are placed at the first timestamp.
    """
    ts = rows[:, 0].copy()
    known = ts[ts >= 0]
    ts[ts < 0] = known.min() if known.size else 0
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    category = np.clip(rows[order, 3], 0, len(CATEGORIES) - 1)
    deltas = np.zeros((ts.size, len(CATEGORIES)), dtype=np.int64)
    deltas[np.arange(ts.size), category] = rows[order, 2]
    held = np.cumsum(deltas, axis=0)
    last = np.append(ts[1:] != ts[:-1], True) if ts.size else np.zeros(0, dtype=bool)
    out = pd.DataFrame(held[last], columns=list(CATEGORIES))
    out.insert(0, "ts_ns", ts[last])
    out["total_bytes"] = held[last].sum(axis=1)
    return out


@computes("memory_categories")
def categories(trace: TraceTables) -> pd.DataFrame:
    """The memory timeline stacked by category, from ``memory_timeline_<rank>.json`` files,
    on the allocator's scale: its total is ``memory()``'s ``allocated_bytes`` at the same time.

    One row per distinct timestamp with the bytes held in each category after it.
    Columns: ``rank``, ``cycle`` (Int64, NA for single-cycle captures), ``device``, ``ts``
    (µs since the trace's start), ``before_capture``, one column per category of torch's
    memory profile (parameter, optimizer_state, input, temporary, activation, gradient,
    autograd_detail, unknown), ``total_bytes``; ``df.attrs['categories']`` lists the stacked
    columns in order (``before_capture`` first).

    The profile and the allocator see what existed before the capture differently: the
    profile lists the tensors the captured ops touched (its rows at ts -1), the allocator
    counts what it had handed out (``Total Allocated`` before the first ``[memory]`` event:
    everything on CUDA; on the CPU only blocks allocated while a profiler ran). So
    ``before_capture`` is the allocator's count at the start minus the profile's
    pre-existing tensors: memory allocated before the capture that no category covers.
    Where the allocator counted less than those tensors (the CPU), they are not in its
    totals and are left out here too; ``df.attrs['uncounted']`` {rank: {category: bytes}}
    says how much. Empty, with a ``df.attrs['note']``, when the capture wrote no timeline.
    Timelines use the wall clock; they are placed on the trace's clock with its
    ``baseTimeNanoseconds``, else they start at the trace's start (``df.attrs['clock']``
    says which; on their own clock they cannot be matched to the allocator and
    ``before_capture`` is 0).
    """
    stacked = ["before_capture", *CATEGORIES]
    columns = TABLES["memory_categories"].names
    files = trace.artifacts.memory_timelines
    parts = []
    clocks = set()
    uncounted: dict[int, dict[str, int]] = {}
    t0 = trace_start(trace)
    events = trace.events
    end = float((events["ts"] + events["dur"]).max()) - t0 if len(events) else 0.0
    device = "cuda:0" if trace.has_gpu else "cpu"
    allocator = trace.table(memory) if files else None
    for rank, cycle, rows in files:
        if rows.size == 0:
            continue
        part = stack(rows)
        base = trace.meta.get("ranks", {}).get(rank, {}).get("baseTimeNanoseconds")
        ts = None
        if isinstance(base, int):
            ts = (part["ts_ns"].to_numpy() - base) / 1000.0 - t0
            if ts[0] < -_CLOCK_SLACK_US or ts[-1] > end + _CLOCK_SLACK_US:
                ts = None
        clocks.add("trace" if ts is not None else "own")
        before = 0
        if ts is not None:
            start = _allocator_start(allocator, rank, device, float(ts[0]))
            if start is not None:
                early = rows[rows[:, 0] < 0]
                held = np.bincount(
                    np.clip(early[:, 3], 0, len(CATEGORIES) - 1), weights=early[:, 2], minlength=len(CATEGORIES)
                ).astype(np.int64)
                if held.sum() > start:  # the allocator never counted these tensors: leave them out
                    for name, bytes_ in zip(CATEGORIES, held):
                        part[name] -= bytes_
                        if bytes_:
                            uncounted.setdefault(rank, {})[name] = uncounted.get(rank, {}).get(name, 0) + int(bytes_)
                    part["total_bytes"] -= int(held.sum())
                    before = start
                else:
                    before = start - int(held.sum())
        if ts is None:
            ts = (part["ts_ns"].to_numpy() - part["ts_ns"].iloc[0]) / 1000.0
        part = part.drop(columns="ts_ns")
        part.insert(0, "before_capture", np.int64(before))
        part["total_bytes"] += before
        part.insert(0, "ts", ts)
        part.insert(0, "device", device)
        part.insert(0, "cycle", pd.array([cycle] * len(part), dtype="Int64"))
        part.insert(0, "rank", rank)
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)[columns] if parts else TABLES["memory_categories"].empty()
    out.attrs["categories"] = stacked
    out.attrs["uncounted"] = uncounted
    if not parts:
        out.attrs["note"] = (
            "no memory timeline next to this trace: capture with record_shapes, profile_memory "
            "and with_stack on to have torch classify allocations"
        )
    else:
        out.attrs["clock"] = "trace" if clocks == {"trace"} else "own"
    if uncounted:
        out.attrs["note"] = (
            "tensors that existed before the capture and that the allocator's totals do not count "
            "(on the CPU it counts only blocks allocated while a profiler ran) are left out: "
            "see attrs['uncounted']"
        )
    return out


def _allocator_start(memory: pd.DataFrame | None, rank: int, device: str, ts: float) -> int | None:
    """Bytes the allocator of ``rank``'s ``device`` held just before ``ts`` (µs since the
    trace start): the first ``[memory]`` event from then on, less its own delta; None
    without one."""
    if memory is None or memory.empty:
        return None
    mine = memory[(memory["rank"] == rank) & (memory["device"] == device) & (memory["ts"] >= ts - 1.0)]
    if mine.empty:
        return None
    first = mine.iloc[0]
    return int(first["allocated_bytes"]) - int(first["delta_bytes"])
