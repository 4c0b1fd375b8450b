"""Capture under torch.distributed and the analysis of every rank.

Real jobs: ``torchrun`` (gloo, CPU, loopback) runs ``tests/data/ddp_train.py`` with
``tracemagic.capture`` (one rank slow; and one rank raising while another dies), and the
same script unedited under ``torchrun -m tracemagic run``. The three jobs start together in
one module fixture, so the file costs about one job's time. Real multi-rank GPU traces
(8-rank DLRM, NCCL) are checked against figures computed here from the raw JSON.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import TRACES, rank_file

import tb_reference
import tracemagic
from tracemagic.capture import distributed
from tracemagic.capture.config import config_from_options
from tracemagic.errors import CaptureError, TraceError
from tracemagic.script import ScriptCapture
from tracemagic.trace import loader

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "ddp_train.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
SLOW_RANK = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nproc: int, *args: str, out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        str(TORCHRUN), f"--nproc_per_node={nproc}", "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}", *args,
    ]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed by the fixture
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three torchrun jobs, run at once: ``slow``, ``broken`` and ``cli`` (exit code, dir)."""
    assert TORCHRUN.exists(), f"torchrun is not installed next to this Python ({TORCHRUN})"
    base = tmp_path_factory.mktemp("ddp")
    specs = {
        "slow": (2, [str(SCRIPT), "--slow-rank", str(SLOW_RANK), "--slow-ms", "50"]),
        "broken": (3, [str(SCRIPT), "--fail-rank", "1", "--crash-rank", "2", "--timeout", "20"]),
        "killed": (2, [str(SCRIPT), "--kill-rank", "1", "--timeout", "20"]),
        "cli": (2, ["-m", "tracemagic", "run", "--no-memory-timeline", "--et", "--name", "cli", "--out",
                    str(base / "cli"), "--", str(SCRIPT), "--plain", "--iterations", "7"]),
    }
    procs = {}
    for name, (nproc, args) in specs.items():
        out = base / name
        if name != "cli":
            args = [*args, "--out", str(out)]
        procs[name] = (_torchrun(nproc, *args, out=out), out)
    results = {}
    for name, (proc, out) in procs.items():
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        log = out.with_suffix(".log").read_text()
        dirs = sorted(out.glob("*-*")) if out.exists() else []
        results[name] = {"code": code, "log": log, "dir": dirs[0] if len(dirs) == 1 else None, "dirs": dirs}
    return results


def _job(jobs: dict[str, Any], name: str, ok: bool = True) -> dict[str, Any]:
    job = jobs[name]
    assert job["code"] is not None, f"{name}: torchrun timed out\n{job['log'][-3000:]}"
    assert (job["code"] == 0) == ok, f"{name}: exit {job['code']}\n{job['log'][-3000:]}"
    assert job["dir"] is not None, f"{name}: expected ONE capture directory, got {job['dirs']}"
    return job


def _manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "capture.json").read_text())


# -- a job with a slow rank ------------------------------------------------------------
def test_ranks_share_one_directory_and_rank0_lists_all(jobs: dict[str, Any]) -> None:
    directory = _job(jobs, "slow")["dir"]
    manifest = _manifest(directory)
    assert manifest["status"] == "complete"
    assert manifest["world_size"] == 2 and manifest["missing_ranks"] == [] and manifest["failed_ranks"] == []
    assert set(manifest["ranks"]) == {"0", "1"}
    kineto = sorted(e["path"] for e in manifest["files"] if e["kind"] == "kineto")
    assert kineto == ["kineto_trace_0.json", "kineto_trace_1.json"]
    assert all((directory / path).is_file() for path in kineto)
    for rank in (0, 1):
        info = json.loads((directory / f"kineto_trace_{rank}.json").read_text())["distributedInfo"]
        assert (info["backend"], info["rank"], info["world_size"]) == ("gloo", rank, 2)


