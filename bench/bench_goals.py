"""Issue 23's goals, each as a ratio measured in this run, with a pass / falls short verdict.

On the ~100 MB CPU trace of ``bench/make_traces.py`` and the GPU trace
``tests/data/traces/hta_control.json.gz``, round by round, each measurement in a fresh
process (see ``benchlib.worker``), in an order that turns each round:

- ``orjson.loads`` of the CPU trace's bytes (read beforehand, not timed): the baseline;
- ``tracemagic.load`` fresh + the 6 tables (ops, kernels, layers, memory, shapes, steps),
  then the other tables (memory_peaks, efficiency, advice, ranks, diff(self)) for the peak
  RSS of a load and every table;
- the same load + 6 tables with the cache on (``load``'s default) into an empty cache: a
  trace's first load, which also leaves its cache entry to be written (at the process's
  end: ``trace.cache.PendingEntry``), printed as its own line, same goal;
- the same 6 tables after reopening from the Arrow cache, which holds them from an earlier
  process (``trace.cache.TableStore``: a trace reopened after it was looked at); and the
  same with ``$TRACEMAGIC_TABLE_CACHE=0``, computing them (a trace reopened for the first
  time by this tracemagic version: printed as its own line, same goal);
- efficiency, advice, ranks and diff(self), each alone after a cached load with
  ``$TRACEMAGIC_TABLE_CACHE=0`` (so each computes its own intermediate results);
- ``gzip.decompress`` + ``orjson.loads`` of the GPU trace, and its load + the 6 tables;
- HolisticTraceAnalysis ``TraceAnalysis`` on the CPU trace where it installs
  (``bench/out/hta-venv``, see ``benchlib.ensure_hta``), in the first ``--hta-rounds``.

Each figure is a ratio of medians; the goals:

==============================================================  ======
load + 6 tables, fresh, / ``orjson.loads``                      <= 0.15
reopen from the cache + 6 tables / ``orjson.loads``             <= 0.05
peak RSS of load + every table / the file's size                <= 2.5
efficiency, advice, ranks, diff(self), each / ``orjson.loads``  <= 0.1
GPU trace: load + 6 tables / (gzip + ``orjson.loads``)          <= 0.5
HTA load / (load + 6 tables)                                    >= 50
==============================================================  ======

The magic's and the first paint's goals are measured by their own benches (``EXTERNAL``).

Usage: ``.venv/bin/python bench/bench_goals.py [--rounds 3] [--size 100] [--no-hta]
[--hta-rounds 1] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import GPU_TRACE, ROOT, SIX, cpu_trace, ensure_hta, fmt_s, machine, median, run_hta, run_worker  # noqa: E402

#: the tables timed alone, each against orjson.loads
OTHERS = ("efficiency", "advice", "ranks", "diff")
#: the tables run after the 6 for the peak RSS of "every table"
REST = ("memory_peaks", "efficiency", "advice", "ranks", "diff")
#: the goals other benches measure: (goal, the bench that prints its verdict)
EXTERNAL = (
    ("magic: whole profiled loop <= 1.02x a bare torch.profiler loop, active step <= 1.05x", "bench/bench_magic_overhead.py"),
    ("report/dashboard: first figure <= 1 s after the page starts loading, each tab <= 0.3 s, "
     "Timeline tab in JupyterLab < 1 s", "the first-paint bench (views)"),
)


def measurements(cpu: Path, gpu: Path, cache: str) -> dict[str, dict[str, Any]]:
    """Each measurement of a round: its worker spec."""
    found: dict[str, dict[str, Any]] = {
        "orjson": {"kind": "orjson", "path": str(cpu)},
        "fresh": {"kind": "fresh", "path": str(cpu), "tables": [*SIX, *REST], "cache_dir": cache},
        "first": {"kind": "cached", "path": str(cpu), "tables": list(SIX), "cache_dir": cache, "empty_cache": True},
        "cached": {"kind": "cached", "path": str(cpu), "tables": list(SIX), "cache_dir": cache},
        "cached, computed": {"kind": "cached", "path": str(cpu), "tables": list(SIX), "cache_dir": cache, "table_cache": False},
        "gzip-orjson": {"kind": "gzip-orjson", "path": str(gpu)},
        "gpu": {"kind": "fresh", "path": str(gpu), "tables": list(SIX), "cache_dir": cache},
    }
    for name in OTHERS:
        found[f"{name} alone"] = {"kind": "cached", "path": str(cpu), "tables": [name], "cache_dir": cache, "table_cache": False}
    return found


def six(run: dict[str, Any]) -> float:
    """Load + the 6 tables of one run, s (nan if a table failed)."""
    values = [run["tables"].get(t) for t in SIX]
    return float("nan") if any(v is None for v in values) else run["seconds"] + sum(values)


def goals(results: dict[str, list[dict[str, Any]]], file_mb: float) -> list[tuple[str, float, str, float, str]]:
    """(goal, measured ratio, comparison, target, the figures behind it)."""
    orjson = median([r["seconds"] for r in results["orjson"]])
    fresh = median([six(r) for r in results["fresh"]])
    first = median([six(r) for r in results["first"]])
    cached = median([six(r) for r in results["cached"]])
    computed = median([six(r) for r in results["cached, computed"]])
    peak = max((r["peak_mb"] for r in results["fresh"]), default=float("nan"))
    base = min((r["base_mb"] for r in results["fresh"]), default=float("nan"))
    found = [
        ("load + 6 tables, fresh, x orjson.loads", fresh / orjson, "<=", 0.15, f"{fmt_s(fresh)} s vs {fmt_s(orjson)} s"),
        ("  the same with the cache on (load's default: a first load, its cache entry left to write), x orjson.loads",
         first / orjson, "<=", 0.15, f"{fmt_s(first)} s"),
        ("reopen from cache + 6 tables (stored in the cache), x orjson.loads", cached / orjson, "<=", 0.05,
         f"{fmt_s(cached)} s vs {fmt_s(orjson)} s"),
        ("  the same, tables computed (none stored yet), x orjson.loads", computed / orjson, "<=", 0.05,
         f"{fmt_s(computed)} s"),
        ("peak RSS, load + every table, x file size", peak * 2**20 / 1e6 / file_mb, "<=", 2.5,
         f"{peak:.0f} MiB of a {file_mb:.0f} MB file ({(peak - base) * 2**20 / 1e6 / file_mb:.2f}x above the "
         f"{base:.0f} MiB after imports)"),
    ]
    for name in OTHERS:
        alone = median([r["tables"].get(name) for r in results[f"{name} alone"]])
        found.append((f"{name}{'(self)' if name == 'diff' else '()'} alone, x orjson.loads", alone / orjson, "<=", 0.1,
                      f"{fmt_s(alone)} s"))
    gz = median([r["seconds"] for r in results["gzip-orjson"]])
    gpu = median([six(r) for r in results["gpu"]])
    found.append(("GPU trace: load + 6 tables, x (gzip + orjson.loads)", gpu / gz, "<=", 0.5, f"{fmt_s(gpu)} s vs {fmt_s(gz)} s"))
    if results.get("hta"):
        hta = median([r["seconds"] for r in results["hta"]])
        found.append(("HolisticTraceAnalysis load / (load + 6 tables)", hta / fresh, ">=", 50.0,
                      f"HTA {fmt_s(hta)} s in {len(results['hta'])} runs, peak {max(r['peak_mb'] for r in results['hta']):.0f} MiB"))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=100, help="the CPU trace of bench/make_traces.py (MB)")
    parser.add_argument("--trace", type=Path, help="another CPU trace instead")
    parser.add_argument("--gpu-trace", type=Path, default=GPU_TRACE)
    parser.add_argument("--no-hta", action="store_true")
    parser.add_argument("--hta-rounds", type=int, default=1, help="in how many rounds HTA runs (it takes ~20 s)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    cpu = (args.trace or cpu_trace(args.size)).resolve()
    file_mb = cpu.stat().st_size / 1e6
    with_hta = not args.no_hta
    if with_hta:
        problem = ensure_hta()
        if problem:
            print(f"HTA: {problem}; going on without it")
            with_hta = False
    print(f"machine: {machine()}")
    print(f"CPU trace {cpu.name} ({file_mb:.1f} MB), GPU trace {args.gpu_trace.name}; {args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="tm-goals-") as cache:
        specs = measurements(cpu, args.gpu_trace.resolve(), cache)
        run_worker(specs["cached"])  # write the cache, the 6 tables stored in it (not timed)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in [*specs, "hta"]}
        names = list(specs)
        for r in range(args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                res = run_worker(specs[name], ROOT)
                if res is not None:
                    results[name].append(res)
            if with_hta and r < args.hta_rounds:
                res = run_hta(cpu)
                if res is not None:
                    results["hta"].append(res)
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nissue 23's goals (ratios of medians of {args.rounds} rounds; {file_mb:.0f} MB CPU trace; "
          f"at the end: {machine()}):")
    for goal, value, op, target, detail in goals(results, file_mb):
        if value != value:
            verdict = "n/a"
        else:
            verdict = "pass" if (value <= target if op == "<=" else value >= target) else "falls short"
        shown = f"{value:.3f}" if value < 10 else f"{value:.1f}"
        print(f"  {verdict:11s}  {goal}: {shown} (goal {op} {target:g}; {detail})")
    print("\nper table (s, median), fresh: " + ", ".join(
        f"{t} {fmt_s(median([r['tables'].get(t) for r in results['fresh']]))}" for t in [*SIX, *REST]))
    for label in ("first", "cached", "cached, computed"):
        print(f"per table (s, median), {label}: " + ", ".join(
            f"{t} {fmt_s(median([r['tables'].get(t) for r in results[label]]))}" for t in SIX))
    print("\nmeasured elsewhere:")
    for goal, where in EXTERNAL:
        print(f"  {goal}: {where}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
