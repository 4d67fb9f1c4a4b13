"""Choosing DP-FTRL's report goal, noise multiplier and client timer (paper 002, Sec. 2.2, 2.5).

Each round takes at least `report_goal` (M) distinct devices from a population of N, so a
device can come back at the earliest floor(N / M) rounds after it took part: the largest MinS a
timer can enforce is floor(N / M) - 1 rounds *between* participations (the accountant's
convention; the paper's "MinS ~ N / report goal"). With that MinS, the worst case over T rounds
is MaxP = ceil(T / (MinS + 1)), the most participations MinS allows. The exact tree
sensitivity S then gives the noise multiplier meeting a zCDP target, z = sqrt(S / (2 rho)).

Paper 002's working hypothesis: utility stays about the same when noise multiplier and report
goal grow in proportion, so z / M (the noise std on the averaged update, in units of the clip
norm) is the utility proxy. It keeps falling, ever more slowly, as M grows, so without a given
report goal the planner picks the smallest one within 10% of the best z / M on its grid.
The timer that approaches MinS keeps a device ineligible for MinS + 1 rounds; the paper grows
it in whole days because participation is diurnal.

Mechanisms (`mechanism_rows`): at the chosen report goal, the tree, banded and BLT strategies
are each optimised for (rounds, MinS, MaxP) and given the z that meets the target; at one rho
the one whose model noise (z x `noise_factor`) is least is `pick_mechanism`'s choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dpfleet.coordinator.accounting.ledger import stated_epsilon
from dpfleet.coordinator.accounting.zcdp import (
    noise_for_zcdp,
    zcdp_from_sensitivity,
)
from dpfleet.coordinator.mechanisms.registry import build, entry, planned_names
from dpfleet.coordinator.mechanisms.tree_bound import EXACT_MAX_PARTICIPATION, tree_sensitivity_bound
from dpfleet.errors import DpfleetError
from dpfleet.progress import progress_bar

MAX_POPULATION = 10 ** 12  # devices: above any fleet, well inside numpy's int64


def max_min_separation(population: int, report_goal: int) -> int:
    """Largest MinS (rounds strictly between) that N devices allow at M devices per round."""
    if report_goal < 1 or population < report_goal:
        raise DpfleetError(f"need 1 <= report goal <= population, got report goal "
                           f"{report_goal} and population {population}")
    return population // report_goal - 1


def worst_case_max_participation(rounds: int, min_separation: int) -> int:
    """The most participations MinS allows in `rounds` rounds."""
    return -(-rounds // (min_separation + 1))


def capped_max_participation(rounds: int, min_separation: int, cap: int = 0) -> int:
    """The MaxP accounted for a launch that enforces MinS and a cap (0: none): the lower of the
    cap and what MinS allows over the rounds."""
    most = worst_case_max_participation(rounds, min_separation)
    return min(most, cap) if cap else most


@dataclass(frozen=True)
class PlanRow:
    """One report goal with the largest MinS it allows and the noise that meets the target."""

    report_goal: int
    min_separation: int
    max_participation: int
    sensitivity_squared: int
    noise_multiplier: float
    zcdp: float
    sensitivity_exact: bool = True  # False: `tree_bound`'s upper bound (z at least what it needs)

    @property
    def noise_per_report(self) -> float:
        """z / M: noise std on the mean update in clip-norm units (the utility proxy)."""
        return self.noise_multiplier / self.report_goal


@dataclass(frozen=True)
class Timer:
    """How long a device stays ineligible after taking part, to approach a MinS."""

    rounds: int  # MinS + 1
    hours: float | None  # at the given round duration
    diurnal_hours: float | None  # rounded up to whole days


def timer_for(min_separation: int, round_minutes: float | None = None) -> Timer:
    rounds = min_separation + 1
    if round_minutes is None:
        return Timer(rounds, None, None)
    if not (round_minutes > 0 and math.isfinite(round_minutes)):
        raise DpfleetError(f"round duration must be positive minutes, got {round_minutes}")
    hours = rounds * round_minutes / 60.0
    return Timer(rounds, hours, 24.0 * math.ceil(hours / 24.0))


def _tree():
    """The report goal is chosen on the tree's z / M (paper 002's proxy), whatever the mechanism."""
    return build("tree", 1, 0, 1)


def planned_tree_sensitivity(rounds: int, min_separation: int, max_participation: int,
                             exact_up_to: int | None = None) -> tuple[int, bool]:
    """(the tree's S for a plan, whether it is exact): the exact program up to `exact_up_to`
    participations (default `EXACT_MAX_PARTICIPATION`), above it `tree_bound`'s upper bound,
    within 1% of it there (the exact program took minutes per row at 10^5 rounds; a larger S
    only makes the planned z larger, the plan more private than its target)."""
    limit = EXACT_MAX_PARTICIPATION if exact_up_to is None else exact_up_to
    if capped_max_participation(rounds, min_separation, max_participation) <= limit:
        return _tree().sensitivity_squared(rounds, min_separation, max_participation), True
    return tree_sensitivity_bound(rounds, max_participation, min_separation), False


def plan_row(population: int, rounds: int, report_goal: int, target_zcdp: float) -> PlanRow:
    """The plan for one report goal: MinS = N // M - 1, MaxP = worst case, z for the target."""
    mins = max_min_separation(population, report_goal)
    return row_for(report_goal, rounds, mins, worst_case_max_participation(rounds, mins), target_zcdp)


def row_for(report_goal: int, rounds: int, min_separation: int, max_participation: int,
            target_zcdp: float) -> PlanRow:
    """The tree's row for a participation that is given rather than derived from N (a trace
    planner's enforced MinS and MaxP cap): its sensitivity (`planned_tree_sensitivity`) and the z
    meeting the target."""
    s, exact = planned_tree_sensitivity(rounds, min_separation, max_participation)
    z = noise_for_zcdp(target_zcdp, s)
    return PlanRow(report_goal, min_separation, max_participation, s, z, zcdp_from_sensitivity(z, s),
                   exact)


def report_goal_grid(population: int, rounds: int, points: int = 12) -> list[int]:
    """Report goals from 'each device at most once' (M ~ N / T) to N / 4 (MinS >= 3)."""
    low = max(1, population // max(rounds, 1))
    high = max(low, population // 4)
    return sorted({int(round(m)) for m in np.geomspace(low, high, points)})


@dataclass(frozen=True)
class Plan:
    population: int
    rounds: int
    target_zcdp: float
    delta: float | None
    method: str
    epsilon: float | None  # of the target zCDP at delta, when a delta was given
    rows: list[PlanRow]
    chosen: PlanRow
    timer: Timer

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, d in zip([*self.rows, self.chosen], [*out["rows"], out["chosen"]], strict=True):
            d["noise_per_report"] = row.noise_per_report
        return out


def make_plan(population: int, rounds: int, target_zcdp: float, *,
              report_goal: int | None = None, delta: float | None = None, method: str = "pld",
              round_minutes: float | None = None) -> Plan:
    """Rows over a report-goal grid (plus `report_goal`); chosen: `report_goal`, or else the
    smallest report goal whose z / M is within 10% of the grid's best."""
    if population < 1 or rounds < 1:
        raise DpfleetError("population and rounds must be >= 1")
    if population > MAX_POPULATION:  # beyond numpy's integers (the report goal grid)
        raise DpfleetError(f"population must be at most {MAX_POPULATION:.0e} devices, got {population}")
    eps = None if delta is None else stated_epsilon(target_zcdp, delta, method)
    goals = report_goal_grid(population, rounds)
    if report_goal is not None:
        max_min_separation(population, report_goal)  # validates
        goals = sorted({*goals, report_goal})
    rows = [plan_row(population, rounds, m, target_zcdp)
            for m in progress_bar(goals, desc="planning", unit="report goal", leave=False)]
    if report_goal is not None:
        chosen = next(r for r in rows if r.report_goal == report_goal)
    else:
        best = min(r.noise_per_report for r in rows)
        chosen = next(r for r in rows if r.noise_per_report <= 1.1 * best)
    return Plan(population, rounds, target_zcdp, delta, method, eps, rows, chosen,
                timer_for(chosen.min_separation, round_minutes))


@dataclass(frozen=True)
class MechanismRow:
    """One noise mechanism at a plan's report goal: the z it needs and the model noise it gives.

    model_noise = z * sqrt(prefix_error) is the worst round's noise std on the model's prefix sum
    in clip-norm units (proportional to z * noise_factor): at one target rho the mechanism with
    the least model_noise adds the least noise, the one `auto` picks.
    """

    mechanism: str
    spec: dict
    sensitivity_squared: float
    noise_multiplier: float
    noise_factor: float
    model_noise: float
    model_noise_per_report: float  # / M: on the averaged update
    sensitivity_exact: bool = True  # False: the tree's upper bound (`planned_tree_sensitivity`)


# `dpfleet plan`'s "auto" optimises banded and BLT only up to this many rounds: at 10^4 the
# whole plan took 37 s, at 10^5 BLT's optimisation alone 180 s and banded's over 120 s
OPTIMISED = ("banded", "blt")
PLAN_OPTIMISED_ROUNDS = 10_000


def quick_candidates(kinds: Sequence[str], rounds: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the kinds `dpfleet plan`'s "auto" compares at `rounds`, the optimised ones it leaves out
    above `PLAN_OPTIMISED_ROUNDS`: asked for by name, they are optimised however long it takes)."""
    if rounds <= PLAN_OPTIMISED_ROUNDS:
        return tuple(kinds), ()
    return tuple(k for k in kinds if k not in OPTIMISED), tuple(k for k in kinds if k in OPTIMISED)


def candidates(asked: str, restarts: bool = False, plugins: bool = False) -> tuple[str, ...]:
    """The mechanisms to plan: `auto`'s (every planned built-in, and planned plugins only with
    `plugins`; with restarts only those that take them), or the tree (the reference) and the one
    asked for."""
    if asked == "auto":
        return tuple(k for k in planned_names(plugins) if not restarts or entry(k).cls.supports_restarts)
    return tuple(dict.fromkeys(("tree", asked)))


def mechanism_rows(row: PlanRow, rounds: int, target_zcdp: float,
                   kinds: Sequence[str] = ("tree", "banded", "blt")) -> list[MechanismRow]:
    """Each mechanism built for the row's (rounds, MinS, MaxP), with the z meeting the target."""
    tree_error = _tree().prefix_error(rounds)
    out = []
    for kind in kinds:
        mechanism = build(kind, rounds, row.min_separation, row.max_participation)
        if kind == "tree":  # built as `_tree()` is: all nodes
            s, exact = planned_tree_sensitivity(rounds, row.min_separation, row.max_participation)
        else:
            s, exact = mechanism.sensitivity_squared(rounds, row.min_separation, row.max_participation), True
        z = noise_for_zcdp(target_zcdp, s)
        error = mechanism.prefix_error(rounds)
        noise = z * math.sqrt(error)
        out.append(MechanismRow(kind, mechanism.identity(), s, z, math.sqrt(error / tree_error), noise,
                                noise / row.report_goal, exact))
    return out


def pick_mechanism(rows: Sequence[MechanismRow]) -> MechanismRow:
    """The least model noise; ties go to the earlier (simpler) mechanism."""
    return min(rows, key=lambda r: r.model_noise)


def zcdp_curve_report_goal(population: int, rounds: int, report_goals: Sequence[int],
                           noise_per_report: float, exact_up_to: int | None = None) -> list[float]:
    """zCDP when z grows with M (z = noise_per_report * M) and MinS is the largest allowed."""
    out = []
    for m in report_goals:
        mins = max_min_separation(population, m)
        s, _ = planned_tree_sensitivity(rounds, mins, worst_case_max_participation(rounds, mins),
                                        exact_up_to)
        out.append(zcdp_from_sensitivity(noise_per_report * m, s))
    return out


def zcdp_curve_min_separation(rounds: int, min_separations: Sequence[int],
                              noise_multiplier: float, exact_up_to: int | None = None) -> list[float]:
    """zCDP at a fixed z against MinS, with the worst-case MaxP = ceil(T / (MinS + 1))."""
    return [zcdp_from_sensitivity(noise_multiplier, planned_tree_sensitivity(
        rounds, s, worst_case_max_participation(rounds, s), exact_up_to)[0]) for s in min_separations]


# the figure's curves (84 tree sensitivities over up to twice the plan's rounds) are drawn from the
# bound beyond this many rounds: exactly they took 40 s at 10^5 rounds, and the bound is within a
# few % of them, which a log axis does not show
PLOT_EXACT_ROUNDS = 10_000


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """Paper 002 Fig. 4-like: zCDP vs report goal (a) and vs MinS (b), the plan marked."""
    from matplotlib.figure import Figure  # not pyplot: the caller's backend is left alone

    path = Path(path)
    chosen = plan.chosen
    exact_up_to = None if plan.rounds <= PLOT_EXACT_ROUNDS else 0  # 0: the bound for every point
    rho = "zCDP rho" if exact_up_to is None else "zCDP rho (from the sensitivity's upper bound)"
    fig = Figure(figsize=(11, 4.2))
    ax_a, ax_b = fig.subplots(1, 2)
    populations = [plan.population // 4, plan.population, plan.population * 4]
    for n in progress_bar(populations, desc="plot: report goal", leave=False):
        goals = report_goal_grid(n, plan.rounds)
        ax_a.plot(goals, zcdp_curve_report_goal(n, plan.rounds, goals, chosen.noise_per_report,
                                                 exact_up_to),
                  marker="o", ms=3, label=f"population {n:,}")
    ax_a.plot([chosen.report_goal], [chosen.zcdp], "k*", ms=12, label="plan")
    ax_a.set(xscale="log", yscale="log", xlabel="report goal (noise multiplier grows in "
             f"proportion, z/M = {chosen.noise_per_report:.3g})", ylabel=rho,
             title=f"(a) {plan.rounds} rounds, largest MinS per report goal")
    top = max(plan.rounds * 2 - 1, 2)
    mins = sorted({int(round(s)) for s in np.geomspace(max(1, plan.rounds // 100), top, 16)})
    for t in progress_bar([max(plan.rounds // 2, 1), plan.rounds, plan.rounds * 2],
                          desc="plot: MinS", leave=False):
        ax_b.plot(mins, zcdp_curve_min_separation(t, mins, chosen.noise_multiplier, exact_up_to),
                  marker="o", ms=3, label=f"{t} rounds")
    ax_b.plot([chosen.min_separation], [chosen.zcdp], "k*", ms=12, label="plan")
    ax_b.set(xscale="log", yscale="log", xlabel="MinS (rounds between participations; "
             "MaxP = ceil(T / (MinS + 1)))", ylabel=rho,
             title=f"(b) noise multiplier {chosen.noise_multiplier:.3g}")
    for ax in (ax_a, ax_b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
