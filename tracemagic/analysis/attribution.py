"""Layer attribution: which ``nn.Module`` instance each event's time belongs to.

Forward work belongs to the innermost enclosing module event; backward work (the
outermost autograd ops) to the layer of the forward op that created its autograd node
(``fwdbwd`` flows, else the sequence number). ``layers()``, ``spans()``, ``memory()`` and
``efficiency()`` build on it; it lives below them so that none imports another for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    enclosing_at,
    flow_thread_keys,
    group_rows,
    in_scope,
    layers_at,
    names_match_at,
    names_where,
    thread_order,
)
from tracemagic.trace import structure
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask, per_code
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import MODULE_PREFIX, enclosing_of_kind, narrow_rows, propagate

#: outermost op of each autograd node run by the engine
BACKWARD_OP = re.compile(r"^autograd::engine::evaluate_function")
#: the op dynamo runs each compiled frame in (``Torch-Compiled Region: 0/0``)
COMPILED_REGION = re.compile(r"^Torch-Compiled Region")
#: the module event of a ``torch.compile(model)`` wrapper
COMPILED_WRAPPER = re.compile(r"^nn\.Module: OptimizedModule_\d+$")


@dataclass(frozen=True)
class Attribution:
    """Which layer each event's time belongs to.

    Attributes:
        module: per events row (int32 rows where they fit, as ``root`` and ``module_parent``),
            the ``nn.Module`` event row whose layer gets the row's time:
            the innermost enclosing module for forward work, the module of the matching
            forward op for work inside a backward op; -1 for none.
        backward: per events row, whether it lies inside an outermost backward op.
        root: per events row, the outermost backward op enclosing it (itself included), -1.
        is_module: per events row, whether it is an ``nn.Module`` event that is a layer of
            its own (not folded into its enclosing one, see ``_fold_compiled``).
        module_parent: per events row, the ``nn.Module`` event enclosing a module event, -1.
        in_scope: per events row, inside a ProfilerStep (or the rank has no steps).
        compiled: rows of the ``Torch-Compiled Region`` ops.
    """

    module: np.ndarray
    backward: np.ndarray
    root: np.ndarray
    is_module: np.ndarray
    module_parent: np.ndarray
    in_scope: np.ndarray
    compiled: np.ndarray


def attribution(trace: TraceTables, flows: bool = True) -> Attribution:
    """Attribute every event to a layer: forward by module nesting, backward by its forward op
    (computed once per trace and flag; see ``_attribution``)."""
    return trace.shared((Shared.ATTRIBUTION, flows), lambda: _attribution(trace, flows))


def _attribution(trace: TraceTables, flows: bool) -> Attribution:
    """Attribute every event to a layer: forward by module nesting, backward by its forward op.

    Backward ops count only when outermost (not inside another backward op) and outside
    any module event (autograd work inside a module's forward is that module's forward
    time). A backward op goes to the layer of the forward op that created its autograd
    node: the op at the start of a ``fwdbwd`` flow ending on the backward op or an op
    inside it (exact, even with forward passes on several threads), else (traces without
    flows, or ``flows=False``) the latest earlier forward op with the same ``Sequence
    number`` on the rank (sequence numbers are per thread, so they can collide). Module
    events inside a backward op (activation recomputation) count as that backward op's time.

    Per-event work is kept to masks and the propagation; what only some rows need (the
    outermost backward ops, the module events, the rows with a forward thread id) is
    computed over those rows alone.
    """
    events = trace.events
    n = len(events)
    parent = events["parent"].to_numpy()
    depth = events["depth"].to_numpy()
    is_op = kind_mask(events, "cpu_op")
    names = events["name"]
    codes = names.array.codes  # (``.cat.codes`` copies them)
    # per category, and False for a missing name (code -1: the appended last entry)
    module_names = np.append(np.asarray(names.cat.categories.str.startswith(MODULE_PREFIX), dtype=bool), False)
    functions = np.flatnonzero(kind_mask(events, "python_function"))
    is_module = np.zeros(n, dtype=bool)
    is_module[functions[module_names[codes[functions]]]] = True
    del functions
    compiled = np.flatnonzero(is_op & names_where(names, COMPILED_REGION))
    module, folded = _fold_compiled(trace, events["module"].to_numpy(), is_module, compiled)
    if folded is not None:
        is_module &= ~folded
    del folded
    is_bwd = names_where(names, BACKWARD_OP)
    fwd_tid = events["fwd_tid"].array  # (> 0 where known: read at the rows that have one)
    known = np.flatnonzero(~np.asarray(fwd_tid.isna(), dtype=bool))
    if known.size:
        is_bwd[known[np.asarray(fwd_tid[known].to_numpy(dtype=np.int64)) > 0]] = True
    del known
    is_bwd &= is_op
    root, roots = _backward_roots(parent, depth, is_bwd, module, thread_order(trace))
    # per outermost backward op (``roots``): the layer of its forward op, and whether a flow linked it
    matched = np.full(roots.size, -1, dtype=np.int64)
    linked = np.zeros(roots.size, dtype=bool)
    if flows and roots.size:
        at, fwd = _flow_links(trace, root, is_op)
        where = np.searchsorted(roots, at)  # (each end's outermost backward op is one of ``roots``)
        linked[where] = True
        matched[where] = np.where(fwd >= 0, module[np.maximum(fwd, 0)], -1)
    seq = events["seq"].array
    unlinked = roots[~linked]
    unlinked = unlinked[np.asarray(seq[unlinked].to_numpy(dtype=np.int64, na_value=-1)) >= 0]
    if unlinked.size:
        seq_all = seq.to_numpy(dtype=np.int64, na_value=-1)
        forward = np.flatnonzero(is_op & ~is_bwd & (seq_all >= 0) & (root < 0))
        if forward.size:
            ts = events["ts"].to_numpy()
            rank = events["rank"].to_numpy()
            left = pd.DataFrame(
                {"ts": ts[unlinked], "rank": rank[unlinked].astype(np.int64), "seq": seq_all[unlinked], "row": unlinked}
            )
            right = pd.DataFrame(
                {
                    "ts": ts[forward],
                    "rank": rank[forward].astype(np.int64),
                    "seq": seq_all[forward],
                    "fwd": module[forward],
                }
            )
            joined = pd.merge_asof(
                left.sort_values("ts", kind="stable"),
                right.sort_values("ts", kind="stable"),
                on="ts",
                by=["rank", "seq"],
                direction="backward",
            )
            found = np.searchsorted(roots, joined["row"].to_numpy())
            matched[found] = joined["fwd"].fillna(-1).to_numpy(dtype=np.int64)
        del seq_all, forward
    del is_bwd, unlinked
    backward = root >= 0
    layer = narrow_rows(module)
    if layer is module:  # (a copy: ``module`` is the events' column)
        layer = module.copy()
    inside = np.flatnonzero(backward)
    if inside.size:  # each backward row gets its outermost backward op's layer
        of_root = np.full(n, -1, dtype=layer.dtype)
        of_root[roots] = matched
        layer[inside] = of_root[root[inside]]
        del of_root
    del inside, matched
    root = narrow_rows(root)
    module_parent = np.full(n, -1, dtype=layer.dtype)  # (the dtype ``narrow_rows`` gives rows of n events)
    held = np.flatnonzero(is_module)
    held = held[parent[held] >= 0]
    module_parent[held] = module[parent[held]]
    return Attribution(layer, backward, root, is_module, module_parent, in_scope(events), compiled)


def _backward_roots(
    parent: np.ndarray, depth: np.ndarray, is_bwd: np.ndarray, module: np.ndarray, order: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per events row, the outermost backward op enclosing it (itself included) where that
    one lies in no module event, else -1; and the rows of those ops (the roots), ascending.

    A root is a backward op in no other and in no module event, so a row's root is its
    outermost enclosing backward op where that one is outside modules: one C pass
    (``_nesting.outermost`` over the backward ops outside modules, of which the outermost is
    that op where it is outside modules, else none) where the extension is built, else
    numpy's two propagations (the same rows). ``order``: the nesting walk's order
    (``thread_order``), where each parent comes before its children: then the C pass goes
    down it once (``_nesting.propagate_pair``) instead of climbing from every row.
    """
    nesting = structure._nesting
    if nesting is not None and parent.dtype == np.int64:
        anchor = is_bwd & (module < 0)
        root = np.empty(parent.size, dtype=np.int64)
        walked = (
            order is not None
            and order.dtype in (np.int32, np.int64)
            and order.flags.c_contiguous
            and nesting.propagate_pair(
                order, order.dtype == np.int64, parent, anchor.view(np.uint8), b"", True, root, bytearray()
            )
        )
        if not walked:
            nesting.outermost(parent, anchor.view(np.uint8), root)
        roots = np.flatnonzero(anchor)
        return root, roots[root[roots] == roots]
    bwd_rows = np.flatnonzero(is_bwd)
    is_root = np.zeros(parent.size, dtype=bool)
    is_root[bwd_rows[(enclosing_of_kind(parent, depth, is_bwd, bwd_rows) < 0) & (module[bwd_rows] < 0)]] = True
    return propagate(parent, depth, is_root), np.flatnonzero(is_root)


