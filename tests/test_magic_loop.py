"""Step-loop choice and rewriting (``tracemagic.capture.loop``), without running a profiler."""

from __future__ import annotations

import ast
import dis
import linecache
import textwrap

import pytest

from tracemagic.capture.loop import SESSION_NAME, instrument, prepare_cell
from tracemagic.errors import CaptureError


def plan_for(body: str, loop_line: int | None = None):
    """Instrument ``body`` as a cell (the magic line is line 1); return (plan, code)."""
    source = "\n" + textwrap.dedent(body)
    tree = ast.parse(source)
    plan = instrument(tree, source.splitlines(), loop_line=loop_line, handle="chakra")
    return plan, ast.unparse(tree)


def test_first_top_level_loop_is_stepped_and_bracketed():
    plan, code = plan_for("""\
        x = 1
        for a in range(3):
            pass
        for b in range(3):
            pass
    """)
    assert (plan.mode, plan.kind, plan.line, plan.header) == ("loop", "for", 3, "for a in range(3):")
    assert plan.brackets_loop
    lines = code.splitlines()
    assert lines[1] == f"{SESSION_NAME}.start()" and lines[2].startswith("for a")
    assert f"{SESSION_NAME}.stop()" in lines and "for b in range(3):" in lines
    assert code.count(f"with {SESSION_NAME}._iteration:") == 1


def test_descends_while_the_body_holds_exactly_one_loop():
    plan, _ = plan_for("""\
        for epoch in range(2):
            with open('x'):
                while True:
                    for batch in range(3):
                        pass
                    break
    """)
    assert (plan.kind, plan.line) == ("for", 5)


def test_stops_descending_at_two_inner_loops():
    plan, _ = plan_for("""\
        for epoch in range(2):
            for batch in range(3):
                pass
            for val in range(3):
                pass
    """)
    assert plan.line == 2


def test_loop_inside_try_and_if_is_found():
    plan, _ = plan_for("""\
        try:
            if True:
                while x:
                    pass
        except Exception:
            pass
    """)
    assert (plan.kind, plan.line) == ("while", 4)


def test_loop_in_a_function_is_not_default_but_selectable_without_brackets():
    body = """\
        def train():
            for i in range(3):
                pass
        train()
    """
    assert plan_for(body)[0].mode == "none"
    plan, code = plan_for(body, loop_line=3)
    assert plan.mode == "loop" and not plan.brackets_loop
    assert ".start()" not in code and f"with {SESSION_NAME}._iteration:" in code


def test_loop_line_accepts_continuation_lines_of_the_header():
    plan, _ = plan_for("""\
        for i in zip(
            range(3), range(3)
        ):
            pass
    """, loop_line=3)
    assert plan.line == 2


def test_loop_line_without_loop_lists_the_loops():
    with pytest.raises(CaptureError, match=r"--loop 2: .* loops start at line 3, 4"):
        plan_for("""\
            x = 1
            for i in range(3):
                for j in range(3):
                    pass
        """, loop_line=2)


def test_manual_stepping_is_left_alone():
    plan, code = plan_for("""\
        for i in range(3):
            chakra.step()
    """)
    assert plan.mode == "manual" and SESSION_NAME not in code


def test_prepare_cell_keeps_the_cells_line_numbers(ip):
    cell = "\n\nx = 1\nfor i in range(2):\n    %time i\n    y = 1 / 0\n"
    prepared = prepare_cell(ip, "--et", cell, loop_line=None, handle="chakra")
    assert prepared.plan.line == 5  # magic line 1, two blank lines, x = 1
    linenos = {i.positions.lineno for i in dis.get_instructions(prepared.body)}
    assert {4, 5, 6, 7} <= linenos  # x = 1 is line 4
    assert linecache.getline(prepared.filename, 1).startswith("%%chakra_trace --et")
    assert linecache.getline(prepared.filename, 7).strip() == "y = 1 / 0"
    assert prepared.last_expr is None


def test_prepare_cell_splits_the_last_expression(ip):
    prepared = prepare_cell(ip, "", "x = 2\nx * 21\n", loop_line=None, handle="chakra")
    assert prepared.plan.mode == "none"
    ns: dict = {}
    exec(prepared.body, ns)
    assert eval(prepared.last_expr, ns) == 42


def test_prepare_cell_a_trailing_semicolon_hides_the_value(ip):
    prepared = prepare_cell(ip, "", "x = 2\nx * 21;  # quiet\n", loop_line=None, handle="chakra")
    assert prepared.last_expr is None
    ns: dict = {}
    exec(prepared.body, ns)  # the expression still runs
    assert ns["x"] == 2


def test_stop_breaks_after_the_step_and_at_the_loops_own_continues_only():
    source = "\n" + textwrap.dedent("""\
        for i in range(3):
            if i:
                continue
            for j in range(2):
                continue
            else:
                continue
            def f():
                for k in range(2):
                    continue
    """)
    tree = ast.parse(source)
    instrument(tree, source.splitlines(), loop_line=2, handle="chakra", stop=True)
    code = ast.unparse(tree)
    loop = tree.body[1]
    assert isinstance(loop, ast.For) and isinstance(loop.body[-1], ast.If)  # after the try: break when done
    assert ast.unparse(loop.body[-1]) == f"if {SESSION_NAME}._stop_loop():\n    break"
    # the loop's own continues (in the if, and in the inner loop's else) end the step first
    assert code.count(f"{SESSION_NAME}._continue()") == 2
    assert code.count(f"{SESSION_NAME}._stop_loop()") == 3
    # every continue is kept; the inner loop's and f's unchanged
    assert [line.strip() for line in code.splitlines()].count("continue") == 4


def test_without_stop_nothing_breaks():
    _, code = plan_for("""\
        for i in range(3):
            continue
    """)
    assert "_stop_loop" not in code and "_continue" not in code
