"""The wheel holds what an installed dpfleet needs besides code (issue 33: it held only .py files).
CI also installs it in a fresh venv and runs `dpfleet init --example tiny` (.ci/wheel_smoke.sh)."""

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from dpfleet.examples import EXAMPLES

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # builds the wheel: ~15 s
def test_the_wheel_carries_the_example_configs_py_typed_and_the_license(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("dpfleet-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for example in EXAMPLES.values():
            packaged = f"dpfleet/configs/{example.file}"
            assert zf.read(packaged) == (REPO / "examples" / example.file).read_bytes(), packaged
        assert "dpfleet/py.typed" in names
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert zf.read(license_file) == (REPO / "LICENSE").read_bytes()
        metadata = zf.read(license_file.replace("licenses/LICENSE", "METADATA")).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert b"Apache License" in (REPO / "LICENSE").read_bytes()[:200]
    # every mapped subpackage is in, and nothing of the repository around it
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for package in packages:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/", "docs/"))]
