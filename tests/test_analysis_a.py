"""ops / kernels / steps / ranks / diff on every real trace and on a CPU trace captured here.

Expectations come from the raw JSON (plain ``json``/``gzip``/``tarfile``), never from the
loader: counts and sums directly, the step breakdown through an independent sweep line
(one boundary at a time, the highest-priority active activity wins) instead of the
analyses' vectorized interval unions.
"""

from __future__ import annotations

import gzip
import json
import math
import tarfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import TRACES, exact_events

import tb_reference
import tracemagic
from tracemagic.facade import Trace

KINETO_FILES = [
    "hta_benchmark_simple_add_trace.json.gz",
    "hta_control.json.gz",
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "hta_nccl_data.json.gz",
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "hta_triton_example.json.gz",
    "kineto_worker0.1623143089861.pt.trace.json.gz",
    "param_dlrm_kineto.tar.gz",
    "tracelens_normalization_layer_test.json.gz",
]
PARTS = ["compute_us", "comm_us", "memcpy_us", "memset_us", "runtime_us", "dataloader_us", "cpu_us"]
RAW_KIND = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "runtime": "runtime",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "user_annotation",
}

assert TRACES.is_dir(), f"the real traces are missing: {TRACES} (tests/data/traces)"


# -- independent expectations from the raw JSON ----------------------------------------------
def raw_ranks(name: str) -> dict[int, list[dict[str, Any]]]:
    """rank -> timed events (X and instants) of a trace file, read with the standard library."""
    path = TRACES / name
    docs = []
    if name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".json"):
                    docs.append(json.load(tar.extractfile(member)))
    else:
        with gzip.open(path, "rt") as fh:
            docs.append(json.load(fh))
    out = {}
    for doc in docs:
        rank = int((doc.get("distributedInfo") or {}).get("rank", 0))
        out[rank] = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i", "I") and "ts" in e]
    return out


def kind(event: dict[str, Any]) -> str | None:
    return RAW_KIND.get(str(event.get("cat", "")).lower())


