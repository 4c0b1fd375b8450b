"""``python -m tracemagic``: the command line (see ``tracemagic.cli``)."""

import sys

from tracemagic.cli import main

if __name__ == "__main__":
    sys.exit(main())