def test_gloo_allreduce_found_on_both_ranks_with_equal_steps(jobs: dict[str, Any]) -> None:
    directory = _job(jobs, "slow")["dir"]
    for rank in (0, 1):  # what torch writes for a gloo all-reduce, in the raw files
        events = json.loads((directory / f"kineto_trace_{rank}.json").read_text())["traceEvents"]
        names = {(e.get("cat"), e.get("name")) for e in events}
        assert ("user_annotation", "gloo:all_reduce") in names  # on gloo's worker thread
        assert ("cpu_op", "c10d::allreduce_") in names  # the op on the main thread
    trace = tracemagic.load(directory, use_cache=False)
    assert trace.rank_ids == [0, 1]
    steps = trace.steps()
    counts = steps.groupby("rank")["step"].apply(list)
    assert counts[0] == counts[1] == [2, 3, 4]
    table = trace.collectives()
    reduce = table[table["collective"] == "all_reduce"]
    assert set(reduce["rank"]) == {0, 1}
    assert (reduce.groupby("step")["rank"].nunique() == 2).all()  # matched in every step
    assert set(reduce["source"]) == {"annotation"}


def test_slow_rank_is_the_straggler(jobs: dict[str, Any], tmp_path: Path) -> None:
    trace = tracemagic.load(_job(jobs, "slow")["dir"])
    table = trace.ranks_table().set_index("rank")
    assert bool(table.loc[SLOW_RANK, "slowest"])
    assert table.loc[SLOW_RANK, "straggler_steps"] == 3
    # the other rank waits ~50 ms per step in its all-reduce for the slow one
    assert table.loc[1 - SLOW_RANK, "wait_us"] > 30_000 > table.loc[SLOW_RANK, "wait_us"]
    assert set(trace.stragglers()["rank"]) == {SLOW_RANK}
    # the capture directory as a job of summarized ranks (manifest ranks, gloo annotations)
    job = tracemagic.load_ranks(_job(jobs, "slow")["dir"], cache_dir=tmp_path)
    assert job.rank_ids == [0, 1] and job.manifest == trace.manifest
    for name in ("ranks_table", "steps", "collectives", "stragglers"):
        pd.testing.assert_frame_equal(getattr(job, name)(), getattr(trace, name)(), check_exact=True, obj=name)


# -- a job where rank 1 raises and rank 2 dies ------------------------------------------
def test_failed_rank_keeps_its_trace_and_missing_rank_is_named(jobs: dict[str, Any]) -> None:
    job = _job(jobs, "broken", ok=False)
    directory = job["dir"]
    manifest = _manifest(directory)
    assert manifest["status"] == "partial"
    assert manifest["missing_ranks"] == [2], job["log"][-3000:]
    assert 1 in manifest["failed_ranks"]
    error = manifest["ranks"]["1"]["error"]
    assert error["type"] in ("RuntimeError", "SystemExit")  # SystemExit: torchrun's SIGTERM won
    assert (directory / "kineto_trace_0.json").is_file() and (directory / "kineto_trace_1.json").is_file()
    assert not (directory / "kineto_trace_2.json").exists()
    assert any("rank 2 did not finish" in note for note in manifest["notes"])
    trace = tracemagic.load(directory, use_cache=False)
    assert trace.rank_ids == [0, 1]


