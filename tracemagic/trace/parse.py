"""Parse one Kineto trace into typed columns (no per-event Python dicts, bounded memory).

The ``traceEvents`` array is decoded in chunks of a few MB, straight from the (streamed,
decompressed) file. Where it is built, the C scanner (``_scan.c``: yyjson parses the
chunk, one pass fills the columns, each column's values interned per chunk, no Python
object per event) reads each chunk, ~4x faster than the Python route. That route, msgspec,
reads what the scanner leaves (malformed JSON, values of unexpected types) and everything
when no C compiler built it: msgspec decodes the chunk into slotted structs that keep only
the fields the analyses use, and the columns are pulled out with C-level ``attrgetter``
maps. Both give the same columns (``tests/test_scan.py``); repeated strings become
categorical codes as they come, so peak memory is the final columns plus one chunk.

Chunks are cut at ``}`` ``,`` ``{`` boundaries; a cut is accepted only when the chunk
decodes as a list of events, which a cut inside a string or a nested object never does
(its prefix cannot be complete JSON), so the cutting is exact for any valid JSON. Damage
(truncation, garbage) is located by msgspec's byte offset; ``recover=True`` keeps the
events before it. Odd layouts fall back to decoding the whole document at once.
"""

from __future__ import annotations

import ast
import gc
import json
import math
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Iterator

import msgspec
import numpy as np
import pandas as pd

from tracemagic.errors import TraceError
from tracemagic.trace import normalize
from tracemagic.trace.columns import all_missing
from tracemagic.trace.read import ByteStream, Source, sniff

try:  # the C scanner (setup.py builds it where a compiler is found)
    from tracemagic.trace import _scan
except ImportError:  # pragma: no cover - installed without a C compiler: msgspec alone
    _scan = None

#: bytes of events decoded at once (peak memory holds about one chunk's Python objects;
#: 1-8 MB measured alike in speed, smaller is lighter)
CHUNK_BYTES = 2 << 20
#: how many cut candidates to try before falling back to the whole-document path
_MAX_CUT_TRIES = 16
#: progress callback: (bytes read from the file so far, the file's size)
Progress = Callable[[int, int], None]

_NULL = msgspec.Raw(b"null")


class _Args(msgspec.Struct, gc=False):
    """The ``args`` keys tracemagic reads; every other key is skipped by the decoder."""

    external_id: Any = msgspec.field(name="External id", default=None)
    external_id_old: Any = msgspec.field(name="external id", default=None)
    correlation: Any = None
    device: Any = None
    stream: Any = None
    rf_id: Any = msgspec.field(name="Record function id", default=None)
    seq: Any = msgspec.field(name="Sequence number", default=None)
    fwd_tid: Any = msgspec.field(name="Fwd thread id", default=None)
    python_id: Any = msgspec.field(name="Python id", default=None)
    python_parent_id: Any = msgspec.field(name="Python parent id", default=None)
    input_dims: msgspec.Raw = msgspec.field(name="Input Dims", default=_NULL)
    input_type: msgspec.Raw = msgspec.field(name="Input type", default=_NULL)
    concrete_inputs: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=_NULL)
    mem_bytes: Any = msgspec.field(name="Bytes", default=None)
    nbytes: Any = msgspec.field(name="bytes", default=None)
    total_allocated: Any = msgspec.field(name="Total Allocated", default=None)
    total_reserved: Any = msgspec.field(name="Total Reserved", default=None)
    device_id: Any = msgspec.field(name="Device Id", default=None)
    device_type: Any = msgspec.field(name="Device Type", default=None)
    addr: Any = msgspec.field(name="Addr", default=None)
    collective: Any = msgspec.field(name="Collective name", default=None)
    pg_name: Any = msgspec.field(name="Process Group Name", default=None)
    pg_ranks: msgspec.Raw = msgspec.field(name="Process Group Ranks", default=_NULL)
    group_size: Any = msgspec.field(name="Group size", default=None)
    in_nelems: Any = msgspec.field(name="In msg nelems", default=None)
    out_nelems: Any = msgspec.field(name="Out msg nelems", default=None)
    dtype: Any = None
    flops: Any = None
    grid: msgspec.Raw = _NULL
    block: msgspec.Raw = _NULL
    meta_name: Any = msgspec.field(name="name", default=None)
    labels: Any = None
    sort_index: Any = None


_EMPTY_ARGS = _Args()
#: the JSON key of each ``_Args`` field (for messages)
_ARG_KEY = {f.name: f.encode_name for f in msgspec.structs.fields(_Args)}


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: Any = ""
    name: Any = ""
    pid: Any = None
    tid: Any = None
    ts: float = math.nan
    dur: float = 0.0
    id: Any = None
    args: _Args = msgspec.field(default_factory=_Args)


class _LooseEvent(msgspec.Struct, gc=False):
    """Fallback for traces whose fields have unexpected types (slower, same columns)."""

    ph: Any = ""
    cat: Any = ""
    name: Any = ""
    pid: Any = None
    tid: Any = None
    ts: Any = math.nan
    dur: Any = 0.0
    id: Any = None
    args: Any = None


