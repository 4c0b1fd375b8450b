"""layers(), memory() (peaks, biggest allocations, categories) and shapes().

Expectations are computed independently from the raw JSON with plain Python loops, on a CPU
trace captured here from real torch layers and on the real GPU traces in tests/data/traces/.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import TRACES

import tracemagic
from tracemagic.analysis import memory as memory_mod
from tracemagic.analysis.shapes import flops

import torch  # noqa: E402
nn = torch.nn

TRACELENS = TRACES / "tracelens_normalization_layer_test.json.gz"
OLD = TRACES / "kineto_worker0.1623143089861.pt.trace.json.gz"
CONTROL = TRACES / "hta_control.json.gz"
MI250 = TRACES / "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"
HTA_TIMELINE = TRACES / "hta_memory_timeline.raw.gz"
MODULE = "nn.Module: "
BACKWARD = "autograd::engine::evaluate_function"
TOL = 0.25


class Net(nn.Module):
    """An MLP and a 2-layer transformer encoder built from torch layers."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x: Any, seq: Any) -> Any:
        return self.mlp(x).sum() + self.encoder(seq).sum()


def raw_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two training steps of ``Net`` (forward, backward, SGD) profiled on the CPU."""
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    folder = tmp_path_factory.mktemp("capture")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, seq = torch.randn(8, 32), torch.randn(4, 10, 32)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=2),
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
        with_flops=True,
    ) as prof:
        for _ in range(4):
            model(x, seq).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    path = folder / "kineto_trace_0.json"
    prof.export_chrome_trace(str(path))
    MemoryProfileTimeline(prof._memory_profile()).export_memory_timeline_raw(str(folder / "memory_timeline_0.json"), "cpu")
    torch_flops = {(e.name, str(e.input_shapes)): e.flops for e in prof.events() if e.flops}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "path": path,
        "trace": tracemagic.load(path, use_cache=False),
        "raw": raw_events(path),
        "torch_flops": torch_flops,
        "param_bytes": param_bytes,
    }


@pytest.fixture(scope="module")
def tracelens() -> dict[str, Any]:
    return {"trace": tracemagic.load(TRACELENS, use_cache=False), "raw": raw_events(TRACELENS)}


# -- independent oracles over raw JSON -------------------------------------------------------
def steps_of(raw: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in raw if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]


def inside_steps(e: dict[str, Any], steps: list[tuple[float, float]]) -> bool:
    return not steps or any(a <= e["ts"] <= b + TOL for a, b in steps)


def modules_of(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in raw if e.get("cat") == "python_function" and e["name"].startswith(MODULE)]


def innermost(containers: list[dict[str, Any]], tid: Any, t: float) -> dict[str, Any] | None:
    """The latest-starting (innermost) event on ``tid`` whose span holds time ``t``."""
    best = None
    for e in containers:
        if e["tid"] == tid and e["ts"] - TOL <= t <= e["ts"] + e["dur"] + TOL:
            if best is None or (e["ts"], -e["dur"]) > (best["ts"], -best["dur"]):
                best = e
    return best


def backward_by_module(raw: list[dict[str, Any]]) -> dict[str, float]:
    """Outermost backward op time per module name, by sequence number (loop oracle)."""
    steps = steps_of(raw)
    mods = modules_of(raw)
    bwd = [e for e in raw if e.get("ph") == "X" and e["name"].startswith(BACKWARD)]
    fwd = [
        e
        for e in raw
        if e.get("cat") == "cpu_op"
        and "Sequence number" in e.get("args", {})
        and not e["args"].get("Fwd thread id")
        and not e["name"].startswith(BACKWARD)
        and innermost(bwd, e["tid"], e["ts"]) is None
    ]
    out: dict[str, float] = defaultdict(float)
    for e in bwd:
        nested = any(o is not e and o["tid"] == e["tid"] and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in bwd)
        if nested or innermost(mods, e["tid"], e["ts"]) is not None or not inside_steps(e, steps):
            continue
        seq = e["args"].get("Sequence number")
        before = [f for f in fwd if f["args"]["Sequence number"] == seq and f["ts"] <= e["ts"]]
        if seq is None or not before:
            continue
        creator = max(before, key=lambda f: f["ts"])
        holder = innermost(mods, creator["tid"], creator["ts"])
        if holder is not None:
            out[holder["name"][len(MODULE) :]] += e["dur"]
    return out


def by_layer(df: Any) -> dict[str, dict[str, Any]]:
    return {row["layer"]: row for row in df.to_dict("records")}


# -- layers -------------------------------------------------------------------------------
def test_layers_tree_and_calls(captured: dict[str, Any]) -> None:
    df = captured["trace"].layers()
    rows = by_layer(df)
    assert list(df["layer"][:4]) == ["Net_0", "Sequential_0", "Linear_0", "ReLU_0"]
    assert rows["Net_0"]["depth"] == 0 and pd.isna(rows["Net_0"]["parent"])
    assert (rows["Linear_0"]["parent"], rows["Linear_0"]["depth"], rows["Linear_0"]["type"]) == ("Sequential_0", 2, "Linear")
    assert (rows["MultiheadAttention_1"]["parent"], rows["MultiheadAttention_1"]["depth"]) == ("TransformerEncoderLayer_1", 3)
    assert set(df["calls"]) == {2}  # two active steps, one call each
    assert rows["Linear_0"]["input_shapes"] == "[[8, 32], [64, 32], [64]]"
    assert rows["TransformerEncoder_0"]["input_shapes"].startswith("[[4, 10, 32]")


def test_layer_time_equals_its_module_events(captured: dict[str, Any]) -> None:
    raw, df = captured["raw"], captured["trace"].layers()
    mods = [e for e in modules_of(raw) if inside_steps(e, steps_of(raw))]
    total: dict[str, float] = defaultdict(float)
    child: dict[str, float] = defaultdict(float)
    for e in mods:
        name = e["name"][len(MODULE) :]
        total[name] += e["dur"]
        holder = innermost([m for m in mods if m is not e and m["dur"] >= e["dur"]], e["tid"], e["ts"])
        if holder is not None:
            child[holder["name"][len(MODULE) :]] += e["dur"]
    rows = by_layer(df)
    assert set(rows) == set(total)
    for name, us in total.items():
        assert rows[name]["fwd_cpu_us"] == pytest.approx(us, abs=1e-3)
        assert rows[name]["fwd_self_cpu_us"] == pytest.approx(us - child[name], abs=1e-3)
        assert rows[name]["cpu_us"] == pytest.approx(rows[name]["fwd_cpu_us"] + rows[name]["bwd_cpu_us"])
        assert rows[name]["self_cpu_us"] == pytest.approx(rows[name]["fwd_self_cpu_us"] + rows[name]["bwd_self_cpu_us"])


@pytest.mark.parametrize("which", ["captured", "tracelens"])
def test_backward_goes_to_the_forward_layer(which: str, request: pytest.FixtureRequest) -> None:
    data = request.getfixturevalue(which)
    expected = backward_by_module(data["raw"])
    rows = by_layer(data["trace"].layers())
    assert expected and sum(expected.values()) > 0
    for name, row in rows.items():
        assert row["bwd_self_cpu_us"] == pytest.approx(expected.get(name, 0.0), abs=1e-3), name
    leaves = [r for n, r in rows.items() if n.startswith(("Linear_", "LayerNorm_", "BatchNorm2d_", "RMSNorm_"))]
    assert leaves and all(r["bwd_self_cpu_us"] > 0 for r in leaves)


@pytest.mark.parametrize("which", ["captured", "tracelens"])
def test_self_times_add_up_to_the_step_time(which: str, request: pytest.FixtureRequest) -> None:
    data = request.getfixturevalue(which)
    raw, df = data["raw"], data["trace"].layers()
    steps = steps_of(raw)
    if steps:
        step_us = sum(b - a for a, b in steps)
    else:
        timed = [e for e in raw if e.get("ph") == "X" and e.get("cat") not in ("Trace", "")]
        step_us = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
    attrs = df.attrs
    assert attrs["step_us"][0] == pytest.approx(step_us, abs=1e-2)
    assert attrs["unattributed_us"][0] >= 0 and attrs["overlap_us"][0] == 0
    assert df["self_cpu_us"].sum() + attrs["unattributed_us"][0] == pytest.approx(step_us, abs=1e-2)
    assert (df["self_cpu_us"] <= df["cpu_us"] + 1e-6).all() and (df["self_cpu_us"] >= 0).all()


def test_gpu_time_of_layers(tracelens: dict[str, Any]) -> None:
    raw, df = tracelens["raw"], tracelens["trace"].layers()
    runtime = {e["args"]["correlation"]: e for e in raw if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = [e for e in raw if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    mods = modules_of(raw)
    forward: dict[str, float] = defaultdict(float)
    for k in gpu:
        launch = runtime.get(k["args"].get("correlation"))
        holder = launch and innermost(mods, launch["tid"], launch["ts"])
        if holder:
            forward[holder["name"][len(MODULE) :]] += k["dur"]
    rows = by_layer(df)
    for name in ("BatchNorm2d_0", "LayerNorm_1", "RMSNorm_0", "MSELoss_0"):
        assert rows[name]["fwd_gpu_us"] == pytest.approx(forward[name], abs=1e-3)
        assert rows[name]["bwd_gpu_us"] > 0
    children = df[df["parent"] == "Net_0"]
    net = rows["Net_0"]
    assert net["gpu_us"] == pytest.approx(net["self_gpu_us"] + children["gpu_us"].sum())
    total = sum(k["dur"] for k in gpu)
    assert df.attrs["gpu_us"][0] == pytest.approx(total)
    assert df["self_gpu_us"].sum() + df.attrs["gpu_unattributed_us"][0] == pytest.approx(total)


def test_memory_growth_of_layers(captured: dict[str, Any]) -> None:
    raw, rows = captured["raw"], by_layer(captured["trace"].layers())
    steps = steps_of(raw)
    mods = modules_of(raw)
    memory = [e for e in raw if e["name"] == "[memory]" and inside_steps(e, steps)]
    for name in ("Linear_0", "MultiheadAttention_0", "TransformerEncoderLayer_1", "Net_0"):
        calls = [m for m in mods if m["name"] == MODULE + name]
        grown = sum(e["args"]["Bytes"] for e in memory for m in calls if m["tid"] == e["tid"] and m["ts"] <= e["ts"] <= m["ts"] + m["dur"])
        assert rows[name]["memory_growth_bytes"] == grown, name


def test_layer_names_from_the_capture_manifest(captured: dict[str, Any], tmp_path: Path) -> None:
    shutil.copy(captured["path"], tmp_path / "kineto_trace_0.json")
    manifest = {"modules": {"nn.Module: Linear_0": {"path": "mlp.0", "type": "Linear"}, "nn.Module: Net_0": {"path": "", "type": "Net"}}}
    (tmp_path / "capture.json").write_text(json.dumps(manifest))
    df = tracemagic.load(tmp_path, use_cache=False).layers()
    assert "mlp.0" in set(df["layer"]) and "Linear_0" not in set(df["layer"])
    assert df.loc[df["layer"] == "mlp.0", "module"].item() == "nn.Module: Linear_0"


def test_no_modules_means_no_layers_but_the_step_time(kineto_raw_control: dict[str, Any]) -> None:
    trace, raw = kineto_raw_control["trace"], kineto_raw_control["raw"]
    df = trace.layers()
    step_us = sum(b - a for a, b in steps_of(raw))
    assert df.empty and "self_cpu_us" in df.columns
    assert df.attrs["step_us"][3] == pytest.approx(step_us) == df.attrs["unattributed_us"][3]


@pytest.fixture(scope="module")
def kineto_raw_control() -> dict[str, Any]:
    return {"trace": tracemagic.load(CONTROL, use_cache=False), "raw": raw_events(CONTROL)}


# -- memory -------------------------------------------------------------------------------
def test_memory_with_totals(tracelens: dict[str, Any]) -> None:
    raw, trace = tracelens["raw"], tracelens["trace"]
    mem = sorted((e for e in raw if e["name"] == "[memory]"), key=lambda e: e["ts"])
    df = trace.memory()
    assert len(df) == len(mem) == 475
    assert set(df["device"]) == {"cpu", "cuda:0"}  # Device Type 6 (HIP) is torch's cuda
    peak: dict[str, int] = defaultdict(int)
    for e in mem:
        device = "cpu" if e["args"]["Device Type"] == 0 else f"cuda:{e['args']['Device Id']}"
        peak[device] = max(peak[device], e["args"]["Total Allocated"])
    got = memory_mod.peaks(trace)
    whole = got[got["step"].isna()].set_index("device")["peak_bytes"].to_dict()
    assert whole == dict(peak)
    # what was allocated before the capture: the first event's total less its own allocation
    start: dict[str, int] = {}
    for e in mem:
        device = "cpu" if e["args"]["Device Type"] == 0 else f"cuda:{e['args']['Device Id']}"
        start.setdefault(device, e["args"]["Total Allocated"] - e["args"]["Bytes"])
    assert got[got["step"].isna()].set_index("device")["start_bytes"].to_dict() == start
    assert start["cuda:0"] > 0
    assert df["delta_bytes"].sum() == sum(e["args"]["Bytes"] for e in mem)
    assert df["ts"].is_monotonic_increasing and df["ts"].min() >= 0
    assert not df.attrs["reconstructed"]
    assert df["layer"].notna().sum() > 400  # nearly every allocation happens in a layer


def test_memory_reconstructed_from_deltas() -> None:
    trace = tracemagic.load(OLD, use_cache=False)
    raw = sorted((e for e in raw_events(OLD) if e["name"] == "[memory]"), key=lambda e: e["ts"])
    df = trace.memory()
    assert len(df) == len(raw) == 12838
    assert df.attrs["reconstructed"] == {0: ["cpu", "cuda:0"]} and "running sum" in df.attrs["note"]
    for device, kind in (("cpu", 0), ("cuda:0", 1)):
        running, low, high = 0, 0, 0
        for e in raw:
            if e["args"]["Device Type"] == kind:
                running += e["args"]["Bytes"]
                low, high = min(low, running), max(high, running)
        mine = df[df["device"] == device]
        assert mine["allocated_bytes"].max() == high - low
        assert mine["allocated_bytes"].min() >= 0
        assert df.attrs["baseline_bytes"][0][device] == -low
    peaks = memory_mod.peaks(trace)
    assert sorted(peaks["step"].dropna()) == sorted(list(range(5, 11)) * 2)


def test_cuda_memory_keeps_its_device_without_gpu_activity(tmp_path: Path) -> None:
    """Issue 24.2: a CPU-activity profile of a CUDA model on two GPUs (``profile_memory=True``,
    no kernels) has ``[memory]`` events with ``Device Type`` 1 and ``Device Id`` 0 and 1: two
    devices, two curves, a peak each (as torch names them: ``cuda:<Device Id>``)."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": 0, "dur": 100}]
    totals = {(0, -1): 0, (1, 0): 0, (1, 1): 0}
    for i, (kind, device, size) in enumerate([(1, 0, 512), (1, 1, 4096), (1, 0, 256), (0, -1, 64), (1, 1, -4096), (1, 0, -512), (1, 1, 1024)]):
        totals[(kind, device)] += size
        events.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 10 + i,
                       "args": {"Device Type": kind, "Device Id": device, "Bytes": size, "Total Allocated": totals[(kind, device)],
                                "Total Reserved": 1 << 20, "Addr": 1000 + i}})
    path = tmp_path / "cuda_memory_cpu_activity.json"
    path.write_text(json.dumps({"traceEvents": events}))
    peak: dict[str, int] = defaultdict(int)
    for e in events[1:]:
        args = e["args"]
        device = "cpu" if args["Device Type"] == 0 else f"cuda:{args['Device Id']}"
        peak[device] = max(peak[device], args["Total Allocated"])
    trace = tracemagic.load(path, use_cache=False)
    df = trace.memory()
    assert df["device"].tolist() == ["cpu" if e["args"]["Device Type"] == 0 else f"cuda:{e['args']['Device Id']}" for e in events[1:]]
    got = trace.memory_peaks()
    assert got[got["step"].isna()].set_index("device")["peak_bytes"].to_dict() == dict(peak) == {"cpu": 64, "cuda:0": 768, "cuda:1": 4096}


