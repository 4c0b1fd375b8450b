"""``efficiency()`` and the device peaks on the real GPU traces, checked against the raw JSON.

FLOPs and bytes are recomputed here from each op's ``Input Dims``/``Input type`` with the
documented cost models (written again, independently: numel, sizes, broadcasting), the
call chains rebuilt from the raw events' nesting, and the device peaks compared with the
vendors' datasheet figures typed in below.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import TRACES

import tb_reference
import tracemagic
from tracemagic.analysis import devices
from tracemagic.errors import TraceError

#: trace -> (device row expected, datasheet HBM TB/s, FP32 TFLOP/s: CUDA cores (NVIDIA), matrix cores (AMD))
DEVICES = {
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz": ("MI250 (one GCD)", 3.2768 / 2, 90.5 / 2),
    "tracelens_normalization_layer_test.json.gz": ("MI300X", 5.3, 163.4),
    "hta_control.json.gz": ("A100 SXM 40GB", 1.555, 19.5),
    "kineto_worker0.1623143089861.pt.trace.json.gz": ("V100 SXM2", 0.9, 15.7),
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz": ("V100 SXM2", 0.9, 15.7),
    "hta_nccl_data.json.gz": ("A100 SXM 40GB", 1.555, 19.5),
    "param_dlrm_kineto.tar.gz": ("V100 SXM2", 0.9, 15.7),
}
GPU_TRACES = list(DEVICES)[:4]
SIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8, "int": 4, "bool": 1, "unsigned char": 1}
NORMS_FWD = {
    "aten::layer_norm", "aten::native_layer_norm", "aten::rms_norm", "aten::_fused_rms_norm", "aten::batch_norm",
    "aten::native_batch_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
    "aten::group_norm", "aten::native_group_norm", "aten::instance_norm",
}  # fmt: skip
NORMS_BWD = {
    "aten::native_layer_norm_backward", "aten::_fused_rms_norm_backward", "aten::native_batch_norm_backward",
    "aten::cudnn_batch_norm_backward", "aten::miopen_batch_norm_backward", "aten::native_group_norm_backward",
}  # fmt: skip
ELEMENTWISE = {f"aten::{n}{s}" for n in ("add", "mul", "div", "sub", "rsub", "neg", "exp", "log", "relu", "tanh", "sigmoid", "clamp",
               "clamp_min", "nan_to_num", "threshold_backward", "tanh_backward", "sigmoid_backward") for s in ("", "_")}  # fmt: skip


def numel(shape: list[int]) -> int:
    out = 1
    for v in shape:
        out *= v
    return out


def tensor_inputs(dims: list[Any], types: list[str]) -> list[tuple[list[int], int]]:
    return [(d, SIZE[t]) for d, t in zip(dims, types) if t in SIZE and isinstance(d, list) and all(isinstance(v, int) for v in d)]


def expected_cost(name: str, args: dict[str, Any]) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one call by the documented models, or None where this test does not model it."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    concrete = args.get("Concrete Inputs") or []
    if dims is None or types is None:
        return None
    reads = sum(numel(d) * s for d, s in tensor_inputs(dims, types))
    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::linear"):
        if name == "aten::linear":
            x, w = dims[0], dims[1]
            m, k, n = numel(x[:-1]), x[-1], w[0]
            batch = 1
        else:
            a, b = (dims[1], dims[2]) if name == "aten::addmm" else (dims[0], dims[1])
            batch = a[0] if name == "aten::bmm" else 1
            m, k, n = a[-2], a[-1], b[-1]
        return 2.0 * batch * m * n * k, reads + batch * m * n * SIZE[types[0 if name != "aten::addmm" else 1]]
    if name in NORMS_FWD:
        return 5.0 * numel(dims[0]), reads + numel(dims[0]) * SIZE[types[0]]
    if name in NORMS_BWD:
        return 8.0 * numel(dims[0]), reads + numel(dims[0]) * SIZE[types[0]]
    if name in ("aten::_log_softmax_backward_data", "aten::_softmax_backward_data"):
        return 3.0 * numel(dims[0]), reads + numel(dims[0]) * SIZE[types[0]]
    if name in ("aten::_log_softmax", "aten::_softmax", "aten::log_softmax", "aten::softmax"):
        return 5.0 * numel(dims[0]), reads + numel(dims[0]) * SIZE[types[0]]
    if name in ELEMENTWISE or name == "aten::where":
        if types[1 if name == "aten::where" else 0] not in SIZE:
            return None  # where(cond, 0.0, x): the output dtype is not the second input's
        shapes = [d for d, _ in tensor_inputs(dims, types)]
        out = numel(list(np.broadcast_shapes(*map(tuple, shapes))))
        return float(out), reads + out * SIZE[types[1 if name == "aten::where" else 0]]
    if name in ("aten::fill_", "aten::zero_"):
        return 0.0, numel(dims[0]) * SIZE[types[0]]
    if name in ("aten::sum", "aten::mean"):
        x = dims[0]
        if len(concrete) > 1 and concrete[1].startswith("["):
            reduced = [int(v) % len(x) for v in json.loads(concrete[1])] or list(range(len(x)))
            kept = numel([s for i, s in enumerate(x) if i not in reduced])
        elif len(dims) == 1 or types[1] == "":  # no dim: everything reduced to one value
            kept = 1
        else:
            return None
        return float(numel(x)), (numel(x) + kept) * SIZE[types[0]]
    return None


def raw_docs(name: str) -> list[dict[str, Any]]:
    return tb_reference.raw_docs(TRACES / name)


class RawOps:
    """The ops of a raw trace with their nesting (per thread, by time) and their kernels' time."""

    def __init__(self, doc: dict[str, Any]) -> None:
        events = doc["traceEvents"]
        self.ops = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in ("cpu_op", "operator")]
        self.parent: dict[int, int] = {}
        self.children: dict[int, list[int]] = defaultdict(list)
        threads: dict[tuple[Any, Any], list[int]] = defaultdict(list)
        for i, e in enumerate(self.ops):
            threads[(e["pid"], e["tid"])].append(i)
        for rows in threads.values():
            rows.sort(key=lambda i: (float(self.ops[i]["ts"]), -float(self.ops[i].get("dur", 0))))
            stack: list[int] = []
            for i in rows:
                ts = float(self.ops[i]["ts"])
                while stack and float(self.ops[stack[-1]]["ts"]) + float(self.ops[stack[-1]].get("dur", 0)) <= ts:
                    stack.pop()
                if stack:
                    self.parent[i] = stack[-1]
                    self.children[stack[-1]].append(i)
                stack.append(i)
        # GPU time launched inside each op: kernel -> runtime call (correlation) -> the ops around it
        runtime = {e["args"]["correlation"]: e for e in events if str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver", "runtime") and "correlation" in e.get("args", {})}
        self.launches: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
        self.kernels: dict[tuple[Any, Any], list[tuple[float, str]]] = defaultdict(list)
        for e in events:
            if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset") and e.get("ph") == "X":
                call = runtime.get(e.get("args", {}).get("correlation"))
                if call is not None:
                    self.launches[(call["pid"], call["tid"])].append((float(call["ts"]), float(e.get("dur", 0))))
                    self.kernels[(call["pid"], call["tid"])].append((float(call["ts"]), str(e.get("name", ""))))

    def is_top(self, i: int) -> bool:
        """No op with ``Input Dims`` around it (the top of its call chain)."""
        at = self.parent.get(i)
        while at is not None:
            if "Input Dims" in self.ops[at].get("args", {}):
                return False
            at = self.parent.get(at)
        return True

    def chain_cost(self, i: int) -> tuple[float, float] | None:
        """The op's cost, or the sum over its outermost modelled ops inside; None if none is modelled."""
        e = self.ops[i]
        own = expected_cost(e["name"], e.get("args", {}))
        if own is not None:
            return own
        parts = [c for c in (self.chain_cost(j) for j in self.children.get(i, [])) if c is not None]
        if not parts:
            return None
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def kernel_names(self, i: int) -> list[str]:
        """Names of the GPU work launched inside op ``i``."""
        e = self.ops[i]
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        return [name for ts, name in self.kernels[(e["pid"], e["tid"])] if start <= ts < end]

    def gpu_us(self, i: int) -> float:
        e = self.ops[i]
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        return sum(d for ts, d in self.launches[(e["pid"], e["tid"])] if start <= ts < end)


@pytest.fixture(scope="module")
def loaded() -> dict[str, tracemagic.Trace]:
    return {name: tracemagic.load(TRACES / name, use_cache=False) for name in DEVICES}


@pytest.fixture(scope="module")
def raw() -> dict[str, RawOps]:
    return {name: RawOps(raw_docs(name)[0]) for name in GPU_TRACES}


@pytest.mark.parametrize("name", list(DEVICES))
def test_devices_are_recognised_with_their_datasheet_peaks(loaded: dict[str, tracemagic.Trace], name: str) -> None:
    device, bandwidth, fp32_matrix = DEVICES[name]
    props = [d for d in raw_docs(name)[0]["deviceProperties"]]
    assert devices.match({"name": props[0]["name"], "sm_count": props[0]["numSms"], "memory_bytes": props[0]["totalGlobalMem"]}).name == device
    table = loaded[name].efficiency()
    assert set(table["device"].dropna()) == {device}
    assert table["peak_tbytes_per_s"].dropna().unique().tolist() == [pytest.approx(bandwidth)]
    float_matrix = table[table["input_type"].str.startswith('["float"') & table["name"].isin(["aten::linear", "aten::mm", "aten::addmm", "AddmmBackward0"])]
    assert not float_matrix.empty or name in ("tracelens_normalization_layer_test.json.gz", "hta_nccl_data.json.gz", "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz", "param_dlrm_kineto.tar.gz")
    # a float32 matrix op: the FP32 peak, or A100's TF32 tensor cores' 156 where its kernels used them
    assert np.isin(float_matrix["peak_tflops"].to_numpy(), [fp32_matrix, 156.0 if device.startswith("A100") else fp32_matrix]).all()


#: TF32 tensor-core kernels by name, as NVIDIA's libraries spell them in the A100 traces
TF32_NAMES = ("tf32", "tfloat32", "tensorop_s1688")


def test_a_float32_matrix_op_is_held_to_the_tf32_peak_only_where_its_kernels_ran_tf32(loaded: dict[str, tracemagic.Trace], raw: dict[str, RawOps]) -> None:
    # allow_tf32 is off by default for matmuls: on the A100 trace cuBLAS ran some float32
    # GEMMs as CUDA-core ampere_sgemm (19.5 TFLOP/s) and others on TF32 tensor cores (156)
    name = "hta_control.json.gz"
    ops, table = raw[name], loaded[name].efficiency()
    matrix = {"aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "AddmmBackward0", "BmmBackward0", "MmBackward0"}
    tops: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for i, e in enumerate(ops.ops):
        args = e.get("args", {})
        if e["name"] in matrix and "Input Dims" in args and ops.is_top(i) and ops.gpu_us(i) > 0:
            tops[(e["name"], json.dumps(args["Input Dims"]), json.dumps(args.get("Input type")))].append(i)
    seen = set()
    for row in table[table["name"].isin(matrix) & table["input_type"].str.startswith('["float"')].itertuples():
        calls = tops[(row.name, json.dumps(json.loads(row.input_dims)), json.dumps(json.loads(row.input_type)))]
        assert len(calls) == row.calls
        kernels = [k.lower() for i in calls for k in ops.kernel_names(i)]
        tf32 = any(marker in k for k in kernels for marker in TF32_NAMES)
        assert row.peak_tflops == (156.0 if tf32 else 19.5), (row.name, row.input_dims, kernels[:3])
        seen.add(row.peak_tflops)
    assert seen == {19.5, 156.0}


def test_an_unnamed_amd_device_is_told_by_its_compute_units_and_memory() -> None:
    gib = 2**30
    assert devices.match({"name": "", "sm_count": 110, "memory_bytes": 64 * gib}).name == "MI250X (one GCD)"
    assert devices.match({"name": "AMD Radeon Graphics", "sm_count": 104, "memory_bytes": 64 * gib}).name == "MI250 (one GCD)"
    assert devices.match({"name": "", "sm_count": 304, "memory_bytes": 256 * gib}).name == "MI325X"
    assert devices.match({"name": "", "sm_count": 304, "memory_bytes": 192 * gib}).name == "MI300X"
    assert devices.match({"name": "NVIDIA H100 PCIe", "sm_count": 114}).name == "H100 PCIe"
    assert devices.match({"name": "NVIDIA H200", "sm_count": 132, "memory_bytes": 141 * 10**9}).name == "H200"
    assert devices.match({"name": "NVIDIA A100-SXM4-80GB", "sm_count": 108, "memory_bytes": 85 * 10**9}).name == "A100 SXM 80GB"
    assert devices.match({"name": "cpu"}) is None
    peaks = devices.table()
    assert set(peaks["name"]) >= {"V100 SXM2", "A100 SXM 40GB", "H100 SXM", "H100 PCIe", "H200", "B200", "MI250X (one GCD)", "MI300X", "MI355X"}
    assert peaks["source"].str.contains("datasheet").all()
    # dense figures: the H100 SXM's BF16 is half its 1,979 TFLOP/s with sparsity
    assert peaks.set_index("name").loc["H100 SXM", "bf16"] == pytest.approx(1979 / 2, rel=1e-3)


#: deviceProperties name -> the PEAKS row (None: unknown, no peaks), with the SM/CU count and GiB it reports
NAMED = [
    ("NVIDIA H100 80GB HBM3", 132, 80, "H100 SXM"),
    ("NVIDIA H100 PCIe", 114, 80, "H100 PCIe"),
    ("NVIDIA H200", 132, 141, "H200"),
    ("NVIDIA B200", 148, 180, "B200"),
    ("Tesla V100-PCIE-16GB", 80, 16, "V100 PCIe"),
    ("NVIDIA A100 80GB PCIe", 108, 80, "A100 PCIe 80GB"),
    ("AMD Instinct MI250X", 110, 64, "MI250X (one GCD)"),
    # model numbers are whole words: Grace superchips are not H200/B200, a V100S is no V100
    ("NVIDIA GH200 480GB", 132, 96, None),
    ("NVIDIA GB200", 148, 186, None),
    ("Tesla V100S-PCIE-32GB", 80, 32, None),
    # an H100 NVL has its own figures, not the SXM's
    ("NVIDIA H100 NVL", 132, 94, None),
    # named boards not in the table get no peaks, not those of a board with as many SMs/CUs
    ("TITAN V", 80, 12, None),
    ("Quadro GV100", 80, 32, None),
    ("AMD Instinct MI210", 104, 64, None),
    # generic or empty names: by SM/CU count and memory
    ("AMD Radeon Graphics", 104, 64, "MI250 (one GCD)"),
    ("", 304, 192, "MI300X"),
    ("Device", 108, 40, "A100 SXM 40GB"),
    ("gfx90a:sramecc+:xnack-", 110, 64, "MI250X (one GCD)"),
]


@pytest.mark.parametrize(("name", "sms", "gib", "row"), NAMED)
def test_device_names_match_whole_model_numbers_and_unknown_boards_get_no_row(name: str, sms: int, gib: int, row: str | None) -> None:
    found = devices.match({"name": name, "sm_count": sms, "memory_bytes": gib * 2**30})
    assert (found.name if found else None) == row


def test_an_unknown_named_board_gets_nan_peaks_and_a_note(tmp_path: Path) -> None:
    # the MI250 trace with its devices renamed to a board the table lacks (an MI210: 104 CUs, like an MI250 die)
    doc = raw_docs("hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz")[0]
    for props in doc["deviceProperties"]:
        props["name"] = "AMD Instinct MI210"
    path = tmp_path / "mi210.json"
    path.write_text(json.dumps(doc))
    table = tracemagic.load(path, cache_dir=tmp_path).efficiency()
    assert len(table) > 0 and table["device"].isna().all()
    assert table["peak_tflops"].isna().all() and table["peak_tbytes_per_s"].isna().all() and table["bound"].isna().all()
    assert "AMD Instinct MI210" in table.attrs["note"]
    # the FLOPs need no device
    assert table["flops"].notna().any()


#: trace -> op families that must come out modelled (non-NaN FLOPs and bytes)
FAMILIES = {
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz": {"aten::linear", "AddmmBackward0", "aten::relu", "ReluBackward0", "aten::sum"},
    "tracelens_normalization_layer_test.json.gz": {
        "aten::layer_norm", "aten::batch_norm", "aten::group_norm", "aten::rms_norm", "aten::instance_norm",
        "NativeLayerNormBackward0", "NativeBatchNormBackward0", "MiopenBatchNormBackward0", "NativeGroupNormBackward0",
        "FusedRmsNormBackward0", "torch::autograd::AccumulateGrad",
    },
    "hta_control.json.gz": {"aten::linear", "AddmmBackward0", "aten::bmm", "BmmBackward0", "aten::layer_norm", "NativeLayerNormBackward0", "aten::add", "aten::mul", "aten::tanh", "TanhBackward0", "aten::sigmoid"},
    "kineto_worker0.1623143089861.pt.trace.json.gz": {"aten::linear", "aten::batch_norm", "CudnnBatchNormBackward", "aten::add_", "aten::relu_", "ReluBackward1", "LogSoftmaxBackward"},
}  # fmt: skip


@pytest.mark.parametrize("name", GPU_TRACES)
def test_flops_and_bytes_equal_the_cost_models_on_the_raw_input_dims(loaded: dict[str, tracemagic.Trace], raw: dict[str, RawOps], name: str) -> None:
    table = loaded[name].efficiency()
    ops = raw[name]
    tops: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for i, e in enumerate(ops.ops):
        args = e.get("args", {})
        if "Input Dims" in args and ops.is_top(i):
            tops[(e["name"], json.dumps(args["Input Dims"]), json.dumps(args.get("Input type")))].append(i)
    checked = set()
    for row in table.itertuples():
        if pd.isna(row.input_dims) or (math.isnan(row.flops) and math.isnan(row.bytes)):
            continue
        key = (row.name, json.dumps(json.loads(row.input_dims)), json.dumps(json.loads(row.input_type)))
        calls = [i for i in tops[key] if ops.gpu_us(i) > 0]
        assert len(calls) == row.calls, key
        costs = [ops.chain_cost(i) for i in calls]
        assert None not in costs, key
        assert row.flops == pytest.approx(sum(c[0] for c in costs) / len(costs), rel=1e-9), key
        assert row.bytes == pytest.approx(sum(c[1] for c in costs) / len(costs), rel=1e-9), key
        gpu = sum(ops.gpu_us(i) for i in calls)
        assert row.gpu_us == pytest.approx(gpu, rel=1e-9, abs=1e-3), key
        assert row.tflops_per_s == pytest.approx(row.calls * row.flops / (gpu * 1e-6) / 1e12, rel=1e-6)
        assert row.intensity == pytest.approx(row.flops / row.bytes) if row.bytes else True
        checked.add(row.name)
    assert FAMILIES[name] <= checked, FAMILIES[name] - checked


def test_convolutions_without_their_stride_are_left_unknown(loaded: dict[str, tracemagic.Trace]) -> None:
    # the 2021 ResNet-50 trace records no Concrete Inputs: a conv's output size is unknown,
    # shapes() estimates it, efficiency() does not guess
    table = loaded["kineto_worker0.1623143089861.pt.trace.json.gz"].efficiency()
    convs = table[table["name"] == "aten::conv2d"]
    assert len(convs) > 10
    assert convs["flops"].isna().all() and convs["pct_of_roofline"].isna().all()


@pytest.mark.parametrize("name", [*GPU_TRACES, "param_dlrm_kineto.tar.gz"])
def test_no_row_runs_above_its_roof_except_from_the_cache(loaded: dict[str, tracemagic.Trace], name: str) -> None:
    table = loaded[name].efficiency()
    device = {p.name: p for p in devices.PEAKS}[DEVICES[name][0]]
    known = table.dropna(subset=["pct_of_roofline"])
    assert len(known) >= 5
    for row in known.itertuples():
        roof = min(row.peak_tflops, row.intensity * row.peak_tbytes_per_s) if row.flops > 0 and not math.isnan(row.peak_tflops) else math.nan
        seconds = row.gpu_us * 1e-6
        # kernels are timed to 1 µs in these traces: each call may be up to 1 µs longer
        seconds_at_most = (row.gpu_us + row.calls * 1.0) * 1e-6
        if row.bound == "compute":
            assert row.pct_of_roofline == pytest.approx(100 * row.tflops_per_s / roof, rel=1e-9)
            # above the compute roof would mean a wrong FLOP model or peak
            assert row.calls * row.flops / seconds_at_most / 1e12 <= row.peak_tflops, row
        else:
            assert row.bound == "memory"
            achieved = row.calls * row.bytes / seconds / 1e12
            assert row.pct_of_roofline == pytest.approx(100 * achieved / row.peak_tbytes_per_s, rel=1e-9)
            # HBM serves at least what the last-level cache cannot hold: that part stays under the peak
            from_memory = max(row.bytes - device.cache_mib * 2**20, 0.0)
            assert row.calls * from_memory / seconds_at_most / 1e12 <= row.peak_tbytes_per_s, row
    assert (known["pct_of_roofline"] > 0).all()


def cpu_trace(tmp_path: Path) -> Path:
    """A CPU-only trace: flash attention (causal), a convolution backward and an mm, with shapes."""
    def op(name: str, ts: float, dims: list[Any], types: list[str], concrete: list[str]) -> dict[str, Any]:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 100.0,
                "args": {"Input Dims": dims, "Input type": types, "Concrete Inputs": concrete}}  # fmt: skip

    events = [
        op("aten::_scaled_dot_product_flash_attention_for_cpu", 0, [[2, 4, 128, 64], [2, 4, 128, 64], [2, 4, 128, 64], [], [], [], []],
           ["c10::BFloat16"] * 3 + ["Scalar", "Scalar", "", ""], ["", "", "", "0.", "True", "", ""]),
        op("aten::convolution_backward", 200, [[8, 32, 14, 14], [8, 16, 28, 28], [32, 16, 3, 3], [], [], [], [], [], [], [], []],
           ["float"] * 3 + ["ScalarList"] * 4 + ["Scalar", "ScalarList", "Scalar", "ScalarList"],
           ["", "", "", "[32]", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "[True, True, False]"]),
        op("aten::mm", 400, [[64, 32], [32, 16]], ["float", "float"], ["", ""]),
    ]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_flops_per_call_are_unknown_in_shapes_and_efficiency_unless_every_call_is_modelled(tmp_path: Path) -> None:
    """Two groups of calls of one custom op: one whose calls all run an ``aten::mm``, one
    whose second call runs an op no model covers. Averaging the known call would hold the
    unknown call's time to the known call's FLOPs; both tables say NaN instead."""
    def op(name: str, ts: float, dur: float, dims: list[Any], types: list[str]) -> dict[str, Any]:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                "args": {"Input Dims": dims, "Input type": types}}  # fmt: skip

    mm = ([[64, 32], [32, 16]], ["float", "float"])
    events = [
        op("custom::all_known", 0, 100, [[64, 32]], ["float"]), op("aten::mm", 10, 50, *mm),
        op("custom::all_known", 200, 100, [[64, 32]], ["float"]), op("aten::mm", 210, 50, *mm),
        op("custom::one_unknown", 400, 100, [[64, 32]], ["float"]), op("aten::mm", 410, 50, *mm),
        op("custom::one_unknown", 600, 100, [[64, 32]], ["float"]), op("custom::unmodelled", 610, 50, [[64, 32]], ["float"]),
    ]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = tracemagic.load(path, cache_dir=tmp_path)
    shapes, table = trace.shapes().set_index("name"), trace.efficiency().set_index("name")
    m, k = mm[0][0]
    n = mm[0][1][1]
    assert shapes.loc["custom::all_known", "flops"] == table.loc["custom::all_known", "flops"] == 2 * m * n * k
    assert pd.isna(shapes.loc["custom::one_unknown", "flops"]) and math.isnan(table.loc["custom::one_unknown", "flops"])
    assert pd.isna(shapes.loc["custom::one_unknown", "tflops_per_s"]) and pd.isna(shapes.loc["custom::one_unknown", "flops_source"])
    assert shapes.loc["custom::all_known", "flops_source"] == "shapes"


