"""JSON values as tracemagic reads them: msgspec decoding that survives what msgspec cannot
read (invalid UTF-8, nesting deeper than ``MAX_NESTING``) by repairing a same-length copy,
numbers from JSON numbers or numeric text, metadata written as Python reprs, and the byte
offset of a decoding error. The limits of the parser live here; the parsers use it
(``parse``, ``structs``, ``builder``).
"""

from __future__ import annotations

import ast
import codecs
import json
import math
import re
from typing import Any

import msgspec

_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY = msgspec.json.Decoder()
#: ``_ANY`` that reads numbers beyond float64 (as inf) instead of failing
_BIG = msgspec.json.Decoder(float_hook=float)
#: the trace's metadata: numbers beyond float64 stay text
_META = msgspec.json.Decoder(float_hook=lambda text: _float_or_text(text))
_BAD_OFFSET = re.compile(r"\(byte (\d+)\)|at byte (\d+)")


def _offset_of(exc: Exception) -> int | None:
    match = _BAD_OFFSET.search(str(exc))
    if not match:
        return None
    return int(match.group(1) or match.group(2))


#: values nested deeper than this are replaced by a string before msgspec decodes them (it
#: recurses, and gives up with RecursionError near the interpreter's C recursion limit: ~1,000
#: levels on 3.11, ~1,500 on 3.12, ~10,000 on 3.13); a text column cuts a value it decoded
#: whole at the same depth (``cut_deep``)
MAX_NESTING = 200
_STRUCTURE = re.compile(rb'[\[\]{}"]')
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*"', re.S)
_TOO_DEEP = b"<nested too deep>"
_BAD_BYTE = re.compile("[\udc80-\udcff]")
#: what may come before a JSON document, and ``load`` skips: a UTF-8 byte order mark, white space
LEADING = re.compile(rb"[\xef\xbb\xbf \t\r\n]*")
#: bytes ``valid_utf8`` checks at once
_UTF8_BLOCK = 8 << 20
#: notes that tally what one chunk's decoding repaired or read as something else (the first
#: number: where it starts in the file, unique to the chunk); ``merge_notes`` joins each kind
#: into one note for the file, which does not depend on where the file was cut into chunks
_BAD_UTF8 = "invalid UTF-8 at byte {first} ({count} bytes in all read as '?')"
ODD_DURATIONS = (
    "{count} events after byte {base} have a dur that is not a finite number; read as 0 (the first: {first})"
)
#: (the chunk's note, the file's)
_TALLIES = (
    (re.compile(r"invalid UTF-8 at byte (?P<first>\d+) \((?P<count>\d+) bytes in all read as '\?'\)\Z"), _BAD_UTF8),
    (
        re.compile(
            r"(?P<count>\d+) events after byte \d+ have a dur that is not a finite number; "
            r"read as 0 \(the first: (?P<first>.*)\)\Z",
            re.S,
        ),
        "{count} events have a dur that is not a finite number; read as 0 (the first: {first})",
    ),
)


def _repair(data: bytes, base: int = 0) -> tuple[bytes, list[str]]:
    """``data`` made decodable at the same length (so offsets in it stay true): invalid UTF-8
    bytes become ``?``, values nested deeper than ``MAX_NESTING`` a string; and notes of
    what was replaced (``base`` is ``data``'s offset in the file)."""
    notes = []
    text = data.decode("utf-8", "surrogateescape")
    bad = _BAD_BYTE.search(text)
    if bad is not None:
        offset = base + len(text[: bad.start()].encode("utf-8", "surrogateescape"))
        count = len(_BAD_BYTE.findall(text))
        data = _questioned(text)
        notes.append(_BAD_UTF8.format(first=offset, count=count))
    out = bytearray(data)
    depth, deep_from, pos = 0, -1, 0
    while (match := _STRUCTURE.search(data, pos)) is not None:
        at = pos = match.start()
        char = data[at]
        pos += 1
        if char == 0x22:  # a string: skip to its end
            rest = _STRING_REST.match(data, pos)
            if rest is None:
                break  # the rest of the data is inside it
            pos = rest.end()
        elif char in b"[{":
            depth += 1
            if depth == MAX_NESTING + 1:
                deep_from = at
        else:
            if depth == MAX_NESTING + 1 and deep_from >= 0:
                _blank(out, deep_from, at + 1)
                deep_from = -1
            depth -= 1
    if deep_from >= 0:  # never closed: blank to the end (the data is cut off there)
        out[deep_from:] = b" " * (len(out) - deep_from)
    return bytes(out), notes


