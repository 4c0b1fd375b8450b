"""Recommendations as rules: each a measured figure against a named threshold.

``advice(trace)`` (``trace.advice()``) evaluates every rule on one scope (the whole trace,
or one ProfilerStep) and returns a row per rule that fired, most important first: which
rule, the figure against its threshold, the evidence (the figure as text), the advice, and
the line the views show. The views (the Overview, the text summary, the report) only pick
and print rows; they decide nothing.

Shares are fractions of the mean step's device window (``steps()``'s ``window_dur``) unless
a rule says otherwise. ``weight`` orders the rows: a rule's own share where it has one
(a bigger problem first), else a fixed rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd

from tracemagic.analysis import aggregate
from tracemagic.analysis import iterations as _iterations
from tracemagic.analysis import kernels as _kernels
from tracemagic.analysis import lines as _lines
from tracemagic.analysis import memory as _memory
from tracemagic.analysis import ops as _ops
from tracemagic.analysis import phases as _phases
from tracemagic.analysis import ranks as _ranks
from tracemagic.analysis import steps as _steps
from tracemagic.analysis import syncs as _syncs
from tracemagic.analysis._common import memory_off_cpu
from tracemagic.analysis._text import fmt_bytes, fmt_count, fmt_dtypes, fmt_pct, fmt_time, shorten
from tracemagic.analysis.schema import TABLES, computes

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import TraceTables

# -- thresholds --------------------------------------------------------------------------
#: ``gpu_idle``: the GPU idle at least this share of the step (it waits for the host)
GPU_IDLE_SHARE = 0.20
#: ``memcpy``: host/device copies at least this share of the step
MEMCPY_SHARE = 0.10
#: ``communication``: collectives (NCCL kernels) at least this share of the step
COMM_SHARE = 0.20
#: ``dataloader``: DataLoader iteration at least this share of the step
DATALOADER_SHARE = 0.10
#: ``dataloader``: added to its share when ordering (a data stall is cheap to fix)
DATALOADER_BONUS = 0.05
#: ``slow_step``: the longest step at least this many times the median step
SLOW_STEP_RATIO = 1.5
#: ``slow_step``: the fewest steps for a median worth comparing with
SLOW_STEP_MIN_STEPS = 3
#: ``slow_step``: its weight
SLOW_STEP_WEIGHT = 0.15
#: ``top_op``: the CPU op with the most self time at least this share of all ops' self time
TOP_OP_SHARE = 0.20
#: ``top_op``: its weight is its share times this (CPU time matters less than the step's parts)
TOP_OP_DISCOUNT = 0.9
#: ``launch_overhead``: at least this many kernels per step ...
KERNELS_PER_STEP = 1000
#: ``launch_overhead``: ... averaging under this many µs each
SHORT_KERNEL_US = 10.0
#: ``launch_overhead``: its weight
LAUNCH_WEIGHT = 0.30
#: ``straggler``: the others' extra wait for the slowest rank at least this share of the median step
STRAGGLER_SHARE = 0.05
#: ``straggler``: added to its share when ordering (every other rank pays it)
STRAGGLER_BONUS = 0.10
#: ``memory_peak``: the GPU peak allocated at least this share of the device's memory
MEMORY_PEAK_SHARE = 0.85
#: ``fragmentation``: the peak reserved at least this many times the peak allocated ...
RESERVED_RATIO = 1.5
#: ``fragmentation``: ... and above this many bytes (small caches are not worth a setting)
RESERVED_MIN_BYTES = 256 * 2**20
#: ``fragmentation``: its weight
FRAGMENTATION_WEIGHT = 0.20
#: ``optimizer``: the optimizer's step and zero_grad at least this share of the step (host, or GPU time it launched)
OPTIMIZER_SHARE = 0.15
#: ``host_sync``: the host waiting for the GPU in its syncs (``syncs()``: ``.item()``, copies to
#: the host, ``torch.cuda.synchronize()`` and other blocking runtime calls) at least this share
#: of the step, on a GPU
HOST_SYNC_SHARE = 0.10
#: ``roofline``: a gap heads the Overview only when the GPU time it loses is at least this share
#: of all GPU time of ops with shapes
ROOFLINE_MIN_SHARE = 0.01
#: how many of the rules closest to their thresholds are named when none fired
CLOSEST = 3

#: ``untypical_window``: its weight (it says how far to trust every other figure)
UNTYPICAL_WEIGHT = 0.50
#: ``untypical_window``: the op dynamo runs each compiled frame in
COMPILED_REGION_PREFIX = "Torch-Compiled Region"

#: ``roofline``: an op whose inputs are already 16- or 8-bit floats (no lower precision to advise)
#: precisions (``efficiency()``'s ``precision``) that are already low: its roof is their own
_LOW_PRECISION = frozenset({"bf16", "fp16", "fp8"})

#: the hint of ``.item()``, under both names torch records it
_ITEM_HINT = "each .item() turns a tensor into a Python number; keep values as tensors inside the step"

#: what to say about an op that dominates CPU time
OP_ADVICE = {
    "aten::copy_": "host/device copies or dtype casts; keep tensors on the device and in one dtype",
    "aten::to": "host/device copies or dtype casts; keep tensors on the device and in one dtype",
    "aten::_to_copy": "host/device copies or dtype casts; keep tensors on the device and in one dtype",
    "aten::item": "each .item() waits for the GPU; avoid it inside the step",
    "aten::_local_scalar_dense": "each .item()/.cpu() waits for the GPU; avoid it inside the step",
    "cudaDeviceSynchronize": "explicit synchronizations stall the pipeline",
    "aten::nonzero": "nonzero/masked indexing syncs with the GPU",
}
#: the same on a trace without GPU work (no device to copy to or wait for)
CPU_OP_ADVICE = {
    "aten::copy_": "tensor copies or dtype casts; keep tensors in one dtype and avoid needless copies",
    "aten::to": "dtype casts or copies; keep tensors in one dtype",
    "aten::_to_copy": "dtype casts or copies; keep tensors in one dtype",
    "aten::item": _ITEM_HINT,
    "aten::_local_scalar_dense": _ITEM_HINT,
    "aten::nonzero": "nonzero/masked indexing makes outputs of data-dependent size",
}
#: what to say about any other op that dominates CPU time
OTHER_OP_ADVICE = "look at its callers in the Layers and Timeline tabs"

#: the columns of ``advice()`` (its contract in ``tracemagic.analysis.schema``)
COLUMNS = TABLES["advice"].names


class Row(NamedTuple):
    """One rule that fired (a row of ``advice()``, less its ``step``)."""

    rule: str
    value: float
    threshold: float
    weight: float
    evidence: str
    advice: str
    text: str


def _row(
    rule: str, value: float, threshold: float, weight: float, evidence: str, advice: str, joint: str = ": "
) -> Row:
    return Row(rule, float(value), float(threshold), float(weight), evidence, advice, f"{evidence}{joint}{advice}")


@dataclass(frozen=True, eq=False)
class Scope:
    """The tables one evaluation looks at (see :func:`evaluate`), and the mean step's shares
    (``aggregate.step_shares``; None without steps of some length); ``phases``: the scope's
    ``phases()`` rows (None where not given); ``syncs``: the scope's ``syncs()`` on a GPU
    (None otherwise); ``lines``: the trace's ``lines()`` where the rules name cell lines; ``line_of``:
    events rows -> their cell line (-1 for none), where the trace has line marks."""

    steps: pd.DataFrame
    ops: pd.DataFrame
    kernels: pd.DataFrame | None
    peaks: pd.DataFrame | None
    ranks: pd.DataFrame | None
    device_memory_bytes: float | None
    share: pd.Series | None
    iterations: pd.DataFrame | None = None
    phases: pd.DataFrame | None = None
    lines: pd.DataFrame | None = None
    syncs: pd.DataFrame | None = None
    line_of: Callable[[np.ndarray], np.ndarray] | None = None
    memo: dict[str, Any] = field(default_factory=dict)  # figures two rules share, computed once

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, computed once per scope (a rule and :func:`closest` share it)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    @property
    def has_gpu(self) -> bool:
        """Whether the scope ran GPU kernels, memcpy or memset."""
        return self.kernels is not None and not self.kernels.empty


def _gpu_part(scope: Scope, rule: str, column: str, threshold: float, evidence: str, advice: str) -> Row | None:
    """The rule ``rule`` where a GPU ran in the scope and its step part ``column`` is
    ``threshold`` of the step or more (``gpu_idle_us`` is NaN without a GPU); ``evidence``
    names the share ``{pct}``."""
    share = scope.share
    if share is None or not scope.has_gpu or share["gpu_idle_us"] != share["gpu_idle_us"]:
        return None
    part = float(share[column])
    if part < threshold:
        return None
    return _row(rule, part, threshold, part, evidence.format(pct=fmt_pct(part)), advice)


def gpu_idle(scope: Scope) -> Row | None:
    """The GPU idle ``GPU_IDLE_SHARE`` of the step or more: it waits for the host."""
    return _gpu_part(
        scope,
        "gpu_idle",
        "gpu_idle_us",
        GPU_IDLE_SHARE,
        "GPU idle {pct} of the step",
        "the GPU waits for the CPU; bigger batches, fewer syncs, CUDA graphs or torch.compile keep it busy.",
    )


def memcpy(scope: Scope) -> Row | None:
    """memcpy ``MEMCPY_SHARE`` of the step or more (on a GPU)."""
    return _gpu_part(
        scope,
        "memcpy",
        "memcpy_us",
        MEMCPY_SHARE,
        "memcpy takes {pct} of the step",
        "use pin_memory=True and .to(device, non_blocking=True).",
    )


def communication(scope: Scope) -> Row | None:
    """Collectives ``COMM_SHARE`` of the step or more (on a GPU)."""
    return _gpu_part(
        scope,
        "communication",
        "comm_us",
        COMM_SHARE,
        "Communication takes {pct} of the step",
        "overlap it with compute (bucketed DDP/FSDP) or shrink what is sent.",
    )


def dataloader(scope: Scope) -> Row | None:
    """DataLoader iteration ``DATALOADER_SHARE`` of the step or more."""
    if scope.share is None:
        return None
    part = float(scope.share["dataloader_us"])
    if part < DATALOADER_SHARE:
        return None
    return _row(
        "dataloader",
        part,
        DATALOADER_SHARE,
        part + DATALOADER_BONUS,
        f"DataLoader takes {fmt_pct(part)} of the step",
        "raise num_workers, use pin_memory and persistent_workers.",
    )


def slow_step(scope: Scope) -> Row | None:
    """The longest of ``SLOW_STEP_MIN_STEPS`` steps or more over ``SLOW_STEP_RATIO`` × the median."""
    if scope.share is None:
        return None
    durs = scope.steps["window_dur"].astype(float)
    median = float(durs.median())
    if not (len(durs) >= SLOW_STEP_MIN_STEPS and median > 0 and durs.max() > SLOW_STEP_RATIO * median):
        return None
    slow = scope.steps.loc[durs.idxmax()]
    ratio = float(durs.max()) / median
    return _row(
        "slow_step",
        ratio,
        SLOW_STEP_RATIO,
        SLOW_STEP_WEIGHT,
        f"Step {int(slow['step'])} takes {fmt_time(float(slow['window_dur']))}, {ratio:.1f}× the median step "
        f"({fmt_time(median)})",
        "warm-up, recompilation or a data stall.",
    )


def top_op(scope: Scope) -> Row | None:
    """The CPU op with the most self time ``TOP_OP_SHARE`` of all ops' or more (a DataLoader
    op not when :func:`dataloader` fired, a sync op not when :func:`host_sync` did: said already)."""
    top = scope.once("top_op", lambda: aggregate.top_ops(scope.ops, 1))
    if top.empty or not float(top["self_us"].sum()) > 0:
        return None
    first = top.iloc[0]
    pct = float(first["self_pct"]) / 100
    if pct < TOP_OP_SHARE or ("DataLoader" in str(first["name"]) and dataloader(scope) is not None):
        return None
    if str(first["name"]) in SYNC_OPS and host_sync(scope) is not None:
        return None  # said already, with its time per step
    advice = (OP_ADVICE if scope.has_gpu else CPU_OP_ADVICE).get(str(first["name"]), OTHER_OP_ADVICE)
    where = _op_line(scope, str(first["name"]))
    return _row(
        "top_op",
        pct,
        TOP_OP_SHARE,
        pct * TOP_OP_DISCOUNT,
        f"{shorten(first['name'], 60)} is {fmt_pct(pct)} of CPU time ({int(first['calls']):,} calls"
        f"{', mostly ' + where if where else ''})",
        f"{advice}.",
    )


def _line_name(lines: pd.DataFrame, line: int) -> str:
    """``line 7 `y = model(x)``` for a cell line of ``lines()``."""
    text = lines.loc[lines["line"] == line, "text"]
    said = shorten(str(text.iloc[0]).strip(), 50) if len(text) and str(text.iloc[0]).strip() else ""
    return f"line {line} `{said}`" if said else f"line {line}"


def _op_line(scope: Scope, name: str) -> str:
    """The cell line holding most of op ``name``'s self time (``line 7 `...```), "" without line marks."""
    if scope.line_of is None or scope.lines is None or scope.lines.empty:
        return ""
    ops = scope.ops[(scope.ops["name"] == name).to_numpy()]
    if ops.empty:
        return ""
    line = scope.line_of(ops["row"].to_numpy())
    known = line >= 0
    if not known.any():
        return ""
    per_line = pd.Series(ops["self_dur"].to_numpy()[known]).groupby(line[known]).sum()
    return _line_name(scope.lines, int(per_line.idxmax()))


