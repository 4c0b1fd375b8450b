"""tracemagic on the Pythons after the venv's 3.11 (``requires-python = ">=3.11"`` has no upper
bound, so pip installs it on 3.12 and 3.13): the C extensions compile on both without a
warning, and the tests that need no torch pass on 3.13.

For each of Python 3.12 and 3.13 found on this machine (pyenv's ``~/.pyenv/versions/3.1X.*``, or
``python3.1X`` on the PATH; skipped where absent), a throwaway venv is built once and reused
like the lower-bounds venv (``tests/test_lower_bounds.py``): setuptools for 3.12; for 3.13
the versions of the dependencies this interpreter has (binary wheels; no torch: none is
installable for them here). The checkout is copied to a temporary folder (so the build
writes nothing into it), ``setup.py build_ext`` compiles the extensions there (they are
``optional``: a failed compile would install silently without them, so the built files are
checked), and on 3.13 the torch-free modules below run against that copy.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_lower_bounds import _clean_env, _locked, _run, _venv_root

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: what the modules below import (torch aside), at the versions this interpreter has
PACKAGES = ["pandas", "numpy", "pyarrow", "msgspec", "orjson", "isal", "plotly", "ipywidgets", "anywidget",
            "ipython", "pytest", "setuptools", "packaging"]
#: modules that never need torch: hostile input (and nesting past the C recursion limit,
#: which moved in 3.12 and 3.13), the magic's cell rewriting, the CLI (its report too). Not
#: the fuzz of the C code: the same C on every interpreter (the 3.11 suite and
#: tests/test_sanitizers.py fuzz it), and 45 s more an interpreter
SUITE = ["tests/test_hostile.py", "tests/test_magic_loop.py", "tests/test_cli.py"]
#: what runs on each interpreter: the build on both; the tests on the newest (3.13, whose
#: recursion limit moved furthest), so the suite's run grows by ~4 minutes, not ~9, with
#: the venvs built (3.12's holds setuptools alone)
TESTED = {"3.12": False, "3.13": True}


def _interpreter(minor: str) -> str | None:
    """The first ``python{minor}`` that runs (a pyenv shim on the PATH may name one not installed)."""
    pyenv = sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / f"{minor}.*" / "bin" / "python")))
    for found in [*reversed(pyenv), shutil.which(f"python{minor}")]:
        if found and subprocess.run([found, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
            return found
    return None


def _venv(config: pytest.Config, python: str, packages: list[str]) -> Path:
    pins = sorted(f"{name}=={importlib.metadata.version(name)}" for name in packages)
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    key = hashlib.sha256(json.dumps([version, pins]).encode()).hexdigest()[:16]
    base = _venv_root(config).parent / "tracemagic-newer-pythons"
    venv = base / key
    with _locked(base / f"{key}.lock"):
        if not (venv / "installed.json").is_file():
            shutil.rmtree(venv, ignore_errors=True)  # a half-built one from an interrupted run
            _run([python, "-m", "venv", str(venv)], env=_clean_env(), timeout=300, what="python -m venv")
            _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:", *pins],
                 env=_clean_env(venv), timeout=1200, what=f"pip install {' '.join(pins)}")
            (venv / "installed.json").write_text(json.dumps(pins))
    return venv


def _run_in(tree: Path, cmd: list[str], *, env: dict[str, str], what: str) -> str:
    """``cmd`` run in ``tree`` (the copy, not the checkout); its output, or the test fails with it."""
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{out[-6000:]}", pytrace=False)
    return out


@pytest.mark.parametrize("minor", ["3.12", "3.13"])
def test_builds_without_warnings_and_the_torch_free_tests_pass(minor: str, request: pytest.FixtureRequest,
                                                                 tmp_path: Path) -> None:
    python = _interpreter(minor)
    if python is None:
        pytest.skip(f"no Python {minor} on this machine")
    venv = _venv(request.config, python, PACKAGES if TESTED[minor] else ["setuptools"])
    py = str(venv / "bin" / "python")
    tree = tmp_path / "tracemagic"
    tree.mkdir()
    for name in ("tracemagic", "vendor", "tests", "bench"):  # (tests/data: ~7 MB)
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, tree / name)
    env = {**_clean_env(venv), "PYTHONPATH": str(tree)}

    built = _run_in(tree, [py, "setup.py", "build_ext", "--inplace"], env=env, what=f"build_ext on {minor}")
    ours = [line for line in built.splitlines() if re.search(r"tracemagic/trace/_\w+\.c.*(warning|error):", line)]
    assert not ours, "\n".join(ours)
    for ext in ("_scan", "_nesting"):
        assert list((tree / "tracemagic" / "trace").glob(f"{ext}.cpython-{minor.replace('.', '')}*.so")), built[-3000:]

    if not TESTED[minor]:
        return
    out = _run_in(tree, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not browser", *SUITE],
                  env=env, what=f"the torch-free tests on {minor}")
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, out[-4000:]