_EVENTS = msgspec.json.Decoder(list[_Event])
#: the loose path reads numbers beyond float64 too (``1e400``: as text, see ``_float_or_text``)
_LOOSE_EVENTS = msgspec.json.Decoder(list[_LooseEvent], float_hook=lambda text: _float_or_text(text))
_ONE_ARGS = msgspec.json.Decoder(_Args)
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY = msgspec.json.Decoder()
#: ``_ANY`` that reads numbers beyond float64 (as inf) instead of failing
_BIG = msgspec.json.Decoder(float_hook=float)
#: the trace's metadata: numbers beyond float64 stay text
_META = msgspec.json.Decoder(float_hook=lambda text: _float_or_text(text))

#: event columns pulled from every X/i event
_BASE = ("ph", "cat", "name", "pid", "tid", "ts", "dur")
_BASE_GETTER = attrgetter(*_BASE)
_ARGS_GETTER = attrgetter("args")
_FLOW_GETTER = attrgetter("ph", "cat", "pid", "tid", "id", "ts")
#: args columns: (column name, struct field, floating?)
_ARG_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("external_id", "external_id", False),
    ("correlation", "correlation", False),
    ("device", "device", False),
    ("stream", "stream", False),
    ("rf_id", "rf_id", False),
    ("seq", "seq", False),
    ("fwd_tid", "fwd_tid", False),
    ("python_id", "python_id", False),
    ("python_parent_id", "python_parent_id", False),
    ("bytes", "nbytes", False),
    ("mem_bytes", "mem_bytes", False),
    ("total_allocated", "total_allocated", False),
    ("total_reserved", "total_reserved", False),
    ("device_id", "device_id", False),
    ("device_type", "device_type", False),
    ("addr", "addr", False),
    ("flops", "flops", True),
    ("group_size", "group_size", False),
    ("in_nelems", "in_nelems", False),
    ("out_nelems", "out_nelems", False),
)
_ARG_STRINGS = ("collective", "pg_name", "dtype")
#: the text columns of timed events, in the C scanner's order
_TEXT = ("ph", "cat", "name", "pid", "tid") + _ARG_STRINGS
_ARG_RAW = ("input_dims", "input_type", "concrete_inputs", "grid", "block", "pg_ranks")
_ARG_FIELDS = tuple(f for _, f, _ in _ARG_COLUMNS) + _ARG_STRINGS + _ARG_RAW + ("external_id_old",)
_ARG_GETTER = attrgetter(*_ARG_FIELDS)
_TIMED = frozenset(("X", "i", "I"))
_FLOWS = frozenset(("s", "f", "t"))
_BAD_OFFSET = re.compile(r"\(byte (\d+)\)|at byte (\d+)")
_NEXT_EVENT = re.compile(rb"\}\s*,\s*\{")
_LAST_EVENT = re.compile(rb"\}\s*\]")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = b" \t\r\n"
_INT64_MAX = np.iinfo(np.int64).max


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


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Switch the cyclic GC off while millions of small objects are made."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _offset_of(exc: Exception) -> int | None:
    match = _BAD_OFFSET.search(str(exc))
    if not match:
        return None
    return int(match.group(1) or match.group(2))


#: values nested deeper than this are replaced by a string before msgspec decodes them (it
#: recurses, and gives up with RecursionError near Python's recursion limit, ~1,000 levels)
MAX_NESTING = 200
_STRUCTURE = re.compile(rb'[\[\]{}"]')
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*"', re.S)
_TOO_DEEP = b"<nested too deep>"
_BAD_BYTE = re.compile("[\udc80-\udcff]")


def _repair(data: bytes, base: int = 0) -> tuple[bytes, list[str]]:
    """``data`` made decodable at the same length (so offsets in it stay true): invalid UTF-8
    bytes become ``?``, values nested deeper than ``MAX_NESTING`` a string; and notes of
    what was replaced (``base`` is ``data``'s offset in the file)."""
    notes = []
    text = data.decode("utf-8", "surrogateescape")
    bad = _BAD_BYTE.search(text)
    if bad is not None:
        offset = base + len(text[: bad.start()].encode("utf-8", "surrogateescape"))
        count = len(_BAD_BYTE.findall(text))
        data = _BAD_BYTE.sub("?", text).encode("utf-8")
        notes.append(f"invalid UTF-8 at byte {offset} ({count} bytes in all read as '?')")
    out = bytearray(data)
    depth, deep_from, pos = 0, -1, 0
    while (match := _STRUCTURE.search(data, pos)) is not None:
        at = pos = match.start()
        char = data[at]
        pos += 1
        if char == 0x22:  # a string: skip to its end
            rest = _STRING_REST.match(data, pos)
            if rest is None:
                break  # the rest of the data is inside it
            pos = rest.end()
        elif char in b"[{":
            depth += 1
            if depth == MAX_NESTING + 1:
                deep_from = at
        else:
            if depth == MAX_NESTING + 1 and deep_from >= 0:
                _blank(out, deep_from, at + 1)
                deep_from = -1
            depth -= 1
    if deep_from >= 0:  # never closed: blank to the end (the data is cut off there)
        out[deep_from:] = b" " * (len(out) - deep_from)
    return bytes(out), notes