def launch_overhead(scope: Scope) -> Row | None:
    """``KERNELS_PER_STEP`` kernels per step (of one rank) or more, averaging under
    ``SHORT_KERNEL_US`` (``aggregate.kernel_rate``: the kernels of the steps)."""
    if scope.kernels is None or not scope.has_gpu:
        return None
    rate = aggregate.kernel_rate(scope.kernels, scope.steps)
    if not (rate["per_step"] >= KERNELS_PER_STEP and rate["mean_us"] < SHORT_KERNEL_US):
        return None
    return _row(
        "launch_overhead",
        float(rate["per_step"]),
        KERNELS_PER_STEP,
        LAUNCH_WEIGHT,
        f"{fmt_count(float(rate['per_step']))} kernels per step{' and rank' if rate['ranks'] > 1 else ''} averaging "
        f"{fmt_time(float(rate['mean_us']))}",
        "launch overhead dominates; fuse with torch.compile or CUDA graphs.",
    )


def straggler_rule(scope: Scope) -> Row | None:
    """The others wait for one rank ``STRAGGLER_SHARE`` of the median step or more (:func:`straggler`)."""
    late = straggler(scope.ranks) if scope.ranks is not None else None
    if late is None or late[0] < STRAGGLER_SHARE:
        return None
    return _row(
        "straggler",
        late[0],
        STRAGGLER_SHARE,
        late[0] + STRAGGLER_BONUS,
        late[1],
        "check its data, placement and load balance.",
        joint="; ",
    )


