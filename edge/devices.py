"""One model of a device: when it may train, its participation timer, its speed and link, and
whether it drops out in each phase of a round. `simulate`'s timer mode (`SlottedDevices`, a whole
population on a slotted clock) and the emulated fleet (`Behaviour`, one device on a continuous
clock, fleet/) both read it from the config's `[devices]` section (`DevicesSection`).

Paper 002 (Sec. 2.2) limits how often a device takes part with a timer *on the device*: after it
takes part it does not check in again until a period has passed. Whether an eligible device
checks in also depends on its conditions (charging, idle, unmetered network; Bonawitz et al.
2019). Availability is one of:

* a replayed trace (`devices.trace`, edge/traces.py `TraceReplay`): a device is available exactly
  inside its intervals, trains at its speed class's multiplier and fails with its failure chance;
* otherwise two factors that both must hold, each a no-op at its default: the simple model, a
  probability that may follow the time of day (`availability`, `diurnal_amplitude`), drawn per
  round slot; and the charging model, a nightly charging window in the device's local time with
  seeded idle / unmetered draws per condition slot (`charging_hours`, `idle`, `unmetered`).

Why every draw is keyed, never a shared stream: a run must replay, and a device's behaviour must
not depend on who else is simulated or which worker process owns it. The simple model's draw for
device d at slot s is element d of the stream seeded (seed, 0xA7, s), and a phase's dropout is
drawn per (seed, device, round, attempt, phase), so `simulate` and the fleet decide the same for
the same device and round (tests/test_device_model.py), SecAgg's phases included (`secagg_drops`,
tests/test_service_parity.py). One exception is kept for replay: by default
(`failure_draws = "round"`) a trace's failure chance in `simulate` is drawn per (round, slot)
over the selected devices, as recorded runs drew it; "device" draws it as the fleet does.

`simulate`'s clock counts slots of one round's duration: the coordinator starts a round (or,
when it cannot fill one, retries) once per slot, so every comparison is exact. A timer of P
hours lasts ceil(P * 60 / round_minutes) slots. The fleet's clock is simulated seconds
(fleet/clock.py), on which the same timer is a `DeviceTimer`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from dpfleet.edge.traces import SPEED_MULTIPLIER, TraceReplay, load_replay
from dpfleet.errors import DpfleetError

PLAIN_PHASES = ("download", "train", "report")  # any other phase name is a SecAgg phase


@dataclass(frozen=True)
class DevicesSection:
    """How the devices behave, for `simulate`'s timer mode and the emulated fleet alike
    (edge/devices.py); times are simulated."""

    trace: str = ""
    """An availability trace (docs/traces.md) replayed in place of the availability and charging
    keys: client i is trace device i mod the trace's devices, the trace repeats after its
    duration, and a device that joins a round drops out with its failure chance. "": no trace."""
    failure_draws: str = "round"
    """How `simulate` draws a trace's failure chance: "round", per (round, slot) over the selected
    devices, as runs before [devices] drew it; "device", per (device, round, attempt), the draw
    the emulated fleet makes, so both drop the same devices."""
    availability: float = 1.0
    """The chance that a device is available at a round slot (drawn per slot)."""
    diurnal_amplitude: float = 0.0
    """0: flat availability; up to 1, availability peaks at 2 am."""
    charging_hours: float = 24.0
    """Length of each device's nightly charging window (24: always charging)."""
    charging_start: float = 22.0
    """Mean local hour the window starts (each device: +- 1.5 h)."""
    timezone_spread: float = 0.0
    """Devices' local clocks spread uniformly over this many hours."""
    idle: float = 1.0
    """The chance the phone is idle, per condition slot, while charging."""
    unmetered: float = 1.0
    """The chance of an unmetered network, per condition slot."""
    condition_minutes: float = 15.0
    """How long one draw of idle / unmetered lasts."""
    train_minutes: float = 2.0
    """Timer mode: the reference ("mid") device's simulated time to train and report; a device
    finishes after this x its speed class's multiplier (a trace's; "mid" without one) x a seeded
    LogNormal(0, train_jitter) jitter."""
    train_jitter: float = 0.25
    """Timer mode: sigma of the LogNormal jitter on each device's finishing time (0: none)."""
    speed_sigma: float = 0.3
    """The emulated fleet's training time multiplier ~ LogNormal(0, speed_sigma) (median 1)."""
    bandwidth_mbps: float = 20.0
    """Median link bandwidth (LogNormal, sigma link_sigma)."""
    latency_ms: float = 50.0
    """Median one-way latency added around each transfer (LogNormal, sigma link_sigma)."""
    link_sigma: float = 0.5
    """The spread of each device's bandwidth and latency around their medians."""
    dropout_download: float = 0.0
    """The chance a device vanishes while downloading the round's model."""
    dropout_train: float = 0.0
    """The chance a device vanishes while training."""
    dropout_report: float = 0.0
    """The chance a device vanishes while reporting its update."""
    dropout_secagg: float = 0.0
    """The chance a device vanishes before each of its SecAgg messages' phases (commit, advertise,
    share, mask, consistency in signed mode, unmask), in `simulate` as in the emulated fleet."""

    def charging_model(self) -> bool:
        """Whether the charging window or the idle / unmetered draws can make a device unavailable."""
        return self.charging_hours < 24 or self.idle < 1 or self.unmetered < 1

    def dropout_chance(self, phase: str) -> float:
        """The configured chance of vanishing at `phase` (a trace's failure comes on top in "train")."""
        return {"download": self.dropout_download, "train": self.dropout_train,
                "report": self.dropout_report}.get(phase, self.dropout_secagg)


