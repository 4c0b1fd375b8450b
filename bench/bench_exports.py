"""The exports' speed against a git ref: ``trace.to_pfw`` (``.pfw`` and ``.pfw.gz``) and
``trace.to_chrome_trace`` (the whole trace, and one step) and ``trace.report`` (the
standalone HTML report) on the ~100 MB CPU trace of
``bench/make_traces.py`` and on the GPU trace ``hta_control.json.gz``.

``REF`` is checked out with ``git worktree add`` into a temporary folder (its C extensions
built) and each tree gets its own Arrow cache, written before the rounds. Each round runs
every measurement in a fresh process for the ref and for this tree, the order of the two
turning each round (interleaved pairs); a worker loads the trace from its cache, times an
``orjson.loads`` of the same file (``gzip`` + ``orjson`` for a ``.gz``) and then the export.
Before the rounds the outputs of both trees are compared byte for byte (gzip'd ones
decompressed; a report's per-file script nonce replaced by one placeholder).

It prints per measurement the medians of both trees (s), each as a ratio to ``orjson.loads``
of the file measured in the same process, and new/ref (< 1: faster).

Usage: ``.venv/bin/python bench/bench_exports.py REF [--rounds 11] [--size 100] [--only pfw,chrome,report]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tables_vs_ref import checkout, place, remove
from benchlib import GPU_TRACE, ROOT, cpu_trace, fmt_s, fmt_x, interleaved, machine, median

#: export name -> how to write it into folder OUT (``trace`` loaded)
EXPORTS = {
    "pfw": lambda trace, out: trace.to_pfw(out / "t.pfw"),
    "pfw.gz": lambda trace, out: trace.to_pfw(out / "t.pfw.gz"),
    "chrome": lambda trace, out: trace.to_chrome_trace(out / "t.json"),
    "chrome step": lambda trace, out: trace.to_chrome_trace(out / "t.json", steps=[_first_step(trace)]),
    "report": lambda trace, out: trace.report(out / "t.html"),
}
#: the report's Content-Security-Policy nonce (new in every file)
_NONCE = re.compile(rb"'nonce-([A-Za-z0-9_-]+)'")


def _first_step(trace: Any) -> int:
    return int(trace.steps()["step"].iloc[0])


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: orjson.loads of the file, then the export after a cached load."""
    import orjson

    import tracemagic

    path = Path(spec["path"])
    data = path.read_bytes()
    start = time.perf_counter()
    orjson.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)
    orjson_s = time.perf_counter() - start
    del data
    trace = tracemagic.load(path, cache_dir=spec["cache_dir"], progress=False)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    EXPORTS[spec["export"]](trace, out)
    return {"seconds": time.perf_counter() - start, "orjson": orjson_s, "module": tracemagic.__file__}


def run(spec: dict[str, Any], tree: Path) -> dict[str, Any] | None:
    """``worker(spec)`` in a fresh process importing ``tracemagic`` from ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree), TRACEMAGIC_TABLE_CACHE="0")
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            if not Path(result["module"]).resolve().is_relative_to(tree.resolve()):
                raise RuntimeError(f"the worker for {tree} imported tracemagic from {result['module']}")
            return result
    print(f"  {spec['export']} failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}", file=sys.stderr)
    return None


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: _comparable(p) for p in sorted(folder.iterdir()) if p.is_file()}


def _comparable(path: Path) -> bytes:
    """The file's bytes (decompressed), a report's nonce replaced by one placeholder."""
    data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    nonce = _NONCE.search(data) if path.suffix == ".html" else None
    return data.replace(nonce.group(1), b"NONCE") if nonce else data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the git ref to compare with (e.g. main)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--size", type=int, default=100, help="the CPU trace of bench/make_traces.py, in MB")
    parser.add_argument("--only", default=",".join(EXPORTS), help=f"exports, comma-separated ({', '.join(EXPORTS)})")
    parser.add_argument("--no-gpu", action="store_true", help="leave out the GPU trace")
    args = parser.parse_args(argv)
    exports = [e.strip() for e in args.only.split(",") if e.strip()]
    cpu = cpu_trace(args.size)
    print(f"machine: {machine()}")
    print(f"CPU trace {cpu.name} ({cpu.stat().st_size / 1e6:.1f} MB); GPU trace {GPU_TRACE.name}; ref {args.ref}")
    with tempfile.TemporaryDirectory(prefix="tm-bench-exports-") as tmp:
        where = Path(tmp)
        print(f"checking out {args.ref} and building its C extensions ...", flush=True)
        trees = {"ref": checkout(args.ref, where), "new": ROOT}
        try:
            specs: dict[str, dict[str, dict[str, Any]]] = {}
            for name in trees:
                folder = where / f"data-{name}"
                traces = {"cpu": place(cpu, folder), **({} if args.no_gpu else {"gpu": place(GPU_TRACE, folder)})}
                specs[name] = {
                    f"{which} {export}": {
                        "path": str(p),
                        "cache_dir": str(folder / "cache"),
                        "export": export,
                        "out": str(where / f"out-{name}" / which / export.replace(" ", "-")),
                    }
                    for which, p in traces.items()
                    for export in exports
                }
            print("writing the caches and comparing the outputs (untimed) ...", flush=True)
            differ = []
            for label in specs["new"]:
                for name in trees:
                    run(specs[name][label], trees[name])
                if _bytes(Path(specs["ref"][label]["out"])) != _bytes(Path(specs["new"][label]["out"])):
                    differ.append(label)
            print("outputs: " + ("identical" if not differ else f"DIFFER: {', '.join(differ)}"))
            results = interleaved(specs, trees, args.rounds, run)
        finally:
            remove(trees["ref"])
    print(f"\nmedians of {args.rounds} interleaved pairs (fresh processes); x orjson: the export / orjson.loads")
    print(f"{'measurement':<18} {'ref s':>8} {'new s':>8} {'ref x orjson':>13} {'new x orjson':>13} {'new/ref':>8}")
    for label in specs["new"]:
        ref, new = results["ref"][label], results["new"][label]
        ref_s, new_s = median([x["seconds"] for x in ref]), median([x["seconds"] for x in new])
        ref_x = median([x["seconds"] / x["orjson"] for x in ref])
        new_x = median([x["seconds"] / x["orjson"] for x in new])
        times = f"{fmt_s(ref_s):>8} {fmt_s(new_s):>8}"
        print(f"{label:<18} {times} {fmt_x(ref_x):>13} {fmt_x(new_x):>13} {fmt_x(new_s / ref_s):>8}")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        print("RESULT " + json.dumps(worker(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
