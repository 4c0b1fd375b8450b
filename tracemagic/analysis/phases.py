"""``phases()``: what each step spends its time on: data loading, forward, backward,
optimizer and the rest, on the host and on the GPU.

The phases come from the annotations torch writes itself:

- **data loading**: ``enumerate(DataLoader)#...`` and ``enumerate(DataPipe)#...`` (the
  DataLoader's ``__next__``);
- **optimizer**: ``Optimizer.step#<Class>.step`` and ``Optimizer.zero_grad#<Class>.zero_grad``;
- **backward**: autograd's ``autograd::engine::evaluate_function: ...`` ops (in older
  traces the autograd nodes, ``AddmmBackward0``, ``torch::autograd::AccumulateGrad``), and
  every op on a backward thread (a thread running such ops and no ``ProfilerStep``:
  autograd's device threads on GPU);
- **forward**: the ``nn.Module: ...`` events (``with_stack=True``); on a rank without them,
  the ops with an autograd sequence number that are not backward ops (``Fwd thread id`` 0
  or none): ops recorded for autograd, which then include a loss computed outside any module;
- **other**: the rest of the step.

**Host rule.** A step is its host ``ProfilerStep`` (``steps()``' ``ts``/``dur``). Each
phase holds the union of its events' intervals, over every thread of the rank, clipped to
the step; where phases overlap, the higher one in ``PRIORITY`` wins: backward, then data
loading, then optimizer, then forward (a module forward that activation checkpointing re-runs
inside backward is backward time; ops recorded for autograd inside data loading, such as a
collate's ``aten::stack``, are data loading). The five host columns add up to ``dur``.

**GPU rule.** Each kernel, memcpy and memset belongs to the phase in effect (the host
rule) when the runtime call that launched it started, and to that call's step; a phase's
GPU time is the union of its GPU events' intervals (busy time, every stream), not clipped
to the host step: on a GPU-bound loop the GPU runs after the host. The GPU columns are NaN
on ranks without GPU activity; GPU work without a launching call in the trace belongs to no
step (as in ``steps()``).

This differs from ``steps()``' breakdown, which partitions the step's device window by
what *runs* (kernels, communication, runtime calls, host ops); ``phases()`` says which part
of the training step the host was in, and what the GPU ran for it.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from tracemagic.analysis import steps as _steps
from tracemagic.analysis._common import names_where, thread_keys_of, trace_start, union_length
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import MODULE_PREFIX

#: the phases, in the table's column order (``<phase>_us`` and ``gpu_<phase>_us``)
PHASES: tuple[str, ...] = ("dataloader", "forward", "backward", "optimizer", "other")
#: which phase wins where phases overlap, highest first (``other`` is what none covers)
PRIORITY: tuple[str, ...] = ("backward", "dataloader", "optimizer", "forward")
#: data loading: the DataLoader's (or DataPipe's) iteration
DATALOADER = re.compile(r"^enumerate\((?:DataLoader|DataPipe)\)#")
#: the optimizer: its step and zero_grad, ``Optimizer.step#AdamW.step``
OPTIMIZER = re.compile(r"^Optimizer\.(?:step|zero_grad)#")
#: the optimizer's class in its step's name
OPTIMIZER_CLASS = re.compile(r"^Optimizer\.step#(\w+)\.step")
#: autograd's backward ops: ``autograd::engine::evaluate_function: ...`` and, in traces
#: older than that wrapper, the autograd nodes themselves (``AddmmBackward0``,
#: ``CudnnConvolutionBackward``, ``torch::autograd::AccumulateGrad``)
BACKWARD = re.compile(r"^autograd::engine::evaluate_function: |^torch::autograd::AccumulateGrad$|^\w*Backward\d*$")
#: ops that run an optimizer's update fused into one kernel per parameter group
FUSED_OPS = re.compile(r"^aten::_fused_")
#: ops that run it over lists of tensors (``foreach=True``)
FOREACH_OPS = re.compile(r"^aten::_foreach_")
#: the columns of ``phases()`` (its contract in ``tracemagic.analysis.schema``)
COLUMNS = TABLES["phases"].names


def phase_masks(trace: TraceTables) -> dict[str, np.ndarray]:
    """Which events make each phase of ``PRIORITY`` (before priorities apply), by the rules
    of the module docstring; computed once per trace, each phase's when first read (a caller
    of the first phases alone pays for no other), treat it as read-only."""
    return trace.shared(Shared.PHASE_MASKS, lambda: _PhaseMasks(trace))


class _PhaseMasks(dict[str, np.ndarray]):
    """``phase_masks``' mapping: a phase's mask is computed the first time it is read."""

    def __init__(self, trace: TraceTables) -> None:
        super().__init__()
        self.trace = trace
        events = trace.events
        timed = (events["ph"] == "X").to_numpy() & np.isfinite(events["ts"].to_numpy()) & (events["dur"].to_numpy() > 0)
        self.ops = timed & kind_mask(events, "cpu_op", "user_annotation")
        self.timed = timed

    def __missing__(self, name: str) -> np.ndarray:
        if name not in PRIORITY:
            raise KeyError(name)
        events, ops = self.trace.events, self.ops
        names = events["name"]
        if name == "backward":
            evaluate = ops & names_where(names, BACKWARD)
            keys = thread_keys_of(self.trace)
            step_threads = np.unique(keys[kind_mask(events, "step")])
            backward_threads = np.setdiff1d(np.unique(keys[evaluate]), step_threads)
            value = evaluate | (ops & np.isin(keys, backward_threads))
        elif name == "dataloader":
            value = ops & names_where(names, DATALOADER)
        elif name == "optimizer":
            value = ops & names_where(names, OPTIMIZER)
        else:  # forward
            modules = (
                self.timed
                & kind_mask(events, "python_function")
                & names_where(names, re.compile("^" + re.escape(MODULE_PREFIX)))
            )
            rank = events["rank"].to_numpy()
            bare = ~np.isin(rank, np.unique(rank[modules]))  # ranks without module events: ops recorded for autograd
            recorded = ops & bare & ~self["backward"] & events["seq"].notna().to_numpy()
            if "fwd_tid" in events:  # a backward op names its forward's thread (``Fwd thread id``); 0 or none: forward
                fwd_tid = events["fwd_tid"]
                recorded &= (fwd_tid.isna() | fwd_tid.eq(0)).to_numpy(dtype=bool, na_value=True)
            value = modules | recorded
        self[name] = value
        return value


def _host_windows(trace: TraceTables) -> pd.DataFrame:
    """``steps.windows`` as ``in_windows`` takes them: the host steps, µs since the trace's start."""
    frame = _steps.windows(trace)
    return frame.assign(
        window_ts=frame["start"].to_numpy(dtype=np.float64) - trace_start(trace),
        window_dur=frame["dur"].to_numpy(dtype=np.float64),
    )


