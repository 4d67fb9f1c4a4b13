"""Who takes part in each round, and the coordinator's refusal of devices that would break MinS.

Modes (`[participation] mode`):
  disjoint  one seeded permutation cut into blocks of the report goal (paper 000 App. C): each
            device takes part at most once, so single-participation accounting applies.
  uniform   a fresh seeded draw of report-goal devices each round among those the guard allows.
  timer     paper 002 Sec. 2.2: the devices (`[devices]`, edge/devices.py `SlottedDevices`)
            check in when their own timer has expired and they are available; the coordinator
            takes the report goal from the devices it accepts (a seeded draw) and, when too few
            are accepted, waits one slot (a round's duration) on the simulated clock and tries
            again. With `devices.trace` the devices are available when the trace says so
            (edge/traces.py `TraceReplay`); a selected device drops out of the round with the
            trace's failure chance or a phase's `devices.dropout_*`: it is not trained and not in
            the sum, its timer still starts.
            Rounds close as production's do (Bonawitz et al. 2019): the coordinator over-selects
            (`over_selection`), each selected device reports after its training time (speed
            class x seeded jitter), the round closes at the report goal or the deadline, and only
            the first report-goal finishers are trained and summed; a round short of `min_reports`
            is abandoned and retried one slot later (`Participation._propose_timer`).

Defence in depth: whatever the devices' timers do, `ParticipationGuard` refuses a device that
would have fewer than `min_separation` rounds strictly between two of its participations (the
accountant's MinS convention) or more than `max_participation` participations. The timer alone
cannot promise a MinS in *rounds*: it separates participations in time, and a round that had to
wait for devices stretches time, so fewer rounds fit into one timer period. The accountant reads
the participation log, never this module's state, so a bug here cannot hide a participation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dpfleet.coordinator.config import ParticipationSection, over_selected
from dpfleet.edge.devices import DevicesSection, SlottedDevices
from dpfleet.errors import DpfleetError

NEVER = -(1 << 40)  # "last participation" of a device that never took part
MAX_WAIT_DAYS = 30  # a round that cannot be filled within this much simulated time ends the run


class RoundUnfillable(Exception):
    """No round can start: too few devices may take part (the run stops cleanly)."""


class ParticipationGuard:
    """The coordinator's own record of participation: refuses devices that would break MinS/MaxP.

    Besides the per-device arrays it keeps the devices of the last MinS rounds and the ones at
    their MaxP cap, so the refused set of a round (`blocked`) costs O(recent participants), not
    O(population): a million-device round is selected without a million-entry mask."""

    def __init__(self, size: int, min_separation: int, max_participation: int = 0):
        if min_separation < 0 or max_participation < 0:
            raise DpfleetError("min_separation and max_participation must be >= 0")
        self.min_separation, self.max_participation = min_separation, max_participation
        self.last = np.full(size, NEVER, dtype=np.int64)
        self.count = np.zeros(size, dtype=np.int64)
        self._by_round: dict[int, np.ndarray] = {}  # round -> devices recorded in it (MinS window)
        self._kept_from = NEVER  # rounds before this were dropped from _by_round
        self._exhausted: set[int] = set()  # devices at their MaxP cap

    def allowed(self, round_idx: int) -> np.ndarray:
        """Boolean mask of the devices that may take part in round `round_idx`."""
        return self.allows(slice(None), round_idx)

    def allows(self, devices: np.ndarray | slice, round_idx: int) -> np.ndarray:
        """`allowed(round_idx)[devices]`, computed for those devices only (the one MinS/MaxP rule)."""
        ok = round_idx - self.last[devices] - 1 >= self.min_separation
        if self.max_participation:
            ok &= self.count[devices] < self.max_participation
        return ok

    def admits(self, device: int, round_idx: int) -> bool:
        """`allowed(round_idx)[device]` in O(1): what a networked check-in asks."""
        return bool(self.allows(slice(device, device + 1), round_idx)[0])

    def blocked(self, round_idx: int) -> np.ndarray:
        """Sorted devices refused in round `round_idx` (the complement of `allowed`)."""
        if round_idx - self.min_separation < self._kept_from:  # window pruned: scan everyone
            return np.flatnonzero(~self.allowed(round_idx))
        recent = [d for q, d in self._by_round.items() if q >= round_idx - self.min_separation]
        candidates = np.unique(np.concatenate(
            [*recent, np.fromiter(self._exhausted, np.int64, len(self._exhausted)),
             np.zeros(0, np.int64)]))
        return candidates[~self.allows(candidates, round_idx)]

    def record(self, devices: list[int], round_idx: int) -> None:
        idx = np.asarray(devices, dtype=np.int64)
        if idx.size and not self.allows(idx, round_idx).all():
            raise RuntimeError(f"round {round_idx}: a refused device was about to be recorded")
        self.last[idx] = round_idx
        self.count[idx] += 1
        self._by_round[round_idx] = np.concatenate([self._by_round.get(round_idx, idx[:0]), idx])
        keep = max(self._by_round) + 1 - self.min_separation  # the next round's window starts here
        if keep > self._kept_from:
            self._by_round = {q: d for q, d in self._by_round.items() if q >= keep}
            self._kept_from = keep
        if self.max_participation:
            self._exhausted.update(idx[self.count[idx] >= self.max_participation].tolist())


@dataclass(frozen=True)
class Selection:
    """The devices of one round and when it starts on the simulated clock."""

    round: int
    devices: list[int]  # indices into the population, ascending
    slot: int  # clock slot (round durations since the start) at which the round starts
    waited_slots: int  # slots spent waiting because too few devices were accepted
    refused: int  # devices that checked in but the guard refused (summed over the waits)
    dropped: list[int] = field(default_factory=list)  # selected, then dropped out (trace failure)
    late: list[int] = field(default_factory=list)  # selected, finished after the deadline
    over_goal: list[int] = field(default_factory=list)  # finished after the goal: told to stop
    minutes: float | None = None  # the round's simulated duration (None: not timed, not timer mode)
    # attempts abandoned before this one (too few reports by the deadline): (slot, selected devices)
    abandoned: tuple[tuple[int, tuple[int, ...]], ...] = ()
    attempt: int = 0  # timer mode: selections tried before this one in the round (the dropout draws' key)

    @property
    def selected(self) -> list[int]:
        """Every device the round selected: reported, dropped, missed the deadline or over the goal."""
        return sorted(self.devices + self.dropped + self.late + self.over_goal)

    def outcome(self) -> dict:
        """The round's fields in metrics.jsonl (timer mode; {} otherwise): what happened to the
        devices it selected, the attempts it abandoned and its simulated duration."""
        if self.minutes is None:
            return {}
        return {"selected": len(self.selected), "failed": len(self.dropped),
                "missed_deadline": len(self.late), "over_goal": len(self.over_goal),
                "committed": len(self.devices), "abandoned": len(self.abandoned),
                "abandoned_selected": sum(len(d) for _, d in self.abandoned),
                "round_duration_minutes": self.minutes}


@dataclass(frozen=True)
class Close:
    """How one timer-mode round closes (`round_close`): positions into the selected devices."""

    committed: np.ndarray  # the first report-goal finishers (or every one in time)
    late: np.ndarray  # finished after the deadline
    over_goal: np.ndarray  # finished after the goal was reached
    minutes: float  # when the round closed, minutes after it opened


def round_close(finish: np.ndarray, goal: int, deadline: float) -> Close:
    """Production's close (Bonawitz et al. 2019, Sec. 2): the round ends when `goal` devices have
    reported or at `deadline` (minutes; 0: none), whichever comes first. `finish[i]`: when selected
    device i reports (inf: it dropped). The first `goal` finishers commit (ties: the earlier
    position, i.e. the lower device); whoever finishes later is told to stop and is over the goal
    when the goal was reached, else it missed the deadline. Without a deadline and short of the
    goal, the round closes when its last reporter finishes."""
    finish = np.asarray(finish, dtype=np.float64)
    limit = deadline if deadline > 0 else np.inf
    order = np.argsort(finish, kind="stable")
    reports = np.isfinite(finish)
    in_time = order[reports[order] & (finish[order] <= limit)]  # reporters in time, by time
    committed = np.sort(in_time[:goal])
    if committed.size == goal:
        closes = float(finish[in_time[goal - 1]]) if goal else 0.0
        late = np.zeros(0, dtype=np.int64)
    else:
        closes = deadline if deadline > 0 else float(finish[committed].max(initial=0.0))
        late = np.flatnonzero(reports & (finish > limit))
    rest = np.flatnonzero(reports)
    over = np.setdiff1d(rest, np.concatenate([committed, late]))
    return Close(committed, late, over, closes)


class Eligible:
    """The devices the guard allows in one round, in ascending order, without materialising them
    (a million-device fleet): what a `dpfleet.extensions.ParticipationPolicy` chooses from.

    Devices are indices into the population; `users[i]` (or `keys(devices)`) is device i's user
    key: the key you gave in `dpfleet.simulate(users=...)`, or the dataset's user id (e.g. a
    Shakespeare play and speaker). A policy may choose by key; the guard still checks every
    choice and the accountant reads who took part, so a name never changes the guarantee."""

    def __init__(self, size: int, blocked: np.ndarray, pool: np.ndarray | None = None,
                 users: Sequence[str] | None = None):
        """`blocked`: sorted devices the guard refuses; `pool`: the devices that checked in and are
        not blocked (None: every device not blocked); `users`: each device's user key (None: the
        index as a string)."""
        self.blocked, self.pool = blocked, pool
        self.count = size - blocked.size if pool is None else pool.size
        self.users: Sequence[str] = users if users is not None else _IndexKeys(size)

    def keys(self, devices: Sequence[int] | np.ndarray) -> list[str]:
        """The user keys of `devices` (indices, e.g. from `at`), in the same order."""
        return [self.users[int(d)] for d in np.asarray(devices).reshape(-1)]

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The eligible devices at `positions` (0 <= position < count) of the ascending list."""
        positions = np.asarray(positions, dtype=np.int64)
        return self.pool[positions] if self.pool is not None else nth_unblocked(self.blocked, positions)


