"""Line marks of ``%%chakra_trace`` cells, ``trace.lines()``, ``trace.syncs()``, the advice naming
lines and the Source tab: checked against computations written here from the raw trace JSON."""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TRACES, run_in_kernel

import tracemagic
from tracemagic.analysis.schema import TABLES

PREFIX = "tracemagic.line:"
#: a loop where line 3 dominates CPU time, line 4 allocates the most, line 5 syncs every step
BODY = """\
for i in range(6):
    a = big @ big
    b = torch.empty(4_000_000)
    c = small.sum().item()
    if i % 2:
        d = small * 2
    else:
        continue
    e = d + 1
"""
#: the same loop without the ``.item()``
QUIET = BODY.replace("    c = small.sum().item()\n", "    c = small.sum()\n")
HEAD = "%%chakra_trace -q --cpu-only --wait 1 --warmup 1 --active 3 --no-memory-timeline --out {out} --name {name}"
SETUP = ("%load_ext tracemagic\nimport torch\ntorch.manual_seed(0)\n"
         "big = torch.randn(600, 600)\nsmall = torch.randn(8, 8)")


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two captures made in a real Jupyter kernel: with line marks, and ``--no-lines``
    without the ``.item()``."""
    folder = tmp_path_factory.mktemp("lines")
    out = folder / "traces"
    run_in_kernel([SETUP, HEAD.format(out=out, name="marked") + "\n" + BODY,
                   HEAD.format(out=out, name="plain") + " --no-lines\n" + QUIET], folder)
    found = {p.name.split("-")[0]: p for p in out.iterdir()}
    assert set(found) == {"marked", "plain"}, found
    return found


def raw(capture: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The Kineto events and the manifest of a capture directory, as written."""
    events = json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
    return events, json.loads((capture / "capture.json").read_text())


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def counted_steps(events: list[dict[str, Any]], manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The ProfilerStep events of the whole steps (the manifest's ``end == "step"``)."""
    whole = {s["step"] for s in manifest["steps"] if s["end"] == "step"}
    return [e for e in events if e.get("name", "").startswith("ProfilerStep#") and int(e["name"][13:]) in whole]


def within(e: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= outer["ts"] + outer["dur"]


def test_lines_match_the_raw_marks_and_rank_the_known_lines(captures: dict[str, Path]) -> None:
    events, manifest = raw(captures["marked"])
    assert manifest["line_marks"]["marked"] is True
    # line 2 (the stepped loop) is marked around its fetch of each item only; 9 (continue) not at all
    assert manifest["line_marks"]["lines"] == [2, 3, 4, 5, 6, 7, 10]
    steps = counted_steps(events, manifest)
    assert len(steps) == 3
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    marks = [m for m in marks if any(within(m, s) for s in steps)]
    by_line: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for m in marks:
        by_line[int(m["name"][len(PREFIX):])].append(m)
    n = len(steps)
    mean_step = sum(s["dur"] for s in steps) / n
    memory = [e for e in events
              if e.get("name") == "[memory]" and any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)]

    lines = tracemagic.load(captures["marked"]).lines()
    assert list(lines.columns) == TABLES["lines"].names
    assert lines["line"].tolist() == sorted(by_line)
    cell = manifest["cell"].splitlines()
    for _, row in lines.iterrows():
        mine = by_line[int(row["line"])]
        assert row["text"] == cell[int(row["line"]) - 2]
        assert row["calls"] == pytest.approx(len(mine) / n)
        cpu = union([(m["ts"], m["ts"] + m["dur"]) for m in mine]) / n
        assert row["cpu_us"] == pytest.approx(cpu, rel=1e-6, abs=1e-3)
        assert row["step_pct"] == pytest.approx(100 * cpu / mean_step, rel=1e-6)
        allocated = sum(e["args"]["Bytes"] for e in memory if e["args"]["Bytes"] > 0
                        and any(m["ts"] <= e["ts"] < m["ts"] + m["dur"] for m in mine))
        assert row["alloc_bytes"] == pytest.approx(allocated / n)
        assert row["gpu_us"] == 0
    # nesting: the `if` line holds line 7, its self time does not
    row = lines.set_index("line")
    inner = union([(m["ts"], m["ts"] + m["dur"]) for m in by_line[7]]) / n
    assert row.at[6, "self_cpu_us"] == pytest.approx(row.at[6, "cpu_us"] - inner, rel=1e-6, abs=1e-3)
    assert row.at[7, "parent_line"] == 6 and row.at[3, "parent_line"] == -1
    # the known ranking
    assert int(lines.loc[lines["self_cpu_us"].idxmax(), "line"]) == 3
    assert int(lines.loc[lines["alloc_bytes"].idxmax(), "line"]) == 4
    assert row.at[4, "alloc_bytes"] >= 16_000_000
    assert int(lines.loc[lines["peak_bytes"].idxmax(), "line"]) == 4


#: a DataLoader whose batches cost far more than the loop's body; a generator that raises
LOADER_SETUP = """\
%load_ext tracemagic
import torch
from torch.utils.data import DataLoader, Dataset
torch.manual_seed(0)
class Squares(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        x = torch.randn(160, 160)
        return (x @ x).sum(0)
loader = DataLoader(Squares(), batch_size=8)
w = torch.randn(160, 4)
def batches():
    for k in range(6):
        if k == 3:
            y = 1 / 0
        yield torch.ones(2)
"""
LOADER_HEAD = "%%chakra_trace -q --cpu-only --wait 1 --warmup 1 --active 3 --no-memory-timeline --out {out} --name {name}"


@pytest.fixture(scope="module")
def loader_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """In a real Jupyter kernel: a capture of a loop over a DataLoader, and the traceback of
    a loop whose iterable raises (as the notebook shows it, colours stripped)."""
    folder = tmp_path_factory.mktemp("loader")
    out = folder / "traces"
    nb = run_in_kernel([
        LOADER_SETUP,
        LOADER_HEAD.format(out=out, name="loader") + "\nfor x in loader:\n    y = x @ w\n",
        LOADER_HEAD.format(out=out, name="raising") + "\nfor b in batches():\n    c = b * 2\n",
    ], folder, allow_errors=True)
    (error,) = [o for o in nb.cells[2].outputs if o.get("output_type") == "error"]
    (capture,) = out.glob("loader-*")
    return capture, "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in error["traceback"])


def test_a_for_loops_fetch_of_each_batch_is_its_lines_time(loader_run: tuple[Path, str]) -> None:
    """The DataLoader's work for each batch runs under the ``for`` line's mark (as a line
    profiler counts a loop header), and ``lines()`` gives that line the marks' time."""
    capture, _ = loader_run
    events, manifest = raw(capture)
    assert manifest["line_marks"]["lines"] == [2, 3]
    steps = counted_steps(events, manifest)
    assert len(steps) == 3
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == f"{PREFIX}2" and any(within(e, s) for s in steps)]
    assert len(marks) == 3  # one fetch a step, each inside it
    fetches = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("enumerate(DataLoader)#")
               and any(within(e, s) for s in steps)]
    assert len(fetches) == 3 and all(any(within(f, m) for m in marks) for f in fetches)
    body = [e for e in events if e.get("ph") == "X" and e.get("name") == f"{PREFIX}3"]
    assert body and not any(within(b, m) for b in body for m in marks)  # the body is not the fetch's

    lines = tracemagic.load(capture).lines().set_index("line")
    fetch_us = union([(m["ts"], m["ts"] + m["dur"]) for m in marks]) / 3
    assert lines.at[2, "cpu_us"] == pytest.approx(fetch_us, rel=1e-6)
    assert lines.at[2, "self_cpu_us"] == pytest.approx(fetch_us, rel=1e-6)
    assert lines.at[2, "cpu_us"] >= sum(f["dur"] for f in fetches) / 3
    assert lines.at[3, "parent_line"] == -1
    assert lines["self_cpu_us"].idxmax() == 2  # the batches cost more than `y = x @ w`


