"""Replaying an availability trace (`devices.trace`): simulate's timer mode selects only
devices the trace says are available, drops them by its failure chance, and a tiny run accounts
exactly the participation it committed."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.config import ParticipationSection, parse_config
from dpfleet.coordinator.engine.participation import Participation
from dpfleet.coordinator.engine.restore import replay
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.edge.devices import DevicesSection
from dpfleet.edge.trace_gen import GeneratorSettings, generate
from dpfleet.edge.traces import TraceReplay, load, write_trace
from dpfleet.errors import DpfleetError

H = 3600


def write_hand_trace(path, failure3=None):
    """Four devices over 6 hours; a round every hour, so round slot s reads the trace at s h
    (mod 6 h: the trace repeats after its duration).
      device 0: [0 h, 2 h)            -> available in slots 0, 1
      device 1: [0 h, 1 h), [3 h, 4 h) -> slots 0, 3
      device 2: [1 h, 3 h)            -> slots 1, 2
      device 3: [2 h, 6 h)            -> slots 2, 3, 4, 5"""
    lines = [{"format": "dpfleet-trace", "version": 1, "duration": 6 * H},
             {"id": "a", "intervals": [[0, 2 * H]]},
             {"id": "b", "intervals": [[0, H], [3 * H, 4 * H]]},
             {"id": "c", "intervals": [[H, 3 * H]]},
             {"id": "d", "intervals": [[2 * H, 6 * H]],
              **({} if failure3 is None else {"failure": failure3})}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def hand_participation(path) -> Participation:
    # report goal 2, a 2 h timer at 1 h rounds: a device returns 2 slots after it took part
    section = ParticipationSection(mode="timer", timer_period=2.0, round_minutes=60.0)
    return Participation(section, 4, 2, 4, seed=3, devices=DevicesSection(trace=str(path)))


def drive(part: Participation, rounds: int):
    sels = []
    for r in range(rounds):
        sel = part.propose(r)
        part.commit(sel, sel.devices)
        sels.append(sel)
    return sels


def test_a_hand_written_trace_forces_the_participation_pattern(tmp_path):
    # by hand, with timers (ready = slot + 2) and the wrap at 6 h:
    # round 0, slot 0: available {0, 1}                          -> {0, 1}; ready at slot 2
    # round 1, slot 1: available {0, 2}, 0's timer runs -> {2}: wait; slot 2: {2, 3} -> {2, 3}
    # round 2, slot 3: {1, 3}, 3 waits; slot 4, 5: {3}; slot 6 (= 0 h again): {0, 1} -> {0, 1}
    # round 3, slot 7 (1 h): {0, 2}, 0 waits; slot 8 (2 h): {2, 3}         -> {2, 3}
    sels = drive(hand_participation(write_hand_trace(tmp_path / "t.jsonl")), 4)
    assert [s.devices for s in sels] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [s.slot for s in sels] == [0, 2, 6, 8]
    assert [s.waited_slots for s in sels] == [0, 1, 3, 1]
    assert all(s.dropped == [] for s in sels)


def test_the_trace_failure_drops_a_device_from_the_sum_and_starts_its_timer(tmp_path):
    # device 3 always fails: rounds 1 and 3 keep only device 2; 3's timer still starts at slot 2,
    # so in round 2 (slot 4: only 3 is available) nothing changes from the pattern above
    part = hand_participation(write_hand_trace(tmp_path / "t.jsonl", failure3=1.0))
    sels = drive(part, 4)
    assert [s.devices for s in sels] == [[0, 1], [2], [0, 1], [2]]
    assert [s.dropped for s in sels] == [[], [3], [], [3]]
    assert [s.slot for s in sels] == [0, 2, 6, 8]
    assert part.guard.count.tolist() == [2, 2, 2, 0]  # the guard records only who contributed
    assert part.guard.count[3] == 0 and part.slotted.ready_slot[3] == 8 + 2


def test_replay_maps_clients_onto_devices_and_wraps_time(tmp_path):
    trace = load(write_hand_trace(tmp_path / "t.jsonl"))
    replay = TraceReplay(trace, 6)  # clients 4, 5 replay devices 0, 1
    assert replay.eligible(0).tolist() == [True, True, False, False, True, True]
    assert replay.eligible(6 * H + 2.5 * H).tolist() == [False, False, True, True, False, False]
    for t in np.arange(0, 13 * H, 900.0):
        assert [replay.client_eligible(c, t) for c in range(6)] == replay.eligible(t).tolist()
    # the next change: device 1 leaves at 1 h, is back at 3 h, leaves at 4 h, then the wrap (6 h)
    assert [replay.next_change(1, t) for t in (0, H, 3.5 * H, 4 * H)] == [H, 3 * H, 4 * H, 6 * H]
    assert replay.next_change(3, 6 * H + 3 * H) == 12 * H  # inside [2 h, 6 h) of the second pass
    with pytest.raises(DpfleetError, match="no devices"):
        TraceReplay(load(_empty(tmp_path / "e.jsonl")), 3)


PERIODIC = ('{"format": "dpfleet-trace", "version": 1, "duration": 20000}\n'
            '{"id": "p", "intervals": [[100, 900], [2000, 2500]], "period": 3000}\n'
            '{"id": "q", "intervals": [[0, 20000]]}\n'
            '{"id": "r", "intervals": []}\n'
            '{"id": "s", "intervals": [[19000, 20000]]}\n')


@settings(max_examples=80, deadline=None)
@given(t=st.floats(0, 10 * 20000), client=st.integers(0, 3))
def test_eligibility_is_constant_until_the_next_change(tmp_path_factory, t, client):
    # a periodic device whose period does not divide the duration, an always-on one (no change
    # but the wrap), one never available, one whose interval ends at the wrap
    path = tmp_path_factory.getbasetemp() / "periodic.jsonl"
    if not path.exists():
        path.write_text(PERIODIC)
    replay = TraceReplay(load(path), 4)
    nxt = replay.next_change(client, t)
    assert t < nxt <= (t // 20000 + 1) * 20000  # never past the wrap
    now = replay.client_eligible(client, t)
    for frac in (0.01, 0.5, 0.99):
        x = t + frac * (nxt - t)
        if x < nxt:  # (a gap of a few ulps rounds onto its end)
            assert replay.client_eligible(client, x) == now == bool(replay.eligible(t)[client])


def _empty(path):
    path.write_text('{"format": "dpfleet-trace", "version": 1, "duration": 60}\n')
    return path


TINY = {
    "rounds": 6, "eval_every": 6, "seed": 5,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 200, "max_examples": 16,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 3},
}


@pytest.fixture(scope="module")
def generated_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay")
    trace_path = folder / "trace.jsonl"
    # a busier day than the FLASH-like default, so 2 of a dozen devices are often available at once
    busy = GeneratorSettings(sessions_per_day=4, night_hours=8, timezone_spread=2)
    write_trace(trace_path, generate(40, days=1, seed=4, settings=busy))
    cfg = parse_config({**TINY, "dp": {**TINY["dp"], "report_goal": 2},
                        "participation": {"mode": "timer", "timer_period": 1.0, "round_minutes": 30.0},
                        "devices": {"trace": str(trace_path)}})
    result = run_simulation(cfg, folder / "run", progress=False, log=lambda s: None)
    return result, load(trace_path), cfg


def test_a_generated_trace_runs_end_to_end_inside_its_intervals(generated_run):
    result, trace, cfg = generated_run
    assert result.stopped_early is None and len(result.metrics) == 6
    log = [json.loads(x) for x in (result.run_dir / "participation.jsonl").read_text().splitlines()]
    # the engine's rounds are the participation control's, driven alone on the same trace and seed
    size = json.loads((result.run_dir / "privacy.json").read_text())["population"]
    part = Participation(cfg.participation, size, 2, 6, seed=TINY["seed"], devices=cfg.devices)
    sels = drive(part, 6)
    assert [len(e["devices"]) for e in log] == [len(s.devices) for s in sels]
    assert [m["clock_hours"] for m in result.metrics] == [part.hours(s.slot) for s in sels]
    replay = TraceReplay(trace, size)
    for s in sels:  # every selected device (dropped or not) was inside an interval at the round
        available = replay.eligible(s.slot * 30 * 60.0)
        assert available[s.devices + s.dropped].all() and len(s.devices) + len(s.dropped) == 2
    # the accountant read what was committed: the log, dropouts excluded
    ref = account_participation_log(result.run_dir / "participation.jsonl", 1.0, 1e-6)
    assert result.privacy["epsilon"] == pytest.approx(ref["epsilon"], rel=1e-9)


@pytest.mark.parametrize("participation, devices, message", [
    ({"mode": "timer"}, {"availability": 0.5}, "devices.trace and devices.availability"),
    ({"mode": "uniform"}, {}, "devices.trace is replayed in timer mode"),
    ({"mode": "timer"}, {"idle": 0.5}, "devices.trace and devices.charging_hours"),
    ({"mode": "timer"}, {"trace_missing": True}, "no such trace file"),
])
def test_a_bad_trace_setting_is_one_error_line(tmp_path, capsys, participation, devices, message):
    trace = write_hand_trace(tmp_path / "t.jsonl")
    missing = devices.pop("trace_missing", False)
    cfg = {**TINY, "participation": participation, "devices": {
        **devices, "trace": str(tmp_path / "nope.jsonl") if missing else str(trace)}}
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code != 0 and err[-1].startswith("error: ") and message in err[-1]
    assert len([line for line in err if line.startswith("error")]) == 1 and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_replays_the_same_trace_rounds_and_dropouts(tmp_path):
    # resume rebuilds participation by proposing the logged rounds again: the trace's waits and
    # its seeded dropouts must come out the same, or a resumed run is refused as another run
    path = write_hand_trace(tmp_path / "t.jsonl", failure3=0.5)
    first = hand_participation(path)
    sels = drive(first, 4)
    assert [s.dropped for s in sels] == [[], [3], [], [3]]  # device 3's draws at p = 0.5 (seed 3)
    logged = [{"round": s.round, "devices": [f"u{i}" for i in s.devices], "restart": False}
              for s in sels]
    again = hand_participation(path)
    replay(again, RunAccountant(1.0, 1e-6), logged, [f"u{i}" for i in range(4)])
    assert again.slot == first.slot and again.slotted.ready_slot.tolist() == first.slotted.ready_slot.tolist()
    assert again.guard.count.tolist() == first.guard.count.tolist()
    assert again.propose(4) == first.propose(4)