def memory_peak(scope: Scope) -> Row | None:
    """A GPU's peak allocated ``MEMORY_PEAK_SHARE`` of its memory or more."""
    peaks = scope.peaks
    if peaks is None or peaks.empty or not scope.device_memory_bytes:
        return None
    gpu = peaks[peaks["device"].astype(str) != "cpu"]
    if gpu.empty:
        return None
    frac = float(gpu["peak_bytes"].max()) / scope.device_memory_bytes
    if frac < MEMORY_PEAK_SHARE:
        return None
    held = ""
    lines = scope.lines
    if lines is not None and not lines.empty and int(lines["self_peak_bytes"].max()) > 0:
        top = lines.loc[lines["self_peak_bytes"].idxmax()]
        held = f"; {_line_name(lines, int(top['line']))} allocated {fmt_bytes(float(top['self_peak_bytes']))} of it"
    return _row(
        "memory_peak",
        frac,
        MEMORY_PEAK_SHARE,
        frac,
        f"Peak memory is {fmt_pct(frac)} of the GPU's {fmt_bytes(scope.device_memory_bytes)}{held}",
        "activation checkpointing or a smaller batch leaves headroom.",
    )


def fragmentation(scope: Scope) -> Row | None:
    """A GPU's peak reserved ``RESERVED_RATIO`` × its peak allocated or more, above ``RESERVED_MIN_BYTES``."""
    peaks = scope.peaks
    if peaks is None or peaks.empty:
        return None
    gpu = peaks[peaks["device"].astype(str) != "cpu"]
    reserved = gpu["peak_reserved_bytes"].astype(float)
    if gpu.empty or not reserved.notna().any():
        return None
    ratio = float(reserved.max()) / max(float(gpu["peak_bytes"].max()), 1.0)
    if not (ratio >= RESERVED_RATIO and float(reserved.max()) > RESERVED_MIN_BYTES):
        return None
    return _row(
        "fragmentation",
        ratio,
        RESERVED_RATIO,
        FRAGMENTATION_WEIGHT,
        f"Reserved memory is {ratio:.1f}× the allocated peak",
        "fragmentation; try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
    )


