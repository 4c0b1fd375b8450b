"""``trace.source()``, ``trace.call_tree()`` and the stacks exporters against independent
computations from the raw JSON: per function the union of its frames' intervals, the GPU
time of the kernels whose launching op lies inside its frames, folded values adding up to
the recorded time, the speedscope file against speedscope's published schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TRACES, exact_events
from tb_reference import union

import tracemagic
from tracemagic.export.stacks import folded, to_folded, to_speedscope

ROOT = Path(__file__).resolve().parents[1]
#: speedscope's file-format schema as published at https://www.speedscope.app/file-format-schema.json
SPEEDSCOPE_SCHEMA = ROOT / "tests" / "data" / "speedscope-file-format-schema.json"
MI300X = "tracelens_normalization_layer_test.json.gz"
V100 = "kineto_worker0.1623143089861.pt.trace.json.gz"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime"}
OP_CATS = {"cpu_op", "Operator", "user_annotation"}
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>$")
FOLDED_LINE = re.compile(r"^(.+) (\d+)$")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- the raw JSON, read with the standard library ---------------------------------------------
def timed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def frames_by_function(events: list[dict[str, Any]]) -> dict[str, dict[tuple[Any, Any], list[tuple[float, float]]]]:
    """function label -> thread -> its frames' intervals (python_function events that are not
    ``nn.Module`` events; a built-in's address dropped from its name)."""
    out: dict[str, dict[tuple[Any, Any], list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for e in timed(events):
        if e.get("cat") == "python_function" and not e["name"].startswith("nn.Module: "):
            ts = float(e["ts"])
            out[ADDRESS.sub(">", e["name"])][(e["pid"], e["tid"])].append((ts, ts + float(e.get("dur", 0))))
    return out


def union_all(intervals: list[tuple[float, float]]) -> float:
    return union(intervals, -np.inf, np.inf)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def launches(events: list[dict[str, Any]]) -> list[tuple[float, tuple[Any, Any] | None, float, float]]:
    """Per GPU activity: its duration and the thread and interval of the CPU event that
    launched it: the op whose External id the runtime call carries (matched by correlation),
    else the runtime call itself; None where no runtime call matches."""
    runtime = {}
    ops: dict[int, dict[str, Any]] = {}
    for e in timed(events):
        args = e.get("args") or {}
        if e.get("cat") in RUNTIME_CATS and "correlation" in args:
            runtime[args["correlation"]] = e
        elif e.get("cat") in OP_CATS and args.get("External id") is not None:
            ops.setdefault(args["External id"], e)
    out = []
    for e in timed(events):
        if e.get("cat") not in GPU_CATS:
            continue
        call = runtime.get((e.get("args") or {}).get("correlation"))
        if call is None:
            out.append((float(e["dur"]), None, 0.0, 0.0))
            continue
        cargs = call.get("args") or {}
        op = ops.get(cargs.get("External id", cargs.get("external id")), call)
        out.append((float(e["dur"]), (op["pid"], op["tid"]), float(op["ts"]), float(op["ts"]) + float(op.get("dur", 0))))
    return out


def gpu_beneath(spans: dict[tuple[Any, Any], list[tuple[float, float]]], launched: list[Any]) -> float:
    """The GPU time whose launching event lies inside ``spans`` (thread -> intervals)."""
    blocks = {thread: merged(intervals) for thread, intervals in spans.items()}
    total = 0.0
    for dur, thread, start, end in launched:
        for a, b in blocks.get(thread, []):
            if a - 1e-6 <= start and end <= b + 1e-6:
                total += dur
                break
    return total


def allocated_within(spans: dict[tuple[Any, Any], list[tuple[float, float]]], allocations: list[Any]) -> int:
    """The bytes of the allocations (``[memory]`` events with a positive ``Bytes``) made on a
    thread while one of its ``spans`` ran: from a span's start up to, not including, its end."""
    blocks = {thread: merged(intervals) for thread, intervals in spans.items()}
    return sum(size for pid, tid, ts, size in allocations
               if any(a <= ts < b for a, b in blocks.get((pid, tid), [])))


def capture(folder: Path) -> Path:
    """A CPU trace of a real small model trained with stacks, shapes, memory and FLOPs: the
    training step is ``train_step`` of this file (user code)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    path = folder / "cpu_stack_trace.json"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True,
                 with_flops=True, schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            train_step(model, opt, torch.randn(16, 32))
            prof.step()
    return path


def train_step(model: Any, opt: Any, x: Any) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@pytest.fixture(scope="module")
def cpu_trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture(tmp_path_factory.mktemp("source"))


def load(path: Path) -> Any:
    return tracemagic.load(path, use_cache=False)


def raw(path: Path) -> list[dict[str, Any]]:
    """The trace's events, ``ts`` exact from its earliest event (``conftest.exact_events``)."""
    events = exact_events(path)
    for e in events:
        for field in ("pid", "tid"):  # old traces write a thread's tid as a number on some events
            if field in e:
                e[field] = str(e[field])
    return events


# -- source(): functions ----------------------------------------------------------------------
@pytest.mark.parametrize("which", ["mi300x", "cpu"])
def test_functions_time_is_the_union_of_their_frames_and_gpu_time_their_kernels(which: str, cpu_trace_path: Path) -> None:
    path = TRACES / MI300X if which == "mi300x" else cpu_trace_path
    events = raw(path)
    table = load(path).source()
    functions = table[table["kind"] == "function"].set_index("name")
    expected = frames_by_function(events)
    assert set(functions.index) == set(expected)
    assert not functions.index.duplicated().any()
    launched = launches(events)
    allocations = [(e["pid"], e["tid"], float(e["ts"]), int(e["args"]["Bytes"])) for e in events
                   if e.get("ph") in ("i", "I") and e.get("name") == "[memory]" and int((e.get("args") or {}).get("Bytes", 0)) > 0]
    assert allocations
    gpu_seen = alloc_seen = 0
    for name, spans in expected.items():
        row = functions.loc[name]
        assert row["calls"] == sum(len(v) for v in spans.values()), name
        assert row["cpu_us"] == pytest.approx(sum(union_all(v) for v in spans.values()), rel=1e-9, abs=1e-6), name
        gpu = gpu_beneath(spans, launched)
        assert row["gpu_us"] == pytest.approx(gpu, rel=1e-9, abs=1e-6), name
        gpu_seen += gpu > 0
        assert row["alloc_bytes"] == allocated_within(spans, allocations), name
        alloc_seen += row["alloc_bytes"] > 0
    assert alloc_seen >= 10
    if which == "mi300x":
        assert gpu_seen >= 20  # the check saw GPU work under many functions
        assert functions["self_cpu_us"].le(functions["cpu_us"] + 1e-6).all()
    # self times add up to the root: per thread, the time of the outermost frames
    roots = sum(union_all([iv for spans in expected.values() for iv in spans.get(t, [])])
                for t in {t for spans in expected.values() for t in spans})
    assert functions["self_cpu_us"].sum() == pytest.approx(roots, rel=1e-9)


def test_user_code_is_told_from_torch_and_builtins(cpu_trace_path: Path) -> None:
    table = load(cpu_trace_path).source()
    functions = table[table["kind"] == "function"]
    step = functions[functions["function"] == "train_step"]
    assert len(step) == 1 and bool(step["user"].iloc[0])
    assert step["file"].iloc[0].endswith("test_source.py") and step["line"].iloc[0] == train_step.__code__.co_firstlineno
    assert step["calls"].iloc[0] == 3  # the active steps
    assert step["alloc_bytes"].iloc[0] > 0 and step["flops"].isna().all()  # torch 2.13 wrote no FLOPs on CPU
    torch_rows = functions[functions["file"].str.startswith("torch/")]
    assert len(torch_rows) and not torch_rows["user"].any()
    assert not functions.loc[functions["file"] == "<built-in>", "user"].any()
    assert functions["name"].str.contains(" at 0x").sum() == 0  # built-ins merged across objects
    tree = load(cpu_trace_path).call_tree(user_only=True)
    python = tree[tree["kind"] == "python"]
    assert len(python) and python["user"].all()
    assert (tree["name"] == "aten::addmm").any()  # the ops stay, below the user frames


def test_flops_beneath_count_each_op_once(cpu_trace_path: Path, tmp_path: Path) -> None:
    """torch 2.13 writes no ``flops`` on CPU and none of the real traces has any: the capture
    gets them on its matrix products (``aten::linear`` and the ``aten::addmm`` inside it
    both, as torch's formulas would), from their shapes; each product counts once."""
    doc = json.loads(cpu_trace_path.read_text())
    for e in doc["traceEvents"]:
        if e.get("cat") == "cpu_op" and e["name"] in ("aten::addmm", "aten::linear", "aten::mm"):
            dims = e["args"]["Input Dims"]
            m, k = dims[1] if e["name"] == "aten::addmm" else dims[0]
            n = (dims[2] if e["name"] == "aten::addmm" else dims[1])[-1 if e["name"] == "aten::mm" else 0]
            e["args"]["flops"] = 2 * m * k * n
    path = tmp_path / "with_flops.json"
    path.write_text(json.dumps(doc))
    events = raw(path)
    products = [e for e in timed(events) if "flops" in (e.get("args") or {})]
    outer = [p for p in products if not any(q is not p and q["tid"] == p["tid"] and q["ts"] <= p["ts"]
                                            and p["ts"] + p["dur"] <= q["ts"] + q["dur"] for q in products)]
    assert len(outer) < len(products)  # linear holds addmm: nesting to count once
    table = load(path).source()
    functions = table[table["kind"] == "function"].set_index("name")
    for name, spans in frames_by_function(events).items():
        blocks = {t: merged(v) for t, v in spans.items()}
        expected = sum(float(p["args"]["flops"]) for p in outer
                       if any(a <= p["ts"] and p["ts"] + p["dur"] <= b for a, b in blocks.get((p["pid"], p["tid"]), [])))
        assert functions.loc[name, "flops"] == pytest.approx(expected), name
    assert functions.loc[functions["function"] == "train_step", "flops"].iloc[0] > 0


@pytest.mark.parametrize("name", [MI300X, V100, "param_dlrm_kineto.tar.gz", "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"])
def test_tables_follow_their_contracts(name: str) -> None:
    from test_analysis_a import assert_schema

    trace = load(TRACES / name)
    assert_schema("source", trace.source())
    for user_only in (False, True):
        tree = trace.call_tree(user_only)
        assert_schema("call_tree", tree)
        parent = tree["parent"].to_numpy()
        assert (parent < tree["node"].to_numpy()).all()  # parents first
        kids = parent >= 0
        assert (tree["depth"].to_numpy()[kids] == tree["depth"].to_numpy()[parent[kids]] + 1).all()
        # a node's children never hold more than it does
        held = np.bincount(parent[kids], weights=tree["cpu_us"].to_numpy()[kids], minlength=len(tree))
        assert (held <= tree["cpu_us"].to_numpy() + 1e-6).all()
    if name.endswith(".tar.gz"):  # several ranks: a rank node above each rank's tree
        tree = trace.call_tree()
        assert sorted(tree.loc[tree["parent"] < 0, "name"]) == sorted(f"rank {r}" for r in trace.rank_ids)


# -- source(): call-site lines of old traces ---------------------------------------------------
def test_call_stack_lines_of_the_v100_trace() -> None:
    events = raw(TRACES / V100)
    table = load(TRACES / V100).source()
    lines = table[table["kind"] == "line"].set_index("name")
    assert len(table) == len(lines) > 0
    spans: dict[str, dict[tuple[Any, Any], list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    innermost: dict[str, dict[tuple[Any, Any], list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for e in timed(events):
        stack = (e.get("args") or {}).get("Call stack") or ""
        if e.get("cat") not in OP_CATS or not stack.strip() or e["name"].startswith("ProfilerStep#"):
            continue  # a step annotation spans to the next step() call: no code ran at its line
        entries = [s.strip() for s in stack.split(";") if s.strip()]
        ts = float(e["ts"])
        for entry in set(entries):
            spans[entry][(e["pid"], e["tid"])].append((ts, ts + float(e["dur"])))
        innermost[entries[0]][(e["pid"], e["tid"])].append((ts, ts + float(e["dur"])))
    assert set(lines.index) == set(spans)
    launched = launches(events)
    allocations = [(e["pid"], e["tid"], float(e["ts"]), int(e["args"]["Bytes"])) for e in events
                   if e.get("ph") in ("i", "I") and e.get("name") == "[memory]" and int((e.get("args") or {}).get("Bytes", 0)) > 0]
    assert allocations and lines["alloc_bytes"].max() > 0
    for entry, per_thread in spans.items():
        row = lines.loc[entry]
        assert row["cpu_us"] == pytest.approx(sum(union_all(v) for v in per_thread.values())), entry
        assert row["gpu_us"] == pytest.approx(gpu_beneath(per_thread, launched)), entry
        assert row["alloc_bytes"] == allocated_within(per_thread, allocations), entry
        file, line = re.match(r"^(.*)\((\d+)\): ", entry).groups()  # type: ignore[union-attr]
        assert row["file"] == file and row["line"] == int(line)
    # line self times add up to the time of the ops with a stack
    stacked: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    for per_thread in innermost.values():
        for thread, intervals in per_thread.items():
            stacked[thread] += intervals
    assert lines["self_cpu_us"].sum() == pytest.approx(sum(union_all(v) for v in stacked.values()))
    assert (lines["self_cpu_us"] <= lines["cpu_us"] + 1e-6).all()
    # the user's script lines are user code, torch's are not
    assert lines.loc[lines["file"] == "resnet50_profiler_api.py", "user"].all()
    assert not lines.loc[lines["file"].str.contains("site-packages"), "user"].any()
    assert lines["gpu_us"].max() > 0


# -- the call tree and its exports -------------------------------------------------------------
def recorded_cpu(events: list[dict[str, Any]]) -> float:
    """Per thread, the union of the Python frames, ops and annotations (ProfilerSteps aside):
    the time the tree's top nodes hold."""
    per_thread: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    for e in timed(events):
        if e.get("cat") in OP_CATS | {"python_function"} and not e["name"].startswith("ProfilerStep#"):
            ts = float(e["ts"])
            per_thread[(e["pid"], e["tid"])].append((ts, ts + float(e.get("dur", 0))))
    return sum(union_all(v) for v in per_thread.values())


@pytest.mark.parametrize("which", ["mi300x", "v100", "cpu"])
def test_folded_values_add_up_to_the_tree_and_the_recorded_time(which: str, cpu_trace_path: Path, tmp_path: Path) -> None:
    path = {"mi300x": TRACES / MI300X, "v100": TRACES / V100, "cpu": cpu_trace_path}[which]
    events = raw(path)
    trace = load(path)
    tree = trace.call_tree()
    top = tree[tree["parent"] < 0]
    (written,) = to_folded(trace, tmp_path / "cpu.folded")
    lines = written.read_text(encoding="utf-8").splitlines()
    assert lines and all(FOLDED_LINE.match(line) for line in lines)
    stacks = [FOLDED_LINE.match(line).group(1) for line in lines]  # type: ignore[union-attr]
    assert len(set(stacks)) == len(stacks)  # one line per stack
    values = [int(FOLDED_LINE.match(line).group(2)) for line in lines]  # type: ignore[union-attr]
    assert sum(values) == pytest.approx(top["cpu_us"].sum() * 1000, abs=len(values))
    assert sum(values) == pytest.approx(recorded_cpu(events) * 1000, rel=1e-9, abs=len(values))
    assert tree["self_cpu_us"].sum() == pytest.approx(top["cpu_us"].sum(), rel=1e-9)
    if trace.has_gpu:
        gpu_lines = folded(trace, gpu=True)
        gpu_total = sum(float(e["dur"]) for e in timed(events) if e.get("cat") in GPU_CATS)
        assert sum(int(FOLDED_LINE.match(line).group(2)) for line in gpu_lines) == pytest.approx(  # type: ignore[union-attr]
            gpu_total * 1000, abs=len(gpu_lines))
        assert top["gpu_us"].sum() == pytest.approx(gpu_total)
        kinds = dict(zip(tree["name"], tree["kind"]))
        assert all(kinds[FOLDED_LINE.match(line).group(1).split(";")[-1]] in ("kernel", "memcpy", "memset")  # type: ignore[union-attr]
                   for line in gpu_lines[:50])


@pytest.mark.parametrize("which", ["mi300x", "cpu"])
def test_speedscope_file_validates_against_the_published_schema(which: str, cpu_trace_path: Path, tmp_path: Path) -> None:
    import jsonschema

    path = TRACES / MI300X if which == "mi300x" else cpu_trace_path
    trace = load(path)
    (written,) = to_speedscope(trace, tmp_path / "out.speedscope.json", gpu=trace.has_gpu)
    data = json.loads(written.read_text(encoding="utf-8"))
    schema = json.loads(SPEEDSCOPE_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(data)
    assert data["$schema"] == schema["definitions"]["FileFormat.File"]["properties"]["$schema"]["const"]
    cpu = data["profiles"][0]
    assert cpu["unit"] == "microseconds"
    assert sum(cpu["weights"]) == pytest.approx(sum(int(v.rsplit(" ", 1)[1]) for v in folded(trace)) / 1000)
    assert len(data["profiles"]) == (2 if trace.has_gpu else 1)
    frames = data["shared"]["frames"]
    named = [f for f in frames if f.get("file") == "test_perf_model.py" or str(f.get("file", "")).endswith("test_source.py")]
    assert named and all(isinstance(f["line"], int) for f in named)
    # a schema check that can fail: a sample pointing nowhere is not the format
    broken = json.loads(json.dumps(data))
    broken["profiles"][0]["type"] = "flat"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


# -- the command line --------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracemagic", *args], capture_output=True, text=True, timeout=300)


def test_stacks_command(cpu_trace_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.folded"
    done = cli("stacks", str(cpu_trace_path), "--folded", "-o", str(out), "--no-cache")
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8").splitlines() == folded(load(cpu_trace_path))
    done = cli("stacks", str(TRACES / MI300X), "--speedscope", "--gpu", "-o", str(tmp_path / "s.json"), "--no-cache")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "s.json").read_text())["activeProfileIndex"] == 1


@pytest.mark.parametrize("case", ["damaged", "missing", "gpu on a CPU trace", "no format"])
def test_stacks_command_bad_input_is_one_clean_line(case: str, cpu_trace_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur"')
    args = {
        "damaged": [str(bad), "--folded"],
        "missing": [str(tmp_path / "nope.json"), "--folded"],
        "gpu on a CPU trace": [str(cpu_trace_path), "--folded", "--gpu"],
        "no format": [str(cpu_trace_path)],
    }[case]
    done = cli("stacks", *args, "-o", str(tmp_path / "out"), "--no-cache")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    if case != "no format":
        assert done.stderr.startswith("tracemagic: error: ") and len(done.stderr.strip().splitlines()) == 1
    if case == "gpu on a CPU trace":
        assert "no GPU activity" in done.stderr


# -- the flame graph ---------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [40, 100_000])
def test_flame_figure_is_bounded_and_its_boxes_hold_the_recorded_time(cap: int) -> None:
    """Capped or not, the icicle's boxes add up to the time the trace recorded (per thread,
    the union of its frames, ops and annotations, from the raw JSON); capped, at most ``cap``
    nodes are drawn besides the root and the ``other`` boxes, and the title says so."""
    from tracemagic.views import figures

    events = raw(TRACES / MI300X)
    tree = load(TRACES / MI300X).call_tree()
    fig = figures.flame(tree, max_nodes=cap, unit="µs")
    icicle = fig.data[0]
    ids, values = list(icicle.ids), np.asarray(icicle.values, dtype=float)
    others = sum(1 for label in icicle.labels if str(label).startswith("other ("))
    assert sum(values) == pytest.approx(recorded_cpu(events), rel=1e-9)
    assert len(set(ids)) == len(ids) and set(icicle.parents) <= set(ids) | {""}
    drawn = len(ids) - 1 - others
    cpu_nodes = int(((tree["cpu_us"] > 0) & ~tree["kind"].isin(["kernel", "memcpy", "memset"])).sum())
    if cap < cpu_nodes:
        assert drawn <= cap + 40  # the heaviest cap nodes and their ancestors
        assert others >= 1 and "smaller boxes merged" in fig.layout.title.text
    else:
        assert drawn == cpu_nodes and others == 0 and "other" not in fig.layout.title.text
    gpu = figures.flame(tree, metric="gpu", max_nodes=cap)
    assert sum(gpu.data[0].values) == pytest.approx(
        sum(float(e["dur"]) for e in timed(events) if e.get("cat") in GPU_CATS), rel=1e-9)  # µs, as the boxes


def _frames_trace(path: Path, between: str) -> Path:
    """A Kineto trace of nested Python frames: a script's ``<module>`` running, through
    ``between`` (library frames), another ``<module>`` of user code that calls ``helper``
    (the op ``aten::add`` inside)."""
    names = [
        "train.py(1): <module>",
        *between.split(";"),
        "mylib.py(1): <module>",
        "mylib.py(5): helper",
    ]
    events = [
        {"ph": "X", "cat": "python_function", "name": n, "pid": 1, "tid": 1, "ts": 100 + i, "dur": 100 - 2 * i}
        for i, n in enumerate(names)
    ]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 150, "dur": 5})
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_only_the_magics_own_cell_line_leaves_the_user_tree(tmp_path: Path) -> None:
    """A user ``<module>`` that imports user code (importlib's frames between) keeps its frame
    in ``call_tree(user_only=True)`` and stays user code in ``source()``; the same frames with
    the magic's between (IPython's ``run_cell_magic``, ``tracemagic/magics.py``: a
    ``%%chakra_trace`` cell's own line running its body) lose the outer ``<module>`` only."""
    imported = _frames_trace(tmp_path / "import.json", "<frozen importlib._bootstrap>(1): _find_and_load")
    magic = _frames_trace(
        tmp_path / "magic.json",
        "IPython/core/interactiveshell.py(2644): run_cell_magic;tracemagic/magics.py(249): chakra_trace",
    )
    for path, kept in ((imported, True), (magic, False)):
        trace = load(path)
        tree = trace.call_tree(user_only=True)
        python = tree[tree["kind"] == "python"]
        expected = (["train.py(1): <module>"] if kept else []) + ["mylib.py(1): <module>", "mylib.py(5): helper"]
        assert list(python["name"]) == expected, path.name
        assert (tree["name"] == "aten::add").any()
        user = trace.source().set_index("name")["user"]
        assert bool(user["train.py(1): <module>"]) is kept and user["mylib.py(1): <module>"] and user["mylib.py(5): helper"]


def test_a_folder_pip_installed_into_on_the_path_is_library_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip install --target DIR`` with DIR on ``PYTHONPATH`` (no ``site-packages`` in its
    name): its files (``ipykernel_launcher.py``'s ``<module>`` above every notebook cell) are
    library code; the same folder off ``sys.path``, or without ``*.dist-info``, is not."""
    from tracemagic.analysis import source

    target = tmp_path / "site"
    (target / "launcher_pkg-1.0.dist-info").mkdir(parents=True)
    (target / "launcher_mod.py").write_text("x = 1\n")
    plain = tmp_path / "project"
    plain.mkdir()
    (plain / "train.py").write_text("x = 1\n")
    frame = str(target / "launcher_mod.py")
    mine = str(plain / "train.py")
    monkeypatch.setattr(sys, "path", [*sys.path, str(plain)])
    assert not source.is_library(frame) and not source.is_library(mine)  # the target is not on the path yet
    monkeypatch.setattr(sys, "path", [*sys.path, str(target)])
    assert source.is_library(frame) and not source.is_library(mine)
    # through the public table: the folder's frame is no user code, the script's is
    trace = _frames_trace(tmp_path / "t.json", f"{frame}(18): <module>")
    table = load(trace).source()
    assert not table.loc[table["file"] == frame, "user"].any()
    assert table.loc[table["file"] == "mylib.py", "user"].all() and (table["file"] == frame).any()