def test_memory_op_layer_and_step(captured: dict[str, Any]) -> None:
    trace = captured["trace"]
    df = trace.memory()
    raw = [e for e in captured["raw"] if e["name"] == "[memory]"]
    assert len(df) == len(raw) and df["device"].eq("cpu").all()
    assert df["allocated_bytes"].max() == max(e["args"]["Total Allocated"] for e in raw)
    first = df[(df["layer"] == "Linear_0") & (df["delta_bytes"] > 0)].iloc[0]
    assert first["op"] == "aten::addmm" and first["phase"] == "forward" and first["step"] in (2, 3)
    assert set(df.loc[df["phase"] == "backward", "layer"].dropna()) >= {"Linear_0", "Linear_1"}
    peaks = memory_mod.peaks(trace)
    assert list(peaks["step"].fillna(-1)) == [2, 3, -1]  # two steps, then the whole trace
    assert peaks["peak_bytes"].iloc[-1] == df["allocated_bytes"].max()


def test_biggest_allocations(captured: dict[str, Any]) -> None:
    big = memory_mod.biggest_allocations(captured["trace"], 5)
    deltas = sorted((e["args"]["Bytes"] for e in captured["raw"] if e["name"] == "[memory]"), reverse=True)
    assert list(big["bytes"]) == deltas[:5]
    freed = big.dropna(subset=["freed_ts"])
    assert len(freed) and (freed["lifetime_us"] > 0).all()


