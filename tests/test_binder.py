"""The Binder (repo2docker) configuration in ``binder/`` builds what the notebooks need.

When ``binder/`` exists repo2docker ignores the repository's root config, so ``binder/``
must list every runtime dependency of ``pyproject.toml`` and install tracemagic itself
(``postBuild``). These tests check the files against ``pyproject.toml``, against what the
package really imports, and against ``constraints.txt`` (the versions the suite runs with),
then install ``binder/requirements.txt`` and run ``postBuild`` in a throwaway virtualenv,
torch taken from the local CPU wheel, to prove it installs without CUDA packages and the
extension loads.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import unquote

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
WHEELS = Path("/opt/wheels")  # the local CPU torch wheel (see scripts/setup_venv.sh)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: import name -> distribution name, where they differ
DIST_OF_MODULE = {"IPython": "ipython", "yaml": "pyyaml"}


def _requirements(path: Path) -> tuple[dict[str, Requirement], list[str]]:
    """(requirements by canonical name, option lines) of a requirements file."""
    reqs: dict[str, Requirement] = {}
    options: list[str] = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        req = Requirement(line)
        reqs[canonicalize_name(req.name)] = req
    return reqs, options


def _pin(req: Requirement) -> Version:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"binder pins exact versions: {req}"
    return Version(specs[0].version)


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def binder_reqs() -> tuple[dict[str, Requirement], list[str]]:
    return _requirements(BINDER / "requirements.txt")


def _constraints() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_binder_folder_has_what_repo2docker_needs() -> None:
    assert (BINDER / "requirements.txt").is_file()
    post = BINDER / "postBuild"
    assert post.is_file() and os.access(post, os.X_OK), "binder/postBuild must be executable"
    text = post.read_text(encoding="utf-8")
    assert text.startswith("#!"), "postBuild needs a shebang"
    assert "set -e" in text, "postBuild must fail the build when a command fails"
    assert re.search(r"pip install .*--no-deps .*\.$", text, re.M), "postBuild installs this checkout (pip install --no-deps .)"
    # other environment files in binder/ would take precedence over requirements.txt
    for other in ("environment.yml", "Pipfile", "setup.py", "Dockerfile", "pyproject.toml"):
        assert not (BINDER / other).exists(), f"binder/{other} would override requirements.txt"


def test_runtime_python_fits_requires_python(pyproject: dict) -> None:
    runtime = (BINDER / "runtime.txt").read_text(encoding="utf-8").strip()
    match = re.fullmatch(r"python-(\d+)\.(\d+)", runtime)
    assert match, f"runtime.txt must read python-X.Y, got {runtime!r}"
    from packaging.specifiers import SpecifierSet

    assert Version(f"{match[1]}.{match[2]}") in SpecifierSet(pyproject["project"]["requires-python"])


def test_every_dependency_is_pinned_within_pyproject(pyproject: dict, binder_reqs) -> None:
    reqs, _ = binder_reqs
    for dep in pyproject["project"]["dependencies"]:
        wanted = Requirement(dep)
        name = canonicalize_name(wanted.name)
        assert name in reqs, f"binder/requirements.txt lacks {wanted.name} (pyproject: {dep})"
        pinned = _pin(reqs[name])
        assert wanted.specifier.contains(pinned, prereleases=True), f"binder pins {reqs[name]}, pyproject wants {dep}"


def test_pins_are_the_versions_the_suite_runs_with(binder_reqs) -> None:
    reqs, _ = binder_reqs
    tested = _constraints()
    for name, req in reqs.items():
        if not req.specifier or any(s.operator != "==" for s in req.specifier):
            continue  # a range on purpose (jupyterlab comes with the Binder image)
        assert name in tested, f"{req} is not in constraints.txt: the suite never runs with it"
        assert _pin(req).public == tested[name].public, f"binder {req} vs constraints.txt {name}=={tested[name]}"


def test_torch_is_the_cpu_build(binder_reqs) -> None:
    reqs, options = binder_reqs
    torch = reqs["torch"]
    assert _pin(torch).local == "cpu", f"pin the CPU build (torch==X.Y.Z+cpu), got {torch}"
    assert f"--extra-index-url {TORCH_CPU_INDEX}" in options, "the +cpu wheels live on PyTorch's CPU index"


def _third_party_imports() -> set[str]:
    """Top-level modules tracemagic imports at module level (not inside functions)."""
    stdlib = set(sys.stdlib_module_names)
    found: set[str] = set()
    for path in (ROOT / "tracemagic").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only: lazy imports inside functions are optional
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top != "tracemagic" and top != "__future__":
                    found.add(top)
    return found


def test_binder_installs_everything_tracemagic_imports(binder_reqs) -> None:
    # postBuild installs with --no-deps, so this list is all the image gets
    reqs, _ = binder_reqs
    missing = sorted(m for m in _third_party_imports() if canonicalize_name(DIST_OF_MODULE.get(m, m)) not in reqs)
    assert not missing, f"tracemagic imports {missing} at module level; add them to binder/requirements.txt"


def test_pyproject_declares_everything_tracemagic_imports(pyproject: dict) -> None:
    declared = {canonicalize_name(Requirement(d).name) for d in pyproject["project"]["dependencies"]}
    missing = sorted(m for m in _third_party_imports() if canonicalize_name(DIST_OF_MODULE.get(m, m)) not in declared)
    assert not missing, (
        f"tracemagic imports {missing} at module level but [project].dependencies in "
        "pyproject.toml does not list them: `pip install tracemagic` would fail on import"
    )


def test_notebooks_the_badge_opens_exist() -> None:
    assert (ROOT / "notebooks" / "quickstart.ipynb").is_file()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for url in re.findall(r"https://mybinder\.org/v2/gh/[^)\s\]]+", readme):
        path = re.search(r"urlpath=lab/tree/([^&)\s]+)", unquote(url))
        assert path, f"the Binder link should open JupyterLab on a notebook (urlpath=lab/tree/...): {url}"
        assert (ROOT / path[1]).is_file(), f"{url} opens {path[1]}, which does not exist"


@pytest.mark.slow
def test_binder_installs_in_a_fresh_venv(tmp_path: Path) -> None:
    """What repo2docker does, in an empty venv: pip installs binder/requirements.txt, then
    binder/postBuild runs (installing this checkout); no CUDA wheels, the extension loads.

    torch comes from the local CPU wheel when there is one (this machine cannot reach
    PyTorch's index), pinned by a constraints file.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    reqs = tmp_path / "requirements.txt"
    lines = (BINDER / "requirements.txt").read_text(encoding="utf-8").splitlines()
    extra: list[str] = []
    local_torch = sorted(WHEELS.glob("torch-2.13.0+cpu-*.whl")) if WHEELS.is_dir() else []
    if local_torch:
        lines = [l for l in lines if not l.startswith("--extra-index-url")]
        extra = ["--find-links", str(WHEELS)]
    reqs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.13.0\n", encoding="utf-8")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir", "-r", str(reqs), "-c", str(constraints), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    post = subprocess.run(["bash", str(BINDER / "postBuild")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert post.returncode == 0, post.stderr[-3000:]
    assert "tracemagic" in post.stdout
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], env=env, capture_output=True, text=True, timeout=120)
    installed = {canonicalize_name(item["name"]): Version(item["version"]) for item in json.loads(listed.stdout)}
    assert installed["torch"] == Version("2.13.0+cpu")
    cuda = sorted(n for n in installed if n.startswith("nvidia-") or n == "triton")
    assert not cuda, f"CUDA packages were installed: {cuda}"
    assert "tracemagic" in installed
    pinned, _ = _requirements(BINDER / "requirements.txt")
    for name, req in pinned.items():
        assert name in installed, f"{name} not installed"
        assert req.specifier.contains(installed[name], prereleases=True), f"{name} is {installed[name]}, binder wants {req}"
    # the image a user lands in: the extension loads in IPython and the magic is there
    check = "from IPython.core.interactiveshell import InteractiveShell; ip = InteractiveShell.instance(); ip.run_line_magic('load_ext', 'tracemagic'); assert ip.find_cell_magic('chakra_trace')"
    loaded = subprocess.run([str(python), "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
