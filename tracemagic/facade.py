"""The front door: ``Trace``, ``Capture`` and ``load`` as users get them.

The layers below hold data and functions (``trace`` the data, ``analysis`` the tables,
``views`` and ``export`` the outputs, ``capture`` the profiler); this module, above them
all, gathers them into the methods users call (``trace.steps()``, ``trace.report(...)``,
``capture.dashboard``), with explicit imports: the one place they meet.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from tracemagic.analysis import advice as _advice
from tracemagic.analysis import aggregate as _aggregate
from tracemagic.analysis import diff as _diff
from tracemagic.analysis import efficiency as _efficiency
from tracemagic.analysis import iterations as _iterations
from tracemagic.analysis import kernels as _kernels
from tracemagic.analysis import layers as _layers
from tracemagic.analysis import lines as _lines
from tracemagic.analysis import memory as _memory
from tracemagic.analysis import ops as _ops
from tracemagic.analysis import phases as _phases
from tracemagic.analysis import ranks as _ranks
from tracemagic.analysis import shapes as _shapes
from tracemagic.analysis import sites as _sites
from tracemagic.analysis import source as _source
from tracemagic.analysis import steps as _steps
from tracemagic.analysis import syncs as _syncs
from tracemagic.capture import result as _result
from tracemagic.trace import layout as _layout
from tracemagic.trace import loader as _loader
from tracemagic.trace import model as _model
from tracemagic.trace.progress import Progress

_log = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

    from tracemagic.analysis.devices import DevicePeaks
    from tracemagic.export.chakra import ChakraReport
    from tracemagic.views.dashboard import Dashboard

__all__ = ["Capture", "Trace", "load"]


class Trace(_model.TraceTables):
    """A loaded Kineto trace: its tables (``tracemagic.trace.model.TraceTables``) and the
    analyses and outputs over them (each a DataFrame with times in µs, computed once per
    trace; see ``tracemagic.analysis`` for their columns)."""

    #: the tables kept in the trace's cache between sessions (``trace.model.TraceTables.STORED``):
    #: each reads only the events, the metadata and the capture manifest
    STORED = frozenset(
        {
            "ops.ops",
            "kernels.kernels",
            "steps.steps",
            "layers.layers",
            "memory.memory",
            "memory.peaks",
            "shapes.shapes",
            "efficiency.efficiency",
            "phases.phases",
            "ranks.ranks",
        }
    )

    def ops(self) -> pd.DataFrame:
        """Every CPU op and annotation (see ``tracemagic.analysis.ops``)."""
        return self.table(_ops.ops)

    def kernels(self) -> pd.DataFrame:
        """GPU kernels, memcpy and memset with their launching op and layer."""
        return self.table(_kernels.kernels)

    def layers(self, step: int | None = None) -> pd.DataFrame:
        """The per-layer (nn.Module instance) table (of one ProfilerStep, given ``step``)."""
        return self.table(_layers.layers) if step is None else self.table(_layers.layers, step)

    def lines(self) -> pd.DataFrame:
        """Per line of a ``%%chakra_trace`` cell: CPU and GPU time, calls and memory per step
        (from the cell's line marks; empty without them)."""
        return self.table(_lines.lines)

    def syncs(self) -> pd.DataFrame:
        """Host-device synchronisations inside the steps (``.item()``, copies to the host,
        blocking runtime calls) with their stall, named by cell line or function."""
        return self.table(_syncs.syncs)

    def memory(self) -> pd.DataFrame:
        """The memory timeline per device."""
        return self.table(_memory.memory)

    def memory_peaks(self) -> pd.DataFrame:
        """Peak allocated bytes per device and step, with the op and layer that reached it."""
        return self.table(_memory.peaks)

    def biggest_allocations(self, n: int | None = 10) -> pd.DataFrame:
        """The ``n`` largest allocations with their op, layer and lifetime."""
        return self.table(_memory.biggest_allocations, n)

    def memory_categories(self) -> pd.DataFrame:
        """Memory over time stacked by category (parameter, gradient, activation, ...);
        empty unless the capture recorded ``memory_timeline_<rank>.json``."""
        return self.table(_memory.categories)

    def shapes(self) -> pd.DataFrame:
        """Call chain x input shapes x dtypes x scalar args with calls, time and FLOPs."""
        return self.table(_shapes.shapes)

    def source(self) -> pd.DataFrame:
        """Per Python function (and per call-site line of old traces' ``Call stack``):
        calls, inclusive and self CPU time, GPU time, bytes and FLOPs beneath, user code or
        library (the definitions: ``tracemagic.analysis.source``)."""
        return self.table(_source.source)

    def sites(self) -> pd.DataFrame:
        """Per CPU op, kernel/memcpy/memset and ``[memory]`` event: the user code that
        launched it, the cell line, else the user function, else the ``Call stack`` line
        (``tracemagic.analysis.sites``)."""
        return self.table(_sites.sites)

    def call_tree(self, user_only: bool = False) -> pd.DataFrame:
        """The merged call tree, Python frames → ops → kernels, with CPU and GPU time per
        node (``tracemagic.analysis.source.call_tree``; ``user_only``: library frames left out)."""
        return self.table(_source.call_tree, user_only)

    def efficiency(self, peaks: Mapping[str, float] | DevicePeaks | None = None) -> pd.DataFrame:
        """Op x shapes x dtypes against the device's roofline: the precision its math ran in
        (``precision``: autocast's rows apart), FLOPs, bytes, achieved TFLOP/s and TB/s,
        compute- or memory-bound, % of the roof (``peaks``: the device's own, see
        ``tracemagic.analysis.efficiency``)."""
        if peaks is None:
            return self.table(_efficiency.efficiency)
        return _efficiency.efficiency(self, peaks)

    def steps(self) -> pd.DataFrame:
        """One row per ProfilerStep (per rank) with its time breakdown."""
        return self.table(_steps.steps)

    def phases(self) -> pd.DataFrame:
        """Per ProfilerStep, the host time in data loading, forward, backward, optimizer and the
        rest, and the GPU time launched from each (the rule: ``tracemagic.analysis.phases``)."""
        return self.table(_phases.phases)

    def ranks(self) -> pd.DataFrame:
        """Per-rank step time, compute, communication and idle; slowest rank marked (the
        rank ids themselves are ``trace.rank_ids``)."""
        return self.table(_ranks.ranks)

    def ranks_table(self) -> pd.DataFrame:
        """The same as ``ranks()`` (its earlier name)."""
        return self.ranks()

    def collectives(self) -> pd.DataFrame:
        """Collectives matched across ranks (same collective, same step) with each rank's wait."""
        return self.table(_ranks.collectives)

    def stragglers(self) -> pd.DataFrame:
        """The rank the others waited for, per step."""
        return self.table(_ranks.stragglers)

    def advice(self, step: int | None = None) -> pd.DataFrame:
        """The recommendations (of one ProfilerStep, given ``step``): a row per rule that
        fired, with its figure, threshold, evidence and advice, most important first (the
        rules and their named thresholds: ``tracemagic.analysis.advice``);
        ``df.attrs['closest']``: the figures nearest their thresholds that did not fire,
        which the views show when none did."""
        return self.table(_advice.advice) if step is None else self.table(_advice.advice, step)

    def diff(self, other: _model.TraceTables) -> pd.DataFrame:
        """This trace compared with ``other`` op by op and layer by layer."""
        return _diff.diff(self, other)

    # -- outputs -------------------------------------------------------------------------
    def iterations(self) -> pd.DataFrame:
        """Every iteration of a ``%%chakra_trace`` loop, recorded or not (see
        ``tracemagic.analysis.iterations``; empty for other traces)."""
        return self.table(_iterations.iterations)

    def report(self, path: str | os.PathLike[str], other: _model.TraceTables | None = None) -> Path:
        """Write the self-contained HTML report (``tracemagic.views.report.write_report``).

        Args:
            path: the ``.html`` file to write (its folder is created).
            other: a second trace: adds the Compare section (this trace is A).

        Returns:
            The path written.
        """
        from tracemagic.views.report import write_report  # plotly: imported on first use

        return write_report(self, path, other=other)

    def to_pfw(self, path: str | os.PathLike[str], **kwargs: Any) -> list[Path]:
        """Write the events as DFTracer ``.pfw``/``.pfw.gz`` (``tracemagic.export.dftracer.to_pfw``);
        returns the path written, in a list (as ``to_chrome_trace``)."""
        from tracemagic.export.dftracer import to_pfw

        return to_pfw(self, path, **kwargs)

    def to_chrome_trace(self, path: str | os.PathLike[str], steps: Any = None, **kwargs: Any) -> list[Path]:
        """Write a trimmed Chrome/Perfetto trace per rank, e.g. only some steps of a trace
        too large for the viewers (``tracemagic.export.chrome.to_chrome_trace``)."""
        from tracemagic.export.chrome import to_chrome_trace

        return to_chrome_trace(self, path, steps=steps, **kwargs)


def load(
    path: str | os.PathLike[str],
    *,
    recover: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    workers: int | None = None,
    progress: bool | Progress | None = None,
    max_bytes: int | None = None,
    allow_high_compression: bool = False,
) -> Trace:
    return Trace.of(
        _loader.load(
            path,
            recover=recover,
            cache_dir=cache_dir,
            use_cache=use_cache,
            workers=workers,
            progress=progress,
            max_bytes=max_bytes,
            allow_high_compression=allow_high_compression,
        )
    )


load.__doc__ = _loader.load.__doc__


class Capture(_result.CaptureResult):
    """A finished capture (``tracemagic.capture.result.CaptureResult``) with what it shows: its
    trace, dashboard, report and Chakra check."""

    @property
    def trace(self) -> Trace:
        """The capture loaded with ``tracemagic.load`` (on first access, then kept).

        Raises:
            TraceError: the capture wrote no trace (the message says why), or it is damaged.
        """
        trace = super().trace
        if not isinstance(trace, Trace):
            trace = self._trace = Trace.of(trace)
        return trace

    def slow_trace(self, k: int = 1) -> Trace:
        """The trace of the ``k``-th slow step ``--slow`` caught (from 1), loaded.

        Raises:
            TraceError: there is no such trace.
        """
        return Trace.of(super().slow_trace(k))

    @property
    def dashboard(self) -> Dashboard:
        """The ``tracemagic.views.Dashboard`` of this capture (built on first access, then kept)."""
        if self._dashboard is None:
            from tracemagic.views.dashboard import Dashboard  # ipywidgets: imported on first use

            other = Capture.of(self.vs).trace if self.vs is not None else None
            self._dashboard = Dashboard(
                self.trace,
                title=self.title,
                other=other,
                caption=self._header_lines() + self._note_lines(),
                other_before=other is not None,
            )
        dashboard: Dashboard = self._dashboard
        return dashboard

    def compare_with(self, other: _result.CaptureResult) -> None:
        """Compare this capture with ``other`` (``--vs``): the dashboard's Compare tab (``other``,
        the earlier run, is A and this capture B), and ``vs_line`` in the summary. ``other`` is loaded once
        and kept (its trace, and the line, are not read again at every display)."""
        self.vs = Capture.of(other)
        self._vs_line: str | None = None
        self._dashboard = None

    def vs_line(self) -> str | None:
        """One line: the mean step of the compared capture (``--vs``) → this one's, the change
        in %, and the layer (else op) whose time changed most; None without ``vs``."""
        if self.vs is None:
            return None
        if getattr(self, "_vs_line", None) is None:
            self._vs_line = self._compare_line(Capture.of(self.vs))
        return self._vs_line

    def _compare_line(self, vs: Capture) -> str:
        try:
            before, after = vs.trace, self.trace
            change = _aggregate.mean_step_change(
                _aggregate.loop_steps(before.steps(), before.manifest),
                _aggregate.loop_steps(after.steps(), after.manifest),
            )
            diff = _diff.diff(before, after)
            parts = []
            if change is not None:
                parts.append(f"mean step {change[0] / 1e3:.3g} → {change[1] / 1e3:.3g} ms, {change[2]:+.0f}%")
            for level in ("layer", "op"):
                rows = diff[(diff["level"] == level) & diff["delta_us"].notna()]
                if len(rows):
                    top = rows.loc[rows["delta_us"].abs().idxmax()]
                    parts.append(f"the biggest change: {top['name']} ({float(top['delta_us']) / 1e3:+.3g} ms)")
                    break
        except Exception as exc:  # noqa: BLE001 - a display line must never raise
            _log.debug("the comparison line failed", exc_info=True)
            return f"  vs {vs.dir.name}: no comparison ({type(exc).__name__}: {exc})"
        return f"  vs {vs.dir.name}: " + ("; ".join(parts) or "nothing to compare")

    def _header_lines(self) -> list[str]:
        lines = super()._header_lines()
        line = self.vs_line() if self.vs is not None and self.has_trace else None
        return lines + ([line] if line else [])

    def report(self, path: str | os.PathLike[str], other: _model.TraceTables | None = None) -> Path:
        """Write the standalone HTML report (``Trace.report``); its path goes in the manifest
        (``other`` default: the capture compared with, ``--vs``, which the Compare tab takes as
        A, the run before this one)."""
        if other is None and self.vs is not None:
            from tracemagic.views.report import write_report  # plotly: imported on first use

            written = write_report(self.trace, path, other=Capture.of(self.vs).trace, other_before=True)
        else:
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
        (written,) = self.trace.to_pfw(path)
        if written.resolve().parent == self.dir.resolve():
            self._add_file(
                {
                    "path": written.name,
                    "kind": _layout.PFW_KIND,
                    "rank": self.manifest.get("rank", 0),
                    "bytes": written.stat().st_size,
                }
            )
        self.save_manifest()
        return written

    def chakra_check(self) -> ChakraReport:
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
                    "cycle": p.cycle,
                    "et": p.et_path.name,
                    "kineto": p.kineto_path.name,
                    "schema": p.schema,
                    "et_ops": p.et_ops,
                    "matched_ops": p.matched_ops,
                    "timed_ops": p.timed_ops,
                    "orphan_ops": p.orphan_ops,
                    "profiler_steps": p.profiler_steps,
                    "unmatched": [list(u) for u in p.unmatched[:10]],
                    "orphans": [list(o) for o in p.orphans[:10]],
                    "notes": p.notes,
                }
                for p in report.pairs
            ],
        }
        self.save_manifest()
        return report

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The capture as the dashboard (a widget in a kernel) with a ``text/plain`` fallback.

        ``text/plain`` always starts with the capture's status, steps, files and notes
        (a partial or failed capture says so first), then the dashboard's text summary.
        A capture that wrote no trace shows only that (no dashboard). Never raises: when
        the trace cannot be loaded or drawn, the text says why instead. Only the MIME types
        ``include`` names (all when None), none that ``exclude`` names.
        """
        from tracemagic.views import bundle as _bundle

        body: list[str] = []
        bundle: dict[str, Any] = {}
        if self.has_trace:
            try:
                bundle = dict(self.dashboard._repr_mimebundle_(include, exclude))
                body = ["", bundle.get(_bundle.TEXT_MIME, "")]
            except Exception as exc:  # noqa: BLE001 - a display must never raise; say why instead
                _log.debug("the dashboard failed", exc_info=True)
                bundle = {}
                body = [f"  dashboard unavailable ({type(exc).__name__}: {exc})"]
        if _bundle.wanted(_bundle.TEXT_MIME, include, exclude):
            bundle[_bundle.TEXT_MIME] = "\n".join(self._header_lines() + self._note_lines() + body)
        return _bundle.select(bundle, include, exclude)
