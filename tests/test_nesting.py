"""Nesting and what is built on it: each CPU event's parent and depth, self time (``ops()``,
torch's Self CPU), and call chains (``shapes()``, ``diff()``).

Expectations come from the raw JSON through a nesting written here (one stack per thread,
plain Python), never from the loader; self time is also checked against torch's own
``key_averages()`` on a trace captured here.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import tracemagic
from conftest import TRACES, make_cnn
from tracemagic.analysis._common import row_thread_key
from tracemagic.trace import parse, structure

#: the raw categories of events that run on a CPU thread and nest there
CPU_CATS = {
    "cpu_op",
    "operator",
    "user_annotation",
    "python_function",
    "python",
    "cuda_runtime",
    "cuda_driver",
    "runtime",
}
OP_CATS = {"cpu_op", "operator"}
GPU_CATS = {"kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset"}
#: the rule, written here again: a child ends at most 0.25 µs after its parent ends (float
#: error of epoch-µs times), starts at least half a nanosecond before the parent ends, or
#: starts with it (the longer one first)
TOLERANCE, MARGIN = 0.25, 0.0005
PYTHON_HEAVY = [
    "tracelens_normalization_layer_test.json.gz",  # 6,004 python_function frames
    "hta_control.json.gz",  # 75k events, integer µs: many 0 µs ops at another's end
    "kineto_worker0.1623143089861.pt.trace.json.gz",  # old category names
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",  # ns floats of epoch µs
]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


# -- the oracle: nesting from the raw JSON -----------------------------------------------------
def table_events(path: Path) -> list[dict[str, Any]]:
    """The events a trace's table holds (duration events and instants), in file order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return [e for e in events if e.get("ph") in ("X", "i")]


def is_cpu(e: dict[str, Any]) -> bool:
    return e["ph"] == "X" and str(e.get("cat", "")).lower() in CPU_CATS


