"""Arrow cache of parsed traces, so reopening a trace is near-instant.

Where it lives: a capture directory written by tracemagic (its ``capture.json`` names a
tracemagic version) keeps the cache of its traces inside itself, in ``.tracemagic-cache/``.
Any other trace, a colleague's file in a shared folder or a git checkout, is cached in the
user cache folder: ``cache_dir=`` if given, else ``$TRACEMAGIC_CACHE_DIR``, else
``$XDG_CACHE_HOME/tracemagic`` (``~/.cache/tracemagic``), under a digest of the source's
resolved path; nothing is written next to it. The user cache is capped
(``$TRACEMAGIC_CACHE_SIZE``, e.g. ``500M``, default 4 GiB): after each write the least
recently used entries go until it fits. ``tracemagic cache info|clear`` shows and empties it.

An entry is three files: the events (``<name>.arrow``), the flows (``<name>.flows.arrow``)
and, written last, the seal (``<name>.seal``): the source's identity and the size and
checksum of both Arrow files, with a CRC-32 of the seal itself. The identity is, per source
file, its resolved path, size and mtime and a CRC-32 of its bytes (all of them up to 4 MiB,
else its first and last MiB and 16 blocks spread over it; a gzip file's last bytes are
the CRC of its whole content). On open the identity is computed again, each Arrow file's
size and checksum verified over its mapped bytes, and the tables Arrow reads from them fully
validated: a damaged cache, an edited source or another trace's file means a fresh parse,
never a wrong table nor a crash.

The checksum (``checksum``) reads every byte but is not a CRC of every byte, which cost
~30-50 ms per 47 MB (a 100 MB trace) at each open: the file is seen as a grid of 64-bit
words, 8192 to a row (64 KiB), and the checksum is a BLAKE2b digest of the wrapping sums of
every row and of every column (numpy sums at memory speed) and of the bytes after the last
whole row. It detects any change of size, any
change of one or two words (a byte, a bit, a value), any two words swapped (they would have
to share both row and column), rows zeroed, torn, repeated or out of order, and any other
damage unless it keeps all 2 x 8192-per-row sums (a rectangle of four words changed by
+d, -d, -d, +d: no accident looks like that). No checksum stops someone who edits a cache
on purpose and rewrites its seal to match (the seal is not signed; a CRC-32 did not stop
them either): against that, Arrow's full validation of what is read
(``Table.validate(full=True)``: buffer sizes, string offsets and UTF-8, dictionary codes
within their categories, ~3 ms) means such a cache is parsed again, or gives wrong numbers,
but never a crash or a code outside its categories.

The format is the Arrow IPC file (Feather v2), uncompressed, so a cache is opened by
mapping it into memory: the numeric columns are the mapped file itself (a private,
copy-on-write mapping, so they stay writable and edits never reach the file), with no
decoding and no per-row work. It takes about half the JSON's size on disk; LZ4 made it
~8x smaller but reopening several times slower, as slow as a third of a fresh parse
(``bench/bench_load.py``), and Parquet slower still. Only Arrow data and JSON metadata
are read back: nothing from a cache or a trace is ever executed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from tracemagic.errors import TraceError
from tracemagic.trace import layout
from tracemagic.trace.columns import all_missing

_log = logging.getLogger(__name__)

#: bump when the events table's columns or meaning, or the entry's files, change
FORMAT = 11
EVENTS_SUFFIX = ".arrow"
FLOWS_SUFFIX = ".flows.arrow"
SEAL_SUFFIX = ".seal"
#: the folder inside a capture directory that holds its cache
CAPTURE_FOLDER = ".tracemagic-cache"
#: the user cache's cap unless ``$TRACEMAGIC_CACHE_SIZE`` says otherwise
DEFAULT_MAX_BYTES = 4 * 2**30
_META_KEY = b"tracemagic"
#: a source up to this size is checksummed whole; a larger one by its edges and samples
_WHOLE = 4 << 20
_EDGE = 1 << 20
_SAMPLES = 16
_SAMPLE = 64 << 10
#: the row of the Arrow files' checksum: 8192 64-bit words (64 KiB)
_BLOCK_WORDS = 8192
#: the files of the user cache's entries (temporary files of an unfinished write included)
_ENTRY_FILE = re.compile(r"^\.?([0-9a-f]{24})(\.arrow|\.flows\.arrow|\.seal)(\..*\.tmp)?$")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

PathLike = str | os.PathLike[str]


def user_cache_dir() -> Path:
    """The user cache folder: ``$TRACEMAGIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/tracemagic``
    (``~/.cache/tracemagic`` when ``XDG_CACHE_HOME`` is unset)."""
    explicit = os.environ.get("TRACEMAGIC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tracemagic"


def max_bytes() -> int:
    """The user cache's cap in bytes: ``$TRACEMAGIC_CACHE_SIZE`` (``500M``, ``4G``, ``0``
    keeps nothing), default 4 GiB.

    Raises:
        TraceError: the variable is not a size.
    """
    raw = os.environ.get("TRACEMAGIC_CACHE_SIZE", "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", raw, re.IGNORECASE)
    if match is None:
        raise TraceError(
            f"TRACEMAGIC_CACHE_SIZE={raw!r} is not a size: give bytes or a number with K, M, G "
            "or T (e.g. 500M, 4G; 0 keeps no cache)."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def writable(folder: Path) -> bool:
    """Whether we may write into ``folder``: it has write bits and we have write access
    (root ignores the bits, but a folder someone made read-only is never written into)."""
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return bool(mode & 0o222) and os.access(folder, os.W_OK)


# -- which source, and where its cache lies --------------------------------------------------


def _fingerprint(path: Path, size: int) -> int:
    """A CRC-32 of the file's bytes: all of them up to ``_WHOLE``, else the first and last
    MiB and ``_SAMPLES`` blocks spread between (a few ms at most)."""
    with open(path, "rb") as handle:
        if size <= _WHOLE:
            return zlib.crc32(handle.read())
        blocks = [(0, _EDGE), *((size * i // (_SAMPLES + 1), _SAMPLE) for i in range(1, _SAMPLES + 1)), (size - _EDGE, _EDGE)]
        crc = 0
        for offset, length in blocks:
            handle.seek(offset)
            crc = zlib.crc32(handle.read(length), crc)
        return crc


def identity(sources: list[Path], recover: bool) -> str:
    """What a cache must have been written for: the format, ``recover``, and each source
    file's resolved path, size, mtime and fingerprint.

    Raises:
        OSError: a source cannot be read.
    """
    described = []
    for source in sources:
        stat = source.stat()
        described.append([str(source.resolve()), stat.st_size, stat.st_mtime_ns, _fingerprint(source, stat.st_size)])
    return json.dumps({"format": FORMAT, "recover": recover, "sources": described}, separators=(",", ":"))


def capture_home(path: Path) -> Path | None:
    """The capture directory written by tracemagic that ``path`` is or lies in, if any
    (its ``capture.json`` names the tracemagic version that wrote it)."""
    folder = path if path.is_dir() else path.parent
    try:
        manifest = layout.read_manifest(folder / layout.MANIFEST)
    except TraceError:
        return None
    versions = manifest.get("versions") if isinstance(manifest, dict) else None
    return folder if isinstance(versions, dict) and versions.get("tracemagic") else None


@dataclass(frozen=True)
class Entry:
    """The cache of one ``load``: where it may lie and what it must have been written for.

    Attributes:
        places: the entry's base paths (file name without suffix), read and written in
            this order: inside the capture directory first, when there is one.
        sources: the files parsed.
        recover: whether they are parsed with ``recover=True``.
        identity: their identity (see ``identity``).
        capped: the places in a user cache folder, which is kept under ``max_bytes()``.
    """

    places: tuple[Path, ...]
    sources: tuple[Path, ...]
    recover: bool
    identity: str
    capped: frozenset[Path]


def entry(path: Path, files: list[Path] | None, recover: bool, cache_dir: PathLike | None = None) -> Entry:
    """The cache entry of ``load(path)``: ``cache_dir`` if given, else inside the capture
    directory tracemagic wrote (if it is one), then the user cache folder.

    Raises:
        OSError: a source cannot be read.
        TraceError: ``$TRACEMAGIC_CACHE_SIZE`` is not a size.
    """
    max_bytes()  # a bad cap is reported on every load, not only when a cache is written
    sources = tuple(files if files is not None else [path])
    resolved = path.resolve()
    suffix = "-recover" if recover else ""
    places: list[Path] = []
    home = capture_home(path) if cache_dir is None else None
    if home is not None:
        inner = path.name if resolved != home.resolve() else "traces"
        places.append(home / CAPTURE_FOLDER / f"{inner}{suffix}")
    folder = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    user = folder / hashlib.sha256(os.fsencode(f"{resolved}{suffix}")).hexdigest()[:24]  # any file name
    places.append(user)
    return Entry(tuple(places), sources, recover, identity(list(sources), recover), frozenset([user]))


def locations(path: PathLike, cache_dir: PathLike | None = None, recover: bool = False) -> list[Path]:
    """The seal files ``load(path)`` would look for, in order (for tools and tests)."""
    found = entry(Path(path), None, recover, cache_dir).places
    return [_file(base, SEAL_SUFFIX) for base in found]


def _file(base: Path, suffix: str) -> Path:
    return base.with_name(base.name + suffix)


# -- reading -----------------------------------------------------------------------------------


def checksum(data: Any) -> str:
    """The checksum of an Arrow file's bytes (``data``: a buffer, e.g. its mapping): a
    BLAKE2b digest of the wrapping sums of the rows and of the columns of its little-endian
    64-bit words laid out 8192 to a row, then of the bytes after the last whole row. It
    reads every byte at memory speed, several times faster than a CRC-32 of them all; what
    it detects: the module doc."""
    with memoryview(data) as view:
        flat = view.cast("B")
        whole = len(flat) // (8 * _BLOCK_WORDS) * _BLOCK_WORDS
        grid = np.frombuffer(flat, dtype="<u8", count=whole).reshape(-1, _BLOCK_WORDS)
        rows = grid.sum(axis=1, dtype=np.uint64)  # modulo 2**64
        columns = grid.sum(axis=0, dtype=np.uint64)
        del grid  # the mapping must hold no export when it is closed
        digest = hashlib.blake2b(rows.tobytes(), digest_size=16)
        digest.update(columns.tobytes())
        digest.update(flat[whole * 8 :])
        return digest.hexdigest()


def _read_seal(base: Path) -> dict[str, Any] | None:
    """The entry's seal if it is whole (its CRC matches), else None."""
    try:
        raw = _file(base, SEAL_SUFFIX).read_bytes()
        crc, _, body = raw.partition(b"\n")
        if int(crc, 16) != zlib.crc32(body):
            return None
        seal = json.loads(body)
    except (OSError, ValueError):
        return None
    return seal if isinstance(seal, dict) else None


