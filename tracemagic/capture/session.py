"""One capture: torch.profiler and the ET observer around a cell, and the files they leave.

``CaptureSession`` is the one capture core: the magic runs a cell in it, and a script's
``tracemagic.capture(...)`` and ``tracemagic run`` (``tracemagic.script``) run one per rank,
in a directory shared by the ranks. It is also the handle the cell sees (``chakra``): the
rewritten loop calls ``step()`` at the end of each iteration, ``start()`` before and
``stop()`` after it.
Whatever happens in the cell, ``finish()`` stops the profiler, unregisters the ET observer,
writes what was recorded and the manifest, and returns a ``Capture``.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.py's C half (no stub in typeshed)
import contextlib
import functools
import itertools
import logging
import mmap
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.profiler import ExecutionTraceObserver, ProfilerAction, ProfilerActivity

from tracemagic._version import __version__
from tracemagic.capture import distributed, files, notices
from tracemagic.capture.config import CaptureConfig
from tracemagic.capture.loop import Fetch, Iteration, LoopPlan
from tracemagic.capture.naming import (
    Called,
    find_roots,
    module_event_names_in,
    module_map,
    namespace_modules,
    recorded_modules,
    resolve,
)
from tracemagic.capture.result import CaptureResult
from tracemagic.capture.watch import GpuMarks, LoopClock
from tracemagic.errors import CaptureError
from tracemagic.trace import layout
from tracemagic.trace.layout import FileEntry, Manifest, SlowCatch

_log = logging.getLogger(__name__)
_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
#: the line marks' context manager (capture/loop.py ``mark_lines``): torch's C++
#: RecordFunction, ~1 µs while recording, a no-op while the profiler is off
LINE_MARK: Any = getattr(torch._C._profiler, "_RecordFunctionFast", torch.profiler.record_function)
_ACTIVE: CaptureSession | None = None
#: the capture's note for ``--warmup 0`` (in place of torch's warning, which points into this file)
NO_WARMUP_NOTE = (
    "--warmup 0: no warm-up step before the recorded ones, so the profiler's own start-up can land in "
    "the first of them (torch.profiler warns that this can skew its times)"
)
#: the attribute set on a ``KeyboardInterrupt`` held while a window was written (``_raise_held``)
HELD = "_tracemagic_held"
#: the main thread, the only one that may set a signal handler (``_hold_interrupts``). The
#: hold runs in the user's loop at a window's end, where torch still records every Python
#: call: ``_signal``'s C functions and this id are used, not ``signal.signal``/``getsignal``
#: and ``threading.main_thread()``, which go through Python-level enum conversions (~20 µs
#: and a dozen events in the user's trace per hold)
_MAIN_THREAD = threading.main_thread().ident

#: Column meaning of the memory timeline rows (``MemoryProfileTimeline`` raw format).
MEMORY_TIMELINE_FORMAT = {
    "row": ["ts_ns", "action", "bytes", "category"],
    "time": "ts_ns is Unix-epoch ns (-1: allocated before the capture); the Kineto ts in us "
    "is (ts_ns - baseTimeNanoseconds) / 1000",
    "actions": {"1": "PREEXISTING", "2": "CREATE", "3": "INCREMENT_VERSION", "4": "DESTROY"},
    "categories": [
        "PARAMETER",
        "OPTIMIZER_STATE",
        "INPUT",
        "TEMPORARY",
        "ACTIVATION",
        "GRADIENT",
        "AUTOGRAD_DETAIL",
        None,
    ],
}


def profiler_busy(et: bool = False) -> str | None:
    """Why a new capture cannot start now, or None if nothing else is profiling.

    Args:
        et: the capture records an Execution Trace (then another registered
            ExecutionTraceObserver is a reason too).
    """
    if _ACTIVE is not None:
        return (
            "a %%chakra_trace capture is already running (nested capture); "
            "a cell can be captured by one session at a time."
        )
    if torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
        return (
            "a torch profiler is already running (a torch.profiler.profile() that was "
            "started and not stopped); stop it (prof.stop(), or leave its `with` block) first."
        )
    if et and not et_observer_free():
        return ET_OBSERVER_BUSY
    return None


@dataclass
class StepRecord:
    """One ``ProfilerStep#N`` written to a trace.

    ``end`` says how the step ended: ``step`` (the loop stepped), ``loop_exit`` (the
    loop finished: the step holds only its exit), ``cell_end`` or ``error``.
    """

    step: int
    cycle: int
    complete: bool
    end: str
    wall_ms: float


@dataclass
class _Cycle:
    number: int
    label: int | None  # the cycle suffix in file names (None with a single cycle)
    steps: list[StepRecord]
    kineto: str | None = None
    memory: str | None = None
    et: str | None = None
    window: Called = field(default_factory=dict)  # trace module name -> module (naming)


class _Profiler(torch.profiler.profile):
    """``torch.profiler.profile`` that hushes torch's start/stop notices and, when a
    recording window's trace is exported, reads which modules its ``nn.Module`` events
    stand for (``_modules``; a window that is not written is not read).

    Nothing is installed around the window (see ``tracemagic.capture.naming``); without
    ``with_stack`` there are no ``nn.Module`` events to name.
    """

    def __init__(self, session: CaptureSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._session = session

    # Where the notices filter is on, descriptor 2 already goes through it: torch's start and
    # stop, which print the notices, run through ``Filter.aside`` (the filter's reader is not
    # woken); its other calls run as they are (between start_trace and stop_trace every
    # Python call here is an event in the user's trace).
    def prepare_trace(self) -> None:
        notices_filter = self._session._filter
        if notices_filter is not None and notices_filter.active:
            super().prepare_trace()
            return
        with self._session._hushed():
            super().prepare_trace()

    def start_trace(self) -> None:
        notices_filter = self._session._filter
        if notices_filter is not None and notices_filter.active:
            notices_filter.aside(super().start_trace)
            return
        with self._session._hushed():
            super().start_trace()

    def stop_trace(self) -> None:
        if not torch._C._autograd._profiler_enabled():
            # switched off under us (torch.autograd._disable_profiler(), another profiler):
            # torch's results are then invalid, and exporting them crashes the process
            self._session._switched_off = True
        notices_filter = self._session._filter
        if notices_filter is not None and notices_filter.active:
            notices_filter.aside(super().stop_trace)
            return
        with self._session._hushed():
            super().stop_trace()

    def _modules(self, trace: bytes | mmap.mmap | None = None) -> Called:
        """The modules of the window just stopped, by trace name, found while they are alive
        (``trace``: its Kineto JSON's contents, just exported, which makes the search cheaper)."""
        if not self.with_stack:
            return {}
        try:
            names = module_event_names_in(trace) if trace is not None else None
            return resolve(recorded_modules(self.profiler, names=names), namespace_modules(self._session.namespace))
        except Exception as exc:  # noqa: BLE001 - names are a convenience, never worth a failed capture
            _log.debug("naming nn.Module events failed", exc_info=True)
            self._session.note(f"nn.Module events could not be named by attribute path ({type(exc).__name__}: {exc}).")
            return {}


class CaptureSession:
    """A capture in progress, and the handle a cell steps with ``chakra.step()``.

    Args:
        config: the validated options.
        plan: what the cell's rewrite steps (``LoopPlan``).
        cell: the cell source, kept in the manifest.
        line: the magic's argument line, kept in the manifest.
        namespace: the user namespace, to name models after their variables.
        cells: the notebook's cell files -> execution counts (IPython's compiler's map,
            read as the capture starts): the manifest's ``cells``, so the views name
            a cell's frames ``Cell In[3]`` as tracebacks do, not by its temporary file.
        rank: this process's rank (default: ``torch.distributed``'s, else 0).
        world_size: the number of ranks (default: ``torch.distributed``'s, else 1); with
            several, this rank's manifest goes to ``ranks/<rank>.json``, from which
            ``capture.json`` is merged (``distributed.write_merged_manifest``).
        directory: the capture directory, already made (a job's ranks share one); default:
            ``open()`` makes ``OUT/NAME-<timestamp>``.
        filter_notices: pass descriptor 2 through ``notices.Filter`` while recording (the
            magic: torch's notices kept out of the notebook); off for scripts and ranks, whose
            last lines before a crash must reach their log directly.
    """

    #: what a line mark runs in (``with __chakra_trace__._mark("tracemagic.line:N"):``)
    _mark = LINE_MARK

    def __init__(
        self,
        config: CaptureConfig,
        plan: LoopPlan,
        *,
        cell: str = "",
        line: str = "",
        namespace: dict[str, Any] | None = None,
        cells: Mapping[str, int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        directory: Path | None = None,
        filter_notices: bool = False,
    ) -> None:
        self.config = config
        self.plan = plan
        self.cell = cell
        self.line = line
        self.namespace = namespace if namespace is not None else {}
        self.cells = cells
        self.dir: Path | None = None
        if rank is None or world_size is None:
            rank, world_size = _rank_and_world()
        self.rank, self.world_size = rank, world_size
        self._directory = directory
        self._one_step = plan.mode == "none"
        self._prof: _Profiler | None = None
        self._et: ExecutionTraceObserver | None = None
        self._et_label: int | None = None  # the cycle label of the ET being recorded
        self._started = False
        self._stopped = False
        self._skip_step = False
        self._failed_at: str | None = None  # where the iteration that raised was (``_error_note``)
        self._iteration = Iteration(self)  # the rewritten loop's ``with`` (capture/loop.py)
        #: a stepped ``for`` loop's iterable, fetched under its line's mark (capture/loop.py)
        self._fetch = functools.partial(Fetch, self)
        # line marks (capture/loop.py ``mark_lines``): on while a profiler runs
        self._marking = False
        self._iterations = 0
        self._t_step = 0  # perf_counter_ns at the start of the current iteration
        self._clock = LoopClock(config.slow)
        self._gpu: GpuMarks | None = None  # CUDA events at the iteration boundaries
        self._schedule_done = False
        self._slow_prof: _Profiler | None = None  # a --slow recording in progress
        # the steps of the cycle being recorded, (step, complete, end, wall_ms): their cycle is
        # the one they are written in (``_on_trace_ready`` makes them ``StepRecord``s)
        self._pending: list[tuple[int, bool, str, float]] = []
        self._written_cycles = 0  # len(self._cycles), read by step() without a call
        self._cycles: list[_Cycle] = []
        self._notes: list[str] = []
        self._hidden: list[str] = []  # torch's own start/stop notices, kept out of the output
        # descriptor 2 through a line filter while recording (torch's mid-loop notices): the
        # notebook's only; a script's or a rank's crash output must reach its log unbuffered
        self._filter = notices.Filter(self._hidden) if filter_notices else None
        self._switched_off = False  # the profiler was switched off inside the current cycle
        self._interrupted = False  # a Ctrl-C arrived while a window was written (``_hold_interrupts``)
        self._left_loop = False  # ``stop()`` ran: the loop (or the cell's recording) was over
        self._created = datetime.now(UTC)
        self._base: Manifest | None = None  # the manifest's fixed part (_base_manifest)
        self._manifest_lines: dict[str, tuple[Any, str]] = {}  # as written (layout.manifest_text memo)
        self._sizes: dict[str, int] = {}  # bytes of the files placed, as read while placing them

    # -- what the cell sees ------------------------------------------------------------
    @property
    def step_num(self) -> int:
        """The profiler's current step number (``ProfilerStep#N``)."""
        return self._prof.step_num if self._prof is not None else 0

    @property
    def recording(self) -> bool:
        """Whether the current step is being recorded."""
        return self._prof is not None and not self._stopped and self._prof.current_action in _RECORDING

    def step(self) -> None:
        """End the current step and begin the next (``prof.step()``).

        Every call also times the iteration that ends (``loop_timing`` in the manifest),
        before, during and after the schedule; with ``--slow`` it judges the iterations
        after the schedule and records the one after a slow one.
        """
        now = time.perf_counter_ns()
        if self._skip_step:  # the iteration raised (or was ended early): no step() for it
            self._skip_step = False
            return
        self._iterations += 1
        prof = self._prof
        if prof is None or self._stopped:
            if self._started:
                self._after_schedule(now)
            return
        action = prof.current_action
        if action in _RECORDING:
            phase = "active"
            # ``+=``, not ``append``: while torch records, each call here (C ones too) is an
            # event in the user's trace, and an operator is none
            self._clock.recorded += ([self._iterations - 1, prof.step_num],)
            self._pending += ((prof.step_num, True, "step", (now - self._t_step) / 1e6),)
        elif action == ProfilerAction.WARMUP:
            phase = "warmup"
        else:
            phase = "skip" if prof.step_num < self.config.skip_first else "wait"
        self._clock.add(now - self._t_step, phase)
        if self._gpu is not None:
            self._gpu.mark()
        ended = prof.step_num
        if action == ProfilerAction.RECORD_AND_SAVE:  # the window ends: stopped and written now
            held = self._hold_interrupts()
            try:
                prof.step()
            finally:
                _release_interrupts(held)
        else:
            prof.step()
        if self.config.repeat and self._written_cycles >= self.config.repeat:
            self._schedule_done = True
            self._end_recording()  # the schedule is done: no cost for the rest of the loop
        self._t_step = time.perf_counter_ns()
        if self._interrupted:
            self._raise_held(
                f" at the end of step {ended}, once the steps recorded were written (Ctrl-C waits for them)"
            )

    def _after_schedule(self, now: int) -> None:
        """``step()`` past the schedule: time the iteration, and the ``--slow`` watch."""
        slow = self._slow_prof
        ratio = self._clock.add(now - self._t_step, "after" if slow is None else "slow")
        if self._gpu is not None:
            self._gpu.mark()
        if slow is not None:
            self._end_slow(slow)
        elif ratio is not None and len(self._clock.catches) < self.config.slow_max:
            self._begin_slow(now - self._t_step, ratio)
        self._t_step = time.perf_counter_ns()
        if self._interrupted:
            self._raise_held()

    def _gpu_ms(self) -> list[float] | None:
        """The GPU time of each timed iteration: between consecutive boundary events."""
        if self._gpu is None or not self._gpu.count:
            return None
        try:
            return self._gpu.elapsed_ms()
        except Exception as exc:  # noqa: BLE001 - the GPU times are a convenience
            _log.debug("no GPU time per iteration", exc_info=True)
            self._notes.append(f"no GPU time per iteration ({type(exc).__name__}: {exc})")
            return None

    def _begin_slow(self, wall_ns: int, ratio: float) -> None:
        """Iteration ``n`` was slow: record iteration ``n + 1`` with a profiler of its own."""
        iteration = self._iterations - 1
        catch: SlowCatch = {
            "iteration": iteration,
            "wall_ms": round(wall_ns / 1e6, 6),
            "median_ms": round(self._clock.median_ns / 1e6, 6),
            "ratio": round(ratio, 3),
            "recorded": iteration + 1,
            "path": None,
        }
        self._clock.catches.append(catch)
        try:
            # a schedule that always records: torch marks ProfilerStep#N only under a schedule
            prof = _Profiler(self, schedule=_always_record, **self._profile_kwargs())
            prof.step_num = iteration + 1  # its ProfilerStep#N is the iteration's number
            prof.start()
            self._marking = True
        except Exception as exc:  # noqa: BLE001 - the watch must never break the loop
            _log.debug("--slow: starting its profiler failed", exc_info=True)
            self._notes.append(f"--slow: iteration {iteration + 1} could not be recorded ({type(exc).__name__}: {exc})")
            return
        self._slow_prof = prof

    def _end_slow(self, prof: torch.profiler.profile) -> None:
        """Stop the ``--slow`` recording and write its trace."""
        self._slow_prof = None
        self._marking = False
        assert self.dir is not None
        catch = self._clock.catches[-1]
        name = layout.slow_name(self.rank, len(self._clock.catches), self.config.gzip)
        held = self._hold_interrupts()
        try:
            prof.stop()
            files.write_with(self.dir / name, prof.export_chrome_trace, gz=self.config.gzip, beside=True)
            catch["path"] = name
        except Exception as exc:  # noqa: BLE001 - torch's stop or export failed: noted, the loop goes on
            _log.debug("--slow: writing its trace failed", exc_info=True)
            self._notes.append(f"--slow: the trace of iteration {catch['recorded']} was not written ({exc})")
        finally:
            _release_interrupts(held)
            with contextlib.suppress(Exception):
                torch.autograd.profiler.KinetoStepTracker.erase_step_count("ProfilerStep")

    @property
    def done(self) -> bool:
        """Whether the profile is complete: the schedule's last cycle is written (with
        ``--slow``, also its ``--slow-max`` traces). A cell that steps itself may
        ``break`` on it; ``--stop`` does that for the stepped loop."""
        return (
            self._schedule_done
            and self._slow_prof is None
            and (self.config.slow is None or len(self._clock.catches) >= self.config.slow_max)
        )

    def _stop_loop(self) -> bool:
        """Called by the ``--stop`` rewrite after ``step()``: True ends the loop (``break``)."""
        if not self.done:
            return False
        self._clock.stopped_after = self._iterations - 1
        return True

    def _continue(self) -> None:
        """Called by the ``--stop`` rewrite at a ``continue``: end the iteration now (its
        ``finally`` then skips ``step()``), so ``_stop_loop`` can be asked before going on."""
        self.step()
        self._skip_step = True

    def note(self, message: str) -> None:
        """Add a line to the manifest's ``notes``."""
        self._notes.append(message)

    def _fail(self) -> None:
        """Called by the rewritten loop when an iteration raises: no step() for it."""
        self._skip_step = True
        if self._prof is not None and not self._stopped:
            self._failed_at = f" in step {self.step_num}"
        else:  # past the schedule (or before it began): that iteration is in no step
            self._failed_at = self._past_schedule()

    # -- lifecycle ---------------------------------------------------------------------
    def open(self) -> Path:
        """Check that a capture can run and create its directory, before the cell runs
        (a ``directory`` given to the constructor is used as it is: its maker checked).

        Raises:
            CaptureError: another profiler is running, or the directory is not writable.
        """
        if self._directory is not None:
            self.dir = self._directory
        else:
            busy = profiler_busy(et=self.config.et)
            if busy:
                raise CaptureError(busy)
            self.dir = files.make_capture_dir(self.config.out, self.config.name, probe=False)
            try:  # also the check that the directory can be written
                self._write_manifest(status="running")
            except OSError as exc:
                raise files.unwritable(self.config.out, exc) from None
            return self.dir
        self._write_manifest(status="running")
        return self.dir

    def start(self) -> None:
        """Start the profiler (and ET observer) now; step 0 begins. Idempotent."""
        global _ACTIVE
        if self._started:
            return
        if self.dir is None:
            self.open()
        self._started = True
        _ACTIVE = self
        if cfg_cuda(self.config):
            cfg = self.config
            self._gpu = GpuMarks(cfg.skip_first + (cfg.wait + cfg.warmup + cfg.active) * max(cfg.repeat, 1) + 1)
        if self._filter is not None:
            self._filter.start()
        if self.config.et:
            self._open_et(1)
        with warnings.catch_warnings():
            # torch warns of no warmup from this line: a cell without a loop (its one step)
            # needs none, and ``--warmup 0``, asked for, gets a note of the capture instead
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            if not self._one_step and self.config.warmup == 0:
                self._notes.append(NO_WARMUP_NOTE)
            self._prof = _Profiler(
                self,
                schedule=torch.profiler.schedule(**self.schedule),
                on_trace_ready=self._on_trace_ready,
                execution_trace_observer=self._et,
                **self._profile_kwargs(),
            )
        self._prof.start()
        self._marking = True
        # ProfilerStep#0 begins at the end of start(): its wall time is measured from here,
        # not from before the profiler's own set-up
        if self._gpu is not None:
            self._gpu.mark()
        self._t_step = time.perf_counter_ns()

    def _profile_kwargs(self) -> dict[str, Any]:
        """The ``torch.profiler.profile`` options of this capture (its cycles and ``--slow``)."""
        cfg = self.config
        activities = [ProfilerActivity.CPU]
        if cfg_cuda(cfg):
            activities.append(ProfilerActivity.CUDA)
        return dict(
            activities=activities,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
            with_flops=cfg.with_flops,
        )

    def stop(self) -> None:
        """Stop recording now (the loop is over); the rest of the cell is not traced."""
        self._left_loop = True
        self._end_recording()
        if self._interrupted:
            self._raise_held()

    def _end_recording(self) -> None:
        """Stop the profiler (writing the window it records) and the notices filter."""
        self._stop_profiler("cell_end" if self._one_step else "loop_exit")
        if self._filter is not None:
            self._filter.stop()

    @property
    def interrupted(self) -> bool:
        """Whether a Ctrl-C arrived while ``finish()`` wrote the files: held until they were
        written (``finish`` never raises); its caller raises ``KeyboardInterrupt`` then."""
        return self._interrupted

    def _hold_interrupts(self) -> Any:
        """Hold Ctrl-C (SIGINT) while a window is stopped and written: one that arrives then
        is noted (``_interrupted``) and raised once the files are on disk, at the loop's next
        step (``_raise_held``), instead of cutting torch's stop or export short, which lost
        the whole window (and its execution trace); a second Ctrl-C does cut it short. Only
        over Python's own handler (as a kernel runs a cell), from the main thread.

        Returns:
            The handler to put back with ``_release_interrupts`` (None: nothing changed).
        """
        if threading.get_ident() != _MAIN_THREAD:
            return None
        try:
            if _signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                return None  # another handler (or one of ours, already holding): left as it is
            return _signal.signal(signal.SIGINT, self._note_interrupt)
        except (ValueError, OSError):
            return None

    def _note_interrupt(self, signum: int, frame: FrameType | None) -> None:
        """A Ctrl-C while held: noted; a second one raises at once (the user insists: the
        write is cut short, as without the hold)."""
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt
        self._interrupted = True

    def _raise_held(self, where: str | None = None) -> None:
        """Raise the Ctrl-C held while a window was written, marked ``HELD`` (the magic
        ends its traceback at the cell's line: the frames below are the capture's);
        ``where``: where it was, for ``_error_note``, if not where the loop is now."""
        self._interrupted = False
        if where is not None:
            self._failed_at = where
        interrupt = KeyboardInterrupt()
        setattr(interrupt, HELD, True)
        raise interrupt

    @property
    def schedule(self) -> dict[str, int]:
        """The ``torch.profiler.schedule`` arguments in effect."""
        if self._one_step:
            return {"wait": 0, "warmup": 0, "active": 1, "repeat": 1, "skip_first": 0}
        c = self.config
        out = {"wait": c.wait, "warmup": c.warmup, "active": c.active, "repeat": c.repeat}
        out["skip_first"] = c.skip_first
        if c.skip_first_wait:
            out["skip_first_wait"] = c.skip_first_wait
        return out

    def finish(self, error: BaseException | None = None) -> CaptureResult:
        """Stop everything, write what was recorded and the manifest; never raises.

        Args:
            error: the exception the cell raised, if any (the caller re-raises it).
        """
        held = self._hold_interrupts()  # a Ctrl-C now waits for the files (``interrupted``)
        try:
            return self._finish(error)
        finally:
            _release_interrupts(held)

    def _finish(self, error: BaseException | None) -> CaptureResult:
        global _ACTIVE
        try:
            self._abandon_slow()
            self._stop_profiler("error" if error is not None else "cell_end")
        except KeyboardInterrupt:  # a second Ctrl-C cut the write short: the manifest says what is
            self._interrupted = True  # on disk, then the caller raises it (``interrupted``)
            self._notes.append("Ctrl-C pressed again while the recorded steps were written: their write was cut short")
        finally:
            try:
                self._cleanup()  # closes the ET observer, whose notice the filter still hides
            finally:
                if self._filter is not None:
                    self._filter.stop()  # descriptor 2 is the user's again, whatever _cleanup raised
                if _ACTIVE is self:
                    _ACTIVE = None
        status = self._status(error)
        if error is not None:
            self._notes.insert(0, self._error_note(error, status))
        self._notes.extend(self._schedule_notes(error))
        try:
            manifest = self._manifest(status, error)
        except Exception as exc:  # noqa: BLE001 - never lose the cell's own error to bookkeeping
            _log.debug("building the manifest failed", exc_info=True)
            manifest = self._base_manifest(status)
            manifest.update(
                {
                    "files": [{"path": files.MANIFEST, "kind": layout.MANIFEST_KIND}],
                    "notes": [*self._notes, f"capture.json is incomplete ({type(exc).__name__}: {exc})"],
                    "error": _error_entry(error),
                }
            )
        assert self.dir is not None
        try:
            self._write_manifest(manifest=manifest)
        except OSError as exc:
            manifest["notes"].append(f"capture.json could not be written: {exc}")
        return CaptureResult(self.dir, manifest)

    # -- internals ---------------------------------------------------------------------
    def _abandon_slow(self) -> None:
        """The loop ended while ``--slow`` recorded an iteration: stop, write nothing."""
        prof, self._slow_prof = self._slow_prof, None
        self._marking = False
        if prof is None:
            return
        catch = self._clock.catches[-1]
        self._notes.append(
            f"--slow: the loop ended during iteration {catch['recorded']}, "
            f"recorded after slow iteration {catch['iteration']}: no trace of it."
        )
        stop_profiler(prof)

    def _stop_profiler(self, end: str) -> None:
        self._marking = self._slow_prof is not None
        if self._prof is None or self._stopped:
            self._stopped = True
            return
        self._stopped = True
        prof = self._prof
        held = self._hold_interrupts()
        try:
            if prof.current_action in _RECORDING:
                complete = self._one_step and end == "cell_end"
                self._pending.append((prof.step_num, complete, end, (time.perf_counter_ns() - self._t_step) / 1e6))
            failed = stop_profiler(prof)
        finally:
            _release_interrupts(held)
        if failed is not None:
            self._notes.append(f"torch.profiler failed to stop cleanly: {failed}")

    def _cleanup(self) -> None:
        """Unregister the ET observer of a cycle that never ended."""
        self._close_et(None)

    def _hushed(self) -> contextlib.AbstractContextManager[None]:
        """What torch's profiler calls run in: ``notices.hush``, unless the notices filter is
        on (descriptor 2 already goes through it, and it keeps the notices in the same list)."""
        if self._filter is not None and self._filter.active:
            return contextlib.nullcontext()
        return notices.hush(self._hidden)

    # -- the Execution Trace: one per cycle, like the Kineto trace ------------------------
    def _cycle_label(self, number: int) -> int | None:
        """The cycle suffix in file names (None with a single cycle)."""
        return None if self.config.repeat == 1 or self._one_step else number

    def _et_partial(self, label: int | None) -> Path:
        assert self.dir is not None
        return files.partial_path(self.dir / files.et_name(self.rank, label))

    def _open_et(self, number: int) -> None:
        """Register the ET observer of cycle ``number`` (torch starts it with the cycle)."""
        self._et_label = self._cycle_label(number)
        self._et = register_et_observer(self._et_partial(self._et_label))
        if self._prof is not None:
            self._prof.execution_trace_observer = self._et

    def _close_et(self, cycle: _Cycle | None) -> None:
        """Finalize the current ET; keep it as ``cycle``'s, or delete it (``cycle`` None).

        The profiler has stopped the observer by then (``stop_trace`` runs before
        ``on_trace_ready``), so the ET holds exactly the cycle's steps.
        """
        if self._et is None:
            return
        tmp = self._et_partial(self._et_label)
        try:
            self._et.unregister_callback()
        except Exception as exc:  # noqa: BLE001 - torch's observer failed: noted, and removed below
            self._notes.append(f"the execution trace observer failed to finalize: {exc}")
            with contextlib.suppress(Exception):
                torch._C._profiler._remove_execution_trace_observer()
        self._et = None
        if self._prof is not None:
            self._prof.execution_trace_observer = None
        try:
            if cycle is not None and cycle.steps and tmp.exists():
                name = files.et_name(self.rank, self._et_label)
                files.place(tmp, tmp.with_name(name))
                cycle.et = name
            else:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            self._notes.append(f"the execution trace could not be placed: {exc}")

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        """Write one cycle's Kineto trace and memory timeline (never raises into the loop)."""
        assert self.dir is not None
        if self._pending and all(end == "loop_exit" for _, _, end, _ in self._pending):
            # the loop ended just as the window opened: a trace of its exit alone is noise
            self._pending = []
            self._close_et(None)
            return
        number = len(self._cycles) + 1
        label = self._cycle_label(number)
        steps = [StepRecord(step, number, complete, end, wall_ms) for step, complete, end, wall_ms in self._pending]
        cycle = _Cycle(number, label, steps=steps)
        self._pending = []
        self._cycles.append(cycle)
        self._written_cycles = len(self._cycles)
        if self._switched_off:
            self._switched_off = False
            self._notes.append(
                f"cycle {cycle.number}: the profiler was switched off inside the cell "
                "(torch.autograd._disable_profiler() or another profiler started in the loop), "
                "so torch recorded nothing usable: no trace was written for it."
            )
            self._close_et(None)
            return
        gz = self.config.gzip

        def named(data: bytes | mmap.mmap) -> None:  # the window's modules are named from it, still alive
            cycle.window = self._prof._modules(data) if self._prof is not None else {}

        try:
            if self.config.tb_names:
                name = files.tb_name(files.tb_worker(), gz=gz)
            else:
                name = files.kineto_name(self.rank, label, gz)
            size = files.write_with(self.dir / name, prof.export_chrome_trace, gz=gz, beside=True, inspect=named)
            cycle.kineto = name
            if size is not None:
                self._sizes[name] = size
        except Exception as exc:  # noqa: BLE001 - torch's export failed: noted, the capture goes on
            self._notes.append(f"cycle {cycle.number}: the Kineto trace was not written: {exc}")
        if self.config.records_memory_categories:
            try:
                cycle.memory = self._write_memory_timeline(prof, label)
            except Exception as exc:  # noqa: BLE001 - torch's classification failed: noted, the capture goes on
                self._notes.append(
                    f"cycle {cycle.number}: no memory timeline (torch could not classify "
                    f"the allocations: {type(exc).__name__}: {exc})"
                )
        if self._et is not None:
            self._close_et(cycle)
            if not self._stopped and (self.config.repeat == 0 or number < self.config.repeat):
                try:
                    self._open_et(number + 1)
                except CaptureError as exc:
                    self._notes.append(f"cycles after {number} have no execution trace: {exc}")

    def _write_memory_timeline(self, prof: torch.profiler.profile, label: int | None) -> str:
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        assert self.dir is not None
        device = "cuda:0" if ProfilerActivity.CUDA in prof.activities else "cpu"
        name = files.memory_name(self.rank, label, self.config.gzip)
        timeline = MemoryProfileTimeline(prof._memory_profile())
        files.write_with(
            self.dir / name,
            lambda path: timeline.export_memory_timeline_raw(path, device),
            gz=self.config.gzip,
            beside=True,
        )
        return name

    def _status(self, error: BaseException | None) -> str:
        """``complete``, ``partial``, ``failed`` or ``empty``, from what is on disk: steps of a
        cycle whose trace could not be written do not count."""
        recorded = [s for c in self._cycles for s in c.steps]
        steps = [s for c in self._cycles if c.kineto for s in c.steps]
        complete = [s for s in steps if s.complete]
        if not steps:
            return "failed" if error is not None or recorded else "empty"
        if len(steps) < len(recorded):
            return "partial"
        schedule = self.schedule  # the one-step schedule of a cell without a loop, too
        expected = schedule["active"] * (schedule["repeat"] or len(self._cycles))
        if error is not None or len(complete) < expected:
            return "partial"
        return "complete"

    def _past_schedule(self) -> str:
        """Where an iteration after the schedule's last step is, for ``_error_note``."""
        return f" in iteration {self._iterations} of the loop (counted from 0), after the recorded steps"

    def _error_note(self, error: BaseException, status: str) -> str:
        """The note on the cell's exception: where it was raised, and what was written
        (as ``status`` says: on disk)."""
        recorded = sum(s.complete for c in self._cycles for s in c.steps)
        if self._failed_at is not None:  # an iteration of the stepped loop raised
            where = self._failed_at
        elif self._prof is None:
            where = " before the loop"
        elif self._left_loop:  # stop() ran: after the bracketed loop, or the cell's own stop()
            where = (
                " after the loop (every step it ran was ended)"
                if self.plan.mode == "loop"
                else f" after {self.config.handle}.stop()"
            )
        elif self._schedule_done:  # in the loop (its header), past the schedule
            where = self._past_schedule()
        else:  # in the loop's header (a DataLoader, a generator) or in a step() call
            where = f" in step {self.step_num}"
        if status == "partial":
            written = f"{recorded} complete step(s) recorded before it were written (partial capture)"
        elif recorded:
            written = (
                f"{recorded} complete step(s) were recorded before it, but no trace was written ({status} capture)"
            )
        else:
            written = f"no complete step was recorded before it, so no trace was written ({status} capture)"
        return f"the cell raised {type(error).__name__}{where}; {written}."

    def _schedule_notes(self, error: BaseException | None) -> list[str]:
        if self._one_step or not self._started:
            return []
        steps = [s for c in self._cycles for s in c.steps]
        before = self.config.steps_before_first_active
        c = self.config
        if not steps and error is None:
            return [
                f"no trace written: the loop ran {self._iterations} iteration(s), but the "
                f"schedule records nothing before iteration {before + 1} (skip_first "
                f"{c.skip_first} + wait {0 if c.skip_first_wait else c.wait} + warmup "
                f"{c.warmup} = {before} steps come first). Run at least {before + 1} "
                "iterations, or lower --skip-first/--wait/--warmup."
            ]
        notes = []
        last = self._cycles[-1] if self._cycles else None
        if last is not None and error is None:
            complete = sum(s.complete for s in last.steps)
            if complete < c.active:
                notes.append(
                    f"only {complete} of --active {c.active} steps were recorded in cycle "
                    f"{last.number}: the loop ended after {self._iterations} iteration(s)."
                )
        for s in steps:
            if s.end == "loop_exit":
                notes.append(f"ProfilerStep#{s.step} holds only the loop's exit (incomplete).")
        return notes

    def _manifest(self, status: str, error: BaseException | None) -> Manifest:
        assert self.dir is not None
        written = [c for c in self._cycles if c.kineto]
        entries: list[FileEntry] = []
        for c in written:
            assert c.kineto is not None
            entries.append({"path": c.kineto, "kind": layout.KINETO_KIND, "rank": self.rank, "cycle": c.label})
            if c.memory:
                entries.append({"path": c.memory, "kind": layout.MEMORY_KIND, "rank": self.rank, "cycle": c.label})
        for c in self._cycles:
            if c.et:
                entries.append({"path": c.et, "kind": layout.ET_KIND, "rank": self.rank, "cycle": c.label})
        for catch in self._clock.catches:
            if catch.get("path"):
                entries.append({"path": str(catch["path"]), "kind": layout.SLOW_KIND, "rank": self.rank, "cycle": None})
        sizes = self._sizes
        for entry in entries:
            path = entry["path"]
            entry["bytes"] = sizes[path] if path in sizes else os.stat(os.path.join(self.dir, path)).st_size
        entries.append({"path": files.MANIFEST, "kind": layout.MANIFEST_KIND})

        roots = find_roots(m for c in written for m in c.window.values() if not isinstance(m, str))
        maps = {str(c.kineto): module_map(c.window, roots, self.namespace) for c in written}
        first = next(iter(maps.values()), {})
        manifest = self._base_manifest(status)
        manifest.update(
            {
                "steps": [dict(vars(s)) for c in self._cycles for s in c.steps],  # asdict deep-copies
                "steps_recorded": sum(len(c.steps) for c in self._cycles),
                "iterations": self._iterations,
                "loop_timing": self._clock.as_manifest(self._gpu_ms()),
                "files": entries,
                "modules": first,
                "notes": list(self._notes),
                "error": _error_entry(error),
                "hidden_output": list(self._hidden),
            }
        )
        if any(m != first for m in maps.values()):
            manifest["modules_by_file"] = maps
        if any(c.memory for c in written):
            manifest["memory_timeline"] = MEMORY_TIMELINE_FORMAT
        return manifest

    def _base_manifest(self, status: str) -> Manifest:
        """The manifest's part known before the cell runs, with ``status`` (made once per
        session; a new dict each call, its values shared)."""
        if self._base is None:
            self._base = self._fixed_manifest()
        return {**self._base, "status": status}

    def _fixed_manifest(self) -> Manifest:
        use_cuda = torch.cuda.is_available() and not self.config.cpu_only
        return {
            "format": layout.MANIFEST_FORMAT,
            "status": "running",
            "name": self.config.name,
            "created": self._created.isoformat(timespec="seconds"),
            "arguments": {"line": self.line, "options": self.config.as_dict()},
            "schedule": self.schedule,
            "loop": self.plan.as_dict(),
            "cell": self.cell,
            "line_marks": self.plan.line_marks(),
            "versions": dict(_versions(sys.modules.get("IPython"))),  # a copy: the manifest is the caller's
            "device": {
                "type": "cuda" if use_cuda else "cpu",
                "name": torch.cuda.get_device_name() if use_cuda else _cpu_name(),
                "activities": ["CPU", "CUDA"] if use_cuda else ["CPU"],
            },
            "rank": self.rank,
            "world_size": self.world_size,
            **({"cells": cell_numbers(self.cells)} if self.cells else {}),
        }

    def _write_manifest(self, *, status: str = "running", manifest: Manifest | None = None) -> None:
        assert self.dir is not None
        data = manifest if manifest is not None else self._base_manifest(status)
        if self._directory is not None and self.world_size > 1:  # a job's shared directory
            distributed.write_part(self.dir, self.rank, data)
        else:
            # the final manifest replaces the running one
            text = layout.manifest_text(data, self._manifest_lines)
            files.write_text(os.path.join(self.dir, files.MANIFEST), text, replacing=manifest is not None)


def _release_interrupts(previous: Any) -> None:
    """Put back the SIGINT handler ``CaptureSession._hold_interrupts`` replaced."""
    if previous is not None:
        _signal.signal(signal.SIGINT, previous)


def start_profiler(prof: torch.profiler.profile, hidden: list[str] | None = None) -> None:
    """Start ``prof``; with ``hidden``, torch's start notices are kept out of the output
    and collected there (``notices.hush``; a ``_Profiler`` hushes itself)."""
    with notices.hush(hidden) if hidden is not None else contextlib.nullcontext():
        prof.start()


def stop_profiler(prof: torch.profiler.profile, hidden: list[str] | None = None) -> str | None:
    """Stop ``prof`` and make sure no profiler stays on, whatever torch raises.

    Where torch fails to stop, the autograd profiler is switched off by hand; the step
    counter ``ProfilerStep`` is reset either way (the next profiler counts from 0).

    Args:
        prof: a started profiler.
        hidden: as ``start_profiler``'s.

    Returns:
        None, or torch's error text when it failed to stop (its results are then unusable).
    """
    failed = None
    with notices.hush(hidden) if hidden is not None else contextlib.nullcontext():
        try:
            prof.stop()
        except Exception as exc:  # noqa: BLE001 - torch failed to stop: make sure nothing stays on
            failed = str(exc)
            with contextlib.suppress(Exception):
                if torch._C._autograd._profiler_enabled():
                    torch.autograd._disable_profiler()
                if not torch._C._autograd._profiler_enabled():  # torch's flag, read by profiler_busy
                    torch.autograd.profiler._set_is_profiler_enabled(False)
        finally:
            with contextlib.suppress(Exception):
                torch.autograd.profiler.KinetoStepTracker.erase_step_count("ProfilerStep")
    return failed


#: the most notebook cells a manifest names (``cells``: the session's latest)
MAX_CELLS = 2000
#: why ``--et`` cannot record while another ExecutionTraceObserver is registered
ET_OBSERVER_BUSY = (
    "--et: an ExecutionTraceObserver is already registered in this process (yours, or "
    "ENABLE_PYTORCH_EXECUTION_TRACE=1's). torch keeps one per process, so this capture would "
    "write no Execution Trace. Finalize yours first (observer.unregister_callback()), or drop "
    "--et and pass your observer to torch.profiler.profile(execution_trace_observer=...)."
)


def register_et_observer(path: Path) -> ExecutionTraceObserver:
    """An ``ExecutionTraceObserver`` registered to write ``path``.

    Raises:
        CaptureError: another observer is registered (``ET_OBSERVER_BUSY``); it is left as it was.
    """
    observer = ExecutionTraceObserver().register_callback(str(path))
    if not path.exists():
        # torch creates the file on registration; it did not: it kept the observer that was
        # already there (and only warned). Unregistering ours, as its __del__ would, removes
        # THAT one, so ours is marked as never registered.
        observer._registered = False
        raise CaptureError(ET_OBSERVER_BUSY)
    return observer


def et_observer_free() -> bool:
    """Whether no ExecutionTraceObserver is registered (probed by registering one of ours
    for an instant; another one is left untouched)."""
    folder = Path(tempfile.mkdtemp(prefix="tracemagic-et-probe-"))
    try:
        register_et_observer(folder / "probe.json").unregister_callback()
    except CaptureError:
        return False
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return True


def _always_record(step: int) -> ProfilerAction:
    """The ``--slow`` recorder's schedule: record (its one step)."""
    return ProfilerAction.RECORD


def cfg_cuda(config: CaptureConfig) -> bool:
    """Whether the capture records CUDA (available and not ``--cpu-only``)."""
    return torch.cuda.is_available() and not config.cpu_only


def cell_numbers(cells: Mapping[str, int], most: int = MAX_CELLS) -> dict[str, int]:
    """The last ``most`` entries of a shell's map of cell files to execution counts (IPython's
    ``CachingCompiler._filename_map``), those whose count is a number."""
    size = len(cells)
    picked = dict(cells) if size <= most else dict(itertools.islice(cells.items(), size - most, None))
    if set(map(type, picked)) <= {str} and set(map(type, picked.values())) <= {int}:
        return picked  # IPython's map, as it is (checked in C, not entry by entry)
    return {str(name): int(number) for name, number in picked.items() if isinstance(number, int)}


@functools.cache
def _versions(ipython: Any) -> dict[str, str | None]:
    """The versions a manifest names (the process's: looked up once, and again if IPython
    is imported later)."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tracemagic": __version__,
        "ipython": getattr(ipython, "__version__", None),
    }


@functools.cache
def _cpu_name() -> str:
    """The CPU a manifest names when the capture records no GPU (looked up once)."""
    return platform.processor() or platform.machine()


def _error_entry(error: BaseException | None) -> dict[str, Any] | None:
    """The manifest's ``error``: the cell's exception type and message, or None.

    An exception whose ``str()`` raises gets a message saying so (as Python's own
    tracebacks do): it raised in ``finish()``, which then lost the capture and replaced
    the user's exception with its own.
    """
    if error is None:
        return None
    try:
        message = str(error)
    except Exception as exc:  # noqa: BLE001 - the user's exception class: never lose the capture to it
        message = f"<exception str() failed: {type(exc).__name__}>"
    return {"type": type(error).__name__, "message": message}


def _rank_and_world() -> tuple[int, int]:
    """Rank and world size from ``torch.distributed`` when initialized, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
