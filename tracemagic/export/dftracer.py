"""DFTracer's ``.pfw`` format: write the profiler events, read them back.

DFTracer (LLNL's I/O and application tracer) writes one JSON event per line, after a
first line holding ``[`` and with no closing ``]`` (the bracket only serves Perfetto,
which accepts an unterminated array)::

    [
    {"id":0,"name":"aten::linear","cat":"PP","pid":4242,"tid":4242,"ts":1732200000123456,"dur":41,"ph":"X","args":{...}}

``ts``/``dur`` are integer microseconds on the wall clock (µs since the Unix epoch), so
these events line up with DFTracer's own POSIX/app events of the same run. PyTorch
profiler events use category ``PP`` with the args keys DFTracer's own
``dftracer.python.torch`` handler writes (``device``, ``cpu_memory``,
``device_memory_usage``) plus ``input_shapes``/``input_types`` and the Kineto ids needed
to read them back. Metadata events (``ph: "M"``) name the processes and carry the
hostname hash (``HH``) that ``args.hhash`` refers to.

DFTracer's analysis tools (``dftracer-utils``, ``dftracer-analyzer``) index and read
``.pfw.gz`` (plain gzip; they build their own ``.zindex`` next to it on first read); a plain
``.pfw`` is for viewers and ``grep``. ``to_pfw`` picks by the file name.

Kineto's clock: traces from torch >= 2.3 carry ``baseTimeNanoseconds`` and ``ts`` relative
to it (``ts + baseTimeNanoseconds / 1000`` is µs since the epoch); older traces already
write epoch µs.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import pandas as pd

from tracemagic.errors import TraceError
from tracemagic.trace.kineto import GPU_KINDS, KINDS
from tracemagic.trace.layout import gzip_to
from tracemagic.trace.structure import MODULE_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import TraceTables

__all__ = ["CATEGORY", "DEFAULT_KINDS", "pfw_trace", "read_pfw", "to_pfw", "trace_handler", "wall_clock_offset_us"]

#: DFTracer's category for PyTorch profiler events
CATEGORY = "PP"
#: event kinds written by default, every kind but the trace's metadata and the unclassified
#: (python frames other than ``nn.Module`` ones are skipped)
DEFAULT_KINDS = tuple(k for k in KINDS if k not in ("trace", "other"))
_EPOCH_US = 1e15  # µs timestamps above this are already since the epoch (after 2001)
#: the integers JSON readers (orjson, DFTracer's) take
_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
#: the largest float64 below 2**63 (what clips a float to int64's range)
_INT64_FLOAT = float((1 << 63) - 1024)


def wall_clock_offset_us(trace: TraceTables, rank: int) -> float:
    """What to add to a rank's ``ts`` to get µs since the Unix epoch.

    Raises:
        TraceError: the trace's clock cannot be tied to the wall clock (no
            ``baseTimeNanoseconds`` and timestamps too small to be epoch times).
    """
    meta = trace.meta.get("ranks", {}).get(rank, {})
    base = meta.get("baseTimeNanoseconds")
    if base is not None:
        try:
            offset = float(base) / 1000.0
        except (TypeError, ValueError, OverflowError):
            offset = math.nan
        if math.isfinite(offset):
            return offset
    ts = trace.events.loc[trace.events["rank"] == rank, "ts"].to_numpy()
    ts = ts[np.isfinite(ts)]
    if ts.size == 0 or float(np.median(ts)) > _EPOCH_US:
        return 0.0
    odd = "no baseTimeNanoseconds" if base is None else f"baseTimeNanoseconds {str(base)[:40]!r} is no time"
    raise TraceError(
        f"rank {rank}: timestamps are not on the wall clock ({odd}, median ts "
        f"{float(np.median(ts)):.0f} µs); pass offset_us= to to_pfw to place them."
    )


def _int_or_hash(value: Any) -> int:
    """A pid or tid as DFTracer writes it: the integer, or for text that is none or one
    beyond 64 bits (``load`` keeps such a pid as text), the CRC-32 of the text."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        number = None
    if number is not None and _INT64_MIN <= number <= _INT64_MAX:
        return number
    return zlib.crc32(_text(value).encode()) & 0x7FFFFFFF


