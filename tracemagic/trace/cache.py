"""Arrow cache of parsed traces, so reopening a trace is near-instant.

Where it lives: a capture directory written by tracemagic (its ``capture.json`` names a
tracemagic version) keeps the cache of its traces inside itself, in ``.tracemagic-cache/``.
Any other trace, a colleague's file in a shared folder or a git checkout, is cached in the
user cache folder: ``cache_dir=`` if given, else ``$TRACEMAGIC_CACHE_DIR``, else
``$XDG_CACHE_HOME/tracemagic`` (``~/.cache/tracemagic``), under a digest of the source's
resolved path; nothing is written next to it. The user cache is capped
(``$TRACEMAGIC_CACHE_SIZE``, e.g. ``500M``, default 4 GiB): after each write the least
recently used entries go until it fits. ``tracemagic cache info|clear`` shows and empties it.

A fresh parse's entry is written later, not while ``load`` runs (``PendingEntry``): when
the trace is dropped or the process ends, when the same trace is loaded again in the
process, or when a tool asks about the cache (``locations``, ``entries``).

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
within their categories, ~3 ms) and ``check_events`` and ``check_meta`` (~3-5 ms a 100 MB
trace: what the tables rely on and a parse guarantees: the dtypes of the columns read in
place, row columns within the table, each ``parent`` one ``depth`` above its row so no
climb up the nesting loops, ``ts`` finite, steps named ``ProfilerStep#N``, JSON text
nested no deeper than the parser keeps it, the metadata's shape) mean such a cache is
parsed again, or gives wrong numbers (values that are possible but not the trace's: a
``dur``, a ``parent`` that is another row one level up), but never a crash, a hang or a
code outside its categories.

The format is the Arrow IPC file (Feather v2), uncompressed, so a cache is opened by
mapping it into memory: the numeric columns are the mapped file itself (a private,
copy-on-write mapping, so they stay writable and edits never reach the file), with no
decoding and no per-row work. It takes about half the JSON's size on disk; LZ4 made it
~8x smaller but reopening several times slower, as slow as a third of a fresh parse
(``bench/bench_load.py``), and Parquet slower still. Only Arrow data and JSON metadata
are read back: nothing from a cache or a trace is ever executed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import hashlib
import json
import logging
import mmap
import os
import re
import tempfile
import threading
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from tracemagic.errors import TraceError
from tracemagic.trace import layout
from tracemagic.trace.columns import all_missing
from tracemagic.trace.jsonvalues import MAX_NESTING, nesting_depth
from tracemagic.trace.kineto import KINDS, STEP_NAME

_log = logging.getLogger(__name__)

#: bump when the events table's columns or meaning, or the entry's files, change
FORMAT = 13
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
_ENTRY_FILE = re.compile(
    r"^\.?([0-9a-f]{24})(\.arrow|\.flows\.arrow|\.seal|\.t\.[a-z_]+\.[a-z_]+\.(?:arrow|seal))(\..*\.tmp)?$"
)
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
    if size <= _WHOLE:
        blocks = [(0, size)]
    else:
        blocks = [
            (0, _EDGE),
            *((size * i // (_SAMPLES + 1), _SAMPLE) for i in range(1, _SAMPLES + 1)),
            (size - _EDGE, _EDGE),
        ]
    # read in pieces into one small buffer (the CRC of pieces chained is the CRC of their
    # bytes together): a fresh MiB buffer for each edge cost a page fault per 4 KiB, most
    # of the time this takes on a load with the cache on
    piece = memoryview(bytearray(_SAMPLE))
    crc = 0
    with open(path, "rb", buffering=0) as handle:
        for offset, length in blocks:
            handle.seek(offset)
            while length > 0:
                got = handle.readinto(piece[: min(length, _SAMPLE)])
                if not got:
                    break  # the file is shorter now: the CRC of what it holds
                crc = zlib.crc32(piece[:got], crc)
                length -= got
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
    places = _places(path, recover, cache_dir)
    return Entry(places, sources, recover, identity(list(sources), recover), frozenset(places[-1:]))


def _places(path: Path, recover: bool, cache_dir: PathLike | None) -> tuple[Path, ...]:
    """Where the cache of ``load(path)`` lies (see ``entry``): the user cache's place last."""
    resolved = path.resolve()
    suffix = "-recover" if recover else ""
    places: list[Path] = []
    home = capture_home(path) if cache_dir is None else None
    if home is not None:
        inner = path.name if resolved != home.resolve() else "traces"
        places.append(home / CAPTURE_FOLDER / f"{inner}{suffix}")
    folder = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    places.append(folder / hashlib.sha256(os.fsencode(f"{resolved}{suffix}")).hexdigest()[:24])  # any file name
    return tuple(places)


