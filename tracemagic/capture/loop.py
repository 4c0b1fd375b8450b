"""Find a cell's step loop and make it call the session's ``step()``.

The cell goes through IPython's own cell transforms (so ``%magics`` and ``!cmd`` lines
keep working), then its AST is rewritten: the step loop's body becomes

    with __chakra_trace__._iteration:   # step() at its end, also on ``continue``;
        <body>                          # _fail() first (no step) when it raised

(an ``Iteration``: a ``with`` and not ``try/except/finally``, so that a traceback keeps
the raising line, see ``Iteration``).

With ``--stop`` the loop also ends once the profile is done: ``if
__chakra_trace__._stop_loop(): break`` follows the ``with`` (a ``continue`` of the loop first
ends the iteration with ``__chakra_trace__._continue()`` and asks the same), so the loop's
``else:`` clause does not run, as after any ``break``.

And, when the loop sits in a statement that runs right away (not in a ``def``), the
session starts just before that statement and stops just after it, so set-up code
before the loop and reporting code after it stay out of the trace.

Unless ``--no-lines``, each statement of the cell also runs under a line mark (see
``mark_lines``): an annotation ``tracemagic.line:N`` (``MARK_PREFIX``) around it, so the ops,
kernels and allocations it causes are attributed to cell line N. The stepped loop itself is
never held in a mark (a mark must not stay open across a step), but a ``for`` loop's fetch of
each item is (``Fetch``): ``for x, y in loader:`` becomes ``for x, y in
__chakra_trace__._fetch(loader, "tracemagic.line:N"):``, so the time a DataLoader takes for
the next batch is the ``for`` line's, as a line profiler counts it.

Line numbers are the notebook cell's own: the ``%%chakra_trace`` line is line 1, so
tracebacks, ``--loop LINE`` and the messages all agree with what the user sees.
"""

from __future__ import annotations

import ast
import copy
import io
import tokenize
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from types import CodeType, TracebackType
from typing import Any, Literal, Protocol

from tracemagic.errors import CaptureError
from tracemagic.trace.kineto import LINE_MARK_PREFIX

#: Name of the session in the user namespace that the injected code calls. A dunder
#: name, so the cell's own variables (``chakra`` included) cannot shadow it.
SESSION_NAME = "__chakra_trace__"

_LOOPS = (ast.For, ast.While, ast.AsyncFor)
# statements that run their body right away, so a loop inside still runs "at top level"
_TRANSPARENT = (ast.With, ast.AsyncWith, ast.If, ast.Try)
_DEFERRED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

Mode = Literal["loop", "manual", "none"]


class _Stepped(Protocol):
    def step(self) -> None: ...
    def _fail(self) -> None: ...


class Iteration:
    """The ``with`` the rewritten loop runs each iteration's body in.

    On leaving the body (its end, ``continue``, ``break``, ``return``) it calls the
    session's ``step()``; when the body raised, ``_fail()`` first (that iteration's step
    is then left open) and the exception goes on unchanged.

    Why a ``with`` and not ``try/except/finally``: after an ``except``/``finally`` clause
    has run, the frame's current line is the clause's (here the loop's line), while a
    ``with`` re-raises restoring the raising instruction, so the frame's line stays the
    raising line. IPython's traceback reads the frame's line, not the traceback's, for a
    cell whose file is not on disk, which is the case in ipykernel (JupyterLab, nbclient:
    its cells are named ``/tmp/ipykernel_<pid>/<hash>.py``); with ``try/finally`` the arrow
    there pointed at the ``for`` line.
    """

    __slots__ = ("_session",)

    def __init__(self, session: _Stepped) -> None:
        self._session = session

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:  # the exception, if any, goes on
        if kind is not None:
            self._session._fail()
        self._session.step()


class _Marking(Protocol):
    _marking: bool

    def _mark(self, name: str) -> Any: ...


