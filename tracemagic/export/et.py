"""Deprecated: ``tracemagic.export.et`` is now ``tracemagic.et`` (it reads, it does not export).

Importing this module warns once and gives ``tracemagic.et``'s names.
"""

from __future__ import annotations

import warnings

from tracemagic.et import ExecutionTrace, et_graph, et_ops, find_et, read_et

__all__ = ["ExecutionTrace", "et_graph", "et_ops", "find_et", "read_et"]

warnings.warn(
    "tracemagic.export.et is deprecated: import tracemagic.et instead (same functions).",
    DeprecationWarning,
    stacklevel=2,
)
