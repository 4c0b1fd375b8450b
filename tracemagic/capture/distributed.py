"""Several ranks, one capture directory: agreeing on it, and the manifest of all ranks.

Every rank of a ``torchrun`` job writes its own files into ONE directory:

- The directory: with an initialized process group, rank 0 creates ``OUT/NAME-<timestamp>``
  and hands its name to the others through the process group's store (no collective, so
  no device is touched); without one, every rank derives the same name from the launcher's
  environment (``TORCHELASTIC_RUN_ID``, else ``MASTER_ADDR``/``MASTER_PORT``).
- Each rank writes its own manifest ``ranks/<rank>.json`` when it finishes (also when its
  block raised). ``capture.json``, the manifest of all ranks, is merged from those under a
  file lock by rank 0 once every rank is done (or its wait timed out) and again by any rank
  finishing later, so it always lists what is on disk and names the ranks still missing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from tracemagic.capture import files
from tracemagic.errors import CaptureError, TraceError
from tracemagic.trace import layout
from tracemagic.trace.layout import FileEntry, FileKind, Manifest, RankSummary

#: Folder of the per-rank manifests inside a capture directory.
RANKS_DIR = layout.RANKS_DIR
_STORE_PREFIX = "tracemagic/capture"
_sequence = itertools.count()


def rank_and_world() -> tuple[int, int, bool]:
    """This process's rank, the world size, and whether a process group is initialized.

    The process group wins; else the launcher's ``RANK``/``WORLD_SIZE`` (torchrun sets them
    before the script runs); else a single process ``(0, 1, False)``.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), True
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1, False
    return (rank, world, False) if world > 1 and 0 <= rank < world else (0, 1, False)


def part_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its own manifest: ``ranks/<rank>.json``."""
    return layout.part_path(directory, rank)


def shared_directory(out: Path, name: str, rank: int, world: int, initialized: bool, timeout: float) -> Path:
    """The capture directory every rank of the job agrees on (created, writable).

    Args:
        out: the parent directory (``--out``).
        name: the capture name (``--name``).
        rank: this process's rank.
        world: the world size (1: a plain ``OUT/NAME-<timestamp>``).
        initialized: whether a process group is initialized (rank 0 then picks the name).
        timeout: seconds a rank waits for rank 0's choice.

    Raises:
        CaptureError: the directory cannot be created, or rank 0 did not publish it in time.
    """
    if world == 1:
        return files.make_capture_dir(out, name)
    seq = next(_sequence)
    if initialized:
        return _from_rank0(out, name, rank, seq, timeout)
    return _from_environment(out, name, seq)


def _from_rank0(out: Path, name: str, rank: int, seq: int, timeout: float) -> Path:
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"{_STORE_PREFIX}/{restart}/{seq}"
    chosen: str | None = None
    error: str | None = None
    if rank == 0:
        try:
            chosen = str(files.make_capture_dir(out, name).resolve())
        except CaptureError as exc:
            error = str(exc)
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - torch's private API: any failure means no store; one small collective instead
        store = None
    if store is not None:
        if rank == 0:
            store.set(key, "!" + error if error else chosen or "")
        else:
            try:
                store.wait([key], timedelta(seconds=timeout))
            except Exception as exc:  # noqa: BLE001 - the store's timeout error differs across torch versions
                raise CaptureError(
                    f"rank {rank}: rank 0 did not share the capture directory within "
                    f"{timeout:g} s ({type(exc).__name__}: {exc})."
                ) from None
            value = store.get(key).decode()
            chosen, error = (None, value[1:]) if value.startswith("!") else (value, None)
    else:
        box: list[Any] = [[chosen, error]]
        dist.broadcast_object_list(box, src=0)
        chosen, error = box[0]
    if error or chosen is None:
        raise CaptureError(f"rank 0 could not create the capture directory: {error}")
    path = Path(chosen)
    if not path.is_dir():
        raise CaptureError(
            f"rank {rank}: the capture directory {chosen!r} chosen by rank 0 is not visible "
            "here; ranks on several machines need --out on a shared file system."
        )
    return path


def _from_environment(out: Path, name: str, seq: int) -> Path:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        tag = run_id
    else:
        tag = f"{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ.get('MASTER_PORT', '0')}"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0":
        tag += f"-restart{restart}"
    if seq:
        tag += f"-{seq}"
    safe = "".join(c if c.isalnum() or c in "_.+-" else "_" for c in tag)
    path = out / f"{name}-{safe}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaptureError(f"cannot write the capture to {str(out)!r}: {exc.strerror or exc}.") from None
    return path


def write_part(directory: Path, rank: int, manifest: Manifest) -> None:
    """Write rank ``rank``'s own manifest (atomically)."""
    path = part_path(directory, rank)
    path.parent.mkdir(exist_ok=True)
    layout.write_manifest(path, manifest)


def read_parts(directory: Path, world: int) -> dict[int, Manifest]:
    """The per-rank manifests present, by rank (unreadable ones are skipped)."""
    parts: dict[int, Manifest] = {}
    for rank in range(world):
        path = part_path(directory, rank)
        with contextlib.suppress(TraceError):
            parts[rank] = layout.read_manifest(path)
    return parts


