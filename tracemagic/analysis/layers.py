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

import re

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    layers_at,
    memory_holders,
    names_at,
    names_where,
    nesting_depth,
    rollup,
    text,
    thread_keys_of,
)
from tracemagic.analysis.attribution import Attribution, attribution
from tracemagic.analysis.efficiency import gpu_shares
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.kineto import CPU_KINDS, GPU_ACTIVITY, GPU_KINDS
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.structure import NEST_TOLERANCE_US, sort_by_thread

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
    is_timed = kind_mask(events, *CPU_KINDS + GPU_KINDS) & (events["ph"] == "X").to_numpy()
    out = {}
    for r in trace.rank_ids:
        mine = rank == r
        steps = events.loc[mine & is_step, ["name", "dur"]].drop_duplicates("name")
        if len(steps):
            out[r] = float(steps["dur"].sum())
            continue
        timed = mine & is_timed
        ts = events["ts"].to_numpy()[timed]
        end = ts + events["dur"].to_numpy()[timed]
        out[r] = float(end.max() - ts.min()) if ts.size else 0.0
    return out


def _rollup(
    start: np.ndarray, weights: np.ndarray, layer_of: np.ndarray, up: np.ndarray, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """Self and inclusive sums per layer of weights placed at module event rows ``start``.

    ``up`` is each module event's enclosing module event; inclusive sums walk it upwards.
    """
    ok = start >= 0
    own = np.bincount(layer_of[start[ok]], weights=np.asarray(weights, dtype=np.float64)[ok], minlength=count)
    inclusive = rollup(start, weights, up)
    rows = np.flatnonzero(layer_of >= 0)
    return own, np.bincount(layer_of[rows], weights=inclusive[rows], minlength=count)


def _first_op_dims(trace: TraceTables, calls: np.ndarray) -> np.ndarray:
    """Input dims (text, None if none) of the first cpu_op with a tensor input inside each
    module call row."""
    events = trace.events
    categories = np.append(np.asarray(events["input_dims"].cat.categories, dtype=object), [None])
    out = np.full(calls.size, -1, dtype=np.int64)
    tensor_input = names_where(events["input_dims"], TENSOR_DIMS)
    ops = np.flatnonzero(kind_mask(events, "cpu_op") & tensor_input)
    if ops.size == 0 or calls.size == 0:
        return categories[out]
    keys = thread_keys_of(trace)
    ts = events["ts"].to_numpy()
    dur = events["dur"].to_numpy()
    dims = events["input_dims"].cat.codes.to_numpy()
    ops = ops[sort_by_thread(keys[ops], ts[ops], -dur[ops])]
    op_keys = keys[ops]
    for key in np.unique(keys[calls]):  # one pass per thread
        lo, hi = np.searchsorted(op_keys, [key, key + 1])
        where = np.flatnonzero(keys[calls] == key)
        if lo == hi:
            continue
        mine = ops[lo:hi]
        pos = np.searchsorted(ts[mine], ts[calls[where]] - NEST_TOLERANCE_US, side="left")
        ok = pos < mine.size
        first = mine[np.minimum(pos, mine.size - 1)]
        ok &= ts[first] <= ts[calls[where]] + dur[calls[where]]
        out[where[ok]] = dims[first[ok]]
    return categories[out]


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
    return att.module[holder[fwd]], events["bytes"].to_numpy(dtype=np.float64, na_value=0.0)[rows[fwd]]


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
    modules = np.flatnonzero(att.is_module & (att.root < 0))
    rank = events["rank"].to_numpy()
    dur = events["dur"].to_numpy()
    ts = events["ts"].to_numpy()
    codes = events["name"].cat.codes.to_numpy()
    layer_id, keys = pd.factorize(pd.MultiIndex.from_arrays([rank[modules], codes[modules]]), sort=False)
    count = len(keys)
    layer_of = np.full(len(events), -1, dtype=np.int64)
    layer_of[modules] = layer_id
    calls_rows = modules[scope[modules]]
    calls = np.bincount(layer_of[calls_rows], minlength=count)
    fwd_cpu = np.bincount(layer_of[calls_rows], weights=dur[calls_rows], minlength=count)
    children = calls_rows[att.module_parent[calls_rows] >= 0]
    child_time = np.bincount(att.module_parent[children], weights=dur[children], minlength=len(events))
    fwd_self = np.bincount(layer_of[calls_rows], weights=dur[calls_rows] - child_time[calls_rows], minlength=count)
    up = att.module_parent
    roots = np.flatnonzero((att.root == np.arange(len(events))) & scope)
    bwd_self, bwd_cpu = _rollup(att.module[roots], dur[roots], layer_of, up, count)
    launch = events["launch"].to_numpy()
    gpu_all = np.flatnonzero(kind_mask(events, *GPU_ACTIVITY) & scope)
    gpu = gpu_all[launch[gpu_all] >= 0]
    gpu_layer = att.module[launch[gpu]]
    gpu_bwd = att.backward[launch[gpu]]
    fwd_gpu_self, fwd_gpu = _rollup(np.where(gpu_bwd, -1, gpu_layer), dur[gpu], layer_of, up, count)
    bwd_gpu_self, bwd_gpu = _rollup(np.where(gpu_bwd, gpu_layer, -1), dur[gpu], layer_of, up, count)
    _, growth = _rollup(*memory_growth(trace, att, scope), layer_of, up, count)
    regions = att.compiled[scope[att.compiled]]
    region_layer = np.where(att.module[regions] >= 0, layer_of[np.maximum(att.module[regions], 0)], -1)
    compiled = np.bincount(region_layer[region_layer >= 0], minlength=count) > 0
    if (gpu_layer >= 0).any():  # the roofline only where a layer launched GPU work: a CPU trace never needs it
        flops_of, memory_bound, has_bound = gpu_shares(trace)
        _, flops = _rollup(gpu_layer, flops_of[gpu], layer_of, up, count)
        _, memory_us = _rollup(gpu_layer, np.where(memory_bound[gpu], dur[gpu], 0.0), layer_of, up, count)
        _, modelled = _rollup(gpu_layer, (flops_of[gpu] > 0).astype(np.float64), layer_of, up, count)
        _, bounded = _rollup(gpu_layer, has_bound[gpu].astype(np.float64), layer_of, up, count)
    else:  # no layer to share them out to: no FLOPs, no bound (NaN below)
        flops = memory_us = modelled = bounded = np.zeros(count)
    gpu_us = fwd_gpu + bwd_gpu
    with np.errstate(divide="ignore", invalid="ignore"):
        tflops = np.where((modelled > 0) & (gpu_us > 0), flops / (gpu_us * 1e6), np.nan)
        # NaN where no op of the layer has a known bound (an unknown device: not 0% memory-bound)
        memory_pct = np.where((bounded > 0) & (gpu_us > 0), memory_us / gpu_us * 100.0, np.nan)

    used = (calls > 0) | (bwd_cpu > 0) | (bwd_gpu > 0)
    first = pd.Series(ts[calls_rows]).groupby(layer_of[calls_rows]).idxmin()
    first_row = np.full(count, -1, dtype=np.int64)
    first_row[first.index.to_numpy()] = calls_rows[first.to_numpy()]
    any_row = pd.Series(modules).groupby(layer_id).first()
    first_row = np.where(first_row >= 0, first_row, any_row.reindex(range(count)).to_numpy())
    parent_row = up[first_row]
    depth = nesting_depth(up, first_row)
    name, kind = layers_at(trace, first_row)
    parent_name, _ = layers_at(trace, parent_row)
    trace_name = names_at(trace, first_row)
    table = pd.DataFrame(
        {
            "rank": np.asarray([k[0] for k in keys], dtype=np.int32),
            "layer": text(name),
            "type": text(kind),
            "depth": depth,
            "parent": text(parent_name),
            "calls": calls,
            "cpu_us": fwd_cpu + bwd_cpu,
            "self_cpu_us": fwd_self + bwd_self,
            "fwd_cpu_us": fwd_cpu,
            "fwd_self_cpu_us": fwd_self,
            "bwd_cpu_us": bwd_cpu,
            "bwd_self_cpu_us": bwd_self,
            "gpu_us": fwd_gpu + bwd_gpu,
            "self_gpu_us": fwd_gpu_self + bwd_gpu_self,
            "fwd_gpu_us": fwd_gpu,
            "bwd_gpu_us": bwd_gpu,
            "tflops_per_s": tflops,
            "memory_bound_pct": memory_pct,
            "memory_growth_bytes": growth.astype(np.int64),
            "input_shapes": text(_first_op_dims(trace, first_row)),
            "module": text(trace_name),
            "_ts": ts[first_row],
            "_compiled": compiled,
        },
        columns=[*COLUMNS, "_ts", "_compiled"],
    )
    table = table[used].sort_values(["rank", "_ts"], kind="stable").reset_index(drop=True)
    compiled_layers = {
        r: [str(v) for v in table.loc[(table["rank"] == r) & table["_compiled"], "layer"]] for r in trace.rank_ids
    }
    table = table.drop(columns=["_ts", "_compiled"])
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
    attrs: dict[str, dict[int, float]] = {
        k: {} for k in ("step_us", "unattributed_us", "overlap_us", "gpu_us", "gpu_unattributed_us")
    }
    for r in trace.rank_ids:
        mine = table[table["rank"] == r]
        attributed = float(mine["self_cpu_us"].sum())
        attrs["step_us"][r] = steps.get(r, 0.0)
        attrs["unattributed_us"][r] = max(steps.get(r, 0.0) - attributed, 0.0)
        attrs["overlap_us"][r] = max(attributed - steps.get(r, 0.0), 0.0)
        gpu_total = float(dur[gpu[rank[gpu] == r]].sum())
        attrs["gpu_us"][r] = gpu_total
        attrs["gpu_unattributed_us"][r] = max(gpu_total - float(mine["self_gpu_us"].sum()), 0.0)
    table.attrs.update(attrs)