def raw_steps(events: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(number, start, duration) of the ProfilerSteps, by start."""
    steps = {}
    for e in events:
        if e["ph"] == "X" and str(e.get("name", "")).startswith("ProfilerStep#") and kind(e) in ("cpu_op", "user_annotation"):
            steps.setdefault(int(e["name"].split("#")[1]), (float(e["ts"]), float(e.get("dur", 0))))
    return sorted(((n, s, t) for n, (s, t) in steps.items()), key=lambda x: x[1])


def sweep_breakdown(events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Step number -> partition of its device window, by a sweep line over the raw events.

    The windows are the TensorBoard plugin's (``tb_reference``); inside one, every event
    counts by time, whichever step launched it. Times are shifted to the rank's first event
    (a live capture's events come from ``conftest.exact_events``, already exact from there).
    """
    origin = min(float(e["ts"]) for e in events)
    steps = tb_reference.device_windows(events, origin)
    if not steps:
        steps = [(-1, 0.0, max(float(e["ts"]) - origin + float(e.get("dur", 0)) for e in events))]
    marked: list[tuple[float, float, int]] = []
    for e in events:
        k, name, dur = kind(e), str(e.get("name", "")), float(e.get("dur", 0))
        if e["ph"] != "X" or dur <= 0:
            continue
        if k == "kernel":
            category = 1 if "nccl" in name.lower() else 0
        elif k in ("memcpy", "memset"):
            category = 2 if k == "memcpy" else 3
        elif k == "runtime":
            category = 4
        elif k in ("cpu_op", "user_annotation") and ("DataLoader" in name or name.startswith("enumerate(DataPipe)#")):
            category = 5
        elif k in ("cpu_op", "user_annotation") and not name.startswith("ProfilerStep#"):
            category = 6  # host ops and annotations: the TensorBoard plugin's CpuOp
        else:
            continue
        ts = float(e["ts"]) - origin
        marked.append((ts, ts + dur, category))
    out = {}
    for number, start, end in steps:
        marks = []
        for s, t, category in marked:
            s, t = min(max(s, start), end), min(max(t, start), end)
            if t > s:
                marks += [(s, 1, category), (t, -1, category)]
        marks.sort()
        active, totals, last = [0] * 7, [0.0] * 8, start
        for t, delta, category in marks:
            top = next((c for c in range(7) if active[c]), 7)
            totals[top] += t - last
            last = t
            active[category] += delta
        totals[7] += end - last
        out[number] = dict(zip(PARTS + ["idle_us"], totals)) | {"window_dur": end - start}
    return out


@pytest.fixture(scope="module")
def loaded() -> dict[str, Trace]:
    return {name: tracemagic.load(TRACES / name, use_cache=False) for name in KINETO_FILES}


@pytest.fixture(scope="module")
def raw() -> dict[str, dict[int, list[dict[str, Any]]]]:
    return {name: raw_ranks(name) for name in KINETO_FILES}


# -- contracts ----------------------------------------------------------------------------
def documented_contracts() -> dict[str, list[str]]:
    """Table -> its column list, as ``tracemagic.analysis``' docstring documents it."""
    import re

    import tracemagic.analysis

    found = re.findall(r"^- ``(\w+)(?:\([^)]*\))?``(?: \(``[\w.()]+``\))?: ``([\w, ]+)``", tracemagic.analysis.__doc__, re.M)
    return {name: [c.strip() for c in columns.split(",")] for name, columns in found}


def test_the_documented_contracts_are_the_schema() -> None:
    from tracemagic.analysis.memory import CATEGORIES
    from tracemagic.analysis.schema import KINDS, TABLES

    assert documented_contracts() == {name: table.names for name, table in TABLES.items()}
    assert TABLES["memory_categories"].names[4:-1] == ["before_capture", *CATEGORIES]
    for table in TABLES.values():
        assert set(table.dtypes().values()) <= set(KINDS), table.name
        empty = table.empty()
        assert list(empty.columns) == table.names and empty.empty
        assert [str(d) for d in empty.dtypes] == list(table.dtypes().values()), table.name


def assert_schema(name: str, table: pd.DataFrame) -> None:
    """``table`` has exactly the columns of its contract, in order, with dtypes of the
    declared kinds (the exact dtype for text kept as categoricals)."""
    from tracemagic.analysis.schema import TABLES, kind

    contract = TABLES[name]
    assert list(table.columns) == contract.names, name
    for column, declared in contract.dtypes().items():
        dtype = table[column].dtype
        if len(table):
            assert kind(dtype) == kind(declared), (name, column, str(dtype), declared)
            if declared == "category":
                assert isinstance(dtype, pd.CategoricalDtype), (name, column, str(dtype))
        else:  # an empty table may hold text as object
            assert kind(dtype) in (kind(declared), "object"), (name, column, str(dtype), declared)


@pytest.mark.parametrize("name", KINETO_FILES)
def test_tables_have_exactly_the_documented_columns(loaded: dict[str, Trace], name: str) -> None:
    from tracemagic.analysis.phases import phase_spans
    from tracemagic.analysis.spans import layer_spans

    trace = loaded[name]
    tables = {
        "ops": trace.ops(), "kernels": trace.kernels(), "steps": trace.steps(), "ranks": trace.ranks_table(),
        "collectives": trace.collectives(), "stragglers": trace.stragglers(), "layers": trace.layers(),
        "layer_spans": layer_spans(trace), "memory": trace.memory(), "memory_peaks": trace.memory_peaks(),
        "biggest_allocations": trace.biggest_allocations(), "memory_categories": trace.memory_categories(),
        "shapes": trace.shapes(), "diff": trace.diff(trace), "efficiency": trace.efficiency(),
        "advice": trace.advice(), "iterations": trace.iterations(),  # empty: not a %%chakra_trace loop
        "phases": trace.phases(), "phase_spans": phase_spans(trace),
        "source": trace.source(), "call_tree": trace.call_tree(),
        "lines": trace.lines(), "syncs": trace.syncs(),  # lines: empty, no %%chakra_trace line marks
        "sites": trace.sites(),
    }
    if name == "hta_benchmark_simple_add_trace.json.gz":  # the trace with an Execution Trace beside it
        from tracemagic.analysis.et_graph import et_graph

        tables["et_graph"], tables["et_edges"] = et_graph(trace)
        assert len(tables["et_graph"]) and len(tables["et_edges"])
    assert set(documented_contracts()) - set(tables) <= {"et_graph", "et_edges"}
    for table, frame in tables.items():
        assert_schema(table, frame)
    assert set(tables["layers"].attrs) == {"step_us", "unattributed_us", "overlap_us", "gpu_us", "gpu_unattributed_us",
                                           "compiled_regions", "compiled_layers"}


# -- kernels ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", KINETO_FILES)
def test_kernels_match_the_raw_trace(loaded: dict[str, Trace], raw: dict, name: str) -> None:
    table = loaded[name].kernels()
    for rank, events in raw[name].items():
        mine = table[table["rank"] == rank]
        for k in ("kernel", "memcpy", "memset"):
            expected = [e for e in events if e["ph"] == "X" and kind(e) == k]
            got = mine[mine["kind"] == k]
            assert len(got) == len(expected), (rank, k)
            assert got["dur"].sum() == pytest.approx(sum(float(e.get("dur", 0)) for e in expected), rel=1e-9, abs=1e-6)
            sizes = [e["args"]["bytes"] for e in expected if "bytes" in e.get("args", {})]
            assert got["bytes"].notna().sum() == len(sizes)
            assert got["bytes"].sum() == sum(sizes)
        nccl = [e for e in events if kind(e) == "kernel" and "nccl" in e["name"].lower()]
        assert int(mine["is_comm"].sum()) == len(nccl), rank
        assert sorted(mine.loc[mine["is_comm"], "dur"]) == pytest.approx(sorted(float(e["dur"]) for e in nccl))


@pytest.mark.parametrize(
    "name",
    ["hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz", "hta_triton_example.json.gz", "tracelens_normalization_layer_test.json.gz"],
)
def test_kernels_name_the_innermost_op_around_their_launch(loaded: dict[str, Trace], raw: dict, name: str) -> None:
    events = raw[name][0]
    runtime = {e["args"]["correlation"]: e for e in events if kind(e) == "runtime" and "correlation" in e.get("args", {})}
    ops = [e for e in events if e["ph"] == "X" and kind(e) == "cpu_op"]
    expected = []
    for e in events:
        if e["ph"] == "X" and kind(e) in ("kernel", "memcpy", "memset"):
            launch = runtime.get(e["args"].get("correlation"))
            around = [
                o
                for o in ops
                if launch is not None
                and o["tid"] == launch["tid"]
                and o["ts"] <= launch["ts"]
                and launch["ts"] + launch["dur"] <= o["ts"] + o["dur"] + 0.25
            ]
            inner = min(around, key=lambda o: (o["dur"], -o["ts"])) if around else None
            expected.append(inner["name"] if inner else None)
    table = loaded[name].kernels()
    assert len(expected) == len(table) and any(expected)
    assert [None if pd.isna(v) else v for v in table["op"]] == expected


def write_kineto(path: Path, events: list[dict[str, Any]]) -> Path:
    """A Kineto JSON file of ``events`` (``ph`` X unless given)."""
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 1, **e} for e in events]}))
    return path


