"""``tracemagic.capture(...)``: the ``%%chakra_trace`` capture for scripts, on one rank or all.

A context manager and a decorator around the magic's own ``CaptureSession`` (same options,
same files, same ``capture.json``), handing out the same ``tracemagic.facade.Capture``::

    with tracemagic.capture(active=3, et=True) as cap:
        for batch in cap.steps(loader):          # or call cap.step() after each step
            train_step(batch)
    print(cap.result.summary())
    cap.result.trace.steps()                     # the capture's tracemagic.Trace

    @tracemagic.capture(active=3)               # one capture per call of main()
    def main(): ...

Under ``torchrun`` every rank records its own ``kineto_trace_<rank>.json`` (and
``torch_et_<rank>.json`` with ``et=True``) into one shared directory (see
``tracemagic.capture.distributed``), and rank 0 writes the ``capture.json`` of all ranks once
they are done. An exception inside the block propagates after the files are written.

This is the top layer (it hands out the facade's ``Capture``); ``tracemagic.capture(...)``
is ``capture`` here (``tracemagic/__init__.py`` makes the ``tracemagic.capture`` package
callable), and ``tracemagic run`` (``tracemagic.run``) drives a ``ScriptCapture``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from tracemagic.capture import distributed
from tracemagic.capture import result as _result
from tracemagic.capture.config import CaptureConfig, config_from_options
from tracemagic.capture.loop import LoopPlan
from tracemagic.errors import CaptureError

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.capture.session import CaptureSession
    from tracemagic.facade import Capture

__all__ = ["ScriptCapture", "capture"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def capture(*, timeout: float = 300.0, whole: bool = False, **options: Any) -> ScriptCapture:
    """A capture of a script's step loop, usable as ``with`` block or decorator.

    Args:
        timeout: seconds rank 0 waits for the other ranks to finish before it writes
            ``capture.json`` without them (it is updated when they finish later), and
            that a rank waits for rank 0 to share the directory.
        whole: record the whole block as one step (no ``step()`` calls needed), as the
            magic does for a cell without a loop.
        **options: the ``%%chakra_trace`` options as keywords: ``wait``, ``warmup``,
            ``active``, ``repeat``, ``skip_first``, ``skip_first_wait``, ``cpu_only``,
            ``record_shapes`` (or ``no_shapes``), ``profile_memory`` (``no_memory``),
            ``with_stack`` (``no_stack``), ``with_flops``, ``memory_timeline``
            (``no_memory_timeline``), ``et``, ``out``, ``name``, ``gzip``, ``tb_names``.

    Raises:
        CaptureError: an unknown or invalid option.
    """
    return ScriptCapture(config_from_options(**options), timeout=timeout, whole=whole)


class ScriptCapture:
    """One capture at a time of a script's steps; reusable, not re-entrant.

    Attributes:
        config: the validated options.
        rank: this process's rank (0 outside torch.distributed).
        world_size: the number of ranks (1 outside torch.distributed).
        dir: the capture directory, once started.
    """

    def __init__(self, config: CaptureConfig, *, timeout: float = 300.0, whole: bool = False) -> None:
        if timeout <= 0:
            raise CaptureError(f"timeout must be > 0 seconds, got {timeout!r}.")
        self.config = config
        self.timeout = float(timeout)
        self.whole = whole
        self.rank, self.world_size = 0, 1
        self.dir: Path | None = None
        self._finished: _result.CaptureResult | None = None  # the data; ``result`` hands it out
        self._full: Capture | None = None
        self._session: CaptureSession | None = None
        self._namespace: dict[str, Any] = {}
        self._signals = _TermAsExit()

    # -- the handle the script steps with ------------------------------------------------
    def step(self) -> None:
        """End the current step and begin the next (``prof.step()``)."""
        if self._session is None:
            raise CaptureError("cap.step() outside the capture: call it inside the `with` block.")
        self._session.step()

    def steps(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable``, ending a step after each one (also on ``continue``).

        An iteration that raises ends no step: the error leaves the block and the capture
        keeps the steps recorded before it.
        """
        for item in iterable:
            yield item
            self.step()

    def note(self, message: str) -> None:
        """Add a line to the capture's manifest ``notes`` (ignored when not running)."""
        if self._session is not None:
            self._session.note(message)

    def stop(self) -> None:
        """Stop recording now (the rest of the block is not traced)."""
        if self._session is not None:
            self._session.stop()

    @property
    def running(self) -> bool:
        """Whether a capture is in progress (started, not finished)."""
        return self._session is not None

    @property
    def recording(self) -> bool:
        """Whether the current step is being recorded."""
        return self._session is not None and self._session.recording

    @property
    def step_num(self) -> int:
        """The profiler's current step number (``ProfilerStep#N``)."""
        return self._session.step_num if self._session is not None else 0

    @property
    def result(self) -> Capture | None:
        """The finished capture, as the magic gives it: ``tracemagic.facade.Capture`` with
        its ``trace``, ``dashboard``, ``report()`` (on rank 0 of a job: all ranks' manifest);
        None until a capture has finished. Made on first access (pandas is imported then,
        not when the capture ends: ``tracemagic run`` never needs it)."""
        if self._full is None and self._finished is not None:
            from tracemagic.facade import Capture  # pandas: imported on first use

            self._full = Capture.of(self._finished)
        return self._full

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, namespace: dict[str, Any] | None = None) -> Path:
        """Create (or join) the capture directory and start the profiler; step 0 begins.

        ``with`` does this; call it yourself only to start later than the block does
        (``finish()`` then ends the capture).

        Raises:
            CaptureError: a capture is already running, or the directory is unusable.
        """
        from tracemagic.capture.session import CaptureSession, profiler_busy  # torch: on first use

        if self._session is not None:
            raise CaptureError("this capture is already running (a capture cannot be nested in itself).")
        busy = profiler_busy(et=self.config.et)
        if busy:
            raise CaptureError(busy)
        self._finished = self._full = None
        rank, world, initialized = distributed.rank_and_world()
        self.rank, self.world_size = rank, world
        self.dir = distributed.shared_directory(
            self.config.out, self.config.name, rank, world, initialized, self.timeout
        )
        session = CaptureSession(
            self.config,
            LoopPlan(mode="none" if self.whole else "manual"),
            line=_describe(self.config, self.whole),
            namespace=namespace if namespace is not None else self._namespace,
            rank=rank,
            world_size=world,
            directory=self.dir,
        )
        session.open()
        self._session = session
        if world > 1:
            self._signals.install()
        try:
            session.start()
        except BaseException as exc:
            self.end(exc)
            raise
        return self.dir

    def finish(self, error: BaseException | None = None) -> Capture:
        """Stop, write the files and the manifest; on rank 0 of a job, merge all ranks'.

        Never raises because of the capture itself; returns ``result``.
        """
        self.end(error)
        finished = self.result
        assert finished is not None
        return finished

    def end(self, error: BaseException | None = None) -> _result.CaptureResult:
        """``finish()``, returning the data ``tracemagic.capture.result.Capture`` (its
        directory, manifest and summary) without importing pandas; ``with`` ends this way."""
        session = self._session
        if session is None:
            if self._finished is not None:
                return self._finished
            raise CaptureError("this capture was never started.")
        self._signals.defer()
        try:
            finished = session.finish(error=error)
            if self.world_size > 1:
                # (a Ctrl-C held while the files were written: the user stops, rank 0 waits for no one)
                finished = self._merge(finished, failed=error is not None or session.interrupted)
        finally:
            self._session = None
            self._signals.restore()
        self._finished, self._full = finished, None
        if session.interrupted and error is None:  # Ctrl-C held while the files were written
            raise KeyboardInterrupt
        return finished

    def _merge(self, own: _result.CaptureResult, failed: bool) -> _result.CaptureResult:
        """Rank 0 waits for the others (unless its own block failed); any rank merges."""
        assert self.dir is not None
        if self.rank == 0 and not failed:  # a SIGTERM (torchrun stopping the job) ends the wait
            with contextlib.suppress(KeyboardInterrupt):
                distributed.wait_for_ranks(
                    self.dir, self.world_size, self.timeout, cancelled=lambda: self._signals.pending
                )
        try:
            manifest = distributed.write_merged_manifest(self.dir, self.world_size)
        except OSError as exc:
            own.manifest.setdefault("notes", []).append(f"capture.json could not be written: {exc}")
            return own
        return _result.CaptureResult(self.dir, manifest) if self.rank == 0 else own

    def __enter__(self) -> ScriptCapture:
        frame = sys._getframe(1)
        self._namespace = {**frame.f_globals, **frame.f_locals}
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if self._session is not None:
            self.end(error)
        return False  # the block's exception, if any, propagates

    def __call__(self, func: F) -> F:
        """Decorate ``func``: each call runs inside a fresh capture (``with self:``)."""

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._namespace = dict(func.__globals__)
            self.start()
            try:
                value = func(*args, **kwargs)
            except BaseException as exc:
                self.end(exc)
                raise
            self.end()
            return value

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "running" if self._session is not None else "finished" if self._finished else "ready"
        where = f" at {str(self.dir)!r}" if self.dir else ""
        return f"<ScriptCapture {state} rank {self.rank}/{self.world_size}{where}>"


