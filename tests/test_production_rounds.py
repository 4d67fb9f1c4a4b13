"""Rounds as production runs them (Bonawitz et al. 2019): timer mode over-selects, each selected
device reports at its speed class's time, the round closes at the report goal or the deadline,
and only the committed devices are trained, summed and accounted."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trace_replay import TINY  # the same tiny run

from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.config import ParticipationSection, parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.engine.participation import Participation, RoundUnfillable
from dpfleet.coordinator.engine.restore import replay
from dpfleet.coordinator.engine.simulation import run_simulation, train_plan
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.edge.devices import DevicesSection
from dpfleet.edge.trace_gen import GeneratorSettings, generate
from dpfleet.edge.traces import write_trace
from dpfleet.errors import DpfleetError

DAY = 86400
# speed classes: fast x0.5, mid x1, slow x2.5 of train_minutes = 4: 2, 4 and 10 minutes
SPEEDS = ["fast", "fast", "mid", "mid", "mid", "slow", "slow", "slow", "slow", "slow"]


def write_speed_trace(path, late_fast=0):
    """Devices 0..9 always available with the speeds above; `late_fast` more fast devices that
    become available 10 minutes in (round slot 1 at 10-minute rounds)."""
    lines = [{"format": "dpfleet-trace", "version": 1, "duration": DAY}]
    lines += [{"id": str(i), "intervals": [[0, DAY]], "speed": s} for i, s in enumerate(SPEEDS)]
    lines += [{"id": f"f{i}", "intervals": [[600, DAY]], "speed": "fast"} for i in range(late_fast)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def speed_participation(path, size, goal, timer_hours=1.0, **keys) -> Participation:
    section = ParticipationSection(mode="timer", timer_period=timer_hours, round_minutes=10.0, **keys)
    devices = DevicesSection(trace=str(path), train_minutes=4.0, train_jitter=0.0)
    return Participation(section, size, goal, 20, seed=1, devices=devices)


def test_the_round_closes_at_the_goal_and_the_rest_are_over_it(tmp_path):
    # goal 4, over-selection 2.5: all 10 selected. Reports at 2, 2, 4, 4, 4, 10 x5 minutes: the
    # first 4 (ties: the lower device) commit at minute 4; device 4 and the slow ones are told
    # to stop (over the goal); nobody misses the 8-minute deadline, which never comes
    part = speed_participation(write_speed_trace(tmp_path / "t.jsonl"), 10, 4, over_selection=2.5,
                               deadline_minutes=8.0)
    sel = part.propose(0)
    assert sel.selected == list(range(10))
    assert sel.devices == [0, 1, 2, 3] and sel.over_goal == [4, 5, 6, 7, 8, 9] and sel.late == []
    assert sel.minutes == 4.0 and sel.abandoned == ()
    assert sel.outcome() == {"selected": 10, "failed": 0, "missed_deadline": 0, "over_goal": 6,
                             "committed": 4, "abandoned": 0, "abandoned_selected": 0,
                             "round_duration_minutes": 4.0}


def test_the_slow_devices_miss_the_deadline(tmp_path):
    # goal 6: only 5 devices report by the 8-minute deadline (2, 2, 4, 4, 4 minutes); the slow
    # ones (10 minutes) miss it and the round closes at the deadline with 5 (min_reports 0: any)
    part = speed_participation(write_speed_trace(tmp_path / "t.jsonl"), 10, 6, over_selection=2.0,
                               deadline_minutes=8.0)
    sel = part.propose(0)
    assert sel.devices == [0, 1, 2, 3, 4] and sel.late == [5, 6, 7, 8, 9] and sel.over_goal == []
    assert sel.minutes == 8.0
    part.commit(sel, sel.devices)
    assert part.guard.count.tolist() == [1] * 5 + [0] * 5
    assert part.slotted.ready_slot.tolist() == [6] * 10  # every selected device's timer runs (1 h)


def test_an_abandoned_round_retries_and_its_devices_timers_run(tmp_path):
    # goal 6, min_reports 6, 12 devices (10, 11 fast, available from slot 1). Slot 0: devices
    # 0..9 selected, 5 report by the deadline < 6: abandoned, their 1 h timers (6 slots) start.
    # Slots 1..5: only 10, 11 check in (2 < 6): wait. Slot 6: all 12 selected (ceil(2 x 6) = 12);
    # in time: 0, 1, 10, 11 (2 min), 2, 3, 4 (4 min): the first 6 are 0, 1, 10, 11, 2, 3, closing
    # at minute 4; 4 and the slow ones are over the goal
    part = speed_participation(write_speed_trace(tmp_path / "t.jsonl", late_fast=2), 12, 6,
                               over_selection=2.0, deadline_minutes=8.0, min_reports=6)
    sel = part.propose(0)
    assert sel.abandoned == ((0, tuple(range(10))),)
    assert sel.slot == 6 and sel.waited_slots == 6
    assert sel.devices == [0, 1, 2, 3, 10, 11] and sel.over_goal == [4, 5, 6, 7, 8, 9]
    assert sel.minutes == 4.0 and sel.outcome()["abandoned_selected"] == 10
    assert part.slotted.ready_slot.tolist() == [0] * 12  # propose changed nothing
    part.commit(sel, sel.devices)
    assert part.guard.count.tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert part.slotted.ready_slot.tolist() == [12] * 12  # the later round's timers


def test_a_round_that_never_fills_min_reports_stops_cleanly(tmp_path):
    part = speed_participation(write_speed_trace(tmp_path / "t.jsonl"), 10, 6, over_selection=2.0,
                               deadline_minutes=8.0, min_reports=6)
    # 5 of 10 report by the deadline in every attempt: abandoned at slots 0, 6, ... (the 6-slot
    # timers) up to the 30-day wait, 30 x 24 x 6 = 4320 slots: 4320 / 6 + 1 = 721 attempts
    with pytest.raises(RoundUnfillable, match=r"round 0 was abandoned 721 times in 30 simulated days: "
                                              r"fewer than participation.min_reports = 6"):
        part.propose(0)


def test_min_reports_above_a_smaller_goal_means_the_goal(tmp_path):
    # a planner may try report goal 4 with a section whose min_reports is 6: no commit below 4
    part = speed_participation(write_speed_trace(tmp_path / "t.jsonl"), 10, 4, over_selection=2.5,
                               deadline_minutes=8.0, min_reports=6)
    assert part.min_reports == 4 and part.propose(0).devices == [0, 1, 2, 3]


def test_over_goal_devices_are_never_contributors(tmp_path):
    # no timer (MinS 0): every round selects all 10 and commits 0..3 (the fast and first mid);
    # over 5 rounds the guard and the accountant see exactly them, 5 times each
    part = speed_participation(write_speed_trace(tmp_path / "t.jsonl"), 10, 4, timer_hours=0.0,
                               over_selection=2.5)
    accountant = RunAccountant(1.0, 1e-6)
    for r in range(5):
        sel = part.propose(r)
        assert sel.devices == [0, 1, 2, 3] and len(sel.over_goal) == 6
        part.commit(sel, sel.devices)
        spent = accountant.record([str(d) for d in sel.devices], False)
    assert part.guard.count.tolist() == [5, 5, 5, 5, 0, 0, 0, 0, 0, 0]
    assert spent["max_participation"] == 5 and spent["min_separation"] == 0
    assert sorted(accountant.count) == ["0", "1", "2", "3"]


def busy_trace(path, failure_mean=0.1, seed=4):
    busy = GeneratorSettings(sessions_per_day=4, night_hours=8, timezone_spread=2, failure_mean=failure_mean)
    write_trace(path, generate(40, days=1, seed=seed, settings=busy))
    return path


def test_defaults_select_exactly_as_before(tmp_path):
    # recorded with the code before over-selection: (slot, devices, dropped) of 12 rounds on a
    # generated trace with many failures (slot 2's draw: all three dropped, retried at slot 3)
    before = [(0, [12, 19, 21], []), (1, [6, 10, 25], []), (3, [3, 12], [24]), (4, [18, 20], [11]),
              (5, [3, 19], [12]), (6, [2, 10], [1]), (7, [6, 15, 21], []), (8, [7, 11], [2]),
              (9, [15, 17, 18], []), (10, [21], [12, 24]), (11, [11, 18], [15]), (12, [2, 12], [24])]
    section = ParticipationSection(mode="timer", timer_period=1.0, round_minutes=30.0)
    devices = DevicesSection(trace=str(busy_trace(tmp_path / "t.jsonl", failure_mean=0.4)))
    part = Participation(section, 30, 3, 12, seed=5, devices=devices)
    got = []
    for r in range(12):
        sel = part.propose(r)
        part.commit(sel, sel.devices)
        got.append((sel.slot, sel.devices, sel.dropped))
        assert sel.late == [] and sel.over_goal == [] and sel.abandoned == ()
    assert got == before


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), goal=st.integers(1, 6), over=st.floats(1.0, 3.0),
       deadline=st.sampled_from([0.0, 3.0, 6.0, 10.0]), min_reports=st.integers(0, 6),
       trace_seed=st.integers(0, 3))
def test_committed_devices_are_the_goal_at_most_selected_and_in_time(tmp_path_factory, seed, goal, over,
                                                                      deadline, min_reports, trace_seed):
    path = tmp_path_factory.getbasetemp() / f"busy{trace_seed}.jsonl"
    if not path.exists():
        busy_trace(path, failure_mean=0.3, seed=trace_seed)
    section = ParticipationSection(mode="timer", timer_period=1.0, round_minutes=10.0,
                                   over_selection=over, deadline_minutes=deadline,
                                   min_reports=min(min_reports, goal))
    devices = DevicesSection(trace=str(path), train_minutes=3.0)
    part = Participation(section, 30, goal, 4, seed=seed, devices=devices)
    for r in range(3):
        try:
            sel = part.propose(r)
        except RoundUnfillable:
            return
        assert 1 <= len(sel.devices) <= goal and len(sel.devices) >= min(min_reports, goal)
        assert set(sel.devices) <= set(sel.selected) and len(sel.selected) <= max(goal, np.ceil(over * goal))
        chosen = np.array(sel.selected)
        finish = part.slotted.finish_minutes(chosen, r, sel.slot, 3.0, devices.train_jitter)
        at = dict(zip(chosen.tolist(), finish.tolist(), strict=True))
        assert all(at[d] <= sel.minutes for d in sel.devices)  # every committed device reported in time
        assert all(at[d] >= sel.minutes for d in sel.over_goal)
        if deadline:
            assert sel.minutes <= deadline and all(at[d] > deadline for d in sel.late)
        part.commit(sel, sel.devices)


@pytest.mark.parametrize("keys, message", [
    ({"over_selection": 0.5}, "participation.over_selection must be in [1, 100]"),
    ({"deadline_minutes": 45.0}, "participation.deadline_minutes must be in [0, round_minutes = 30]"),
    ({"min_reports": 4}, "participation.min_reports must be in [0, dp.report_goal = 3]"),
    ({"mode": "uniform", "over_selection": 1.5}, "close rounds on the simulated clock of timer mode"),
])
def test_bad_round_close_keys_are_one_line(keys, message):
    with pytest.raises(DpfleetError) as exc:  # parse_config validates
        parse_config({"dp": {"report_goal": 3},
                      "participation": {"mode": "timer", "round_minutes": 30.0, **keys}})
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.fixture(scope="module")
def production_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prodrounds")
    trace = busy_trace(folder / "trace.jsonl")
    cfg = parse_config({**TINY, "participation": {
        "mode": "timer", "timer_period": 1.0, "round_minutes": 30.0, "over_selection": 1.3,
        "deadline_minutes": 15.0}, "devices": {"trace": str(trace), "train_minutes": 8.0}})
    lines, trained = [], []

    def spy(cfg, trainer, clients, plan):  # who the in-process trainer is asked to train
        trained.append(list(plan.devices))
        return train_plan(cfg, trainer, clients, plan)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulation, "train_plan", spy)
        result = run_simulation(cfg, folder / "run", progress=False, log=lines.append)
    return result, lines, trained


def test_a_tiny_run_records_how_rounds_closed_and_accounts_only_the_committed(production_run):
    result, lines, trained = production_run
    assert result.stopped_early is None and len(result.metrics) == 6
    log = [json.loads(x) for x in (result.run_dir / "participation.jsonl").read_text().splitlines()]
    for m, entry in zip(result.metrics, log, strict=True):
        # ceil(1.3 x 3) = 4 selected (3 when only 3 checked in); committed = trained and summed
        # = the participation log
        assert m["selected"] in (3, 4) and m["committed"] == m["clients"] == len(entry["devices"]) <= 3
        assert m["selected"] == m["committed"] + m["failed"] + m["missed_deadline"] + m["over_goal"]
        assert 0 < m["round_duration_minutes"] <= 15.0
    # the trainer never spent time on a device that missed the deadline or was over the goal
    assert [len(t) for t in trained] == [m["committed"] for m in result.metrics]
    assert sum(m["selected"] for m in result.metrics) > 18  # over-selection did something
    assert sum(m["over_goal"] + m["missed_deadline"] for m in result.metrics) > 0
    ref = account_participation_log(result.run_dir / "participation.jsonl", 1.0, 1e-6)
    privacy = json.loads((result.run_dir / "privacy.json").read_text())
    assert privacy["epsilon"] == pytest.approx(ref["epsilon"], rel=1e-9)
    closes = json.loads((result.run_dir / "summary.json").read_text())["round_close"]
    assert closes["rounds_committed"] == 6
    assert closes["selected"] == sum(m["selected"] for m in result.metrics)
    assert closes["committed"] == sum(len(e["devices"]) for e in log)
    assert any(line.startswith("rounds: 6 committed, ") for line in lines)


def test_a_resumed_run_replays_over_selection_and_abandoned_rounds(tmp_path):
    # resume re-proposes the logged rounds: the abandoned attempts and their timers must come out
    # the same, or a resumed run is refused as another run (or selects other devices next)
    path = write_speed_trace(tmp_path / "t.jsonl", late_fast=2)
    keys = {"over_selection": 2.0, "deadline_minutes": 8.0, "min_reports": 6, "min_separation": 0}
    first = speed_participation(path, 12, 6, **keys)
    sels = []
    for r in range(3):
        sels.append(first.propose(r))
        first.commit(sels[-1], sels[-1].devices)
    assert sels[0].abandoned == ((0, tuple(range(10))),) and [s.slot for s in sels] == [6, 12, 18]
    logged = [{"round": s.round, "devices": [f"u{i}" for i in s.devices], "restart": False} for s in sels]
    again = speed_participation(path, 12, 6, **keys)
    replay(again, RunAccountant(1.0, 1e-6), logged, [f"u{i}" for i in range(12)])
    assert again.slot == first.slot and again.slotted.ready_slot.tolist() == first.slotted.ready_slot.tolist()
    assert again.guard.count.tolist() == first.guard.count.tolist()
    assert again.propose(3) == first.propose(3)
