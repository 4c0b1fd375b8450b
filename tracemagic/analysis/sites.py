"""``sites()``: the user code that launched each op, kernel and allocation ("Where (code)").

Every table that ends at an op or a kernel (Kernels, Shapes, the Roofline, the memory
peak and the biggest allocations) can name the code that caused it: its *site*, the
innermost enclosing user code, found in this order:

1. the cell line of the innermost ``tracemagic.line:N`` mark above it (``%%chakra_trace``
   captures): ``line 7 `loss = model(x)```;
2. else the innermost ``python_function`` frame above it that is user code
   (``source.user_labels``: not torch, the standard library or a built-in, nor a
   ``%%chakra_trace`` cell's own line):
   ``train_step · train.py:41`` (the function's ``def`` line, all such frames give);
3. else, in old traces with ``Call stack`` strings, the innermost user entry of the stack of
   the innermost op around it: ``forward · model.py:88`` (the call-site line);
4. else none (empty): library-only stacks, the autograd engine's backward ops (no Python
   frame is above them), or a trace recorded without ``with_stack``.

A kernel, memcpy or memset takes the site of the op that launched it (``kernels()``' link),
else of its runtime call; a ``[memory]`` event that of the innermost CPU event around it.
Nothing here runs unless a view or ``trace.sites()`` asks: ``ops()``, ``kernels()``,
``shapes()`` and ``memory()`` never pay for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import pandas as pd

from tracemagic.analysis._common import call_chains, memory_holders
from tracemagic.analysis.lines import cell_lines, line_label, marks
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.analysis.source import _call_stacks, _frame_masks, _labels, _launch_anchor, user_labels
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import propagate

#: the kinds of site, in ``sites()``' ``site`` column
SITE_KINDS = ("line", "function", "stack")
#: the name TorchDynamo gives the op around a compiled region's run (``Torch-Compiled Region: 0/0``)
REGION_PREFIX = "Torch-Compiled Region"

_Sites = tuple[np.ndarray, pd.DataFrame]


def cell_file(file: str, cells: Mapping[str, int] | None) -> str:
    """A frame's file as the user knows it: ``Cell In[3]`` for a notebook cell's file (as
    IPython's tracebacks name it; ``cells``: ``trace.cell_numbers``), else the file."""
    number = cells.get(file) if cells else None
    return f"Cell In[{number}]" if number is not None else file


def _label(function: str, file: str, line: int, cells: Mapping[str, int] | None = None) -> str:
    """``func · file.py:LINE`` (the file's base name: the full path is in ``file``; a
    notebook cell's file ``Cell In[3]``: ``cell_file``)."""
    place = cell_file(file, cells)
    base = place if place != file else os.path.basename(file.replace("\\", "/")) or file
    return f"{function} · {base}:{line}" if line >= 0 else f"{function} · {base}"


def site_codes(trace: TraceTables) -> _Sites:
    """Per events row, the code of its site (-1: none) and the sites (``site``, ``where``,
    ``file``, ``line``, ``function``, one row per code); CPU events only (GPU and memory
    rows: :func:`site_of_rows`). Computed once per trace."""

    def compute() -> _Sites:
        events = trace.events
        n = len(events)
        parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
        site: list[str] = []
        where: list[str] = []
        files: list[str] = []
        lines: list[int] = []
        functions: list[str] = []

        def add(kind: str, label: str, file: str, line: int, function: str) -> int:
            site.append(kind)
            where.append(label)
            files.append(file)
            lines.append(line)
            functions.append(function)
            return len(site) - 1

        code = np.full(n, -1, dtype=np.int64)
        cells = getattr(trace, "cell_numbers", None)
        # 1. line marks
        line_of, mark_rows = marks(trace)
        if mark_rows.size:
            texts = cell_lines(trace)
            numbers = np.unique(line_of[line_of >= 0])
            ids = np.array(
                [add("line", line_label(int(k), texts.get(int(k), "")), "", int(k), "") for k in numbers],
                dtype=np.int64,
            )
            has = line_of >= 0
            code[has] = ids[np.searchsorted(numbers, line_of[has])]
        # 2. the innermost user python_function frame
        is_fn, _ = _frame_masks(trace)
        if is_fn.any():
            lab_code, _label_text, file, line, function, _ = _labels(trace)
            lab = lab_code[events["name"].cat.codes.to_numpy()]
            user_fn = is_fn & user_labels(trace)[lab]
            if user_fn.any():
                inner = propagate(parent, depth, user_fn)
                free = (code < 0) & (inner >= 0)
                labs = lab[inner[free]]
                used, back = np.unique(labs, return_inverse=True)
                ids = np.array(
                    [
                        add(
                            "function",
                            _label(str(function[u]), str(file[u]), int(line[u]), cells),
                            str(file[u]),
                            int(line[u]),
                            str(function[u]),
                        )
                        for u in used
                    ],
                    dtype=np.int64,
                )
                code[free] = ids[back]
        # 3. the innermost user entry of an old trace's Call stack
        stacks = _call_stacks(trace)
        if stacks is not None and (code < 0).any():
            ops, stack_of, _up, paths, entries = stacks
            library = entries["library"].to_numpy(dtype=bool)
            user_entry = np.array([next((e for e in p if not library[e]), -1) for p in paths], dtype=np.int64)
            entry_of = user_entry[stack_of]
            anchored = np.zeros(n, dtype=bool)
            anchored[ops[entry_of >= 0]] = True
            if anchored.any():
                entry_at = np.full(n, -1, dtype=np.int64)
                entry_at[ops] = entry_of
                inner = propagate(parent, depth, anchored)
                free = (code < 0) & (inner >= 0)
                used, back = np.unique(entry_at[inner[free]], return_inverse=True)
                stack_ids: list[int] = []
                for e in used.tolist():
                    raw_line = entries["line"].iat[e]
                    number = -1 if raw_line is None or pd.isna(raw_line) else int(raw_line)
                    file_e, function_e = str(entries["file"].iat[e]), str(entries["function"].iat[e])
                    stack_ids.append(
                        add("stack", _label(function_e, file_e, number, cells), file_e, number, function_e)
                    )
                code[free] = np.array(stack_ids, dtype=np.int64)[back]
        table = pd.DataFrame({"site": site, "where": where, "file": files, "line": lines, "function": functions})
        return code, table

    return trace.shared(Shared.SITES, compute)


def site_of_rows(trace: TraceTables, rows: np.ndarray) -> np.ndarray:
    """The site code (:func:`site_codes`) of each of ``rows``: a CPU event's own; a GPU
    activity's through the op that launched it, else its runtime call; a ``[memory]``
    event's through the innermost CPU event around it. -1 where none."""
    code, _ = site_codes(trace)
    at = anchor_rows(trace, rows)
    return np.where(at >= 0, code[np.maximum(at, 0)], -1)


def anchor_rows(trace: TraceTables, rows: np.ndarray) -> np.ndarray:
    """The CPU event each of ``rows`` is placed by: itself; for GPU activity the op that
    launched it, else its runtime call; for a ``[memory]`` event the innermost CPU event
    around it; -1 where none."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows.size:
        return np.zeros(0, dtype=np.int64)
    events = trace.events
    at = rows.copy()
    gpu = kind_mask(events, *GPU_ACTIVITY)[rows]
    if gpu.any():
        gpu_rows, anchor = _launch_anchor(trace)
        anchor_of = pd.Series(anchor, index=gpu_rows)
        at[gpu] = anchor_of.reindex(rows[gpu]).fillna(-1).to_numpy(dtype=np.int64)
    memory = kind_mask(events, "memory")[rows]
    if memory.any():
        held_rows, holder = memory_holders(trace)
        at[memory] = holder[np.searchsorted(held_rows, rows[memory])]
    return at


def compiled_of_rows(trace: TraceTables, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row (placed as :func:`anchor_rows`): the source file Inductor generated for a
    Triton kernel (the ``kernel_file`` arg torch writes on the op that launches it,
    ``torch/_inductor/runtime/triton_heuristics.py`` ``get_profiler_kwargs``) and the
    ``torch.compile`` region around it (the ``Torch-Compiled Region: F/N`` op TorchDynamo
    records, ``torch/_dynamo/convert_frame.py``); None where there is none."""
    rows = np.asarray(rows, dtype=np.int64)
    none = np.full(rows.size, None, dtype=object)
    events = trace.events
    if not rows.size or "kernel_file" not in events:
        return none, none.copy()
    at = anchor_rows(trace, rows)
    names = events["name"]
    region_code = np.append(np.asarray(names.cat.categories.str.startswith(REGION_PREFIX), dtype=bool), False)
    is_region = region_code[names.cat.codes.to_numpy()] & kind_mask(events, "cpu_op", "user_annotation")
    files = events["kernel_file"]
    file_codes = files.cat.codes.to_numpy()
    file_names = np.array([*(str(c) or None for c in files.cat.categories), None], dtype=object)
    kernel_file: np.ndarray = np.where(at >= 0, file_names[file_codes[np.maximum(at, 0)]], none)
    region = none.copy()
    if is_region.any():
        inner = propagate(events["parent"].to_numpy(), events["depth"].to_numpy(), is_region)
        above = np.where(at >= 0, inner[np.maximum(at, 0)], -1)
        name_values = np.array([*(str(c) for c in names.cat.categories), None], dtype=object)
        region = np.where(above >= 0, name_values[names.cat.codes.to_numpy()[np.maximum(above, 0)]], none)
    return kernel_file.astype(object), region.astype(object)


@computes("sites")
def sites(trace: TraceTables) -> pd.DataFrame:
    """One row per CPU op, GPU activity (kernel, memcpy, memset) and ``[memory]`` event, in
    the events table's order, with the user code that launched it (the rules: this
    module's docstring). Columns: ``rank``, ``row``, ``kind`` (the event's), ``site``
    (line | function | stack, NA for none), ``where`` (how the views name it, NA for none),
    ``file``, ``line`` (the cell line, the function's ``def`` line or the stack's call-site
    line), ``function``; ``kernel_file`` and ``compiled_region`` (``torch.compile``: the
    generated source of a Triton kernel and the compiled region it ran in,
    :func:`compiled_of_rows`; NA elsewhere)."""
    events = trace.events
    x = (events["ph"] == "X").to_numpy()
    rows = np.flatnonzero((kind_mask(events, "cpu_op", *GPU_ACTIVITY) & x) | kind_mask(events, "memory"))
    if not rows.size:
        return TABLES["sites"].empty()
    code = site_of_rows(trace, rows)
    _, table = site_codes(trace)

    def column(values: list[str] | np.ndarray) -> pd.Categorical:
        categories, inverse = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
        return pd.Categorical.from_codes(
            np.where(code >= 0, inverse[np.maximum(code, 0)] if len(values) else -1, -1),
            categories=pd.Index(categories, dtype=object),
        )

    kernel_file, region = compiled_of_rows(trace, rows)
    known = code >= 0
    line = table["line"].to_numpy(dtype=np.int64) if len(table) else np.zeros(1, dtype=np.int64)
    line_at = line[np.maximum(code, 0)]
    return pd.DataFrame(
        {
            "rank": events["rank"].to_numpy()[rows],
            "row": rows.astype(np.int64),
            "kind": events["kind"].array[rows],
            "site": column(table["site"].to_numpy()),
            "where": column(table["where"].to_numpy()),
            "file": column(table["file"].to_numpy()),
            "line": pd.arrays.IntegerArray(np.where(known, line_at, 0), ~known | (line_at < 0)),
            "function": column(table["function"].to_numpy()),
            "kernel_file": pd.Categorical(kernel_file),
            "compiled_region": pd.Categorical(region),
        }
    )


# -- the views' joins ---------------------------------------------------------------------------
def where_text(trace: TraceTables, rows: np.ndarray, group: np.ndarray, groups: int, weights: np.ndarray) -> list[str]:
    """Per group (``group`` of each of ``rows``, ids 0..groups-1): the sites of its rows, most
    ``weights`` first, as text: ``line 7 `y = f(x)```, ``a · f.py:3, b · g.py:9 (+2)``; ''
    where none of its rows has one."""
    code = site_of_rows(trace, rows)
    _, table = site_codes(trace)
    found = [""] * groups
    known = code >= 0
    if not known.any():
        return found
    frame = pd.DataFrame(
        {"group": np.asarray(group)[known], "code": code[known], "w": np.asarray(weights, dtype=float)[known]}
    )
    summed = frame.groupby(["group", "code"], sort=False)["w"].sum().reset_index()
    summed = summed.sort_values(["group", "w"], ascending=[True, False], kind="stable")
    labels = table["where"].to_numpy()
    for g, part in summed.groupby("group", sort=False):
        listed = [str(labels[c]) for c in part["code"].tolist()]
        found[int(g)] = ", ".join(listed[:2]) + (f" (+{len(listed) - 2})" if len(listed) > 2 else "")
    return found


def where_by(trace: TraceTables, rows: np.ndarray, keys: pd.DataFrame, weights: np.ndarray) -> pd.DataFrame:
    """``keys`` (one row per of ``rows``) made unique, with a ``where`` column: each key's
    sites by :func:`where_text` (most ``weights`` first). The frame to merge on those keys."""
    keys = keys.reset_index(drop=True)
    if keys.empty:
        return keys.assign(where=pd.Series(dtype="str"))
    group = keys.groupby(list(keys.columns), sort=False, dropna=False, observed=True).ngroup().to_numpy()
    groups = int(group.max()) + 1
    first = np.full(groups, len(keys), dtype=np.int64)
    np.minimum.at(first, group, np.arange(len(keys)))
    out = keys.iloc[first].reset_index(drop=True)
    out["where"] = pd.array(where_text(trace, rows, group, groups, weights), dtype="str")
    return out


def chain_tops(trace: TraceTables) -> np.ndarray:
    """The rows of the call chains' top ops (``shapes()``' and ``efficiency()``' calls)."""
    rows, top = call_chains(trace)
    return rows[top == rows]
