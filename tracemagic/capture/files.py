"""Writing a capture's files: its directory, torch's exporters' output placed atomically.

The names and the manifest are the format's (``tracemagic.trace.layout``, re-exported
here): every file is written under a hidden temporary name in its final directory and
moved into place with ``os.replace``, so a reader never sees a half-written file under a
final name (an interrupted write leaves only a ``.*.partial`` file behind, or nothing).
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import tempfile
import threading
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


def make_capture_dir(out: Path, name: str, now: datetime | None = None) -> Path:
    """Create ``out/NAME-<timestamp>`` (made unique), checking that it can be written.

    Raises:
        CaptureError: the directory cannot be created or written, with the reason.
    """
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    try:
        out.mkdir(parents=True, exist_ok=True)
        taken: set[str] | None = None
        for n in range(1000):
            candidate = out / (f"{name}-{stamp}" if n == 0 else f"{name}-{stamp}-{n}")
            if taken is not None and candidate.name in taken:
                continue
            try:
                candidate.mkdir()
            except FileExistsError:
                if taken is None:  # several captures this second: skip the names seen taken
                    taken = set(os.listdir(out))
                continue
            probe = partial_path(candidate / MANIFEST)
            probe.write_text("{}")
            probe.unlink()
            return candidate
    except OSError as exc:
        raise CaptureError(
            f"cannot write the capture to --out {str(out)!r}: {exc.strerror or exc}. "
            "Pick a writable directory with --out DIR."
        ) from None
    raise CaptureError(f"too many captures named {name!r} in {str(out)!r} this second.")


def write_with(
    final: Path, write: Callable[[str], None], gz: bool = False, *, cleaners: list[threading.Thread] | None = None
) -> None:
    """Let ``write(path)`` (a torch exporter) write plain JSON, then place it atomically.

    The exporter writes into a hidden staging folder of its own (``.partial-*``: ranks
    sharing the directory never remove one another's) under the file's own name (Kineto
    records that name as ``traceName``), and the file is moved out when done.

    Args:
        cleaners: where given, the staging folder is removed by a background thread added
            to this list (removing a folder can wait milliseconds on the disk, inside the
            user's loop); the caller joins them before it is done.
    """
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=final.parent))
    raw = staging / (final.name[: -len(".gz")] if final.name.endswith(".gz") else final.name)
    try:
        write(str(raw))
        place(raw, final, gz=gz)
    finally:
        if cleaners is None:
            shutil.rmtree(staging, ignore_errors=True)
        else:
            cleaner = threading.Thread(
                target=shutil.rmtree,
                args=(staging,),
                kwargs={"ignore_errors": True},
                name="tracemagic-cleanup",
                daemon=True,
            )
            cleaner.start()
            cleaners.append(cleaner)


def place(source: Path, final: Path, gz: bool = False) -> None:
    """Move a finished file to ``final`` (gzip-compressing it on the way if ``gz``)."""
    if not gz:
        os.replace(source, final)
        return
    with atomic_path(final) as tmp, open(source, "rb") as fin, gzip.open(tmp, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    source.unlink()
