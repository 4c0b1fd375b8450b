"""The ``Trace``: one loaded trace (all its ranks) and the analyses over it.

``trace.events`` is the normalized table every analysis reads; each analysis is a
``Trace`` method returning a DataFrame (times in µs) and lives in ``tracemagic.analysis``.
"""

from __future__ import annotations

import os
from functools import cached_property
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, TypeVar

import pandas as pd

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.analysis.devices import DevicePeaks

#: The events table: one row per duration (``X``) or instant (``i``) event, all ranks.
#:
#: ``rank`` int32; ``kind`` normalized category (see ``normalize.KINDS``); ``cat``, ``name``,
#: ``ph``, ``pid``, ``tid`` categoricals as written; ``ts`` start in µs on the trace's own
#: clock; ``dur`` µs (0 for instants); ``self_dur`` µs minus nested CPU events; ``parent``,
#: ``depth`` nesting on the CPU thread; ``step`` ProfilerStep number (-1 outside steps;
#: GPU events take their launch's step); ``launch`` row of the runtime call that launched a
#: GPU event; ``op`` row of the enclosing/launching CPU op; ``module`` row of the innermost
#: ``nn.Module`` event around it. Row columns hold positions in this table, -1 for none.
#: Nullable args: ``external_id``, ``correlation``, ``device``, ``stream``, ``rf_id``,
#: ``seq``, ``fwd_tid``, ``python_id``, ``python_parent_id``, ``bytes`` (memcpy/memset
#: size, or a ``[memory]`` event's signed delta), ``total_allocated``, ``total_reserved``,
#: ``device_type``, ``addr``, ``flops``, ``group_size``, ``in_nelems``, ``out_nelems``;
#: strings ``collective``, ``pg_name``, ``dtype``, ``input_dims``, ``input_type``,
#: ``concrete_inputs`` (``Concrete Inputs``: the op's scalar and list arguments, one string
#: per argument, ``''`` for tensors and None), ``grid``, ``block``, ``pg_ranks`` (JSON text
#: as written).
EVENT_COLUMNS_DOC = __doc__
T = TypeVar("T")


