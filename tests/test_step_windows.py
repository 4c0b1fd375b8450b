"""``steps()`` on real GPU traces: device windows, GPU busy time and their use in the
Overview, the text summary, the advice and ``ranks_table()``, against the TensorBoard
plugin's rule re-implemented from the raw JSON in ``tb_reference`` (never our own code)."""

from __future__ import annotations

import gzip
import re
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracemagic
from conftest import TRACES
from tb_reference import GPU, KERNEL, ROLES, RUNTIME, breakdown, category, device_windows, host_steps, union

#: the GPU-lag trace (V100, ns timestamps), the old-format ResNet-50, NCCL, the big A100 one, AMD
FILES = [
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "kineto_worker0.1623143089861.pt.trace.json.gz",
    "hta_nccl_data.json.gz",
    "hta_control.json.gz",
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz",
]


def _raw(name: str) -> list[dict[str, Any]]:
    with gzip.open(TRACES / name, "rt", encoding="utf-8") as fh:
        return json.load(fh)["traceEvents"]


def reference(events: list[dict[str, Any]], origin: float | None = None) -> dict[str, Any]:
    """The TensorBoard plugin's device step windows and GPU activity, from the raw events, in
    µs after ``origin`` (default: the first event, the trace's time zero)."""
    t0 = min(float(e["ts"]) for e in events if e.get("ph") in ("X", "i") and "ts" in e) if origin is None else origin
    windows = device_windows(events, t0)
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in timed if category(e) in GPU]
    interval = lambda e: (float(e["ts"]) - t0, float(e["ts"]) - t0 + float(e.get("dur", 0)))  # noqa: E731
    kernels = [interval(e) for e in timed if category(e) in KERNEL and "nccl" not in e["name"].lower()]
    nccl = [interval(e) for e in timed if category(e) in KERNEL and "nccl" in e["name"].lower()]
    gpu = [interval(e) for e in device]
    launching = {int((r.get("args") or {}).get("correlation", -2)) for r in timed if category(r) in RUNTIME}
    return {
        "windows": windows,
        "busy": [union(gpu, a, b) for _, a, b in windows],
        "compute": [union(kernels, a, b) for _, a, b in windows],
        "comm": [union(kernels + nccl, a, b) - union(kernels, a, b) for _, a, b in windows],
        "unlaunched": sum(1 for e in device if int((e.get("args") or {}).get("correlation", -1)) not in launching),
    }


def close(ours: float, theirs: float, what: str) -> None:
    """Within 0.5% (or 1 µs: float64 epoch-µs times round to 0.25 µs)."""
    assert abs(ours - theirs) <= max(0.005 * abs(theirs), 1.0), f"{what}: ours {ours:.1f} µs, reference {theirs:.1f} µs"


@pytest.mark.parametrize("name", FILES)
def test_device_windows_and_gpu_time_match_the_tensorboard_rule(name: str, tmp_path: Path) -> None:
    ref = reference(_raw(name))
    table = tracemagic.load(TRACES / name, use_cache=False).steps()
    assert table["step"].tolist() == [n for n, _, _ in ref["windows"]]
    for row, (number, begin, stop), busy, compute, comm in zip(
        table.itertuples(), ref["windows"], ref["busy"], ref["compute"], ref["comm"]
    ):
        close(row.window_ts, begin, f"{name} step {number} window start")
        close(row.window_dur, stop - begin, f"{name} step {number} window length")
        close(row.gpu_busy_us, busy, f"{name} step {number} GPU busy")
        close(row.gpu_idle_us, (stop - begin) - busy, f"{name} step {number} GPU idle")
        close(row.compute_us, compute, f"{name} step {number} GPU kernels")
        close(row.comm_us, comm, f"{name} step {number} communication kernels")
    parts = table[[c for c in table.columns if c.endswith("_us") and not c.startswith(("gpu_", "kernel_"))]].sum(axis=1)
    np.testing.assert_allclose(parts, table["window_dur"], rtol=1e-9, atol=1e-6)
    unlaunched = sum(v["events"] for v in table.attrs["unlaunched"].values())
    assert unlaunched == ref["unlaunched"]


def test_the_gpu_bound_trace_says_the_gpu_is_busy(tmp_path: Path) -> None:
    """The V100 trace whose GPU runs behind the host: kernels cover ~99% of every step."""
    name = FILES[0]
    ref = reference(_raw(name))
    table = tracemagic.load(TRACES / name, use_cache=False).steps()
    busy = sum(ref["busy"]) / sum(b - a for _, a, b in ref["windows"])
    assert busy > 0.9  # the reference itself: this trace is GPU-bound
    ours = float(table["gpu_busy_us"].sum() / table["window_dur"].sum())
    close(100 * ours, 100 * busy, "GPU busy share")
    # every GPU event with a launching call inside a step is inside some window
    assert float(table["gpu_busy_us"].sum()) > 0.95 * sum(ref["busy"])


def test_cpu_only_windows_are_the_host_steps(ip: Any) -> None:
    """Without a GPU the window is the host ProfilerStep and GPU columns are NaN."""
    ip.run_cell_magic("chakra_trace", "--active 2 --wait 0 --warmup 1 -q -v cap", "m = make_mlp()\nfor _ in range(4):\n    m(torch.randn(8, 32)).sum().backward()\n")
    table = ip.user_ns["cap"].trace.steps()
    assert len(table) == 2
    np.testing.assert_array_equal(table["window_dur"], table["dur"])
    np.testing.assert_allclose(table["window_ts"], table["ts"])
    assert table["gpu_busy_us"].isna().all() and table["gpu_idle_us"].isna().all()
    parts = table[["compute_us", "comm_us", "memcpy_us", "memset_us", "runtime_us", "dataloader_us", "cpu_us", "idle_us"]]
    np.testing.assert_allclose(parts.sum(axis=1), table["dur"], rtol=1e-9)


def test_every_rank_of_a_multi_rank_job_gets_its_own_windows(tmp_path: Path) -> None:
    """DLRM on 8 V100s (a tar of one trace per rank): each rank's windows, GPU busy and
    communication match the reference computed from that rank's own file."""
    import tarfile

    table = tracemagic.load(TRACES / "param_dlrm_kineto.tar.gz", use_cache=False).steps()
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        members = [m for m in archive.getmembers() if m.isfile() and m.name.endswith(".json")]
        raws = [json.load(archive.extractfile(m)) for m in members]
    assert len(raws) == 8 == table["rank"].nunique()
    t0 = min(float(e["ts"]) for raw in raws for e in raw["traceEvents"] if e.get("ph") in ("X", "i") and "ts" in e)
    for raw in raws:
        rank = int(raw["distributedInfo"]["rank"])
        ref = reference(raw["traceEvents"], t0)
        mine = table[table["rank"] == rank]
        assert mine["step"].tolist() == [n for n, _, _ in ref["windows"]]
        for row, (number, begin, stop), busy, comm in zip(mine.itertuples(), ref["windows"], ref["busy"], ref["comm"]):
            close(row.window_ts, begin, f"rank {rank} step {number} window start")
            close(row.window_dur, stop - begin, f"rank {rank} step {number} window length")
            close(row.gpu_busy_us, busy, f"rank {rank} step {number} GPU busy")
            close(row.comm_us, comm, f"rank {rank} step {number} communication kernels")
        assert table.attrs["unlaunched"].get(rank, {"events": 0})["events"] == ref["unlaunched"]


def test_the_overview_and_advice_of_the_gpu_bound_trace_tell_the_truth(tmp_path: Path) -> None:
    """The text summary (the dashboard's fallback, the CLI's output) and the recommendations
    quote the device-window figures: GPU busy ~98%, and no "GPU waits for the CPU"."""
    from tracemagic.views import insights, text
    from tracemagic.views.data import TraceData

    name = FILES[0]
    ref = reference(_raw(name))
    total = sum(b - a for _, a, b in ref["windows"])
    busy = sum(ref["busy"]) / total
    data = TraceData(tracemagic.load(TRACES / name, use_cache=False))
    facts = dict(insights.facts(data))
    assert facts["GPU"].startswith(f"busy {100 * busy:.0f}%"), facts["GPU"]
    lengths = sorted(b - a for _, a, b in ref["windows"])
    assert facts["mean step"] == f"{total / len(lengths) / 1000:.1f} ms (median {lengths[len(lengths) // 2] / 1000:.1f} ms)"
    shown = text.summary(data)
    assert f"GPU kernels {100 * sum(ref['compute']) / total:.0f}%" in facts["breakdown"]
    fired = [line for line in insights.for_trace(data) if not line.startswith("No rule fired")]
    assert "GPU idle" not in " ".join(fired) and "waits for the CPU" not in shown
    assert "gpu_idle" not in set(data.trace.advice()["rule"])


def test_ranks_table_means_the_device_windows(tmp_path: Path) -> None:
    """``ranks_table()`` on the 8-rank DLRM job: mean step and GPU idle share per rank are
    the reference windows' (one step per rank)."""
    import tarfile

    table = tracemagic.load(TRACES / "param_dlrm_kineto.tar.gz", use_cache=False).ranks_table()
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        raws = [json.load(archive.extractfile(m)) for m in archive.getmembers() if m.isfile() and m.name.endswith(".json")]
    for raw in raws:
        ref = reference(raw["traceEvents"])
        row = table.set_index("rank").loc[int(raw["distributedInfo"]["rank"])]
        windows = [b - a for _, a, b in ref["windows"]]
        close(row["step_us"], float(np.mean(windows)), "mean step")
        close(row["gpu_idle_pct"], 100 * (1 - sum(ref["busy"]) / sum(windows)), "GPU idle %")
        parts = ["compute_us", "comm_us", "memcpy_us", "memset_us", "runtime_us", "dataloader_us", "cpu_us", "idle_us"]
        close(float(row[parts].sum()), row["step_us"], "parts add up to the mean step")


def test_a_trace_without_profiler_steps_says_so(tmp_path: Path) -> None:
    """The MI300X trace has no ProfilerStep (checked in the raw JSON): the Overview says so
    instead of listing one step numbered -1."""
    from tracemagic.views import insights
    from tracemagic.views.data import TraceData

    name = "tracelens_normalization_layer_test.json.gz"
    assert not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in _raw(name))
    facts = dict(insights.facts(TraceData(tracemagic.load(TRACES / name, use_cache=False))))
    assert facts["steps"] == "none (no ProfilerStep: the whole trace is one span)"


def test_trailing_steps_without_gpu_work_are_dropped_as_the_plugin_does(tmp_path: Path) -> None:
    """Issue 24.5: the TensorBoard plugin removes a GPU trace's trailing steps that launched
    no device work, and the last one that did when it launched under 0.8 of the step before
    (kineto tb_plugin ``torch_tb_profiler/profiler/event_parser.py``, ``_update_steps_duration``,
    ``is_remove_tail_steps``: "the profiler may fail to capture all the kernels launched by
    these steps"); ``steps()``, the mean step and ``ranks()`` leave them out the same way and
    the note names them. Steps launching 3, 3, 2 and 0 kernels keep steps 1 and 2."""
    events: list[dict[str, Any]] = []
    correlation = 0
    for step, kernels in enumerate([3, 3, 2, 0], start=1):
        start = 1000.0 * step
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1, "ts": start, "dur": 500})
        for k in range(kernels):
            correlation += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": start + 10 + 20 * k, "dur": 5, "args": {"correlation": correlation}})
            events.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": start + 100 + 50 * k, "dur": 30,
                           "args": {"correlation": correlation, "device": 0, "stream": 7}})
    path = tmp_path / "tail.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ref = reference(events)
    assert [n for n, _, _ in ref["windows"]] == [1, 2]
    trace = tracemagic.load(path, use_cache=False)
    table = trace.steps()
    assert table["step"].tolist() == [n for n, _, _ in ref["windows"]]
    assert table["window_dur"].tolist() == pytest.approx([b - a for _, a, b in ref["windows"]])
    assert table.attrs["tail"] == {0: [3, 4]} and "step(s) 3, 4 of rank 0 left out" in table.attrs["note"]
    ranks = trace.ranks_table()
    assert ranks["steps"].tolist() == [2]
    assert ranks["step_us"].iloc[0] == pytest.approx(float(np.mean([b - a for _, a, b in ref["windows"]])))


