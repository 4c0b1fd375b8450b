"""A large trace is parsed on two threads (``tracemagic.trace.split``): the result must be
exactly the one-thread parse's, for real traces, for cuts that land inside strings or
nested values, for damaged files, and when the second thread fails or the user interrupts."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import TRACES, run_in_kernel

import tracemagic
from tracemagic.errors import TraceError
from tracemagic.trace import parse, split
from tracemagic.trace.read import file_source

load_module = importlib.import_module("tracemagic.trace.loader")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEMAGIC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def plain(name: str, tmp_path: Path) -> Path:
    """A real trace from tests/data/traces, decompressed (only plain files are split)."""
    source = TRACES / name
    if not source.is_file():
        pytest.fail(f"{source} is missing: tests/data/traces is incomplete")
    path = tmp_path / name.removesuffix(".gz")
    path.write_bytes(gzip.decompress(source.read_bytes()))
    return path


class SplitSpy:
    """Counts split parses and whether each gave a result (or fell back)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.results: list[bool] = []
        real = split.parse_split

        def spy(*args: Any, **kwargs: Any) -> Any:
            parsed = real(*args, **kwargs)
            self.results.append(parsed is not None)
            return parsed

        monkeypatch.setattr(split, "parse_split", spy)


def assert_same(a: tracemagic.Trace, b: tracemagic.Trace) -> None:
    pd.testing.assert_frame_equal(a.events, b.events)
    pd.testing.assert_frame_equal(a.flows, b.flows)
    assert a.meta == b.meta