def locations(path: PathLike, cache_dir: PathLike | None = None, recover: bool = False) -> list[Path]:
    """The seal files ``load(path)`` would look for, in order (for tools and tests), for a
    file or a folder; the entry of a trace parsed in this process and not yet written is
    written first."""
    found = _places(Path(path), recover, cache_dir)
    flush_pending(found)
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
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return None
    return seal if isinstance(seal, dict) else None


def read(found: Entry) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], Path, str] | None:
    """The cached tables of ``found`` (with the entry's base path and the events file's
    checksum, which its stored analysis tables are tied to), or None (missing, stale,
    damaged or another's)."""
    for base in found.places:
        seal = _read_seal(base)
        if seal is None or seal.get("format") != FORMAT or seal.get("source") != found.identity:
            continue
        try:
            events_file = _Mapped(_file(base, EVENTS_SUFFIX), seal["events"])
            flows_file = _Mapped(_file(base, FLOWS_SUFFIX), seal["flows"])
            stored = events_file.layout()
            events = events_file.frame(stored, check_events)
            flows = flows_file.frame(flows_file.layout())
            meta = stored["meta"]
            for section in ("ranks", "processes", "threads"):
                meta[section] = {int(k): v for k, v in meta.get(section, {}).items()}
            check_meta(meta)
        except (OSError, KeyError, ValueError, TypeError, AttributeError, RecursionError, pa.ArrowException):
            _log.debug("%s: cache entry unreadable, the trace is parsed again", base, exc_info=True)
            continue  # missing, damaged or foreign: parse the trace again
        if base in found.capped:
            _touch(_file(base, SEAL_SUFFIX))
        return events, flows, meta, base, str(seal["events"]["sum"])
    return None


#: the events' row columns: a row of the table, -1 for none
_ROW_COLUMNS = ("parent", "launch", "op", "module")
#: the events' columns of JSON text as written (``structs._ARG_RAW``), which tables decode
_JSON_TEXT = ("input_dims", "input_type", "concrete_inputs", "grid", "block", "pg_ranks")
#: the dtypes of the events' columns the tables read codes or numbers of in place (None:
#: categorical); the args' nullable numbers are read through pandas, whatever their dtype
_DTYPES: dict[str, np.dtype[Any] | None] = {
    **dict.fromkeys(("ph", "cat", "name", "pid", "tid", "kind", "collective", "pg_name", "dtype")),
    **dict.fromkeys(("call_stack", "kernel_file", *_JSON_TEXT)),
    **dict.fromkeys(("rank", "depth"), np.dtype(np.int32)),
    **dict.fromkeys(("ts", "dur", "self_dur"), np.dtype(np.float64)),
    **dict.fromkeys((*_ROW_COLUMNS, "step"), np.dtype(np.int64)),
}
#: rows ``check_events`` checks at a time: its temporaries stay small and are reused from
#: the heap (one of every row is a fresh mapping, faulted in), each column read once
_BLOCK = 1 << 15


