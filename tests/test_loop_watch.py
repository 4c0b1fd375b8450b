"""The magic watches the whole loop (issue 27): every iteration timed, ``--stop``,
``--slow``, the "not typical" note and ``--vs last``, through the magic in a real shell
(and once through a real kernel).

Timings come from loops that sleep: a slow iteration sleeps many times longer than the
others, so the checks hold on a busy machine. Expected values are computed here from the
raw ``capture.json`` and the Kineto JSON, never by calling the code under test.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from conftest import run_in_kernel
from IPython.utils.capture import capture_output

from tracemagic.analysis.schema import TABLES, kind
from tracemagic.capture.watch import SLOW_WARMUP
from tracemagic.views import figures
from tracemagic.views.dashboard import figure_of

LIGHT = "--no-stack --no-memory --no-shapes --no-memory-timeline"


def run(ip: Any, line: str, body: str) -> tuple[Any, Any]:
    with capture_output() as out:
        result = ip.run_cell(f"%%chakra_trace {line}\n{body}", store_history=True)
    return result, out


def manifest(capture: Any) -> dict[str, Any]:
    return json.loads((capture.dir / "capture.json").read_text())


def profiler_steps(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#"))


PERIODIC = """\
import time
marks = []
for i in range({n}):
    time.sleep({slow} if i in {slow_at} else {base})
    marks.append(time.perf_counter())