class _IndexKeys(Sequence[str]):
    """Device i's key when no user keys were given: "i"."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [str(j) for j in range(self.size)[i]]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        return str(i % self.size)


class UniformPolicy:
    """Built-in `ParticipationPolicy`: a seeded uniform draw without replacement among the
    eligible devices (`participation.mode = "uniform"`; with `tag` 0x5C the networked timer mode's
    draw among the devices that checked in)."""

    def __init__(self, seed: int, tag: int = 0x5B):
        self.seed, self.tag = seed, tag

    def select(self, round_idx: int, eligible: Eligible, count: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.tag, round_idx])
        return eligible.at(rng.choice(eligible.count, count, replace=False))


class DisjointPolicy:
    """Built-in `ParticipationPolicy`: one seeded permutation cut into blocks of the report goal
    (`participation.mode = "disjoint"`): each device at most once."""

    def __init__(self, size: int, seed: int):
        self.order = np.random.default_rng([seed, 0x5A]).permutation(size)

    def select(self, round_idx: int, eligible: Eligible, count: int) -> np.ndarray:
        return self.order[round_idx * count : (round_idx + 1) * count]


class Participation:
    """Selects each round's devices under the configured mode and enforces the guard."""

    def __init__(self, section: ParticipationSection, size: int, report_goal: int, rounds: int,
                 seed: int, slotted: SlottedDevices | None = None, policy=None,
                 users: Sequence[str] | None = None, end_slot: int | None = None,
                 devices: DevicesSection | None = None):
        """`policy`: a caller's `dpfleet.extensions.ParticipationPolicy` in place of the mode's
        built-in draw (uniform mode only); its choice is checked against the guard every round.
        `users`: each device's user key, which the policy sees (`Eligible.users`).
        `end_slot`: timer mode, a launch's end (the planner's replay): no round starts at or after
        this slot, so a round that cannot fill before it fails there instead of scanning up to
        `MAX_WAIT_DAYS` of a large trace. None: a run waits as long as that.
        `devices`: how the devices behave in timer mode (the config's `[devices]`; default: always
        available, no trace, no dropout)."""
        if policy is not None and section.mode != "uniform":
            raise DpfleetError(f"a custom participation policy runs with participation.mode = "
                               f"'uniform' (its guard's MinS / MaxP apply), not {section.mode!r}")
        if report_goal > size:
            raise DpfleetError(f"dp.report_goal={report_goal} exceeds the {size} training clients")
        if section.mode == "disjoint" and rounds * report_goal > size:
            raise DpfleetError(
                f"disjoint participation needs rounds * report_goal = {rounds * report_goal} "
                f"clients but there are {size}; lower rounds or dp.report_goal, set "
                "participation.mode = 'uniform' or 'timer', or state dp.target_epsilon and let "
                "the planner choose"
            )
        self.section, self.size, self.report_goal, self.seed = section, size, report_goal, seed
        self.end_slot = end_slot
        self.slotted, self.users = slotted, users
        self.devices = devices if devices is not None else (
            slotted.section if slotted is not None else DevicesSection())
        if section.mode == "timer" and slotted is None:
            self.slotted = SlottedDevices.from_section(self.devices, size, section.timer_period,
                                                     section.round_minutes, seed)
        mins = section.min_separation
        if mins < 0:  # default: what the timer nominally gives (no waiting), else no refusal
            mins = self.slotted.timer_slots - 1 if section.mode == "timer" else 0
        self.guard = ParticipationGuard(size, max(mins, 0), section.max_participation)
        self.slot = 0
        self.policy = policy if policy is not None else (
            DisjointPolicy(size, seed) if section.mode == "disjoint" else UniformPolicy(seed))
        self._timer_draw = UniformPolicy(seed, 0x5C)  # timer mode among the devices that checked in
        # timer mode's over-selection, the service's rule (`over_selected`): exactly the goal at 1
        self.round_size = over_selected(report_goal, section.over_selection - 1.0)
        # an empty sum is never committed; above the goal (a planner trying smaller report goals
        # with a run's section; a config is refused) it means the goal: no commit below it
        self.min_reports = min(max(section.min_reports, 1), report_goal)

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
        blocked = self.guard.blocked(round_idx)  # O(recent participants), not O(population)
        pool = None  # None: every device not blocked (never materialised)
        if available is not None:
            available = np.unique(available[(available >= 0) & (available < self.size)])
            pool = available[~np.isin(available, blocked, assume_unique=True)]
        n_allowed = self.size - blocked.size if pool is None else pool.size
        m = self.report_goal
        if n_allowed < m:
            raise RoundUnfillable(
                f"only {n_allowed} devices may take part in round {round_idx} under "
                f"MinS {self.guard.min_separation} / MaxP {self.guard.max_participation or 'any'}; "
                f"the report goal is {m}"
            )
        mode = self.section.mode
        if mode == "timer" and available is None:
            return self._propose_timer(round_idx, self.guard.allowed(round_idx))  # the devices scan all
        # timer + available: the devices' timers decided who checked in, a uniform draw among them.
        # Drawing positions in the allowed pool by count gives the same devices as rng.choice over
        # the pool array did (numpy draws positions either way)
        policy = self._timer_draw if mode == "timer" else self.policy
        count = m if mode == "disjoint" else min(m + extra, n_allowed)
        chosen = policy.select(round_idx, Eligible(self.size, blocked, pool, self.users), count)
        devices = check_selection(chosen, count, self.size, blocked, pool, round_idx)  # every policy
        return Selection(round_idx, devices, self.slot, 0, 0)

    def _propose_timer(self, round_idx: int, allowed: np.ndarray) -> Selection:
        """Production's round (Bonawitz et al. 2019): select `round_size` of the devices that
        checked in, let each report at its finishing time or drop, close at the goal or the
        deadline (`round_close`). A round short of `min_reports` is abandoned and retried one slot
        later; its devices took part from their own view (they trained), so their timers start
        (conservative: a device never checks in sooner than a real one would). An attempt in
        which every selected device dropped is retried as it always was, without starting
        timers: the runs made before over-selection replay (and resume) exactly. Propose changes
        no state: the abandoned attempts ride in the selection, and `commit` starts their timers;
        meanwhile those devices stay away from the retries (`busy`)."""
        section = self.section
        max_wait = int(MAX_WAIT_DAYS * 24 * 60 / section.round_minutes)
        slot, refused = self.slot, 0
        abandoned: list[tuple[int, tuple[int, ...]]] = []
        attempt = 0  # selections tried in this round (the phases' dropout draws' key)
        busy = np.zeros(0, dtype=np.int64)  # devices of abandoned attempts whose timers run
        busy_until = np.zeros(0, dtype=np.int64)
        while True:
            if self.end_slot is not None and slot >= self.end_slot:
                raise RoundUnfillable(f"round {round_idx} did not fill before the launch's end "
                                      f"(slot {self.end_slot})")
            checked_in = self.slotted.check_in(slot)
            if busy.size:
                checked_in = checked_in[~np.isin(checked_in, busy[busy_until > slot])]
            accepted = checked_in[allowed[checked_in]]
            refused += checked_in.size - accepted.size
            if accepted.size >= self.report_goal:
                rng = np.random.default_rng([self.seed, 0x5C, round_idx])
                size = min(self.round_size, accepted.size)
                chosen = np.sort(rng.choice(accepted, size, replace=False))
                drops = self.slotted.drops(chosen, round_idx, slot, attempt)
                attempt += 1
                finish = self.slotted.finish_minutes(chosen, round_idx, slot, self.devices.train_minutes,
                                                   self.devices.train_jitter)
                close = round_close(np.where(drops, np.inf, finish), self.report_goal,
                                    section.deadline_minutes)
                if close.committed.size >= self.min_reports:
                    return Selection(round_idx, chosen[close.committed].tolist(), slot,
                                     slot - self.slot, refused, chosen[drops].tolist(),
                                     chosen[close.late].tolist(), chosen[close.over_goal].tolist(),
                                     close.minutes, tuple(abandoned), attempt - 1)
                if not drops.all():  # abandoned: try again one slot later, these devices' timers run
                    abandoned.append((slot, tuple(chosen.tolist())))
                    busy = np.concatenate([busy, chosen])
                    busy_until = np.concatenate([busy_until, np.full(size, slot + self.slotted.timer_slots)])
            if slot - self.slot >= max_wait and abandoned:
                raise RoundUnfillable(
                    f"round {round_idx} was abandoned {len(abandoned)} times in {MAX_WAIT_DAYS} "
                    f"simulated days: fewer than participation.min_reports = {self.min_reports} "
                    "devices reported by the deadline; raise deadline_minutes or over_selection, "
                    "or lower min_reports"
                )
            if slot - self.slot >= max_wait:
                hint = ("the trace has too few devices available" if self.slotted.trace is not None
                        else "raise devices.availability")
                raise RoundUnfillable(
                    f"round {round_idx} could not be filled within {MAX_WAIT_DAYS} simulated days "
                    f"(at most {accepted.size} of the report goal {self.report_goal} checked in); "
                    f"{hint} or lower the timer period"
                )
            slot += 1

    def commit(self, selection: Selection, contributed: list[int]) -> None:
        """The round ran: record who contributed, start the selected devices' timers, tick."""
        self.guard.record(contributed, selection.round)
        if self.slotted is not None:
            for slot, devices in selection.abandoned:  # they trained for a round that never closed
                self.slotted.took_part(list(devices), slot)
            self.slotted.took_part(selection.selected, selection.slot)
        self.slot = selection.slot + 1


