"""Who takes part in each round, and the coordinator's refusal of devices that would break MinS.

Modes (`[participation] mode`):
  disjoint  one seeded permutation cut into blocks of the report goal (paper 000 App. C): each
            device takes part at most once, so single-participation accounting applies.
  uniform   a fresh seeded draw of report-goal devices each round among those the guard allows.
  timer     paper 002 Sec. 2.2: the devices of an `EmulatedFleet` check in when their own timer
            has expired and they are available; the coordinator takes the report goal from the
            devices it accepts (a seeded draw) and, when too few are accepted, waits one slot
            (a round's duration) on the simulated clock and tries again.

Defence in depth: whatever the devices' timers do, `ParticipationGuard` refuses a device that
would have fewer than `min_separation` rounds strictly between two of its participations (the
accountant's MinS convention) or more than `max_participation` participations. The timer alone
cannot promise a MinS in *rounds*: it separates participations in time, and a round that had to
wait for devices stretches time, so fewer rounds fit into one timer period. The accountant reads
the participation log, never this module's state, so a bug here cannot hide a participation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpfleet.coordinator.config import ParticipationSection
from dpfleet.edge.fleet import Availability, EmulatedFleet
from dpfleet.errors import DpfleetError

NEVER = -(1 << 40)  # "last participation" of a device that never took part
MAX_WAIT_DAYS = 30  # a round that cannot be filled within this much simulated time ends the run


class RoundUnfillable(Exception):
    """No round can start: too few devices may take part (the run stops cleanly)."""


class ParticipationGuard:
    """The coordinator's own record of participation: refuses devices that would break MinS/MaxP."""

    def __init__(self, size: int, min_separation: int, max_participation: int = 0):
        if min_separation < 0 or max_participation < 0:
            raise DpfleetError("min_separation and max_participation must be >= 0")
        self.min_separation, self.max_participation = min_separation, max_participation
        self.last = np.full(size, NEVER, dtype=np.int64)
        self.count = np.zeros(size, dtype=np.int64)

    def allowed(self, round_idx: int) -> np.ndarray:
        """Boolean mask of the devices that may take part in round `round_idx`."""
        ok = round_idx - self.last - 1 >= self.min_separation
        if self.max_participation:
            ok &= self.count < self.max_participation
        return ok

    def record(self, devices: list[int], round_idx: int) -> None:
        idx = np.asarray(devices, dtype=np.int64)
        if idx.size and not self.allowed(round_idx)[idx].all():
            raise RuntimeError(f"round {round_idx}: a refused device was about to be recorded")
        self.last[idx] = round_idx
        self.count[idx] += 1


@dataclass(frozen=True)
class Selection:
    """The devices of one round and when it starts on the simulated clock."""

    round: int
    devices: list[int]  # indices into the fleet, ascending
    slot: int  # clock slot (round durations since the start) at which the round starts
    waited_slots: int  # slots spent waiting because too few devices were accepted
    refused: int  # devices that checked in but the guard refused (summed over the waits)


class Participation:
    """Selects each round's devices under the configured mode and enforces the guard."""

    def __init__(self, section: ParticipationSection, size: int, report_goal: int, rounds: int,
                 seed: int, fleet: EmulatedFleet | None = None):
        if report_goal > size:
            raise DpfleetError(f"dp.report_goal={report_goal} exceeds the {size} training clients")
        if section.mode == "disjoint" and rounds * report_goal > size:
            raise DpfleetError(
                f"disjoint participation needs rounds * report_goal = {rounds * report_goal} "
                f"clients but there are {size}; lower rounds or dp.report_goal, or set "
                "participation.mode = 'uniform' or 'timer'"
            )
        self.section, self.size, self.report_goal, self.seed = section, size, report_goal, seed
        self.fleet = fleet
        if section.mode == "timer" and fleet is None:
            self.fleet = EmulatedFleet(
                size, section.timer_period, section.round_minutes,
                Availability(section.availability, section.diurnal_amplitude), seed,
            )
        mins = section.min_separation
        if mins < 0:  # default: what the timer nominally gives (no waiting), else no refusal
            mins = self.fleet.timer_slots - 1 if section.mode == "timer" else 0
        self.guard = ParticipationGuard(size, max(mins, 0), section.max_participation)
        self.slot = 0
        self._order = np.random.default_rng([seed, 0x5A]).permutation(size)

    @property
    def min_separation(self) -> int:
        """The MinS the coordinator enforces (rounds strictly between participations)."""
        return self.guard.min_separation

    def hours(self, slot: int) -> float:
        return slot * self.section.round_minutes / 60.0

    def propose(self, round_idx: int, available: np.ndarray | None = None, extra: int = 0
                ) -> Selection:
        """The devices for round `round_idx` (state changes only in `commit`). A networked
        coordinator passes the devices that checked in (`available`, indices) and `extra`
        over-selected ones; with everyone available and no extra the draw is the simulation's."""
        allowed = self.guard.allowed(round_idx)
        if available is not None:
            allowed &= np.isin(np.arange(self.size), available)
        m = self.report_goal
        if int(allowed.sum()) < m:
            raise RoundUnfillable(
                f"only {int(allowed.sum())} devices may take part in round {round_idx} under "
                f"MinS {self.guard.min_separation} / MaxP {self.guard.max_participation or 'any'}; "
                f"the report goal is {m}"
            )
        mode = self.section.mode
        if mode == "disjoint":
            chosen = self._order[round_idx * m : (round_idx + 1) * m]
            return Selection(round_idx, sorted(chosen.tolist()), self.slot, 0, 0)
        if mode == "uniform":
            rng = np.random.default_rng([self.seed, 0x5B, round_idx])
            pool = np.flatnonzero(allowed)
            chosen = rng.choice(pool, min(m + extra, pool.size), replace=False)
            return Selection(round_idx, sorted(chosen.tolist()), self.slot, 0, 0)
        if available is not None:  # timer: the devices' own timers decided who checked in
            rng = np.random.default_rng([self.seed, 0x5C, round_idx])
            pool = np.flatnonzero(allowed)
            chosen = rng.choice(pool, min(m + extra, pool.size), replace=False)
            return Selection(round_idx, sorted(chosen.tolist()), self.slot, 0, 0)
        return self._propose_timer(round_idx, allowed)

    def _propose_timer(self, round_idx: int, allowed: np.ndarray) -> Selection:
        max_wait = int(MAX_WAIT_DAYS * 24 * 60 / self.section.round_minutes)
        slot, refused = self.slot, 0
        while True:
            checked_in = self.fleet.check_in(slot)
            accepted = checked_in[allowed[checked_in]]
            refused += checked_in.size - accepted.size
            if accepted.size >= self.report_goal:
                break
            if slot - self.slot >= max_wait:
                raise RoundUnfillable(
                    f"round {round_idx} could not be filled within {MAX_WAIT_DAYS} simulated days "
                    f"(at most {accepted.size} of the report goal {self.report_goal} checked in); "
                    "raise participation.availability or lower the timer period"
                )
            slot += 1
        rng = np.random.default_rng([self.seed, 0x5C, round_idx])
        chosen = rng.choice(accepted, self.report_goal, replace=False)
        return Selection(round_idx, sorted(chosen.tolist()), slot, slot - self.slot, refused)

    def commit(self, selection: Selection, contributed: list[int]) -> None:
        """The round ran: record who contributed, start the selected devices' timers, tick."""
        self.guard.record(contributed, selection.round)
        if self.fleet is not None:
            self.fleet.took_part(selection.devices, selection.slot)
        self.slot = selection.slot + 1
