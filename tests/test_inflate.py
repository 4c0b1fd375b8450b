"""gzip traces are inflated by ISA-L (python-isal) where it imports, else by zlib: the same
events, the same errors, the same bounds either way."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import pandas as pd
import pytest
from conftest import TRACES

import tracemagic
from tracemagic.errors import TraceError
from tracemagic.trace import read

#: Kineto traces: a large one (split over two threads), a multi-rank NCCL one, a small one
GZ_TRACES = ["hta_control.json.gz", "hta_nccl_data.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"]


def _load(path: Path) -> pd.DataFrame:
    return tracemagic.load(path, use_cache=False, progress=False).events


def test_isal_inflates_where_it_is_installed() -> None:
    """The pinned venv has python-isal: the fast path is the one these tests exercise."""
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert read._inflate is isal_zlib


@pytest.mark.parametrize("name", GZ_TRACES)
def test_zlib_and_isal_give_the_same_events(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = TRACES / name
    fast = _load(path)
    monkeypatch.setattr(read, "_inflate", zlib)
    slow = _load(path)
    pd.testing.assert_frame_equal(fast, slow)
    assert len(fast) > 0


def test_a_multi_member_gzip_inflates_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gzip members (``cat a.gz b.gz``): both inflaters read on past the first."""
    events = ",".join(f'{{"ph":"X","name":"op{i}","ts":{i * 10},"dur":5,"pid":1,"tid":1}}' for i in range(400))
    text = ('{"traceEvents":[' + events + "]}").encode()
    half = len(text) // 2
    path = tmp_path / "two.json.gz"
    path.write_bytes(gzip.compress(text[:half]) + gzip.compress(text[half:]))
    assert len(_load(path)) == 400
    monkeypatch.setattr(read, "_inflate", zlib)
    assert len(_load(path)) == 400


@pytest.mark.parametrize("inflater", ["isal", "zlib"])
def test_corrupt_gzip_is_a_trace_error(inflater: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if inflater == "zlib":
        monkeypatch.setattr(read, "_inflate", zlib)
    else:
        pytest.importorskip("isal.isal_zlib")
    raw = bytearray((TRACES / GZ_TRACES[0]).read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = b"\x00" * 64  # a damaged deflate block
    path = tmp_path / "damaged.json.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(TraceError) as info:
        tracemagic.load(path, use_cache=False, progress=False)
    assert str(path) in str(info.value)
