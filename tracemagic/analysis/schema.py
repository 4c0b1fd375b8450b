"""The column contract of every analysis table, in one machine-readable place.

Each table's columns are an ordered mapping column -> (dtype, meaning). Everything else
derives from it: the contract section of ``tracemagic.analysis``' docstring
(:func:`describe`), the empty stand-in tables the views show when an analysis fails
(:meth:`Table.empty`), and the tests that check real tables have exactly these columns,
in this order, with these dtypes' kinds.

It is also the one registry of the analyses: each ``Table`` names the function computing it
(``Table.function``: the analysis marked ``@computes("name")``); ``tracemagic.Trace``'s methods
and the views' tables (``views.data.ANALYSES``) are checked against it by
``tests/test_registry.py``. A new table is three things: its ``Table`` in ``_TABLES`` below,
``@computes("name")`` on its function, and a ``tracemagic.Trace`` method ``name`` returning
``self.table(function)`` (or ``method=False`` on the ``Table`` for a views-only table).

Dtypes are those of a non-empty table (pandas 3): ``str`` text, ``category`` text kept as
categoricals (the per-event tables), ``Int64``/``Float64`` nullable numbers (NA where not
recorded). A column may come with another dtype of the same kind (:func:`kind`: an
integer column holding NA becomes ``Int64``, a text column ``object`` when empty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

#: the dtypes a schema may name, by kind
KINDS: dict[str, str] = {
    "int32": "int",
    "int64": "int",
    "Int64": "int",
    "float64": "float",
    "Float64": "float",
    "bool": "bool",
    "str": "text",
    "category": "text",
}

_RANK = ("int32", "rank (0 for single-rank traces)")
_ROW = ("int64", "position in ``trace.events``")
_TS = ("float64", "start, µs since the trace's start")
_STEP = ("int64", "ProfilerStep number, -1 outside steps")


@dataclass(frozen=True)
class Table:
    """One analysis table's contract.

    Attributes:
        name: the table's key (``ops``, ``ranks``, ``et_graph`` ...): the name of the
            ``tracemagic.Trace`` method that returns it (where ``method``).
        call: how users get it (``ops()``).
        columns: column -> (dtype, one-line meaning), in the table's order.
        note: what the table holds beyond its columns (rows, ``attrs``).
        method: whether ``tracemagic.Trace`` has a method ``name`` returning it (False: the
            views' own tables, such as ``layer_spans``).
    """

    name: str
    call: str
    columns: dict[str, tuple[str, str]]
    note: str = ""
    method: bool = True

    @property
    def names(self) -> list[str]:
        """The column names, in order."""
        return list(self.columns)

    @property
    def function(self) -> Callable[..., Any]:
        """The analysis that computes the table (the function marked ``@computes(name)``).

        Raises:
            LookupError: no function is marked as computing it.
        """
        import tracemagic.analysis  # noqa: F401 - imports every analysis module, each marks its functions

        try:
            return _FUNCTIONS[self.name]
        except KeyError:
            raise LookupError(
                f"no analysis computes the table {self.name!r}: mark its function "
                f"@computes({self.name!r}) (tracemagic.analysis.schema)"
            ) from None

    def dtypes(self) -> dict[str, str]:
        """Column -> dtype name."""
        return {c: d for c, (d, _) in self.columns.items()}

    def empty(self) -> pd.DataFrame:
        """An empty table with these columns and dtypes (the views' stand-in)."""
        import pandas as pd

        return pd.DataFrame({c: pd.Series(dtype=d) for c, d in self.dtypes().items()})


#: table name -> the analysis computing it (filled by ``computes`` as the modules are imported)
_FUNCTIONS: dict[str, Callable[..., Any]] = {}
F = TypeVar("F", bound=Callable[..., Any])


def computes(*names: str) -> Callable[[F], F]:
    """Mark the decorated analysis as the function computing the tables ``names`` (their
    ``Table.function``); the function itself is returned unchanged."""
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise LookupError(f"@computes{names}: no table {', '.join(unknown)} in analysis.schema.TABLES")

    def mark(function: F) -> F:
        for name in names:
            _FUNCTIONS[name] = function
        return function

    return mark


def kind(dtype: object) -> str:
    """The kind of a pandas dtype or of a dtype name of :data:`KINDS`: 'int', 'float',
    'bool', 'text' (else the dtype's name)."""
    import pandas as pd
    from pandas.api import types

    if isinstance(dtype, str) and dtype in KINDS:
        return KINDS[dtype]
    if isinstance(dtype, pd.CategoricalDtype):
        return "text"
    if types.is_bool_dtype(dtype):
        return "bool"
    if types.is_integer_dtype(dtype):
        return "int"
    if types.is_float_dtype(dtype):
        return "float"
    if types.is_string_dtype(dtype):
        return "text"
    return str(dtype)


_TABLES = [
    Table(
        "ops",
        "ops()",
        {
            "rank": _RANK,
            "row": _ROW,
            "name": ("category", "op name"),
            "kind": ("category", "cpu_op | user_annotation | step"),
            "ts": _TS,
            "dur": ("float64", "duration, µs"),
            "self_dur": ("float64", "duration minus the CPU events directly inside (torch's Self CPU, never below 0)"),
            "thread": ("category", "the trace's tid"),
            "step": _STEP,
            "depth": ("int32", "nesting depth among the thread's CPU events"),
            "parent": ("int64", "row of the enclosing CPU event, -1 at top level"),
            "layer": ("category", "innermost enclosing nn.Module, NA outside modules"),
            "layer_type": ("category", "that module's class"),
            "input_dims": ("category", "input shapes, JSON text as recorded"),
            "input_type": ("category", "input dtypes, JSON text as recorded"),
            "seq": ("Int64", "autograd sequence number (links a forward op to its backward)"),
            "rf_id": ("Int64", "record-function id (joins the Execution Trace)"),
            "external_id": ("Int64", "Kineto external id"),
            "merged": (
                "bool",
                "the only CPU event directly inside an op of its own name: torch's key_averages "
                "folds it into that op (no call of its own, its time in that op's total)",
            ),
        },
        "one row per CPU op / annotation (``cpu_op``, ``user_annotation``, ``step``; python_function "
        "frames are not ops).",
    ),
    Table(
        "kernels",
        "kernels()",
        {
            "rank": _RANK,
            "row": _ROW,
            "name": ("category", "kernel name"),
            "kind": ("category", "kernel | memcpy | memset"),
            "device": ("Int64", "GPU index"),
            "stream": ("Int64", "stream id"),
            "ts": _TS,
            "dur": ("float64", "duration, µs"),
            "step": (
                "int64",
                "ProfilerStep of the launching runtime call, -1 outside steps and where the "
                "trace has no launching call (work in flight when profiling began: in no step, as in steps())",
            ),
            "op": (
                "category",
                "CPU op of the launch: the launching call's External id's (as the TensorBoard "
                "plugin links them), else the innermost CPU op around the call",
            ),
            "op_row": ("int64", "that op's row, -1 for none"),
            "layer": ("category", "innermost nn.Module around the launch"),
            "layer_type": ("category", "that module's class"),
            "correlation": ("Int64", "correlation id linking the runtime launch"),
            "bytes": ("Int64", "bytes moved (memcpy / memset), NA otherwise"),
            "grid": ("category", "launch grid, as recorded"),
            "block": ("category", "launch block, as recorded"),
            "collective": ("category", "the collective a communication kernel runs"),
            "is_comm": ("bool", "a communication (NCCL / RCCL) kernel"),
        },
    ),
    Table(
        "steps",
        "steps()",
        {
            "rank": _RANK,
            "step": ("int64", "ProfilerStep number"),
            "ts": ("float64", "host ProfilerStep start, µs since the trace's start"),
            "dur": ("float64", "host ProfilerStep duration, µs"),
            "window_ts": ("float64", "device window start"),
            "window_dur": ("float64", "device window duration (the parts below add up to it)"),
            "compute_us": ("float64", "GPU kernels"),
            "comm_us": ("float64", "collectives"),
            "memcpy_us": ("float64", "memcpy"),
            "memset_us": ("float64", "memset"),
            "runtime_us": ("float64", "CUDA runtime calls"),
            "dataloader_us": ("float64", "data loading"),
            "cpu_us": (
                "float64",
                "host ops and annotations (record_function ranges, line marks) with nothing above running",
            ),
            "idle_us": ("float64", "none of the above running"),
            "gpu_busy_us": ("float64", "union of all GPU activity in the window"),
            "gpu_idle_us": ("float64", "``window_dur - gpu_busy_us`` (NaN without a GPU)"),
            "kernel_busy_us": (
                "float64",
                "union of the kernels alone in the window (no memcpy/memset): over "
                "``window_dur``, the TensorBoard plugin's GPU Utilization (NaN without a GPU)",
            ),
        },
        "``ts``/``dur`` are the host ProfilerStep; ``window_ts``/``window_dur`` the step's device "
        "window (the TensorBoard plugin's rule: extended to the end of the GPU work the step launched; "
        "the host step on CPU-only traces), partitioned by ``compute_us`` … ``idle_us``; "
        '``df.attrs[\'unlaunched\']``: {rank: {"events", "us"}} of GPU work in flight when profiling '
        "began (no launching call in the trace), which belongs to no step.",
    ),
    Table(
        "iterations",
        "iterations()",
        {
            "iteration": (
                "int64",
                "the stepped loop's iteration, from 0 (``ProfilerStep`` numbers count the same way)",
            ),
            "wall_ms": (
                "float64",
                "wall time, ms (``time.perf_counter_ns``; the session's own work between iterations left out)",
            ),
            "gpu_ms": ("float64", "time between CUDA events at the iteration's boundaries, ms (NaN without CUDA)"),
            "step": ("Int64", "the ``ProfilerStep`` number it was recorded as in the trace (NA: not recorded)"),
            "phase": ("str", "skip | wait | warmup | active | after (past the schedule) | slow (recorded by --slow)"),
            "slow_ratio": ("float64", "caught by ``--slow``: its time over the running median (NaN otherwise)"),
            "slow_trace": ("Int64", "the k of ``kineto_trace_<rank>_slow<k>.json`` that recorded it (NA otherwise)"),
        },
        note="One row per iteration of a ``%%chakra_trace`` loop, recorded or not (the manifest's "
        "``loop_timing``); empty for other traces. Times in ms (as ``%%chakra_trace`` prints them), "
        "not µs: they are the loop's own clock, not the trace's.",
    ),
    Table(
        "phases",
        "phases()",
        {
            "rank": _RANK,
            "step": ("int64", "ProfilerStep number"),
            "ts": ("float64", "host ProfilerStep start, µs since the trace's start"),
            "dur": ("float64", "host ProfilerStep duration, µs (the five host phases add up to it)"),
            "dataloader_us": ("float64", "host in DataLoader/DataPipe iteration (``enumerate(DataLoader)#``)"),
            "forward_us": ("float64", "host in module forwards (``nn.Module:``; else ops recorded for autograd)"),
            "backward_us": ("float64", "host in autograd's backward ops (and on its backward threads)"),
            "optimizer_us": ("float64", "host in ``Optimizer.step#`` / ``Optimizer.zero_grad#``"),
            "other_us": ("float64", "the rest of the host step"),
            "gpu_dataloader_us": ("float64", "GPU busy time launched while loading data, NaN without a GPU"),
            "gpu_forward_us": ("float64", "GPU busy time launched in the forward"),
            "gpu_backward_us": ("float64", "GPU busy time launched in the backward"),
            "gpu_optimizer_us": ("float64", "GPU busy time launched by the optimizer"),
            "gpu_other_us": ("float64", "GPU busy time launched in the rest of the step"),
        },
        "one row per ProfilerStep and rank; where phases overlap, backward wins, then data loading, "
        "then optimizer, then forward (``phases.PRIORITY``); a GPU event belongs to the phase its launch "
        "started in (``tracemagic.analysis.phases``). ``df.attrs``: ``optimizers`` (classes named by "
        "``Optimizer.step#``), ``optimizer_impl`` (fused | foreach | for-loop).",
    ),
    Table(
        "ranks",
        "ranks()",
        {
            "rank": _RANK,
            "steps": ("int64", "steps of the rank"),
            "step_us": ("float64", "mean device window"),
            "compute_us": ("float64", "mean per step, as in ``steps()``"),
            "comm_us": ("float64", "mean per step"),
            "memcpy_us": ("float64", "mean per step"),
            "memset_us": ("float64", "mean per step"),
            "runtime_us": ("float64", "mean per step"),
            "dataloader_us": ("float64", "mean per step"),
            "cpu_us": ("float64", "mean per step"),
            "idle_us": ("float64", "mean per step"),
            "gpu_idle_pct": ("float64", "GPU idle share of the window, %"),
            "overlap_pct": ("float64", "communication-kernel time overlapped by compute, %"),
            "wait_us": ("float64", "mean time waiting in collectives for other ranks"),
            "straggler_steps": ("int64", "steps in which the others waited for this rank"),
            "slowest": ("bool", "the rank the others wait for most often (``ranks.stragglers``)"),
        },
        "one row per rank; ``slowest`` is not simply the rank with the longest steps, since waiting lengthens a step.",
    ),
    Table(
        "collectives",
        "collectives()",
        {
            "rank": _RANK,
            "step": _STEP,
            "collective": ("str", "name as recorded"),
            "seq": ("int64", "n-th of that collective in the step on that rank, from 0"),
            "ts": _TS,
            "dur": ("float64", "duration, µs"),
            "arrival_us": ("float64", "start minus the rank's step start (the step-aligned clock)"),
            "wait_us": ("float64", "the latest matched rank's arrival minus this rank's, NaN where unmatched"),
            "excess_us": ("float64", "duration minus the shortest matched duration"),
            "transfer_us": (
                "float64",
                "``dur − excess_us``: the transfer once the last rank arrived; ``dur`` where the wait is unknown",
            ),
            "ranks": ("int64", "how many ranks have this collective"),
            "source": ("str", "kernel | annotation | record_param_comms"),
            "bytes": ("float64", "message size"),
            "algbw_gbps": ("float64", "algorithm bandwidth (NCCL tests), GB/s over ``transfer_us``"),
            "busbw_gbps": ("float64", "bus bandwidth (NCCL tests), GB/s"),
        },
    ),
    Table(
        "stragglers",
        "stragglers()",
        {
            "step": ("int64", "ProfilerStep number"),
            "rank": ("int64", "the straggling rank"),
            "by": ("str", "collectives | step_time"),
            "step_us": ("float64", "its step time"),
            "median_step_us": ("float64", "the ranks' median window"),
            "wait_us": ("float64", "its total collective wait in the step"),
            "median_wait_us": ("float64", "the ranks' median wait"),
        },
    ),
    Table(
        "layers",
        "layers()",
        {
            "rank": _RANK,
            "layer": ("str", "module path"),
            "type": ("str", "module class"),
            "depth": ("int64", "nesting depth (0 outermost)"),
            "parent": ("str", "enclosing layer, None at the top"),
            "calls": ("int64", "calls"),
            "cpu_us": ("float64", "CPU time inside the layer"),
            "self_cpu_us": ("float64", "CPU time not in a child layer"),
            "fwd_cpu_us": ("float64", "forward CPU time"),
            "fwd_self_cpu_us": ("float64", "forward self CPU time"),
            "bwd_cpu_us": ("float64", "backward CPU time"),
            "bwd_self_cpu_us": ("float64", "backward self CPU time"),
            "gpu_us": ("float64", "GPU time launched from the layer"),
            "self_gpu_us": ("float64", "GPU time not launched from a child layer"),
            "fwd_gpu_us": ("float64", "forward GPU time"),
            "bwd_gpu_us": ("float64", "backward GPU time"),
            "tflops_per_s": ("float64", "achieved TFLOP/s (``efficiency()``'s model)"),
            "memory_bound_pct": ("float64", "share of ``gpu_us`` in memory-bound ops, %"),
            "memory_growth_bytes": ("int64", "summed allocation deltas inside the forward calls"),
            "input_shapes": ("str", "input dims of the first op of the first call"),
            "module": ("str", "the trace's ``nn.Module: X_k`` name"),
        },
        "``df.attrs``: ``step_us``, ``unattributed_us``, ``overlap_us``, ``gpu_us``, "
        "``gpu_unattributed_us`` (each {rank: µs}), ``compiled_regions`` ({rank: torch.compile region "
        "calls}), ``compiled_layers`` ({rank: [layers running them]}).",
    ),
    Table(
        "layer_spans",
        "layer_spans()",
        {
            "rank": _RANK,
            "layer": ("str", "model path from the capture, else ``Linear_0``"),
            "type": ("str", "module class"),
            "phase": ("str", "forward | backward"),
            "ts": _TS,
            "dur": ("float64", "duration, µs"),
            "step": _STEP,
            "calls": ("int64", "module calls or backward ops merged into the span"),
        },
        method=False,
    ),
    Table(
        "phase_spans",
        "phase_spans()",
        {
            "rank": _RANK,
            "phase": ("str", "dataloader | forward | backward | optimizer (``phases()``' host rule)"),
            "ts": _TS,
            "dur": ("float64", "duration, µs"),
            "step": _STEP,
            "busy_us": ("float64", "the phase's own time in the span (``dur`` less the ``other`` time inside)"),
        },
        "the moments each host phase is in effect: a phase's runs in one step with only ``other`` time "
        "between them are one span (``other`` itself left out).",
        method=False,
    ),
    Table(
        "memory",
        "memory()",
        {
            "rank": _RANK,
            "ts": _TS,
            "device": ("str", "'cpu' | 'cuda:N'"),
            "allocated_bytes": ("int64", "allocator's Total Allocated after the event"),
            "reserved_bytes": ("Int64", "allocator's Total Reserved, NA where not recorded"),
            "delta_bytes": ("int64", "bytes allocated (+) or freed (-)"),
            "op": ("str", "innermost CPU op around it"),
            "op_row": ("int64", "that op's row, -1 for none"),
            "layer": ("str", "innermost nn.Module around it"),
            "phase": ("str", "forward | backward, None outside layers and backward ops"),
            "step": _STEP,
            "addr": ("Int64", "address, NA where not recorded"),
            "row": _ROW,
        },
    ),
    Table(
        "memory_peaks",
        "memory_peaks()",
        {
            "rank": _RANK,
            "device": ("str", "'cpu' | 'cuda:N'"),
            "step": ("Int64", "ProfilerStep, NA for the whole capture"),
            "peak_bytes": ("int64", "highest ``Total Allocated`` recorded in the scope"),
            "start_bytes": ("int64", "allocated when the scope began"),
            "peak_reserved_bytes": ("Int64", "highest ``Total Reserved``, NA where not recorded"),
            "ts": ("float64", "when the peak was first reached"),
            "op": ("str", "op of the event that reached it"),
            "layer": ("str", "layer of that event"),
            "phase": ("str", "phase of that event"),
            "delta_bytes": ("int64", "that event's allocation"),
        },
    ),
    Table(
        "biggest_allocations",
        "biggest_allocations()",
        {
            "rank": _RANK,
            "ts": _TS,
            "device": ("str", "'cpu' | 'cuda:N'"),
            "bytes": ("int64", "bytes allocated"),
            "op": ("str", "innermost CPU op around it"),
            "layer": ("str", "innermost nn.Module around it"),
            "phase": ("str", "forward | backward, None outside layers and backward ops"),
            "step": _STEP,
            "addr": ("Int64", "address"),
            "freed_ts": ("float64", "when freed, NaN if not within the trace"),
            "lifetime_us": ("float64", "``freed_ts - ts``"),
        },
    ),
    Table(
        "memory_categories",
        "memory_categories()",
        {
            "rank": _RANK,
            "cycle": ("Int64", "capture cycle, NA for single-cycle captures"),
            "device": ("str", "'cpu' | 'cuda:N'"),
            "ts": _TS,
            "before_capture": ("int64", "bytes allocated before the capture"),
            "parameter": ("int64", "bytes"),
            "optimizer_state": ("int64", "bytes"),
            "input": ("int64", "bytes"),
            "temporary": ("int64", "bytes"),
            "activation": ("int64", "bytes"),
            "gradient": ("int64", "bytes"),
            "autograd_detail": ("int64", "bytes"),
            "unknown": ("int64", "bytes"),
            "total_bytes": ("int64", "sum of the categories: ``memory()``'s ``allocated_bytes`` at ``ts``"),
        },
        "on the allocator's scale.",
    ),
    Table(
        "source",
        "source()",
        {
            "rank": _RANK,
            "kind": (
                "str",
                "function (a ``python_function`` frame) | line (a call-site line of ``Call stack`` strings)",
            ),
            "name": ("str", "``file(LINE): func`` as the trace writes it (a built-in without its address)"),
            "file": ("str", "the file (``<built-in>`` for C functions)"),
            "line": ("Int64", "a function's ``def`` line, a line row's call-site line; NA for built-ins"),
            "function": ("str", "the function's name"),
            "user": (
                "bool",
                "user code, not a library, the standard library or a built-in, nor a ``%%chakra_trace`` "
                "cell's own line",
            ),
            "calls": ("int64", "frames (lines: the outermost ops recorded at the line)"),
            "cpu_us": ("float64", "inclusive: the union of the frames' intervals per thread, summed over threads"),
            "self_cpu_us": ("float64", "time not in a child Python frame (lines: ops whose innermost entry it is)"),
            "gpu_us": ("float64", "GPU activity launched by ops beneath"),
            "alloc_bytes": ("int64", "bytes allocated beneath (positive ``[memory]`` deltas)"),
            "flops": ("float64", "the trace's ``flops`` of the ops beneath, NaN without ``with_flops``"),
        },
        "one row per Python function per rank, and per call-site line of ``Call stack`` strings; "
        "the definitions: ``tracemagic.analysis.source``.",
    ),
    Table(
        "call_tree",
        "call_tree()",
        {
            "node": ("int64", "node id (parents come first)"),
            "parent": ("int64", "parent node id, -1 at the top"),
            "depth": ("int64", "nesting depth (0 at the top)"),
            "rank": _RANK,
            "name": ("str", "frame, op, annotation or kernel name (``rank N`` nodes above several ranks)"),
            "kind": ("str", "rank | python | module | op | annotation | kernel | memcpy | memset | line | other"),
            "file": ("str", "a Python frame's or stack line's file"),
            "line": ("Int64", "its line"),
            "user": ("bool", "a user-code Python frame or line"),
            "calls": ("int64", "events merged into the node"),
            "cpu_us": ("float64", "CPU time of the node's events (inclusive)"),
            "self_cpu_us": ("float64", "``cpu_us`` minus the children's"),
            "gpu_us": ("float64", "GPU activity at and below the node"),
            "self_gpu_us": ("float64", "a GPU node's own duration"),
            "layer": (
                "str",
                "an ``nn.Module`` node's layer as ``layers()`` names it (the capture's attribute path: "
                "``bert.encoder.layer.0``); NA for other nodes and modules the capture did not name",
            ),
        },
        "the merged call tree (Python frames → ops → kernels) folded stacks and flame graphs draw; "
        "``call_tree(user_only=True)`` leaves library frames out.",
    ),
    Table(
        "sites",
        "sites()",
        {
            "rank": _RANK,
            "row": _ROW,
            "kind": ("category", "the event's kind: cpu_op | kernel | memcpy | memset | memory"),
            "site": (
                "category",
                "line (a cell line mark) | function (a user python_function frame) | stack (a user "
                "``Call stack`` entry), NA for none",
            ),
            "where": (
                "category",
                "how the views name it: ``line 7 `y = f(x)```, ``func · file.py:LINE`` (a notebook cell's "
                "``func · Cell In[3]:LINE``); NA for none",
            ),
            "file": ("category", "the function's or stack entry's file (empty for a cell line)"),
            "line": ("Int64", "the cell line, the function's ``def`` line or the stack's call-site line"),
            "function": ("category", "the function's name (empty for a cell line)"),
            "kernel_file": (
                "category",
                "``torch.compile``: the source file Inductor generated for a Triton kernel "
                "(the launching op's ``kernel_file``), NA elsewhere",
            ),
            "compiled_region": (
                "category",
                "the ``Torch-Compiled Region: F/N`` op around it, NA outside compiled code",
            ),
        },
        "one row per CPU op, GPU activity and ``[memory]`` event with the user code that launched it "
        "(GPU work through its launching op, memory through the CPU event around it; the rules: "
        "``tracemagic.analysis.sites``).",
    ),
    Table(
        "shapes",
        "shapes()",
        {
            "rank": _RANK,
            "name": ("str", "top op of the call chain"),
            "input_dims": ("str", "input shapes, JSON text"),
            "input_type": ("str", "input dtypes, JSON text"),
            "concrete_inputs": ("str", "scalar inputs, JSON text"),
            "calls": ("int64", "calls"),
            "total_us": ("float64", "CPU time of the calls"),
            "mean_us": ("float64", "``total_us / calls``"),
            "self_us": ("float64", "self time of every op of the chains"),
            "gpu_us": ("float64", "GPU time the chains launched"),
            "flops": ("Float64", "FLOPs per call, NA unless known for every call"),
            "tflops_per_s": (
                "Float64",
                "achieved TFLOP/s over ``gpu_us``, over ``total_us`` where the chains launched no GPU work",
            ),
            "flops_source": ("str", "trace | shapes | estimate, NA where ``flops`` is"),
        },
        "one row per top op of a call chain (the outermost op with recorded shapes, or with none and "
        "none inside, and every op it runs: one convolution is one ``aten::conv2d`` row, not four), "
        "ranked by ``total_us``.",
    ),
    Table(
        "efficiency",
        "efficiency()",
        {
            "rank": _RANK,
            "name": ("str", "top op of the call chain"),
            "input_dims": ("str", "input shapes, JSON text"),
            "input_type": ("str", "input dtypes, JSON text"),
            "precision": (
                "str",
                "the dtype its math ran in: fp64 | fp32 | bf16 | fp16 | fp8, its first floating-point input's, "
                "or its inner matrix op's where that differs (autocast); NA without one",
            ),
            "calls": ("int64", "calls"),
            "gpu_us": ("float64", "GPU time launched"),
            "flops": ("float64", "FLOPs per call, NaN unless known for every call (as ``shapes()``)"),
            "bytes": ("float64", "bytes moved per call, NaN unless known for every call"),
            "intensity": ("float64", "FLOPs per byte"),
            "tflops_per_s": ("float64", "achieved TFLOP/s"),
            "tbytes_per_s": ("float64", "achieved TB/s"),
            "peak_tflops": (
                "float64",
                "the device's peak TFLOP/s at the dtype its matrix math ran in (autocast: its inner matrix op's; "
                "float32 matrix op: TF32 only where its kernels ran TF32)",
            ),
            "peak_tbytes_per_s": ("float64", "the device's peak TB/s"),
            "bound": ("str", "compute | memory"),
            "pct_of_roofline": ("float64", "achieved share of the roof at this intensity, %"),
            "device": ("str", "device the peaks are of"),
        },
        "one row per (rank, op, input dims, dtypes, precision) of the call chains that launched GPU work, most "
        "GPU time first; peaks from ``devices.PEAKS`` matched by ``deviceProperties`` (or given; an "
        "unknown board gets NaN and ``df.attrs['note']``); ``df.attrs['layers']`` the layers of each row's calls.",
    ),
    Table(
        "diff",
        "diff(a, b)",
        {
            "level": ("str", "op | kernel | layer"),
            "name": ("str", "op (call-chain top, as in ``shapes()``), kernel or layer"),
            "type": ("str", "layer class"),
            "calls_a": ("int64", "calls in ``a``"),
            "calls_b": ("int64", "calls in ``b``"),
            "us_a": ("float64", "time in ``a``"),
            "us_b": ("float64", "time in ``b``"),
            "delta_us": ("float64", "``us_b - us_a``"),
            "ratio": ("float64", "``us_b / us_a``"),
            "status": ("str", "added | removed | faster | slower | same"),
            "gpu_us_a": ("float64", "GPU time in ``a``"),
            "gpu_us_b": ("float64", "GPU time in ``b``"),
        },
    ),
    Table(
        "advice",
        "advice()",
        {
            "rule": ("str", "the rule that fired (``advice.RULES``; ``roofline`` for the roofline gaps)"),
            "step": ("Int64", "the ProfilerStep the scope is, NA for the whole trace"),
            "value": ("float64", "the figure the rule measured"),
            "threshold": ("float64", "the named constant of ``advice`` it reached"),
            "weight": ("float64", "importance: rows come most important first"),
            "evidence": ("str", "the figure as text"),
            "advice": ("str", "what to do"),
            "text": ("str", "the line the views show"),
        },
        "one row per rule that fired over the scope, by ``weight``. The figures the views headline "
        "(mean step, top ops, kernels and layers, a scope's peaks) are ``aggregate``'s.",
    ),
    Table(
        "lines",
        "lines()",
        {
            "line": ("int64", "the cell line (the ``%%chakra_trace`` line is 1)"),
            "text": ("str", "the line as written (empty without the manifest's cell)"),
            "parent_line": ("int64", "the enclosing statement's line, -1 at top level"),
            "calls": ("float64", "runs per step"),
            "cpu_us": ("float64", "host time per step: the union of the line's marks, nested lines included"),
            "self_cpu_us": ("float64", "``cpu_us`` less its nested lines' marks"),
            "gpu_us": ("float64", "per step, summed durations of the GPU work launched beneath the line"),
            "self_gpu_us": ("float64", "``gpu_us`` less its nested lines'"),
            "step_pct": ("float64", "``cpu_us`` as % of the mean step (``window_dur``)"),
            "alloc_bytes": ("float64", "bytes allocated beneath the line per step"),
            "peak_bytes": ("int64", "bytes it allocated still live at the memory peak"),
            "self_peak_bytes": ("int64", "``peak_bytes`` less its nested lines'"),
        },
        "one row per marked line of a ``%%chakra_trace`` cell that ran in the counted steps (means per "
        "step); empty for traces without line marks.",
    ),
    Table(
        "syncs",
        "syncs()",
        {
            "rank": _RANK,
            "row": _ROW,
            "step": _STEP,
            "ts": _TS,
            "name": ("str", "the sync's event: ``aten::item``, ``aten::to``, ``cudaStreamSynchronize`` ..."),
            "what": ("str", "item | copy_to_host | sync_call"),
            "dur": ("float64", "the event's host duration, µs"),
            "stall_us": ("float64", "host time in blocking runtime calls beneath it (itself for a runtime call)"),
            "gpu_wait": ("bool", "the host waited on a GPU runtime call (False: a CPU-only .item(), no wait)"),
            "line": ("int64", "the cell line it ran in (line marks), -1 for none"),
            "line_text": ("str", "that line's text, empty for none"),
            "function": ("str", "the innermost Python function above it outside torch, empty for none"),
            "op": ("str", "the innermost CPU op or annotation around it (line marks aside), empty for none"),
            "where": ("str", "how the views name it: ``line 7 `loss.item()```, a function, an op"),
        },
        "one row per host-device synchronisation inside the steps (the outermost of nested ones).",
    ),
    Table(
        "et_graph",
        "et_graph()",
        {
            "id": ("int64", "ET node id"),
            "name": ("str", "operator"),
            "op_schema": ("str", "its schema"),
            "parent": ("int64", "parent node id"),
            "depth": ("int64", "nesting depth"),
            "step": _STEP,
            "rf_id": ("Int64", "record-function id"),
            "input_shapes": ("str", "JSON text"),
            "input_types": ("str", "JSON text"),
            "output_shapes": ("str", "JSON text"),
            "output_types": ("str", "JSON text"),
            "row": ("int64", "the Kineto event's row, -1 for none"),
            "ts": ("float64", "the Kineto event's start, NaN without a match"),
            "dur": ("float64", "its duration"),
            "self_dur": ("float64", "its self duration"),
        },
        "the nodes of ``et.graph``; its edges are ``et_edges``.",
        method=False,
    ),
    Table(
        "et_edges",
        "et_edges",
        {
            "src": ("int64", "producer node id"),
            "dst": ("int64", "consumer node id"),
            "tensor": ("str", "the tensor"),
            "bytes": ("int64", "its size"),
        },
        "one row per tensor an op reads that an earlier op wrote.",
        method=False,
    ),
]

#: every table's contract, by name
TABLES: dict[str, Table] = {t.name: t for t in _TABLES}


def describe() -> str:
    """The contracts as the docstring's bullet list: ``- ``call``: ``columns`` — note``,
    then one line per column: ``column`` (dtype): meaning."""
    lines = []
    for t in _TABLES:
        function, where = _FUNCTIONS.get(t.name), ""
        if function is not None and (function.__module__.rsplit(".", 1)[-1], function.__name__) != (t.name, t.name):
            where = f" (``{function.__module__.rsplit('.', 1)[-1]}.{function.__name__}``)"
        note = f" — {t.note}" if t.note else ""
        lines.append(f"- ``{t.call}``{where}: ``{', '.join(t.columns)}``{note}")
        lines += [f"    - ``{c}`` ({d}): {m}" for c, (d, m) in t.columns.items()]
    return "\n".join(lines)