def test_attention_and_conv_backward_costs_and_peaks_on_a_cpu_trace(tmp_path: Path) -> None:
    trace = tracemagic.load(cpu_trace(tmp_path), cache_dir=tmp_path)
    table = trace.efficiency().set_index("name")
    attention = table.loc["aten::_scaled_dot_product_flash_attention_for_cpu"]
    # QKᵀ and PV, 2·B·H·L·S·(E + Eᵥ), halved for is_causal
    assert attention["flops"] == 2 * 2 * 4 * 128 * 128 * (64 + 64) * 0.5
    assert attention["bytes"] == (3 + 1) * 2 * 4 * 128 * 64 * 2
    conv = table.loc["aten::convolution_backward"]
    # grad input and grad weight, each 2 · N · C_out · out positions · C_in · kernel
    assert conv["flops"] == 2 * (2 * 8 * 32 * 14 * 14 * 16 * 9)
    assert conv["bytes"] == (8 * 32 * 14 * 14 + 8 * 16 * 28 * 28 + 32 * 16 * 9 + 8 * 16 * 28 * 28 + 32 * 16 * 9) * 4
    # shapes() counts the same FLOPs
    shapes = trace.shapes().set_index("name")
    assert shapes.loc["aten::convolution_backward", "flops"] == conv["flops"]
    assert shapes.loc["aten::_scaled_dot_product_flash_attention_for_cpu", "flops"] == attention["flops"]
    # a CPU trace has no default peak; the host time is the time
    assert table["device"].isna().all() and table["peak_tflops"].isna().all() and table["pct_of_roofline"].isna().all()
    assert (table["gpu_us"] == 100.0).all()
    given = trace.efficiency(peaks={"fp32": 2.0, "bf16": 8.0, "tbytes_per_s": 0.1}).set_index("name")
    assert given.loc["aten::mm", "peak_tflops"] == 2.0 and given.loc["aten::_scaled_dot_product_flash_attention_for_cpu", "peak_tflops"] == 8.0
    mm = given.loc["aten::mm"]
    achieved = 2 * 64 * 32 * 16 / 100e-6 / 1e12
    assert mm["tflops_per_s"] == pytest.approx(achieved)
    intensity = 2 * 64 * 32 * 16 / ((64 * 32 + 32 * 16 + 64 * 16) * 4)
    assert mm["bound"] == ("compute" if intensity >= 2.0 / 0.1 else "memory")
    assert mm["pct_of_roofline"] == pytest.approx(100 * achieved / min(2.0, intensity * 0.1))
    with pytest.raises(TraceError, match="unknown keys"):
        trace.efficiency(peaks={"bfloat16": 1.0})
    with pytest.raises(TraceError, match="peaks must be"):
        trace.efficiency(peaks=[1.0])  # type: ignore[arg-type]


