"""``tracemagic.load`` on every real trace in ``tests/data/traces`` and on damaged, odd and
hand-made ones. Expectations are computed here from the raw JSON with the standard
library, independently of the loader's own parsing."""

from __future__ import annotations

import gzip
import importlib
import io
import json
import pickle
import os
import shutil
import stat
import tarfile
import time
import zlib
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import TRACES

import tracemagic
from tracemagic.errors import TraceError
from tracemagic.trace import cache, normalize, parse, progress, structure
from tracemagic.trace.read import file_source

MISSING = f"the real traces folder {TRACES} is missing (see tests/data/traces/README.md)"
#: the traces in it (hidden files and the README are not traces)
FILES = (
    sorted(p.name for p in TRACES.iterdir() if p.name != "README.md" and not p.name.startswith("."))
    if TRACES.is_dir() else [MISSING]
)
NOT_KINETO = {
    "hta_benchmark_simple_add_et.json.gz": "Execution Trace",
    "hta_memory_timeline.raw.gz": "memory-timeline",
}
#: the category -> kind mapping, written out here again (old and new spellings)
KIND = {
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "user_annotation",
    "python_function": "python_function",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "runtime": "runtime",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "gpu_user_annotation": "gpu_annotation",
}


def trace_path(name: str) -> Path:
    if not TRACES.is_dir():
        pytest.fail(MISSING)
    path = TRACES / name
    assert path.is_file(), f"{path} is missing from tests/data/traces"
    return path


@pytest.fixture(autouse=True)
def user_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own user cache folder (nothing written to ~/.cache)."""
    home = tmp_path_factory.mktemp("user-cache")
    monkeypatch.setenv("TRACEMAGIC_CACHE_DIR", str(home))
    monkeypatch.delenv("TRACEMAGIC_CACHE_SIZE", raising=False)
    return home


# -- independent expectations from the raw JSON --------------------------------------------


@lru_cache(maxsize=None)
def raw_docs(name: str) -> tuple[tuple[str, Any], ...]:
    """(member name, decoded JSON) of each trace inside a file (a tar holds several)."""
    path = trace_path(name)
    if name.endswith(".tar.gz"):
        with tarfile.open(path) as archive:
            return tuple(
                (m.name, json.loads(archive.extractfile(m).read()))  # type: ignore[union-attr]
                for m in archive.getmembers()
                if m.isfile()
            )
    return ((name, json.loads(gzip.decompress(path.read_bytes()))),)


@lru_cache(maxsize=None)
def loaded(name: str) -> tracemagic.Trace:
    """The real trace, loaded once for all the tests that only read it."""
    return tracemagic.load(trace_path(name), use_cache=False)


def expected_kind(event: dict[str, Any]) -> str:
    name = str(event.get("name", ""))
    if event.get("ph") != "X" and name == "[memory]":
        return "memory"
    kind = KIND.get(str(event.get("cat", "")).lower(), "other")
    if name.startswith("ProfilerStep#") and kind in ("cpu_op", "user_annotation"):
        return "step"
    return kind


def timed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") in ("X", "i", "I")]


def kind_counts(events: list[dict[str, Any]]) -> Counter[str]:
    return Counter(expected_kind(e) for e in timed(events))


def count_complete_events(data: bytes) -> int:
    """X/i events that are complete before the damage in ``data``, read with the stdlib."""
    decoder = json.JSONDecoder()
    start = data.find(b"[", data.find(b'"traceEvents"')) + 1
    text = data[start:].decode("utf-8", "replace")
    pos, count = 0, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            event, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return count
        if isinstance(event, dict) and event.get("ph") in ("X", "i", "I"):
            count += 1


def write_trace(path: Path, events: list[dict[str, Any]], **meta: Any) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, **meta, "traceEvents": events}, indent=1))
    return path


# -- every real trace ----------------------------------------------------------------------


def test_the_real_traces_folder_is_there() -> None:
    assert TRACES.is_dir(), MISSING
    assert len(FILES) >= 11, f"expected the 11 traces of tests/data/traces/README.md, found {FILES}"


@pytest.mark.parametrize("name", FILES)
def test_every_real_trace_loads_or_says_what_it_is(name: str) -> None:
    path = trace_path(name)
    if name in NOT_KINETO:
        with pytest.raises(TraceError) as info:
            tracemagic.load(path, use_cache=False)
        assert NOT_KINETO[name] in str(info.value)
        assert str(path) in str(info.value)
        return
    trace = loaded(name)
    events = trace.events
    docs = raw_docs(name)
    raw = [e for _, doc in docs for e in doc["traceEvents"]]
    # one row per X/i event, and the kinds of old and new category names
    assert len(events) == len(timed(raw))
    got = events["kind"].value_counts()
    for kind, n in kind_counts(raw).items():
        if kind != "other":
            assert got.get(kind, 0) == n, (kind, got.get(kind, 0), n)
    # memory events, steps and kernels, counted and summed from the raw JSON
    memory = [e for e in raw if e.get("name") == "[memory]" and e.get("ph") != "X"]
    assert int((events["kind"] == "memory").sum()) == len(memory)
    steps = [e for e in raw if expected_kind(e) == "step"]
    assert int((events["kind"] == "step").sum()) == len(steps)
    kernels = [e for e in raw if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    got_kernels = events[events["kind"] == "kernel"]
    assert len(got_kernels) == len(kernels)
    assert got_kernels["dur"].sum() == pytest.approx(sum(float(e["dur"]) for e in kernels), rel=1e-9)
    # self time never exceeds the duration, nor goes negative
    assert (events["self_dur"] <= events["dur"] + 1e-6).all()
    assert (events["self_dur"] >= 0).all()
    assert trace.rank_ids == sorted(set(events["rank"].tolist()))


EXPECTED_STEPS = {
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz": 2,
    "hta_nccl_data.json.gz": 3,
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz": 5,
    "hta_control.json.gz": 6,
    "kineto_worker0.1623143089861.pt.trace.json.gz": 6,
    "param_dlrm_kineto.tar.gz": 8,
    "hta_triton_example.json.gz": 1,
    "tracelens_normalization_layer_test.json.gz": 0,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_STEPS))
def test_profiler_steps_and_memory_counts(name: str) -> None:
    trace = loaded(name)
    events = trace.events
    assert int((events["kind"] == "step").sum()) == EXPECTED_STEPS[name]
    step_rows = events[events["kind"] == "step"]
    assert all(n.startswith("ProfilerStep#") for n in step_rows["name"].astype(str))
    # the step column holds the step numbers written in the names
    numbers = {int(n.split("#")[1]) for n in step_rows["name"].astype(str)}
    assert numbers <= set(events["step"].unique().tolist())


def test_old_memory_events_without_totals() -> None:
    name = "kineto_worker0.1623143089861.pt.trace.json.gz"
    trace = loaded(name)
    memory = trace.events[trace.events["kind"] == "memory"]
    (_, doc), = raw_docs(name)
    raw = [e for e in doc["traceEvents"] if e.get("name") == "[memory]"]
    assert len(memory) == len(raw) == 12838
    assert memory["total_allocated"].isna().all()  # the old format has no totals
    assert int(memory["bytes"].sum()) == sum(int(e["args"]["Bytes"]) for e in raw)


def test_new_memory_events_with_totals() -> None:
    name = "tracelens_normalization_layer_test.json.gz"
    trace = loaded(name)
    memory = trace.events[trace.events["kind"] == "memory"]
    (_, doc), = raw_docs(name)
    raw = [e for e in doc["traceEvents"] if e.get("name") == "[memory]"]
    assert len(memory) == len(raw) == 475
    assert memory["total_allocated"].max() == max(e["args"]["Total Allocated"] for e in raw)
    assert memory["device"].tolist() == [e["args"]["Device Id"] for e in raw]


@pytest.mark.parametrize("in_c", [True, False])
def test_per_category_gives_each_row_its_categorys_answer(in_c: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``normalize.per_category`` compares the codes with the categories where few answer
    True (or few False), else gathers (in C where the extension is built): each row still
    gets its category's answer, ``missing`` for code -1, whatever the answers, the codes'
    width and how many categories answer either way."""
    if in_c:
        assert normalize._nesting is not None
    else:
        monkeypatch.setattr(normalize, "_nesting", None)
    rng = np.random.default_rng(23)
    widths = [np.int8, np.int16, np.int32, np.int64]
    for _ in range(2000):
        categories = int(rng.integers(1, 40))
        answers = rng.random(categories) < rng.random()
        codes = rng.integers(-1, categories, int(rng.integers(0, 300))).astype(rng.choice(widths))
        for missing in (False, True):
            expected = [missing if code < 0 else bool(answers[code]) for code in codes.tolist()]
            assert normalize.per_category(answers, codes, missing).tolist() == expected


