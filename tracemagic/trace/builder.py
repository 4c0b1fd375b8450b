"""The columns builder: the decoded chunks of a trace (the C scanner's columns or msgspec's
structs) become typed columns as they come, repeated strings categorical codes shared by
all chunks (``Interners``), so peak memory is the final columns plus one chunk.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeAlias

import msgspec
import numpy as np
import pandas as pd

from tracemagic.trace import normalize
from tracemagic.trace.columns import Carver, all_missing, code_dtype, fresh, lazy_zeros, partly_written, zero_rows
from tracemagic.trace.jsonvalues import _ANY, _BIG, MAX_NESTING, _finite, _to_number, cut_deep
from tracemagic.trace.structs import (
    _ARG_COLUMNS,
    _ARG_FIELDS,
    _ARG_GETTER,
    _ARG_KEY,
    _ARG_RAW,
    _ARG_STRINGS,
    _ARGS_GETTER,
    _BASE_GETTER,
    _EMPTY_ARGS,
    _FLOW_GETTER,
    _FLOWS,
    _NULL,
    _TEXT,
    _TIMED,
    _Args,
    _Event,
)

_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

_join: ModuleType | None  # the C scanner's ``join_*``: a column's chunks joined without the GIL
try:
    from tracemagic.trace import _scan as _join
except ImportError:  # pragma: no cover - installed without a C compiler: numpy joins them
    _join = None
if _join is not None and not hasattr(_join, "join_codes"):  # pragma: no cover - an older build
    _join = None

#: ``finish``'s way to run a job on a second thread: ``helper(job)`` starts it there
#: (``trace.split`` lends its second parsing thread, idle by then)
Helper: TypeAlias = Callable[[Callable[[], None]], None]
#: a column's join, run by ``_run_jobs`` (on two threads where a ``Helper`` is lent)
_Job: TypeAlias = Callable[[], None]

#: whether ``finish`` carves the columns out of the scan pools it is handed (``Carver``)
REUSE_POOLS = True
#: number columns not carved from a pool: ``loader._prepare`` drops or replaces them, and a
#: carved column would keep its pool resident as long as the trace lives (the pools fill up
#: with the other columns all the same; ``ts`` and ``dur``, replaced where they are
#: nanoseconds, are not carved either)
_NOT_CARVED = frozenset(("mem_bytes", "device_id", "device", "stream", "bytes"))


@dataclass
class ParsedTrace:
    """One rank's trace as raw typed columns, before normalization."""

    events: pd.DataFrame
    flows: pd.DataFrame
    meta: dict[str, Any]
    processes: dict[str, str] = field(default_factory=dict)
    threads: dict[tuple[str, str], str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: the CPU duration events' rows in nesting order (``structure.cpu_by_thread``), once prepared
    cpu_by_thread: np.ndarray | None = None
    #: its events' ``structure.thread_keys`` (before the ranks are stacked), once prepared
    thread_keys: np.ndarray | None = None


#: the types of the values an ``_Interner`` keys by themselves: no two of them are equal
#: across types; any other value (a float or a bool, equal to an int: ``2.0 == 2``,
#: ``False == 0``) is keyed by its label, or it would take the label of whichever of them
#: came first in the file (or in a stretch, on two threads)
_EXACT_KEYS = frozenset((str, int, type(None)))


def _keys(values: Any) -> list[Any]:
    """``_Interner``'s keys of ``values``: themselves where their type is exact, else their label."""
    return [v if type(v) in _EXACT_KEYS else str(v) for v in values]


class _Interner:
    """Labels -> categorical codes, shared by all chunks of a column (insertion order).

    Values are looked up in a dict keyed by the decoded value itself (a C-level ``map``
    over the chunk), so only values not seen before cost Python work. Floats and bools are
    keyed by their label (``_EXACT_KEYS``): in a column that holds integers, the chunk's
    types are checked first (the only case where one could find an integer's key).
    """

    __slots__ = ("index", "ints", "labels", "levels", "raw", "seen")

    def __init__(self, raw: bool = False, levels: int = MAX_NESTING - 2) -> None:
        self.index: dict[str, int] = {}
        self.labels: list[str] = []
        self.raw = raw  # values are JSON text as bytes; b"null" is missing
        #: how deep a value may nest before ``cut_deep`` cuts it: ``MAX_NESTING`` less the
        #: levels around it (the ``traceEvents`` list and the event; an arg's ``args`` too)
        self.levels = levels
        self.seen: dict[Any, int] = {b"null": -1} if raw else {None: -1}
        self.ints = False  # whether an integer is among the keys of ``seen``

    def codes(self, values: Any, n: int) -> np.ndarray:
        seen = self.seen
        if self.ints and not _EXACT_KEYS.issuperset(map(type, values)):
            values = _keys(values)
        try:
            found = list(map(seen.get, values))
        except TypeError:  # an unhashable value (a list where a string belongs)
            values = [
                v if isinstance(v, (str, int, float, bytes)) or v is None else str(cut_deep(v, self.levels))
                for v in values
            ]
            values = values if self.raw else _keys(values)
            found = list(map(seen.get, values))
        try:
            return np.array(found, dtype=np.int32)
        except TypeError:  # some values not seen before (their lookup gave None)
            pass
        new = [v for v, c in zip(values, found) if c is None]
        if not self.raw and not _EXACT_KEYS.issuperset(map(type, new)):
            values = _keys(values)
            new = [v for v in values if v not in seen]
        for value in dict.fromkeys(new):  # in order
            seen[value] = self._code(value)
            self.ints = self.ints or type(value) is int
        return np.array(list(map(seen.__getitem__, values)), dtype=np.int32)

    def _code(self, value: Any) -> int:
        """The code of a value not seen before (missing values are in ``seen`` from the start)."""
        label = _json_text(value) if self.raw else value if type(value) is str else str(value)
        return self.intern(label)

    def intern(self, label: str) -> int:
        """The code of ``label``, added if new."""
        code = self.index.get(label)
        if code is None:
            code = self.index[label] = len(self.labels)
            self.labels.append(label)
        return code

    def remap(self, codes: bytes | None, values: list[Any], n: int) -> tuple[ChunkCodes, np.ndarray]:
        """A chunk of ``n`` rows the C scanner interned on its own (``codes`` index
        ``values``; None: no value) as a ``ChunkCodes``: its codes and the table to this interner's
        (``_joined_codes`` looks them up as it joins the chunks: one pass, out of the
        parsing threads' turns at the GIL), and the codes of ``values`` (the chunk's distinct
        values in the order it met them)."""
        if codes is None:
            return n, _NO_CODES
        local = np.frombuffer(codes, dtype=np.int32)
        if not values:
            return local, _NO_CODES
        # a missing value last (``seen`` has it as -1), for the chunk's -1 codes to stay missing
        table = self.codes([*values, b"null" if self.raw else None], len(values) + 1)
        return (local, table), table[:-1]

    def categorical(self, codes: np.ndarray) -> pd.Categorical:
        return pd.Categorical.from_codes(codes, categories=pd.Index(self.labels, dtype="str"), validate=False)


def _json_text(raw: bytes) -> str:
    """A JSON value as text in one spelling, ``json.dumps``'s (``[[8, 32], [64]]``, as Kineto
    writes it), whoever wrote it and whichever parser read it (numbers beyond float64 are
    ``Infinity``)."""
    try:
        try:
            value = _ANY.decode(raw)
        except msgspec.DecodeError:  # a number beyond float64
            value = _BIG.decode(raw)
        return json.dumps(value, ensure_ascii=False)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):  # invalid UTF-8, too deep
        return raw.decode("utf-8", "replace")