def test_layers_achieved_tflops_and_memory_bound_share_follow_their_ops(loaded: dict[str, tracemagic.Trace], raw: dict[str, RawOps]) -> None:
    name = "tracelens_normalization_layer_test.json.gz"
    doc = raw_docs(name)[0]
    ops = raw[name]
    start = {(e["pid"], e["tid"], e["ts"]): e for e in doc["traceEvents"] if e.get("cat") == "fwdbwd" and e["ph"] == "s"}
    by_id = {e["id"]: e for e in start.values()}
    at = {(e["pid"], e["tid"], float(e["ts"])): i for i, e in enumerate(ops.ops) if "Input Dims" in e.get("args", {}) and ops.is_top(i)}
    backward_of = {}  # forward op -> the backward chain top the autograd flow leads to
    for e in doc["traceEvents"]:
        if e.get("cat") == "fwdbwd" and e["ph"] == "f" and e["id"] in by_id:
            s = by_id[e["id"]]
            fwd = next((i for i, o in enumerate(ops.ops) if (o["pid"], o["tid"], o["ts"]) == (s["pid"], s["tid"], s["ts"])), None)
            bwd = at.get((e["pid"], e["tid"], float(e["ts"])))
            if fwd is not None and bwd is not None:
                backward_of[fwd] = bwd
    layers = loaded[name].layers().set_index("layer")
    ridge = 163.4 / 5.3  # MI300X FP32 TFLOP/s over TB/s, datasheet
    checked = 0
    calls: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(("nn.Module: RMSNorm", "nn.Module: LayerNorm")):
            calls[e["name"].split(": ")[1]].append(e)
    for layer, modules in calls.items():
        chains = []
        for module in modules:
            lo, hi = float(module["ts"]), float(module["ts"]) + float(module["dur"])
            inside = [i for i, o in enumerate(ops.ops) if o["tid"] == module["tid"] and lo <= float(o["ts"]) < hi]
            chains += [i for i in inside if "Input Dims" in ops.ops[i].get("args", {}) and ops.is_top(i)]
            chains += [backward_of[i] for i in inside if i in backward_of]
        chains = [i for i in chains if ops.gpu_us(i) > 0]
        costs = [ops.chain_cost(i) for i in chains]
        assert chains and None not in costs, layer
        gpu = sum(ops.gpu_us(i) for i in chains)
        row = layers.loc[layer]
        assert row["gpu_us"] == pytest.approx(gpu, rel=1e-9)
        assert row["tflops_per_s"] * row["gpu_us"] * 1e6 == pytest.approx(sum(c[0] for c in costs), rel=1e-6)
        assert all(c[0] / c[1] < ridge for c in costs) and row["memory_bound_pct"] == pytest.approx(100.0)
        checked += 1
    assert checked == 4


