"""``trace.sites()``: the user code behind each op, kernel and allocation, the "where" column of
the Kernels, Shapes, Roofline and Memory views, Triton kernels' generated files; checked
against computations written here from the raw trace JSON."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import TRACES, run_in_kernel

import tracemagic
from tracemagic.analysis.schema import TABLES
from tracemagic.trace.shared_keys import Shared
from tracemagic.views import sections
from tracemagic.views.data import TraceData

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MI300X = "tracelens_normalization_layer_test.json.gz"  # python_function frames
V100 = "kineto_worker0.1623143089861.pt.trace.json.gz"  # old ``Call stack`` strings
TRITON = "hta_triton_example.json.gz"  # a torch.compile Triton kernel
FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")


def raw(name: str) -> list[dict[str, Any]]:
    with gzip.open(TRACES / name) as f:
        return json.load(f)["traceEvents"]


def innermost(candidates: list[dict[str, Any]], at: dict[str, Any]) -> dict[str, Any] | None:
    """The latest-starting (then shortest) of ``candidates`` on ``at``'s thread whose interval
    holds ``at``'s start."""
    inside = [
        c
        for c in candidates
        if (c["pid"], c["tid"]) == (at["pid"], at["tid"]) and c["ts"] <= at["ts"] < c["ts"] + c["dur"]
    ]
    return max(inside, key=lambda c: (c["ts"], -c["dur"])) if inside else None


def launching_calls(
    events: list[dict[str, Any]], runtime_cat: str, gpu_cats: tuple[str, ...]
) -> dict[int, dict[str, Any]]:
    """GPU activity (kernels, memcpy, memset) correlation id -> the runtime call that launched it."""
    calls = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == runtime_cat and "correlation" in e.get("args", {})
    }
    return {
        k["args"]["correlation"]: calls[k["args"]["correlation"]]
        for k in events
        if k.get("cat") in gpu_cats and k["args"].get("correlation") in calls
    }


def kernel_sites(trace: tracemagic.Trace) -> dict[int, tuple[str, str, int]]:
    """Kernel correlation id -> (function, file, line) of ``trace.sites()``."""
    kernels = trace.kernels()
    table = trace.sites().set_index("row")
    out = {}
    for row, correlation in zip(kernels["row"], kernels["correlation"]):
        site = table.loc[int(row)]
        if isinstance(site["where"], str):
            out[int(correlation)] = (str(site["function"]), str(site["file"]), int(site["line"]))
    return out


def test_kernels_of_the_mi300x_trace_name_the_user_function_above_their_launch() -> None:
    events = raw(MI300X)
    # user code: the one script of the run (every other frame is torch's, the standard library's or a built-in)
    user = [
        e
        for e in events
        if e.get("cat") == "python_function" and e.get("ph") == "X" and e["name"].startswith("test_perf_model.py(")
    ]
    expected = {}
    for correlation, call in launching_calls(events, "cuda_runtime", ("kernel", "gpu_memset", "gpu_memcpy")).items():
        frame = innermost(user, call)
        if frame is not None:
            found = FRAME.match(frame["name"])
            assert found
            expected[correlation] = (found["func"], found["file"], int(found["line"]))
    trace = tracemagic.load(TRACES / MI300X, use_cache=False)
    got = kernel_sites(trace)
    assert len(expected) >= 50 and got == expected
    assert Counter(f for f, _, _ in got.values()).most_common(1)[0][0] == "forward"


def test_kernels_of_the_v100_trace_name_their_call_stack_line() -> None:
    events = raw(V100)
    stacked = [e for e in events if e.get("cat") == "Operator" and e.get("args", {}).get("Call stack")]
    expected = {}
    for correlation, call in launching_calls(events, "Runtime", ("Kernel", "Memset", "Memcpy")).items():
        op = innermost(stacked, call)
        if op is None:
            continue
        entries = [FRAME.match(s) for s in op["args"]["Call stack"].split(";") if s]
        user = next((m for m in entries if m and "site-packages" not in m["file"]), None)
        if user is not None:
            expected[correlation] = (user["func"], user["file"], int(user["line"]))
    trace = tracemagic.load(TRACES / V100, use_cache=False)
    got = kernel_sites(trace)
    assert len(expected) >= 1000
    agree = sum(got.get(k) == v for k, v in expected.items())
    assert agree == len(expected) and set(got) == set(expected)
    assert {f for _, f, _ in got.values()} == {"resnet50_profiler_api.py"}


def test_sites_are_computed_only_when_asked() -> None:
    trace = tracemagic.load(TRACES / MI300X, use_cache=False)
    for table in (trace.ops, trace.kernels, trace.shapes, trace.memory, trace.efficiency, trace.layers):
        table()
    assert Shared.SITES not in trace._shared
    sites = trace.sites()
    assert Shared.SITES in trace._shared
    assert list(sites.columns) == TABLES["sites"].names


