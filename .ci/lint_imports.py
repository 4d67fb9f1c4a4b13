"""lint-imports (import-linter) on the package as installed: the contracts of pyproject.toml's
[tool.importlinter] (the layers; issue 31). Extra arguments go to lint-imports.

Why not plain `lint-imports`: import-linter (grimp) finds a package's modules by walking its
folder, and the folder dpfleet/ holds none of the subpackages pyproject.toml maps onto it
([tool.setuptools.package-dir]: coordinator/ is dpfleet.coordinator, ...); the editable install's
finder maps them for imports, not for a folder walk. So the package is laid out as installed,
as symlinks in a temporary folder, by the docs' own `package_tree` (docs/_hooks/package_tree.py),
and lint-imports runs with that folder first on PYTHONPATH, from inside it: the checkout's
dpfleet/ folder is not on the path, and the editable finder comes after PYTHONPATH.
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


def main(argv: list[str]) -> int:
    hook_file = ROOT / "docs" / "_hooks" / "package_tree.py"
    spec = importlib.util.spec_from_file_location("package_tree", hook_file)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    lint = shutil.which("lint-imports")
    if lint is None:
        print("lint-imports not found: pip install -e '.[test]' (import-linter)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dpfleet-layers-") as tmp:
        tree = hook.package_tree(ROOT, Path(tmp) / "pkg")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p))
        cmd = [lint, "--no-cache", str(ROOT / "pyproject.toml"), *argv]
        return subprocess.call(cmd, cwd=tree, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
