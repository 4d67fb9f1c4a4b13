"""An emulated fleet: each device keeps its own participation timer and is only sometimes available.

Paper 002 (Sec. 2.2) limits how often a device takes part with a timer *on the device*: after it
takes part it does not check in again until a period has passed. Whether an eligible device
checks in also depends on its conditions (charging, idle, unmetered network; Bonawitz et al.
2019), modelled as a probability that may follow the time of day (diurnal participation).

Time is counted in slots of one round's duration: the coordinator starts a round (or, when it
cannot fill one, retries) once per slot, so an integer slot counter is the simulated clock and
every comparison is exact. A timer of P hours lasts ceil(P * 60 / round_minutes) slots.
Availability at each slot is a seeded Bernoulli draw per device, so a run is reproducible; or,
given an availability trace (`participation.trace`, edge/traces.py), what the trace says at the
slot's simulated time, and a device that joins a round drops out with the trace's failure chance.
A selected device that does not drop reports after its training time (`finish_minutes`), which
the coordinator compares with the round's report goal and deadline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpfleet.edge.traces import SPEED_MULTIPLIER, TraceReplay
from dpfleet.errors import DpfleetError


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


def timer_slots(timer_hours: float, slot_minutes: float) -> int:
    """How many round slots a timer of `timer_hours` keeps a device away (rounded up)."""
    if not (slot_minutes > 0 and math.isfinite(slot_minutes)):
        raise DpfleetError(f"round duration must be positive minutes, got {slot_minutes}")
    if not (timer_hours >= 0 and math.isfinite(timer_hours)):
        raise DpfleetError(f"timer period must be >= 0 hours, got {timer_hours}")
    # the epsilon absorbs float noise such as 24 h / 7.2 min = 200.00000000000003 slots
    return math.ceil(timer_hours * 60.0 / slot_minutes - 1e-9)


class EmulatedFleet:
    """Device-side state of `size` devices: when each timer expires, and who is available."""

    def __init__(self, size: int, timer_hours: float, slot_minutes: float,
                 availability: Availability, seed: int, trace: TraceReplay | None = None):
        """`trace`: replayed in place of `availability`'s draw (which is then not used)."""
        if size < 1:
            raise DpfleetError("a fleet needs at least one device")
        self.size, self.slot_minutes, self.availability = size, slot_minutes, availability
        self.timer_slots = timer_slots(timer_hours, slot_minutes)
        self.seed, self.trace = seed, trace
        self.ready_slot = np.zeros(size, dtype=np.int64)  # first slot each device may check in

    def hour_of(self, slot: int) -> float:
        return (slot * self.slot_minutes / 60.0) % 24.0

    def available(self, slot: int) -> np.ndarray:
        """Boolean mask: devices whose conditions allow training at `slot` (seeded per slot), or
        inside one of their trace intervals at the slot's start."""
        if self.trace is not None:
            return self.trace.eligible(slot * self.slot_minutes * 60.0)
        rng = np.random.default_rng([self.seed, 0xA7, slot])
        return rng.random(self.size) < self.availability.at(self.hour_of(slot))

    def check_in(self, slot: int) -> np.ndarray:
        """Indices of devices that check in at `slot`: timer expired and available."""
        return np.flatnonzero((self.ready_slot <= slot) & self.available(slot))

    def drops(self, devices: np.ndarray | list[int], round_idx: int, slot: int) -> np.ndarray:
        """Which of `devices`, selected for round `round_idx` at `slot`, drop out before reporting:
        the trace's failure chance, drawn per (round, slot, device); none without a trace."""
        devices = np.asarray(devices, dtype=np.int64)
        if self.trace is None:
            return np.zeros(devices.size, dtype=bool)
        draws = np.random.default_rng([self.seed, 0xA8, round_idx, slot]).random(devices.size)
        return draws < self.trace.failure(devices)

    def finish_minutes(self, devices: np.ndarray | list[int], round_idx: int, slot: int,
                       train_minutes: float, jitter: float) -> np.ndarray:
        """When each of `devices`, selected for round `round_idx` at `slot`, would report (minutes
        after the round opened): `train_minutes` x its speed class's multiplier (the trace's;
        every device is "mid" without one) x a LogNormal(0, `jitter`) draw per (round, slot, device).

        Why LogNormal: a device's training time is a product of positive factors (thermal
        throttling, other apps, its data's size), so its log is roughly normal and it has the
        right skew (a few very late devices, never a negative time); the median factor is 1, so the
        speed class stays the typical time, as the emulated fleet's LogNormal speed does
        (fleet/behaviour.py). Drawn from its own stream, so it never moves a selection or a drop."""
        devices = np.asarray(devices, dtype=np.int64)
        speed = (np.array([self.trace.speed(int(d)) for d in devices]) if self.trace is not None
                 else np.full(devices.size, SPEED_MULTIPLIER["mid"]))
        rng = np.random.default_rng([self.seed, 0xA9, round_idx, slot])
        return train_minutes * speed * rng.lognormal(0.0, jitter, devices.size)

    def took_part(self, devices: np.ndarray | list[int], slot: int) -> None:
        """Start the timers of devices that took part in the round starting at `slot`."""
        self.ready_slot[np.asarray(devices, dtype=np.int64)] = slot + self.timer_slots
