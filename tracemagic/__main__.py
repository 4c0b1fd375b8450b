"""``python -m tracemagic``: ``run`` captures a script (``capture.run``); the rest is the CLI."""

from __future__ import annotations

import sys


def _main(argv: list[str]) -> int:
    if argv[:1] == ["run"]:
        from tracemagic.capture.run import main

        return main(argv[1:])
    try:
        from tracemagic.cli import main as cli_main
    except ImportError:
        print("usage: python -m tracemagic run [options] -- script.py [args]", file=sys.stderr)
        return 2
    return int(cli_main(argv) or 0)


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
