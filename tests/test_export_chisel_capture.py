"""``@capture_model``'s per-forward capture on the capture session's pieces: the profiler is
stopped whatever the forward raises, and the trace reaches its final name only when whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tracemagic.export import chisel

nn = torch.nn


def make_model(trace_dir: Path) -> nn.Module:
    @chisel.capture_model(model_name="Flaky", trace_dir=trace_dir, verbose=False)
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
            y = self.body(x)
            if fail:
                raise RuntimeError("boom in forward")
            return y

    return Flaky()


def profiler_off() -> bool:
    return not torch.autograd.profiler._is_profiler_enabled and not torch._C._autograd._profiler_enabled()


def test_raising_forward_stops_the_profiler_and_writes_nothing(tmp_path: Path) -> None:
    model = make_model(tmp_path)
    with pytest.raises(RuntimeError, match="boom in forward"):
        model(torch.randn(2, 4), fail=True)
    assert profiler_off()
    # no trace, no sidecar, no hidden partial file or staging folder of the failed forward
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # the next forward profiles normally: a profiler left on would make it skip with a warning
    model(torch.randn(2, 4))
    assert profiler_off()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Flaky_forward_002.json", "Flaky_forward_002.modules.json"]
    names = {e.get("name") for e in json.loads((tmp_path / "Flaky_forward_002.json").read_text())["traceEvents"]}
    assert "aten::linear" in names


def test_trace_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "Flaky_forward_001.json"
    seen: list[tuple[Path, bool]] = []
    export = torch.profiler.profile.export_chrome_trace

    def spy(self: torch.profiler.profile, path: str) -> None:
        seen.append((Path(path), final.exists()))  # the final name must not exist mid-write
        export(self, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", spy)
    make_model(tmp_path)(torch.randn(2, 4))
    [(written, final_existed)] = seen
    assert not final_existed
    assert written != final and written.name == final.name and written.parent.parent == tmp_path
    assert written.parent.name.startswith(".")  # a hidden staging folder, removed afterwards
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Flaky_forward_001.json", "Flaky_forward_001.modules.json"]
    assert json.loads(final.read_text())["traceEvents"]


def test_torch_failing_to_stop_leaves_no_profiler_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_stop(self: torch.profiler.profile) -> None:
        raise RuntimeError("kineto could not stop")

    monkeypatch.setattr(torch.profiler.profile, "stop", broken_stop)
    with pytest.warns(UserWarning, match="failed to stop .*kineto could not stop.*no trace written"):
        out = make_model(tmp_path)(torch.randn(2, 4))
    assert out.shape == (2, 4)  # the forward's result is kept
    assert profiler_off()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_profiler_switched_off_inside_the_forward_writes_nothing(tmp_path: Path) -> None:
    @chisel.capture_model(model_name="Off", trace_dir=tmp_path, verbose=False)
    class Off(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.autograd._disable_profiler()  # torch's results are now invalid
            return x * 2

    with pytest.warns(UserWarning, match="switched off inside the forward"):
        out = Off()(torch.ones(2))
    assert out.tolist() == [2.0, 2.0]
    assert profiler_off()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