@dataclass(frozen=True)
class Availability:
    """Probability that a device can check in (charging, idle, unmetered) at a given hour.

    p(hour) = probability * (1 + diurnal_amplitude * cos(2 pi (hour - peak_hour) / 24)), clipped
    to [0, 1]: flat when the amplitude is 0, most devices available around `peak_hour` (night
    charging) otherwise. The mean over a day is `probability` while no clipping occurs.
    """

    probability: float = 1.0
    diurnal_amplitude: float = 0.0
    peak_hour: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 < self.probability <= 1.0:
            raise DpfleetError(f"availability must be in (0, 1], got {self.probability}")
        if not 0.0 <= self.diurnal_amplitude <= 1.0:
            raise DpfleetError(f"diurnal amplitude must be in [0, 1], got {self.diurnal_amplitude}")

    def at(self, hour: float) -> float:
        wave = math.cos(2.0 * math.pi * (hour - self.peak_hour) / 24.0)
        return min(1.0, max(0.0, self.probability * (1.0 + self.diurnal_amplitude * wave)))


def slot_draws(seed: int, slot: int, count: int) -> np.ndarray:
    """The simple model's uniform draws of devices 0..count-1 at round slot `slot`: device d's is
    element d whatever `count` (> d), so one device alone draws what the population does."""
    return np.random.default_rng([seed, 0xA7, slot]).random(count)


def _phase_tag(phase: str) -> int:
    return int.from_bytes(hashlib.sha256(phase.encode()).digest()[:4], "little")


def drop_draw(seed: int, device: int, round_idx: int, attempt: int, phase: str) -> float:
    """The uniform draw that decides whether `device` vanishes at `phase` of (round, attempt)."""
    return float(np.random.default_rng(
        [seed, 0xF2, device, round_idx, attempt, _phase_tag(phase)]).random())


def secagg_drops(section: DevicesSection, seed: int, devices: list[int], round_number: int,
                 attempt: int, phases: tuple[str, ...]) -> dict[str, list[int]]:
    """{phase: positions} of `devices` (a SecAgg round's, in position order) that vanish before
    their message of `phase`, each at the first of `phases` (in protocol order) whose draw says so:
    the draw an emulated device makes before each message (`Behaviour.drops`, keyed by the
    service's 1-based round number and attempt), so `simulate` drops the devices, attempts and
    phases the fleet does."""
    chance = section.dropout_secagg
    gone: dict[str, list[int]] = {}
    if chance <= 0:
        return gone
    for position, device in enumerate(devices):
        for phase in phases:
            if drop_draw(seed, int(device), round_number, attempt, phase) < chance:
                gone.setdefault(phase, []).append(position)
                break
    return gone


