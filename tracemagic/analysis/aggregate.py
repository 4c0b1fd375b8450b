"""The figures the views headline, computed once here: the mean step, the top ops, kernels
and layers, one scope's memory peaks.

The dashboard, the HTML report, the text summary and the advice (``analysis.advice``) all
take these numbers from here, so a number quoted in one place is the number shown in
another. DataFrames in, DataFrames (or a Series) out; nothing here draws or formats.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

#: the parts of a step in stacking order (``steps()`` columns; they add up to ``window_dur``)
STEP_PARTS: tuple[str, ...] = (
    "compute_us",
    "comm_us",
    "memcpy_us",
    "memset_us",
    "runtime_us",
    "dataloader_us",
    "cpu_us",
    "idle_us",
)
#: step parts that only a GPU has (CUDA runtime calls are the host driving one)
GPU_PARTS: tuple[str, ...] = ("compute_us", "memcpy_us", "memset_us", "runtime_us")


def select_step(frame: pd.DataFrame, step: int | None) -> pd.DataFrame:
    """Rows of ``frame`` in ``step`` (all rows for ``None``)."""
    if step is None or "step" not in frame:
        return frame
    return frame[frame["step"] == step]


def of_steps(frame: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Rows of ``frame`` (per rank and step, e.g. ``phases()``) whose (rank, step) is a row of
    ``steps``: each rank's own steps (the tail rule keeps different steps on different ranks)."""
    if frame.empty or steps.empty:
        return frame.iloc[:0]
    kept = pd.MultiIndex.from_frame(steps[["rank", "step"]])
    return frame[pd.MultiIndex.from_frame(frame[["rank", "step"]]).isin(kept)].reset_index(drop=True)


#: how a ``%%chakra_trace`` step that no mean counts ended (``capture.json``'s ``end``):
#: ``loop_exit`` (the step holds only the loop's exit), ``error`` (the cell's exception cut it short)
UNCOUNTED_ENDS: dict[str, str] = {"loop_exit": "holds only the loop's exit", "error": "was cut short by the error"}


def uncounted_steps(manifest: Mapping[str, Any] | None) -> dict[int, str]:
    """The ProfilerSteps a ``%%chakra_trace`` capture marks as not complete because the loop
    ended in them or the cell's exception cut them short (``capture.json``: ``end`` one of
    :data:`UNCOUNTED_ENDS`): step -> that ``end``. Not whole steps of the loop, so no mean or
    advice counts them. Empty for other traces."""
    out: dict[int, str] = {}
    for s in (manifest or {}).get("steps") or []:
        if (
            isinstance(s, dict)
            and s.get("end") in UNCOUNTED_ENDS
            and not s.get("complete")
            and isinstance(s.get("step"), int)
        ):
            out[int(s["step"])] = str(s["end"])
    return dict(sorted(out.items()))


def loop_exit_steps(manifest: Mapping[str, Any] | None) -> list[int]:
    """The steps of :func:`uncounted_steps` (the loop's exit, or cut short by an error)."""
    return list(uncounted_steps(manifest))


def loop_steps(steps: pd.DataFrame, manifest: Mapping[str, Any] | None) -> pd.DataFrame:
    """``steps()`` less the steps :func:`uncounted_steps` names."""
    exits = loop_exit_steps(manifest)
    if exits and not steps.empty:
        return steps[~steps["step"].isin(exits)].reset_index(drop=True)
    return steps


def step_means(steps: pd.DataFrame) -> pd.Series:
    """The mean step in µs: ``step_us`` (the device window, ``steps()``'s ``window_dur``),
    each part of ``STEP_PARTS`` (they add up to ``step_us``), ``gpu_busy_us``,
    ``gpu_idle_us`` and ``kernel_busy_us`` (NaN without a GPU); zeros for no steps."""
    parts = [c for c in STEP_PARTS if c in steps]
    gpu = [c for c in ("gpu_busy_us", "gpu_idle_us", "kernel_busy_us") if c in steps or steps.empty]
    if steps.empty:
        return pd.Series(0.0, index=["step_us", *parts, *gpu])
    mean = steps[["window_dur", *parts, *gpu]].astype(float).mean()
    return mean.rename({"window_dur": "step_us"})