def test_memory_categories(captured: dict[str, Any]) -> None:
    df = memory_mod.categories(captured["trace"])
    rows = json.loads((captured["path"].parent / "memory_timeline_0.json").read_text())
    assert df.attrs["clock"] == "trace" and df["cycle"].isna().all()
    assert df["ts"].is_monotonic_increasing
    assert df["ts"].iloc[-1] <= captured["trace"].memory()["ts"].max() + 1
    start = min(r[0] for r in rows if r[0] >= 0)  # ts -1 (allocated before) counts as the start
    assert len(df) == len({r[0] if r[0] >= 0 else start for r in rows})
    # on the allocator's scale: after each timestamp the stack holds what Total Allocated says
    base = json.loads(captured["path"].read_text())["baseTimeNanoseconds"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in captured["raw"] if e["name"] == "[memory]")
    stamps = sorted({r[0] for r in rows if r[0] >= 0})
    allocator = [next(total for ts, total in reversed(memory) if ts <= (ns - base) / 1000 + 1e-3) for ns in stamps]
    assert df["total_bytes"].tolist() == allocator
    # the parameters existed before the capture: in the stack where the allocator counted them, else set aside
    uncounted = df.attrs["uncounted"].get(0, {})
    assert df["parameter"].iloc[0] + uncounted.get("parameter", 0) == captured["param_bytes"]
    assert (df["before_capture"] >= 0).all() and df["before_capture"].nunique() == 1
    assert df["gradient"].max() > 0 and df["activation"].max() > 0
    assert df.attrs["categories"][0] == "before_capture"
    assert (df[df.attrs["categories"]].sum(axis=1) == df["total_bytes"]).all()