def read(found: Entry) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]] | None:
    """The cached tables of ``found``, or None (missing, stale, damaged or another's)."""
    for base in found.places:
        seal = _read_seal(base)
        if seal is None or seal.get("format") != FORMAT or seal.get("source") != found.identity:
            continue
        try:
            events_file = _Mapped(_file(base, EVENTS_SUFFIX), seal["events"])
            flows_file = _Mapped(_file(base, FLOWS_SUFFIX), seal["flows"])
            stored = events_file.layout()
            events = events_file.frame(stored)
            flows = flows_file.frame(flows_file.layout())
            meta = stored["meta"]
            for section in ("ranks", "processes", "threads"):
                meta[section] = {int(k): v for k, v in meta.get(section, {}).items()}
        except (OSError, KeyError, ValueError, TypeError, AttributeError, pa.ArrowException):
            _log.debug("%s: cache entry unreadable, the trace is parsed again", base, exc_info=True)
            continue  # missing, damaged or foreign: parse the trace again
        if base in found.capped:
            _touch(_file(base, SEAL_SUFFIX))
        return events, flows, meta
    return None


def _touch(path: Path) -> None:
    """Mark an entry used now (least recently used entries are evicted first)."""
    try:
        os.utime(path)
    except OSError:
        pass


class _Mapped:
    """An Arrow IPC file mapped copy-on-write, its size and checksum checked against the
    seal's: its columns read in place, and writable."""

    def __init__(self, path: Path, sealed: dict[str, Any]) -> None:
        with open(path, "rb") as handle:
            self.memory = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self.memory) != sealed["bytes"] or checksum(self.memory) != sealed["sum"]:
            raise ValueError(f"{path}: not the file its seal describes")
        self.buffer = pa.py_buffer(self.memory)
        self.reader = pa.ipc.open_file(pa.BufferReader(self.buffer))

    def layout(self) -> Any:
        """The JSON the writer stored with the table (metadata, how to rebuild it)."""
        return json.loads((self.reader.schema.metadata or {})[_META_KEY])

    def frame(self, layout: dict[str, Any]) -> pd.DataFrame:
        """The table, fully validated (a cache with a forged seal: ArrowInvalid, not a crash)."""
        table = self.reader.read_all()
        table.validate(full=True)
        return _frame(table, layout, self._values)

    def _values(self, array: pa.Array) -> np.ndarray:
        """A numeric column's values as writable numpy: a view of the mapping where the
        column lies in it, else a copy."""
        kind = array.type
        dtype = np.dtype(kind.to_pandas_dtype())
        data = array.buffers()[1]
        offset = data.address - self.buffer.address + array.offset * dtype.itemsize
        if 0 <= offset and offset + len(array) * dtype.itemsize <= self.buffer.size:
            return np.frombuffer(self.memory, dtype=dtype, count=len(array), offset=offset)
        return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize).copy()


