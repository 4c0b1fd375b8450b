"""The ``tracemagic`` command line: ``report``, ``summary``, ``diff``, ``stacks``, ``demo``, ``run`` and ``cache``.

Bad input (a missing file, a damaged trace) prints one line on stderr and exits with
status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracemagic._version import __version__
from tracemagic.errors import TracemagicError

#: exit status for bad input
EXIT_USAGE = 2
#: loads of this many bytes or more show progress on stderr
LARGE_BYTES = 20 * 2**20


def _size(path: Path) -> int:
    try:
        if path.is_dir():  # hidden files (a capture's own cache) are not read
            return sum(
                p.stat().st_size
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        return path.stat().st_size
    except OSError:
        return 0


def _load(path: str, args: argparse.Namespace) -> Any:
    """``tracemagic.load`` of ``path``; a missing path is a clear error.

    A load of ``LARGE_BYTES`` or more shows progress on stderr (unless ``--quiet``): the
    loader's own bar on a terminal, else a line when it starts and one when it ends.
    """
    from tracemagic.facade import load

    target = Path(path).expanduser()
    if not target.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    size = _size(target)
    large = not args.quiet and size >= LARGE_BYTES
    tty = sys.stderr.isatty()
    if large and not tty:
        print(f"loading {target} ({size / 2**20:,.0f} MiB)…", file=sys.stderr, flush=True)
    started = time.monotonic()
    trace = load(target, progress=large and tty, recover=args.recover, use_cache=not args.no_cache)
    if large and not tty:
        print(f"loaded {target.name} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return trace


def _width(args: argparse.Namespace) -> int:
    return args.width or shutil.get_terminal_size((100, 24)).columns


def cmd_report(args: argparse.Namespace) -> int:
    from tracemagic.views.report import write_report

    trace = _load(args.path, args)
    other = _load(args.vs, args) if args.vs else None
    out = Path(args.output) if args.output else Path(f"{Path(args.path).name.split('.')[0] or 'trace'}.report.html")
    written = write_report(trace, out, other=other)
    print(f"wrote {written} ({written.stat().st_size / 2**20:.1f} MiB)")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from tracemagic.views.text import summary

    print(summary(_load(args.path, args), width=_width(args), top=args.top))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from tracemagic.views.text import diff_summary

    a, b = _load(args.a, args), _load(args.b, args)
    print(diff_summary(a, b, width=_width(args), top=args.top))
    if args.output:
        from tracemagic.views.report import write_report

        written = write_report(a, args.output, other=b)
        print(f"wrote {written}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tracemagic.demo import run

    run(Path(args.out_dir), args.notebook)
    return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from tracemagic.export.stacks import to_folded, to_speedscope

    trace = _load(args.path, args)
    if args.gpu and not trace.has_gpu:
        raise UsageError(f"{args.path}: the trace has no GPU activity (kernels, memcpy, memset); leave out --gpu")
    speedscope = args.speedscope
    stem = Path(args.path).name.split(".")[0] or "trace"
    out = (
        Path(args.output)
        if args.output
        else Path(f"{stem}{'.gpu' if args.gpu else ''}.{'speedscope.json' if speedscope else 'folded'}")
    )
    write = to_speedscope if speedscope else to_folded
    (written,) = write(trace, out, gpu=args.gpu, user_only=args.user_only)
    print(f"wrote {written} ({written.stat().st_size / 2**10:,.1f} KiB)")
    return 0


class UsageError(TracemagicError):
    """A command's arguments do not fit the trace."""


