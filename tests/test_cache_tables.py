"""Analysis tables kept in a trace's cache (``trace.cache.TableStore``): reopening a trace
gives them without computing them again, exactly as computed, and never a stale, damaged
or forged one."""

from __future__ import annotations

import functools
import json
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pytest

import tracemagic
from tracemagic.analysis import layers as layers_module
from tracemagic.analysis import memory as memory_module
from tracemagic.analysis import ops as ops_module
from tracemagic.trace import cache

TRACES = Path(__file__).parent / "data" / "traces"
GPU_TRACE = TRACES / "hta_control.json.gz"
#: every table the store keeps, by the facade call that asks for it
CALLS: dict[str, Callable[[Any], pd.DataFrame]] = {
    "ops.ops": lambda t: t.ops(),
    "kernels.kernels": lambda t: t.kernels(),
    "steps.steps": lambda t: t.steps(),
    "layers.layers": lambda t: t.layers(),
    "memory.memory": lambda t: t.memory(),
    "memory.peaks": lambda t: t.memory_peaks(),
    "shapes.shapes": lambda t: t.shapes(),
    "efficiency.efficiency": lambda t: t.efficiency(),
    "phases.phases": lambda t: t.phases(),
    "ranks.ranks": lambda t: t.ranks(),
}


def identical(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """The same frame: values, dtypes (categories' too), column names and attrs."""
    pd.testing.assert_frame_equal(got, want, check_exact=True, check_categorical=True)
    for column in want.columns:
        assert got[column].dtype == want[column].dtype, column
        if isinstance(want[column].dtype, pd.CategoricalDtype):
            assert got[column].cat.categories.dtype == want[column].cat.categories.dtype, column
    assert repr(got.attrs) == repr(want.attrs)


def stored(folder: Path) -> set[str]:
    return {p.name.split(cache.TABLE_INFIX, 1)[1].removesuffix(cache.SEAL_SUFFIX) for p in folder.glob(f"*{cache.TABLE_INFIX}*.seal")}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the calls of ops(), layers() and memory() (the facade looks them up on their modules)."""
    calls: Counter[str] = Counter()
    for module, name in ((ops_module, "ops"), (layers_module, "layers"), (memory_module, "memory")):
        real = getattr(module, name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, functools.wraps(real)(counting))
    return calls


@pytest.mark.parametrize("name", ["hta_control.json.gz", "tracelens_normalization_layer_test.json.gz"])
def test_reopened_tables_are_the_computed_ones(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.NO_TABLES_ENV, "0")
    plain = tracemagic.load(TRACES / name, use_cache=False)
    want = {key: call(plain) for key, call in CALLS.items()}
    monkeypatch.delenv(cache.NO_TABLES_ENV)
    first = tracemagic.load(TRACES / name, cache_dir=tmp_path)
    for key, call in CALLS.items():
        identical(call(first), want[key])
    first.store.flush()  # else written as the process ends
    assert stored(tmp_path) == set(CALLS)
    again = tracemagic.load(TRACES / name, cache_dir=tmp_path)
    for key, call in CALLS.items():
        identical(call(again), want[key])
        table = call(again)
        if len(table):  # each call's copy is the caller's to change
            table.iloc[0, 0] = table.iloc[-1, 0]
    for key, call in CALLS.items():
        identical(call(again), want[key])


def test_a_reopened_trace_reads_its_tables_instead_of_computing_them(tmp_path: Path, counted: Counter[str]) -> None:
    first = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    first.ops(), first.layers(), first.memory()
    first.store.flush()
    assert counted == {"ops": 1, "layers": 1, "memory": 1}
    again = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    again.ops(), again.layers(), again.memory(), again.memory_peaks()
    assert counted == {"ops": 1, "layers": 1, "memory": 1}, "memory_peaks read, not made from memory()"
    again.layers(0)  # with an argument: computed, never stored
    assert counted["layers"] == 2 and "layers.layers" in stored(tmp_path)


def test_no_stored_tables_when_turned_off_or_for_a_trace_given_other_events(
    tmp_path: Path, counted: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.NO_TABLES_ENV, "0")
    off = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    off.ops()
    assert off.store is None and stored(tmp_path) == set()
    monkeypatch.delenv(cache.NO_TABLES_ENV)
    on = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    on.ops()
    on.store.flush()
    assert stored(tmp_path) == {"ops.ops"} and counted["ops"] == 2
    trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    trace.events = trace.events.assign(dur=trace.events["dur"] * 2)
    doubled = trace.ops()["dur"].to_numpy()
    assert (doubled == 2 * tracemagic.load(GPU_TRACE, cache_dir=tmp_path).ops()["dur"].to_numpy()).all()
    assert counted["ops"] == 3


def _seal_body(path: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(path.read_bytes().partition(b"\n")[2])
    return body


def _write_seal(path: Path, body: dict[str, Any]) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    path.write_bytes(f"{zlib.crc32(raw):08x}\n".encode() + raw)


def test_stale_damaged_or_forged_tables_are_computed_again(
    tmp_path: Path, counted: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def reopened() -> pd.DataFrame:
        trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
        table = trace.ops()
        trace.store.flush()
        return table

    want = reopened()
    (seal,) = tmp_path.glob("*.t.ops.ops.seal")
    data = seal.with_name(seal.name.replace(".seal", ".arrow"))
    assert counted["ops"] == 1

    # another tracemagic (or numpy/pandas/pyarrow) version: computed again, and stored for it
    with monkeypatch.context() as patched:
        patched.setattr(cache, "code_version", lambda: "another version")
        identical(reopened(), want)
        assert counted["ops"] == 2
        identical(reopened(), want)
        assert counted["ops"] == 2
    identical(reopened(), want)  # back to this version: its table was replaced, so computed again
    assert counted["ops"] == 3
    # a byte of the table changed: its checksum differs
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    identical(reopened(), want)
    assert counted["ops"] == 4
    # a seal forged to match a hostile layout (a column said to be of another kind, or a
    # dtype outside the list): rebuilt tables are refused, never a crash nor a wrong table
    for forge in (
        lambda layout: layout["columns"][0].update(kind="numpy", dtype="float64"),
        lambda layout: layout["columns"][0].update(kind="object"),
        lambda layout: layout.update(names="datetime64[ns]"),
        lambda layout: layout.update(attrs={"dict": [[{"dict": []}, 1]]}),
        lambda layout: layout.update(attrs={"tuple": [{"tuple": []}] * 3, "dict": 1}),
        lambda layout: layout["columns"][1].update(kind="category", categories="str"),
        lambda layout: layout["columns"].pop(),
    ):
        body = _seal_body(seal)
        forge(body["layout"])
        _write_seal(seal, body)
        before = counted["ops"]
        identical(reopened(), want)
        assert counted["ops"] == before + 1
    # a table file forged whole, its seal made to match: a categorical column whose codes
    # are unsigned, one of them missing (-1 fits no unsigned code): refused, not an OverflowError
    import pyarrow as pa

    body = _seal_body(seal)
    table = pa.ipc.open_file(pa.BufferReader(data.read_bytes())).read_all()
    name = next(spec["name"] for spec in body["layout"]["columns"] if spec["kind"] == "category")
    dictionary = table[name].combine_chunks().dictionary
    codes = pa.array([None] + [0] * (table.num_rows - 1), pa.uint8())
    forged_column = pa.DictionaryArray.from_arrays(codes, dictionary)
    table = table.set_column(table.schema.get_field_index(name), name, forged_column)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    forged = sink.getvalue().to_pybytes()
    data.write_bytes(forged)
    body["table"] = {"bytes": len(forged), "sum": cache.checksum(forged)}
    _write_seal(seal, body)
    before = counted["ops"]
    identical(reopened(), want)
    assert counted["ops"] == before + 1
    # a seal of JSON nested too deep to read
    raw = b'{"layout":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    seal.write_bytes(f"{zlib.crc32(raw):08x}\n".encode() + raw)
    before = counted["ops"]
    identical(reopened(), want)
    assert counted["ops"] == before + 1
    # the trace parsed again (a new events file): its tables go with the old one
    trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    assert trace.store is not None
    for path in tmp_path.glob("*.seal"):
        if cache.TABLE_INFIX not in path.name:
            path.unlink()  # the events' seal: the next load parses and writes a new entry
    tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    assert stored(tmp_path) == set()


def test_a_capture_manifest_edited_after_the_tables_were_stored(tmp_path: Path, counted: Counter[str]) -> None:
    """Layer names come from the manifest: another manifest means the tables are made again."""
    folder = tmp_path / "capture"
    folder.mkdir()
    trace_file = folder / "kineto_trace_0.json.gz"
    trace_file.write_bytes((TRACES / "tracelens_normalization_layer_test.json.gz").read_bytes())
    (folder / "capture.json").write_text(json.dumps({
        "versions": {"tracemagic": tracemagic.__version__},
        "files": [{"path": trace_file.name, "kind": "kineto", "rank": 0}],
    }))
    trace = tracemagic.load(folder)
    before = trace.layers()
    trace.store.flush()
    assert counted["layers"] == 1 and (folder / cache.CAPTURE_FOLDER).is_dir()
    again = tracemagic.load(folder)
    again.layers()
    again.store.flush()
    assert counted["layers"] == 1
    layer = str(before["layer"].iloc[0])  # Net_0: no manifest names it yet
    manifest = json.loads((folder / "capture.json").read_text())
    manifest["modules"] = {f"nn.Module: {layer}": {"path": "renamed.path", "type": "Renamed"}}
    (folder / "capture.json").write_text(json.dumps(manifest))
    after = tracemagic.load(folder).layers()
    assert counted["layers"] == 2
    assert "renamed.path" in set(after["layer"]) and layer not in set(after["layer"])


def test_stored_tables_belong_to_their_cache_entry(tmp_path: Path) -> None:
    trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    trace.ops(), trace.steps()
    trace.store.flush()
    (entry,) = cache.entries(tmp_path)
    assert {p.name.split(".", 1)[1] for p in entry.files} >= {"t.ops.ops.arrow", "t.ops.ops.seal", "t.steps.steps.seal"}
    assert cache.clear(tmp_path)[0] == 1
    assert list(tmp_path.iterdir()) == []


def test_a_session_stores_its_tables_as_it_ends(tmp_path: Path, counted: Counter[str]) -> None:
    """A process that computed tables writes them when it ends; one whose cache entry was
    cleared meanwhile writes nothing (no table files without their events)."""
    import os
    import subprocess
    import sys

    root = Path(tracemagic.__file__).resolve().parents[1]
    script = (
        "import sys, tracemagic\n"
        "from tracemagic.trace import cache\n"
        "trace = tracemagic.load(sys.argv[1], cache_dir=sys.argv[2])\n"
        "trace.ops(), trace.layers()\n"
        "if sys.argv[3] == 'clear':\n"
        "    cache.clear(sys.argv[2])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(root))
    for folder, then in ((tmp_path / "kept", "keep"), (tmp_path / "cleared", "clear")):
        subprocess.run([sys.executable, "-c", script, str(GPU_TRACE), str(folder), then], check=True, env=env, timeout=300)
    assert stored(tmp_path / "kept") == {"ops.ops", "layers.layers"}
    assert list((tmp_path / "cleared").glob("*")) == []  # nothing written (not even the folder)
    again = tracemagic.load(GPU_TRACE, cache_dir=tmp_path / "kept")
    again.ops(), again.layers()
    assert counted == Counter()


def test_a_trace_dropped_stores_its_tables(tmp_path: Path, counted: Counter[str]) -> None:
    """Tables are written when their trace is dropped (a function's trace at its return), not
    while they are computed."""

    def look() -> None:
        trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
        trace.ops()
        assert stored(tmp_path) == set(), "not written while the session computes"
        trace.memory()

    look()
    assert stored(tmp_path) == {"ops.ops", "memory.memory"}
    trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    trace.ops(), trace.memory()
    assert counted == {"ops": 1, "memory": 1}


#: a trace dropped in a garbage cycle with a table to store, collected while the same
#: trace's pending entry is written (a collection may start at any allocation there)
COLLECTED_WHILE_WRITTEN = """
import faulthandler, gc, json, sys, weakref
import tracemagic
from tracemagic.trace import cache
faulthandler.dump_traceback_later(120, exit=True)  # a hang: its stacks, and a failure
trace = tracemagic.load(sys.argv[1], cache_dir=sys.argv[2], progress=False)
trace.ops()
dropped = []
weakref.finalize(trace, dropped.append, "dropped")
gc.disable()
cycle = [trace]
cycle.append(cycle)
del trace, cycle
write_events = cache._table
during = []
def collecting(*args, **kwargs):
    gc.collect()  # the dropped trace's finalizers run here, on this thread
    during.append(list(dropped))
    return write_events(*args, **kwargs)
cache._table = collecting
again = tracemagic.load(sys.argv[1], cache_dir=sys.argv[2], progress=False)  # writes the entry first
print(json.dumps([during, len(again.events), again.ops().shape[0]]))
"""


def test_a_dropped_trace_collected_while_its_entry_is_written_does_not_hang(tmp_path: Path) -> None:
    """Loading a trace again writes its first load's pending cache entry; a garbage
    collection during that write runs the finalizers of the first trace, if it was dropped
    in a cycle: its entry's flush and its tables' store, on the same thread. They used to
    wait for the write's own lock forever (the kernel hung); they return at once now, the
    entry is written and the trace loads."""
    import os
    import subprocess
    import sys

    trace = TRACES / "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    root = Path(tracemagic.__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", COLLECTED_WHILE_WRITTEN, str(trace), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    direct = tracemagic.load(trace, use_cache=False, progress=False)
    during, events, ops = json.loads(done.stdout)
    assert during[0] == ["dropped"], "the first trace finalized during the write (its first table)"
    assert [events, ops] == [len(direct.events), direct.ops().shape[0]]
    assert list(tmp_path.glob(f"*{cache.EVENTS_SUFFIX}")), "the entry is written"


def test_reopened_tables_and_events_take_edits_in_place(tmp_path: Path, counted: Counter[str]) -> None:
    """Every column of a table read from the cache, and of the events read from it, takes an
    assignment as a computed one does (their arrays writable: views of the file's
    copy-on-write mapping, the file left as it is)."""
    first = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    first.ops()
    first.store.flush()
    del first
    files = {path: path.read_bytes() for path in tmp_path.iterdir()}
    trace = tracemagic.load(GPU_TRACE, cache_dir=tmp_path)
    ops = trace.ops()
    assert counted["ops"] == 1, "read from the cache, not computed"
    for frame in (ops, trace.events):
        for column in frame.columns:
            frame.loc[0, column] = frame[column].iloc[1]
            first, second = (frame[column].iloc[[row]].reset_index(drop=True) for row in (0, 1))
            assert first.equals(second), column
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == files


# -- an events entry edited on purpose, its seal rewritten to match ------------------------------

SMALL_TRACE = TRACES / "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz"  # steps, launches, input shapes
#: every table of a trace, as the user asks for them
EVERY_TABLE = (
    "ops", "kernels", "layers", "lines", "syncs", "memory", "memory_peaks", "biggest_allocations",
    "memory_categories", "shapes", "source", "sites", "call_tree", "efficiency", "steps", "phases", "ranks",
    "collectives", "stragglers", "advice", "iterations",
)  # fmt: skip
#: a forged entry's tables next to a fresh parse's, in a fresh interpreter that gives up
#: after argv[3] seconds (a climb around a parent cycle never ends); prints how many times
#: ``load`` parsed the trace
FORGED_TABLES = """
import faulthandler, sys
faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)
import pandas as pd
import tracemagic
from tracemagic.trace import loader
path, folder = sys.argv[1:3]
parsed = []
real = loader.parse_source
loader.parse_source = lambda source, *args, **kwargs: parsed.append(source.name) or real(source, *args, **kwargs)
got = tracemagic.load(path, cache_dir=folder, progress=False)
reparsed = len(parsed)
want = tracemagic.load(path, use_cache=False, progress=False)
names = sys.argv[4].split(",")
tables = {name: getattr(got, name)() for name in names}  # all made first: a hang or error shows here
tables["diff"] = got.diff(got)
for name in names:
    pd.testing.assert_frame_equal(tables[name], getattr(want, name)(), check_exact=True, obj=name)
pd.testing.assert_frame_equal(tables["diff"], want.diff(want), check_exact=True, obj="diff")
pd.testing.assert_frame_equal(got.events, want.events, check_exact=True, obj="events")
print(reparsed)
"""


def _column(table: Any, name: str) -> Any:
    return table.column(name).combine_chunks().to_numpy(zero_copy_only=False).copy()


def _forged(table: Any, stored: dict[str, Any], forgery: str) -> Any:
    """The events table (and its stored layout, changed in place) as ``forgery`` edits them."""
    import numpy as np
    import pyarrow as pa

    n = table.num_rows

    def put(name: str, values: Any) -> Any:
        at = table.schema.get_field_index(name)
        return table.set_column(at, name, pa.array(values, type=table.schema.field(name).type))

    def dictionary(name: str) -> Any:
        return table.column(name).combine_chunks()

    if forgery == "parent cycle":
        return put("parent", (np.arange(n) + 1) % n)
    if forgery in ("parent", "launch", "op", "module"):  # past the table's last row
        return put(forgery, np.where(_column(table, forgery) >= 0, n + 3, 2**40))
    if forgery == "parent below -1":
        return put("parent", np.where(_column(table, "parent") >= 0, -7, -1))
    if forgery == "ts NaN":
        return put("ts", np.where(np.arange(n) % 2 == 0, np.nan, _column(table, "ts")))
    if forgery == "dur negative":  # (the loader leaves such events out: tables would count -1 µs calls)
        dur = _column(table, "dur")
        return put("dur", np.where(np.isfinite(dur), -1.0, dur))
    if forgery == "a step of another name":
        kind, name = dictionary("kind"), dictionary("name")
        steps = np.flatnonzero(kind.indices.to_numpy(zero_copy_only=False) == kind.dictionary.index("step").as_py())
        other = next(i for i, label in enumerate(name.dictionary.to_pylist()) if not label.startswith("ProfilerStep#"))
        codes = name.indices.to_numpy(zero_copy_only=False).copy()
        codes[steps] = other
        forged = pa.DictionaryArray.from_arrays(pa.array(codes, type=name.indices.type), name.dictionary)
        return table.set_column(table.schema.get_field_index("name"), "name", forged)
    if forgery == "kinds reordered":
        kind = dictionary("kind")
        forged = pa.DictionaryArray.from_arrays(kind.indices, pa.array(kind.dictionary.to_pylist()[::-1], type=kind.dictionary.type))
        return table.set_column(table.schema.get_field_index("kind"), "kind", forged)
    if forgery == "input_dims 5000 deep":
        dims = dictionary("input_dims")
        deep = ["[" * 5000 + str(i) + "]" * 5000 for i in range(len(dims.dictionary))]
        forged = pa.DictionaryArray.from_arrays(dims.indices, pa.array(deep, type=dims.dictionary.type))
        return table.set_column(table.schema.get_field_index("input_dims"), "input_dims", forged)
    if forgery == "pid not categorical":  # (numbers: the tables read a categorical's codes)
        return table.set_column(table.schema.get_field_index("pid"), "pid", pa.array(np.arange(n, dtype=np.float64)))
    if forgery == "a rank's metadata not a dict":
        stored["meta"]["ranks"] = {rank: 5 for rank in stored["meta"]["ranks"]}
        return table
    if forgery == "devices not dicts":
        for rank in stored["meta"]["ranks"].values():
            rank["devices"] = "junk"
        return table
    if forgery == "its layout nested 100000 deep":  # (written by the test itself)
        return table
    raise AssertionError(forgery)


FORGERIES = (
    "parent cycle", "parent", "launch", "op", "module", "parent below -1", "ts NaN", "dur negative", "a step of another name",
    "kinds reordered", "input_dims 5000 deep", "pid not categorical", "a rank's metadata not a dict",
    "devices not dicts", "its layout nested 100000 deep",
)  # fmt: skip


@pytest.mark.parametrize("forgery", FORGERIES)
def test_an_events_entry_forged_with_its_seal_is_parsed_again(forgery: str, tmp_path: Path) -> None:
    """Someone edits a cache's events and rewrites the seal to match (no checksum stops
    that): columns the tables index with (``parent``, ``launch``, ``op``, ``module``) out of
    the table, a ``parent`` cycle (a climb up the nesting that never ends), a NaN ``ts``,
    a step not named ``ProfilerStep#N``, JSON input shapes nested past the parser's cap,
    a column of another dtype, metadata of another shape, a layout JSON too deep for
    Python's parser (a raw RecursionError from ``load``). ``load`` refuses the entry and
    parses the trace again: every table is a fresh parse's, never a hang or a raw error."""
    import os
    import subprocess
    import sys

    import pyarrow as pa

    trace = tmp_path / SMALL_TRACE.name
    trace.write_bytes(SMALL_TRACE.read_bytes())
    folder = tmp_path / "cache"
    first = tracemagic.load(trace, cache_dir=folder, progress=False)
    del first
    cache.flush_pending()
    (seal,) = (p for p in folder.glob("*.seal") if cache.TABLE_INFIX not in p.name)
    events = seal.with_suffix(cache.EVENTS_SUFFIX)
    reader = pa.ipc.open_file(pa.BufferReader(events.read_bytes()))
    table = reader.read_all()
    metadata = dict(reader.schema.metadata)
    stored = json.loads(metadata[b"tracemagic"])
    table = _forged(table, stored, forgery)
    metadata[b"tracemagic"] = json.dumps(stored).encode()
    if forgery == "its layout nested 100000 deep":
        metadata[b"tracemagic"] = b'{"meta":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    events.write_bytes(data)
    body = _seal_body(seal)
    body["events"] = {"bytes": len(data), "sum": cache.checksum(data)}
    _write_seal(seal, body)
    root = Path(tracemagic.__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", FORGED_TABLES, str(trace), str(folder), "60", ",".join(EVERY_TABLE)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(root)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1"], "the forged entry was used, not parsed again"


