"""`dpfleet audit CONFIG`: train the config with canary devices and estimate its epsilon empirically."""

from __future__ import annotations

import math
from pathlib import Path

import click

from dpfleet.coordinator.config_overrides import set_option


def _count(value: str, flag: str, minimum: int) -> int:
    """An integer flag, refused in one `error:` line (click's own message spans several)."""
    from dpfleet.errors import DpfleetError

    try:
        n = int(value)
    except ValueError:
        raise DpfleetError(f"{flag} must be an integer, got {value!r}") from None
    if n < minimum:
        raise DpfleetError(f"{flag} must be >= {minimum}, got {n}")
    return n


@click.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--canaries", default="256", show_default=True, metavar="N",
              help="Gradient canaries: 2N secret random directions, each inserted as a device with "
                   "probability 1/2 (the others are the unobserved null).")
@click.option("--text-canaries", default="4", show_default=True, metavar="T",
              help="Secret-sharer devices whose only data is a random secret (exposure in bits).")
@click.option("--seeds", default="1", show_default=True, metavar="S",
              help="Audit S runs (seeds CONFIG's seed, +1, ...): each reported, and pooled.")
@click.option("--confidence", default="0.95", show_default=True,
              help="Confidence of the lower bound and of the estimate's interval, in (0.5, 1).")
@click.option("--rounds", default=None, help="Override the config's number of rounds.")
@set_option
@click.option("--out", type=click.Path(path_type=Path), default=None, metavar="RUN_DIR",
              help="Run directory (default: runs/<config name>-audit, or -2, -3, ...).")
@click.option("--overwrite", is_flag=True, help="Reuse a non-empty run directory.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--debug-nonprivate", is_flag=True, hidden=True)  # the old spelling of --break noise-off
@click.option("--break", "broken", default=None, metavar="WHAT",
              help="BROKEN ON PURPOSE: 'noise-off' (no DP noise), 'clipping' (disabled) or "
                   "'noise-div-10' (noise scaled down 10x), the accountant unchanged, to see the "
                   "audit fail. The model is not private: the run states no eps and its "
                   "checkpoint does not export.")
def audit(config: Path, canaries: str, text_canaries: str, seeds: str, confidence: str,
          rounds: str | None, overrides: tuple[str, ...], out: Path | None, overwrite: bool,
          quiet: bool, debug_nonprivate: bool, broken: str | None) -> None:
    """Audit a run: train CONFIG with canary devices, estimate epsilon from the released model.

    The canaries are extra devices in the fleet, under the same participation policy and timers,
    clipping, noise and (with aggregation.kind = "secagg") secure aggregation as every device.
    Gradient canaries send a secret random direction; the cosine of the final model's change with
    each direction gives a one-shot epsilon estimate with an interval (Andrew et al., ICLR 2024)
    and a lower bound at --confidence (Steinke, Nasr, Jagielski, NeurIPS 2023). Text canaries
    train on a random secret; their exposure (Carlini et al., USENIX Security 2019) is its rank
    among random secrets of the same format, in bits.

    Writes the run directory as `dpfleet simulate` does, plus audit.json and an "Empirical audit"
    section in privacy_report.md. An estimate is not a proof; a lower bound under the accounted
    epsilon is consistent with it, not a certificate (docs/audit.md).
    """
    from dpfleet.coordinator.audit.canaries import BROKEN, AuditSettings, run_audit
    from dpfleet.coordinator.config_overrides import describe, parse_overrides
    from dpfleet.coordinator.run import cli_pretrain, fresh_run_dir
    from dpfleet.coordinator.run_privacy.config_plan import load_run_config
    from dpfleet.errors import DpfleetError

    if debug_nonprivate:  # for simulate it means telemetry: here it never silently means noise off
        raise DpfleetError("audit's --debug-nonprivate is now --break noise-off (it switches the DP "
                           "noise off)")
    n, t, s = (_count(canaries, "--canaries", 1), _count(text_canaries, "--text-canaries", 0),
               _count(seeds, "--seeds", 1))
    try:
        c = float(confidence)
    except ValueError:
        raise DpfleetError(f"--confidence must be a number in (0.5, 1), got {confidence!r}") from None
    if broken is not None and broken not in BROKEN:
        raise DpfleetError(f"--break must be one of {', '.join(map(repr, BROKEN))}, got {broken!r}")
    settings = AuditSettings(canaries=n, text_canaries=t, confidence=c, broken=broken)
    settings.check()
    sets = parse_overrides(overrides)
    # --rounds is an override too, after --set: the config is parsed and checked once, with it
    cfg, plan = load_run_config(config, sets if rounds is None else
                                {**sets, "rounds": _count(rounds, "--rounds", 1)})
    if sets:
        click.echo(f"overrides: {describe(sets)}")
    if cfg.dp.noise_multiplier == 0 and cfg.dp.target_epsilon == 0:  # a planned run's z comes later
        raise DpfleetError("dp.noise_multiplier = 0 accounts eps = inf: there is nothing to audit "
                           "(--break noise-off switches the noise off under a finite accounted eps)")
    out = out or fresh_run_dir(Path("runs") / f"{config.stem}-audit")
    a = run_audit(cfg, out, settings, seeds=s, overwrite=overwrite, progress=not quiet, log=click.echo,
                  pretrain=cli_pretrain(), plan=plan)
    fmt = lambda x: "inf" if not math.isfinite(x) else f"{x:.3f}"  # noqa: E731
    lo, hi = a["epsilon_estimate_interval"]
    if a["broken"]:
        click.echo(f"WARNING               {a['broken']['warning']}: {a['broken']['what']}")
    click.echo(f"accounted             eps = {fmt(a['epsilon_accounted'])} at delta = {a['delta']:g}")
    click.echo(f"one-shot estimate     eps = {fmt(a['epsilon_estimate'])}   "
               f"{a['estimate_confidence']:g} interval [{fmt(lo)}, {fmt(hi)}]")
    click.echo(f"one-run lower bound   eps >= {fmt(a['epsilon_lower_bound'])} at confidence "
               f"{a['lower_bound_confidence']:g}")
    e = a["exposure"]
    if e["canaries"]:
        click.echo(f"exposure              median {e['median_bits']:.2f} bits, max {e['max_bits']:.2f} "
                   f"bits over {e['canaries']} text canaries (never inserted: median "
                   f"{e['null_median_bits']:.2f})")
    click.echo(f"verdict               {a['verdict']}")
    click.echo(f"audit                 {out / 'audit.json'}")
