"""Helpers the analyses share: relative time, event selection, threads and nesting, layer
names, name tests, sums up a nesting tree and interval unions.

Private to ``tracemagic.analysis``; everything here is vectorized over the events table.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Callable, Collection
from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pandas.api.types import pandas_dtype

from tracemagic.trace import layout, structure
from tracemagic.trace.columns import code_dtype
from tracemagic.trace.kineto import CPU_KINDS, GPU_ACTIVITY
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask, per_code
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import (
    MODULE_PREFIX,
    NEST_START_MARGIN_US,
    cpu_by_thread,
    enclosing_of_kind,
    narrow_rows,
    propagate,
    sort_by_thread,
    thread_keys,
    timed_mask,
)

_INSTANCE_SUFFIX = re.compile(r"_\d+$")
#: host-side collective events: ``nccl:all_reduce``, ``gloo:broadcast`` annotations
HOST_COLLECTIVE = re.compile(r"^(?:nccl|gloo|mpi|ucc|xccl):\w+")
#: DataLoader iteration: ``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``
_DATALOADER = re.compile(r"DataLoader|^enumerate\(DataPipe\)#")


def trace_start(trace: TraceTables) -> float:
    """The earliest ``ts`` over all events of all ranks (µs): time zero of every table.

    A rank opened as part of a job (``tracemagic.load_ranks``) carries the job's time zero
    (``trace.meta["time_zero_us"]``: the earliest ``ts`` of all its ranks), so its tables
    line up with the other ranks' as if they were loaded together.
    """
    given = trace.meta.get("time_zero_us") if isinstance(trace.meta, dict) else None
    if given is not None:
        return float(given)
    return trace.shared(Shared.EARLIEST_TS, lambda: _earliest(trace.events["ts"].to_numpy()))


def _earliest(ts: np.ndarray) -> float:
    return float(np.nanmin(ts)) if ts.size else 0.0


def in_scope(events: pd.DataFrame) -> np.ndarray:
    """Rows inside a ProfilerStep, or any row of a rank that has no ProfilerStep."""
    rank = events["rank"].to_numpy()
    stepped = np.unique(rank[kind_mask(events, "step")])
    if rank.size and stepped.size == 1 and rank.min() == rank.max() == stepped[0]:  # one rank, stepped
        return events["step"].to_numpy() >= 0  # (no pass over the ranks: none is without steps)
    return (events["step"].to_numpy() >= 0) | ~of_ranks(rank, stepped)


def of_ranks(ranks: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``np.isin(ranks, wanted)``, by comparison where ``wanted`` holds a few ranks (isin
    sorts the table's)."""
    if wanted.size > 8:
        return np.isin(ranks, wanted)
    out = np.zeros(ranks.size, dtype=bool)
    for rank in wanted.tolist():
        out |= ranks == rank
    return out


def thread_keys_of(trace: TraceTables) -> np.ndarray:
    """``thread_keys`` of ``trace.events``, computed once per trace."""
    return trace.shared(Shared.THREAD_KEYS, lambda: thread_keys(trace.events))


def thread_order(trace: TraceTables) -> np.ndarray:
    """The trace's CPU duration events by (thread, start, longest first): ``structure.
    cpu_by_thread``, the order ``enclosing_at`` searches in, kept once per trace (read-only;
    int32 rows where they fit); ``load`` hands over the one its nesting made."""
    return trace.shared(Shared.CPU_BY_THREAD, lambda: narrow_rows(_thread_order(trace)))


def _thread_order(trace: TraceTables) -> np.ndarray:
    """``structure.cpu_by_thread`` of a trace whose nesting was not walked in this session
    (reopened from its cache): the C sort the nesting walk makes (``_nesting.order_rows``,
    bucketed by thread, each thread's rows merge-sorted: near linear on a trace's nearly
    sorted rows, ~4x faster than numpy's sorts), else numpy's (the same rows)."""
    events = trace.events
    nesting = structure._nesting
    ts, dur = events["ts"].to_numpy(), events["dur"].to_numpy()
    if nesting is None or not all(a.dtype == np.float64 and a.flags.c_contiguous for a in (ts, dur)):
        return cpu_by_thread(events)
    mask = timed_mask(events, CPU_KINDS)
    ordered = np.empty(np.count_nonzero(mask), dtype=np.int64)
    nesting.order_rows(mask.view(np.uint8), thread_keys_of(trace), ts, dur, ordered)
    return ordered


def activity_rows(trace: TraceTables) -> np.ndarray:
    """Rows of the GPU activity (``GPU_ACTIVITY``: kernels, memcpy, memset), in table order,
    found once per trace: several tables ask, and a CPU trace's answer (none) spares each
    of them its own pass over the table (the caller must not change it)."""
    return trace.shared(Shared.ACTIVITY_ROWS, lambda: np.flatnonzero(kind_mask(trace.events, *GPU_ACTIVITY)))


def memory_off_cpu(trace: TraceTables) -> bool:
    """Whether any ``[memory]`` event is on a device other than the CPU (``Device Type`` not
    0, or not recorded): only such events give ``memory_peaks()`` rows the GPU memory rules
    look at; computed once per trace."""

    def compute() -> bool:
        events = trace.events
        types = events["device_type"].array[kind_mask(events, "memory")]
        return bool((np.asarray(types.to_numpy(dtype=np.int64, na_value=-1)) != 0).any())

    return trace.shared(Shared.MEMORY_OFF_CPU, compute)


