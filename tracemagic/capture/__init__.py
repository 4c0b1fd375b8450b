"""Capture a cell's step loop with torch.profiler (the ``%%chakra_trace`` machinery).

``CaptureConfig`` validates the options, ``prepare_cell`` finds and steps the loop,
``CaptureSession`` runs the profiler and writes the files, ``Capture`` is the result.
torch is imported only when ``CaptureSession`` is first used.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tracemagic.capture.config import CaptureConfig
from tracemagic.capture.loop import LoopPlan, PreparedCell, prepare_cell
from tracemagic.capture.result import Capture

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.capture.api import ScriptCapture
    from tracemagic.capture.session import CaptureSession

__all__ = ["Capture", "CaptureConfig", "CaptureSession", "LoopPlan", "PreparedCell", "prepare_cell"]


def __getattr__(name: str) -> Any:
    if name == "CaptureSession":  # torch: imported on first use
        from tracemagic.capture.session import CaptureSession

        return CaptureSession
    raise AttributeError(f"module 'tracemagic.capture' has no attribute {name!r}")


class _CallableModule(ModuleType):
    """This package is also ``tracemagic.capture(**options)`` (see ``capture.api``)."""

    def __call__(self, **options: Any) -> ScriptCapture:
        from tracemagic.capture.api import capture

        return capture(**options)


sys.modules[__name__].__class__ = _CallableModule
