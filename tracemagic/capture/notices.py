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
from collections.abc import Callable, Iterator
from typing import TextIO

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
#: how long a filter's start waits for the reader (stuck writing to a descriptor 2 nobody
#: reads) before the capture goes on unfiltered
START_WAIT_S = 0.5
#: how long a filter's stop (or the sorting of torch's own notices) waits for the reader
STOP_WAIT_S = 2.0


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
    _flush(sys.stdout, sys.stderr)
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


def _flush(*streams: TextIO) -> None:
    """Flush Python's streams before descriptor 2 changes hands, so what they hold comes out
    first; a stream with nothing to send is left alone (ipykernel's ``OutStream``, whose
    ``_flush_pending`` says so: its ``flush()`` waits for a round trip through the kernel's
    IO thread, ~60 µs)."""
    for stream in streams:
        if getattr(stream, "_flush_pending", True) is False:
            continue
        with contextlib.suppress(Exception):
            stream.flush()


def _restore(saved: list[tuple[int, int]]) -> None:
    for fd, copy in saved:
        with contextlib.suppress(OSError):
            os.dup2(copy, fd)
        with contextlib.suppress(OSError):
            os.close(copy)


class Filter:
    """File descriptor 2 passed through a pipe while the profiler records: torch's known
    notices go to ``hidden``, every other line to the original descriptor 2 as it comes.

    One reader thread per process (``_Pump``, started by the first filter and kept: each
    capture then costs two ``dup``s and no thread start) reads the pipe, so C++ output
    anywhere in the window (the CPU allocator's notice is printed when a tensor is freed,
    mid-loop) is filtered without holding the cell's output back: a line goes on at its
    newline or carriage return, an unfinished one after ``PARTIAL_LINE_WAIT_S``.
    :meth:`stop` puts descriptor 2 back and passes on what is left in the pipe itself (no
    wait for the thread to be scheduled). A child process that inherited the pipe, such as
    a DataLoader worker, may write after that: the thread forwards its lines to the
    descriptor 2 of the latest filter. Torch's own start and stop calls run through
    :meth:`aside`: their notices go to a file of their own and are sorted right after the
    call, so the thread is not woken by them (it would take the GIL in the middle of the
    user's loop, and while torch records, its Python calls are events in the user's
    trace). Where descriptors cannot be redirected, or another filter is already on,
    nothing is filtered.
    """

    def __init__(self, hidden: list[str]) -> None:
        self.hidden = hidden
        self._saved: int | None = None
        #: whether descriptor 2 is being filtered now (an attribute, read without a call)
        self.active = False

    def start(self) -> None:
        """Begin filtering descriptor 2 (idempotent)."""
        if self._saved is not None:
            return
        _flush(sys.stdout, sys.stderr)
        try:
            pump = _Pump.get()
        except OSError:
            return
        if not pump.lock.acquire(timeout=START_WAIT_S):  # the reader stuck writing: unfiltered
            return
        try:
            if pump.filtering:  # another filter is on: descriptor 2 is its pipe already
                return
            try:
                saved = os.dup(2)
            except OSError:
                return
            try:
                os.dup2(pump.write, 2)
            except OSError:
                os.close(saved)
                return
            pump.attach(self.hidden, saved)
        finally:
            pump.lock.release()
        self._saved = saved
        self.active = True

    def aside(self, call: Callable[[], None]) -> None:
        """Run ``call`` (torch's profiler start or stop, which print their notices) with
        descriptor 2 on the pump's file of its own (``_Pump.sink``), then sort what it
        printed at once: notices to ``hidden``, any other line to the original descriptor 2,
        as the reader does. The reader thread is not woken (``aside`` runs no Python call
        of its own between the call and putting descriptor 2 back: inside a recording
        window each call is an event in the user's trace). A file, not a pipe: a write
        never blocks, however much is printed. Where descriptor 2 cannot be moved, or the
        filter is off, ``call`` runs as it is."""
        pump = _Pump._instance
        sink = pump.sink if pump is not None and self.active else None
        try:
            if sink is None:
                raise OSError
            os.dup2(sink, 2)
        except OSError:
            call()
            return
        try:
            call()
        finally:
            os.dup2(pump.write, 2)  # type: ignore[union-attr]
            pump.sort_sink()  # type: ignore[union-attr]

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Put descriptor 2 back and pass on what was written before (idempotent): by the
        time it returns, every line written before it has been passed on or kept as a
        notice, unless the thread holds the pipe longer than ``timeout`` (stuck writing to
        a descriptor 2 nobody reads): it passes them on itself then."""
        saved = self._saved
        if saved is None:
            return
        _flush(sys.stderr)
        pump = _Pump.get()
        with contextlib.suppress(OSError):
            os.dup2(saved, 2)  # what this process writes now goes straight to the original
        self._saved = None
        self.active = False
        try:
            got = pump.lock.acquire(timeout=timeout)
        except BaseException:  # interrupted while waiting: later captures must still filter
            pump.filtering = False
            raise
        if not got:
            pump.filtering = False  # the next filter may start; the thread routes the rest
            return
        try:
            pump.drain(final=True)  # the pipe's bytes, all written before the dup2 returned
        finally:
            pump.filtering = False
            pump.lock.release()


#: the size past which ``_Pump.sort_sink`` empties its file (a few hundred bytes a capture)
_SINK_KEPT = 1 << 16
#: bytes read from the pipe at a time
_CHUNK = 1 << 16
#: an unfinished line this long is passed on as it is (its end may never come)
_LONGEST_LINE = 1 << 20


def _pipe_capacity(fd: int) -> int:
    """The bytes a pipe holds (Linux's ``F_GETPIPE_SZ``; else 1 MiB, Linux's most without
    privileges): the most that can have been written to it and not read yet."""
    try:
        import fcntl

        return max(int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)), _CHUNK)
    except (ImportError, AttributeError, OSError):  # pragma: no cover - not Linux
        return 1 << 20


class _Pump:
    """The process's pipe and its reader thread (``Filter``): routes each line to the
    current filter's ``hidden`` list (a known notice) or its saved descriptor 2."""

    _instance: _Pump | None = None

    @classmethod
    def get(cls) -> _Pump:
        """The process's pump, made (pipe and thread) on first use."""
        pump = cls._instance
        if pump is None:
            pump = cls._instance = cls()
        return pump

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)  # drained by the thread or by stop(): never blocks
        self.capacity = _pipe_capacity(self.read)
        self.lock = threading.Lock()
        self.filtering = False
        self.hidden: list[str] = []
        self.forward: int | None = None  # the latest filter's original descriptor 2
        self.pending = b""  # an unfinished line
        self.sink = _sink()  # where ``Filter.aside`` points descriptor 2 (None: no such file)
        self.sunk = 0  # the sink's bytes routed so far
        # a bare thread: ``threading.Thread.start`` waits until it runs (a wait on a busy
        # machine before the user's loop), and this one lives as long as the process
        _thread.start_new_thread(self._run, ())

    def attach(self, hidden: list[str], forward: int) -> None:
        """Route to a new filter's list and descriptor (under ``lock``)."""
        old = self.forward
        self.hidden, self.forward, self.filtering = hidden, forward, True
        if old is not None:
            with contextlib.suppress(OSError):
                os.close(old)

    def drain(self, final: bool = False) -> None:
        """Read what the pipe holds and route its complete lines as each chunk comes (under
        ``lock``); with ``final`` (``stop``), up to the pipe's capacity (every byte written
        before it, whatever a writer that goes on adds) and an unfinished last line too;
        else one chunk, so that the thread lets go of the lock between chunks. Bounded
        either way: a child that writes without a pause (a DataLoader worker) neither holds
        its lines back nor keeps ``stop`` waiting."""
        left = self.capacity if final else _CHUNK
        while left > 0:
            try:
                chunk = os.read(self.read, min(left, _CHUNK))
            except BlockingIOError:
                break
            except OSError:  # pragma: no cover - the pipe closed under us
                break
            if not chunk:  # pragma: no cover - we hold the write end: no EOF
                break
            left -= len(chunk)
            lines = _LINE_END.split(self.pending + chunk)
            self.pending = lines.pop()  # '' after a terminator, else the unfinished line
            if len(self.pending) >= _LONGEST_LINE:  # no terminator for long: passed on as it is
                lines.append(self.pending)
                self.pending = b""
            for line in lines:
                self._route(line)
        if final and self.pending:
            line, self.pending = self.pending, b""
            self._route(line)

    def sort_sink(self) -> None:
        """Route what ``sink`` got since the last time, line by line (``Filter.aside``)."""
        sink = self.sink
        if sink is None:
            return
        try:
            end = os.lseek(sink, 0, os.SEEK_CUR)  # where the writes left the file's offset
            if end == self.sunk:
                return
            data = os.pread(sink, end - self.sunk, self.sunk)
            if end >= _SINK_KEPT:  # emptied now and then, not after every use
                os.ftruncate(sink, 0)
                os.lseek(sink, 0, os.SEEK_SET)
                end = 0
            self.sunk = end
        except OSError:  # pragma: no cover - a file we made and hold
            return
        # under the lock, in order with the reader's lines; without it past ``STOP_WAIT_S``
        # (the reader stuck writing to a descriptor 2 nobody reads), as ``Filter.stop`` does
        locked = self.lock.acquire(timeout=STOP_WAIT_S)
        try:
            for line in _LINE_END.split(data):
                if line:
                    self._route(line)
        finally:
            if locked:
                self.lock.release()

    def _route(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if text and is_notice(text):
            self.hidden.append(text)
            return
        if self.forward is not None:
            with contextlib.suppress(OSError):
                os.write(self.forward, line)

    def _run(self) -> None:
        try:
            self._read_until_closed()
        finally:  # a pump whose reader is gone is not handed out again: the next filter makes one
            if _Pump._instance is self:
                _Pump._instance = None

    def _read_until_closed(self) -> None:
        read = self.read
        # poll where there is one: select() refuses a descriptor numbered 1024 or more (a
        # process with many files open), and a reader gone leaves writers to descriptor 2
        # blocked once the pipe is full
        poller = select.poll() if hasattr(select, "poll") else None
        if poller is not None:
            poller.register(read, select.POLLIN)
        while True:
            try:
                # no timeout while no line is unfinished: the thread sleeps between captures
                if poller is not None:
                    events = poller.poll(PARTIAL_LINE_WAIT_S * 1000 if self.pending else None)
                    if any(flags & select.POLLNVAL for _, flags in events):  # pragma: no cover - closed under us
                        return
                    ready = bool(events)
                else:  # pragma: no cover - no poll (Windows)
                    ready = bool(select.select([read], [], [], PARTIAL_LINE_WAIT_S if self.pending else None)[0])
            except InterruptedError:  # pragma: no cover - retried by Python itself since 3.5
                continue
            except (OSError, ValueError):  # pragma: no cover - the descriptor is gone
                return
            try:
                with self.lock:
                    if ready:
                        self.drain()
                    elif self.pending:  # an unfinished line waited long enough: pass it on
                        line, self.pending = self.pending, b""
                        self._route(line)
            except Exception:  # noqa: BLE001 - pragma: no cover - never leave the pipe unread (a full one blocks writers)
                continue


def _sink() -> int | None:
    """A descriptor on an unnamed file for ``Filter.aside`` (None where none can be made):
    in memory where the system allows (``memfd_create``), else a temporary file; made once
    per process."""
    with contextlib.suppress(AttributeError, OSError):
        return os.memfd_create("tracemagic-notices", os.MFD_CLOEXEC)
    try:
        handle = tempfile.TemporaryFile()  # noqa: SIM115 - its descriptor is kept for the process
    except OSError:  # pragma: no cover - no writable temporary directory
        return None
    try:
        return os.dup(handle.fileno())
    except OSError:  # pragma: no cover - out of descriptors
        return None
    finally:
        handle.close()


def _forget_pump() -> None:
    """In a forked child: the parent's reader thread is not there; a filter there starts
    its own (the inherited pipe is left to the parent)."""
    _Pump._instance = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pump)
