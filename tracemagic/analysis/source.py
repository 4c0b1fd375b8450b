"""``source()``: CPU time, GPU time, bytes and FLOPs per Python function (and per call-site
line where the trace has ``Call stack`` strings); ``call_tree()``: the merged call tree of
Python frames, ops and kernels that flame graphs and folded stacks draw.

Where the numbers come from:

- ``with_stack=True`` makes torch write a ``python_function`` event per Python call, named
  ``file(LINE): func`` where LINE is the function's ``def`` line (for ``<module>`` the line
  running when the profiler started), and ``<built-in method X of Y object at 0x...>`` for
  C functions (the address is dropped here, so every call of one built-in is one row).
- Older traces (torch < 1.10, e.g. the V100 ResNet-50 trace of the TensorBoard plugin's
  samples) have no such events; their ops carry a ``Call stack`` argument instead,
  ``file(LINE): func;...`` innermost first, where LINE is the line that was running: the
  call site. Those become rows of ``kind`` 'line'.
- GPU work reaches a frame through the op that launched it (``kernels()``' link: the
  runtime call's ``External id``/correlation), bytes through the ``[memory]`` events inside
  the ops beneath, FLOPs through the ops' own ``flops`` argument (``with_flops``).

Nothing here is computed unless asked for: the other tables never pay for it.
"""

from __future__ import annotations

import os
import re
import sys
from functools import lru_cache

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    group_rows,
    module_entry,
    nesting_depth,
    rollup,
    text,
    text_take,
    trace_start,
    unique_roots,
)
from tracemagic.analysis.lines import cell_lines, line_label, waited_in
from tracemagic.analysis.schema import computes
from tracemagic.trace.kineto import GPU_ACTIVITY, LINE_MARK_PREFIX, line_of_mark
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.shared_keys import Shared
from tracemagic.trace.structure import MODULE_PREFIX, enclosing_of_kind, propagate, thread_keys

#: ``file(LINE): func`` of a python_function event (and of each ``Call stack`` entry)
FRAME_NAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")
#: the object address in a built-in's name (``... object at 0x7f0242...>``)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+(?=>$)")
#: where library code lives in a file path (any segment)
_LIBRARY_PATH = re.compile(r"(?:^|/)(?:site-packages|dist-packages|lib6?4?/python\d[\d.]*)(?:/|$)")
#: top-level packages whose files count as library code even when the profiler wrote their
#: path relative to ``sys.path`` (torch strips those prefixes: ``torch/nn/modules/linear.py``)
LIBRARIES = frozenset(
    [
        "torch",
        "torchvision",
        "torchaudio",
        "torchtext",
        "torchdata",
        "functorch",
        "triton",
        "numpy",
        "scipy",
        "pandas",
        "transformers",
        "accelerate",
        "datasets",
        "tokenizers",
        "safetensors",
        "huggingface_hub",
        "peft",
        "diffusers",
        "deepspeed",
        "apex",
        "fairscale",
        "megatron",
        "lightning",
        "pytorch_lightning",
        "timm",
        "einops",
        "xformers",
        "flash_attn",
        "tqdm",
        "IPython",
        "ipykernel",
        "jupyter_client",
        "tornado",
        "zmq",
        "traitlets",
        "tracemagic",
        "sklearn",
        "jax",
        "flax",
        "optree",
        "sympy",
        "networkx",
    ]
)
#: a file of this package's (the magic's frames: ``tracemagic/magics.py(249): chakra_trace``),
#: as torch writes it: relative to ``sys.path`` or absolute (an editable install)
_MAGIC_FILE = re.compile(r"(?:^|/)tracemagic/")
#: the node kinds of ``call_tree``
NODE_KINDS = ("rank", "python", "module", "op", "annotation", "kernel", "memcpy", "memset", "line", "other")
#: the name of the node that holds GPU work whose launching call is not in the trace
NO_LAUNCH = "<no launching call in the trace>"


# -- frames ---------------------------------------------------------------------------------
def is_library(file: str) -> bool:
    """Whether a frame's file is library code rather than the user's: a built-in or frozen
    module (``<built-in ...>``, ``<frozen os>``), code generated from a string (``<string>``:
    a dataclass's or ``NamedTuple``'s ``__init__``, written by no one), a path through ``site-packages``,
    ``dist-packages`` or ``lib/pythonX.Y`` or a folder of ``sys.path`` pip installed into
    (``_install_paths``: ``pip install --target``), or a path (as torch writes it, relative to
    ``sys.path``) whose first part is a standard-library module (``typing.py``), a known
    package (``LIBRARIES``: torch, numpy, transformers, ...; also as a folder further down an
    absolute path, as in an editable install) or a package installed where the trace is read.
    Everything else, notebook cells (``/tmp/ipykernel_1/123.py``) and
    scripts (``train.py``) included, is user code.
    """
    if file.startswith("<"):
        return file.startswith(("<built-in", "<frozen", "<method", "<slot", "<string>"))
    if _LIBRARY_PATH.search(file):
        return True
    path = file.replace("\\", "/")
    if path.startswith("/") and path.startswith(_install_paths(tuple(sys.path))):
        return True
    parts = path.lstrip("./").split("/")
    top = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    if top in LIBRARIES or top in sys.stdlib_module_names or _installed(top):
        return True
    return any(part in LIBRARIES for part in parts[1:-1])  # an editable install: /src/torch/nn/...


