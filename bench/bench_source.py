"""Issue 26's speed goal for ``trace.source()``: its time on the ~100 MB CPU trace of
``bench/make_traces.py`` relative to ``ops()`` in the same run (goal: <= 1.5x).

Round by round, each table in a fresh process after a load from the Arrow cache (made
once before the rounds), timed alone so it pays for every intermediate result it needs
(``benchlib.worker``, kind ``cached``); the order of the two turns each round. The figure
is the ratio of the medians, with a pass / falls short verdict.

Usage: ``.venv/bin/python bench/bench_source.py [--rounds 3] [--size 100]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_trace, fmt_s, fmt_x, machine, median, run_worker  # noqa: E402

#: source() / ops() on the ~100 MB trace, at most
GOAL = 1.5
TABLES = ("ops", "source")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=100, help="the trace of bench/make_traces.py, in MB (default 100)")
    args = parser.parse_args(argv)
    path = cpu_trace(args.size)
    print(f"{path.name} ({path.stat().st_size / 2**20:,.0f} MiB); {machine()}")
    times: dict[str, list[float]] = {t: [] for t in TABLES}
    with tempfile.TemporaryDirectory(prefix="tm-bench-source-") as cache:
        if run_worker({"kind": "fresh", "path": str(path), "cache_dir": cache, "tables": []}) is None:
            return 1
        for r in range(args.rounds):
            order = TABLES if r % 2 == 0 else TABLES[::-1]
            for name in order:
                result = run_worker({"kind": "cached", "path": str(path), "cache_dir": cache, "tables": [name]})
                seconds = (result or {}).get("tables", {}).get(name)
                if seconds is None:
                    print(f"  round {r + 1}: {name}() failed", file=sys.stderr)
                    continue
                times[name].append(seconds)
            print(f"  round {r + 1}: " + ", ".join(f"{t}() {fmt_s(times[t][-1])} s" for t in TABLES if times[t]))
    ops, source = median(times["ops"]), median(times["source"])
    ratio = source / ops if ops == ops and ops > 0 else float("nan")
    verdict = "pass" if ratio <= GOAL else "falls short"
    print(f"median of {args.rounds} rounds: ops() {fmt_s(ops)} s, source() {fmt_s(source)} s")
    print(f"source() / ops(): {fmt_x(ratio)} (goal <= {GOAL}x): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
