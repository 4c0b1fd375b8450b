"""Every notebook in ``notebooks/`` runs top to bottom, and shows what it promises.

Each notebook is executed once (module-scoped) with nbclient in a fresh temporary folder
(its ``data/`` copied beside it, as the notebooks read ``data/...`` relative to their own
folder), on the ``python3`` kernel, and the tests below read the executed cells: the
dashboards are widget views whose saved state holds the tabs and plotly figures, the
tables are non-empty, the cell tagged ``raises-exception`` failed with the user's own
error. Nothing is asserted on timings.

The kernel runs with ``OMP_NUM_THREADS=1``: on a small shared machine OpenMP threads that
spin-wait for busy cores make torch many times slower; it changes no output.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import nbclient  # noqa: E402
import nbformat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
CELL_TIMEOUT = 300  # seconds per cell: generous for a loaded machine; they take seconds

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------------------
# running and reading notebooks
# ------------------------------------------------------------------------------------------
class Executed:
    """An executed notebook, its folder and helpers to find cells and read their outputs."""

    def __init__(self, nb: Any, folder: Path, seconds: float) -> None:
        self.nb = nb
        self.folder = folder
        self.seconds = seconds
        state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_MIME, {})
        self.widgets: dict[str, Any] = state.get("state", {})

    @property
    def code_cells(self) -> list[Any]:
        return [c for c in self.nb.cells if c.cell_type == "code"]

    def cell(self, snippet: str) -> Any:
        """The one code cell whose source contains ``snippet``."""
        found = [c for c in self.code_cells if snippet in c.source]
        assert len(found) == 1, f"{len(found)} cells contain {snippet!r}"
        return found[0]

    def capture_cells(self) -> list[Any]:
        return [c for c in self.code_cells if c.source.lstrip().startswith("%%chakra_trace")]

    def report_cells(self) -> list[Any]:
        return [c for c in self.code_cells if c.source.lstrip().startswith("%chakra_report")]

    def widget_views(self, cell: Any) -> list[str]:
        """Model ids of the widget views a cell displayed."""
        return [o.data[WIDGET_MIME]["model_id"] for o in cell.outputs if WIDGET_MIME in o.get("data", {})]

    def models_under(self, model_id: str) -> list[dict[str, Any]]:
        """Every widget model reachable from ``model_id`` in the saved widget state."""
        seen: set[str] = set()
        todo = [model_id]
        out = []
        while todo:
            mid = todo.pop()
            if mid in seen or mid not in self.widgets:
                continue
            seen.add(mid)
            model = self.widgets[mid]
            out.append(model)
            todo.extend(re.findall(r"IPY_MODEL_([0-9a-f]+)", repr(model["state"])))
        return out

    def dashboard(self, cell: Any) -> dict[str, Any]:
        """What the cell's dashboard holds: tab titles and the figures rendered so far."""
        views = self.widget_views(cell)
        assert views, f"no widget view in the outputs of:\n{cell.source[:200]}"
        models = self.models_under(views[-1])
        tabs = [m["state"].get("titles") for m in models if m["model_name"] == "TabModel"]
        figures = [
            o["data"][PLOTLY_MIME]
            for m in models if m["model_name"] == "OutputModel"
            for o in m["state"].get("outputs", []) if PLOTLY_MIME in o.get("data", {})
        ]
        return {"tabs": tabs[0] if tabs else None, "figures": figures, "models": models}


def text_of(cell: Any) -> str:
    """All stream and text/plain output of a cell (stdout, stderr, results, displays)."""
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif "data" in o:
            parts.append(o.data.get("text/plain", ""))
    return "".join(parts)


def errors(cell: Any) -> list[Any]:
    return [o for o in cell.outputs if o.output_type == "error"]


def table_rows(cell: Any) -> int:
    """Rows of the DataFrame a cell returned (from its HTML rendering)."""
    html = [o.data["text/html"] for o in cell.outputs if o.output_type == "execute_result" and "text/html" in o.data]
    assert html, f"no table returned by:\n{cell.source[:200]}"
    body = html[-1].split("<tbody>", 1)[-1]
    return body.count("<tr")


def _execute(name: str, folder: Path) -> Executed:
    src = NOTEBOOKS / name
    folder.mkdir(parents=True, exist_ok=True)
    if (NOTEBOOKS / "data").is_dir():
        shutil.copytree(NOTEBOOKS / "data", folder / "data", dirs_exist_ok=True)
    nb = nbformat.read(src, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3",
        resources={"metadata": {"path": str(folder)}},
    )
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        nbformat.write(nb, folder / name)  # kept for a look when a test fails
    return Executed(nb, folder, time.perf_counter() - start)


