"""``tracemagic.load``: any Kineto trace (file, gzip, tar, capture directory, rank directory)
into one analysis-ready events table, cached as Arrow IPC (see ``trace.cache``)."""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from tracemagic.errors import TraceError
from tracemagic.trace import cache, layout, normalize, parse, split, structure
from tracemagic.trace.kineto import CPU_KINDS, tb_worker
from tracemagic.trace.model import TraceTables
from tracemagic.trace.parse import ParsedTrace
from tracemagic.trace.pfw import is_pfw, pfw_to_kineto
from tracemagic.trace.progress import Aggregate, Progress, bar_for
from tracemagic.trace.read import (
    MAX_RATIO,
    Source,
    default_max_bytes,
    file_source,
    inside,
    memory_guard,
    rank_files,
    read_sources,
    regular_file,
)
from tracemagic.trace.shared_keys import Shared

_log = logging.getLogger(__name__)

#: row-number columns that must be shifted when ranks are stacked
ROW_COLUMNS = ("parent", "launch", "op", "module")
#: after parsing at least this much JSON, the heap the parse freed is handed back
TRIM_MIN_BYTES = 8 << 20


@functools.cache
def _malloc_trim() -> Any:
    """The C library's ``malloc_trim`` (glibc), or None where there is none (macOS, musl, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def release_free_memory() -> None:
    """Hand the heap memory the parse freed back to the system. glibc keeps what the
    parsing threads freed in their own arenas (the second thread of ``trace.split``) and
    the holes the chunks left: ~40 MB after a 100 MB trace, counted in the session's
    memory until it ends, since the analyses (on the main thread) do not reuse it. Costs
    ~2 ms; a no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _prepare(parsed: ParsedTrace) -> ParsedTrace:
    """Normalize one rank's columns and add the derived structure (its temporaries, too,
    reuse freed heap memory: ``heap_for_tables`` first)."""
    heap_for_tables(len(parsed.events))
    parsed.events, dropped = normalize.without_timeless(parsed.events)
    parsed.flows, dropped_flows = normalize.without_timeless(parsed.flows)
    if dropped or dropped_flows:
        parsed.warnings.append(
            f"{parsed.meta.get('source')}: {dropped} events and {dropped_flows} flow events without a "
            "timestamp (ts) left out"
        )
    parsed.events["kind"], odd_marks = normalize.event_kinds(parsed.events)
    if odd_marks:
        parsed.warnings.append(normalize.odd_marks_warning(str(parsed.meta.get("source")), odd_marks))
    parsed.events, negative = normalize.without_negative_durations(parsed.events)
    if negative:
        kinds = ", ".join(f"{count} {kind}" for kind, count in negative.items())
        parsed.warnings.append(
            f"{parsed.meta.get('source')}: {sum(negative.values())} events with a negative duration (dur) left out "
            f"({kinds}): no end to place them by (torch >= 2.7 writes dur -1 for an op still running when the "
            "profiler stopped; its own key_averages leaves such ops out)"
        )
    events = parsed.events
    if normalize.timestamps_in_ns(events["ts"].to_numpy()):
        events["ts"] = events["ts"] / 1000.0
        events["dur"] = events["dur"] / 1000.0
        parsed.flows["ts"] = parsed.flows["ts"] / 1000.0
        parsed.warnings.append("timestamps were in nanoseconds; converted to µs")
    changed = normalize.device_and_stream(events)
    memory = normalize.kind_mask(events, "memory")
    if memory.any():  # on the arrays: a Series' masked assignment aligns on the index (~4x slower)
        changed["bytes"] = normalize.filled_where(events["bytes"].array, events["mem_bytes"].array, memory)
    added, parsed.cpu_by_thread, parsed.thread_keys, notes = structure.structure_columns(events)
    parsed.warnings.extend(f"{parsed.meta.get('source')}: {note}" for note in notes)
    # one new table sharing the columns (``events[c] = ...`` copies each, ~1.5 ms a column)
    data = {c: changed[c] if c in changed else _values(events[c]) for c in events.columns if c not in _PARSE_ONLY}
    data.update(added)
    parsed.events = pd.DataFrame(data, copy=False)
    return parsed


