"""MkDocs hook: let mkdocstrings (griffe) find `dpfleet.coordinator`, `dpfleet.secagg`, ...

Why: pyproject.toml maps top-level folders (coordinator/, secagg/, ...) onto dpfleet.* subpackages
([tool.setuptools.package-dir]). Python's import system follows that mapping (the editable finder),
but griffe reads folders: it finds dpfleet/ and none of its mapped subpackages. So before any API
page renders, this hook lays out the package as installed, as symlinks under build/docs_pkg/, from
the mapping in pyproject.toml itself (a new subpackage there needs no docs change), and points the
Python handler at it. Statically analysed: nothing is imported, so torch is not needed for the API.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

try:
    from mkdocs.plugins import event_priority
except ImportError:  # `package_tree` alone, without the docs extra: .ci/lint_imports.py

    def event_priority(priority: float) -> Any:
        return lambda f: f


def package_tree(root: Path, out: Path) -> Path:
    """Symlink `root`'s package-dir mapping into `out` as one folder per package; return `out`."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    if out.exists():
        shutil.rmtree(out)
    for package, folder in sorted(mapping.items()):  # parents sort before their children
        target = out.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted((root / folder).iterdir()):
            if entry.suffix == ".py":
                (target / entry.name).symlink_to(entry.resolve())
    return out


@event_priority(100)  # before mkdocstrings' on_config, which creates the handler and its search paths
def on_config(config: Any) -> Any:
    root = Path(config.config_file_path).resolve().parent
    tree = package_tree(root, root / "build" / "docs_pkg")
    config.plugins["mkdocstrings"].config.handlers["python"]["paths"] = [str(tree)]
    return config
