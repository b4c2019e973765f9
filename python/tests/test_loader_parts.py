"""The leader loader's parts (spbcast/_loader) import one way, in the order _loader/__init__.py
states, and each stays small enough to hold in mind. Reads the sources only: nothing is run."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "spbcast"
PARTS = PACKAGE / "_loader"
PART_LINES, FUNCTION_LINES = 400, 60
# The facade, LeaderLoader (issue 37: about 300 lines); its class and method docstrings, the
# user's reference, are about 90 of them.
FACADE_LINES = 330


def _order():
    """The import order written in _loader/__init__.py's docstring ("Import order: a < b < ...")."""
    doc = ast.get_docstring(ast.parse((PARTS / "__init__.py").read_text()))
    line = re.search(r"^Import order: (.+)$", doc, re.MULTILINE)
    assert line, "_loader/__init__.py's docstring has no 'Import order:' line"
    return [name.strip() for name in line.group(1).split("<")]


def _imported_parts(path):
    """The parts a module imports: `from .x import ...`, `from . import x`, `from ._loader[.x] ...`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if path.parent == PARTS and node.level == 1:
            found |= {module.split(".")[0]} if module else {alias.name for alias in node.names}
        elif module.startswith("_loader"):
            found |= {module.split(".")[1]} if "." in module else {alias.name for alias in node.names}
    return found


def test_every_part_is_in_the_order():
    modules = {p.stem for p in PARTS.glob("*.py")} - {"__init__"}
    assert modules == set(_order()), f"parts {sorted(modules)} vs the stated order {_order()}"


def test_parts_import_one_way():
    order = _order()
    for path in PARTS.glob("*.py"):
        if path.stem == "__init__":
            assert _imported_parts(path) == set(), "_loader/__init__.py imports no part"
            continue
        for part in _imported_parts(path):
            assert part in order, f"{path.name} imports {part}, which is not a part"
            assert order.index(part) < order.index(path.stem), (
                f"{path.name} imports {part}: a part imports only parts before it ({' < '.join(order)})")


def test_sizes():
    for path in sorted(PARTS.glob("*.py")) + [PACKAGE / "loader.py"]:
        text = path.read_text()
        limit = FACADE_LINES if path.name == "loader.py" else PART_LINES
        lines = text.count("\n")
        assert lines <= limit, f"{path.name} has {lines} lines (at most {limit})"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= FUNCTION_LINES, f"{path.name}: {node.name} has {length} lines"