@dataclass
class DeviceTimer:
    """One device's participation timer on the fleet's continuous clock (simulated seconds): away
    `period` after taking part (`timer_slots` is the same timer on `simulate`'s slotted clock)."""

    period: float
    last: float | None = None  # simulated time it was last assigned to a round

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period) and self.period >= 0):
            raise DpfleetError(f"timer period must be >= 0 seconds, got {self.period}")

    def expires_at(self) -> float | None:
        return None if self.last is None else self.last + self.period

    def expired(self, sim_t: float) -> bool:
        # elapsed >= period, not sim_t >= last + period: the sum can round down onto sim_t
        return self.last is None or sim_t - self.last >= self.period

    def remaining(self, sim_t: float) -> float:
        if self.expired(sim_t):
            return 0.0
        return max(self.period - (sim_t - self.last), math.ulp(sim_t))

    def start(self, sim_t: float) -> None:
        if self.last is not None and sim_t < self.last:
            raise RuntimeError("a device timer cannot be restarted in the past")
        self.last = sim_t


def timer_slots(timer_hours: float, slot_minutes: float) -> int:
    """How many round slots a timer of `timer_hours` keeps a device away (rounded up)."""
    if not (slot_minutes > 0 and math.isfinite(slot_minutes)):
        raise DpfleetError(f"round duration must be positive minutes, got {slot_minutes}")
    if not (timer_hours >= 0 and math.isfinite(timer_hours)):
        raise DpfleetError(f"timer period must be >= 0 hours, got {timer_hours}")
    # the epsilon absorbs float noise such as 24 h / 7.2 min = 200.00000000000003 slots
    return math.ceil(timer_hours * 60.0 / slot_minutes - 1e-9)


class SlottedDevices:
    """`simulate`'s devices on its slotted clock: when each timer expires, and who is available."""

    def __init__(self, size: int, timer_hours: float, slot_minutes: float,
                 availability: Availability, seed: int, trace: TraceReplay | None = None,
                 section: DevicesSection | None = None):
        """`trace`: replayed in place of `availability`'s draw (which is then not used); `section`:
        the charging model and the phases' dropout chances (default: none)."""
        if size < 1:
            raise DpfleetError("a fleet needs at least one device")
        self.size, self.slot_minutes, self.availability = size, slot_minutes, availability
        self.timer_slots = timer_slots(timer_hours, slot_minutes)
        self.seed, self.trace = seed, trace
        self.section = section if section is not None else DevicesSection()
        self.ready_slot = np.zeros(size, dtype=np.int64)  # first slot each device may check in
        self._devices: list[Behaviour] | None = None  # the charging model's, made when first asked

    @classmethod
    def from_section(cls, section: DevicesSection, size: int, timer_hours: float, slot_minutes: float,
                     seed: int) -> SlottedDevices:
        """The `size` devices `section` describes, its trace (if any) loaded for them."""
        trace = load_replay(section.trace, size) if section.trace else None
        return cls(size, timer_hours, slot_minutes,
                   Availability(section.availability, section.diurnal_amplitude), seed, trace, section)

    def hour_of(self, slot: int) -> float:
        return (slot * self.slot_minutes / 60.0) % 24.0

    def available(self, slot: int) -> np.ndarray:
        """Boolean mask: devices whose conditions allow training at `slot` (seeded per slot), or
        inside one of their trace intervals at the slot's start."""
        t = slot * self.slot_minutes * 60.0
        if self.trace is not None:
            return self.trace.eligible(t)
        mask = slot_draws(self.seed, slot, self.size) < self.availability.at(self.hour_of(slot))
        if self.section.charging_model():  # one device at a time: O(population) per slot
            if self._devices is None:
                self._devices = [Behaviour(self.section, self.seed, d) for d in range(self.size)]
            hour = self.hour_of(slot)
            mask &= np.fromiter((b.in_conditions(t, hour) for b in self._devices), bool, self.size)
        return mask

    def check_in(self, slot: int) -> np.ndarray:
        """Indices of devices that check in at `slot`: timer expired and available."""
        return np.flatnonzero((self.ready_slot <= slot) & self.available(slot))

    def drops(self, devices: np.ndarray | list[int], round_idx: int, slot: int, attempt: int = 0
              ) -> np.ndarray:
        """Which of `devices`, selected for attempt `attempt` (0-based) of round `round_idx`
        (0-based) at `slot`, drop out before reporting: in any plain phase by its dropout chance
        (the draws `Behaviour` makes), or by the trace's failure chance: drawn per (round, slot)
        over `devices` by default (module docstring: as recorded runs drew it), else as
        `Behaviour` draws it."""
        devices = np.asarray(devices, dtype=np.int64)
        dropped = np.zeros(devices.size, dtype=bool)
        shared = self.trace is not None and self.section.failure_draws == "device"
        if self.trace is not None and not shared:
            draws = np.random.default_rng([self.seed, 0xA8, round_idx, slot]).random(devices.size)
            dropped = draws < self.trace.failure(devices)
        for phase in PLAIN_PHASES:
            chance = np.full(devices.size, self.section.dropout_chance(phase))
            if shared and phase == "train":  # the larger of the two, as `Behaviour.dropout_chance`
                chance = np.maximum(chance, self.trace.failure(devices))
            for i in np.flatnonzero(chance > 0):
                # keyed as the service numbers rounds and attempts (from 1), which is what a fleet
                # device's `Behaviour.drops` is given: the same device drops in the same round
                dropped[i] |= drop_draw(self.seed, int(devices[i]), round_idx + 1, attempt + 1,
                                        phase) < chance[i]
        return dropped

    def finish_minutes(self, devices: np.ndarray | list[int], round_idx: int, slot: int,
                       train_minutes: float, jitter: float) -> np.ndarray:
        """When each of `devices`, selected for round `round_idx` at `slot`, would report (minutes
        after the round opened): `train_minutes` x its speed class's multiplier (the trace's;
        every device is "mid" without one) x a LogNormal(0, `jitter`) draw per (round, slot, device).

        Why LogNormal: a device's training time is a product of positive factors (thermal
        throttling, other apps, its data's size), so its log is roughly normal and it has the
        right skew (a few very late devices, never a negative time); the median factor is 1, so the
        speed class stays the typical time, as the emulated fleet's LogNormal speed does
        (`Behaviour`). Drawn from its own stream, so it never moves a selection or a drop."""
        devices = np.asarray(devices, dtype=np.int64)
        speed = (np.array([self.trace.speed(int(d)) for d in devices]) if self.trace is not None
                 else np.full(devices.size, SPEED_MULTIPLIER["mid"]))
        rng = np.random.default_rng([self.seed, 0xA9, round_idx, slot])
        return train_minutes * speed * rng.lognormal(0.0, jitter, devices.size)

    def took_part(self, devices: np.ndarray | list[int], slot: int) -> None:
        """Start the timers of devices that took part in the round starting at `slot`."""
        self.ready_slot[np.asarray(devices, dtype=np.int64)] = slot + self.timer_slots