#: ``heap_for_tables``: the most the analyses' temporaries reuse from the heap, in bytes a
#: row (four float64 columns), and glibc's cap on its mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX``)
HEAP_BYTES_A_ROW = 32
_MMAP_THRESHOLD_MAX = 32 << 20


def heap_for_tables(rows: int) -> None:
    """Let the analyses' temporaries (a few columns each) reuse freed heap memory.

    glibc serves a request above its mmap threshold with a fresh mapping, each page of
    it faulted in on first touch and unmapped when freed; the threshold rises to the
    largest mapped block freed (up to 32 MiB). The loader's numpy temporaries used to
    raise it as a side effect; with the nesting in C nothing that large is freed, and
    the tables of a 100 MB trace paid ~10000 more page faults (``layers`` twice its own).
    Allocating and freeing one block of ``HEAP_BYTES_A_ROW`` bytes a row, never touched
    (no page of it is used), raises it as before. A no-op but for the allocation
    elsewhere than glibc.
    """
    size = min(HEAP_BYTES_A_ROW * rows, _MMAP_THRESHOLD_MAX - (1 << 20))
    if size > 0:
        block = np.empty(size, dtype=np.uint8)  # (numpy's allocation: glibc's malloc, then free)
        del block


#: columns the parse fills for ``_prepare`` alone
_PARSE_ONLY = ("mem_bytes", "device_id")


def _values(column: pd.Series) -> Any:
    """A column's array, for a new table to share (not copy)."""
    return column.array if isinstance(column.dtype, pd.api.extensions.ExtensionDtype) else column.to_numpy()


def parse_source(
    source: Source, recover: bool = False, progress: Progress | None = None, workers: int | None = None
) -> ParsedTrace:
    """Parse and prepare one file (a large one on two threads, see ``trace.split``).

    Raises:
        TraceError: the file is damaged, or too large for the memory (``memory_guard``).
    """
    with memory_guard(source.name, source.max_bytes):
        large = source.size >= TRIM_MIN_BYTES
        ended: list[int | None] = []  # the split parse's second thread, once it has run
        parsed = split.parse_split(source, progress, ended=ended) if split.can_split(source, workers) else None
        if parsed is None:
            parsed = parse.parse_source(source, recover=recover, progress=progress)
        parsed.meta["source"] = source.name
        parsed.meta.setdefault("rank_hint", source.rank_hint)
        if large and not ended:
            release_free_memory()  # before the structure adds its columns
        prepared = _prepare(parsed)
        if large and ended:
            # what the split parse freed, its second thread's arena included, handed back
            # after the preparation, whose columns reuse this thread's freed heap (trimmed
            # first, they faulted ~2000 pages of a 100 MB trace in again; and the trim, on
            # another thread, held the heap's lock while the preparation allocated)
            split.trim_thread_arena(ended[0])
        return prepared


#: ranks are stored as int32
_MAX_RANK = 2**31 - 1


def assign_ranks(
    metas: list[dict[str, Any]], same_as: Mapping[int, int] | None = None
) -> tuple[list[int], dict[int, str]]:
    """Each file's rank from its parse metadata: its ``distributedInfo``'s (``rank``), else
    its name's or manifest's (``rank_hint``), else that of the earlier file ``same_as``
    names for it (``_one_workers_cycles``), else the first free one; and a warning by
    index for each rank outside 0 .. 2**31-1 (not taken)."""
    taken: list[int | None] = []
    warnings: dict[int, str] = {}
    for index, meta in enumerate(metas):
        rank = meta.get("rank")
        if rank is None:
            rank = meta.get("rank_hint")
        if rank is not None and not 0 <= rank <= _MAX_RANK:
            warnings[index] = f"{meta.get('source')}: rank {rank} is out of range; numbered as the next free rank"
            rank = None
        taken.append(rank)
    used = {r for r in taken if r is not None}
    free = (r for r in range(len(metas) + len(used) + 1) if r not in used)
    out: list[int] = []
    for index, rank in enumerate(taken):
        if rank is None:
            lead = (same_as or {}).get(index)
            rank = out[lead] if lead is not None and lead < index else next(free)
        out.append(rank)
    return out, warnings