def untypical_window(scope: Scope) -> Row | None:
    """The recorded steps are not typical of the loop (``iterations.window_check``: their
    median ``iterations.UNTYPICAL_SHARE`` or more off the loop's steady state, or the first
    iterations of a compiled model); a ``%%chakra_trace`` capture's whole trace only."""
    table = scope.iterations
    if table is None or table.empty:
        return None
    names = scope.ops["name"] if "name" in scope.ops else pd.Series([], dtype=str)
    values = names.cat.categories if isinstance(names.dtype, pd.CategoricalDtype) else names.unique()
    compiled = any(str(name).startswith(COMPILED_REGION_PREFIX) for name in values)
    check = _iterations.window_check(table, compiled)
    if check is None:
        return None
    value = abs(check.change) if check.change == check.change else 1.0
    return _row(
        "untypical_window",
        value,
        _iterations.UNTYPICAL_SHARE,
        UNTYPICAL_WEIGHT,
        check.text,
        "move the window (--wait/--skip-first) to steps like the rest.",
    )


#: the ops that make the host wait for the GPU: ``.item()`` and what it runs
SYNC_OPS = _syncs.ITEM_OPS


def optimizer_share(scope: Scope) -> tuple[float, float, float] | None:
    """The optimizer's share of the mean step: (the larger of the two below, its host time
    over the host step — ``phases()``' ``optimizer_us`` / ``dur`` —, the GPU time it launched
    over the device window, NaN without a GPU); None without phases or an optimizer step."""
    phases = scope.phases
    if phases is None or phases.empty or not float(phases["optimizer_us"].sum()) > 0:
        return None
    host_step = float(phases["dur"].sum())
    host = float(phases["optimizer_us"].sum()) / host_step if host_step > 0 else 0.0
    gpu = float("nan")
    window = float(scope.steps["window_dur"].sum()) if not scope.steps.empty else 0.0
    if scope.has_gpu and window > 0 and phases["gpu_optimizer_us"].notna().any():
        gpu = float(phases["gpu_optimizer_us"].sum()) / window
    return max(host, gpu if gpu == gpu else 0.0), host, gpu


def optimizer(scope: Scope) -> Row | None:
    """The optimizer (``Optimizer.step#`` and ``zero_grad#``) ``OPTIMIZER_SHARE`` of the step
    or more, on the host or in the GPU time it launched (:func:`optimizer_share`); the
    advice follows how it ran (``phases()``' ``attrs``): one parameter at a time →
    ``foreach=True`` / ``fused=True``; foreach → ``fused=True``; fused → fewer steps."""
    found = optimizer_share(scope)
    if found is None or found[0] < OPTIMIZER_SHARE:
        return None
    value, host, gpu = found
    assert scope.phases is not None
    classes = list(scope.phases.attrs.get("optimizers") or [])
    impl = scope.phases.attrs.get("optimizer_impl")
    if any(c.startswith("Fused") for c in classes):
        impl = "fused"
    name = "/".join(classes) or "the optimizer"
    owner = f"{name}'s step" if classes else "the optimizer's step"
    where = (
        f"{fmt_pct(host)} of the host step" + (f", {fmt_pct(gpu)} of the GPU's" if gpu == gpu else "")
        if gpu == gpu
        else f"{fmt_pct(host)} of the step"
    )
    call = f"torch.optim.{classes[0]}(..., " if classes else "the optimizer's constructor ("
    if impl == "fused":
        advice = (
            "its update already runs fused: the time is the update itself; step less often (gradient "
            "accumulation) or update fewer parameters"
        )
    elif impl == "foreach":
        advice = f"it runs foreach; {call}fused=True) (on CUDA) fuses the update into a few kernels"
    else:
        advice = (
            f"it updates one parameter at a time: {call}foreach=True) batches the updates over all "
            "parameters, fused=True (on CUDA) fuses them into a few kernels"
        )
    return _row("optimizer", value, OPTIMIZER_SHARE, value, f"{owner} and zero_grad take {where}", f"{advice}.")


