"""A fixed-seed fuzz of ``tracemagic.load`` (``bench/fuzz_load.py``, issue 14): mutants of the
real traces (bytes flipped, cut, inserted; numbers beyond int64/float64; invalid UTF-8;
nesting thousands of levels deep; odd step names; fields dropped or of the wrong type;
damaged gzip; tars), each loaded on the C path (two of three on two threads, cut into
3-14 stretches: ``trace.split``) and on the one-thread pure Python path with the main tables
computed. Each must load with the same tables and warnings on both paths or raise the same
``TraceError`` naming the file. Workers run the mutants in batches in subprocesses, so a
crash or a hang fails the test naming the mutant (rerun it with ``--only N``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "bench" / "fuzz_load.py"
MUTANTS = 300
SEED = 14


def fuzz(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(FUZZ), "--json", "--jobs", "2", *args],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    assert done.stdout.strip(), f"the fuzz printed nothing:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


def test_fuzzed_real_traces_load_or_raise_trace_error_alike_on_both_paths() -> None:
    summary = fuzz("--mutants", str(MUTANTS), "--seed", str(SEED), "--batch", "50", "--timeout", "120")
    failures = summary["failures"]
    assert not failures, "\n\n".join(
        f"mutant {f['i']} ({f.get('file')}): {f['outcome']} on the {f.get('path', 'C and Python')} path "
        f"(rerun: bench/fuzz_load.py --seed {SEED} --only {f['i']}; --save DIR writes it)\n{f.get('detail')}"
        for f in failures[:10]
    )
    counts = summary["counts"]
    assert summary["mutants"] == MUTANTS
    # not a vacuous run: the mutants both load and fail, in every format
    assert counts.get("ok", 0) > MUTANTS // 5 and counts.get("trace_error", 0) > MUTANTS // 5, counts
    assert all(sum(by.values()) > 10 for by in summary["by_format"].values()), summary["by_format"]


def test_the_fuzz_reports_a_crash_and_a_hang_by_mutant() -> None:
    """The harness itself: a worker killed by a signal, or one that stops answering, is a
    failure naming the mutant it was on, and the batch goes on without it."""
    summary = fuzz("--mutants", "6", "--batch", "6", "--timeout", "8",
                   env={"TRACEMAGIC_FUZZ_CRASH_AT": "1", "TRACEMAGIC_FUZZ_HANG_AT": "4"})
    outcomes = {f["i"]: f["outcome"] for f in summary["failures"]}
    assert outcomes == {1: "crash", 4: "hang"}
    assert summary["mutants"] == 6


def test_the_fuzz_stopped_by_sigterm_leaves_no_worker_running() -> None:
    """A caller's timeout stops the harness with SIGTERM (``tests/test_sanitizers.py`` does):
    its workers, in sessions of their own, are killed with it, not left behind, even one
    stalled in a mutant."""
    harness = subprocess.Popen(
        [sys.executable, str(FUZZ), "--json", "--jobs", "2", "--mutants", "4", "--batch", "2", "--timeout", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRACEMAGIC_FUZZ_HANG_AT": "0"},
    )
    children = Path(f"/proc/{harness.pid}/task/{harness.pid}/children")
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline and harness.poll() is None:
        time.sleep(0.2)
        workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    assert len(workers) == 2, harness.communicate()[1][-3000:]
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=60) != 0
    # a killed worker is reaped by init once its parent is gone: until then it is a zombie
    # (its /proc entry still there); one stalled in a mutant and not killed runs on for good
    deadline = time.monotonic() + 10
    while [pid for pid in workers if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _running(pid)], "workers left running"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_mutants_the_10000_run_found_now_load() -> None:
    """Seed 0's mutants that once raised TypeError from the roofline (an ``Input type`` of
    nested lists): they load, or raise TraceError, alike on both paths."""
    summary = fuzz("--seed", "0", "--only", "3579,4835,6808", "--timeout", "120")
    assert summary["mutants"] == 3 and not summary["failures"], summary["failures"]
