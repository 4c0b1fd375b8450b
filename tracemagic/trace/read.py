"""Find the trace files behind a path and stream their bytes (plain, gzip, tar, directories).

Nothing here parses JSON beyond sniffing what a file is, so a wrong file (an Execution
Trace, a memory-timeline dump) is named before any heavy work starts. Files are read block
by block and gzip is decompressed as a stream, so a large trace never sits in memory twice
(compressed and decompressed) nor whole.

Inputs come from other people's machines, so what they can cost is bounded: only regular
files are opened (a FIFO would block forever), a folder's symlinks that lead out of it are
not followed, decompression stops at ``max_bytes`` (a 4 MB gzip can inflate to 4 GiB) and,
unless asked (``allow_high_compression``), at a compression ratio no trace has
(``MAX_RATIO``), and an archive is read for at most ``MAX_ARCHIVE_ENTRIES`` entries. Running
out of memory while loading is a ``TraceError`` too (``memory_guard``).
"""

from __future__ import annotations

import functools
import io
import os
import re
import stat
import tarfile
import types
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from tracemagic.errors import TraceError
from tracemagic.trace.kineto import rank_from_name
from tracemagic.trace.layout import ET_PREFIX, KINETO_PREFIX, MANIFEST, MEMORY_PREFIX

_inflate: types.ModuleType
try:  # ISA-L's inflate (python-isal, zlib's API): a trace's gzip in 0.4x zlib's time
    from isal import isal_zlib as _inflate
except ImportError:  # pragma: no cover - a platform without its wheel: zlib, same results
    _inflate = zlib

#: file names that hold a Kineto trace inside a directory or tar
_TRACE_NAME = re.compile(rf"(\.pt\.trace\.json|{KINETO_PREFIX}\d+(_\w+)?\.json|trace.*\.json|\.json)(\.gz)?$")
_NOT_KINETO = re.compile(
    rf"({ET_PREFIX}|_et\.json|\.et\.json|{MEMORY_PREFIX.rstrip('_')}|{re.escape(MANIFEST)}|\.pfw"
    r"|_slow\d+\.json)"  # a --slow recording (layout.SLOW_FILE) is no rank: it loads on its own
)
#: what a damaged gzip stream raises (zlib's, and ISA-L's where it inflates)
INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error,) if _inflate is zlib else (zlib.error, _inflate.error)
#: what reading a (gzip, tar) file raises when it is damaged or unreadable
_READ_ERRORS: tuple[type[Exception], ...] = (OSError, EOFError, tarfile.TarError, *INFLATE_ERRORS)
#: compressed bytes fed to the inflater per step (a trace compresses ~10-30x)
_GZIP_STEP = 1 << 18
_GZIP_MAGIC = b"\x1f\x8b"
#: entries of a tar archive read at most (each costs a header read; a tar of thousands of
#: tiny files is no trace)
MAX_ARCHIVE_ENTRIES = 10_000
#: the default ``max_bytes`` is this share of the memory available (the tables of a trace
#: take about as much memory as its JSON), and at least ``MIN_MAX_BYTES``
MEMORY_SHARE = 0.5
MIN_MAX_BYTES = 256 << 20
#: the most a gzip may inflate (JSON bytes per compressed byte) unless the user allows more:
#: real Kineto traces compress 7x to 30x (``tests/data/traces``), gzip at most ~1,030x, and a
#: decompression bomb (a 4 MB file of 4 GiB) ~1,000x
MAX_RATIO = 200
#: the ratio is checked once this much JSON came out: below it ``max_bytes`` is bound enough
#: (and a small file's ratio says little)
RATIO_CHECK_BYTES = 64 << 20