def _describe(config: CaptureConfig, whole: bool) -> str:
    """The options as a call, for the manifest's ``arguments.line``."""
    defaults = CaptureConfig()
    changed = [
        f"{f.name}={getattr(config, f.name)!r}"
        for f in dataclasses.fields(CaptureConfig)
        if getattr(config, f.name) != getattr(defaults, f.name)
    ]
    if whole:
        changed.append("whole=True")
    return f"tracemagic.capture({', '.join(changed)})"


class _TermAsExit:
    """While a rank captures, SIGTERM (torchrun stopping the job) raises ``SystemExit``.

    So a rank stopped because another one failed still writes what it recorded. While the
    files are written (``defer``) a SIGTERM is only noted, and delivered again once the
    previous handler is back (``restore``). Installed only over the default handler, from
    the main thread.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False
        self._pending = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._pending = False
        self._previous = signal.signal(signal.SIGTERM, self._raise)
        self._installed = True

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        self.defer()
        raise SystemExit(128 + signum)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._pending = True

    @property
    def pending(self) -> bool:
        """Whether a SIGTERM arrived while the files were being written."""
        return self._pending

    def defer(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._note)

    def restore(self) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGTERM, self._previous)
        self._installed = False
        if self._pending:
            self._pending = False
            signal.raise_signal(signal.SIGTERM)
