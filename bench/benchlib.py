"""What the benches in ``bench/`` share: the tables they time, the worker that times them in
a fresh process (against any source tree, so an old commit's code is timed by the same
worker), the ~10/~100 MB traces, medians and the HolisticTraceAnalysis venv.

A worker is ``python bench/benchlib.py worker SPEC`` (SPEC: JSON) run with ``PYTHONPATH``
set to the tree whose ``tracemagic`` is timed; it prints one ``RESULT {json}`` line. Its
kinds:

- ``orjson``: ``orjson.loads`` of the file's bytes (read beforehand, not timed);
- ``gzip-orjson``: ``gzip.decompress`` + ``orjson.loads`` of a ``.json.gz`` file's bytes;
- ``fresh`` / ``cached``: ``tracemagic.load`` without / from the Arrow cache (reading the
  file included), then each table of ``tables`` in order, each timed; the tables of one
  process share the trace's intermediate results, as in a session (``alone`` times a
  single table after a cached load, so it pays for its intermediates itself).

A ``cached`` spec with ``"empty_cache": true`` loads into a new, empty cache folder: the
first load of a trace with the cache on (``load``'s default), which parses it and leaves
its cache entry to be written (as the process ends, see ``trace.cache.PendingEntry``).

A spec with ``"table_cache": false`` runs with ``$TRACEMAGIC_TABLE_CACHE=0``: the tables are
computed even where the cache holds them from an earlier process (``trace.cache.TableStore``);
with ``"dump": PATH`` the tables are also pickled to PATH (``{name: DataFrame}``) for
``identical`` to compare.

Peak memory is the worker's ``ru_maxrss`` at its end (``base_mb``: after the imports and a
warm-up load of a tiny trace, so lazy imports are not timed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out"
HTA_VENV = OUT / "hta-venv"
GPU_TRACE = ROOT / "tests" / "data" / "traces" / "hta_control.json.gz"

#: the 6 tables of the issue-23 load goal, in the order a session asks for them
SIX = ("ops", "kernels", "layers", "memory", "shapes", "steps")
#: every table the regression guard times, in order
ALL = ("ops", "kernels", "steps", "layers", "memory", "memory_peaks", "shapes", "efficiency", "advice", "ranks", "diff")


def _ranks(trace: Any) -> Any:
    ranks = trace.ranks
    return ranks() if callable(ranks) else trace.ranks_table()  # an old tree: ranks was the id list


#: table name -> how to compute it (written for old trees too: a missing method is "-")
TABLE_CALLS: dict[str, Callable[[Any], Any]] = {
    "ops": lambda t: t.ops(),
    "kernels": lambda t: t.kernels(),
    "steps": lambda t: t.steps(),
    "layers": lambda t: t.layers(),
    "memory": lambda t: t.memory(),
    "memory_peaks": lambda t: t.memory_peaks(),
    "shapes": lambda t: t.shapes(),
    "efficiency": lambda t: t.efficiency(),
    "advice": lambda t: t.advice(),
    "ranks": _ranks,
    "diff": lambda t: t.diff(t),
    "source": lambda t: t.source(),  # bench_source.py; not in ALL
}


# -- traces ------------------------------------------------------------------------------


def cpu_trace(mb: int, out: Path = OUT) -> Path:
    """The ~``mb`` MB CPU trace of ``bench/make_traces.py`` (made on first use)."""
    path = out / f"cpu_{mb}mb.pt.trace.json"
    if not path.exists():
        subprocess.run([sys.executable, str(BENCH / "make_traces.py"), "--sizes", str(mb), "--out", str(out)], check=True)
    return path


# -- the worker (a fresh process) ----------------------------------------------------------


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _warm_up(cache_dir: str) -> None:
    """Load a tiny trace through both paths and ask for every table, so lazy imports
    (pyarrow.ipc, the analysis modules) are not timed: the numbers are a session's."""
    import tempfile

    import tracemagic

    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0 + i, "dur": 0.5} for i in range(50)
    ]
    # a step and allocations too, so the memory tables run their pandas code here, not first in a timed call
    events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.5, "dur": 60.0})
    events += [
        {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1.2 + i,
         "args": {"Device Type": 0, "Device Id": -1, "Addr": 4096 * (i // 2), "Bytes": 64 if i % 2 == 0 else -64,
                  "Total Allocated": 64 * (i % 2 == 0), "Total Reserved": 0}}
        for i in range(20)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "warm.json"
        path.write_text(json.dumps({"traceEvents": events}))
        for _ in range(2):  # parse (and write the cache), then read the cache
            trace = tracemagic.load(path, progress=False, cache_dir=tmp)
            for call in TABLE_CALLS.values():
                try:
                    call(trace)
                except Exception:  # noqa: BLE001 - a table an old tree lacks
                    pass


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Time one measurement (see the module doc); runs in a fresh process."""
    import gc

    kind = spec["kind"]
    path = Path(spec["path"])
    if spec.get("table_cache") is False:
        os.environ["TRACEMAGIC_TABLE_CACHE"] = "0"
    if kind in ("orjson", "gzip-orjson"):
        import gzip

        import orjson

        data = path.read_bytes()
        base = _rss_mb()
        start = time.perf_counter()
        doc = orjson.loads(gzip.decompress(data) if kind == "gzip-orjson" else data)
        seconds = time.perf_counter() - start
        events = len(doc["traceEvents"]) if isinstance(doc, dict) else len(doc)
        return {"seconds": seconds, "peak_mb": _rss_mb(), "base_mb": base, "events": events}

    import pandas  # noqa: F401 - imports are not timed

    import tracemagic

    cache_dir = spec["cache_dir"]
    _warm_up(cache_dir)
    if spec.get("empty_cache"):  # a first load with the cache on (the default): nothing in it yet
        import tempfile

        cache_dir = tempfile.mkdtemp(dir=cache_dir, prefix="empty-")
    gc.collect()
    base = _rss_mb()
    start = time.perf_counter()
    trace = tracemagic.load(path, use_cache=kind != "fresh", cache_dir=cache_dir, progress=False)
    load_s = time.perf_counter() - start
    tables: dict[str, float | None] = {}
    made: dict[str, Any] = {}
    for name in spec.get("tables", ()):
        t = time.perf_counter()
        try:
            made[name] = TABLE_CALLS[name](trace)
        except Exception as exc:  # noqa: BLE001 - a table an old tree lacks is "-", not a failed bench
            tables[name] = None
            if not (isinstance(exc, AttributeError) and not hasattr(trace, name)):  # lacking it is no news
                print(f"  ({name}() failed: {type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
            continue
        tables[name] = time.perf_counter() - t
    if spec.get("dump"):
        import pickle

        Path(spec["dump"]).write_bytes(pickle.dumps(made))
    return {
        "seconds": load_s,
        "tables": tables,
        "peak_mb": _rss_mb(),
        "base_mb": base,
        "events": len(trace.events),
        "module": tracemagic.__file__,
    }


def run_worker(spec: dict[str, Any], tree: Path = ROOT, timeout: float = 900) -> dict[str, Any] | None:
    """``worker(spec)`` in a fresh process importing ``tracemagic`` from ``tree``; None
    (and the reason on stderr) if it failed."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tree, env=env)
    except subprocess.TimeoutExpired:
        print(f"  {spec['kind']}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    result = _result(proc, spec["kind"])
    if result is not None:
        module = result.get("module")
        if module is not None and not Path(module).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the worker for {tree} imported tracemagic from {module}")
        if proc.stderr.strip():
            print(proc.stderr.strip()[-400:], file=sys.stderr)
    return result


def _result(proc: subprocess.CompletedProcess[str], label: str) -> dict[str, Any] | None:
    """The ``RESULT {json}`` line a worker printed; None (and its stderr's end) without one."""
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    print(f"  {label} failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}", file=sys.stderr)
    return None


def identical(dumps: dict[str, Path]) -> list[str]:
    """Compare the tables pickled by workers (``"dump"``): label -> file, the first is the
    reference. Returns the differences found (empty: every table identical, dtypes, the
    categories' dtypes and ``attrs`` included)."""
    import pickle

    import pandas as pd

    labels = list(dumps)
    loaded = {label: pickle.loads(dumps[label].read_bytes()) for label in labels}
    want = loaded[labels[0]]
    problems = []
    for label in labels[1:]:
        got = loaded[label]
        for name in want:
            if name not in got:
                problems.append(f"{label}: {name} missing")
                continue
            a, b = want[name], got[name]
            try:
                pd.testing.assert_frame_equal(b, a, check_exact=True, check_categorical=True)
                for column in a.columns:
                    assert b[column].dtype == a[column].dtype, f"{column}: dtype {b[column].dtype} != {a[column].dtype}"
                    if isinstance(a[column].dtype, pd.CategoricalDtype):
                        assert b[column].cat.categories.dtype == a[column].cat.categories.dtype, f"{column}: categories"
                assert repr(b.attrs) == repr(a.attrs), "attrs differ"
            except AssertionError as exc:
                problems.append(f"{label}: {name}: {str(exc).strip().splitlines()[0][:200]}")
    return problems


# -- figures -----------------------------------------------------------------------------


def interleaved(
    specs: dict[str, dict[str, Any]],
    trees: dict[str, Path],
    rounds: int,
    run: Callable[[Any, Path], dict[str, Any] | None],
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Tree name -> label -> each round's result of ``run(specs[tree][label], trees[tree])``:
    every label measured once per tree a round, "ref" and "new" taking turns at going
    first (interleaved pairs: the machine's drift hits both alike). A failed run (None) is
    left out."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {n: {label: [] for label in specs[n]} for n in trees}
    for r in range(rounds):
        order = ["ref", "new"] if r % 2 == 0 else ["new", "ref"]
        for label in specs["new"]:
            for name in order:
                result = run(specs[name][label], trees[name])
                if result is not None:
                    results[name][label].append(result)
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return results


def median(values: list[float]) -> float:
    """The median, nan for none."""
    kept = [v for v in values if v is not None and v == v]
    return statistics.median(kept) if kept else float("nan")


def fmt_s(value: float) -> str:
    return "-" if value != value else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def fmt_x(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


def machine() -> str:
    """The machine in words: cores, load, CPU model."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores{f' ({model})' if model else ''}, load average {os.getloadavg()[0]:.1f}"


# -- HolisticTraceAnalysis, in its own venv ------------------------------------------------

HTA_SCRIPT = r"""
import json, logging, os, resource, sys, time
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start = time.perf_counter()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
seconds = time.perf_counter() - start
rows = sum(len(analysis.t.get_trace(r)) for r in analysis.t.get_ranks())
print("RESULT " + json.dumps({"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                             "base_mb": base, "events": rows}))
"""


def run_hta(path: Path, timeout: float = 900) -> dict[str, Any] | None:
    """HTA's ``TraceAnalysis(trace_dir=...)`` on ``path`` (alone in a folder), in a fresh
    process of ``bench/out/hta-venv`` (see ``ensure_hta``)."""
    python = HTA_VENV / "bin" / "python"
    folder = OUT / f"hta-{path.stem}"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / path.name
    if not link.exists():
        link.symlink_to(path.resolve())
    try:
        proc = subprocess.run([str(python), "-c", HTA_SCRIPT, str(folder)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"  hta: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    return _result(proc, "hta")


def hta_requirements() -> list[str]:
    """HTA's declared requirements, read from its wheel's METADATA (pip download --no-deps)."""
    dest = OUT / "hta-dl"
    dest.mkdir(parents=True, exist_ok=True)
    if not list(dest.glob("holistictraceanalysis-*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "holistictraceanalysis", "-d", str(dest)],
            check=True,
            capture_output=True,
        )
    wheel = sorted(dest.glob("holistictraceanalysis-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def ensure_hta() -> str | None:
    """Create ``bench/out/hta-venv`` with HTA (HTA breaks on pandas 3, so it gets
    ``pandas<3``; torch is pinned so nothing pulls CUDA wheels); None if it works, else
    why not."""
    python = HTA_VENV / "bin" / "python"
    probe = [str(python), "-c", "import hta.trace_analysis"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return None
    try:
        requires = hta_requirements()
        print(f"HTA requires: {', '.join(requires)}")
        constraints = OUT / "hta-constraints.txt"
        constraints.write_text("torch==2.13.0\npandas<3\n")
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True)
        print("installing HTA into bench/out/hta-venv (one time) ...", flush=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-c", str(constraints), "holistictraceanalysis", "pandas<3"],
            check=True,
            capture_output=True,
            text=True,
        )
    except (subprocess.CalledProcessError, OSError, StopIteration) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"could not install HTA: {str(detail).strip()[-300:]}"
    if subprocess.run(probe, capture_output=True).returncode != 0:
        return "HTA installed but does not import"
    return None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        print("RESULT " + json.dumps(worker(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit("usage: benchlib.py worker SPEC (the benches start it)")
