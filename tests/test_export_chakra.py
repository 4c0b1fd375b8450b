"""The Chakra pre-flight check and command lines (``tracemagic.export.chakra``)."""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TRACES

from tracemagic.errors import TraceError
from tracemagic.export import chakra

import torch  # noqa: E402
HTA_ET = TRACES / "hta_benchmark_simple_add_et.json.gz"
HTA_KINETO = TRACES / "hta_benchmark_simple_add_trace.json.gz"


def capture(folder: Path, rank: int = 0, steps: int = 3, et: bool = True) -> None:
    """One rank's pair: the ET observer and the profiler over the same steps."""
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, schedule

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    observer = ExecutionTraceObserver().register_callback(str(folder / f"torch_et_{rank}.json")) if et else None
    try:
        with profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=steps - 1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(folder / f"kineto_trace_{rank}.json")),
            execution_trace_observer=observer,
        ) as prof:
            for _ in range(steps):
                model(torch.randn(4, 8)).sum().backward()
                prof.step()
    finally:
        if observer is not None:
            observer.unregister_callback()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chakra")
    capture(folder, 0)
    capture(folder, 1)
    return folder


def test_schema_lists_match_chakra_sources() -> None:
    assert "1.1.1-chakra.0.0.4" in chakra.CONVERTER_SCHEMAS  # torch 2.13 writes this
    assert "1.0.1" in chakra.LINKER_SCHEMAS and "1.0.1" not in chakra.CONVERTER_SCHEMAS
    assert set(chakra.CONVERTER_SCHEMAS) <= set(chakra.LINKER_SCHEMAS)


def test_fresh_capture_passes_per_rank(two_ranks: Path) -> None:
    report = chakra.check(two_ranks)
    assert report.ok, report.summary()
    assert [p.rank for p in report.pairs] == [0, 1]
    for pair in report.pairs:
        assert pair.schema == "1.1.1-chakra.0.0.4" and pair.converter_accepts and pair.linker_accepts
        assert pair.uncompressed and pair.finalized
        assert pair.profiler_steps == [1, 2]
        assert pair.et_ops > 50 and pair.timed_ops == pair.matched_ops == pair.et_ops
    assert report.timed_share == 1.0
    assert "rank 1" in report.summary() and "100%" in report.summary()


def test_single_pair_forms(two_ranks: Path) -> None:
    et, kineto = two_ranks / "torch_et_1.json", two_ranks / "kineto_trace_1.json"
    for report in (chakra.check(et, kineto), chakra.check((kineto, et))):
        assert report.ok and [p.rank for p in report.pairs] == [1]


def test_real_hta_pair_is_reported_not_raised() -> None:
    report = chakra.check(HTA_ET, HTA_KINETO)
    assert not report.ok
    pair = report.pairs[0]
    assert pair.schema == "1.0.1" and pair.linker_accepts and not pair.converter_accepts
    assert not pair.uncompressed and pair.finalized
    assert pair.profiler_steps == [] and pair.et_ops == 36 and pair.timed_ops == 0
    text = " ".join(pair.problems)
    for words in ("gzip", "chakra_converter rejects", "ProfilerStep", "Record function id"):
        assert words in text