def cut_deep(value: Any, levels: int = MAX_NESTING - 2) -> Any:
    """``value`` (decoded) with what lies more than ``levels`` lists or objects deep replaced by
    the string ``<nested too deep>``, where ``_repair`` would have put it (``levels``: for an
    event's field ``MAX_NESTING - 2``, the ``traceEvents`` list and the event around it; for an
    arg, ``MAX_NESTING - 3``).

    msgspec decodes a value too deep for ``MAX_NESTING`` whole up to the interpreter's C
    recursion limit, and only past it does ``decode_or_repair`` repair the text: that limit
    is ~1,000 levels on Python 3.11 and ~1,500 on 3.12 but ~10,000 on 3.13, so a name nested 5,000 deep
    reached the table as 10,000 brackets on 3.13 and as ``<nested too deep>`` before. Cut here,
    it reads the same on every interpreter. Recursion is at most ``levels`` deep.
    """
    if not isinstance(value, (list, dict)):
        return value
    if levels <= 0:
        return _TOO_DEEP.decode()
    if isinstance(value, list):
        return [cut_deep(v, levels - 1) for v in value]
    return {k: cut_deep(v, levels - 1) for k, v in value.items()}


def _questioned(text: str) -> bytes:
    """``text`` (decoded with ``surrogateescape``) as UTF-8, each invalid byte read as ``?``."""
    return _BAD_BYTE.sub("?", text).encode("utf-8")


def valid_utf8(data: bytes | bytearray) -> bytes | bytearray:
    """``data`` with each invalid UTF-8 byte replaced by ``?``, as ``load`` reads it (the same
    length, so offsets stay true; ``data`` itself where it is valid)."""
    if data.isascii():  # (~20x faster than decoding)
        return data
    check = codecs.getincrementaldecoder("utf-8")()  # block by block: no str of the whole file
    try:
        with memoryview(data) as view:
            for at in range(0, len(data), _UTF8_BLOCK):
                check.decode(view[at : at + _UTF8_BLOCK])
            check.decode(b"", final=True)
    except UnicodeDecodeError:
        return _questioned(data.decode("utf-8", "surrogateescape"))
    return data


def nesting_depth(text: str) -> int:
    """How deep ``text`` (JSON) nests: the most ``[``/``{`` open at once outside its strings,
    counted without recursion (``json.loads`` recurses once a level). A value the parser
    kept is at most ``MAX_NESTING`` deep, its event and args included (``_repair``)."""
    data = text.encode("utf-8", "surrogatepass")
    depth = deepest = pos = 0
    while (match := _STRUCTURE.search(data, pos)) is not None:
        char = data[match.start()]
        pos = match.end()
        if char == 0x22:  # a string: skip to its end
            rest = _STRING_REST.match(data, pos)
            if rest is None:
                break  # the rest of the text is inside it
            pos = rest.end()
        elif char in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _blank(out: bytearray, start: int, stop: int) -> None:
    """Replace ``out[start:stop]`` (a value nested too deep) by the string ``_TOO_DEEP`` and
    spaces, the same length. No note: where a column reads it, it shows; elsewhere it is
    skipped, as the C scanner skips it (so no warning can tell the two paths apart)."""
    text = b'"' + _TOO_DEEP + b'"'
    if len(text) > stop - start:
        text = b'""'
    out[start:stop] = text.ljust(stop - start)


