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

#: display units for times: name -> divisor from µs
UNITS: dict[str, float] = {"µs": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def esc(value: Any) -> str:
    """Text safe for HTML and plotly labels: ``<``, ``>``, ``&`` and quotes escaped."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    return html.escape(str(value), quote=True)


def esc_all(values: Iterable[Any]) -> list[str]:
    """:func:`esc` over a column."""
    return [esc(v) for v in values]


def unit_divisor(unit: str) -> float:
    """The divisor from µs to ``unit``.

    Raises:
        ValueError: an unknown unit.
    """
    try:
        return UNITS[unit]
    except KeyError:
        raise ValueError(f"unknown time unit {unit!r}; use one of {', '.join(UNITS)}") from None


def fmt_time(us: float | None, unit: str | None = None) -> str:
    """A duration in µs as short text (``12.3 ms``); ``unit`` forces the unit."""
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "–"
    if unit is None:
        unit = "s" if abs(us) >= 1e6 else "ms" if abs(us) >= 1e3 else "µs"
    value = us / unit_divisor(unit)
    return f"{value:,.3g} {unit}" if abs(value) < 100 else f"{value:,.0f} {unit}"


def fmt_bytes(n: float | None) -> str:
    """Bytes as short text (``1.5 GiB``)."""
    if n is None or (isinstance(n, float) and math.isnan(n)) or n is pd.NA:
        return "–"
    n = float(n)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:,.0f} {suffix}" if suffix == "B" else f"{n:,.1f} {suffix}"
        n /= 1024
    return f"{n:,.1f} TiB"  # pragma: no cover


def fmt_pct(fraction: float) -> str:
    """A fraction as a percentage (``40%``)."""
    if fraction is None or math.isnan(fraction):
        return "–"
    return f"{100 * fraction:.0f}%"


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


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis."""
    text = str(text)
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


_NAMESPACE = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


def kernel_label(name: str, limit: int = 60) -> str:
    """A GPU kernel's name short enough for a chart label or a terminal column: the
    ``void`` return type, the argument list and namespaces dropped, template arguments
    kept (they tell instances apart): ``void at::native::vectorized_elementwise_kernel<4,
    at::native::CUDAFunctor_add<float>, ...>(int, ...)`` becomes
    ``vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, ...>``. Names that are not
    C++ signatures (``Memcpy DtoD (Device -> Device)``, mangled names) are only cut."""
    text = str(name).strip()
    if text.startswith("void "):
        text = text[5:]
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
    return shorten(text, limit)


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
