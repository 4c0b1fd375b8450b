"""A job of N ranks: ``tracemagic.load_ranks`` in this process vs on a Dask ``LocalCluster``.

The ranks are made from the 8 real DLRM ranks of ``../shared/traces/param_dlrm_kineto.tar.gz``
(NCCL, V100, ~0.9 MB of JSON and one ProfilerStep each): rank ``k`` is DLRM rank ``k % 8``
with ``distributedInfo.rank = k``, its step repeated ``--steps`` times one after another
(ProfilerStep#12, #13, ...; events shifted by the step's span) for bigger ranks.

For each N, each mode runs in a fresh subprocess on a cold cache (a new cache folder):

- ``serial``: ``load_ranks(dir)``: every rank opened and summarized here, one after another;
- ``cluster``: ``load_ranks(dir, client)`` on a ``LocalCluster`` of ``--workers`` worker
  processes (one thread each), started before the clock starts (its start is printed apart).

Timed: ``load_ranks`` plus the four cross-rank tables (``ranks_table``, ``steps``,
``collectives``, ``stragglers``). The client's memory is the client process's alone (the
workers are other processes): its peak RSS above the RSS just before ``load_ranks`` (sampled
every 5 ms), and that as a share of the job's JSON bytes. A flat client means it stays put as
N grows (tracemalloc is left off: it would slow the serial mode's parsing, in this process,
and not the workers').

    .venv/bin/python bench/bench_ranks.py [--ranks 8 32 128] [--steps 1] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "traces" / "param_dlrm_kineto.tar.gz"
if not SOURCE.exists():
    SOURCE = ROOT / "tests" / "data" / "traces" / "param_dlrm_kineto.tar.gz"

CHILD = """\
import json, os, sys, threading, time
import psutil
import tracemagic, tracemagic.job, tracemagic.analysis.ranks  # imports outside the clock
folder, mode, cache, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = cluster = None
started = time.perf_counter()
if mode == "cluster":
    from distributed import Client, LocalCluster
    cluster = LocalCluster(n_workers=workers, processes=True, threads_per_worker=1, dashboard_address=None)
    client = Client(cluster)
    client.run(lambda: __import__("tracemagic.job"))  # the workers' imports, outside the clock
startup = time.perf_counter() - started
me = psutil.Process()
base = me.memory_info().rss
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], me.memory_info().rss)
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
ranks = tracemagic.load_ranks(folder, client, cache_dir=cache)
tables = [ranks.ranks_table(), ranks.steps(), ranks.collectives(), ranks.stragglers()]
wall = time.perf_counter() - t0
done.set()
peak[0] = max(peak[0], me.memory_info().rss)
assert len(ranks.rank_ids) == len(os.listdir(folder)) and not ranks.failed, ranks
print(json.dumps({"wall": wall, "rss": peak[0] - base, "startup": startup,
                  "rows": sum(len(t) for t in tables)}))
if client is not None:
    client.close(); cluster.close()
"""


def make_job(folder: Path, ranks: int, steps: int) -> int:
    """``ranks`` rank files in ``folder`` (see the module docstring); their JSON bytes."""
    with tarfile.open(SOURCE) as archive:
        docs = sorted((json.load(archive.extractfile(m)) for m in archive if m.isfile()),  # type: ignore[arg-type]
                      key=lambda d: d["distributedInfo"]["rank"])
    folder.mkdir(parents=True)
    total = 0
    for rank in range(ranks):
        doc = dict(docs[rank % len(docs)])
        events = doc["traceEvents"]
        timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
        span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed)
        repeated = list(events)
        for k in range(1, steps):
            for e in timed:
                copy = dict(e, ts=e["ts"] + k * span)
                if str(e.get("name", "")).startswith("ProfilerStep#"):
                    copy["name"] = f"ProfilerStep#{int(e['name'].split('#')[1]) + k}"
                repeated.append(copy)
        doc["traceEvents"] = repeated
        doc["distributedInfo"] = dict(doc["distributedInfo"], rank=rank)
        path = folder / f"worker{rank}.pt.trace.json"
        path.write_text(json.dumps(doc))
        total += path.stat().st_size
    return total


def run(folder: Path, mode: str, cache: Path, workers: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mode, str(cache), str(workers)],
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--steps", type=int, default=1, help="steps per rank (1: ~0.9 MB of JSON per rank)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{'N':>5} {'JSON':>9} {'mode':>8} {'wall s':>7} {'client peak RSS (/ JSON)':>26}  cluster start")
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        for n in args.ranks:
            folder = Path(tmp) / f"job{n}"
            total = make_job(folder, n, args.steps)
            for mode in ("serial", "cluster"):
                r = run(folder, mode, Path(tmp) / f"cache-{n}-{mode}", args.workers)
                start = f"{r['startup']:.1f} s" if mode == "cluster" else ""
                print(f"{n:>5} {total / 2**20:>7.0f}MB {mode:>8} {r['wall']:>7.2f} "
                      f"{r['rss'] / 2**20:>13.1f} MB ({r['rss'] / total:>6.1%})  {start}", flush=True)


if __name__ == "__main__":
    main()
