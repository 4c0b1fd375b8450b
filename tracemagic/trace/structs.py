"""The pure-Python route of the parse: msgspec decodes a chunk of events into slotted
structs that keep only the fields the analyses use (``Event``; ``LooseEvent`` where fields
have unexpected types), and the tables of which columns are pulled out of them. The C
scanner (``_scan.c``) gives the same columns without them (``tests/test_scan.py``).
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

import msgspec

from tracemagic.errors import TraceError
from tracemagic.trace.jsonvalues import ODD_DURATIONS, _finite, _float_or_text, decode_or_repair

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
    call_stack: Any = msgspec.field(name="Call stack", default=None)
    kernel_file: Any = None
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
_ARG_STRINGS = ("collective", "pg_name", "dtype", "call_stack", "kernel_file")
#: the text columns of timed events, in the C scanner's order
_TEXT = ("ph", "cat", "name", "pid", "tid") + _ARG_STRINGS
_ARG_RAW = ("input_dims", "input_type", "concrete_inputs", "grid", "block", "pg_ranks")
_ARG_FIELDS = tuple(f for _, f, _ in _ARG_COLUMNS) + _ARG_STRINGS + _ARG_RAW + ("external_id_old",)
_ARG_GETTER = attrgetter(*_ARG_FIELDS)
_TIMED = frozenset(("X", "i", "I"))
_FLOWS = frozenset(("s", "f", "t"))


def decode_structs(data: Any, name: str, notes: list[str] | None = None, base: int = 0) -> list[Any]:
    """A JSON array of events -> msgspec structs: the typed fast path, else the loose one
    (values of unexpected types made readable, odd durations noted in ``notes``).

    Raises msgspec.DecodeError for malformed JSON (the caller locates it).
    """
    try:
        return decode_or_repair(_EVENTS, data, notes, base)
    except msgspec.ValidationError:
        pass
    try:
        events = decode_or_repair(_LOOSE_EVENTS, data, notes, base)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{name}: an event has an unreadable shape ({exc}).", path=name) from None
    odd_durations = 0
    first = ""
    for event in events:
        event.ph = event.ph if isinstance(event.ph, str) else str(event.ph)
        ts = _finite(event.ts)
        event.ts = ts if ts is not None else math.nan  # left out later, with a warning
        dur = _finite(event.dur)
        if dur is None and event.dur is not None:
            odd_durations += 1
            first = first or f"{event.name!r:.80} at ts {event.ts}"
        event.dur = dur or 0.0
        event.args = _loose_args(event.args)
    if odd_durations and notes is not None:  # joined for the file by ``merge_notes``
        notes.append(ODD_DURATIONS.format(count=odd_durations, base=base, first=first))
    return events


def _loose_args(value: Any) -> _Args:
    if not isinstance(value, dict):
        return _EMPTY_ARGS
    try:
        return _ONE_ARGS.decode(msgspec.json.encode(value))
    except (msgspec.ValidationError, msgspec.EncodeError, RecursionError, OverflowError):
        return _EMPTY_ARGS
