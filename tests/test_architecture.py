"""The layers hold: import-linter checks the contract in pyproject.toml ([tool.importlinter]).

top (magics, cli, demo, __main__, facade, job, script, run) > views | export > capture > analysis > trace:
no module imports one of a layer above it (imports inside functions count), and views and
export are independent of each other.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tracemagic"


def lint(root: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root``, with its pyproject's contract (no
    cache: nothing is written next to the sources)."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--config", str(root / "pyproject.toml"),
         "--no-cache"],  # (no --no-logo: 2.7+ only, and the lower bound is 2.0)
        cwd=tmp_path, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )


def copy_package(tmp_path: Path) -> Path:
    """The package's sources and pyproject.toml, copied under ``tmp_path``."""
    root = tmp_path / "copy"
    shutil.copytree(PACKAGE, root / "tracemagic", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_layers_contract_is_kept(tmp_path: Path) -> None:
    done = lint(ROOT, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("module", "statement"),
    [
        # an analysis reaching up to a view, inside a function (the lazy import that hid edges)
        ("analysis/ops.py", "def _up():\n    from tracemagic.views import figures\n"),
        # the data Trace reaching the facade
        ("trace/model.py", "def _up():\n    import tracemagic.facade\n"),
        # a view using an exporter (siblings are independent)
        ("views/text.py", "from tracemagic.export import chrome\n"),
        # the capture core reaching its script adapter (which hands out the facade's Capture)
        ("capture/session.py", "def _up():\n    from tracemagic.script import capture\n"),
        # capture reaching the root package, which leads to the magics
        ("capture/result.py", "def _up():\n    import tracemagic\n"),
    ],
)
def test_a_forbidden_import_breaks_it(tmp_path: Path, module: str, statement: str) -> None:
    """The check has teeth: one import against the layers makes it fail, naming the edge."""
    root = copy_package(tmp_path)
    target = root / "tracemagic" / module
    target.write_text(target.read_text() + "\n\n" + statement)
    ast.parse(target.read_text())
    done = lint(root, tmp_path)
    assert done.returncode != 0, done.stdout
    assert "BROKEN" in done.stdout and module.replace("/", ".").removesuffix(".py") in done.stdout, done.stdout


def test_no_string_imports() -> None:
    """Every edge is an import statement a tool can see: no ``importlib.import_module`` or
    ``__import__`` that would hide one."""
    for source in PACKAGE.rglob("*.py"):
        text = source.read_text()
        assert "import_module(" not in text and "__import__(" not in text, source


def test_the_format_is_defined_once(tmp_path: Path) -> None:
    """``trace.layout`` names the files and reads and writes the manifest; the capture side
    writes those names and the reader finds them (a file of each kind round-trips)."""
    from tracemagic.capture import files
    from tracemagic.errors import TraceError
    from tracemagic.trace import layout, pairing
    from tracemagic.trace.read import is_trace_name

    assert files.kineto_name is layout.kineto_name and files.MANIFEST == layout.MANIFEST == "capture.json"
    for rank, cycle in ((0, None), (3, 2)):
        kineto, et, memory = (layout.kineto_name(rank, cycle, gz=True), layout.et_name(rank, cycle),
                              layout.memory_name(rank, cycle, gz=False))
        for pattern, name in ((layout.KINETO_FILE, kineto), (layout.ET_FILE, et), (layout.MEMORY_FILE, memory)):
            match = pattern.fullmatch(name)
            assert match and int(match.group(1)) == rank and match.group(2) == (None if cycle is None else str(cycle))
        assert is_trace_name(kineto) and not is_trace_name(et) and not is_trace_name(memory)
        assert pairing.is_et_name(et) and pairing.is_kineto_name(kineto)
    manifest = {"format": layout.MANIFEST_FORMAT, "status": "complete", "when": Path("x")}
    layout.write_manifest(tmp_path, manifest)
    assert layout.read_manifest(tmp_path) == {**manifest, "when": "x"}
    assert not list(tmp_path.glob(".*partial"))  # written under a hidden name, then moved
    (tmp_path / layout.MANIFEST).write_text("[1, 2]")
    with pytest.raises(TraceError, match="not a capture manifest"):
        layout.read_manifest(tmp_path)
