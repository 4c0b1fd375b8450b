"""The on-disk format of a capture directory, defined once: file names, the manifest.

A ``%%chakra_trace`` (or ``tracemagic.capture``, or torchrun) capture directory holds::

    kineto_trace_<rank>[_cycle<k>].json[.gz]     the Kineto trace (one per cycle with --repeat)
    torch_et_<rank>[_cycle<k>].json              the Execution Trace (--et), plain JSON for Chakra
    memory_timeline_<rank>[_cycle<k>].json[.gz]  torch's raw memory timeline (by category)
    kineto_trace_<rank>_slow<k>.json[.gz]        the k-th slow step caught by --slow (its successor)
    ranks/<rank>.json                            each rank's own manifest (a job of several ranks)
    capture.json                                 the manifest (``Manifest``), written last

Every writer (``capture.session``, ``capture.distributed``, ``export.chisel``) and reader
(``trace.loader``, ``trace.cache``, ``trace.artifacts``, ``trace.pairing``, the magics)
takes the names and the manifest from here. Files are written under a hidden temporary
name in their final directory and moved into place with ``os.replace``, so a reader never
sees a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypedDict, Union, cast, get_args, get_origin, get_type_hints

from tracemagic.errors import TraceError

#: the manifest's file name
MANIFEST = "capture.json"
#: the manifest's layout: its name and version (a new version for a change readers must know
#: about; ``read_manifest`` refuses a version above ``MANIFEST_VERSION``)
MANIFEST_NAME = "tracemagic.capture"
MANIFEST_VERSION = 1
#: the manifest's ``format``: ``<name>/<version>``
MANIFEST_FORMAT = f"{MANIFEST_NAME}/{MANIFEST_VERSION}"
#: the folder of the per-rank manifests of a job of several ranks
RANKS_DIR = "ranks"
#: the file-name prefixes of a capture's files
KINETO_PREFIX = "kineto_trace_"
ET_PREFIX = "torch_et_"
MEMORY_PREFIX = "memory_timeline_"
#: ``kineto_trace_<rank>[_cycle<k>].json[.gz]``: groups rank, cycle
KINETO_FILE = re.compile(KINETO_PREFIX + r"(\d+)(?:_cycle(\d+))?\.json(?:\.gz)?$")
#: ``torch_et_<rank>[_cycle<k>].json[.gz]``: groups rank, cycle
ET_FILE = re.compile(ET_PREFIX + r"(\d+)(?:_cycle(\d+))?\.json(?:\.gz)?$")
#: ``kineto_trace_<rank>_slow<k>.json[.gz]`` (``--slow``): groups rank, k
SLOW_FILE = re.compile(KINETO_PREFIX + r"(\d+)_slow(\d+)\.json(?:\.gz)?$")
#: ``memory_timeline_<rank>[_cycle<k>].json[.gz]``: groups rank, cycle
MEMORY_FILE = re.compile(MEMORY_PREFIX + r"(\d+)(?:_cycle(\d+))?\.json(?:\.gz)?$")

#: the ``kind`` of a file in the manifest's ``files``, the one vocabulary of writers and readers
FileKind = Literal["kineto", "kineto_slow", "execution_trace", "memory_timeline", "pfw", "manifest", "rank_manifest"]
#: a Kineto trace of the schedule's cycles (``kineto_name``)
KINETO_KIND: Final = "kineto"
#: a ``--slow`` trace (not ``kineto``: loading the capture loads the schedule's cycles only;
#: each slow trace loads on its own)
SLOW_KIND: Final = "kineto_slow"
#: an Execution Trace (``et_name``); tracemagic has always written this word (the type once
#: said ``et``, which no writer wrote)
ET_KIND: Final = "execution_trace"
#: torch's raw memory timeline (``memory_name``)
MEMORY_KIND: Final = "memory_timeline"
#: a DFTracer ``.pfw`` written by ``Capture.to_pfw``
PFW_KIND: Final = "pfw"
#: the manifest itself (listed last)
MANIFEST_KIND: Final = "manifest"
#: a rank's own manifest in a job of several ranks (``part_path``)
RANK_MANIFEST_KIND: Final = "rank_manifest"


class FileEntry(TypedDict, total=False):
    """One file of the manifest's ``files``: its name in the capture directory, its kind,
    the rank and cycle it belongs to, its size."""

    path: str
    kind: FileKind
    rank: int
    cycle: int | None
    bytes: int


class SlowCatch(TypedDict, total=False):
    """One slow iteration caught by ``--slow``: ``iteration`` was ``ratio`` × the running
    median ``median_ms``; ``recorded`` (the next iteration) went to ``path``."""

    iteration: int
    wall_ms: float
    median_ms: float
    ratio: float
    recorded: int
    path: str | None


class LoopTiming(TypedDict, total=False):
    """``capture.json``'s ``loop_timing``: every iteration of the stepped loop, timed.

    ``wall_ms[i]``: iteration ``i``'s wall time (``time.perf_counter_ns`` between the ends of
    consecutive iterations; iteration 0 from the profiler's start). ``gpu_ms[i]`` (CUDA only,
    else absent): the time between CUDA events recorded on the current stream at the same
    boundaries. ``phases``: runs ``[phase, first iteration, count]`` (``skip``, ``wait``,
    ``warmup``, ``active``, ``after``: past the schedule, ``slow``: recorded by ``--slow``);
    ``recorded``: ``[iteration, ProfilerStep number]`` of the iterations in the trace;
    ``stopped_after``: the iteration after which ``--stop`` ended the loop (else None).
    """

    wall_ms: list[float]
    gpu_ms: list[float]
    phases: list[list[Any]]
    recorded: list[list[int]]
    stopped_after: int | None
    slow: list[SlowCatch]
    slow_factor: float | None
    slow_warmup: int


class RankSummary(TypedDict, total=False):
    """One rank of a job in the merged manifest's ``ranks`` (``capture.distributed.merge``)."""

    status: str | None
    steps_recorded: int | None
    iterations: int | None
    error: dict[str, Any] | None
    notes: list[str]