"""


def test_every_iteration_is_timed_and_the_strip_has_them_all(ip, tmp_path):
    n, slow_at = 30, [6, 13, 20, 27]
    result, out = run(ip, f"{LIGHT} -q", PERIODIC.format(n=n, slow=0.03, base=0.003, slow_at=slow_at))
    assert result.success, out.stdout + out.stderr
    cap = ip.user_ns["_chakra_capture"]
    timing = manifest(cap)["loop_timing"]
    assert len(timing["wall_ms"]) == n
    walls = timing["wall_ms"]
    assert all(walls[i] >= 30 for i in slow_at)
    assert all(3 <= walls[i] < 30 for i in range(n) if i not in slow_at and i > 5)  # past the schedule
    # the cell's own clock agrees past the schedule (no profiler work between those iterations);
    # a few ms of leeway: a busy machine can preempt the cell between its mark and step(),
    # and an iteration counted one off would miss by the 27 ms of a slow one
    marks = ip.user_ns["marks"]
    for i in range(6, n):
        assert abs(walls[i] - 1e3 * (marks[i] - marks[i - 1])) < 3.0 + 0.05 * walls[i], i
    # the phases of the default schedule (wait 1, warmup 1, active 3), then "after"
    phases = [p for name, first, count in timing["phases"] for p in [name] * count]
    assert phases == ["wait", "warmup", "active", "active", "active"] + ["after"] * (n - 5)
    assert timing["recorded"] == [[2, 2], [3, 3], [4, 4]]

    table = cap.iterations
    contract = TABLES["iterations"]
    assert list(table.columns) == contract.names
    assert [kind(table[c].dtype) for c in table] == [kind(d) for d in contract.dtypes().values()]
    assert list(table["iteration"]) == list(range(n))
    assert list(table["wall_ms"]) == walls
    assert [int(s) for s in table["step"].dropna()] == [2, 3, 4]

    header = cap.dashboard.widget.children[1]  # under the heading, above the controls
    drawn = figure_of(header)
    assert drawn["layout"]["title"]["text"].startswith("Every iteration (30)")
    strip = cap.dashboard.strip()
    assert [t["name"] for t in drawn["data"]] == [t.name for t in strip.data]
    xs = sorted(x for trace in strip.data if trace.type == "bar" for x in trace.x)
    assert xs == list(range(n))
    ys = {x: y for trace in strip.data if trace.type == "bar" for x, y in zip(trace.x, trace.y)}
    assert [ys[i] for i in range(n)] == walls
    recorded = next(t for t in strip.data if t.name == "recorded steps")
    assert list(recorded.x) == [2, 3, 4]
    assert "iterations: 30 timed" in cap.summary()
    page = cap.report(tmp_path / "r.html").read_text()
    header = page[page.index("<header>"): page.index("</header>")]
    assert 'id="fig-strip"' in header and "Every iteration (30)" in header


def test_slow_records_the_successors_of_the_slow_iterations_and_no_others(ip):
    n, slow_at = 60, [20, 41]
    body = PERIODIC.format(n=n, slow=0.08, base=0.005, slow_at=slow_at)
    result, out = run(ip, f"{LIGHT} -q --wait 0 --warmup 0 --active 1 --slow 4 --slow-max 3", body)
    assert result.success, out.stdout + out.stderr
    cap = ip.user_ns["_chakra_capture"]
    m = manifest(cap)
    catches = m["loop_timing"]["slow"]
    assert [c["iteration"] for c in catches] == slow_at
    walls = m["loop_timing"]["wall_ms"]
    for c in catches:
        assert c["recorded"] == c["iteration"] + 1
        assert c["ratio"] >= 4 and abs(c["wall_ms"] - walls[c["iteration"]]) < 1e-3
    slow_files = [e for e in m["files"] if e["kind"] == "kineto_slow"]
    assert [e["path"] for e in slow_files] == ["kineto_trace_0_slow1.json", "kineto_trace_0_slow2.json"]
    for k, c in enumerate(catches, start=1):
        assert profiler_steps(cap.dir / f"kineto_trace_0_slow{k}.json") == [f"ProfilerStep#{c['recorded']}"]
    # the capture's own trace holds the schedule's step only; the slow traces load on their own
    assert profiler_steps(cap.dir / "kineto_trace_0.json") == ["ProfilerStep#0"]
    assert list(cap.trace.steps()["step"]) == [0]
    assert list(cap.slow_trace(2).steps()["step"]) == [42]
    table = cap.iterations
    assert list(table.loc[table["slow_ratio"].notna(), "iteration"]) == slow_at
    assert list(table.loc[table["phase"] == "slow", "iteration"]) == [21, 42]
    strip = figures.iteration_strip(table)
    marked = next(t for t in strip.data if t.type == "scatter")
    assert list(marked.x) == slow_at


def test_slow_stops_at_its_limit_and_ignores_the_warm_up(ip):
    n = 40
    slow_at = [1, 2] + list(range(10, 40, 5))  # 1, 2: warm-up, never judged
    body = PERIODIC.format(n=n, slow=0.06, base=0.004, slow_at=slow_at)
    result, out = run(ip, f"{LIGHT} -q --wait 0 --warmup 0 --active 1 --slow 4 --slow-max 2", body)
    assert result.success, out.stdout + out.stderr
    catches = manifest(ip.user_ns["_chakra_capture"])["loop_timing"]["slow"]
    assert [c["iteration"] for c in catches] == [10, 15]
    assert all(i >= SLOW_WARMUP for i in (c["iteration"] for c in catches))


STOPPED = """\
total = 0
after = False
for i in range(10_000):
    total += i
    if i % 2:
        continue
else:
    ran_else = True
