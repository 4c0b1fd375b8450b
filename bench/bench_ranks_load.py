"""Loading 8 ranks: parsed in parallel processes vs one by one (``workers=1``).

Two sets, each a directory of 8 rank files:

- ``dlrm``: the 8 real DLRM ranks of ``../shared/traces/param_dlrm_kineto.tar.gz``, extracted.
- ``big``: one bigger real trace (default ``hta_control.json.gz``, ~35 MB of JSON) written
  8 times as ``kineto_trace_<rank>.json`` with ``distributedInfo.rank`` set per copy.

Each load runs in a fresh subprocess (``tracemagic.load(dir, workers=W, use_cache=False)``)
in three modes: ``workers=N`` (parallel, default N = cores), ``workers=None`` (the
loader's own choice: it parses in parallel only above a total size) and ``workers=1``
(serial). Each is timed inside the subprocess (imports excluded); the parent samples the RSS of that process and
all its children every 10 ms for the peak memory of the whole process tree. Printed per
set: median wall time and peak tree RSS for each mode, and its ratios to serial.

    .venv/bin/python bench/bench_ranks_load.py [--reps 3] [--source PATH] [--workers N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
RANKS = 8

CHILD = """\
import sys, time
import tracemagic
t0 = time.perf_counter()
trace = tracemagic.load(sys.argv[1], workers=int(sys.argv[2]) or None, use_cache=False)
wall = time.perf_counter() - t0
print(f"{wall} {len(trace.events)} {len(trace.rank_ids)}")
"""


def extract_dlrm(target: Path) -> Path:
    """The DLRM tar's 8 rank files, flat in ``target``."""
    target.mkdir(parents=True)
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                (target / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    return target


def replicate(source: Path, target: Path, ranks: int = RANKS) -> Path:
    """``source`` written ``ranks`` times as ``kineto_trace_<r>.json`` with its rank metadata."""
    target.mkdir(parents=True)
    opener = gzip.open if source.name.endswith(".gz") else open
    with opener(source, "rb") as fh:
        data = json.load(fh)
    info = dict(data.get("distributedInfo") or {"backend": "nccl"})
    for rank in range(ranks):
        data["distributedInfo"] = {**info, "rank": rank, "world_size": ranks}
        with open(target / f"kineto_trace_{rank}.json", "w") as out:
            json.dump(data, out)
    return target


def measure(directory: Path, workers: int) -> tuple[float, int, int]:
    """(load wall seconds, peak RSS bytes of the process tree, events) of one load."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), str(workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        peak = max(peak, total)
        time.sleep(0.01)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"load of {directory} failed:\n{err[-2000:]}")
    wall, events, ranks = out.split()[-3:]
    if int(ranks) != RANKS:
        raise RuntimeError(f"{directory}: loaded {ranks} ranks, expected {RANKS}")
    return float(wall), peak, int(events)


def bench(name: str, directory: Path, reps: int, workers: int) -> None:
    size = sum(p.stat().st_size for p in directory.iterdir())
    modes = {
        f"parallel (workers={workers})": workers,
        "loader default (workers=None)": 0,
        "serial (workers=1)": 1,
    }
    results: dict[str, list[tuple[float, int, int]]] = {mode: [] for mode in modes}
    for _ in range(reps):  # alternate, so drift hits all modes alike
        for mode, count in modes.items():
            results[mode].append(measure(directory, count))
    wall = {k: statistics.median(r[0] for r in v) for k, v in results.items()}
    rss = {k: max(r[1] for r in v) for k, v in results.items()}
    events = next(iter(results.values()))[0][2]
    print(f"\n{name}: {RANKS} ranks, {size / 1e6:.1f} MB of JSON, {events:,} events, {reps} rep(s)")
    serial = "serial (workers=1)"
    for mode in modes:
        ratio = "" if mode == serial else (
            f"   vs serial: wall x{wall[mode] / wall[serial]:.2f}, RSS x{rss[mode] / rss[serial]:.2f}"
        )
        print(f"  {mode:<30} wall {wall[mode]:7.2f} s   peak tree RSS {rss[mode] / 2**20:6.0f} MiB{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="loads per mode for the DLRM set (default 3)")
    parser.add_argument("--big-reps", type=int, default=1, help="loads per mode for the big set (default 1)")
    parser.add_argument("--source", type=Path, default=TRACES / "hta_control.json.gz", help="trace replicated 8x")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="workers of the parallel mode (default: the cores)")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as tmp:
        bench("dlrm", extract_dlrm(Path(tmp) / "dlrm"), args.reps, args.workers)
        bench(f"big ({args.source.name} x{RANKS})", replicate(args.source, Path(tmp) / "big"), args.big_reps, args.workers)


if __name__ == "__main__":
    main()