def test_notes_of_values_left_missing_do_not_depend_on_where_the_file_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values that are no numbers where a number belongs are left missing with one note per
    field. A chunk counts its fields in column order, the file in the order its chunks met
    them: the notes must come in one order however the file was cut (a fuzzed mutant gave
    the two in the other order on two threads than on one)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0, "args": {"Device Id": "gpu"}},
        *(
            {"ph": "X", "cat": "cpu_op", "name": "pad", "pid": 1, "tid": 1, "ts": 3.0 + i, "dur": 0.5, "args": {}}
            for i in range(20)
        ),
        {"ph": "X", "cat": "cpu_op", "name": "b", "pid": 1, "tid": 1, "ts": 30.0, "dur": 1.0, "args": {"External id": "x"}},
    ]
    path = write_trace(tmp_path / "odd.json", events)
    seen = []
    scanner = parse._scan
    for chunk in (1 << 20, 512):  # both odd events in one chunk, then each in a chunk of its own
        for scan in (scanner, None):  # the C scanner's path and the pure Python one
            monkeypatch.setattr(parse, "CHUNK_BYTES", chunk)
            monkeypatch.setattr(parse, "_scan", scan)
            warnings = tracemagic.load(path, use_cache=False, workers=1).meta["warnings"]
            seen.append([w for w in warnings if "left missing" in w])
    assert all(len(notes) == 2 for notes in seen), seen
    assert all(notes == seen[0] for notes in seen), seen


def test_ns_resolution_trace_is_in_microseconds() -> None:
    """``displayTimeUnit: ns`` is a display hint: the ts values are float µs (~1.7e15 since
    the epoch) at ns resolution, and durations are µs. Nothing is divided by 1000."""
    name = "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    (_, doc), = raw_docs(name)
    assert doc["displayTimeUnit"] == "ns"
    raw = timed(doc["traceEvents"])
    ts = np.array([float(e["ts"]) for e in raw])
    assert 1e15 < np.median(ts) < 2e15  # µs since 1970 = 2024; as ns it would be 1970
    trace = loaded(name)
    np.testing.assert_array_equal(trace.events["ts"].to_numpy(), ts)
    np.testing.assert_array_equal(trace.events["dur"].to_numpy(), [float(e.get("dur", 0)) for e in raw])
    assert not any("nanosecond" in w for w in trace.warnings)
    # ns resolution survives: fractional µs are kept
    assert (trace.events["ts"] % 1 != 0).any()
    steps = trace.events[trace.events["kind"] == "step"]
    assert steps["dur"].between(1e3, 60e6).all()  # a step lasts ms to s, in µs


def test_true_nanosecond_timestamps_are_converted(tmp_path: Path) -> None:
    base = 1_700_000_000_000_000_000  # ns since the epoch
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": base, "dur": 5000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": base + 10_000, "dur": 2000},
    ]
    trace = tracemagic.load(write_trace(tmp_path / "ns.json", events), use_cache=False)
    assert trace.events["dur"].tolist() == [5.0, 2.0]
    assert trace.events["ts"].iloc[1] - trace.events["ts"].iloc[0] == pytest.approx(10.0)
    assert any("nanoseconds" in w for w in trace.warnings)


@pytest.mark.parametrize(
    ("name", "flow_cat"),
    [("hta_control.json.gz", "async_cpu_to_gpu"), ("hta_nccl_data.json.gz", "ac2g")],
)
def test_gpu_events_are_linked_to_their_launch(name: str, flow_cat: str) -> None:
    (_, doc), = raw_docs(name)
    raw = doc["traceEvents"]
    assert any(e.get("cat") == flow_cat for e in raw if e.get("ph") in ("s", "f"))
    runtime_corr = {
        e["args"]["correlation"]
        for e in raw
        if e.get("ph") == "X" and KIND.get(str(e.get("cat", "")).lower()) == "runtime" and "correlation" in e.get("args", {})
    }
    gpu = [e for e in raw if e.get("ph") == "X" and KIND.get(str(e.get("cat", "")).lower()) in ("kernel", "memcpy", "memset")]
    expected_linked = sum(1 for e in gpu if e.get("args", {}).get("correlation") in runtime_corr)
    trace = loaded(name)
    events = trace.events
    on_gpu = events[events["kind"].isin(["kernel", "memcpy", "memset"])]
    assert int((on_gpu["launch"] >= 0).sum()) == expected_linked > 0
    launched = on_gpu[on_gpu["launch"] >= 0]
    launchers = events.iloc[launched["launch"].to_numpy()]
    assert (launchers["kind"] == "runtime").all()
    assert (launchers["correlation"].to_numpy() == launched["correlation"].to_numpy()).all()
    assert set(trace.flows["cat"].astype(str)) >= {flow_cat}