def available_memory() -> int | None:
    """Bytes of memory available now: ``MemAvailable`` (Linux), else the physical memory
    (``os.sysconf``); None where neither is known."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def default_max_bytes() -> int:
    """How much JSON one load may decompress by default: half the memory available (at least
    256 MiB; 8 GiB where the memory is not known)."""
    memory = available_memory()
    if memory is None:
        return 8 << 30
    return max(int(memory * MEMORY_SHARE), MIN_MAX_BYTES)


def _too_big(name: str, limit: int) -> TraceError:
    return TraceError(
        f"{name}: decompresses to more than {limit:,} bytes (max_bytes; by default half the memory "
        "available), more than this machine can load. If the trace is real, pass a larger "
        "max_bytes= to tracemagic.load (or load it on a machine with more memory); a small "
        "file that inflates this much is a decompression bomb.",
        path=name,
    )


def _too_compressed(name: str, produced: int, packed: int, ratio: float) -> TraceError:
    return TraceError(
        f"{name}: {packed:,} compressed bytes inflated to more than {produced:,} bytes of JSON "
        f"(over {ratio:g} times; real traces compress 7 to 30 times), so this looks like a "
        "decompression bomb and was not loaded. If the trace is real, pass "
        "allow_high_compression=True to tracemagic.load (and a max_bytes= large enough for it).",
        path=name,
    )


@contextmanager
def memory_guard(name: str, max_bytes: int | None) -> Iterator[None]:
    """Turn running out of memory while loading ``name`` into a ``TraceError`` that says
    what to do (``max_bytes`` bounds the JSON a load decompresses, not the tables made of it)."""
    try:
        yield
    except MemoryError:
        limit = "no limit" if max_bytes is None else f"max_bytes={max_bytes:,}"
        raise TraceError(
            f"{name}: this machine ran out of memory loading the trace ({limit}; the JSON and "
            "the tables made from it need about twice its size). Pass a smaller max_bytes= to "
            "tracemagic.load to be told early, free memory, or load it on a machine with more; "
            "tracemagic.load_ranks opens a job's ranks one at a time.",
            path=name,
        ) from None


class Readable(Protocol):
    """What a source opens: a binary stream, read front to back and closed."""

    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Source:
    """One trace file: how to open it, its (on-disk) size, and the rank its name suggests."""

    name: str
    opener: Callable[[], Readable]
    size: int
    rank_hint: int | None
    #: the file on disk, when the source is one (not a tar member or bytes)
    path: Path | None = None
    #: decompressed bytes it may give at most (None: no limit)
    max_bytes: int | None = None
    #: the most its gzip may inflate, past ``RATIO_CHECK_BYTES`` (None: no limit)
    max_ratio: float | None = None

    @classmethod
    def from_bytes(cls, name: str, data: bytes, rank_hint: int | None = None) -> Source:
        """A source over bytes already in memory (tests, tar members)."""
        return cls(name, lambda: io.BytesIO(data), len(data), rank_hint)


class ByteStream:
    """The decompressed bytes of a source, block by block.

    ``read()`` gives the next block (``b""`` at the end); ``consumed`` counts the bytes
    taken from the file (for progress), ``truncated`` tells a cut-off gzip stream.

    Raises (from ``read``): ``TraceError`` when the source gives more than its ``max_bytes``
    or its gzip inflates more than ``max_ratio`` times.
    """

    def __init__(self, source: Source, block: int = 8 << 20) -> None:
        self.source = source
        self.block = block
        self.consumed = 0
        self.produced = 0  # decompressed bytes given
        self.packed = 0  # compressed bytes inflated so far (read-ahead not counted)
        self.truncated = False
        try:
            self._handle = source.opener()
            first = self._handle.read(2)
        except _READ_ERRORS as exc:
            raise TraceError(f"{source.name}: the file cannot be read ({exc}).", path=source.name) from None
        self.consumed = len(first)
        self._gzip = first == _GZIP_MAGIC
        self._pending = first
        self._decomp = _inflate.decompressobj(16 + zlib.MAX_WBITS) if self._gzip else None
        self._done = False

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> ByteStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> bytes:
        """The next block of (decompressed) bytes; ``b""`` when the source is exhausted."""
        return self._checked(self._read)

    def _checked(self, read: Callable[[], bytes]) -> bytes:
        """``read()``, its I/O and decompression errors a ``TraceError`` that names the file."""
        try:
            return read()
        except TraceError:
            raise
        except _READ_ERRORS as exc:
            raise TraceError(
                f"{self.source.name}: the file cannot be read after {self.consumed} bytes ({exc}); "
                "it is truncated or damaged.",
                path=self.source.name,
            ) from None

    def _read(self) -> bytes:
        if self._done:
            return b""
        if not self._gzip:
            more = self._handle.read(self.block - len(self._pending))
            self.consumed += len(more)
            data = self._pending + more
            self._pending = b""
            if not data:
                self._done = True
            return data
        return self._read_gzip()

    def _read_gzip(self, sink: Callable[[bytes], object] | None = None) -> bytes:
        """The next block decompressed; each piece handed to ``sink`` instead where one is
        given (``read_all``, ``read_blocks``: no block joined), then ``b""``."""
        assert self._decomp is not None
        out: list[bytes] = []
        size = 0
        while size < self.block:
            raw = self._decomp.unconsumed_tail  # input left over when the last block filled
            if not raw:
                raw, self._pending = self._pending, b""
            if not raw:
                raw = self._handle.read(_GZIP_STEP)
                self.consumed += len(raw)
            if not raw:
                if not self._decomp.eof:
                    self.truncated = True
                self._done = True
                break
            try:  # at most the rest of the block: a bomb inflates by 1,000x per call
                chunk = self._decomp.decompress(raw, self.block - size)
                self.packed += len(raw) - len(self._decomp.unconsumed_tail) - len(self._decomp.unused_data)
            except INFLATE_ERRORS as exc:
                raise TraceError(
                    f"{self.source.name}: the gzip data is corrupt ({exc}) after "
                    f"{self.consumed} compressed bytes; the file cannot be read. Re-copy or "
                    "re-record the trace.",
                    path=self.source.name,
                ) from None
            (out.append if sink is None else sink)(chunk)
            size += len(chunk)
            self.produced += len(chunk)
            if self.source.max_bytes is not None and self.produced > self.source.max_bytes:
                raise _too_big(self.source.name, self.source.max_bytes)
            ratio = self.source.max_ratio
            if ratio is not None and self.produced > RATIO_CHECK_BYTES and self.produced > ratio * max(self.packed, 1):
                raise _too_compressed(self.source.name, self.produced, self.packed, ratio)
            if self._decomp.eof:
                rest = self._decomp.unused_data
                if not rest:
                    rest = self._handle.read(2)
                    self.consumed += len(rest)
                if rest[:2] == _GZIP_MAGIC:  # a multi-member gzip file: go on
                    self._decomp = _inflate.decompressobj(16 + zlib.MAX_WBITS)
                    self._pending = rest
                else:  # the end (trailing junk is ignored, like gzip(1) with a warning)
                    self._done = True
                    break
        return b"".join(out)

    def read_all(self) -> bytearray:
        """Everything that is left (used on the slow paths: damaged files, odd layouts), in
        one buffer grown in place (a list of blocks joined would need the size twice)."""
        out = bytearray()
        if self._gzip:
            while not self._done:
                self._checked(lambda: self._read_gzip(out.extend))
            return out
        while block := self.read():
            out += block
        return out

    def read_blocks(self) -> list[bytes]:
        """Everything that is left, as the blocks it came in (gzip: as inflated, none
        copied again): for a reader that copies out the ranges it needs anyway."""
        blocks: list[bytes] = []
        if self._gzip:
            while not self._done:
                self._checked(lambda: self._read_gzip(blocks.append))
            return blocks
        while block := self.read():
            blocks.append(block)
        return blocks


def is_trace_name(name: str) -> bool:
    """Whether a file name in a directory or tar looks like a Kineto trace.

    Hidden files (caches, editors' lock and swap files, macOS ``._`` resource forks) and
    editor backups (``~``, ``#...#``, ``.bak``, ``.orig``, ``.swp``) are not: only names
    that end in ``.json`` or ``.json.gz`` count.
    """
    base = Path(name).name
    if base.startswith((".", "#", "~")):
        return False
    return bool(_TRACE_NAME.search(base)) and not _NOT_KINETO.search(base)


def rank_files(path: Path) -> list[Path]:
    """The Kineto trace files in a directory (one per rank, or per profiler cycle).

    Raises:
        TraceError: the directory holds none.
    """
    files = sorted(p for p in path.iterdir() if p.is_file() and is_trace_name(p.name))
    if not files:
        raise TraceError(
            f"{path}: this directory holds no Kineto trace (*.json, *.json.gz, "
            "*.pt.trace.json). Pass a trace file or a capture directory.",
            path=str(path),
        )
    return files


def file_source(
    path: Path, rank: int | None = None, max_bytes: int | None = None, max_ratio: float | None = None
) -> Source:
    """A source reading ``path`` from disk; its rank is ``rank`` if known, else the name's.

    Raises:
        TraceError: ``path`` is not a regular file (a FIFO would block the read forever).
    """
    hint = rank if rank is not None else rank_from_name(path.name)
    size = regular_file(path).st_size
    return Source(str(path), lambda: open(path, "rb"), size, hint, path, max_bytes, max_ratio)


def regular_file(path: Path) -> os.stat_result:
    """``path``'s stat (symlinks followed) if it is a regular file.

    Raises:
        TraceError: it is not there, or is a FIFO, socket, device or folder.
    """
    try:
        info = path.stat()
    except OSError as exc:
        raise TraceError(f"{path}: cannot be read ({exc.strerror or exc}).", path=str(path)) from None
    if not stat.S_ISREG(info.st_mode):
        raise TraceError(
            f"{path}: not a regular file (a FIFO, socket or device); tracemagic reads trace files "
            "only. Save the trace to a file and load that.",
            path=str(path),
        )
    return info


def inside(folder: Path, files: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """The ``files`` of ``folder`` that really lie in it, and those that do not (symlinks that
    lead out of it: a folder from someone else must not make tracemagic read elsewhere)."""
    root = folder.resolve()
    kept: list[Path] = []
    outside: list[Path] = []
    for file in files:
        try:
            real = file.resolve(strict=True)
        except (OSError, RuntimeError):  # a broken link or a loop
            outside.append(file)
            continue
        (kept if real.is_relative_to(root) else outside).append(file)
    return kept, outside


def read_sources(path: Path, max_bytes: int | None = None, max_ratio: float | None = None) -> list[Source]:
    """Every Kineto trace behind ``path``: a file, a .tar/.tar.gz, or a directory of ranks,
    each to give at most ``max_bytes`` of JSON, its gzip inflating at most ``max_ratio`` times.

    Raises:
        TraceError: the path does not exist or holds no trace.
    """
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory.", path=str(path))
    if path.is_dir():
        files, _ = inside(path, rank_files(path))
        return [file_source(p, max_bytes=max_bytes, max_ratio=max_ratio) for p in files]
    regular_file(path)
    if is_tar(path):
        return _read_tar(path, max_bytes, max_ratio)
    return [file_source(path, max_bytes=max_bytes, max_ratio=max_ratio)]


def is_tar(path: Path) -> bool:
    return path.name.lower().endswith((".tar", ".tar.gz", ".tgz"))


class _Archive:
    """A tar archive opened once for all its members. They are read in archive order, so a
    compressed archive is decompressed about once (opened anew for each member, it would be
    decompressed from its start every time: hours for thousands of members)."""

    def __init__(self, path: Path, members: list[tarfile.TarInfo]) -> None:
        self.path = path
        self.members = members
        self._tar: tarfile.TarFile | None = None

    def open(self, member: tarfile.TarInfo) -> _Member:
        if self._tar is None:
            self._tar = tarfile.open(self.path)  # noqa: SIM115 - open for all members, closed by done()
        handle = self._tar.extractfile(member)  # by its TarInfo: by name reads every header first
        if handle is None:  # pragma: no cover - only regular files are listed
            raise TraceError(f"{self.path}!{member.name}: not a regular file.", path=str(self.path))
        return _Member(self, member, handle)

    def done(self, member: tarfile.TarInfo) -> None:
        """A member's stream was closed: after the last member's, close the archive."""
        if member is self.members[-1] and self._tar is not None:
            self._tar.close()
            self._tar = None


class _Member(io.RawIOBase):
    """One tar member as a stream."""

    def __init__(self, archive: _Archive, member: tarfile.TarInfo, handle: IO[bytes]) -> None:
        super().__init__()
        self._archive = archive
        self._member = member
        self._handle = handle

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._handle.read(size)

    def close(self) -> None:
        if not self.closed:
            self._handle.close()
            self._archive.done(self._member)
        super().close()


def _read_tar(path: Path, max_bytes: int | None = None, max_ratio: float | None = None) -> list[Source]:
    """The trace members of a tar; each is read (streamed) only when it is parsed.

    Raises:
        TraceError: the archive is damaged, holds no trace, has more than
            ``MAX_ARCHIVE_ENTRIES`` entries, or its traces hold more than ``max_bytes``, or
            more than ``max_ratio`` times the compressed archive's size.
    """
    members: list[tarfile.TarInfo] = []
    try:
        with tarfile.open(path) as archive:
            for count, member in enumerate(archive, 1):
                if count > MAX_ARCHIVE_ENTRIES:
                    raise TraceError(
                        f"{path}: the archive has more than {MAX_ARCHIVE_ENTRIES:,} entries; tracemagic "
                        "reads archives of rank traces. Extract the traces you want and load their folder.",
                        path=str(path),
                    )
                if member.isfile() and is_trace_name(member.name):
                    members.append(member)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise TraceError(f"{path}: not a readable tar archive ({exc}).", path=str(path)) from None
    if not members:
        raise TraceError(f"{path}: the archive holds no Kineto trace.", path=str(path))
    total = sum(m.size for m in members)
    if max_bytes is not None and total > max_bytes:
        raise _too_big(f"{path} (its {len(members)} traces)", max_bytes)
    packed = path.stat().st_size
    if max_ratio is not None and total > RATIO_CHECK_BYTES and total > max_ratio * packed:
        raise _too_compressed(f"{path} (its {len(members)} traces)", total, packed, max_ratio)
    reader = _Archive(path, members)
    return [
        Source(
            f"{path}!{m.name}",
            functools.partial(reader.open, m),
            m.size,
            rank_from_name(m.name),
            max_bytes=max_bytes,
            max_ratio=max_ratio,
        )
        for m in members
    ]


def sniff(head: bytes, name: str) -> None:
    """Raise a clear TraceError when the file's first block is not a Kineto trace's."""
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head:
        raise TraceError(f"{name}: the file is empty.", path=name, offset=0)
    if head[:1] == b"[":
        # Chrome-trace array form starts with an object; a memory timeline with a list
        if re.match(rb"\[\s*\[", head):
            raise TraceError(
                f"{name}: this is a memory-timeline dump (rows of [ts, action, bytes, "
                "category] written by profile.export_memory_timeline), not a Kineto trace. "
                "Load the Kineto trace of the same run; tracemagic reads memory from it.",
                path=name,
            )
        return
    if head[:1] != b"{":
        raise TraceError(
            f"{name}: not a JSON trace (it starts with {head[:16]!r}). Expected a Kineto "
            "trace (.json or .json.gz) as written by torch.profiler.",
            path=name,
            offset=0,
        )
    if b'"traceEvents"' not in head and re.search(rb'"schema"\s*:', head[:4096]) and b'"nodes"' in head:
        raise TraceError(
            f"{name}: this is a PyTorch Execution Trace (torch_et), not a Kineto trace. "
            "Pass the Kineto trace recorded with it (kineto_trace_<rank>.json); tracemagic "
            "joins the Execution Trace lying next to it automatically.",
            path=name,
        )