def _rank_steps(scope: Scope) -> int:
    """How many steps the scope's syncs are summed over: one per step of each rank (the
    steps table's rows), so that a figure "per step" is one rank's, as the step it is
    compared with (the syncs of 8 ranks in one step are not 8 times one step's stall)."""
    return max(len(scope.steps), 1)


def _per_step(scope: Scope) -> str:
    """The words "per step", or "per step and rank" where the scope holds several ranks."""
    several = "rank" in scope.steps and scope.steps["rank"].nunique() > 1
    return "per step and rank" if several else "per step"


def host_syncs(scope: Scope) -> tuple[float, pd.DataFrame] | None:
    """The host's waits for the GPU: (the stall of the scope's ``syncs()`` that waited —
    ``gpu_wait`` — over the steps' device windows, those syncs per name: ``calls``,
    ``total_us`` and ``max_us`` of stall, ``where`` of the longest); None without a GPU,
    steps of some length or such syncs. A CPU tensor's ``.item()`` (an optimizer's step
    count) waits for nothing and is not counted."""
    return scope.once("host_syncs", lambda: _host_syncs(scope))


def _host_syncs(scope: Scope) -> tuple[float, pd.DataFrame] | None:
    syncs = scope.syncs
    if not scope.has_gpu or scope.share is None or syncs is None or syncs.empty:
        return None
    waited = syncs[syncs["gpu_wait"].to_numpy(dtype=bool)]
    if waited.empty:
        return None
    names = waited["name"].astype(str)
    table = waited["stall_us"].groupby(names).agg(calls="size", total_us="sum", max_us="max")
    table.index.name = "name"
    longest = waited.sort_values("stall_us", ascending=False, kind="stable").drop_duplicates("name")
    table["where"] = longest.set_index(longest["name"].astype(str))["where"].astype("string")
    n_steps = _rank_steps(scope)
    window = float(scope.steps["window_dur"].sum())
    share = float(table["total_us"].sum()) / window if window > 0 else 0.0
    table["per_step_us"] = table["total_us"] / n_steps
    table["calls_per_step"] = table["calls"] / n_steps
    return share, table.sort_values("total_us", ascending=False, kind="stable")


def host_sync(scope: Scope) -> Row | None:
    """On a GPU, the host waiting for the GPU in its syncs (:func:`host_syncs`)
    ``HOST_SYNC_SHARE`` of the step or more: names the cell line that waits longest, else
    the sync, its calls and stall per step, and where the longest wait is."""
    found = host_syncs(scope)
    if found is None or found[0] < HOST_SYNC_SHARE:
        return None
    share, table = found
    named = _sync_line(scope)
    if named is not None:
        where, stall, calls = named
        return _row(
            "host_sync",
            share,
            HOST_SYNC_SHARE,
            share,
            f"{where} waits {fmt_time(stall)} for the GPU every step"
            + (" of each rank" if _per_step(scope) != "per step" else "")
            + (f" ({calls:,.0f} syncs)" if calls > 1.5 else "")
            + f"; syncs stall the host {fmt_pct(share)} of the step",
            _SYNC_ADVICE,
        )
    op = str(table.index[0])
    first = table.iloc[0]
    where = f" in {shorten(str(first['where']), 40)}" if pd.notna(first["where"]) and str(first["where"]) else ""
    return _row(
        "host_sync",
        share,
        HOST_SYNC_SHARE,
        share,
        f"The host waits for the GPU in {op} {float(first['calls_per_step']):,.0f}× {_per_step(scope)}, "
        f"{fmt_time(float(first['per_step_us']))} {_per_step(scope)}; all syncs: {fmt_pct(share)} of the step "
        f"(the longest {fmt_time(float(first['max_us']))}{where})",
        _SYNC_ADVICE,
    )


#: what ``host_sync`` advises
_SYNC_ADVICE = (
    "each sync (.item(), .cpu(), printing a tensor, torch.cuda.synchronize()) waits for all queued GPU work; "
    "keep values on the GPU inside the step, read them every N steps, and synchronize only where you time."
)


def _sync_line(scope: Scope) -> tuple[str, float, float] | None:
    """The cell line whose syncs (``syncs()`` rows that waited for the GPU) stall the host
    longest: (``line 7 `loss.item()```, stall µs per step, syncs per step); None without
    line marks or such syncs."""
    syncs = scope.syncs
    if syncs is None or syncs.empty:
        return None
    waited = syncs[syncs["gpu_wait"].to_numpy() & (syncs["line"].to_numpy() >= 0)]
    if waited.empty:
        return None
    n_steps = _rank_steps(scope)
    per_line = waited.groupby("line")["stall_us"].agg(["sum", "size"])
    line = int(per_line["sum"].idxmax())
    text = str(waited.loc[waited["line"] == line, "line_text"].iloc[0])
    where = f"line {line} `{shorten(text, 50)}`" if text else f"line {line}"
    return where, float(per_line.at[line, "sum"]) / n_steps, float(per_line.at[line, "size"]) / n_steps


