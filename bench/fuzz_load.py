"""Fuzz ``tracemagic.load``: mutants of the real traces, on the C and the pure Python path.

Each mutant is a small real trace (``tests/data/traces``, whole or a slice of a few hundred
events of a large one) changed by one to three mutations: bytes flipped, inserted, deleted
or cut off; numbers beyond int64/float64; invalid UTF-8; nesting thousands of levels deep;
odd ``ProfilerStep#`` names; fields dropped or given values of the wrong type; hostile
metadata; then written as ``.json``, ``.json.gz`` (sometimes with the gzip bytes damaged) or
a ``.tar.gz``. Every mutant is loaded twice, with the C scanner and nesting and without
them, and on each loaded trace the main tables are computed (``steps``, ``ops``,
``kernels``, ``layers``, ``memory``, ``shapes``).

Outcomes, per mutant: ``ok`` (both paths loaded it and gave the same events, flows,
metadata and tables), ``trace_error`` (both raised ``TraceError`` with the same message,
naming the file), or a failure: ``crash`` (the process died on a signal), ``hang`` (no answer
within ``--timeout`` seconds), ``exception`` (any other exception, on either path),
``unnamed`` (a ``TraceError`` that does not name the file) or ``mismatch`` (the two paths
disagree). Mutants run in batches in worker processes; a worker that dies or stops
answering is replaced and the mutant it was on is recorded.

Usage: ``.venv/bin/python bench/fuzz_load.py [--mutants 10000] [--seed 0] [--jobs 2]
[--batch 100] [--json]`` prints the counts by outcome (and the failures, reproducible
with ``--only N``, written to a folder with ``--save DIR --only N``); exit status 1 when any
failure was found. Two of three mutants are loaded on two threads on the C path, each cut
into 3-14 stretches (``trace.split``: the inner ones of a plain file read by ``scan_file``),
and compared with the one-thread pure Python parse, warnings included (``--no-split``: all
on one thread).
``TRACEMAGIC_FUZZ_CRASH_AT=N`` / ``TRACEMAGIC_FUZZ_HANG_AT=N`` make the worker die or stall
at mutant N (``tests/test_fuzz.py`` checks the harness reports them).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data" / "traces"
#: small real traces used whole
WHOLE = (
    "hta_triton_example.json.gz",
    "hta_benchmark_simple_add_trace.json.gz",
    "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz",
)
#: large real traces sliced into windows of events (their metadata kept)
SLICED = (
    "tracelens_normalization_layer_test.json.gz",
    "kineto_worker0.1623143089861.pt.trace.json.gz",
    "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "hta_nccl_data.json.gz",
    "hta_control.json.gz",
)
WINDOW = 300
FAILURES = ("crash", "hang", "exception", "unnamed", "mismatch")
TABLES = ("steps", "ops", "kernels", "layers", "memory", "shapes")

HOSTILE_NUMBERS = (
    b"18446744073709551616", b"1e400", b"-1e400", b"-9223372036854775809", b"9223372036854775808",
    b"99999999999999999999999999999", b"1.7976931348623157e308", b"-0", b"1.5", b"0", b"-1",
    b"4294967296", b"2147483648", b"1e-400", b"123456789012345678901234567890.5",
    b"1" + b"0" * 399, b"-" + b"9" * 400,  # integers beyond float64 as well
)
HOSTILE_STRINGS = (
    b'"ProfilerStep#abc"', b'"ProfilerStep#"', b'"ProfilerStep#99999999999999999999"', b'"ProfilerStep#-1"',
    b'""', b'"\xff\xfe"', b'"\xc3"', b'"\\ud800"', b'"\\u0000"', b'"nn.Module: "', b'"[memory]"',
    b'"0x"', b'"0xfffffffffffffffffffff"', b'"stream 99999999999999999999999"', b'"\xed\xa0\x80"',
)
ODD_VALUES = (b"null", b"true", b"false", b"[]", b"{}", b'"x"', b"[1, 2]", b'{"a": 1}', b"-1", b"0")
FIELDS = ("ph", "cat", "name", "pid", "tid", "ts", "dur", "id", "args")
ARG_KEYS = (
    "External id", "correlation", "device", "stream", "Sequence number", "Fwd thread id", "Input Dims",
    "Input type", "Concrete Inputs", "Bytes", "Total Allocated", "Total Reserved", "Device Id", "Addr",
    "flops", "Collective name", "Process Group Ranks", "grid", "block", "Record function id", "Python id",
    "Python parent id", "name", "labels",
)
_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


# -- seeds -------------------------------------------------------------------------------------


def _raw(name: str) -> bytes:
    return gzip.decompress((TRACES / name).read_bytes())


def make_seeds(folder: Path) -> list[Path]:
    """The seed traces as plain JSON files in ``folder`` (the small traces, slices of the large)."""
    seeds = []
    for name in WHOLE:
        path = folder / f"seed_{len(seeds)}.json"
        path.write_bytes(_raw(name))
        seeds.append(path)
    rng = random.Random(1234)
    for name in SLICED:
        doc = json.loads(_raw(name))
        events = doc.pop("traceEvents")
        names = [e for e in events if e.get("ph") == "M"]
        timed = [e for e in events if e.get("ph") != "M"]
        for start in (0, rng.randrange(len(timed) - WINDOW)):
            window = names + timed[start : start + WINDOW]
            path = folder / f"seed_{len(seeds)}.json"
            path.write_text(json.dumps({**doc, "traceEvents": window}, ensure_ascii=False))
            seeds.append(path)
    return seeds


# -- mutations ---------------------------------------------------------------------------------


def _spot(rng: random.Random, data: bytes) -> int:
    return rng.randrange(max(1, len(data)))


def _replace_token(rng: random.Random, data: bytes, pattern: re.Pattern[bytes], values: tuple[bytes, ...]) -> bytes:
    start = _spot(rng, data)
    match = pattern.search(data, start) or pattern.search(data)
    if match is None:
        return data
    return data[: match.start()] + rng.choice(values) + data[match.end() :]


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice((500, 1100, 3000, 20000))
    if rng.random() < 0.5:
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def _byte_mutation(rng: random.Random, data: bytes) -> bytes:
    """One mutation of the JSON text."""
    kind = rng.randrange(11)
    at = _spot(rng, data)
    if kind == 0:  # flip bytes
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[_spot(rng, out)] = rng.randrange(256)
        return bytes(out)
    if kind == 1:  # insert random bytes
        return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[at:]
    if kind == 2:  # delete a range
        return data[:at] + data[at + rng.randint(1, 200) :]
    if kind == 3:  # cut off
        return data[:at]
    if kind == 4:  # duplicate a range
        end = min(len(data), at + rng.randint(1, 2000))
        return data[:end] + data[at:end] + data[end:]
    if kind == 5:
        return _replace_token(rng, data, _NUMBER, HOSTILE_NUMBERS)
    if kind == 6:
        return _replace_token(rng, data, _STRING, HOSTILE_STRINGS)
    if kind == 7:  # a value nested thousands of levels deep
        return _replace_token(rng, data, rng.choice((_NUMBER, _STRING)), (_deep(rng),))
    if kind == 8:
        return _replace_token(rng, data, rng.choice((_NUMBER, _STRING)), ODD_VALUES)
    if kind == 9:  # invalid UTF-8 inside a string
        match = _STRING.search(data, at) or _STRING.search(data)
        if match is None:
            return data
        cut = rng.randint(match.start() + 1, match.end() - 1)
        return data[:cut] + rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf4\x90\x80\x80")) + data[cut:]
    # kind 10: whitespace, control characters or a BOM somewhere
    return data[:at] + rng.choice((b"\x00", b"\t\n", b"\xef\xbb\xbf", b"\x1f\x8b", b"\\")) + data[at:]


def _hostile_value(rng: random.Random) -> Any:
    choice = rng.randrange(10)
    if choice == 0:
        return rng.choice((2**64, 10**399))  # beyond int64, beyond float64
    if choice == 1:
        return -(2**63) - 1
    if choice == 2:
        return rng.choice((1e308, -1e308, 5e-324))
    if choice == 3:
        return rng.choice(("ProfilerStep#abc", "ProfilerStep#", "ProfilerStep#99999999999999999999", "ProfilerStep#7"))
    if choice == 4:
        return rng.choice((None, True, False, "", "x", "0x", "12abc"))
    if choice == 5:
        return rng.choice(([], {}, [1, [2, [3]]], {"a": {"b": 1}}))
    if choice == 6:
        return rng.choice((0, -1, 1, 2**31, 2**53 + 1))
    if choice == 7:
        return rng.random() * 10**rng.randint(0, 20)
    if choice == 8:
        return rng.choice(("nn.Module: ", "nn.Module: X_0", "[memory]", "cuda_runtime", "kernel", "cpu_op"))
    return "x" * rng.randint(0, 300)


def _args(event: dict[str, Any]) -> dict[str, Any]:
    """The event's args, made an object if they are not one."""
    if not isinstance(event.get("args"), dict):
        event["args"] = {}
    return event["args"]