def test_the_launching_op_is_the_one_of_the_runtime_calls_external_id(tmp_path: Path) -> None:
    """Issue 24.6: the TensorBoard plugin links a runtime call to the op with its ``External
    id`` (kineto tb_plugin ``torch_tb_profiler/profiler/event_parser.py``, ``parse_nodes``:
    "Use external_id to build correlation with its father OperatorNode ... in the case when
    RuntimeNode has duration 0 and starts at same time as a OperatorNode, just use interval
    containing relationship can't tell it is child or brother"); nesting on the call's
    thread is the fallback where the call has no External id."""
    ops = [
        {"cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 100, "dur": 50, "args": {"External id": 5}},
        {"cat": "cpu_op", "name": "aten::other", "tid": 2, "ts": 110, "dur": 30, "args": {"External id": 6}},
        {"cat": "cpu_op", "name": "aten::add", "tid": 1, "ts": 200, "dur": 10, "args": {"External id": 7}},
        {"cat": "cpu_op", "name": "aten::mul", "tid": 1, "ts": 210, "dur": 10, "args": {"External id": 8}},
        {"cat": "cpu_op", "name": "aten::relu", "tid": 1, "ts": 300, "dur": 10, "args": {"External id": 9}},
    ]
    calls = [  # (tid, ts, dur, External id or None)
        (2, 120, 5, 5),  # on another thread, inside an unrelated op there: aten::mm by id
        (1, 210, 0, 7),  # 0 µs at aten::add's end and aten::mul's start: aten::add by id
        (1, 302, 3, None),  # no id: by nesting, aten::relu
    ]
    events = list(ops)
    for i, (tid, ts, dur, ext) in enumerate(calls):
        args = {"correlation": 900 + i} | ({"External id": ext} if ext is not None else {})
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": ts, "dur": dur, "args": args})
        events.append({"cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 400 + 10 * i, "dur": 5,
                       "args": {"correlation": 900 + i, "device": 0, "stream": 7}})
    path = write_kineto(tmp_path / "t.json", events)
    # the rule, from the raw JSON: the op with the runtime call's External id, else the
    # innermost op around the call on its thread
    by_id = {e["args"]["External id"]: e["name"] for e in events if e["cat"] == "cpu_op"}
    runtime = {e["args"]["correlation"]: e for e in events if e["cat"] == "cuda_runtime"}
    want = []
    for kernel in (e for e in events if e["cat"] == "kernel"):
        call = runtime[kernel["args"]["correlation"]]
        if "External id" in call["args"]:
            want.append(by_id[call["args"]["External id"]])
        else:
            around = [o for o in ops if o["tid"] == call["tid"] and o["ts"] <= call["ts"] and call["ts"] + call["dur"] <= o["ts"] + o["dur"]]
            want.append(min(around, key=lambda o: o["dur"])["name"])
    assert want == ["aten::mm", "aten::add", "aten::relu"]
    table = tracemagic.load(path, use_cache=False).kernels()
    assert table["op"].astype(str).tolist() == want


def test_an_external_id_of_another_numbering_falls_back_to_nesting(loaded: dict[str, Trace], raw: dict) -> None:
    """Where we differ from the plugin on purpose: HTA's benchmark trace gives its runtime
    calls their correlation id as ``External id``, so the id names an op that ran at
    another time (``aten::add``, 56 ms later); the launch is then found by nesting
    (``aten::uniform_``, which the call runs inside)."""
    name = "hta_benchmark_simple_add_trace.json.gz"
    events = raw[name][0]
    ops = {e["args"]["External id"]: e for e in events if kind(e) == "cpu_op"}
    call = next(e for e in events if e["name"] == "cudaLaunchKernel")
    other = ops[call["args"]["External id"]]
    assert not other["ts"] <= call["ts"] <= other["ts"] + other["dur"]  # the id's op is elsewhere in time
    around = [o for o in ops.values() if o["tid"] == call["tid"] and o["ts"] <= call["ts"] and call["ts"] + call["dur"] <= o["ts"] + o["dur"]]
    table = loaded[name].kernels()
    launched = table[table["correlation"] == call["args"]["correlation"]]
    assert launched["op"].astype(str).tolist() == [min(around, key=lambda o: o["dur"])["name"]] == ["aten::uniform_"]


def test_gpu_work_without_a_launching_call_is_in_no_step(loaded: dict[str, Trace], raw: dict) -> None:
    """Issue 24.3: ``kernels().step`` is the step of the launching runtime call (the host
    ProfilerStep that holds it) and -1 where the trace has no launching call (work in
    flight when profiling began), as the schema and ``steps()`` (its ``unlaunched`` note:
    such work "belongs to no step") say. The DLRM trace's ranks 1 and 3 have 64 such kernels each."""
    name = "param_dlrm_kineto.tar.gz"
    table = loaded[name].kernels()
    unlaunched = loaded[name].steps().attrs["unlaunched"]
    for rank, events in raw[name].items():
        runtime = {e["args"]["correlation"]: e for e in events if kind(e) == "runtime" and "correlation" in e.get("args", {})}
        steps = raw_steps(events)
        want = []
        for e in events:
            if e["ph"] == "X" and kind(e) in ("kernel", "memcpy", "memset"):
                call = runtime.get(e.get("args", {}).get("correlation"))
                at = [n for n, start, dur in steps if call is not None and start <= call["ts"] <= start + dur + 0.25]
                want.append(at[0] if at else -1)
        mine = table[table["rank"] == rank]
        assert mine["step"].tolist() == want, rank
        orphans = sum(1 for e in events if kind(e) in ("kernel", "memcpy", "memset") and e["args"].get("correlation") not in runtime)
        assert unlaunched.get(rank, {}).get("events", 0) == orphans
    assert sorted(r for r, found in unlaunched.items() if found["events"] == 64) == [1, 3]


# -- steps --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", KINETO_FILES)
def test_steps_match_the_raw_profiler_steps(loaded: dict[str, Trace], raw: dict, name: str) -> None:
    table = loaded[name].steps()
    start = min(float(e["ts"]) for events in raw[name].values() for e in events)
    for rank, events in raw[name].items():
        mine = table[table["rank"] == rank]
        expected = raw_steps(events)
        if not expected:
            assert mine["step"].tolist() == [-1]
            assert "no ProfilerStep" in table.attrs["note"]
            end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events)
            first = min(float(e["ts"]) for e in events)
            assert mine["dur"].iloc[0] == pytest.approx(end - first)
            continue
        assert "no ProfilerStep" not in table.attrs.get("note", "")
        # less the trailing steps that launched no GPU work (the plugin's tail rule)
        kept = {n for n, _, _ in tb_reference.device_windows(events, 0.0)}
        expected = [step for step in expected if step[0] in kept]
        assert mine["step"].tolist() == [n for n, _, _ in expected]
        assert mine["dur"].tolist() == [d for _, _, d in expected]
        assert mine["ts"].to_numpy() == pytest.approx([s - start for _, s, _ in expected], abs=1e-3)


