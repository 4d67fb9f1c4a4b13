"""How one emulated phone behaves: when it may train, how fast, over what link, and when it vanishes.

Why per device and seeded: a fleet emulation is only useful if a run can be replayed, and a
device's behaviour must not depend on which worker process owns it. Every draw is keyed by
(fleet seed, device, ...), never by a shared random stream.

* Eligibility (Bonawitz et al. 2019: a phone trains only while charging, idle and on an unmetered
  network): a nightly charging window in the device's local time (its time zone and its own
  start hour), and per condition slot (`fleet.condition_minutes` of simulated time) a seeded
  draw of idle and unmetered. `charging_hours = 24` is a phone that is always plugged in.
* Speed: a LogNormal(0, speed_sigma) multiplier on training time (median 1).
* Link: bandwidth (bytes/s) and latency (s), LogNormal around the configured medians; a transfer
  of n bytes costs latency + n / bandwidth simulated seconds.
* Dropout: a chance per phase of a round (download, train, report, each SecAgg phase), drawn
  per (device, round, attempt, phase), so a retried attempt draws afresh.
All times here are simulated seconds since the emulation's origin (`fleet/clock.py`).

With an availability trace (`participation.trace`, the key `simulate`'s timer mode reads too) the
trace replaces the charging window and the idle / unmetered draws: a device is eligible exactly
inside its intervals (edge/traces.py `TraceReplay`: device i replays trace device i mod T, the
trace repeats after its duration), wakes at their edges, trains at its speed class's multiplier,
and the trace's failure chance is its chance of dropping out while training.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from dpfleet.coordinator.config import FleetSection
from dpfleet.edge.traces import TraceReplay

PLAIN_PHASES = ("download", "train", "report")  # any other phase name is a SecAgg phase


@dataclass(frozen=True)
class Profile:
    """The fixed traits of one device, drawn once from (fleet seed, device)."""

    tz_offset: float  # hours added to the fleet clock's hour of day
    charge_start: float  # local hour its nightly charging window opens
    speed: float  # training time multiplier (> 1: slower than the reference)
    bandwidth: float  # bytes per simulated second
    latency: float  # simulated seconds per transfer


def _phase_tag(phase: str) -> int:
    return int.from_bytes(hashlib.sha256(phase.encode()).digest()[:4], "little")


class Behaviour:
    """One device's availability trace, speed, link and dropout (pure: no clock, no I/O)."""

    def __init__(self, section: FleetSection, fleet_seed: int, device: int,
                 trace: TraceReplay | None = None):
        """`trace`: the replayed availability trace (module docstring), shared by a worker's devices."""
        self.section, self.seed, self.device, self.trace = section, fleet_seed, device, trace
        s = section
        rng = np.random.default_rng([fleet_seed, 0xF0, device])
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

    def eligibility(self, sim_t: float, hour_of_day: float) -> dict[str, bool]:
        """What the device reports at check-in (the contract's `eligibility` object); with a trace,
        all three hold exactly inside its intervals."""
        if self.trace is not None:
            inside = self.trace.client_eligible(self.device, sim_t)
            return {"charging": inside, "idle": inside, "unmetered": inside}
        idle, unmetered = self.conditions(sim_t)
        return {"charging": self.charging(hour_of_day), "idle": idle, "unmetered": unmetered}

    def eligible(self, sim_t: float, hour_of_day: float) -> bool:
        return all(self.eligibility(sim_t, hour_of_day).values())

    def next_change(self, sim_t: float, hour_of_day: float) -> float:
        """The first simulated time after `sim_t` at which eligibility can change.

        Outside its charging window a device sleeps until the window opens (one wake-up a day,
        however fast the clock runs); inside it, until the next idle / unmetered slot edge or
        the window's close, whichever comes first. With a trace: the next interval edge."""
        if self.trace is not None:
            return self.trace.next_change(self.device, sim_t)
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
        s = self.section
        if phase == "train" and self.trace is not None:
            return max(s.dropout_train, float(self.trace.failure([self.device])[0]))
        return {"download": s.dropout_download, "train": s.dropout_train,
                "report": s.dropout_report}.get(phase, s.dropout_secagg)

    def drops(self, phase: str, round_idx: int, attempt: int) -> bool:
        """Whether this device vanishes at `phase` of (round, attempt) (seeded, replayable)."""
        p = self.dropout_chance(phase)
        if p <= 0.0:
            return False
        draw = np.random.default_rng(
            [self.seed, 0xF2, self.device, round_idx, attempt, _phase_tag(phase)]).random()
        return bool(draw < p)
