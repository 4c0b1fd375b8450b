"""What ``%%chakra_trace`` keeps across cells: the compiled rewrite of a cell and its parsed
magic line (``capture.loop.PREPARED``, ``TracemagicMagics._options``).

A cell run again unchanged is not rewritten nor compiled again, and its line is not parsed
again: the tests count calls (of ``instrument``, the shell's parser, the option parser),
never time them. What the cached code does is checked against the raw trace JSON: the line
marks of each run's trace, the names of its ``nn.Module`` events, the line a traceback shows.
"""

from __future__ import annotations

import ast
import json
import linecache
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_kernel
from IPython.utils.capture import capture_output

import tracemagic.magics
from tracemagic.capture import loop

PREFIX = "tracemagic.line:"
HEAD = "%%chakra_trace -q --cpu-only --wait 0 --warmup 1 --active 2 --no-memory-timeline"
LOOP = """\
for i in range(4):
    y = model(torch.randn(2, 8))
    y.sum().backward()
"""


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, ip: Any) -> dict[str, list[int]]:
    """Counts the rewrites (``loop.instrument``), the shell's parses of a magic cell's body and
    the parses of a magic line (``magics.config_from_args``), from an empty cell cache."""
    loop.PREPARED.clear()
    monkeypatch.setattr(ip.magics_manager.registry["TracemagicMagics"], "_parsed", {})
    calls: dict[str, list[int]] = {"instrument": [], "ast_parse": [], "options": []}

    def counting(name: str, real: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> Any:
            # the shell parses every cell it runs: only a magic cell's body (its first line,
            # the magic's, left blank) counts
            if name != "ast_parse" or args[0].startswith("\n"):
                calls[name].append(1)
            return real(*args, **kwargs)

        return count

    monkeypatch.setattr(loop, "instrument", counting("instrument", loop.instrument))
    monkeypatch.setattr(ip.compile, "ast_parse", counting("ast_parse", ip.compile.ast_parse))
    monkeypatch.setattr(tracemagic.magics, "config_from_args", counting("options", tracemagic.magics.config_from_args))
    return calls


def run(ip: Any, cell: str, head: str = HEAD) -> Any:
    """Run ``cell`` under ``head``; the capture (the cell must succeed)."""
    with capture_output() as out:
        result = ip.run_cell(f"{head}\n{cell}")
    assert result.success, out.stdout + out.stderr
    return ip.user_ns["_chakra_capture"]


def marks(capture: Any) -> dict[int, int]:
    """``{cell line: line-mark events}`` of the capture's trace, from its raw JSON."""
    events = json.loads((Path(capture.dir) / "kineto_trace_0.json").read_text())["traceEvents"]
    found: dict[int, int] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(PREFIX):
            line = int(e["name"][len(PREFIX):])
            found[line] = found.get(line, 0) + 1
    return found


def module_events(capture: Any) -> set[str]:
    events = json.loads((Path(capture.dir) / "kineto_trace_0.json").read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("nn.Module: ")}


def test_a_cell_run_again_unchanged_is_not_parsed_rewritten_nor_compiled_again(ip, counted):
    ip.run_cell("model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))").raise_error()
    first = run(ip, LOOP)
    assert (len(counted["instrument"]), len(counted["ast_parse"]), len(counted["options"])) == (1, 1, 1)
    second = run(ip, LOOP)
    assert (len(counted["instrument"]), len(counted["ast_parse"]), len(counted["options"])) == (1, 1, 1)
    assert first.dir != second.dir and second.status == "complete"
    # the cached code marks the same lines, once per recorded step and warmup-free window (line 2:
    # the loop's fetch of each item)
    assert marks(first) == marks(second) == {2: 2, 3: 2, 4: 2}
    assert [s["step"] for s in second.steps] == [1, 2]


def test_a_changed_cell_or_changed_options_are_prepared_again(ip, counted):
    ip.run_cell("model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))").raise_error()
    run(ip, LOOP)
    changed = run(ip, LOOP + "    z = y * 2\n")  # one more statement, at line 5
    assert len(counted["instrument"]) == 2
    assert marks(changed) == {2: 2, 3: 2, 4: 2, 5: 2}
    unmarked = run(ip, LOOP, head=HEAD + " --no-lines")  # same cell, other options
    assert len(counted["instrument"]) == 3 and len(counted["options"]) == 2
    assert marks(unmarked) == {}
    again = run(ip, LOOP)  # the first one again: still kept
    assert len(counted["instrument"]) == 3 and len(counted["options"]) == 2
    assert marks(again) == {2: 2, 3: 2, 4: 2}


def test_a_new_ast_transformer_gets_the_cell_prepared_again(ip, counted):
    cell = "for i in range(3):\n    n = 1\n"
    run(ip, cell)
    assert ip.user_ns["n"] == 1

    class Doubles(ast.NodeTransformer):
        def visit_Constant(self, node: ast.Constant) -> ast.Constant:
            return ast.copy_location(ast.Constant(node.value * 2), node) if node.value == 1 else node

    ip.ast_transformers.append(Doubles())
    try:
        run(ip, cell)
        assert len(counted["instrument"]) == 2
        assert ip.user_ns["n"] == 2  # the transformer ran on the cell
    finally:
        ip.ast_transformers.pop()
    run(ip, cell)
    assert ip.user_ns["n"] == 1


def test_a_changed_model_under_the_same_cell_is_named_by_its_own_modules(ip, counted):
    ip.run_cell("model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))").raise_error()
    first = run(ip, LOOP)
    assert first.manifest["modules"]["nn.Module: Linear_1"]["qualname"] == "model.2"
    ip.run_cell("model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))"
                ).raise_error()
    second = run(ip, LOOP)
    assert len(counted["instrument"]) == 1  # the cell's code was kept: only the model changed
    modules = second.manifest["modules"]
    assert set(modules) == module_events(second)  # every module event of the trace is named
    model = ip.user_ns["model"]
    for name, info in modules.items():
        cls = name[len("nn.Module: "):].rsplit("_", 1)[0]
        target = model if info["path"] == "model" else model.get_submodule(info["path"])
        assert type(target).__name__ == cls == info["type"], (name, info)
    assert modules["nn.Module: Linear_2"]["qualname"] == "model.4"
    assert "nn.Module: ReLU_0" not in modules


RAISES = """\
def check(v):
    if v > 1:
        raise ValueError(f"bad {v}")

for i in range(4):
    check(i)
"""


def test_a_kept_cell_raises_with_its_own_runs_cell_name_and_lines(ip, counted):
    """The cached code is renamed after each run's cell (the shell names cells by their
    execution count), the function defined in the cell included."""
    seen = []
    for _ in range(2):
        with capture_output():
            result = ip.run_cell(f"{HEAD}\n{RAISES}", store_history=True)  # a new cell number
        assert isinstance(result.error_in_exec, ValueError)
        tb = result.error_in_exec.__traceback__
        frames = []
        while tb is not None:
            frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
            tb = tb.tb_next
        # the magic's cell: where it raised (the shell's own outer cell runs the magic)
        cell_frames = [f for f in frames if f[0] == frames[-1][0]]
        assert [(line, name) for _, line, name in cell_frames] == [(7, "<module>"), (4, "check")]
        filename = cell_frames[0][0]
        assert {f[0] for f in cell_frames} == {filename}
        assert filename.startswith(f"<ipython-input-{result.execution_count}-")
        assert linecache.getline(filename, 4).strip() == 'raise ValueError(f"bad {v}")'
        seen.append(filename)
    assert seen[0] != seen[1]
    assert len(counted["instrument"]) == 1


def test_a_bad_magic_line_is_refused_every_time(ip, counted):
    for _ in range(2):
        with capture_output():
            result = ip.run_cell("%%chakra_trace --active 0\nfor i in range(2):\n    pass\n")
        assert "--active must be an integer >= 1" in str(result.error_in_exec)
    assert len(counted["options"]) == 2  # not kept


def test_a_one_line_cell_is_prepared_every_time_as_the_namespace_decides_its_meaning(ip, counted):
    """IPython's prefilter reads a one-line cell against the namespace: ``pwd`` is the
    magic while no variable has that name, the variable once one does."""
    run(ip, "pwd")
    assert ip.user_ns["_chakra_capture"].status == "complete"
    ip.run_cell("pwd = 'a variable'").raise_error()
    with capture_output():
        result = ip.run_cell(f"{HEAD}\npwd", store_history=True)
    assert result.result == "a variable"
    assert len(counted["instrument"]) == 2


def test_the_prepared_cache_keeps_the_most_recent_cells():
    cache = loop.PreparedCache(size=2)
    made = {}
    for name in ("a", "b", "c"):
        made[name] = loop.PreparedCell(body=compile("pass", name, "exec"), last_expr=None,
                                       plan=loop.LoopPlan(mode="none"), filename=name)
    keep = (object(),)
    cache.put(("a",), keep, made["a"])
    cache.put(("b",), keep, made["b"])
    assert cache.get(("a",), keep) is made["a"]  # a is now the most recent
    cache.put(("c",), keep, made["c"])
    assert cache.get(("b",), keep) is None and cache.get(("a",), keep) is made["a"] and len(cache) == 2
    assert cache.get(("a",), (object(),)) is None  # other transformers under the same ids: not it


def test_a_cell_run_twice_in_a_kernel_is_prepared_once_and_raises_at_its_line(tmp_path):
    """In a real kernel (nbclient): ipykernel names a cell by its text, so the kept code is
    used as it is; the second run is not rewritten, records its steps, and a traceback
    still shows the cell's raising line."""
    cells = [
        "%load_ext tracemagic\nimport torch\nimport tracemagic.capture.loop as L\n"
        "calls = []\nreal = L.instrument\n"
        "L.instrument = lambda *a, **k: (calls.append(1), real(*a, **k))[1]\n"
        "model = torch.nn.Linear(8, 2)",
        f"{HEAD}\nfor i in range(4):\n    y = model(torch.randn(2, 8))\n    assert i < 3, 'line four'\n",
        f"{HEAD}\nfor i in range(4):\n    y = model(torch.randn(2, 8))\n    assert i < 3, 'line four'\n",
        "print(len(calls), _chakra_capture.status, [s['step'] for s in _chakra_capture.steps])",
    ]
    nb = run_in_kernel(cells, tmp_path, allow_errors=True)
    for index in (1, 2):
        errors = [o for o in nb.cells[index].outputs if o.output_type == "error"]
        assert errors and errors[0].ename == "AssertionError", nb.cells[index].outputs
        shown = "\n".join(errors[0].traceback)
        assert "line four" in shown and "assert i < 3" in shown
    printed = "".join(o.text for o in nb.cells[3].outputs if o.output_type == "stream")
    assert printed.strip() == "1 partial [1, 2]", printed
