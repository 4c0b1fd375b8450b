"""The clock on the stepped loop: every iteration timed, its phase noted, slow ones seen.

``LoopClock`` is what ``CaptureSession.step()`` feeds at the end of each iteration of
the stepped loop (with or without the profiler recording): the iteration's wall time
(``time.perf_counter_ns``), its phase in the schedule, and, with ``--slow FACTOR``,
whether it was slower than ``FACTOR`` × the running median of the iterations before it.
It keeps plain lists (a few hundred ns per iteration: ``bench/bench_loop_watch.py``)
and gives the manifest's ``loop_timing`` (``tracemagic.trace.layout.LoopTiming``).
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any

from tracemagic.trace.layout import LoopTiming, SlowCatch

#: ``--slow``: the loop's first iterations, never judged nor counted in the running median
#: (compilation, cache warm-up, first allocations)
SLOW_WARMUP = 5
#: ``--slow``: the fewest iterations in the running median before one is judged
SLOW_MIN_HISTORY = 5
#: ``--slow``: the running median is over the last this many unrecorded iterations
SLOW_WINDOW = 64
#: iterations that the profiler recorded (their time holds its overhead): out of the median
PROFILED = frozenset({"warmup", "active", "slow"})
#: CUDA events made before the loop at most (``GpuMarks``; a longer loop doubles the pool)
GPU_POOL_MAX = 1024


class LoopClock:
    """Times every iteration of a loop and notes its phase; optionally judges slow ones.

    Args:
        slow: ``--slow FACTOR`` (None: no judging).
    """

    def __init__(self, slow: float | None = None) -> None:
        self.slow = slow
        self.wall_ns: list[int] = []
        self.phases: list[list[Any]] = []  # runs [phase, first iteration, count]
        self.recorded: list[list[int]] = []  # [iteration, ProfilerStep number]
        self.catches: list[SlowCatch] = []
        self.stopped_after: int | None = None
        self._count = 0  # len(self.wall_ns)
        self._window: deque[int] = deque()
        self._sorted: list[int] = []

    def add(self, wall_ns: int, phase: str) -> float | None:
        """Record one iteration; with ``slow``, its ratio to the running median when it
        is slower than ``slow`` × that median (else None)."""
        # no call on this path (``+=``, a count kept): inside a recording window, each call
        # is an event in the user's trace (torch's Python tracer records C calls too)
        i = self._count
        self._count = i + 1
        self.wall_ns += (wall_ns,)
        runs = self.phases
        if runs and runs[-1][0] == phase:
            runs[-1][2] += 1
        else:
            runs += ([phase, i, 1],)
        if self.slow is None or phase in PROFILED or i < SLOW_WARMUP:
            return None
        ratio = None
        ordered = self._sorted
        if len(ordered) >= SLOW_MIN_HISTORY:
            median = ordered[len(ordered) // 2]
            if median > 0 and wall_ns > self.slow * median:
                ratio = wall_ns / median
        self._window.append(wall_ns)
        bisect.insort(ordered, wall_ns)
        if len(self._window) > SLOW_WINDOW:
            del ordered[bisect.bisect_left(ordered, self._window.popleft())]
        return ratio

    @property
    def median_ns(self) -> float:
        """The running median the next iteration is judged against (NaN before any)."""
        return float(self._sorted[len(self._sorted) // 2]) if self._sorted else float("nan")

    def as_manifest(self, gpu_ms: list[float] | None = None) -> LoopTiming:
        """The manifest's ``loop_timing``."""
        out: LoopTiming = {
            "wall_ms": [round(ns / 1e6, 6) for ns in self.wall_ns],
            "phases": self.phases,
            "recorded": self.recorded,
            "stopped_after": self.stopped_after,
            "slow": self.catches,
            "slow_factor": self.slow,
            "slow_warmup": SLOW_WARMUP,
        }
        if gpu_ms is not None:
            out["gpu_ms"] = [round(ms, 6) for ms in gpu_ms]
        return out


class GpuMarks:
    """CUDA events at the iteration boundaries of the stepped loop: each iteration's GPU time.

    While torch records with stacks, every Python frame and C call made here is an event in
    the user's trace, under their step: ``torch.cuda.Event().record()`` runs ~15 Python
    frames (the current stream, the device index; ~110 µs a step measured in a capture on an
    H200). So a mark is one C call: the next event of a pool made before the loop, recorded
    on the stream that was current when the capture began (the loop's own stream, where the
    step boundary is). The pool doubles when a loop outruns it.

    Args:
        size: events made up front (the steps the schedule spans, plus one; at most
            ``GPU_POOL_MAX``).
    """

    def __init__(self, size: int) -> None:
        import torch  # CUDA only: the clock above runs on every loop

        self._event = torch.cuda.Event
        self._record = torch._C._CudaEventBase.record
        self.stream = torch.cuda.current_stream()
        self.events: list[Any] = [self._event(enable_timing=True) for _ in range(min(max(size, 1), GPU_POOL_MAX))]
        self._size = len(self.events)  # len(self.events), read without a call
        self.count = 0  # events recorded

    def mark(self) -> None:
        """Record the next event (one C call while the pool lasts)."""
        count = self.count
        if count == self._size:
            self.events += [self._event(enable_timing=True) for _ in range(self._size)]
            self._size += self._size
        self._record(self.events[count], self.stream)
        self.count = count + 1

    def elapsed_ms(self) -> list[float]:
        """The GPU time between consecutive marks, in ms (waits for the last one)."""
        events = self.events[: self.count]
        if not events:
            return []
        events[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]