@pytest.mark.parametrize("name", KINETO_FILES)
def test_step_breakdown_matches_a_sweep_line_and_adds_up(loaded: dict[str, Trace], raw: dict, name: str) -> None:
    table = loaded[name].steps()
    parts = table[PARTS + ["idle_us"]]
    assert (parts.to_numpy() >= -1e-9).all()
    np.testing.assert_allclose(parts.sum(axis=1), table["window_dur"], rtol=1e-12, atol=1e-6)
    for rank, events in raw[name].items():
        expected = sweep_breakdown(events)
        for _, row in table[table["rank"] == rank].iterrows():
            want = expected[int(row["step"])]
            for column in PARTS + ["idle_us", "window_dur"]:
                assert row[column] == pytest.approx(want[column], rel=1e-9, abs=1e-3), (rank, row["step"], column)


def test_a_step_window_runs_to_the_end_of_the_gpu_work_it_launched(tmp_path: Path) -> None:
    """A hand-made trace whose every overlap is known: priorities, device windows, exact sums."""

    def x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    gpu = {"pid": 0, "tid": 7}
    events = [
        x("ProfilerStep#3", "user_annotation", 1000, 100),
        x("aten::mm", "cpu_op", 1000, 70),
        x("cudaLaunchKernel", "cuda_runtime", 1000, 15, correlation=1),
        x("cudaLaunchKernel", "cuda_runtime", 1020, 5, correlation=2),
        x("cudaMemcpyAsync", "cuda_runtime", 1040, 5, correlation=3),
        x("cudaLaunchKernel", "cuda_runtime", 1090, 5, correlation=4),
        x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 1075, 10),
        x("gemm", "kernel", 1010, 20, correlation=1) | gpu,
        x("ncclKernel_AllReduce_RING_LL_Sum_float", "kernel", 1020, 30, correlation=2) | gpu,
        x("Memcpy HtoD", "gpu_memcpy", 1045, 15, correlation=3, bytes=64) | gpu,
        x("late", "kernel", 1095, 40, correlation=4) | gpu,  # runs past the step's end
        x("ProfilerStep#4", "user_annotation", 1100, 50),
        # a last step that launches work, so step 4 (none) is no trailing step the plugin drops
        x("ProfilerStep#5", "user_annotation", 1200, 50),
        x("cudaLaunchKernel", "cuda_runtime", 1210, 5, correlation=5),
        x("next", "kernel", 1220, 10, correlation=5) | gpu,
    ]
    path = tmp_path / "made.json"
    path.write_text(json.dumps({"traceEvents": events}))
    table = tracemagic.load(path, use_cache=False).steps().set_index("step")
    first = table.loc[3]
    # the window of step 3 runs to the end of "late" (1135), step 4's from there to its host end;
    # compute 1010-1030 + 1095-1135; comm 1030-1050; memcpy 1050-1060; runtime 1000-1010;
    # cpu 1060-1070; dataloader 1075-1085; runtime 1090-1095; idle 1070-1075 + 1085-1090
    assert (first["dur"], first["window_ts"], first["window_dur"]) == (100.0, 0.0, 135.0)
    assert first[PARTS + ["idle_us"]].tolist() == [60.0, 20.0, 10.0, 0.0, 15.0, 10.0, 10.0, 10.0]
    assert (first["gpu_busy_us"], first["gpu_idle_us"]) == (90.0, 45.0)  # 1010-1060 and 1095-1135
    second = table.loc[4]
    assert (second["dur"], second["window_ts"], second["window_dur"]) == (50.0, 135.0, 15.0)
    assert second["compute_us"] == 0.0 and second["idle_us"] == 15.0 and second["gpu_idle_us"] == 15.0


