"""``layers()``: time, GPU time and memory growth per ``nn.Module`` instance, forward and backward.

A layer is one ``nn.Module`` instance: the ``nn.Module: <Class>_<k>`` python_function
events of a ``with_stack`` trace. Forward time is the module events' own time; backward
time is that of the outermost autograd ops (``autograd::engine::evaluate_function: ...``)
whose forward op ran inside the layer: the op at the start of the ``fwdbwd`` flow that ends
at the backward op, or, for traces without those flows, the op with the same autograd
sequence number. Each stretch of host
time goes to at most one layer, so self times plus the unattributed rest add up to the
step time.

Compiled code (``torch.compile``) is one layer: the ``OptimizedModule`` of
``cm = torch.compile(m)`` and the model it runs are one module (the capture names both
``cm``), and module events inside a ``Torch-Compiled Region`` (the ``GraphModule`` of the
eager backends) belong to the layer running the region. Submodules are inlined into the
compiled graph, so their time is not available inside compiled regions: it is the compiled
module's own time, forward (the region's ops and kernels) and backward
(``CompiledFunctionBackward``).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    activity_rows,
    group_rows,
    in_thread_order,
    layers_at,
    memory_holders,
    names_at,
    names_where,
    nesting_depth,
    rollup,
    row_thread_key,
    text,
    thread_keys_of,
    thread_order,
)
from tracemagic.analysis.attribution import Attribution, attribution
from tracemagic.analysis.efficiency import gpu_shares
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.kineto import CPU_KINDS, GPU_KINDS
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.structure import NEST_TOLERANCE_US, sort_by_thread, thread_keys

#: ``Input Dims`` text with at least one tensor of one or more dimensions
TENSOR_DIMS = re.compile(r"\[\d")
COLUMNS = tuple(TABLES["layers"].names)


def step_time(trace: TraceTables, step: int | None = None) -> dict[int, float]:
    """Per rank: the summed ProfilerStep durations (only step ``step``'s if given), else the
    span of its CPU and GPU events."""
    events = trace.events
    rank = events["rank"].to_numpy()
    is_step = kind_mask(events, "step")
    if step is not None:
        is_step &= events["step"].to_numpy() == step
    step_rows = np.flatnonzero(is_step)
    names = events["name"].array.codes
    dur = events["dur"].to_numpy()
    is_timed = None
    out = {}
    for r in trace.rank_ids:
        mine = step_rows[rank[step_rows] == r]
        if mine.size:  # the first step of each name (a step recorded twice counts once), in row order
            _, first = np.unique(names[mine], return_index=True)
            out[r] = float(pd.Series(dur[mine[np.sort(first)]]).sum())
            continue
        if is_timed is None:
            is_timed = kind_mask(events, *CPU_KINDS + GPU_KINDS) & (events["ph"] == "X").to_numpy()
        timed = (rank == r) & is_timed
        ts = events["ts"].to_numpy()[timed]
        end = ts + dur[timed]
        out[r] = float(end.max() - ts.min()) if ts.size else 0.0
    return out


@dataclass(frozen=True)
class _Modules:
    """The module events of the layers (``Attribution.is_module``), numbered 0.. in row
    order: the sums up the module nesting run over these few rows, not the whole table.

    Attributes:
        rows: their rows.
        up: per module event, the number of its enclosing module event, -1 at the top.
        layer: per module event, its layer (-1 for one inside a backward op).
        count: how many layers.
    """

    rows: np.ndarray
    up: np.ndarray
    layer: np.ndarray
    count: int


def _numbered(rows: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The position in ``rows`` (ascending) of each of ``wanted``, -1 where it is not there
    (as for -1, no row)."""
    if not rows.size:
        return np.full(np.size(wanted), -1, dtype=np.int64)
    pos = np.searchsorted(rows, wanted)
    np.minimum(pos, rows.size - 1, out=pos)
    return np.where(rows[pos] == wanted, pos, -1)


def _rollup(start: np.ndarray, weights: np.ndarray, modules: _Modules) -> tuple[np.ndarray, np.ndarray]:
    """Self and inclusive sums per layer of weights placed at module event rows ``start``
    (-1: nowhere); inclusive sums walk the module nesting upwards."""
    at = _numbered(modules.rows, start)
    ok = at >= 0
    own = np.bincount(modules.layer[at[ok]], weights=np.asarray(weights, dtype=np.float64)[ok], minlength=modules.count)
    inclusive = rollup(at, weights, modules.up)
    rows = np.flatnonzero(modules.layer >= 0)
    return own, np.bincount(modules.layer[rows], weights=inclusive[rows], minlength=modules.count)


#: ``_first_op_dims`` walks the thread order from each call where there are at most this
#: many (a model's layers: a few dozen), rather than finding every op with tensor inputs
_FEW_CALLS = 64


def _first_op_dims(trace: TraceTables, calls: np.ndarray) -> np.ndarray:
    """Input dims (text, None if none) of the first cpu_op with a tensor input inside each
    module call row: the first such op of the call's thread (in its thread order: by start,
    longest first) starting no earlier than ``NEST_TOLERANCE_US`` before the call and no
    later than its end."""
    events = trace.events
    categories = np.append(np.asarray(events["input_dims"].cat.categories, dtype=object), [None])
    walked = _walked_first_ops(trace, calls) if 0 < calls.size <= _FEW_CALLS else None
    if walked is not None:
        return categories[walked]
    out = np.full(calls.size, -1, dtype=np.int64)
    is_op = kind_mask(events, "cpu_op")
    is_op &= names_where(events["input_dims"], TENSOR_DIMS)
    if calls.size == 0 or not is_op.any():
        return categories[out]
    ts = events["ts"].to_numpy()
    dur = events["dur"].to_numpy()
    dims = events["input_dims"].array.codes
    ops = in_thread_order(trace, is_op)  # by thread, start, longest first: the order the trace keeps
    # (gathered from the trace's keys, which its thread order was made with: one take, not three)
    op_keys = np.take(thread_keys_of(trace), ops) if ops is not None else np.zeros(0, dtype=np.int64)
    if ops is None or (op_keys[1:] < op_keys[:-1]).any():  # (none kept, or threads out of key order: sorted here)
        ops = np.flatnonzero(is_op)
        op_keys = thread_keys(events, ops)
        order = sort_by_thread(op_keys, ts[ops], -dur[ops])
        ops, op_keys = ops[order], op_keys[order]
    del is_op
    keys = thread_keys(events, calls)
    for key in np.unique(keys):  # one pass per thread
        lo, hi = np.searchsorted(op_keys, [key, key + 1])
        where = np.flatnonzero(keys == key)
        if lo == hi:
            continue
        mine = ops[lo:hi]
        pos = np.searchsorted(ts[mine], ts[calls[where]] - NEST_TOLERANCE_US, side="left")
        ok = pos < mine.size
        first = mine[np.minimum(pos, mine.size - 1)]
        ok &= ts[first] <= ts[calls[where]] + dur[calls[where]]
        out[where[ok]] = dims[first[ok]]
    return categories[out]


def _walked_first_ops(trace: TraceTables, calls: np.ndarray) -> np.ndarray | None:
    """``_first_op_dims``' input dims codes (-1: none) for a few calls, from the thread order
    the trace keeps (``_common.in_thread_order``'s): per call, a bisection of its thread's
    rows for the call's start, then the rows after it read in growing chunks up to the
    first op with a tensor input or the call's end; none of the table-long masks and
    searches the many-calls path makes (the same rows: that path's ops are a subsequence of
    this order). None where some cpu_op is not a duration event (not in that order)."""
    events = trace.events
    kinds, dims = events["kind"].array, events["input_dims"].array
    ph = events["ph"].array
    if not all(isinstance(a, pd.Categorical) for a in (kinds, dims, ph)):
        return None
    # (the categories as lists: comparing an Arrow-backed index goes through pandas)
    op_kind = np.array([c == "cpu_op" for c in kinds.categories.tolist()] + [False])  # (the last: -1, missing)
    phases = ph.categories.tolist()
    if "X" not in phases:
        return None
    # (a cpu_op instant is in no thread order: the many-calls path sorts such rows itself)
    is_x = phases.index("X")
    if any(((kinds.codes == code) & (ph.codes != is_x)).any() for code in np.flatnonzero(op_kind[:-1]).tolist()):
        return None
    tensor = np.fromiter((bool(TENSOR_DIMS.search(str(c))) for c in dims.categories.tolist()), dtype=bool)
    tensor = np.append(tensor, False)  # (the last: -1, no dims)
    order = thread_order(trace)
    if not order.size:  # no CPU duration event: no op inside any call
        return np.full(calls.size, -1, dtype=np.int64)
    ts, dur = events["ts"].to_numpy(), events["dur"].to_numpy()
    kind_codes, dims_codes = kinds.codes, dims.codes
    key_of = row_thread_key(events)
    out = np.full(calls.size, -1, dtype=np.int64)
    threads: dict[int, tuple[int, int]] = {}  # thread key -> its rows' bounds in ``order``
    at = np.zeros(calls.size, dtype=np.int64)  # per call: where its walk starts, ends, and its end time
    hi = np.zeros(calls.size, dtype=np.int64)
    end = np.full(calls.size, -np.inf)
    for i, call in enumerate(calls.tolist()):
        start, stop = float(ts[call]) - NEST_TOLERANCE_US, float(ts[call] + dur[call])
        if start != start or stop != stop:  # (NaN: the search finds no op that starts by the end)
            continue  # (an empty walk: at == hi)
        key = key_of(call)
        if key not in threads:
            first = bisect.bisect_left(order, key, key=key_of)
            threads[key] = (first, bisect.bisect_left(order, key + 1, first, key=key_of))
        lo, hi[i] = threads[key]
        at[i] = bisect.bisect_left(order, start, lo, hi[i], key=lambda row: ts[row])  # (NaN starts last, as numpy's)
        end[i] = stop
    step = 16  # the first rows of every walk at once (the first op with a tensor input is near), then each alone
    pos = at[:, None] + np.arange(step)
    rows = np.take(order, np.minimum(pos, order.size - 1))
    # started past the call's end (or NaN), or past the thread's rows: no op after it is inside
    ended = (pos >= hi[:, None]) | ~(np.take(ts, rows) <= end[:, None])
    hit = np.take(op_kind, np.take(kind_codes, rows)) & np.take(tensor, np.take(dims_codes, rows)) & ~ended
    # (``ended`` holds from a walk's first such row on: the rows of a thread are in start order)
    found = hit.any(axis=1)
    first = np.argmax(hit, axis=1)
    out[found] = np.take(dims_codes, rows[found, first[found]])
    live = np.flatnonzero(~found & ~ended.any(axis=1))  # neither found nor ended in those rows: walked on
    if live.size:
        out[live] = _walked_on(
            order, ts, kind_codes, dims_codes, op_kind, tensor, at[live] + step, hi[live], end[live], step * 4
        )
    return out


def _walked_on(
    order: np.ndarray,
    ts: np.ndarray,
    kind_codes: np.ndarray,
    dims_codes: np.ndarray,
    op_kind: np.ndarray,
    tensor: np.ndarray,
    at: np.ndarray,
    hi: np.ndarray,
    end: np.ndarray,
    step: int,
) -> np.ndarray:
    """``_walked_first_ops``' walks that went on past their first rows, each alone, in
    chunks growing fourfold: the dims code of the first op with a tensor input, -1."""
    out = np.full(at.size, -1, dtype=np.int64)
    for i in range(at.size):
        where, size = int(at[i]), step
        while where < hi[i]:
            chunk = order[where : min(where + size, int(hi[i]))]
            ended = ~(np.take(ts, chunk) <= end[i])
            hit = np.take(op_kind, np.take(kind_codes, chunk)) & np.take(tensor, np.take(dims_codes, chunk))
            stop = int(np.argmax(ended)) if ended.any() else chunk.size
            found = np.flatnonzero(hit[:stop])
            if found.size:
                out[i] = dims_codes[chunk[found[0]]]
                break
            if stop < chunk.size:
                break
            where += chunk.size
            size *= 4
    return out


def memory_growth(
    trace: TraceTables, att: Attribution, in_scope: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Module event row enclosing each in-scope forward ``[memory]`` event, and its delta
    (``in_scope``: per events row, default ``att.in_scope``)."""
    events = trace.events
    rows, holder = memory_holders(trace)
    scope = (att.in_scope if in_scope is None else in_scope)[rows]
    rows, holder = rows[scope], holder[scope]
    ok = holder >= 0
    rows, holder = rows[ok], holder[ok]
    fwd = ~att.backward[holder]
    grown = events["bytes"].array[rows[fwd]]  # (converted at these rows alone)
    return att.module[holder[fwd]], np.asarray(grown.to_numpy(dtype=np.float64, na_value=0.0))


@computes("layers")
def layers(trace: TraceTables, step: int | None = None) -> pd.DataFrame:
    """One row per layer (``nn.Module`` instance) per rank, in order of first call; with
    ``step``, only the work of that ProfilerStep counts (and only layers used in it).

    Columns: ``rank``; ``layer`` (model path from the capture, else ``Linear_0``); ``type``;
    ``depth`` (0 for a top-level module) and ``parent`` (enclosing layer, None at the top),
    from the first call; ``calls``; ``fwd_cpu_us`` (summed module event durations) and
    ``fwd_self_cpu_us`` (minus child module events); ``bwd_self_cpu_us`` (outermost backward
    ops whose forward op ran directly in this layer) and ``bwd_cpu_us`` (with its
    sublayers'); ``cpu_us`` = fwd + bwd and ``self_cpu_us`` = fwd self + bwd self;
    ``self_gpu_us`` (kernels, memcpy, memset launched directly from the layer, forward or
    backward), ``gpu_us`` (with sublayers'), ``fwd_gpu_us``, ``bwd_gpu_us`` (inclusive);
    ``tflops_per_s`` (the FLOPs ``efficiency()``'s cost models know for the ops run in the
    layer and its sublayers, forward and backward, over its ``gpu_us``: a lower bound where
    some of its ops are not modelled; NaN where none is); ``memory_bound_pct`` (the share of
    ``gpu_us`` in ops ``efficiency()`` finds memory-bound on the trace's device, %; NaN
    where none of its ops has a known bound, e.g. on a device without known peaks);
    ``memory_growth_bytes`` (summed allocation deltas inside the forward calls, all devices);
    ``input_shapes`` (input dims of the first op of the first call); ``module`` (the trace's
    ``nn.Module: X_k`` name). Only work inside ProfilerSteps counts when the trace has them.

    ``df.attrs``: ``step_us`` {rank: summed step durations (the trace span without steps)},
    ``unattributed_us`` {rank: host time in no layer}, ``overlap_us`` {rank: attributed time
    beyond the step time, from threads running at once; 0 normally}, so that per rank
    ``sum(self_cpu_us) + unattributed_us - overlap_us == step_us``; ``gpu_us`` and
    ``gpu_unattributed_us`` {rank: ...} likewise for GPU time; ``compiled_regions`` {rank:
    ``Torch-Compiled Region`` calls counted} and ``compiled_layers`` {rank: [layers running
    them]}: ``torch.compile``'d code, whose submodules have no time of their own.
    """
    events = trace.events
    att = attribution(trace)
    scope = att.in_scope if step is None else att.in_scope & (events["step"].to_numpy() == step)
    rank = events["rank"].to_numpy()
    dur = events["dur"].to_numpy()
    ts = events["ts"].to_numpy()
    held = np.flatnonzero(att.is_module)
    forward = att.root[held] < 0  # (a module event inside a backward op is no call of its layer)
    modules = held[forward]
    layer_id, first_of = group_rows(rank[modules], events["name"].array.codes[modules])
    count = len(first_of)
    layer_of = np.full(held.size, -1, dtype=np.int64)
    layer_of[forward] = layer_id
    space = _Modules(held, _numbered(held, att.module_parent[held]), layer_of, count)
    calls_at = np.flatnonzero(forward & scope[held])
    calls_rows = held[calls_at]
    call_layer = layer_of[calls_at]
    calls = np.bincount(call_layer, minlength=count)
    fwd_cpu = np.bincount(call_layer, weights=dur[calls_rows], minlength=count)
    children = calls_at[space.up[calls_at] >= 0]
    child_time = np.bincount(space.up[children], weights=dur[held[children]], minlength=held.size)
    fwd_self = np.bincount(call_layer, weights=dur[calls_rows] - child_time[calls_at], minlength=count)
    inside = np.flatnonzero(att.backward)
    roots = inside[att.root[inside] == inside]
    del inside
    roots = roots[scope[roots]]
    bwd_self, bwd_cpu = _rollup(att.module[roots], dur[roots], space)
    launch = events["launch"].to_numpy()
    gpu_all = activity_rows(trace)
    gpu_all = gpu_all[scope[gpu_all]]
    gpu = gpu_all[launch[gpu_all] >= 0]
    gpu_layer = att.module[launch[gpu]]
    gpu_bwd = att.backward[launch[gpu]]
    fwd_gpu_self, fwd_gpu = _rollup(np.where(gpu_bwd, -1, gpu_layer), dur[gpu], space)
    bwd_gpu_self, bwd_gpu = _rollup(np.where(gpu_bwd, gpu_layer, -1), dur[gpu], space)
    _, growth = _rollup(*memory_growth(trace, att, scope), space)
    regions = att.compiled[scope[att.compiled]]
    region_at = _numbered(held, att.module[regions])
    region_layer = layer_of[region_at[region_at >= 0]]  # (-1: a module event inside a backward op)
    compiled = np.bincount(region_layer[region_layer >= 0], minlength=count) > 0
    if (gpu_layer >= 0).any():  # the roofline only where a layer launched GPU work: a CPU trace never needs it
        flops_of, memory_bound, has_bound = gpu_shares(trace)
        _, flops = _rollup(gpu_layer, flops_of[gpu], space)
        _, memory_us = _rollup(gpu_layer, np.where(memory_bound[gpu], dur[gpu], 0.0), space)
        _, modelled = _rollup(gpu_layer, (flops_of[gpu] > 0).astype(np.float64), space)
        _, bounded = _rollup(gpu_layer, has_bound[gpu].astype(np.float64), space)
    else:  # no layer to share them out to: no FLOPs, no bound (NaN below)
        flops = memory_us = modelled = bounded = np.zeros(count)
    gpu_us = fwd_gpu + bwd_gpu
    with np.errstate(divide="ignore", invalid="ignore"):
        tflops = np.where((modelled > 0) & (gpu_us > 0), flops / (gpu_us * 1e6), np.nan)
        # NaN where no op of the layer has a known bound (an unknown device: not 0% memory-bound)
        memory_pct = np.where((bounded > 0) & (gpu_us > 0), memory_us / gpu_us * 100.0, np.nan)

    # each layer's first call in scope (the earliest; of calls starting together the first
    # row), else its first module event
    first_row = modules[first_of]
    if calls_rows.size:
        by_layer = np.lexsort((ts[calls_rows], call_layer))
        ordered = call_layer[by_layer]
        head = np.flatnonzero(np.append(True, ordered[1:] != ordered[:-1]))
        first_row[ordered[head]] = calls_rows[by_layer[head]]
    used = np.flatnonzero((calls > 0) | (bwd_cpu > 0) | (bwd_gpu > 0))
    layer_rank = rank[first_row].astype(np.int32)
    used = used[np.lexsort((ts[first_row[used]], layer_rank[used]))]  # by rank, then first call
    first_row = first_row[used]
    depth = nesting_depth(att.module_parent, first_row)
    name, kind = layers_at(trace, first_row)
    parent_name, _ = layers_at(trace, att.module_parent[first_row])
    table = pd.DataFrame(
        {
            "rank": layer_rank[used],
            "layer": text(name),
            "type": text(kind),
            "depth": depth,
            "parent": text(parent_name),
            "calls": calls[used],
            "cpu_us": (fwd_cpu + bwd_cpu)[used],
            "self_cpu_us": (fwd_self + bwd_self)[used],
            "fwd_cpu_us": fwd_cpu[used],
            "fwd_self_cpu_us": fwd_self[used],
            "bwd_cpu_us": bwd_cpu[used],
            "bwd_self_cpu_us": bwd_self[used],
            "gpu_us": gpu_us[used],
            "self_gpu_us": (fwd_gpu_self + bwd_gpu_self)[used],
            "fwd_gpu_us": fwd_gpu[used],
            "bwd_gpu_us": bwd_gpu[used],
            "tflops_per_s": tflops[used],
            "memory_bound_pct": memory_pct[used],
            "memory_growth_bytes": growth.astype(np.int64)[used],
            "input_shapes": text(_first_op_dims(trace, first_row)),
            "module": text(names_at(trace, first_row)),
        },
        columns=list(COLUMNS),
    )
    compiled = compiled[used]
    compiled_layers: dict[int, list[str]] = {r: [] for r in trace.rank_ids}
    if compiled.any():
        layer_text = table["layer"].array
        for r in trace.rank_ids:
            compiled_layers[r] = [str(v) for v in layer_text[(layer_rank[used] == r) & compiled]]
    if table.empty:  # bincount of nothing is int64: give the contract's dtypes
        table = TABLES["layers"].empty()
    _totals(trace, table, gpu_all, dur, step)
    table.attrs["compiled_regions"] = {r: int((rank[regions] == r).sum()) for r in trace.rank_ids}
    table.attrs["compiled_layers"] = compiled_layers
    return table


def _totals(trace: TraceTables, table: pd.DataFrame, gpu: np.ndarray, dur: np.ndarray, step: int | None = None) -> None:
    """Fill ``table.attrs`` with per-rank step time and what no layer got."""
    steps = step_time(trace, step)
    rank = trace.events["rank"].to_numpy()
    table_rank = table["rank"].to_numpy()
    self_cpu = table["self_cpu_us"].to_numpy()
    self_gpu = table["self_gpu_us"].to_numpy()
    attrs: dict[str, dict[int, float]] = {
        k: {} for k in ("step_us", "unattributed_us", "overlap_us", "gpu_us", "gpu_unattributed_us")
    }
    for r in trace.rank_ids:
        mine = table_rank == r
        attributed = float(pd.Series(self_cpu[mine]).sum())
        attrs["step_us"][r] = steps.get(r, 0.0)
        attrs["unattributed_us"][r] = max(steps.get(r, 0.0) - attributed, 0.0)
        attrs["overlap_us"][r] = max(attributed - steps.get(r, 0.0), 0.0)
        gpu_total = float(dur[gpu[rank[gpu] == r]].sum())
        attrs["gpu_us"][r] = gpu_total
        attrs["gpu_unattributed_us"][r] = max(gpu_total - float(pd.Series(self_gpu[mine]).sum()), 0.0)
    table.attrs.update(attrs)
