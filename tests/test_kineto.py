"""The Kineto vocabulary lives in one module (``tracemagic.trace.kineto``): step names, GPU
kinds and ranks in file names are written nowhere else in the package, and they mean what
the profiler's files mean."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tracemagic.trace import kineto

PACKAGE = Path(__file__).resolve().parents[1] / "tracemagic"

#: the spellings of the vocabulary that must appear only in kineto.py
SPELLINGS = {
    "a step-name regex": re.compile(r"ProfilerStep#\("),
    "a GPU-kind tuple": re.compile(r"""\(\s*["']kernel["'],\s*["']memcpy["'],\s*["']memset["']"""),
    "a rank-in-name regex": re.compile(r"re\.compile\(.*(?:rank\|worker)"),
}


def test_the_vocabulary_is_written_only_in_kineto_py() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}: {what}"
        for path in PACKAGE.rglob("*.py") if path.name != "kineto.py"
        for what, pattern in SPELLINGS.items() if pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert not found
    kineto_py = (PACKAGE / "trace" / "kineto.py").read_text(encoding="utf-8")
    assert all(p.search(kineto_py) for p in SPELLINGS.values())  # the checks see what they look for


@pytest.mark.parametrize(("name", "rank"), [
    ("rank-3.pt.trace.json", 3), ("worker3.1623143089861.pt.trace.json.gz", 3), ("kineto_trace_12_cycle2.json.gz", 12),
    ("torch_et_5.json", 5), ("RANK_7_et.json", 7), ("et.4.json", 4), ("resnet_50_et.json", None),
    ("hta_control.json.gz", None), ("runs/rank2/trace.json", None),
])
def test_rank_from_a_file_name(name: str, rank: int | None) -> None:
    assert kineto.rank_from_name(name) == rank


def test_step_names() -> None:
    assert kineto.step_number("ProfilerStep#42") == 42
    assert kineto.STEP_NAME.match("ProfilerStep#" + "9" * 18)
    for name in ("ProfilerStep#abc", "ProfilerStep#" + "9" * 19, "aten::mm"):  # not int64, not a step
        assert not kineto.STEP_NAME.match(name)
        with pytest.raises(ValueError, match="not a ProfilerStep#N name"):
            kineto.step_number(name)


def test_gpu_kinds_are_kinds() -> None:
    assert set(kineto.GPU_ACTIVITY) < set(kineto.GPU_KINDS) <= set(kineto.KINDS)
    assert set(kineto.CPU_KINDS).isdisjoint(kineto.GPU_KINDS)
    assert kineto.GPU_CATEGORIES == {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset", "gpu_user_annotation"}
