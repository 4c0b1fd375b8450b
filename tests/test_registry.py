"""One registry of the analyses: ``analysis.schema.TABLES`` names each table's function as an
object (``Table.function``, marked ``@computes``), ``tracemagic.Trace``'s methods and the
views' data access are checked against it (a table added without its method, or a method
without its table, fails here), and the intermediate results analyses share are named by
``Shared``'s constants, never by strings typed in two modules."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import TRACES

import tracemagic
from tracemagic.analysis import schema
from tracemagic.analysis.schema import TABLES
from tracemagic.trace.shared_keys import Shared
from tracemagic.views import data as view_data

PACKAGE = Path(tracemagic.__file__).parent
#: ``Trace`` methods returning a table that is another's under an earlier name
ALIASES = {"ranks_table": "ranks"}
#: the views' tables that are a table of the schema called differently
VIEW_ONLY = {"allocations": "biggest_allocations(None): every allocation, largest first"}
#: arguments a method needs
ARGS: dict[str, tuple[Any, ...]] = {"diff": ("self",)}


def _dataframe_methods(cls: type) -> set[str]:
    """The public methods and properties ``cls`` itself defines annotated to return a DataFrame
    (not its base's: ``Trace.table`` computes any analysis)."""
    found = set()
    for name, member in inspect.getmembers(cls):
        function = member.fget if isinstance(member, property) else getattr(member, "func", member)
        if name.startswith("_") or not callable(function) or name not in vars(cls):
            continue
        if inspect.signature(function).return_annotation in ("pd.DataFrame", pd.DataFrame):
            found.add(name)
    return found


def test_every_table_names_its_function() -> None:
    for table in TABLES.values():
        function = table.function
        assert callable(function) and function.__module__.startswith("tracemagic.analysis."), table.name
    with pytest.raises(LookupError, match="no table nope in analysis.schema.TABLES"):
        schema.computes("nope")


def test_a_table_without_a_function_says_how_to_add_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(schema._FUNCTIONS, "ops")
    with pytest.raises(LookupError, match=r"mark its function @computes\('ops'\)"):
        TABLES["ops"].function


@pytest.fixture()
def trace() -> tracemagic.Trace:
    return tracemagic.load(TRACES / "hta_benchmark_simple_add_trace.json.gz", progress=False)


def test_the_trace_methods_are_the_tables(trace: tracemagic.Trace, monkeypatch: pytest.MonkeyPatch) -> None:
    methods = {t.name for t in TABLES.values() if t.method}
    assert _dataframe_methods(tracemagic.Trace) == methods | set(ALIASES)
    called: list[str] = []
    for name in methods:
        real = TABLES[name].function

        def spy(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> pd.DataFrame:
            called.append(_name)
            return TABLES[_name].empty()

        monkeypatch.setattr(sys.modules[real.__module__], real.__name__, functools.wraps(real)(spy))
    for name in sorted(methods):  # each method computes its table's function, nothing else
        called.clear()
        args = [trace if a == "self" else a for a in ARGS.get(name, ())]
        assert list(getattr(trace, name)(*args).columns) == TABLES[name].names, name
        assert called == [name], (name, called)
    for alias, name in ALIASES.items():
        called.clear()
        getattr(trace, alias)()
        assert called in ([name], []), alias  # [] once cached: the same table


def test_the_views_use_the_registry() -> None:
    assert view_data.ANALYSES == {t.name: t.function for t in TABLES.values() if t.method}
    shown = {name for name in _dataframe_methods(view_data.TraceData)  # its tables as properties
             if isinstance(vars(view_data.TraceData)[name], property)}
    assert shown - set(VIEW_ONLY) <= set(TABLES), shown - set(TABLES) - set(VIEW_ONLY)
    assert "ranks" in shown and "ranks_table" not in shown  # one name per table


def _shared_keys(path: Path) -> list[tuple[int, ast.expr]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.lineno, node.args[0]) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "shared"
            and node.args]


def _is_named(key: ast.expr) -> bool:
    if isinstance(key, ast.Tuple) and key.elts:
        key = key.elts[0]
    return isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name) and key.value.id == "Shared"


def test_shared_results_are_named_once() -> None:
    calls = {f"{p.relative_to(PACKAGE)}:{line}": key for p in PACKAGE.rglob("*.py") for line, key in _shared_keys(p)
             if p.relative_to(PACKAGE) != Path("trace/model.py")}  # Trace.table: keyed by the analysis itself
    assert len(calls) >= 15  # the scan sees the calls
    assert [where for where, key in calls.items() if not _is_named(key)] == []
    values = [v for k, v in vars(Shared).items() if k.isupper()]
    assert len(values) == len(set(values))
    # the check itself: a string key is caught
    assert not _is_named(ast.parse('trace.shared("cpu_by_thread", f)').body[0].value.args[0])  # type: ignore[attr-defined]
