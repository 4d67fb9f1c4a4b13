"""`service serve` with dp.target_epsilon: the first start plans for the service's training
clients exactly as `simulate` plans (same planner code, same plan.json, same `plan:` line),
a restart applies the kept plan.json (never a new plan), and a restart whose config changes the
target is refused in one line before the state is touched. Also boot's start line: `starting:
round 1 of N` on a fresh state, `continuing after round k of N` on a restart after k rounds."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import TINY, fleet_data, run_devices
from test_service_admin import wait_for

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.run_privacy import config_plan
from dpfleet.coordinator.run_privacy.config_plan import planned_values, read_run_config
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError
from dpfleet.service.boot import boot
from dpfleet.service.server import shutdown, start

ROUNDS = 3
# TINY without the keys the planner chooses and without research-mode noise (serve refuses it)
VALUES = {**TINY, "rounds": ROUNDS, "eval_every": ROUNDS,
          "dp": {**{k: v for k, v in TINY["dp"].items()
                    if k not in ("noise_multiplier", "report_goal", "noise_seed")},
                 "target_epsilon": 8.0, "mechanism": "auto"},
          "participation": {}}
PLANNED = [("dp", "report_goal"), ("dp", "noise_multiplier"), ("dp", "mechanism"),
           ("participation", "mode"), ("participation", "min_separation"),
           ("participation", "max_participation")]


def planned(values=VALUES):
    return parse_config(json.loads(json.dumps(values)))


def planned_with_given(values=VALUES):
    """The config and what it states beside its settings (the planned keys the plan must agree with)."""
    return read_run_config(json.loads(json.dumps(values)))


def plan_lines(lines):
    return [s for s in lines if s.startswith("plan:")]


def booted_once(state, values=VALUES):
    lines = []
    cfg, plan = planned_with_given(values)
    booted = boot(cfg, state, log=lines.append, plan=plan)
    booted.store.close()
    return booted, lines


@pytest.mark.slow
def test_serve_plans_what_simulate_plans(tmp_path):
    sim_lines = []
    simulation.run_simulation(planned(), tmp_path / "sim", progress=False, log=sim_lines.append)
    booted, lines = booted_once(tmp_path / "state")
    state = tmp_path / "state"

    sim_plan = json.loads((tmp_path / "sim" / "plan.json").read_text())
    served_plan = json.loads((state / "plan.json").read_text())
    assert served_plan == sim_plan  # population, target, chosen goal / MinS / MaxP / mechanism / z
    assert served_plan["population"] == len(booted.users) == 8
    assert plan_lines(lines) == plan_lines(sim_lines) and len(plan_lines(lines)) == 1
    # the engine runs the plan, and the state's config.json says so, as simulate's does
    chosen = planned_values(served_plan)
    sim_config = json.loads((tmp_path / "sim" / "config.json").read_text())
    served_config = json.loads((state / "config.json").read_text())
    for section, key in PLANNED:
        value = getattr(getattr(booted.cfg, section), key)
        assert value == chosen[f"{section}.{key}"] == served_config[section][key] \
            == sim_config[section][key]
    assert booted.cfg.dp.mechanism != "auto" and booted.cfg.participation.mode == "uniform"
    assert lines[-1].endswith(f"; starting: round 1 of {ROUNDS}"), lines[-1]


def served_some_rounds(tmp_path) -> tuple:
    """A planned coordinator stopped after >= 1 committed round: (state, committed, its lines)."""
    state = tmp_path / "state"
    cfg = planned()
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    first_lines = []

    async def first_start():
        running = await start(cfg, state, log=first_lines.append)
        stop = asyncio.Event()
        devices = asyncio.create_task(run_devices(running.url, keys, examples, stop=stop))
        await wait_for(lambda: running.driver.store.last_committed() >= 1)
        running.driver.stop()
        await asyncio.wait_for(asyncio.shield(running.task), 90)
        committed = running.driver.store.last_committed()
        await shutdown(running)
        stop.set()
        await asyncio.wait_for(devices, 90)
        return committed

    committed = asyncio.run(first_start())
    assert 1 <= committed < ROUNDS
    return state, committed, first_lines


@pytest.fixture(scope="module")
def served_once(tmp_path_factory):
    return served_some_rounds(tmp_path_factory.mktemp("served"))


@pytest.fixture
def served(served_once, tmp_path):
    """`served_some_rounds`, once for the module: each test restarts (or edits) its own copy of
    the stopped coordinator's state directory (modes kept)."""
    state, committed, first_lines = served_once
    return Path(shutil.copytree(state, tmp_path / "state", symlinks=True)), committed, list(first_lines)