def test_an_iterable_that_raises_shows_the_cells_line_and_its_own_not_ours(loader_run: tuple[Path, str]) -> None:
    _, traceback = loader_run
    # IPython's arrows: "----> 2 for ..." (padded to the widest line number: "---> 16 ...")
    arrows = [re.split(r"-+> *\d+ ", line, maxsplit=1)[1].strip() for line in traceback.splitlines()
              if re.match(r"\s*-+> *\d+ ", line)]
    assert arrows[-2:] == ["for b in batches():", "y = 1 / 0"]  # the cell's line, then the generator's
    assert "tracemagic" not in traceback  # no frame of ours between them
    assert traceback.rstrip().endswith("ZeroDivisionError: division by zero")


def test_the_call_tree_and_folded_stacks_name_marks_by_their_cell_line(captures: dict[str, Path]) -> None:
    """The flame graph and the folded stacks name a line mark as the Source tab does
    (``line 3 `a = big @ big```, the text from the manifest's cell), never by its raw
    annotation name; each line's nodes merge every raw mark of it."""
    capture = captures["marked"]
    cell = json.loads((capture / "capture.json").read_text())["cell"].splitlines()
    raw = json.loads(next(capture.glob("kineto_trace_*.json")).read_text())
    marks = defaultdict(list)
    for event in raw["traceEvents"]:
        if event.get("ph") == "X" and str(event.get("name", "")).startswith(PREFIX):
            marks[int(event["name"][len(PREFIX):])].append((event["ts"], event["ts"] + event["dur"]))
    trace = tracemagic.load(capture)
    tree = trace.call_tree()
    assert not tree["name"].str.startswith(PREFIX).any()
    for number, spans in marks.items():
        label = f"line {number} `{cell[number - 2].strip()}`"
        nodes = tree[tree["name"] == label]
        assert len(nodes), label
        assert nodes["calls"].sum() == len(spans)
    from tracemagic.export.stacks import folded as folded_stacks

    folded = folded_stacks(trace)
    assert any("line 3 `a = big @ big`" in line for line in folded)


