"""%%chakra_trace when things go wrong: each failure of the spec, in a real shell."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_kernel
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import torch  # noqa: E402

LOOP = """\
model = make_mlp()
ran = []
for i in range({n}):
    ran.append(i)
    model(torch.randn(4, 32)).sum().backward()
"""

RAISE_AT_5 = """\
model = make_mlp()
for i in range(10):
    model(torch.randn(4, 32)).sum().backward()
    if i == 5:
        raise ValueError("bad batch")
"""


def run(ip: Any, line: str, body: str) -> tuple[Any, Any]:
    with capture_output() as out:
        result = ip.run_cell(f"%%chakra_trace {line}\n{body}", store_history=True)
    return result, out


def shown(out: Any) -> str:
    return out.stdout + out.stderr + "".join(o.data.get("text/plain", "") for o in out.outputs)


def step_names(path: Path, read_json: Any) -> list[str]:
    return [
        e["name"] for e in read_json(path)["traceEvents"]
        if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")
    ]


def assert_nothing_left_running() -> None:
    from torch.nn.modules.module import _global_forward_pre_hooks

    from tracemagic.capture import session

    assert not torch.autograd.profiler._is_profiler_enabled
    assert not torch._C._autograd._profiler_enabled()
    assert not _global_forward_pre_hooks
    assert session._ACTIVE is None


def assert_next_capture_works(ip: Any, read_json: Any) -> None:
    result, out = run(ip, "--et --no-memory-timeline", LOOP.format(n=5))
    assert result.success, shown(out)
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "complete"
    assert len(step_names(capture.dir / "kineto_trace_0.json", read_json)) == 3
    assert read_json(capture.dir / "torch_et_0.json")["nodes"]


def test_exception_mid_loop_writes_partial_and_reraises(ip, read_json):
    result, out = run(ip, "--et --wait 0 --warmup 1 --active 8", RAISE_AT_5)
    assert isinstance(result.error_in_exec, ValueError)
    assert str(result.error_in_exec) == "bad batch"
    assert_nothing_left_running()
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "partial"
    m = capture.manifest
    assert m["error"] == {"type": "ValueError", "message": "bad batch"}
    assert [(s["step"], s["complete"]) for s in m["steps"]] == [
        (1, True), (2, True), (3, True), (4, True), (5, False)
    ]
    assert m["steps"][-1]["end"] == "error"
    assert step_names(capture.dir / "kineto_trace_0.json", read_json) == [
        f"ProfilerStep#{n}" for n in range(1, 6)
    ]
    et = read_json(capture.dir / "torch_et_0.json")  # finalized: valid JSON
    assert et["nodes"]
    text = shown(out)
    assert "partial" in text and "ValueError" in text
    # the user's own traceback, with the cell's own line (the magic line is line 1)
    assert "line 6" in text and 'raise ValueError("bad batch")' in text
    assert_next_capture_works(ip, read_json)


def test_holding_ctrl_c_at_a_windows_end_adds_no_python_calls_of_signal_to_the_trace(ip, read_json):
    """The hold runs in the user's loop while torch still records every Python call: it
    sets the handler through C functions only (``signal.signal`` went through enum
    conversions in Python, a dozen events of our own in the user's trace)."""
    ip.user_ns["data"] = [torch.randn(4, 4) for _ in range(8)]
    result = ip.run_cell("%%chakra_trace -q --no-memory-timeline\nfor x in data:\n    y = x @ x\n")
    assert result.success
    events = read_json(Path(ip.user_ns["_chakra_capture"].dir) / "kineto_trace_0.json")["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "python_function"}
    assert any(name.endswith(": _hold_interrupts") for name in names)  # the hold ran while recording
    assert "<built-in function signal>" in names
    ours = sorted(n for n in names if n.startswith(("signal.py(", "enum.py(")) or n.endswith(("): main_thread", "): current_thread")))
    assert not [n for n in ours if "__hash__" not in n], ours  # (torch hashes its own enums)


def test_keyboard_interrupt_is_kept_and_reraised(ip, read_json):
    body = RAISE_AT_5.replace('raise ValueError("bad batch")', "raise KeyboardInterrupt")
    result, out = run(ip, "--no-memory-timeline", body)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert_nothing_left_running()
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "partial"
    assert [s["step"] for s in capture.manifest["steps"] if s["complete"]] == [2, 3, 4]
    assert_next_capture_works(ip, read_json)


def test_exception_during_warmup_records_nothing_and_says_so(ip, read_json):
    body = RAISE_AT_5.replace("i == 5", "i == 0")
    result, out = run(ip, "", body)
    assert isinstance(result.error_in_exec, ValueError)
    assert_nothing_left_running()
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "failed" and capture.manifest["steps"] == []
    assert [f["kind"] for f in capture.manifest["files"]] == ["manifest"]
    assert "ValueError" in shown(out)


def test_loop_shorter_than_schedule_says_so_with_numbers(ip):
    result, out = run(ip, "--skip-first 1 --wait 2 --warmup 1", LOOP.format(n=3))
    assert result.success  # the cell itself is fine
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "empty"
    note = capture.manifest["notes"][0]
    assert "ran 3 iteration(s)" in note and "before iteration 5" in note
    assert "skip_first 1 + wait 2 + warmup 1 = 4" in note
    assert note in shown(out)


def test_short_loop_is_reported_even_when_quiet(ip):
    result, out = run(ip, "-q", LOOP.format(n=2))
    assert result.success
    assert "no trace written" in out.stderr


def test_fewer_than_active_steps_are_kept_and_reported(ip, read_json):
    result, out = run(ip, "--active 5 --no-memory-timeline", LOOP.format(n=4))
    assert result.success
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "partial"
    steps = capture.manifest["steps"]
    assert [(s["step"], s["complete"], s["end"]) for s in steps] == [
        (2, True, "step"), (3, True, "step"), (4, False, "loop_exit")
    ]
    assert len(step_names(capture.dir / "kineto_trace_0.json", read_json)) == len(steps)
    text = shown(out)
    assert "only 2 of --active 5 steps" in text and "after 4 iteration(s)" in text


def _usage_error(result: Any) -> str:
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    return str(result.error_in_exec)


def test_user_profiler_running_is_refused_before_the_cell_runs(ip):
    with torch.profiler.profile():
        result, out = run(ip, "", LOOP.format(n=5))
    assert "torch profiler is already running" in _usage_error(result)
    assert "ran" not in ip.user_ns  # the cell did not run at all
    assert not list(Path("traces").glob("*"))


def test_nested_capture_is_refused(ip):
    body = "get_ipython().run_cell_magic('chakra_trace', '', 'inner = 1')\n"
    result, out = run(ip, "--no-memory-timeline", body)
    assert "already running (nested capture)" in _usage_error(result)
    assert "inner" not in ip.user_ns
    assert_nothing_left_running()


def test_unwritable_output_dir_is_refused(ip, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    result, out = run(ip, f"--out {blocker}/sub", LOOP.format(n=5))
    message = _usage_error(result)
    assert "cannot write the capture to --out" in message and str(blocker) in message
    assert "ran" not in ip.user_ns


def test_loop_line_without_loop_is_refused(ip):
    result, out = run(ip, "--loop 2", LOOP.format(n=5))
    message = _usage_error(result)
    assert "--loop 2: there is no for/while loop at line 2" in message
    assert "loops start at line 4" in message
    assert "ran" not in ip.user_ns


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("--active 0", "--active must be an integer >= 1, got 0"),
        ("--wait -1", "--wait must be an integer >= 0, got -1"),
        ("--bogus", "unrecognized arguments: --bogus"),
        ("--active three", "--active: invalid int value: 'three'"),
        ("--name ../x", "--name '../x' is not a plain file name"),
        ("--name 'oops", "cannot read the options \"--name 'oops\": a quote is not closed"),
        ('--vs "last --active 2', "a quote is not closed"),
    ],
)
def test_bad_options_raise_usage_error_naming_the_option(ip, line, needle):
    result, out = run(ip, line, LOOP.format(n=5))
    assert needle in _usage_error(result)
    assert "ran" not in ip.user_ns
    assert not Path("traces").exists()


@pytest.mark.parametrize(
    ("body", "line", "kind"),
    [
        ("x = 1\nfor i in range(3)\n    pass\n", 3, "SyntaxError: expected ':'"),
        ("\n\nfor i in range(3):\n    y = i @@ i\n", 5, "SyntaxError: invalid syntax"),
        ("for i in range(3):\n    y = i\n  z = 1\n", 4, "IndentationError: unindent"),  # IPython's tokenizer
        ("for i in range(3):\n    y = i\nbreak\n", 4, "SyntaxError: 'break' outside loop"),  # the compiler
    ],
)
def test_syntax_error_is_the_users_with_cell_lines(ip, body, line, kind):
    """Shown as IPython shows a cell's own: at its line in the cell (the magic line is line
    1), no tracemagic frame; nothing is captured and the cell fails (a UsageError)."""
    result, out = run(ip, "", body)
    assert "the cell is not valid Python (the error above); nothing was captured" in _usage_error(result)
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown(out))
    assert re.search(rf"Cell In\[\d+\], line {line}\n", text), text
    assert kind in text and body.splitlines()[line - 2].strip() in text
    assert "tracemagic/" not in text and "Traceback" not in text
    assert "_chakra_capture" not in ip.user_ns and not Path("traces").exists()
    assert_nothing_left_running()


