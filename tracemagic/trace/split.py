"""Parse one large trace file on two cores: this process reads the first stretch of the
events while a forked child reads the rest, and the child's columns are appended.

Decoding is CPU-bound Python (msgspec structs to numpy columns), so one process is the
limit; splitting the JSON at an event boundary near its middle nearly halves the wall
time (``bench/bench_load.py``). A plain file is read in place by both processes, a gzip
file is decompressed into memory first (its stream has no middle to seek to), and the
child sees those bytes through the fork. The split is proven, not guessed: the parent decodes
everything before the cut as a complete list of events, which a cut inside a string or a
nested value never is. Anything unexpected (no fork, a damaged file, an odd layout, a
child that fails or hangs) falls back to the one-process parse, so the result is always
exactly what it would have been.

The child is forked, not spawned: it starts in milliseconds with everything imported,
only decodes bytes into arrays, never writes to the terminal or the notebook, and sends
its columns back over a pipe (pickle between our own two processes; nothing read from a
file is ever unpickled).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import select
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from tracemagic.errors import TraceError
from tracemagic.trace import parse
from tracemagic.trace.parse import ParsedTrace, Progress
from tracemagic.trace.read import ByteStream, Source

#: files of at least this much JSON are split (below it the fork and merge cost more than
#: they save)
SPLIT_MIN_BYTES = 16 << 20
#: the child's share of the events bytes (the parent also merges and finishes the table)
CHILD_SHARE = 0.5
#: how long to wait for the child beyond the parent's own time, before parsing alone
_GRACE_S = 30.0
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_GZIP_MAGIC = b"\x1f\x8b"


#: ``read_at(offset, size)``: bytes of the JSON (a plain file's, or decompressed gzip)
ReadAt = Callable[[int, int], bytes]


class _Slice(io.RawIOBase):
    """Bytes ``[start, stop)`` of the JSON, with ``prefix``/``suffix`` bytes around them."""

    def __init__(self, read_at: ReadAt, start: int, stop: int, prefix: bytes = b"", suffix: bytes = b"") -> None:
        super().__init__()
        self._read_at = read_at
        self._pos = start
        self._stop = stop
        self._prefix = prefix
        self._suffix = suffix

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = size if size is not None and size >= 0 else 1 << 62
        head, self._prefix = self._prefix[:size], self._prefix[size:]
        take = min(size - len(head), self._stop - self._pos)
        body = self._read_at(self._pos, take) if take > 0 else b""
        self._pos += len(body)
        room = size - len(head) - len(body)
        tail = b""
        if self._pos >= self._stop and room > 0:
            tail, self._suffix = self._suffix[:room], self._suffix[room:]
        return head + body + tail


def can_split(source: Source, workers: int | None) -> bool:
    """Whether ``source`` is a JSON file (plain or gzip) worth parsing in two processes here."""
    if source.path is None or (workers is not None and workers < 2):
        return False
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False  # fork is unsafe on macOS and missing on Windows
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= 2 and _json_size(source.path, source.size) >= SPLIT_MIN_BYTES


def _json_size(path: Path, size: int) -> int:
    """The JSON's size: the file's, or for gzip the size its trailer records (mod 4 GiB;
    a trailer smaller than the file means more, so the file's size x 10 stands in)."""
    try:
        with open(path, "rb") as file:
            if file.read(2) != _GZIP_MAGIC:
                return size
            file.seek(-4, os.SEEK_END)
            recorded = int.from_bytes(file.read(4), "little")
    except OSError:
        return 0
    return recorded if recorded >= size else size * 10


@contextmanager
def _contents(source: Source) -> Iterator[tuple[ReadAt, int] | None]:
    """``(read_at, size)`` over the JSON: a plain file read in place with ``pread`` (which
    the forked child can share), a gzip file decompressed into memory; None for a damaged
    gzip stream (the one-process parse reports it)."""
    assert source.path is not None
    fd = os.open(source.path, os.O_RDONLY)
    try:
        if os.pread(fd, 2, 0) != _GZIP_MAGIC:
            yield (lambda offset, size: os.pread(fd, size, offset)), os.fstat(fd).st_size
            return
    finally:
        os.close(fd)
    try:
        with ByteStream(source, block=8 << 20) as stream:
            data = stream.read_all()
            truncated = stream.truncated
    except TraceError:
        truncated = True
    if truncated:
        yield None
        return
    view = memoryview(data)
    yield (lambda offset, size: bytes(view[offset : offset + size])), len(data)


def _cut(read_at: ReadAt, size: int) -> tuple[int, int] | None:
    """``(end, start)``: the first stretch is ``[0, end)`` (it ends with an event's ``}``),
    the second starts at the next event's ``{``; None when no boundary is found."""
    match = _EVENTS_KEY.search(read_at(0, 1 << 20))
    if match is None:
        return None
    target = max(match.end(), int(size * (1 - CHILD_SHARE)))
    boundary = _BOUNDARY.search(read_at(target, 4 << 20))
    if boundary is None:
        return None
    return target + boundary.start() + 1, target + boundary.end() - 1


def parse_split(source: Source, progress: Progress | None = None) -> ParsedTrace | None:
    """Parse ``source`` in two processes; None when it cannot be, and then the caller
    parses it whole (which also reports damage exactly where the one-process parse would).

    Progress is reported from the parent's stretch, scaled to the whole file (the two
    stretches are read at the same pace).
    """
    with _contents(source) as contents:
        return _parse_split(source, contents, progress) if contents is not None else None


def _parse_split(source: Source, contents: tuple[ReadAt, int], progress: Progress | None) -> ParsedTrace | None:
    read_at, size = contents
    cut = _cut(read_at, size)
    if cut is None:
        return None
    end, start = cut
    first = Source(source.name, lambda: _Slice(read_at, 0, end, suffix=b"]"), end + 1, source.rank_hint)
    rest = Source(source.name, lambda: _Slice(read_at, start, size, prefix=b"["), size - start + 1, source.rank_hint)
    child = _Child(lambda: parse.read_part(rest, base=start - 1))
    try:
        began = time.monotonic()
        scaled: Progress | None = None
        if progress is not None:
            report = progress

            def scaled(done: int, total: int) -> None:
                report(min(source.size, done * source.size // max(total, 1)), source.size)

        try:
            part = parse.read_part(first, progress=scaled)
        except (TraceError, parse.Unstreamable):
            return None  # damage or an odd layout: the whole-file parse says what and where
        later = child.result(timeout=_GRACE_S + 2 * (time.monotonic() - began))
    finally:
        child.stop()
    if later is None:
        return None
    part.extend(later)
    return part.finish()


class _Child:
    """A forked process running ``work`` and sending back its pickled result."""

    def __init__(self, work: Callable[[], Any]) -> None:
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "fork() in a multi-threaded process"
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child (coverage does not follow forks)
            os.close(read_end)
            _run_child(work, write_end)
        os.close(write_end)
        self.pid = pid
        self.fd = read_end

    def result(self, timeout: float) -> Any | None:
        """The child's result, or None when it failed or did not answer in time."""
        deadline = time.monotonic() + timeout
        blocks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            block = os.read(self.fd, 1 << 20)
            if not block:
                break
            blocks.append(block)
        try:
            status, value = pickle.loads(b"".join(blocks))
        except Exception:  # noqa: BLE001 - a child that died mid-write: parse alone
            return None
        return value if status == "ok" else None

    def stop(self) -> None:
        """Close the pipe, end the child if it still runs, and reap it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.pid > 0:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
                if done == 0:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass
            self.pid = -1


def _run_child(work: Callable[[], Any], fd: int) -> None:  # pragma: no cover - runs in the child
    """Do ``work`` quietly and write ``(status, value)`` to ``fd``; never returns."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = sys.stderr = open(devnull, "w", closefd=False)
        warnings.simplefilter("ignore")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            payload: tuple[str, Any] = ("ok", work())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which parses alone
            payload = ("error", f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        with open(fd, "wb", closefd=True) as pipe:
            pipe.write(data)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)
