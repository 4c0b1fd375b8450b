"""Events are matched to ops of their own thread only: a rank too big for 21 bits, ranks
stacked from files that number their pids in another order, and a Python event with no name.

Each expectation is computed here from the raw JSON: the op around a ``[memory]`` event is
the innermost ``cpu_op`` of the same (rank, pid, tid) whose span holds its time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

import tracemagic


def _op(name: str, pid: str, ts: int, dur: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": pid, "tid": 1, "ts": ts, "dur": dur, "args": {}}


def _memory(pid: str, ts: int, addr: int) -> dict[str, Any]:
    args = {"Bytes": 10, "Total Allocated": 10, "Total Reserved": 10, "Device Type": 0, "Device Id": -1, "Addr": addr}
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": pid, "tid": 1, "ts": ts, "s": "t",
            "args": args}


def _write(path: Path, events: list[dict[str, Any]], rank: int, world: int) -> Path:
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank, "world_size": world}}))
    return path


def _expected_ops(files: dict[int, list[dict[str, Any]]]) -> list[tuple[int, int, str | None]]:
    """(rank, ts, the innermost op of its thread around it or None) per memory event."""
    out = []
    for rank, events in files.items():
        for m in (e for e in events if e["name"] == "[memory]"):
            around = [e for e in events if e["ph"] == "X" and e["cat"] == "cpu_op"
                      and (e["pid"], e["tid"]) == (m["pid"], m["tid"]) and e["ts"] <= m["ts"] <= e["ts"] + e["dur"]]
            inner = min(around, key=lambda e: e["dur"])["name"] if around else None
            out.append((rank, m["ts"], inner))
    return sorted(out)


def _found_ops(table: pd.DataFrame) -> list[tuple[int, str | None]]:
    """(rank, op) per row of ``memory()``, in (rank, time) order (its ts are from the trace's start)."""
    rows = table.sort_values(["rank", "ts"])
    return [(int(r), None if pd.isna(op) else str(op)) for r, op in zip(rows["rank"], rows["op"], strict=True)]


def test_a_rank_of_2_21_or_more_keeps_its_memory_events_on_their_op(tmp_path: Path) -> None:
    rank = 3_000_000  # e.g. a date in a file name: rank_20240101
    events = [_op("aten::mm", "100", 1000, 100), _memory("100", 1050, 1)]
    trace = tracemagic.load(_write(tmp_path / "big.pt.trace.json", events, rank, rank + 1), use_cache=False)
    expected = _expected_ops({rank: events})
    assert [(r, op) for r, _, op in expected] == [(rank, "aten::mm")]
    assert _found_ops(trace.memory()) == [(r, op) for r, _, op in expected]
    assert trace.memory()["op_row"].tolist() == [0]


def test_stacked_ranks_with_pids_in_another_order_match_their_own_threads(tmp_path: Path) -> None:
    files = {
        0: [_op("aten::mm", "100", 1000, 10), _op("aten::mm", "200", 1100, 10)],
        1: [_op("aten::long_on_200", "200", 1000, 1000), _op("aten::short_on_100", "100", 1200, 10),
            _memory("100", 1100, 1), _memory("100", 1205, 2)],
    }
    for rank, events in files.items():
        _write(tmp_path / f"rank{rank}.pt.trace.json", events, rank, 2)
    trace = tracemagic.load(tmp_path, use_cache=False)
    expected = _expected_ops(files)
    assert [op for _, _, op in expected] == [None, "aten::short_on_100"]  # pid 200's long op holds no pid 100 event
    assert _found_ops(trace.memory()) == [(r, op) for r, _, op in expected]


def test_a_python_event_with_no_name_is_no_layer(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "python_function", "name": "nn.Module: Linear_0", "pid": 1, "tid": 1, "ts": 100, "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 110, "dur": 10},
        {"ph": "X", "cat": "python_function", "name": None, "pid": 1, "tid": 1, "ts": 200, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 205, "dur": 10},
        {"ph": "X", "cat": "python_function", "name": "nn.Module: Zed_0", "pid": 1, "tid": 1, "ts": 300, "dur": 30},
    ]
    path = tmp_path / "nameless.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    layers = tracemagic.load(path, use_cache=False).layers()
    modules = {e["name"] for e in events if e["cat"] == "python_function" and str(e["name"]).startswith("nn.Module: ")}
    assert len(layers) == len(modules) == 2
    assert layers["layer"].notna().all()
    # the host time in no layer: the trace's span less the two modules' (the nameless event is none)
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    in_modules = sum(e["dur"] for e in events if str(e["name"]).startswith("nn.Module: "))
    assert layers.attrs["unattributed_us"] == {0: span - in_modules}
