"""One emulated phone's life: sleep until its timer expires and it is eligible, check in, take part.

Why a loop per device (a coroutine): an idle phone is a sleeping coroutine, so a worker process
holds hundreds of them. The decision when to check in is the pure `wait_before_checkin`; the loop
only sleeps, asks the coordinator, and hands an assignment to `participate` (the service's
`Participant`, wired in `fleet/worker.py`). The device checks in only once its own timer has
expired: it never relies on the coordinator's guard for that.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dpfleet.edge.devices import Behaviour, DeviceTimer
from dpfleet.fleet.clock import FleetClock

WAKE_MARGIN_S = 1e-3
MIN_RETRY_S = 0.05
MAX_ERROR_PAUSE_S = 10.0  # wall seconds: a coordinator that says "retry after 0" is not hammered


class CheckinLink(Protocol):
    async def register(self) -> Any: ...

    async def checkin(self, *, charging: bool, idle: bool, unmetered: bool, runtime: str,
                      timer_expires_at: float | None) -> dict: ...


@dataclass
class DeviceState:
    """What one device knows about itself (and nothing about any other device)."""

    index: int  # train client index = position in the fleet key file
    device_id: str  # the train client's user id
    behaviour: Behaviour
    timer: DeviceTimer
    runtime: str = "eager"
    link: Any = None  # its own signed link to the coordinator (fleet/worker.py)
    offline_until: float = 0.0  # simulated time before which it is gone (it dropped out)
    counts: dict[str, int] = field(default_factory=dict)
    bundle_serials: dict[str, int] = field(default_factory=dict)  # key hex -> newest serial taken

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


def wait_before_checkin(device: DeviceState, clock: FleetClock, sim_t: float) -> float:
    """Simulated seconds the device must wait before it may check in (0: now)."""
    if sim_t < device.offline_until:
        return device.offline_until - sim_t
    if not device.timer.expired(sim_t):
        return device.timer.remaining(sim_t)
    hour = clock.hour_of_day(sim_t)
    if not device.behaviour.eligible(sim_t, hour):
        return device.behaviour.next_change(sim_t, hour) - sim_t
    return 0.0


async def device_loop(device: DeviceState, link: CheckinLink, clock: FleetClock,
                      participate: Callable[[DeviceState, dict], Awaitable[str]],
                      *, rng: random.Random | None = None,
                      on_event: Callable[[DeviceState, str], None] | None = None,
                      link_errors: tuple[type[Exception], ...] = ()) -> None:
    """Run the device until the coordinator answers `done` (or 410: the run is over).

    `participate(device, assignment)` runs one assignment and returns its outcome (a short
    word for the statistics: "reported", "dropped", "stale", ...). A request that failed for
    good (`link_errors`: the link already retried) is noted and tried again after a jittered
    pause, as a phone would the next time its scheduler runs, so a coordinator restart costs
    the fleet nothing."""
    rng = rng or random.Random(device.index)

    def note(event: str) -> None:
        device.count(event)
        if on_event is not None:
            on_event(device, event)

    registered, failures = False, 0
    while True:
        try:
            if not registered:
                await link.register()
                registered = True
                note("registered")
            if await _step(device, link, clock, participate, rng, note):
                return
            failures = 0
        except link_errors as exc:
            if getattr(exc, "status", None) == 410:
                note("done")
                return
            note(f"link_error_{getattr(exc, 'status', 'other')}")
            failures += 1
            await asyncio.sleep(min(MAX_ERROR_PAUSE_S, 0.5 * 2 ** min(failures, 6)) * rng.uniform(0.5, 1.5))


async def _step(device, link, clock, participate, rng, note) -> bool:
    """One wait-or-check-in step; True when the run is done."""
    sim_t = clock.now()
    wait = wait_before_checkin(device, clock, sim_t)
    if wait > 0:  # + 1 ms of wall time: wake up past the edge, never spin on float rounding
        await clock.sleep(wait + clock.time_scale * WAKE_MARGIN_S)
        return False
    expires = device.timer.expires_at()
    reply = await link.checkin(
        **device.behaviour.eligibility(sim_t, clock.hour_of_day(sim_t)), runtime=device.runtime,
        timer_expires_at=None if expires is None else clock.to_unix(expires))
    note("checkin")
    kind = reply.get("kind")
    if kind == "done":
        note("done")
        return True
    if kind == "assignment":
        device.timer.start(max(sim_t, clock.now()))  # away a whole period from now on
        note("assigned")
        note(await participate(device, reply))
        return False
    if kind == "refused":
        note(f"refused_{reply.get('reason', 'other')}")
    after = float(reply.get("after_s", 1.0))
    await asyncio.sleep(max(MIN_RETRY_S, after) * rng.uniform(0.8, 1.2))  # jitter: no herd
    return False