def test_bytes_live_at_the_peak_match_the_raw_allocations(captures: dict[str, Path]) -> None:
    events, _ = raw(captures["marked"])
    memory = [e for e in events if e.get("name") == "[memory]"]
    peak = max(memory, key=lambda e: e["args"]["Total Allocated"])
    live: dict[int, dict[str, Any]] = {}
    for e in sorted(memory, key=lambda e: e["ts"]):
        if e["ts"] > peak["ts"]:
            break
        if e["args"]["Bytes"] > 0:
            live[e["args"]["Addr"]] = e
        elif e["args"]["Bytes"] < 0:
            live.pop(e["args"]["Addr"], None)
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    held: dict[int, int] = defaultdict(int)
    for e in live.values():
        for line in {int(m["name"][len(PREFIX):]) for m in marks if m["ts"] <= e["ts"] < m["ts"] + m["dur"]}:
            held[line] += e["args"]["Bytes"]
    lines = tracemagic.load(captures["marked"]).lines().set_index("line")
    for line in lines.index:
        assert lines.at[line, "peak_bytes"] == held.get(line, 0), line
    assert held[4] >= 16_000_000


def test_no_lines_leaves_the_trace_unmarked_and_the_table_empty(captures: dict[str, Path]) -> None:
    events, manifest = raw(captures["plain"])
    assert manifest["line_marks"]["marked"] is False and manifest["line_marks"]["lines"] == []
    assert not [e for e in events if str(e.get("name", "")).startswith(PREFIX)]
    trace = tracemagic.load(captures["plain"])
    lines = trace.lines()
    assert lines.empty and list(lines.columns) == TABLES["lines"].names
    from tracemagic.views.data import TraceData
    from tracemagic.views.sections import available

    assert "source" not in available(TraceData(trace))
    assert "source" in available(TraceData(tracemagic.load(captures["marked"])))


