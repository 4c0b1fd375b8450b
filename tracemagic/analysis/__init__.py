"""Analyses: a loaded ``Trace`` in, a pandas DataFrame out. They never draw.

Each module exposes one function named like the ``Trace`` method that calls it
(``tracemagic.analysis.layers.layers(trace)`` is ``trace.layers()``). Times are µs;
``ts`` columns are µs since the trace's start (the earliest event over all ranks), so
tables of one trace line up. Every per-event or per-rank table has a ``rank`` column (0
for single-rank traces). Row columns (``row``, ``op_row``, ``parent``) are positions in
``trace.events``, -1 for none.

The cross-rank tables (``steps``, ``ranks``, ``collectives``, ``stragglers``) are also made
from per-rank summaries (``ranks.summarize`` and ``ranks.*_of``), so that
``tracemagic.load_ranks`` can summarize each rank of a job where it runs; they have the same
columns either way.

Column contracts (views rely on these names): ``tracemagic/analysis/schema.py`` holds each
table's columns in order, with dtype and meaning; the list below is made from it, and the
tests check real tables against it.

"""

# every analysis module, so that each table's ``Table.function`` (marked ``@computes``) is
# known wherever the package is used, and the contract list below names it
from tracemagic.analysis import (  # noqa: F401 - imported for their @computes marks
    advice,
    diff,
    efficiency,
    et_graph,
    iterations,
    kernels,
    layers,
    lines,
    memory,
    ops,
    phases,
    ranks,
    shapes,
    sites,
    source,
    spans,
    steps,
    syncs,
)
from tracemagic.analysis.schema import describe as _describe

__doc__ = f"{__doc__}{_describe()}\n"
