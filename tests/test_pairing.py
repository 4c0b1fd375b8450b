"""ET ↔ Kineto pairing by file name (``tracemagic.trace.pairing``) and its three callers."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tracemagic import et
from tracemagic.export import chakra
from tracemagic.trace import pairing
from tracemagic.trace.artifacts import Artifacts
from tracemagic.views.data import TraceData


def files(folder: Path, *names: str) -> Path:
    """Empty files ``names`` in ``folder`` (pairing looks at names only)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("{}")
    return folder


def has_et(path: Path) -> bool:
    """The views' rule (``TraceData.has_et``: the Graph tab shows)."""
    return TraceData(SimpleNamespace(artifacts=Artifacts(path))).has_et  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "is_et", "is_kineto", "rank"),
    [
        ("torch_et_3.json", True, False, 3),
        ("torch_et_3.json.gz", True, False, 3),
        ("run_torch_et_3.json", True, False, 3),
        ("x_et.json.gz", True, False, None),
        ("x.et.json", True, False, None),
        ("rank2_et.json", True, False, 2),
        ("et_rank1.json", True, False, 1),
        ("host_4.json", True, False, 4),
        ("host_4.json.gz", False, False, 4),
        ("kineto_trace_3.json", False, True, 3),
        ("kineto_trace_3_cycle2.json.gz", False, True, 3),
        ("x_trace.json.gz", False, True, None),
        ("y.trace.json", False, True, None),
        ("worker_5_trace.json", False, True, 5),
        ("device_4.json", False, True, 4),
        ("et_x_trace.json", True, False, None),  # an ET name wins over a Kineto one
        ("a.pfw_trace.json", False, False, None),
        ("memory_timeline_0.json", False, False, 0),
        ("trace.json", False, False, None),
    ],
)
def test_names(name: str, is_et: bool, is_kineto: bool, rank: int | None) -> None:
    assert pairing.is_et_name(name) is is_et
    assert pairing.is_kineto_name(name) is is_kineto
    assert pairing.rank_of(name) == rank


def test_capture_dir_pairs_by_rank(tmp_path: Path) -> None:
    d = files(tmp_path, "kineto_trace_0.json", "kineto_trace_1.json", "torch_et_0.json", "torch_et_1.json",
              "memory_timeline_0.json", "capture.json", "trace.pfw")
    found, problems = pairing.pairs(d)
    assert found == [(0, d / "torch_et_0.json", d / "kineto_trace_0.json"),
                     (1, d / "torch_et_1.json", d / "kineto_trace_1.json")]
    assert problems == []
    assert chakra.find_pairs(d) == (found, problems)
    for rank in (0, 1):
        kineto, et_file = d / f"kineto_trace_{rank}.json", d / f"torch_et_{rank}.json"
        assert pairing.et_for(kineto) == pairing.et_for(kineto, lone=False) == et.find_et(kineto) == et_file
        assert pairing.kineto_for(et_file) == kineto
        assert has_et(kineto)
    assert pairing.capture_ets(d) == pairing.ets_in(d) == [d / "torch_et_0.json", d / "torch_et_1.json"]
    assert has_et(d)


def test_gz_and_cycle_variants(tmp_path: Path) -> None:
    d = files(tmp_path, "kineto_trace_2_cycle1.json.gz", "torch_et_2.json.gz")
    kineto = d / "kineto_trace_2_cycle1.json.gz"
    assert pairing.et_for(kineto, lone=False) == d / "torch_et_2.json.gz"
    assert pairing.pairs(d) == ([(2, d / "torch_et_2.json.gz", kineto)], [])
    assert has_et(kineto) and has_et(d)
    # the plain ET wins over the gzip one
    files(d, "torch_et_2.json")
    assert pairing.et_for(kineto) == d / "torch_et_2.json"


@pytest.mark.parametrize(
    ("kineto", "et_name"),
    [
        ("x_trace.json", "x_et.json"),
        ("x_trace.json.gz", "x_et.json.gz"),
        ("x_kineto_trace.json", "x_et.json"),
        ("x-trace.json", "x_et.json"),
        ("x.trace.json", "x.et.json"),
    ],
)
def test_stem_pairs(tmp_path: Path, kineto: str, et_name: str) -> None:
    # other traces and ETs beside it: only the name decides
    d = files(tmp_path, kineto, et_name, "other_trace.json", "zzz_et.json")
    assert pairing.et_for(d / kineto, lone=False) == et.find_et(d / kineto) == d / et_name
    assert has_et(d / kineto)
    # back from the ET: only ``<stem>_trace.json[.gz]`` is looked for
    assert pairing.kineto_for(d / et_name) == (d / kineto if kineto.startswith("x_trace") else None)
    assert not has_et(d)  # not a capture directory (no torch_et_<rank>.json)


