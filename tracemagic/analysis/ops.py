"""``ops()``: every CPU op and annotation with its self time, step, shapes and enclosing layer."""

from __future__ import annotations

from typing import cast

import numpy as np
import pandas as pd

from tracemagic.analysis._common import columns_at, kinds_at, labels, layer_labels, trace_start
from tracemagic.analysis.schema import computes
from tracemagic.trace.model import TraceTables
from tracemagic.trace.structure import timed_rows

#: the event kinds listed (python_function frames are call stacks, not ops)
KINDS = ("cpu_op", "user_annotation", "step")
#: the events' columns ``ops`` takes at its rows
_TAKEN = (
    "module", "ts", "name", "parent", "rank", "dur", "self_dur", "tid", "step", "depth",
    "input_dims", "input_type", "seq", "rf_id", "external_id",
)  # fmt: skip


@computes("ops")
def ops(trace: TraceTables) -> pd.DataFrame:
    """CPU ops, user annotations and ProfilerSteps, one row each, in the events table's order.

    Columns: ``rank``; ``row`` (position in ``trace.events``); ``name``; ``kind`` (cpu_op |
    user_annotation | step); ``ts`` (µs since the trace's start); ``dur``; ``self_dur``
    (duration minus the CPU events directly inside it, ops, runtime calls and
    python_function frames alike: torch's Self CPU, as ``key_averages()`` and TensorBoard
    count it, so rankings agree; self times of one thread add up without double
    counting; never below 0: where the children overlap each other, as with
    ``with_stack`` a ``record_function`` block's annotation begins inside its
    ``__enter__`` frame and ends inside its ``__exit__`` frame, their durations sum to
    more than the parent's, torch's Self CPU of the parent goes negative and this is 0);
    ``thread`` (the trace's tid); ``step`` (-1 outside steps); ``depth`` and
    ``parent`` (row of the enclosing CPU event, -1 at top level); ``layer``, ``layer_type``
    (innermost enclosing ``nn.Module``, NA outside modules); ``input_dims``,
    ``input_type`` (JSON text as recorded); ``seq`` (autograd sequence number, links a
    forward op to its backward); ``rf_id``; ``external_id``; ``merged`` (see ``merged``).
    Text columns are categoricals.
    """
    events = trace.events
    rows = timed_rows(events, KINDS)
    taken = columns_at(events, _TAKEN, rows)  # (every column at once: the rows read once)

    def at(column: str) -> pd.api.extensions.ExtensionArray | np.ndarray:
        return taken[column]

    layer, layer_type = layer_labels(trace, at("module"))
    ts = np.asarray(at("ts"), dtype=np.float64)
    ts -= trace_start(trace)  # (in place: taken at the rows, the array is this table's own)
    names = cast(pd.Categorical, at("name"))
    parent = at("parent")  # (the column, and each op's parent for ``merged``)
    return pd.DataFrame(
        {
            "rank": at("rank"),
            "row": rows,
            "name": labels(names),
            "kind": kinds_at(events, rows, KINDS),
            "ts": ts,
            "dur": at("dur"),
            "self_dur": at("self_dur"),
            "thread": labels(at("tid")),
            "step": at("step"),
            "depth": at("depth"),
            "parent": parent,
            "layer": layer,
            "layer_type": layer_type,
            "input_dims": labels(at("input_dims")),
            "input_type": labels(at("input_type")),
            "seq": at("seq"),
            "rf_id": at("rf_id"),
            "external_id": at("external_id"),
            "merged": merged(events, rows, np.asarray(parent), names.codes),
        },
        copy=False,  # every column is made here: no second copy of each (11.8 MB on a 100 MB trace)
    )


def merged(events: pd.DataFrame, rows: np.ndarray, up: np.ndarray, names: np.ndarray) -> np.ndarray:
    """Which of ``rows`` (op rows) run as the only CPU event directly inside an op of their own
    name (``aten::div`` dispatching to ``aten::div``): torch's ``key_averages()``
    (``EventList._remove_dup_nodes``) folds such an op into the one around it, so it is no
    call of its own and its time is already in the outer op's total; ``top_ops`` counts it
    so. torch counts every CPU child (ops, runtime calls, python frames); the TensorBoard
    plugin (``op_tree.py``, ``_remove_dup_nodes``) counts only op children, so an outer op
    that also holds a runtime call of its own is merged there and not here (rare: the inner
    op makes the launch). Chains (``a`` in ``a`` in ``a``) fold into the outermost. An op
    in a 0 µs op (integer-µs traces) is none: it is its sibling for the plugin, as for torch.
    ``up`` and ``names``: the rows' parents and name codes (the caller took them already).
    """
    parent = events["parent"].to_numpy()
    out = np.zeros(rows.size, dtype=bool)
    codes = cast(pd.Categorical, events["name"].array).codes  # (``.cat.codes`` copies them)
    # same name as the parent first (one pass, -1 parents masked): few rows, so the rest looks at those alone
    # (``take``: indexing the small codes by int64 rows is slower; a -1 parent takes the last row's, masked)
    where = np.flatnonzero((up >= 0) & (np.take(codes, up) == names))
    if where.size == 0:
        return out
    outer = up[where]
    kinds = cast(pd.Categorical, events["kind"].array)
    is_op_kind = np.array([k in KINDS for k in kinds.categories.tolist()] + [False])  # the last: -1 (missing)
    # a 0 µs parent (integer-µs traces) holds nothing: the plugin's tree makes such ops siblings
    keep = np.take(is_op_kind, kinds.codes[outer]) & (events["dur"].to_numpy()[outer] > 0)
    where, outer = where[keep], outer[keep]
    if where.size == 0:
        return out
    # the CPU events directly inside each outer op, counted for those few ops alone (not a
    # count for every row: two table-long int64 arrays)
    holders = np.unique(outer)
    is_holder = np.zeros(len(events) + 1, dtype=bool)  # the last entry: parent -1 (top level)
    is_holder[holders] = True
    children = np.bincount(np.searchsorted(holders, parent[is_holder[parent]]), minlength=holders.size)
    out[where] = children[np.searchsorted(holders, outer)] == 1
    return out