def test_memory_categories_keep_the_tensors_the_allocator_counted(tmp_path: Path) -> None:
    """Tensors made in an earlier profiled session are in the CPU allocator's totals: the
    stack keeps them in their category, and what else it held is the before-capture band."""
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.manual_seed(0)
        model = nn.Linear(256, 256)
        x = torch.randn(16, 256)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 record_shapes=True, profile_memory=True, with_stack=True) as prof:
        for _ in range(3):
            model(x).sum().backward()
            model.zero_grad()
            prof.step()
    path = tmp_path / "kineto_trace_0.json"
    prof.export_chrome_trace(str(path))
    MemoryProfileTimeline(prof._memory_profile()).export_memory_timeline_raw(str(tmp_path / "memory_timeline_0.json"), "cpu")
    df = memory_mod.categories(tracemagic.load(path, use_cache=False))
    raw = json.loads(path.read_text())
    rows = json.loads((tmp_path / "memory_timeline_0.json").read_text())
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in raw["traceEvents"]
                    if e.get("name") == "[memory]")
    start = memory[0][1] - memory[0][2]
    before = sum(r[2] for r in rows if r[0] < 0)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert before >= param_bytes and start >= before  # the earlier session counted them
    assert df.attrs["uncounted"] == {}
    assert df["parameter"].iloc[0] == param_bytes
    assert (df["before_capture"] == start - before).all()
    stamps = sorted({r[0] for r in rows if r[0] >= 0})
    base = raw["baseTimeNanoseconds"]
    allocator = [next(total for ts, total, _ in reversed(memory) if ts <= (ns - base) / 1000 + 1e-3) for ns in stamps]
    assert df["total_bytes"].tolist() == allocator


