"""The examples in README.md and the docs run as written.

Every fenced Python or shell block is marked runnable (default suite), runnable slow (it trains:
the slow set) or not runnable with a reason (`tests/docs_markdown.py`), so a new block cannot be
skipped silently. A runnable block runs in a fresh folder that looks like the checkout (every
top-level entry linked, no `runs/`), so `examples/...` paths work and the runs it writes stay
in the temporary folder: Python through this interpreter, shell with `bash -e -o pipefail`.

`pip install -e .` lines are checked, not run: a stand-in `pip` first on PATH accepts only
`install [-q] -e .` or `.[extras]` and passes when the checkout's distribution and every
requirement of it (and of those extras) are installed, the state the block would leave. Any
other pip call fails the block.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from docs_markdown import PYTHON, ROOT, SHELL, Block, blocks, pages

CODE = PYTHON + SHELL
SKIP_IN_SANDBOX = {"runs", "build", "site", "dist"}
TIMEOUT = {False: 120, True: 1800}


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def runnable() -> list:
    """One test per distinct runnable block (README and getting-started share the main job's)."""
    by_code: dict[tuple[str, str], list[Block]] = {}
    for block in all_blocks():
        if block.runnable:
            by_code.setdefault((block.lang, block.code), []).append(block)
    params = []
    for same in by_code.values():
        ident = "+".join(f"{b.page}:{b.line}" for b in same)
        slow = any(b.slow for b in same)
        params.append(pytest.param(same[0], id=ident, marks=[pytest.mark.slow] if slow else []))
    return params


def test_every_fence_names_its_language():
    unnamed = [f"{b.page}:{b.line}" for b in all_blocks() if not b.lang]
    assert not unnamed, f"fenced blocks without a language (```text for output): {unnamed}"


def test_every_python_and_shell_block_says_whether_it_runs():
    problems = []
    for b in all_blocks():
        if b.lang not in CODE:
            continue
        if b.marker is None:
            written = f" ({b.marker_line} is not a marker)" if b.marker_line else ""
            problems.append(f"{b.page}:{b.line}: no <!-- runnable --> / <!-- runnable slow --> / "
                            f"<!-- not-runnable: why --> before it{written}")
        elif not b.runnable and len(b.reason.split()) < 2:
            problems.append(f"{b.page}:{b.line}: not-runnable needs its reason")
    assert not problems, "\n".join(problems)


def test_the_marker_reader_sees_every_kind(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        <!-- runnable -->

        ```bash
        true
        ```
        <!-- runnable slow -->
        ```python
        print(1)
        ```

        <!-- not-runnable: needs a phone -->
        ~~~bash
        adb shell
        ~~~

        <!-- runable -->

        ```python
        ```
        text
        ```
        """))
    found = blocks(page)
    assert [(b.lang, b.marker) for b in found] == [
        ("bash", "runnable"), ("python", "runnable slow"), ("bash", "not-runnable: needs a phone"),
        ("python", None), ("", None)]
    assert found[2].reason == "needs a phone" and found[2].code == "adb shell\n"
    assert found[3].marker_line == "<!-- runable -->"  # a misspelt marker is named, not ignored


@pytest.fixture
def sandbox(tmp_path) -> tuple[Path, dict[str, str]]:
    """A folder that looks like the checkout, and an environment with the stand-in pip."""
    folder = tmp_path / "checkout"
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in SKIP_IN_SANDBOX and not entry.name.startswith("."):
            (folder / entry.name).symlink_to(entry)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pip = bin_dir / "pip"
    pip.write_text(f"#!{sys.executable}\n" + PIP_STANDIN)
    pip.chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                                  os.environ.get("PATH", "")])}
    return folder, env


@pytest.mark.parametrize("block", runnable())
def test_the_block_runs_as_written(block: Block, sandbox):
    folder, env = sandbox
    if block.lang in PYTHON:
        script = folder / "doc_block.py"
        script.write_text(block.code)
        command = [sys.executable, script.name]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    run = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT[block.slow])
    assert run.returncode == 0, (f"{block.page}:{block.line} failed ({run.returncode}):\n"
                                 f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")


def test_the_pip_standin_refuses_what_it_cannot_vouch_for(sandbox):
    folder, env = sandbox

    def pip(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["pip", *args], cwd=folder, env=env, capture_output=True, text=True)

    assert pip("install", "-e", ".").returncode == 0
    assert pip("install", "-q", "-e", ".[no-such-extra]").returncode != 0
    assert pip("install", "requests").returncode != 0
    assert pip("install", "-e", "/elsewhere").returncode != 0


PIP_STANDIN = '''"""pip for the doc tests: `install [-q] -e .` or `.[extras]` passes when the distribution of
./pyproject.toml and all it requires (with those extras) are installed; anything else fails."""
import importlib.metadata as metadata
import re
import sys
import tomllib

from packaging.requirements import Requirement

args = [a for a in sys.argv[1:] if a not in ("-q", "--quiet")]
spec = re.fullmatch(r"\\.(?:\\[([\\w,-]+)\\])?", args[2]) if len(args) == 3 else None
if args[:2] != ["install", "-e"] or spec is None:
    sys.exit(f"doc-test pip: cannot vouch for `pip {' '.join(sys.argv[1:])}`")
project = tomllib.load(open("pyproject.toml", "rb"))["project"]["name"]
dist = metadata.distribution(project)
extras = spec[1].split(",") if spec[1] else []
unknown = set(extras) - set(dist.metadata.get_all("Provides-Extra") or [])
if unknown:
    sys.exit(f"doc-test pip: {project} has no extra {sorted(unknown)}")
missing = []
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or [""]):
        continue
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(str(req))
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{req} (installed {version})")
if missing:
    sys.exit(f"doc-test pip: {project} is installed but not {missing}")
print(f"doc-test pip: {project} {dist.version} and its requirements are installed")
'''
