"""`dpfleet plan`: report goal, noise multiplier and client timer for a privacy target."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from dpfleet.coordinator.accounting.planner import (
    MechanismRow,
    Plan,
    candidates,
    make_plan,
    mechanism_rows,
    pick_mechanism,
    plot_plan,
)
from dpfleet.coordinator.accounting.zcdp import METHODS, zcdp_for_epsilon
from dpfleet.coordinator.cli.account import with_mechanism_help
from dpfleet.coordinator.config import check_delta, round_minutes_error
from dpfleet.coordinator.mechanisms.registry import names
from dpfleet.coordinator.state.run_dir import check_not_a_run
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write, check_writable, private_mkdir, removed_on_failure
from dpfleet.jsonio import dumps


def format_plan(plan: Plan) -> str:
    """The plan as a text table, the chosen report goal marked with '*'."""
    head = (f"{'':1}{'report goal':>12} {'MinS':>7} {'MaxP':>6} {'sens^2':>9} "
            f"{'noise z':>10} {'z / M':>10}")
    lines = [f"population {plan.population:,}, {plan.rounds} rounds, target zCDP "
             f"{plan.target_zcdp:.4g}" + ("" if plan.delta is None else
                                          f" (eps {plan.epsilon:.4g} at delta {plan.delta:g}, "
                                          f"{plan.method})"),
             "MinS = largest a timer allows (population // report goal - 1 rounds between); "
             "MaxP = ceil(rounds / (MinS + 1))", "", head]
    for r in plan.rows:
        mark = "*" if r == plan.chosen else " "
        lines.append(f"{mark}{r.report_goal:>12,} {r.min_separation:>7} {r.max_participation:>6} "
                     f"{r.sensitivity_squared:>9} {r.noise_multiplier:>10.4g} "
                     f"{r.noise_per_report:>10.4g}")
    c, t = plan.chosen, plan.timer
    timer = f"{t.rounds} rounds"
    if t.hours is not None:
        timer += f" = {t.hours:.3g} h at the given round duration ({t.diurnal_hours:g} h in " \
                 "whole days, as paper 002 grows it for diurnal participation)"
    lines += ["", f"plan: report goal {c.report_goal:,}, noise multiplier {c.noise_multiplier:.4g}"
              f", MinS {c.min_separation}, MaxP {c.max_participation}",
              f"timer: keep a device ineligible for {timer} after it takes part"]
    return "\n".join(lines)


def format_mechanisms(plan: Plan, rows: list[MechanismRow], chosen: MechanismRow, how: str) -> str:
    """The mechanisms at the plan's report goal, the chosen one marked with '*'."""
    c = plan.chosen
    lines = ["", f"mechanisms at report goal {c.report_goal:,} (MinS {c.min_separation}, MaxP "
             f"{c.max_participation}), each optimised for it",
             "model noise: the worst round's noise std on the model's prefix sum (clip-norm units; "
             "= z x noise factor x the tree's at z = 1)",
             f"{'':1}{'mechanism':<10} {'sens^2':>9} {'noise z':>10} {'noise factor':>13} "
             f"{'model noise':>12} {'/ M':>10}"]
    for r in rows:
        lines.append(f"{'*' if r is chosen else ' '}{r.mechanism:<10} {r.sensitivity_squared:>9.5g} "
                     f"{r.noise_multiplier:>10.4g} {r.noise_factor:>13.4f} {r.model_noise:>12.4g} "
                     f"{r.model_noise_per_report:>10.4g}")
    lines.append(f"mechanism: {chosen.mechanism} ({how}), noise multiplier "
                 f"{chosen.noise_multiplier:.4g}")
    return "\n".join(lines)


@click.command("plan")
@with_mechanism_help
@click.option("--population", "-N", type=int, required=True,
              help="Estimated number of devices that can take part.")
@click.option("--rounds", "-T", type=int, required=True, help="Planned training rounds.")
@click.option("--target-zcdp", type=float, default=None, help="Privacy target as rho-zCDP.")
@click.option("--target-epsilon", type=float, default=None,
              help="Privacy target as eps at --delta (converted with --method).")