@pytest.mark.parametrize("name", ["hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz", "tracelens_normalization_layer_test.json.gz"])
def test_amd_traces_and_empty_device_names(name: str, tmp_path: Path) -> None:
    trace = loaded(name)
    assert trace.devices and all(d["name"] for d in trace.devices)
    assert trace.has_gpu
    # the same trace with the empty device names some ROCm versions write
    (_, doc), = raw_docs(name)
    doc = json.loads(json.dumps(doc))
    for item in doc["deviceProperties"]:
        item["name"] = ""
    path = tmp_path / "amd_empty_names.json"
    path.write_text(json.dumps(doc))
    blank = tracemagic.load(path, use_cache=False)
    assert [d["id"] for d in blank.devices] == [d["id"] for d in trace.devices]
    assert all(d["name"] == "unnamed GPU" for d in blank.devices)
    assert len(blank.events) == len(trace.events)


# -- ranks ---------------------------------------------------------------------------------


def test_rank_from_distributed_info_dict() -> None:
    trace = loaded("hta_control.json.gz")
    (_, doc), = raw_docs("hta_control.json.gz")
    assert trace.rank_ids == [doc["distributedInfo"]["rank"]] == [3]
    assert set(trace.events["rank"].unique().tolist()) == {3}
    assert trace.meta["ranks"][3]["world_size"] == 8


def test_rank_from_distributed_info_python_repr(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0}]
    path = write_trace(tmp_path / "repr.json", events, distributedInfo="{'backend': 'nccl', 'rank': 5, 'world_size': 8}")
    trace = tracemagic.load(path, use_cache=False)
    assert trace.rank_ids == [5]
    assert trace.meta["ranks"][5]["world_size"] == 8


def _tar_ranks() -> dict[int, int]:
    """rank -> number of X/i events, from each tar member's own distributedInfo."""
    return {doc["distributedInfo"]["rank"]: len(timed(doc["traceEvents"])) for _, doc in raw_docs("param_dlrm_kineto.tar.gz")}


def test_eight_rank_tar() -> None:
    expected = _tar_ranks()
    assert sorted(expected) == list(range(8))
    trace = loaded("param_dlrm_kineto.tar.gz")
    assert trace.rank_ids == list(range(8))
    assert trace.events.groupby("rank").size().to_dict() == expected
    # row columns point inside their own rank after stacking
    for column in ("parent", "launch", "op", "module"):
        rows = trace.events[column].to_numpy()
        has = rows >= 0
        assert (trace.events["rank"].to_numpy()[rows[has]] == trace.events["rank"].to_numpy()[has]).all()


def test_directory_of_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    for member, doc in raw_docs("param_dlrm_kineto.tar.gz"):
        (folder / Path(member).name).write_text(json.dumps(doc))
    trace = tracemagic.load(folder, use_cache=False)
    assert trace.rank_ids == list(range(8))
    assert trace.events.groupby("rank").size().to_dict() == _tar_ranks()


def test_rank_from_file_name_without_distributed_info(tmp_path: Path) -> None:
    folder = tmp_path / "named"
    folder.mkdir()
    for rank in (2, 6):
        events = [{"ph": "X", "cat": "cpu_op", "name": f"op{rank}", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0}]
        write_trace(folder / f"run_rank-{rank}.pt.trace.json", events)
    trace = tracemagic.load(folder, use_cache=False)
    assert trace.rank_ids == [2, 6]
    by_rank = trace.events.set_index("rank")["name"].astype(str).to_dict()
    assert by_rank == {2: "op2", 6: "op6"}
    single = write_trace(tmp_path / "plain.json", [{"ph": "X", "cat": "cpu_op", "name": "x", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}])
    assert tracemagic.load(single, use_cache=False).rank_ids == [0]


def test_a_slow_recording_beside_a_trace_is_no_rank_of_it(tmp_path: Path) -> None:
    """A folder (or tar) of a capture without its ``capture.json``: the ``--slow`` recording
    ``kineto_trace_0_slow1.json`` is no second rank-0 file merged into the trace."""
    folder = tmp_path / "capture"
    folder.mkdir()
    write_trace(folder / "kineto_trace_0.json", [{"ph": "X", "cat": "cpu_op", "name": "main", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}])
    write_trace(folder / "kineto_trace_0_slow1.json", [{"ph": "X", "cat": "cpu_op", "name": "slow", "pid": 1, "tid": 1, "ts": 9.0, "dur": 1.0}])
    names = set(tracemagic.load(folder, use_cache=False).events["name"].astype(str))
    assert "main" in names and "slow" not in names
    assert set(tracemagic.load(folder / "kineto_trace_0_slow1.json", use_cache=False).events["name"].astype(str)) >= {"slow"}


# -- damaged and wrong files ---------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_json() -> bytes:
    """A real trace as plain JSON (2.5 MB; its metadata lies before and after the events)."""
    return gzip.decompress(trace_path("tracelens_normalization_layer_test.json.gz").read_bytes())


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.9999])
@pytest.mark.parametrize("chunk", [None, 64 * 1024])
def test_truncated_json(plain_json: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fraction: float, chunk: int | None) -> None:
    if chunk:
        monkeypatch.setattr(parse, "CHUNK_BYTES", chunk)
    cut = int(len(plain_json) * fraction)
    path = tmp_path / "cut.json"
    path.write_bytes(plain_json[:cut])
    with pytest.raises(TraceError) as info:
        tracemagic.load(path, use_cache=False)
    error = info.value
    assert str(path) in str(error)
    assert error.offset is not None and 0 < error.offset <= cut
    assert f"byte {error.offset}" in str(error)
    assert "recover=True" in str(error)
    recovered = tracemagic.load(path, use_cache=False, recover=True)
    assert len(recovered.events) == count_complete_events(plain_json[:cut]) > 0
    assert any("damaged" in w for w in recovered.warnings)


def test_truncated_in_the_metadata_before_the_events(plain_json: bytes, tmp_path: Path) -> None:
    path = tmp_path / "head.json"
    path.write_bytes(plain_json[:200])
    for recover in (False, True):
        with pytest.raises(TraceError) as info:
            tracemagic.load(path, use_cache=False, recover=recover)
        assert str(path) in str(info.value) and info.value.offset is not None