@lru_cache(maxsize=8)
def _install_paths(path: tuple[str, ...]) -> tuple[str, ...]:
    """The folders of ``sys.path`` (``path``) pip installed packages into without a
    ``site-packages`` in their name (they hold ``*.dist-info`` folders: ``pip install
    --target DIR`` on ``PYTHONPATH``), each ending in ``/``: their files are library code.
    Only ``sys.path`` entries count, so a notebook's cell folder never does."""
    found = []
    for entry in path:
        folder = os.path.abspath(entry or os.curdir).replace("\\", "/").rstrip("/")
        if not folder or _LIBRARY_PATH.search(folder):
            continue
        try:
            with os.scandir(folder) as listing:
                if any(e.name.endswith(".dist-info") and e.is_dir() for e in listing):
                    found.append(folder + "/")
        except OSError:
            continue
    return tuple(found)


@lru_cache(maxsize=4096)
def _installed(top: str) -> bool:
    """Whether the module ``top`` is installed here as a third-party package
    (``typing_extensions``, ``six``, ...: found by the import system in a ``site-packages``
    or ``dist-packages`` folder; nothing is imported). A module of the user's project next
    to the script or notebook is not; one installed in editable mode may be."""
    if not top.isidentifier():
        return False
    from importlib.util import find_spec

    try:
        spec = find_spec(top)
    except (ImportError, ValueError, AttributeError):
        return False
    where = (spec.origin or "") if spec is not None else ""
    if spec is not None and not where and spec.submodule_search_locations:
        where = next(iter(spec.submodule_search_locations), "")
    where = where.replace("\\", "/")
    return bool(_LIBRARY_PATH.search(where)) or where.startswith(_install_paths(tuple(sys.path)))


@lru_cache(maxsize=65536)
def parse_frame(name: str) -> tuple[str, str, int | None, str, bool]:
    """A frame name -> (label, file, line, function, library).

    ``file(LINE): func`` gives its parts; a built-in (``<built-in method add_ of Tensor
    object at 0x7f...>``) is file ``<built-in>``, no line, and the name without its
    address, which is also its label; anything else is its own label and function.
    """
    found = FRAME_NAME.match(name)
    if found:
        file = found["file"]
        return name, file, int(found["line"]), found["func"], is_library(file)
    label = _ADDRESS.sub("", name)
    if label.startswith("<built-in"):
        return label, "<built-in>", None, label, True
    return label, "", None, label, False


