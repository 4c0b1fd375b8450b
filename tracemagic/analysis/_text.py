"""Numbers as short text (``12.3 ms``, ``1.5 GiB``, ``40%``): the advice's evidence
(``analysis.advice``) and every view use these same functions, so a figure reads the same
wherever it is quoted."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pandas as pd

#: display units for times: name -> divisor from µs
UNITS: dict[str, float] = {"µs": 1.0, "ms": 1000.0, "s": 1_000_000.0}


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


def fmt_count(value: float) -> str:
    """A mean count as text: whole where it is (to 0.05), else to one decimal (``2,047.5``)."""
    return f"{value:,.0f}" if abs(value - round(value)) < 0.05 else f"{value:,.1f}"


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


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis."""
    text = str(text)
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


#: a float literal in an op's constant inputs (``0.10000000000000001``, ``1e-05``), not an integer
_FLOAT = re.compile(r"(?<![\w.])-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")


def _short_float(match: re.Match[str]) -> str:
    value = float(match.group(0))
    short = f"{value:.6g}"
    return repr(value) if float(short) == value else short


def fmt_dtypes(value: Any) -> str:
    """An op's input dtypes or constant inputs as the trace writes them (JSON text,
    ``["float", "float", "", "Scalar"]``) as a short list: ``float, float, –, Scalar``
    (``–``: an input that is no tensor, such as ``None``). Floats written with 17 digits
    (``0.10000000000000001``, ``1.0000000000000001e-05``) read as Python prints them (``0.1``,
    ``1e-05``), or to 6 significant digits; other text is returned as it is."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = str(value)
    if not text.startswith("["):
        return text
    try:
        items = json.loads(text)
    except ValueError:
        return text
    if not isinstance(items, list):
        return text
    return ", ".join((_FLOAT.sub(_short_float, str(v)) if v not in ("", None) else "–") for v in items)
