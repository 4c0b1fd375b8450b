"""PyTorch Execution Traces (ET, Chakra's "host trace"): read one, join it to its Kineto trace.

An ET (``ExecutionTraceObserver``) records every operator with its ``op_schema``, input and
output values, shapes, dtypes and the ids of the tensors it reads and writes; the Kineto
trace of the same steps records when each ran. The join key is the ET node's ``rf_id`` =
the Kineto event's ``Record function id``.

Two ET layouts exist: schema ``1.0.1`` (flat ``inputs``/``input_shapes``/``input_types``
and ``parent``) and ``1.0.2-chakra.0.0.4`` and later (``inputs``/``outputs`` objects with
``values``/``shapes``/``types`` [/``strides``], ``ctrl_deps``, and an ``attrs`` list).
"""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import orjson
import pandas as pd

from tracemagic.errors import TraceError
from tracemagic.export._files import read_bytes
from tracemagic.trace import pairing

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import Trace

__all__ = ["ExecutionTrace", "et_graph", "et_ops", "find_et", "read_et"]

#: names of the ET's own bookkeeping nodes (not operators)
ROOT_NAMES = (
    "[pytorch|profiler|execution_trace|process]",
    "[pytorch|profiler|execution_trace|thread]",
    "[pytorch|profiler|execution_graph|process]",
    "[pytorch|profiler|execution_graph|thread]",
)
#: a ``ProfilerStep#N`` node or event name
STEP_NAME = re.compile(r"ProfilerStep#(\d+)")
_RANK = re.compile(r"(?:rank|worker|_et_|et_)[-_.]?(\d+)", re.IGNORECASE)

#: columns of ``ExecutionTrace.nodes`` (see ``read_et``)
NODE_COLUMNS = (
    "id", "name", "parent", "rf_id", "seq_id", "scope", "tid", "fw_parent", "fw_tid",
    "op_schema", "is_op", "step", "input_shapes", "input_types", "output_shapes",
    "output_types", "input_tensors", "output_tensors", "input_bytes", "output_bytes",
)


@dataclass
class ExecutionTrace:
    """One rank's Execution Trace as a table.

    Attributes:
        path: the file it was read from.
        meta: the top-level keys (``schema``, ``pid``, ``time``, ``start_ts``, ``finish_ts``).
        nodes: one row per ET node, ordered by ``id`` (execution order of entry): ``id``,
            ``name``, ``parent`` (id of the enclosing node), ``rf_id``, ``seq_id``,
            ``scope``, ``tid``, ``fw_parent``, ``fw_tid``, ``op_schema``, ``is_op``
            (an operator, not a label/annotation), ``step`` (``ProfilerStep#N`` around it,
            -1), ``input_shapes``/``input_types``/``output_shapes``/``output_types``
            (JSON text), ``input_tensors``/``output_tensors`` (tensor keys
            ``"<tensor id>:<storage id>"``, tuples), ``input_bytes``/``output_bytes``.
        rank: the rank its file name names, else 0.
    """

    path: Path
    meta: dict[str, Any]
    nodes: pd.DataFrame
    rank: int = 0

    @property
    def schema(self) -> str:
        """The schema version string (``1.1.1-chakra.0.0.4`` for torch 2.5+)."""
        return str(self.meta.get("schema", ""))


def _load_json(path: Path) -> Any:
    raw, _ = read_bytes(path)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TraceError(
            f"{path}: not valid JSON ({exc}). An Execution Trace is only complete once its "
            "observer is unregistered (ExecutionTraceObserver.unregister_callback(), or the "
            "end of `with profile(..., execution_trace_observer=et)`); a cell that failed "
            "mid-capture leaves it truncated.",
            path=str(path),
        ) from None


def _walk_tensors(value: Any, typ: str, out: list[str], sizes: list[int]) -> None:
    """Collect tensor keys from an ET value of type ``Tensor(...)`` or ``GenericList[...]``."""
    if not isinstance(value, list):
        return
    if typ.startswith("Tensor") and len(value) >= 6 and isinstance(value[0], int):
        out.append(f"{value[0]}:{value[1]}")
        try:
            sizes.append(int(value[3]) * int(value[4]))
        except (TypeError, ValueError):
            sizes.append(0)
        return
    if typ.startswith("GenericList[") and "Tensor" in typ:
        inner = typ[len("GenericList[") : -1].split(",")
        for k, item in enumerate(value):
            _walk_tensors(item, inner[k] if k < len(inner) else inner[-1], out, sizes)


def _tensors(values: list[Any], types: list[str]) -> tuple[tuple[str, ...], int]:
    keys: list[str] = []
    sizes: list[int] = []
    for value, typ in zip(values or [], types or []):
        _walk_tensors(value, str(typ), keys, sizes)
    return tuple(keys), int(sum(sizes))


