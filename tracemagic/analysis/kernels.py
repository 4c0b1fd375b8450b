"""``kernels()``: every GPU kernel, memcpy and memset with the CPU op and layer that launched it."""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    activity_rows,
    column_at,
    is_nccl,
    kinds_at,
    labels,
    layer_labels,
    name_labels,
    trace_start,
)
from tracemagic.analysis.schema import computes
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.model import TraceTables
from tracemagic.trace.structure import timed_rows

#: the GPU activity kinds listed, in ``kind`` column order
KINDS = GPU_ACTIVITY


@computes("kernels")
def kernels(trace: TraceTables) -> pd.DataFrame:
    """GPU kernels, memcpy and memset, one row each, in the events table's order.

    The launching op and layer come from the runtime call that launched the activity
    (matched by correlation id when the trace was loaded): the op that shares the call's
    ``External id``, the TensorBoard plugin's link, right where the call runs on another
    thread or sits at an op's boundary; else the innermost op around the call on its thread.

    Columns: ``rank``; ``row`` (position in ``trace.events``); ``name``; ``kind`` (kernel |
    memcpy | memset); ``device``, ``stream``; ``ts`` (µs since the trace's start); ``dur``
    (µs); ``step`` (the launching call's step; -1 outside steps and where the trace holds
    no launching call, work in flight when profiling began, which ``steps()`` counts in no
    step); ``op`` (name of the CPU op that
    launched it, NA if unknown) and ``op_row``; ``layer``, ``layer_type`` (the enclosing
    ``nn.Module`` at launch, NA outside modules); ``correlation``; ``bytes`` (memcpy/memset
    size); ``grid``, ``block`` (JSON text); ``collective`` (NCCL kernels' ``Collective name``
    arg, when recorded); ``is_comm`` (an NCCL kernel). Text columns are categoricals.
    """
    events = trace.events
    # (a trace without GPU activity, a CPU one: no pass over the table)
    rows = timed_rows(events, KINDS) if activity_rows(trace).size else np.zeros(0, dtype=np.int64)

    def at(column: str) -> pd.api.extensions.ExtensionArray | np.ndarray:
        return column_at(events[column], rows)

    op_rows = at("op")
    layer, layer_type = layer_labels(trace, at("module"))
    names = at("name")
    kind = kinds_at(events, rows, KINDS)
    is_kernel = np.asarray(kind == "kernel")
    return pd.DataFrame(
        {
            "rank": at("rank"),
            "row": rows,
            "name": labels(names),
            "kind": kind,
            "device": at("device"),
            "stream": at("stream"),
            "ts": at("ts") - trace_start(trace),
            "dur": at("dur"),
            "step": at("step"),
            "op": name_labels(trace, op_rows),
            "op_row": op_rows,
            "layer": layer,
            "layer_type": layer_type,
            "correlation": at("correlation"),
            "bytes": at("bytes"),
            "grid": labels(at("grid")),
            "block": labels(at("block")),
            "collective": labels(at("collective")),
            "is_comm": is_kernel & is_nccl(pd.Series(names)) if is_kernel.any() else is_kernel,
        },
        copy=False,  # every column is made here
    )