#: every rule, in the order that breaks ties of ``weight``
RULES: tuple[Callable[[Scope], Row | None], ...] = (
    untypical_window,
    gpu_idle,
    memcpy,
    communication,
    dataloader,
    optimizer,
    host_sync,
    slow_step,
    top_op,
    launch_overhead,
    straggler_rule,
    memory_peak,
    fragmentation,
)


def closest(scope: Scope, limit: int = CLOSEST) -> pd.DataFrame:
    """The rules' figures that did not reach their thresholds, closest first (by figure over
    threshold), as advice rows (``COLUMNS``; ``weight`` that ratio): what the rules measured
    when none fired. Only rules with a figure in the scope (a GPU's shares on a GPU)."""
    rows: list[Row] = []

    def near(rule: str, value: float, threshold: float, figure: str, limit_text: str) -> None:
        if value == value and 0 < value < threshold:
            rows.append(_row(rule, value, threshold, value / threshold, figure, f"(threshold {limit_text})", joint=" "))

    share = scope.share
    if share is not None:
        if scope.has_gpu and share["gpu_idle_us"] == share["gpu_idle_us"]:
            for rule, column, threshold, label in (
                ("gpu_idle", "gpu_idle_us", GPU_IDLE_SHARE, "GPU idle"),
                ("memcpy", "memcpy_us", MEMCPY_SHARE, "memcpy"),
                ("communication", "comm_us", COMM_SHARE, "communication"),
            ):
                near(
                    rule,
                    float(share[column]),
                    threshold,
                    f"{label} {fmt_pct(float(share[column]))} of the step",
                    fmt_pct(threshold),
                )
        near(
            "dataloader",
            float(share["dataloader_us"]),
            DATALOADER_SHARE,
            f"data loading {fmt_pct(float(share['dataloader_us']))} of the step",
            fmt_pct(DATALOADER_SHARE),
        )
        durs = scope.steps["window_dur"].astype(float)
        median = float(durs.median())
        if len(durs) >= SLOW_STEP_MIN_STEPS and median > 0:
            ratio = float(durs.max()) / median
            near("slow_step", ratio, SLOW_STEP_RATIO, f"slowest step {ratio:.2f}× the median", f"{SLOW_STEP_RATIO:g}×")
    found = optimizer_share(scope)
    if found is not None:
        near(
            "optimizer",
            found[0],
            OPTIMIZER_SHARE,
            f"optimizer {fmt_pct(found[0])} of the step",
            fmt_pct(OPTIMIZER_SHARE),
        )
    syncs = host_syncs(scope)
    if syncs is not None:
        near(
            "host_sync",
            syncs[0],
            HOST_SYNC_SHARE,
            f"host syncs ({syncs[1].index[0]}) {fmt_pct(syncs[0])} of the step",
            fmt_pct(HOST_SYNC_SHARE),
        )
    top = scope.once("top_op", lambda: aggregate.top_ops(scope.ops, 1))
    if not top.empty and float(top["self_us"].sum()) > 0:
        pct = float(top.iloc[0]["self_pct"]) / 100
        near(
            "top_op",
            pct,
            TOP_OP_SHARE,
            f"{shorten(top.iloc[0]['name'], 40)} {fmt_pct(pct)} of CPU time",
            fmt_pct(TOP_OP_SHARE),
        )
    return _frame(rows, None).head(limit)


def evaluate(
    steps: pd.DataFrame,
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    peaks: pd.DataFrame | None = None,
    ranks: pd.DataFrame | None = None,
    *,
    device_memory_bytes: float | None = None,
    step: int | None = None,
    iterations: pd.DataFrame | None = None,
    phases: pd.DataFrame | None = None,
    lines: pd.DataFrame | None = None,
    syncs: pd.DataFrame | None = None,
    line_of: Callable[[np.ndarray], np.ndarray] | None = None,
) -> pd.DataFrame:
    """Every rule of ``RULES`` over one scope's tables; a row per rule that fired, by ``weight``.

    Args:
        steps: the scope's ``steps()`` rows (of the loop: see ``aggregate.loop_steps``).
        ops: the scope's ``ops()`` rows.
        kernels: the scope's ``kernels()`` rows (None or empty without a GPU).
        peaks: the scope's ``memory_peaks()`` rows (``aggregate.peaks_of``).
        ranks: ``ranks()`` of a job of several ranks (None otherwise).
        device_memory_bytes: the GPU's memory, for ``memory_peak``.
        step: the scope, recorded in the ``step`` column (None: the whole trace).
        iterations: a capture's ``iterations()`` (the whole trace only), for ``untypical_window``.
        phases: the scope's ``phases()`` rows (None: no ``optimizer`` rule).
        lines: the trace's ``lines()`` (None: the rules name no cell line).
        syncs: the scope's ``syncs()`` on a GPU (None: no ``host_sync`` rule).
        line_of: events rows -> their cell line, -1 for none (None: ``top_op`` names no line).

    Returns:
        The columns ``COLUMNS``; ``value`` is the figure the rule measured and ``threshold``
        the named constant it reached. ``df.attrs['closest']``: :func:`closest`, the figures
        nearest their thresholds that did not fire (so an empty table still says what the
        rules measured; :func:`lines` words both).
    """
    timed = not steps.empty and float(steps["window_dur"].sum()) > 0
    share = aggregate.step_shares(aggregate.step_means(steps)) if timed else None
    scope = Scope(
        steps, ops, kernels, peaks, ranks, device_memory_bytes, share, iterations, phases, lines, syncs, line_of
    )
    out = _frame([row for rule in RULES if (row := rule(scope)) is not None], step)
    near = closest(scope)
    near["step"] = pd.array([step] * len(near), dtype="Int64")
    out.attrs["closest"] = near
    return out


