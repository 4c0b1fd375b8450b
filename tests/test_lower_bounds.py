"""The declared dependency lower bounds are honest: the suite passes on them.

A throwaway venv gets the LOWEST version every ``>=`` bound in ``pyproject.toml`` allows
(``pandas>=3.0`` -> ``pandas==3.0``, the main dependencies and pytest from the test
extra), binary wheels only; pip picks the newest versions of everything those pull in
(a "lowest-direct" resolution). torch is the exception: only the local CPU wheel can be
had here, so the venv gets the torch this interpreter already has (2.13.0+cpu); the
``torch>=`` bound itself comes from the torch APIs tracemagic calls (see
``pyproject.toml``). tracemagic goes in editable with ``--no-deps``, and the tests that
drive pandas, pyarrow, msgspec/orjson, plotly, ipywidgets and IPython run in it.

The venv is built once per set of pins (and Python, and checkout) under pytest's cache
directory (``.pytest_cache/d/tracemagic-lower-bounds``; the system temp directory with
``-p no:cacheprovider``) and reused: about 2 minutes to build, then the run itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

#: The part of the suite that exercises the dependencies' APIs (loading and caching:
#: pandas/pyarrow/msgspec/orjson; analyses: pandas/numpy; views: plotly/ipywidgets;
#: magics: IPython + torch.profiler). Browser and notebook tests stay out (their extras
#: are not installed), and so do the slow ones.
SUITE = [
    "tests/test_load.py",
    "tests/test_analysis_a.py",
    "tests/test_analysis_b.py",
    "tests/test_views.py",
    "tests/test_magic.py",
]
MARKERS = "not slow and not browser"
#: reads every real trace with the stdlib json module (~20 s, no dependency API): left out
DESELECT = "not test_kernels_match_the_raw_trace"
#: declared elsewhere than the main dependencies, but needed to run the suite
FROM_EXTRAS = {"pytest"}

pytestmark = pytest.mark.slow


def declared(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Requirement]:
    """The main dependencies (and pytest from the test extra), by canonical name."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        requirements += [r for r in map(Requirement, extra) if canonicalize_name(r.name) in FROM_EXTRAS]
    return {
        canonicalize_name(r.name): r
        for r in requirements
        if r.marker is None or r.marker.evaluate({"extra": ""})
    }


def lowest_pin(req: Requirement) -> str:
    """``name==<the lowest version the requirement allows>`` (``pandas>=3.0`` -> ``pandas==3.0``)."""
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "~=", "==")]
    assert lows, f"pyproject.toml: {req} declares no lower bound"
    return f"{req.name}=={max(lows)}"


def _torch_pin(req: Requirement) -> str:
    """The torch this interpreter has (the only one installable here), if the bound allows it."""
    try:
        have = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError("no torch in this environment to pin the lower-bound venv to") from None
    assert req.specifier.contains(have, prereleases=True), f"torch {have} here is outside the declared {req}"
    return f"torch=={have}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions building the same venv wait for each other
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str], *, env: dict[str, str], timeout: float, what: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    noise = "WARNING: Location"  # pip's complaint about the machine's empty extra indexes
    if proc.returncode != 0:
        tail = "\n".join(line for line in out.splitlines() if not line.startswith(noise))[-6000:]
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{tail}", pytrace=False)
    return out


def _clean_env(venv: Path | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PIP_REQUIRE_VIRTUALENV"}
    }
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _venv_root(config: pytest.Config) -> Path:
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("tracemagic-lower-bounds"))
    return Path(tempfile.gettempdir()) / "tracemagic-lower-bounds"


def lower_bound_venv(config: pytest.Config, pins: list[str]) -> tuple[Path, dict[str, Any]]:
    """The venv for these pins, built if needed; and what it holds (``installed.json``)."""
    key = hashlib.sha256(json.dumps([sys.version, str(ROOT), sorted(pins)]).encode()).hexdigest()[:16]
    base = _venv_root(config)
    venv = base / key
    stamp = venv / "installed.json"
    with _locked(base / f"{key}.lock"):
        if stamp.is_file():
            return venv, {**json.loads(stamp.read_text()), "cached": True}
        shutil.rmtree(venv, ignore_errors=True)  # a half-built one from an interrupted run
        t0 = time.monotonic()
        env = _clean_env()
        _run([sys.executable, "-m", "venv", str(venv)], env=env, timeout=300, what="python -m venv")
        py = str(venv / "bin" / "python")
        env = _clean_env(venv)
        _run(
            [py, "-m", "pip", "install", "-q", "--only-binary=:all:", *pins],
            env=env, timeout=1200, what=f"pip install {' '.join(pins)}",
        )
        # no C build here: it would rewrite, in the source tree, the extensions the running
        # suite has loaded; the editable install finds the ones the main venv built there
        _run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], env={**env, "TRACEMAGIC_NO_C": "1"},
             timeout=600, what="pip install --no-deps -e . (tracemagic)")
        names = [p.split("==")[0] for p in pins] + ["tracemagic"]
        probe = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
        versions = json.loads(_run([py, "-c", probe, *names], env=env, timeout=120, what="reading versions").strip().splitlines()[-1])
        info = {"versions": versions, "build_s": round(time.monotonic() - t0, 1)}
        stamp.write_text(json.dumps(info, indent=1))
        return venv, {**info, "cached": False}


def test_suite_passes_on_the_declared_lower_bounds(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = declared()
    pins = {name: _torch_pin(req) if name == "torch" else lowest_pin(req) for name, req in reqs.items()}
    venv, info = lower_bound_venv(request.config, sorted(pins.values()))
    versions = info["versions"]

    # pip gave exactly the lowest versions (torch: the local one)
    for name, pin in pins.items():
        want = pin.split("==", 1)[1]
        got = next(v for n, v in versions.items() if canonicalize_name(n) == name)
        assert Version(got) == Version(want), f"{name}: venv has {got}, the lower bound is {want}"

    shown = ", ".join(f"{n} {v}" for n, v in sorted(versions.items()) if n != "tracemagic")
    how = "cached venv" if info["cached"] else f"venv built in {info['build_s']} s"
    with capsys.disabled():
        print(
            f"\n[lower bounds] {how}: {venv}\n[lower bounds] {shown} "
            f"(declared {reqs['torch']}: only the local torch can be installed here)"
        )

    t0 = time.monotonic()
    out = _run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-m", MARKERS, "-k", DESELECT, *SUITE],
        env=_clean_env(venv), timeout=1500, what="the suite on the lower bounds",
    )
    summary = out.strip().splitlines()[-1]
    with capsys.disabled():
        print(f"[lower bounds] {summary} ({time.monotonic() - t0:.0f} s)")
    assert " passed" in summary and "failed" not in summary and "error" not in summary, out[-4000:]