class Fetch:
    """The iterator of a stepped ``for`` loop with line marks: each item is fetched under the
    loop line's mark while the profiler records (a DataLoader's next batch: its ops, its
    wait for the workers), and plainly otherwise.

    Only the fetch is marked, not the loop: ``next()`` runs after the previous iteration's
    ``step()`` and ends before the body starts, so the mark never spans a step. Its frame
    is hidden from IPython's tracebacks (``__tracebackhide__``): an error raised by the
    iterable shows the cell's ``for`` line, then the iterable's own frames.
    """

    __slots__ = ("_items", "_name", "_session")

    def __init__(self, session: _Marking, items: Iterable[Any], name: str) -> None:
        self._items = iter(items)
        self._name = name
        self._session = session

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        __tracebackhide__ = True  # read by IPython's traceback formatter
        if self._session._marking:
            with self._session._mark(self._name):
                return next(self._items)
        return next(self._items)


@dataclass(frozen=True)
class LoopPlan:
    """Which loop gets stepped, and how the session brackets it.

    Attributes:
        mode: ``"loop"`` (a loop is stepped), ``"manual"`` (the cell calls
            ``<handle>.step()`` itself) or ``"none"`` (no loop: the cell is one step).
        line: the stepped loop's line in the cell (``%%chakra_trace`` is line 1).
        kind: ``"for"``, ``"while"`` or ``"async for"``.
        header: the loop's first source line, stripped.
        brackets_loop: the injected code starts and stops the session around the
            loop's top-level statement; otherwise the magic starts it before the cell.
        marked_lines: the cell lines whose statements run under a line mark, None with
            ``--no-lines``.
    """

    mode: Mode
    line: int | None = None
    kind: str | None = None
    header: str | None = None
    brackets_loop: bool = False
    marked_lines: tuple[int, ...] | None = None

    def describe(self, handle: str) -> str:
        """One line telling the user what will be stepped."""
        if self.mode == "manual":
            return f"the cell calls {handle}.step() itself; running it unchanged"
        if self.mode == "none":
            return "no loop in the cell: capturing the whole cell as one step"
        return f"stepping the `{self.kind}` loop at line {self.line}: {self.header}"

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain JSON values, for the manifest."""
        return {
            "mode": self.mode,
            "line": self.line,
            "kind": self.kind,
            "header": self.header,
        }

    def line_marks(self) -> dict[str, Any]:
        """The line marks as plain JSON values, for the manifest's ``line_marks``."""
        return {
            "marked": self.marked_lines is not None,
            "prefix": MARK_PREFIX,
            "lines": list(self.marked_lines or ()),
        }


@dataclass(frozen=True)
class PreparedCell:
    """A cell ready to run: its statements, its last expression and the plan.

    Attributes:
        body: code of every statement but a trailing expression.
        last_expr: code of the trailing expression (``eval`` mode), if any, so its
            value can still be displayed (none when the cell ends with ``;``).
        plan: what gets stepped.
        filename: the name the code was compiled under (registered in ``linecache``).
    """

    body: CodeType
    last_expr: CodeType | None
    plan: LoopPlan
    filename: str