def memory_holders(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the ``[memory]`` events and the innermost CPU duration event on the same
    thread containing each (-1 where none; the loader does not nest instants); computed
    once per trace (the memory and layers tables both need them)."""

    def compute() -> tuple[np.ndarray, np.ndarray]:
        events = trace.events
        rows = np.flatnonzero(kind_mask(events, "memory"))
        return rows, enclosing_at(trace, thread_keys(events, rows), events["ts"].to_numpy()[rows])

    return trace.shared(Shared.MEMORY_HOLDERS, compute)


def enclosing_at(trace: TraceTables, keys: np.ndarray, at: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """The innermost CPU duration event on thread ``keys`` (see ``thread_keys``) containing
    ``at``; ``among`` (a mask over the events) narrows the candidates.

    An event contains the moments from its start up to (not including) its end, as it
    contains its children (``structure.previous_enclosing``): a moment at an event's end
    belongs to what comes after it, one at its start to it even when it lasts 0 µs.
    One ``searchsorted`` per thread over the candidates' start times; of events starting
    at the same time the shortest wins. Where that one ended by ``at`` the search climbs
    the nesting (``parent``, which may leave the candidates). -1 where none. One C pass
    (``_nesting.enclosing_at``) where the extension is built, else numpy (the same values).
    """
    out = np.full(keys.size, -1, dtype=np.int64)
    cand = thread_order(trace)
    if among is not None:
        cand = _rows_where(cand, among)
    if keys.size == 0 or cand.size == 0:
        return out
    events = trace.events
    t0 = trace_start(trace)
    ts = events["ts"].to_numpy()  # taken from t0 where read: epoch-µs floats are coarse
    dur = events["dur"].to_numpy()
    at = at - t0
    parent = events["parent"].to_numpy()
    key_of = row_thread_key(events)  # (the keys of the few rows the bisection reads)
    lone = keys.min() == keys.max()  # one thread (the usual case): no grouping of the keys
    nesting = structure._nesting  # the search and the climb in one C pass, where built
    in_c = (
        nesting is not None
        and all(
            a.dtype == want and a.flags.c_contiguous
            for a, want in ((ts, np.float64), (dur, np.float64), (at, np.float64), (parent, np.int64))
        )
        and cand.dtype in (np.int32, np.int64)
    )
    for key in keys[:1] if lone else np.unique(keys):  # one pass per thread; cand is sorted by key
        lo = bisect.bisect_left(cand, key, key=key_of)
        hi = bisect.bisect_left(cand, key + 1, lo, key=key_of)
        if lo == hi:
            continue
        where = slice(None) if lone else np.flatnonzero(keys == key)
        if in_c:
            found = out if lone else np.empty(len(where), dtype=np.int64)  # type: ignore[arg-type]
            mine, wide = cand[lo:hi], cand.dtype == np.int64
            nesting.enclosing_at(mine, wide, ts, dur, parent, t0, NEST_START_MARGIN_US, at[where], found)
            if not lone:
                out[where] = found
            continue
        pos = np.searchsorted(ts[cand[lo:hi]] - t0, at[where], side="right") - 1
        out[where] = np.where(pos >= 0, cand[lo:hi][np.maximum(pos, 0)], -1)
    if in_c:
        return out  # (climbed already)

    def ended(rows: np.ndarray, moment: np.ndarray) -> np.ndarray:
        held = np.maximum(rows, 0)
        start = ts[held] - t0
        return (rows >= 0) & (start + dur[held] < moment + NEST_START_MARGIN_US) & (start != moment)

    climb = np.flatnonzero(ended(out, at))
    while climb.size:  # one round per nesting level, over the ones still climbing
        out[climb] = parent[out[climb]]
        climb = climb[ended(out[climb], at[climb])]
    return out


def _rows_where(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``rows[mask[rows]]`` (``mask``: bool per events row): in one C pass where the extension
    is built (numpy widens int32 rows to an intp index first), else numpy's."""
    nesting = structure._nesting
    if nesting is None or rows.dtype not in (np.int32, np.int64) or mask.dtype != np.bool_:
        return rows[mask[rows]]
    out = np.empty_like(rows)
    kept = nesting.rows_where(np.ascontiguousarray(rows), rows.dtype == np.int64, np.ascontiguousarray(mask), out)
    return out[:kept]


def call_chains(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """The CPU op rows, and for each the row of the top of its call chain (-1: in none; int32
    where rows fit, see ``narrow_rows``); computed once per trace.

    A call chain is an op the program called and every op it runs inside (``aten::conv2d``
    -> ``aten::convolution`` -> ``aten::_convolution`` -> ``aten::mkldnn_convolution``), so
    one convolution is one chain. Its top is the outermost op with recorded input shapes
    or, of ops that record none, the outermost that holds no op with shapes
    (``record_param_comms`` in traces that left its shapes out). Wrappers around ops with
    shapes (``autograd::engine::evaluate_function: ...``, annotations that old traces file
    as ops, like ``Optimizer.step#SGD.step``) top no chain, and their own time is in none.
    In a trace without ``record_shapes`` every outermost op is a top. One C call
    (``_nesting.chain_tops``) where the extension is built, else numpy (the same rows).
    """

    def compute() -> tuple[np.ndarray, np.ndarray]:
        events = trace.events
        is_op = timed_mask(events, ("cpu_op",))
        parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
        dims = events["input_dims"]
        # (a categorical's codes read off the array: ``notna`` goes through pandas' accessor)
        known = dims.array.codes >= 0 if isinstance(dims.dtype, pd.CategoricalDtype) else dims.notna().to_numpy()
        shaped = is_op & known
        nesting = structure._nesting
        if nesting is not None and parent.dtype == np.int64:  # the same tops in one C call
            rows = np.flatnonzero(is_op)
            tops = np.empty(rows.size, dtype=np.int64)
            nesting.chain_tops(parent, is_op.view(np.uint8), shaped.view(np.uint8), rows, tops)
            return rows, narrow_rows(tops)
        holds_shapes = _with_ancestors(np.flatnonzero(shaped), parent)  # itself or inside
        candidate = shaped | (is_op & ~holds_shapes)
        at = np.flatnonzero(candidate)
        is_top = np.zeros(len(events), dtype=bool)
        is_top[at[enclosing_of_kind(parent, depth, candidate, at) < 0]] = True
        rows = np.flatnonzero(is_op)
        return rows, narrow_rows(propagate(parent, depth, is_top)[rows])

    return trace.shared(Shared.CALL_CHAINS, compute)


def _with_ancestors(rows: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Mask of ``rows`` and every row above them along ``up`` (row -> enclosing row, -1 at
    the top): one round per nesting level over the rows not marked yet."""
    out = np.zeros(up.size, dtype=bool)
    at = rows
    while at.size:
        out[at] = True
        at = up[at]
        at = at[at >= 0]
        at = at[~out[at]]  # a marked row's ancestors are marked or on their way
    return out


def flow_thread_keys(events: pd.DataFrame, flows: pd.DataFrame) -> np.ndarray:
    """``thread_keys`` of the events' thread for each flow row; -1 where no event has its pid/tid."""
    codes = []
    for column in ("pid", "tid"):  # (the few categories matched in a dict: pandas' indexers cost ~0.3 ms a call)
        known = {str(v): i for i, v in enumerate(events[column].array.categories.tolist())}
        flow_values = flows[column].array
        # per flow category its events' code, then -1 for a missing value (code -1: the last entry)
        lookup = [known.get(str(v), -1) for v in flow_values.categories.tolist()]
        codes.append(np.take(np.array([*lookup, -1], dtype=np.int64), flow_values.codes))
    pid, tid = codes
    rank = flows["rank"].to_numpy().astype(np.int64)
    return np.where((pid >= 0) & (tid >= 0), (rank << 42) | ((pid + 1) << 21) | (tid + 1), -1)


def nesting_depth(up: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """How many ancestors each of ``rows`` has along ``up`` (row -> enclosing row, -1 at the top)."""
    depth = np.zeros(rows.size, dtype=np.int64)
    cur = up[rows]
    while (cur >= 0).any():  # one round per nesting level
        depth += cur >= 0
        cur = np.where(cur >= 0, up[np.maximum(cur, 0)], -1)
    return depth


def rollup(start: np.ndarray, weights: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Per row of ``up``: the weights placed at rows ``start`` (-1: nowhere) on it or below it.

    ``up`` maps a row to its enclosing row (-1 at the top); each weight is added to its
    start row and to every ancestor, one vectorized round per nesting level.
    """
    keep = start >= 0
    at, weights = start[keep], np.asarray(weights, dtype=np.float64)[keep]
    total = np.zeros(up.size)
    while at.size:  # one round per nesting level
        total += np.bincount(at, weights=weights, minlength=up.size)
        at = up[at]
        keep = at >= 0
        at, weights = at[keep], weights[keep]
    return total


def names_where(names: pd.Series, pattern: re.Pattern[str]) -> np.ndarray:
    """Boolean mask of rows whose categorical name matches ``pattern`` (tested once per name)."""

    def matches(categories: pd.Index) -> np.ndarray:
        # the categories as a list first: iterating an Arrow-backed index is ~8x slower
        return np.fromiter(
            (bool(pattern.search(str(c))) for c in categories.tolist()), dtype=bool, count=len(categories)
        )

    return per_code(names, matches, False)


def names_match_at(names: pd.Series, pattern: re.Pattern[str], rows: np.ndarray) -> np.ndarray:
    """``names_where(names, pattern)[rows]`` for a few ``rows`` (no mask over every row): a
    categorical's names tested once each, then read at the rows' codes."""
    values = names.array
    if not isinstance(values, pd.Categorical):
        return names_where(names, pattern)[rows]
    answers = [bool(pattern.search(str(c))) for c in values.categories.tolist()]
    return np.take(np.array([*answers, False], dtype=bool), np.take(values.codes, rows))  # -1 (missing): False


def is_nccl(names: pd.Series) -> np.ndarray:
    """Rows whose name contains ``nccl`` (any case): NCCL kernels and annotations."""
    return names_where(names, re.compile("nccl", re.IGNORECASE))


def is_dataloader(trace: TraceTables) -> np.ndarray:
    """Ops and annotations of data loading: DataLoader and DataPipe iteration (the profiler's
    own record functions, ``enumerate(DataLoader)#...`` and ``enumerate(DataPipe)#...``, the
    TensorBoard plugin's DataLoader role in ``event_parser.py``). The plugin takes only
    ``enumerate(DataLoader)#...__next__``; we take any name holding ``DataLoader``."""
    events = trace.events
    named = names_where(events["name"], _DATALOADER)
    return named & kind_mask(events, "cpu_op", "user_annotation") if named.any() else named


def values_at(column: pd.Series, rows: np.ndarray) -> np.ndarray:
    """``column.to_numpy()[rows]``, for a categorical column without converting its other
    rows: the codes are taken first, so only ``rows`` become values (the same values and
    missing marker as ``to_numpy``)."""
    values = column.array
    if isinstance(values, pd.Categorical):
        return np.asarray(values.take(np.asarray(rows)))
    return column.to_numpy()[rows]


def column_at(column: pd.Series, rows: np.ndarray) -> pd.api.extensions.ExtensionArray | np.ndarray:
    """A column's values at ``rows``, kept in its own type (a categorical stays one): taken
    column by column, as the per-event tables take theirs (a frame of every used column
    taken at once, ``events.iloc[rows]``, copies all of the table's columns)."""
    return _values_at(column.array, rows)


def _values_at(
    values: pd.api.extensions.ExtensionArray, rows: np.ndarray
) -> pd.api.extensions.ExtensionArray | np.ndarray:
    """``column_at`` of a column's array."""
    if isinstance(values, pd.arrays.NumpyExtensionArray):
        return values.to_numpy()[rows]
    return values.take(rows)


#: ``columns_at`` takes fewer rows column by column (the one pass gains nothing there)
_AT_ONCE_MIN_ROWS = 1 << 13
#: the masked (nullable) arrays ``columns_at`` takes as their values and mask
_MASKED = (pd.arrays.IntegerArray, pd.arrays.FloatingArray, pd.arrays.BooleanArray)


def columns_at(
    events: pd.DataFrame, columns: Collection[str], rows: np.ndarray
) -> dict[str, pd.api.extensions.ExtensionArray | np.ndarray]:
    """``column_at`` of each of ``columns``, by name: one C pass (``_nesting.take_rows``) takes
    every numpy, categorical (its codes) and nullable (values and mask) column at once,
    reading ``rows`` once a block at a time instead of once per column, where the extension
    is built and there are ``_AT_ONCE_MIN_ROWS`` rows or more; other columns, and all
    otherwise, one by one (the same values and types)."""
    nesting = structure._nesting
    arrays = {name: events[name].array for name in columns}  # (each ``events[name]`` ~10 µs)
    out: dict[str, pd.api.extensions.ExtensionArray | np.ndarray] = {}
    planned: list[tuple[str, pd.api.extensions.ExtensionArray, tuple[np.ndarray, ...]]] = []
    at_once = rows.size >= _AT_ONCE_MIN_ROWS and rows.dtype in (np.int32, np.int64) and rows.flags.c_contiguous
    if nesting is not None and at_once and rows.ndim == 1:
        for name, values in arrays.items():
            parts = _parts(values)
            if parts is not None:
                planned.append((name, values, parts))
    if planned:
        sources = tuple(part for _, _, parts in planned for part in parts)
        taken = tuple(np.empty(rows.size, dtype=part.dtype) for part in sources)
        nesting.take_rows(rows, rows.dtype == np.int64, len(events), sources, taken)
        at = 0
        for name, values, parts in planned:
            got = taken[at : at + len(parts)]
            at += len(parts)
            if isinstance(values, pd.Categorical):
                out[name] = pd.Categorical.from_codes(got[0], dtype=values.dtype, validate=False)
            elif isinstance(values, _MASKED):
                out[name] = type(values)(got[0], got[1])
            else:
                out[name] = got[0]
    for name, values in arrays.items():
        if name not in out:
            out[name] = _values_at(values, rows)
    return {name: out[name] for name in columns}


def _parts(values: pd.api.extensions.ExtensionArray) -> tuple[np.ndarray, ...] | None:
    """The numpy arrays a column's values are kept in, for ``columns_at``: its values, a
    categorical's codes, a nullable array's values and mask; None for any other (Arrow)."""
    if isinstance(values, pd.arrays.NumpyExtensionArray):
        parts: tuple[np.ndarray, ...] = (values.to_numpy(),)
    elif isinstance(values, pd.Categorical):
        parts = (values.codes,)
    elif isinstance(values, _MASKED):
        parts = (values._data, values._mask)
    else:
        return None
    # (values copied as bytes: never Python objects, whose references a copy would not count)
    fits = (
        p.ndim == 1 and p.flags.c_contiguous and p.itemsize in (1, 2, 4, 8) and not p.dtype.hasobject for p in parts
    )
    if all(fits):
        return parts
    return None


def codes_of(column: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """A column of repeated strings as codes (-1: missing) and the values they stand for,
    with NaN, the missing marker of ``to_numpy``, appended (so ``values[codes]`` is
    ``column.to_numpy()``): a categorical's own codes, else factorized. Group, match and
    join on the codes; turn only what is kept into values."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, categories = column.cat.codes.to_numpy(), column.cat.categories
    else:
        codes, categories = pd.factorize(column)
    return codes, np.append(np.asarray(categories, dtype=object), [np.nan])


def among(values: np.ndarray, wanted: Collection[str]) -> np.ndarray:
    """Mask of ``values`` (few: the values of ``codes_of``) that are one of ``wanted``;
    index it by the codes for a mask per row."""
    wanted = frozenset(wanted)
    return np.fromiter((isinstance(v, str) and v in wanted for v in values), dtype=bool, count=len(values))


def names_at(trace: TraceTables, rows: np.ndarray) -> np.ndarray:
    """Event names at ``rows`` (object array), ``None`` where the row is -1."""
    names = trace.events["name"]
    categories = np.append(np.asarray(names.cat.categories, dtype=object), [None])
    return categories[_codes_at(trace, rows)]


def name_text(trace: TraceTables, rows: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """``text(names_at(trace, rows))``, made from the name codes."""
    return text_take(np.asarray(trace.events["name"].cat.categories, dtype=object), _codes_at(trace, rows))


def layer_text(trace: TraceTables, module_rows: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """``text`` of the layer names ``layers_at`` gives, made from the name codes."""
    layer_of, _ = _per_name(trace)
    return text_take(layer_of[:-1], _codes_at(trace, module_rows))


def module_labels(trace: TraceTables) -> dict[str, tuple[str, str]]:
    """``nn.Module: Linear_0`` -> (layer, type) for every module name in the trace.

    The layer is the model path recorded by the capture (``encoder.0``) when the manifest
    has one, else the trace's instance name without the prefix (``Linear_0``); the type is
    the class name. A root named like a path in a capture made before roots were renamed
    (``bert`` for both ``bert = BertForMaskedLM(...)`` and its ``.bert``) is named as
    captures name it now (``layout.root_layer``: ``bert (BertForMaskedLM)``), and so are two
    models' submodules at one path (``fc`` of both ``gen`` and ``disc``: ``gen.fc``, ``disc.fc``).
    """
    known = unique_roots(trace.module_names)
    out = {}
    for name in trace.events["name"].cat.categories.tolist():  # (a list: iterating the Arrow-backed index is slow)
        text = str(name)
        if not text.startswith(MODULE_PREFIX):
            continue
        instance = text[len(MODULE_PREFIX) :]
        entry = module_entry(known, text)
        layer = str(entry.get("path") or instance)
        kind = str(entry.get("type") or _INSTANCE_SUFFIX.sub("", instance))
        out[text] = (layer, kind)
    return out


def module_entry(known: dict[str, dict[str, str]], name: str) -> dict[str, str]:
    """The module map's entry (``unique_roots``) of the trace's ``nn.Module: Linear_0``,
    kept under that name or (older captures) under ``Linear_0``; empty where it has none."""
    entry = known.get(name) or known.get(name.removeprefix(MODULE_PREFIX))
    return entry if isinstance(entry, dict) else {}


def unique_roots(known: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """``known`` as captures name it now: the submodules of roots whose paths clash
    (``layout.clashing_roots``) named by their ``qualname``, and each root entry
    (``qualname`` == ``root``) whose ``path`` is also a submodule's path renamed
    ``layout.root_layer(path, type)``."""
    out = dict(known)
    children = {
        name: e
        for name, e in known.items()
        if isinstance(e, dict) and e.get("root") and e.get("qualname") != e.get("root")
    }
    paths_by_root: dict[str, list[str]] = {}
    for e in children.values():
        paths_by_root.setdefault(str(e["root"]), []).append(str(e.get("path")))
    clashing = layout.clashing_roots(paths_by_root)
    for name, e in children.items():
        if e["root"] in clashing and e.get("qualname"):
            out[name] = {**e, "path": str(e["qualname"])}
    entries = [e for e in out.values() if isinstance(e, dict)]
    child_paths = {e.get("path") for e in entries if e.get("qualname") != e.get("root")}
    for name, e in known.items():
        if not isinstance(e, dict) or not e.get("root") or e.get("qualname") != e.get("root"):
            continue
        if e.get("path") == e["root"] and e["root"] in child_paths:
            out[name] = {**e, "path": layout.root_layer(str(e["root"]), str(e.get("type") or e["root"]))}
    return out


def _per_name(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """Layer and type for every category of the ``name`` column (None for non-modules),
    computed once per trace."""

    def compute() -> tuple[np.ndarray, np.ndarray]:
        labels = module_labels(trace)
        # as a list first: iterating an Arrow-backed index is ~8x slower
        categories = trace.events["name"].cat.categories.tolist()
        layer_of = np.array([labels.get(str(c), (None, None))[0] for c in categories] + [None], dtype=object)
        type_of = np.array([labels.get(str(c), (None, None))[1] for c in categories] + [None], dtype=object)
        return layer_of, type_of

    return trace.shared(Shared.LAYER_PER_NAME, compute)


def _codes_at(trace: TraceTables, rows: np.ndarray) -> np.ndarray:
    codes = trace.events["name"].array.codes  # (``.cat.codes`` copies them)
    return take_codes(codes, rows)


def take_codes(codes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``codes`` (a categorical's codes, or row numbers) at ``rows``, -1 where a row is -1:
    one C pass (``_nesting.take_codes``) where the extension is built, else numpy's take."""
    nesting = structure._nesting
    fits = codes.dtype.kind == "i" and codes.flags.c_contiguous and rows.flags.c_contiguous
    if nesting is not None and fits and rows.dtype in (np.int32, np.int64) and rows.ndim == 1:
        out = np.empty(rows.size, dtype=codes.dtype)
        nesting.take_codes(codes, codes.itemsize, rows, rows.dtype == np.int64, out)
        return out
    out = np.take(codes, rows)  # (``take``: indexing by int64 rows converts the small codes first)
    out[rows < 0] = -1
    return out


def layer_codes(trace: TraceTables, module_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer names of ``layers_at`` as codes (-1 for none) into the names they stand
    for: group and count layers without a string per row."""
    layer_of, _ = _per_name(trace)
    codes, names = trace.shared(Shared.LAYER_CODES, lambda: pd.factorize(layer_of))  # None: -1
    return codes[_codes_at(trace, module_rows)], np.asarray(names, dtype=object)


def layers_at(trace: TraceTables, module_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer name and type of the ``nn.Module`` event at each row (``None`` for -1)."""
    layer_of, type_of = _per_name(trace)
    at = _codes_at(trace, module_rows)
    return layer_of[at], type_of[at]


def _categorical(per_code: np.ndarray, at: np.ndarray) -> pd.Categorical:
    """``per_code[at]`` as a categorical, built from codes (no per-row string work)."""
    present = np.array([v is not None for v in per_code])
    categories, index = np.unique(per_code[present].astype(str), return_inverse=True)
    recode = np.full(per_code.size, -1, dtype=np.int64)
    recode[np.flatnonzero(present)] = index
    return without_unused(pd.Categorical.from_codes(recode[at], categories=categories))


def layer_labels(trace: TraceTables, module_rows: np.ndarray) -> tuple[pd.Categorical, pd.Categorical]:
    """``layers_at`` as categoricals, for per-event tables of millions of rows."""
    layer_of, type_of = _per_name(trace)
    at = _codes_at(trace, module_rows)
    nesting = structure._nesting
    if nesting is not None and at.flags.c_contiguous:  # marked in C, on the small codes as they are
        marks = np.zeros(layer_of.size, dtype=np.uint8)  # the names present (-1: the None at the end)
        if nesting.recode(at, at.itemsize, marks, bytearray(), 0):
            used = marks.view(bool)
            return _used_categorical(layer_of, at, used), _used_categorical(type_of, at, used)
    # (as indices once, for the mark and both takes: each converts small codes otherwise)
    at = at.astype(np.intp)
    used = np.zeros(layer_of.size, dtype=bool)  # the names present (-1: the None at the end)
    used[at] = True
    return _used_categorical(layer_of, at, used), _used_categorical(type_of, at, used)


def name_labels(trace: TraceTables, rows: np.ndarray) -> pd.Categorical:
    """Event names at ``rows`` as a categorical (missing where the row is -1)."""
    names = trace.events["name"].array
    return without_unused(pd.Categorical.from_codes(_codes_at(trace, rows), dtype=names.dtype))


def kinds_at(events: pd.DataFrame, rows: np.ndarray, kinds: tuple[str, ...]) -> pd.Categorical:
    """The ``kind`` of ``rows`` as a categorical of ``kinds`` (others missing), made from the
    codes: ``set_categories(list(kinds))`` of the rows' values, which recodes them through a
    hash table."""
    column = cast(pd.Categorical, events["kind"].array)
    lookup = [kinds.index(k) if k in kinds else -1 for k in column.categories.tolist()]
    codes = _kind_codes_at(column.codes, lookup, rows)
    dtype = _kinds_dtype(kinds, column.ordered, pandas_dtype(str))
    return pd.Categorical.from_codes(codes, dtype=dtype, validate=False)


@functools.cache
def _kinds_dtype(kinds: tuple[str, ...], ordered: bool, text: Any) -> pd.CategoricalDtype:
    """``CategoricalDtype(list(kinds), ordered)`` with categories of the ``text`` dtype
    (``pandas_dtype(str)``: pandas' string dtype, or object where ``future.infer_string``
    is off), made once per dtype (its checks cost ~0.1 ms a call)."""
    return pd.CategoricalDtype(pd.Index(list(kinds), dtype=text), ordered=ordered)


def _kind_codes_at(codes: np.ndarray, lookup: list[int], rows: np.ndarray) -> np.ndarray:
    """``lookup`` (per category, then -1 for a missing kind) at the ``codes`` of ``rows``, as
    int8: taken and mapped in two C passes where the extension is built, else numpy's takes."""
    nesting = structure._nesting
    fits = codes.flags.c_contiguous and rows.dtype in (np.int32, np.int64) and rows.flags.c_contiguous
    if nesting is not None and fits:
        taken = np.empty(rows.size, dtype=codes.dtype)
        nesting.take_rows(rows, rows.dtype == np.int64, codes.size, (codes,), (taken,))
        out = np.empty(rows.size, dtype=np.int8)
        if nesting.recode(taken, taken.itemsize, np.array([*lookup, -1], dtype=np.int64), out, 1):
            return out
    return np.take(np.array([*lookup, -1], dtype=np.int8), np.take(codes, rows))  # -1 (missing): the last


def without_unused(values: pd.Categorical) -> pd.Categorical:
    """``values.remove_unused_categories()`` by counting codes instead of sorting them: the
    codes marked and mapped in two C passes (``_nesting.recode``) where the extension is
    built, else numpy's (the same codes)."""
    codes = values.codes
    if not codes.size and len(values.categories):  # none used (an empty table): no category kept
        return pd.Categorical.from_codes(codes.astype(np.int8), dtype=_none_of(values.categories.dtype), validate=False)
    nesting = structure._nesting
    if nesting is not None and codes.flags.c_contiguous:  # the mark and the mapping in C, on the codes as they are
        marks = np.zeros(len(values.categories) + 1, dtype=np.uint8)  # the last entry: -1 (missing)
        nesting.recode(codes, codes.itemsize, marks, bytearray(), 0)
        used = marks[:-1].view(bool)
        if used.all():
            return values
        kept = int(used.sum())
        table = np.full(used.size + 1, -1, dtype=np.int64)  # the last entry maps -1 (missing)
        table[np.flatnonzero(used)] = np.arange(kept)
        new = np.empty(codes.size, dtype=code_dtype(kept))  # in the width pandas keeps them in
        nesting.recode(codes, codes.itemsize, table, new, new.itemsize)
        return pd.Categorical.from_codes(new, categories=values.categories[used], validate=False)
    # the small codes as indices converted once, for the mark and the take (each converts them
    # otherwise: a fresh table-long array each, faulted in)
    at = codes.astype(np.intp)
    used = np.zeros(len(values.categories) + 1, dtype=bool)  # the last entry: -1 (missing)
    used[at] = True
    used = used[:-1]
    if used.all():
        return values
    kept = int(used.sum())
    # the new codes made in the width pandas keeps them in (no int64 copy cast down after)
    remap = np.full(used.size + 1, -1, dtype=code_dtype(kept))  # the last entry maps -1 (missing)
    remap[np.flatnonzero(used)] = np.arange(kept)
    return pd.Categorical.from_codes(np.take(remap, at), categories=values.categories[used], validate=False)


def labels(values: pd.Series | pd.api.extensions.ExtensionArray | np.ndarray) -> pd.Categorical:
    """A column of repeated strings (or its array) as a categorical without unused categories."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        return without_unused(values.array if isinstance(values, pd.Series) else values)
    return pd.Categorical(np.asarray(values, dtype=object))


def union_length(group: np.ndarray, start: np.ndarray, end: np.ndarray, groups: int) -> np.ndarray:
    """Length of the union of intervals ``[start, end)`` per group id (0..groups-1).

    Sort by (group, start); each interval adds what extends past the running maximum end
    of the earlier intervals of its group. Vectorized, O(n log n); rows in that order
    already (``in_windows`` gives them so) in one C pass (``_nesting.union_rows``) where the
    extension is built, else numpy (the same sums, added in the same order).
    """
    nesting = structure._nesting
    if (
        nesting is not None
        and group.dtype in (np.int32, np.int64)
        and all(a.dtype == np.float64 for a in (start, end))
        and all(a.flags.c_contiguous for a in (group, start, end))
    ):
        out = np.empty(groups)
        if nesting.union_rows(group, group.dtype == np.int64, start, end, out):
            return out
    keep = end > start
    if not keep.all():  # (a copy only where some interval is empty: these arrays are per row)
        group, start, end = group[keep], start[keep], end[keep]
    del keep
    if group.size == 0:
        return np.zeros(groups)
    if not in_order(group, start):  # (in_windows gives each category's parts in order already)
        order = sort_by_thread(group, start)
        group, start, end = group[order], start[order], end[order]
        del order
    # running maximum per group in one pass: each group is lifted above all earlier ones,
    # and the row holding each maximum gives its exact value back
    lifted = group * (float(end.max() - min(start.min(), 0.0)) + 1.0)
    lifted += end
    top = np.maximum.accumulate(lifted)
    at = np.arange(end.size)
    at[lifted != top] = 0
    del lifted, top
    reach = end[np.maximum.accumulate(at, out=at)]
    del at
    previous = np.empty_like(reach)
    previous[0] = -np.inf
    previous[1:] = reach[:-1]
    previous[1:][group[1:] != group[:-1]] = -np.inf
    del reach
    added = np.maximum(start, previous, out=previous)  # in place: these arrays are per row
    np.subtract(end, added, out=added)
    np.maximum(added, 0.0, out=added)
    return np.bincount(group, weights=added, minlength=groups)


def text(values: pd.Series | np.ndarray) -> pd.api.extensions.ExtensionArray:
    """Values as pandas' string dtype, missing ones (None, NaN) as NA: one text type everywhere.

    Made in the C library's heap, as ``text_take`` (Arrow's default pool, mimalloc, takes a
    new 2 MiB huge page when its pages are full, and never gives it back); values that are
    not text (numbers) are converted by pandas, in its pool."""
    objects = np.asarray(values, dtype=object)
    try:
        arrow = pa.array(objects, type=pa.large_string(), from_pandas=True, memory_pool=pa.system_memory_pool())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pd.array(objects, dtype="str")
    return pd.array(arrow, dtype="str")


def text_take(labels: np.ndarray, at: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """``text(labels[at])`` for per-row tables: ``labels`` are few (per code, None for none),
    ``at`` indexes them (-1: missing), so no string is made per row (Arrow's take).

    Made in the C library's heap (``pa.system_memory_pool``), not Arrow's default pool:
    mimalloc's arena is backed by 2 MiB huge pages, so the few MB of a per-row column
    (``memory()``: 61k rows, 3.6 MB) held ~16 MiB resident there, never given back; the
    heap reuses what the analyses freed."""
    pool = pa.system_memory_pool()
    taken = pc.take(
        pa.array(labels, type=pa.large_string(), memory_pool=pool),
        pa.array(at, mask=at < 0, memory_pool=pool),
        memory_pool=pool,
    )
    return pd.array(taken, dtype="str")


def group_rows(*columns: np.ndarray | pd.Series | pd.Categorical) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by equal values in all ``columns``, as ``pd.factorize`` of the row tuples
    and ``groupby(columns, sort=False, dropna=False, observed=True)`` group them: each row's
    group (int64), numbered in order of first appearance, and the first row of each group.

    Column by column, never building a tuple per row: a categorical's codes are used as they
    are (missing: one more code), any other column is factorized (a missing value is one
    value); the codes are combined as the digits of one int64 key, renumbered only where the
    next digit could overflow. Group a table on the result with pandas' own aggregations:
    one int key is a cheap grouper (five categorical keys cost more than the sums), and
    the sums keep pandas' order within each group."""
    size = len(columns[0]) if columns else 0
    key = np.zeros(size, dtype=np.int64)
    span = 1  # every key value is below it
    for column in columns:
        values = column.array if isinstance(column, pd.Series) else column
        if isinstance(values, pd.Categorical):
            codes = values.codes.astype(np.int64) + 1  # -1, missing, becomes 0
            base = len(values.categories) + 1
        elif _one_value(values):
            continue  # one value (one rank, say): every row the same digit, which changes no group
        else:
            codes, uniques = pd.factorize(values, use_na_sentinel=False)
            codes, base = codes.astype(np.int64, copy=False), max(len(uniques), 1)
        if span > _INT64_MAX // base:
            key, span = _factorized(key)
            if span > _INT64_MAX // base:  # more categories than rows
                codes, base = _factorized(codes)
        key = key * base + codes  # fits: else both were renumbered below the row count
        span *= base
    group, _ = pd.factorize(key)
    group = group.astype(np.int64, copy=False)
    if not size:
        return group, np.zeros(0, dtype=np.int64)
    # numbered by first appearance: a row starts its group where it exceeds every number before it
    starts = np.empty(size, dtype=bool)
    starts[0] = True
    np.greater(group[1:], np.maximum.accumulate(group)[:-1], out=starts[1:])
    return group, np.flatnonzero(starts)


_INT64_MAX = int(np.iinfo(np.int64).max)


def _one_value(values: object) -> bool:
    """Whether ``values`` is an integer array holding one value (a column ``group_rows``
    can leave out: factorized, it is a digit 0 of base 1)."""
    if not (isinstance(values, np.ndarray) and values.dtype.kind in "iu" and values.size):
        return False
    return bool(values.min() == values.max())


def group_sums(group: np.ndarray, groups: int, **columns: np.ndarray) -> dict[str, np.ndarray]:
    """``pd.DataFrame(columns).groupby(group).sum()``, each column as an array, for groups
    numbered ``0..groups-1`` that all hold a row (``group_rows``' numbering): pandas'
    compensated sums to the bit (they differ from a plain sum in the last bits). One C pass
    per float column (``_nesting.group_sums``) where the extension is built, else (or for
    other columns, or a sum that is not finite) pandas' own."""
    nesting = structure._nesting
    if nesting is not None and group.dtype == np.int64 and group.flags.c_contiguous:
        out: dict[str, np.ndarray] = {}
        for name, values in columns.items():
            sums = np.empty(groups)
            if not (values.dtype == np.float64 and values.flags.c_contiguous and values.size == group.size):
                break
            if not nesting.group_sums(group, values, sums):
                break
            out[name] = sums
        else:
            return out
    frame = pd.DataFrame(columns).groupby(group).sum()
    return {name: frame[name].to_numpy() for name in columns}


def _factorized(values: np.ndarray) -> tuple[np.ndarray, int]:
    """``values`` renumbered 0.. in order of first appearance, and how many distinct."""
    codes, uniques = pd.factorize(values)
    return codes.astype(np.int64, copy=False), max(len(uniques), 1)


#: int64's range, half of it (``row_thread_key`` wraps as numpy's int64 arithmetic does)
_WRAP = 1 << 63


def row_thread_key(events: pd.DataFrame) -> Callable[[int], int]:
    """``structure.thread_keys`` of one row at a time: the key function of a bisection over
    rows sorted by thread (``cpu_by_thread``), which reads a few rows' keys, where making
    every row's key (``thread_keys_of``) costs a pass over the table (tests/test_nesting.py
    checks it against ``thread_keys``)."""
    pid = events["pid"].array.codes  # (``.cat.codes`` copies them)
    tid = events["tid"].array.codes
    rank = events["rank"].to_numpy() if "rank" in events else None  # one rank before stacking

    def key(row: int) -> int:
        # as thread_keys: (pid code + 1) << 21 | (tid code + 1) | rank << 42, wrapped to
        # int64 as numpy wraps it (a rank of 2**21 or more leaves 64 bits)
        value = ((int(pid[row]) + 1) << 21) | (int(tid[row]) + 1)
        if rank is not None:
            value = ((value | (int(rank[row]) << 42)) + _WRAP) % (2 * _WRAP) - _WRAP
        return value

    return key


def in_thread_order(trace: TraceTables, mask: np.ndarray) -> np.ndarray | None:
    """The rows of ``mask`` in ``cpu_by_thread`` order (by thread, start, longest first, then
    row), read off the order the trace keeps instead of sorted again; None where some row
    of the mask is no CPU duration event (not in that order)."""
    ordered = thread_order(trace)
    picked = mask[ordered]
    if np.count_nonzero(picked) != np.count_nonzero(mask):
        return None
    return ordered[picked]


def in_order(group: np.ndarray, start: np.ndarray) -> bool:
    """Whether the rows are sorted by (``group``, ``start``) already, with no NaN start:
    then a stable sort by them (``sort_by_thread``, ``sort_values``) leaves every row where
    it is."""
    if group.size < 2:
        return True
    if not (group[1:] >= group[:-1]).all():
        return False
    back = group[1:] == group[:-1]  # within a group, a start before the one above it
    back &= start[1:] < start[:-1]
    return not back.any() and not np.isnan(start).any()


@functools.cache
def _none_of(categories: object) -> pd.CategoricalDtype:
    """The dtype ``without_unused`` gives a categorical none of whose categories (of dtype
    ``categories``) is used, made once: a dtype's checks cost ~0.1 ms each."""
    return pd.CategoricalDtype(pd.Index([], dtype=categories))


@functools.cache
def _no_categories(named: bool, text: Any) -> pd.CategoricalDtype:
    """The dtype of a categorical with no category (categories of the ``text`` dtype,
    ``pandas_dtype(str)``, where ``named``, else object, as ``_categorical`` makes them),
    made once per dtype: a dtype's checks cost ~0.1 ms each."""
    return pd.CategoricalDtype(pd.Index([], dtype=text if named else object))


def _used_categorical(per_code: np.ndarray, at: np.ndarray, used: np.ndarray) -> pd.Categorical:
    """``_categorical(per_code, at)`` (unused categories left out) made from the ``used``
    codes alone: only their values are sorted, and no code is remapped twice."""
    present = np.array([v is not None for v in per_code], dtype=bool)
    keep = used & present
    if not keep.any():  # no category: ``_categorical``'s answer (its categories are str where any name
        # is present, else object), made without its sorts and remaps: all missing
        return pd.Categorical.from_codes(
            np.full(at.size, -1, dtype=np.int8),
            dtype=_no_categories(bool(present.any()), pandas_dtype(str)),
            validate=False,
        )
    categories, index = np.unique(per_code[keep].astype(str), return_inverse=True)
    dtype = code_dtype(len(categories))
    nesting = structure._nesting
    if nesting is not None and at.flags.c_contiguous:  # the codes mapped in C, read in their own width
        table = np.full(per_code.size, -1, dtype=np.int64)
        table[np.flatnonzero(keep)] = index
        codes = np.empty(at.size, dtype=dtype)
        if nesting.recode(at, at.itemsize, table, codes, codes.itemsize):
            return pd.Categorical.from_codes(codes, categories=categories, validate=False)
    recode = np.full(per_code.size, -1, dtype=dtype)
    recode[np.flatnonzero(keep)] = index
    return pd.Categorical.from_codes(np.take(recode, at), categories=categories, validate=False)
