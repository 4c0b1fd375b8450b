"""Torch's native start/stop notices, kept out of the cell's output and recorded instead.

Kineto prints lines such as ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start``
at every profiler start and stop, the Execution Trace observer ``Enabling``/``Disabling
Execution Trace Observer``, and c10's CPU allocator, once per process, ``Memory block of
unknown size was allocated before the profiling started`` when a tensor made before the
capture is freed inside it (in the middle of the loop). All go straight to the process's
file descriptors, from C++. In JupyterLab they appear as a red stderr box under the
capture, as if something had failed, and ``-q`` cannot hide them.

``hush`` redirects file descriptors 1 and 2 around the profiler's own calls; ``Filter``
passes descriptor 2 through a pipe for the whole recording, line by line as it comes. Both
keep every line that is not one of these known notices (``hush`` writes them back to
``sys.stderr``, ``Filter`` to the original descriptor 2 at once) and collect the notices
for ``capture.json``.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import re
import select
import sys
import tempfile
import threading
from collections.abc import Iterator

#: the notices torch prints on its own at profiler start/stop: nothing the user must act on
KNOWN_NOTICES = (
    re.compile(r"^USDT:.*\]\s*profiler_(?:start|stop)\s*$"),
    re.compile(r"CPUAllocator.*allocated before the profil", re.IGNORECASE),
    re.compile(r"execution_trace_observer\.cpp:\d+\]\s*(?:Enabling|Disabling) Execution Trace Observer"),
)
#: the notices as one pattern (``is_notice``: one search per line, no Python loop; the
#: filter's thread runs while the profiler records, and its Python calls are recorded)
_ANY_NOTICE = re.compile(
    "|".join(f"(?i:{p.pattern})" if p.flags & re.IGNORECASE else f"(?:{p.pattern})" for p in KNOWN_NOTICES)
)
#: where ``Filter`` cuts what it reads into lines: after each newline or carriage return
_LINE_END = re.compile(rb"(?<=[\n\r])")
#: how long ``Filter`` holds an unfinished line (no newline or carriage return yet) before
#: passing it on: a progress bar's partial line is not held back longer than this (s)
PARTIAL_LINE_WAIT_S = 0.05


def is_notice(line: str) -> bool:
    """Whether ``line`` is one of torch's known start/stop notices."""
    return _ANY_NOTICE.search(line) is not None


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
        sink = tempfile.TemporaryFile()  # noqa: SIM115 - open across the yield, closed below
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


class Filter:
    """File descriptor 2 passed through a pipe while the profiler records: torch's known
    notices go to ``hidden``, every other line to the original descriptor 2 as it comes.

    A thread reads the pipe, so C++ output anywhere in the window (the CPU allocator's
    notice is printed when a tensor is freed, mid-loop) is filtered without holding the
    cell's output back: a line goes on at its newline or carriage return, an unfinished one
    after ``PARTIAL_LINE_WAIT_S``. :meth:`stop` puts descriptor 2 back and waits until the
    pipe is drained (a child process that inherited it, such as a DataLoader worker, may hold
    it open longer: the thread forwards its lines until it exits). Where descriptors cannot
    be redirected, nothing is filtered.
    """

    def __init__(self, hidden: list[str]) -> None:
        self.hidden = hidden
        self._saved: int | None = None
        self._closing = False
        self._drained = threading.Event()

    @property
    def active(self) -> bool:
        """Whether descriptor 2 is being filtered now."""
        return self._saved is not None

    def start(self) -> None:
        """Begin filtering descriptor 2 (idempotent)."""
        if self._saved is not None:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        opened: list[int] = []
        try:
            read, write = os.pipe()
            opened += [read, write]
            saved = os.dup(2)
            opened.append(saved)
            forward = os.dup(2)
            opened.append(forward)
            os.dup2(write, 2)
        except OSError:
            for fd in opened:
                with contextlib.suppress(OSError):
                    os.close(fd)
            return
        os.close(write)
        self._saved = saved
        self._closing = False
        self._drained = threading.Event()
        # a bare thread: ``threading.Thread.start`` waits until it runs (a wait on a busy
        # machine before the user's loop); ``_drained`` says when it is done
        _thread.start_new_thread(self._pump, (read, forward))

    def stop(self, timeout: float = 2.0) -> None:
        """Put descriptor 2 back and wait, up to ``timeout``, until the thread has passed on
        what was written (idempotent). The thread itself goes on until every writer has
        closed the pipe: a child process that inherited it (a DataLoader worker) may still
        write, and its lines still reach the original descriptor 2."""
        if self._saved is None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        self._closing = True
        with contextlib.suppress(OSError):
            os.dup2(self._saved, 2)  # closes this process's last write end
        with contextlib.suppress(OSError):
            os.close(self._saved)
        self._saved = None
        self._drained.wait(timeout)

    def _route(self, line: bytes, forward: int) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if text and is_notice(text):
            self.hidden.append(text)
            return
        with contextlib.suppress(OSError):
            os.write(forward, line)

    def _pump(self, read: int, forward: int) -> None:
        pending = b""
        try:
            while True:
                if not select.select([read], [], [], PARTIAL_LINE_WAIT_S)[0]:
                    if pending:
                        self._route(pending, forward)  # an unfinished line: pass it on
                        pending = b""
                    if self._closing:
                        self._drained.set()  # nothing more came: stop() may return
                    continue
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                pending += chunk
                lines = _LINE_END.split(pending)
                pending = lines.pop()  # '' after a terminator, else the unfinished line
                for line in lines:
                    self._route(line, forward)
            if pending:
                self._route(pending, forward)
        except (OSError, ValueError):  # pragma: no cover - select/read on a closed descriptor
            pass
        finally:
            self._drained.set()
            for fd in (read, forward):
                with contextlib.suppress(OSError):
                    os.close(fd)