def test_datapipe_iteration_is_data_loading(tmp_path: Path) -> None:
    """Issue 24.4: DataPipe iteration (``enumerate(DataPipe)#...``) is data loading, as the
    TensorBoard plugin files it (kineto tb_plugin ``torch_tb_profiler/profiler/event_parser.py``,
    ``_parse_step``: an op or annotation named ``enumerate(DataLoader)#...__next__`` or
    ``enumerate(DataPipe)#...`` is the DataLoader role)."""
    events = []
    for step in range(2):
        start = 1000.0 * step
        events += [
            {"name": f"ProfilerStep#{step}", "cat": "user_annotation", "ts": start, "dur": 500},
            {"name": "enumerate(DataPipe)#ShufflerIterDataPipe", "cat": "user_annotation", "ts": start + 10, "dur": 120},
            {"name": "aten::mm", "cat": "cpu_op", "ts": start + 200, "dur": 100},
        ]
    path = tmp_path / "datapipe.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, **e} for e in events]}))

    def data_loading(name: str) -> bool:  # the plugin's rule
        return (name.startswith("enumerate(DataLoader)#") and name.endswith(".__next__")) or name.startswith("enumerate(DataPipe)#")

    want = {int(e["name"].split("#")[1]): 0.0 for e in events if e["name"].startswith("ProfilerStep#")}
    for e in events:
        if data_loading(e["name"]):
            want[int(e["ts"] // 1000)] += e["dur"]
    table = tracemagic.load(path, use_cache=False).steps()
    assert dict(zip(table["step"], table["dataloader_us"])) == want == {0: 120.0, 1: 120.0}
    assert table["cpu_us"].tolist() == [100.0, 100.0]


def test_wrappers_are_kept_apart_from_the_ops_as_the_plugin_does(loaded: dict[str, Trace], raw: dict) -> None:
    """Issue 24.7: the TensorBoard plugin's Operator view lists only operator nodes (kineto
    tb_plugin ``torch_tb_profiler/profiler/node.py``: ``create_operator_node`` makes DataLoader
    (``enumerate(DataLoader)#...__next__``, ``enumerate(DataPipe)#...``) and optimizer
    (``Optimizer.step...``) nodes of such ops; ``is_operator_node`` also leaves out
    ``Optimizer.*`` and ``DataParallel.forward``/``DistributedDataParallel.forward``); the old
    ResNet-50 trace files them as ops. ``top_ops`` is those operator nodes, the wrappers are
    listed apart (``top_wrappers``, shown under the Timeline's ops), and no time is lost."""
    from tracemagic.analysis.aggregate import top_ops, top_wrappers

    name = "kineto_worker0.1623143089861.pt.trace.json.gz"
    events = raw[name][0]

    def wrapper(n: str) -> bool:  # the plugin's rules
        return ((n.startswith("enumerate(DataLoader)#") and n.endswith(".__next__")) or n.startswith("enumerate(DataPipe)#")
                or n.startswith("Optimizer.") or n in ("DataParallel.forward", "DistributedDataParallel.forward"))

    ops = [e for e in events if e["ph"] == "X" and kind(e) == "cpu_op" and not e["name"].startswith("ProfilerStep#")]
    wrappers = [e for e in ops if wrapper(e["name"])]
    assert {e["name"] for e in wrappers} == {
        "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "Optimizer.step#SGD.step", "Optimizer.zero_grad#SGD.zero_grad"}
    table = loaded[name].ops()
    listed = top_ops(table)
    assert set(listed["name"]) == {e["name"] for e in ops if not wrapper(e["name"])}
    apart = top_wrappers(table).set_index("name")
    assert set(apart.index) == {e["name"] for e in wrappers}
    for n in apart.index:
        assert apart.loc[n, "calls"] == sum(1 for e in wrappers if e["name"] == n)
        assert apart.loc[n, "total_us"] == pytest.approx(sum(e["dur"] for e in wrappers if e["name"] == n))
    # every op's self time is in one of the two tables
    all_self = table.loc[table["kind"] == "cpu_op", "self_dur"].sum()
    assert listed["self_us"].sum() + apart["self_us"].sum() == pytest.approx(all_self)
    # the Timeline tab lists them apart, under its ops table, which holds none of them
    from tracemagic.views import Dashboard

    section = Dashboard(loaded[name]).section("timeline")
    assert not set(section.table["name"].astype(str)) & set(apart.index)
    ((caption, shown),) = [(c, f) for c, f in section.extra if "wrappers" in c]
    assert set(shown["name"].astype(str)) == set(apart.index)


# -- ranks and collectives ------------------------------------------------------------------
def nccl_kernels(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((e for e in events if kind(e) == "kernel" and "nccl" in e["name"].lower()), key=lambda e: e["ts"])


def test_ranks_of_the_eight_rank_dlrm_trace(loaded: dict[str, Trace], raw: dict) -> None:
    name = "param_dlrm_kineto.tar.gz"
    trace, ranks = loaded[name], raw[name]
    table = trace.ranks_table().set_index("rank")
    assert sorted(table.index) == list(range(8)) == trace.rank_ids
    for rank, events in ranks.items():
        origin = min(float(e["ts"]) for e in events)
        ((_, start, end),) = tb_reference.device_windows(events, origin)
        want = sweep_breakdown(events)[10]
        row = table.loc[rank]
        assert row["steps"] == 1 and row["step_us"] == pytest.approx(end - start, abs=1e-3)
        for column in ("compute_us", "comm_us", "memcpy_us", "idle_us"):
            assert row[column] == pytest.approx(want[column], abs=1e-3)
        # overlap: NCCL time during which another kernel runs, by brute force on 1 µs ticks
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in nccl_kernels(events)]
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in events if kind(e) == "kernel" and "nccl" not in e["name"].lower()]
        ticks = origin + np.arange(start, end)
        in_comm = np.zeros(ticks.size, dtype=bool)
        in_compute = np.zeros(ticks.size, dtype=bool)
        for s, t in comm:
            in_comm |= (ticks >= s) & (ticks < t)
        for s, t in compute:
            in_compute |= (ticks >= s) & (ticks < t)
        assert row["overlap_pct"] == pytest.approx(100 * (in_comm & in_compute).sum() / in_comm.sum(), abs=0.5)

    # collectives: the n-th NCCL kernel of every rank is one collective; its true straggler
    # starts it last, and everyone leaves together (one wall clock across the node)
    found = trace.collectives()
    per_rank = {rank: nccl_kernels(events) for rank, events in ranks.items()}
    assert {len(v) for v in per_rank.values()} == {8}
    assert len(found) == 64 and (found["ranks"] == 8).all() and (found["source"] == "kernel").all()
    waits = Counter()
    for n in range(8):
        starts = {rank: kernels[n]["ts"] for rank, kernels in per_rank.items()}
        ends = [k[n]["ts"] + k[n]["dur"] for k in per_rank.values()]
        assert max(ends) - min(ends) < 10
        for rank, s in starts.items():
            waits[rank] += max(starts.values()) - s
    got = found.groupby("rank")["wait_us"].sum()
    for rank in range(8):
        assert got[rank] == pytest.approx(waits[rank], abs=10)
    assert (found.groupby(["collective", "seq"])["wait_us"].min().abs() < 5).all()
    # the SendRecv kernels are all-to-alls (the host launched them in nccl:all_to_all), so
    # they end together like the all-reduces and count for the clock and excess_us
    for events in ranks.values():
        annotations = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "nccl:all_to_all"]
        launches = {e["args"]["correlation"]: e for e in events if kind(e) == "runtime" and "correlation" in e.get("args", {})}
        for k in nccl_kernels(events):
            if "SendRecv" in k["name"]:
                at = launches[k["args"]["correlation"]]
                assert any(tid == at["tid"] and a <= at["ts"] < b for tid, a, b in annotations)
    assert found["excess_us"].notna().all() and (found["collective"] == "SendRecv").sum() == 40
    straggler = min(waits, key=waits.get)
    assert trace.stragglers()["rank"].tolist() == [straggler]
    assert table["slowest"].sum() == 1 and table.loc[straggler, "slowest"]
    # the straggler has the SHORTEST step here: it came late, the others waited for it
    assert table.loc[straggler, "step_us"] == table["step_us"].min()


def test_collectives_match_across_ranks_and_correct_clock_offsets(tmp_path: Path) -> None:
    """Two ranks whose clocks differ by 5 ms; rank 1 reaches each all-reduce 300 µs late."""
    for rank, (clock, late) in enumerate([(0.0, 0.0), (5000.0, 300.0)]):
        events = [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": clock + 1000 * n, "dur": 900}
            for n in (1, 2)
        ]
        for n in (1, 2):
            for k, start in enumerate((100.0, 500.0)):
                begin = clock + 1000 * n + start + late
                end = clock + 1000 * n + start + 350.0  # all leave together
                events += [
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": begin - 10, "dur": 5, "args": {"correlation": 10 * n + k}},
                    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "pid": 0, "tid": 7, "ts": begin, "dur": end - begin, "args": {"correlation": 10 * n + k}},
                ]
        doc = {"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    trace = tracemagic.load(tmp_path, use_cache=False, workers=1)
    found = trace.collectives()
    assert len(found) == 8 and set(found["collective"]) == {"AllReduce"} and (found["ranks"] == 2).all()
    assert found.attrs["clock_offset_us"][1] - found.attrs["clock_offset_us"][0] == pytest.approx(5000.0)
    by_rank = found.groupby("rank")
    assert by_rank["wait_us"].max().tolist() == pytest.approx([300.0, 0.0])
    assert by_rank["excess_us"].max().tolist() == pytest.approx([300.0, 0.0])
    assert found.sort_values(["rank", "ts"])["arrival_us"].tolist() == pytest.approx([100, 500] * 2 + [400, 800] * 2)
    late = trace.stragglers()
    assert late["step"].tolist() == [1, 2] and late["rank"].tolist() == [1, 1] and set(late["by"]) == {"collectives"}
    table = trace.ranks_table().set_index("rank")
    assert table["slowest"].tolist() == [False, True] and table["straggler_steps"].tolist() == [0, 2]
    assert table.loc[0, "wait_us"] == pytest.approx(600.0) and table.loc[1, "wait_us"] == 0


def test_clock_correction_ignores_point_to_point_kernels(tmp_path: Path) -> None:
    """Three ranks with clocks 5 ms apart. Per step an all-reduce and a SendRecv launched by
    ``nccl:all_to_all`` end together; three SendRecv kernels with no all-to-all around them
    (pipeline sends and receives) and a broadcast end at different times on each rank."""
    clocks, late = [0.0, 5000.0, -2000.0], [0.0, 50.0, 120.0]
    true_starts: dict[tuple[int, str], list[float]] = defaultdict(list)
    for rank in range(3):
        clock = clocks[rank]
        events = [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": clock + 1000 * n, "dur": 900}
            for n in (1, 2)
        ]
        corr = 0

        def launch(kernel: str, begin: float, end: float, around: str | None = None) -> None:
            nonlocal corr
            corr += 1
            runtime = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": clock + begin - 10, "dur": 5, "args": {"correlation": corr}}
            if around:
                events.append({"ph": "X", "cat": "user_annotation", "name": around, "pid": 1, "tid": 1, "ts": clock + begin - 12, "dur": 9})
            events.append(runtime)
            events.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{kernel}(ncclDevComm*, unsigned long, ncclWork*)", "pid": 0, "tid": 7,
                           "ts": clock + begin, "dur": end - begin, "args": {"correlation": corr}})

        for n in (1, 2):
            base = 1000.0 * n
            launch("AllReduce_Sum_f32_RING_LL", base + 100 + late[rank], base + 300)
            true_starts[(n, "AllReduce")].append(base + 100 + late[rank])
            launch("SendRecv", base + 320 + late[rank] / 2, base + 400, around="nccl:all_to_all")
            for j in range(3):  # point to point: each rank's transfer ends on its own
                begin = base + 450 + 40 * j + 7 * rank
                launch("SendRecv", begin, begin + 10 + 30 * rank)
            launch("Broadcast_RING_LL_Sum_int8_t", base + 700 + 5 * rank, base + 760 + 20 * rank)
            true_starts[(n, "Broadcast")].append(base + 700 + 5 * rank)
        doc = {"distributedInfo": {"rank": rank, "world_size": 3}, "traceEvents": events}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    trace = tracemagic.load(tmp_path, use_cache=False, workers=1)
    found = trace.collectives()
    assert len(found) == 3 * 2 * 6 and (found["ranks"] == 3).all()
    offset = found.attrs["clock_offset_us"]
    assert [offset[r] - offset[0] for r in range(3)] == pytest.approx([c - clocks[0] for c in clocks], abs=1e-9)
    for (step, name), starts in true_starts.items():
        rows = found[(found["step"] == step) & (found["collective"] == name)].sort_values("rank")
        assert rows["wait_us"].tolist() == pytest.approx([max(starts) - s for s in starts], abs=1e-9), (step, name)
    allreduce = found[found["collective"] == "AllReduce"].sort_values(["step", "rank"])
    durations = [200.0 - x for x in late]
    assert allreduce["excess_us"].tolist() == pytest.approx([d - min(durations) for d in durations] * 2)
    sendrecv = found[found["collective"] == "SendRecv"]
    all_to_all, p2p = sendrecv[sendrecv["seq"] == 0], sendrecv[sendrecv["seq"] > 0]
    assert all_to_all["wait_us"].notna().all() and all_to_all["excess_us"].notna().all()
    assert len(p2p) == 18 and p2p["wait_us"].isna().all() and p2p["excess_us"].isna().all()
    broadcast = found[found["collective"] == "Broadcast"]
    assert broadcast["wait_us"].notna().all() and broadcast["excess_us"].isna().all()