def test_no_table_caption_asks_for_a_header_click(captures: dict[str, Path]) -> None:
    """The dashboard's tables sort with their own "sort" menu (a header click does nothing in the
    widget), so no caption may tell the user to click a column (the Source tab's did)."""
    from tracemagic.views import Dashboard

    dash = Dashboard(tracemagic.load(captures["marked"]), force_widget=True)
    assert "source" in dash.keys
    for key in dash.keys:
        assert "click" not in dash.table(key).caption, (key, dash.table(key).caption)


def test_the_sync_detector_finds_the_item_of_every_step_and_names_its_line(captures: dict[str, Path]) -> None:
    events, _ = raw(captures["marked"])
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    items = [e for e in events if e.get("name") == "aten::item" and any(within(e, s) for s in steps)]
    assert len(items) == 3
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    syncs = tracemagic.load(captures["marked"]).syncs()
    assert list(syncs.columns) == TABLES["syncs"].names
    assert len(syncs) == len(items)
    assert syncs["what"].tolist() == ["item"] * 3 and syncs["name"].tolist() == ["aten::item"] * 3
    for item, (_, row) in zip(sorted(items, key=lambda e: e["ts"]), syncs.iterrows()):
        (mark,) = [m for m in marks if within(item, m)]
        assert row["line"] == int(mark["name"][len(PREFIX):]) == 5
        assert row["dur"] == pytest.approx(item["dur"])
    # a CPU-only capture: the host never waits for a GPU
    assert not syncs["gpu_wait"].any() and (syncs["stall_us"] == 0).all()
    assert syncs["where"].iloc[0] == "line 5 `c = small.sum().item()`"
    # the loop without .item() has none
    assert tracemagic.load(captures["plain"]).syncs().empty


def test_the_sync_detector_on_a_real_gpu_trace_matches_the_raw_runtime_calls() -> None:
    """hta_control (A100): every ``aten::item`` in a step, its stall the host time of the
    memcpy and synchronize runtime calls inside it on its thread."""
    with gzip.open(TRACES / "hta_control.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime")]
    items = [e for e in cpu if e["name"] == "aten::item" and any(within(e, s) for s in steps)]
    runtime = [e for e in cpu if e["cat"] == "cuda_runtime"
               and (e["name"].startswith("cudaMemcpy") or e["name"].endswith("Synchronize"))]
    stalls = sorted(sum(r["dur"] for r in runtime if r["tid"] == i["tid"] and within(r, i)) for i in items)
    syncs = tracemagic.load(TRACES / "hta_control.json.gz").syncs()
    found = syncs[syncs["what"] == "item"]
    assert len(found) == len(items) == 30
    assert sorted(found["stall_us"].tolist()) == pytest.approx(stalls)
    assert found["stall_us"].max() > 4000  # the 4.7 ms wait of the issue
    assert found["gpu_wait"].sum() == sum(s > 0 for s in stalls)
    assert (found["line"] == -1).all() and found["where"].str.contains("aten::item in ").all()


def test_the_advice_names_the_line_of_the_top_op(captures: dict[str, Path]) -> None:
    events, _ = raw(captures["marked"])
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    mm = [e for e in events if e.get("name") == "aten::mm"]
    per_line: dict[int, float] = defaultdict(float)
    for e in mm:
        inner = min((m for m in marks if within(e, m)), key=lambda m: m["dur"], default=None)
        if inner is not None:
            per_line[int(inner["name"][len(PREFIX):])] += e["dur"]
    top = max(per_line, key=lambda k: per_line[k])
    advice = tracemagic.load(captures["marked"]).advice()
    text = advice.loc[advice["rule"] == "top_op", "text"]
    assert len(text) == 1 and "aten::mm" in text.iloc[0]
    assert f"mostly line {top} `a = big @ big`" in text.iloc[0]