def _text(value: Any) -> str:
    """``str(value)`` that UTF-8 can encode (a lone surrogate becomes ``?``)."""
    return str(value).encode("utf-8", "replace").decode("utf-8")


def _writable(value: Any) -> Any:
    """``value`` with what JSON (orjson) cannot write as it is written as text: an integer
    beyond 64 bits, a string with lone surrogates, an object of another type."""
    if isinstance(value, dict):
        return {_text(k): _writable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_writable(v) for v in value]
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        return value if _INT64_MIN <= value <= _UINT64_MAX else str(value)
    return _text(value)


def _dumps(record: dict[str, Any]) -> bytes:
    """One event as a line of JSON; a field orjson cannot write is written as text."""
    try:
        return orjson.dumps(record)
    except orjson.JSONEncodeError:
        return orjson.dumps(_writable(record))


def _whole_us(values: np.ndarray) -> np.ndarray:
    """µs as the integers ``.pfw`` holds: floored, clipped to int64's range (a ``ts`` of
    ``1e300`` has no integer), not a number as 0."""
    return np.floor(np.clip(np.nan_to_num(values, nan=0.0), -_INT64_FLOAT, _INT64_FLOAT)).astype(np.int64)


def _starts_with(names: pd.Series, prefix: str) -> np.ndarray:
    """Per row: whether the name (as text) starts with ``prefix``; tested once per category
    where the column is categorical. (``np.char`` on the names would first copy them all at
    the longest name's width: half a GB and 2 s on a GPU trace of 75,000 events.)"""
    if isinstance(names.dtype, pd.CategoricalDtype):
        flags = np.array([str(c).startswith(prefix) for c in names.cat.categories] + [False], dtype=bool)
        return flags[names.cat.codes.to_numpy()]  # a missing name (code -1) is "nan": the False appended
    return np.array([str(n).startswith(prefix) for n in names.astype(str).to_numpy()], dtype=bool)


def _raw(column: pd.Series, rows: np.ndarray) -> list[Any]:
    """The column's values at ``rows`` as the objects ``astype(object)`` gives (a missing one
    as it is: ``pd.NA`` or NaN)."""
    values: list[Any] = column.take(rows).astype(object).to_numpy().tolist()
    return values


def _values(column: pd.Series, rows: np.ndarray) -> tuple[list[Any], np.ndarray]:
    """The column's values at ``rows`` as Python objects, a missing one (``pd.NA``, ``None``,
    NaN) as None and a numpy scalar as its Python value, and the positions of those present:
    converted one column at a time, for the rows written only (converting every column whole
    and testing each value in the event loop took most of the export's time)."""
    values = _raw(column, rows)
    if column.dtype == object:
        values = [v.item() if isinstance(v, np.generic) else v for v in values]
    missing = column.take(rows).isna().to_numpy()
    for i in np.flatnonzero(missing).tolist():
        values[i] = None
    return values, np.flatnonzero(~missing)


def _ids(column: pd.Series, rows: np.ndarray) -> list[int]:
    """``_int_or_hash`` of the column's values at ``rows`` (pids, tids), computed once per
    category where the column is categorical."""
    part = column.take(rows)
    if isinstance(part.dtype, pd.CategoricalDtype):
        # a missing value is NaN after astype(object), as in _raw: its hash is the last entry
        per_category = [_int_or_hash(v) for v in part.cat.categories.astype(object).tolist()]
        per_category.append(_int_or_hash(math.nan))
        return [per_category[c] for c in part.cat.codes.to_numpy().tolist()]
    return [_int_or_hash(v) for v in _raw(column, rows)]


