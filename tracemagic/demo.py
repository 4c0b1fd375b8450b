"""The demo (``make demo`` / ``tracemagic demo``): run the quickstart notebook headless.

It executes ``notebooks/quickstart.ipynb`` with nbclient in an output folder, so the
``%%chakra_trace`` cells capture a small model there, then prints where the executed
notebook and this run's trace files are, the per-layer summary of the first capture this
run made, and how many captures earlier runs left in the folder (they are kept). It writes
that capture's standalone HTML report as ``report.html`` in the output folder and ends with
what to open next: the report, the notebook in JupyterLab, the trace in Python.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TextIO

from tracemagic.errors import TraceError
from tracemagic.trace.layout import MANIFEST, read_manifest

#: the notebook the demo runs, relative to the repository root
NOTEBOOK = Path("notebooks") / "quickstart.ipynb"


def find_notebook(start: Path | None = None) -> Path:
    """The quickstart notebook of this checkout (cwd first, then beside the package)."""
    candidates = [(start or Path.cwd()) / NOTEBOOK, Path(__file__).resolve().parents[1] / NOTEBOOK]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"cannot find {NOTEBOOK}; run the demo from the tracemagic repository root "
        "(make demo), or pass --notebook PATH."
    )


def run(
    out_dir: str | Path = "demo-output", notebook: str | Path | None = None, *, stream: TextIO | None = None
) -> Path:
    """Execute the quickstart notebook in ``out_dir`` and print a summary of what it made.

    Returns:
        The executed notebook's path.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell of the notebook failed.
    """
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as exc:
        raise ImportError(
            f"the demo runs a notebook and needs nbclient ({exc}); install it with pip install 'tracemagic[demo]'"
        ) from None

    stream = stream or sys.stdout
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = Path(notebook) if notebook else find_notebook()
    nb = nbformat.read(source, as_version=4)
    before = set(_captures(out))
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(out)}})
    client.execute()
    executed = out / source.name
    tmp = executed.with_name(f".{executed.name}.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(executed)
    print(f"executed notebook: {executed}", file=stream)
    made = [c for c in _captures(out) if c not in before]
    for capture in made:
        print(f"trace files:       {capture}", file=stream)
    if before:
        print(
            f"earlier captures:  {len(before)} more in {out / 'traces'} from earlier runs "
            "(kept; delete the folder to start afresh)",
            file=stream,
        )
    if made:
        _print_layers(made[0], stream)
        report = _write_report(made[0], out / REPORT)
        _print_next(executed, made[0], report, stream)
    return executed


#: the report the demo writes in its output folder
REPORT = "report.html"


def _write_report(capture_dir: Path, path: Path) -> Path:
    """The standalone HTML report of ``capture_dir`` at ``path``."""
    from tracemagic.facade import load

    return Path(load(capture_dir).report(path))


def _print_next(notebook: Path, capture_dir: Path, report: Path, stream: TextIO) -> None:
    """What to open next, with paths to copy."""
    print(
        "\nWhat to open next:\n"
        f"  the report (any browser, works offline):  {report}\n"
        f"  the notebook with its dashboards:         jupyter lab {notebook}\n"
        "                                            (run its cells again for the interactive dashboards)\n"
        f'  the trace in Python:                      tracemagic.load("{capture_dir}")',
        file=stream,
    )


def _captures(out: Path) -> list[Path]:
    """The capture directories under ``out/traces``, oldest first (by the manifest's
    ``created``, then its file's age: the names are made unique, not ordered)."""
    traces = out / "traces"
    manifests = list(traces.glob(f"*/{MANIFEST}")) if traces.is_dir() else []

    def created(manifest: Path) -> tuple[str, int]:
        try:
            when = str(read_manifest(manifest).get("created") or "")
        except TraceError:  # a damaged manifest: ordered by its file alone
            when = ""
        return when, manifest.stat().st_mtime_ns

    return [m.parent for m in sorted(manifests, key=created)]


def _print_layers(capture_dir: Path, stream: TextIO) -> None:
    from tracemagic.facade import load

    trace = load(capture_dir)
    try:
        from tracemagic.views.text import summary
    except ImportError:  # views not installed in this build: print the layer table
        print(trace.layers().head(20).to_string(index=False), file=stream)
        return
    width = shutil.get_terminal_size((120, 40)).columns
    print(summary(trace, width=width), file=stream)
