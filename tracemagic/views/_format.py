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
from typing import Any, Iterable

import numpy as np
import pandas as pd

# the number formats are the analyses' own (``analysis._text``: the advice quotes figures with them)
from tracemagic.analysis._text import UNITS as UNITS
from tracemagic.analysis._text import fmt_bytes as fmt_bytes
from tracemagic.analysis._text import fmt_pct as fmt_pct
from tracemagic.analysis._text import fmt_time as fmt_time
from tracemagic.analysis._text import shorten as shorten
from tracemagic.analysis._text import unit_divisor as unit_divisor


def esc(value: Any) -> str:
    """Text safe for HTML and plotly labels: ``<``, ``>``, ``&`` and quotes escaped."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    return html.escape(str(value), quote=True)


def esc_all(values: Iterable[Any]) -> list[str]:
    """:func:`esc` over a column."""
    return [esc(v) for v in values]


def fmt_cell(value: Any) -> str:
    """One table cell as plain text (numbers rounded, missing values blank)."""
    if value is None or value is pd.NA:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else ""
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isnan(number):
            return ""
        if number.is_integer() and abs(number) < 1e15:
            return f"{int(number):,}"
        return f"{number:,.3f}" if abs(number) < 100 else f"{number:,.1f}"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
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
