"""User-facing errors: the CLI prints them as one line and exits non-zero, never a traceback."""

from collections.abc import Iterator
from contextlib import contextmanager


class DpfleetError(Exception):
    """A mistake in the user's input or environment that the user can fix."""


@contextmanager
def resume_hint(command: str) -> Iterator[None]:
    """On Ctrl-C, say how to continue (then the CLI's usual `aborted`, exit 130): long jobs
    keep resume points, so an interruption loses at most the work since the last one."""
    try:
        yield
    except KeyboardInterrupt:
        import click

        click.echo(f"\ninterrupted; continue with: {command}", err=True)
        raise click.exceptions.Abort() from None
