"""Type checking: mypy passes on the package (``[tool.mypy]`` in pyproject.toml: the whole
package at mypy's default strictness, the public API strictly), and a user's code that
calls ``tracemagic.load``/``tracemagic.capture`` sees their real signatures: right calls
pass ``--strict``, wrong ones are flagged (not "module is not callable", not ``Any``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tracemagic

ROOT = Path(__file__).resolve().parents[1]

RIGHT = '''
from pathlib import Path
from typing import assert_type

import pandas as pd

import tracemagic
from tracemagic.capture import CaptureConfig, prepare_cell


def analyse(path: Path) -> pd.DataFrame:
    trace = tracemagic.load(path, cache_dir="/tmp/cache", use_cache=True, workers=1, progress=False)
    assert_type(trace, tracemagic.Trace)
    return trace.ops()


def record() -> None:
    with tracemagic.capture(active=3, out="traces", timeout=60.0) as cap:
        for _ in cap.steps(range(5)):
            pass
    print(cap.result, CaptureConfig, prepare_cell)
'''

#: wrong calls, each with the error code mypy must report on its line
WRONG = {
    "tracemagic.load(42)": "arg-type",
    'tracemagic.load("t.json", cache="/tmp")': "call-arg",
    'tracemagic.load("t.json", use_cache="no")': "arg-type",
    'tracemagic.capture("traces")': "call-arg",
    'tracemagic.capture(timeout="soon")': "arg-type",
    "tracemagic.capture().no_such_method()": "attr-defined",
    'x: int = tracemagic.load("t.json")': "assignment",
}


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for this module's runs (numpy's stubs are read once), never in the checkout."""
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``python -m mypy ARGS`` in ``cwd``, with tracemagic found in the checkout."""
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=600,
    )


def user_code(text: str, folder: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """mypy ``--strict`` on a user's module (errors inside tracemagic are not the user's)."""
    (folder / "user.py").write_text(text)
    return mypy("--strict", "--follow-imports=silent", "--ignore-missing-imports", "user.py", cwd=folder, cache=cache)


def test_mypy_passes_on_the_package(tmp_path: Path, mypy_cache: Path) -> None:
    done = mypy("--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "tracemagic"), cwd=tmp_path, cache=mypy_cache)
    assert done.returncode == 0, done.stdout + done.stderr


def test_right_calls_pass_strict_mypy(tmp_path: Path, mypy_cache: Path) -> None:
    done = user_code(RIGHT, tmp_path, mypy_cache)
    assert done.returncode == 0, done.stdout + done.stderr


def test_wrong_calls_are_flagged_with_the_real_signatures(tmp_path: Path, mypy_cache: Path) -> None:
    lines = ["import tracemagic", *WRONG]
    done = user_code("\n".join(lines) + "\n", tmp_path, mypy_cache)
    assert done.returncode == 1, done.stdout + done.stderr
    found: dict[int, set[str]] = {}
    for number, code in re.findall(r"^user\.py:(\d+): error: .*\[([a-z-]+)\]$", done.stdout, re.MULTILINE):
        found.setdefault(int(number), set()).add(code)
    expected = {number: code for number, code in enumerate(WRONG.values(), start=2)}
    for number, code in expected.items():
        assert code in found.get(number, set()), f"line {number} ({lines[number - 1]}): {done.stdout}"
    assert set(found) == set(expected), done.stdout
    assert "not callable" not in done.stdout


def test_the_typed_names_are_the_runtime_ones() -> None:
    """What the type checker is told (the ``TYPE_CHECKING`` imports) is what runs:
    ``tracemagic.capture`` stays the package (its names import) and is callable."""
    from tracemagic.capture import CaptureConfig
    from tracemagic.script import ScriptCapture
    from tracemagic.facade import Trace, load

    assert tracemagic.load is load and tracemagic.Trace is Trace
    assert tracemagic.capture.CaptureConfig is CaptureConfig
    assert isinstance(tracemagic.capture(active=1), ScriptCapture)
