"""Derived columns every analysis needs: nesting, self time, steps, launches, modules.

All of it is vectorized with numpy (no per-event Python loop), so it stays fast on traces of
millions of events. Row numbers below are positions in the events table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracemagic.trace.kineto import CPU_KINDS, GPU_ACTIVITY, GPU_KINDS, KINDS
from tracemagic.trace.kineto import step_number as _step_number
from tracemagic.trace.normalize import kind_codes, kind_mask, per_category

try:  # the one-pass nesting in C (setup.py builds it where a compiler is found)
    from tracemagic.trace import _nesting
except ImportError:  # pragma: no cover - installed without a C compiler: numpy alone
    _nesting = None  # type: ignore[assignment]  # the callers test for None

#: an event that ends at most this much (µs) after another still nests in it: JSON floats of
#: epoch-µs times carry ~0.1 µs error
NEST_TOLERANCE_US = 0.25
#: a child starts at least this much (µs) before its parent ends: half the nanosecond
#: resolution of the finest traces, so float noise cannot make an event that starts at (or
#: after) another's end, however short, its child: it is a sibling
NEST_START_MARGIN_US = 0.0005
MODULE_PREFIX = "nn.Module: "


def sort_by_thread(group: np.ndarray, start: np.ndarray, then: np.ndarray | None = None) -> np.ndarray:
    """The order of rows by (``group``, ``start``, ``then``): ``np.lexsort((then, start,
    group))``, ~2x faster on trace data, whose starts are nearly sorted already (a stable
    sort of them is close to linear) and whose groups (threads) are few."""
    order = np.argsort(start, kind="stable")
    if then is not None and order.size > 1:
        ordered = start[order]
        same = (ordered[1:] == ordered[:-1]) | (np.isnan(ordered[1:]) & np.isnan(ordered[:-1]))
        if same.any():  # runs of equal starts: by ``then`` within each run
            tied = np.flatnonzero(np.append(False, same) | np.append(same, False))
            run = np.cumsum(np.append(True, ~same))[tied]
            rows = order[tied]
            order[tied] = rows[np.lexsort((then[rows], run))]
        del ordered, same  # (per row: freed before the next sort)
    if not group.size or group.min() == group.max():  # one thread: the stable sort by it keeps this order
        return order
    codes, uniques = pd.factorize(group[order], sort=True)
    dense = codes.astype(np.int16 if len(uniques) < 2**15 else np.int64)  # int16 sorts by radix
    del codes
    return order[np.argsort(dense, kind="stable")]


def previous_enclosing(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For rows sorted by (group, start, -end): the nearest earlier row of the same group
    that encloses this one (its parent), else -1.

    A row encloses a later one when it ends no more than ``NEST_TOLERANCE_US`` before the
    later one ends and at least ``NEST_START_MARGIN_US`` after it starts; or when both
    start together (the sort puts the longer first; zero durations included). Binary
    lifting over a sparse table of running maxima: O(n log n), vectorized.
    """
    n = end.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    target = np.maximum(end - NEST_TOLERANCE_US, start + NEST_START_MARGIN_US)
    table = [end]
    span = 1
    while span * 2 <= n:
        prev = table[-1]
        table.append(np.maximum(prev[:-span], prev[span:]))
        span *= 2
    pos = np.arange(n, dtype=np.int64)  # search window is [.., pos): shrink pos leftwards
    for level in range(len(table) - 1, -1, -1):
        width = 1 << level
        start_at = pos - width
        ok = start_at >= 0
        maxima = np.full(n, np.inf)
        maxima[ok] = table[level][start_at[ok]]
        move = ok & (maxima < target)
        pos = np.where(move, start_at, pos)
    parent = pos - 1
    valid = parent >= 0
    valid[valid] &= end[parent[valid]] >= target[valid]
    valid[valid] &= group[parent[valid]] == group[valid]
    parent = np.where(valid, parent, -1)
    together = np.append(False, (start[1:] == start[:-1]) & (group[1:] == group[:-1]))
    parent[together] = np.flatnonzero(together) - 1
    return parent


