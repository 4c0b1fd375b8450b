"""The rank files of a job, and one rank opened alone (for ``tracemagic.load_ranks``).

A job's ranks are listed here once, on the machine that asks (a capture directory's
manifest, a folder of rank traces, a glob, or a tar of them), as small picklable
``RankFile`` records; each rank is then opened on its own (``open_rank``), possibly on
another machine that sees the same files: through ``tracemagic.load`` and its Arrow cache
for a file, parsed from the archive for a tar member. ``as_rank`` gives it the rank number
and time zero the whole job agreed on, so its tables line up with the others'.
"""

from __future__ import annotations

import glob
import os
import tarfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tracemagic.errors import TraceError
from tracemagic.trace import loader
from tracemagic.trace.kineto import rank_from_name
from tracemagic.trace.model import TraceTables
from tracemagic.trace.read import MAX_RATIO, Source, default_max_bytes, is_tar, read_sources, regular_file


@dataclass(frozen=True)
class RankFile:
    """One rank's trace: a file, or a member of a tar archive.

    Attributes:
        name: how the loader names it (the file's path, ``archive!member`` for a member).
        path: the file, or the archive.
        member: the member's name in the archive, else None.
        hint: the rank its manifest entry or its name gives (its ``distributedInfo`` wins).
        source: the member's stream in this process (read in archive order, so a
            compressed archive is decompressed once here); never sent to a worker.
    """

    name: str
    path: Path
    member: str | None = None
    hint: int | None = None
    source: Source | None = field(default=None, compare=False, repr=False)

    def portable(self) -> RankFile:
        """This record without its in-process stream (what a worker is sent)."""
        return replace(self, source=None)


@dataclass(frozen=True)
class Options:
    """How ranks are opened: ``tracemagic.load``'s options of the same names."""

    recover: bool = False
    cache_dir: str | None = None
    use_cache: bool = True
    max_bytes: int | None = None
    workers: int | None = None
    allow_high_compression: bool = False

    def cached(self, rank: RankFile) -> bool:
        """Whether reopening ``rank`` reads the Arrow cache (files with the cache on; a tar
        member has no cache of its own and is parsed again)."""
        return self.use_cache and rank.member is None


def list_ranks(
    path: str | os.PathLike[str], max_bytes: int | None = None, allow_high_compression: bool = False
) -> tuple[Path, dict[str, Any] | None, list[RankFile], list[str]]:
    """The rank traces behind ``path``: a capture directory (its manifest's Kineto files and
    ranks), a directory of rank traces, a glob pattern (``"run/*.json.gz"``), a single trace
    or a ``.tar``/``.tar.gz`` of them.

    ``max_bytes`` bounds what each tar member may inflate to (``load``'s default if None);
    ``allow_high_compression`` as for ``load``.

    Returns:
        The path, the capture manifest (or None), the ranks in the order ``load`` reads them,
        and warnings (symlinks leading out of the folder, which are skipped).

    Raises:
        TraceError: nothing there, no trace in it, or only symlinks leading out of the folder.
    """
    text = os.fspath(path)
    path = Path(text)
    if not path.exists() and glob.has_magic(text):
        matched = sorted(Path(p) for p in glob.glob(text) if Path(p).is_file())
        if not matched:
            raise TraceError(f"{text}: no file matches this pattern.", path=text)
        return path, None, [RankFile(str(p), p, hint=rank_from_name(p.name)) for p in matched], []
    if path.is_dir():
        manifest, listed, outside = loader.folder_ranks(path)
        ranks = [
            RankFile(str(p), p, hint=rank if rank is not None else rank_from_name(p.name)) for p, rank in listed.items()
        ]
        return path, manifest, ranks, [loader.skipped(path, outside)] if outside else []
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory.", path=str(path))
    regular_file(path)
    if is_tar(path):
        limit = default_max_bytes() if max_bytes is None else max_bytes
        ratio = None if allow_high_compression else MAX_RATIO
        members = [replace(s, max_bytes=limit) for s in read_sources(path, None, ratio)]  # each rank on its own limit
        return path, None, [RankFile(s.name, path, s.name.split("!", 1)[1], s.rank_hint, s) for s in members], []
    return path, None, [RankFile(str(path), path, hint=rank_from_name(path.name))], []


def open_rank(rank: RankFile, options: Options) -> TraceTables:
    """One rank's ``Trace``, numbered as the file says (as ``tracemagic.load`` would open it
    alone; a file goes through its Arrow cache).

    Raises:
        TraceError: the file is damaged or no Kineto trace.
    """
    if rank.member is None:
        return loader.load(
            rank.path,
            recover=options.recover,
            cache_dir=options.cache_dir,
            use_cache=options.use_cache,
            workers=options.workers,
            progress=False,
            max_bytes=options.max_bytes,
            allow_high_compression=options.allow_high_compression,
        )
    source = (
        rank.source if rank.source is not None else _member(rank, options.max_bytes, options.allow_high_compression)
    )
    parsed = loader.parse_source(source, options.recover, workers=options.workers)
    events, flows, meta, found = loader.assemble([parsed], rank.path)
    return loader.as_trace(events, flows, meta, found, rank.path)


def _member(rank: RankFile, max_bytes: int | None, allow_high_compression: bool = False) -> Source:
    """A tar member's stream, the archive opened anew (on a worker)."""
    assert rank.member is not None
    limit = default_max_bytes() if max_bytes is None else max_bytes
    try:
        archive = tarfile.open(rank.path)  # noqa: SIM115 - open for the returned Source's opener
        info = archive.getmember(rank.member)
    except (tarfile.TarError, KeyError, EOFError, OSError, zlib.error) as exc:
        raise TraceError(f"{rank.name}: cannot be read from its archive ({exc}).", path=rank.name) from None

    def opener() -> Any:
        handle = archive.extractfile(info)
        if handle is None:
            raise TraceError(f"{rank.name}: not a regular file.", path=rank.name)
        return handle

    ratio = None if allow_high_compression else MAX_RATIO
    return Source(rank.name, opener, info.size, rank.hint, max_bytes=limit, max_ratio=ratio)


def facts(trace: TraceTables) -> dict[str, Any]:
    """What the job needs of one freshly opened rank to number it and set time zero: its
    parse metadata (``rank`` from ``distributedInfo``), its earliest ``ts`` (None without
    events), its warnings and whether it ran GPU work."""
    (meta,) = trace.meta["ranks"].values()
    ts = trace.events["ts"].to_numpy()
    return {
        "meta": meta,
        "start": float(np.nanmin(ts)) if ts.size else None,
        "warnings": trace.warnings,
        "has_gpu": trace.has_gpu,
    }


def as_rank(trace: TraceTables, rank: int, time_zero: float) -> TraceTables:
    """``trace`` (one rank, as ``open_rank`` gives it) numbered ``rank`` and on the job's
    time zero (``meta["time_zero_us"]``: its tables' ``ts`` count from the job's start)."""
    (was,) = trace.meta["ranks"]
    if was != rank:
        trace.events["rank"] = np.full(len(trace.events), rank, dtype=np.int32)
        trace.flows["rank"] = np.full(len(trace.flows), rank, dtype=np.int32)
        for key in ("ranks", "processes", "threads"):
            if key in trace.meta:
                values = list(trace.meta[key].values())  # one rank's: one value, kept under the new number
                trace.meta[key] = {rank: values[-1]} if values else {}
    trace.meta["time_zero_us"] = time_zero
    return trace
