"""lint-imports (import-linter) on the package as installed: the contracts of pyproject.toml's
[tool.importlinter] (the layers), then a check that no two library modules import each other,
directly or in a circle. Extra arguments go to lint-imports.

Why not plain `lint-imports`: import-linter (grimp) finds a package's modules by walking its
folder, and the folder dpfleet/ holds none of the subpackages pyproject.toml maps onto it
([tool.setuptools.package-dir]: coordinator/ is dpfleet.coordinator, ...); the editable install's
finder maps them for imports, not for a folder walk. So the package is laid out as installed,
as symlinks in a temporary folder, by the docs' own `package_tree` (docs/_hooks/package_tree.py),
and lint-imports runs with that folder first on PYTHONPATH, from inside it: the checkout's
dpfleet/ folder is not on the path, and the editable finder comes after PYTHONPATH.

Why a cycle check besides the layers: a layers contract only sees imports between its layers, so
two modules of one layer (or one folder) can still import each other, and a circle makes the
modules in it one unit: none can be read, tested or moved alone. The check builds the same grimp
graph (imports inside functions and under TYPE_CHECKING count) and lists each strongly connected
component of two or more modules with one concrete circle through it (`--cycles` runs it alone).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_cycles(package: str = "dpfleet") -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of two or more of `package`'s modules, as (its modules,
    one closed circle through them, first module repeated at the end), sorted. Needs `package`
    importable as installed."""
    import grimp
    import networkx as nx

    graph = grimp.build_graph(package)
    edges = nx.DiGraph()
    for module in graph.modules:
        edges.add_edges_from((module, target) for target in graph.find_modules_directly_imported_by(module))
    cycles = []
    for component in nx.strongly_connected_components(edges):
        if len(component) < 2:
            continue
        circle = [a for a, _b in nx.find_cycle(edges.subgraph(component), source=min(component))]
        cycles.append((sorted(component), [*circle, circle[0]]))
    return sorted(cycles)


def _report_cycles() -> int:
    cycles = import_cycles()
    for modules, circle in cycles:
        print(f"import cycle of {len(modules)} modules ({', '.join(modules)}), e.g. " + " -> ".join(circle))
    print(f"import cycles: {len(cycles)}")
    return 1 if cycles else 0


def main(argv: list[str]) -> int:
    if argv == ["--cycles-here"]:  # the child below: the installed layout is on sys.path
        return _report_cycles()
    only_cycles = argv == ["--cycles"]
    hook_file = ROOT / "docs" / "_hooks" / "package_tree.py"
    spec = importlib.util.spec_from_file_location("package_tree", hook_file)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    lint = shutil.which("lint-imports")
    if lint is None and not only_cycles:
        print("lint-imports not found: pip install -e '.[test]' (import-linter)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dpfleet-layers-") as tmp:
        tree = hook.package_tree(ROOT, Path(tmp) / "pkg")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p))
        code = 0
        if not only_cycles:
            cmd = [lint, "--no-cache", str(ROOT / "pyproject.toml"), *argv]
            code = subprocess.call(cmd, cwd=tree, env=env)
        cycles = subprocess.call([sys.executable, str(Path(__file__).resolve()), "--cycles-here"],
                                 cwd=tree, env=env)
        return code or cycles


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
