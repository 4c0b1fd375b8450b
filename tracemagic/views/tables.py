"""Display tables: the analyses' DataFrames aggregated and filtered for showing.

Pure pandas, no drawing and no HTML: the figures, the dashboard, the report and the text
summary all show these same numbers.
"""

from __future__ import annotations

import pandas as pd

#: the parts of a step, in stacking order, with their display names (``steps()`` contract)
STEP_PARTS: dict[str, str] = {
    "compute_us": "GPU kernels",
    "comm_us": "communication",
    "memcpy_us": "memcpy",
    "memset_us": "memset",
    "runtime_us": "CUDA runtime",
    "dataloader_us": "DataLoader",
    "cpu_us": "CPU (GPU idle)",
    "idle_us": "idle",
}
#: step parts that only a GPU has (CUDA runtime calls are the host driving one)
GPU_PARTS = ("compute_us", "memcpy_us", "memset_us", "runtime_us")


def part_names(steps: pd.DataFrame) -> dict[str, str]:
    """``STEP_PARTS`` named for this trace (``steps()`` or ``ranks()``): without any
    GPU activity the host's op time is ``CPU ops``, as there is no GPU to be idle."""
    if steps.empty or any((steps[c] > 0).any() for c in GPU_PARTS if c in steps):
        return STEP_PARTS
    return {**STEP_PARTS, "cpu_us": "CPU ops"}


def top_ops(ops: pd.DataFrame, n: int | None = None) -> pd.DataFrame:
    """CPU ops aggregated by name: calls, total and self time (µs), self share; by self time.

    Annotations and steps are left out (they are not ops), so self times add up without
    double counting.
    """
    cols = ["name", "calls", "total_us", "self_us", "mean_us", "self_pct"]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    frame = ops[ops["kind"].astype(str) == "cpu_op"] if "kind" in ops else ops
    if frame.empty:
        return pd.DataFrame(columns=cols)
    out = (
        frame.assign(name=frame["name"].astype(str))
        .groupby("name", observed=True)
        .agg(calls=("dur", "size"), total_us=("dur", "sum"), self_us=("self_dur", "sum"))
        .reset_index()
    )
    out["mean_us"] = out["total_us"] / out["calls"]
    total_self = float(out["self_us"].sum())
    out["self_pct"] = 100 * out["self_us"] / total_self if total_self > 0 else 0.0
    out = out.sort_values(["self_us", "name"], ascending=[False, True], ignore_index=True)
    return out[cols].head(n) if n else out[cols]


def top_kernels(kernels: pd.DataFrame, n: int | None = None, *, by_op: bool = False) -> pd.DataFrame:
    """GPU kernels (and memcpy/memset) aggregated by name, or by name + launching op."""
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


def step_means(steps: pd.DataFrame) -> pd.Series:
    """The mean step in µs: ``step_us`` (the device window, ``steps()``'s ``window_dur``),
    each part of ``STEP_PARTS`` (they add up to ``step_us``), ``gpu_busy_us`` and
    ``gpu_idle_us`` (NaN without a GPU); zeros for no steps."""
    parts = [c for c in STEP_PARTS if c in steps]
    if steps.empty:
        return pd.Series(0.0, index=["step_us", *parts, "gpu_busy_us", "gpu_idle_us"])
    mean = steps[["window_dur", *parts, "gpu_busy_us", "gpu_idle_us"]].astype(float).mean()
    return mean.rename({"window_dur": "step_us"})


def biggest_changes(diff: pd.DataFrame, level: str | None = None, n: int | None = None) -> pd.DataFrame:
    """Rows of ``trace.diff()`` (only ``level``'s, ``op`` or ``layer``, if given) by the size
    of their change ``|delta_us|``, largest first; the first ``n``."""
    frame = diff[diff["level"] == level] if level is not None and "level" in diff else diff
    if frame.empty:
        return frame
    frame = frame.reindex(frame["delta_us"].abs().sort_values(ascending=False, kind="stable").index)
    return frame.head(n) if n else frame


def select_step(frame: pd.DataFrame, step: int | None) -> pd.DataFrame:
    """Rows of ``frame`` in ``step`` (all rows for ``None``)."""
    if step is None or "step" not in frame:
        return frame
    return frame[frame["step"] == step]


def filter_rows(frame: pd.DataFrame, text: str) -> pd.DataFrame:
    """Rows where any text column contains ``text`` (case-insensitive; all rows for '')."""
    text = (text or "").strip().lower()
    if not text or frame.empty:
        return frame
    mask = pd.Series(False, index=frame.index)
    for column in frame.columns:
        if frame[column].dtype == object or isinstance(frame[column].dtype, (pd.StringDtype, pd.CategoricalDtype)):
            mask |= frame[column].astype("string").str.lower().str.contains(text, regex=False).fillna(False)
    return frame[mask]


