"""Whole-trace columns that cost no memory until used: most args columns of a trace are
missing on every event (a CPU trace has no stream, device or collective fields), and
their zeroed values are lazily mapped pages instead of memory written up front (fresh
memory costs a page fault per 4 KiB; reading a cached trace was ~20% page faults)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pandas as pd


def lazy_zeros(n: int, dtype: np.dtype | type) -> np.ndarray:
    """A writable array of ``n`` zeros whose pages are made only when first written.

    A private mapping (``MAP_PRIVATE``): reading it maps the kernel's one zero page, so an
    all-missing column that a table only reads costs no memory. Python's default for an
    anonymous map is shared memory, whose every page read becomes resident (``ranks()``
    read three such columns of a 100 MB trace: +6 MiB)."""
    kind = np.dtype(dtype)
    size = n * kind.itemsize
    if size < mmap.PAGESIZE * 16:  # small: not worth a mapping
        return np.zeros(n, dtype=kind)
    private = getattr(mmap, "MAP_PRIVATE", None)  # (Windows has no flags: its maps are lazy alike)
    pages = mmap.mmap(-1, size) if private is None else mmap.mmap(-1, size, flags=private)
    return np.frombuffer(pages, dtype=kind, count=n)


#: where each array of a ``packed`` block starts: on a cache line
_LINE = 64


def packed(specs: list[tuple[int, np.dtype | type]]) -> list[np.ndarray]:
    """Uninitialized arrays of the given (length, type), carved out of one allocation.

    Fresh memory costs a page fault per 4 KiB page when first written, unless it is in
    huge pages (2 MiB, one fault each), which numpy asks for only for an allocation of
    4 MiB or more, and only for the whole 2 MiB pages inside it: the parse's columns (text
    codes and missing-value masks of 0.7-1.4 MB each on a 100 MB trace, numbers of 5.6 MB)
    made together are one such allocation, nearly all of it in huge pages. Each array
    starts on a cache line; the block lives as long as any of them does.
    """
    kinds = [np.dtype(dtype) for _, dtype in specs]
    sizes = [-(-n * kind.itemsize // _LINE) * _LINE for (n, _), kind in zip(specs, kinds)]
    block = np.empty(sum(sizes) + _LINE, dtype=np.uint8)
    at = -block.ctypes.data % _LINE
    out = []
    for (n, _), kind, size in zip(specs, kinds, sizes):
        out.append(block[at : at + n * kind.itemsize].view(kind))
        at += size
    return out


def all_missing(n: int, floating: bool) -> pd.arrays.IntegerArray | pd.arrays.FloatingArray:
    """A nullable ``Int64`` (``Float64`` if ``floating``) column of ``n`` missing values."""
    if floating:
        return pd.arrays.FloatingArray(lazy_zeros(n, np.float64), np.ones(n, dtype=bool))
    return pd.arrays.IntegerArray(lazy_zeros(n, np.int64), np.ones(n, dtype=bool))


def code_dtype(count: int) -> type[np.signedinteger[Any]]:
    """The integer type pandas keeps the codes of a categorical of ``count`` categories in
    (``coerce_indexer_dtype``): codes made in it are kept as they are, not converted."""
    for dtype in (np.int8, np.int16, np.int32):
        if count < np.iinfo(dtype).max:
            return dtype
    return np.int64
