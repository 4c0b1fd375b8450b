"""``TraceData``: the analyses' tables of one trace, fetched once and shared by the views.

A view never fails as a whole because one analysis did: a table that raises becomes an
empty table with the contract's columns, and the error is kept in ``problems`` so the
view can say what is missing.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tracemagic.analysis import aggregate as _aggregate
from tracemagic.analysis import diff as _diff
from tracemagic.analysis import efficiency as _efficiency
from tracemagic.analysis import layers as _layers
from tracemagic.analysis import lines as _lines
from tracemagic.analysis import memory as _memory
from tracemagic.analysis import phases as _phases
from tracemagic.analysis import sites as _sites
from tracemagic.analysis.schema import TABLES

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace import TraceTables

_log = logging.getLogger(__name__)

#: the analyses behind the tables, by table name (``analysis.schema.TABLES``: each table's
#: ``Table.function``; computed with ``trace.table``: once per trace, shared with
#: ``tracemagic.Trace``'s methods of the same names)
ANALYSES: dict[str, Callable[..., pd.DataFrame]] = {t.name: t.function for t in TABLES.values() if t.method}


def empty_table(name: str) -> pd.DataFrame:
    """An empty stand-in for the table ``name``: its contract's columns and dtypes
    (``tracemagic.analysis.schema``), no columns for a table without one."""
    table = TABLES.get(name)
    return table.empty() if table is not None else pd.DataFrame()


def _insert_after(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """``table`` with its ``where`` column moved right after ``column`` (text, '' for none)."""
    where = table["where"].astype("string").fillna("").astype("str")
    out = table.drop(columns=["where"])
    at = list(out.columns).index(column) + 1 if column in out.columns else len(out.columns)
    out.insert(at, "where", where)
    return out


def _where_of_rows(trace: TraceTables, rows: Any) -> Any:
    """The ``where`` text of each events row (``analysis.sites``; '' for none or row -1)."""
    rows = np.asarray(rows, dtype=np.int64)
    code = _sites.site_of_rows(trace, np.maximum(rows, 0))
    labels = np.append(_sites.site_codes(trace)[1]["where"].to_numpy(dtype=object), "")
    return pd.array(labels[np.where((rows >= 0) & (code >= 0), code, -1)], dtype="str")


class TraceData:
    """Lazily computed analysis tables of one ``Trace`` (each computed at most once).

    Args:
        trace: the loaded trace.
        name: a display name (default: the trace's file name).
    """

    def __init__(self, trace: TraceTables, name: str | None = None) -> None:
        self.trace = trace
        self.name = name or (Path(str(trace.path)).name if getattr(trace, "path", None) else "trace")
        self.problems: dict[str, str] = {}
        self._tables: dict[str, pd.DataFrame] = {}

    def table(self, name: str, *args: Any, compute: Callable[[], pd.DataFrame] | None = None) -> pd.DataFrame:
        """The analysis ``name`` (of ``ANALYSES``, or ``compute()``), or an empty stand-in
        if it failed."""
        key = name if not args else f"{name}:{id(args[0])}"
        if key not in self._tables:
            try:
                frame = compute() if compute is not None else self._analysis(name, *args)
            except Exception as exc:  # noqa: BLE001 - one analysis must not take the view down
                self.problems[name] = f"{type(exc).__name__}: {exc}"
                _log.debug("the %s analysis failed", name, exc_info=True)
                warnings.warn(f"tracemagic: the {name} analysis failed ({exc}); its view is empty", stacklevel=2)
                frame = empty_table(name.split(":")[0])
            self._tables[key] = frame
        return self._tables[key]

    def _analysis(self, name: str, *args: Any) -> pd.DataFrame:
        """``ANALYSES[name]`` of the trace, computed once per trace (``Trace.table``); a job's
        summarized ranks (``tracemagic.load_ranks``) compute their own cross-rank tables."""
        if self.summaries_only:
            frame: pd.DataFrame = getattr(self.trace, name)(*args)
            return frame
        return self.trace.table(ANALYSES[name], *args)

    @property
    def steps(self) -> pd.DataFrame:
        """``trace.steps()`` less the steps that hold only the loop's exit or that the cell's
        error cut short (:attr:`loop_exit_steps`): they are not whole steps of the loop."""
        return _aggregate.loop_steps(self.table("steps"), getattr(self.trace, "manifest", None))

    @property
    def iterations(self) -> pd.DataFrame:
        """Every iteration of a ``%%chakra_trace`` loop (``trace.iterations()``; empty for
        other traces)."""
        return self.table("iterations")

    @cached_property
    def loop_exit_steps(self) -> list[int]:
        """The ProfilerSteps a ``%%chakra_trace`` capture marks as holding only the loop's
        exit or cut short by the cell's error (``aggregate.uncounted_steps``); empty for
        other traces."""
        return list(self.uncounted_steps)

    @cached_property
    def uncounted_steps(self) -> dict[int, str]:
        """:attr:`loop_exit_steps` with how each ended (``loop_exit`` | ``error``)."""
        return _aggregate.uncounted_steps(getattr(self.trace, "manifest", None))

    @property
    def phases(self) -> pd.DataFrame:
        """``trace.phases()``: per step, data loading, forward, backward, optimizer and other."""
        return self.table("phases")

    @property
    def ops(self) -> pd.DataFrame:
        """``trace.ops()``."""
        return self.table("ops")

    @property
    def kernels(self) -> pd.DataFrame:
        """``trace.kernels()`` (empty without a GPU)."""
        if not self.has_gpu:
            return empty_table("kernels")
        return self.table("kernels")

    @property
    def layers(self) -> pd.DataFrame:
        """``trace.layers()``."""
        return self.table("layers")

    @property
    def memory(self) -> pd.DataFrame:
        """``trace.memory()``."""
        return self.table("memory")

    @property
    def memory_peaks(self) -> pd.DataFrame:
        """``trace.memory_peaks()``: per device, each step's and the whole trace's peak."""
        return self.table("memory_peaks")

    @property
    def allocations(self) -> pd.DataFrame:
        """``trace.biggest_allocations(None)``: every allocation, largest first."""
        return self.table("biggest_allocations", compute=lambda: self.trace.table(_memory.biggest_allocations, None))

    def layers_in(self, step: int | None) -> pd.DataFrame:
        """``trace.layers(step)``: the layers table of one step (all steps for None)."""
        if step is None:
            return self.layers
        return self.table(f"layers:step {step}", compute=lambda: self.trace.table(_layers.layers, step))

    @cached_property
    def has_line_marks(self) -> bool:
        """Whether the trace holds a ``%%chakra_trace`` cell's line marks (the Source tab)."""
        try:
            return bool(_lines.marks(self.trace)[1].size) if not self.summaries_only else False
        except Exception:  # noqa: BLE001 - no Source tab rather than no dashboard
            return False

    @property
    def lines(self) -> pd.DataFrame:
        """``trace.lines()``: per line of the cell (empty without line marks)."""
        return self.table("lines")

    @property
    def cell_lines(self) -> dict[int, str]:
        """The captured cell's text by line (the ``%%chakra_trace`` line is 1); empty without a manifest."""
        return _lines.cell_lines(self.trace)

    @property
    def shapes(self) -> pd.DataFrame:
        """``trace.shapes()``."""
        return self.table("shapes")

    @property
    def source(self) -> pd.DataFrame:
        """``trace.source()``: per Python function (or call-site line) of the trace."""
        return self.table("source")

    @property
    def cells(self) -> dict[str, int]:
        """Notebook cells' files -> execution counts (``trace.cell_numbers``: a capture's)."""
        return dict(getattr(self.trace, "cell_numbers", None) or {})

    def call_tree(self, user_only: bool = False) -> pd.DataFrame:
        """``trace.call_tree(user_only)``."""
        return self.table(
            f"call_tree:{user_only}", compute=lambda: self.trace.table(TABLES["call_tree"].function, user_only)
        )

    # -- "where (code)": the user code behind each row (``analysis.sites``), joined here only
    # when a view shows it, never inside the tables themselves
    def _where(self, name: str, compute: Callable[[], pd.DataFrame], plain: Callable[[], pd.DataFrame]) -> pd.DataFrame:
        """A table with its ``where`` column (``compute``), or as it was (``plain``) if the sites
        failed: the view loses a column, not its table (the error is in ``problems``)."""

        def guarded() -> pd.DataFrame:
            try:
                return compute()
            except Exception as exc:  # noqa: BLE001 - the table without its where column
                self.problems[f"where:{name}"] = f"{type(exc).__name__}: {exc}"
                _log.debug("the where column of %s failed", name, exc_info=True)
                return plain()

        return self.table(f"where:{name}", compute=guarded)

    @property
    def can_place(self) -> bool:
        """Whether the trace's events are here to find sites in (not a job's summaries)."""
        return hasattr(self.trace, "events") and not self.summaries_only

    def kernel_table(self, kernels: pd.DataFrame) -> pd.DataFrame:
        """``top_kernels(kernels, by_op=True)`` with ``where``: per kernel + launching op, the
        user code that launched its calls (most GPU time first, ``analysis.sites``)."""
        table = _aggregate.top_kernels(kernels, by_op=True)
        if not self.can_place or kernels.empty:
            return table
        try:
            return self._kernel_where(kernels, table)
        except Exception as exc:  # noqa: BLE001 - the table without its where column
            self.problems["where:kernels"] = f"{type(exc).__name__}: {exc}"
            _log.debug("the where column of the kernels failed", exc_info=True)
            return table

    def _kernel_where(self, kernels: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
        """``table`` with ``where`` (and, for ``torch.compile`` kernels, ``kernel_file`` and
        ``compiled_region``, the first of each kernel + op)."""
        keys = pd.DataFrame(
            {
                "name": kernels["name"].astype(str).to_numpy(),
                "op": kernels["op"].astype("string").fillna("").astype(str).to_numpy(),
            }
        )
        rows = kernels["row"].to_numpy()
        found = _sites.where_by(self.trace, rows, keys, kernels["dur"].to_numpy(dtype=float))
        out = _insert_after(table.merge(found, on=["name", "op"], how="left"), "op")
        kernel_file, region = _sites.compiled_of_rows(self.trace, rows)
        if any(v is not None for v in kernel_file) or any(v is not None for v in region):
            # torch.compile: the generated source of a Triton kernel, and its compiled region
            compiled = (
                keys.assign(kernel_file=kernel_file, compiled_region=region)
                .groupby(["name", "op"], sort=False)
                .first()
                .reset_index()
            )
            out = out.merge(compiled, on=["name", "op"], how="left")
            at = list(out.columns).index("where") + 1
            out = out[
                [
                    *out.columns[:at],
                    "kernel_file",
                    "compiled_region",
                    *[c for c in out.columns[at:] if c not in ("kernel_file", "compiled_region")],
                ]
            ]
            out = out.astype({"kernel_file": "str", "compiled_region": "str"})
        return out

    def shapes_where(self) -> pd.DataFrame:
        """``shapes()`` with ``where``: the user code that called each op × shapes row."""

        def compute() -> pd.DataFrame:
            keys = ["rank", "name", "input_dims", "input_type", "concrete_inputs"]
            return self._keyed_where(self.shapes, keys, _sites.chain_tops(self.trace), after="concrete_inputs")

        return self._where("shapes", compute, lambda: self.shapes) if self.can_place else self.shapes

    def efficiency_where(self) -> pd.DataFrame:
        """``efficiency()`` with ``where`` (and ``attrs['where']`` for the roofline's hover)."""

        def compute() -> pd.DataFrame:
            # a row per precision too (autocast's calls apart from plain ones): each chain
            # is keyed by the precision it is counted under, so a row lists its own sites
            tops, precision = _efficiency.chain_precisions(self.trace)
            keys = ["rank", "name", "input_dims", "input_type", "precision"]
            out = self._keyed_where(  # (the dtypes, what they ran in, where)
                self.efficiency, keys, tops, after="precision", given={"precision": precision}
            )
            out.attrs = {**self.efficiency.attrs, "where": out["where"].fillna("").astype(str).tolist()}
            return out

        return self._where("efficiency", compute, lambda: self.efficiency) if self.can_place else self.efficiency

    def _keyed_where(
        self,
        table: pd.DataFrame,
        keys: list[str],
        tops: np.ndarray,
        after: str,
        given: dict[str, np.ndarray] | None = None,
    ) -> pd.DataFrame:
        """``table`` (rows keyed by the call chains' top op's ``keys``) with ``where``, the
        sites of the top ops ``tops`` of its row, most host time first. A key is the top's
        events column, or the values ``given`` for it (one per top)."""
        if table.empty:
            return table.assign(where=pd.Series(dtype="str"))
        events = self.trace.events
        given = given or {}

        def column(k: str) -> Any:
            if k in given:
                values = given[k]
            elif k == "rank":
                return events[k].to_numpy()[tops]
            else:
                values = events[k].array[tops]
            return pd.array(np.asarray(values, dtype=object), dtype="str")

        frame = pd.DataFrame({k: column(k) for k in keys})
        found = _sites.where_by(self.trace, tops, frame, events["dur"].to_numpy()[tops])
        typed = table[keys].astype({k: "str" for k in keys if k != "rank"})
        merged = typed.merge(found, on=keys, how="left")
        return _insert_after(table.assign(where=merged["where"].to_numpy()), after)

    def allocations_where(self) -> pd.DataFrame:
        """:attr:`allocations` with ``where``: the user code that allocated each block."""

        def compute() -> pd.DataFrame:
            allocations, memory = self.allocations, self.memory
            if allocations.empty or memory.empty:
                return allocations.assign(where=pd.Series(dtype="str"))
            made = memory[memory["delta_bytes"] > 0]
            keys = ["rank", "device", "ts", "addr", "bytes"]
            found = (
                made.rename(columns={"delta_bytes": "bytes"})[keys]
                .assign(where=_where_of_rows(self.trace, made["row"].to_numpy()))
                .drop_duplicates(keys)
            )
            return _insert_after(allocations.merge(found, on=keys, how="left"), "layer")

        return self._where("allocations", compute, lambda: self.allocations) if self.can_place else self.allocations

    def memory_peaks_where(self) -> pd.DataFrame:
        """``memory_peaks()`` with ``where``: the user code of the event that reached each peak."""

        def compute() -> pd.DataFrame:
            peaks, memory = self.memory_peaks, self.memory
            if peaks.empty or memory.empty:
                return peaks.assign(where=pd.Series(dtype="str"))
            keys = ["rank", "device", "ts"]
            at = memory.rename(columns={"allocated_bytes": "peak_bytes"})[[*keys, "peak_bytes", "row"]]
            at = at.drop_duplicates([*keys, "peak_bytes"])
            merged = peaks[[*keys, "peak_bytes"]].merge(at, on=[*keys, "peak_bytes"], how="left")
            rows = merged["row"].fillna(-1).to_numpy(dtype="int64")
            return peaks.assign(where=_where_of_rows(self.trace, rows))

        return self._where("memory_peaks", compute, lambda: self.memory_peaks) if self.can_place else self.memory_peaks

    @property
    def efficiency(self) -> pd.DataFrame:
        """``trace.efficiency()`` (the roofline per op × shape)."""
        return self.table("efficiency")

    @property
    def ranks(self) -> pd.DataFrame:
        """``trace.ranks()``."""
        return self.table("ranks")

    @property
    def memory_categories(self) -> pd.DataFrame:
        """``trace.memory_categories()`` (empty unless the capture wrote a memory timeline)."""
        return self.table("memory_categories")

    @property
    def layer_spans(self) -> pd.DataFrame:
        """Forward/backward time spans of the top-level layers (``analysis.spans.layer_spans``)."""

        def compute() -> pd.DataFrame:
            from tracemagic.analysis.spans import layer_spans

            return layer_spans(self.trace)

        if not hasattr(self.trace, "events"):
            return empty_table("layer_spans")
        return self.table("layer_spans", compute=compute)

    @property
    def phase_spans(self) -> pd.DataFrame:
        """The host phases as time intervals (``analysis.phases.phase_spans``): the Timeline's phases lane."""
        if not hasattr(self.trace, "events"):
            return empty_table("phase_spans")
        return self.table("phase_spans", compute=lambda: self.trace.table(_phases.phase_spans))

    @cached_property
    def has_et(self) -> bool:
        """Whether an Execution Trace lies next to the trace under a matching name
        (``trace.artifacts.has_et``): the Graph tab shows then."""
        artifacts = getattr(self.trace, "artifacts", None)  # none for a job's summarized ranks
        return bool(artifacts is not None and artifacts.has_et)

    def et_graph(self, step: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The Execution Trace's op graph (``tracemagic.analysis.et_graph.et_graph``), read once for
        all steps and cut to ``step`` here (an edge is kept when both its ops are; with one
        ET per cycle, whose ids repeat, the step's own graph is asked for instead)."""

        def compute() -> pd.DataFrame:
            from tracemagic.analysis.et_graph import et_graph

            nodes, edges = et_graph(self.trace)
            self._tables["et_edges"] = edges
            return nodes

        nodes = self.table("et_graph", compute=compute)
        edges = self._tables.get("et_edges", empty_table("et_edges"))
        if nodes.empty:
            return empty_table("et_graph"), empty_table("et_edges")
        if step is not None and nodes["id"].duplicated().any():  # one ET per cycle

            def one_step() -> pd.DataFrame:
                from tracemagic.analysis.et_graph import et_graph

                nodes, edges = et_graph(self.trace, step=step)
                self._tables[f"et_edges#{step}"] = edges
                return nodes

            nodes = self.table(f"et_graph#{step}", compute=one_step)
            edges = self._tables.get(f"et_edges#{step}", empty_table("et_edges"))
            if nodes.empty:
                return empty_table("et_graph"), empty_table("et_edges")
            return nodes.reset_index(drop=True), edges.reset_index(drop=True)
        if step is not None:
            nodes = nodes[nodes["step"] == step]
            ids = set(nodes["id"].tolist())
            edges = edges[edges["src"].isin(ids) & edges["dst"].isin(ids)]
        return nodes.reset_index(drop=True), edges.reset_index(drop=True)

    @property
    def et_steps(self) -> list[int]:
        """The ProfilerSteps the Execution Trace covers (ascending; empty without steps)."""
        nodes, _ = self.et_graph()
        return sorted({int(s) for s in nodes["step"] if int(s) >= 0}) if not nodes.empty else []

    def diff(self, other: TraceData) -> pd.DataFrame:
        """``trace.diff(other.trace)``."""
        return self.table(f"diff:{id(other.trace)}", compute=lambda: _diff.diff(self.trace, other.trace))

    @cached_property
    def has_gpu(self) -> bool:
        """Whether the trace recorded GPU work."""
        return bool(getattr(self.trace, "has_gpu", False))

    @cached_property
    def rank_ids(self) -> list[int]:
        """The ranks present (``trace.rank_ids``)."""
        return list(getattr(self.trace, "rank_ids", [0]))

    @cached_property
    def summaries_only(self) -> bool:
        """Whether the trace is a job's ranks summarized (``tracemagic.load_ranks``): only
        the cross-rank tables, no events."""
        return bool(getattr(self.trace, "summaries_only", False))

    @property
    def several_ranks(self) -> bool:
        """More than one rank."""
        return len(self.rank_ids) > 1

    @cached_property
    def step_ids(self) -> list[int]:
        """The ProfilerStep numbers present (any rank), ascending."""
        steps = self.steps
        return sorted({int(s) for s in steps["step"]}) if not steps.empty else []

    @cached_property
    def thread_names(self) -> dict[tuple[int, str], str]:
        """(rank, thread id) -> the name the trace metadata gives it (``thread 12 (pt_main_thread)``)."""
        out: dict[tuple[int, str], str] = {}
        for rank, threads in (self.trace.meta.get("threads") or {}).items() if hasattr(self.trace, "meta") else ():
            for key, name in (threads or {}).items():
                tid = str(key).rsplit("/", 1)[-1]
                if name and str(name).strip():
                    out[(int(rank), tid)] = str(name).strip()
        return out

    @cached_property
    def devices(self) -> list[str]:
        """Device names: the GPUs from the trace metadata, else ``CPU``."""
        names = [str(d.get("name") or f"GPU {d.get('id', '?')}") for d in getattr(self.trace, "devices", []) or []]
        if names:
            return names
        return ["GPU"] if self.has_gpu else ["CPU"]
