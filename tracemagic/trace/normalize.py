"""Make traces of every Kineto vintage look alike: one `kind` per event, µs, devices, ranks.

Old traces spell categories ``Operator``/``Runtime``/``Kernel``/``Memcpy``/``Memset`` and
write ``[memory]`` instants with no ``cat``; new ones use ``cpu_op``/``cuda_runtime``/...;
AMD traces call the runtime ``hip*``. All of them map to the kinds below.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pandas as pd

from tracemagic.trace.columns import lazy_zeros
from tracemagic.trace.kineto import (
    CATEGORY_KIND,
    GPU_KINDS,
    KINDS,
    LINE_MARK_MAX,
    LINE_MARK_PREFIX,
    STEP_NAME,
    STEP_PREFIX,
    line_of_mark,
)

try:  # the one-pass gathers in C (setup.py builds it where a compiler is found)
    from tracemagic.trace import _nesting
except ImportError:  # pragma: no cover - installed without a C compiler: numpy alone
    _nesting = None  # type: ignore[assignment]  # the callers test for None

#: the vocabulary (kinds, step names) is ``tracemagic.trace.kineto``'s; ``STEP_NAME`` is
#: used with ``match``: ``ProfilerStep#abc`` and the like stay the annotations they are
_INT64 = 2**63


def event_kinds(events: pd.DataFrame) -> tuple[pd.Categorical, list[str]]:
    """The normalized kind of every event (see ``KINDS``), and the names that look like a
    line mark's (``tracemagic.line:``) but name no line (``line_of_mark``: a number out of
    range, or none): those events keep the kind torch gave them."""
    cats = events["cat"].array
    lookup = np.array(
        [KINDS.index(CATEGORY_KIND.get(str(c).lower(), "other")) for c in cats.categories] + [KINDS.index("other")],
        dtype=np.int8,
    )
    codes = lookup.take(cats.codes)  # (-1, a missing cat: the last; ``take`` is ~2x faster than ``lookup[...]``)
    # per-name (and per-phase) answers, indexed by the codes (-1, a missing value: the last)
    names = events["name"].array
    name_codes = names.codes
    labels = [str(label) for label in names.categories.tolist()]
    if "[memory]" in labels:
        is_memory = per_category(np.array([label == "[memory]" for label in labels], dtype=bool), name_codes)
        is_memory &= per_code(events["ph"], lambda c: c != "X", True)
        codes[is_memory] = KINDS.index("memory")
    step_names = np.array(
        [label.startswith(STEP_PREFIX) and STEP_NAME.match(label) is not None for label in labels], dtype=bool
    )
    if step_names.any():
        is_step = per_category(step_names, name_codes)
        is_step &= (codes == KINDS.index("cpu_op")) | (codes == KINDS.index("user_annotation"))
        codes[is_step] = KINDS.index("step")
    mark_names = np.array([label.startswith(LINE_MARK_PREFIX) for label in labels], dtype=bool)
    odd_marks: list[str] = []
    if mark_names.any():  # the magic's line marks: recorded as cpu_op, annotations by what they mean
        for code in np.flatnonzero(mark_names).tolist():
            if line_of_mark(labels[code]) is None:
                mark_names[code] = False
                odd_marks.append(labels[code])
        is_mark = per_category(mark_names, name_codes)
        is_mark &= codes == KINDS.index("cpu_op")
        codes[is_mark] = KINDS.index("user_annotation")
    # (codes are KINDS indices by construction: not validated again)
    return pd.Categorical.from_codes(codes, categories=pd.Index(KINDS, dtype="str"), validate=False), odd_marks


def odd_marks_warning(source: str, names: list[str]) -> str:
    """The warning for the event names of ``source`` that look like line marks but name no
    line (``event_kinds``), a few of them shown (each cut to 60 characters)."""
    shown = ", ".join(repr(n if len(n) <= 60 else n[:57] + "...") for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"{source}: {len(names)} event names look like line marks but name no cell line (0 .. {LINE_MARK_MAX}): "
        f"{shown}{more}; read as the events they are, not as line marks"
    )


def per_code(column: pd.Series, test: Any, missing: bool) -> np.ndarray:
    """``test`` of each value of a categorical column, decided once per category (``missing``
    for a missing value)."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        return np.asarray(test(column.to_numpy()), dtype=bool)
    values = column.array  # (``.cat.codes`` copies the codes: read off the array)
    return per_category(np.asarray(test(values.categories), dtype=bool), values.codes, missing)


#: ``per_category`` compares the codes with at most this many categories rather than gather
_FEW_CATEGORIES = 8


