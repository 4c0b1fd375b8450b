"""What lies beside a trace's Kineto files: its Execution Traces and memory timelines.

``trace.artifacts`` finds and reads them (on first use, then kept with the trace), so the
analyses take everything from the ``Trace`` and never open a file themselves.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import msgspec
import numpy as np

from tracemagic.trace import et_reader, layout, pairing
from tracemagic.trace._files import read_bytes


class Artifacts:
    """The files beside a trace (a capture or rank directory, or one Kineto file), read
    on first use.

    Attributes:
        path: the trace's path (None for a trace built in memory: no artifacts).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = None if path is None else Path(path)

    @cached_property
    def execution_traces(self) -> list[et_reader.ExecutionTrace]:
        """The Execution Traces of the capture (one per rank, or per cycle), or the one
        paired with the Kineto file (``tracemagic.trace.pairing``); empty when none."""
        return [] if self.path is None else et_reader.next_to(self.path)

    @cached_property
    def has_et(self) -> bool:
        """Whether an Execution Trace lies next to the trace under a matching name (without
        reading it): a capture directory with ``torch_et_<rank>.json``,
        ``kineto_trace_<rank>.json`` beside ``torch_et_<rank>.json``, or ``<stem>_trace.json``
        beside ``<stem>_et.json`` (a lone ET elsewhere in the folder is not assumed to
        belong to this trace; the names are ``pairing``'s)."""
        if self.path is None:
            return False
        try:
            if self.path.is_dir():
                return bool(pairing.capture_ets(self.path))
            return pairing.et_for(self.path, lone=False) is not None
        except OSError:
            return False

    @cached_property
    def memory_timelines(self) -> list[tuple[int, int | None, np.ndarray]]:
        """(rank, cycle, rows) of the memory timelines (``memory_timeline_<rank>.json``):
        the raw ``[ts_ns, action, bytes, category]`` rows as an (n, 4) int64 array."""
        return [(rank, cycle, _read_rows(path)) for rank, cycle, path in timeline_files(self.path)]


def timeline_files(path: Path | None) -> list[tuple[int, int | None, Path]]:
    """(rank, cycle, path) of the memory timelines written next to the trace's Kineto files.

    A capture directory gives all of its timelines; a ``kineto_trace_<rank>[_cycle<k>]``
    file gives the timeline of the same rank and cycle; any other file gives none.
    """
    if path is None:
        return []
    path = Path(path)
    if path.is_dir():
        folder, wanted = path, None
    else:
        match = layout.KINETO_FILE.search(path.name)
        if match is None:
            return []
        cycle = int(match.group(2)) if match.group(2) else None
        folder, wanted = path.parent, layout.memory_name(int(match.group(1)), cycle, gz=False)
    found = []
    for candidate in sorted(folder.iterdir()):
        match = layout.MEMORY_FILE.fullmatch(candidate.name)
        if match is None or (wanted is not None and candidate.name.removesuffix(".gz") != wanted):
            continue
        cycle = int(match.group(2)) if match.group(2) else None
        found.append((int(match.group(1)), cycle, candidate))
    return found


def _read_rows(path: Path) -> np.ndarray:
    """A raw timeline file's ``[ts_ns, action, bytes, category]`` rows as an (n, 4) int64 array."""
    data, _ = read_bytes(path)
    rows = msgspec.json.decode(data)
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)
