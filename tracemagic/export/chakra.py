"""Check that a capture is what MLCommons Chakra's tools accept, without Chakra installed.

Chakra turns a PyTorch Execution Trace (its "host trace") plus the Kineto trace of the same
steps (its "device trace") into a simulator input in two commands (see ``commands``):

1. ``chakra_trace_link`` joins them: it reads the ET through ``et_replay``'s
   ``ExecutionTrace`` (schemas ``1.0.1`` and ``1.0.2``/``1.0.3``/``1.0.4``/``1.1.0``/
   ``1.1.1-chakra.0.0.4``), takes node id 1 (the process root the observer writes when it
   is finalized) as the root, keeps only the nodes whose parent chain (``ctrl_deps``, or
   ``parent`` in ``1.0.1``) reaches it, and gives each ET operator the duration of the
   Kineto ``cpu_op``/``user_annotation`` event whose ``Record function id`` equals the
   node's ``rf_id`` (``ProfilerStep#N`` events are skipped). It writes its output from the
   ET re-read with a plain ``open()``, so the ET must be plain JSON, not gzip.
2. ``chakra_converter PyTorch`` reads the linked JSON (plain JSON only; it needs
   ``schema``, ``pid``, ``time``, ``start_ts`` and ``finish_ts``) and accepts the schemas
   ``1.0.2``, ``1.0.3``, ``1.1.0`` and, since mlcommons/chakra#177 (January 2025),
   ``1.1.1-chakra.0.0.4``. ``1.0.1`` traces are rejected (mlcommons/chakra#127).

``check`` verifies all of that and reports, per rank (and per cycle of a ``--repeat``
capture), the share of ET operators that will get a duration: reached from the root AND
matched in Kineto. A node whose parent was never written (a record function still open
when the observer stopped: a profiler step ended inside ``optimizer.step()``) is an orphan;
Chakra drops it and everything under it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson

from tracemagic.errors import TraceError
from tracemagic.trace import pairing
from tracemagic.trace._files import read_bytes
from tracemagic.trace.et_reader import ROOT_NAMES
from tracemagic.trace.kineto import STEP_NAME

__all__ = [
    "CONVERTER_SCHEMAS",
    "LINKER_SCHEMAS",
    "ChakraPair",
    "ChakraReport",
    "check",
    "commands",
    "find_pairs",
]

#: ET schemas ``chakra_trace_link`` reads (et_replay ``ExecutionTrace`` node parsers)
LINKER_SCHEMAS = (
    "1.0.1",
    "1.0.2-chakra.0.0.4",
    "1.0.3-chakra.0.0.4",
    "1.0.4-chakra.0.0.4",
    "1.1.0-chakra.0.0.4",
    "1.1.1-chakra.0.0.4",
)
#: ET schemas ``chakra_converter PyTorch`` accepts (``PyTorchNode.SUPPORTED_VERSIONS``;
#: 1.1.1 since mlcommons/chakra#177)
CONVERTER_SCHEMAS = (
    "1.0.2-chakra.0.0.4",
    "1.0.3-chakra.0.0.4",
    "1.1.0-chakra.0.0.4",
    "1.1.1-chakra.0.0.4",
)
#: top-level keys the converter copies from the (linked) trace
REQUIRED_KEYS = ("schema", "pid", "time", "start_ts", "finish_ts", "nodes")
#: ET metadata nodes that are no operator and that Kineto never holds: torch records the
#: process-group configuration when the observer starts, before Kineto does (the converter
#: reads it for the communicator groups)
METADATA_NAMES = ("## process_group:init ##",)


@dataclass
class ChakraPair:
    """The check of one rank's ET + Kineto pair.

    Attributes:
        rank: the rank (from the file names, else the position).
        et_path: the Execution Trace.
        kineto_path: the Kineto trace.
        cycle: the cycle of a ``--repeat`` capture (``torch_et_<rank>_cycle<k>.json``), else None.
        schema: the ET's schema string ('' when unreadable).
        uncompressed: the ET is plain JSON (the contract; Chakra's converter reads plain JSON).
        finalized: the ET is valid JSON with ``finish_ts`` and the root node (id 1).
        linker_accepts: ``schema`` in ``LINKER_SCHEMAS``.
        converter_accepts: ``schema`` in ``CONVERTER_SCHEMAS``.
        profiler_steps: the ``ProfilerStep#N`` numbers in the Kineto trace.
        et_ops: ET operator nodes (not the process/thread roots, not ``ProfilerStep#N``, not
            ``## process_group:init ##``).
        orphan_ops: of those, how many have a parent chain that does not reach the root
            (node 1): Chakra drops them.
        matched_ops: of those, how many have their ``rf_id`` as a Kineto ``Record function id``.
        timed_ops: of those, how many Chakra's linker will time (reached from the root and
            matched on a ``cpu_op`` or ``user_annotation`` event).
        unmatched: a few ``(node id, name, rf_id)`` that will get no timing.
        orphans: a few ``(node id, name, missing parent id)`` that Chakra drops.
        lost: the Kineto names of the missing ancestors where the Kineto trace has them
            (the record function with an rf_id the ET lacks, just before the orphans').
        problems: what stops Chakra or loses data (empty when the pair is fine).
        notes: facts worth knowing that do not stop Chakra.
    """

    rank: int
    et_path: Path
    kineto_path: Path
    cycle: int | None = None
    schema: str = ""
    uncompressed: bool = False
    finalized: bool = False
    linker_accepts: bool = False
    converter_accepts: bool = False
    profiler_steps: list[int] = field(default_factory=list)
    et_ops: int = 0
    orphan_ops: int = 0
    matched_ops: int = 0
    timed_ops: int = 0
    unmatched: list[tuple[int, str, int | None]] = field(default_factory=list)
    orphans: list[tuple[int, str, int]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def timed_share(self) -> float:
        """Share (0..1) of ET operators that will get a duration from Kineto."""
        return self.timed_ops / self.et_ops if self.et_ops else 0.0

    @property
    def ok(self) -> bool:
        """Whether Chakra's link + convert will accept the pair and time every operator."""
        return not self.problems

    @property
    def label(self) -> str:
        """``rank R`` or ``rank R cycle K``."""
        return f"rank {self.rank}" + (f" cycle {self.cycle}" if self.cycle is not None else "")


@dataclass
class ChakraReport:
    """The Chakra check of a capture: one ``ChakraPair`` per rank.

    Attributes:
        source: what was checked.
        pairs: per-rank results, by rank.
        problems: capture-level problems (no pair found, unpaired files).
    """

    source: str
    pairs: list[ChakraPair] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every rank passes and nothing is unpaired."""
        return bool(self.pairs) and not self.problems and all(p.ok for p in self.pairs)

    @property
    def timed_share(self) -> float:
        """The lowest per-rank share of ET operators that will get timing (0 with no pair)."""
        return min((p.timed_share for p in self.pairs), default=0.0)

    @property
    def all_problems(self) -> list[str]:
        """Capture-level problems, then each rank's, prefixed with the rank."""
        return list(self.problems) + [f"{p.label}: {m}" for p in self.pairs for m in p.problems]

    def summary(self) -> str:
        """A few lines for a terminal or a notebook warning."""
        lines = [f"Chakra check of {self.source}: {'OK' if self.ok else 'PROBLEMS'}"]
        for p in self.pairs:
            lines.append(
                f"  {p.label}: schema {p.schema or '?'}, {p.timed_ops}/{p.et_ops} ET ops timed "
                f"({p.timed_share:.0%}), ProfilerSteps {p.profiler_steps or 'none'}"
            )
            lines += [f"    problem: {m}" for m in p.problems]
            lines += [f"    note: {m}" for m in p.notes]
        lines += [f"  problem: {m}" for m in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython text display
        printer.text(self.summary())


# -- finding the pairs -------------------------------------------------------------------
def find_pairs(capture_dir: str | os.PathLike[str]) -> tuple[list[tuple[int, Path, Path]], list[str]]:
    """The ``(rank, et, kineto)`` pairs in a directory and what could not be paired.

    Pairs ``torch_et_<rank>[_cycle<k>].json`` with ``kineto_trace_<rank>[_cycle<k>].json`` (also
    ``*_et.json`` with ``*_trace.json`` and Chakra's ``host_<rank>.json``/``device_<rank>.json``);
    one ET and one Kineto trace in a directory always pair. See ``tracemagic.trace.pairing.pairs``.
    """
    return pairing.pairs(capture_dir)


# -- reading -----------------------------------------------------------------------------
class _Args(msgspec.Struct, gc=False):
    rf_id: Any = msgspec.field(name="Record function id", default=None)


class _Event(msgspec.Struct, gc=False):
    ph: Any = ""
    cat: Any = ""
    name: Any = ""
    args: _Args | None = None


class _Kineto(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []  # noqa: N815 - the JSON key


_KINETO = msgspec.json.Decoder(_Kineto)
_KINETO_LIST = msgspec.json.Decoder(list[_Event])


def _kineto_ids(path: Path) -> tuple[dict[int, tuple[str, str]], list[int]]:
    """``Record function id`` -> (cat, name) of the Kineto trace, and its ProfilerStep numbers."""
    data, _ = read_bytes(path)
    try:
        events = _KINETO_LIST.decode(data) if data.lstrip()[:1] == b"[" else _KINETO.decode(data).traceEvents
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}: not a readable Kineto trace ({exc}).", path=str(path)) from None
    ids: dict[int, tuple[str, str]] = {}
    steps: list[int] = []
    for e in events:
        if e.ph != "X":
            continue
        name = str(e.name)
        if name.startswith("ProfilerStep#"):
            with contextlib.suppress(ValueError):
                steps.append(int(name.split("#", 1)[1]))
        if e.args is not None and e.args.rf_id is not None:
            try:
                ids.setdefault(int(e.args.rf_id), (str(e.cat), name))
            except (TypeError, ValueError):
                continue
    return ids, sorted(set(steps))


def _node_rf_id(node: dict[str, Any]) -> int | None:
    if "rf_id" in node:
        value = node["rf_id"]
    else:
        value = next(
            (a.get("value") for a in node.get("attrs", []) if isinstance(a, dict) and a.get("name") == "rf_id"), None
        )
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _parent(node: dict[str, Any]) -> Any:
    """The enclosing node's id: ``ctrl_deps`` (schema 1.0.2+) or ``parent`` (1.0.1)."""
    return node["ctrl_deps"] if "ctrl_deps" in node else node.get("parent")


def _rooted(nodes: list[dict[str, Any]]) -> tuple[set[Any], dict[Any, Any]]:
    """The ids whose parent chain reaches node 1, and each other id's first missing ancestor."""
    parent = {n.get("id"): _parent(n) for n in nodes}
    rooted: set[Any] = {1} if 1 in parent else set()
    missing: dict[Any, Any] = {}
    for start in parent:
        chain: list[Any] = []
        node = start
        while node not in rooted and node not in missing and node in parent and node not in chain:
            chain.append(node)
            node = parent[node]
        if node in rooted:
            rooted.update(chain)
        else:  # a parent never written (or a cycle): the whole chain is cut off
            lost = missing.get(node, node)
            missing.update(dict.fromkeys(chain, lost))
    return rooted, missing


def _lost_names(
    nodes: list[dict[str, Any]], orphans: list[tuple[int, str, int]], ids: dict[int, tuple[str, str]]
) -> list[str]:
    """Kineto's names for the ancestors the ET never wrote.

    rf_ids are handed out as record functions begin, so a missing ancestor's rf_id is the
    last one before its first orphan's that the ET does not hold but Kineto does.
    """
    by_id = {n.get("id"): n for n in nodes}
    in_et = {r for n in nodes if (r := _node_rf_id(n)) is not None}
    firsts: dict[int, int] = {}
    for node_id, _, missing in orphans:
        rf = _node_rf_id(by_id.get(node_id, {}))
        if rf is not None:
            firsts[missing] = min(rf, firsts.get(missing, rf))
    names = []
    for first in firsts.values():
        before = [r for r in ids if r < first and r not in in_et]
        if before:
            names.append(ids[max(before)][1])
    return sorted(set(names))


def _check_pair(rank: int, et_path: Path, kineto_path: Path) -> ChakraPair:
    pair = ChakraPair(rank, et_path, kineto_path, cycle=pairing.cycle_of(et_path.name))
    try:
        raw, compressed = read_bytes(et_path)
    except TraceError as exc:
        pair.problems.append(str(exc))
        return pair
    pair.uncompressed = not compressed
    if compressed:
        pair.problems.append(
            f"{et_path.name} is gzip-compressed: chakra_trace_link re-reads the ET with a plain open() to "
            "write its output and fails on gzip. Keep the ET as plain JSON: gunzip it."
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        pair.problems.append(
            f"{et_path.name} is not valid JSON ({exc}): the ET was not finalized. Unregister the observer "
            "(et.unregister_callback(), or leave the `with profile(..., execution_trace_observer=et)` "
            "block) before reading it."
        )
        return pair
    if not isinstance(data, dict) or "nodes" not in data:
        pair.problems.append(f"{et_path.name} is not a PyTorch Execution Trace (no 'nodes').")
        return pair
    pair.schema = str(data.get("schema", ""))
    missing = [k for k in REQUIRED_KEYS if k not in data]
    nodes = [n for n in data.get("nodes", []) if isinstance(n, dict)]
    has_root = any(n.get("id") == 1 for n in nodes)
    pair.finalized = "finish_ts" in data and has_root
    if not pair.finalized:
        pair.problems.append(
            f"{et_path.name} was not finalized by its observer (no 'finish_ts'"
            + ("" if has_root else " and no root node 1")
            + "); chakra_trace_link and chakra_converter need both. Unregister the observer before reading."
        )
    elif missing:
        pair.problems.append(f"{et_path.name} lacks {', '.join(missing)}, which chakra_converter reads.")
    pair.linker_accepts = pair.schema in LINKER_SCHEMAS
    pair.converter_accepts = pair.schema in CONVERTER_SCHEMAS
    if not pair.linker_accepts:
        pair.problems.append(
            f"schema {pair.schema!r} is not one chakra_trace_link reads ({', '.join(LINKER_SCHEMAS)})."
        )
    elif not pair.converter_accepts:
        pair.problems.append(
            f"schema {pair.schema!r} links, but chakra_converter rejects it ('Unsupported schema version', "
            f"mlcommons/chakra#127); it accepts {', '.join(CONVERTER_SCHEMAS)}: "
            "record with a newer torch (2.5+ writes 1.1.1-chakra.0.0.4)."
        )
    try:
        ids, steps = _kineto_ids(kineto_path)
    except TraceError as exc:
        pair.problems.append(str(exc))
        return pair
    pair.profiler_steps = steps
    if not steps:
        pair.problems.append(
            f"{kineto_path.name} has no ProfilerStep#N: call prof.step() once per iteration "
            "(Chakra segments iterations by it)."
        )
    if not ids:
        pair.problems.append(
            f"{kineto_path.name} carries no 'Record function id' (torch < 2.1, or the ET observer was not "
            "running while it recorded); chakra_trace_link cannot time any ET operator."
        )
    skip = (*ROOT_NAMES, *METADATA_NAMES)
    ops = [
        n
        for n in nodes
        if str(n.get("name", "")) not in skip and not str(n.get("name", "")).startswith("ProfilerStep#")
    ]
    rooted, first_missing = _rooted(nodes) if pair.finalized else (set(), {})
    pair.et_ops = len(ops)
    lost: set[int] = set()
    orphans: list[tuple[int, str, int]] = []
    for node in ops:
        node_id = node.get("id")
        reached = node_id in rooted
        if not reached and pair.finalized:
            pair.orphan_ops += 1
            lost.add(int(first_missing.get(node_id, -1)))
            orphans.append((int(node_id or -1), str(node.get("name", "")), int(first_missing.get(node_id, -1))))
        rf_id = _node_rf_id(node)
        hit = ids.get(rf_id) if rf_id is not None else None
        if hit is None:
            if len(pair.unmatched) < 10:
                pair.unmatched.append((int(node.get("id", -1)), str(node.get("name", "")), rf_id))
            continue
        pair.matched_ops += 1
        if hit[0] in ("cpu_op", "user_annotation") and reached:
            pair.timed_ops += 1
    if pair.orphan_ops:
        pair.orphans = orphans[:10]
        pair.lost = _lost_names(nodes, orphans, ids)
        named = f" (in Kineto: {', '.join(repr(n) for n in pair.lost)})" if pair.lost else ""
        pair.problems.append(
            f"{pair.orphan_ops} of {pair.et_ops} ET operators have a parent chain that does not reach the root "
            f"(node 1): their ancestor node{'s' if len(lost) > 1 else ''} {', '.join(map(str, sorted(lost)))}{named} "
            f"{'were' if len(lost) > 1 else 'was'} never written, its record function still open when the observer "
            "stopped. chakra_trace_link and chakra_converter drop these operators. A profiler step that ends "
            "inside optimizer.step() does this (call prof.step() after it returns, as `tracemagic run` does); so "
            "does an asynchronous collective still running on a communication thread as the window closes "
            "(torch's ET makes it the parent of the main thread's ops)."
        )
    unmatched = pair.et_ops - pair.matched_ops
    if ids and unmatched:
        pair.problems.append(
            f"{unmatched} of {pair.et_ops} ET operators ({unmatched / pair.et_ops:.0%}) have no Kineto event with "
            "their rf_id and will get no duration: the ET and the Kineto trace are not of the same steps. "
            "Record both with profile(..., execution_trace_observer=et)."
        )
    et_steps = sorted({int(m.group(1)) for n in nodes if (m := STEP_NAME.match(str(n.get("name", ""))))})
    if et_steps and steps and not set(et_steps) <= set(steps):
        pair.problems.append(f"the ET holds ProfilerStep {et_steps} but the Kineto trace {steps}: not the same steps.")
    pair.notes.append(f"ET steps {et_steps or 'none'}; Kineto steps {steps or 'none'}.")
    return pair


def _as_pair(source: Any, kineto: Any) -> tuple[Path, Path] | None:
    if kineto is not None:
        return Path(source), Path(kineto)
    if isinstance(source, (tuple, list)) and len(source) == 2:
        a, b = Path(source[0]), Path(source[1])
        return (a, b) if pairing.is_et_name(a.name) or not pairing.is_et_name(b.name) else (b, a)
    return None


def check(
    capture_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    kineto: str | os.PathLike[str] | None = None,
) -> ChakraReport:
    """Check a capture against what ``chakra_trace_link`` and ``chakra_converter`` accept.

    Args:
        capture_dir: a capture directory (one ``torch_et_<rank>.json`` +
            ``kineto_trace_<rank>.json`` pair per rank, or per rank and cycle:
            ``torch_et_<rank>_cycle<k>.json`` + ``kineto_trace_<rank>_cycle<k>.json``), or an
            ET file (with ``kineto``), or an ``(et, kineto)`` pair of paths.
        kineto: the Kineto trace when ``capture_dir`` is an ET file.

    Returns:
        A ``ChakraReport`` (``.ok``, ``.timed_share``, ``.pairs``, ``.summary()``). Problems
        are reported, not raised.

    Raises:
        TraceError: the path does not exist.
    """
    pair = _as_pair(capture_dir, kineto)
    if pair is not None:
        for p in pair:
            if not p.is_file():
                raise TraceError(f"{p}: no such file.", path=str(p))
        rank = pairing.rank_of(pair[0].name)
        report = ChakraReport(f"{pair[0]} + {pair[1]}")
        report.pairs.append(_check_pair(rank if rank is not None else 0, *pair))
        return report
    folder = Path(capture_dir)  # type: ignore[arg-type]
    if not folder.exists():
        raise TraceError(f"{folder}: no such file or directory.", path=str(folder))
    if folder.is_file():
        raise TraceError(
            f"{folder}: a single file; pass the capture directory, or the ET and its Kineto trace: "
            "check(et_path, kineto_path).",
            path=str(folder),
        )
    report = ChakraReport(str(folder))
    pairs, problems = find_pairs(folder)
    report.problems += problems
    if not pairs:
        report.problems.append(
            f"{folder}: no Execution Trace + Kineto trace pair (torch_et_<rank>.json + "
            "kineto_trace_<rank>.json). Capture with `%%chakra_trace --et`."
        )
    report.pairs = [_check_pair(r, e, k) for r, e, k in pairs]
    return report


def commands(
    capture_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str] | None = None,
    kineto: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The ``chakra_trace_link`` and ``chakra_converter`` command lines for a capture.

    Per rank (and per cycle of a ``--repeat`` capture): link the ET (host trace) with the
    Kineto trace of the same steps (device trace) into
    ``<out>/chakra_host_device_<rank>[_cycle<k>].json``, then convert that into
    ``<out>/chakra[_cycle<k>].<rank>.et`` (the ``<prefix>.<npu id>.et`` naming ASTRA-sim reads:
    one prefix per cycle). Every path is absolute, so the lines run from any directory.
    Flags as in Chakra's current CLI (``src/trace_link/trace_link.py``,
    ``src/converter/converter.py``).

    Args:
        capture_dir: a capture directory, an ET file (with ``kineto``) or an ``(et, kineto)`` pair.
        out_dir: where Chakra should write (default: ``<capture_dir>/chakra``).
        kineto: the Kineto trace when ``capture_dir`` is an ET file.

    Raises:
        TraceError: no pair was found.
    """
    pair = _as_pair(capture_dir, kineto)
    if pair is not None:
        rank = pairing.rank_of(pair[0].name)
        pairs = [(rank if rank is not None else 0, pair[0], pair[1])]
        base = pair[0].parent
    else:
        base = Path(capture_dir)  # type: ignore[arg-type]
        if not base.is_dir():
            raise TraceError(f"{base}: not a capture directory.", path=str(base))
        pairs, _ = find_pairs(base)
    if not pairs:
        raise TraceError(
            f"{base}: no torch_et_<rank>.json + kineto_trace_<rank>.json pair to give Chakra.", path=str(base)
        )
    out = (Path(out_dir) if out_dir is not None else base / "chakra").resolve()
    q = shlex.quote
    lines = [f"mkdir -p {q(str(out))}"]
    converts = []
    for rank, et, k in pairs:
        cycle = pairing.cycle_of(et.name)
        tag = f"_cycle{cycle}" if cycle is not None else ""
        linked = out / f"chakra_host_device_{rank}{tag}.json"
        lines.append(
            f"chakra_trace_link --rank {rank} --chakra-host-trace {q(str(et.resolve()))} "
            f"--chakra-device-trace {q(str(k.resolve()))} --output-file {q(str(linked))}"
        )
        converts.append(
            f"chakra_converter PyTorch --input {q(str(linked))} --output {q(str(out / f'chakra{tag}.{rank}.et'))}"
        )
    return lines + converts