def _event_mutation(rng: random.Random, doc: dict[str, Any]) -> None:
    """One mutation of the decoded trace (events or metadata)."""
    events = doc.get("traceEvents")
    if not isinstance(events, list) or not events:
        return
    kind = rng.randrange(9)
    picked = [e for e in rng.sample(events, min(len(events), rng.randint(1, 20))) if isinstance(e, dict)]
    if kind == 0:  # drop fields
        field = rng.choice(FIELDS)
        for event in picked if rng.random() < 0.7 else events:
            if isinstance(event, dict):
                event.pop(field, None)
    elif kind == 1:  # hostile field values
        field = rng.choice(FIELDS)
        for event in picked:
            event[field] = _hostile_value(rng)
    elif kind == 2:  # hostile args values
        key = rng.choice(ARG_KEYS)
        for event in picked:
            _args(event)[key] = _hostile_value(rng)
    elif kind == 3:  # odd phases
        for event in picked:
            event["ph"] = rng.choice(("X", "i", "I", "s", "f", "t", "M", "B", "E", "C", "b", "e", "", "XX"))
    elif kind == 4:  # hostile metadata
        key = rng.choice(("distributedInfo", "deviceProperties", "displayTimeUnit", "schemaVersion", "baseTimeNanoseconds"))
        value = rng.choice((
            {"rank": _hostile_value(rng), "world_size": _hostile_value(rng)},
            [{"id": _hostile_value(rng), "name": _hostile_value(rng), "totalGlobalMem": _hostile_value(rng)}],
            _hostile_value(rng),
            "{'rank': %d}" % rng.randint(-5, 10**20),
        ))
        doc[key] = value
    elif kind == 5:  # duplicate, shuffle or drop events
        if rng.random() < 0.4:
            events.extend(picked)
        elif rng.random() < 0.5:
            rng.shuffle(events)
        else:
            del events[rng.randrange(len(events)) :]
    elif kind == 6:  # GPU events alone, or no pid/tid anywhere
        if rng.random() < 0.5:
            doc["traceEvents"] = [e for e in events if isinstance(e, dict) and e.get("cat") in ("kernel", "Kernel")][:3]
        for event in doc["traceEvents"]:
            if isinstance(event, dict):
                event.pop(rng.choice(("pid", "tid")), None)
    elif kind == 7:  # step names and sequence numbers on events without times
        for event in picked:
            event["name"] = rng.choice(("ProfilerStep#abc", "ProfilerStep#", "ProfilerStep#99999999999999999999", "ProfilerStep#1"))
            event["cat"] = rng.choice(("cpu_op", "user_annotation"))
            if rng.random() < 0.5:
                event.pop("ts", None)
                _args(event)["Sequence number"] = rng.randint(0, 5)
    else:  # nested events: children that end after their parents, zero durations
        for event in picked:
            if "dur" in event:
                event["dur"] = rng.choice((0, -5, 1e12, event.get("dur")))


