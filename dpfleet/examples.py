"""The example configs shipped inside the package, and `dpfleet init`, which writes one out.

Why in the package: an installed wheel has no repository around it, so the configs README and the
docs run travel as package data (`dpfleet/configs/`; the repository's `examples/*.toml` link to
these same files) and `dpfleet init` puts one in the folder a newcomer works in.
"""

from __future__ import annotations

import importlib.resources
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import click

from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write


@dataclass(frozen=True)
class Example:
    file: str  # in dpfleet/configs/
    run: str  # the command that runs it, with {file} for the written file
    what: str  # one line for `dpfleet init --help`


EXAMPLES: dict[str, Example] = {
    "shakespeare": Example("shakespeare_cifg.toml", "dpfleet simulate {file}",
                           "the main job: Shakespeare, eps 8, public pretraining (~40 s; ~2 min "
                           "the first time: downloads and pretraining)"),
    "tiny": Example("tiny.toml", "dpfleet simulate {file}",
                    "the main job's shape, 3 rounds of 100 clients (seconds)"),
    "fleet": Example("fleet.toml", "dpfleet fleet run {file} --state runs/fleet",
                     "a coordinator service and 200 emulated phones (loopback)"),
    "fred": Example("fred.toml", "dpfleet public fred-stats {file} --out runs/fred",
                    "private FreD statistics of the Shakespeare users"),
    "public-pipeline": Example("public_pipeline.toml",
                               "dpfleet public pipeline {file} --out runs/pipeline",
                               "DP-FTRL with public data chosen by distribution matching"),
    "stackoverflow": Example("stackoverflow_nwp.toml", "dpfleet simulate {file}",
                             "the DP-FTRL papers' StackOverflow run, Gboard's CIFG (needs TFF's "
                             "stackoverflow.sqlite and word counts: see the file's comment)"),
}


def example_text(name: str) -> str:
    """The TOML text of the example `name` (a key of `EXAMPLES`), read from the package."""
    if name not in EXAMPLES:
        raise DpfleetError(f"unknown example {name!r}; choose from {', '.join(EXAMPLES)}")
    return (importlib.resources.files("dpfleet") / "configs" / EXAMPLES[name].file).read_text()


def write_example(name: str, path: str | Path | None = None, force: bool = False) -> Path:
    """Write the example `name` to `path` (a file, or a folder to hold the example's file name;
    default the current folder) and return the file written. An existing file is kept unless
    `force`: a config someone edited is not silently replaced."""
    text = example_text(name)
    folder = path is not None and (Path(path).is_dir() or str(path).endswith(("/", os.sep)))
    target = Path(path) if path is not None else Path(EXAMPLES[name].file)
    if folder:
        target = target / EXAMPLES[name].file
    if target.exists() and not force:
        raise DpfleetError(f"{target} exists: pass --force to overwrite it")
    if not target.parent.is_dir():
        raise DpfleetError(f"no folder {target.parent}: create it first")
    try:
        atomic_write(target, text)
    except OSError as exc:
        raise DpfleetError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target


def _epilog() -> str:
    width = max(map(len, EXAMPLES))
    lines = [f"  {name.ljust(width)}  {e.what}" for name, e in EXAMPLES.items()]
    return "\b\nExamples (--example):\n" + "\n".join(lines)


@click.command(epilog=_epilog())
@click.argument("path", type=click.Path(), required=False)  # str: a trailing / means a folder
@click.option("--example", "-e", "name", type=click.Choice(list(EXAMPLES)), default="shakespeare",
              show_default=True, help="Which example config to write.")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def init(path: str | None, name: str, force: bool) -> None:
    """Write an example config into the current folder (or PATH), then run it.

    PATH is a file name or a folder (default: the example's own file name, here). An existing
    file is kept unless --force. Relative paths inside a config (data.path, tokenizer.path)
    are read relative to the config file. Every key is listed, with its default and meaning,
    on the documentation site's config reference.

    \b
      dpfleet init                       # shakespeare_cifg.toml: the main job
      dpfleet simulate shakespeare_cifg.toml
      dpfleet init --example tiny        # tiny.toml: a run of a few seconds
    """
    target = write_example(name, path, force)
    click.echo(f"wrote {target}: {EXAMPLES[name].what}")
    click.echo(f"run it: {EXAMPLES[name].run.format(file=shlex.quote(str(target)))}")
