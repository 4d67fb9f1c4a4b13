"""User-facing errors: the CLI prints them as one line and exits non-zero, never a traceback."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click


class DpfleetError(Exception):
    """A mistake in the user's input or environment that the user can fix."""


class DpfleetWarning(UserWarning):
    """A result that is not fully private or means nothing: said to Python callers through
    `warnings.warn` (the CLI prints the same lines as WARNING)."""


class Interrupted(click.exceptions.Abort):
    """Ctrl-C after the command said how to continue: the CLI exits 130 and adds nothing, so
    the hint stays the last line (a plain Abort, where nothing was said, gets `aborted`)."""


@contextmanager
def resume_hint(command: str, kept: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """On Ctrl-C, say how to continue (as the last line, exit 130: `Interrupted`): long jobs
    keep resume points, so an interruption loses at most the work since the last one. `kept()`
    false: the job was interrupted before it kept anything (nothing to resume; run it again)."""
    try:
        yield
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; continue with: {command}" if kept() else
                   "\ninterrupted before anything was kept; run the same command again", err=True)
        raise Interrupted() from None