def _labels(trace: TraceTables) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per category of the ``name`` column (plus one for missing, code -1): its label code
    (names that differ only by a built-in's address share one), and per label the label,
    file, line (-1: none), function and whether it is library code; once per trace."""

    def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        categories = trace.events["name"].cat.categories.tolist()
        parsed = [parse_frame(str(c)) for c in categories] + [("", "", None, "", False)]
        code, first = group_rows(np.array([p[0] for p in parsed], dtype=object))
        picked = [parsed[i] for i in first]
        return (
            code,
            np.array([p[0] for p in picked], dtype=object),
            np.array([p[1] for p in picked], dtype=object),
            np.array([-1 if p[2] is None else p[2] for p in picked], dtype=np.int64),
            np.array([p[3] for p in picked], dtype=object),
            np.array([p[4] for p in picked], dtype=bool),
        )

    return trace.shared(Shared.SOURCE_LABELS, compute)


def user_labels(trace: TraceTables) -> np.ndarray:
    """Per label (``_labels``' codes): whether its frames are user code: not library code
    (``is_library``) and not a ``%%chakra_trace`` cell's own line (``_magic_lines``); once
    per trace. ``source()``' ``user``, the frames ``call_tree(user_only=True)`` keeps and
    the frames ``sites()`` names all come from it."""

    def compute() -> np.ndarray:
        library = _labels(trace)[5]
        user = ~library
        user[_magic_lines(trace)] = False
        return user

    return trace.shared(Shared.SOURCE_USER, compute)


def _magic_lines(trace: TraceTables) -> np.ndarray:
    """The label codes (``_labels``) of ``%%chakra_trace`` cells' own lines.

    IPython runs a cell ``%%chakra_trace ...`` + body as ``get_ipython().run_cell_magic(...)``,
    a ``<module>`` frame of the cell's file; the magic (this package's frames, below IPython's)
    compiles the body under a file of its own, mapped to the same ``Cell In[n]``, whose
    ``<module>`` frame holds the user's code. One cell, two ``<module>`` frames: the outer one
    is the magic's invocation, no code of the user's. It is found by the path, so a capture
    without the manifest's ``cells`` map reads the same: a user ``<module>`` frame that is the
    nearest user frame above another user ``<module>`` frame, with a frame of this package
    between them. A user's ``<module>`` that imports or calls user code (no frame of this
    package between) keeps its frame."""
    events = trace.events
    code, _label, file, _line, function, library = _labels(trace)
    user_module = (function == "<module>") & ~library
    none = np.zeros(0, dtype=np.int64)
    if not user_module.any():
        return none
    magic_file = np.array(
        [lib and "tracemagic" in f and bool(_MAGIC_FILE.search(f.replace("\\", "/"))) for f, lib in zip(file, library)],
        dtype=bool,
    )
    if not magic_file.any():
        return none
    is_fn, _ = _frame_masks(trace)
    lab = code[events["name"].cat.codes.to_numpy()]
    user_fn = is_fn & ~library[lab]
    body = np.flatnonzero(user_fn & user_module[lab])
    if body.size == 0:
        return none
    parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
    outer = enclosing_of_kind(parent, depth, user_fn, body)
    via = enclosing_of_kind(parent, depth, is_fn & magic_file[lab], body)
    # both are ancestors of the body: the magic's frame lies between where it is the deeper one
    hit = (outer >= 0) & (via >= 0)
    hit[hit] = depth[via[hit]] > depth[outer[hit]]
    hit[hit] = user_module[lab[outer[hit]]]
    return np.unique(lab[outer[hit]]).astype(np.int64)


def _frame_masks(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """Masks over the events: Python function frames (python_function events that are not
    ``nn.Module`` events); once per trace (read-only)."""

    def compute() -> tuple[np.ndarray, np.ndarray]:
        events = trace.events
        is_py = kind_mask(events, "python_function") & (events["ph"] == "X").to_numpy()
        categories = events["name"].cat.categories
        module_code = np.append(np.asarray(categories.str.startswith(MODULE_PREFIX), dtype=bool), False)
        is_module = is_py & module_code[events["name"].cat.codes.to_numpy()]
        return is_py & ~is_module, is_module

    return trace.shared(Shared.SOURCE_FRAME_MASKS, compute)


def _launch_anchor(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """The GPU activity rows and, per row, the CPU event that launched it: the op of
    ``kernels()`` (``External id`` link) where known, else the runtime call; -1 for none."""
    events = trace.events
    rows = np.flatnonzero(kind_mask(events, *GPU_ACTIVITY) & (events["ph"] == "X").to_numpy())
    op = events["op"].to_numpy()[rows]
    launch = events["launch"].to_numpy()[rows]
    return rows, np.where(op >= 0, op, launch)


#: what ``_beneath`` sums: per kind, the events' thread keys, times (µs from the trace's
#: start) and weights, sorted by (thread, time), with the weights' running sums
_Points = tuple[np.ndarray, np.ndarray, np.ndarray]


def _points(trace: TraceTables) -> dict[str, _Points | None]:
    """The moments whose weights ``source()`` sums beneath a frame, computed once per trace:
    ``gpu``, each GPU activity's duration at the start of the op that launched it (or of
    its runtime call; ``kernels()``' link); ``alloc``, each positive ``[memory]`` delta at
    its time; ``flops``, the trace's ``flops`` of each op not inside another op that has
    one (``aten::linear`` and its ``aten::addmm`` count once), None without any."""

    def sort(rows: np.ndarray, weights: np.ndarray) -> _Points | None:
        if rows.size == 0:
            return None
        events = trace.events
        key = thread_keys(events, rows)
        at = events["ts"].to_numpy()[rows] - trace_start(trace)
        order = np.lexsort((at, key))
        return key[order], at[order], np.concatenate([[0.0], np.cumsum(weights[order], dtype=np.float64)])

    def compute() -> dict[str, _Points | None]:
        events = trace.events
        rows, anchor = _launch_anchor(trace)
        held = anchor >= 0
        gpu = sort(anchor[held], events["dur"].to_numpy()[rows][held])
        memory = np.flatnonzero(kind_mask(events, "memory"))
        delta = events["bytes"].to_numpy(dtype=np.float64, na_value=0.0)[memory]
        alloc = sort(memory[delta > 0], delta[delta > 0])
        flops_arg = events["flops"].to_numpy(dtype=np.float64, na_value=np.nan)
        has = kind_mask(events, "cpu_op") & ~np.isnan(flops_arg)
        flops = None
        if has.any():
            at = np.flatnonzero(has)
            outer = at[enclosing_of_kind(events["parent"].to_numpy(), events["depth"].to_numpy(), has, at) < 0]
            flops = sort(outer, flops_arg[outer]) if outer.size else None
            if flops is None:
                flops = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(1))
        return {"gpu": gpu, "alloc": alloc, "flops": flops}

    return trace.shared(Shared.SOURCE_POINTS, compute)


def _beneath(points: _Points | None, key: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per interval ``[start, end)`` on thread ``key``: the weights of ``points`` there
    (an event contains the moments from its start up to, not including, its end)."""
    out = np.zeros(key.size)
    if points is None or key.size == 0:
        return out
    keys, at, running = points
    for k in np.unique(key):  # one pass per thread
        lo, hi = np.searchsorted(keys, [k, k + 1])
        if lo == hi:
            continue
        where = np.flatnonzero(key == k)
        a = lo + np.searchsorted(at[lo:hi], start[where], side="left")
        b = lo + np.searchsorted(at[lo:hi], end[where], side="left")
        out[where] = running[b] - running[a]
    return out


def _outermost(group: np.ndarray, key: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Mask of the intervals not inside an earlier one of the same ``group`` on the same
    thread ``key``: a recursive call's frames count once, through the outermost, and the
    outermost ones' lengths add up to the union of the group's intervals (on one thread,
    frames nest or are disjoint). One sort, then each group's running end."""
    order = np.lexsort((-end, start, key, group))
    g, k = group[order], key[order]
    new = np.ones(order.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (k[1:] != k[:-1])
    reach = pd.Series(end[order]).groupby(np.cumsum(new)).cummax().to_numpy()
    before = np.empty_like(reach)
    before[:1] = -np.inf
    before[1:] = np.where(new[1:], -np.inf, reach[:-1])
    outer = np.empty(order.size, dtype=bool)
    outer[order] = start[order] >= before
    return outer


# -- source() -------------------------------------------------------------------------------
@computes("source")
def source(trace: TraceTables) -> pd.DataFrame:
    """One row per Python function per rank, and per call-site line where ops carry ``Call
    stack`` strings, with the time, GPU work, memory and FLOPs beneath it.

    Definitions (per rank; a function's frames are its ``python_function`` events, a
    line's frames the ops whose ``Call stack`` holds that line, once where they nest):

    - ``calls``: frames (a line: the ops recorded at it that are not inside another).
    - ``cpu_us`` (inclusive): the length of the union of the frames' intervals on each
      thread, summed over threads: a recursive function counts once. On one thread it
      never exceeds the trace's span (nor a step's, per step); like CPU time, threads add.
      For a line it is the time of the ops called from it (the Python between them is
      not in such traces).
    - ``self_cpu_us``: the frames' time not inside a child Python frame (ops called
      directly count as self time; ``nn.Module`` events are seen through). Self times of
      a thread add up to the inclusive time of its outermost frames (the root); for lines,
      the time of the ops whose innermost stack entry is the line, less that of the ops with
      a stack inside them (so line self times add up to the stacked ops' time).
    - ``gpu_us``: the summed duration of the kernels, memcpy and memset launched by ops
      (or runtime calls) beneath the outermost frames, linked as ``kernels()`` links them.
    - ``alloc_bytes``: the bytes allocated beneath (positive ``[memory]`` deltas).
    - ``flops``: the trace's own ``flops`` (``with_flops``) of the ops beneath, NaN where
      the trace has none.
    - ``user``: user code, not a library, the standard library or a built-in (``is_library``),
      nor a ``%%chakra_trace`` cell's own line (``user_labels``: the cell's code is its body's
      ``<module>``).

    Rows are sorted by rank, then ``cpu_us``, largest first.
    """
    parts = [_function_rows(trace), _line_rows(trace)]
    table = (
        pd.concat([p for p in parts if p is not None], ignore_index=True) if any(p is not None for p in parts) else None
    )
    if table is None or table.empty:
        return _empty()
    table = table.sort_values(["rank", "cpu_us"], ascending=[True, False], kind="stable").reset_index(drop=True)
    return table


_COLUMNS = (
    "rank",
    "kind",
    "name",
    "file",
    "line",
    "function",
    "user",
    "calls",
    "cpu_us",
    "self_cpu_us",
    "gpu_us",
    "alloc_bytes",
    "flops",
)


def _empty() -> pd.DataFrame:
    from tracemagic.analysis.schema import TABLES

    return TABLES["source"].empty()


def _table(
    rank: np.ndarray,
    kind: str,
    label: np.ndarray,
    file: np.ndarray,
    line: np.ndarray,
    function: np.ndarray,
    library: np.ndarray,
    calls: np.ndarray,
    cpu: np.ndarray,
    self_cpu: np.ndarray,
    gpu: np.ndarray,
    alloc: np.ndarray,
    flops: np.ndarray | None,
) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "rank": rank.astype(np.int32),
            "kind": text(np.full(rank.size, kind, dtype=object)),
            "name": text(label),
            "file": text(file),
            "line": _int_or_na(line, line >= 0),
            "function": text(function),
            "user": ~library.astype(bool),
            "calls": calls.astype(np.int64),
            "cpu_us": cpu.astype(np.float64),
            "self_cpu_us": self_cpu.astype(np.float64),
            "gpu_us": gpu.astype(np.float64),
            "alloc_bytes": np.rint(alloc).astype(np.int64),
            "flops": flops.astype(np.float64) if flops is not None else np.full(rank.size, np.nan),
        },
        columns=list(_COLUMNS),
    )


def _function_rows(trace: TraceTables) -> pd.DataFrame | None:
    events = trace.events
    is_fn, _ = _frame_masks(trace)
    rows = np.flatnonzero(is_fn)
    if rows.size == 0:
        return None
    code, label, file, line, function, _ = _labels(trace)
    library = ~user_labels(trace)  # a %%chakra_trace cell's own line is no user code either
    fid = code[events["name"].cat.codes.to_numpy()[rows]]
    rank = events["rank"].to_numpy()[rows].astype(np.int64)
    group, first = group_rows(rank, fid)
    count = first.size
    parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
    up_rows = enclosing_of_kind(parent, depth, is_fn, rows)  # nearest enclosing function frame
    key = thread_keys(events, rows)
    start = events["ts"].to_numpy()[rows] - trace_start(trace)
    dur = events["dur"].to_numpy()[rows]
    end = start + dur
    outer = _outermost(group, key, start, end)
    pos = np.full(len(events), -1, dtype=np.int64)
    pos[rows] = np.arange(rows.size)
    child = up_rows >= 0
    self_cpu = np.bincount(group, weights=dur, minlength=count) - np.bincount(
        group[pos[up_rows[child]]], weights=dur[child], minlength=count
    )
    points = _points(trace)

    def total(kind: str) -> np.ndarray:
        at = _beneath(points[kind], key[outer], start[outer], end[outer])
        return np.bincount(group[outer], weights=at, minlength=count)

    fids = fid[first]
    return _table(
        rank[first],
        "function",
        label[fids],
        file[fids],
        line[fids],
        function[fids],
        library[fids],
        np.bincount(group, minlength=count),
        np.bincount(group[outer], weights=dur[outer], minlength=count),
        self_cpu,
        total("gpu"),
        total("alloc"),
        None if points["flops"] is None else total("flops"),
    )


def _call_stacks(trace: TraceTables) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]], pd.DataFrame] | None:
    """The ops with a non-empty ``Call stack``, each one's stack code and nearest enclosing
    such op (-1: none), the stacks as lists of entry ids (innermost first) and the entries
    (label, file, line, function, library); None where the trace has no call stacks; once
    per trace."""

    def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]], pd.DataFrame] | None:
        events = trace.events
        if "call_stack" not in events:
            return None
        column = events["call_stack"]
        stacks = [str(s) for s in column.cat.categories.tolist()]
        codes = column.cat.codes.to_numpy()
        filled = np.append(np.array([bool(s.strip()) for s in stacks], dtype=bool), False)
        has = kind_mask(events, "cpu_op", "user_annotation") & filled[codes] & (events["ph"] == "X").to_numpy()
        if not has.any():
            return None
        ops = np.flatnonzero(has)
        up = enclosing_of_kind(events["parent"].to_numpy(), events["depth"].to_numpy(), has, ops)
        entries: dict[str, int] = {}
        paths = [[entries.setdefault(e.strip(), len(entries)) for e in s.split(";") if e.strip()] for s in stacks]
        parsed = [parse_frame(e) for e in entries]
        table = pd.DataFrame(parsed, columns=["label", "file", "line", "function", "library"])
        return ops, codes[ops], up, paths, table

    return trace.shared(Shared.SOURCE_CALL_STACKS, compute)


