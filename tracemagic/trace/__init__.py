"""Loading Kineto traces into typed pandas tables (``load``, ``Trace``)."""

from tracemagic.trace.loader import load
from tracemagic.trace.model import Trace

__all__ = ["Trace", "load"]
