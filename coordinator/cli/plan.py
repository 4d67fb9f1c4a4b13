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
    quick_candidates,
)
from dpfleet.coordinator.accounting.zcdp import METHODS, zcdp_for_epsilon
from dpfleet.coordinator.cli.account import with_mechanism_help
from dpfleet.coordinator.config import check_delta, parse_config, read_toml, round_minutes_error
from dpfleet.coordinator.engine.launch_plan import TracePlan, plan_over_trace, plot_trace_plan
from dpfleet.coordinator.mechanisms.registry import names
from dpfleet.coordinator.mechanisms.tree_bound import EXACT_MAX_PARTICIPATION
from dpfleet.coordinator.state.run_dir import check_not_a_run, to_toml
from dpfleet.edge.trace_gen import generate
from dpfleet.edge.traces import write_trace
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write, check_writable, private_mkdir, removed_on_failure
from dpfleet.jsonio import dumps, write_json

GENERATED = "trace.jsonl.gz"  # --generate's trace, in --out


BOUND_NOTE = (f"<= : an upper bound on the exact sens^2 (MaxP above {EXACT_MAX_PARTICIPATION:,}, "
              "where the exact program takes minutes; within 1% there): its z meets the target "
              "at the bound, so the plan is at least as private as the target")


def format_plan(plan: Plan) -> str:
    """The plan as a text table, the chosen report goal marked with '*'."""
    head = (f"{'':1}{'report goal':>12} {'MinS':>7} {'MaxP':>6} {'sens^2':>13} "
            f"{'noise z':>10} {'z / M':>10}")
    lines = [f"population {plan.population:,}, {plan.rounds} rounds, target zCDP "
             f"{plan.target_zcdp:.4g}" + ("" if plan.delta is None else
                                          f" (eps {plan.epsilon:.4g} at delta {plan.delta:g}, "
                                          f"{plan.method})"),
             "MinS = largest a timer allows (population // report goal - 1 rounds between); "
             "MaxP = ceil(rounds / (MinS + 1))", "", head]
    for r in plan.rows:
        mark = "*" if r == plan.chosen else " "
        sens = f"{'' if r.sensitivity_exact else '<= '}{r.sensitivity_squared}"
        lines.append(f"{mark}{r.report_goal:>12,} {r.min_separation:>7} {r.max_participation:>6} "
                     f"{sens:>13} {r.noise_multiplier:>10.4g} {r.noise_per_report:>10.4g}")
    if not all(r.sensitivity_exact for r in plan.rows):
        lines.append(BOUND_NOTE)
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
             f"{'':1}{'mechanism':<10} {'sens^2':>13} {'noise z':>10} {'noise factor':>13} "
             f"{'model noise':>12} {'/ M':>10}"]
    for r in rows:
        sens = f"{'' if r.sensitivity_exact else '<= '}{r.sensitivity_squared:.5g}"
        lines.append(f"{'*' if r is chosen else ' '}{r.mechanism:<10} {sens:>13} "
                     f"{r.noise_multiplier:>10.4g} {r.noise_factor:>13.4f} {r.model_noise:>12.4g} "
                     f"{r.model_noise_per_report:>10.4g}")
    if not all(r.sensitivity_exact for r in rows):
        lines.append(BOUND_NOTE)
    lines.append(f"mechanism: {chosen.mechanism} ({how}), noise multiplier "
                 f"{chosen.noise_multiplier:.4g}")
    return "\n".join(lines)


@click.command("plan", short_help="Plan DP-FTRL's report goal, noise multiplier and client "
                                   "timer for a privacy target.")
@with_mechanism_help
@click.option("--population", "-N", type=int, default=None,
              help="Estimated number of devices that can take part (with --trace: the training "
                   "clients the run will have; default the trace's devices).")
@click.option("--rounds", "-T", type=int, default=None,
              help="Planned training rounds (not with --trace: the trace decides them).")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="Plan over this availability trace (docs/traces.md): replay each report goal "
                   "and timer for --days and choose.")
@click.option("--generate", "generate_devices", type=int, default=None, metavar="DEVICES",
              help="Plan over a trace generated for the launch (`dpfleet trace generate`'s "
                   "generator, --days long, --trace-seed) and written to --out/trace.jsonl.gz.")
@click.option("--trace-seed", type=int, default=0, show_default=True,
              help="With --generate: the generator's seed.")
