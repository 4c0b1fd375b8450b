"""The loader's fast paths (the C code in ``trace/_scan.c`` and ``trace/_nesting.c``, and
``structure.sort_by_thread``) are only faster routes to what the plain Python code
computes: same events, flows, names and tables on every real trace and on a trace
captured here from a real model, and the msgspec path for whatever the scanner does not
read exactly as it does."""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import TRACES

import tracemagic
from tracemagic.trace import builder, parse, structure
from tracemagic.trace.read import Source

KINETO = sorted(p.name for p in TRACES.glob("*.gz") if "_et." not in p.name and "memory_timeline" not in p.name)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEMAGIC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def test_the_c_code_is_built() -> None:
    """setup.py builds both extensions where a C compiler is found, as on this machine."""
    for module in ("tracemagic.trace._scan", "tracemagic.trace._nesting"):
        try:
            importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - a broken install
            pytest.fail(f"{module} is not built ({exc}): install a C compiler and reinstall tracemagic")
    assert parse.scans_in_c()


def without_c(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "_scan", None)
    monkeypatch.setattr(builder, "_join", None)
    monkeypatch.setattr(structure, "_nesting", None)


def load_both(path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[tracemagic.Trace, tracemagic.Trace]:
    fast = tracemagic.load(path, use_cache=False, **kwargs)
    with monkeypatch.context() as m:
        without_c(m)
        slow = tracemagic.load(path, use_cache=False, **kwargs)
    return fast, slow


def assert_same_trace(a: tracemagic.Trace, b: tracemagic.Trace, tables: bool = True) -> None:
    pd.testing.assert_frame_equal(a.events, b.events)
    pd.testing.assert_frame_equal(a.flows, b.flows)
    assert a.meta == b.meta
    if tables:
        for table in ("ops", "kernels", "steps", "layers", "memory", "shapes"):
            pd.testing.assert_frame_equal(getattr(a, table)(), getattr(b, table)(), obj=table)


class ScanSpy:
    """Counts the chunks the scanner read and those it left to msgspec."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read = 0
        self.left = 0
        real = parse._scan

        class Spy:
            @staticmethod
            def scan(data: Any, pool: Any = None) -> Any:
                columns = real.scan(data, pool)
                if columns is None:
                    self.left += 1
                else:
                    self.read += 1
                return columns

        monkeypatch.setattr(parse, "_scan", Spy)


@pytest.mark.parametrize("name", KINETO)
def test_every_real_trace_loads_the_same_with_and_without_c(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = ScanSpy(monkeypatch)
    fast = tracemagic.load(TRACES / name, use_cache=False)
    assert spy.read > 0 and spy.left == 0, "the scanner read every chunk of a real trace"
    with monkeypatch.context() as m:
        without_c(m)
        slow = tracemagic.load(TRACES / name, use_cache=False)
    assert_same_trace(fast, slow)
    assert len(fast.events) > 0


def test_a_captured_model_trace_loads_the_same(
    transformer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real transformer step loop with shapes, memory and stacks (every args column the
    scanner reads from CPU traces, fwdbwd flows, nn.Module events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model = transformer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 50, (4, 12))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True) as prof:
        for _ in range(2):
            optimizer.zero_grad()
            model(tokens).sum().backward()
            optimizer.step()
            prof.step()
    path = tmp_path / "transformer.pt.trace.json"
    prof.export_chrome_trace(str(path))
    fast, slow = load_both(path, monkeypatch)
    assert_same_trace(fast, slow)
    assert (fast.events["kind"] == "memory").sum() > 0 and fast.layers()["layer"].notna().all()
    assert fast.events["input_dims"].notna().sum() > 0


def event(**fields: Any) -> dict[str, Any]:
    base = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0}
    return {**base, **fields}


#: events the scanner reads itself (a chunk of them gives columns)
READ = {
    "hex and decimal text ids (AMD)": [event(args={"External id": "0x1f", "stream": "0x0", "correlation": "2560"})],
    "ns integers as timestamps": [event(ts=1790857026000000000, dur=1500)],
    "a missing cat and name": [{"ph": "X", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}],
    "escapes and non-ASCII names": [event(name='aten::add_\\"x\\" \u00e9\u4e2d \U0001f600 \\n')],
    "ids as text and numbers": [event(pid="Spans", tid="PyTorch Profiler"), event(pid=7, tid=-3)],
    "input dims in any spacing": [
        event(args={"Input Dims": [[8, 32], [64, 32]]}),
        {**event(), "args": json.loads('{"Input Dims": [[8,32],[64,32]], "Input type": ["float","float"]}')},
    ],
    "shapes alike but for their nesting": [
        event(args={"Input Dims": dims})
        for dims in ([[1, 2], [3]], [[1], [2, 3]], [[1, 2, 3]], [1, [2, 3]], [[1, 2], [3]], [[], []], [[[]]])
    ],
    "a repeated key (the last wins)": [event(name="first")],  # duplicated in the text below
    "names and labels of processes and threads": [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 1, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
        event(),
    ],
    "flows and unknown phases": [
        event(),
        {"ph": "s", "cat": "fwdbwd", "id": 4, "pid": 1, "tid": 1, "ts": 10.0},
        {"ph": "f", "cat": "fwdbwd", "id": 4, "pid": 1, "tid": 1, "ts": 12.0, "bp": "e"},
        {"ph": "C", "name": "counter", "pid": 1, "ts": 11.0, "args": {"v": 3}},
        {"ph": "b", "name": "async", "id": "0x1", "pid": 1, "ts": 11.0},
    ],
    "memory events": [
        {
            "ph": "i",
            "cat": "cpu_instant_event",
            "name": "[memory]",
            "pid": 1,
            "tid": 1,
            "ts": 12.0,
            "s": "t",
            "args": {
                "Total Reserved": 2048,
                "Total Allocated": 512,
                "Bytes": -256,
                "Addr": 94000000,
                "Device Type": 0,
                "Device Id": -1,
            },
        },
    ],
    "flops as floats": [event(args={"flops": 1.5e9}), event(args={"flops": 12})],
    "old and new external id keys, and nulls": [
        event(args={"External id": None, "external id": 5}),
        event(args={"external id": 6}),
        event(args={"External id": 7, "external id": 8}),
        event(args={"Sequence number": None, "Fwd thread id": 3}),
    ],
    "a repeated args key (the last wins)": [event(args={"Sequence number": 1}), event(args={"Sequence number": 2})],
    "keys that differ from known ones inside": [  # same length, first and last eight bytes
        event(args={"Record fXnction id": 5, "Python parXnt id": 6, "Sequence numbXr": 7}),
    ],
}
#: events the scanner leaves to msgspec (the chunk gives None)
LEFT = {
    "a float in an integer column": [event(args={"External id": 1.5})],
    "a bool in an integer column": [event(args={"Sequence number": True})],
    "an id beyond 64 bits": [event(args={"External id": 2**70})],
    "a list as a name": [event(name=["a", "b"])],
    "a timestamp as text": [event(ts="12.5")],
    "args that are not an object": [event(args=[1, 2])],
    "a flow id as text": [event(), {"ph": "s", "cat": "fwdbwd", "id": "x4", "pid": 1, "tid": 1, "ts": 10.0}],
    "an event that is not an object": [event(), 3],
}


def write_events(path: Path, events: list[Any]) -> Path:
    text = json.dumps({"schemaVersion": 1, "traceEvents": events}, ensure_ascii=False)
    if path.stem == "a repeated key (the last wins)":
        text = text.replace('"name": "first"', '"name": "first", "name": "second"', 1)
    if path.stem == "a repeated args key (the last wins)":
        text = text.replace('"Sequence number": 1', '"Sequence number": 1, "Sequence number": 3', 1)
        text = text.replace('"Sequence number": 2', '"Sequence number": 2, "Sequence number": null', 1)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", sorted(READ))
def test_values_the_scanner_reads_give_the_msgspec_columns(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_events(tmp_path / f"{case}.json", READ[case])
    spy = ScanSpy(monkeypatch)
    fast = tracemagic.load(path, use_cache=False)
    assert (spy.read, spy.left) == (1, 0)
    with monkeypatch.context() as m:
        without_c(m)
        slow = tracemagic.load(path, use_cache=False)
    assert_same_trace(fast, slow, tables=False)
    if case == "a repeated key (the last wins)":
        assert fast.events["name"].astype(str).tolist() == ["second"]
    if case == "input dims in any spacing":
        assert fast.events["input_dims"].astype(str).tolist() == ["[[8, 32], [64, 32]]"] * 2
    if case == "shapes alike but for their nesting":
        written = [json.dumps(e["args"]["Input Dims"]) for e in READ[case]]
        assert fast.events["input_dims"].astype(str).tolist() == written
    if case == "old and new external id keys, and nulls":
        assert fast.events["external_id"].tolist() == [5, 6, 7, pd.NA]
        assert fast.events["fwd_tid"].tolist() == [pd.NA, pd.NA, pd.NA, 3]
    if case == "a repeated args key (the last wins)":
        assert fast.events["seq"].tolist() == [3, pd.NA]
    if case == "keys that differ from known ones inside":
        assert fast.events[["rf_id", "python_parent_id", "seq"]].isna().all(axis=None)


@pytest.mark.parametrize("case", sorted(LEFT))
def test_values_the_scanner_leaves_take_the_msgspec_path(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_events(tmp_path / f"{case}.json", LEFT[case])
    spy = ScanSpy(monkeypatch)
    try:
        fast = tracemagic.load(path, use_cache=False)
    except tracemagic.TraceError as exc:
        with monkeypatch.context() as m:
            without_c(m)
            with pytest.raises(tracemagic.TraceError) as slow_exc:
                tracemagic.load(path, use_cache=False)
        assert str(exc) == str(slow_exc.value)
        return
    assert spy.left == 1
    with monkeypatch.context() as m:
        without_c(m)
        slow = tracemagic.load(path, use_cache=False)
    assert_same_trace(fast, slow, tables=False)


def test_malformed_json_is_left_to_msgspec() -> None:
    from tracemagic.trace import _scan

    assert _scan.scan(b'[{"ph": "X", "name": "a"}]') is not None
    for broken in (b'[{"ph": "X", "name": "a}]', b'[{"ph": "X"},]', b'{"ph": "X"}', b"", b"[NaN]", b'["\xff"]'):
        assert _scan.scan(broken) is None, broken


def test_a_scan_pool_gives_the_columns_malloc_gives() -> None:
    """Chunks decoded in a reused pool (``parse.scan_pool``), one that holds them, one too
    small (the rest from malloc) and none, give the same columns; a broken chunk between
    them leaves the pool usable; a read-only buffer is refused."""
    import mmap

    from tracemagic.trace import _scan

    data = gzip.decompress((TRACES / "hta_control.json.gz").read_bytes())
    start = data.index(b"[", data.index(b'"traceEvents"'))
    chunks = []
    for cut in (200_000, 500_000, 900_000):  # whole events: up to the '}' before a '},{'
        end = data.index(b"},", start + cut) + 1
        chunks.append(data[start:end] + b"]")
    for size in (16 << 20, 64 << 10, 0):
        pool = mmap.mmap(-1, size) if size else bytearray(0)
        for chunk in [*chunks, b'[{"ph": "X"},]', *reversed(chunks)]:
            want = _scan.scan(chunk)
            got = _scan.scan(chunk, pool)
            assert got == want, size
            assert _scan.scan(chunk, None) == want
    with pytest.raises(BufferError):
        _scan.scan(chunks[0], b"x" * 1024)


def test_the_c_joins_give_numpys_columns_and_refuse_what_does_not_fit() -> None:
    """``join_codes``/``join_numbers``/``join_bytes`` (``_Builder.finish``'s joins of a
    column's chunks) write what numpy's take and slices write; parts that do not fit the
    output, or a code outside its table, are a ValueError (never memory out of bounds)."""
    from tracemagic.trace import _scan

    rng = np.random.default_rng(5)
    tables = [rng.integers(0, 300, size=k + 1).astype(np.int32) for k in (3, 40, 1)]
    for table in tables:
        table[-1] = -1  # the missing code's entry
    locals_ = [rng.integers(-1, len(t) - 1, size=n).astype(np.int32) for t, n in zip(tables, (1000, 5, 70_000))]
    parts: list[Any] = [(locals_[0], tables[0]), 17, (locals_[1], tables[1]), (locals_[2], tables[2])]
    want = np.concatenate(
        [
            np.take(tables[0], locals_[0], mode="wrap"),
            np.full(17, -1),
            np.take(tables[1], locals_[1], mode="wrap"),
            np.take(tables[2], locals_[2], mode="wrap"),
        ]
    )
    for dtype in (np.int16, np.int32, np.int64):
        out = np.empty(len(want), dtype=dtype)
        _scan.join_codes(out, out.dtype.itemsize, parts)
        np.testing.assert_array_equal(out, want)
    out = np.empty(len(want) + 1, dtype=np.int16)
    with pytest.raises(ValueError):
        _scan.join_codes(out, 2, parts)  # one row too many
    with pytest.raises(ValueError):
        _scan.join_codes(np.empty(3, np.int16), 2, [(np.array([0, 5, 1], np.int32), np.array([7, -1], np.int32))])
    with pytest.raises(ValueError):
        _scan.join_codes(np.empty(3, np.int16), 3, [3])  # no such width
    values = [rng.integers(-(2**62), 2**62, size=n) for n in (10, 30_000)]
    masks = [rng.random(len(v)) < 0.5 for v in values]
    numbers: list[Any] = [(10, (values[0], masks[0])), (7, None), (30_000, (values[1], masks[1]))]
    got, mask = np.zeros(30_017, np.int64), np.empty(30_017, bool)
    _scan.join_numbers(got, mask, numbers)
    np.testing.assert_array_equal(got, np.concatenate([values[0], np.zeros(7, np.int64), values[1]]))
    np.testing.assert_array_equal(mask, np.concatenate([masks[0], np.ones(7, bool), masks[1]]))
    with pytest.raises(ValueError):
        _scan.join_numbers(got, mask, [(30_017, (values[1], masks[1]))])  # values of fewer rows
    floats = [rng.random(n) for n in (5, 100_000)]
    joined = np.empty(100_005)
    _scan.join_bytes(joined, floats)
    np.testing.assert_array_equal(joined, np.concatenate(floats))
    with pytest.raises(ValueError):
        _scan.join_bytes(np.empty(3), floats)
    with pytest.raises(BufferError):
        _scan.join_bytes(b"x" * 8, [np.zeros(1)])  # read-only output


def test_damage_is_reported_as_msgspec_reports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = gzip.decompress((TRACES / "hta_nccl_data.json.gz").read_bytes())
    path = tmp_path / "cut.json"
    path.write_bytes(data[: len(data) // 2] + b"garbage")
    with pytest.raises(tracemagic.TraceError) as fast:
        tracemagic.load(path, use_cache=False, workers=1)
    with monkeypatch.context() as m:
        without_c(m)
        with pytest.raises(tracemagic.TraceError) as slow:
            tracemagic.load(path, use_cache=False, workers=1)
    assert str(fast.value) == str(slow.value) and fast.value.offset == slow.value.offset
    a, b = load_both(path, monkeypatch, recover=True, workers=1)
    assert_same_trace(a, b, tables=False)


def test_chunks_parsed_on_two_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scanner runs without the GIL (trace.split relies on it): many threads scanning
    at once give each its own, correct columns."""
    from concurrent.futures import ThreadPoolExecutor

    data = gzip.decompress((TRACES / "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz").read_bytes())
    expected = parse.parse_source(Source.from_bytes("rank0", data)).events
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda _: parse.parse_source(Source.from_bytes("rank0", data), chunk=256 * 1024).events, range(4))
        )
    for events in results:
        pd.testing.assert_frame_equal(events, expected)


