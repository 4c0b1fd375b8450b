# The C extension _nesting.c (optional: the pure-Python path runs without it); its functions
# are typed as Any here, their contracts are in the C file and the Python callers.
from typing import Any

def __getattr__(name: str) -> Any: ...
