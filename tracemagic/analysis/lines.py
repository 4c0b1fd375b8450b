"""``lines()``: the figures of each line of a ``%%chakra_trace`` cell, from its line marks.

The magic runs each statement of the cell under a ``tracemagic.line:N`` annotation
(``capture.loop.mark_lines``); every op, kernel and allocation beneath one belongs to line N.
A compound statement's mark (``for``, ``if``, ``with`` ...) encloses its inner lines', so a
line's inclusive figures hold its nested lines' and its ``self_`` ones do not.

Work autograd's threads do while a line runs belongs to that line too: on a GPU, autograd runs
``loss.backward()``'s ops (and launches their kernels) on a thread of its own
(``pt_autograd_0``; told by the backward it runs, since the trace does not always name it so)
while the cell's thread waits inside the line's mark, so an op, annotation or runtime call of
that thread is the line's whose mark holds its start (the innermost event of the marked thread
at that moment, as ``memory_holders`` places ``[memory]`` events). Other threads (a
DataLoader's pin-memory thread) run on their own: no line's (see ``waited_in``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from tracemagic.analysis import aggregate
from tracemagic.analysis._common import enclosing_at, in_scope, memory_holders, thread_keys_of, union_length
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.analysis.steps import steps
from tracemagic.trace.kineto import GPU_ACTIVITY, LINE_MARK_PREFIX, line_of_mark
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import enclosing_of_kind, propagate


def cell_lines(trace: TraceTables) -> dict[int, str]:
    """The cell's text by line number as the notebook shows it (the ``%%chakra_trace`` line
    is line 1), from the manifest's ``cell``; empty without one."""
    manifest = trace.manifest or {}
    cell = manifest.get("cell")
    if not isinstance(cell, str):
        return {}
    return {number: text for number, text in enumerate(cell.splitlines(), start=2)}


#: the most characters of a line's text a label shows
LABEL_CHARS = 60


def line_label(number: int, text: str) -> str:
    """``line 7 `loss = model(x)``` (the text shortened), ``line 7`` without it: how views,
    sites and the call tree name a cell line."""
    text = text.strip()
    if len(text) > LABEL_CHARS:
        text = text[: LABEL_CHARS - 1] + "…"
    return f"line {number} `{text}`" if text else f"line {number}"


def mark_names(names: pd.Series, texts: Mapping[int, str]) -> pd.Series:
    """``names`` (a categorical column of event names) with each line mark
    ``tracemagic.line:N`` named as the other views name its line (``line_label``: ``line 7
    `loss = model(x)```; ``texts``: ``cell_lines``); other names, and a column where a label
    would take an existing name, unchanged. Renames categories only: no per-row work."""
    categories = names.cat.categories
    renamed = {
        name: line_label(number, texts.get(number, ""))
        for name in map(str, categories)
        if name.startswith(LINE_MARK_PREFIX) and (number := line_of_mark(name)) is not None
    }
    if not renamed or not set(renamed.values()).isdisjoint(map(str, categories)):
        return names
    return names.cat.rename_categories(lambda name: renamed.get(str(name), name))