def _human(n: int) -> str:
    """A size in KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def cmd_cache(args: argparse.Namespace) -> int:
    from tracemagic.trace import cache

    folder = Path(args.cache_dir).expanduser() if args.cache_dir else cache.user_cache_dir()
    if args.action == "clear":
        count, freed = cache.clear(folder)
        print(f"removed {count} cached trace{'s' * (count != 1)} ({_human(freed)}) from {folder}")
        return 0
    found = cache.entries(folder)
    total = sum(e.bytes for e in found)
    print(f"cache folder: {folder}")
    print(
        f"{len(found)} cached trace{'s' * (len(found) != 1)}, {_human(total)} of {_human(cache.max_bytes())} "
        "(TRACEMAGIC_CACHE_SIZE; the least recently used go first)"
    )
    for cached in reversed(found):  # most recently used first
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(cached.last_used))
        print(f"  {_human(cached.bytes):>12}  {used}  {cached.trace or '(unfinished or damaged entry)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tracemagic``."""
    parser = argparse.ArgumentParser(
        prog="tracemagic",
        description="Summaries, HTML reports and diffs of PyTorch profiler (Kineto) traces; capture of scripts.",
    )
    parser.add_argument("--version", action="version", version=f"tracemagic {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
        p.add_argument("--recover", action="store_true", help="keep what a truncated or damaged trace holds")
        p.add_argument("--no-cache", action="store_true", help="do not read or write the trace cache")

    p = sub.add_parser("report", help="write the standalone HTML report of a trace")
    p.add_argument("path", help="a trace file (.json, .json.gz, .tar.gz) or a capture/rank directory")
    p.add_argument("-o", "--output", help="the .html file to write (default: <trace name>.report.html)")
    p.add_argument("--vs", metavar="OTHER", help="a second trace to compare with (adds the Compare tab)")
    common(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("summary", help="print a text summary: steps, top layers, top ops, peak memory")
    p.add_argument("path", help="a trace file or directory")
    p.add_argument("--width", type=int, default=None, help="line width (default: the terminal's)")
    p.add_argument("--top", type=int, default=10, help="rows in the top-N tables (default 10)")
    common(p)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("diff", help="compare two traces (A is the baseline)")
    p.add_argument("a", help="the baseline trace")
    p.add_argument("b", help="the trace compared with it")
    p.add_argument("--width", type=int, default=None, help="line width (default: the terminal's)")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("-o", "--output", help="also write an HTML report with the Compare tab")
    common(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser(
        "stacks",
        help="write the call tree (Python frames, ops, kernels) as folded stacks or a speedscope file",
        description="Folded stacks (one 'frame;frame;... value' line per stack, the value the stack's self "
        "time in integer ns: CPU, or GPU with --gpu) for flamegraph.pl, inferno or speedscope; or a speedscope "
        "JSON file (profiles of CPU self time and GPU time, in µs) for https://www.speedscope.app.",
    )
    p.add_argument("path", help="a trace file or directory")
    form = p.add_mutually_exclusive_group(required=True)
    form.add_argument("--folded", action="store_true", help="folded stacks (default name: <trace>.folded)")
    form.add_argument(
        "--speedscope", action="store_true", help="speedscope JSON (default name: <trace>.speedscope.json)"
    )
    p.add_argument("-o", "--output", help="the file to write")
    p.add_argument(
        "--gpu", action="store_true", help="GPU time of the kernels by launching stack instead of CPU self time"
    )
    p.add_argument(
        "--user-only", action="store_true", help="leave out library frames (torch, the standard library, built-ins)"
    )
    common(p)
    p.set_defaults(func=cmd_stacks)

    p = sub.add_parser("demo", help="run the quickstart notebook headless: capture a small model, print its summary")
    p.add_argument("out_dir", nargs="?", default="demo-output", help="where to write (default ./demo-output)")
    p.add_argument(
        "--notebook", type=Path, default=None, help="run this notebook instead of notebooks/quickstart.ipynb"
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "cache",
        help="show (info) or empty (clear) the user cache of parsed traces",
        description="The cache of traces tracemagic did not write lives in the user cache folder "
        "($TRACEMAGIC_CACHE_DIR, else $XDG_CACHE_HOME/tracemagic, ~/.cache/tracemagic), capped by "
        "$TRACEMAGIC_CACHE_SIZE (default 4G; the least recently used traces go first). A capture "
        "directory tracemagic wrote keeps its cache inside itself (.tracemagic-cache/), untouched here.",
    )
    p.add_argument("action", choices=["info", "clear"], help="info: list the cached traces; clear: remove them")
    p.add_argument("--cache-dir", help="another cache folder (as load(cache_dir=...))")
    p.set_defaults(func=cmd_cache)

    # listed for --help only: main() hands `run ...` to tracemagic.run before parsing
    sub.add_parser("run", help="capture a script: tracemagic run [options] -- script.py [args] (see run --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # its own parser: everything after `--` belongs to the script
        from tracemagic.run import main as run_main

        return run_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `tracemagic summary x | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (TracemagicError, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"tracemagic: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a bug: one line unless TRACEMAGIC_DEBUG asks for the traceback
        if os.environ.get("TRACEMAGIC_DEBUG"):
            raise
        print(
            f"tracemagic: internal error: {type(exc).__name__}: {exc} (set TRACEMAGIC_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("tracemagic: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
