"""Trimmed Chrome/Perfetto export, TensorBoard names, and HolisticTraceAnalysis reading our traces."""

from __future__ import annotations

import gc
import gzip
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import TRACES

import tracemagic
from tracemagic.errors import TraceError
from tracemagic.export import chrome

import torch  # noqa: E402
ROOT = Path(__file__).resolve().parents[1]
#: HTA 0.5 breaks on pandas 3: its own environment, torch pinned so nothing pulls CUDA wheels
HTA_REQUIREMENTS = ["holistictraceanalysis==0.5.0", "pandas<3"]



@pytest.fixture(scope="module")
def cpu_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch 2.13 CPU trace of 3 active steps, as torch.profiler writes it."""
    from torch.profiler import ProfilerActivity, profile, schedule

    path = tmp_path_factory.mktemp("cpu") / "kineto_trace_0.json"
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=3),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        record_shapes=True,
        with_stack=True,
    ) as prof:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
            prof.step()
    return path


def test_tb_name() -> None:
    assert chrome.tb_name("worker0", 1623143089861) == "worker0.1623143089861.pt.trace.json"
    assert chrome.tb_name("w", 5, gz=True) == "w.5.pt.trace.json.gz"
    assert re.fullmatch(r".+_\d+\.\d{19}\.pt\.trace\.json", chrome.tb_name())  # time.time_ns(), as torch 2.13
    with pytest.raises(ValueError):
        chrome.tb_name("a/b")
    # tracemagic and torch's own reader both recognise the name as a trace
    from tracemagic.trace.read import is_trace_name

    assert is_trace_name(chrome.tb_name("w", 1, gz=True))


def test_step_cut_keeps_gpu_work_and_metadata(tmp_path: Path) -> None:
    trace = tracemagic.load(TRACES / "hta_nccl_data.json.gz", use_cache=False)
    (out,) = chrome.to_chrome_trace(trace, tmp_path / "step5.json.gz", steps=[5])
    cut = tracemagic.load(out, use_cache=False)
    ev, orig = cut.events, trace.events
    assert set(ev.loc[ev["kind"] == "step", "name"].astype(str)) == {"ProfilerStep#5"}
    for kind in ("kernel", "runtime", "memcpy"):
        want = ((orig["kind"] == kind) & (orig["step"] == 5)).sum()
        assert (ev["kind"] == kind).sum() == want > 0
    assert (ev.loc[ev["kind"] == "kernel", "launch"] >= 0).all()  # every kernel with its launch
    assert ev["collective"].notna().sum() > 0  # NCCL args copied byte for byte
    assert len(cut.flows) > 0 and cut.devices == trace.devices
    top = json.loads(gzip.decompress(out.read_bytes()))
    assert top["distributedInfo"]["rank"] == 0 and "baseTimeNanoseconds" in top
    assert out.stat().st_size < (TRACES / "hta_nccl_data.json.gz").stat().st_size


def test_max_events_and_whole_copy(tmp_path: Path) -> None:
    trace = tracemagic.load(TRACES / "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz", use_cache=False)
    (whole,) = chrome.to_chrome_trace(trace, tmp_path / "all.json")
    back = tracemagic.load(whole, use_cache=False)
    assert len(back.events) == len(trace.events) and len(back.flows) == len(trace.flows)
    (small,) = chrome.to_chrome_trace(trace, tmp_path / "small.json", max_events=60)
    cut = tracemagic.load(small, use_cache=False)
    assert len(cut.events) <= 60 and (cut.events["kind"] == "step").sum() >= 1
    with pytest.raises(ValueError, match="ProfilerStep"):
        chrome.to_chrome_trace(trace, tmp_path / "x.json", steps=[99])
    with pytest.raises(ValueError, match="max_events"):
        chrome.to_chrome_trace(trace, tmp_path / "x.json", max_events=0)


def test_ns_and_old_and_multirank_traces(tmp_path: Path) -> None:
    ns = tracemagic.load(TRACES / "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz", use_cache=False)
    first = int(ns.events.loc[ns.events["kind"] == "step", "step"].min())
    (out,) = chrome.to_chrome_trace(ns, tmp_path / "ns.json.gz", steps=[first])
    cut = tracemagic.load(out, use_cache=False)
    assert (cut.events["kind"] == "kernel").sum() == ((ns.events["kind"] == "kernel") & (ns.events["step"] == first)).sum()
    ranks = tracemagic.load(TRACES / "param_dlrm_kineto.tar.gz", use_cache=False)
    step = int(ranks.events.loc[ranks.events["kind"] == "step", "step"].min())
    files = chrome.to_chrome_trace(ranks, tmp_path / "dlrm", steps=[step])
    assert [f.name for f in files] == [f"rank{r}.pt.trace.json" for r in range(8)]
    again = tracemagic.load(tmp_path / "dlrm", use_cache=False)
    assert again.rank_ids == list(range(8))


def test_cpu_capture_cut(cpu_capture: Path, tmp_path: Path) -> None:
    trace = tracemagic.load(cpu_capture, use_cache=False)
    (out,) = chrome.to_chrome_trace(trace, tmp_path / "cpu.json", steps=[2])
    cut = tracemagic.load(out, use_cache=False)
    ops = cut.events[cut.events["kind"] == "cpu_op"]
    assert len(ops) == ((trace.events["kind"] == "cpu_op") & (trace.events["step"] == 2)).sum()
    assert set(ops["step"]) == {2}
    shutil.copy(cpu_capture, tmp_path / "moved.json")
    moved = tracemagic.load(tmp_path / "moved.json", use_cache=False)
    (tmp_path / "moved.json").unlink()
    with pytest.raises(TraceError):
        chrome.to_chrome_trace(moved, tmp_path / "y.json")


HTA_SCRIPT = r"""
import json, sys
from hta.trace_analysis import TraceAnalysis
out = {}
for folder in sys.argv[1:]:
    analysis = TraceAnalysis(trace_dir=folder)
    ranks = analysis.t.get_ranks()
    df = analysis.t.get_trace(ranks[0])
    names = analysis.t.symbol_table.get_sym_table()
    result = {"ranks": ranks, "rows": len(df), "iterations": analysis.t.get_iterations(ranks[0]),
              "cpu_ops": int((df["cat"].map(lambda c: names[c]) == "cpu_op").sum())}
    if (df["stream"] >= 0).any():
        tb = analysis.get_temporal_breakdown(visualize=False)
        result["kernel_time"] = float(tb["kernel_time(us)"].iloc[0])
    out[folder] = result