def _device(kind: str, device: Any) -> str:
    if kind in GPU_KINDS:
        return f"cuda:{device}" if device is not None else "cuda"
    if kind == "memory":
        return "cpu" if device is None or int(device) < 0 else f"cuda:{device}"
    return "cpu"


def _rank_args(
    trace: TraceTables,
    rows: np.ndarray,
    kinds_of: list[str],
    rank: int,
    hhash: int,
    memory_in: dict[int, tuple[int, int]],
) -> list[dict[str, Any]]:
    """Each written event's ``args``, built column by column (every key set in the order
    DFTracer's readers see it: the base keys, memory, the ids, bytes, shapes, step, module)."""
    ev = trace.events
    cats = [str(v) for v in _raw(ev["cat"], rows)]
    devices, _ = _values(ev["device"], rows)
    out: list[dict[str, Any]] = [
        {"hhash": hhash, "rank": rank, "kind": k, "kineto_cat": c, "device": _device(k, d)}
        for k, c, d in zip(kinds_of, cats, devices)
    ]
    if memory_in:
        where = {r: j for j, r in enumerate(rows.tolist())}
        for r in memory_in:
            j = where.get(r)
            if j is not None:
                out[j]["cpu_memory"], out[j]["device_memory_usage"] = memory_in[r]
    for key in ("stream", "rf_id", "external_id", "correlation", "seq", "flops"):
        values, present = _values(ev[key], rows)
        for j in present.tolist():
            out[j][key] = values[j]
    is_memory = np.array(kinds_of, dtype=object) == "memory"
    for key in ("bytes", "total_allocated", "total_reserved"):
        values, present = _values(ev[key], rows)
        for j in present[is_memory[present]].tolist():
            out[j][key] = int(values[j])
    for key, column in (("input_shapes", "input_dims"), ("input_types", "input_type")):
        values, present = _values(ev[column], rows)
        for j in present.tolist():
            if values[j]:
                out[j][key] = values[j]
    steps = ev["step"].to_numpy()[rows]
    for j, step in zip(np.flatnonzero(steps >= 0).tolist(), steps[steps >= 0].tolist()):
        out[j]["step"] = step
    module = ev["module"].to_numpy()[rows]
    layered = np.flatnonzero((module >= 0) & ~(np.array(kinds_of, dtype=object) == "python_function"))
    if layered.size:
        owners = np.unique(module[layered])
        names = dict(zip(owners.tolist(), ev["name"].take(owners).astype(str).to_numpy().tolist()))
        for j, m in zip(layered.tolist(), module[layered].tolist()):
            out[j]["module"] = names[m][len(MODULE_PREFIX) :]
    return out


