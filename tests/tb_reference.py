"""The TensorBoard plugin's device step windows, re-implemented from the raw JSON for tests.

It follows ``torch_tb_profiler/profiler/event_parser.py`` (``_find_device_steps`` and
``_update_steps_duration``): runtime calls wholly inside a host ProfilerStep own the device
work they launched (joined by correlation id); a step's window runs from the previous
window's end (or its host start, if later) to the later of its host end and the end of
its device work; trailing steps that launched no device work are removed (and the last
that did, when it launched under 0.8 of the one before: ``is_remove_tail_steps``).

``breakdown`` partitions each window as the plugin's Overview does (``StepParser._parse_step``
puts every event in one ``ProfileRole``; ``OverallParser.Statistics.create_from_range`` gives
each instant to the first role running then, in ``ROLES`` order, what none covers is Other),
with tracemagic's documented differences applied where they are named (``role``).
Independent of tracemagic: the standard library and the raw events only.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import tarfile
from pathlib import Path
from typing import Any

KERNEL = {"kernel"}
MEMCPY = {"gpu_memcpy", "memcpy"}
MEMSET = {"gpu_memset", "memset"}
RUNTIME = {"cuda_runtime", "cuda_driver", "runtime"}
HOST = {"cpu_op", "user_annotation", "operator"}
GPU = KERNEL | MEMCPY | MEMSET
#: the roles of a step's window, the first winning where several run (tracemagic's order:
#: the plugin's ``ProfileRole`` puts Communication after Memcpy and Memset)
ROLES = ("compute", "comm", "memcpy", "memset", "runtime", "dataloader", "cpu")
#: a host collective (tracemagic: on a rank without GPU activity, communication)
HOST_COMM = re.compile(r"^(?:nccl|gloo|mpi|ucc|xccl):\w+|^record_param_comms$")
#: a gloo collective: communication on any rank (it moves the data on the host)
GLOO = re.compile(r"^gloo:\w+")


def category(event: dict[str, Any]) -> str:
    """The event's ``cat`` in lower case (old traces spell them ``Kernel``, ``Runtime``...)."""
    return str(event.get("cat", "")).lower()


def host_steps(events: list[dict[str, Any]], origin: float = 0.0) -> list[tuple[int, float, float]]:
    """(number, start, end) of the ProfilerSteps, µs after ``origin``, by start; the first of
    a repeated number."""
    seen: dict[int, tuple[float, float]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and name.startswith("ProfilerStep#") and category(e) in HOST:
            start = float(e["ts"]) - origin
            seen.setdefault(int(name.split("#")[1]), (start, start + float(e.get("dur", 0))))
    return sorted(((n, s, t) for n, (s, t) in seen.items()), key=lambda x: x[1])


def device_windows(
    events: list[dict[str, Any]], origin: float, tail: bool = True
) -> list[tuple[int, float, float]]:
    """(number, start, end) of each step's device window, µs after ``origin`` (times are
    shifted before any sum: float64 epoch-µs times round to 0.25 µs). ``tail=False``: the
    trailing steps stay (tracemagic's own captures, whose manifest says which are whole)."""
    steps = host_steps(events, origin)

    def start_of(e: dict[str, Any]) -> float:
        return float(e["ts"]) - origin

    def end_of(e: dict[str, Any]) -> float:
        return float(e["ts"]) - origin + float(e.get("dur", 0))

    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in timed if category(e) in GPU]
    by_corr: dict[int, list[dict[str, Any]]] = {}
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            by_corr.setdefault(int(corr), []).append(e)
    runtimes = sorted((start_of(e), end_of(e), id(e)) for e in timed if category(e) in RUNTIME)
    launched_by = {id(e): by_corr.get(int((e.get("args") or {}).get("correlation", -1)), []) for e in timed if category(e) in RUNTIME}
    lo = [math.inf] * len(steps)
    hi = [-math.inf] * len(steps)
    launched = [0] * len(steps)
    matched: set[int] = set()
    i = j = 0
    while i < len(steps) and j < len(runtimes):  # _find_device_steps: a two-way merge
        start, end, key = runtimes[j]
        _, step_start, step_end = steps[i]
        if start < step_start:  # before the step, or straddling its start
            j += 1
        elif end <= step_end:  # wholly inside: the step owns what it launched
            for d in launched_by[key]:
                lo[i] = min(lo[i], start_of(d))
                hi[i] = max(hi[i], end_of(d))
                matched.add(id(d))
                launched[i] += 1
            j += 1
        elif start < step_end:  # straddling the step's end
            j += 1
        else:
            i += 1
    if not steps:
        return []
    previous = steps[0][1]
    if math.isfinite(lo[0]):
        for d in device:
            end = end_of(d)
            if id(d) not in matched and end < lo[0]:
                previous = max(previous, end)
    windows = []
    for k, (number, start, end) in enumerate(steps):  # _update_steps_duration
        begin = max(previous, start)
        stop = max(end, hi[k]) if math.isfinite(hi[k]) else end
        stop = max(stop, begin)
        windows.append((number, begin, stop))
        previous = stop
    # is_remove_tail_steps: with GPU work in some step, the trailing steps that launched none
    # go, and the last that did too if it launched under 0.8 of the one before
    if tail and matched and len(steps) > 1:
        last = max((k for k, n in enumerate(launched) if n > 0), default=-1)
        if last >= 0:
            keep = last + 1
            if last > 0 and launched[last - 1] * 0.8 > launched[last]:
                keep = last
            windows = windows[:keep]
    return windows


