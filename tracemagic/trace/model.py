"""``TraceTables``: the data of one loaded trace (all its ranks), its metadata and artifacts.

``trace.events`` is the normalized table every analysis reads. This class holds data only;
the methods users call (``trace.steps()``, ``trace.report(...)``) are those of
``tracemagic.facade.Trace``, a subclass above every layer (``tracemagic.load`` returns it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from tracemagic.trace.artifacts import Artifacts
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.normalize import kind_mask

#: The events table: one row per duration (``X``) or instant (``i``) event, all ranks.
#:
#: ``rank`` int32; ``kind`` normalized category (see ``kineto.KINDS``); ``cat``, ``name``,
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
#: strings ``collective``, ``pg_name``, ``dtype``, ``call_stack`` (old traces' ``Call stack``,
#: ``file(LINE): func;...`` innermost first), ``kernel_file`` (the Python file Inductor generated
#: for a Triton kernel, on the op that launches it), ``input_dims``, ``input_type``,
#: ``concrete_inputs`` (``Concrete Inputs``: the op's scalar and list arguments, one string
#: per argument, ``''`` for tensors and None), ``grid``, ``block``, ``pg_ranks`` (JSON text
#: as written).
EVENT_COLUMNS_DOC = __doc__
T = TypeVar("T")
TraceT = TypeVar("TraceT", bound="TraceTables")


class _Lifetime:
    """A token held by a trace and its ``TraceTables.of`` copies (``weakref.finalize`` on it)."""


class TraceTables:
    """A loaded Kineto trace: the normalized events of every rank plus metadata (data
    only: ``tracemagic.Trace`` adds the analyses and outputs).

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
        if events.columns.dtype != object:
            # its column labels as Python strings: pandas 3 keeps string labels in an
            # Arrow-backed "str" index, whose label read is ~15 µs of every events[name]
            # (~35 -> ~20 µs a read; the six main tables read ~170 columns)
            events.columns = events.columns.astype(object)  # (in place: the table store knows this frame)
        self.events = events
        self.flows = flows
        self.meta = meta
        self.path = path
        self.manifest = manifest
        self._shared: dict[Hashable, Any] = {}
        #: where the tables named in ``STORED`` are kept between sessions (set by ``load``
        #: for a cached trace: ``cache.TableStore``), else None; not used once ``events``
        #: is replaced (edits in place are not seen: load with ``use_cache=False`` for that)
        self.store: Any = None
        #: shared by this trace and its ``of`` copies: when the last of them is dropped,
        #: what waits for that runs (``load`` writes a freshly parsed trace's cache entry then)
        self.lifetime: object = _Lifetime()

    # -- facts -------------------------------------------------------------------------
    @property
    def rank_ids(self) -> list[int]:
        """The ranks present, ascending (``trace.ranks()`` is the per-rank table)."""
        return sorted(int(r) for r in self.meta.get("ranks", {0: {}}))

    @property
    def devices(self) -> list[dict[str, Any]]:
        """GPU devices named in the trace metadata (first rank's), possibly empty."""
        for rank in self.rank_ids:
            devices = self.meta["ranks"][rank].get("devices") or []
            if devices:
                return devices
        return []

    @cached_property
    def has_gpu(self) -> bool:
        """Whether any kernel, memcpy or memset was recorded."""
        return bool(kind_mask(self.events, *GPU_ACTIVITY).any())

    @property
    def warnings(self) -> list[str]:
        """What the loader had to repair or convert."""
        return list(self.meta.get("warnings", []))

    @cached_property
    def artifacts(self) -> Artifacts:
        """The Execution Traces and memory timelines beside the trace's files (read on
        first use, then kept): what the analyses read instead of opening files."""
        return Artifacts(self.path)

    @property
    def module_names(self) -> dict[str, dict[str, str]]:
        """Trace module names (``nn.Module: Linear_0``) -> {path, type}, from the capture."""
        if not self.manifest:
            return {}
        return dict(self.manifest.get("modules") or {})

    @property
    def cell_numbers(self) -> dict[str, int]:
        """Notebook cells' files (``/tmp/ipykernel_<pid>/<hash>.py``) -> their execution
        count (``Cell In[3]`` in a traceback), from the capture; empty elsewhere."""
        cells = self.manifest.get("cells") if self.manifest else None
        if not isinstance(cells, dict):
            return {}
        return {str(f): n for f, n in cells.items() if isinstance(n, int) and not isinstance(n, bool)}

    def __repr__(self) -> str:
        kinds = self.events["kind"].value_counts()
        parts = ", ".join(f"{int(kinds[k])} {k}" for k in ("cpu_op", "kernel", "memory", "step") if kinds.get(k, 0))
        where = f" from {self.path}" if self.path else ""
        return f"<Trace{where}: {len(self.rank_ids)} rank(s), {parts or 'no events'}>"

    # -- the shared cache --------------------------------------------------------------
    def shared(self, key: Hashable, compute: Callable[[], T]) -> T:
        """A result computed once per trace: the tables, and intermediates several analyses
        use (layer attribution, the ops around memory events); treat it as read-only."""
        if key not in self._shared:
            self._shared[key] = compute()
        value: T = self._shared[key]
        return value

    #: the analyses (``module.function``) whose tables, called without arguments, are kept
    #: in the trace's cache (``tracemagic.trace.cache.TableStore``), so reopening the trace
    #: gives them without computing them again; the facade names them
    STORED: frozenset[str] = frozenset()

    def table(self, function: Callable[..., pd.DataFrame], *args: Any, **kwargs: Any) -> pd.DataFrame:
        """``function(self, *args, **kwargs)`` (an analysis), computed once per trace (or
        read from the trace's cache, see ``STORED``) and returned as a copy: the caller may
        change it freely. The copy is shallow: pandas' copy-on-write (always on from pandas
        3) copies a column only when either frame changes it, so handing out a table costs
        neither the time nor the memory of copying it (``attrs`` are still deep-copied)."""
        module = function.__module__.rsplit(".", 1)[-1]
        key = (module, function.__name__, args, tuple(sorted(kwargs.items())))
        name = f"{module}.{function.__name__}"
        if (
            self.store is None
            or args
            or kwargs
            or name not in self.STORED
            or key in self._shared
            or self.store.events is not self.events
        ):
            return self.shared(key, lambda: function(self, *args, **kwargs)).copy(deep=False)

        def stored() -> pd.DataFrame:
            frame = self.store.get(name)
            if frame is None:
                frame = function(self)
                self.store.put_later(name, frame, self)  # written when this trace is dropped: the caller does not wait
            return frame

        return self.shared(key, stored).copy(deep=False)

    @classmethod
    def of(cls: type[TraceT], trace: TraceTables) -> TraceT:
        """``trace`` as an instance of ``cls`` (the facade ``tracemagic.Trace``), made by its
        constructor from the same tables and metadata, sharing the cache of computed tables and
        the table store (nothing copied)."""
        if type(trace) is cls:
            return trace
        new = cls(trace.events, trace.flows, trace.meta, path=trace.path, manifest=trace.manifest)
        new._shared = trace._shared  # one cache of computed tables for both
        new.store = trace.store
        new.lifetime = trace.lifetime
        return new