def prepare_cell(
    shell: Any,
    line: str,
    cell: str,
    *,
    loop_line: int | None,
    handle: str,
    stop: bool = False,
    lines: bool = False,
) -> PreparedCell:
    """Transform, instrument and compile a ``%%chakra_trace`` cell.

    A cell of several lines run again unchanged (same text, magic line and options, and the
    shell's transformers and ``__future__`` flags unchanged) is not transformed, rewritten
    nor compiled again: its code is taken from ``PREPARED``, renamed after the cell's new
    execution count where the shell names cells by it (tracebacks show the run's own cell).

    Args:
        shell: the IPython shell (its transforms, compiler and AST transformers).
        line: the magic's argument line, shown as the cell's line 1 in tracebacks.
        cell: the cell body.
        loop_line: ``--loop LINE``, or None to pick the step loop automatically.
        handle: the user-facing session name (a cell calling ``<handle>.step()``
            is left alone).
        stop: ``--stop``: end the loop once the session is done (``break``).
        lines: mark each statement with its cell line (``mark_lines``; off: ``--no-lines``).

    Raises:
        CaptureError: ``--loop`` names a line without a loop, or conflicts with a
            cell that steps itself.
        SyntaxError: the cell is not valid Python (with the cell's own line numbers).
    """
    display = f"%%chakra_trace {line}".rstrip() + "\n" + cell
    running = getattr(shell.displayhook, "exec_result", None)  # the cell being run
    number = running.execution_count if running is not None else shell.execution_count
    # a one-line cell goes through IPython's prefilter, whose result depends on the
    # namespace (automagic, autocall): it is prepared every time (it is cheap)
    kept = sum(1 for text in cell.splitlines() if text.strip()) > 1
    key, keep = _cell_key(shell, display, loop_line, handle, stop, lines)
    cached = PREPARED.get(key, keep) if kept else None
    filename = shell.compile.cache(display, number, raw_code="# %%chakra_trace\n" + display)
    if cached is not None:
        return _renamed(cached, filename)

    blank = len(cell) - len(cell.lstrip("\n \t\r\f"))
    leading = cell[:blank].count("\n")  # IPython's transforms drop leading empty lines
    try:
        transformed = shell.transform_cell(cell)
    except SyntaxError as exc:  # IPython's tokenizer (an IndentationError): numbered from the
        _to_cell_lines(exc, filename, 1 + leading)  # first non-blank line, in no file
        raise
    source = "\n" * (1 + leading) + transformed
    tree = shell.compile.ast_parse(source, filename=filename)
    tree = shell.transform_ast(tree)

    last_expr = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(source):
        last_expr = ast.Expression(tree.body.pop().value)

    plan = instrument(tree, display.splitlines(), loop_line=loop_line, handle=handle, stop=stop, marks=lines)
    body = shell.compile(tree, filename, "exec")
    expr = shell.compile(last_expr, filename, "eval") if last_expr is not None else None
    prepared = PreparedCell(body=body, last_expr=expr, plan=plan, filename=filename)
    if kept:
        PREPARED.put(key, keep, prepared)
    return prepared


def _to_cell_lines(exc: SyntaxError, filename: str, before: int) -> None:
    """Make ``exc`` point at its line in the cell as shown (``before``: the lines above the
    text it was numbered in: the magic line, leading blank lines), in the cell's file."""
    exc.filename = filename
    if exc.lineno is not None:
        exc.lineno += before
    if exc.end_lineno is not None:
        exc.end_lineno += before


class PreparedCache:
    """The cells ``prepare_cell`` compiled, most recent last, at most ``size`` of them.

    Keyed by what the result depends on: the cell with its magic line, the options that
    change the rewrite, the shell's ``__future__`` flags and its input and AST
    transformers (by identity: an entry holds them, so a new transformer never takes an
    old one's ``id``).
    """

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], PreparedCell]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every cell."""
        self._entries.clear()

    def get(self, key: tuple[Any, ...], keep: tuple[Any, ...]) -> PreparedCell | None:
        """The cell prepared under ``key`` with these very transformers, if kept."""
        entry = self._entries.get(key)
        if entry is None or len(entry[0]) != len(keep) or any(a is not b for a, b in zip(entry[0], keep)):
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: tuple[Any, ...], keep: tuple[Any, ...], prepared: PreparedCell) -> None:
        """Keep ``prepared`` (the oldest entry goes beyond ``size``)."""
        self._entries[key] = (keep, prepared)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


#: the process's prepared cells (``prepare_cell``)
PREPARED = PreparedCache()


def _cell_key(
    shell: Any, display: str, loop_line: int | None, handle: str, stop: bool, lines: bool
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``prepare_cell``'s cache key, and the transformers it was made with."""
    manager = getattr(shell, "input_transformer_manager", None)
    keep = (
        *getattr(shell, "ast_transformers", ()),
        *getattr(shell, "input_transformers_post", ()),
        *getattr(manager, "cleanup_transforms", ()),
        *getattr(manager, "line_transforms", ()),
        *getattr(manager, "token_transformers", ()),
    )
    flags = getattr(shell.compile, "flags", 0)
    key = (id(shell), display, loop_line, handle, stop, lines, flags, tuple(id(t) for t in keep))
    return key, keep


