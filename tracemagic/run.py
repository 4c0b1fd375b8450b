"""``python -m tracemagic run [options] -- script.py [args]``: capture a script without editing it.

The script runs as ``__main__`` (``runpy``, with its own ``sys.argv``). A step is an
optimizer step: a global ``Optimizer.step`` post-hook (``register_optimizer_step_post_hook``)
starts the capture at the first step of the first optimizer that steps, so the set-up
(model, data, process group) stays out of the trace and the schedule counts from the first
optimizer step. ``--whole`` records the whole script as one step instead (for scripts
without an optimizer).

A step ends when that optimizer's ``step()`` has returned, never inside it: the post-hook
runs inside torch's ``Optimizer.step#...`` record function, and ending the profiler step
(or an ET/Kineto window) there leaves that record function open, so the Execution Trace
never writes its node and Chakra drops every optimizer op under it. So at its first step
the optimizer's ``step`` is wrapped on the instance (``optimizer.step = wrapper``, the way
torch's LR schedulers wrap it), and the wrapper calls ``prof.step()`` after the real
``step()`` returns. The script is not edited; the wrapper is removed when it ends. A call
that bypasses the instance attribute (``type(opt).step(opt)``, a bound method saved before
the first step) still ends the step from the hook, with a note in the manifest.

Every rank of a job, with the directory shared as ``tracemagic.capture`` does (this module
is the ``run`` adapter over ``tracemagic.script.ScriptCapture``, in the top layer)::

    torchrun --nproc_per_node=2 -m tracemagic run --active 3 -- train.py --epochs 1
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from tracemagic.capture.config import OPTIONS, config_from_args
from tracemagic.errors import CaptureError
from tracemagic.script import ScriptCapture

__all__ = ["build_parser", "main"]

PROG = "python -m tracemagic run"


def build_parser() -> argparse.ArgumentParser:
    """The ``run`` options: the magic's capture options, then ``-- script.py args``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run a Python script under a tracemagic capture; each optimizer step is a step.",
        epilog="Under torchrun: torchrun --nproc_per_node=2 -m tracemagic run -- train.py ARGS",
    )
    for flags, spec in OPTIONS:
        p.add_argument(*flags, **spec)
    add = p.add_argument
    add("--whole", action="store_true", help="record the whole script as one step (no optimizer-step hook)")
    add(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds rank 0 waits for the other ranks (default 300)",
    )
    add("-q", "--quiet", action="store_true", help="print nothing but problems")
    add("-m", dest="module", metavar="MODULE", help="run a module (like python -m MODULE) instead of a script")
    add("target", nargs=argparse.REMAINDER, help="-- script.py [args...]")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``[options] -- script.py [args]`` under a capture; return the exit status.

    Args:
        argv: the arguments after ``run`` (default ``sys.argv[1:]``).

    Returns:
        The script's exit status (1 when it raised, 2 for bad options).
    """
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    target = list(args.target)
    if target[:1] == ["--"]:
        target = target[1:]
    if args.module is None and not target:
        parser.error("name the script to run: ... run [options] -- script.py [args]")
    try:
        cap = ScriptCapture(
            config_from_args(args),
            timeout=args.timeout,
            whole=args.whole,
        )
    except CaptureError as exc:
        parser.error(str(exc))
    if args.module is not None:
        return _Runner(cap, args.quiet).run_module(args.module, target)
    script = Path(target[0])
    if not script.is_file():
        parser.error(f"no such script: {target[0]}")
    return _Runner(cap, args.quiet).run_script(script, target[1:])


class _Runner:
    """Runs one script under ``cap``, stepping it on optimizer steps."""

    def __init__(self, cap: ScriptCapture, quiet: bool) -> None:
        self.cap = cap
        self.quiet = quiet
        self.source: str | None = None
        self._optimizer: int | None = None
        self._handle: Any = None
        self._wrapped: Any = None  # the optimizer whose ``step`` is wrapped
        self._inside = 0  # wrapped step() calls in progress
        self._bypassed = False

    def run_script(self, script: Path, args: list[str]) -> int:
        path = str(script.resolve())
        self.source = path
        return self._run(
            lambda: runpy.run_path(path, run_name="__main__"), [str(script), *args], str(script.resolve().parent)
        )

    def run_module(self, module: str, args: list[str]) -> int:
        return self._run(
            lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), [module, *args], os.getcwd()
        )

    def _run(self, call: Any, argv: list[str], path0: str) -> int:
        saved_argv, saved_path = sys.argv[:], sys.path[:]
        sys.argv = argv
        sys.path.insert(0, path0)
        error: BaseException | None = None
        status = 0
        try:
            if self.cap.whole:
                self.cap.start(namespace={})
            else:
                self._hook()
            call()
        except SystemExit as exc:
            status = _exit_status(exc.code)
            error = exc if status else None
        except CaptureError as exc:  # the capture could not start (at the first optimizer step)
            error, status = exc, 2
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        except BaseException as exc:  # noqa: BLE001 - the script failed, any way: keep its files, print the error
            error, status = exc, 1
            if not isinstance(exc, KeyboardInterrupt):
                traceback.print_exc()
            else:
                status = 130
        finally:
            if self._handle is not None:
                self._handle.remove()
            self._unwrap()
            sys.argv, sys.path[:] = saved_argv, saved_path
        self._finish(error)
        return status

    def _hook(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._optimizer is None:
            self._optimizer = id(optimizer)
            self.cap.start(namespace=self._script_namespace(sys._getframe(1)))
            self._wrap(optimizer)
        elif id(optimizer) == self._optimizer and self.cap.running and not self._inside:
            # step() was called without the wrapper: end the step here, inside it
            if not self._bypassed:
                self._bypassed = True
                self.cap.note(
                    "the optimizer's step() was called without tracemagic's wrapper (a bound "
                    "method saved before the first step, or type(opt).step(opt)), so steps end "
                    "inside Optimizer.step: with --et the ET's last optimizer step is incomplete."
                )
            self.cap.step()

    def _wrap(self, optimizer: Any) -> None:
        """Make ``optimizer.step`` end the profiler step once the real step has returned."""
        inner = optimizer.step  # the bound method, or an LR scheduler's wrapper of it

        @functools.wraps(inner)  # keeps ``_wrapped_by_lr_sched``: no scheduler warning
        def step(*args: Any, **kwargs: Any) -> Any:
            self._inside += 1
            try:
                out = inner(*args, **kwargs)
            finally:
                self._inside -= 1
            if self.cap.running:
                self.cap.step()
            return out

        step._tracemagic_inner = inner  # type: ignore[attr-defined]
        optimizer.step = step
        self._wrapped = optimizer

    def _unwrap(self) -> None:
        optimizer: Any = self._wrapped
        self._wrapped = None
        if optimizer is None:
            return
        current = optimizer.__dict__.get("step")
        if getattr(current, "_tracemagic_inner", None) is None:
            return  # wrapped again since (an LR scheduler made later): leave it
        inner = current._tracemagic_inner
        class_step = type(optimizer).step
        bound_here = id(getattr(inner, "__self__", None)) == id(optimizer)  # `is` would narrow optimizer
        if bound_here and getattr(inner, "__func__", None) is class_step:
            del optimizer.step  # it was the class's method: back to the class attribute
        else:
            optimizer.step = inner

    def _script_namespace(self, frame: FrameType | None) -> dict[str, Any]:
        """The variables of the innermost frame of the script (to name its models)."""
        import torch

        torch_dir = os.path.dirname(torch.__file__)
        while frame is not None:
            name = frame.f_code.co_filename
            if name == self.source or (self.source is None and not name.startswith(torch_dir)):
                return {**frame.f_globals, **frame.f_locals}
            frame = frame.f_back
        return {}

    def _finish(self, error: BaseException | None) -> None:
        cap = self.cap
        if not cap.running:
            if cap.dir is None and not cap.whole:
                print(
                    f"{PROG}: the script made no optimizer step, so nothing was captured; "
                    "use --whole to record the whole script as one step.",
                    file=sys.stderr,
                )
            return
        result = cap.end(error)  # the data Capture: no pandas in the script's process
        if cap.rank == 0 or result.status != "complete":
            out = sys.stderr if result.status != "complete" else sys.stdout
            if not self.quiet or out is sys.stderr:
                print(f"{PROG}: {result.status}, {len(result.steps)} step(s) -> {result.dir}", file=out)
                for note in result.manifest.get("notes", []):
                    print(f"  note: {note}", file=out)


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
