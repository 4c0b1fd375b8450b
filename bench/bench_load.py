"""Time ``tracemagic.load`` (+ every analysis table) against JSON parsers and HTA.

For each generated CPU trace (``bench/make_traces.py``: ~10, ~100, ~500 MB) this runs, in
one process per measurement and interleaved round by round (the machine is shared and
noisy, so baseline and candidate always alternate and ratios are of medians):

- ``json.loads``, ``orjson.loads``, ``simdjson.loads`` (pysimdjson), ``msgspec.json.decode``
  of the file's bytes (read beforehand, not timed): the parsers alone, no tables;
- ``tracemagic.load(use_cache=False)`` (reading included), then ``ops()``, ``kernels()``,
  ``steps()``, ``layers()``, ``memory()`` (each only if its analysis module exists);
- the same reopened from the Arrow cache;
- HolisticTraceAnalysis ``TraceAnalysis(trace_dir=...)`` on the same file (in the first
  ``--hta-rounds`` rounds, default 3; its median is the baseline), in a throwaway
  venv (``bench/out/hta-venv``, made by ``benchlib.ensure_hta``: HTA breaks on pandas 3, so it gets
  ``pandas<3``; torch is pinned to 2.13.0 in the constraints so nothing pulls CUDA wheels).

Peak memory is each worker's peak RSS (``ru_maxrss``; the loader parses a large file on two
threads of the one process), also shown minus the RSS after imports, against the JSON size. Targets (issue 3), judged on the ~100 MB trace: load into
analysis-ready tables >= 20x faster than HTA and no slower than ``orjson.loads``; peak
memory <= 3x the JSON size; reopening from cache >= 10x faster than the first load.

Usage: ``.venv/bin/python bench/bench_load.py [--sizes 10,100,500] [--rounds 3]
[--hta-sizes 10,100] [--hta-rounds 3] [--no-hta]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import BENCH, OUT, ROOT, ensure_hta, run_hta  # noqa: E402 - the HTA venv, shared with bench_goals.py

TABLES = ("ops", "kernels", "steps", "layers", "memory")
PARSERS = ("json", "orjson", "simdjson", "msgspec")


# -- workers (run in a fresh process each) -----------------------------------------------


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(kind: str, path: Path) -> dict[str, object]:
    import gc

    if kind in PARSERS:
        data = path.read_bytes()
        if kind == "json":
            import json as parser

            loads = parser.loads
        elif kind == "orjson":
            import orjson

            loads = orjson.loads
        elif kind == "simdjson":
            import simdjson

            loads = simdjson.loads
        else:
            import msgspec

            loads = msgspec.json.decode
        base = _rss_mb()
        start = time.perf_counter()
        doc = loads(data)
        seconds = time.perf_counter() - start
        events = len(doc["traceEvents"]) if isinstance(doc, dict) else len(doc)
        return {"seconds": seconds, "peak_mb": _rss_mb(), "base_mb": base, "events": events}

    import pandas  # noqa: F401 - imports are not timed

    import tracemagic

    _warm_up()
    base = _rss_mb()
    gc.collect()
    start = time.perf_counter()
    trace = tracemagic.load(path, use_cache=(kind == "cached"), progress=False)
    load_s = time.perf_counter() - start
    tables: dict[str, float] = {}
    for name in TABLES:
        if importlib.util.find_spec(f"tracemagic.analysis.{name}") is None:
            continue
        t = time.perf_counter()
        try:
            getattr(trace, name)()
        except Exception as exc:  # noqa: BLE001 - a table under construction must not stop the bench
            tables[name] = float("nan")
            print(f"  ({name}() failed: {type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        tables[name] = time.perf_counter() - t
    return {
        "seconds": load_s,
        "tables_s": sum(v for v in tables.values() if v == v),
        "tables": tables,
        "peak_mb": _rss_mb(),
        "base_mb": base,
        "events": len(trace.events),
    }


def _warm_up() -> None:
    """Load a tiny trace through both paths first, so lazy imports (pyarrow.ipc, the
    analysis modules) are not timed: the numbers are those of a session in use."""
    import tempfile

    import tracemagic

    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0 + i, "dur": 0.5} for i in range(50)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "warm.json"
        path.write_text(json.dumps({"traceEvents": events}))
        for _ in range(2):  # parse (and write the cache), then read the cache
            trace = tracemagic.load(path, progress=False)
            for name in TABLES:
                if importlib.util.find_spec(f"tracemagic.analysis.{name}") is not None:
                    try:
                        getattr(trace, name)()
                    except Exception:  # noqa: BLE001
                        pass


def run_worker(kind: str, path: Path, timeout: float = 900) -> dict[str, object] | None:
    if kind == "hta":
        return run_hta(path, timeout)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"  {kind}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"  {kind} failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}", file=sys.stderr)
    return None


# -- the run -----------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_s(value: float) -> str:
    return "-" if value != value else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def fmt_x(value: float) -> str:
    return "-" if value != value else f"{value:.1f}x"


def bench_size(path: Path, rounds: int, with_hta: bool, hta_rounds: int = 3) -> dict[str, object]:
    json_mb = path.stat().st_size / 1e6
    print(f"\n== {path.name}: {json_mb:.1f} MB", flush=True)
    run_worker("cached", path)  # writes the cache (not timed)
    kinds = ["orjson", "tracemagic", "json", "cached", "simdjson", "msgspec"]
    if json_mb > 200:  # each generic parser needs ~10x the file in memory: keep to one baseline
        kinds = ["orjson", "tracemagic", "cached"]
    results: dict[str, list[dict[str, object]]] = {k: [] for k in kinds + ["hta"]}
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for kind in order:
            res = run_worker(kind, path)
            if res is not None:
                results[kind].append(res)
                extra = f" + tables {res['tables_s']:.3f}s" if "tables_s" in res else ""
                print(f"  round {r + 1} {kind:10s} {res['seconds']:.3f}s{extra}  peak {res['peak_mb']:.0f} MB", flush=True)
        if r < hta_rounds and with_hta:  # HTA too is timed in several rounds: the machine is noisy
            res = run_worker("hta", path)
            if res is not None:
                results["hta"].append(res)
                print(f"  round {r + 1} {'hta':10s} {res['seconds']:.3f}s  peak {res['peak_mb']:.0f} MB", flush=True)
    med = {k: median([float(x["seconds"]) for x in results.get(k, [])]) for k in ["json", "orjson", "simdjson", "msgspec", "tracemagic", "cached", "hta"]}
    tables = median([float(x["tables_s"]) for x in results["tracemagic"]])
    cached_tables = median([float(x["tables_s"]) for x in results["cached"]])
    peak = max((float(x["peak_mb"]) for x in results["tracemagic"]), default=float("nan"))
    base = min((float(x["base_mb"]) for x in results["tracemagic"]), default=float("nan"))
    per_table = {
        name: median([float(x["tables"][name]) for x in results["tracemagic"] if name in x["tables"]])  # type: ignore[index]
        for name in TABLES
    }
    return {
        "file": path.name,
        "json_mb": json_mb,
        "events": results["tracemagic"][0]["events"] if results["tracemagic"] else 0,
        "median_s": med,
        "tables_s": tables,
        "per_table_s": per_table,
        "cached_tables_s": cached_tables,
        "peak_mb": peak,
        "base_mb": base,
        "orjson_peak_mb": max((float(x["peak_mb"]) for x in results["orjson"]), default=float("nan")),
        "hta_peak_mb": max((float(x["peak_mb"]) for x in results["hta"]), default=float("nan")),
        "runs": {k: len(v) for k, v in results.items()},
    }


def report(rows: list[dict[str, object]]) -> None:
    print("\nseconds (median of rounds; tracemagic load includes reading the file):")
    head = f"{'trace':>8} {'events':>9} {'json':>7} {'orjson':>7} {'simdjs':>7} {'msgspec':>7} {'tm load':>8} {'tables':>7} {'tm all':>7} {'cached':>7} {'HTA':>7}"
    print(head)
    for row in rows:
        m = row["median_s"]  # type: ignore[assignment]
        total = m["tracemagic"] + row["tables_s"]  # type: ignore[index,operator]
        print(
            f"{row['json_mb']:>6.0f}MB {row['events']:>9} {fmt_s(m['json']):>7} {fmt_s(m['orjson']):>7} {fmt_s(m['simdjson']):>7} "  # type: ignore[index]
            f"{fmt_s(m['msgspec']):>7} {fmt_s(m['tracemagic']):>8} {fmt_s(row['tables_s']):>7} {fmt_s(total):>7} "  # type: ignore[index]
            f"{fmt_s(m['cached']):>7} {fmt_s(m['hta']):>7}"  # type: ignore[index]
        )
    print("\nratios (>1 means tracemagic is faster) and peak memory:")
    print(f"{'trace':>8} {'orjson/load':>11} {'orjson/all':>10} {'HTA/all':>8} {'HTA/load':>8} {'load/cached':>11} {'peak RSS':>9} {'xJSON':>6} {'delta xJSON':>11} {'orjson RSS':>10} {'HTA RSS':>8}")
    for row in rows:
        m = row["median_s"]  # type: ignore[assignment]
        total = m["tracemagic"] + row["tables_s"]  # type: ignore[index,operator]
        jm = float(row["json_mb"])  # type: ignore[arg-type]
        print(
            f"{jm:>6.0f}MB {fmt_x(m['orjson'] / m['tracemagic']):>11} {fmt_x(m['orjson'] / total):>10} "  # type: ignore[index]
            f"{fmt_x(m['hta'] / total):>8} {fmt_x(m['hta'] / m['tracemagic']):>8} {fmt_x(m['tracemagic'] / m['cached']):>11} "  # type: ignore[index]
            f"{row['peak_mb']:>7.0f}MB {float(row['peak_mb']) / jm:>5.1f}x {(float(row['peak_mb']) - float(row['base_mb'])) / jm:>10.1f}x "  # type: ignore[arg-type]
            f"{row['orjson_peak_mb']:>8.0f}MB {row['hta_peak_mb']:>6.0f}MB"
        )
    print("\nper table (s):", "; ".join(f"{r['json_mb']:.0f}MB " + ", ".join(f"{k} {v:.3f}" for k, v in r["per_table_s"].items() if v == v) for r in rows))  # type: ignore[union-attr]
    target = min(rows, key=lambda r: abs(float(r["json_mb"]) - 100))  # type: ignore[arg-type]
    m = target["median_s"]  # type: ignore[assignment]
    total = m["tracemagic"] + target["tables_s"]  # type: ignore[index,operator]
    jm = float(target["json_mb"])  # type: ignore[arg-type]
    checks = [
        ("load + tables >= 20x faster than HTA", m["hta"] / total, 20.0),  # type: ignore[index]
        ("load + tables no slower than orjson.loads", m["orjson"] / total, 1.0),  # type: ignore[index]
        ("load alone no slower than orjson.loads", m["orjson"] / m["tracemagic"], 1.0),  # type: ignore[index]
        ("peak RSS <= 3x JSON size", 3.0 / (float(target["peak_mb"]) / jm), 1.0),  # type: ignore[arg-type]
        ("cache reopen >= 10x faster than first load", m["tracemagic"] / m["cached"], 10.0),  # type: ignore[index]
    ]
    print(f"\ntargets on the {jm:.0f} MB trace:")
    for label, value, need in checks:
        verdict = "n/a " if value != value else ("PASS" if value >= need else "FAIL")
        print(f"  {verdict}  {label}  ({value:.2f} vs {need:g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,500")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hta-sizes", default="10,100", help="HTA is slow: which sizes to run it on")
    parser.add_argument("--hta-rounds", type=int, default=3, help="in how many of the rounds HTA runs")
    parser.add_argument("--no-hta", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker[0], Path(args.worker[1]))))
        return 0

    sizes = [int(s) for s in args.sizes.split(",") if s]
    paths = [OUT / f"cpu_{mb}mb.pt.trace.json" for mb in sizes]
    missing = [mb for mb, p in zip(sizes, paths) if not p.exists()]
    if missing:
        subprocess.run([sys.executable, str(BENCH / "make_traces.py"), "--sizes", ",".join(map(str, missing))], check=True)
    hta_sizes = set() if args.no_hta else {int(s) for s in args.hta_sizes.split(",") if s}
    if hta_sizes:
        problem = ensure_hta()
        if problem:
            print(f"HTA: {problem}; going on without it")
            hta_sizes = set()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    rows = [bench_size(p, args.rounds if mb <= 200 else 1, mb in hta_sizes, args.hta_rounds) for mb, p in zip(sizes, paths)]
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