def _blank(out: bytearray, start: int, stop: int) -> None:
    """Replace ``out[start:stop]`` (a value nested too deep) by the string ``_TOO_DEEP`` and
    spaces, the same length. No note: where a column reads it, it shows; elsewhere it is
    skipped, as the C scanner skips it (so no warning can tell the two paths apart)."""
    text = b'"' + _TOO_DEEP + b'"'
    if len(text) > stop - start:
        text = b'""'
    out[start:stop] = text.ljust(stop - start)


def _decode(decoder: Any, data: Any, notes: list[str] | None = None, base: int = 0) -> Any:
    """``decoder.decode(data)``; where msgspec meets invalid UTF-8 or nesting too deep for it,
    decoded again from ``_repair``'s copy (``notes`` gets what was replaced).

    Raises msgspec.DecodeError for malformed JSON, as ``decode`` does.
    """
    try:
        return decoder.decode(data)
    except (UnicodeDecodeError, RecursionError):
        fixed, done = _repair(bytes(data), base)
    if notes is not None:
        notes.extend(done)
    return decoder.decode(fixed)


def _literal(value: Any) -> Any:
    """Metadata values written as Python reprs (``"{'rank': 2}"``) become objects; never eval.
    Only values JSON can hold are taken (the cache stores metadata as JSON)."""
    if isinstance(value, str) and value[:1] in "{[":
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            try:
                return _decode(_META, value.encode("utf-8", "surrogatepass"))
            except msgspec.DecodeError:
                return value
        try:
            return json.loads(json.dumps(parsed, allow_nan=False))
        except (TypeError, ValueError, RecursionError):
            return value
    return value


def _finite(value: Any) -> float | None:
    """A JSON number (or numeric text) as a finite float; None for anything else."""
    number = _to_number(value)
    try:
        number = float(number) if number is not None else None
    except OverflowError:  # an integer beyond float64
        return None
    return number if number is not None and math.isfinite(number) else None


def _float_or_text(text: str) -> float | str:
    """msgspec's ``float_hook`` on the loose path: a number beyond float64 (``1e400``) stays text."""
    value = float(text)
    return value if math.isfinite(value) else text


def _to_number(value: Any) -> int | float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text, 0)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return None
    return None


# -- columns -------------------------------------------------------------------------------


