"""Exporters: a loaded trace written in other tools' formats.

Every writer here has one shape: ``to_<format>(trace, path, *, options) -> list[Path]``, a
loaded ``Trace`` in, the files written out (``chrome.to_chrome_trace``, ``dftracer.to_pfw``,
``stacks.to_folded``, ``stacks.to_speedscope``); ``tests/test_exporters.py`` checks it.
``chakra`` checks a capture for Chakra's tools and prints their command lines (it writes
nothing); ``chisel`` is the Chisel-compatible ``@capture_model`` API.
"""
