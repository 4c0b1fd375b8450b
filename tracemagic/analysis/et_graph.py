"""An Execution Trace joined to its Kineto trace, and its operator graph.

The join key is the ET node's ``rf_id`` = the Kineto event's ``Record function id``. The
ETs are those ``load`` found next to the trace (``trace.artifacts.execution_traces``);
``tracemagic.et`` takes paths instead.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd

from tracemagic.analysis.schema import computes
from tracemagic.errors import TraceError
from tracemagic.trace.et_reader import ExecutionTrace
from tracemagic.trace.model import TraceTables

__all__ = ["et_graph", "et_ops", "graph", "join"]


def et_ops(trace: TraceTables) -> pd.DataFrame:
    """Every ET node of every rank of ``trace`` joined to its Kineto event (see ``join``).

    Raises:
        TraceError: no Execution Trace lies next to the trace.
    """
    if trace.path is None:
        raise TraceError("this Trace has no path, so its Execution Trace cannot be found.")
    ets = trace.artifacts.execution_traces
    if not ets:
        raise TraceError(
            f"{trace.path}: no Execution Trace found next to this trace (torch_et_<rank>.json). "
            "Capture with `%%chakra_trace --et`, or with "
            "torch.profiler.profile(..., execution_trace_observer=ExecutionTraceObserver()"
            ".register_callback(path)).",
            path=str(trace.path),
        )
    return join(ets, trace)


def join(ets: list[ExecutionTrace], trace: TraceTables | None) -> pd.DataFrame:
    """Every ET node of every rank joined to its Kineto event by ``rf_id``.

    Args:
        ets: the Execution Traces (one per rank, or per cycle).
        trace: the Kineto trace to join them to (None: no times).

    Returns:
        The ``ExecutionTrace.nodes`` columns plus ``rank``, ``row`` (the Kineto event's row
        in ``trace.events``, -1 when not found), ``ts``, ``dur``, ``self_dur`` (µs) and
        ``kineto_step``, NaN/-1 where there is no match. ``attrs['join_key']`` per rank is
        ``'rf_id'``, or ``'external_id'`` for traces of torch < 2.1 that carry no
        ``Record function id`` (their CPU ops' ``External id`` held the ET's ``rf_id``).
    """
    frames = []
    for et in ets:
        nodes = et.nodes.copy()
        rank = (
            et.rank if trace is None or et.rank in trace.rank_ids else (trace.rank_ids[0] if len(ets) == 1 else et.rank)
        )
        nodes.insert(0, "rank", np.full(len(nodes), rank, dtype=np.int32))
        frames.append(_join(nodes, trace, rank))
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.attrs["join_key"] = {et.rank: f.attrs.get("join_key", "rf_id") for et, f in zip(ets, frames)}
    out.attrs["schemas"] = {et.rank: et.schema for et in ets}
    return out


def _join(nodes: pd.DataFrame, trace: TraceTables | None, rank: int) -> pd.DataFrame:
    n = len(nodes)
    row = np.full(n, -1, dtype=np.int64)
    ts = np.full(n, np.nan)
    dur = np.full(n, np.nan)
    self_dur = np.full(n, np.nan)
    kstep = np.full(n, -1, dtype=np.int64)
    key = "rf_id"
    if trace is not None and n:
        ev = trace.events
        mine = (ev["rank"].to_numpy() == rank) & ev["kind"].isin(("cpu_op", "user_annotation", "step")).to_numpy()
        if not (mine & ev["rf_id"].notna().to_numpy()).any():
            # torch < 2.1 wrote no 'Record function id'; its CPU ops' 'External id' was the
            # same number as the ET's rf_id (what HTA's ET correlation relies on)
            key = "external_id"
        keep = mine & ev[key].notna().to_numpy()
        rows = np.flatnonzero(keep)
        lookup = pd.Series(rows, index=ev[key].to_numpy(dtype=np.int64, na_value=-1)[rows])
        lookup = lookup[~lookup.index.duplicated()]
        rf = nodes["rf_id"].to_numpy(dtype=np.int64, na_value=-1)
        found = lookup.reindex(rf).to_numpy()
        ok = ~np.isnan(found) & (rf > 0)
        row[ok] = found[ok].astype(np.int64)
        hit = row[ok]
        ts[ok] = ev["ts"].to_numpy()[hit]
        dur[ok] = ev["dur"].to_numpy()[hit]
        self_dur[ok] = ev["self_dur"].to_numpy()[hit]
        kstep[ok] = ev["step"].to_numpy()[hit]
    nodes["row"] = row
    nodes["ts"] = ts
    nodes["dur"] = dur
    nodes["self_dur"] = self_dur
    nodes["kineto_step"] = kstep
    nodes.attrs["join_key"] = key
    return nodes


@computes("et_graph", "et_edges")
def et_graph(
    trace: TraceTables,
    step: int | None = None,
    *,
    level: Literal["top", "leaf", "all"] = "top",
    rank: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ET operator graph of ``trace`` (``graph`` of ``et_ops(trace)``)."""
    return graph(et_ops(trace), step, level=level, rank=rank)