def _renamed(prepared: PreparedCell, filename: str) -> PreparedCell:
    """``prepared`` with its code (nested functions' included) named ``filename``."""
    if prepared.filename == filename:
        return prepared
    expr = _refile(prepared.last_expr, filename) if prepared.last_expr is not None else None
    return replace(prepared, body=_refile(prepared.body, filename), last_expr=expr, filename=filename)


def _refile(code: CodeType, filename: str) -> CodeType:
    consts = tuple(_refile(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _ends_with_semicolon(source: str) -> bool:
    """Whether the last token of ``source`` is ``;`` (its value is then not displayed)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    ignored = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    last = next((t for t in reversed(tokens) if t.type not in ignored), None)
    return last is not None and last.type == tokenize.OP and last.string == ";"


def instrument(
    tree: ast.Module,
    lines: list[str],
    *,
    loop_line: int | None,
    handle: str,
    stop: bool = False,
    marks: bool = False,
) -> LoopPlan:
    """Pick the step loop of ``tree`` and rewrite it in place.

    Args:
        tree: the cell's module AST, line numbers as in ``lines``.
        lines: the cell's source lines (for the message naming the loop).
        loop_line: the loop's line, or None for the default choice: the first loop
            that runs at top level (looking through ``with``/``if``/``try``), then
            down while its body holds exactly one loop.
        handle: the user-facing session name.
        stop: also end the loop once the session is done (``--stop``).
        marks: mark each statement with its cell line (``mark_lines``).

    Raises:
        CaptureError: ``loop_line`` has no loop, or the cell also steps itself.
    """
    manual = _calls_step(tree, handle)
    if manual and loop_line is not None:
        raise CaptureError(
            f"--loop {loop_line}: the cell already calls {handle}.step() itself; drop --loop, or the call."
        )
    if manual:
        marked = mark_lines(tree, handle=handle) if marks else None
        ast.fix_missing_locations(tree)
        return LoopPlan(mode="manual", marked_lines=marked)

    loop = _loop_at(tree, loop_line) if loop_line is not None else _default_loop(tree.body)
    if loop is None:
        marked = mark_lines(tree, handle=handle) if marks else None
        ast.fix_missing_locations(tree)
        return LoopPlan(mode="none", marked_lines=marked)

    marked = None
    if marks:
        keep: list[ast.AST] = [loop]
        if stop:  # their ``_continue()`` steps: no mark may stay open across it
            keep.extend(stmt for stmt, *_ in _own_continues(loop.body))
        marked = mark_lines(tree, handle=handle, unmarked=keep)
        if isinstance(loop, ast.For) and not _deferred(tree, loop):
            _fetch_marked(loop)
            marked = tuple(sorted({*marked, loop.lineno}))
    _wrap_body(loop)
    if stop:
        _stop_when_done(loop)
    brackets = _bracket(tree, loop)
    ast.fix_missing_locations(tree)
    kind = {ast.For: "for", ast.While: "while", ast.AsyncFor: "async for"}[type(loop)]
    header = lines[loop.lineno - 1].strip() if loop.lineno <= len(lines) else ""
    return LoopPlan(
        mode="loop",
        line=loop.lineno,
        kind=kind,
        header=header,
        brackets_loop=brackets,
        marked_lines=marked,
    )


#: the name of a line mark: ``tracemagic.line:<cell line>`` (the ``%%chakra_trace`` line is 1)
MARK_PREFIX = LINE_MARK_PREFIX
# compound statements whose bodies are marked statement by statement
_COMPOUND = (
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.If,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.TryStar,
    ast.Match,
)
# statements never marked: nothing to time, or declarations a ``with`` must not hold
_SKIPPED = (ast.Pass, ast.Break, ast.Continue, ast.Global, ast.Nonlocal)


def mark_lines(tree: ast.Module, *, handle: str, unmarked: list[ast.AST] | None = None) -> tuple[int, ...]:
    """Run each statement of the cell under a line mark; the lines marked.

    A simple statement at line N becomes::

        if __chakra_trace__._marking:               # only while the profiler is on
            with __chakra_trace__._mark("tracemagic.line:N"):
                <statement>
        else:
            <statement>

    and a compound one (``for``/``while``/``if``/``with``/``try``/``match``) is held in the
    ``with`` alone, its inner statements marked in turn, so a line's annotation encloses its
    nested lines'. ``_mark`` is torch's ``_RecordFunctionFast`` (a C++ ``RecordFunction``, no
    Python frame of its own; it records nothing while the profiler is off), so the marks cost
    a test of one attribute outside the profiler's window and ~1 µs per statement inside it.
    Measured against the alternatives (torch 2.13, CPU, profiler on with shapes, memory and
    stacks / off): ``_RecordFunctionFast`` 1.1 µs / 0.23 µs; ``torch.profiler.record_function``
    10.7 µs / 4.6 µs; a Python context manager calling ``_record_function_enter_new`` and
    ``_exit`` 17 µs / 0.18 µs (its own frames are recorded as ``python_function`` events);
    ``try``/``finally`` around the calls would also move the traceback's line. A ``with``
    keeps the frame's line on the raising statement (see ``Iteration``), and
    ``break``/``continue``/``return`` leave it as they leave any ``with``.

    Not marked: statements that hold the stepped loop (a stepped ``for`` loop's fetch of
    each item is, by ``instrument``: see ``Fetch``), a use of the session
    (``<handle>.step()``, ``<handle>.recording``...) or one of ``unmarked`` (a mark must never stay open across a
    step); ``pass``/``break``/``continue``/``global``/``nonlocal``, ``from __future__``
    imports, string statements (docstrings); the bodies of ``def``/``class``/``lambda``
    (they run later, maybe after the cell: their time is their call site's line).

    Args:
        tree: the cell's module AST, line numbers as the cell shows them.
        handle: the user-facing session name.
        unmarked: nodes whose enclosing statements must not be marked.
    """
    blocked: list[ast.AST] = list(unmarked or [])
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in (SESSION_NAME, handle):
            blocked.append(node)
    blocked_ids = {id(node) for node in blocked}
    lines: set[int] = set()

    def holds_blocked(stmt: ast.stmt) -> bool:
        return any(id(node) in blocked_ids for node in ast.walk(stmt))

    def mark_body(body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            out.append(mark_one(stmt))
        return out

    def mark_inside(stmt: ast.stmt) -> None:
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                setattr(stmt, field, mark_body(inner))
        for holder in [*getattr(stmt, "handlers", []), *getattr(stmt, "cases", [])]:
            holder.body = mark_body(holder.body)

    def mark_one(stmt: ast.stmt) -> ast.stmt:
        if isinstance(stmt, (*_DEFERRED, *_SKIPPED)) or _is_docstring(stmt):
            return stmt
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            return stmt
        blocked_here = holds_blocked(stmt)
        if isinstance(stmt, _COMPOUND):
            mark_inside(stmt)
            if blocked_here:
                return stmt
            lines.add(stmt.lineno)
            return _mark_with(stmt, [stmt])
        if blocked_here:
            return stmt
        lines.add(stmt.lineno)
        twin = copy.deepcopy(stmt)
        test = _session_attr("_marking", stmt)
        return _located(ast.If(test=test, body=[_mark_with(stmt, [stmt])], orelse=[twin]), stmt)

    tree.body = mark_body(tree.body)
    return tuple(sorted(lines))


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _session_attr(attr: str, anchor: ast.stmt) -> ast.Attribute:
    node = ast.Attribute(value=ast.Name(id=SESSION_NAME, ctx=ast.Load()), attr=attr, ctx=ast.Load())
    for sub in (node, node.value):
        _located(sub, anchor)
    return node


_Node = Any


def _located(node: _Node, anchor: ast.stmt) -> _Node:
    """``node`` placed on ``anchor``'s first line (a traceback never points elsewhere)."""
    ast.copy_location(node, anchor)
    node.end_lineno, node.end_col_offset = anchor.lineno, anchor.col_offset
    return node


def _mark_with(anchor: ast.stmt, body: list[ast.stmt]) -> ast.With:
    """``with __chakra_trace__._mark("tracemagic.line:N"): <body>`` on ``anchor``'s line."""
    name = _located(ast.Constant(f"{MARK_PREFIX}{anchor.lineno}"), anchor)
    call = _located(ast.Call(func=_session_attr("_mark", anchor), args=[name], keywords=[]), anchor)
    return _located(ast.With(items=[ast.withitem(context_expr=call, optional_vars=None)], body=body), anchor)


def _calls_step(tree: ast.AST, handle: str) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "step"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == handle
        ):
            return True
    return False


def _children(stmt: ast.stmt) -> list[ast.stmt]:
    """Statements a transparent statement runs right away, in source order."""
    out: list[ast.stmt] = list(getattr(stmt, "body", []))
    if isinstance(stmt, ast.Try):
        for handler in stmt.handlers:
            out.extend(handler.body)
    out.extend(getattr(stmt, "orelse", []))
    out.extend(getattr(stmt, "finalbody", []))
    return out


def _loops_in(body: list[ast.stmt]) -> list[ast.For | ast.While | ast.AsyncFor]:
    """The loops at the top level of ``body``, looking through with/if/try."""
    found: list[ast.For | ast.While | ast.AsyncFor] = []
    for stmt in body:
        if isinstance(stmt, _LOOPS):
            found.append(stmt)
        elif isinstance(stmt, _TRANSPARENT):
            found.extend(_loops_in(_children(stmt)))
    return found


def _default_loop(body: list[ast.stmt]) -> ast.For | ast.While | ast.AsyncFor | None:
    loops = _loops_in(body)
    if not loops:
        return None
    loop = loops[0]
    while True:
        inner = _loops_in(loop.body)
        if len(inner) != 1:
            return loop
        loop = inner[0]


def _loop_at(tree: ast.Module, line: int) -> ast.For | ast.While | ast.AsyncFor:
    loops = sorted((node for node in ast.walk(tree) if isinstance(node, _LOOPS)), key=lambda n: n.lineno)
    for loop in loops:
        header_end = loop.body[0].lineno - 1 if loop.body[0].lineno > loop.lineno else loop.lineno
        if loop.lineno <= line <= header_end:
            return loop
    where = ", ".join(str(loop.lineno) for loop in loops)
    hint = f"loops start at line {where}" if loops else "the cell has no for/while loop"
    raise CaptureError(
        f"--loop {line}: there is no for/while loop at line {line} of the cell "
        f"(the %%chakra_trace line is line 1); {hint}."
    )


def _session_call(method: str, anchor: ast.stmt) -> ast.Expr:
    call = ast.Expr(
        ast.Call(
            func=ast.Attribute(value=ast.Name(id=SESSION_NAME, ctx=ast.Load()), attr=method, ctx=ast.Load()),
            args=[],
            keywords=[],
        )
    )
    for node in ast.walk(call):
        ast.copy_location(node, anchor)
        if isinstance(node, (ast.expr, ast.stmt)):  # contexts (Load) carry no position
            node.end_lineno, node.end_col_offset = anchor.lineno, anchor.col_offset
    return call


def _deferred(tree: ast.Module, loop: ast.AST) -> bool:
    """Whether ``loop`` sits in a ``def`` or ``class`` of the cell (its lines are not marked)."""
    return any(isinstance(node, _DEFERRED) and _contains(node, loop) for node in ast.walk(tree))


def _fetch_marked(loop: ast.For) -> None:
    """``for <target> in __chakra_trace__._fetch(<iter>, "tracemagic.line:N"):`` (``Fetch``)."""
    name = _located(ast.Constant(f"{MARK_PREFIX}{loop.lineno}"), loop)
    loop.iter = _located(ast.Call(func=_session_attr("_fetch", loop), args=[loop.iter, name], keywords=[]), loop)


def _wrap_body(loop: ast.For | ast.While | ast.AsyncFor) -> None:
    """``with __chakra_trace__._iteration: <body>`` (see ``Iteration``), on the loop's line."""
    manager = ast.Attribute(value=ast.Name(id=SESSION_NAME, ctx=ast.Load()), attr="_iteration", ctx=ast.Load())
    wrapped = ast.With(items=[ast.withitem(context_expr=manager, optional_vars=None)], body=loop.body)
    for node in (wrapped, manager, manager.value):
        ast.copy_location(node, loop)
        node.end_lineno, node.end_col_offset = loop.lineno, loop.col_offset
    loop.body = [wrapped]


def _stop_when_done(loop: ast.For | ast.While | ast.AsyncFor) -> None:
    """``--stop``: ``break`` after the step when the session is done, also at a ``continue``."""

    def check() -> ast.If:
        call = _session_call("_stop_loop", loop)
        return ast.copy_location(ast.If(test=call.value, body=[ast.copy_location(ast.Break(), loop)], orelse=[]), loop)

    for stmt, parent, field, index in _own_continues(loop.body):
        anchor = ast.copy_location(ast.Continue(), stmt)
        getattr(parent, field)[index : index + 1] = [_session_call("_continue", stmt), check(), anchor]
    loop.body.append(check())


def _own_continues(body: list[ast.stmt]) -> list[tuple[ast.stmt, ast.AST, str, int]]:
    """The ``continue`` statements of ``body`` that continue its loop (not an inner
    loop's, nor a nested function's), as (statement, parent, field, index), last first."""
    found: list[tuple[ast.stmt, ast.AST, str, int]] = []

    def visit(parent: ast.AST, field: str) -> None:
        for index, stmt in enumerate(getattr(parent, field)):
            if isinstance(stmt, ast.Continue):
                found.append((stmt, parent, field, index))
            elif isinstance(stmt, _DEFERRED):
                continue
            elif isinstance(stmt, _LOOPS):
                visit(stmt, "orelse")  # an inner loop's else: continues the outer loop
            else:
                for sub in ("body", "orelse", "finalbody"):
                    if isinstance(getattr(stmt, sub, None), list):
                        visit(stmt, sub)
                for handler in getattr(stmt, "handlers", []):
                    visit(handler, "body")
                for case in getattr(stmt, "cases", []):
                    visit(case, "body")

    holder = ast.Module(body=body, type_ignores=[])
    visit(holder, "body")
    return found[::-1]


def _contains(stmt: ast.stmt, target: ast.AST) -> bool:
    return any(node is target for node in ast.walk(stmt))


def _bracket(tree: ast.Module, loop: ast.AST) -> bool:
    """Start/stop the session around the top-level statement holding ``loop``.

    Returns False (nothing inserted) when that statement only defines code (a
    ``def``/``class``): then the session runs for the whole cell.
    """
    for index, stmt in enumerate(tree.body):
        if _contains(stmt, loop):
            if _deferred(ast.Module(body=[stmt], type_ignores=[]), loop):
                return False
            tree.body[index : index + 1] = [
                _session_call("start", stmt),
                stmt,
                _session_call("stop", stmt),
            ]
            return True
    return False
