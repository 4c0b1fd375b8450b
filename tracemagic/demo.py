"""The demo (``make demo`` / ``tracemagic demo``): run the quickstart notebook headless.

It executes ``notebooks/quickstart.ipynb`` with nbclient in an output folder, so the
``%%chakra_trace`` cells capture a small model there, then prints where the executed
notebook and the trace files are and the per-layer summary of the first capture.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TextIO

from tracemagic.trace.layout import MANIFEST

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


def run(out_dir: str | Path = "demo-output", notebook: str | Path | None = None, *, stream: TextIO | None = None) -> Path:
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
            f"the demo runs a notebook and needs nbclient ({exc}); install it with "
            "pip install 'tracemagic[demo]'"
        ) from None

    stream = stream or sys.stdout
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = Path(notebook) if notebook else find_notebook()
    nb = nbformat.read(source, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(out)}})
    client.execute()
    executed = out / source.name
    tmp = executed.with_name(f".{executed.name}.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(executed)
    print(f"executed notebook: {executed}", file=stream)
    captures = sorted((out / "traces").glob(f"*/{MANIFEST}")) if (out / "traces").is_dir() else []
    for manifest in captures:
        print(f"trace files:       {manifest.parent}", file=stream)
    if captures:
        _print_layers(captures[0].parent, stream)
    return executed


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
