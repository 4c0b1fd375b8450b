"""PyTorch Execution Traces (ET, Chakra's "host trace"): read one into a table.

(Joining it to its Kineto trace is ``tracemagic.analysis.et_graph``; ``tracemagic.et``
takes paths.)

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

from tracemagic.errors import TraceError
from tracemagic.trace import pairing
from tracemagic.trace._files import read_bytes
from tracemagic.trace.kineto import STEP_NAME, rank_from_name

__all__ = ["ExecutionTrace", "find_et", "next_to", "read_et"]

#: names of the ET's own bookkeeping nodes (not operators)
ROOT_NAMES = (
    "[pytorch|profiler|execution_trace|process]",
    "[pytorch|profiler|execution_trace|thread]",
    "[pytorch|profiler|execution_graph|process]",
    "[pytorch|profiler|execution_graph|thread]",
)
#: a ``ProfilerStep#N`` node or event name

#: columns of ``ExecutionTrace.nodes`` (see ``read_et``)
NODE_COLUMNS = (
    "id",
    "name",
    "parent",
    "rf_id",
    "seq_id",
    "scope",
    "tid",
    "fw_parent",
    "fw_tid",
    "op_schema",
    "is_op",
    "step",
    "input_shapes",
    "input_types",
    "output_shapes",
    "output_types",
    "input_tensors",
    "output_tensors",
    "input_bytes",
    "output_bytes",
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
        outs, out_types, out_shapes = (
            node.get("outputs", []),
            node.get("output_types", []),
            node.get("output_shapes", []),
        )
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
    rank = rank_from_name(path.name)
    return ExecutionTrace(path, meta, nodes, rank=rank if rank is not None else 0)


def find_et(kineto_path: str | os.PathLike[str]) -> Path | None:
    """The Execution Trace lying next to a Kineto trace, if any.

    ``kineto_trace_<rank>[_cycle<k>].json[.gz]`` pairs with ``torch_et_<rank>.json[.gz]``;
    ``<stem>_trace.json[.gz]`` with ``<stem>_et.json[.gz]``; in a directory holding one ET
    and one Kineto trace, those two pair. See ``tracemagic.trace.pairing.et_for``.
    """
    return pairing.et_for(kineto_path)


def is_et_file(path: Path) -> bool:
    """Whether ``path`` is an Execution Trace (by its name, else by its first 4 KiB)."""
    if pairing.is_et_name(path.name):
        return True
    try:
        with gzip.open(path, "rb") if path.read_bytes()[:2] == b"\x1f\x8b" else open(path, "rb") as fh:
            head = fh.read(4096)
    except (OSError, EOFError):
        return False
    return b'"schema"' in head and b'"nodes"' in head and b'"traceEvents"' not in head


def next_to(base: Path) -> list[ExecutionTrace]:
    """The Execution Traces of a capture or rank directory, or the one next to a Kineto
    trace file (``tracemagic.trace.pairing``'s names), read."""
    if base.is_dir():
        return [read_et(p) for p in pairing.ets_in(base)]
    found = find_et(base)
    return [read_et(found)] if found is not None else []
