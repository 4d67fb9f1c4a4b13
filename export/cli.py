"""`dpfleet export CHECKPOINT --format pte|onnx [--quantize int8] --out DIR`."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.export.phone import PHONE_FORMATS, QUANTIZE
from dpfleet.jsonio import dumps


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(PHONE_FORMATS),
    required=True,
    help="pte: ExecuTorch with the XNNPACK delegate; onnx: ONNX for ONNX Runtime.",
)
@click.option(
    "--quantize",
    type=click.Choice(QUANTIZE),
    default=None,
    help="Dynamic int8 weights for the matmuls (smaller, faster; checked against eager).",
)
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, help="Output folder (must be new or empty)."
)
@click.option(
    "--seq-len",
    type=int,
    default=20,
    show_default=True,
    help="Token window the program takes (text is PAD-filled up to it).",
)
@click.option(
    "--heldout",
    type=click.Path(path_type=Path),
    default=None,
    help="Held-out text, one example per line, for the logit agreement check "
    "(default: random token windows).",
)
@click.option(
    "--threads", type=int, default=1, show_default=True, help="CPU threads for the latency measurement."
)
def export(
    checkpoint: Path,
    fmt: str,
    quantize: str | None,
    out: Path,
    seq_len: int,
    heldout: Path | None,
    threads: int,
) -> None:
    """Export a checkpoint folder (model.safetensors, model_config.json, tokenizer/) for phones.

    Writes the inference program, the tokenizer and manifest.json (architecture, vocabulary,
    version, sha256 of every file) to --out, then prints a JSON summary: file sizes, single-step
    latency, and the program's agreement with eager PyTorch (max |logit error|, top-1
    agreement).
    """
    from dpfleet.export.phone import PhoneExport

    summary = PhoneExport(checkpoint, fmt, out, quantize, seq_len, threads, heldout).run()
    click.echo(dumps(summary, indent=2))