@pytest.mark.parametrize(
    "name", sorted(p.name for p in TRACES.glob("*.gz") if "_et." not in p.name and "memory_timeline" not in p.name)
)
def test_a_fresh_parse_passes_the_checks_of_a_cache_read(name: str) -> None:
    """What ``read`` checks holds for every parse, eight ranks of a tar among them (else
    every reopen would parse again, unseen)."""
    trace = tracemagic.load(TRACES / name, use_cache=False, progress=False)
    cache.check_events(trace.events)
    cache.check_meta(trace.meta)


def test_nesting_depth_counts_brackets_outside_strings() -> None:
    """``jsonvalues.nesting_depth`` against Python's own parser (a recursive one) on texts
    it can read, strings holding brackets and escaped quotes among them."""
    import json as json_module

    from tracemagic.trace.jsonvalues import nesting_depth

    def depth(value: Any) -> int:
        if isinstance(value, list):
            return 1 + max((depth(v) for v in value), default=0)
        if isinstance(value, dict):
            return 1 + max((depth(v) for v in value.values()), default=0)
        return 0

    texts = [
        "1", '"[[["', "[]", "[[1, 2], [3]]", '[["a]]]", "[[[["], {"k": [[["\\"]["]]]}]', '{"[": {"{": []}}',
        '[["\\\\"], "\\\\\\"[["]', "[" * 150 + "]" * 150, '[[[["' + "é" * 3 + '"]]]]',
    ]
    for text in texts:
        assert nesting_depth(text) == depth(json_module.loads(text)), text
    assert nesting_depth("[" * 5000) == 5000  # never closed: still counted, without recursion
    assert nesting_depth('["[[[' + "[" * 5000) == 1  # the rest is inside a string
