"""The Kineto vocabulary, defined once: event kinds, step names, ranks in file names.

What torch's profiler (Kineto) writes and how tracemagic names it: the ``cat`` of an event
and the normalized ``kind`` it gets (``KINDS``), which kinds run on a GPU, the
``ProfilerStep#N`` step annotations, and the rank a trace or Execution Trace file name
carries. Every reader, analysis and exporter takes these from here.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "CATEGORY_KIND",
    "CPU_KINDS",
    "GPU_ACTIVITY",
    "GPU_CATEGORIES",
    "GPU_KINDS",
    "KINDS",
    "LINE_MARK_MAX",
    "LINE_MARK_PREFIX",
    "STEP_NAME",
    "STEP_PREFIX",
    "rank_from_name",
    "line_of_mark",
    "rank_at_stem_end",
    "step_number",
]

#: normalized event kinds, in display order
KINDS = (
    "step",
    "cpu_op",
    "user_annotation",
    "python_function",
    "runtime",
    "kernel",
    "memcpy",
    "memset",
    "gpu_annotation",
    "memory",
    "trace",
    "other",
)
#: GPU activity with a duration on the device: what counts as GPU time
GPU_ACTIVITY = ("kernel", "memcpy", "memset")
#: kinds that run on a GPU stream (pid = device, tid = stream): the activity and the
#: ``gpu_user_annotation`` ranges drawn over it
GPU_KINDS = (*GPU_ACTIVITY, "gpu_annotation")
#: kinds that run on a CPU thread and nest there
CPU_KINDS = ("step", "cpu_op", "user_annotation", "python_function", "runtime")
#: the name of a line mark of a ``%%chakra_trace`` cell: ``tracemagic.line:<N>``, N its line in
#: the cell (the magic's line is 1); torch records it as a ``cpu_op`` (``_RecordFunctionFast``),
#: it is loaded as the ``user_annotation`` it means; the manifest's ``line_marks`` lists the lines
LINE_MARK_PREFIX = "tracemagic.line:"
#: the largest line a line mark names (a larger number is no line of a cell: the name is not a
#: line mark, and the loader warns about it)
LINE_MARK_MAX = 2**31 - 1
_LINE_DIGITS = len(str(LINE_MARK_MAX))

#: Kineto's event ``cat`` (lower-cased) -> its ``KINDS`` entry (any other cat: ``other``;
#: ``[memory]`` instant events: ``memory``; a ``ProfilerStep#N`` cpu_op: ``step``)
CATEGORY_KIND = {
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "user_annotation",
    "python_function": "python_function",
    "python": "python_function",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "runtime": "runtime",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "gpu_user_annotation": "gpu_annotation",
    "trace": "trace",
}
#: the Kineto categories of the events on a GPU stream (``GPU_KINDS``)
GPU_CATEGORIES = frozenset(cat for cat, kind in CATEGORY_KIND.items() if kind in GPU_KINDS)

#: how a step annotation's name starts
STEP_PREFIX = "ProfilerStep#"
#: a step's name: ``ProfilerStep#`` and its number N (group 1), which fits int64 (at most 18
#: digits); ``ProfilerStep#abc`` and the like are left as the annotations they are. Use with
#: ``match`` (a prefix: Kineto writes nothing after the number)
STEP_NAME = re.compile(r"ProfilerStep#(\d{1,18})(?!\d)")


def step_number(name: object) -> int:
    """N of a ``ProfilerStep#N`` name (the step events are those so named).

    Raises:
        ValueError: ``name`` is not a step's name.
    """
    match = STEP_NAME.match(str(name))
    if match is None:
        raise ValueError(f"not a ProfilerStep#N name: {name!r}")
    return int(match.group(1))


def line_of_mark(name: object) -> int | None:
    """The cell line N of a line mark's name (``tracemagic.line:N``, N in ASCII digits, at
    most ``LINE_MARK_MAX``), else None (any other name, ``tracemagic.line:99999999999999999999``
    included: no line, and no number to convert to a C long)."""
    if not isinstance(name, str) or not name.startswith(LINE_MARK_PREFIX):
        return None
    digits = name[len(LINE_MARK_PREFIX) :]
    if not (0 < len(digits) <= _LINE_DIGITS and digits.isascii() and digits.isdigit()):
        return None
    number = int(digits)
    return number if number <= LINE_MARK_MAX else None


#: a rank in a file name: the number after ``rank``, ``worker``, ``kineto_trace_`` or a
#: word ``et`` (``rank-3``, ``worker3``, ``kineto_trace_3``, ``torch_et_3``, ``et.3``; not
#: ``resnet_50``), the first such
_RANK_IN_NAME = re.compile(r"(?:rank|worker|kineto_trace_|(?<![a-z0-9])et)[-_.]?(\d+)", re.IGNORECASE)
#: pairing's last resort: the last number of a stem, after ``rank``, ``worker`` or ``_``
_RANK_AT_STEM_END = re.compile(r"(?:rank|worker|_)[-_]?(\d+)(?=\D*$)")


#: torch's ``tensorboard_trace_handler`` file name, ``<worker>.<span>.pt.trace.json[.gz]``
#: (the worker ``<host>_<pid>`` unless named, the span a timestamp; the TensorBoard plugin's
#: ``WORKER_PATTERN`` with the span required): the files of one worker are one process
_TB_FILE = re.compile(r"^(.+)\.\d+\.pt\.trace\.json(?:\.gz)?$")


def tb_worker(name: str) -> str | None:
    """The worker a ``tensorboard_trace_handler`` file name gives (``host_123`` of
    ``host_123.1795829963338.pt.trace.json``), None for other names.

    Args:
        name: a file name (a folder before it is ignored).
    """
    match = _TB_FILE.match(Path(name).name)
    return match.group(1) if match else None


def rank_from_name(name: str) -> int | None:
    """The rank a trace's or Execution Trace's file name carries (``rank-3``, ``worker3``,
    ``kineto_trace_3``, ``torch_et_3``), if any.

    Args:
        name: a file name (a folder before it is ignored).
    """
    match = _RANK_IN_NAME.search(Path(name).name)
    return int(match.group(1)) if match else None


def rank_at_stem_end(name: str) -> int | None:
    """The last number of a file name's stem (before its first dot) when ``rank``, ``worker``
    or ``_`` precedes it (``trainer_3_et.json``: 3), else None: how an ET and a Kineto trace
    of other tools' names are paired by rank (``trace.pairing.rank_of``)."""
    match = _RANK_AT_STEM_END.search(name.split(".")[0])
    return int(match.group(1)) if match else None