after = True
"""


def test_stop_ends_a_long_loop_after_the_schedule_and_keeps_its_variables(ip):
    ip.user_ns.pop("ran_else", None)
    result, out = run(ip, f"{LIGHT} --stop --wait 1 --warmup 1 --active 2", STOPPED)
    assert result.success, out.stdout + out.stderr
    ns = ip.user_ns
    assert ns["i"] == 3 and ns["total"] == 0 + 1 + 2 + 3 and ns["after"] is True
    assert "ran_else" not in ns  # the loop ended with break: its else clause did not run
    cap = ns["_chakra_capture"]
    assert cap.status == "complete"
    assert manifest(cap)["loop_timing"]["stopped_after"] == 3
    assert len(cap.iterations) == 4
    assert "loop stopped on purpose by --stop after iteration 3" in out.stdout + "".join(
        o.data.get("text/plain", "") for o in out.outputs)


def test_stop_with_repeat_ends_after_the_last_cycle_in_a_while_loop(ip):
    body = "n = 0\nwhile n < 10_000:\n    n += 1\n    if n == 2:\n        continue\nlast = n\n"
    result, out = run(ip, f"{LIGHT} -q --stop --wait 0 --warmup 1 --active 1 --repeat 3", body)
    assert result.success, out.stdout + out.stderr
    assert ip.user_ns["n"] == 6 and ip.user_ns["last"] == 6
    cap = ip.user_ns["_chakra_capture"]
    assert manifest(cap)["loop_timing"]["stopped_after"] == 5
    assert len([e for e in cap.manifest["files"] if e["kind"] == "kineto"]) == 3


def test_stop_needs_a_stepped_loop(ip):
    result, out = run(ip, "--stop", "x = 1\n")
    assert not result.success and "--stop ends the stepped loop" in str(result.error_in_exec)


WARMING = """\
import time
for i in range(24):
    time.sleep(0.25 if i < 2 else 0.04)
