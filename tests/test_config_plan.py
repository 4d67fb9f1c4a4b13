"""dp.target_epsilon: `simulate` takes the planner's choice (coordinator/run_privacy/config_plan.py).

Scored on the values: the run's report goal, z, mechanism and participation limits are the ones
the planner computes independently for the run's population and rounds; the participation log
obeys them; the accounted eps is within the target; a config that states a planned key
differently is refused (one error line) instead of silently running something else."""

import json

import numpy as np
import pytest
from test_noise_secrecy import CFG as SECRECY_CFG
from test_noise_secrecy import QUIET

from dpfleet.cli import main
from dpfleet.coordinator.accounting.planner import make_plan, mechanism_rows, pick_mechanism
from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.run_privacy.config_plan import read_run_config
from dpfleet.coordinator.serve_plan import check_service_config
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError

TARGET, ROUNDS = 8.0, 6
CFG = {**SECRECY_CFG, "rounds": ROUNDS, "eval_every": ROUNDS,
       "dp": {**{k: v for k, v in SECRECY_CFG["dp"].items() if k not in ("noise_multiplier", "report_goal")},
              "target_epsilon": TARGET, "mechanism": "auto"}}


def planned_run(tmp_path, values=CFG, name="run"):
    return simulation.run_simulation(parse_config(values), tmp_path / name, **QUIET)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One planned run of CFG, read by the tests that only look at its plan, config and logs."""
    return planned_run(tmp_path_factory.mktemp("planned"))


def test_run_takes_the_planners_choice_and_keeps_it(planned):
    result = planned
    plan = json.loads((result.run_dir / "plan.json").read_text())
    n = plan["population"]
    rho = zcdp_for_epsilon(TARGET, 1e-6)  # dp.delta's default
    expected = make_plan(n, ROUNDS, rho).chosen
    best = pick_mechanism(mechanism_rows(expected, ROUNDS, rho))
    config = json.loads((result.run_dir / "config.json").read_text())
    assert n == CFG["data"]["max_clients"]  # the training population, known only once data is split
    assert (config["dp"]["report_goal"], config["participation"]["min_separation"],
            config["participation"]["max_participation"]) == (
        expected.report_goal, expected.min_separation, expected.max_participation)
    assert config["dp"]["mechanism"] == best.mechanism == plan["chosen"]["mechanism"]
    assert config["dp"]["noise_multiplier"] == pytest.approx(best.noise_multiplier, rel=1e-12)
    assert config["participation"]["mode"] == "uniform"
    # the guard enforced the plan, and the accountant (which reads the log) stays within the target
    rounds_of = {}
    for line in (result.run_dir / "participation.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert len(rec["devices"]) == expected.report_goal
        for c in rec["devices"]:
            rounds_of.setdefault(c, []).append(rec["round"])
    assert max(map(len, rounds_of.values())) <= expected.max_participation
    gaps = [b - a - 1 for r in rounds_of.values() for a, b in zip(r, r[1:], strict=False)]
    assert gaps and min(gaps) >= expected.min_separation
    assert result.privacy["epsilon"] <= TARGET * (1 + 1e-6)
    assert result.privacy["epsilon"] > 0.5 * TARGET  # the plan spends the budget, not a sliver


def test_stating_the_planned_values_runs_and_resume_replans_the_same(planned, tmp_path):
    first = planned
    config = json.loads((first.run_dir / "config.json").read_text())
    stated = {**CFG, "dp": {**CFG["dp"], "report_goal": config["dp"]["report_goal"],
                            "noise_multiplier": config["dp"]["noise_multiplier"],
                            "mechanism": config["dp"]["mechanism"]},
              "participation": {k: config["participation"][k]
                                for k in ("mode", "min_separation", "max_participation")}}
    second = planned_run(tmp_path, stated, name="b")
    assert json.loads((second.run_dir / "plan.json").read_text())["chosen"] == \
        json.loads((first.run_dir / "plan.json").read_text())["chosen"]
    # the run's own config.json (the plan written in) parses and re-plans to itself
    _, again = read_run_config(config)
    assert again.given["dp.report_goal"] == config["dp"]["report_goal"]
    assert again.binding == config["mechanism"]  # its mechanism pin, kept beside the config


def test_a_stated_key_must_agree_with_the_plan(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(to_toml({**CFG, "dp": {**CFG["dp"], "report_goal": 5}}))
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(path), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert "dp.report_goal = 5" in err[0] and "dp.target_epsilon = 8" in err[0]
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("values, message", [
    ({**SECRECY_CFG, "dp": {**SECRECY_CFG["dp"], "mechanism": "auto"}}, "needs dp.target_epsilon"),
    ({**CFG, "dp": {**CFG["dp"], "target_epsilon": -1.0}}, "dp.target_epsilon must be >= 0"),
])
def test_bad_plan_keys_are_one_error(values, message):
    with pytest.raises(DpfleetError, match=message):
        parse_config(values)


def test_service_takes_a_target_it_plans_at_boot():
    """`service serve` plans dp.target_epsilon itself (tests/test_service_plan.py)."""
    cfg = parse_config({**CFG, "dp": {**CFG["dp"], "mechanism": "tree"}})
    check_service_config(cfg)  # no refusal


@pytest.mark.slow
def test_a_planned_run_resumes_through_the_cli_to_the_same_model(tmp_path, capsys):
    from crashes import Crash
    from safetensors.numpy import load_file
    from test_resume import crash_before

    values = {**CFG, "checkpoint_every": 2, "dp": {**CFG["dp"], "noise_seed": 3}}
    whole = planned_run(tmp_path, values, name="whole")
    cut = tmp_path / "cut"
    with pytest.raises(Crash):
        simulation.run_simulation(parse_config(values), cut, before_round=crash_before(4), **QUIET)
    plan = (cut / "plan.json").read_text()
    main(["simulate", "--resume", str(cut), "--quiet"])
    assert "resuming after round 4" in capsys.readouterr().out
    assert (cut / "plan.json").read_text() == plan  # planned once, re-planned to the same on resume
    released = [load_file(str(d / "checkpoint" / "server_state.safetensors"))["theta"]
                for d in (whole.run_dir, cut)]
    np.testing.assert_array_equal(*released)