def per_category(answers: np.ndarray, codes: np.ndarray, missing: bool = False) -> np.ndarray:
    """Per row, the answer of its category: ``answers`` (one per category) indexed by a
    categorical's ``codes``, ``missing`` where the code is -1 (a missing value).

    Where few categories answer True (or few False), by comparing the codes with each of
    them: a gather first widens the codes (int8 or int16) to 64 bits, ~10x slower."""
    hits = np.flatnonzero(answers)
    invert = hits.size > answers.size - hits.size  # the fewer side: its rows are compared
    if invert:
        hits = np.flatnonzero(~np.asarray(answers, dtype=bool))
    if hits.size > _FEW_CATEGORIES:
        return _gathered(answers, codes, missing)
    # Python ints: compared in the codes' own width (a numpy int64 would widen them first)
    compared = hits.tolist()
    out = codes == compared[0] if compared else np.zeros(codes.shape, dtype=bool)
    for code in compared[1:]:
        out |= codes == code
    if missing != invert:  # the missing rows' answer is the compared side's
        out |= codes < 0
    return ~out if invert else out


def _gathered(answers: np.ndarray, codes: np.ndarray, missing: bool) -> np.ndarray:
    """``per_category`` by a gather: one C pass over the codes in their own width
    (``_nesting.recode``) where the extension is built, else numpy's ``take`` (which widens
    them first; ~2x faster than indexing; -1 takes the last entry, ``missing``)."""
    if _nesting is not None and codes.flags.c_contiguous and codes.dtype.kind == "i":
        out = np.empty(codes.size, dtype=np.uint8)
        table = np.append(np.asarray(answers, dtype=np.int64), int(missing))  # the last entry: code -1
        if _nesting.recode(codes, codes.itemsize, table, out, 1):
            return out.view(bool).reshape(codes.shape)
    return np.append(answers, missing).take(codes)


def _kind_per_category(events: pd.DataFrame) -> np.ndarray:
    """The ``KINDS`` index of each category of ``events['kind']`` (unknown ones are
    ``other``), then -1 for a missing kind: indexed by the column's codes."""
    return _kinds_of(tuple(events["kind"].array.categories))


@functools.lru_cache(maxsize=32)
def _kinds_of(categories: tuple[str, ...]) -> np.ndarray:
    lookup = np.array([KINDS.index(str(c) if str(c) in KINDS else "other") for c in categories] + [-1], dtype=np.int8)
    lookup.flags.writeable = False  # shared by every caller
    return lookup


def kind_codes(events: pd.DataFrame) -> np.ndarray:
    """Every event's kind as its index in ``KINDS`` (no strings materialized)."""
    return _kind_per_category(events)[events["kind"].cat.codes.to_numpy()]


def kind_mask(events: pd.DataFrame, *kinds: str) -> np.ndarray:
    """Boolean mask of the events whose kind is one of ``kinds``, decided once per category
    (``per_category``). Called ~20 times a table: kept lean (no ``np.isin`` of a few
    categories, the codes read without pandas' accessor)."""
    wanted = {KINDS.index(k) for k in kinds}
    answers = np.array([kind in wanted for kind in _kind_per_category(events)[:-1].tolist()], dtype=bool)
    return per_category(answers, events["kind"].array.codes)