@pytest.mark.parametrize("name", ["hta_nccl_data.json.gz", "hta_control.json.gz"])
def test_single_rank_of_a_job_has_collectives_but_no_waits(loaded: dict[str, Trace], raw: dict, name: str) -> None:
    trace = loaded[name]
    ((rank, events),) = raw[name].items()
    found = trace.collectives()
    assert len(found) == len(nccl_kernels(events)) > 0
    assert found["wait_us"].isna().all() and (found["ranks"] == 1).all()
    table = trace.ranks_table()
    assert table["rank"].tolist() == [rank] and table["slowest"].tolist() == [True]
    assert 0 < table["overlap_pct"].iloc[0] < 100
    assert trace.stragglers().empty


# -- diff -----------------------------------------------------------------------------------
def test_diff_of_a_trace_with_itself_is_all_same(loaded: dict[str, Trace], raw: dict) -> None:
    name = "hta_control.json.gz"
    table = loaded[name].diff(loaded[name])
    assert set(table["status"]) == {"same"} and (table["delta_us"] == 0).all()
    assert set(table["level"]) >= {"op", "kernel"}
    ops = table[table["level"] == "op"].set_index("name")
    # op rows are call chains: the outermost op with shapes, the ops it runs inside it
    from test_nesting import chain_oracle, table_events

    events = table_events(TRACES / name)
    chains = chain_oracle(events)
    assert ops["calls_a"].to_dict() == dict(Counter(events[top]["name"] for top in chains))
    assert ops["us_a"].sum() == pytest.approx(sum(c["dur"] for c in chains.values()))