def lines(table: pd.DataFrame, limit: int = 6) -> list[str]:
    """The recommendations as the views show them, never nothing: the ``text`` of the first
    ``limit`` rows of an ``advice()`` table, or, where no rule fired, one line saying so with
    the figures closest to their thresholds (``attrs['closest']``)."""
    if len(table):
        return [str(text) for text in table["text"].head(limit)]
    near = table.attrs.get("closest")
    figures = ", ".join(str(t) for t in near["text"]) if near is not None and len(near) else ""
    return [
        f"No rule fired ({len(RULES)} rules checked, tracemagic.analysis.advice)"
        + (f"; the closest: {figures}." if figures else ".")
    ]


def straggler(ranks: pd.DataFrame) -> tuple[float, str] | None:
    """The rank the others wait for, from ``ranks()``: (its cost as a share of the median
    step, a sentence saying so), or None for fewer than two ranks.

    Where collectives were matched across ranks (``wait_us``), the straggler is the rank
    marked ``slowest`` (it waits least: it arrives last) and its cost is how much longer
    the others wait; its own step is often the *shortest*, since waiting makes a step
    long. Without that, the rank with the longest mean step.
    """
    if len(ranks) < 2 or not float(ranks["step_us"].median()) > 0:
        return None
    median_step = float(ranks["step_us"].median())
    waits = ranks["wait_us"].astype(float) if "wait_us" in ranks else pd.Series(float("nan"), index=ranks.index)
    if "slowest" in ranks and ranks["slowest"].astype(bool).any() and waits.notna().sum() >= 2:
        late = ranks[ranks["slowest"].astype(bool)].iloc[0]
        others = float(waits.drop(late.name).median())
        its = float(waits[late.name]) if pd.notna(waits[late.name]) else 0.0
        cost = max(others - its, 0.0) / median_step
        return cost, (
            f"Rank {int(late['rank'])} is the straggler: the other ranks wait for it in collectives "
            f"({fmt_time(others)} per step for the median rank, {fmt_time(its)} for rank {int(late['rank'])}, "
            f"{fmt_pct(cost)} of the median step)"
        )
    worst = ranks.loc[ranks["step_us"].idxmax()]
    excess = float(worst["step_us"]) / median_step - 1
    return excess, (
        f"Rank {int(worst['rank'])} is {fmt_pct(excess)} slower than the median rank: the others wait for "
        "it at each collective"
    )


def roofline_gaps(efficiency: pd.DataFrame, limit: int = 3, min_share: float = ROOFLINE_MIN_SHARE) -> pd.DataFrame:
    """The op × shapes of ``efficiency()`` with the most GPU time lost to their roof, as
    advice rows (``COLUMNS``; rule ``roofline``), largest loss first.

    The loss is GPU time × (1 − its share of the roof), summed over the ranks where the same
    op × shapes × dtypes ran (one row, "on N ranks"); ``value`` is the share of the roof over
    all their GPU time, ``weight`` the loss as a share of all of the table's GPU time, and
    ``threshold`` ``min_share``: a gap losing less than that share of the GPU time is left
    out (a 47 µs op of a 57 ms trace is no headline). Rows without a cost model are left out.
    """
    rows: list[Row] = []
    layers = list(efficiency.attrs.get("layers") or [])
    efficiency = pd.DataFrame(efficiency)  # without its attrs: pandas deep-copies them at every step
    known = (
        efficiency[efficiency["pct_of_roofline"].notna() & (efficiency["gpu_us"] > 0)]
        if len(efficiency)
        else efficiency
    )
    total = float(efficiency["gpu_us"].sum()) if len(efficiency) else 0.0
    if len(known) and total > 0:
        lost = known["gpu_us"] * (1 - known["pct_of_roofline"].clip(upper=100) / 100)
        key = known[["name", "input_dims", "input_type", "precision"]].fillna("").astype(str).agg("\x1f".join, axis=1)
        merged = pd.DataFrame(
            {
                "key": key,
                "lost": lost,
                "gpu_us": known["gpu_us"].astype(float),
                "rank": known.get("rank", 0),
            }
        )
        groups = merged.groupby("key", sort=False).agg(
            lost=("lost", "sum"), gpu_us=("gpu_us", "sum"), ranks=("rank", "nunique"), first=("lost", "idxmax")
        )
        for _, group in groups.sort_values("lost", ascending=False).head(limit).iterrows():
            weight = float(group["lost"]) / total
            if weight < min_share:
                break
            index = group["first"]
            row = known.loc[index]
            where = layers[efficiency.index.get_loc(index)] if len(layers) == len(efficiency) else ""
            device = row["device"] if isinstance(row["device"], str) else "the given"
            shape = (
                f"{shorten(str(row['name']), 50)} {shorten(str(row['input_dims']), 50)} "
                f"({shorten(fmt_dtypes(row['input_type']), 30)})"
            )
            gpu_us = float(group["gpu_us"])
            pct = 1 - float(group["lost"]) / gpu_us
            if row["bound"] == "compute" and row["precision"] in _LOW_PRECISION:
                roof = f"{float(row['peak_tflops']):g} TFLOP/s"  # its roof is already its 16/8-bit one
                advice = "compute-bound at this shape, already in a low precision: larger matrices reach more of it"
            elif row["bound"] == "compute":
                roof = f"{float(row['peak_tflops']):g} TFLOP/s"
                advice = (
                    "compute-bound at this shape: a lower precision (BF16/FP16, TF32 for float32) or larger "
                    "matrices reach more of it"
                )
            elif row["intensity"] == row["intensity"]:
                roof = f"{float(row['peak_tbytes_per_s']):g} TB/s"
                advice = (
                    f"memory-bound at this shape ({float(row['intensity']):.2g} FLOP/byte): fusing it with its "
                    "neighbours (torch.compile) or a lower precision moves fewer bytes"
                )
            else:
                roof = f"{float(row['peak_tbytes_per_s']):g} TB/s"
                advice = "memory-bound: fusing it with its neighbours (torch.compile) moves fewer bytes"
            layer = f" in {shorten(where, 60)}" if where else ""
            ranks = f" on {int(group['ranks'])} ranks" if int(group["ranks"]) > 1 else ""
            part = gpu_us / total
            evidence = (
                f"{shape}{layer} runs at {fmt_pct(pct)} of {device} {roof} over {fmt_time(gpu_us)} of GPU "
                f"time{ranks} ({f'{100 * part:.1f}%' if part < 0.095 else fmt_pct(part)} of the GPU time of "
                "ops with shapes)"
            )
            rows.append(_row("roofline", pct, min_share, weight, evidence, f"it is {advice}.", joint="; "))
    return _frame(rows, None)