def _events_lines(trace: TraceTables, kinds: Iterable[str], offset_us: float | None) -> Iterator[bytes]:
    ev = trace.events
    kinds = tuple(kinds)
    kind = ev["kind"].astype(str).to_numpy()
    keep = np.isin(kind, kinds)
    if "python_function" in kinds:  # only the nn.Module frames: the layers
        keep &= (kind != "python_function") | _starts_with(ev["name"], MODULE_PREFIX)
    host = (
        str(next((m.get("host_name") for m in trace.meta.get("ranks", {}).values() if m.get("host_name")), ""))
        or socket.gethostname()
    )
    hhash = zlib.crc32(_text(host).encode()) & 0x7FFFFFFF
    memory_in = _memory_inside(trace)
    next_id = 0
    seen_pids: set[tuple[int, int]] = set()
    yield _dumps(
        {
            "id": next_id,
            "name": "HH",
            "cat": "dftracer",
            "pid": 0,
            "tid": 0,
            "ph": "M",
            "args": {"name": host, "value": hhash},
        }
    )
    next_id += 1
    ranks, ts, dur = ev["rank"].to_numpy(), ev["ts"].to_numpy(), ev["dur"].to_numpy()
    for rank in sorted(set(ranks[keep].tolist())):
        offset = wall_clock_offset_us(trace, rank) if offset_us is None else float(offset_us)
        rows = np.flatnonzero(keep & (ranks == rank))
        start = _whole_us(ts[rows] + offset).tolist()
        end = _whole_us(ts[rows] + dur[rows] + offset).tolist()
        kinds_of = kind[rows].tolist()
        names = ev["name"].take(rows).astype(str).to_numpy().tolist()
        pids, tids = _ids(ev["pid"], rows), _ids(ev["tid"], rows)
        args = _rank_args(trace, rows, kinds_of, int(rank), hhash, memory_in)
        for j in range(len(rows)):
            pid = pids[j]
            if (rank, pid) not in seen_pids:
                seen_pids.add((rank, pid))
                label = f"rank {rank}" + (" GPU" if kinds_of[j] in GPU_KINDS else "")
                yield _dumps(
                    {
                        "id": next_id,
                        "name": "process_name",
                        "cat": "dftracer",
                        "pid": pid,
                        "tid": pid,
                        "ph": "M",
                        "args": {"name": label, "value": label},
                    }
                )
                next_id += 1
            yield _dumps(
                {
                    "id": next_id,
                    "name": names[j],
                    "cat": CATEGORY,
                    "pid": pid,
                    "tid": tids[j],
                    "ts": start[j],
                    "dur": max(end[j] - start[j], 0),
                    "ph": "X",
                    "args": args[j],
                }
            )
            next_id += 1