def _assign_ranks(parsed: list[ParsedTrace], path: Path) -> list[int]:
    """``assign_ranks`` of parsed files (its warnings, and ``world_size_warnings``, go to theirs).

    Raises:
        TraceError: files of one rank that are not one run's profiler cycles (``shared_rank``).
    """
    metas = [p.meta for p in parsed]
    same_as = _one_workers_cycles(parsed)
    ranks, warnings = assign_ranks(metas, same_as)
    for index, warning in warnings.items():
        parsed[index].warnings.append(warning)
    for index, warning in world_size_warnings(metas, path):
        parsed[index].warnings.append(warning)
    if len(set(ranks)) < len(ranks):
        shared_rank(parsed, ranks, path, checked={*same_as, *same_as.values()})
    return ranks


def _one_workers_cycles(parsed: list[ParsedTrace]) -> dict[int, int]:
    """The files that are one rank because torch's ``tensorboard_trace_handler`` wrote them
    as one worker's profiler cycles (a ``schedule(..., repeat=2)`` writes a file per cycle,
    ``<host>_<pid>.<span>.pt.trace.json``, with no rank in them when not distributed): file
    index -> the index of the worker's first file. Only files with no rank of their own,
    and only where they are cycles (``_not_cycles``: apart in time, no step number twice);
    other files of one worker (two runs of one process) stay ranks of their own."""
    workers: dict[str, list[int]] = {}
    for index, p in enumerate(parsed):
        if p.meta.get("rank") is None and p.meta.get("rank_hint") is None:
            worker = tb_worker(str(p.meta.get("source", "")).split("!")[-1])
            if worker is not None:
                workers.setdefault(worker, []).append(index)
    out: dict[int, int] = {}
    for files in workers.values():
        if len(files) > 1 and _not_cycles([parsed[i] for i in files]) is None:
            out.update({i: files[0] for i in files[1:]})
    return out


def world_size_warnings(metas: list[dict[str, Any]], path: Path) -> list[tuple[int, str]]:
    """(file index, warning) for each file whose ``distributedInfo`` rank is not below its
    ``world_size``, and one when the files' (of ``path``) world sizes differ: they are not
    of one job."""
    out = []
    sizes: dict[int, list[str]] = {}
    for index, meta in enumerate(metas):
        rank, size = meta.get("rank"), meta.get("world_size")
        if size is None:
            continue
        sizes.setdefault(size, []).append(str(meta.get("source")))
        if rank is not None and rank >= size:
            out.append((index, f"{meta.get('source')}: rank {rank} is not below its world_size {size}"))
    if len(sizes) > 1:
        said = "; ".join(f"{size} in {_some(names)}" for size, names in sorted(sizes.items()))
        out.append((0, f"{path}: the files are not of one job: their world_size differs ({said})"))
    return out