class Manifest(TypedDict, total=False):
    """``capture.json``: what a capture did and wrote (every key optional to a reader: a
    failed capture writes few, other tools' manifests fewer). Every writer builds it as this
    type (mypy checks it); ``read_manifest`` checks the types of the keys it finds.

    A job of several ranks (torchrun) merges its ranks' own manifests into one that has no
    ``rank`` but ``ranks``, ``missing_ranks`` and ``failed_ranks``.
    """

    format: str
    status: str  # running, complete, partial, empty, failed
    name: str
    created: str
    arguments: dict[str, Any]
    schedule: dict[str, Any]
    loop: dict[str, Any]
    cell: str
    line_marks: dict[str, Any]  # marked, prefix, lines (capture.loop.LoopPlan.line_marks)
    versions: dict[str, Any]
    device: dict[str, Any]
    rank: int
    world_size: int
    steps: list[dict[str, Any]]
    steps_recorded: int
    iterations: int
    loop_timing: LoopTiming
    files: list[FileEntry]
    modules: dict[str, dict[str, str]]
    modules_by_file: dict[str, Any]
    cells: dict[str, int]  # notebook cells' files (``/tmp/ipykernel_<pid>/<hash>.py``) -> execution count
    memory_timeline: dict[str, Any]  # the raw rows' format (``capture.session.MEMORY_TIMELINE_FORMAT``)
    notes: list[str]
    error: dict[str, Any] | None
    hidden_output: list[str]
    ranks: dict[str, RankSummary]
    missing_ranks: list[int]
    failed_ranks: list[int]
    chakra_check: dict[str, Any]
    report: str


def _cycle(cycle: int | None) -> str:
    return f"_cycle{cycle}" if cycle is not None else ""


