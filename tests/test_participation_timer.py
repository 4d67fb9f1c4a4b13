"""Device timers on a simulated clock, and the coordinator's MinS / MaxP refusal behind them."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.planner import max_min_separation, timer_for
from dpfleet.coordinator.accounting.zcdp import observe_participation
from dpfleet.coordinator.config import ParticipationSection, parse_config
from dpfleet.coordinator.engine.participation import Participation, ParticipationGuard, RoundUnfillable
from dpfleet.edge.devices import Availability, DevicesSection, SlottedDevices, timer_slots
from dpfleet.errors import DpfleetError


def run_rounds(part: Participation, rounds: int) -> tuple[list[dict], list]:
    """Drive the participation control alone (every selected device contributes)."""
    log, selections = [], []
    for r in range(rounds):
        sel = part.propose(r)
        part.commit(sel, sel.devices)
        log.append({"round": r, "devices": [f"d{i}" for i in sel.devices]})
        selections.append(sel)
    return log, selections


class IgnoresTimer(SlottedDevices):
    """A misbehaving fleet: every device checks in every slot, timers or not."""

    def check_in(self, slot):
        return np.arange(self.size)


def timer_section(**kw) -> ParticipationSection:
    return ParticipationSection(**{"mode": "timer", "round_minutes": 10.0, **kw})


def test_timer_slots_round_up_exactly():
    assert timer_slots(24, 10) == 144
    assert timer_slots(24, 7.2) == 200  # 200.00000000000003 in floating point
    assert timer_slots(1, 25) == 3 and timer_slots(0, 10) == 0
    with pytest.raises(DpfleetError, match="round duration"):
        timer_slots(1, 0)


def test_diurnal_availability_peaks_at_night():
    a = Availability(0.5, diurnal_amplitude=0.8, peak_hour=2.0)
    assert a.at(2.0) == pytest.approx(0.9) and a.at(14.0) == pytest.approx(0.1)
    assert Availability(0.9, 1.0).at(2.0) == 1.0  # clipped to a probability
    with pytest.raises(DpfleetError, match="availability"):
        Availability(0.0)


def test_timer_gives_its_nominal_min_separation_when_no_round_waits():
    # 1 h timer at 10-minute rounds = 6 slots: a device can return 6 rounds later (MinS 5)
    part = Participation(timer_section(timer_period=1.0), 60, 5, 30, seed=1)
    assert part.slotted.timer_slots == 6 and part.min_separation == 5
    log, sels = run_rounds(part, 30)
    obs = observe_participation(log)
    assert obs.min_separation == 5 and obs.max_participation >= 2
    assert all(s.waited_slots == 0 and s.refused == 0 for s in sels)
    assert [s.slot for s in sels] == list(range(30))
    assert part.hours(sels[-1].slot) == pytest.approx(29 * 10 / 60)


def test_the_planners_timer_reaches_the_planned_min_separation():
    mins = max_min_separation(60, 5)  # 11: a device can come back every 12th round
    timer = timer_for(mins, round_minutes=10.0)
    part = Participation(timer_section(timer_period=timer.hours), 60, 5, 40, seed=3)
    assert part.min_separation == mins
    assert observe_participation(run_rounds(part, 40)[0]).min_separation == mins


def test_waiting_advances_the_clock():
    # 10 devices, 5 per round, 3-slot timer: round 2 must wait one slot for the first five
    part = Participation(timer_section(timer_period=0.5, min_separation=1), 10, 5, 6, seed=0)
    _, sels = run_rounds(part, 6)
    assert [s.slot for s in sels] == [0, 1, 3, 4, 6, 7]
    assert [s.waited_slots for s in sels] == [0, 0, 1, 0, 1, 0]
    assert sels[2].devices == sels[0].devices


def test_low_availability_makes_rounds_wait_and_stay_reproducible():
    section = timer_section(timer_period=0.0)
    a, b = (Participation(section, 100, 8, 10, seed=4, devices=DevicesSection(availability=0.05))
            for _ in range(2))
    sels_a, sels_b = run_rounds(a, 10)[1], run_rounds(b, 10)[1]
    assert sels_a == sels_b
    assert sum(s.waited_slots for s in sels_a) > 0  # ~5 of 100 available, 8 needed
    assert sels_a[-1].slot > 9


def test_coordinator_refuses_what_a_misbehaving_timer_lets_through():
    section = timer_section(timer_period=0.0, min_separation=3)
    fleet = IgnoresTimer(12, 0.0, 10.0, Availability(), seed=0)
    part = Participation(section, 12, 3, 40, seed=2, slotted=fleet)
    log, sels = run_rounds(part, 40)
    assert observe_participation(log).min_separation == 3
    assert sum(s.refused for s in sels) > 0


def test_refusal_when_min_separation_cannot_be_met_stops_the_run():
    # 10 devices, 5 per round: a device can come back every 2nd round at best (MinS 1)
    part = Participation(timer_section(timer_period=0.5), 10, 5, 6, seed=0)
    assert part.min_separation == 2
    run_rounds(part, 2)
    with pytest.raises(RoundUnfillable, match="only 0 devices may take part in round 2"):
        part.propose(2)


def test_max_participation_cap_exhausts_the_population():
    part = Participation(ParticipationSection(mode="uniform", max_participation=2), 9, 3, 10, seed=0)
    with pytest.raises(RoundUnfillable, match="MaxP 2; the report goal is 3"):
        run_rounds(part, 7)  # 9 devices x 2 = 18 participations: at most 6 rounds of 3
    assert part.guard.count.max() == 2 and (part.guard.count < 2).sum() < 3


def test_guard_never_records_a_refused_device():
    guard = ParticipationGuard(4, min_separation=2)
    guard.record([0, 1], 0)
    assert guard.allowed(2).tolist() == [False, False, True, True]
    assert guard.allowed(3).tolist() == [True, True, True, True]
    with pytest.raises(RuntimeError, match="refused device"):
        guard.record([1], 2)


def test_disjoint_and_uniform_modes():
    disjoint = Participation(ParticipationSection(), 20, 4, 5, seed=0)
    log, _ = run_rounds(disjoint, 5)
    assert observe_participation(log).max_participation == 1
    with pytest.raises(DpfleetError, match="disjoint participation needs"):
        Participation(ParticipationSection(), 20, 4, 6, seed=0)
    uniform = Participation(ParticipationSection(mode="uniform", min_separation=2), 20, 4, 30, seed=0)
    assert observe_participation(run_rounds(uniform, 30)[0]).min_separation >= 2


def test_config_section_and_the_moved_sampling_key():
    cfg = parse_config({"participation": {"mode": "timer", "timer_period": 2},
                        "devices": {"availability": 0.5}})
    assert cfg.participation.timer_period == 2.0 and cfg.participation.mode == "timer"
    assert cfg.devices.availability == 0.5
    with pytest.raises(DpfleetError, match="'dp.sampling' moved to 'participation.mode'"):
        parse_config({"dp": {"sampling": "uniform"}})
    with pytest.raises(DpfleetError, match="must be one of"):
        parse_config({"participation": {"mode": "poisson"}})
    with pytest.raises(DpfleetError, match="devices.availability must be in"):
        parse_config({"devices": {"availability": 1.5}})


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(6, 40), goal=st.integers(1, 5), mins=st.integers(0, 6),
    cap=st.integers(0, 4), slots=st.integers(0, 8), availability=st.sampled_from([0.3, 1.0]),
    broken=st.booleans(), seed=st.integers(0, 2**16),
)
def test_observed_participation_never_breaks_the_enforced_limits(size, goal, mins, cap, slots,
                                                                 availability, broken, seed):
    goal = min(goal, size)
    section = timer_section(timer_period=slots * 10 / 60, min_separation=mins, max_participation=cap)
    fleet_cls = IgnoresTimer if broken else SlottedDevices
    fleet = fleet_cls(size, section.timer_period, 10.0, Availability(availability), seed)
    part = Participation(section, size, goal, 30, seed, slotted=fleet)
    log = []
    for r in range(30):
        try:
            sel = part.propose(r)
        except RoundUnfillable:
            break
        assert len(sel.devices) == goal == len(set(sel.devices))
        part.commit(sel, sel.devices)
        log.append({"round": r, "devices": [f"d{i}" for i in sel.devices]})
    if log:
        obs = observe_participation(log)
        assert obs.min_separation is None or obs.min_separation >= mins
        assert not cap or obs.max_participation <= cap