def _some(names: list[str], most: int = 3) -> str:
    """Up to ``most`` names, and how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def shared_rank(
    parsed: list[ParsedTrace], ranks: list[int], path: Path, checked: frozenset[int] | set[int] = frozenset()
) -> None:
    """Allow files of one rank only where they are the profiler cycles of one run (a
    ``--repeat`` capture's ``kineto_trace_<rank>_cycle<k>.json``, torch's
    ``tensorboard_trace_handler`` writing a file per cycle): one rank's timeline, which the
    loader stacks. Cycles of one process never overlap in time nor repeat a step number;
    files that do are separate runs or copies of one trace, whose calls stacked as one rank
    would be counted as one process's. ``checked``: indices of files already found to be
    one worker's cycles (``_one_workers_cycles``), whose rank is not checked again.

    Raises:
        TraceError: naming the files of the first such rank, and what to do.
    """
    by_rank: dict[int, list[int]] = {}
    for index, rank in enumerate(ranks):
        by_rank.setdefault(rank, []).append(index)
    for rank, indices in sorted(by_rank.items()):
        if len(indices) < 2 or checked.issuperset(indices):
            continue
        files = [parsed[i] for i in indices]
        why = _not_cycles(files)
        if why is None:
            continue
        names = [str(p.meta.get("source")) for p in files]
        one = "extract the archive and load" if "!" in names[0] else "load"
        raise TraceError(
            f"{path}: {len(files)} files claim rank {rank} ({_some(names, 4)}) and {why}: they are not the "
            "profiler cycles of one run but separate runs or copies of one trace, which would be counted as one "
            f"process. To read them, {one} one file at a time (tracemagic.load('{names[0].split('!')[-1]}')), or "
            "put each run's rank files in a folder of their own.",
            path=str(path),
        )


def _not_cycles(files: list[ParsedTrace]) -> str | None:
    """Why the files of one rank cannot be one run's profiler cycles, or None if they can be:
    they repeat a ProfilerStep number, or the times of their CPU events (of all events in a
    file without any) overlap. (GPU work launched in one cycle may still run when the next
    begins: cycles written back to back overlap there.)"""
    spans = []
    steps: set[int] = set()
    for p in files:
        events = p.events
        numbers = np.unique(events["step"].to_numpy())
        repeated = steps.intersection(numbers[numbers >= 0].tolist())
        if repeated:
            return f"repeat ProfilerStep#{min(repeated)}"
        steps.update(numbers[numbers >= 0].tolist())
        cpu = normalize.kind_mask(events, *CPU_KINDS)
        rows = np.flatnonzero(cpu) if cpu.any() else np.arange(len(events))
        if rows.size:
            ts = events["ts"].to_numpy()[rows]
            ends = ts + np.nan_to_num(events["dur"].to_numpy()[rows])
            spans.append((float(ts.min()), float(ends.max())))
    end = -np.inf
    for start, stop in sorted(spans):
        if start < end - structure.NEST_TOLERANCE_US:
            return "overlap in time"
        end = max(end, stop)
    return None


def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Stack tables whose categorical columns have different categories (keeps categoricals)."""
    if len(frames) == 1:
        return frames[0]
    out = {}
    for column in frames[0].columns:
        parts = [f[column] for f in frames]
        if isinstance(parts[0].dtype, pd.CategoricalDtype):
            out[column] = pd.Categorical(union_categoricals([p.array for p in parts], ignore_order=True))
        else:
            out[column] = pd.concat(parts, ignore_index=True)
    return pd.DataFrame(out)


def _fresh(values: np.ndarray, frame: pd.DataFrame) -> pd.Series:
    """A new column for ``frame.insert`` that it keeps as it is (an array is copied: ~1 ms
    and 500 page faults for the rank column of a 100 MB trace)."""
    return pd.Series(values, index=frame.index, copy=False)


class Found(NamedTuple):
    """What preparing the events found that the analyses share (``Trace.shared``), or None:
    the CPU events' rows in nesting order (``structure.cpu_by_thread``) and each event's
    ``structure.thread_keys``."""

    cpu_by_thread: np.ndarray | None = None
    thread_keys: np.ndarray | None = None


def _stack(parsed: list[ParsedTrace], ranks: list[int]) -> tuple[pd.DataFrame, pd.DataFrame, Found]:
    """The ranks' events and flows stacked in rank order (row columns shifted to match),
    and what the preparation found: the ``cpu_by_thread`` rows (unless a rank lacks them),
    and of one file its ``thread_keys`` (stacked ranks' categories, and so keys, are others)."""
    offset = 0
    events: list[pd.DataFrame] = []
    flows: list[pd.DataFrame] = []
    orders: list[np.ndarray] = []
    for p, rank in sorted(zip(parsed, ranks), key=lambda pr: pr[1]):
        frame = p.events
        frame.insert(0, "rank", _fresh(np.full(len(frame), rank, dtype=np.int32), frame))
        if offset:
            for column in ROW_COLUMNS:
                values = frame[column].to_numpy()
                frame[column] = np.where(values >= 0, values + offset, -1)
        if p.cpu_by_thread is not None:
            orders.append(p.cpu_by_thread + offset if offset else p.cpu_by_thread)
        offset += len(frame)
        events.append(frame)
        p.flows.insert(0, "rank", _fresh(np.full(len(p.flows), rank, dtype=np.int32), p.flows))
        flows.append(p.flows)
    order = None
    if orders and len(orders) == len(parsed):
        order = orders[0] if len(orders) == 1 else np.concatenate(orders)
    keys = parsed[0].thread_keys if len(parsed) == 1 else None
    if keys is not None and ranks[0]:  # (as ``structure.thread_keys`` of the table with its rank column)
        keys |= np.int64(ranks[0]) << 42
    stacked = concat(events)
    if order is not None and len(orders) > 1:
        # each rank's order is by its own pid/tid codes; stacking renumbers them (one set of
        # categories for all ranks), so the ranks' orders one after another are the whole's
        # only where the stacked keys still never go down: else it is made again when needed
        along = structure.thread_keys(stacked, order)
        if (along[1:] < along[:-1]).any():
            order = None
    return stacked, concat(flows), Found(order, keys)