_RUNS: dict[str, Executed] = {}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """``run(name)``: the executed notebook (executed once per test module)."""

    def get(name: str) -> Executed:
        if name not in _RUNS:
            _RUNS[name] = _execute(name, tmp_path_factory.mktemp(name.replace(".ipynb", "")))
        return _RUNS[name]

    yield get
    _RUNS.clear()


# ------------------------------------------------------------------------------------------
# every notebook
# ------------------------------------------------------------------------------------------
def test_the_notebooks_are_all_here() -> None:
    expected = {"quickstart.ipynb", "training_loop.ipynb", "transformer.ipynb", "gpu_traces.ipynb", "chakra_export.ipynb"}
    assert expected <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_stored_without_outputs_on_the_python3_kernel(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs stored in git:\n{cell.source[:120]}"
    assert "widgets" not in nb.metadata, f"{name}: widget state stored in git"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), f"{name} opens with a title"


@pytest.mark.parametrize("name", ALL)
def test_runs_top_to_bottom(run, name: str) -> None:
    ex = run(name)
    for cell in ex.code_cells:
        expected = "raises-exception" in cell.metadata.get("tags", [])
        failed = errors(cell)
        if expected:
            assert failed, f"{name}: the cell tagged raises-exception did not raise:\n{cell.source}"
        else:
            assert not failed, f"{name}: {failed[0].ename}: {failed[0].evalue}\nin:\n{cell.source}"
    print(f"{name}: {ex.seconds:.1f} s")


@pytest.mark.parametrize("name", ALL)
def test_every_dashboard_has_tabs_and_a_plotly_figure(run, name: str) -> None:
    ex = run(name)
    cells = [c for c in ex.capture_cells() + ex.report_cells()
             if not re.search(r"(^|\s)(-q|--quiet|-o|--output)(\s|$)", c.source.splitlines()[0])
             and "no trace written" not in text_of(c)]
    for cell in cells:
        board = ex.dashboard(cell)
        assert board["tabs"] and "Overview" in board["tabs"], board["tabs"]
        assert board["figures"], f"{name}: the dashboard shows no plotly figure:\n{cell.source[:200]}"
        assert all(fig.get("data") for fig in board["figures"]), "an empty plotly figure"
        # the text/plain fallback travels with the widget (terminals, GitHub's viewer)
        assert "tracemagic" in text_of(cell) or "chakra_trace" in text_of(cell)


# ------------------------------------------------------------------------------------------
# what each notebook shows
# ------------------------------------------------------------------------------------------
def test_quickstart(run) -> None:
    ex = run("quickstart.ipynb")
    first = ex.capture_cells()[0]
    assert "stepping the `for` loop" in text_of(first)
    assert ex.dashboard(first)["tabs"][:2] == ["Overview", "Layers"]
    layers = ex.cell("cap.trace.layers()")
    assert table_rows(layers) > 0 and "features.0" in text_of(layers)
    assert table_rows(ex.cell("cap.trace.steps()")) > 0
    files = text_of(ex.cell("cap.dir.iterdir()"))
    assert "kineto_trace_0.json" in files and "capture.json" in files
    # the loop watched: --stop after the --slow catch (the sleep at step 10), its iterations
    watched = text_of(ex.cell('print("stopped after iteration"'))
    stopped = int(re.search(r"stopped after iteration (\d+)", watched).group(1))
    assert f"'recorded': {stopped}," in watched and stopped < 100
    assert table_rows(ex.cell('print("stopped after iteration"')) == 6
    again = text_of(ex.cell("--vs last"))
    assert re.search(r"vs watch-\d{8}-\d{6}\S*: mean step [\d.]+ → [\d.]+ ms", again), again[:2000]


