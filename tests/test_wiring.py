"""The wiring between capture, loader, views and exports, driven through the magics in a
real IPython shell: the dashboard after ``%%chakra_trace``, ``%chakra_report``, and the
``--report``/``--pfw``/``--tb-names``/``--et`` outputs of a capture."""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import tracemagic
from tracemagic.capture import CaptureResult
from tracemagic.errors import TraceError
from tracemagic.magics import TracemagicMagics
from tracemagic.trace import cache, loader

import torch  # noqa: E402

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

TRAIN = """\
model = make_mlp()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range({n}):
    if i == {fail}:
        raise ValueError("bad batch")
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def train(n: int = 5, fail: int = -1) -> str:
    return TRAIN.format(n=n, fail=fail)


def run(ip: Any, source: str) -> tuple[Any, Any]:
    """Run a cell; return (ExecutionResult, captured output)."""
    with capture_output() as out:
        result = ip.run_cell(source, store_history=True)
    return result, out


def shown(out: Any) -> str:
    """What a terminal shows: stdout, stderr and the text of displayed objects."""
    return out.stdout + out.stderr + "".join(o.data.get("text/plain", "") for o in out.outputs)


def capture(ip: Any, line: str = "", body: str | None = None) -> tuple[CaptureResult, Any]:
    result, out = run(ip, f"%%chakra_trace {line}\n{body or train()}")
    assert result.success, shown(out)
    return ip.user_ns["_chakra_capture"], out


def kineto_entries(cap: CaptureResult) -> list[str]:
    return [e["path"] for e in cap.manifest["files"] if e["kind"] == "kineto"]


# -- 1. the dashboard after %%chakra_trace ------------------------------------------------
def test_capture_displays_dashboard_summary_under_status_and_files(ip):
    cap, out = capture(ip, "--no-memory-timeline")
    (display,) = out.outputs
    text = display.data["text/plain"]
    # the capture's own header: status, steps, directory, files ...
    assert text.startswith("chakra_trace complete: 3 steps recorded (ProfilerStep#2..#4)")
    assert f"dir: {cap.dir}" in text and "kineto_trace_0.json" in text and "capture.json" in text
    # ... then the dashboard's text summary of the loaded trace
    assert cap.dashboard.text() in text
    assert "Top ops" in text and "aten::addmm" in text
    assert WIDGET_MIME not in display.data  # a terminal shell: no widget built
    assert cap.dashboard.data.trace is cap.trace  # one load, shared


def test_in_a_kernel_the_capture_displays_the_dashboard_widget(ip, monkeypatch):
    monkeypatch.setattr(ip, "kernel", object(), raising=False)  # what ipykernel's shell has
    cap, out = capture(ip, "--no-memory-timeline")
    (display,) = out.outputs
    assert WIDGET_MIME in display.data
    assert display.data[WIDGET_MIME]["model_id"] == cap.dashboard.widget.model_id
    assert display.data["text/plain"].startswith("chakra_trace complete")


def test_the_widget_header_shows_the_folder_files_and_notes(ip, monkeypatch):
    """What the text fallback says about the capture is in the widget too, not hidden."""
    monkeypatch.setattr(ip, "kernel", object(), raising=False)
    result, out = run(ip, f"%%chakra_trace --no-memory-timeline\n{train(n=8, fail=5)}")
    assert isinstance(result.error_in_exec, ValueError)
    cap = ip.user_ns["_chakra_capture"]
    header = cap.dashboard.widget.children[0].value
    assert str(cap.dir) in header and "kineto_trace_0.json" in header and "capture.json" in header
    assert "chakra_trace partial:" in header and "the cell raised ValueError in iteration 5 of the loop" in header


def test_partial_capture_says_so_and_still_shows_its_dashboard(ip):
    result, out = run(ip, f"%%chakra_trace --no-memory-timeline\n{train(n=8, fail=5)}")
    assert isinstance(result.error_in_exec, ValueError)  # the user's own error, re-raised
    text = shown(out)
    assert "chakra_trace partial:" in text
    assert "the cell raised ValueError in iteration 5 of the loop" in text
    assert "Top ops" in text  # the steps kept are shown
    assert 'raise ValueError("bad batch")' in out.stdout  # with the user's traceback


def test_capture_without_trace_shows_its_notes_and_no_dashboard(ip):
    result, out = run(ip, f"%%chakra_trace --report r.html --pfw\n{train(n=8, fail=0)}")
    assert isinstance(result.error_in_exec, ValueError)
    cap = ip.user_ns["_chakra_capture"]
    assert cap.status == "failed" and not cap.has_trace
    text = shown(out)
    assert "chakra_trace failed: no steps recorded" in text
    assert "note: the cell raised ValueError before the loop" in text or "note: the cell raised ValueError" in text
    assert "Top ops" not in text and "dashboard unavailable" not in text
    assert "no trace was written, so --pfw and --report wrote nothing" in out.stderr
    assert not Path("r.html").exists()
    with pytest.raises(TraceError, match="wrote no trace"):
        cap.trace  # noqa: B018


def test_empty_capture_shows_the_schedule_note_not_a_dashboard(ip):
    cap, out = capture(ip, "", train(n=2))
    assert cap.status == "empty"
    (display,) = out.outputs
    assert "no trace written: the loop ran 2 iteration(s)" in display.data["text/plain"]
    assert "Top ops" not in display.data["text/plain"]


def test_trace_that_cannot_be_loaded_is_reported_in_the_display(ip, monkeypatch):
    def broken(path: Any, **_: Any) -> Any:
        raise TraceError(f"{path}: damaged at byte 12")

    monkeypatch.setattr(loader, "load", broken, raising=False)
    cap, out = capture(ip, "--no-memory-timeline")
    text = shown(out)
    assert "chakra_trace complete" in text and "kineto_trace_0.json" in text
    assert "dashboard unavailable (TraceError:" in text and "damaged at byte 12" in text


@pytest.mark.parametrize("failure", [TraceError("damaged"), RuntimeError("bug"), KeyboardInterrupt()])
def test_loading_failures_never_hide_the_users_exception(ip, monkeypatch, failure):
    def broken(path: Any, **_: Any) -> Any:
        raise failure

    monkeypatch.setattr(loader, "load", broken, raising=False)
    result, out = run(ip, f"%%chakra_trace --no-memory-timeline --report r.html\n{train(n=8, fail=5)}")
    assert isinstance(result.error_in_exec, ValueError), result.error_in_exec
    assert str(result.error_in_exec) == "bad batch"
    assert 'raise ValueError("bad batch")' in out.stdout
    assert "chakra_trace partial" in shown(out) or "could not show the capture" in out.stderr
    assert ip.user_ns["_chakra_capture"].status == "partial"


# -- 2. %chakra_report --------------------------------------------------------------------
def test_report_without_path_shows_the_last_capture(ip):
    cap, _ = capture(ip, "--no-memory-timeline")
    result, out = run(ip, "%chakra_report")
    assert result.success, shown(out)
    (display,) = out.outputs
    assert "Top ops" in display.data["text/plain"] and cap.dir.name in display.data["text/plain"]


def test_report_of_a_file_a_directory_and_a_tar(ip):
    cap, _ = capture(ip, "--no-memory-timeline")
    kineto = cap.dir / "kineto_trace_0.json"
    with tarfile.open("ranks.tar.gz", "w:gz") as tar:
        tar.add(kineto, arcname="run/kineto_trace_0.json")
    expected = len(cap.trace.events)
    for path in (kineto, cap.dir, Path("ranks.tar.gz")):
        result, out = run(ip, f"%chakra_report {path} -o")
        assert result.success, shown(out)
        dashboard = result.result
        assert type(dashboard).__name__ == "Dashboard"
        assert len(dashboard.data.trace.events) == expected
        assert not out.outputs and "Top ops" in out.stdout  # shown once, as the Out[] value


def test_report_vs_adds_compare_and_options_reach_the_dashboard(ip):
    a, _ = capture(ip, "--no-memory-timeline --name a")
    b, _ = capture(ip, "--no-memory-timeline --name b")
    result, out = run(ip, f"d = %chakra_report {a.dir} --vs {b.dir} --step 3 --top 4 --unit us --report cmp.html")
    assert result.success, shown(out)
    assert ip.user_ns["d"] is None  # without -o the dashboard is displayed, not returned
    (display,) = out.outputs
    assert display.data["text/plain"].startswith(f"tracemagic · {a.dir.name}")
    assert f"compared with {b.dir.name}" in display.data["text/plain"]
    assert f"wrote {Path('cmp.html').absolute()}" in out.stdout
    result, out = run(ip, f"%chakra_report {a.dir} --vs {b.dir} --step 3 --top 4 --unit us -o")
    d = result.result
    assert "compare" in d.keys
    assert (d.state.step, d.state.top, d.state.unit) == (3, 4, "µs")
    assert d.title == f"{a.dir.name} vs {b.dir.name}"
    assert not d.figures("compare") == []
    html = Path("cmp.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") or "<html" in html[:200]


def test_report_accepts_a_variable_holding_a_capture_or_trace(ip):
    capture(ip, "--no-memory-timeline -v cap")
    ip.user_ns["tr"] = ip.user_ns["cap"].trace
    for name in ("cap", "tr"):
        result, out = run(ip, f"%chakra_report {name} -o")
        assert result.success, shown(out)
        assert result.result.data.trace is ip.user_ns["cap"].trace


def test_report_paths_are_literal(ip):
    ip.user_ns["where"] = "somewhere"
    result, out = run(ip, "%chakra_report $where/{x}.json")
    assert isinstance(result.error_in_exec, UsageError)
    assert "$where/{x}.json: no such file or directory" in str(result.error_in_exec)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("missing.json", "missing.json: no such file or directory."),
        ("notes.txt", "not a JSON trace"),
        ("empty_dir", "holds no Kineto trace"),
        ("--top 0", "--top must be at least 1"),
        ("x --unit s", "argument --unit: invalid choice"),
        ("cap_int", "is a int; pass a path"),
        ("'notes.txt", "a quote is not closed"),
        ('notes.txt --vs "b', "a quote is not closed"),
    ],
)
def test_report_bad_input_is_a_usage_error_without_traceback(ip, line, message):
    Path("notes.txt").write_text("hello")
    Path("empty_dir").mkdir()
    ip.user_ns["cap_int"] = 3
    result, out = run(ip, f"%chakra_report {line}")
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert message in str(result.error_in_exec)
    assert "Traceback" not in out.stdout + out.stderr


def test_report_without_any_capture_says_what_to_do(ip):
    ip.user_ns.pop("_chakra_capture", None)
    result, _ = run(ip, "%chakra_report")
    assert isinstance(result.error_in_exec, UsageError)
    assert "no capture yet" in str(result.error_in_exec)


def test_report_of_a_failed_capture_and_a_missing_step(ip):
    run(ip, f"%%chakra_trace -q\n{train(n=8, fail=0)}")
    result, _ = run(ip, "%chakra_report")
    assert isinstance(result.error_in_exec, UsageError)
    assert "wrote no trace" in str(result.error_in_exec)
    capture(ip, "--no-memory-timeline -q")
    result, _ = run(ip, "%chakra_report --step 99")
    assert isinstance(result.error_in_exec, UsageError)
    assert "--step 99 is not in" in str(result.error_in_exec) and "2, 3, 4" in str(result.error_in_exec)


# -- 3. --report, --pfw, --tb-names -------------------------------------------------------
def test_report_option_writes_the_html_report_after_the_capture(ip):
    cap, out = capture(ip, "--no-memory-timeline --report reports/run.html")
    target = Path("reports/run.html").absolute()
    assert f"wrote {target}" in out.stdout
    html = target.read_text(encoding="utf-8")
    assert "<script" in html and not re.search(r"<script[^>]+src=", html)  # self-contained
    assert cap.manifest["report"] == str(target)
    assert json.loads((cap.dir / "capture.json").read_text())["report"] == str(target)
    assert f"report: {target}" in shown(out)


def test_report_option_to_an_unwritable_place_fails_before_the_cell(ip):
    Path("adir").mkdir()
    result, out = run(ip, "%%chakra_trace --report adir\nran = True\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "--report 'adir' is a directory" in str(result.error_in_exec)
    assert "ran" not in ip.user_ns  # the cell did not run


def test_pfw_option_writes_dftracer_events_listed_in_the_manifest(ip):
    cap, out = capture(ip, "--no-memory-timeline --pfw")
    pfw = cap.dir / "dftracer_0.pfw"
    assert f"wrote {pfw}" in out.stdout
    lines = pfw.read_text().splitlines()
    assert lines[0] == "["
    events = [json.loads(line) for line in lines[1:] if line.strip()]
    ops = [e for e in events if e.get("cat") == "PP" and e.get("ph") == "X"]
    assert ops and any(e["name"].startswith("aten::") for e in ops)
    assert min(e["ts"] for e in ops) > 1e15  # wall clock (µs since the epoch), not near zero
    entry = next(e for e in cap.manifest["files"] if e["kind"] == "pfw")
    assert entry == {"path": "dftracer_0.pfw", "kind": "pfw", "rank": 0, "bytes": pfw.stat().st_size}
    assert cap.manifest["files"][-1]["kind"] == "manifest"
    assert pfw in cap.files
    # the .pfw next to the trace does not confuse the loader
    assert len(tracemagic.load(cap.dir, use_cache=False).events) == len(cap.trace.events)


def test_pfw_option_with_gzip_writes_pfw_gz(ip):
    cap, _ = capture(ip, "--no-memory-timeline --pfw --gzip")
    assert (cap.dir / "dftracer_0.pfw.gz").is_file()
    assert "dftracer_0.pfw.gz" in [e["path"] for e in cap.manifest["files"]]


TB_NAME = re.compile(r"^[^.]+_\d+\.\d{19}\.pt\.trace\.json(\.gz)?$")


def test_tb_names_are_found_by_the_loader_through_the_manifest(ip):
    cap, out = capture(ip, "--no-memory-timeline --tb-names --repeat 2 --gzip", train(n=12))
    names = kineto_entries(cap)
    assert len(names) == 2 and all(TB_NAME.match(n) and n.endswith(".json.gz") for n in names), names
    assert sorted(names) == sorted(p.name for p in cap.dir.glob("*.pt.trace.json.gz"))
    assert [e["cycle"] for e in cap.manifest["files"] if e["kind"] == "kineto"] == [1, 2]
    assert "Top ops" in shown(out)  # the dashboard loaded both cycles
    assert set(cap.trace.events["step"].unique()) >= {2, 3, 4, 7, 8, 9}


def test_loader_reads_the_manifest_files_and_ignores_caches(ip):
    cap, _ = capture(ip, "--no-memory-timeline --tb-names")
    (name,) = kineto_entries(cap)
    assert TB_NAME.match(name) and not name.endswith(".gz")
    n = len(cap.trace.events)  # loaded once by the display: the capture keeps its cache inside
    cache.locations(cap.dir)  # the entry of a trace parsed in this process is written when asked for
    caches = sorted(p.name for p in (cap.dir / cache.CAPTURE_FOLDER).iterdir())
    assert "traces.seal" in caches, "a capture directory tracemagic wrote keeps its cache inside itself"
    assert not any(p.name in caches for p in cap.files)
    # a stray trace in the folder is not loaded: the manifest says which files are the capture's
    shutil.copy(cap.dir / name, cap.dir / "unrelated_trace.json")
    assert len(tracemagic.load(cap.dir).events) == n
    assert len(tracemagic.load(cap.dir, use_cache=False).events) == n
    # without a file list the folder is scanned: the caches are not taken for traces
    (cap.dir / "unrelated_trace.json").unlink()
    manifest = json.loads((cap.dir / "capture.json").read_text())
    manifest["files"] = []
    (cap.dir / "capture.json").write_text(json.dumps(manifest))
    shutil.copy(cap.dir / name, cap.dir / f".{name}")  # a hidden copy (an editor's) is no rank either
    assert len(tracemagic.load(cap.dir, use_cache=False).events) == n


# -- 4. Trace.report / Trace.to_pfw ------------------------------------------------------
def test_trace_report_and_to_pfw(ip):
    capture(ip, "--no-memory-timeline -q -v cap")
    run(ip, "other = cap.trace")
    result, out = run(ip, "cap.trace.report('t.html', other=other), cap.trace.to_pfw('t.pfw.gz')")
    assert result.success, shown(out)
    html_path, (pfw_path,) = result.result  # to_pfw returns the files written, as every exporter
    assert Path(html_path).is_file() and "Compare" in Path(html_path).read_text(encoding="utf-8")
    assert Path(pfw_path).name == "t.pfw.gz" and Path(pfw_path).stat().st_size > 0


# -- 5. the Chakra check after --et -------------------------------------------------------
def test_et_capture_records_a_passing_chakra_check(ip):
    cap, out = capture(ip, "--et --no-memory-timeline --tb-names")
    check = cap.manifest["chakra_check"]
    assert check["ok"] and check["timed_share"] == 1.0 and check["problems"] == []
    (pair,) = check["pairs"]
    assert pair["et"] == "torch_et_0.json" and TB_NAME.match(pair["kineto"])
    assert pair["et_ops"] == pair["timed_ops"] > 0
    assert pair["profiler_steps"] == [2, 3, 4]
    on_disk = json.loads((cap.dir / "capture.json").read_text())
    assert on_disk["chakra_check"] == check  # rewritten ...
    assert not list(cap.dir.glob(".*.partial"))  # ... atomically
    assert "Chakra" not in out.stderr


def test_et_capture_warns_in_one_line_when_ops_would_get_no_timing(ip, monkeypatch):
    import tracemagic.export.chakra as chakra

    real = chakra.check

    def lossy(directory: Any, *args: Any) -> Any:
        report = real(directory, *args)
        report.pairs[0].timed_ops -= 3
        return report

    monkeypatch.setattr(chakra, "check", lossy)
    cap, out = capture(ip, "--et --no-memory-timeline -q")
    warnings = [line for line in out.stderr.splitlines() if "Chakra" in line]
    assert len(warnings) == 1, out.stderr
    assert re.search(r"only 9\d\.\d% of the ET ops will get timing \(rank 0: 3 of \d+ untimed\)", warnings[0])
    assert cap.manifest["chakra_check"]["timed_share"] < 1
    assert json.loads((cap.dir / "capture.json").read_text())["chakra_check"]["timed_share"] < 1


# -- 6. help ------------------------------------------------------------------------------
def test_help_documents_the_new_options(ip):
    doc = TracemagicMagics.chakra_trace.__doc__
    for option in ("--report", "--pfw", "--tb-names", "chakra_check", "%chakra_report"):
        assert option in doc, option
    doc = TracemagicMagics.chakra_report.__doc__
    for option in ("PATH", "--vs", "--step", "--top", "--unit", "--report", "-o"):
        assert option in doc, option
    with capture_output() as out:
        ip.run_cell("%chakra_report?")
    assert "--vs" in out.stdout


def test_trace_to_chrome_trace_keeps_the_steps_asked_for(ip, kineto_events):
    capture(ip, "--no-memory-timeline -q -v cap")
    result, out = run(ip, "cap.trace.to_chrome_trace('step3.json', steps=[3])")
    assert result.success, shown(out)
    (written,) = result.result
    steps = [e["name"] for e in kineto_events(written) if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert steps == ["ProfilerStep#3"]


def test_tb_names_rank_comes_from_the_manifest_not_the_host_name(ip, monkeypatch):
    # a host name with digits (gpu-worker-12) must not be read as rank 12
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-worker-12")
    cap, _ = capture(ip, "--no-memory-timeline --tb-names")
    (name,) = kineto_entries(cap)
    assert name.startswith("gpu-worker-12_")
    assert tracemagic.load(cap.dir, use_cache=False).rank_ids == [0]


def test_load_reads_pfw_written_by_the_pfw_option(ip):
    cap, _ = capture(ip, "--no-memory-timeline --pfw --gzip")
    back = tracemagic.load(cap.dir / "dftracer_0.pfw.gz", use_cache=False)
    assert "``.pfw``/``.pfw.gz``" in tracemagic.load.__doc__  # and load's help says it reads them
    def framework_events(events):  # ops, steps, and the nn.Module frames (.pfw keeps no other Python frames)
        names = events["name"].astype(str)
        keep = events["kind"].isin(("cpu_op", "user_annotation", "step")) | names.str.startswith("nn.Module: ")
        return sorted(names[keep])

    assert framework_events(back.events) == framework_events(cap.trace.events)
    assert back.steps()["step"].tolist() == cap.trace.steps()["step"].tolist()
