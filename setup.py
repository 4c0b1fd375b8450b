"""Two optional C extensions: the scanner (tracemagic/trace/_scan.c, with the vendored
yyjson) and the one-pass nesting (tracemagic/trace/_nesting.c). Where they cannot be
compiled, tracemagic installs without them and uses msgspec and numpy alone (the same
tables, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tracemagic.trace._scan",
            sources=["tracemagic/trace/_scan.c", "vendor/yyjson/yyjson.c"],
            include_dirs=["vendor/yyjson"],
            optional=True,
        ),
        Extension("tracemagic.trace._nesting", sources=["tracemagic/trace/_nesting.c"], optional=True),
    ]
)
