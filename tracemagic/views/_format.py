"""Escaping and number formatting shared by every view.

Every string that comes from a trace (op, kernel and layer names, shapes, file names)
passes through :func:`esc` before it reaches HTML or a plotly label: plotly renders a
subset of HTML in labels and hover text, and an ipywidgets ``HTML`` widget sets
``innerHTML``.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

# the number formats are the analyses' own (``analysis._text``: the advice quotes figures with them)
from tracemagic.analysis._text import UNITS as UNITS
from tracemagic.analysis._text import fmt_bytes as fmt_bytes
from tracemagic.analysis._text import fmt_count as fmt_count
from tracemagic.analysis._text import fmt_dtypes as fmt_dtypes
from tracemagic.analysis._text import fmt_pct as fmt_pct
from tracemagic.analysis._text import fmt_time as fmt_time
from tracemagic.analysis._text import shorten as shorten
from tracemagic.analysis._text import unit_divisor as unit_divisor


def esc(value: Any) -> str:
    """Text safe for HTML and plotly labels: ``<``, ``>``, ``&`` and quotes escaped. A double
    quote is ``&#34;``, not ``&quot;``: plotly decodes numeric entities in labels and hover
    text but not ``&quot;``, which a hover would show as it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    return html.escape(str(value), quote=True).replace("&quot;", "&#34;")


def esc_all(values: Iterable[Any]) -> list[str]:
    """:func:`esc` over a column."""
    return [esc(v) for v in values]


#: columns of numbers that name something (a step, a rank, an id): printed without thousands separators
PLAIN_COLUMNS = frozenset({"step", "rank", "id", "iteration", "tid", "pid", "stream", "device_id", "step_id", "line"})


def step_name(step: Any) -> str:
    """A step's label: ``step 12``; the one span of a trace without ProfilerStep (step -1)
    is ``whole trace``, never ``step -1``."""
    return f"step {int(step)}" if int(step) >= 0 else "whole trace"


def in_step(step: Any) -> str:
    """A title's ending for the step shown: `` in step 12``, `` in the whole trace`` (step -1,
    see :func:`step_name`), nothing for all steps (None)."""
    if step is None:
        return ""
    return f" in step {int(step)}" if int(step) >= 0 else " in the whole trace"


def fmt_cell(value: Any, plain: bool = False) -> str:
    """One table cell as plain text (numbers rounded, missing values blank; ``plain``: an
    integer without thousands separators, for ids such as step numbers)."""
    if value is None or value is pd.NA:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else ""
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isnan(number):
            return ""
        if number.is_integer() and abs(number) < 1e15:
            return f"{int(number)}" if plain else f"{int(number):,}"
        return f"{number:,.3f}" if abs(number) < 100 else f"{number:,.1f}"
    if isinstance(value, (int, np.integer)):
        return f"{int(value)}" if plain else f"{int(value):,}"
    return str(value)


_NAMESPACE = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


def kernel_label(name: str, limit: int = 60) -> str:
    """A GPU kernel's name short enough for a chart label or a terminal column: the
    ``void`` return type, the argument list and namespaces dropped, template arguments
    kept (they tell instances apart): ``void at::native::vectorized_elementwise_kernel<4,
    at::native::CUDAFunctor_add<float>, ...>(int, ...)`` becomes
    ``vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, ...>``; the parentheses
    of ``(anonymous namespace)`` (``void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>``)
    are a namespace, not the argument list. Names that are not C++ signatures (``Memcpy DtoD
    (Device -> Device)``, mangled names) are only cut; a label is never empty."""
    text = original = str(name).strip()
    if text.startswith("void "):
        text = text[5:].replace("(anonymous namespace)::", "")
        depth = 0
        for i, char in enumerate(text):
            if char == "<":
                depth += 1
            elif char == ">":
                depth -= 1
            elif char == "(" and depth == 0 and i:
                text = text[:i]
                break
        text = _NAMESPACE.sub("", text)
    elif re.fullmatch(r"[A-Za-z_]\w*\(.*\)", text, flags=re.S):  # a C function: ncclKernel_...(ncclDevComm*, ...)
        text = text[: text.index("(")]
    return shorten(text.strip() or original, limit)


def unique_labels(labels: Iterable[str]) -> list[str]:
    """``labels`` made distinct for a category axis, the first of each left as it is and
    the repeats numbered (``name (2)``), so bars whose shortened labels coincide stay apart."""
    seen: set[str] = set()
    out = []
    for label in labels:
        candidate, n = label, 1
        while candidate in seen:
            n += 1
            candidate = f"{label} ({n})"
        seen.add(candidate)
        out.append(candidate)
    return out


