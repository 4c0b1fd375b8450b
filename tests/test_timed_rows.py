"""Which events ``ops()`` and ``kernels()`` list: duration (``X``) events of their kinds only.

Both select their rows by the ``ph`` column's category codes (``structure.timed_mask``), so
these traces put the phases in an order where ``X`` is not the first category, and one has
no ``X`` event at all. The expected rows come from the raw JSON events written here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tracemagic

#: the event kinds each table lists, by the raw events' ``cat``
OPS_CATS = ("cpu_op", "user_annotation")
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _events() -> list[dict[str, Any]]:
    """Instants before durations (so ``X`` is no first category), of every kind listed."""
    out: list[dict[str, Any]] = [
        {"ph": "i", "cat": "cpu_op", "name": "aten::instant", "pid": 1, "tid": 1, "ts": 1.0, "s": "t"},
        {"ph": "i", "cat": "kernel", "name": "instant_kernel", "pid": 0, "tid": 7, "ts": 1.5, "s": "t"},
    ]
    for i in range(6):
        ts = 10.0 + 20 * i
        out.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 3}", "pid": 1, "tid": 1, "ts": ts, "dur": 8.0})
        out.append({"ph": "i", "cat": "cpu_op", "name": "aten::mark", "pid": 1, "tid": 1, "ts": ts + 1, "s": "t"})
        out.append({"ph": "X", "cat": "user_annotation", "name": f"block{i}", "pid": 1, "tid": 2, "ts": ts, "dur": 3.0})
        out.append({"ph": "X", "cat": KERNEL_CATS[i % 3], "name": f"k{i}", "pid": 0, "tid": 7, "ts": ts + 2, "dur": 1.0})
        out.append({"ph": "i", "cat": "kernel", "name": "k_instant", "pid": 0, "tid": 7, "ts": ts + 3, "s": "t"})
    return out


def _load(tmp_path: Path, events: list[dict[str, Any]]) -> Any:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return tracemagic.load(path, use_cache=False, progress=False)


def test_only_duration_events_of_each_kind(tmp_path: Path) -> None:
    events = _events()
    trace = _load(tmp_path, events)
    want_ops = [(e["name"], e["ts"]) for e in events if e["ph"] == "X" and e["cat"] in OPS_CATS]
    want_kernels = [(e["name"], e["ts"]) for e in events if e["ph"] == "X" and e["cat"] in KERNEL_CATS]
    t0 = min(e["ts"] for e in events)
    ops = trace.ops()
    kernels = trace.kernels()
    assert list(zip(ops["name"].astype(str), ops["ts"] + t0)) == want_ops
    assert list(zip(kernels["name"].astype(str), kernels["ts"] + t0)) == want_kernels


def test_no_duration_event(tmp_path: Path) -> None:
    events = [e for e in _events() if e["ph"] != "X"]
    trace = _load(tmp_path, events)
    assert "X" not in set(trace.events["ph"].astype(str))
    assert len(trace.ops()) == 0
    assert len(trace.kernels()) == 0
