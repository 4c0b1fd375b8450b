"""``Capture``: what one ``%%chakra_trace`` run left on disk, and how it displays."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tracemagic.capture.files import MANIFEST


class Capture:
    """A finished capture: its directory, its files and its manifest.

    Everything here is rebuilt from the directory alone (``Capture.from_dir``), so a live
    capture and one loaded later behave the same.

    Attributes:
        dir: the capture directory ``DIR/NAME-<timestamp>``.
        manifest: the parsed ``capture.json``.
    """

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.manifest = manifest
        self._trace: Any = None

    @classmethod
    def from_dir(cls, directory: str | Path) -> Capture:
        """Read a capture directory written by ``%%chakra_trace``."""
        path = Path(directory)
        return cls(path, json.loads((path / MANIFEST).read_text(encoding="utf-8")))

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
    def trace(self) -> Any:
        """The capture loaded with ``tracemagic.load`` (on first access, then kept)."""
        if self._trace is None:
            import tracemagic

            self._trace = tracemagic.load(self.dir)
        return self._trace

    def summary(self, top: int = 5) -> str:
        """A few lines of plain text: status, steps, time per step, top layers, files."""
        m = self.manifest
        steps = self.steps
        complete = [s for s in steps if s.get("complete")]
        lines = [f"chakra_trace {self.status}: {_steps_phrase(steps, complete)}"]
        loop = m.get("loop") or {}
        if loop.get("mode") == "loop":
            lines.append(f"  stepped: `{loop.get('kind')}` loop at line {loop.get('line')}")
        lines.append(f"  dir: {self.dir}")
        files = ", ".join(
            f"{e['path']} ({_size(e['bytes'])})" if "bytes" in e else e["path"]
            for e in m.get("files", [])
        )
        lines.append(f"  files: {files}")
        lines.extend(self._layer_lines(top))
        lines.extend(f"  note: {note}" for note in m.get("notes", []))
        return "\n".join(lines)

    def _layer_lines(self, top: int) -> list[str]:
        if not any(e.get("kind") == "kineto" for e in self.manifest.get("files", [])):
            return []
        # The loader (tracemagic.trace) is developed alongside the capture; until it
        # provides ``load`` the summary simply has no layer table.
        try:
            from tracemagic.trace import load  # noqa: F401
        except (ImportError, AttributeError):
            return []
        try:
            layers = self.trace.layers()
            rows = layers.sort_values("self_cpu_us", ascending=False).head(top)
        except Exception as exc:  # a display must never raise; say why instead
            return [f"  top layers: unavailable ({type(exc).__name__}: {exc})"]
        out = ["  top layers (self CPU time):"]
        for row in rows.itertuples(index=False):
            out.append(
                f"    {row.layer:<40} {row.type:<20} {row.self_cpu_us / 1e3:9.3f} ms"
                f"  {int(row.calls)} calls"
            )
        return out

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None
    ) -> dict[str, str]:
        """The one display method (the dashboard replaces it); text/plain always."""
        return {"text/plain": self.summary()}

    def __repr__(self) -> str:
        return f"<Capture {self.status} {len(self.steps)} steps at {str(self.dir)!r}>"


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


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
