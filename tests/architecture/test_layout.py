"""The harness's layout as the README draws it: folders in layers, imports that flow one way, no cycle.

Every import of every module (function-local ones included) is read from the source, so a lazy
import cannot hide a dependency the wrong way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "harness"

# Lower layers never import higher ones; a layer may import itself (without a cycle) and below.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "paths", "processes", "files"}),
    frozenset({"ranks", "targets", "pipelines"}),
    frozenset({"contracts", "cases", "baselines", "results", "metrics", "report", "perf", "project"}),
    frozenset({"gate", "sweep", "recalibrate"}),
    frozenset({"commands", "cli", "pytest_plugin"}),
)
MAX_TOP_LEVEL_MODULES = 8
MAX_LINES = 450  # at 120 columns as ruff formats them (400 was set for hand-wrapped 140-column code)


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(HARNESS.rglob("*.py")):
        parts = path.relative_to(HARNESS.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _unit(module: str) -> str:
    """The folder (or top-level module) a harness module belongs to: ``harness.gate.perf`` -> ``gate``."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        if module == "harness":
            continue
        unit = _unit(module)
        deps = {_unit(m) for m in _imports(path) if m.startswith("harness.")}
        graph.setdefault(unit, set()).update(deps - {unit})
    return graph


def test_every_folder_has_a_layer() -> None:
    units = set(_graph())
    assert units <= set().union(*LAYERS), f"not in any layer: {sorted(units - set().union(*LAYERS))}"


@pytest.mark.parametrize("page", ["README.md", "ARCHITECTURE.md"])
def test_the_layout_drawing_names_every_unit_of_the_layers(page: str) -> None:
    """The drawing a reader sees is the one this test enforces: every folder (``gate/``) and top-level module
    (``cli.py``) of LAYERS appears in the page's first code block after its "Layout" heading, if any."""
    text = (HARNESS.parent / page).read_text()
    drawing = text.partition("## Layout")[2].split("```", 2)[1] if "## Layout" in text else text.split("```", 2)[1]
    missing = sorted(u for u in set().union(*LAYERS) if f"{u}/" not in drawing and f"{u}.py" not in drawing)
    assert missing == [], f"{page}'s layout drawing omits {missing}"


def test_imports_flow_down_the_layers() -> None:
    wrong = sorted((u, d) for u, deps in _graph().items() for d in deps if _layer(d) > _layer(u))
    assert not wrong, f"imports that go up a layer: {wrong}"


def test_no_import_cycle_between_folders() -> None:
    graph = _graph()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    cycles = sorted(u for u in graph if reaches(u, u, set()))
    assert not cycles, f"folders on an import cycle: {cycles}"


def test_only_the_reference_target_knows_reference_impl() -> None:
    """``reference_impl.platform`` (the platform detector) is the one shared exception."""
    offenders = []
    for module, path in _modules():
        uses = {m for m in _imports(path) if m == "reference_impl" or m.startswith("reference_impl.")}
        uses = {m for m in uses if not m.startswith("reference_impl.platform")}
        if uses and not module.startswith("harness.targets.reference"):
            offenders.append((module, sorted(uses)))
    assert not offenders, offenders


@pytest.mark.parametrize("folder", ["contracts"])
def test_contracts_import_no_implementation(folder: str) -> None:
    offenders = [
        module
        for module, path in _modules()
        if module.startswith(f"harness.{folder}") and any(m.startswith("reference_impl") for m in _imports(path))
    ]
    assert not offenders, offenders


def test_reference_impl_never_imports_the_harness() -> None:
    root = HARNESS.parent / "reference_impl"
    offenders = [str(p) for p in root.rglob("*.py") if any(m.startswith("harness") for m in _imports(p))]
    assert not offenders, offenders


def test_few_top_level_modules_and_no_long_files() -> None:
    top = sorted(p.name for p in HARNESS.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    long = sorted(
        (str(p.relative_to(HARNESS)), n)
        for p in HARNESS.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    )
    assert not long, f"files over {MAX_LINES} lines: {long}"


MAX_FUNCTION_LINES = 50
MAX_LONG_FUNCTIONS = 5
LONG_MARK = "# long: "


def _long_functions() -> dict[str, str | None]:
    """``path:function`` of every function over MAX_FUNCTION_LINES lines (its docstring counted), with the reason
    on the line above its ``def`` (``# long: ...``), or None."""
    found: dict[str, str | None] = {}
    for _, path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    above = lines[first - 2].strip() if first >= 2 else ""
                    reason = above.removeprefix(LONG_MARK) if above.startswith(LONG_MARK) else None
                    found[f"{path.relative_to(HARNESS.parent)}:{node.name}"] = reason
    return found


def test_a_function_over_50_lines_says_why_and_there_are_few() -> None:
    long = _long_functions()
    assert sorted(name for name, reason in long.items() if not reason) == []
    assert len(long) <= MAX_LONG_FUNCTIONS, f"{len(long)} functions over {MAX_FUNCTION_LINES} lines: {sorted(long)}"


# A verb parses, builds typed options, calls one run function and renders: it neither starts rank processes nor
# writes a report file itself (emit_json, the --json output, and the terminal renderers are its render calls).
VERB_FORBIDDEN = ("harness.ranks", "harness.report.junit", "harness.report.html", "harness.results.results_document")


def test_verbs_start_no_ranks_and_write_no_reports() -> None:
    wrong = {
        str(path.relative_to(HARNESS.parent)): sorted(m for m in _imports(path) if m.startswith(VERB_FORBIDDEN))
        for module, path in _modules()
        if module.startswith("harness.commands")
    }
    assert {path: found for path, found in wrong.items() if found} == {}


def _register_calls(tree: ast.Module) -> tuple[int, int]:
    """(calls of ``register`` as a module-level statement, calls of it anywhere)."""
    called = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "register"]
    top = [s for s in tree.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and s.value in called]
    return len(top), len(called)


def test_every_contract_is_registered_one_way() -> None:
    """``register(Contract)`` at module level is the one way: builders (attention_contract, output_contract, ...)
    return a Contract and register nothing themselves, so every registered contract is visible where it is named."""
    elsewhere = {}
    for module, path in _modules():
        if module.startswith("harness.contracts") and module != "harness.contracts.registry":
            top, total = _register_calls(ast.parse(path.read_text()))
            if top != total:
                elsewhere[module] = total - top
    assert elsewhere == {}