def sort_rows(frame: pd.DataFrame, column: str | None, ascending: bool = False) -> pd.DataFrame:
    """``frame`` sorted by ``column`` (unchanged when the column is absent)."""
    if not column or column not in frame:
        return frame
    return frame.sort_values(column, ascending=ascending, kind="stable", na_position="last")


def layers_table(layers: pd.DataFrame, rank: int | None = None) -> pd.DataFrame:
    """The layers table for display: one rank (every rank for ``None``), ordered as a tree:
    each layer right after its parent, siblings in the analysis' order (first call)."""
    if layers.empty:
        return layers
    frame = layers if rank is None or "rank" not in layers else layers[layers["rank"] == rank]
    frame = frame.reset_index(drop=True)
    ranks = frame["rank"].tolist() if "rank" in frame else [0] * len(frame)
    names = frame["layer"].astype(str).tolist()
    parents = frame["parent"].astype("string").fillna("").astype(str).tolist()
    position = {(r, n): i for i, (r, n) in reversed(list(enumerate(zip(ranks, names))))}
    children: dict[int, list[int]] = {}
    roots = []
    for i, (r, p) in enumerate(zip(ranks, parents)):
        parent = position.get((r, p))
        if parent is None or parent == i:
            roots.append(i)
        else:
            children.setdefault(parent, []).append(i)
    order: list[int] = []
    seen: set[int] = set()
    stack = roots[::-1]
    while stack:
        i = stack.pop()
        if i in seen:  # a cycle in damaged data: each row once
            continue
        seen.add(i)
        order.append(i)
        stack.extend(children.get(i, [])[::-1])
    order += [i for i in range(len(frame)) if i not in seen]
    if "rank" in frame:  # ranks stay in blocks, lowest first
        order.sort(key=lambda i: ranks[i])
    return frame.iloc[order].reset_index(drop=True)


def layer_hierarchy(layers: pd.DataFrame, *, by: str, rank: int | None = None,
                    max_nodes: int | None = None) -> tuple[pd.DataFrame, int]:
    """One rank's layers ready to draw as a tree, and how many were left out.

    ``layer`` and ``parent`` become plain text (a parent missing from the table becomes
    ``''``, a root), a repeated layer is kept once, and beyond ``max_nodes`` only the
    heaviest layers by column ``by`` are kept, with all their ancestors.

    Args:
        layers: ``trace.layers()``.
        by: the column ranking the layers (``cpu_us``, ``gpu_us``).
        rank: the rank kept (default: the lowest).
        max_nodes: the most layers kept (None: all).
    """
    if "rank" in layers and len(layers):
        layers = layers[layers["rank"] == (int(layers["rank"].min()) if rank is None else rank)]
    frame = layers.assign(layer=layers["layer"].astype(str),
                          parent=layers["parent"].astype("string").fillna("").astype(str)).drop_duplicates("layer")
    frame.loc[~frame["parent"].isin(set(frame["layer"])), "parent"] = ""
    if max_nodes is None or len(frame) <= max_nodes:
        return frame, 0
    keep = set(frame.nlargest(max_nodes, by)["layer"])
    parents = dict(zip(frame["layer"], frame["parent"]))
    for name in list(keep):
        parent = parents.get(name, "")
        while parent and parent not in keep:
            keep.add(parent)
            parent = parents.get(parent, "")
    return frame[frame["layer"].isin(keep)], len(frame) - len(keep)


def peaks_of(peaks: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """The rows of ``trace.memory_peaks()`` for ``step``: its own per (rank, device), or the
    whole-trace rows (``step`` NA) for None."""
    if peaks.empty:
        return peaks
    rows = peaks["step"].isna() if step is None else peaks["step"].eq(step).fillna(False)
    return peaks[rows.to_numpy(dtype=bool)].reset_index(drop=True)


def step_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps with their parts and the GPU-busy share of the device window, for display (a
    trace without GPU activity shows neither the GPU columns nor the window, which is then
    the host step)."""
    if steps.empty:
        return steps
    if part_names(steps) is not STEP_PARTS:
        gpu_only = [*GPU_PARTS, "window_ts", "window_dur", "gpu_busy_us", "gpu_idle_us"]
        return steps.drop(columns=[c for c in gpu_only if c in steps])
    out = steps.copy()
    window = out["window_dur"].where(out["window_dur"] > 0)
    out["gpu_busy_pct"] = (100 * out["gpu_busy_us"] / window).fillna(0.0)
    return out