def _manifest(path: Path) -> tuple[dict[str, Any] | None, dict[Path, int | None] | None]:
    """A capture directory's manifest and the Kineto files it lists, with their ranks."""
    manifest_path = path / layout.MANIFEST
    if not manifest_path.is_file() or not inside(path, [manifest_path])[0]:
        return None, None
    manifest = dict(layout.read_manifest(manifest_path))
    return manifest, _manifest_kineto(path, manifest.get("files"))


def _manifest_kineto(path: Path, files: Any) -> dict[Path, int | None] | None:
    """The Kineto files a manifest lists that exist, with the rank it gives each, or None
    (then the folder is scanned).

    ``%%chakra_trace`` writes ``files: [{path, kind, rank, cycle, bytes}]`` (the Kineto
    traces have ``kind: "kineto"``, whatever their names, e.g. ``--tb-names``, so the
    manifest's rank is trusted over a number in the name); a ``files: {"kineto": [names]}``
    mapping is read too.
    """
    entries: list[tuple[Any, Any]]
    if isinstance(files, dict) and isinstance(files.get("kineto"), list):
        entries = [(name, None) for name in files["kineto"]]
    elif isinstance(files, list):
        entries = [
            (e.get("path"), e.get("rank")) for e in files if isinstance(e, dict) and e.get("kind") == layout.KINETO_KIND
        ]
    else:
        return None
    # plain names only: a manifest from someone else cannot point outside its folder
    found = {
        path / name: rank if isinstance(rank, int) else None
        for name, rank in entries
        if isinstance(name, str) and Path(name).name == name and (path / name).is_file()
    }
    return found or None


def folder_ranks(path: Path) -> tuple[dict[str, Any] | None, dict[Path, int | None], list[Path]]:
    """A folder's rank traces: its capture manifest (or None), the files it lists (or the
    folder's trace files) that lie in it with the rank the manifest gives each (or None),
    and the symlinks leading out of it (skipped).

    Raises:
        TraceError: no trace in it, or only symlinks leading out of it.
    """
    manifest, listed = _manifest(path)
    if listed is None:
        listed = {p: None for p in rank_files(path)}
    kept, outside = inside(path, listed)
    if not kept:
        raise TraceError(
            f"{path}: its trace files ({', '.join(p.name for p in outside[:4])}) are symlinks to "
            "files outside the folder, which tracemagic does not follow. Load the files "
            "themselves, or copy them into the folder.",
            path=str(path),
        )
    return manifest, {p: listed[p] for p in kept}, outside


def skipped(path: Path, outside: list[Path]) -> str:
    """The warning for the symlinks of ``path`` that lead out of it."""
    names = ", ".join(p.name for p in outside[:4])
    return f"{path}: skipped {len(outside)} symlinks to files outside the folder ({names})"


