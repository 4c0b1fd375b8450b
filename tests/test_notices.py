"""Torch's native start/stop notices: hidden from the cell's output, recorded in capture.json,
and nothing else lost (``tracemagic.capture.notices``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracemagic.capture import notices

USDT = "USDT:2026-11-23 22:23:17 19388:19388 SyncActivityProfilerHandler.cpp:52] profiler_start"


def test_known_notices_are_hidden_and_other_native_output_is_kept(capsys: pytest.CaptureFixture[str]) -> None:
    hidden: list[str] = []
    with notices.hush(hidden):
        os.write(2, f"{USDT}\nsomething torch really means\n".encode())
        os.write(1, b"[W CPUAllocator.cpp:249] Memory block of unknown size was allocated before the profiling started\n")
    assert hidden == [USDT, "[W CPUAllocator.cpp:249] Memory block of unknown size was allocated before the profiling started"]
    assert capsys.readouterr().err == "something torch really means\n"
    os.write(2, b"")  # the descriptors are back: writing still works


def test_a_capture_prints_no_profiler_notices_and_records_them(tmp_path: Path) -> None:
    """The magic in a real IPython shell, in a child process whose raw stderr we read."""
    script = textwrap.dedent(
        """
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "tracemagic")
        ip.run_cell("import torch\\nm = torch.nn.Linear(8, 8)")
        ip.run_cell_magic("chakra_trace", "--active 2 --wait 0 --warmup 1 -q -v cap",
                         "for _ in range(4):\\n    m(torch.randn(4, 8)).sum().backward()\\n")
        print("DIR", ip.user_ns["cap"].dir)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "profiler_start" not in done.stderr + done.stdout and "profiler_stop" not in done.stderr + done.stdout
    (folder,) = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("DIR ")]
    manifest = json.loads((tmp_path / folder / "capture.json").read_text())
    hidden = manifest["hidden_output"]
    assert hidden and all(notices.is_notice(line) for line in hidden)
    assert any("profiler_start" in line for line in hidden) and any("profiler_stop" in line for line in hidden)
