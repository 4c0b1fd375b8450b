"""Views: figures on their data, the dashboard's widgets and state, the text summary, the
report file. Figures are checked on hand-made tables that follow the analysis contracts
and on real traces (a CPU capture made here, GPU, multi-rank and old-format traces)."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import TRACES

import tb_reference
import tracemagic
from tracemagic.analysis.schema import TABLES
from tracemagic.views import figures, sections, tables
from tracemagic.views.dashboard import ALL_STEPS, PLOTLY_MIME, WIDGET_HINT, Dashboard
from tracemagic.views.data import ANALYSES, TraceData
from tracemagic.views.report import write_report
from tracemagic.views.text import diff_summary, render_table, summary

ROOT = Path(__file__).resolve().parents[1]
GPU = TRACES / "hta_nccl_data.json.gz"
MULTI = TRACES / "param_dlrm_kineto.tar.gz"
OLD = TRACES / "kineto_worker0.1623143089861.pt.trace.json.gz"
EVIL_SCRIPT = "<script>window.__pwned=1</script>"
EVIL_IMG = '<img src=x onerror="window.__pwned=1">'

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- hand-made tables (the analysis contracts) --------------------------------------------------
def make_steps(n: int = 3, ranks: int = 1) -> pd.DataFrame:
    rows = []
    for r in range(ranks):
        t = 0.0
        for s in range(n):
            parts = {"compute_us": 600.0 + 10 * s + 5 * r, "comm_us": 100.0, "memcpy_us": 50.0, "memset_us": 0.0,
                     "runtime_us": 20.0, "dataloader_us": 80.0, "cpu_us": 100.0, "idle_us": 50.0}
            window = sum(parts.values())
            busy = sum(parts[c] for c in ("compute_us", "comm_us", "memcpy_us", "memset_us"))
            # the host runs ahead of the GPU: its step is shorter than the device window
            rows.append({"rank": r, "step": s + 1, "ts": t, "dur": window / 2, "window_ts": t, "window_dur": window,
                         **parts, "gpu_busy_us": busy, "gpu_idle_us": window - busy})
            t += window
    return pd.DataFrame(rows)


def make_ops(names: list[str] | None = None, n_per: int = 4) -> pd.DataFrame:
    names = names or ["aten::addmm", "aten::copy_", "aten::relu"]
    rows, row = [], 0
    for s in (1, 2, 3):
        t = (s - 1) * 1000.0
        for name in names:
            for _ in range(n_per):
                rows.append({"rank": 0, "row": row, "name": name, "kind": "cpu_op", "ts": t, "dur": 20.0 + len(name),
                             "self_dur": 10.0 + len(name), "thread": "1", "step": s, "depth": 0, "layer": "model.fc1",
                             "input_dims": "[[16, 32]]", "input_type": "['float']", "seq": None, "rf_id": None,
                             "external_id": None})
                row += 1
                t += 40.0
    return pd.DataFrame(rows)


def make_kernels(n: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({
        "rank": 0, "row": np.arange(n), "name": [f"kernel_{i % 5}" for i in range(n)],
        "kind": ["memcpy" if i % 10 == 0 else "kernel" for i in range(n)], "device": 0, "stream": 7,
        "ts": np.sort(rng.uniform(0, 3000, n)), "dur": rng.uniform(1, 30, n), "step": 1, "op": "aten::addmm",
        "layer": "model.fc1", "correlation": np.arange(n), "bytes": None, "grid": "[1, 1, 1]", "block": "[128, 1, 1]",
        "is_comm": False,
    })


def make_memory(n: int = 5000) -> pd.DataFrame:
    delta = np.where(np.arange(n) % 2 == 0, 1024 * 1024, -1024 * 1024 + 1000).astype(np.int64)
    delta[n // 3] = 300 * 2**20  # the peak
    delta[n // 3 + 1] = -300 * 2**20
    allocated = np.cumsum(delta) + 2**30
    return pd.DataFrame({
        "rank": 0, "ts": np.linspace(0, 3000, n), "device": "cuda:0", "allocated_bytes": allocated,
        "reserved_bytes": allocated + 2**28, "delta_bytes": delta,
        "op": ["aten::empty"] * n, "layer": ["model.fc1"] * n, "step": np.repeat([1, 2, 3], -(-n // 3))[:n],
    }).assign(op=lambda f: f["op"].where(f.index != n // 3, "aten::bigalloc"))


def make_layers() -> pd.DataFrame:
    rows = [
        ("model", "Net", 0, "", 100.0, 10.0), ("model.enc", "Encoder", 1, "model", 60.0, 20.0),
        ("model.enc.0", "Linear", 2, "model.enc", 25.0, 25.0), ("model.enc.1", "Linear", 2, "model.enc", 15.0, 15.0),
        ("model.head", "Linear", 1, "model", 30.0, 30.0),
    ]
    return pd.DataFrame([{
        "rank": 0, "layer": l, "type": t, "depth": d, "parent": p, "calls": 3, "cpu_us": c, "self_cpu_us": sc,
        "fwd_cpu_us": c / 3, "bwd_cpu_us": 2 * c / 3, "gpu_us": c / 2, "self_gpu_us": sc / 2, "fwd_gpu_us": 0.0,
        "bwd_gpu_us": 0.0, "memory_growth_bytes": 0, "input_shapes": "[[16, 32]]",
    } for l, t, d, p, c, sc in rows])


def decoded(obj: Any) -> Any:
    """A figure dict with plotly's typed arrays ({'dtype', 'bdata'}) decoded to lists."""
    if isinstance(obj, dict):
        if "bdata" in obj and "dtype" in obj:
            return figures_decode(obj).tolist()
        return {k: decoded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [decoded(v) for v in obj]
    return obj


def as_dict(fig: Any) -> dict[str, Any]:
    """``fig.to_dict()`` (or a figure dict from a widget) with typed arrays decoded."""
    return decoded(fig.to_dict() if hasattr(fig, "to_dict") else fig)


def all_strings(obj: Any) -> list[str]:
    """Every string inside a figure dict."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in all_strings(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in all_strings(v)]
    if isinstance(obj, np.ndarray) and obj.dtype == object:
        return [s for v in obj.tolist() for s in all_strings(v)]
    return []


# -- figures on hand-made data ----------------------------------------------------------------
def test_step_breakdown_stacks_the_parts_per_step() -> None:
    steps = make_steps()
    fig = as_dict(figures.step_breakdown(steps, unit="ms"))
    nonzero = [c for c in tables.STEP_PARTS if (steps[c] > 0).any()]
    assert len(fig["data"]) == len(nonzero) and "memset" not in [t["name"] for t in fig["data"]]
    assert fig["layout"]["barmode"] == "stack"
    assert fig["layout"]["xaxis"]["title"]["text"] == "step"
    assert fig["layout"]["yaxis"]["title"]["text"] == "time (ms)"
    compute = next(t for t in fig["data"] if t["name"] == "GPU kernels")
    assert list(compute["x"]) == ["step 1", "step 2", "step 3"]
    np.testing.assert_allclose(compute["y"], steps["compute_us"] / 1000)
    # the stack adds up to the step's device window
    total = np.sum([np.asarray(t["y"], float) for t in fig["data"]], axis=0)
    np.testing.assert_allclose(total, steps["window_dur"] / 1000)
    us = as_dict(figures.step_breakdown(steps, unit="µs"))
    assert us["layout"]["yaxis"]["title"]["text"] == "time (µs)"
    np.testing.assert_allclose(us["data"][0]["y"], steps[nonzero[0]])


def test_step_breakdown_labels_ranks_and_handles_no_steps() -> None:
    fig = figures.step_breakdown(make_steps(2, ranks=2))
    assert list(fig.data[0].x) == ["r0 · step 1", "r0 · step 2", "r1 · step 1", "r1 · step 2"]
    empty = figures.step_breakdown(TABLES["steps"].empty())
    assert not empty.data and "No ProfilerStep" in empty.layout.annotations[0].text


def test_top_ops_bar_matches_the_table_and_escapes_names() -> None:
    ops = make_ops(["aten::addmm", EVIL_SCRIPT, EVIL_IMG])
    fig = figures.top_ops_bar(ops, top=2, unit="µs")
    table = tables.top_ops(ops, 2)
    (bar,) = fig.data
    np.testing.assert_allclose(bar.x, table["self_us"].to_numpy()[::-1])
    strings = all_strings(fig.to_dict())
    assert not any("<script" in s or "<img" in s for s in strings)
    assert any("&lt;script&gt;" in s for s in strings)
    assert fig.layout.xaxis.title.text == "self time (µs)"


def test_top_ops_counts_self_time_once() -> None:
    ops = make_ops()
    table = tables.top_ops(ops)
    assert table["self_us"].sum() == pytest.approx(ops["self_dur"].sum())
    assert table["self_pct"].sum() == pytest.approx(100)
    assert list(table["calls"]) == [12, 12, 12]


def test_timeline_lanes_and_downsampling() -> None:
    n = 20_000
    rng = np.random.default_rng(1)
    ts = np.sort(rng.uniform(0, 1e6, n))
    ops = pd.DataFrame({
        "rank": 0, "row": np.arange(n), "name": [f"op{i % 7}" for i in range(n)], "kind": "cpu_op", "ts": ts,
        "dur": rng.uniform(1, 40, n), "self_dur": 1.0, "thread": "11", "step": 1, "depth": 0, "layer": None,
    })
    kernels = make_kernels(200)
    steps = pd.DataFrame({"rank": [0], "step": [1], "ts": [0.0], "dur": [1e6]})
    fig = figures.timeline(ops, kernels, steps, max_events=600, bins=100, thread_names={(0, "11"): "thread 11 (main)"})
    meta = fig.layout.meta
    assert meta["total"] == n + 200 + 1
    assert meta["shown"] <= 600 + 10
    names = [t.name for t in fig.data]
    assert "aggregated" in names and "cpu_op" in names and "kernel" in names
    lanes = list(fig.layout.yaxis.categoryarray)
    assert lanes[0] == "steps" and lanes[1] == "thread 11 (main)" and lanes[-1].startswith("GPU 0 stream 7")
    # the longest events are the ones drawn
    cpu = next(t for t in fig.data if t.name == "cpu_op")
    assert min(cpu.x) * 1000 >= np.sort(ops["dur"])[-len(cpu.x)] - 1e-6
    agg = next(t for t in fig.data if t.name == "aggregated")
    assert len(agg.x) <= 2 * 100  # one bar per lane and bin at most
    # what was left out is said in the axis title (a note of its own under the axis overlapped it)
    assert fig.layout.xaxis.title.text == (f"time since window start (ms) · {meta['shown']:,} of {meta['total']:,} "
                                           "events drawn, the rest in grey bins")
    # a small window keeps only its events
    win = figures.timeline(ops, kernels, steps, window=(0.0, 1000.0))
    assert win.layout.meta["total"] < 100


def test_timeline_step_window() -> None:
    ops, steps = make_ops(), make_steps()
    steps["ts"] = [0.0, 1000.0, 2000.0]
    steps["dur"] = 1000.0
    fig = figures.timeline(ops, None, steps, step=2)
    assert fig.layout.meta["window"] == [1000.0, 2000.0]
    assert "step 2" in fig.layout.title.text
    drawn = sum(len(t.x) for t in fig.data)
    assert drawn == fig.layout.meta["shown"] == ((ops["ts"] + ops["dur"] > 1000) & (ops["ts"] < 2000)).sum() + 1


def make_spans(n_steps: int = 3, per_step: int = 4, step_us: float = 1000.0) -> pd.DataFrame:
    """``layer_spans()`` rows: per step, forward then backward spans of ``per_step`` layers."""
    rows = []
    for s in range(n_steps):
        for i in range(per_step):
            rows.append((0, f"encoder.block{i}", "Block", "forward", s * step_us + 10 + 50 * i, 40.0, s + 1, 1))
            rows.append((0, f"encoder.block{i}", "Block", "backward", s * step_us + 900 - 50 * i, 40.0, s + 1, 2))
    return pd.DataFrame(rows, columns=TABLES["layer_spans"].names)


def _layer_bars(fig: Any) -> list[dict[str, Any]]:
    return [t for t in as_dict(fig)["data"] if str(t.get("name", "")).startswith("layer ")]


def test_timeline_layers_lane_follows_window_cap_and_phase() -> None:
    ops, steps, spans = make_ops(), make_steps(), make_spans()
    steps["ts"] = [0.0, 1000.0, 2000.0]
    steps["dur"] = 1000.0
    fig = figures.timeline(ops, None, steps, spans=spans, window=(0.0, 3000.0))
    assert list(fig.layout.yaxis.categoryarray)[:2] == ["steps", "layers"]
    bars = {t["name"]: t for t in _layer_bars(fig)}
    assert set(bars) == {"layer forward", "layer backward"}
    assert bars["layer forward"]["marker"]["color"] != bars["layer backward"]["marker"]["color"]
    assert all(y == "layers" for t in bars.values() for y in t["y"])
    assert sorted(row[0] for t in bars.values() for row in t["customdata"]) == sorted(spans["layer"])
    # a step's window keeps only that step's spans
    one = figures.timeline(ops, None, steps, spans=spans, step=2)
    drawn = [row[0] for t in _layer_bars(one) for row in t["customdata"]]
    assert len(drawn) == (spans["step"] == 2).sum()
    for trace in _layer_bars(one):
        start, length = np.asarray(trace["base"], float), np.asarray(trace["x"], float)
        assert ((start + length > 0) & (start < 1.0)).all()  # ms from the window's start
    # the per-lane cap applies to the layers lane; the rest are binned in it
    many = make_spans(n_steps=1, per_step=2000, step_us=1e6)
    many["ts"] = np.arange(len(many)) * 50.0
    capped = figures.timeline(ops, None, steps, spans=many, window=(0.0, 3000.0 + 50.0 * len(many)), max_events=300)
    shown = sum(len(t["x"]) for t in _layer_bars(capped))
    assert 10 <= shown <= 300
    agg = next(t for t in as_dict(capped)["data"] if t["name"] == "aggregated")
    assert "layers" in agg["y"]
    # no spans, or none in the window: no (empty) layers lane
    for none in (None, spans.iloc[:0], spans.assign(ts=spans["ts"] + 1e7)):
        fig = figures.timeline(ops, None, steps, spans=none, window=(0.0, 3000.0))
        assert "layers" not in list(fig.layout.yaxis.categoryarray) and not _layer_bars(fig)


def test_memory_timeline_keeps_the_peak_and_names_it() -> None:
    memory, steps = make_memory(), make_steps()
    steps["ts"] = [0.0, 1000.0, 2000.0]
    top = memory.loc[[memory["allocated_bytes"].idxmax()]].rename(columns={"allocated_bytes": "peak_bytes"}).assign(step=pd.NA)
    fig = figures.memory_timeline(memory, steps, max_points=400, peaks=top)
    alloc = next(t for t in fig.data if t.name.endswith("allocated"))
    assert len(alloc.x) <= 420
    scale = 2**30  # GiB: peak > 1 GiB
    assert max(alloc.y) == pytest.approx(memory["allocated_bytes"].max() / scale)
    assert fig.layout.yaxis.title.text == "memory (GiB)"
    (note,) = [a for a in fig.layout.annotations if a.text.startswith("peak")]
    assert "aten::bigalloc" in note.text and "model.fc1" in note.text
    assert len([s for s in fig.layout.shapes if s.type == "line"]) == 3  # step boundaries
    assert any(t.name.endswith("reserved") for t in fig.data)
    one = figures.memory_timeline(memory, steps, step=2)
    assert max(next(t for t in one.data if t.name.endswith("allocated")).x) <= memory.loc[memory.step == 2, "ts"].max() / 1000


def test_layers_tree_is_a_consistent_hierarchy() -> None:
    layers = make_layers()
    fig = figures.layers_tree(layers, metric="cpu")
    (tree,) = fig.data
    assert tree.type == "icicle" and tree.branchvalues == "remainder"
    assert list(tree.ids) == list(layers["layer"])
    assert list(tree.parents) == list(layers["parent"])
    np.testing.assert_allclose(tree.values, layers["self_cpu_us"])
    # pruning keeps the ancestors of what it keeps
    small = figures.layers_tree(layers, max_nodes=1, style="sunburst").data[0]
    assert small.type == "sunburst" and set(small.ids) == {"model"}
    small2 = figures.layers_tree(layers.assign(cpu_us=[1, 2, 100, 3, 4]), max_nodes=1).data[0]
    assert set(small2.ids) == {"model", "model.enc", "model.enc.0"}


def test_kernel_rank_shapes_and_diff_figures() -> None:
    kernels = make_kernels()
    fig = figures.top_kernels_bar(kernels, top=3, unit="µs")
    table = tables.top_kernels(kernels, 3)
    np.testing.assert_allclose(fig.data[0].x, table["total_us"].to_numpy()[::-1])
    assert fig.layout.xaxis.title.text == "GPU time (µs)"
    assert len(figures.top_kernels_bar(kernels, by_op=True).data[0].y) == 5

    ranks = pd.DataFrame({"rank": [0, 1, 2], "steps": 3, "step_us": [100.0, 150.0, 110.0], "compute_us": [60.0, 60, 60],
                          "comm_us": [20.0, 70, 30], "memcpy_us": [5.0, 5, 5], "idle_us": [15.0, 15, 15],
                          "overlap_pct": 0.0, "slowest": [False, True, False]})
    fig = figures.rank_breakdown(ranks)
    assert list(fig.data[0].x) == ["rank 0", "rank 1 (straggler)", "rank 2"]
    assert any(a.text == "the others wait for it" for a in fig.layout.annotations)
    # the same parts, names and colors as the step breakdown
    assert [t.name for t in fig.data] == ["GPU kernels", "communication", "memcpy", "idle"]
    steps = make_steps(3, ranks=2)
    heat = figures.rank_step_heatmap(steps).data[0]
    assert np.asarray(heat.z).shape == (2, 3)
    np.testing.assert_allclose(np.asarray(heat.z, float).ravel(), steps.sort_values(["rank", "step"])["window_dur"] / 1000)

    shapes = pd.DataFrame({"rank": 0, "name": ["aten::mm", "aten::add"], "input_dims": ["[[2, 3], [3, 4]]", "[[4]]"],
                           "input_type": ["['float', 'float']", "['float']"], "calls": [3, 1], "total_us": [30.0, 5.0],
                           "mean_us": [10.0, 5.0], "self_us": [30.0, 5.0], "flops": [72.0, None], "tflops_per_s": [1e-6, None]})
    fig = figures.shapes_bar(shapes, unit="µs")
    np.testing.assert_allclose(fig.data[0].x, [5.0, 30.0])
    # unknown FLOPs read n/a in the hover, not 0 TFLOP/s
    bar = as_dict(fig)["data"][0]
    assert [row[4] for row in bar["customdata"]] == ["n/a", "1e-06 TFLOP/s"]
    assert "%{customdata[4]}<extra>" in bar["hovertemplate"] and "TFLOP/s<extra>" not in bar["hovertemplate"]
    no_rates = figures.shapes_bar(shapes.drop(columns=["tflops_per_s"]))
    assert {row[4] for row in as_dict(no_rates)["data"][0]["customdata"]} == {"n/a"}

    diff = pd.DataFrame({"level": ["op", "op", "op", "layer"], "name": ["a", "b", "c", "m"], "calls_a": 1, "calls_b": 1,
                         "us_a": [10.0, 50.0, None, 5.0], "us_b": [30.0, 20.0, 7.0, 5.0], "delta_us": [20.0, -30.0, 7.0, 0.0],
                         "ratio": [3.0, 0.4, None, 1.0], "status": ["slower", "faster", "added", "same"]})
    fig = figures.diff_bars(diff, level="op", top=2)
    assert sorted(t.name for t in fig.data) == ["faster", "slower"]
    assert fig.layout.xaxis.title.text == "change in time (ms)"


def test_bar_labels_are_readable_and_distinct() -> None:
    from tracemagic.views._format import kernel_label

    assert kernel_label("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
                        "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
                        200) == "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, Array<char*, 3> >"
    assert kernel_label("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)") == \
        "ncclKernel_AllReduce_RING_LL_Sum_float"
    assert kernel_label("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    # two kernels whose short labels coincide stay two bars; no other label is numbered
    kernels = make_kernels(40).assign(kind="kernel", name=[f"void ns::k<{'x' * 80}{i % 2}>(int)" for i in range(40)])
    (bar,) = figures.top_kernels_bar(kernels, top=5).data
    assert len(set(bar.y)) == len(bar.y) == 2
    assert [y.endswith(" (2)") for y in bar.y] == [True, False]  # drawn bottom-up: the heavier one is plain
    shapes = pd.DataFrame({"rank": 0, "name": ["aten::mm", "aten::add"], "input_dims": ["[[2, 3], [3, 4]]", ""],
                           "input_type": "", "calls": 1, "total_us": [30.0, 5.0]})
    assert list(figures.shapes_bar(shapes).data[0].y) == ["aten::add", "aten::mm [[2, 3], [3, 4]]"]


def _raw_kernel_names() -> set[str]:
    """Every GPU kernel name in the real traces, read from the raw JSON (tars member by member)."""
    import gzip
    import tarfile

    docs = []
    for path in sorted(TRACES.iterdir()):
        if path.name.endswith(".tar.gz"):
            with tarfile.open(path) as tar:
                docs += [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.isfile()]  # type: ignore[arg-type]
        elif path.name.endswith(".json.gz"):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                doc = json.load(fh)
            if isinstance(doc, dict):
                docs.append(doc)
    return {str(e.get("name", "")) for doc in docs for e in doc.get("traceEvents", [])
            if isinstance(e, dict) and str(e.get("cat", "")).lower() == "kernel"}


def test_no_kernel_label_is_empty_on_the_real_traces() -> None:
    from tracemagic.views._format import kernel_label

    names = _raw_kernel_names()
    anonymous = {n for n in names if "(anonymous namespace)" in n}
    assert len(names) > 100 and anonymous  # CatArrayBatchedCopy and others live in one
    assert [n for n in names if not kernel_label(n).strip()] == []
    for name in anonymous:  # the kernel's own identifier: the last one before its templates / arguments
        head = name.removeprefix("void ").replace("(anonymous namespace)::", "")
        ident = re.split(r"[<(]", head, maxsplit=1)[0].rsplit("::", 1)[-1]
        assert kernel_label(name, 200).startswith(ident), (name, kernel_label(name, 200))
    catarrays = sorted(n for n in anonymous if "CatArrayBatchedCopy" in n)
    assert catarrays and all(kernel_label(n).startswith("CatArrayBatchedCopy") for n in catarrays)


def test_layers_table_lists_parents_before_children() -> None:
    layers = pd.DataFrame({"rank": 0, "layer": ["Sequential_0", "Linear_0", "ReLU_0", "Linear_1"],
                           "parent": [None, "Sequential_0", "Sequential_0", "Sequential_0"]})
    assert list(tables.layers_table(layers)["layer"]) == ["Sequential_0", "Linear_0", "ReLU_0", "Linear_1"]
    shuffled = make_layers().iloc[[4, 2, 0, 3, 1]]  # model.head, model.enc.0, model, model.enc.1, model.enc
    assert list(tables.layers_table(shuffled)["layer"]) == ["model", "model.head", "model.enc", "model.enc.0", "model.enc.1"]


def test_cpu_only_steps_name_host_time_cpu_ops() -> None:
    steps = make_steps()
    steps[list(tables.GPU_PARTS)] = 0.0
    names = [t.name for t in figures.step_breakdown(steps).data]
    assert "CPU ops" in names and "CPU (GPU idle)" not in names
    assert "CPU (GPU idle)" in [t.name for t in figures.step_breakdown(make_steps()).data]
    shown = tables.step_table(steps).columns
    assert "cpu_us" in shown and not {*tables.GPU_PARTS, "gpu_busy_pct"} & set(shown)


# -- the text summary -----------------------------------------------------------------------
def test_render_table_fits_the_width_and_cleans_control_characters() -> None:
    lines = render_table([["x" * 300 + "\x1b[31m", "1"]], ["name", "n"], width=50)
    assert all(len(line) <= 50 for line in lines)
    assert "\x1b" not in "".join(lines)


#: invisible characters that reorder or hide terminal text (Trojan Source, CVE-2021-42574)
SPOOF = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200b\u200e\u200f\u2060\ufeff\u061c\u00ad"


def test_clean_strips_bidi_and_invisible_format_characters(tmp_path: Path) -> None:
    from tracemagic.views.text import clean

    name = "aten::mm\u202e)lanigiro(\u202c \u2066admin\u2069\u200b✓ café Ω"
    assert clean(name) == "aten::mm)lanigiro( admin✓ café Ω"  # visible text kept, non-ASCII included
    assert clean("a\u2028b\u2029c\x1b[31m") == "a?b?c?[31m"
    assert not set(clean(SPOOF)) and clean("plain") == "plain"
    lines = render_table([[f"evil{SPOOF}op", "1"]], ["name", "n"], width=60)
    assert not set("".join(lines)) & set(SPOOF) and "evilop" in lines[2]
    # end to end: a trace whose op, thread and layer names carry them
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": f"main{SPOOF}"}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "python_function", "name": "nn.Module: Lin\u202eear_0", "pid": 1, "tid": 1, "ts": 5,
         "dur": 900},
        {"ph": "X", "cat": "cpu_op", "name": f"aten::\u202emm{SPOOF}", "pid": 1, "tid": 1, "ts": 10, "dur": 800},
    ]
    path = tmp_path / "spoof_trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    text = summary(tracemagic.load(path, use_cache=False), width=120)
    assert "aten::mm" in text and not set(text) & set(SPOOF)


# -- real traces ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_capture(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A CPU capture made here with torch.profiler directly (shapes, memory, stack)."""
    import torch

    from torch.profiler import ProfilerActivity, profile, schedule

    path = tmp_path_factory.mktemp("cpu") / "cpu_trace.json"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True,
                 schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            loss = model(torch.randn(16, 32)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    return tracemagic.load(path, use_cache=False)


@pytest.fixture(scope="module")
def gpu() -> Any:
    return tracemagic.load(GPU, use_cache=False)


@pytest.fixture(scope="module")
def multi() -> Any:
    return tracemagic.load(MULTI, use_cache=False)


@pytest.fixture(scope="module")
def old() -> Any:
    return tracemagic.load(OLD, use_cache=False)


@pytest.fixture(params=["cpu_capture", "gpu", "multi", "old"])
def any_trace(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def test_timeline_layers_lane_of_a_cpu_capture(cpu_capture: Any, gpu: Any) -> None:
    data = TraceData(cpu_capture)
    spans = data.layer_spans
    assert not spans.empty and set(spans["phase"]) == {"forward", "backward"}
    section = sections.build("timeline", data)
    fig = as_dict(section.figures[0])
    lanes = fig["layout"]["yaxis"]["categoryarray"]
    assert lanes[:3] == ["steps", "phases", "layers"] and lanes[3].startswith("thread ")
    bars = _layer_bars(fig)
    names = [row[0] for t in bars for row in t["customdata"]]
    assert sorted(names) == sorted(spans["layer"])  # one bar per span, named by its layer path
    assert {t["name"] for t in bars} == {"layer forward", "layer backward"}
    lo, hi = fig["layout"]["meta"]["window"]
    origin = fig["layout"]["meta"]["origin"]
    for trace in bars:
        start = np.asarray(trace["base"], float) * 1000 + origin
        end = start + np.asarray(trace["x"], float) * 1000
        assert ((end > lo - 1e-6) & (start < hi + 1e-6)).all()
    # the step selector and a zoom redraw keep the spans of their window only
    step = int(data.steps["step"].iloc[1])
    row = data.steps.set_index("step").loc[step]
    one = as_dict(sections.build("timeline", data, sections.ViewState(step=step)).figures[0])
    assert sorted(row[0] for t in _layer_bars(one) for row in t["customdata"]) == sorted(
        spans.loc[(spans["ts"] + spans["dur"] > row["ts"]) & (spans["ts"] < row["ts"] + row["dur"]), "layer"])
    first = spans.iloc[0]
    zoomed = as_dict(section.rebuild[0]((float(first["ts"]), float(first["ts"] + first["dur"] / 2))))
    assert [row[0] for t in _layer_bars(zoomed) for row in t["customdata"]] == [first["layer"]]
    # a trace without module events has no (empty) layers lane
    assert TraceData(gpu).layer_spans.empty
    plain = as_dict(sections.build("timeline", TraceData(gpu)).figures[0])
    assert "layers" not in plain["layout"]["yaxis"]["categoryarray"] and not _layer_bars(plain)


def test_dashboard_tabs_follow_the_trace(cpu_capture: Any, gpu: Any, multi: Any, old: Any) -> None:
    base = ["overview", "layers", "timeline", "memory", "shapes"]
    assert Dashboard(cpu_capture).keys == [*base, "flame"]
    assert Dashboard(gpu).keys == [*base, "roofline", "kernels", "flame"]
    assert Dashboard(old).keys == [*base, "roofline", "kernels", "flame"]
    assert Dashboard(multi).keys == [*base, "roofline", "kernels", "flame", "ranks"]
    assert Dashboard(gpu, other=old).keys == [*base, "roofline", "kernels", "flame", "compare"]
    dash = Dashboard(multi)
    assert dash.widget.children[-1].titles == ("Overview", "Layers", "Timeline", "Memory", "Shapes", "Roofline", "Kernels",
                                               "Flame", "Ranks")


def test_every_tab_renders_figures_and_a_table(any_trace: Any) -> None:
    dash = Dashboard(any_trace)
    dash.render_all()
    for key in dash.keys:
        figs = dash.figures(key)
        assert figs, key
        for fig in figs:
            assert "data" in fig and "layout" in fig
        assert "<table" in dash.table(key).html.value or "no rows" in dash.table(key).html.value
    assert dash.figures("overview")[0]["layout"]["title"]["text"] in ("Step time breakdown",)


def test_overview_figure_values_equal_the_steps_table(any_trace: Any) -> None:
    dash = Dashboard(any_trace)
    steps = any_trace.steps().sort_values(["rank", "step"])
    fig = dash.figures("overview")[0]
    if steps.empty:
        assert not fig["data"]
        return
    y = {t["name"]: np.asarray(t["y"], float) for t in as_dict(fig)["data"]}
    np.testing.assert_allclose(y["GPU kernels"] if "GPU kernels" in y else y[next(iter(y))],
                               steps["compute_us" if "GPU kernels" in y else _col(next(iter(y)), steps)].to_numpy() / 1000)
    np.testing.assert_allclose(np.sum(list(y.values()), axis=0), steps["window_dur"].to_numpy() / 1000, rtol=1e-6, atol=1e-6)


def _col(name: str, steps: pd.DataFrame) -> str:
    return {v: k for k, v in tables.part_names(steps).items()}[name]


def figures_decode(values: Any) -> Any:
    """Plotly JSON may carry typed arrays as {'dtype', 'bdata'}; decode them."""
    if isinstance(values, dict) and "bdata" in values:
        import base64

        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"]))
    return values


def test_step_selector_changes_timeline_memory_and_overview(gpu: Any) -> None:
    dash = Dashboard(gpu)
    steps = gpu.steps()
    step = int(steps["step"].iloc[1])
    assert [v for _, v in dash.controls["step"].options] == [ALL_STEPS, *sorted(steps["step"])]
    assert dash.controls["step"].value == ALL_STEPS  # "all steps" shows (ipywidgets 8 blanks a None value)
    dash.select("timeline")
    before = dash.figures("timeline")[0]["layout"]["meta"]["window"]
    dash.controls["step"].value = step
    after = dash.figures("timeline")[0]["layout"]["meta"]["window"]
    row = steps[steps["step"] == step].iloc[0]
    assert after == pytest.approx([row["ts"], row["ts"] + row["dur"]])
    assert after != before
    assert f"step {step}" in dash.figures("timeline")[0]["layout"]["title"]["text"]
    assert f"step {step}" in dash.figures("memory")[0]["layout"]["title"]["text"]
    overview = dash.figures("overview")
    assert overview[0]["data"][0]["marker"]["opacity"].count(1.0) == 1
    # a GPU trace's top list is its kernels by GPU time, in the step chosen
    assert overview[2]["layout"]["title"]["text"] == "Top 15 kernels by GPU time"
    kernels = gpu.kernels()
    in_step = kernels[kernels["step"] == step].groupby("name", observed=True)["dur"].sum().nlargest(15)
    np.testing.assert_allclose(sorted(as_dict(overview[2])["data"][0]["x"]), sorted(in_step / 1000))


def test_units_and_top_n_controls(gpu: Any) -> None:
    dash = Dashboard(gpu)
    dash.controls["top"].value = 5
    assert len(as_dict(dash.figures("overview")[2])["data"][0]["y"]) == 5
    dash.controls["unit"].value = "µs"
    fig = dash.figures("overview")[0]
    assert fig["layout"]["yaxis"]["title"]["text"] == "time (µs)"
    assert "dur_us" in dash.table("overview").frame.columns


def test_table_view_filters_sorts_and_pages(gpu: Any) -> None:
    dash = Dashboard(gpu)
    table = dash.table("timeline")  # ops aggregated by name
    total = len(table.frame)
    assert total > 25 and table.pages == -(-total // 25)
    assert table.html.value.count("<tr>") == 25 + 1
    table.next.click()
    assert table.page == 1 and "page 2/" in table.status.value
    table.filter.value = "aten::copy_"
    assert table.page == 0 and set(table.view()["name"]) == {"aten::copy_"}
    table.filter.value = ""
    table.sort.value = "calls"
    table.descending.value = True
    calls = table.view()["calls"].to_list()
    assert calls == sorted(calls, reverse=True) and table.descending.description == "desc"
    table.descending.value = False
    assert table.view()["calls"].to_list() == sorted(calls)
    assert table.descending.description == "asc"  # off, it sorts ascending: the toggle says so


def test_only_the_reports_table_headers_look_clickable(gpu: Any, tmp_path: Path) -> None:
    """The report sorts on a header click (its script); the dashboard's tables sort with their
    own controls, so their headers must not show a pointer that promises a click."""
    import re

    from tracemagic.views import html

    def header_rules(css: str) -> list[str]:
        return [rule for rule in re.findall(r"([^{}]+)\{([^}]*)\}", css) if re.search(r"\.tm-table th\b", rule[0])]

    widget_css = html.style()
    assert header_rules(widget_css) and not any("cursor:pointer" in body for _, body in header_rules(widget_css))
    page = gpu.report(tmp_path / "r.html").read_text()
    styles = "".join(re.findall(r"<style>(.*?)</style>", page, flags=re.S))
    assert any("cursor:pointer" in body for _, body in header_rules(styles))


def test_mimebundle_carries_widget_and_text(gpu: Any) -> None:
    dash = Dashboard(gpu, force_widget=True)
    bundle = dash._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "application/vnd.jupyter.widget-view+json"}
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.widget.model_id
    # a saved notebook shows the text until the cell runs again: it says so
    assert bundle["text/plain"] == f"{summary(gpu)}\n\n{WIDGET_HINT}"
    # outside a kernel (terminal IPython, this test) only the text is sent, no widget is built
    plain = Dashboard(gpu)
    assert set(plain._repr_mimebundle_()) == {"text/plain"} and plain._widget is None
    assert plain._repr_mimebundle_()["text/plain"] == summary(gpu)  # no widget: nothing to run again for


def test_figures_in_outputs_use_plotly_mime(gpu: Any) -> None:
    dash = Dashboard(gpu)
    out = dash._tabs["overview"]["figures"][0] if dash.widget else None
    (entry,) = out.outputs
    assert entry["output_type"] == "display_data" and PLOTLY_MIME in entry["data"]
    assert entry["data"][PLOTLY_MIME]["config"]["displaylogo"] is False


def test_payload_stays_small(gpu: Any) -> None:
    dash = Dashboard(gpu)
    dash.render_all()
    assert dash.widget_state_bytes() < 3 * 2**20
    assert len(json.dumps(dash.figures("timeline")[0])) < 1.5 * 2**20


def test_compare_tab(gpu: Any, old: Any) -> None:
    dash = Dashboard(gpu, other=old)
    figs = dash.figures("compare")
    assert len(figs) == 2
    info = dash.info_html("compare")
    assert "hta_nccl_data.json.gz" in info and "kineto_worker0" in info
    from tracemagic.views._format import header

    # every time of the table in the unit chosen (A, B and the change alike): B - A is the change
    for unit in ("ms", "µs"):
        dash.controls["unit"].value = unit
        table = dash.table("compare").frame
        headers = [header(c) for c in table.columns]
        assert {"A", "B", "Change", "GPU A", "GPU B"} <= {h.split(" (")[0] for h in headers if h.endswith(f"({unit})")}
        assert not [h for h in headers if h.endswith(("(µs)", "(ms)")) and not h.endswith(f"({unit})")], headers
        both = table.dropna(subset=[table.columns[headers.index(f"{x} ({unit})")] for x in "AB"])
        a, b, change = (both[both.columns[headers.index(f"{x} ({unit})")]] for x in ("A", "B", "Change"))
        assert len(both) and ((b - a - change).abs() <= 1e-6 * (a.abs() + b.abs() + 1)).all()
    text = diff_summary(gpu, old, width=90)
    assert text.splitlines()[0].startswith("tracemagic diff")
    assert all(len(line) <= 90 for line in text.splitlines())


def test_two_cpu_traces_compare_without_gpu_columns(cpu_capture: Any, gpu: Any, old: Any) -> None:
    """Two CPU traces have no GPU time: their Compare table shows no columns of zeros for it."""
    from tracemagic.views._format import header

    def time_headers(dash: Dashboard) -> set[str]:
        return {header(c).split(" (")[0] for c in dash.table("compare").frame.columns}

    assert not {"GPU A", "GPU B"} & time_headers(Dashboard(cpu_capture, other=cpu_capture))
    assert {"GPU A", "GPU B"} <= time_headers(Dashboard(gpu, other=old))  # one GPU trace: kept


def test_summary_text(any_trace: Any) -> None:
    text = summary(any_trace, width=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert lines[0].startswith("tracemagic · ")
    assert "Top ops (by self CPU time)" in text
    if not any_trace.steps().empty:
        assert "Steps (share of each step" in text and "mean step" in text


def test_summary_of_a_gpu_trace_names_its_top_ops_and_kernels(gpu: Any) -> None:
    text = summary(gpu, width=120)
    top = tables.top_ops(gpu.ops(), 1)["name"].iloc[0]
    assert top in text and "Top kernels" in text and "A100" in text


def test_recommendations_from_numbers() -> None:
    from tracemagic.views.insights import recommendations

    steps = make_steps()
    steps["dataloader_us"] = steps["window_dur"] * 0.3
    steps["idle_us"] = steps["window_dur"] * 0.2
    ops = make_ops(["aten::copy_", "aten::relu"])
    ops.loc[ops["name"] == "aten::copy_", "self_dur"] = 1000.0
    tips = recommendations(steps, ops, make_kernels(), None)
    assert any(t.startswith("DataLoader takes") for t in tips)
    assert any(t.startswith("aten::copy_ is") and "of CPU time" in t for t in tips)
    ranks = pd.DataFrame({"rank": [0, 1, 2], "step_us": [100.0, 140.0, 100.0]})
    assert any(t.startswith("Rank 1 is 40% slower") for t in recommendations(steps, ops, None, None, ranks))
    # with collective waits, the straggler is the rank the others wait for, not the longest step
    ranks = pd.DataFrame({"rank": [0, 1, 2], "step_us": [100.0, 140.0, 90.0], "wait_us": [20.0, 50.0, 2.0],
                          "slowest": [False, False, True]})
    (late,) = [t for t in recommendations(steps, ops, None, None, ranks) if t.startswith("Rank")]
    assert late.startswith("Rank 2 is the straggler")
    # the others' median wait 35 µs against its 2 µs: 33 µs of the 100 µs median step
    assert "(35 µs per step for the median rank, 2 µs for rank 2, 33% of the median step)" in late
    # a GPU idle most of the step is reported with its share
    idle = make_steps()
    idle[["compute_us", "comm_us", "memcpy_us", "gpu_busy_us"]] = 0.0
    idle["cpu_us"] = idle["window_dur"] - idle[[c for c in tables.STEP_PARTS if c != "cpu_us"]].sum(axis=1)
    idle["gpu_idle_us"] = idle["window_dur"]
    assert any(t.startswith("GPU idle 100% of the step") for t in recommendations(idle, ops, make_kernels(), None))


def test_failed_analysis_leaves_an_empty_view(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(trace: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setitem(ANALYSES, "memory", fail)
    dash = Dashboard(gpu)
    dash.render_all()
    assert "memory" in dash.data.problems and "boom" in dash.data.problems["memory"]
    assert "No memory events" in json.dumps(dash.figures("memory")[0])
    assert "boom" in dash.text()


# -- escaping (XSS) ----------------------------------------------------------------------------
def evil_trace_file(folder: Path) -> Path:
    """A small Kineto trace whose op, kernel and thread names are HTML/JS payloads."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": EVIL_IMG}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1, "tid": 1, "ts": 1000, "dur": 1000},
    ]
    t = 10
    for step in (0, 1000):
        for i, name in enumerate([EVIL_SCRIPT, EVIL_IMG, "aten::mm"]):
            events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": step + t + 200 * i, "dur": 150,
                           "args": {"Input Dims": [[2, 3]], "Input type": [EVIL_SCRIPT], "External id": step + i}})
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": step + t + 200 * i + 10, "dur": 5, "args": {"correlation": step + i + 1}})
            events.append({"ph": "X", "cat": "kernel", "name": f"{name}_kernel", "pid": 0, "tid": 7,
                           "ts": step + t + 200 * i + 20, "dur": 50,
                           "args": {"device": 0, "stream": 7, "correlation": step + i + 1, "External id": step + i}})
            events.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1,
                           "ts": step + t + 200 * i + 1, "args": {"Device Type": 1, "Device Id": 0, "Bytes": 4096 * (i + 1),
                                                                  "Total Allocated": 4096 * (i + 2), "Total Reserved": 2**20,
                                                                  "Addr": 1234 + i}})
    for step in (0, 1000):  # a layer whose name is markup, around the step's ops
        events.append({"ph": "X", "cat": "python_function", "name": f"nn.Module: {EVIL_IMG}_0", "pid": 1, "tid": 1,
                       "ts": step + 5, "dur": 700})
    path = folder / "evil_trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": EVIL_SCRIPT}],
                                "traceEvents": events}))
    evil_et_file(folder / "evil_et.json")
    return path


def evil_et_file(path: Path) -> Path:
    """An Execution Trace (schema 1.0.1) beside the evil trace: op names, schemas and types are markup."""
    def node(id_: int, name: str, parent: int, rf_id: int, schema: str = "", ins: list[Any] | None = None,
             outs: list[Any] | None = None) -> dict[str, Any]:
        return {"name": name, "id": id_, "rf_id": rf_id, "parent": parent, "fw_parent": 0, "seq_id": -1, "scope": 0,
                "tid": 1, "fw_tid": 0, "op_schema": schema, "inputs": ins or [], "input_shapes": [[2, 3]] if ins else [],
                "input_types": [f"Tensor({EVIL_SCRIPT})"] if ins else [], "outputs": outs or [],
                "output_shapes": [[2, 3]] if outs else [], "output_types": ["Tensor(float)"] if outs else []}

    tensor = [10, 11, 0, 6, 4, "cpu"]
    nodes = [
        node(1, "[pytorch|profiler|execution_trace|process]", 1, 0),
        node(2, "[pytorch|profiler|execution_trace|thread]", 1, 0),
        node(3, "ProfilerStep#1", 2, 0),
        node(4, EVIL_SCRIPT, 3, 1, f"{EVIL_SCRIPT}(Tensor x) -> Tensor", outs=[tensor]),
        node(5, EVIL_IMG, 3, 2, f"{EVIL_IMG}(Tensor x) -> Tensor", ins=[tensor], outs=[[12, 13, 0, 6, 4, "cpu"]]),
    ]
    path.write_text(json.dumps({"schema": "1.0.1", "pid": 1, "time": "2026-01-01 00:00:00", "start_ts": 0,
                                "finish_ts": 1, "nodes": nodes}))
    return path


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tracemagic.load(evil_trace_file(tmp_path_factory.mktemp("evil")), use_cache=False)


RAW = re.compile(r"<\s*(script|img)", re.I)


def test_dashboard_escapes_every_trace_string(evil: Any) -> None:
    dash = Dashboard(evil, other=evil, interactive=True)
    assert "graph" in dash.keys and not evil.layers().empty  # the ET graph and the layer tree are covered
    dash.render_all()
    assert any("&lt;img" in row[0] for t in dash.figures("graph")[0]["data"] if "customdata" in t
               for row in t["customdata"] if isinstance(row, list))
    assert "&lt;img" in dash._tabs["layers"]["side"].value
    zoom = dash.zoomable("timeline")
    zoom.set_range(0.0, 0.5)  # a redrawn window is escaped too
    assert zoom.redraws == 1
    htmls = [w.value for w in _walk(dash.widget) if hasattr(w, "value") and isinstance(w.value, str)]
    assert any("&lt;script&gt;" in h for h in htmls)  # the names are shown, escaped
    for value in htmls:
        assert not re.search(r"<script>window|<img src=x", value), value[:200]
    for key in dash.keys:
        for fig in dash.figures(key):
            assert not any(RAW.search(s) for s in all_strings(fig)), key


def _walk(widget: Any) -> list[Any]:
    out = [widget]
    for child in getattr(widget, "children", ()) or ():
        out += _walk(child)
    return out


def test_report_escapes_every_trace_string(evil: Any, tmp_path: Path) -> None:
    path = write_report(evil, tmp_path / "evil.html")
    text = path.read_text()
    assert "window.__pwned" in text  # the names are in the file...
    assert EVIL_SCRIPT not in text and EVIL_IMG not in text  # ...but never as markup
    assert not re.search(r"<script>window|<img src=x", text)


# -- the report file ---------------------------------------------------------------------------
def test_the_partial_plotlyjs_is_the_version_plotly_writes_figures_for() -> None:
    """The report's partial plotly.js must be the plotly.js of the plotly that
    ``constraints.txt`` pins (else every report falls back to the 4 MB full bundle, a slower
    first paint); under any other plotly (the lower-bounds venv) the report must not use it
    and inline that plotly's full bundle instead."""
    import importlib.metadata

    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    from tracemagic.views import report

    pinned = re.search(r"^plotly==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    bundle = report.PARTIAL_PLOTLYJS.read_text(encoding="utf-8")
    types = set(report.PARTIAL_TRACES)
    if importlib.metadata.version("plotly") == pinned.group(1):
        assert bundle.startswith(f"/*! plotly.js v{get_plotlyjs_version()} "), (
            f"{report.PARTIAL_PLOTLYJS.name} is not plotly.js {get_plotlyjs_version()}: "
            "run bash scripts/build_plotly_bundle.sh")
        assert report.plotly_js(types) == bundle
    else:
        same = bundle.startswith(f"/*! plotly.js v{get_plotlyjs_version()} ")
        assert report.plotly_js(types) == (bundle if same else get_plotlyjs())


def test_write_report_is_self_contained_and_atomic(gpu: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "sub" / "gpu.html"
    written = write_report(gpu, out)
    assert written == out.absolute() and out.is_file()
    text = out.read_text()
    assert text.count("plotly.js v") <= 2 and "Plotly.newPlot" in text  # plotly.js inlined once
    assert not re.search(r"<script[^>]+src=", text)  # (plotly.js mentions its CDN in a string it never fetches)
    assert "<link" not in text
    for key in sections.available(TraceData(gpu)):
        assert f'id="tab-{key}"' in text
    assert [p.name for p in out.parent.iterdir()] == ["gpu.html"]  # no temporary file left
    # a failed write leaves the old file intact
    before = out.read_bytes()
    import tracemagic.views.report as report

    def fail(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_report(gpu, out)
    assert out.read_bytes() == before
    assert [p.name for p in out.parent.iterdir()] == ["gpu.html"]


def test_dashboard_save_button_writes_the_report(gpu: Any, tmp_path: Path) -> None:
    dash = Dashboard(gpu)
    dash.controls["report_path"].value = str(tmp_path / "saved.html")
    seen = []
    dash.on_saved = seen.append
    dash.controls["save"].click()
    assert (tmp_path / "saved.html").is_file() and seen == [tmp_path / "saved.html"]
    assert "saved" in dash.save_status.value
    dash.controls["report_path"].value = str(tmp_path / "no" / "\0bad.html")
    dash.controls["save"].click()
    assert "could not save" in dash.save_status.value
    # a folder (an emptied name box is the current one): said so, with what to type instead
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    dash.controls["report_path"].value = str(tmp_path)
    dash.controls["save"].click()
    assert "could not save" in dash.save_status.value and "is a folder: give the report a file name" in dash.save_status.value
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before


def test_views_do_not_read_files() -> None:
    """Views take tables, never trace files: no JSON parsing or opening of paths in them."""
    folder = Path(sections.__file__).parent
    for source in folder.glob("*.py"):
        text = source.read_text()
        assert "json.load(" not in text and "open(" not in text.replace("fdopen(", ""), source.name
        assert "tracemagic.trace." not in text.replace("from tracemagic.trace import TraceTables", ""), source.name


# -- the Timeline's zoom: re-sampled to the visible range ---------------------------------------
def write_big_trace(path: Path, events: int, steps: int = 10) -> Path:
    """A Kineto-format trace of ``events`` short CPU ops on two threads in ``steps`` steps."""
    per = events // steps
    parts, ts = [], 0
    for s in range(steps):
        parts.append('{"ph":"X","cat":"user_annotation","name":"ProfilerStep#%d","pid":1,"tid":1,"ts":%d,"dur":%d}'
                     % (s, ts, 2 * per))
        parts.extend(
            '{"ph":"X","cat":"cpu_op","name":"aten::op%d","pid":1,"tid":%d,"ts":%d,"dur":%d}'
            % (i % 17, 1 + i % 2, ts + 1 + 2 * (i // 2) * 2, 1 + (i % 5 == 0))
            for i in range(per)
        )
        ts += 2 * per + 10
    path.write_text('{"schemaVersion":1,"traceEvents":[' + ",".join(parts) + "]}")
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A trace of a million events, loaded with the public loader."""
    path = write_big_trace(tmp_path_factory.mktemp("big") / "big_trace.json", 1_000_000)
    return tracemagic.load(path, use_cache=False)


def _drawn(widget: Any) -> list[Any]:
    return [t for t in widget.data if t.name not in ("extent", "aggregated")]


@pytest.mark.slow
def test_timeline_zoom_redraws_the_visible_window_of_a_million_events(big: Any) -> None:
    from tracemagic.views.sections import TIMELINE_MAX_EVENTS
    from tracemagic.views.zoom import ZoomableFigure

    assert len(big.events) > 1_000_000
    dash = Dashboard(big, interactive=True)
    zoom = dash.zoomable("timeline")
    assert isinstance(zoom, ZoomableFigure) and type(zoom.widget).__name__ == "FigureWidget"
    assert zoom.widget in _walk(dash.widget)  # the FigureWidget is what the tab shows
    meta = zoom.widget.layout.meta
    assert meta["total"] == len(big.events) and meta["shown"] <= TIMELINE_MAX_EVENTS + 10
    before = [list(t.base) for t in _drawn(zoom.widget)]
    # zoom to 1 ms (x is in ms since the base window's start): every event of it is drawn
    zoom.set_range(100.0, 101.0)
    lo, hi = zoom.origin + 100_000.0, zoom.origin + 101_000.0
    meta = zoom.widget.layout.meta
    assert meta["window"] == pytest.approx([lo, hi]) and zoom.window == pytest.approx((lo, hi))
    assert zoom.redraws == 1
    ops = big.ops()
    inside = ((ops["ts"] + ops["dur"] > lo) & (ops["ts"] < hi)).sum()
    assert meta["total"] == inside and meta["shown"] == inside <= TIMELINE_MAX_EVENTS
    drawn = _drawn(zoom.widget)
    assert [list(t.base) for t in drawn] != before
    assert sum(len(t.x) for t in drawn) == inside
    for trace in drawn:  # every bar drawn overlaps the visible range (x in ms from the origin)
        start, length = np.asarray(trace.base, float), np.asarray(trace.x, float)
        assert ((start + length >= 100.0 - 1e-9) & (start <= 101.0 + 1e-9)).all()
    assert not next(t for t in zoom.widget.data if t.name == "aggregated").x  # nothing to aggregate here
    # a wide window stays under the cap, the rest aggregated
    zoom.set_range(0.0, 1000.0)
    meta = zoom.widget.layout.meta
    assert meta["total"] > 400_000 and meta["shown"] <= TIMELINE_MAX_EVENTS + 10
    assert sum(len(t.x) for t in _drawn(zoom.widget)) == meta["shown"]
    assert len(next(t for t in zoom.widget.data if t.name == "aggregated").x) > 0
    # the same range again (the frontend echoing it) draws nothing new
    zoom.set_range(0.0, 1000.0)
    assert zoom.redraws == 2
    # the payload of the widget stays small at every zoom
    assert len(json.dumps(dash.figures("timeline")[0])) < 1.5 * 2**20


def test_zoom_is_debounced_in_an_event_loop(gpu: Any) -> None:
    import asyncio

    from tracemagic.views.zoom import ZoomableFigure

    fig = sections.build("timeline", TraceData(gpu))
    calls = []

    def rebuild(window: tuple[float, float]) -> Any:
        calls.append(window)
        return fig.rebuild[0](window)

    async def scroll() -> ZoomableFigure:
        zoom = ZoomableFigure(fig.figures[0], rebuild, unit_divisor=1000.0, debounce_s=0.05)
        for end in (50.0, 40.0, 30.0, 20.0):  # a burst of scroll-zoom events
            zoom.set_range(10.0, end)
        assert calls == []  # nothing drawn yet
        await asyncio.sleep(0.2)
        return zoom

    zoom = asyncio.run(scroll())
    assert len(calls) == 1 and zoom.redraws == 1
    assert calls[0] == pytest.approx((zoom.origin + 10_000.0, zoom.origin + 20_000.0))
    # an invisible 'extent' trace spans the base window, so double-click (autorange) returns to it
    extent = next(t for t in zoom.widget.data if t.name == "extent")
    assert list(extent.x) == pytest.approx([(b - zoom.origin) / 1000.0 for b in zoom.base])


def test_timeline_step_change_reuses_the_widget_and_static_fallback(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    dash = Dashboard(gpu, interactive=True)
    zoom = dash.zoomable("timeline")
    zoom.set_range(0.0, 1.0)
    step = int(gpu.steps()["step"].iloc[1])
    dash.controls["step"].value = step
    again = dash.zoomable("timeline")
    assert again is zoom and zoom.redraws == 1  # one FigureWidget per tab, new content
    row = gpu.steps().set_index("step").loc[step]
    assert zoom.base == pytest.approx((row["ts"], row["ts"] + row["dur"])) == tuple(zoom.widget.layout.meta["window"])
    assert zoom.widget.layout.xaxis.autorange is True and f"step {step}" in zoom.widget.layout.title.text
    # without anywidget (or switched off) the Timeline is the static Output figure
    static = Dashboard(gpu, interactive=False)
    assert static.zoomable("timeline") is None
    (out,) = static._tabs["timeline"]["figures"]
    assert PLOTLY_MIME in out.outputs[0]["data"]
    monkeypatch.setenv("TRACEMAGIC_FIGUREWIDGET", "0")
    assert Dashboard(gpu).zoomable("timeline") is None


def test_timeline_starts_static_and_its_toggle_makes_it_zoomable(gpu: Any) -> None:
    """By default the Timeline is plotly's mime figure, like every tab: building it must not
    start a FigureWidget, whose first start in a kernel imports nbformat -> jsonschema ->
    rfc3987_syntax (seconds of grammar building) and sends plotly.js again. Checked in a
    fresh interpreter by what got imported, not by timing. The "detail on zoom" toggle
    swaps in the zoomable FigureWidget, and back."""
    code = """
import sys, warnings
warnings.simplefilter("ignore")
import tracemagic
from tracemagic.views.dashboard import Dashboard, PLOTLY_MIME
dash = Dashboard(tracemagic.load(sys.argv[1], use_cache=False), force_widget=True)
dash.select("timeline")
(out,) = dash._tabs["timeline"]["figures"]
assert PLOTLY_MIME in out.outputs[0]["data"] and dash.zoomable("timeline") is None
assert dash._tabs["timeline"]["zoom"] in dash._tabs["timeline"]["box"].children
heavy = sorted(m for m in ("plotly.basewidget", "anywidget", "nbformat", "jsonschema") if m in sys.modules)
assert not heavy, heavy
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACEMAGIC_FIGUREWIDGET": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(TRACES / "hta_nccl_data.json.gz")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

    dash = Dashboard(gpu)
    if not dash.zoom_available:
        pytest.skip("anywidget is not installed: no toggle")
    dash.select("timeline")
    toggle = dash._tabs["timeline"]["zoom"]
    assert toggle.value is False and dash.zoomable("timeline") is None
    static = dash.figures("timeline")[0]
    toggle.value = True
    zoom = dash.zoomable("timeline")
    assert zoom is not None and type(zoom.widget).__name__ == "FigureWidget"
    assert zoom.widget in _walk(dash._tabs["timeline"]["box"])
    assert [t["name"] for t in dash.figures("timeline")[0]["data"] if t["name"] != "extent"] == [t["name"] for t in static["data"]]
    toggle.value = False
    assert dash.zoomable("timeline") is None and PLOTLY_MIME in dash._tabs["timeline"]["figures"][0].outputs[0]["data"]
    assert Dashboard(gpu, interactive=False).zoom_available is False  # no toggle at all


def test_every_tab_keeps_a_plotly_figure_per_slot(gpu: Any) -> None:
    """Every figure reaches the page as a plotly figure (a FigureWidget or plotly's mime
    bundle), so each renders a .js-plotly-plot element in JupyterLab."""
    dash = Dashboard(gpu, interactive=True)
    dash.render_all()
    for key in dash.keys:
        for slot in dash._tabs[key]["figures"]:
            widget = getattr(slot, "widget", slot)
            assert type(widget).__name__ == "FigureWidget" or PLOTLY_MIME in widget.outputs[0]["data"], key


# -- the Graph tab (Execution Trace op graph) ---------------------------------------------------
HTA_PAIR = (TRACES / "hta_benchmark_simple_add_trace.json.gz", TRACES / "hta_benchmark_simple_add_et.json.gz")


def make_graph(n: int = 6) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A diamond a -> (b, c) -> d plus a chain d -> e -> f ..."""
    nodes = pd.DataFrame({
        "id": np.arange(1, n + 1) * 10, "name": [f"aten::op{i}" for i in range(n)], "op_schema": "aten::op(Tensor x) -> Tensor",
        "parent": 1, "depth": 0, "step": 3, "rf_id": np.arange(n), "input_shapes": "[[2,3]]", "input_types": '["Tensor(float)"]',
        "output_shapes": "[[2,3]]", "output_types": '["Tensor(float)"]', "row": np.arange(n), "ts": 0.0,
        "dur": [float(10 * (i + 1)) for i in range(n - 1)] + [np.nan], "self_dur": 1.0,
    })
    pairs = [(10, 20), (10, 30), (20, 40), (30, 40)] + [(10 * i, 10 * (i + 1)) for i in range(4, n)]
    edges = pd.DataFrame({"src": [a for a, _ in pairs], "dst": [b for _, b in pairs], "tensor": "1:1", "bytes": 24})
    return nodes, edges


def test_op_graph_layers_by_topological_depth_and_caps_nodes() -> None:
    nodes, edges = make_graph(6)
    fig = figures.op_graph(nodes, edges, step=3, unit="µs")
    meta = fig.layout.meta
    assert meta == {"shown": 6, "total": 6, "edges": 6, "levels": 5}
    timed = next(t for t in fig.data if t.name == "ops")
    untimed = next(t for t in fig.data if t.name == "ops without timing")
    assert list(timed.x) == [0, 1, 1, 2, 3] and list(untimed.x) == [4]  # a, (b c), d, e, f
    assert sorted(timed.y[1:3]) == [-0.5, 0.5]  # b and c side by side
    np.testing.assert_allclose(timed.marker.color, [10, 20, 30, 40, 50])  # µs
    lines = next(t for t in fig.data if t.name == "dependencies")
    assert sum(v is None for v in lines.x) == 6
    assert "op_schema" not in timed.hovertemplate and "aten::op(Tensor x) -&gt; Tensor" in timed.customdata[0][1]
    assert "step 3" in fig.layout.title.text
    capped = figures.op_graph(*make_graph(30), max_nodes=10)
    assert capped.layout.meta["shown"] == 10 and capped.layout.meta["total"] == 30
    assert capped.layout.meta["edges"] == 10  # only edges between drawn ops
    assert any("first 10 of 30 ops" in a.text for a in capped.layout.annotations)
    assert "no operators" in figures.op_graph(nodes.iloc[:0], edges.iloc[:0]).layout.annotations[0].text.lower()


def test_graph_tab_on_the_hta_et_pair(tmp_path: Path) -> None:
    from tracemagic.et import et_graph

    for source, name in zip(HTA_PAIR, ("simple_add_trace.json.gz", "simple_add_et.json.gz")):
        (tmp_path / name).write_bytes(source.read_bytes())
    trace = tracemagic.load(tmp_path / "simple_add_trace.json.gz", use_cache=False)
    dash = Dashboard(trace)
    assert dash.keys[-1] == "graph"
    nodes, edges = et_graph(trace)
    (fig,) = dash.figures("graph")
    assert fig["layout"]["meta"] == {"shown": len(nodes), "total": len(nodes), "edges": len(edges),
                                     "levels": fig["layout"]["meta"]["levels"]}
    names = [row[0] for t in as_dict(fig)["data"] if t.get("name", "").startswith("ops") for row in t["customdata"]]
    assert sorted(names) == sorted(nodes["name"])
    table = dash.table("graph").frame
    assert len(table) == len(nodes) and {"op_schema", "input_shapes", "dur_ms", "reads_from", "feeds"} <= set(table.columns)
    assert table["reads_from"].sum() == len(edges)
    # the dtypes as the other tables show them, not JSON lists
    for column in ("input_types", "output_types"):
        assert not table[column].astype(str).str.startswith("[").any(), table[column].head()
    assert "Tensor(float)" in set(table["output_types"])
    assert "timed by Kineto" in dash.info_html("graph")
    # the traces folder's lone ET is not taken for every trace beside it
    assert "graph" not in Dashboard(tracemagic.load(GPU, use_cache=False)).keys


def test_graph_memory_categories_and_spans_of_a_chakra_trace_et_capture(ip: Any, tmp_path: Path) -> None:
    from IPython.utils.capture import capture_output

    from tracemagic.et import et_graph

    with capture_output():
        result = ip.run_cell(
            "%%chakra_trace --et\nmodel = make_mlp()\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
            "for i in range(5):\n    model(torch.randn(8, 32)).sum().backward()\n    opt.step()\n    opt.zero_grad()\n"
        )
    assert result.success
    capture = ip.user_ns["_chakra_capture"]
    assert (capture.dir / "torch_et_0.json").is_file()
    dash = Dashboard(capture.trace)
    assert dash.keys == ["overview", "layers", "timeline", "memory", "source", "shapes", "flame", "graph"]  # source: the line marks
    steps = dash.data.et_steps
    assert steps == sorted(int(s) for s in capture.trace.steps()["step"])
    # default: the first step; the step selector picks another
    (fig,) = dash.figures("graph")
    nodes, edges = et_graph(capture.dir, step=steps[0])
    assert fig["layout"]["meta"]["shown"] == len(nodes) and fig["layout"]["meta"]["edges"] == len(edges) > 0
    assert f"step {steps[0]}" in fig["layout"]["title"]["text"]
    assert {"aten::linear", "aten::relu"} <= {row[0] for t in as_dict(fig)["data"] if t.get("name") == "ops" for row in t["customdata"]}
    dash.controls["step"].value = steps[-1]
    assert f"step {steps[-1]}" in dash.figures("graph")[0]["layout"]["title"]["text"]
    assert "100%" in dash.info_html("graph")  # every ET op timed by Kineto
    # Memory: layer spans under the curve, and the profile by category
    memory = dash.figures("memory")
    assert [f["layout"]["title"]["text"] for f in memory] == [f"Memory — step {steps[-1]}", f"Memory by category — step {steps[-1]}"]
    lanes = {t["name"]: t for t in as_dict(memory[0])["data"] if t["name"].startswith("layer ")}
    assert set(lanes) == {"layer forward", "layer backward"}
    spans = dash.data.layer_spans
    in_step = spans[spans["step"] == steps[-1]]
    assert len(lanes["layer forward"]["x"]) == (in_step["phase"] == "forward").sum() == 5  # the MLP's 5 layers
    assert {row[0] for row in lanes["layer forward"]["customdata"]} == set(in_step["layer"])
    categories = {t["name"] for t in as_dict(memory[1])["data"]}
    # the parameters were made before the capture: in the stack where the CPU allocator counted them, else named
    uncounted = dash.data.memory_categories.attrs["uncounted"].get(0, {})
    assert "gradient" in categories and ("parameter" in categories) != (uncounted.get("parameter", 0) > 0)
    if uncounted:
        assert "not in the allocator&#x27;s totals" in dash.info_html("memory") and "parameter" in dash.info_html("memory")
    # the report has the Graph tab too
    text = write_report(dash.data, tmp_path / "et.html").read_text()
    assert 'id="tab-graph"' in text and "Execution Trace op graph" in text


def test_layer_spans_are_the_top_level_layers(cpu_capture: Any) -> None:
    from tracemagic.analysis.spans import layer_spans

    spans = layer_spans(cpu_capture)
    layers = cpu_capture.layers()
    top = set(layers.loc[layers["depth"] == 1, "layer"])
    assert set(spans["layer"]) == top and set(spans["phase"]) == {"forward", "backward"}
    steps = cpu_capture.steps()
    for step, group in spans.groupby("step"):  # inside their step, in time order, not overlapping per phase
        row = steps[steps["step"] == step].iloc[0]
        assert (group["ts"] >= row["ts"] - 1).all() and (group["ts"] + group["dur"] <= row["ts"] + row["dur"] + 1).all()
        assert (group["phase"] == "forward").sum() == len(top)
    fwd = spans[spans["phase"] == "forward"].groupby("layer")["dur"].sum()
    np.testing.assert_allclose(fwd.sort_index(), layers.set_index("layer").loc[sorted(top), "fwd_cpu_us"], atol=0.01)
    assert list(layer_spans(cpu_capture, depth=0)["layer"].unique()) == list(layers.loc[layers["depth"] == 0, "layer"])


def test_memory_timeline_lane_of_layer_spans() -> None:
    memory, steps = make_memory(), make_steps()
    steps["ts"] = [0.0, 1000.0, 2000.0]
    spans = pd.DataFrame({"rank": 0, "layer": ["model.enc", EVIL_IMG, "model.enc"], "type": "X",
                          "phase": ["forward", "forward", "backward"], "ts": [100.0, 400.0, 700.0],
                          "dur": [200.0, 100.0, 250.0], "step": 1, "calls": 1})
    fig = figures.memory_timeline(memory, steps, spans=spans, max_points=400)
    fwd = next(t for t in fig.data if t.name == "layer forward")
    bwd = next(t for t in fig.data if t.name == "layer backward")
    assert fwd.yaxis == bwd.yaxis == "y2" and list(fwd.base) == [0.1, 0.4] and list(bwd.x) == [0.25]
    assert fig.layout.yaxis.title.text == "memory (GiB)" and fig.layout.xaxis2.title.text == "time since trace start (ms)"
    # the x range is the memory events' (the category chart under it takes the same)
    lo, hi = memory["ts"].min(), memory["ts"].max()
    pad = (hi - lo) / 100
    assert {k: v for k, v in fig.layout.meta.items() if k != "x_range"} == {"spans": 3, "spans_total": 3}
    assert fig.layout.meta["x_range"] == pytest.approx([(lo - pad) / 1000, (hi + pad) / 1000])
    assert list(fig.layout.xaxis.range) == fig.layout.meta["x_range"]
    assert not any(RAW.search(s) for s in all_strings(fig.to_dict()))
    assert len(figures.memory_timeline(memory, steps, spans=spans, step=2).data) == 2  # no spans in step 2: no lane


def test_memory_categories_figure() -> None:
    ts = np.linspace(0, 3000, 50)
    cats = pd.DataFrame({"rank": 0, "cycle": pd.array([pd.NA] * 50, dtype="Int64"), "device": "cpu", "ts": ts,
                         "parameter": 1000.0, "optimizer_state": 0.0, "input": 10.0, "temporary": 0.0,
                         "activation": np.arange(50) * 10.0, "gradient": 500.0, "autograd_detail": 0.0, "unknown": 0.0})
    cats["total_bytes"] = cats[["parameter", "input", "activation", "gradient"]].sum(axis=1)
    fig = figures.memory_categories(cats, unit="ms")
    assert [t.name for t in fig.data] == ["parameter", "input", "activation", "gradient"]
    assert {t.stackgroup for t in fig.data} == {"categories"}
    np.testing.assert_allclose(next(t for t in fig.data if t.name == "activation").y, cats["activation"] / 1024)
    steps = make_steps()
    steps["ts"] = [0.0, 1000.0, 2000.0]
    steps["dur"] = 1000.0
    one = figures.memory_categories(cats, steps, step=2)
    assert min(one.data[0].x) >= 1.0 and max(one.data[0].x) <= 2.0
    empty_note = pd.DataFrame(columns=cats.columns)
    empty_note.attrs["note"] = "no memory timeline was recorded"
    assert "no memory timeline" in figures.memory_categories(empty_note).layout.annotations[0].text


# -- the Layers tab's tree table -------------------------------------------------------------
def test_layer_tree_nests_expands_and_escapes() -> None:
    from tracemagic.views.html import layer_tree

    layers = make_layers()
    layers.loc[layers["layer"] == "model.head", "layer"] = f"model.{EVIL_SCRIPT}"
    text = layer_tree(layers, unit="µs", open_depth=1)
    assert text.count("<details") == 2  # model and model.enc have children
    assert text.count("<details open>") == 1  # the root is open, the rest collapsed
    assert text.count('class="tm-leaf"') == 3
    assert EVIL_SCRIPT not in text and "&lt;script&gt;" in text
    # children under their parent, heaviest first
    assert text.index('title="model.enc"') < text.index('title="model.enc.0"') < text.index('title="model.enc.1"')
    assert ">100.000<" in text and ">60.000<" in text  # totals in µs
    small = layer_tree(layers.assign(cpu_us=[1, 2, 100, 3, 4]), max_nodes=1)
    assert "model.enc.0" in small and "model.enc.1" not in small and "2 lighter layers not listed" in small


def test_layers_tab_shows_the_tree_beside_the_icicle(cpu_capture: Any, tmp_path: Path) -> None:
    import ipywidgets as widgets

    dash = Dashboard(cpu_capture)
    dash.select("layers")
    box = dash._tabs["layers"]["box"]
    (row,) = [c for c in box.children if isinstance(c, widgets.HBox)]
    assert row.children[0] is dash._tabs["layers"]["figures"][0] and "<details" in row.children[1].value
    text = write_report(cpu_capture, tmp_path / "cpu.html").read_text()
    assert '<div class="tm-side">' in text and "<details open>" in text


def test_tabs_are_an_explicit_registry(gpu: Any) -> None:
    """``sections.TABS`` lists every tab (key, title, availability, builder): what shows is
    what each tab's ``available`` says, in the registry's order, and each builds."""
    data = TraceData(gpu)
    shown = sections.available(data)
    assert shown == [k for k, tab in sections.TABS.items() if tab.available(data, None)]
    assert "kernels" in shown and "compare" not in shown  # a GPU trace, nothing to compare
    assert sections.available(data, TraceData(gpu))[-1] == "compare"
    for key in shown:
        section = sections.build(key, data)
        assert (section.key, section.title) == (key, sections.TABS[key].title)
    with pytest.raises(ValueError, match="needs another trace"):
        sections.build("compare", data)
    with pytest.raises(ValueError, match="unknown tab 'nope'; tabs are overview, layers"):
        sections.build("nope", data)


# -- the timeline's selection, against the raw JSON ----------------------------------------------
def _raw_docs(name: str) -> list[dict[str, Any]]:
    return tb_reference.raw_docs(TRACES / name)


@pytest.mark.parametrize("name", ["param_dlrm_kineto.tar.gz", "hta_nccl_data.json.gz"])
def test_timeline_events_cover_the_raw_trace_within_the_bound(name: str) -> None:
    """Lanes, window and event counts from the raw JSON; the kept events are each lane's
    longest, at most ``max(max_events // lanes, 10)`` per lane; the GPU events not kept
    are all counted in the lane's bins."""
    from tracemagic.views.selection import timeline_events

    cpu_cats, gpu_cats = {"cpu_op", "user_annotation"}, {"kernel", "gpu_memcpy", "gpu_memset"}
    docs = _raw_docs(name)
    several = len(docs) > 1
    lanes: dict[str, list[float]] = {}  # lane label -> raw durations of its events
    starts, ends = [], []
    for doc in docs:
        rank = int((doc.get("distributedInfo") or {}).get("rank", 0))
        prefix = f"rank {rank} · " if several else ""
        for e in doc["traceEvents"]:
            cat = str(e.get("cat", "")).lower()
            if e.get("ph") != "X" or cat not in cpu_cats | gpu_cats:
                continue
            dur = float(e.get("dur", 0))
            starts.append(float(e["ts"]))
            ends.append(float(e["ts"]) + dur)
            if cat in gpu_cats:
                args = e.get("args", {})
                lane = f"GPU {args.get('device', e['pid'])} stream {args.get('stream', e['tid'])}"
            elif str(e["name"]).startswith("ProfilerStep#"):
                lane = "steps"
            else:
                lane = f"thread {e['tid']}"
            lanes.setdefault(prefix + lane, []).append(dur)

    trace = tracemagic.load(TRACES / name, use_cache=False)
    max_events, bins = 300, 50
    got = timeline_events(trace.ops(), trace.kernels(), trace.steps(), max_events=max_events, bins=bins)
    lo, hi = got.attrs["window"]
    assert hi - lo == pytest.approx(max(ends) - min(starts), abs=1e-3)  # the whole trace
    assert sorted(got.attrs["lanes"]) == sorted(lanes)
    assert got.attrs["total"] == sum(len(d) for d in lanes.values())
    kept = got[got["kind"] != "aggregated"]
    per_lane = max(10, max_events // len(lanes))
    assert len(kept) <= per_lane * len(lanes) < got.attrs["total"]  # bounded: the raw trace has more
    bins_ = got[got["kind"] == "aggregated"]
    assert ((bins_["busy"] > 0) & (bins_["busy"] <= 1)).all()
    assert (bins_["ts"] >= lo).all() and (bins_["ts"] < hi).all()
    assert bins_["dur"].to_numpy() == pytest.approx((hi - lo) / bins)
    for lane, durations in lanes.items():
        mine = kept[kept["lane"] == lane]
        top = sorted(durations, reverse=True)[:per_lane]
        assert sorted(mine["dur"], reverse=True) == pytest.approx(top), lane
        if lane.split("· ")[-1].startswith("GPU"):  # no nesting: every event not kept is binned
            assert bins_.loc[bins_["lane"] == lane, "count"].sum() == len(durations) - len(top), lane


def _launched_gpu_us(raw: dict[str, Any], name: str, dims: str) -> float:
    """The GPU work (kernels, memcpy, memset) launched inside the ``cpu_op`` events called
    ``name`` with input dims ``dims`` (as the table writes them), from the raw JSON."""
    spans = [(e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in raw["traceEvents"]
             if e.get("cat") == "cpu_op" and e.get("name") == name
             and json.dumps(e.get("args", {}).get("Input Dims")) == dims]
    launches = {e["args"]["correlation"]: (e["pid"], e["tid"], e["ts"]) for e in raw["traceEvents"]
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    total = 0.0
    for e in raw["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            at = launches.get(e["args"].get("correlation"))
            if at and any(at[:2] == (pid, tid) and start <= at[2] <= end for pid, tid, start, end in spans):
                total += e["dur"]
    return total


def test_shapes_tab_ranks_by_gpu_time_on_a_gpu_trace(cpu_capture: Any, tmp_path: Path) -> None:
    """On a GPU trace the Shapes table and chart lead with the op × shapes that ran the most GPU
    time (as the Overview and Kernels tabs do); a CPU trace keeps them by total CPU time."""
    path = TRACES / "hta_control.json.gz"
    control = tracemagic.load(path, cache_dir=tmp_path)
    dash = Dashboard(control)
    table = dash.table("shapes").frame
    assert list(table.columns[:4]) == ["name", "input_dims", "calls", "gpu_ms"]
    gpu_ms = table["gpu_ms"].to_numpy(dtype=float)
    assert gpu_ms[0] > 0 and (np.diff(gpu_ms) <= 0).all()  # most GPU time first
    assert (np.diff(table["total_ms"].to_numpy(dtype=float)) > 0).any()  # which is not the CPU's order here
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        raw = json.load(fh)
    for _, row in table.head(2).iterrows():  # the figure ranked by is the GPU work the op × shapes launched
        assert abs(row["gpu_ms"] - _launched_gpu_us(raw, row["name"], row["input_dims"]) / 1e3) <= 5e-4, row
    bars = dash.section("shapes").figures[0].data[0]
    top = len(bars.x)
    assert np.allclose(np.asarray(bars.x, dtype=float)[::-1], gpu_ms[:top], atol=5e-4)  # the chart: same rows
    assert (np.diff(control.shapes()["total_us"].to_numpy(dtype=float)) <= 0).all()  # the analysis keeps its order
    cpu = Dashboard(cpu_capture).table("shapes").frame
    assert "gpu_ms" not in cpu and list(cpu.columns[:4]) == ["name", "input_dims", "calls", "total_ms"]
    assert (np.diff(cpu["total_ms"].to_numpy(dtype=float)) <= 0).all()


def test_hover_numbers_reach_the_page_as_numbers(tmp_path: Path) -> None:
    """Every hover value a figure formats as a number (``%{customdata[k]:.3f}``) is sent as a
    number (or null), in every tab of a GPU trace: not as text as wide as the longest name
    beside it (what ``np.stack`` of names and numbers made)."""
    control = tracemagic.load(TRACES / "hta_control.json.gz", cache_dir=tmp_path)
    dash = Dashboard(control)
    checked = 0
    for key in sections.available(dash.data):
        for fig in dash.section(key).figures:
            spec = json.loads(fig.to_json())
            for trace in spec["data"]:
                rows = trace.get("customdata")
                formatted = {int(k) for k in re.findall(r"%\{customdata\[(\d+)\]:[^}]*[fde%]\}", trace.get("hovertemplate", ""))}
                if not rows or not formatted:
                    continue
                if isinstance(rows, dict):  # a numeric array, sent typed (plotly's base64 ``bdata``)
                    assert rows["dtype"][0] in "fiu", (key, rows["dtype"])
                    continue
                for row in rows:
                    for k in formatted:
                        assert row[k] is None or isinstance(row[k], (int, float)), (key, trace.get("type"), k, row[k])
                checked += 1
    assert checked >= 5  # flame, timeline, shapes, roofline, top ops at least


def test_allocations_without_addresses_show_no_blank_lifetime_columns() -> None:
    """The 2021 ResNet-50 trace's ``[memory]`` events carry no ``Addr`` (checked in the raw
    JSON here): no allocation can be paired with its free, so the Memory table leaves out the
    address, freed-at and lifetime columns (blank on every row) and a fact says why; a trace
    whose events have addresses (the MI300X one) keeps them."""
    with gzip.open(OLD, "rt", encoding="utf-8") as fh:
        raw = [e for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    assert raw and not any("Addr" in e.get("args", {}) for e in raw)
    old = Dashboard(tracemagic.load(OLD, use_cache=False)).section("memory")
    assert not {"addr", "freed_ts_ms", "lifetime_ms"} & set(old.table.columns), list(old.table.columns)
    assert dict(old.facts)["lifetimes"].startswith("unknown: these memory events carry no address")
    new = Dashboard(tracemagic.load(TRACES / "tracelens_normalization_layer_test.json.gz", use_cache=False))
    section = new.section("memory")
    assert {"addr", "freed_ts_ms", "lifetime_ms"} <= set(section.table.columns) and "lifetimes" not in dict(section.facts)


def test_the_whole_trace_selected_is_named_so_in_every_tab() -> None:
    """A trace without ProfilerStep (the MI300X one: checked in its raw JSON) has one span,
    step -1, which the step menu offers as "whole trace"; chosen there, the Overview said
    "step -1" and the tables' titles "Top ops in step -1"."""
    path = TRACES / "tracelens_normalization_layer_test.json.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        assert not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in json.load(fh)["traceEvents"])
    dash = Dashboard(tracemagic.load(path, use_cache=False), step=-1)
    assert ("whole trace", -1) in dash.controls["step"].options
    said = []
    for key, tab in sections.TABS.items():
        if not tab.available(dash.data, None):  # (a tab this trace does not have)
            continue
        section = dash.section(key)
        said += [section.title, section.table_title, *section.bullets, *[c for c, _ in section.extra]]
        said += [f"{label} {value}" for label, value in section.facts]
    text = "\n".join(said)
    assert "step -1" not in text, [s for s in said if "step -1" in s]
    assert "Top ops in the whole trace" in text and "whole trace" in dict(dash.section("overview").facts)
