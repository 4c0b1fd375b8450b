"""Display tables: the analyses' DataFrames aggregated and filtered for showing.

Pure pandas, no drawing and no HTML: the figures, the dashboard, the report and the text
summary all show these same numbers. The numbers themselves (means, top-N, peaks) come
from ``tracemagic.analysis.aggregate``; here they are only selected and arranged.
"""

from __future__ import annotations

import pandas as pd

from tracemagic.analysis import aggregate

#: the parts of a step, in stacking order, with their display names (``steps()`` contract)
STEP_PARTS: dict[str, str] = dict(
    zip(
        aggregate.STEP_PARTS,
        (
            "GPU kernels",
            "communication",
            "memcpy",
            "memset",
            "CUDA runtime",
            "DataLoader",
            "CPU (GPU idle)",
            "idle",
        ),
    )
)
#: step parts that only a GPU has (CUDA runtime calls are the host driving one)
GPU_PARTS = aggregate.GPU_PARTS
# the figures the views show are computed in ``analysis.aggregate`` (one rule each, shared
# with the advice); re-exported here for the views
select_step = aggregate.select_step
of_steps = aggregate.of_steps
step_means = aggregate.step_means
step_shares = aggregate.step_shares
kernel_rate = aggregate.kernel_rate
top_ops = aggregate.top_ops
top_wrappers = aggregate.top_wrappers
top_kernels = aggregate.top_kernels
top_layers = aggregate.top_layers
layer_metric = aggregate.layer_metric
peaks_of = aggregate.peaks_of
mean_step_change = aggregate.mean_step_change
UNCOUNTED_ENDS = aggregate.UNCOUNTED_ENDS
modelled_gpu_us = aggregate.modelled_gpu_us


#: the phases of a step (``phases()``' ``<phase>_us`` columns) as the views name them
PHASE_NAMES: dict[str, str] = {
    "dataloader": "data loading",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "other": "other",
}


def phase_means(phases: pd.DataFrame) -> pd.Series:
    """The mean step's phases (``phases()`` rows): ``dur`` and each ``<phase>_us`` and
    ``gpu_<phase>_us`` (NaN without a GPU), µs."""
    columns = ["dur", *(f"{p}_us" for p in PHASE_NAMES), *(f"gpu_{p}_us" for p in PHASE_NAMES)]
    if phases.empty:
        return pd.Series(float("nan"), index=columns)
    return phases[columns].astype(float).mean()


def part_names(steps: pd.DataFrame) -> dict[str, str]:
    """``STEP_PARTS`` named for this trace (``steps()`` or ``ranks()``): without any
    GPU activity the host's time in ops and annotations is ``CPU ops``, as there is no GPU
    to be idle."""
    if aggregate.has_gpu_parts(steps):
        return STEP_PARTS
    return {**STEP_PARTS, "cpu_us": "CPU ops"}


def biggest_changes(diff: pd.DataFrame, level: str | None = None, n: int | None = None) -> pd.DataFrame:
    """Rows of ``trace.diff()`` (only ``level``'s, ``op`` or ``layer``, if given) by the size
    of their change ``|delta_us|``, largest first; the first ``n``."""
    frame = diff[diff["level"] == level] if level is not None and "level" in diff else diff
    if frame.empty:
        return frame
    frame = frame.reindex(frame["delta_us"].abs().sort_values(ascending=False, kind="stable").index)
    return frame.head(n) if n else frame


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


def layer_hierarchy(
    layers: pd.DataFrame, *, by: str, rank: int | None = None, max_nodes: int | None = None
) -> tuple[pd.DataFrame, int]:
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
    frame = layers.assign(
        layer=layers["layer"].astype(str), parent=layers["parent"].astype("string").fillna("").astype(str)
    ).drop_duplicates("layer")
    frame.loc[~frame["parent"].isin(set(frame["layer"])), "parent"] = ""
    if max_nodes is None or len(frame) <= max_nodes:
        return frame, 0
    keep = set(aggregate.top_layers(frame, max_nodes, by=by)["layer"])
    parents = dict(zip(frame["layer"], frame["parent"]))
    for name in list(keep):
        parent = parents.get(name, "")
        while parent and parent not in keep:
            keep.add(parent)
            parent = parents.get(parent, "")
    return frame[frame["layer"].isin(keep)], len(frame) - len(keep)


def step_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps with their parts and the GPU-busy share of the device window, for display (a
    trace without GPU activity shows neither the GPU columns nor the window, which is then
    the host step)."""
    if steps.empty:
        return steps
    if part_names(steps) is not STEP_PARTS:
        gpu_only = [*GPU_PARTS, "window_ts", "window_dur", "gpu_busy_us", "gpu_idle_us", "kernel_busy_us"]
        return steps.drop(columns=[c for c in gpu_only if c in steps])
    return steps.assign(gpu_busy_pct=aggregate.gpu_busy_pct(steps))
