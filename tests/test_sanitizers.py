"""The C extensions (``_scan.c`` with the vendored yyjson, ``_nesting.c``) built with
AddressSanitizer and UndefinedBehaviorSanitizer, in a copy of the package in a temporary
folder, then run on untrusted input: every real trace of ``tests/data`` loaded on both C
routes (a gzip'd file streamed on one thread; the same file plain, read by ``scan_file`` on
two threads where it is large enough to be cut) with every table computed, reopened from
the cache, and the fixed-seed fuzz of ``bench/fuzz_load.py`` (mutants of those traces: cut,
flipped, nested thousands deep, numbers beyond 64 bits). An out-of-bounds read or write,
a use after free or undefined behaviour (an overflowing shift, a misaligned load) aborts
the process: the test fails with the sanitizer's report, where the normal build may read
a few bytes too many and go on.

The scanner's own allocator (a pool over one memory map, ``Pool`` in ``_scan.c``) is
poisoned for the sanitizer while a scan uses it, each block made readable as it is taken
and followed by a redzone, so an over-read of yyjson's text or a column in the pool is
caught as one of malloc's memory is.

Skipped where the C compiler has no sanitizer runtime (``libasan``, ``libubsan``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O1 -g"
#: mutants the fuzz runs under the sanitizers (another seed than the plain suite's 300)
MUTANTS = 300

#: loads every real trace on both C routes (the CUDA captures as the folders the magic
#: wrote), computes every table, reopens it from the cache; prints what it loaded (a JSON line)
LOAD_ALL = r"""
import gzip, json, logging, sys, tarfile, tempfile
from pathlib import Path
import tracemagic
from tracemagic.trace import _nesting, _scan, parse, structure

assert parse._scan is _scan and structure._nesting is _nesting  # the C routes, not msgspec's
TABLES = ("steps", "ops", "kernels", "layers", "memory", "memory_peaks", "shapes", "efficiency",
          "advice", "phases")
files = [Path(p) for p in sys.argv[1:]]
seen = {"modules": [_scan.__file__, _nesting.__file__], "loaded": {}}
hits = []  # the loads that read the cache (the loader says so at debug level)
logger = logging.getLogger("tracemagic.trace.loader")
logger.setLevel(logging.DEBUG)
logger.addHandler(logging.Handler())
logger.handlers[-1].emit = lambda record: hits.append("read from the cache" in record.getMessage())
with tempfile.TemporaryDirectory() as tmp:
    for path in files:
        routes = [("stream", path)]
        if path.parent.name == "cuda":  # a capture folder, as the magic writes it
            with tarfile.open(path) as tar:
                tar.extractall(Path(tmp) / path.name, filter="data")
            routes = [("capture", next(p for p in (Path(tmp) / path.name).iterdir() if p.is_dir()))]
        elif path.name.endswith(".json.gz"):  # the same events plain: scan_file, on two threads
            plain = Path(tmp) / path.name[: -len(".gz")]
            plain.write_bytes(gzip.decompress(path.read_bytes()))
            routes.append(("split", plain))
        for route, source in routes:
            for run, cached in enumerate((False, True, True)):  # no cache; a parse that writes it; a reopen
                hits.clear()
                print(path.name, route, run, file=sys.stderr, flush=True)  # (what a report is about)
                trace = tracemagic.load(source, use_cache=cached, cache_dir=Path(tmp) / "cache",
                                        workers=None, progress=False)
                for name in TABLES:
                    getattr(trace, name)()
                trace.ranks()
                trace.diff(trace)
                seen["loaded"][f"{path.name} {route} {run}"] = [len(trace.events), any(hits)]
                del trace