def check_events(events: Mapping[str, Any]) -> None:
    """Check the events' columns (``events``: the table or its arrays by name) for what the
    tables rely on and a parse guarantees but Arrow's validation cannot see (a cache edited
    on purpose, its seal rewritten to match): the dtypes of ``_DTYPES``; the row columns
    (``parent``, ``launch``, ``op``, ``module``) within the table or -1; a row's ``parent``
    one ``depth`` (at least -1) above it, and a row without one at depth 0 or -1, so every
    climb up the nesting ends (no cycle; at most ``depth`` + 1 rounds);
    ``ts`` finite (the loader drops events without a timestamp) and no ``dur`` below 0
    (nor events with one: ``normalize.without_negative_durations``); the ``kind`` categories
    ``KINDS`` and each step's name ``ProfilerStep#N`` (``normalize.event_kinds``); JSON
    text nested at most ``MAX_NESTING`` deep, as the parser keeps it (``json.loads``
    recurses once a level). Vectorized, each column read once: ~3-5 ms a 100 MB trace.

    Raises:
        ValueError: one of them does not hold (the entry is then parsed again).
        KeyError: a column is missing.
    """
    arrays = {column: _array(events[column]) for column in _DTYPES}
    for column, dtype in _DTYPES.items():
        values = arrays[column]
        if not (
            isinstance(values, pd.Categorical)
            if dtype is None
            else isinstance(values, np.ndarray) and values.dtype == dtype
        ):
            raise ValueError(f"events: {column} is not {dtype or 'categorical'}")
    kind, name = arrays["kind"], arrays["name"]
    if kind.categories.tolist() != list(KINDS):
        raise ValueError("events: kind categories are not KINDS")
    rows = [arrays[column] for column in _ROW_COLUMNS]
    parent, depth, ts, dur = rows[0], arrays["depth"], arrays["ts"], arrays["dur"]
    n, step = len(ts), KINDS.index("step")
    steps: set[int] = set()  # the name codes of the steps
    for start in range(0, n, _BLOCK):  # a block of every column at a time, read once from memory
        stop = start + _BLOCK
        for column, values in zip(_ROW_COLUMNS, rows):
            block = values[start:stop]
            if block.min() < -1 or block.max() >= n:
                raise ValueError(f"events: {column} outside the table")
        if depth[start:stop].min() < -1:
            raise ValueError("events: depth below -1")
        _check_nesting(parent[start:stop], depth[start:stop], depth)
        block = ts[start:stop]
        if not (np.isfinite(block.min()) and np.isfinite(block.max())):  # (NaN wins both: no mask made)
            raise ValueError("events: a ts that is not a finite number")
        if (dur[start:stop] < 0).any():  # (NaN, an instant's, is not below 0)
            raise ValueError("events: a negative dur (the loader leaves those events out)")
        steps.update(name.codes[start:stop][kind.codes[start:stop] == step].tolist())
    labels = name.categories.tolist() if steps else []
    if any(code < 0 or not STEP_NAME.match(labels[code]) for code in steps):
        raise ValueError("events: a step not named ProfilerStep#N")
    for column in _JSON_TEXT:
        for text in arrays[column].categories.tolist():
            # no deeper than the brackets it holds: only a text with many is walked
            if text.count("[") + text.count("{") > MAX_NESTING and nesting_depth(text) > MAX_NESTING:
                raise ValueError(f"events: {column} nested deeper than {MAX_NESTING}")


#: the fields of a device in a rank's metadata (``normalize.metadata``), ``name`` aside
_DEVICE_NUMBERS = ("id", "memory_bytes", "sm_count")


def check_meta(meta: dict[str, Any]) -> None:
    """Check the shape of the metadata the loader made that the tables read (as
    ``check_events`` the events): ``ranks``, ``processes`` and ``threads`` map ranks to
    dicts; a rank's ``devices`` are dicts of an int (or None) ``id``, ``memory_bytes`` and
    ``sm_count`` and a text ``name``; ``rank`` and ``world_size`` ints or None; ``warnings``
    text. The rest is the trace's own metadata, which the tables take as it comes.

    Raises:
        ValueError: it is not so (the entry is then parsed again).
    """
    warnings = meta.get("warnings", [])
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise ValueError("meta: warnings are not text")
    for section in ("ranks", "processes", "threads"):
        if not all(isinstance(v, dict) for v in meta[section].values()):
            raise ValueError(f"meta: {section} are not dicts")
    for rank in meta["ranks"].values():
        devices = rank.get("devices", [])
        if not (
            all(_is_int_or_none(rank.get(key)) for key in ("rank", "world_size"))
            and isinstance(devices, list)
            and all(isinstance(d, dict) and isinstance(d.get("name", ""), str) for d in devices)
            and all(_is_int_or_none(d.get(key)) for d in devices for key in _DEVICE_NUMBERS)
        ):
            raise ValueError("meta: a rank's devices, rank or world size are not as parsed")


def _is_int_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _array(column: Any) -> Any:
    """A column's numpy array or Categorical (a frame's column: its array)."""
    if isinstance(column, pd.Series):
        column = column.array
    return column.to_numpy() if isinstance(column, pd.arrays.NumpyExtensionArray) else column


def _check_nesting(up: np.ndarray, level: np.ndarray, depth: np.ndarray) -> None:
    """``check_events``' nesting rule on some rows (``up``: their parents, ``level``: their
    depths, at least -1; ``depth``: all rows')."""
    above = depth.take(up)  # (parent -1: the last row's depth, not read)
    above -= level  # -1 where the parent is one level up (depths >= -1: no wrap gives -1)
    if not np.where(up >= 0, above == -1, level <= 0).all():
        raise ValueError("events: a parent not one level above its row")


def _touch(path: Path) -> None:
    """Mark an entry used now (least recently used entries are evicted first)."""
    with contextlib.suppress(OSError):
        os.utime(path)


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

    def frame(self, layout: dict[str, Any], check: Callable[[dict[str, Any]], None] | None = None) -> pd.DataFrame:
        """The table, fully validated (a cache with a forged seal: ArrowInvalid, not a crash),
        its columns given to ``check`` first (``check_events``: on the arrays, no pandas
        lookups)."""
        table = self.reader.read_all()
        table.validate(full=True)
        return _frame(table, layout, self._values, check)

    def _values(self, array: pa.Array) -> np.ndarray:
        """A numeric column's values as writable numpy: a view of the mapping where the
        column lies in it, else a copy."""
        kind = array.type
        dtype = np.dtype(kind.to_pandas_dtype())
        data = array.buffers()[1]
        offset = -1 if data is None else data.address - self.buffer.address + array.offset * dtype.itemsize
        if offset >= 0 and offset + len(array) * dtype.itemsize <= self.buffer.size:
            return np.frombuffer(self.memory, dtype=dtype, count=len(array), offset=offset)
        return _copied_values(array)