def _fold_compiled(
    trace: TraceTables, module: np.ndarray, is_module: np.ndarray, compiled: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """Fold the module events of compiled code into the layer they belong to.

    Folded: the model event directly inside its ``OptimizedModule`` event when both have
    the same layer name (the capture names both by the user's path), and every module event
    inside a ``Torch-Compiled Region`` op (dynamo's own ``GraphModule``) that has an
    enclosing module event.

    Args:
        module: per events row, the innermost enclosing ``nn.Module`` event (itself included).
        is_module: per events row, whether it is an ``nn.Module`` event.
        compiled: the rows of the ``Torch-Compiled Region`` ops.

    Returns:
        ``module`` with each folded event replaced by the event it folds into, and the mask
        of folded rows (None where none is folded: ``module`` is returned as given).
    """
    events = trace.events
    rows = np.flatnonzero(is_module)
    parent = events["parent"].to_numpy()
    up = np.where(parent[rows] >= 0, module[np.maximum(parent[rows], 0)], -1)
    keep = up >= 0
    rows, up = rows[keep], up[keep]
    if not rows.size:
        return module, None
    fold = names_match_at(events["name"], COMPILED_WRAPPER, up)
    if fold.any():  # the layer names compared only inside a wrapper (none without torch.compile)
        inside = np.flatnonzero(fold)
        layer, _ = layers_at(trace, rows[inside])
        up_layer, _ = layers_at(trace, up[inside])
        fold[inside] = layer == up_layer
    if compiled.size:
        region = np.zeros(len(events), dtype=bool)
        region[compiled] = True
        fold |= enclosing_of_kind(parent, events["depth"].to_numpy(), region, rows) >= 0
    if not fold.any():
        return module, None
    folded = np.zeros(len(events), dtype=bool)
    folded[rows[fold]] = True
    into = np.arange(len(events))
    into[rows[fold]] = up[fold]
    while True:  # a chain of folds ends at the first event that stays a layer
        again = into[into]
        if np.array_equal(again, into):
            break
        into = again
    return np.where(module >= 0, into[np.maximum(module, 0)], -1), folded


def _flow_links(trace: TraceTables, root: np.ndarray, is_op: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The outermost backward ops linked to a forward op by a ``fwdbwd`` flow, and that
    forward op's row (-1: linked, but to no forward op), one pair per flow in flow order
    (an op linked by several flows: the last pair holds).

    The flow end is located on the CPU op at its (rank, pid, tid, ts), the flow start on
    the forward op there, and the end's outermost backward op gets the start's op. A start
    that lands on no op, or inside backward work, gives -1. Vectorized: one
    ``searchsorted`` per thread.
    """
    events = trace.events
    no_links = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    flows = trace.flows
    if flows.empty or "cat" not in flows:
        return no_links
    # (on the categories: a categorical compared per row goes through pandas)
    wanted = per_code(flows["cat"], lambda values: values == "fwdbwd", False) & flows["id"].notna().to_numpy()
    fwdbwd = flows if wanted.all() else flows[wanted]  # (a trace's flows are often all fwdbwd ones)
    if fwdbwd.empty:
        return no_links
    at = enclosing_at(trace, flow_thread_keys(events, fwdbwd), fwdbwd["ts"].to_numpy(dtype=np.float64), is_op)
    # a flow is its (rank, id); the first start and the first end of each, paired in the
    # order of the ends (an inner merge of the two de-duplicated, without building frames)
    flow, first = group_rows(fwdbwd["rank"].to_numpy(), fwdbwd["id"].to_numpy(dtype=np.int64))  # (ids all known)
    none = len(flow)
    start = np.full(len(first), none, dtype=np.int64)
    starts = np.flatnonzero(per_code(fwdbwd["ph"], lambda values: values == "s", False))
    np.minimum.at(start, flow[starts], starts)
    finish = np.full(len(first), none, dtype=np.int64)
    ends = np.flatnonzero(per_code(fwdbwd["ph"], lambda values: values == "f", False))
    np.minimum.at(finish, flow[ends], ends)
    ends = ends[(finish[flow[ends]] == ends) & (start[flow[ends]] < none)]
    bwd = at[ends].astype(np.int64, copy=False)
    fwd = at[start[flow[ends]]].astype(np.int64, copy=False)
    bwd_root = np.where(bwd >= 0, root[np.maximum(bwd, 0)], -1)
    fwd = np.where((fwd >= 0) & (root[np.maximum(fwd, 0)] < 0), fwd, -1)
    keep = bwd_root >= 0
    return bwd_root[keep], fwd[keep]
