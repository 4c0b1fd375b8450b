"""A notebook cell's frames are named as IPython's tracebacks name them (``Cell In[2]``), not by
the temporary file ipykernel compiles each cell under (``/tmp/ipykernel_<pid>/<hash>.py``).

The capture is made by the magic in a real kernel (nbclient, as JupyterLab runs it); which cell
and line each frame is is taken from the raw Kineto JSON and the executed notebook.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_kernel
from test_cuda_captures import magic_cells

import tracemagic
from tracemagic.views.dashboard import Dashboard

SETUP = "%load_ext tracemagic\nimport torch\nfrom torch import nn\ntorch.manual_seed(0)"
MODEL = """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum()

model = Net()
"""
LOOP = "for i in range(5):\n    model(torch.randn(8, 32)).backward()"
#: a Python frame's event name: ``<file>(<line>): <function>``
FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>.+)$")


#: the model's ``named_modules()`` as the kernel sees them: [[path, class name], ...]
NAMED = "import json\nprint(json.dumps([[n, type(m).__name__] for n, m in model.named_modules()]))"
HEAD = "%%chakra_trace -q --no-memory-timeline --out {out} --name {name}"


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Any]:
    """The capture directories (with line marks: ``cells``; without: ``plain``) and the
    executed notebook."""
    folder = tmp_path_factory.mktemp("cells")
    out = folder / "traces"
    cells = [SETUP, MODEL, HEAD.format(out=out, name="cells") + "\n" + LOOP,
             HEAD.format(out=out, name="plain") + " --no-lines\n" + LOOP, NAMED]
    nb = run_in_kernel(cells, folder)
    found = {p.name.split("-")[0]: p for p in out.iterdir()}
    assert set(found) == {"cells", "plain"}, found
    return found, nb


@pytest.fixture(scope="module")
def captured(kernel_run: tuple[dict[str, Path], Any]) -> tuple[Path, Any]:
    """The capture with line marks and the executed notebook."""
    return kernel_run[0]["cells"], kernel_run[1]


def _forward_frame(capture: Path) -> tuple[str, int]:
    """(file, line) of ``Net.forward``'s frames, from the raw Kineto JSON."""
    events = json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
    found = {
        (m["file"], int(m["line"]))
        for e in events
        if e.get("cat") == "python_function" and (m := FRAME.match(str(e.get("name", "")))) and m["function"] == "forward"
        and "ipykernel" in m["file"]
    }
    assert len(found) == 1, found
    return found.pop()


def test_the_manifest_names_the_cells_of_the_traces_frames(captured: tuple[Path, Any]) -> None:
    capture, nb = captured
    file, line = _forward_frame(capture)
    model_cell = nb.cells[1]
    assert MODEL.splitlines()[line - 1].strip().startswith("def forward")  # the frame's line is the cell's
    cells = json.loads((capture / "capture.json").read_text())["cells"]
    assert cells[file] == model_cell.execution_count == 2
    assert tracemagic.load(capture, use_cache=False).cell_numbers[file] == 2


def test_the_flame_graph_and_its_table_name_the_cell(captured: tuple[Path, Any]) -> None:
    capture, nb = captured
    file, line = _forward_frame(capture)
    number = nb.cells[1].execution_count
    dash = Dashboard(tracemagic.load(capture, use_cache=False))
    icicle = dash.section("flame").figures[0].data[0]
    labels = [str(label) for label in icicle.labels]
    assert f"forward · Cell In[{number}]:{line}" in labels
    assert not any(Path(file).name in label for label in labels)  # no temporary file names left
    hovers = [str(row[0]) for row in icicle.customdata]
    assert f"Cell In[{number}]({line}): forward" in hovers
    table = dash.table("flame").frame
    rows = table[(table["function"] == "forward")]
    assert list(rows["file"]) == [f"Cell In[{number}]"] and list(rows["line"]) == [line]
    # the magic's own cell (In[3]) is named too
    assert any(label.startswith("&lt;module&gt; · Cell In[3]") for label in labels), labels[:12]  # (escaped)


