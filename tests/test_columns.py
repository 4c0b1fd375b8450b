"""The loader's column memory (``trace.columns``): arrays whose pages are made at once
(``fresh``) or only where a column is written (``partly_written``) must behave as plain
numpy arrays of zeros, wherever the written rows fall on the pages."""

from __future__ import annotations

import mmap
import pickle

import numpy as np
import pandas as pd
import pytest

from tracemagic.trace.columns import fresh, partly_written

ROWS = 50_001  # (not a whole number of pages of any dtype)


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.float64, bool])
def test_fresh_arrays_are_writable_arrays_of_the_size_asked(dtype: type) -> None:
    for rows in (0, 10, ROWS):
        values = fresh(rows, dtype)
        assert values.shape == (rows,) and values.dtype == np.dtype(dtype) and values.flags.writeable
        values[...] = 1
        assert (values == 1).all()
        assert np.array_equal(pickle.loads(pickle.dumps(values)), values)


@pytest.mark.parametrize(
    "spans",
    [
        [],
        [(0, ROWS)],
        [(0, 1)],
        [(ROWS - 1, ROWS)],
        [(3, 700), (700, 9000), (12_345, 12_346), (40_000, ROWS)],  # touching, one row, to the end
        [(1, 2), (5, 5), (511, 513), (mmap.PAGESIZE // 8 - 1, mmap.PAGESIZE // 8 + 1)],  # empty, across a page
    ],
)
@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_a_partly_written_column_is_zeros_that_take_any_write(spans: list[tuple[int, int]], dtype: type) -> None:
    values = partly_written(ROWS, dtype, spans)
    assert values.shape == (ROWS,) and values.dtype == np.dtype(dtype) and values.flags.writeable
    assert not values.any(), "zeros before anything is written"
    want = np.zeros(ROWS, dtype=dtype)
    for start, stop in spans:
        values[start:stop] = np.arange(start, stop) + 1
        want[start:stop] = np.arange(start, stop) + 1
    values[ROWS // 3] = 7  # a row outside the spans takes a write as well
    want[ROWS // 3] = 7
    assert np.array_equal(values, want)
    assert np.array_equal(pickle.loads(pickle.dumps(values)), want)


def test_a_small_partly_written_column_is_zeros_too() -> None:
    values = partly_written(100, np.int64, [(10, 20)])
    assert values.shape == (100,) and not values.any() and values.flags.writeable


def test_out_of_mappings_the_columns_come_from_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process at its limit of memory maps (``vm.max_map_count``: thousands of traces
    kept): ``mmap`` fails, and the columns are the same arrays from the heap (a bare
    ``OSError`` came out of ``load``)."""
    from tracemagic.trace import columns

    def no_map(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(columns.mmap, "mmap", no_map)
    n = 1 << 20
    made = fresh(n, np.int64)
    made[:] = 7
    assert made.shape == (n,) and made.dtype == np.int64 and (made == 7).all()
    partly = partly_written(n, np.float64, [(10, 20)])
    lazy = columns.lazy_zeros(n, np.int32, populate=True)
    for zeros in (partly, lazy):
        assert zeros.flags.writeable and not zeros.any() and len(zeros) == n


@pytest.mark.parametrize("per_code", [["a", "b", None, None], [None, None], ["x"] * 200 + [None]])
@pytest.mark.parametrize("size", [0, 3])
def test_used_categorical_without_categories(per_code: list[str | None], size: int) -> None:
    """No used code names anything (an empty table, rows outside modules): the shortcut
    gives ``_categorical``'s answer, its categories' dtype included (str, or object where
    no name is present)."""
    from tracemagic.analysis import _common

    values = np.array(per_code, dtype=object)
    for dtype in (np.int16, np.int64):
        at = np.full(size, values.size - 1, dtype=dtype)
        used = np.zeros(values.size, dtype=bool)
        used[at] = True
        want = _common._categorical(values, at)
        got = _common._used_categorical(values, at, used)
        assert got.dtype == want.dtype and got.categories.dtype == want.categories.dtype
        assert got.codes.dtype == want.codes.dtype
        pd.testing.assert_series_equal(pd.Series(got), pd.Series(want), check_exact=True)


@pytest.mark.parametrize(
    "categories",
    [pd.Index(["a", "b"]), pd.Index(["a", "b"], dtype=object), pd.Index([1, 2]), pd.Index([f"n{i}" for i in range(300)])],
)
@pytest.mark.parametrize("ordered", [False, True])
def test_without_unused_of_no_rows(categories: pd.Index, ordered: bool) -> None:
    """An empty categorical (an empty table's column) keeps no category, in the dtype the
    general path gives one whose rows are all missing."""
    from tracemagic.analysis import _common

    dtype = pd.CategoricalDtype(categories, ordered=ordered)
    got = _common.without_unused(pd.Categorical.from_codes(np.zeros(0, dtype=np.int8), dtype=dtype))
    want = _common.without_unused(pd.Categorical.from_codes(np.array([-1], dtype=np.int8), dtype=dtype))
    assert got.dtype == want.dtype and got.categories.dtype == want.categories.dtype
    assert got.codes.dtype == want.codes.dtype and got.ordered == want.ordered and len(got) == 0


@pytest.mark.parametrize("infer_string", [True, False])
def test_cached_label_dtypes_follow_the_string_option(infer_string: bool) -> None:
    """The dtypes made once (``_kinds_dtype``, ``_no_categories``) give the categories'
    dtype the option in force gives, as making them each time did: pandas' string dtype,
    or object where a session turned ``future.infer_string`` off (after a call with it on)."""
    import warnings

    from tracemagic.analysis import _common

    _common._kinds_dtype(("kernel", "memcpy"), False, pd.api.types.pandas_dtype(str))  # made with the option on
    _common._used_categorical(np.array(["a", None], dtype=object), np.full(2, 1), np.array([False, True]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the option is deprecated in pandas 3)
        with pd.option_context("future.infer_string", infer_string):
            rows = np.array([0, 1])
            events = pd.DataFrame({"kind": pd.Categorical(["kernel", "memcpy"])})
            got = _common.kinds_at(events, rows, ("kernel", "memcpy"))
            want = pd.CategoricalDtype(["kernel", "memcpy"])
            assert got.categories.dtype == want.categories.dtype
            values = np.array(["a", None], dtype=object)
            got = _common._used_categorical(values, np.full(2, 1), np.array([False, True]))
            want = _common._categorical(values, np.full(2, 1))
            assert got.categories.dtype == want.categories.dtype