def _row(node: dict[str, Any], legacy: bool) -> dict[str, Any]:
    if legacy:
        attrs = node
        ins, in_types, in_shapes = node.get("inputs", []), node.get("input_types", []), node.get("input_shapes", [])
        outs, out_types, out_shapes = node.get("outputs", []), node.get("output_types", []), node.get("output_shapes", [])
        parent = node.get("parent")
    else:
        attrs = {str(a.get("name")): a.get("value") for a in node.get("attrs", []) if isinstance(a, dict)}
        inputs, outputs = node.get("inputs") or {}, node.get("outputs") or {}
        ins, in_types, in_shapes = inputs.get("values", []), inputs.get("types", []), inputs.get("shapes", [])
        outs, out_types, out_shapes = outputs.get("values", []), outputs.get("types", []), outputs.get("shapes", [])
        parent = node.get("ctrl_deps")
    in_keys, in_bytes = _tensors(ins, in_types)
    out_keys, out_bytes = _tensors(outs, out_types)
    name = str(node.get("name", ""))
    schema = str(attrs.get("op_schema") or "")
    return {
        "id": int(node["id"]),
        "name": name,
        "parent": int(parent) if isinstance(parent, (int, float)) else -1,
        "rf_id": attrs.get("rf_id"),
        "seq_id": attrs.get("seq_id"),
        "scope": attrs.get("scope"),
        "tid": attrs.get("tid"),
        "fw_parent": attrs.get("fw_parent"),
        "fw_tid": attrs.get("fw_tid"),
        "op_schema": schema,
        "is_op": bool(schema) and name not in ROOT_NAMES,
        "input_shapes": orjson.dumps(in_shapes).decode(),
        "input_types": orjson.dumps(in_types).decode(),
        "output_shapes": orjson.dumps(out_shapes).decode(),
        "output_types": orjson.dumps(out_types).decode(),
        "input_tensors": in_keys,
        "output_tensors": out_keys,
        "input_bytes": in_bytes,
        "output_bytes": out_bytes,
    }


def _steps_of(nodes: pd.DataFrame) -> np.ndarray:
    """The ``ProfilerStep#N`` enclosing each node (-1 outside any)."""
    index = {int(i): k for k, i in enumerate(nodes["id"].to_numpy())}
    parents = nodes["parent"].to_numpy()
    own = np.array([int(m.group(1)) if (m := STEP_NAME.match(n)) else -1 for n in nodes["name"]], dtype=np.int64)
    step = own.copy()
    # walk up: ids are assigned on entry, so a parent's id is smaller; resolve in id order
    order = np.argsort(nodes["id"].to_numpy(), kind="stable")
    for k in order:
        if step[k] >= 0:
            continue
        p = index.get(int(parents[k]))
        if p is not None and p != k:
            step[k] = step[p]
    return step