@pytest.mark.parametrize("stop", ["", " --stop"])
def test_marks_keep_the_loops_semantics_and_never_cross_a_step(ip: Any, tmp_path: Path, stop: str) -> None:
    """break, continue, else, a generator, try/finally, ``!cmd`` and ``%magic`` lines: the cell
    ends as it does without the magic, and every mark lies inside one ProfilerStep."""
    body = (
        "out = []\n"
        "def gen(n):\n    for k in range(n):\n        yield k\n"
        "for i in gen(12):\n"
        "    if i == 1:\n        continue\n"
        "    try:\n        if i == 9:\n            break\n        out.append(i)\n    finally:\n        out.append(-i)\n"
        "    !true\n"
        "    %time z = i\n"
        "else:\n    out.append('else')\n"
        "last = (i, z)\n"
    )
    assert ip.run_cell(body).success
    plain = (list(ip.user_ns["out"]), ip.user_ns["last"])
    head = f"%%chakra_trace -q --cpu-only --wait 0 --warmup 1 --active 2 --no-memory-timeline --out {tmp_path}{stop}\n"
    assert ip.run_cell(head + body).success
    traced = (list(ip.user_ns["out"]), ip.user_ns["last"])
    if stop:  # --stop ends the loop after the last recorded step (iteration 2 ends step 2)
        assert traced[0] == plain[0][: len(traced[0])] and traced[0][-1] == -traced[1][0]
    else:
        assert traced == plain
    (capture,) = tmp_path.iterdir()
    events, manifest = raw(capture)
    assert manifest["line_marks"]["marked"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    assert marks and all(any(within(m, s) for s in steps) for m in marks)


@pytest.mark.parametrize("body", [
    "for i in range(4):\n    if i == 2:\n        y = 1 / 0\n",
    "for i in range(4):\n    with open('/dev/null') as f:\n        for j in range(2):\n"
    "            if i == 2:\n                y = 1 / 0\n",
    "x = 0\nwhile x < 5:\n    x += 1\n    try:\n        if x == 3:\n            y = 1 / 0\n"
    "    finally:\n        pass\n",
])
def test_a_marked_cell_raises_at_its_own_line(ip: Any, tmp_path: Path, body: str) -> None:
    from IPython.utils.capture import capture_output
    from test_magic_failures import arrows, raising_line

    head = f"%%chakra_trace -q --cpu-only --wait 0 --warmup 1 --active 1 --no-memory-timeline --out {tmp_path}\n"
    with capture_output() as out:
        ip.run_cell(head + body)
    assert arrows(out.stdout)[-1] == (raising_line(body) + 1, "y = 1 / 0")
    (capture,) = tmp_path.iterdir()
    assert json.loads((capture / "capture.json").read_text())["line_marks"]["marked"]


@pytest.mark.browser
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_source_tab_in_a_real_browser(captures: dict[str, Path], tmp_path: Path, browser: Any) -> None:
    """The report of the marked capture: the Source tab lists the cell's lines with their
    figures, draws its chart, sorts its table; the Overview names the hottest line; a
    screenshot is kept in the test's folder (``conftest.save_screenshot``)."""
    from conftest import save_screenshot
    from test_report_browser import Page

    trace = tracemagic.load(captures["marked"])
    lines = trace.lines()
    hottest = int(lines.loc[lines["self_cpu_us"].idxmax(), "line"])
    path = trace.report(tmp_path / "source.html")
    page = Page(browser)
    try:
        page.page.goto(path.as_uri())
        assert f"line {hottest} `a = big @ big`" in page.page.locator("#tab-overview").inner_text()
        page.page.locator('nav button[data-tab="source"]').click()
        section = page.page.locator("#tab-source")
        section.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=10_000)
        assert section.locator(".plot-container .barlayer .point").count() >= len(lines)
        listing = section.locator(".tm-source tbody tr")
        cell = json.loads((captures["marked"] / "capture.json").read_text())["cell"].splitlines()
        assert listing.count() == len(cell)
        row = section.locator('.tm-source tr[data-line="3"]')
        assert row.locator("code").inner_text().strip() == "a = big @ big"
        # beside the chart (1280 px), the listing keeps all its columns in the page and a short
        # statement on one line (the code column was squeezed to ~9 letters: `loss` / `=` / ...)
        width = page.page.evaluate("document.documentElement.clientWidth")
        rights = section.locator(".tm-source thead th").evaluate_all("ths => ths.map(th => th.getBoundingClientRect().right)")
        assert rights and max(rights) <= width + 1, (rights, width)
        tops = row.locator("code").evaluate("c => [...c.getClientRects()].map(r => Math.round(r.top))")
        assert len(set(tops)) == 1, tops  # one line (its indent may be a box of its own on it)
        assert "background:rgb(" in (row.locator("td.tm-code").get_attribute("style") or "")
        box = section.locator(".tm-tablebox")
        box.locator("th", has_text="Self CPU").first.click()  # numbers sort descending first
        first = box.locator("tbody tr").first.locator("td").first.inner_text()
        assert first == str(hottest)
        save_screenshot(page.page, tmp_path, "report-source")
        assert page.errors == [] and page.requests == []
    finally:
        page.close()


