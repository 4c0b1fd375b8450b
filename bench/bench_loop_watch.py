"""What does watching every iteration cost? The loop without the magic vs under it.

``%%chakra_trace`` times every iteration of the stepped loop (``perf_counter_ns`` and a list
append in ``step()``, plus the rewritten loop's ``try``/``finally``), and ``--slow`` adds a
running median. This measures both per iteration, past the schedule (the profiler recorded
iteration 0 only: ``--wait 0 --warmup 0 --active 1``), against the same cell run plainly,
all as IPython cells, runs interleaved (plain, timed, watched, plain, ...) so drift hits
each alike:

- an empty body (``x += 1``): the per-iteration overhead in ns, and the goal's figure,
  that overhead as a share of a 1 ms step (goal: under 1%);
- a 1 ms busy body: the ratio of the loops' times directly (the goal itself, noisier).

``--slow 1000`` never catches anything, so the watch's judging is measured, not a trace.

    .venv/bin/python bench/bench_loop_watch.py [--reps 5] [--n 100000]

Measured (2026-11-26, CPU, a shared 2-core machine, 5 runs): empty body 269 ns/iteration
plain, +2.0 µs timed (0.20% of a 1 ms step), +3.4 µs with the --slow watch (0.34%); the
1 ms body's ratios 0.998x and 1.004x (within the noise).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

from IPython.core.interactiveshell import InteractiveShell

#: the iterations timed start here (past the schedule and the --slow warm-up)
SKIP = 50

CELL = """\
x = 0
for i in range({n}):
    {body}
    if i == {skip}:
        _t0 = time.perf_counter_ns()
_t1 = time.perf_counter_ns()
_bench = (_t1 - _t0) / ({n} - 1 - {skip})
"""
EMPTY = "x += 1"
BUSY = "_end = time.perf_counter_ns() + 1_000_000\n    while time.perf_counter_ns() < _end: pass"

MAGIC = "%%chakra_trace -q --no-stack --no-shapes --no-memory --no-memory-timeline --wait 0 --warmup 0 --active 1"
VARIANTS = {
    "plain": "",
    "timed": MAGIC,
    "watched (--slow)": MAGIC + " --slow 1000",
}


def per_iteration_ns(ip: Any, head: str, body: str, n: int, out: str) -> float:
    """One run of the cell under ``head`` (a magic line or nothing): ns per iteration."""
    line = f"{head} --out {out}\n" if head else ""
    result = ip.run_cell(line + CELL.format(n=n, body=body, skip=SKIP))
    result.raise_error()
    return float(ip.user_ns["_bench"])


def measure(ip: Any, body: str, n: int, reps: int, out: str) -> dict[str, float]:
    """Median ns per iteration of each variant, runs interleaved."""
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(reps):
        for name, head in VARIANTS.items():
            runs[name].append(per_iteration_ns(ip, head, body, n, out))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n", type=int, default=100_000, help="iterations of the empty loop")
    parser.add_argument("--busy-n", type=int, default=300, help="iterations of the 1 ms loop")
    args = parser.parse_args()
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "tracemagic")
    ip.run_cell("import time")
    with tempfile.TemporaryDirectory() as out:
        empty = measure(ip, EMPTY, args.n, args.reps, out)
        busy = measure(ip, BUSY, args.busy_n, args.reps, out)
    base = empty["plain"]
    print(f"empty body, {args.n:,} iterations, median of {args.reps} interleaved runs:")
    for name, ns in empty.items():
        extra = ns - base
        share = f", overhead {extra:,.0f} ns = {extra / 1e6:.3%} of a 1 ms step" if name != "plain" else ""
        print(f"  {name:18} {ns:8,.0f} ns/iteration  ratio {ns / base:5.2f}x{share}")
    print(f"1 ms busy body, {args.busy_n} iterations:")
    for name, ns in busy.items():
        print(f"  {name:18} {ns / 1e6:8.4f} ms/iteration  ratio {ns / busy['plain']:.4f}x")


if __name__ == "__main__":
    main()