def _frame(rows: list[Row], step: int | None) -> pd.DataFrame:
    """Advice rows as the ``COLUMNS`` table, by ``weight`` (ties in the rules' order)."""
    rows = sorted(rows, key=lambda row: -row[3])  # stable: ties keep the rules' order
    rule, value, threshold, weight, evidence, advice_, text = (list(c) for c in zip(*rows)) if rows else ([],) * 7
    return pd.DataFrame(
        {
            "rule": pd.array(rule, dtype="string"),
            "step": pd.array([step] * len(rows), dtype="Int64"),
            "value": np.asarray(value, dtype=float),
            "threshold": np.asarray(threshold, dtype=float),
            "weight": np.asarray(weight, dtype=float),
            "evidence": pd.array(evidence, dtype="string"),
            "advice": pd.array(advice_, dtype="string"),
            "text": pd.array(text, dtype="string"),
        }
    )


def device_memory(devices: list[dict[str, Any]]) -> float | None:
    """The GPU memory the trace's metadata gives (``trace.devices``: the first device's), or None."""
    return next((float(d["memory_bytes"]) for d in devices or [] if d.get("memory_bytes")), None)


@computes("advice")
def advice(trace: TraceTables, step: int | None = None) -> pd.DataFrame:
    """The recommendations for ``trace`` (of one ProfilerStep, given ``step``): the rules of
    this module over its tables, a row per rule that fired, most important first.

    The steps holding only a ``%%chakra_trace`` loop's exit, or cut short by the cell's error,
    are left out, as the views do (``aggregate.loop_steps``);
    the ``straggler`` rule looks at the whole trace of several ranks only.
    """
    manifest: Mapping[str, Any] | None = getattr(trace, "manifest", None)
    steps = aggregate.select_step(aggregate.loop_steps(trace.table(_steps.steps), manifest), step)
    ops = aggregate.select_step(trace.table(_ops.ops), step)
    kernels = aggregate.select_step(trace.table(_kernels.kernels), step) if trace.has_gpu else None
    # the memory rules read GPU peaks alone: no memory_peaks() where every allocation is on the CPU
    peaks = aggregate.peaks_of(trace.table(_memory.peaks), step) if memory_off_cpu(trace) else None
    ranks = trace.table(_ranks.ranks) if len(trace.rank_ids) > 1 and step is None else None
    phases: pd.DataFrame | None = None  # only the optimizer rule reads phases(): none without an optimizer step
    if any(_phases.OPTIMIZER.match(str(c)) for c in trace.events["name"].cat.categories.tolist()):
        phases = trace.table(_phases.optimizer_phases)  # its columns alone: no forward phase computed
        phases = aggregate.of_steps(phases, steps)
    loop = trace.table(_iterations.iterations) if step is None and manifest else None
    lines = line_of = None
    # the host_sync rule's figure, on a GPU (its rows name cell lines where the trace has line marks)
    syncs = aggregate.of_steps(trace.table(_syncs.syncs), steps) if kernels is not None else None
    if _lines.marks(trace)[1].size:  # a %%chakra_trace capture with line marks: the rules name lines
        lines = trace.table(_lines.lines)

        def line_of(rows: np.ndarray) -> np.ndarray:
            return _lines.line_of_rows(trace, rows)

    return evaluate(
        steps,
        ops,
        kernels,
        peaks,
        ranks,
        device_memory_bytes=device_memory(trace.devices),
        step=step,
        iterations=loop,
        phases=phases,
        lines=lines,
        syncs=syncs,
        line_of=line_of,
    )
