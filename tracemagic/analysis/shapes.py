"""``shapes()``: CPU ops grouped by name, input shapes and dtypes, with FLOPs where shapes fix them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from tracemagic.analysis._common import GPU_ACTIVITY, rollup, text
from tracemagic.trace.model import Trace

Dims = list[list[int]]


def _matrix(a: list[int], b: list[int]) -> float | None:
    """2·M·N·K of ``a @ b`` with torch.matmul's broadcasting (1-D operands included)."""
    if not a or not b:
        return None
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        return None
    batch = np.broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2]))
    return 2.0 * math.prod(batch) * a2[-2] * b2[-1] * a2[-1]


def _mm(dims: Dims) -> float | None:
    return _matrix(dims[0], dims[1]) if len(dims) >= 2 else None


def _addmm(dims: Dims) -> float | None:
    return _matrix(dims[1], dims[2]) if len(dims) >= 3 else None


def _linear(dims: Dims) -> float | None:
    if len(dims) < 2 or not dims[0] or len(dims[1]) != 2 or dims[0][-1] != dims[1][1]:
        return None
    return 2.0 * math.prod(dims[0][:-1]) * dims[1][0] * dims[1][1]


def _convolution(dims: Dims) -> float | None:
    """2 · N · C_out · (C_in / groups) · kernel volume · output positions.

    The output size is not in ``Input Dims``; it is taken equal to the input's spatial
    size ('same' padding, stride 1), an estimate for strided or unpadded convolutions.
    """
    if len(dims) < 2 or len(dims[0]) < 3 or len(dims[1]) != len(dims[0]):
        return None
    x, w = dims[0], dims[1]
    return 2.0 * x[0] * w[0] * w[1] * math.prod(w[2:]) * math.prod(x[2:])


def _attention(dims: Dims) -> float | None:
    """QKᵀ and PV: 2·B·L·S·E + 2·B·L·S·Eᵥ for q [.., L, E], k [.., S, E], v [.., S, Eᵥ]."""
    if len(dims) < 3 or min(len(d) for d in dims[:3]) < 2:
        return None
    q, k, v = dims[0], dims[1], dims[2]
    batch = math.prod(q[:-2])
    return 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1])


#: op name -> FLOPs of one call from its input dims
FLOP_RULES: dict[str, Callable[[Dims], float | None]] = {
    "aten::mm": _mm,
    "aten::matmul": _mm,
    "aten::bmm": _mm,
    "aten::addmm": _addmm,
    "aten::baddbmm": _addmm,
    "aten::linear": _linear,
    "aten::convolution": _convolution,
    "aten::_convolution": _convolution,
    "aten::conv1d": _convolution,
    "aten::conv2d": _convolution,
    "aten::conv3d": _convolution,
    "aten::scaled_dot_product_attention": _attention,
    "aten::_scaled_dot_product_flash_attention": _attention,
    "aten::_scaled_dot_product_efficient_attention": _attention,
    "aten::_scaled_dot_product_cudnn_attention": _attention,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention,
}
#: rules whose result is an estimate (output size assumed)
ESTIMATED = {"aten::convolution", "aten::_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d"}


def flops(name: str, input_dims: str | None) -> float | None:
    """FLOPs of one call of op ``name`` with ``Input Dims`` text, None where shapes don't fix it."""
    rule = FLOP_RULES.get(name)
    if rule is None or not input_dims:
        return None
    try:
        dims = json.loads(input_dims)
        return rule(dims)
    except (ValueError, TypeError, IndexError):
        return None


def gpu_time(events: pd.DataFrame) -> np.ndarray:
    """Per events row: duration of the GPU work (kernels, memcpy, memset) launched inside it."""
    gpu = np.flatnonzero(events["kind"].isin(GPU_ACTIVITY).to_numpy() & (events["launch"] >= 0).to_numpy())
    return rollup(events["launch"].to_numpy()[gpu], events["dur"].to_numpy()[gpu], events["parent"].to_numpy())


def shapes(trace: Trace) -> pd.DataFrame:
    """CPU ops grouped by rank, name, input dims and input types, busiest first.

    Columns: ``rank``, ``name``, ``input_dims``, ``input_type`` (JSON text as recorded, NA
    without ``record_shapes``); ``calls``; ``total_us``, ``mean_us``, ``self_us`` (summed
    self time); ``gpu_us`` (kernels, memcpy and memset launched inside the calls, nested
    ops included); ``flops`` (per call: the trace's own ``flops`` arg when ``with_flops``
    wrote it, else computed from the shapes for matmul, linear, bmm, conv and attention
    ops, NA otherwise); ``tflops_per_s`` (calls × flops / time: GPU time where the op
    launched GPU work, else host time); ``flops_source``
    ('trace' | 'shapes' | 'estimate' for conv, whose output size is assumed equal to the
    input's). Nested ops each count their own FLOPs (``aten::linear`` and the
    ``aten::addmm`` inside it), so do not sum ``flops`` across rows.
    """
    events = trace.events
    picked = (events["kind"] == "cpu_op").to_numpy() & (events["ph"] == "X").to_numpy()
    ops = events.loc[picked, ["rank", "name", "input_dims", "input_type", "dur", "self_dur", "flops"]]
    ops["gpu_us"] = gpu_time(events)[picked]
    keys = ["rank", "name", "input_dims", "input_type"]
    grouped = ops.groupby(keys, observed=True, dropna=False, sort=False)
    table = grouped.agg(
        calls=("dur", "size"),
        total_us=("dur", "sum"),
        self_us=("self_dur", "sum"),
        gpu_us=("gpu_us", "sum"),
        trace_flops=("flops", "mean"),
    ).reset_index()
    table["mean_us"] = table["total_us"] / table["calls"]
    computed = [
        flops(str(name), None if pd.isna(dims) else str(dims))
        for name, dims in zip(table["name"], table["input_dims"], strict=True)
    ]
    computed = pd.Series(pd.array(computed, dtype="Float64"), index=table.index)
    own = table["trace_flops"].astype("Float64")
    table["flops"] = own.fillna(computed)
    source = np.where(own.notna(), "trace", np.where(computed.notna(), "shapes", None))
    source = np.where((source == "shapes") & table["name"].isin(ESTIMATED).to_numpy(), "estimate", source)
    table["flops_source"] = text(source)
    seconds = table["gpu_us"].where(table["gpu_us"] > 0, table["total_us"]) * 1e-6
    table["tflops_per_s"] = (table["flops"] * table["calls"] / seconds / 1e12).where(seconds > 0)
    for column in ("name", "input_dims", "input_type"):
        table[column] = text(table[column])
    columns = ["rank", *keys[1:], "calls", "total_us", "mean_us", "self_us", "gpu_us", "flops", "tflops_per_s", "flops_source"]
    return table[columns].sort_values(["rank", "total_us"], ascending=[True, False], kind="stable").reset_index(drop=True)
