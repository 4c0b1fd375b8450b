"""``torch.compile``'d models: the capture measures them as they run, names them by the user's path.

A warmed compiled model is profiled twice with the same flags, by a bare ``torch.profiler``
and by ``%%chakra_trace``: the magic must not make dynamo trace anything inside its window,
nor make torch warn about global hooks. Its layers are then checked against the raw JSON.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import warnings
from pathlib import Path
from statistics import median
from typing import Any, Iterator

import pytest
from conftest import TRACES, own_namespace
from IPython.utils.capture import capture_output

import tracemagic
from tracemagic.views import sections
from tracemagic.views.data import TraceData

import torch  # noqa: E402

#: inductor's CPU code needs a C++ compiler; the eager-graph backend stands in without one
BACKEND = "inductor" if shutil.which("g++") or shutil.which("c++") else "aot_eager"
#: the events of dynamo tracing or compiling a frame (what a re-trace leaves in a trace)
RETRACE = re.compile(r"bytecode_tracing|dynamo_timed|compile_id=|convert_frame\.py\(\d+\): _compile\b")
HOOK_WARNING = "hooks to fire an extra time"

DEFINE = """\
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 64)
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x):
        return self.out(self.proj(x))

torch.manual_seed(0)
model = Tiny()
cm = torch.compile(model, backend={backend!r})
x = torch.randn(16, 32)
for _ in range(3):  # warm: compiled for these shapes, forward and backward
    cm(x).sum().backward()
"""

#: the magic's default flags and schedule, spelled out for a bare torch.profiler
BARE = """\
from torch.profiler import ProfilerActivity, profile, schedule
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
             record_shapes=True, profile_memory=True, with_stack=True,
             on_trace_ready=lambda p: p.export_chrome_trace({path!r})) as prof:
    for i in range(6):
        cm(x).sum().backward()
        prof.step()
"""

LOOP = """\
for i in range(6):
    cm(x).sum().backward()
"""


def _events(path: Path) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())["traceEvents"]


def _steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]


def _in_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The complete events that start inside a ProfilerStep (by time, as torch assigns steps)."""
    steps = _steps(events)
    return [
        e for e in events
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("ProfilerStep#")
        and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)
    ]


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["name"] == name]


def _within(event: dict[str, Any], spans: list[dict[str, Any]]) -> bool:
    return any(s["ts"] <= event["ts"] and event["ts"] + event["dur"] <= s["ts"] + s["dur"] for s in spans)


def _frames() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


