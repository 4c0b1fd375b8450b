"""Writing a capture's files: its directory, torch's exporters' output placed atomically.

The names and the manifest are the format's (``tracemagic.trace.layout``, re-exported
here): every file is written under a hidden temporary name in its final directory and
moved into place with ``os.replace``, so a reader never sees a half-written file under a
final name (an interrupted write leaves only a ``.*.partial`` file behind, or nothing).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from tracemagic.errors import CaptureError
from tracemagic.trace.layout import (  # noqa: F401 - the format's names and writers, used as files.X
    MANIFEST,
    atomic_path,
    et_name,
    kineto_name,
    memory_name,
    partial_path,
    write_json,
)


def tb_worker() -> str:
    """``<hostname>_<pid>``: ``tensorboard_trace_handler``'s default worker name."""
    return f"{socket.gethostname()}_{os.getpid()}"


def tb_name(worker: str, ts: int | None = None, gz: bool = False) -> str:
    """``<worker>.<ts>.pt.trace.json[.gz]``, as ``torch.profiler.tensorboard_trace_handler``
    names its files (``ts``: ``time.time_ns()`` when the trace is written)."""
    stamp = time.time_ns() if ts is None else ts
    return f"{worker}.{stamp}.pt.trace.json" + (".gz" if gz else "")


#: names ``make_capture_dir`` tries one by one before it lists the folder
_PROBED = 8


def make_capture_dir(out: Path, name: str, now: datetime | None = None, *, probe: bool = True) -> Path:
    """Create ``out/NAME-<timestamp>`` (made unique), checking that it can be written.

    Args:
        probe: write and remove a file in it, to check that it can be written (a caller
            that writes a file there at once, such as a session's first manifest, checks by
            that write instead, turning its ``OSError`` into ``unwritable(out, exc)``).

    Raises:
        CaptureError: the directory cannot be created or written, with the reason.
    """
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    try:
        if not out.is_dir():  # one stat where it exists (mkdir would fail, then stat it)
            out.mkdir(parents=True, exist_ok=True)
        taken: set[str] | None = None
        for n in range(1000):
            candidate = out / (f"{name}-{stamp}" if n == 0 else f"{name}-{stamp}-{n}")
            if taken is not None and candidate.name in taken:
                continue
            try:
                candidate.mkdir()
            except FileExistsError:
                if taken is None and n >= _PROBED:  # many captures this second: skip the names seen taken
                    taken = set(os.listdir(out))  # (a failed mkdir is cheaper than listing a big folder)
                continue
            if probe:
                path = partial_path(candidate / MANIFEST)
                path.write_text("{}")
                path.unlink()
            return candidate
    except OSError as exc:
        raise unwritable(out, exc) from None
    raise CaptureError(f"too many captures named {name!r} in {str(out)!r} this second.")


def unwritable(out: Path, exc: OSError) -> CaptureError:
    """The error for a capture that cannot be written under ``--out out``."""
    return CaptureError(
        f"cannot write the capture to --out {str(out)!r}: {exc.strerror or exc}. "
        "Pick a writable directory with --out DIR."
    )


def write_with(
    final: Path,
    write: Callable[[str], None],
    gz: bool = False,
    *,
    beside: bool = False,
) -> None:
    """Let ``write(path)`` (a torch exporter) write plain JSON, then place it atomically.

    By default the exporter writes into a hidden staging folder (``.partial-*``: writers
    sharing the directory never remove one another's) under the file's own name, and the
    file is moved out when done.

    Args:
        beside: write under the hidden name ``.<name>.partial`` in ``final``'s own directory
            instead (no folder made or removed: a capture session's files, written inside
            the user's loop). A Kineto trace's ``traceName`` (the path torch wrote to) is
            then set to ``final``'s path (``_set_trace_name``), as torch's own exporters
            write it. An exporter that fails leaves nothing behind either way.
    """
    raw_final = final.with_name(final.name[: -len(".gz")]) if final.name.endswith(".gz") else final
    if beside:
        raw = partial_path(raw_final)
        try:
            write(str(raw))
            _set_trace_name(raw, final)
            place(raw, final, gz=gz)
        except BaseException:
            for left in (raw, raw.with_name(raw.name + ".tmp")):  # and Kineto's own temporary file
                with contextlib.suppress(OSError):
                    left.unlink(missing_ok=True)
            raise
        return
    folder = staging_dir(final.parent)
    try:
        raw = folder / raw_final.name
        write(str(raw))
        place(raw, final, gz=gz)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def staging_dir(parent: Path) -> Path:
    """A new hidden staging folder in ``parent`` for ``write_with``."""
    return Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))


#: how far from its end a Kineto trace holds its ``"traceName": ...`` (its last key)
_TAIL = 4096
_TRACE_NAME = b'"traceName": '


def _set_trace_name(written: Path, final: Path) -> None:
    """Make the ``traceName`` Kineto wrote (the path it was given, ``written``) name
    ``final`` instead, in place: the value is overwritten and padded with spaces (JSON
    whitespace), so nothing else in the file moves. A file whose tail does not hold
    exactly ``"traceName": "<written>"`` (not a Kineto trace, a memory timeline) is left
    as it is; so is a ``final`` whose JSON string would not fit."""
    old = b'"' + os.fsencode(str(written)) + b'"'
    new = json.dumps(str(final), ensure_ascii=False).encode("utf-8")
    if len(new) > len(old):
        return
    with open(written, "r+b") as fh:
        start = max(0, fh.seek(0, os.SEEK_END) - _TAIL)
        fh.seek(start)
        at = fh.read().rfind(_TRACE_NAME + old)
        if at >= 0:
            fh.seek(start + at + len(_TRACE_NAME))
            fh.write(new + b" " * (len(old) - len(new)))


def place(source: Path, final: Path, gz: bool = False) -> None:
    """Move a finished file to ``final`` (gzip-compressing it on the way if ``gz``)."""
    if not gz:
        os.replace(source, final)
        return
    with atomic_path(final) as tmp, open(source, "rb") as fin, gzip.open(tmp, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    source.unlink()