def test_the_views_show_where_in_the_kernels_shapes_roofline_and_memory_tables() -> None:
    trace = tracemagic.load(TRACES / MI300X, use_cache=False)
    data = TraceData(trace)
    sites = trace.sites().set_index("row")
    kernels = trace.kernels()
    for key in ("kernels", "shapes", "roofline", "memory"):
        table = sections.build(key, data).table
        assert "where" in table.columns, key
        assert table["where"].str.contains("test_perf_model.py:").any(), key
    # the kernels table: each kernel + op row names the sites of its kernels, most GPU time first
    # the full kernel name is the table's last column, "signature" (its readable name leads)
    table = sections.build("kernels", data).table
    for row in table.head(10).itertuples():
        mine = kernels[
            (kernels["name"].astype(str) == row.signature) & (kernels["op"].astype("string").fillna("") == row.op)
        ]
        weights: Counter[str] = Counter()
        for r, dur in zip(mine["row"], mine["dur"]):
            w = sites.loc[int(r), "where"]
            if isinstance(w, str):
                weights[w] += dur
        listed = [w for w, _ in sorted(weights.items(), key=lambda kv: -kv[1])]
        assert row.where == ", ".join(listed[:2]) + (f" (+{len(listed) - 2})" if len(listed) > 2 else "")
    # the roofline's hover names the code
    fig = sections.build("roofline", data).figures[0]
    points = [t for t in fig.data if t.mode == "markers"]
    assert points and all("code %{customdata[7]}" in t.hovertemplate for t in points)
    assert any("test_perf_model.py" in str(c[7]) for t in points for c in t.customdata)
    # the memory peak's fact names the code of the event that reached it
    facts = dict(sections.build("memory", data).facts)
    assert "test_perf_model.py:" in facts["peak cuda:0"]


def test_a_triton_kernel_shows_its_generated_file_and_compiled_region() -> None:
    # torch writes ``kernel_file`` on the op launching a Triton kernel
    # (torch/_inductor/runtime/triton_heuristics.py, get_profiler_kwargs) inside the
    # ``Torch-Compiled Region: F/N`` op of TorchDynamo (torch/_dynamo/convert_frame.py)
    events = raw(TRITON)
    launch = next(e for e in events if e.get("cat") == "cpu_op" and "kernel_file" in e.get("args", {}))
    region = next(e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("Torch-Compiled Region"))
    assert region["ts"] <= launch["ts"] < region["ts"] + region["dur"]
    kernel = next(
        e for e in events if e.get("cat") == "kernel" and e["args"]["External id"] == launch["args"]["External id"]
    )
    trace = tracemagic.load(TRACES / TRITON, use_cache=False)
    sites = trace.sites()
    row = sites[(sites["kind"] == "kernel")].iloc[0]
    assert trace.events["name"].iat[int(row["row"])] == kernel["name"]
    assert row["kernel_file"] == launch["args"]["kernel_file"]
    assert row["compiled_region"] == region["name"]
    table = sections.build("kernels", TraceData(trace)).table
    assert table.loc[0, "kernel_file"] == launch["args"]["kernel_file"]
    assert table.loc[0, "compiled_region"] == region["name"]
    # a trace without torch.compile has no such columns in its kernels table
    assert "kernel_file" not in sections.build("kernels", TraceData(tracemagic.load(TRACES / MI300X))).table


#: a loop where line 3 multiplies, line 4 allocates 16 MB
BODY = """\
for i in range(4):
    a = big @ big
    b = torch.empty(4_000_000)
    c = a.sum()
"""


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sites")
    out = folder / "traces"
    run_in_kernel(
        [
            "%load_ext tracemagic\nimport torch\nbig = torch.randn(200, 200)",
            f"%%chakra_trace -q --cpu-only --wait 0 --warmup 1 --active 2 --no-memory-timeline --out {out} --name s\n"
            + BODY,
        ],
        folder,
    )
    (found,) = list(out.iterdir())
    return found


def test_a_magic_capture_names_the_cell_line_of_each_op_and_allocation(capture: Path) -> None:
    events = json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
    marks = [e for e in events if e.get("ph") == "X" and e["name"].startswith("tracemagic.line:")]
    expected: Counter[tuple[str, int | None]] = Counter()
    for e in events:
        op = e.get("cat") == "cpu_op" and e.get("ph") == "X" and not e["name"].startswith("tracemagic.line:")
        if op or e.get("cat") == "cpu_instant_event":  # the ops and the [memory] events
            mark = innermost(marks, e)
            expected[(e["name"], int(mark["name"].split(":")[1]) if mark else None)] += 1
    trace = tracemagic.load(capture, use_cache=False)
    sites = trace.sites()
    names = trace.events["name"]
    got = Counter(
        (str(names.iat[int(row)]), int(line) if site == "line" else None)
        for row, line, site in zip(sites["row"], sites["line"], sites["site"])
    )
    assert got == expected
    assert {line for _, line in got} >= {3, 4, 5}
    texts = dict(enumerate(json.loads((capture / "capture.json").read_text())["cell"].splitlines(), start=2))
    # the views: the 16 MB allocation is line 4's, the matmul's shapes row line 3's
    data = TraceData(trace)
    allocations = sections.build("memory", data).table
    biggest = allocations.sort_values("bytes", ascending=False).iloc[0]
    assert biggest["bytes"] == 16_000_000 and biggest["where"] == f"line 4 `{texts[4].strip()}`"
    shapes = sections.build("shapes", data).table
    mm = shapes[shapes["name"].isin(["aten::mm", "aten::matmul"])]
    assert not mm.empty and (mm["where"] == f"line 3 `{texts[3].strip()}`").all()


