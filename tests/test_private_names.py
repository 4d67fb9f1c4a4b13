"""No private name crosses modules (issue 31): outside tests, no `from dpfleet.x import _name` and no
`module._name` on an imported dpfleet module; a name another module needs gets a public name in
the right module (and layer). import-linter checks the layers (.ci/lint_imports.py); this is the
part it cannot express. Dunder names (`__version__`) are public."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where the toolkit's own code is used outside the package: scanned too
SCRIPTS = ("benchmarks", "examples")
# (file, name): private names another engineer's rewrite removes (issue 31), nothing else
ALLOWED = {
    ("benchmarks/accounting_speed.py", "_sensitivity"),  # coordinator/mechanisms/tree_sensitivity.py
}


def modules() -> dict[str, Path]:
    """Every module of the package (pyproject.toml's package-dir mapping) -> its file."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in mapping.items():
        for path in (ROOT / folder).glob("*.py"):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def crossings(path: Path, own: str | None, known: set[str], root: Path = ROOT) -> list[str]:
    """`file:line name` for each private name of another dpfleet module that `path` uses."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the dpfleet module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpfleet"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif private(alias.name) and node.module != own:
                    found.append((node.lineno, alias.name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                and bound.get(node.value.id, own) != own):
            found.append((node.lineno, node.attr))
    rel = path.relative_to(root).as_posix()
    return [f"{rel}:{line} {name}" for line, name in sorted(found) if (rel, name) not in ALLOWED]


def scan() -> list[str]:
    known = modules()
    files = [(path, name) for name, path in known.items()]
    files += [(path, None) for folder in SCRIPTS for path in sorted((ROOT / folder).rglob("*.py"))]
    return [hit for path, own in files for hit in crossings(path, own, set(known))]


def test_no_private_name_crosses_modules():
    assert scan() == []


def test_the_scan_sees_both_forms(tmp_path):
    known = {"dpfleet.a", "dpfleet.b"}
    path = tmp_path / "probe.py"
    path.write_text("from dpfleet.a import _x, y\nfrom dpfleet import b\nimport dpfleet.a as a\n"
                    "b._z()\na.__doc__\nb.ok()\na._w\n")
    hits = ["probe.py:1 _x", "probe.py:4 _z", "probe.py:7 _w"]
    assert crossings(path, "dpfleet.c", known, tmp_path) == hits
    assert crossings(path, "dpfleet.a", known, tmp_path) == ["probe.py:4 _z"]  # its own: fine