@click.option("--days", type=float, default=None,
              help="With --trace or --generate: the launch's length in days.")
@click.option("--timer-hours", type=float, multiple=True,
              help="With --trace: a timer period to try (repeat; default 1, 6 and 24 h).")
@click.option("--min-rounds", type=int, default=1, show_default=True,
              help="With --trace: a candidate must commit at least this many rounds.")
@click.option("--seed", type=int, default=None,
              help="With --trace: the run's seed (client selection); default --config's, else 0.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="With --trace: a run config whose [participation], [devices] (their other keys) "
                   "and seed the replay uses.")
@click.option("--emit-config", type=click.Path(dir_okay=False), default=None,
              help="With --trace: write the plan's config keys (rounds, seed, [dp], "
                   "[participation], [devices]) as TOML to this new file, to merge into a run "
                   "config.")
@click.option("--emit-projection", type=click.Path(dir_okay=False), default=None,
              help="With --trace: write the keys of a laptop rehearsal of the planned launch "
                   "(rounds, [dp] z and mechanism, [projection] with the plan's report goal, "
                   "population, MinS and MaxP cap) as TOML to this new file; the run keeps its "
                   "own report goal and participation and adds the launch's noise.")
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
def plan(population: int | None, rounds: int | None, trace: str | None,
         generate_devices: int | None, trace_seed: int, days: float | None,
         timer_hours: tuple[float, ...], min_rounds: int, seed: int | None, config_path: str | None,
         emit_config: str | None, emit_projection: str | None, target_zcdp: float | None,
         target_epsilon: float | None, delta: float | None, method: str,
         report_goal: int | None, round_minutes: float | None, out: str | None,
         mechanism: str, as_json: bool) -> None:
    """Plan DP-FTRL's report goal, noise multiplier and client timer (paper 002, Sec. 2.5).

    For each report goal M, the largest MinS the population allows is N // M - 1 rounds
    between participations, MaxP its worst case ceil(T / (MinS + 1)); the exact tree
    sensitivity then gives the noise multiplier that meets the target. Keeping z / M fixed
    keeps utility about the same (paper 002's hypothesis), so smaller z / M is better. At the
    chosen report goal each mechanism is optimised for (T, MinS, MaxP) and given its z.

    With --trace, the rounds and MinS come from an availability trace instead: each report goal
    and timer (--timer-hours) is replayed over --days as `simulate` would select (no training),
    accounted for its enforced MinS, its realised MaxP as the cap and its rounds, and the least
    noise-to-signal (z x noise factor / M) with at least --min-rounds rounds is chosen.

    \b
    Mechanisms:
    {mechanisms}

    \b
    Examples:
      dpfleet plan -N 4210000 -T 1900 --target-zcdp 0.35 -M 6500 --round-minutes 20 --out plan/
      dpfleet plan -N 1277 -T 60 --target-epsilon 8 --delta 1e-6 --json
      dpfleet plan --trace week.jsonl.gz --days 7 --round-minutes 10 --target-epsilon 8 --delta 1e-6
      dpfleet plan --trace day.jsonl --days 1 --round-minutes 30 --target-zcdp 1 --emit-config p.toml
    """
    if (target_zcdp is None) == (target_epsilon is None):
        raise DpfleetError("give exactly one of --target-zcdp and --target-epsilon")
    trace_options = {"--days": days, "--timer-hours": timer_hours or None, "--seed": seed,
                     "--config": config_path, "--emit-config": emit_config,
                     "--emit-projection": emit_projection,
                     "--min-rounds": None if min_rounds == 1 else min_rounds}
    trace = _trace_to_plan_over(trace, generate_devices, trace_seed, out)
    if trace is None and (given := [k for k, v in trace_options.items() if v is not None]):
        raise DpfleetError(f"{given[0]} plans over a trace: give --trace")
    if trace is not None and rounds is not None:
        raise DpfleetError("--rounds is not planned over a trace: the trace decides how many rounds "
                           "--days fill")
    if trace is None and (population is None or rounds is None):
        raise DpfleetError("give --population and --rounds (or --trace and --days)")
    emits = {"--emit-config": emit_config, "--emit-projection": emit_projection}
    _check_outputs(out, emits)
    if round_minutes is not None and (problem := round_minutes_error(round_minutes, "--round-minutes")):
        raise DpfleetError(problem)
    if delta is not None and population is not None and population >= 1:
        check_delta(delta, population, "--delta")
    if target_epsilon is not None:
        if delta is None:
            raise DpfleetError("--target-epsilon needs --delta")
        target_zcdp = zcdp_for_epsilon(target_epsilon, delta, method)
    if trace is not None:
        if generate_devices is None:
            return plan_trace(trace, days, round_minutes, target_zcdp, delta, method, population,
                              seed, report_goal, timer_hours, mechanism, config_path, min_rounds,
                              out, emits, as_json)
        with removed_on_failure(Path(out)):  # a plan that fails leaves no folder of a lone trace
            if days is not None and days > 0:  # else plan_over_trace says what is wrong with it
                private_mkdir(Path(out))
                write_trace(Path(trace), generate(generate_devices, days, trace_seed, progress=True))
            return plan_trace(trace, days, round_minutes, target_zcdp, delta, method, population,
                              seed, report_goal, timer_hours, mechanism, config_path, min_rounds,
                              out, emits, as_json)
    plan_population(population, rounds, target_zcdp, delta, method, report_goal, round_minutes,
                    mechanism, out, as_json)


