"""`dpfleet ARGS` run inside the test's own process, for the tests of one-line errors and help.

A subprocess pays for importing torch and dpfleet again (2-5 CPU-s each, most of such a test);
the console script's entry point, `dpfleet.cli.main`, is what a subprocess would run, with the
same streams and exit code. Tests that need a real process (signals, a served coordinator, a
crash) keep `test_cli_errors.run_cli`.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import traceback
from pathlib import Path

from dpfleet.cli import main


def run_here(*args: str, env_extra: dict | None = None, cwd: Path | None = None
             ) -> subprocess.CompletedProcess:
    """Run `dpfleet *args` in this process: its stdout, stderr and exit code, as `subprocess.run`
    gives them. An exception that escapes `main` is printed as the interpreter would (a
    "Traceback" in stderr, exit 1), so a test that asserts no traceback still sees one."""
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_umask = os.umask(0o022)  # `service serve` sets the process's (077); put it back after
    os.umask(saved_umask)
    os.environ.update(env_extra or {})
    code = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # what an uncaught exception does to the process
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.umask(saved_umask)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["dpfleet", *args], code, out.getvalue(), err.getvalue())
