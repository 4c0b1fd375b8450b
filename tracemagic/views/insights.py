"""Short, specific recommendations and headline facts drawn from the analyses' numbers.

Plain text (no markup): the views escape it where they show it.
"""

from __future__ import annotations

import pandas as pd

from tracemagic.views import tables
from tracemagic.views._format import fmt_bytes, fmt_pct, fmt_time, shorten
from tracemagic.views.data import TraceData

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


def recommendations(
    steps: pd.DataFrame,
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    peaks: pd.DataFrame | None = None,
    ranks: pd.DataFrame | None = None,
    *,
    device_memory_bytes: float | None = None,
    limit: int = 6,
) -> list[str]:
    """Up to ``limit`` one-line recommendations, most important first.

    Args:
        steps: ``trace.steps()``.
        ops: ``trace.ops()``.
        kernels: ``trace.kernels()`` (None or empty without a GPU).
        peaks: ``trace.memory_peaks()`` rows of the scope (``tables.peaks_of``).
        ranks: ``trace.ranks()`` (for several ranks).
        device_memory_bytes: the GPU's memory, to flag a peak close to it.
        limit: the most recommendations returned.
    """
    found: list[tuple[float, str]] = []  # (weight, text)
    dataloader_said = False
    has_gpu = kernels is not None and not kernels.empty
    if not steps.empty and float(steps["window_dur"].sum()) > 0:
        mean = tables.step_means(steps)
        dur = float(mean["step_us"])
        share = {c: float(mean.get(c, 0.0)) / dur for c in tables.STEP_PARTS}
        if has_gpu and mean["gpu_idle_us"] == mean["gpu_idle_us"]:  # NaN: no GPU on these ranks
            idle = float(mean["gpu_idle_us"]) / dur
            if idle >= 0.2:
                found.append((idle, f"GPU idle {fmt_pct(idle)} of the step: the GPU waits for the CPU; bigger "
                                    "batches, fewer syncs, CUDA graphs or torch.compile keep it busy."))
            if share["memcpy_us"] >= 0.1:
                found.append((share["memcpy_us"], f"memcpy takes {fmt_pct(share['memcpy_us'])} of the step: use "
                                                  "pin_memory=True and .to(device, non_blocking=True)."))
            if share["comm_us"] >= 0.2:
                found.append((share["comm_us"], f"Communication takes {fmt_pct(share['comm_us'])} of the step: "
                                                "overlap it with compute (bucketed DDP/FSDP) or shrink what is sent."))
        if share["dataloader_us"] >= 0.1:
            dataloader_said = True
            found.append((share["dataloader_us"] + 0.05, f"DataLoader takes {fmt_pct(share['dataloader_us'])} of the "
                                                         "step: raise num_workers, use pin_memory and persistent_workers."))
        durs = steps["window_dur"].astype(float)
        if len(durs) >= 3 and durs.median() > 0 and durs.max() > 1.5 * durs.median():
            slow = steps.loc[durs.idxmax()]
            found.append((0.15, f"Step {int(slow['step'])} takes {fmt_time(float(slow['window_dur']))}, "
                                f"{durs.max() / durs.median():.1f}× the median step ({fmt_time(float(durs.median()))}): "
                                "warm-up, recompilation or a data stall."))
    top = tables.top_ops(ops, 3)
    if not top.empty and float(top["self_us"].sum()) > 0:
        first = top.iloc[0]
        pct = float(first["self_pct"]) / 100
        if pct >= 0.2 and not (dataloader_said and "DataLoader" in str(first["name"])):  # said already
            advice = (OP_ADVICE if has_gpu else CPU_OP_ADVICE).get(str(first["name"]),
                                                                   "look at its callers in the Layers and Timeline tabs")
            found.append((pct * 0.9, f"{shorten(first['name'], 60)} is {fmt_pct(pct)} of CPU time "
                                     f"({int(first['calls']):,} calls): {advice}."))
    if kernels is not None and has_gpu:
        kern = kernels[kernels["kind"].astype(str) == "kernel"]
        n_steps = max(int(steps["step"].nunique()) if not steps.empty else 1, 1)
        if len(kern) / n_steps >= 1000 and float(kern["dur"].mean()) < 10:
            found.append((0.3, f"{len(kern) // n_steps:,} kernels per step averaging {fmt_time(float(kern['dur'].mean()))}: "
                               "launch overhead dominates; fuse with torch.compile or CUDA graphs."))
    late = straggler(ranks) if ranks is not None else None
    if late is not None and late[0] >= 0.05:
        found.append((late[0] + 0.1, f"{late[1]}; check its data, placement and load balance."))
    if peaks is not None and not peaks.empty:
        gpu = peaks[peaks["device"].astype(str) != "cpu"]
        if device_memory_bytes and not gpu.empty:
            frac = float(gpu["peak_bytes"].max()) / device_memory_bytes
            if frac >= 0.85:
                found.append((frac, f"Peak memory is {fmt_pct(frac)} of the GPU's {fmt_bytes(device_memory_bytes)}: "
                                    "activation checkpointing or a smaller batch leaves headroom."))
        reserved = gpu["peak_reserved_bytes"].astype(float) if not gpu.empty else pd.Series(dtype=float)
        if not gpu.empty and reserved.notna().any():
            ratio = float(reserved.max()) / max(float(gpu["peak_bytes"].max()), 1.0)
            if ratio >= 1.5 and float(reserved.max()) > 256 * 2**20:
                found.append((0.2, f"Reserved memory is {ratio:.1f}× the allocated peak: fragmentation; try "
                                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."))
    found.sort(key=lambda wt: -wt[0])
    return [text for _, text in found[:limit]]


def straggler(ranks: pd.DataFrame) -> tuple[float, str] | None:
    """The rank the others wait for, from ``trace.ranks()``: (its cost as a share of
    the median step, a sentence saying so), or None for fewer than two ranks.

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


def facts(data: TraceData, step: int | None = None) -> list[tuple[str, str]]:
    """Headline (label, value) pairs for the Overview: devices, ranks, steps, step time
    and its breakdown, kernels, peak memory, events; of one step given ``step``."""
    out: list[tuple[str, str]] = [("trace", data.name)]
    counts = pd.Series(data.devices).value_counts()
    devices = ", ".join(f"{n} × {name}" if n > 1 else name for name, n in counts.items())
    memory_bytes = device_memory(data)
    if memory_bytes:
        devices += f" ({fmt_bytes(memory_bytes)} each)" if len(data.devices) > 1 else f" ({fmt_bytes(memory_bytes)})"
    kernels = data.kernels
    if len(data.devices) > 1 and not kernels.empty:  # the metadata lists every GPU the process could see
        used = sorted({int(d) for d in kernels["device"].dropna()})
        if 0 < len(used) < len(data.devices):
            devices += f" visible; work on GPU {', '.join(map(str, used))}"
    out.append(("devices", devices))
    if data.several_ranks:
        out.append(("ranks", f"{len(data.ranks)} ({', '.join(map(str, data.ranks[:16]))}{'…' if len(data.ranks) > 16 else ''})"))
    steps = data.steps
    chosen = tables.select_step(steps, step)
    if steps.empty:
        out.append(("steps", "none (no ProfilerStep in the trace)"))
    else:
        mean = tables.step_means(chosen)
        numbered = [s for s in data.step_ids if s >= 0]
        listed = f"{len(numbered)} ({', '.join(map(str, numbered[:12]))}{'…' if len(numbered) > 12 else ''})"
        if len(numbered) < len(data.step_ids):  # step -1: a rank without ProfilerStep, one span
            listed = ("none (no ProfilerStep: the whole trace is one span)" if not numbered
                      else listed + "; ranks without ProfilerStep: one span each (step -1)")
        if data.loop_exit_steps:
            listed += (f"; step {', '.join(map(str, data.loop_exit_steps))} holds only the loop's exit and is not "
                       "counted")
        out.append(("steps", listed))
        step_us = float(mean["step_us"])
        if step is None:
            durs = steps["window_dur"].astype(float)
            out.append(("mean step", fmt_time(step_us) + (f" (median {fmt_time(float(durs.median()))})"
                                                          if len(durs) >= 3 else "")))
        else:
            out.append((f"step {step}", fmt_time(step_us) + (" (mean over ranks)" if len(chosen) > 1 else "")))
        parts = [(name, float(mean.get(col, 0.0)) / step_us) for col, name in tables.part_names(steps).items()
                 if col in mean and step_us > 0 and float(mean.get(col, 0.0)) >= 0.005 * step_us]
        out.append(("breakdown", ", ".join(f"{name} {fmt_pct(p)}" for name, p in sorted(parts, key=lambda x: -x[1]))))
        if step_us > 0 and mean["gpu_busy_us"] == mean["gpu_busy_us"]:  # NaN without a GPU
            busy = float(mean["gpu_busy_us"]) / step_us
            out.append(("GPU", f"busy {fmt_pct(busy)}, idle {fmt_pct(1.0 - busy)} of the step"))
        unlaunched = steps.attrs.get("unlaunched") or {}
        if unlaunched:
            events = sum(int(v["events"]) for v in unlaunched.values())
            us = sum(float(v["us"]) for v in unlaunched.values())
            out.append(("in flight", f"{events:,} GPU events ({fmt_time(us)}) running when profiling began, in no step"))
    kern = tables.select_step(kernels, step)
    kern = kern[kern["kind"].astype(str) == "kernel"] if not kern.empty else kern
    if len(kern):
        per_step = len(kern) // max(int(chosen["step"].nunique()) if not steps.empty else 1, 1)
        out.append(("kernels", f"{len(kern):,} ({per_step:,} per step, {fmt_time(float(kern['dur'].mean()))} on average)"))
    peaks = tables.peaks_of(data.memory_peaks, step)
    if not peaks.empty:
        top = peaks.sort_values("peak_bytes", ascending=False).head(4)
        out.append(("peak memory" + (f" in step {step}" if step is not None else ""),
                    "; ".join((f"rank {row['rank']} · " if data.several_ranks else "") + peak_text(row, step)
                              for _, row in top.iterrows())))
    if data.has_gpu and step is None:
        gaps = roofline_gaps(data.efficiency, 1)
        if gaps:
            out.append(("furthest below its roof", gaps[0]))
    table = getattr(data.trace, "events", None)
    if table is not None:
        out.append(("events", f"{len(table):,}"))
    return out


def peak_text(row: pd.Series, step: int | None = None, *, device: bool = True) -> str:
    """One ``memory_peaks()`` row as text: the peak, what was allocated before the scope
    began, and the peak reserved bytes where recorded."""
    text = (f"{row['device']}: " if device else "") + f"{fmt_bytes(row['peak_bytes'])} ("
    text += f"{fmt_bytes(row['start_bytes'])} already allocated at the {'capture' if step is None else 'step'}'s start"
    reserved = row.get("peak_reserved_bytes")
    if reserved is not None and pd.notna(reserved) and float(reserved) > 0:
        text += f"; reserved {fmt_bytes(reserved)}"
    return text + ")"


def roofline_gap_weights(efficiency: pd.DataFrame, limit: int = 3) -> list[tuple[float, str]]:
    """The op × shapes with the most GPU time lost to their roof (GPU time × (1 − % of the
    roof)), as (share of the modelled GPU time, advice), largest first."""
    if efficiency is None or efficiency.empty:
        return []
    known = efficiency[efficiency["pct_of_roofline"].notna() & (efficiency["gpu_us"] > 0)]
    total = float(efficiency["gpu_us"].sum())
    if known.empty or total <= 0:
        return []
    layers = list(efficiency.attrs.get("layers") or [])
    lost = known["gpu_us"] * (1 - known["pct_of_roofline"].clip(upper=100) / 100)
    out = []
    for index in lost.sort_values(ascending=False).index[:limit]:
        row = known.loc[index]
        where = layers[efficiency.index.get_loc(index)] if len(layers) == len(efficiency) else ""
        device = row["device"] if isinstance(row["device"], str) else "the given"
        shape = f"{shorten(str(row['name']), 50)} {shorten(str(row['input_dims']), 50)} ({shorten(str(row['input_type']), 30)})"
        pct = float(row["pct_of_roofline"]) / 100
        if row["bound"] == "compute":
            roof = f"{float(row['peak_tflops']):g} TFLOP/s"
            advice = "compute-bound at this shape: a lower precision (BF16/FP16, TF32 for float32) or larger matrices reach more of it"
        else:
            roof = f"{float(row['peak_tbytes_per_s']):g} TB/s"
            advice = (f"memory-bound at this shape ({float(row['intensity']):.2g} FLOP/byte): fusing it with its "
                      "neighbours (torch.compile) or a lower precision moves fewer bytes") if row["intensity"] == row["intensity"] \
                else "memory-bound: fusing it with its neighbours (torch.compile) moves fewer bytes"
        layer = f" in {shorten(where, 60)}" if where else ""
        out.append((float(lost[index]) / total, f"{shape}{layer} runs at {fmt_pct(pct)} of {device} {roof} "
                                                f"over {fmt_time(float(row['gpu_us']))} of GPU time; it is {advice}."))
    return out


def roofline_gaps(efficiency: pd.DataFrame, limit: int = 3) -> list[str]:
    """``roofline_gap_weights`` as text: the largest gaps between ops and their roof."""
    return [text for _, text in roofline_gap_weights(efficiency, limit)]


def device_memory(data: TraceData) -> float | None:
    """The GPU memory the trace's metadata gives (the first device's), or None."""
    devices = getattr(data.trace, "devices", []) or []
    return next((float(d["memory_bytes"]) for d in devices if d.get("memory_bytes")), None)


def for_trace(data: TraceData, limit: int = 6, step: int | None = None) -> list[str]:
    """:func:`recommendations` for a ``TraceData`` (of one step, given ``step``)."""
    return recommendations(
        tables.select_step(data.steps, step), tables.select_step(data.ops, step),
        tables.select_step(data.kernels, step) if data.has_gpu else None, tables.peaks_of(data.memory_peaks, step),
        data.ranks_table if data.several_ranks and step is None else None, device_memory_bytes=device_memory(data),
        limit=limit,
    )
