"""One pytest id per grid point: no check inside a loop of a test function.

A check (``assert``, ``pytest.raises``/``warns``, an ``assert_*`` helper) in a loop makes one failure
name the test, not the case, shape, dtype or verb it failed at, and hides the grid points after it.
A grid is a ``pytest.mark.parametrize``; the parts of one result are judged by one assertion over all
of them (a dict or set comparison names every failing part at once). Three loops are not grids and
are kept only with a marker on the loop's header that says why:

- ``# repeats: <why>`` (a ``for``): one scenario again and again on state the loop carries (kills, calls
  to one pool, Monte Carlo trials), each check guarding the next round;
- ``# one result: <why>`` (a ``for``): several checks on each part of one result computed before the loop;
- ``# poll: <why>`` (a ``while``): waiting for an event under a deadline.

A marked ``for`` over a literal collection, an UPPER_CASE constant or ``product(...)`` is a grid
whatever its marker, and is refused.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"#\s*(repeats|one result|poll):\s*\S")
FOR_MARKERS = frozenset({"repeats", "one result"})
WRAPPERS = frozenset({"enumerate", "zip", "sorted", "reversed", "list", "tuple", "set", "dict"})


def _is_check(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return True
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("raises", "warns") or name.lstrip("_").startswith("assert")


def _grid_iterables(node: ast.expr) -> list[ast.expr]:
    """What a ``for`` really walks: the arguments of enumerate/zip/sorted..., the dict of ``.items()``."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in WRAPPERS:
            return [i for arg in node.args for i in _grid_iterables(arg)]
        if isinstance(func, ast.Attribute) and func.attr in ("items", "values", "keys"):
            return _grid_iterables(func.value)
    return [node]


def _is_grid(node: ast.expr) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
        return True
    if isinstance(node, ast.Name) and node.id.isupper():
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) == "product"
    return False


def _marker(loop: ast.For | ast.While, lines: list[str]) -> str | None:
    """The marker on the loop's header lines (from ``for``/``while`` to the line before its body)."""
    last = max(loop.lineno, loop.body[0].lineno - 1)
    for line in lines[loop.lineno - 1 : last]:
        if found := MARKER.search(line):
            return found.group(1)
    return None


def _problem(loop: ast.For | ast.While, lines: list[str]) -> str | None:
    kind = _marker(loop, lines)
    if isinstance(loop, ast.While):
        return None if kind == "poll" else "a check in a while loop that is not marked '# poll:'"
    if kind not in FOR_MARKERS:
        return "a check in a for loop: parametrize the grid, or judge the parts of one result in one assertion"
    if any(_is_grid(i) for i in _grid_iterables(loop.iter)):
        return f"'# {kind}:' on a loop over a literal, a constant or a product: that is a grid, parametrize it"
    return None


def checks_in_loops(root: Path = TESTS) -> list[str]:
    """``file:line: problem`` for every loop of a test function with a check in its body."""
    found = []
    for path in sorted(root.rglob("test_*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for function in ast.walk(ast.parse(source)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.name.startswith(
                "test"
            ):
                continue
            for loop in ast.walk(function):
                if isinstance(loop, (ast.For, ast.AsyncFor, ast.While)) and any(
                    _is_check(n) for stmt in (*loop.body, *loop.orelse) for n in ast.walk(stmt)
                ):
                    if problem := _problem(loop, lines):
                        found.append((str(path.relative_to(root.parent)), loop.lineno, f"{function.name}: {problem}"))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(set(found))]


def test_no_check_inside_a_loop_over_a_grid() -> None:
    found = checks_in_loops()
    assert not found, f"{len(found)} loop(s) with a check inside:\n" + "\n".join(found)


def test_the_rule_sees_what_it_claims(tmp_path: Path) -> None:
    """The checker on planted loops: each kind it refuses, each marker it takes."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_planted.py").write_text(
        "import pytest\n"
        "def test_grid():\n"
        "    for dtype in ('fp32', 'bf16'):\n"
        "        assert dtype\n"
        "def test_raises():\n"
        "    for value in values():\n"
        "        with pytest.raises(ValueError):\n"
        "            parse(value)\n"
        "def test_marked_grid():\n"
        "    for case in CASES:  # one result: not really\n"
        "        assert case\n"
        "def test_unmarked_poll():\n"
        "    while busy():\n"
        "        assert alive()\n"
        "def test_repeats():\n"
        "    for _ in range(50):  # repeats: one pool, many calls\n"
        "        assert call()\n"
        "def test_one_result():\n"
        "    for run in session.runs():  # one result: the runs of one session\n"
        "        assert_close(run, 1)\n"
        "def test_poll():\n"
        "    while busy():  # poll: until the writer is done\n"
        "        assert alive()\n"
        "def test_no_check():\n"
        "    for x in (1, 2):\n"
        "        print(x)\n"
    )
    found = checks_in_loops(tmp_path / "tests")
    assert sorted(line.split(": ")[1] for line in found) == [
        "test_grid",
        "test_marked_grid",
        "test_raises",
        "test_unmarked_poll",
    ]
