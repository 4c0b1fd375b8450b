"""Viewer-sized Chrome/Perfetto traces cut from a big one, and TensorBoard-style file names.

Perfetto's web UI handles traces up to a few hundred MB (chrome://tracing much less); a
capture of many steps on a GPU easily exceeds that. ``to_chrome_trace`` keeps chosen
``ProfilerStep``s: every host event inside them, the GPU events their runtime calls
launched (even when the kernel ran after the step ended), the flows between kept events,
and all metadata (process/thread names, ``deviceProperties``, ``distributedInfo``,
``baseTimeNanoseconds``). Events are copied byte for byte from the original file, so any
tool that read the original (HTA, TraceLens, Perfetto) reads the cut. The file is re-read
as ``load`` reads it (a BOM, data after the gzip stream, invalid UTF-8 and values nested too
deep are tolerated), and what ``load`` repairs is repaired in the copy too: invalid UTF-8
becomes ``?``, and in a file nested too deep for msgspec, what is nested over 200 levels
the text ``<nested too deep>``, so the cut is valid JSON; an entry of ``traceEvents`` that
is not an object is left out.

Open a result in https://ui.perfetto.dev ("Open trace file"); for files over ~1 GB use
Perfetto's ``trace_processor --httpd FILE`` and open the UI with ``?rpc_port=9001``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import orjson

from tracemagic.capture import files
from tracemagic.errors import TraceError
from tracemagic.trace.jsonvalues import LEADING, decode_or_repair, valid_utf8
from tracemagic.trace.kineto import GPU_CATEGORIES
from tracemagic.trace.read import ByteStream, Source, file_source, read_sources

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import TraceTables

__all__ = ["to_chrome_trace", "tb_name"]

#: event categories that run on a GPU (old and new spellings)
_GPU_CATS = GPU_CATEGORIES
#: what is dropped first when ``max_events`` bites (lowest priority first)
_PRIORITY = {"python_function": 0, "python": 0, "cpu_instant_event": 1}


def tb_name(worker: str | None = None, ts: int | None = None, *, gz: bool = False) -> str:
    """A file name as ``torch.profiler.tensorboard_trace_handler`` writes it.

    ``<worker>.<ts>.pt.trace.json[.gz]``: ``worker`` defaults to ``<hostname>_<pid>`` and
    ``ts`` to ``time.time_ns()``, as torch 2.13 does (the capture names files the same way).

    Raises:
        ValueError: a worker name containing a path separator.
    """
    worker = worker if worker is not None else files.tb_worker()
    if not worker or "/" in worker or os.sep in worker:
        raise ValueError(f"worker name {worker!r} must be a plain file-name part")
    return files.tb_name(worker, ts, gz)


class _Ids(msgspec.Struct, gc=False):
    """The ``args`` an event is matched by; the other keys are skipped, not decoded (building
    every event's ``args`` as a dict took most of the re-read)."""

    correlation: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    external_id_lower: Any = msgspec.field(default=None, name="external id")


class _Light(msgspec.Struct, gc=False):
    ph: Any = ""
    cat: Any = ""
    name: Any = ""
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = None
    id: Any = None
    args: _Ids | None = None  # an ``args`` that is no object: the event is read field by field


_TOP_RAW = msgspec.json.Decoder(dict[str, msgspec.Raw])
_EVENTS_RAW = msgspec.json.Decoder(list[msgspec.Raw])
_LIGHT = msgspec.json.Decoder(_Light)
_ANY = msgspec.json.Decoder()
#: the ``args`` keys of ``_Ids``, in its order
_ARG_KEYS = ("correlation", "External id", "external id")
#: the ids events are matched by: JSON scalars (a list or an object matches nothing)
_ID_TYPES = (str, int, float)


@dataclass
class _Rank:
    rank: int
    source: str
    meta: dict[str, msgspec.Raw]
    raw: list[msgspec.Raw]
    events: list[_Light]


def _source(source: str) -> Source:
    """The file (or tar member, ``archive!member``) a rank was loaded from, as ``load`` opens it.

    Raises:
        TraceError: it is not there (any more), or not a regular file.
    """
    if "!" in source and not Path(source).exists():
        # the archive is the longest prefix before a "!" that is a file (a folder may hold "!")
        cuts = [i for i, c in enumerate(source) if c == "!"]
        archive = next((source[:i] for i in reversed(cuts) if Path(source[:i]).is_file()), source[: cuts[0]])
        for member in read_sources(Path(archive)):
            if member.name == source:
                return member
        raise TraceError(f"{source}: not a trace in the archive (any more).", path=source)
    return file_source(Path(source))


def _read_source(source: str) -> bytes | bytearray:
    """The JSON of a rank's file, decompressed as ``load`` does it (gzip, several gzip
    members, data after the gzip stream ignored; see ``ByteStream``), with each invalid
    UTF-8 byte replaced by ``?`` (same length), as ``load`` reads it.

    Raises:
        TraceError: the file cannot be read, or its gzip is damaged or cut off.
    """
    with ByteStream(_source(source)) as stream:
        data = stream.read_all()
        if stream.truncated:
            raise TraceError(f"{source}: the gzip stream is cut off (the file is truncated).", path=source)
    return valid_utf8(data)


def _load_rank(rank: int, source: str) -> _Rank:
    """A rank's file: its metadata, and its events raw (bytes to copy) and decoded.

    Raises:
        TraceError: the file cannot be read; msgspec.DecodeError: its JSON is damaged.
    """
    data = _read_source(source)
    start = LEADING.match(data).end()  # type: ignore[union-attr]  # it matches the empty string
    body = memoryview(data)[start:]
    if data[start : start + 1] == b"[":
        meta: dict[str, msgspec.Raw] = {}
        listed = decode_or_repair(_EVENTS_RAW, body)
    else:
        top = decode_or_repair(_TOP_RAW, body)  # where msgspec cannot nest as deep, from a repaired copy
        meta = {k: v for k, v in top.items() if k != "traceEvents"}
        listed = decode_or_repair(_EVENTS_RAW, top.get("traceEvents", msgspec.Raw(b"[]")))
    raw: list[msgspec.Raw] = []
    events: list[_Light] = []
    for item in listed:  # (views of ``data``, or of a repaired copy where msgspec could not read it)
        try:
            event = _LIGHT.decode(item)
        except msgspec.ValidationError:
            found = _field_by_field(item)
            if found is None:  # not an object: no event (load skips it as well)
                continue
            event = found
        raw.append(item)
        events.append(event)
    return _Rank(rank, source, meta, raw, events)


def _field_by_field(item: msgspec.Raw) -> _Light | None:
    """The ``_Light`` of an event msgspec refuses whole (a number beyond float64 in it, which
    ``load`` reads as missing): each field, and each of its ``args``, read on its own, one
    that cannot be read left out; None for an entry that is not an object."""
    try:
        fields = _TOP_RAW.decode(item)
    except msgspec.DecodeError:
        return None
    values: dict[str, Any] = {}
    for name in _Light.__struct_fields__:
        if name in fields:
            decoder = _TOP_RAW if name == "args" else _ANY
            try:
                values[name] = decoder.decode(fields[name])
            except msgspec.DecodeError:
                continue
    args = values.pop("args", None)
    if isinstance(args, dict):
        found = {k: v for k, v in ((k, _lenient(args[k])) for k in _ARG_KEYS if k in args) if v is not None}
        values["args"] = _Ids(*(found.get(k) for k in _ARG_KEYS))
    return _Light(**values)


def _lenient(value: msgspec.Raw) -> Any:
    """A JSON value, or None where msgspec cannot read it."""
    try:
        return _ANY.decode(value)
    except msgspec.DecodeError:
        return None


def _num(value: Any) -> float:
    """A number field as a float; NaN for anything else (text, a list, an integer beyond float64)."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def _correlation(event: _Light) -> Any:
    return None if event.args is None else event.args.correlation


def _id(value: Any) -> Any:
    """An id events are matched by (``correlation``, ``External id``, a flow's ``id``); None
    for a value that is no JSON scalar (``[1]``: it links nothing)."""
    return value if isinstance(value, _ID_TYPES) else None


def _select(rank: _Rank, windows: list[tuple[float, float]] | None, max_events: int | None) -> list[int]:
    """Indexes of the raw events to keep."""
    events = rank.events
    n = len(events)
    ts = np.array([_num(e.ts) for e in events])
    dur = np.nan_to_num(np.array([_num(e.dur) for e in events]))
    ph = np.array([str(e.ph) for e in events])
    cats = np.array([str(e.cat).lower() for e in events])
    is_gpu = np.isin(cats, list(_GPU_CATS))
    is_flow = np.isin(ph, ["s", "f", "t"])
    is_meta = ph == "M"
    timed = ~is_flow & ~is_meta
    if windows is None:
        keep = timed.copy()
        inside = np.ones(n, dtype=bool)
    else:
        scale = 1000.0 if np.nanmedian(ts[timed]) > 1e17 else 1.0  # ns traces (the loader works in µs)
        inside = np.zeros(n, dtype=bool)
        for start, end in windows:
            inside |= (ts >= (start - 0.5) * scale) & (ts <= (end + 0.5) * scale)
        keep = inside & timed & ~is_gpu
        corr = {c for i in np.flatnonzero(keep).tolist() if (c := _id(_correlation(events[i]))) is not None}
        launched = np.zeros(n, dtype=bool)
        for i in np.flatnonzero(is_gpu).tolist():
            launched[i] = _id(_correlation(events[i])) in corr
        keep |= launched | (inside & is_gpu)
    trimmed = max_events is not None and int(keep.sum()) > max_events
    if trimmed:
        keep = _trim(keep, dur, cats, int(max_events))  # type: ignore[arg-type]
    # flows: those between kept events (ac2g ids are correlation ids), or all in the window
    kept = [a for i in np.flatnonzero(keep).tolist() if (a := events[i].args) is not None]
    ids = {v for a in kept for v in (a.correlation, a.external_id, a.external_id_lower) if isinstance(v, _ID_TYPES)}
    flows = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(is_flow).tolist():
        flows[i] = _id(events[i].id) in ids or (not trimmed and bool(inside[i]))
    return np.flatnonzero(keep | flows | is_meta).tolist()


def _trim(keep: np.ndarray, dur: np.ndarray, cats: np.ndarray, max_events: int) -> np.ndarray:
    """Keep ``max_events`` events, dropping python frames first, then the shortest ops."""
    candidates = np.flatnonzero(keep)
    priority = np.array([_PRIORITY.get(c, 2) for c in cats[candidates]])
    order = np.lexsort((-dur[candidates], -priority))
    out = np.zeros_like(keep)
    out[candidates[order[:max_events]]] = True
    return out


def _step_windows(trace: TraceTables, rank: int, steps: Iterable[int]) -> list[tuple[float, float]]:
    ev = trace.events
    sel = (ev["rank"].to_numpy() == rank) & (ev["kind"] == "step").to_numpy()
    rows = np.flatnonzero(sel)
    numbers = ev["step"].to_numpy()[rows]
    wanted = set(int(s) for s in steps)
    available = sorted(set(int(s) for s in numbers))
    missing = wanted - set(available)
    if missing:
        raise ValueError(f"rank {rank}: no ProfilerStep {sorted(missing)} in this trace (steps: {available or 'none'})")
    ts = ev["ts"].to_numpy()[rows]
    end = ts + ev["dur"].to_numpy()[rows]
    return [(float(a), float(b)) for a, b, s in zip(ts, end, numbers) if int(s) in wanted]


def _steps_that_fit(trace: TraceTables, rank: int, max_events: int) -> list[int] | None:
    """The first consecutive steps whose events fit in ``max_events`` (at least one), or
    None when the trace has no ProfilerStep."""
    ev = trace.events
    mine = ev["rank"].to_numpy() == rank
    step = ev["step"].to_numpy()[mine]
    numbers = sorted(set(int(s) for s in step[(ev["kind"] == "step").to_numpy()[mine]]))
    if not numbers:
        return None
    counts = {int(k): int(v) for k, v in zip(*np.unique(step[step >= 0], return_counts=True))}
    chosen: list[int] = []
    total = 0
    for number in numbers:
        total += counts.get(number, 0)
        if chosen and total > max_events:
            break
        chosen.append(number)
    return chosen


def _write(path: Path, rank: _Rank, keep: list[int], world: int) -> None:
    meta = dict(rank.meta)
    parts = []
    if "distributedInfo" not in meta:
        # HTA finds a file's rank with the regex '"rank":\s+(\d+)' (note the space)
        parts.append(f'"distributedInfo": {{"rank": {rank.rank}, "world_size": {world}}}'.encode())
    for key, value in meta.items():
        parts.append(orjson.dumps(key) + b": " + bytes(value))
    raw = rank.raw
    body = b",\n".join([raw[i] for i in keep])  # the Raw views themselves: no copy of each
    blob = b"{\n" + b",\n".join(parts + [b'"traceEvents": [\n' + body + b"\n]"]) + b"\n}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        if path.name.endswith(".gz"):
            with files.gzip_to(tmp, path) as fh:
                fh.write(blob)
        else:
            tmp.write_bytes(blob)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _reread(rank: int, source: str) -> _Rank:
    """``_load_rank``, what stops it a ``TraceError`` that names the file and says what to do.

    Raises:
        TraceError: the file is gone, unreadable, or its JSON is damaged.
    """
    advice = (
        "to_chrome_trace copies the events from the file the trace was loaded from, so it must "
        "still be there, whole and unchanged; trace.to_pfw(path) writes the loaded events "
        "instead (Perfetto opens .pfw files too)."
    )
    try:
        return _load_rank(rank, source)
    except TraceError as exc:
        raise TraceError(f"cannot re-read the original trace: {exc} {advice}", path=source) from None
    except (OSError, msgspec.DecodeError) as exc:
        raise TraceError(f"{source}: cannot re-read the original trace ({exc}). {advice}", path=source) from None
    except MemoryError:
        raise TraceError(
            f"{source}: this machine ran out of memory re-reading the original trace; free memory, "
            "or export on a machine with more.",
            path=source,
        ) from None


def to_chrome_trace(
    trace: TraceTables,
    path: str | os.PathLike[str],
    steps: Iterable[int] | None = None,
    max_events: int | None = None,
) -> list[Path]:
    """Write a trimmed Chrome/Perfetto trace (``.json`` or ``.json.gz``) per rank.

    Args:
        trace: a loaded ``Trace`` (its original files are re-read, so they must still exist).
        path: the output file for a single-rank trace; for several ranks, a directory that
            receives ``rank<r>.pt.trace.json[.gz]`` (gzip when ``path`` ends in ``.gz``).
        steps: ``ProfilerStep`` numbers to keep (default: the whole trace, or with
            ``max_events`` the first steps that fit).
        max_events: an upper bound on timed events per rank. Without ``steps``, whole steps
            are kept from the first on while they fit; whatever still exceeds the bound is
            cut, python frames first, then the shortest events. Metadata events and the
            flows between kept events come on top.

    Returns:
        The files written, by rank.

    Raises:
        ValueError: a step that is not in the trace, or ``max_events`` < 1.
        TraceError: the trace's source files cannot be read any more (moved, deleted,
            changed since the trace was loaded, or damaged: loaded with ``recover=True``).
    """
    path = Path(path)
    ranks = trace.rank_ids
    steps = None if steps is None else sorted(set(int(s) for s in steps))
    if max_events is not None and max_events < 1:
        raise ValueError("max_events must be positive")
    sources = {r: trace.meta.get("ranks", {}).get(r, {}).get("source") for r in ranks}
    missing = [r for r, s in sources.items() if not s]
    if missing:
        raise TraceError(f"ranks {missing}: the trace does not record which file they came from; load it from a file.")
    gz = path.name.endswith(".gz")
    written = []
    for r in ranks:
        chosen = steps if steps is not None else (_steps_that_fit(trace, r, max_events) if max_events else None)
        windows = _step_windows(trace, r, chosen) if chosen is not None else None
        loaded = _reread(r, str(sources[r]))
        keep = _select(loaded, windows, max_events)
        out = path if len(ranks) == 1 else path / f"rank{r}.pt.trace.json{'.gz' if gz else ''}"
        _write(out, loaded, keep, world=len(ranks))
        written.append(out)
    return written