def _copied_values(array: pa.Array) -> np.ndarray:
    """A numeric column's values as a new numpy array (those under its nulls unspecified)."""
    dtype = np.dtype(array.type.to_pandas_dtype())
    data = array.buffers()[1]
    if data is None:  # (an empty column may have none)
        return np.zeros(len(array), dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize).copy()


def _numbers(values: np.ndarray, array: pa.Array, nullable: bool) -> Any:
    """A numeric Arrow column (``values``: its data) as numpy, or a nullable ``Int64``/``Float64`` array."""
    if not nullable:
        return values
    mask = array.is_null().to_numpy(zero_copy_only=False) if array.null_count else np.zeros(len(array), dtype=bool)
    return (
        pd.arrays.FloatingArray(values, mask)
        if pa.types.is_floating(array.type)
        else pd.arrays.IntegerArray(values, mask)
    )


def _column(array: pa.Array, nullable: bool, values: Callable[[pa.Array], np.ndarray]) -> Any:
    """One Arrow column as the array a fresh parse makes (categoricals with ``str``
    categories, nullable ``Int64``/``Float64``, writable numpy)."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        if not pa.types.is_signed_integer(kind.index_type):  # (a forged file's: -1 would not fit)
            raise ValueError("dictionary indices are not signed integers")
        # writable codes: a view of the mapping, or with missing ones a new array (Arrow's
        # fill, copied: ~4x faster than writing -1 through the mapping's bit mask)
        if array.null_count:
            codes = array.indices.fill_null(-1).to_numpy(zero_copy_only=False).copy()
        else:
            codes = values(array.indices)
        # (straight from the Arrow text: ~10x faster than through Python strings)
        categories = pd.Index(array.dictionary, dtype="str")
        return pd.Categorical.from_codes(codes, categories=categories, validate=False)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return _numbers(values(array), array, nullable)
    return array.to_pandas()


def _all_missing_column(dtype: str, n: int) -> Any:
    if dtype == "category":
        return pd.Categorical.from_codes(
            np.full(n, -1, dtype=np.int8), categories=pd.Index([], dtype="str"), validate=False
        )
    return all_missing(n, floating=dtype == "Float64")


def _frame(
    table: pa.Table,
    layout: dict[str, Any],
    values: Callable[[pa.Array], np.ndarray],
    check: Callable[[dict[str, Any]], None] | None = None,
) -> pd.DataFrame:
    """The table as the frame a fresh parse makes: the all-missing columns ``write`` left
    out put back, in the original column order (``check``: given the columns first)."""
    nullable = set(layout.get("nullable") or ())
    data: dict[str, Any] = {}
    for name, chunked in zip(table.column_names, table.columns):
        array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        data[name] = _column(array, name in nullable, values)
    for name, dtype in (layout.get("missing") or {}).items():
        data[name] = _all_missing_column(dtype, table.num_rows)
    if check is not None:
        check(data)
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
    table = pa.Table.from_pandas(frame, preserve_index=False, nthreads=1)  # no thread pool: it may run at exit
    payload = json.dumps(stored, default=str).encode()
    return table.replace_schema_metadata({_META_KEY: payload})


def write(
    found: Entry, trace: Path, events: pd.DataFrame, flows: pd.DataFrame, meta: dict[str, Any]
) -> tuple[Path, str] | None:
    """Store the tables at the first place of ``found`` that takes them (a capture
    directory only if its folder is writable); returns the entry's base path (its files'
    common stem) and the checksum of the events file written, or None.

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
            for stale in base.parent.glob(f"{glob.escape(base.name)}{TABLE_INFIX}*"):
                stale.unlink(missing_ok=True)  # analysis tables of the events replaced here
            events_sealed = _write_atomic(table, _file(base, EVENTS_SUFFIX))
            seal = {
                "format": FORMAT,
                "source": found.identity,
                "trace": str(trace.resolve()),
                "events": events_sealed,
                "flows": _write_atomic(flow_table, _file(base, FLOWS_SUFFIX)),
            }
            body = json.dumps(seal, separators=(",", ":")).encode()
            _write_atomic(f"{zlib.crc32(body):08x}\n".encode() + body, _file(base, SEAL_SUFFIX))
        except OSError as exc:
            _log.debug("%s: cache not written here (%s)", base, exc)
            continue
        if base in found.capped:
            evict(base.parent, keep=base.name)
        return base, str(events_sealed["sum"])
    return None