def test_diff_of_two_traces_finds_added_removed_and_changed(loaded: dict[str, Trace]) -> None:
    a, b = loaded["hta_control.json.gz"], loaded["kineto_worker0.1623143089861.pt.trace.json.gz"]
    table = a.diff(b)
    ops = table[table["level"] == "op"].set_index("name")
    assert ops.loc["aten::conv2d", "status"] == "added"  # ResNet's convolutions, not in a
    assert "aten::cudnn_convolution" not in ops.index  # inside aten::conv2d's chains
    assert ops.loc["record_param_comms", "status"] == "removed"  # a's NCCL, not in b
    kernels = table[table["level"] == "kernel"]
    assert {"added", "removed"} <= set(kernels["status"])
    both = table[(table["calls_a"] > 0) & (table["calls_b"] > 0)]
    assert set(both["status"]) <= {"faster", "slower", "same"}
    assert (both.loc[both["status"] == "slower", "ratio"] > 1.05).all()
    assert (both.loc[both["status"] == "faster", "ratio"] < 0.95).all()
    assert table["status"].map({"added": 1, "removed": 1}).fillna(0).sum() == ((table["calls_a"] == 0) | (table["calls_b"] == 0)).sum()


def test_diff_verdict_is_by_presence_not_by_call_count() -> None:
    """A layer whose forward ran before the steps has 0 calls but backward time: not 'added'."""
    from tracemagic.analysis.diff import _compare

    a = pd.DataFrame({"calls": [0, 3], "us": [10.0, 5.0], "gpu_us": [0.0, 0.0]}, index=["bwd_only", "gone"])
    b = pd.DataFrame({"calls": [2, 1], "us": [30.0, 1.0], "gpu_us": [0.0, 0.0]}, index=["bwd_only", "new"])
    table = _compare("layer", a, b, 0.05).set_index("name")
    assert table["status"].to_dict() == {"bwd_only": "slower", "gone": "removed", "new": "added"}
    assert table.loc["bwd_only", "ratio"] == 3.0 and table.loc["new", "calls_a"] == 0 and table.loc["gone", "us_b"] == 0