def test_unfinalized_and_mismatched(tmp_path: Path, two_ranks: Path) -> None:
    shutil.copy(two_ranks / "kineto_trace_0.json", tmp_path / "kineto_trace_0.json")
    full = (two_ranks / "torch_et_0.json").read_text()
    (tmp_path / "torch_et_0.json").write_text(full[: len(full) // 2])
    pair = chakra.check(tmp_path).pairs[0]
    assert not pair.finalized and "not finalized" in pair.problems[0]
    data = json.loads(full)
    del data["finish_ts"]
    (tmp_path / "torch_et_0.json").write_text(json.dumps(data))
    pair = chakra.check(tmp_path).pairs[0]
    assert not pair.finalized and any("finish_ts" in p for p in pair.problems)
    # the ET of rank 0 against the Kineto trace of another run: rf_ids do not line up
    other = tmp_path / "other"
    other.mkdir()
    capture(other, 0, steps=2)
    shutil.copy(two_ranks / "torch_et_0.json", other / "torch_et_0.json")
    pair = chakra.check(other).pairs[0]
    assert pair.timed_share < 1.0 and any("same steps" in p for p in pair.problems)


def test_kineto_without_et_and_gz(tmp_path: Path, two_ranks: Path) -> None:
    capture(tmp_path, 0, et=False)
    report = chakra.check(tmp_path)
    assert not report.ok and "no Execution Trace" in " ".join(report.problems)
    shutil.copy(two_ranks / "kineto_trace_0.json", tmp_path / "kineto_trace_0.json")
    (tmp_path / "torch_et_0.json.gz").write_bytes(gzip.compress((two_ranks / "torch_et_0.json").read_bytes()))
    pair = chakra.check(tmp_path).pairs[0]
    assert not pair.uncompressed and pair.timed_share == 1.0 and "gzip" in pair.problems[0]


def test_bad_input_raises(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such"):
        chakra.check(tmp_path / "nope")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(TraceError, match="single file"):
        chakra.check(tmp_path / "x.json")
    with pytest.raises(TraceError, match="pair"):
        chakra.commands(tmp_path)


def test_commands_use_chakras_current_flags(two_ranks: Path, tmp_path: Path) -> None:
    lines = chakra.commands(two_ranks, out_dir=tmp_path / "out dir")
    assert lines[0].startswith("mkdir -p ")
    links = [shlex.split(x) for x in lines if x.startswith("chakra_trace_link")]
    converts = [shlex.split(x) for x in lines if x.startswith("chakra_converter")]
    assert len(links) == len(converts) == 2
    for rank, argv in enumerate(links):
        opts = dict(zip(argv[1::2], argv[2::2]))
        assert opts == {
            "--rank": str(rank),
            "--chakra-host-trace": str(two_ranks / f"torch_et_{rank}.json"),
            "--chakra-device-trace": str(two_ranks / f"kineto_trace_{rank}.json"),
            "--output-file": str(tmp_path / "out dir" / f"chakra_host_device_{rank}.json"),
        }
    assert converts[1] == [
        "chakra_converter", "PyTorch",
        "--input", str(tmp_path / "out dir" / "chakra_host_device_1.json"),
        "--output", str(tmp_path / "out dir" / "chakra.1.et"),
    ]
    single = chakra.commands(two_ranks / "torch_et_1.json", kineto=two_ranks / "kineto_trace_1.json")
    assert "--rank 1" in single[1] and str(two_ranks / "chakra") in single[0]


def test_capture_made_by_tracemagic_passes(tmp_path: Path) -> None:
    """``tracemagic.capture(et=True)`` (what ``%%chakra_trace --et`` runs) gives Chakra a valid pair."""
    from tracemagic.script import capture as tm_capture
    from tracemagic import et

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with tm_capture(active=2, et=True, out=str(tmp_path)) as cap:
        for _ in cap.steps(range(5)):
            model(torch.randn(4, 8)).sum().backward()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    report = chakra.check(folder)
    assert report.ok and report.timed_share == 1.0, report.summary()
    assert len(report.pairs[0].profiler_steps) == 2
    nodes, edges = et.et_graph(folder, step=report.pairs[0].profiler_steps[0])
    assert "aten::linear" in set(nodes["name"]) and len(edges) > 0 and nodes["dur"].notna().all()


# -- `tracemagic run --et` on an AdamW script: what Chakra needs, checked from the raw JSON ---
ADAMW_SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range({n}):
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
"""
ROOT = Path(__file__).resolve().parents[1]


def run_script(tmp_path: Path, *options: str, iterations: int = 8) -> tuple[subprocess.CompletedProcess[str], list[Path]]:
    """``python -m tracemagic run OPTIONS -- adamw.py`` in ``tmp_path``; the capture dirs made."""
    script = tmp_path / "adamw.py"
    script.write_text(ADAMW_SCRIPT.format(n=iterations))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tracemagic", "run", "--no-memory-timeline", "--out", "traces", *options,
         "--", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    out = tmp_path / "traces"
    return proc, sorted(out.iterdir()) if out.exists() else []


def raw_pair(et_path: Path, kineto_path: Path) -> dict[str, Any]:
    """What Chakra makes of an ET + Kineto pair, from the raw JSON alone.

    ``ops``: operator nodes (no process/thread root, ProfilerStep or process-group metadata);
    ``rooted``: ids whose ``ctrl_deps`` chain reaches node 1 (the linker and converter keep
    only those); ``timed``: rooted ops whose ``rf_id`` is a Kineto cpu_op/user_annotation
    ``Record function id``; ``optimizer``: the ``Optimizer.step#`` nodes and every node below one.
    """
    nodes = {n["id"]: n for n in json.loads(et_path.read_text())["nodes"]}
    rf = {i: next((a["value"] for a in n["attrs"] if a["name"] == "rf_id"), None) for i, n in nodes.items()}

    def chain(i: int) -> list[int]:
        seen = [i]
        while i != 1 and i in nodes and nodes[i]["ctrl_deps"] not in seen:
            i = nodes[i]["ctrl_deps"]
            seen.append(i)
        return seen

    rooted = {i for i in nodes if chain(i)[-1] == 1}
    events = json.loads(kineto_path.read_text())["traceEvents"]
    kineto = {e["args"]["Record function id"] for e in events
              if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
              and "Record function id" in e.get("args", {})}
    ops = [i for i, n in nodes.items()
           if not n["name"].startswith(("[pytorch|profiler", "ProfilerStep#", "## process_group:init"))]
    optimizer = [i for i in nodes if any(nodes[a]["name"].startswith("Optimizer.step#") for a in chain(i) if a in nodes)]
    return {
        "nodes": nodes, "ops": ops, "rooted": rooted, "kineto": kineto, "rf": rf,
        "timed": [i for i in ops if i in rooted and rf[i] in kineto],
        "optimizer": optimizer,
    }


def test_run_et_times_every_optimizer_op(tmp_path: Path) -> None:
    proc, dirs = run_script(tmp_path, "--et")
    assert proc.returncode == 0 and len(dirs) == 1, proc.stderr[-3000:]
    folder = dirs[0]
    raw = raw_pair(folder / "torch_et_0.json", folder / "kineto_trace_0.json")
    nodes = raw["nodes"]
    assert set(nodes) == raw["rooted"]  # every node's parent chain reaches the root
    steps = [i for i in raw["optimizer"] if nodes[i]["name"] == "Optimizer.step#AdamW.step"]
    assert len(steps) == 3  # one per active step, each written (closed) and inside its ProfilerStep
    assert all(nodes[nodes[i]["ctrl_deps"]]["name"].startswith("ProfilerStep#") for i in steps)
    names = {nodes[i]["name"] for i in raw["optimizer"]}
    assert {"aten::lerp_", "aten::addcmul_"} <= names  # AdamW's own math
    assert all(raw["rf"][i] in raw["kineto"] for i in raw["optimizer"])
    assert len(raw["timed"]) == len(raw["ops"])
    report = chakra.check(folder)
    assert report.ok and report.timed_share == 1.0, report.summary()
    pair = report.pairs[0]
    assert (pair.et_ops, pair.timed_ops, pair.orphan_ops) == (len(raw["ops"]), len(raw["timed"]), 0)


def test_check_reports_ops_orphaned_by_a_step_inside_the_optimizer(tmp_path: Path) -> None:
    """prof.step() from the optimizer's post-hook (what `run` did): the last optimizer step's node
    is never written, so Chakra drops its ops; check() counts exactly those."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    observer = ExecutionTraceObserver().register_callback(str(tmp_path / "torch_et_0.json"))
    try:
        with profile(
            activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(tmp_path / "kineto_trace_0.json")),
            execution_trace_observer=observer,
        ) as prof:
            handle = register_optimizer_step_post_hook(lambda *_: prof.step())
            try:
                for _ in range(4):
                    opt.zero_grad()
                    model(torch.randn(8, 16)).sum().backward()
                    opt.step()
            finally:
                handle.remove()
    finally:
        observer.unregister_callback()
    raw = raw_pair(tmp_path / "torch_et_0.json", tmp_path / "kineto_trace_0.json")
    orphans = [i for i in raw["ops"] if i not in raw["rooted"]]
    assert orphans and "aten::lerp_" in {raw["nodes"][i]["name"] for i in orphans}
    assert all(raw["rf"][i] in raw["kineto"] for i in orphans)  # matched by rf_id all the same
    report = chakra.check(tmp_path)
    pair = report.pairs[0]
    assert not report.ok and pair.orphan_ops == len(orphans)
    assert pair.timed_ops == len(raw["timed"]) < pair.et_ops == len(raw["ops"])
    assert any("does not reach the root" in p for p in pair.problems)
    assert pair.lost == ["Optimizer.step#AdamW.step"]  # the missing node, named from Kineto


def test_run_et_repeat_writes_one_linkable_pair_per_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc, dirs = run_script(tmp_path, "--et", "--repeat", "2", "--wait", "0", "--active", "2")
    assert proc.returncode == 0 and len(dirs) == 1, proc.stderr[-3000:]
    folder = dirs[0]
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".json") and p.name != "capture.json")
    assert names == ["kineto_trace_0_cycle1.json", "kineto_trace_0_cycle2.json",
                     "torch_et_0_cycle1.json", "torch_et_0_cycle2.json"]
    report = chakra.check(folder)
    assert report.ok, report.summary()
    assert [(p.rank, p.cycle, p.et_path.name, p.kineto_path.name) for p in report.pairs] == [
        (0, k, f"torch_et_0_cycle{k}.json", f"kineto_trace_0_cycle{k}.json") for k in (1, 2)]
    for k, pair in zip((1, 2), report.pairs):
        raw = raw_pair(folder / f"torch_et_0_cycle{k}.json", folder / f"kineto_trace_0_cycle{k}.json")
        assert set(raw["nodes"]) == raw["rooted"] and len(raw["optimizer"]) > 0
        linked = len(raw["timed"]) / len(raw["ops"])
        assert linked == 1.0 >= pair.timed_share and pair.timed_ops == len(raw["timed"])
    # the other cycle's Kineto trace times (almost) nothing: pairing by cycle is what links
    cross = raw_pair(folder / "torch_et_0_cycle1.json", folder / "kineto_trace_0_cycle2.json")
    assert len(cross["timed"]) < 0.1 * len(cross["ops"])
    manifest = json.loads((folder / "capture.json").read_text())
    assert sorted((e["path"], e["cycle"]) for e in manifest["files"] if e["kind"] == "execution_trace") == [
        ("torch_et_0_cycle1.json", 1), ("torch_et_0_cycle2.json", 2)]

    # printed from the default relative --out, the lines work from anywhere: absolute paths
    monkeypatch.chdir(tmp_path)
    lines = chakra.commands(Path("traces") / folder.name)
    links = [shlex.split(x) for x in lines if x.startswith("chakra_trace_link")]
    converts = [shlex.split(x) for x in lines if x.startswith("chakra_converter")]
    assert len(links) == len(converts) == 2
    for k, argv in zip((1, 2), links):
        opts = dict(zip(argv[1::2], argv[2::2]))
        assert opts["--chakra-host-trace"] == str(folder.resolve() / f"torch_et_0_cycle{k}.json")
        assert opts["--chakra-device-trace"] == str(folder.resolve() / f"kineto_trace_0_cycle{k}.json")
        assert opts["--output-file"] == str(folder.resolve() / "chakra" / f"chakra_host_device_0_cycle{k}.json")
    outputs = [argv[-1] for argv in converts]
    assert outputs == [str(folder.resolve() / "chakra" / f"chakra_cycle{k}.0.et") for k in (1, 2)]
    for argv in [shlex.split(lines[0]), *links, *converts]:
        assert all(Path(a).is_absolute() for a in argv if "/" in a)


