"""Time every table of this working tree against a git ref: the regression guard (issue 23).

``REF`` (a commit, branch or tag) is checked out with ``git worktree add`` into a temporary
folder and its C extensions built there (``setup.py build_ext --inplace``); then, round by
round, the same measurements run in fresh processes for the ref and for this tree,
alternating which goes first (the machine is shared and noisy, so only ratios of medians
measured in the same run are compared):

- ``load fresh``: ``tracemagic.load(use_cache=False)`` of the CPU trace, then every table
  (``ops kernels steps layers memory memory_peaks shapes efficiency advice ranks
  diff(self)``) in that order in the same process, each timed (later tables reuse the
  intermediate results earlier ones computed, as in a session);
- ``load cached``: the same reopened from the Arrow cache (each tree its own cache);
- ``gpu``: the GPU trace ``tests/data/traces/hta_control.json.gz``, fresh, with the tables;
- with ``--alone``, each table also in its own process after a cached load, paying for its
  intermediate results itself.

Every timed measurement runs with ``$TRACEMAGIC_TABLE_CACHE=0``, so a tree that keeps tables
in its cache (``trace.cache.TableStore``) computes them as the ref does: the guard compares
the computations. Before the rounds, the outputs are compared (untimed): every table of
each trace (the CPU and the GPU one) from the ref fresh, against the ref reopened from its
cache, this tree fresh, reopened computing, reopened storing its tables and reopened
reading them: ``assert_frame_equal(check_exact=True)``, dtypes, categories' dtypes and
``attrs`` (``benchlib.identical``); any difference is printed and the exit status is 1.

It prints per measurement the medians (s) of both trees and their ratio new/ref (> 1:
this tree is slower; ``!`` marks a ratio over ``--tolerance``), and the peak RSS.
A table the ref lacks is ``-``.

Usage: ``.venv/bin/python bench/bench_tables_vs_ref.py REF [--rounds 3] [--size 10]
[--trace PATH] [--alone] [--tables ops,layers] [--no-gpu] [--json OUT]``; ``--size 100``
uses the ~100 MB trace of ``bench/make_traces.py`` (made under ``bench/out`` on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ALL, GPU_TRACE, ROOT, cpu_trace, fmt_s, fmt_x, identical, interleaved, machine, median, run_worker  # noqa: E402


def checkout(ref: str, where: Path) -> Path:
    """``ref`` checked out (detached) under ``where`` with its C extensions built."""
    tree = where / "ref"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), ref], check=True, capture_output=True)
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True, text=True
    )
    if build.returncode != 0:
        print(f"warning: building {ref}'s C extensions failed; it runs without them:\n{build.stderr[-600:]}", file=sys.stderr)
    return tree


def remove(tree: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)


def place(trace: Path, folder: Path) -> Path:
    """The trace linked into ``folder`` (an old tree writes its cache next to the trace:
    each tree gets its own folder, so neither reads the other's cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / trace.name
    if target.exists():
        return target
    try:
        os.link(trace, target)
    except OSError:
        shutil.copy2(trace, target)
    return target


def measurements(args: argparse.Namespace, tables: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """(label, kind, which trace, tables) of each measurement of a round."""
    found = [("load fresh", "fresh", "cpu", tables), ("load cached", "cached", "cpu", tables)]
    if not args.no_gpu:
        found.append(("gpu fresh", "fresh", "gpu", tables))
    if args.alone:
        found += [(f"{name} alone", "cached", "cpu", [name]) for name in tables]
    return found


def check_outputs(trees: dict[str, Path], where: Path, traces: dict[str, Path], tables: list[str]) -> list[str]:
    """Every table of each trace made every way (see the module doc), compared with the
    ref's fresh ones; the differences found."""
    problems = []
    for which, trace in traces.items():
        dumps: dict[str, Path] = {}
        ways = [
            ("ref fresh", "ref", "fresh", False), ("ref cached", "ref", "cached", False),
            ("new fresh", "new", "fresh", False), ("new cached, computed", "new", "cached", False),
            ("new cached, storing", "new", "cached", True), ("new cached, stored", "new", "cached", True),
        ]
        for label, tree, kind, stored in ways:
            folder = where / f"check-{which}-{tree}"
            dump = where / f"dump-{which}-{label.replace(' ', '_').replace(',', '')}.pickle"
            spec = {"kind": kind, "path": str(place(trace, folder)), "tables": tables, "cache_dir": str(folder / "cache"),
                    "table_cache": stored, "dump": str(dump)}
            if kind == "cached" and not (folder / "cache").exists():
                run_worker({**spec, "tables": [], "dump": None}, trees[tree])
            if run_worker(spec, trees[tree]) is not None:
                dumps[label] = dump
        if "ref fresh" not in dumps:
            return [f"{which}: the ref made no tables"]
        problems += [f"{which}: {p}" for p in identical(dumps)]
        missing = [label for label, *_ in ways if label not in dumps]
        problems += [f"{which}: {label} failed" for label in missing]
        print(f"  {which}: {len(dumps) - 1} ways x {len(tables)} tables compared with the ref's fresh ones", flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="the git ref to compare with (e.g. main, cfc8dfa)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=10, help="the CPU trace of bench/make_traces.py: 10 or 100 (MB)")
    parser.add_argument("--trace", type=Path, help="another CPU trace instead")
    parser.add_argument("--gpu-trace", type=Path, default=GPU_TRACE)
    parser.add_argument("--no-gpu", action="store_true", help="leave the GPU trace out")
    parser.add_argument("--tables", default=",".join(ALL), help="comma-separated, in the order they are asked for")
    parser.add_argument("--alone", action="store_true", help="also time each table in its own process")
    parser.add_argument("--tolerance", type=float, default=1.10, help="ratios above it are marked '!'")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--no-check", action="store_true", help="do not compare the outputs first")
    args = parser.parse_args(argv)
    tables = [t for t in args.tables.split(",") if t]
    unknown = set(tables) - set(ALL)
    if unknown:
        parser.error(f"unknown tables: {', '.join(sorted(unknown))} (known: {', '.join(ALL)})")
    cpu = (args.trace or cpu_trace(args.size)).resolve()
    print(f"machine: {machine()}")
    print(f"CPU trace {cpu.name} ({cpu.stat().st_size / 1e6:.1f} MB); GPU trace {args.gpu_trace.name}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    print(f"new: this working tree ({head}{', with uncommitted changes' if dirty else ''}); ref: {args.ref}")

    with tempfile.TemporaryDirectory(prefix="tm-bench-ref-") as tmp:
        where = Path(tmp)
        print(f"checking out {args.ref} and building its C extensions ...", flush=True)
        trees = {"ref": checkout(args.ref, where), "new": ROOT}
        problems: list[str] = []
        try:
            if not args.no_check:
                print("comparing the outputs (untimed) ...", flush=True)
                gpu = {} if args.no_gpu else {"gpu": args.gpu_trace.resolve()}
                problems = check_outputs(trees, where, {"cpu": cpu, **gpu}, tables)
                print("outputs: " + ("identical" if not problems else f"{len(problems)} DIFFERENCES:"))
                for problem in problems:
                    print(f"  {problem}")
            specs: dict[str, dict[str, dict[str, Any]]] = {}
            for name in trees:
                folder = where / f"data-{name}"
                traces = {"cpu": place(cpu, folder), "gpu": place(args.gpu_trace.resolve(), folder)}
                specs[name] = {
                    label: {"kind": kind, "path": str(traces[which]), "tables": names, "cache_dir": str(folder / "cache"),
                            "table_cache": False}
                    for label, kind, which, names in measurements(args, tables)
                }
                for label, spec in specs[name].items():  # write each tree's caches (not timed)
                    if spec["kind"] == "cached":
                        run_worker({**spec, "tables": []}, trees[name])
                        break
            results = interleaved(specs, trees, args.rounds, run_worker)
        finally:
            remove(trees["ref"])
    report(results, tables, args.tolerance)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if problems:
        print(f"\noutputs: {len(problems)} differences (listed above)")
    return 1 if problems else 0


def _med(runs: list[dict[str, Any]], key: str) -> float:
    if key == "load":
        return median([r["seconds"] for r in runs])
    if key == "total":
        return median([r["seconds"] + sum(v for v in r["tables"].values() if v is not None) for r in runs])
    return median([r["tables"].get(key) for r in runs])


def report(results: dict[str, dict[str, list[dict[str, Any]]]], tables: list[str], tolerance: float) -> None:
    """Per measurement: each table's median in both trees and new/ref."""
    for label, ref_runs in results["ref"].items():
        new_runs = results["new"][label]
        if not ref_runs or not new_runs:
            print(f"\n{label}: no result ({len(ref_runs)} ref runs, {len(new_runs)} new runs)")
            continue
        print(f"\n{label} (median of {min(len(ref_runs), len(new_runs))} rounds, s)")
        print(f"  {'':14s} {'ref':>8s} {'new':>8s} {'new/ref':>8s}")
        keys = (["load"] if not label.endswith(" alone") else []) + [t for t in tables if t in ref_runs[0]["tables"]]
        for key in keys + ["total"]:
            ref, new = _med(ref_runs, key), _med(new_runs, key)
            ratio = new / ref if ref == ref and new == new and ref > 0 else float("nan")
            mark = " !" if ratio == ratio and ratio > tolerance else ""
            print(f"  {key:14s} {fmt_s(ref):>8s} {fmt_s(new):>8s} {fmt_x(ratio):>8s}{mark}")
        ref_peak = max(r["peak_mb"] for r in ref_runs)
        new_peak = max(r["peak_mb"] for r in new_runs)
        print(f"  {'peak RSS MB':14s} {ref_peak:>8.0f} {new_peak:>8.0f} {fmt_x(new_peak / ref_peak):>8s}")


if __name__ == "__main__":
    sys.exit(main())
