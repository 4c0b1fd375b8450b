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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tracemagic.analysis import aggregate
from tracemagic.analysis import kernels as _kernels
from tracemagic.analysis import memory as _memory
from tracemagic.analysis import ops as _ops
from tracemagic.analysis import ranks as _ranks
from tracemagic.analysis import steps as _steps
from tracemagic.analysis._text import fmt_bytes, fmt_pct, fmt_time, shorten

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import Trace

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
    "aten::item": "each .item() turns a tensor into a Python number; keep values as tensors inside the step",
    "aten::_local_scalar_dense": "each .item() turns a tensor into a Python number; keep values as tensors inside the step",
    "aten::nonzero": "nonzero/masked indexing makes outputs of data-dependent size",
}
#: what to say about any other op that dominates CPU time
OTHER_OP_ADVICE = "look at its callers in the Layers and Timeline tabs"

#: the columns of ``advice()`` (``tracemagic.analysis``)
COLUMNS = ["rule", "step", "value", "threshold", "weight", "evidence", "advice", "text"]


def evaluate(
    steps: pd.DataFrame,
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    peaks: pd.DataFrame | None = None,
    ranks: pd.DataFrame | None = None,
    *,
    device_memory_bytes: float | None = None,
    step: int | None = None,
) -> pd.DataFrame:
    """Every rule over one scope's tables; a row per rule that fired, by ``weight``.

    Args:
        steps: the scope's ``steps()`` rows (of the loop: see ``aggregate.loop_steps``).
        ops: the scope's ``ops()`` rows.
        kernels: the scope's ``kernels()`` rows (None or empty without a GPU).
        peaks: the scope's ``memory_peaks()`` rows (``aggregate.peaks_of``).
        ranks: ``ranks()`` of a job of several ranks (None otherwise).
        device_memory_bytes: the GPU's memory, for ``memory_peak``.
        step: the scope, recorded in the ``step`` column (None: the whole trace).

    Returns:
        The columns ``COLUMNS``; ``value`` is the figure the rule measured and ``threshold``
        the named constant it reached.
    """
    rows: list[tuple[str, float, float, float, str, str, str]] = []

    def fire(rule: str, value: float, threshold: float, weight: float, evidence: str, advice: str,
             joint: str = ": ") -> None:
        rows.append((rule, value, threshold, weight, evidence, advice, f"{evidence}{joint}{advice}"))

    dataloader_said = False
    has_gpu = kernels is not None and not kernels.empty
    if not steps.empty and float(steps["window_dur"].sum()) > 0:
        share = aggregate.step_shares(aggregate.step_means(steps))
        if has_gpu and share["gpu_idle_us"] == share["gpu_idle_us"]:  # NaN: no GPU on these ranks
            idle = float(share["gpu_idle_us"])
            if idle >= GPU_IDLE_SHARE:
                fire("gpu_idle", idle, GPU_IDLE_SHARE, idle, f"GPU idle {fmt_pct(idle)} of the step",
                     "the GPU waits for the CPU; bigger batches, fewer syncs, CUDA graphs or torch.compile keep it busy.")
            if share["memcpy_us"] >= MEMCPY_SHARE:
                fire("memcpy", float(share["memcpy_us"]), MEMCPY_SHARE, float(share["memcpy_us"]),
                     f"memcpy takes {fmt_pct(share['memcpy_us'])} of the step",
                     "use pin_memory=True and .to(device, non_blocking=True).")
            if share["comm_us"] >= COMM_SHARE:
                fire("communication", float(share["comm_us"]), COMM_SHARE, float(share["comm_us"]),
                     f"Communication takes {fmt_pct(share['comm_us'])} of the step",
                     "overlap it with compute (bucketed DDP/FSDP) or shrink what is sent.")
        if share["dataloader_us"] >= DATALOADER_SHARE:
            dataloader_said = True
            fire("dataloader", float(share["dataloader_us"]), DATALOADER_SHARE, float(share["dataloader_us"]) + DATALOADER_BONUS,
                 f"DataLoader takes {fmt_pct(share['dataloader_us'])} of the step",
                 "raise num_workers, use pin_memory and persistent_workers.")
        durs = steps["window_dur"].astype(float)
        median = float(durs.median())
        if len(durs) >= SLOW_STEP_MIN_STEPS and median > 0 and durs.max() > SLOW_STEP_RATIO * median:
            slow = steps.loc[durs.idxmax()]
            ratio = float(durs.max()) / median
            fire("slow_step", ratio, SLOW_STEP_RATIO, SLOW_STEP_WEIGHT,
                 f"Step {int(slow['step'])} takes {fmt_time(float(slow['window_dur']))}, {ratio:.1f}× the median step "
                 f"({fmt_time(median)})", "warm-up, recompilation or a data stall.")
    top = aggregate.top_ops(ops, 1)
    if not top.empty and float(top["self_us"].sum()) > 0:
        first = top.iloc[0]
        pct = float(first["self_pct"]) / 100
        if pct >= TOP_OP_SHARE and not (dataloader_said and "DataLoader" in str(first["name"])):  # said already
            advice = (OP_ADVICE if has_gpu else CPU_OP_ADVICE).get(str(first["name"]), OTHER_OP_ADVICE)
            fire("top_op", pct, TOP_OP_SHARE, pct * TOP_OP_DISCOUNT,
                 f"{shorten(first['name'], 60)} is {fmt_pct(pct)} of CPU time ({int(first['calls']):,} calls)", f"{advice}.")
    if kernels is not None and has_gpu:
        rate = aggregate.kernel_rate(kernels, steps)
        if rate["per_step"] >= KERNELS_PER_STEP and rate["mean_us"] < SHORT_KERNEL_US:
            fire("launch_overhead", float(rate["per_step"]), KERNELS_PER_STEP, LAUNCH_WEIGHT,
                 f"{int(rate['kernels']) // int(rate['steps']):,} kernels per step averaging {fmt_time(float(rate['mean_us']))}",
                 "launch overhead dominates; fuse with torch.compile or CUDA graphs.")
    late = straggler(ranks) if ranks is not None else None
    if late is not None and late[0] >= STRAGGLER_SHARE:
        fire("straggler", late[0], STRAGGLER_SHARE, late[0] + STRAGGLER_BONUS, late[1],
             "check its data, placement and load balance.", joint="; ")
    if peaks is not None and not peaks.empty:
        gpu = peaks[peaks["device"].astype(str) != "cpu"]
        if device_memory_bytes and not gpu.empty:
            frac = float(gpu["peak_bytes"].max()) / device_memory_bytes
            if frac >= MEMORY_PEAK_SHARE:
                fire("memory_peak", frac, MEMORY_PEAK_SHARE, frac,
                     f"Peak memory is {fmt_pct(frac)} of the GPU's {fmt_bytes(device_memory_bytes)}",
                     "activation checkpointing or a smaller batch leaves headroom.")
        reserved = gpu["peak_reserved_bytes"].astype(float) if not gpu.empty else pd.Series(dtype=float)
        if not gpu.empty and reserved.notna().any():
            ratio = float(reserved.max()) / max(float(gpu["peak_bytes"].max()), 1.0)
            if ratio >= RESERVED_RATIO and float(reserved.max()) > RESERVED_MIN_BYTES:
                fire("fragmentation", ratio, RESERVED_RATIO, FRAGMENTATION_WEIGHT,
                     f"Reserved memory is {ratio:.1f}× the allocated peak",
                     "fragmentation; try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    return _frame(rows, step)


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
        return cost, (f"Rank {int(late['rank'])} is the straggler: the other ranks wait for it in collectives "
                      f"({fmt_time(others)} per step for the median rank, {fmt_time(its)} for rank {int(late['rank'])}, "
                      f"{fmt_pct(cost)} of the median step)")
    worst = ranks.loc[ranks["step_us"].idxmax()]
    excess = float(worst["step_us"]) / median_step - 1
    return excess, (f"Rank {int(worst['rank'])} is {fmt_pct(excess)} slower than the median rank: the others wait for "
                    "it at each collective")


def roofline_gaps(efficiency: pd.DataFrame, limit: int = 3) -> pd.DataFrame:
    """The op × shapes of ``efficiency()`` with the most GPU time lost to their roof, as
    advice rows (``COLUMNS``; rule ``roofline``), largest loss first.

    The loss is GPU time × (1 − its share of the roof); ``value`` is that share,
    ``weight`` the loss as a share of all of the table's GPU time. Rows without a cost
    model are left out.
    """
    rows: list[tuple[str, float, float, float, str, str, str]] = []
    layers = list(efficiency.attrs.get("layers") or [])
    efficiency = pd.DataFrame(efficiency)  # without its attrs: pandas deep-copies them at every step
    known = efficiency[efficiency["pct_of_roofline"].notna() & (efficiency["gpu_us"] > 0)] if len(efficiency) else efficiency
    total = float(efficiency["gpu_us"].sum()) if len(efficiency) else 0.0
    if len(known) and total > 0:
        lost = known["gpu_us"] * (1 - known["pct_of_roofline"].clip(upper=100) / 100)
        for index in lost.sort_values(ascending=False).index[:limit]:
            row = known.loc[index]
            where = layers[efficiency.index.get_loc(index)] if len(layers) == len(efficiency) else ""
            device = row["device"] if isinstance(row["device"], str) else "the given"
            shape = (f"{shorten(str(row['name']), 50)} {shorten(str(row['input_dims']), 50)} "
                     f"({shorten(str(row['input_type']), 30)})")
            pct = float(row["pct_of_roofline"]) / 100
            if row["bound"] == "compute":
                roof = f"{float(row['peak_tflops']):g} TFLOP/s"
                advice = ("compute-bound at this shape: a lower precision (BF16/FP16, TF32 for float32) or larger "
                          "matrices reach more of it")
            elif row["intensity"] == row["intensity"]:
                roof = f"{float(row['peak_tbytes_per_s']):g} TB/s"
                advice = (f"memory-bound at this shape ({float(row['intensity']):.2g} FLOP/byte): fusing it with its "
                          "neighbours (torch.compile) or a lower precision moves fewer bytes")
            else:
                roof = f"{float(row['peak_tbytes_per_s']):g} TB/s"
                advice = "memory-bound: fusing it with its neighbours (torch.compile) moves fewer bytes"
            layer = f" in {shorten(where, 60)}" if where else ""
            evidence = f"{shape}{layer} runs at {fmt_pct(pct)} of {device} {roof} over {fmt_time(float(row['gpu_us']))} of GPU time"
            rows.append(("roofline", pct, float("nan"), float(lost[index]) / total, evidence, f"it is {advice}.",
                         f"{evidence}; it is {advice}."))
    return _frame(rows, None)


def _frame(rows: list[tuple[str, float, float, float, str, str, str]], step: int | None) -> pd.DataFrame:
    """Advice rows as the ``COLUMNS`` table, by ``weight`` (ties in the rules' order)."""
    rows = sorted(rows, key=lambda row: -row[3])  # stable: ties keep the rules' order
    rule, value, threshold, weight, evidence, advice_, text = (list(c) for c in zip(*rows)) if rows else ([],) * 7
    return pd.DataFrame({
        "rule": pd.array(rule, dtype="string"), "step": pd.array([step] * len(rows), dtype="Int64"),
        "value": np.asarray(value, dtype=float), "threshold": np.asarray(threshold, dtype=float),
        "weight": np.asarray(weight, dtype=float), "evidence": pd.array(evidence, dtype="string"),
        "advice": pd.array(advice_, dtype="string"), "text": pd.array(text, dtype="string"),
    })


def device_memory(devices: list[dict[str, Any]]) -> float | None:
    """The GPU memory the trace's metadata gives (``trace.devices``: the first device's), or None."""
    return next((float(d["memory_bytes"]) for d in devices or [] if d.get("memory_bytes")), None)


def advice(trace: Trace, step: int | None = None) -> pd.DataFrame:
    """The recommendations for ``trace`` (of one ProfilerStep, given ``step``): the rules of
    this module over its tables, a row per rule that fired, most important first.

    The steps holding only a ``%%chakra_trace`` loop's exit are left out, as the views do;
    the ``straggler`` rule looks at the whole trace of several ranks only.
    """
    manifest: Mapping[str, Any] | None = getattr(trace, "manifest", None)
    steps = aggregate.select_step(aggregate.loop_steps(trace.table(_steps.steps), manifest), step)
    ops = aggregate.select_step(trace.table(_ops.ops), step)
    kernels = aggregate.select_step(trace.table(_kernels.kernels), step) if trace.has_gpu else None
    peaks = aggregate.peaks_of(trace.table(_memory.peaks), step)
    ranks = trace.table(_ranks.ranks) if len(trace.rank_ids) > 1 and step is None else None
    return evaluate(steps, ops, kernels, peaks, ranks, device_memory_bytes=device_memory(trace.devices), step=step)