def test_a_top_level_await_is_named_not_called_invalid_python(ip):
    """IPython runs a plain cell's top-level ``await`` (autoawait); the capture cannot, and the
    message says so, with the line, rather than that the cell is not valid Python."""
    result, out = run(ip, "", "import asyncio\nawait asyncio.sleep(0)\nx = 1\n")
    error = _usage_error(result)
    assert "top-level `await` cannot run inside the capture" in error and "not valid Python" not in error
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown(out))
    assert re.search(r"Cell In\[\d+\], line 3\n", text) and "await asyncio.sleep(0)" in text, text
    assert "_chakra_capture" not in ip.user_ns and not Path("traces").exists()


def test_syntax_error_in_a_kernel_is_shown_at_the_users_line(tmp_path):
    """In a real kernel (ipykernel compiles cells under its own file names): the cell's
    SyntaxError alone, at its line in the cell, no tracemagic frame, no capture folder."""
    cells = ["%load_ext tracemagic", "%%chakra_trace -q --cpu-only\nx = 1\nfor i in range(3):\n    y = x @@ x\n"]
    nb = run_in_kernel(cells, tmp_path, allow_errors=True)
    outputs = nb.cells[1].outputs
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join("\n".join(o.get("traceback", [])) + o.get("text", "") for o in outputs))
    assert [o.get("ename") for o in outputs if o.output_type == "error"] == ["SyntaxError"], text
    assert "Cell In[2], line 4\n    y = x @@ x\n" in text and "SyntaxError: invalid syntax" in text
    assert "nothing was captured" in text
    assert "tracemagic/" not in text and "Traceback" not in text and "compilerop" not in text
    assert not (tmp_path / "traces").exists()