def test_memory_categories_absent_or_foreign(tmp_path: Path) -> None:
    empty = memory_mod.categories(tracemagic.load(MI250, use_cache=False))
    assert empty.empty and "no memory timeline" in empty.attrs["note"]
    shutil.copy(MI250, tmp_path / "kineto_trace_0.json.gz")
    shutil.copy(HTA_TIMELINE, tmp_path / "memory_timeline_0.json.gz")
    df = memory_mod.categories(tracemagic.load(tmp_path / "kineto_trace_0.json.gz", use_cache=False))
    rows = json.loads(gzip.decompress(HTA_TIMELINE.read_bytes()))
    assert df.attrs["clock"] == "own" and df["ts"].iloc[0] == 0
    assert df["total_bytes"].iloc[-1] == sum(r[2] for r in rows)
    assert df["device"].eq("cuda:0").all()


# -- shapes -------------------------------------------------------------------------------
def test_linear_flops_match_torch(captured: dict[str, Any]) -> None:
    """A call chain's FLOPs are its top op's (aten::linear), else those of the outermost ops
    inside that have some (the two aten::mm of AddmmBackward0): torch's own counts."""
    df = captured["trace"].shapes()
    torch_flops = captured["torch_flops"]
    linear = df[(df["name"] == "aten::linear") & (df["input_dims"] == "[[8, 32], [64, 32], [64]]")].iloc[0]
    assert linear["flops"] == 2 * 8 * 64 * 32 == torch_flops[("aten::addmm", "[[64], [8, 32], [32, 64], [], []]")]
    assert linear["tflops_per_s"] == pytest.approx(linear["flops"] * linear["calls"] / linear["total_us"] / 1e6)
    # the column contract (help(tracemagic.analysis)) says so: it named gpu_us alone, 0 on the CPU
    from tracemagic.analysis.schema import TABLES
    assert "over ``total_us`` where" in TABLES["shapes"].columns["tflops_per_s"][1]
    checked = 0
    for _, row in df[df["name"] == "aten::linear"].iterrows():  # the addmm or mm each one runs
        x, w = json.loads(row["input_dims"])[:2]
        m = math.prod(x[:-1])
        ran = torch_flops.get(("aten::addmm", str([[w[0]], [m, w[1]], [w[1], w[0]], [], []])))
        ran = ran or torch_flops.get(("aten::mm", str([[m, w[1]], [w[1], w[0]]])))
        assert row["flops"] == 2 * m * w[0] * w[1] == ran, row["input_dims"]
        checked += 1
    assert checked >= 5
    backward = df[(df["name"] == "AddmmBackward0") & (df["input_dims"] == "[[8, 16]]")].iloc[0]
    assert backward["flops"] == torch_flops[("aten::mm", "[[8, 16], [16, 64]]")] + torch_flops[("aten::mm", "[[16, 8], [8, 64]]")]
    assert not set(df["name"]) & {"aten::addmm", "aten::mm"}  # inside the chains above
    sdpa = df[df["name"] == "aten::scaled_dot_product_attention"].iloc[0]
    assert sdpa["flops"] == 4 * 4 * 4 * 10 * 10 * 8  # 2·(B·H)·L·S·(E + Ev)