def load(
    path: str | os.PathLike[str],
    *,
    recover: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    workers: int | None = None,
    progress: bool | Progress | None = None,
    max_bytes: int | None = None,
    allow_high_compression: bool = False,
) -> TraceTables:
    """Load a Kineto trace into an analysis-ready ``Trace``.

    Args:
        path: a ``.json``/``.json.gz`` trace, a ``.tar``/``.tar.gz`` of rank traces, a
            capture directory written by ``%%chakra_trace``, a directory of rank traces, or
            a DFTracer ``.pfw``/``.pfw.gz`` file (as ``trace.to_pfw`` writes it).
        recover: keep the events before the damage of a truncated or corrupt file
            instead of raising ``TraceError`` (a warning in ``trace.warnings`` says where).
        cache_dir: the folder to keep the cache in (default: inside a capture directory
            tracemagic wrote, else ``$TRACEMAGIC_CACHE_DIR`` or ``$XDG_CACHE_HOME/tracemagic``;
            nothing is ever written next to a trace tracemagic did not write).
        use_cache: read and write the cache (checked on every open: an edited trace or a
            damaged cache means a fresh parse). A fresh parse's cache entry is written
            when the trace is dropped or the session ends (or the trace is loaded again),
            so ``load`` does not wait for it.
        workers: how many threads to parse a file with (default: as many cores as there
            are): a large JSON file is read by two threads; ``1`` parses in this thread only.
            Rank files are parsed one after another (``tracemagic.load_ranks`` parses them
            on a Dask cluster).
        progress: ``None`` shows a progress bar (a widget in a notebook, a line on a
            terminal's stderr) for inputs over 50 MB; ``True`` always, ``False`` never; or a
            callable ``progress(done_bytes, total_bytes)`` called as the files are read.
        max_bytes: the most JSON one load may decompress from ``.gz`` files and archives
            (default: half the memory available, at least 256 MiB), so a small file that
            inflates to gigabytes (a decompression bomb) stops with a ``TraceError`` instead
            of filling the memory; raise it to load a larger trace.
        allow_high_compression: load a ``.gz`` (or ``.tar.gz``) that inflates more than
            ``MAX_RATIO`` (200) times; by default such a file is refused as a decompression
            bomb once 64 MiB came out of it (real traces compress 7 to 30 times).

    Only regular files are read (not FIFOs or devices), and in a folder only the files that
    lie in it (symlinks leading out of it are skipped, with a warning).

    Raises:
        TraceError: the path holds no Kineto trace, or a damaged one (naming the file and
            byte offset), or another kind of file (an Execution Trace, a memory timeline),
            or more than ``max_bytes`` of JSON, or a gzip inflating more than ``MAX_RATIO``
            times, or the machine ran out of memory loading it.
    """
    path = Path(path)
    limit = default_max_bytes() if max_bytes is None else max_bytes
    ratio = None if allow_high_compression else MAX_RATIO
    manifest: dict[str, Any] | None = None
    listed: dict[Path, int | None] | None = None
    outside: list[Path] = []
    if path.is_dir():
        manifest, listed, outside = folder_ranks(path)
    elif not path.exists():
        raise TraceError(f"{path}: no such file or directory.", path=str(path))
    else:
        regular_file(path)
    files = list(listed) if listed is not None else None
    try:
        entry = cache.entry(path, files, recover, cache_dir) if use_cache else None
    except OSError:  # an unreadable source: parsing it says what is wrong
        entry = None
    if entry is not None:
        cache.flush_pending(entry.places)  # parsed earlier in this process: its entry is written now
        hit = cache.read(entry)
        if hit is not None:
            events, flows, meta, base, events_sum = hit
            _log.debug("%s: %d events read from the cache", path, len(events))
            trace = TraceTables(events, flows, named_at(meta, str(path)), path=path, manifest=manifest)
            trace.store = _table_store((base, events_sum), entry, manifest, events)
            return trace
    if listed is not None:
        sources = [file_source(p, rank, limit, ratio) for p, rank in listed.items()]
    elif is_pfw(path.name):
        with memory_guard(str(path), limit):
            sources = [Source.from_bytes(str(path), pfw_to_kineto(path, limit, ratio))]
    else:
        sources = read_sources(path, limit, ratio)
    total = sum(s.size for s in sources)
    callback = bar_for(progress, total, path.name)
    parsed = _parse_sources(sources, recover, callback, total, workers)
    if total >= TRIM_MIN_BYTES and min(s.size for s in sources) < TRIM_MIN_BYTES:
        # files too small to be trimmed after their own parse (``parse_source``): the heap
        # they freed. Not after large files alone: each was trimmed once its events were
        # prepared (``parse_source``)
        release_free_memory()
    if outside:
        parsed[0].warnings.append(skipped(path, outside))
    events, flows, meta, found = assemble(parsed, path)
    _log.debug(
        "%s: parsed %d file(s) (%.1f MB read), %d events (cache: %s)",
        path,
        len(sources),
        total / 1e6,
        len(events),
        "off" if not use_cache else "none" if entry is None else "missed",
    )
    if callback is not None:
        callback(total, total)
    trace = as_trace(events, flows, meta, found, path, manifest)
    if entry is not None:
        # the cache entry is written when the trace is dropped or the process ends (or the
        # trace is loaded again): the user does not wait for it (see cache.PendingEntry)
        pending = cache.PendingEntry(entry, path, events, flows, meta)
        weakref.finalize(trace.lifetime, pending.flush)  # runs at exit too
        trace.store = _table_store(pending, entry, manifest, trace.events)
    return trace