def test_et_refused_beside_the_users_observer(tmp_path: Path) -> None:
    """An ExecutionTraceObserver already registered: a clear CaptureError, no capture directory,
    and the user's observer still records and finalizes its own file."""
    import tracemagic
    from torch.profiler import ExecutionTraceObserver

    from tracemagic.errors import CaptureError

    mine = tmp_path / "user_et.json"
    observer = ExecutionTraceObserver().register_callback(str(mine))
    try:
        with pytest.raises(CaptureError, match="ExecutionTraceObserver is already registered"):
            with tracemagic.capture(et=True, out=tmp_path / "out", whole=True):
                torch.ones(4).sum()
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
        assert observer.is_registered
        observer.start()
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
        observer.stop()
    finally:
        observer.unregister_callback()
    data = json.loads(mine.read_text())
    assert "finish_ts" in data and "aten::mm" in {n["name"] for n in data["nodes"]}
    # the script form: `run --et` stops at the first optimizer step with the message, exit 2
    script_dir = tmp_path / "script"
    script_dir.mkdir()
    (script_dir / "prelude.py").write_text(
        "from torch.profiler import ExecutionTraceObserver\n"
        "obs = ExecutionTraceObserver().register_callback('own_et.json')\n"
    )
    script = script_dir / "adamw.py"
    script.write_text("exec(open('prelude.py').read())\n" + ADAMW_SCRIPT.format(n=3))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tracemagic", "run", "--et", "--out", "again", "--", str(script)],
        cwd=script_dir, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 2 and "ExecutionTraceObserver is already registered" in proc.stderr
    assert "Traceback" not in proc.stderr and not (script_dir / "again").exists()