def _memory_inside(trace: TraceTables) -> dict[int, tuple[int, int]]:
    """Per CPU op row: bytes allocated on the CPU and on devices while it ran (net, inclusive)."""
    ev = trace.events
    kind = ev["kind"].to_numpy()
    mem = np.flatnonzero((kind == "memory") & ev["bytes"].notna().to_numpy())
    if mem.size == 0:
        return {}
    ops = np.flatnonzero(np.isin(kind, ("cpu_op", "user_annotation", "step")))
    out: dict[int, list[int]] = {}
    device = ev["device"].to_numpy(dtype=np.float64, na_value=-1.0)
    key_m = (ev["rank"].to_numpy()[mem].astype(np.int64) << 32) + ev["tid"].cat.codes.to_numpy()[mem]
    key_o = (ev["rank"].to_numpy()[ops].astype(np.int64) << 32) + ev["tid"].cat.codes.to_numpy()[ops]
    ts = ev["ts"].to_numpy()
    dur = ev["dur"].to_numpy()
    nbytes = ev["bytes"].to_numpy(dtype=np.float64, na_value=0.0)
    for slot, on_device in ((0, False), (1, True)):
        sel = mem[(device[mem] >= 0) == on_device]
        ksel = key_m[(device[mem] >= 0) == on_device]
        for key in np.unique(ksel):
            m = sel[ksel == key]
            order = np.argsort(ts[m], kind="stable")
            mts, csum = ts[m][order], np.concatenate([[0.0], np.cumsum(nbytes[m][order])])
            o = ops[key_o == key]
            lo = np.searchsorted(mts, ts[o], side="left")
            hi = np.searchsorted(mts, ts[o] + dur[o], side="right")
            total = csum[hi] - csum[lo]
            for row, value in zip(o[total != 0], total[total != 0]):
                out.setdefault(int(row), [0, 0])[slot] = int(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def to_pfw(
    trace: TraceTables,
    path: str | os.PathLike[str],
    *,
    kinds: Iterable[str] = DEFAULT_KINDS,
    offset_us: float | None = None,
) -> list[Path]:
    """Write a trace's events as DFTracer ``.pfw`` (plain) or ``.pfw.gz`` (gzip), by the name.

    Args:
        trace: a loaded ``Trace``.
        path: ``*.pfw`` or ``*.pfw.gz``.
        kinds: the event kinds to write (``tracemagic.trace.kineto.KINDS``); python
            frames are limited to ``nn.Module`` ones.
        offset_us: µs to add to ``ts`` (default: from the trace's ``baseTimeNanoseconds``,
            so timestamps are µs since the epoch).

    Every line is JSON whatever the trace holds: a pid or tid that is no 64-bit integer
    (text, or a number ``load`` kept as text) is written as the CRC-32 of its text, a time
    beyond int64 clipped to it, any other field JSON cannot hold as text.

    Returns:
        The path written, in a list (as every exporter of ``tracemagic.export``).

    Raises:
        ValueError: the name does not end in ``.pfw`` or ``.pfw.gz``.
        TraceError: the timestamps cannot be placed on the wall clock.
    """
    path = Path(path)
    if not path.name.endswith((".pfw", ".pfw.gz")):
        raise ValueError(f"{path.name}: a DFTracer trace is named *.pfw or *.pfw.gz")
    bad = set(kinds) - set(DEFAULT_KINDS) - {"trace", "other"}
    if bad:
        raise ValueError(f"unknown event kinds {sorted(bad)}; choose from {DEFAULT_KINDS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    opener: Callable[..., Any] = (
        (lambda p: gzip_to(p, path)) if path.name.endswith(".gz") else (lambda p: open(p, "wb"))  # noqa: SIM115 - opened in the with-statement below
    )
    try:
        with opener(tmp) as fh:
            fh.write(b"[\n")
            buffer: list[bytes] = []
            for line in _events_lines(trace, kinds, offset_us):
                buffer.append(line)
                if len(buffer) >= 4096:
                    fh.write(b"\n".join(buffer) + b"\n")
                    buffer.clear()
            if buffer:
                fh.write(b"\n".join(buffer) + b"\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return [path]


def pfw_trace(path: str | os.PathLike[str]) -> TraceTables:
    """Load a ``.pfw``/``.pfw.gz`` file (ours, or any DFTracer trace) as a ``Trace`` (the
    data: ``tracemagic.load(path)``, which reads ``.pfw`` files itself, gives the same with
    the analyses as methods; see ``tracemagic.trace.pfw``).

    Raises:
        TraceError: the file is missing, empty or has a line that is not JSON.
    """
    from tracemagic.trace.loader import load

    return load(path)


def read_pfw(path: str | os.PathLike[str]) -> pd.DataFrame:
    """The events of a ``.pfw``/``.pfw.gz`` file in tracemagic's events-table layout.

    See ``pfw_trace``; this is its ``events`` table (``ts`` in µs since the epoch).
    """
    return pfw_trace(path).events


def trace_handler(
    dir_name: str | os.PathLike[str],
    *,
    worker_name: str | None = None,
    gz: bool = True,
    kinds: Iterable[str] = DEFAULT_KINDS,
) -> Callable[[Any], list[Path]]:
    """An ``on_trace_ready`` callback that writes each profiler cycle as a ``.pfw[.gz]`` file.

    Use in plain torch.profiler code::

        with torch.profiler.profile(schedule=..., on_trace_ready=trace_handler("traces")) as p:
            ...

    Files are named ``<worker>.<step>.pfw.gz`` (worker defaults to ``<host>_<pid>``); ``.gz``
    is what DFTracer's analysis tools read.

    Args:
        dir_name: the directory to write to (created if needed).
        worker_name: the file-name prefix.
        gz: gzip the output (``.pfw.gz``).
        kinds: event kinds to write (see ``to_pfw``).
    """
    folder = Path(dir_name)
    worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
    kinds = tuple(kinds)

    def handler(prof: Any) -> list[Path]:
        from tracemagic.trace.loader import load

        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="tracemagic-pfw-") as tmp:
            kineto = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(kineto))
            trace = load(kineto, use_cache=False)
            step = getattr(prof, "step_num", 0)
            return to_pfw(trace, folder / f"{worker}.{step}.pfw{'.gz' if gz else ''}", kinds=kinds)

    return handler