def test_roofline_figure_and_the_largest_gap(loaded: dict[str, tracemagic.Trace]) -> None:
    from tracemagic.views import figures, insights, sections
    from tracemagic.views.data import TraceData

    trace = loaded["tracelens_normalization_layer_test.json.gz"]
    table = trace.efficiency()
    fig = figures.roofline(table)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    roof = [t for t in fig.data if t.mode == "lines"]
    points = [t for t in fig.data if t.mode == "markers"]
    assert len(roof) == 1
    xs, ys = np.asarray(roof[0].x, dtype=float), np.asarray(roof[0].y, dtype=float)
    assert np.allclose(ys, np.minimum(163.4, xs * 5.3))  # MI300X FP32 and HBM3, datasheet
    drawn = table[(table["intensity"] > 0) & (table["tflops_per_s"] > 0)]
    assert sum(len(t.x) for t in points) == len(drawn)
    hover = " ".join(str(v) for t in points for row in t.customdata for v in row)
    assert "LayerNorm_0" in hover and "RMSNorm_1" in hover  # the layers the ops ran in
    # the advice names the op × shape with the most GPU time lost to its roof
    lost = table["gpu_us"] * (1 - table["pct_of_roofline"] / 100)
    worst = table.loc[lost.idxmax()]
    (advice,) = insights.roofline_gaps(table, 1)
    assert advice.startswith(f"{worst['name']} {worst['input_dims']}") and f"{worst['pct_of_roofline']:.0f}%" in advice
    assert "memory-bound" in advice and "MI300X" in advice
    section = sections.build("roofline", TraceData(trace))
    assert section.bullets[0] == advice and "MI300X" in dict(section.facts)["device"]