def _numbers(values: np.ndarray, array: pa.Array, nullable: bool) -> Any:
    """A numeric Arrow column (``values``: its data) as numpy, or a nullable ``Int64``/``Float64`` array."""
    if not nullable:
        return values
    if array.null_count:
        mask = array.is_null().to_numpy(zero_copy_only=False)
    else:
        mask = np.zeros(len(array), dtype=bool)
    return pd.arrays.FloatingArray(values, mask) if pa.types.is_floating(array.type) else pd.arrays.IntegerArray(values, mask)


def _column(array: pa.Array, nullable: bool, values: Callable[[pa.Array], np.ndarray]) -> Any:
    """One Arrow column as the array a fresh parse makes (categoricals with ``str``
    categories, nullable ``Int64``/``Float64``, writable numpy)."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        indices = array.indices.fill_null(-1) if array.null_count else array.indices
        codes = indices.to_numpy(zero_copy_only=False)
        categories = pd.Index(array.dictionary.to_pylist(), dtype="str")
        return pd.Categorical.from_codes(codes, categories=categories, validate=False)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return _numbers(values(array), array, nullable)
    return array.to_pandas()


def _all_missing_column(dtype: str, n: int) -> Any:
    if dtype == "category":
        return pd.Categorical.from_codes(np.full(n, -1, dtype=np.int8), categories=pd.Index([], dtype="str"), validate=False)
    return all_missing(n, floating=dtype == "Float64")


def _frame(table: pa.Table, layout: dict[str, Any], values: Callable[[pa.Array], np.ndarray]) -> pd.DataFrame:
    """The table as the frame a fresh parse makes: the all-missing columns ``write`` left
    out put back, in the original column order."""
    nullable = set(layout.get("nullable") or ())
    data: dict[str, Any] = {}
    for name, chunked in zip(table.column_names, table.columns):
        array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        data[name] = _column(array, name in nullable, values)
    for name, dtype in (layout.get("missing") or {}).items():
        data[name] = _all_missing_column(dtype, table.num_rows)
    return pd.DataFrame({name: data[name] for name in layout.get("columns") or list(data)}, copy=False)


def _layout(frame: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The columns worth storing, and how to rebuild the frame: its column order, the
    nullable numeric columns, and the all-missing columns (most args columns of a CPU
    trace), which are not stored but remade on read."""
    missing: dict[str, str] = {}
    nullable: list[str] = []
    for column in frame.columns:
        dtype = frame[column].dtype
        if isinstance(dtype, pd.CategoricalDtype):
            if len(dtype.categories) == 0:
                missing[column] = "category"
        elif str(dtype) in ("Int64", "Float64"):
            if frame[column].notna().any():
                nullable.append(column)
            else:
                missing[column] = str(dtype)
    layout = {"columns": list(frame.columns), "missing": missing, "nullable": nullable}
    return frame.drop(columns=list(missing)), layout


