"""The main job: `python -m tracemagic demo OUT` runs the quickstart notebook headless and
leaves the executed notebook and the trace files, printing where they are and the layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_the_quickstart_and_prints_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "demo-output"
    done = subprocess.run(
        [sys.executable, "-m", "tracemagic", "demo", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    executed = out / "quickstart.ipynb"
    assert f"executed notebook: {executed}" in done.stdout
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    captures = sorted((out / "traces").glob("*/capture.json"))
    assert captures, "the demo wrote no capture"
    for manifest in captures:
        assert f"trace files:       {manifest.parent}" in done.stdout
        listed = json.loads(manifest.read_text())["files"]
        assert any(f["kind"] == "kineto" for f in listed)
        for entry in listed:
            assert (manifest.parent / entry["path"]).is_file()
    # the per-layer summary names the quickstart model's layers by attribute path
    layers = done.stdout.split("Top layers", 1)[1].split("Top ops", 1)[0]
    assert "SmallNet" in layers and "features" in layers
    assert "Conv2d" in layers and "Conv2d_0" not in layers  # attribute paths, not trace names
    # it writes the first capture's report and ends with what to open next, paths included
    report = out / "report.html"
    assert report.is_file() and "<html" in report.read_text(encoding="utf-8")[:2000].lower()
    after = done.stdout.split("What to open next:", 1)[1]
    assert str(report) in after and f"jupyter lab {executed}" in after
    assert f'tracemagic.load("{captures[0].parent}")' in after
    # the saved notebook's dashboards fall back to text that says how to get the dashboard back
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert shown and all("run the cell again (or trust the notebook) for the interactive dashboard"
                         in o["data"]["text/plain"] for o in shown)


def test_demo_run_twice_reports_the_capture_it_just_made(tmp_path: Path) -> None:
    """A second run summarizes its own capture, lists only the captures it made, and says
    how many earlier runs left in the folder."""
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext tracemagic\nimport torch\nmodel = torch.nn.Linear(8, 4)"),
            nbformat.v4.new_code_cell(
                "%%chakra_trace -q --wait 0 --warmup 0 --active 2 --name tiny --no-memory-timeline\n"
                "for _ in range(3):\n    model(torch.randn(2, 8)).sum().backward()"
            ),
        ]
    )
    nb_path = tmp_path / "tiny.ipynb"
    nbformat.write(notebook, nb_path)
    out = tmp_path / "demo-output"

    def demo() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tracemagic", "demo", str(out), "--notebook", str(nb_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    first = demo()
    (made_first,) = [line.split(":", 1)[1].strip() for line in first.splitlines() if line.startswith("trace files:")]
    assert "earlier captures" not in first
    second = demo()
    listed = [line.split(":", 1)[1].strip() for line in second.splitlines() if line.startswith("trace files:")]
    dirs = {str(p.parent) for p in (out / "traces").glob("*/capture.json")}
    assert len(dirs) == 2 and made_first in dirs
    (made_second,) = dirs - {made_first}
    assert listed == [made_second]
    assert f"earlier captures:  1 more in {out / 'traces'}" in second
    title = next(line for line in second.splitlines() if line.startswith("tracemagic · "))
    assert Path(made_second).name in title and Path(made_first).name not in title