"""


def untypical(capture: Any) -> Any:
    advice = capture.trace.advice()
    return advice[advice["rule"] == "untypical_window"]


def test_a_window_on_the_first_iterations_is_not_typical_and_says_so_with_numbers(ip):
    result, out = run(ip, f"{LIGHT} -q --wait 0 --warmup 0 --active 2", WARMING)
    assert result.success, out.stdout + out.stderr
    cap = ip.user_ns["_chakra_capture"]
    rows = untypical(cap)
    assert len(rows) == 1
    walls = manifest(cap)["loop_timing"]["wall_ms"]
    recorded = statistics.median(walls[:2])
    steady = statistics.median(walls[2:])
    assert abs(rows["value"].iloc[0] - abs(recorded / steady - 1)) < 1e-9
    text = rows["text"].iloc[0]
    assert "not typical" in text and f"{recorded:.3g} ms" in text and f"{steady:.3g} ms" in text
    assert text in cap.dashboard.section("overview").bullets


def test_a_steady_window_gets_no_note(ip):
    result, out = run(ip, f"{LIGHT} -q --wait 6 --warmup 1 --active 3", WARMING)
    assert result.success, out.stdout + out.stderr
    assert untypical(ip.user_ns["_chakra_capture"]).empty


def test_vs_last_compares_with_the_previous_capture_of_the_same_name(ip):
    body = "import time\nfor i in range(8):\n    time.sleep({})\n"
    result, out = run(ip, f"{LIGHT} -q --name loopvs --wait 0 --warmup 0 --active 4", body.format(0.1))
    first = ip.user_ns["_chakra_capture"]
    run(ip, f"{LIGHT} -q --name other --wait 0 --warmup 0 --active 4", body.format(0.001))  # another name
    result, out = run(ip, f"{LIGHT} --name loopvs --vs last --wait 0 --warmup 0 --active 4", body.format(0.005))
    assert result.success, out.stdout + out.stderr
    cap = ip.user_ns["_chakra_capture"]
    assert cap.vs is not None and cap.vs.dir == first.dir
    assert "compare" in cap.dashboard.keys
    line = next(x for x in cap.summary().splitlines() + cap._header_lines() if x.strip().startswith("vs "))
    assert line.strip().startswith(f"vs {first.dir.name}: mean step ")
    before, after = line.split("mean step ")[1].split(" ms")[0].split(" → ")
    # the figures are the mean ProfilerStep of each capture, read here from the raw JSON
    for shown, capture in ((before, first), (after, cap)):
        events = json.loads(next(capture.dir.glob("kineto_trace_*.json")).read_text())["traceEvents"]
        durs = [e["dur"] for e in events if e.get("name", "").startswith("ProfilerStep#")]
        assert len(durs) == 4
        assert abs(float(shown) - statistics.mean(durs) / 1e3) <= 0.005 * float(shown) + 0.05  # 3 digits shown
    assert float(before) > float(after)  # 100 ms sleeps against 5 ms ones
    assert "-" in line.split("ms, ")[1]
    # the Compare tab reads the same way: from the earlier run (A) to this one (B), faster here
    facts = dict(cap.dashboard.section("compare").facts)
    assert (facts["A"], facts["B"]) == (first.dir.name, cap.dir.name), facts
    shown_a, shown_b = (float(x.split()[0]) for x in facts["mean step"].split(" (")[0].split(" → "))
    assert shown_a > shown_b and "(-" in facts["mean step"], facts["mean step"]
    # --vs DIR: that capture, whatever its name
    result, out = run(ip, f"{LIGHT} -q --name third --vs {first.dir} --wait 0 --warmup 0 --active 4", body.format(0.001))
    assert result.success and ip.user_ns["_chakra_capture"].vs.dir == first.dir


def test_vs_last_without_an_earlier_capture_says_so(ip):
    body = "for i in range(6):\n    pass\n"
    result, out = run(ip, f"{LIGHT} -q --name lonely --vs last", body)
    assert result.success
    assert "no earlier capture named 'lonely'" in out.stderr
    assert ip.user_ns["_chakra_capture"].vs is None


def test_the_loop_watch_in_a_real_kernel(tmp_path):
    """--stop and --slow in a Jupyter kernel (ipykernel's own compiler and output)."""

    cells = [
        "%load_ext tracemagic",
        f"%%chakra_trace {LIGHT} -q --stop --wait 0 --warmup 0 --active 1 --slow 4 --slow-max 1\n"
        "import time\n"
        "for i in range(100_000):\n"
        "    time.sleep(0.06 if i == 12 else 0.004)\n",
        "cap = _chakra_capture\n"
        "print('i', i, 'stopped', cap.manifest['loop_timing']['stopped_after'])\n"
        "print('caught', [(c['iteration'], c['recorded']) for c in cap.slow_steps])\n"
        "print('rows', len(cap.iterations))",
    ]
    nb = run_in_kernel(cells, tmp_path)
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "i 13 stopped 13" in printed
    assert "caught [(12, 13)]" in printed
    assert "rows 14" in printed


def test_a_cell_that_steps_itself_can_break_on_done(ip):
    body = ("for i in range(10_000):\n"
            "    chakra.step()\n"
            "    if chakra.done:\n"
            "        break\n")
    result, out = run(ip, f"{LIGHT} -q --wait 1 --warmup 0 --active 2", body)
    assert result.success, out.stdout + out.stderr
    assert ip.user_ns["i"] == 2
    cap = ip.user_ns["_chakra_capture"]
    assert cap.status == "complete" and len(cap.iterations) == 3
    assert list(cap.iterations["phase"]) == ["wait", "active", "active"]


def test_a_window_on_a_compiled_models_first_iterations_says_compilation(ip):
    assert ip.run_cell("import torch\ncm = torch.compile(torch.nn.Linear(16, 16), backend='aot_eager')\n"
                       "xs = torch.randn(4, 16)").success
    body = "for i in range(12):\n    cm(xs).sum().backward()\n"
    result, out = run(ip, f"{LIGHT} -q --wait 0 --warmup 0 --active 2", body)
    assert result.success, out.stdout + out.stderr
    cap = ip.user_ns["_chakra_capture"]
    ops = cap.trace.ops()
    assert ops["name"].astype(str).str.startswith("Torch-Compiled Region").any()
    (text,) = untypical(cap)["text"]
    assert "first iteration(s) 0, 1 of a compiled model" in text
    # the same model, compiled and warm: a window past the first iterations gets no such note
    result, out = run(ip, f"{LIGHT} -q --wait 4 --warmup 1 --active 2", body)
    assert result.success, out.stdout + out.stderr
    assert "compiled model" not in " ".join(untypical(ip.user_ns["_chakra_capture"])["text"])
