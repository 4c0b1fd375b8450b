"""``tracemagic.load_ranks``: a whole job's ranks, each parsed and summarized where it runs.

A job of hundreds of ranks holds more JSON than one machine can parse and keep. Here each
rank is opened on its own (``trace.rank_files.open_rank``: through the Arrow cache), numbered and
put on the job's time zero, and reduced to its ``analysis.ranks.Summary`` (its steps,
overlap and collective arrivals: a few rows per step); only the summaries come back, and
the cross-rank tables are computed from them. With a ``dask.distributed.Client`` every rank
is a task on the cluster's workers; without one the same tasks run in this process, one
rank after another, so the caller never holds more than the summaries plus one rank.

Two rounds, because a rank's tables need two facts only the whole job knows: its number
(its ``distributedInfo``, else its manifest entry or name, else the next free one, as
``tracemagic.load`` numbers them) and the job's time zero (the earliest event of all
ranks). Round one opens every rank and sends back those facts; round two summarizes each
rank, reading it back from the cache. A rank without a cache entry (a tar member, or with
``use_cache=False``) is kept on the worker that opened it between the rounds; in this
process it is parsed again instead, so that no more than one rank is ever held here.

A task that fails for one rank (a damaged file: ``TraceError``; its worker killed:
``distributed.KilledWorker``; any other exception) fails that rank alone: it is listed in
``Ranks.failed`` and the others complete.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pandas as pd

from tracemagic import facade
from tracemagic.errors import TraceError
from tracemagic.trace.kineto import tb_worker
from tracemagic.trace.layout import KINETO_FILE
from tracemagic.trace.loader import assign_ranks, world_size_warnings
from tracemagic.trace.model import TraceTables
from tracemagic.trace.rank_files import Options, RankFile, as_rank, facts, list_ranks, open_rank

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.analysis.ranks import Summary
    from tracemagic.views.dashboard import Dashboard

#: what to install for ``client=``
EXTRA = "pip install tracemagic[dask]"


# -- the tasks (module-level: a worker imports them by name) ---------------------------------
def _opened(rank: RankFile, options: Options) -> TraceTables:
    return open_rank(rank, options)


def _facts(trace: TraceTables) -> dict[str, Any]:
    return facts(trace)


def _numbered(opened: TraceTables | RankFile, number: int, time_zero: float, options: Options) -> TraceTables:
    """A rank opened (or opened again from its cache), numbered and on the job's time zero."""
    trace = opened if isinstance(opened, TraceTables) else open_rank(opened, options)
    return as_rank(trace, number, time_zero)


def _summary(opened: TraceTables | RankFile, number: int, time_zero: float, options: Options) -> Summary:
    from tracemagic.analysis.ranks import summarize

    return summarize(_numbered(opened, number, time_zero, options))


# -- where tasks run ---------------------------------------------------------------------------
class _Task(Protocol):
    """What the job uses of a task's handle (a ``distributed.Future`` has it)."""

    @property
    def status(self) -> str: ...

    def result(self) -> Any: ...

    def exception(self) -> BaseException | None: ...


