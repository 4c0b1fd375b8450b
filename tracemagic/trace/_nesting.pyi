# The C extension _nesting.c (optional: the pure-Python path runs without it): nest_rows
# (structure.nest in one call, any number of threads) and propagate (structure.propagate).
# Typed as Any here; their contracts are in the C file's docstrings and the Python callers.
from typing import Any

def __getattr__(name: str) -> Any: ...
