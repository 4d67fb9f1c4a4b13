"""`dpfleet data list|get|stats|inspect`: the user-keyed text datasets, and your files of them."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.edge.datasets import DATASETS
from dpfleet.jsonio import dumps


@click.group()
def data() -> None:
    """Inspect the real, user-keyed text datasets dpfleet ships loaders for."""


@data.command("list")
def list_() -> None:
    """List the datasets."""
    for name, what in DATASETS.items():
        click.echo(f"{name:12s} {what}")


def _path_option(f):
    return click.option("--path", type=click.Path(path_type=Path), default=None,
                        help="Your file, for the jsonl dataset.")(f)


@data.command()
@click.argument("name")
@click.option("--split", default="train", show_default=True, help="train/valid/test (wikitext2).")
@_path_option
def get(name: str, split: str, path: Path | None) -> None:
    """Fetch NAME into the data cache and report how many records and users it has."""
    from dpfleet.edge.datasets import load_records

    records = load_records(name, split, path)
    users = {r.user for r in records}
    click.echo(f"{name}: {len(records)} records from {len(users)} users (cached)")


@data.command()
@click.argument("name")
@_path_option
@click.option("--vocab-size", default=1024, show_default=True,
              help="Public SentencePiece size (the main job uses 1024).")
@click.option("--seq-len", default=20, show_default=True, help="Tokens per example.")
@click.option("--max-examples", default=256, show_default=True, help="Examples kept per client.")
@click.option("--test-fraction", default=0.1, show_default=True, help="Held-out users.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stats(name: str, path: Path | None, vocab_size: int, seq_len: int, max_examples: int,
          test_fraction: float, as_json: bool) -> None:
    """Clients, examples, tokens and examples per client, as the simulation would build them."""
    from dpfleet.edge.client_data import build_federated, describe
    from dpfleet.edge.datasets import load_records
    from dpfleet.edge.spm_public import public_sentencepiece

    records = load_records(name, "train", path)
    tokenizer = public_sentencepiece("wikitext2", vocab_size)
    fed = build_federated(records, tokenizer, seq_len=seq_len, max_examples=max_examples,
                          test_fraction=test_fraction)
    info = describe(fed)
    if as_json:
        click.echo(dumps(info, indent=2))
        return
    click.echo(f"{name}: sequences of <= {seq_len} tokens, <= {max_examples} examples per client")
    for part in ("train", "test"):
        d = info[part]
        q = d["examples_per_client"]
        click.echo(
            f"  {part:5s} clients {d['clients']:6d}  examples {d['examples']:8d}  "
            f"tokens {d['tokens']:9d}  examples/client min {q['min']:.0f} p25 {q['p25']:.0f} "
            f"median {q['median']:.0f} p75 {q['p75']:.0f} max {q['max']:.0f}"
        )


@data.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--format", "fmt", default="", help="tff_sqlite, tff_h5, leaf or jsonl; default: "
              "inferred from the file.")
@click.option("--split", default="train", show_default=True,
              help="A TFF SQLite file's split_name (\"\" for every split).")
@click.option("--feature", default="", help="The text feature of a TFF file (default: tokens, "
              "snippets or text, the first present).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(file: Path, fmt: str, split: str, feature: str, as_json: bool) -> None:
    """Users, examples and tokens per user (percentiles) of a TFF SQLite / HDF5, LEAF JSON or
    jsonl FILE, read in one streaming pass (tokens: whitespace-separated words)."""
    from dpfleet.edge.data_files import summarize

    info = summarize(file, fmt, split, feature, progress=not as_json)
    if as_json:
        click.echo(dumps(info, indent=2))
        return
    split_note = f", split {info['split']!r}" if info["split"] else ""
    click.echo(f"{info['path']} ({info['format']}{split_note}): {info['users']:,} users, "
               f"{info['examples']:,} examples, {info['tokens']:,} tokens")
    click.echo(f"  {'per user':10s} {'p50':>10s} {'p90':>10s} {'p99':>10s} {'max':>10s}")
    for key, label in (("examples_per_user", "examples"), ("tokens_per_user", "tokens")):
        q = info[key]
        click.echo(f"  {label:10s} " + " ".join(f"{q[k]:>10,d}" for k in ("p50", "p90", "p99", "max")))