def test_collectives_message_size_and_nccl_tests_bandwidths(loaded: dict[str, tracemagic.Trace]) -> None:
    name = "hta_nccl_data.json.gz"
    kernels = sorted(
        (e for e in raw_docs(name)[0]["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"].lower()),
        key=lambda e: float(e["ts"]),
    )
    table = loaded[name].collectives().sort_values("ts").reset_index(drop=True)
    assert len(table) == len(kernels) == 21
    size = {"Float": 4, "Long": 8}
    # busbw factors of NCCL's tests (doc/PERFORMANCE.md): all-reduce 2(n-1)/n, broadcast 1
    factor = {"allreduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}
    for row, e in zip(table.itertuples(), kernels):
        args = e["args"]
        message = args["In msg nelems"] * size[args["dtype"]]
        assert row.bytes == message
        seconds = float(e["dur"]) * 1e-6  # one rank here: no wait for a last rank is known
        assert row.transfer_us == float(e["dur"]) and math.isnan(row.excess_us)
        assert row.algbw_gbps == pytest.approx(message / seconds / 1e9)
        assert row.busbw_gbps == pytest.approx(message / seconds / 1e9 * factor[args["Collective name"]](args["Group size"]))
    # a trace with no In msg nelems gets the sizes of its nccl:* ops' Input Dims (the
    # TensorBoard plugin's comm args, checked in test_distributed) but, with no Group size,
    # no bus bandwidth: NaN, not a guess
    dlrm = loaded["param_dlrm_kineto.tar.gz"].collectives()
    assert len(dlrm) > 0 and dlrm["bytes"].notna().all() and dlrm["busbw_gbps"].isna().all()


def test_causal_attention_backward_recorded_by_torch_on_the_cpu(tmp_path: Path) -> None:
    """A real CPU recording: torch's own ``Concrete Inputs`` say where ``is_causal`` is."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    path = tmp_path / "sdpa.json"
    prof.export_chrome_trace(str(path))
    raw = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    backward = [e for e in raw if e["name"] == "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    if not backward:
        pytest.skip("this torch runs CPU attention without the flash kernel")
    (event,) = backward
    _, query, key, value = event["args"]["Input Dims"][:4]
    # causal: half of QKᵀ and PV; the backward 2.5× the forward
    expected = 2.5 * 0.5 * 2 * numel(query[:-2]) * query[-2] * key[-2] * (query[-1] + value[-1])
    # its call chain's top: the autograd node around it (the backward op is its only counted op)
    (node,) = [e for e in raw if e["name"].endswith("Backward0") and "Input Dims" in e.get("args", {}) and e["tid"] == event["tid"]
               and e["ts"] <= event["ts"] and event["ts"] + event["dur"] <= e["ts"] + e["dur"]]
    shapes = tracemagic.load(path, cache_dir=tmp_path).shapes().set_index("name")
    assert shapes.loc[node["name"], "flops"] == pytest.approx(expected)


def test_a_float32_linear_under_autocast_is_held_to_the_peak_of_the_dtype_it_ran_in(tmp_path: Path) -> None:
    """A real CPU recording of one ``nn.Linear`` called with float32 tensors, three times
    under ``torch.autocast(bfloat16)`` and twice without: autocast's calls cast the inputs
    and run an inner ``aten::linear`` in bf16, so they are a row of their own, held to the
    bf16 peak; the plain calls to the fp32 peak."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    linear, x = torch.nn.Linear(64, 32), torch.randn(16, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                linear(x)
        for _ in range(2):
            linear(x)
    path = tmp_path / "autocast.json"
    prof.export_chrome_trace(str(path))
    ops = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    linears = [e for e in ops if e["name"] == "aten::linear"]
    outer = [e for e in linears if e["args"]["Input type"][0] == "float"]
    in_bf16 = [
        e
        for e in outer
        if any(i["args"]["Input type"][0] == "c10::BFloat16" and e["ts"] < i["ts"] < e["ts"] + e["dur"] for i in linears)
    ]
    assert len(outer) == 5 and len(in_bf16) == 3  # the recording is what the test is about
    peaks = {"fp32": 10.0, "bf16": 100.0, "tbytes_per_s": 1.0}
    table = tracemagic.load(path, cache_dir=tmp_path).efficiency(peaks=peaks)
    rows = table[(table["name"] == "aten::linear") & table["input_type"].str.startswith('["float"')]
    assert sorted(zip(rows["calls"], rows["peak_tflops"], rows["precision"])) == [(2, 10.0, "fp32"), (3, 100.0, "bf16")]
    assert "``precision``" in tracemagic.Trace.efficiency.__doc__  # help(trace.efficiency) names the column
    for calls, group in ((3, in_bf16), (2, [e for e in outer if e not in in_bf16])):
        row = rows[rows["calls"] == calls].iloc[0]
        assert row["gpu_us"] == pytest.approx(sum(e["dur"] for e in group))  # host time: a CPU trace


def test_on_an_unknown_device_a_layers_memory_bound_share_is_unknown(loaded: dict[str, tracemagic.Trace], tmp_path: Path) -> None:
    """Without peaks no op has a bound: a layer's memory-bound share is unknown, not 0%."""
    name = "tracelens_normalization_layer_test.json.gz"
    doc = raw_docs(name)[0]
    for props in doc["deviceProperties"]:
        props["name"], props["numSms"] = "AMD Radeon PRO W7900", 96  # in no datasheet row
    path = tmp_path / "unknown.json"
    path.write_text(json.dumps(doc))
    trace = tracemagic.load(path, cache_dir=tmp_path)
    assert trace.efficiency()["bound"].isna().all()
    layers, known = trace.layers().set_index("layer"), loaded[name].layers().set_index("layer")
    assert (layers["gpu_us"] > 0).all() and layers["memory_bound_pct"].isna().all()
    # the FLOPs need no device: the same achieved TFLOP/s as on the recognised MI300X
    pd.testing.assert_series_equal(layers["tflops_per_s"], known["tflops_per_s"])


def test_a_reduction_to_another_dtype_reduces_everything(tmp_path: Path) -> None:
    """``x.sum(dtype=...)`` records the dtype as its second argument ('7'), which is no dim."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 128)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        x.sum(dtype=torch.float64)
        x.mean(dtype=torch.float64)
        x.var(True)  # var(self, unbiased): no dim either
        x.sum(1)
    path = tmp_path / "sums.json"
    prof.export_chrome_trace(str(path))
    raw = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "cpu_op"]
    table = tracemagic.load(path, cache_dir=tmp_path).efficiency()
    for name, concrete, kept in (("aten::sum", ["", "7"], 1), ("aten::mean", ["", "7"], 1), ("aten::var", None, 1),
                                 ("aten::sum", ["", "[1]", "False", ""], 64)):
        (event,) = [e for e in raw if e["name"] == name and len(e["args"]["Input Dims"]) == (2 if concrete in (None, ["", "7"]) else 4)
                    and (concrete is None or e["args"]["Concrete Inputs"] == concrete)]
        dims, types = event["args"]["Input Dims"], event["args"]["Input type"]
        (row,) = table[(table["name"] == name) & (table["input_dims"] == json.dumps(dims)) & (table["input_type"] == json.dumps(types))].itertuples()
        # the input read, the reduced output (``kept`` elements) written, in float32
        assert (row.flops, row.bytes) == (64 * 128, (64 * 128 + kept) * 4), (name, concrete)


def test_all_gather_reduce_scatter_and_all_to_all_bandwidths_follow_nccl_tests(tmp_path: Path) -> None:
    """Four ranks; each collective ends together, rank r arrives 10·r µs late. NCCL tests'
    ``size`` (doc/PERFORMANCE.md and its *GetBw): all-gather the gathered output, reduce-scatter
    the whole input, all-to-all the whole send buffer; busbw = algbw × (n−1)/n for all three;
    the time is the transfer, without the wait for the last rank."""
    n, per_rank = 4, 1 << 20  # elements of one rank's part
    kernels = [  # (kernel, Collective name, In msg nelems, Out msg nelems, dtype, bytes per element)
        ("AllGather_RING_LL", "_allgather_base", per_rank, n * per_rank, "BFloat16", 2),
        ("ReduceScatter_Sum_bf16_RING_LL", "_reduce_scatter_base", n * per_rank, per_rank, "BFloat16", 2),
        ("SendRecv", "all_to_allv", n * per_rank, n * per_rank, "Float", 4),
    ]
    for rank in range(n):
        events: list[dict[str, Any]] = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 2000}]
        for k, (kernel, name, in_n, out_n, dtype, _) in enumerate(kernels):
            begin, end = 100.0 + 500 * k + 10 * rank, 100.0 + 500 * k + 400
            events += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": begin - 10, "dur": 5, "args": {"correlation": k + 1}},
                {"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{kernel}(ncclDevComm*, unsigned long, ncclWork*)", "pid": 0, "tid": 7,
                 "ts": begin, "dur": end - begin, "args": {"correlation": k + 1, "Collective name": name, "In msg nelems": in_n,
                                                           "Out msg nelems": out_n, "Group size": n, "dtype": dtype}},
            ]
        doc = {"distributedInfo": {"rank": rank, "world_size": n}, "traceEvents": events}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    found = tracemagic.load(tmp_path, use_cache=False).collectives()
    assert len(found) == n * len(kernels)
    for kernel, name, in_n, out_n, dtype, size in kernels:
        rows = found[found["collective"] == name]
        assert len(rows) == n, name
        message = (out_n if name == "_allgather_base" else in_n) * size
        seconds = (400.0 - 10 * (n - 1)) * 1e-6  # the last rank's duration: the transfer alone
        # rank r waited 10·(n−1−r) µs for the last rank, then moved data as long as it did
        by_rank = rows.sort_values("rank")
        assert by_rank["excess_us"].tolist() == pytest.approx([10.0 * (n - 1 - r) for r in range(n)]), name
        assert by_rank["transfer_us"].tolist() == pytest.approx([400.0 - 10 * (n - 1)] * n), name
        assert (by_rank["excess_us"] + by_rank["transfer_us"]).tolist() == pytest.approx(by_rank["dur"].tolist()), name
        assert (rows["bytes"] == message).all(), name
        assert rows["algbw_gbps"].to_numpy() == pytest.approx([message / seconds / 1e9] * n), name
        assert rows["busbw_gbps"].to_numpy() == pytest.approx([message / seconds / 1e9 * (n - 1) / n] * n), name


def test_a_collective_with_a_group_size_of_zero_gets_no_bus_bandwidth_and_no_warning(tmp_path: Path) -> None:
    """A ``Group size`` of 0 (seen when the process group is not known to the recorder)
    leaves the bus factor unknown: NaN busbw, not a division by zero."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 90, "dur": 5, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
         "pid": 0, "tid": 7, "ts": 100, "dur": 200, "args": {"correlation": 1, "Collective name": "allreduce", "In msg nelems": 1024,
                                                           "Out msg nelems": 1024, "Group size": 0, "dtype": "Float"}},
    ]  # fmt: skip
    path = tmp_path / "group0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = tracemagic.load(path, cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = trace.collectives()
    assert len(found) == 1
    row = found.iloc[0]
    assert row["bytes"] == 1024 * 4 and row["transfer_us"] == 200.0
    assert row["algbw_gbps"] == pytest.approx(1024 * 4 / 200e-6 / 1e9)
    assert math.isnan(row["busbw_gbps"])