def oracle(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Parent (index into ``events``, -1 at the top and off the CPU), depth (-1 off the
    CPU) and self time (duration less the direct children's) of every event."""
    t0 = min(e["ts"] for e in events)
    n = len(events)
    parent, depth = [-1] * n, [-1] * n
    self_time = [float(e.get("dur", 0.0)) for e in events]
    threads: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if is_cpu(e):
            threads[(str(e["pid"]), str(e["tid"]))].append(i)
    for rows in threads.values():
        start = {i: events[i]["ts"] - t0 for i in rows}
        end = {i: start[i] + events[i]["dur"] for i in rows}
        rows.sort(key=lambda i: (start[i], -events[i]["dur"], i))
        stack: list[int] = []
        for i in rows:
            while stack:
                p = stack[-1]
                together = start[p] == start[i]
                inside = end[p] >= end[i] - TOLERANCE and end[p] - start[i] >= MARGIN
                if together or inside:
                    break
                stack.pop()
            if stack:
                parent[i] = stack[-1]
                depth[i] = depth[stack[-1]] + 1
                self_time[stack[-1]] -= events[i]["dur"]
            else:
                depth[i] = 0
            stack.append(i)
    return {"parent": parent, "depth": depth, "self": [max(s, 0.0) for s in self_time]}


def load_both(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, tracemagic.Trace]:
    """The trace nested in C and with numpy only."""
    fast = tracemagic.load(path, use_cache=False)
    with monkeypatch.context() as m:
        m.setattr(structure, "_nesting", None)
        m.setattr(parse, "_scan", None)
        slow = tracemagic.load(path, use_cache=False)
    assert structure._nesting is not None, "the C nesting is built (see test_scan.py)"
    return {"C": fast, "numpy": slow}


def assert_same_rows(trace: tracemagic.Trace, events: list[dict[str, Any]]) -> None:
    """The table's rows are the raw events in file order (so indices compare)."""
    table = trace.events
    assert len(table) == len(events)
    assert table["name"].astype(str).tolist() == [str(e.get("name", "")) for e in events]
    np.testing.assert_array_equal(table["ts"].to_numpy(), [e["ts"] for e in events])


# -- nesting ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PYTHON_HEAVY)
def test_nesting_of_real_traces_matches_the_raw_json(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = TRACES / name
    events = table_events(path)
    want = oracle(events)
    start = np.array([e["ts"] for e in events]) - min(e["ts"] for e in events)
    end = start + np.array([e.get("dur", 0.0) for e in events])
    for how, trace in load_both(path, monkeypatch).items():
        assert_same_rows(trace, events)
        parent = trace.events["parent"].to_numpy()
        depth = trace.events["depth"].to_numpy()
        wrong = np.flatnonzero(parent != np.array(want["parent"]))
        assert wrong.size == 0, f"{how}: {wrong.size} wrong parents, first at row {wrong[:1]}"
        np.testing.assert_array_equal(depth, want["depth"], err_msg=how)
        np.testing.assert_allclose(trace.events["self_dur"].to_numpy(), want["self"], atol=1e-6, err_msg=how)
        # never the child of an event that ended before (or as) it started
        child = np.flatnonzero(parent >= 0)
        up = parent[child]
        assert ((start[child] < end[up]) | (start[child] == start[up])).all(), how
    assert max(want["depth"]) > 3 and sum(p >= 0 for p in want["parent"]) > 1000


def nest_reference(
    thread: list[tuple[int, int]], ts: list[float], dur: list[float], cpu: list[bool], t0: float
) -> tuple[list[int], list[int], list[float], list[int]]:
    """``structure.nest``'s answer written again on plain Python floats, for any table:
    each thread's rows by (start, longest first, row), NaN last as numpy sorts, threads by
    ``thread`` (the pid and tid codes); then one stack per thread. A row's parent is the
    previous row where both start together, else the innermost open row that ends no
    earlier than the later of (its end - TOLERANCE, its start + MARGIN) (a comparison with
    NaN is false: such rows enclose nothing, and nothing encloses them); self time is the
    duration less the children's, summed in walk order, at least +0.0 (NaN kept)."""
    n = len(ts)
    parent, depth, child = [-1] * n, [-1] * n, [0.0] * n
    rows_of: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in range(n):
        if cpu[i]:
            rows_of[thread[i]].append(i)

    def nan_last(x: float) -> tuple[bool, float]:
        return (x != x, 0.0 if x != x else x)

    walked: list[int] = []
    for key in sorted(rows_of):
        rows = sorted(rows_of[key], key=lambda i: (nan_last(ts[i]), nan_last(-dur[i]), i))
        stack: list[int] = []
        for i in rows:
            start = ts[i] - t0
            end = start + dur[i]
            if not (stack and ts[stack[-1]] - t0 == start):
                target = end - TOLERANCE
                if start + MARGIN > target:
                    target = start + MARGIN
                while stack and not (ts[stack[-1]] - t0 + dur[stack[-1]] >= target):
                    stack.pop()
            if stack:
                parent[i], depth[i] = stack[-1], depth[stack[-1]] + 1
                child[stack[-1]] += dur[i]
            else:
                depth[i] = 0
            stack.append(i)
        walked += rows
    own = [dur[i] - child[i] if cpu[i] else dur[i] for i in range(n)]
    self_time = [x if not cpu[i] or x > 0.0 or x != x else 0.0 for i, x in enumerate(own)]
    return parent, depth, self_time, walked


def many_threads_table(
    rng: np.random.Generator, n: int, pids: int, tids: int, nans: bool, span: float = 400.0
) -> pd.DataFrame:
    """An events table of ``pids * tids`` threads in file order (starts nearly sorted, some
    out of order): nests with ends a little past their parent's, ties of start (and of
    duration), zero, -0.0 and negative durations, short events at or 1 ns before another's
    end, NaN starts and durations (``nans``), starts within ``span`` µs, instants and GPU kernels between them."""
    from tracemagic.trace.kineto import KINDS

    ts = np.sort(np.round(rng.uniform(0, span, n), 1)) + rng.choice([0.0] * 8 + [3.0, -4.0], n)
    dur = np.round(rng.exponential(8, n), 1) * (rng.random(n) > 0.1) + rng.choice([0.0, 0.1, 0.2, 0.3], n)
    short = rng.random(n) < 0.2
    earlier = rng.integers(0, n, n)
    ts = np.where(short, ts[earlier] + dur[earlier] - rng.choice([0.0, 0.001], n), ts)
    dur = np.where(short, rng.choice([0.0, 0.05, 0.2], n), dur)
    dur[rng.random(n) < 0.02] = -0.0
    dur[rng.random(n) < 0.01] = -1.0
    if nans:
        ts[rng.random(n) < 0.01] = np.nan
        dur[rng.random(n) < 0.02] = np.nan
    kinds = rng.choice(["cpu_op", "python_function", "user_annotation", "runtime", "kernel", "memory"], n)
    return pd.DataFrame(
        {
            "ph": pd.Categorical(rng.choice(["X", "X", "X", "i"], n)),
            "pid": pd.Categorical(rng.integers(0, pids, n).astype(str)),
            "tid": pd.Categorical(rng.integers(0, tids, n).astype(str)),
            "ts": 1_000_000.0 + ts,
            "dur": dur,
            "kind": pd.Categorical(kinds, categories=pd.Index(KINDS, dtype="str")),
        }
    )


def assert_bits(got: np.ndarray, want: list[Any], dtype: Any, what: str) -> None:
    """Equal values, dtype and bits (-0.0 is not 0.0)."""
    expected = np.array(want, dtype=dtype)
    assert got.dtype == expected.dtype, what
    np.testing.assert_array_equal(got, expected, err_msg=what)
    assert got.tobytes() == expected.tobytes(), what


@pytest.mark.parametrize("pids, tids", [(1, 1), (4, 4), (50, 20), (200, 20)])
def test_nesting_of_any_number_of_threads_matches_a_reference_walk(
    pids: int, tids: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to 4,000 threads (once the C code's limit was 256: it handed the sort to numpy):
    the C nesting equals the reference walk bit for bit, NaNs included; numpy's (no C
    extension) equals it where there is no NaN (a load never gives one: a missing ``dur``
    is read as 0, an event without ``ts`` is left out)."""
    rng = np.random.default_rng(pids * 1000 + tids)
    for nans in (True, False):
        events = many_threads_table(rng, 20_000, pids, tids, nans, span=400.0 if pids * tids < 100 else 40.0)
        cpu = (events["ph"] == "X") & events["kind"].isin(["cpu_op", "python_function", "user_annotation", "runtime"])
        thread = list(zip(events["pid"].cat.codes.tolist(), events["tid"].cat.codes.tolist()))
        ts, dur = events["ts"].tolist(), events["dur"].tolist()
        t0 = float(np.nanmin(events["ts"].to_numpy()))
        want = nest_reference(thread, ts, dur, cpu.tolist(), t0)
        assert len({thread[i] for i in want[3]}) > pids * tids * 0.9
        paths = ["C", "numpy"] if not nans else ["C"]
        for how in paths:
            with monkeypatch.context() as m:
                if how == "numpy":
                    m.setattr(structure, "_nesting", None)
                else:
                    assert structure._nesting is not None, "the C nesting is built (see test_scan.py)"
                parent, depth, self_dur, ordered = structure.nest(events, t0)
            assert_bits(parent, want[0], np.int64, f"{how}: parent")
            assert_bits(depth, want[1], np.int32, f"{how}: depth")
            assert_bits(self_dur, want[2], np.float64, f"{how}: self time")
            assert_bits(ordered, want[3], np.int64, f"{how}: order")
        assert max(want[1]) >= 3 and sum(p >= 0 for p in want[0]) > 500
        walked_self = [want[2][i] for i in want[3]]
        assert 0.0 in walked_self and not any(x < 0 for x in walked_self)  # clipped at +0.0


@pytest.mark.parametrize("pids, tids", [(1, 1), (4, 4), (200, 20)])
def test_the_c_thread_order_matches_a_reference_sort_and_numpys(
    pids: int, tids: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_nesting.order_rows`` (the order of a trace reopened from its cache, where no
    nesting walk hands it over) sorts the CPU duration rows as the reference walk does, NaNs
    included, and as numpy's ``structure.cpu_by_thread`` (its twin without the extension)."""
    from tracemagic.trace import _nesting
    from tracemagic.trace.kineto import CPU_KINDS

    rng = np.random.default_rng(pids * 7 + tids)
    for nans in (True, False):
        events = many_threads_table(rng, 20_000, pids, tids, nans, span=400.0 if pids * tids < 100 else 40.0)
        cpu = (events["ph"] == "X") & events["kind"].isin(["cpu_op", "python_function", "user_annotation", "runtime"])
        thread = list(zip(events["pid"].cat.codes.tolist(), events["tid"].cat.codes.tolist()))
        t0 = float(np.nanmin(events["ts"].to_numpy()))
        want = nest_reference(thread, events["ts"].tolist(), events["dur"].tolist(), cpu.tolist(), t0)[3]
        mask = structure.timed_mask(events, CPU_KINDS)
        ordered = np.empty(np.count_nonzero(mask), dtype=np.int64)
        _nesting.order_rows(
            mask.view(np.uint8),
            structure.thread_keys(events),
            events["ts"].to_numpy(),
            events["dur"].to_numpy(),
            ordered,
        )
        assert_bits(ordered, want, np.int64, f"C, nans={nans}")
        assert_bits(structure.cpu_by_thread(events), want, np.int64, f"numpy, nans={nans}")
    with pytest.raises(ValueError, match="order_rows"):  # buffers that disagree: refused, never read past
        _nesting.order_rows(
            mask.view(np.uint8),
            structure.thread_keys(events)[:-1],
            events["ts"].to_numpy(),
            events["dur"].to_numpy(),
            ordered,
        )
    with pytest.raises(ValueError, match="order_rows"):
        _nesting.order_rows(
            mask.view(np.uint8),
            structure.thread_keys(events),
            events["ts"].to_numpy(),
            events["dur"].to_numpy(),
            ordered[:-1],
        )


@pytest.mark.parametrize("name", ["hta_control.json.gz", "tracelens_normalization_layer_test.json.gz"])
def test_a_trace_reopened_from_its_cache_searches_the_order_a_load_walks(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh load hands its nesting walk's thread order to the analyses; a trace reopened
    from the cache sorts it again (in C, else numpy): the same rows, and the same tables."""
    from tracemagic.analysis import _common
    from tracemagic.trace.shared_keys import Shared

    fresh = tracemagic.load(TRACES / name, use_cache=False)
    walked = fresh.shared(Shared.CPU_BY_THREAD, lambda: None)
    assert walked is not None and walked.size > 1000
    tracemagic.load(TRACES / name)  # (writes the cache entry when dropped)
    for how in ("C", "numpy"):
        with monkeypatch.context() as m:
            m.setenv("TRACEMAGIC_TABLE_CACHE", "0")
            if how == "numpy":
                m.setattr(structure, "_nesting", None)
            reopened = tracemagic.load(TRACES / name)
            assert Shared.CPU_BY_THREAD not in reopened._shared, "reopened, not parsed"
            np.testing.assert_array_equal(_common.thread_order(reopened), walked, err_msg=how)
            for table in ("layers", "memory"):
                pd.testing.assert_frame_equal(getattr(reopened, table)(), getattr(fresh, table)(), check_exact=True)


def test_loading_a_thousand_threads_matches_the_raw_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace of 1,000 threads (50 pids, 20 tids each), nests with ties, zero durations and
    short events at another's end, rows out of order: both loads nest it as the raw JSON
    says, and the C and numpy loads agree bit for bit."""
    rng = np.random.default_rng(1000)
    table = many_threads_table(rng, 30_000, 50, 20, nans=False)
    cats = dict(zip(["cpu_op", "python_function", "user_annotation"], ["cpu_op", "python_function", "user_annotation"]))
    cats.update(runtime="cuda_runtime", kernel="kernel", memory="cpu_instant_event")
    raw = []
    for ph, pid, tid, ts, dur, kind in table[["ph", "pid", "tid", "ts", "dur", "kind"]].itertuples(index=False):
        event = {"ph": ph, "cat": cats[kind], "name": f"{kind}", "pid": int(pid), "tid": int(tid), "ts": ts, "args": {}}
        if ph == "X":
            event["dur"] = max(dur, 0.0)  # (negative durations: test above)
        elif kind != "memory":
            event["s"] = "t"
        raw.append(event)
    path = tmp_path / "threads.json"
    path.write_text(json.dumps({"traceEvents": raw}))
    events = table_events(path)
    want = oracle(events)
    loaded = load_both(path, monkeypatch)
    for how, trace in loaded.items():
        assert_same_rows(trace, events)
        np.testing.assert_array_equal(trace.events["parent"].to_numpy(), want["parent"], err_msg=how)
        np.testing.assert_array_equal(trace.events["depth"].to_numpy(), want["depth"], err_msg=how)
        np.testing.assert_allclose(trace.events["self_dur"].to_numpy(), want["self"], atol=1e-6, err_msg=how)
    for column in ("parent", "depth", "self_dur"):
        assert loaded["C"].events[column].to_numpy().tobytes() == loaded["numpy"].events[column].to_numpy().tobytes()
    assert len({(e["pid"], e["tid"]) for e in events if is_cpu(e)}) == 1000
    assert max(want["depth"]) >= 3
    # the bisections over the thread order read one row's key at a time: the same keys
    for ranked in (loaded["C"].events, loaded["C"].events.assign(rank=np.int32(5))):
        keys, key_of = structure.thread_keys(ranked), row_thread_key(ranked)
        assert [key_of(row) for row in range(len(keys))] == keys.tolist()


OUT_OF_MEMORY = """
import resource, sys
import numpy as np
from tracemagic.trace import _nesting
m = 2_000_000
mask, keys = np.ones(m, dtype=np.uint8), np.arange(m, dtype=np.int64)[::-1].copy()  # all distinct
ts, dur, self_dur = np.zeros(m), np.ones(m), np.empty(m)
ordered, parent, depth = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int32)
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (int(sys.argv[1]) << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    _nesting.nest_rows(mask, keys, ts, dur, 0.0, 0.25, 0.0005, ordered, parent, depth, self_dur)
    print("nested", (depth == 0).all())
except MemoryError:
    print("MemoryError")
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space size from /proc")
def test_the_c_nesting_out_of_memory_raises_memory_error() -> None:
    """2 million rows of as many threads under an address-space limit: the C nesting raises
    ``MemoryError`` where its scratch (4 MiB more allowed) or its growing table of threads
    (64 MiB: the scratch fits) cannot be had, never crashes, and nests them given room."""
    import subprocess
    import sys

    for headroom, want in ((4, "MemoryError"), (64, "MemoryError"), (1024, "nested True")):
        command = [sys.executable, "-c", OUT_OF_MEMORY, str(headroom)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == want, (headroom, done.stdout, done.stderr)


def write_trace(path: Path, spans: list[tuple[str, float, float]]) -> Path:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": 1_000.0 + ts, "dur": dur, "args": {}}
        for name, ts, dur in spans
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_short_event_right_after_a_sibling_is_not_its_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A [0, 10) then B [10, 10.5); I [20, 30) then J [30, 30.1), shorter than the tolerance
    (it used to nest in I); E ending 0.2 µs after A's end (rounding: still A's child), D
    starting 1 ns before A's end, inside E; a 0 µs chain starting together (F > G) and H, 0 µs at
    A's end, which starts with B."""
    spans = [
        ("A", 0.0, 10.0),
        ("B", 10.0, 0.5),
        ("D", 9.999, 0.2),
        ("E", 9.0, 1.2),
        ("F", 3.0, 0.0),
        ("G", 3.0, 0.0),
        ("H", 10.0, 0.0),
        ("I", 20.0, 10.0),
        ("J", 30.0, 0.1),
    ]
    path = write_trace(tmp_path / "siblings.json", spans)
    want = {"A": None, "B": None, "D": "E", "E": "A", "F": "A", "G": "F", "H": "B", "I": None, "J": None}
    for how, trace in load_both(path, monkeypatch).items():
        table = trace.events
        names = table["name"].astype(str).tolist()
        got = {names[i]: (names[p] if p >= 0 else None) for i, p in enumerate(table["parent"])}
        assert got == want, how
        assert dict(zip(names, table["depth"].tolist())) == {
            "A": 0,
            "B": 0,
            "D": 2,
            "E": 1,
            "F": 1,
            "G": 2,
            "H": 1,
            "I": 0,
            "J": 0,
        }, how
        selfs = dict(zip(names, table["self_dur"]))
        assert (
            selfs["A"] == pytest.approx(8.8) and selfs["B"] == pytest.approx(0.5) and selfs["I"] == pytest.approx(10.0)
        ), how


def test_memory_instant_at_an_ops_end_belongs_to_what_follows(tmp_path: Path) -> None:
    """enclosing_at, the instants' nesting: an allocation at the end of an op is not in it."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "outer", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "first", "pid": 1, "tid": 1, "ts": 10.0, "dur": 10.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "empty", "pid": 1, "tid": 1, "ts": 30.0, "dur": 0.0, "args": {}},
    ]
    for at in (15.0, 20.0, 30.0, 100.0):
        events.append(
            {
                "ph": "i",
                "s": "t",
                "cat": "cpu_instant_event",
                "name": "[memory]",
                "pid": 1,
                "tid": 1,
                "ts": at,
                "args": {
                    "Bytes": 64,
                    "Total Allocated": 64,
                    "Total Reserved": 64,
                    "Device Type": 0,
                    "Device Id": -1,
                    "Addr": 1,
                },
            }
        )
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = tracemagic.load(path, use_cache=False)
    table = trace.memory()
    assert [None if op != op else str(op) for op in table["op"]] == ["first", "outer", "empty", None]


# -- self time: torch's Self CPU ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three training steps of the small CNN with stacks (python_function frames), shapes
    and a record_function block around each step's work."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    model = make_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 1, 16, 16)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        for _ in range(3):
            with record_function("train_step"):
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
            prof.step()
    path = tmp_path_factory.mktemp("cnn") / "cnn.pt.trace.json"
    prof.export_chrome_trace(str(path))
    averages = {e.key: e for e in prof.key_averages()}
    return {"path": path, "averages": averages, "trace": tracemagic.load(path, use_cache=False)}


def test_self_time_is_torchs_self_cpu(cnn_trace: dict[str, Any]) -> None:
    """``ops()`` self time summed by name equals ``key_averages()``'s self CPU time (python
    frames are function events there and are subtracted like any child), and each row's
    equals the raw JSON's duration less its direct children's."""
    trace, averages = cnn_trace["trace"], cnn_trace["averages"]
    events = table_events(cnn_trace["path"])
    want = oracle(events)
    ops = trace.ops()
    np.testing.assert_allclose(ops["self_dur"].to_numpy(), np.array(want["self"])[ops["row"].to_numpy()], atol=1e-6)
    assert (ops["kind"] != "cpu_op").any() and any(e.get("cat") == "python_function" for e in events)
    ours = ops.assign(name=ops["name"].astype(str).str.replace(r"^ProfilerStep#\d+$", "ProfilerStep*", regex=True))
    by_name = ours.groupby("name")["self_dur"].sum()
    for name, total in by_name.items():
        assert total == pytest.approx(averages[name].self_cpu_time_total, rel=0.005, abs=3.0), name
    assert len(by_name) > 30
    # where python frames sit inside an op (the record_function block), they are subtracted
    block = ops[ops["name"] == "train_step"]
    assert (block["self_dur"] < 0.2 * block["dur"]).all()
    assert by_name["train_step"] == pytest.approx(averages["train_step"].self_cpu_time_total, rel=0.005, abs=3.0)


def test_an_op_nested_in_one_of_its_own_name_is_one_call_as_in_key_averages(cnn_trace: dict[str, Any]) -> None:
    """Issue 24.1: ``aten::div`` dispatching to ``aten::div`` (MeanBackward), ``aten::div_``
    and ``aten::sum`` likewise, are one call each in torch's ``key_averages()``, which folds
    an event that is the only CPU child of a parent of its own name into that parent
    (torch/autograd/profiler_util.py, ``EventList._remove_dup_nodes``; the TensorBoard plugin's
    ``op_tree.py`` does the same). The Operator table (``top_ops``), the text summary's top ops
    and ``ops()``'s ``merged`` column agree with ``key_averages()`` of the same profile."""
    from tracemagic.analysis.aggregate import top_ops
    from tracemagic.views import text

    trace, averages = cnn_trace["trace"], cnn_trace["averages"]
    events = table_events(cnn_trace["path"])
    want = oracle(events)
    children = Counter(p for p in want["parent"] if p >= 0)
    folded = {
        i
        for i, p in enumerate(want["parent"])
        if p >= 0
        and events[p].get("cat") == events[i].get("cat") == "cpu_op"
        and events[p]["name"] == events[i]["name"]
        and children[p] == 1
    }
    assert {events[i]["name"] for i in folded} >= {"aten::div", "aten::div_"}  # the shape the issue names
    ops = trace.ops()
    assert set(ops.loc[ops["merged"], "row"]) == folded
    table = top_ops(ops).set_index("name")
    assert len(table) > 30
    for name, row in table.iterrows():
        assert row["calls"] == averages[name].count, name
        assert row["total_us"] == pytest.approx(averages[name].cpu_time_total, rel=0.005, abs=3.0), name
        assert row["self_us"] == pytest.approx(averages[name].self_cpu_time_total, rel=0.005, abs=3.0), name
    summary = text.summary(trace, width=200, top=200)
    block = summary.split("Top ops (by self CPU time)\n")[1].split("\n\n")[0]
    for name in ("aten::div", "aten::div_", "aten::sum"):
        line = next(line for line in block.splitlines() if line.split()[0] == name)
        assert line.split()[1] == f"{averages[name].count:,}", line


# -- torch's counts under other profiler settings ---------------------------------------------
def _mlp(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _block_net() -> Any:
    """Five instances of one class (two attributes, a ModuleList of three), one called twice."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            y = self.lin(x)
            y.mul_(0.5).add_(1.0)  # in place
            return torch.relu(y)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Block(), Block()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x: Any) -> Any:
            x = self.b(self.a(x))
            for block in self.blocks:
                x = block(x)
            return self.a(x)

    torch.manual_seed(0)
    return Net()


def _models(name: str) -> tuple[Any, Any]:
    """Variant ``name``'s model and input, made before profiling (scripting one takes seconds
    under the profiler)."""
    import torch

    if name == "scripted":
        return torch.jit.script(_mlp()), torch.randn(8, 16)
    if name == "repeated modules":
        return _block_net(), torch.randn(4, 8)
    return _mlp(), torch.randn(64 if name == "intra-op threads" else 8, 16)


def _variant(name: str, prof: Any, model: Any, x: Any) -> None:
    """Run the steps of variant ``name`` under ``prof``."""
    import threading

    import torch
    from torch.profiler import record_function

    if name == "intra-op threads":  # two intra-op threads (restored by the caller)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            prof.step()
    elif name == "other threads":  # backward on a thread of its own, a second model on another
        other = _mlp(1)
        for _ in range(3):
            side = threading.Thread(target=lambda: [other(x).sum().backward() for _ in range(3)])
            side.start()
            loss = model(x).sum()
            backward = threading.Thread(target=loss.backward)
            backward.start()
            backward.join()
            side.join()
            prof.step()
    elif name == "ranges":  # nested ranges, and one open across each step's end
        handle = None
        for _ in range(3):
            with record_function("outer"):
                with record_function("inner"):
                    model(x)
                with record_function("inner"):
                    model(x).relu_()
            if handle is not None:
                torch.ops.profiler._record_function_exit._RecordFunction(handle)
            handle = torch.ops.profiler._record_function_enter_new("across", None)
            model(x)
            prof.step()
        torch.ops.profiler._record_function_exit._RecordFunction(handle)
    elif name == "bare inference":  # no shapes, stacks, modules; no_grad
        with torch.no_grad():
            for _ in range(3):
                model(x)
                prof.step()
    elif name == "allocations kept":  # one freed a step later, one never (the list holds it)
        kept, previous = [], None
        for _ in range(3):
            current = torch.randn(1000, 100)
            kept.append(torch.randn(500, 100))
            del previous
            previous = current
            model(x)
            prof.step()
    else:  # scripted, repeated modules
        for _ in range(3):
            model(x).sum().backward()
            prof.step()


VARIANTS = {
    "intra-op threads": {},
    "other threads": {"all_threads": True},
    "ranges": {},
    "bare inference": {"record_shapes": False, "with_stack": False, "with_modules": False},
    "scripted": {"with_modules": True},
    "repeated modules": {},
    "allocations kept": {},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small model's steps recorded under one of ``VARIANTS``' settings (by default with
    shapes, stacks and memory), with torch's ``key_averages()`` of the same profile."""
    import torch
    from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, schedule

    name = request.param
    options = dict(VARIANTS[name])
    all_threads = options.pop("all_threads", False)
    options = {"record_shapes": True, "with_stack": True, "profile_memory": True, **options}
    if all_threads:  # else the profiler records only the threads it was started on
        options["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    model, x = _models(name)
    threads = torch.get_num_threads()
    if name == "intra-op threads":
        torch.set_num_threads(2)
    try:
        with profile(
            activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=10), **options
        ) as prof:
            _variant(name, prof, model, x)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("variant") / "trace.json"
    prof.export_chrome_trace(str(path))
    return {
        "name": name,
        "path": path,
        "averages": {e.key: e for e in prof.key_averages()},
        "by_shape": prof.key_averages(group_by_input_shape=True),
        "trace": tracemagic.load(path, use_cache=False),
        "options": options,
    }


def test_ops_are_torchs_counts_under_other_profiler_settings(variant: dict[str, Any]) -> None:
    """Per op name, ``top_ops`` (the Operator table) has ``key_averages()``' calls, CPU total
    and self CPU; each row's self time is the raw JSON's duration less its direct children's,
    never below 0; annotations and steps have torch's call counts and, where torch's self CPU
    is not negative, its self time. Where it is (``ranges``: a ``record_function`` block's
    annotation begins in its ``__enter__`` frame and ends in its ``__exit__`` frame, both
    children of the enclosing range), the range's self time is 0, as the docstring says."""
    from tracemagic.analysis.aggregate import top_ops

    trace, averages = variant["trace"], variant["averages"]
    events = table_events(variant["path"])
    want = oracle(events)
    ops = trace.ops()
    np.testing.assert_allclose(ops["self_dur"].to_numpy(), np.array(want["self"])[ops["row"].to_numpy()], atol=1e-6)
    table = top_ops(ops).set_index("name")
    raw_ops = {e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "cpu_op"}
    assert set(table.index) == raw_ops - {n for n in raw_ops if n.startswith("ProfilerStep#")}
    for name, row in table.iterrows():
        assert row["calls"] == averages[name].count, name
        assert row["total_us"] == pytest.approx(averages[name].cpu_time_total, rel=0.005, abs=3.0), name
        assert row["self_us"] == pytest.approx(averages[name].self_cpu_time_total, rel=0.005, abs=3.0), name
    names = ops["name"].astype(str).str.replace(r"^ProfilerStep#\d+$", "ProfilerStep*", regex=True)
    ranges = ops[(ops["kind"] != "cpu_op").to_numpy()].groupby(names)["self_dur"].agg(["size", "sum"])
    assert "ProfilerStep*" in ranges.index
    for name, row in ranges.iterrows():
        torch_self = averages[name].self_cpu_time_total
        assert row["size"] == averages[name].count, name
        if torch_self >= 0:
            assert row["sum"] == pytest.approx(torch_self, rel=0.005, abs=3.0), name
        else:
            assert row["sum"] == 0.0, name
    if variant["name"] == "ranges":
        assert averages["outer"].self_cpu_time_total < 0 and ranges.loc["outer", "sum"] == 0.0
        assert ranges.loc["across", "size"] == 3  # each one starts in one step and ends in the next
    if variant["name"] == "other threads":  # the backward thread's ops and the side thread's are there
        assert ops["thread"].nunique() >= 3
        assert table.loc["aten::linear", "calls"] == 2 * 3 + 2 * 3 * 3


def test_steps_layers_and_memory_are_the_raw_jsons_under_other_profiler_settings(variant: dict[str, Any]) -> None:
    """``steps()`` has each ProfilerStep#N's duration; ``layers()`` one row per
    ``nn.Module: X_k`` of the JSON with its calls and (forward) time, where stacks were
    recorded; ``memory()`` each ``[memory]`` event's Total Allocated, ``memory_peaks()``
    each step's highest and the whole capture's."""
    trace = variant["trace"]
    events = table_events(variant["path"])
    marks = [e for e in events if e["ph"] == "X" and e["name"].startswith("ProfilerStep#")]
    steps = {int(e["name"].split("#")[1]): e for e in marks}
    table = trace.steps()
    want = {k: e["dur"] for k, e in steps.items()}
    assert dict(zip(table["step"].tolist(), table["dur"].tolist())) == pytest.approx(want)
    modules = [e for e in events if e.get("cat") == "python_function" and e["name"].startswith("nn.Module: ")]
    layers = trace.layers()
    assert bool(modules) == variant["options"]["with_stack"] == (not layers.empty)
    calls = Counter(e["name"] for e in modules)
    time: dict[str, float] = defaultdict(float)
    for e in modules:
        time[e["name"]] += e["dur"]
    assert dict(zip(layers["module"].astype(str), layers["calls"].tolist())) == calls
    for module, fwd in zip(layers["module"].astype(str), layers["fwd_cpu_us"]):
        assert fwd == pytest.approx(time[module], rel=1e-6, abs=1e-3), module
    if variant["name"] == "repeated modules":  # Block_0 (``a``) is called twice a step
        assert calls["nn.Module: Block_0"] == 6 and len(layers) == 11
    memory = [e for e in events if e["ph"] == "i" and e["name"] == "[memory]"]
    got = trace.memory().sort_values("row")
    assert got["allocated_bytes"].tolist() == [e["args"]["Total Allocated"] for e in memory]
    peaks = trace.memory_peaks()
    if not memory:
        assert peaks.empty
        return
    whole = peaks[peaks["step"].isna()]
    assert whole["peak_bytes"].tolist() == [max(e["args"]["Total Allocated"] for e in memory)]
    for number, step in steps.items():
        inside = [e for e in memory if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        row = peaks[peaks["step"] == number]
        if inside:
            assert row["peak_bytes"].tolist() == [max(e["args"]["Total Allocated"] for e in inside)], number


# -- call chains: shapes() and diff() -------------------------------------------------------------
def chain_oracle(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per call-chain top (index into ``events``): its key and the chain's self and GPU time.

    The top is the outermost op that records ``Input Dims`` or holds no op that does
    (wrappers around ops with shapes are no top); its chain is every op nested in it.
    """
    want = oracle(events)
    parent = want["parent"]
    ops = [
        i
        for i, e in enumerate(events)
        if e["ph"] == "X"
        and str(e.get("cat", "")).lower() in OP_CATS
        and not str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    shaped = {i for i in ops if "Input Dims" in events[i].get("args", {})}
    wrappers = set()
    for i in shaped:
        at = parent[i]
        while at >= 0:
            wrappers.add(at)
            at = parent[at]
    candidates = {i for i in ops if i in shaped or i not in wrappers}

    def top_of(i: int) -> int:
        found, at = -1, i
        while at >= 0:
            if at in candidates:
                found = at
            at = parent[at]
        return found

    chains: dict[int, dict[str, Any]] = {}
    for i in ops:
        top = top_of(i)
        if top < 0:
            continue
        if top not in chains:
            args = events[top].get("args", {})
            key = (
                events[top]["name"],
                *(json.dumps(args.get(k)) for k in ("Input Dims", "Input type", "Concrete Inputs")),
            )
            chains[top] = {"key": key, "dur": events[top]["dur"], "self": 0.0, "gpu": 0.0}
        chains[top]["self"] += want["self"][i]
    launched = {
        e["args"]["correlation"]: i
        for i, e in enumerate(events)
        if is_cpu(e)
        and str(e.get("cat")).lower() in ("cuda_runtime", "runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
    }
    for e in events:
        if (
            e["ph"] == "X"
            and str(e.get("cat", "")).lower() in GPU_CATS
            and e.get("args", {}).get("correlation") in launched
        ):
            runtime = launched[e["args"]["correlation"]]
            holder = parent[runtime]
            while holder >= 0 and holder not in chains:
                holder = parent[holder]
            if holder >= 0:
                chains[holder]["gpu"] += e["dur"]
    return chains


def table_key(row: Any) -> tuple[str, ...]:
    def canon(text: Any) -> str:
        return json.dumps(None if text is None or text != text else json.loads(text))

    return (row["name"], canon(row["input_dims"]), canon(row["input_type"]), canon(row["concrete_inputs"]))


@pytest.mark.parametrize("which", ["cnn", "resnet50"])
def test_shapes_and_diff_rows_are_call_chains(which: str, cnn_trace: dict[str, Any], tmp_path: Path) -> None:
    if which == "cnn":
        path, trace = cnn_trace["path"], cnn_trace["trace"]
    else:
        path = TRACES / "kineto_worker0.1623143089861.pt.trace.json.gz"
        trace = tracemagic.load(path, use_cache=False)
    events = table_events(path)
    chains = chain_oracle(events)
    want: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for chain in chains.values():
        row = want[chain["key"]]
        row[0] += 1
        row[1] += chain["dur"]
        row[2] += chain["self"]
        row[3] += chain["gpu"]
    df = trace.shapes()
    got = {table_key(r): [r["calls"], r["total_us"], r["self_us"], r["gpu_us"]] for _, r in df.iterrows()}
    assert len(got) == len(df) == len(want)
    assert set(got) == set(want)
    for key, (calls, total, self_us, gpu) in want.items():
        assert got[key][0] == calls, key
        assert got[key][1:] == pytest.approx([total, self_us, gpu], abs=1e-3), key
    assert df["total_us"].is_monotonic_decreasing
    # one convolution, one row: the op the model called, not the ops it runs
    names = set(df["name"].astype(str))
    assert "aten::conv2d" in names
    assert not names & {
        "aten::convolution",
        "aten::_convolution",
        "aten::mkldnn_convolution",
        "aten::cudnn_convolution",
    }
    convs = sum(1 for e in events if e.get("name") == "aten::conv2d")
    assert df.loc[df["name"] == "aten::conv2d", "calls"].sum() == convs > 0
    if which == "resnet50":
        assert df.loc[df["name"] == "aten::conv2d", "gpu_us"].sum() > 0
        assert df.loc[df["gpu_us"].idxmax(), "name"] in ("aten::conv2d", "CudnnConvolutionBackward")

    table = trace.diff(trace)
    op_rows = table[table["level"] == "op"].set_index("name")
    assert op_rows["calls_a"].to_dict() == dict(Counter(events[top]["name"] for top in chains))
    assert op_rows["us_a"].sum() == pytest.approx(sum(c["dur"] for c in chains.values()))
    assert op_rows["gpu_us_a"].sum() == pytest.approx(sum(c["gpu"] for c in chains.values()))


def test_shapes_are_torchs_counts_by_input_shape_under_other_profiler_settings(variant: dict[str, Any]) -> None:
    """``shapes()`` rows are the raw JSON's call chains; summed over their input types and
    concrete inputs, the rows of an op every call of which tops a chain (``aten::linear``,
    ``aten::randn``) have ``key_averages(group_by_input_shape=True)``'s calls and CPU total.
    ``torch.randn(1000, 100)`` and ``torch.randn(500, 100)`` are two rows (their concrete
    inputs differ) where torch has one (their input dims do not), as the docstring says."""
    trace = variant["trace"]
    if not variant["options"]["record_shapes"]:
        assert trace.shapes()["input_dims"].isna().all()
        return
    events = table_events(variant["path"])
    chains = chain_oracle(events)
    want: dict[tuple[str, ...], int] = Counter(chain["key"] for chain in chains.values())
    df = trace.shapes()
    assert {table_key(r): r["calls"] for _, r in df.iterrows()} == want
    torch_rows = {(e.key, json.dumps(e.input_shapes)): e for e in variant["by_shape"]}
    every: Counter[tuple[str, str]] = Counter(
        (e["name"], json.dumps(e["args"].get("Input Dims")))
        for e in events
        if e["ph"] == "X" and e.get("cat") == "cpu_op" and "Input Dims" in e.get("args", {})
    )
    df = df.assign(dims=[json.dumps(json.loads(d)) if isinstance(d, str) else "null" for d in df["input_dims"]])
    summed = df.groupby(["name", "dims"], observed=True)[["calls", "total_us"]].sum()
    checked = 0
    for (name, dims), row in summed.iterrows():
        if row["calls"] != every[(name, dims)]:
            continue  # some calls run inside another op's chain
        torch_row = torch_rows[(name, dims)]
        assert row["calls"] == torch_row.count, (name, dims)
        assert row["total_us"] == pytest.approx(torch_row.cpu_time_total, rel=0.005, abs=3.0), (name, dims)
        checked += 1 + (name in ("aten::linear", "aten::randn"))
    assert checked >= (1 if variant["name"] == "scripted" else 4)  # scripted: the linears run inside ``forward``
    if variant["name"] == "allocations kept":
        randn = df[df["name"] == "aten::randn"]
        assert len(randn) == 2 and randn["dims"].nunique() == 1 and randn["calls"].tolist() == [3, 3]
        assert torch_rows[("aten::randn", randn["dims"].iloc[0])].count == 6


def nested_spans(rng: np.random.Generator, lo: int, hi: int, level: int, out: list[tuple[int, int]]) -> None:
    """Properly nested integer spans (start, dur) inside [lo, hi): siblings side by side or
    apart, children starting with their parent or ending with it, 0 µs ones among them."""
    t = lo
    while t < hi and level < 6:
        if rng.random() < 0.3:
            t += int(rng.integers(1, 4))
            continue
        length = int(rng.integers(0, min(hi - t, 40) + 1))
        if t == lo and length == hi - lo:  # (not as long as the parent it starts with)
            length -= 1
        out.append((t, length))
        if length > 2:
            nested_spans(rng, t, t + length, level + 1, out)
        t += max(length, 1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_memory_events_are_held_by_the_innermost_event_containing_them(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memory()``'s op of every allocation, in a trace of 6 threads with deep nesting, 0 µs
    ops, ops side by side and allocations at their starts and ends, in shuffled file order:
    the event a plain search of the raw JSON finds (on the same thread, started at or before
    the moment and not ended by it, a 0 µs one at its start; the latest start, then the
    shortest), loaded with the C search and climb and with numpy's."""
    rng = np.random.default_rng(seed)
    spans: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    for thread in range(6):
        pid, tid = 1 + thread // 2, 10 + thread
        here: list[tuple[int, int]] = []
        nested_spans(rng, 0, 1_500, 0, here)
        moments = [t for s, d in here for t in (s, s + d)] + rng.integers(-5, 1_505, 200).tolist()
        where = {"pid": pid, "tid": tid}
        for start, dur in here:
            op = {"ph": "X", "cat": "cpu_op", "name": f"op{len(spans)}", "ts": 1_000.0 + start, "dur": float(dur)}
            spans.append({**op, **where, "args": {}})
        for at in moments:
            args = {"Bytes": len(memory) + 1, "Total Allocated": 64, "Total Reserved": 64, "Device Type": 0}
            alloc = {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "ts": 1_000.0 + at}
            memory.append({**alloc, **where, "args": {**args, "Device Id": -1, "Addr": 1}})
    events = spans + memory
    order = rng.permutation(len(events))
    shuffled = [events[i] for i in order]
    path = tmp_path / "held.json"
    path.write_text(json.dumps({"traceEvents": shuffled}))

    on_thread = defaultdict(list)
    for e in spans:
        on_thread[e["pid"], e["tid"]].append(e)

    def holder(alloc: dict[str, Any]) -> str | None:
        at, best = alloc["ts"], None
        for e in on_thread[alloc["pid"], alloc["tid"]]:
            if e["ts"] > at:
                continue
            holds = at < e["ts"] + e["dur"] or (e["dur"] == 0 and at == e["ts"])
            if holds and (best is None or (e["ts"], -e["dur"]) > (best["ts"], -best["dur"])):
                best = e
        return None if best is None else best["name"]

    want = {alloc["args"]["Bytes"]: holder(alloc) for alloc in memory}
    assert sum(v is None for v in want.values()) > 10 and len(set(want.values())) > 200
    for how, trace in load_both(path, monkeypatch).items():
        table = trace.memory()
        got = dict(zip(table["delta_bytes"].tolist(), [None if op != op else str(op) for op in table["op"]]))
        assert got == want, how


def test_the_c_search_of_enclosing_events_refuses_rows_outside_the_table() -> None:
    """``_nesting.enclosing_at`` on hostile buffers: candidates or parents outside the table,
    a cycle of parents and buffers of different lengths raise ``ValueError``, never read
    out of bounds; int32 and int64 candidate rows give the same answers."""
    from tracemagic.trace import _nesting

    ts, dur = np.array([0.0, 1.0, 2.0, 9.0]), np.array([10.0, 3.0, 0.5, 0.0])
    parent = np.array([-1, 0, 1, 0], dtype=np.int64)
    moments = np.array([2.2, 0.5, 9.0, 3.5, -1.0, 10.0, np.nan])
    for rows in (np.array([0, 1, 2, 3], dtype=np.int64), np.array([0, 1, 2, 3], dtype=np.int32)):
        out = np.empty(moments.size, dtype=np.int64)
        _nesting.enclosing_at(rows, rows.dtype == np.int64, ts, dur, parent, 0.0, MARGIN, moments, out)
        assert out.tolist() == [2, 0, 3, 1, -1, -1, 3], rows.dtype
    out = np.empty(moments.size, dtype=np.int64)
    three = np.array([0, 1, 2], dtype=np.int64)
    hostile = [
        (np.array([0, 7], dtype=np.int64), parent, moments, out),  # a candidate outside
        (np.array([0, -2], dtype=np.int64), parent, moments, out),
        (three, np.array([-1, 9, 1, 0], dtype=np.int64), moments, out),  # a parent outside
        (three, np.array([1, 0, 1, 0], dtype=np.int64), np.array([20.0]), out[:1]),  # a cycle
        (three[:2], parent[:3], moments, out),  # lengths
        (three[:2], parent, moments, out[:3]),
        (three[:2].tobytes() + b"x", parent, moments, out),
    ]
    for rows, up, at, into in hostile:
        with pytest.raises(ValueError, match="enclosing_at"):
            _nesting.enclosing_at(rows, True, ts, dur, up, 0.0, MARGIN, at, into)


@pytest.mark.parametrize("seed", [4, 5])
def test_call_chains_of_mixed_wrappers_and_shapes_match_the_raw_json(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shapes()`` of deep random nests of ops with and without ``Input Dims`` and of user
    annotations between them (on 3 threads): one row per chain key with its calls, total
    and self time as ``chain_oracle`` finds them in the raw JSON, with the C call chains
    (one pass) and with numpy's, which agree bit for bit."""
    rng = np.random.default_rng(seed)
    events: list[dict[str, Any]] = []
    for tid in (1, 2, 3):
        here: list[tuple[int, int]] = []
        nested_spans(rng, 0, 2_000, 0, here)
        for start, dur in here:
            cat = "user_annotation" if rng.random() < 0.2 else "cpu_op"
            args = {"Input Dims": [[int(rng.integers(1, 4))]], "Input type": ["float"]} if rng.random() < 0.4 else {}
            name = f"{cat[:2]}{int(rng.integers(0, 6))}"
            events.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": name,
                    "pid": 1,
                    "tid": tid,
                    "ts": 1_000.0 + start,
                    "dur": float(dur),
                    "args": args,
                }
            )
    path = tmp_path / "chains.json"
    path.write_text(json.dumps({"traceEvents": events}))
    chains = chain_oracle(events)
    want: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for chain in chains.values():
        row = want[chain["key"]]
        row[0] += 1
        row[1] += chain["dur"]
        row[2] += chain["self"]
    wrappers = sum(1 for top in chains if "Input Dims" not in events[top]["args"])
    assert len(want) > 20 and 0 < wrappers < len(chains)
    tables = {}
    for how, trace in load_both(path, monkeypatch).items():
        with monkeypatch.context() as m:
            if how == "numpy":
                m.setattr(structure, "_nesting", None)
            df = trace.shapes()
        got = {table_key(r): [r["calls"], r["total_us"], r["self_us"]] for _, r in df.iterrows()}
        assert set(got) == set(want), how
        for key, (calls, total, self_us) in want.items():
            assert got[key][0] == calls, (how, key)
            assert got[key][1:] == pytest.approx([total, self_us], abs=1e-3), (how, key)
        tables[how] = df
    pd.testing.assert_frame_equal(tables["C"], tables["numpy"])


def test_the_c_call_chains_refuse_rows_outside_the_table() -> None:
    """``_nesting.chain_tops`` on hostile buffers: op rows outside the table and buffers of
    different lengths raise ``ValueError``; parents outside the table end a climb and a
    cycle of parents ends, never reading out of bounds."""
    from tracemagic.trace import _nesting

    parent = np.array([-1, 0, 1, 1, 9], dtype=np.int64)  # row 4's parent is outside
    is_op = np.array([1, 1, 1, 1, 1], dtype=np.uint8)
    shaped = np.array([0, 0, 1, 0, 0], dtype=np.uint8)  # 0 holds 1 holds 2 (shaped): 0 and 1 are wrappers
    rows = np.arange(5, dtype=np.int64)
    out = np.empty(5, dtype=np.int64)
    _nesting.chain_tops(parent, is_op, shaped, rows, out)
    assert out.tolist() == [-1, -1, 2, 3, 4]
    cycle = np.array([1, 2, 0, 1, 3], dtype=np.int64)
    _nesting.chain_tops(cycle, is_op, shaped, rows, out)  # ends (the values are of no meaning)
    for bad in (
        (parent, is_op, shaped, np.array([0, 5], dtype=np.int64), out[:2]),
        (parent, is_op, shaped, np.array([-1], dtype=np.int64), out[:1]),
        (parent, is_op[:4], shaped, rows, out),
        (parent, is_op, shaped, rows, out[:4]),
        (parent[:4], is_op, shaped, rows, out),
    ):
        with pytest.raises(ValueError, match="chain_tops"):
            _nesting.chain_tops(*bad)


def test_the_c_outermost_anchor_refuses_buffers_of_other_lengths() -> None:
    """``_nesting.outermost``: each row's outermost anchor (itself included) up a nest, -1
    above none; parents outside the table end a climb, a cycle ends; buffers of different
    lengths raise ``ValueError``."""
    from tracemagic.trace import _nesting

    parent = np.array([-1, 0, 1, 2, 0, 17, -1], dtype=np.int64)
    anchor = np.array([0, 1, 0, 1, 0, 1, 0], dtype=np.uint8)
    out = np.empty(7, dtype=np.int64)
    _nesting.outermost(parent, anchor, out)
    assert out.tolist() == [-1, 1, 1, 1, -1, 5, -1]
    _nesting.outermost(np.array([1, 2, 0, 1, 3, 4, 5], dtype=np.int64), anchor, out)  # ends
    for bad in ((parent, anchor[:6], out), (parent, anchor, out[:6]), (parent[:6], anchor, out)):
        with pytest.raises(ValueError, match="outermost"):
            _nesting.outermost(*bad)


@pytest.mark.parametrize(
    "name", ["tracelens_normalization_layer_test.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"]
)
def test_layers_and_memory_are_the_same_with_the_c_walks_and_without(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``layers()``, ``memory()`` and ``shapes()`` of real traces (layers with backward time;
    12,838 allocations): the C
    walks (``enclosing_at``, ``outermost``, ``chain_tops``) give the tables numpy's give, to
    the bit (their values are checked against the raw JSON in test_analysis_*.py)."""
    tables = {}
    for how in ("C", "numpy"):
        with monkeypatch.context() as m:
            if how == "numpy":
                m.setattr(structure, "_nesting", None)
            trace = tracemagic.load(TRACES / name, use_cache=False)
            tables[how] = {table: getattr(trace, table)() for table in ("layers", "memory", "shapes")}
    assert structure._nesting is not None, "the C nesting is built (see test_scan.py)"
    assert (tables["C"]["layers"]["bwd_cpu_us"] > 0).any() or tables["C"]["memory"]["op"].notna().sum() > 8000
    assert len(tables["C"]["shapes"]) > 10
    for table, df in tables["C"].items():
        pd.testing.assert_frame_equal(df, tables["numpy"][table], check_exact=True, obj=table)
        assert df.attrs == tables["numpy"][table].attrs, table


def union_reference(group: list[int], start: list[float], end: list[float], groups: int) -> list[float]:
    """The union of each group's intervals [start, end), merged by hand: sorted by start,
    each run of overlapping intervals adds its span (plain Python)."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for g, s, e in zip(group, start, end):
        if e > s:
            spans[g].append((s, e))
    out = [0.0] * groups
    for g, mine in spans.items():
        mine.sort()
        lo, hi = mine[0]
        for s, e in mine[1:]:
            if s > hi:
                out[g] += hi - lo
                lo, hi = s, e
            else:
                hi = max(hi, e)
        out[g] += hi - lo
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_c_union_of_intervals_matches_a_merge_and_numpys(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_nesting.union_rows`` (``union_length`` for rows in (group, start) order, as
    ``steps()`` gives them): each group's union as a merge by hand computes it, and bit for
    bit numpy's (its twin without the extension), with nested, touching, empty, negative
    and NaN intervals; rows out of order, groups outside the output and infinite times are
    left to numpy, buffers of other lengths refused."""
    from tracemagic.analysis._common import union_length
    from tracemagic.trace import _nesting

    rng = np.random.default_rng(seed)
    n, groups = 20_000, 40
    group = np.sort(rng.integers(0, groups - 3, n))  # (some groups hold no row)
    start = np.round(rng.uniform(0, 500, n), 2)
    end = start + np.round(rng.exponential(3, n), 2) * rng.choice([1, 1, 1, 0, -1], n)
    end[rng.random(n) < 0.01] = np.nan
    order = np.lexsort((start, group))
    group, start, end = group[order], start[order], end[order]
    want = union_reference(group.tolist(), start.tolist(), end.tolist(), groups)
    for dtype in (np.int32, np.int64):
        g = group.astype(dtype)
        out = np.empty(groups)
        assert _nesting.union_rows(g, dtype == np.int64, start, end, out) is True
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-9)
        with monkeypatch.context() as m:
            m.setattr(structure, "_nesting", None)
            numpy_sums = union_length(g, start, end, groups)
        assert out.tobytes() == numpy_sums.tobytes(), dtype
        assert union_length(g, start, end, groups).tobytes() == out.tobytes()
    shuffled = rng.permutation(n)
    for g, s, e in ((group[shuffled], start[shuffled], end[shuffled]), (group + 5, start, end)):  # out of order, past
        assert _nesting.union_rows(g, True, s, e, np.empty(groups)) is False
        got = union_length(g, s, e, groups + 5)  # (numpy's, sorted)
        want = union_reference(g.tolist(), s.tolist(), e.tolist(), groups + 5)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    infinite = np.where(np.arange(n) == 7, -np.inf, start)
    assert _nesting.union_rows(group, True, infinite, end, np.empty(groups)) is False
    for bad in ((group[:-1], True, start, end), (group, False, start, end), (group, True, start, end[:-1])):
        with pytest.raises(ValueError, match="union_rows"):
            _nesting.union_rows(*bad, np.empty(groups))


@pytest.mark.parametrize(
    "name", ["hta_control.json.gz", "hta_nccl_data.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"]
)
def test_steps_are_the_same_with_the_c_union_and_without(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``steps()`` of real traces (GPU windows, kernels, runtime calls, CPU ops) is the same
    to the bit with the C union of intervals as with numpy's (its values are checked against
    the raw JSON in test_step_windows.py)."""
    tables = {}
    for how in ("C", "numpy"):
        with monkeypatch.context() as m:
            if how == "numpy":
                m.setattr(structure, "_nesting", None)
            tables[how] = tracemagic.load(TRACES / name, use_cache=False).steps()
    assert len(tables["C"]) > 1 and (tables["C"]["cpu_us"] > 0).all()
    pd.testing.assert_frame_equal(tables["C"], tables["numpy"], check_exact=True)
    assert tables["C"].attrs == tables["numpy"].attrs


def module_trace(path: Path, with_instant: bool) -> Path:
    """Two threads, each a ProfilerStep holding module calls: ops with and without tensor
    inputs, an op starting 0.2 µs before its module (inside the nesting tolerance), two ops
    starting together (the longer one first), a module whose only op starts after its end,
    python frames between (90 before one module's op); with ``with_instant``, a cpu_op instant with tensor dims too."""

    def ev(name: str, cat: str, tid: int, ts: float, dur: float, dims: str | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"Input Dims": json.loads(dims)} if dims else {}
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": 1_000.0 + ts, "dur": dur, "args": args}

    events = []
    for tid in (1, 2):
        k = 10 * tid
        events += [
            ev("ProfilerStep#1", "user_annotation", tid, 0, 1000),
            ev(f"nn.Module: Linear_{tid}", "python_function", tid, 10, 100),
            ev("torch/nn/functional.py(1): linear", "python_function", tid, 11, 50),
            ev("aten::empty", "cpu_op", tid, 12, 1, "[[], []]"),  # no tensor input
            ev("aten::linear", "cpu_op", tid, 20, 30, f"[[{k}, 4], [8, 4]]"),
            ev(f"nn.Module: Conv_{tid}", "python_function", tid, 200.2, 100),  # its op starts 0.2 µs before it
            ev("aten::conv2d", "cpu_op", tid, 200, 60, f"[[{k}, 3, 8, 8]]"),
            ev(f"nn.Module: ReLU_{tid}", "python_function", tid, 400, 50),
            ev("aten::short", "cpu_op", tid, 401, 5, f"[[{k}, 1]]"),
            ev("aten::long", "cpu_op", tid, 401, 20, f"[[{k}, 2]]"),  # starts with aten::short, longer: first
            ev(f"nn.Module: Drop_{tid}", "python_function", tid, 500, 10),
            ev("aten::late", "cpu_op", tid, 511, 5, f"[[{k}, 9]]"),  # after its end: none
            ev(f"nn.Module: Deep_{tid}", "python_function", tid, 600, 100),
            *(ev(f"frame_{j}", "python_function", tid, 601 + j, 0.5) for j in range(90)),  # a long walk
            ev("aten::deep", "cpu_op", tid, 695, 1, f"[[{k}, 5]]"),
        ]
    if with_instant:
        events.append(
            {
                "ph": "i",
                "s": "t",
                "cat": "cpu_op",
                "name": "aten::mark",
                "pid": 1,
                "tid": 1,
                "ts": 1_000.0 + 400.5,
                "args": {"Input Dims": [[7]]},
            }
        )
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize("with_instant", [False, True])
def test_layers_input_shapes_walk_the_thread_order_as_the_search_finds_them(
    with_instant: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``layers()``' ``input_shapes`` (the first op with a tensor input in the layer's first
    call): found by walking the thread order from each call (a few layers) as by the
    search over every op (many layers), on two threads, with ties and the tolerance."""
    from tracemagic.analysis import layers as layers_module

    path = module_trace(tmp_path / "modules.json", with_instant)
    want = {}
    for tid in (1, 2):
        k = 10 * tid
        want |= {
            f"Linear_{tid}": f"[[{k}, 4], [8, 4]]",
            f"Conv_{tid}": f"[[{k}, 3, 8, 8]]",
            f"ReLU_{tid}": f"[[{k}, 2]]",
            f"Drop_{tid}": None,
            f"Deep_{tid}": f"[[{k}, 5]]",
        }
    if with_instant:
        want["ReLU_1"] = "[[7]]"  # the instant starts first: the walk, which has no instants, leaves it to the search
    for few in (64, 0):
        with monkeypatch.context() as m:
            m.setattr(layers_module, "_FEW_CALLS", few)
            table = tracemagic.load(path, use_cache=False).layers()
        got = {
            layer: (None if pd.isna(shapes) else json.dumps(json.loads(shapes)))
            for layer, shapes in zip(table["layer"], table["input_shapes"])
        }
        assert got == {k: (None if v is None else json.dumps(json.loads(v))) for k, v in want.items()}, few


@pytest.mark.parametrize("seed", [1, 2])
def test_the_c_group_sums_are_pandas_compensated_sums(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_common.group_sums`` (``shapes()``' sums per row, in C: ``_nesting.group_sums``) gives
    ``groupby().sum()``'s values to the bit (Kahan-compensated, not a plain sum), NaN left
    out, on values of very different sizes; an infinite value, a column that is not float
    and a group outside the output are left to pandas; buffers of other lengths refused."""
    from tracemagic.analysis._common import group_sums
    from tracemagic.trace import _nesting

    rng = np.random.default_rng(seed)
    m, groups = 30_000, 500
    group = rng.integers(0, groups, m)
    group[:groups] = np.arange(groups)
    values = rng.exponential(100, m) * rng.choice([1.0, 1e-9, 1e9, -1.0, 3.3], m)
    values[rng.random(m) < 0.05] = np.nan
    other = np.round(rng.normal(0, 1e6, m), 3)
    got = group_sums(group, groups, a=values, b=other)
    want = pd.DataFrame({"a": values, "b": other}).groupby(group).sum()
    for name in ("a", "b"):
        assert got[name].tobytes() == want[name].to_numpy().tobytes(), name
    plain = np.bincount(group, weights=np.nan_to_num(values), minlength=groups)
    assert (got["a"] != plain).any(), "the sums are compensated (a plain sum differs in the last bits)"
    with monkeypatch.context() as m_:
        m_.setattr(structure, "_nesting", None)
        assert group_sums(group, groups, a=values)["a"].tobytes() == got["a"].tobytes()
    infinite = values.copy()
    infinite[5] = np.inf
    out = np.empty(groups)
    assert _nesting.group_sums(group, infinite, out) is False
    assert (
        group_sums(group, groups, a=infinite)["a"].tobytes()
        == pd.Series(infinite).groupby(group).sum().to_numpy().tobytes()
    )
    counts = rng.integers(0, 9, m)  # ints: pandas' integer sums, its dtype
    assert group_sums(group, groups, n=counts)["n"].dtype == np.int64
    assert _nesting.group_sums(group + 1, values, out) is False  # a group past the output
    assert _nesting.group_sums(group - 1, values, out) is False
    for bad in ((group[:-1], values, out), (group, values[:-1], out), (group.astype(np.int32), values, out)):
        with pytest.raises(ValueError, match="group_sums"):
            _nesting.group_sums(*bad)


def window_parts_reference(
    start: list[float], end: list[float], windows: list[tuple[float, float]]
) -> list[tuple[int, float, float]] | None:
    """Each row's part inside the window it reaches into, from the window's start and clipped
    to it, written out row by row: the first window ending after the row's start; None where
    a row reaches into two windows (plain Python)."""
    out = []
    for s, e in zip(start, end):
        hits = [j for j, (ws, we) in enumerate(windows) if we > s and ws < e]
        if len(hits) > 1:
            return None
        if hits:
            j = hits[0]
            ws, we = windows[j]
            out.append((j, min(max(s - ws, 0.0), we - ws), min(max(e - ws, 0.0), we - ws)))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_c_window_parts_match_a_reference_and_numpys(seed: int) -> None:
    """``_nesting.window_parts`` (``steps()``: the CPU ops cut to their step's window):
    each row's window and its part clipped to it as written out here, and bit for bit the
    numpy twin's (``steps._in_one_window`` + ``_clipped``), with rows before, between,
    across the edges of and after the windows; rows reaching into two windows, NaN and rows
    out of order are left to numpy (-1); buffers of other lengths refused."""
    from tracemagic.analysis import steps as steps_module
    from tracemagic.trace import _nesting

    rng = np.random.default_rng(seed)
    edges = np.cumsum(rng.uniform(5, 50, 24))
    win_start, win_end = edges[0::2].copy(), edges[1::2].copy()
    win_dur = win_end - win_start
    n = 5_000
    start = np.sort(np.round(rng.uniform(0, edges[-1] + 20, n), 2))
    end = start + np.round(rng.exponential(2, n), 2)
    k = np.searchsorted(win_end, start, side="right")  # each row's window: the first ending after its start
    limit = np.append(win_start, [np.inf, np.inf])[k + 1]
    end = np.minimum(end, limit)  # (no row into two windows)
    where = np.arange(win_start.size, dtype=np.int64)
    group, since, until = np.empty(n, dtype=np.int32), np.empty(n), np.empty(n)
    count = _nesting.window_parts(start, end, win_start, win_end, win_dur, where, group, since, until)
    want = window_parts_reference(start.tolist(), end.tolist(), list(zip(win_start.tolist(), win_end.tolist())))
    assert want is not None and 0 < count == len(want) < n
    assert group[:count].tolist() == [j for j, _, _ in want]
    np.testing.assert_allclose(since[:count], [a for _, a, _ in want], rtol=0, atol=1e-9)
    np.testing.assert_allclose(until[:count], [b for _, _, b in want], rtol=0, atol=1e-9)
    lo, hit = steps_module._in_one_window(start, end, win_start, win_end)
    part = np.flatnonzero(hit)
    twin = steps_module._clipped(None, part, where.astype(np.int32)[lo[part]], start, end.copy(), win_start, win_dur)
    for got, numpy_part in zip((group, since, until), twin):
        assert got[:count].tobytes() == numpy_part.tobytes()
    across = end.copy()
    across[np.searchsorted(start, win_start[3]) - 1] = win_start[5]  # a row into two windows
    unordered = start[::-1].copy()
    with_nan = start.copy()
    with_nan[10] = np.nan
    for s, e in ((start, across), (unordered, end[::-1].copy()), (with_nan, end)):
        assert _nesting.window_parts(s, e, win_start, win_end, win_dur, where, group, since, until) == -1
    assert _nesting.window_parts(start, end, win_start, win_end, win_dur, where + 1, group, since, until) == -1
    for bad in ((start[:-1], end), (start, end[:-1])):
        with pytest.raises(ValueError, match="window_parts"):
            _nesting.window_parts(*bad, win_start, win_end, win_dur, where, group, since, until)
    with pytest.raises(ValueError, match="window_parts"):
        _nesting.window_parts(start, end, win_start, win_end[:-1], win_dur, where, group, since, until)


def test_propagate_pair_follows_each_row_to_its_anchor_or_gives_way() -> None:
    """``_nesting.propagate_pair`` over a walk order where parents come first answers as two
    climbs written here (innermost anchors, and with ``outer`` the outermost, as attribution
    asks; int64 and int32 orders); any order that breaks that (a parent after its child, a
    row twice, a row with a parent left out) is refused (False), and the caller's two
    ``propagate`` give the rows."""
    nesting = structure._nesting
    assert nesting is not None, "the C nesting is built (see test_scan.py)"
    rng = np.random.default_rng(23)

    def climbed(parent: np.ndarray, anchor: np.ndarray) -> np.ndarray:
        out = np.full(parent.size, -1, dtype=np.int64)
        for i in range(parent.size):
            j = i
            while j >= 0 and not anchor[j]:
                j = parent[j]
            out[i] = j
        return out

    def outermost_climbed(parent: np.ndarray, anchor: np.ndarray) -> np.ndarray:
        out = np.full(parent.size, -1, dtype=np.int64)
        for i in range(parent.size):
            j = i
            while j >= 0:
                if anchor[j]:
                    out[i] = j  # (the last met on the way up: the outermost)
                j = parent[j]
        return out

    for trial in range(40):
        n = int(rng.integers(1, 300))
        nested = rng.random(n) > 0.2  # the rest: outside the nesting (no parent, not walked)
        walk = rng.permutation(np.flatnonzero(nested))
        parent = np.full(n, -1, dtype=np.int64)
        for at, i in enumerate(walk.tolist()):
            if at and rng.random() > 0.2:
                parent[i] = walk[rng.integers(0, at)]  # a row walked before it
        a, b = rng.random(n) > 0.7, rng.random(n) > 0.5
        order = walk.astype(np.int64)
        broken = trial % 4
        has_parent = bool((parent >= 0).any())
        refused = (broken in (1, 3) and has_parent) or (broken == 2 and order.size > 0)
        if broken == 1 and has_parent:  # a child before its parent
            child = int(np.flatnonzero(parent >= 0)[0])
            order = np.concatenate(([child], order[order != child]))
        elif broken == 2 and order.size:  # a row twice
            order = np.concatenate((order, order[:1]))
        elif broken == 3 and has_parent:  # a row with a parent left out of the order
            order = order[order != int(np.flatnonzero(parent >= 0)[-1])]
        out_a, out_b = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        done = nesting.propagate_pair(order, True, parent, a.view(np.uint8), b.view(np.uint8), False, out_a, out_b)
        assert done == (not refused)
        if done:
            np.testing.assert_array_equal(out_a, climbed(parent, a))
            np.testing.assert_array_equal(out_b, climbed(parent, b))
        # outer (attribution's outermost backward op), one propagation, the order as int32
        outer = np.empty(n, dtype=np.int64)
        args = (parent, a.view(np.uint8), b"", True, outer, bytearray())
        assert nesting.propagate_pair(order.astype(np.int32), False, *args) == (not refused)
        if not refused:
            np.testing.assert_array_equal(outer, outermost_climbed(parent, a))
        depth = np.zeros(n, dtype=np.int32)
        got = structure._propagate_pair(parent, depth, order, a, b)  # the caller: C or the climbs
        np.testing.assert_array_equal(got[0], climbed(parent, a))
        np.testing.assert_array_equal(got[1], climbed(parent, b))


def test_step_numbers_in_one_pass_equal_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    """``step_numbers``' C search (``_nesting.step_rows``) gives numpy's ``searchsorted``
    answer row for row: rows out of time order, NaN times, starts and ends, ties at a step's
    start and at its end (start + dur + tolerance, inside it), overlapping and repeated
    steps, rows before the first and after the last."""
    rng = np.random.default_rng(5)
    for trial in range(40):
        n, steps = int(rng.integers(1, 400)), int(rng.integers(1, 8))
        ts = np.sort(rng.choice(np.arange(0.0, 100.0, 0.5), n))
        ts = np.where(rng.random(n) < 0.1, rng.choice(np.arange(-5.0, 110.0, 0.5), n), ts)  # out of order
        ts[rng.random(n) < 0.05] = np.nan
        dur = rng.choice([0.0, 1.0, 5.0, 20.0], n)
        kind = np.full(n, "cpu_op", dtype=object)
        step_rows = rng.choice(n, min(steps, n), replace=False)
        kind[step_rows] = "step"
        names = np.array([f"ProfilerStep#{int(k)}" for k in rng.integers(0, 4, n)], dtype=object)
        if trial % 5 == 0:
            dur[step_rows[:1]] = np.nan
        # ties at a step's end: rows at exactly its start + dur + tolerance (in the step, as numpy's <=)
        ends = ts[step_rows] + dur[step_rows] + structure.NEST_TOLERANCE_US
        others = np.setdiff1d(np.arange(n), step_rows)
        tied = rng.choice(others, min(others.size, 2 * step_rows.size), replace=False)
        ts[tied] = ends[rng.integers(0, ends.size, tied.size)]
        events = pd.DataFrame(
            {
                "name": pd.Categorical(names),
                "ts": ts,
                "dur": dur,
                "kind": pd.Categorical(kind, categories=pd.Index(structure.KINDS, dtype="str")),
            }
        )
        fast = structure.step_numbers(events)
        with monkeypatch.context() as m:
            m.setattr(structure, "_nesting", None)
            slow = structure.step_numbers(events)
        assert fast.dtype == slow.dtype
        np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize("at_once", [True, False])
def test_columns_taken_at_once_equal_each_taken_alone(at_once: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_common.columns_at`` (one C pass, ``_nesting.take_rows``, from ``_AT_ONCE_MIN_ROWS``
    rows; column by column below) gives each column as pandas' own ``take`` does: numpy
    columns of every width, categoricals with missing values, nullable integers, floats and
    booleans with missing values, an Arrow column (taken by pandas), int32 and int64 rows,
    no rows; and ``without_unused`` (``_nesting.recode``) equals
    ``remove_unused_categories`` on the taken categoricals."""
    from tracemagic.analysis import _common
    from tracemagic.analysis._common import columns_at, without_unused

    monkeypatch.setattr(_common, "_AT_ONCE_MIN_ROWS", 0 if at_once else 1 << 62)

    rng = np.random.default_rng(8)
    n = 5000
    names = np.array([f"name{i}" for i in range(300)], dtype=object)
    frame = pd.DataFrame(
        {
            "f8": rng.random(n),
            "i4": rng.integers(-5, 5, n).astype(np.int32),
            "i1": rng.integers(-5, 5, n).astype(np.int8),
            "b": rng.random(n) > 0.5,
            "wide": pd.Categorical(np.where(rng.random(n) < 0.1, None, names[rng.integers(0, 300, n)])),
            "narrow": pd.Categorical(np.where(rng.random(n) < 0.1, None, names[rng.integers(0, 5, n)])),
            "nullable": pd.array(np.where(rng.random(n) < 0.2, None, rng.integers(0, 9, n)), dtype="Int64"),
            "floating": pd.array(np.where(rng.random(n) < 0.2, None, rng.random(n)), dtype="Float64"),
            "boolean": pd.array(np.where(rng.random(n) < 0.2, None, rng.random(n) > 0.5), dtype="boolean"),
            "text": pd.array(names[rng.integers(0, 300, n)], dtype="str"),
        }
    )
    for rows in (np.sort(rng.choice(n, 700, replace=False)), rng.integers(0, n, 900), np.zeros(0, dtype=np.int64)):
        for dtype in (np.int64, np.int32):
            at = rows.astype(dtype)
            got = columns_at(frame, list(frame.columns), at)
            for column in frame.columns:
                want = frame[column].array.take(at)
                if isinstance(want, pd.arrays.NumpyExtensionArray):
                    want = want.to_numpy()
                    assert isinstance(got[column], np.ndarray) and got[column].dtype == want.dtype
                    np.testing.assert_array_equal(got[column], want)
                else:
                    assert type(got[column]) is type(want) and got[column].dtype == want.dtype
                    pd.testing.assert_extension_array_equal(got[column], want)
            for column in ("wide", "narrow"):
                values = got[column]
                fast = without_unused(values)
                with monkeypatch.context() as m:
                    m.setattr(structure, "_nesting", None)
                    slow = without_unused(values)
                want = values.remove_unused_categories()
                for made in (fast, slow):
                    pd.testing.assert_extension_array_equal(made, want)
                    assert made.codes.dtype == want.codes.dtype
    refused = pytest.raises(ValueError, match="does not fit") if at_once else pytest.raises(IndexError)
    with refused:  # a row outside the table
        columns_at(frame, ["f8"], np.array([0, n], dtype=np.int64))


def test_rows_where_keeps_the_rows_of_a_mask_in_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_common._rows_where`` (``_nesting.rows_where``, the candidates of ``enclosing_at``)
    gives numpy's ``rows[mask[rows]]``: int32 and int64 rows, repeated rows, none kept, all."""
    from tracemagic.analysis._common import _rows_where

    rng = np.random.default_rng(4)
    for trial in range(20):
        n = int(rng.integers(1, 500))
        mask = rng.random(n) < (trial % 4) / 3  # none, some, most, all
        rows = rng.integers(0, n, int(rng.integers(0, 800)))
        for dtype in (np.int32, np.int64):
            got = _rows_where(rows.astype(dtype), mask)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, rows[mask[rows]])
            with monkeypatch.context() as m:
                m.setattr(structure, "_nesting", None)
                np.testing.assert_array_equal(_rows_where(rows.astype(dtype), mask), got)


def test_thread_keys_in_one_pass_equal_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    """``structure.thread_keys`` (``_nesting.thread_key_rows``) gives numpy's keys: int8 and
    int16 codes, missing ones (-1), ranks 0, many and beyond 2**21 (wrapped as numpy
    wraps them), no rank column, all rows and some."""
    rng = np.random.default_rng(12)
    for trial in range(12):
        n = int(rng.integers(1, 400))
        pids = np.array([f"p{i}" for i in range(3 if trial % 2 else 300)], dtype=object)
        frame = pd.DataFrame(
            {
                "pid": pd.Categorical(np.where(rng.random(n) < 0.1, None, pids[rng.integers(0, pids.size, n)])),
                "tid": pd.Categorical(np.where(rng.random(n) < 0.1, None, rng.integers(0, 5, n).astype(str))),
                "rank": rng.choice([0, 0, 3, 2**21 + 5, 2**30], n).astype(np.int32) * (trial % 3 > 0),
            }
        )
        if trial % 4 == 3:
            frame = frame.drop(columns="rank")
        for rows in (None, np.sort(rng.choice(n, n // 2, replace=False))):
            fast = structure.thread_keys(frame, rows)
            with monkeypatch.context() as m:
                m.setattr(structure, "_nesting", None)
                slow = structure.thread_keys(frame, rows)
            assert fast.dtype == slow.dtype == np.int64
            np.testing.assert_array_equal(fast, slow)
            if rows is None:
                np.testing.assert_array_equal(fast, [row_thread_key(frame)(i) for i in range(n)])


def test_take_codes_gives_minus_one_for_no_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_common.take_codes`` (``_nesting.take_codes``) gives numpy's take with -1 where the
    row is -1, in the values' own width: int8 to int64 values, int32 and int64 rows."""
    from tracemagic.analysis._common import take_codes

    rng = np.random.default_rng(9)
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        values = rng.integers(-1, 100, 300).astype(dtype)
        for rows in (rng.integers(-1, 300, 1000), np.zeros(0, dtype=np.int64), np.full(5, -1)):
            for width in (np.int32, np.int64):
                at = rows.astype(width)
                got = take_codes(values, at)
                want = np.where(at >= 0, values[np.maximum(at, 0)], -1).astype(dtype)
                assert got.dtype == dtype
                np.testing.assert_array_equal(got, want)
                with monkeypatch.context() as m:
                    m.setattr(structure, "_nesting", None)
                    np.testing.assert_array_equal(take_codes(values, at), want)


def test_take_rows_refuses_columns_of_python_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_nesting.take_rows`` copies values as bytes: a column of Python objects (an object
    array, or a record holding one) would be copied without its references counted (freed
    twice later), so it is refused (ValueError), and ``_common.columns_at`` takes such a
    column with pandas (each value referenced once more per row taken)."""
    import gc
    import sys

    from tracemagic.analysis import _common
    from tracemagic.analysis._common import columns_at

    nesting = structure._nesting
    assert nesting is not None, "the C nesting is built (see test_scan.py)"
    monkeypatch.setattr(_common, "_AT_ONCE_MIN_ROWS", 0)  # (the one pass for these few rows too)
    values = np.array([object() for _ in range(4)], dtype=object)
    rows = np.array([3, 3, 0], dtype=np.int64)
    for source in (values, np.zeros(4, dtype=[("o", object)])):
        out = np.empty(rows.size, dtype=source.dtype)
        with pytest.raises(ValueError, match="take_rows"):
            nesting.take_rows(rows, True, 4, (source,), (out,))
    frame = pd.DataFrame({"objects": values, "f8": np.arange(4.0)})
    columns_at(frame, ["objects", "f8"], rows)  # (any cache pandas keeps of the column made)
    gc.collect()
    before = sys.getrefcount(values[3])
    got = columns_at(frame, ["objects", "f8"], rows)
    same = got["objects"][0] is values[3] and got["objects"][2] is values[0]  # (no temporaries kept by assert)
    held = sys.getrefcount(values[3])
    assert same and held >= before + 2  # the two rows taken hold it
    np.testing.assert_array_equal(got["f8"], [3.0, 3.0, 0.0])
    del got
    gc.collect()
    after = sys.getrefcount(values[3])  # (out of the assert: pytest's rewriting holds its operands)
    assert after == before  # each reference given back once


def test_thread_keys_of_the_largest_codes_wrap_as_numpys() -> None:
    """``_nesting.thread_key_rows`` adds 1 to each code as numpy's int64 does, wrapping at
    the largest (no signed overflow in C: a UBSan build of _nesting.c aborts on one)."""
    nesting = structure._nesting
    assert nesting is not None, "the C nesting is built (see test_scan.py)"
    big = np.iinfo(np.int64).max
    pid = np.array([big, -1, 5], dtype=np.int64)
    tid = np.array([big, big, -1], dtype=np.int64)
    rank = np.array([1, -1, 0], dtype=np.int32)
    out = np.empty(3, dtype=np.int64)
    nesting.thread_key_rows(pid, 8, tid, 8, rank, out)
    with np.errstate(over="ignore"):
        want = (np.add(pid, 1) << 21) | np.add(tid, 1) | (rank.astype(np.int64) << 42)
    np.testing.assert_array_equal(out, want)