def test_truncated_gzip(tmp_path: Path) -> None:
    name = "hta_nccl_data.json.gz"
    raw = trace_path(name).read_bytes()
    cut = raw[: int(len(raw) * 0.6)]
    path = tmp_path / "cut.json.gz"
    path.write_bytes(cut)
    with pytest.raises(TraceError) as info:
        tracemagic.load(path, use_cache=False)
    assert str(path) in str(info.value)
    assert "gzip" in str(info.value)
    assert info.value.offset is not None and f"byte {info.value.offset}" in str(info.value)
    held = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(cut)
    assert info.value.offset == len(held)
    recovered = tracemagic.load(path, use_cache=False, recover=True)
    assert len(recovered.events) == count_complete_events(held) > 0
    assert any("gzip" in w for w in recovered.warnings)


def test_garbage_in_the_middle(plain_json: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "CHUNK_BYTES", 256 * 1024)
    middle = plain_json.index(b"},\n  {", len(plain_json) // 2) + 2
    damaged = plain_json[:middle] + b"#garbage#" + plain_json[middle:]
    path = tmp_path / "garbage.json"
    path.write_bytes(damaged)
    with pytest.raises(TraceError) as info:
        tracemagic.load(path, use_cache=False)
    assert str(path) in str(info.value)
    assert middle <= info.value.offset <= middle + 9
    recovered = tracemagic.load(path, use_cache=False, recover=True)
    assert len(recovered.events) == count_complete_events(damaged[:middle])


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "empty"),
        (b"   \n ", "empty"),
        (b"\x00\x01\x02garbage\xff", "not a JSON trace"),
        (b"PK\x03\x04 a zip file", "not a JSON trace"),
        (b'{"schemaVersion": 1, "deviceProperties": []}', "without 'traceEvents'"),
        (b"{}", "without 'traceEvents'"),
        (b'{"traceEvents": 5}', "unreadable"),
    ],
)
def test_wrong_files_get_a_clear_error(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "wrong.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        tracemagic.load(path, use_cache=False)
    assert says in str(info.value)
    assert str(path) in str(info.value)


def test_truncated_tar(tmp_path: Path) -> None:
    raw = trace_path("param_dlrm_kineto.tar.gz").read_bytes()
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceError) as info:
        tracemagic.load(path, use_cache=False)
    assert str(path) in str(info.value)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        tracemagic.load(tmp_path / "nope.json")


def test_directory_without_traces(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(TraceError, match="holds no Kineto trace"):
        tracemagic.load(tmp_path)


# -- layouts the chunked parser must cut exactly -------------------------------------------


def _tricky_events() -> list[dict[str, Any]]:
    events = []
    for i in range(3000):
        events.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": ["aten::mm", 'weird },{ "name": }] [{', "x\\"][i % 3],
                "pid": 7,
                "tid": 7,
                "ts": 1000.0 + 10 * i,
                "dur": 5.0,
                "args": {"External id": i, "Input Dims": [[i % 5, 3], []], "nested": [{"a": {"b": [1, {"c": 2}]}}]},
            }
        )
        if i % 7 == 0:
            events.append({"ph": "s", "cat": "ac2g", "id": i, "pid": 7, "tid": 7, "ts": 1000.0 + 10 * i})
    return events


@pytest.mark.parametrize("layout", ["compact", "pretty", "array"])
def test_chunk_cutting_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    monkeypatch.setattr(parse, "CHUNK_BYTES", 16 * 1024)
    events = _tricky_events()
    doc: Any = events if layout == "array" else {"traceEvents": events, "traceName": "after, the events ]}"}
    text = json.dumps(doc, indent=None if layout == "compact" else 2, separators=(",", ":") if layout == "compact" else None)
    path = tmp_path / f"{layout}.json"
    path.write_text(text)
    trace = tracemagic.load(path, use_cache=False)
    x = [e for e in events if e["ph"] == "X"]
    assert trace.events["name"].astype(str).tolist() == [e["name"] for e in x]
    assert trace.events["external_id"].tolist() == [e["args"]["External id"] for e in x]
    assert [json.loads(t) for t in trace.events["input_dims"].astype(str)] == [e["args"]["Input Dims"] for e in x]
    assert len(trace.flows) == sum(1 for e in events if e["ph"] == "s")
    if layout != "array":
        assert trace.meta["ranks"][0]["traceName"] == "after, the events ]}"


def test_chunked_and_whole_parse_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    path = trace_path("hta_nccl_data.json.gz")
    whole = loaded("hta_nccl_data.json.gz")
    monkeypatch.setattr(parse, "CHUNK_BYTES", 100 * 1024)
    chunked = tracemagic.load(path, use_cache=False)
    pd.testing.assert_frame_equal(whole.events, chunked.events)
    pd.testing.assert_frame_equal(whole.flows, chunked.flows)


