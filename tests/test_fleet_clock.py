"""The fleet's scaled clock and each device's own participation timer (fleet/clock.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.edge.devices import DeviceTimer
from dpfleet.errors import DpfleetError
from dpfleet.fleet.clock import FleetClock, read_time_scale


class Wall:
    """Stands in for time.time: a wall clock the test moves by hand."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_day_timer_passes_in_a_wall_second_at_scale_86400():
    wall = Wall()
    clock = FleetClock(86_400.0, origin=wall.t, start_hour=22.0, wall=wall)
    timer = DeviceTimer(period=24 * 3600.0)
    timer.start(clock.now())
    wall.t += 0.999
    assert not timer.expired(clock.now())
    wall.t += 0.002
    assert timer.expired(clock.now())
    assert clock.hour_of_day(clock.now()) == pytest.approx(22.0 + 24 * 0.001 * 1.001, abs=1e-3)
    assert clock.to_unix(timer.expires_at()) == pytest.approx(wall.t - 0.001, abs=1e-6)
    assert clock.wall_seconds(3600.0) == pytest.approx(3600 / 86_400)


def test_time_scale_is_read_defensively():
    assert read_time_scale({}) == 1.0
    assert read_time_scale({"service": {"time_scale": 600}}) == 600.0

    class Cfg:
        class service:  # noqa: N801 (stands in for a parsed config's [service] section)
            time_scale = 3600.0

    assert read_time_scale(Cfg()) == 3600.0
    for bad in (0, -1, float("inf"), "fast", True):
        with pytest.raises(DpfleetError, match="time_scale"):
            read_time_scale({"service": {"time_scale": bad}})


@settings(max_examples=200, deadline=None)
@given(period=st.floats(0, 1e7), steps=st.lists(st.floats(0, 1e6), min_size=1, max_size=30),
       takes=st.lists(st.booleans(), min_size=30, max_size=30))
def test_timer_never_expires_early(period, steps, takes):
    timer, t, last = DeviceTimer(period), 0.0, None
    for dt, take in zip(steps, takes, strict=False):
        t += dt
        if timer.expired(t):
            assert last is None or t - last >= period  # expired only after a whole period
            if take:
                timer.start(t)
                last = t
        else:
            assert last is not None and t - last < period
            left = timer.remaining(t)  # > 0, so sleeping it always makes progress
            assert left > 0 and left == pytest.approx(period - (t - last), abs=2 * math.ulp(t))


def test_timer_rejects_bad_periods_and_time_travel():
    with pytest.raises(DpfleetError):
        DeviceTimer(-1.0)
    timer = DeviceTimer(10.0)
    timer.start(100.0)
    with pytest.raises(RuntimeError):
        timer.start(50.0)