def kineto_name(rank: int, cycle: int | None, gz: bool) -> str:
    """``kineto_trace_<rank>[_cycle<k>].json[.gz]``; the cycle only with several cycles."""
    return f"{KINETO_PREFIX}{rank}{_cycle(cycle)}.json" + (".gz" if gz else "")


def slow_name(rank: int, k: int, gz: bool) -> str:
    """``kineto_trace_<rank>_slow<k>.json[.gz]``: the ``k``-th (from 1) ``--slow`` trace."""
    return f"{KINETO_PREFIX}{rank}_slow{k}.json" + (".gz" if gz else "")


def et_name(rank: int, cycle: int | None = None) -> str:
    """``torch_et_<rank>[_cycle<k>].json``: always plain JSON, as Chakra's linker reads it;
    one per cycle, like the Kineto trace it pairs with (``kineto_name``)."""
    return f"{ET_PREFIX}{rank}{_cycle(cycle)}.json"


def memory_name(rank: int, cycle: int | None, gz: bool) -> str:
    """``memory_timeline_<rank>[_cycle<k>].json[.gz]``."""
    return f"{MEMORY_PREFIX}{rank}{_cycle(cycle)}.json" + (".gz" if gz else "")


def part_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` of a job writes its own manifest: ``ranks/<rank>.json``."""
    return directory / RANKS_DIR / f"{rank}.json"


def modules_sidecar(trace_file: Path) -> Path:
    """``<stem>.modules.json`` beside a ``capture_model`` trace ``<stem>.json[.gz]``: its
    module names (the manifest's ``modules``)."""
    name = trace_file.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            return trace_file.with_name(name[: -len(suffix)] + ".modules.json")
    return trace_file.with_name(name + ".modules.json")


def root_layer(name: str, kind: str) -> str:
    """The layer name of a root module whose name is also an attribute path under a root.

    A root is named after the user's variable and its submodules by their attribute paths
    (the manifest's ``modules``: ``path``). ``bert = BertForMaskedLM(...)`` holds a
    ``BertModel`` at ``.bert``: both would be the layer ``bert``. Such a root is the layer
    ``bert (BertForMaskedLM)`` instead, which no attribute path can be (a path has no space),
    and its children keep their ``named_modules()`` paths.
    """
    return f"{name} ({kind})"


def clashing_roots(paths_by_root: Mapping[str, Iterable[str]]) -> set[str]:
    """The roots whose submodules' attribute paths are also another root's.

    Two models called in one capture (a GAN's generator and discriminator, a teacher and
    its student) may each have an ``fc``: named by their paths alone, both would be the
    layer ``fc`` and one table row would add up two layers. A clashing root's submodules
    are named by their qualified names instead (``gen.fc``, ``disc.fc``); the other roots'
    keep their paths.
    """
    owner: dict[str, str] = {}
    clashing: set[str] = set()
    for root, paths in paths_by_root.items():
        for path in paths:
            other = owner.setdefault(path, root)
            if other != root:
                clashing |= {root, other}
    return clashing


# -- writing, atomically -------------------------------------------------------------------
def partial_path(final: Path) -> Path:
    """The hidden name a file is written under before it gets its final name."""
    return final.with_name(f".{final.name}.partial")


@contextlib.contextmanager
def atomic_path(final: Path, *, replacing: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; move it to ``final`` only if the block succeeds.

    Args:
        replacing: ``final`` is expected to exist (a capture's final manifest over its
            ``running`` one): the two are swapped (``replace_existing``), which skips the
            write-back some file systems force on a rename over an existing file.
    """
    tmp = partial_path(final)
    try:
        yield tmp
        if not (replacing and replace_existing(tmp, final)):
            os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


#: ``renameat2(2)``'s flag that swaps two paths atomically (Linux 3.15+)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: libc's ``renameat2`` once looked up (None: not there, as on macOS or an old glibc)
_renameat2: Any = ...


def replace_existing(new: str | os.PathLike[str], final: str | os.PathLike[str]) -> bool:
    """Put the file ``new`` in the place of the existing file ``final`` atomically, by
    swapping the two names (``renameat2(RENAME_EXCHANGE)``) and removing the old file now
    under ``new``'s name. False where the swap is not available (not Linux, a file system
    without it, ``final`` missing): the caller then renames with ``os.replace``.

    Why: ext4 (``auto_da_alloc``, its default) starts writing ``new``'s data to disk when
    a rename replaces an existing file, ~0.1 ms of a capture here; a swap does not. At
    every moment ``final`` names the old or the new file, whole, as with a rename.
    """
    global _renameat2
    if _renameat2 is ...:
        try:
            import ctypes

            _renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
            if _renameat2 is not None:
                _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                _renameat2.restype = ctypes.c_int
        except Exception:  # noqa: BLE001 - no libc to ask (Windows, a static build): no swap
            _renameat2 = None
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE) != 0:
        return False  # ENOENT, EINVAL (no swap on this file system), ENOSYS...: nothing moved
    with contextlib.suppress(FileNotFoundError):
        os.unlink(new)  # the old file
    return True


@contextlib.contextmanager
def gzip_to(tmp: Path, final: Path, compresslevel: int = 6) -> Iterator[gzip.GzipFile]:
    """A gzip stream writing ``tmp`` whose header names ``final`` (less ``.gz``), not the
    hidden ``tmp``: ``gunzip -N``, 7-Zip and file managers extract to the name in the header."""
    with (
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename=final.name, mode="wb", fileobj=raw, compresslevel=compresslevel) as fh,
    ):
        yield fh


def write_json(final: Path, data: Any, gz: bool = False) -> None:
    """Write ``data`` as JSON (gzip-compressed if ``gz``), atomically."""
    with atomic_path(final) as tmp:
        if gz:
            with gzip_to(tmp, final) as raw, io.TextIOWrapper(raw, encoding="utf-8") as fh:
                json.dump(data, fh, indent=None, default=str)
        else:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1, default=str)


def write_manifest(
    path: Path, manifest: Manifest, memo: dict[str, tuple[Any, str]] | None = None, *, replacing: bool = False
) -> None:
    """Write a manifest (``path``: a capture directory, or the file itself, e.g. a rank's
    ``part_path``) atomically; values JSON cannot hold are written as text (``memo``: as
    ``manifest_text``'s; ``replacing``: as ``atomic_path``'s)."""
    final = path / MANIFEST if path.is_dir() else path
    text = manifest_text(manifest, memo)
    with atomic_path(final, replacing=replacing) as tmp:
        tmp.write_text(text, encoding="utf-8")


#: how manifest values are written: compact, and what JSON cannot hold as text
_MANIFEST_ENCODER = json.JSONEncoder(default=str)


def manifest_text(manifest: Manifest, memo: dict[str, tuple[Any, str]] | None = None) -> str:
    """A manifest as JSON text: one top-level key a line, each value compact (``json``'s C
    encoder: an indented dump runs its Python encoder, milliseconds for a long loop's
    ``loop_timing``); values JSON cannot hold are written as text.

    Args:
        memo: the lines written before, by key, with their value, kept by a caller that
            writes one manifest several times (a capture's ``running`` and final
            manifests share their fixed part): a value that is the very object encoded
            before is not encoded again. Such values must not be changed in place.
    """
    encode = _MANIFEST_ENCODER.encode  # one encoder: json.dumps(default=...) makes one per call
    if memo is None:
        items = [f"{encode(str(key))}: {encode(value)}" for key, value in manifest.items()]
    else:
        items = []
        for key, value in manifest.items():
            known = memo.get(key)
            if known is None or known[0] is not value:
                known = memo[key] = (value, f"{encode(str(key))}: {encode(value)}")
            items.append(known[1])
    return "{\n" + ",\n".join(items) + "\n}\n"


# -- reading -------------------------------------------------------------------------------
def read_manifest(path: Path) -> Manifest:
    """The manifest of a capture directory (or the manifest file ``path`` itself).

    Raises:
        TraceError: it is missing, unreadable, not a JSON object, a key of ``Manifest`` holds
            a value of another type, or a newer tracemagic wrote it (``format`` above
            ``MANIFEST_FORMAT``: upgrade tracemagic to read it).
    """
    file = path / MANIFEST if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceError(f"{file}: unreadable capture manifest ({exc}).", path=str(file)) from None
    if not isinstance(data, dict):
        raise TraceError(f"{file}: not a capture manifest (a JSON object).", path=str(file))
    _check_version(file, data.get("format"))
    for key, value in data.items():
        expected = _KEY_TYPES.get(key)
        if expected is not None and not isinstance(value, expected):
            names = " or ".join("null" if t is type(None) else _JSON_NAMES.get(t, t.__name__) for t in expected)
            raise TraceError(
                f"{file}: not a capture manifest tracemagic can read: {key!r} is "
                f"{_JSON_NAMES.get(type(value), type(value).__name__)}, not {names}. {_DAMAGED}",
                path=str(file),
            )
    files = data.get("files")
    if isinstance(files, list) and not all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in files):
        raise TraceError(
            f"{file}: not a capture manifest tracemagic can read: an entry of 'files' "
            f"is not an object with a 'path'. {_DAMAGED}",
            path=str(file),
        )
    return cast(Manifest, data)


def _check_version(file: Path, fmt: Any) -> None:
    """Refuse a manifest of a newer format than this tracemagic reads (other tools' names pass)."""
    if fmt is None or not isinstance(fmt, str) or not fmt.startswith(MANIFEST_NAME + "/"):
        return  # no format (other tools) or theirs; a non-text format is caught as a type
    version = fmt[len(MANIFEST_NAME) + 1 :]
    if not version.isdigit():
        raise TraceError(
            f"{file}: unknown capture manifest format {fmt!r} (this tracemagic reads {MANIFEST_FORMAT}).",
            path=str(file),
        )
    if int(version) > MANIFEST_VERSION:
        from tracemagic._version import __version__

        raise TraceError(
            f"{file}: written by a newer tracemagic (manifest format {fmt}; tracemagic {__version__} "
            f"reads up to {MANIFEST_FORMAT}). Upgrade tracemagic to read it: pip install -U tracemagic.",
            path=str(file),
        )


def _runtime_types(hint: Any) -> tuple[type, ...]:
    """The classes ``isinstance`` checks for a ``Manifest`` annotation (``int | None`` ->
    ``(int, NoneType)``, ``list[str]`` -> ``(list,)``, a TypedDict -> ``(dict,)``)."""
    if get_origin(hint) is Union or type(hint).__name__ == "UnionType":
        return tuple(t for arg in get_args(hint) for t in _runtime_types(arg))
    if hint is type(None):
        return (type(None),)
    if hint is Any:
        return (object,)
    origin = get_origin(hint) or hint
    if isinstance(origin, type) and issubclass(origin, dict):  # a TypedDict is a dict at runtime
        return (dict,)
    if origin is float:
        return (int, float)
    return (origin,)


#: each ``Manifest`` key's types as read from JSON; ``files`` may also be another tool's
#: ``{"kineto": [names]}`` mapping (``trace.loader`` reads it)
_KEY_TYPES: dict[str, tuple[type, ...]] = {
    key: _runtime_types(hint) for key, hint in get_type_hints(Manifest).items()
} | {"files": (list, dict)}
#: what to do about a manifest of the wrong shape
_DAMAGED = "Load the trace files themselves, or move this capture.json away to load the folder's traces without it."
_JSON_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true/false",
    type(None): "null",
}