@pytest.fixture(scope="module")
def compiled_run(_shell: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One warmed compiled model, profiled bare and then under ``%%chakra_trace``."""
    folder = tmp_path_factory.mktemp("compiled")
    torch_threads = torch.get_num_threads()
    # TorchDynamo numbers compiled frames per process ("Torch-Compiled Region: F/N"): an
    # earlier test module's compiled model would make this one's frame 1, not 0
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as here, own_namespace(_shell):
        here.chdir(folder)
        torch.set_num_threads(1)  # inductor's CPU kernels spin on a shared, loaded machine
        try:
            with capture_output() as out:
                assert _shell.run_cell(DEFINE.format(backend=BACKEND)).success, out.stdout + out.stderr
                bare_path = folder / "bare.json"
                frames_before = _frames()
                with warnings.catch_warnings(record=True) as bare_warned:
                    warnings.simplefilter("always")
                    assert _shell.run_cell(BARE.format(path=str(bare_path))).success, out.stdout + out.stderr
                frames_bare = _frames()
                with warnings.catch_warnings(record=True) as magic_warned:
                    warnings.simplefilter("always")
                    result = _shell.run_cell(f"%%chakra_trace\n{LOOP}")
                frames_magic = _frames()
            assert result.success, out.stdout + out.stderr
            capture = _shell.user_ns["_chakra_capture"]
            yield {
                "bare": _events(bare_path),
                "capture": capture,
                "magic": _events(capture.dir / "kineto_trace_0.json"),
                "frames": (frames_before, frames_bare, frames_magic),
                "warned": ([str(w.message) for w in bare_warned], [str(w.message) for w in magic_warned]),
                "folder": folder,
            }
        finally:
            torch.set_num_threads(torch_threads)


def test_the_magic_runs_a_compiled_model_as_a_bare_profiler_does(compiled_run: dict[str, Any]) -> None:
    bare, magic = compiled_run["bare"], compiled_run["magic"]
    assert compiled_run["capture"].status == "complete"
    assert len(_steps(bare)) == len(_steps(magic)) == 3
    # the compiled code ran in both windows, once per step ...
    for events in (bare, magic):
        assert len(_named(_in_steps(events), "Torch-Compiled Region: 0/0")) == 3
    # ... and nothing was traced or compiled again: the model was warm, and the magic
    # changes nothing dynamo guards on
    retraced = [[e["name"] for e in events if RETRACE.search(e["name"])] for events in (bare, magic)]
    assert retraced == [[], []]
    before, after_bare, after_magic = compiled_run["frames"]
    assert before == after_bare == after_magic
    bare_warned, magic_warned = compiled_run["warned"]
    assert not [w for w in bare_warned + magic_warned if HOOK_WARNING in w]
    from torch.nn.modules.module import _global_forward_pre_hooks

    assert not _global_forward_pre_hooks
    # step times: reported, with a loose sanity bound only (shared machine; the re-trace is
    # caught by its events above)
    bare_ms = [s["dur"] / 1e3 for s in _steps(bare)]
    magic_ms = [s["dur"] / 1e3 for s in _steps(magic)]
    print(f"\n[{BACKEND}] ProfilerStep ms, bare: {bare_ms}, magic: {magic_ms}")
    assert max(magic_ms) < 10 * median(bare_ms) + 50


def test_a_compiled_model_is_one_layer_named_by_the_users_variable(compiled_run: dict[str, Any], tmp_path: Path) -> None:
    capture = compiled_run["capture"]
    modules = capture.manifest["modules"]
    assert modules["nn.Module: OptimizedModule_0"] == {"path": "cm", "type": "Tiny", "root": "cm", "qualname": "cm"}
    assert modules["nn.Module: Tiny_0"]["path"] == "cm"
    assert not [v for v in modules.values() if "_orig_mod" in v["qualname"]]

    trace = tracemagic.load(capture.dir, cache_dir=tmp_path)
    layers = trace.layers()
    assert list(layers["layer"]) == ["cm"]  # submodules are inlined: no layers of their own
    row = layers.iloc[0]
    assert row["type"] == "Tiny" and row["depth"] == 0

    # independently, from the raw JSON: the wrapper's calls are the layer's forward ...
    events = _in_steps(compiled_run["magic"])
    calls = _named(events, "nn.Module: OptimizedModule_0")
    assert row["calls"] == len(calls) == 3
    assert row["fwd_cpu_us"] == pytest.approx(sum(e["dur"] for e in calls), abs=1e-3)
    assert row["fwd_self_cpu_us"] == pytest.approx(row["fwd_cpu_us"], abs=1e-3)
    # ... the compiled regions run inside those calls, their backward graphs inside the
    # compiled backward ops, which are the layer's backward time
    backward = _named(events, "autograd::engine::evaluate_function: CompiledFunctionBackward")
    assert len(backward) == 3
    regions = [e for e in events if e["name"] in ("Torch-Compiled Region: 0/0", "CompiledFunction")]
    assert len(regions) == 6 and all(_within(e, calls) for e in regions)
    graphs = [e for e in events if e["name"].startswith("## Call CompiledFxGraph")]  # inductor's graph calls
    assert len(graphs) == (6 if BACKEND == "inductor" else 0)
    assert all(_within(e, calls) or _within(e, backward) for e in graphs)
    assert row["bwd_cpu_us"] == pytest.approx(sum(e["dur"] for e in backward), abs=1e-3)
    assert row["self_cpu_us"] == pytest.approx(row["cpu_us"], abs=1e-3)
    assert layers.attrs["compiled_regions"] == {0: 3}
    assert layers.attrs["compiled_layers"] == {0: ["cm"]}

    ops = trace.ops()
    inside = ops[ops["name"].isin(["Torch-Compiled Region: 0/0", "CompiledFunction"]).to_numpy()]
    assert len(inside) == 6 and set(inside["layer"]) == {"cm"}

    note = sections.build("layers", TraceData(trace)).bullets
    assert any("Submodule timing is not available inside compiled regions" in b and "cm" in b for b in note)


def test_eager_layers_tab_has_no_compiled_note(ip: Any, tmp_path: Path) -> None:
    with capture_output() as out:
        result = ip.run_cell("%%chakra_trace --no-memory-timeline\nmodel = make_mlp()\n"
                             "for i in range(5):\n    model(torch.randn(4, 32)).sum().backward()\n")
    assert result.success, out.stdout
    trace = tracemagic.load(ip.user_ns["_chakra_capture"].dir, cache_dir=tmp_path)
    assert trace.layers().attrs["compiled_regions"] == {0: 0}
    assert sections.build("layers", TraceData(trace)).bullets == []


def test_compiled_regions_of_a_real_gpu_trace_are_counted_and_noted(tmp_path: Path) -> None:
    path = TRACES / "hta_triton_example.json.gz"  # A100: a torch.compile'd function, a Triton kernel
    with gzip.open(path, "rt") as fh:
        events = _in_steps(json.load(fh)["traceEvents"])
    regions = [e for e in events if e["name"].startswith("Torch-Compiled Region")]
    assert regions and [e for e in events if e["name"].startswith("triton_")]
    trace = tracemagic.load(path, cache_dir=tmp_path)
    layers = trace.layers()
    assert layers.attrs["compiled_regions"] == {0: len(regions)} and layers.attrs["compiled_layers"] == {0: []}
    note = sections.build("layers", TraceData(trace)).bullets
    assert any(f"{len(regions)} compiled region call(s), outside any nn.Module event" in b for b in note)


class Body(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(Body(), backend="aot_eager")  # runs an fx GraphModule inside its region
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_compiled_submodule_is_a_layer_at_its_path(tmp_path: Path) -> None:
    net = Net()
    x = torch.randn(8, 16)
    for _ in range(3):
        net(x).sum().backward()
    frames = _frames()
    cap = tracemagic.capture(wait=1, warmup=1, active=2, out=tmp_path, no_memory_timeline=True)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with cap:
            for _ in cap.steps(range(5)):
                net(x).sum().backward()
    assert cap.result is not None and cap.result.status == "complete"
    assert _frames() == frames and not [w for w in warned if HOOK_WARNING in str(w.message)]
    modules = cap.result.manifest["modules"]
    assert modules["nn.Module: OptimizedModule_0"]["qualname"] == "net.body"
    assert modules["nn.Module: Body_0"]["qualname"] == "net.body"

    raw = _events(cap.dir / "kineto_trace_0.json")
    assert not [e for e in raw if RETRACE.search(e["name"])]
    events = _in_steps(raw)
    assert _named(events, "nn.Module: GraphModule_0")  # dynamo's module, inside the region
    trace = tracemagic.load(cap.dir, cache_dir=tmp_path / "cache")
    layers = trace.layers().set_index("layer")
    assert list(layers.index) == ["net", "body", "head"]
    assert layers.loc["body", "parent"] == "net" and layers.loc["body", "type"] == "Body"

    def total(name: str) -> float:
        return sum(e["dur"] for e in _named(events, name))

    # the GraphModule's time is the compiled module's own: nothing is subtracted from it
    body = total("nn.Module: OptimizedModule_0")
    assert layers.loc["body", "fwd_self_cpu_us"] == pytest.approx(body, abs=1e-3)
    head = total("nn.Module: Linear_0")
    assert modules["nn.Module: Linear_0"]["path"] == "head"
    assert layers.loc["net", "fwd_self_cpu_us"] == pytest.approx(total("nn.Module: Net_0") - body - head, abs=1e-3)
    backward = total("autograd::engine::evaluate_function: CompiledFunctionBackward")
    assert backward > 0 and layers.loc["body", "bwd_cpu_us"] == pytest.approx(backward, abs=1e-3)
    assert trace.layers().attrs["compiled_layers"] == {0: ["body"]}


def test_a_model_held_in_no_variable_is_named_under_its_class(tmp_path: Path) -> None:
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())]  # no variable holds the model
    cap = tracemagic.capture(wait=0, warmup=0, active=2, out=tmp_path, no_memory_timeline=True)
    with cap:
        for _ in cap.steps(range(2)):
            models[0](torch.randn(2, 4))
    assert cap.result is not None
    modules = cap.result.manifest["modules"]
    assert {name: (v["path"], v["qualname"]) for name, v in modules.items()} == {
        "nn.Module: Sequential_0": ("Sequential", "Sequential"),
        "nn.Module: Linear_0": ("0", "Sequential.0"),
        "nn.Module: ReLU_0": ("1", "Sequential.1"),
    }
    names = {e["name"] for e in _events(cap.dir / "kineto_trace_0.json") if e["name"].startswith("nn.Module: ")}
    assert names == set(modules)


def test_the_ops_of_a_compiled_region_name_it_in_sites(compiled_run: dict[str, Any]) -> None:
    """``trace.sites()``' ``compiled_region``: the ``Torch-Compiled Region: F/N`` op TorchDynamo
    records around a compiled call (torch/_dynamo/convert_frame.py), checked on the raw JSON."""
    from collections import Counter

    events = compiled_run["magic"]
    regions = [e for e in events if e.get("ph") == "X" and e["name"].startswith("Torch-Compiled Region")]
    assert regions
    expected: Counter[tuple[str, str | None]] = Counter()
    for e in events:
        if e.get("cat") != "cpu_op" or e.get("ph") != "X" or e["name"].startswith("tracemagic.line:"):
            continue
        around = [r for r in regions if (r["pid"], r["tid"]) == (e["pid"], e["tid"])
                  and r["ts"] <= e["ts"] < r["ts"] + r["dur"]]
        inner = max(around, key=lambda r: (r["ts"], -r["dur"])) if around else None
        expected[(e["name"], inner["name"] if inner else None)] += 1
    trace = tracemagic.load(compiled_run["capture"].dir, use_cache=False)
    sites = trace.sites()
    ops = sites[sites["kind"] == "cpu_op"]
    names = trace.events["name"]
    got = Counter((str(names.iat[int(r)]), c if isinstance(c, str) else None)
                  for r, c in zip(ops["row"], ops["compiled_region"]))
    assert got == expected
    assert any(region for _, region in got)
    assert sites["kernel_file"].isna().all()  # no Triton kernel on a CPU
