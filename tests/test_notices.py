"""Torch's native start/stop notices: hidden from the cell's output, recorded in capture.json,
and nothing else lost (``tracemagic.capture.notices``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import run_in_kernel

from tracemagic.capture import notices
from tracemagic.capture.session import NO_WARMUP_NOTE

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


def test_the_filter_passes_other_lines_at_once_and_keeps_the_notices(capfd: pytest.CaptureFixture[str]) -> None:
    """Descriptor 2 through ``notices.Filter``: notices out, other lines (and an unfinished
    line, after ``PARTIAL_LINE_WAIT_S``) through, in order, while the filter still runs."""
    import time

    hidden: list[str] = []
    live = notices.Filter(hidden)
    live.start()
    try:
        os.write(2, b"first line\n[W1126 12:00:00.1 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
                    b"before the profiling started, profiler results will not include the deallocation event\n")
        os.write(2, b"[W1126 execution_trace_observer.cpp:989] Enabling Execution Trace Observer\nprogress 50%\r")
        os.write(2, b"unfinished")
        time.sleep(10 * notices.PARTIAL_LINE_WAIT_S)
        assert capfd.readouterr().err == "first line\nprogress 50%\runfinished"  # already through
    finally:
        live.stop()
    assert [h.split("] ", 1)[1][:20] for h in hidden] == ["Memory block of unkn", "Enabling Execution T"]
    os.write(2, b"after\n")  # descriptor 2 is back
    assert capfd.readouterr().err == "after\n"


def test_torch_s_own_calls_print_aside_sorted_at_once_in_order_and_never_blocking(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``Filter.aside`` (torch's start and stop calls): their notices are kept, their other
    lines reach descriptor 2 by the time it returns, in order after what was written before,
    the pipe's reader is not woken (nothing reaches the pipe), and a call printing more than
    a pipe holds does not block."""
    hidden: list[str] = []
    live = notices.Filter(hidden)
    live.start()
    pump = notices._Pump.get()
    big = b"x" * (3 * pump.capacity) + b"\n"
    try:
        os.write(2, b"before\n")
        live.stop()  # everything written so far passed on: the pipe is empty now
        live.start()
        seen: list[bytes] = []

        def torch_call() -> None:
            os.write(2, f"{USDT}\nsomething torch means\n".encode())
            os.write(2, big)
            seen.append(stat.S_ISREG(os.fstat(2).st_mode))  # a file, not the reader's pipe

        live.aside(torch_call)
        assert seen == [True]
        assert capfd.readouterr().err == "before\nsomething torch means\n" + big.decode()  # passed on at once
        live.aside(lambda: os.write(2, b"unfinished"))  # a last line without its end is passed on too
        assert capfd.readouterr().err == "unfinished"
        os.write(2, b"through the pipe\n")  # descriptor 2 is the filter's again
    finally:
        live.stop()
    assert hidden == [USDT]
    assert capfd.readouterr().err == "through the pipe\n"
    notices.Filter([]).aside(lambda: os.write(2, f"{USDT}\n".encode()))  # no filter on: runs as it is
    assert capfd.readouterr().err == f"{USDT}\n"


