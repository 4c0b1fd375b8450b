"""The C scanner (tracemagic/trace/_scan.c, with the vendored yyjson) as an optional
extension: where it cannot be compiled, tracemagic installs without it and parses with
msgspec alone (the same columns, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tracemagic.trace._scan",
            sources=["tracemagic/trace/_scan.c", "vendor/yyjson/yyjson.c"],
            include_dirs=["vendor/yyjson"],
            optional=True,
        )
    ]
)