def nest_sorted(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows sorted by (group, start, -end): each row's parent (``previous_enclosing``)
    and depth (0 at the top), with numpy: ``nest``'s path where the C extension is not
    built (``_nesting.nest_rows`` does the same walk in one pass)."""
    parent = previous_enclosing(group, start, end)
    depth = np.zeros(end.size, dtype=np.int32)
    while True:  # one round per nesting level; parents precede children, so it ends
        deeper = np.where(parent >= 0, depth[np.maximum(parent, 0)] + 1, 0)
        if np.array_equal(deeper, depth):
            return parent, depth
        depth = deeper


def thread_keys(events: pd.DataFrame, rows: np.ndarray | None = None) -> np.ndarray:
    """One int64 per row (of ``rows``, default all) naming its (rank, pid, tid): events
    nest only within one key; keys order threads by rank, then pid and tid codes. One C pass
    (``_nesting.thread_key_rows``) where the extension is built, else numpy (the same keys)."""
    pid = events["pid"].array.codes  # (``.cat.codes`` copies them)
    tid = events["tid"].array.codes
    rank = events["rank"].to_numpy() if "rank" in events else None  # one rank before stacking
    if rows is not None:
        pid, tid, rank = pid[rows], tid[rows], (rank[rows] if rank is not None else None)
    fits = pid.flags.c_contiguous and tid.flags.c_contiguous and (rank is None or rank.dtype == np.int32)
    if _nesting is not None and fits:  # the same keys in one C pass over the codes
        keys = np.empty(pid.size, dtype=np.int64)
        ranks = b"" if rank is None else np.ascontiguousarray(rank)
        _nesting.thread_key_rows(pid, pid.itemsize, tid, tid.itemsize, ranks, keys)
        return keys
    # no int64 temporary (each a fresh mapping, faulted in): a code + 1 fits its own type
    # (categorical codes have room for one more category), and a rank 0 adds nothing
    keys = np.add(pid, 1, dtype=np.int64)
    keys <<= 21
    keys |= tid + 1
    if rank is not None and rank.any():
        keys |= rank.astype(np.int64) << 42
    return keys


def timed_mask(events: pd.DataFrame, kinds: tuple[str, ...]) -> np.ndarray:
    """Whether each row is a duration (``X``) event of one of the given kinds."""
    ph = events["ph"]
    if not isinstance(ph.dtype, pd.CategoricalDtype):
        return kind_mask(events, *kinds) & (ph == "X").to_numpy()
    # on the codes: no string comparison per row; the category by get_loc and the codes off
    # the array (get_indexer and .cat.codes cost more than the comparison itself)
    values = ph.array
    try:
        at = values.categories.get_loc("X")
    except KeyError:
        return np.zeros(len(ph), dtype=bool)
    is_x = values.codes == at
    return np.logical_and(kind_mask(events, *kinds), is_x, out=is_x)


def timed_rows(events: pd.DataFrame, kinds: tuple[str, ...]) -> np.ndarray:
    """Rows of the duration (``X``) events of the given kinds, in table order."""
    return np.flatnonzero(timed_mask(events, kinds))


def narrow_rows(rows: np.ndarray) -> np.ndarray:
    """Row numbers of the events table (-1 for none) as int32 where the table's rows fit
    (2**31 of them, always in practice): what a trace keeps per event for its lifetime in
    half the memory; they index alike."""
    return rows.astype(np.int32, copy=False) if rows.size < 2**31 and (not rows.size or rows.max() < 2**31) else rows


def cpu_by_thread(events: pd.DataFrame) -> np.ndarray:
    """Rows of the CPU duration events sorted by (thread, start, longest first): the order
    nesting walks and ``enclosing_at`` searches (a trace made by ``load`` has it already)."""
    return _cpu_by_thread_keyed(events)[0]


def _cpu_by_thread_keyed(events: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """``cpu_by_thread`` and the ``thread_keys`` of its rows, in its order."""
    rows = timed_rows(events, CPU_KINDS)
    keys = thread_keys(events, rows)
    # of equal starts the longer first: by duration, which is exact, where an epoch-µs end
    # (ts + dur) is rounded to 0.25 µs
    order = sort_by_thread(keys, events["ts"].to_numpy()[rows], -events["dur"].to_numpy()[rows])
    return rows[order], keys[order]


def nest(
    events: pd.DataFrame, t0: float, keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parent row, depth and self time (µs) of every CPU-side duration event, and the
    ``cpu_by_thread`` order it walked (``keys``: the ``thread_keys`` of ``events``, where known).

    Events nest per (pid, tid); GPU events and instants get parent -1, depth -1 and
    self time equal to their duration. Sorting, nesting and self time are one C call
    (``_nesting.nest_rows``) where the extension is built, else numpy (the same values).
    """
    if _nesting is None:
        return _nest_with_numpy(events, t0)
    n = len(events)
    mask = timed_mask(events, CPU_KINDS)
    parent = np.empty(n, dtype=np.int64)
    depth = np.empty(n, dtype=np.int32)
    self_dur = np.empty(n, dtype=np.float64)
    ordered = np.empty(np.count_nonzero(mask), dtype=np.int64)
    _nesting.nest_rows(
        mask.view(np.uint8),
        thread_keys(events) if keys is None else keys,
        np.ascontiguousarray(events["ts"].to_numpy(), dtype=np.float64),
        np.ascontiguousarray(events["dur"].to_numpy(), dtype=np.float64),
        t0,
        NEST_TOLERANCE_US,
        NEST_START_MARGIN_US,
        ordered,
        parent,
        depth,
        self_dur,
    )
    return parent, depth, self_dur, ordered


def _nest_with_numpy(events: pd.DataFrame, t0: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``nest`` without the C extension: numpy's sort by thread, ``nest_sorted``'s walk,
    then the children's durations summed per parent (in the walk's order, as C sums them)."""
    n = len(events)
    dur = events["dur"].to_numpy()
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.full(n, -1, dtype=np.int32)
    self_dur = dur.copy()
    ordered, keys = _cpu_by_thread_keyed(events)
    if ordered.size == 0:
        return parent, depth, self_dur, ordered
    start = events["ts"].to_numpy()[ordered] - t0  # from t0: epoch-µs floats are coarse
    sorted_parent, d = nest_sorted(keys, start, start + dur[ordered])
    has = sorted_parent >= 0
    parent[ordered[has]] = ordered[sorted_parent[has]]
    depth[ordered] = d
    rows = ordered[has]
    child_time = np.bincount(parent[rows], weights=dur[rows], minlength=n)
    self_dur[ordered] = np.maximum(dur[ordered] - child_time[ordered], 0.0)
    return parent, depth, self_dur, ordered


def propagate(parent: np.ndarray, depth: np.ndarray, is_anchor: np.ndarray) -> np.ndarray:
    """Row of the innermost enclosing anchor event (itself included), else -1."""
    if _nesting is not None:
        out = np.empty(parent.size, dtype=np.int64)
        _nesting.propagate(
            np.ascontiguousarray(parent, dtype=np.int64), np.ascontiguousarray(is_anchor, dtype=bool), out
        )
        return out
    out = np.where(is_anchor, np.arange(parent.size), -1)
    if parent.size == 0:
        return out
    for level in range(1, int(depth.max(initial=0)) + 1):
        rows = np.flatnonzero(depth == level)
        inherit = rows[out[rows] < 0]
        out[inherit] = out[parent[inherit]]
    return out


def _propagate_pair(
    parent: np.ndarray, depth: np.ndarray, ordered: np.ndarray, is_a: np.ndarray, is_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``propagate`` of both anchor masks: where ``nest`` walked (``ordered``, its
    ``cpu_by_thread`` rows, each after its parent), two passes in one C call
    (``_nesting.propagate_pair``) instead of two climbs; else each propagated (the same rows)."""
    if _nesting is not None and parent.dtype == np.int64 and ordered.dtype in (np.int32, np.int64):
        out_a, out_b = np.empty(parent.size, dtype=np.int64), np.empty(parent.size, dtype=np.int64)
        wide, a, b = ordered.dtype == np.int64, is_a.view(np.uint8), is_b.view(np.uint8)
        if _nesting.propagate_pair(ordered, wide, parent, a, b, False, out_a, out_b):
            return out_a, out_b
    return propagate(parent, depth, is_a), propagate(parent, depth, is_b)


def enclosing_of_kind(parent: np.ndarray, depth: np.ndarray, is_kind: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For each row: the nearest strict ancestor that is of the kind, else -1."""
    inner = propagate(parent, depth, is_kind)
    start = parent[rows]
    return np.where(start >= 0, inner[np.maximum(start, 0)], -1)


def step_numbers(events: pd.DataFrame, kinds: np.ndarray | None = None) -> np.ndarray:
    """The ProfilerStep number of every event by time (-1: in no step): the last step that
    starts at or before it, if it has not ended (with ``NEST_TOLERANCE_US``) by then. Of
    steps with one number, the first to start counts (``repeated_steps`` says so).

    GPU events are given the step of the runtime call that launched them later
    (see ``launches``); here they are placed by their own time.
    """
    return _step_numbers(events, kind_codes(events) if kinds is None else kinds)[0]


def _step_numbers(events: pd.DataFrame, kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``step_numbers``, and the rows and numbers of the steps left out (by start): those
    whose number a step that started before has."""
    step_rows = np.flatnonzero(kinds == KINDS.index("step"))
    none = np.zeros(0, dtype=np.int64)
    if step_rows.size == 0:
        return np.full(len(events), -1, dtype=np.int64), none, none
    ts = events["ts"].to_numpy()
    # numpy on the few steps (a pandas table of them cost ~2 ms); each name parsed once
    names = events["name"].array
    codes, at = np.unique(names.codes[step_rows], return_inverse=True)
    categories = names.categories
    numbers = np.array([_step_number(categories[c]) for c in codes.tolist()], dtype=np.int64)[at.reshape(-1)]
    starts = ts[step_rows]
    order = np.argsort(starts, kind="stable")
    first = np.unique(numbers[order], return_index=True)[1]
    keep = order[np.sort(first)]  # by start, the first of each number
    left: tuple[np.ndarray, np.ndarray] = (none, none)
    if keep.size < step_rows.size:  # (rare: the steps' rows are looked at again only then)
        out = np.setdiff1d(order, keep, assume_unique=True)
        out = out[np.argsort(starts[out], kind="stable")]
        left = (step_rows[out], numbers[out])
    step = _in_steps(ts, starts[keep], events["dur"].to_numpy()[step_rows[keep]], numbers[keep])
    return step, *left


def _in_steps(ts: np.ndarray, starts: np.ndarray, durations: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """Per ``ts``, the number of the last step (``starts``, ascending) that starts at or
    before it, if it has not ended by then (with ``NEST_TOLERANCE_US``), else -1."""
    # per step, after a first entry for index 0: no time is at or before NaN
    last = np.concatenate(([np.nan], starts + durations + NEST_TOLERANCE_US))
    if _nesting is not None and ts.dtype == np.float64 and ts.flags.c_contiguous:  # the search below in one C pass
        step = np.empty(ts.size, dtype=np.int64)
        _nesting.step_rows(np.ascontiguousarray(starts), last, np.ascontiguousarray(numbers, dtype=np.int64), ts, step)
        return step
    index = np.searchsorted(starts, ts, side="right")  # 0: before the first step
    outside = np.less_equal(ts, last.take(index))
    np.logical_not(outside, out=outside)
    step = np.concatenate(([-1], numbers)).take(index)
    step[outside] = -1
    return step


def repeated_steps(
    events: pd.DataFrame, kinds: np.ndarray, rows: np.ndarray, numbers: np.ndarray, step: np.ndarray
) -> str:
    """The warning for the steps left out of ``step`` (their ``rows`` and ``numbers``, by
    start) since an earlier step has their number: which numbers, and how many events that
    lie in them are in no step (-1) for it (GPU work by its launch, as ``step`` places it)."""
    ts = events["ts"].to_numpy()
    inside = _in_steps(ts, ts[rows], events["dur"].to_numpy()[rows], np.arange(rows.size, dtype=np.int64))
    inside[_kind_in(kinds, GPU_ACTIVITY)] = -1
    launch = launches(events, kinds)
    launched = np.flatnonzero(launch >= 0)
    inside[launched] = inside[launch[launched]]
    lost = int(np.count_nonzero((inside >= 0) & (step < 0) & (kinds != KINDS.index("step"))))
    repeats, counts = np.unique(numbers, return_counts=True)
    said = ", ".join(f"#{n} {c + 1} times" for n, c in zip(repeats[:5].tolist(), counts[:5].tolist()))
    more = f" and {repeats.size - 5} more" if repeats.size > 5 else ""
    return (
        f"ProfilerStep numbers repeat ({said}{more}): steps() keeps the first step of each number; the "
        f"{rows.size} later ones are left out, and the {lost} events in them are in no step (step -1)"
    )


def _kind_in(kinds: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Whether each of ``kind_codes`` (-1: no kind) is one of the kinds named, decided per
    kind (``per_category``: the int8 codes compared, not widened for a gather; ``np.isin`` sorts)."""
    answers = np.zeros(len(KINDS), dtype=bool)
    answers[[KINDS.index(k) for k in names]] = True
    return per_category(answers, kinds)


def launches(events: pd.DataFrame, kinds: np.ndarray | None = None) -> np.ndarray:
    """Row of the runtime call that launched each GPU event (by correlation id), else -1."""
    kinds = kind_codes(events) if kinds is None else kinds  # (``kind_codes``, where known)
    launch = np.full(len(events), -1, dtype=np.int64)
    runtime_rows = np.flatnonzero(kinds == KINDS.index("runtime"))
    gpu_rows = np.flatnonzero(_kind_in(kinds, GPU_KINDS)) if runtime_rows.size else runtime_rows
    if runtime_rows.size == 0 or gpu_rows.size == 0:  # (a CPU trace: no pass over the correlation ids)
        return launch
    has_corr = np.asarray(events["correlation"].notna().to_numpy(), dtype=bool)
    runtime_rows, gpu_rows = runtime_rows[has_corr[runtime_rows]], gpu_rows[has_corr[gpu_rows]]
    if runtime_rows.size == 0 or gpu_rows.size == 0:
        return launch
    corr = events["correlation"].to_numpy(dtype=np.int64, na_value=-1)
    lookup = pd.Series(runtime_rows, index=corr[runtime_rows])
    lookup = lookup[~lookup.index.duplicated()]
    found = lookup.reindex(corr[gpu_rows]).to_numpy()
    ok = ~np.isnan(found)
    launch[gpu_rows[ok]] = found[ok].astype(np.int64)
    return launch


def by_external_id(events: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """For each of ``rows`` (runtime calls of one rank's events): the row of the op, annotation or step
    with the same ``External id`` (the first in table order), else -1 (no id, id 0, none).

    The TensorBoard plugin links runtime calls to their op so (``event_parser.py``,
    ``parse_nodes``: ``externalid_to_runtime``), which holds where nesting cannot: a runtime
    call on another thread than its op, or a 0 µs call exactly at an op's boundary. Unlike
    the plugin, a link to an op that was not running when the call started is not taken
    (the id is then of another numbering, as in converted traces that copy the correlation
    id into ``External id``): such calls fall back to nesting.
    """
    found = np.full(rows.size, -1, dtype=np.int64)
    ext = events["external_id"]
    if rows.size == 0 or not ext.notna().any():
        return found
    ids = ext.to_numpy(dtype=np.int64, na_value=0)
    ops = np.flatnonzero(kind_mask(events, "cpu_op", "user_annotation", "step") & (ids != 0))
    if ops.size == 0:
        return found
    lookup = pd.Index(ids[ops])
    first = ~lookup.duplicated()
    at = pd.Index(lookup[first]).get_indexer(ids[rows])
    known = (at >= 0) & (ids[rows] != 0)
    op = ops[first][np.maximum(at, 0)]
    # an id of another numbering (some converted traces give runtime calls their
    # correlation id as External id) would link to an op that ran at another time
    ts, dur = events["ts"].to_numpy(), events["dur"].to_numpy()
    start = ts[rows] - ts[op]
    known &= (start >= -NEST_TOLERANCE_US) & (start <= dur[op] + NEST_TOLERANCE_US)
    found[known] = op[known]
    return found


def _kind_codes(events: pd.DataFrame) -> np.ndarray:
    """``kind_codes`` (read-only): the kind column's codes themselves where its categories
    are ``KINDS`` in order, as ``normalize.event_kinds`` makes them (no gather, no copy)."""
    kind = events["kind"].array
    if isinstance(kind, pd.Categorical) and kind.categories.tolist() == list(KINDS):
        codes = kind.codes.view()
    else:
        codes = kind_codes(events)
    codes.flags.writeable = False
    return codes


def structure_columns(events: pd.DataFrame) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[str]]:
    """The columns ``parent``, ``depth``, ``self_dur``, ``step``, ``launch``, ``op`` and
    ``module`` (by name, in that order), the ``cpu_by_thread`` rows (the analyses search
    in that order too), the ``thread_keys`` of ``events`` (which several analyses use) and
    warnings (``repeated_steps``).

    ``op`` is the CPU op that launched a GPU event (or a runtime call's op): the innermost
    ``cpu_op`` at or around the op, annotation or step that shares the runtime call's
    ``External id`` (``by_external_id``, the TensorBoard plugin's link), else, without
    one, the innermost op enclosing the runtime call on its thread. ``module`` is the
    innermost ``nn.Module`` event enclosing a CPU event, or that op (or runtime call) for
    a GPU event. Both are row numbers, -1 where none. ``step`` of a GPU event is its
    launching runtime call's step; -1 for GPU work with no launching runtime call in the
    trace (in flight when profiling began) and work launched outside steps, as
    ``steps()`` counts them (in no step).
    """
    ts = events["ts"].to_numpy()
    t0 = float(np.nanmin(ts)) if len(ts) else 0.0
    keys = thread_keys(events)
    parent, depth, self_dur, ordered = nest(events, t0, keys)
    kinds = _kind_codes(events)
    step, repeated, repeated_numbers = _step_numbers(events, kinds)
    launch = launches(events, kinds)
    names = events["name"]
    module_names = np.asarray(names.cat.categories.str.startswith(MODULE_PREFIX), dtype=bool)
    is_module = per_category(module_names, names.array.codes)
    is_module &= kinds == KINDS.index("python_function")
    is_op = kinds == KINDS.index("cpu_op")
    module, op = _propagate_pair(parent, depth, ordered, is_module, is_op)
    runtime = np.flatnonzero(kinds == KINDS.index("runtime"))
    linked = by_external_id(events, runtime)
    has_link = linked >= 0
    op[runtime[has_link]] = op[linked[has_link]]
    module[runtime[has_link]] = module[linked[has_link]]
    has_launch = launch >= 0
    rows = np.flatnonzero(has_launch)
    module[rows] = module[launch[rows]]
    op[rows] = op[launch[rows]]
    step[_kind_in(kinds, GPU_ACTIVITY)] = -1
    step[rows] = step[launch[rows]]
    columns = {"parent": parent, "depth": depth, "self_dur": self_dur, "step": step, "launch": launch}
    columns.update(op=op, module=module)
    notes = [repeated_steps(events, kinds, repeated, repeated_numbers, step)] if repeated.size else []
    return columns, ordered, keys, notes
