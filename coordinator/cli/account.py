"""`dpfleet account`: zCDP and (eps, delta) of a DP-FTRL run, planned or observed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from dpfleet.coordinator.accounting.ledger import (
    account_participation_log,
    account_worst_case,
    read_checked_privacy,
)
from dpfleet.coordinator.accounting.privacy_report import noise_mechanism
from dpfleet.coordinator.accounting.zcdp import (
    ADJACENCY,
    METHODS,
    MIN_SEPARATION_CONVENTION,
    observe_participation_log,
)
from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.coordinator.mechanisms.matrix import as_mechanism
from dpfleet.coordinator.mechanisms.registry import (
    build,
    entries,
    names,
    rebuild,
    ring_is_rounded,
)
from dpfleet.coordinator.mechanisms.spec import MechanismSpec
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.coordinator.mechanisms.tree_sensitivity import NODES
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import dumps


def _checked_ledger(path: Path, as_json: bool) -> str:
    """A run's privacy ledger, checked against the figures its privacy.json states, as text or
    JSON: each release's rho and eps, and their composition."""
    block = read_checked_privacy(path)["ledger"]
    if as_json:
        return dumps(block)
    at = f"delta {block['epsilon_at_delta']:g}, {block['conversion']}"
    lines = [f"privacy ledger of {path} (consistent with every figure it states)"]
    def figure(value: float | None) -> str:  # inf is null in strict JSON
        return "inf" if value is None else f"{value:.4g}"

    for entry in block["entries"]:
        for item, indent in [(entry, "  "), *((p, "    ") for p in entry.get("parts", ()))]:
            added = f"  (+ delta {item['delta']:g})" if item["delta"] else ""
            lines.append(f"{indent}{item['name']:<{24 - len(indent)}} zCDP {figure(item['zcdp'])}  "
                         f"epsilon {figure(item['epsilon'])}{added}")
    lines.append(f"  {'composed':<22} zCDP {figure(block['zcdp'])}  epsilon {figure(block['epsilon'])} "
                 f"at {at}; total delta {block['delta']:g}")
    return "\n".join(lines)


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


MECHANISM_FILE = "mechanism.json"  # a run directory's strategy, beside participation.jsonl
MECHANISM_HELP = "\n".join(f"  {e.name:<11} {line}" if i == 0 else f"  {'':<11} {line}"
                           for e in entries() for i, line in enumerate(e.description.splitlines()))


def with_mechanism_help(f):
    """Put the mechanisms' descriptions in place of {mechanisms} in a command's docstring."""
    f.__doc__ = f.__doc__.replace("{mechanisms}", MECHANISM_HELP.replace("\n", "\n    "))
    return f


def load_mechanism(path: str | Path) -> Mechanism:
    """The mechanism in a JSON file: a run's mechanism.json (any registered mechanism), or a
    banded / BLT spec on its own."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DpfleetError(f"cannot read mechanism spec {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise DpfleetError(f"{path}: not JSON ({exc.msg})") from None
    if isinstance(data, dict) and "sha256" in data:  # a run's binding (`mechanism_binding`)
        if data.get("custom"):
            raise DpfleetError(f"{path} is a custom mechanism's ({data.get('name')!r}): account it "
                               "from Python with the object itself")
        return rebuild(data["name"], data["identity"])
    return as_mechanism(MechanismSpec.from_json(data.get("spec", data) if isinstance(data, dict) else data))


def _mechanism(kind: str, given: Mechanism | None, source: str, rounds: int,
               mins: int | None, maxp: int, tree_nodes: str) -> tuple[Mechanism, str]:
    """The mechanism to account: the given one if it is of `kind`, else `kind` built for the
    participation (banded / BLT: optimised for it; the tree over `tree_nodes`)."""
    if given is not None and given.name == kind and kind != "tree":
        covered = given.spec.rounds if hasattr(given, "spec") else rounds
        if covered < rounds:
            raise DpfleetError(f"the {kind} strategy ({source}) covers {covered} rounds, "
                               f"fewer than the {rounds} accounted")
        return given, source  # over its own n rounds: an upper bound for any prefix
    if kind == "tree":
        return TreeMechanism(tree_nodes), ""
    mins = 0 if mins is None else mins
    built = build(kind, rounds, mins, max(maxp, 1))
    return built, (f"optimised for {rounds} rounds, MinS {mins}, MaxP {max(maxp, 1)}"
                   if hasattr(built, "spec") else "nothing to optimise")


def _participation(log: str | None, rounds: int | None, max_participation: int | None,
                   min_separation: int | None, restarts: str | None) -> tuple:
    """(rounds, MinS, MaxP) to account: the log's observed ones, or the ones given."""
    if log is not None:
        if max_participation is not None or min_separation is not None or restarts:
            raise DpfleetError("with --participation-log, MaxP, MinS and restarts come from "
                               "the log; drop --max-participation/--min-separation/--restarts")
        obs = observe_participation_log(log, rounds)
        return obs.rounds, obs.min_separation, obs.max_participation
    if rounds is None:
        raise DpfleetError("give --rounds (or --participation-log)")
    return rounds, min_separation, 1 if max_participation is None else max_participation