def test_shapes_groups_cover_every_call_chain(kineto_raw_control: dict[str, Any]) -> None:
    from test_nesting import chain_oracle, table_events

    chains = chain_oracle(table_events(CONTROL))
    df = kineto_raw_control["trace"].shapes()
    assert df["calls"].sum() == len(chains)
    assert df["total_us"].sum() == pytest.approx(sum(c["dur"] for c in chains.values()))
    assert df["self_us"].sum() == pytest.approx(sum(c["self"] for c in chains.values()))
    assert len(df) == len({c["key"] for c in chains.values()})
    assert (df["mean_us"] * df["calls"]).sum() == pytest.approx(df["total_us"].sum())
    mm = df[df["flops_source"] == "shapes"]
    assert len(mm) and (mm["tflops_per_s"] > 0).all() and (mm["gpu_us"] > 0).all()


def test_flop_rules() -> None:
    assert flops("aten::matmul", "[[2, 3, 4, 5], [5, 6]]") == 2 * 2 * 3 * 4 * 6 * 5
    assert flops("aten::matmul", "[[5], [5]]") == 10
    assert flops("aten::bmm", "[[7, 4, 5], [7, 5, 6]]") == 2 * 7 * 4 * 6 * 5
    assert flops("aten::baddbmm", "[[7, 4, 6], [7, 4, 5], [7, 5, 6], [], []]") == 2 * 7 * 4 * 6 * 5
    assert flops("aten::linear", "[[2, 10, 32], [64, 32], [64]]") == 2 * 20 * 64 * 32
    assert flops("aten::conv2d", "[[2, 3, 8, 8], [4, 3, 3, 3], [4], [], [], [], []]") == 2 * 2 * 4 * 3 * 9 * 64
    assert flops("aten::mm", "[[2, 3], [4, 5]]") is None  # mismatched inner dims
    assert flops("aten::relu", "[[2, 3]]") is None and flops("aten::mm", None) is None


# -- backward attribution: fwdbwd flows, sequence numbers as the fallback ---------------------
def backward_links(trace: Any) -> tuple[Any, Any, Any]:
    """Outermost backward op rows, and their layer (module row) by flows and by seq alone."""
    import numpy as np

    from tracemagic.analysis.attribution import attribution

    by_flow, by_seq = attribution(trace), attribution(trace, flows=False)
    roots = np.flatnonzero(by_flow.root == np.arange(by_flow.root.size))
    return roots, by_flow.module[roots], by_seq.module[roots]


