"""Parse one Kineto trace into typed columns (no per-event Python dicts, bounded memory).

The ``traceEvents`` array is decoded in chunks of a few MB, straight from the (streamed,
decompressed) file. Where it is built, the C scanner (``_scan.c``: yyjson parses the
chunk, one pass fills the columns, each column's values interned per chunk, no Python
object per event) reads each chunk, ~4x faster than the Python route. That route, msgspec,
reads what the scanner leaves (malformed JSON, values of unexpected types) and everything
when no C compiler built it: msgspec decodes the chunk into slotted structs that keep only
the fields the analyses use, and the columns are pulled out with C-level ``attrgetter``
maps. Both give the same columns (``tests/test_scan.py``); repeated strings become
categorical codes as they come, so peak memory is the final columns plus one chunk.

Chunks are cut at ``}`` ``,`` ``{`` boundaries; a cut is accepted only when the chunk
decodes as a list of events, which a cut inside a string or a nested object never does
(its prefix cannot be complete JSON), so the cutting is exact for any valid JSON. Damage
(truncation, garbage) is located by msgspec's byte offset; ``recover=True`` keeps the
events before it. Odd layouts fall back to decoding the whole document at once.

This module cuts and streams (and picks the C scanner or msgspec per chunk); the rest lives
beside it: ``structs`` (the msgspec structs of the Python route and the fields pulled out
of them), ``builder`` (the columns builder: chunks -> typed columns, ``ParsedTrace``) and
``jsonvalues`` (decoding that repairs invalid UTF-8 and too-deep nesting, numbers from
JSON values, metadata, error offsets).
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec

from tracemagic.errors import TraceError
from tracemagic.trace.builder import Helper, Interners, ParsedTrace, _Builder
from tracemagic.trace.jsonvalues import (
    _ANY,
    _META,
    _TOP,
    LEADING,
    MAX_NESTING,
    _literal,
    _offset_of,
    decode_or_repair,
    merge_notes,
)
from tracemagic.trace.read import ByteStream, Source, sniff
from tracemagic.trace.structs import _LOOSE_EVENTS, decode_structs

__all__ = [
    "CHUNK_BYTES",
    "MAX_NESTING",
    "Interners",
    "ParsedTrace",
    "Part",
    "Progress",
    "UnstreamableError",
    "parse_events",
    "parse_source",
    "read_part",
    "scan_pool",
    "scans_in_c",
]

_scan: ModuleType | None  # the C scanner (setup.py builds it where a compiler is found)
try:
    from tracemagic.trace import _scan
except ImportError:  # pragma: no cover - installed without a C compiler: msgspec alone
    _scan = None

#: bytes of events decoded at once (peak memory holds about one chunk's Python objects;
#: 1-8 MB measured alike in speed, smaller is lighter)
CHUNK_BYTES = 2 << 20
#: a scan pool holds this many chunks' bytes: a chunk's document (yyjson's copy of the text
#: and its values, ~3.6x the text) and its columns (~0.8x) fit in it
POOL_CHUNKS = 5
#: how many cut candidates to try before falling back to the whole-document path
_MAX_CUT_TRIES = 16
#: progress callback: (bytes read from the file so far, the file's size)
Progress = Callable[[int, int], None]
_NEXT_EVENT = re.compile(rb"\}\s*,\s*\{")
_LAST_EVENT = re.compile(rb"\}\s*\]")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = b" \t\r\n"
#: a BOM and white space before the document (matched: ``lstrip`` would copy the document)
#: white space (``_WS``), matched where ``lstrip`` would copy
_SPACE = re.compile(rb"[ \t\r\n]*")


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Switch the cyclic GC off while millions of small objects are made."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -- decoding ------------------------------------------------------------------------------


def scans_in_c() -> bool:
    """Whether the C scanner is built (it decodes without holding the GIL)."""
    return _scan is not None


def scans_files() -> bool:
    """Whether the C scanner reads stretches of a file itself (``scan_file``: POSIX ``pread``)."""
    return _scan is not None and hasattr(_scan, "scan_file")


def scan_file(
    fd: int, start: int, stop: int, interners: Interners, pool: mmap.mmap | None = None, chunk: int | None = None
) -> tuple[Part, int]:
    """The columns of the events in bytes ``[start, stop)`` of the open file ``fd`` (events
    separated by commas, from the first one's ``{`` to the last one's ``}``), which the C
    scanner reads chunk by chunk (of about ``chunk`` bytes) straight into ``pool``: no Python
    buffer, no copy of the stretch, no cut searched in Python. And how many bytes of it that
    read: from there on (the ``{`` of the first chunk the scanner leaves to msgspec) the
    caller reads the rest with ``read_part``."""
    assert _scan is not None
    found, done = _scan.scan_file(fd, start, stop - start, pool, chunk or CHUNK_BYTES)
    return _scanned_part(found, interners), done


def _scanned_part(found: list[tuple[Any, ...]], interners: Interners) -> Part:
    builder = _Builder(interners)
    with _gc_paused():
        for columns in found:
            builder.add(columns)
    return Part(builder, {}, [])


@contextmanager
def scan_pool(chunk: int = CHUNK_BYTES, kept: list[mmap.mmap] | None = None) -> Iterator[mmap.mmap | None]:
    """Memory for the C scanner to decode chunks of up to ``chunk`` bytes in, one after
    another on one thread (see ``_scan.c``'s ``Pool``), unmapped on exit; None without the
    scanner. Its pages are handed back to the system at once when the parse ends, wherever
    it ran, instead of staying in a glibc arena (a second parsing thread's is never trimmed).

    ``kept``: where the block ends without an error, the pool is appended to it instead of
    unmapped, for ``Part.finish`` to make the columns in (its pages are made already)."""
    if _scan is None:
        yield None
        return
    private = getattr(mmap, "MAP_PRIVATE", None)  # a private map: pages made as they are written
    size = POOL_CHUNKS * chunk
    pool = mmap.mmap(-1, size) if private is None else mmap.mmap(-1, size, flags=private)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge is not None:  # 2 MiB pages where the system makes them: ~500x fewer page faults
        with contextlib.suppress(OSError):
            pool.madvise(huge)
    try:
        yield pool
    except BaseException:
        pool.close()
        raise
    if kept is None:
        pool.close()
    else:
        kept.append(pool)


def _decode_events(
    data: Any, name: str, notes: list[str] | None = None, base: int = 0, pool: mmap.mmap | None = None
) -> list[Any] | tuple[Any, ...]:
    """A JSON array of events -> the C scanner's columns, or structs (typed fast path,
    loose fallback) where the scanner leaves the array to msgspec.

    ``notes`` gets what had to be repaired to decode it (see ``decode_or_repair``; ``base`` is the
    data's offset in the file); ``pool``: ``scan_pool``'s memory, for this thread alone.

    Raises msgspec.DecodeError for malformed JSON (the caller locates it).
    """
    if _scan is not None:
        columns = _scan.scan(data, pool)
        if columns is not None:
            return columns
    return decode_structs(data, name, notes, base)


@dataclass
class Part:
    """The decoded columns of a file, or of a stretch of one, before they become tables."""

    builder: _Builder
    meta: dict[str, Any]
    warnings: list[str]

    def extend(self, later: Part) -> None:
        """Append a part that follows this one in the same file (read with the same ``Interners``)."""
        self.builder.extend(later.builder)
        self.meta.update(later.meta)
        self.warnings += later.warnings

    def finish(self, helper: Helper | None = None, pools: list[mmap.mmap] | None = None) -> ParsedTrace:
        """The trace's columns (``helper``: a second thread to join them on; ``pools``: the
        parse's scan pools, to make them in; see ``_Builder.finish``)."""
        return self.builder.finish(self.meta, merge_notes(self.warnings), helper, pools)


class _DamageError(Exception):
    """The JSON is broken at ``offset`` (absolute, in the decompressed bytes)."""

    def __init__(self, offset: int | None, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset
        self.reason = reason


class UnstreamableError(Exception):
    """The streaming path cannot handle this layout: decode the whole document instead."""


class _StreamParser:
    """Cuts the traceEvents array of a byte stream into chunks and decodes them."""

    def __init__(
        self,
        source: Source,
        stream: ByteStream,
        recover: bool,
        progress: Progress | None,
        chunk: int,
        base: int = 0,
        interners: Interners | None = None,
        pool: mmap.mmap | None = None,
    ) -> None:
        self.source = source
        self.pool = pool
        self.name = source.name
        self.stream = stream
        self.recover = recover
        self.progress = progress
        self.chunk = chunk
        self.buf = bytearray()
        self.base = base  # absolute offset of buf[0] in the file
        self.eof = False
        self.builder = _Builder(interners)
        self.meta: dict[str, Any] = {}
        self.warnings: list[str] = []

    # -- input --------------------------------------------------------------------------
    def _more(self) -> bool:
        if self.eof:
            return False
        block = self.stream.read()
        if not block:
            self.eof = True
            return False
        self.buf = self.buf + block if self.buf else bytearray(block)
        return True

    def _drop(self, count: int) -> None:
        """Forget the first ``count`` bytes (a new buffer: decoded Raw values may still view the old one)."""
        self.buf = self.buf[count:]
        self.base += count

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(min(self.stream.consumed, self.source.size), self.source.size)

    # -- the document -----------------------------------------------------------------
    def read(self) -> Part:
        """Decode the whole stream into columns (not yet a table)."""
        self._more()
        sniff(bytes(self.buf[: 1 << 20]), self.name)
        self._find_events()
        while True:
            while not self.eof and len(self.buf) < self.chunk:
                self._more()
            if self.eof:
                self._last_chunk()
                break
            if not self._next_chunk():
                break
            self._report()
        if self.stream.truncated and not self.recover:
            raise TraceError(
                f"{self.name}: the gzip stream is cut off (the file is truncated after "
                f"{self.base + len(self.buf)} bytes of JSON). Pass recover=True to "
                "tracemagic.load to keep the events before the cut.",
                path=self.name,
                offset=self.base + len(self.buf),
            )
        if self.stream.truncated:
            self.warnings.append(f"{self.name}: gzip stream truncated; recovered what it held")
        self._report()
        return Part(self.builder, self.meta, self.warnings)

    def _find_events(self) -> None:
        """Move to the '[' of the events array; decode the metadata before it."""
        start = LEADING.match(self.buf).end()  # type: ignore[union-attr]  # (lstrip would copy the chunk)
        if self.buf[start : start + 1] == b"[":
            self._drop(start)
            return
        while True:
            key = self.buf.find(b'"traceEvents"', start)
            match = _EVENTS_KEY.match(self.buf, key) if key >= 0 else None
            if match is not None and self.buf[key - 1 : key] != b"\\":
                break
            if key >= 0 and len(self.buf) - key > 64:  # odd spacing or a string that says traceEvents
                raise UnstreamableError
            if not self._more() or len(self.buf) > (256 << 20):
                raise UnstreamableError
        head = bytes(self.buf[start:key]).rstrip(_WS)
        if head.endswith(b","):
            head = head[:-1]
        if head.strip(_WS) != b"{":
            try:
                top = decode_or_repair(_META, head + b"}", self.warnings, self.base + start)
            except msgspec.DecodeError:
                raise UnstreamableError from None
            if not isinstance(top, dict):
                raise UnstreamableError
            self.meta.update({k: _literal(v) for k, v in top.items()})
        self._drop(match.end() - 1)

    def _decode_at(self, end: int) -> list[Any] | tuple[Any, ...]:
        """Decode buf[0:end] + ']' as events (buf[0] is the '[' or the ',' before the chunk)."""
        buf = self.buf
        buf[0] = 0x5B  # '['
        saved = buf[end] if end < len(buf) else None
        try:
            if saved is None:
                return _decode_events(bytes(buf) + b"]", self.name, self.warnings, self.base, self.pool)
            buf[end] = 0x5D  # ']'
            with memoryview(buf) as view:
                return _decode_events(view[: end + 1], self.name, self.warnings, self.base, self.pool)
        finally:
            if saved is not None:
                buf[end] = saved

    def _try_cut(self, end: int) -> list[Any] | tuple[Any, ...] | None:
        """Events of buf[:end]; None when the cut is not between two events."""
        try:
            return self._decode_at(end)
        except msgspec.DecodeError as exc:
            where = _offset_of(exc)
            if where is None or where >= end:
                return None  # error at the end of the chunk: the cut was inside an event
            raise _DamageError(self.base + where, str(exc)) from None

    def _next_chunk(self) -> bool:
        """Decode one chunk ending near ``self.chunk``; False when the parse stopped (recovered)."""
        tries = 0
        for limit in (min(len(self.buf), self.chunk), len(self.buf)):
            pos = limit
            while tries < _MAX_CUT_TRIES:
                pos = self.buf.rfind(b"}", 1, pos)
                if pos < 0:
                    break
                if _NEXT_EVENT.match(self.buf, pos) is None:
                    continue
                tries += 1
                try:
                    events = self._try_cut(pos + 1)
                except _DamageError as damage:
                    return self._damaged(damage)
                if events is None:
                    continue
                self.builder.add(events)
                del events
                self._drop(self.buf.index(b",", pos + 1))
                return True
        if tries < _MAX_CUT_TRIES and len(self.buf) < (256 << 20) and self._more():
            return True  # no boundary yet (one enormous event): read on
        raise UnstreamableError

    def _last_chunk(self) -> None:
        """The end of the document: the last events, the ']' and the metadata after it."""
        first = _SPACE.match(self.buf, 1).end()  # type: ignore[union-attr]  # (lstrip would copy the chunk)
        if self.buf[first : first + 1] == b"]":  # no (more) events
            close = first
        else:
            close = -1
            for tries, match in enumerate(_LAST_EVENT.finditer(self.buf), 1):
                try:
                    events = self._try_cut(match.start() + 1)
                except _DamageError as damage:
                    self._damaged(damage)
                    return
                if events is not None:
                    self.builder.add(events)
                    del events
                    close = match.end() - 1
                    break
                if tries >= _MAX_CUT_TRIES:
                    raise UnstreamableError
            if close < 0:
                self._damaged(self._locate_end_damage())
                return
        tail = bytes(self.buf[close + 1 :]).strip(_WS)
        if tail in (b"", b"}"):
            return
        if tail[:1] == b",":
            try:
                extra = decode_or_repair(_META, b"{" + tail[1:], self.warnings, self.base + close + 1)
            except msgspec.DecodeError as exc:
                where = _offset_of(exc)
                offset = self.base + close + 1 + (where if where is not None else len(tail))
                if not self.recover:
                    raise self._error(offset, f"the metadata after the events is damaged ({exc})") from None
                self.warnings.append(f"{self.name}: damaged after the events (byte {offset}); metadata after them lost")
                return
            if isinstance(extra, dict):
                self.meta.update({k: _literal(v) for k, v in extra.items()})
                return
        raise UnstreamableError

    def _locate_end_damage(self) -> _DamageError:
        """Where the remainder of the document breaks (it has no complete end)."""
        self.buf[0] = 0x5B  # '[' (it may hold the ',' before the next event)
        try:
            decode_or_repair(_ANY, self.buf)
        except msgspec.DecodeError as exc:
            where = _offset_of(exc)
            if where is None:  # truncated: the data just ends
                return _DamageError(self.base + len(self.buf), "the file ends inside the events (truncated)")
            return _DamageError(self.base + where, str(exc))
        return _DamageError(self.base + len(self.buf), "the events array is not closed")

    def _error(self, offset: int | None, reason: str) -> TraceError:
        cut = " (the gzip stream is cut off)" if self.stream.truncated else ""
        where = f" at byte {offset}" if offset is not None else ""
        return TraceError(
            f"{self.name}: the trace is truncated or corrupt{where}{cut}: {reason}. "
            "Pass recover=True to tracemagic.load to keep the events before the damage.",
            path=self.name,
            offset=offset,
        )

    def _damaged(self, damage: _DamageError) -> bool:
        """Raise, or keep the complete events before the damage (recover=True); stops the parse."""
        if not self.recover:
            raise self._error(damage.offset, damage.reason)
        limit = len(self.buf) if damage.offset is None else max(0, damage.offset - self.base)
        pos = limit
        kept = False
        for _ in range(64):
            pos = self.buf.rfind(b"}", 1, pos)
            if pos < 0:
                break
            try:
                events = self._decode_at(pos + 1)
            except msgspec.DecodeError:
                continue
            self.builder.add(events)
            kept = True
            break
        if not kept and self.builder.n == 0 and not self.builder.flow_parts["ts"]:
            raise TraceError(
                f"{self.name}: damaged at byte {damage.offset} before any complete event; nothing to recover.",
                path=self.name,
                offset=damage.offset,
            )
        self.warnings.append(
            f"{self.name}: damaged at byte {damage.offset} ({damage.reason}); "
            f"recovered the {self.builder.n} events before it"
        )
        self.eof = True
        return False


def _parse_whole(data: bytes | bytearray, name: str, recover: bool) -> ParsedTrace:
    """The slow, simple path: decode the whole document at once."""
    warnings: list[str] = []
    leading = LEADING.match(data)
    start = leading.end() if leading is not None else 0
    builder = _Builder()
    if data[start : start + 1] == b"[":
        raw_events: Any = data
        meta: dict[str, Any] = {}
    else:
        try:
            top = decode_or_repair(_TOP, data, warnings)
        except msgspec.DecodeError as exc:
            offset = _offset_of(exc)
            if offset is None:
                offset = len(data)
            if not recover:
                raise TraceError(
                    f"{name}: the trace is truncated or corrupt at byte {offset} ({exc}). "
                    "Pass recover=True to tracemagic.load to keep the events before the damage.",
                    path=name,
                    offset=offset,
                ) from None
            raw_events, meta = _recover_whole(data, name, offset)
            warnings.append(f"{name}: damaged at byte {offset}; recovered the events before it.")
        else:
            if not isinstance(top, dict) or "traceEvents" not in top:
                raise TraceError(
                    f"{name}: a JSON object without 'traceEvents'; not a Kineto trace "
                    f"(its keys: {', '.join(list(top)[:8]) or 'none'}).",
                    path=name,
                )
            meta = {}
            for key, raw in top.items():
                if key != "traceEvents":
                    meta[key] = _literal(decode_or_repair(_META, raw, warnings))
            raw_events = top["traceEvents"]
    try:
        events = _decode_events(raw_events, name, warnings)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{name}: corrupt traceEvents ({exc}).", path=name, offset=_offset_of(exc)) from None
    builder.add(events)
    return builder.finish(meta, merge_notes(warnings))


def _recover_whole(data: bytes | bytearray, name: str, offset: int) -> tuple[bytes | bytearray, dict[str, Any]]:
    start = data.find(b'"traceEvents"')
    bracket = data.find(b"[", start) if start >= 0 else -1
    if bracket < 0:
        raise TraceError(
            f"{name}: damaged at byte {offset} before any event; nothing to recover.", path=name, offset=offset
        )
    meta: dict[str, Any] = {}
    head = data[:start].rstrip().rstrip(b",") + b"}"
    try:
        meta = {k: _literal(v) for k, v in decode_or_repair(_META, head).items()}
    except (msgspec.DecodeError, AttributeError):
        meta = {}
    cuts = [m.start() + 1 for m in _NEXT_EVENT.finditer(data, bracket, offset)]
    for cut in reversed(cuts[-64:]):
        candidate = data[bracket:cut] + b"]"
        try:
            decode_or_repair(_LOOSE_EVENTS, candidate)
        except msgspec.DecodeError:
            continue
        return candidate, meta
    raise TraceError(f"{name}: no complete event before the damage at byte {offset}.", path=name, offset=offset)


def parse_source(
    source: Source, *, recover: bool = False, progress: Progress | None = None, chunk: int | None = None
) -> ParsedTrace:
    """Decode one trace file into an events table, a flows table and metadata.

    Raises:
        TraceError: the JSON is damaged (with the byte offset), empty, or not a Kineto trace.
    """
    chunk = chunk or CHUNK_BYTES
    with _gc_paused():
        try:
            kept: list[mmap.mmap] = []  # the pool, once read: the columns are made in it
            with ByteStream(source, block=chunk) as stream, scan_pool(chunk, kept) as pool:
                part = _StreamParser(source, stream, recover, progress, chunk, pool=pool).read()
            return part.finish(pools=kept)
        except UnstreamableError:
            pass
        with ByteStream(source, block=chunk) as stream:
            data = stream.read_all()
            truncated = stream.truncated
        parsed = _parse_whole(data, source.name, recover or truncated)
        if truncated:
            if not recover:
                raise TraceError(
                    f"{source.name}: the gzip stream is cut off (the file is truncated). "
                    "Pass recover=True to tracemagic.load to keep the events before the cut.",
                    path=source.name,
                    offset=len(data),
                )
            parsed.warnings.append(f"{source.name}: gzip stream truncated; recovered what it held")
        if progress is not None:
            progress(source.size, source.size)
        return parsed


def read_part(
    source: Source,
    *,
    base: int = 0,
    chunk: int | None = None,
    progress: Progress | None = None,
    interners: Interners | None = None,
    pool: mmap.mmap | None = None,
) -> Part:
    """Stream-decode ``source`` into columns, strictly (no recovery, no whole-document
    fallback): used on stretches of one file parsed side by side (``trace.split``).

    Args:
        base: the file offset of the source's first byte, so damage is located in the file.
        interners: shared with the other stretches of the file (see ``Interners``).
        pool: ``scan_pool(chunk)``'s memory, used by this thread alone (None: malloc's).

    Raises:
        TraceError: the JSON is damaged.
        UnstreamableError: a layout only the whole-document path reads.
    """
    chunk = chunk or CHUNK_BYTES
    with _gc_paused(), ByteStream(source, block=chunk) as stream:
        return _StreamParser(source, stream, False, progress, chunk, base, interners, pool).read()


def parse_events(data: bytes, name: str, *, recover: bool = False) -> ParsedTrace:
    """Decode one trace's bytes (plain or gzip) into an events table, flows and metadata."""
    return parse_source(Source.from_bytes(name, data), recover=recover)