def _objects(values: Any, n: int) -> np.ndarray:
    """A 1-d object array of ``n`` values (``np.array`` is ~20x faster than ``fromiter``, but
    would make a 2-d array of equal-length lists)."""
    if isinstance(values, (tuple, list)):
        objects = np.array(values, dtype=object)
        if objects.ndim == 1:
            return objects
    return np.fromiter(values, dtype=object, count=n)


def _numbers(col: tuple[Any, ...], floating: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, missing mask) of a column of JSON numbers with Nones; None if all missing.

    Hex strings ('0x7f..') and numeric strings are read as numbers; anything else is missing,
    ``true``/``false`` too. Each value is read alone: never as its neighbours make it (a
    chunk's, or a stretch's, on two threads: ``trace.split``).
    """
    n = len(col)
    nones = col.count(None)
    if nones == n:
        return None
    dtype = np.float64 if floating else np.int64
    try:  # fast path: numbers and Nones (-> nan) straight into float64
        floats = np.array(col, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):  # text, or an integer beyond float64
        floats = None
    if floats is not None and floats.ndim == 1:
        mask = ~np.isfinite(floats)  # inf: numeric text beyond float64 ("1e400")
        if ((floats == 0) | (floats == 1)).any():  # (only then can a bool, read as 0 or 1, be there)
            bools = _bools(col, n)
            if bools is not None:
                mask |= bools
        if floating:
            return floats, mask
        finite = floats[~mask]
        if finite.size == 0 or (np.abs(finite).max() < 2**53 and np.array_equal(finite, np.round(finite))):
            floats[mask] = 0
            return floats.astype(np.int64), mask
    objects = _objects(col, n)
    mask = (objects == None) if nones else np.zeros(n, dtype=bool)  # noqa: E711 - elementwise
    bools = _bools(col, n)
    if bools is not None:
        mask |= bools
    if nones or bools is not None:
        objects[mask] = 0
    try:
        values = objects.astype(dtype)
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        if not floating:
            return values, mask
        return values, mask | ~np.isfinite(values)  # numeric text beyond float64 ("1e400")
    values = np.zeros(n, dtype=dtype)
    mask = np.ones(n, dtype=bool)
    for i, raw in enumerate(col):
        number = _finite(raw) if floating else _to_number(raw)
        if number is None:
            continue
        if not floating:
            if isinstance(number, float):
                if not math.isfinite(number):
                    continue
                number = int(number)  # truncated, as astype does
            if not _INT64_MIN <= number <= _INT64_MAX:
                continue
        values[i] = number
        mask[i] = False
    return values, mask


def _bools(col: tuple[Any, ...], n: int) -> np.ndarray | None:
    """Where ``col`` holds ``true``/``false`` (not numbers: missing, as ``_to_number`` reads
    them), or None where it holds none."""
    if bool not in set(map(type, col)):
        return None
    return np.fromiter((type(value) is bool for value in col), dtype=bool, count=n)


class Interners:
    """The distinct values of one file's text columns. The builders of its stretches, read
    on two threads (``trace.split``), share one: their codes then need no recoding when the
    stretches are joined, and each value is decoded once. ``lock`` guards the sharing."""

    def __init__(self) -> None:
        # an arg lies one level deeper than an event's field (in ``args``): cut one level sooner
        self.cats = {c: _Interner(levels=MAX_NESTING - (3 if c in _ARG_STRINGS else 2)) for c in _TEXT}
        self.cats.update({c: _Interner(raw=True) for c in _ARG_RAW})
        self.flow_cats = {c: _Interner() for c in ("ph", "cat", "pid", "tid")}
        self.lock = threading.Lock()


class _Builder:
    """Accumulates the columns of one trace, chunk by chunk."""

    def __init__(self, interners: Interners | None = None) -> None:
        self.n = 0
        self.interners = interners or Interners()
        self.cats = self.interners.cats
        #: per text column, its chunks' codes (``ChunkCodes``)
        self.codes: dict[str, list[ChunkCodes]] = {c: [] for c in self.cats}
        self.floats: dict[str, list[np.ndarray]] = {"ts": [], "dur": []}
        self.numbers: dict[str, list[tuple[int, tuple[np.ndarray, np.ndarray] | None]]] = {
            c: [] for c, _, _ in _ARG_COLUMNS
        }
        self.flow_cats = self.interners.flow_cats
        self.flow_parts: dict[str, list[Any]] = {c: [] for c in ("ph", "cat", "pid", "tid", "id", "ts")}
        #: per (JSON field, floating): values present that are not numbers fitting the column (left missing)
        self.dropped: dict[tuple[str, bool], int] = {}
        #: the processes' names and labels as the file gives them, in order (pid, text, a
        #: label?): a label is added to the name before it, which may be in an earlier part
        self.process_names: list[tuple[str, Any, bool]] = []
        self.threads: dict[tuple[str, str], str] = {}
        # with shared interners, codes follow the order the threads met values in: the
        # distinct codes of each chunk (in its own order) put them back in file order
        self.firsts: dict[str, list[np.ndarray]] | None = None
        #: the dtype of a text column no chunk had a value of (``_Interner.categorical``'s with no labels)
        self._no_categories: pd.CategoricalDtype | None = None
        if interners is not None:
            self.firsts = {c: [] for c in [*self.cats, *(f"flow {c}" for c in self.flow_cats)]}

    def _keep(self, column: str, codes: ChunkCodes, firsts: np.ndarray | None = None) -> None:
        """Append a chunk's codes of a text column (``flow X`` for the flows' columns), a
        ``ChunkCodes`` (``firsts`` given where they are not an array of codes)."""
        parts = self.flow_parts[column[5:]] if column.startswith("flow ") else self.codes[column]
        parts.append(codes)
        if self.firsts is not None:
            if firsts is None:
                assert isinstance(codes, (int, np.ndarray))
                firsts = _NO_CODES if isinstance(codes, int) else pd.unique(codes[codes >= 0])
            self.firsts[column].append(firsts)

    def add(self, events: list[Any] | tuple[Any, ...]) -> None:
        """Append a chunk: msgspec's event structs, or the C scanner's columns (a tuple)."""
        with self.interners.lock:
            self._add(events)

    def _add(self, events: list[Any] | tuple[Any, ...]) -> None:
        if type(events) is tuple:
            self._add_scanned(events)
            return
        timed = [e for e in events if e.ph in _TIMED]
        if len(timed) != len(events):
            self._flows([e for e in events if e.ph in _FLOWS])
            self._names([e for e in events if e.ph == "M"])
        n = len(timed)
        if not n:
            return
        ph, cat, name, pid, tid, ts, dur = zip(*map(_BASE_GETTER, timed))
        for column, values in (("ph", ph), ("cat", cat), ("name", name), ("pid", pid), ("tid", tid)):
            self._keep(column, self.cats[column].codes(values, n))
        self.floats["ts"].append(np.array(ts, dtype=np.float64))
        self.floats["dur"].append(np.nan_to_num(np.array(dur, dtype=np.float64)))
        args = zip(*map(_ARG_GETTER, map(_ARGS_GETTER, timed)))
        columns = dict(zip(_ARG_FIELDS, args))
        old = columns.pop("external_id_old")
        if old.count(None) != n:
            columns["external_id"] = tuple(o if v is None else v for v, o in zip(columns["external_id"], old))
        for column, source, floating in _ARG_COLUMNS:
            self.numbers[column].append((n, self._numbers(f"args {_ARG_KEY[source]!r}", columns[source], floating)))
        for column in _ARG_STRINGS:
            values = columns[column]
            self._keep(
                column,
                n if values.count(None) == n else self.cats[column].codes(values, n),
            )
        for column in _ARG_RAW:
            values = columns[column]
            if values.count(_NULL) == n:
                self._keep(column, n)
            else:
                self._keep(column, self.cats[column].codes(list(map(bytes, values)), n))
        self.n += n

    def _add_scanned(self, columns: tuple[Any, ...]) -> None:
        n, text, raw, ts, dur, numbers, (n_flows, flow_text, flow_id, flow_ts), names = columns
        if names:
            self._names(
                [
                    _Event("M", "", name, pid, tid, args=_Args(meta_name=label, labels=labels))
                    for name, pid, tid, label, labels in names
                ]
            )
        if n_flows:
            for column, (codes, values) in zip(self.flow_cats, flow_text):
                self._keep(f"flow {column}", *self.flow_cats[column].remap(codes, values, n_flows))
            self.flow_parts["ts"].append(np.frombuffer(flow_ts, dtype=np.float64))
            ids = _scanned_numbers(flow_id, False)
            self.flow_parts["id"].append(ids or (np.zeros(n_flows, np.int64), np.ones(n_flows, bool)))
        if not n:
            return
        for column, (codes, values) in zip(_TEXT + _ARG_RAW, text + raw):
            self._keep(column, *self.cats[column].remap(codes, values, n))
        self.floats["ts"].append(np.frombuffer(ts, dtype=np.float64))
        self.floats["dur"].append(np.frombuffer(dur, dtype=np.float64))
        for (column, _, floating), part in zip(_ARG_COLUMNS, numbers):
            self.numbers[column].append((n, _scanned_numbers(part, floating)))
        self.n += n

    def extend(self, other: _Builder) -> None:
        """Append the events ``other`` read after this builder's (a later part of the file)."""
        if other.interners is not self.interners:
            raise ValueError("only parts read with the same Interners can be joined")
        for column in self.codes:
            self.codes[column] += other.codes[column]
        for column, parts in other.floats.items():
            self.floats[column] += parts
        for column, numbers in other.numbers.items():
            self.numbers[column] += numbers
        for column in self.flow_parts:
            self.flow_parts[column] += other.flow_parts[column]
        if self.firsts is not None and other.firsts is not None:
            for column, firsts in other.firsts.items():
                self.firsts[column] += firsts
        self.process_names += other.process_names
        self.threads.update(other.threads)
        for key, count in other.dropped.items():
            self.dropped[key] = self.dropped.get(key, 0) + count
        self.n += other.n

    def _flows(self, flows: list[Any]) -> None:
        if not flows:
            return
        n = len(flows)
        ph, cat, pid, tid, ids, ts = zip(*map(_FLOW_GETTER, flows))
        for column, values in (("ph", ph), ("cat", cat), ("pid", pid), ("tid", tid)):
            self._keep(f"flow {column}", self.flow_cats[column].codes(values, n))
        self.flow_parts["ts"].append(np.array(ts, dtype=np.float64))
        self.flow_parts["id"].append(
            self._numbers("the flow events' 'id'", ids, False) or (np.zeros(n, np.int64), np.ones(n, bool))
        )

    def _numbers(self, field: str, values: tuple[Any, ...], floating: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """``_numbers(values, floating)``, counting the values of ``field`` it left missing."""
        part = _numbers(values, floating)
        if part is not None:
            lost = int(part[1].sum()) - values.count(None)
            if lost:
                self.dropped[field, floating] = self.dropped.get((field, floating), 0) + lost
        return part

    def _names(self, meta_events: list[Any]) -> None:
        for event in meta_events:
            args = event.args if isinstance(event.args, _Args) else _EMPTY_ARGS
            value = args.meta_name
            if event.name == "process_name" and value is not None:
                self.process_names.append((str(event.pid), str(value), False))
            elif event.name == "process_labels" and args.labels:
                self.process_names.append((str(event.pid), args.labels, True))
            elif event.name == "thread_name" and value is not None:
                self.threads[(str(event.pid), str(event.tid))] = str(value)

    def finish(
        self,
        meta: dict[str, Any],
        warnings: list[str],
        helper: Helper | None = None,
        pools: list[Any] | None = None,
    ) -> ParsedTrace:
        """The trace's columns: each column's chunks joined into one (by the C scanner's
        ``join_*`` where it is built: no GIL held while they copy and make their pages, so
        with a ``helper`` thread two columns are joined at once).

        ``pools``: the parse's scan pools, done with: the columns are carved out of them
        (``Carver``: their pages are made already) until they are full, and what is left of
        them handed back."""
        carver = Carver(pools) if pools and REUSE_POOLS and _join is not None else None
        if carver is None:
            for pool in pools or ():
                pool.close()
        jobs: list[_Job] = []
        made: dict[str, Callable[[], Any]] = {}
        try:
            for column in ("ph", "cat", "name", "pid", "tid"):
                made[column] = self._categorical(column, jobs, carver)
            for column in ("ts", "dur"):  # (not carved: nanoseconds are replaced by µs in ``_prepare``)
                made[column] = _joined_floats(self.floats[column], jobs)
            for column, _, floating in _ARG_COLUMNS:
                into = None if column in _NOT_CARVED else carver
                made[column] = _masked(self.numbers[column], self.n, floating, jobs, into)
            for column in _ARG_STRINGS + _ARG_RAW:
                made[column] = self._categorical(column, jobs, carver)
        finally:  # (also on an error or Ctrl-C: a traceback kept would hold the pools' pages)
            if carver is not None:
                carver.close()
        _run_jobs(jobs, helper)
        table = pd.DataFrame({column: make() for column, make in made.items()}, copy=False)

        fp = self.flow_parts
        flows = pd.DataFrame(
            {
                "ph": self._flow_categorical("ph"),
                "cat": self._flow_categorical("cat"),
                "id": _masked([(len(v), (v, m)) for v, m in fp["id"]], sum(len(v) for v, _ in fp["id"]), False),
                "pid": self._flow_categorical("pid"),
                "tid": self._flow_categorical("tid"),
                "ts": np.concatenate(fp["ts"]) if fp["ts"] else np.zeros(0, dtype=np.float64),
            }
        )
        warnings = list(dict.fromkeys(warnings))  # a chunk decoded twice notes its repairs twice
        # by field, not in the order the chunks met them: that order depends on where the
        # file was cut into chunks and stretches (a chunk counts its fields in column order)
        for (where, floating), count in sorted(self.dropped.items()):
            kind = "float64" if floating else "int64"
            warnings.append(f"{count} values of {where} are not numbers that fit {kind}; left missing")
        processes: dict[str, str] = {}
        for pid, text, label in self.process_names:
            processes[pid] = f"{processes.get(pid, '')} {text}".strip() if label else text
        return ParsedTrace(table, flows, normalize.metadata(meta), processes, self.threads, warnings)

    def _categorical(self, column: str, jobs: list[_Job], carver: Carver | None = None) -> Callable[[], pd.Categorical]:
        return self._in_file_order(column, self.cats[column], self.codes[column], jobs, carver)

    def _flow_categorical(self, column: str) -> pd.Categorical:
        jobs: list[_Job] = []
        make = self._in_file_order(f"flow {column}", self.flow_cats[column], self.flow_parts[column], jobs)
        _run_jobs(jobs, None)
        return make()

    def _in_file_order(
        self,
        column: str,
        interner: _Interner,
        parts: list[ChunkCodes],
        jobs: list[_Job],
        carver: Carver | None = None,
    ) -> Callable[[], pd.Categorical]:
        """The column (its chunks' codes joined, by a job added to ``jobs``, in memory
        ``carver`` lends where it has room) as a categorical whose categories are in the
        order the file first has them, as a one-thread parse makes them, however the
        threads met them; made by the function returned, once the jobs have run."""
        count = len(interner.labels)
        if count == 0:  # no value in any chunk (most args columns of a CPU trace): all missing
            n = sum(map(_rows, parts))
            if self._no_categories is None:  # (one dtype for all of them: making one costs ~0.1 ms)
                self._no_categories = pd.CategoricalDtype(pd.Index([], dtype="str"), ordered=False)
            missing = _new(n, np.int8, carver)
            jobs.append(functools.partial(missing.fill, -1))
            dtype = self._no_categories
            return lambda: pd.Categorical.from_codes(missing, dtype=dtype, validate=False)
        if self.firsts is None or not self.firsts[column]:
            codes = _joined_codes(parts, count, jobs, carver=carver)
            return lambda: interner.categorical(codes)
        order = pd.unique(np.concatenate(self.firsts[column]))  # in order of first appearance
        if len(order) < count:  # values no chunk had (none expected): after the others
            order = np.concatenate([order, np.setdiff1d(np.arange(count), order)])
        if (order == np.arange(count)).all():
            codes = _joined_codes(parts, count, jobs, carver=carver)
            return lambda: interner.categorical(codes)
        # (int32 for the C join's tables; numpy's casts them to the codes' type itself)
        renumber = np.full(count + 1, -1, dtype=np.int32 if _join is not None else code_dtype(count))
        renumber[order] = np.arange(count)  # the last: missing stays -1
        categories = pd.Index(np.asarray(interner.labels, dtype=object)[order], dtype="str")
        codes = _joined_codes(parts, count, jobs, renumber, carver)
        return lambda: pd.Categorical.from_codes(codes, categories=categories, validate=False)


#: the codes of no value
_NO_CODES = np.zeros(0, dtype=np.int32)
_NO_CODES.flags.writeable = False

#: a chunk's codes of a text column: the interner's codes (int32, -1 missing); or a number
#: of rows, all missing; or the scanner's own codes of the chunk (int32, -1 missing) and the
#: interner's code of each (int32, then -1 for the missing ones)
ChunkCodes: TypeAlias = np.ndarray | int | tuple[np.ndarray, np.ndarray]


def _rows(part: ChunkCodes) -> int:
    """The rows of a chunk's ``ChunkCodes``."""
    return part if isinstance(part, int) else len(part[0]) if isinstance(part, tuple) else len(part)


def _run_jobs(jobs: list[_Job], helper: Helper | None) -> None:
    """Run ``jobs``: on this thread and, where ``helper`` lends one, a second one, each
    taking the next job not yet taken (the C joins hold no GIL while they work)."""
    if helper is None or len(jobs) < 2:
        for job in jobs:
            job()
        return
    taken = iter(jobs)  # (a list iterator hands each job to one thread: its next() holds the GIL)
    failed: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            for job in taken:
                job()
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            failed.append(exc)

    def helped() -> None:
        try:
            work()
        finally:
            done.set()

    helper(helped)
    work()
    done.wait()
    if failed:  # Ctrl-C (or an exit) before any job's own error
        raise next((exc for exc in failed if not isinstance(exc, Exception)), failed[0])


def _new(n: int, dtype: np.dtype | type, carver: Carver | None) -> np.ndarray:
    """A new array of ``n`` items (contents garbage) that a C join writes all over: carved
    by ``carver`` where it has room, else ``fresh`` (its pages made by the join)."""
    out = carver.take(n, dtype) if carver is not None else None
    return out if out is not None else fresh(n, dtype, populate=False)


def _joined_floats(parts: list[np.ndarray], jobs: list[_Job]) -> Callable[[], np.ndarray]:
    """A float64 column of its chunks' values, joined by a job added to ``jobs``."""
    if not parts:
        empty = np.zeros(0, np.float64)
        return lambda: empty
    rows = sum(map(len, parts))
    if _join is None:
        joined = np.concatenate(parts, out=fresh(rows, np.float64))
        return lambda: joined
    out = fresh(rows, np.float64, populate=False)
    join = _join.join_bytes
    chunks = [np.ascontiguousarray(p, dtype=np.float64) for p in parts]
    jobs.append(lambda: join(out, chunks))
    return lambda: out


def _joined_codes(
    parts: list[ChunkCodes],
    count: int,
    jobs: list[_Job],
    renumber: np.ndarray | None = None,
    carver: Carver | None = None,
) -> np.ndarray:
    """The chunks' codes (``ChunkCodes``) of a column of ``count`` categories joined into one
    array of ``code_dtype(count)``, through ``renumber`` (indexed by code, its last entry -1
    for the missing ones) where given: one pass, no int32 copy of the column. By the C
    join, a job added to ``jobs``, where it is built (the array is written once they ran;
    in memory ``carver`` lends, where it has room)."""
    if _join is None:
        return _joined_codes_numpy(parts, count, renumber)
    out = _new(sum(map(_rows, parts)), code_dtype(count), carver)
    # the interner's own codes (msgspec's chunks) go through renumber, or as they are
    through = renumber if renumber is not None else np.append(np.arange(count, dtype=np.int32), np.int32(-1))
    pieces: list[int | tuple[np.ndarray, np.ndarray]] = []
    for part in parts:
        if isinstance(part, int):
            pieces.append(part)
        elif isinstance(part, tuple):
            local, table = part
            pieces.append((local, renumber[table] if renumber is not None else table))
        else:
            pieces.append((part, through))
    join, width = _join.join_codes, out.dtype.itemsize
    jobs.append(lambda: join(out, width, pieces))
    return out


def _joined_codes_numpy(parts: list[ChunkCodes], count: int, renumber: np.ndarray | None = None) -> np.ndarray:
    """``_joined_codes`` without the C scanner."""
    out = fresh(sum(map(_rows, parts)), code_dtype(count))
    at = 0
    for part in parts:
        rows = _rows(part)
        piece = out[at : at + rows]
        if isinstance(part, int):
            piece[...] = -1
        elif isinstance(part, tuple):
            local, table = part
            table = renumber[table] if renumber is not None else table.astype(out.dtype)
            np.take(table, local, out=piece, mode="wrap")  # (-1, missing: the table's last entry)
        elif renumber is None:
            piece[...] = part
        else:
            np.take(renumber, part, out=piece)
        at += rows
    return out


def _scanned_numbers(part: tuple[bytes, bytes] | None, floating: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, missing mask) of a number column from the C scanner (None: all missing)."""
    if part is None:
        return None
    values, missing = part
    return np.frombuffer(values, dtype=np.float64 if floating else np.int64), np.frombuffer(missing, dtype=bool)


def _masked(
    parts: list[tuple[int, tuple[np.ndarray, np.ndarray] | None]],
    n: int,
    floating: bool,
    jobs: list[_Job] | None = None,
    carver: Carver | None = None,
) -> Any:
    """A nullable Int64/Float64 array from chunk parts (None parts are all missing), filled
    in place (no zeros and ones made for the missing parts to be joined: ~2 ms less of a
    100 MB trace's load). With ``jobs``: a function that makes the array, which a job added
    to them fills first (the C join, where it is built); the arrays it writes all over
    (its mask; its values where every chunk has some) in memory ``carver`` lends."""
    dtype = np.float64 if floating else np.int64
    if all(p is None for _, p in parts):
        missing = all_missing(n, floating, carver.take(n, bool) if carver is not None else None)
        return missing if jobs is None else lambda: missing
    # every chunk with values: all of it written (``fresh``); else the rows of the chunks
    # without are lazily mapped zeros, written never
    spans = [
        (at, at + k)
        for at, (k, p) in zip(itertools.accumulate((k for k, _ in parts), initial=0), parts)
        if p is not None
    ]
    whole = len(spans) == len(parts)
    if jobs is not None and _join is not None:  # (the join makes the pages: ``partly_written``'s advice)
        values, gaps = (_new(n, dtype, carver), []) if whole else _partly_carved(n, dtype, spans, carver)
        mask = _new(n, bool, carver)
        join, kind = _join.join_numbers, pd.arrays.FloatingArray if floating else pd.arrays.IntegerArray

        def job() -> None:
            for start, stop in gaps:  # a pool's garbage where no chunk has values: zeros
                zero_rows(values, start, stop)
            join(values, mask, parts)

        jobs.append(job)
        return lambda: kind(values, mask)
    made = _masked_numpy(parts, n, floating, spans, whole)
    return made if jobs is None else lambda: made


def _partly_carved(
    n: int, dtype: type, spans: list[tuple[int, int]], carver: Carver | None
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The values of a number column that some chunks have none of, and the rows of it to
    zero before the join writes the others: carved by ``carver`` where a quarter of the
    rows or more have values (the rest, the pool's garbage, to zero: ``zero_rows`` hands
    their whole pages back), else lazily mapped zeros (only the pages of rows with values
    are made; none to zero)."""
    present = sum(stop - start for start, stop in spans)
    out = carver.take(n, dtype) if carver is not None and 4 * present >= n else None
    return (lazy_zeros(n, dtype), []) if out is None else (out, _gaps(spans, n))


def _gaps(spans: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The rows of ``[0, n)`` outside ``spans`` (in order, not overlapping)."""
    gaps, at = [], 0
    for start, stop in spans:
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    if n > at:
        gaps.append((at, n))
    return gaps


def _masked_numpy(
    parts: list[tuple[int, tuple[np.ndarray, np.ndarray] | None]],
    n: int,
    floating: bool,
    spans: list[tuple[int, int]],
    whole: bool,
) -> Any:
    """``_masked`` by numpy (without the C scanner; and the flows' ids)."""
    dtype = np.float64 if floating else np.int64
    values = fresh(n, dtype) if whole else partly_written(n, dtype, spans)
    mask = fresh(n, bool)
    at = 0
    for k, part in parts:
        if part is None:
            mask[at : at + k] = True
        else:
            values[at : at + k] = part[0]
            mask[at : at + k] = part[1]
        at += k
    if floating:
        return pd.arrays.FloatingArray(values, mask)
    return pd.arrays.IntegerArray(values, mask)


def categorical(values: list[Any] | np.ndarray) -> pd.Categorical:
    """Strings interned as an unsorted categorical (mixed int/str ids become strings)."""
    interner = _Interner()
    return interner.categorical(interner.codes(values, len(values)))
