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
