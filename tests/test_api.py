"""The public API: everything in ``__all__`` resolves, and nothing heavy loads on import."""

from __future__ import annotations

import subprocess
import sys

import tracemagic


def test_all_names_resolve() -> None:
    for name in tracemagic.__all__:
        assert getattr(tracemagic, name) is not None, name
    assert set(tracemagic._LAZY) <= set(tracemagic.__all__)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        tracemagic.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_import_is_light() -> None:
    """``%load_ext tracemagic`` should not pay for torch, pandas or plotly until they are used."""
    code = "import sys, tracemagic; print(sorted(m for m in ('torch', 'pandas', 'plotly', 'ipywidgets') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_load_gives_the_facade_over_the_data_trace(tmp_path) -> None:
    """``tracemagic.load`` returns ``tracemagic.Trace``: the data class (``trace.model``)
    with the analyses as methods; it pickles as itself, and ``ranks()`` is the per-rank
    table like every other table (``rank_ids`` the ranks present)."""
    import pickle

    from conftest import TRACES

    from tracemagic.trace.model import TraceTables as TraceData

    trace = tracemagic.load(TRACES / "hta_nccl_data.json.gz", cache_dir=tmp_path)
    assert type(trace) is tracemagic.Trace and isinstance(trace, TraceData)
    ranks = trace.ranks()
    assert list(ranks["rank"]) == trace.rank_ids and ranks.equals(trace.ranks_table())
    again = pickle.loads(pickle.dumps(trace))
    assert type(again) is tracemagic.Trace and again.steps().equals(trace.steps())
    assert tracemagic.Trace.of(trace) is trace
    # the data class holds no analysis: a data trace is only data
    assert not hasattr(TraceData, "steps") and not hasattr(TraceData, "report")


def test_the_data_capture_old_name_warns() -> None:
    """``tracemagic.capture.Capture`` (the data class's name before issue 28's renames) still
    gives it, with a DeprecationWarning naming ``CaptureResult``."""
    import pytest

    import tracemagic.capture
    from tracemagic.facade import Capture

    with pytest.warns(DeprecationWarning, match="CaptureResult"):
        old = tracemagic.capture.Capture
    assert old is tracemagic.capture.CaptureResult
    assert issubclass(Capture, old)
