"""The one round driver's rule for a short round, in `simulate` (`round_driver.drive` with the
in-process collector; serve's side: tests/test_service_parity.py, tests/test_service_secagg.py):
fewer inputs than the report goal in the sum -> abandoned (nothing released) and opened again
under the same number; a seeded `aggregation.dropout` that would starve every round is one
error line; with over-selection headroom its rounds commit with the goal's inputs."""

import json

import pytest
from service_fleet import tiny_cfg

from dpfleet.coordinator.engine.round_driver import survivors_short
from dpfleet.coordinator.engine.simulation import InProcessCollector, run_simulation
from dpfleet.errors import DpfleetError

SECAGG = {"aggregation": {"kind": "secagg"}, "rounds": 2, "eval_every": 2}


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_round_commits_with_the_report_goal_or_every_device_a_timer_round_closed_with():
    cfg = tiny_cfg()  # report goal 3

    class Plan:  # what the rule reads of a RoundPlan
        def __init__(self, n):
            self.devices = list(range(n))

    assert survivors_short(cfg, Plan(5), 3) is None  # over-selected: the goal suffices
    assert survivors_short(cfg, Plan(5), 2) == "2 of the round's 5 devices are in the sum, it needs 3"
    assert survivors_short(cfg, Plan(2), 2) is None  # a timer round closed with 2 (min_reports)
    assert survivors_short(cfg, Plan(2), 1) == "1 of the round's 2 devices are in the sum, it needs 2"


def test_a_round_short_of_the_goal_is_abandoned_and_opened_again(tmp_path, monkeypatch):
    cfg = tiny_cfg(**SECAGG)
    plain = run_simulation(cfg, tmp_path / "all", progress=False, log=lambda s: None)
    attempts = []

    def schedule(plan, attempt):  # round 1's first attempt: its first device never masks
        attempts.append((plan.round + 1, attempt))
        return {"mask": [0]} if (plan.round + 1, attempt) == (1, 1) else {}

    monkeypatch.setattr(InProcessCollector, "dropout_schedule", staticmethod(schedule))
    said = []
    run = run_simulation(cfg, tmp_path / "drop", progress=False, log=said.append)
    assert attempts == [(1, 1), (1, 2), (2, 1)]
    # 2 of 3 left before masking: below the threshold t = 2 for the dropped device's shares
    assert [s for s in said if "abandoned" in s] == [
        "round 1 (attempt 1) abandoned: secure aggregation aborted: client 1: 1 shares returned, "
        "threshold 2: abort"]
    assert [m["round"] for m in run.metrics] == [1, 2]
    assert [m["clients"] for m in run.metrics] == [3, 3]
    # nothing of the abandoned attempt was released or accounted: the same devices, the same eps
    assert lines(tmp_path / "drop" / "participation.jsonl") == lines(tmp_path / "all" / "participation.jsonl")
    assert [m["epsilon"] for m in run.metrics] == [m["epsilon"] for m in plain.metrics]
    assert len(lines(tmp_path / "drop" / "releases.jsonl")) == len(lines(tmp_path / "all" / "releases.jsonl"))


def test_a_seeded_dropout_without_over_selection_is_one_error(tmp_path):
    cfg = tiny_cfg(**{**SECAGG, "aggregation": {"kind": "secagg", "dropout": 0.34}})
    with pytest.raises(DpfleetError, match=r"^aggregation.dropout = 0.34 drops 1 of a round's 3 "
                                           r"devices, .* raise service.overselect$"):
        run_simulation(cfg, tmp_path / "run", progress=False, log=lambda s: None)


def test_a_seeded_dropout_with_over_selection_commits_the_goal(tmp_path):
    # report goal 3, overselect 0.34: 3 + ceil(1.02) = 5 devices; round(0.2 x 5) = 1 vanishes
    cfg = tiny_cfg(**{**SECAGG, "aggregation": {"kind": "secagg", "dropout": 0.2},
                      "service": {"overselect": 0.34}})
    run = run_simulation(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    assert [m["clients"] for m in run.metrics] == [4, 4]
    assert [m["aggregation"]["survivors"] for m in run.metrics] == [4, 4]
    assert [len(e["devices"]) for e in lines(tmp_path / "run" / "participation.jsonl")] == [4, 4]


def test_a_round_that_always_aborts_stops_the_run_with_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(InProcessCollector, "dropout_schedule",
                        staticmethod(lambda plan, attempt: {"commit": [0]}))  # every attempt
    said = []
    with pytest.raises(DpfleetError, match=r"^round 1 was abandoned 10 times in a row \(secure "
                                           r"aggregation aborted: .*\); raise service.overselect"):
        run_simulation(tiny_cfg(**SECAGG), tmp_path / "run", progress=False, log=said.append)
    assert sum(" abandoned: " in s for s in said) == 10
    releases = tmp_path / "run" / "releases.jsonl"
    assert not releases.is_file() or not lines(releases)  # nothing released
