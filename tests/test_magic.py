"""%%chakra_trace on real models in a real IPython shell: options, files, names, display."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import tracemagic
from tracemagic.capture import CaptureResult
from tracemagic.magics import TracemagicMagics, register
from tracemagic.trace import loader

import torch  # noqa: E402

TRAIN_MLP = """\
model = make_mlp()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range({n}):
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def run(ip: Any, line: str, body: str) -> tuple[Any, Any]:
    """Run a %%chakra_trace cell; return (ExecutionResult, captured output)."""
    with capture_output() as out:
        result = ip.run_cell(f"%%chakra_trace {line}\n{body}", store_history=True)
    return result, out


def shown(out: Any) -> str:
    """Everything a frontend would show: stdout plus the text of displayed objects."""
    return out.stdout + "".join(o.data.get("text/plain", "") for o in out.outputs)


def step_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]


def test_default_capture_writes_trace_memory_and_manifest(ip, kineto_events, read_json):
    result, out = run(ip, "", TRAIN_MLP.format(n=6) + "loss.item()\n")
    assert result.success, out.stdout
    assert isinstance(result.result, float)  # the cell's last expression still displays
    assert "stepping the `for` loop at line 4" in out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert isinstance(capture, CaptureResult) and capture.status == "complete"
    assert "chakra" not in ip.user_ns and "__chakra_trace__" not in ip.user_ns

    assert capture.dir.parent == Path("traces")
    assert re.fullmatch(r"capture-\d{8}-\d{6}", capture.dir.name)
    names = sorted(p.name for p in capture.dir.iterdir() if not p.name.startswith("."))
    assert names == ["capture.json", "kineto_trace_0.json", "memory_timeline_0.json"]

    m = read_json(capture.dir / "capture.json")
    assert m == capture.manifest
    for key in ("arguments", "cell", "versions", "device", "rank", "world_size", "steps",
                "files", "modules", "schedule", "loop", "status", "notes"):
        assert key in m
    assert m["versions"]["torch"] == torch.__version__
    assert m["versions"]["tracemagic"] == tracemagic.__version__
    assert (m["rank"], m["world_size"]) == (0, 1)
    assert m["cell"].startswith("model = make_mlp()")
    assert [s["step"] for s in m["steps"]] == [2, 3, 4]
    assert all(s["complete"] and s["wall_ms"] > 0 for s in m["steps"])

    steps = step_events(kineto_events(capture.dir / "kineto_trace_0.json"))
    assert len(steps) == m["steps_recorded"] == 3
    assert [e["name"] for e in steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]

    rows = read_json(capture.dir / "memory_timeline_0.json")
    assert rows and all(len(r) == 4 for r in rows)
    categories = {r[3] for r in rows}
    labels = m["memory_timeline"]["categories"]
    assert {labels[c] for c in categories} >= {"PARAMETER", "GRADIENT"}

    text = capture._repr_mimebundle_()["text/plain"]
    assert "3 steps recorded" in text and "kineto_trace_0.json" in text
    assert "3 steps recorded" in shown(out)  # displayed after the cell


def test_et_refused_beside_a_users_observer(ip, read_json):
    """A notebook that registered its own ExecutionTraceObserver: --et says so before the cell
    runs, writes nothing, and the user's observer still records and finalizes its file."""
    ip.run_cell("from torch.profiler import ExecutionTraceObserver\n"
                "obs = ExecutionTraceObserver().register_callback('mine_et.json')")
    try:
        result, out = run(ip, "--et", TRAIN_MLP.format(n=5))
        assert isinstance(result.error_in_exec, UsageError), out.stdout
        assert "ExecutionTraceObserver is already registered" in str(result.error_in_exec)
        assert "model" not in ip.user_ns  # refused before the cell ran
        assert not Path("traces").exists()
        assert ip.user_ns["obs"].is_registered
        ip.run_cell("obs.start(); torch.mm(torch.ones(2, 2), torch.ones(2, 2)); obs.stop()")
    finally:
        ip.run_cell("obs.unregister_callback()")
    data = read_json(Path("mine_et.json"))
    assert "finish_ts" in data and "aten::mm" in {n["name"] for n in data["nodes"]}


