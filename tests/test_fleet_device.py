"""One emulated device's check-in loop (fleet/device.py): its own timer and eligibility rule it."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.edge.devices import Behaviour, DevicesSection, DeviceTimer
from dpfleet.edge.traces import load_replay
from dpfleet.fleet.clock import FleetClock
from dpfleet.fleet.device import DeviceState, device_loop, wait_before_checkin

T0 = 1_700_000_000.0


class SteppedClock(FleetClock):
    """Stands in for wall time: sleeping advances a virtual wall clock instantly."""

    def __init__(self, time_scale: float, start_hour: float = 0.0):
        self.wall_t = T0
        super().__init__(time_scale, T0, start_hour, wall=lambda: self.wall_t)

    async def sleep(self, sim_seconds: float) -> None:
        self.wall_t += self.wall_seconds(sim_seconds)
        await asyncio.sleep(0)


class ScriptedCoordinator:
    """Stands in for CoordinatorLink: replies from a script, records when each check-in came."""

    def __init__(self, clock: SteppedClock, script: list[str], after_s: float):
        self.clock, self.script, self.after_s = clock, list(script), after_s
        self.checkins: list[tuple[float, dict, float | None]] = []

    async def register(self) -> dict:
        return {"registered": True}

    async def checkin(self, *, runtime, timer_expires_at, **eligibility):
        self.checkins.append((self.clock.now(), eligibility, timer_expires_at))
        self.clock.wall_t += 0.001  # the request takes a moment
        kind = self.script.pop(0) if self.script else "done"
        if kind == "assignment":
            return {"kind": "assignment", "round": len(self.checkins), "attempt": 0}
        if kind == "refused":
            return {"kind": "refused", "reason": "timer", "after_s": self.after_s}
        return {"kind": kind, "after_s": self.after_s}


def run(device: DeviceState, coordinator: ScriptedCoordinator, clock: SteppedClock,
        train_wall_s: float = 0.0) -> list[float]:
    assigned: list[float] = []

    async def participate(dev, assignment):
        assigned.append(clock.now())
        clock.wall_t += train_wall_s
        return "reported"

    async def main():
        loop_sleep = asyncio.sleep

        async def fast_sleep(seconds):  # retries advance the virtual wall clock too
            clock.wall_t += seconds
            await loop_sleep(0)

        asyncio.sleep = fast_sleep
        try:
            await device_loop(device, coordinator, clock, participate, rng=random.Random(0))
        finally:
            asyncio.sleep = loop_sleep

    asyncio.run(main())
    return assigned


@settings(max_examples=40, deadline=None)
@given(script=st.lists(st.sampled_from(["assignment", "retry", "refused"]), max_size=25),
       period_h=st.floats(0.0, 48.0), scale=st.sampled_from([1.0, 600.0, 86_400.0]),
       after_s=st.floats(0.0, 5.0), charging_hours=st.sampled_from([24.0, 8.0]),
       train_wall_s=st.floats(0.0, 2.0))
def test_device_never_checks_in_before_its_timer_expires(script, period_h, scale, after_s,
                                                          charging_hours, train_wall_s):
    clock = SteppedClock(scale, start_hour=12.0)
    section = DevicesSection(charging_hours=charging_hours, idle=0.9, unmetered=0.9)
    device = DeviceState(0, "u0", Behaviour(section, 3, 0), DeviceTimer(period_h * 3600.0))
    coordinator = ScriptedCoordinator(clock, script, after_s)
    assigned = run(device, coordinator, clock, train_wall_s)
    assert len(assigned) == script.count("assignment")
    for t, eligibility, expires in coordinator.checkins:
        earlier = [a for a in assigned if a <= t]
        if earlier:  # a whole timer period since the last assignment, on the device's own clock
            assert t - earlier[-1] >= period_h * 3600.0 - 1e-6
            assert expires is not None and clock.to_unix(t / 1.0) >= expires - 1e-6
        else:
            assert expires is None
        assert all(eligibility.values())  # it checks in only when charging, idle and unmetered
    assert device.counts["done"] == 1


def test_ineligible_device_sleeps_to_its_window_in_one_step():
    section = DevicesSection(charging_hours=6.0, charging_start=22.0)
    clock = SteppedClock(86_400.0, start_hour=12.0)  # noon: outside every window
    behaviour = Behaviour(section, 0, 4)
    device = DeviceState(4, "u4", behaviour, DeviceTimer(0.0))
    wait = wait_before_checkin(device, clock, 0.0)
    opens = (behaviour.profile.charge_start - behaviour.profile.tz_offset - 12.0) % 24 * 3600
    assert abs(wait - opens) < 1.0
    assert wait_before_checkin(device, clock, wait + 1.0) == 0.0


def test_timer_state_is_the_devices_own():
    clock = SteppedClock(86_400.0)
    devices = [DeviceState(i, f"u{i}", Behaviour(DevicesSection(), 0, i), DeviceTimer(86_400.0))
               for i in range(2)]
    coordinator = ScriptedCoordinator(clock, ["assignment"], 0.5)
    run(devices[0], coordinator, clock)
    assert devices[0].timer.last is not None and devices[1].timer.last is None
    assert wait_before_checkin(devices[1], clock, clock.now()) == 0.0
    assert wait_before_checkin(devices[0], clock, devices[0].timer.last + 10.0) > 86_000.0


class Flaky(Exception):
    """Stands in for the link's LinkError after its own retries: a status and nothing else."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def test_a_device_outlasts_a_coordinator_outage_and_stops_on_410():
    clock = SteppedClock(1.0)
    calls: list[str] = []

    class Outage(ScriptedCoordinator):
        """Registration fails twice (coordinator down), then one retry, then 410 (run over)."""

        async def register(self):
            calls.append("register")
            if calls.count("register") <= 2:
                raise Flaky(0)
            return {"registered": True}

        async def checkin(self, **kw):
            calls.append("checkin")
            if calls.count("checkin") == 1:
                return await super().checkin(**kw)
            raise Flaky(410)

    device = DeviceState(0, "u0", Behaviour(DevicesSection(), 0, 0), DeviceTimer(0.0))
    run_with = Outage(clock, ["retry"], 0.5)

    async def never(dev, assignment):
        raise AssertionError("no assignment was scripted")

    async def main():
        loop_sleep = asyncio.sleep

        async def fast_sleep(seconds):
            clock.wall_t += seconds
            await loop_sleep(0)

        asyncio.sleep = fast_sleep
        try:
            await device_loop(device, run_with, clock, never, rng=random.Random(0),
                              link_errors=(Flaky,))
        finally:
            asyncio.sleep = loop_sleep

    asyncio.run(main())
    assert calls == ["register", "register", "register", "checkin", "checkin"]
    assert device.counts["link_error_0"] == 2 and device.counts["registered"] == 1
    assert device.counts["done"] == 1
    assert clock.wall_t - T0 >= 0.5 * 0.5 + 0.5 * 2 * 0.5  # jittered pauses, growing


