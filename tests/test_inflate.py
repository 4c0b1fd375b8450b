"""gzip traces are inflated by ISA-L (python-isal) where it imports, else by zlib: the same
events, the same errors, the same bounds either way."""

from __future__ import annotations

import gzip
import random
import re
import zlib
from pathlib import Path
from typing import Any

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


#: the inflater's own reason in a message (zlib: "Error -3 while decompressing data: ...",
#: ISA-L: "Error -6 Incorrect checksum found")
_REASON = re.compile(r"\(Error -?\d+[^)]*\)")


def _outcome(path: Path) -> Any:
    """The events loaded, or the error's message (either inflater must give the same)."""
    try:
        return tracemagic.load(path, use_cache=False, progress=False, recover=True).events
    except TraceError as exc:
        return str(exc)


def test_damaged_gzip_streams_end_alike_with_either_inflater(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes of a real trace's gzip flipped, cut or dropped at random: ISA-L and zlib load
    the same events (``recover=True`` keeps what came before the damage) or raise the same
    ``TraceError``."""
    pytest.importorskip("isal.isal_zlib")
    raw = (TRACES / "tracelens_normalization_layer_test.json.gz").read_bytes()  # an MI300X's, 0.2 MB
    rng = random.Random(23)
    kinds = set()
    for i in range(24):
        data = bytearray(raw)
        spot = rng.randrange(10, len(data))
        match i % 3:
            case 0:
                data[spot] ^= 1 << rng.randrange(8)
            case 1:
                del data[spot:]
            case _:
                del data[spot : spot + rng.randrange(1, 64)]
        path = tmp_path / f"damaged{i}.json.gz"
        path.write_bytes(bytes(data))
        fast = _outcome(path)
        with monkeypatch.context() as patched:
            patched.setattr(read, "_inflate", zlib)
            slow = _outcome(path)
        if isinstance(fast, str) or isinstance(slow, str):  # the same message but the library's own words
            assert isinstance(fast, str) and isinstance(slow, str), (i, spot)
            assert _REASON.sub("()", fast) == _REASON.sub("()", slow), (i, spot)
            kinds.add("error")
        else:
            pd.testing.assert_frame_equal(fast, slow)
            kinds.add("events")
    assert kinds == {"error", "events"}  # both endings were tried
