"""``syncs()``: host-device synchronisations inside the steps, with their stall and their line.

A synchronisation makes the host wait until the GPU has run everything queued before it:
``.item()`` (``aten::item`` / ``aten::_local_scalar_dense``), a copy to the host
(``.cpu()``, ``.tolist()``, ``.numpy()`` of a CUDA tensor: ``aten::to`` / ``aten::_to_copy`` /
``aten::copy_`` launching a device-to-host memcpy), and the blocking runtime calls
(``cudaMemcpy``, ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``cudaEventSynchronize``, their ``hip`` twins). The stall is the host time in the blocking
runtime calls beneath it: the memcpy to pageable memory and the stream synchronisation of
an ``.item()`` (where the host waits for the queue to drain). On a CPU-only trace an
``.item()`` is found too, with no wait (``gpu_wait`` False): there is no queue to drain.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from tracemagic.analysis._common import in_scope, trace_start
from tracemagic.analysis.lines import cell_lines, line_of_rows, marks
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.structure import enclosing_of_kind, propagate

#: ops that read one value back to the host (``.item()``, printing a tensor)
ITEM_OPS = ("aten::item", "aten::_local_scalar_dense")
#: ops that copy a tensor; a sync where they copy device -> host (``.cpu()``, ``.tolist()``)
COPY_OPS = ("aten::to", "aten::_to_copy", "aten::copy_")
#: runtime calls that block the host until the GPU is done (``cudaMemcpy`` is the synchronous one)
SYNC_CALLS = re.compile(r"^(?:cuda|hip)(?:Memcpy|StreamSynchronize|DeviceSynchronize|EventSynchronize)$")
#: runtime calls whose host time is a stall when they run inside a sync op
BLOCKING_CALLS = re.compile(r"^(?:cuda|hip)(?:Memcpy\w*|\w*Synchronize)$")
#: a device-to-host memcpy's name (``Memcpy DtoH (Device -> Pageable)``)
DTOH = re.compile(r"DtoH|Device -> (?:Pageable|Pinned|Host)")
#: a ``python_function`` frame of torch's own code, or a builtin: not where the user called from
_NOT_USER = re.compile(
    r"^<built-in|^nn\.Module: |^torch/|[/\\](?:site|dist)-packages[/\\]torch[/\\]"
    r"|[/\\]torch[/\\](?:nn|_tensor|autograd|utils|optim|_dynamo|_ops|profiler)"
)


def _names_mask(names: pd.Series, test: object) -> np.ndarray:
    categories = names.cat.categories.tolist()
    if isinstance(test, re.Pattern):
        hit = np.fromiter((bool(test.search(str(c))) for c in categories), dtype=bool, count=len(categories))
    else:
        wanted = set(test)  # type: ignore[call-overload]
        hit = np.fromiter((str(c) in wanted for c in categories), dtype=bool, count=len(categories))
    hit = np.append(hit, False)  # code -1: no name
    return hit[names.cat.codes.to_numpy()]


@computes("syncs")
def syncs(trace: TraceTables) -> pd.DataFrame:
    """One row per host-device synchronisation inside the steps, in time order.

    Found: ``.item()`` ops, copies to the host (a ``COPY_OPS`` op that launched a
    device-to-host memcpy, counted at its outermost copy op) and the blocking runtime calls
    of ``SYNC_CALLS``; one inside another counts once, as the outermost (the
    ``cudaStreamSynchronize`` of an ``aten::item`` is that item's stall).

    Columns: see ``schema.TABLES['syncs']``. ``stall_us`` is the host time in the blocking
    runtime calls beneath the sync (``BLOCKING_CALLS``: memcpy and synchronize calls),
    itself for a runtime call: the time the host waited for the GPU (plus the copy);
    ``dur`` the sync event's own duration. Named by its cell line where the trace has line
    marks, else by the innermost Python function above it outside torch, else by the op
    around it.
    """
    columns = TABLES["syncs"].names
    events = trace.events
    if events.empty:
        return TABLES["syncs"].empty()
    names = events["name"]
    parent = events["parent"].to_numpy()
    depth = events["depth"].to_numpy()
    is_op = kind_mask(events, "cpu_op")
    is_runtime = kind_mask(events, "runtime")
    item = is_op & _names_mask(names, ITEM_OPS)
    copy = is_op & _names_mask(names, COPY_OPS)
    call = is_runtime & _names_mask(names, SYNC_CALLS)
    to_host = np.zeros(len(events), dtype=bool)
    if copy.any():
        gpu = kind_mask(events, *GPU_ACTIVITY)
        memcpy = np.flatnonzero(gpu & _names_mask(names, DTOH))
        launcher = events["op"].to_numpy()[memcpy]
        launcher = launcher[launcher >= 0]
        inner = propagate(parent, depth, copy)  # the innermost copy op around each row
        cur = inner[launcher]
        cur = cur[cur >= 0]
        while cur.size:  # climb to the outermost copy op of each chain
            up = np.where(parent[cur] >= 0, inner[np.maximum(parent[cur], 0)], -1)
            top = up < 0
            to_host[cur[top]] = True
            cur = up[~top]
    candidate = (item | to_host | call) & in_scope(events)
    rows = np.flatnonzero(candidate)
    if not rows.size:
        return TABLES["syncs"].empty()
    rows = rows[enclosing_of_kind(parent, depth, candidate, rows) < 0]  # the outermost of nested ones
    kept = np.zeros(len(events), dtype=bool)
    kept[rows] = True
    blocking = np.flatnonzero(is_runtime & _names_mask(names, BLOCKING_CALLS))
    owner = propagate(parent, depth, kept)[blocking]
    found = owner >= 0
    pos = np.full(len(events), -1, dtype=np.int64)
    pos[rows] = np.arange(rows.size)
    dur_all = events["dur"].to_numpy()
    stall = np.bincount(pos[owner[found]], weights=dur_all[blocking][found], minlength=rows.size)
    waited = np.bincount(pos[owner[found]], minlength=rows.size) > 0

    what = np.where(item[rows], "item", np.where(to_host[rows], "copy_to_host", "sync_call"))
    line = line_of_rows(trace, rows)
    texts = cell_lines(trace)
    line_text = [texts.get(int(n), "").strip() if n >= 0 else "" for n in line]
    function = _function_above(trace, rows)
    op = _op_around(trace, rows)
    event_names = _names_at(names, rows)
    where = []
    for n, text, func, around, name in zip(line, line_text, function, op, event_names):
        if n >= 0:
            where.append(f"line {int(n)} `{text}`" if text else f"line {int(n)}")
        elif func:
            where.append(func)
        elif around:
            where.append(f"{name} in {around}")
        else:
            where.append(name)
    table = pd.DataFrame(
        {
            "rank": events["rank"].to_numpy()[rows],
            "row": rows.astype(np.int64),
            "step": events["step"].to_numpy()[rows],
            "ts": events["ts"].to_numpy()[rows] - trace_start(trace),
            "name": pd.array(event_names, dtype="str"),
            "what": pd.array(what, dtype="str"),
            "dur": dur_all[rows],
            "stall_us": stall,
            "gpu_wait": waited,
            "line": line.astype(np.int64),
            "line_text": pd.array(line_text, dtype="str"),
            "function": pd.array(function, dtype="str"),
            "op": pd.array(op, dtype="str"),
            "where": pd.array(where, dtype="str"),
        }
    )[columns]
    return table.sort_values(["rank", "ts", "row"], kind="stable").reset_index(drop=True)


def _function_above(trace: TraceTables, rows: np.ndarray) -> list[str]:
    """The innermost ``python_function`` frame above each row that is not torch's own or a builtin."""
    events = trace.events
    user = kind_mask(events, "python_function") & ~_names_mask(events["name"], _NOT_USER)
    if not user.any():
        return [""] * rows.size
    above = enclosing_of_kind(events["parent"].to_numpy(), events["depth"].to_numpy(), user, rows)
    return _names_at(events["name"], above)


def _op_around(trace: TraceTables, rows: np.ndarray) -> list[str]:
    """The innermost CPU op or annotation around each row, line marks and steps aside."""
    events = trace.events
    ops = kind_mask(events, "cpu_op", "user_annotation")
    _, mark_rows = marks(trace)
    ops[mark_rows] = False
    above = enclosing_of_kind(events["parent"].to_numpy(), events["depth"].to_numpy(), ops, rows)
    return _names_at(events["name"], above)


def _names_at(names: pd.Series, rows: np.ndarray) -> list[str]:
    """The names of events ``rows`` ("" for -1 or no name), from the categorical's codes (no
    name made per event of the trace)."""
    categories = names.cat.categories
    codes = names.cat.codes.to_numpy()
    out = []
    for row in rows:
        code = codes[row] if row >= 0 else -1
        out.append(str(categories[code]) if code >= 0 else "")
    return out
