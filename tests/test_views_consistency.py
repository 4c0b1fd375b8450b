"""Every view consistent with itself: the Memory header, curve and category chart agree; the
step selector filters every widget; 'mean step' counts only the loop's steps; recommendations
quote only numbers the Overview shows. Checked on a real ``%%chakra_trace`` capture (real
IPython shell) and a real GPU trace, against the raw JSON read here."""

from __future__ import annotations

import base64
import gzip
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from IPython.utils.capture import capture_output

import tracemagic
from tracemagic.views import Dashboard

import torch  # noqa: E402

TRACELENS = Path(__file__).resolve().parent / "data" / "traces" / "tracelens_normalization_layer_test.json.gz"
NCCL = Path(__file__).resolve().parent / "data" / "traces" / "hta_nccl_data.json.gz"
BYTES = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
TIMES = {"µs": 1.0, "ms": 1e3, "s": 1e6}
TRAIN = """\
model = make_mlp()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(5):
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def raw_json(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def quantities(text: str) -> list[tuple[float, str, float]]:
    """(value, unit, rounding half-step) of each '12.3 ms', '4.0 KiB', '35%' in ``text``."""
    out = []
    for number, unit in re.findall(r"(\d[\d,]*(?:\.\d+)?)\s*(%|µs|ms|s\b|B\b|KiB|MiB|GiB|TiB| calls)", text):
        decimals = len(number.split(".")[1]) if "." in number else 0
        out.append((float(number.replace(",", "")), unit.strip(), 0.5 * 10.0**-decimals))
    return out


def sizes(text: str) -> list[tuple[float, float]]:
    """(bytes, the display's rounding half-step in bytes) of each byte size quoted in ``text``:
    '3.8 KiB' is any size within 0.05 KiB of 3.8 KiB."""
    return [(v * BYTES[u], half * BYTES[u]) for v, u, half in quantities(text) if u in BYTES]


def rounds_to(shown: tuple[float, float], expected: float) -> bool:
    """Whether a displayed (value, half-step) is ``expected`` rounded to the shown precision.

    A relative tolerance would be wrong both ways: 3,856 B shows as '3.8 KiB', 0.9% off,
    while a 0.5% band around 100 MiB allows an error the display's 0.1 MiB would show."""
    value, half = shown
    return abs(value - expected) <= half * (1 + 1e-9)


def close(shown: float, expected: float, rel: float = 0.005) -> bool:
    return abs(shown - expected) <= rel * abs(expected) + 1e-9


def decode(values: Any) -> np.ndarray:
    """A plotly array, typed ({'dtype', 'bdata'}) or a list, as floats."""
    if isinstance(values, dict) and "bdata" in values:
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"])).astype(float)
    return np.asarray(values, dtype=float)


def y_scale(fig: dict[str, Any]) -> float:
    """Bytes per y unit of a memory figure, from its axis title ('memory (KiB)')."""
    return BYTES[re.search(r"\((\w+)\)", fig["layout"]["yaxis"]["title"]["text"]).group(1)]


def memory_events(raw: dict[str, Any], lo: float = -np.inf, hi: float = np.inf) -> dict[str, list[dict[str, Any]]]:
    """The raw ``[memory]`` events in [lo, hi] (µs, the trace's clock) per device, in time order."""
    out: dict[str, list[dict[str, Any]]] = {}
    events = sorted((e for e in raw["traceEvents"] if e.get("name") == "[memory]" and lo <= e["ts"] <= hi),
                    key=lambda e: e["ts"])
    for e in events:
        kind = e["args"]["Device Type"]
        device = "cpu" if kind == 0 else f"cuda:{e['args']['Device Id']}"
        out.setdefault(device, []).append(e)
    return out


def folded_by_torch(events: list[dict[str, Any]]) -> set[int]:
    """Indices of the events torch's ``key_averages()`` folds into their parent
    (torch/autograd/profiler_util.py, ``EventList._remove_dup_nodes``): the only CPU child
    of a parent of the same name (nesting per thread, plain Python)."""
    cpu = [i for i, e in enumerate(events) if e.get("ph") == "X" and e.get("cat") in
           ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")]
    parent: dict[int, int] = {}
    by_thread: dict[Any, list[int]] = {}
    for i in cpu:
        by_thread.setdefault((events[i]["pid"], events[i]["tid"]), []).append(i)
    for rows in by_thread.values():
        rows.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        stack: list[int] = []
        for i in rows:
            while stack and events[i]["ts"] + events[i]["dur"] > events[stack[-1]]["ts"] + events[stack[-1]]["dur"]:
                stack.pop()
            while stack and events[i]["ts"] >= events[stack[-1]]["ts"] + events[stack[-1]]["dur"] and events[i]["dur"] > 0:
                stack.pop()
            if stack:
                parent[i] = stack[-1]
            stack.append(i)
    children: dict[int, int] = {}
    for p in parent.values():
        children[p] = children.get(p, 0) + 1
    return {i for i, p in parent.items() if events[p]["name"] == events[i]["name"] and children[p] == 1}


def profiler_steps(raw: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(e["name"].split("#")[1]): e for e in raw["traceEvents"]
            if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#")}


@pytest.fixture(scope="module")
def capture(_shell: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real %%chakra_trace of 5 MLP training iterations with --active 5: steps 2-4 are
    recorded complete and ProfilerStep#5 holds only the loop's exit."""
    from conftest import make_mlp, own_namespace

    out = tmp_path_factory.mktemp("capture")
    with own_namespace(_shell) as ns, capture_output() as shown:
        ns.update(torch=torch, make_mlp=make_mlp)
        result = _shell.run_cell(f"%%chakra_trace --active 5 --out {out}\n{TRAIN}")
        cap = ns.get("_chakra_capture")
    assert result.success and cap is not None, shown.stdout
    assert [(s["step"], s["end"]) for s in cap.manifest["steps"]] == [(2, "step"), (3, "step"), (4, "step"), (5, "loop_exit")]
    cap.shown = shown.stdout + "".join(o.data.get("text/plain", "") for o in shown.outputs)
    cap.raw = raw_json(cap.dir / "kineto_trace_0.json")
    return cap


# -- 1. memory: header == curve == category chart ------------------------------------------------
def check_memory_tab(dash: Dashboard, raw: dict[str, Any]) -> dict[str, float]:
    """The Memory header, the curve and the category chart against the raw events; the peak
    time (ms) per device."""
    facts = dict(dash.section("memory").facts)
    html = dash.info_html("memory")
    figs = dash.figures("memory")
    curve = figs[0]
    when = {}
    for device, events in memory_events(raw).items():
        peak = max(e["args"]["Total Allocated"] for e in events)
        # torch's CPU counter is process-wide and keeps the bytes of tensors made under an
        # earlier profile_memory session but freed outside one: ``start`` depends on what ran
        # before in this process (3,856 B after test_analysis_a's capture)
        start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
        header = facts[f"peak {device}"]
        shown_peak, shown_start = sizes(header)[:2]
        assert rounds_to(shown_peak, peak) and "already allocated at the capture's start" in header, header
        assert rounds_to(shown_start, start) if start else shown_start[0] == 0, header
        assert header.split(" (")[0] in html  # the widget shows it
        (line,) = [t for t in curve["data"] if t["name"] == f"{device} allocated"]
        y = decode(line["y"]) * y_scale(curve)
        assert close(y.max(), peak, 0.005)
        x = decode(line["x"])
        when[device] = float(x[int(np.argmax(y))])
        (mark,) = [a for a in curve["layout"]["annotations"] if a["text"].startswith(f"peak {header.split(' (')[0]}")]
        assert mark["x"] == pytest.approx(when[device])
    return when


def test_memory_header_curve_and_categories_agree_on_a_capture(capture: Any) -> None:
    dash = Dashboard(capture.trace)
    when = check_memory_tab(dash, capture.raw)
    figs = dash.figures("memory")
    assert len(figs) == 2 and figs[1]["layout"]["title"]["text"] == "Memory by category"
    stacked = [t for t in figs[1]["data"] if t.get("stackgroup")]
    x = decode(stacked[0]["x"])
    at = int(np.searchsorted(x, when["cpu"] + 1e-9)) - 1  # the stack after the peak's event
    total = sum(decode(t["y"])[at] for t in stacked) * y_scale(figs[1])
    peak = max(e["args"]["Total Allocated"] for e in memory_events(capture.raw)["cpu"])
    assert close(total, peak, 0.005), (total, peak)
    # the tensors made before the capture that the CPU allocator never counted are named, not stacked
    rows = raw_json(capture.dir / "memory_timeline_0.json")
    before = sum(r[2] for r in rows if r[0] < 0)
    start = memory_events(capture.raw)["cpu"][0]
    start = start["args"]["Total Allocated"] - start["args"]["Bytes"]
    if before > start:
        named = dict(dash.section("memory").facts)["not in the allocator's totals"]
        shown = sizes(named)
        assert rounds_to((sum(v for v, _ in shown), sum(h for _, h in shown)), before) and "parameter" in named
        assert not any(t["name"] == "parameter" for t in stacked)


def test_memory_header_and_curve_agree_on_a_gpu_trace(tmp_path: Path) -> None:
    trace = tracemagic.load(TRACELENS, cache_dir=tmp_path)
    when = check_memory_tab(Dashboard(trace), raw_json(TRACELENS))
    assert set(when) == {"cpu", "cuda:0"}


# -- 2. the step selector filters every widget ----------------------------------------------------
def test_step_selector_filters_every_widget(capture: Any) -> None:
    raw = capture.raw
    steps = profiler_steps(raw)
    dash = Dashboard(capture.trace)
    assert [v for _, v in dash.controls["step"].options] == ["all", 2, 3, 4]  # not the loop's exit
    everything = dash.section("overview")
    step = 3
    dash.controls["step"].value = step
    row = steps[step]
    lo, hi = row["ts"], row["ts"] + row["dur"]
    inside = [e for e in raw["traceEvents"] if e.get("ph") == "X" and lo <= e["ts"] and e["ts"] + e.get("dur", 0) <= hi]

    overview = dash.section("overview")
    facts = dict(overview.facts)
    (shown,) = [v * TIMES[u] for v, u, _ in quantities(facts[f"step {step}"]) if u in TIMES]
    assert close(shown, row["dur"], 0.005)
    assert f"step {step}" in dash.info_html("overview")
    extra = dict(overview.extra)
    layers = extra[f"Top layers in step {step}"]
    modules: dict[str, int] = {}
    for e in inside:
        if e["name"].startswith("nn.Module: "):
            modules[e["name"]] = modules.get(e["name"], 0) + 1
    assert sorted(layers["calls"]) == sorted(modules.values())
    assert sorted(dict(everything.extra)["Top layers"]["calls"]) == sorted(3 * c for c in modules.values())
    ops = extra[f"Top ops in step {step}"]
    calls: dict[str, int] = {}
    folded = folded_by_torch(inside)  # aten::sum inside aten::sum is one call, as in key_averages
    for i, e in enumerate(inside):
        if e.get("cat") == "cpu_op" and i not in folded:
            calls[e["name"]] = calls.get(e["name"], 0) + 1
    assert {n: c for n, c in zip(ops["name"], ops["calls"])} == {n: calls[n] for n in ops["name"]}

    # the Memory header: this step's peak, what was allocated at its start, and when
    events = memory_events(raw, lo, hi)["cpu"]
    peak = max(e["args"]["Total Allocated"] for e in events)
    first_peak = next(e for e in events if e["args"]["Total Allocated"] == peak)
    header = dict(dash.section("memory").facts)[f"peak cpu in step {step}"]
    shown_peak, shown_start = sizes(header)[:2]
    assert rounds_to(shown_peak, peak) and "already allocated at the step's start" in header, header
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    assert rounds_to(shown_start, start) if start else shown_start[0] == 0, header
    (at,) = [v * TIMES[u] for v, u, _ in quantities(header.split(") at ")[1]) if u in TIMES]
    origin = min(e["ts"] for e in raw["traceEvents"] if e.get("ph") in ("X", "i") and "ts" in e)
    assert abs(at - (first_peak["ts"] - origin)) <= 0.005 * at + 1
    assert sizes(dict(overview.facts)[f"peak memory in step {step}"])[0] == shown_peak
    assert f"peak cpu in step {step}" in dash.info_html("memory")
    # the Layers tab too; the Shapes tab says it shows every step
    table = dash.table("layers").frame
    assert sorted(table["calls"]) == sorted(modules.values()) and f"in step {step}" in dash.table("layers").caption
    assert "all steps" in dict(dash.section("shapes").facts)["steps"]
    # the timeline shows this step's window
    dash.select("timeline")
    lo_shown, hi_shown = dash.figures("timeline")[0]["layout"]["meta"]["window"]
    assert hi_shown - lo_shown == pytest.approx(row["dur"], abs=1e-3)
    assert f"step {step}" in dash.figures("timeline")[0]["layout"]["title"]["text"]


# -- 3. 'mean step' counts the loop's steps only ---------------------------------------------------
def test_mean_step_leaves_out_the_loop_exit(capture: Any) -> None:
    steps = profiler_steps(capture.raw)
    complete = [steps[s]["dur"] for s in (2, 3, 4)]
    every = [*complete, steps[5]["dur"]]
    assert not close(np.mean(every), np.mean(complete), 0.01)  # the exit step would change the mean
    facts = dict(Dashboard(capture.trace).section("overview").facts)
    (mean,) = [v * TIMES[u] for v, u, _ in quantities(facts["mean step"].split(" (")[0]) if u in TIMES]
    assert close(mean, np.mean(complete), 0.005)
    assert "step 5 holds only the loop's exit" in facts["steps"]
    assert f"mean step: {facts['mean step']}" in capture.shown  # the capture's display says the same


# -- 4. recommendations fit the trace and quote the page -------------------------------------------
def page_quantities(section: Any) -> list[tuple[float, str]]:
    """Every quantity the Overview shows: its facts, and its tables' cells in their units."""
    found = [(v, u) for _, value in section.facts for v, u, _ in quantities(value)]
    frames = [section.table, *(frame for _, frame in section.extra)]
    for frame in frames:
        for column in frame.columns:
            if not pd.api.types.is_numeric_dtype(frame[column]) or pd.api.types.is_bool_dtype(frame[column]):
                continue
            unit = "ms" if column.endswith("_ms") else "%" if column.endswith("pct") else " calls" if column == "calls" else None
            if unit:
                found += [(float(v), unit.strip()) for v in frame[column].dropna()]
    return found


def check_quoted(section: Any) -> None:
    shown = page_quantities(section)
    for bullet in section.bullets:
        # a rule's threshold is the rule's constant (``analysis.advice``), not a figure of the trace
        for value, unit, half in quantities(re.sub(r"\(threshold [^)]*\)", "", bullet)):
            if unit in TIMES:
                ok = any(u in TIMES and abs(v * TIMES[u] - value * TIMES[unit]) <= half * TIMES[unit] + 1e-9 for v, u in shown)
            elif unit in BYTES:
                ok = any(u in BYTES and abs(v * BYTES[u] - value * BYTES[unit]) <= half * BYTES[unit] for v, u in shown)
            else:
                ok = any(u == unit and abs(v - value) <= half + 1e-9 for v, u in shown)
            assert ok, f"{value} {unit} of {bullet!r} is not on the page"


def test_cpu_only_trace_gets_no_device_copy_advice(ip: Any) -> None:
    body = "x = torch.randn(512, 512)\nfor i in range(5):\n    y = x.to(torch.float64)\n    z = y.to(torch.float32)\n"
    with capture_output() as shown:
        result = ip.run_cell(f"%%chakra_trace -q --no-memory-timeline\n{body}")
    assert result.success, shown.stdout
    trace = ip.user_ns["_chakra_capture"].trace
    assert not trace.has_gpu
    section = Dashboard(trace).section("overview")
    raw = raw_json(ip.user_ns["_chakra_capture"].dir / "kineto_trace_0.json")
    names = {e["name"] for e in raw["traceEvents"] if e.get("cat") == "cpu_op"}
    assert "aten::copy_" in names
    (copy,) = [b for b in section.bullets if "aten::copy_" in b or "aten::_to_copy" in b or "aten::to " in b]
    assert "dtype" in copy
    assert not any(re.search(r"host/device|on the device|GPU|\.item\(\) waits", b) for b in section.bullets), section.bullets
    check_quoted(section)


@pytest.mark.parametrize("path", [TRACELENS, NCCL], ids=["tracelens", "nccl"])
def test_recommendations_quote_the_overview(path: Path, tmp_path: Path) -> None:
    dash = Dashboard(tracemagic.load(path, cache_dir=tmp_path))
    section = dash.section("overview")
    assert section.bullets
    check_quoted(section)


def test_recommendations_of_a_capture_quote_the_overview(capture: Any) -> None:
    dash = Dashboard(capture.trace)
    check_quoted(dash.section("overview"))
    dash.controls["step"].value = 3
    check_quoted(dash.section("overview"))


def test_step_selector_filters_the_kernels_tab(tmp_path: Path) -> None:
    raw = raw_json(NCCL)
    steps = profiler_steps(raw)
    launches = {e["args"]["correlation"]: e["ts"] for e in raw["traceEvents"]
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    per_step: dict[int, int] = {}
    for e in raw["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            ts = launches.get(e["args"].get("correlation"))
            for number, row in steps.items():
                if ts is not None and row["ts"] <= ts <= row["ts"] + row["dur"]:
                    per_step[number] = per_step.get(number, 0) + 1
    dash = Dashboard(tracemagic.load(NCCL, cache_dir=tmp_path))
    step = sorted(steps)[1]
    dash.controls["step"].value = step
    table = dash.table("kernels")
    assert int(table.frame["calls"].sum()) == per_step[step] and f"in step {step}" in table.caption
    dash.controls["step"].value = "all"
    assert int(dash.table("kernels").frame["calls"].sum()) >= sum(per_step.values()) > per_step[step]