def test_the_where_column_names_the_cell(kernel_run: tuple[dict[str, Path], Any]) -> None:
    """The ``where`` of the ops (the user code behind each) names the cell too, where no line
    mark names the op's line of the magic's cell (``--no-lines``)."""
    capture, nb = kernel_run[0]["plain"], kernel_run[1]
    file, line = _forward_frame(capture)
    trace = tracemagic.load(capture, use_cache=False)
    sites = trace.sites()
    assert f"forward · Cell In[{nb.cells[1].execution_count}]:{line}" in set(sites["where"].astype(str))
    assert not sites["where"].astype(str).str.contains(Path(file).name, regex=False).any()


@pytest.mark.parametrize("name", ["cells", "plain"])
def test_one_module_frame_per_magic_cell(kernel_run: tuple[dict[str, Path], Any], name: str) -> None:
    """The magic's cell is one ``<module>`` in the user-code call tree and the Flame tab: the
    body's (raw: the cell ``<module>`` inside tracemagic's frames), named ``Cell In[n]`` at
    the line torch gives it, not the line IPython ran the magic from (the same cell's)."""
    capture, nb = kernel_run[0][name], kernel_run[1]
    cell = nb.cells[2 if name == "cells" else 3]
    events = json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
    bodies, lines = magic_cells(events)
    assert len(bodies) == 1 and len(lines) == 1, (bodies, lines)
    (body,) = bodies
    frame = FRAME.match(body)
    assert frame
    (outer,) = [FRAME.match(line) for line in lines]
    assert outer
    numbers = json.loads((capture / "capture.json").read_text())["cells"]
    # two files, one cell: both are In[n] (what made the flame graph show two <module> boxes)
    assert numbers[frame["file"]] == numbers[outer["file"]] == cell.execution_count
    line = int(frame["line"])
    assert cell.source.splitlines()[line - 1].startswith("for i in range(5):")  # the loop: the line running
    trace = tracemagic.load(capture, use_cache=False)
    tree = trace.call_tree(user_only=True)
    modules = tree[tree["name"].astype(str).str.endswith("): <module>")]
    assert list(modules["name"]) == [body] and list(modules["line"]) == [line]
    for fig in Dashboard(trace).section("flame").figures:
        labels = [str(label) for label in fig.data[0].labels]
        assert [label for label in labels if label.startswith("&lt;module&gt;")] == [
            f"&lt;module&gt; · Cell In[{cell.execution_count}]:{line}"
        ]
    # the user's own function frames below stay
    assert (tree["name"].astype(str).str.endswith("): forward")).any()


def test_the_flames_module_boxes_are_named_as_the_layers(kernel_run: tuple[dict[str, Path], Any]) -> None:
    """The ``nn.Module`` boxes of the Flame tab carry the names the Layers tab gives: the
    root by the user's variable (``model``), the others by their ``named_modules()`` path (as
    the kernel printed them), in the label and the hover; the Layers table agrees."""
    capture, nb = kernel_run[0]["cells"], kernel_run[1]
    printed = json.loads("".join(o.get("text", "") for o in nb.cells[4].outputs))
    by_type = {kind: path or "model" for path, kind in printed}  # one instance per class here
    events = json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
    raw = {str(e["name"]) for e in events if e.get("cat") == "python_function"
           and str(e.get("name", "")).startswith("nn.Module: ")}
    expected = {r: by_type[re.sub(r"_\d+$", "", r.removeprefix("nn.Module: "))] for r in raw}
    assert expected == {"nn.Module: Net_0": "model", "nn.Module: Linear_0": "fc"}
    trace = tracemagic.load(capture, use_cache=False)
    layers = trace.layers()
    assert dict(zip(layers["module"].astype(str), layers["layer"].astype(str))) == expected
    tree = trace.call_tree(user_only=True).set_index("node")
    seen = set()
    for fig in Dashboard(trace).section("flame").figures:
        icicle = fig.data[0]
        for i, label, custom in zip(icicle.ids, icicle.labels, icicle.customdata):
            if str(i).isdigit() and tree.loc[int(i), "kind"] == "module":
                raw_name = str(tree.loc[int(i), "name"])
                assert (str(label), str(custom[0])) == (expected[raw_name], expected[raw_name])
                seen.add(raw_name)
    assert seen == set(expected)
