"""No library function over 80 lines: a function that long does several things, and each of them
wants a name that says why it is there. Every module of the package (pyproject.toml's
package-dir mapping) is parsed; a function is counted from its `def` line
(decorators not included) to its last line, docstring and nested functions included."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def library_files(root: Path = ROOT) -> list[Path]:
    """Every module file of the package: each folder of the package-dir mapping (which names
    every subpackage too)."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted({path for folder in mapping.values() for path in (root / folder).glob("*.py")})


def function_lengths(source: str) -> dict[str, int]:
    """Qualified name (`Class.method`, `outer.inner`) -> lines from `def` to the function's end."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def long_functions(root: Path = ROOT) -> dict[str, int]:
    """`file::name` -> its length, for every library function over MAX_LINES."""
    found = {}
    for path in library_files(root):
        where = path.relative_to(root).as_posix()
        for name, length in function_lengths(path.read_text()).items():
            if length > MAX_LINES:
                found[f"{where}::{name}"] = length
    return found


def test_the_count_is_def_line_to_last_line_nested_included():
    source = "@decorator\ndef outer():\n    def inner():\n        pass\n\n    return 1\n\n\nclass C:\n" \
             "    def m(self):\n        return 2\n"
    assert function_lengths(source) == {"outer": 5, "outer.inner": 2, "C.m": 2}


def test_the_walk_covers_subpackages():
    files = {p.relative_to(ROOT).as_posix() for p in library_files()}
    assert {"public/topk.py", "coordinator/cli/plan.py", "export/bundle.py",
            "coordinator/engine/simulation.py", "dpfleet/cli.py"} <= files


def test_no_library_function_over_80_lines():
    over = long_functions()
    assert over == {}, "split these into helpers that each say why: " + ", ".join(
        f"{name} ({n} lines)" for name, n in sorted(over.items()))

