"""`dpfleet export CHECKPOINT --format pte|onnx [--quantize int8] --out DIR` (an inference program)
or `dpfleet export CHECKPOINT --bundle DIR [--runtime onnx --runtime executorch]` (a signed phone
bundle for on-device training and suggestions)."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.errors import DpfleetError
from dpfleet.export.phone import FORMAT_NAMES, MIN_TOP1, PHONE_FORMATS, QUANTIZE, TARGETS
from dpfleet.io import check_writable
from dpfleet.jsonio import dumps


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice([*PHONE_FORMATS, *FORMAT_NAMES]),
    default=None,
    help="pte (or executorch): ExecuTorch with the XNNPACK delegate; onnx: ONNX for ONNX Runtime "
    "(with --out).",
)
@click.option(
    "--quantize",
    type=click.Choice(QUANTIZE),
    default=None,
    help="Dynamic int8 weights for the matmuls (smaller, faster; checked against eager).",
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Output folder (must be new or empty)."
)
@click.option(
    "--bundle",
    type=click.Path(path_type=Path),
    default=None,
    help="Write a signed phone bundle here instead (new or empty folder): training program(s), "
    "inference program, weights, tokenizer and a manifest a client can follow without dpfleet.",
)
@click.option(
    "--runtime",
    "runtimes",
    type=click.Choice(("onnx", "executorch")),
    multiple=True,
    help="Training programs in the bundle (repeatable; default onnx; executorch exports take minutes).",
)
@click.option(
    "--signing-key",
    type=click.Path(path_type=Path),
    default=None,
    help="Ed25519 private key (PEM) that signs the bundle's manifest. Default: "
    "<bundle>.signing_key.pem next to the bundle, generated (mode 0600) on first use.",
)
@click.option(
    "--batch-size",
    type=int,
    default=None,
    help="Bundle: minibatch size (default: the run's client.batch_size).",
)
@click.option(
    "--seq-len",
    type=int,
    default=None,
    help="Token window the program takes (text is PAD-filled up to it). Default 20, or for a bundle "
    "the run's data.seq_len.",
)
@click.option(
    "--heldout",
    type=click.Path(path_type=Path),
    default=None,
    help="Held-out text, one example per line, for the logit agreement check "
    "(default: random token windows).",
)
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="x86",
    show_default=True,
    help="CPU the int8 ONNX program is tuned for: x86 uses 7-bit weights (reduce_range; AVX2 "
    "saturates otherwise), arm the full 8 bits.",
)
@click.option(
    "--min-top1",
    type=float,
    default=MIN_TOP1,
    show_default=True,
    help="int8: refuse the export when its top-1 agreement with eager on --heldout is below this.",
)
@click.option(
    "--accept-int8-drop",
    is_flag=True,
    help="int8: write the program even below --min-top1 (the manifest records it).",
)
@click.option(
    "--threads", type=int, default=1, show_default=True, help="CPU threads for the latency measurement."
)
@click.option(
    "--serial",
    type=click.IntRange(0),
    help="Bundle serial signed into the manifest (devices refuse a bundle below the highest they "
    "accepted from the key). Default: one above the last this key signed (<key>.serial), and never "
    "below the unix time; a given serial must be above that last one.",
)
@click.option(
    "--accept-caveats",
    is_flag=True,
    help="Bundle: export a run that is not fully private (a non-private vocabulary, research noise "
    "seed, debug telemetry, a declared plugin or custom mechanism...); the manifest records its "
    "caveats. Without it such a bundle is refused, naming them.",
)
@click.option(
    "--policy",
    type=click.Path(path_type=Path),
    default=None,
    help="Bundle: a release policy (TOML: max_epsilon at delta, max_rho, beat_public_model, "
    "beat_unigram, allow_caveats) the run must meet; a run that misses a rule is refused, naming "
    "the rule and the value, before anything is written. The manifest records the policy.",
)
def export(
    checkpoint: Path,
    fmt: str | None,
    quantize: str | None,
    out: Path | None,
    bundle: Path | None,
    runtimes: tuple[str, ...],
    signing_key: Path | None,
    batch_size: int | None,
    seq_len: int | None,
    heldout: Path | None,
    target: str,
    min_top1: float,
    accept_int8_drop: bool,
    threads: int,
    serial: int | None,
    accept_caveats: bool,
    policy: Path | None,
) -> None:
    """Export a checkpoint folder (model.safetensors, model_config.json, tokenizer/) for phones.

    With --format and --out: writes the inference program, the tokenizer and manifest.json
    (architecture, vocabulary, version, sha256 of every file), then prints a JSON summary: file
    sizes, single-step latency, and the program's agreement with eager PyTorch (max |logit
    error|, top-1 and top-3 agreement). int8 needs --heldout text and is refused below
    --min-top1 unless --accept-int8-drop.

    With --bundle: writes a signed phone bundle (see dpfleet.edge.device_client for the reference
    client) and prints its files, sizes and the public key to pin in the app. A run that is not
    fully private (its caveats) is refused unless --accept-caveats; the manifest records them.
    With --policy FILE the run must meet the release policy first (one error line naming each
    rule it misses and the run's value); the manifest records the policy and the values passed.

    The exporters' own output (torch.export, ONNX, ExecuTorch warnings and logs) goes to
    OUT.export.log (or BUNDLE.export.log) beside the output folder, named in one line;
    DPFLEET_EXPORT_DEBUG=1 lets it through to the terminal. A model an exporter refuses is one
    error line with its reason. A checkpoint of a custom module (dpfleet.simulate(model=...))
    has no config to rebuild it from: the error says how to export it from Python.
    """
    from dpfleet.export.checkpoint import check_private

    check_private(checkpoint)  # a deliberately broken audit run's weights never ship
    if bundle is not None:
        if fmt or out or quantize:
            raise DpfleetError("--bundle takes no --format/--out/--quantize")
        from dpfleet.export.bundle import BundleExport
        from dpfleet.export.policy import ReleasePolicy

        release = None if policy is None else ReleasePolicy.load(policy)  # a bad file: one line
        check_writable(bundle)  # before the checkpoint loads: an unwritable folder is one line
        summary = BundleExport(checkpoint, bundle, runtimes or ("onnx",), signing_key, seq_len,
                               batch_size, threads, heldout=heldout, serial=serial,
                               accept_caveats=accept_caveats, policy=release).run()
        _report(summary)
        return
    if fmt is None or out is None:
        raise DpfleetError("pass --format and --out (an inference program) or --bundle DIR")
    if runtimes or signing_key or batch_size or serial is not None or accept_caveats or policy:
        raise DpfleetError("--runtime, --signing-key, --batch-size, --serial, --accept-caveats and "
                           "--policy apply to --bundle only")
    from dpfleet.export.phone import PhoneExport

    check_writable(out)
    summary = PhoneExport(checkpoint, fmt, out, quantize, seq_len or 20, threads, heldout, target, min_top1,
                          accept_int8_drop).run()
    _report(summary)


def _report(summary: dict) -> None:
    """The JSON summary on stdout; where the exporters' own output went, one line on stderr."""
    click.echo(dumps(summary, indent=2))
    if summary.get("log"):
        click.echo(f"exporter output (warnings, logs): {summary['log']}", err=True)