class _Done:
    """A task run here, at once: its result, or the exception it raised (as a task on a
    worker would: one rank's failure is that rank's alone)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.value: Any = None
        self.error: Exception | None = None
        try:
            self.value = fn(*(a.result() if isinstance(a, _Done) else a for a in args))
        except Exception as exc:  # noqa: BLE001 - reported per rank by _outcome
            self.error = exc

    @property
    def status(self) -> str:
        return "error" if self.error is not None else "finished"

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self) -> BaseException | None:
        return self.error


class _Engine:
    """Runs the tasks: on a Dask cluster (``client``), else here, one after another."""

    def __init__(self, client: Any = None) -> None:
        self.client = client
        self.token = uuid.uuid4().hex[:8]
        self.submitted = 0

    @property
    def remote(self) -> bool:
        return self.client is not None

    def submit(self, fn: Callable[..., Any], *args: Any, key: str) -> _Task:
        if self.client is None:
            return _Done(fn, args)
        self.submitted += 1  # a key is never reused: rank(3) twice is two tasks
        task: _Task = self.client.submit(fn, *args, key=f"tracemagic-{key}-{self.token}-{self.submitted}", pure=False)
        return task

    def wait(self, tasks: list[_Task]) -> None:
        if self.client is not None and tasks:
            from distributed import wait

            wait(tasks)

    def __repr__(self) -> str:
        return f"the Dask cluster of {self.client}" if self.client is not None else "this process"


def _outcome(task: _Task, name: str, engine: _Engine) -> tuple[Any, TraceError | None]:
    """A finished task's result, or the ``TraceError`` that failed rank ``name``: its own, or
    one wrapping anything else (its worker killed: ``distributed.KilledWorker``; a bug)."""
    if task.status != "error":
        return task.result(), None
    error = task.exception()
    if isinstance(error, TraceError):
        return None, error
    cause = f"{type(error).__name__}: {error}" if error is not None else "no reason given"
    failure = TraceError(
        f"{name}: its task failed on {engine} ({cause}); left out. A killed worker usually ran out "
        "of memory: give the workers more, or open this rank alone with tracemagic.load to see the error.",
        path=name,
    )
    failure.__cause__ = error
    return None, failure


def _engine(client: Any) -> _Engine:
    if client is None:
        return _Engine()
    try:
        import distributed
    except ImportError as exc:
        raise ImportError(
            f"tracemagic.load_ranks(client=...) runs on Dask, which is not installed here ({exc}). "
            f"Install it with `{EXTRA}` (dask[distributed]), or leave out client= to run in this process."
        ) from None
    if not isinstance(client, distributed.Client):
        raise TypeError(f"client= takes a dask.distributed.Client, not {type(client).__name__}")
    return _Engine(client)


# -- the job -----------------------------------------------------------------------------------
class Ranks:
    """A job's ranks: the cross-rank tables from per-rank summaries, any rank on request.

    Attributes:
        path: what was loaded.
        manifest: ``capture.json`` of a capture directory, else None.
        meta: ``ranks`` {rank: the trace metadata of each rank}, ``warnings``.
        failed: the ranks that could not be read, {file name: its ``TraceError``}.
        files: {rank: the file it came from (``archive!member`` for a tar member)}.
    """

    #: the dashboard shows the Ranks tab only (the other tabs need every event)
    summaries_only = True

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any] | None,
        files: dict[int, RankFile],
        summaries: dict[int, Summary],
        meta: dict[str, Any],
        failed: dict[str, TraceError],
        engine: _Engine,
        options: Options,
        time_zero: float,
        has_gpu: bool,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.meta = meta
        self.failed = failed
        self.files = {rank: files[rank].name for rank in sorted(files)}
        self.has_gpu = has_gpu
        self._files = files
        self._summaries = [summaries[rank] for rank in sorted(summaries)]
        self._engine = engine
        self._options = options
        self._time_zero = time_zero
        self._tables: dict[str, pd.DataFrame] = {}

    @property
    def rank_ids(self) -> list[int]:
        """The ranks loaded, ascending (failed ones left out)."""
        return sorted(self._files)

    @property
    def warnings(self) -> list[str]:
        """What the loader had to repair or skip, and the ranks that failed."""
        return list(self.meta["warnings"]) + [f"{name}: not loaded ({error})" for name, error in self.failed.items()]

    def _table(self, function: str) -> pd.DataFrame:
        if function not in self._tables:
            from tracemagic.analysis import ranks

            self._tables[function] = getattr(ranks, function)(self._summaries)
        return self._tables[function].copy()

    def ranks_table(self) -> pd.DataFrame:
        """Per rank: step time and breakdown, overlap, waits, the slowest rank (``Trace.ranks_table``)."""
        return self._table("ranks_of")

    def ranks(self) -> pd.DataFrame:
        """``ranks_table()``."""
        return self.ranks_table()

    def steps(self) -> pd.DataFrame:
        """One row per ProfilerStep and rank, all ranks (``Trace.steps``)."""
        return self._table("steps_of")

    def collectives(self) -> pd.DataFrame:
        """Collectives matched across ranks with each rank's wait (``Trace.collectives``)."""
        return self._table("collectives_of")

    def stragglers(self) -> pd.DataFrame:
        """The rank the others waited for, per step (``Trace.stragglers``)."""
        return self._table("stragglers_of")

    def rank(self, rank: int) -> facade.Trace:
        """One rank's whole ``Trace`` for the detailed views: opened where the others were
        (a worker: read back from its cache) and sent here. Its tables count time from the
        job's start (``meta["time_zero_us"]``), as in ``tracemagic.load`` of all ranks.

        Raises:
            KeyError: no such rank (or it failed: see ``failed``).
            TraceError: it cannot be read any more.
        """
        if rank not in self._files:
            raise KeyError(
                f"rank {rank} is not loaded; the ranks are {self.rank_ids}"
                + (f" ({len(self.failed)} failed: see .failed)" if self.failed else "")
            )
        file = self._files[rank]
        task = self._engine.submit(
            _numbered,
            file.portable() if self._engine.remote else file,
            rank,
            self._time_zero,
            self._options,
            key=f"rank-{rank}",
        )
        trace: TraceTables = task.result()
        return facade.Trace.of(trace)

    def dashboard(self, **kwargs: Any) -> Dashboard:
        """The dashboard's Ranks tab for the whole job (``views.dashboard.Dashboard``'s options)."""
        from tracemagic.views.dashboard import Dashboard

        return Dashboard(self, **kwargs)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        failed = f", {len(self.failed)} failed" if self.failed else ""
        return f"<Ranks from {self.path}: {len(self._files)} rank(s){failed}, on {self._engine}>"


