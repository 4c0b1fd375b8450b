"""The merged call tree (``trace.call_tree()``) as folded stacks and as a speedscope file.

- **Folded stacks**, the input of Brendan Gregg's ``flamegraph.pl``, of speedscope,
  inferno and most flame-graph tools: one line per stack, ``frame;frame;... value``,
  outermost frame first. The value is the **self time of the stack's last node in integer
  nanoseconds** (the format holds whole numbers, and µs would lose the traces' ns
  resolution): CPU self time by default, GPU time with ``gpu=True`` (the stacks then end in
  the kernel, memcpy or memset). The values add up to the tree's totals: the ``cpu_us``
  (``gpu_us``) of its top nodes, × 1000.
- **speedscope** (https://www.speedscope.app, its file format:
  https://www.speedscope.app/file-format-schema.json): a ``sampled`` profile whose samples
  are the same stacks and whose weights are the same self times, in microseconds; one
  profile of CPU self time and, for a trace with GPU activity, one of GPU time (the one
  opened first: ``gpu``). Python frames carry their file and line.

Nodes: see ``tracemagic.analysis.source.call_tree``; a ``;`` or line break in a name is
written as ``,`` or a space, so every line parses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import pandas as pd

from tracemagic._version import __version__
from tracemagic.analysis.source import call_tree
from tracemagic.trace.layout import atomic_path

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import TraceTables

__all__ = ["folded", "to_folded", "to_speedscope"]

#: speedscope's published schema, which the file names as its ``$schema``
SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"
_CLEAN = str.maketrans({";": ",", "\n": " ", "\r": " "})


def _tree(trace: TraceTables, gpu: bool, user_only: bool) -> pd.DataFrame:
    if gpu and not trace.has_gpu:
        raise ValueError("the trace has no GPU activity (kernels, memcpy, memset): leave out gpu / --gpu")
    return trace.table(call_tree, user_only)  # computed once per trace, as trace.call_tree()


def _stacks(tree: pd.DataFrame, gpu: bool) -> tuple[np.ndarray, np.ndarray]:
    """The nodes with a self value (> 0) and those values in ns (CPU self time, or GPU time)."""
    own = tree["self_gpu_us" if gpu else "self_cpu_us"].to_numpy(dtype=np.float64)
    value = np.rint(np.maximum(own, 0.0) * 1000.0).astype(np.int64)
    nodes = np.flatnonzero(value > 0)
    return nodes, value[nodes]


def _paths(tree: pd.DataFrame, nodes: np.ndarray) -> list[list[int]]:
    """Per node, the node ids from the top down to it."""
    parent = tree["parent"].to_numpy()
    paths = []
    for node in nodes.tolist():
        path = []
        while node >= 0:
            path.append(node)
            node = int(parent[node])
        paths.append(path[::-1])
    return paths


def _write(path: str | os.PathLike[str], data: bytes) -> list[Path]:
    """``data`` written to ``path`` atomically (its folder made), the path in a list."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)
    return [final]


def folded(trace: TraceTables, *, gpu: bool = False, user_only: bool = False) -> list[str]:
    """The call tree as folded-stack lines (``frame;frame;... value``, value in ns; see the
    module's docstring), largest first.

    Raises:
        ValueError: ``gpu`` on a trace without GPU activity.
    """
    tree = _tree(trace, gpu, user_only)
    nodes, values = _stacks(tree, gpu)
    names = [str(n).translate(_CLEAN) for n in tree["name"].tolist()]
    order = np.argsort(-values, kind="stable")
    paths = _paths(tree, nodes[order])
    return [f"{';'.join(names[i] for i in path)} {int(v)}" for path, v in zip(paths, values[order])]


def to_folded(
    trace: TraceTables, path: str | os.PathLike[str], *, gpu: bool = False, user_only: bool = False
) -> list[Path]:
    """Write the folded stacks (``folded``) to ``path`` (atomically), one line per stack.

    Returns:
        The path written, in a list (as every exporter of ``tracemagic.export``).
    """
    lines = folded(trace, gpu=gpu, user_only=user_only)
    return _write(path, "".join(f"{line}\n" for line in lines).encode("utf-8"))


def speedscope(
    trace: TraceTables, *, gpu: bool = False, user_only: bool = False, name: str | None = None
) -> dict[str, Any]:
    """The call tree as a speedscope file (a dict; see the module's docstring).

    Raises:
        ValueError: ``gpu`` on a trace without GPU activity.
    """
    tree = _tree(trace, gpu, user_only)
    frames: list[dict[str, Any]] = []
    frame_of: dict[tuple[str, str, int], int] = {}
    node_frame = np.empty(len(tree), dtype=np.int64)
    kinds = tree["kind"].to_numpy(dtype=object)
    files = tree["file"].to_numpy(dtype=object, na_value=None)
    lines = tree["line"].to_numpy(dtype=np.int64, na_value=-1)
    for i, label in enumerate(tree["name"].tolist()):
        file = files[i] if isinstance(files[i], str) and files[i] else ""
        line = int(lines[i])
        key = (str(label), file, line)
        if key not in frame_of:
            frame: dict[str, Any] = {"name": str(label)}
            if kinds[i] in ("python", "line") and file:
                frame["file"] = file
                if line >= 0:
                    frame["line"] = line
            frame_of[key] = len(frames)
            frames.append(frame)
        node_frame[i] = frame_of[key]
    profiles = []
    wanted = [False, True] if trace.has_gpu else [False]
    for on_gpu in wanted:
        nodes, values = _stacks(tree, on_gpu)
        weights = (values / 1000.0).tolist()
        profiles.append(
            {
                "type": "sampled",
                "name": "GPU time (kernels, memcpy, memset by launching stack)" if on_gpu else "CPU self time",
                "unit": "microseconds",
                "startValue": 0,
                "endValue": float(sum(weights)),
                "samples": [node_frame[p].tolist() for p in _paths(tree, nodes)],
                "weights": weights,
            }
        )
    return {
        "$schema": SPEEDSCOPE_SCHEMA,
        "shared": {"frames": frames},
        "profiles": profiles,
        "name": name or (trace.path.name if trace.path else "trace"),
        "activeProfileIndex": 1 if gpu else 0,
        "exporter": f"tracemagic {__version__}",
    }


def to_speedscope(
    trace: TraceTables, path: str | os.PathLike[str], *, gpu: bool = False, user_only: bool = False
) -> list[Path]:
    """Write the speedscope file (``speedscope``) to ``path`` (atomically); open it at
    https://www.speedscope.app or with the ``speedscope`` command.

    Returns:
        The path written, in a list (as every exporter of ``tracemagic.export``).
    """
    return _write(path, orjson.dumps(speedscope(trace, gpu=gpu, user_only=user_only)))
