"""Layer names stay right and cheap across cells: the module cache and the pruned event walk.

A model made inside a function (held only by a closure and its optimizer) is found by walking
every live object (``gc.get_objects``) the first time only; the tests count those walks by
instrumentation, never by timing. The names are checked against the raw trace and a twin of
the model built in the test: each ``nn.Module: <Class>_<k>`` event's path must hold a module
of that class, a ``Linear``'s ``aten::linear`` must take that module's weight shape, and
every module event must lie inside the event of its parent path.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from tracemagic.capture import naming

import torch  # noqa: E402
from torch import nn  # noqa: E402

MAKE = """\
import gc as _gc

def make():
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step():
        model(torch.randint(0, 50, (2, 8))).sum().backward()
        opt.step()
        opt.zero_grad()

    def new_head():
        model.head = nn.Linear(32, 50)

    def drop_layer():
        del model.encoder.layers[1]

    return train_step, new_head, drop_layer

step, new_head, drop_layer = make()
"""

#: the same model, held where the search of the namespace does not look (a module object's
#: attribute, reached from the cell's functions through their globals only): only the walk
#: over every live object finds it
HIDDEN = MAKE.replace("step, new_head, drop_layer = make()", """\
import types as _types
_hidden = _types.ModuleType("hidden")
_hidden.fns = make()
step = lambda: _hidden.fns[0]()
new_head = lambda: _hidden.fns[1]()
drop_layer = lambda: _hidden.fns[2]()""")

LOOP = "for i in range(4):\n    step()\n"


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``gc.get_objects()`` calls (one per walk over every live object)."""
    calls: list[int] = []
    real = gc.get_objects

    def counting(*args: Any, **kwargs: Any) -> list[Any]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gc, "get_objects", counting)
    return calls


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts searches of what the namespace's values hold (``naming.held_modules``)."""
    calls: list[int] = []
    real = naming.held_modules

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(naming, "held_modules", counting)
    return calls


def capture(ip: Any) -> Any:
    """Run the loop under %%chakra_trace; the capture."""
    with capture_output() as out:
        result = ip.run_cell(f"%%chakra_trace -q --no-memory-timeline\n{LOOP}")
    assert result.success, out.stdout + out.stderr
    return ip.user_ns["_chakra_capture"]


def raw_events(capture: Any) -> list[dict[str, Any]]:
    return json.loads((Path(capture.dir) / "kineto_trace_0.json").read_text())["traceEvents"]