print(json.dumps(out, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
"""


@pytest.mark.slow
def test_hta_reads_our_traces(cpu_capture: Path, tmp_path: Path, throwaway_venv) -> None:
    """HolisticTraceAnalysis (in its own pandas<3 venv) loads a CPU capture unchanged and
    the real GPU traces after a round trip through to_chrome_trace."""
    python = throwaway_venv("hta", HTA_REQUIREMENTS)
    folders = {}
    cpu_dir = tmp_path / "cpu"
    cpu_dir.mkdir()
    shutil.copy(cpu_capture, cpu_dir / cpu_capture.name)  # unchanged, as torch wrote it
    folders["cpu"] = cpu_dir
    for name, steps in (("hta_nccl_data.json.gz", [4]), ("hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz", None)):
        trace = tracemagic.load(TRACES / name, use_cache=False)
        folder = tmp_path / name.split(".")[0]
        chrome.to_chrome_trace(trace, folder / chrome.tb_name("worker0", 1, gz=True), steps=steps)
        folders[name] = folder
    done = subprocess.run(
        [str(python), "-c", HTA_SCRIPT, *map(str, folders.values())], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = result[str(cpu_dir)]
    ours = tracemagic.load(cpu_capture, use_cache=False)
    steps = set(ours.events.loc[ours.events["kind"] == "step", "step"])
    assert cpu["ranks"] == [0] and steps == {1, 2, 3}
    assert len(cpu["iterations"]) >= 2 and set(cpu["iterations"]) <= steps  # HTA drops the last step
    in_hta_steps = (ours.events["kind"] == "cpu_op") & ours.events["step"].isin(cpu["iterations"])
    assert cpu["cpu_ops"] == in_hta_steps.sum()
    for name in ("hta_nccl_data.json.gz", "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"):
        gpu = result[str(folders[name])]
        assert gpu["ranks"] == [0] and gpu["rows"] > 100 and gpu["kernel_time"] > 0


MINITOY = TRACES / "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"


def _minitoy_variant(case: str, folder: Path) -> Path:
    """The small real GPU trace, changed the way traces from elsewhere differ; each loads."""
    raw = gzip.decompress(MINITOY.read_bytes())
    if case == "gz_trailing_garbage":  # gzip(1) warns and reads it; so does load
        path = folder / "garbage.json.gz"
        path.write_bytes(gzip.compress(raw) + b"\x00\x00 trailing garbage")
        return path
    if case == "latin1":
        raw = raw.replace(b'"python3"', b'"pyth\xe9n3"')
    elif case == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif case == "correlation_list":  # a kernel whose correlation is no scalar
        doc = json.loads(raw)
        next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")["args"]["correlation"] = [1]
        next(e for e in doc["traceEvents"] if e.get("ph") == "s")["id"] = {"a": 1}
        raw = json.dumps(doc).encode()
    elif case == "deep_input_dims":  # deeper than msgspec (and Python's json) can nest
        doc = json.loads(raw)
        op = next(e for e in doc["traceEvents"] if "Input Dims" in e.get("args", {}))
        op["args"]["Input Dims"] = "DEEP"
        raw = json.dumps(doc).encode().replace(b'"DEEP"', b"[" * 5000 + b"1" + b"]" * 5000, 1)
    elif case in ("arg_beyond_float64", "dur_beyond_float64"):  # msgspec refuses the event whole
        doc = json.loads(raw)
        kernel = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")
        if case == "arg_beyond_float64":
            kernel["args"]["odd"] = "BIG"
            raw = json.dumps(doc).encode().replace(b'"BIG"', b"1e400", 1)
        else:  # an integer: msgspec keeps it, float() overflows (load reads it as 0, with a note)
            kernel["dur"] = "BIG"
            raw = json.dumps(doc).encode().replace(b'"BIG"', b"1" + b"0" * 400, 1)
    path = folder / f"{case}.json"
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize(
    "case",
    [
        "latin1", "bom", "gz_trailing_garbage", "correlation_list", "deep_input_dims", "arg_beyond_float64",
        "dur_beyond_float64",
    ],
)
def test_reads_the_original_as_load_does(case: str, tmp_path: Path) -> None:
    """A trace that loads exports: the original is re-read with load's tolerance (a BOM,
    data after the gzip stream, invalid UTF-8 as '?', nesting capped), ids that are no
    scalar link nothing, and the cut is valid JSON that loads with the same events."""
    trace = tracemagic.load(_minitoy_variant(case, tmp_path), use_cache=False)
    for steps in ([2], None):
        (out,) = trace.to_chrome_trace(tmp_path / f"cut{steps}.json", steps=steps)
        text = out.read_bytes().decode("utf-8")  # valid UTF-8 ...
        doc = json.loads(text)  # ... and JSON that Python reads (it nests at most ~1,000 deep)
        assert doc["baseTimeNanoseconds"] and len(doc["traceEvents"]) > 10
        cut = tracemagic.load(out, use_cache=False)
        if steps is None:
            assert len(cut.events) == len(trace.events) and len(cut.flows) == len(trace.flows)
            assert sorted(cut.events["name"].astype(str)) == sorted(trace.events["name"].astype(str))
        else:
            assert set(cut.events.loc[cut.events["kind"] == "step", "name"].astype(str)) == {"ProfilerStep#2"}
    if case == "latin1":  # (``text``: the whole trace's)
        assert "pyth?n3" in text
    if case == "deep_input_dims":
        assert "<nested too deep>" in text and "[" * 300 not in text


@pytest.mark.parametrize("damage", ["truncated_gzip", "not_json", "removed"])
def test_original_that_cannot_be_reread_is_a_trace_error(damage: str, tmp_path: Path) -> None:
    """The original changed since it was loaded: a TraceError naming it and what to do."""
    path = tmp_path / "run.json.gz"
    shutil.copy(MINITOY, path)
    trace = tracemagic.load(path, use_cache=False)
    if damage == "truncated_gzip":
        path.write_bytes(MINITOY.read_bytes()[:-100])
    elif damage == "not_json":
        path.write_bytes(gzip.compress(b"hello"))
    else:
        path.unlink()
    with pytest.raises(TraceError, match="cannot re-read the original trace") as caught:
        trace.to_chrome_trace(tmp_path / "cut.json")
    assert str(path) in str(caught.value) and "trace.to_pfw" in str(caught.value)
    assert caught.value.path == str(path)


def test_a_tar_in_a_folder_named_with_a_bang_is_reread(tmp_path: Path) -> None:
    """A rank read from a tar member is named ``archive!member``: a "!" in a folder above the
    archive does not cut the path there."""
    folder = tmp_path / "exp!1"
    folder.mkdir()
    member = tmp_path / "worker0.pt.trace.json.gz"
    shutil.copy(MINITOY, member)
    archive = folder / "run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(member, arcname="worker0.pt.trace.json.gz")
    trace = tracemagic.load(archive, use_cache=False)
    (out,) = trace.to_chrome_trace(tmp_path / "cut.json")
    assert len(tracemagic.load(out, use_cache=False).events) == len(trace.events)


@pytest.mark.parametrize("layout", ["file", "tar", "folder"])
def test_a_trace_reopened_from_the_cache_elsewhere_is_reread(layout: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A trace first loaded by a relative path and reopened from the cache in another
    working directory exports: the cache entry kept the first load's names (``a/run.json.gz``),
    and to_chrome_trace looked for the original there (a TraceError: no such file)."""
    folder = tmp_path / "a"
    folder.mkdir()
    if layout == "file":
        shutil.copy(MINITOY, folder / "run.json.gz")
        name = "a/run.json.gz"
    elif layout == "tar":
        shutil.copy(MINITOY, tmp_path / "worker0.pt.trace.json.gz")
        with tarfile.open(folder / "run.tar.gz", "w:gz") as tar:
            tar.add(tmp_path / "worker0.pt.trace.json.gz", arcname="worker0.pt.trace.json.gz")
        name = "a/run.tar.gz"
    else:
        shutil.copy(MINITOY, folder / "kineto_trace_0.json.gz")
        name = "a"
    cache_dir = tmp_path / "cache"
    monkeypatch.chdir(tmp_path)
    first = tracemagic.load(name, cache_dir=cache_dir)
    rows = len(first.events)
    del first
    gc.collect()  # its cache entry is written when it is dropped
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with caplog.at_level(logging.DEBUG, logger="tracemagic.trace.loader"):
        again = tracemagic.load(tmp_path / name, cache_dir=cache_dir)
    assert "read from the cache" in caplog.text
    (out,) = again.to_chrome_trace(tmp_path / "cut.json")
    assert len(tracemagic.load(out, use_cache=False).events) == rows
    assert again.meta["path"] == str(tmp_path / name)


def test_the_reread_decodes_only_the_ids_of_args(tmp_path: Path) -> None:
    """Re-reading the original decodes from each event's ``args`` only the ids events are
    matched by (building every ``args`` as a dict took most of the export's time); the step
    cut still follows the raw JSON: the launch, its kernel after the step and their flow kept,
    the next step's op and flow not."""
    noise = {"Input Dims": [[64, 64]] * 50, "Input type": ["float"] * 50, "nested": {"a": [1, {"b": 2}]}}
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1, "tid": 1, "ts": 101, "dur": 99},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 50,
         "args": {"External id": 7, **noise}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20, "dur": 5,
         "args": {"External id": 7, "correlation": 11, **noise}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 150, "dur": 30,
         "args": {"External id": 7, "correlation": 11, "device": 0, "stream": 7}},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 11, "pid": 1, "tid": 1, "ts": 20, "bp": "e"},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 11, "pid": 0, "tid": 7, "ts": 150, "bp": "e"},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 110, "dur": 20,
         "args": {"External id": 8, **noise}},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 12, "pid": 1, "tid": 1, "ts": 120, "bp": "e"},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rank = chrome._load_rank(0, str(path))
    assert not any(isinstance(e.args, dict) for e in rank.events)
    got = [(e.args.correlation, e.args.external_id) if e.args is not None else None for e in rank.events]
    want = [(e["args"].get("correlation"), e["args"].get("External id")) if "args" in e else None for e in events]
    assert got == want
    (out,) = chrome.to_chrome_trace(tracemagic.load(path, use_cache=False), tmp_path / "cut.json", steps=[1])
    cut = json.loads(out.read_text())["traceEvents"]
    assert cut == [e for e in events if e["name"] not in ("ProfilerStep#2", "aten::add") and e.get("id") != 12]