def step_shares(mean: pd.Series) -> pd.Series:
    """A mean step's (:func:`step_means`) parts (``STEP_PARTS``), ``gpu_busy_us`` and
    ``gpu_idle_us`` as fractions of its ``step_us``; NaN for no steps or a zero-length
    step (and for the GPU's without a GPU)."""
    dur = float(mean["step_us"])
    return mean.drop("step_us") / dur if dur > 0 else mean.drop("step_us") * float("nan")


def mean_step_change(a: pd.DataFrame, b: pd.DataFrame) -> tuple[float, float, float] | None:
    """The mean steps of two ``steps()`` tables (µs) and B's change against A in %; None
    unless both have steps of some length."""
    before, after = float(step_means(a)["step_us"]), float(step_means(b)["step_us"])
    if not (before > 0 and after > 0):
        return None
    return before, after, 100 * (after / before - 1)


def gpu_busy_pct(steps: pd.DataFrame) -> pd.Series:
    """Per step (``steps()`` row), the GPU-busy share of its device window in % (0 for an
    empty window or no GPU)."""
    window = steps["window_dur"].where(steps["window_dur"] > 0)
    return (100 * steps["gpu_busy_us"] / window).fillna(0.0)


def modelled_gpu_us(efficiency: pd.DataFrame) -> tuple[float, float]:
    """Of ``efficiency()``'s GPU time (µs), how much ran in ops with a cost model (a
    ``pct_of_roofline``), and all of it."""
    modelled = float(efficiency.loc[efficiency["pct_of_roofline"].notna(), "gpu_us"].sum())
    return modelled, float(efficiency["gpu_us"].sum())


def kernel_rate(kernels: pd.DataFrame, steps: pd.DataFrame) -> pd.Series:
    """The GPU kernels (``kind`` kernel; not memcpy/memset) of the steps and how long they
    took, per step of one rank as the mean step is (:func:`step_means`: the mean over
    ``steps()`` rows, one per rank and step).

    A kernel counts where its (rank, step) is a row of ``steps`` (``kernels()``' step: that of
    its launching runtime call); one in no step (in flight when profiling began, launched
    between or after the steps) or in a step left out of ``steps`` does not.

    Returns:
        ``kernels`` (the count), ``steps`` (the rows of ``steps``: steps of one rank, at
        least 1), ``ranks`` (the ranks among them, at least 1), ``per_step`` (kernels /
        steps: the mean over ranks and steps of one rank's kernels in one step),
        ``mean_us`` (NaN without kernels) and ``outside`` (the kernels of ``kernels`` not
        counted). Without steps (a step ``steps()`` leaves out, selected alone) none counts.
    """
    # on the columns' arrays: no copy of the table's rows
    keep = (kernels["kind"] == "kernel").to_numpy(dtype=bool) if len(kernels) else np.zeros(0, dtype=bool)
    total = int(keep.sum())
    if total:  # (no steps: a step left out by the tail rule, selected alone; none counts)
        keep = keep & _in_rank_steps(kernels, steps) if not steps.empty else np.zeros_like(keep)
    count = int(keep.sum())
    n_steps = max(len(steps), 1)
    n_ranks = max(int(steps["rank"].nunique()) if "rank" in steps and not steps.empty else 1, 1)
    mean = float(kernels["dur"].to_numpy(dtype=np.float64)[keep].mean()) if count else float("nan")
    return pd.Series(
        {
            "kernels": float(count),
            "steps": float(n_steps),
            "ranks": float(n_ranks),
            "per_step": count / n_steps,
            "mean_us": mean,
            "outside": float(total - count),
        }
    )


