"""Whole-trace columns that cost no memory until used: most args columns of a trace are
missing on every event (a CPU trace has no stream, device or collective fields), and
their zeroed values are lazily mapped pages instead of memory written up front (fresh
memory costs a page fault per 4 KiB; reading a cached trace was ~20% page faults)."""

from __future__ import annotations

import contextlib
import mmap
import sys
from typing import Any

import numpy as np
import pandas as pd

#: ``madvise`` advice (Linux 5.14+; Python 3.11's ``mmap`` has no name for it): map every
#: page of a range for reading at once (the zero page, for memory never written)
_MADV_POPULATE_READ = 22
#: the same for writing: every page of a range made (zeroed, resident) at once
_MADV_POPULATE_WRITE = 23
#: ``fresh`` maps arrays of at least this many bytes (smaller ones come from the heap)
_FRESH_MIN_BYTES = 64 << 10


def lazy_zeros(n: int, dtype: np.dtype | type, populate: bool = False) -> np.ndarray:
    """A writable array of ``n`` zeros whose pages are made only when first written.

    A private mapping (``MAP_PRIVATE``): reading it maps the kernel's one zero page, so an
    all-missing column that a table only reads costs no memory. Python's default for an
    anonymous map is shared memory, whose every page read becomes resident (``ranks()``
    read three such columns of a 100 MB trace: +6 MiB).

    ``populate``: the zero page mapped for reading all over it at once (~0.06 ms for 2 MiB,
    a fifth of the read faults it saves; still no memory), for a column partly written
    whose unwritten pages are read anyway: by the tables, and by the cache's writer, whose
    ``write`` of a buffer with pages not yet mapped fills the file's page cache in single
    pages (its copy stops at each fault and goes on a page at a time), which made reopening
    a 100 MB trace ~10% slower."""
    kind = np.dtype(dtype)
    size = n * kind.itemsize
    if size < mmap.PAGESIZE * 16:  # small: not worth a mapping
        return np.zeros(n, dtype=kind)
    private = getattr(mmap, "MAP_PRIVATE", None)  # (Windows has no flags: its maps are lazy alike)
    try:
        pages = mmap.mmap(-1, size) if private is None else mmap.mmap(-1, size, flags=private)
    except OSError:  # no mapping left (vm.max_map_count): the heap's zeros, the same array
        return np.zeros(n, dtype=kind)
    if populate and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # (an older kernel: the pages are mapped as read)
            pages.madvise(_MADV_POPULATE_READ)
    return np.frombuffer(pages, dtype=kind, count=n)


def fresh(n: int, dtype: np.dtype | type, populate: bool = True) -> np.ndarray:
    """A new array of ``n`` items (its contents unspecified, as ``np.empty``'s) for a column
    written all over at once: a large one is a private mapping whose pages are all made in
    one call (``MADV_POPULATE_WRITE``) rather than by a page fault per 4 KiB as it is
    written (``np.empty``'s fresh memory): ~0.6 ms instead of ~0.9 ms a 2 MiB column, ~20
    such columns in a 100 MB trace's load. Its pages go back to the system when it is
    freed. Where the advice is not known (not Linux, a kernel before 5.14), the pages are
    made as they are written, as ``np.empty``'s.

    ``populate=False``: the pages are left for the writer to make (the C scanner's
    ``join_*`` make them without holding the GIL, so that two threads do it side by side)."""
    kind = np.dtype(dtype)
    size = n * kind.itemsize
    private = getattr(mmap, "MAP_PRIVATE", None)
    if size < _FRESH_MIN_BYTES or private is None or not sys.platform.startswith("linux"):
        return np.empty(n, dtype=kind)
    try:
        pages = mmap.mmap(-1, size, flags=private)
    except OSError:  # no mapping left (vm.max_map_count): the heap's
        return np.empty(n, dtype=kind)
    if populate:
        with contextlib.suppress(OSError):
            pages.madvise(_MADV_POPULATE_WRITE)
    return np.frombuffer(pages, dtype=kind, count=n)


