"""Parquet cache of parsed traces, so reopening a trace is near-instant.

The cache lies next to the trace (``.<name>.tracemagic.parquet``) or, when that folder is
read-only, in the user cache directory. A folder counts as read-only when it has no write
permission bits even if the process could write there anyway (root ignores the bits): a
shared, read-only trace folder is never written into. Its key is every source file's path, size and
mtime plus the cache format version: a changed file is parsed again. Only Parquet and
JSON are read back: nothing from a cache or a trace is ever executed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

#: bump when the events table's columns or meaning change
FORMAT = 4
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
    beside = folder / f".{stem}.tracemagic.parquet"
    elsewhere = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    other = elsewhere / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}.parquet"
    if for_write and not writable(folder):
        return [other]
    return [beside, other]


def locations(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The cache files ``load(path)`` would read, in order (for tools and tests)."""
    return _locations(Path(path), cache_dir)


def read(key: str, path: Path, cache_dir: str | os.PathLike[str] | None) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]] | None:
    """The cached tables for ``key``, or None (missing, stale or unreadable)."""
    for location in _locations(path, cache_dir):
        if not location.is_file():
            continue
        try:
            schema = pq.read_schema(location)
            stored = json.loads((schema.metadata or {})[_META_KEY])
            if not isinstance(stored, dict) or stored.get("key") != key:
                continue
            events = _restore(_frame(pq.read_table(location)), stored)
            flows = _frame(pq.read_table(location.with_suffix(".flows.parquet")))
            meta = stored["meta"]
            for section in ("ranks", "processes", "threads"):
                meta[section] = {int(k): v for k, v in meta.get(section, {}).items()}
        except (OSError, KeyError, ValueError, TypeError, AttributeError, pa.ArrowException):
            continue  # missing, damaged or foreign: parse the trace again
        return events, flows, meta


def _frame(table: pa.Table) -> pd.DataFrame:
    """The table as the frame a fresh parse makes (categoricals with ``str`` categories,
    also for an all-missing column, which Arrow would give back as plain objects)."""
    pandas_meta = table.schema.pandas_metadata or {}
    categorical = {c.get("name") for c in pandas_meta.get("columns", []) if c.get("pandas_type") == "categorical"}
    frame = table.to_pandas(split_blocks=True, self_destruct=True)
    for column in categorical & set(frame.columns):
        values = frame[column]
        if isinstance(values.dtype, pd.CategoricalDtype):
            if values.cat.categories.dtype == object:
                frame[column] = pd.Categorical.from_codes(
                    values.cat.codes.to_numpy(), categories=pd.Index(values.cat.categories, dtype="str"), validate=False
                )
        elif values.isna().all():
            codes = np.full(len(values), -1, dtype=np.int8)
            frame[column] = pd.Categorical.from_codes(codes, categories=pd.Index([], dtype="str"), validate=False)
        else:
            frame[column] = pd.Categorical(values.astype(object))
    return frame


def _all_missing(events: pd.DataFrame) -> dict[str, str]:
    """Columns with no value at all (most args columns of a CPU trace): not stored, remade on read."""
    out = {}
    for column in events.columns:
        dtype = events[column].dtype
        if isinstance(dtype, pd.CategoricalDtype):
            if len(dtype.categories) == 0:
                out[column] = "category"
        elif str(dtype) in ("Int64", "Float64") and not events[column].notna().any():
            out[column] = str(dtype)
    return out


def _restore(frame: pd.DataFrame, stored: dict[str, Any]) -> pd.DataFrame:
    """Put back the all-missing columns ``write`` left out, in the original column order."""
    missing: dict[str, str] = stored.get("missing") or {}
    if not missing:
        return frame
    n = len(frame)
    for column, dtype in missing.items():
        if dtype == "category":
            codes = np.full(n, -1, dtype=np.int8)
            frame[column] = pd.Categorical.from_codes(codes, categories=pd.Index([], dtype="str"), validate=False)
        elif dtype == "Float64":
            frame[column] = pd.arrays.FloatingArray(np.zeros(n, dtype=np.float64), np.ones(n, dtype=bool))
        else:
            frame[column] = pd.arrays.IntegerArray(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))
    return frame[stored["columns"]]


def _write_atomic(table: pa.Table, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write(
    key: str,
    path: Path,
    cache_dir: str | os.PathLike[str] | None,
    events: pd.DataFrame,
    flows: pd.DataFrame,
    meta: dict[str, Any],
) -> Path | None:
    """Store the tables; first beside the trace, else in the user cache. None if neither works."""
    missing = _all_missing(events)
    payload = json.dumps({"key": key, "meta": meta, "columns": list(events.columns), "missing": missing}, default=str).encode()
    table = pa.Table.from_pandas(events.drop(columns=list(missing)), preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META_KEY: payload})
    flow_table = pa.Table.from_pandas(flows, preserve_index=False)
    for location in _locations(path, cache_dir, for_write=True):
        try:
            _write_atomic(flow_table, location.with_suffix(".flows.parquet"))
            _write_atomic(table, location)
        except OSError:
            continue
        return location
    return None
