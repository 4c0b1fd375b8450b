"""Find the trace files behind a path and read their bytes (plain, gzip, tar, directories).

Nothing here parses JSON beyond sniffing what a file is, so a wrong file (an Execution
Trace, a memory-timeline dump) is named before any heavy work starts.
"""

from __future__ import annotations

import gzip
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tracemagic.errors import TraceError

#: file names that hold a Kineto trace inside a directory or tar
_TRACE_NAME = re.compile(r"(\.pt\.trace\.json|kineto_trace_\d+(_\w+)?\.json|trace.*\.json|\.json)(\.gz)?$")
_NOT_KINETO = re.compile(r"(torch_et_|_et\.json|\.et\.json|memory_timeline|capture\.json|\.pfw)")
_RANK_IN_NAME = re.compile(r"(?:rank|worker|kineto_trace_)[-_]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class Source:
    """One trace file's bytes, where they came from, and the rank its name suggests."""

    name: str
    data: bytes
    rank_hint: int | None
    truncated_gzip: bool = False


def rank_from_name(name: str) -> int | None:
    """The rank a file name carries (`rank-3`, `worker3`, `kineto_trace_3`), if any."""
    match = _RANK_IN_NAME.search(Path(name).name)
    return int(match.group(1)) if match else None


def is_trace_name(name: str) -> bool:
    """Whether a file name in a directory or tar looks like a Kineto trace."""
    base = Path(name).name
    return bool(_TRACE_NAME.search(base)) and not _NOT_KINETO.search(base)


def _gunzip(raw: bytes, name: str) -> tuple[bytes, bool]:
    """Decompress gzip bytes; a cut-off stream gives what it held and a flag."""
    try:
        return gzip.decompress(raw), False
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = decomp.decompress(raw)
        except zlib.error:
            raise TraceError(
                f"{name}: the gzip data is corrupt ({exc}); the file cannot be read. "
                "Re-copy or re-record the trace.",
                path=name,
            ) from None
        return data, True


def _decode_bytes(raw: bytes, name: str) -> tuple[bytes, bool]:
    if raw[:2] == b"\x1f\x8b":
        return _gunzip(raw, name)
    return raw, False


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


def read_sources(path: Path) -> list[Source]:
    """Every Kineto trace behind ``path``: a file, a .tar/.tar.gz, or a directory of ranks.

    Raises:
        TraceError: the path does not exist or holds no trace.
    """
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory.", path=str(path))
    if path.is_dir():
        return [_read_file(p) for p in rank_files(path)]
    if _is_tar(path):
        return _read_tar(path)
    return [_read_file(path)]


def _is_tar(path: Path) -> bool:
    return path.name.lower().endswith((".tar", ".tar.gz", ".tgz"))


def _read_file(path: Path) -> Source:
    raw = path.read_bytes()
    data, cut = _decode_bytes(raw, str(path))
    return Source(str(path), data, rank_from_name(path.name), cut)


def _read_tar(path: Path) -> list[Source]:
    try:
        archive = tarfile.open(path)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise TraceError(f"{path}: not a readable tar archive ({exc}).", path=str(path)) from None
    sources = []
    with archive:
        for member in archive.getmembers():
            if not member.isfile() or not is_trace_name(member.name):
                continue
            handle = archive.extractfile(member)
            if handle is None:  # pragma: no cover - isfile() members always extract
                continue
            name = f"{path}!{member.name}"
            data, cut = _decode_bytes(handle.read(), name)
            sources.append(Source(name, data, rank_from_name(member.name), cut))
    if not sources:
        raise TraceError(f"{path}: the archive holds no Kineto trace.", path=str(path))
    return sources


def sniff(data: bytes, name: str) -> None:
    """Raise a clear TraceError when ``data`` is JSON of another kind than a Kineto trace."""
    head = data[:4096].lstrip()
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
    if b'"traceEvents"' not in data[:1 << 20] and re.search(rb'"schema"\s*:', head) and b'"nodes"' in data:
        raise TraceError(
            f"{name}: this is a PyTorch Execution Trace (torch_et), not a Kineto trace. "
            "Pass the Kineto trace recorded with it (kineto_trace_<rank>.json); tracemagic "
            "joins the Execution Trace lying next to it automatically.",
            path=name,
        )