def test_et_covers_exactly_the_kineto_steps(ip, kineto_events, read_json):
    result, out = run(ip, "--et", TRAIN_MLP.format(n=5))
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    et = read_json(capture.dir / "torch_et_0.json")  # plain JSON, finalized
    assert "schema" in et and et["nodes"]
    et_ids = {
        a["value"] for n in et["nodes"] for a in n["attrs"] if a["name"] == "rf_id"
    } - {0}  # 0: the observer's own process/thread root nodes
    events = kineto_events(capture.dir / "kineto_trace_0.json")
    kineto_ids = {
        e["args"]["Record function id"]
        for e in events
        if e.get("args", {}).get("Record function id") is not None
    }
    assert et_ids and et_ids == kineto_ids
    assert len(step_events(events)) == 3
    kinds = {f["kind"] for f in capture.manifest["files"]}
    assert kinds == {"kineto", "execution_trace", "memory_timeline", "manifest"}
    assert not list(capture.dir.glob("*.partial"))  # no temporary file left behind
    assert not [p.name for p in capture.dir.iterdir() if "partial" in p.name]  # nor staging folder
    from torch.nn.modules.module import _global_forward_pre_hooks

    assert not _global_forward_pre_hooks


def _module_spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    mods = [
        e for e in events
        if e.get("cat") == "python_function" and e["name"].startswith("nn.Module: ")
    ]
    return sorted(mods, key=lambda e: (e["ts"], -e["dur"]))


def test_module_names_are_attribute_paths_and_match_trace_nesting(ip, kineto_events):
    body = """\
model = make_transformer()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(5):
    loss = model(torch.randint(0, 50, (2, 8))).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
    result, out = run(ip, "--no-memory-timeline", body)
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    modules = capture.manifest["modules"]
    paths = {v["path"] for v in modules.values()}
    assert {"embed", "encoder.layers.0.self_attn", "encoder.layers.1.linear2", "head"} <= paths
    assert modules["nn.Module: SmallTransformer_0"] == {
        "path": "model", "type": "SmallTransformer", "root": "model", "qualname": "model"
    }
    # Each entry's type is the class in its name, and the naming is the same as torch's:
    # in the real trace, every module event lies inside the event of its parent path.
    for name, info in modules.items():
        assert name.startswith(f"nn.Module: {info['type']}_")
    events = kineto_events(capture.dir / "kineto_trace_0.json")
    spans = _module_spans(events)
    assert {e["name"] for e in spans} == set(modules)
    stack: list[dict[str, Any]] = []
    checked = 0
    for event in spans:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
            stack.pop()
        qual = modules[event["name"]]["qualname"]
        if stack:
            parent = modules[stack[-1]["name"]]["qualname"]
            assert qual.startswith(parent + "."), (event["name"], qual, parent)
            assert qual.count(".") == parent.count(".") + 1 or "layers" in qual
            checked += 1
        stack.append(event)
    assert checked > 20
    # first-call order within each class: layer 0 before layer 1
    assert modules["nn.Module: TransformerEncoderLayer_0"]["path"] == "encoder.layers.0"
    assert modules["nn.Module: TransformerEncoderLayer_1"]["path"] == "encoder.layers.1"


def test_cnn_gzip_out_name_and_flops(ip, tmp_path, kineto_events):
    body = """\
net = make_cnn()
for x in [torch.randn(4, 1, 16, 16) for _ in range(5)]:
    net(x).sum().backward()
"""
    result, out = run(ip, f"--gzip --out {tmp_path}/runs --name cnn_run --with-flops", body)
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.dir.parent == tmp_path / "runs" and capture.dir.name.startswith("cnn_run-")
    trace = capture.dir / "kineto_trace_0.json.gz"
    assert trace in capture.files
    # written beside its final name, compressed, moved into place: nothing hidden is left, and
    # the trace names its final path, as torch's own exporters write it
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceName"] == str(trace)
    assert not [p.name for p in capture.dir.iterdir() if p.name.startswith(".")]
    events = kineto_events(trace)
    assert len(step_events(events)) == 3
    assert capture.manifest["arguments"]["options"]["with_flops"] is True
    paths = {v["path"] for v in capture.manifest["modules"].values()}
    assert {"features.0", "features.1", "features.4", "head"} <= paths


def test_repeat_keeps_each_cycle_trace(ip, kineto_events):
    result, out = run(ip, "--repeat 2 --wait 0 --warmup 1 --active 2 --no-memory-timeline",
                      TRAIN_MLP.format(n=10))
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    names = [f["path"] for f in capture.manifest["files"] if f["kind"] == "kineto"]
    assert names == ["kineto_trace_0_cycle1.json", "kineto_trace_0_cycle2.json"]
    for cycle, name in enumerate(names, start=1):
        steps = step_events(kineto_events(capture.dir / name))
        recorded = [s["step"] for s in capture.manifest["steps"] if s["cycle"] == cycle]
        assert [f"ProfilerStep#{n}" for n in recorded] == [e["name"] for e in steps]
        assert len(recorded) == 2
    assert capture.status == "complete"


def test_nested_loops_step_the_inner_loop_and_continue_steps(ip, kineto_events):
    body = """\
