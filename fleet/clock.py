"""Simulated time for the emulated fleet (each device's own timer is edge/devices.py `DeviceTimer`).

Why a scaled clock: a participation timer of 24 h (paper 002 Sec. 2.2) must pass in seconds
for an emulation to finish, on the devices and at the coordinator alike. `[service] time_scale`
is simulated seconds per wall second; the coordinator sends the same value in every assignment,
and `after_s` in its replies is wall seconds. All worker processes share one origin (unix wall
seconds), so they agree on the simulated time of day.

Why a timer on the device: the coordinator also refuses devices that would break MinS / MaxP,
but the device's own timer is the first line (a device that never checks in early cannot be
selected early, whatever the coordinator does). It starts when the device is assigned to a round,
which is never later than when the coordinator records its participation.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from dpfleet.errors import DpfleetError


def read_time_scale(values: object) -> float:
    """`[service] time_scale` from a config object or its TOML dict (default 1.0).

    Read defensively: the `[service]` section belongs to the coordinator service."""
    service = values.get("service") if isinstance(values, dict) else getattr(values, "service", None)
    raw = (service.get("time_scale") if isinstance(service, dict)
           else getattr(service, "time_scale", None)) if service is not None else None
    scale = 1.0 if raw is None else raw
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not (
            math.isfinite(scale) and scale > 0):
        raise DpfleetError(f"service.time_scale must be a positive number, got {raw!r}")
    return float(scale)


class FleetClock:
    """Simulated seconds since `origin` (a unix wall time), at `time_scale` per wall second."""

    def __init__(self, time_scale: float, origin: float, start_hour: float = 0.0,
                 wall: Callable[[], float] = time.time):
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise DpfleetError(f"time_scale must be positive, got {time_scale}")
        self.time_scale, self.origin, self.start_hour, self._wall = time_scale, origin, start_hour, wall

    def now(self) -> float:
        return (self._wall() - self.origin) * self.time_scale

    def hour_of_day(self, sim_t: float) -> float:
        """The fleet's reference hour of day (UTC-like) at simulated time `sim_t`."""
        return (self.start_hour + sim_t / 3600.0) % 24.0

    def to_unix(self, sim_t: float) -> float:
        """The unix wall time at which the simulated clock reads `sim_t`."""
        return self.origin + sim_t / self.time_scale

    def wall_seconds(self, sim_seconds: float) -> float:
        return max(0.0, sim_seconds) / self.time_scale

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(self.wall_seconds(sim_seconds))
