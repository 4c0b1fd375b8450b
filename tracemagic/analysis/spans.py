"""``layer_spans()``: when each top-level layer ran, forward and backward, as time intervals.

The memory curve and the timeline mark these spans so a rise in memory can be read against
the layer that caused it. Forward spans are the layer's ``nn.Module`` events; backward
spans are runs of outermost autograd ops attributed to the layer (the attribution of
``layers()``: same sequence number as a forward op that ran inside it), merged while
consecutive backward ops belong to the same layer.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracemagic.analysis._common import layers_at, nesting_depth, text, trace_start
from tracemagic.analysis.attribution import attribution
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.model import TraceTables

COLUMNS = tuple(TABLES["layer_spans"].names)


@computes("layer_spans")
def layer_spans(trace: TraceTables, depth: int | None = None) -> pd.DataFrame:
    """Forward and backward time intervals of the top-level layers, per rank.

    Args:
        trace: a loaded trace (with ``nn.Module`` events: ``with_stack=True``).
        depth: the module depth to report (0 = outermost). Default per rank: 1 when a
            single module (the model) encloses all others, else 0.

    Returns:
        One row per span, ordered by rank and time: ``rank``, ``layer`` (model path from
        the capture, else ``Linear_0``), ``type``, ``phase`` ('forward' | 'backward'),
        ``ts`` (µs since the trace's start), ``dur``, ``step`` (-1 outside steps),
        ``calls`` (module calls or backward ops merged into the span). Empty (same
        columns) for a trace without module events.
    """
    events = trace.events
    empty = TABLES["layer_spans"].empty()
    if not len(events):
        return empty
    att = attribution(trace)
    up = att.module_parent
    modules = np.flatnonzero(att.is_module & (att.root < 0))
    if not modules.size:
        return empty
    rank = events["rank"].to_numpy().astype(np.int64)
    ts = events["ts"].to_numpy(dtype=float)
    dur = events["dur"].to_numpy(dtype=float)
    step = events["step"].to_numpy()
    codes = events["name"].cat.codes.to_numpy()
    mdepth = np.full(len(events), -1, dtype=np.int64)
    mdepth[modules] = nesting_depth(up, modules)
    target = {}
    for r in np.unique(rank[modules]):
        mine = modules[rank[modules] == r]
        top = mine[mdepth[mine] == 0]
        single_root = np.unique(codes[top]).size == 1 and (mdepth[mine] == 1).any()
        target[int(r)] = depth if depth is not None else (1 if single_root else 0)
    want = np.array([target.get(int(r), 0) for r in rank[modules]], dtype=np.int64)

    # the ancestor at the wanted depth of every module row (-1 when the row is above it)
    ancestor = np.full(len(events), -1, dtype=np.int64)
    at = modules.copy()
    level = mdepth[modules].copy()
    ok = level >= want
    while True:
        climb = ok & (level > want)
        if not climb.any():
            break
        at[climb] = up[at[climb]]
        level[climb] -= 1
    ancestor[modules[ok]] = at[ok]

    fwd = modules[ok & (mdepth[modules] == want)]
    roots = np.flatnonzero((att.root == np.arange(len(events))) & (att.module >= 0))
    owner = ancestor[att.module[roots]]
    roots, owner = roots[owner >= 0], owner[owner >= 0]
    parts = []
    if fwd.size:
        parts.append(
            pd.DataFrame(
                {
                    "rank": rank[fwd],
                    "owner": fwd,
                    "code": codes[fwd],
                    "phase": "forward",
                    "ts": ts[fwd],
                    "end": ts[fwd] + dur[fwd],
                    "step": step[fwd],
                }
            )
        )
    if roots.size:
        frame = pd.DataFrame(
            {
                "rank": rank[roots],
                "owner": owner,
                "code": codes[owner],
                "phase": "backward",
                "ts": ts[roots],
                "end": ts[roots] + dur[roots],
                "step": step[roots],
            }
        )
        frame = frame.sort_values(["rank", "ts"], kind="stable")
        # a new span starts where the layer (or rank, or step) changes between consecutive ops
        key = frame[["rank", "code", "step"]].to_numpy()
        run = np.r_[True, (key[1:] != key[:-1]).any(axis=1)].cumsum()
        parts.append(
            frame.assign(run=run)
            .groupby("run", sort=False)
            .agg(
                rank=("rank", "first"),
                owner=("owner", "first"),
                code=("code", "first"),
                phase=("phase", "first"),
                ts=("ts", "min"),
                end=("end", "max"),
                step=("step", "first"),
                calls=("ts", "size"),
            )
            .reset_index(drop=True)
        )
    spans = pd.concat(parts, ignore_index=True)
    if "calls" not in spans:
        spans["calls"] = 1
    spans["calls"] = spans["calls"].fillna(1).astype(np.int64)
    name, kind = layers_at(trace, spans["owner"].to_numpy())
    out = pd.DataFrame(
        {
            "rank": spans["rank"].to_numpy().astype(np.int32),
            "layer": text(name),
            "type": text(kind),
            "phase": spans["phase"].to_numpy(dtype=object),
            "ts": spans["ts"].to_numpy() - trace_start(trace),
            "dur": (spans["end"] - spans["ts"]).to_numpy(),
            "step": spans["step"].to_numpy(),
            "calls": spans["calls"].to_numpy(),
        }
    )
    return out.sort_values(["rank", "ts"], kind="stable").reset_index(drop=True)


__all__ = ["layer_spans"]