@pytest.mark.parametrize("which", ["captured", "tracelens", "mi250"])
def test_flows_and_sequence_numbers_agree_on_single_threaded_forwards(which: str, request: pytest.FixtureRequest) -> None:
    trace = tracemagic.load(MI250, use_cache=False) if which == "mi250" else request.getfixturevalue(which)["trace"]
    flows = trace.flows
    fwdbwd = flows[(flows["cat"].astype(str) == "fwdbwd").to_numpy()]
    assert len(fwdbwd) > 0
    # a flow's ts is the ts of a CPU op on its thread: start at a forward op, end at a backward op
    events = trace.events
    ops = events[(events["kind"] == "cpu_op").to_numpy()]
    at = set(zip(ops["rank"], ops["pid"].astype(str), ops["tid"].astype(str), ops["ts"]))
    assert all(k in at for k in zip(fwdbwd["rank"], fwdbwd["pid"].astype(str), fwdbwd["tid"].astype(str), fwdbwd["ts"]))
    roots, by_flow, by_seq = backward_links(trace)
    assert roots.size and (by_flow >= 0).any() or which == "mi250"
    assert (by_flow == by_seq).all()


def two_thread_trace(path: Path, with_flows: bool = True) -> Path:
    """Two threads run forward passes with colliding sequence numbers; fwdbwd flows link them.

    Thread 1 runs Linear_0 (op seq 5) then its backward last; thread 2 runs Linear_1 (op seq
    5, later) and its backward first. The latest earlier forward op with seq 5 is thread 2's
    for both backward ops, so seq alone gives both to Linear_1; the flows give one each.
    """

    def x(name: str, cat: str, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur, "args": args}

    def flow(ph: str, tid: int, ts: float, ident: int) -> dict[str, Any]:
        event = {"ph": ph, "cat": "fwdbwd", "name": "fwdbwd", "id": ident, "pid": 100, "tid": tid, "ts": ts}
        return event | ({"bp": "e"} if ph == "f" else {})

    events = [
        x("ProfilerStep#1", "user_annotation", 1, 0, 1000),
        x("nn.Module: Linear_0", "python_function", 1, 10, 100),
        x("aten::linear", "cpu_op", 1, 20, 50, **{"Sequence number": 5, "Fwd thread id": 0}),
        x("nn.Module: Linear_1", "python_function", 2, 40, 100),
        x("aten::linear", "cpu_op", 2, 50, 50, **{"Sequence number": 5, "Fwd thread id": 0}),
        x(f"{BACKWARD}: AddmmBackward0", "cpu_op", 2, 300, 40, **{"Sequence number": 5, "Fwd thread id": 2}),
        x("AddmmBackward0", "cpu_op", 2, 301, 30, **{"Sequence number": 5, "Fwd thread id": 2}),
        x(f"{BACKWARD}: AddmmBackward0", "cpu_op", 1, 500, 70, **{"Sequence number": 5, "Fwd thread id": 1}),
        x("AddmmBackward0", "cpu_op", 1, 501, 60, **{"Sequence number": 5, "Fwd thread id": 1}),
        flow("s", 1, 20, 1),
        flow("f", 1, 501, 1),
        flow("s", 2, 50, 2),
        flow("f", 2, 301, 2),
    ]
    events = [e for e in events if with_flows or e["ph"] == "X"]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_flows_attribute_backward_across_threads_with_colliding_sequence_numbers(tmp_path: Path) -> None:
    trace = tracemagic.load(two_thread_trace(tmp_path / "two_threads.json"), use_cache=False)
    rows = by_layer(trace.layers())
    assert rows["Linear_0"]["bwd_cpu_us"] == pytest.approx(70.0)
    assert rows["Linear_1"]["bwd_cpu_us"] == pytest.approx(40.0)
    assert rows["Linear_0"]["fwd_cpu_us"] == pytest.approx(100.0)
    roots, by_flow, by_seq = backward_links(trace)
    names = trace.events["name"].to_numpy(dtype=object)
    assert roots.size == 2
    tids = trace.events["tid"].astype(str).to_numpy()[roots]
    assert dict(zip(tids, names[by_flow])) == {"1": "nn.Module: Linear_0", "2": "nn.Module: Linear_1"}
    assert list(names[by_seq]) == ["nn.Module: Linear_1"] * 2  # seq alone: both to thread 2's layer
    # without the flows (an old trace) the sequence numbers are the fallback
    old = tracemagic.load(two_thread_trace(tmp_path / "no_flows.json", with_flows=False), use_cache=False)
    assert "Linear_0" not in by_layer(old.layers()) or by_layer(old.layers())["Linear_0"]["bwd_cpu_us"] == 0
    assert by_layer(old.layers())["Linear_1"]["bwd_cpu_us"] == pytest.approx(110.0)


