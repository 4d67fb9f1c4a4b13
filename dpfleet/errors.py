"""User-facing errors: the CLI prints them as one line and exits non-zero, never a traceback."""


class DpfleetError(Exception):
    """A mistake in the user's input or environment that the user can fix."""