def _trace_to_plan_over(trace: str | None, generate_devices: int | None, trace_seed: int,
                        out: str | None) -> str | None:
    """The trace to plan over: --trace, or where --generate will write its trace in --out (a new
    folder's, so no earlier trace is planned over or overwritten)."""
    if trace_seed != 0 and generate_devices is None:
        raise DpfleetError("--trace-seed seeds --generate's trace: give --generate")
    if generate_devices is None:
        return trace
    if trace is not None or out is None:
        raise DpfleetError("--generate writes its trace into --out: give --out, not --trace")
    trace = str(Path(out) / GENERATED)
    if Path(trace).exists():
        raise DpfleetError(f"--out {out} already holds {GENERATED}: give a new folder")
    return trace


def _check_outputs(out: str | None, emits: dict[str, str | None]) -> None:
    """Refuse, before the search, an --out that cannot be written or is a run's folder and an
    --emit-* file that exists: a plan that runs for minutes then fails to write is wasted."""
    if out is not None:
        check_writable(Path(out))  # before the search: an unwritable --out is one line, at once
        check_not_a_run(Path(out), "--out")  # a planned run's plan.json is the plan it ran
    for flag, path in emits.items():
        if path is not None and Path(path).exists():  # it may be anyone's file
            raise DpfleetError(f"{flag} {path} exists: give a new file")


def plan_population(population: int, rounds: int, target_zcdp: float, delta: float | None, method: str,
                    report_goal: int | None, round_minutes: float | None, mechanism: str,
                    out: str | None, as_json: bool) -> None:
    """`dpfleet plan -N -T`: `planner.make_plan` over the report-goal grid, each mechanism at the
    chosen goal, printed and written."""
    result = make_plan(population, rounds, target_zcdp, report_goal=report_goal, delta=delta,
                       method=method, round_minutes=round_minutes)
    kinds, skipped = candidates(mechanism), ()
    if mechanism == "auto":
        kinds, skipped = quick_candidates(kinds, rounds)
    rows = mechanism_rows(result.chosen, rounds, result.target_zcdp, kinds)
    picked = (pick_mechanism(rows) if mechanism == "auto"
              else next(r for r in rows if r.mechanism == mechanism))
    record = {**result.to_dict(), "mechanisms": [asdict(r) for r in rows],
              "mechanism": picked.mechanism, "mechanism_choice": mechanism,
              "mechanism_noise_multiplier": picked.noise_multiplier,
              **({"mechanisms_not_optimised": list(skipped)} if skipped else {})}
    how = "least model noise at the target" if mechanism == "auto" else "as asked"
    if skipped:
        how += (f" of {', '.join(kinds)}; {' and '.join(skipped)} are not optimised for "
                f"{rounds:,} rounds under auto (minutes each): ask for one with --mechanism")
    click.echo(dumps(record) if as_json else format_plan(result) + "\n"
               + format_mechanisms(result, rows, picked, how))
    if out is not None:
        write_out(Path(out), record, lambda path: plot_plan(result, path))


def write_out(out_dir: Path, record: dict, plot) -> None:
    """--out: plan.json and the figure `plot(path)` draws to plan.png, or nothing at all."""
    with removed_on_failure(out_dir):  # a full disk leaves no empty or half-written folder
        private_mkdir(out_dir)
        write_json(out_dir / "plan.json", record, indent=1, end="\n")
        figure = plot(out_dir / "plan.png")
    click.echo(f"wrote {out_dir / 'plan.json'} and {figure}")