def _numbered_files(
    listed: list[RankFile], found: dict[int, dict[str, Any]], failed: dict[str, TraceError]
) -> list[tuple[int, int]]:
    """(index in ``listed``, rank) of the files opened (``found``: their ``facts``), numbered
    as ``tracemagic.load`` numbers ranks; a second file of a rank already taken goes to
    ``failed``."""
    order = sorted(found)
    numbers, _ = assign_ranks([dict(found[i]["meta"], rank_hint=listed[i].hint) for i in order])
    first_of: dict[int, int] = {}
    for i, number in zip(order, numbers):
        if number in first_of:
            first = listed[first_of[number]].name
            failed[listed[i].name] = TraceError(
                f"{listed[i].name}: rank {number} again (already {first}); left out. "
                + _one_file_a_rank(first, listed[i].name),
                path=listed[i].name,
            )
        else:
            first_of[number] = i
    return [(i, n) for n, i in first_of.items()]


def _one_file_a_rank(first: str, again: str) -> str:
    """What to do when a second file claims a rank: the profiler cycles of one rank (a
    ``--repeat`` capture's ``kineto_trace_<r>_cycle<k>``, ``tensorboard_trace_handler``'s
    files of one worker) are one rank's timeline, which ``tracemagic.load`` stacks and
    ``load_ranks`` cannot."""
    names = [Path(name.split("!")[-1]).name for name in (first, again)]
    found = [KINETO_FILE.search(name) for name in names]
    workers = [tb_worker(name) for name in names]
    if all(f is not None and f.group(2) is not None for f in found) or (workers[0] and workers[0] == workers[1]):
        return (
            "They look like the profiler cycles of one rank (--repeat, or a schedule's repeat): load_ranks reads "
            "one file a rank; tracemagic.load() of the folder stacks each rank's cycles."
        )
    return "Load the ranks of one run together, each run's rank files in a folder of their own."