def role(event: dict[str, Any], gpu_rank: bool) -> str | None:
    """The role (``ROLES``) an event plays in the breakdown, None for none.

    The plugin's rule (``event_parser.py``, ``_parse_step``; ``trace.py``, ``EventTypeMap``):
    kernels are Kernel, or Communication; memcpy, memset and runtime calls their own;
    a host ``Operator`` or ``user_annotation`` (cat ``cpu_op``, ``operator``,
    ``user_annotation``) is DataLoader, Communication (a collective) or else CpuOp, the
    ProfilerSteps apart. That is every host range a ``record_function`` opens, and the
    ``%%chakra_trace`` line marks (``tracemagic.line:N``, cat ``cpu_op`` in the file).

    tracemagic's documented differences, applied here (``analysis/steps.py``' docstring):

    - a kernel is communication when ``nccl`` is in its name (the plugin: when its External
      id is that of a host range with one of five ``nccl:*`` names);
    - ``cuda_driver`` calls are runtime (the plugin ignores the category);
    - a host collective is communication only on a rank without GPU activity (any
      ``nccl:``/``gloo:``/``mpi:``/``ucc:``/``xccl:`` op, ``record_param_comms``), and a
      ``gloo:*`` one on any rank; a GPU rank's ``nccl:*`` ops only launch the NCCL kernels,
      which count: they are CPU (the plugin: Communication, five names, any rank);
    - DataLoader is any host range named with ``DataLoader`` or ``enumerate(DataPipe)#``
      (the plugin: ``enumerate(DataLoader)#...__next__`` only; the others are its CpuOp);
    - ``gpu_user_annotation`` ranges, drawn over a GPU stream, are nothing (the plugin maps
      them to USER_ANNOTATION, so CpuOp), and so is the old cat ``python`` (the plugin's
      PYTHON, CpuOp too), which tracemagic reads as ``python_function`` (none in either).
    """
    cat, name = category(event), str(event.get("name", ""))
    if cat in KERNEL:
        return "comm" if "nccl" in name.lower() else "compute"
    if cat in MEMCPY:
        return "memcpy"
    if cat in MEMSET:
        return "memset"
    if cat in RUNTIME:
        return "runtime"
    if cat not in HOST or re.match(r"ProfilerStep#\d", name):
        return None
    if "DataLoader" in name or name.startswith("enumerate(DataPipe)#"):
        return "dataloader"
    if GLOO.match(name) or (not gpu_rank and HOST_COMM.match(name)):
        return "comm"
    return "cpu"


def breakdown(
    events: list[dict[str, Any]], windows: list[tuple[int, float, float]], origin: float
) -> list[dict[str, float]]:
    """Per window (``device_windows``' rows, µs after ``origin``): µs of each ``ROLES``
    entry (``<role>_us``) and ``idle_us`` (the plugin's Other), which add up to the window.

    The events are one rank's: a rank with any GPU activity is a GPU rank (``role``)."""
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e and float(e.get("dur", 0)) > 0]
    gpu_rank = any(category(e) in GPU for e in timed)
    ranges: dict[str, list[tuple[float, float]]] = {r: [] for r in ROLES}
    for e in timed:
        found = role(e, gpu_rank)
        if found is not None:
            start = float(e["ts"]) - origin
            ranges[found].append((start, start + float(e["dur"])))
    out = []
    for _, lo, hi in windows:
        row: dict[str, float] = {}
        covered: list[tuple[float, float]] = []
        before = 0.0
        for name in ROLES:  # each role: what it adds to the union of those before it
            covered += [(a, b) for a, b in ranges[name] if min(b, hi) > max(a, lo)]
            now = union(covered, lo, hi)
            row[f"{name}_us"] = now - before
            before = now
        row["idle_us"] = (hi - lo) - before
        out.append(row)
    return out


def union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, reach = 0.0, -math.inf
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def raw_docs(path: Path) -> list[dict[str, Any]]:
    """The JSON documents of a ``.json.gz`` trace (one) or a ``.tar.gz`` of rank traces."""
    if path.name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            return [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")]
    with gzip.open(path, "rt") as fh:
        return [json.load(fh)]
