"""The command line, run as ``python -m tracemagic`` in a subprocess."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRACES

from tracemagic.cli import build_parser, main

GPU = TRACES / "hta_nccl_data.json.gz"
MULTI = TRACES / "param_dlrm_kineto.tar.gz"
OLD = TRACES / "kineto_worker0.1623143089861.pt.trace.json.gz"
ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path | None = None, **more_env: str) -> subprocess.CompletedProcess[str]:
    """``python -m tracemagic ARGS``; its trace cache is the session's (conftest) unless
    ``TRACEMAGIC_CACHE_DIR`` is given."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "COLUMNS": "100", **more_env}
    env.pop("TRACEMAGIC_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tracemagic", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=240)


def test_summary_prints_the_text_summary() -> None:
    proc = run("summary", str(GPU), "--width", "90")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "tracemagic · hta_nccl_data.json.gz"
    assert all(len(line) <= 90 for line in lines)
    for heading in ("Steps (share of each step", "Top ops (by self CPU time)", "Top kernels (by GPU time)"):
        assert heading in proc.stdout
    assert "Traceback" not in proc.stderr


def test_report_writes_one_self_contained_file(tmp_path: Path) -> None:
    out = tmp_path / "r" / "multi.html"
    proc = run("report", str(MULTI), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.is_file() and f"wrote {out}" in proc.stdout
    text = out.read_text()
    assert 'id="tab-ranks"' in text and 'id="tab-kernels"' in text
    assert "<script src" not in text


def test_report_default_name_in_the_working_directory(tmp_path: Path) -> None:
    proc = run("report", str(GPU), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hta_nccl_data.report.html").is_file()


def test_diff_compares_two_traces(tmp_path: Path) -> None:
    proc = run("diff", str(GPU), str(OLD), "--width", "100", "-o", str(tmp_path / "d.html"))
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("tracemagic diff · A = hta_nccl_data.json.gz · B = kineto_worker0")
    assert "mean step:" in proc.stdout
    assert 'id="tab-compare"' in (tmp_path / "d.html").read_text()


@pytest.mark.parametrize("command", ["summary", "report"])
def test_missing_file_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    proc = run(command, str(tmp_path / "nope.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"tracemagic: error: {tmp_path / 'nope.json'}: no such file or directory"]
    assert proc.stdout == ""


def test_damaged_trace_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2, ')[:-8])
    proc = run("summary", str(bad))
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("tracemagic: error: ") and "Traceback" not in proc.stderr


def test_not_a_trace_is_one_line_and_exit_2(tmp_path: Path) -> None:
    text = tmp_path / "notes.json"
    text.write_text('{"hello": "world"}')
    proc = run("summary", str(text))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("tracemagic: error: ")


def test_usage_errors_exit_2() -> None:
    proc = run("frobnicate")
    assert proc.returncode == 2 and "usage: tracemagic" in proc.stderr
    assert run().returncode == 2


def test_help_lists_every_command() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    for command in ("report", "summary", "diff", "demo"):
        assert command in proc.stdout


def test_main_in_process_returns_the_status(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["summary", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("tracemagic: error: ")
    args = build_parser().parse_args(["report", "x.json", "-o", "y.html", "--vs", "z.json"])
    assert (args.path, args.output, args.vs) == ("x.json", "y.html", "z.json")


def test_demo_calls_the_demo_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import types

    seen: list[tuple[Path, Path | None]] = []
    fake = types.ModuleType("tracemagic.demo")
    fake.run = lambda out_dir, notebook: seen.append((out_dir, notebook))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tracemagic.demo", fake)
    assert main(["demo", str(tmp_path / "out")]) == 0
    assert main(["demo", str(tmp_path / "out"), "--notebook", str(tmp_path / "nb.ipynb")]) == 0
    assert seen == [(tmp_path / "out", None), (tmp_path / "out", tmp_path / "nb.ipynb")]


def test_cache_info_lists_and_clear_empties_the_user_cache(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    assert run("summary", str(GPU), TRACEMAGIC_CACHE_DIR=str(folder)).returncode == 0
    assert run("summary", str(OLD), TRACEMAGIC_CACHE_DIR=str(folder)).returncode == 0
    stored = sum(p.stat().st_size for p in folder.iterdir())
    info = run("cache", "info", TRACEMAGIC_CACHE_DIR=str(folder), TRACEMAGIC_CACHE_SIZE="500M")
    assert info.returncode == 0, info.stderr
    lines = info.stdout.splitlines()
    assert lines[0] == f"cache folder: {folder}"
    assert lines[1].startswith(f"2 cached traces, {stored / 2**20:,.1f} MiB of 500.0 MiB")
    assert str(OLD) in lines[2] and str(GPU) in lines[3], "the most recently used first"
    cleared = run("cache", "clear", "--cache-dir", str(folder))
    assert cleared.returncode == 0 and cleared.stdout.startswith(f"removed 2 cached traces ({stored / 2**20:,.1f} MiB)")
    assert list(folder.iterdir()) == []
    assert run("cache", "info", TRACEMAGIC_CACHE_DIR=str(folder)).stdout.splitlines()[1].startswith("0 cached traces")
    bad = run("cache", "info", TRACEMAGIC_CACHE_SIZE="lots")
    assert bad.returncode == 2 and "TRACEMAGIC_CACHE_SIZE='lots' is not a size" in bad.stderr