class PendingEntry:
    """The cache entry of a trace just parsed, written later (``flush``) so that the user
    does not wait for it: when the trace is dropped or the process ends, when the same
    trace is loaded again in this process (then it is read from the cache), or when a
    tool asks where the cache lies or what it holds (``locations``, ``entries``);
    ``clear`` drops it unwritten. Writing it costs ~10-15% of a fresh load (the Arrow conversion, 47 MB
    written and checksummed for a 100 MB trace).

    It keeps a snapshot of the tables as parsed: shallow copies, which pandas'
    copy-on-write keeps as they were when the user edits ``trace.events`` in place (the
    edited columns are copied then; a ``trace.events`` replaced by another frame keeps the
    parsed one in memory until the entry is written), so the entry written is always the
    parse's. A source
    edited meanwhile is seen by ``write`` (its identity no longer matches): nothing is
    written. A process killed before the trace is dropped leaves no entry: the next load
    parses again.
    """

    def __init__(
        self, found: Entry, trace: Path, events: pd.DataFrame, flows: pd.DataFrame, meta: dict[str, Any]
    ) -> None:
        self.found = found
        self._tables: tuple[Path, pd.DataFrame, pd.DataFrame, dict[str, Any]] | None = (
            trace,
            events.copy(deep=False),
            flows.copy(deep=False),
            copy.deepcopy(meta),
        )
        self._written: tuple[Path, str] | None = None
        self._lock = threading.RLock()  # (re-entered: see flush)
        with _PENDING_LOCK:
            _PENDING[found.places] = self

    @property
    def done(self) -> bool:
        """Whether it was written (or given up)."""
        return self._tables is None

    def __getstate__(self) -> dict[str, Any]:
        """A pickled trace (sent to another process) carries its entry as done: only the
        process that parsed it writes it."""
        return {"found": self.found, "_tables": None, "_written": self._written}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def flush(self) -> tuple[Path, str] | None:
        """Write the entry now if it is not yet (once); what ``write`` returned: its base
        path and events checksum, or None where it was not written (or is being written).

        A garbage collection while it writes may run the finalizers of a dropped trace of
        the same entry on this thread (its own flush, or its stored tables'), which call
        this again: such a call returns None at once (those tables are not stored) instead
        of waiting for itself forever."""
        with self._lock:
            tables, self._tables = self._tables, None
            if tables is not None:
                try:  # never an error of the session's: the trace is parsed again next time
                    self._written = write(self.found, *tables)
                except Exception:  # noqa: BLE001
                    _log.debug("%s: cache not written", self.found.places[-1], exc_info=True)
            written = self._written
        if tables is not None:
            self._forget()
        return written

    def cancel(self) -> None:
        """Never write it (the cache folder was cleared)."""
        with self._lock:
            self._tables = None
        self._forget()

    def _forget(self) -> None:
        """Off the list of pending entries. Never called holding ``_lock``: a collection
        while another thread holds ``_PENDING_LOCK`` may flush this entry there, which takes
        ``_lock`` (the other order would deadlock the two threads)."""
        with _PENDING_LOCK:
            if _PENDING.get(self.found.places) is self:
                del _PENDING[self.found.places]


#: the entries of traces parsed in this process and not yet written, by their places
_PENDING: dict[tuple[Path, ...], PendingEntry] = {}
_PENDING_LOCK = threading.RLock()  # (a collection while it is held may flush an entry)


def _pending(places: tuple[Path, ...] | None = None, folder: Path | None = None) -> list[PendingEntry]:
    """The pending entries: the one at ``places``, or those with a place in ``folder``, or
    (neither given) all of them."""
    with _PENDING_LOCK:
        found = list(_PENDING.values())
    return [
        pending
        for pending in found
        if (places is None or pending.found.places == places)
        and (folder is None or any(base.parent == folder for base in pending.found.places))
    ]


def flush_pending(places: tuple[Path, ...] | None = None, folder: Path | None = None) -> None:
    """Write the pending entries now (``_pending``'s: at ``places``, in ``folder``, or all)."""
    for pending in _pending(places, folder):
        pending.flush()


# -- analysis tables stored next to the events ---------------------------------------------------

