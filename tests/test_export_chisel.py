"""Chisel-compatible ``capture_model`` / ``parse_model_trace`` (``tracemagic.export.chisel``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TRACES

from tracemagic.errors import TraceError
from tracemagic.export import chisel

import torch  # noqa: E402
nn = torch.nn


def make_class(trace_dir: Path, **options):
    @chisel.capture_model(model_name="TinyNet", trace_dir=trace_dir, **options)
    class TinyNet(nn.Module):
        """A doc."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.encoder(x))

    return TinyNet


def test_decorator_writes_traces_and_prints_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    TinyNet = make_class(tmp_path)
    assert TinyNet.__name__ == "TinyNet" and TinyNet.__doc__ == "A doc."
    model = TinyNet()
    out = [model(torch.randn(8, 16)) for _ in range(3)]
    assert out[0].shape == (8, 4)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"TinyNet_forward_{n:03d}.{ext}" for n in (1, 2, 3) for ext in ("json", "modules.json")]
    modules = json.loads((tmp_path / "TinyNet_forward_001.modules.json").read_text())
    assert {v["path"] for v in modules.values()} == {"TinyNet", "encoder", "encoder.0", "encoder.1", "encoder.2", "head"}
    printed = capsys.readouterr().out
    assert printed.count("[capture_model] TinyNet forward pass #") == 3
    assert "Layer" in printed and "Total Time (ms)" in printed and "encoder.2" in printed and "TOTAL" in printed


def test_layer_stats_shape_and_no_double_counting(tmp_path: Path) -> None:
    model = make_class(tmp_path, verbose=False)()
    model(torch.randn(8, 16))
    trace_file = tmp_path / "TinyNet_forward_001.json"
    result = chisel.parse_model_trace(trace_file, "TinyNet")
    assert result["model_name"] == "TinyNet" and result["trace_file"] == str(trace_file)
    stats = result["layer_stats"]
    assert set(stats) >= {"TinyNet", "encoder", "encoder.0", "encoder.1", "encoder.2", "head"}
    for s in stats.values():
        assert isinstance(s["total_time_us"], int) and isinstance(s["call_count"], int)
        assert isinstance(s["shapes"], set) and isinstance(s["operations"], set)
    head = stats["head"]
    assert head["call_count"] == 1 and (8, 32) in head["shapes"] and (4, 32) in head["shapes"]
    assert {"aten::linear", "aten::addmm"} <= head["operations"]
    assert stats["encoder.1"]["operations"] >= {"aten::relu"}
    # self times add up to the forward time: nested layers and nested ops counted once
    total = sum(s["total_time_us"] for s in stats.values())
    inclusive = stats["TinyNet"]["inclusive_time_us"] + stats.get("(no layer)", {}).get("total_time_us", 0)
    assert abs(total - inclusive) <= max(len(stats) + 1, 0.02 * inclusive), stats
    # Chisel's sum over every cpu_op counts aten::addmm inside aten::linear twice: it
    # exceeds the sum over the outermost ops by the nested ops' time (timing-independent)
    events = json.loads(trace_file.read_text())["traceEvents"]
    ops = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op"]
    naive = sum(end - ts for _, ts, end in ops)

    def nested(op):
        tid, ts, end = op
        return any(o is not op and o[0] == tid and o[1] <= ts and end <= o[2] for o in ops)

    outermost = sum(end - ts for op in ops if not nested(op) for _, ts, end in [op])
    assert any(nested(op) for op in ops) and naive > outermost


def test_disable_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chisel.DISABLE_ENV, "1")

    class Plain(nn.Linear):
        pass

    assert chisel.capture_model(trace_dir=tmp_path)(Plain) is Plain
    monkeypatch.delenv(chisel.DISABLE_ENV)
    model = make_class(tmp_path, verbose=False)()
    monkeypatch.setenv(chisel.DISABLE_ENV, "true")  # switched off after decoration: no trace either
    model(torch.randn(2, 16))
    assert list(tmp_path.iterdir()) == []


def test_inside_another_profiler_only_warns(tmp_path: Path) -> None:
    model = make_class(tmp_path, verbose=False)()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.warns(UserWarning, match="already running"):
            model(torch.randn(2, 16))
    assert list(tmp_path.iterdir()) == []


def test_plain_trace_without_names_and_real_gpu_trace(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        model(torch.randn(3, 4))
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    stats = chisel.parse_model_trace(tmp_path / "t.json")["layer_stats"]
    assert {"Sequential_0", "Linear_0", "Linear_1", "ReLU_0"} <= set(stats)
    assert stats["Linear_1"]["shapes"] >= {(3, 8), (2, 8)}
    gpu = chisel.parse_model_trace(TRACES / "tracelens_normalization_layer_test.json.gz", "norm")["layer_stats"]
    assert any(s["gpu_time_us"] > 0 for s in gpu.values())


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        chisel.capture_model()(int)  # type: ignore[arg-type]
    with pytest.raises(TraceError):
        chisel.parse_model_trace(tmp_path / "missing.json")
    assert "No layer information" in chisel.format_layer_summary({"layer_stats": {}})