class Trace:
    """A loaded Kineto trace: the normalized events of every rank plus metadata.

    Attributes:
        events: the events table (see ``tracemagic.trace.model`` for its columns).
        flows: flow events (``rank``, ``ph``, ``cat``, ``id``, ``pid``, ``tid``, ``ts``).
        meta: ``ranks`` {rank: trace metadata}, ``processes``, ``threads``, ``warnings``.
        path: where it was loaded from.
        manifest: ``capture.json`` of a capture directory, else None.
    """

    def __init__(
        self,
        events: pd.DataFrame,
        flows: pd.DataFrame,
        meta: dict[str, Any],
        *,
        path: Path | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> None:
        self.events = events
        self.flows = flows
        self.meta = meta
        self.path = path
        self.manifest = manifest
        self._shared: dict[Hashable, Any] = {}

    # -- facts -------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """The ranks present, ascending."""
        return sorted(int(r) for r in self.meta.get("ranks", {0: {}}))

    @property
    def devices(self) -> list[dict[str, Any]]:
        """GPU devices named in the trace metadata (first rank's), possibly empty."""
        for rank in self.ranks:
            devices = self.meta["ranks"][rank].get("devices") or []
            if devices:
                return devices
        return []

    @cached_property
    def has_gpu(self) -> bool:
        """Whether any kernel, memcpy or memset was recorded."""
        return bool(self.events["kind"].isin(("kernel", "memcpy", "memset")).any())

    @property
    def warnings(self) -> list[str]:
        """What the loader had to repair or convert."""
        return list(self.meta.get("warnings", []))

    @property
    def module_names(self) -> dict[str, dict[str, str]]:
        """Trace module names (``nn.Module: Linear_0``) -> {path, type}, from the capture."""
        if not self.manifest:
            return {}
        return dict(self.manifest.get("modules") or {})

    def __repr__(self) -> str:
        kinds = self.events["kind"].value_counts()
        parts = ", ".join(f"{int(kinds[k])} {k}" for k in ("cpu_op", "kernel", "memory", "step") if kinds.get(k, 0))
        where = f" from {self.path}" if self.path else ""
        return f"<Trace{where}: {len(self.ranks)} rank(s), {parts or 'no events'}>"

    # -- analyses (DataFrame out, see tracemagic.analysis) ---------------------------------
    def shared(self, key: Hashable, compute: Callable[[], T]) -> T:
        """A result computed once per trace: the tables, and intermediates several analyses
        use (layer attribution, the ops around memory events); treat it as read-only."""
        if key not in self._shared:
            self._shared[key] = compute()
        value: T = self._shared[key]
        return value

    def _analysis(self, module: str, function: str, *args: Any, **kwargs: Any) -> pd.DataFrame:
        fn = getattr(import_module(f"tracemagic.analysis.{module}"), function)
        key = (module, function, args, tuple(sorted(kwargs.items())))
        return self.shared(key, lambda: fn(self, *args, **kwargs)).copy()

    def ops(self) -> pd.DataFrame:
        """Every CPU op and annotation (see ``tracemagic.analysis.ops``)."""
        return self._analysis("ops", "ops")

    def kernels(self) -> pd.DataFrame:
        """GPU kernels, memcpy and memset with their launching op and layer."""
        return self._analysis("kernels", "kernels")

    def layers(self, step: int | None = None) -> pd.DataFrame:
        """The per-layer (nn.Module instance) table (of one ProfilerStep, given ``step``)."""
        return self._analysis("layers", "layers") if step is None else self._analysis("layers", "layers", step)

    def memory(self) -> pd.DataFrame:
        """The memory timeline per device."""
        return self._analysis("memory", "memory")

    def memory_peaks(self) -> pd.DataFrame:
        """Peak allocated bytes per device and step, with the op and layer that reached it."""
        return self._analysis("memory", "peaks")

    def biggest_allocations(self, n: int | None = 10) -> pd.DataFrame:
        """The ``n`` largest allocations with their op, layer and lifetime."""
        return self._analysis("memory", "biggest_allocations", n)

    def memory_categories(self) -> pd.DataFrame:
        """Memory over time stacked by category (parameter, gradient, activation, ...);
        empty unless the capture recorded ``memory_timeline_<rank>.json``."""
        return self._analysis("memory", "categories")

    def shapes(self) -> pd.DataFrame:
        """Op x input shapes x dtypes with calls, time and FLOPs."""
        return self._analysis("shapes", "shapes")

    def efficiency(self, peaks: "Mapping[str, float] | DevicePeaks | None" = None) -> pd.DataFrame:
        """Op x shapes x dtypes against the device's roofline: FLOPs, bytes, achieved
        TFLOP/s and TB/s, compute- or memory-bound, % of the roof (``peaks``: the device's
        own, see ``tracemagic.analysis.efficiency``)."""
        if peaks is None:
            return self._analysis("efficiency", "efficiency")
        from tracemagic.analysis.efficiency import efficiency

        return efficiency(self, peaks)

    def steps(self) -> pd.DataFrame:
        """One row per ProfilerStep (per rank) with its time breakdown."""
        return self._analysis("steps", "steps")

    def ranks_table(self) -> pd.DataFrame:
        """Per-rank step time, compute, communication and idle; slowest rank marked."""
        return self._analysis("ranks", "ranks")

    def collectives(self) -> pd.DataFrame:
        """Collectives matched across ranks (same collective, same step) with each rank's wait."""
        return self._analysis("ranks", "collectives")

    def stragglers(self) -> pd.DataFrame:
        """The rank the others waited for, per step."""
        return self._analysis("ranks", "stragglers")

    def diff(self, other: "Trace") -> pd.DataFrame:
        """This trace compared with ``other`` op by op and layer by layer."""
        from tracemagic.analysis.diff import diff

        return diff(self, other)

    # -- outputs (thin, lazily imported conveniences) ------------------------------------
    def report(self, path: str | os.PathLike[str], other: "Trace | None" = None) -> Path:
        """Write the self-contained HTML report (``tracemagic.views.report.write_report``).

        Args:
            path: the ``.html`` file to write (its folder is created).
            other: a second trace: adds the Compare section (this trace is A).

        Returns:
            The path written.
        """
        # The one place the model imports a view: a lazy, thin convenience so that
        # ``trace.report(...)`` works; the model itself never draws.
        from tracemagic.views.report import write_report

        return write_report(self, path, other=other)

    def to_pfw(self, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """Write the events as DFTracer ``.pfw``/``.pfw.gz`` (``tracemagic.export.dftracer.to_pfw``)."""
        from tracemagic.export.dftracer import to_pfw

        return to_pfw(self, path, **kwargs)

    def to_chrome_trace(
        self, path: str | os.PathLike[str], steps: Any = None, **kwargs: Any
    ) -> list[Path]:
        """Write a trimmed Chrome/Perfetto trace per rank, e.g. only some steps of a trace
        too large for the viewers (``tracemagic.export.chrome.to_chrome_trace``)."""
        from tracemagic.export.chrome import to_chrome_trace

        return to_chrome_trace(self, path, steps=steps, **kwargs)
