"""``python -m tracemagic``: the same command line as ``tracemagic``."""

from tracemagic.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
