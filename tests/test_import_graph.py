"""No two library modules import each other, directly or in a circle (imports inside functions
count): `.ci/lint_imports.py --cycles` on the package as installed names each circle it finds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycles_among_library_modules():
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "lint_imports.py"), "--cycles"],
                          capture_output=True, text=True, timeout=300)
    assert "import cycles: " in done.stdout, done.stderr  # the check ran (grimp found the package)
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip() == "import cycles: 0"
