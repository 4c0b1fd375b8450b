"""tracemagic: the notebook-native profiler for PyTorch.

``%load_ext tracemagic`` registers ``%%chakra_trace`` (capture a cell's step loop with
torch.profiler) and ``%chakra_report`` (show any Kineto trace). ``tracemagic.load`` turns
any Kineto trace into pandas tables; ``tracemagic.load_ranks`` summarizes a whole job's
ranks, on a Dask cluster if given one.

The heavy parts (torch, pandas, plotly, ipywidgets) are imported lazily, on first use.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

import tracemagic.capture as _capture_package  # light: its names import on first use
from tracemagic._version import __version__
from tracemagic.errors import CaptureError, TraceError

if TYPE_CHECKING:  # pragma: no cover - what type checkers see of the lazy names below
    from tracemagic.export.chisel import capture_model, parse_model_trace
    from tracemagic.facade import Trace, load
    from tracemagic.job import Ranks, load_ranks
    from tracemagic.script import ScriptCapture as _ScriptCapture
    from tracemagic.script import capture

__all__ = [
    "CaptureError",
    "Ranks",
    "Trace",
    "TraceError",
    "__version__",
    "capture",
    "capture_model",
    "load",
    "load_ipython_extension",
    "load_ranks",
    "parse_model_trace",
    "unload_ipython_extension",
]

#: the public names imported on first access (the heavy parts load only when used)
_LAZY = ("Ranks", "Trace", "capture_model", "load", "load_ranks", "parse_model_trace")


class _CallableCapture(ModuleType):
    """The ``tracemagic.capture`` package, callable: ``tracemagic.capture(**options)`` is
    ``tracemagic.script.capture`` (the script adapter, in the top layer, which the package
    below it may not import). Installed here, as ``tracemagic`` is imported before any of
    its subpackages: ``import tracemagic.capture`` and ``from tracemagic import capture``
    give the same callable package."""

    def __call__(self, **options: Any) -> _ScriptCapture:
        from tracemagic.script import capture as script_capture

        return script_capture(**options)


#: diagnostics for developers go to the ``tracemagic`` logger (each module logs to its own
#: child, ``tracemagic.trace.loader`` ...): silent unless the application configures logging
#: (``logging.getLogger("tracemagic").setLevel(logging.DEBUG)`` and a handler) or
#: ``TRACEMAGIC_LOG=debug`` (or ``info``) asks for them on stderr
_logger = logging.getLogger(__name__)
_logger.addHandler(logging.NullHandler())
_level = os.environ.get("TRACEMAGIC_LOG", "").strip().upper()
if _level:
    _stderr = logging.StreamHandler()
    _stderr.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    _logger.addHandler(_stderr)
    _logger.setLevel(_level if _level in logging.getLevelNamesMapping() else logging.DEBUG)

_capture_package.__class__ = _CallableCapture
del _capture_package  # it stays ``tracemagic.capture``


def __getattr__(name: str) -> Any:
    """``_LAZY``'s names, each imported by an import statement a tool can see."""
    value: Any
    if name in ("Trace", "load"):
        from tracemagic import facade

        value = getattr(facade, name)
    elif name in ("Ranks", "load_ranks"):
        from tracemagic import job

        value = getattr(job, name)
    elif name in ("capture_model", "parse_model_trace"):
        from tracemagic.export import chisel

        value = getattr(chisel, name)
    else:
        raise AttributeError(f"module 'tracemagic' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """Register the tracemagic magics on an IPython shell (idempotent)."""
    from tracemagic.magics import register

    register(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing to undo: magics stay registered, like other extensions."""