def _in_rank_steps(frame: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """Whether each row of ``frame`` (with ``step``, and ``rank`` where ``steps`` has one)
    is in a (rank, step) of ``steps``, each pair one exact int64 key compared with
    ``np.isin``: ``rank << 32 | step + 1`` where both fit 31 bits (a real trace's),
    else the codes of the rank and of the step among all values (a hash over the rows)."""
    step, wanted = frame["step"].to_numpy(dtype=np.int64), steps["step"].to_numpy(dtype=np.int64)
    if not ("rank" in steps and "rank" in frame):
        return np.isin(step, wanted)
    rank, ranks = frame["rank"].to_numpy(dtype=np.int64), steps["rank"].to_numpy(dtype=np.int64)
    limit = 2**31 - 2
    if all(a.size == 0 or (int(a.min()) >= -1 and int(a.max()) <= limit) for a in (step, wanted, rank, ranks)):
        return np.isin((rank << 32) | (step + 1), (ranks << 32) | (wanted + 1))
    n = len(frame)
    codes, values = pd.factorize(np.concatenate([step, wanted]))
    key = pd.factorize(np.concatenate([rank, ranks]))[0].astype(np.int64) * max(len(values), 1) + codes
    return np.isin(key[:n], key[n:])


def has_gpu_parts(steps: pd.DataFrame) -> bool:
    """Whether any step (``steps()`` or ``ranks()`` rows) holds GPU activity (a part of
    ``GPU_PARTS`` above zero); true for no rows."""
    return steps.empty or any((steps[c] > 0).any() for c in GPU_PARTS if c in steps)


#: ops that wrap others, kept out of the op tables as the TensorBoard plugin keeps them out of
#: its Operator view (``node.py``: ``create_operator_node`` makes DataLoader and optimizer
#: nodes of them, ``is_operator_node`` leaves out ``Optimizer.*`` and ``ExcludeOpName``)
WRAPPER_OPS = re.compile(
    r"^(?:enumerate\(DataLoader\)#.*\.__next__$|enumerate\(DataPipe\)#|Optimizer\."
    r"|DataParallel\.forward$|DistributedDataParallel\.forward$)"
)


def _wrapper_rows(frame: pd.DataFrame) -> np.ndarray:
    """Which rows of ``frame`` (``ops()`` rows) are named as a wrapper op (``WRAPPER_OPS``)."""
    names = frame["name"]
    if isinstance(names.dtype, pd.CategoricalDtype):
        hit = np.append(np.asarray(names.cat.categories.astype(str).str.contains(WRAPPER_OPS), dtype=bool), False)
        return hit[names.cat.codes.to_numpy()]  # code -1 (NA): the False at the end
    return names.astype(str).str.contains(WRAPPER_OPS).to_numpy(dtype=bool)


def _by_name(frame: pd.DataFrame, keep: np.ndarray | None = None) -> pd.DataFrame:
    """``frame``'s rows (those ``keep`` marks, all for None) by name: calls, total and self
    (µs); a ``merged`` row (``ops()``) is no call and adds no total, its self time counts."""
    rows = np.flatnonzero(keep) if keep is not None else np.arange(len(frame))
    own = ~frame["merged"].to_numpy()[rows] if "merged" in frame else np.ones(rows.size, dtype=bool)
    # only the columns summed, taken at the rows (not a copy of the whole frame), grouped on
    # the names' codes (the same sums, in row order, as on the names), each code turned into
    # its text once, in text order
    names = frame["name"]
    sums = pd.DataFrame(
        {
            "call": own,
            "total": np.where(own, frame["dur"].to_numpy()[rows], 0.0),
            "self_dur": frame["self_dur"].to_numpy()[rows],
        },
        copy=False,  # columns made here (per op row): no second copy
    )
    aggregations = {"calls": ("call", "sum"), "total_us": ("total", "sum"), "self_us": ("self_dur", "sum")}
    if isinstance(names.dtype, pd.CategoricalDtype):
        codes = names.cat.codes.to_numpy()[rows]
        named = codes >= 0  # a missing name is in no group, as groupby leaves NA out
        if not named.all():  # (else no copy of the rows)
            sums, codes = sums[named], codes[named]
        out = sums.groupby(codes).sum().rename(columns={"call": "calls", "total": "total_us", "self_dur": "self_us"})
        out.index = names.cat.categories[out.index.to_numpy()].astype(str).rename("name")
    else:
        out = sums.assign(name=names.to_numpy()[rows]).groupby("name").agg(**aggregations)
        out.index = out.index.astype(str)
    return out.sort_index().reset_index()


def top_wrappers(ops: pd.DataFrame, n: int | None = None) -> pd.DataFrame:
    """What wraps the ops, by name: user annotations (``record_function`` blocks, ``nccl:*``)
    and the ops :data:`WRAPPER_OPS` names (DataLoader and DataPipe iteration, ``Optimizer.step#``,
    ``Optimizer.zero_grad#``, ``DistributedDataParallel.forward``); calls, total and self time
    (µs), mean; the ``n`` with the most total time first. Their totals hold the ops inside,
    so they are listed apart from :func:`top_ops` and never added to it."""
    cols = ["name", "kind", "calls", "total_us", "self_us", "mean_us"]
    if ops.empty or "kind" not in ops:
        return pd.DataFrame(columns=cols)
    kind = ops["kind"].astype(str)
    frame = ops[(kind == "user_annotation").to_numpy() | ((kind == "cpu_op").to_numpy() & _wrapper_rows(ops))]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    out = _by_name(frame)
    out["kind"] = out["name"].map(
        frame.assign(name=frame["name"].astype(str)).groupby("name")["kind"].first().astype(str)
    )
    out["mean_us"] = out["total_us"] / out["calls"]
    out = out.sort_values(["total_us", "name"], ascending=[False, True], ignore_index=True)
    return out[cols].head(n) if n else out[cols]


def top_ops(ops: pd.DataFrame, n: int | None = None) -> pd.DataFrame:
    """CPU ops aggregated by name: calls, total and self time (µs), self share; the ``n``
    with the most self time first (ties by name).

    Annotations, steps and the ops that wrap others (:data:`WRAPPER_OPS`: DataLoader
    iteration, ``Optimizer.*``, ``DistributedDataParallel.forward``, which old traces file as
    ops) are left out, as in the TensorBoard plugin's Operator view (they are listed apart by
    :func:`top_wrappers`), so self times add up without double counting. An op folded into
    the one of its name around it (``ops()``'s ``merged``: ``aten::div`` inside
    ``aten::div``) is no call and adds no total, its self time goes to its name all the
    same: calls, totals and self times are ``key_averages()``'s.
    """
    cols = ["name", "calls", "total_us", "self_us", "mean_us", "self_pct"]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    keep = (ops["kind"] == "cpu_op").to_numpy() & ~_wrapper_rows(ops) if "kind" in ops else None
    if keep is not None and not keep.any():
        return pd.DataFrame(columns=cols)
    out = _by_name(ops, keep)
    out["mean_us"] = out["total_us"] / out["calls"]
    total_self = float(out["self_us"].sum())
    out["self_pct"] = 100 * out["self_us"] / total_self if total_self > 0 else 0.0
    out = out.sort_values(["self_us", "name"], ascending=[False, True], ignore_index=True)
    return out[cols].head(n) if n else out[cols]


def top_kernels(kernels: pd.DataFrame, n: int | None = None, *, by_op: bool = False) -> pd.DataFrame:
    """GPU kernels (and memcpy/memset) aggregated by name, or by name + launching op: calls,
    total, mean and longest time (µs), share of the GPU time; the ``n`` with the most time
    first (ties by name)."""
    keys = ["name", "op"] if by_op else ["name"]
    cols = [*keys, "kind", "calls", "total_us", "mean_us", "max_us", "pct"]
    if kernels.empty:
        return pd.DataFrame(columns=cols)
    frame = kernels.assign(
        name=kernels["name"].astype(str),
        kind=kernels["kind"].astype(str),
        op=kernels["op"].astype("string").fillna("") if "op" in kernels else "",
    )
    out = (
        frame.groupby(keys, observed=True, dropna=False)
        .agg(kind=("kind", "first"), calls=("dur", "size"), total_us=("dur", "sum"), max_us=("dur", "max"))
        .reset_index()
    )
    out["mean_us"] = out["total_us"] / out["calls"]
    total = float(out["total_us"].sum())
    out["pct"] = 100 * out["total_us"] / total if total > 0 else 0.0
    out = out.sort_values(["total_us", *keys], ascending=[False] + [True] * len(keys), ignore_index=True)
    return out[cols].head(n) if n else out[cols]


def layer_metric(layers: pd.DataFrame) -> str:
    """The time that ranks layers: ``gpu_us`` when any layer ran GPU work, else ``cpu_us``."""
    return "gpu_us" if not layers.empty and "gpu_us" in layers and bool((layers["gpu_us"] > 0).any()) else "cpu_us"


def top_layers(layers: pd.DataFrame, n: int | None = None, *, by: str | None = None) -> pd.DataFrame:
    """The rule for "top layers", used everywhere: ``layers()`` rows by ``by`` (default
    :func:`layer_metric`), most first, ties in the table's order; the first ``n`` (all for
    None)."""
    if layers.empty:
        return layers
    out = layers.sort_values(by or layer_metric(layers), ascending=False, kind="stable")
    return out.head(n) if n is not None else out


def peaks_of(peaks: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """The rows of ``memory_peaks()`` for ``step``: its own per (rank, device), or the
    whole-trace rows (``step`` NA) for None."""
    if peaks.empty:
        return peaks
    rows = peaks["step"].isna() if step is None else peaks["step"].eq(step).fillna(False)
    return peaks[rows.to_numpy(dtype=bool)].reset_index(drop=True)
