"""Writing a capture's files: its directory, torch's exporters' output placed atomically.

The names and the manifest are the format's (``tracemagic.trace.layout``, re-exported
here): every file is written under a hidden temporary name in its final directory and
moved into place with ``os.replace``, so a reader never sees a half-written file under a
final name (an interrupted write leaves only a ``.*.partial`` file behind, or nothing).
"""

from __future__ import annotations

import contextlib
import json
import mmap
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
    gzip_to,
    kineto_name,
    memory_name,
    partial_path,
    replace_existing,
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
#: the last capture directory made: ``(folder, NAME-<timestamp>, its number)`` (the next
#: capture made the same second tries the next number first, not every taken one again)
_last_made: tuple[str, str, int] = ("", "", -1)


def make_capture_dir(out: Path, name: str, now: datetime | None = None, *, probe: bool = True) -> Path:
    """Create ``out/NAME-<timestamp>`` (made unique), checking that it can be written.

    The name is made unique by a number (``NAME-<timestamp>-<n>``): each ``mkdir`` is the
    check, so two captures never share one; a capture made in the same second as this
    process's last one starts from the number after that one's.

    Args:
        probe: write and remove a file in it, to check that it can be written (a caller
            that writes a file there at once, such as a session's first manifest, checks by
            that write instead, turning its ``OSError`` into ``unwritable(out, exc)``).

    Raises:
        CaptureError: the directory cannot be created or written, with the reason.
    """
    global _last_made
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    # plain str paths and os calls: pathlib's parsing was most of this function's time
    folder = os.fspath(out)
    base = f"{name}-{stamp}"
    last_folder, last_base, last_n = _last_made
    first = last_n + 1 if last_base == base and last_folder == folder else 0
    try:
        taken: set[str] | None = None
        for n in range(first, first + 1000):
            leaf = base if n == 0 else f"{base}-{n}"
            if taken is not None and leaf in taken:
                continue
            candidate = os.path.join(folder, leaf)
            try:
                os.mkdir(candidate)
            except FileExistsError:
                if taken is None and n - first >= _PROBED:  # many captures this second: skip the names seen taken
                    taken = set(os.listdir(folder))  # (a failed mkdir is cheaper than listing a big folder)
                continue
            except FileNotFoundError:
                if n != first or os.path.isdir(folder):
                    raise
                os.makedirs(folder, exist_ok=True)  # the first capture in a new --out
                try:
                    os.mkdir(candidate)
                except FileExistsError:  # another process's capture, made in between: taken
                    continue
            _last_made = (folder, base, n)
            made = out / leaf
            if probe:
                path = partial_path(made / MANIFEST)
                path.write_text("{}")
                path.unlink()
            return made
    except OSError as exc:
        raise unwritable(out, exc) from None
    raise CaptureError(f"too many captures named {name!r} in {str(out)!r} this second.")


def write_text(final: str, text: str, *, replacing: bool = False) -> None:
    """Write ``text`` (UTF-8) to the file ``final`` atomically, as ``layout.atomic_path``
    does (under the hidden ``.NAME.partial`` name, then moved into place; ``replacing``: the
    final file exists, and the two are swapped), with plain ``os`` calls on ``str`` paths: a
    capture writes its manifest twice inside the user's cell.

    Raises:
        OSError: the file could not be written; nothing is left under either name.
    """
    head, leaf = os.path.split(final)
    tmp = os.path.join(head, f".{leaf}.partial")
    data = text.encode("utf-8")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        if not (replacing and replace_existing(tmp, final)):
            os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
    inspect: Callable[[bytes | mmap.mmap], object] | None = None,
) -> int | None:
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
        inspect: with ``beside``, called with the file's contents (mapped read-only, valid
            during the call) before it is placed: the file is read once, for this and its
            ``traceName``.

    Returns:
        With ``beside`` and no ``gz``, the placed file's size in bytes (read while its
        ``traceName`` was set, so the caller need not ``stat`` it); otherwise None.
    """
    raw_final = final.with_name(final.name[: -len(".gz")]) if final.name.endswith(".gz") else final
    if beside:
        raw = partial_path(raw_final)
        try:
            write(str(raw))
            size = _set_trace_name(raw, final, inspect)
            place(raw, final, gz=gz)
        except BaseException:
            for left in (raw, raw.with_name(raw.name + ".tmp")):  # and Kineto's own temporary file
                with contextlib.suppress(OSError):
                    left.unlink(missing_ok=True)
            raise
        return None if gz else size
    folder = staging_dir(final.parent)
    try:
        raw = folder / raw_final.name
        write(str(raw))
        place(raw, final, gz=gz)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return None


def staging_dir(parent: Path) -> Path:
    """A new hidden staging folder in ``parent`` for ``write_with``."""
    return Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))


#: how far from its end a Kineto trace holds its ``"traceName": ...`` (its last key)
_TAIL = 4096
_TRACE_NAME = b'"traceName": '


def _set_trace_name(written: Path, final: Path, inspect: Callable[[bytes | mmap.mmap], object] | None = None) -> int:
    """Make the ``traceName`` Kineto wrote (the path it was given, ``written``) name
    ``final`` instead, in place: the value is overwritten and padded with spaces (JSON
    whitespace), so nothing else in the file moves. A file whose tail does not hold
    exactly ``"traceName": "<written>"`` (not a Kineto trace, a memory timeline) is left
    as it is; so is a ``final`` whose JSON string would not fit.

    Args:
        inspect: called with the whole file first, mapped (``mmap``, read-only; valid
            only during the call), so the file is read once for both.

    Returns:
        The file's size in bytes (unchanged by the edit).
    """
    old = b'"' + os.fsencode(str(written)) + b'"'
    new = json.dumps(str(final), ensure_ascii=False).encode("utf-8")
    fd = os.open(written, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:  # plain descriptor calls: this runs inside the user's loop, once per window
        size = os.fstat(fd).st_size
        start = max(0, size - _TAIL)
        if inspect is not None:
            if size:  # mapped, not read: no copy of the whole file
                with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
                    inspect(view)
                    tail = view[start:size]
            else:
                inspect(b"")
                tail = b""
        elif len(new) > len(old):
            return size
        else:
            tail = os.pread(fd, size - start, start)
        if len(new) > len(old):
            return size
        at = tail.rfind(_TRACE_NAME + old)
        if at >= 0:
            os.pwrite(fd, new + b" " * (len(old) - len(new)), start + at + len(_TRACE_NAME))
        return size
    finally:
        os.close(fd)


def place(source: Path, final: Path, gz: bool = False) -> None:
    """Move a finished file to ``final`` (gzip-compressing it on the way if ``gz``)."""
    if not gz:
        os.replace(source, final)
        return
    with atomic_path(final) as tmp, open(source, "rb") as fin, gzip_to(tmp, final) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    source.unlink()