#: the names of table columns as the views show them (the frames keep their own names,
#: ``analysis.schema``); a time column's unit comes from its suffix (``_ms`` -> "(ms)")
HEADERS: dict[str, str] = {
    "rank": "Rank",
    "ts": "Start",
    "dur": "Duration",
    "window_ts": "Device window start",
    "window_dur": "Device window",
    "compute": "GPU kernels",
    "comm": "Communication",
    "memcpy": "Memcpy",
    "memset": "Memset",
    "runtime": "CUDA runtime",
    "dataloader": "DataLoader",
    "cpu": "CPU",
    "idle": "Idle",
    "gpu_busy": "GPU busy",
    "gpu_idle": "GPU idle",
    "kernel_busy": "Kernels busy",
    "gpu_busy_pct": "GPU busy %",
    "name": "Name",
    "kind": "Kind",
    "calls": "Calls",
    "total": "Total",
    "self": "Self",
    "mean": "Mean",
    "max": "Max",
    "self_pct": "Self %",
    "pct": "% of GPU time",
    "op": "Op",
    "layer": "Layer",
    "type": "Type",
    "depth": "Depth",
    "self_cpu": "Self CPU",
    "fwd_cpu": "Forward CPU",
    "fwd_self_cpu": "Forward self CPU",
    "bwd_cpu": "Backward CPU",
    "bwd_self_cpu": "Backward self CPU",
    "gpu": "GPU",
    "self_gpu": "Self GPU",
    "fwd_gpu": "Forward GPU",
    "bwd_gpu": "Backward GPU",
    "tflops_per_s": "TFLOP/s",
    "tbytes_per_s": "TB/s",
    "memory_bound_pct": "Memory-bound %",
    "memory_growth_bytes": "Memory growth (bytes)",
    "input_shapes": "Input shapes",
    "module": "Trace module",
    "device": "Device",
    "bytes": "Bytes",
    "addr": "Address",
    "phase": "Phase",
    "freed_ts": "Freed at",
    "lifetime": "Lifetime",
    "input_dims": "Input shapes",
    "input_type": "Dtypes",
    "precision": "Ran in",
    "concrete_inputs": "Constant inputs",
    "flops": "FLOPs",
    "flops_source": "FLOPs from",
    "intensity": "FLOP/byte",
    "peak_tflops": "Peak TFLOP/s",
    "peak_tbytes_per_s": "Peak TB/s",
    "bound": "Bound",
    "pct_of_roofline": "% of roof",
    "level": "Level",
    "op_schema": "Op schema",
    "input_types": "Dtypes",
    "reads_from": "Reads from",
    "feeds": "Feeds",
    "calls_a": "Calls A",
    "calls_b": "Calls B",
    "us_a": "A (µs)",
    "us_b": "B (µs)",
    "delta": "Change",
    "delta_pct": "Change %",
    "status": "Status",
    "straggler": "Straggler",
    "gpu_idle_pct": "GPU idle %",
    "steps": "Steps",
    "step": "Step",
    "overlap_pct": "Overlap %",
    "wait": "Wait",
    "straggler_steps": "Straggler steps",
    "slowest": "Slowest",
    "kernel": "Kernel",
    "signature": "Full name",
    "alloc_bytes": "Allocated (bytes)",
    "function": "Function",
    "file": "File",
    "line": "Line",
    "user": "User code",
    "where": "Where (your code)",
    "kernel_file": "Kernel file",
    "compiled_region": "Compiled region",
    "ratio": "Ratio B/A",
    "a": "A",
    "b": "B",
    "gpu_a": "GPU A",
    "gpu_b": "GPU B",
    "gpu_us_a": "GPU A (µs)",
    "gpu_us_b": "GPU B (µs)",
}
_UNIT_SUFFIXES = {"_ms": "ms", "_us": "µs", "_s": "s"}


def header(column: object) -> str:
    """A table column's header: its human name with the unit (``self_ms`` -> ``Self (ms)``,
    ``self_pct`` -> ``Self %``); a name this module does not know reads as words."""
    name = str(column)
    if name in HEADERS:  # a name of its own (``tflops_per_s`` is no time in seconds)
        return HEADERS[name]
    unit = ""
    for suffix, text in _UNIT_SUFFIXES.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            name, unit = name[: -len(suffix)], text
            break
    label = HEADERS.get(name)
    if label is None:
        words = name.replace("_", " ").strip()
        label = words[:1].upper() + words[1:] if words else str(column)
        if label.endswith(" pct"):
            label = label[:-4] + " %"
    return f"{label} ({unit})" if unit else label