def check_names(capture: Any, twin: nn.Module) -> dict[str, str]:
    """Check the manifest's module names against the raw trace and ``twin`` (a module of the
    same architecture); returns ``{trace name: path}``."""
    modules = capture.manifest["modules"]
    events = [e for e in raw_events(capture) if e.get("ph") == "X"]
    spans = sorted((e for e in events if e["name"].startswith("nn.Module: ")), key=lambda e: (e["ts"], -e["dur"]))
    assert {e["name"] for e in spans} == set(modules)
    named = dict(twin.named_modules())
    linears = [e for e in events if e["name"] == "aten::linear"]
    for name, info in modules.items():
        cls = name[len("nn.Module: "):].rsplit("_", 1)[0]
        assert info["root"] == type(twin).__name__  # held by no variable: named after its class
        path = "" if info["path"] == info["root"] else info["path"]
        assert type(named[path]).__name__ == cls, (name, path)
        if cls == "Linear":
            for span in (s for s in spans if s["name"] == name):
                inside = [e for e in linears if span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
                assert inside and inside[0]["args"]["Input Dims"][1] == list(named[path].weight.shape), (name, path)
    stack: list[dict[str, Any]] = []
    for span in spans:  # each module event lies inside its parent path's event
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= span["ts"]:
            stack.pop()
        if stack:
            inner, outer = modules[span["name"]]["qualname"], modules[stack[-1]["name"]]["qualname"]
            assert inner.startswith(outer + "."), (span["name"], inner, outer)
        stack.append(span)
    return {name: info["path"] for name, info in modules.items()}


def twin_transformer() -> nn.Module:
    from conftest import make_transformer

    return make_transformer()


def test_a_model_in_a_closure_is_found_without_walking_every_object_then_cached(ip, walks, searches):
    ip.run_cell(MAKE).raise_error()
    first = check_names(capture(ip), twin_transformer())
    assert first["nn.Module: TransformerEncoderLayer_1"] == "encoder.layers.1"
    assert "encoder.layers.0.linear1" in first.values()
    assert len(walks) == 0 and len(searches) == 1  # found through step's closure
    second = check_names(capture(ip), twin_transformer())
    assert second == first
    assert len(walks) == 0 and len(searches) == 1  # the second capture found it in the cache


def test_a_model_held_out_of_reach_is_walked_for_once_then_found_in_the_cache(ip, walks):
    ip.run_cell(HIDDEN).raise_error()
    first = check_names(capture(ip), twin_transformer())
    assert "encoder.layers.0.linear1" in first.values()
    assert len(walks) == 1  # the first capture of this model searched every live object
    assert check_names(capture(ip), twin_transformer()) == first
    assert len(walks) == 1  # the second one found every module in the cache


def test_a_new_model_in_place_of_the_old_one_is_named_by_its_own_modules(ip, walks):
    ip.run_cell(HIDDEN).raise_error()
    before = set(naming.MODULES._modules.keys())
    capture(ip)
    old_ids = set(naming.MODULES._modules.keys()) - before  # this model's modules
    assert len(old_ids) > 10
    # the old model dies; its memory is free for the new one's modules (ids can be reused)
    ip.run_cell("_hidden.fns = None\n_gc.collect()\n" + HIDDEN).raise_error()
    assert not old_ids & set(naming.MODULES._modules.keys())  # the old entries went with it
    check_names(capture(ip), twin_transformer())
    assert len(walks) == 2  # new objects: searched once more


def test_a_replaced_or_deleted_submodule_is_found_under_the_cached_model(ip, walks):
    ip.run_cell(HIDDEN).raise_error()
    capture(ip)
    twin = twin_transformer()
    ip.run_cell("new_head()\n_gc.collect()").raise_error()  # model.head is a new Linear
    assert check_names(capture(ip), twin)["nn.Module: Linear_4"] == "head"
    ip.run_cell("drop_layer()\n_gc.collect()").raise_error()  # model.encoder.layers[1] is gone
    del twin.encoder.layers[1]
    names = check_names(capture(ip), twin)
    assert "nn.Module: TransformerEncoderLayer_1" not in names
    assert names["nn.Module: Linear_2"] == "head"
    assert len(walks) == 1  # both found among the cached model's submodules


def test_a_cell_that_calls_no_module_searches_for_none(ip, walks, searches, monkeypatch):
    """A loop of bare tensor ops records no ``nn.Module`` event: the namespace is not
    searched for models (it used to be, every cell: ~3 ms here, more in a big namespace)."""
    monkeypatch.setattr(naming, "MODULES", naming.ModuleCache())  # no model found by earlier tests
    ip.run_cell("x = torch.randn(8, 8)").raise_error()
    with capture_output() as out:
        result = ip.run_cell("%%chakra_trace -q --no-memory-timeline\nfor i in range(4):\n    y = x @ x\n")
    assert result.success, out.stdout + out.stderr
    assert ip.user_ns["_chakra_capture"].manifest["modules"] == {}
    assert not any(e["name"].startswith("nn.Module: ") for e in raw_events(ip.user_ns["_chakra_capture"]))
    assert len(searches) == 0 and len(walks) == 0


#: a model whose forward makes and drops a module in each call (dead once the window is written)
TEMPORARY = """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = nn.ReLU()(self.fc(x))
        return self.act(y) if hasattr(self, "act") else y

def make():
    model = Net()

    def add_act():
        model.act = nn.ReLU()

    return (lambda: model(torch.randn(4, 16)).sum().backward()), add_act

step, add_act = make()
"""


def test_a_module_made_in_forward_is_walked_for_once_not_in_every_window(ip, walks, searches, monkeypatch):
    """The ``ReLU`` made in each ``forward`` is dead once its window is written: the first
    capture looks for it everywhere (one walk over every live object) and names it by its
    class; later captures do not look again (it was tens of ms a cell), while a model seen
    for the first time after them is still walked for and named by its paths."""
    monkeypatch.setattr(naming, "MODULES", naming.ModuleCache())  # nothing known from earlier tests
    ip.run_cell(TEMPORARY).raise_error()
    for k in range(3):
        modules = capture(ip).manifest["modules"]
        assert {n: (m["path"], m["root"]) for n, m in modules.items() if not n.startswith("nn.Module: ReLU_")} == {
            "nn.Module: Net_0": ("Net", "Net"),
            "nn.Module: Linear_0": ("fc", "Net"),
        }
        relus = [m for n, m in modules.items() if n.startswith("nn.Module: ReLU_")]
        assert relus and all(m["path"] == m["root"] == "ReLU" for m in relus)  # no object: its class
        assert len(walks) == 1 and len(searches) == 1, k  # the first capture only
    ip.run_cell("add_act()").raise_error()  # a ReLU of the known model, of a class not found before
    modules = capture(ip).manifest["modules"]
    assert sorted((m["path"], m["root"]) for m in modules.values() if m["path"] != "ReLU") == [
        ("Net", "Net"), ("act", "Net"), ("fc", "Net")
    ]
    assert len(walks) == 1  # found under the known model
    ip.run_cell(HIDDEN).raise_error()  # a new model nothing the namespace reaches holds
    assert "encoder.layers.0.linear1" in check_names(capture(ip), twin_transformer()).values()
    assert len(walks) == 2


def test_in_a_kernel_later_cells_search_neither_for_made_in_forward_modules_nor_in_module_free_loops(tmp_path):
    """The two searches that used to run in every cell, counted in a real kernel (ipykernel,
    as JupyterLab runs the magic): a loop that calls no module, three times, then the model
    whose ``forward`` makes its ``ReLU``, three times."""
    from conftest import run_in_kernel

    count = (
        "import gc, json, torch\n"
        "from torch import nn\n"
        "from tracemagic.capture import naming\n"
        "counts = {'walks': 0, 'searches': 0}\n"
        "_get_objects, _held = gc.get_objects, naming.held_modules\n"
        "def _walk(*a, **k):\n"
        "    counts['walks'] += 1\n"
        "    return _get_objects(*a, **k)\n"
        "def _search(*a, **k):\n"
        "    counts['searches'] += 1\n"
        "    return _held(*a, **k)\n"
        "gc.get_objects, naming.held_modules = _walk, _search\n"
        "%load_ext tracemagic\n"
        "x = torch.randn(8, 8)"
    )
    tensors = "%%chakra_trace -q --no-memory-timeline\nfor i in range(4):\n    y = x @ x\n"
    made = "%%chakra_trace -q --no-memory-timeline\n" + LOOP
    report = "print(json.dumps(dict(counts, modules=_chakra_capture.manifest['modules'])))"
    cells = [count, tensors, tensors, tensors, report, TEMPORARY, made, made, made, report]
    nb = run_in_kernel(cells, tmp_path)
    after_tensors, after_made = (
        json.loads("".join(o.get("text", "") for o in nb.cells[i].outputs)) for i in (4, 9)
    )
    assert (after_tensors["walks"], after_tensors["searches"]) == (0, 0)
    assert after_tensors["modules"] == {}
    assert (after_made["walks"], after_made["searches"]) == (1, 1)  # the first capture of the model only
    assert after_made["modules"]["nn.Module: Linear_0"]["path"] == "fc"
    assert after_made["modules"]["nn.Module: ReLU_0"]["path"] == "ReLU"


def test_a_class_is_left_unsearched_only_where_the_last_walk_found_none_of_it():
    cache = naming.ModuleCache()
    live = nn.ReLU()
    cache.not_alive({1: "ReLU", 2: "Dropout", id(live): "ReLU"}, [live])  # one ReLU was alive
    assert cache.searched_in_vain({3: "Dropout", 4: "Dropout"})
    assert not cache.searched_in_vain({3: "ReLU"})  # another one may be too
    assert not cache.searched_in_vain({3: "Dropout", 4: "Linear"})  # a class not looked for
    assert not cache.searched_in_vain({})
    cache.not_alive({5: "Linear"}, [])  # only the last walk counts
    assert not cache.searched_in_vain({3: "Dropout"})


def test_the_cache_forgets_dead_modules_and_checks_the_class():
    cache = naming.ModuleCache()
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    cache.remember(model.modules())
    ptr = id(model[0])
    assert cache.get(ptr, "Linear") is model[0]
    assert cache.get(ptr, "ReLU") is None  # same id, other class: not that module
    assert cache.roots() == [model]
    del model
    gc.collect()
    assert len(cache) == 0 and cache.roots() == []
    fresh = [nn.Linear(2, 2) for _ in range(50)]  # some may reuse the dead ones' memory
    assert all(cache.get(id(m), "Linear") is None for m in fresh)


def _window(tmp_path: Path, body: Any) -> tuple[Any, Path]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        body()
    trace = tmp_path / "window.json"
    prof.export_chrome_trace(str(trace))
    return prof.profiler, trace


def _json_module_names(trace: Path) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("name", "").startswith("nn.Module: ")]


