"""Our own CUDA captures (made on a GPU by ``bench/gpu_check.py``), parsed on any machine.

Each ``tests/data/cuda/*.tar.gz`` holds one capture folder as the magic wrote it on the GPU,
and beside it ``gpu_check.json`` (the GPU, driver, torch, and what the cell itself read:
``torch.cuda.max_memory_allocated()`` over the recorded iterations, ``named_modules()``).
Every figure is checked against the raw JSON, computed here. ``TRACEMAGIC_CUDA_CAPTURES=DIR``
points the module at another folder of such archives (``bench/gpu_check.py --out DIR`` on a
CPU makes ``cpu_*.tar.gz``: the GPU-only tests then skip, each saying why).
"""

from __future__ import annotations

import bisect
import html
import json
import os
import re
import tarfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

import tracemagic
from tracemagic.analysis import devices
from tracemagic.analysis.advice import HOST_SYNC_SHARE
from tracemagic.views.report import write_report

DATA = Path(os.environ.get("TRACEMAGIC_CUDA_CAPTURES") or Path(__file__).parent / "data" / "cuda")
ARCHIVES = sorted(DATA.glob("*.tar.gz")) if DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not ARCHIVES, reason="no CUDA captures in tests/data/cuda")

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
#: dynamo tracing or compiling a frame (as tests/test_compiled.py)
#: a ``%%chakra_trace`` line mark: ``tracemagic.line:N``, N the cell line (the magic's is 1)
MARK = "tracemagic.line:"
#: runtime calls that block the host until the GPU is done (``cudaMemcpy`` is the synchronous one)
SYNC_CALLS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
RETRACE = re.compile(r"bytecode_tracing|dynamo_timed|compile_id=|convert_frame\.py\(\d+\): _compile\b")


def _key(archive: Path) -> str:
    return archive.name.removesuffix(".tar.gz").split("_", 1)[1]


