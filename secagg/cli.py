"""`dpfleet secagg ...`: secure aggregation tools."""

from __future__ import annotations

import click

from dpfleet.errors import DpfleetError
from dpfleet.jsonio import dumps
from dpfleet.secagg.bench import bench_round
from dpfleet.secagg.errors import SecAggError
from dpfleet.secagg.inprocess import PHASES


@click.group(name="secagg", short_help="Secure aggregation (SecAgg, SecAgg+): the server learns "
                                      "only the sum of a round's updates.")
def secagg() -> None:
    """Secure aggregation (Bonawitz et al. SecAgg, Bell et al. SecAgg+): the server learns
    only the sum of a round's updates, never one device's."""


@secagg.command()
@click.option("--clients", "-n", type=int, required=True, help="Clients in the round.")
@click.option("--dim", "-d", type=float, required=True,
              help="Vector length (accepts 1e6-style values).")
@click.option("--dropout", type=float, default=0.0, show_default=True,
              help="Fraction of clients that vanish after sharing keys; k and t are planned "
                   "for it.")
@click.option("--graph", type=click.Choice(["complete", "harary"]), default="harary",
              show_default=True,
              help="complete: everyone masks with everyone (SecAgg); harary: sparse k-regular "
                   "graph (SecAgg+).")
@click.option("--bits", type=int, default=32, show_default=True, help="Ring Z_(2^bits), 1..32.")
@click.option("--signed", is_flag=True,
              help="Malicious-server mode: identity signatures, pinned keys, the consistency "
                   "round (the mode for anything that leaves one process; see "
                   "secagg/THREAT_MODEL.md).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for inputs/graph.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(clients: int, dim: float, dropout: float, graph: str, bits: int, signed: bool,
          seed: int, as_json: bool) -> None:
    """Run one whole round in-process on random vectors: per-phase client and server time,
    bytes per client, and whether the unmasked sum equals the plain sum (sum_exact)."""
    if clients < 2:
        raise DpfleetError(f"--clients must be at least 2, got {clients}")
    if dim < 1 or dim != int(dim):
        raise DpfleetError(f"--dim must be a positive whole number, got {dim}")
    if not 0 <= dropout < 1:
        raise DpfleetError(f"--dropout must be in [0, 1), got {dropout}")
    if not 1 <= bits <= 32:
        raise DpfleetError(f"--bits must be in 1..32, got {bits}")
    try:
        result = bench_round(clients, int(dim), dropout, graph, bits, signed, seed=seed,
                             progress=not as_json)
    except SecAggError as exc:
        raise DpfleetError(f"round aborted: {exc}") from exc
    if as_json:
        click.echo(dumps(result, indent=2))
        return
    click.echo(f"{result['graph']} graph  n={clients}  d={int(dim)}  dropout={dropout}  "
               f"k={result['k']}  t={result['threshold']}  bits={bits}"
               f"{'  signed' if signed else ''}")
    click.echo(f"{'phase':<12}{'client mean s':>15}{'client max s':>15}{'server s':>12}"
               f"{'sent B/client':>15}{'recv B/client':>15}")
    for phase in PHASES:
        click.echo(f"{phase:<12}{result['client_seconds_mean'][phase]:>15.4f}"
                   f"{result['client_seconds_max'][phase]:>15.4f}"
                   f"{result['server_seconds'][phase]:>12.4f}"
                   f"{result['bytes_sent_per_client_by_phase'][phase]:>15.0f}"
                   f"{result['bytes_received_per_client_by_phase'][phase]:>15.0f}")
    sent, received = result["bytes_sent_per_client"], result["bytes_received_per_client"]
    click.echo(f"bytes per client: sent {sent['mean']:.0f} (max {sent['max']}), "
               f"received {received['mean']:.0f} (max {received['max']})")
    click.echo(f"survivors {result['survivors']}/{clients}  "
               f"round (parallel clients) {result['round_seconds']:.3f} s  "
               f"in-process wall {result['wall_seconds']:.3f} s")
    click.echo(f"sum_exact: {str(result['sum_exact']).lower()}")
