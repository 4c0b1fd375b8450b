"""Progress of long loads: a callback ``(done_bytes, total_bytes)``, and the default bars.

The loader only ever calls a plain callable, so it imports no view code. ``bar_for`` picks
the default: an ipywidgets ``FloatProgress`` inside a Jupyter kernel that has widgets, a
one-line bar on stderr when it is a terminal, nothing otherwise; and only for inputs larger
than ``AUTO_MIN_BYTES`` unless asked for explicitly.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: below this many bytes on disk a load is quick: no bar unless ``progress=True``
AUTO_MIN_BYTES = 50 * 1024 * 1024

Progress = Callable[[int, int], None]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 10e6 else f"{n / 1e6:,.1f} MB"


class TerminalBar:
    """``tracemagic: loading NAME  [#####.....]  45%  120/260 MB`` redrawn on one stderr line."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30, interval: float = 0.1) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.interval = interval
        self._last = 0.0
        self._closed = False

    def __call__(self, done: int, total: int) -> None:
        if self._closed:
            return
        now = time.monotonic()
        finished = total > 0 and done >= total
        if not finished and now - self._last < self.interval:
            return
        self._last = now
        frac = min(1.0, done / total) if total > 0 else 0.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\rtracemagic: loading {self.label} [{bar}] {frac:4.0%} {_mb(done)}/{_mb(total)}")
        if finished:
            self.stream.write("\n")
            self._closed = True
        self.stream.flush()


class WidgetBar:
    """An ipywidgets progress bar shown in the notebook output, removed when the load ends."""

    def __init__(self, label: str) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        self._bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="Loading", bar_style="info")
        self._text = widgets.Label(value=label)
        self._box = widgets.HBox([self._bar, self._text])
        self._label = label
        self._last = 0.0
        display(self._box)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        if not finished and now - self._last < 0.1:
            return
        self._last = now
        self._bar.value = min(1.0, done / total) if total > 0 else 0.0
        self._text.value = f"{self._label}  {_mb(done)} / {_mb(total)}"
        if finished:
            self._box.close()


def in_widget_kernel() -> bool:
    """Whether we run inside a Jupyter kernel where ipywidgets can render."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell: Any = ipython.get_ipython()
    except AttributeError:
        return False
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401 - whether it is installed
    except ImportError:
        return False
    return True


def bar_for(progress: bool | Progress | None, total: int, label: str) -> Progress | None:
    """The callback to use for ``load(progress=...)``.

    ``None`` (default): a bar only for inputs over ``AUTO_MIN_BYTES``; ``True``: always a
    bar (where one can be shown); ``False``: none; a callable: that callable.
    """
    if callable(progress):
        return progress
    if progress is False or (progress is None and total < AUTO_MIN_BYTES):
        return None
    if in_widget_kernel():
        try:
            return WidgetBar(label)
        except Exception:  # noqa: BLE001 - a frontend without widgets: fall back to text
            pass
    stream = sys.stderr
    if progress is True or (stream is not None and hasattr(stream, "isatty") and stream.isatty()):
        return TerminalBar(label, stream)
    return None


class Aggregate:
    """Progress over several files: each file's (done, total) added to what came before."""

    def __init__(self, callback: Progress, total: int) -> None:
        self.callback = callback
        self.total = total
        self.base = 0

    def file(self, size: int) -> Progress:
        base = self.base
        self.base += size

        def report(done: int, _total: int) -> None:
            self.callback(min(base + done, self.total), self.total)

        return report

    def advance(self, size: int) -> None:
        self.base += size
        self.callback(min(self.base, self.total), self.total)
