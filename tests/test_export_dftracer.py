"""DFTracer ``.pfw`` export, read-back and the ``on_trace_ready`` handler (``tracemagic.export.dftracer``)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import TRACES

import tracemagic
from tracemagic.errors import TraceError
from tracemagic.export import dftracer

import torch  # noqa: E402
ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[tracemagic.Trace, float, float]:
    """A fresh CPU capture with memory, and the wall clock (µs) around it."""
    from torch.profiler import ProfilerActivity, profile, schedule

    folder = tmp_path_factory.mktemp("pfw")
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    before = time.time() * 1e6
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=2),
        on_trace_ready=lambda p: p.export_chrome_trace(str(folder / "trace.json")),
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
    ) as prof:
        for _ in range(3):
            model(torch.randn(32, 16)).sum().backward()
            prof.step()
    after = time.time() * 1e6
    return tracemagic.load(folder / "trace.json", use_cache=False), before, after


def read_lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode().splitlines()


def test_format_is_dftracers(cpu_trace, tmp_path: Path) -> None:
    trace, before, after = cpu_trace
    (path,) = dftracer.to_pfw(trace, tmp_path / "run.pfw")
    lines = read_lines(path)
    assert lines[0] == "[" and lines[-1] != "]"  # DFTracer: opening bracket only
    events = [json.loads(line) for line in lines[1:]]
    meta = [e for e in events if e["ph"] == "M"]
    ops = [e for e in events if e["ph"] == "X"]
    assert {m["name"] for m in meta} >= {"HH", "process_name"}
    assert [e["id"] for e in events] == list(range(len(events)))
    assert {e["cat"] for e in ops} == {"PP"}
    for e in ops:
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["args"]["device"] == "cpu" and "hhash" in e["args"]
    # on the wall clock, inside the capture's window, not near zero
    ts = np.array([e["ts"] for e in ops])
    assert before - 1e6 <= ts.min() and ts.max() <= after + 1e6
    linear = next(e for e in ops if e["name"] == "aten::linear")
    assert json.loads(linear["args"]["input_shapes"]) == [[32, 16], [64, 16], [64]]
    assert linear["args"]["module"].startswith("Linear_")
    assert any(e["args"].get("cpu_memory", 0) > 0 for e in ops)
    assert not any(e["name"].startswith("<built-in") for e in ops)  # only nn.Module python frames


def test_round_trip_plain_and_gz(cpu_trace, tmp_path: Path) -> None:
    trace, _, _ = cpu_trace
    offset = dftracer.wall_clock_offset_us(trace, 0)
    assert offset > 1.5e15  # baseTimeNanoseconds on torch 2.13
    for name in ("a.pfw", "a.pfw.gz"):
        (path,) = dftracer.to_pfw(trace, tmp_path / name)
        back = dftracer.pfw_trace(path)
        assert back.path == path
        events = dftracer.read_pfw(path)
        kinds = ("cpu_op", "step", "memory")
        for kind in kinds:
            assert (events["kind"] == kind).sum() == (trace.events["kind"] == kind).sum()
        orig = trace.events[trace.events["kind"] == "cpu_op"].sort_values("ts")
        got = events[events["kind"] == "cpu_op"].sort_values("ts")
        assert list(got["name"].astype(str)) == list(orig["name"].astype(str))
        assert np.allclose(got["ts"].to_numpy(), np.floor(orig["ts"].to_numpy() + offset), atol=1)
        assert (got["rf_id"].to_numpy() == orig["rf_id"].to_numpy()).all()
        shapes = [[None if v is None or v != v else json.loads(v) for v in f["input_dims"]] for f in (got, orig)]
        assert shapes[0] == shapes[1] and any(shapes[0])
        mem = events[events["kind"] == "memory"]
        assert mem["total_allocated"].notna().all() and mem["bytes"].notna().all()
        assert set(events["step"]) - {-1} == set(trace.events["step"]) - {-1} == {1, 2}
    assert (tmp_path / "a.pfw.gz").read_bytes()[:2] == b"\x1f\x8b"


def test_real_gpu_traces_round_trip(tmp_path: Path) -> None:
    for name, epoch_from_base in (("hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz", True), ("hta_benchmark_simple_add_trace.json.gz", False)):
        trace = tracemagic.load(TRACES / name, use_cache=False)
        (path,) = dftracer.to_pfw(trace, tmp_path / name.replace(".json.gz", ".pfw.gz"))
        back = dftracer.read_pfw(path)
        for kind in ("kernel", "memcpy", "cpu_op"):
            assert (back["kind"] == kind).sum() == (trace.events["kind"] == kind).sum()
        assert back["ts"].min() > 1.5e15  # epoch µs either from baseTimeNanoseconds or as written
        kern = back[back["kind"] == "kernel"]
        assert kern["device"].notna().all() and kern["stream"].notna().all()
        assert (dftracer.wall_clock_offset_us(trace, trace.rank_ids[0]) > 0) == epoch_from_base


def test_trace_handler_writes_each_cycle(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule

    out = tmp_path / "pfw"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=0, active=1, repeat=2),
        on_trace_ready=dftracer.trace_handler(out, worker_name="w0"),
    ) as prof:
        for _ in range(3):
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.step()
    files = sorted(p.name for p in out.iterdir())
    assert files == ["w0.1.pfw.gz", "w0.2.pfw.gz"]
    names = set(dftracer.read_pfw(out / files[0])["name"].astype(str))
    assert "aten::mm" in names


def test_bad_input(cpu_trace, tmp_path: Path) -> None:
    trace, _, _ = cpu_trace
    with pytest.raises(ValueError, match=r"\.pfw"):
        dftracer.to_pfw(trace, tmp_path / "x.json")
    with pytest.raises(ValueError, match="kinds"):
        dftracer.to_pfw(trace, tmp_path / "x.pfw", kinds=("cpu_ops",))
    (tmp_path / "bad.pfw").write_text("[\n{not json}\n")
    with pytest.raises(TraceError, match="not JSON"):
        dftracer.read_pfw(tmp_path / "bad.pfw")
    (tmp_path / "empty.pfw").write_text("[\n")
    with pytest.raises(TraceError, match="no events"):
        dftracer.read_pfw(tmp_path / "empty.pfw")
    with pytest.raises(TraceError, match="no such"):
        dftracer.read_pfw(tmp_path / "missing.pfw")


def test_foreign_dftracer_events_load(tmp_path: Path) -> None:
    path = tmp_path / "posix.pfw"
    path.write_text(
        "[\n"
        '{"id":0,"name":"open","cat":"POSIX","pid":1,"tid":1,"ts":1698080323781412,"dur":3430,"ph":"X","args":{"fname":"/x"}}\n'
        '{"id":1,"name":"read","cat":"POSIX","pid":1,"tid":1,"ts":1698080323785831,"dur":24,"ph":"X","args":{"ret":131072}}\n'
    )
    events = dftracer.read_pfw(path)
    assert list(events["name"].astype(str)) == ["open", "read"]
    assert list(events["cat"].astype(str)) == ["POSIX", "POSIX"] and list(events["dur"]) == [3430, 24]


@pytest.mark.slow
def test_dftracer_own_tools_read_our_output(cpu_trace, tmp_path: Path, throwaway_venv) -> None:
    """dftracer-utils (DFTracer's analysis reader, from PyPI) reads our .pfw.gz."""
    trace, _, _ = cpu_trace
    (path,) = dftracer.to_pfw(trace, tmp_path / "run.pfw.gz")
    python = throwaway_venv("dftracer", ["dftracer-utils==0.0.14", "pydftracer==2.0.6"])
    script = (
        "import json, sys\n"
        "from dftracer.utils import TraceViewer\n"
        "df = TraceViewer(sys.argv[1], index_path=sys.argv[2]).collect()\n"
        "cols = ['name', 'cat', 'ts', 'dur', 'args.device', 'args.kind']\n"
        "print(json.dumps({'rows': len(df), 'columns': df.columns,"
        " 'head': {c: df[c].to_list()[:50] for c in cols}}))\n"
    )
    done = subprocess.run(
        [str(python), "-c", script, str(path), str(tmp_path / "index")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "DFTRACER_UTILS_LOG_LEVEL": "error"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ops = [json.loads(x) for x in read_lines(path)[1:] if '"ph":"X"' in x]
    assert result["rows"] == len(ops)
    head = result["head"]
    assert head["name"] == [e["name"] for e in ops][:50]
    assert set(head["cat"]) == {"PP"} and head["ts"] == [e["ts"] for e in ops][:50]
    assert "args.input_shapes" in result["columns"] and "args.cpu_memory" in result["columns"]
    validate = subprocess.run(
        [str(python.parent / "dftracer_validate"), "--files", str(path)], capture_output=True, text=True, timeout=120
    )
    assert "1 passed, 0 failed" in validate.stdout + validate.stderr


def _minitoy(tmp_path: Path, change, text: tuple[str, str] = ("", "")) -> tracemagic.Trace:
    """The small real GPU trace with ``change`` applied to its JSON document (then ``text``
    replaced in the JSON: what ``json`` cannot write), loaded."""
    doc = json.loads(gzip.decompress((TRACES / "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz").read_bytes()))
    change(doc)
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(doc).replace(*text) if text[0] else json.dumps(doc))
    return tracemagic.load(path, use_cache=False)


@pytest.mark.parametrize("field", ["pid", "ts"])
def test_values_beyond_64_bits_are_written(field: str, tmp_path: Path) -> None:
    """A pid beyond 64 bits (load keeps it as text) or a ts no integer holds: the file is
    still written, every line JSON, no raw error and no numpy warning."""

    def huge(doc: dict) -> None:
        if field == "ts":
            next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")["ts"] = 1e300
            return
        for event in doc["traceEvents"]:
            if event.get("pid") == 597913:
                event["pid"] = 2**70

    trace = _minitoy(tmp_path, huge)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (path,) = trace.to_pfw(tmp_path / "run.pfw")
    events = [json.loads(line) for line in read_lines(path)[1:]]
    pids = {e["pid"] for e in events}
    assert all(isinstance(p, int) and -(2**63) <= p < 2**63 for p in pids)
    timed = [e for e in events if e["ph"] == "X"]
    assert all(-(2**63) <= e["ts"] < 2**63 and 0 <= e["dur"] < 2**63 for e in timed)
    assert {e["name"] for e in timed} >= {"aten::linear", "ProfilerStep#1"}
    assert len(tracemagic.load(path, use_cache=False).events) == len(timed)
    if field == "pid":
        assert "1180591620717411303424" in set(trace.events["pid"].astype(str))
        assert len(pids - {0, 2}) == 1  # the big pid: one process, under a stable stand-in number


def test_base_time_that_is_no_number(tmp_path: Path) -> None:
    """A ``baseTimeNanoseconds`` beyond float64 (1e400: kept as text) places nothing: the
    usual TraceError asking for ``offset_us``, and with it the file is written."""

    def odd(doc: dict) -> None:
        doc["baseTimeNanoseconds"] = "BASE"

    trace = _minitoy(tmp_path, odd, ('"BASE"', "1e400"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TraceError, match="offset_us"):
            trace.to_pfw(tmp_path / "run.pfw")
        (out,) = trace.to_pfw(tmp_path / "run.pfw", offset_us=1.7e15)
    assert all(json.loads(line) for line in read_lines(out)[1:])


def test_a_field_orjson_cannot_write_is_written_as_text() -> None:
    """The last guard of every line (no value ``load`` gives reaches it today): an integer
    beyond 64 bits, a lone surrogate, an object of another type become text."""
    line = dftracer._dumps({"pid": 1, "args": {"big": 2**70, "name": "a\ud800b", "odd": {1, 2}, "ok": [1.5, None]}})
    assert json.loads(line) == {"pid": 1, "args": {"big": str(2**70), "name": "a?b", "odd": "{1, 2}", "ok": [1.5, None]}}


def test_module_frames_are_kept_without_copying_every_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which python frames are written (the ``nn.Module`` ones) is decided per distinct name:
    ``numpy.char`` copied every name at the longest one's width first (half a GB on a GPU
    trace of 75,000 events); the lines follow the raw JSON."""
    long_frame = "torch/nn/modules/module.py(1750): _call_impl" + "x" * 5000
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 7, "tid": 7, "ts": 100, "dur": 100},
        {"ph": "X", "cat": "python_function", "name": "nn.Module: Linear_0", "pid": 7, "tid": 7, "ts": 110, "dur": 50},
        {"ph": "X", "cat": "python_function", "name": long_frame, "pid": 7, "tid": 7, "ts": 111, "dur": 48},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 7, "tid": 7, "ts": 120, "dur": 30.7,
         "args": {"External id": 5, "Record function id": 9, "Sequence number": 4,
                  "Input Dims": [[2, 3], [4, 3]], "Input type": ["float", "float"]}},
        {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 7, "tid": 7, "ts": 125,
         "args": {"Device Type": 0, "Device Id": -1, "Addr": 1, "Bytes": 64, "Total Allocated": 64,
                  "Total Reserved": 0}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": 1_700_000_000_000_000_000}))
    trace = tracemagic.load(path, use_cache=False)
    for name in ("startswith", "str_len"):  # a fixed-width copy of the names is what is checked
        if hasattr(np.char, name):
            monkeypatch.setattr(np.char, name, lambda *a, **k: pytest.fail("numpy.char on the names"))
    (out,) = dftracer.to_pfw(trace, tmp_path / "t.pfw")
    lines = [json.loads(x) for x in read_lines(out)[1:]]
    written = {e["name"]: e for e in lines if e["ph"] == "X"}
    assert set(written) == {"ProfilerStep#3", "nn.Module: Linear_0", "aten::linear", "[memory]"}  # not the long frame
    base = 1_700_000_000_000_000
    op = written["aten::linear"]
    assert (op["ts"], op["dur"], op["pid"], op["tid"]) == (base + 120, 30, 7, 7)
    assert op["args"]["external_id"] == 5 and op["args"]["rf_id"] == 9 and op["args"]["seq"] == 4
    assert json.loads(op["args"]["input_shapes"]) == [[2, 3], [4, 3]]
    assert op["args"]["module"] == "Linear_0" and op["args"]["step"] == 3 and op["args"]["cpu_memory"] == 64
    mem = written["[memory]"]
    assert mem["args"]["device"] == "cpu" and (mem["args"]["bytes"], mem["args"]["total_allocated"]) == (64, 64)
    assert "module" not in written["nn.Module: Linear_0"]["args"]