def named_at(meta: dict[str, Any], path: str) -> dict[str, Any]:
    """A cached trace's metadata with its paths as this load names the trace: the entry keeps
    the names of the load that wrote it (``a/t.json`` read from another working directory
    is ``/abs/a/t.json`` here), and ``to_chrome_trace`` re-reads each rank's ``source``."""
    old = meta.get("path")
    if not isinstance(old, str) or old == path:
        return meta
    ranks: dict[Any, Any] = {}
    for rank, about in (meta.get("ranks") or {}).items():
        source = about.get("source") if isinstance(about, dict) else None
        if isinstance(source, str) and (source == old or source.startswith((f"{old}/", f"{old}!", f"{old}{os.sep}"))):
            about = {**about, "source": path + source[len(old) :]}
        ranks[rank] = about
    return {**meta, "path": path, "ranks": ranks}


def _table_store(
    sealed: tuple[Path, str] | cache.PendingEntry,
    entry: cache.Entry,
    manifest: dict[str, Any] | None,
    events: pd.DataFrame,
) -> cache.TableStore | None:
    """Where a cached trace's analysis tables are kept (None with ``$TRACEMAGIC_TABLE_CACHE=0``):
    tied to its events file (``sealed``: its base path and checksum, or the entry still to
    be written), the code, and the manifest the analyses read."""
    if not cache.TableStore.enabled():
        return None
    return cache.TableStore(sealed, entry, json.dumps(manifest, sort_keys=True, default=str), events)


def assemble(parsed: list[ParsedTrace], path: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], Found]:
    """Parsed files into one trace's events, flows and metadata, ranked and stacked (and the
    intermediate results the analyses share that the preparation found, see ``_stack``)."""
    ranks = _assign_ranks(parsed, path)
    events, flows, found = _stack(parsed, ranks)
    meta = {
        "path": str(path),
        "ranks": {rank: p.meta for p, rank in zip(parsed, ranks)},
        "processes": {rank: p.processes for p, rank in zip(parsed, ranks)},
        "threads": {rank: {f"{k[0]}/{k[1]}": v for k, v in p.threads.items()} for p, rank in zip(parsed, ranks)},
        "warnings": [w for p in parsed for w in p.warnings],
    }
    return events, flows, meta, found


def as_trace(
    events: pd.DataFrame,
    flows: pd.DataFrame,
    meta: dict[str, Any],
    found: Found,
    path: Path,
    manifest: dict[str, Any] | None = None,
) -> TraceTables:
    """The ``Trace`` of assembled tables, with what the preparation found (nesting sorted
    the CPU events and keyed their threads already: the analyses need not again)."""
    trace = TraceTables(events, flows, meta, path=path, manifest=manifest)
    if found.cpu_by_thread is not None:
        kept = structure.narrow_rows(found.cpu_by_thread)
        trace.shared(Shared.CPU_BY_THREAD, lambda: kept)
    keys = found.thread_keys
    if keys is not None:
        trace.shared(Shared.THREAD_KEYS, lambda: keys)
    return trace


def _parse_sources(
    sources: list[Source], recover: bool, callback: Progress | None, total: int, workers: int | None = None
) -> list[ParsedTrace]:
    """Parse sources one after another, reporting progress over all of them."""
    if callback is None:
        return [parse_source(s, recover, workers=workers) for s in sources]
    overall = Aggregate(callback, total)
    return [parse_source(s, recover, overall.file(s.size), workers) for s in sources]
