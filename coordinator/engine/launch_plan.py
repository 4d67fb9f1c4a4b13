"""Planning a launch over an availability trace: report goal, timer, MinS / MaxP, rounds, mechanism.

Why a second planner: `accounting.planner.make_plan` sees only the population N and the rounds
T, so its MinS is arithmetic (N // M - 1) and its rounds are whatever the user says. On real
devices both come from when the phones are available: how many rounds a night fills, how often
a device comes back. This planner finds out by replaying the participation process over the
trace (docs/traces.md) for the launch's length, without training: for each candidate (report
goal M, timer period) it builds the very `Participation` that `simulate` builds in timer mode
(same section, population and seed) and proposes / commits round after round until a round
would start after the launch ends. A later `simulate` of the chosen plan on the same trace
therefore selects exactly the same devices in exactly the same rounds.

Each candidate is replayed twice. The first replay is uncapped; the most participations any
device had (its realised MaxP) becomes the cap `participation.max_participation` of the second
replay, whose participation is the plan's. Why: the noise is accounted for the cap the
coordinator enforces, not for what a device happened to do, and a cap changes who is accepted
(a device at its cap is refused), so the capped replay is the one the run repeats. The
accounting then uses the enforced MinS (the guard's), the cap (or the fewer participations the
enforced MinS allows over the rounds) and the rounds the capped replay committed; each
mechanism is optimised for that and given the z meeting the target (`mechanism_rows`,
`pick_mechanism`). The realised MinS / MaxP (what the devices really did) only ever lower the eps
a run reports, so the plan's eps is an upper bound on the replayed run's.

The choice (`choose`): among candidates that committed at least `min_rounds` rounds (default 1),
the least noise-to-signal z x noise_factor / M (the utility proxy of `accounting.planner`); ties
go to more rounds, then the smaller report goal, then the shorter timer. The proxy alone favours
a large report goal that fills a handful of rounds, so a launch that needs its rounds states
`min_rounds`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from dpfleet.coordinator.accounting.ledger import planned_epsilon
from dpfleet.coordinator.accounting.planner import (
    candidates,
    capped_max_participation,
    mechanism_rows,
    pick_mechanism,
    row_for,
)
from dpfleet.coordinator.accounting.zcdp import zcdp_from_sensitivity
from dpfleet.coordinator.config import ParticipationSection, check_delta, round_minutes_error
from dpfleet.coordinator.engine.participation import Participation, RoundUnfillable
from dpfleet.coordinator.mechanisms.registry import rebuild
from dpfleet.edge.devices import DevicesSection
from dpfleet.edge.traces import TraceReplay, load
from dpfleet.errors import DpfleetError
from dpfleet.progress import progress_bar

DEFAULT_TIMER_HOURS = (1.0, 6.0, 24.0)
GOAL_POINTS = 6  # report goals on the default grid


@dataclass(frozen=True)
class Realised:
    """What the devices did in a replay: rounds committed, their slots, the realised MinS / MaxP."""

    rounds: int
    slots: list[int]  # the round slot each committed round started at
    enforced_min_separation: int  # the guard's MinS
    min_separation: int | None  # smallest gap in rounds strictly between two participations
    max_participation: int  # most participations of one device


def realised_participation(rounds: Sequence[Sequence[int]]) -> tuple[int | None, int]:
    """(MinS, MaxP) of a participation log, `rounds[r]` the devices in round r: the smallest
    number of rounds strictly between two participations of a device (None: nobody took part
    twice) and the most participations of a device (0: nobody took part)."""
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    mins: int | None = None
    for r, devices in enumerate(rounds):
        for d in devices:
            if d in last:
                gap = r - last[d] - 1
                mins = gap if mins is None else min(mins, gap)
            last[d] = r
            count[d] = count.get(d, 0) + 1
    return mins, max(count.values(), default=0)


def launch_slots(days: float, round_minutes: float) -> int:
    """Round slots that start within the launch: slot s starts at s x round_minutes."""
    return math.ceil(days * 24 * 60 / round_minutes - 1e-9)


def replay(section: ParticipationSection, devices: DevicesSection, population: int, report_goal: int,
           seed: int, days: float) -> Realised:
    """Propose and commit rounds as `simulate` does (no training) until a round would start after
    `days`, or none can be filled. `section` and `devices` are passed whole (any field the engine
    reads flows in)."""
    slots = launch_slots(days, section.round_minutes)
    part = Participation(section, population, report_goal, slots, seed, end_slot=slots, devices=devices)
    log: list[list[int]] = []
    starts: list[int] = []
    while True:
        try:
            selection = part.propose(len(log))
        except RoundUnfillable:
            break
        if selection.slot >= slots:
            break
        part.commit(selection, selection.devices)  # plain aggregation: everyone reported is summed
        log.append(selection.devices)
        starts.append(selection.slot)
    mins, maxp = realised_participation(log)
    return Realised(len(log), starts, part.min_separation, mins, maxp)


@dataclass(frozen=True)
class Candidate:
    """One (report goal, timer) replayed over the launch and accounted."""

    report_goal: int
    timer_hours: float
    rounds: int
    rounds_per_day: float
    filled: float  # fraction of the launch's round slots that started a round
    min_separation: int  # enforced (the guard's)
    max_participation: int  # accounted: the cap, or fewer when MinS allows fewer over the rounds
    cap: int  # participation.max_participation, the cap the coordinator enforces
    realised_min_separation: int | None
    realised_max_participation: int
    mechanism: str | None
    noise_multiplier: float | None
    noise_factor: float | None
    noise_to_signal: float | None  # z x noise_factor / M
    zcdp: float | None  # of the enforced participation at z: the plan's guarantee
    epsilon: float | None
    realised_epsilon: float | None  # at the realised MinS / MaxP: what the run's privacy.json says
    slots: tuple[int, ...] = ()

    @property
    def meets(self) -> bool:
        return self.noise_to_signal is not None


def choose(rows: Sequence[Candidate], min_rounds: int = 1) -> Candidate:
    """The least noise-to-signal among candidates that committed at least `min_rounds` rounds;
    ties: more rounds, then the smaller report goal, then the shorter timer."""
    ok = [r for r in rows if r.meets and r.rounds >= min_rounds]
    if not ok:
        most = max((r.rounds for r in rows), default=0)
        raise DpfleetError(f"no candidate fills {max(min_rounds, 1)} round(s) in the launch (the most: "
                           f"{most}): lower the report goal or the timer, or plan a longer launch")
    return min(ok, key=lambda r: (r.noise_to_signal, -r.rounds, r.report_goal, r.timer_hours))


@dataclass(frozen=True)
class TracePlan:
    trace: str
    population: int
    days: float
    round_minutes: float
    seed: int
    target_zcdp: float
    delta: float | None
    method: str
    min_rounds: int
    launch_slots: int
    available: list[int]  # clients available at each slot of the launch
    candidates: list[Candidate]
    chosen: Candidate
    section: ParticipationSection  # the chosen participation, as simulate will run it
    devices: DevicesSection  # the devices replayed: the trace (and the run's other [devices] keys)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["available"] = {"slots": len(self.available), "peak": max(self.available),
                            "mean": float(np.mean(self.available))}
        for row in out["candidates"]:  # the chosen one keeps its rounds' start slots
            row.pop("slots")
        out["rule"] = (f"least noise-to-signal (z x noise_factor / M) among candidates of at least "
                       f"{self.min_rounds} round(s); ties: more rounds, smaller report goal, shorter timer")
        out["config"] = config_fragment(self)
        out["projection_config"] = projection_fragment(self)
        return out


def config_fragment(plan: TracePlan) -> dict:
    """The config keys the plan implies ([participation] and [devices] whole, [dp], rounds, seed):
    merged into a run config, `dpfleet simulate` replays exactly the planned participation."""
    c = plan.chosen
    dp = {"target_epsilon": 0.0, "report_goal": c.report_goal, "noise_multiplier": c.noise_multiplier,
          "mechanism": c.mechanism}
    if plan.delta is not None:
        dp["delta"] = plan.delta
    return {"rounds": c.rounds, "seed": plan.seed, "dp": dp, "participation": asdict(plan.section),
            "devices": asdict(plan.devices)}


def projection_fragment(plan: TracePlan) -> dict:
    """The keys of a laptop rehearsal of the planned launch (pfl's method, `[projection]`): the
    run trains its own report goal under its own participation and adds the noise of the plan's
    cohort; its projected eps is accounted for the plan's population, rounds, enforced MinS and
    MaxP cap, so it is the plan's eps (a simulation of DP, not a guarantee)."""
    c = plan.chosen
    dp = {"target_epsilon": 0.0, "noise_multiplier": c.noise_multiplier, "mechanism": c.mechanism}
    if plan.delta is not None:
        dp["delta"] = plan.delta
    return {"rounds": c.rounds, "dp": dp,
            "projection": {"noise_cohort": c.report_goal, "population": plan.population,
                           "min_separation": c.min_separation,
                           "max_participation": c.max_participation}}


def report_goal_grid(peak: int, points: int = GOAL_POINTS) -> list[int]:
    """Report goals from 1% to half of the most clients ever available at once."""
    low, high = max(1, peak // 100), max(1, peak // 2)
    return sorted({int(round(m)) for m in np.geomspace(low, high, points)})


def _account(report_goal: int, timer: float, run: Realised, cap: int, slots: int, days: float,
             target_zcdp: float, delta: float | None, method: str, kinds: Sequence[str]) -> Candidate:
    """The candidate's accounting: the enforced MinS, the cap (or what MinS allows) and the rounds
    committed, each mechanism in `kinds` given the z meeting the target, the least model noise
    chosen; its eps at `delta`, and the eps of the realised MinS / MaxP at that z."""
    enforced_mins = run.enforced_min_separation
    base = dict(report_goal=report_goal, timer_hours=timer, rounds=run.rounds, cap=cap,
                rounds_per_day=run.rounds / days, filled=run.rounds / slots, min_separation=enforced_mins,
                realised_min_separation=run.min_separation,
                realised_max_participation=run.max_participation, slots=tuple(run.slots))
    if run.rounds == 0:
        return Candidate(**base, max_participation=cap, mechanism=None, noise_multiplier=None,
                         noise_factor=None, noise_to_signal=None, zcdp=None, epsilon=None,
                         realised_epsilon=None)
    maxp = capped_max_participation(run.rounds, enforced_mins, cap)  # cap >= 1 once a round ran
    row = row_for(report_goal, run.rounds, enforced_mins, maxp, target_zcdp)
    picked = pick_mechanism(mechanism_rows(row, run.rounds, target_zcdp, kinds))
    mechanism = rebuild(picked.mechanism, picked.spec)
    s = mechanism.sensitivity_squared(run.rounds, run.min_separation, run.max_participation, [])
    rho = zcdp_from_sensitivity(picked.noise_multiplier, picked.sensitivity_squared)
    eps = None if delta is None else planned_epsilon(picked.noise_multiplier, picked.sensitivity_squared,
                                                     delta, method)
    realised = None if delta is None else planned_epsilon(picked.noise_multiplier, s, delta, method)
    return Candidate(**base, max_participation=maxp, mechanism=picked.mechanism,
                     noise_multiplier=picked.noise_multiplier, noise_factor=picked.noise_factor,
                     noise_to_signal=picked.noise_multiplier * picked.noise_factor / report_goal,
                     zcdp=rho, epsilon=eps, realised_epsilon=realised)


def plan_over_trace(trace: str | Path, days: float, round_minutes: float, target_zcdp: float, *,
                    delta: float | None = None, method: str = "pld", population: int | None = None,
                    seed: int = 0, report_goals: Sequence[int] | None = None,
                    timer_hours: Sequence[float] | None = None, mechanism: str = "auto",
                    section: ParticipationSection | None = None, min_rounds: int = 1,
                    progress: bool = True, devices: DevicesSection | None = None) -> TracePlan:
    """Replay each (report goal, timer) candidate over `days` of the trace and choose (`choose`).

    `population`: the training clients the run will have (client i replays trace device i mod
    the trace's devices; default: the trace's devices). `section`: the run's [participation]
    (its other fields, e.g. over-selection, are replayed as they are); mode, timer_period,
    round_minutes and max_participation are the plan's; `devices`: the run's [devices], whose
    trace is the plan's. `min_rounds`: see `choose`."""
    if not (days > 0 and math.isfinite(days)):
        raise DpfleetError(f"--days must be a positive number of days, got {days:g}")
    if problem := round_minutes_error(round_minutes, "--round-minutes"):
        raise DpfleetError(problem)
    if not (target_zcdp > 0 and math.isfinite(target_zcdp)):
        raise DpfleetError(f"the privacy target must be a positive zCDP, got {target_zcdp:g}")
    path = Path(trace).absolute()
    loaded = load(path)
    population = population if population is not None else len(loaded)
    if population < 1:
        raise DpfleetError(f"the population must be at least 1 client, got {population}")
    replayed = TraceReplay(loaded, population)
    if delta is not None:
        check_delta(delta, population, "--delta")
    slots = launch_slots(days, round_minutes)
    available = [int(replayed.eligible(s * round_minutes * 60.0).sum())
                 for s in progress_bar(range(slots), desc="availability", unit="slot", leave=False,
                                       enabled=progress)]
    peak = max(available)
    if peak == 0:
        raise DpfleetError(f"{trace}: no device is available at any round slot of the {days:g} "
                           "days: nothing to plan")
    goals = sorted(set(report_goals)) if report_goals else report_goal_grid(peak)
    if goals[0] < 1 or goals[-1] > population:
        raise DpfleetError(f"report goals must be within 1..{population} (the population), got "
                           f"{goals[0]}..{goals[-1]}")
    timers = sorted(set(timer_hours)) if timer_hours else sorted(
        {max(h, round_minutes / 60.0) for h in DEFAULT_TIMER_HOURS})
    base = section if section is not None else ParticipationSection()
    replayed_devices = replace(devices if devices is not None else DevicesSection(), trace=str(path))
    kinds = candidates(mechanism)
    grid = [(m, t) for t in timers for m in goals]
    rows = []
    for m, t in progress_bar(grid, desc="replaying candidates", unit="candidate", enabled=progress):
        run_section = replace(base, mode="timer", timer_period=t, round_minutes=round_minutes)
        run, cap = Realised(0, [], -1, None, 0), 0
        if m <= peak:  # else never fillable: no replay (it would wait MAX_WAIT_DAYS of slots)
            run = replay(run_section, replayed_devices, population, m, seed, days)
            cap = run.max_participation
            if run.rounds:  # the realised MaxP becomes the cap; the capped replay is the plan's
                run = replay(replace(run_section, max_participation=cap), replayed_devices, population,
                             m, seed, days)
        rows.append(_account(m, t, run, cap, slots, days, target_zcdp, delta, method, kinds))
    chosen = choose(rows, min_rounds)
    chosen_section = replace(base, mode="timer", timer_period=chosen.timer_hours,
                             round_minutes=round_minutes, max_participation=chosen.cap,
                             min_separation=chosen.min_separation)  # stated, as enforced
    return TracePlan(str(path), population, days, round_minutes, seed, target_zcdp, delta, method,
                     min_rounds, slots, available, rows, chosen, chosen_section, replayed_devices)


def per_hour(plan: TracePlan) -> tuple[np.ndarray, np.ndarray]:
    """(devices available, rounds committed) per hour of the launch: the mean of the clients
    available at the hour's round slots (NaN for an hour with no slot start) and the chosen
    candidate's rounds that started in it."""
    hours = math.ceil(plan.days * 24 - 1e-9)
    hour_of = (np.arange(plan.launch_slots) * plan.round_minutes / 60.0).astype(np.int64)
    counts = np.bincount(hour_of, minlength=hours)[:hours]
    totals = np.bincount(hour_of, weights=np.asarray(plan.available, float), minlength=hours)[:hours]
    available = np.divide(totals, counts, out=np.full(hours, np.nan), where=counts > 0)
    starts = (np.asarray(plan.chosen.slots, dtype=np.int64) * plan.round_minutes / 60.0).astype(np.int64)
    return available, np.bincount(starts, minlength=hours)[:hours]


def plot_trace_plan(plan: TracePlan, path: str | Path) -> Path:
    """Devices available and rounds committed per hour over the simulated days (the chosen plan)."""
    from matplotlib.figure import Figure  # not pyplot: the caller's backend is left alone

    path = Path(path)
    available, rounds = per_hour(plan)
    days = np.arange(available.size) / 24.0
    c = plan.chosen
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    ax.plot(days, available, color="tab:blue", label="devices available (mean over the hour's slots)")
    ax.set(xlabel="simulated day", ylabel="devices available",
           title=f"report goal {c.report_goal}, timer {c.timer_hours:g} h: {c.rounds} rounds in "
                 f"{plan.days:g} days ({c.rounds_per_day:.3g} a day)")
    right = ax.twinx()
    right.bar(days, rounds, width=1 / 24, align="edge", alpha=0.4, color="tab:orange",
              label="rounds committed")
    right.set_ylabel("rounds committed per hour")
    ax.set_zorder(right.get_zorder() + 1)  # the availability line over the bars
    ax.patch.set_visible(False)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
