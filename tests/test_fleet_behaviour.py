"""Emulated device behaviour (edge/devices.py `Behaviour`) and the [devices] config section."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.config import parse_config
from dpfleet.edge.devices import Behaviour, DevicesSection
from dpfleet.errors import DpfleetError

NIGHTS = DevicesSection(charging_hours=8.0, charging_start=22.0, timezone_spread=6.0, idle=0.8,
                      unmetered=0.7, condition_minutes=15.0)


def test_profile_is_seeded_per_device_not_per_stream():
    a, b = Behaviour(NIGHTS, 7, 3), Behaviour(NIGHTS, 7, 3)
    assert a.profile == b.profile
    assert a.eligibility(12_345.0, 3.0) == b.eligibility(12_345.0, 3.0)
    others = {Behaviour(NIGHTS, 7, d).profile.speed for d in range(50)}
    assert len(others) == 50  # every device its own speed
    assert Behaviour(NIGHTS, 8, 3).profile != a.profile  # the fleet seed matters


def test_always_plugged_in_by_default():
    b = Behaviour(DevicesSection(), 0, 0)
    assert all(b.charging(h) for h in np.linspace(0, 24, 97))
    assert all(b.eligible(t, 0.0) for t in np.arange(0, 86_400, 900.0))


def test_charging_window_covers_its_hours_at_night():
    hours = np.arange(0, 24, 1 / 60)  # every simulated minute of a day
    for d in range(20):
        b = Behaviour(NIGHTS, 1, d)
        share = np.mean([b.charging(h) for h in hours])
        assert share == pytest.approx(8 / 24, abs=2 / 1440)
        opens = (b.profile.charge_start - b.profile.tz_offset) % 24  # fleet hour it opens
        assert b.charging((opens + 0.01) % 24) and not b.charging((opens - 0.01) % 24)


def test_idle_and_unmetered_rates_match_the_config():
    b = Behaviour(NIGHTS, 3, 11)
    draws = np.array([b.conditions(slot * 900.0 + 1.0) for slot in range(20_000)])
    # binomial sd ~ 0.003: a wrong rate (or idle and unmetered drawn from one number) is far off
    assert draws[:, 0].mean() == pytest.approx(0.8, abs=0.015)
    assert draws[:, 1].mean() == pytest.approx(0.7, abs=0.015)
    both = (draws[:, 0] & draws[:, 1]).mean()
    assert both == pytest.approx(0.56, abs=0.015)  # independent draws


@settings(max_examples=60, deadline=None)
@given(device=st.integers(0, 10_000), t=st.floats(0, 30 * 86_400), start=st.floats(0, 24))
def test_eligibility_is_constant_until_next_change(device, t, start):
    b = Behaviour(NIGHTS, 5, device)

    def hour(x: float) -> float:
        return (start + x / 3600) % 24

    nxt = b.next_change(t, hour(t))
    assert nxt > t
    now = b.eligible(t, hour(t))
    for frac in (0.25, 0.5, 0.9):
        x = t + frac * (nxt - t)
        assert b.eligible(x, hour(x)) == now
    if not b.charging(hour(t)):  # asleep until the window opens, not a wake-up per slot
        assert b.charging(hour(nxt + 1.0))


def test_dropout_per_phase_is_seeded_and_at_its_rate():
    cfg = dataclasses.replace(NIGHTS, dropout_train=0.3, dropout_secagg=1.0)
    devices = [Behaviour(cfg, 2, d) for d in range(400)]
    train = np.array([[b.drops("train", r, 0) for r in range(10)] for b in devices])
    assert train.mean() == pytest.approx(0.3, abs=0.03)
    assert not any(b.drops("download", 1, 0) or b.drops("report", 1, 0) for b in devices)
    assert all(b.drops("masked_input", 1, 0) for b in devices)  # any other phase: secagg's
    again = np.array([[b.drops("train", r, 0) for r in range(10)] for b in devices])
    assert (again == train).all()  # replayable
    retry = np.array([[b.drops("train", r, 1) for r in range(10)] for b in devices])
    assert (retry != train).mean() == pytest.approx(2 * 0.3 * 0.7, abs=0.04)  # a new attempt draws afresh


def test_link_and_speed_spread_around_their_medians():
    cfg = DevicesSection(bandwidth_mbps=8.0, latency_ms=100.0, link_sigma=0.5, speed_sigma=0.3)
    profiles = [Behaviour(cfg, 0, d).profile for d in range(2000)]
    assert np.median([p.bandwidth for p in profiles]) == pytest.approx(1e6, rel=0.06)
    assert np.median([p.latency for p in profiles]) == pytest.approx(0.1, rel=0.06)
    assert np.std(np.log([p.speed for p in profiles])) == pytest.approx(0.3, rel=0.08)
    b = Behaviour(cfg, 0, 0)
    assert b.transfer_seconds(0) == pytest.approx(b.profile.latency)
    assert b.transfer_seconds(4_000_000) == pytest.approx(b.profile.latency + 4e6 / b.profile.bandwidth)


def test_fleet_config_is_validated():
    cfg = parse_config({"devices": {"charging_hours": 6, "dropout_train": 0.1}})
    assert cfg.devices.charging_hours == 6.0 and cfg.devices.dropout_train == 0.1
    assert cfg.resolved()["devices"]["speed_sigma"] == 0.3
    for bad in ({"dropout_train": 1.5}, {"charging_hours": 0}, {"bandwidth_mbps": 0},
                {"latency_ms": -1}, {"idle": -0.1}):
        with pytest.raises(DpfleetError, match="devices."):
            parse_config({"devices": bad})
    with pytest.raises(DpfleetError, match="did you mean 'devices.dropout_train'"):
        parse_config({"devices": {"dropout_trian": 0.1}})