def test_the_dashboards_flame_search_box_highlights_the_matching_boxes() -> None:
    import html

    from tracemagic.views.dashboard import Dashboard

    dash = Dashboard(tracemagic.load(TRACES / MI300X, use_cache=False))
    before = dash.figures("flame")
    labels = [html.unescape(str(label)).lower() for label in before[0]["data"][0]["labels"]]
    wanted = [i for i, label in enumerate(labels) if "forward" in label]
    assert wanted and len(wanted) < len(labels)
    box = dash._tabs["flame"]["search"]
    box.value = "FORWARD"  # as typed in the Text widget
    shown = dash.figures("flame")
    colors = list(shown[0]["data"][0]["marker"]["colors"])
    assert [i for i, c in enumerate(colors) if c == "#2b7bff"] == wanted
    assert all(c == "#e6e6e6" for i, c in enumerate(colors) if i not in wanted)
    every = sum(
        "forward" in html.unescape(str(label)).lower()
        for fig in before
        for t in fig["data"]
        if t.get("type") == "icicle"
        for label in t["labels"]
    )
    assert dash._tabs["flame"]["hits"].value == f"{every:,} boxes match"
    box.value = ""
    again = dash.figures("flame")[0]["data"][0]["marker"]
    assert again.get("showscale") == before[0]["data"][0]["marker"].get("showscale")
    assert not isinstance(again["colors"], list) or not any(c == "#2b7bff" for c in again["colors"])
    # the Layers tab's icicle gets no search box
    dash.select("layers")
    assert "search" not in dash._tabs["layers"]


def test_a_failing_site_lookup_costs_the_column_not_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracemagic.analysis import sites as sites_module

    def broken(trace: Any) -> Any:
        raise RuntimeError("no sites")

    monkeypatch.setattr(sites_module, "site_codes", broken)
    data = TraceData(tracemagic.load(TRACES / MI300X, use_cache=False))
    for key in ("kernels", "shapes", "roofline", "memory"):
        table = sections.build(key, data).table
        assert len(table) and "where" not in table.columns, key
    assert data.problems and all("no sites" in v for v in data.problems.values())


def _autocast_call(linear: Any, x: Any) -> Any:
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16):
        return linear(x)


def _plain_call(linear: Any, x: Any) -> Any:
    return linear(x)


def test_a_roofline_row_names_only_the_code_of_its_own_calls_autocast_or_plain(tmp_path: Path) -> None:
    """The same float32 ``aten::linear`` (same input dims and dtypes) called under
    ``torch.autocast(bfloat16)`` from one function and plainly from another: two rows of
    ``efficiency()`` (the precision its math ran in parts them), each naming only the
    function its own calls came from, found here from the raw trace's python_function frames."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    linear, x = torch.nn.Linear(64, 32), torch.randn(16, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        for _ in range(3):
            _autocast_call(linear, x)
        for _ in range(2):
            _plain_call(linear, x)
    path = tmp_path / "autocast_and_plain.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    frames = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "python_function" and e["name"].startswith("test_sites.py(")
    ]
    linears = [e for e in ops if e["name"] == "aten::linear"]
    outer = [e for e in linears if e["args"]["Input type"][0] == "float"]
    expected: dict[str, set[str]] = {"bf16": set(), "fp32": set()}
    for e in outer:
        inner = [i for i in linears if i is not e and e["ts"] <= i["ts"] < e["ts"] + e["dur"]]
        precision = "bf16" if any(i["args"]["Input type"][0] == "c10::BFloat16" for i in inner) else "fp32"
        frame = FRAME.match(innermost(frames, e)["name"])  # type: ignore[index]
        assert frame
        expected[precision].add(f"{frame['func']} · {Path(frame['file']).name}:{frame['line']}")
    # the recording is what the test is about: one function per precision, same dims and dtypes
    assert len(outer) == 5 and len({json.dumps(e["args"]["Input Dims"]) for e in outer}) == 1
    assert len({json.dumps(e["args"]["Input type"]) for e in outer}) == 1
    assert [len(v) for v in expected.values()] == [1, 1] and expected["bf16"] != expected["fp32"]
    assert any(w.startswith("_autocast_call ·") for w in expected["bf16"])
    trace = tracemagic.load(path, cache_dir=tmp_path)
    table = TraceData(trace).efficiency_where()
    rows = table[(table["name"] == "aten::linear") & table["input_type"].str.startswith('["float"')]
    assert sorted(rows["precision"]) == ["bf16", "fp32"]
    for row in rows.itertuples():
        assert set(row.where.split(", ")) == expected[row.precision], row.precision
    # the roofline's hover takes the same text, row for row
    assert table.attrs["where"] == table["where"].fillna("").astype(str).tolist()
