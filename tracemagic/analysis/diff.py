"""``diff(a, b)``: two traces compared op by op, kernel by kernel and layer by layer.

Like HTA's trace diff and the TensorBoard plugin's Diff Run: each name's call count and
total time in ``a`` and ``b`` (all ranks together), with a verdict. Ops are compared by the
top op of each call chain (``_common.call_chains``, as in ``shapes()``), so one slower
convolution is one row, not four.
"""

from __future__ import annotations

import pandas as pd

from tracemagic.analysis._common import activity_rows, call_chains, codes_of, text
from tracemagic.analysis.kernels import kernels as kernels_table
from tracemagic.analysis.layers import layers as layers_table
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.analysis.shapes import gpu_time
from tracemagic.trace.model import TraceTables

#: relative change in time below which a name counts as ``same``
TOLERANCE = 0.05
_COLUMNS = TABLES["diff"].names


def _ops(trace: TraceTables) -> pd.DataFrame:
    """Per name of a call chain's top op: calls, total (inclusive) CPU time, and GPU time
    launched inside the chains."""
    events = trace.events
    rows, top = call_chains(trace)
    tops = rows[top == rows]
    codes, names = codes_of(events["name"])
    tops = tops[codes[tops] >= 0]  # a chain without a name is in no group, as groupby drops NA keys
    chains = pd.DataFrame(
        {
            "name": codes[tops],
            "dur": events["dur"].to_numpy()[tops],
            "gpu_us": gpu_time(events, tops, activity_rows(trace)),
        }
    )
    # grouped on the name codes (each group's rows in the same order as by text), named once per name
    table = chains.groupby("name").agg(calls=("dur", "size"), us=("dur", "sum"), gpu_us=("gpu_us", "sum"))
    table.index = pd.Index(names[table.index.to_numpy()], name="name").astype(str)
    return table.sort_index()


def _kernels(trace: TraceTables) -> pd.DataFrame:
    """Per GPU kernel / memcpy / memset name: calls and total GPU time."""
    kernels = trace.table(kernels_table)
    table = kernels.groupby("name", observed=True).agg(calls=("dur", "size"), us=("dur", "sum"))
    table.index = table.index.astype(str)
    table["gpu_us"] = table["us"]
    return table


def _layers(trace: TraceTables) -> pd.DataFrame:
    """Per layer: calls, CPU and GPU time (from ``layers()``), with the layer's type."""
    layers = trace.table(layers_table)
    return layers.groupby("layer").agg(
        type=("type", "first"), calls=("calls", "sum"), us=("cpu_us", "sum"), gpu_us=("gpu_us", "sum")
    )


def _compare(level: str, a: pd.DataFrame, b: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """One row per name of ``a`` or ``b`` (tables indexed by name with ``calls``, ``us``,
    ``gpu_us`` and optionally ``type``): both sides, the change and its verdict.

    ``added``/``removed`` mean present in only one table, not a call count of 0: a layer
    with backward time but no forward call in the steps is still there.
    """
    both = a.merge(b, how="outer", left_index=True, right_index=True, suffixes=("_a", "_b"), indicator="_side")
    out = pd.DataFrame(
        {
            "level": level,
            "name": both.index.astype(str),
            "type": text(both["type_a"].fillna(both["type_b"])) if "type_a" in both else text([None] * len(both)),
            "calls_a": both["calls_a"].fillna(0).astype("int64"),
            "calls_b": both["calls_b"].fillna(0).astype("int64"),
            "us_a": both["us_a"].fillna(0.0),
            "us_b": both["us_b"].fillna(0.0),
            "gpu_us_a": both["gpu_us_a"].fillna(0.0),
            "gpu_us_b": both["gpu_us_b"].fillna(0.0),
        }
    )
    out["delta_us"] = out["us_b"] - out["us_a"]
    out["ratio"] = out["us_b"] / out["us_a"].where(out["us_a"] > 0)
    status = pd.Series("same", index=out.index, dtype="str")
    status[out["ratio"] > 1 + tolerance] = "slower"
    status[out["ratio"] < 1 - tolerance] = "faster"
    side = both["_side"].to_numpy()
    status[side == "right_only"] = "added"
    status[side == "left_only"] = "removed"
    out["status"] = status
    return out


@computes("diff")
def diff(a: TraceTables, b: TraceTables, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """Compare trace ``b`` with trace ``a`` by op name, kernel name and layer.

    Args:
        a: the reference trace.
        b: the trace compared with it.
        tolerance: relative change in total time within which a name is ``same``.

    Returns:
        One row per (level, name): ``level`` (op | kernel | layer; kernel rows only when a
        trace has GPU activity, layer rows only when a trace has ``nn.Module`` events);
        ``name``; ``type`` (a layer's class, NA otherwise); ``calls_a``, ``calls_b``;
        ``us_a``, ``us_b`` (total µs over all ranks: inclusive CPU time for ops and layers,
        GPU time for kernels); ``delta_us`` (b - a); ``ratio`` (b / a, NaN when a is 0);
        ``status`` (added: only in b | removed: only in a | slower | faster | same);
        ``gpu_us_a``, ``gpu_us_b`` (GPU time launched inside the op's call chains, or by
        the layer). Op rows are the top ops of call chains (see ``shapes()``): a
        convolution is its ``aten::conv2d``, whose time holds the ops it runs. Rows are sorted
        by level, then by the size of the change.
    """
    parts = [_compare("op", _ops(a), _ops(b), tolerance)]
    if a.has_gpu or b.has_gpu:
        parts.append(_compare("kernel", _kernels(a), _kernels(b), tolerance))
    layers_a, layers_b = _layers(a), _layers(b)
    if len(layers_a) or len(layers_b):
        parts.append(_compare("layer", layers_a, layers_b, tolerance))
    out = pd.concat(parts, ignore_index=True)
    order = out["level"].map({"op": 0, "kernel": 1, "layer": 2})
    out = out.assign(_level=order, _size=out["delta_us"].abs())
    out = out.sort_values(["_level", "_size"], ascending=[True, False], kind="stable")
    return out[_COLUMNS].reset_index(drop=True)
