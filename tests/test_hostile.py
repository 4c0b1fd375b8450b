"""Damaged, odd and hostile inputs (issue 14): every one gives a loaded trace or a
``TraceError`` naming the file, never another exception, a crash or a hang, and the C and
pure Python paths agree on it. Each case here is one the loader once crashed, raised
something else, or hung on. Expectations are computed from the raw JSON in the test."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import tracemagic
from tracemagic.errors import TraceError
from tracemagic.trace import parse, read, structure

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data" / "traces"
TABLES = ("steps", "ops", "kernels", "layers", "memory", "shapes")


def op(**fields: Any) -> dict[str, Any]:
    base = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0}
    return {**base, **fields}


def kernel(**fields: Any) -> dict[str, Any]:
    base = {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 12.0, "dur": 2.0,
            "args": {"device": 0, "stream": 7, "correlation": 1}}
    return {**base, **fields}


def trace_text(events: list[Any], **meta: Any) -> str:
    return json.dumps({"schemaVersion": 1, **meta, "traceEvents": events})


def load_both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(C path, pure Python path): each a loaded trace with its tables computed, or the
    TraceError it raised; any other exception fails the test."""

    def one() -> Any:
        try:
            trace = tracemagic.load(path, use_cache=False)
        except TraceError as exc:
            assert str(path) in str(exc), f"the error does not name the file: {exc}"
            return exc
        for table in TABLES:
            getattr(trace, table)()
        return trace

    fast = one()
    with monkeypatch.context() as m:
        m.setattr(parse, "_scan", None)
        m.setattr(structure, "_nesting", None)
        slow = one()
    return fast, slow


def same(fast: Any, slow: Any) -> Any:
    """The one result both paths gave (same tables, or the same error)."""
    if isinstance(fast, TraceError) or isinstance(slow, TraceError):
        assert type(fast) is type(slow) and str(fast) == str(slow)
        return fast
    pd.testing.assert_frame_equal(fast.events, slow.events)
    pd.testing.assert_frame_equal(fast.flows, slow.flows)
    assert fast.meta == slow.meta
    for table in TABLES:
        pd.testing.assert_frame_equal(getattr(fast, table)(), getattr(slow, table)(), obj=table)
    return fast


def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | bytes, name: str = "t.json") -> Any:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return same(*load_both(path, monkeypatch))


def isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter, so a crash or a hang fails the test, not pytest."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env)


# -- the C scanner: numbers beyond 64 bits where it reads raw JSON (segfaulted) ----------------

BIG = ["18446744073709551616", "1e400", "[-9223372036854775809]", "[[8, 18446744073709551616], [1e400]]"]