# -- a CPU trace captured here from a real model --------------------------------------------
@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trace, Path]:
    """Three active steps of a small MLP trained from a DataLoader, on the CPU."""
    import torch

    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    data = torch.utils.data.TensorDataset(torch.randn(96, 16), torch.randint(0, 4, (96,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path_factory.mktemp("capture") / "kineto_trace_0.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=3),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
    ) as prof:
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            prof.step()
    return tracemagic.load(path, use_cache=False), path


def test_captured_cpu_trace_steps_and_ops(captured: tuple[Trace, Path]) -> None:
    trace, path = captured
    events = exact_events(path)
    steps = trace.steps()
    expected = raw_steps(events)
    assert len(expected) == 3 and steps["step"].tolist() == [n for n, _, _ in expected]
    assert steps[["compute_us", "comm_us", "memcpy_us", "memset_us", "runtime_us"]].to_numpy().sum() == 0
    assert (steps["dataloader_us"] > 0).all() and (steps["cpu_us"] > 0).all()
    np.testing.assert_allclose(steps["window_dur"], steps["dur"])  # no GPU: the window is the host step
    np.testing.assert_allclose(steps[PARTS + ["idle_us"]].sum(axis=1), steps["window_dur"], rtol=1e-12)
    want = sweep_breakdown(events)
    for _, row in steps.iterrows():
        assert row["cpu_us"] == pytest.approx(want[int(row["step"])]["cpu_us"], abs=1e-3)
        assert row["dataloader_us"] == pytest.approx(want[int(row["step"])]["dataloader_us"], abs=1e-3)

    ops = trace.ops()
    raw_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    assert len(ops) == len(raw_ops)
    assert (ops["self_dur"] <= ops["dur"] + 1e-9).all()
    top = ops[(ops["depth"] == 0) & (ops["kind"] != "step")]
    assert top["step"].isin(steps["step"]).all()
    # aten::linear ops run inside the nn.Module events of the two Linear layers
    linear = ops[ops["name"] == "aten::linear"]
    assert len(linear) == 6 and set(linear["layer"]) == {"Linear_0", "Linear_1"} and set(linear["layer_type"]) == {"Linear"}
    assert linear["input_dims"].str.startswith("[[16, ").all()
    assert trace.kernels().empty and list(trace.kernels().columns)[:5] == ["rank", "row", "name", "kind", "device"]
    table = trace.ranks_table()
    assert table["slowest"].tolist() == [True] and math.isnan(table["overlap_pct"].iloc[0])
    assert table["step_us"].iloc[0] == pytest.approx(steps["window_dur"].mean())


def test_layer_names_come_from_the_capture_manifest(captured: tuple[Trace, Path]) -> None:
    trace, _ = captured
    modules = {"nn.Module: Linear_0": {"path": "net.0", "type": "Linear"}, "nn.Module: Linear_1": {"path": "net.2", "type": "Linear"}}
    named = Trace(trace.events, trace.flows, trace.meta, manifest={"modules": modules})
    linear = named.ops().query("name == 'aten::linear'")
    assert set(linear["layer"]) == {"net.0", "net.2"}
    assert named.ops().query("name == 'aten::relu'")["layer"].eq("ReLU_0").all()


def test_captured_trace_diffed_layer_by_layer(captured: tuple[Trace, Path], loaded: dict[str, Trace], raw: dict) -> None:
    trace, path = captured
    table = trace.diff(trace)
    assert set(table["status"]) == {"same"} and set(table["level"]) == {"op", "layer"}
    assert table.loc[table["name"] == "aten::linear", "calls_a"].tolist() == [6]
    events = json.loads(path.read_text())["traceEvents"]
    module_calls = Counter(e["name"].removeprefix("nn.Module: ") for e in events if str(e.get("name")).startswith("nn.Module: "))
    layers = table[table["level"] == "layer"].set_index("name")
    assert layers.loc["Linear_0", "calls_a"] == module_calls["Linear_0"] == 3
    assert layers.loc["Linear_0", "type"] == "Linear"

    other = loaded["tracelens_normalization_layer_test.json.gz"]
    versus = trace.diff(other)
    layers = versus[versus["level"] == "layer"].set_index("name")
    assert layers.loc["Linear_0", "status"] == "removed" and layers.loc["BatchNorm2d_0", "status"] == "added"
    (raw_other,) = raw["tracelens_normalization_layer_test.json.gz"].values()
    assert layers.loc["BatchNorm2d_0", "calls_b"] == sum(e.get("name") == "nn.Module: BatchNorm2d_0" for e in raw_other)
    assert set(versus["level"]) == {"op", "kernel", "layer"}


def test_gloo_collectives_on_a_cpu_rank(tmp_path: Path) -> None:
    """A one-process gloo group: host time in collectives is communication on a CPU rank."""
    import torch

    dist = torch.distributed
    from torch.profiler import profile, schedule

    assert dist.is_available() and not dist.is_initialized(), "torch.distributed is unavailable or already in use"
    path = tmp_path / "kineto_trace_0.json"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with profile(schedule=schedule(wait=0, warmup=1, active=2), on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
            for _ in range(3):
                tensor = torch.ones(1 << 16)
                dist.all_reduce(tensor)
                dist.broadcast(tensor, src=0)
                prof.step()
    finally:
        dist.destroy_process_group()
    trace = tracemagic.load(path, use_cache=False)
    events = json.loads(path.read_text())["traceEvents"]
    expected = [e for e in events if e.get("ph") == "X" and str(e.get("name")).startswith("gloo:")]
    found = trace.collectives()
    assert len(found) == len(expected) == 4 and set(found["source"]) == {"annotation"}
    assert set(found["collective"]) == {"all_reduce", "broadcast"} and found["wait_us"].isna().all()
    steps = trace.steps()
    assert (steps["comm_us"] > 0).all() and steps["compute_us"].sum() == 0
    np.testing.assert_allclose(steps[PARTS + ["idle_us"]].sum(axis=1), steps["window_dur"], rtol=1e-12)