def test_a_replayed_trace_device_checks_in_only_inside_its_intervals(tmp_path):
    # the device replays trace device 1 of 2 (client 3 -> 3 mod 2): inside [0, 1 h) and
    # [3 h, 4 h), the 6-hour trace repeating; the coordinator says "retry" after 1 wall second
    # (600 simulated seconds), 30 times
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"format": "dpfleet-trace", "version": 1, "duration": 21600}\n'
                     '{"id": "x", "intervals": [[0, 21600]]}\n'
                     '{"id": "y", "intervals": [[0, 3600], [10800, 14400]], "speed": "slow"}\n')
    replay = load_replay(trace, 4)
    clock = SteppedClock(600.0)
    behaviour = Behaviour(DevicesSection(), 0, 3, replay)
    device = DeviceState(3, "u3", behaviour, DeviceTimer(0.0))
    coordinator = ScriptedCoordinator(clock, ["retry"] * 30, 1.0)
    run(device, coordinator, clock)
    times = [t for t, _, _ in coordinator.checkins]
    assert len(times) == 31 and all(all(e.values()) for _, e, _ in coordinator.checkins)
    assert all(t % 21600 < 3600 or 10800 <= t % 21600 < 14400 for t in times)
    # outside its intervals it sleeps to the next one in one step: the first check-in after
    # [0, 1 h) is at 3 h exactly (retries are jittered, window edges are not)
    first_late = next(t for t in times if t >= 3600)
    assert abs(first_late - 10800) < 1 and times[0] == 0  # (a request takes 0.6 simulated s)
    passes = {int(t // 3600) for t in times}  # the hours it checked in: 0, 3, 6, 9, 12, 15 (wrapped)
    assert passes == {0, 3, 6, 9, 12, 15}
    assert behaviour.profile.speed == 2.5  # the trace's speed class, "slow"