def _described(result: dict, built: Mechanism, kind: str, spec_source: str, noise: str,
               rounds: int) -> dict:
    """The result with the noise in words and, beside the tree, the strategy and its noise factor."""
    words = noise_mechanism(noise, False, kind) if noise == "discrete" else "continuous Gaussian"
    result.update(noise=noise, noise_mechanism=words)
    if kind != "tree":
        matrix = hasattr(built, "spec")
        result.update(mechanism_spec=built.identity(), spec_source=spec_source,
                      family="matrix-factorization DP-FTRL" if matrix else "noise",
                      strategy=_strategy(built.identity()) if matrix else built.describe(),
                      noise_factor=math.sqrt(built.prefix_error(rounds)
                                             / TreeMechanism().prefix_error(_covered(built, rounds))))
    return result


def _covered(mechanism: Mechanism, rounds: int) -> int:
    """The rounds a mechanism's noise is built for (a strategy's n), else those accounted."""
    return mechanism.spec.rounds if hasattr(mechanism, "spec") else rounds


def _strategy(spec: dict) -> str:
    if spec["kind"] == "banded":
        return f"{spec['bands']} bands, coefficients " + ", ".join(f"{c:.4g}" for c in spec["coefficients"])
    return (f"{len(spec['theta'])} buffers, theta " + ", ".join(f"{t:.8g}" for t in spec["theta"])
            + ", omega " + ", ".join(f"{w:.4g}" for w in spec["omega"]))


def _format_mf(result: dict) -> str:
    mins = result["min_separation"]
    lines = [
        f"noise: {result['noise_mechanism']}",
        f"{result['mechanism']} {result['family']} over {result['rounds']} rounds"
        + (f", {result['noise_segments']} noise segments" if result["noise_segments"] > 1 else ""),
        f"  strategy              {result['strategy']}",
        f"  strategy from         {result['spec_source']}",
        f"  MaxP                  {result['max_participation']}",
        f"  MinS                  {'none' if mins is None else mins} ({MIN_SEPARATION_CONVENTION})",
        f"  noise multiplier      {result['noise_multiplier']:g}",
        f"  adjacency             {result['adjacency']}",
        f"  sensitivity^2 (C^2)   {result['sensitivity_squared']:.6g}",
        f"  zCDP                  {result['zcdp']:.4f}",
        f"  epsilon               {result['epsilon']:.4f} at delta {result['delta']:g} "
        f"({result['method']})",
        f"  noise factor          {result['noise_factor']:.4f} (model noise std / the tree's at "
        "the same noise multiplier)",
    ]
    if "devices" in result:
        lines.insert(1, f"  observed in the log   {result['devices']} devices, "
                        f"{result['participations']} participations")
    return "\n".join(lines)


def _format_all(rows: list[dict]) -> str:
    tree = rows[0]
    mins = tree["min_separation"]
    lines = [f"noise: {tree['noise_mechanism']}; {tree['rounds']} rounds, MaxP "
             f"{tree['max_participation']}, MinS {'none' if mins is None else mins}, noise "
             f"multiplier {tree['noise_multiplier']:g}, delta {tree['delta']:g} ({tree['method']})",
             "noise factor: model noise std / the tree's at the same noise multiplier; at the same "
             "epsilon: / the tree's at equal zCDP", "",
             f"{'mechanism':<10} {'sens^2':>10} {'zCDP':>9} {'epsilon':>9} {'noise factor':>13} "
             f"{'at same eps':>12}"]
    for r in rows:
        lines.append(f"{r['mechanism']:<10} {r['sensitivity_squared']:>10.5g} {r['zcdp']:>9.4f} "
                     f"{r['epsilon']:>9.4f} {r['noise_factor']:>13.4f} "
                     f"{r['noise_at_equal_zcdp']:>12.4f}")
    return "\n".join(lines)


@click.command("account")
@with_mechanism_help
@click.option("--noise-multiplier", "-z", type=float, default=None,
              help="Noise std / clip norm of the tree (for adaptive clipping: the z of the "
                   "App. A transform, not z_delta). Required unless --privacy-json.")
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
                   "--noise gaussian and for banded / blt), rdp (paper 000; the default for the "
                   "tree with --noise discrete), "
                   "zcdp_bound (closed form).")
@click.option("--noise", type=click.Choice(["gaussian", "discrete"]), default="gaussian",
              show_default=True,
              help="The run's dp.noise as resolved in its config.toml: discrete = noise in the "
                   "SecAgg ring (the default with secagg). Tree: the discrete Gaussian, whose zCDP "
                   "the Gaussian PLD does not bound, so pld is refused for it; banded / blt: the MF "
                   "Gaussian rounded in the ring, the same eps as gaussian (PLD holds).")
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
@click.option("--mechanism", type=click.Choice([*names(), "all"]), default=None,
              help="The noise mechanism (see above; any registered one): tree (default), banded, "
                   "blt, independent, or all (tree, banded and BLT, one row each at the same noise "
                   "multiplier). With --participation-log: "
                   "default the run's, from mechanism.json beside the log.")
