"""Which Execution Trace (ET) goes with which Kineto trace, judged by file names only.

- ``torch_et_<rank>_cycle<k>.json`` with ``kineto_trace_<rank>_cycle<k>.json[.gz]`` (a
  capture with ``--repeat``: one pair per cycle), and ``torch_et_<rank>.json[.gz]`` with
  ``kineto_trace_<rank>[_cycle<k>].json[.gz]`` (a capture);
- ``<stem>_et.json[.gz]`` (or ``<stem>.et.json``) with ``<stem>_trace.json[.gz]``;
- in ``pairs``, by rank, so also Chakra's ``host_<rank>.json`` with ``device_<rank>.json``.

Without a matching name, ``et_for`` takes a folder's only ET (unless ``lone=False``) and
``pairs`` pairs a folder's only ET with its only Kineto trace.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tracemagic.trace.kineto import rank_at_stem_end
from tracemagic.trace.layout import ET_FILE, ET_PREFIX, KINETO_PREFIX, et_name, kineto_name

__all__ = [
    "capture_ets",
    "cycle_of",
    "et_for",
    "ets_in",
    "is_et_name",
    "is_kineto_name",
    "kineto_for",
    "pairs",
    "rank_of",
]

#: an ET file name; the digit groups, where there are any, are the rank
_ET_NAME = re.compile(
    rf"^(?:{ET_PREFIX}(\d+)(?:_cycle\d+)?|(.*?)[_.]et)\.json(?:\.gz)?$"
    r"|^host_(\d+)\.json$"
    rf"|^.*?{ET_PREFIX}(\d+)(?:_cycle\d+)?\.json(?:\.gz)?$"
    r"|^et[_.].*\.json(?:\.gz)?$"
)
#: a Kineto trace file name (an ET name wins where both match)
_KINETO_NAME = re.compile(
    rf"^{KINETO_PREFIX}(\d+)(?:_cycle\d+)?\.json(?:\.gz)?$|^(.*?)[_.]trace\.json(?:\.gz)?$|^device_(\d+)\.json$"
)
#: the ETs tracemagic's capture writes
_CAPTURE_ET = ET_FILE
#: the cycle of a capture's per-cycle file
_CYCLE = re.compile(rf"^(?:{ET_PREFIX}|{KINETO_PREFIX})\d+_cycle(\d+)\.json(?:\.gz)?$")


def is_et_name(name: str) -> bool:
    """Whether a file name is an Execution Trace's.

    Args:
        name: a file name (no folder).
    """
    return bool(_ET_NAME.match(name))


def is_kineto_name(name: str) -> bool:
    """Whether a file name is a Kineto trace's (not an ET's, not a ``.pfw`` log's).

    Args:
        name: a file name (no folder).
    """
    return bool(_KINETO_NAME.match(name)) and not is_et_name(name) and ".pfw" not in name


def rank_of(name: str) -> int | None:
    """The rank written in an ET or Kineto trace file name.

    Args:
        name: a file name (no folder).

    Returns:
        The number of ``torch_et_<rank>``, ``kineto_trace_<rank>``, ``host_<rank>`` or
        ``device_<rank>``, else the last number before the first dot when ``rank``,
        ``worker`` or ``_`` precedes it, else None.
    """
    m = _ET_NAME.match(name) or _KINETO_NAME.match(name)
    if m:
        for g in m.groups():
            if g and g.isdigit():
                return int(g)
    return rank_at_stem_end(name)


def cycle_of(name: str) -> int | None:
    """The ``<k>`` of ``torch_et_<rank>_cycle<k>`` / ``kineto_trace_<rank>_cycle<k>``, else None.

    Args:
        name: a file name (no folder).
    """
    m = _CYCLE.match(name)
    return int(m.group(1)) if m else None


def ets_in(folder: str | os.PathLike[str]) -> list[Path]:
    """The files in a folder named as Execution Traces, sorted.

    Args:
        folder: a directory.
    """
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and is_et_name(p.name))


def capture_ets(folder: str | os.PathLike[str]) -> list[Path]:
    """The ``torch_et_<rank>[_cycle<k>].json[.gz]`` files in a folder (what a capture writes), sorted.

    Args:
        folder: a directory.
    """
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and _CAPTURE_ET.match(p.name))


def et_for(kineto_path: str | os.PathLike[str], *, lone: bool = True) -> Path | None:
    """The Execution Trace lying next to a Kineto trace file, if any.

    Args:
        kineto_path: the Kineto trace file.
        lone: also take the folder's only ET-named file when no name matches.

    Returns:
        ``torch_et_<rank>_cycle<k>.json`` for ``kineto_trace_<rank>_cycle<k>.json[.gz]``, else
        ``torch_et_<rank>.json[.gz]`` for ``kineto_trace_<rank>[_cycle<k>].json[.gz]``;
        ``<stem>_et.json[.gz]`` or ``<stem>.et.json`` for ``<stem>[_]trace.json[.gz]``
        (also ``<stem>_kineto_trace.json``); with ``lone``, the only ET in the folder;
        else None.
    """
    kineto = Path(kineto_path)
    folder, name = kineto.parent, kineto.name
    candidates: list[str] = []
    m = re.match(rf"{KINETO_PREFIX}(\d+)", name)
    if m:
        rank, cycle = int(m.group(1)), cycle_of(name)
        if cycle is not None:
            candidates += [et_name(rank, cycle), et_name(rank, cycle) + ".gz"]
        candidates += [et_name(rank), et_name(rank) + ".gz"]
    m = re.match(r"(.*?)[_.-]?(?:kineto_)?trace(\.json(?:\.gz)?)$", name)
    if m and m.group(1):
        stem = m.group(1)
        candidates += [f"{stem}_et.json", f"{stem}_et.json.gz", f"{stem}.et.json"]
    for candidate in candidates:
        if (folder / candidate).is_file():
            return folder / candidate
    if lone and folder.is_dir():
        ets = ets_in(folder)
        if len(ets) == 1:
            return ets[0]
    return None


def kineto_for(et_path: str | os.PathLike[str]) -> Path | None:
    """The Kineto trace lying next to an Execution Trace file under the matching name, if any.

    Args:
        et_path: the ET file.

    Returns:
        ``kineto_trace_<rank>[_cycle<k>].json[.gz]`` for ``torch_et_<rank>[_cycle<k>]...``;
        ``<stem>_trace.json[.gz]`` for ``<stem>_et.json[.gz]``/``<stem>.et.json[.gz]``; else None.
    """
    et = Path(et_path)
    folder = et.parent
    names: list[str] = []
    m = re.match(rf"{ET_PREFIX}(\d+)", et.name)
    if m:
        rank, cycle = int(m.group(1)), cycle_of(et.name)
        names += [kineto_name(rank, cycle, gz=False), kineto_name(rank, cycle, gz=True)]
    m = re.match(r"(.*?)[_.]et\.json(\.gz)?$", et.name)
    if m:
        names += [f"{m.group(1)}_trace.json", f"{m.group(1)}_trace.json.gz"]
    for n in names:
        if (folder / n).is_file():
            return folder / n
    return None


def pairs(folder: str | os.PathLike[str]) -> tuple[list[tuple[int, Path, Path]], list[str]]:
    """The ``(rank, et, kineto)`` pairs in a directory and what could not be paired.

    One ET and one Kineto trace in the directory always pair. Otherwise each ET takes the
    Kineto trace of the same rank (``rank_of``; names without a rank pair with each other),
    and a per-cycle ET (``torch_et_<rank>_cycle<k>``) the Kineto trace of the same rank and
    cycle (``cycle_of``).

    Args:
        folder: a capture directory.

    Returns:
        The pairs sorted by rank, then cycle (rank 0 where the name has none), and one line
        per ET or Kineto trace left without a partner or with several.
    """
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    ets = [p for p in files if is_et_name(p.name)]
    kinetos = [p for p in files if is_kineto_name(p.name)]
    problems: list[str] = []
    if len(ets) == 1 and len(kinetos) == 1:
        rank = rank_of(ets[0].name)
        return [(rank if rank is not None else 0, ets[0], kinetos[0])], problems
    by_rank: dict[int, list[Path]] = {}
    for k in kinetos:
        r = rank_of(k.name)
        by_rank.setdefault(r if r is not None else -1, []).append(k)
    found = []
    # per-cycle ETs first: each takes its own cycle's trace; an ET without a cycle the rest
    for et in sorted(ets, key=lambda p: cycle_of(p.name) is None):
        r = rank_of(et.name)
        key = r if r is not None else -1
        cycle = cycle_of(et.name)
        if cycle is None:
            candidates = by_rank.pop(key, [])
        else:
            candidates = [k for k in by_rank.get(key, []) if cycle_of(k.name) == cycle]
            by_rank[key] = [k for k in by_rank.get(key, []) if k not in candidates]
        if not candidates and cycle is not None:
            problems.append(
                f"{et.name}: no Kineto trace of the same rank and cycle next to it "
                f"(kineto_trace_{r}_cycle{cycle}.json)."
            )
            continue
        if not candidates:
            problems.append(f"{et.name}: no Kineto trace of the same rank next to it (kineto_trace_{r}.json).")
            continue
        if len(candidates) > 1:
            problems.append(
                f"{et.name}: several Kineto traces of rank {r} ({', '.join(c.name for c in candidates)}); "
                "Chakra needs the one recorded in the same steps as the ET. The first one is checked."
            )
        found.append((r if r is not None else 0, et, candidates[0]))
    for r, rest in sorted(by_rank.items()):
        problems += [f"{k.name}: no Execution Trace of rank {r} (torch_et_{r}.json); capture with --et." for k in rest]
    return sorted(found, key=lambda t: (t[0], cycle_of(t[1].name) or 0, t[1].name)), problems