def without_timeless(table: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """``table`` without its rows that have no timestamp (``ts`` missing or not a finite
    number: such an event cannot be placed in time, nor nested, nor put in a step), and
    how many were left out."""
    timed = np.isfinite(table["ts"].to_numpy())
    dropped = int(timed.size - np.count_nonzero(timed))
    if not dropped:
        return table, 0
    return table[timed].reset_index(drop=True), dropped


def without_negative_durations(table: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """``table`` without its rows whose ``dur`` is negative, and how many were left out of
    each kind, in ``KINDS`` order (none left out: an empty dict, and ``table`` itself).

    torch >= 2.7 writes ``dur: -1`` for a CPU event still running when the profiler stopped
    (pytorch/pytorch#150131), and its own tables (``key_averages``) leave such events out; a
    clock glitch gives a GPU event a negative duration. Either has no end to place it by:
    kept, it would count as a call of negative time (and a negative GPU time in the tables).
    One pass over ``dur`` (a missing one, NaN, is not negative)."""
    negative = table["dur"].to_numpy() < 0
    if not negative.any():
        return table, {}
    kinds = table["kind"].array
    counts = np.bincount(kinds.codes[negative] + 1, minlength=len(kinds.categories) + 1).tolist()
    names = ["no kind", *map(str, kinds.categories)]  # (code -1: a missing kind)
    dropped = {name: count for name, count in zip(names, counts) if count}
    np.logical_not(negative, out=negative)
    return table[negative].reset_index(drop=True), dropped


def timestamps_in_ns(ts: np.ndarray) -> bool:
    """Whether timestamps are nanoseconds (µs epoch times are ~1.7e15; ns ones ~1.7e18)."""
    finite = ts if np.isfinite(ts).all() else ts[np.isfinite(ts)]
    # fewer than half above 1e17: the median is not (counted, not sorted: the usual µs case);
    # none at all: no median (numpy would warn of an empty slice)
    if finite.size == 0 or np.count_nonzero(finite > 1e17) < (finite.size + 1) // 2:
        return False
    return float(np.median(finite)) > 1e17


def _number(text: Any) -> int | None:
    try:
        number = int(str(text).split()[-1], 0)
    except (ValueError, IndexError):
        return None
    return number if -_INT64 <= number < _INT64 else None


def device_and_stream(events: pd.DataFrame) -> dict[str, Any]:
    """The ``device`` and ``stream`` columns filled in, those that change (by name): GPU
    events without ``device``/``stream`` args take them from pid/tid ('stream 7');
    ``[memory]`` events take their ``Device Id`` (CUDA memory has its device in traces with
    no GPU activity too: a CPU-activity profile of a CUDA model)."""
    out: dict[str, Any] = {}
    memory = kind_mask(events, "memory")
    device = events["device"].array
    if memory.any():  # on the arrays: a Series' masked assignment aligns on the index (~4x slower)
        device = filled_where(device, events["device_id"].array, memory)
        out["device"] = device
    gpu = kind_mask(events, *GPU_KINDS)
    if not gpu.any():
        return out
    # a last entry, missing, for the events without a pid or tid (code -1)
    pid_numbers = pd.array([_number(c) for c in events["pid"].cat.categories] + [None], dtype="Int64")
    tid_numbers = pd.array([_number(c) for c in events["tid"].cat.categories] + [None], dtype="Int64")
    pid_codes = events["pid"].cat.codes.to_numpy()
    tid_codes = events["tid"].cat.codes.to_numpy()
    device = device.copy() if "device" not in out else device
    stream = events["stream"].array.copy()
    need_device = gpu & device.isna()
    device[need_device] = pid_numbers[pid_codes[need_device]]
    need_stream = gpu & stream.isna()
    stream[need_stream] = tid_numbers[tid_codes[need_stream]]
    out["device"] = device
    out["stream"] = stream
    return out


def metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """Top-level trace metadata with ``rank``, ``world_size`` and ``devices`` filled in."""
    out = dict(meta)
    dist = meta.get("distributedInfo")
    if isinstance(dist, dict):
        out["rank"] = _int_or_none(dist.get("rank"))
        out["world_size"] = _int_or_none(dist.get("world_size"))
        out["backend"] = dist.get("backend")
    props = meta.get("deviceProperties")
    devices = []
    if isinstance(props, list):
        for item in props:
            if isinstance(item, dict):
                devices.append(
                    {
                        "id": _int_or_none(item.get("id")),
                        "name": str(item.get("name") or "") or "unnamed GPU",
                        "memory_bytes": _int_or_none(item.get("totalGlobalMem")),
                        "sm_count": _int_or_none(item.get("numSms")),
                    }
                )
    out["devices"] = devices
    return out


def _int_or_none(value: Any) -> int | None:
    """An integer that fits int64, else None (also for text, inf and other JSON)."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if -_INT64 <= number < _INT64 else None


def filled_where(target: Any, source: Any, where: np.ndarray) -> Any:
    """A copy of the array ``target`` with ``source``'s values (missing ones included) where
    ``where`` is set. Where ``target`` is a nullable column with every value missing (as
    most args columns of a trace are), its values are lazily mapped zeros written at those
    rows alone (``lazy_zeros``), not a copy of the whole column: ~1000 page faults less a
    column of a 100 MB trace."""
    masked = isinstance(target, (pd.arrays.IntegerArray, pd.arrays.FloatingArray))
    if masked and type(source) is type(target) and source.dtype == target.dtype and target._mask.all():
        values = lazy_zeros(len(target), target._data.dtype, populate=True)
        np.copyto(values, source._data, where=where)  # (missing: zeros under the mask, as in target)
        mask = np.logical_not(where)
        mask |= source._mask
        return type(target)(values, mask)
    out = target.copy()
    out[where] = source[where]
    return out