def test_efficiency_is_computed_once_for_layers_the_roofline_and_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``layers()`` (through ``gpu_shares``), the dashboard's Roofline tab and
    ``trace.efficiency()`` share one roofline per trace (``efficiency.roofline``)."""
    import tracemagic.analysis.efficiency as module
    from tracemagic.views.data import TraceData

    made = []
    roofline = module._roofline
    monkeypatch.setattr(module, "_roofline", lambda *args: (made.append(1), roofline(*args))[1])
    trace = tracemagic.load(TRACES / "tracelens_normalization_layer_test.json.gz", cache_dir=tmp_path)
    layers = trace.layers()
    table = trace.efficiency()
    assert len(TraceData(trace).efficiency) == len(table)
    assert len(made) == 1
    assert layers["memory_bound_pct"].notna().any() and len(table) > 0


def test_no_analysis_module_imports_one_that_imports_it_back() -> None:
    """Every import of one analysis module by another (inside functions too), from the
    sources: the graph has no cycle (efficiency and layers both use the layer attribution,
    which lives below them)."""
    import ast

    package = Path(tracemagic.__file__).parent / "analysis"
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tracemagic.analysis."):
                found.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "tracemagic.analysis":
                found |= {a.name for a in node.names if (package / f"{a.name}.py").exists()}
            elif isinstance(node, ast.Import):
                found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("tracemagic.analysis.")}
        graph[path.stem] = found
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            at = todo.pop()
            if at not in seen:
                seen.add(at)
                todo.extend(graph.get(at, ()))
        assert start not in seen, f"{start} imports itself back through {sorted(seen)}"


def test_argument_positions_are_those_of_torchs_op_schemas() -> None:
    """Where ``is_causal``, the query and a conv backward's flags sit, read from torch's schemas."""
    import torch

    from tracemagic.analysis.shapes import ATTENTION

    def arguments(name: str) -> list[str]:
        return [a.name for a in getattr(torch.ops.aten, name.split("::")[1]).default._schema.arguments]

    for name, (query, causal, _) in ATTENTION.items():
        args = arguments(name)
        assert (args[query], args[causal]) == ("query", "is_causal"), name
    args = arguments("aten::convolution_backward")
    assert (args[:3], args[7], args[10]) == (["grad_output", "input", "weight"], "transposed", "output_mask")
