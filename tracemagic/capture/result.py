"""``Capture``: what one ``%%chakra_trace`` run left on disk, and how it displays."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from tracemagic.capture.files import MANIFEST, write_json
from tracemagic.errors import TraceError


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
        self._dashboard: Any = None

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
    def has_trace(self) -> bool:
        """Whether a Kineto trace was written (a failed or empty capture has none)."""
        return any(e.get("kind") == "kineto" for e in self.manifest.get("files", []))

    @property
    def title(self) -> str:
        """The dashboard heading: the directory name, and the status unless complete."""
        return self.dir.name + ("" if self.status == "complete" else f" ({self.status})")

    @property
    def trace(self) -> Any:
        """The capture loaded with ``tracemagic.load`` (on first access, then kept).

        Raises:
            TraceError: the capture wrote no trace (the message says why), or it is damaged.
        """
        if self._trace is None:
            if not self.has_trace:
                notes = self.manifest.get("notes") or []
                why = f": {notes[0]}" if notes else ""
                raise TraceError(f"{self.dir}: this capture ({self.status}) wrote no trace{why}", path=str(self.dir))
            import tracemagic

            self._trace = tracemagic.load(self.dir)
        return self._trace

    @property
    def dashboard(self) -> Any:
        """The ``tracemagic.views.Dashboard`` of this capture (built on first access, then kept)."""
        if self._dashboard is None:
            from tracemagic.views import Dashboard

            self._dashboard = Dashboard(self.trace, title=self.title, caption=self._header_lines() + self._note_lines())
        return self._dashboard

    # -- outputs next to the trace ---------------------------------------------------------
    def report(self, path: str | os.PathLike[str], other: Any = None) -> Path:
        """Write the standalone HTML report (``Trace.report``); its path goes in the manifest."""
        written = self.trace.report(path, other=other)
        self.manifest["report"] = str(written)
        self.save_manifest()
        return Path(written)

    def to_pfw(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the profiler events as DFTracer ``.pfw`` (``Trace.to_pfw``).

        Args:
            path: default ``dftracer_<rank>.pfw`` in the capture directory (``.pfw.gz``
                when the capture was written with ``--gzip``). A file in the capture
                directory is listed in the manifest's ``files`` (``kind: "pfw"``).
        """
        if path is None:
            gz = bool(self.manifest.get("arguments", {}).get("options", {}).get("gzip"))
            path = self.dir / (f"dftracer_{self.manifest.get('rank', 0)}.pfw" + (".gz" if gz else ""))
        written = Path(self.trace.to_pfw(path))
        if written.resolve().parent == self.dir.resolve():
            self._add_file({"path": written.name, "kind": "pfw", "rank": self.manifest.get("rank", 0),
                            "bytes": written.stat().st_size})
        self.save_manifest()
        return written

    def chakra_check(self) -> Any:
        """Check the ET + Kineto pair(s) against what Chakra's tools accept.

        Runs ``tracemagic.export.chakra.check`` on the directory, records the result in the
        manifest (``chakra_check``: ``ok``, ``timed_share``, ``problems``, ``pairs``) and
        returns the ``ChakraReport``.
        """
        from tracemagic.export.chakra import check

        report = check(self.dir)
        self.manifest["chakra_check"] = {
            "ok": report.ok,
            "timed_share": round(report.timed_share, 6),
            "problems": report.all_problems,
            "pairs": [
                {
                    "rank": p.rank,
                    "et": p.et_path.name,
                    "kineto": p.kineto_path.name,
                    "schema": p.schema,
                    "et_ops": p.et_ops,
                    "matched_ops": p.matched_ops,
                    "timed_ops": p.timed_ops,
                    "profiler_steps": p.profiler_steps,
                    "unmatched": [list(u) for u in p.unmatched[:10]],
                    "notes": p.notes,
                }
                for p in report.pairs
            ],
        }
        self.save_manifest()
        return report

    def save_manifest(self) -> None:
        """Rewrite ``capture.json`` from ``self.manifest`` (atomically: never half-written)."""
        write_json(self.dir / MANIFEST, json.loads(json.dumps(self.manifest, default=str)))

    def _add_file(self, entry: dict[str, Any]) -> None:
        entries = [e for e in self.manifest.get("files", []) if e.get("path") != entry["path"]]
        at = next((i for i, e in enumerate(entries) if e.get("kind") == "manifest"), len(entries))
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
        loop = m.get("loop") or {}
        if loop.get("mode") == "loop":
            lines.append(f"  stepped: `{loop.get('kind')}` loop at line {loop.get('line')}")
        lines.append(f"  dir: {self.dir}")
        files = ", ".join(
            f"{e['path']} ({_size(e['bytes'])})" if "bytes" in e else e["path"]
            for e in m.get("files", [])
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

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The capture as the dashboard (a widget in a kernel) with a ``text/plain`` fallback.

        ``text/plain`` always starts with the capture's status, steps, files and notes
        (a partial or failed capture says so first), then the dashboard's text summary.
        A capture that wrote no trace shows only that (no dashboard). Never raises: when
        the trace cannot be loaded or drawn, the text says why instead.
        """
        body: list[str] = []
        bundle: dict[str, Any] = {}
        if self.has_trace:
            try:
                bundle = dict(self.dashboard._repr_mimebundle_(include, exclude))
                body = ["", bundle.get("text/plain", "")]
            except Exception as exc:  # noqa: BLE001 - a display must never raise; say why instead
                bundle = {}
                body = [f"  dashboard unavailable ({type(exc).__name__}: {exc})"]
        bundle["text/plain"] = "\n".join(self._header_lines() + self._note_lines() + body)
        return bundle

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


def _size(n: float) -> str:
    """``n`` bytes in B, kB, MB or GB (powers of 1000)."""
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
