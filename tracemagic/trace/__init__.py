"""Loading Kineto traces into typed pandas tables (``load``, ``TraceTables``: the data).

``load`` and ``TraceTables`` are imported on first access, so the light modules here (``layout``,
``pairing``) cost nothing heavy (pandas) to the capture side that imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.loader import load
    from tracemagic.trace.model import TraceTables

__all__ = ["TraceTables", "load"]


def __getattr__(name: str) -> Any:
    value: Any
    if name == "load":
        from tracemagic.trace.loader import load as value
    elif name == "TraceTables":
        from tracemagic.trace.model import TraceTables as value  # noqa: N813 - the attribute asked for, by any name
    else:
        raise AttributeError(f"module 'tracemagic.trace' has no attribute {name!r}")
    globals()[name] = value
    return value
