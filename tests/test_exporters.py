"""Every exporter has one shape (issue 28): ``to_<format>(trace, path, ...) -> list[Path]``, a
loaded trace in, the files it wrote out."""

from __future__ import annotations

import inspect
from pathlib import Path

from conftest import TRACES

import tracemagic
from tracemagic.export import chakra, chisel, chrome, dftracer, stacks


def exporters() -> list[object]:
    """Every public ``to_*`` function of ``tracemagic.export``'s modules."""
    found = []
    for module in (chakra, chisel, chrome, dftracer, stacks):
        for name in getattr(module, "__all__", []):
            if name.startswith("to_"):
                found.append(getattr(module, name))
    return found


def test_every_exporter_takes_a_trace_and_a_path_and_returns_the_files() -> None:
    found = exporters()
    assert {f.__name__ for f in found} >= {"to_chrome_trace", "to_pfw", "to_folded", "to_speedscope"}  # type: ignore[attr-defined]
    for function in found:
        signature = inspect.signature(function)  # type: ignore[arg-type]
        assert list(signature.parameters)[:2] == ["trace", "path"], function
        assert signature.return_annotation == "list[Path]", function


def test_each_returns_the_files_it_wrote(tmp_path: Path) -> None:
    trace = tracemagic.load(TRACES / "hta_benchmark_simple_add_trace.json.gz", cache_dir=tmp_path / "cache")
    outputs = {
        chrome.to_chrome_trace: "t.json",
        dftracer.to_pfw: "t.pfw",
        stacks.to_folded: "t.folded",
        stacks.to_speedscope: "t.speedscope.json",
    }
    for function, name in outputs.items():
        written = function(trace, tmp_path / name)
        assert isinstance(written, list) and written == [tmp_path / name], (function, written)
        assert written[0].is_file() and written[0].stat().st_size > 0
    # the facade's methods return what the exporters return
    assert trace.to_pfw(tmp_path / "f.pfw") == [tmp_path / "f.pfw"]
    assert trace.to_chrome_trace(tmp_path / "f.json") == [tmp_path / "f.json"]