def _with_line_marks(trace_file: str, tmp_path: Path, first: int) -> tuple[list[dict[str, Any]], Path]:
    """A real trace of ``tests/data/traces`` with its annotations (not ``ProfilerStep#N``)
    renamed line marks numbered from ``first`` in name order: its events and the file written."""
    with gzip.open(TRACES / trace_file, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    names = sorted({e["name"] for e in events if e.get("cat") == "user_annotation"
                    and not e["name"].startswith("ProfilerStep#")})
    number = {name: first + i for i, name in enumerate(names)}
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in number:
            e["name"] = f"{PREFIX}{number[e['name']]}"
    path = tmp_path / "marked.json"
    path.write_text(json.dumps(doc))
    return events, path


def test_gpu_time_of_a_line_is_the_kernels_launched_beneath_it(tmp_path: Path) -> None:
    """A real MI300X trace whose annotations are renamed line marks (``BatchNorm affine=True``
    becomes ``tracemagic.line:N``): each line's GPU time is the summed duration of the kernels
    whose launching runtime call (same correlation id) runs inside one of its marks, on its
    thread; its CPU time the union of its marks."""
    events, path = _with_line_marks("tracelens_normalization_layer_test.json.gz", tmp_path, 10)
    marks = [e for e in events if e.get("cat") == "user_annotation"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu: dict[int, float] = defaultdict(float)
    cpu: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for m in marks:
        cpu[int(m["name"][len(PREFIX):])].append((m["ts"], m["ts"] + m["dur"]))
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        call = launches.get(k.get("args", {}).get("correlation"))
        if call is None:
            continue
        for line in {int(m["name"][len(PREFIX):]) for m in marks if m["tid"] == call["tid"] and within(call, m)}:
            gpu[line] += k["dur"]
    lines = tracemagic.load(path, use_cache=False).lines().set_index("line")
    assert sorted(lines.index) == sorted(cpu)
    assert sum(gpu.values()) > 0
    for line in lines.index:
        assert lines.at[line, "gpu_us"] == pytest.approx(gpu.get(line, 0.0), rel=1e-9, abs=1e-6), line
        assert lines.at[line, "cpu_us"] == pytest.approx(union(cpu[line]), rel=1e-9, abs=1e-3), line
        assert lines.at[line, "self_gpu_us"] == pytest.approx(lines.at[line, "gpu_us"])  # no nesting here


def test_the_host_sync_advice_names_the_line_that_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hta_control (A100) with its annotations renamed line marks: the host_sync rule (its
    threshold lowered: this trace waits under 10% of the step) names the line whose syncs
    (``.item()``, copies to the host) stall the host longest, with their stall per step from
    the raw runtime calls."""
    from tracemagic.analysis import advice as advice_module
    from tracemagic.analysis._text import fmt_time

    events, path = _with_line_marks("hta_control.json.gz", tmp_path, 100)
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime")]
    # the syncs: .item(), copies that launched a device-to-host memcpy, and the blocking calls
    # outside both; a sync's stall is the memcpy and synchronize calls inside it
    dtoh = {e["args"]["correlation"] for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]}
    runtime = [e for e in cpu if e["cat"] == "cuda_runtime"
               and (e["name"].startswith("cudaMemcpy") or e["name"].endswith("Synchronize"))]
    copies = [e for e in cpu if e["name"] in ("aten::to", "aten::_to_copy", "aten::copy_")
              and any(r["tid"] == e["tid"] and within(r, e) and r["args"].get("correlation") in dtoh for r in runtime)]
    ops = [e for e in cpu if e["name"] == "aten::item"] + copies
    stall: dict[int, float] = defaultdict(float)
    for r in runtime:
        if not any(within(r, s) for s in steps):
            continue
        inside = any(o["tid"] == r["tid"] and within(r, o) for o in ops)
        if not inside and r["name"] not in ("cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                                            "cudaEventSynchronize"):
            continue
        around = [m for m in marks if m["tid"] == r["tid"] and within(r, m)]
        if around:
            stall[int(min(around, key=lambda m: m["dur"])["name"][len(PREFIX):])] += r["dur"]
    top = max(stall, key=lambda k: stall[k])
    monkeypatch.setattr(advice_module, "HOST_SYNC_SHARE", 0.001)
    trace = tracemagic.load(path, use_cache=False)
    table = trace.advice()
    (text,) = table.loc[table["rule"] == "host_sync", "evidence"]
    assert text.startswith(f"line {top} waits {fmt_time(stall[top] / len(steps))} for the GPU every step"), text
    # the dashboard's Overview says the same, the line named
    from tracemagic.views import Dashboard

    (line,) = table.loc[table["rule"] == "host_sync", "text"]
    assert line in Dashboard(trace).section("overview").bullets


def test_the_memory_peak_advice_names_the_line_holding_most_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real MI300X trace with its annotations renamed line marks (the peak rule's threshold
    lowered: the trace uses a sliver of the 192 GiB): the rule names the line whose own
    allocations are most of the GPU memory live at the peak, counted here from the raw events."""
    from tracemagic.analysis import advice as advice_module

    events, path = _with_line_marks("tracelens_normalization_layer_test.json.gz", tmp_path, 10)
    memory = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") != 0]
    peak = max(memory, key=lambda e: e["args"]["Total Allocated"])
    live: dict[int, dict[str, Any]] = {}
    for e in sorted(memory, key=lambda e: e["ts"]):
        if e["ts"] > peak["ts"]:
            break
        live.pop(e["args"]["Addr"], None) if e["args"]["Bytes"] < 0 else live.__setitem__(e["args"]["Addr"], e)
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
    held: dict[int, int] = defaultdict(int)
    for e in live.values():
        around = [m for m in marks if m["tid"] == e["tid"] and m["ts"] <= e["ts"] < m["ts"] + m["dur"]]
        if around:
            held[int(min(around, key=lambda m: m["dur"])["name"][len(PREFIX):])] += e["args"]["Bytes"]
    top = max(held, key=lambda k: held[k])
    monkeypatch.setattr(advice_module, "MEMORY_PEAK_SHARE", 1e-9)
    table = tracemagic.load(path, use_cache=False).advice()
    (text,) = table.loc[table["rule"] == "memory_peak", "evidence"]
    from tracemagic.analysis._text import fmt_bytes

    assert f"; line {top} allocated {fmt_bytes(float(held[top]))} of it" in text, (text, dict(held))


def test_the_text_summary_names_the_hottest_line(captures: dict[str, Path]) -> None:
    from tracemagic.views.text import summary

    events, manifest = raw(captures["marked"])
    steps = counted_steps(events, manifest)
    marks = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)
             and any(within(e, s) for s in steps)]
    own: dict[int, float] = defaultdict(float)
    for m in marks:  # a mark's own time: less the marks right inside it
        inside = [c for c in marks if c is not m and within(c, m)]
        outer = [c for c in inside if not any(o is not c and within(c, o) for o in inside)]
        own[int(m["name"][len(PREFIX):])] += m["dur"] - sum(c["dur"] for c in outer)
    hottest = max(own, key=lambda k: own[k])
    text = summary(tracemagic.load(captures["marked"]))
    assert f"hottest line: line {hottest} `a = big @ big`" in text
    assert "hottest line" not in summary(tracemagic.load(captures["plain"]))


