"""The one round driver's rule for a short round, in `simulate` (`round_driver.drive` with the
in-process collector; serve's side: tests/test_service_parity.py, tests/test_service_secagg.py):
fewer inputs than the report goal in the sum -> abandoned (nothing released) and opened again
under the same number, the device model's SecAgg dropouts (`devices.dropout_secagg`) drawn
afresh for each attempt; a round that never commits is one error line; with over-selection
headroom its rounds commit with the goal's inputs."""

import json

import pytest
from service_fleet import tiny_cfg

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.round_driver import survivors_short
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.serve_plan import check_service_config
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


def test_a_round_short_of_the_goal_is_abandoned_and_opened_again(tmp_path):
    cfg = tiny_cfg(**SECAGG)
    plain = run_simulation(cfg, tmp_path / "all", progress=False, log=lambda s: None)
    # devices.dropout_secagg = 0.02, seed 5: of the draws drop_draw(5, device, round, attempt,
    # phase), round 1's devices 0, 2, 7 (attempt 1) draw none below 0.02 (least: 0.04); round 2's
    # 1, 2, 4 draw 0.018 for device 2 in "share" at attempt 1 and none below 0.059 at attempt 2
    said = []
    run = run_simulation(tiny_cfg(**SECAGG, devices={"dropout_secagg": 0.02}), tmp_path / "drop",
                         progress=False, log=said.append)
    assert [s for s in said if "SecAgg dropouts" in s] == [
        "round 2 (attempt 1): SecAgg dropouts (share: a-midsummer-night-s-dream/COBWEB)"]
    # 2 of 3 left before sharing: below the threshold t = 2 for the dropped device's shares
    abandoned = [s for s in said if "abandoned" in s]
    assert len(abandoned) == 1
    assert abandoned[0].startswith("round 2 (attempt 1) abandoned: secure aggregation aborted: ")
    assert [m["round"] for m in run.metrics] == [1, 2]
    assert [m["clients"] for m in run.metrics] == [3, 3]
    # nothing of the abandoned attempt was released or accounted: the same devices, the same eps
    assert lines(tmp_path / "drop" / "participation.jsonl") == lines(tmp_path / "all" / "participation.jsonl")
    assert [m["epsilon"] for m in run.metrics] == [m["epsilon"] for m in plain.metrics]
    assert len(lines(tmp_path / "drop" / "releases.jsonl")) == len(lines(tmp_path / "all" / "releases.jsonl"))


def test_the_old_seeded_dropout_key_names_the_device_model_key():
    with pytest.raises(DpfleetError) as exc:
        parse_config({"aggregation": {"kind": "secagg", "dropout": 0.2}})
    assert str(exc.value) == "config key 'aggregation.dropout' moved to 'devices.dropout_secagg'"


def test_secagg_dropouts_with_over_selection_commit_the_goal(tmp_path):
    # report goal 3, overselect 0.34: 3 + ceil(1.02) = 5 devices, round 1's 0, 1, 5, 6, 7 and round
    # 2's 0, 1, 3, 5, 7 (ALL, BOTTOM, EGEUS, FAIRY, HELENA). dropout_secagg 0.1, seed 5, the draws
    # below 0.1 (each device's first): round 1 attempt 1, device 0 0.040 "advertise" and device 5
    # 0.091 "share" (two gone: abandoned); attempt 2, device 5 0.097 "commit"; round 2 attempt 1,
    # device 7 0.089 "mask" and device 1 0.081 "unmask" (abandoned); attempt 2, device 1 0.059 "mask"
    cfg = tiny_cfg(**{**SECAGG, "service": {"overselect": 0.34}, "devices": {"dropout_secagg": 0.1}})
    said = []
    run = run_simulation(cfg, tmp_path / "run", progress=False, log=said.append)
    who = "a-midsummer-night-s-dream/"
    assert [s for s in said if "SecAgg dropouts" in s] == [
        f"round 1 (attempt 1): SecAgg dropouts (advertise: {who}ALL; share: {who}FAIRY)",
        f"round 1 (attempt 2): SecAgg dropouts (commit: {who}FAIRY)",
        f"round 2 (attempt 1): SecAgg dropouts (mask: {who}HELENA; unmask: {who}BOTTOM)",
        f"round 2 (attempt 2): SecAgg dropouts (mask: {who}BOTTOM)"]
    assert [s.split(" abandoned")[0] for s in said if " abandoned: " in s] == [
        "round 1 (attempt 1)", "round 2 (attempt 1)"]
    # one device gone before its masked input: the goal's 3 inputs and one more in each sum
    assert [m["clients"] for m in run.metrics] == [4, 4]
    assert [m["aggregation"]["survivors"] for m in run.metrics] == [4, 4]
    assert [len(e["devices"]) for e in lines(tmp_path / "run" / "participation.jsonl")] == [4, 4]


def test_a_round_that_always_aborts_stops_the_run_with_one_error(tmp_path):
    said = []  # every device vanishes before its first SecAgg message, in every attempt
    with pytest.raises(DpfleetError, match=r"^round 1 was abandoned 10 times in a row \(secure "
                                           r"aggregation aborted: .*\); raise service.overselect or "
                                           r"lower devices.dropout_secagg$"):
        run_simulation(tiny_cfg(**SECAGG, devices={"dropout_secagg": 1.0}), tmp_path / "run",
                       progress=False, log=said.append)
    assert sum(" abandoned: " in s for s in said) == 10
    releases = tmp_path / "run" / "releases.jsonl"
    assert not releases.is_file() or not lines(releases)  # nothing released


def test_each_over_selection_key_is_refused_where_it_would_be_ignored(tmp_path):
    """Timer-mode `simulate` and `serve` select the same devices: `service.overselect` (every
    assigned device stays in the round) would be ignored by simulate's timer rounds, and
    `participation.over_selection` (simulate's race to the goal) by serve, so each is one error."""
    timer = {"mode": "timer", "timer_period": 0.25}
    with pytest.raises(DpfleetError, match=r"^service.overselect adds devices to serve's rounds; "
                                           r"simulate's timer mode over-selects with "
                                           r"participation.over_selection"):
        run_simulation(tiny_cfg(participation=timer, service={"overselect": 0.3}), tmp_path / "run",
                       progress=False, log=lambda s: None)
    assert not (tmp_path / "run").exists()  # refused before the run directory is made
    with pytest.raises(DpfleetError, match=r"^participation.over_selection races simulated finishing "
                                           r"times .* over-select with service.overselect$"):
        check_service_config(tiny_cfg(participation={**timer, "over_selection": 1.5}))
    check_service_config(tiny_cfg(participation=timer))  # the goal exactly: both select 3
