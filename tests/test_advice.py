"""``trace.advice()``: the recommendations as rules with named thresholds, checked on the real
GPU traces against figures computed here from the raw JSON (the TensorBoard plugin's step
windows, ``tb_reference``; self times by nesting the raw ops), never with our own code; and
the views show exactly its rows."""

from __future__ import annotations

import gzip
import re
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import tracemagic
from conftest import TRACES
from tb_reference import GPU, KERNEL, MEMCPY, RUNTIME, category, device_windows, union
from tracemagic.analysis import advice as rules

#: the real traces with ProfilerSteps: the GPU-lag V100 first
STEPPED = [
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "kineto_worker0.1623143089861.pt.trace.json.gz",
    "hta_nccl_data.json.gz",
    "hta_control.json.gz",
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "hta_triton_example.json.gz",
]
#: a rule's threshold constant, by rule
THRESHOLDS = {
    "gpu_idle": "GPU_IDLE_SHARE", "memcpy": "MEMCPY_SHARE", "communication": "COMM_SHARE",
    "dataloader": "DATALOADER_SHARE", "slow_step": "SLOW_STEP_RATIO", "top_op": "TOP_OP_SHARE",
    "launch_overhead": "KERNELS_PER_STEP", "straggler": "STRAGGLER_SHARE", "memory_peak": "MEMORY_PEAK_SHARE",
    "fragmentation": "RESERVED_RATIO", "optimizer": "OPTIMIZER_SHARE", "host_sync": "HOST_SYNC_SHARE",
}
#: how far a figure may sit from a threshold before "fires iff reached" is checked (rounding)
MARGIN = 0.01


def raw_events(name: str) -> list[dict[str, Any]]:
    with gzip.open(TRACES / name, "rt", encoding="utf-8") as fh:
        return json.load(fh)["traceEvents"]


def step_shares(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From the raw events: the device windows' lengths and, as shares of their sum, the GPU
    idle time, the NCCL time under no compute kernel, the memcpy time under neither, and the
    DataLoader time under no GPU activity nor runtime call (the steps' partition order)."""
    t0 = min(float(e["ts"]) for e in events if e.get("ph") in ("X", "i") and "ts" in e)
    windows = device_windows(events, t0)
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]

    def spans(keep: Any) -> list[tuple[float, float]]:
        return [(float(e["ts"]) - t0, float(e["ts"]) - t0 + float(e.get("dur", 0))) for e in timed if keep(e)]

    compute = spans(lambda e: category(e) in KERNEL and "nccl" not in e["name"].lower())
    nccl = spans(lambda e: category(e) in KERNEL and "nccl" in e["name"].lower())
    memcpy = spans(lambda e: category(e) in MEMCPY)
    gpu = spans(lambda e: category(e) in GPU)
    runtime = spans(lambda e: category(e) in RUNTIME)
    loader = spans(lambda e: "DataLoader" in str(e.get("name", "")) and category(e) in ("cpu_op", "user_annotation", "operator"))
    total = sum(b - a for _, a, b in windows)

    def share(over: list[tuple[float, float]], under: list[tuple[float, float]]) -> float:
        return sum(union(over + under, a, b) - union(under, a, b) for _, a, b in windows) / total

    return {
        "lengths": [b - a for _, a, b in windows],
        "gpu_idle": 1 - sum(union(gpu, a, b) for _, a, b in windows) / total,
        "communication": share(nccl, compute),
        "memcpy": share(memcpy, compute + nccl),
        "dataloader": share(loader, gpu + runtime),
    }


#: the raw categories of host duration events: a CPU op's self time is its duration less
#: its direct children's of any of these (ops, annotations, Python frames, runtime calls)
HOST_CATEGORIES = {"cpu_op", "operator", "user_annotation", "python_function", "python"} | RUNTIME


def self_times(events: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """Self time (its duration less its direct children's, at least 0) and calls of each
    CPU op name, nesting the raw host events per thread."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and category(e) in HOST_CATEGORIES:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for host in by_thread.values():
        t0 = min(float(e["ts"]) for e in host)
        stack: list[list[Any]] = []  # [end, children's time, event]

        def close(item: list[Any]) -> None:
            event = item[2]
            if category(event) in ("cpu_op", "operator"):
                self_us[event["name"]] += max(float(event.get("dur", 0)) - item[1], 0.0)
                calls[event["name"]] += 1

        for e in sorted(host, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
            start, dur = float(e["ts"]) - t0, float(e.get("dur", 0))
            while stack and stack[-1][0] <= start:
                close(stack.pop())
            if stack:
                stack[-1][1] += dur
            stack.append([start + dur, 0.0, e])
        while stack:
            close(stack.pop())
    return dict(self_us), dict(calls)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tracemagic.Trace]:
    cache = tmp_path_factory.mktemp("cache")
    names = [*STEPPED, "hta_benchmark_simple_add_trace.json.gz", "tracelens_normalization_layer_test.json.gz",
             "param_dlrm_kineto.tar.gz"]
    return {name: tracemagic.load(TRACES / name, cache_dir=cache) for name in names}


def rows_of(table: pd.DataFrame) -> dict[str, pd.Series]:
    assert not table["rule"].duplicated().any()
    return {str(row["rule"]): row for _, row in table.iterrows()}


def test_the_gpu_bound_v100_trace_gets_no_waits_for_the_cpu_advice(loaded: dict[str, tracemagic.Trace]) -> None:
    """The V100 trace whose GPU runs behind the host: idle well under the threshold in the
    raw windows, so neither the table nor any view says the GPU waits for the CPU."""
    name = STEPPED[0]
    ref = step_shares(raw_events(name))
    assert ref["gpu_idle"] < rules.GPU_IDLE_SHARE - MARGIN  # the reference itself: GPU-bound
    table = loaded[name].advice()
    assert "gpu_idle" not in set(table["rule"])
    assert not table["text"].str.contains("waits for the CPU").any()
    for step in sorted(loaded[name].steps()["step"]):
        assert "gpu_idle" not in set(loaded[name].advice(step)["rule"]), step


@pytest.mark.parametrize("name", STEPPED)
def test_step_rules_fire_exactly_when_the_raw_figures_reach_their_thresholds(
    loaded: dict[str, tracemagic.Trace], name: str
) -> None:
    ref = step_shares(raw_events(name))
    lengths = ref["lengths"]
    ratio = max(lengths) / float(np.median(lengths))
    expected = {rule: ref[rule] for rule in ("gpu_idle", "communication", "memcpy", "dataloader")}
    if len(lengths) >= rules.SLOW_STEP_MIN_STEPS:
        expected["slow_step"] = ratio
    fired = rows_of(loaded[name].advice())
    for rule, figure in expected.items():
        threshold = getattr(rules, THRESHOLDS[rule])
        if abs(figure - threshold) < MARGIN * max(threshold, 1):
            continue  # too close to call through rounding
        assert (rule in fired) == (figure >= threshold), (rule, figure, threshold)
        if rule in fired:
            row = fired[rule]
            assert row["value"] == pytest.approx(figure, abs=0.005), rule
            assert row["threshold"] == threshold
            if rule != "slow_step":
                assert f"{100 * figure:.0f}% of the step" in row["evidence"], row["evidence"]


def test_the_gpu_idle_and_dataloader_figures_of_the_resnet_trace(loaded: dict[str, tracemagic.Trace]) -> None:
    """ResNet-50 with num_workers=0: a third of each step in the DataLoader; both rules fire
    with the raw figures, the DataLoader first in its own step too."""
    name = STEPPED[1]
    ref = step_shares(raw_events(name))
    assert ref["dataloader"] >= rules.DATALOADER_SHARE and ref["gpu_idle"] >= rules.GPU_IDLE_SHARE
    fired = rows_of(loaded[name].advice())
    assert fired["dataloader"]["value"] == pytest.approx(ref["dataloader"], abs=0.005)
    assert fired["gpu_idle"]["value"] == pytest.approx(ref["gpu_idle"], abs=0.005)
    assert fired["dataloader"]["text"].startswith(f"DataLoader takes {100 * ref['dataloader']:.0f}% of the step: ")


@pytest.mark.parametrize("name", ["hta_benchmark_simple_add_trace.json.gz", "tracelens_normalization_layer_test.json.gz",
                                  "hta_triton_example.json.gz", "hta_control.json.gz"])
def test_the_top_op_rule_quotes_the_raw_self_time_share(loaded: dict[str, tracemagic.Trace], name: str) -> None:
    self_us, calls = self_times(raw_events(name))
    top = min(self_us, key=lambda n: (-self_us[n], n))
    share = self_us[top] / sum(self_us.values())
    fired = rows_of(loaded[name].advice())
    if abs(share - rules.TOP_OP_SHARE) < MARGIN:
        return
    assert ("top_op" in fired) == (share >= rules.TOP_OP_SHARE), (top, share)
    if "top_op" in fired:
        row = fired["top_op"]
        assert row["value"] == pytest.approx(share, abs=0.005)
        assert row["evidence"] == f"{top[:59] + '…' if len(top) > 60 else top} is {100 * share:.0f}% of CPU time ({calls[top]:,} calls)"
        assert row["weight"] == pytest.approx(share * rules.TOP_OP_DISCOUNT)


def test_communication_of_the_eight_rank_job(loaded: dict[str, tracemagic.Trace]) -> None:
    """DLRM on 8 V100s: the mean over the ranks' steps of the NCCL time under no compute
    kernel, from each rank's own file; the straggler rule speaks of one rank only."""
    import tarfile

    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        raws = [json.load(archive.extractfile(m))["traceEvents"]  # type: ignore[union-attr]
                for m in archive.getmembers() if m.isfile() and m.name.endswith(".json")]
    shares = [step_shares(events) for events in raws]
    lengths = [length for s in shares for length in s["lengths"]]
    comm = sum(s["communication"] * sum(s["lengths"]) for s in shares) / sum(lengths)
    idle = sum(s["gpu_idle"] * sum(s["lengths"]) for s in shares) / sum(lengths)
    fired = rows_of(loaded["param_dlrm_kineto.tar.gz"].advice())
    assert comm >= rules.COMM_SHARE and fired["communication"]["value"] == pytest.approx(comm, abs=0.005)
    assert fired["gpu_idle"]["value"] == pytest.approx(idle, abs=0.005)
    assert fired["straggler"]["evidence"].startswith("Rank ") and fired["straggler"]["threshold"] == rules.STRAGGLER_SHARE
    assert "straggler" not in set(loaded["param_dlrm_kineto.tar.gz"].advice(12)["rule"])  # one step: no ranks rule


def test_host_syncs_of_several_ranks_are_quoted_per_step_and_rank(loaded: dict[str, tracemagic.Trace]) -> None:
    """DLRM on 8 V100s, one step each: the host_sync rule quotes the stall of one rank's step
    (the raw cudaStreamSynchronize time in the ranks' steps over ranks x steps, 2.5 ms), not
    the 8 ranks' sum (20 ms, longer than the 15.8 ms step it is a share of)."""
    import tarfile

    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        raws = [json.load(archive.extractfile(m))["traceEvents"]  # type: ignore[union-attr]
                for m in archive.getmembers() if m.isfile() and m.name.endswith(".json")]
    stall, rank_steps, calls = 0.0, 0, 0
    for events in raws:
        for step in [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]:
            rank_steps += 1
            inside = [e for e in events if e.get("name") == "cudaStreamSynchronize"
                      and step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
            stall += sum(e["dur"] for e in inside)
            calls += len(inside)
    assert rank_steps == 8 and calls == 80
    (text,) = loaded["param_dlrm_kineto.tar.gz"].advice().query("rule == 'host_sync'")["text"]
    found = re.search(r"cudaStreamSynchronize (\d+)× per step and rank, ([\d.]+) ms per step and rank", text)
    assert found, text
    assert float(found.group(2)) == pytest.approx(stall / rank_steps / 1000, abs=0.01)
    assert int(found.group(1)) <= calls / rank_steps  # the syncs that waited for the GPU
    # the share is every sync's stall, not the named one's: said as such, not as its share
    assert re.search(r"ms per step and rank; all syncs: \d+% of the step \(the longest", text), text


@pytest.mark.parametrize("name", [*STEPPED, "param_dlrm_kineto.tar.gz", "hta_benchmark_simple_add_trace.json.gz"])
def test_every_row_keeps_the_contract(loaded: dict[str, tracemagic.Trace], name: str) -> None:
    """Each row reached its named threshold, says its evidence then its advice, and the rows
    come most important first; a step's rows say which step."""
    trace = loaded[name]
    for step in [None, *sorted(trace.steps()["step"])[:2]]:
        table = trace.advice(step)
        assert list(table.columns) == rules.COLUMNS
        assert table["weight"].is_monotonic_decreasing
        assert (table["step"].isna() if step is None else table["step"] == step).all()
        for _, row in table.iterrows():
            assert row["threshold"] == getattr(rules, THRESHOLDS[row["rule"]])
            assert row["value"] >= row["threshold"]
            assert row["text"] in (f"{row['evidence']}: {row['advice']}", f"{row['evidence']}; {row['advice']}")


def test_every_threshold_is_named_and_documented() -> None:
    source = Path(rules.__file__).read_text(encoding="utf-8").splitlines()
    constants = [i for i, line in enumerate(source) if line.split(" = ")[0].isupper() and " = " in line
                 and not line.startswith(("COLUMNS", "OP_ADVICE", "CPU_OP_ADVICE", "OTHER_OP_ADVICE"))]
    assert len(constants) >= len(THRESHOLDS)
    for i in constants:
        assert source[i - 1].startswith("#: "), source[i]
    assert set(THRESHOLDS.values()) <= {source[i].split(" = ")[0] for i in constants}


@pytest.mark.parametrize("name", ["kineto_worker0.1623143089861.pt.trace.json.gz", "param_dlrm_kineto.tar.gz"])
def test_the_views_show_the_advice_rows_as_they_are(loaded: dict[str, tracemagic.Trace], name: str) -> None:
    """The Overview's bullets and the text summary's recommendations are the table's
    ``text``, in its order (for the whole trace and for a selected step)."""
    from tracemagic.views import Dashboard, text

    trace = loaded[name]
    dash = Dashboard(trace)
    assert dash.section("overview").bullets[: len(trace.advice())] == trace.advice()["text"].head(6).tolist()
    summary = text.summary(trace, width=400)
    for line in trace.advice()["text"].head(6):
        assert f"• {line}" in summary
    step = int(sorted(trace.steps()["step"])[0])
    dash.controls["step"].value = step
    assert dash.section("overview").bullets[: len(trace.advice(step))] == trace.advice(step)["text"].head(6).tolist()


def test_one_rule_for_top_layers_everywhere(loaded: dict[str, tracemagic.Trace]) -> None:
    """The Overview's and the text summary's top layers are ``aggregate.top_layers``: by GPU
    time where any layer ran GPU work, most first, ties in the table's order."""
    from tracemagic.analysis import aggregate
    from tracemagic.views import Dashboard, text

    trace = loaded["tracelens_normalization_layer_test.json.gz"]
    layers = trace.layers()
    assert (layers["gpu_us"] > 0).any() and aggregate.layer_metric(layers) == "gpu_us"
    top = aggregate.top_layers(layers, 5)
    expected = sorted(range(len(layers)), key=lambda i: (-float(layers["gpu_us"].iloc[i]), i))[:5]
    assert top["layer"].tolist() == layers["layer"].iloc[expected].tolist()
    (shown,) = [frame for caption, frame in Dashboard(trace).section("overview").extra if caption == "Top layers"]
    assert shown["layer"].tolist()[:5] == top["layer"].tolist()
    block = text.summary(trace, width=300, top=5).split("Top layers (by GPU time)\n")[1].split("\n\n")[0]
    rows = block.splitlines()[2:]
    assert len(rows) == 5 and all(row.startswith(name + " ") for row, name in zip(rows, top["layer"])), rows
    cpu_only = layers.assign(gpu_us=0.0)
    assert aggregate.layer_metric(cpu_only) == "cpu_us"


def test_memory_and_launch_rules_at_their_thresholds() -> None:
    """The rules no real trace here reaches, at both sides of their named thresholds."""
    gib = 2.0**30
    empty = pd.DataFrame(columns=["step", "window_dur"])

    def peaks(peak: float, reserved: float) -> pd.DataFrame:
        return pd.DataFrame({"rank": [0, 0], "device": ["cuda:0", "cpu"], "step": [pd.NA, pd.NA],
                             "peak_bytes": [peak, 100 * gib], "peak_reserved_bytes": [reserved, np.nan]})

    def rules_for(table: pd.DataFrame, **kwargs: Any) -> dict[str, pd.Series]:
        return rows_of(rules.evaluate(empty, pd.DataFrame(), peaks=table, **kwargs))

    memory = 16 * gib
    high = rules_for(peaks(rules.MEMORY_PEAK_SHARE * memory, 0.0), device_memory_bytes=memory)
    assert high["memory_peak"]["value"] == pytest.approx(rules.MEMORY_PEAK_SHARE)  # the CPU's 100 GiB is not a GPU's
    assert "memory_peak" not in rules_for(peaks(0.99 * rules.MEMORY_PEAK_SHARE * memory, 0.0), device_memory_bytes=memory)
    big = rules.RESERVED_MIN_BYTES
    assert rules_for(peaks(big, rules.RESERVED_RATIO * big + 1))["fragmentation"]["text"].startswith(
        "Reserved memory is 1.5× the allocated peak: fragmentation")
    assert "fragmentation" not in rules_for(peaks(big, 1.49 * big))
    assert "fragmentation" not in rules_for(peaks(big / 4, rules.RESERVED_MIN_BYTES))  # too small to matter
    steps = pd.DataFrame({"step": [1], "window_dur": [1e5], "gpu_busy_us": [1e5], "gpu_idle_us": [0.0],
                          **{c: [0.0] for c in ("compute_us", "comm_us", "memcpy_us", "memset_us", "runtime_us",
                                                 "dataloader_us", "cpu_us", "idle_us")}})
    for count, fires in ((rules.KERNELS_PER_STEP, True), (rules.KERNELS_PER_STEP - 1, False)):
        kernels = pd.DataFrame({"kind": ["kernel"] * count + ["memcpy"] * 5, "dur": [5.0] * count + [500.0] * 5,
                                "step": [1] * (count + 5)})
        fired = rows_of(rules.evaluate(steps, pd.DataFrame(), kernels))
        assert ("launch_overhead" in fired) == fires, count
    assert fired.keys() == set()  # a busy GPU, nothing else to say


def test_no_rule_fired_is_said_with_the_closest_figures(
    loaded: dict[str, tracemagic.Trace], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The A100 trace: communication and GPU idle just under their 20% thresholds (from the raw
    windows here), no rule fires, and every view says so with those figures instead of nothing.
    Its host waits for the GPU 16% of the step in syncs (``host_sync`` fires at 10%: the stalls
    are checked against the raw runtime calls in test_lines), so that rule's threshold is set
    above it here: this test is about the closest figures of the others."""
    from tracemagic.views import Dashboard, text

    name = "hta_control.json.gz"
    ref = step_shares(raw_events(name))
    assert rules.COMM_SHARE - 0.05 < ref["communication"] < rules.COMM_SHARE - MARGIN
    assert rules.GPU_IDLE_SHARE - 0.08 < ref["gpu_idle"] < rules.GPU_IDLE_SHARE - MARGIN
    assert "host_sync" in set(loaded[name].advice()["rule"])
    monkeypatch.setattr(rules, "HOST_SYNC_SHARE", 0.5)
    trace = tracemagic.load(TRACES / name, use_cache=False)  # the fixture's trace keeps its advice
    table = trace.advice()
    assert table.empty
    closest = table.attrs["closest"]
    assert list(closest.columns) == rules.COLUMNS and len(closest) == rules.CLOSEST
    assert (closest["value"] < closest["threshold"]).all() and closest["weight"].is_monotonic_decreasing
    near = rows_of(closest)
    assert near["communication"]["value"] == pytest.approx(ref["communication"], abs=0.005)
    assert near["gpu_idle"]["value"] == pytest.approx(ref["gpu_idle"], abs=0.005)
    (line,) = rules.lines(table)
    assert line.startswith("No rule fired")
    assert f"communication {100 * ref['communication']:.0f}% of the step (threshold {100 * rules.COMM_SHARE:.0f}%)" in line
    assert f"GPU idle {100 * ref['gpu_idle']:.0f}% of the step (threshold {100 * rules.GPU_IDLE_SHARE:.0f}%)" in line
    assert Dashboard(trace).section("overview").bullets[0] == line
    assert f"• {line}"[:80] in text.summary(trace, width=1000)
    # a trace where rules fire shows them, not the closest figures
    fired = loaded["kineto_worker0.1623143089861.pt.trace.json.gz"].advice()
    assert len(fired) and rules.lines(fired) == fired["text"].tolist()


def test_the_roofline_headline_is_weighted_by_gpu_time(loaded: dict[str, tracemagic.Trace]) -> None:
    """DLRM on 8 V100s: every op with a cost model is a few tens of µs of 57 ms of GPU work,
    so none heads the Overview; on the A100 trace the headline's op × shape holds at least
    ``ROOFLINE_MIN_SHARE`` of the trace's kernel time (summed here from the raw JSON)."""
    import tarfile

    from tracemagic.views import Dashboard

    facts = dict(Dashboard(loaded["param_dlrm_kineto.tar.gz"]).section("overview").facts)
    assert "furthest below its roof" not in facts
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        kernel_us = sum(float(e["dur"]) for m in archive.getmembers() if m.isfile() and m.name.endswith(".json")
                        for e in json.load(archive.extractfile(m))["traceEvents"]  # type: ignore[arg-type]
                        if category(e) in KERNEL)
    gaps = rules.roofline_gaps(loaded["param_dlrm_kineto.tar.gz"].efficiency(), 3, min_share=0.0)
    assert len(gaps) and len(set(gaps["text"])) == len(gaps)  # the same op × shape of 8 ranks is one row
    assert "on 8 ranks" in gaps["text"].iloc[0] and gaps["weight"].max() < rules.ROOFLINE_MIN_SHARE
    assert quoted_gpu_us(gaps["text"].iloc[0]) < rules.ROOFLINE_MIN_SHARE * kernel_us
    (bullet,) = Dashboard(loaded["param_dlrm_kineto.tar.gz"]).section("roofline").bullets  # said, not silent
    assert bullet.startswith("No op × shape loses 1% of the GPU time") and gaps["evidence"].iloc[0] in bullet
    name = "hta_control.json.gz"
    headline = dict(Dashboard(loaded[name]).section("overview").facts)["furthest below its roof"]
    total = sum(float(e["dur"]) for e in raw_events(name) if e.get("ph") == "X" and category(e) in KERNEL)
    assert quoted_gpu_us(headline) >= rules.ROOFLINE_MIN_SHARE * total


def quoted_gpu_us(text: str) -> float:
    """The GPU time a roofline gap quotes ("over 6.89 ms of GPU time"), in µs."""
    value, unit = re.search(r"over ([\d.,]+) (µs|ms|s) of GPU time", text).groups()  # type: ignore[union-attr]
    return float(value.replace(",", "")) * {"µs": 1.0, "ms": 1e3, "s": 1e6}[unit]
