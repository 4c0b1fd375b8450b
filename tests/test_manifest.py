"""The capture manifest (``capture.json``) is a checked type: what a real capture writes is
exactly ``Manifest``'s keys with its types and the one vocabulary of file kinds; a manifest
of the format this tracemagic writes (or older, or another tool's) reads; a newer format, a
manifest that is not an object or holds a key of the wrong type is a ``TraceError`` that says
what to do."""

from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

import tracemagic
from tracemagic.capture.result import CaptureResult
from tracemagic.errors import TraceError
from tracemagic.trace import layout
from tracemagic.trace.layout import FileEntry, Manifest

from conftest import TRACES

KINETO = "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"


def _folder(tmp_path: Path, manifest: Any) -> Path:
    """A capture folder: one real Kineto trace under a capture's name, and ``manifest``."""
    folder = tmp_path / "cap"
    folder.mkdir()
    shutil.copyfile(TRACES / KINETO, folder / "kineto_trace_0.json.gz")
    (folder / "capture.json").write_text(json.dumps(manifest))
    return folder


def _v1(**extra: Any) -> dict[str, Any]:
    """A manifest as tracemagic 0.1 wrote it (format 1), before the type was checked."""
    return {"format": "tracemagic.capture/1", "status": "complete", "rank": 0, "world_size": 1,
            "files": [{"path": "kineto_trace_0.json.gz", "kind": "kineto", "rank": 0, "cycle": None, "bytes": 1},
                      {"path": "torch_et_0.json", "kind": "execution_trace", "rank": 0, "cycle": None, "bytes": 1},
                      {"path": "capture.json", "kind": "manifest"}],
            "versions": {"tracemagic": "0.1.0"}, "notes": [], "error": None, **extra}


def test_a_real_capture_writes_exactly_the_manifest_type(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    with tracemagic.capture(wait=0, warmup=1, active=1, et=True, out=tmp_path) as cap:
        for _ in cap.steps(range(3)):
            model(torch.randn(2, 8)).sum().backward()
    raw = json.loads((cap.dir / "capture.json").read_text())
    hints = typing.get_type_hints(Manifest)
    assert set(raw) <= set(hints), set(raw) - set(hints)  # no key the type lacks
    assert {"format", "status", "files", "steps", "steps_recorded", "loop_timing", "memory_timeline"} <= set(raw)
    assert raw["format"] == "tracemagic.capture/1"
    kinds = set(typing.get_args(typing.get_type_hints(FileEntry)["kind"]))
    assert {e["kind"] for e in raw["files"]} <= kinds
    assert {e["kind"] for e in raw["files"]} >= {"kineto", "execution_trace", "memory_timeline", "manifest"}
    for key, value in raw.items():  # JSON types as the type says
        origin = typing.get_origin(hints[key]) or hints[key]
        if origin in (list, dict, str, int):
            assert isinstance(value, origin), key
    assert CaptureResult.from_dir(cap.dir).manifest == raw


def test_a_format_1_manifest_still_reads(tmp_path: Path) -> None:
    folder = _folder(tmp_path, _v1())
    cap = CaptureResult.from_dir(folder)
    assert cap.status == "complete" and cap.has_trace
    assert [p.name for p in cap.files] == ["kineto_trace_0.json.gz", "torch_et_0.json", "capture.json"]
    assert tracemagic.load(folder, use_cache=False).manifest["files"][1]["kind"] == layout.ET_KIND


def test_another_tools_manifest_still_reads(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"format": "their-tool/7", "files": {"kineto": ["kineto_trace_0.json.gz"]}})
    assert len(tracemagic.load(folder, use_cache=False).events)


@pytest.mark.parametrize("fmt", ["tracemagic.capture/2", "tracemagic.capture/10"])
def test_a_newer_format_asks_to_upgrade_tracemagic(tmp_path: Path, fmt: str) -> None:
    folder = _folder(tmp_path, _v1(format=fmt))
    for read in (tracemagic.load, CaptureResult.from_dir):
        with pytest.raises(TraceError, match=rf"newer tracemagic \(manifest format {fmt};.*Upgrade tracemagic"):
            read(folder)


@pytest.mark.parametrize(("manifest", "message"), [
    ([1, 2], "not a capture manifest"),
    ("complete", "not a capture manifest"),
    (_v1(status=3), r"'status' is a number, not a string"),
    (_v1(files="kineto_trace_0.json.gz"), r"'files' is a string, not an array or an object"),
    (_v1(files=[["kineto_trace_0.json.gz"]]), r"an entry of 'files' is not an object with a 'path'"),
    (_v1(rank="0"), r"'rank' is a string, not a number"),
    (_v1(error="boom"), r"'error' is a string, not an object or null"),
    (_v1(format=1), r"'format' is a number, not a string"),
    (_v1(format="tracemagic.capture/one"), r"unknown capture manifest format"),
])
def test_a_manifest_of_the_wrong_shape_is_a_trace_error(tmp_path: Path, manifest: Any, message: str) -> None:
    folder = _folder(tmp_path, manifest)
    for read in (tracemagic.load, CaptureResult.from_dir):
        with pytest.raises(TraceError, match=message) as info:
            read(folder)
        if "'" in message:  # a key of the wrong type: what to do
            assert "Load the trace files themselves, or move this capture.json away" in str(info.value)


def test_a_manifest_replacing_another_is_swapped_in_whole_and_leaves_nothing(tmp_path: Path) -> None:
    """The final manifest takes the running one's place (swapped where the system can, else
    renamed over it); a manifest with no earlier version is renamed into place; the lines of
    values written before are reused only while they are the very same objects."""
    layout.write_manifest(tmp_path, {"format": layout.MANIFEST_FORMAT, "status": "running"})
    memo: dict[str, tuple[Any, str]] = {}
    layout.write_manifest(tmp_path, {"status": "running", "cell": ["x = 1"]}, memo, replacing=True)
    layout.write_manifest(tmp_path, {"status": "complete", "cell": ["x = 2"], "steps": [{"step": 1}]}, memo, replacing=True)
    assert json.loads((tmp_path / "capture.json").read_text()) == {
        "status": "complete", "cell": ["x = 2"], "steps": [{"step": 1}]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capture.json"]  # the old one removed
    fresh = tmp_path / "new"
    fresh.mkdir()
    layout.write_manifest(fresh, {"status": "running"}, replacing=True)  # nothing to replace
    assert sorted(p.name for p in fresh.iterdir()) == ["capture.json"]
    missing = tmp_path / ".x.partial"
    missing.write_text("{}")
    assert not layout.replace_existing(missing, tmp_path / "absent.json") and missing.exists()


def test_cell_numbers_keeps_the_last_cells_whose_count_is_a_number() -> None:
    from tracemagic.capture.session import cell_numbers

    def expected(cells: dict[Any, Any], most: int) -> dict[str, int]:  # the rule, entry by entry
        last = list(cells.items())[len(cells) - most :] if len(cells) > most else list(cells.items())
        return {str(k): int(v) for k, v in last if isinstance(v, int)}

    ipython = {f"/tmp/ipykernel_1/{i:08x}.py": i for i in range(50)}  # IPython's map: str -> int
    ipython["/tmp/ipykernel_1/00000003.py"] = 77  # a cell run again: its count changes in place
    odd: dict[Any, Any] = {"a": 1, "b": True, "c": None, 4: 5, "d": "6", "e": 7}
    for cells in (ipython, odd, {}):
        for most in (1, 3, 40, 2000):
            got = cell_numbers(cells, most)
            assert got == expected(cells, most) and list(got) == list(expected(cells, most))
            assert got is not cells