def test_step_call_conflicts_with_loop_option(ip):
    body = "for i in range(5):\n    chakra.step()\n"
    result, out = run(ip, "--loop 2", body)
    assert "already calls chakra.step() itself" in _usage_error(result)


# -- atomic writes: nothing half-written under a final name ----------------------------
def test_export_failing_mid_write_leaves_no_trace_file_and_says_so(ip, read_json, monkeypatch):
    def half_then_fail(self: Any, path: str) -> None:
        Path(path).write_text('{"traceEvents": [')
        raise OSError("disk full")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", half_then_fail)
    result, out = run(ip, "--no-memory-timeline", LOOP.format(n=5))
    assert result.success, shown(out)
    capture = ip.user_ns["_chakra_capture"]
    assert sorted(p.name for p in capture.dir.iterdir()) == ["capture.json"]  # no hidden leftovers
    assert not capture.has_trace
    assert any("the Kineto trace was not written: disk full" in n for n in capture.manifest["notes"])
    assert "disk full" in shown(out)
    monkeypatch.undo()
    assert_next_capture_works(ip, read_json)


def test_atomic_writers_keep_the_old_file_or_none_when_the_write_fails(tmp_path):
    from tracemagic.capture import files

    target = tmp_path / "capture.json"
    files.write_json(target, {"v": 1})
    looped: dict[str, Any] = {"v": 2}
    looped["self"] = looped  # json.dump fails half-way through
    with pytest.raises(ValueError, match="Circular reference"):
        files.write_json(target, looped)
    assert json.loads(target.read_text()) == {"v": 1}
    with pytest.raises(RuntimeError, match="exporter failed"):
        files.write_with(tmp_path / "k.json.gz", _write_then_raise, gz=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capture.json"]


def test_a_write_beside_its_final_name_leaves_nothing_when_it_fails(tmp_path):
    # a session's exporters write under a hidden name next to the final one (no folder)
    from tracemagic.capture import files

    with pytest.raises(RuntimeError, match="exporter failed"):
        files.write_with(tmp_path / "k.json.gz", _write_then_raise, gz=True, beside=True)
    assert list(tmp_path.iterdir()) == []  # the half-written file went

    def kineto_fails_quietly(path: str) -> None:  # writes PATH.tmp first; a failed write leaves it
        Path(path + ".tmp").write_text("[")

    with pytest.raises(FileNotFoundError):
        files.write_with(tmp_path / "k.json", kineto_fails_quietly, beside=True)
    assert list(tmp_path.iterdir()) == []
    seen: list[tuple[Path, str]] = []

    def export(path: str) -> None:  # Kineto's ending, the path written as it is
        text = '{"traceEvents": [],\n  "traceName": "%s" }\n' % path
        seen.append((Path(path), text))
        Path(path).write_text(text)

    final = tmp_path / "k.json"
    files.write_with(final, export, beside=True)
    [(written, before)] = seen
    assert written.parent == tmp_path and written.name.startswith(".") and written != final
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.json"]
    text = final.read_text()
    assert json.loads(text)["traceName"] == str(final)  # as torch writes it when exporting to final
    assert len(text) == len(before) and text.startswith('{"traceEvents": [],')  # padded in place
    files.write_with(tmp_path / "m.json", lambda p: Path(p).write_text("[0]"), beside=True)
    assert (tmp_path / "m.json").read_text() == "[0]"  # no traceName: left as written


def test_writers_sharing_a_directory_do_not_remove_each_others_staging(tmp_path):
    # two ranks exporting into one capture directory at the same time (here: nested)
    from tracemagic.capture import files

    def outer(path: str) -> None:
        files.write_with(tmp_path / "kineto_trace_1.json", lambda p: Path(p).write_text("[1]"))
        Path(path).write_text("[0]")  # the staging folder must still be there

    files.write_with(tmp_path / "kineto_trace_0.json.gz", outer, gz=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kineto_trace_0.json.gz", "kineto_trace_1.json"]
    assert gzip.decompress((tmp_path / "kineto_trace_0.json.gz").read_bytes()) == b"[0]"


def _write_then_raise(path: str) -> None:
    Path(path).write_text("{half")
    raise RuntimeError("exporter failed")


def test_manifest_bookkeeping_failure_never_hides_the_users_exception(ip, read_json, monkeypatch):
    from tracemagic.capture import session

    def broken(*args: Any) -> Any:
        raise RuntimeError("naming failed")

    monkeypatch.setattr(session, "module_map", broken)
    result, out = run(ip, "--no-memory-timeline --wait 0", RAISE_AT_5)
    assert isinstance(result.error_in_exec, ValueError)  # the cell's own error, not ours
    assert_nothing_left_running()
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "partial"
    assert capture.manifest["error"] == {"type": "ValueError", "message": "bad batch"}
    assert any("capture.json is incomplete (RuntimeError: naming failed)" in n
               for n in capture.manifest["notes"])
    assert read_json(capture.dir / "capture.json")["status"] == "partial"
    monkeypatch.undo()
    assert_next_capture_works(ip, read_json)


TRACEBACK_CASES = {
    "in the loop body": "for i in range(4):\n    x = i\n    if i == 2:\n        y = 1 / 0\n    x = -i\n",
    "first statement": "for i in range(4):\n    y = 1 / 0\n",
    "after continue": "for i in range(4):\n    if i < 2:\n        continue\n    y = 1 / 0\n",
    "nested loops": "for e in range(2):\n    for i in range(4):\n        if i == 2:\n            y = 1 / 0\n",
    "while loop": "i = 0\nwhile i < 4:\n    i += 1\n    if i == 3:\n        y = 1 / 0\n",
    "after the loop": "for i in range(4):\n    x = i\ny = 1 / 0\n",
}


#: raising cases that only a real kernel needs (more frames, more handlers around the raise)
KERNEL_CASES = {
    **TRACEBACK_CASES,
    "inner loop of the stepped loop": (
        "for e in range(3):\n    for i in range(2):\n        x = i\n"
        "    for i in range(3):\n        if e == 1 and i == 1:\n            y = 1 / 0\n"
    ),
    "in a function called in the loop": (
        "def f(i):\n    if i == 2:\n        y = 1 / 0\n    return i\n"
        "for i in range(4):\n    x = f(i)\n"
    ),
    "in an elif after continue": (
        "for i in range(6):\n    if i % 2:\n        continue\n    elif i == 4:\n        y = 1 / 0\n"
    ),
}
TRACED = "%%chakra_trace --wait 0 --warmup 1 --active 1 -q --no-memory-timeline\n"


def arrows(traceback: str) -> list[tuple[int, str]]:
    """The ``---->`` lines of an IPython traceback (ANSI colours stripped): (line, text)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in traceback.splitlines()]
    marked = [line.split("---->", 1)[1].split(None, 1) for line in lines if "---->" in line]
    return [(int(number), text.strip()) for number, text in marked]


def raising_line(cell: str) -> int:
    """The line of ``y = 1 / 0`` in ``cell``, counted from 1."""
    return [line.strip() for line in cell.splitlines()].index("y = 1 / 0") + 1


@pytest.mark.parametrize("body", TRACEBACK_CASES.values(), ids=TRACEBACK_CASES.keys())
def test_the_traceback_arrow_points_at_the_failing_line(ip, body):
    """The arrow marks the line that raised, as without the magic (one line lower: the
    %%chakra_trace line is line 1 of the cell)."""

    def run_arrows(cell: str) -> list[tuple[int, str]]:
        with capture_output() as out:
            ip.run_cell(cell)
        return arrows(out.stdout)

    (plain,) = run_arrows(body)
    assert plain == (raising_line(body), "y = 1 / 0")
    traced = run_arrows(TRACED + body)
    assert traced[-1] == (plain[0] + 1, plain[1])


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``execute(code) -> (status, error)``: run a cell in a real ipykernel (as JupyterLab
    and nbclient run them; it names cells ``/tmp/ipykernel_<pid>/<hash>.py``), with
    tracemagic loaded, in a temporary folder. ``error`` is the error message's content;
    ``shown``, a list, gets the text of the cell's other outputs."""
    import os

    from jupyter_client.manager import start_new_kernel

    folder = tmp_path_factory.mktemp("kernel")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(folder), env=env)

    def execute(code: str, shown: list[str] | None = None) -> tuple[str, dict[str, Any] | None]:
        errors: list[dict[str, Any]] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "error":
                errors.append(msg["content"])
            elif shown is not None and msg["msg_type"] == "stream":
                shown.append(msg["content"]["text"])
            elif shown is not None and msg["msg_type"] in ("display_data", "execute_result"):
                shown.append(msg["content"]["data"].get("text/plain", ""))

        reply = client.execute_interactive(code, timeout=300, output_hook=hook)
        assert len(errors) <= 1, errors
        return reply["content"]["status"], (errors[0] if errors else None)

    try:
        assert execute("%load_ext tracemagic") == ("ok", None)
        yield execute
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("body", KERNEL_CASES.values(), ids=KERNEL_CASES.keys())
def test_the_traceback_arrow_in_a_jupyter_kernel(kernel, body):
    """In ipykernel too the user gets their own exception and traceback: the arrow of each
    frame in the cell on the line that raised there, with the cell's own text (the
    %%chakra_trace line is line 1), as the same cell shows it without the magic."""
    status, plain_error = kernel(body)
    assert status == "error" and plain_error is not None
    plain = arrows("\n".join(plain_error["traceback"]))
    assert plain[-1] == (raising_line(body), "y = 1 / 0")

    status, error = kernel(TRACED + body)
    assert status == "error" and error is not None
    assert (error["ename"], error["evalue"]) == ("ZeroDivisionError", "division by zero")
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["traceback"]))
    traced = arrows(text)
    assert traced[-len(plain):] == [(line + 1, code) for line, code in plain], text
    assert traced[-1] == (raising_line(TRACED + body), "y = 1 / 0")
    # the frames shown are the cell's: none from tracemagic (its magic frame is hidden)
    import tracemagic

    assert str(Path(tracemagic.__file__).parent) not in text, text


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("for i in range(4):\n    x = i\nundefined_after\n", "raised NameError after the loop"),
        ("undefined_before\nfor i in range(4):\n    x = i\n", "raised NameError before the loop"),
        ("for i in range(6):\n    if i == 3:\n        undefined_in\n", "raised NameError in step 3"),
    ],
    ids=["after", "before", "inside"],
)
def test_the_note_says_where_the_error_came_from(ip, body, said):
    result, out = run(ip, "--wait 0 --warmup 1 --active 4 --no-memory-timeline", body)
    assert isinstance(result.error_in_exec, NameError)
    notes = ip.user_ns["_chakra_capture"].manifest["notes"]
    assert any(said in note for note in notes), notes