def _line_rows(trace: TraceTables) -> pd.DataFrame | None:
    """Per call-site line: the ops whose stack holds it (``source``' definitions)."""
    found = _call_stacks(trace)
    if found is None:
        return None
    ops, stack_of, up, paths, entries = found
    events = trace.events
    n = len(events)
    # one (op, entry) pair per entry of the op's stack, each entry once (a recursive stack)
    unique = [list(dict.fromkeys(p)) for p in paths]
    sizes = np.array([len(p) for p in unique], dtype=np.int64)
    flat = np.array([e for p in unique for e in p], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n_pairs = sizes[stack_of]
    op_idx = np.repeat(np.arange(ops.size), n_pairs)
    offset = np.arange(op_idx.size) - np.repeat(np.cumsum(n_pairs) - n_pairs, n_pairs)
    entry = flat[starts[stack_of][op_idx] + offset]
    # a pair counts where no enclosing op with a stack holds the same entry (nesting: once)
    width = int(flat.max()) + 1 if flat.size else 1
    keys = np.sort(ops[op_idx] * width + entry)
    pos = np.full(n, -1, dtype=np.int64)
    pos[ops] = np.arange(ops.size)
    outer = np.ones(op_idx.size, dtype=bool)
    idx = np.arange(op_idx.size)
    cur = up[op_idx]
    while idx.size:
        live = cur >= 0
        idx, cur = idx[live], cur[live]
        key = cur * width + entry[idx]
        at = np.minimum(np.searchsorted(keys, key), keys.size - 1)
        held = keys[at] == key
        outer[idx[held]] = False
        idx, cur = idx[~held], cur[~held]
        cur = up[pos[cur]]
    rank = events["rank"].to_numpy()[ops].astype(np.int64)
    group, first = group_rows(rank[op_idx], entry)
    count = first.size
    dur = events["dur"].to_numpy()[ops]
    # self: an op's time not in an op with a stack inside it, to the innermost entry of its stack
    child = up >= 0
    exclusive = dur - np.bincount(pos[up[child]], weights=dur[child], minlength=ops.size)
    inner = offset == 0
    self_cpu = np.bincount(group[inner], weights=exclusive[op_idx[inner]], minlength=count)
    points = _points(trace)
    top = ops[op_idx[outer]]
    top_key = thread_keys(events, top)
    top_start = events["ts"].to_numpy()[top] - trace_start(trace)
    top_end = top_start + events["dur"].to_numpy()[top]

    def total(kind: str) -> np.ndarray:
        at = _beneath(points[kind], top_key, top_start, top_end)
        return np.bincount(group[outer], weights=at, minlength=count)

    ids = entry[first]
    line = entries["line"].to_numpy(dtype=np.float64, na_value=-1)
    return _table(
        rank[op_idx][first],
        "line",
        entries["label"].to_numpy(dtype=object)[ids],
        entries["file"].to_numpy(dtype=object)[ids],
        np.nan_to_num(line[ids], nan=-1).astype(np.int64),
        entries["function"].to_numpy(dtype=object)[ids],
        entries["library"].to_numpy(dtype=bool)[ids],
        np.bincount(group[outer], minlength=count),
        np.bincount(group[outer], weights=events["dur"].to_numpy()[top], minlength=count),
        self_cpu,
        total("gpu"),
        total("alloc"),
        None if points["flops"] is None else total("flops"),
    )


# -- the call tree --------------------------------------------------------------------------
def _rank_nodes(ranks: np.ndarray, rank_of_rows: np.ndarray, extra: list[str]) -> tuple[dict[int, int], np.ndarray]:
    """The ``rank N`` nodes above the ranks' trees (numbered 0 up, in ``ranks``' order, their
    names appended to ``extra``): rank -> node, and the node each of ``rank_of_rows`` hangs below."""
    rank_node: dict[int, int] = {}
    for r in ranks.tolist():
        extra.append(f"rank {r}")
        rank_node[r] = len(rank_node)
    top_of = np.array([rank_node[r] for r in ranks.tolist()], dtype=np.int64)[np.searchsorted(ranks, rank_of_rows)]
    return rank_node, top_of


@computes("call_tree")
def call_tree(trace: TraceTables, user_only: bool = False) -> pd.DataFrame:
    """The merged call tree: Python frames, ``nn.Module`` events, ops and annotations, and
    the GPU activity they launched, with the time of each node.

    Every event becomes a node on the path of names from the outermost frame down to it
    (``<module>`` → ``train`` → ``aten::linear`` → ``aten::addmm`` → the GEMM kernel); events
    on the same path are merged into one node (a flame graph's box). Where ops carry
    ``Call stack`` strings (old traces) the stack's entries, outermost first, are the path
    above the outermost op. ProfilerStep annotations and runtime calls are not nodes (their
    time is their parent's self time); a kernel hangs below the op that launched it (the
    runtime call's ``External id``), else below the node around its runtime call, else
    below ``NO_LAUNCH``. Several ranks: one ``rank N`` node above each rank's tree. In a
    ``%%chakra_trace`` capture (line marks) the outermost ops of autograd's backward thread
    (``lines.waited_in``) hang below the node of the cell's thread that waited for them (the
    ``loss.backward()`` line), not beside it: that node's time holds them.

    Args:
        user_only: leave out library frames and stack lines (``is_library``: torch's own,
            the standard library, built-ins) and a ``%%chakra_trace`` cell's own line (the
            ``<module>`` IPython runs the magic from, ``_magic_lines``: the cell's body is
            its one ``<module>`` frame); what ran inside them hangs below the nearest
            user frame (the own time of a library frame above every user frame, a script's
            runner, is then in no node).

    Columns (times µs): ``node``, ``parent`` (-1 at the top), ``depth``, ``rank``, ``name``,
    ``kind`` (``NODE_KINDS``), ``file``, ``line`` (Python frames), ``user``, ``calls``
    (events merged; 0 for rank and stack-line nodes, which are no events), ``cpu_us``
    (their summed duration: merged events are disjoint, as two calls on one path cannot
    nest; an event that overlaps its siblings or parent partly
    is clipped, see ``_held``, so the top nodes hold each thread's recorded time, the union
    of its events' intervals), ``self_cpu_us`` (``cpu_us`` minus the children's:
    the self times of a subtree add up to its root's ``cpu_us``), ``gpu_us`` (the GPU
    activity below, its own included), ``self_gpu_us`` (a GPU node's own duration),
    ``layer`` (an ``nn.Module`` node's layer as ``layers()`` and the Layers tab name it,
    ``bert.encoder.layer.0``, where the capture's module map names it; NA elsewhere: the
    ``name`` stays the trace's ``nn.Module: BertLayer_0``). Nodes come parents first.
    """
    events = trace.events
    n = len(events)
    parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
    is_fn, is_module = _frame_masks(trace)
    code, label, file, line, function, _ = _labels(trace)
    library = ~user_labels(trace)  # a %%chakra_trace cell's own line is no user code either
    name_code = events["name"].cat.codes.to_numpy()
    lab = code[name_code]
    if user_only:
        is_fn = is_fn & ~library[lab]
    x = (events["ph"] == "X").to_numpy()
    is_op = kind_mask(events, "cpu_op") & x
    is_ann = kind_mask(events, "user_annotation") & x
    is_node = is_fn | is_module | is_op | is_ann
    cpu_rows = np.flatnonzero(is_node)
    up = np.full(n, -1, dtype=np.int64)
    up[cpu_rows] = enclosing_of_kind(parent, depth, is_node, cpu_rows)
    # a %%chakra_trace capture: the outermost ops of autograd's backward thread (not Python
    # frames) hang below the node of the cell's thread that waited for them
    tops = cpu_rows[(up[cpu_rows] < 0) & (is_op | is_ann)[cpu_rows]]
    host = waited_in(trace, tops)
    if (host >= 0).any():
        node_above = propagate(parent, depth, is_node)[np.maximum(host, 0)]
        grafted = (host >= 0) & (node_above >= 0)
        up[tops[grafted]] = node_above[grafted]
    gpu_rows, anchor = _launch_anchor(trace)
    held = np.maximum(anchor, 0)
    gpu_up = np.where(anchor >= 0, np.where(is_node[held], anchor, enclosing_of_kind(parent, depth, is_node, held)), -1)
    gpu_up = np.where(anchor >= 0, gpu_up, -2)  # -2: no launching call
    up[gpu_rows] = np.maximum(gpu_up, -1)
    kind_of = np.full(n, NODE_KINDS.index("other"), dtype=np.int64)
    kind_of[is_fn | (kind_mask(events, "python_function") & ~is_module)] = NODE_KINDS.index("python")
    kind_of[is_module] = NODE_KINDS.index("module")
    kind_of[is_op] = NODE_KINDS.index("op")
    kind_of[is_ann] = NODE_KINDS.index("annotation")
    for k in GPU_ACTIVITY:
        kind_of[kind_mask(events, k)] = NODE_KINDS.index(k)
    rows = np.concatenate([cpu_rows, gpu_rows])
    rank = events["rank"].to_numpy().astype(np.int64)
    ranks = np.unique(rank[rows]) if rows.size else np.zeros(0, dtype=np.int64)
    multi = ranks.size > 1

    # fixed nodes first: one per rank (several ranks), the stacks' entries, NO_LAUNCH
    node_parent: list[np.ndarray] = []
    node_label: list[np.ndarray] = []  # label codes; extra names are negative: -(1 + index into extra)
    node_rank: list[np.ndarray] = []
    node_kind: list[np.ndarray] = []
    extra: list[str] = []
    rank_node: dict[int, int] = {}
    top_of = np.full(rows.size, -1, dtype=np.int64)
    if multi:
        rank_node, top_of = _rank_nodes(ranks, rank[rows], extra)
        node_parent.append(np.full(ranks.size, -1, dtype=np.int64))
        node_label.append(-1 - np.arange(ranks.size, dtype=np.int64))
        node_rank.append(ranks.astype(np.int64))
        node_kind.append(np.full(ranks.size, NODE_KINDS.index("rank"), dtype=np.int64))
    count = len(rank_node)

    # a top op with a Call stack hangs below its stack's entries (one chain of nodes per stack)
    stacks = _call_stacks(trace)
    entry_label: dict[int, int] = {}
    if stacks is not None:
        ops, stack_of, stack_up, paths, entries = stacks
        top_stacked = stack_up < 0
        ops, stack_of = ops[top_stacked], stack_of[top_stacked]
        library_entry = entries["library"].to_numpy(dtype=bool)
        keyed: dict[tuple[int, int], int] = {}
        chain_end: dict[tuple[int, int], int] = {}
        new_parent, new_label, new_rank = [], [], []
        for op, s in zip(ops.tolist(), stack_of.tolist()):
            if up[op] >= 0:
                continue
            r = int(rank[op])
            if (r, s) not in chain_end:
                above = rank_node.get(r, -1)
                for e in reversed(paths[s]):  # outermost first
                    if user_only and library_entry[e]:
                        continue
                    if e not in entry_label:
                        entry_label[e] = len(extra)
                        extra.append(str(entries["label"].iat[e]))
                    key = (above, e)
                    if key not in keyed:
                        keyed[key] = count
                        count += 1
                        new_parent.append(above)
                        new_label.append(-1 - entry_label[e])
                        new_rank.append(r)
                    above = keyed[key]
                chain_end[(r, s)] = above
        if new_parent:
            node_parent.append(np.array(new_parent, dtype=np.int64))
            node_label.append(np.array(new_label, dtype=np.int64))
            node_rank.append(np.array(new_rank, dtype=np.int64))
            node_kind.append(np.full(len(new_parent), NODE_KINDS.index("line"), dtype=np.int64))
        stack_top = np.full(n, -1, dtype=np.int64)
        for op, s in zip(ops.tolist(), stack_of.tolist()):
            if up[op] < 0:
                stack_top[op] = chain_end[(int(rank[op]), s)]
        top_of = np.where(stack_top[rows] >= 0, stack_top[rows], top_of)
    if (gpu_up == -2).any():
        extra.append(NO_LAUNCH)
        lost = np.flatnonzero(gpu_up == -2)
        lost_ranks = np.unique(rank[gpu_rows[lost]])
        ids = count + np.arange(lost_ranks.size)
        node_parent.append(np.array([rank_node.get(r, -1) for r in lost_ranks.tolist()], dtype=np.int64))
        node_label.append(np.full(lost_ranks.size, -len(extra), dtype=np.int64))
        node_rank.append(lost_ranks.astype(np.int64))
        node_kind.append(np.full(lost_ranks.size, NODE_KINDS.index("other"), dtype=np.int64))
        count += lost_ranks.size
        top_of[cpu_rows.size + lost] = ids[np.searchsorted(lost_ranks, rank[gpu_rows[lost]])]

    fixed_count = count
    # the events' nodes, level by level: a node is (parent node, label)
    node_of = np.full(n, -1, dtype=np.int64)
    level = nesting_depth(up, rows) if rows.size else np.zeros(0, dtype=np.int64)
    labels_n = int(code.max()) + 2 if code.size else 1
    for d in range(int(level.max(initial=-1)) + 1):
        at = np.flatnonzero(level == d)
        sel = rows[at]
        pn = np.where(up[sel] >= 0, node_of[np.maximum(up[sel], 0)], top_of[at])
        key = (pn + 1) * labels_n + lab[sel]
        codes, uniques = pd.factorize(key)
        node_of[sel] = count + codes
        firsts = np.full(uniques.size, sel.size, dtype=np.int64)
        np.minimum.at(firsts, codes, np.arange(sel.size))
        node_parent.append(pn[firsts])
        node_label.append(lab[sel[firsts]])
        node_rank.append(rank[sel[firsts]])
        node_kind.append(kind_of[sel[firsts]])
        count += uniques.size

    nparent = np.concatenate(node_parent) if node_parent else np.zeros(0, dtype=np.int64)
    nlabel = np.concatenate(node_label) if node_label else np.zeros(0, dtype=np.int64)
    nrank = np.concatenate(node_rank) if node_rank else np.zeros(0, dtype=np.int64)
    nkind = np.concatenate(node_kind) if node_kind else np.zeros(0, dtype=np.int64)
    dur = events["dur"].to_numpy()
    where = node_of[rows]
    is_gpu_row = np.zeros(rows.size, dtype=bool)
    is_gpu_row[cpu_rows.size :] = True
    calls = np.bincount(where, minlength=count)
    held_dur = _held(trace, cpu_rows, up, level[: cpu_rows.size])
    cpu = np.bincount(where[~is_gpu_row], weights=held_dur, minlength=count)
    self_gpu = np.bincount(where[is_gpu_row], weights=dur[rows[is_gpu_row]], minlength=count)
    # fixed nodes (ranks, stack entries) hold the time of what is below them
    fixed = np.arange(count) < fixed_count
    # a fixed node's time is that of the event nodes right below it (theirs is inclusive)
    held = ~fixed & (nparent >= 0) & fixed[np.maximum(nparent, 0)]
    below = rollup(np.where(held, np.arange(count), -1), cpu, nparent)
    cpu = np.where(fixed, below, cpu)
    has_parent = nparent >= 0
    self_cpu = cpu - np.bincount(nparent[has_parent], weights=cpu[has_parent], minlength=count)
    gpu = _subtree_sum(self_gpu, nparent)
    extra_arr = np.array(extra + [""], dtype=object)
    names = np.where(
        nlabel >= 0, label[np.maximum(nlabel, 0)], extra_arr[np.where(nlabel < 0, -1 - nlabel, len(extra))]
    )
    nfile = np.where(nlabel >= 0, file[np.maximum(nlabel, 0)], "")
    nline = np.where(nlabel >= 0, line[np.maximum(nlabel, 0)], -1)
    nlib = np.where(nlabel >= 0, library[np.maximum(nlabel, 0)], False)
    if stacks is not None and entry_label:  # stack entries: their own file and line
        entries = stacks[4]
        by_extra = {v: k for k, v in entry_label.items()}
        for i in np.flatnonzero(nkind == NODE_KINDS.index("line")).tolist():
            e = by_extra[-1 - int(nlabel[i])]
            nfile[i] = entries["file"].iat[e]
            nline[i] = (
                -1 if entries["line"].iat[e] is None or pd.isna(entries["line"].iat[e]) else int(entries["line"].iat[e])
            )
            nlib[i] = bool(entries["library"].iat[e])
    ops_kinds = np.isin(nkind, [NODE_KINDS.index(k) for k in ("python", "line")])
    nline = nline.astype(np.int64)
    names = _cell_line_names(trace, names, nkind)
    layer = _layer_names(trace, nkind, names)
    return pd.DataFrame(
        {
            "node": np.arange(count, dtype=np.int64),
            "parent": nparent,
            "depth": nesting_depth(nparent, np.arange(count)) if count else np.zeros(0, dtype=np.int64),
            "rank": nrank.astype(np.int32),
            "name": text(names),
            "kind": text_take(np.array(NODE_KINDS, dtype=object), nkind),
            "file": text(np.where(ops_kinds, nfile.astype(object), np.full(count, None, dtype=object))),
            "line": _int_or_na(nline, ops_kinds & (nline >= 0)),
            "user": ~nlib.astype(bool) & ops_kinds,
            "calls": calls.astype(np.int64),
            "cpu_us": cpu,
            "self_cpu_us": self_cpu,
            "gpu_us": gpu,
            "self_gpu_us": self_gpu,
            "layer": text(layer),
        }
    )


def _cell_line_names(trace: TraceTables, names: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """The node names with the magic's line marks (``tracemagic.line:7`` annotations) named
    as the Source tab names them: ``line 7 `loss = model(x)```."""
    texts = cell_lines(trace)
    marked = {
        i: number
        for i in np.flatnonzero(kinds == NODE_KINDS.index("annotation")).tolist()
        if isinstance(names[i], str)
        and names[i].startswith(LINE_MARK_PREFIX)
        and (number := line_of_mark(names[i])) is not None
    }
    if not marked:
        return names
    names = names.copy()
    for i, number in marked.items():
        names[i] = line_label(number, texts.get(number, ""))
    return names


def _layer_names(trace: TraceTables, kinds: np.ndarray, names: np.ndarray) -> np.ndarray:
    """Per node (``kinds``, ``names``): an ``nn.Module`` node's layer as ``layers()`` and the
    Layers tab name it (``bert.encoder.layer.0``, the model's attribute path the capture
    recorded: the manifest's ``modules``, roots renamed as ``_common.module_labels`` renames
    them), None where the capture named no such module (a trace without the map keeps
    torch's ``nn.Module: BertLayer_0``) and for the other nodes. Only the module nodes' names
    are looked up: ``call_tree()`` alone never pays for the layers of every event name."""
    out = np.full(kinds.size, None, dtype=object)
    at = np.flatnonzero(kinds == NODE_KINDS.index("module"))
    if not at.size or not trace.module_names:
        return out
    known = unique_roots(trace.module_names)
    for i in at.tolist():
        name = names[i]
        if not isinstance(name, str):
            continue
        path = module_entry(known, name).get("path")
        if path:
            out[i] = str(path)
    return out


def _held(trace: TraceTables, rows: np.ndarray, up: np.ndarray, level: np.ndarray) -> np.ndarray:
    """The time each of ``rows`` (tree nodes' CPU events) holds in the tree: its interval
    clipped to its tree parent's and after its earlier siblings' (on one thread for the top
    events). Events that overlap partly, as a ``record_function`` annotation that starts
    inside the ``__enter__`` frame and ends inside ``__exit__``, would otherwise make
    children outlast their parent; clipped, the top events hold the union of the thread's
    time and every node's children fit in it."""
    events = trace.events
    ts = events["ts"].to_numpy()[rows] - trace_start(trace)
    end = ts + events["dur"].to_numpy()[rows]
    start_of = np.full(len(events), -np.inf)
    end_of = np.full(len(events), np.inf)
    thread = thread_keys(events, rows)
    for d in range(int(level.max(initial=-1)) + 1):
        at = np.flatnonzero(level == d)
        p = up[rows[at]]
        has = p >= 0
        s = np.maximum(ts[at], np.where(has, start_of[np.maximum(p, 0)], -np.inf))
        e = np.maximum(np.minimum(end[at], np.where(has, end_of[np.maximum(p, 0)], np.inf)), s)
        group = np.where(has, p, -2 - thread[at])
        order = np.lexsort((s, group))
        g = pd.Series(group[order])
        reach = pd.Series(e[order]).groupby(g.to_numpy()).cummax()
        before = reach.groupby(g.to_numpy()).shift(1).to_numpy(dtype=np.float64, na_value=-np.inf)
        s_sorted = np.maximum(s[order], before)
        s[order] = s_sorted
        e = np.maximum(e, s)
        start_of[rows[at]] = s
        end_of[rows[at]] = e
    return end_of[rows] - start_of[rows]


def _int_or_na(values: np.ndarray, known: np.ndarray) -> pd.arrays.IntegerArray:
    """``values`` as a nullable ``Int64`` array, NA where not ``known``."""
    return pd.arrays.IntegerArray(np.where(known, values, 0).astype(np.int64), ~known.astype(bool))


def _subtree_sum(values: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Per node: ``values`` summed over the node and everything below it."""
    return rollup(np.arange(values.size), values, parent)