def test_odd_types_take_the_loose_path(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "a", "pid": "1", "tid": 1, "ts": "100.5", "dur": "3", "args": {"External id": "0x10"}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": "stream 7", "ts": 101, "dur": 1, "args": None},
        {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": 102, "args": {"Bytes": 64, "Device Id": -1}},
    ]
    trace = tracemagic.load(write_trace(tmp_path / "odd.json", events), use_cache=False)
    assert trace.events["ts"].tolist() == [100.5, 101.0, 102.0]
    assert trace.events["external_id"].tolist()[0] == 16
    assert trace.events["stream"].tolist()[1] == 7
    assert trace.events["kind"].astype(str).tolist() == ["cpu_op", "kernel", "memory"]


# -- cache ---------------------------------------------------------------------------------


class ParseSpy:
    """Records every file the loader parses (on one thread or two)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        loader = importlib.import_module("tracemagic.trace.loader")
        real = loader.parse_source

        def spy(source: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(source.name)
            return real(source, *args, **kwargs)

        monkeypatch.setattr(loader, "parse_source", spy)


@pytest.fixture
def copied_trace(tmp_path: Path) -> Path:
    folder = tmp_path / "traces"
    folder.mkdir()
    path = folder / "nccl.json.gz"
    shutil.copyfile(trace_path("hta_nccl_data.json.gz"), path)
    return path


def test_second_load_comes_from_the_cache(copied_trace: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = ParseSpy(monkeypatch)
    first = tracemagic.load(copied_trace)
    assert spy.calls == [str(copied_trace)]
    seal = cache.locations(copied_trace)[0]
    assert seal.parent == user_cache and seal.is_file()
    second = tracemagic.load(copied_trace)
    assert spy.calls == [str(copied_trace)]  # not parsed again
    pd.testing.assert_frame_equal(first.events, second.events)
    pd.testing.assert_frame_equal(first.flows, second.flows)
    assert second.rank_ids == first.rank_ids and second.devices == first.devices
    # the cached columns are the user's to edit, as a parsed trace's are
    second.events.loc[second.events["dur"] > 0, "dur"] = 0.0
    second.events["external_id"] = second.events["external_id"].fillna(-1)
    assert (second.events["dur"] == 0).all()
    # ... in their own copy: the mapped cache file is unchanged
    third = tracemagic.load(copied_trace)
    assert spy.calls == [str(copied_trace)]
    pd.testing.assert_frame_equal(first.events, third.events)


def test_a_parsed_trace_writes_its_cache_entry_when_dropped_and_only_in_its_process(tmp_path: Path) -> None:
    """``load`` returns before the cache entry is written: it is written when the trace is
    dropped (or the process ends); a pickled copy (sent to another process) never writes it."""
    import gc
    import pickle

    folder = tmp_path / "cache"
    trace = tracemagic.load(trace_path("hta_triton_example.json.gz"), cache_dir=folder)
    assert not list(folder.glob("*.seal")), "written inside load"
    copy = pickle.loads(pickle.dumps(trace))
    copy.ops()
    del copy
    gc.collect()
    assert not list(folder.glob("*.seal")), "written by a copy"
    del trace
    gc.collect()
    assert len(list(folder.glob("*.seal"))) == 1


def test_all_missing_columns_are_missing_writable_and_picklable_parsed_or_cached(tmp_path: Path) -> None:
    """A CPU trace has no stream, device or collective fields: those columns are all
    missing (and backed by lazily zeroed pages); they must behave as any column."""
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i % 7}", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5}
              for i in range(20_000)]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    parsed, cached = tracemagic.load(path), tracemagic.load(path)
    for trace in (parsed, cached):
        for column, dtype in (("stream", "Int64"), ("flops", "Float64")):
            values = trace.events[column]
            assert str(values.dtype) == dtype and values.isna().all() and len(values) == 20_000
            assert pickle.loads(pickle.dumps(values)).equals(values)
        trace.events.loc[trace.events.index[:3], "stream"] = 7
        assert trace.events["stream"].notna().sum() == 3 and trace.events["stream"].iloc[2] == 7
    assert tracemagic.load(path).events["stream"].isna().all(), "the cache is unchanged"


def test_columns_missing_in_whole_chunks_are_missing_writable_and_picklable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where whole chunks of the file have no value of a column (the memory events of a CPU
    trace have no ``External id``, the ops no ``Bytes``), those rows' values are lazily
    zeroed pages, never written: the column still reads, writes and pickles as any."""
    monkeypatch.setattr(parse, "CHUNK_BYTES", 16 << 10)  # many chunks, some with no id at all
    events = [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5,
               **({"args": {"External id": i}} if (i // 2000) % 2 == 0 else {})} for i in range(12_000)]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    want = pd.array([e.get("args", {}).get("External id") for e in events], dtype="Int64")
    parsed, cached = tracemagic.load(path, cache_dir=tmp_path), tracemagic.load(path, cache_dir=tmp_path)
    for trace in (parsed, cached):
        values = trace.events["external_id"]
        pd.testing.assert_extension_array_equal(values.array, want)
        assert pickle.loads(pickle.dumps(values)).equals(values)
        trace.events.loc[trace.events.index[2000:2003], "external_id"] = 7
        assert trace.events["external_id"].iloc[2001] == 7 and trace.events["external_id"].notna().sum() == 6003


@pytest.mark.parametrize(
    "name", ["hta_control.json.gz", "hta_nccl_data.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"]
)
def test_load_hands_the_thread_keys_to_the_analyses(name: str) -> None:
    """Nesting keys each event by its (rank, pid, tid); ``load`` passes the keys of one
    file on, with its rank (``hta_control`` is rank 3), exactly as the analyses compute
    them from the table; of several ranks (whose categories are joined) it passes none."""
    trace = tracemagic.load(trace_path(name), use_cache=False)
    handed = trace.shared("thread_keys", lambda: None)
    assert handed is not None
    np.testing.assert_array_equal(handed, structure.thread_keys(trace.events))
    ranks = tracemagic.load(trace_path("param_dlrm_kineto.tar.gz"), use_cache=False)
    assert ranks.shared("thread_keys", lambda: None) is None and ranks.events["rank"].nunique() > 1


@pytest.mark.parametrize(
    "name", ["param_dlrm_kineto.tar.gz", "hta_nccl_data.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"]
)
def test_load_hands_the_nesting_order_to_the_analyses(name: str, tmp_path: Path) -> None:
    """Nesting sorts the CPU events by thread and time; ``load`` passes that order on (the
    analyses search in it), and it is exactly the order they compute from a cached trace."""
    fresh = tracemagic.load(trace_path(name), cache_dir=tmp_path)
    handed = fresh.shared("cpu_by_thread", lambda: None)
    assert handed is not None and handed.size > 0
    np.testing.assert_array_equal(handed, structure.cpu_by_thread(fresh.events))
    cached = tracemagic.load(trace_path(name), cache_dir=tmp_path)  # computes the order when an analysis asks
    pd.testing.assert_frame_equal(fresh.layers(), cached.layers())
    pd.testing.assert_frame_equal(fresh.memory(), cached.memory())


def test_touching_or_changing_the_file_invalidates_the_cache(copied_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = ParseSpy(monkeypatch)
    tracemagic.load(copied_trace)
    stat_ = copied_trace.stat()
    os.utime(copied_trace, ns=(stat_.st_atime_ns, stat_.st_mtime_ns + 1_000_000_000))
    tracemagic.load(copied_trace)
    assert len(spy.calls) == 2
    small = [{"ph": "X", "cat": "cpu_op", "name": "only", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    copied_trace.write_bytes(gzip.compress(json.dumps({"traceEvents": small}).encode()))
    changed = tracemagic.load(copied_trace)
    assert len(spy.calls) == 3
    assert changed.events["name"].astype(str).tolist() == ["only"]


def test_a_same_size_edit_that_keeps_the_mtime_is_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Size and mtime are not enough: the source's bytes are part of its identity."""
    path = write_trace(tmp_path / "t.json", [
        {"ph": "X", "cat": "cpu_op", "name": "aaaa", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5} for i in range(3000)
    ])
    spy = ParseSpy(monkeypatch)
    tracemagic.load(path)
    before = path.stat()
    text = path.read_text()
    middle = text.index('"aaaa"', len(text) // 2)
    path.write_text(text[:middle] + '"bbbb"' + text[middle + 6:])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    edited = tracemagic.load(path)
    assert len(spy.calls) == 2, "the edited file was parsed again"
    assert Counter(edited.events["name"].astype(str)) == {"aaaa": 2999, "bbbb": 1}
    assert len(tracemagic.load(path).events) == 3000 and len(spy.calls) == 2, "and its new cache is used"


def test_flipped_bytes_in_a_cache_mean_a_fresh_parse(tmp_path: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any single byte of the events, the flows or the seal changed: the trace is parsed
    again and the tables are exactly a no-cache load's, never silently different ones."""
    path = tmp_path / "mi250.json.gz"
    shutil.copyfile(trace_path("hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"), path)
    truth = tracemagic.load(path, use_cache=False)
    tracemagic.load(path)
    seal = cache.locations(path)[0]
    files = [seal.with_suffix(".arrow"), seal.with_suffix(".flows.arrow"), seal]
    pristine = {f: f.read_bytes() for f in files}
    rng = np.random.default_rng(14)
    spy = ParseSpy(monkeypatch)
    flips = 0
    for target in files:
        data = pristine[target]
        for offset in rng.choice(len(data), size=min(len(data), 60), replace=False):
            for f, original in pristine.items():
                f.write_bytes(original)
            damaged = bytearray(data)
            damaged[offset] ^= int(rng.integers(1, 256))
            target.write_bytes(bytes(damaged))
            reloaded = tracemagic.load(path)
            flips += 1
            assert len(spy.calls) == flips, f"{target.name} byte {offset} flipped: the damaged cache was used"
            pd.testing.assert_frame_equal(reloaded.events, truth.events)
            pd.testing.assert_frame_equal(reloaded.flows, truth.flows)
            del reloaded  # its cache entry is written as it is dropped (before the next damage)
    assert flips == 180


def _rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` (same size) and put its mtime back: only the bytes tell."""
    before = path.stat()
    assert len(data) == before.st_size
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_cache_altered_in_the_middle_with_its_size_and_mtime_kept_means_a_fresh_parse(
    copied_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum is not a CRC of every byte (``cache.checksum``: sums of 64-bit words by
    row and by column): what it is weakest at still means a fresh parse, the tables exactly
    a no-cache load's: two different words swapped within one 64 KiB row (same row sum), a
    4 KiB page replaced by another page of the file (a misdirected write), one word changed."""
    truth = tracemagic.load(copied_trace, use_cache=False)
    tracemagic.load(copied_trace)
    events_file = cache.locations(copied_trace)[0].with_suffix(".arrow")
    pristine = events_file.read_bytes()
    assert len(pristine) > 4 * 65536, "a file of several checksum rows"
    words = np.frombuffer(pristine, dtype="<u8", count=len(pristine) // 8)
    middle = (len(words) // 2) // 8192 * 8192  # the first word of a row in the middle
    row = words[middle : middle + 8192]
    first = int(np.flatnonzero(row != 0)[0])
    other = int(np.flatnonzero(row != row[first])[-1])
    swapped = words.copy()
    swapped[middle + first], swapped[middle + other] = words[middle + other], words[middle + first]
    page = len(pristine) // 2 // 4096 * 4096
    replaced = bytearray(pristine)
    replaced[page : page + 4096] = pristine[page + 3 * 4096 : page + 4 * 4096]
    assert bytes(replaced) != pristine
    one = bytearray(pristine)
    one[middle * 8 + 3] ^= 0x10
    spy = ParseSpy(monkeypatch)
    for label, damaged in (("two words swapped in a row", swapped.tobytes() + pristine[len(words) * 8 :]),
                           ("a page replaced", bytes(replaced)), ("one bit", bytes(one))):
        _rewrite_keeping_mtime(events_file, pristine)  # each case alone (a fresh parse rewrote the cache)
        tracemagic.load(copied_trace)
        events_file = cache.locations(copied_trace)[0].with_suffix(".arrow")
        calls = len(spy.calls)
        _rewrite_keeping_mtime(events_file, damaged)
        reloaded = tracemagic.load(copied_trace)
        assert len(spy.calls) == calls + 1, f"{label}: the altered cache was used"
        pd.testing.assert_frame_equal(reloaded.events, truth.events)


def test_a_cache_altered_with_a_forged_seal_never_gives_codes_outside_their_categories(
    copied_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone edits a cache and rewrites its seal to match (no checksum can stop that): the
    ``name`` column's dictionary codes pointed past its categories. Arrow's full validation
    of what is read catches it: a fresh parse, not a Categorical with codes that crash or
    read other memory later."""
    truth = tracemagic.load(copied_trace, use_cache=False)
    tracemagic.load(copied_trace)
    seal_file = cache.locations(copied_trace)[0]
    events_file = seal_file.with_suffix(".arrow")
    data = bytearray(events_file.read_bytes())
    import pyarrow as pa  # the test finds the codes' bytes in the file with Arrow itself

    buffer = pa.py_buffer(bytes(data))
    names = pa.ipc.open_file(pa.BufferReader(buffer)).read_all().column("name").chunk(0)
    codes = names.indices
    start = codes.buffers()[1].address - buffer.address + codes.offset * codes.type.bit_width // 8
    width = codes.type.bit_width // 8
    too_far = len(names.dictionary) + 5
    assert too_far < 2 ** (8 * width - 1)
    for row in range(0, len(codes), max(1, len(codes) // 10)):
        data[start + row * width : start + (row + 1) * width] = too_far.to_bytes(width, "little", signed=True)
    events_file.write_bytes(bytes(data))
    crc, _, body = seal_file.read_bytes().partition(b"\n")
    seal = json.loads(body)
    seal["events"]["sum"] = cache.checksum(bytes(data))  # the forged seal
    forged = json.dumps(seal, separators=(",", ":")).encode()
    seal_file.write_bytes(f"{zlib.crc32(forged):08x}\n".encode() + forged)
    spy = ParseSpy(monkeypatch)
    reloaded = tracemagic.load(copied_trace)
    assert spy.calls == [str(copied_trace)], "the forged cache was used"
    pd.testing.assert_frame_equal(reloaded.events, truth.events)


def test_a_cache_copied_from_another_trace_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = tmp_path / "ours.json.gz", tmp_path / "theirs.json.gz"
    shutil.copyfile(trace_path("hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"), ours)
    shutil.copyfile(trace_path("hta_triton_example.json.gz"), theirs)
    truth = tracemagic.load(ours, use_cache=False)
    tracemagic.load(ours)
    tracemagic.load(theirs)
    our_seal, their_seal = cache.locations(ours)[0], cache.locations(theirs)[0]
    spy = ParseSpy(monkeypatch)
    for suffixes in ([".flows.arrow"], [".arrow"], [".arrow", ".flows.arrow", ".seal"]):
        for suffix in suffixes:
            shutil.copyfile(their_seal.with_suffix(suffix), our_seal.with_suffix(suffix))
        reloaded = tracemagic.load(ours)
        assert spy.calls[-1] == str(ours), f"{suffixes} of another trace were used"
        pd.testing.assert_frame_equal(reloaded.events, truth.events)
        pd.testing.assert_frame_equal(reloaded.flows, truth.flows)
        del reloaded  # its cache entry is written as it is dropped (before the next copy)
    assert len(spy.calls) == 3


def test_a_trace_tracemagic_did_not_write_is_cached_in_the_user_cache(
    copied_trace: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Nothing is written next to someone else's trace, in a writable folder or not; the
    user cache folder is ``TRACEMAGIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/tracemagic``."""
    folder = copied_trace.parent
    tracemagic.load(copied_trace)
    assert sorted(p.name for p in folder.iterdir()) == ["nccl.json.gz"]
    assert len(list(user_cache.glob("*.seal"))) == 1
    monkeypatch.delenv("TRACEMAGIC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    try:
        spy = ParseSpy(monkeypatch)
        tracemagic.load(copied_trace)
        tracemagic.load(copied_trace)
        assert len(spy.calls) == 1
        assert sorted(p.name for p in folder.iterdir()) == ["nccl.json.gz"]
        stored = list((tmp_path / "xdg" / "tracemagic").glob("*.seal"))
        assert stored == cache.locations(copied_trace)
    finally:
        folder.chmod(0o755)


def test_explicit_cache_dir(copied_trace: Path, user_cache: Path, tmp_path: Path) -> None:
    tracemagic.load(copied_trace, cache_dir=tmp_path / "mine")
    assert len(list((tmp_path / "mine").glob("*.seal"))) == 1
    assert not list(user_cache.iterdir())


def _capture_folder(folder: Path, manifest: dict[str, Any]) -> Path:
    folder.mkdir()
    shutil.copyfile(trace_path("hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"), folder / "rank0.pt.trace.json.gz")
    (folder / "capture.json").write_text(json.dumps(manifest))
    return folder


def test_a_capture_directory_tracemagic_wrote_keeps_its_cache_inside(tmp_path: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _capture_folder(tmp_path / "ours", {"versions": {"tracemagic": tracemagic.__version__}})
    spy = ParseSpy(monkeypatch)
    first = tracemagic.load(ours)
    again = tracemagic.load(ours)
    assert len(spy.calls) == 1
    pd.testing.assert_frame_equal(first.events, again.events)
    inside = ours / cache.CAPTURE_FOLDER
    assert sorted(p.name for p in inside.iterdir()) == ["traces.arrow", "traces.flows.arrow", "traces.seal"]
    tracemagic.load(ours / "rank0.pt.trace.json.gz")  # one of its files: cached there too
    assert len(list(inside.glob("*.seal"))) == 2
    assert not list(user_cache.iterdir())
    # a capture.json another tool wrote does not make a folder tracemagic's
    theirs = _capture_folder(tmp_path / "theirs", {"files": {"kineto": ["rank0.pt.trace.json.gz"]}})
    tracemagic.load(theirs)
    assert sorted(p.name for p in theirs.iterdir()) == ["capture.json", "rank0.pt.trace.json.gz"]
    assert len(list(user_cache.glob("*.seal"))) == 1


def test_the_user_cache_evicts_the_least_recently_used(tmp_path: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = []
    for i in range(3):
        events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}-{j}", "pid": 1, "tid": 1, "ts": float(j), "dur": 0.5}
                  for j in range(2000)]
        paths.append(write_trace(tmp_path / f"t{i}.json", events))
    tracemagic.load(paths[0])
    size = sum(f.stat().st_size for f in user_cache.iterdir())
    monkeypatch.setenv("TRACEMAGIC_CACHE_SIZE", str(int(size * 2.5)))  # room for two entries
    tracemagic.load(paths[1])
    an_hour_ago = time.time() - 3600
    for f in user_cache.iterdir():
        os.utime(f, (an_hour_ago, an_hour_ago))
    tracemagic.load(paths[0])  # used again: now t1 is the least recently used
    tracemagic.load(paths[2])
    kept = {e.trace for e in cache.entries(user_cache)}
    assert kept == {str(paths[0]), str(paths[2])}
    assert sum(e.bytes for e in cache.entries(user_cache)) <= size * 2.5
    monkeypatch.setenv("TRACEMAGIC_CACHE_SIZE", "lots")
    with pytest.raises(TraceError, match="TRACEMAGIC_CACHE_SIZE"):
        tracemagic.load(paths[1])


def test_damaged_cache_is_ignored(copied_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tracemagic.load(copied_trace)
    events_file = cache.locations(copied_trace)[0].with_suffix(".arrow")
    data = events_file.read_bytes()
    events_file.write_bytes(data[: len(data) // 2])
    spy = ParseSpy(monkeypatch)
    again = tracemagic.load(copied_trace)
    assert len(spy.calls) == 1
    pd.testing.assert_frame_equal(first.events, again.events)
    events_file.write_bytes(b"not an arrow file at all")
    assert len(tracemagic.load(copied_trace).events) == len(first.events)


def test_a_large_parse_hands_its_freed_heap_back(copied_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After parsing a large trace the loader calls ``malloc_trim(0)`` (glibc keeps what the
    parsing threads freed: ~40 MB after a 100 MB trace); not after a small one, nor when
    the trace comes from the cache. A parse on two threads (this trace's 9.8 MB of JSON,
    where two cores are free) has what it freed handed back once the events are prepared
    (their columns reuse this thread's freed heap: ~2000 page faults less on a 100 MB
    trace), the second thread's arena included (``split.trim_thread_arena``, given that
    thread's id), in place of the loader's first trim (so what preparing the events freed is
    handed back too); the loader trims once more only after files too small for a trim
    of their own. Where the C library has none, loading works alike."""
    loader = importlib.import_module("tracemagic.trace.loader")
    split = importlib.import_module("tracemagic.trace.split")
    real = loader._malloc_trim()
    assert real is None or callable(real)
    calls: list[int] = []
    ended: list[int | None] = []
    monkeypatch.setattr(loader, "_malloc_trim", lambda: calls.append)
    monkeypatch.setattr(split, "trim_thread_arena", ended.append)
    prepare = loader._prepare
    prepared: list[int] = []  # how many trims of the split parse there were as each preparation began

    def noting(*args: Any, **kwargs: Any) -> Any:
        prepared.append(len(ended))
        return prepare(*args, **kwargs)

    monkeypatch.setattr(loader, "_prepare", noting)
    tracemagic.load(copied_trace)
    assert calls == [] and ended == [], "a small trace: no trim"
    monkeypatch.setattr(loader, "TRIM_MIN_BYTES", copied_trace.stat().st_size)
    tracemagic.load(copied_trace, use_cache=False, workers=1)
    assert calls == [0] and ended == [], "after the parse, not after the preparation (its heap is the tables')"
    calls.clear()
    tracemagic.load(copied_trace, use_cache=False, workers=2)
    if split.can_split(file_source(copied_trace), 2):
        assert len(ended) == 1 and isinstance(ended[0], int), "the split parse's own, given its thread"
        assert prepared[-1] == 0, "after the preparation"
        assert calls == [], "in place of the loader's"
    else:  # one core: parsed on one thread
        assert calls == [0] and ended == []
    calls.clear()
    small = copied_trace.parent / "ranks"
    small.mkdir()
    shutil.copy(copied_trace, small / "rank0.json.gz")
    text = gzip.decompress(copied_trace.read_bytes()).replace(b'"rank": 0, "world_size": 2', b'"rank": 1, "world_size": 2', 1)
    (small / "rank1.json.gz").write_bytes(gzip.compress(text))  # (a copy of rank 0 is refused: a clash)
    size = max(file_source(small / f"rank{rank}.json.gz").size for rank in range(2))
    monkeypatch.setattr(loader, "TRIM_MIN_BYTES", size + 1)
    tracemagic.load(small, use_cache=False)
    assert calls == [0], "files too small for their own trim, together large: trimmed once, after them"
    calls.clear()
    monkeypatch.setattr(loader, "TRIM_MIN_BYTES", copied_trace.stat().st_size)
    calls.clear()
    ended.clear()
    tracemagic.load(copied_trace)
    assert calls == [] and ended == [], "the cache: nothing parsed"
    monkeypatch.setattr(loader, "_malloc_trim", lambda: None)
    monkeypatch.undo()
    assert len(tracemagic.load(copied_trace, use_cache=False).events) > 0


def test_use_cache_false_writes_nothing(copied_trace: Path, user_cache: Path) -> None:
    tracemagic.load(copied_trace, use_cache=False)
    assert sorted(p.name for p in copied_trace.parent.iterdir()) == ["nccl.json.gz"]
    assert not list(user_cache.iterdir())


def test_a_directory_of_ranks_lists_only_traces(tmp_path: Path, user_cache: Path) -> None:
    """Caches, hidden files and editors' backups beside the ranks are not ranks."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in (0, 1):
        events = [{"ph": "X", "cat": "cpu_op", "name": f"op{rank}", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
        write_trace(folder / f"rank{rank}.json", events)
    junk = {"rank0.json~": "x", "#rank1.json#": "x", ".rank1.json.swp": "x", "rank0.json.bak": "x",
            "rank0.json.orig": "x", "._rank0.json": "\x00\x05\x16\x07", ".#rank1.json": "x",
            ".rank0.json.tracemagic.arrow": "ARROW1", ".hidden.json": "{}", ".hidden.json.gz": "x"}
    for name, text in junk.items():
        (folder / name).write_text(text)
    (folder / "notes.txt").write_text("not a trace")
    trace = tracemagic.load(folder)
    assert trace.rank_ids == [0, 1]
    assert sorted(trace.events["name"].astype(str)) == ["op0", "op1"]


# -- nesting -------------------------------------------------------------------------------


def test_nesting_and_self_time(tmp_path: Path) -> None:
    t0 = 4_438_756_392_079.031  # µs since boot, as recent Kineto writes them
    def op(name: str, start: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": round(t0 + start, 3), "dur": dur}

    events = [
        op("A", 0.0, 100.0),
        op("B", 10.0, 40.0),  # in A
        op("C", 20.0, 10.0),  # in B
        op("D", 60.0, 40.1),  # in A, ends 0.1 µs after A (imperfect nesting)
        op("E", 100.5, 19.5),  # after A
        op("F", 5.0, 50.0, tid=2),  # another thread: its own tree
        op("G", 6.0, 4.0, tid=2),
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": t0 + 12.0, "dur": 30.0},
    ]
    trace = tracemagic.load(write_trace(tmp_path / "nest.json", events), use_cache=False)
    ev = trace.events
    names = ev["name"].astype(str).tolist()
    parent = {names[i]: (names[p] if p >= 0 else None) for i, p in enumerate(ev["parent"].tolist())}
    assert parent == {"A": None, "B": "A", "C": "B", "D": "A", "E": None, "F": None, "G": "F", "k": None}
    depth = dict(zip(names, ev["depth"].tolist()))
    assert depth == {"A": 0, "B": 1, "C": 2, "D": 1, "E": 0, "F": 0, "G": 1, "k": -1}
    self_dur = dict(zip(names, ev["self_dur"].tolist()))
    expected = {"A": 100.0 - 40.0 - 40.1, "B": 30.0, "C": 10.0, "D": 40.1, "E": 19.5, "F": 46.0, "G": 4.0, "k": 30.0}
    assert self_dur == pytest.approx(expected, abs=1e-6)
    # the self times of a tree add up to its root's duration (nothing counted twice)
    assert self_dur["A"] + self_dur["B"] + self_dur["C"] + self_dur["D"] == pytest.approx(100.0, abs=1e-6)


# -- progress ------------------------------------------------------------------------------


def test_progress_callback(plain_json: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "CHUNK_BYTES", 128 * 1024)
    path = tmp_path / "p.json"
    path.write_bytes(plain_json)
    calls: list[tuple[int, int]] = []
    tracemagic.load(path, use_cache=False, progress=lambda done, total: calls.append((done, total)))
    assert len(calls) > 5
    assert all(total == len(plain_json) for _, total in calls)
    dones = [done for done, _ in calls]
    assert dones == sorted(dones) and dones[-1] == len(plain_json)


def test_progress_over_several_files(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    for member, doc in raw_docs("param_dlrm_kineto.tar.gz")[:3]:
        (folder / Path(member).name).write_text(json.dumps(doc))
    total = sum(p.stat().st_size for p in folder.iterdir())
    calls: list[tuple[int, int]] = []
    tracemagic.load(folder, use_cache=False, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_progress_bars() -> None:
    assert progress.bar_for(None, 1000, "small") is None  # quick loads show nothing
    assert progress.bar_for(False, 10**10, "x") is None
    callback = lambda d, t: None  # noqa: E731
    assert progress.bar_for(callback, 10, "x") is callback
    assert not progress.in_widget_kernel()  # pytest is no kernel
    out = io.StringIO()
    bar = progress.TerminalBar("big.json", out, interval=0.0)
    bar(50, 100)
    bar(100, 100)
    text = out.getvalue()
    assert "50%" in text and "100%" in text and "big.json" in text and text.endswith("\n")
    assert isinstance(progress.bar_for(True, 10, "x"), progress.TerminalBar)


def test_widget_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[Any] = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    bar = progress.WidgetBar("big.json")
    assert shown, "the bar is displayed"
    bar(30, 100)
    bar(100, 100)
    assert bar._bar.value == 1.0