#: a stored table's files: ``<base>.t.<module>.<function>.arrow`` and ``.seal``
TABLE_INFIX = ".t."
#: the dtypes a stored table's columns may have (anything else: the table is not stored)
_NUMPY_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "float32", "float64"})
_NULLABLE_DTYPES = frozenset({"Int64", "Float64"})
#: set to ``0`` to neither read nor write stored analysis tables
NO_TABLES_ENV = "TRACEMAGIC_TABLE_CACHE"


@functools.cache
def code_version() -> str:
    """A digest of every tracemagic source file and the versions of numpy, pandas and
    pyarrow: a stored analysis table is used only by the code that computed it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{FORMAT} {np.__version__} {pd.__version__} {pa.__version__}".encode())
    package = Path(__file__).resolve().parent.parent
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + b"\0")
        try:
            digest.update(source.read_bytes())
        except OSError:
            digest.update(b"?")
    return digest.hexdigest()


def _encode(value: Any) -> Any:
    """``value`` (a table's ``attrs``) as JSON that ``_decode`` turns back into an equal
    value of the same types: dicts (any hashable scalar keys), lists, tuples, str, int,
    float, bool, None. Raises TypeError for anything else (the table is then not stored)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if type(value) in (int, float):
        return value if value == value else {"nan": True}  # NaN is not equal to itself
    if isinstance(value, list) and type(value) is list:
        return [_encode(v) for v in value]
    if type(value) is tuple:
        return {"tuple": [_encode(v) for v in value]}
    if type(value) is dict:
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    raise TypeError(f"not stored: {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        if "dict" in value:
            return {_key(_decode(k)): _decode(v) for k, v in value["dict"]}
        if value.get("nan") is True:
            return float("nan")
        raise ValueError("not an encoded value")
    return value


def _key(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise ValueError("not a key")
    return value


def _column_layout(column: pd.Series) -> dict[str, Any] | None:
    """How to rebuild one column from Arrow, or None if its dtype is not stored."""
    dtype = column.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        categories = dtype.categories.dtype
        if dtype.ordered:
            return None
        if categories == np.dtype(object):
            return {"kind": "category", "categories": "object"}
        if (
            isinstance(categories, pd.StringDtype)
            and categories.storage == "pyarrow"
            and categories.na_value is not pd.NA
        ):
            return {"kind": "category", "categories": "str"}
        return None
    if isinstance(dtype, pd.StringDtype):
        return {"kind": "text", "storage": dtype.storage, "nan": dtype.na_value is not pd.NA}
    name = str(dtype)
    if name in _NUMPY_DTYPES:
        return {"kind": "numpy", "dtype": name}
    if name in _NULLABLE_DTYPES:
        return {"kind": "nullable", "dtype": name}
    return None


def _is_text(kind: pa.DataType) -> bool:
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _rebuild(
    table: pa.Table, layout: dict[str, Any], values: Callable[[pa.Array], np.ndarray] = _copied_values
) -> pd.DataFrame:
    """A stored table as the DataFrame that was stored (its column layouts and attrs).

    ``values``: a numeric column's values as writable numpy (``_Mapped._values``: views of
    the file's copy-on-write mapping, nothing copied); by default, copies."""
    columns = layout["columns"]
    if table.column_names != [c["name"] for c in columns]:
        raise ValueError("columns differ from the seal's")
    data: dict[str, Any] = {}
    for spec, chunked in zip(columns, table.columns):
        array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        kind = spec["kind"]
        if kind == "category":
            if not pa.types.is_dictionary(array.type) or not _is_text(array.type.value_type):
                raise ValueError("not a categorical column")
            categorical = _column(array, False, values)
            if spec["categories"] == "object":
                categorical = pd.Categorical.from_codes(  # (set_categories would hand back read-only codes)
                    np.array(categorical.codes),
                    categories=pd.Index(categorical.categories, dtype=object),
                    validate=False,
                )
            elif spec["categories"] != "str":
                raise ValueError("unknown categories")
            data[spec["name"]] = categorical
        elif kind == "text":
            if not _is_text(array.type):
                raise ValueError("not a text column")
            dtype = pd.StringDtype(storage=spec["storage"], na_value=np.nan if spec["nan"] else pd.NA)
            data[spec["name"]] = pd.array(array, dtype=dtype)
        elif kind in ("numpy", "nullable"):
            dtype = np.dtype(spec["dtype"].lower())
            if pa.from_numpy_dtype(dtype) != array.type:
                raise ValueError("not the column's type")
            if kind == "numpy" and array.null_count:
                raise ValueError("missing values in a numpy column")
            if pa.types.is_boolean(array.type):  # (Arrow's are bits: unpacked)
                data[spec["name"]] = array.to_numpy(zero_copy_only=False)
            else:
                data[spec["name"]] = _numbers(values(array), array, kind == "nullable")
        else:
            raise ValueError(f"unknown column kind {kind!r}")
    frame = pd.DataFrame(data, copy=False)
    if layout["names"] not in ("str", "object"):
        raise ValueError("column names are not text")
    frame.columns = pd.Index([c["name"] for c in columns], dtype=layout["names"])
    frame.attrs = _decode(layout["attrs"])
    return frame


def _arrow(column: pd.Series, kind: str) -> pa.Array:
    """One column as Arrow: NaN kept as NaN in numpy columns, categories as text."""
    if kind == "numpy":
        return pa.array(column.to_numpy(), from_pandas=False)
    if kind == "category":
        codes = column.cat.codes.to_numpy()
        categories = pa.array(np.asarray(column.cat.categories, dtype=object), type=pa.large_string())
        return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), categories)
    array = pa.array(column.array)
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def _storable(frame: pd.DataFrame) -> tuple[bytes, dict[str, Any]] | None:
    """The Arrow IPC file and layout of ``frame``, or None unless rebuilding it gives back
    exactly ``frame`` (index, column names, dtypes, values, attrs)."""
    index = frame.index
    if not (isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1):
        return None
    if not all(isinstance(c, str) for c in frame.columns) or not frame.columns.is_unique:
        return None
    attrs_of = frame.attrs
    frame = frame.copy(deep=False)  # its columns taken without deep-copying the attrs each time
    frame.attrs = {}
    columns = []
    for name in frame.columns:
        spec = _column_layout(frame[name])
        if spec is None:
            return None
        columns.append({"name": name, **spec})
    try:
        attrs = _encode(attrs_of)
        layout = {"columns": columns, "names": str(frame.columns.dtype), "attrs": attrs}
        json.dumps(layout, allow_nan=False)
        batch = pa.RecordBatch.from_pydict(
            {spec["name"]: _arrow(frame[spec["name"]], spec["kind"]) for spec in columns}
        )
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        data = sink.getvalue()
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()  # checked as it will be read
        back = _rebuild(table, json.loads(json.dumps(layout)))
        rebuilt_attrs, back.attrs = back.attrs, {}
    except (TypeError, ValueError, pa.ArrowException):
        return None
    same = (
        back.columns.equals(frame.columns)
        and back.columns.dtype == frame.columns.dtype
        and all(back[c].dtype == frame[c].dtype for c in frame.columns)
        and all(
            back[c].cat.categories.dtype == frame[c].cat.categories.dtype
            for c in frame.columns
            if isinstance(frame[c].dtype, pd.CategoricalDtype)
        )
        and back.equals(frame)
        and _same(rebuilt_attrs, attrs_of)
    )
    return (data.to_pybytes(), layout) if same else None


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same types throughout (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, m) and _same(a[k], b[m]) for k, m in zip(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    return bool(a == b)


class TableStore:
    """The analysis tables stored next to one cached trace, so reopening it gives them
    without computing them again.

    A stored table is two files beside the events: ``<base>.t.<module>.<function>.arrow``
    (Arrow IPC, no pandas metadata) and its ``.seal``: a CRC-32 of its body, then JSON with
    the source's identity, the checksum of the events file it was computed from, the
    ``code_version()`` (a digest of every tracemagic source file and the numpy, pandas and
    pyarrow versions), a digest of what else the analyses read (the capture manifest),
    the Arrow file's size and checksum, and how to rebuild the frame (each column's dtype
    from a fixed list, the ``attrs`` as tagged JSON). A table is used only when all of it
    matches and Arrow's full validation passes, so a new tracemagic, a re-parsed trace, an
    edited manifest or a damaged file means it is computed again (edits of ``trace.events``
    in place are not seen: load with ``use_cache=False`` to analyse edited events); as with the events,
    nothing read is executed. Only tables that rebuild exactly (checked when stored) are
    stored, when the trace is dropped or the process ends (``put_later``: computing a table
    costs no more than without the store; ``flush`` writes them at once), and nothing is
    read or written with ``$TRACEMAGIC_TABLE_CACHE=0``.
    """

    def __init__(
        self, sealed: tuple[Path, str] | PendingEntry, found: Entry, context: str, events: pd.DataFrame
    ) -> None:
        """``sealed``: the entry's base path and events checksum, or for a trace just
        parsed its ``PendingEntry`` (written first when the tables are: until then no
        stored table is read, none could be of these events)."""
        self.events = events  # the table they were computed from (a trace given other events does not use them)
        self._entry: PendingEntry | None = sealed if isinstance(sealed, PendingEntry) else None
        self.base, self.events_sum = (Path(), "") if isinstance(sealed, PendingEntry) else sealed
        self._capped = found.capped
        self.source = found.identity
        self.context = hashlib.blake2b(context.encode(), digest_size=16).hexdigest()
        self._pending: dict[str, pd.DataFrame] = {}
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def capped(self) -> bool:
        return self.base in self._capped

    def _sealed(self) -> bool:
        """Whether the events entry is written (writing a pending one now)."""
        if self._entry is None:
            return True
        written = self._entry.flush()
        if written is None:
            return False
        self.base, self.events_sum = written
        self._entry = None
        return True

    @staticmethod
    def enabled() -> bool:
        """Whether stored tables are read and written (``$TRACEMAGIC_TABLE_CACHE`` is not ``0``)."""
        return os.environ.get(NO_TABLES_ENV, "").strip() != "0"

    def _files(self, name: str) -> tuple[Path, Path]:
        if not re.fullmatch(r"[a-z_]+\.[a-z_]+", name):
            raise ValueError(f"not a table name: {name!r}")
        stem = f"{self.base.name}{TABLE_INFIX}{name}"
        return self.base.with_name(stem + EVENTS_SUFFIX), self.base.with_name(stem + SEAL_SUFFIX)

    def _expected(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "events": self.events_sum,
            "code": code_version(),
            "context": self.context,
        }

    def get(self, name: str) -> pd.DataFrame | None:
        """The stored table ``name`` (``module.function``), or None (none, stale or damaged)."""
        if self._entry is not None:
            return None  # the events are not written yet: nothing stored is of them
        try:
            data, seal_file = self._files(name)
            seal = _read_seal(seal_file.with_suffix(""))
            if seal is None or any(seal.get(k) != v for k, v in self._expected().items()):
                return None
            mapped = _Mapped(data, seal["table"])
            table = mapped.reader.read_all()
            table.validate(full=True)
            frame = _rebuild(table, seal["layout"], mapped._values)
        except (OSError, KeyError, ValueError, TypeError, AttributeError, RecursionError, pa.ArrowException):
            return None
        if self.capped:
            _touch(seal_file)
        return frame

    def put_later(self, name: str, frame: pd.DataFrame, owner: object) -> None:
        """Store ``frame`` as table ``name`` at ``flush``: when ``owner`` (the trace holding
        the table) is dropped, or the process ends, so computing a table costs a session no
        more than without the store."""
        self._pending[name] = frame
        if self._finalizer is None or not self._finalizer.alive:
            self._finalizer = weakref.finalize(owner, self.flush)  # runs at exit too

    def flush(self) -> None:
        """Store the tables handed to ``put_later`` now (any error: that table is not kept)."""
        pending, self._pending = self._pending, {}
        for name, frame in pending.items():
            # a table not kept is computed next time: never an error of the session's
            with contextlib.suppress(Exception):
                self.put(name, frame)

    def put(self, name: str, frame: pd.DataFrame) -> bool:
        """Store ``frame`` as table ``name`` if it rebuilds exactly; whether it was stored."""
        if not self._sealed():
            return False
        stored = _storable(frame)
        if stored is None:
            return False
        ipc, layout = stored
        try:
            data, seal_file = self._files(name)
            if not self.capped and not writable(self.base.parent.parent):
                return False
            events_seal = _read_seal(self.base)
            if events_seal is None or events_seal.get("events", {}).get("sum") != self.events_sum:
                return False  # the entry was removed or replaced meanwhile (cache clear, another process)
            seal_file.unlink(missing_ok=True)
            seal = {**self._expected(), "table": _write_atomic(ipc, data), "layout": layout}
            body = json.dumps(seal, separators=(",", ":")).encode()
            _write_atomic(f"{zlib.crc32(body):08x}\n".encode() + body, seal_file)
        except (OSError, ValueError):
            return False
        if self.capped:
            evict(self.base.parent, keep=self.base.name)
        return True


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
    used first (the entries of traces parsed in this process are written first). Files
    not written by tracemagic are not listed."""
    root = Path(folder) if folder is not None else user_cache_dir()
    flush_pending(folder=root)
    return _entries(root)


def _entries(root: Path) -> list[CachedTrace]:
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
        found.append(
            CachedTrace(
                name,
                tuple(sorted(path for path, _ in files)),
                sum(stat.st_size for _, stat in files),
                max(stat.st_mtime for _, stat in files),
                trace if isinstance(trace, str) else None,
            )
        )
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
    found = _entries(Path(folder) if folder is not None else user_cache_dir())
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
    returns how many traces and bytes were removed (the entries of traces parsed in this
    process and not yet written are dropped: not written later). Capture directories keep theirs."""
    root = Path(folder) if folder is not None else user_cache_dir()
    for pending in _pending(folder=root):
        pending.cancel()
    found = _entries(root)
    return len(found), sum(_remove(cached) for cached in found)