def test_training_loop(run) -> None:
    ex = run("training_loop.ipynb")
    first = ex.cell("%%chakra_trace -v run")
    out = text_of(first)
    assert "stepping the `for` loop at line 5" in out  # the batch loop inside the epochs
    assert "epoch 1: mean loss" in out  # the cell's own output is kept
    assert table_rows(ex.cell("run.trace.steps()")) == 3  # --active 3
    assert "dataloader_us" in text_of(ex.cell("run.trace.steps()"))
    assert table_rows(ex.cell("layers = run.trace.layers()")) > 0

    cycles = text_of(ex.cell("print(cycles.status)"))
    assert "kineto_trace_0_cycle1.json" in cycles and "kineto_trace_0_cycle2.json" in cycles
    # the text above the cell names the files as the capture writes them (it said kineto_trace_<rank>.json)
    said = next(c.source for c in ex.nb.cells if c.cell_type == "markdown" and "Each cycle writes" in c.source)
    printed = re.findall(r"kineto_trace_0_cycle\d\.json", cycles)
    written = {re.sub(r"_0_cycle\d", "_<rank>_cycle<k>", n) for n in printed}
    assert written == {"kineto_trace_<rank>_cycle<k>.json"} and all(f"`{n}`" in said for n in written), said
    assert table_rows(ex.cell("print(cycles.status)")) == 4  # 2 cycles x --active 2

    loop = ex.cell("--loop 9")
    assert "loop at line 9: for x, y in train_loader:" in text_of(loop)
    assert "'line': 9" in text_of(ex.cell('trained.manifest["loop"]'))

    short = text_of(ex.cell("list(train_loader)[:2]"))
    assert "no trace written" in short and "Run at least 3 iterations" in short

    failing = ex.cell("BATCH = 32")
    assert "raises-exception" in failing.metadata.tags
    (err,) = errors(failing)
    assert err.ename == "RuntimeError" and "is invalid for input of size" in err.evalue
    assert "partial capture" in text_of(failing)  # the summary is shown before the error
    after = ex.cell("failed = _chakra_capture")
    assert text_of(after).startswith("partial")
    assert table_rows(after) > 0


def test_transformer(run) -> None:
    ex = run("transformer.ipynb")
    board = ex.dashboard(ex.capture_cells()[0])
    assert {"Layers", "Memory", "Shapes"} <= set(board["tabs"])
    top = ex.cell("cols = [")
    assert table_rows(top) > 0 and "bert.encoder.layer." in text_of(top)
    blocks = ex.cell("blocks = layers[")
    assert table_rows(blocks) == 4 and "bert.encoder.layer.3" in text_of(blocks)
    assert "attention.self.query" in text_of(ex.cell('inside["part"]'))
    shapes = ex.cell("shapes = cap.trace.shapes()")
    assert table_rows(shapes) > 0 and "aten::" in text_of(shapes)
    mem = ex.cell("mem = cap.trace.memory()")
    assert "allocator events; peak" in text_of(mem) and table_rows(mem) > 0
    fig = ex.cell("figures.memory_timeline(")
    plots = [o.data[PLOTLY_MIME] for o in fig.outputs if PLOTLY_MIME in o.get("data", {})]
    assert plots and plots[0]["data"], "the memory timeline figure is missing"
    assert table_rows(ex.cell("categories(cap.trace)")) > 0


def test_gpu_traces(run) -> None:
    ex = run("gpu_traces.ipynb")
    reports = ex.report_cells()
    assert len(reports) == 5
    for cell in reports:
        assert ex.widget_views(cell), f"no dashboard for {cell.source}"
    assert "Kernels" in ex.dashboard(reports[0])["tabs"]
    assert "Ranks" in ex.dashboard(ex.cell("%chakra_report data/param_dlrm_kineto.tar.gz"))["tabs"]
    assert "Compare" in ex.dashboard(ex.cell("--vs "))["tabs"]
    assert table_rows(ex.cell("mi250.kernels()")) > 0
    nccl = ex.cell("k[k.is_comm]")
    assert "memcpy" in text_of(nccl) and "ncclKernel_AllReduce" in text_of(nccl)
    assert table_rows(ex.cell('nccl = tracemagic.load')) == 3
    assert table_rows(ex.cell("mi300.layers()")) > 0
    assert "cuda:0" in text_of(ex.cell("mem = mi300.memory()"))
    assert table_rows(ex.cell("dlrm.ranks()")) == 8
    job = ex.cell("tracemagic.load_ranks(")
    assert "8 rank(s), on the Dask cluster" in text_of(job) and "loading it whole: True" in text_of(job)
    assert ex.dashboard(ex.cell("job.dashboard()"))["tabs"] == ["Ranks"]
    assert "the DataLoader takes" in text_of(ex.cell("old = tracemagic.load"))
    diff = ex.cell("rank1.diff(rank7)")
    assert table_rows(diff) > 0 and "ncclKernel_SendRecv" in text_of(diff)


def test_chakra_export(run) -> None:
    ex = run("chakra_export.ipynb")
    files = text_of(ex.cell("for f in cap.files"))
    assert "torch_et_0.json" in files and "kineto_trace_0.json" in files
    check = text_of(ex.cell("chakra.check(cap.dir)"))
    assert ": OK" in check and "ok: True" in check
    ops = ex.cell("et.et_ops(cap.dir)")
    assert table_rows(ops) > 0 and "aten::" in text_of(ops)
    commands = text_of(ex.cell("chakra.commands(cap.dir)"))
    assert "chakra_trace_link --rank 0" in commands and "chakra_converter PyTorch" in commands
