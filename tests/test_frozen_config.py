"""The config is a leaf: frozen, validated once per command, the planner's choices and a run's
mechanism pin kept beside it (`config_plan.RunPlan`), never attached to it.

Scored on behaviour: setting a field of a parsed config (or attaching a new attribute) is an
error; one `dpfleet simulate` call runs the config checks once; the config.json a run writes is
byte-for-byte what the mutable config wrote for the same input (its sha256 recorded from the
code before the config was frozen)."""

import dataclasses
import hashlib

import pytest
from test_config_plan import CFG as PLANNED_CFG
from test_noise_secrecy import CFG

from dpfleet.cli import main
from dpfleet.coordinator import config as config_module
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.state.run_dir import to_toml

TINY = {**CFG, "rounds": 2, "eval_every": 2, "checkpoint_every": 0,
        "data": {**CFG["data"], "max_clients": 20}}


def test_a_parsed_config_cannot_be_changed_or_given_attributes():
    cfg = parse_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rounds = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dp.noise_multiplier = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.planned_given = {}  # what the parser used to attach
    assert not hasattr(cfg, "planned_given") and not hasattr(cfg, "mechanism_binding")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """One `dpfleet simulate` of a tiny planned config (--rounds, --seed and --debug-nonprivate
    given on the command line too), with the config checks counted."""
    tmp = tmp_path_factory.mktemp("frozen")
    path = tmp / "tiny.toml"
    # keyboard_words at its default: the config.json hash below was recorded with it
    path.write_text(to_toml({**PLANNED_CFG, "rounds": 3, "eval_every": 2, "checkpoint_every": 0,
                             "data": {**PLANNED_CFG["data"], "max_clients": 20, "keyboard_words": 30}}))
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        checks = config_module.missing_extras
        mp.setattr(config_module, "missing_extras", lambda cfg: calls.append(cfg) or checks(cfg))
        main(["simulate", str(path), "--out", str(tmp / "run"), "--quiet", "--rounds", "2",
              "--seed", "3", "--debug-nonprivate"])
    return tmp / "run", calls


def test_simulate_validates_the_stated_config_once_and_the_planned_one_once(simulated):
    _, calls = simulated
    # the stated config (at parse), and the planner's config once the population is known: two
    # configs, each checked once (before: the stated one three times, the planned one once)
    assert len(calls) == 2
    stated, planned = calls
    assert (stated.rounds, stated.seed, stated.debug_nonprivate) == (2, 3, True)
    assert stated.dp.noise == planned.dp.noise == "gaussian"  # "auto" resolved at parse
    assert planned.participation.mode == "uniform" and stated.participation.mode == "disjoint"


def test_simulate_validates_an_unplanned_config_once(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(to_toml(TINY))
    calls = []
    checks = config_module.missing_extras
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config_module, "missing_extras", lambda cfg: calls.append(cfg) or checks(cfg))
        main(["simulate", str(path), "--out", str(tmp_path / "run"), "--quiet", "--rounds", "1"])
    assert len(calls) == 1 and calls[0].rounds == 1  # before: 3 (parse, the CLI, `run`)


def test_config_json_is_byte_identical_to_the_mutable_configs(simulated):
    run, _ = simulated
    data = (run / "config.json").read_bytes()
    # recorded from main (b7f5f6b) before the config was frozen (8ad6a661...), then re-recorded
    # after a diff of the two files showed only these changes: [devices] took the device keys of
    # [participation] and [fleet], aggregation.dropout became devices.dropout_secagg, and
    # client.precision's default is "auto"; a new config key changes it
    assert hashlib.sha256(data).hexdigest() == EXPECTED_CONFIG_JSON_SHA256, data.decode()


EXPECTED_CONFIG_JSON_SHA256 = "8d2ce7a0561ce9282374422b9ca9e991f571e49fd80ac6fe366073ade7c30915"


def test_the_plan_makes_a_new_config_and_keeps_its_choice_beside_it():
    from dpfleet.coordinator.run_privacy.config_plan import (
        apply_run_plan,
        make_run_plan,
        planned_values,
        read_run_config,
    )

    values = {**PLANNED_CFG, "dp": {**PLANNED_CFG["dp"], "mechanism": "tree"}}
    cfg, plan = read_run_config(values)
    assert plan.given == {"dp.mechanism": "tree"} and plan.record is None and plan.chosen == {}
    record = make_run_plan(cfg, 40)
    planned, kept = apply_run_plan(cfg, plan, record)
    assert (cfg.participation.mode, planned.participation.mode) == ("disjoint", "uniform")
    assert planned.dp.report_goal == record["chosen"]["report_goal"] != cfg.dp.report_goal
    assert kept.chosen == planned_values(record) and kept.given == plan.given
    assert plan.record is None  # the stated plan is not changed either
