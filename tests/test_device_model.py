"""One device model (edge/devices.py) for `simulate`'s timer mode and the emulated fleet: for the
same config, seed, device and round, both decide the same availability and the same dropouts."""

from __future__ import annotations

import numpy as np
import pytest

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.participation import Participation
from dpfleet.edge.devices import PLAIN_PHASES, Behaviour, SlottedDevices
from dpfleet.errors import DpfleetError

SEED, SIZE, ROUND_MINUTES = 7, 30, 10.0
CONFIG = {"participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": ROUND_MINUTES},
          "devices": {"availability": 0.5, "diurnal_amplitude": 0.4, "dropout_download": 0.2,
                      "dropout_train": 0.3, "dropout_report": 0.1},
          "dp": {"report_goal": 3}}


def fleet_device(cfg, device: int) -> Behaviour:
    """The device as the emulated fleet builds it (fleet/worker.py)."""
    return Behaviour(cfg.devices, SEED, device, None, cfg.participation.round_minutes)


@pytest.mark.parametrize("devices", [CONFIG["devices"], {"charging_hours": 8.0, "timezone_spread": 6.0,
                                                          "idle": 0.8, "unmetered": 0.7}],
                         ids=["availability", "charging"])
def test_simulate_and_the_fleet_see_the_same_devices_available(devices):
    cfg = parse_config({**CONFIG, "devices": devices})
    slotted = SlottedDevices.from_section(cfg.devices, SIZE, 0.5, ROUND_MINUTES, SEED)
    fleet = [fleet_device(cfg, d) for d in range(SIZE)]
    slot_s = ROUND_MINUTES * 60.0
    seen = []
    for slot in range(0, 300, 7):  # two days of slots, every hour of the day
        for offset in (0.0, 123.0):  # the fleet checks in at any time inside the slot
            t = slot * slot_s + offset
            hour = (t / 3600.0) % 24.0  # the fleet clock's hour (start hour 0, as simulate's)
            on_fleet = np.array([b.eligible(t, hour) for b in fleet])
            if devices is CONFIG["devices"] or offset == 0.0:  # charging: conditions change in-slot
                assert (on_fleet == slotted.available(slot)).all(), (slot, offset)
            seen.append(on_fleet)
    share = np.mean(seen)
    assert 0.1 < share < 0.9  # the draws decide: neither everyone nor no one


def test_simulate_drops_the_devices_the_fleet_would_drop_in_the_same_round():
    cfg = parse_config(CONFIG)
    part = Participation(cfg.participation, SIZE, cfg.dp.report_goal, 12, SEED, devices=cfg.devices)
    fleet = [fleet_device(cfg, d) for d in range(SIZE)]
    dropped = 0
    for r in range(12):
        sel = part.propose(r)
        expected = [d for d in sel.selected  # attempt: > 0 after an attempt in which all dropped
                    if any(fleet[d].drops(phase, r + 1, sel.attempt + 1) for phase in PLAIN_PHASES)]
        assert sel.dropped == expected
        # and the fleet's availability at the round's start agrees on every selected device
        t = sel.slot * ROUND_MINUTES * 60.0
        assert all(fleet[d].eligible(t, (t / 3600.0) % 24.0) for d in sel.selected)
        dropped += len(sel.dropped)
        part.commit(sel, sel.devices)
    assert dropped > 0  # 1 - 0.8 x 0.7 x 0.9 = 50 % of the selected drop somewhere


@pytest.mark.parametrize("section, key", [
    ("participation", "availability"), ("participation", "diurnal_amplitude"),
    ("participation", "trace"), ("participation", "train_minutes"), ("participation", "train_jitter"),
    ("fleet", "charging_hours"), ("fleet", "idle"), ("fleet", "dropout_secagg"), ("fleet", "latency_ms"),
])
def test_an_old_device_key_is_one_line_naming_its_new_key(section, key):
    with pytest.raises(DpfleetError) as exc:
        parse_config({section: {key: 1.0}})
    assert str(exc.value) == f"config key '{section}.{key}' moved to 'devices.{key}'"


def test_bad_device_keys_are_one_line():
    for devices, message in (({"train_minutes": 0.0}, "devices.train_minutes must be > 0"),
                             ({"train_jitter": 4.0}, "devices.train_jitter must be in [0, 3]"),
                             ({"availability": 0.0}, "devices.availability must be in (0, 1]")):
        with pytest.raises(DpfleetError, match=message.replace("[", r"\[").replace("(", r"\(")):
            parse_config({"participation": {"mode": "timer"}, "devices": devices})


def test_with_device_failure_draws_a_trace_drops_the_same_devices_in_simulate_and_the_fleet(tmp_path):
    """`devices.failure_draws = "device"`: a trace's failure chance is drawn per (device, round,
    attempt) as the fleet draws it; the default "round" keeps recorded runs (test_production_rounds)."""
    from test_production_rounds import busy_trace

    from dpfleet.edge.traces import load_replay

    trace = busy_trace(tmp_path / "t.jsonl", failure_mean=0.4)
    cfg = parse_config({"participation": {"mode": "timer", "timer_period": 1.0, "round_minutes": 30.0},
                        "devices": {"trace": str(trace), "failure_draws": "device"},
                        "dp": {"report_goal": 3}})
    part = Participation(cfg.participation, SIZE, 3, 12, 5, devices=cfg.devices)
    replay = load_replay(str(trace), SIZE)
    fleet = [Behaviour(cfg.devices, 5, d, replay, 30.0) for d in range(SIZE)]
    dropped = 0
    for r in range(12):
        sel = part.propose(r)
        assert sel.dropped == [d for d in sel.selected if fleet[d].drops("train", r + 1, sel.attempt + 1)]
        dropped += len(sel.dropped)
        part.commit(sel, sel.devices)
    assert dropped > 0
    with pytest.raises(DpfleetError, match="must be one of"):
        parse_config({"devices": {"failure_draws": "slot"}})
