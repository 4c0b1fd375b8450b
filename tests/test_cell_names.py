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


HEAD = "%%chakra_trace -q --no-memory-timeline --out {out} --name {name}"


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Any]:
    """The capture directories (with line marks: ``cells``; without: ``plain``) and the
    executed notebook."""
    folder = tmp_path_factory.mktemp("cells")
    out = folder / "traces"
    cells = [SETUP, MODEL, HEAD.format(out=out, name="cells") + "\n" + LOOP,
             HEAD.format(out=out, name="plain") + " --no-lines\n" + LOOP]
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