# -- writing -----------------------------------------------------------------------------------


def _write_atomic(data: pa.Table | bytes, target: Path) -> dict[str, Any]:
    """Write an Arrow table (or bytes) to ``target`` through a temporary file, so readers
    never see half a file; returns its size and ``checksum``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if isinstance(data, bytes):
            Path(tmp).write_bytes(data)
        else:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, data.schema) as writer:
                writer.write_table(data, max_chunksize=max(data.num_rows, 1))
        with open(tmp, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as written:
            sealed = {"bytes": len(written), "sum": checksum(written)}
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sealed


def _table(frame: pd.DataFrame, stored: dict[str, Any]) -> pa.Table:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    payload = json.dumps(stored, default=str).encode()
    return table.replace_schema_metadata({_META_KEY: payload})


def write(found: Entry, trace: Path, events: pd.DataFrame, flows: pd.DataFrame, meta: dict[str, Any]) -> Path | None:
    """Store the tables at the first place of ``found`` that takes them (a capture
    directory only if its folder is writable); returns the seal written, or None.

    Nothing is stored when a source changed while it was parsed, and a write into a user
    cache folder evicts its least recently used entries beyond ``max_bytes()``.
    """
    try:
        if identity(list(found.sources), found.recover) != found.identity:
            return None  # the file changed under us: these tables are of neither version
    except OSError:
        return None
    kept, layout = _layout(events)
    table = _table(kept, {"meta": meta, **layout})
    flow_kept, flow_layout = _layout(flows)
    flow_table = _table(flow_kept, flow_layout)
    for base in found.places:
        if base not in found.capped and not writable(base.parent.parent):
            continue  # a capture directory someone made read-only
        try:
            _file(base, SEAL_SUFFIX).unlink(missing_ok=True)
            seal = {
                "format": FORMAT,
                "source": found.identity,
                "trace": str(trace.resolve()),
                "events": _write_atomic(table, _file(base, EVENTS_SUFFIX)),
                "flows": _write_atomic(flow_table, _file(base, FLOWS_SUFFIX)),
            }
            body = json.dumps(seal, separators=(",", ":")).encode()
            _write_atomic(f"{zlib.crc32(body):08x}\n".encode() + body, _file(base, SEAL_SUFFIX))
        except OSError as exc:
            _log.debug("%s: cache not written here (%s)", base, exc)
            continue
        if base in found.capped:
            evict(base.parent, keep=base.name)
        return _file(base, SEAL_SUFFIX)
    return None


# -- the user cache folder ----------------------------------------------------------------------


@dataclass(frozen=True)
class CachedTrace:
    """One entry of a user cache folder.

    Attributes:
        name: its file name without suffix (a digest of the trace's path).
        files: its files (events, flows, seal; a temporary file of an unfinished write).
        bytes: their size.
        last_used: when it was last written or read (seconds since the epoch).
        trace: the trace it holds (None when its seal is missing or damaged).
    """

    name: str
    files: tuple[Path, ...]
    bytes: int
    last_used: float
    trace: str | None


def entries(folder: PathLike | None = None) -> list[CachedTrace]:
    """The entries of a user cache folder (default ``user_cache_dir()``), least recently
    used first. Files not written by tracemagic are not listed."""
    root = Path(folder) if folder is not None else user_cache_dir()
    groups: dict[str, list[tuple[Path, os.stat_result]]] = {}
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    for child in children:
        match = _ENTRY_FILE.match(child.name)
        if match is None:
            continue
        try:
            info = child.stat()
        except OSError:
            continue  # removed meanwhile (by another process writing or evicting)
        groups.setdefault(match.group(1), []).append((child, info))
    found = []
    for name, files in groups.items():
        seal = _read_seal(root / name)
        trace = seal.get("trace") if seal is not None else None
        found.append(CachedTrace(
            name,
            tuple(sorted(path for path, _ in files)),
            sum(stat.st_size for _, stat in files),
            max(stat.st_mtime for _, stat in files),
            trace if isinstance(trace, str) else None,
        ))
    return sorted(found, key=lambda e: (e.last_used, e.name))


def _remove(cached: CachedTrace) -> int:
    """Delete an entry's files (the seal first, so no reader takes the rest); bytes freed."""
    freed = 0
    for path in sorted(cached.files, key=lambda p: not p.name.endswith(SEAL_SUFFIX)):
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except OSError:
            pass
    return freed


def evict(folder: PathLike | None = None, keep: str | None = None, limit: int | None = None) -> int:
    """Delete the least recently used entries of a user cache folder until it holds at
    most ``limit`` bytes (default ``max_bytes()``); ``keep`` (an entry's name) goes last.
    Returns the bytes freed."""
    cap = max_bytes() if limit is None else limit
    found = entries(folder)
    total = sum(e.bytes for e in found)
    freed = 0
    for cached in sorted(found, key=lambda e: e.name == keep):  # stable: LRU order kept
        if total <= cap:
            break
        gone = _remove(cached)
        total -= cached.bytes
        freed += gone
    return freed


def clear(folder: PathLike | None = None) -> tuple[int, int]:
    """Empty a user cache folder (default ``user_cache_dir()``) of tracemagic's entries:
    returns how many traces and bytes were removed. Capture directories keep theirs."""
    found = entries(folder)
    return len(found), sum(_remove(cached) for cached in found)