def check_selection(chosen: object, count: int, size: int, blocked: np.ndarray, pool: np.ndarray | None,
                    round_idx: int) -> list[int]:
    """A policy's choice, checked before anything is trained or released: exactly `count` distinct
    devices, each one the guard allows (and, networked, one that checked in). A duplicate would
    count one user twice in a sum whose sensitivity assumes once; a refused one breaks MinS / MaxP.
    Returns the devices ascending; anything else is one `DpfleetError` naming the device."""
    try:
        arr = np.asarray(chosen).reshape(-1)
    except Exception:  # a caller's object
        arr = np.zeros(0)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DpfleetError(f"round {round_idx + 1}: the participation policy must return device "
                           f"indices (ints), got {arr.dtype}")
    devices = np.sort(arr.astype(np.int64))
    where = f"round {round_idx + 1}: the participation policy"
    if devices.size != count:
        raise DpfleetError(f"{where} chose {devices.size} devices, the round needs {count}")
    if devices.size and (devices[0] < 0 or devices[-1] >= size):
        bad = devices[0] if devices[0] < 0 else devices[-1]
        raise DpfleetError(f"{where} chose device {bad}, not in [0, {size})")
    twice = devices[1:][devices[1:] == devices[:-1]]
    if twice.size:
        raise DpfleetError(f"{where} chose device {twice[0]} more than once (its update would count "
                           "twice in a sum whose sensitivity assumes once)")
    refused = devices[np.isin(devices, blocked)]
    if refused.size:
        raise DpfleetError(f"{where} chose device {refused[0]}, which the guard refuses in this round "
                           "(it would break the enforced MinS / MaxP)")
    if pool is not None and not np.isin(devices, pool).all():
        raise DpfleetError(f"{where} chose device {devices[~np.isin(devices, pool)][0]}, which did not "
                           "check in")
    return devices.tolist()


def nth_unblocked(blocked: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The devices at `positions` in the ascending list of devices not in sorted `blocked`
    (what `np.flatnonzero(~mask)[positions]` gives, in O(len(positions) log len(blocked)))."""
    shift = blocked - np.arange(blocked.size)  # unblocked devices before each blocked one
    return positions + np.searchsorted(shift, positions, side="right")