def wait_for_ranks(
    directory: Path,
    world: int,
    timeout: float,
    poll: float = 0.05,
    cancelled: Callable[[], bool] | None = None,
) -> list[int]:
    """Wait until every rank has finished (written its final manifest) or ``timeout`` passes.

    ``cancelled()`` returning True ends the wait early (the job is being stopped).

    Returns:
        The ranks that have not finished, ascending (empty when all are done).
    """
    deadline = time.monotonic() + timeout
    while True:
        parts = read_parts(directory, world)
        pending = [r for r in range(world) if parts.get(r, {}).get("status", "running") == "running"]
        if not pending or time.monotonic() >= deadline or (cancelled is not None and cancelled()):
            return pending
        time.sleep(poll)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    lock = directory / RANKS_DIR / ".lock"
    lock.parent.mkdir(exist_ok=True)
    with open(lock, "a") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: last writer wins
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_merged_manifest(directory: Path, world: int) -> Manifest:
    """Merge the per-rank manifests into ``capture.json`` (under a lock) and return it."""
    with _locked(directory):
        manifest = merge(read_parts(directory, world), world)
        _keep_left_files(directory, manifest)
        layout.write_manifest(directory, manifest)
    return manifest


#: the files a rank writes before its manifest, by the ``kind`` the manifest gives them
_RANK_FILES: dict[FileKind, re.Pattern[str]] = {
    layout.KINETO_KIND: layout.KINETO_FILE,
    layout.ET_KIND: layout.ET_FILE,
    layout.MEMORY_KIND: layout.MEMORY_FILE,
}


def _keep_left_files(directory: Path, manifest: Manifest) -> None:
    """List the finished files of the ranks that left no manifest (killed after writing
    their trace), so that ``tracemagic.load`` reads them; such a rank counts as failed."""
    missing = set(manifest.get("missing_ranks") or [])
    if not missing:
        return
    entries, ranks, failed = (
        manifest.setdefault("files", []),
        manifest.setdefault("ranks", {}),
        manifest.get("failed_ranks", []),
    )
    listed = {e.get("path") for e in entries}
    found: dict[int, list[str]] = {}
    for path in sorted(directory.iterdir()):
        for kind, pattern in _RANK_FILES.items():
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) in missing and path.name not in listed and path.is_file():
                rank = int(match.group(1))
                entry: FileEntry = {"path": path.name, "kind": kind, "rank": rank, "bytes": path.stat().st_size}
                if match.group(2) is not None:
                    entry["cycle"] = int(match.group(2))
                entries.insert(len(entries) - 1, entry)  # before capture.json
                found.setdefault(rank, []).append(path.name)
    for rank, names in sorted(found.items()):
        ranks[str(rank)] = {
            "status": "failed",
            "steps_recorded": None,
            "iterations": None,
            "error": {"type": "missing", "message": "the rank stopped before writing its manifest"},
            "notes": [f"kept what it wrote before it stopped: {', '.join(names)}"],
        }
        manifest.setdefault("notes", []).append(
            f"rank {rank}: kept what it wrote before it stopped: {', '.join(names)}."
        )
    manifest["failed_ranks"] = sorted(set(failed) | set(found))


def merge(parts: dict[int, Manifest], world: int) -> Manifest:
    """The manifest of all ranks from each rank's own.

    Top-level fields are rank 0's (else the first rank present), with ``rank`` dropped and:
    ``status`` (``complete`` only when every rank is), ``ranks`` (per rank: status, steps,
    error, notes), ``missing_ranks`` (no final manifest: crashed, killed or still running),
    ``failed_ranks`` (their block raised), ``files`` (every rank's), ``steps`` (rank 0's).
    """
    done = {r: p for r, p in parts.items() if p.get("status") != "running"}
    missing = [r for r in range(world) if r not in done]
    failed = sorted(r for r, p in done.items() if p.get("error"))
    base: Manifest = (done.get(0) or next(iter(done.values()), None) or parts.get(0) or Manifest()).copy()
    base.pop("rank", None)
    entries: list[FileEntry] = []
    ranks: dict[str, RankSummary] = {}
    modules_by_file: dict[str, Any] = {}
    for rank in sorted(done):
        part = done[rank]
        own = [e for e in part.get("files", []) if e.get("kind") != layout.MANIFEST_KIND]
        entries.extend(own)
        entries.append({"path": f"{RANKS_DIR}/{rank}.json", "kind": layout.RANK_MANIFEST_KIND, "rank": rank})
        ranks[str(rank)] = {
            "status": part.get("status"),
            "steps_recorded": part.get("steps_recorded", 0),
            "iterations": part.get("iterations"),
            "error": part.get("error"),
            "notes": part.get("notes", []),
        }
        by_file = part.get("modules_by_file") or {
            e["path"]: part.get("modules", {}) for e in own if e.get("kind") == layout.KINETO_KIND
        }
        modules_by_file.update(by_file)
    entries.append({"path": files.MANIFEST, "kind": layout.MANIFEST_KIND})
    statuses = [p.get("status") for p in done.values()]
    if not done or all(s in ("failed", "empty") for s in statuses):
        status = "failed" if failed or missing else "empty"
    elif missing or any(s != "complete" for s in statuses):
        status = "partial"
    else:
        status = "complete"
    notes = [f"rank {r} did not finish: it left no manifest (crashed, killed or still running)." for r in missing]
    notes += [f"rank {r}: {n}" for r in sorted(done) for n in done[r].get("notes", [])]
    base.update(
        {
            "status": status,
            "world_size": world,
            "ranks": ranks,
            "missing_ranks": missing,
            "failed_ranks": failed,
            "files": entries,
            "notes": notes,
        }
    )
    if modules_by_file and any(m != base.get("modules") for m in modules_by_file.values()):
        base["modules_by_file"] = modules_by_file
    return base
