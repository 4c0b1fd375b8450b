"""The names of the intermediate results several analyses share through ``Trace.shared``,
defined once: a key written in one module and read in another is this class's attribute,
never a string typed twice (``tests/test_registry.py`` checks every ``shared`` call)."""

from __future__ import annotations

from typing import Final


class Shared:
    """``Trace.shared`` keys, each with the module that computes the result."""

    #: the CPU events' order by thread (``trace.loader``, read by ``analysis._common``)
    CPU_BY_THREAD: Final = "cpu_by_thread"
    #: each event's thread key (``trace.loader`` for one file, else ``analysis._common``)
    THREAD_KEYS: Final = "thread_keys"
    #: the earliest event start, the trace's time zero without a job's (``analysis._common``)
    EARLIEST_TS: Final = "earliest_ts"
    #: the op and layer around each memory event (``analysis._common``)
    MEMORY_HOLDERS: Final = "memory_holders"
    #: the rows of the GPU activity, kernels, memcpy and memset (``analysis._common``)
    ACTIVITY_ROWS: Final = "activity_rows"
    #: whether any memory event is off the CPU (``analysis._common``)
    MEMORY_OFF_CPU: Final = "memory_off_cpu"
    #: each op's call chain (``analysis._common``)
    CALL_CHAINS: Final = "call_chains"
    #: the layer of each op name (``analysis._common``)
    LAYER_PER_NAME: Final = "layer_per_name"
    #: the layers, factorized (``analysis._common``)
    LAYER_CODES: Final = "layer_codes"
    #: events to their layer, with or without flows: ``(ATTRIBUTION, flows)`` (``analysis.attribution``)
    ATTRIBUTION: Final = "attribution"
    #: each step's window per rank (``analysis.steps``)
    STEP_WINDOWS: Final = "step_windows"
    #: times relative to the trace's start (``analysis.steps``)
    RELATIVE_TIMES: Final = "relative_times"
    #: each step's device window (``analysis.steps``)
    DEVICE_WINDOWS: Final = "device_windows"
    #: the step breakdown's category masks (``analysis.steps``)
    CATEGORY_MASKS: Final = "category_masks"
    #: the host phase of each event (``analysis.phases``)
    PHASE_MASKS: Final = "phase_masks"
    #: each event's cell line, from the ``%%chakra_trace`` line marks (``analysis.lines``)
    LINE_MARKS: Final = "line_marks"
    #: one rank's summary for the cross-rank tables (``analysis.ranks``)
    RANK_SUMMARY: Final = "rank_summary"
    #: the roofline's intermediates (``analysis.efficiency``)
    EFFICIENCY_GPU_CHAINS: Final = "efficiency:gpu_chains"
    EFFICIENCY_CHAINS: Final = "efficiency:chains"
    EFFICIENCY_OP_SHAPES: Final = "efficiency:op_shapes"
    EFFICIENCY_ROOFLINE: Final = "efficiency:roofline"
    EFFICIENCY_GPU_SHARES: Final = "efficiency:gpu_shares"
    #: the Python frames' labels, the points they cover and old traces' call-site stacks
    #: (``analysis.source``)
    SOURCE_LABELS: Final = "source:labels"
    SOURCE_POINTS: Final = "source:points"
    SOURCE_CALL_STACKS: Final = "source:call_stacks"
    SOURCE_FRAME_MASKS: Final = "source:frame_masks"
    #: per frame label, whether it is user code (``analysis.source``: not a library, nor a
    #: ``%%chakra_trace`` cell's own line)
    SOURCE_USER: Final = "source:user"
    #: each CPU event's launching user code, and the sites (``analysis.sites``)
    SITES: Final = "sites"
