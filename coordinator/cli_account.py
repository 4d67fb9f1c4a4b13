"""`dpfleet account`: zCDP and (eps, delta) of a DP-FTRL run, planned or observed."""

from __future__ import annotations

import click

from dpfleet.coordinator.accounting import (
    ADJACENCY,
    METHODS,
    MIN_SEPARATION_CONVENTION,
    account_participation_log,
    account_worst_case,
)
from dpfleet.coordinator.tree_sensitivity import NODES
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import dumps


def parse_rounds_list(text: str | None) -> list[int]:
    """'128,1152' -> [128, 1152]; empty or None -> []."""
    if not text:
        return []
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise DpfleetError(f"expected comma-separated round numbers, got {text!r}") from None


def _format(result: dict) -> str:
    mins = result["min_separation"]
    lines = [
        f"noise: {result['noise_mechanism']}",
        f"DP-FTRL tree aggregation over {result['rounds']} rounds"
        + (f", tree restarts at {result['restarts']}" if result["restarts"] else ", no restart"),
        f"  MaxP                  {result['max_participation']}",
        f"  MinS                  {'none' if mins is None else mins} ({MIN_SEPARATION_CONVENTION})",
        f"  noise multiplier      {result['noise_multiplier']:g}",
        f"  adjacency, nodes      {result['adjacency']}, {result['nodes']}",
        f"  sensitivity^2 (C^2)   {result['sensitivity_squared']}",
        f"  zCDP                  {result['zcdp']:.4f}",
        f"  epsilon               {result['epsilon']:.4f} at delta {result['delta']:g} "
        f"({result['method']})",
    ]
    if "devices" in result:
        lines.insert(1, f"  observed in the log   {result['devices']} devices, "
                        f"{result['participations']} participations")
        dev = result["worst_device"]
        if dev:
            lines.append(f"  worst actual device   {dev['device']}: {dev['participations']} "
                         f"participations, sensitivity^2 {dev['sensitivity_squared']}, "
                         f"zCDP {dev['zcdp']:.4f}, epsilon {dev['epsilon']:.4f}")
    return "\n".join(lines)


@click.command("account")
@click.option("--noise-multiplier", "-z", type=float, required=True,
              help="Noise std / clip norm of the tree (for adaptive clipping: the z of the "
                   "App. A transform, not z_delta).")
@click.option("--rounds", "-T", type=int, default=None,
              help="Total rounds (leaves of the tree). With --participation-log: optional, "
                   "accounts the model after the log's first T rounds.")
@click.option("--max-participation", "-P", type=int, default=None,
              help="MaxP: most rounds one device takes part in (default 1).")
@click.option("--min-separation", "-S", type=int, default=None,
              help="MinS: fewest rounds strictly BETWEEN two participations of one device "
                   "(0 allows consecutive rounds; default: no constraint).")
@click.option("--restarts", default=None, metavar="R1,R2,...",
              help="Rounds at which a fresh tree starts (e.g. adaptive clipping's 128,1152).")
@click.option("--delta", type=float, default=1e-10, show_default=True,
              help="Target delta of the (eps, delta) statement.")
@click.option("--method", type=click.Choice(METHODS), default=None,
              help="zCDP -> eps conversion: pld (tightest; paper 002; the default for "
                   "--noise gaussian), rdp (paper 000; the default for --noise discrete), "
                   "zcdp_bound (closed form).")
@click.option("--noise", type=click.Choice(["gaussian", "discrete"]), default="gaussian",
              show_default=True,
              help="The run's dp.noise as resolved in its config.toml: discrete = the discrete "
                   "Gaussian in the SecAgg ring (the default with secagg), whose zCDP the "
                   "Gaussian PLD does not bound, so pld is refused for it.")
@click.option("--adjacency", type=click.Choice(list(ADJACENCY)), default="zero-out",
              show_default=True,
              help="zero-out (add/remove a device's updates; paper 002) or replace-one "
                   "(4x the squared sensitivity).")
@click.option("--tree-nodes", type=click.Choice(NODES), default="all", show_default=True,
              help="all: every dyadic block (the published analysis; also right for the "
                   "efficient tree estimator). prefix: only blocks a streaming prefix sum uses "
                   "(exact and tighter for dpfleet's plain online tree).")
@click.option("--participation-log", type=click.Path(dir_okay=False), default=None,
              help="Account a run from its participation.jsonl: observed MaxP / MinS, "
                   "restarts and the worst actual device.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def account(noise_multiplier: float, rounds: int | None, max_participation: int | None,
            min_separation: int | None, restarts: str | None, delta: float, method: str | None,
            noise: str, adjacency: str, tree_nodes: str, participation_log: str | None,
            as_json: bool) -> None:
    """Privacy of DP-FTRL: exact worst-case tree sensitivity -> rho-zCDP -> (eps, delta).

    rho = S / (2 z^2), where S is the largest squared sensitivity of the tree mechanism over
    every participation pattern with at most MaxP participations and at least MinS rounds
    between two of them (Kairouz et al. 2021, App. D; paper 002, Sec. 2.2).

    \b
    Examples:
      dpfleet account -z 7 -T 3600 -P 3 -S 909          # paper 002, pt-BR: zCDP 0.45
      dpfleet account -z 8.83 -T 1600 --delta 1e-6 --method rdp   # paper 000: eps 1.77
      dpfleet account -z 7 --participation-log runs/x/participation.jsonl --json
      dpfleet account -z 1 --noise discrete --participation-log runs/secagg/participation.jsonl
    """
    if method is None:
        method = "rdp" if noise == "discrete" else "pld"
    if noise == "discrete" and method == "pld":
        raise DpfleetError("--noise discrete: the Gaussian PLD is not a proven bound for the "
                           "discrete Gaussian; use --method rdp (or zcdp_bound)")
    if participation_log is not None:
        if max_participation is not None or min_separation is not None or restarts:
            raise DpfleetError("with --participation-log, MaxP, MinS and restarts come from "
                               "the log; drop --max-participation/--min-separation/--restarts")
        result = account_participation_log(participation_log, noise_multiplier, delta, method,
                                           rounds=rounds, adjacency=adjacency,
                                           nodes=tree_nodes)
    else:
        if rounds is None:
            raise DpfleetError("give --rounds (or --participation-log)")
        result = account_worst_case(noise_multiplier, rounds,
                                    1 if max_participation is None else max_participation,
                                    min_separation, parse_rounds_list(restarts), delta, method,
                                    adjacency=adjacency, nodes=tree_nodes)
    result["noise"] = noise
    result["noise_mechanism"] = ("discrete Gaussian in the SecAgg ring" if noise == "discrete"
                                 else "continuous Gaussian")
    click.echo(dumps(result) if as_json else _format(result))
