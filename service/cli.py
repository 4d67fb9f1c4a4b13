"""`dpfleet service ...`: the coordinator as a long-running HTTP service.

The command group is `service`, not `coordinator`: `dpfleet.coordinator` is the package of the
privacy core and the round engine, which `simulate` runs in-process too. `dpfleet coordinator`,
the group's earlier name, stays as a hidden alias that says so on stderr.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from dpfleet.coordinator.config_overrides import set_option
from dpfleet.service.cli_admin import add_admin_commands


@click.group(name="service")
def service() -> None:
    """The coordinator as an HTTP service: devices register, check in, train and report over
    HTTP (edge/wire/PROTOCOL.md)."""


add_admin_commands(service)  # status | pause | resume | stop | report (cli_admin.py)


@service.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--state", type=click.Path(path_type=Path), required=True,
              help="State directory (SQLite + files); an existing one is continued.")
@click.option("--listen", default="127.0.0.1:0", show_default=True,
              help="HOST:PORT to listen on; port 0 picks a free one (printed, and written to "
                   "STATE/admin.json). Non-loopback addresses need TLS.")
@click.option("--rounds", type=int, default=None,
              help="Override the config's rounds (give the same value when continuing).")
@set_option
@click.option("--fleet-public", type=click.Path(path_type=Path), default=None,
              help="Fleet registry JSON of device public keys: only these keys may register.")
@click.option("--tls-cert", type=click.Path(path_type=Path), default=None, help="PEM certificate.")
@click.option("--tls-key", type=click.Path(path_type=Path), default=None, help="PEM private key.")
@click.option("--policy", type=click.Path(path_type=Path), default=None,
              help="Release policy (TOML, as export --bundle --policy): at the end the model is "
                   "published as a signed bundle in STATE/release only if the run meets it.")
def serve(config: Path, state: Path, listen: str, rounds: int | None, overrides: tuple[str, ...],
          fleet_public: Path | None, tls_cert: Path | None, tls_key: Path | None,
          policy: Path | None) -> None:
    """Run the coordinator of CONFIG until its rounds are done (or `service stop`, Ctrl-C).

    Ctrl-C fails the open round cleanly, commits nothing half-done and exits 130; the same command
    continues the run from its last committed round.

    Refused: dp.noise_seed (research mode), and a non-loopback --listen without --fleet-public
    (anyone could claim a device id). The state directory is 0700, its files 0600.

    dp.target_epsilon is planned at the first start for the config's training clients, as
    `simulate` plans it (`plan:` line, STATE/plan.json); a restart keeps that plan and refuses a
    config whose target, delta, rounds or mechanism differ.

    Devices register their Ed25519 identity key, check in, download the plan and model by
    hash, and report (plain) or run signed SecAgg; each round commits durably before its model
    is served. The run directory files of `simulate` (metrics, participation, privacy report,
    checkpoint, plot) end up in STATE, next to service.log. The console gets one line per
    committed round (round k/N, devices, eps so far, accuracy when evaluated) and, at the end,
    the result block `simulate` ends with: warnings, accuracy against the unigram baseline, eps.
    The port is bound before STATE is touched: a busy port leaves STATE as it was.
    With --policy FILE the finished model is published (STATE/release, signed with STATE's bundle
    key, the manifest recording the policy) only if the run meets the release policy; a refusal
    publishes nothing and is one line on the console, the status page and in service.log.
    """
    from dpfleet import eventloop
    from dpfleet.coordinator.cli.result_block import result_lines
    from dpfleet.coordinator.config_overrides import describe, parse_overrides
    from dpfleet.coordinator.run_privacy.config_plan import load_run_config
    from dpfleet.coordinator.serve_plan import check_secret_noise
    from dpfleet.errors import DpfleetError, Interrupted
    from dpfleet.export.policy import ReleasePolicy
    from dpfleet.secagg.registry import load_public_registry
    from dpfleet.service.server import serve as run

    sets = parse_overrides(overrides)
    if rounds is not None and rounds < 1:
        raise DpfleetError("--rounds must be >= 1")
    # --rounds is an override too, after --set: the config is parsed and checked once, with it
    cfg, plan = load_run_config(config, sets if rounds is None else {**sets, "rounds": rounds})
    if sets:
        click.echo(f"overrides: {describe(sets)}", err=True)
    check_secret_noise(cfg)
    registry = load_public_registry(fleet_public) if fleet_public else None
    release = ReleasePolicy.load(policy) if policy else None  # a bad file: one line, STATE untouched
    warning = noise_warning(cfg)
    if warning:
        click.echo(warning, err=True)
    status = eventloop.run(run(cfg, state, listen=listen, registry=registry, tls_cert=tls_cert,
                             tls_key=tls_key, log=lambda s: click.echo(s, err=True), policy=release,
                             plan=plan))
    click.echo(f"{status['run_state']}: {status['rounds_committed']} of {status['rounds_planned']} "
               f"rounds committed, {status['rounds_failed']} failed; state in {state}")
    if "outcome" in status:  # finished: the block `simulate` ends with (its warnings included)
        for line in result_lines(**status["outcome"]):
            click.echo(line)
    else:
        click.echo(f"noise: {noise_line(planned_config(cfg, plan, state))}")
        if warning:
            click.echo(warning)
    if status.get("stopped_by") == "SIGINT" and status["run_state"] != "finished":
        again = "".join(f" --set {shlex.quote(s)}" for s in overrides)
        click.echo(f"interrupted; continue with: dpfleet service serve {config} --state {state}"
                   f"{again}", err=True)
        raise Interrupted()  # exit 130, as every command on Ctrl-C


def planned_config(cfg, plan, state: Path):
    """The config the service ran: with dp.target_epsilon, the one its kept plan.json makes."""
    from dpfleet.coordinator.serve_plan import check_kept_plan, follow_plan

    record = check_kept_plan(cfg, state) if cfg.dp.target_epsilon > 0 else None
    return cfg if record is None else follow_plan(cfg, record, plan)[0]


def noise_line(cfg) -> str:
    """Which noise the run adds, in the privacy report's words."""
    from dpfleet.coordinator.accounting.privacy_report import noise_mechanism
    from dpfleet.coordinator.config import resolve_noise

    return noise_mechanism(resolve_noise(cfg), cfg.aggregation.kind == "secagg", cfg.dp.mechanism)


def noise_warning(cfg) -> str | None:
    """"WARNING: ..." when continuous noise after SecAgg makes the guarantee need honest peers."""
    from dpfleet.coordinator.accounting.privacy_report import HONEST_ONLY
    from dpfleet.coordinator.config import honest_participants_only

    return f"WARNING: {HONEST_ONLY}" if honest_participants_only(cfg) else None


@click.group(name="coordinator", hidden=True, commands=service.commands)
def coordinator() -> None:
    """The earlier name of `dpfleet service`, kept so that scripts and deployments keep working."""
    click.echo("warning: `dpfleet coordinator` is deprecated; use `dpfleet service`", err=True)