def test_torch_s_lines_come_after_the_lines_the_reader_has_not_read_yet(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines written just before torch's call may still be in the pipe (the reader not
    scheduled yet: the user's thread holds the GIL): what the call printed is passed on
    after them, in the order it was all written, not ahead of them."""
    monkeypatch.setattr(notices._Pump, "_instance", None)  # a pump of this test's own ...
    monkeypatch.setattr(notices._Pump, "_run", lambda self: None)  # ... whose reader never runs
    hidden: list[str] = []
    live = notices.Filter(hidden)
    live.start()
    pump = notices._Pump._instance
    assert pump is not None and live.active
    try:
        os.write(2, b"the loop's last line\n")  # in the pipe, unread
        live.aside(lambda: os.write(2, f"{USDT}\ntorch's line\n".encode()))
        os.write(2, b"after\n")
    finally:
        live.stop()
        for fd in (pump.read, pump.write, pump.sink, pump.forward):
            if fd is not None:
                os.close(fd)
    assert capfd.readouterr().err == "the loop's last line\ntorch's line\nafter\n"
    assert hidden == [USDT]


def test_torch_s_call_leaves_descriptor_2_where_it_found_it(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Descriptor 2 moved by someone else while the filter is on (the user's loop inside
    an fd-level capture of its own, such as ``wurlitzer.pipes``): torch's call, made from
    ``prof.step()`` in that loop, puts it back where it was, not on the filter's pipe."""
    hidden: list[str] = []
    live = notices.Filter(hidden)
    live.start()
    theirs = os.open(tmp_path / "theirs.txt", os.O_WRONLY | os.O_CREAT)
    ours = os.dup(2)
    try:
        os.dup2(theirs, 2)  # someone else's capture begins
        live.aside(lambda: os.write(2, f"{USDT}\n".encode()))
        os.write(2, b"for their capture\n")
        os.dup2(ours, 2)  # and ends
    finally:
        os.close(theirs)
        os.close(ours)
        live.stop()
    assert (tmp_path / "theirs.txt").read_text() == "for their capture\n"
    assert capfd.readouterr().err == ""
    assert hidden == [USDT]


def test_torch_s_notices_are_sorted_even_while_the_reader_holds_the_pipe(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader stuck (writing to a descriptor 2 nobody reads) holds the pump's lock:
    sorting what torch's call printed waits ``STOP_WAIT_S`` for it, then sorts anyway (it
    waited for ever, inside the user's loop)."""
    import threading
    import time

    monkeypatch.setattr(notices, "STOP_WAIT_S", 0.2)
    hidden: list[str] = []
    live = notices.Filter(hidden)
    live.start()
    pump = notices._Pump.get()
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        with pump.lock:
            held.set()
            free.wait(10)

    threading.Thread(target=hold, daemon=True).start()
    try:
        assert held.wait(5)
        began = time.perf_counter()
        live.aside(lambda: os.write(2, f"{USDT}\nwhile stuck\n".encode()))
        waited = time.perf_counter() - began
        assert 0.2 <= waited < 2, waited
        assert hidden == [USDT]
        assert capfd.readouterr().err == "while stuck\n"
    finally:
        free.set()
        live.stop()


def test_the_first_capture_in_a_fresh_kernel_shows_no_notices(tmp_path: Path) -> None:
    """A real kernel (nbclient), its first capture with --et: tensors made before it are freed
    mid-loop (the CPU allocator's once-per-process notice) and the ET observer starts and
    stops; no stream output carries a notice, capture.json keeps them all, and C++-level
    output of the cell's own still shows."""

    cells = [
        "%load_ext tracemagic\nimport os, torch\nmodel = torch.nn.Linear(16, 4)\n"
        "early = [torch.randn(64, 64) for _ in range(8)]",
        "%%chakra_trace --et --wait 0 --warmup 1 --active 2 --no-memory-timeline\n"
        "for i in range(4):\n    early.pop()\n    model(torch.randn(8, 16)).sum().backward()\n"
        "    os.write(2, f'native line {i}\\n'.encode())",
        "print(_chakra_capture.dir)",
        # --warmup 0, asked for: torch's warning (which names tracemagic's file) becomes the capture's note
        "%%chakra_trace -q --wait 0 --warmup 0 --active 1 --no-memory-timeline\n"
        "for i in range(2):\n    model(torch.randn(8, 16)).sum().backward()",
        "print(_chakra_capture.summary())",
    ]
    # ipykernel forwards C++-level output (descriptor 2) to the notebook as users see it,
    # except under pytest (``PYTEST_CURRENT_TEST`` in its environment): the kernel runs without it
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    nb = run_in_kernel(cells, tmp_path, env)
    streams = [o for c in nb.cells for o in c.outputs if o.output_type == "stream"]
    text = "".join(o.text for o in streams)
    for phrase in ("profiler_start", "profiler_stop", "allocated before the profiling started",
                   "Execution Trace Observer", "using warmup", "session.py"):
        assert phrase not in text, text
    assert "".join(o.text for o in nb.cells[1].outputs if o.output_type == "stream" and o.name == "stderr") == \
        "".join(f"native line {i}\n" for i in range(4))
    folder = tmp_path / nb.cells[2].outputs[0].text.strip()
    hidden = json.loads((folder / "capture.json").read_text())["hidden_output"]
    assert all(notices.is_notice(line) for line in hidden)
    for phrase in ("profiler_start", "profiler_stop", "allocated before the profiling started",
                   "Enabling Execution Trace Observer", "Disabling Execution Trace Observer"):
        assert any(phrase in line for line in hidden), (phrase, hidden)
    assert NO_WARMUP_NOTE not in json.loads((folder / "capture.json").read_text())["notes"]  # --warmup 1
    assert f"note: {NO_WARMUP_NOTE}" in nb.cells[4].outputs[0].text


def test_the_filter_does_not_wait_for_a_child_that_inherited_it(capfd: pytest.CaptureFixture[str]) -> None:
    """A process started while filtering (a DataLoader worker) holds the pipe open after the
    capture: stop() returns once the pipe is drained, and the child's later lines still reach
    descriptor 2."""
    import time

    live = notices.Filter([])
    live.start()
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.stderr.write('child line\\n')"])
    try:
        began = time.perf_counter()
        live.stop()
        assert time.perf_counter() - began < 1.0
    finally:
        child.wait(timeout=30)
    time.sleep(10 * notices.PARTIAL_LINE_WAIT_S)
    assert "child line\n" in capfd.readouterr().err


def test_what_is_written_before_stop_is_passed_on_before_it_returns(capfd: pytest.CaptureFixture[str]) -> None:
    """Lines written just before stop() (no time for the thread to run) are passed on, or kept
    as notices, by the time it returns, every time."""
    notice = b"USDT:2026-11-26 12:00:00 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
    for i in range(30):
        hidden: list[str] = []
        live = notices.Filter(hidden)
        live.start()
        os.write(2, b"line %d\n" % i + notice + b"tail %d" % i)  # the last line unfinished
        live.stop()
        assert capfd.readouterr().err == f"line {i}\ntail {i}"
        assert len(hidden) == 1 and hidden[0].endswith("profiler_stop")



HIGH_DESCRIPTORS = """
import os, resource, sys
from tracemagic.capture import notices
from tracemagic.capture.session import NO_WARMUP_NOTE
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < 1200:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.dup(1) for _ in range(1100)]  # a process with many files open (datasets, sockets)
live = notices.Filter([])
live.start()
assert live.active
for _ in range(2000):  # 400 KB: more than a pipe holds, so the reader must keep up
    os.write(2, b"y" * 199 + b"\\n")
live.stop()
print("done")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="descriptor numbers and RLIMIT_NOFILE are POSIX")
def test_the_filter_reads_its_pipe_in_a_process_with_over_a_thousand_descriptors(tmp_path: Path) -> None:
    """The pipe's descriptor numbered past select()'s FD_SETSIZE (1024), as in a process
    with many files open: the reader still drains it, so a cell writing more to descriptor
    2 than a pipe holds goes on (it blocked for ever when the reader could not wait on it)."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard limit on open files is too low")
    done = subprocess.run([sys.executable, "-c", HIGH_DESCRIPTORS], cwd=tmp_path, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.decode().strip() == "done"
    assert done.stderr.count(b"y" * 199 + b"\n") == 2000


A_WRITER_WITHOUT_PAUSE = """
import os, subprocess, sys, tempfile, time
from tracemagic.capture import notices
from tracemagic.capture.session import NO_WARMUP_NOTE
out = tempfile.TemporaryFile()
os.dup2(out.fileno(), 2)  # the original descriptor 2: a file whose size says what was passed on
live = notices.Filter([])
live.start()
writers = [subprocess.Popen([sys.executable, "-c", "import os, time\\nend = time.time() + 20\\n"
                            "while time.time() < end: os.write(2, b'x' * 4000 + b'\\\\n')"]) for _ in range(3)]
time.sleep(1.0)
before = os.fstat(out.fileno()).st_size
time.sleep(0.5)
passed = os.fstat(out.fileno()).st_size - before  # in the last half second
began = time.perf_counter()
live.stop()
took = time.perf_counter() - began
alive = all(writer.poll() is None for writer in writers)
for writer in writers:
    writer.kill()
    writer.wait()
print(passed, took, alive)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="a pipe on descriptor 2 is POSIX")
def test_a_child_writing_without_pause_is_passed_on_as_it_writes_and_stop_does_not_wait_for_it(
    tmp_path: Path,
) -> None:
    """Processes that inherited the pipe (DataLoader workers) and write to it without a
    pause: their lines reach descriptor 2 while they write (they were held, in a buffer
    growing without bound, until the writers paused), and stop() returns while they still
    write (it waited for them, past its timeout)."""
    done = subprocess.run([sys.executable, "-c", A_WRITER_WITHOUT_PAUSE], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    passed, took, alive = done.stdout.split()
    assert alive == "True"  # (the writers were still writing when stop() returned)
    assert int(passed) > 100_000, passed  # (in half a second: held back, it was 0)
    assert float(took) < 1.0, took


def test_a_reader_that_holds_the_pipe_leaves_the_next_capture_unfiltered_not_waiting() -> None:
    """The reader stuck writing to a descriptor 2 nobody reads holds the pump: a filter's
    start gives up after ``START_WAIT_S`` and the capture runs unfiltered (it waited for
    ever); once the reader lets go, the next filter filters again."""
    import threading
    import time

    pump = notices._Pump.get()
    held = threading.Event()
    free = threading.Event()

    def hold() -> None:
        with pump.lock:
            held.set()
            free.wait(10)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(5)
    stuck = notices.Filter([])
    began = time.perf_counter()
    stuck.start()
    waited = time.perf_counter() - began
    free.set()
    assert not stuck.active and notices.START_WAIT_S <= waited < notices.START_WAIT_S + 2
    stuck.stop()  # nothing to stop
    later = notices.Filter([])
    later.start()
    try:
        assert later.active
    finally:
        later.stop()
    assert not later.active


def test_a_stop_interrupted_while_waiting_leaves_later_captures_filtered() -> None:
    """Ctrl-C while ``stop`` waits for the reader: the interrupt reaches the user, and the
    next capture still filters (a flag left on made every later one run unfiltered)."""

    class Interrupted:
        def __init__(self, lock: Any) -> None:
            self.lock = lock

        def acquire(self, timeout: float = -1) -> bool:
            raise KeyboardInterrupt

    pump = notices._Pump.get()
    first = notices.Filter([])
    first.start()
    assert first.active
    real = pump.lock
    pump.lock = Interrupted(real)  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            first.stop()
    finally:
        pump.lock = real
    assert not first.active
    second = notices.Filter([])
    second.start()
    try:
        assert second.active
    finally:
        second.stop()
