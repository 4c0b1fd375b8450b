"""The lint and format rules (``[tool.ruff]`` in pyproject.toml) catch what they are chosen
for: each deliberate violation below is reported with its code, a clean file passes, and
mccabe's limit is 20 exactly; the C files' functions are held to the same 20 (lizard's CCN).
The tests marked ``lint`` (``pytest -m lint``) hold the package itself to these rules."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lizard
import pytest

ROOT = Path(__file__).resolve().parents[1]

CLEAN = '''\
"""A module every rule accepts."""

from __future__ import annotations

import os
from pathlib import Path


def home(name: str) -> Path:
    """Where ``name`` lies."""
    try:
        return Path(os.environ[name])
    except KeyError:
        return Path.home()
'''


def _branches(n: int) -> str:
    """A function of cyclomatic complexity ``n + 1`` (``n`` ifs)."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n))
    return f'def f(x: int) -> int:\n    """Branches."""\n{body}    return -1\n'


#: a deliberate violation per rule family -> the code ruff must report
VIOLATIONS = {
    "F401": "import os\n",
    "E501": f"X = {'1 + ' * 40}1\n",  # 125 columns
    "BLE001": "try:\n    X = 1\nexcept Exception:\n    X = 2\n",
    "I001": "import sys\nimport os\n\nprint(os, sys)\n",
    "B006": "def f(x: list[int] = []) -> list[int]:\n    return x\n",
    "UP045": "from typing import Optional\n\nX: Optional[int] = None\n",
    "C901": _branches(20),  # complexity 21
    "RUF100": "X = 1  # noqa: E501\n",
    "N802": "def Name() -> None:\n    pass\n",
}


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args, "--no-cache", "--config", str(ROOT / "pyproject.toml")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _codes(path: Path) -> set[str]:
    done = _ruff("check", "--output-format", "json", str(path))
    assert done.returncode in (0, 1), done.stderr
    return {v["code"] for v in json.loads(done.stdout)}


def test_a_clean_file_passes(tmp_path: Path) -> None:
    (tmp_path / "clean.py").write_text(CLEAN)
    assert _codes(tmp_path / "clean.py") == set()
    assert _ruff("format", "--check", str(tmp_path / "clean.py")).returncode == 0


@pytest.mark.parametrize("code", sorted(VIOLATIONS))
def test_each_rule_catches_its_violation(tmp_path: Path, code: str) -> None:
    path = tmp_path / "bad.py"
    path.write_text(f'"""A deliberate {code}."""\n\n' + VIOLATIONS[code])
    assert code in _codes(path)
    assert _ruff("check", str(path)).returncode == 1  # the command fails


def test_complexity_20_passes_and_21_fails(tmp_path: Path) -> None:
    for ifs, expected in ((19, set()), (20, {"C901"})):
        path = tmp_path / f"cc{ifs + 1}.py"
        path.write_text('"""Complexity."""\n\n\n' + _branches(ifs))
        assert _codes(path) == expected, ifs + 1


def test_a_formatting_difference_fails_the_format_check(tmp_path: Path) -> None:
    path = tmp_path / "unformatted.py"
    path.write_text(textwrap.dedent(CLEAN).replace("def home(name: str)", "def home( name:str )"))
    done = _ruff("format", "--check", str(path))
    assert done.returncode == 1 and "unformatted.py" in done.stdout + done.stderr


# -- the package itself ------------------------------------------------------------------------


#: the most complex a C function may be: lizard's CCN, counted as mccabe counts Python's
#: (1 + each if, loop, case, &&, || and ?:), at the same limit
MAX_CCN = 20


def _package(*suffixes: str) -> list[str]:
    """The package's files git tracks, with these endings (the source of truth for what ships)."""
    done = subprocess.run(["git", "ls-files", "tracemagic"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    return [f for f in done.stdout.split() if f.endswith(suffixes)]


@pytest.mark.lint
def test_the_package_passes_ruff_check() -> None:
    files = _package(".py", ".pyi")
    assert len(files) > 50
    done = _ruff("check", "--output-format", "concise", *files)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.lint
def test_the_package_is_formatted() -> None:
    files = _package(".py", ".pyi")
    done = _ruff("format", "--check", *files)
    assert done.returncode == 0, "run `ruff format` on:\n" + done.stdout + done.stderr


def _ccn(path: Path) -> dict[str, int]:
    """Function name -> lizard's cyclomatic complexity, for a C file."""
    return {f.name: f.cyclomatic_complexity for f in lizard.analyze_file(str(path)).function_list}


def _over_limit(paths: list[Path]) -> dict[str, int]:
    """``file:function`` -> CCN of the C functions above ``MAX_CCN``."""
    return {f"{p.name}:{name}": ccn for p in paths for name, ccn in _ccn(p).items() if ccn > MAX_CCN}


@pytest.mark.lint
def test_every_c_function_is_at_most_ccn_20() -> None:
    files = [ROOT / f for f in _package(".c")]
    assert files, "no C files found"
    over = _over_limit(files)
    assert not over, f"C functions above CCN {MAX_CCN} (split them into static helpers): {over}"


def _c_branches(n: int) -> str:
    """A C function of cyclomatic complexity ``n + 1`` (``n`` ifs)."""
    body = "".join(f"    if (x == {i}) return {i};\n" for i in range(n))
    return f"static int f(int x) {{\n{body}    return -1;\n}}\n"


def test_the_c_complexity_check_fails_above_20(tmp_path: Path) -> None:
    path = tmp_path / "branches.c"
    for ifs, expected in ((19, {}), (20, {"branches.c:f": 21})):
        path.write_text(_c_branches(ifs))
        assert _ccn(path) == {"f": ifs + 1}
        assert _over_limit([path]) == expected
    path.write_text("static int g(int a, int b) {\n    while (a > 0 && b > 0) a--;\n    return a ? b : a || b;\n}\n")
    assert _ccn(path) == {"g": 5}  # while, &&, ?:, ||