@click.option("--mechanism-spec", type=click.Path(dir_okay=False), default=None,
              help="A banded / BLT strategy as JSON (a run's mechanism.json or a spec) to "
                   "account instead of one optimised for the given participation.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (--mechanism all: one per line).")
@click.option("--privacy-json", type=click.Path(dir_okay=False), default=None,
              help="A run's privacy.json: check every figure it states against its ledger (the "
                   "run's releases as dp_accounting events) and print the ledger; a file whose "
                   "figures disagree is refused. The other options are not used.")
def account(noise_multiplier: float | None, rounds: int | None, max_participation: int | None,
            min_separation: int | None, restarts: str | None, delta: float, method: str | None,
            noise: str, adjacency: str, tree_nodes: str, participation_log: str | None,
            mechanism: str | None, mechanism_spec: str | None, as_json: bool,
            privacy_json: str | None) -> None:
    """Privacy of DP-FTRL: exact worst-case tree sensitivity -> rho-zCDP -> (eps, delta).

    rho = S / (2 z^2), where S is the largest squared sensitivity of the tree mechanism over
    every participation pattern with at most MaxP participations and at least MinS rounds
    between two of them (Kairouz et al. 2021, App. D; paper 002, Sec. 2.2). banded / blt: the
    strategy's min-separation sensitivity (b = MinS + 1, k = MaxP) in place of the tree's.

    \b
    Mechanisms:
    {mechanisms}

    \b
    Examples:
      dpfleet account -z 7 -T 3600 -P 3 -S 909          # paper 002, pt-BR: zCDP 0.45
      dpfleet account -z 8.83 -T 1600 --delta 1e-6 --method rdp   # paper 000: eps 1.77
      dpfleet account -z 7 --participation-log runs/x/participation.jsonl --json
      dpfleet account -z 1 --noise discrete --participation-log runs/secagg/participation.jsonl
      dpfleet account -z 8.881 -T 60 -P 15 -S 3 --delta 1e-6 --mechanism all
      dpfleet account --privacy-json runs/x/privacy.json
    """
    if privacy_json is not None:
        click.echo(_checked_ledger(Path(privacy_json), as_json))
        return
    if noise_multiplier is None:
        raise DpfleetError("give --noise-multiplier (-z), or --privacy-json to check a run's figures")
    given, source = None, ""
    if mechanism_spec is not None:
        given, source = load_mechanism(mechanism_spec), mechanism_spec
    elif participation_log is not None and (Path(participation_log).parent / MECHANISM_FILE).is_file():
        source = str(Path(participation_log).parent / MECHANISM_FILE)
        given = load_mechanism(source)
    if mechanism is None:
        mechanism = "tree" if given is None else given.name
    if given is not None and mechanism != "all" and given.name != mechanism:
        raise DpfleetError(f"{source} holds a {given.name} strategy, not {mechanism}: account it "
                           f"with --mechanism {given.name}")
    # banded / blt in the ring are the continuous MF Gaussian, rounded (`mf_ring`): PLD holds
    rounded = noise == "discrete" and ring_is_rounded(mechanism)
    if method is None:
        method = "rdp" if noise == "discrete" and not rounded else "pld"
    if noise == "discrete" and method == "pld" and not rounded:
        raise DpfleetError("--noise discrete: the Gaussian PLD is not a proven bound for the "
                           "discrete Gaussian; use --method rdp (or zcdp_bound)")
    if mechanism not in ("tree", "all") and (tree_nodes != "all" or restarts):
        raise DpfleetError("--tree-nodes and --restarts apply to the tree mechanism only")
    part = _participation(participation_log, rounds, max_participation, min_separation, restarts)
    rows = []
    for kind in ([mechanism] if mechanism != "all" else ("tree", "banded", "blt")):
        built, spec_source = _mechanism(kind, given, source, *part, tree_nodes)
        if participation_log is not None:
            result = account_participation_log(participation_log, noise_multiplier, delta, method,
                                               rounds=rounds, adjacency=adjacency, mechanism=built)
        else:
            result = account_worst_case(noise_multiplier, part[0], part[2], part[1],
                                        parse_rounds_list(restarts), delta, method,
                                        adjacency=adjacency, mechanism=built)
        rows.append(_described(result, built, kind, spec_source, noise, part[0]))
    if mechanism != "all":
        result = rows[0]
        text = _format(result) if mechanism == "tree" else _format_mf(result)
        click.echo(dumps(result) if as_json else text)
        return
    tree = rows[0]
    tree.update(noise_factor=1.0, noise_at_equal_zcdp=1.0)
    for row in rows[1:]:
        ratio = (row["sensitivity_squared"] / tree["sensitivity_squared"]
                 if tree["sensitivity_squared"] else 1.0)
        row["noise_at_equal_zcdp"] = math.sqrt(ratio) * row["noise_factor"]
    click.echo("\n".join(dumps(r) for r in rows) if as_json else _format_all(rows))