def test_the_amd_traces_last_step_launched_nothing_and_is_dropped() -> None:
    """The MI250 trace's step 2 launches no GPU work (checked in the raw JSON): the plugin
    drops it, so do we; step 1 is the only step and the mean step is its window."""
    name = "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    events = _raw(name)
    ref = reference(events)
    hosts = [e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert sorted(set(hosts)) == ["ProfilerStep#1", "ProfilerStep#2"] and [n for n, _, _ in ref["windows"]] == [1]
    table = tracemagic.load(TRACES / name, use_cache=False).steps()
    assert table["step"].tolist() == [1] and table.attrs["tail"] == {0: [2]}


def test_our_own_capture_keeps_its_steps_the_manifest_calls_complete(tmp_path: Path) -> None:
    """The tail rule is for foreign traces: a capture directory with its ``capture.json``
    (the manifest says which steps are whole) keeps a last step that launched no GPU work,
    as it keeps a complete step that launched little (gradient accumulation)."""
    from tracemagic.trace import layout

    name = "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    folder = tmp_path / "capture"
    folder.mkdir()
    (folder / "kineto_trace_0.json.gz").write_bytes((TRACES / name).read_bytes())
    layout.write_manifest(folder, {"format": layout.MANIFEST_FORMAT, "status": "complete",
                                   "files": [{"path": "kineto_trace_0.json.gz", "kind": "kineto", "rank": 0}]})
    table = tracemagic.load(folder, use_cache=False).steps()
    hosts = sorted({int(e["name"].split("#")[1]) for e in _raw(name) if str(e.get("name", "")).startswith("ProfilerStep#")})
    assert table["step"].tolist() == hosts == [1, 2] and table.attrs["tail"] == {}


@pytest.mark.parametrize("name", FILES)
def test_gpu_utilization_is_the_plugins_kernel_time_over_step_time(name: str) -> None:
    """Issue 24.8: the TensorBoard plugin's "GPU Utilization" is the union of kernel time
    (kernels alone: no memcpy, no memset) over the steps' span (kineto tb_plugin
    ``torch_tb_profiler/profiler/gpu_metrics_parser.py``, ``calculate_gpu_utilization``:
    ``kernel_ranges_per_device`` intersected with ``(steps_start_time, steps_end_time)``,
    over its length). ``steps()``'s ``kernel_busy_us`` is that union per step window, and the
    Overview shows it beside GPU busy (all GPU activity), each named."""
    from tracemagic.views import insights
    from tracemagic.views.data import TraceData

    events = _raw(name)
    t0 = min(float(e["ts"]) for e in events if e.get("ph") in ("X", "i") and "ts" in e)
    windows = device_windows(events, t0)
    kernels = [(float(e["ts"]) - t0, float(e["ts"]) - t0 + float(e.get("dur", 0)))
               for e in events if e.get("ph") == "X" and category(e) in KERNEL]
    devices = {(e.get("args") or {}).get("device", e.get("pid")) for e in events if e.get("ph") == "X" and category(e) in KERNEL}
    assert len(devices) == 1  # one GPU per trace: the plugin's per-device figure is the trace's
    span = (windows[0][1], windows[-1][2])
    plugin = union(kernels, *span) / (span[1] - span[0])
    trace = tracemagic.load(TRACES / name, use_cache=False)
    table = trace.steps()
    for row, (number, begin, stop) in zip(table.itertuples(), windows):
        close(row.kernel_busy_us, union(kernels, begin, stop), f"{name} step {number} kernel time")
        assert row.kernel_busy_us <= row.gpu_busy_us + 1e-6
    ours = float(table["kernel_busy_us"].sum() / table["window_dur"].sum())
    assert 100 * ours == pytest.approx(100 * plugin, abs=0.05)  # the windows tile the span but for host gaps
    facts = dict(insights.facts(TraceData(trace)))
    assert facts["GPU utilization"].startswith(f"{100 * ours:.0f}%") and "kernels only" in facts["GPU utilization"]
    assert facts["GPU"].startswith("busy ")


def _kernels_in_steps(events: list[dict[str, Any]]) -> tuple[dict[int, list[float]], int]:
    """One rank's raw events: per ProfilerStep its window counts (the plugin's rule,
    ``device_windows``), the lengths of the kernels whose launching runtime call (by
    correlation id) starts inside its host span; and how many kernels there are in all."""
    spans = host_steps(events)
    counted = {n for n, _, _ in device_windows(events, 0.0)}
    launched = {
        (e.get("args") or {}).get("correlation"): float(e["ts"])
        for e in events
        if e.get("ph") == "X" and category(e) in RUNTIME
    }
    kernels = [e for e in events if e.get("ph") == "X" and category(e) in KERNEL]
    per_step: dict[int, list[float]] = {n: [] for n in counted}
    for k in kernels:
        ts = launched.get((k.get("args") or {}).get("correlation"))
        step = next((n for n, start, end in spans if ts is not None and start <= ts <= end), None)
        if step in counted:
            per_step[step].append(float(k["dur"]))
    return per_step, len(kernels)


def _check_kernels_fact(text: str, per_rank: list[dict[int, list[float]]], total: int, step: int | None) -> None:
    """The Overview's kernels fact against the raw count: the kernels of the steps (of
    ``step``), per step of one rank (as the mean step), their mean length, and for all
    steps how many of the trace's kernels that leaves out."""
    rank_steps = [durs for steps in per_rank for n, durs in steps.items() if step is None or n == step]
    durs = [d for one in rank_steps for d in one]
    match = re.fullmatch(
        r"([\d,]+) \(([\d,.]+) per step( and rank)?, ([\d.]+) (µs|ms) on average\)"
        r"(?:; ([\d,]+) outside the steps not counted)?",
        text,
    )
    assert match, text
    assert int(match[1].replace(",", "")) == len(durs), text
    assert abs(float(match[2].replace(",", "")) - len(durs) / len(rank_steps)) <= 0.05 + 1e-9, text
    assert bool(match[3]) == (len(per_rank) > 1), text
    mean = float(match[4]) * (1000 if match[5] == "ms" else 1)
    assert mean == pytest.approx(sum(durs) / len(durs), rel=0.006), text
    outside = int(match[6].replace(",", "")) if match[6] else 0
    assert outside == (total - len(durs) if step is None else 0), text


@pytest.mark.parametrize("name", ["param_dlrm_kineto.tar.gz", "hta_nccl_data.json.gz"])
def test_the_overviews_kernels_are_those_of_the_steps_per_rank(name: str, tmp_path: Path) -> None:
    """The Overview's kernels fact (dashboard, report, text summary) counts the kernels
    launched inside a ProfilerStep of their rank, per step of one rank as the mean step
    beside it; DLRM's 8 ranks launch ~247 each in their one step (10), and 128 kernels in
    flight when profiling began are in no step: all steps and step 10 say the same."""
    import html
    import tarfile

    from tracemagic.views import Dashboard, text
    from tracemagic.views.report import write_report

    if name.endswith(".tar.gz"):
        with tarfile.open(TRACES / name) as archive:
            raws = [json.load(archive.extractfile(m))["traceEvents"] for m in archive.getmembers()  # type: ignore[arg-type]
                    if m.isfile() and m.name.endswith(".json")]
    else:
        raws = [_raw(name)]
    counted = [_kernels_in_steps(events) for events in raws]
    per_rank = [steps for steps, _ in counted]
    total = sum(n for _, n in counted)
    trace = tracemagic.load(TRACES / name, cache_dir=tmp_path / "cache")
    shown = dict(Dashboard(trace).section("overview").facts)["kernels"]
    _check_kernels_fact(shown, per_rank, total, None)
    numbers = sorted({n for steps in per_rank for n in steps})
    for step in numbers:
        _check_kernels_fact(dict(Dashboard(trace, step=step).section("overview").facts)["kernels"], per_rank, total, step)
    if len(numbers) == 1:  # one step: all steps are that step
        (step,) = numbers
        alone = dict(Dashboard(trace, step=step).section("overview").facts)["kernels"]
        assert shown.split(";")[0] == alone, (shown, alone)
    if name.endswith(".tar.gz"):
        assert total - sum(len(d) for steps in per_rank for d in steps.values()) == 128  # in flight, in no step
        assert {len(steps[10]) for steps in per_rank} == {245, 246, 251}
    assert f"kernels: {shown}" in text.summary(trace, width=1000)
    assert f"<dd>{html.escape(shown)}</dd>" in write_report(trace, tmp_path / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("big", [False, True])
def test_kernel_rate_counts_the_kernels_of_each_ranks_own_steps(big: bool) -> None:
    """``aggregate.kernel_rate`` against a set of (rank, step) pairs: a kernel counts where its
    rank ran that step (steps kept on one rank only, step -1, memcpy left out); with step
    numbers past 32 bits and a negative rank (untrusted input) the same."""
    import pandas as pd

    from tracemagic.analysis import aggregate

    rng = np.random.default_rng(7)
    n = 5000
    step_values = np.array([-1, 3, 4, 5, 2**40 + 4] if big else [-1, 3, 4, 5, 6])
    rank_values = np.array([-5, 0, 1, 2] if big else [0, 1, 2, 3])
    kernels = pd.DataFrame({
        "rank": rng.choice(rank_values, n).astype(np.int32 if not big else np.int64),
        "step": rng.choice(step_values, n),
        "kind": pd.Categorical(rng.choice(["kernel", "memcpy"], n, p=[0.8, 0.2])),
        "dur": rng.uniform(1, 100, n),
    })
    pairs = [(int(r), int(s)) for r in rank_values for s in step_values[1:] if (r + s) % 3]  # each rank its own
    steps = pd.DataFrame({"rank": [r for r, _ in pairs], "step": [s for _, s in pairs], "window_dur": 1.0})
    wanted = set(pairs)
    mine = [(int(r), int(s), float(d)) for r, s, k, d in kernels.itertuples(index=False) if k == "kernel"]
    durs = [d for r, s, d in mine if (r, s) in wanted]
    rate = aggregate.kernel_rate(kernels, steps)
    assert rate["kernels"] == len(durs) and rate["outside"] == len(mine) - len(durs)
    assert rate["per_step"] == pytest.approx(len(durs) / len(pairs)) and rate["steps"] == len(pairs)
    assert rate["mean_us"] == pytest.approx(sum(durs) / len(durs)) and rate["ranks"] == len(rank_values)
    no_rank = aggregate.kernel_rate(kernels.drop(columns="rank"), steps.drop(columns="rank").drop_duplicates("step"))
    assert no_rank["kernels"] == sum(1 for _, s, _ in mine if s in {s for _, s in pairs})


def _capture_events(archive: Path, into: Path) -> tuple[Path, list[dict[str, Any]]]:
    """One of our CUDA captures (``tests/data/cuda``): its folder and its Kineto trace's events."""
    import tarfile

    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (folder,) = [p for p in into.iterdir() if p.is_dir()]
    return folder, json.loads((folder / "kineto_trace_0.json").read_text())["traceEvents"]


CAPTURES = sorted((TRACES.parent / "cuda").glob("*.tar.gz"))
PARTS = [f"{r}_us" for r in ROLES] + ["idle_us"]


def _same_breakdown(table: Any, events: list[dict[str, Any]], origin: float, tail: bool, what: str) -> None:
    """``steps()``' rows (one rank's) against ``tb_reference.breakdown`` of the raw events:
    the same steps and, per step, every category and idle to 1e-3 µs."""
    windows = device_windows(events, origin, tail=tail)
    assert table["step"].tolist() == [n for n, _, _ in windows], what
    for row, (number, begin, stop), want in zip(table.to_dict("records"), windows, breakdown(events, windows, origin)):
        assert row["window_dur"] == pytest.approx(stop - begin, abs=1e-3), f"{what} step {number} window"
        for part in PARTS:
            assert row[part] == pytest.approx(want[part], abs=1e-3), f"{what} step {number} {part}"


@pytest.mark.parametrize("name", FILES)
def test_every_category_of_the_breakdown_is_the_plugins(name: str) -> None:
    """Issue (audit, views): ``steps()``' categories per step are the TensorBoard plugin's
    roles (``tb_reference.breakdown``: ``_parse_step`` and the Overview's priority and
    union), from the raw JSON, with our documented differences applied there. In
    particular every host ``user_annotation`` (record_function ranges: ``## forward ##``,
    ``Optimizer.step#SGD.step``, ``DistributedDataParallel.forward``) is CPU time, as the
    plugin's CpuOp: the host time inside one but outside any op was counted idle (the NCCL
    trace's step 4: 25.6 ms idle of 222 ms, the plugin 0.23 ms). The old category names
    (``Operator``) of ``kineto_worker0`` are the same roles."""
    events = _raw(name)
    origin = min(float(e["ts"]) for e in events if e.get("ph") in ("X", "i") and "ts" in e)
    _same_breakdown(tracemagic.load(TRACES / name, use_cache=False).steps(), events, origin, True, name)


def test_every_rank_of_the_dlrm_job_has_the_plugins_breakdown() -> None:
    """The 8 DLRM ranks (GPU ranks with host ``nccl:*`` ops: CPU time by our documented
    rule, their NCCL kernels communication), each against its own file."""
    import tarfile

    table = tracemagic.load(TRACES / "param_dlrm_kineto.tar.gz", use_cache=False).steps()
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        raws = [json.load(archive.extractfile(m)) for m in archive.getmembers() if m.isfile() and m.name.endswith(".json")]
    origin = min(float(e["ts"]) for raw in raws for e in raw["traceEvents"] if e.get("ph") in ("X", "i") and "ts" in e)
    assert any(str(e.get("name", "")).startswith("nccl:") for raw in raws for e in raw["traceEvents"])
    for raw in raws:
        rank = int(raw["distributedInfo"]["rank"])
        mine = table[table["rank"] == rank]
        _same_breakdown(mine, raw["traceEvents"], origin, True, f"rank {rank}")


@pytest.mark.skipif(not CAPTURES, reason="no CUDA captures in tests/data/cuda")
@pytest.mark.parametrize("archive", CAPTURES, ids=[a.name.removesuffix(".tar.gz") for a in CAPTURES])
def test_our_captures_line_marks_are_cpu_time_not_idle(archive: Path, tmp_path: Path) -> None:
    """Our own CUDA captures: the breakdown is the plugin's (the plugin, reading the capture's
    file, sees the ``tracemagic.line:N`` marks as ``cpu_op``: CPU Exec; the manifest keeps
    every step, ``tail=False``), and the Overview and the Source tab agree: the time the
    cell's lines run on the host is never idle (cuda_quickstart said "idle 44%" while
    ``lines()`` showed its lines on the host 94% of the step)."""
    from tracemagic.views import insights
    from tracemagic.views.data import TraceData

    folder, events = _capture_events(archive, tmp_path)
    origin = min(float(e["ts"]) for e in events if e.get("ph") in ("X", "i") and "ts" in e)
    trace = tracemagic.load(folder, use_cache=False)
    table = trace.steps()
    _same_breakdown(table, events, origin, False, archive.name)
    marks = [(float(e["ts"]) - origin, float(e["ts"]) - origin + float(e["dur"]))
             for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("tracemagic.line:")]
    assert marks and all(e["cat"] == "cpu_op" for e in events if str(e.get("name", "")).startswith("tracemagic.line:"))
    for row, (_, begin, stop) in zip(table.itertuples(), device_windows(events, origin, tail=False)):
        assert row.idle_us <= (stop - begin) - union(marks, begin, stop) + 1e-3
    if archive.name == "cuda_quickstart.tar.gz":
        shown = dict(insights.facts(TraceData(trace)))["breakdown"]
        assert shown.startswith("CPU (GPU idle) "), shown
        assert float(table["idle_us"].sum() / table["window_dur"].sum()) < 0.1


def test_host_ranges_in_a_step_are_cpu_time_by_the_documented_rule(tmp_path: Path) -> None:
    """A hand-made GPU step whose every part is known (µs from the step's start, 0–1000):
    a ``## forward ##`` annotation 100–600 holding an op, a launch and its kernel (300–400);
    a ``gpu_user_annotation`` 300–650 (nothing: drawn on the GPU), a ``python_function``
    50–700 (nothing); a line mark 700–800 (CPU); a host ``nccl:all_reduce`` 850–900 on this
    GPU rank (CPU: its kernel 870–950 is the communication). CPU: the annotation less the
    kernel and the launch (500 - 100 - 10), the mark (100), the nccl op less its launch and
    kernel (50 - 5 - 30): 505; idle 300. The old rule (``cpu_op`` alone) said CPU 115."""

    def x(name: str, cat: str, ts: float, dur: float, gpu: bool = False, **args: Any) -> dict[str, Any]:
        where = {"pid": 0, "tid": 7} if gpu else {"pid": 1, "tid": 1}
        return {"ph": "X", "cat": cat, "name": name, "ts": 10_000 + ts, "dur": dur, "args": args} | where

    events = [
        x("ProfilerStep#1", "user_annotation", 0, 1000),
        x("## forward ##", "user_annotation", 100, 500),
        x("aten::mm", "cpu_op", 150, 100),
        x("cudaLaunchKernel", "cuda_runtime", 260, 10, correlation=1),
        x("gemm", "kernel", 300, 100, gpu=True, correlation=1, device=0, stream=7),
        x("## forward ##", "gpu_user_annotation", 300, 350, gpu=True),
        x("model.py(10): forward", "python_function", 50, 650),
        x("tracemagic.line:3", "cpu_op", 700, 100),
        x("nccl:all_reduce", "cpu_op", 850, 50),
        x("cudaLaunchKernel", "cuda_runtime", 860, 5, correlation=2),
        x("ncclKernel_AllReduce_RING_LL_Sum_float", "kernel", 870, 80, gpu=True, correlation=2, device=0, stream=7),
    ]
    path = tmp_path / "made.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (row,) = tracemagic.load(path, use_cache=False).steps().to_dict("records")
    want = {"compute_us": 100, "comm_us": 80, "memcpy_us": 0, "memset_us": 0, "runtime_us": 15,
            "dataloader_us": 0, "cpu_us": 505, "idle_us": 300}
    assert {p: row[p] for p in PARTS} == pytest.approx(want)
    ((_, begin, stop),) = device_windows(events, 10_000)
    assert breakdown(events, [(1, begin, stop)], 10_000) == [pytest.approx(want)]


def test_a_step_the_tail_rule_left_out_shows_no_kernels_of_its_own(tmp_path: Path) -> None:
    """Step 2 launched half of step 1's kernels, so ``steps()`` leaves it out (the plugin's tail
    rule): the Overview of all steps says its 5 kernels are outside the steps, and the
    Overview of step 2 alone shows no kernels fact (not the 5 as "per step" of a 0 µs step)."""
    from tracemagic.views import Dashboard

    events, corr = [], 0

    def x(name: str, cat: str, ts: float, dur: float, gpu: bool = False, **args: Any) -> dict[str, Any]:
        where = {"pid": 0, "tid": 7} if gpu else {"pid": 1, "tid": 1}
        return {"ph": "X", "cat": cat, "name": name, "ts": 10_000 + ts, "dur": dur, "args": args, **where}

    for step, launched in ((1, 10), (2, 5)):
        base = (step - 1) * 1000
        events.append(x(f"ProfilerStep#{step}", "user_annotation", base, 900))
        for i in range(launched):
            corr += 1
            events.append(x("cudaLaunchKernel", "cuda_runtime", base + 10 + 20 * i, 5, correlation=corr))
            events.append(x("k", "kernel", base + 20 + 20 * i, 10, gpu=True, correlation=corr, device=0, stream=7))
    path = tmp_path / "tail.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = tracemagic.load(path, use_cache=False)
    assert trace.steps()["step"].tolist() == [1]
    facts = {step: dict(Dashboard(trace, step=step).section("overview").facts) for step in (None, 1, 2)}
    assert facts[None]["kernels"].startswith("10 (10 per step") and "5 outside the steps" in facts[None]["kernels"]
    assert facts[1]["kernels"].startswith("10 (10 per step")
    assert "kernels" not in facts[2]


@pytest.mark.parametrize("c_paths", [True, False])
def test_repeated_step_numbers_are_warned_with_the_events_left_in_no_step(
    c_paths: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ProfilerSteps named #5 (and two #7): steps() keeps the first of each number and
    the later ones' events fall in no step. That was silent; the warning names the numbers
    and counts those events (a kernel by its launch, as steps() places it)."""
    from tracemagic.trace import parse, structure

    if not c_paths:
        monkeypatch.setattr(parse, "_scan", None)
        monkeypatch.setattr(structure, "_nesting", None)
    events, names = [], [5, 5, 7, 5, 7, 8]
    for i, number in enumerate(names):
        ts = 1000.0 * i
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 1, "tid": 1, "ts": ts, "dur": 900},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts + 10, "dur": 100},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts + 20, "dur": 10,
             "args": {"correlation": i + 1}},
            # the kernel runs past its step's end: placed by its launch, not its time
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": ts + 850, "dur": 300,
             "args": {"correlation": i + 1, "device": 0, "stream": 7}},
        ]
    path = tmp_path / "repeated.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = tracemagic.load(path, use_cache=False)
    assert trace.steps()["step"].tolist() == [5, 7, 8]
    left_out = sum(1 for i, n in enumerate(names) if n in names[:i])
    in_no_step = 3 * left_out  # each left-out step's op, runtime call and kernel
    assert int((trace.events["step"] == -1).sum()) == in_no_step + left_out  # (and the step events themselves)
    (warning,) = [w for w in trace.warnings if "ProfilerStep numbers repeat" in w]
    assert warning == (
        f"{path}: ProfilerStep numbers repeat (#5 3 times, #7 2 times): steps() keeps the first step of each "
        f"number; the {left_out} later ones are left out, and the {in_no_step} events in them are in no step (step -1)"
    )