def mutant(seeds: list[Path], seed: int, index: int) -> tuple[str, bytes]:
    """Mutant ``index`` of run ``seed``: a file name (telling its format) and its bytes."""
    rng = random.Random(f"{seed}:{index}")
    data = seeds[rng.randrange(len(seeds))].read_bytes()
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if rng.random() < 0.45:
            try:
                doc = json.loads(data)
            except (ValueError, RecursionError):
                doc = None
            if isinstance(doc, dict):
                _event_mutation(rng, doc)
                try:
                    data = json.dumps(doc, ensure_ascii=rng.random() < 0.3).encode("utf-8", "surrogatepass")
                except (ValueError, RecursionError):
                    pass
                continue
        data = _byte_mutation(rng, data)
    form = rng.random()
    if form < 0.55:
        return "mutant.json", data
    if form < 0.9:
        packed = gzip.compress(data, compresslevel=1)
        if rng.random() < 0.3:  # damage the compressed stream
            packed = _byte_mutation(rng, packed) if rng.random() < 0.5 else packed[: _spot(rng, packed)]
        return "mutant.json.gz", packed
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for rank in range(rng.randint(1, 3)):
            info = tarfile.TarInfo(f"run/worker{rank}.pt.trace.json")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    packed = buffer.getvalue()
    if rng.random() < 0.2:
        packed = packed[: _spot(rng, packed)]
    return "mutant.tar.gz", packed


