"""tracemagic: the notebook-native profiler for PyTorch.

``%load_ext tracemagic`` registers ``%%chakra_trace`` (capture a cell's step loop with
torch.profiler) and ``%chakra_report`` (show any Kineto trace). ``tracemagic.load`` turns
any Kineto trace into pandas tables; ``tracemagic.load_ranks`` summarizes a whole job's
ranks, on a Dask cluster if given one.

The heavy parts (torch, pandas, plotly, ipywidgets) are imported lazily, on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tracemagic._version import __version__
from tracemagic.errors import CaptureError, TraceError

if TYPE_CHECKING:  # pragma: no cover - what type checkers see of the lazy names below
    from tracemagic.capture.api import capture
    from tracemagic.export.chisel import capture_model, parse_model_trace
    from tracemagic.job import Ranks, load_ranks
    from tracemagic.trace import Trace, load

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

# public name -> module that defines it (imported on first access)
_LAZY = {
    "Trace": "tracemagic.trace",
    "capture": "tracemagic.capture",  # the subpackage itself, callable: capture(**options)
    "capture_model": "tracemagic.export.chisel",
    "load": "tracemagic.trace",
    "load_ranks": "tracemagic.job",
    "Ranks": "tracemagic.job",
    "parse_model_trace": "tracemagic.export.chisel",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tracemagic' has no attribute {name!r}")
    imported = import_module(module)
    value = imported if module == f"{__name__}.{name}" else getattr(imported, name)
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
