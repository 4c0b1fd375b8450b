"""Parse one large trace file on two cores: the events are cut into stretches of a few MB,
this thread and a second one each take the next unread stretch until none is left, and the
stretches' columns are joined in file order. Taking stretches as they come keeps both
threads busy to the end, whatever the events cost to read in each part of the file (a
stretch of operators with shapes takes ~1.5x as long as one of memory events).

The C scanner (``parse``, ``_scan.c``) does most of its work without the GIL, so two
threads scanning two stretches of one file run side by side; with the msgspec path alone
(no scanner built) they would not, and the file is parsed in one thread. A plain file is
read in place by both threads, a gzip file is decompressed into memory first (its stream
has no middle to seek to). The cuts are proven, not guessed: each stretch decodes as a
complete list of events, which one cut inside a string or a nested value never does.
Anything unexpected (a damaged file, an odd layout, a stretch that fails) falls back to
the one-thread parse, so the result is always exactly what it would have been.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import io
import itertools
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from tracemagic.errors import TraceError
from tracemagic.trace import parse
from tracemagic.trace.parse import ParsedTrace, Progress
from tracemagic.trace.read import ByteStream, Source

#: files of at least this much JSON are split (a 10 MB trace loads ~20% faster split;
#: below a few MB the merge costs about what the second thread saves)
SPLIT_MIN_BYTES = 4 << 20
#: the events are cut into stretches of about this many bytes (at most MAX_STRETCHES, and
#: TAIL_PIECES - 1 more where the last inner one is cut into pieces: see ``_targets``)
STRETCH_BYTES = 8 << 20
MAX_STRETCHES = 16
#: the first and the last stretch end / start about this far into the events (see ``_targets``)
EDGE_BYTES = 1 << 20
#: the last inner stretch is cut into up to this many pieces of at least TAIL_MIN_BYTES (see ``_targets``)
TAIL_PIECES = 4
TAIL_MIN_BYTES = 1 << 20
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_GZIP_MAGIC = b"\x1f\x8b"


#: ``read_at(offset, size)``: bytes of the JSON (a plain file's, or decompressed gzip)
ReadAt = Callable[[int, int], bytes]
#: ``scan_at(start, stop, interners, pool)``: ``parse.scan_file`` of the file's bytes
#: ``[start, stop)`` (a plain file's, where the scanner reads it itself)
ScanAt = Callable[[int, int, parse.Interners, Any], tuple[parse.Part, int]]


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
    """Whether ``source`` is a JSON file (plain or gzip) worth parsing on two threads here."""
    if source.path is None or (workers is not None and workers < 2) or not parse.scans_in_c():
        return False
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
def _contents(source: Source) -> Iterator[tuple[ReadAt, int, ScanAt | None] | None]:
    """``(read_at, size, scan_at)`` over the JSON: a plain file read in place (both threads
    read their stretch from it; ``scan_at`` where the scanner reads it itself), a gzip file
    decompressed into memory (no ``scan_at``: a stretch's bytes copied out of the inflated
    blocks for it measured slower than ``read_part``'s chunks); None for a damaged gzip
    stream (the one-thread parse reports it)."""
    assert source.path is not None
    with open(source.path, "rb") as file:
        if file.read(2) != _GZIP_MAGIC:
            scan_at = partial(parse.scan_file, file.fileno()) if parse.scans_files() else None
            yield _reader(file), os.fstat(file.fileno()).st_size, scan_at
            return
    try:
        with ByteStream(source, block=8 << 20) as stream:
            blocks = stream.read_blocks()
            truncated = stream.truncated
    except TraceError:
        truncated = True
    if truncated:
        yield None
        return
    yield _blocks_reader(blocks), sum(len(b) for b in blocks), None


def _blocks_reader(blocks: list[bytes]) -> ReadAt:
    """``read_at`` over bytes held as consecutive blocks (a gzip inflated piece by piece:
    joining them first would copy the whole JSON once more)."""
    starts = list(itertools.accumulate((len(b) for b in blocks), initial=0))

    def read_at(offset: int, size: int) -> bytes:
        stop = min(offset + size, starts[-1])
        index = bisect.bisect_right(starts, offset) - 1
        parts: list[memoryview] = []
        while offset < stop:
            block = memoryview(blocks[index])
            piece = block[offset - starts[index] : stop - starts[index]]
            parts.append(piece)
            offset += len(piece)
            index += 1
        return b"".join(parts) if len(parts) != 1 else parts[0].tobytes()

    return read_at


def _reader(file: BinaryIO) -> ReadAt:
    """``read_at`` over an open file for two threads: ``pread`` where there is one (it
    keeps no file position, and measured faster than a memory map here), else seek and
    read under a lock."""
    if hasattr(os, "pread"):
        fd = file.fileno()
        return lambda offset, size: os.pread(fd, size, offset)
    lock = threading.Lock()

    def read_at(offset: int, size: int) -> bytes:
        with lock:
            file.seek(offset)
            return file.read(size)

    return read_at


def _targets(events: int, size: int, scanned: bool) -> list[int]:
    """Where to look for the cuts between stretches (``events``: where the events start),
    for about ``STRETCH_BYTES`` each, up to ``MAX_STRETCHES`` (and ``TAIL_PIECES - 1`` pieces
    of the last inner one). Where the scanner reads the
    inner stretches itself (``scanned``), the first and the last, which hold the metadata
    around the events and are read by ``parse.read_part`` (~1.4x slower), are short
    (``EDGE_BYTES``), with at least two inner ones (both threads busy) between them."""
    if not scanned:
        count = max(2, min(MAX_STRETCHES, size // STRETCH_BYTES))
        return [size * i // count for i in range(1, count)]
    span = size - events
    edge = min(EDGE_BYTES, span // 8)
    inner = max(2, min(MAX_STRETCHES - 2, (span - 2 * edge) // STRETCH_BYTES))
    starts = [events + edge + (span - 2 * edge) * i // inner for i in range(inner)]
    # the last inner stretch in pieces of at least TAIL_MIN_BYTES: the thread that finds no
    # stretch left waits for the other's last one (half a stretch on average, ~7 ms of a
    # 100 MB trace's ~95), a piece of it rather than the whole
    last = size - edge - starts[-1]
    pieces = max(1, min(TAIL_PIECES, last // TAIL_MIN_BYTES))
    tail = [starts[-1] + last * i // pieces for i in range(1, pieces)]
    return starts + tail + [size - edge]


def _cuts(read_at: ReadAt, size: int, scanned: bool = False) -> list[tuple[int, int]] | None:
    """``[(start, stop)]`` of each stretch: the first from byte 0 to an event's ``}``, each
    later one from the next event's ``{``, the last to the end; None when no boundary is found."""
    match = _EVENTS_KEY.search(read_at(0, 1 << 20))
    if match is None:
        return None
    stretches: list[tuple[int, int]] = []
    start = 0
    for target in _targets(match.end(), size, scanned):
        target = max(match.end(), start + 1, target)
        boundary = _BOUNDARY.search(read_at(target, 64 << 10)) or _BOUNDARY.search(read_at(target, 4 << 20))
        if boundary is None:
            break
        stretches.append((start, target + boundary.start() + 1))
        start = target + boundary.end() - 1
    if not stretches:
        return None
    return stretches + [(start, size)]


def parse_split(
    source: Source, progress: Progress | None = None, ended: list[int | None] | None = None
) -> ParsedTrace | None:
    """Parse ``source`` on two threads; None when it cannot be, and then the caller parses
    it whole (which also reports damage exactly where the one-thread parse would).

    Progress is reported from this thread, counting the bytes both threads have read.
    ``ended``: where given, the second thread's native id is added to it, for the caller's
    ``trim_thread_arena`` (what the parse freed, that thread's arena included, handed back
    once the caller is done with the heap it reuses).
    """
    with _contents(source) as contents:
        found = _parse_split(source, contents, progress) if contents is not None else None
    if found is None:
        return None
    parsed, second = found
    if ended is not None:
        ended.append(second)
    return parsed


def _parse_split(
    source: Source, contents: tuple[ReadAt, int, ScanAt | None], progress: Progress | None
) -> tuple[ParsedTrace, int | None] | None:
    """``parse_split``'s parse, and the second thread's native id."""
    read_at, size, scan_at = contents
    cuts = _cuts(read_at, size, scan_at is not None)
    if cuts is None:
        return None
    stretches = _Stretches(read_at, cuts, source, scan_at)
    second = _Second(stretches.take_all)
    try:
        try:
            stretches.take_all(_Reporter(stretches, source.size, progress))
        except (TraceError, parse.UnstreamableError):
            second.cancel()
            return None  # damage or an odd layout: the whole-file parse says what and where
        except BaseException:  # the user interrupted: do not wait for the second thread
            second.cancel()
            raise
        if not second.finished() or None in stretches.parts:
            return None
        if progress is not None:
            progress(source.size, source.size)
        first, *later = stretches.parts
        assert first is not None
        for part in later:
            assert part is not None
            first.extend(part)
        del later
        stretches.parts.clear()
        pools, stretches.pools = stretches.pools, []
        parsed = first.finish(second.help, pools)  # the columns joined on both threads, in the pools
        return parsed, second.native_id
    finally:
        second.release()  # (where it was handed no job: it ends after its stretch)


class _Stretches:
    """The stretches of one file, handed out in file order to whichever thread asks next."""

    def __init__(self, read_at: ReadAt, cuts: list[tuple[int, int]], source: Source, scan_at: ScanAt | None) -> None:
        last = len(cuts) - 1
        self.read_at = read_at
        self.scan_at = scan_at
        self.cuts = cuts
        self.source = source
        self.sources = [
            Source(
                source.name,
                partial(_Slice, read_at, start, stop, prefix=b"[" if i else b"", suffix=b"]" if i < last else b""),
                stop - start + (i > 0) + (i < last),
                source.rank_hint,
            )
            for i, (start, stop) in enumerate(cuts)
        ]
        self.bases = [start - 1 if i else 0 for i, (start, _) in enumerate(cuts)]
        self.parts: list[parse.Part | None] = [None] * len(cuts)
        self.interners = parse.Interners()
        #: the threads' scan pools, once each is done (``parse.scan_pool``'s ``kept``)
        self.pools: list[Any] = []
        self.done = [0] * len(cuts)  # bytes read of each stretch, for progress
        # the first and the last stretch (the metadata around the events: read by
        # ``read_part``, ~1.4x slower than the scanner's inner stretches) are taken first,
        # so that the stretches left at the end, when a thread may wait for the other, are short
        self._order = [0, *([last] if last else []), *range(1, last)]
        self._next = 0
        self._failed = False
        self._lock = threading.Lock()

    def _take(self) -> int | None:
        with self._lock:
            taken = self._next
            self._next += 1
        return self._order[taken] if taken < len(self._order) and not self._failed else None

    def take_all(self, progress: Callable[[int, int], None]) -> None:
        """Parse stretches until none is left (or a stretch failed on either thread);
        ``progress(done, total)`` after each chunk. The thread's chunks are decoded in one
        ``parse.scan_pool``, kept in ``pools`` once its part is read (``finish`` makes the
        columns in them)."""
        with parse.scan_pool(kept=self.pools) as pool:
            self._take_all(progress, pool)

    def _take_all(self, progress: Callable[[int, int], None], pool: Any) -> None:
        while (index := self._take()) is not None:

            def report(done: int, total: int, index: int = index) -> None:
                self.done[index] = done
                progress(done, total)

            try:
                self.parts[index] = self._read(index, report, pool)
            except BaseException:
                self._failed = True  # the other thread takes no further stretch
                raise

    def _read(self, index: int, report: Progress, pool: Any) -> parse.Part:
        """The columns of stretch ``index``: an inner one scanned in C straight from the
        file where the scanner can, the first and last (with the metadata around the
        events) and any other by ``parse.read_part``."""
        if 0 < index < len(self.cuts) - 1 and self.scan_at is not None:
            return self._scan_inner(index, report, pool)
        return parse.read_part(
            self.sources[index], base=self.bases[index], progress=report, interners=self.interners, pool=pool
        )

    def _scan_inner(self, index: int, report: Progress, pool: Any) -> parse.Part:
        """An inner stretch (events alone, no metadata around them) cut into chunks and
        scanned in C straight from the file's bytes; from the first chunk the scanner
        leaves to msgspec, the rest as ``read_part`` reads any stretch."""
        assert self.scan_at is not None
        start, stop = self.cuts[index]
        part, done = self.scan_at(start, stop, self.interners, pool)
        if done < stop - start:
            rest = Source(
                self.source.name,
                partial(_Slice, self.read_at, start + done, stop, prefix=b"[", suffix=b"]"),
                stop - start - done + 2,
                self.source.rank_hint,
            )
            part.extend(parse.read_part(rest, base=start + done - 1, interners=self.interners, pool=pool))
        report(self.sources[index].size, self.sources[index].size)
        return part


class _Reporter:
    """This thread's progress callback: both threads' bytes read so far, of the whole file."""

    def __init__(self, stretches: _Stretches, size: int, progress: Progress | None) -> None:
        self._stretches = stretches
        self._size = size
        self._total = max(sum(s.size for s in stretches.sources), 1)
        self._progress = progress

    def __call__(self, done: int, total: int) -> None:
        if self._progress is not None:
            read = sum(self._stretches.done)
            self._progress(min(self._size, read * self._size // self._total), self._size)


class _CancelledError(Exception):
    """Raised in the second thread at its next chunk once its result is not wanted."""


#: blocks a thread takes (untouched: no memory) and frees to make glibc trim its arena,
#: see ``trim_thread_arena``
_TRIM_BLOCK = 1 << 20
_TRIM_BLOCKS = 40


@functools.cache
def _libc() -> tuple[Any, Any, Any] | None:
    """glibc's ``malloc``, ``free`` and ``malloc_trim``, or None where the C library is another one."""
    try:
        libc = ctypes.CDLL(None)
        if getattr(libc, "malloc_trim", None) is None:  # not glibc: its arenas are not the issue
            return None
        malloc, free = libc.malloc, libc.free
    except (OSError, TypeError, AttributeError):
        return None
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    return malloc, free, libc.malloc_trim


def trim_thread_arena(ended: int | None = None) -> None:
    """Hand back the memory the parse freed, the free top of the glibc arena the second
    parsing thread used included, on a short thread of its own (glibc gives a new thread the
    arena of the thread that ended last: ``ended``, that thread's native id, is waited for,
    up to 50 ms, as Python lets a thread be joined just before it has ended).

    The parts that thread read lived in its arena; freed, the arena is all free, but
    ``malloc_trim`` trims a thread arena's holes, not its top, and glibc trims that top on
    a free only when it is larger than its trim threshold (up to 64 MiB): 0-11 MiB of pages
    stayed resident after a 100 MB trace, with how the threads interleaved. The thread
    takes ``_TRIM_BLOCKS`` untouched blocks (malloc writes their headers only: no memory),
    the last of them at the top; frees the others, so the free space below the last one,
    the old top with it, is no longer the top, and ``malloc_trim`` (every arena) hands its
    pages back; then frees the last. That takes 2–3 ms, on the other core: ``load`` does
    not wait for it (glibc locks each arena while it trims it; ``load`` calls it once the
    events are prepared, whose columns reuse the parse's freed heap). A no-op where
    the C library is not glibc."""
    if _libc() is not None:
        if ended is not None:
            task = Path(f"/proc/self/task/{ended}")
            deadline = time.monotonic() + 0.05
            while task.exists() and time.monotonic() < deadline:
                time.sleep(0.0002)
        threading.Thread(target=_take_and_free_blocks, name="tracemagic-trim", daemon=True).start()


def _take_and_free_blocks() -> None:
    libc = _libc()
    assert libc is not None
    malloc, free, trim = libc
    blocks = [malloc(_TRIM_BLOCK) for _ in range(_TRIM_BLOCKS)]
    guard = blocks.pop()  # the last, at the top: what is freed below it is not the top
    for block in blocks:  # in the order taken: each joins the free space before it
        free(block)
    trim(0)  # the free space below the guard, the parse's old top included, handed back
    free(guard)  # joins it all to the top, which glibc trims now that it passed the threshold


class _Second:
    """``work`` on a second thread; ``work(stop)`` reports progress to ``stop``, which
    raises ``_CancelledError`` after ``cancel()``, so an unwanted parse ends at its next chunk.

    After its work the thread waits for one more job, which ``help`` hands it (the columns'
    joins: a thread of its own would take a glibc arena of its own, see ``trim_thread_arena``),
    and ends once it has run it, or on ``release``."""

    def __init__(self, work: Callable[[Progress], Any]) -> None:
        self._work = work
        self._wanted = True
        self._ok = False
        self._done = threading.Event()
        self._job: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._handed = False
        #: the thread's id in the system (``threading.get_native_id``), once it runs
        self.native_id: int | None = None
        self._thread = threading.Thread(target=self._run, name="tracemagic-parse", daemon=True)
        self._thread.start()

    def _stop(self, done: int, total: int) -> None:
        if not self._wanted:
            raise _CancelledError

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        try:
            self._work(self._stop)
            self._ok = True
        except BaseException:  # noqa: BLE001 - any failure: the caller parses in one thread
            self._ok = False
        finally:
            self._done.set()
        job = self._job.get()
        if job is not None:
            job()  # (it catches what it raises: ``builder._run_jobs``)

    def cancel(self) -> None:
        self._wanted = False

    def finished(self) -> bool:
        """Wait for the work; whether it ran to the end without failing."""
        self._done.wait()
        return self._ok

    def help(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread once its work is done; then the thread ends. Once only."""
        if self._handed:
            raise RuntimeError("the second thread runs one job after its work")
        self._handed = True
        self._job.put(job)

    def release(self) -> None:
        """Let the thread end without a job (where none was handed to it)."""
        if not self._handed:
            self._handed = True
            self._job.put(None)
