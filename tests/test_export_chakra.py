"""The Chakra pre-flight check and command lines (``tracemagic.export.chakra``)."""

from __future__ import annotations

import gzip
import json
import shlex
import shutil
from pathlib import Path

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
    from tracemagic.capture.api import capture as tm_capture
    from tracemagic.export import et

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