def marks(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """The line mark events of the trace: (per events row, the cell line of the innermost
    line mark enclosing it, itself included, or for a thread without marks holding its start
    (see the module's docstring), -1 for none; the mark rows). Computed once per trace;
    read-only (shared by every analysis)."""
    line, rows, _ = _marks(trace)
    return line, rows


def _marks(trace: TraceTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`marks` and, per events row, the row of that innermost line mark (-1 for none)."""

    def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        events = trace.events
        names = events["name"]
        categories = names.cat.categories
        numbers = np.full(len(categories) + 1, -1, dtype=np.int64)
        for code, name in enumerate(categories.tolist()):
            text = str(name)
            if text.startswith(LINE_MARK_PREFIX) and (number := line_of_mark(text)) is not None:
                numbers[code] = number  # (a number out of range is no mark: the loader warned)
        # a trace without marks (not a %%chakra_trace capture) holds no per-event array:
        # -1 for every row, read-only, in no memory
        none = np.broadcast_to(np.array(-1, dtype=np.int64), (len(events),))
        if not (numbers >= 0).any():
            return none, np.zeros(0, dtype=np.int64), none
        line_of = numbers[names.cat.codes.to_numpy()]  # code -1 (missing) reads the last: -1
        is_mark = (line_of >= 0) & kind_mask(events, "user_annotation")
        rows = np.flatnonzero(is_mark)
        if not rows.size:
            return none, rows, none
        inner = propagate(events["parent"].to_numpy(), events["depth"].to_numpy(), is_mark)
        _other_threads(trace, inner, rows)
        return np.where(inner >= 0, line_of[np.maximum(inner, 0)], -1), rows, inner

    return trace.shared(Shared.LINE_MARKS, compute)


def _other_threads(trace: TraceTables, inner: np.ndarray, mark_rows: np.ndarray) -> None:
    """Give the ops, annotations and runtime calls of autograd's threads (``waited_in``) the
    innermost mark of their rank's marked thread holding their start:
    ``inner`` (the innermost mark row above each row) is filled in place."""
    events = trace.events
    free = np.flatnonzero((inner < 0) & kind_mask(events, "cpu_op", "user_annotation", "runtime"))
    host = waited_in(trace, free, mark_rows)
    held = host >= 0
    inner[free[held]] = inner[host[held]]


#: the name torch gives autograd's device threads (``pt_autograd_0``), which run a backward
#: while the thread that called it waits
AUTOGRAD_THREAD = "pt_autograd_"


def waited_in(trace: TraceTables, rows: np.ndarray, mark_rows: np.ndarray | None = None) -> np.ndarray:
    """For CPU ``rows`` on threads without line marks that work for the cell (autograd's
    backward threads: ``_helper_threads``; every such thread where the trace names none):
    the innermost CPU event of their rank's marked thread (the one with the most marks)
    holding their start, where the cell waited for them; -1 for rows on other threads, of a
    rank without marks or at a moment that thread recorded nothing. A thread that runs on
    its own (a DataLoader's pin-memory thread) is no line's."""
    out = np.full(np.size(rows), -1, dtype=np.int64)
    if mark_rows is None:
        mark_rows = marks(trace)[1]
    if not mark_rows.size or not out.size:
        return out
    events = trace.events
    keys = thread_keys_of(trace)
    marked, counts = np.unique(keys[mark_rows], return_counts=True)
    rank = events["rank"].to_numpy()
    home: dict[int, int] = {}
    for key in marked[np.argsort(-counts, kind="stable")].tolist():
        home.setdefault(int(rank[mark_rows[np.argmax(keys[mark_rows] == key)]]), int(key))
    rows = np.asarray(rows, dtype=np.int64)
    target = np.full(rows.size, -1, dtype=np.int64)
    for r, key in home.items():
        target[rank[rows] == r] = key
    free = (target >= 0) & ~np.isin(keys[rows], marked) & np.isin(keys[rows], _helper_threads(trace, keys, rows))
    if free.any():
        out[free] = enclosing_at(trace, target[free], events["ts"].to_numpy()[rows[free]])
    return out


def _helper_threads(trace: TraceTables, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The thread keys among ``rows``' that work for the cell's thread: those that run
    autograd's backward (an op with a forward thread, ``Fwd thread id``: autograd's device
    threads, whatever name the trace gives them; Kineto may record ``pt_autograd_0`` as
    ``thread 571 (python3)``), those the trace names ``AUTOGRAD_THREAD…``, or all of a rank
    whose threads the trace does not name."""
    events = trace.events
    names = trace.meta.get("threads") or {}
    found, first = np.unique(keys[rows], return_index=True)
    at = rows[first]
    pid, tid, rank = events["pid"].to_numpy()[at], events["tid"].to_numpy()[at], events["rank"].to_numpy()[at]
    backward = set()
    if "fwd_tid" in events:
        runs = events["fwd_tid"].to_numpy(dtype=np.int64, na_value=0)[rows] > 0
        backward = set(np.unique(keys[rows][runs]).tolist())
    keep = []
    for key, p, t, r in zip(found.tolist(), pid, tid, rank.tolist()):
        named = names.get(r) or names.get(str(r)) or {}
        if key in backward or not named or AUTOGRAD_THREAD in str(named.get(f"{p}/{t}", "")):
            keep.append(key)
    return np.asarray(keep, dtype=np.int64)


def line_of_rows(trace: TraceTables, rows: np.ndarray) -> np.ndarray:
    """The cell line of the innermost line mark above each of ``rows`` (CPU events; GPU
    events by the op that launched them), -1 where none."""
    line, mark_rows = marks(trace)
    rows = np.asarray(rows, dtype=np.int64)
    if not mark_rows.size or not rows.size:
        return np.full(rows.size, -1, dtype=np.int64)
    events = trace.events
    gpu = kind_mask(events, *GPU_ACTIVITY)[rows]
    at = np.where(gpu, events["op"].to_numpy()[rows], rows)
    return np.where(at >= 0, line[np.maximum(at, 0)], -1)


@computes("lines")
def lines(trace: TraceTables) -> pd.DataFrame:
    """One row per marked cell line that ran in the counted steps, in line order.

    Figures are means per step over the steps the Overview counts (``steps()`` less the
    loop's exit, ``aggregate.loop_steps``). *Inclusive* figures hold the line's nested lines
    (the body of a ``for``/``if``/``with`` line); ``self_`` ones do not.

    Columns: ``line`` (in the cell, the ``%%chakra_trace`` line is 1); ``text`` (the line as
    written, empty without the manifest's cell); ``parent_line`` (the enclosing statement's
    line, -1 at top level); ``calls`` (the line's runs per step: its outermost marks);
    ``cpu_us`` (the union of the line's mark intervals: host wall time, like an op's total
    CPU time; ``steps()`` counts it as host work, CPU or above, never idle); ``self_cpu_us``
    (less its nested lines' marks); ``gpu_us`` (the summed durations of the kernels,
    memcpy and memset launched by ops beneath the line, or by autograd's backward thread
    while it ran: the TensorBoard plugin's and ``key_averages``' device total, streams summed);
    ``self_gpu_us`` (those whose innermost line it is); ``step_pct`` (``cpu_us`` as % of the
    mean step, ``steps()``' ``window_dur``); ``alloc_bytes`` (bytes allocated beneath the
    line per step); ``peak_bytes`` (bytes allocated beneath the line, at any time, still
    live at the trace's memory peak: the highest ``allocated_bytes`` of a GPU if the trace
    has one, else of the CPU); ``self_peak_bytes`` (those of its own, not its nested lines).
    Empty (these columns) for traces without line marks; ``df.attrs['steps']`` is the
    number of steps averaged over, ``df.attrs['step_us']`` the mean step.
    """
    columns = TABLES["lines"].names
    line_of, mark_rows = marks(trace)
    if not mark_rows.size:
        return TABLES["lines"].empty()
    events = trace.events
    counted = aggregate.loop_steps(trace.table(steps), trace.manifest)
    step_ids = np.unique(counted["step"].to_numpy()) if not counted.empty else np.zeros(0, dtype=np.int64)
    n_steps = max(int(step_ids.size), 1)
    step_us = float(aggregate.step_means(counted)["step_us"])
    scoped = np.isin(events["step"].to_numpy(), step_ids) if step_ids.size else in_scope(events)

    parent = events["parent"].to_numpy()
    ts = events["ts"].to_numpy()
    dur = events["dur"].to_numpy()
    is_mark = np.zeros(len(events), dtype=bool)
    is_mark[mark_rows] = True
    rows = mark_rows[scoped[mark_rows]]
    if not rows.size:
        return TABLES["lines"].empty()
    up = enclosing_of_kind(parent, events["depth"].to_numpy(), is_mark, rows)  # the mark around each
    mark_line = line_of[rows]
    above = np.where(up >= 0, line_of[np.maximum(up, 0)], -1)
    numbers, index = np.unique(mark_line, return_inverse=True)
    k = numbers.size
    cpu = union_length(index, ts[rows], ts[rows] + dur[rows], k)
    outermost = above != mark_line  # a one-line compound holds marks of its own line
    calls = np.bincount(index[outermost], minlength=k)
    first = pd.Series(above[outermost]).groupby(index[outermost]).first().reindex(range(k), fill_value=-1).to_numpy()
    # self: the line's outermost marks less the marks of other lines right inside them
    inside_other = (above >= 0) & outermost & np.isin(above, numbers)
    holder = np.searchsorted(numbers, above[inside_other])
    self_cpu = np.bincount(index[outermost], weights=dur[rows][outermost], minlength=k)
    self_cpu -= np.bincount(holder, weights=dur[rows][inside_other], minlength=k)

    gpu, self_gpu = _gpu_time(trace, line_of, numbers, scoped)
    alloc, peak, self_peak = _memory(trace, line_of, numbers, scoped)
    texts = cell_lines(trace)
    table = pd.DataFrame(
        {
            "line": numbers.astype(np.int64),
            "text": pd.array([texts.get(int(n), "") for n in numbers], dtype="str"),
            "parent_line": first.astype(np.int64),
            "calls": calls / n_steps,
            "cpu_us": cpu / n_steps,
            "self_cpu_us": np.maximum(self_cpu, 0.0) / n_steps,
            "gpu_us": gpu / n_steps,
            "self_gpu_us": self_gpu / n_steps,
            "step_pct": cpu / n_steps / step_us * 100.0 if step_us > 0 else np.full(k, np.nan),
            "alloc_bytes": alloc / n_steps,
            "peak_bytes": peak,
            "self_peak_bytes": self_peak,
        }
    )[columns]
    table.attrs["steps"] = int(step_ids.size)
    table.attrs["step_us"] = step_us
    return table


def _chain_lines(trace: TraceTables, line_of: np.ndarray, at: np.ndarray, numbers: np.ndarray) -> list[np.ndarray]:
    """For CPU rows ``at``: the index in ``numbers`` of each line on their chain of marks,
    innermost first, one array per level (-1 past the chain's end; a line repeated by a
    one-line compound is given once)."""
    parent = trace.events["parent"].to_numpy()
    _, _, inner = _marks(trace)
    levels = []
    cur = np.where(at >= 0, inner[np.maximum(at, 0)], -1)
    last = np.full(at.size, -1, dtype=np.int64)
    while (cur >= 0).any():
        line = np.where(cur >= 0, line_of[np.maximum(cur, 0)], -1)
        index = np.where(line >= 0, np.searchsorted(numbers, line), -1)
        index = np.where((index >= 0) & (index < numbers.size), index, -1)
        hit = (index >= 0) & (line != last)
        levels.append(np.where(hit, index, -1))
        last = np.where(cur >= 0, line, last)
        up = parent[np.maximum(cur, 0)]
        cur = np.where((cur >= 0) & (up >= 0), inner[np.maximum(up, 0)], -1)
    return levels


def _gpu_time(
    trace: TraceTables, line_of: np.ndarray, numbers: np.ndarray, scoped: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per line: summed durations of the GPU work launched beneath it (inclusive, self)."""
    events = trace.events
    k = numbers.size
    rows = np.flatnonzero(kind_mask(events, *GPU_ACTIVITY) & scoped)
    if not rows.size:
        return np.zeros(k), np.zeros(k)
    op = events["op"].to_numpy()[rows]
    dur = events["dur"].to_numpy()[rows]
    levels = _chain_lines(trace, line_of, op, numbers)
    total, own = np.zeros(k), np.zeros(k)
    for depth, index in enumerate(levels):
        hit = index >= 0
        total += np.bincount(index[hit], weights=dur[hit], minlength=k)
        if depth == 0:
            own += np.bincount(index[hit], weights=dur[hit], minlength=k)
    return total, own


def _memory(
    trace: TraceTables, line_of: np.ndarray, numbers: np.ndarray, scoped: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per line: bytes allocated beneath it in the counted steps; bytes it allocated that are
    live at the memory peak (inclusive, self)."""
    from tracemagic.analysis.memory import memory

    k = numbers.size
    zeros = (np.zeros(k), np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64))
    rows, holder = memory_holders(trace)
    if not rows.size:
        return zeros
    table = trace.table(memory)
    if table.empty:
        return zeros
    holder_of = pd.Series(holder, index=rows)
    at = holder_of.reindex(table["row"].to_numpy()).fillna(-1).to_numpy(dtype=np.int64)
    levels = _chain_lines(trace, line_of, at, numbers)
    delta = table["delta_bytes"].to_numpy(dtype=np.int64)
    allocated = delta > 0
    in_steps = scoped[table["row"].to_numpy()]
    alloc = np.zeros(k)
    for index in levels:
        hit = (index >= 0) & allocated & in_steps
        alloc += np.bincount(index[hit], weights=delta[hit], minlength=k)
    live = _live_at_peak(table)
    peak, own = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    for depth, index in enumerate(levels):
        hit = (index >= 0) & live
        add = np.bincount(index[hit], weights=delta[hit], minlength=k).astype(np.int64)
        peak += add
        if depth == 0:
            own += add
    return alloc, peak, own


def _live_at_peak(table: pd.DataFrame) -> np.ndarray:
    """Per ``memory()`` row: an allocation still live at the trace's peak (the highest
    ``allocated_bytes`` of a GPU device if any, else of the CPU; rank 0's first)."""
    device = table["device"].astype(str).to_numpy()
    on_gpu = device != "cpu"
    scope = on_gpu if on_gpu.any() else np.ones(device.size, dtype=bool)
    values = np.where(scope, table["allocated_bytes"].to_numpy(dtype=np.int64), -1)
    at = int(np.argmax(values))
    where = (table["rank"].to_numpy() == table["rank"].iat[at]) & (device == device[at])
    peak_ts, peak_row = float(table["ts"].iat[at]), int(table["row"].iat[at])
    ts = table["ts"].to_numpy()
    row = table["row"].to_numpy()
    done = (ts < peak_ts) | ((ts == peak_ts) & (row <= peak_row))  # events up to the peak's, itself included
    delta = table["delta_bytes"].to_numpy(dtype=np.int64)
    addr = table["addr"].to_numpy(dtype=np.float64, na_value=np.nan)
    live = where & done & (delta > 0) & np.isfinite(addr)
    freed_keys = set(zip(table["rank"].to_numpy()[where & done & (delta < 0)], addr[where & done & (delta < 0)]))
    if not freed_keys:
        return live
    # an address freed after its allocation and before the peak is not live (addresses are reused:
    # the last allocation of an address before the peak is live unless a free follows it)
    order = np.lexsort((row, ts))
    last_alloc: dict[float, int] = {}
    for i in order:
        if not (where[i] and done[i]) or not np.isfinite(addr[i]):
            continue
        if delta[i] > 0:
            last_alloc[addr[i]] = i
        elif delta[i] < 0:
            last_alloc.pop(addr[i], None)
    out = np.zeros(live.size, dtype=bool)
    out[list(last_alloc.values())] = True
    return out & live