model = make_mlp()
seen = []
for epoch in range(2):
    model.train()
    for i in range(4):
        seen.append(i)
        if i % 2:
            continue
        model(torch.randn(4, 32)).sum().backward()
"""
    result, out = run(ip, "--wait 0 --warmup 1 --active 5", body)
    assert result.success, out.stdout
    assert "stepping the `for` loop at line 6" in out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.manifest["iterations"] == 8  # continue still steps
    assert [s["step"] for s in capture.manifest["steps"]] == [1, 2, 3, 4, 5]
    assert len(step_events(kineto_events(capture.dir / "kineto_trace_0.json"))) == 5


def test_loop_option_picks_the_outer_loop(ip):
    body = """\
model = make_mlp()
for epoch in range(5):
    for i in range(2):
        model(torch.randn(4, 32))
"""
    result, out = run(ip, "--loop 3 --no-memory-timeline", body)
    assert result.success, out.stdout
    assert "stepping the `for` loop at line 3" in out.stdout
    assert ip.user_ns["_chakra_capture"].manifest["iterations"] == 5


def test_while_loop_inside_no_grad(ip):
    body = """\
model = make_mlp()
i = 0
with torch.no_grad():
    while i < 6:
        model(torch.randn(4, 32))
        i += 1
print("after the loop")
"""
    result, out = run(ip, "--no-memory-timeline", body)
    assert result.success, out.stdout
    assert "stepping the `while` loop at line 5" in out.stdout
    assert "after the loop" in out.stdout
    assert ip.user_ns["_chakra_capture"].status == "complete"


def test_cell_that_steps_itself_is_not_rewritten(ip, kineto_events):
    body = """\
model = make_mlp()
for i in range(6):
    model(torch.randn(4, 32))
    chakra.step()
"""
    result, out = run(ip, "--no-memory-timeline", body)
    assert result.success, out.stdout
    assert "calls chakra.step() itself" in out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.manifest["loop"]["mode"] == "manual"
    assert [s["step"] for s in capture.manifest["steps"] if s["complete"]] == [2, 3, 4]


def test_cell_without_loop_is_one_step(ip, kineto_events):
    body = """\
model = make_mlp()
y = model(torch.randn(4, 32))
y.shape
"""
    result, out = run(ip, "", body)
    assert result.success, out.stdout
    assert result.result == torch.Size([4, 10])
    assert "no loop in the cell" in out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "complete"
    assert capture.manifest["steps"] == [
        {"step": 0, "cycle": 1, "complete": True, "end": "cell_end",
         "wall_ms": capture.manifest["steps"][0]["wall_ms"]}
    ]
    assert len(step_events(kineto_events(capture.dir / "kineto_trace_0.json"))) == 1


def test_cell_without_loop_wall_time_starts_with_the_profiled_step(ip, kineto_events):
    # the one step's wall time is the profiled step's, not the profiler's set-up before it
    body = "import time\nmodel = make_mlp()\ntime.sleep(0.05)\ny = model(torch.randn(4, 32))\n"
    result, out = run(ip, "--no-memory-timeline", body)
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    (step,) = step_events(kineto_events(capture.dir / "kineto_trace_0.json"))
    wall = capture.manifest["steps"][0]["wall_ms"]
    assert 50 <= wall <= step["dur"] / 1000 + 0.02, (wall, step["dur"] / 1000)
    assert f"{wall:.2f} ms/step wall" in shown(out)


def test_trailing_semicolon_hides_the_value_as_in_any_cell(ip):
    result, out = run(ip, "-q --no-memory-timeline", TRAIN_MLP.format(n=5) + "i;\n")
    assert result.success, out.stdout
    assert result.result is None and shown(out) == ""
    assert ip.user_ns["_chakra_capture"].status == "complete"


def test_cell_without_loop_is_complete_whatever_the_schedule_options(ip):
    # the cell is the one active step: --repeat/--active do not make it "partial"
    body = "model = make_mlp()\ny = model(torch.randn(4, 32))\n"
    result, out = run(ip, "--repeat 2 --active 4 --no-memory-timeline", body)
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "complete", capture.manifest["notes"]
    assert capture.manifest["schedule"]["repeat"] == 1
    assert [f["path"] for f in capture.manifest["files"]] == ["kineto_trace_0.json", "capture.json"]


def test_magics_and_shell_commands_work_inside_the_cell(ip):
    body = """\