def test_conv_flops_exact_from_concrete_inputs(tmp_path: Path) -> None:
    """Strided, dilated, grouped and transposed convs: FLOPs from the real output size."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    strided = nn.Conv2d(3, 8, 3, stride=2, padding=1)
    dilated = nn.Conv2d(8, 8, 3, dilation=2, padding=1, bias=False)
    grouped = nn.Conv2d(8, 12, (3, 1), groups=4, stride=(1, 2))
    up = nn.ConvTranspose2d(12, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
    layers = [strided, dilated, grouped, up]
    model = nn.Sequential(*layers).eval()
    x = torch.randn(2, 3, 17, 19)
    inputs, outputs = [], []
    with torch.no_grad():
        h = x
        for layer in layers:
            inputs.append(list(h.shape))
            h = layer(h)
            outputs.append(list(h.shape))
        with FlopCounterMode(display=False) as counter:
            model(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
            model(x)
    path = tmp_path / "conv.json"
    prof.export_chrome_trace(str(path))
    df = tracemagic.load(path, use_cache=False).shapes()

    def expected(layer: nn.Module, inp: list[int], out: list[int]) -> int:
        n, c_in, c_out, k = inp[0], layer.in_channels, layer.out_channels, math.prod(layer.kernel_size)
        if layer.transposed:  # torch counts a transposed conv per input position
            return 2 * n * math.prod(inp[2:]) * c_in * (c_out // layer.groups) * k
        spatial = [
            (i + 2 * p - d * (kk - 1) - 1) // s + 1
            for i, p, d, kk, s in zip(inp[2:], layer.padding, layer.dilation, layer.kernel_size, layer.stride)
        ]
        assert spatial == out[2:]  # the textbook size is the real one
        return 2 * n * c_out * math.prod(out[2:]) * (c_in // layer.groups) * k

    want = [expected(layer, i, o) for layer, i, o in zip(layers, inputs, outputs)]
    assert want[0] < 2 * 2 * 8 * 3 * 9 * 17 * 19 / 3  # the old same-size estimate was ~4x too big
    # the rule on the ops each conv runs (shapes() lists only the op the model called)
    events = json.loads(path.read_text())["traceEvents"]
    for name in ("aten::convolution", "aten::_convolution"):
        calls = [e for e in events if e.get("name") == name]
        got = {str(e["args"]["Input Dims"][0]): flops(name, json.dumps(e["args"]["Input Dims"]), json.dumps(e["args"]["Concrete Inputs"]))
               for e in calls}
        assert len(calls) == 4 and [got[str(i)] for i in inputs] == want
    assert not set(df["name"]) & {"aten::convolution", "aten::_convolution"}
    conv2d = df[df["name"] == "aten::conv2d"].sort_values("input_dims")
    assert (conv2d["flops_source"] == "shapes").all()
    assert sorted(conv2d["flops"]) == sorted(want[:3])
    assert df[df["name"] == "aten::conv_transpose2d"]["flops"].tolist() == [want[3]]
    # torch's own counts: FlopCounterMode (all four) and with_flops (conv2d only)
    assert counter.get_total_flops() == sum(want)
    torch_conv2d = sorted(e.flops for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::conv2d")
    assert torch_conv2d == sorted(want[:3])
    # without Concrete Inputs the estimate (input-sized output) is all there is
    dims = "[[2, 3, 17, 19], [8, 3, 3, 3], [8], [], [], [], []]"
    assert flops("aten::conv2d", dims) == 2 * 2 * 8 * 3 * 9 * 17 * 19
    assert flops("aten::conv2d", dims, '["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "1"]') == want[0]
    assert flops("aten::conv2d", dims, '["", "", "", "[2]", "[1]", "1", "1"]') == want[0]  # broadcast
    assert flops("aten::conv2d", dims, '["", "", "", "[1, 1]", "same", "[1, 1]", "1"]') == 2 * 2 * 8 * 3 * 9 * 17 * 19
    assert flops("aten::conv2d", dims, '["", "", "", "[1, 1]", "valid", "[1, 1]", "1"]') == 2 * 2 * 8 * 3 * 9 * 15 * 17
    assert flops("aten::conv2d", dims, '["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "2"]') == 2 * 2 * 8 * 3 * 9 * 17 * 19
