"""PyTorch Execution Traces (ET, Chakra's "host trace") from paths: read one, join it to its
Kineto trace.

An ET (``ExecutionTraceObserver``) records every operator with its ``op_schema``, input and
output values, shapes, dtypes and the ids of the tensors it reads and writes; the Kineto
trace of the same steps records when each ran. The join key is the ET node's ``rf_id`` =
the Kineto event's ``Record function id``. Reading is ``tracemagic.trace.et_reader``, the join and
the graph ``tracemagic.analysis.et_graph``; these take a ``Trace`` or a path.

Two ET layouts exist: schema ``1.0.1`` (flat ``inputs``/``input_shapes``/``input_types``
and ``parent``) and ``1.0.2-chakra.0.0.4`` and later (``inputs``/``outputs`` objects with
``values``/``shapes``/``types`` [/``strides``], ``ctrl_deps``, and an ``attrs`` list).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pandas as pd

from tracemagic.analysis import et_graph as analysis
from tracemagic.errors import TraceError
from tracemagic.trace import pairing
from tracemagic.trace.et_reader import ExecutionTrace, find_et, is_et_file, next_to, read_et
from tracemagic.trace.loader import load
from tracemagic.trace.model import TraceTables

__all__ = ["ExecutionTrace", "et_graph", "et_ops", "find_et", "read_et"]


def _resolve(source: str | os.PathLike[str]) -> tuple[list[ExecutionTrace], TraceTables | None]:
    """ETs (one per rank) and the Trace to join them with, from a path."""
    base = Path(source)
    if base.is_file() and is_et_file(base):
        et = read_et(base)
        kineto = pairing.kineto_for(base)
        return [et], (load(kineto) if kineto is not None else None)
    ets = next_to(base)
    if not ets:
        raise TraceError(
            f"{base}: no Execution Trace found next to this trace (torch_et_<rank>.json). "
            "Capture with `%%chakra_trace --et`, or with "
            "torch.profiler.profile(..., execution_trace_observer=ExecutionTraceObserver()"
            ".register_callback(path)).",
            path=str(base),
        )
    try:
        trace: TraceTables | None = load(base)
    except TraceError:
        trace = None
    return ets, trace


def et_ops(source: TraceTables | str | os.PathLike[str]) -> pd.DataFrame:
    """Every ET node of every rank joined to its Kineto event by ``rf_id``
    (``tracemagic.analysis.et_graph.join``).

    Args:
        source: a loaded ``Trace`` (its ET is found next to ``trace.path``), a capture
            directory, a Kineto trace file, or an ET file (its Kineto trace is found next
            to it when there is one).

    Raises:
        TraceError: no Execution Trace could be found or read.
    """
    if isinstance(source, TraceTables):
        return analysis.et_ops(source)
    return analysis.join(*_resolve(source))


def et_graph(
    trace_or_dir: TraceTables | str | os.PathLike[str],
    step: int | None = None,
    *,
    level: Literal["top", "leaf", "all"] = "top",
    rank: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ET's operator graph (``tracemagic.analysis.et_graph.graph``) of a ``Trace``, capture
    directory, Kineto trace or ET file.

    Raises:
        TraceError: no ET found, or ``step`` is not in it.
        ValueError: an unknown ``level``.
    """
    return analysis.graph(et_ops(trace_or_dir), step, level=level, rank=rank)