def graph(
    ops: pd.DataFrame,
    step: int | None = None,
    *,
    level: Literal["top", "leaf", "all"] = "top",
    rank: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ET's operator graph: nodes and data-dependency edges, ready to draw.

    Args:
        ops: ``et_ops``/``join``'s table.
        step: keep only the ops of ``ProfilerStep#<step>`` (default: all steps).
        level: ``"top"`` draws the outermost operators (``aten::linear``, not the
            ``aten::addmm`` inside it; a tensor made inside one is credited to it);
            ``"leaf"`` the innermost ones; ``"all"`` every operator.
        rank: the rank to draw (default: the lowest).

    Returns:
        ``(nodes, edges)``. ``nodes``: ``id, name, op_schema, parent, depth, step, rf_id,
        input_shapes, input_types, output_shapes, output_types, row, ts, dur, self_dur``
        (times µs, NaN where Kineto has no match). ``edges``: ``src, dst, tensor, bytes``,
        one row per tensor an op reads that an earlier op wrote (producer -> consumer).
        A ``--repeat`` capture has one ET per cycle, whose node ids each start again at 1:
        each cycle's graph is built on its own (no edge crosses cycles), so ids repeat
        across cycles when ``step`` is None; pass ``step`` for one cycle's graph.

    Raises:
        TraceError: no ET found, or ``step`` is not in it.
        ValueError: an unknown ``level``.
    """
    if level not in ("top", "leaf", "all"):
        raise ValueError(f"level must be 'top', 'leaf' or 'all', not {level!r}")
    if rank is None:
        rank = int(ops["rank"].min()) if len(ops) else 0
    ops = ops[ops["rank"] == rank].reset_index(drop=True)
    if step is not None:
        available = sorted(int(s) for s in set(ops["step"]) if s >= 0)
        if step not in available:
            raise TraceError(f"ProfilerStep#{step} is not in the Execution Trace (steps there: {available or 'none'}).")
        ops = ops[ops["step"] == step].reset_index(drop=True)
    # one block per ET file (et_ops stacks them, each in increasing id order)
    starts = np.flatnonzero(np.diff(ops["id"].to_numpy()) <= 0) + 1
    parts = [_graph(ops.iloc[b].reset_index(drop=True), level) for b in np.split(np.arange(len(ops)), starts)]
    nodes = pd.concat([n for n, _ in parts], ignore_index=True)
    edges = pd.concat([e for _, e in parts], ignore_index=True)
    return nodes, edges


def _graph(ops: pd.DataFrame, level: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``et_graph`` of one ET's operators (ids unique)."""
    index = {int(i): k for k, i in enumerate(ops["id"].to_numpy())}
    is_op = ops["is_op"].to_numpy()
    parent = ops["parent"].to_numpy()
    # nearest operator ancestor (-1) and operator depth, in id order (parents come first)
    op_parent = np.full(len(ops), -1, dtype=np.int64)
    depth = np.zeros(len(ops), dtype=np.int64)
    for k in np.argsort(ops["id"].to_numpy(), kind="stable"):
        p = index.get(int(parent[k]))
        if p is None or p == k:
            continue
        op_parent[k] = p if is_op[p] else op_parent[p]
        depth[k] = depth[p] + (1 if is_op[p] else 0)
    has_op_child = np.zeros(len(ops), dtype=bool)
    has_op_child[op_parent[(op_parent >= 0) & is_op]] = True
    top = np.arange(len(ops))
    for _ in range(int(depth.max(initial=0)) + 1):  # climb to the outermost operator
        up = op_parent[top]
        top = np.where(up >= 0, up, top)
    if level == "top":
        keep = is_op & (op_parent < 0)
        owner = np.where(is_op, top, -1)
    elif level == "leaf":
        keep = is_op & ~has_op_child
        owner = np.where(keep, np.arange(len(ops)), -1)
    else:
        keep = is_op.copy()
        owner = np.where(is_op, np.arange(len(ops)), -1)
    ids = ops["id"].to_numpy()
    # producer of each tensor: the latest op (by id) writing it, credited to its owner
    writer: dict[str, int] = {}
    edges: list[tuple[int, int, str, int]] = []
    order = np.argsort(ids, kind="stable")
    ins, outs = ops["input_tensors"].to_numpy(), ops["output_tensors"].to_numpy()
    for k in order:
        if not is_op[k]:
            continue
        consumer = owner[k]
        if keep[k]:
            for key in ins[k]:
                src = writer.get(key)
                if src is not None and src != consumer:
                    edges.append((int(ids[src]), int(ids[consumer]), key, 0))
        if owner[k] >= 0:
            for key in outs[k]:
                writer[key] = int(owner[k])
    edge_frame = pd.DataFrame(edges, columns=["src", "dst", "tensor", "bytes"]).drop_duplicates(
        ["src", "dst", "tensor"]
    )
    sizes = _tensor_sizes(ops)
    edge_frame["bytes"] = edge_frame["tensor"].map(sizes).fillna(0).astype(np.int64)
    node_frame = ops.loc[
        keep,
        [
            "id",
            "name",
            "op_schema",
            "parent",
            "step",
            "rf_id",
            "input_shapes",
            "input_types",
            "output_shapes",
            "output_types",
            "row",
            "ts",
            "dur",
            "self_dur",
        ],
    ].copy()
    node_frame.insert(4, "depth", depth[keep])
    return node_frame.reset_index(drop=True), edge_frame.reset_index(drop=True)


def _tensor_sizes(ops: pd.DataFrame) -> dict[str, int]:
    """Bytes of each tensor key, from the outputs that carry it."""
    sizes: dict[str, int] = {}
    for keys, total in zip(ops["output_tensors"], ops["output_bytes"]):
        if len(keys) == 1:
            sizes.setdefault(keys[0], int(total))
    return sizes
