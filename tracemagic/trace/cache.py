"""Arrow cache of parsed traces, so reopening a trace is near-instant.

The cache lies next to the trace (``.<name>.tracemagic.arrow``) or, when that folder is
read-only, in the user cache directory. A folder counts as read-only when it has no write
permission bits even if the process could write there anyway (root ignores the bits): a
shared, read-only trace folder is never written into. Its key is every source file's path, size and
mtime plus the cache format version: a changed file is parsed again.

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
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from tracemagic.trace.columns import all_missing

#: bump when the events table's columns or meaning change
FORMAT = 7
SUFFIX = ".tracemagic.arrow"
FLOWS_SUFFIX = ".flows.arrow"
_META_KEY = b"tracemagic"


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tracemagic`` (default ``~/.cache/tracemagic``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tracemagic"


def key_for(path: Path, files: list[Path] | None, recover: bool) -> str:
    """A digest of the source files' identity (path, size, mtime) and the format."""
    sources = files if files is not None else [path]
    parts = [f"format={FORMAT}", f"recover={recover}"]
    for source in sources:
        stat = source.stat()
        parts.append(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def writable(folder: Path) -> bool:
    """Whether we may write into ``folder``: it has write bits and we have write access."""
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return bool(mode & 0o222) and os.access(folder, os.W_OK)


def _locations(path: Path, cache_dir: str | os.PathLike[str] | None, *, for_write: bool = False) -> list[Path]:
    """Where the cache of ``path`` may lie: beside it (if that folder is writable), else
    ``cache_dir`` or the user cache directory."""
    folder = path if path.is_dir() else path.parent
    stem = path.name if not path.is_dir() else "traces"
    beside = folder / f".{stem}{SUFFIX}"
    elsewhere = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    other = elsewhere / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}.arrow"
    if for_write and not writable(folder):
        return [other]
    return [beside, other]


def locations(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The cache files ``load(path)`` would read, in order (for tools and tests)."""
    return _locations(Path(path), cache_dir)


def _flows_path(location: Path) -> Path:
    return location.with_suffix(FLOWS_SUFFIX)


def read(key: str, path: Path, cache_dir: str | os.PathLike[str] | None) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]] | None:
    """The cached tables for ``key``, or None (missing, stale or unreadable)."""
    for location in _locations(path, cache_dir):
        if not location.is_file():
            continue
        try:
            events_file = _Mapped(location)
            stored = events_file.layout()
            if not isinstance(stored, dict) or stored.get("key") != key:
                continue
            events = events_file.frame(stored)
            flows_file = _Mapped(_flows_path(location))
            flows = flows_file.frame(flows_file.layout())
            meta = stored["meta"]
            for section in ("ranks", "processes", "threads"):
                meta[section] = {int(k): v for k, v in meta.get(section, {}).items()}
        except (OSError, KeyError, ValueError, TypeError, AttributeError, pa.ArrowException):
            continue  # missing, damaged or foreign: parse the trace again
        return events, flows, meta
    return None


class _Mapped:
    """An Arrow IPC file mapped copy-on-write: its columns read in place, and writable."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as handle:
            self.memory = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self.buffer = pa.py_buffer(self.memory)
        self.reader = pa.ipc.open_file(pa.BufferReader(self.buffer))

    def layout(self) -> Any:
        """The JSON the writer stored with the table (key, metadata, how to rebuild it)."""
        return json.loads((self.reader.schema.metadata or {})[_META_KEY])

    def frame(self, layout: dict[str, Any]) -> pd.DataFrame:
        return _frame(self.reader.read_all(), layout, self._values)

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


def _write_atomic(table: pa.Table, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=max(table.num_rows, 1))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _table(frame: pd.DataFrame, stored: dict[str, Any]) -> pa.Table:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    payload = json.dumps(stored, default=str).encode()
    return table.replace_schema_metadata({_META_KEY: payload})


def write(
    key: str,
    path: Path,
    cache_dir: str | os.PathLike[str] | None,
    events: pd.DataFrame,
    flows: pd.DataFrame,
    meta: dict[str, Any],
) -> Path | None:
    """Store the tables; first beside the trace, else in the user cache. None if neither works."""
    kept, layout = _layout(events)
    table = _table(kept, {"key": key, "meta": meta, **layout})
    flow_kept, flow_layout = _layout(flows)
    flow_table = _table(flow_kept, flow_layout)
    for location in _locations(path, cache_dir, for_write=True):
        try:
            _write_atomic(flow_table, _flows_path(location))
            _write_atomic(table, location)
        except OSError:
            continue
        _forget_parquet(location)
        return location
    return None


def _forget_parquet(location: Path) -> None:
    """Remove a cache in the earlier Parquet format from this place (it is never read again)."""
    for old in (location.with_suffix(".parquet"), location.with_suffix(".flows.parquet")):
        try:
            old.unlink(missing_ok=True)
        except OSError:
            pass
