"""``CaptureResult``: what one ``%%chakra_trace`` run left on disk (its directory, manifest and
trace); ``tracemagic.facade.Capture`` adds how it displays (dashboard, report, Chakra check)."""

from __future__ import annotations

import logging
import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tracemagic.errors import TraceError
from tracemagic.trace.layout import (
    KINETO_KIND,
    MANIFEST,
    MANIFEST_KIND,
    FileEntry,
    Manifest,
    SlowCatch,
    read_manifest,
    write_manifest,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from tracemagic.trace.model import TraceTables

CaptureT = TypeVar("CaptureT", bound="CaptureResult")
_log = logging.getLogger(__name__)


class CaptureResult:
    """A finished capture: its directory, its files and its manifest (the data; the
    magic and a script's ``cap.result`` hand out ``tracemagic.facade.Capture``, which adds
    the dashboard and outputs).

    Everything here is rebuilt from the directory alone (``CaptureResult.from_dir``), so a live
    capture and one loaded later behave the same.

    Attributes:
        dir: the capture directory ``DIR/NAME-<timestamp>``.
        manifest: the parsed ``capture.json``.
    """

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.dir = Path(directory)
        self.manifest = manifest
        self._trace: Any = None
        self._dashboard: Any = None  # built by tracemagic.facade.Capture.dashboard
        self.vs: CaptureResult | None = None  # the capture it is compared with (--vs)

    @classmethod
    def of(cls: type[CaptureT], capture: CaptureResult) -> CaptureT:
        """``capture`` as an instance of ``cls`` (``tracemagic.facade.Capture``), sharing
        its directory, manifest and loaded trace."""
        if type(capture) is cls:
            return capture
        new = cls(capture.dir, capture.manifest)
        new._trace = capture._trace  # the trace, if loaded, is not loaded again
        new._dashboard = capture._dashboard
        new.vs = capture.vs
        return new

    @classmethod
    def from_dir(cls, directory: str | Path) -> CaptureResult:
        """Read a capture directory written by ``%%chakra_trace``."""
        path = Path(directory)
        return cls(path, read_manifest(path))

    @property
    def files(self) -> list[Path]:
        """Every file of the capture (traces, ET, memory timelines, manifest)."""
        return [self.dir / entry["path"] for entry in self.manifest.get("files", [])]

    @property
    def status(self) -> str:
        """``complete``, ``partial`` (short loop or the cell raised), ``empty`` or ``failed``."""
        return str(self.manifest.get("status", "unknown"))

    @property
    def steps(self) -> list[dict[str, Any]]:
        """One entry per ``ProfilerStep#N`` in the traces (see ``capture.json``)."""
        return list(self.manifest.get("steps", []))

    @property
    def iterations(self) -> pd.DataFrame:
        """Every iteration of the stepped loop, recorded or not: ``iteration``, ``wall_ms``,
        ``gpu_ms``, ``step`` (its ``ProfilerStep`` number, NA if not recorded), ``phase``,
        ``slow_ratio``, ``slow_trace`` (``tracemagic.analysis.iterations.from_manifest``)."""
        from tracemagic.analysis.iterations import from_manifest  # pandas: imported on first use

        return from_manifest(self.manifest)

    @property
    def slow_steps(self) -> list[SlowCatch]:
        """The slow iterations ``--slow`` caught: ``iteration``, ``wall_ms``, ``median_ms``,
        ``ratio``, ``recorded`` (the next iteration, the one recorded) and ``path`` (its
        trace in ``dir``; None if it could not be written)."""
        return list((self.manifest.get("loop_timing") or {}).get("slow") or [])

    def slow_trace(self, k: int = 1) -> TraceTables:
        """The trace of the ``k``-th slow step ``--slow`` caught (from 1), loaded.

        Raises:
            TraceError: there is no such trace.
        """
        catches = self.slow_steps
        if not 1 <= k <= len(catches) or not catches[k - 1].get("path"):
            raise TraceError(
                f"{self.dir}: no trace of slow step {k} (this capture has {len(catches)} "
                "caught with --slow; see cap.slow_steps).",
                path=str(self.dir),
            )
        from tracemagic.trace.loader import load

        return load(self.dir / str(catches[k - 1]["path"]))

    @property
    def has_trace(self) -> bool:
        """Whether a Kineto trace was written (a failed or empty capture has none)."""
        return any(e.get("kind") == KINETO_KIND for e in self.manifest.get("files", []))

    @property
    def title(self) -> str:
        """The dashboard heading: the directory name, and the status unless complete."""
        return self.dir.name + ("" if self.status == "complete" else f" ({self.status})")

    @property
    def trace(self) -> TraceTables:
        """The capture loaded with ``tracemagic.trace.load`` (on first access, then kept).

        Raises:
            TraceError: the capture wrote no trace (the message says why), or it is damaged.
        """
        if self._trace is None:
            if not self.has_trace:
                notes = self.manifest.get("notes") or []
                why = f": {notes[0]}" if notes else ""
                raise TraceError(f"{self.dir}: this capture ({self.status}) wrote no trace{why}", path=str(self.dir))
            from tracemagic.trace.loader import load  # pandas: imported on first use

            self._trace = load(self.dir)
        trace: TraceTables = self._trace
        return trace

    def save_manifest(self) -> None:
        """Rewrite ``capture.json`` from ``self.manifest`` (atomically: never half-written)."""
        write_manifest(self.dir, self.manifest)

    def _add_file(self, entry: FileEntry) -> None:
        entries = [e for e in self.manifest.get("files", []) if e.get("path") != entry["path"]]
        at = next((i for i, e in enumerate(entries) if e.get("kind") == MANIFEST_KIND), len(entries))
        entries.insert(at, entry)  # the manifest stays last
        self.manifest["files"] = entries

    def summary(self, top: int = 5) -> str:
        """A few lines of plain text: status, steps, time per step, top layers, files."""
        return "\n".join(self._header_lines() + self._layer_lines(top) + self._note_lines())

    def _header_lines(self) -> list[str]:
        m = self.manifest
        steps = self.steps
        complete = [s for s in steps if s.get("complete")]
        lines = [f"chakra_trace {self.status}: {_steps_phrase(steps, complete)}"]
        timing = m.get("loop_timing") or {}
        if timing.get("stopped_after") is not None:
            lines[0] += (
                f"; loop stopped on purpose by --stop after iteration {timing['stopped_after']} (the profile was done)"
            )
        loop = m.get("loop") or {}
        if loop.get("mode") == "loop":
            lines.append(f"  stepped: `{loop.get('kind')}` loop at line {loop.get('line')}")
        walls = timing.get("wall_ms") or []
        if walls:
            lines.append(f"  iterations: {len(walls):,} timed, median {statistics.median(walls):.3g} ms wall")
        for catch in timing.get("slow") or []:
            lines.append(
                f"  slow: iteration {catch['iteration']} took {catch['wall_ms']:.3g} ms, "
                f"{catch['ratio']:.1f}x the running median; iteration {catch['recorded']} recorded: "
                f"{catch.get('path') or 'not written'}"
            )
        lines.append(f"  dir: {self.dir}")
        files = ", ".join(
            f"{e['path']} ({_size(e['bytes'])})" if "bytes" in e else e["path"] for e in m.get("files", [])
        )
        lines.append(f"  files: {files}")
        if m.get("report"):
            lines.append(f"  report: {m['report']}")
        return lines

    def _note_lines(self) -> list[str]:
        return [f"  note: {note}" for note in self.manifest.get("notes", [])]

    def _layer_lines(self, top: int) -> list[str]:
        if not self.has_trace:
            return []
        from tracemagic.analysis.layers import layers as layers_table

        try:
            layers = self.trace.table(layers_table)
            rows = layers.sort_values("self_cpu_us", ascending=False).head(top)
        except Exception as exc:  # noqa: BLE001 - a display must never raise; say why instead
            _log.debug("the top layers failed", exc_info=True)
            return [f"  top layers: unavailable ({type(exc).__name__}: {exc})"]
        out = ["  top layers (self CPU time):"]
        for row in rows.itertuples(index=False):
            out.append(f"    {row.layer:<40} {row.type:<20} {row.self_cpu_us / 1e3:9.3f} ms  {int(row.calls)} calls")
        return out

    def __repr__(self) -> str:
        return f"<Capture {self.status} {len(self.steps)} steps at {str(self.dir)!r}>"


def previous_capture(out: str | Path, name: str, exclude: Path | None = None) -> CaptureResult | None:
    """The latest capture named ``name`` in ``out`` that wrote a trace (``--vs last``), or None.

    Looks at the ``NAME-<timestamp>[-n]`` folders of ``out`` (not ``exclude``, the capture
    just made) whose manifest has this ``name``; the latest by its manifest's write time.
    """
    folder = Path(out)
    pattern = re.compile(re.escape(name) + r"-\d{8}-\d{6}(?:-\d+)?$")
    found: list[tuple[int, CaptureResult]] = []
    skip = exclude.resolve() if exclude is not None else None
    for path in folder.iterdir() if folder.is_dir() else []:
        if not pattern.match(path.name) or (skip is not None and path.resolve() == skip):
            continue
        try:
            capture = CaptureResult.from_dir(path)
            written = (path / MANIFEST).stat().st_mtime_ns
        except (TraceError, OSError):
            continue
        if capture.manifest.get("name") == name and capture.has_trace:
            found.append((written, capture))
    return max(found, key=lambda item: (item[0], item[1].dir.name))[1] if found else None


def _steps_phrase(steps: list[dict[str, Any]], complete: list[dict[str, Any]]) -> str:
    if not steps:
        return "no steps recorded"
    numbers = [s["step"] for s in steps]
    span = f"ProfilerStep#{numbers[0]}" + (f"..#{numbers[-1]}" if len(numbers) > 1 else "")
    walls = [s["wall_ms"] for s in complete if s.get("wall_ms") is not None]
    per_step = f", {statistics.median(walls):.2f} ms/step wall (median)" if walls else ""
    extra = len(steps) - len(complete)
    tail = f" + {extra} incomplete" if extra else ""
    plural = "" if len(complete) == 1 else "s"
    return f"{len(complete)} step{plural} recorded{tail} ({span}){per_step}"


def _size(n: float) -> str:
    """``n`` bytes in B, kB, MB or GB (powers of 1000)."""
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