def test_chakra_host_and_device(tmp_path: Path) -> None:
    d = files(tmp_path, "host_0.json", "device_0.json", "host_1.json", "device_1.json")
    assert pairing.pairs(d) == ([(0, d / "host_0.json", d / "device_0.json"), (1, d / "host_1.json", d / "device_1.json")], [])
    # host/device is a pairs() rule only: et_for takes host_<r> just as a lone ET
    single = files(tmp_path / "single", "host_3.json", "device_3.json")
    assert pairing.et_for(single / "device_3.json") == single / "host_3.json"
    assert pairing.et_for(single / "device_3.json", lone=False) is None


def test_lone_et_is_taken_only_when_asked(tmp_path: Path) -> None:
    d = files(tmp_path, "gpu_trace.json", "cpu_trace.json", "hta_add_et.json.gz")
    assert pairing.et_for(d / "gpu_trace.json") == et.find_et(d / "gpu_trace.json") == d / "hta_add_et.json.gz"
    assert pairing.et_for(d / "gpu_trace.json", lone=False) is None
    assert not has_et(d / "gpu_trace.json")  # the views' stricter rule
    # one ET + one Kineto trace in a folder pair whatever their names
    one = files(tmp_path / "one", "run.trace.json", "profile_et.json")
    assert pairing.pairs(one) == ([(0, one / "profile_et.json", one / "run.trace.json")], [])


def test_two_ets_are_not_guessed(tmp_path: Path) -> None:
    d = files(tmp_path, "gpu_trace.json", "a_et.json", "b_et.json")
    assert pairing.et_for(d / "gpu_trace.json") is None
    assert et.find_et(d / "gpu_trace.json") is None
    assert not has_et(d / "gpu_trace.json")
    found, problems = pairing.pairs(d)  # no rank anywhere: the first ET takes the rankless trace
    assert found == [(0, d / "a_et.json", d / "gpu_trace.json")]
    assert problems == ["b_et.json: no Kineto trace of the same rank next to it (kineto_trace_None.json)."]


def test_ranks_mismatched(tmp_path: Path) -> None:
    d = files(tmp_path, "torch_et_0.json", "torch_et_1.json", "kineto_trace_1.json", "kineto_trace_2.json")
    found, problems = pairing.pairs(d)
    assert found == [(1, d / "torch_et_1.json", d / "kineto_trace_1.json")]
    assert problems == [
        "torch_et_0.json: no Kineto trace of the same rank next to it (kineto_trace_0.json).",
        "kineto_trace_2.json: no Execution Trace of rank 2 (torch_et_2.json); capture with --et.",
    ]
    assert pairing.et_for(d / "kineto_trace_2.json") is None  # two ETs, none named for rank 2
    assert not has_et(d / "kineto_trace_2.json") and has_et(d)
    # a single ET and a single Kineto trace pair even across ranks (the ET's rank is kept)
    lone = files(tmp_path / "lone", "torch_et_0.json", "kineto_trace_3.json")
    assert pairing.pairs(lone) == ([(0, lone / "torch_et_0.json", lone / "kineto_trace_3.json")], [])
    assert pairing.et_for(lone / "kineto_trace_3.json") == lone / "torch_et_0.json"
    assert pairing.et_for(lone / "kineto_trace_3.json", lone=False) is None


def test_several_kineto_traces_of_one_rank(tmp_path: Path) -> None:
    d = files(tmp_path, "torch_et_0.json", "torch_et_1.json", "kineto_trace_0.json", "kineto_trace_0_cycle1.json",
              "kineto_trace_1.json")
    found, problems = pairing.pairs(d)
    assert [(r, e.name, k.name) for r, e, k in found] == [
        (0, "torch_et_0.json", "kineto_trace_0.json"), (1, "torch_et_1.json", "kineto_trace_1.json")]
    assert len(problems) == 1 and "several Kineto traces of rank 0" in problems[0]
    assert pairing.et_for(d / "kineto_trace_0_cycle1.json") == d / "torch_et_0.json"


def test_no_et(tmp_path: Path) -> None:
    d = files(tmp_path, "kineto_trace_0.json")
    assert pairing.pairs(d) == ([], ["kineto_trace_0.json: no Execution Trace of rank 0 (torch_et_0.json); capture with --et."])
    assert pairing.et_for(d / "kineto_trace_0.json") is None
    assert pairing.kineto_for(d / "torch_et_0.json") == d / "kineto_trace_0.json"
    assert pairing.kineto_for(d / "torch_et_5.json") is None
    assert not has_et(d) and not has_et(d / "kineto_trace_0.json")
    assert not TraceData(SimpleNamespace(artifacts=Artifacts(None))).has_et  # type: ignore[arg-type]


def test_pairing_is_the_trace_layer() -> None:
    """pairing imports nothing of tracemagic but the file names' definitions and the Kineto
    vocabulary (views and export import it, not the reverse; tests/test_architecture.py
    checks every layer)."""
    import tracemagic.trace.pairing as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert sorted(m for m in imported if m.startswith("tracemagic")) == ["tracemagic.trace.kineto", "tracemagic.trace.layout"]