def test_with_a_step_chosen_the_hottest_line_says_it_is_the_mean_of_all_steps(captures: dict[str, Path]) -> None:
    """``lines()`` is per step over all steps: the Overview's fact must not read as the chosen step's."""
    from tracemagic.views import sections
    from tracemagic.views.data import TraceData

    data = TraceData(tracemagic.load(captures["marked"]))
    step = int(data.trace.steps()["step"].iloc[-1])
    every = dict(sections.build("overview", data).facts)["hottest line"]
    chosen = dict(sections.build("overview", data, sections.ViewState(step=step)).facts)["hottest line"]
    assert every.endswith("(Source tab)")
    assert chosen == every.removesuffix("(Source tab)") + f"(the mean of all steps, not only step {step}: Source tab)"


def test_a_mark_naming_no_line_is_no_mark_and_is_warned(tmp_path: Path) -> None:
    """``tracemagic.line:<20 digits>`` (any trace can hold one) made lines(), syncs(), sites(),
    call_tree() and advice() raise OverflowError; ``tracemagic.line:²`` (``isdigit``, but no
    ``int``) a ValueError. Such names are no line marks: ignored, with a warning."""
    events, path = _with_line_marks("tracelens_normalization_layer_test.json.gz", tmp_path, 10)
    good = sorted({int(e["name"][len(PREFIX):]) for e in events if e.get("name", "").startswith(PREFIX)})
    doc = json.loads(path.read_text())
    mark = next(e for e in events if e.get("name", "").startswith(PREFIX))
    odd = [PREFIX + "99999999999999999999", PREFIX + "\u00b2", PREFIX + "9" * 5000, PREFIX + "2147483648"]
    for i, name in enumerate(odd):
        doc["traceEvents"].append({**mark, "name": name, "cat": "cpu_op" if i % 2 else "user_annotation",
                                   "dur": mark["dur"] / 2, "args": {}})
    path.write_text(json.dumps(doc))
    trace = tracemagic.load(path, use_cache=False)
    for table in ("lines", "syncs", "sites", "call_tree", "advice"):
        getattr(trace, table)()
    assert sorted(trace.lines()["line"]) == good
    (warning,) = [w for w in trace.warnings if "line marks" in w]
    assert warning.startswith(f"{path}: 4 event names look like line marks but name no cell line (0 .. 2147483647): ")
    assert len(warning) < 400  # the 5000 digits cut
    kinds = dict(zip(trace.events["name"].astype(str), trace.events["kind"].astype(str)))
    assert kinds[PREFIX + "\u00b2"] == "cpu_op" and kinds[PREFIX + str(good[0])] == "user_annotation"