class _Interner:
    """Labels -> categorical codes, shared by all chunks of a column (insertion order).

    Values are looked up in a dict keyed by the decoded value itself (a C-level ``map``
    over the chunk), so only values not seen before cost Python work.
    """

    __slots__ = ("index", "labels", "raw", "seen")

    def __init__(self, raw: bool = False) -> None:
        self.index: dict[str, int] = {}
        self.labels: list[str] = []
        self.raw = raw  # values are JSON text as bytes; b"null" is missing
        self.seen: dict[Any, int] = {b"null": -1} if raw else {None: -1}

    def codes(self, values: Any, n: int) -> np.ndarray:
        seen = self.seen
        try:
            found = list(map(seen.get, values))
        except TypeError:  # an unhashable value (a list where a string belongs)
            values = [v if isinstance(v, (str, int, float, bytes)) or v is None else str(v) for v in values]
            found = list(map(seen.get, values))
        try:
            return np.array(found, dtype=np.int32)
        except TypeError:  # some values not seen before (their lookup gave None)
            pass
        for value in dict.fromkeys(v for v, c in zip(values, found) if c is None):  # in order
            seen[value] = self._code(value)
        return np.array(list(map(seen.__getitem__, values)), dtype=np.int32)

    def _code(self, value: Any) -> int:
        """The code of a value not seen before (missing values are in ``seen`` from the start)."""
        if self.raw:
            label = _json_text(value)
        else:
            label = value if type(value) is str else str(value)
        return self.intern(label)

    def intern(self, label: str) -> int:
        """The code of ``label``, added if new."""
        code = self.index.get(label)
        if code is None:
            code = self.index[label] = len(self.labels)
            self.labels.append(label)
        return code

    def remap(self, codes: bytes, values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Codes of a chunk the C scanner interned on its own (``codes`` index ``values``),
        and the codes of ``values`` (the chunk's distinct values in the order it met them)."""
        local = np.frombuffer(codes, dtype=np.int32)
        if not values:
            return local, np.zeros(0, dtype=np.int32)
        table = np.append(self.codes(values, len(values)), np.int32(-1))  # -1 stays missing
        return table[local], table[:-1]

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

    Hex strings ('0x7f..') and numeric strings are read as numbers; anything else is missing.
    """
    n = len(col)
    nones = col.count(None)
    if nones == n:
        return None
    dtype = np.float64 if floating else np.int64
    try:  # fast path: numbers and Nones (-> nan) straight into float64
        floats = np.array(col, dtype=np.float64)
    except (TypeError, ValueError):
        floats = None
    if floats is not None and floats.ndim == 1:
        mask = ~np.isfinite(floats)  # inf: numeric text beyond float64 ("1e400")
        if floating:
            return floats, mask
        finite = floats[~mask]
        if finite.size == 0 or (np.abs(finite).max() < 2**53 and np.array_equal(finite, np.round(finite))):
            floats[mask] = 0
            return floats.astype(np.int64), mask
    objects = _objects(col, n)
    mask = np.equal(objects, None) if nones else np.zeros(n, dtype=bool)
    if nones:
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
            if abs(number) > _INT64_MAX:
                continue
        values[i] = number
        mask[i] = False
    return values, mask


class Interners:
    """The distinct values of one file's text columns. The builders of its stretches, read
    on two threads (``trace.split``), share one: their codes then need no recoding when the
    stretches are joined, and each value is decoded once. ``lock`` guards the sharing."""

    def __init__(self) -> None:
        self.cats = {c: _Interner() for c in _TEXT}
        self.cats.update({c: _Interner(raw=True) for c in _ARG_RAW})
        self.flow_cats = {c: _Interner() for c in ("ph", "cat", "pid", "tid")}
        self.lock = threading.Lock()


class _Builder:
    """Accumulates the columns of one trace, chunk by chunk."""

    def __init__(self, interners: Interners | None = None) -> None:
        self.n = 0
        self.interners = interners or Interners()
        self.cats = self.interners.cats
        self.codes: dict[str, list[np.ndarray]] = {c: [] for c in self.cats}
        self.floats: dict[str, list[np.ndarray]] = {"ts": [], "dur": []}
        self.numbers: dict[str, list[tuple[int, tuple[np.ndarray, np.ndarray] | None]]] = {
            c: [] for c, _, _ in _ARG_COLUMNS
        }
        self.flow_cats = self.interners.flow_cats
        self.flow_parts: dict[str, list[Any]] = {c: [] for c in ("ph", "cat", "pid", "tid", "id", "ts")}
        #: per (JSON field, floating): values present that are not numbers fitting the column (left missing)
        self.dropped: dict[tuple[str, bool], int] = {}
        self.processes: dict[str, str] = {}
        self.threads: dict[tuple[str, str], str] = {}
        # with shared interners, codes follow the order the threads met values in: the
        # distinct codes of each chunk (in its own order) put them back in file order
        self.firsts: dict[str, list[np.ndarray]] | None = None
        if interners is not None:
            self.firsts = {c: [] for c in [*self.cats, *(f"flow {c}" for c in self.flow_cats)]}

    def _keep(self, column: str, codes: np.ndarray, firsts: np.ndarray | None = None) -> None:
        """Append a chunk's codes of a text column (``flow X`` for the flows' columns)."""
        parts = self.flow_parts[column[5:]] if column.startswith("flow ") else self.codes[column]
        parts.append(codes)
        if self.firsts is not None:
            self.firsts[column].append(pd.unique(codes[codes >= 0]) if firsts is None else firsts)

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
            self._keep(column, np.full(n, -1, dtype=np.int32) if values.count(None) == n else self.cats[column].codes(values, n))
        for column in _ARG_RAW:
            values = columns[column]
            if values.count(_NULL) == n:
                self._keep(column, np.full(n, -1, dtype=np.int32))
            else:
                self._keep(column, self.cats[column].codes(list(map(bytes, values)), n))
        self.n += n

    def _add_scanned(self, columns: tuple[Any, ...]) -> None:
        n, text, raw, ts, dur, numbers, (n_flows, flow_text, flow_id, flow_ts), names = columns
        if names:
            self._names([_Event("M", "", name, pid, tid, args=_Args(meta_name=label, labels=labels))
                         for name, pid, tid, label, labels in names])
        if n_flows:
            for column, (codes, values) in zip(self.flow_cats, flow_text):
                self._keep(f"flow {column}", *self.flow_cats[column].remap(codes, values))
            self.flow_parts["ts"].append(np.frombuffer(flow_ts, dtype=np.float64))
            ids = _scanned_numbers(flow_id, False)
            self.flow_parts["id"].append(ids or (np.zeros(n_flows, np.int64), np.ones(n_flows, bool)))
        if not n:
            return
        for column, (codes, values) in zip(_TEXT + _ARG_RAW, text + raw):
            self._keep(column, *self.cats[column].remap(codes, values))
        self.floats["ts"].append(np.frombuffer(ts, dtype=np.float64))
        self.floats["dur"].append(np.frombuffer(dur, dtype=np.float64))
        for (column, _, floating), part in zip(_ARG_COLUMNS, numbers):
            self.numbers[column].append((n, _scanned_numbers(part, floating)))
        self.n += n

    def extend(self, other: "_Builder") -> None:
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
        self.processes.update(other.processes)
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
        self.flow_parts["id"].append(self._numbers("the flow events' 'id'", ids, False) or (np.zeros(n, np.int64), np.ones(n, bool)))

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
                self.processes[str(event.pid)] = str(value)
            elif event.name == "process_labels" and args.labels:
                self.processes[str(event.pid)] = f"{self.processes.get(str(event.pid), '')} {args.labels}".strip()
            elif event.name == "thread_name" and value is not None:
                self.threads[(str(event.pid), str(event.tid))] = str(value)

    def finish(self, meta: dict[str, Any], warnings: list[str]) -> ParsedTrace:
        frame: dict[str, Any] = {}
        for column in ("ph", "cat", "name", "pid", "tid"):
            frame[column] = self._categorical(column)
        for column in ("ts", "dur"):
            parts = self.floats[column]
            frame[column] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)
        for column, _, floating in _ARG_COLUMNS:
            frame[column] = _masked(self.numbers[column], self.n, floating)
        for column in _ARG_STRINGS + _ARG_RAW:
            frame[column] = self._categorical(column)
        table = pd.DataFrame(frame, copy=False)

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
        for (where, floating), count in self.dropped.items():
            kind = "float64" if floating else "int64"
            warnings.append(f"{count} values of {where} are not numbers that fit {kind}; left missing")
        return ParsedTrace(table, flows, normalize.metadata(meta), self.processes, self.threads, warnings)

    def _categorical(self, column: str) -> pd.Categorical:
        parts = self.codes[column]
        return self._in_file_order(column, self.cats[column], np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))

    def _flow_categorical(self, column: str) -> pd.Categorical:
        parts = self.flow_parts[column]
        codes = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return self._in_file_order(f"flow {column}", self.flow_cats[column], codes)

    def _in_file_order(self, column: str, interner: _Interner, codes: np.ndarray) -> pd.Categorical:
        """The column as a categorical whose categories are in the order the file first has
        them, as a one-thread parse makes them, however the threads met them."""
        if self.firsts is None or not self.firsts[column]:
            return interner.categorical(codes)
        count = len(interner.labels)
        order = pd.unique(np.concatenate(self.firsts[column]))  # in order of first appearance
        if len(order) < count:  # values no chunk had (none expected): after the others
            order = np.concatenate([order, np.setdiff1d(np.arange(count), order)])
        if (order == np.arange(count)).all():
            return interner.categorical(codes)
        renumber = np.full(count + 1, -1, dtype=np.int32)  # the last: missing stays -1
        renumber[order] = np.arange(count, dtype=np.int32)
        categories = pd.Index(np.asarray(interner.labels, dtype=object)[order], dtype="str")
        return pd.Categorical.from_codes(renumber[codes], categories=categories, validate=False)


def _scanned_numbers(part: tuple[bytes, bytes] | None, floating: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, missing mask) of a number column from the C scanner (None: all missing)."""
    if part is None:
        return None
    values, missing = part
    return np.frombuffer(values, dtype=np.float64 if floating else np.int64), np.frombuffer(missing, dtype=bool)


def _masked(parts: list[tuple[int, tuple[np.ndarray, np.ndarray] | None]], n: int, floating: bool) -> Any:
    """A nullable Int64/Float64 array from chunk parts (None parts are all missing)."""
    dtype = np.float64 if floating else np.int64
    if all(p is None for _, p in parts):
        return all_missing(n, floating)
    values = np.concatenate([p[0] if p is not None else np.zeros(k, dtype=dtype) for k, p in parts])
    mask = np.concatenate([p[1] if p is not None else np.ones(k, dtype=bool) for k, p in parts])
    if floating:
        return pd.arrays.FloatingArray(values, mask)
    return pd.arrays.IntegerArray(values, mask)


def categorical(values: list[Any] | np.ndarray) -> pd.Categorical:
    """Strings interned as an unsorted categorical (mixed int/str ids become strings)."""
    interner = _Interner()
    return interner.categorical(interner.codes(values, len(values)))


# -- decoding ------------------------------------------------------------------------------


def scans_in_c() -> bool:
    """Whether the C scanner is built (it decodes without holding the GIL)."""
    return _scan is not None


def _decode_events(data: Any, name: str, notes: list[str] | None = None, base: int = 0) -> list[Any] | tuple[Any, ...]:
    """A JSON array of events -> the C scanner's columns, or structs (typed fast path,
    loose fallback) where the scanner leaves the array to msgspec.

    ``notes`` gets what had to be repaired to decode it (see ``_decode``; ``base`` is the
    data's offset in the file).

    Raises msgspec.DecodeError for malformed JSON (the caller locates it).
    """
    if _scan is not None:
        columns = _scan.scan(data)
        if columns is not None:
            return columns
    try:
        return _decode(_EVENTS, data, notes, base)
    except msgspec.ValidationError:
        pass
    try:
        events = _decode(_LOOSE_EVENTS, data, notes, base)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{name}: an event has an unreadable shape ({exc}).", path=name) from None
    odd_durations = 0
    for event in events:
        event.ph = event.ph if isinstance(event.ph, str) else str(event.ph)
        ts = _finite(event.ts)
        event.ts = ts if ts is not None else math.nan  # left out later, with a warning
        dur = _finite(event.dur)
        odd_durations += dur is None and event.dur is not None
        event.dur = dur or 0.0
        event.args = _loose_args(event.args)
    if odd_durations and notes is not None:
        notes.append(f"{odd_durations} events after byte {base} have a dur that is not a finite number; read as 0")
    return events


def _loose_args(value: Any) -> _Args:
    if not isinstance(value, dict):
        return _EMPTY_ARGS
    try:
        return _ONE_ARGS.decode(msgspec.json.encode(value))
    except (msgspec.ValidationError, msgspec.EncodeError, RecursionError, OverflowError):
        return _EMPTY_ARGS


@dataclass
class Part:
    """The decoded columns of a file, or of a stretch of one, before they become tables."""

    builder: _Builder
    meta: dict[str, Any]
    warnings: list[str]

    def extend(self, later: "Part") -> None:
        """Append a part that follows this one in the same file (read with the same ``Interners``)."""
        self.builder.extend(later.builder)
        self.meta.update(later.meta)
        self.warnings += later.warnings

    def finish(self) -> ParsedTrace:
        return self.builder.finish(self.meta, self.warnings)


class _Damage(Exception):
    """The JSON is broken at ``offset`` (absolute, in the decompressed bytes)."""

    def __init__(self, offset: int | None, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset
        self.reason = reason


class Unstreamable(Exception):
    """The streaming path cannot handle this layout: decode the whole document instead."""


class _StreamParser:
    """Cuts the traceEvents array of a byte stream into chunks and decodes them."""

    def __init__(
        self,
        source: Source,
        stream: ByteStream,
        recover: bool,
        progress: Progress | None,
        chunk: int,
        base: int = 0,
        interners: Interners | None = None,
    ) -> None:
        self.source = source
        self.name = source.name
        self.stream = stream
        self.recover = recover
        self.progress = progress
        self.chunk = chunk
        self.buf = bytearray()
        self.base = base  # absolute offset of buf[0] in the file
        self.eof = False
        self.builder = _Builder(interners)
        self.meta: dict[str, Any] = {}
        self.warnings: list[str] = []

    # -- input --------------------------------------------------------------------------
    def _more(self) -> bool:
        if self.eof:
            return False
        block = self.stream.read()
        if not block:
            self.eof = True
            return False
        self.buf = self.buf + block if self.buf else bytearray(block)
        return True

    def _drop(self, count: int) -> None:
        """Forget the first ``count`` bytes (a new buffer: decoded Raw values may still view the old one)."""
        self.buf = self.buf[count:]
        self.base += count

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(min(self.stream.consumed, self.source.size), self.source.size)

    # -- the document -----------------------------------------------------------------
    def run(self) -> ParsedTrace:
        return self.read().finish()

    def read(self) -> "Part":
        """Decode the whole stream into columns (not yet a table)."""
        self._more()
        sniff(bytes(self.buf[: 1 << 20]), self.name)
        self._find_events()
        while True:
            while not self.eof and len(self.buf) < self.chunk:
                self._more()
            if self.eof:
                self._last_chunk()
                break
            if not self._next_chunk():
                break
            self._report()
        if self.stream.truncated and not self.recover:
            raise TraceError(
                f"{self.name}: the gzip stream is cut off (the file is truncated after "
                f"{self.base + len(self.buf)} bytes of JSON). Pass recover=True to "
                "tracemagic.load to keep the events before the cut.",
                path=self.name,
                offset=self.base + len(self.buf),
            )
        if self.stream.truncated:
            self.warnings.append(f"{self.name}: gzip stream truncated; recovered what it held")
        self._report()
        return Part(self.builder, self.meta, self.warnings)

    def _find_events(self) -> None:
        """Move to the '[' of the events array; decode the metadata before it."""
        start = len(self.buf) - len(self.buf.lstrip(b"\xef\xbb\xbf" + _WS))
        if self.buf[start : start + 1] == b"[":
            self._drop(start)
            return
        while True:
            key = self.buf.find(b'"traceEvents"', start)
            match = _EVENTS_KEY.match(self.buf, key) if key >= 0 else None
            if match is not None and self.buf[key - 1 : key] != b"\\":
                break
            if key >= 0 and len(self.buf) - key > 64:  # odd spacing or a string that says traceEvents
                raise Unstreamable
            if not self._more() or len(self.buf) > (256 << 20):
                raise Unstreamable
        head = bytes(self.buf[start:key]).rstrip(_WS)
        if head.endswith(b","):
            head = head[:-1]
        if head.strip(_WS) != b"{":
            try:
                top = _decode(_META, head + b"}", self.warnings, self.base + start)
            except msgspec.DecodeError:
                raise Unstreamable from None
            if not isinstance(top, dict):
                raise Unstreamable
            self.meta.update({k: _literal(v) for k, v in top.items()})
        self._drop(match.end() - 1)

    def _decode_at(self, end: int) -> list[Any]:
        """Decode buf[0:end] + ']' as events (buf[0] is the '[' or the ',' before the chunk)."""
        buf = self.buf
        buf[0] = 0x5B  # '['
        saved = buf[end] if end < len(buf) else None
        try:
            if saved is None:
                return _decode_events(bytes(buf) + b"]", self.name, self.warnings, self.base)
            buf[end] = 0x5D  # ']'
            with memoryview(buf) as view:
                return _decode_events(view[: end + 1], self.name, self.warnings, self.base)
        finally:
            if saved is not None:
                buf[end] = saved

    def _try_cut(self, end: int) -> list[Any] | None:
        """Events of buf[:end]; None when the cut is not between two events."""
        try:
            return self._decode_at(end)
        except msgspec.DecodeError as exc:
            where = _offset_of(exc)
            if where is None or where >= end:
                return None  # error at the end of the chunk: the cut was inside an event
            raise _Damage(self.base + where, str(exc)) from None

    def _next_chunk(self) -> bool:
        """Decode one chunk ending near ``self.chunk``; False when the parse stopped (recovered)."""
        tries = 0
        for limit in (min(len(self.buf), self.chunk), len(self.buf)):
            pos = limit
            while tries < _MAX_CUT_TRIES:
                pos = self.buf.rfind(b"}", 1, pos)
                if pos < 0:
                    break
                if _NEXT_EVENT.match(self.buf, pos) is None:
                    continue
                tries += 1
                try:
                    events = self._try_cut(pos + 1)
                except _Damage as damage:
                    return self._damaged(damage)
                if events is None:
                    continue
                self.builder.add(events)
                del events
                self._drop(self.buf.index(b",", pos + 1))
                return True
        if tries < _MAX_CUT_TRIES and len(self.buf) < (256 << 20) and self._more():
            return True  # no boundary yet (one enormous event): read on
        raise Unstreamable

    def _last_chunk(self) -> None:
        """The end of the document: the last events, the ']' and the metadata after it."""
        body = self.buf[1:].lstrip(_WS)
        if body[:1] == b"]":  # no (more) events
            close = len(self.buf) - len(body)
        else:
            close = -1
            tries = 0
            for match in _LAST_EVENT.finditer(self.buf):
                tries += 1
                try:
                    events = self._try_cut(match.start() + 1)
                except _Damage as damage:
                    self._damaged(damage)
                    return
                if events is not None:
                    self.builder.add(events)
                    del events
                    close = match.end() - 1
                    break
                if tries >= _MAX_CUT_TRIES:
                    raise Unstreamable
            if close < 0:
                self._damaged(self._locate_end_damage())
                return
        tail = bytes(self.buf[close + 1 :]).strip(_WS)
        if tail in (b"", b"}"):
            return
        if tail[:1] == b",":
            try:
                extra = _decode(_META, b"{" + tail[1:], self.warnings, self.base + close + 1)
            except msgspec.DecodeError as exc:
                where = _offset_of(exc)
                offset = self.base + close + 1 + (where if where is not None else len(tail))
                if not self.recover:
                    raise self._error(offset, f"the metadata after the events is damaged ({exc})") from None
                self.warnings.append(f"{self.name}: damaged after the events (byte {offset}); metadata after them lost")
                return
            if isinstance(extra, dict):
                self.meta.update({k: _literal(v) for k, v in extra.items()})
                return
        raise Unstreamable

    def _locate_end_damage(self) -> _Damage:
        """Where the remainder of the document breaks (it has no complete end)."""
        self.buf[0] = 0x5B  # '[' (it may hold the ',' before the next event)
        try:
            _decode(_ANY, self.buf)
        except msgspec.DecodeError as exc:
            where = _offset_of(exc)
            if where is None:  # truncated: the data just ends
                return _Damage(self.base + len(self.buf), "the file ends inside the events (truncated)")
            return _Damage(self.base + where, str(exc))
        return _Damage(self.base + len(self.buf), "the events array is not closed")

    def _error(self, offset: int | None, reason: str) -> TraceError:
        cut = " (the gzip stream is cut off)" if self.stream.truncated else ""
        where = f" at byte {offset}" if offset is not None else ""
        return TraceError(
            f"{self.name}: the trace is truncated or corrupt{where}{cut}: {reason}. "
            "Pass recover=True to tracemagic.load to keep the events before the damage.",
            path=self.name,
            offset=offset,
        )

    def _damaged(self, damage: _Damage) -> bool:
        """Raise, or keep the complete events before the damage (recover=True); stops the parse."""
        if not self.recover:
            raise self._error(damage.offset, damage.reason)
        limit = len(self.buf) if damage.offset is None else max(0, damage.offset - self.base)
        pos = limit
        kept = False
        for _ in range(64):
            pos = self.buf.rfind(b"}", 1, pos)
            if pos < 0:
                break
            try:
                events = self._decode_at(pos + 1)
            except msgspec.DecodeError:
                continue
            self.builder.add(events)
            kept = True
            break
        if not kept and self.builder.n == 0 and not self.builder.flow_parts["ts"]:
            raise TraceError(
                f"{self.name}: damaged at byte {damage.offset} before any complete event; nothing to recover.",
                path=self.name,
                offset=damage.offset,
            )
        self.warnings.append(
            f"{self.name}: damaged at byte {damage.offset} ({damage.reason}); recovered the {self.builder.n} events before it"
        )
        self.eof = True
        return False


def _parse_whole(data: bytes, name: str, recover: bool) -> ParsedTrace:
    """The slow, simple path: decode the whole document at once."""
    warnings: list[str] = []
    start = len(data) - len(data.lstrip(b"\xef\xbb\xbf" + _WS))
    builder = _Builder()
    if data[start : start + 1] == b"[":
        raw_events: Any = data
        meta: dict[str, Any] = {}
    else:
        try:
            top = _decode(_TOP, data, warnings)
        except msgspec.DecodeError as exc:
            offset = _offset_of(exc)
            if offset is None:
                offset = len(data)
            if not recover:
                raise TraceError(
                    f"{name}: the trace is truncated or corrupt at byte {offset} ({exc}). "
                    "Pass recover=True to tracemagic.load to keep the events before the damage.",
                    path=name,
                    offset=offset,
                ) from None
            raw_events, meta = _recover_whole(data, name, offset)
            warnings.append(f"{name}: damaged at byte {offset}; recovered the events before it.")
        else:
            if not isinstance(top, dict) or "traceEvents" not in top:
                raise TraceError(
                    f"{name}: a JSON object without 'traceEvents'; not a Kineto trace "
                    f"(its keys: {', '.join(list(top)[:8]) or 'none'}).",
                    path=name,
                )
            meta = {}
            for key, raw in top.items():
                if key != "traceEvents":
                    meta[key] = _literal(_decode(_META, raw, warnings))
            raw_events = top["traceEvents"]
    try:
        events = _decode_events(raw_events, name, warnings)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{name}: corrupt traceEvents ({exc}).", path=name, offset=_offset_of(exc)) from None
    builder.add(events)
    return builder.finish(meta, warnings)


def _recover_whole(data: bytes, name: str, offset: int) -> tuple[bytes, dict[str, Any]]:
    start = data.find(b'"traceEvents"')
    bracket = data.find(b"[", start) if start >= 0 else -1
    if bracket < 0:
        raise TraceError(f"{name}: damaged at byte {offset} before any event; nothing to recover.", path=name, offset=offset)
    meta: dict[str, Any] = {}
    head = data[:start].rstrip().rstrip(b",") + b"}"
    try:
        meta = {k: _literal(v) for k, v in _decode(_META, head).items()}
    except (msgspec.DecodeError, AttributeError):
        meta = {}
    cuts = [m.start() + 1 for m in _NEXT_EVENT.finditer(data, bracket, offset)]
    for cut in reversed(cuts[-64:]):
        candidate = data[bracket:cut] + b"]"
        try:
            _decode(_LOOSE_EVENTS, candidate)
        except msgspec.DecodeError:
            continue
        return candidate, meta
    raise TraceError(f"{name}: no complete event before the damage at byte {offset}.", path=name, offset=offset)


def parse_source(
    source: Source, *, recover: bool = False, progress: Progress | None = None, chunk: int | None = None
) -> ParsedTrace:
    """Decode one trace file into an events table, a flows table and metadata.

    Raises:
        TraceError: the JSON is damaged (with the byte offset), empty, or not a Kineto trace.
    """
    chunk = chunk or CHUNK_BYTES
    with _gc_paused():
        try:
            with ByteStream(source, block=chunk) as stream:
                return _StreamParser(source, stream, recover, progress, chunk).run()
        except Unstreamable:
            pass
        with ByteStream(source, block=chunk) as stream:
            data = stream.read_all()
            truncated = stream.truncated
        parsed = _parse_whole(data, source.name, recover or truncated)
        if truncated:
            if not recover:
                raise TraceError(
                    f"{source.name}: the gzip stream is cut off (the file is truncated). "
                    "Pass recover=True to tracemagic.load to keep the events before the cut.",
                    path=source.name,
                    offset=len(data),
                )
            parsed.warnings.append(f"{source.name}: gzip stream truncated; recovered what it held")
        if progress is not None:
            progress(source.size, source.size)
        return parsed


def read_part(
    source: Source,
    *,
    base: int = 0,
    chunk: int | None = None,
    progress: Progress | None = None,
    interners: Interners | None = None,
) -> Part:
    """Stream-decode ``source`` into columns, strictly (no recovery, no whole-document
    fallback): used on stretches of one file parsed side by side (``trace.split``).

    Args:
        base: the file offset of the source's first byte, so damage is located in the file.
        interners: shared with the other stretches of the file (see ``Interners``).

    Raises:
        TraceError: the JSON is damaged.
        Unstreamable: a layout only the whole-document path reads.
    """
    chunk = chunk or CHUNK_BYTES
    with _gc_paused(), ByteStream(source, block=chunk) as stream:
        return _StreamParser(source, stream, False, progress, chunk, base, interners).read()


def parse_events(data: bytes, name: str, *, recover: bool = False) -> ParsedTrace:
    """Decode one trace's bytes (plain or gzip) into an events table, flows and metadata."""
    return parse_source(Source.from_bytes(name, data), recover=recover)