@click.option("--delta", type=float, default=None, help="delta of the (eps, delta) statement.")
@click.option("--method", type=click.Choice(METHODS), default="pld", show_default=True,
              help="zCDP <-> eps conversion.")
@click.option("--report-goal", "-M", type=int, default=None,
              help="Devices per round you can afford; default: the smallest within 10% of "
                   "the best noise-per-device (z / M) on the grid.")
@click.option("--round-minutes", type=float, default=None,
              help="Wall-clock minutes per round, to express the timer in hours.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Directory for plan.json and plan.png (zCDP vs report goal and MinS, "
                   "like paper 002 Fig. 4).")
@click.option("--mechanism", type=click.Choice([*names(), "auto"]), default="auto",
              show_default=True,
              help="Noise mechanism (see above); auto: the least model noise at the target.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(population: int, rounds: int, target_zcdp: float | None,
         target_epsilon: float | None, delta: float | None, method: str,
         report_goal: int | None, round_minutes: float | None, out: str | None,
         mechanism: str, as_json: bool) -> None:
    """Plan DP-FTRL's report goal, noise multiplier and client timer (paper 002, Sec. 2.5).

    For each report goal M, the largest MinS the population allows is N // M - 1 rounds
    between participations, MaxP its worst case ceil(T / (MinS + 1)); the exact tree
    sensitivity then gives the noise multiplier that meets the target. Keeping z / M fixed
    keeps utility about the same (paper 002's hypothesis), so smaller z / M is better. At the
    chosen report goal each mechanism is optimised for (T, MinS, MaxP) and given its z.

    \b
    Mechanisms:
    {mechanisms}

    \b
    Examples:
      dpfleet plan -N 4210000 -T 1900 --target-zcdp 0.35 -M 6500 --round-minutes 20 --out plan/
      dpfleet plan -N 1277 -T 60 --target-epsilon 8 --delta 1e-6 --json
    """
    if (target_zcdp is None) == (target_epsilon is None):
        raise DpfleetError("give exactly one of --target-zcdp and --target-epsilon")
    if out is not None:
        check_writable(Path(out))  # before the search: an unwritable --out is one line, at once
        check_not_a_run(Path(out), "--out")  # a planned run's plan.json is the plan it ran
    if round_minutes is not None and (problem := round_minutes_error(round_minutes, "--round-minutes")):
        raise DpfleetError(problem)
    if delta is not None and population >= 1:
        check_delta(delta, population, "--delta")
    if target_epsilon is not None:
        if delta is None:
            raise DpfleetError("--target-epsilon needs --delta")
        target_zcdp = zcdp_for_epsilon(target_epsilon, delta, method)
    result = make_plan(population, rounds, target_zcdp, report_goal=report_goal, delta=delta,
                       method=method, round_minutes=round_minutes)
    rows = mechanism_rows(result.chosen, rounds, result.target_zcdp, candidates(mechanism))
    picked = (pick_mechanism(rows) if mechanism == "auto"
              else next(r for r in rows if r.mechanism == mechanism))
    record = {**result.to_dict(), "mechanisms": [asdict(r) for r in rows],
              "mechanism": picked.mechanism, "mechanism_choice": mechanism,
              "mechanism_noise_multiplier": picked.noise_multiplier}
    how = "least model noise at the target" if mechanism == "auto" else "as asked"
    click.echo(dumps(record) if as_json else format_plan(result) + "\n"
               + format_mechanisms(result, rows, picked, how))
    if out is not None:
        out_dir = Path(out)
        with removed_on_failure(out_dir):  # a full disk leaves no empty or half-written folder
            private_mkdir(out_dir)
            atomic_write(out_dir / "plan.json", dumps(record, indent=1) + "\n")
            figure = plot_plan(result, out_dir / "plan.png")
        click.echo(f"wrote {out_dir / 'plan.json'} and {figure}")
