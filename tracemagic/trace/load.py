"""``tracemagic.load``: any Kineto trace (file, gzip, tar, capture directory, rank directory)
into one analysis-ready events table, cached as Parquet next to the file."""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from tracemagic.errors import TraceError
from tracemagic.trace import cache, normalize, structure
from tracemagic.trace.model import Trace
from tracemagic.trace.parse import ParsedTrace, parse_events
from tracemagic.trace.read import Source, rank_files, read_sources, sniff

#: row-number columns that must be shifted when ranks are stacked
ROW_COLUMNS = ("parent", "launch", "op", "module")
MANIFEST = "capture.json"


def _prepare(parsed: ParsedTrace) -> ParsedTrace:
    """Normalize one rank's columns and add the derived structure."""
    events = parsed.events
    events["kind"] = normalize.event_kinds(events)
    if normalize.timestamps_in_ns(events["ts"].to_numpy()):
        events["ts"] = events["ts"] / 1000.0
        events["dur"] = events["dur"] / 1000.0
        parsed.flows["ts"] = parsed.flows["ts"] / 1000.0
        parsed.warnings.append("timestamps were in nanoseconds; converted to µs")
    normalize.fill_device_and_stream(events)
    memory = (events["kind"] == "memory").to_numpy()
    if memory.any():
        nbytes = events["bytes"].copy()
        nbytes[memory] = events["mem_bytes"][memory]
        events["bytes"] = nbytes
    events.drop(columns=["mem_bytes", "device_id"], inplace=True)
    structure.add_structure(events)
    return parsed


def parse_source(source: Source, recover: bool = False) -> ParsedTrace:
    """Parse and prepare one file's bytes."""
    sniff(source.data, source.name)
    parsed = parse_events(source.data, source.name, recover=recover or source.truncated_gzip)
    if source.truncated_gzip:
        if not recover:
            raise TraceError(
                f"{source.name}: the gzip stream is cut off (the file is truncated). "
                "Pass recover=True to tracemagic.load to keep the events before the cut.",
                path=source.name,
                offset=len(source.data),
            )
        parsed.warnings.append(f"{source.name}: gzip stream truncated; recovered what it held")
    parsed.meta["source"] = source.name
    parsed.meta.setdefault("rank_hint", source.rank_hint)
    return _prepare(parsed)


def _parse_path(args: tuple[str, bool]) -> ParsedTrace:
    """Worker entry: parse one rank file in a child process."""
    path, recover = args
    (source,) = read_sources(Path(path))
    return parse_source(source, recover)


def _assign_ranks(parsed: list[ParsedTrace]) -> list[int]:
    taken: list[int | None] = []
    for p in parsed:
        rank = p.meta.get("rank")
        if rank is None:
            rank = p.meta.get("rank_hint")
        taken.append(rank)
    used = {r for r in taken if r is not None}
    free = (r for r in range(len(parsed) + len(used) + 1) if r not in used)
    return [r if r is not None else next(free) for r in taken]


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


def _stack(parsed: list[ParsedTrace], ranks: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    offset = 0
    events, flows = [], []
    for p, rank in sorted(zip(parsed, ranks), key=lambda pr: pr[1]):
        frame = p.events
        frame.insert(0, "rank", np.full(len(frame), rank, dtype=np.int32))
        if offset:
            for column in ROW_COLUMNS:
                values = frame[column].to_numpy()
                frame[column] = np.where(values >= 0, values + offset, -1)
        offset += len(frame)
        events.append(frame)
        p.flows.insert(0, "rank", np.full(len(p.flows), rank, dtype=np.int32))
        flows.append(p.flows)
    return concat(events), concat(flows)


def _manifest(path: Path) -> tuple[dict[str, Any] | None, list[Path] | None]:
    """A capture directory's manifest and the Kineto files it lists."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TraceError(f"{manifest_path}: unreadable capture manifest ({exc}).", path=str(manifest_path)) from None
    return manifest, _manifest_kineto(path, manifest.get("files"))


def _manifest_kineto(path: Path, files: Any) -> list[Path] | None:
    """The Kineto files a manifest lists that exist, or None (then the folder is scanned).

    ``%%chakra_trace`` writes ``files: [{path, kind, rank, cycle, bytes}]`` (the Kineto
    traces have ``kind: "kineto"``, whatever their names, e.g. ``--tb-names``); a
    ``files: {"kineto": [names]}`` mapping is read too.
    """
    if isinstance(files, dict):
        names = files.get("kineto")
    elif isinstance(files, list):
        names = [e.get("path") for e in files if isinstance(e, dict) and e.get("kind") == "kineto"]
    else:
        names = None
    if not isinstance(names, list):
        return None
    # plain names only: a manifest from someone else cannot point outside its folder
    found = [path / n for n in names if isinstance(n, str) and Path(n).name == n and (path / n).is_file()]
    return found or None


def load(
    path: str | os.PathLike[str],
    *,
    recover: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    workers: int | None = None,
) -> Trace:
    """Load a Kineto trace into an analysis-ready ``Trace``.

    Args:
        path: a ``.json``/``.json.gz`` trace, a ``.tar``/``.tar.gz`` of rank traces, a
            capture directory written by ``%%chakra_trace``, or a directory of rank traces.
        recover: keep the events before the damage of a truncated or corrupt file
            instead of raising ``TraceError``.
        cache_dir: where to keep the Parquet cache when the trace's folder is read-only
            (default: the user cache directory).
        use_cache: read and write the Parquet cache (invalidated when the file changes).
        workers: processes for parsing several rank files (default: up to the cores).

    Raises:
        TraceError: the path holds no Kineto trace, or a damaged one (naming the file and
            byte offset), or another kind of file (an Execution Trace, a memory timeline).
    """
    path = Path(path)
    manifest, files = (None, None)
    if path.is_dir():
        manifest, files = _manifest(path)
        if files is None:
            files = rank_files(path)
    key = cache.key_for(path, files, recover)
    if use_cache:
        hit = cache.read(key, path, cache_dir)
        if hit is not None:
            events, flows, meta = hit
            return Trace(events, flows, meta, path=path, manifest=manifest)
    if files is not None:
        parsed = _parse_files(files, recover, workers)
    else:
        parsed = [parse_source(s, recover) for s in read_sources(path)]
    ranks = _assign_ranks(parsed)
    events, flows = _stack(parsed, ranks)
    meta = {
        "path": str(path),
        "ranks": {rank: p.meta for p, rank in zip(parsed, ranks)},
        "processes": {rank: p.processes for p, rank in zip(parsed, ranks)},
        "threads": {rank: {f"{k[0]}/{k[1]}": v for k, v in p.threads.items()} for p, rank in zip(parsed, ranks)},
        "warnings": [w for p in parsed for w in p.warnings],
    }
    if use_cache:
        cache.write(key, path, cache_dir, events, flows, meta)
    return Trace(events, flows, meta, path=path, manifest=manifest)


def _parse_files(paths: list[Path], recover: bool, workers: int | None) -> list[ParsedTrace]:
    """Parse rank files, in parallel processes when there are several (one file in memory
    per worker, so many large ranks do not all sit in memory at once)."""
    limit = min(workers or os.cpu_count() or 1, len(paths))
    if limit > 1:
        with ProcessPoolExecutor(max_workers=limit, mp_context=get_context("spawn")) as pool:
            return list(pool.map(_parse_path, [(str(p), recover) for p in paths]))
    return [_parse_path((str(p), recover)) for p in paths]
