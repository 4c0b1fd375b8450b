"""Diagnostics go to the ``tracemagic`` logger (a child per module): silent by default (a
``NullHandler`` on the package logger, nothing on stderr), shown when the application turns
logging on or ``TRACEMAGIC_LOG`` asks for it, as the README says."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tracemagic
from conftest import TRACES

ROOT = Path(__file__).resolve().parents[1]
TRACE = TRACES / "hta_control.json.gz"
LOAD = f"import tracemagic; tracemagic.load({str(TRACE)!r}, use_cache=False, progress=False)"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRACEMAGIC_LOG"}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


def test_silent_by_default() -> None:
    package = logging.getLogger("tracemagic")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)
    # not even a warning configured nowhere reaches stderr (logging's last resort)
    assert _run(LOAD + "; import logging; logging.getLogger('tracemagic.trace.loader').warning('x')").stderr == ""


def test_tracemagic_log_shows_the_diagnostics_on_stderr() -> None:
    err = _run(LOAD, TRACEMAGIC_LOG="debug").stderr
    assert f"tracemagic.trace.loader DEBUG: {TRACE}: parsed 1 file(s)" in err and "(cache: off)" in err
    assert _run(LOAD, TRACEMAGIC_LOG="warning").stderr == ""  # a level above the diagnostics


def test_turned_on_by_the_application(caplog: pytest.LogCaptureFixture, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tracemagic.views import data

    caplog.set_level(logging.DEBUG, logger="tracemagic")
    tracemagic.load(TRACE, cache_dir=tmp_path, progress=False)
    trace = tracemagic.load(TRACE, cache_dir=tmp_path, progress=False)
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert ("tracemagic.trace.loader", f"{TRACE}: parsed 1 file(s) ({TRACE.stat().st_size / 1e6:.1f} MB read), "
            f"{len(trace.events)} events (cache: missed)") in messages
    assert ("tracemagic.trace.loader", f"{TRACE}: {len(trace.events)} events read from the cache") in messages

    def broken(_trace: object) -> None:
        raise ValueError("boom")

    monkeypatch.setitem(data.ANALYSES, "ops", broken)
    caplog.clear()
    with pytest.warns(UserWarning, match="the ops analysis failed"):  # the user's warning stays a warning
        assert data.TraceData(trace).table("ops").empty
    (record,) = [r for r in caplog.records if r.name == "tracemagic.views.data"]
    assert record.getMessage() == "the ops analysis failed" and record.exc_info and "boom" in str(record.exc_info[1])