def partly_written(n: int, dtype: np.dtype | type, spans: list[tuple[int, int]]) -> np.ndarray:
    """``lazy_zeros(n, dtype, populate=True)`` for a column about to be written at the rows
    ``spans`` (``(start, stop)``, in order) alone: their pages are made for writing at once
    (``fresh``'s advice: not a page fault each as they are written, nor the zero page mapped
    first), the others map the zero page (no memory)."""
    kind = np.dtype(dtype)
    size = n * kind.itemsize
    private = getattr(mmap, "MAP_PRIVATE", None)
    if size < mmap.PAGESIZE * 16 or private is None or not sys.platform.startswith("linux"):
        return lazy_zeros(n, kind, populate=True)
    try:
        pages = mmap.mmap(-1, size, flags=private)
    except OSError:  # no mapping left (vm.max_map_count): the heap's zeros
        return np.zeros(n, dtype=kind)
    page = mmap.PAGESIZE
    with contextlib.suppress(OSError):
        for start, stop in _merged(spans):
            first = start * kind.itemsize // page * page  # (the pages the rows lie on, whole)
            pages.madvise(_MADV_POPULATE_WRITE, first, min(stop * kind.itemsize, size) - first)
        pages.madvise(_MADV_POPULATE_READ)  # the rest: the zero page
    return np.frombuffer(pages, dtype=kind, count=n)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ordered row spans with the touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in spans:
        if out and out[-1][1] >= start:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        elif stop > start:
            out.append((start, stop))
    return out


def all_missing(
    n: int, floating: bool, mask: np.ndarray | None = None
) -> pd.arrays.IntegerArray | pd.arrays.FloatingArray:
    """A nullable ``Int64`` (``Float64`` if ``floating``) column of ``n`` missing values
    (``mask``: memory for its mask, ``n`` bools, contents garbage; else ``fresh``'s)."""
    mask = fresh(n, bool) if mask is None else mask
    mask.fill(True)
    if floating:
        return pd.arrays.FloatingArray(lazy_zeros(n, np.float64), mask)
    return pd.arrays.IntegerArray(lazy_zeros(n, np.int64), mask)


def code_dtype(count: int) -> type[np.signedinteger[Any]]:
    """The integer type pandas keeps the codes of a categorical of ``count`` categories in
    (``coerce_indexer_dtype``): codes made in it are kept as they are, not converted."""
    for dtype in (np.int8, np.int16, np.int32):
        if count < np.iinfo(dtype).max:
            return dtype
    return np.int64


#: ``Carver``'s alignment of the arrays it hands out, in bytes (a cache line)
_CARVE_ALIGN = 64


class Carver:
    """The parse's scan pools (``parse.scan_pool``), their pages already made as the chunks
    were decoded in them, handed out as new columns: a fresh page costs a page fault each
    4 KiB (~0.5-0.85 ms a MB here, not faster on two threads), a made one nothing. A
    column carved from a pool keeps the whole mapping alive as long as it lives.

    The pools hold garbage: only a column written all over by its maker may be carved."""

    def __init__(self, pools: list[mmap.mmap]) -> None:
        self._pools = pools
        self._used = [0] * len(pools)

    def take(self, n: int, dtype: np.dtype | type) -> np.ndarray | None:
        """An array of ``n`` items over a pool's free room (its contents garbage), or None
        where none has room for it (or it is small enough for the heap)."""
        kind = np.dtype(dtype)
        size = n * kind.itemsize
        if size < _FRESH_MIN_BYTES:
            return None
        for k, pool in enumerate(self._pools):
            start = -(-self._used[k] // _CARVE_ALIGN) * _CARVE_ALIGN
            if start + size <= len(pool):
                self._used[k] = start + size
                return np.frombuffer(pool, dtype=kind, count=n, offset=start)
        return None

    def close(self) -> None:
        """Hand back what was not carved: a pool with no column in it is unmapped, the rest
        of one past its last column given back (``MADV_DONTNEED``)."""
        page = mmap.PAGESIZE
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        for pool, used in zip(self._pools, self._used):
            if not used:
                pool.close()
                continue
            start = -(-used // page) * page
            if dontneed is not None and start < len(pool):
                with contextlib.suppress(OSError):
                    pool.madvise(dontneed, start, len(pool) - start)
        self._pools, self._used = [], []


def zero_rows(values: np.ndarray, start: int, stop: int) -> None:
    """Rows ``[start, stop)`` of a ``Carver``'s array (1-d) set to zeros: the whole pages
    they cover handed back (``MADV_DONTNEED``: a private anonymous map's pages then read as
    zeros again and hold no memory until written), the rest written. Where the array is no
    map's or the advice fails, all written."""
    pool = values.base.obj if isinstance(values.base, memoryview) else values.base  # (``frombuffer``'s)
    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    if isinstance(pool, mmap.mmap) and dontneed is not None and sys.platform.startswith("linux"):
        page, size = mmap.PAGESIZE, values.itemsize
        at = values.ctypes.data - np.frombuffer(pool, dtype=np.uint8, count=1).ctypes.data  # in the map
        lo, hi = at + start * size, at + stop * size
        first, last = -(-lo // page) * page, hi // page * page
        if last > first:
            try:
                pool.madvise(dontneed, first, last - first)
            except OSError:
                pass
            else:
                raw = values.view(np.uint8)
                raw[lo - at : first - at] = 0
                raw[last - at : hi - at] = 0
                return
    values[start:stop] = 0