def assert_same_bits(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    """Arrays equal bit for bit (-0.0 is not 0.0; NaNs where the other has them)."""
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
        assert a.tobytes() == b.tobytes()


def test_one_pass_nesting_equals_the_numpy_nesting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random nests per thread, with ends a little past their parent's (within and beyond
    the tolerance), short events starting at or just before another's end, equal starts
    and zero durations, rows in any order: ``structure.nest`` in C and with numpy alone."""
    from tracemagic.trace.kineto import KINDS

    rng = np.random.default_rng(7)
    for _ in range(30):
        n = int(rng.integers(1, 400))
        group = rng.integers(0, 4, n)
        start = np.round(rng.uniform(0, 100, n), 1)
        end = start + np.round(rng.exponential(10, n), 1) * (rng.random(n) > 0.1)
        end = end + rng.choice([0.0, 0.1, 0.2, 0.3], n)
        short = rng.random(n) < 0.3  # tiny events starting at, or 1 ns before, an earlier one's end
        earlier = rng.integers(0, n, n)
        start = np.where(short, end[earlier] - rng.choice([0.0, 0.001], n), start)
        end = np.where(short, start + rng.choice([0.0, 0.05, 0.2], n), end)
        events = pd.DataFrame(
            {
                "ph": pd.Categorical(["X"] * n),
                "pid": pd.Categorical(group.astype(str)),
                "tid": pd.Categorical(["1"] * n),
                "ts": start,
                "dur": end - start,
                "kind": pd.Categorical(["cpu_op"] * n, categories=pd.Index(KINDS, dtype="str")),
            }
        )
        fast = structure.nest(events, 0.0)
        with monkeypatch.context() as m:
            m.setattr(structure, "_nesting", None)
            slow = structure.nest(events, 0.0)
        assert_same_bits(fast, slow)
        parent, depth = fast[0], fast[1]
        for i in fast[3]:  # in the walk's order parents come first
            assert depth[i] == (depth[parent[i]] + 1 if parent[i] >= 0 else 0)


def test_one_pass_propagate_equals_the_numpy_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    for _ in range(30):
        n = int(rng.integers(1, 500))
        parent = np.full(n, -1, dtype=np.int64)
        depth = np.full(n, -1, dtype=np.int32)
        nested = rng.random(n) > 0.2  # the rest are outside the nesting (GPU events, instants)
        for i in np.flatnonzero(nested):
            earlier = np.flatnonzero(nested[:i])
            if earlier.size and rng.random() > 0.2:
                parent[i] = rng.choice(earlier)
                depth[i] = depth[parent[i]] + 1
            else:
                depth[i] = 0
        anchor = rng.random(n) > 0.7
        shuffle = rng.permutation(n)  # rows in any order, parents anywhere
        inverse = np.argsort(shuffle)
        p = np.where(parent[shuffle] >= 0, inverse[np.maximum(parent[shuffle], 0)], -1)
        fast = structure.propagate(p, depth[shuffle], anchor[shuffle])
        with monkeypatch.context() as m:
            m.setattr(structure, "_nesting", None)
            slow = structure.propagate(p, depth[shuffle], anchor[shuffle])
        np.testing.assert_array_equal(fast, slow)


def test_sort_by_thread_is_lexsort() -> None:
    """Nearly sorted starts with ties, NaN starts and ends, few and many groups."""
    rng = np.random.default_rng(3)
    for groups in (1, 3, 40000):
        for _ in range(10):
            n = int(rng.integers(1, 3000))
            group = rng.integers(0, groups, n).astype(np.int64) * 1_000_003
            start = np.sort(np.round(rng.uniform(0, 50, n), 0)) + rng.choice([0.0, 0.0, 0.0, 5.0, -3.0], n)
            start[rng.random(n) < 0.02] = np.nan
            end = start + np.round(rng.exponential(3, n), 0)
            end[rng.random(n) < 0.02] = np.nan
            np.testing.assert_array_equal(
                structure.sort_by_thread(group, start, -end), np.lexsort((-end, start, group))
            )
            np.testing.assert_array_equal(structure.sort_by_thread(group, start), np.lexsort((start, group)))


def random_events(rng: np.random.Generator, n: int, threads: int) -> pd.DataFrame:
    """An events table with CPU duration events of ``threads`` threads in file order (starts
    nearly sorted, some out of order), ties, zero, negative and missing durations, missing
    starts, instants and GPU kernels between them."""
    from tracemagic.trace.kineto import KINDS

    kinds = rng.choice(["cpu_op", "python_function", "user_annotation", "kernel", "runtime", "memory"], n)
    ts = np.sort(np.round(rng.uniform(0, 200, n), 1)) + rng.choice([0.0] * 8 + [3.0, -4.0], n)
    ts[rng.random(n) < 0.01] = np.nan
    dur = np.round(rng.exponential(8, n), 1) * (rng.random(n) > 0.1) + rng.choice([0.0, 0.1, 0.2, 0.3], n)
    dur[rng.random(n) < 0.02] = np.nan
    dur[rng.random(n) < 0.02] = -0.0
    dur[rng.random(n) < 0.02] = -1.0
    return pd.DataFrame(
        {
            "ph": pd.Categorical(rng.choice(["X", "X", "X", "i"], n)),
            "pid": pd.Categorical(rng.integers(0, max(threads // 4, 1), n).astype(str)),
            "tid": pd.Categorical(rng.integers(0, min(threads, 4), n).astype(str)),
            "ts": ts,
            "dur": dur,
            "kind": pd.Categorical(kinds, categories=pd.Index(KINDS, dtype="str")),
        }
    )


def test_one_call_nesting_equals_the_numpy_nesting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``structure.nest`` in one C call (sort by thread, nesting, self time) sorts the rows
    as numpy does (NaN starts and durations, ties) and, on what a load can give (no NaN:
    tests/test_nesting.py checks NaNs against a reference walk), gives the numpy path's
    parents, depths and self times bit for bit: ties, zero, -0.0 and negative durations;
    few threads and thousands of them (no limit)."""
    rng = np.random.default_rng(23)
    most = 0
    for threads in (1, 3, 16, 2000):
        for _ in range(8):
            events = random_events(rng, int(rng.integers(1, 3000)), threads)
            t0 = float(np.nanmin(events["ts"].to_numpy()))
            assert_same_bits(structure.nest(events, t0)[3:], (structure.cpu_by_thread(events),))
            events["ts"] = events["ts"].fillna(t0 + 7.0)  # as a load reads them: no NaN
            events["dur"] = events["dur"].fillna(0.0)
            fast = structure.nest(events, t0)
            with monkeypatch.context() as m:  # numpy's sort, then previous_enclosing's walk
                m.setattr(structure, "_nesting", None)
                slow = structure.nest(events, t0)
            assert_same_bits(fast, slow)
            most = max(most, len(np.unique(structure.thread_keys(events, fast[3]))))
    assert most > 900  # far more threads than the old limit of 256