def load_ranks(
    path: str | os.PathLike[str],
    client: Any = None,
    *,
    recover: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    max_bytes: int | None = None,
    workers: int | None = None,
    allow_high_compression: bool = False,
) -> Ranks:
    """A job's rank traces, each parsed and summarized where it runs; only summaries kept here.

    Args:
        path: a capture directory, a directory of rank traces, a glob (``"run/*.json.gz"``)
            or a ``.tar``/``.tar.gz`` of them. With a client, the workers must see the files
            at the same path (a shared file system), and a ``.tar.gz`` is decompressed up
            to its member by each task: extract large archives first.
        client: a ``dask.distributed.Client``: every rank is opened, cached and summarized
            on its workers. None: the same, here, one rank after another.
        recover, cache_dir, use_cache, max_bytes, workers, allow_high_compression: as for
            ``tracemagic.load``, per rank (``cache_dir`` and ``max_bytes`` as the workers
            see them).

    Raises:
        TraceError: nothing to load there, or no rank could be read (a rank that cannot
            be read is left out and listed in ``failed``).
        ImportError: ``client`` given but Dask is not installed (``pip install tracemagic[dask]``).
    """
    engine = _engine(client)
    where, manifest, listed, warnings = list_ranks(path, max_bytes, allow_high_compression)
    options = Options(
        recover,
        None if cache_dir is None else os.fspath(cache_dir),
        use_cache,
        max_bytes,
        workers,
        allow_high_compression,
    )
    sent = [f.portable() if engine.remote else f for f in listed]
    facts_of: list[_Task] = []
    kept: dict[int, _Task] = {}
    for index, file in enumerate(sent):
        opened = engine.submit(_opened, file, options, key=f"open-{index}")
        facts_of.append(engine.submit(_facts, opened, key=f"facts-{index}"))
        if engine.remote and not options.cached(file):
            kept[index] = opened  # no cache to read it back from: keep it on its worker
        del opened  # here, a rank is dropped once its facts are taken (parsed again in round two)
    engine.wait(facts_of)
    failed: dict[str, TraceError] = {}
    found: dict[int, dict[str, Any]] = {}
    for index, task in enumerate(facts_of):
        value, error = _outcome(task, listed[index].name, engine)
        if error is not None:
            failed[listed[index].name] = error
            kept.pop(index, None)
        else:
            found[index] = value
    if not found:
        first = next(iter(failed.values()))
        raise TraceError(
            f"{where}: none of its {len(listed)} rank traces could be read; the first: {first}", path=str(where)
        )
    numbered = _numbered_files(listed, found, failed)
    starts = [found[i]["start"] for i, _ in numbered if found[i]["start"] is not None]
    time_zero = min(starts) if starts else 0.0
    summary_of = [
        (i, number, engine.submit(_summary, kept.get(i, sent[i]), number, time_zero, options, key=f"summary-{i}"))
        for i, number in numbered
    ]
    kept.clear()  # released as soon as summarized
    engine.wait([task for _, _, task in summary_of])
    summaries: dict[int, Summary] = {}
    files: dict[int, RankFile] = {}
    for i, number, task in summary_of:
        value, error = _outcome(task, listed[i].name, engine)
        if error is not None:
            failed[listed[i].name] = error
        else:
            summaries[number], files[number] = value, listed[i]
    sizes = world_size_warnings([dict(found[i]["meta"], source=listed[i].name) for i, _ in numbered], where)
    meta = {
        "ranks": {n: dict(found[i]["meta"], rank_hint=listed[i].hint) for i, n in numbered if n in files},
        # (a rank's own file already warns of its rank beyond its world size: said once)
        "warnings": list(
            dict.fromkeys(warnings + [w for i, _ in numbered for w in found[i]["warnings"]] + [w for _, w in sizes])
        ),
    }
    has_gpu = any(found[i]["has_gpu"] for i, _ in numbered)
    return Ranks(where, manifest, files, summaries, meta, failed, engine, options, time_zero, has_gpu)
