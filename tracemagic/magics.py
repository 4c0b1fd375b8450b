"""The IPython magics: a thin adapter from the magic line to capture and display.

``%%chakra_trace`` parses its options, prepares the cell (``capture.loop``), runs it in
the user namespace inside a ``CaptureSession`` and displays the resulting ``Capture``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from tracemagic.capture.config import CaptureConfig
from tracemagic.errors import CaptureError

#: Where the last capture is kept in the user namespace.
LAST_CAPTURE = "_chakra_capture"


@magics_class
class TracemagicMagics(Magics):
    """tracemagic's magics (``%%chakra_trace``; ``%chakra_report`` below)."""

    # ==================================================================================
    # %%chakra_trace
    # ==================================================================================
    @magic_arguments()
    @argument(
        "--wait", type=int, default=1, metavar="N",
        help="schedule: steps skipped per cycle before warmup (default 1)",
    )
    @argument(
        "--warmup", type=int, default=1, metavar="N",
        help="schedule: warmup steps, traced but discarded (default 1)",
    )
    @argument(
        "--active", type=int, default=3, metavar="N",
        help="schedule: steps recorded per cycle, at least 1 (default 3)",
    )
    @argument(
        "--repeat", type=int, default=1, metavar="N",
        help="schedule: cycles to record, 0 = until the loop ends; one trace per cycle (default 1)",
    )
    @argument(
        "--skip-first", type=int, default=0, metavar="N",
        help="schedule: steps skipped once, before the first cycle (default 0)",
    )
    @argument(
        "--skip-first-wait", type=int, default=0, metavar="N",
        help="schedule: if not 0, the first cycle skips its wait steps (default 0)",
    )
    @argument(
        "--cpu-only", action="store_true",
        help="record CPU activity only, even when CUDA is available",
    )
    @argument(
        "--no-shapes", action="store_true",
        help="do not record input shapes (record_shapes=False)",
    )
    @argument(
        "--no-memory", action="store_true",
        help="do not record allocations (profile_memory=False)",
    )
    @argument(
        "--no-stack", action="store_true",
        help="no Python stacks (with_stack=False): no nn.Module events, no layer names",
    )
    @argument(
        "--with-flops", action="store_true",
        help="estimate FLOPs of matmul/conv ops (with_flops=True)",
    )
    @argument(
        "--no-memory-timeline", action="store_true",
        help="skip memory_timeline_<rank>.json (allocation categories)",
    )
    @argument(
        "--et", action="store_true",
        help="also write the Execution Trace torch_et_<rank>.json over the same steps (for Chakra)",
    )
    @argument(
        "--out", default="traces", metavar="DIR",
        help="directory the capture directory is created in (default ./traces)",
    )
    @argument(
        "--name", default="capture", metavar="NAME",
        help="capture directory name: DIR/NAME-<timestamp> (default capture)",
    )
    @argument(
        "--gzip", action="store_true",
        help="write kineto_trace_<rank>.json.gz (the ET stays plain JSON)",
    )
    @argument(
        "--loop", type=int, default=None, metavar="LINE",
        help="step the loop at this line of the cell (the %%%%chakra_trace line is line 1)",
    )
    @argument(
        "-v", "--var", default=None, metavar="NAME",
        help="also store the Capture in this user variable",
    )
    @argument(
        "-o", "--output", action="store_true",
        help="return the Capture object (like %%timeit -o)",
    )
    @argument(
        "-q", "--quiet", action="store_true",
        help="print nothing but problems (a short or failed capture)",
    )
    @cell_magic
    def chakra_trace(self, line: str, cell: str) -> Any:
        """Profile this cell's step loop with torch.profiler and write the trace files.

        The cell runs in your namespace as usual (``%magics`` and ``!cmd`` lines work).
        Its step loop is found and stepped for you: the first ``for``/``while`` that runs
        at top level (also inside ``with``/``if``/``try``), and the inner loop when the
        body of that loop holds exactly one loop (epochs around batches). ``step()``
        runs at the end of every iteration, also on ``continue``. ``--loop LINE`` picks
        another loop; a cell that calls ``chakra.step()`` itself is run unchanged; a
        cell without a loop is captured as one step. While the cell runs, ``chakra`` is
        the session (``chakra.step()``, ``chakra.stop()``, ``chakra.recording``).

        Files, in ``DIR/NAME-<timestamp>/``: ``kineto_trace_<rank>.json`` (one per
        cycle with ``--repeat``), ``torch_et_<rank>.json`` with ``--et``,
        ``memory_timeline_<rank>.json`` (allocation categories) and ``capture.json``
        (options, cell, versions, device, steps, files, layer names).

        After the cell a summary is displayed and the capture is kept in
        ``_chakra_capture``. If the cell raises (or is interrupted), the steps recorded
        so far are written and the error is raised again, so "Run All" stops.

        Example::

            %%chakra_trace --et --active 5
            for step, (x, y) in enumerate(loader):
                loss = loss_fn(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
        """
        __tracebackhide__ = True
        from tracemagic.capture.loop import SESSION_NAME, prepare_cell
        from tracemagic.capture.session import CaptureSession

        args = parse_argstring(self.chakra_trace, line)
        try:
            config = _config(args)
            prepared = prepare_cell(
                self.shell, line, cell, loop_line=config.loop_line, handle=config.handle
            )
            session = CaptureSession(
                config, prepared.plan, cell=cell, line=line, namespace=self.shell.user_ns
            )
            session.open()
        except CaptureError as exc:
            raise UsageError(f"%%chakra_trace: {exc}") from None
        if not args.quiet:
            print(f"chakra_trace: {prepared.plan.describe(config.handle)}")

        ns = self.shell.user_ns
        exposed = {SESSION_NAME: session, config.handle: session}
        saved = {name: ns[name] for name in exposed if name in ns}
        ns.update(exposed)
        try:
            if not prepared.plan.brackets_loop:
                session.start()
            exec(prepared.body, self.shell.user_global_ns, ns)
            value = None
            if prepared.last_expr is not None:
                value = eval(prepared.last_expr, self.shell.user_global_ns, ns)
        except BaseException as exc:
            self._publish(session.finish(error=exc), args)
            raise
        finally:
            for name in exposed:
                ns.pop(name, None)
            ns.update(saved)
        capture = self._publish(session.finish(), args)
        if args.output:
            if value is not None:
                display(value)
            return capture
        return value

    def _publish(self, capture: Any, args: Any) -> Any:
        """Keep the capture in the user namespace and show it (or only its problems)."""
        self.shell.user_ns[LAST_CAPTURE] = capture
        if args.var:
            self.shell.user_ns[args.var] = capture
        if args.quiet or args.output:
            if capture.status != "complete":
                for note in capture.manifest.get("notes", []):
                    print(f"chakra_trace: {note}", file=sys.stderr)
            if args.quiet:
                return capture
        if not args.output:
            display(capture)
        return capture

    # ==================================================================================
    # %chakra_report  (the views' line magic goes here; %%chakra_trace ends above)
    # ==================================================================================


def _config(args: Any) -> CaptureConfig:
    """Options parsed by magic_arguments -> validated ``CaptureConfig``."""
    return CaptureConfig(
        wait=args.wait,
        warmup=args.warmup,
        active=args.active,
        repeat=args.repeat,
        skip_first=args.skip_first,
        skip_first_wait=args.skip_first_wait,
        cpu_only=args.cpu_only,
        record_shapes=not args.no_shapes,
        profile_memory=not args.no_memory,
        with_stack=not args.no_stack,
        with_flops=args.with_flops,
        memory_timeline=not args.no_memory_timeline,
        et=args.et,
        out=Path(args.out).expanduser(),
        name=args.name,
        gzip=args.gzip,
        loop_line=args.loop,
    )


def register(ipython: Any) -> None:
    """Register tracemagic's magics on ``ipython``; a second call does nothing."""
    if "TracemagicMagics" in ipython.magics_manager.registry:
        return
    ipython.register_magics(TracemagicMagics)