SWITCH_OFF = {
    "disable_profiler": "torch.autograd._disable_profiler()",
    "second profiler": "with torch.profiler.profile():\n            torch.randn(4).sum()",
}


@pytest.mark.parametrize("switch", SWITCH_OFF.values(), ids=SWITCH_OFF.keys())
def test_a_profiler_switched_off_in_the_loop_is_a_failed_capture_not_a_crash(ip, read_json, switch):
    """Exporting what torch holds after its profiler was switched off under it segfaults
    the process: the capture says what happened instead, and writes no trace."""
    body = f"m = make_mlp()\nfor i in range(6):\n    m(torch.randn(4, 32)).sum().backward()\n    if i == 2:\n        {switch}\n"
    result, out = run(ip, "--wait 0 --warmup 1 --active 3 --no-memory-timeline --et", body)
    assert result.success, shown(out)
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "failed" and not capture.has_trace
    assert not (capture.dir / "torch_et_0.json").exists()
    assert any("the profiler was switched off inside the cell" in n for n in capture.manifest["notes"])
    assert "switched off" in shown(out)
    assert_nothing_left_running()
    assert_next_capture_works(ip, read_json)


def test_a_trace_that_cannot_be_written_is_not_a_complete_capture(ip, read_json, monkeypatch):
    """A full disk: the status follows what is on disk (failed, then partial when only one
    of two cycles could be written), with the reason."""
    from tracemagic.capture import files

    real = files.write_with
    calls = []

    def full_disk(path: Path, *args: Any, **kwargs: Any) -> Any:
        calls.append(path.name)
        if len(calls) in failing:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "write_with", full_disk)
    failing = {1, 2}
    result, out = run(ip, "--wait 0 --warmup 1 --active 2 --no-memory-timeline", LOOP.format(n=5))
    assert result.success, shown(out)
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "failed" and not capture.has_trace
    assert any("No space left on device" in n for n in capture.manifest["notes"])
    calls.clear()
    failing = {1}
    result, out = run(ip, "--wait 0 --warmup 1 --active 2 --repeat 2 --no-memory-timeline", LOOP.format(n=9))
    assert result.success, shown(out)
    capture = ip.user_ns["_chakra_capture"]
    assert capture.status == "partial"
    assert [e["path"] for e in capture.manifest["files"] if e["kind"] == "kineto"] == ["kineto_trace_0_cycle2.json"]
    assert "chakra_trace partial" in shown(out)