model = make_mlp()
for i in range(5):
    %time model(torch.randn(4, 32))
    !true
    x = i
"""
    result, out = run(ip, "--no-memory-timeline", body)
    assert result.success, out.stdout
    assert "Wall time" in out.stdout
    assert ip.user_ns["x"] == 4


def test_quiet_prints_nothing_and_var_stores_the_capture(ip):
    result, out = run(ip, "-q -v cap --no-memory-timeline", TRAIN_MLP.format(n=5) + "i\n")
    assert result.success and result.result == 4
    assert shown(out) == "Out[%d]: 4\n" % result.execution_count and out.stderr == ""
    assert ip.user_ns["cap"] is ip.user_ns["_chakra_capture"]
    assert ip.user_ns["cap"].status == "complete"


def test_output_flag_returns_capture_with_lazy_trace(ip, monkeypatch):
    result, out = run(ip, "-o --no-memory-timeline", TRAIN_MLP.format(n=5) + "i\n")
    assert result.success
    capture = result.result
    assert isinstance(capture, CaptureResult) and capture is ip.user_ns["_chakra_capture"]
    assert out.outputs[0].data["text/plain"] == "4"  # the last expression, displayed
    assert capture.dir.is_dir()
    assert all(p.exists() for p in capture.files)
    assert capture.manifest["files"][-1]["path"] == "capture.json"
    loaded: list[Path] = []
    monkeypatch.setattr(loader, "load", lambda path: loaded.append(path) or "TRACE", raising=False)
    fresh = CaptureResult.from_dir(capture.dir)
    assert fresh.manifest == capture.manifest
    assert fresh.trace == "TRACE" and fresh.trace == "TRACE"  # lazy, then kept
    assert loaded == [capture.dir]


def test_help_documents_every_option(ip):
    doc = TracemagicMagics.chakra_trace.__doc__
    for option in ("--wait", "--warmup", "--active", "--repeat", "--skip-first",
                   "--skip-first-wait", "--cpu-only", "--no-shapes", "--no-memory",
                   "--no-stack", "--with-flops", "--no-memory-timeline", "--et", "--out",
                   "--name", "--gzip", "--loop", "-o", "-q", "-v"):
        assert option in doc, option
    with capture_output() as out:
        ip.run_cell("%%chakra_trace?")
    assert "--active" in out.stdout


def _option_groups() -> list[list[str]]:
    """The option strings of each %%chakra_trace argument (``["-o", "--output"]``, ...)."""
    return [a.option_strings for a in TracemagicMagics.chakra_trace.parser._actions]


def _mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_help_and_readme_table_list_every_option_the_magic_parses():
    groups = _option_groups()
    assert len(groups) >= 23
    doc = TracemagicMagics.chakra_trace.__doc__
    assert doc.lstrip(": \n").startswith("%%chakra_trace [--wait N]")
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("Options (`%%chakra_trace?`")
    table = readme[start : readme.index("\n\n", readme.index("|", start))]
    for group in groups:
        assert all(_mentions(doc, option) for option in group), group
        assert any(_mentions(table, option) for option in group), group


def test_run_command_takes_the_same_capture_options():
    from tracemagic.run import build_parser

    run_options = {s for a in build_parser()._actions for s in a.option_strings}
    magic_only = {"--tb-names", "--report", "--pfw", "--loop", "--stop", "--no-lines", "--vs", "-v", "--var", "-o", "--output"}
    assert {s for group in _option_groups() for s in group} - magic_only <= run_options


def test_var_must_be_a_variable_name(ip):
    result, out = run(ip, "-v cap.x", "ran = True\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "-v 'cap.x' is not a Python variable name" in str(result.error_in_exec)
    assert "ran" not in ip.user_ns and not Path("traces").exists()


def test_register_is_idempotent(ip):
    register(ip)
    register(ip)
    assert "chakra_trace" in ip.magics_manager.magics["cell"]
    assert list(ip.magics_manager.registry).count("TracemagicMagics") == 1


def test_no_stack_flag_records_no_module_names(ip):
    result, out = run(ip, "--no-stack --no-shapes --no-memory", TRAIN_MLP.format(n=5))
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.manifest["modules"] == {}
    assert "memory_timeline" not in capture.manifest  # torch needs all three to classify
    opts = capture.manifest["arguments"]["options"]
    assert (opts["with_stack"], opts["record_shapes"], opts["profile_memory"]) == (False,) * 3


def test_no_shapes_and_no_memory_leave_their_events_out(ip, kineto_events):
    def events_of(line: str) -> list[dict[str, Any]]:
        result, out = run(ip, f"--no-memory-timeline {line}", TRAIN_MLP.format(n=5))
        assert result.success, out.stdout
        return kineto_events(ip.user_ns["_chakra_capture"].dir / "kineto_trace_0.json")

    def has_shapes(events: list[dict[str, Any]]) -> bool:
        return any("Input Dims" in e.get("args", {}) for e in events if e.get("cat") == "cpu_op")

    def has_memory(events: list[dict[str, Any]]) -> bool:
        return any(e.get("name") == "[memory]" for e in events)

    default = events_of("")
    assert has_shapes(default) and has_memory(default)
    no_shapes = events_of("--no-shapes")
    assert not has_shapes(no_shapes) and has_memory(no_shapes)
    no_memory = events_of("--no-memory")
    assert has_shapes(no_memory) and not has_memory(no_memory)


def test_skip_first_and_skip_first_wait_move_the_recorded_steps(ip, kineto_events):
    line = "--skip-first 1 --skip-first-wait 1 --wait 2 --warmup 1 --active 2 --no-memory-timeline"
    result, out = run(ip, line, TRAIN_MLP.format(n=6))
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.manifest["schedule"] == {
        "wait": 2, "warmup": 1, "active": 2, "repeat": 1, "skip_first": 1, "skip_first_wait": 1
    }
    # step 0 skipped once, no wait in the first cycle, step 1 warms up: 2 and 3 are recorded
    assert [s["step"] for s in capture.manifest["steps"]] == [2, 3]
    names = [e["name"] for e in step_events(kineto_events(capture.dir / "kineto_trace_0.json"))]
    assert names == ["ProfilerStep#2", "ProfilerStep#3"]


def test_cpu_only_records_no_device_activity(ip, kineto_events):
    result, out = run(ip, "--cpu-only --no-memory-timeline", TRAIN_MLP.format(n=5))
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.manifest["arguments"]["options"]["cpu_only"] is True
    assert capture.manifest["device"]["activities"] == ["CPU"]
    assert capture.manifest["device"]["type"] == "cpu"
    device_cats = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver"}
    events = kineto_events(capture.dir / "kineto_trace_0.json")
    assert not [e for e in events if e.get("cat") in device_cats]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_is_recorded_by_default_when_available(ip, kineto_events):
    body = TRAIN_MLP.format(n=5).replace("make_mlp()", "make_mlp().cuda()").replace(
        "torch.randn(8, 32)", "torch.randn(8, 32, device='cuda')"
    )
    result, out = run(ip, "--no-memory-timeline", body)
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    assert capture.manifest["device"]["activities"] == ["CPU", "CUDA"]
    events = kineto_events(capture.dir / "kineto_trace_0.json")
    assert any(e.get("cat") == "kernel" for e in events)
    # each iteration's GPU time, from the magic's CUDA events at the iteration boundaries
    timing = capture.manifest["loop_timing"]
    assert len(timing["gpu_ms"]) == len(timing["wall_ms"]) == 5
    assert all(ms > 0 for ms in timing["gpu_ms"])
    # and those events add no Python frames of torch.cuda's under the magic's step() in the user's
    # trace (torch's own profiler.step() may stop the profiler there, which synchronizes)
    frames = [e for e in events if e.get("cat") == "python_function"]
    steps = [e for e in frames if re.match(r"tracemagic/capture/session\.py\(\d+\): step$", e["name"])]
    assert steps

    def within(outer: dict, inner: dict) -> bool:
        return outer["tid"] == inner["tid"] and outer["ts"] <= inner["ts"] and (
            inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
        )

    torch_own = [f for f in frames if f["name"].startswith("torch/profiler/")]
    inside = [
        f["name"] for s in steps for f in frames
        if f["name"].startswith("torch/cuda/") and within(s, f)
        and not any(within(s, p) and within(p, f) for p in torch_own)
    ]
    assert not inside, inside
