"""Reading the JSON files beside a trace (the Execution Trace, the Chakra check's inputs), plain or gzip."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from tracemagic.errors import TraceError

_GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: Path) -> tuple[bytes, bool]:
    """The file's content, gunzipped when it is gzip, and whether it was.

    Raises:
        TraceError: a gzip stream that is cut off or corrupt, naming the file.
    """
    raw = path.read_bytes()
    if raw[:2] != _GZIP_MAGIC:
        return raw, False
    try:
        return gzip.decompress(raw), True
    except (EOFError, OSError, zlib.error) as exc:
        raise TraceError(f"{path}: the gzip stream is cut off or corrupt ({exc}).", path=str(path)) from None
