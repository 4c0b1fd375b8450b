"""Find the trace files behind a path and stream their bytes (plain, gzip, tar, directories).

Nothing here parses JSON beyond sniffing what a file is, so a wrong file (an Execution
Trace, a memory-timeline dump) is named before any heavy work starts. Files are read block
by block and gzip is decompressed as a stream, so a large trace never sits in memory twice
(compressed and decompressed) nor whole.
"""

from __future__ import annotations

import io
import re
import tarfile
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Protocol

from tracemagic.errors import TraceError

#: file names that hold a Kineto trace inside a directory or tar
_TRACE_NAME = re.compile(r"(\.pt\.trace\.json|kineto_trace_\d+(_\w+)?\.json|trace.*\.json|\.json)(\.gz)?$")
_NOT_KINETO = re.compile(r"(torch_et_|_et\.json|\.et\.json|memory_timeline|capture\.json|\.pfw)")
_RANK_IN_NAME = re.compile(r"(?:rank|worker|kineto_trace_)[-_]?(\d+)", re.IGNORECASE)
#: compressed bytes fed to zlib per step (a trace compresses ~10-30x)
_GZIP_STEP = 1 << 18
_GZIP_MAGIC = b"\x1f\x8b"


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

    @classmethod
    def from_bytes(cls, name: str, data: bytes, rank_hint: int | None = None) -> "Source":
        """A source over bytes already in memory (tests, tar members)."""
        return cls(name, lambda: io.BytesIO(data), len(data), rank_hint)


class ByteStream:
    """The decompressed bytes of a source, block by block.

    ``read()`` gives the next block (``b""`` at the end); ``consumed`` counts the bytes
    taken from the file (for progress), ``truncated`` tells a cut-off gzip stream.
    """

    def __init__(self, source: Source, block: int = 8 << 20) -> None:
        self.source = source
        self.block = block
        self.consumed = 0
        self.truncated = False
        try:
            self._handle = source.opener()
            first = self._handle.read(2)
        except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
            raise TraceError(f"{source.name}: the file cannot be read ({exc}).", path=source.name) from None
        self.consumed = len(first)
        self._gzip = first == _GZIP_MAGIC
        self._pending = first
        self._decomp = zlib.decompressobj(16 + zlib.MAX_WBITS) if self._gzip else None
        self._done = False

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "ByteStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> bytes:
        """The next block of (decompressed) bytes; ``b""`` when the source is exhausted."""
        try:
            return self._read()
        except TraceError:
            raise
        except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
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

    def _read_gzip(self) -> bytes:
        assert self._decomp is not None
        out: list[bytes] = []
        size = 0
        while size < self.block:
            raw = self._pending
            if not raw:
                raw = self._handle.read(_GZIP_STEP)
                self.consumed += len(raw)
            self._pending = b""
            if not raw:
                if not self._decomp.eof:
                    self.truncated = True
                self._done = True
                break
            try:
                chunk = self._decomp.decompress(raw)
            except zlib.error as exc:
                raise TraceError(
                    f"{self.source.name}: the gzip data is corrupt ({exc}) after "
                    f"{self.consumed} compressed bytes; the file cannot be read. Re-copy or "
                    "re-record the trace.",
                    path=self.source.name,
                ) from None
            out.append(chunk)
            size += len(chunk)
            if self._decomp.eof:
                rest = self._decomp.unused_data
                if not rest:
                    rest = self._handle.read(2)
                    self.consumed += len(rest)
                if rest[:2] == _GZIP_MAGIC:  # a multi-member gzip file: go on
                    self._decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    self._pending = rest
                else:  # the end (trailing junk is ignored, like gzip(1) with a warning)
                    self._done = True
                    break
        return b"".join(out)

    def read_all(self) -> bytes:
        """Everything that is left (used on the slow paths: damaged files, odd layouts)."""
        parts = []
        while block := self.read():
            parts.append(block)
        return b"".join(parts)


def rank_from_name(name: str) -> int | None:
    """The rank a file name carries (`rank-3`, `worker3`, `kineto_trace_3`), if any."""
    match = _RANK_IN_NAME.search(Path(name).name)
    return int(match.group(1)) if match else None


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


def file_source(path: Path, rank: int | None = None) -> Source:
    """A source reading ``path`` from disk; its rank is ``rank`` if known, else the name's."""
    hint = rank if rank is not None else rank_from_name(path.name)
    return Source(str(path), lambda: open(path, "rb"), path.stat().st_size, hint, path)


def read_sources(path: Path) -> list[Source]:
    """Every Kineto trace behind ``path``: a file, a .tar/.tar.gz, or a directory of ranks.

    Raises:
        TraceError: the path does not exist or holds no trace.
    """
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory.", path=str(path))
    if path.is_dir():
        return [file_source(p) for p in rank_files(path)]
    if _is_tar(path):
        return _read_tar(path)
    return [file_source(path)]


def _is_tar(path: Path) -> bool:
    return path.name.lower().endswith((".tar", ".tar.gz", ".tgz"))


class _Member(io.RawIOBase):
    """One tar member as a stream that closes its archive with it."""

    def __init__(self, path: Path, name: str) -> None:
        super().__init__()
        self._archive = tarfile.open(path)
        handle = self._archive.extractfile(name)
        if handle is None:  # pragma: no cover - only regular files are listed
            raise TraceError(f"{path}!{name}: not a regular file.", path=str(path))
        self._handle = handle

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._handle.read(size)

    def close(self) -> None:
        if not self.closed:
            self._handle.close()
            self._archive.close()
        super().close()


def _read_tar(path: Path) -> list[Source]:
    """The trace members of a tar; each is read (streamed) only when it is parsed."""
    try:
        with tarfile.open(path) as archive:
            members = [m for m in archive if m.isfile() and is_trace_name(m.name)]
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise TraceError(f"{path}: not a readable tar archive ({exc}).", path=str(path)) from None
    if not members:
        raise TraceError(f"{path}: the archive holds no Kineto trace.", path=str(path))
    return [
        Source(f"{path}!{m.name}", partial(_Member, path, m.name), m.size, rank_from_name(m.name)) for m in members
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