def test_a_restart_keeps_the_plan_and_says_where_it_continues(served, monkeypatch):
    state, committed, first_lines = served
    plan = (state / "plan.json").read_bytes()
    config = (state / "config.json").read_bytes()

    def no_new_plan(*args, **kwargs):
        raise AssertionError("a restart planned again")

    monkeypatch.setattr(config_plan, "make_run_plan", no_new_plan)
    booted, lines = booted_once(state)
    assert (state / "plan.json").read_bytes() == plan
    assert (state / "config.json").read_bytes() == config
    assert plan_lines(lines) == plan_lines(first_lines) and len(plan_lines(lines)) == 1
    chosen = planned_values(json.loads(plan))
    for section, key in PLANNED:
        assert getattr(getattr(booted.cfg, section), key) == chosen[f"{section}.{key}"]
    assert lines[-1].endswith(f"; continuing after round {committed} of {ROUNDS}"), lines[-1]
    assert any(s.endswith(f"; starting: round 1 of {ROUNDS}") for s in first_lines)


@pytest.mark.parametrize("key,factor", [("noise_multiplier", 4.0), ("report_goal", 2),
                                        ("max_participation", 2)])
def test_attack_an_edited_plan_is_refused_on_restart(served, key, factor):
    """The operator's edit between two starts: plan.json's noise multiplier raised (the rounds
    already released had less noise, so the accountant would claim too little eps for them), or
    its report goal / MaxP changed. The restart must not run (nor account) another plan."""
    state, committed, _ = served
    record = json.loads((state / "plan.json").read_text())
    before = record["chosen"][key]
    record["chosen"][key] = before * factor
    (state / "plan.json").write_text(json.dumps(record))
    with pytest.raises(DpfleetError, match="plan"):
        booted, _ = booted_once(state)
        # had it booted, this is what it would run: the edited value, not the one released with
        pytest.fail(f"restarted with {key} {getattr(booted.cfg.dp, key, None)} (released: {before})")


def test_a_restart_with_another_target_is_one_error(tmp_path, capsys):
    state = tmp_path / "state"
    booted_once(state)
    plan = (state / "plan.json").read_bytes()
    other = {**VALUES, "dp": {**VALUES["dp"], "target_epsilon": 4.0}}
    with pytest.raises(DpfleetError, match="a restart never re-plans"):
        boot(planned(other), state, log=lambda s: None)
    config = tmp_path / "other.toml"
    config.write_text(to_toml(other))
    with pytest.raises(SystemExit) as exit_:
        main(["service", "serve", str(config), "--state", str(state)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "target_epsilon 8.0 -> 4.0" in err
    assert (state / "plan.json").read_bytes() == plan  # nothing re-planned or rewritten
    # dropping the target (stating values by hand) on a planned state is refused the same way
    with pytest.raises(DpfleetError, match="a restart never re-plans"):
        boot(parse_config({**TINY, "rounds": ROUNDS, "eval_every": ROUNDS}), state, log=lambda s: None)


def test_a_stated_key_the_plan_contradicts_is_refused_at_the_first_start(tmp_path):
    values = {**VALUES, "dp": {**VALUES["dp"], "report_goal": 1}}
    cfg, plan = planned_with_given(values)
    with pytest.raises(DpfleetError, match="config states dp.report_goal = 1"):
        boot(cfg, tmp_path / "state", log=lambda s: None, plan=plan)
    assert not (tmp_path / "state" / "plan.json").exists()


def test_with_over_selection_serve_plans_for_the_fleet_shrunk_by_it(tmp_path):
    """The service assigns report_goal (1 + overselect) devices a round, the planner sizes MinS /
    MaxP for report_goal a round out of N: so it plans for N / (1 + overselect) devices (a fleet
    planned for all its devices stopped at round 3 of 10 when over-selected rounds used them up)."""
    values = {**VALUES, "service": {**VALUES.get("service", {}), "overselect": 0.3}}
    booted, lines = booted_once(tmp_path / "state", values)
    plan = json.loads((tmp_path / "state" / "plan.json").read_text())
    assert len(booted.users) == 8 and plan["population"] == 6  # floor(8 / 1.3)
    assert plan == config_plan.make_run_plan(planned(values), 6)
    assert any("over-selection 0.3: planned for N = 6" in s for s in lines)
    # a restart applies the kept plan for the same shrunk population, never a new one
    again, lines = booted_once(tmp_path / "state", values)
    again.store.close()
    assert json.loads((tmp_path / "state" / "plan.json").read_text()) == plan
    assert again.cfg.dp.report_goal == plan["chosen"]["report_goal"]