@pytest.mark.parametrize("value", BIG)
def test_numbers_beyond_64_bits_in_raw_args_do_not_crash_the_scanner(value: str, tmp_path: Path) -> None:
    text = '{"traceEvents": [%s, %s]}' % (
        json.dumps(op()).replace('"dur": 5.0', '"dur": 5.0, "args": {"Input Dims": %s, "Input type": %s}' % (value, value)),
        json.dumps(op(ts=20.0, args={"Input Dims": [[1, 2]]})),
    )
    path = tmp_path / "big.json"
    path.write_text(text)
    done = isolated(f"""
        import json, tracemagic
        from tracemagic.trace import parse, structure
        chunk = open({str(path)!r}, "rb").read()
        start = chunk.index(b"[")
        assert parse._scan.scan(chunk[start:-1]) is not None, "the scanner reads it"
        out = []
        for c_path in (True, False):
            if not c_path:
                parse._scan, structure._nesting = None, None
            trace = tracemagic.load({str(path)!r}, use_cache=False)
            values = trace.events["input_dims"].tolist() + trace.events["input_type"].tolist()
            out.append([v if isinstance(v, str) else None for v in values])
        print(json.dumps(out))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    fast, slow = json.loads(done.stdout)
    expected = json.dumps(json.loads(value))  # Python's json reads 1e400 as inf, written Infinity
    assert fast == slow == [expected, "[[1, 2]]", expected, None]


def test_a_deeply_nested_raw_arg_is_left_to_the_python_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scanner's hashing recursed without bound on nested values."""
    deep = "[" * 100_000 + "]" * 100_000
    text = '{"traceEvents": [%s]}' % json.dumps(op(args={"Input Dims": "DEEP"})).replace('"DEEP"', deep)
    trace = loaded(tmp_path, monkeypatch, text)
    (dims,) = trace.events["input_dims"].astype(str).tolist()
    # kept to MAX_NESTING levels in all (the array of events, the event and its args among them)
    match = re.fullmatch(r'(\[+)"<nested too deep>"(\]+)', dims)
    assert match and len(match.group(1)) == len(match.group(2)) >= parse.MAX_NESTING - 4


# -- invalid UTF-8, nesting deeper than msgspec reads ----------------------------------------------


def test_invalid_utf8_in_a_name_is_read_as_question_marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = trace_text([op(name="aten::XX"), op(ts=20.0)]).encode().replace(b"XX", b"\xff\xfe")
    trace = loaded(tmp_path, monkeypatch, data)
    assert trace.events["name"].astype(str).tolist() == ["aten::??", "aten::mm"]
    offset = data.index(bytes([0xFF]))
    assert f"invalid UTF-8 at byte {offset} (2 bytes in all read as '?')" in " ".join(trace.warnings)


@pytest.mark.parametrize("where", ["events", "metadata", "after the events"])
def test_invalid_utf8_anywhere_loads_or_says_where(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = [op(), op(ts=20.0, args={"note": "XX"})]
    meta = {"deviceProperties": [{"name": "XX"}]} if where == "metadata" else {}
    text = trace_text(events, **meta)
    if where == "after the events":
        text = text[:-1] + ', "extra": "XX"}'
    data = text.encode().replace(b"XX", b"\xc3(", 1)
    trace = loaded(tmp_path, monkeypatch, data)
    assert len(trace.events) == 2


@pytest.mark.parametrize("field", ["args", "name", "top", "metadata", "External id"])
def test_nesting_thousands_of_levels_deep(field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = "[" * 5000 + "1" + "]" * 5000
    event = op(args={"unknown": "DEEP"}) if field == "args" else op(name="DEEP") if field == "name" else op()
    if field == "External id":
        event = op(args={"External id": "DEEP"})
    if field == "top":
        event = {**op(), "extra": "DEEP"}
    meta = {"deviceProperties": "DEEP"} if field == "metadata" else {}
    text = trace_text([event, op(ts=20.0)], **meta).replace('"DEEP"', deep)
    trace = loaded(tmp_path, monkeypatch, text)
    assert len(trace.events) == 2
    if field == "name":  # a value in a text column shows what it was
        name, other = trace.events["name"].astype(str).tolist()
        assert "<nested too deep>" in name and other == "aten::mm"
    if field == "External id":
        assert trace.events["external_id"].isna().all()
        assert "1 values of args 'External id' are not numbers that fit int64; left missing" in trace.warnings


@pytest.mark.parametrize("depth", [300, 1_200, 5_000, 12_000])
def test_a_name_nested_too_deep_reads_the_same_on_every_python(depth: int, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # msgspec decodes a value whole up to the interpreter's C recursion limit (~1,000 levels on
    # 3.11, ~1,500 on 3.12, ~10,000 on 3.13) and only past it is the text repaired: 5,000 levels read as
    # 10,000 brackets on 3.13. Whatever the depth, the name is cut where the repair cuts it:
    # 198 lists (the event and the traceEvents list are the other two of MAX_NESTING's 200).
    deep = "[" * depth + "1" + "]" * depth
    text = trace_text([op(name="DEEP"), op(ts=20.0)]).replace('"DEEP"', deep)
    trace = loaded(tmp_path, monkeypatch, text)
    name, other = trace.events["name"].astype(str).tolist()
    assert name == "[" * 198 + "'<nested too deep>'" + "]" * 198 and other == "aten::mm"


@pytest.mark.parametrize("depth", [300, 1_200, 5_000])
def test_an_arg_nested_too_deep_reads_the_same_at_any_depth(depth: int, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # an arg lies in ``args`` too: 197 lists, where the repair cuts it past the recursion
    # limit, and where a value decoded whole is cut (it was 198 below the limit)
    deep = "[" * depth + "1" + "]" * depth
    text = trace_text([op(args={"Call stack": "DEEP"}), op(ts=20.0)]).replace('"DEEP"', deep)
    trace = loaded(tmp_path, monkeypatch, text)
    stack = trace.events["call_stack"].astype(str).tolist()[0]
    assert stack == "[" * 197 + "'<nested too deep>'" + "]" * 197


@pytest.mark.parametrize("events", [[], [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}}]],
                         ids=["no events", "metadata alone"])
def test_a_trace_with_no_timed_event_loads_empty_without_numpy_warnings(events: list[Any], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # the nanosecond check took the median of no timestamps: numpy's "Mean of empty slice"
    # and "invalid value encountered in scalar divide" reached the user
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = loaded(tmp_path, monkeypatch, trace_text(events))
        assert trace.events.empty and trace.ops().empty and trace.steps().empty


# -- odd step names, numbers that fit no column ----------------------------------------------------


def test_profiler_step_names_without_a_number_are_not_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["ProfilerStep#abc", "ProfilerStep#", "ProfilerStep#99999999999999999999", "ProfilerStep#3", "ProfilerStep#4x"]
    events = [op(cat="user_annotation", name=n, ts=100.0 * i, dur=50.0) for i, n in enumerate(names)]
    trace = loaded(tmp_path, monkeypatch, trace_text(events))
    numbered = [int(m.group(1)) for n in names if (m := re.match(r"ProfilerStep#(\d+)", n)) and len(m.group(1)) < 19]
    assert sorted(trace.steps()["step"].tolist()) == numbered == [3, 4]
    kinds = dict(zip(trace.events["name"].astype(str), trace.events["kind"].astype(str)))
    assert [kinds[n] for n in names] == ["user_annotation"] * 3 + ["step"] * 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ts", "1e400"), ("ts", "18446744073709551616"), ("dur", "1e400"), ("pid", "18446744073709551616"),
        ("tid", "-9223372036854775809"), ("External id", "18446744073709551616"), ("Sequence number", "1e400"),
        ("flops", "1e400"), ("correlation", "-9223372036854775809"), ("bytes", "99999999999999999999999999"),
        # integers beyond float64 too (400 digits: no float holds them; raised OverflowError)
        ("Python parent id", "1" + "0" * 399), ("External id", "-" + "9" * 400), ("flops", "1" + "0" * 399),
        ("Sequence number", "1" + "0" * 399), ("ts", "1" + "0" * 399), ("pid", "1" + "0" * 399),
    ],
)
def test_numbers_beyond_int64_and_float64(field: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args_field = field not in ("ts", "dur", "pid", "tid")
    event = op(args={field: "VALUE"}) if args_field else op(**{field: "VALUE"})
    text = trace_text([event, op(ts=20.0)]).replace('"VALUE"', value)
    trace = loaded(tmp_path, monkeypatch, text)
    events = trace.events
    number = json.loads(value)  # what the JSON says, read by Python
    try:
        finite = bool(np.isfinite(float(number)))
    except OverflowError:  # an integer beyond float64
        finite = False
    if field == "ts" and not finite:  # no time: the event is left out, said so
        assert len(events) == 1 and any("without a timestamp" in w for w in trace.warnings)
        return
    assert len(events) == 2
    if field in ("pid", "tid"):  # kept as the text it is
        assert str(events[field].iloc[0]) == value
    elif field == "dur":  # no duration: 0, said so
        assert events["dur"].tolist() == [0.0, 5.0]
        assert any(w.startswith("1 events have a dur that is not a finite number; read as 0") for w in trace.warnings)
    elif args_field:  # does not fit the column: missing, with a warning
        column = {"External id": "external_id", "Sequence number": "seq", "Python parent id": "python_parent_id"}.get(field, field)
        assert pd.isna(events[column].iloc[0])
        kind = "float64" if field == "flops" else "int64"
        assert f"1 values of args {field!r} are not numbers that fit {kind}; left missing" in trace.warnings


@pytest.mark.parametrize("rank", ["18446744073709551616", "1e400", "-5", "\"{'rank': 99999999999999}\""])
def test_distributed_info_rank_out_of_range(rank: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = trace_text([op()], distributedInfo="RANK").replace('"RANK"', '{"rank": %s, "world_size": 2}' % rank)
    trace = loaded(tmp_path, monkeypatch, text)
    assert trace.rank_ids == [0]


def test_no_pid_anywhere_and_one_gpu_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = [{k: v for k, v in kernel().items() if k not in ("pid", "tid")} | {"args": {}}]
    trace = loaded(tmp_path, monkeypatch, trace_text(events))
    assert trace.events["kind"].astype(str).tolist() == ["kernel"]
    assert trace.events["device"].isna().all() and trace.events["stream"].isna().all()


def test_ops_without_ts_that_carry_sequence_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """layers() merged on their missing times (ValueError); they are left out, with a warning."""
    events = [
        {"ph": "X", "cat": "python_function", "name": "nn.Module: Linear_0", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0},
        op(ts=10.0, args={"Sequence number": 4}),
        {k: v for k, v in op(name="aten::mm_backward", args={"Sequence number": 4, "Fwd thread id": 1}).items() if k != "ts"},
        {k: v for k, v in op(name="autograd::engine::evaluate_function: MmBackward0", args={"Sequence number": 4}).items() if k != "ts"},
    ]
    trace = loaded(tmp_path, monkeypatch, trace_text(events))
    without_ts = sum("ts" not in e for e in events)
    assert len(trace.events) == len(events) - without_ts
    assert any(f"{without_ts} events and 0 flow events without a timestamp" in w for w in trace.warnings)
    assert trace.layers()["layer"].astype(str).tolist() == ["Linear_0"]


def test_negative_durations_are_left_out_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch >= 2.7 writes dur -1 for an op still running when the profiler stopped
    (pytorch/pytorch#150131); a clock glitch gives a kernel a negative one. They were kept:
    a call of -1 µs, a negative GPU time in shapes(), silently."""
    events = [
        op(cat="user_annotation", name="ProfilerStep#1", ts=0.0, dur=1000.0),
        op(name="aten::linear", ts=10.0, dur=300.0, args={"External id": 1, "Input Dims": [[4, 4]]}),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20.0, "dur": 5.0,
         "args": {"External id": 1, "correlation": 1}},
        kernel(ts=40.0, dur=-300.0, args={"device": 0, "stream": 7, "correlation": 1, "External id": 1}),
        op(name="aten::unfinished", ts=900.0, dur=-1, args={"External id": 2, "Input Dims": [[4, 4]]}),
        op(name="aten::add", ts=910.0, dur=20.0, args={"External id": 3}),  # inside the unfinished op
    ]
    trace = loaded(tmp_path, monkeypatch, trace_text(events))
    assert len(trace.events) == len(events) - 2
    assert (trace.events["dur"] >= 0).all()
    assert "aten::unfinished" not in set(trace.ops()["name"].astype(str))
    assert trace.ops().set_index("name").loc["aten::add", "step"] == 1  # nests in the step instead
    assert (trace.shapes()["gpu_us"] >= 0).all() and (trace.shapes()["total_us"] >= 0).all()
    assert trace.kernels().empty
    (warning,) = [w for w in trace.warnings if "negative duration" in w]
    assert "2 events with a negative duration (dur) left out (1 cpu_op, 1 kernel)" in warning
    cached = tracemagic.load(tmp_path / "t.json", cache_dir=tmp_path / "cache")
    again = tracemagic.load(tmp_path / "t.json", cache_dir=tmp_path / "cache")  # from the cache
    assert cached.warnings == again.warnings == trace.warnings
    pd.testing.assert_frame_equal(again.events, trace.events)


def test_deep_and_odd_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = "{\"a\": " * 3000 + "1" + "}" * 3000
    text = trace_text([op()], deviceProperties="D1", distributedInfo="D2", extra="{(1, 2): b'x'}").replace('"D1"', deep).replace('"D2"', deep)
    trace = loaded(tmp_path, monkeypatch, text)
    meta = trace.meta["ranks"][0]
    assert meta["devices"] == [] and meta.get("rank") is None
    assert meta["extra"] == "{(1, 2): b'x'}"  # a Python repr JSON cannot hold stays text
    json.dumps(trace.meta)  # the metadata stays JSON (the cache stores it so)


# -- bounded resources: decompression, archives, FIFOs, symlinks, file names -----------------------


def bomb(size: int) -> bytes:
    """A valid trace whose gzip is ~1,000x smaller than its JSON (one long run of spaces)."""
    head, tail = b'{"traceEvents": [', b"]}"
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as packed:
        packed.write(head)
        block = b" " * (1 << 20)
        for _ in range(size >> 20):
            packed.write(block)
        packed.write(json.dumps(op()).encode() + tail)
    return out.getvalue()


def test_a_decompression_bomb_stops_at_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(bomb(64 << 20))
    assert path.stat().st_size < (1 << 20)
    done = isolated(f"""
        import resource, tracemagic
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            tracemagic.load({str(path)!r}, use_cache=False, max_bytes=16 << 20)
        except tracemagic.TraceError as exc:
            print(exc)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print("grown_kib", grown)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    message, grown = done.stdout.rsplit("grown_kib", 1)
    assert str(path) in message and "max_bytes" in message and f"{16 << 20:,}" in message
    assert int(grown) < 48 << 10, "memory stayed far below the 64 MiB of JSON"
    # a larger max_bytes is not enough: it inflates ~1,000 times (over read.MAX_RATIO)
    with pytest.raises(TraceError, match="allow_high_compression=True"):
        tracemagic.load(path, use_cache=False, max_bytes=80 << 20)
    # both together load it
    trace = tracemagic.load(path, use_cache=False, max_bytes=80 << 20, allow_high_compression=True)
    assert len(trace.events) == 1


class Spaces(io.RawIOBase):
    """``size`` spaces read as a stream (so a test writes GiBs of JSON without holding them)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = b" " * count
        self.left -= count
        return count


def test_a_4_gib_bomb_is_refused_by_its_ratio_before_it_is_inflated(tmp_path: Path) -> None:
    """The bomb of issue 24: a 4 MB .json.gz of 4 GiB of JSON, well under the default
    max_bytes of a large machine. Written as 256 gzip members of 16 MiB of spaces each
    (a gzip file may hold several; each member compresses ~1,000 times)."""
    member = gzip.compress(b" " * (16 << 20), compresslevel=9)
    path = tmp_path / "bomb.json.gz"
    with open(path, "wb") as out:
        out.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(256):
            out.write(member)
        out.write(gzip.compress(json.dumps(op()).encode() + b"]}"))
    packed = path.stat().st_size
    assert packed < 5 << 20
    assert (4 << 30) / packed > 1000
    done = isolated(f"""
        import resource, tracemagic
        from tracemagic.trace import read
        read.default_max_bytes = lambda: 8 << 30  # the default on a machine with 16 GiB free
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            tracemagic.load({str(path)!r}, use_cache=False)
        except tracemagic.TraceError as exc:
            print(exc)
        print("grown_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    message, grown = done.stdout.rsplit("grown_kib", 1)
    assert str(path) in message and "decompression bomb" in message, message
    assert "allow_high_compression=True" in message and "max_bytes=" in message
    # refused once 64 MiB (read.RATIO_CHECK_BYTES) came out, far from the 4 GiB
    assert int(grown) < 512 << 10, f"memory grew by {int(grown) >> 10} MiB"


def test_a_tar_gz_inflating_too_much_is_refused_by_its_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its members' sizes are in the archive: the ratio is checked before any is read."""
    monkeypatch.setattr(read, "RATIO_CHECK_BYTES", 4 << 20)  # 64 MiB of spaces would take seconds
    path = tmp_path / "bomb.tar.gz"
    size = 8 << 20
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("rank0.json")
        head, tail = b'{"traceEvents": [', b"]}"
        info.size = size
        archive.addfile(info, io.BufferedReader(_Joined(head, Spaces(size - len(head) - len(tail)), tail)))
    assert size / path.stat().st_size > 200
    with pytest.raises(TraceError, match="allow_high_compression=True") as error:
        tracemagic.load(path, use_cache=False)
    assert str(path) in str(error.value)
    assert tracemagic.load(path, use_cache=False, allow_high_compression=True).events.empty


class _Joined(io.RawIOBase):
    """Bytes, a stream, bytes: one stream."""

    def __init__(self, head: bytes, middle: io.RawIOBase, tail: bytes) -> None:
        self.parts: list[Any] = [io.BytesIO(head), middle, io.BytesIO(tail)]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self.parts:
            count = self.parts[0].readinto(buffer)
            if count:
                return count
            self.parts.pop(0)
        return 0


def test_running_out_of_memory_is_a_trace_error_naming_max_bytes(tmp_path: Path) -> None:
    """Allowed past the ratio check and max_bytes, a load that needs more memory than there
    is says so (here the address space is capped at 300 MiB above what the interpreter uses)."""
    path = tmp_path / "big.json.gz"
    path.write_bytes(bomb(512 << 20))
    done = isolated(f"""
        import resource, tracemagic
        tracemagic.load({str(TRACES / "hta_triton_example.json.gz")!r}, use_cache=False)  # all imported
        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (used + (300 << 20), resource.RLIM_INFINITY))
        try:
            tracemagic.load({str(path)!r}, use_cache=False, workers=1, max_bytes=1 << 30,
                            allow_high_compression=True)
        except tracemagic.TraceError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    message = done.stdout
    assert str(path) in message and "ran out of memory" in message, message
    assert f"max_bytes={1 << 30:,}" in message and "smaller max_bytes=" in message


def test_the_default_max_bytes_is_half_the_memory_available() -> None:
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    expected = max(available // 2, 256 << 20)
    assert abs(read.default_max_bytes() - expected) < 0.1 * expected


def test_the_default_limit_loads_the_real_traces(tmp_path: Path) -> None:
    trace = tracemagic.load(TRACES / "param_dlrm_kineto.tar.gz", use_cache=False)
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        ranks = [m for m in archive if m.isfile() and m.name.endswith(".json")]
    assert trace.rank_ids == list(range(len(ranks)))


def test_a_bomb_inside_a_tar_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bomb.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("rank0.json")
        info.size = 64 << 20
        archive.addfile(info, io.BytesIO(b'{"traceEvents": [' + b" " * (info.size - 19) + b"]}"))
    with pytest.raises(TraceError, match="max_bytes") as error:
        tracemagic.load(path, use_cache=False, max_bytes=16 << 20)
    assert str(path) in str(error.value)


def make_tar(path: Path, members: int, text: bytes) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for rank in range(members):
            info = tarfile.TarInfo(f"run/rank{rank}.json")
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))


def test_a_tar_is_read_in_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each member was looked up by name from the archive's start (every header read again,
    the gzip decompressed again): a tar.gz of 2,000 traces ran past 300 s."""
    path = tmp_path / "many.tar.gz"
    make_tar(path, 100, trace_text([op(args={"pad": "x" * 20_000}), op(ts=20.0)]).encode())
    opened: list[Any] = []
    real = tarfile.open
    monkeypatch.setattr(tarfile, "open", lambda *args, **kwargs: opened.append(args) or real(*args, **kwargs))
    trace = tracemagic.load(path, use_cache=False)
    assert trace.rank_ids == list(range(100)) and len(trace.events) == 200
    assert len(opened) == 2  # once to list the members, once to read them all


def test_a_tar_with_too_many_entries_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "entries.tar"
    with tarfile.open(path, "w") as archive:
        for i in range(read.MAX_ARCHIVE_ENTRIES + 1):
            archive.addfile(tarfile.TarInfo(f"notes/{i}.txt"), io.BytesIO(b""))
    with pytest.raises(TraceError, match="more than 10,000 entries") as error:
        tracemagic.load(path, use_cache=False)
    assert str(path) in str(error.value)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    done = isolated(f"""
        import tracemagic
        try:
            tracemagic.load({str(fifo)!r}, use_cache=False)
        except tracemagic.TraceError as exc:
            print(exc)
    """, timeout=60)
    assert "not a regular file" in done.stdout and str(fifo) in done.stdout


def test_a_fifo_in_a_rank_folder_is_not_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rank0.json").write_text(trace_text([op()]))
    os.mkfifo(tmp_path / "rank1.json")
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(tracemagic.load(tmp_path, use_cache=False)), daemon=True)
    worker.start()
    worker.join(60)
    assert result and result[0].rank_ids == [0]


def test_symlinks_out_of_the_folder_are_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"password": "hunter2", "traceEvents": []}')
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "rank1.json").symlink_to(secret)
    with pytest.raises(TraceError, match="symlinks to files outside the folder") as error:
        tracemagic.load(folder, use_cache=False)
    assert "hunter2" not in str(error.value)
    (folder / "rank0.json").write_text(trace_text([op()]))
    (folder / "rank2.json").symlink_to(folder / "rank0.json")  # inside: followed
    trace = tracemagic.load(folder, use_cache=False)
    assert trace.rank_ids == [0, 2]
    assert any("skipped 1 symlinks" in w and "rank1.json" in w for w in trace.warnings)


def test_a_manifest_cannot_list_a_symlink_out_of_its_folder(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text(trace_text([op(name="outside")]))
    folder = tmp_path / "capture"
    folder.mkdir()
    (folder / "kineto_trace_0.json").write_text(trace_text([op(name="inside")]))
    (folder / "kineto_trace_1.json").symlink_to(outside)
    files = [{"path": f"kineto_trace_{r}.json", "kind": "kineto", "rank": r} for r in (0, 1)]
    (folder / "capture.json").write_text(json.dumps({"files": files}))
    trace = tracemagic.load(folder, use_cache=False)
    assert trace.events["name"].astype(str).tolist() == ["inside"]


@pytest.mark.parametrize("name", ["a" * 237 + ".json.gz", os.fsdecode(b"caf\xe9-\xff.json.gz")])
def test_long_and_non_utf8_file_names(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_bytes((TRACES / "hta_triton_example.json.gz").read_bytes())
    trace = tracemagic.load(path, use_cache=False)
    raw = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert len(trace.events) == sum(e.get("ph") in ("X", "i", "I") for e in raw)
    cached = [tracemagic.load(path, cache_dir=tmp_path / "cache") for _ in range(2)]  # written, then read back
    assert [len(t.events) for t in cached] == [len(trace.events)] * 2 and len(list((tmp_path / "cache").iterdir())) == 3
    broken = tmp_path / ("b" + name)
    broken.write_bytes(b"\x00garbage")
    with pytest.raises(TraceError) as error:
        tracemagic.load(broken, use_cache=False)
    assert str(broken) in str(error.value)


def test_every_truncation_of_a_small_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-written file cut every 331 bytes: a trace or a TraceError, the same on both paths."""
    data = gzip.decompress((TRACES / "hta_triton_example.json.gz").read_bytes())
    for cut in range(0, len(data), 331):
        path = tmp_path / f"cut{cut}.json"
        path.write_bytes(data[:cut])
        same(*load_both(path, monkeypatch))
