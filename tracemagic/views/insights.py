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


def recommendations(
    steps: pd.DataFrame,
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    memory: pd.DataFrame | None = None,
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
        memory: ``trace.memory()``.
        ranks: ``trace.ranks_table()`` (for several ranks).
        device_memory_bytes: the GPU's memory, to flag a peak close to it.
        limit: the most recommendations returned.
    """
    found: list[tuple[float, str]] = []  # (weight, text)
    dataloader_said = False
    has_gpu = kernels is not None and not kernels.empty
    if not steps.empty and float(steps["dur"].sum()) > 0:
        mean = tables.step_means(steps)
        dur = float(mean["dur"])
        share = {c: float(mean.get(c, 0.0)) / dur for c in tables.STEP_PARTS}
        if has_gpu:
            busy = sum(share[c] for c in ("compute_us", "comm_us", "memcpy_us", "memset_us"))
            idle = 1.0 - busy
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
        durs = steps["dur"].astype(float)
        if len(durs) >= 3 and durs.median() > 0 and durs.max() > 1.5 * durs.median():
            slow = steps.loc[durs.idxmax()]
            found.append((0.15, f"Step {int(slow['step'])} takes {fmt_time(float(slow['dur']))}, "
                                f"{durs.max() / durs.median():.1f}× the median step ({fmt_time(float(durs.median()))}): "
                                "warm-up, recompilation or a data stall."))
    top = tables.top_ops(ops, 3)
    if not top.empty and float(top["self_us"].sum()) > 0:
        first = top.iloc[0]
        pct = float(first["self_pct"]) / 100
        if pct >= 0.2 and not (dataloader_said and "DataLoader" in str(first["name"])):  # said already
            advice = OP_ADVICE.get(str(first["name"]), "look at its callers in the Layers and Timeline tabs")
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
    if memory is not None and not memory.empty:
        peaks = tables.peak_memory(memory)
        gpu = peaks[peaks["device"].astype(str) != "cpu"]
        if device_memory_bytes and not gpu.empty:
            frac = float(gpu["peak_bytes"].max()) / device_memory_bytes
            if frac >= 0.85:
                found.append((frac, f"Peak memory is {fmt_pct(frac)} of the GPU's {fmt_bytes(device_memory_bytes)}: "
                                    "activation checkpointing or a smaller batch leaves headroom."))
        reserved = gpu["reserved_bytes"].astype(float) if not gpu.empty else pd.Series(dtype=float)
        if not gpu.empty and reserved.notna().any():
            ratio = float(reserved.max()) / max(float(gpu["peak_bytes"].max()), 1.0)
            if ratio >= 1.5 and float(reserved.max()) > 256 * 2**20:
                found.append((0.2, f"Reserved memory is {ratio:.1f}× the allocated peak: fragmentation; try "
                                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."))
    found.sort(key=lambda wt: -wt[0])
    return [text for _, text in found[:limit]]


def straggler(ranks: pd.DataFrame) -> tuple[float, str] | None:
    """The rank the others wait for, from ``trace.ranks_table()``: (its cost as a share of
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


def facts(data: TraceData) -> list[tuple[str, str]]:
    """Headline (label, value) pairs for the Overview: devices, ranks, steps, step time,
    GPU busy share, peak memory, events."""
    out: list[tuple[str, str]] = [("trace", data.name)]
    counts = pd.Series(data.devices).value_counts()
    devices = ", ".join(f"{n} × {name}" if n > 1 else name for name, n in counts.items())
    kernels = data.kernels
    if len(data.devices) > 1 and not kernels.empty:  # the metadata lists every GPU the process could see
        used = sorted({int(d) for d in kernels["device"].dropna()})
        if 0 < len(used) < len(data.devices):
            devices += f" visible; work on GPU {', '.join(map(str, used))}"
    out.append(("devices", devices))
    if data.several_ranks:
        out.append(("ranks", f"{len(data.ranks)} ({', '.join(map(str, data.ranks[:16]))}{'…' if len(data.ranks) > 16 else ''})"))
    steps = data.steps
    if steps.empty:
        out.append(("steps", "none (no ProfilerStep in the trace)"))
    else:
        mean = tables.step_means(steps)
        out.append(("steps", f"{len(data.step_ids)} ({', '.join(map(str, data.step_ids[:12]))}{'…' if len(data.step_ids) > 12 else ''})"))
        out.append(("mean step", fmt_time(float(mean["dur"]))))
        parts = [(name, float(mean.get(col, 0.0)) / float(mean["dur"])) for col, name in tables.part_names(steps).items()
                 if col in mean and float(mean["dur"]) > 0 and float(mean.get(col, 0.0)) >= 0.005 * float(mean["dur"])]
        out.append(("breakdown", ", ".join(f"{name} {fmt_pct(p)}" for name, p in sorted(parts, key=lambda x: -x[1]))))
    peaks = tables.peak_memory(data.memory)
    if not peaks.empty:
        top = peaks.sort_values("peak_bytes", ascending=False).head(4)
        out.append(("peak memory", "; ".join(f"{d}: {fmt_bytes(b)}" for d, b in zip(top["device"].astype(str), top["peak_bytes"]))))
    events = getattr(data.trace, "events", None)
    if events is not None:
        out.append(("events", f"{len(events):,}"))
    return out


def for_trace(data: TraceData, limit: int = 6) -> list[str]:
    """:func:`recommendations` for a ``TraceData``."""
    devices = getattr(data.trace, "devices", []) or []
    mem = next((float(d["memory_bytes"]) for d in devices if d.get("memory_bytes")), None)
    return recommendations(
        data.steps, data.ops, data.kernels if data.has_gpu else None, data.memory,
        data.ranks_table if data.several_ranks else None, device_memory_bytes=mem, limit=limit,
    )