# -- the worker --------------------------------------------------------------------------------


def _load(path: Path, c_path: bool, workers: int | None = 1) -> tuple[str, Any]:
    """(outcome, detail) of loading ``path`` and computing the tables on one path
    (``workers=None``: on two threads, where ``trace.split`` takes the file)."""
    import tracemagic
    from tracemagic.trace import parse, structure

    saved = parse._scan, structure._nesting
    if not c_path:
        parse._scan, structure._nesting = None, None
    try:
        trace = tracemagic.load(path, use_cache=False, workers=workers, progress=False)
        tables = [getattr(trace, name)() for name in TABLES]
    except tracemagic.TraceError as exc:
        if str(path) not in str(exc):
            return "unnamed", str(exc)[:300]
        return "trace_error", str(exc)
    except Exception as exc:  # noqa: BLE001 - what the fuzz is looking for
        return "exception", "".join(traceback.format_exception(exc)[-8:])[-2500:]
    finally:
        parse._scan, structure._nesting = saved
    return "ok", (trace, tables)


def _same(a: Any, b: Any) -> str | None:
    """Why the two paths' traces differ, or None."""
    import pandas as pd

    trace_a, tables_a = a
    trace_b, tables_b = b
    try:
        pd.testing.assert_frame_equal(trace_a.events, trace_b.events)
        pd.testing.assert_frame_equal(trace_a.flows, trace_b.flows)
        for name, x, y in zip(TABLES, tables_a, tables_b):
            pd.testing.assert_frame_equal(x, y, obj=name)
    except AssertionError as exc:
        return str(exc)[:800]
    if repr(trace_a.meta) != repr(trace_b.meta):
        return f"meta differs: {trace_a.meta!r:.300} != {trace_b.meta!r:.300}"
    return None


