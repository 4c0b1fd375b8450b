"""The IPython magics: a thin adapter from the magic line to capture and display.

``%%chakra_trace`` parses its options, prepares the cell (``capture.loop``), runs it in
the user namespace inside a ``CaptureSession`` and displays the resulting ``Capture``.
"""

from __future__ import annotations

import argparse
import keyword
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from tracemagic.capture.config import OPTIONS, config_from_args
from tracemagic.errors import CaptureError, TraceError
from tracemagic.trace.layout import ET_KIND

_log = logging.getLogger(__name__)

#: Where the last capture is kept in the user namespace.
LAST_CAPTURE = "_chakra_capture"
#: magic lines whose parsed options are kept (``TracemagicMagics._options``)
_PARSED_LINES = 32


def _capture_options(magic: Any) -> Any:
    """Add the capture options shared with ``tracemagic run`` (``capture.config.OPTIONS``)
    to ``magic``'s arguments, in their order."""
    for flags, spec in reversed(OPTIONS):  # decorators apply bottom-up
        magic = argument(*flags, **spec)(magic)
    return magic


@magics_class
class TracemagicMagics(Magics):
    """tracemagic's magics (``%%chakra_trace``; ``%chakra_report`` below)."""

    #: the shell they are registered on (``Magics`` allows None; ``register`` always gives one)
    shell: InteractiveShell

    def __init__(self, shell: InteractiveShell | None = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        #: ``%%chakra_trace`` lines parsed, with their config (``_options``)
        self._parsed: dict[str, tuple[argparse.Namespace, Any]] = {}

    # ==================================================================================
    # %%chakra_trace
    # ==================================================================================
    @magic_arguments(name="%chakra_trace")  # the usage line reads %%chakra_trace
    @_capture_options
    @argument(
        "--tb-names",
        action="store_true",
        help="name the Kineto traces <worker>.<ts>.pt.trace.json[.gz] like "
        "tensorboard_trace_handler (worker: <hostname>_<pid>)",
    )
    @argument(
        "--report",
        default=None,
        metavar="PATH",
        help="after the cell, write the self-contained HTML report to PATH",
    )
    @argument(
        "--pfw",
        action="store_true",
        help="after the cell, write the events as DFTracer dftracer_<rank>.pfw (.pfw.gz with --gzip) next to the trace",
    )
    @argument(
        "--stop",
        action="store_true",
        help="end the stepped loop (break) after the schedule's last recorded step (with "
        "--repeat, its last cycle; with --slow, also after --slow-max slow steps were caught): "
        "the cell's variables keep their values, the loop's else: clause does not run, the "
        "code after the loop does",
    )
    @argument(
        "--no-lines",
        action="store_true",
        help="do not mark the cell's statements with their line (tracemagic.line:N annotations "
        "that give trace.lines() and the Source tab; ~1 µs per statement run while recording)",
    )
    @argument(
        "--vs",
        default=None,
        metavar="last|DIR",
        help="compare with another capture in the Compare tab (that capture as A, this one as B) "
        "and one summary line: 'last' is the previous capture of the same --name in --out",
    )
    @argument(
        "--loop",
        type=int,
        default=None,
        metavar="LINE",
        help="step the loop at this line of the cell (the %%%%chakra_trace line is line 1)",
    )
    @argument(
        "-v",
        "--var",
        default=None,
        metavar="NAME",
        help="also store the Capture in this user variable",
    )
    @argument(
        "-o",
        "--output",
        action="store_true",
        help="return the Capture object (like %%timeit -o)",
    )
    @argument(
        "-q",
        "--quiet",
        action="store_true",
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
        the session (``chakra.step()``, ``chakra.stop()``, ``chakra.recording``,
        ``chakra.done``).

        Every iteration of the stepped loop is timed, recorded or not (wall time; on
        CUDA also the GPU time between CUDA events at its boundaries): ``cap.iterations``,
        ``loop_timing`` in ``capture.json``, and the strip atop the dashboard, where the
        recorded steps are marked. When the recorded steps are not typical of the loop
        (their median 20% or more off the steady state's and outside its 10th-90th
        percentiles, or the first iterations of a compiled model), the Overview says so.
        ``--stop`` ends the loop once the profile is done (``break``: the loop's ``else:``
        does not run; the loop variable keeps the
        value of the last iteration run). ``--slow FACTOR`` watches the iterations after
        the schedule (the first 5 of the loop are its warm-up): one slower than FACTOR ×
        the running median gets the next iteration recorded, as
        ``kineto_trace_<rank>_slow<k>.json`` (the slow one itself is over when it is
        seen, so it cannot be recorded after the fact), up to ``--slow-max`` traces
        (``cap.slow_steps``, ``cap.slow_trace(k)``). ``--vs last`` compares with the
        previous capture of the same ``--name``.

        Each statement of the cell runs under a line mark, a ``tracemagic.line:N``
        annotation (N: its line in the cell), so every op, kernel and allocation is
        attributed to the line that ran it: ``trace.lines()``, the Source tab, the advice
        naming lines and host-device syncs (``trace.syncs()``). Compound statements
        (``for``/``if``/``with``...) enclose their inner lines; statements in a ``def`` or
        ``class`` of the cell are not marked (their time is their call site's line). The
        stepped ``for`` loop's fetch of each item is marked with the loop's line (a
        DataLoader's next batch is the ``for`` line's time). The
        marks cost ~1 µs per statement run while the profiler records, a test of one
        attribute otherwise; ``--no-lines`` leaves the cell unmarked.

        Files, in ``DIR/NAME-<timestamp>/``: ``kineto_trace_<rank>.json`` (one per
        cycle with ``--repeat``; ``<hostname>_<pid>.<ts>.pt.trace.json`` with
        ``--tb-names``, as ``tensorboard_trace_handler`` names them),
        ``torch_et_<rank>.json`` with ``--et`` (one per cycle, like the Kineto trace,
        with ``--repeat``; refused while another ``ExecutionTraceObserver`` is
        registered, as torch keeps one per process), ``memory_timeline_<rank>.json``
        (allocation categories), ``kineto_trace_<rank>_slow<k>.json`` per slow step
        caught by ``--slow``, ``dftracer_<rank>.pfw`` with ``--pfw`` (DFTracer's
        format, wall-clock timestamps) and ``capture.json`` (options, cell, versions,
        device, steps, every iteration's time, files, layer names).

        With ``--et`` the pair is checked against what Chakra's ``chakra_trace_link``
        and ``chakra_converter`` accept (``tracemagic.export.chakra.check``: schema, plain
        JSON, every ET op's parent chain reaching the root and its ``rf_id`` in Kineto;
        ``tracemagic.export.chakra.commands`` prints the command lines): the result
        goes in ``capture.json`` (``chakra_check``) and one warning line is printed when
        some ET ops will get no timing. ``--report PATH`` also writes the standalone HTML
        report.

        After the cell the dashboard is displayed (in a terminal: its text summary
        under the capture's status and files) and the capture is kept in
        ``_chakra_capture`` (``%chakra_report`` with no path shows it again). If the
        cell raises (or is interrupted), the steps recorded so far are written and shown
        and the error is raised again, so "Run All" stops (an interrupt that arrives while
        a recorded window is written waits until its files are on disk; a second one cuts
        the write short). A cell that is not valid Python
        shows its ``SyntaxError`` at its line in the cell, captures nothing, and stops
        "Run All" too (a ``UsageError``, as a bad option does); so does a top-level
        ``await``, which IPython runs in a plain cell but the capture cannot.

        Example::

            %%chakra_trace --et --active 5
            for step, (x, y) in enumerate(loader):
                loss = loss_fn(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
        """
        __tracebackhide__ = True
        from tracemagic.capture.loop import SESSION_NAME
        from tracemagic.capture.session import HELD, CaptureSession

        args, config = self._options(line)
        try:
            _check_outputs(args)
            prepared = self._prepare(line, cell, config)
            if config.stop and prepared.plan.mode != "loop":
                raise CaptureError(
                    "--stop ends the stepped loop, and this cell has none"
                    + (
                        f" (it calls {config.handle}.step() itself: `if {config.handle}.done: break` "
                        "after it does the same)"
                        if prepared.plan.mode == "manual"
                        else ""
                    )
                    + "; drop --stop."
                )
            if config.stop and config.repeat == 0:
                raise CaptureError(
                    "--stop with --repeat 0 would never stop (the schedule has no last cycle); give --repeat N."
                )
            session = CaptureSession(
                config,
                prepared.plan,
                cell=cell,
                line=line,
                namespace=self.shell.user_ns,
                cells=getattr(self.shell.compile, "_filename_map", None),  # IPython's: file -> In[n]
                filter_notices=True,
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
            if getattr(exc, HELD, False):  # a Ctrl-C raised by the session at a step: at the cell's line
                _end_traceback_in(exc, prepared.body.co_filename)
            capture = self._keep(session.finish(error=exc), args)
            try:
                self._after(capture, args)
                self._publish(capture, args)
            except BaseException as problem:  # noqa: BLE001 - never hide the cell's own error
                _log.debug("showing the capture failed", exc_info=True)
                print(
                    f"chakra_trace: could not show the capture ({type(problem).__name__}: {problem})", file=sys.stderr
                )
            raise
        finally:
            for name in exposed:
                ns.pop(name, None)
            ns.update(saved)
        capture = self._keep(session.finish(), args)
        if args.vs and not session.interrupted:  # (stopped by Ctrl-C: shown, not compared)
            self._compare(capture, args.vs, config)
        self._after(capture, args)
        self._publish(capture, args)
        if session.interrupted:  # Ctrl-C while the files were written: they are, now it stops
            raise KeyboardInterrupt
        if args.output:
            if value is not None:
                display(value)
            return capture
        return value

    def _prepare(self, line: str, cell: str, config: Any) -> Any:
        """The cell compiled and instrumented (``prepare_cell``). A cell that is not valid
        Python shows its ``SyntaxError`` as IPython shows one in a plain cell (at the line
        in the cell, without tracemagic's frames) and stops here: nothing is captured, and
        the ``UsageError`` fails the cell so that "Run All" stops.

        Raises:
            UsageError: the cell has a syntax error (shown above it).
            CaptureError: ``--loop`` names no loop, or conflicts with the cell.
        """
        from tracemagic.capture.loop import prepare_cell

        try:
            return prepare_cell(
                self.shell,
                line,
                cell,
                loop_line=config.loop_line,
                handle=config.handle,
                stop=config.stop,
                lines=config.lines,
            )
        except SyntaxError as exc:
            self.shell.showsyntaxerror()  # (it reads the error from sys.exc_info(): here)
            if "await" in str(exc.msg):  # valid in a plain cell (IPython's autoawait), not here
                raise UsageError(
                    "%%chakra_trace: a top-level `await` cannot run inside the capture (the error above); "
                    "nothing was captured. Run the awaited part in a cell of its own, or drive it with "
                    "asyncio.run(...) inside a function."
                ) from None
            raise UsageError(
                "%%chakra_trace: the cell is not valid Python (the error above); nothing was captured."
            ) from None

    def _options(self, line: str) -> tuple[argparse.Namespace, Any]:
        """The parsed magic line and its ``CaptureConfig``, kept per line (a cell run again
        parses nothing): a bad line raises ``UsageError`` and is not kept."""
        cache = self._parsed
        kept = cache.get(line)
        if kept is None:
            args = _parse_line(self.chakra_trace, line, "%%chakra_trace")
            try:
                config = config_from_args(
                    args, loop_line=args.loop, tb_names=args.tb_names, stop=args.stop, lines=not args.no_lines
                )
            except CaptureError as exc:
                raise UsageError(f"%%chakra_trace: {exc}") from None
            if len(cache) >= _PARSED_LINES:
                cache.pop(next(iter(cache)))
            kept = cache[line] = (args, config)
        args, config = kept
        return argparse.Namespace(**vars(args)), config

    def _after(self, capture: Any, args: Any) -> None:
        """The outputs asked for besides the trace: Chakra check, ``.pfw``, HTML report.

        Each one that fails says so in one line on stderr; the capture is kept either way.
        """
        say = (lambda _msg: None) if args.quiet else (lambda msg: print(f"chakra_trace: {msg}"))
        if args.et and any(e.get("kind") == ET_KIND for e in capture.manifest.get("files", [])):
            try:
                report = capture.chakra_check()
            except Exception as exc:  # noqa: BLE001 - a check must not lose the capture
                _log.debug("the Chakra check failed", exc_info=True)
                _warn(f"the Chakra check failed ({type(exc).__name__}: {exc})")
            else:
                if report.timed_share < 1 or not report.ok:
                    untimed = ", ".join(
                        f"{p.label}: {p.et_ops - p.timed_ops} of {p.et_ops}"
                        for p in report.pairs
                        if p.timed_ops < p.et_ops
                    )
                    problems = report.all_problems
                    _warn(
                        f"Chakra: only {report.timed_share:.1%} of the ET ops will get timing"
                        + (f" ({untimed} untimed)" if untimed else "")
                        + (f"; {problems[0]}" if problems else "")
                        + "; see capture.json 'chakra_check'"
                    )
        wanted = [flag for flag, on in (("--pfw", args.pfw), ("--report", args.report)) if on]
        if wanted and not capture.has_trace:
            _warn(f"no trace was written, so {' and '.join(wanted)} wrote nothing")
            return
        if args.pfw:
            _write_or_warn("--pfw", capture.to_pfw, say)
        if args.report:
            _write_or_warn(f"--report {args.report}", lambda: capture.report(Path(args.report).expanduser()), say)

    def _compare(self, capture: Any, vs: str, config: Any) -> None:
        """``--vs last|DIR``: the capture to compare with, set on ``capture`` (one line on
        stderr when there is none: the capture itself is kept and shown)."""
        from tracemagic.capture.result import CaptureResult, previous_capture

        if vs == "last":
            other = previous_capture(config.out, config.name, exclude=capture.dir)
            if other is None:
                _warn(
                    f"--vs last: no earlier capture named {config.name!r} with a trace in "
                    f"{config.out}; nothing to compare with yet (run the cell again)."
                )
                return
        else:
            try:
                other = CaptureResult.from_dir(Path(vs).expanduser())
            except TraceError as exc:
                _warn(f"--vs {vs}: {exc}")
                return
            if not other.has_trace:
                _warn(f"--vs {vs}: that capture ({other.status}) wrote no trace; nothing to compare with.")
                return
        capture.compare_with(other)

    def _keep(self, capture: Any, args: Any) -> Any:
        """Keep the capture in the user namespace (first: whatever happens next), as the
        ``tracemagic.facade.Capture`` users get (with its dashboard and outputs)."""
        from tracemagic.facade import Capture

        capture = Capture.of(capture)
        self.shell.user_ns[LAST_CAPTURE] = capture
        if args.var:
            self.shell.user_ns[args.var] = capture
        return capture

    def _publish(self, capture: Any, args: Any) -> Any:
        """Show the capture (or only its problems)."""
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
    @magic_arguments()
    @argument(
        "path",
        nargs="?",
        default=None,
        metavar="PATH",
        help="a Kineto trace (.json, .json.gz), a capture directory, a directory of rank "
        "traces or a .tar[.gz] of them, or the name of a variable holding a Capture, a "
        "Trace or a path (default: the last capture, _chakra_capture)",
    )
    @argument("--vs", default=None, metavar="B", help="compare with trace B (same forms as PATH): adds the Compare tab")
    @argument("--step", type=int, default=None, metavar="N", help="select ProfilerStep#N at first (default: all steps)")
    @argument("--top", type=int, default=15, metavar="N", help="bars in the top-N charts (default 15)")
    @argument("--unit", default="ms", choices=("ms", "us", "µs"), help="time unit: ms (default) or us")
    @argument("--report", default=None, metavar="OUT.html", help="also write the standalone HTML report to OUT.html")
    @argument(
        "-o",
        "--output",
        action="store_true",
        help="return the Dashboard instead of displaying it (it displays as the cell's result)",
    )
    @no_var_expand
    @line_magic
    def chakra_report(self, line: str) -> Any:
        """Show the dashboard of any trace: a file, a capture directory, a tar of ranks.

        ``%chakra_report`` alone shows the last ``%%chakra_trace`` capture again;
        ``%chakra_report A --vs B`` adds the Compare tab (A against B). Paths are taken
        literally (no ``$var``/``{expr}`` expansion); to use a Python variable, give its
        name: ``%chakra_report cap`` with ``cap`` a ``Capture``, ``Trace`` or path.
        Unreadable traces raise ``UsageError`` with the reason (no traceback).

        Example::

            %chakra_report traces/capture-20260101-120000 --vs baseline.json.gz --unit us
        """
        from tracemagic.views import Dashboard

        args = _parse_line(self.chakra_report, line, "%chakra_report")
        if args.top < 1:
            raise UsageError(f"%chakra_report: --top must be at least 1, got {args.top}.")
        trace, title = self._report_source(args.path, "PATH")
        other = None
        if args.vs is not None:
            other, other_title = self._report_source(args.vs, "--vs")
            title = f"{title} vs {other_title}"
        unit = "µs" if args.unit == "us" else args.unit
        dashboard = Dashboard(trace, title=title, other=other, step=args.step, top=args.top, unit=unit)
        if args.step is not None and args.step not in dashboard.data.step_ids:
            steps = ", ".join(str(s) for s in dashboard.data.step_ids) or "none"
            raise UsageError(f"%chakra_report: --step {args.step} is not in {title} (its steps: {steps}).")
        if args.report:
            try:
                written = dashboard.save_report(Path(args.report).expanduser())
            except OSError as exc:
                raise UsageError(f"%chakra_report: cannot write --report {args.report!r}: {exc}") from None
            print(f"chakra_report: wrote {written}")
        if args.output:
            return dashboard
        display(dashboard)
        return None

    def _report_source(self, spec: str | None, option: str) -> tuple[Any, str]:
        """``(trace, title)`` for a PATH/--vs value; bad input -> ``UsageError``."""
        from tracemagic.capture.result import CaptureResult
        from tracemagic.facade import Trace, load
        from tracemagic.trace.model import TraceTables

        ns = self.shell.user_ns
        value: Any = spec
        if spec is None:
            value = ns.get(LAST_CAPTURE)
            if value is None:
                raise UsageError(
                    "%chakra_report: no PATH given and no capture yet. Run a %%chakra_trace "
                    "cell first, or pass a trace file, a capture directory or a tar."
                )
        elif not Path(spec).expanduser().exists() and spec.isidentifier() and spec in ns:
            value = ns[spec]
        try:
            if isinstance(value, CaptureResult):
                return Trace.of(value.trace), value.title
            if isinstance(value, TraceTables):
                return Trace.of(value), Path(str(value.path)).name if value.path else "trace"
            if isinstance(value, (str, os.PathLike)):
                path = Path(value).expanduser()
                return load(path), path.name
        except TraceError as exc:
            raise UsageError(f"%chakra_report: {exc}") from None
        except OSError as exc:
            raise UsageError(f"%chakra_report: cannot read {value}: {exc}") from None
        raise UsageError(
            f"%chakra_report: {option} {spec!r} is a {type(value).__name__}; pass a path, or "
            "a variable holding a Capture, a Trace or a path."
        )


def _parse_line(magic: Callable[..., Any], line: str, name: str) -> argparse.Namespace:
    """``parse_argstring``; a line it cannot split into words (an unterminated quote: shlex's
    ``ValueError``) a ``UsageError`` that says so, as argparse's own errors are.

    Raises:
        UsageError: the line cannot be split, or its options are wrong.
    """
    try:
        return parse_argstring(magic, line)
    except ValueError as exc:
        raise UsageError(
            f"{name}: cannot read the options {line.strip()!r}: a quote is not closed ({exc}). Close it, or remove it."
        ) from None


def _end_traceback_in(error: BaseException, filename: str) -> None:
    """Cut ``error``'s traceback at its first tracemagic frame below the cell's code
    (``filename``): from there the frames are the capture's, where a held Ctrl-C was raised,
    not the user's (their own functions the cell called on the way are kept)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tb, above, in_cell = error.__traceback__, None, False
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if in_cell and above is not None and os.path.abspath(name).startswith(package):
            above.tb_next = None
            return
        in_cell = in_cell or name == filename
        above, tb = tb, tb.tb_next


def _check_outputs(args: Any) -> None:
    """Check ``-v``/``--report``/``--pfw`` before the cell runs (CaptureError naming the option)."""
    if args.var is not None and (not args.var.isidentifier() or keyword.iskeyword(args.var)):
        raise CaptureError(f"-v {args.var!r} is not a Python variable name.")
    if args.report:
        target = Path(args.report).expanduser()
        if target.is_dir():
            raise CaptureError(f"--report {args.report!r} is a directory; name the .html file to write.")
        parent = next((p for p in target.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise CaptureError(f"--report {args.report!r}: {parent} is not a writable directory.")
    if args.pfw:
        try:
            from tracemagic.export.dftracer import to_pfw  # noqa: F401 - checked before the cell runs
        except ImportError as exc:
            raise CaptureError(f"--pfw needs tracemagic.export.dftracer.to_pfw ({exc}).") from None


def _write_or_warn(option: str, write: Callable[[], object], say: Callable[[str], None]) -> None:
    """Write one optional output after the capture (``--pfw``, ``--report``): say where, or
    warn that ``option`` failed; the capture itself stands either way."""
    try:
        say(f"wrote {write()}")
    except Exception as exc:  # noqa: BLE001 - an optional output failed: warned, the capture stands
        _log.debug("%s failed", option, exc_info=True)
        _warn(f"{option} failed ({type(exc).__name__}: {exc})")


def _warn(message: str) -> None:
    """One line on stderr (shown even with -q: these are problems)."""
    print(f"chakra_trace: {message}", file=sys.stderr)


def register(ipython: Any) -> None:
    """Register tracemagic's magics on ``ipython``; a second call does nothing."""
    if "TracemagicMagics" in ipython.magics_manager.registry:
        return
    ipython.register_magics(TracemagicMagics)
