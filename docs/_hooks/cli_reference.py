"""MkDocs hook: the CLI reference page, generated from the click commands at build time.

Why generated: a hand-copied reference goes stale with the first new option. Each command's
section is exactly what `dpfleet ... --help` prints (click's own formatter, so `\\b` example
blocks keep their lines), under a heading per command for the page's table of contents.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click

MARKER = "<!-- dpfleet-cli -->"
WIDTH = 90  # columns of the help text: what fits the page's code block


def _context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    """The context `--help` would see (the command's own context_settings, e.g. `-h`), parsing nothing."""
    return command.make_context(name, [], parent=parent, resilient_parsing=True,
                                max_content_width=WIDTH, terminal_width=WIDTH)


def _walk(command: click.Command, ctx: click.Context, depth: int) -> Iterator[str]:
    path = ctx.command_path
    yield f"{'#' * depth} `{path}`\n"
    short = command.get_short_help_str(limit=200)
    if short:
        yield f"{short}\n"
    yield "```text\n" + command.get_help(ctx).rstrip() + "\n```\n"
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, _context(sub, name, ctx), min(depth + 1, 4))


def cli_reference() -> str:
    """Markdown for every `dpfleet` command, the top group first, subcommands in list order."""
    from dpfleet.cli import cli

    return "\n".join(_walk(cli, _context(cli, "dpfleet", None), 2))


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown
