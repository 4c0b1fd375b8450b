"""Torch's native start/stop notices, kept out of the cell's output and recorded instead.

Kineto prints lines such as ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start``
and ``CPUAllocator ... allocated before the profiling started`` straight to the process's
file descriptors at every profiler start and stop. In JupyterLab they appear as a red
stderr box under every capture, as if something had failed, and ``-q`` cannot hide them.
``hush`` redirects file descriptors 1 and 2 around those calls, keeps every line that is
not one of these known notices (written back to ``sys.stderr``), and collects the rest for
``capture.json``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

#: the notices torch prints on its own at profiler start/stop: nothing the user must act on
KNOWN_NOTICES = (
    re.compile(r"^USDT:.*\]\s*profiler_(?:start|stop)\s*$"),
    re.compile(r"CPUAllocator.*allocated before the profil", re.IGNORECASE),
)


def is_notice(line: str) -> bool:
    """Whether ``line`` is one of torch's known start/stop notices."""
    return any(pattern.search(line) for pattern in KNOWN_NOTICES)


@contextlib.contextmanager
def hush(hidden: list[str]) -> Iterator[None]:
    """Run the block with file descriptors 1 and 2 captured; known notices go to ``hidden``.

    Every other captured line is written to ``sys.stderr`` afterwards (the frontend's
    stream in a notebook), so nothing else is lost. Where the descriptors cannot be
    redirected (closed, or no OS support), the block runs unchanged.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved: list[tuple[int, int]] = []
    sink = None
    try:
        sink = tempfile.TemporaryFile()
        for fd in (1, 2):
            saved.append((fd, os.dup(fd)))
            os.dup2(sink.fileno(), fd)
    except OSError:
        _restore(saved)
        if sink is not None:
            sink.close()
        yield
        return
    try:
        yield
    finally:
        _restore(saved)
        sink.seek(0)
        text = sink.read().decode("utf-8", "replace")
        sink.close()
        kept: list[str] = []
        for line in text.splitlines():
            (hidden if is_notice(line) else kept).append(line)
        if kept:
            with contextlib.suppress(Exception):
                sys.stderr.write("\n".join(kept) + "\n")


def _restore(saved: list[tuple[int, int]]) -> None:
    for fd, copy in saved:
        with contextlib.suppress(OSError):
            os.dup2(copy, fd)
        with contextlib.suppress(OSError):
            os.close(copy)
