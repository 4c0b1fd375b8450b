"""Exceptions tracemagic raises for bad input, each with a message that says what to do."""

from __future__ import annotations


class TracemagicError(Exception):
    """Base class of tracemagic's own errors."""


class TraceError(TracemagicError, ValueError):
    """A file could not be read as a Kineto trace.

    Attributes:
        path: the file concerned.
        offset: byte offset of the damage in the (decompressed) JSON, when known.
    """

    def __init__(self, message: str, path: object = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


class CaptureError(TracemagicError, RuntimeError):
    """A capture could not start or finish (bad options, profiler busy, unwritable directory)."""
