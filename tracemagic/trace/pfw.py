"""Read DFTracer ``.pfw``/``.pfw.gz`` files as Kineto events, so ``tracemagic.load`` takes them.

A ``.pfw`` file is a ``[`` line then one JSON event per line (no closing ``]``). Events that
``tracemagic.export.dftracer.to_pfw`` wrote get back their Kineto category, ids, shapes and
memory fields; foreign DFTracer events (``POSIX``, ``STDIO``, application categories) keep
their category and load as kind ``other``. Timestamps stay µs since the epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from tracemagic.errors import TraceError
from tracemagic.trace.kineto import GPU_KINDS
from tracemagic.trace.read import ByteStream, file_source


def is_pfw(name: str) -> bool:
    """Whether a file name is a DFTracer trace (``.pfw`` or ``.pfw.gz``)."""
    return name.lower().endswith((".pfw", ".pfw.gz"))


def _pfw_lines(path: Path, max_bytes: int | None = None, max_ratio: float | None = None) -> Iterator[bytearray]:
    with ByteStream(file_source(path, max_bytes=max_bytes, max_ratio=max_ratio)) as stream:  # at most max_bytes
        raw = stream.read_all()
        if stream.truncated:
            raise TraceError(f"{path}: the gzip stream is cut off.", path=str(path))
    for line in raw.splitlines():
        line = line.strip().rstrip(b",")
        if not line or line == b"[" or line == b"]":
            continue
        yield line


_ARG_TO_KINETO = {
    "stream": "stream",
    "rf_id": "Record function id",
    "external_id": "External id",
    "correlation": "correlation",
    "seq": "Sequence number",
    "flops": "flops",
}


def _to_kineto(event: dict[str, Any]) -> dict[str, Any] | None:
    """A ``.pfw`` event as the Kineto event it came from (foreign events keep their fields)."""
    ph = event.get("ph", "X")
    if ph == "M":
        args = event.get("args") or {}
        if event.get("name") in ("process_name", "thread_name"):
            return {
                "ph": "M",
                "name": event["name"],
                "pid": event.get("pid"),
                "tid": event.get("tid"),
                "args": {"name": args.get("name")},
            }
        return None
    args = dict(event.get("args") or {})
    out: dict[str, Any] = {
        "ph": "i" if args.get("kind") == "memory" else "X",
        "cat": args.pop("kineto_cat", event.get("cat", "")),
        "name": event.get("name", ""),
        "pid": event.get("pid"),
        "tid": event.get("tid"),
        "ts": float(event.get("ts", 0)),
        "dur": float(event.get("dur", 0)),
    }
    kargs: dict[str, Any] = {}
    for key, kkey in _ARG_TO_KINETO.items():
        if key in args:
            kargs[kkey] = args.pop(key)
    if "input_shapes" in args:
        kargs["Input Dims"] = _json_or_text(args.pop("input_shapes"))
    if "input_types" in args:
        kargs["Input type"] = _json_or_text(args.pop("input_types"))
    device = str(args.get("device", ""))
    if args.get("kind") in GPU_KINDS and device.startswith("cuda:"):
        kargs["device"] = int(device.split(":", 1)[1])
    if args.get("kind") == "memory":
        out["s"] = "t"
        kargs["Device Id"] = int(device.split(":", 1)[1]) if device.startswith("cuda:") else -1
        kargs["Device Type"] = 1 if device.startswith("cuda") else 0
        for key, kkey in (
            ("bytes", "Bytes"),
            ("total_allocated", "Total Allocated"),
            ("total_reserved", "Total Reserved"),
        ):
            if key in args:
                kargs[kkey] = args.pop(key)
    out["args"] = kargs
    return out


def _json_or_text(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def pfw_to_kineto(path: Path, max_bytes: int | None = None, max_ratio: float | None = None) -> bytes:
    """The events of a ``.pfw`` file as the bytes of an equivalent Kineto trace.

    Args:
        max_bytes: the most bytes a ``.pfw.gz`` may decompress to (None: no limit).
        max_ratio: the most its gzip may inflate (see ``read.MAX_RATIO``; None: no limit).

    Raises:
        TraceError: the file is empty, cut off, over ``max_bytes``, or has a line that is not
            JSON.
    """
    events = []
    ranks: set[int] = set()
    for number, line in enumerate(_pfw_lines(path, max_bytes, max_ratio), start=1):
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"{path}: event {number} is not JSON ({exc}).", path=str(path)) from None
        if isinstance(event, dict) and isinstance(event.get("args") or {}, dict):
            rank = (event.get("args") or {}).get("rank") if event.get("ph") != "M" else None
            if isinstance(rank, int):
                ranks.add(rank)
            converted = _to_kineto(event)
            if converted is not None:
                events.append(converted)
    if not any(e["ph"] != "M" for e in events):
        raise TraceError(f"{path}: no events in this .pfw file.", path=str(path))
    top: dict[str, Any] = {"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms"}
    if len(ranks) == 1:
        top["distributedInfo"] = {"rank": ranks.pop()}
    return orjson.dumps(top)