def test_a_module_called_inside_an_aten_op_is_still_found(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode

    inner = nn.Identity()

    class CallsAModule(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                inner(out)  # a module call inside aten::mm
            return out

    lin = nn.Linear(4, 4, bias=False)

    def body() -> None:
        with CallsAModule():
            lin(torch.randn(2, 4))

    profiler, trace = _window(tmp_path, body)
    names = _json_module_names(trace)
    assert naming.module_event_names(trace) == set(names) and len(names) == 2
    assert naming.recorded_modules(profiler, trace) == {
        "nn.Module: Linear_0": (id(lin), "Linear"),
        "nn.Module: Identity_0": (id(inner), "Identity"),
    }


def test_the_pruned_walk_finds_what_the_full_walk_finds(tmp_path):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    head = nn.Linear(16, 4)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)

    def body() -> None:
        for _ in range(2):
            x = torch.randn(2, 5, 16, requires_grad=True)
            # the head runs again in backward (recomputation, inside autograd ops)
            checkpoint(head, model(x), use_reentrant=False).sum().backward()
            opt.step()
            opt.zero_grad()

    profiler, trace = _window(tmp_path, body)
    fast = naming.recorded_modules(profiler, trace)
    assert fast == naming.recorded_modules(profiler)
    assert set(fast) == set(_json_module_names(trace))
    assert fast["nn.Module: Linear_4"] == (id(head), "Linear")
    # chunked reading: a key or a name split across chunks is read whole, once
    for chunk in (7, 19, 23, 64):
        assert naming.module_event_names(trace, chunk=chunk) == set(_json_module_names(trace))


def test_module_names_are_found_in_a_trace_full_of_other_capital_ms(tmp_path):
    """The names are looked for from each ``M`` first; a trace whose ``M``s are mostly other
    names (``MmBackward0``, ``Memcpy``) runs past that search's budget and is searched for
    the whole key: the same names either way, read from a file or from a mapped one."""
    import mmap
    import re

    rows = []
    for i in range(3000):
        rows.append(json.dumps({"ph": "X", "name": "MmBackward0", "cat": "cpu_op", "args": {"M": "Memcpy HtoD"}}))
        if i % 250 == 0:
            rows.append(json.dumps({"ph": "X", "name": f"nn.Module: Linear_{i // 250}", "cat": "python_function"}))
    rows.append(json.dumps({"ph": "X", "name": "nn.Module: ReLU_0", "cat": "python_function"}))
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [\n' + ",\n".join(rows) + "\n]}")
    data = path.read_bytes()
    expected = {m.decode() for m in re.findall(rb'"name": "(nn\.Module: [^"]*)"', data)}
    assert len(expected) == 13
    assert naming.module_event_names_in(data) == expected
    assert naming.module_event_names(path) == expected
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
        assert naming.module_event_names_in(view) == expected
    # few Ms: every name found from its M, also the first and the last bytes of the file
    short = b'"name": "nn.Module: A_0", "name": "nn.Module: B_1"'
    assert naming.module_event_names_in(short) == {"nn.Module: A_0", "nn.Module: B_1"}
    assert naming.module_event_names_in(short + b', "name": "nn.Module: C_') == {"nn.Module: A_0", "nn.Module: B_1"}


def test_held_modules_follows_closures_methods_partials_containers_and_attributes():
    import functools
    import types

    a, b, c, d, hidden = nn.Linear(1, 1), nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.GELU()

    def closure() -> nn.Module:
        return a

    class Trainer:
        def __init__(self) -> None:
            self.model = b

        def run(self) -> None: ...

    holder = types.ModuleType("holder")  # module objects are not searched
    holder.model = hidden
    values = [closure, Trainer().run, functools.partial(print, c), {"k": [(d,)]}, holder]
    assert {id(m) for m in naming.held_modules(values)} == {id(a), id(b), id(c), id(d)}
    assert list(naming.held_modules(values, budget=1)) == []  # the budget ends the search


def test_captures_in_the_same_second_take_increasing_suffixes(tmp_path, monkeypatch):
    from datetime import datetime

    from tracemagic.capture import files

    now = datetime(2026, 1, 2, 3, 4, 5)
    made = [files.make_capture_dir(tmp_path, "cap", now=now).name for _ in range(4)]
    stamp = "cap-20260102-030405"
    assert made == [stamp, f"{stamp}-1", f"{stamp}-2", f"{stamp}-3"]
    (tmp_path / f"{stamp}-1").rmdir()  # a freed name is not taken again: the next number is
    assert files.make_capture_dir(tmp_path, "cap", now=now).name == f"{stamp}-4"
    (tmp_path / "new").mkdir()
    assert files.make_capture_dir(tmp_path / "new" / "deeper", "cap", now=now).name == stamp  # made as needed
    # names taken by another process (unknown to this one): tried one by one, then the
    # folder is listed once; the first free suffix either way
    monkeypatch.setattr(files, "_last_made", ("", "", -1))
    assert files.make_capture_dir(tmp_path, "cap", now=now).name == f"{stamp}-1"
    for n in range(5, files._PROBED + 9):
        (tmp_path / f"{stamp}-{n}").mkdir()
    monkeypatch.setattr(files, "_last_made", ("", "", -1))
    assert files.make_capture_dir(tmp_path, "cap", now=now).name == f"{stamp}-{files._PROBED + 9}"
    assert files.make_capture_dir(tmp_path, "cap", now=now).name == f"{stamp}-{files._PROBED + 10}"
    assert not any(p.name.startswith(".") for q in tmp_path.iterdir() for p in q.iterdir())


def test_two_captures_making_a_new_out_folder_at_once_both_get_a_directory(tmp_path, monkeypatch):
    """Two kernels whose first capture goes to the same new ``--out`` in the same second:
    the other one's directory made between this one's ``makedirs`` and its ``mkdir`` (the
    race, made certain here) is a name taken, not a folder that cannot be written."""
    from datetime import datetime

    from tracemagic.capture import files

    now = datetime(2026, 1, 2, 3, 4, 5)
    stamp = "cap-20260102-030405"
    real_makedirs = os.makedirs

    def the_other_kernel_first(path, *args, **kwargs):
        real_makedirs(path, *args, **kwargs)
        os.mkdir(os.path.join(path, stamp))  # the other kernel's capture, made in between

    monkeypatch.setattr(os, "makedirs", the_other_kernel_first)
    assert files.make_capture_dir(tmp_path / "new", "cap", now=now).name == f"{stamp}-1"
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [stamp, f"{stamp}-1"]


@pytest.mark.filterwarnings("ignore:.*Profiler clears events at the end of each cycle")
def test_no_staging_file_or_folder_is_left_and_no_thread_of_ours_runs_in_a_window(ip, read_json):
    """Back-to-back windows each write beside their final names (no folder made or removed,
    nothing in the background: no cleanup thread in any window), and each trace's
    ``traceName`` is its final path, as torch writes it."""
    import threading

    ip.run_cell(MAKE).raise_error()
    with capture_output() as out:  # back-to-back windows, each trace and memory timeline staged
        result = ip.run_cell("%%chakra_trace -q --wait 0 --warmup 0 --active 1 --repeat 3\n" + LOOP)
    assert result.success, out.stdout + out.stderr
    cap = ip.user_ns["_chakra_capture"]
    assert cap.status == "complete"
    assert not [p.name for p in Path(cap.dir).iterdir() if p.name.startswith(".")]
    assert not [t for t in threading.enumerate() if t.name == "tracemagic-cleanup"]
    for k in (1, 2, 3):  # no thread of ours in any window
        events = read_json(Path(cap.dir) / f"kineto_trace_0_cycle{k}.json")["traceEvents"]
        names = {e["args"].get("name") for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
        assert "tracemagic-cleanup" not in names
        assert any(e.get("cat") == "python_function" for e in events)
        trace = Path(cap.dir) / f"kineto_trace_0_cycle{k}.json"
        assert read_json(trace)["traceName"] == str(trace)