def run_one(seeds: list[Path], seed: int, index: int, folder: Path) -> dict[str, Any]:
    """Load mutant ``index`` both ways; its outcome."""
    import tracemagic.trace.parse as parse
    import tracemagic.trace.split as split

    rng = random.Random(f"chunk:{seed}:{index}")
    parse.CHUNK_BYTES = rng.choice((2 << 20, 2 << 20, 4096, 1024))  # small chunks: many cuts
    name, data = mutant(seeds, seed, index)
    # two of three mutants parsed on two threads on the C path (the small files cut into
    # 3-14 stretches: a plain file's inner ones scanned by scan_file); not with --no-split
    two_threads = os.environ.get("TRACEMAGIC_FUZZ_SPLIT", "1") == "1" and rng.random() < 2 / 3
    if two_threads:
        split.SPLIT_MIN_BYTES = 0
        split.STRETCH_BYTES = max(1, len(data) // rng.choice((3, 6, 12)))
        split.EDGE_BYTES = rng.choice((1 << 20, 256, 4096))
    work = folder / f"m{index}"
    work.mkdir()
    path = work / name
    path.write_bytes(data)
    fast = _load(path, True, None if two_threads else 1)
    slow = _load(path, False)
    result: dict[str, Any] = {"i": index, "file": name, "size": len(data)}
    for outcome in ("exception", "unnamed"):
        for label, (got, detail) in (("C", fast), ("Python", slow)):
            if got == outcome:
                result.update(outcome=outcome, path=label, detail=detail)
                return result
    if fast[0] != slow[0]:
        result.update(outcome="mismatch", detail=f"C: {fast[0]} {str(fast[1])[:400]} | Python: {slow[0]} {str(slow[1])[:400]}")
    elif fast[0] == "trace_error":
        same = fast[1] == slow[1]
        result.update(outcome="trace_error" if same else "mismatch", detail=fast[1][:300] if same else f"C: {fast[1]} | Python: {slow[1]}")
    else:
        why = _same(fast[1], slow[1])
        result.update(outcome="ok" if why is None else "mismatch", detail=why)
    for child in work.iterdir():
        child.unlink()
    work.rmdir()
    return result


def worker(seed_dir: Path, seed: int, indices: list[int]) -> None:
    """Run mutants, printing ``start N`` before and a JSON line after each."""
    import warnings

    warnings.simplefilter("ignore")
    seeds = sorted(seed_dir.glob("seed_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    # the harness's own check (tests/test_fuzz.py): die or stall on purpose at one mutant
    crash_at = int(os.environ.get("TRACEMAGIC_FUZZ_CRASH_AT", -1))
    hang_at = int(os.environ.get("TRACEMAGIC_FUZZ_HANG_AT", -1))
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        for index in indices:
            print(f"start {index}", flush=True)
            if index == crash_at:
                os.kill(os.getpid(), signal.SIGSEGV)
            if index == hang_at:
                time.sleep(3600)
            print(json.dumps(run_one(seeds, seed, index, Path(tmp))), flush=True)


# -- the harness -------------------------------------------------------------------------------


class _Batch:
    """A worker process on some mutants, read line by line."""

    def __init__(self, seed_dir: Path, seed: int, indices: list[int]) -> None:
        self.pending = list(indices)
        self.current: int | None = None
        self.buffer = b""
        self.since = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, __file__, "--worker", str(seed_dir), "--seed", str(seed), "--indices", ",".join(map(str, indices))]
        self.stderr = tempfile.TemporaryFile()  # a pipe could fill up and stall the worker
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.stderr, env=env, start_new_session=True)

    def lines(self) -> list[str] | None:
        """The complete lines read now; None at the end of the output."""
        chunk = os.read(self.process.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *done, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in done]


def _stop(b: _Batch) -> None:
    """Kill a worker with its session (it runs in one of its own)."""
    try:
        os.killpg(b.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    b.process.wait()


def run(mutants: int, seed: int, jobs: int, batch: int, timeout: float, only: list[int] | None = None) -> list[dict[str, Any]]:
    """Every mutant's outcome (see the module docstring)."""
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fuzz-seeds-") as tmp:
        seed_dir = Path(tmp)
        make_seeds(seed_dir)
        todo = list(only) if only is not None else list(range(mutants))
        queue = [todo[i : i + batch] for i in range(0, len(todo), batch)]
        running: list[_Batch] = []
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    running.append(_Batch(seed_dir, seed, queue.pop(0)))
                ready, _, _ = select.select([b.process.stdout for b in running], [], [], 1.0)
                for b in list(running):
                    if b.process.stdout in ready:
                        lines = b.lines()
                        for line in lines or []:
                            if line.startswith("start "):
                                b.current = int(line.split()[1])
                                b.since = time.monotonic()
                            elif line.startswith("{"):
                                result = json.loads(line)
                                results.append(result)
                                b.pending.remove(result["i"])
                                b.current = None
                        if lines is not None:
                            continue
                        code = b.process.wait()
                        b.stderr.seek(0)
                        stderr = b.stderr.read().decode(errors="replace")
                        if b.pending:  # it died before answering for these
                            lost = b.current if b.current is not None else b.pending[0]
                            outcome = "crash" if code < 0 else "exception"
                            results.append({"i": lost, "outcome": outcome, "detail": f"worker exit {code}: {stderr[-1500:]}"})
                            b.pending.remove(lost)
                            if b.pending:
                                queue.insert(0, b.pending)
                        running.remove(b)
                    elif b.current is not None and time.monotonic() - b.since > timeout:
                        _stop(b)
                        results.append({"i": b.current, "outcome": "hang", "detail": f"no answer in {timeout:.0f} s"})
                        b.pending.remove(b.current)
                        if b.pending:
                            queue.insert(0, b.pending)
                        running.remove(b)
        finally:  # stopped early (an error, Ctrl-C, a caller's SIGTERM): no worker outlives the run
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (not cut short by a second SIGTERM)
            for b in running:
                _stop(b)
    return sorted(results, key=lambda r: r["i"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one mutant may take (both paths)")
    parser.add_argument("--only", default=None, help="comma-separated mutant numbers to rerun")
    parser.add_argument(
        "--split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load two of three mutants on two threads (cut into 3-14 stretches) on the C path "
        "(the default; --no-split: all on one thread)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (counts and failures)")
    parser.add_argument("--save", default=None, help="write mutant N's file here (with --only N) and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--indices", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:  # the workers (subprocesses) read it
        os.environ["TRACEMAGIC_FUZZ_SPLIT"] = "1" if args.split else "0"
    if args.worker:
        worker(Path(args.worker), args.seed, [int(i) for i in args.indices.split(",") if i])
        return 0
    only = [int(i) for i in args.only.split(",")] if args.only else None
    if args.save:
        with tempfile.TemporaryDirectory() as tmp:
            seeds = make_seeds(Path(tmp))
            name, data = mutant(seeds, args.seed, only[0])
            target = Path(args.save) / name
            target.write_bytes(data)
            print(target)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (``run`` then stops its workers)
    started = time.monotonic()
    results = run(args.mutants, args.seed, args.jobs, args.batch, args.timeout, only)
    counts = Counter(r["outcome"] for r in results)
    failures = [r for r in results if r["outcome"] in FAILURES]
    summary = {
        "mutants": len(results),
        "seed": args.seed,
        "split": args.split,
        "seconds": round(time.monotonic() - started, 1),
        "counts": dict(sorted(counts.items())),
        "by_format": {
            form: dict(Counter(r["outcome"] for r in results if r.get("file") == f"mutant.{form}"))
            for form in ("json", "json.gz", "tar.gz")
        },
        "failures": failures,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        split = " (two of three on two threads)" if args.split else ""
        print(
            f"{len(results)} mutants (seed {args.seed}) in {summary['seconds']} s, "
            f"each on the C{split} and the Python path"
        )
        for outcome in ("ok", "trace_error", *FAILURES):
            print(f"  {outcome:12} {counts.get(outcome, 0)}")
        for failure in failures[:50]:
            print(f"\n#{failure['i']} {failure['outcome']} {failure.get('path', '')}: {failure.get('detail')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
