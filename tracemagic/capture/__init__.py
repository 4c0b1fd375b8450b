"""Capture a cell's step loop with torch.profiler (the ``%%chakra_trace`` machinery).

``CaptureConfig`` validates the options, ``prepare_cell`` finds and steps the loop,
``CaptureSession`` runs the profiler and writes the files (the one core of the magic, of
scripts and of ``tracemagic run``), ``CaptureResult`` is what a capture left on disk. The names
are imported on first use (torch only with ``CaptureSession``), so importing the package
costs nothing: ``import tracemagic`` makes it callable as ``tracemagic.capture(**options)``
(``tracemagic.script.capture``, in the top layer).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - what type checkers see of the lazy names below
    from tracemagic.capture.config import CaptureConfig
    from tracemagic.capture.loop import LoopPlan, PreparedCell, prepare_cell
    from tracemagic.capture.result import CaptureResult
    from tracemagic.capture.session import CaptureSession

__all__ = ["CaptureConfig", "CaptureResult", "CaptureSession", "LoopPlan", "PreparedCell", "prepare_cell"]


def __getattr__(name: str) -> Any:
    """``__all__``'s names, each imported by an import statement a tool can see."""
    module: Any
    if name == "Capture":  # its name before issue 28's renames
        warnings.warn(
            "tracemagic.capture.Capture is deprecated: it is tracemagic.capture.CaptureResult.",
            DeprecationWarning,
            stacklevel=2,
        )
        from tracemagic.capture.result import CaptureResult

        return CaptureResult
    if name == "CaptureResult":
        from tracemagic.capture import result as module
    elif name == "CaptureConfig":
        from tracemagic.capture import config as module
    elif name in ("LoopPlan", "PreparedCell", "prepare_cell"):
        from tracemagic.capture import loop as module
    elif name == "CaptureSession":  # torch: imported on first use
        from tracemagic.capture import session as module
    else:
        raise AttributeError(f"module 'tracemagic.capture' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