class Capture:
    """One extracted archive: its folder, raw events, gpu_check.json and the loaded trace."""

    def __init__(self, archive: Path, into: Path) -> None:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
        (self.dir,) = [p for p in into.iterdir() if p.is_dir()]
        self.key = _key(archive)
        self.meta: dict[str, Any] = json.loads((into / "gpu_check.json").read_text())
        self.manifest: dict[str, Any] = json.loads((self.dir / "capture.json").read_text())
        self.doc: dict[str, Any] = json.loads((self.dir / "kineto_trace_0.json").read_text())
        self.trace = tracemagic.load(self.dir, cache_dir=into / "cache")
        xs = [e for e in self.doc["traceEvents"] if e.get("ph") == "X"]
        self.xs = xs
        self.steps = sorted(
            (e for e in xs if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")),
            key=lambda e: e["ts"],
        )
        self.gpu = [e for e in xs if e.get("cat") in GPU_CATS]
        self.launches = {
            e["args"]["correlation"]: e
            for e in xs
            if e.get("cat") in RUNTIME_CATS and "correlation" in e.get("args", {})
        }
        self.cpu_ops = {
            e["args"]["External id"]: e for e in xs if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
        }

    def step_of(self, ts: float) -> int:
        return next((int(s["name"].split("#")[1]) for s in self.steps if s["ts"] <= ts <= s["ts"] + s["dur"]), -1)

    def needs_gpu(self) -> None:
        if not self.gpu:
            pytest.skip(f"{self.key}: no GPU activity in this capture")


def _of(*keys: str, et: bool = False) -> list[Any]:
    """The archives of these captures (all without ``keys``; those made with ``--et``)."""
    chosen = [a for a in ARCHIVES if (not keys or _key(a) in keys) and (not et or _key(a).endswith("_et"))]
    return [pytest.param(a, id=a.name) for a in chosen]


@pytest.fixture
def capture(request: pytest.FixtureRequest, tmp_path: Path) -> Capture:
    return Capture(request.param, tmp_path)


def each(*keys: str, et: bool = False) -> Any:
    """Run the test once per archive of ``keys`` (every archive without them)."""
    return pytest.mark.parametrize("capture", _of(*keys, et=et), indirect=True)


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@each()
def test_the_capture_is_complete_with_its_recorded_steps(capture: Capture) -> None:
    assert capture.manifest["status"] == "complete"
    recorded = [s["step"] for s in capture.manifest["steps"]]
    assert [int(s["name"].split("#")[1]) for s in capture.steps] == recorded
    assert list(capture.trace.steps()["step"]) == recorded


@each()
def test_kernels_are_the_raw_kernels_launched_by_their_ops(capture: Capture) -> None:
    capture.needs_gpu()
    table = capture.trace.kernels()
    raw = [e for e in capture.gpu if e["cat"] == "kernel"]
    assert int((table["kind"] == "kernel").sum()) == len(raw) > 0
    ours = {
        int(c): (str(op), int(s))
        for c, op, s in zip(table["correlation"], table["op"], table["step"])
        if not isinstance(c, type(None)) and str(c) != "<NA>"
    }
    launched = [k for k in raw if k["args"].get("correlation") in capture.launches]
    assert len(launched) >= 0.99 * len(raw)  # the rest were in flight when the window opened
    for k in launched:
        launch = capture.launches[k["args"]["correlation"]]
        op = capture.cpu_ops.get(launch["args"].get("External id"))
        step = capture.step_of(launch["ts"])
        assert step >= 0, k["name"]  # launched by the cell's ops, inside a recorded step
        if op is not None:
            assert ours[k["args"]["correlation"]] == (op["name"], step), k["name"]


def _windows(capture: Capture) -> list[tuple[float, float]]:
    """Each host step's device window from the raw events (the TensorBoard plugin's rule):
    from its start (or the previous window's end) to the end of the step or of the last GPU
    work launched inside it, whichever is later."""
    out: list[tuple[float, float]] = []
    prev_end = float("-inf")
    for s in capture.steps:
        start, host_end = s["ts"], s["ts"] + s["dur"]
        ends = []
        for k in capture.gpu:
            launch = capture.launches.get(k["args"].get("correlation"))
            if launch is not None and start <= launch["ts"] and launch["ts"] + launch["dur"] <= host_end:
                ends.append(k["ts"] + k["dur"])
        w_start, w_end = max(start, prev_end), max([host_end, *ends])
        prev_end = w_end
        out.append((w_start, w_end))
    return out


def _counted(capture: Capture) -> list[int]:
    """The steps every mean counts (capture.json's steps less a loop's exit or an error's cut)."""
    return [
        s["step"] for s in capture.manifest["steps"] if s.get("complete") or s.get("end") not in ("loop_exit", "error")
    ]


@each()
def test_device_windows_and_gpu_busy_follow_the_raw_events(capture: Capture) -> None:
    capture.needs_gpu()
    table = capture.trace.steps()
    for row, s, (w_start, w_end) in zip(table.itertuples(), capture.steps, _windows(capture)):
        start = s["ts"]
        assert row.window_ts - row.ts == pytest.approx(w_start - start, abs=2.0)
        assert row.window_dur == pytest.approx(w_end - w_start, abs=max(2.0, 1e-4 * row.window_dur))
        busy = _union(
            [
                (max(k["ts"], w_start), min(k["ts"] + k["dur"], w_end))
                for k in capture.gpu
                if k["ts"] < w_end and k["ts"] + k["dur"] > w_start
            ]
        )
        assert row.gpu_busy_us == pytest.approx(busy, abs=max(2.0, 1e-4 * row.window_dur))
        assert row.gpu_idle_us == pytest.approx(row.window_dur - busy, abs=max(2.0, 1e-4 * row.window_dur))


@each()
def test_the_cuda0_memory_peak_is_the_allocators(capture: Capture) -> None:
    memory = [
        e
        for e in capture.doc["traceEvents"]
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 1 and e["args"].get("Device Id") == 0
    ]
    if not memory:
        pytest.skip(f"{capture.key}: no CUDA memory event in this capture")
    raw_peak = max(e["args"]["Total Allocated"] for e in memory)
    peaks = capture.trace.memory_peaks()
    whole = peaks[(peaks["device"] == "cuda:0") & peaks["step"].isna()]
    assert list(whole["peak_bytes"]) == [raw_peak]
    in_cell = capture.meta.get("max_memory_allocated")
    if in_cell is not None:  # the same allocator statistic, read in the cell over the same iterations
        assert abs(raw_peak - in_cell) <= max(2 << 20, 0.01 * in_cell)


@each()
def test_the_device_is_named_and_its_peaks_known(capture: Capture) -> None:
    props = capture.doc.get("deviceProperties") or []
    if not props:
        pytest.skip(f"{capture.key}: no deviceProperties (a CPU capture)")
    assert capture.trace.devices[0]["name"] == props[0]["name"] == capture.meta["environment"]["gpu"]
    assert capture.manifest["device"] == {"type": "cuda", "name": props[0]["name"], "activities": ["CPU", "CUDA"]}
    peaks = devices.match(capture.trace.devices[0])
    assert peaks is not None and peaks.bf16 > 0 and peaks.tbytes_per_s > 0


def _expected_layers(capture: Capture) -> set[str]:
    """``named_modules()`` as gpu_check.py lists them (the root by its variable), with the
    root named ``var (Class)`` where its variable is also a child's path (then the list holds
    ``var`` twice: ``bert = BertForMaskedLM(...)`` and its ``.bert``); the root's class is the
    type the manifest records for it (its entry whose qualified name is the variable)."""
    var, names = capture.meta["var"], list(capture.meta["named_modules"])
    if names.count(var) > 1:
        (kind,) = {m["type"] for m in capture.manifest["modules"].values() if m["qualname"] == var}
        names[names.index(var)] = f"{var} ({kind})"
    return set(names)


@each("quickstart", "quickstart_et", "transformer", "transformer_et")
def test_layer_names_are_the_models_named_modules(capture: Capture) -> None:
    expected = _expected_layers(capture)
    table = capture.trace.layers()
    ours = set(table["layer"])
    others = {m["root"] for m in capture.manifest["modules"].values() if m["root"] != capture.meta["var"]}
    assert expected <= ours and ours - expected <= others
    assert not table.duplicated(["rank", "layer"]).any()


@each("transformer", "transformer_et")
def test_a_root_named_like_its_child_has_its_own_layer_and_level(capture: Capture) -> None:
    # `bert = BertForMaskedLM(...)` and its `.bert`: captures made before roots were renamed
    # name both `bert` in their manifest, and the loader tells them apart
    var, expected = capture.meta["var"], _expected_layers(capture)
    (root,) = [name for name in expected if name.startswith(f"{var} (")]
    paths = expected - {root}
    assert var in paths
    table = capture.trace.layers().set_index("layer")
    assert table.loc[root, "depth"] == 0 and table.loc[var, "parent"] == root and table.loc[var, "depth"] == 1
    # every child's parent is its nearest enclosing path that is a layer (the paths
    # gpu_check.json lists), the root's children the root
    for layer, row in table.drop(index=root).iterrows():
        if layer not in paths:
            continue  # another root (the loss)
        parts = str(layer).split(".")
        enclosing = [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in paths]
        assert row["parent"] == (enclosing[-1] if enclosing else root), layer
        assert row["depth"] == len(enclosing) + 1, layer


@each(et=True)
def test_the_et_joins_kineto(capture: Capture) -> None:
    from tracemagic.export.chakra import check

    report = check(capture.dir)
    assert report.ok and report.timed_share == 1.0, report.summary()
    (et_path,) = capture.dir.glob("torch_et_0*.json")
    nodes = json.loads(et_path.read_text())["nodes"]
    et_rf = {a["value"] for n in nodes for a in n.get("attrs", []) if a.get("name") == "rf_id"}
    in_steps = [e for e in capture.cpu_ops.values() if capture.step_of(e["ts"]) >= 0]
    recorded = {e["args"].get("Record function id") for e in in_steps} - {None}
    assert recorded and recorded <= et_rf  # every op of the recorded steps is an ET node
    launching = {
        capture.cpu_ops[launch["args"]["External id"]]["args"].get("Record function id")
        for launch in capture.launches.values()
        if launch["args"].get("External id") in capture.cpu_ops
    }
    assert launching - {None} <= et_rf


@each("matmul")
def test_the_bf16_matmul_is_under_its_roofline(capture: Capture) -> None:
    capture.needs_gpu()
    eff = capture.trace.efficiency()
    row = eff[(eff["name"] == "aten::mm") & eff["input_type"].str.contains("BFloat16", na=False)].iloc[0]
    mm = [e for e in capture.cpu_ops.values() if e["name"] == "aten::mm" and capture.step_of(e["ts"]) >= 0]
    ids = {e["args"]["External id"] for e in mm}
    gpu_us = sum(
        k["dur"]
        for k in capture.gpu
        if k["cat"] == "kernel"
        and capture.launches.get(k["args"].get("correlation"), {}).get("args", {}).get("External id") in ids
    )
    (m, k), (_, n) = json.loads(row["input_dims"])[:2]
    assert float(row["tflops_per_s"]) == pytest.approx(2 * m * n * k * len(mm) / gpu_us / 1e6, rel=0.05)
    assert 0 < float(row["pct_of_roofline"]) <= 100


@each("compiled")
def test_the_compiled_model_is_not_retraced_and_owns_its_kernels(capture: Capture) -> None:
    inside = [e for e in capture.xs if capture.step_of(e["ts"]) >= 0]
    assert not [e["name"] for e in inside if RETRACE.search(e["name"])]
    assert len([e for e in inside if e["name"].startswith("Torch-Compiled Region")]) == len(capture.steps)
    layers = capture.trace.layers()
    assert list(layers["layer"]) == ["cm"]
    capture.needs_gpu()
    calls = [e for e in capture.xs if e["name"] == "nn.Module: OptimizedModule_0"]
    forward = {
        k["args"]["correlation"]
        for k in capture.gpu
        if k["name"].startswith("triton")
        and k["args"].get("correlation") in capture.launches
        and any(c["ts"] <= capture.launches[k["args"]["correlation"]]["ts"] <= c["ts"] + c["dur"] for c in calls)
    }
    assert forward
    kernels = capture.trace.kernels()
    mine = kernels[kernels["correlation"].isin(list(forward))]
    assert len(mine) == len(forward) and set(mine["layer"].astype(str)) == {"cm"}
    assert float(layers["gpu_us"].iloc[0]) > 0


def dims_text(m: int, k: int, n: int) -> str:
    """A linear's ``input_dims`` as the tables write them, then its dtypes' opening (as the
    tables list them: ``float, float, float``)."""
    return f"[[{m}, {k}], [{n}, {k}], [{n}]] (float"


@each("amp")
def test_an_autocast_float32_linear_is_held_to_the_bf16_peak_and_under_its_roof(capture: Capture) -> None:
    """Under ``torch.autocast(bfloat16)`` a float32 ``aten::linear`` casts its inputs and runs
    an ``aten::linear`` in bf16 inside: its row of ``efficiency()`` is held to the device's
    bf16 peak (the fp32 one put an 8192³ matmul at 1066% of its roof), its achieved TFLOP/s
    the raw 2·M·N·K per call over the GPU work its calls launched."""
    capture.needs_gpu()
    ops = [e for e in capture.xs if e.get("cat") == "cpu_op"]
    linears = [e for e in ops if e["name"] == "aten::linear" and capture.step_of(e["ts"]) >= 0]
    outer = [
        e
        for e in linears
        if e["args"]["Input type"][0] == "float"
        and any(
            i["args"]["Input type"][0] == "c10::BFloat16" and i["tid"] == e["tid"] and _holds(e, i["ts"]) and i is not e
            for i in linears
        )
    ]
    assert len(outer) == len(capture.steps)
    (m, k), (n, _) = outer[0]["args"]["Input Dims"][:2]
    gpu_us = sum(g["dur"] for g in _launched_inside(capture, outer))
    achieved = 2 * m * n * k * len(outer) / gpu_us / 1e6
    table = capture.trace.efficiency()
    rows = table[(table["name"] == "aten::linear") & table["input_type"].str.startswith('["float"')]
    (row,) = [r for r in rows.itertuples() if r.calls == len(outer)]
    peak = devices.match(capture.doc["deviceProperties"][0])
    assert peak is not None and row.peak_tflops == peak.bf16
    assert row.tflops_per_s == pytest.approx(achieved, rel=1e-6)
    assert row.pct_of_roofline == pytest.approx(100 * achieved / peak.bf16, rel=1e-6) and row.pct_of_roofline <= 100
    assert row.precision == "bf16"
    # and the roofline advice does not tell it to lower a precision it already runs in
    from tracemagic.analysis.advice import roofline_gaps

    gaps = roofline_gaps(table, limit=len(table), min_share=0)
    (said,) = [a for e, a in zip(gaps["evidence"], gaps["advice"]) if e.startswith(f"aten::linear {dims_text(m, k, n)}")]
    assert "already in a low precision" in said and "a lower precision" not in said


#: the CUDA graph captures: the root module's call, its layer, and the ops that launch the
#: forward and the backward replays (``make_graphed_callables``'s autograd function, and
#: AOTAutograd's under ``torch.compile(mode="reduce-overhead")``)
GRAPHED = {
    "graphs": ("nn.Module: Sequential_0", "gnet", "Graphed", "GraphedBackward"),
    "reduce_overhead": ("nn.Module: OptimizedModule_0", "ro", "CompiledFunction", "CompiledFunctionBackward"),
}


@each(*GRAPHED)
def test_cuda_graph_replays_are_their_launches_ops_and_layers(capture: Capture) -> None:
    """A CUDA graph replay runs many kernels from one ``cudaGraphLaunch`` (one correlation):
    each kernel is in ``kernels()`` with the op and step of that launch, and the layer's
    forward and backward GPU time hold the replays, as for any kernel its forward launched
    or autograd ran for it."""
    capture.needs_gpu()
    module, layer, forward_op, backward_op = GRAPHED[capture.key]
    replayed = [
        k
        for k in capture.gpu
        if capture.launches.get(k["args"].get("correlation"), {}).get("name", "").startswith("cudaGraphLaunch")
    ]
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for k in replayed:
        launch = capture.launches[k["args"]["correlation"]]
        by_op[capture.cpu_ops[launch["args"]["External id"]]["name"]].append(k)
    # the forward and the backward, each replayed once a step
    assert sorted(by_op) == sorted([forward_op, backward_op])
    for kernels in by_op.values():
        assert len({k["args"]["correlation"] for k in kernels}) == len(capture.steps)
    table = capture.trace.kernels()
    for op, kernels in by_op.items():
        for corr, count in Counter(k["args"]["correlation"] for k in kernels).items():
            mine = table[table["correlation"] == corr]
            step = capture.step_of(capture.launches[corr]["ts"])
            assert len(mine) == count and set(mine["op"].astype(str)) == {op}, (op, corr)
            assert set(mine["step"].astype(int)) == {step}

    def launched_inside(name: str) -> tuple[float, list[dict[str, Any]]]:
        """The GPU time launched while a call named ``name`` ran, in the steps; the calls."""
        calls = [e for e in capture.xs if e["name"] == name and capture.step_of(e["ts"]) >= 0]
        assert len(calls) == len(capture.steps), name
        within = _launched_inside(capture, calls)
        return sum(k["dur"] for k in within), within

    layers = capture.trace.layers().set_index("layer")
    assert list(layers.index) == [layer]
    # the forward replay runs inside the module's call; the layer's forward is what that launched
    forward, within = launched_inside(module)
    assert all(k in within for k in by_op[forward_op])
    assert float(layers.loc[layer, "fwd_gpu_us"]) == pytest.approx(forward, abs=1e-3)
    # the backward replay runs inside autograd's node of the forward op (its sequence number
    # follows the forward's): the layer's backward is what that node launched
    backward, within = launched_inside(f"autograd::engine::evaluate_function: {backward_op}")
    assert all(k in within for k in by_op[backward_op])
    assert float(layers.loc[layer, "bwd_gpu_us"]) == pytest.approx(backward, abs=1e-3)


def _line(mark: dict[str, Any]) -> int:
    return int(mark["name"][len(MARK) :])


def _holds(event: dict[str, Any], ts: float) -> bool:
    return bool(event["ts"] <= ts < event["ts"] + event["dur"])


def _launched_inside(capture: Capture, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The raw GPU events launched by their own thread while one of ``calls`` ran there."""
    return [
        k
        for k in capture.gpu
        if (launch := capture.launches.get(k["args"].get("correlation"))) is not None
        and any(c["tid"] == launch["tid"] and _holds(c, launch["ts"]) for c in calls)
    ]


def _line_marks(capture: Capture, steps: list[int]) -> list[dict[str, Any]]:
    """The raw line marks that ran in ``steps``."""
    return [e for e in capture.xs if e["name"].startswith(MARK) and capture.step_of(e["ts"]) in steps]


def _raw_lines(capture: Capture) -> dict[int, dict[str, float]]:
    """Per cell line, from the raw marks and GPU events of the counted steps, per step: its
    runs (outermost marks), the union of its marks (CPU), the GPU work whose launching
    runtime call (by correlation, on any thread) lies inside one of its marks (inclusive)
    or whose innermost holding mark is its own (self); and the GPU work of other threads."""
    counted = _counted(capture)
    marks = _line_marks(capture, counted)
    n = len(counted)
    gpu: dict[int, float] = defaultdict(float)
    own: dict[int, float] = defaultdict(float)
    elsewhere = 0.0
    mark_threads = {m["tid"] for m in marks}
    for k in capture.gpu:
        launch = capture.launches.get(k["args"].get("correlation"))
        if launch is None or capture.step_of(launch["ts"]) not in counted:
            continue
        holders = [m for m in marks if _holds(m, launch["ts"])]
        for number in {_line(m) for m in holders}:
            gpu[number] += k["dur"]
        if holders:
            own[_line(min(holders, key=lambda m: m["dur"]))] += k["dur"]
            elsewhere += k["dur"] if launch["tid"] not in mark_threads else 0.0
    out: dict[int, dict[str, float]] = {}
    for number in sorted({_line(m) for m in marks}):
        mine = [m for m in marks if _line(m) == number]
        outer = [
            m
            for m in mine
            if not any(o is not m and o["ts"] <= m["ts"] and m["ts"] + m["dur"] <= o["ts"] + o["dur"] for o in mine)
        ]
        out[number] = {
            "calls": len(outer) / n,
            "cpu_us": _union([(m["ts"], m["ts"] + m["dur"]) for m in mine]) / n,
            "gpu_us": gpu[number] / n,
            "self_gpu_us": own[number] / n,
        }
    out[-1] = {"elsewhere_us": elsewhere / n}
    return out


def _mean_step(capture: Capture) -> float:
    counted = _counted(capture)
    spans = [w for s, w in zip(capture.steps, _windows(capture)) if int(s["name"].split("#")[1]) in counted]
    return sum(end - start for start, end in spans) / len(spans)


@each()
def test_each_lines_gpu_time_is_the_work_launched_inside_its_marks(capture: Capture) -> None:
    """``lines()`` on a GPU: a line's GPU time is the kernels, memcpy and memset launched
    while it ran, autograd's backward thread included (``loss.backward()`` launches its
    kernels there while the cell's thread waits in the line's mark)."""
    capture.needs_gpu()
    raw = _raw_lines(capture)
    elsewhere = raw.pop(-1)["elsewhere_us"]
    if not raw:
        pytest.skip(f"{capture.key}: no line mark in the counted steps")
    table = capture.trace.lines().set_index("line")
    assert sorted(table.index) == sorted(raw)
    step_us = _mean_step(capture)
    assert table.attrs["steps"] == len(_counted(capture))
    assert table.attrs["step_us"] == pytest.approx(step_us, rel=1e-4)
    cell = dict(enumerate(capture.manifest["cell"].splitlines(), start=2))
    for number, figures in raw.items():
        row = table.loc[number]
        assert row["text"] == cell[number]
        assert row["calls"] == pytest.approx(figures["calls"])
        assert row["cpu_us"] == pytest.approx(figures["cpu_us"], abs=max(1.0, 1e-4 * figures["cpu_us"]))
        assert row["step_pct"] == pytest.approx(100 * figures["cpu_us"] / step_us, abs=0.02)
        for column in ("gpu_us", "self_gpu_us"):
            assert row[column] == pytest.approx(figures[column], abs=max(0.5, 1e-4 * figures[column])), (number, column)
    # the top-level lines hold all GPU work launched inside a mark, each kernel once
    top = table[table["parent_line"] == -1]
    assert float(top["gpu_us"].sum()) == pytest.approx(sum(f["self_gpu_us"] for f in raw.values()), rel=1e-4)
    if capture.key.startswith(("quickstart", "transformer")):
        backward = table[table["text"].str.strip() == "loss.backward()"]
        assert elsewhere > 0 and float(backward["gpu_us"].iloc[0]) >= elsewhere - 1.0


@each("transformer", "matmul")
def test_the_source_tab_shows_the_lines_figures(capture: Capture, tmp_path: Path) -> None:
    """The report's Source tab: each line's CPU and GPU time per step and % of the step, as
    the raw marks give them (its table's cells, in ms)."""
    capture.needs_gpu()
    raw = _raw_lines(capture)
    raw.pop(-1)
    html = write_report(capture.trace, tmp_path / "report.html").read_text(encoding="utf-8")
    (source,) = re.findall(r'<div class="tm-source">.*?</table>', html, flags=re.S)
    head = re.findall(r"<th>(.*?)</th>", source)
    assert head[:5] == ["line", "code", "CPU (ms)", "self CPU (ms)", "GPU (ms)"] and "% of step" in head, head
    rows = {
        int(number): [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", body)]
        for number, body in re.findall(r'<tr data-line="(\d+)">(.*?)</tr>', source)
    }
    step_us = _mean_step(capture)
    for number, figures in raw.items():
        cells = dict(zip(head, rows[number]))
        assert float(cells["CPU (ms)"].replace(",", "")) == pytest.approx(figures["cpu_us"] / 1e3, abs=0.0011)
        assert float(cells["GPU (ms)"].replace(",", "")) == pytest.approx(figures["gpu_us"] / 1e3, abs=0.0011)
        assert float(cells["% of step"].rstrip("%")) == pytest.approx(100 * figures["cpu_us"] / step_us, abs=0.06)
    assert any(f["gpu_us"] > 0 for f in raw.values())


@each("transformer", "quickstart")
def test_the_timeline_names_line_marks_as_the_source_tab(capture: Capture, tmp_path: Path) -> None:
    """The Timeline's annotations table names each line mark ``line N `code``` (the cell's
    line N, from the manifest), with the mark's calls and total time from the raw events;
    no ``tracemagic.line:N`` is left in the page's tables."""
    body = capture.manifest["cell"].splitlines()
    raw: dict[int, list[float]] = {}
    for e in capture.xs:
        # recorded as CPU ops (torch's fast record_function) or annotations, never the GPU's copies
        if e.get("cat") in ("cpu_op", "user_annotation") and str(e.get("name", "")).startswith(MARK):
            raw.setdefault(int(e["name"][len(MARK) :]), []).append(float(e["dur"]))
    assert raw, "no line marks in the raw JSON"
    html = write_report(capture.trace, tmp_path / "report.html").read_text(encoding="utf-8")
    (data,) = re.findall(r'Annotations and wrappers.*?<script class="tm-data"[^>]*>(.*?)</script>', html, flags=re.S)
    table = json.loads(data)
    named = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    for number, durations in raw.items():
        text = body[number - 2].strip()  # the %%chakra_trace line is line 1
        label = f"line {number} `{text}`" if len(text) <= 60 else f"line {number} `{text[:59]}…`"
        row = named[label]
        assert row["Calls"] == len(durations)
        assert row["Total (ms)"] == pytest.approx(sum(durations) / 1e3, rel=1e-9)
    assert MARK not in html  # nor in the Timeline's hover


@each()
def test_each_steps_sync_stall_is_its_raw_blocking_calls(capture: Capture) -> None:
    """Every cell of bench/gpu_check.py calls ``torch.cuda.synchronize()`` once a step (its
    ``sync()`` line) and no ``.item()`` on a CUDA tensor: ``syncs()`` finds each
    ``cudaDeviceSynchronize`` with its stall, named by that line; the ``aten::item`` it lists
    beside them (AdamW reading its CPU step counts) waited for nothing."""
    capture.needs_gpu()
    recorded = [int(s["name"].split("#")[1]) for s in capture.steps]
    raw = [
        e for e in capture.xs if e["cat"] in RUNTIME_CATS and e["name"] in SYNC_CALLS and capture.step_of(e["ts"]) >= 0
    ]
    assert raw
    syncs = capture.trace.syncs()
    waited = syncs[syncs["gpu_wait"]]
    ours = waited.groupby("step")["stall_us"].sum().to_dict()
    for step in recorded:
        expected = sum(e["dur"] for e in raw if capture.step_of(e["ts"]) == step)
        assert ours.get(step, 0.0) == pytest.approx(expected, abs=0.01), step
    assert sorted(waited["name"]) == sorted(e["name"] for e in raw)
    marks = _line_marks(capture, recorded)
    cell = dict(enumerate(capture.manifest["cell"].splitlines(), start=2))
    lines = sorted(_line(min((m for m in marks if _holds(m, e["ts"])), key=lambda m: m["dur"])) for e in raw)
    assert sorted(waited["line"]) == lines and {cell[n].strip() for n in lines} == {"sync()"}
    # the .item()s: no blocking runtime call beneath any of them on its thread, so no wait
    items = [e for e in capture.xs if e["name"] == "aten::item" and capture.step_of(e["ts"]) >= 0]
    blocking = [
        e for e in capture.xs if e["cat"] in RUNTIME_CATS and re.match(r"cuda(Memcpy|\w*Synchronize)", e["name"])
    ]
    assert not any(b["tid"] == i["tid"] and _holds(i, b["ts"]) for i in items for b in blocking)
    listed = syncs[syncs["what"] == "item"]
    assert len(listed) == len(items) and not listed["gpu_wait"].any() and float(listed["stall_us"].sum()) == 0.0
    # host_sync: the stall of the syncs that waited (the raw blocking calls here; the CPU
    # .item()s count nothing) over the steps' device windows; where it fires it names the line
    share = sum(e["dur"] for e in raw) / sum(end - start for start, end in _windows(capture))
    table = capture.trace.advice()
    assert ("host_sync" in set(table["rule"])) == (share >= HOST_SYNC_SHARE), share
    if share >= HOST_SYNC_SHARE:
        (value,) = table.loc[table["rule"] == "host_sync", "value"]
        assert value == pytest.approx(share, rel=1e-6)
        (evidence,) = table.loc[table["rule"] == "host_sync", "evidence"]
        assert re.match(rf"line ({'|'.join(map(str, lines))}) `sync\(\)` waits ", evidence), evidence


@each()
def test_kernel_busy_and_kernels_per_step_follow_the_raw_kernels(capture: Capture) -> None:
    """``kernel_busy_us``: the union of the kernels (no memcpy/memset) in each step's
    device window, over the window the TensorBoard plugin's GPU Utilization; ``kernels()``
    per step: the kernels launched inside each host step."""
    capture.needs_gpu()
    table = capture.trace.steps()
    kernels = [k for k in capture.gpu if k["cat"] == "kernel"]
    for row, (w_start, w_end) in zip(table.itertuples(), _windows(capture)):
        busy = _union(
            [
                (max(k["ts"], w_start), min(k["ts"] + k["dur"], w_end))
                for k in kernels
                if k["ts"] < w_end and k["ts"] + k["dur"] > w_start
            ]
        )
        assert row.kernel_busy_us == pytest.approx(busy, abs=max(2.0, 1e-4 * row.window_dur))
        assert row.kernel_busy_us / row.window_dur == pytest.approx(busy / (w_end - w_start), abs=1e-3)
        assert 0 < row.kernel_busy_us <= row.gpu_busy_us + 1e-6
    ours = capture.trace.kernels()
    ours = ours[(ours["kind"] == "kernel") & (ours["step"] >= 0)].groupby("step").size().to_dict()
    raw = Counter(
        capture.step_of(capture.launches[k["args"]["correlation"]]["ts"])
        for k in kernels
        if k["args"].get("correlation") in capture.launches
    )
    raw.pop(-1, None)
    assert ours == dict(raw) and sum(raw.values()) > 0


@each()
def test_cuda0_memory_is_the_raw_allocator_events(capture: Capture) -> None:
    """``memory()`` on cuda:0 is the raw ``[memory]`` events of Device Type 1, each step's
    peak their highest ``Total Allocated`` in the step, and ``memory_categories()`` (torch's
    memory timeline) adds up to the allocator's count at every moment."""
    raw = [
        e
        for e in capture.doc["traceEvents"]
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 1 and e["args"].get("Device Id") == 0
    ]
    if not raw:
        pytest.skip(f"{capture.key}: no CUDA memory event in this capture")
    memory = capture.trace.memory()
    mine = memory[memory["device"] == "cuda:0"]
    assert sorted(zip(mine["allocated_bytes"], mine["delta_bytes"])) == sorted(
        (e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in raw
    )
    assert sorted(mine["reserved_bytes"].astype(int)) == sorted(e["args"]["Total Reserved"] for e in raw)
    peaks = capture.trace.memory_peaks()
    peaks = peaks[(peaks["device"] == "cuda:0") & peaks["step"].notna()]
    by_step: dict[int, int] = {}
    for e in raw:
        step = capture.step_of(e["ts"])
        if step >= 0:
            by_step[step] = max(by_step.get(step, 0), e["args"]["Total Allocated"])
    assert dict(zip(peaks["step"].astype(int), peaks["peak_bytes"].astype(int))) == by_step
    timeline = capture.dir / "memory_timeline_0.json"
    if not timeline.exists():
        return
    # the timeline's rows [ts_ns, action, bytes (signed), category]: its running total at
    # each moment, on the trace's clock, is the allocator's count less one constant (what
    # was allocated before the capture and no category covers)
    rows = sorted(json.loads(timeline.read_text()), key=lambda r: r[0])
    base = capture.doc["baseTimeNanoseconds"]
    ordered = sorted(raw, key=lambda e: e["ts"])
    times = [e["ts"] for e in ordered]
    categories = capture.trace.memory_categories()
    total, offsets, moments = 0, [], []
    for i, r in enumerate(rows):
        total += r[2]
        if i + 1 < len(rows) and rows[i + 1][0] == r[0]:
            continue  # the total after the last row of a moment
        if r[0] < 0:
            continue  # tensors that existed before the capture: no moment
        at = (r[0] - base) / 1e3
        before = bisect.bisect_right(times, at) - 1
        if before >= 0:
            offsets.append(ordered[before]["args"]["Total Allocated"] - total)
            moments.append(ordered[before]["args"]["Total Allocated"])
    common = Counter(offsets).most_common(1)[0]
    assert common[1] >= 0.95 * len(offsets), Counter(offsets).most_common(3)
    assert set(categories["before_capture"]) == {common[0]}
    assert max(categories["total_bytes"]) == max(moments) and len(categories) >= len(moments)


@pytest.mark.browser
@each("matmul")
def test_the_iteration_strip_numbers_whole_iterations(capture: Capture, browser: Any, tmp_path: Path) -> None:
    """The report's strip of every iteration (4 here) in Chromium: one tick per iteration,
    whole numbers (plotly's own ticks put 0.5 steps on so short a range)."""
    page = browser.new_page(viewport={"width": 1024, "height": 900})
    try:
        page.goto(write_report(capture.trace, tmp_path / "report.html").as_uri())
        page.wait_for_selector("#fig-strip .xtick text")
        ticks = page.evaluate("[...document.querySelectorAll('#fig-strip .xtick text')].map(t => t.textContent)")
    finally:
        page.close()
    assert ticks == [str(i) for i in range(capture.manifest["iterations"])], ticks


@each("matmul")
def test_a_bf16_matmul_below_its_roof_is_not_told_to_lower_its_precision(capture: Capture, tmp_path: Path) -> None:
    """The Overview names the op furthest below its roof: for the bf16 matmul (its inputs
    BFloat16 in the raw JSON) the advice is larger matrices, not a lower precision."""
    capture.needs_gpu()
    mm = [e for e in capture.cpu_ops.values() if e["name"] == "aten::mm" and capture.step_of(e["ts"]) >= 0]
    assert mm and {tuple(e["args"]["Input type"]) for e in mm} == {("c10::BFloat16", "c10::BFloat16")}
    html = write_report(capture.trace, tmp_path / "report.html").read_text(encoding="utf-8")
    (fact,) = re.findall(r"furthest below its roof</dt><dd>(.*?)</dd>", html)
    assert fact.startswith("aten::mm [[8192, 8192], [8192, 8192]]") and "compute-bound" in fact, fact
    assert "already in a low precision" in fact and "BF16/FP16" not in fact, fact


@each("quickstart", "transformer_et")
def test_the_flame_hangs_the_backward_below_its_line(capture: Capture) -> None:
    """The call tree (the Flame tab's) of a GPU capture: autograd's backward thread's ops hang
    below ``loss.backward()``'s line, which holds the GPU work launched while it ran (raw),
    and no autograd op is a root of its own."""
    capture.needs_gpu()
    raw = _raw_lines(capture)
    raw.pop(-1)
    n = len(_counted(capture))
    cell = dict(enumerate(capture.manifest["cell"].splitlines(), start=2))
    (number,) = [k for k in raw if cell[k].strip() == "loss.backward()"]
    for user_only in (True, False):
        tree = capture.trace.call_tree(user_only=user_only)
        (row,) = tree[tree["name"].astype(str).str.startswith(f"line {number} ")].itertuples()
        assert row.gpu_us == pytest.approx(raw[number]["gpu_us"] * n, abs=1.0)
        assert row.self_cpu_us >= 0 and row.cpu_us > 0
        roots = tree[tree["parent"] == -1]
        assert not roots["name"].astype(str).str.startswith("autograd::").any()
        assert float(roots["gpu_us"].sum()) == pytest.approx(sum(k["dur"] for k in capture.gpu), abs=1.0)


@each("transformer")
def test_only_autograds_threads_work_for_a_line(capture: Capture, tmp_path: Path) -> None:
    """Autograd's device thread works for the ``loss.backward()`` line whatever the trace
    names it (an H200 capture of this project wrote ``pt_autograd_0`` as ``thread 571
    (python3)``): renamed so, the line keeps its GPU work. A thread that runs no backward (a
    DataLoader's pin-memory thread copying a batch while the line runs) is no line's: a copy
    it launches inside the line's mark is left out of the line (raw: the line's GPU work less
    that copy)."""
    capture.needs_gpu()
    doc = json.loads((capture.dir / "kineto_trace_0.json").read_text())
    renamed = 0
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name" and "pt_autograd_" in e["args"]["name"]:
            e["args"]["name"] = e["args"]["name"].replace("pt_autograd_0", "python3")
            renamed += 1
    counted = _counted(capture)
    marks = _line_marks(capture, counted)
    cell = dict(enumerate(capture.manifest["cell"].splitlines(), start=2))
    (number,) = {_line(m) for m in marks if cell[_line(m)].strip() == "loss.backward()"}
    mark = next(m for m in marks if _line(m) == number)
    # a pin-memory thread's copy, launched inside the line's mark
    pid, tid, at = mark["pid"], 987_654, mark["ts"] + mark["dur"] / 2
    gpu = next(k for k in capture.gpu if k["cat"] == "kernel")
    corr, ext = 9_000_001, 9_000_002
    doc["traceEvents"] += [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": "thread 987654 (python3)"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": pid, "tid": tid, "ts": at, "dur": 20.0,
         "args": {"External id": ext}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": pid, "tid": tid, "ts": at + 1, "dur": 5.0,
         "args": {"correlation": corr, "External id": ext}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": gpu["pid"], "tid": gpu["tid"],
         "ts": at + 10, "dur": 333.0, "args": {**{k: gpu["args"][k] for k in ("device", "stream") if k in gpu["args"]},
                                               "correlation": corr, "External id": ext}},
    ]
    assert renamed
    folder = tmp_path / "renamed"
    folder.mkdir()
    (folder / "kineto_trace_0.json").write_text(json.dumps(doc))
    (folder / "capture.json").write_text((capture.dir / "capture.json").read_text())
    lines = tracemagic.load(folder, cache_dir=tmp_path / "cache").lines().set_index("line")
    expected = _raw_lines(capture)[number]["gpu_us"]  # every thread's launches inside the line's marks
    assert expected > 100 and float(lines.loc[number, "gpu_us"]) == pytest.approx(expected, abs=0.5)


# -- the Flame tab: one <module> per %%chakra_trace cell, modules named as the Layers tab ------
#: a Python frame's event name: ``<file>(<line>): <function>``
FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>.+)$")


def _within(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    """Whether event ``inner`` nests in ``outer`` on one thread (0.01 us: the ends of frames
    that end together differ in the last digit of torch's floats)."""
    return (
        inner["pid"] == outer["pid"]
        and inner["tid"] == outer["tid"]
        and outer["ts"] <= inner["ts"]
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 0.01
    )


def magic_cells(events: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """From raw Kineto events: the names of the notebook cells' ``<module>`` frames that are
    the bodies the magic ran (inside a frame of tracemagic's own package), and of those that
    ran the magic (IPython's ``run_cell_magic`` line: the cell ``<module>`` around a body)."""
    frames = [e for e in events if e.get("cat") == "python_function" and e.get("ph") == "X"]
    parsed = [(e, FRAME.match(str(e.get("name", "")))) for e in frames]
    cells = [e for e, m in parsed if m and m["function"] == "<module>" and "/ipykernel_" in m["file"]]
    magic = [e for e, m in parsed if m and "tracemagic/" in m["file"].replace("\\", "/")]
    bodies = [e for e in cells if any(_within(e, t) for t in magic)]
    lines = {e["name"] for e in cells if e not in bodies and any(_within(b, e) for b in bodies)}
    return {e["name"] for e in bodies}, lines


def expected_layers(manifest: dict[str, Any]) -> dict[str, str]:
    """``nn.Module: X_k`` -> the layer the Layers tab names it by, from the manifest's module
    map: the recorded attribute path; a root whose path is also one of its submodules' (a
    capture made before roots were renamed: ``bert`` for both ``bert`` and ``bert.bert``) as
    captures name it now, ``bert (BertForMaskedLM)``."""
    modules = manifest.get("modules") or {}
    children = {e["path"] for e in modules.values() if e.get("qualname") != e.get("root")}
    out = {}
    for name, e in modules.items():
        root = e.get("qualname") == e.get("root")
        out[name] = f"{e['path']} ({e['type']})" if root and e["path"] in children else e["path"]
    return out


@each()
def test_the_user_call_tree_has_one_module_frame_per_magic_cell(capture: Capture) -> None:
    """The magic's cell is one ``<module>`` frame in the user-code tree (the Flame tab's): its
    body's, at the top, with its own file and line; the line IPython ran the magic from (the
    same cell's ``<module>`` around it, raw) is in the full tree only, and is no user code in
    the functions table either. Works without the manifest's ``cells`` map (these captures)."""
    from tracemagic.views.dashboard import Dashboard

    bodies, lines = magic_cells(capture.xs)
    assert len(bodies) == 1 and len(lines) == 1, (bodies, lines)
    (body,) = bodies
    frame = FRAME.match(body)
    assert frame
    tree = capture.trace.call_tree(user_only=True)
    modules = tree[(tree["kind"] == "python") & tree["name"].astype(str).str.endswith("): <module>")]
    assert list(modules["name"]) == [body]
    (row,) = modules.itertuples()
    assert row.file == frame["file"] and row.line == int(frame["line"]) and row.parent == -1
    full = capture.trace.call_tree()
    outer = full[full["name"].astype(str).isin(lines)]
    assert len(outer) == 1 and not outer["user"].any()
    source = capture.trace.source()
    assert not source.loc[source["name"].astype(str).isin(lines), "user"].any()
    assert source.loc[source["name"].astype(str).isin(bodies), "user"].all()
    # the Flame tab: one <module> box per graph
    for fig in Dashboard(capture.trace).section("flame").figures:
        labels = [str(label) for label in fig.data[0].labels]
        assert sum(label.startswith("&lt;module&gt;") for label in labels) == 1, labels[:6]


@each("quickstart", "quickstart_et", "transformer", "transformer_et", "compiled")
def test_the_flames_module_boxes_are_named_as_the_layers(capture: Capture, tmp_path: Path) -> None:
    """Every ``nn.Module`` box of the Flame tab (label and hover) carries its layer's name from
    the manifest's module map, as the Layers tab names it, and the paths are the model's
    ``named_modules()`` (read by the cell itself); a trace without the map keeps torch's names."""
    from tracemagic.views.dashboard import Dashboard

    expected = expected_layers(capture.manifest)
    raw = {str(e["name"]) for e in capture.xs if e.get("cat") == "python_function" and
           str(e.get("name", "")).startswith("nn.Module: ")}
    assert raw and raw <= set(expected)
    named = set(capture.meta.get("named_modules") or [])  # none read by the compiled capture's cell
    for name in raw if named else ():
        entry = capture.manifest["modules"][name]
        assert entry["path"] in named or entry["qualname"] == entry["root"], (name, entry)
    layers = capture.trace.layers()
    by_module = dict(zip(layers["module"].astype(str), layers["layer"].astype(str)))
    assert {m: by_module[m] for m in raw if m in by_module} == {m: expected[m] for m in raw if m in by_module}

    def boxes(trace: Any) -> list[tuple[str, str, str]]:
        """(raw name, label, hover name) of each module box of the Flame tab's graphs."""
        tree = trace.call_tree(user_only=True).set_index("node")
        out = []
        for fig in Dashboard(trace).section("flame").figures:
            icicle = fig.data[0]
            for i, label, custom in zip(icicle.ids, icicle.labels, icicle.customdata):
                if str(i).lstrip("-").isdigit() and int(i) >= 0 and tree.loc[int(i), "kind"] == "module":
                    name = str(tree.loc[int(i), "name"])
                    out.append((name, html.unescape(str(label)), html.unescape(str(custom[0]))))
        return out

    drawn = boxes(capture.trace)
    assert drawn
    for name, label, hover in drawn:
        assert name in raw
        assert label == expected[name] and hover == expected[name], (name, label, hover)
    # without the map: torch's names
    folder = tmp_path / "no-map"
    folder.mkdir()
    manifest = dict(capture.manifest)
    manifest.pop("modules")
    (folder / "capture.json").write_text(json.dumps(manifest))
    (folder / "kineto_trace_0.json").write_text((capture.dir / "kineto_trace_0.json").read_text())
    plain = boxes(tracemagic.load(folder, cache_dir=tmp_path / "cache"))
    assert plain and all(label == name and hover == name for name, label, hover in plain)


@each("transformer")
def test_the_dashboards_flame_search_finds_a_module_by_its_class(capture: Capture) -> None:
    """A module box is named by its path (``bert.encoder.layer.0``); the dashboard's search box
    finds it by its class too (torch's ``nn.Module: BertLayer_0``, which its hover shows)."""
    from tracemagic.views.dashboard import Dashboard

    raw = {
        str(node): str(name)
        for node, name, kind in capture.trace.call_tree(user_only=True)[["node", "name", "kind"]].itertuples(index=False)
        if kind == "module"
    }
    dash = Dashboard(capture.trace)
    dash.figures("flame")
    dash._tabs["flame"]["search"].value = "BertLayer"  # as typed in the Text widget
    icicle = dash.figures("flame")[0]["data"][0]
    hits = {i for i, c in zip(icicle["ids"], icicle["marker"]["colors"]) if c == "#2b7bff"}
    assert hits and hits == {i for i in icicle["ids"] if "BertLayer" in raw.get(i, "")}


@each("transformer", "quickstart")
def test_code_generated_from_a_string_is_no_users_code(capture: Capture) -> None:
    """``<string>`` frames (a dataclass's ``__init__``: here the magic's own, called from
    tracemagic's step) are library code: not ``user`` in ``source()``, no node of the user
    call tree, no row of the Flame tab's functions table."""
    raw = {e["name"] for e in capture.xs if e.get("cat") == "python_function" and e["name"].startswith("<string>(")}
    assert raw, "no <string> frames in the raw JSON"
    functions = capture.trace.source()
    generated = functions[functions["file"] == "<string>"]
    assert len(generated) and not generated["user"].any()
    tree = capture.trace.call_tree(user_only=True)
    assert not tree["name"].isin(raw).any()