def format_trace_plan(plan: TracePlan) -> str:
    """The candidates as a text table, the chosen one marked with '*'."""
    eps = "" if plan.delta is None else f" (eps at delta {plan.delta:g})"
    lines = [f"trace {plan.trace}: {plan.population:,} clients over {plan.days:g} days of "
             f"{plan.round_minutes:g}-minute round slots ({plan.launch_slots:,}), peak "
             f"{max(plan.available):,} available; target zCDP {plan.target_zcdp:.4g}{eps}",
             "MinS / MaxP: enforced (accounted); real: what the replayed devices did; "
             "noise/signal = z x noise factor / M", "",
             f"{'':1}{'goal M':>7} {'timer h':>8} {'rounds':>7} {'a day':>7} {'filled':>7} "
             f"{'MinS':>5} {'MaxP':>5} {'real':>10} {'mechanism':>9} {'z':>9} {'noise/signal':>12} "
             f"{'eps':>7}"]
    for r in plan.candidates:
        real = f"{'-' if r.realised_min_separation is None else r.realised_min_separation}/" \
               f"{r.realised_max_participation}"
        tail = (f"{r.mechanism:>9} {r.noise_multiplier:>9.4g} {r.noise_to_signal:>12.4g} "
                f"{'-' if r.epsilon is None else format(r.epsilon, '.3g'):>7}" if r.meets
                else f"{'no round filled':>40}")
        lines.append(f"{'*' if r is plan.chosen else ' '}{r.report_goal:>7,} {r.timer_hours:>8g} "
                     f"{r.rounds:>7} {r.rounds_per_day:>7.3g} {r.filled:>7.1%} {r.min_separation:>5} "
                     f"{r.max_participation:>5} {real:>10} {tail}")
    c = plan.chosen
    lines += ["", f"rule: least noise/signal among candidates of at least {plan.min_rounds} round(s); "
              "ties: more rounds, smaller report goal, shorter timer",
              f"plan: report goal {c.report_goal:,}, timer {c.timer_hours:g} h, {c.rounds} rounds "
              f"({c.rounds_per_day:.3g} a day, {c.filled:.0%} of the slots fill), MinS "
              f"{c.min_separation}, MaxP cap {c.cap}, {c.mechanism} noise z {c.noise_multiplier:.4g}"
              + ("" if c.epsilon is None else f", eps {c.epsilon:.3g} (realised participation: "
                 f"{c.realised_epsilon:.3g})")]
    return "\n".join(lines)


def plan_trace(trace: str, days: float | None, round_minutes: float | None, target_zcdp: float,
               delta: float | None, method: str, population: int | None, seed: int | None,
               report_goal: int | None, timer_hours: tuple[float, ...], mechanism: str,
               config_path: str | None, min_rounds: int, out: str | None, emits: dict[str, str | None],
               as_json: bool) -> None:
    """`dpfleet plan --trace`: `launch_plan.plan_over_trace`, printed and written (`emits`: the
    --emit-config / --emit-projection files)."""
    if days is None or round_minutes is None:
        raise DpfleetError("--trace needs --days and --round-minutes")
    section, devices, run_seed = None, None, 0
    if config_path is not None:
        cfg = parse_config(read_toml(Path(config_path)))
        section, devices, run_seed = cfg.participation, cfg.devices, cfg.seed
    result = plan_over_trace(trace, days, round_minutes, target_zcdp, delta=delta, method=method,
                             population=population, seed=run_seed if seed is None else seed,
                             report_goals=None if report_goal is None else [report_goal],
                             timer_hours=timer_hours or None, mechanism=mechanism, section=section,
                             devices=devices,
                             min_rounds=min_rounds)
    record = result.to_dict()
    click.echo(dumps(record) if as_json else format_trace_plan(result))
    if out is not None:
        write_out(Path(out), record, lambda path: plot_trace_plan(result, path))
    for path, key, what in zip(emits.values(), ("config", "projection_config"), (
            "merge it into a run config for `dpfleet simulate`",
            "merge it into a run config to rehearse the launch on a laptop (a projection: its eps "
            "is a simulation of DP, not a guarantee)"), strict=True):
        if path is not None:
            atomic_write(Path(path), to_toml(record[key]))
            click.echo(f"wrote {path}: {what}")