def read_et(path: str | os.PathLike[str]) -> ExecutionTrace:
    """Read an Execution Trace (plain or gzip JSON) into an ``ExecutionTrace``.

    Raises:
        TraceError: the file is missing, not JSON, or not an Execution Trace.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such Execution Trace file.", path=str(path))
    data = _load_json(path)
    if not isinstance(data, dict) or "nodes" not in data or "schema" not in data:
        keys = ", ".join(list(data)[:6]) if isinstance(data, dict) else type(data).__name__
        raise TraceError(
            f"{path}: not a PyTorch Execution Trace (expected 'schema' and 'nodes'; found {keys}).",
            path=str(path),
        )
    meta = {k: v for k, v in data.items() if k != "nodes"}
    legacy = "-chakra" not in str(data.get("schema", ""))
    rows = [_row(n, legacy) for n in data["nodes"] if isinstance(n, dict) and "id" in n]
    nodes = pd.DataFrame(rows, columns=[c for c in NODE_COLUMNS if c != "step"])
    for column in ("rf_id", "seq_id", "scope", "tid", "fw_parent", "fw_tid"):
        nodes[column] = pd.array(pd.to_numeric(nodes[column], errors="coerce"), dtype="Int64")
    nodes = nodes.sort_values("id", kind="stable").reset_index(drop=True)
    nodes.insert(NODE_COLUMNS.index("step"), "step", _steps_of(nodes) if len(nodes) else np.empty(0, np.int64))
    match = _RANK.search(path.name)
    return ExecutionTrace(path, meta, nodes, rank=int(match.group(1)) if match else 0)


def find_et(kineto_path: str | os.PathLike[str]) -> Path | None:
    """The Execution Trace lying next to a Kineto trace, if any.

    ``kineto_trace_<rank>[_cycle<k>].json[.gz]`` pairs with ``torch_et_<rank>.json[.gz]``;
    ``<stem>_trace.json[.gz]`` with ``<stem>_et.json[.gz]``; in a directory holding one ET
    and one Kineto trace, those two pair. See ``tracemagic.trace.pairing.et_for``.
    """
    return pairing.et_for(kineto_path)


def _resolve(source: "Trace | str | os.PathLike[str]") -> tuple[list[ExecutionTrace], "Trace | None"]:
    """ETs (one per rank) and the Trace to join them with, from a Trace or a path."""
    from tracemagic.trace.model import Trace

    if isinstance(source, Trace):
        trace = source
        base = trace.path
        if base is None:
            raise TraceError("this Trace has no path, so its Execution Trace cannot be found.")
    else:
        base = Path(source)
        trace = None
        if base.is_file() and _is_et_file(base):
            et = read_et(base)
            kineto = pairing.kineto_for(base)
            return [et], (_load(kineto) if kineto is not None else None)
    base = Path(base)
    ets = _ets_in(base)
    if not ets:
        raise TraceError(
            f"{base}: no Execution Trace found next to this trace (torch_et_<rank>.json). "
            "Capture with `%%chakra_trace --et`, or with "
            "torch.profiler.profile(..., execution_trace_observer=ExecutionTraceObserver()"
            ".register_callback(path)).",
            path=str(base),
        )
    if trace is None:
        try:
            trace = _load(base)
        except TraceError:
            trace = None
    return ets, trace


def _load(path: Path) -> "Trace":
    from tracemagic.trace.loader import load

    return load(path)


def _is_et_file(path: Path) -> bool:
    if pairing.is_et_name(path.name):
        return True
    try:
        with gzip.open(path, "rb") if path.read_bytes()[:2] == b"\x1f\x8b" else open(path, "rb") as fh:
            head = fh.read(4096)
    except (OSError, EOFError):
        return False
    return b'"schema"' in head and b'"nodes"' in head and b'"traceEvents"' not in head


def _ets_in(base: Path) -> list[ExecutionTrace]:
    if base.is_dir():
        return [read_et(p) for p in pairing.ets_in(base)]
    found = find_et(base)
    return [read_et(found)] if found is not None else []


def et_ops(source: "Trace | str | os.PathLike[str]") -> pd.DataFrame:
    """Every ET node of every rank joined to its Kineto event by ``rf_id``.

    Args:
        source: a loaded ``Trace`` (its ET is found next to ``trace.path``), a capture
            directory, a Kineto trace file, or an ET file (its Kineto trace is found next
            to it when there is one).

    Returns:
        The ``ExecutionTrace.nodes`` columns plus ``rank``, ``row`` (the Kineto event's row
        in ``trace.events``, -1 when not found), ``ts``, ``dur``, ``self_dur`` (µs) and
        ``kineto_step``, NaN/-1 where there is no match. ``attrs['join_key']`` per rank is
        ``'rf_id'``, or ``'external_id'`` for traces of torch < 2.1 that carry no
        ``Record function id`` (their CPU ops' ``External id`` held the ET's ``rf_id``).

    Raises:
        TraceError: no Execution Trace could be found or read.
    """
    ets, trace = _resolve(source)
    frames = []
    for et in ets:
        nodes = et.nodes.copy()
        rank = et.rank if trace is None or et.rank in trace.ranks else (trace.ranks[0] if len(ets) == 1 else et.rank)
        nodes.insert(0, "rank", np.full(len(nodes), rank, dtype=np.int32))
        frames.append(_join(nodes, trace, rank))
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.attrs["join_key"] = {et.rank: f.attrs.get("join_key", "rf_id") for et, f in zip(ets, frames)}
    out.attrs["schemas"] = {et.rank: et.schema for et in ets}
    return out


def _join(nodes: pd.DataFrame, trace: "Trace | None", rank: int) -> pd.DataFrame:
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


def et_graph(
    trace_or_dir: "Trace | str | os.PathLike[str]",
    step: int | None = None,
    *,
    level: Literal["top", "leaf", "all"] = "top",
    rank: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ET's operator graph: nodes and data-dependency edges, ready to draw.

    Args:
        trace_or_dir: a ``Trace``, capture directory, Kineto trace or ET file.
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
    ops = et_ops(trace_or_dir)
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
    edge_frame = pd.DataFrame(edges, columns=["src", "dst", "tensor", "bytes"]).drop_duplicates(["src", "dst", "tensor"])
    sizes = _tensor_sizes(ops)
    edge_frame["bytes"] = edge_frame["tensor"].map(sizes).fillna(0).astype(np.int64)
    node_frame = ops.loc[keep, [
        "id", "name", "op_schema", "parent", "step", "rf_id", "input_shapes", "input_types",
        "output_shapes", "output_types", "row", "ts", "dur", "self_dur",
    ]].copy()
    node_frame.insert(4, "depth", depth[keep])
    return node_frame.reset_index(drop=True), edge_frame.reset_index(drop=True)


def _tensor_sizes(ops: pd.DataFrame) -> dict[str, int]:
    """Bytes of each tensor key, from the outputs that carry it."""
    sizes: dict[str, int] = {}
    for keys, total in zip(ops["output_tensors"], ops["output_bytes"]):
        if len(keys) == 1:
            sizes.setdefault(keys[0], int(total))
    return sizes