@pytest.mark.parametrize(
    "name",
    [
        "hta_nccl_data.json.gz",  # GPU kernels, NCCL, flows, metadata before and after the events
        "hta_mi250_minitoy_train_ROCm6_2_kineto.json.gz",  # AMD
        "kineto_worker0.1623143089861.pt.trace.json.gz",  # an old trace, 35 MB: split by default
    ],
)
def test_split_parse_equals_the_one_process_parse(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = plain(name, tmp_path)
    if path.stat().st_size < split.SPLIT_MIN_BYTES:
        monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    spy = SplitSpy(monkeypatch)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    assert spy.results == []
    both = tracemagic.load(path, use_cache=False)
    assert spy.results == [True], "the file was parsed on two threads"
    assert_same(alone, both)
    assert len(both.events) > 0


def test_stretches_are_taken_by_both_threads_and_joined_in_file_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is cut into many stretches; each thread takes the next one when it is free,
    so both read some, and the joined columns are the one-thread parse's."""
    path = plain("hta_nccl_data.json.gz", tmp_path)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "STRETCH_BYTES", path.stat().st_size // 12)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 128 * 1024)
    taken: list[tuple[str, int]] = []
    real = split._Stretches._read
    # each thread parses its first stretch only once the other has taken one too, so
    # neither can take every stretch before the other starts
    both_started = threading.Barrier(2, timeout=30)

    def gated(self: Any, index: int, *args: Any) -> Any:
        name = threading.current_thread().name
        first = name not in {n for n, _ in taken}
        taken.append((name, index))
        if first:
            both_started.wait()
        return real(self, index, *args)

    monkeypatch.setattr(split._Stretches, "_read", gated)
    both = tracemagic.load(path, use_cache=False)
    assert len(taken) > 8, "many stretches"
    assert {name for name, _ in taken} == {"MainThread", "tracemagic-parse"}
    assert sorted(index for _, index in taken) == list(range(len(taken))), "every stretch read once"
    assert_same(alone, both)


@pytest.mark.parametrize("share", [0.03, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95])
@pytest.mark.parametrize("layout", ["compact", "pretty"])
def test_cuts_inside_strings_and_nested_values_fall_back(
    share: float, layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names and args full of ``}, {`` (also arrays of objects inside args) put candidate
    cuts inside events; the split either proves its cuts or parses in one thread (stretches
    of ``share`` of the file: from 2 to 16 of them)."""
    events = []
    for i in range(2000):
        events.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": ["aten::mm", 'weird }, { "name": }] [{', "x\\"][i % 3],
                "pid": 1,
                "tid": 1,
                "ts": 10.0 * i,
                "dur": 5.0,
                "args": {"External id": i, "objects": [{"a": i}, {"b": [{"c": 1}, {"d": 2}]}] * 3},
            }
        )
    doc = {"schemaVersion": 1, "traceEvents": events, "traceName": "after }, { the events"}
    text = json.dumps(doc, indent=None if layout == "compact" else 2, separators=(",", ":") if layout == "compact" else None)
    path = tmp_path / "tricky.json"
    path.write_text(text)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "STRETCH_BYTES", int(len(text) * share))
    spy = SplitSpy(monkeypatch)
    both = tracemagic.load(path, use_cache=False)
    assert len(spy.results) == 1
    assert both.events["name"].astype(str).tolist() == [e["name"] for e in events]
    assert both.events["external_id"].tolist() == list(range(2000))
    assert both.meta["ranks"][0]["traceName"] == "after }, { the events"
    assert_same(tracemagic.load(path, use_cache=False, workers=1), both)


@pytest.mark.parametrize("fraction", [0.3, 0.7, 0.999])
def test_damaged_files_report_as_the_one_process_parse(fraction: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = plain("hta_nccl_data.json.gz", tmp_path).read_bytes()
    path = tmp_path / "cut.json"
    path.write_bytes(data[: int(len(data) * fraction)] + b"garbage")
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    with pytest.raises(TraceError) as alone:
        tracemagic.load(path, use_cache=False, workers=1)
    with pytest.raises(TraceError) as both:
        tracemagic.load(path, use_cache=False)
    assert str(both.value) == str(alone.value) and both.value.offset == alone.value.offset
    assert_same(
        tracemagic.load(path, use_cache=False, workers=1, recover=True), tracemagic.load(path, use_cache=False, recover=True)
    )


def _parse_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tracemagic-parse"]


def test_a_failing_second_thread_means_a_one_thread_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = plain("hta_nccl_data.json.gz", tmp_path)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    real = split._Stretches._read
    failed = threading.Event()

    def broken(self: Any, index: int, report: Any, pool: Any) -> Any:
        if threading.current_thread().name == "tracemagic-parse":
            failed.set()
            raise MemoryError("no room")
        # this thread reads once the second has failed: on a busy machine it could take
        # every stretch before the second thread asks for one (then nothing fails)
        failed.wait(60)
        return real(self, index, report, pool)

    monkeypatch.setattr(split._Stretches, "_read", broken)
    spy = SplitSpy(monkeypatch)
    both = tracemagic.load(path, use_cache=False)
    assert failed.is_set() and spy.results == [False], "the split gave up"
    assert_same(alone, both)
    assert not _parse_threads()


def test_an_interrupt_reaches_the_user_and_stops_the_second_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = plain("hta_nccl_data.json.gz", tmp_path)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 64 * 1024)  # many chunks: the second thread is mid-way
    real = parse.read_part
    chunks: list[int] = []
    midway, cancelled = threading.Event(), threading.Event()
    cancel = split._Second.cancel

    def cancel_and_tell(self: Any) -> None:
        cancel(self)
        cancelled.set()

    def interrupted(source: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "tracemagic-parse":  # count its chunks
            stop = kwargs["progress"]

            def counting(done: int, total: int) -> None:
                chunks.append(done)
                midway.set()  # the user interrupts now, while this thread is mid-stretch
                assert cancelled.wait(timeout=30), "the interrupt cancelled the second thread"
                stop(done, total)

            return real(source, **{**kwargs, "progress": counting})
        assert midway.wait(timeout=30), "the second thread started"
        raise KeyboardInterrupt

    monkeypatch.setattr(split._Second, "cancel", cancel_and_tell)
    monkeypatch.setattr(parse, "read_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tracemagic.load(path, use_cache=False)
    for thread in _parse_threads():
        thread.join(timeout=30)
    assert not _parse_threads(), "the second thread stopped"
    total = path.stat().st_size // 2 // (64 * 1024)
    assert total > 10 and len(chunks) == 1, "it stopped at its next chunk, not at the end of its stretch"


def test_without_the_c_scanner_there_is_no_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec holds the GIL: two threads would take as long as one."""
    path = plain("hta_nccl_data.json.gz", tmp_path)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    assert split.can_split(file_source(path), None)
    monkeypatch.setattr(parse, "_scan", None)
    assert not split.can_split(file_source(path), None)


def test_progress_runs_to_the_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = plain("hta_nccl_data.json.gz", tmp_path)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 256 * 1024)
    seen: list[tuple[int, int]] = []
    tracemagic.load(path, use_cache=False, progress=lambda done, total: seen.append((done, total)))
    size = path.stat().st_size
    assert len(seen) > 5 and all(total == size for _, total in seen)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == size and done[len(done) // 2] < size


def test_gzip_files_are_split_after_decompressing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    source = TRACES / "hta_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    path = tmp_path / source.name
    path.write_bytes(source.read_bytes())
    spy = SplitSpy(monkeypatch)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    assert spy.results == [], "workers=1 parses in this process only"
    both = tracemagic.load(path, use_cache=False)
    assert spy.results == [True]
    assert_same(alone, both)


def test_a_gzip_is_read_in_the_blocks_it_was_inflated_in() -> None:
    """The second thread reads its stretches of a gzip from the inflated blocks, unjoined:
    every range, across block ends and past the end, is that of the whole JSON."""
    whole = gzip.decompress((TRACES / "hta_nccl_data.json.gz").read_bytes())
    cuts = [0, 1, 4096, 4096, 70000, len(whole) // 2, len(whole)]  # an empty block too
    read_at = split._blocks_reader([whole[a:b] for a, b in zip(cuts, cuts[1:])])
    for offset in (0, 1, 4095, 4096, 4097, 69999, len(whole) // 2 - 3, len(whole) - 5, len(whole), len(whole) + 9):
        for size in (0, 1, 2, 5000, 70001, len(whole)):
            assert read_at(offset, size) == whole[offset : offset + size], (offset, size)


def test_a_truncated_gzip_file_is_reported_as_the_one_process_parse_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    data = (TRACES / "hta_nccl_data.json.gz").read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    spy = SplitSpy(monkeypatch)
    with pytest.raises(TraceError) as both:
        tracemagic.load(path, use_cache=False)
    assert spy.results == [False]
    with pytest.raises(TraceError) as alone:
        tracemagic.load(path, use_cache=False, workers=1)
    assert str(both.value) == str(alone.value)
    assert_same(
        tracemagic.load(path, use_cache=False, workers=1, recover=True), tracemagic.load(path, use_cache=False, recover=True)
    )


def test_the_size_threshold_reads_the_gzip_trailer(tmp_path: Path) -> None:
    source = TRACES / "hta_control.json.gz"  # 1.8 MB of gzip, 35 MB of JSON
    path = tmp_path / source.name
    path.write_bytes(source.read_bytes())
    assert split._json_size(path, path.stat().st_size) == len(gzip.decompress(source.read_bytes()))
    assert split.can_split(file_source(path), None) == (split.SPLIT_MIN_BYTES <= 35 << 20)
    assert not split.can_split(file_source(path), 1)


def test_split_inside_a_jupyter_kernel(tmp_path: Path) -> None:
    """A kernel has threads of its own (heartbeat, IOPub) and an output stream: the split
    parse there gives the same trace, prints nothing, and the kernel goes on working."""

    path = plain("hta_nccl_data.json.gz", tmp_path)
    cells = [
        "import importlib, os, tracemagic\n"
        "split = importlib.import_module('tracemagic.trace.split')\n"
        "split.SPLIT_MIN_BYTES = 0\n"
        "calls = []\n"
        "real = split.parse_split\n"
        "def spy(*a, **k):\n"
        "    parsed = real(*a, **k)\n"
        "    calls.append(parsed is not None)\n"
        "    return parsed\n"
        "split.parse_split = spy\n"
        f"both = tracemagic.load({str(path)!r}, use_cache=False)\n"
        f"alone = tracemagic.load({str(path)!r}, use_cache=False, workers=1)",
        "import pandas as pd\n"
        "pd.testing.assert_frame_equal(both.events, alone.events)\n"
        "pd.testing.assert_frame_equal(both.flows, alone.flows)\n"
        "assert both.meta == alone.meta and calls == [True], calls\n"
        "print('same', len(both.events), os.getpid())",
    ]
    nb = run_in_kernel(cells, tmp_path)
    assert nb.cells[0].outputs == [], "the parse (both threads) wrote nothing to the notebook"
    printed = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert printed.startswith("same ") and int(printed.split()[1]) > 0


def test_split_without_pread_reads_under_a_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has no ``os.pread``: the two threads then share one file handle."""
    path = plain("hta_nccl_data.json.gz", tmp_path)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 256 * 1024)  # many reads from both threads
    monkeypatch.delattr(os, "pread")
    spy = SplitSpy(monkeypatch)
    both = tracemagic.load(path, use_cache=False)
    assert spy.results == [True]
    assert_same(alone, both)


class StretchSpy:
    """Records each inner stretch the C scanner read from the file itself (``scan_file``):
    (its length, how much of it it read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        real = parse.scan_file

        def spy(fd: int, start: int, stop: int, *args: Any, **kwargs: Any) -> Any:
            part, done = real(fd, start, stop, *args, **kwargs)
            self.calls.append((stop - start, done))
            return part, done

        monkeypatch.setattr(parse, "scan_file", spy)


@pytest.mark.parametrize("route", ["file", "no scan_file", "gzip"])
def test_inner_stretches_are_scanned_in_c_straight_from_the_file(
    route: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the first stretch and the last (which hold the metadata around the events),
    the C scanner cuts each stretch of a plain file into chunks itself, reading them from
    the file (``scan_file``); a gzip file's stretches (inflated in memory), and any where
    there is no ``scan_file`` (no ``pread``), are read by ``read_part``: the same columns."""
    path = plain("kineto_worker0.1623143089861.pt.trace.json.gz", tmp_path)
    if route == "no scan_file":
        monkeypatch.setattr(parse, "scans_files", lambda: False)
    if route == "gzip":
        path = path.with_suffix(".json.gz")
        path.write_bytes(gzip.compress(path.with_suffix("").read_bytes(), compresslevel=1))
    alone = tracemagic.load(path, use_cache=False, workers=1)
    monkeypatch.setattr(split, "STRETCH_BYTES", path.stat().st_size // 6)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 256 * 1024)
    spy = StretchSpy(monkeypatch)
    cuts: list[list[tuple[int, int]]] = []
    real_cuts = split._cuts
    monkeypatch.setattr(split, "_cuts", lambda *args: cuts.append(real_cuts(*args)) or cuts[-1])
    both = tracemagic.load(path, use_cache=False)
    assert len(cuts) == 1 and len(cuts[0]) >= 6
    if route == "file":
        assert sorted(size for size, _ in spy.calls) == sorted(stop - start for start, stop in cuts[0][1:-1]), (
            "every stretch between the first and the last"
        )
        assert all(done == size for size, done in spy.calls), "each read to its end in C"
    else:
        assert spy.calls == []
    assert_same(alone, both)
    assert both.warnings == alone.warnings


@pytest.mark.parametrize("chunk", [4 * 1024, 64 * 1024])
def test_a_stretch_the_scanner_leaves_midway_is_read_on_by_msgspec(
    chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event the scanner does not read exactly as msgspec does (a float where an integer
    id belongs, a number beyond 64 bits), or one longer than a chunk, stops the C stretch
    there: the rest of the stretch is read as any stretch is, and the result is the
    one-thread parse's, warnings included."""
    events = []
    for i in range(3000):
        args: dict[str, Any] = {"External id": i, "Input Dims": [[i % 7, 3], []], "Call stack": "a.py(1): f"}
        if i in (1200, 1201, 2100):
            args["External id"] = i + 0.5  # a float id: read by msgspec's rules
        if i == 1700:
            args["Sequence number"] = 2**70  # beyond 64 bits
        if i == 2500:
            args["Call stack"] = "a.py(1): f;" * 2000  # an event of over 20 kB
        event = {"ph": "X", "cat": "cpu_op", "name": f"op{i % 13}", "pid": 1, "tid": 2, "ts": 10.0 * i, "dur": 5.0}
        events.append({**event, "args": args})
    text = json.dumps({"schemaVersion": 1, "traceEvents": events, "traceName": "t"}, indent=2)
    path = tmp_path / "odd.json"
    path.write_text(text)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "STRETCH_BYTES", len(text) // 5)
    monkeypatch.setattr(parse, "CHUNK_BYTES", chunk)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    spy = StretchSpy(monkeypatch)
    both = tracemagic.load(path, use_cache=False)
    assert spy.calls and any(done < size for size, done in spy.calls), "a stretch was left to msgspec midway"
    assert_same(alone, both)
    assert both.warnings == alone.warnings


def test_a_process_name_and_its_labels_in_different_stretches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's labels are added to its name (``"python3 GPU 5"``) also when the name
    and the labels are in stretches read apart (each stretch's names were joined as a
    dict, so the later stretch's bare labels replaced the name)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 5, "tid": 0, "args": {"name": "python3"}},
    ]
    kernel = {"ph": "X", "cat": "kernel", "pid": 5, "tid": 7, "dur": 5.0}
    events += [{**kernel, "name": f"k{i % 7}", "ts": 10.0 * i, "args": {"correlation": i}} for i in range(3000)]
    events.append({"ph": "M", "name": "process_labels", "pid": 5, "tid": 0, "args": {"labels": "GPU 5"}})
    text = json.dumps({"schemaVersion": 1, "traceEvents": events}, indent=1)
    path = tmp_path / "labels.json"
    path.write_text(text)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "STRETCH_BYTES", len(text) // 6)
    spy = SplitSpy(monkeypatch)
    both = tracemagic.load(path, use_cache=False)
    assert spy.results == [True]
    assert both.meta["processes"][0]["5"] == "python3 GPU 5"
    assert_same(tracemagic.load(path, use_cache=False, workers=1), both)


def _odd_trace(
    tmp_path: Path, odd: dict[int, dict[str, Any]], raw: dict[str, bytes] | None = None
) -> tuple[Path, list[dict[str, Any]]]:
    """3000 plain CPU ops, event ``i`` changed by ``odd[i]`` (merged into it, args too);
    ``raw``: JSON strings (``"x"``) written as other bytes (invalid UTF-8)."""
    events = []
    for i in range(3000):
        event: dict[str, Any] = {"ph": "X", "cat": "cpu_op", "name": f"op{i % 13}", "pid": 1, "tid": 2}
        event.update(ts=10.0 * i, dur=5.0, args={"External id": i, "stream": 7})
        for key, value in odd.get(i, {}).items():
            if key == "args":
                event["args"].update(value)
            else:
                event[key] = value
        events.append(event)
    data = json.dumps({"schemaVersion": 1, "traceEvents": events}, indent=1).encode()
    for text, bad in (raw or {}).items():
        assert data.count(f'"{text}"'.encode()) == 1
        data = data.replace(f'"{text}"'.encode(), b'"' + bad + b'"')
    path = tmp_path / "odd.json"
    path.write_bytes(data)
    return path, events


def _one_and_two_threads(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[tracemagic.Trace, tracemagic.Trace]:
    """``path`` parsed on one thread in one chunk, and on two in 6 stretches of small chunks."""
    alone = tracemagic.load(path, use_cache=False, workers=1)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "STRETCH_BYTES", path.stat().st_size // 6)
    monkeypatch.setattr(split, "EDGE_BYTES", 4096)
    monkeypatch.setattr(parse, "CHUNK_BYTES", 16 * 1024)
    spy = SplitSpy(monkeypatch)
    both = tracemagic.load(path, use_cache=False)
    assert spy.results == [True], "the file was parsed on two threads"
    return alone, both


@pytest.mark.parametrize(
    "value",
    [False, True, -(2**63)],
    ids=["false", "true", "int64-min"],
)
def test_a_number_is_read_alone_not_as_its_stretch_makes_it(
    value: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stream: false`` was 0 in a chunk of numbers (numpy's fast path) but missing in one
    with text (the value-by-value rules), and -2**63 the other way round: the value depended
    on where the file was cut. A float id beside it sends its chunk to msgspec's route."""
    odd = {
        400: {"args": {"stream": "abc"}},  # text: the chunk is read value by value
        2000: {"args": {"stream": value, "External id": 2000.5}},
    }
    path, events = _odd_trace(tmp_path, odd)
    alone, both = _one_and_two_threads(path, monkeypatch)
    assert_same(alone, both)
    assert both.warnings == alone.warnings
    # independently: JSON true/false are not numbers; -2**63 fits int64
    streams = [e["args"]["stream"] for e in events]
    expected = [s if type(s) is int and -(2**63) <= s < 2**63 else None for s in streams]
    got = both.events.sort_values("ts")["stream"].astype(object).where(lambda s: s.notna(), None).tolist()
    assert got == expected
    missing = sum(e is None for e in expected)
    assert f"{missing} values of args 'stream' are not numbers that fit int64; left missing" in both.warnings


def test_invalid_utf8_is_noted_once_for_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invalid UTF-8 in two stretches was noted once per chunk, each with its own count
    (``1 bytes``, ``1 bytes``), and once for the file on one thread (``2 bytes``); and in a
    key msgspec skips, only where another byte of the chunk made it repair the chunk."""
    odd = {300: {"args": {"k300": 1}}, 500: {"name": "x500"}, 2200: {"name": "x2200"}}
    raw = {"k300": b"k\xfe300", "x500": b"x\xff500", "x2200": b"x\xc32200"}
    path, _ = _odd_trace(tmp_path, odd, raw)
    alone, both = _one_and_two_threads(path, monkeypatch)
    assert_same(alone, both)
    data = path.read_bytes()
    first = data.index(b"\xfe")
    assert both.warnings == alone.warnings == [f"invalid UTF-8 at byte {first} (3 bytes in all read as '?')"]
    assert set(both.events["name"]) == {f"op{i}" for i in range(13)} | {"x?500", "x?2200"}


def test_a_number_or_bool_as_text_keeps_its_own_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cat: false`` was labelled ``0`` where a ``cat: 0`` had been met first (``False == 0``
    as a dict key), and on two threads whichever thread met one first decided."""
    odd = {
        100: {"cat": 0},
        900: {"cat": 1.0, "pid": 2},
        1500: {"cat": True, "pid": 2.0},
        2100: {"cat": 1, "tid": False},
        2900: {"cat": False, "tid": 0},
    }
    path, events = _odd_trace(tmp_path, odd)
    alone, both = _one_and_two_threads(path, monkeypatch)
    assert_same(alone, both)
    # independently: each value's text as Python writes what json.loads gives
    by_ts = both.events.sort_values("ts")
    for column in ("cat", "pid", "tid"):
        assert by_ts[column].astype(str).tolist() == [str(e[column]) for e in events], column


def test_durations_that_are_not_numbers_are_noted_once_for_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events whose ``dur`` is not a finite number were noted per chunk, after the chunk's
    first byte (where the file was cut): now once for the file, with the first of them."""
    odd = {300: {"dur": "x"}, 1500: {"dur": None}, 1501: {"dur": [1]}, 2700: {"dur": "long"}}
    path, events = _odd_trace(tmp_path, odd)
    alone, both = _one_and_two_threads(path, monkeypatch)
    assert_same(alone, both)
    odd_count = sum(not isinstance(e["dur"], (int, float)) for e in events if e["dur"] is not None)
    assert both.warnings == alone.warnings == [
        f"{odd_count} events have a dur that is not a finite number; read as 0 (the first: 'op1' at ts 3000.0)"
    ]
    assert both.events.loc[both.events["ts"] == 3000.0, "dur"].tolist() == [0.0]


def _garbage_pools(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fill every scan pool handed to ``finish`` with 0xAB (what a reused pool may hold) and
    count the columns carved out of them; small arrays carved too (a small trace's)."""
    from tracemagic.trace import columns

    carved: list[int] = []
    real_init, real_take = columns.Carver.__init__, columns.Carver.take

    def init(self: Any, pools: list[Any]) -> None:
        for pool in pools:
            pool[:] = b"\xab" * len(pool)
        real_init(self, pools)

    def take(self: Any, n: int, dtype: Any) -> Any:
        out = real_take(self, n, dtype)
        if out is not None:
            assert out.ctypes.data % 64 == 0
            carved.append(n)
        return out

    monkeypatch.setattr(columns.Carver, "__init__", init)
    monkeypatch.setattr(columns.Carver, "take", take)
    monkeypatch.setattr(columns, "_FRESH_MIN_BYTES", 0)
    monkeypatch.setattr(parse, "POOL_CHUNKS", 100)  # room for every column
    return carved


def test_columns_carved_from_garbage_pools_equal_fresh_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The columns ``finish`` makes in the scan pools (garbage: 0xAB) equal those made in
    fresh memory, on one thread and on two, with number and text columns present in some
    chunks only (their unwritten rows must not be the pool's bytes)."""
    import numpy as np

    from tracemagic.trace import builder

    odd: dict[int, dict[str, Any]] = {i: {"args": {"device": 3, "Sequence number": i}} for i in range(1000, 1400)}
    odd.update({i: {"args": {"flops": i / 2, "dtype": "float"}} for i in range(2500, 2600)})
    # most chunks, not all (carved, the rest zeroed): its own rows apart and a stretch of them
    for i in [*range(0, 1500), *range(1700, 2200)]:
        if i % 97:
            odd.setdefault(i, {"args": {}})["args"]["Python id"] = -i
    odd[2800] = {"args": {"correlation": 5, "Collective name": "allreduce"}}
    path, _ = _odd_trace(tmp_path, odd)
    monkeypatch.setattr(builder, "REUSE_POOLS", False)
    plain_alone, plain_both = _one_and_two_threads(path, monkeypatch)
    monkeypatch.setattr(builder, "REUSE_POOLS", True)
    carved = _garbage_pools(monkeypatch)
    alone = tracemagic.load(path, use_cache=False, workers=1)
    assert carved, "the one-thread parse carved columns from its pool"
    carved.clear()
    both = tracemagic.load(path, use_cache=False)
    assert carved, "the split parse carved columns from its pools"
    for fresh, reused in ((plain_alone, alone), (plain_both, both)):
        assert_same(fresh, reused)
        for column in fresh.events.columns:  # the values under the masks too (zeros), not garbage
            a, b = fresh.events[column].array, reused.events[column].array
            if hasattr(a, "_data"):
                assert np.array_equal(a._data, b._data, equal_nan=True), column
    assert_same(alone, both)
    events = both.events.sort_values("ts")
    assert events["device"].notna().sum() == 400
    assert events["flops"].notna().sum() == 100
    expected = [-i if (i < 1500 or 1700 <= i < 2200) and i % 97 else None for i in range(3000)]
    assert events["python_id"].astype(object).where(events["python_id"].notna(), None).tolist() == expected
    assert (events["ph"] == "X").all()


def test_a_carver_aligns_falls_back_when_full_and_hands_back_the_rest() -> None:
    import mmap

    import numpy as np

    from tracemagic.trace import columns

    private = getattr(mmap, "MAP_PRIVATE", None)
    pools = [mmap.mmap(-1, 1 << 20) if private is None else mmap.mmap(-1, 1 << 20, flags=private) for _ in range(2)]
    for pool in pools:
        pool[:] = b"\xab" * len(pool)
    carver = columns.Carver(pools)
    a = carver.take(100_000, np.int64)  # 800 KB: the first pool
    b = carver.take(200_001, np.int8)  # the rest of the first
    c = carver.take(100_000, np.int64)  # the second
    assert a is not None and b is not None and c is not None
    assert carver.take(100_000, np.int64) is None, "full: the caller's fresh memory"
    assert carver.take(10, np.int64) is None, "small: the heap's"
    assert all(x.ctypes.data % 64 == 0 for x in (a, b, c))
    ends = sorted((x.ctypes.data, x.ctypes.data + x.nbytes) for x in (a, b, c))
    assert all(stop <= start for (_, stop), (start, _) in zip(ends, ends[1:])), "no overlap"
    a[:] = 1
    b[:] = 2
    c[:] = 3
    carver.close()
    assert (a == 1).all() and (b == 2).all() and (c == 3).all(), "the carved columns kept"
    columns.zero_rows(a, 3, 90_001)  # whole pages handed back, the rows at their ends written
    columns.zero_rows(b, 5, 7)
    expected = np.ones(100_000, dtype=np.int64)
    expected[3:90_001] = 0
    assert (a == expected).all()
    assert (b[:5] == 2).all() and (b[5:7] == 0).all() and (b[7:] == 2).all()
    assert (c == 3).all(), "the next column untouched"
    empty = mmap.mmap(-1, 1 << 20)
    columns.Carver([empty]).close()
    assert empty.closed, "a pool with nothing carved is unmapped"


def test_no_carved_column_is_left_unused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A column carved out of a scan pool that the preparation then drops or replaces (the
    parse-only columns, memory events' bytes, timestamps in nanoseconds made µs) would keep
    pool pages resident for nothing as long as the trace lives: every carved array is memory
    the loaded trace's columns hold."""
    import numpy as np

    from tracemagic.trace import columns

    odd = {i: {"ts": 1.7e18 + 1e4 * i, "dur": 5e3} for i in range(3000)}  # nanoseconds
    odd.update({i: {"args": {"Device Id": 0, "Device Type": 1, "Bytes": 64}} for i in range(0, 3000, 7)})
    path, _ = _odd_trace(tmp_path, odd)
    _garbage_pools(monkeypatch)
    ranges: list[tuple[int, int]] = []
    take = columns.Carver.take

    def noting(self: Any, n: int, dtype: Any) -> Any:
        out = take(self, n, dtype)
        if out is not None:
            ranges.append((out.ctypes.data, out.ctypes.data + out.nbytes))
        return out

    monkeypatch.setattr(columns.Carver, "take", noting)
    for workers in (1, None):
        ranges.clear()
        trace = tracemagic.load(path, use_cache=False, workers=workers)
        assert any("nanoseconds" in w for w in trace.warnings)
        held: list[tuple[int, int]] = []
        for column in trace.events.columns:
            values = trace.events[column].array
            for part in (getattr(values, "codes", None), getattr(values, "_data", None), getattr(values, "_mask", None)):
                if isinstance(part, np.ndarray) and part.size:
                    held.append((part.ctypes.data, part.ctypes.data + part.nbytes))
            if isinstance(values, np.ndarray) or hasattr(values, "_ndarray"):
                array = np.asarray(values)
                held.append((array.ctypes.data, array.ctypes.data + array.nbytes))
        assert ranges, "columns were carved"
        unused = [r for r in ranges if not any(lo < r[1] and r[0] < hi for lo, hi in held)]
        assert not unused, f"{len(unused)} carved arrays no column of the trace holds (workers={workers})"


def test_the_pools_are_handed_back_when_finish_is_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while ``finish`` carves the columns: what was not carved of the pools is handed
    back all the same (a kept traceback, as IPython keeps the last one, would hold them)."""
    from tracemagic.trace import builder, columns

    path, _ = _odd_trace(tmp_path, {})
    _garbage_pools(monkeypatch)
    closed: list[int] = []
    close, categorical = columns.Carver.close, builder._Builder._categorical
    monkeypatch.setattr(columns.Carver, "close", lambda self: (closed.append(len(self._pools)), close(self)))
    calls = iter(range(100))

    def interrupted(self: Any, column: str, *args: Any, **kwargs: Any) -> Any:
        if next(calls) == 3:
            raise KeyboardInterrupt
        return categorical(self, column, *args, **kwargs)

    monkeypatch.setattr(builder._Builder, "_categorical", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tracemagic.load(path, use_cache=False, workers=1)
    assert closed == [1], "the one pool handed back"