def decode_or_repair(decoder: Any, data: Any, notes: list[str] | None = None, base: int = 0) -> Any:
    """``decoder.decode(data)``; where msgspec meets invalid UTF-8 or nesting too deep for it,
    decoded again from ``_repair``'s copy (``notes`` gets what was replaced).

    Raises msgspec.DecodeError for malformed JSON, as ``decode`` does.
    """
    try:
        value = decoder.decode(data)
    except (UnicodeDecodeError, RecursionError):
        fixed, done = _repair(bytes(data), base)
        value = decoder.decode(fixed)
    else:  # msgspec skips the strings it does not read (keys, args it ignores) unchecked: they
        done = _invalid_utf8(data, base) if notes is not None else []  # are counted all the same
    if notes is not None:  # only for a decode that succeeded: a cut tried inside an event, or
        notes.extend(done)  # the typed route given up for the loose one, repaired nothing kept
    return value


def _invalid_utf8(data: Any, base: int) -> list[str]:
    """``_repair``'s note on the invalid UTF-8 in ``data`` (none: ``[]``), so that every
    such byte of a file is noted, whichever chunk (and so whichever route) it was read in."""
    whole = data.obj if isinstance(data, memoryview) else data  # (a view of a chunk's buffer)
    if isinstance(whole, (bytes, bytearray)) and whole.isascii():  # ~20x faster than decoding
        return []
    try:
        str(data, "utf-8")
    except UnicodeDecodeError:
        return _repair(bytes(data), base)[1]
    return []


def merge_notes(notes: list[str]) -> list[str]:
    """``notes`` in order, each repeated one once, and the chunks' tallies (``_TALLIES``)
    joined into one note of each kind for the file, where the first stood: counts summed,
    the first's place (the earliest in the file) kept. So the warnings are the same however
    the file was cut into chunks (``CHUNK_BYTES``) or into stretches on two threads
    (``trace.split``)."""
    merged: list[str] = []
    tallies: dict[int, tuple[int, int, str]] = {}  # kind -> (its place in merged, count, first)
    for note in dict.fromkeys(notes):  # a chunk decoded twice notes its repairs twice
        for kind, (pattern, _) in enumerate(_TALLIES):
            match = pattern.match(note)
            if match is not None:
                place, count, first = tallies.get(kind, (len(merged), 0, match["first"]))
                if place == len(merged):
                    merged.append(note)
                tallies[kind] = (place, count + int(match["count"]), first)
                break
        else:
            merged.append(note)
    for kind, (place, count, first) in tallies.items():
        merged[place] = _TALLIES[kind][1].format(first=first, count=count)
    return merged


def _literal(value: Any) -> Any:
    """Metadata values written as Python reprs (``"{'rank': 2}"``) become objects; never eval.
    Only values JSON can hold are taken (the cache stores metadata as JSON)."""
    if isinstance(value, str) and value[:1] in "{[":
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            try:
                return decode_or_repair(_META, value.encode("utf-8", "surrogatepass"))
            except msgspec.DecodeError:
                return value
        try:
            return json.loads(json.dumps(parsed, allow_nan=False))
        except (TypeError, ValueError, RecursionError):
            return value
    return value


def _finite(value: Any) -> float | None:
    """A JSON number (or numeric text) as a finite float; None for anything else."""
    number = _to_number(value)
    try:
        number = float(number) if number is not None else None
    except OverflowError:  # an integer beyond float64
        return None
    return number if number is not None and math.isfinite(number) else None


def _float_or_text(text: str) -> float | str:
    """msgspec's ``float_hook`` on the loose path: a number beyond float64 (``1e400``) stays text."""
    value = float(text)
    return value if math.isfinite(value) else text


def _to_number(value: Any) -> int | float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text, 0)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return None
    return None
