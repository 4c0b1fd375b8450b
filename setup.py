"""Two optional C extensions: the scanner (tracemagic/trace/_scan.c, with the vendored
yyjson) and the one-pass nesting (tracemagic/trace/_nesting.c). Where they cannot be
compiled, tracemagic installs without them and uses msgspec and numpy alone (the same
tables, slower). ``TRACEMAGIC_NO_C=1`` installs without them on purpose (the test of
the dependency lower bounds does, so its editable install leaves the C code built by the
main environment in the source tree alone)."""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[] if os.environ.get("TRACEMAGIC_NO_C") == "1" else [
        Extension(
            "tracemagic.trace._scan",
            sources=["tracemagic/trace/_scan.c", "vendor/yyjson/yyjson.c"],
            include_dirs=["vendor/yyjson"],
            # no comments, trailing commas, NaN/Infinity literals or invalid Unicode: the scanner
            # asks for none of them (msgspec reads those), and yyjson reads 2-6% faster without
            define_macros=[("YYJSON_DISABLE_NON_STANDARD", "1")],
            optional=True,
        ),
        Extension("tracemagic.trace._nesting", sources=["tracemagic/trace/_nesting.c"], optional=True),
    ]
)