print(json.dumps(seen))
"""


def _runtime(library: str) -> Path | None:
    """The C compiler's ``library`` (e.g. ``libasan.so``), or None where it has none (the
    compiler setuptools builds with: ``$CC``, else Python's)."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    try:
        found = subprocess.run([compiler, f"-print-file-name={library}"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = Path(found.stdout.strip())
    return path if found.returncode == 0 and path.is_absolute() and path.exists() else None


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A copy of the package with its C extensions built under the sanitizers, and the
    environment that runs Python on it (the sanitizers' runtimes preloaded)."""
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("the C compiler has no AddressSanitizer / UBSan runtime (libasan, libubsan)")
    tree = tmp_path_factory.mktemp("sanitized")
    shutil.copytree(ROOT / "tracemagic", tree / "tracemagic", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(ROOT / "vendor", tree / "vendor")
    shutil.copy(ROOT / "setup.py", tree)
    (tree / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "fuzz_load.py", tree / "bench")  # (it reads the traces next to it)
    (tree / "tests").mkdir()
    (tree / "tests" / "data").symlink_to(DATA)
    build_env = {**os.environ, "CFLAGS": FLAGS, "LDFLAGS": "-fsanitize=address,undefined"}
    build_env.pop("TRACEMAGIC_NO_C", None)
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace", "-j", "2"],
        cwd=tree, env=build_env, capture_output=True, text=True, timeout=900,
    )
    # (both extensions are optional: a failed compile still exits 0, and the pure Python
    # route would run instead, proving nothing)
    made = [next((tree / "tracemagic" / "trace").glob(f"{name}.*.so"), None) for name in ("_scan", "_nesting")]
    assert built.returncode == 0 and all(made), built.stderr[-3000:]
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "LD_PRELOAD": f"{asan} {ubsan}",  # (Python itself is not built with them)
        # allocator_may_return_null: a huge allocation a hostile trace asks for is a
        # MemoryError, as without the sanitizer, not the sanitizer's abort
        "ASAN_OPTIONS": f"detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:log_path={tree / 'report'}",
        "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=1:log_path={tree / 'report'}",
        "TRACEMAGIC_CACHE_DIR": str(tree / "cache"),
    }
    return tree, env


def reports(tree: Path) -> str:
    """The sanitizers' reports (``log_path``: one file a process that found something), their heads."""
    return "\n\n".join(report.read_text(errors="replace")[:4000] for report in sorted(tree.glob("report.*")))


def finished(command: list[str], tree: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end in ``tree`` (``-c`` puts the working folder first on the
    path); past ``timeout`` its whole session is stopped (SIGTERM: the fuzz then kills its
    workers, then SIGKILL) and the test fails with what the sanitizers and the command said."""
    process = subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # (it may end just now)
            os.killpg(process.pid, signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        pytest.fail(f"no answer in {timeout:.0f} s\n{reports(tree)}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_the_extensions_are_built_with_the_sanitizers_and_pool_poisoning(
    sanitized: tuple[Path, dict[str, str]],
) -> None:
    tree, _ = sanitized
    scan, nesting = (next((tree / "tracemagic" / "trace").glob(f"{name}.*.so")) for name in ("_scan", "_nesting"))
    for built in (scan, nesting):
        assert b"__asan_report_load" in built.read_bytes() and b"__ubsan_handle" in built.read_bytes(), built
    assert b"__asan_poison_memory_region" in scan.read_bytes()  # the pool's blocks, see the module doc


def test_every_real_trace_loads_on_both_c_routes_with_every_table_under_the_sanitizers(
    sanitized: tuple[Path, dict[str, str]],
) -> None:
    tree, env = sanitized
    files = sorted((DATA / "traces").glob("*.json.gz")) + sorted((DATA / "traces").glob("*.tar.gz"))
    files += sorted((DATA / "cuda").glob("*.tar.gz"))
    files = [f for f in files if not f.name.endswith("_et.json.gz")]  # (an Execution Trace, not Kineto)
    done = finished([sys.executable, "-c", LOAD_ALL, *map(str, files)], tree, env, timeout=1200)
    assert done.returncode == 0, reports(tree) + done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(Path(m).is_relative_to(tree) for m in seen["modules"]), seen["modules"]  # the sanitized build ran
    loaded = seen["loaded"]
    routes = {key.rsplit(" ", 1)[0] for key in loaded}
    assert len(routes) > len(files) and len(loaded) == 3 * len(routes), sorted(loaded)  # some files split too
    for route in routes:  # events on each load; the third read the cache the second wrote
        assert [loaded[f"{route} {run}"] for run in range(3)] == [[loaded[f"{route} 0"][0], hit] for hit in (0, 0, 1)]
    assert all(events > 0 for events, _ in loaded.values())


def test_the_fuzz_finds_nothing_under_the_sanitizers(sanitized: tuple[Path, dict[str, str]]) -> None:
    tree, env = sanitized
    command = [sys.executable, str(tree / "bench" / "fuzz_load.py"), "--json", "--jobs", "2", "--mutants", str(MUTANTS),
               "--seed", "23", "--batch", "40", "--timeout", "300"]
    done = finished(command, tree, env, timeout=1500)
    assert done.stdout.strip(), done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert not summary["failures"], reports(tree) + "\n\n".join(
        f"mutant {f['i']} ({f.get('file')}): {f['outcome']} (rerun: PYTHONPATH=<a sanitized build> "
        f"bench/fuzz_load.py --seed 23 --only {f['i']})\n{f.get('detail')}"
        for f in summary["failures"][:5]
    )
    assert summary["mutants"] == MUTANTS and summary["counts"].get("ok", 0) > MUTANTS // 5, summary["counts"]
