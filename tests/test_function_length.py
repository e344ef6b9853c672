"""Functions stay short enough to hold in mind: at most 80 lines each in ciera_jax and
ciera_models. ``TOO_LONG_TODAY`` names the ones longer than that; the test asserts it is exactly
the set of long functions, so a new long function fails it and so does one on the list that got
shorter (take it off)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ciera_jax", "ciera_models")
MAX_LINES = 80

TOO_LONG_TODAY: set = set()


def long_functions() -> dict[str, int]:
    """``{"path:qualified.name": lines}`` of every function over ``MAX_LINES`` lines (its
    decorators and docstring included)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for name, node in _functions(tree, ""):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                if lines > MAX_LINES:
                    found[f"{rel}:{name}"] = lines
    return found


def _functions(node, prefix: str):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, name + ".")
        else:
            yield from _functions(child, prefix)


def test_no_function_is_longer_than_80_lines_but_the_named_ones():
    found = long_functions()
    new = {k: v for k, v in found.items() if k not in TOO_LONG_TODAY}
    assert not new, f"functions over {MAX_LINES} lines (split them): {new}"
    short = TOO_LONG_TODAY - set(found)
    assert not short, f"at most {MAX_LINES} lines, so off TOO_LONG_TODAY with them: {short}"


def test_the_count_sees_a_long_function():
    source = "def f():\n" + "    x = 1\n" * MAX_LINES
    (name, node), = _functions(ast.parse(source), "")
    assert name == "f" and node.end_lineno - node.lineno + 1 == MAX_LINES + 1