@dataclass(frozen=True)
class Profile:
    """The fixed traits of one device, drawn once from (fleet seed, device)."""

    tz_offset: float  # hours added to the fleet clock's hour of day
    charge_start: float  # local hour its nightly charging window opens
    speed: float  # training time multiplier (> 1: slower than the reference)
    bandwidth: float  # bytes per simulated second
    latency: float  # simulated seconds per transfer


class Behaviour:
    """One device's availability, speed, link and dropout on a continuous clock (pure: no clock,
    no I/O); all times are simulated seconds since the emulation's origin (fleet/clock.py)."""

    def __init__(self, section: DevicesSection, seed: int, device: int,
                 trace: TraceReplay | None = None, slot_minutes: float = 10.0):
        """`trace`: the replayed availability trace, shared by a worker's devices; `slot_minutes`:
        the round slot of the simple availability model (`participation.round_minutes`)."""
        self.section, self.seed, self.device, self.trace = section, seed, device, trace
        s = section
        rng = np.random.default_rng([seed, 0xF0, device])
        tz = rng.uniform(-s.timezone_spread / 2, s.timezone_spread / 2)
        start = (s.charging_start + rng.normal(0.0, 1.5)) % 24.0
        speed = rng.lognormal(0.0, s.speed_sigma)
        link = rng.lognormal(0.0, s.link_sigma, size=2)
        if trace is not None:  # the trace's speed class, not the LogNormal draw
            speed = trace.speed(device)
        self.profile = Profile(
            tz_offset=float(tz), charge_start=float(start), speed=float(speed),
            bandwidth=float(s.bandwidth_mbps * 1e6 / 8 * link[0]),
            latency=float(s.latency_ms / 1000 * link[1]),
        )
        self._slot_s = s.condition_minutes * 60.0
        self._round_s = slot_minutes * 60.0
        self._availability = Availability(s.availability, s.diurnal_amplitude)

    # -- eligibility ---------------------------------------------------------------------------
    def local_hour(self, hour_of_day: float) -> float:
        return (hour_of_day + self.profile.tz_offset) % 24.0

    def charging(self, hour_of_day: float) -> bool:
        if self.section.charging_hours >= 24.0:
            return True
        since_start = (self.local_hour(hour_of_day) - self.profile.charge_start) % 24.0
        return since_start < self.section.charging_hours

    def conditions(self, sim_t: float) -> tuple[bool, bool]:
        """(idle, unmetered) in the condition slot holding `sim_t`."""
        slot = math.floor(sim_t / self._slot_s)
        draws = np.random.default_rng([self.seed, 0xF1, self.device, slot]).random(2)
        return bool(draws[0] < self.section.idle), bool(draws[1] < self.section.unmetered)

    def in_conditions(self, sim_t: float, hour_of_day: float) -> bool:
        """The charging model alone: charging, idle and unmetered at `sim_t`."""
        idle, unmetered = self.conditions(sim_t)
        return self.charging(hour_of_day) and idle and unmetered

    def _simple_model(self) -> bool:
        return self._availability.probability < 1 or self._availability.diurnal_amplitude > 0

    def available(self, sim_t: float, hour_of_day: float) -> bool:
        """The simple model's draw at the round slot holding `sim_t` (`SlottedDevices`' draw for
        this device at that slot, at the slot's starting hour)."""
        if not self._simple_model():
            return True
        slot = math.floor(sim_t / self._round_s)
        hour = (hour_of_day - (sim_t - slot * self._round_s) / 3600.0) % 24.0
        return bool(slot_draws(self.seed, slot, self.device + 1)[self.device]
                    < self._availability.at(hour))

    def eligibility(self, sim_t: float, hour_of_day: float) -> dict[str, bool]:
        """What the device reports at check-in (the contract's `eligibility` object); with a trace,
        all three hold exactly inside its intervals, and the simple model's "unavailable" clears
        all three."""
        if self.trace is not None:
            inside = self.trace.client_eligible(self.device, sim_t)
            return {"charging": inside, "idle": inside, "unmetered": inside}
        idle, unmetered = self.conditions(sim_t)
        up = self.available(sim_t, hour_of_day)
        return {"charging": up and self.charging(hour_of_day), "idle": up and idle,
                "unmetered": up and unmetered}

    def eligible(self, sim_t: float, hour_of_day: float) -> bool:
        return all(self.eligibility(sim_t, hour_of_day).values())

    def next_change(self, sim_t: float, hour_of_day: float) -> float:
        """The first simulated time after `sim_t` at which eligibility can change.

        Outside its charging window a device sleeps until the window opens (one wake-up a day,
        however fast the clock runs); inside it, until the next idle / unmetered slot edge or
        the window's close, whichever comes first; with the simple model, at the latest at the
        next round slot's edge. With a trace: the next interval edge."""
        if self.trace is not None:
            return self.trace.next_change(self.device, sim_t)
        change = self._charging_change(sim_t, hour_of_day)
        if self._simple_model():
            change = min(change, (math.floor(sim_t / self._round_s) + 1) * self._round_s)
        return change

    def _charging_change(self, sim_t: float, hour_of_day: float) -> float:
        slot_edge = (math.floor(sim_t / self._slot_s) + 1) * self._slot_s
        if self.section.charging_hours >= 24.0:
            return slot_edge
        since_start = (self.local_hour(hour_of_day) - self.profile.charge_start) % 24.0
        if since_start >= self.section.charging_hours:  # not charging: until the window opens
            return sim_t + max(24.0 - since_start, 1e-6) * 3600.0
        closes = sim_t + max(self.section.charging_hours - since_start, 1e-6) * 3600.0
        return min(slot_edge, closes)

    # -- link and speed -------------------------------------------------------------------------
    def transfer_seconds(self, nbytes: int) -> float:
        """Simulated seconds one transfer of `nbytes` takes over this device's link."""
        return self.profile.latency + max(0, nbytes) / self.profile.bandwidth

    # -- dropout --------------------------------------------------------------------------------
    def dropout_chance(self, phase: str) -> float:
        p = self.section.dropout_chance(phase)
        if phase == "train" and self.trace is not None:
            return max(p, float(self.trace.failure([self.device])[0]))
        return p

    def drops(self, phase: str, round_idx: int, attempt: int) -> bool:
        """Whether this device vanishes at `phase` of (round, attempt) (seeded, replayable)."""
        p = self.dropout_chance(phase)
        return p > 0.0 and drop_draw(self.seed, self.device, round_idx, attempt, phase) < p