RAISE_MID_STEP = """\
import time
model = make_mlp()
for i in range(10):
    model(torch.randn(4, 32)).sum().backward()
    if i == 4:
        raise ValueError("bad batch")
    time.sleep(0.3)  # the steps' length: step 4 stays short of half of it on a busy machine too
"""


def test_the_step_the_error_cut_short_is_not_in_the_mean(ip, read_json):
    """The exception ends step 4 early (before its 300 ms sleep): like the loop's exit of a
    short loop it is recorded incomplete, shown, and left out of the mean step and the advice."""
    from tracemagic.views import Dashboard

    result, out = run(ip, "--wait 0 --warmup 1 --active 8 --no-memory-timeline", RAISE_MID_STEP)
    assert isinstance(result.error_in_exec, ValueError)
    capture = ip.user_ns["_chakra_capture"]
    assert [(s["step"], s["complete"], s["end"]) for s in capture.manifest["steps"]] == [
        (1, True, "step"), (2, True, "step"), (3, True, "step"), (4, False, "error")]
    durs = {int(e["name"].split("#")[1]): float(e["dur"]) for e in read_json(capture.dir / "kineto_trace_0.json")["traceEvents"]
            if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")}
    assert sorted(durs) == [1, 2, 3, 4] and durs[4] < 0.5 * min(durs[1], durs[2], durs[3])  # cut short
    whole = sum(durs[s] for s in (1, 2, 3)) / 3
    facts = dict(Dashboard(capture.trace).section("overview").facts)
    value, unit = facts["mean step"].split(" (")[0].split()
    assert abs(float(value.replace(",", "")) * {"µs": 1.0, "ms": 1e3, "s": 1e6}[unit] - whole) <= 0.005 * whole
    assert "step 4 was cut short by the error and is not counted" in facts["steps"]
    assert [v for _, v in Dashboard(capture.trace).controls["step"].options] == ["all", 1, 2, 3]
    assert f"mean step: {facts['mean step']}" in shown(out)  # the capture's display says the same


#: torch's export of a window's trace, ended by a Ctrl-C as it returns: what a kernel
#: interrupt (SIGINT to the kernel) does to a user who presses Stop while a big trace is written
INTERRUPTED_EXPORT = """\
import os, signal, time
import torch.profiler.profiler as _pp
_real_export = _pp._KinetoProfile.export_chrome_trace
def _export_then_interrupt(self, path):
    _real_export(self, path)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the interrupt lands here, inside the export, as after a long write
_pp._KinetoProfile.export_chrome_trace = _export_then_interrupt
"""


def _capture_on_disk(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The one capture directory under ``folder`` and its capture.json, read as JSON."""
    (capture,) = [p for p in folder.iterdir() if p.is_dir()]
    return capture, json.loads((capture / "capture.json").read_text())


@pytest.mark.slow
def test_in_a_kernel_an_interrupt_while_a_window_is_written_keeps_it(kernel, tmp_path):
    """Stop (a kernel interrupt) pressed while torch exports the recorded window: the window
    is written whole, trace and execution trace, then the KeyboardInterrupt reaches the user
    at the loop, with the cell's frames only. It used to cut the write short: the
    capture said "failed", its trace and ET deleted."""
    out = tmp_path / "interrupted"
    assert kernel("import torch") == ("ok", None)
    assert kernel(INTERRUPTED_EXPORT) == ("ok", None)
    try:
        status, error = kernel(
            f"%%chakra_trace --wait 1 --warmup 1 --active 2 --et -q --no-memory-timeline --out {out}\n"
            "ran = []\nfor i in range(8):\n    ran.append(i)\n    torch.randn(16, 16).mm(torch.randn(16, 16))\n"
        )
    finally:
        assert kernel("_pp._KinetoProfile.export_chrome_trace = _real_export") == ("ok", None)
    assert status == "error" and error is not None and error["ename"] == "KeyboardInterrupt"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["traceback"]))
    import tracemagic

    assert str(Path(tracemagic.__file__).parent) not in text, text
    assert arrows(text)[-1] == (3, "for i in range(8):"), text
    capture, manifest = _capture_on_disk(out)
    assert sorted(p.name for p in capture.iterdir()) == ["capture.json", "kineto_trace_0.json", "torch_et_0.json"]
    steps = [e["name"] for e in json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
             if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert json.loads((capture / "torch_et_0.json").read_text())["nodes"]
    assert manifest["status"] == "partial"
    assert [(s["step"], s["complete"]) for s in manifest["steps"]] == [(2, True), (3, True)]
    assert manifest["error"]["type"] == "KeyboardInterrupt"
    assert "the cell raised KeyboardInterrupt at the end of step 3, once the steps recorded were written" in (
        manifest["notes"][0]), manifest["notes"]  # the window's last step, not the step the loop went on to
    # the loop stopped at the step the window ended (no more iterations ran after the Ctrl-C)
    status, _ = kernel("assert ran == [0, 1, 2, 3], ran")
    assert status == "ok"
    status, _ = kernel("assert not torch.autograd.profiler._is_profiler_enabled\n"
                       "from tracemagic.capture.session import et_observer_free\nassert et_observer_free()")
    assert status == "ok"


#: cells that raise where the capture's note used to misplace the error, with what it says now
NOTE_CASES = {
    "the loop's header, in a recorded step": (
        "def batches():\n    for k in range(8):\n        if k == 3:\n            raise OSError('bad file')\n"
        "        yield k\nfor x in batches():\n    y = x * 2\n",
        "raised OSError in step 3; 1 complete step(s) recorded before it were written (partial capture).",
    ),
    "the loop's header, after the schedule": (
        "def batches():\n    for k in range(8):\n        if k == 6:\n            raise OSError('bad file')\n"
        "        yield k\nfor x in batches():\n    y = x * 2\n",
        "raised OSError in iteration 6 of the loop (counted from 0), after the recorded steps; "
        "2 complete step(s) recorded before it were written (partial capture).",
    ),
    "the body, after the schedule": (
        "for i in range(8):\n    if i == 6:\n        raise OSError('bad file')\n",
        "raised OSError in iteration 6 of the loop (counted from 0), after the recorded steps; "
        "2 complete step(s) recorded before it were written (partial capture).",
    ),
    "a wait step": (
        "for i in range(8):\n    if i == 0:\n        raise OSError('bad file')\n",
        "raised OSError in step 0; no complete step was recorded before it, so no trace was written "
        "(failed capture).",
    ),
}


@pytest.mark.slow
def test_in_a_kernel_the_note_says_where_the_cell_raised_and_what_is_on_disk(kernel, tmp_path):
    """A loop's header that raises (a DataLoader, a generator) was said to have raised
    "after the loop", an iteration past the schedule "in step 4" (a step never recorded),
    and a capture with no trace "(partial capture)"; the note now says where, and what the
    status says is on disk. A cell that raised in its only recorded step shows that step as
    cut short, where its Overview said there was no ProfilerStep in the trace."""
    head = "%%chakra_trace --wait 1 --warmup 1 --active 2 --no-memory-timeline --out {out}\n"
    assert kernel("import torch") == ("ok", None)
    for number, (body, said) in enumerate(NOTE_CASES.values()):
        out = tmp_path / str(number)
        status, error = kernel(head.format(out=out) + body)
        assert status == "error" and error is not None and error["ename"] == "OSError"
        capture, manifest = _capture_on_disk(out)
        assert manifest["notes"][0] == "the cell " + said, manifest["notes"]
        assert manifest["status"] == ("failed" if "no trace" in said else "partial")
        assert (capture / "kineto_trace_0.json").exists() == (manifest["status"] == "partial")
    shown: list[str] = []
    out = tmp_path / "first"
    status, error = kernel(
        head.format(out=out) + "for i in range(8):\n    torch.randn(8).sum()\n    if i == 2:\n        1 / 0\n",
        shown,
    )
    assert status == "error" and error is not None and error["ename"] == "ZeroDivisionError"
    capture, manifest = _capture_on_disk(out)
    steps = [e["name"] for e in json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
             if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    assert steps == ["ProfilerStep#2"] and manifest["status"] == "partial"
    text = "".join(shown)
    assert "steps: none complete (step 2 was cut short by the error)" in text, text
    assert "no ProfilerStep in the trace" not in text


def _gzip_name(path: Path) -> str:
    """The file name a gzip file's header holds (RFC 1952 FNAME), read from its bytes."""
    data = path.read_bytes()
    assert data[:2] == b"\x1f\x8b" and data[3] & 0x08, "a gzip header with FNAME"
    start = 10 + (2 + int.from_bytes(data[10:12], "little") if data[3] & 0x04 else 0)
    return data[start : data.index(b"\0", start)].decode("latin-1")


def test_gzip_files_name_their_own_file_not_the_hidden_partial(ip, tmp_path):
    """gunzip -N and 7-Zip extract a .gz to the name in its header: it was the hidden
    ``.kineto_trace_0.json.gz.partial`` the file was written under."""
    from tracemagic.export.chrome import to_chrome_trace
    from tracemagic.export.dftracer import to_pfw

    result, out = run(ip, "--gzip --wait 0 --warmup 1 --active 2 --no-memory-timeline", LOOP.format(n=4))
    assert result.success, shown(out)
    capture = ip.user_ns["_chakra_capture"]
    assert _gzip_name(capture.dir / "kineto_trace_0.json.gz") == "kineto_trace_0.json"
    (chrome,) = to_chrome_trace(capture.trace, tmp_path / "trimmed.json.gz")
    assert _gzip_name(chrome) == "trimmed.json"
    (pfw,) = to_pfw(capture.trace, tmp_path / "events.pfw.gz")
    assert _gzip_name(pfw) == pfw.name[: -len(".gz")]


def test_an_exception_whose_str_raises_is_still_the_users(ip, tmp_path):
    """An exception class whose ``__str__`` fails: its ``str()`` in the manifest raised
    inside ``finish()``, so capture.json stayed "running", nothing was kept or shown, and
    the user got tracemagic's AttributeError, chained through its internals, instead of
    their own. (ipykernel itself cannot show such an exception: it calls ``str()`` on it.)"""
    out = tmp_path / "weird"
    with capture_output() as shown_out:  # not stored in history: IPython's own store calls str() on it
        result = ip.run_cell(
            f"%%chakra_trace --wait 1 --warmup 1 --active 2 --no-memory-timeline --out {out}\n"
            "class Weird(Exception):\n    def __str__(self):\n        return self.missing\n"
            "for i in range(8):\n    if i == 3:\n        raise Weird()\n"
        )
    assert type(result.error_in_exec).__name__ == "Weird"
    assert "tracemagic/capture" not in shown_out.stdout, shown_out.stdout
    capture, manifest = _capture_on_disk(out)
    assert manifest["status"] == "partial"
    assert manifest["error"] == {"type": "Weird", "message": "<exception str() failed: AttributeError>"}
    steps = [e["name"] for e in json.loads((capture / "kineto_trace_0.json").read_text())["traceEvents"]
             if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert ip.user_ns["_chakra_capture"].dir == capture
    assert "chakra_trace partial" in shown(shown_out)


def test_a_held_interrupts_traceback_keeps_the_users_own_frames_below_the_cell():
    """A held Ctrl-C is raised inside tracemagic (at a step): its traceback is cut there,
    and no sooner, so a function of the user's (defined in another cell) that the cell
    called on the way to that step stays in it; the first cut dropped it with the capture's."""
    from types import SimpleNamespace

    from tracemagic.capture.session import CaptureSession
    from tracemagic.magics import _end_traceback_in

    scope: dict[str, Any] = {}
    exec(compile("def helper(step):\n    step()\n", "<ipython-input-1>", "exec"), scope)  # another cell
    exec(compile("def cell(helper, step):\n    helper(step)\n", "<ipython-input-2>", "exec"), scope)
    try:
        scope["cell"](scope["helper"], lambda: CaptureSession._raise_held(SimpleNamespace(_interrupted=True)))
    except KeyboardInterrupt as exc:
        error = exc
    _end_traceback_in(error, "<ipython-input-2>")
    names, tb = [], error.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert "<ipython-input-1>" in names and names.index("<ipython-input-1>") > names.index("<ipython-input-2>")
    import tracemagic

    package = Path(tracemagic.__file__).parent
    assert not any(package in Path(n).resolve().parents for n in names), names