def _merged(rank: np.ndarray, start: np.ndarray, end: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per rank, the union of the intervals ``[start, end)`` as sorted disjoint intervals."""
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for r in np.unique(rank):
        mine = rank == r
        order = np.argsort(start[mine], kind="stable")
        s, e = start[mine][order], end[mine][order]
        reach = np.maximum.accumulate(e)
        new = np.r_[True, s[1:] > reach[:-1]]  # a gap before this interval: a new run
        run = np.cumsum(new) - 1
        lo = s[new]
        hi = np.zeros(lo.size)
        np.maximum.at(hi, run, e)
        out[int(r)] = (lo, hi)
    return out


def _inside(merged: dict[int, tuple[np.ndarray, np.ndarray]], rank: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Whether each moment ``at`` (of ``rank``) lies in the rank's union of ``merged``."""
    out = np.zeros(at.size, dtype=bool)
    for r, (lo, hi) in merged.items():
        mine = np.flatnonzero(rank == r)
        if not mine.size or not lo.size:
            continue
        pos = np.searchsorted(lo, at[mine], side="right") - 1
        out[mine] = (pos >= 0) & (at[mine] < hi[np.maximum(pos, 0)])
    return out


def phase_at(trace: TraceTables, rank: np.ndarray, at: np.ndarray, priority: tuple[str, ...] = PRIORITY) -> np.ndarray:
    """The index in ``PHASES`` of the phase in effect on ``rank`` at each moment ``at`` (µs
    since the trace's start), by the host rule (``PRIORITY``; ``other`` where none).
    ``priority``: the first phases of ``PRIORITY`` alone (the rest count as ``other``), for
    callers that read only those (each is decided by the ones above it alone)."""
    masks = phase_masks(trace)
    events = trace.events
    rel = events["ts"].to_numpy(dtype=np.float64) - trace_start(trace)
    end = rel + events["dur"].to_numpy(dtype=np.float64)
    ranks = events["rank"].to_numpy()
    out = np.full(at.size, PHASES.index("other"), dtype=np.int64)
    undecided = np.ones(at.size, dtype=bool)
    for name in priority:
        rows = np.flatnonzero(masks[name])
        if not rows.size or not undecided.any():
            continue
        hit = np.zeros(at.size, dtype=bool)
        hit[undecided] = _inside(_merged(ranks[rows], rel[rows], end[rows]), rank[undecided], at[undecided])
        out[hit] = PHASES.index(name)
        undecided &= ~hit
    return out


@computes("phases")
def phases(trace: TraceTables) -> pd.DataFrame:
    """One row per step and rank: the host time of each phase (they add up to the host
    step's ``dur``) and the GPU time launched from each; the rules are the module docstring's.

    Columns: ``rank``, ``step`` (ProfilerStep number, -1 where a rank has none: one row over
    its whole trace), ``ts``, ``dur`` (the host ProfilerStep, as in ``steps()``), then
    ``<phase>_us`` and ``gpu_<phase>_us`` for each of ``PHASES``. ``df.attrs``:
    ``optimizers`` (the optimizer classes the ``Optimizer.step#`` annotations name, e.g.
    ``['AdamW']``) and ``optimizer_impl`` (``fused`` when ``aten::_fused_*`` ops run inside
    the optimizer, ``foreach`` for ``aten::_foreach_*`` ops, ``for-loop`` for neither,
    None without an optimizer step).
    """
    return _phases(trace, PRIORITY)


def optimizer_phases(trace: TraceTables) -> pd.DataFrame:
    """``phases()``' columns ``rank``, ``step``, ``ts``, ``dur``, ``optimizer_us`` and
    ``gpu_optimizer_us``, with its ``attrs``: the same figures, computed without the forward
    phase, which is below the optimizer in ``PRIORITY`` and so changes neither (what the
    advice's ``optimizer`` rule reads; the forward's events are the most)."""
    return _phases(trace, PRIORITY[: PRIORITY.index("optimizer") + 1])


def _phases(trace: TraceTables, priority: tuple[str, ...]) -> pd.DataFrame:
    """``phases()`` over the first phases of ``PRIORITY`` (``priority``): all columns for all of
    them, else the columns of the last of ``priority`` alone (the GPU time of the others and
    ``other`` are then not known). Where only some phases are computed, each GPU event's
    group changes only where it is not of the last phase: that phase's sums are the same."""
    events = trace.events
    frame = _host_windows(trace)
    groups = len(frame)
    masks = phase_masks(trace)
    covered = np.zeros(groups)
    host: dict[str, np.ndarray] = {}
    so_far: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for k, name in enumerate(priority):
        so_far.append(_steps.in_windows(trace, frame, np.flatnonzero(masks[name])))
        if priority != PRIORITY and k < len(priority) - 2:
            continue  # only the last phase is shown: the union of those above it is all it needs
        group, start, end = (np.concatenate(column) for column in zip(*so_far))
        total = union_length(group, start, end, groups)
        host[name] = total - covered
        covered = total
    dur = frame["window_dur"].to_numpy(dtype=np.float64)
    if priority == PRIORITY:
        host["other"] = np.maximum(dur - covered, 0.0)

    # the GPU: each event's phase at its launch's start, its step the launch's
    gpu_rows = np.flatnonzero(
        (events["ph"] == "X").to_numpy() & kind_mask(events, *GPU_ACTIVITY) & np.isfinite(events["ts"].to_numpy())
    )
    launch = events["launch"].to_numpy()[gpu_rows]
    gpu_rows, launch = gpu_rows[launch >= 0], launch[launch >= 0]
    window = _steps.window_of(trace, frame)[gpu_rows]
    gpu_rows, launch, window = gpu_rows[window >= 0], launch[window >= 0], window[window >= 0]
    t0 = trace_start(trace)
    ts = events["ts"].to_numpy(dtype=np.float64)
    launch_at = ts[launch] - t0
    launch_rank = events["rank"].to_numpy()[launch]
    if priority == PRIORITY:
        phase = phase_at(trace, launch_rank, launch_at)
    else:  # only the last phase's GPU time is read: the launches inside that phase's events alone are decided
        last = PHASES.index(priority[-1])
        inside = np.flatnonzero(phase_at(trace, launch_rank, launch_at, priority[-1:]) == last)
        phase = np.full(launch.size, PHASES.index("other"), dtype=np.int64)
        phase[inside] = phase_at(trace, launch_rank[inside], launch_at[inside], priority)
    start = ts[gpu_rows] - t0
    busy = union_length(
        window * len(PHASES) + phase,
        start,
        start + events["dur"].to_numpy(dtype=np.float64)[gpu_rows],
        groups * len(PHASES),
    ).reshape(groups, len(PHASES))
    gpu_ranks = np.unique(events["rank"].to_numpy()[kind_mask(events, *GPU_ACTIVITY)])
    has_gpu = np.isin(frame["rank"].to_numpy(), gpu_ranks)

    shown = PHASES if priority == PRIORITY else priority[-1:]
    out = pd.DataFrame(
        {
            "rank": frame["rank"].to_numpy(),
            "step": frame["step"].to_numpy(),
            "ts": frame["window_ts"].to_numpy(),
            "dur": frame["dur"].to_numpy(dtype=np.float64),
            **{f"{name}_us": host[name] for name in PHASES if name in shown},
            **{
                f"gpu_{name}_us": np.where(has_gpu, busy[:, i], np.nan)
                for i, name in enumerate(PHASES)
                if name in shown
            },
        }
    )
    out.attrs.update(_optimizer_facts(trace))
    return out


@computes("phase_spans")
def phase_spans(trace: TraceTables) -> pd.DataFrame:
    """The host phases as time spans, for drawing: per rank, the moments each phase of
    ``PRIORITY`` is in effect by the host rule (its events' union less the higher phases'),
    as runs; a phase's consecutive runs in one step with only ``other`` time between them
    are one span (a forward of many short ops is one bar), and ``busy_us`` is the phase's
    own time in it. ``other`` is left out: it is what no span's ``busy_us`` covers.

    Returns:
        ``rank``, ``phase``, ``ts`` (µs since the trace's start), ``dur``, ``step`` (the host
        step the span starts in, -1 outside steps), ``busy_us``, by rank and time.
    """
    empty = TABLES["phase_spans"].empty()
    events = trace.events
    masks = phase_masks(trace)
    rows = np.flatnonzero(np.logical_or.reduce([masks[name] for name in PRIORITY])) if len(events) else np.zeros(0, int)
    if not rows.size:
        return empty
    rel = events["ts"].to_numpy(dtype=np.float64) - trace_start(trace)
    end = rel + events["dur"].to_numpy(dtype=np.float64)
    ranks = events["rank"].to_numpy()
    parts = []
    for r in np.unique(ranks[rows]):
        mine = rows[ranks[rows] == r]
        edges = np.unique(np.concatenate([rel[mine], end[mine]]))
        if edges.size < 2:
            continue
        lo, hi = edges[:-1], edges[1:]
        phase = phase_at(trace, np.full(lo.size, r), (lo + hi) / 2)
        new = np.r_[True, (phase[1:] != phase[:-1]) | (lo[1:] != hi[:-1])]
        run = np.cumsum(new) - 1
        starts, stops, kinds = lo[new], np.zeros(int(new.sum())), phase[new]
        np.maximum.at(stops, run, hi)
        keep = kinds != PHASES.index("other")
        parts.append(
            pd.DataFrame(
                {
                    "rank": np.int32(r),
                    "phase": np.asarray(PHASES, dtype=object)[kinds[keep]],
                    "ts": starts[keep],
                    "dur": (stops - starts)[keep],
                }
            )
        )
    if not parts:
        return empty
    out = pd.concat(parts, ignore_index=True)
    frame = _host_windows(trace)
    step = np.full(len(out), -1, dtype=np.int64)
    for r, where in frame.groupby("rank").indices.items():
        mine = np.flatnonzero(out["rank"].to_numpy() == r)
        begin = frame["window_ts"].to_numpy()[where]
        pos = np.searchsorted(begin, out["ts"].to_numpy()[mine], side="right") - 1
        ok = pos >= 0
        inside = ok & (out["ts"].to_numpy()[mine] < (begin + frame["window_dur"].to_numpy()[where])[np.maximum(pos, 0)])
        step[mine[inside]] = frame["step"].to_numpy()[where][pos[inside]]
    out["step"] = step
    out = out.sort_values(["rank", "ts"], kind="stable").reset_index(drop=True)
    key = out[["rank", "step"]].to_numpy()
    phase = out["phase"].to_numpy()
    new = np.r_[True, (key[1:] != key[:-1]).any(axis=1) | (phase[1:] != phase[:-1])]
    merged = (
        out.assign(end=out["ts"] + out["dur"], run=np.cumsum(new))
        .groupby("run", sort=False)
        .agg(
            rank=("rank", "first"),
            phase=("phase", "first"),
            ts=("ts", "min"),
            end=("end", "max"),
            step=("step", "first"),
            busy_us=("dur", "sum"),
        )
    )
    return pd.DataFrame(
        {
            "rank": merged["rank"].to_numpy().astype(np.int32),
            "phase": merged["phase"].astype("str").to_numpy(),
            "ts": merged["ts"].to_numpy(),
            "dur": (merged["end"] - merged["ts"]).to_numpy(),
            "step": merged["step"].to_numpy().astype(np.int64),
            "busy_us": merged["busy_us"].to_numpy(),
        }
    ).reset_index(drop=True)


def _optimizer_facts(trace: TraceTables) -> dict[str, object]:
    """``optimizers`` and ``optimizer_impl`` of ``phases()``' ``attrs``."""
    events = trace.events
    names = events["name"]
    # the classes from the names used (once per name), not from a text per matching row
    codes = names.cat.codes.to_numpy()
    used = np.bincount(codes[codes >= 0], minlength=len(names.cat.categories)) > 0
    found = [m for c, u in zip(names.cat.categories.tolist(), used) if u and (m := OPTIMIZER_CLASS.match(str(c)))]
    classes = sorted({m.group(1) for m in found})
    if not found:
        return {"optimizers": classes, "optimizer_impl": None}
    inside = phase_masks(trace)["optimizer"]
    rows = np.flatnonzero(inside)
    t0 = trace_start(trace)
    rel = events["ts"].to_numpy(dtype=np.float64) - t0
    merged = _merged(
        events["rank"].to_numpy()[rows], rel[rows], rel[rows] + events["dur"].to_numpy(dtype=np.float64)[rows]
    )
    ops = kind_mask(events, "cpu_op")

    def runs(pattern: re.Pattern[str]) -> bool:
        cand = np.flatnonzero(ops & names_where(names, pattern))
        return bool(cand.size) and bool(_inside(merged, events["rank"].to_numpy()[cand], rel[cand]).any())

    impl = "fused" if runs(FUSED_OPS) else "foreach" if runs(FOREACH_OPS) else "for-loop"
    return {"optimizers": classes, "optimizer_impl": impl}


__all__ = ["PHASES", "PRIORITY", "optimizer_phases", "phase_at", "phase_spans", "phases"]