def test_rank_killed_after_writing_its_trace_is_listed_and_loaded(jobs: dict[str, Any]) -> None:
    job = _job(jobs, "killed", ok=False)
    directory = job["dir"]
    manifest = _manifest(directory)
    assert (directory / "kineto_trace_1.json").is_file(), job["log"][-3000:]
    assert not (directory / "ranks" / "1.json").exists() or _manifest_part(directory, 1)["status"] == "running"
    # rank 0 may fail too: its peer vanished inside the last step's all-reduce
    assert manifest["status"] == "partial" and manifest["missing_ranks"] == [1] and 1 in manifest["failed_ranks"]
    listed = {e["path"]: e for e in manifest["files"]}
    assert listed["kineto_trace_1.json"]["rank"] == 1 and listed["kineto_trace_1.json"]["kind"] == "kineto"
    assert manifest["ranks"]["1"]["status"] == "failed"
    assert any("rank 1: kept what it wrote" in note and "kineto_trace_1.json" in note for note in manifest["notes"])
    trace = tracemagic.load(directory, use_cache=False)
    assert trace.rank_ids == [0, 1]
    raw = json.loads((directory / "kineto_trace_1.json").read_text())
    steps = sorted(e["name"] for e in raw["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    ours = trace.steps()
    assert sorted(f"ProfilerStep#{s}" for s in ours.loc[ours["rank"] == 1, "step"]) == steps


def _manifest_part(directory: Path, rank: int) -> dict[str, Any]:
    return json.loads((directory / "ranks" / f"{rank}.json").read_text())


# -- the unedited script under torchrun -m tracemagic run ------------------------------
def test_run_recipe_captures_every_rank(jobs: dict[str, Any]) -> None:
    job = _job(jobs, "cli")
    manifest = _manifest(job["dir"])
    assert manifest["status"] == "complete", job["log"][-3000:]
    assert sorted(manifest["ranks"]) == ["0", "1"]
    assert manifest["modules"]["nn.Module: DistributedDataParallel_0"]["path"] == "model"
    trace = tracemagic.load(job["dir"])
    assert trace.steps().groupby("rank").size().tolist() == [3, 3]


def test_run_et_under_torchrun_times_every_op_of_every_rank(jobs: dict[str, Any]) -> None:
    """Each rank's ET, from the raw JSON: each optimizer step written inside its ProfilerStep,
    every operator's rf_id in that rank's Kineto trace, and every node under the root; the
    process-group node torch adds under torchrun is metadata, not a mismatch.

    One exception is torch's, not the capture's: the ET makes an asynchronous gloo collective
    running on gloo's thread the parent of the main thread's ops, and when that collective is
    still open as the window closes (a loaded machine) its node is never written. Those
    orphans are allowed only under such a collective, and check() must count exactly them.
    """
    from tracemagic.export import chakra

    directory = _job(jobs, "cli")["dir"]
    orphans_by_rank = {}
    for rank in (0, 1):
        nodes = {n["id"]: n for n in json.loads((directory / f"torch_et_{rank}.json").read_text())["nodes"]}
        events = json.loads((directory / f"kineto_trace_{rank}.json").read_text())["traceEvents"]
        by_rf = {e["args"]["Record function id"]: e for e in events if e.get("ph") == "X"
                 and e.get("cat") in ("cpu_op", "user_annotation") and "Record function id" in e.get("args", {})}
        rf = {i: next(a["value"] for a in n["attrs"] if a["name"] == "rf_id") for i, n in nodes.items()}
        chains, orphans = {}, {}
        for start in nodes:
            i, chain = start, [start]
            while i != 1 and i in nodes and nodes[i]["ctrl_deps"] not in chain:
                i = nodes[i]["ctrl_deps"]
                chain.append(i)
            chains[start] = chain
            if chain[-1] != 1:
                orphans[start] = chain[-1] if chain[-1] not in nodes else None
        assert None not in orphans.values(), "a parent cycle in the ET"
        main_tid = by_rf[rf[next(i for i, n in nodes.items() if n["name"].startswith("ProfilerStep#"))]]["tid"]
        for lost in set(orphans.values()):  # its rf_id: the last one before its first orphan's that the ET lacks
            first = min(rf[i] for i, m in orphans.items() if m == lost)
            missing = by_rf[max(r for r in by_rf if r < first and r not in set(rf.values()))]
            assert missing["name"].startswith("gloo:") and missing["tid"] != main_tid, missing
        orphans_by_rank[rank] = len(orphans)
        steps = [i for i, n in nodes.items() if n["name"] == "Optimizer.step#SGD.step"]
        assert len(steps) == 3  # each written, so closed, below a ProfilerStep
        assert all(any(nodes[a]["name"].startswith("ProfilerStep#") for a in chains[i]) for i in steps if i not in orphans)
        ops = [i for i, n in nodes.items() if not n["name"].startswith(("[pytorch|profiler", "ProfilerStep#"))]
        metadata = [i for i in ops if nodes[i]["name"] == "## process_group:init ##"]
        assert metadata and all(rf[i] not in by_rf for i in metadata)  # recorded before Kineto starts
        assert all(rf[i] in by_rf for i in ops if i not in metadata)
    report = chakra.check(directory)
    assert [p.rank for p in report.pairs] == [0, 1]
    assert [p.orphan_ops for p in report.pairs] == [orphans_by_rank[0], orphans_by_rank[1]]
    assert all(p.lost == (["gloo:all_reduce"] if p.orphan_ops else []) for p in report.pairs)
    assert report.ok == (not any(orphans_by_rank.values())), report.summary()
    assert all(p.timed_ops == p.et_ops - p.orphan_ops for p in report.pairs)


# -- in this process ---------------------------------------------------------------------
def test_capture_is_the_callable_package() -> None:
    cap = tracemagic.capture(active=2, no_stack=True)
    assert isinstance(cap, ScriptCapture) and cap.config.with_stack is False
    assert "capture" in tracemagic.__all__
    assert tracemagic.capture.CaptureSession.__name__ == "CaptureSession"
    with pytest.raises(CaptureError, match="unknown option 'loop_line'"):
        config_from_options(loop_line=3)
    with pytest.raises(CaptureError, match="--active"):
        tracemagic.capture(active=0)


@pytest.mark.parametrize(
    "imports",
    ["import tracemagic\ncapture = tracemagic.capture",
     "import tracemagic.capture\ncapture = tracemagic.capture",
     "from tracemagic import capture"],
)
def test_every_import_of_capture_is_the_callable_package(imports: str) -> None:
    """However it is first imported (a fresh interpreter each), ``capture`` is the package
    and ``capture(...)`` a ``ScriptCapture``; importing it loads neither torch nor pandas."""
    code = (
        f"{imports}\nimport sys\n"
        "heavy = sorted({'torch', 'pandas', 'tracemagic.facade', 'tracemagic.script'} & set(sys.modules))\n"
        "cap = capture(active=2)\n"
        "print(capture.__name__, type(cap).__module__, type(cap).__name__, heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tracemagic.capture", "tracemagic.script", "ScriptCapture", "[]"]


def test_block_error_propagates_after_files_are_written(tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(8, 4)
    cap = tracemagic.capture(wait=0, warmup=0, active=3, out=tmp_path, no_memory_timeline=True)
    with pytest.raises(ZeroDivisionError):
        with cap:
            for i in cap.steps(range(5)):
                model(torch.randn(2, 8)).sum().backward()
                if i == 2:
                    1 / 0
    assert not cap.running
    manifest = _manifest(cap.dir)
    assert manifest["status"] == "partial" and manifest["error"]["type"] == "ZeroDivisionError"
    assert [s["step"] for s in manifest["steps"]] == [0, 1, 2]
    assert (cap.dir / "kineto_trace_0.json").is_file()
    assert manifest["modules"]["nn.Module: Linear_0"]["path"] == "model"  # named from the caller


def test_decorator_runs_one_capture_per_call(tmp_path: Path) -> None:
    import torch

    cap = tracemagic.capture(out=tmp_path, whole=True, no_memory_timeline=True, no_stack=True)

    @cap
    def work(n: int) -> int:
        torch.ones(n).sum()
        return n

    assert work(3) == 3 and cap.result is not None and cap.result.status == "complete"
    first = cap.dir
    assert work(4) == 4 and cap.dir != first and len(list(tmp_path.iterdir())) == 2


def test_a_script_capture_hands_out_the_full_capture_and_trace(tmp_path: Path) -> None:
    """``cap.result`` is what the magic gives: ``trace.steps()``, ``trace.layers()`` and the
    dashboard work on it, and their figures are those of the raw Kineto JSON."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with tracemagic.capture(wait=0, warmup=1, active=3, out=tmp_path, no_memory_timeline=True) as cap:
        for _ in cap.steps(range(5)):
            model(torch.randn(4, 8)).sum().backward()
    result = cap.result
    assert result is not None and result.status == "complete"
    trace = result.trace
    assert isinstance(result, tracemagic.facade.Capture) and isinstance(trace, tracemagic.Trace)
    assert cap.result is result and result.trace is trace  # made once: the trace loads once

    events = json.loads((cap.dir / "kineto_trace_0.json").read_text())["traceEvents"]
    spans = {int(e["name"].split("#")[1]): float(e["dur"]) for e in events
             if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")}
    steps = trace.steps()
    assert sorted(steps["step"].astype(int)) == sorted(spans) == [1, 2, 3]
    for row in steps.itertuples(index=False):
        assert float(row.dur) == pytest.approx(spans[int(row.step)], abs=1.0)

    linear_calls = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"
                       and e["name"].startswith("nn.Module: Linear_"))
    layers = trace.layers().set_index("layer")  # named after the caller's variable `model`
    assert list(layers.loc[["0", "1", "2"], "parent"]) == ["model"] * 3
    assert int(layers.loc[["0", "2"], "calls"].sum()) == linear_calls == 6

    dashboard = result.dashboard
    assert type(dashboard).__name__ == "Dashboard" and dashboard is result.dashboard
    assert result.title in result._repr_mimebundle_()["text/plain"]


def test_merge_names_missing_and_failed_ranks() -> None:
    part = {"status": "complete", "rank": 0, "files": [{"path": "kineto_trace_0.json", "kind": "kineto", "rank": 0}],
            "steps": [{"step": 2}], "steps_recorded": 1, "notes": [], "error": None, "modules": {}}
    failed = {**part, "rank": 1, "status": "partial", "error": {"type": "RuntimeError", "message": "x"},
              "files": [{"path": "kineto_trace_1.json", "kind": "kineto", "rank": 1}]}
    running = {"status": "running", "rank": 3}
    merged = distributed.merge({0: part, 1: failed, 3: running}, world=4)
    assert merged["status"] == "partial"
    assert merged["missing_ranks"] == [2, 3] and merged["failed_ranks"] == [1]
    assert "rank" not in merged and merged["steps"] == [{"step": 2}]
    assert [e["path"] for e in merged["files"] if e["kind"] == "kineto"] == ["kineto_trace_0.json", "kineto_trace_1.json"]
    assert distributed.merge({0: part}, world=1)["status"] == "complete"


def test_run_steps_after_the_optimizer_returns_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    """`run` wraps the optimizer's step on the instance: each ProfilerStep ends after an
    Optimizer.step has ended; an LR scheduler made before it keeps working without warning;
    the script's optimizer gets its own step back afterwards."""
    import warnings

    from tracemagic.run import main

    script = tmp_path / "sched.py"
    script.write_text(
        "import builtins, torch\n"
        "model = torch.nn.Linear(8, 4)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)\n"
        "for _ in range(7):\n"
        "    opt.zero_grad()\n"
        "    model(torch.randn(2, 8)).sum().backward()\n"
        "    opt.step()\n"
        "    sched.step()\n"
        "builtins._tm_test = (opt, sched)\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*Profiler.*")
        assert main(["-q", "--no-memory-timeline", "--no-stack", "--out", str(tmp_path / "out"), "--", str(script)]) == 0
    import builtins

    opt, sched = builtins.__dict__.pop("_tm_test")
    assert sched.get_last_lr() == [pytest.approx(0.1 * 0.5**7)]  # stepped 7 times, after opt.step
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)  # the scheduler's wrapper is back
    assert not hasattr(opt.step, "_tracemagic_inner")
    (folder,) = (tmp_path / "out").iterdir()
    events = json.loads((folder / "kineto_trace_0.json").read_text())["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and (e["name"].startswith("ProfilerStep#") or e["name"].startswith("Optimizer.step#")))
    steps = [s for s in spans if s[2].startswith("ProfilerStep#")]
    optimizer = [s for s in spans if s[2].startswith("Optimizer.step#")]
    assert len(steps) == len(optimizer) == 3
    for (start, end, _), (o_start, o_end, _) in zip(steps, optimizer):
        assert start <= o_start and o_end <= end  # the optimizer step lies inside its ProfilerStep


def test_run_needs_a_script(capsys: pytest.CaptureFixture[str]) -> None:
    from tracemagic.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--active", "2"])
    assert exc.value.code == 2 and "name the script" in capsys.readouterr().err


# -- real multi-rank GPU traces against the raw JSON -------------------------------------
def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _oracle(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step: host duration, device window, and kernel time by category, from the events alone.

    The windows are the TensorBoard plugin's (``tb_reference``); kernels count by time
    inside them; compute is the union of non-NCCL kernels, comm what NCCL kernels add to
    it (compute wins where both run).
    """
    origin = min(float(e["ts"]) for e in events if "ts" in e)
    host = {n: end - start for n, start, end in tb_reference.host_steps(events, origin)}
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    out: dict[str, Any] = {
        "kernel_us": sum(e["dur"] for e in kernels),
        "nccl_us": sum(e["dur"] for e in kernels if "nccl" in e["name"].lower()),
        "steps": {},
    }
    for step, start, end in tb_reference.device_windows(events, origin):
        compute, comm = [], []
        for e in kernels:
            begin = float(e["ts"]) - origin
            span = (min(max(begin, start), end), min(max(begin + e["dur"], start), end))
            (comm if "nccl" in e["name"].lower() else compute).append(span)
        both = _union(compute + comm)
        out["steps"][step] = {
            "dur": host[step],
            "window_dur": end - start,
            "compute_us": _union(compute),
            "comm_us": both - _union(compute),
            "overlap_us": _union(compute) + _union(comm) - both,
            "comm_total_us": _union(comm),
        }
    return out


def _check(trace: Any, raw: dict[int, list[dict[str, Any]]]) -> None:
    kernels = trace.kernels()
    kernels = kernels[kernels["kind"] == "kernel"]
    steps = trace.steps().set_index(["rank", "step"])
    table = trace.ranks_table().set_index("rank")
    assert trace.rank_ids == sorted(raw)
    for rank, events in raw.items():
        want = _oracle(events)
        mine = kernels[kernels["rank"] == rank]
        assert mine["dur"].sum() == pytest.approx(want["kernel_us"], abs=1e-3)
        assert mine.loc[mine["is_comm"], "dur"].sum() == pytest.approx(want["nccl_us"], abs=1e-3)
        assert sorted(steps.loc[rank].index) == sorted(want["steps"])
        overlap = comm_total = 0.0
        for step, figures in want["steps"].items():
            row = steps.loc[(rank, step)]
            for column in ("dur", "window_dur", "compute_us", "comm_us"):
                assert row[column] == pytest.approx(figures[column], abs=0.05), (rank, step, column)
            overlap += figures["overlap_us"]
            comm_total += figures["comm_total_us"]
        durations = [f["window_dur"] for f in want["steps"].values()]
        assert table.loc[rank, "step_us"] == pytest.approx(sum(durations) / len(durations), abs=0.05)
        assert table.loc[rank, "overlap_pct"] == pytest.approx(100 * overlap / comm_total, abs=1e-3)


def test_dlrm_eight_ranks_match_the_raw_json() -> None:
    path = TRACES / "param_dlrm_kineto.tar.gz"
    assert path.exists(), f"{path} is missing from tests/data/traces"
    raw = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if member.isfile():
                data = json.load(tar.extractfile(member))
                raw[data["distributedInfo"]["rank"]] = data["traceEvents"]
    assert sorted(raw) == list(range(8))
    trace = tracemagic.load(path, use_cache=False)
    _check(trace, raw)
    table = trace.ranks_table()
    assert table["slowest"].sum() == 1


def test_nccl_trace_matches_the_raw_json() -> None:
    path = TRACES / "hta_nccl_data.json.gz"
    assert path.exists(), f"{path} is missing from tests/data/traces"
    with gzip.open(path) as fh:
        data = json.load(fh)
    trace = tracemagic.load(path, use_cache=False)
    _check(trace, {data["distributedInfo"]["rank"]: data["traceEvents"]})


#: the TensorBoard plugin's bytes per ``Input type`` (kineto tb_plugin
#: ``torch_tb_profiler/profiler/communication.py``, ``analyze_communication_nodes``)
PLUGIN_TYPE_BYTES = {"long int": 8, "float": 4, "int": 4, "c10::Half": 2, "c10::BFloat16": 2, "unsigned char": 1}


def test_message_sizes_from_the_plugins_comm_args() -> None:
    """Issue 24.9: the DLRM trace records no ``In msg nelems``, but its ``nccl:*`` annotations
    carry ``Input Dims`` and ``Input type``, from which the TensorBoard plugin computes the
    message (each input's elements × its type's bytes, summed). Each collective's ``bytes``
    is that of the ``nccl:*`` annotation around its kernel's launching runtime call."""
    raw = {}
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                data = json.load(tar.extractfile(member))
                raw[data["distributedInfo"]["rank"]] = data["traceEvents"]
    table = tracemagic.load(TRACES / "param_dlrm_kineto.tar.gz", use_cache=False).collectives()
    assert len(table) > 0 and table["source"].eq("kernel").all()
    for rank, events in raw.items():
        calls = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
        annotations = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("nccl:")]
        want = []
        for kernel in sorted((e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()), key=lambda e: e["ts"]):
            call = calls[kernel["args"]["correlation"]]
            (around,) = [a for a in annotations if a["tid"] == call["tid"] and a["ts"] <= call["ts"] <= a["ts"] + a["dur"]]
            args = around["args"]
            want.append(sum(math.prod(shape) * PLUGIN_TYPE_BYTES[t] for shape, t in zip(args["Input Dims"], args["Input type"])))
        mine = table[table["rank"] == rank].sort_values("ts")
        assert mine["bytes"].tolist() == want, rank
    assert table["bytes"].notna().all()


def test_gloo_collectives_on_a_gpu_rank_are_communication(tmp_path: Path) -> None:
    """Issue 24.9: a ``gloo:*`` collective on a rank with GPU work runs on the host and is
    communication, as the TensorBoard plugin counts ops of its ``GlooOpNameSet``
    (``event_parser.py``, ``_parse_step``: the Communication role); kernel time and GPU
    utilization stay the kernels'."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 10, "dur": 5, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 20, "dur": 100, "args": {"correlation": 1, "device": 0, "stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": 1, "tid": 1, "ts": 300, "dur": 250},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 600, "dur": 50},
    ]
    path = tmp_path / "gloo_on_gpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    gloo = ("gloo:broadcast", "gloo:reduce", "gloo:all_reduce", "gloo:all_gather", "gloo:reduce_scatter")  # GlooOpNameSet
    comm = sum(e["dur"] for e in events if e["name"] in gloo)
    row = tracemagic.load(path, use_cache=False).steps().iloc[0]
    assert row["comm_us"] == comm == 250
    assert (row["compute_us"], row["kernel_busy_us"], row["cpu_us"]) == (100.0, 100.0, 50.0)


# -- files that claim one rank --------------------------------------------------------------


@pytest.mark.parametrize("case", ["copies", "runs at other times", "a tar of two members of one name"])
def test_files_of_one_rank_that_are_not_one_runs_cycles_are_refused(case: str, tmp_path: Path) -> None:
    """Three traces that all claim rank 0 (three runs in one folder) were stacked as one rank
    without a word: every call counted three times, steps() keeping one of each number."""
    folder = tmp_path / "run"
    folder.mkdir()
    for i in range(3):  # a later run starts later, and counts its steps from 0 again
        rank_file(folder / f"kineto_trace_{i}.json", 0, [0, 1, 2], t0=1000.0 + (1e6 * i if case != "copies" else 0))
    path = folder
    if case.startswith("a tar"):
        path = tmp_path / "ranks.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(2):
                tar.add(folder / "kineto_trace_0.json", arcname="kineto_trace_0.json")
    with pytest.raises(TraceError) as error:
        tracemagic.load(path, use_cache=False)
    message = str(error.value)
    assert str(path) in message and "claim rank 0" in message and "tracemagic.load(" in message
    named = ["kineto_trace_0.json"] * 2 if case.startswith("a tar") else [f"kineto_trace_{i}.json" for i in range(3)]
    assert all(message.count(name) >= named.count(name) for name in named)
    one = tracemagic.load(folder / "kineto_trace_1.json", use_cache=False)  # what the error says to do
    assert one.rank_ids == [0] and one.ops()["name"].astype(str).tolist().count("aten::mm") == 3


def test_profiler_cycles_of_one_rank_still_load_as_that_rank(tmp_path: Path) -> None:
    """A ``--repeat`` capture (or torch's ``tensorboard_trace_handler``) writes a trace per
    cycle, all of one rank: one rank's timeline, cycles apart in time and step numbers."""
    folder = tmp_path / "cycles"
    folder.mkdir()
    rank_file(folder / "kineto_trace_0_cycle1.json", 0, [1, 2])
    rank_file(folder / "kineto_trace_0_cycle2.json", 0, [4, 5], t0=2000.0)
    rank_file(folder / "kineto_trace_1_cycle1.json", None, [1, 2])  # the rank from its name
    rank_file(folder / "kineto_trace_1_cycle2.json", None, [4, 5], t0=2000.0)
    trace = tracemagic.load(folder, use_cache=False)
    assert trace.rank_ids == [0, 1] and trace.warnings == []
    assert trace.steps().groupby("rank")["step"].apply(list).to_dict() == {0: [1, 2, 4, 5], 1: [1, 2, 4, 5]}


def test_tensorboard_handler_cycles_of_one_process_are_one_rank(tmp_path: Path) -> None:
    """``schedule(..., repeat=2)`` with torch's ``tensorboard_trace_handler`` writes a file
    per cycle, ``<host>_<pid>.<ts>.pt.trace.json``, with no rank in it (not distributed).
    Loading the folder made each cycle a rank of its own: ``trace.ranks()`` and the Ranks
    tab compared "rank 0" with "rank 1", the two halves of one process's run. They are one
    worker's spans, as in the TensorBoard plugin: one rank, its steps and ops those of both
    files; two runs of one process (step numbers again from 0) stay two ranks."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8)
    folder = tmp_path / "tb"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=2, repeat=2),
        on_trace_ready=tensorboard_trace_handler(str(folder)),
    ) as prof:
        for _ in range(8):
            model(x).sum().backward()
            prof.step()
    files = sorted(folder.glob("*.pt.trace.json"))
    assert len(files) == 2 and len({f.name.split(".")[0] for f in files}) == 1
    steps: dict[int, float] = {}
    linear = 0
    for f in files:
        for e in json.loads(f.read_text())["traceEvents"]:
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"):
                steps[int(e["name"].split("#")[1])] = e["dur"]
            linear += e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("name") == "aten::linear"
    assert sorted(steps) == [2, 3, 6, 7] and linear == 2 * 4
    checks = []
    real_check = loader._not_cycles
    with pytest.MonkeyPatch.context() as patch:  # found to be cycles once, not again as a shared rank
        patch.setattr(loader, "_not_cycles", lambda files: checks.append(len(files)) or real_check(files))
        trace = tracemagic.load(folder, use_cache=False)
    assert trace.rank_ids == [0] and trace.warnings == [] and checks == [2]
    table = trace.steps()
    assert dict(zip(table["step"].tolist(), table["dur"].tolist())) == pytest.approx(steps)
    assert (trace.ops()["name"] == "aten::linear").sum() == linear
    assert trace.ranks()["rank"].tolist() == [0]
    runs = tmp_path / "runs"  # one process profiled twice: steps 0, 1 in each
    runs.mkdir()
    rank_file(runs / "host_7.100.pt.trace.json", None, [0, 1])
    rank_file(runs / "host_7.200.pt.trace.json", None, [0, 1], t0=5000.0)
    assert tracemagic.load(runs, use_cache=False).rank_ids == [0, 1]


def test_a_rank_beyond_world_size_and_differing_world_sizes_are_warned(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    rank_file(folder / "a.json", 0, [1], world=2)
    rank_file(folder / "b.json", 5, [1], world=4)
    trace = tracemagic.load(folder, use_cache=False)
    assert trace.rank_ids == [0, 5]
    assert f"{folder / 'b.json'}: rank 5 is not below its world_size 4" in trace.warnings
    (differ,) = [w for w in trace.warnings if "world_size differs" in w]
    assert "2 in " in differ and "a.json" in differ and "4 in " in differ and "b.json" in differ


def test_a_ctrl_c_while_the_block_is_written_keeps_the_files_then_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (SIGINT) while torch exports the trace as the block ends: the files are
    written whole, then the KeyboardInterrupt stops the script (it used to cut the export
    short: no trace, capture.json left saying "running")."""
    import os
    import signal

    import torch
    import torch.profiler.profiler as torch_profiler

    real = torch_profiler._KinetoProfile.export_chrome_trace

    def export_then_interrupt(self: Any, path: str) -> Any:
        done = real(self, path)
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C: handled before the next line
        return done

    monkeypatch.setattr(torch_profiler._KinetoProfile, "export_chrome_trace", export_then_interrupt)
    cap = tracemagic.capture(out=tmp_path, whole=True, no_memory_timeline=True, no_stack=True)
    with pytest.raises(KeyboardInterrupt), cap:
        torch.randn(8, 8).mm(torch.randn(8, 8))
    assert not cap.running
    manifest = _manifest(cap.dir)
    assert manifest["status"] == "complete"
    events = json.loads((cap.dir / "kineto_trace_0.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert sorted(p.name for p in cap.dir.iterdir()) == ["capture.json", "kineto_trace_0.json"]


def test_a_second_ctrl_c_while_the_block_is_written_cuts_the_write_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold must not make Ctrl-C powerless: a second press while the files are written
    (a long export, a memory timeline of minutes) stops at once, as it did before the hold;
    the capture still ends (not "running") and the profiler is off."""
    import os
    import signal

    import torch
    import torch.profiler.profiler as torch_profiler

    real = torch_profiler._KinetoProfile.export_chrome_trace
    reached: list[str] = []

    def export_interrupted_twice(self: Any, path: str) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # the first: held
        os.kill(os.getpid(), signal.SIGINT)  # the second: raised here, before the export
        reached.append(path)
        return real(self, path)

    monkeypatch.setattr(torch_profiler._KinetoProfile, "export_chrome_trace", export_interrupted_twice)
    cap = tracemagic.capture(out=tmp_path, whole=True, no_memory_timeline=True, no_stack=True)
    with pytest.raises(KeyboardInterrupt), cap:
        torch.randn(8, 8).mm(torch.randn(8, 8))
    assert reached == [] and not cap.running
    manifest = _manifest(cap.dir)
    assert manifest["status"] != "running" and any("cut short" in note for note in manifest["notes"])
    assert all((cap.dir / entry["path"]).is_file() for entry in manifest["files"])  # what it lists is there
    assert not torch.autograd.profiler._is_profiler_enabled
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

