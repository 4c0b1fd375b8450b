"""Our own CUDA captures (made on a GPU by ``bench/gpu_check.py``), parsed on any machine.

Each ``tests/data/cuda/*.tar.gz`` holds one capture folder as the magic wrote it on the GPU,
and beside it ``gpu_check.json`` (the GPU, driver, torch, and what the cell itself read:
``torch.cuda.max_memory_allocated()`` over the recorded iterations, ``named_modules()``).
Every figure is checked against the raw JSON, computed here. ``TRACEMAGIC_CUDA_CAPTURES=DIR``
points the module at another folder of such archives (``bench/gpu_check.py --out DIR`` on a
CPU makes ``cpu_*.tar.gz``: the GPU-only tests then skip, each saying why).
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

import tracemagic
from tracemagic.analysis import devices

DATA = Path(os.environ.get("TRACEMAGIC_CUDA_CAPTURES") or Path(__file__).parent / "data" / "cuda")
ARCHIVES = sorted(DATA.glob("*.tar.gz")) if DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not ARCHIVES, reason="no CUDA captures in tests/data/cuda")

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
#: dynamo tracing or compiling a frame (as tests/test_compiled.py)
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
        self.steps = sorted((e for e in xs if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
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


@each()
def test_device_windows_and_gpu_busy_follow_the_raw_events(capture: Capture) -> None:
    capture.needs_gpu()
    table = capture.trace.steps()
    prev_end = float("-inf")
    for row, s in zip(table.itertuples(), capture.steps):
        start, host_end = s["ts"], s["ts"] + s["dur"]
        ends = []
        for k in capture.gpu:
            launch = capture.launches.get(k["args"].get("correlation"))
            if launch is not None and start <= launch["ts"] and launch["ts"] + launch["dur"] <= host_end:
                ends.append(k["ts"] + k["dur"])
        w_start, w_end = max(start, prev_end), max([host_end, *ends])
        prev_end = w_end
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


@each("quickstart", "quickstart_et", "transformer", "transformer_et")
def test_layer_names_are_the_models_named_modules(capture: Capture) -> None:
    expected = capture.meta["named_modules"]
    ours = set(capture.trace.layers()["layer"])
    others = {m["root"] for m in capture.manifest["modules"].values() if m["root"] != capture.meta["var"]}
    assert set(expected) <= ours and ours - set(expected) <= others


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
